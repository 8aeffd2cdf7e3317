"""A bad step's `NanEvent`, its log line and its record (`publish`); the losses of the good steps
before it (`LossHistory`, ``losses_before`` in its record)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, List, Optional, Tuple

# TensorFlow's own logging module, the one NanTensorHook calls: its functions are looked up at
# each call, so whoever patches tf_logging.error or .warning sees the guard's lines.
from tensorflow.python.platform import tf_logging

from slim_nanguard import _exact_sums
from slim_nanguard._exact_sums import FINITE
from slim_nanguard._exact_sums import INF
from slim_nanguard._exact_sums import NAN
from slim_nanguard._reasons import NON_FINITE

if TYPE_CHECKING:  # pragma: no cover
    from slim_nanguard._autopsy import Autopsy
    from slim_nanguard._reasons import Reason

# Not a bad step: the loss-scale optimizer skipped the update and lowered its scale.
LOSS_SCALE_OVERFLOW = "loss_scale_overflow"


def classify(value: float) -> str:
    """`NAN`, `INF` or `FINITE` (as `_exact_sums` names them) for a loss value."""
    return NAN if math.isnan(value) else INF if math.isinf(value) else FINITE


@dataclasses.dataclass(frozen=True)
class NanEvent:
    """What the guard saw on one step whose loss or gradients were not finite.

    Attributes:
      step: The global step the bad step was attempted at (it did not advance it), or -1.
      loss: The step's loss (NaN, +/-Inf, or finite when only gradients went bad).
      loss_kind: ``"nan"``, ``"inf"`` or ``"finite"``.
      culprits: Variables whose gradients held NaN or Inf, in the train op's gradient order.
      consecutive, total: Bad steps in a row, and in this process, this one included.
      mode: The `Mode` that caught the step.
      action: The `Action` the policy decided, or ``"loss_scale_overflow"`` for an overflow
        step of a dynamic loss-scale optimizer (no bad step: no policy, not counted).
      time: Wall-clock time (seconds since the epoch) the step was seen.
      loss_scale: The dynamic loss scale the step used, or None.
      autopsy: The step's replay (an `Autopsy`), or None (off, or past ``autopsy_max_steps``).
      culprit_kinds: Per culprit, ``"nan"``, ``"inf"`` or ``"nan_and_inf"`` (empty: unknown).
      cause: ``"non_finite"``, or the name of the `Reason` that rejected an all-finite step.
      figures: What that reason stored of the step (`Reason.figures`), or None.
      reason: The `Reason` that rejected the step, or None.
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

    @functools.cached_property
    def why(self) -> Optional[str]:
        """What the reason that rejected the step says of its `figures` (None: non-finite)."""
        if self.reason is None or self.figures is None:
            return None
        return self.reason.phrase(self.figures)

    @property
    def spike(self) -> Optional[Dict[str, Any]]:
        """A spike's `figures`, or None for any other cause."""
        return self.figures if self.cause == "spike" else None

    def describe(self) -> str:
        """One line for a log or an error message."""
        loss = "NaN" if self.loss_kind == NAN else f"{self.loss:+}".replace("inf", "Inf")
        loss = f"{self.loss!r} (finite)" if self.loss_kind == FINITE else loss
        head = f"global step {self.step}, loss {loss}"
        count = f"bad step {self.consecutive} in a row ({self.total} in all)"
        if self.why is not None:
            return f"{head}, {self.why}, {count}"
        if self.culprits:
            culprits = (
                f"non-finite gradients of {_exact_sums.listed(self.culprits)}{self._holding()}"
            )
        else:
            culprits = "gradients finite" if self.loss_kind != FINITE else "no culprit known"
        if self.action == LOSS_SCALE_OVERFLOW:
            return (
                f"{head}, {culprits} at loss scale {self.loss_scale:g}: the optimizer skipped "
                "the update and lowers the scale (not a bad step)"
            )
        scale = f", loss scale {self.loss_scale:g}" if self.loss_scale is not None else ""
        return f"{head}, {culprits}{scale}, {count}"

    def _holding(self) -> str:
        """``", holding NaN"`` of the culprits, or per kind when they differ; empty when unknown."""
        if len(self.culprit_kinds) != len(self.culprits):
            return ""
        if len(set(self.culprit_kinds)) == 1:
            return f", holding {_exact_sums.kind_word(self.culprit_kinds[0])}"
        return f", {_exact_sums.describe(list(zip(self.culprits, self.culprit_kinds)))}"

    def to_json(self) -> Dict[str, Any]:
        """A JSON-ready dict; non-finite floats become the strings "nan", "inf", "-inf"."""
        d = dataclasses.asdict(dataclasses.replace(self, autopsy=None, reason=None))
        del d["figures"], d["reason"], d["autopsy"]
        # Plain strings, not enum members: a record reads the same to any JSON consumer.
        d["mode"], d["action"], d["cause"] = str(self.mode), str(self.action), str(self.cause)
        if self.figures is not None:  # Under the cause's name; an overflowed norm is Inf.
            d[str(self.cause)] = {
                k: _json_float(v) if isinstance(v, float) else v for k, v in self.figures.items()
            }
            if self.why is not None:  # The log line's words for them.
                d["why"] = self.why
        d["culprits"], d["culprit_kinds"] = list(self.culprits), list(self.culprit_kinds)
        d["loss"] = _json_float(self.loss)
        if self.loss_scale is None:
            del d["loss_scale"]
        if self.autopsy is not None:
            d["autopsy"] = self.autopsy.to_json()
        return d


