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

import time
from typing import List, Sequence, Tuple

import tensorflow as tf
from absl import logging

from slim_nanguard import _guard

# The ops that add one worker's gradient to an accumulator (ref, resource and sparse).
_ACCUMULATE_OP_TYPES = frozenset(
    {
        "AccumulatorApplyGradient",
        "ResourceAccumulatorApplyGradient",
        "SparseAccumulatorApplyGradient",
    }
)

# The ops that take the aggregated gradient, and which output holds its values.
_TAKE_OP_OUTPUTS = {
    "AccumulatorTakeGradient": 0,
    "ResourceAccumulatorTakeGradient": 0,
    "SparseAccumulatorTakeGradient": 1,
}

AGGREGATE_CHECK_MESSAGE = (
    "slim_nanguard: the replicas' aggregated gradient is NaN or Inf "
    "(an overflow of finite gradients); no variable was updated"
)


def is_sync_replicas(optimizer) -> bool:
    """Whether `optimizer` is a `tf.compat.v1.train.SyncReplicasOptimizer`."""
    return isinstance(optimizer, tf.compat.v1.train.SyncReplicasOptimizer)


def apply_sync_replicas(
    optimizer, grads_and_vars, global_step, gate: tf.Tensor
) -> Tuple[tf.Operation, List[tf.Operation]]:
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
        raise ValueError(
            "SyncReplicasOptimizer needs a global step: pass global_step (or "
            "leave the default) to create_train_op."
        )
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
        raise ValueError(
            "SyncReplicasOptimizer.apply_gradients made no accumulator op to "
            "gate; this TensorFlow version builds it differently."
        )
    return train_op, gated + _check_aggregate(optimizer, new_ops, global_step)


def _check_aggregate(optimizer, new_ops: Sequence[tf.Operation], global_step) -> List[tf.Operation]:
    """Makes the chief's writes of the aggregated gradient wait on its finiteness check."""
    taken = [op.outputs[_TAKE_OP_OUTPUTS[op.type]] for op in new_ops if op.type in _TAKE_OP_OUTPUTS]
    runner = optimizer.get_chief_queue_runner()
    if not taken or runner is None:
        return []
    with tf.device(global_step.device), tf.name_scope("nanguard_aggregate"):
        sums = [
            tf.reduce_sum(tf.cast(t, tf.float64 if t.dtype == tf.float64 else tf.float32))
            for t in taken
        ]
        check = tf.debugging.check_numerics(tf.add_n(sums), AGGREGATE_CHECK_MESSAGE)
    writes = _writes_before(list(runner.enqueue_ops), stop_at=set(t.op for t in taken))
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


# ------------------------------------------------------------------------------------------
# Cluster-wide decisions: a stop anywhere stops every worker; a ps exits when all are done.
#
# Two FIFO queues on the ps, shared by name, carry them (no variable, so nothing is
# initialised, checkpointed or restored): a worker that stops or gives up enqueues its task id
# on the stop queue, which every worker's `ClusterStopHook` reads each step; every worker, last
# thing, enqueues on each ps's done queue, which `serve_ps` waits on.

STOP_QUEUE = "nanguard_cluster_stop"
DONE_QUEUE = "nanguard_cluster_done"


def _stop_queue() -> tf.queue.FIFOQueue:
    with tf.device("/job:ps/task:0"):
        return tf.queue.FIFOQueue(-1, tf.int32, shapes=(), shared_name=STOP_QUEUE, name=STOP_QUEUE)


def _done_queue(ps_task: int) -> tf.queue.FIFOQueue:
    with tf.device(f"/job:ps/task:{ps_task}"):
        return tf.queue.FIFOQueue(
            -1,
            tf.int32,
            shapes=(),
            shared_name=f"{DONE_QUEUE}_{ps_task}",
            name=f"{DONE_QUEUE}_{ps_task}",
        )


