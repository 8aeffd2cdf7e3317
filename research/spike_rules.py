"""Candidate judgements of the spike guard, in NumPy: what each would do, step by step.

A pure model of ``slim_nanguard/_spike.py`` (a window of the logarithms of the accepted steps'
loss and gradient norm; a step is a spike when a value is more than ``sigma`` deviations above
the mean once ``warmup`` steps were accepted; the deviation floored at `FLOOR`) and of the
escalation (``max_bad`` bad steps in a row stop the run), with the variants issue 25 asks to
measure:

* ``center``: ``"mean"`` (today: mean and deviation of the logarithms), ``"median"`` (median
  and 1.4826 x MAD of the window) or ``"trim"`` (mean and deviation, but values accepted
  during the warm-up that are more than ``sigma`` robust deviations from the warm-up's median
  are left out).
* ``level_shift``: after ``k`` consecutive spike rejections with finite values whose
  logarithms are stable among themselves (their deviation at most ``spread`` times the
  window's) and not growing (the mean of the newer half minus that of the older half at most
  ``growth`` times the window's deviation), the guard re-seeds its statistics with those
  ``k`` values, accepts the ``k``-th step, and warms up from them.
* ``signals``: which columns are tested: ``"loss"``, ``"norm"``, and the opt-in
  ``"update"`` (the optimizer's update norm) and ``"m_over_v"`` (Adam: |m| / sqrt|v|).

`Judge.decide` is called once a step, in order, with the step's values; it returns what the
guard does. Nothing here imports TensorFlow.

Not installed (research/ lives in the repository only): `spike_traces`, `spike_bench` and
tests/test_spike_bench.py import it with research/ on ``sys.path``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Sequence

import numpy as np

FLOOR = 0.05
MAD_SCALE = 1.4826
ACCEPT, SPIKE, NONFINITE, ADAPT, STOP = "accept", "spike", "nonfinite", "adapt", "stop"
# A shift decided on a step that is still rejected (`Rule.hold`); a burst that was not a level.
SHIFT_HELD, BURST = "shift_held", "burst"


@dataclasses.dataclass(frozen=True)
class Rule:
    """One candidate judgement (see the module docstring).

    Attributes:
      name: What tables call it.
      sigma: Deviations above the center that make a spike.
      warmup: Accepted steps before any step can be a spike.
      window: Accepted steps the statistics cover.
      center: ``"mean"``, ``"median"`` or ``"trim"``.
      level_shift: Consecutive spike rejections before the level-shift test (None: never).
      spread: The k logarithms' deviation may be at most this times the window's.
      growth: Newer-half mean minus older-half mean, at most this times the window's deviation.
      live_after_shift: True: the re-seeded statistics judge at once, with the deviation at
        least the old window's; False: warm up again from the k values.
      probation: With `live_after_shift`: a spike before ``warmup`` steps were accepted
        after a shift is a divergence: the run stops at once.
      hold: The k-th step is rejected too (the shift is confirmed by the next step), and the
        old statistics are kept through the probation: a step back under the old threshold
        means the streak was a burst of bad batches, not a level: the old statistics return.
      signals: The columns tested.
      max_bad: Bad steps in a row that stop the run.
    """

    name: str = "today"
    sigma: float = 6.0
    warmup: int = 20
    window: int = 128
    center: str = "mean"
    level_shift: Optional[int] = None
    spread: float = 2.0
    growth: float = 2.0
    live_after_shift: bool = False
    probation: bool = False
    hold: bool = False
    signals: Sequence[str] = ("loss", "norm")
    max_bad: int = 10


def statistics(logs: np.ndarray, center: str, warm: Optional[np.ndarray] = None, sigma=6.0):
    """(center, deviation) of a column of logarithms, the deviation floored at `FLOOR`.

    `warm` marks the entries accepted during the warm-up (for ``center="trim"``)."""
    if center == "median":
        med = float(np.median(logs))
        return med, max(MAD_SCALE * float(np.median(np.abs(logs - med))), FLOOR)
    if center == "trim" and warm is not None and warm.any():
        early = logs[warm]
        med = float(np.median(early))
        mad = max(MAD_SCALE * float(np.median(np.abs(early - med))), FLOOR)
        keep = ~warm | (np.abs(logs - med) <= sigma * mad)
        logs = logs[keep]
    return float(logs.mean()), max(float(logs.std()), FLOOR)


class Judge:
    """The state of one candidate guard over a run (see `Rule`)."""

    def __init__(self, rule: Rule):
        self.rule = rule
        self.history: List[Dict[str, float]] = []  # accepted steps' logs, oldest first
        self.warm: List[bool] = []
        self.since_reset = 0  # accepted since the statistics (re)started
        self.bad = 0  # bad steps in a row
        self.pending: List[Dict[str, float]] = []  # this streak's spike values (logs)
        self.events: List[dict] = []  # what the guard said: spikes, shifts, the stop
        self.least_std: Dict[str, float] = {}  # after a live shift: the old window's deviation
        self.on_probation = False
        self.since_shift = 0  # accepted since the last shift
        self.saved = None  # with `Rule.hold`, during the probation: the old statistics

    def z_scores(self, values: Dict[str, float]) -> Dict[str, float]:
        """The z-score of each tested, positive, finite value (0 in the warm-up)."""
        scores = {}
        live = self.since_reset >= self.rule.warmup
        for column in self.rule.signals:
            value = values.get(column, math.nan)
            if not live or not (value > 0) or not math.isfinite(value):
                scores[column] = math.inf if value == math.inf and live else 0.0
                continue
            logs = np.array([h[column] for h in self.history[-self.rule.window :]])
            warm = np.array(self.warm[-self.rule.window :])
            usable = np.isfinite(logs)
            logs, warm = logs[usable], warm[usable]
            mean, std = statistics(logs, self.rule.center, warm, self.rule.sigma)
            std = max(std, self.least_std.get(column, 0.0))
            scores[column] = (math.log(value) - mean) / std
        return scores

    def decide(self, step: int, values: Dict[str, float]) -> str:
        """What the guard does with a step whose ``values`` are given (loss, norm, ...)."""
        if not all(math.isfinite(values[c]) for c in ("loss", "norm")):
            self.pending = []
            return self._bad(step, NONFINITE, {})
        if self.saved is not None and self._back_under_old(values):
            self.history, self.warm, self.since_reset = self.saved
            self.saved, self.least_std, self.on_probation = None, {}, False
            self.events.append({"step": step, "kind": BURST})
        z = self.z_scores(values)
        if max(z.values()) > self.rule.sigma:
            self.pending.append({c: _log(values.get(c, math.nan)) for c in self.rule.signals})
            if self.on_probation:
                self.events.append({"step": step, "kind": SPIKE, "z": z})
                self.events.append({"step": step, "kind": STOP, "why": "spike on probation"})
                return STOP
            if self._is_level_shift():
                self.events.append({"step": step, "kind": SPIKE, "z": z})
                return self._adapt(step)
            return self._bad(step, SPIKE, z)
        self._accept(values)
        return ACCEPT

    def _bad(self, step: int, kind: str, z: Dict[str, float]) -> str:
        self.bad += 1
        self.events.append({"step": step, "kind": kind, "z": z})
        if self.bad >= self.rule.max_bad:
            self.events.append({"step": step, "kind": STOP})
            return STOP
        return kind

    def _accept(self, values: Dict[str, float]) -> None:
        self.history.append({c: _log(values.get(c, math.nan)) for c in self.rule.signals})
        self.warm.append(self.since_reset < self.rule.warmup)
        self.since_reset += 1
        self.since_shift += 1
        if self.since_shift >= self.rule.warmup:  # the new level's own statistics suffice
            self.least_std, self.on_probation, self.saved = {}, False, None
        self.bad = 0
        self.pending = []

    def _is_level_shift(self) -> bool:
        k = self.rule.level_shift
        if k is None or len(self.pending) < k:
            return False
        recent = self.pending[-k:]
        for column in self.rule.signals:
            logs = np.array([p[column] for p in recent])
            if not np.isfinite(logs).all():
                continue
            window = np.array([h[column] for h in self.history[-self.rule.window :]])
            _, std = statistics(window[np.isfinite(window)], "mean")
            half = k // 2
            growing = logs[-half:].mean() - logs[:half].mean() > self.rule.growth * std
            if logs.std() > self.rule.spread * std or growing:
                return False
        return True

    def _adapt(self, step: int) -> str:
        recent = self.pending[-self.rule.level_shift :]
        shown = ("loss", "norm")
        before = {c: np.nanmean([h[c] for h in self.history[-self.rule.window :]]) for c in shown}
        after = {c: np.nanmean([p[c] for p in recent]) for c in shown}
        if self.rule.live_after_shift:
            for column in self.rule.signals:
                logs = np.array([h[column] for h in self.history[-self.rule.window :]])
                logs = logs[np.isfinite(logs)]
                if len(logs):
                    self.least_std[column] = statistics(logs, self.rule.center)[1]
            self.on_probation = self.rule.probation
        self.since_shift = 0
        if self.rule.hold:
            self.saved = (self.history, self.warm, self.since_reset)
        self.history = [dict(p) for p in recent]
        self.warm = [True] * len(recent)
        self.since_reset = self.rule.warmup if self.rule.live_after_shift else len(recent)
        self.bad = 0
        self.pending = []
        self.events.append(
            {
                "step": step,
                "kind": ADAPT,
                "from": {c: math.exp(v) for c, v in before.items()},
                "to": {c: math.exp(v) for c, v in after.items()},
            }
        )
        return SHIFT_HELD if self.rule.hold else ADAPT

    def _back_under_old(self, values: Dict[str, float]) -> bool:
        """Whether every tested value is under the old statistics' threshold."""
        history, warm, _ = self.saved
        for column in self.rule.signals:
            logs = np.array([h[column] for h in history[-self.rule.window :]])
            flags = np.array(warm[-self.rule.window :])
            usable = np.isfinite(logs)
            if not usable.any() or not values.get(column, math.nan) > 0:
                continue
            mean, std = statistics(logs[usable], self.rule.center, flags[usable], self.rule.sigma)
            if (math.log(values[column]) - mean) / std > self.rule.sigma:
                return False
        return True


