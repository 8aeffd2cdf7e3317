"""Error types of slim_nanguard: every error it raises on purpose derives from `NanGuardError`;
`NanLossError` also from `NanLossDuringTrainingError` (what TensorFlow's `NanTensorHook` raises)."""

from __future__ import annotations

import errno
import re
from typing import TYPE_CHECKING, Optional

import tensorflow as tf

from slim_nanguard._types import Cause

if TYPE_CHECKING:  # pragma: no cover
    from slim_nanguard._nan_event import NanEvent


# How the message of the guard's check opens (check_numerics mode).
REJECTED = "slim_nanguard rejected the step"
# How the advice that follows it opens (`caught_numerics_error` rewrites it).
LOOP_ADVICE = "A loop applies"
# That advice, up to what CheckNumerics appends (" : Tensor had NaN values"), the bracket an
# Assert's message closes with, or the line's end.
_ADVICE = re.compile(re.escape(LOOP_ADVICE) + r"[^\n]*?(?= : Tensor had|\]?\n|\]?$)")
_CAUGHT = (
    "slim_nanguard caught this error and applied the policy; the NanLossError raised from it "
    "says what was done and why training gave up"
)


class NanGuardError(Exception):
    """Base class of every error slim_nanguard raises on purpose."""


class NanLossError(NanGuardError, tf.compat.v1.train.NanLossDuringTrainingError):
    """Training gave up on a bad step (NaN or Inf, or a rejected finite step such as a spike).

    The message names the global step, the loss and the variables whose gradients were not
    finite (for a spike, its values and how far above the usual they were).

    Attributes:
      event: The `NanEvent` of the step that made training give up, or None.
      reason: Why training gave up, as a sentence.
      cause: Why training gave up, as a `Cause` to branch on, or None. After
        ``UNGUARDED_LOSS`` (a `NanLossHook` on a loss no guarded train op made) the bad
        update may have happened.
      limit: The bound ``cause`` names (``max_consecutive_bad_steps`` or ``max_rollbacks``),
        else None.
      checkpoint: The checkpoint of the last accepted step the loop saved before raising
        (`slim_nanguard.train` does), else None.
      climb: The global step from which the accepted steps before the bad one were climbing
        (`checkpoint` is then no good state), else None.
      resume_from: With `climb`: the newest checkpoint from before it, None if none is kept.
    """

    def __init__(
        self,
        event: Optional["NanEvent"] = None,
        reason: str = "",
        cause: Optional[Cause] = None,
        limit: Optional[int] = None,
    ):
        self.event = event
        self.reason = reason
        self.cause = None if cause is None else Cause(cause)
        self.limit = limit
        self.checkpoint: Optional[str] = None
        self.climb: Optional[int] = None
        self.resume_from: Optional[str] = None
        super().__init__(str(self))

    def __reduce__(self):
        # Rebuilt from its fields, not its message: a pickled error reads the same.
        return (
            type(self),
            (self.event, self.reason, self.cause, self.limit),
            {"checkpoint": self.checkpoint, "climb": self.climb, "resume_from": self.resume_from},
        )

    def __str__(self) -> str:
        reason = getattr(self.event, "reason", None)
        what = reason.what[:1].upper() + reason.what[1:] if reason else "NaN or Inf"
        autopsy = getattr(self.event, "autopsy", None)
        climb = self.climb is not None and climb_advice(
            self.climb, self.resume_from, f"{self.policy_name}="
        )
        parts = [self.event and self.event.describe(), self.reason, climb]
        parts.append(autopsy and autopsy.describe())
        details = "; ".join(filter(None, parts))
        return f"{what} during training" + (f": {details}" if details else ".")

    @property
    def policy_name(self) -> str:
        """The setting that chose to give up (`policy_name`)."""
        escalated = self.cause in (Cause.MAX_CONSECUTIVE_BAD_STEPS, Cause.DIVERGENCE)
        return policy_name(self.event, escalated)


def policy_name(event: Optional["NanEvent"], escalated: bool) -> str:
    """The setting that chose the action on `event`'s bad step: ``persistent_nan_policy`` if it
    `escalated`, else the policy of the reason that rejected the step (``nan_policy``: NaN)."""
    reason = getattr(event, "reason", None)
    return "persistent_nan_policy" if escalated else getattr(reason, "policy_name", "nan_policy")


class NonFiniteCheckpointError(NanGuardError):
    """A checkpoint (or a model about to be trained) holds NaN or Inf values."""


class CheckpointNotFoundError(NanGuardError):
    """A rollback or a resume needs a good checkpoint and none can be found."""


