"""The record of one rejected training step."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

# TensorFlow's own logging module, the one NanTensorHook calls: its functions are looked up at
# each call, so whoever patches tf_logging.error or .warning sees the guard's lines.
from tensorflow.python.platform import tf_logging

from slim_nanguard import _verdict
from slim_nanguard._reasons import NON_FINITE

if TYPE_CHECKING:  # pragma: no cover
    from slim_nanguard._autopsy import Autopsy
    from slim_nanguard._reasons import Reason

# How the loss of a bad step looked.
LOSS_NAN = "nan"
LOSS_INF = "inf"
LOSS_FINITE = "finite"

# The action of an overflow step of a dynamic loss-scale optimizer: not a bad step, the
# optimizer skipped the update and lowered its scale.
LOSS_SCALE_OVERFLOW = "loss_scale_overflow"


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
      mode: ``"check_numerics"`` or ``"hook"`` (a `Mode`): which mode caught the step.
      action: What the policy decided (an `Action`, equal to its name): ``"raise"``,
        ``"stop"``, ``"skip"`` or ``"rollback"``;
        ``"loss_scale_overflow"`` for an overflow step of a dynamic loss-scale optimizer,
        which is no bad step (no policy applies, and it is not counted in ``consecutive`` or
        ``total``).
      time: Wall-clock time (seconds since the epoch) the step was seen.
      loss_scale: With a dynamic loss-scale optimizer, the loss scale the step used; else None.
      autopsy: The replay of the step (an `Autopsy`: the first op that made a non-finite
        value and the examples behind it), or None (autopsies off, or past
        ``autopsy_max_steps``).
      culprit_kinds: What each culprit's gradient held, in the order of ``culprits``:
        ``"nan"``, ``"inf"`` or ``"nan_and_inf"`` (tested element by element). Empty when
        not known.
      cause: What made the step bad: ``"non_finite"`` (NaN or Inf in the loss or a
        gradient) or the name of the `Reason` that rejected it (``"spike"``: all finite, but
        the loss or the global gradient norm far above those of the accepted steps).
      figures: What that reason stored of the step (`Reason.figures`; a spike's: ``loss``,
        ``grad_norm``, their z-scores, the statistics they were measured against, ``sigma``
        and ``over``), recorded under the cause's name. None for a non-finite step.
      reason: The `Reason` that rejected the step, or None for a non-finite step.
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
    loss_scale: Optional[float] = None
    autopsy: Optional["Autopsy"] = None
    culprit_kinds: Tuple[str, ...] = ()
    cause: str = NON_FINITE
    figures: Optional[Dict[str, Any]] = None
    reason: Optional["Reason"] = dataclasses.field(default=None, compare=False)

    @property
    def spike(self) -> Optional[Dict[str, Any]]:
        """A spike's `figures`, or None for any other cause."""
        return self.figures if self.cause == "spike" else None

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
        if self.reason is not None and self.figures is not None:
            return (
                f"global step {self.step}, loss {self.loss!r} ({self.loss_kind}), "
                f"{self.reason.phrase(self.figures)}, bad step {self.consecutive} in a row "
                f"({self.total} in all)"
            )
        if self.culprits:
            shown = ", ".join(self.culprits[:5])
            more = f" and {len(self.culprits) - 5} more" if len(self.culprits) > 5 else ""
            culprits = f"non-finite gradients of {shown}{more}{self._holding()}"
        else:
            culprits = "gradients finite" if self.loss_kind != LOSS_FINITE else "no culprit known"
        if self.action == LOSS_SCALE_OVERFLOW:
            return (
                f"global step {self.step}, loss {self.loss!r} ({self.loss_kind}), "
                f"{culprits} at loss scale {self.loss_scale:g}: the optimizer skipped the "
                "update and lowers the scale (not a bad step)"
            )
        scale = f", loss scale {self.loss_scale:g}" if self.loss_scale is not None else ""
        return (
            f"global step {self.step}, loss {self.loss!r} ({self.loss_kind}), {culprits}"
            f"{scale}, bad step {self.consecutive} in a row ({self.total} in all)"
        )

    def _holding(self) -> str:
        """``", holding NaN"``, or per kind when they differ; empty when unknown."""
        if len(self.culprit_kinds) != len(self.culprits) or not self.culprits:
            return ""
        if len(set(self.culprit_kinds)) == 1:
            return f", holding {_verdict.kind_word(self.culprit_kinds[0])}"
        return f", {_verdict.describe(list(zip(self.culprits, self.culprit_kinds)))}"

    def to_json(self) -> Dict[str, Any]:
        """A JSON-ready dict; non-finite floats become the strings "nan", "inf", "-inf"."""
        d = dataclasses.asdict(dataclasses.replace(self, autopsy=None, reason=None))
        del d["figures"], d["reason"]
        # Plain strings, not enum members: a record reads the same to any JSON consumer.
        d["mode"], d["action"], d["cause"] = str(self.mode), str(self.action), str(self.cause)
        if self.figures is not None:  # Under the cause's name; an overflowed norm is Inf.
            d[str(self.cause)] = {
                k: _json_float(v) if isinstance(v, float) else v for k, v in self.figures.items()
            }
        d["culprits"] = list(self.culprits)
        d["culprit_kinds"] = list(self.culprit_kinds)
        d["loss"] = _json_float(self.loss)
        if self.loss_scale is None:
            del d["loss_scale"]
        d.pop("autopsy")
        if self.autopsy is not None:
            d["autopsy"] = self.autopsy.to_json()
        return d


