"""absl logging that leaves Python's logging as the user set it up.

Modules import it as ``from slim_nanguard import _log as logging`` and call it as absl.logging:
same logger, levels (``absl.logging.set_verbosity`` applies) and output where a handler is
installed. Unlike absl.logging's functions, it never calls ``logging.basicConfig()`` (which
would double every TensorFlow line and void the user's own ``basicConfig()``), except for a
line below warning that the user asked absl to show when no handler exists. With no handler,
warnings and errors reach stderr through Python's last-resort handler.
"""

import functools
import logging as _logging

from absl import logging as _absl_logging

__all__ = ["batches", "error", "info", "vlog", "warning"]

_LOGGER = _absl_logging.get_absl_logger()


def _log(level: int, msg: str, *args) -> None:
    if level < _logging.WARNING and _LOGGER.isEnabledFor(level) and not _LOGGER.hasHandlers():
        _absl_logging.log(_absl_logging.converter.standard_to_absl(level), msg, *args)
    else:
        _LOGGER.log(level, msg, *args)


error = functools.partial(_log, _logging.ERROR)
warning = functools.partial(_log, _logging.WARNING)
info = functools.partial(_log, _logging.INFO)


def vlog(level: int, msg: str, *args) -> None:
    """absl.logging.vlog: verbosity `level` 1 is Python's DEBUG, each level above one lower."""
    _log(_logging.DEBUG - (level - 1), msg, *args)


def batches(count: int) -> str:
    """``'1 batch'``, ``'3 batches'``: a count of batches as a line says it."""
    return f"{count} batch" if count == 1 else f"{count} batches"


# A line's caller is the module that called these, not this file.
for _name in ("_log", "vlog"):
    _absl_logging.ABSLLogger.register_frame_to_skip(__file__, _name)
