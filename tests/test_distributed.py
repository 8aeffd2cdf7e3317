"""The guard in a replicated graph, in one process: device placement and sync replicas.

A worker of a between-graph replicated cluster builds its graph under a
`replica_device_setter`; `SyncReplicasOptimizer` adds accumulators, a token queue and a chief
queue runner. These tests build exactly that graph and run it in one process (the real
multi-process clusters are in test_cluster.py).
"""

import time

import numpy as np
import pytest
import tensorflow as tf

import slim_nanguard
from slim_nanguard import _cluster

import cluster_lib
import nanguard_testlib as lib

MODES = {"check_numerics": True, "hook": False}
CLUSTER = {"ps": ["127.0.0.1:2222"], "worker": ["127.0.0.1:2223", "127.0.0.1:2224"]}


def _session(replica, check_numerics):
    hooks = list(replica.hooks)
    if not check_numerics:
        hooks.append(slim_nanguard.nan_hook(replica.train_op))
    return cluster_lib.monitored_session(hooks)


_raw = cluster_lib.raw_run  # no hook adds its own fetches


def _step(sess, replica, feed=None):
    """One run of the train op; returns (loss or None, batch index or None, raised)."""
    fetches = [replica.train_op] + ([replica.index] if replica.index is not None else [])
    try:
        values = sess.run(fetches, feed)
    except tf.errors.InvalidArgumentError as err:
        assert slim_nanguard.is_numerics_error(err), err
        return None, None, True
    return values[0], (values[1] if len(values) > 1 else None), False


