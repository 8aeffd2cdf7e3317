"""An exact finiteness verdict and the global gradient norm, from one cheap reduction pass.

A finite sum of squares proves every element finite (and gives the norm); a non-finite one
only says "maybe" (finite squares can overflow): then, and only then, each tensor is tested
element by element and the norm summed again in float64.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import control_flow_ops

from slim_nanguard import _placement

FINITE = "finite"
NAN = "nan"
INF = "inf"
NAN_AND_INF = "nan_and_inf"

# Kind code -> name: bit 1 is "holds a NaN", bit 2 "holds an Inf".
_KIND_NAMES = (FINITE, NAN, INF, NAN_AND_INF)
_KIND_WORDS = {NAN: "NaN", INF: "Inf", NAN_AND_INF: "NaN and Inf"}


def kind_names(codes: Sequence[int]) -> Tuple[str, ...]:
    """``"finite"``, ``"nan"``, ``"inf"`` or ``"nan_and_inf"`` for each kind code."""
    return tuple(_KIND_NAMES[int(code) & 3] for code in codes)


def kind_word(kind: str) -> str:
    """How a message names a kind: ``NaN``, ``Inf`` or ``NaN and Inf``."""
    return _KIND_WORDS.get(kind, kind)


def kind_flags(tensors: Sequence) -> tf.Tensor:
    """Int32 [len(tensors), 2]: whether each of `tensors` holds a NaN, and an Inf (exact).

    Tensors of one device and dtype are laid end to end in chunks (`_chunk_flags`: about 15
    ops a chunk and a reshape a tensor, on a failed step only); a tensor alone in its chunk (of
    unknown size, or large) takes four ops of its own. One vector comes from each device."""
    groups: Dict[object, List[Tuple[int, tf.Tensor]]] = {}
    for i, v in enumerate(map(_placement.values_of, tensors)):
        static = v.shape.is_fully_defined()
        key = (_placement.device_of(v), v.dtype.base_dtype) if static else i
        groups.setdefault(key, []).append((i, v))
    by_device: Dict[str, List[tf.Tensor]] = {}
    order: Dict[str, List[int]] = {}  # The indices of each device's flags, in order.
    for members in groups.values():
        for chunk in _chunks(members, _CHUNK_BYTES, _CHUNK_ELEMENTS):
            first = chunk[0][1]
            with _placement.beside(first):
                if len(chunk) > 1:
                    flags = _chunk_flags([v for _, v in chunk])
                else:  # Alone: whether it holds a NaN, an Inf.
                    tests = (tf.math.is_nan, tf.math.is_inf)
                    flags = tf.stack([tf.reduce_any(test(first)) for test in tests])
            device = _placement.device_of(first)
            by_device.setdefault(device, []).append(flags)
            order.setdefault(device, []).extend(i for i, _ in chunk)
    parts = _one_a_device(by_device, lambda flags: tf.concat(flags, 0))
    flags = tf.reshape(tf.cast(tf.concat(parts, 0), tf.int32), [-1, 2])
    return tf.gather(flags, np.argsort([i for indices in order.values() for i in indices]))


# A chunk's elements and bytes at most (a larger tensor is alone): on a failed step its copy,
# flags and float32 counts (exact up to 2**24) take up to 30 bytes an element: 120 MiB.
_CHUNK_ELEMENTS = 1 << 22
_CHUNK_BYTES = 1 << 24


def _chunks(
    members: Sequence[Tuple[int, tf.Tensor]], max_bytes: int, max_elements: float = math.inf
) -> Iterator[list]:
    """`members` (of one dtype) in runs of at most `max_elements` and `max_bytes` (a larger
    one alone)."""
    chunk, elements = [], 0
    for i, v in members:
        n = v.shape.num_elements() or 0
        total = elements + n  # One dtype: its bytes are total * v.dtype.size.
        if chunk and (total > max_elements or total * v.dtype.size > max_bytes):
            yield chunk
            chunk, elements = [], 0
        chunk.append((i, v))
        elements += n
    if chunk:
        yield chunk


def _one_a_device(parts: Dict[str, List[tf.Tensor]], combine) -> List[tf.Tensor]:
    """One tensor a device: its `parts` combined (`combine` of a list) beside the first."""
    combined = []
    for group in parts.values():
        with _placement.beside(group[0]):
            combined.append(group[0] if len(group) == 1 else combine(group))
    return combined


def _chunk_flags(chunk: Sequence[tf.Tensor]) -> tf.Tensor:
    """Bool [2 * len(chunk)]: whether each of `chunk` (two or more tensors of one dtype and
    static shapes) holds a NaN, and an Inf. The running counts of NaNs and of Infs over the
    tensors laid end to end, read at each tensor's start and end (exact: float32 counts
    integers up to 2**24 exactly)."""
    line = tf.constant([-1])  # One shape for every reshape.
    flat = tf.concat([v if v.shape.rank == 1 else tf.reshape(v, line) for v in chunk], 0)
    bad = tf.cast(tf.stack([tf.math.is_nan(flat), tf.math.is_inf(flat)]), tf.float32)
    counts = tf.concat([tf.zeros([2, 1]), tf.cumsum(bad, axis=1)], 1)  # [2, 1 + elements]
    ends = np.cumsum([0] + [v.shape.num_elements() for v in chunk])
    grew = tf.gather(counts, ends[1:], axis=1) > tf.gather(counts, ends[:-1], axis=1)
    return tf.reshape(tf.transpose(grew), [-1])


def value_kind(value: np.ndarray) -> str:
    """`kind_names`' name of what a fetched array holds (exact; half precision widened)."""
    value = np.asarray(value)
    if value.dtype not in (np.float32, np.float64):
        value = value.astype(np.float32)
    return _KIND_NAMES[int(np.isnan(value).any()) + 2 * int(np.isinf(value).any())]


