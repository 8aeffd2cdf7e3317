"""Runs that are not training steps are left alone.

A user's hand-written `MonitoredTrainingSession` loop does more than train: it reads a weight
for its log after each step, evaluates the loss, peeks at a batch. Every one of those runs goes
through the session's hooks. The guard's hook (`nan_hook(train_op)`) judges only the runs of
its own train op and adds nothing to the others, so with a `tf.data` input a read pulls no
batch (the train op sees batches 0, 1, 2, ... in order), runs no backward pass, and never
meets a bad batch to judge. The loss-only `NanLossHook(loss)` keeps `NanTensorHook`'s
behaviour: its loss is fetched on every run.

Each model here takes the next batch of a `tf.data` pipeline whose batch index a run can
fetch (`cluster_lib.build`), so a test can tell which batches the train op saw.
"""

import collections

import numpy as np
import pytest
import tensorflow as tf

import slim_nanguard
from slim_nanguard import _cluster
from slim_nanguard import _guard

import cluster_lib

_session = cluster_lib.monitored_session
_raw = cluster_lib.raw_run  # no hook sees the run


Step = collections.namedtuple("Step", ["loss", "index"])


# Ways a user's loop fetches the train op with the batch index: each one runs the train op.
TRAIN_FETCHES = {
    "list": lambda r: [r.train_op, r.index],
    "dict": lambda r: {"loss": r.train_op, "batch": r.index},
    "namedtuple": lambda r: Step(r.train_op, r.index),
    "nested": lambda r: {"step": [(r.train_op,)], "batch": r.index},
    "tensor_name": lambda r: [r.train_op.name, r.index.name],
    "op_and_op_name": lambda r: [r.train_op.op, r.index.op.name, r.index],
}


def _index_of(fetched) -> int:
    """The batch index a train fetch of `TRAIN_FETCHES` returned."""
    if isinstance(fetched, dict):
        return int(fetched["batch"])
    return int(fetched[-1] if not isinstance(fetched, Step) else fetched.index)


@pytest.mark.parametrize("form", sorted(TRAIN_FETCHES))
def test_weight_reads_between_steps_take_no_batch(form):
    """Five steps, each followed by a read of the weights for a log line: the train op sees
    batches 0 to 4 in order, and the next batch is 5."""
    replica = cluster_lib.build(check_numerics=False, nan_policy="skip")
    guard = slim_nanguard.get_guard(replica.train_op)
    with replica.graph.as_default():
        weights = tf.compat.v1.trainable_variables()
        with _session([slim_nanguard.nan_hook(replica.train_op)]) as sess:
            seen = []
            for _ in range(5):
                seen.append(_index_of(sess.run(TRAIN_FETCHES[form](replica))))
                assert cluster_lib.all_finite(sess.run(weights))  # the log line's read
                sess.run(replica.global_step)
            assert seen == [0, 1, 2, 3, 4]
            assert _raw(sess, replica.index) == 5
    assert guard.state.total_bad_steps == 0


def test_run_step_fn_judges_its_train_steps_and_not_its_reads():
    """`MonitoredSession.run_step_fn`, batch 1 bad: each step function trains with the hooks,
    then reads the weights with the hooks and the global step in the raw session. The steps
    see batches 0, 1 (skipped) and 2; the reads take none."""
    replica = cluster_lib.build(check_numerics=False, nan_policy="skip", faults={1: "nan_loss"})
    guard = slim_nanguard.get_guard(replica.train_op)
    with replica.graph.as_default(), _session([slim_nanguard.nan_hook(replica.train_op)]) as sess:
        weights = tf.compat.v1.trainable_variables()

        def step_fn(step_context):
            loss, index = step_context.run_with_hooks([replica.train_op, replica.index])
            step_context.run_with_hooks(weights)
            step_context.session.run(replica.global_step)
            return int(index), bool(np.isfinite(loss))

        steps = [sess.run_step_fn(step_fn) for _ in range(3)]
        assert steps == [(0, True), (1, False), (2, True)]
        assert guard.state.skips == 1 and _raw(sess, replica.global_step) == 2


