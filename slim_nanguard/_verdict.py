"""An exact finiteness verdict and the global gradient norm, from one cheap reduction pass.

A square is NaN or Inf whenever its element is, so a finite sum of squares proves every
element finite: that is the fast test, it never misses a bad value, and the same sum gives the
global gradient norm. The converse does not hold (finite elements can square and add up past
the float range), so a non-finite sum only says "maybe": then, and only then, each tensor is
tested element by element, which also says what it holds, and the norm is summed again in
float64. A good step runs none of that.

Kinds are small integers, one per tensor: ``0`` finite, ``1`` NaN, ``2`` Inf, ``3`` both
(`kind_name` turns them into the names a record carries).
"""

from __future__ import annotations

import contextlib
import math
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

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
    tensor = _values(tensor)
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


def accumulation_dtype(tensors: Sequence) -> tf.DType:
    """float64 if one of `tensors` is float64, else float32: what their reductions add in
    (half-precision values are widened first, their sums overflowing long before they do)."""
    wide = any(_values(t).dtype.base_dtype == tf.float64 for t in tensors)
    return tf.float64 if wide else tf.float32


def tensor_sums(tensors: Sequence, name: str = "sums") -> tf.Tensor:
    """One vector: the sum of each of `tensors` (NaN or Inf when an element is), in
    `accumulation_dtype`. `tf.IndexedSlices` are summed by their values."""
    dtype = accumulation_dtype(tensors)
    return tf.stack([tf.reduce_sum(_widened(_values(t), dtype)) for t in tensors], name=name)


def _values(tensor) -> tf.Tensor:
    return tensor.values if isinstance(tensor, tf.IndexedSlices) else tensor


