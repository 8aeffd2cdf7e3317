"""Recovery policies: what happens after a step whose loss or gradients were not finite.

The same names mean the same thing in both modes (check_numerics and hook):

* ``raise``: log the event and raise `NanLossError` (a `NanLossDuringTrainingError`).
* ``stop``: log the event and ask the loop to stop; it ends cleanly with the last good weights.
* ``skip``: log the event and carry on with the next batch. The bad step changed nothing. After
  ``max_consecutive_bad_steps`` bad steps in a row, give up as ``raise`` does.
* ``rollback``: restore the latest good checkpoint, skip ``rollback_skip_batches`` batches of
  input, optionally scale the learning rate by ``rollback_lr_factor``, and carry on. After
  ``max_rollbacks`` rollbacks (or ``max_consecutive_bad_steps`` bad steps in a row), give up as
  ``raise`` does. The checkpoint is the newest readable one of the checkpoint directory; every
  checkpoint the guard lets through is finite, and a `CheckpointSaverHook` saves one when the
  session starts, so there is one from the first step on. With checkpointing off there is
  none: the rollback then fails with `CheckpointNotFoundError` (it does not silently fall back
  to the initial weights, which would throw away the whole run).

A user callback, ``on_nan``, sees every event first and may return one of these names to
override the policy for that event (or None to keep it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Protocol

from slim_nanguard._events import NanEvent

RAISE = "raise"
STOP = "stop"
SKIP = "skip"
ROLLBACK = "rollback"
POLICIES = (RAISE, STOP, SKIP, ROLLBACK)


class OnNanCallback(Protocol):
    """A user callback that sees each bad step before the policy acts."""

    def __call__(self, event: NanEvent) -> Optional[str]:
        """Handles one bad step.

        Args:
          event: The bad step (its ``action`` field holds the configured policy).

        Returns:
          None to apply the configured policy, or one of ``"raise"``, ``"stop"``, ``"skip"``,
          ``"rollback"`` to apply that one to this event instead.
        """


@dataclasses.dataclass(frozen=True)
class GuardConfig:
    """How a guarded train op reacts to a non-finite step.

    Attributes:
      nan_policy: One of ``raise``, ``stop``, ``skip``, ``rollback``.
      max_consecutive_bad_steps: Give up (raise) once this many bad steps came in a row.
      on_nan: Optional `OnNanCallback` called with every bad step.
      rollback_skip_batches: Batches of input to throw away after a rollback, on top of the
        bad batch itself.
      rollback_lr_factor: Multiplies the learning rate at each rollback; 1.0 keeps it.
      max_rollbacks: Give up (raise) at the rollback after this many.
    """

    nan_policy: str = RAISE
    max_consecutive_bad_steps: int = 10
    on_nan: Optional[OnNanCallback] = None
    rollback_skip_batches: int = 1
    rollback_lr_factor: float = 1.0
    max_rollbacks: int = 3

    def __post_init__(self):
        if self.nan_policy not in POLICIES:
            raise ValueError(f"nan_policy must be one of {', '.join(POLICIES)}; got "
                             f"{self.nan_policy!r}.")
        _check_int("max_consecutive_bad_steps", self.max_consecutive_bad_steps, minimum=1)
        _check_int("rollback_skip_batches", self.rollback_skip_batches, minimum=0)
        _check_int("max_rollbacks", self.max_rollbacks, minimum=1)
        factor = self.rollback_lr_factor
        if (isinstance(factor, bool) or not isinstance(factor, (int, float))
                or not math.isfinite(factor) or not 0.0 < factor <= 1.0):
            raise ValueError("rollback_lr_factor must be a number in (0, 1] (1 keeps the "
                             f"learning rate); got {factor!r}.")
        if self.on_nan is not None and not callable(self.on_nan):
            raise ValueError(f"on_nan must be callable (event -> policy name or None); got "
                             f"{self.on_nan!r}.")


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}.")


def validate_action(action: object, source: str) -> str:
    """Returns `action` if it names a policy, else raises ValueError naming `source`."""
    if action not in POLICIES:
        raise ValueError(f"{source} must return one of {', '.join(POLICIES)} or None; got "
                         f"{action!r}.")
    return action  # type: ignore[return-value]
