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
    transient_nan:40    the loss of batch 40 is NaN the first time it is run only: a replay
                        of the same batch on the same weights is finite (a flaky device)
    nan_example:7       one NaN pixel in example 7 of the split, in every epoch (a bad
                        example among good ones: the batch without it is finite)
    spike_example:7     example 7's image times 1,000 and its label the next class, in
                        every epoch (a corrupt record: its loss is a spike, not NaN; scaled
                        alone, a well-classified example only grows more confident)
    lr_jump:40          the learning rate of batch 40's update times 10**12: the step
                        itself is accepted, the weights it leaves are broken (a fault of the
                        model's state: later batches go bad on them)

The index counts the batches the input pipeline hands out, from 0, carried with the data
(`enumerate_batches`), not the global step. So a bad batch is bad once: the ``skip`` policy
steps over it and the next batch is clean, a ``rollback`` goes back to an earlier global step
without meeting the fault again, and in a fresh run with no earlier bad step batch ``STEP``
is the one trained at global step ``STEP``. Rollback's skipped batches count too. The
example kinds count examples instead: their position in the split before shuffling
(`slim_nanguard.app.datasets.get_dataset` with ``example_index=True`` carries it), so the
same example is bad in every epoch, wherever the shuffle puts it.

How it is wired (what `slim_nanguard.app.build` does)::

    faults = FaultSpec.parse_list("nan_input:40,nan_loss:80")
    dataset = enumerate_batches(dataset)                 # (batch_index, (images, labels))
    index, (images, labels) = iterator.get_next()
    injector = FaultInjector(faults, index)
    images = injector.corrupt_images(images)
    ...model, loss...
    total_loss = injector.corrupt_loss(total_loss)

Everything is in the graph (``tf.where`` on ``batch_index == STEP``): no feed, so the train op
and the guard see exactly what a real fault would give them. Only ``transient_nan`` runs Python
in the step (a `tf.numpy_function` that remembers which batches it has failed once): its memory
is the process's, and a graph holding it does not load in another process (an autopsy dump's
replay elsewhere).
"""

from __future__ import annotations

import functools
from typing import Iterable, Sequence

import numpy as np
import tensorflow as tf

from slim_nanguard.app.preflight import EXAMPLE_KINDS
from slim_nanguard.app.preflight import FAULT_KINDS
from slim_nanguard.app.preflight import INF_INPUT
from slim_nanguard.app.preflight import INF_LOSS
from slim_nanguard.app.preflight import INPUT_KINDS
from slim_nanguard.app.preflight import LOSS_KINDS
from slim_nanguard.app.preflight import LR_JUMP
from slim_nanguard.app.preflight import LR_JUMP_SCALE
from slim_nanguard.app.preflight import NAN_GRADIENT
from slim_nanguard.app.preflight import NAN_INPUT
from slim_nanguard.app.preflight import NAN_LOSS
from slim_nanguard.app.preflight import SPIKE_EXAMPLE
from slim_nanguard.app.preflight import SPIKE_INPUT
from slim_nanguard.app.preflight import SPIKE_SCALE
from slim_nanguard.app.preflight import TRANSIENT_NAN
from slim_nanguard.app.preflight import FaultSpec

__all__ = [
    "EXAMPLE_KINDS",
    "FAULT_KINDS",
    "INPUT_KINDS",
    "LOSS_KINDS",
    "FaultInjector",
    "FaultSpec",
    "enumerate_batches",
]


def enumerate_batches(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """The batches of `dataset`, each with its int64 index: ``(index, batch)``."""
    return dataset.enumerate()


def needs_example_index(faults: Iterable) -> bool:
    """Whether any of `faults` hits examples (then the batches must carry their indices)."""
    return any(_spec(f).kind in EXAMPLE_KINDS for f in faults)


def _spec(fault) -> FaultSpec:
    return fault if isinstance(fault, FaultSpec) else FaultSpec.parse(fault)


def _first_time(hit: tf.Tensor, batch_index: tf.Tensor) -> tf.Tensor:
    """`hit`, but only the first time each batch index is run in this process: a replay of
    the batch (an autopsy feeds it back) gets False."""
    seen = set()

    def first(hit_now, index):
        new = bool(hit_now) and int(index) not in seen
        if new:
            seen.add(int(index))
        return np.bool_(new)

    flag = tf.numpy_function(first, [hit, batch_index], tf.bool, stateful=True)
    return tf.reshape(flag, [])


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


def _hits(fault: FaultSpec, batch_index: tf.Tensor) -> tf.Tensor:
    """A boolean tensor shaped like `batch_index`: does `fault` hit each index?"""
    index = tf.cast(batch_index, tf.int64)
    if fault.first == fault.last:
        return tf.equal(index, fault.first)
    return tf.logical_and(index >= fault.first, index <= fault.last)


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
      example_index: The int64 ``[batch]`` indices of its examples in the split; needed by
        the `EXAMPLE_KINDS` (`needs_example_index`).
    """

    def __init__(self, faults: Iterable, batch_index: tf.Tensor, example_index: tf.Tensor = None):
        self.faults = tuple(_spec(f) for f in faults)
        self.batch_index = batch_index
        self.example_index = example_index
        if example_index is None and self._has(EXAMPLE_KINDS):
            raise ValueError("example faults need the example indices (example_index=...).")

    def _hit(self, kinds: Sequence[str]) -> tf.Tensor:
        return _any([_hits(f, self.batch_index) for f in self.faults if f.kind in kinds])

    def _has(self, kinds: Sequence[str]) -> bool:
        return any(f.kind in kinds for f in self.faults)

    def corrupt_images(self, images: tf.Tensor) -> tf.Tensor:
        """`images` with its first value NaN (``nan_input``) or +Inf (``inf_input``), or all its
        values times `SPIKE_SCALE` (``spike_input``, finite), on a hit."""
        images = self._corrupt_examples(images)
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

    def _corrupt_examples(self, images: tf.Tensor) -> tf.Tensor:
        """`images` with the hit examples' first value NaN (``nan_example``) or their values
        times `SPIKE_SCALE` (``spike_example``)."""
        if not self._has(EXAMPLE_KINDS):
            return images
        with tf.name_scope("inject_fault/examples"):
            rows = tf.reshape(images, [tf.shape(images)[0], -1])
            for kind in EXAMPLE_KINDS:
                if not self._has([kind]):
                    continue
                hits = [_hits(f, self.example_index) for f in self.faults if f.kind == kind]
                hit = tf.reshape(functools.reduce(tf.logical_or, hits), [-1, 1])
                if kind == SPIKE_EXAMPLE:
                    rows = tf.where(hit, rows * SPIKE_SCALE, rows)
                else:
                    first = tf.one_hot(0, tf.shape(rows)[1], on_value=True, off_value=False)
                    nan = tf.constant(float("nan"), rows.dtype)
                    rows = tf.where(tf.logical_and(hit, first[tf.newaxis]), nan, rows)
            return tf.reshape(rows, tf.shape(images))

    def corrupt_labels(self, labels: tf.Tensor, num_classes: int) -> tf.Tensor:
        """`labels` with the ``spike_example`` examples' label the next class (mod
        `num_classes`)."""
        if not self._has([SPIKE_EXAMPLE]):
            return labels
        with tf.name_scope("inject_fault/labels"):
            hits = [_hits(f, self.example_index) for f in self.faults if f.kind == SPIKE_EXAMPLE]
            hit = tf.reshape(functools.reduce(tf.logical_or, hits), [-1])
            return tf.where(hit, (labels + 1) % num_classes, labels)

    def corrupt_learning_rate(self, learning_rate: tf.Tensor) -> tf.Tensor:
        """`learning_rate` times `LR_JUMP_SCALE` for a hit batch's update (``lr_jump``)."""
        if not self._has([LR_JUMP]):
            return learning_rate
        with tf.name_scope("inject_fault/learning_rate"):
            scale = tf.where(self._hit([LR_JUMP]), LR_JUMP_SCALE, 1.0)
            return learning_rate * tf.cast(scale, learning_rate.dtype)

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
            nan, inf = float("nan"), float("inf")
            for kind, bad in ((NAN_LOSS, nan), (INF_LOSS, inf), (TRANSIENT_NAN, nan)):
                if self._has([kind]):
                    hit = self._hit([kind])
                    if kind == TRANSIENT_NAN:  # Its first run only: the replay is finite.
                        hit = _first_time(hit, self.batch_index)
                    loss = loss + tf.where(hit, tf.constant(bad, dtype), tf.constant(0.0, dtype))
            if self._has([NAN_GRADIENT]):
                loss = _nan_gradient_on(loss, self._hit([NAN_GRADIENT]))
            return loss