def _widened(tensor: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    return tensor if tensor.dtype.base_dtype == dtype else tf.cast(tensor, dtype)


# The largest stack of same-shape tensors `half_squares` makes, in bytes: a larger copy costs
# more than the reductions it saves (docs/performance.md, "One reduction pass").
_STACK_BYTES = 1 << 16


def half_squares(tensors: Sequence, dtype: tf.DType) -> List[tf.Tensor]:
    """Scalars in `dtype` that add up to half the sum of squares of every element of `tensors`.

    One `tf.nn.l2_loss` per group: tensors of one dtype and static shape are stacked, up to
    `_STACK_BYTES` a stack; any other is reduced alone, widened to `dtype`. A scalar is NaN or
    Inf when an element of its group is, or when the squares add up past `dtype`'s range.
    """
    by_shape: Dict[object, List[tf.Tensor]] = {}
    for i, t in enumerate(tensors):
        v = _values(t)
        key = (v.dtype.base_dtype, tuple(v.shape.as_list())) if v.shape.is_fully_defined() else i
        by_shape.setdefault(key, []).append(v)
    halves = []
    for group in by_shape.values():
        size = group[0].shape.num_elements() or 0
        per_stack = max(1, _STACK_BYTES // max(1, size * group[0].dtype.size))
        for start in range(0, len(group), per_stack):
            chunk = group[start : start + per_stack]
            stacked = chunk[0] if len(chunk) == 1 else tf.stack(chunk, name="same_shape")
            halves.append(tf.nn.l2_loss(_widened(stacked, dtype)))
    return halves


class Verdict:
    """The finiteness test of a step and its global gradient norm, from one reduction pass.

    The fast test is the loss plus half the sum of squares of every gradient element
    (`half_squares`); when it fails, and only then, each tensor is tested by `kind_code`. A
    good step runs the group reductions, one ``AddN``, an ``IsFinite``, a ``Switch`` and a
    ``Merge`` (and the ``IsFinite`` of `ok` where it is used).

    Attributes:
      tensors: The loss (if given), then the gradients: what `kinds` describes, in order.
      total: The loss plus half the gradients' sum of squares, in `accumulation_dtype`.
      fast: ``is_finite(total)``: True proves every value finite; False means "maybe not".
      kinds: Int32 vector, the kind code of each of `tensors`; it has a value only on a step
        whose fast test failed.
      checked: A scalar that is non-finite exactly when a value of `tensors` is: `total`
        itself when the fast test passes, else 0.0 when every value is finite, NaN when one is
        NaN, else Inf.
      ok: Scalar bool, exact: ``is_finite(checked)``, True when every value of `tensors` is
        finite.
      global_norm: Float64 scalar, the square root of the sum of squares of every gradient
        element (`tf.IndexedSlices` by their values, as `tf.clip_by_global_norm` takes them):
        the fast test's reductions when that passes; else summed again in float64 on that
        branch only, so finite whenever every element is (but float64 gradients beyond about
        1e154), NaN or Inf when one is. Built on first use, in the graph and control-flow
        context of the verdict; nothing runs for it on a step that does not fetch it.
    """

    def __init__(
        self,
        gradients: Sequence,
        *,
        loss: Optional[tf.Tensor] = None,
        kinds_variable: Optional[tf.Variable] = None,
    ):
        """Builds the test in the current graph and control-flow context.

        Args:
          gradients: The gradients judged (`tf.IndexedSlices` are judged by their values).
          loss: The loss, judged as it is (not squared), or None.
          kinds_variable: An int32 variable of ``len(tensors)`` elements, or None. On a step
            whose fast test fails it is assigned `kinds` before `checked` has a value.
        """
        self.tensors = ([] if loss is None else [loss]) + list(gradients)
        self._gradients = len(gradients)
        dtype = accumulation_dtype(self.tensors)
        with tf.name_scope("verdict") as self._scope:
            halves = half_squares(gradients, dtype)
            head = [] if loss is None else [_widened(loss, dtype)]
            self.total = tf.math.add_n(head + halves, name="total")
            self.fast = tf.math.is_finite(self.total, name="fast_all_finite")
            # switch returns (output_false, output_true): the first has a value, so what is built
            # on it runs, only when the fast test failed.
            failed, self._passed = control_flow_ops.switch(self.total, self.fast)
            # A control edge from the Identity of a dead output carries deadness: nothing built
            # under it runs on a step the fast test passed.
            self._failed = tf.identity(failed, name="confirm")
            with self.when_failed():
                self.kinds = tf.stack([kind_code(t) for t in self.tensors], name="kinds")
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
                    self._confirmed = tf.gather(
                        tf.constant([0.0, np.nan, np.inf, np.nan], dtype), code
                    )
            self.checked = control_flow_ops.merge(
                [self._passed, self._confirmed], name="exact_total"
            )[0]
            self.ok = tf.math.is_finite(self.checked, name="all_finite")
        self._halves = halves
        self._global_norm = None

    @property
    def global_norm(self) -> tf.Tensor:
        """The global gradient norm (see the class docstring)."""
        if self._global_norm is None:
            with tf.name_scope(self._scope), tf.name_scope("global_norm"):
                _, cheap = control_flow_ops.switch(tf.math.add_n(list(self._halves)), self.fast)
                gradients = self.tensors[len(self.tensors) - self._gradients :]
                with self.when_failed():
                    wide = tf.math.add_n(
                        [tf.nn.l2_loss(_widened(_values(g), tf.float64)) for g in gradients]
                    )
                half = control_flow_ops.merge([_widened(cheap, tf.float64), wide])[0]
                self._global_norm = tf.sqrt(2.0 * half, name="value")
        return self._global_norm

    @contextlib.contextmanager
    def when_failed(self) -> Iterator[None]:
        """Ops built in this block run only on a step whose fast test failed (on a step it
        passed they are dead, so skipped)."""
        with tf.control_dependencies([self._failed]):
            yield

    def confirm_after(self, ops: Sequence) -> None:
        """Makes the exact test wait on `ops` (built in `when_failed`): they run before
        `checked` has a value on a step whose fast test failed, and not on any other step."""
        # The confirmed value's op is already built: TensorFlow has no public API that adds
        # an input to it.
        self._confirmed.op._add_control_inputs([getattr(op, "op", op) for op in ops])  # pylint: disable=protected-access


# The smallest loss scale of a dynamic loss-scale optimizer (`DynamicLossScale` never goes
# below 1): an overflow there is a bad step.
LOSS_SCALE_FLOOR = 1.0


def overflow_rule(failed, loss_finite, scale, *, both=lambda a, b: a and b, **name):
    """The one rule of a loss-scale overflow (not a bad step): the step `failed` the
    finiteness test, its loss is finite, and its `scale` is above `LOSS_SCALE_FLOOR`.

    The train op applies it to tensors (``both=tf.logical_and``, `name` for the op); the loop
    to what a step stored (`stored_overflow`), with Python's ``and``.
    """
    return both(failed, both(loss_finite, scale > LOSS_SCALE_FLOOR), **name)


def stored_loss_scale(stored: Sequence[float], variables: int) -> Optional[float]:
    """The loss scale in what a step stored (`_OverflowTest.sums_and_scale`: the loss, the
    sums of `variables` gradients, then the scale), or None when it holds none."""
    stored = list(stored)
    return float(stored[-1]) if len(stored) == variables + 2 else None


def stored_overflow(stored: Sequence[float], variables: int) -> bool:
    """`overflow_rule` of a non-finite step, from what it stored (`stored_loss_scale`)."""
    scale = stored_loss_scale(stored, variables)
    return scale is not None and overflow_rule(True, math.isfinite(float(stored[0])), scale)
