"""The guard's closed vocabularies (`str` enums) and the types its functions take.

This module imports nothing of the package, nor TensorFlow.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Callable, Dict, Union

if TYPE_CHECKING:  # pragma: no cover
    import tensorflow as tf


class _StrEnum(str, enum.Enum):
    """A `str` enum: a member equals, formats, prints and serializes to JSON as its value
    (``Action.SKIP == "skip"``, ``repr``: ``'skip'``) on any Python."""

    __str__ = str.__str__
    __repr__ = str.__repr__
    __format__ = str.__format__


class Action(_StrEnum):
    """What is done about a bad step: the policies (rule in `_policy.decide`, effect in
    `_actions.carry_out`)."""

    RAISE = "raise"
    STOP = "stop"
    SKIP = "skip"
    ROLLBACK = "rollback"
    AUTO = "auto"  # nan_policy only: the triage's verdict chooses skip or rollback


class Mode(_StrEnum):
    """How a guarded train op reports a bad step."""

    CHECK_NUMERICS = "check_numerics"  # the run raises the check's InvalidArgumentError
    HOOK = "hook"  # the run returns; NanLossHook (or train_step) reads the verdict


class StopReason(_StrEnum):
    """Why `slim_nanguard.train` ended (`TrainResult.stop_reason`)."""

    STEP_LIMIT = "step_limit"
    POLICY = "nan_policy_stop"  # the stop policy, or persistent_nan_policy="stop"
    INTERRUPTED = "interrupted"  # Ctrl-C
    TERMINATED = "terminated"  # SIGTERM
    END_OF_DATA = "end_of_data"
    REQUESTED = "stop_requested"  # a hook asked
    CLUSTER_STOP = "cluster_stop"  # another worker of the cluster stopped (its stop policy)
    NAN_ERROR = "nan_error"  # training gave up with NanLossError (event record only)
    DISK_FULL = "disk_full"  # the disk filled up: DiskFullError (its result, the record)


class Cause(_StrEnum):
    """Why training gave up: `NanLossError.cause`."""

    POLICY = "policy"  # the policy (or the hook's override, or on_nan) said raise
    MAX_CONSECUTIVE_BAD_STEPS = "max_consecutive_bad_steps"  # escalation to raise
    MAX_ROLLBACKS = "max_rollbacks"  # a rollback past max_rollbacks
    UNGUARDED_LOSS = "unguarded_loss"  # NanLossHook on a loss no guarded train op made
    DIVERGENCE = "divergence"  # a spike on the probation of a new level: it was a divergence


class Fault(_StrEnum):
    """What made a step bad: `NanEvent.cause`."""

    NON_FINITE = "non_finite"  # NaN or Inf in the loss or a gradient
    SPIKE = "spike"  # the loss or the gradient norm far above those of the accepted steps


# A session the guard can act on: a raw session, or a MonitoredSession (whose hooks the
# guard goes around with `run_step_fn`).
SessionLike = Union["tf.compat.v1.Session", "tf.compat.v1.train.MonitoredSession"]

# Called with one record (a JSON-ready dict with a "kind" key) per bad step and rollback.
Listener = Callable[[Dict[str, Any]], None]

# Asks the loop to stop after this step, and returns at once (``run_context.request_stop``).
RequestStop = Callable[[], None]