class DiskFullError(NanGuardError):
    """The disk filled up (ENOSPC, chained) as `train` wrote; the run ended as a stop does.

    Attributes:
      result: The run's `TrainResult` (``stop_reason`` ``disk_full``).
      checkpoint: The newest checkpoint whose files read (what a rerun resumes from), or None.
      recorded: Whether the stop record fitted into the event record.
    """

    def __init__(self, result, recorded: bool, cause: str):
        self.result, self.checkpoint, self.recorded = result, result.checkpoint, recorded
        self._cause = cause
        where = self.checkpoint and f"the newest intact checkpoint is {self.checkpoint}"
        then = "it resumes from that checkpoint" if where else "it starts again"
        super().__init__(
            f"the disk is full ({cause}): training stopped at global step {result.global_step}"
            f"{'' if recorded else ' (no room for the stop record either)'}; "
            f"{where or 'no checkpoint was saved'}. Free space on the disk of "
            f"{result.events_path.rsplit('/', 1)[0]}, then run the same training again: {then}."
        )

    def __reduce__(self):  # Pickled by what made it (another process gets the same error).
        return type(self), (self.result, self.recorded, self._cause)


def is_disk_full(error: BaseException) -> bool:
    """Whether `error` (Python's `OSError`, TensorFlow's `OpError`) says the disk is full."""
    message = str(getattr(error, "message", "") or "")
    return getattr(error, "errno", None) == errno.ENOSPC or "No space left on device" in message


class UnreadableCheckpointError(NanGuardError):
    """A checkpoint's files are missing, cut short or garbled; the one-line message names
    the damaged file and says what to do.

    Attributes:
      checkpoint: The checkpoint prefix (``.../model.ckpt-2000``).
      file: The file found damaged or missing: its ``.index`` or one of its ``.data`` shards.
      problem: What is wrong with `file`: ``"is missing"`` or ``"is cut short or garbled"``.
      cause: The first line of the error TensorFlow raised reading it.
      advice: What to do, as a sentence.
    """

    def __init__(self, checkpoint: str, file: str, problem: str, cause: str, advice: str = ""):
        self.checkpoint = checkpoint
        self.file = file
        self.problem = problem
        self.cause = cause
        name = checkpoint.replace("\\", "/").rsplit("/", 1)[-1]
        self.advice = advice or (
            f"Restore it from a copy, or move {name}.* out of its directory to use an older "
            "checkpoint."
        )
        super().__init__(str(self))

    def __reduce__(self):
        return (type(self), (self.checkpoint, self.file, self.problem, self.cause, self.advice))

    @property
    def damage(self) -> str:
        """The message without its advice: which checkpoint, which file, what is wrong."""
        directory = self.checkpoint.replace("\\", "/").rsplit("/", 1)[0] + "/"
        file = self.file.removeprefix(directory)
        cause = self.cause.replace(directory, "")
        return f"checkpoint {self.checkpoint} cannot be read: {file} {self.problem} ({cause})"

    def __str__(self) -> str:
        return f"{self.damage}. {self.advice}"


def op_error_cause(error: BaseException) -> str:
    """The line of a TensorFlow error that says what went wrong: for a ``Graph execution
    error``, the line after ``Node: '...'``; else the first line."""
    text = getattr(error, "message", None) or str(error) or type(error).__name__
    lines = [line.strip() for line in text.splitlines() if line.strip()] or [type(error).__name__]
    if lines[0].startswith("Graph execution error"):
        node = next((i for i, line in enumerate(lines) if line.startswith("Node: ")), None)
        if node is not None:
            return (lines[node + 1 :] or lines)[0]
        noise = ("Detected at node", "File ", "[[", "Original stack")
        return next((line for line in lines[1:] if not line.startswith(noise)), lines[0])
    return lines[0]


def caught_numerics_error(error: BaseException) -> BaseException:
    """`error` (what ``session.run(train_op)`` raised) as it reads once a loop applied the
    policy: the guard's `InvalidArgumentError` copied (so `is_numerics_error` still recognises
    it) with a message that says so, for a `NanLossError` to chain to; any other error itself."""
    message = getattr(error, "message", None)
    if not isinstance(error, tf.errors.InvalidArgumentError) or REJECTED not in (message or ""):
        return error
    caught = tf.errors.InvalidArgumentError(
        error.node_def,
        error.op,
        _ADVICE.sub(_CAUGHT, message, count=1),
        error.experimental_payloads,
    )
    return caught.with_traceback(error.__traceback__)


def climb_advice(climb: int, checkpoint: Optional[str], policy: str) -> str:
    """What `raise` and `stop` say when the accepted steps before a bad step were climbing from
    global step `climb` on: `checkpoint` (None: none is kept) predates the climb, and `policy`
    (``nan_policy=``, ``--spike_policy=``: the flag of the reason that rejected the step) may
    roll back."""
    resume = (
        f"resume from {checkpoint}, the newest checkpoint from before the climb,"
        if checkpoint
        else "no checkpoint predates the climb: train again"
    )
    return (
        f"the accepted steps before the bad step were already climbing from global step {climb} "
        f"on, so the last accepted state is not a good one: {resume} with a lower learning rate, "
        f"or use {policy}rollback, which goes back before the climb"
    )
