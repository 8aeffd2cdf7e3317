"""The guard on TensorFlow's ps/worker cluster: `SyncReplicasOptimizer`'s writes, gated.

Between-graph replication builds the same graph in every worker under a
`tf.compat.v1.train.replica_device_setter`: the model variables live on the ps tasks, the
forward and backward pass on each worker. The guard's own variable (the gradient sums a bad
step leaves for its report) is colocated with the sums, so it stays on its worker
(`create_train_op` does that); nothing a worker keeps for a report is shared through the ps.

Asynchronous training needs nothing more: every write a worker's train op makes (to the ps
variables) waits on that worker's finiteness test, so a bad step pushes nothing to the ps.

`SyncReplicasOptimizer` splits a step in two, and only the first half is a worker's::

    worker (the train op):   accumulate(grad, local_step) for each variable   # gated
                             token = token_queue.dequeue()                     # after them
                             local_step = token
    chief (a queue runner):  aggregated = take_grad(replicas_to_aggregate)     # blocks
                             check(aggregated) -> apply(aggregated); global_step += 1
                             token_queue.enqueue_many(global_step x tokens_per_step)

`apply_sync_replicas` builds it with no control dependency on the guard's test: the
optimizer's init ops, its ready check and the chief's queue runner do not depend on the test
or on the input, so no run but the train op takes a batch. Only the accumulators' apply ops
wait on the test; the token dequeue waits on them, so on a bad step the worker accumulates
nothing and takes no token. The aggregated update waits on a check of its own (placed with
the global step): the mean of finite gradients is non-finite only when it overflows, and then
the chief's queue runner stops with that check's error and nothing is written.

What a skip means for the token queue and for stale gradients: a worker that skips a step
keeps its local step and tries its next batch with it. The round still completes: the
accumulators count gradients, not workers, and the tokens a round releases go to whichever
worker asks, so the other workers fill the round (each takes another token), with or without
backup workers. If the round completed meanwhile, the skipping worker's next gradient carries
an old local step and the accumulators drop it as stale (TensorFlow's own rule); the worker
then takes a fresh token and is current again. A skip so costs at most one more batch of
that worker, and nothing waits on it.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import tensorflow as tf

# The ops that add one worker's gradient to an accumulator (ref, resource and sparse).
_ACCUMULATE_OP_TYPES = frozenset({
    "AccumulatorApplyGradient", "ResourceAccumulatorApplyGradient",
    "SparseAccumulatorApplyGradient"})

# The ops that take the aggregated gradient, and which output holds its values.
_TAKE_OP_OUTPUTS = {"AccumulatorTakeGradient": 0, "ResourceAccumulatorTakeGradient": 0,
                    "SparseAccumulatorTakeGradient": 1}

AGGREGATE_CHECK_MESSAGE = ("slim_nanguard: the replicas' aggregated gradient is NaN or Inf "
                           "(an overflow of finite gradients); no variable was updated")


def is_sync_replicas(optimizer) -> bool:
    """Whether `optimizer` is a `tf.compat.v1.train.SyncReplicasOptimizer`."""
    return isinstance(optimizer, tf.compat.v1.train.SyncReplicasOptimizer)


def apply_sync_replicas(optimizer, grads_and_vars, global_step,
                        gate: tf.Tensor) -> Tuple[tf.Operation, List[tf.Operation]]:
    """Builds ``optimizer.apply_gradients`` with its worker-side writes behind `gate`.

    Args:
      optimizer: A `SyncReplicasOptimizer`.
      grads_and_vars: The (gradient, variable) pairs of this worker.
      global_step: The global step variable (the optimizer needs one).
      gate: The guard's test: its op must run (hook mode: be live) for a write to happen.

    Returns:
      ``(train_op, gated)``: the optimizer's train op (token dequeue) and the ops made to wait
      on `gate` or on the aggregate's check.

    Raises:
      ValueError: No global step, or no gradient reaches an accumulator.
    """
    if global_step is None:
        raise ValueError("SyncReplicasOptimizer needs a global step: pass global_step (or "
                         "leave the default) to create_train_op.")
    graph = gate.graph
    first_new_op = len(graph.get_operations())
    train_op = optimizer.apply_gradients(grads_and_vars, global_step=global_step)
    new_ops = graph.get_operations()[first_new_op:]
    gated = []
    for op in new_ops:
        if op.type in _ACCUMULATE_OP_TYPES and gate.op not in op.control_inputs:
            op._add_control_input(gate.op)  # pylint: disable=protected-access
            gated.append(op)
    if not gated:
        raise ValueError("SyncReplicasOptimizer.apply_gradients made no accumulator op to "
                         "gate; this TensorFlow version builds it differently.")
    return train_op, gated + _check_aggregate(optimizer, new_ops, global_step)


def _check_aggregate(optimizer, new_ops: Sequence[tf.Operation],
                     global_step) -> List[tf.Operation]:
    """Makes the chief's writes of the aggregated gradient wait on its finiteness check."""
    taken = [op.outputs[_TAKE_OP_OUTPUTS[op.type]] for op in new_ops
             if op.type in _TAKE_OP_OUTPUTS]
    runner = optimizer.get_chief_queue_runner()
    if not taken or runner is None:
        return []
    with tf.device(global_step.device), tf.name_scope("nanguard_aggregate"):
        sums = [tf.reduce_sum(tf.cast(t, tf.float64 if t.dtype == tf.float64 else tf.float32))
                for t in taken]
        check = tf.debugging.check_numerics(tf.add_n(sums), AGGREGATE_CHECK_MESSAGE)
    writes = _writes_before(list(runner.enqueue_ops), stop_at=set(
        t.op for t in taken))
    for op in writes:
        op._add_control_input(check.op)  # pylint: disable=protected-access
    return writes


def _writes_before(roots: Sequence[tf.Operation], stop_at: set) -> List[tf.Operation]:
    """The variable writes `roots` wait on, not looking past the ops in `stop_at`."""
    from slim_nanguard import _train_op  # Local: _train_op imports this module.
    found, seen, stack = [], set(), list(roots)
    while stack:
        op = stack.pop()
        if op in seen or op in stop_at:
            continue
        seen.add(op)
        if _train_op._is_write(op):  # pylint: disable=protected-access
            found.append(op)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return found