def _log(value: float) -> float:
    return math.log(value) if value > 0 and math.isfinite(value) else math.nan


# The candidates measured (research/spike_traces.py runs each over each run).
RULES: Dict[str, Rule] = {
    r.name: r
    for r in (
        Rule("today"),
        Rule("shift3", level_shift=3),
        Rule("shift5", level_shift=5),
        Rule("shift8", level_shift=8),
        Rule("shift5_live", level_shift=5, live_after_shift=True),
        Rule("shift3_probation", level_shift=3, live_after_shift=True, probation=True),
        Rule("shift5_probation", level_shift=5, live_after_shift=True, probation=True),
        Rule("shift5_hold", level_shift=5, live_after_shift=True, probation=True, hold=True),
        Rule("shift8_hold", level_shift=8, live_after_shift=True, probation=True, hold=True),
        Rule(
            "trim_shift5_hold",
            center="trim",
            level_shift=5,
            live_after_shift=True,
            probation=True,
            hold=True,
        ),
        Rule("median", center="median"),
        Rule("trim", center="trim"),
        Rule(
            "median_shift5_probation",
            center="median",
            level_shift=5,
            live_after_shift=True,
            probation=True,
        ),
        Rule(
            "trim_shift5_probation",
            center="trim",
            level_shift=5,
            live_after_shift=True,
            probation=True,
        ),
        Rule("update", signals=("loss", "norm", "update")),
        Rule("update_mv", signals=("loss", "norm", "update", "m_over_v")),
    )
}