def listed(names: Sequence[str], limit: int = 5) -> str:
    """``"a, b and 3 more"``: `names`, at most `limit` of them by name."""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def describe(bad: Sequence[Tuple[str, str]]) -> str:
    """``(name, kind)`` pairs as ``"NaN in a, b; Inf in c"``, at most 5 names a kind."""
    kinds = [(kind, [name for name, k in bad if k == kind]) for kind in (NAN, INF, NAN_AND_INF)]
    return "; ".join(f"{kind_word(k)} in {listed(names)}" for k, names in kinds if names)


def _widened(tensor: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    return tensor if tensor.dtype.base_dtype == dtype else tf.cast(tensor, dtype)


# The largest stack of same-shape tensors `half_squares` makes, in bytes: a larger copy costs
# more than the reductions it saves (docs/performance.md, "One reduction pass").
_STACK_BYTES = 1 << 16


def half_squares(tensors: Sequence, dtype: tf.DType) -> List[tf.Tensor]:
    """Scalars in `dtype` adding up to half the sum of squares of `tensors`, one a device: one
    `l2_loss` per stack of same device, dtype and static shape (up to `_STACK_BYTES`), or per
    other tensor, each beside its tensors."""
    by_shape: Dict[object, List[Tuple[int, tf.Tensor]]] = {}
    for i, v in enumerate(map(_placement.values_of, tensors)):
        shape = (v.dtype.base_dtype, tuple(v.shape.as_list())) if v.shape.is_fully_defined() else i
        by_shape.setdefault((_placement.device_of(v), shape), []).append((i, v))
    by_device: Dict[str, List[tf.Tensor]] = {}
    for (device, _), group in by_shape.items():
        for chunk in _chunks(group, _STACK_BYTES):
            stack = [v for _, v in chunk]
            with _placement.beside(stack[0]):
                stacked = stack[0] if len(stack) == 1 else tf.stack(stack, name="same_shape")
                by_device.setdefault(device, []).append(tf.nn.l2_loss(_widened(stacked, dtype)))
    # One scalar a device: what a good step sends between devices.
    return _one_a_device(by_device, tf.math.add_n)


class Verdict:
    """The finiteness test of a step (loss and gradients) and its global gradient norm.

    Attributes:
      tensors: The loss (if given), then the gradients: what `kinds` describes, in order.
      fast: ``is_finite(total)``, the loss plus half the gradients' sum of squares: True
        proves every value finite; False means "maybe not".
      kinds: Int32 vector, 1 if that of `tensors` holds a NaN, plus 2 if an Inf; only on a
        failed fast test.
      checked: Scalar, non-finite exactly when a value of `tensors` is: `total` when the fast
        test passes, else 0.0, NaN (one is NaN) or Inf. `ok` is ``is_finite(checked)``.
    """

    def __init__(self, gradients: Sequence, *, loss: Optional[tf.Tensor] = None):
        self.tensors = ([] if loss is None else [loss]) + list(gradients)
        self._gradients = list(gradients)
        # float64 if a value is, else float32 (half precision's sums overflow early).
        wide = any(_placement.values_of(t).dtype.base_dtype == tf.float64 for t in self.tensors)
        dtype = tf.float64 if wide else tf.float32
        with tf.name_scope("verdict") as self._scope:
            self._halves = half_squares(gradients, dtype)
            head = [] if loss is None else [_widened(loss, dtype)]
            self.total = tf.math.add_n(head + self._halves, name="total")
            self.fast = tf.math.is_finite(self.total, name="fast_all_finite")
            # A control edge from the Identity of a dead Switch output carries deadness: what
            # waits on `_failed` runs only when the fast test failed.
            failed, passed = control_flow_ops.switch(self.total, self.fast)
            self._failed = tf.identity(failed, name="confirm")
            with self.when_failed():
                flags = kind_flags(self.tensors)
                self.kinds = tf.reduce_sum(flags * [1, 2], 1, name="kinds")
                self._code = code = tf.reduce_sum(tf.reduce_max(flags, 0) * [1, 2])
                # finite, NaN, Inf, both (NaN: what CheckNumerics names first).
                self._confirmed = tf.gather(tf.constant([0.0, np.nan, np.inf, np.nan], dtype), code)
            self.checked = control_flow_ops.merge([passed, self._confirmed], name="exact_total")[0]
            self.ok = tf.math.is_finite(self.checked, name="all_finite")

    @functools.cached_property
    def global_norm(self) -> tf.Tensor:
        """Float64 global gradient norm, built on first use: the fast test's sums when it passes,
        else summed again in float64 on that branch only (finite up to about 1e154)."""
        with tf.name_scope(self._scope), tf.name_scope("global_norm"):
            _, cheap = control_flow_ops.switch(tf.math.add_n(list(self._halves)), self.fast)
            with self.when_failed():
                wide = tf.math.add_n(half_squares(self._gradients, tf.float64))
            half = control_flow_ops.merge([_widened(cheap, tf.float64), wide])[0]
            return tf.sqrt(2.0 * half, name="value")

    @contextlib.contextmanager
    def when_failed(self) -> Iterator[None]:
        """Ops built in this block run only on a step whose fast test failed."""
        with tf.control_dependencies([self._failed]):
            yield

    def store_kinds(self, variable: tf.Variable) -> None:
        """Makes a failed fast test that finds a NaN or Inf assign `kinds` to `variable` (int64)
        before it confirms; one that finds every value finite (an overflow) writes nothing, so
        that what a bad step stored stays until it is read."""
        with tf.name_scope(self._scope), self.when_failed():
            kinds = tf.cast(self.kinds, tf.int64)
            untouched, written = control_flow_ops.switch(kinds, self._code > 0)
            with tf.control_dependencies([variable.assign(written, read_value=False)]):
                written = tf.identity(written)
            self.confirm_after([control_flow_ops.merge([untouched, written])[0]])

    def confirm_after(self, ops: Sequence) -> None:
        """Makes the exact test wait on `ops` (built in `when_failed`)."""
        # The confirmed value's op is already built: no public API adds an input to it.
        self._confirmed.op._add_control_inputs([getattr(op, "op", op) for op in ops])  # pylint: disable=protected-access


# The smallest loss scale of a dynamic loss-scale optimizer (`DynamicLossScale` never goes
# below 1): an overflow there is a bad step.
LOSS_SCALE_FLOOR = 1.0


def overflow_rule(failed, loss_finite, scale, *, both=lambda a, b: a and b, **name):
    """A loss-scale overflow (not a bad step): the step `failed` the finiteness test, its
    loss is finite, and its `scale` is above `LOSS_SCALE_FLOOR`. On tensors, pass
    ``both=tf.logical_and`` (and `name`)."""
    return both(failed, both(loss_finite, scale > LOSS_SCALE_FLOOR), **name)


def stored_loss_scale(stored: Sequence[float]) -> Optional[float]:
    """The loss scale after the loss a step stored (`StepTest.kept`), or None."""
    return float(stored[-1]) if len(stored) == 2 else None


def stored_overflow(stored: Sequence[float]) -> bool:
    """`overflow_rule` of a non-finite step, from what it stored (`stored_loss_scale`)."""
    scale = stored_loss_scale(stored)
    return scale is not None and overflow_rule(True, math.isfinite(float(stored[0])), scale)
