"""A new level: a run of spikes that is where training now lives, told from a divergence. Pure.

The spike test compares a step with the accepted steps before it, and only accepted steps
enter its statistics: a one-off spike is rejected and forgotten. But when the data changes
(new, noisier data; a resume on other data or augmentation) or the model's own state makes
the same jump again and again (a fixed batch that the frozen weights judge alike each time),
every step is a spike and nothing adapts: the run ends in the escalation of
``max_consecutive_bad_steps``, although nothing is wrong.

`judge_run` tells such a **new level** from a divergence. A run of
``spike_level_shift_steps`` spikes in a row is a new level when, in each value that was over
the threshold, the run's values hold together: the logarithms lie within `SPREAD` of each
other, and the second half of the run is not above the first by more than `GROWTH`. A
rejected step changes no weight, so a run of spikes under frozen weights only grows when the
input does; a divergence shows itself after it is accepted, which is why a second new level
within `PROBATION` accepted steps of the first is refused (`Refusal`): the run then escalates
as before. The guard then re-seeds the spike statistics with the run's values (they warm up
from there) and carries on.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Mapping, Optional, Sequence, Tuple

# The values a spike is judged on, in the order of a spike record's fields.
COLUMNS = ("loss", "grad_norm")
# How far apart (in natural logarithm) the values of a new level may lie: a factor of 4.
SPREAD = math.log(4.0)
# How far the second half of the run may lie above the first (log of the geometric means).
GROWTH = math.log(1.5)
# Accepted steps after a new level during which another one is a divergence, not a level.
PROBATION = 128


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
    """

    steps: Tuple[int, ...]
    values: Tuple[Tuple[float, float], ...]
    old: Dict[str, float]
    new: Dict[str, float]

    def describe(self) -> str:
        """One sentence for the log: what moved, from what to what, over which steps."""
        moved = ", ".join(
            f"{_NAMES[c]} {self.old[c]:.4g} -> {self.new[c]:.4g}" for c in COLUMNS if c in self.new
        )
        first, last = self.steps[0], self.steps[-1]
        where = f"at global step {first}" if first == last else f"global steps {first}-{last}"
        return (
            f"a new level, not a spike: {len(self.steps)} spikes in a row ({where}) hold "
            f"together at {moved} (typical values, before -> now); the spike statistics "
            "start again from these values and the run goes on"
        )

    def to_json(self) -> Dict[str, object]:
        """The record's fields: ``cause`` ``"level_shift"``, the steps, old and new values."""
        return {
            "cause": "level_shift",
            "steps": list(self.steps),
            "old": dict(self.old),
            "new": dict(self.new),
        }


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A run that holds together but came too soon after the last new level (a divergence).

    Attributes:
      reason: Why it is not taken as a new level, for the log.
    """

    reason: str


_NAMES = {"loss": "loss", "grad_norm": "gradient norm"}


def judge_run(
    spikes: Sequence[Mapping[str, object]],
    needed: int,
    *,
    steps_since_last: Optional[int] = None,
) -> Optional[object]:
    """Whether the last `needed` spikes in a row are a new level of training.

    Args:
      spikes: The spike records of the current run of bad steps, oldest first: each has the
        ``step``, and the spike's figures (``loss``, ``grad_norm``, ``over``, ``log_mean_*``)
        as `_spike.read_report` gives them.
      needed: How many spikes in a row it takes (``spike_level_shift_steps``); 0: never.
      steps_since_last: Accepted steps since the last new level, or None if there was none.

    Returns:
      A `LevelShift`, a `Refusal` (the run holds together but comes within `PROBATION`
      accepted steps of the last new level), or None (too few spikes, or they do not hold
      together: a divergence or unrelated spikes).
    """
    if needed <= 0 or len(spikes) < needed:
        return None
    run = list(spikes)[-needed:]
    over = {c for spike in run for c in spike.get("over") or ()} or set(COLUMNS)
    for column in COLUMNS:
        values = [float(spike[column]) for spike in run]
        if column in over and not holds_together(values):
            return None
    if steps_since_last is not None and steps_since_last < PROBATION:
        return Refusal(
            f"{needed} spikes in a row hold together, but only {steps_since_last} steps were "
            f"accepted since the last new level (fewer than {PROBATION}): a divergence, not a "
            "new level"
        )
    values = tuple((float(s["loss"]), float(s["grad_norm"])) for s in run)
    new = {}
    for index, column in enumerate(COLUMNS):
        logs = [math.log(v[index]) for v in values if _usable(v[index])]
        if logs:
            new[column] = math.exp(sum(logs) / len(logs))
    old = {c: math.exp(float(run[0][f"log_mean_{c}"])) for c in new}
    return LevelShift(tuple(int(s["step"]) for s in run), values, old, new)


def holds_together(values: Sequence[float]) -> bool:
    """Whether `values` are one level: all positive and finite, their logarithms within
    `SPREAD` of each other, and the later half not above the earlier by more than `GROWTH`."""
    if len(values) < 2 or not all(_usable(v) for v in values):
        return False
    logs = [math.log(v) for v in values]
    if max(logs) - min(logs) > SPREAD:
        return False
    half = len(logs) // 2
    early, late = logs[:half], logs[len(logs) - half :]
    return sum(late) / len(late) - sum(early) / len(early) <= GROWTH


def _usable(value: float) -> bool:
    return math.isfinite(value) and value > 0