def test_an_op_that_waits_on_the_train_op_is_a_training_step():
    """A step counter built under control_dependencies([train_op]) runs the train op: its
    runs are judged (the bad batch is skipped), a read of it alone afterwards is not a step."""
    replica = cluster_lib.build(check_numerics=False, nan_policy="skip", faults={2: "nan_loss"})
    guard = slim_nanguard.get_guard(replica.train_op)
    with replica.graph.as_default():
        with tf.control_dependencies([replica.train_op]):
            batch_trained = tf.identity(replica.index, name="batch_trained")
        with _session([slim_nanguard.nan_hook(replica.train_op)]) as sess:
            seen = [int(sess.run(batch_trained)) for _ in range(4)]
            sess.run(tf.compat.v1.trainable_variables())
            assert _raw(sess, replica.index) == 4
    assert seen == [0, 1, 2, 3]
    assert guard.state.skips == 1 and guard.state.total_bad_steps == 1


def test_bad_batches_are_met_by_train_steps_only():
    """Batches 1 and 3 are bad; the loop reads the weights and evaluates the loss of nothing
    between steps. Both bad batches reach the train op (NaN loss, skipped), in order; the
    reads see none and are no steps: two skips, two bad steps, three good ones."""
    replica = cluster_lib.build(
        check_numerics=False, nan_policy="skip", faults={1: "nan_loss", 3: "nan_loss"}
    )
    guard = slim_nanguard.get_guard(replica.train_op)
    hook = slim_nanguard.nan_hook(replica.train_op)
    outcomes = []
    with replica.graph.as_default():
        weights = tf.compat.v1.trainable_variables()
        with _session([hook]) as sess:
            steps = []
            for _ in range(5):
                loss, index = sess.run([replica.train_op, replica.index])
                outcomes.append(hook.last_outcome.action)
                steps.append((int(index), bool(np.isfinite(loss))))
                sess.run(weights)
                assert hook.last_outcome is None  # the read was not judged
            assert _raw(sess, replica.global_step) == 3
    assert steps == [(0, True), (1, False), (2, True), (3, False), (4, True)]
    assert outcomes == [None, "skip", None, "skip", None]  # no action: a good step
    assert guard.state.skips == 2 and guard.state.total_bad_steps == 2


def test_raise_on_a_read_never_happens():
    """Policy raise, batch 1 is bad. A read after step 0 returns the weights (it used to take
    batch 1 and raise, naming a finite loss); step 1 takes batch 1 and raises with its NaN."""
    replica = cluster_lib.build(check_numerics=False, nan_policy="raise", faults={1: "nan_loss"})
    guard = slim_nanguard.get_guard(replica.train_op)
    with replica.graph.as_default():
        weights = tf.compat.v1.trainable_variables()
        with _session([slim_nanguard.nan_hook(replica.train_op)]) as sess:
            _, index = sess.run([replica.train_op, replica.index])
            assert index == 0
            before = sess.run(weights)  # no raise here
            with pytest.raises(slim_nanguard.NanLossError) as raised:
                sess.run([replica.train_op, replica.index])
    assert np.isnan(raised.value.event.loss) and guard.state.total_bad_steps == 1
    assert cluster_lib.all_finite(before)


def _unguarded_numbered_model():
    """A loss no guarded train op made, over numbered batches: (graph, loss, train_op, index, w)."""
    graph = tf.Graph()
    with graph.as_default():
        index = tf.compat.v1.data.make_one_shot_iterator(tf.data.Dataset.range(100)).get_next()
        w = tf.compat.v1.get_variable("w", [], initializer=tf.compat.v1.ones_initializer())
        loss = tf.square(w * tf.cast(index % 3, tf.float32) - 1.0)
        train_op = tf.compat.v1.train.GradientDescentOptimizer(0.01).minimize(loss)
    return graph, loss, train_op, index, w


@pytest.mark.parametrize(
    "make_hook",
    [slim_nanguard.NanLossHook, tf.compat.v1.train.NanTensorHook],
    ids=["NanLossHook", "NanTensorHook"],
)
def test_the_loss_only_hook_fetches_its_loss_on_every_run_as_nan_tensor_hook_does(make_hook):
    """NanLossHook(loss) with no guard behind it is NanTensorHook's drop-in: each read of the
    weight also evaluates the loss, so it takes a batch (steps see batches 0, 2, 4)."""
    graph, loss, train_op, index, w = _unguarded_numbered_model()
    with graph.as_default(), _session([make_hook(loss)]) as sess:
        seen = []
        for _ in range(3):
            seen.append(int(sess.run([train_op, index])[1]))
            sess.run(w)
    assert seen == [0, 2, 4]