def _wait_for_step(sess, replica, step, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _raw(sess, replica.global_step) >= step:
            return
        time.sleep(0.02)
    raise AssertionError(f"global_step did not reach {step} in {timeout}s")


def _feed(replica, seed, fault=None):
    x, y, _, _ = lib.batches(count=seed + 1)
    p = replica.placeholders
    return {
        p["x"]: x[seed],
        p["y"]: y[seed],
        p["offset"]: np.float32(np.nan if fault == "nan_loss" else 0.0),
    }


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_guards_gradient_sums_stay_on_the_worker_that_made_them(mode):
    """replica_device_setter puts variables on the ps; the guard's own stays on worker 1."""
    replica = cluster_lib.build(cluster=CLUSTER, task=1, check_numerics=MODES[mode])
    guard = slim_nanguard.get_guard(replica.train_op)
    with replica.graph.as_default():
        assert all(v.device == "/job:ps/task:0" for v in tf.compat.v1.global_variables())
    ops = [
        op for op in replica.graph.get_operations() if op.name.startswith(guard.diagnostics.op.name)
    ]
    assert ops and {op.device for op in ops} == {"/job:worker/task:1"}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_sync_replicas_session_starts_with_fed_placeholders_and_skips_a_bad_step(mode):
    """Its init, ready check and token ops need no feed; a bad step writes nothing."""
    replica = cluster_lib.build(
        sync_replicas=True, fed=True, check_numerics=MODES[mode], nan_policy="skip"
    )
    with replica.graph.as_default():
        weights = tf.compat.v1.trainable_variables()
        with _session(replica, MODES[mode]) as sess:  # used to fail: "must feed a value"
            _step(sess, replica, _feed(replica, 0))
            _wait_for_step(sess, replica, 1)
            before = _raw(sess, weights + [replica.global_step])
            loss, _, raised = _step(sess, replica, _feed(replica, 1, "nan_loss"))
            assert raised if MODES[mode] else np.isnan(loss)
            time.sleep(0.2)  # the chief's queue runner would have applied by now
            after = _raw(sess, weights + [replica.global_step])
            assert all(np.array_equal(b, a) for b, a in zip(before, after))
            # The next gradient may be stale (it carries the local step of the first
            # token): TensorFlow drops it, and the one after makes the step.
            for seed in (2, 3):
                _step(sess, replica, _feed(replica, seed))
            _wait_for_step(sess, replica, 2)
            assert cluster_lib.all_finite(_raw(sess, weights))


@pytest.mark.parametrize("mode", sorted(MODES))
def test_sync_replicas_only_the_train_op_takes_batches(mode):
    """With tf.data input, session creation and the chief's ops pull no batch."""
    replica = cluster_lib.build(
        sync_replicas=True, faults={2: "nan_loss"}, check_numerics=MODES[mode], nan_policy="skip"
    )
    seen, bad = [], 0
    with replica.graph.as_default(), _session(replica, MODES[mode]) as sess:
        for _ in range(6):
            loss, index, raised = _step(sess, replica)
            if raised or not np.isfinite(loss):
                bad += 1
            if index is not None:
                seen.append(int(index))
        _wait_for_step(sess, replica, 3)  # 5 good batches; a stale one is dropped
    assert bad == 1
    # check_numerics mode: the bad run raised, so its batch index was not returned.
    assert seen == ([0, 1, 3, 4, 5] if MODES[mode] else [0, 1, 2, 3, 4, 5])


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_bad_gradient_never_enters_the_accumulators(mode):
    """Two gradients per round: good, bad (not counted), good completes the round."""
    replica = cluster_lib.build(
        sync_replicas=True,
        replicas_to_aggregate=2,
        fed=True,
        check_numerics=MODES[mode],
        nan_policy="skip",
    )
    with replica.graph.as_default():
        counts = [
            accumulator.num_accumulated() for accumulator, _ in replica.optimizer._accumulator_list
        ]
        weights = tf.compat.v1.trainable_variables()
        with _session(replica, MODES[mode]) as sess:
            _step(sess, replica, _feed(replica, 0))
            assert set(_raw(sess, counts)) == {1}
            before = _raw(sess, weights)
            _step(sess, replica, _feed(replica, 1, "nan_loss"))
            assert set(_raw(sess, counts)) == {1}
            assert _raw(sess, replica.global_step) == 0
            assert all(np.array_equal(b, a) for b, a in zip(before, _raw(sess, weights)))
            _step(sess, replica, _feed(replica, 2))
            _wait_for_step(sess, replica, 1)
            assert cluster_lib.all_finite(_raw(sess, weights))


def test_the_chiefs_aggregated_update_waits_on_its_own_check():
    replica = cluster_lib.build(sync_replicas=True, fed=True)
    writes = [
        op
        for op in replica.graph.get_operations()
        if op.type.startswith(("ApplyGradientDescent", "ResourceApplyGradientDescent"))
    ]
    assert len(writes) == 4  # two layers' weights and biases
    for op in writes:
        checks = [c for c in op.control_inputs if c.type.startswith("CheckNumerics")]
        assert checks and b"aggregated" in checks[0].get_attr("message")


def test_an_aggregate_that_overflows_writes_nothing_and_stops_the_chief():
    """Two finite gradients of 2e38 sum to Inf in the accumulator: the chief's check catches it."""
    graph = tf.Graph()
    with graph.as_default():
        scale = tf.compat.v1.placeholder(tf.float32, [], name="scale")
        w = tf.compat.v1.get_variable("w", [], initializer=tf.compat.v1.constant_initializer(0.5))
        optimizer = tf.compat.v1.train.SyncReplicasOptimizer(
            tf.compat.v1.train.GradientDescentOptimizer(1e-3),
            replicas_to_aggregate=2,
            total_num_replicas=2,
        )
        train_op = slim_nanguard.create_train_op(w * scale, optimizer, nan_policy="skip")
        hook = optimizer.make_session_run_hook(is_chief=True)
        session = tf.compat.v1.train.MonitoredTrainingSession(
            is_chief=True,
            hooks=[hook],
            save_checkpoint_secs=None,
            save_summaries_steps=None,
            save_summaries_secs=None,
            log_step_count_steps=None,
            stop_grace_period_secs=1,
        )
        # The check's error stops the chief's coordinator; the session raises it at the latest
        # when it closes (a run in between may first see the token queue closed).
        with pytest.raises(tf.errors.InvalidArgumentError, match="aggregated gradient"):
            with session as sess:
                sess.run(train_op, {scale: 2e38})  # each gradient is finite: both pass the guard
                sess.run(train_op, {scale: 2e38})
                time.sleep(0.5)  # the chief's queue runner takes the round, fails its check
                assert _raw(sess, w) == 0.5
                assert _raw(sess, tf.compat.v1.train.get_global_step()) == 0
                try:
                    sess.run(train_op, {scale: 1.0})
                except tf.errors.OutOfRangeError:
                    pass


# ------------------------------------------------------------------------------------------
# The cluster's queues on a real in-process ps (and worker) server.


@pytest.fixture(scope="module")
def servers():
    """A ps and one worker in this process (TensorFlow cannot stop them; they end with it)."""
    return cluster_lib.in_process_servers()


def _run_on(target, build):
    graph = tf.Graph()
    with graph.as_default():
        fetches = build()
    with tf.compat.v1.Session(target, graph=graph) as session:
        return session.run(fetches)


def test_the_ps_gives_up_on_a_worker_whose_port_stopped_answering(servers):
    """Worker 0 says it is done; worker 1's port answered once, then refused for 5 s."""
    _, ps_server, _ = servers
    _run_on(ps_server.target, lambda: _cluster._done_queue(0).enqueue(0))
    now = [0.0]
    answered = {"w1": [True, False]}  # worker 1: up at the first look, then down for good

    def is_up(host):
        return host == "w0" or (answered["w1"].pop(0) if len(answered["w1"]) > 1 else False)

    def clock():
        now[0] += 1.0
        return now[0]

    gone = _cluster.serve_ps(
        ps_server.target,
        task=0,
        worker_hosts=["w0", "w1"],
        timeout_secs=5,
        poll_secs=0,
        is_up=is_up,
        clock=clock,
    )
    assert gone == [1] and 5 <= now[0] <= 8


def test_the_chief_answers_requests_queued_together_with_one_rollback(servers, tmp_path):
    """Three requests (workers 1, 2, 1) waiting at one step: one restore, then max_rollbacks."""
    spec, _, worker_server = servers
    replica = cluster_lib.build(cluster=spec, task=0, fed=True, nan_policy="skip", max_rollbacks=1)
    guard = slim_nanguard.get_guard(replica.train_op)
    records = []
    guard.add_listener(records.append)
    with replica.graph.as_default():
        hook = _cluster.ChiefRollbackHook(str(tmp_path))
        session = tf.compat.v1.train.MonitoredTrainingSession(
            master=worker_server.target,
            is_chief=True,
            checkpoint_dir=str(tmp_path),  # saves model.ckpt-0 at the start
            hooks=[hook],
            save_checkpoint_secs=3600,
            save_summaries_steps=None,
            save_summaries_secs=None,
            log_step_count_steps=None,
        )
    with session as sess:
        for seed in range(3):
            sess.run(replica.train_op, _feed(replica, seed))
        assert _raw(sess, replica.global_step) == 3

        def ask(tasks, steps):
            queue = _cluster._rollback_queue()
            return queue.enqueue_many((tasks, np.array(steps, np.int64), [np.nan] * len(tasks)))

        _run_on(worker_server.target, lambda: ask([1, 2, 1], [3, 2, 3]))
        sess.run(replica.train_op, _feed(replica, 3))  # the hook answers after this step
        assert _raw(sess, replica.global_step) == 0 and guard.state.rollbacks == 1
        (rollback,) = [r for r in records if r["kind"] == "rollback"]
        assert rollback["requested_by"] == [1, 2] and rollback["requests"] == 3
        assert rollback["step"] == 2 and rollback["skipped_batches"] == 0
        assert rollback["checkpoint"].endswith("model.ckpt-0")

        _run_on(worker_server.target, lambda: ask([2], [1]))
        with pytest.raises(slim_nanguard.NanLossError, match="worker 2 asked.*max_rollbacks=1"):
            sess.run(replica.train_op, _feed(replica, 4))


# ---------------------------------------------------------------------- the spike guard
def _spike_feed(replica, seed):
    """Batch `seed` with its features times -1,000: all finite, the loss and norm jump."""
    feed = _feed(replica, seed)
    feed[replica.placeholders["x"]] = feed[replica.placeholders["x"]] * np.float32(-1000.0)
    return feed


def _spike_variables(graph):
    return [v for v in graph.get_collection("variables") if v.op.name.startswith("nanguard_spike")]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_spike_statistics_live_on_the_ps_with_the_model(mode):
    """One set of statistics for every worker, saved in the chief's checkpoints; the report
    of a bad step stays on the worker that made it."""
    replica = cluster_lib.build(
        cluster=CLUSTER, task=1, check_numerics=MODES[mode], spike_policy="skip"
    )
    guard = slim_nanguard.get_guard(replica.train_op)
    stats = _spike_variables(replica.graph)
    assert sorted(v.op.name for v in stats) == [
        "nanguard_spike/count",
        "nanguard_spike/floor",
        "nanguard_spike/history",
    ]
    assert {v.device for v in stats} == {"/job:ps/task:0"}
    assert guard.report.device == "/job:worker/task:1"


@pytest.mark.parametrize("mode", sorted(MODES))
def test_sync_replicas_a_spiking_gradient_never_enters_the_accumulators(mode):
    """Each replica's gradient is judged against the statistics of the accepted ones before
    it reaches an accumulator: a spike accumulates nothing, takes no token and enters no
    statistics, and the chief's aggregate (a mean of accepted gradients, whose norm is at
    most theirs) never applies it."""
    warmup = 3
    replica = cluster_lib.build(
        sync_replicas=True,
        replicas_to_aggregate=1,
        fed=True,
        check_numerics=MODES[mode],
        nan_policy="skip",
        spike_policy="skip",
        spike_warmup_steps=warmup,
    )
    with replica.graph.as_default():
        weights = tf.compat.v1.trainable_variables()
        (count,) = [v for v in _spike_variables(replica.graph) if v.op.name.endswith("count")]
        with _session(replica, MODES[mode]) as sess:
            seed = 0
            # Past the warm-up (a stale gradient is dropped by the chief, not by the guard:
            # its step was accepted and entered the statistics).
            while _raw(sess, replica.global_step) < warmup + 1:
                assert seed < 20
                _step(sess, replica, _feed(replica, seed))
                seed += 1
                time.sleep(0.1)
            accepted = int(_raw(sess, count))
            assert accepted == seed
            time.sleep(0.2)
            before = _raw(sess, weights + [replica.global_step, count])
            try:
                loss, error = sess.run(replica.train_op, _spike_feed(replica, seed)), None
            except tf.errors.InvalidArgumentError as err:
                loss, error = None, err
            assert (error is not None) if MODES[mode] else np.isfinite(loss)
            time.sleep(0.2)  # the chief's queue runner would have applied by now
            after = _raw(sess, weights + [replica.global_step, count])
            assert all(np.array_equal(b, a) for b, a in zip(before, after))
            assert int(after[-1]) == accepted
            guard = slim_nanguard.get_guard(replica.train_op)
            if error is not None:  # check_numerics mode: the loop judges the error
                slim_nanguard.handle_numerics_error(sess, error)
            assert guard.last_event.cause == "spike"
