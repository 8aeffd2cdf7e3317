"""The spike test: is this step's loss or gradient norm far above those of the accepted steps?

A NaN is the end of a divergence, not its start: the loss or the gradient norm jumps first, the
weights take the jump, and the NaN comes later. The spike test is one more reason to close the
gate that keeps a bad step from writing anything.

The statistic is OLMo-core's: the mean and standard deviation of the last `window` (128)
accepted steps, a step being a spike when its value is more than `sigma` (6) standard
deviations above that mean, once `warmup_steps` (20) steps were accepted. A window, not an
exponential average (ZClip's): after a stretch of steep descent a window forgets the old scale
in `window` steps exactly, its figures in a record (a mean and a deviation over the last N
steps) say what a reader expects, and it costs a few scalar ops on a 128-element buffer. Like
llm.c after its fix, only accepted steps enter the statistics, so a run of outliers is never
absorbed as normal: it ends in the escalation of `max_consecutive_bad_steps`.

The statistics live in one float64 variable (a ring of `window` rows of ``[loss, norm]``) and
an int64 count of accepted steps: they are saved with each checkpoint, restored by a rollback
and read on the device, with no host round trip. A deviation is floored (see `deviation`), so
a loss that stayed constant does not call the first change a spike.

`reference_z_scores` is the same arithmetic in NumPy, pure, for tests and for reading a
record back.
"""

from __future__ import annotations

from typing import Dict, Sequence, Tuple

import numpy as np
import tensorflow as tf

# The deviation is at least this fraction of the mean's magnitude, and at least FLOOR_ABSOLUTE.
FLOOR_RELATIVE = 1e-3
FLOOR_ABSOLUTE = 1e-12
COLUMNS = ("loss", "norm")


class SpikeTest:
    """The spike test of a step, against the statistics of the accepted steps before it.

    Attributes:
      history: float64 variable ``[window, 2]``, the ``[loss, norm]`` of the last accepted
        steps (a ring, oldest overwritten).
      count: int64 variable, the number of steps accepted since the statistics began.
      mean: float64 ``[2]``, the mean loss and norm of the window (0 before any step).
      std: float64 ``[2]``, their floored deviation.
      z: float64 ``[2]``, the step's z-scores of loss and norm (0 during warm-up and for a
        value that is not finite: the finiteness test judges those).
      spike: Scalar bool, True when warm-up is over and a z-score exceeds `sigma`.
    """

    def __init__(
        self,
        loss: tf.Tensor,
        norm: tf.Tensor,
        *,
        sigma: float,
        warmup_steps: int,
        window: int = 128,
    ):
        """Builds the statistics' variables and the test; call `update` for the write.

        Args:
          loss: The step's scalar loss.
          norm: The step's global gradient norm (a scalar; float64 keeps a finite norm
            finite, float32 is widened).
          sigma: How many deviations above the mean make a spike (> 0).
          warmup_steps: Accepted steps before any step can be a spike (>= 2, <= `window`).
          window: How many accepted steps the statistics cover.
        """
        if not sigma > 0:
            raise ValueError(f"spike_sigma must be > 0; got {sigma!r}.")
        if not 2 <= warmup_steps <= window:
            raise ValueError(
                f"spike_warmup_steps must be between 2 and {window} (the window of the "
                f"statistics); got {warmup_steps!r}."
            )
        self.window, self.sigma, self.warmup_steps = window, float(sigma), int(warmup_steps)
        with tf.compat.v1.variable_scope("nanguard_spike", reuse=tf.compat.v1.AUTO_REUSE):
            self.history = tf.compat.v1.get_variable(
                "history",
                [window, len(COLUMNS)],
                tf.float64,
                tf.compat.v1.zeros_initializer(),
                trainable=False,
                use_resource=True,
            )
            self.count = tf.compat.v1.get_variable(
                "count",
                [],
                tf.int64,
                tf.compat.v1.zeros_initializer(),
                trainable=False,
                use_resource=True,
            )
        with tf.name_scope("nanguard/spike"):
            self.values = tf.stack([tf.cast(loss, tf.float64), tf.cast(norm, tf.float64)])
            count = self.count.read_value()
            n = tf.minimum(count, window)
            kept = tf.cast(tf.range(window, dtype=tf.int64) < n, tf.float64)[:, None]
            size = tf.maximum(tf.cast(n, tf.float64), 1.0)
            history = self.history.read_value()
            self.mean = tf.reduce_sum(history * kept, axis=0) / size
            spread = tf.reduce_sum(tf.square((history - self.mean) * kept), axis=0) / size
            self.std = deviation(tf.sqrt(spread), self.mean)
            finite = tf.math.is_finite(self.values)
            warm = count >= self.warmup_steps
            raw = (tf.where(finite, self.values, self.mean) - self.mean) / self.std
            self.z = tf.where(tf.logical_and(finite, warm), raw, tf.zeros_like(raw))
            self.spike = tf.reduce_any(self.z > self.sigma, name="is_spike")
            self._count_now = count

    def update(self, accepted: tf.Tensor) -> tf.Operation:
        """The write of an accepted step's values into the statistics; a step not accepted
        writes back what was there (no value changes), so the op may run on every step.

        Args:
          accepted: Scalar bool, True when the step's update was applied.
        """
        # After this step's statistics are read: the write must not race the reads.
        with tf.name_scope("nanguard/spike/update"), tf.control_dependencies([self.z, self.std]):
            row = tf.math.floormod(self._count_now, self.window)
            old = tf.gather(self.history.read_value(), row)
            new = tf.where(accepted, self.values, old)
            written = tf.compat.v1.scatter_update(self.history, [row], new[None, :])
            counted = self.count.assign_add(tf.cast(accepted, tf.int64), read_value=False)
            return tf.group(written, counted, name="update")

    def report(self) -> Dict[str, tf.Tensor]:
        """The tensors a spike's record holds: the values, their z-scores and the statistics
        they were measured against (``[loss, norm]`` each), and the count."""
        return {
            "values": self.values,
            "z": self.z,
            "mean": self.mean,
            "std": self.std,
            "count": self._count_now,
        }


def deviation(std, mean):
    """The deviation a z-score divides by: `std`, floored at ``FLOOR_RELATIVE * |mean|`` and
    ``FLOOR_ABSOLUTE`` (works on tensors and on NumPy arrays)."""
    if isinstance(std, np.ndarray) or np.isscalar(std):
        return np.maximum(std, np.maximum(FLOOR_RELATIVE * np.abs(mean), FLOOR_ABSOLUTE))
    floor = tf.maximum(FLOOR_RELATIVE * tf.abs(mean), FLOOR_ABSOLUTE)
    return tf.maximum(std, floor)


def reference_z_scores(
    accepted: Sequence[Tuple[float, float]], value: Tuple[float, float], *, window: int = 128
) -> np.ndarray:
    """The z-scores of ``value = (loss, norm)`` against the last `window` of the `accepted`
    ``(loss, norm)`` pairs, in NumPy (population deviation, floored as `deviation` does)."""
    recent = np.asarray(accepted[-window:], dtype=np.float64).reshape(-1, len(COLUMNS))
    mean = recent.mean(axis=0) if len(recent) else np.zeros(len(COLUMNS))
    std = deviation(recent.std(axis=0) if len(recent) else np.zeros(len(COLUMNS)), mean)
    return (np.asarray(value, dtype=np.float64) - mean) / std
