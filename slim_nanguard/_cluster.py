"""The coordination of `slim_nanguard.cluster`: a stop, a rollback and the ps's exit, for all."""

from __future__ import annotations

import socket
import time
from typing import Callable, Dict, List, Optional, Sequence

import tensorflow as tf

from slim_nanguard import _actions
from slim_nanguard import _errors
from slim_nanguard import _guard
from slim_nanguard import _log as logging
from slim_nanguard import _nan_event
from slim_nanguard import _ops
from slim_nanguard import _policy
from slim_nanguard import _types


def _queue(ps_task: int, name: str, dtypes, shapes) -> tf.queue.FIFOQueue:
    """A FIFO queue on ps `ps_task` shared by `name` (no variable to initialise or restore).

    Stop: a stopping worker's task id once per worker, each worker takes one. Rollback:
    non-chiefs' (task, step, loss) requests. Done (each ps): every worker's task id, last thing.
    """
    with tf.device(f"/job:ps/task:{ps_task}"):
        return tf.queue.FIFOQueue(-1, dtypes, shapes=shapes, shared_name=name, name=name)


def _stop_queue() -> tf.queue.FIFOQueue:
    return _queue(0, "nanguard_cluster_stop", tf.int32, ())


def _rollback_queue() -> tf.queue.FIFOQueue:
    return _queue(0, "nanguard_cluster_rollback", (tf.int32, tf.int64, tf.float32), ((), (), ()))


def _done_queue(ps_task: int) -> tf.queue.FIFOQueue:
    return _queue(ps_task, f"nanguard_cluster_done_{ps_task}", tf.int32, ())


def _run_bounded(session, fetches, feed_dict=None, timeout_secs: float = 10):
    """``session.run`` that gives up after `timeout_secs` (a ps gone away must not hang it)."""
    options = tf.compat.v1.RunOptions(timeout_in_ms=int(timeout_secs * 1000))
    return session.run(fetches, feed_dict, options=options)


class ClusterStopHook(tf.compat.v1.train.SessionRunHook):
    """Stops this worker's loop (task `task` of `num_workers`) once any worker asked for a stop.

    When this worker's guard stopped it, `end` asks the others to stop before the session
    closes. When another worker stopped it (seen in a step or at `end`), ``stop_reason`` is
    ``cluster_stop`` and ``stop_fields`` names that worker (``stopped_by``); `slim_nanguard.train`
    records both.
    """

    def __init__(self, task: int = 0, num_workers: int = 1):
        self.stopped_by_peer = False
        self.stop_reason: Optional[str] = None
        self.stop_fields: Dict[str, int] = {}
        self._task = task
        self._num_workers = num_workers
        self._size = self._ask = self._take = None
        self._stops_before = {}
        self._runs_training: Optional[_ops.RunsOp] = None

    def begin(self):
        queue = _stop_queue()
        self._size = queue.size()
        self._ask = queue.enqueue_many([[self._task] * self._num_workers])
        self._take = queue.dequeue()
        guards = _guard.guards()
        self._stops_before = {g: g.state.stops for g in guards}
        self._runs_training = _ops.RunsOp(*(g.train_op.op for g in guards))

    def end(self, session):
        if any(g.state.stops > n for g, n in self._stops_before.items()):
            session.run(self._ask)
            return
        try:
            if self.stopped_by_peer or _run_bounded(session, self._size):
                self.stopped_by_peer = True
                by = int(_run_bounded(session, self._take))
                self.stop_reason = _types.StopReason.CLUSTER_STOP
                self.stop_fields = {"stopped_by": by}
                logging.warning(
                    "slim_nanguard: worker %d stopped the cluster; this worker stopped too", by
                )
        except tf.errors.OpError as err:  # The ps is gone: the stop stays unexplained.
            logging.warning(
                "slim_nanguard: could not read the cluster's stop queue: %s",
                _errors.op_error_cause(err),
            )

    def before_run(self, run_context):
        if not self._runs_training(run_context.original_args.fetches):
            return None  # Not a training step: nothing added to the run.
        return tf.compat.v1.train.SessionRunArgs(self._size)

    def after_run(self, run_context, run_values):
        if run_values.results:  # None after a run that was not a training step.
            self.stopped_by_peer = True
            run_context.request_stop()


