"""slim_nanguard: keeps TF-Slim training alive and honest when the loss or gradients turn NaN/Inf.

Replace ``slim.learning.create_train_op(...)`` with ``slim_nanguard.create_train_op(...)``: a
step whose loss or any gradient is NaN or Inf then changes no variable, and the policy you
chose (raise, stop, skip, rollback) decides what happens next.
"""

from slim_nanguard import compat
from slim_nanguard._actions import Outcome
from slim_nanguard._autopsy import Autopsy
from slim_nanguard._checkpoints import FiniteSaver
from slim_nanguard._checkpoints import latest_good_checkpoint
from slim_nanguard._checkpoints import non_finite_variables
from slim_nanguard._errors import CheckpointNotFoundError
from slim_nanguard._errors import NanGuardError
from slim_nanguard._errors import NanLossError
from slim_nanguard._errors import NonFiniteCheckpointError
from slim_nanguard._events import NanEvent
from slim_nanguard._guard import Guard
from slim_nanguard._guard import GuardState
from slim_nanguard._guard import get_guard
from slim_nanguard._guard import is_numerics_error
from slim_nanguard._hook import NanLossHook
from slim_nanguard._hook import nan_hook
from slim_nanguard._loop import TrainResult
from slim_nanguard._loop import train
from slim_nanguard._parity import add_gradients_summaries
from slim_nanguard._parity import clip_gradient_norms
from slim_nanguard._parity import multiply_gradients
from slim_nanguard._policy import PERSISTENT_POLICIES
from slim_nanguard._policy import POLICIES
from slim_nanguard._policy import GuardConfig
from slim_nanguard._policy import OnNanCallback
from slim_nanguard._record import EVENTS_FILENAME
from slim_nanguard._record import EventRecorder
from slim_nanguard._record import read_events
from slim_nanguard._steps import handle_numerics_error
from slim_nanguard._steps import make_train_step
from slim_nanguard._steps import train_step
from slim_nanguard._train_op import create_train_op
from slim_nanguard._types import Action
from slim_nanguard._types import Cause
from slim_nanguard._types import Mode
from slim_nanguard._types import StopReason

__version__ = "0.1.0"

# The migration of a TF-Slim script is the import and the changed call: slim.batch_norm and the
# tf_slim.nets must work without a separate compat.install() (idempotent; quiet at import).
compat.install()

__all__ = [
    "EVENTS_FILENAME",
    "Action",
    "Autopsy",
    "Cause",
    "CheckpointNotFoundError",
    "EventRecorder",
    "FiniteSaver",
    "Guard",
    "GuardConfig",
    "GuardState",
    "Mode",
    "NanEvent",
    "NanGuardError",
    "NanLossError",
    "NanLossHook",
    "NonFiniteCheckpointError",
    "OnNanCallback",
    "Outcome",
    "PERSISTENT_POLICIES",
    "POLICIES",
    "StopReason",
    "TrainResult",
    "add_gradients_summaries",
    "clip_gradient_norms",
    "compat",
    "create_train_op",
    "get_guard",
    "handle_numerics_error",
    "is_numerics_error",
    "latest_good_checkpoint",
    "make_train_step",
    "multiply_gradients",
    "nan_hook",
    "non_finite_variables",
    "read_events",
    "train",
    "train_step",
]
