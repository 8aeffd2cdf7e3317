"""slim_nanguard: keeps TF-Slim training alive and honest when the loss or gradients turn NaN/Inf.

Replace ``slim.learning.create_train_op(...)`` with ``slim_nanguard.create_train_op(...)``: a
step whose loss or any gradient is NaN or Inf then changes no variable, and the policy you
chose (raise, stop, skip, rollback) decides what happens next.

`__all__` is the public API (docs/api.md says what each name is for), with five public
modules, each described by its docstring: `autopsy`, `cluster`, `compat`, `quarantine` and
`storage`.
Modules whose names begin with an underscore are private.
"""

from slim_nanguard import _spike  # noqa: F401  (the spike test GuardConfig.all_reasons makes)
from slim_nanguard import autopsy
from slim_nanguard import cluster
from slim_nanguard import compat
from slim_nanguard import quarantine
from slim_nanguard import storage
from slim_nanguard._checkpoints import FiniteSaver
from slim_nanguard._checkpoints import latest_good_checkpoint
from slim_nanguard._checkpoints import non_finite_variables
from slim_nanguard._errors import CheckpointNotFoundError
from slim_nanguard._errors import DiskFullError
from slim_nanguard._errors import NanGuardError
from slim_nanguard._errors import NanLossError
from slim_nanguard._errors import NonFiniteCheckpointError
from slim_nanguard._errors import UnreadableCheckpointError
from slim_nanguard._guard import get_guard
from slim_nanguard._guard import is_numerics_error
from slim_nanguard._hook import NanLossHook
from slim_nanguard._hook import nan_hook
from slim_nanguard._loop import TrainResult
from slim_nanguard._loop import train
from slim_nanguard._nan_event import NanEvent
from slim_nanguard._policy import GuardConfig
from slim_nanguard._reasons import Reason
from slim_nanguard._reasons import StepValues
from slim_nanguard._reasons import Test
from slim_nanguard._recorders import read_events
from slim_nanguard._steps import handle_numerics_error
from slim_nanguard._steps import make_train_step
from slim_nanguard._steps import train_step
from slim_nanguard._train_op import create_train_op
from slim_nanguard._types import Action
from slim_nanguard._types import Cause
from slim_nanguard._types import Fault
from slim_nanguard._types import Mode
from slim_nanguard._types import StopReason

__version__ = "0.1.0"

# The migration of a TF-Slim script is the import and the changed call: slim.batch_norm and the
# tf_slim.nets must work without a separate compat.install() (idempotent; quiet at import).
compat.install()

__all__ = [
    # Building the guarded train op, and its settings.
    "create_train_op",
    "GuardConfig",
    "Reason",
    "StepValues",
    "Test",
    # Applying the policy: the loop, tf-slim's loops, your own loop.
    "train",
    "TrainResult",
    "train_step",
    "make_train_step",
    "NanLossHook",
    "nan_hook",
    "handle_numerics_error",
    "is_numerics_error",
    "get_guard",
    # What a bad step leaves behind.
    "NanEvent",
    "read_events",
    "FiniteSaver",
    "latest_good_checkpoint",
    "non_finite_variables",
    # Errors.
    "NanGuardError",
    "NanLossError",
    "NonFiniteCheckpointError",
    "CheckpointNotFoundError",
    "UnreadableCheckpointError",
    "DiskFullError",
    # The vocabularies (str enums: each member equals its value).
    "Action",
    "Cause",
    "Fault",
    "Mode",
    "StopReason",
    # The public modules.
    "autopsy",
    "cluster",
    "compat",
    "quarantine",
    "storage",
]