class RollbackRequestHook(tf.compat.v1.train.SessionRunHook):
    """Non-chief worker `task`'s rollback: a request to the chief, not a restore of its own.

    From `begin` to `end`, every rollback of the graph's guards puts (task, global step, loss)
    on the rollback queue for `ChiefRollbackHook`; the guard records ``rollback_requested``,
    this worker skips ``rollback_skip_batches`` batches and carries on. It counts no rollback
    (the guard's state counts the requests); the chief counts them against ``max_rollbacks``.
    """

    def __init__(self, task: int):
        self._task = task
        self._ask = self._step = self._loss = None
        self._guards: List[_guard.Guard] = []

    def begin(self):
        with tf.name_scope("nanguard_rollback_request"):
            self._step = tf.compat.v1.placeholder(tf.int64, [], name="step")
            self._loss = tf.compat.v1.placeholder(tf.float32, [], name="loss")
            self._ask = _rollback_queue().enqueue((self._task, self._step, self._loss))
        self._guards = _guard.guards()
        for guard in self._guards:
            guard.rollback_request = self._request

    def end(self, session):
        del session  # The guards roll back as before once this session is over.
        for guard in self._guards:
            if guard.rollback_request == self._request:
                guard.rollback_request = None

    def _request(self, session, guard: _guard.Guard, event: _nan_event.NanEvent) -> Dict[str, int]:
        _run_bounded(session, self._ask, {self._step: event.step, self._loss: event.loss})
        skipped = guard.restorer.skip_input(session, guard.config.rollback_skip_batches)
        logging.warning(
            "slim_nanguard: worker %d asked the chief to roll back the model (bad step at "
            "global step %d); skipped %s, carrying on",
            self._task,
            event.step,
            logging.batches(skipped),
        )
        return {"chief": 0, "skipped_batches": skipped}


class ChiefRollbackHook(tf.compat.v1.train.SessionRunHook):
    """The chief's side of a rollback: answers the other workers' requests.

    After a training step with requests waiting, it answers them all with one rollback of the
    chief's guard (as the chief's own, but skipping no input); the ``rollback`` record names the
    tasks in ``requested_by`` and counts ``requests``. Every rollback counts against
    ``max_rollbacks``; a request past it raises `NanLossError`.

    `checkpoint_dir` is where the chief saves checkpoints. `after_restore` (or None) runs after
    every restore of the chief's guard (requested, or its own, at its next step); with
    `SyncReplicasOptimizer`, its ``chief_init_op`` (resetting the accumulators' step to the
    restored global step).
    """

    def __init__(self, checkpoint_dir: str, after_restore: Optional[tf.Operation] = None):
        self._checkpoint_dir = checkpoint_dir
        self._after_restore = after_restore
        self._guard: Optional[_guard.Guard] = None
        self._size = self._take = self._count = None
        self._restores_seen = 0
        self._runs_training: Optional[_ops.RunsOp] = None

    def begin(self):
        queue = _rollback_queue()
        self._size = queue.size()
        self._count = tf.compat.v1.placeholder(tf.int32, [], name="nanguard_rollback_requests")
        self._take = queue.dequeue_many(self._count)
        guards = _guard.guards()
        self._guard = guards[0] if guards else None
        self._runs_training = _ops.RunsOp(*(g.train_op.op for g in guards))
        if self._guard is not None:
            self._guard.restorer.ensure_saver()  # Now: after begin() the graph is finalized.
            self._restores_seen = self._guard.state.rollbacks

    def before_run(self, run_context):
        if not self._runs_training(run_context.original_args.fetches):
            return None  # Not a training step: no request is answered in it.
        if self._guard is not None and self._guard.state.rollbacks != self._restores_seen:
            self._restored(run_context.session)  # The chief's own rollback, since last step.
        return tf.compat.v1.train.SessionRunArgs(self._size)

    def _restored(self, session) -> None:
        self._restores_seen = self._guard.state.rollbacks
        if self._after_restore is not None:
            session.run(self._after_restore)

    def after_run(self, run_context, run_values):
        waiting = int(run_values.results or 0)
        guard, session = self._guard, run_context.session
        if not waiting or guard is None:
            return
        tasks, steps, losses = session.run(self._take, {self._count: waiting})
        # One rollback answers them all, recorded at the earliest bad step asked about.
        step, loss = min(zip(map(int, steps), map(float, losses)), key=lambda pair: pair[0])
        read = _policy.BadStep(step, _types.Action.ROLLBACK, loss=loss)
        counts = dict(consecutive=0, total=guard.state.total_bad_steps)
        event = _nan_event.event_of(read, mode=guard.mode, action=read.chosen, **counts)
        workers = tuple(sorted(set(map(int, tasks))))
        decision = _actions.observe(guard, _policy.RollbackRequested(workers))
        if decision.action == _types.Action.RAISE:
            logging.error("slim_nanguard: %s; giving up", decision.reason)
        else:
            logging.warning(
                "slim_nanguard: the chief rolls back the model for worker %s (%d request%s)",
                ", ".join(str(w) for w in workers),
                len(tasks),
                "s" if len(tasks) > 1 else "",
            )
        _actions.carry_out(
            guard,
            session,
            event,
            decision,
            checkpoint_dir=self._checkpoint_dir,
            skip_batches=0,
            requested_by=list(workers),
            requests=len(tasks),
        )
        self._restored(session)


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
    num_workers: int = 1,
) -> bool:
    """Worker `task`'s last word to the `num_ps` ps: a stop if `stop`, then done to every ps.

    `stop` (this worker stopped or gave up) stops every other of the `num_workers` workers.
    `target` is this worker's server, or with ``job="ps"`` ps 0's (for a worker that failed
    before it started its server). Waits up to `timeout_secs` for the ps; returns whether any
    worker (this one included) asked the cluster to stop.
    """
    graph = tf.Graph()
    with graph.as_default():
        stop_queue = _stop_queue()
        ask = stop_queue.enqueue_many([[task] * num_workers]) if stop else None
        size = stop_queue.size()
        done = [_done_queue(i).enqueue(task) for i in range(num_ps)]
    config = session_config("worker", task, timeout_secs)
    if job != "worker":  # Through ps 0's server: this worker's own is not up.
        config.device_filters[:] = ["/job:ps"]
    try:
        with tf.compat.v1.Session(target, graph=graph, config=config) as session:
            if ask is not None:
                session.run(ask)
            stopped = int(session.run(size)) > 0
            session.run(done)
            return stopped
    except tf.errors.OpError as err:
        logging.warning(
            "slim_nanguard: could not tell the ps this worker is done: %s",
            _errors.op_error_cause(err),
        )
        return stop


