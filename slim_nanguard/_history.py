"""The losses of the good steps before a bad step, kept for its record.

TensorBoard summaries come every hundred steps or so, so a divergence that takes a few steps
falls between two of them. The loops see the loss of every step anyway (it is the value of
the train op they fetch), so the guard keeps the last few in a ring buffer, at the cost of a
list append on a good step, and a bad step's record carries them (``losses_before``).

A loop gives the loss of a good step, not its step: the global step is read exactly only on
a bad step. The good steps since the previous bad step (or overflow step, or rollback) each
moved the global step by one, so they are numbered back from the bad step: the last one was
attempted at the bad step's global step minus 1. (In a cluster the other workers move the
global step too: the steps are then this worker's count back from the bad step.)
"""

from __future__ import annotations

import collections
import math
from typing import Deque, List, Optional, Tuple


class LossHistory:
    """A ring buffer of ``[step, loss]`` for the last `size` good steps.

    Args:
      size: How many points to keep; 0 keeps none.
    """

    def __init__(self, size: int):
        self._points: Deque[List] = collections.deque(maxlen=size)
        self._unnumbered = 0  # the newest points, whose step is not known yet

    def add(self, loss: float) -> None:
        """Notes the loss of a good step (its step is numbered by the next `anchor`)."""
        if self._points.maxlen and math.isfinite(loss):
            self._points.append([None, float(loss)])
            self._unnumbered = min(self._unnumbered + 1, len(self._points))

    def anchor(self, step: int) -> List[Tuple[int, float]]:
        """Numbers the good steps before a step attempted at global `step` (a bad step, or an
        overflow step: neither moves the global step); returns every point kept, oldest
        first.

        Without a global step (`step` < 0) the points stay unnumbered and none is returned.
        """
        if step < 0:
            return []
        for back in range(1, self._unnumbered + 1):
            self._points[-back][0] = step - back
        self._unnumbered = 0
        return [(s, loss) for s, loss in self._points if s is not None]

    def points(self) -> List[Tuple[int, float]]:
        """The numbered points kept, oldest first (those `anchor` numbered)."""
        return [(s, loss) for s, loss in self._points if s is not None]

    def clear(self) -> None:
        """Forgets every point: after a rollback the steps start again from a checkpoint's."""
        self._points.clear()
        self._unnumbered = 0


# A loss this many times the typical loss of the steps before is part of a climb.
CLIMB_FACTOR = 2.0


def climb_start(losses: List[Tuple[int, float]], before: int) -> Optional[int]:
    """The step at which the losses started climbing to a bad step at `before`, or None. Pure.

    The typical loss is the median of the older half of the points before `before`; the
    climb is the run of the newest points each above `CLIMB_FACTOR` times it, ending right
    before `before` (a learning rate that jumped: accepted steps whose loss grew, then the bad
    ones). None when the last point before `before` is not part of a climb, or there are
    fewer than four points.

    Args:
      losses: ``(step, loss)`` of good steps, oldest first.
      before: The global step of the first bad step.
    """
    points = [(s, v) for s, v in losses if s < before and math.isfinite(v)]
    if len(points) < 4:
        return None
    older = sorted(v for _, v in points[: len(points) // 2])
    typical = older[len(older) // 2]
    if typical <= 0:  # No factor of a loss that is not positive means a climb.
        return None
    start = None
    for step, value in reversed(points):
        if value <= CLIMB_FACTOR * typical:
            break
        start = step
    return start