def record_of(kind: str, event: NanEvent, **extra: Any) -> Dict[str, Any]:
    """The record of `kind` about `event` a guard sends its listeners (`Guard.add_listener`)."""
    record = {"kind": kind, **event.to_json(), **extra}
    if kind != "bad_step":
        record.pop("autopsy", None)  # Once, in the bad step's own record.
    return record


def event_of(read, **fields: Any) -> NanEvent:
    """The `NanEvent` of a step as `read` (a `_policy.BadStep`), with `fields` (its ``mode``,
    ``action``, counts and ``autopsy``)."""
    return NanEvent(
        **dict(step=read.step, loss=read.loss, loss_kind=classify(read.loss), cause=read.cause),
        **dict(culprits=read.culprits, culprit_kinds=read.culprit_kinds, figures=read.figures),
        **dict(loss_scale=read.loss_scale, reason=read.reason),
        **fields,
    )


def publish(
    send: Callable[[Dict[str, Any]], None],
    history: "LossHistory",
    read,
    extra: Dict[str, Any],
    **fields: Any,
) -> NanEvent:
    """Makes the `NanEvent` of a step as `read` (`event_of`), logs it and `send`s its record
    (a bad step's with `extra` and ``losses_before``, the good steps' losses `history` numbers
    back from it); returns it."""
    event = event_of(read, **fields)
    log_event(event)
    losses = history.anchor(event.step)  # The good steps before it end one step before.
    kind = LOSS_SCALE_OVERFLOW if event.action == LOSS_SCALE_OVERFLOW else "bad_step"
    if losses and kind == "bad_step":
        extra = {**extra, "losses_before": [[step, value] for step, value in losses]}
    send(record_of(kind, event, **extra))
    return event


class LossHistory:
    """A ring buffer of ``[step, loss]`` for the last `size` good steps (0 keeps none)."""

    def __init__(self, size: int):
        self._points: Deque[List] = collections.deque(maxlen=size)  # step None: not numbered yet

    def add(self, loss: float) -> None:
        """Notes the loss of a good step (its step is numbered by the next `anchor`)."""
        if self._points.maxlen and math.isfinite(loss):
            self._points.append([None, float(loss)])

    def anchor(self, step: int) -> List[Tuple[int, float]]:
        """Numbers the unnumbered (newest) points back from global `step` (a bad or overflow
        step's); returns every numbered point, oldest first (none if `step` < 0: no global step)."""
        if step < 0:
            return []
        for back, point in enumerate(reversed(self._points), start=1):
            if point[0] is not None:
                break
            point[0] = step - back
        return self.points()

    def points(self) -> List[Tuple[int, float]]:
        """The numbered points kept, oldest first (those `anchor` numbered)."""
        return [(s, loss) for s, loss in self._points if s is not None]

    def clear(self) -> None:
        """Forgets every point: after a rollback the steps start again from a checkpoint's."""
        self._points.clear()


def _json_float(value: float) -> Any:
    return value if math.isfinite(value) else str(value)


def diverged(event: NanEvent) -> str:
    """The opening sentence of `event`'s log line; for a NaN loss, `NanTensorHook`'s (which
    logs are grepped for)."""
    if event.loss_kind == NAN:
        return "Model diverged with loss = NaN."
    if event.loss_kind == INF:
        return f"Model diverged with loss = {'-' if event.loss < 0 else ''}Inf."
    if event.reason is not None:
        return f"Model diverging: {event.reason.what}; all values finite."
    return "Model diverged with non-finite gradients; the loss is finite."


def log_event(event: NanEvent) -> None:
    """Logs `event` on TensorFlow's logger, as `NanTensorHook` does: a bad step's line opens
    with `diverged` and goes through ``tf_logging.error`` when the action is ``raise``,
    ``tf_logging.warning`` otherwise; a loss-scale overflow is logged at info, without that
    sentence. An autopsy adds one line at the same level.
    """
    if event.action == LOSS_SCALE_OVERFLOW:
        tf_logging.log(
            tf_logging.INFO,
            "slim_nanguard: loss-scale overflow (%s mode): %s",
            event.mode,
            event.describe(),
        )
        return
    gives_up = event.action == "raise"
    log = tf_logging.error if gives_up else tf_logging.warning
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
            tf_logging.ERROR if gives_up else tf_logging.WARN,
            "slim_nanguard: autopsy of global step %d: %s%s",
            event.step,
            event.autopsy.describe(),
            dump,
        )
