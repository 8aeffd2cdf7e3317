"""The launcher's library half: configs, graph building, datasets, models, fault injection.

``import slim_nanguard`` is the guard and does not import this subpackage. The launchers in
``scripts/`` turn their flags into a `TrainConfig` or `EvalConfig` and call `run_training` or
`run_eval`; tests call the same functions with no flags involved. The modules, by what they
hold:

* `config`: `TrainConfig`, `EvalConfig`, `LaunchError` and the checks of every setting.
* `checkpoints`: finding a checkpoint, checking it fits the model, fine-tuning from it.
* `build`: the training graph (dataset, model, loss, learning rate, optimizer, guard).
* `train`: `run_training`; `evaluate`: `run_eval`; `report`: what the launchers print.
* `launcher`: `train_and_evaluate`, what one ``slim-nanguard-train`` run does.
* `cluster`: the ps/worker cluster flags and a task's part in the cluster.
* `datasets`, `models`: one spec per dataset and per model (`DATASETS`, `MODELS`).
* `faults`: fault injection (``--inject_fault``).
* `preflight`: the launcher's checks that need no TensorFlow (standard library only).
* `benchmarking`: the benchmark harness of ``slim-nanguard-benchmark`` (imported on its own).
* `plot`: the run's plot of ``slim-nanguard-autopsy --plot`` (imported on its own).
"""

from slim_nanguard.app.checkpoints import resolve_checkpoint
from slim_nanguard.app.config import DECAY_TYPES
from slim_nanguard.app.config import DEFAULT_GUARD
from slim_nanguard.app.config import GUARD_FLAGS
from slim_nanguard.app.config import NO_SPIKE_TEST
from slim_nanguard.app.config import OPTIMIZERS
from slim_nanguard.app.config import PERSISTENT_POLICIES
from slim_nanguard.app.config import REASONS_FLAG
from slim_nanguard.app.config import SPIKE_POLICIES
from slim_nanguard.app.config import EvalConfig
from slim_nanguard.app.config import LaunchError
from slim_nanguard.app.config import TrainConfig
from slim_nanguard.app.evaluate import EvalResult
from slim_nanguard.app.evaluate import check_eval_dataset
from slim_nanguard.app.evaluate import run_eval
from slim_nanguard.app.launcher import EXIT_DISK_FULL
from slim_nanguard.app.launcher import train_and_evaluate
from slim_nanguard.app.report import describe_training
from slim_nanguard.app.report import error_message
from slim_nanguard.app.train import run_training

__all__ = [
    "DECAY_TYPES",
    "EXIT_DISK_FULL",
    "DEFAULT_GUARD",
    "GUARD_FLAGS",
    "NO_SPIKE_TEST",
    "REASONS_FLAG",
    "OPTIMIZERS",
    "PERSISTENT_POLICIES",
    "SPIKE_POLICIES",
    "EvalConfig",
    "EvalResult",
    "LaunchError",
    "TrainConfig",
    "check_eval_dataset",
    "describe_training",
    "error_message",
    "resolve_checkpoint",
    "run_eval",
    "run_training",
    "train_and_evaluate",
]