class ClusterStopHook(tf.compat.v1.train.SessionRunHook):
    """Stops this worker's loop once any worker of the cluster asked for a stop.

    Each step fetches, with the train op, the size of the stop queue on ps task 0. When this
    worker's guard stopped it, `end` asks the others to stop before the session closes (a
    sync-replicas chief's close ends the token queue, and the workers waiting on it with it).

    Args:
      task: This worker's task id.
    """

    def __init__(self, task: int = 0):
        self.stopped_by_peer = False
        self._task = task
        self._size = self._ask = None
        self._stops_before = {}

    def begin(self):
        queue = _stop_queue()
        self._size = queue.size()
        self._ask = queue.enqueue(self._task)
        self._stops_before = {g: g.state.stops for g in _guard.guards()}

    def end(self, session):
        if any(g.state.stops > n for g, n in self._stops_before.items()):
            session.run(self._ask)

    def before_run(self, run_context):
        return tf.compat.v1.train.SessionRunArgs(self._size)

    def after_run(self, run_context, run_values):
        if run_values.results:
            self.stopped_by_peer = True
            run_context.request_stop()


def session_config(job: str, task: int, timeout_secs: float) -> tf.compat.v1.ConfigProto:
    """A session config that sees only the ps tasks and this task, with an op timeout."""
    filters = (
        ["/job:ps", f"/job:{job}/task:{task}"] if job == "worker" else [f"/job:ps/task:{task}"]
    )
    return tf.compat.v1.ConfigProto(
        device_filters=filters, operation_timeout_in_ms=int(timeout_secs * 1000)
    )


def finish(
    target: str,
    *,
    task: int,
    num_ps: int,
    stop: bool,
    timeout_secs: float = 30,
    job: str = "worker",
) -> bool:
    """A worker's last word to the ps: a stop if `stop`, then done to every ps.

    Args:
      target: This worker's server target (or ps 0's, with ``job="ps"``, for a worker that
        failed before it started its server).
      task: This worker's task id.
      num_ps: How many ps tasks.
      stop: Whether this worker stopped or gave up, so that every other worker stops too.
      timeout_secs: How long to wait for the ps.

    Returns:
      Whether any worker (this one included) asked the cluster to stop.
    """
    graph = tf.Graph()
    with graph.as_default():
        stop_queue = _stop_queue()
        ask = stop_queue.enqueue(task) if stop else None
        size = stop_queue.size()
        done = [_done_queue(i).enqueue(task) for i in range(num_ps)]
    config = (
        session_config("worker", task, timeout_secs)
        if job == "worker"
        else tf.compat.v1.ConfigProto(
            device_filters=["/job:ps"], operation_timeout_in_ms=int(timeout_secs * 1000)
        )
    )
    try:
        with tf.compat.v1.Session(target, graph=graph, config=config) as session:
            if ask is not None:
                session.run(ask)
            stopped = int(session.run(size)) > 0
            session.run(done)
            return stopped
    except tf.errors.OpError as err:
        logging.warning(
            "slim_nanguard: could not tell the ps this worker is done: %s", str(err).splitlines()[0]
        )
        return stop


def serve_ps(target: str, *, task: int, num_workers: int) -> None:
    """Serves as ps task `task` until every worker said it is done (see `finish`)."""
    graph = tf.Graph()
    with graph.as_default():
        all_done = _done_queue(task).dequeue_many(num_workers)
    config = tf.compat.v1.ConfigProto(device_filters=[f"/job:ps/task:{task}"])
    with tf.compat.v1.Session(target, graph=graph, config=config) as session:
        session.run(all_done)


def wait_for_model(
    graph: tf.Graph, target: str, config, timeout_secs: float, poll_secs: float = 0.25
) -> None:
    """Waits until the chief has initialised or restored the model on the ps.

    A non-chief `MonitoredTrainingSession` checks every 30 s; polling here first means it
    finds the model ready at once.

    Raises:
      tf.errors.DeadlineExceededError: The model was not ready within `timeout_secs`.
    """
    with graph.as_default():
        # Global ones only: the local ones (sync replicas' local step) are this worker's.
        not_ready = tf.compat.v1.report_uninitialized_variables(tf.compat.v1.global_variables())
    deadline = time.monotonic() + timeout_secs
    with tf.compat.v1.Session(target, graph=graph, config=config) as session:
        while session.run(not_ready).size:
            if time.monotonic() > deadline:
                raise tf.errors.DeadlineExceededError(
                    None, None, f"the chief did not initialise the model within {timeout_secs:g}s"
                )
            time.sleep(poll_secs)
