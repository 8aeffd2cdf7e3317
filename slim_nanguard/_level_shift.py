"""A new level: a run of spikes that is where training now lives, told from a divergence. Pure.

The spike test compares a step with the accepted steps before it, and only accepted steps
enter its statistics: a one-off spike is rejected and forgotten. But when the data changes
(new, noisier data; a resume on other data or augmentation) or the model's own state makes
the same jump again and again (a fixed batch that the frozen weights judge alike each time),
every step is a "spike" and nothing adapts: without more, the run would end in the escalation
of ``max_consecutive_bad_steps`` although nothing is wrong.

`judge_run` takes a run of ``spike_level_shift_steps`` spikes in a row as a **new level** when,
in each value that was over the threshold, the run's values hold together: the deviation of
their logarithms is at most `SPREAD` times the window's, and the later half of the run is not
above the earlier by more than `SPREAD` window deviations either; and no more than `MAX_RISE`
times the typical value before the run. The step that completes the
run is still rejected (a burst of corrupted batches shorter than the run changes nothing); the
guard then re-seeds the spike statistics with the run's values, with the old level's deviation
as the least one, so that the next step is judged at once.

Rejected steps do not move the weights, so the values of a divergence's rejected steps hold
together as well as a new level's do: a learning rate raised a thousandfold after an accepted
step gives a run as flat as new data does. What tells them apart is what follows. A new level
is on **probation** for ``spike_warmup_steps`` accepted steps: a spike then means the new level
was a divergence (`_policy.decide` applies ``persistent_nan_policy`` at once, and a rollback
goes back before the run that was taken for a level).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from slim_nanguard._spike import COLUMNS
from slim_nanguard._spike import NAMES

# How many of the window's deviations (of the logarithms) a new level's values may spread
# over, and its later half lie above its earlier half.
SPREAD = 2.0
# The most a new level may lie above the old one (typical values): a loss or gradient norm a
# hundred times the run's is no level a run lives with (new data four times noisier moves the
# loss of a regression about 16 times; a learning rate raised a thousandfold, 600 times and
# more: docs/guide.md's bench).
MAX_RISE = 100.0
# The least deviation of the logarithms (`_spike.FLOOR`).
_FLOOR = 0.05


@dataclasses.dataclass(frozen=True)
class LevelShift:
    """A run of spikes taken as the new level of training.

    Attributes:
      steps: The global steps of the run, oldest first.
      values: The run's ``(loss, grad_norm)`` pairs, oldest first: what the statistics are
        re-seeded with.
      old: The typical value of each column before the run (the geometric mean of the
        statistics' window), by name (``loss``, ``grad_norm``).
      new: The typical value of each column over the run (its geometric mean).
      floor: The deviation of the logarithms of each column before the run: the least
        deviation the re-seeded statistics judge with.
    """

    steps: Tuple[int, ...]
    values: Tuple[Tuple[float, float], ...]
    old: Dict[str, float]
    new: Dict[str, float]
    floor: Tuple[float, float] = (_FLOOR, _FLOOR)

    def describe(self) -> str:
        """One sentence for the log: what moved, from what to what, over which steps."""
        moved = ", ".join(
            f"{NAMES[c]} {self.old[c]:.4g} -> {self.new[c]:.4g}" for c in COLUMNS if c in self.new
        )
        first, last = self.steps[0], self.steps[-1]
        where = f"at global step {first}" if first == last else f"global steps {first}-{last}"
        why = (
            "the same values each time: the model's own state made them, not a batch; "
            if len(set(self.values)) == 1
            else ""
        )
        return (
            f"a new level, not a spike: {len(self.steps)} spikes in a row ({where}) hold "
            f"together at {moved} (typical values, before -> now); {why}the spike "
            "statistics start again from these values, and a spike in the next accepted "
            "steps will be taken for a divergence"
        )

    def to_json(self) -> Dict[str, object]:
        """The record's fields: ``cause`` ``"level_shift"``, the steps, old and new values."""
        return {
            "cause": "level_shift",
            "steps": list(self.steps),
            "old": dict(self.old),
            "new": dict(self.new),
            "floor": list(self.floor),
        }


def judge_run(spikes: Sequence[Mapping[str, Any]], needed: int) -> Optional[LevelShift]:
    """Whether the last `needed` spikes in a row are a new level of training.

    Args:
      spikes: The spike records of the current run of bad steps, oldest first: each has the
        ``step``, and the spike's figures (``loss``, ``grad_norm``, ``over``, ``log_mean_*``,
        ``log_std_*``) as `_spike.read_report` gives them.
      needed: How many spikes in a row it takes (``spike_level_shift_steps``); 0: never.

    Returns:
      The `LevelShift`, or None: too few spikes, they do not hold together, or they lie more
      than `MAX_RISE` times above the values before them.
    """
    if needed <= 0 or len(spikes) < needed:
        return None
    run = list(spikes)[-needed:]
    over = {c for spike in run for c in spike.get("over") or ()} or set(COLUMNS)
    floor = tuple(max(float(run[0].get(f"log_std_{c}", _FLOOR)), _FLOOR) for c in COLUMNS)
    for index, column in enumerate(COLUMNS):
        values = [float(spike[column]) for spike in run]
        if column in over and not holds_together(values, floor[index]):
            return None
    values = tuple((float(s["loss"]), float(s["grad_norm"])) for s in run)
    new = {}
    for index, column in enumerate(COLUMNS):
        logs = [math.log(v[index]) for v in values if _usable(v[index])]
        if logs:
            new[column] = math.exp(sum(logs) / len(logs))
    old = {c: math.exp(float(run[0][f"log_mean_{c}"])) for c in new}
    if any(c in over and new[c] > MAX_RISE * old[c] for c in new):
        return None
    return LevelShift(tuple(int(s["step"]) for s in run), values, old, new, floor)


def holds_together(values: Sequence[float], deviation: float) -> bool:
    """Whether `values` are one level: all positive and finite, the deviation of their
    logarithms at most `SPREAD` times `deviation` (the window's, of the logarithms), and
    the later half not above the earlier by more than that."""
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
