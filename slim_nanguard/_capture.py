"""Keeping the batch of a bad step, which an autopsy replays from the weights it left
unchanged, at no cost to a good one: one store per batch tensor, on the branch of a ``Switch``
that runs on bad steps only."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, List, Optional, Tuple

import tensorflow as tf
from tensorflow.python.ops import control_flow_ops

from slim_nanguard import _ops
from slim_nanguard import _placement

_UNKEPT_DTYPES = (tf.resource, tf.variant)
_HOST_DTYPES = (tf.int32, tf.string)


@dataclasses.dataclass(frozen=True)
class Capture:
    """The batch `tensors` (fed back in this order at replay), a resource `variables` each (in
    no collection: never saved nor initialised), their `stores` on the bad branch, and `done`:
    live on every step, on a bad step only after the stores ran (check_numerics mode), or None."""

    tensors: Tuple[tf.Tensor, ...] = ()
    variables: Tuple[tf.Variable, ...] = ()
    stores: Tuple[tf.Operation, ...] = ()
    done: Optional[tf.Tensor] = None

    @property
    def control_inputs(self) -> List[tf.Tensor]:
        return [self.done] if self.done is not None else []


def batch_tensors(loss: tf.Tensor) -> List[tf.Tensor]:
    """The outputs of the placeholders and input ops `loss` reads through data edges (not
    behind a placeholder: a fed one never pulls the iterator behind its default into the
    step), in graph order; not those in a control-flow context, nor resource or variant ones."""
    found = _ops.sources([loss.op], _ops.BATCH_OP_TYPES, control_inputs=False)
    order = {op: i for i, op in enumerate(loss.graph.get_operations())}
    # pylint: disable-next=protected-access
    ops = [op for op in found if op._control_flow_context is None]
    kept = [t for op in sorted(ops, key=order.get) for t in op.outputs]
    return [t for t in kept if t.dtype.base_dtype not in _UNKEPT_DTYPES]


def producer(tensor: tf.Tensor) -> tf.Tensor:
    """Where `tensor`, a batch, is made: a dequeue or an iterator's ``get_next`` runs on its
    queue's or iterator's device (under a clone's device scope too), so the resource handle it
    reads; a placeholder where it is placed."""
    op = tensor.op
    if op.type in _ops.INPUT_OP_TYPES and op.inputs:
        return _ops.source(op.inputs[0])
    return tensor


@contextlib.contextmanager
def outside_control_flow(graph: tf.Graph) -> Iterator[None]:
    """Builds in `graph` with no control-flow context and no control dependencies."""
    context = graph._get_control_flow_context()  # pylint: disable=protected-access
    graph._set_control_flow_context(None)  # pylint: disable=protected-access
    try:
        with tf.control_dependencies(None):
            yield
    finally:
        graph._set_control_flow_context(context)  # pylint: disable=protected-access


@contextlib.contextmanager
def guard_variable_scope(graph: tf.Graph, near: Optional[tf.Tensor]) -> Iterator[None]:
    """Where the guard makes a variable of its own: outside control flow and function bodies,
    colocated with `near` on its worker (a `replica_device_setter` would share it on a parameter
    server), or on the host of the device in force when `near` is None; in a function body (not
    colocatable from outside) on the device in force."""
    in_function = getattr(graph, "building_function", False)
    with outside_control_flow(graph), tf.init_scope():
        if in_function:
            yield
        elif near is None:
            with _placement.on_host():
                yield
        else:
            with tf.compat.v1.colocate_with(near.op, ignore_existing=True):
                yield


def keep_batch(loss: tf.Tensor, ok: tf.Tensor, *, enabled: bool, merge: bool = True) -> Capture:
    """The `Capture` whose stores keep the batch of `loss` when `ok` is False (if `enabled`);
    without ``done`` unless `merge` (hook mode puts the stores on its own bad branch)."""
    tensors = batch_tensors(loss) if enabled else []
    if not tensors:
        return Capture()
    variables, stores = [], []
    with tf.name_scope("keep_batch"):
        for i, tensor in enumerate(tensors):
            home = producer(tensor)
            # A fed int32 or string batch on a GPU is kept on the host: no GPU kernel holds a
            # variable of either (only a bad step's value crosses).
            on_host = home is tensor and tensor.dtype.base_dtype in _HOST_DTYPES
            with guard_variable_scope(loss.graph, None if on_host else home):
                variable = tf.compat.v1.Variable(
                    tf.constant([], dtype=tensor.dtype.base_dtype),
                    trainable=False,
                    collections=[],
                    validate_shape=False,
                    shape=tf.TensorShape(None),
                    use_resource=True,
                    name=f"batch_{i}",
                )
            # The batch is switched where it is made: a good step copies only `ok`.
            with tf.compat.v1.colocate_with(home.op, ignore_existing=True):
                bad_value, _ = control_flow_ops.switch(tensor, ok)
            with tf.compat.v1.colocate_with(variable.handle.op, ignore_existing=True):
                stores.append(variable.assign(bad_value, read_value=False))
            variables.append(variable)
        if not merge:
            return Capture(tuple(tensors), tuple(variables), tuple(stores))
        # switch returns (output_false, output_true): the bad step's side comes first.
        on_bad, on_good = control_flow_ops.switch(ok, ok)
        good_done = tf.identity(on_good, name="good_step")
        with tf.control_dependencies(stores):
            bad_done = tf.identity(on_bad, name="bad_step_kept")
        done, _ = control_flow_ops.merge([good_done, bad_done], name="done")
    return Capture(tuple(tensors), tuple(variables), tuple(stores), done)


def read_kept_batch(session: tf.compat.v1.Session, capture: Capture) -> List:
    """The values the last bad step kept, in the order of ``capture.tensors``."""
    return session.run(list(capture.variables))
