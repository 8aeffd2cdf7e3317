"""The launcher's library half: configs, graph building, datasets, models, fault injection.

``import slim_nanguard`` is the guard and does not import this subpackage; the launchers in
``scripts/`` (``slim-nanguard-train``, ``-eval``, ``-benchmark``) do.
"""
