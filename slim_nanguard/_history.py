"""The losses of the good steps before a bad step, kept for its record (``losses_before``):
a good step gives its loss, not its step; `LossHistory.anchor` numbers them back from the next
bad step's global step, one per good step (in a cluster: this worker's count)."""

from __future__ import annotations

import collections
import itertools
import math
from typing import Deque, List, Optional, Tuple


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


# A loss this many times the typical loss of the steps before is part of a climb.
CLIMB_FACTOR = 2.0


def climb_start(losses: List[Tuple[int, float]], before: int) -> Optional[int]:
    """The step at which the ``(step, loss)`` of good steps, oldest first, started climbing to
    the first bad step, at global step `before`: the run of the newest points before it each
    above `CLIMB_FACTOR` times the median of the older half. None without one, or with fewer
    than four points."""
    points = [(s, v) for s, v in losses if s < before and math.isfinite(v)]
    if len(points) < 4:
        return None
    older = sorted(v for _, v in points[: len(points) // 2])
    typical = older[len(older) // 2]
    if typical <= 0:  # No factor of a loss that is not positive means a climb.
        return None
    climb = list(itertools.takewhile(lambda p: p[1] > CLIMB_FACTOR * typical, reversed(points)))
    return climb[-1][0] if climb else None


def climb_advice(climb: int, checkpoint: Optional[str], policy: str) -> str:
    """What `raise` and `stop` say when the accepted steps before a bad step were climbing from
    global step `climb` on: `checkpoint` (None: none is kept) predates the climb, and `policy`
    (``nan_policy=``, ``--spike_policy=``: the flag of the reason that rejected the step) may
    roll back."""
    resume = (
        f"resume from {checkpoint}, the newest checkpoint from before the climb,"
        if checkpoint
        else "no checkpoint predates the climb: train again"
    )
    return (
        f"the accepted steps before the bad step were already climbing from global step {climb} "
        f"on, so the last accepted state is not a good one: {resume} with a lower learning rate, "
        f"or use {policy}rollback, which goes back before the climb"
    )