def answers(host: str, timeout_secs: float = 1.0) -> bool:
    """Whether something accepts a TCP connection at `host` (``HOST:PORT``) now."""
    name, _, port = host.rpartition(":")
    try:
        with socket.create_connection((name.strip("[]"), int(port)), timeout=timeout_secs):
            return True
    except OSError:
        return False


def serve_ps(
    target: str,
    *,
    task: int,
    worker_hosts: Sequence[str],
    timeout_secs: float,
    poll_secs: float = 0.5,
    is_up: Callable[[str], bool] = answers,
    clock: Callable[[], float] = time.monotonic,
) -> List[int]:
    """Serves as ps task `task` until every worker said it is done (see `finish`), or is gone.

    A worker that has not said so counts as gone once its port has refused connections for
    `timeout_secs` in a row, and it had started (its port answered) or another worker is
    done. A worker that never started is waited for while no worker is done.

    `target` is this ps's server, `worker_hosts` every worker's HOST:PORT; it looks at the done
    queue and the ports every `poll_secs`. `is_up` (whether a HOST:PORT answers) and `clock`
    (monotonic seconds) are injectable for tests. Returns the task ids of the workers that never
    said they were done (gone); empty if all did.
    """
    graph = tf.Graph()
    with graph.as_default():
        queue = _done_queue(task)
        size = queue.size()
        count = tf.compat.v1.placeholder(tf.int32, [])
        take = queue.dequeue_many(count)
    config = tf.compat.v1.ConfigProto(device_filters=[f"/job:ps/task:{task}"])
    done, started, silent_since = set(), set(), {}
    workers = range(len(worker_hosts))
    with tf.compat.v1.Session(target, graph=graph, config=config) as session:
        while True:
            waiting = int(session.run(size))
            if waiting:
                done.update(int(t) for t in session.run(take, {count: waiting}))
            left = [w for w in workers if w not in done]
            if not left:
                return []
            now = clock()
            for w in left:
                if is_up(worker_hosts[w]):
                    started.add(w)
                    silent_since.pop(w, None)
                elif w in started or done:
                    silent_since.setdefault(w, now)
            if all(w in silent_since and now - silent_since[w] >= timeout_secs for w in left):
                return left
            time.sleep(poll_secs)


def wait_for_model(
    graph: tf.Graph, target: str, config, timeout_secs: float, poll_secs: float = 0.25
) -> None:
    """Waits until the chief has initialised or restored the model on the ps (polling every
    `poll_secs`, so a non-chief `MonitoredTrainingSession` then finds it ready at once).

    `graph`, `target` and `config` (see `session_config`) are the worker's.

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
