"""A new level: a run of spikes that is where training now lives, told from a divergence by
`judge_run`; the guard re-seeds the spike statistics with it and puts it on probation
(`_policy.decide`). Why: docs/guide.md, "A new level is not a spike"."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from slim_nanguard._spike import COLUMNS
from slim_nanguard._spike import FLOOR
from slim_nanguard._spike import name_of

# How many of the window's deviations (of the logarithms) a new level's values may spread
# over, and its later half lie above its earlier half.
SPREAD = 2.0
# The most a new level's typical value may lie above the old one's (docs/guide.md's bench: a
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
        why = (
            "the same values each time: the model's own state made them, not a batch; "
            if len(set(self.values)) == 1
            else ""
        )
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
