"""The record of one non-finite training step."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

from absl import logging

if TYPE_CHECKING:  # pragma: no cover
    from slim_nanguard._autopsy import Autopsy

# How the loss of a bad step looked.
LOSS_NAN = "nan"
LOSS_INF = "inf"
LOSS_FINITE = "finite"


def classify(value: float) -> str:
    """Returns `LOSS_NAN`, `LOSS_INF` or `LOSS_FINITE` for a loss value."""
    if math.isnan(value):
        return LOSS_NAN
    if math.isinf(value):
        return LOSS_INF
    return LOSS_FINITE


@dataclasses.dataclass(frozen=True)
class NanEvent:
    """What the guard saw on one step whose loss or gradients were not finite.

    Attributes:
      step: The global step the bad step was attempted at. The step did not advance it, so
        the next step is attempted at the same value. -1 when the train op has no global step.
      loss: The loss value of the bad step (may be NaN, +/-Inf, or finite when only gradients
        went bad).
      loss_kind: ``"nan"``, ``"inf"`` or ``"finite"``.
      culprits: Names of the variables whose gradients held NaN or Inf, in the order of the
        train op's gradient list. Empty when the gradients were finite (only the loss was bad)
        or unknown.
      consecutive: How many bad steps came in a row, this one included.
      total: How many bad steps this guard has seen in this process, this one included.
      mode: ``"check_numerics"`` or ``"hook"``: which mode caught the step.
      action: What the policy decided: ``"raise"``, ``"stop"``, ``"skip"`` or ``"rollback"``.
      time: Wall-clock time (seconds since the epoch) the step was seen.
      autopsy: The replay of the step (an `Autopsy`: the first op that made a non-finite
        value and the examples behind it), or None (autopsies off, or past
        ``autopsy_max_steps``).
    """

    step: int
    loss: float
    loss_kind: str
    culprits: Tuple[str, ...]
    consecutive: int
    total: int
    mode: str
    action: str = ""
    time: float = dataclasses.field(default_factory=time.time)
    autopsy: Optional["Autopsy"] = None

    @property
    def loss_is_nan(self) -> bool:
        """True when the loss itself was NaN."""
        return self.loss_kind == LOSS_NAN

    @property
    def loss_is_inf(self) -> bool:
        """True when the loss itself was +Inf or -Inf."""
        return self.loss_kind == LOSS_INF

    def describe(self) -> str:
        """One line for a log or an error message."""
        if self.culprits:
            shown = ", ".join(self.culprits[:5])
            more = f" and {len(self.culprits) - 5} more" if len(self.culprits) > 5 else ""
            culprits = f"non-finite gradients of {shown}{more}"
        else:
            culprits = "gradients finite" if self.loss_kind != LOSS_FINITE else "no culprit known"
        return (f"global step {self.step}, loss {self.loss!r} ({self.loss_kind}), {culprits}, "
                f"bad step {self.consecutive} in a row ({self.total} in all)")

    def to_json(self) -> Dict[str, Any]:
        """A JSON-ready dict; non-finite floats become the strings "nan", "inf", "-inf"."""
        d = dataclasses.asdict(dataclasses.replace(self, autopsy=None))
        d["culprits"] = list(self.culprits)
        d["loss"] = _json_float(self.loss)
        d.pop("autopsy")
        if self.autopsy is not None:
            d["autopsy"] = self.autopsy.to_json()
        return d


def _json_float(value: float) -> Any:
    if math.isfinite(value):
        return value
    return str(value)


def log_event(event: NanEvent, level: Optional[int] = None) -> None:
    """Logs `event` with absl.logging (warning unless training gives up: then error)."""
    if level is None:
        level = logging.ERROR if event.action == "raise" else logging.WARNING
    logging.log(level, "slim_nanguard: bad step (%s mode), action %s: %s", event.mode,
                event.action, event.describe())
    if event.autopsy is not None:
        dump = f" (dump: {event.autopsy.dump})" if event.autopsy.dump else ""
        logging.log(level, "slim_nanguard: autopsy of global step %d: %s%s", event.step,
                    event.autopsy.describe(), dump)
