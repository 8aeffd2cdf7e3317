"""An exact finiteness verdict that costs a good step one sum per tensor and no more.

A sum of a tensor is NaN or Inf whenever an element is, so a sum that is finite proves every
element finite: that is the fast test, and it never misses a bad value. The converse does not
hold: finite elements can add up past the float range (1,000 elements of 1e36 in float32), so a
non-finite sum only says "maybe". The verdict is exact all the same: when the fast test fails,
and only then, each tensor is tested element by element (``reduce_any(is_nan)``,
``reduce_any(is_inf)``), which also says what it holds. A good step runs none of that.

Kinds are small integers, one per tensor: ``0`` finite, ``1`` NaN, ``2`` Inf, ``3`` both
(`kind_name` turns them into the names a record carries).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import control_flow_ops

FINITE = "finite"
NAN = "nan"
INF = "inf"
NAN_AND_INF = "nan_and_inf"

# Kind code -> name: bit 1 is "holds a NaN", bit 2 "holds an Inf".
_KIND_NAMES = (FINITE, NAN, INF, NAN_AND_INF)
# How a message says each kind.
_KIND_WORDS = {NAN: "NaN", INF: "Inf", NAN_AND_INF: "NaN and Inf"}


def kind_name(code: int) -> str:
    """``"finite"``, ``"nan"``, ``"inf"`` or ``"nan_and_inf"`` for a kind code."""
    return _KIND_NAMES[int(code) & 3]


def kind_word(kind: str) -> str:
    """How a message names a kind: ``NaN``, ``Inf`` or ``NaN and Inf``."""
    return _KIND_WORDS.get(kind, kind)


def kind_code(tensor: tf.Tensor) -> tf.Tensor:
    """Scalar int32: 1 if `tensor` holds a NaN, plus 2 if it holds an Inf (exact)."""
    if isinstance(tensor, tf.IndexedSlices):
        tensor = tensor.values
    nan = tf.cast(tf.reduce_any(tf.math.is_nan(tensor)), tf.int32)
    inf = tf.cast(tf.reduce_any(tf.math.is_inf(tensor)), tf.int32)
    return nan + 2 * inf


def describe(bad: Sequence[Tuple[str, str]], limit: int = 5) -> str:
    """Names and kinds as a phrase: ``"NaN in a, b; Inf in c"``.

    Args:
      bad: ``(name, kind)`` pairs, kinds as `kind_name` gives them.
      limit: At most this many names per kind; the rest are counted.
    """
    parts = []
    for kind in (NAN, INF, NAN_AND_INF):
        names = [name for name, k in bad if k == kind]
        if names:
            more = f" and {len(names) - limit} more" if len(names) > limit else ""
            parts.append(f"{kind_word(kind)} in {', '.join(names[:limit])}{more}")
    return "; ".join(parts)


class Verdict:
    """The finiteness test of a step: a fast sum, confirmed exactly on its failure only.

    A good step (the fast test passes) runs the sum, two ``IsFinite``, one ``Switch`` and one
    ``Merge``; the element-wise test runs only where the fast test failed. (A ``Switch`` of
    the test on itself would save an ``IsFinite``, but TensorFlow's constant folding turns its
    outputs into constants with a control edge each, which costs more.)

    Attributes:
      total: The sum of `sums` (scalar).
      fast: ``is_finite(total)``: True proves every value finite; False means "maybe not".
      kinds: Int32 vector, the kind code of each of `tensors`; it has a value only on a step
        whose fast test failed.
      checked: A scalar that is non-finite exactly when a value of `tensors` is: `total`
        itself when the fast test passes (so a check of it costs what a check of `total`
        did), else 0.0 when every value is finite, NaN when one is NaN, else Inf.
      ok: Scalar bool, exact: ``is_finite(checked)``, True when every value of `tensors` is
        finite.
    """

    def __init__(
        self,
        tensors: Sequence[tf.Tensor],
        sums: tf.Tensor,
        kinds_variable: Optional[tf.Variable] = None,
    ):
        """Builds the test.

        Args:
          tensors: The values judged (a loss, gradients; `tf.IndexedSlices` are judged by
            their values).
          sums: A vector whose sum is non-finite whenever a value of `tensors` is (the sum of
            each tensor, say).
          kinds_variable: An int32 variable of ``len(tensors)`` elements, or None. On a step
            whose fast test fails it is assigned `kinds` before `checked` has a value.
        """
        with tf.name_scope("verdict"):
            self.total = tf.reduce_sum(sums)
            self.fast = tf.math.is_finite(self.total, name="fast_all_finite")
            # switch returns (output_false, output_true): the first has a value, so what is built
            # on it runs, only when the fast test failed.
            failed, passed = control_flow_ops.switch(self.total, self.fast)
            # A control edge from the Identity of a dead output carries deadness: nothing built
            # under it runs on a step the fast test passed.
            with tf.control_dependencies([tf.identity(failed, name="confirm")]):
                self.kinds = tf.stack([kind_code(t) for t in tensors], name="kinds")
                stored = (
                    []
                    if kinds_variable is None
                    else [kinds_variable.assign(self.kinds, read_value=False)]
                )
                with tf.control_dependencies(stored):
                    nan = tf.reduce_any(tf.equal(tf.bitwise.bitwise_and(self.kinds, 1), 1))
                    inf = tf.reduce_any(tf.greater_equal(self.kinds, 2))
                    code = tf.cast(nan, tf.int32) + 2 * tf.cast(inf, tf.int32)
                    # finite, NaN, Inf, both (NaN: what CheckNumerics names first).
                    confirmed = tf.gather(
                        tf.constant([0.0, np.nan, np.inf, np.nan], self.total.dtype), code
                    )
            self.checked = control_flow_ops.merge([passed, confirmed], name="exact_total")[0]
            self.ok = tf.math.is_finite(self.checked, name="all_finite")
