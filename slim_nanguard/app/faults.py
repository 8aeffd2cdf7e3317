"""Fault injection: corrupt one chosen batch, loss or gradient, to watch the guard work.

A fault is a kind and a batch index, written ``KIND:STEP`` (the launcher's
``--inject_fault``), or ``KIND:FIRST-LAST`` for a run of consecutive batches::

    nan_input:40        one NaN pixel in the images of batch 40
    inf_input:40        one +Inf pixel in the images of batch 40
    nan_loss:40         the loss of batch 40 is NaN (its gradients stay finite)
    inf_loss:40         the loss of batch 40 is +Inf (its gradients stay finite)
    nan_gradient:40     the loss of batch 40 is finite, but every gradient is NaN
    spike_input:40      the images of batch 40 scaled by 1,000: finite, a loss spike
    nan_loss:40-49      ten bad batches in a row (watch max_consecutive_bad_steps)

The index counts the batches the input pipeline hands out, from 0, carried with the data
(`enumerate_batches`), not the global step. So a bad batch is bad once: the ``skip`` policy
steps over it and the next batch is clean, a ``rollback`` goes back to an earlier global step
without meeting the fault again, and in a fresh run with no earlier bad step batch ``STEP``
is the one trained at global step ``STEP``. Rollback's skipped batches count too.

How it is wired (what `slim_nanguard.app.build` does)::

    faults = FaultSpec.parse_list("nan_input:40,nan_loss:80")
    dataset = enumerate_batches(dataset)                 # (batch_index, (images, labels))
    index, (images, labels) = iterator.get_next()
    injector = FaultInjector(faults, index)
    images = injector.corrupt_images(images)
    ...model, loss...
    total_loss = injector.corrupt_loss(total_loss)

Everything is in the graph (``tf.where`` on ``batch_index == STEP``): no feed, no Python in
the step, so the train op and the guard see exactly what a real fault would give them.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Sequence, Tuple

import tensorflow as tf

__all__ = [
    "FAULT_KINDS",
    "INPUT_KINDS",
    "LOSS_KINDS",
    "FaultInjector",
    "FaultSpec",
    "enumerate_batches",
]

NAN_INPUT = "nan_input"
INF_INPUT = "inf_input"
NAN_LOSS = "nan_loss"
INF_LOSS = "inf_loss"
NAN_GRADIENT = "nan_gradient"
SPIKE_INPUT = "spike_input"
SPIKE_SCALE = 1000.0

INPUT_KINDS = (NAN_INPUT, INF_INPUT, SPIKE_INPUT)
LOSS_KINDS = (NAN_LOSS, INF_LOSS, NAN_GRADIENT)
FAULT_KINDS = INPUT_KINDS + LOSS_KINDS

_SPEC = re.compile(r"^\s*([a-z_]+)\s*:\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


@dataclasses.dataclass(frozen=True)
class FaultSpec:
    """One injected fault: a kind and the batches it hits.

    Attributes:
      kind: One of `FAULT_KINDS`.
      first: Index of the first bad batch (0 is the first batch of the run).
      last: Index of the last bad batch (inclusive); equal to `first` for a single batch.
    """

    kind: str
    first: int
    last: int = -1

    def __post_init__(self):
        if self.kind not in FAULT_KINDS:
            raise ValueError(
                f"unknown fault kind {self.kind!r}: choose one of {', '.join(FAULT_KINDS)}."
            )
        if isinstance(self.first, bool) or not isinstance(self.first, int) or self.first < 0:
            raise ValueError(
                f"the batch index of a fault must be an integer >= 0; got {self.first!r}."
            )
        if self.last == -1:
            object.__setattr__(self, "last", self.first)
        if isinstance(self.last, bool) or not isinstance(self.last, int) or self.last < self.first:
            raise ValueError(
                f"the last batch of fault {self.kind}:{self.first}-{self.last} comes "
                "before its first; write KIND:FIRST-LAST with FIRST <= LAST."
            )

    @classmethod
    def parse(cls, text: str) -> "FaultSpec":
        """Parses ``KIND:STEP`` or ``KIND:FIRST-LAST``.

        Raises:
          ValueError: The text is not of that form, or names an unknown kind; the message
            quotes the text and lists the kinds.
        """
        match = _SPEC.match(text or "")
        if not match:
            raise ValueError(
                f"fault {text!r} is not KIND:STEP or KIND:FIRST-LAST (for example "
                f"nan_input:40); KIND is one of {', '.join(FAULT_KINDS)}."
            )
        kind, first, last = match.group(1), int(match.group(2)), match.group(3)
        if kind not in FAULT_KINDS:
            raise ValueError(
                f"fault {text!r} has the unknown kind {kind!r}: choose one of "
                f"{', '.join(FAULT_KINDS)}."
            )
        return cls(kind, first, int(last) if last is not None else first)

    @classmethod
    def parse_list(cls, texts: "str | Iterable[str]") -> Tuple["FaultSpec", ...]:
        """Parses a comma-separated string, or a sequence of strings; empty items are ignored."""
        if isinstance(texts, str):
            texts = texts.split(",")
        return tuple(cls.parse(t) for t in texts if t and t.strip())

    def __str__(self) -> str:
        if self.last == self.first:
            return f"{self.kind}:{self.first}"
        return f"{self.kind}:{self.first}-{self.last}"

    def hits(self, batch_index: tf.Tensor) -> tf.Tensor:
        """A boolean scalar tensor: does this fault hit the batch `batch_index`?"""
        index = tf.cast(batch_index, tf.int64)
        if self.first == self.last:
            return tf.equal(index, self.first)
        return tf.logical_and(index >= self.first, index <= self.last)


def enumerate_batches(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """The batches of `dataset`, each with its int64 index: ``(index, batch)``."""
    return dataset.enumerate()


def _nan_gradient_on(loss: tf.Tensor, hit: tf.Tensor) -> tf.Tensor:
    """`loss` unchanged, with its gradient times NaN when `hit` (an identity otherwise)."""

    # A custom gradient, because the usual tricks (0 * sqrt(0), 0 * norm(0)) give 0, not NaN:
    # TensorFlow's SqrtGrad returns 0 where the incoming gradient is 0.
    @tf.custom_gradient
    def identity_with_nan_gradient(x):
        def grad(dy):
            return dy * tf.where(
                hit, tf.constant(float("nan"), dy.dtype), tf.constant(1.0, dy.dtype)
            )

        return tf.identity(x), grad

    return identity_with_nan_gradient(loss)


def _any(flags: Sequence[tf.Tensor]) -> tf.Tensor:
    if not flags:
        return tf.constant(False)
    if len(flags) == 1:
        return flags[0]
    return tf.reduce_any(tf.stack(flags))


class FaultInjector:
    """Builds the in-graph corruption of the batches, loss and gradients `faults` name.

    Args:
      faults: The faults to inject (`FaultSpec`s, or strings `FaultSpec.parse` accepts).
      batch_index: The int64 scalar index of the current batch (from `enumerate_batches`).
    """

    def __init__(self, faults: Iterable, batch_index: tf.Tensor):
        self.faults = tuple(f if isinstance(f, FaultSpec) else FaultSpec.parse(f) for f in faults)
        self.batch_index = batch_index

    def _hit(self, kinds: Sequence[str]) -> tf.Tensor:
        return _any([f.hits(self.batch_index) for f in self.faults if f.kind in kinds])

    def _has(self, kinds: Sequence[str]) -> bool:
        return any(f.kind in kinds for f in self.faults)

    def corrupt_images(self, images: tf.Tensor) -> tf.Tensor:
        """`images` with its first value NaN (``nan_input``) or +Inf (``inf_input``), or all its
        values times `SPIKE_SCALE` (``spike_input``, finite), on a hit."""
        if not self._has(INPUT_KINDS):
            return images
        with tf.name_scope("inject_fault/input"):
            if self._has([SPIKE_INPUT]):
                scale = tf.where(self._hit([SPIKE_INPUT]), SPIKE_SCALE, 1.0)
                images = images * tf.cast(scale, images.dtype)
            if not self._has([NAN_INPUT, INF_INPUT]):
                return images
            first = tf.reshape(images, [-1])[0]
            value = first
            for kind, bad in ((NAN_INPUT, float("nan")), (INF_INPUT, float("inf"))):
                if self._has([kind]):
                    value = tf.where(self._hit([kind]), tf.constant(bad, images.dtype), value)
            index = tf.zeros([1, images.shape.rank], tf.int32)
            return tf.tensor_scatter_nd_update(images, index, tf.reshape(value, [1]))

    def corrupt_loss(self, loss: tf.Tensor) -> tf.Tensor:
        """`loss` made NaN or +Inf (gradients finite), or with NaN gradients (loss finite).

        ``nan_gradient`` passes the loss through an identity whose gradient is multiplied by
        NaN on a hit (by 1 otherwise): the loss keeps its finite value, and the gradient of
        every variable the loss depends on is NaN.
        """
        if not self._has(LOSS_KINDS):
            return loss
        with tf.name_scope("inject_fault/loss"):
            dtype = loss.dtype
            for kind, bad in ((NAN_LOSS, float("nan")), (INF_LOSS, float("inf"))):
                if self._has([kind]):
                    loss = loss + tf.where(
                        self._hit([kind]), tf.constant(bad, dtype), tf.constant(0.0, dtype)
                    )
            if self._has([NAN_GRADIENT]):
                loss = _nan_gradient_on(loss, self._hit([NAN_GRADIENT]))
            return loss