def _json_float(value: float) -> Any:
    if math.isfinite(value):
        return value
    return str(value)


# The sentence of `tf.compat.v1.train.NanTensorHook`, which scripts and alerting grep
# TensorFlow's logs for. A bad step's line starts with it when the loss is NaN; otherwise with
# the same opening naming what was bad (`diverged`), so a grep for "Model diverged" finds every
# bad step, and "loss = NaN" is never said of a loss that was not NaN.
DIVERGED = "Model diverged with loss = NaN."


def diverged(event: NanEvent) -> str:
    """The opening sentence of a bad step's log line: which value was bad.

    Args:
      event: The bad step's event.

    Returns:
      `DIVERGED` for a NaN loss, ``Model diverged with loss = Inf.`` (or ``-Inf``) for an
      infinite one, and for a finite loss ``Model diverged with non-finite gradients; the
      loss is finite.``
    """
    if event.loss_kind == LOSS_NAN:
        return DIVERGED
    if event.loss_kind == LOSS_INF:
        return f"Model diverged with loss = {'-' if event.loss < 0 else ''}Inf."
    if event.reason is not None:
        return f"Model diverging: {event.reason.what}; all values finite."
    return "Model diverged with non-finite gradients; the loss is finite."


def log_event(event: NanEvent, level: Optional[int] = None) -> None:
    """Logs `event` as one line on TensorFlow's logger, where `NanTensorHook` logs.

    A bad step's line starts with `diverged` (`NanTensorHook`'s ``Model diverged with loss =
    NaN.`` when the loss is NaN), through ``tf_logging.error`` when training gives up (action
    ``raise``) and ``tf_logging.warning`` otherwise, the calls `NanTensorHook` makes when it
    raises or stops (so a test or an alert that patches them sees the guard's lines too). An
    overflow step of a dynamic loss-scale optimizer is no divergence: it is logged at info
    level, without that sentence.

    Args:
      event: The event.
      level: A Python `logging` level, to override the above.
    """
    if event.action == LOSS_SCALE_OVERFLOW:
        tf_logging.log(
            tf_logging.INFO if level is None else level,
            "slim_nanguard: loss-scale overflow (%s mode): %s",
            event.mode,
            event.describe(),
        )
        return
    gives_up = event.action == "raise"
    if level is not None:
        log = functools.partial(tf_logging.log, level)
    else:
        log = tf_logging.error if gives_up else tf_logging.warning
        level = tf_logging.ERROR if gives_up else tf_logging.WARN
    log(
        "%s slim_nanguard: bad step (%s mode), action %s: %s",
        diverged(event),
        event.mode,
        event.action,
        event.describe(),
    )
    if event.autopsy is not None:  # One error or warning call per bad step, as NanTensorHook.
        dump = f" (dump: {event.autopsy.dump})" if event.autopsy.dump else ""
        tf_logging.log(
            level,
            "slim_nanguard: autopsy of global step %d: %s%s",
            event.step,
            event.autopsy.describe(),
            dump,
        )
