"""The spike test: is the logarithm of this step's data loss (the total loss without the
regularization losses it adds) or gradient norm more than `sigma` deviations above the mean of
the last `window` accepted steps' (warm-up outliers left out)? The tests hold the same
arithmetic in NumPy. Why: docs/guide.md, "The spike guard".
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable, ClassVar, ContextManager, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import cond_v2

from slim_nanguard import _ops
from slim_nanguard import _policy
from slim_nanguard import _reasons
from slim_nanguard._types import Action
from slim_nanguard._types import Cause

# The statistics' variable scope (checkpoints: ``nanguard_spike/history``, ``/count``, ``/floor``).
SPIKE_SCOPE = "nanguard_spike"
# The least deviation of the logarithms (a factor of about 1.05).
FLOOR = 0.05
# The values a step is judged on (a column of the statistics each), and their words.
COLUMNS = ("loss", "grad_norm")
NAMES = {"loss": "loss", "grad_norm": "gradient norm"}


def _fields(*prefixes: str) -> Tuple[str, ...]:
    return tuple(f"{prefix}{column}" for prefix in prefixes for column in COLUMNS)


# What `SpikeTest.report_vector` holds, in order (float64). ``loss`` is the loss judged: the
# data loss; ``total_loss`` the train op's, ``regularization_loss`` the sum of the
# ``regularization_terms`` regularization losses it adds (the difference).
REPORT_FIELDS = _fields("", "z_", "log_mean_", "log_std_") + (
    "accepted_steps",
    "window_steps",
    "total_loss",
    "regularization_loss",
    "regularization_terms",
)


class SpikeTest:
    """The spike test of a step, against the statistics of the accepted steps before it.

    Attributes:
      history: float64 variable ``[window, 2]``, a ring of the last accepted ``[loss, norm]``:
        0 for a value not finite or not positive, a warm-up outlier negated (the writes to the
        warm-up's rows re-mark them, so a step's test sorts nothing).
      count: int64 variable, the rows written since the statistics began (one an accepted
        step) or were re-seeded (`reseed` counts the rows it writes).
      floor: float64 variable ``[2]``, each column's least deviation: `FLOOR`, or after a new
        level the old level's (a level judged on a few values is judged no more narrowly).
      mean, std: float64 ``[2]``, of the logarithms of the window's positive entries.
      spike: Scalar bool, True when warm-up is over and a value exceeds ``threshold``,
        ``exp(mean + sigma * std)``.
    """

    def __init__(
        self,
        loss: tf.Tensor,
        norm: tf.Tensor,
        *,
        sigma: float,
        warmup_steps: int,
        window: int = _policy.SPIKE_WINDOW,
        variable_scope: Callable[[], ContextManager] = contextlib.nullcontext,
        total_loss: Optional[tf.Tensor] = None,
        regularization: Sequence[tf.Tensor] = (),
    ):
        """Builds the variables (in `variable_scope`) and the test; `update` builds the write.
        `loss` is the loss judged; `total_loss` (None: `loss`) and its `regularization`
        terms are reported beside it. Needs ``sigma > 0`` and ``2 <= warmup_steps <= window``
        (unchecked here)."""
        self.window, self.sigma, self.warmup_steps = window, float(sigma), int(warmup_steps)
        self._total_loss = loss if total_loss is None else total_loss
        self._regularization = tuple(regularization)
        # One set per train op: a second one gets ``nanguard_spike_1/``.
        with variable_scope(), tf.compat.v1.variable_scope(None, default_name=SPIKE_SCOPE):
            self.history = _variable("history", [window, len(COLUMNS)], tf.float64)
            self.count = _variable("count", [], tf.int64)
            self.floor = _variable("floor", [len(COLUMNS)], tf.float64, FLOOR)
        with tf.name_scope("nanguard/spike") as self._scope:
            self.values = tf.stack([tf.cast(loss, tf.float64), tf.cast(norm, tf.float64)])
            # Read from the variables alone: ready before the step's values. A value <= 0 or
            # NaN is no spike; an Inf (an overflowed norm) always is.
            self._count_now = self.count.read_value()
            self.mean, self.std, self._window_steps = _log_statistics(
                self.history.read_value(), self.floor.read_value()
            )
            self._live = self._window_steps >= float(self.warmup_steps)
            self.threshold = tf.exp(self.mean + self.sigma * self.std, name="threshold")
            over = tf.logical_and(self.values > self.threshold, self._live)
            self.spike = tf.reduce_any(over, name="is_spike")
        # After a new level: (global step, rows written, distinct values, times each).
        self._seeded: Optional[Tuple[int, int, int, int]] = None
        self.reason: Optional[Spike] = None  # The reason that built it (`Spike.build`).
        with variable_scope(), tf.name_scope("nanguard/spike/reseed"):
            self.reseed_values = tf.compat.v1.placeholder(
                tf.float64, [None, len(COLUMNS)], name="values"
            )
            self.reseed_floor = tf.compat.v1.placeholder(tf.float64, [len(COLUMNS)], name="floor")
            self.reseed = self._reseed_op(self.reseed_values, self.reseed_floor)

    def z_scores(self) -> tf.Tensor:
        """New ops, in the current control context (a bad branch, a summary): float64 ``[2]``,
        the step's z-scores (0 in a column's warm-up and for a NaN or a value not positive;
        +Inf for +Inf)."""
        with tf.name_scope(self._scope), tf.name_scope("z"):
            return _z_scores(self.values, self.mean, self.std, self._live)

    def judged(self) -> tf.Tensor:
        """New ops: float64 vector of `JUDGED_FIELDS` (the statistics before the step's update)."""
        with tf.name_scope(self._scope):
            live = tf.cast(self._live, tf.float64)
            return tf.concat([self.values, self.mean, self.std, live], 0, name="judged")

    def update(self) -> tf.Operation:
        """The write of an accepted step's values into the statistics, whenever it runs (built
        behind the gate)."""
        # After this step's statistics are read (the count a rejected step reports too): the
        # write must not race the reads.
        with (
            tf.name_scope("nanguard/spike/update"),
            tf.control_dependencies([self.spike, self.std, self._count_now]),
        ):
            # The row comes from the increment's own result: two workers sharing the
            # statistics write two rows, not one.
            count = self.count.assign_add(tf.constant(1, tf.int64))
            row = tf.math.floormod(count - 1, self.window)
            new = _entries(self.values)
            written = tf.compat.v1.scatter_update(self.history, [row], new[None, :])
            # Only a write to a warm-up row still in the window can change the outliers.
            warm = (row < self.warmup_steps) & (count <= self.window + self.warmup_steps)
            with tf.control_dependencies([written]):
                trimmed = cond_v2.cond_v2(
                    warm,
                    lambda: self._trim_warmup(count),
                    lambda: tf.constant(False),
                    name="trim_warmup",
                )
            return tf.group(written, trimmed, name="update")

    def _trim_warmup(self, count: tf.Tensor) -> tf.Tensor:
        """Re-marks the warm-up's outliers for `count` accepted steps; True once written. Only
        signs change (a product): a row another worker writes meanwhile keeps its value."""
        rows = self.history.read_value()[: self.warmup_steps]
        outliers = _warmup_outliers(
            tf.abs(rows), count, self.window, self.sigma, self.floor.read_value()
        )
        flip = tf.not_equal(outliers, rows < 0)
        signs = tf.where(flip, tf.constant(-1.0, tf.float64), tf.constant(1.0, tf.float64))
        written = self.history.scatter_mul(
            tf.IndexedSlices(signs, tf.range(self.warmup_steps, dtype=tf.int64))
        )
        with tf.control_dependencies([written]):
            return tf.constant(True)

    def _reseed_op(self, values: tf.Tensor, floor: tf.Tensor) -> tf.Operation:
        """The op that makes `values` (``[n, 2]``, n <= `window`, oldest first) the whole
        statistics, with `floor` (at least `FLOOR`): a new level (`judge_run`)."""
        n = tf.shape(values, out_type=tf.int64)[0]
        zeros = tf.zeros([self.window, len(COLUMNS)], tf.float64)
        rows = tf.concat([values, zeros], 0)[: self.window]
        padded = _entries(tf.ensure_shape(rows, [self.window, len(COLUMNS)]))
        floor = tf.maximum(floor, FLOOR)
        w = self.warmup_steps
        outliers = _warmup_outliers(padded[:w], n, self.window, self.sigma, floor)
        signed = tf.concat([tf.where(outliers, -padded[:w], padded[:w]), padded[w:]], 0)
        written = self.history.assign(signed, read_value=False)
        floors = self.floor.assign(floor, read_value=False)
        with tf.control_dependencies([written, floors]):
            count = self.count.assign(n, read_value=False)
        return tf.group(written, floors, count, name="reseed")

    def note_reseed(self, step: int, values: int, repeats: int) -> None:
        """Notes for `figures` that `reseed` ran at global `step` with `values` distinct values,
        each written `repeats` times."""
        self._seeded = (step, values * repeats, values, repeats)

    def figures(self, report: Sequence[float], step: int) -> Dict[str, Any]:
        """`Spike.figures` of the `report` of a spike at global `step`, plus, while the window
        still holds a new level's re-seeded values (`note_reseed`, not before its step),
        ``level_entries`` (how many), ``level_values`` and ``level_repeats``."""
        figures = self.reason.figures(report)
        if self._seeded is not None:
            at, rows, values, repeats = self._seeded
            since = figures["accepted_steps"] - rows
            entries = figures["window_steps"] - since
            if step >= at and since >= 0 and entries > 0:
                level = {"level_entries": entries, "level_values": values, "level_repeats": repeats}
                figures |= level
        return figures

    def report_vector(self) -> tf.Tensor:
        """New ops (for the bad branch): float64 vector of `REPORT_FIELDS` (`Spike.figures`)."""
        count = tf.cast(tf.reshape(self._count_now, [1]), tf.float64)
        # The window's entries (the fewer of the columns').
        window_steps = tf.cast(tf.reshape(tf.reduce_min(self._window_steps), [1]), tf.float64)
        loss_parts = tf.stack(
            [
                tf.cast(self._total_loss, tf.float64),
                _ops.float64_sum(self._regularization),
                tf.constant(float(len(self._regularization)), tf.float64),
            ]
        )
        return tf.concat(
            [self.values, self.z_scores(), self.mean, self.std, count, window_steps, loss_parts],
            0,
            name="report",
        )


# What `SpikeTest.judged` holds (float64); ``live_``: 1 where a column's warm-up is over.
JUDGED_FIELDS = _fields("", "log_mean_", "log_std_", "live_")


def _z_scores(values: tf.Tensor, mean: tf.Tensor, std: tf.Tensor, live: tf.Tensor) -> tf.Tensor:
    """The z-scores of `values`' logarithms, 0 where not `live`, for a NaN or a value <= 0."""
    usable = values > 0
    logs = tf.math.log(tf.where(usable, values, tf.ones_like(values)))
    z = (logs - mean) / std
    return tf.where(tf.logical_and(usable, live), z, tf.zeros_like(z))


@dataclasses.dataclass(frozen=True)
class Spike(_reasons.Reason):
    """The spike test as a reason (``spike_policy``, ``spike_sigma``, ``spike_warmup_steps``:
    `GuardConfig` declares their defaults and checks them)."""

    name: ClassVar[str] = "spike"
    what: ClassVar[str] = "a spike in the loss or the gradient norm"
    report_fields: ClassVar[Tuple[str, ...]] = REPORT_FIELDS
    judged_fields: ClassVar[Tuple[str, ...]] = JUDGED_FIELDS
    policy: str
    sigma: float
    warmup_steps: int

    def build(self, values: _reasons.StepValues) -> _reasons.Test:
        """The `SpikeTest` of the data loss and the global norm, also its `handles`."""
        test = SpikeTest(
            values.loss if values.data_loss is None else values.data_loss,
            values.global_norm,
            sigma=self.sigma,
            warmup_steps=self.warmup_steps,
            variable_scope=values.state_scope,
            total_loss=values.loss,
            regularization=values.regularization,
        )
        test.reason = self
        return _reasons.Test(
            reject=test.spike,
            report=test.report_vector,
            judged=test.judged,
            writes=lambda: [test.update()],
            variables=(test.history, test.count, test.floor),
            handles=test,
        )

    def settings(self) -> Dict[str, Any]:
        """``spike_policy`` and ``spike_sigma``."""
        return {"spike_policy": self.policy, "spike_sigma": self.sigma}

    def figures(self, report: Sequence[float]) -> Dict[str, Any]:
        """The base figures (counts as ints), plus ``sigma``, ``typical_<column>`` (the window's
        geometric mean) and ``over`` (the columns whose z-score exceeded ``sigma``, loss first)."""
        figures = {name: float(value) for name, value in zip(self.report_fields, report)}
        counts = ("accepted_steps", "window_steps", "regularization_terms")
        figures |= {k: int(figures[k]) for k in counts if k in figures}
        figures["sigma"] = float(self.sigma)
        figures |= {f"typical_{c}": math.exp(figures[f"log_mean_{c}"]) for c in COLUMNS}
        figures["over"] = [c for c in COLUMNS if figures[f"z_{c}"] > self.sigma]
        return figures

    def phrase(self, figures: Dict[str, Any]) -> str:
        return phrase(figures)

    def decide(self, config, state, observation) -> Tuple[Optional[_policy.Decision], Any]:
        """The spike's own rules, before the policy (pure). A spike within
        ``spike_warmup_steps`` global steps of a new level means that level was a divergence
        (``persistent_nan_policy`` at once); a run of skipped spikes that holds together is a
        new level (`judge_run`: skipped, the statistics re-seeded by `_actions`, on
        probation)."""
        run = state.reason_run + ({**(observation.figures or {}), "step": observation.step},)
        state = dataclasses.replace(state, reason_run=run)
        decision = _divergence(config, state, observation)
        if decision is not None:
            return decision, dataclasses.replace(state, level_taken_at=None)
        level = _new_level(config, state, observation)
        if level is None:
            return None, state
        return _policy.Decision(Action.SKIP, level_shift=level), dataclasses.replace(
            state,
            level_shifts=state.level_shifts + 1,
            consecutive_bad_steps=0,
            run_start=None,
            reason_run=(),
            level_taken_at=observation.step,
            level_start=level.steps[0],
        )

    def summaries(self, judged: tf.Tensor) -> Dict[str, tf.Tensor]:
        """The last accepted step's ``data_loss`` (the loss judged: the total loss without the
        regularization losses it adds), ``grad_norm``, ``z_loss`` (of the data loss) and
        ``z_grad_norm`` (z 0 in a column's warm-up and before any step is stored)."""
        values, mean, std, live = tf.split(judged, len(JUDGED_FIELDS) // len(COLUMNS))
        z = _z_scores(values, mean, tf.maximum(std, FLOOR), live > 0)
        shown = {SUMMARY_NAMES.get(c, c): judged[i] for i, c in enumerate(COLUMNS)}
        return shown | {f"z_{c}": z[i] for i, c in enumerate(COLUMNS)}


# The summaries' names of the values judged (``losses/total_loss`` is the launcher's).
SUMMARY_NAMES = {"loss": "data_loss"}


def name_of(column: str, figures: Dict[str, Any]) -> str:
    """What `column` of a spike's (or a level's) `figures` is in words: ``"data loss"`` when
    regularization losses were taken out of the loss judged, else as `NAMES` says."""
    if column == "loss" and figures.get("regularization_terms"):
        return "data loss"
    return NAMES[column]


def _value_words(column: str, report: Dict[str, Any]) -> str:
    """The value of `column` as the log line states it: the data loss with what it was taken
    from (``data loss 0.01 (total loss 0.06 less regularization 0.05)``)."""
    text = f"{name_of(column, report)} {report[column]:.4g}"
    if name_of(column, report) != NAMES[column]:
        text += (
            f" (total loss {report['total_loss']:.4g} less regularization "
            f"{report['regularization_loss']:.4g})"
        )
    return text


def phrase(report: Dict[str, Any]) -> str:
    """A phrase for a spike's log line: which value jumped, how far, against what."""
    sigma = float(report["sigma"])
    over = report.get("over") or ()
    parts = [
        f"{_value_words(c, report)} is {deviations(report['z_' + c], sigma)} deviations above "
        f"the typical {report['typical_' + c]:.4g}"
        for c in over
    ]
    others = [c for c in NAMES if c not in over]
    tail = ", ".join(
        f"{name_of(c, report)} z {deviations(report['z_' + c], sigma)}" for c in others
    )
    tail = f"; {tail}" if tail else ""
    head = "; ".join(parts) or "no value above spike_sigma"
    window = report.get("window_steps", report["accepted_steps"])
    over_what = f"over the last {window} accepted steps"
    level = report.get("level_entries")
    if level:
        over_what = (
            f"over the {window} values of its window: {level} from a new level's "
            f"{report['level_values']} spikes, each taken {report['level_repeats']} times, "
            f"and {window - level} accepted since"
        )
    return f"spike: {head} (spike_sigma={report['sigma']:g}, {over_what}{tail})"


def deviations(z: float, sigma: float) -> str:
    """`z` to one decimal, or as many as keep it on its side of `sigma` (6.04 over 6 is not
    written 6.0)."""
    for digits in range(1, 5):
        text = f"{z:.{digits}f}"
        if (float(text) > sigma) == (z > sigma) and float(text) != sigma:
            return text
    return f"{z:.4f}"


def _variable(name: str, shape, dtype: tf.DType, initial: float = 0.0) -> tf.Variable:
    """A statistics variable: saved with the model, not trained."""
    init = (
        tf.compat.v1.constant_initializer(initial) if initial else tf.compat.v1.zeros_initializer()
    )
    return tf.compat.v1.get_variable(name, shape, dtype, init, trainable=False, use_resource=True)


# A warm-up outlier, among at least MIN_WARMUP_ENTRIES entries, is farther from their median
# than OUTLIER_SIGMAS times `sigma` robust deviations (MAD_SCALE times the median absolute
# deviation; twice the test's bar: a heavy tail stays in, a spike the test would reject does
# not) and than a factor OUTLIER_RATIO (twenty values cannot tell a tail seen once from a spike).
MAD_SCALE = 1.4826
MIN_WARMUP_ENTRIES = 5
OUTLIER_SIGMAS = 2.0
OUTLIER_RATIO = 100.0


def _entries(values: tf.Tensor) -> tf.Tensor:
    """`values` as stored: a non-finite or non-positive value as 0 (never counted, finite for
    the checkpoint), so a negative entry is always a trimmed outlier."""
    return tf.where(tf.math.is_finite(values), tf.nn.relu(values), tf.zeros_like(values))


def _warmup_outliers(rows, count, window: int, sigma: float, floor) -> tf.Tensor:
    """Bool ``[warmup, 2]``: the outliers among `rows`, the magnitudes of the window's first
    ``warmup`` rows (until the ring overwrites them once `count` passes `window`), by the
    constants above (the robust deviation at least `floor`)."""
    warmup = rows.shape[0]
    index = tf.range(warmup, dtype=tf.int64)
    warm = (rows > 0) & (count <= window + index)[:, None]
    logs = tf.math.log(tf.where(warm, rows, tf.ones_like(rows)))
    entries = tf.reduce_sum(tf.cast(warm, tf.int64), axis=0)
    middle = tf.one_hot(
        tf.maximum(entries - 1, 0) // 2, warmup, axis=0, on_value=True, off_value=False
    )

    def median(x):
        ordered = tf.sort(
            tf.where(warm, x, tf.fill(tf.shape(x), tf.constant(np.inf, x.dtype))), axis=0
        )
        return tf.reduce_sum(tf.where(middle, ordered, tf.zeros_like(ordered)), axis=0)

    center = median(logs)
    distance = tf.abs(logs - center)
    scale = tf.maximum(MAD_SCALE * median(distance), floor)
    far = distance > tf.maximum(OUTLIER_SIGMAS * sigma * scale, math.log(OUTLIER_RATIO))
    return warm & far & (entries >= MIN_WARMUP_ENTRIES)[None, :]


def _log_statistics(history: tf.Tensor, floor: tf.Tensor):
    """Per column of `history`: the mean and deviation (at least `floor`) of the logarithms of
    its positive entries, and how many (float64)."""
    usable = history > 0
    weight = tf.cast(usable, tf.float64)
    logs = tf.math.log(tf.where(usable, history, tf.ones_like(history)))  # 0 where not usable
    kept = tf.reduce_sum(weight, axis=0)
    size = tf.maximum(kept, 1.0)
    mean = tf.reduce_sum(logs, axis=0) / size
    spread = tf.reduce_sum(tf.square((logs - mean) * weight), axis=0) / size
    return mean, tf.maximum(tf.sqrt(spread), floor), kept


# How many of the window's deviations (of the logarithms) a new level's values may spread
# over, and its later half lie above its earlier half.
SPREAD = 2.0
# The most a new level's typical value may lie above the old one's (docs/performance.md's bench: a
# learning rate raised a thousandfold moves the loss 600 times and more).
MAX_RISE = 100.0


@dataclasses.dataclass(frozen=True)
class LevelShift:
    """A run of spikes taken as the new level of training.

    Attributes:
      steps: The global steps of the run, oldest first.
      values: The run's ``(loss, grad_norm)`` pairs, oldest first: the statistics' new rows.
      old: Each column's typical value (geometric mean) before the run, by name.
      new: Each column's typical value over the run.
      floor: Each column's deviation of the logarithms before the run: the least one the
        re-seeded statistics judge with.
      regularization_terms: How many regularization losses the loss judged leaves out (its
        words: ``data loss`` when any).
    """

    steps: Tuple[int, ...]
    values: Tuple[Tuple[float, float], ...]
    old: Dict[str, float]
    new: Dict[str, float]
    floor: Tuple[float, float] = (FLOOR, FLOOR)
    regularization_terms: int = 0

    def describe(self, repeats: int = 1, probation_steps: Optional[int] = None) -> str:
        """One sentence for the log: what moved, from what to what, over which steps; each
        value written `repeats` times, a probation of `probation_steps` (None: not said)."""
        words = {"regularization_terms": self.regularization_terms}
        moved = ", ".join(
            f"{name_of(c, words)} {self.old[c]:.4g} -> {self.new[c]:.4g}"
            for c in COLUMNS
            if c in self.new
        )
        first, last = self.steps[0], self.steps[-1]
        where = f"at global step {first}" if first == last else f"global steps {first}-{last}"
        why = ""
        if len(set(self.values)) == 1:
            why = "the same values each time: the model's own state made them, not a batch; "
        taken = f" (each taken {repeats} times, to fill the warm-up)" if repeats > 1 else ""
        within = "steps " if probation_steps is None else f"{probation_steps} global steps "
        return (
            f"a new level, not a spike: {len(self.steps)} spikes in a row ({where}) hold "
            f"together at {moved} (typical values, before -> now); {why}the spike "
            f"statistics start again from these {len(self.values)} values{taken}, and a spike "
            f"in the next {within}will be taken for a divergence"
        )

    def to_json(self) -> Dict[str, object]:
        """The record's fields (``cause`` ``"level_shift"``)."""
        return {
            "cause": "level_shift",
            "steps": list(self.steps),
            "old": dict(self.old),
            "new": dict(self.new),
            "floor": list(self.floor),
        }


def judge_run(spikes: Sequence[Mapping[str, Any]], needed: int) -> Optional[LevelShift]:
    """The `LevelShift` of the last `needed` (0: never) of the run's `spikes` (oldest first,
    each a ``step`` and `_spike.Spike.figures`), or None: too few, they do not hold
    together, or they lie more than `MAX_RISE` times above the values before them."""
    if needed <= 0 or len(spikes) < needed:
        return None
    run = list(spikes)[-needed:]
    over = {c for spike in run for c in spike.get("over") or ()} or set(COLUMNS)
    floor = tuple(max(float(run[0].get(f"log_std_{c}", FLOOR)), FLOOR) for c in COLUMNS)
    for column, deviation in zip(COLUMNS, floor):
        if column in over and not holds_together([float(s[column]) for s in run], deviation):
            return None
    values = tuple((float(s["loss"]), float(s["grad_norm"])) for s in run)
    new = {}
    for index, column in enumerate(COLUMNS):
        if logs := [math.log(v[index]) for v in values if _usable(v[index])]:
            new[column] = math.exp(sum(logs) / len(logs))
    old = {c: math.exp(float(run[0][f"log_mean_{c}"])) for c in new}
    if any(c in over and new[c] > MAX_RISE * old[c] for c in new):
        return None
    terms = int(run[0].get("regularization_terms", 0))
    return LevelShift(tuple(int(s["step"]) for s in run), values, old, new, floor, terms)


def holds_together(values: Sequence[float], deviation: float) -> bool:
    """Whether `values` are one level: all positive and finite, the deviation of their
    logarithms at most `SPREAD` times the window's `deviation`, and the later half not above
    the earlier by more than that."""
    if len(values) < 2 or not all(_usable(v) for v in values):
        return False
    logs = [math.log(v) for v in values]
    mean = sum(logs) / len(logs)
    spread = math.sqrt(sum((x - mean) ** 2 for x in logs) / len(logs))
    half = len(logs) // 2
    early, late = logs[:half], logs[len(logs) - half :]
    growth = sum(late) / len(late) - sum(early) / len(early)
    return spread <= SPREAD * deviation and growth <= SPREAD * deviation


def _usable(value: float) -> bool:
    return math.isfinite(value) and value > 0


def _new_level(config, state, observation) -> Optional[LevelShift]:
    """The new level the run of spikes this one ends, if any: only a spike that is skipped
    ends one (a rollback moves the global step back)."""
    if (
        observation.chosen != Action.SKIP
        or len(state.reason_run) != state.consecutive_bad_steps
        or config.spike_level_shift_steps >= config.max_consecutive_bad_steps
    ):
        return None
    return judge_run(state.reason_run, config.spike_level_shift_steps)


def _divergence(config, state, observation) -> Optional[_policy.Decision]:
    """``persistent_nan_policy`` at once for a spike within ``spike_warmup_steps`` global steps
    of a new level (that level was a divergence); None for any other bad step."""
    if state.level_taken_at is None:
        return None
    since = observation.step - state.level_taken_at
    if not 0 <= since < config.spike_warmup_steps:
        return None
    reason = (
        f"a spike {since} step{'' if since == 1 else 's'} after taking a new level at global step "
        f"{state.level_taken_at} (fewer than spike_warmup_steps={config.spike_warmup_steps}): "
        "that level was a divergence"
    )
    action = Action(config.persistent_nan_policy)
    if action == Action.ROLLBACK and state.rollbacks >= config.max_rollbacks:
        reason += f", and {_policy.rollbacks_done(config, state)}"
        action = Action.RAISE
    if action == Action.RAISE:
        return _policy.Decision(action, reason, reason, give_up=Cause.DIVERGENCE)
    before = state.level_start if action == Action.ROLLBACK else None
    return _policy.Decision(action, escalation=reason, before_step=before)


# The guard's config makes the spike test through the reason interface only (`_policy` needs
# no TensorFlow): `GuardConfig.all_reasons` builds it with this.
_policy.SPIKE_REASON = Spike