@pytest.mark.parametrize("mode", ["check_numerics", "hook"])
def test_sync_replicas_session_and_reads_take_no_batch(mode):
    """One SyncReplicas worker (the chief, aggregating 1 gradient), batch 3 bad, a weight
    read after each of 7 steps. Session creation (the chief's init ops and tokens), the
    chief's queue runner and the reads take no batch: the train op takes batches 0 to 6, and
    batch 3 is the one bad step (in check_numerics mode its run raises, so it returns no
    index; the next run takes batch 4)."""
    check_numerics = mode == "check_numerics"
    replica = cluster_lib.build(
        sync_replicas=True,
        faults={3: "nan_loss"},
        check_numerics=check_numerics,
        nan_policy="skip",
    )
    guard = slim_nanguard.get_guard(replica.train_op)
    hooks = list(replica.hooks)
    if not check_numerics:
        hooks.append(slim_nanguard.nan_hook(replica.train_op))
    seen = []
    with replica.graph.as_default():
        weights = tf.compat.v1.trainable_variables()
        with _session(hooks) as sess:
            for _ in range(7):
                try:
                    loss, index = sess.run([replica.train_op, replica.index])
                except tf.errors.InvalidArgumentError as err:
                    assert _guard.owns_error(guard, err), err
                    slim_nanguard.handle_numerics_error(sess, err)
                    seen.append("raised")
                else:
                    seen.append(int(index) if np.isfinite(loss) else f"bad {int(index)}")
                sess.run(weights)
            assert _raw(sess, replica.index) == 7
    bad = "raised" if check_numerics else "bad 3"
    assert seen == [0, 1, 2, bad, 4, 5, 6]
    assert guard.state.skips == 1


# ------------------------------------------------------------------------------------------
# The cluster's hooks, on a real in-process ps and worker: a stop or a rollback request from
# another worker is seen at this worker's next training step, not in a read.


@pytest.fixture(scope="module")
def servers():
    return cluster_lib.in_process_servers()


def test_the_chiefs_cluster_hooks_answer_at_training_steps_not_at_reads(servers, tmp_path):
    """Worker 1 asks the chief for a rollback: a read of the weights on the chief neither
    answers it nor restores anything; the chief's next step does. Then worker 1 stops the
    cluster: a read does not stop the chief, its next step does."""
    spec, _, worker_server = servers
    replica = cluster_lib.build(cluster=spec, task=0, nan_policy="skip")
    stop_hook = _cluster.ClusterStopHook(task=0, num_workers=1)
    rollback_hook = _cluster.ChiefRollbackHook(str(tmp_path))
    guard = slim_nanguard.get_guard(replica.train_op)
    with replica.graph.as_default():
        weights = tf.compat.v1.trainable_variables()
        ask_rollback = _cluster._rollback_queue().enqueue(
            (1, tf.constant(2, tf.int64), float("nan"))
        )
        ask_stop = _cluster._stop_queue().enqueue(1)
        session = _session(
            [stop_hook, rollback_hook],
            master=worker_server.target,
            checkpoint_dir=str(tmp_path),  # saves model.ckpt-0 at the start
            save_checkpoint_secs=3600,
        )
    with session as sess:
        for _ in range(2):
            sess.run(replica.train_op)
        _raw(sess, ask_rollback)
        trained = sess.run(weights)
        assert guard.state.rollbacks == 0 and _raw(sess, replica.global_step) == 2
        sess.run(replica.train_op)  # the hook answers after this step: back to step 0
        assert guard.state.rollbacks == 1 and _raw(sess, replica.global_step) == 0
        assert not all(np.array_equal(a, b) for a, b in zip(trained, _raw(sess, weights)))

        _raw(sess, ask_stop)
        sess.run(weights)
        assert not sess.should_stop() and not stop_hook.stopped_by_peer
        sess.run(replica.train_op)
        assert sess.should_stop() and stop_hook.stopped_by_peer
