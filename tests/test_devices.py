"""The guard where TF-Slim users train: `model_deploy` clones on GPUs, and a train op built
under a GPU's device scope.

With no GPU here, three logical CPU devices stand in for the host and two GPUs, with soft
placement off as `tf_slim.learning.train` runs (`device_layout`): the input queue and the
variables on the host, each clone's forward and backward pass on its own device, each clone
dequeuing its batch inside its device scope. The guarded train op runs wherever tf-slim's
does, a bad step changes no variable and keeps its batch where the queue is, a good step
sends no more than four tensors more between devices than tf-slim's, and every op the guard
adds under a GPU's scope has a GPU kernel (TensorFlow's kernel registry) or runs on the host,
merged with a cluster's worker device. On a machine with a GPU, the last test runs the guard
there.
"""

import contextlib

import device_layout as layouts
import numpy as np
import pytest
import tensorflow as tf
import tf_slim as slim

import slim_nanguard

import nanguard_testlib as lib

LAYOUTS = {
    "one clone": dict(num_clones=1),
    "two clones": dict(num_clones=2),
    "two clones, variables on the first": dict(num_clones=2, variables_on="clone"),
    "two clones, a FIFOQueue of examples": dict(num_clones=2, pipeline="fifo"),
    "train op built on the first clone": dict(
        num_clones=2, train_op_device=layouts.clone_device(0)
    ),
}
each_layout = pytest.mark.parametrize("layout", sorted(LAYOUTS))

# Example 20 is in the sixth batch: step 5 of one clone, step 2 or 3 of two.
NAN_EXAMPLE = 20


@contextlib.contextmanager
def session_of(layout: layouts.Layout, guarded: bool = True):
    """A session on the three devices, the variables initialised and the queues running."""
    with layout.graph.as_default():
        init = [
            tf.compat.v1.global_variables_initializer(),
            tf.compat.v1.local_variables_initializer(),
        ]
        with tf.compat.v1.Session(config=layouts.session_config()) as sess:
            sess.run(init)
            if guarded:
                lib.mark_judged(sess, layout.train_op)
            coord = tf.compat.v1.train.Coordinator()
            threads = tf.compat.v1.train.start_queue_runners(sess, coord)
            try:
                yield sess
            finally:
                coord.request_stop()
                coord.join(threads, stop_grace_period_secs=5)


def guarded_step(sess, layout: layouts.Layout, mode: str):
    """Runs one step of the train op; returns whether the guard rejected it."""
    guard = slim_nanguard.get_guard(layout.train_op)
    if mode == "check_numerics":
        try:
            sess.run(layout.train_op)
            return False
        except tf.errors.InvalidArgumentError as err:
            assert slim_nanguard.is_numerics_error(err), err
            return True
    _, ok = sess.run([layout.train_op, guard.ok])
    return not ok


@each_layout
@lib.each_mode
def test_the_model_gardens_layout_trains_and_a_bad_step_changes_nothing(mode, layout):
    built = layouts.build(
        check_numerics=lib.MODES[mode], nan_examples=[NAN_EXAMPLE], **LAYOUTS[layout]
    )
    guard = slim_nanguard.get_guard(built.train_op)
    bad_steps = 0
    with session_of(built) as sess:
        for _ in range(8):
            before = built.variables(sess)
            if guarded_step(sess, built, mode):
                bad_steps += 1
                lib.assert_state_equal(before, built.variables(sess))
                # The bad step's batch is kept where the queue is, for the autopsy.
                kept = sess.run(list(guard.capture.variables))
                assert any(NAN_EXAMPLE in np.ravel(k) for k in kept if k.dtype == np.int64)
            else:
                after = built.variables(sess)
                assert after["global_step"] == before["global_step"] + 1
                assert not np.array_equal(after["fc1/weights"], before["fc1/weights"])
        final = built.variables(sess)
    assert bad_steps == 1
    assert final["global_step"] == 8 - bad_steps
    lib.assert_all_finite(final)


@pytest.mark.parametrize("spike", [False, True], ids=["nan guard", "nan and spike guard"])
@each_layout
@lib.each_mode
def test_a_good_step_sends_at_most_four_tensors_more_than_tf_slims(mode, layout, spike):
    """No gradient and no variable crosses devices for the guard: its reductions run beside
    their gradients, its verdict and the spike test's state beside the writes it gates; a few
    scalars cross."""
    sends = {}
    policies = dict(nan_policy="rollback", spike_policy="rollback") if spike else {}
    for guarded in (False, True):
        kwargs = dict(check_numerics=lib.MODES[mode], **policies) if guarded else {}
        built = layouts.build(guarded=guarded, **LAYOUTS[layout], **kwargs)
        with session_of(built, guarded) as sess:
            sess.run(built.train_op)
            _, sends[guarded] = layouts.run_with_partitions(sess, built.train_op)
    assert sends[True] <= sends[False] + 4, sends


POLICIES = ("raise", "stop", "skip", "rollback")


@pytest.mark.parametrize("policy", POLICIES)
@lib.each_mode
def test_every_policy_on_two_clones_under_learning_train(mode, policy, tmp_path):
    """The model garden's loop (`learning.train` with `make_train_step` and `FiniteSaver`) on
    two clones: the policy applies and nothing non-finite reaches a checkpoint."""
    logdir = str(tmp_path)
    built = layouts.build(
        check_numerics=lib.MODES[mode], nan_policy=policy, nan_examples=[NAN_EXAMPLE]
    )
    with built.graph.as_default():
        raises = pytest.raises(slim_nanguard.NanLossError) if policy == "raise" else None
        with raises or contextlib.nullcontext():
            slim.learning.train(
                built.train_op,
                logdir,
                train_step_fn=slim_nanguard.make_train_step(logdir),
                saver=slim_nanguard.FiniteSaver(),
                session_config=layouts.session_config(),
                number_of_steps=6,
                summary_op=None,
                save_summaries_secs=None,
            )
    (record,) = [r for r in slim_nanguard.read_events(logdir) if r["kind"] == "bad_step"]
    assert record["action"] == policy and record["loss"] == "nan"
    lib.assert_no_poisoned_checkpoint(logdir)
    reached = int(tf.train.latest_checkpoint(logdir).rsplit("-", 1)[1])
    if policy == "raise":  # The Supervisor's timer saved at its start: global step 0, 1 or 2.
        assert reached <= record["step"]
    else:  # learning.train's closing save: where the stop left it, or the step limit.
        assert reached == {"stop": record["step"], "skip": 6, "rollback": 6}[policy]


@lib.each_mode
def test_the_spike_guard_on_two_clones(mode):
    """A finite batch scaled by -1000 (confidently wrong), after the warm-up, is rejected on
    the clones."""
    built = layouts.build(
        check_numerics=lib.MODES[mode],
        spike_policy="skip",
        spike_warmup_steps=8,
        scaled_examples=range(4 * 30, 4 * 32),
        scale=-1000.0,
    )
    with session_of(built) as sess:
        bad = [guarded_step(sess, built, mode) for _ in range(18)]
    assert bad.index(True) in (15, 16) and sum(bad) == 1, bad


# ---------------------------------------------------------------------- kernels, statically
def _under_gpu(device_scope, **guard_kwargs) -> tf.Graph:
    """An MLP with batch norm, its train op and the hook's rollback saver built under
    `device_scope` (a GPU of this machine or of a cluster's worker)."""
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.device(device_scope):
        x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
        y = tf.compat.v1.placeholder(tf.int32, [None], name="y")  # int32: no GPU variable
        net = slim.fully_connected(x, 8, normalizer_fn=slim.batch_norm)
        logits = slim.fully_connected(net, 2, activation_fn=None)
        loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(y, logits)
        optimizer = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
        if guard_kwargs:
            train_op = slim_nanguard.create_train_op(loss, optimizer, **guard_kwargs)
            slim_nanguard.nan_hook(train_op, checkpoint_dir="/unused").begin()
        else:
            slim.learning.create_train_op(loss, optimizer)
    return graph


GUARDS = {
    f"{policy}{', spike' if spike else ''}": dict(
        nan_policy=policy, spike_policy=policy if spike else None, summarize_gradients=True
    )
    for policy in POLICIES
    for spike in (False, True)
}


def test_tf_slims_own_train_op_has_every_gpu_kernel():
    """The baseline the guard is held to: the kernel test finds nothing in tf-slim's op."""
    assert layouts.without_gpu_kernel(_under_gpu("/device:GPU:0")) == []


@pytest.mark.parametrize("guard", sorted(GUARDS))
@lib.each_mode
def test_every_op_the_guard_adds_under_a_gpu_has_a_gpu_kernel(mode, guard):
    graph = _under_gpu("/device:GPU:0", check_numerics=lib.MODES[mode], **GUARDS[guard])
    assert layouts.without_gpu_kernel(graph) == []


@lib.each_mode
def test_on_a_cluster_worker_the_guards_host_ops_merge_with_its_device(mode):
    """Under `replica_device_setter`, nothing lands on a bare ``/cpu:0``: the host's ops are
    the worker's own CPU, and no op of the worker lacks a kernel on its GPU."""
    setter = tf.compat.v1.train.replica_device_setter(
        ps_tasks=1, worker_device="/job:worker/task:1/device:GPU:0"
    )
    graph = _under_gpu(setter, check_numerics=lib.MODES[mode], **GUARDS["rollback, spike"])
    assert layouts.without_gpu_kernel(graph) == []
    jobs = {(layouts.placed(op).job, layouts.placed(op).task) for op in graph.get_operations()}
    assert jobs == {("worker", 1), ("ps", 0)}
    strings = [op for op in graph.get_operations() if op.type in _STRING_WORK]
    assert {op.type for op in strings} == _STRING_WORK
    for op in strings:
        assert layouts.placed(op).to_string() == "/job:worker/task:1/device:CPU:0", op.name


# What the guard does with strings: messages, summaries, the rollback saver.
_STRING_WORK = {"Assert", "ScalarSummary", "HistogramSummary", "SaveV2"}


# ---------------------------------------------------------------------- on a real GPU
@pytest.mark.skipif(
    not tf.config.list_physical_devices("GPU"),
    reason="needs a GPU (tf.config.list_physical_devices('GPU') is empty); run .ci/gpu_check "
    "on a GPU machine",
)
@pytest.mark.parametrize("policy", POLICIES)
@lib.each_mode
def test_on_a_gpu_a_bad_step_changes_nothing(mode, policy):
    """The train op built under ``/device:GPU:0``, soft placement off: it runs, and a bad step
    changes no variable."""
    graph = _under_gpu("/device:GPU:0", check_numerics=lib.MODES[mode], nan_policy=policy)
    train_op = graph.get_collection(tf.compat.v1.GraphKeys.TRAIN_OP)[0]
    guard = slim_nanguard.get_guard(train_op)
    config = tf.compat.v1.ConfigProto(allow_soft_placement=False)
    x = np.random.RandomState(0).randn(8, 4).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    bad_x = x.copy()
    bad_x[3, 2] = np.nan
    with graph.as_default(), tf.compat.v1.Session(config=config) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        lib.mark_judged(sess, train_op)
        feed = {"x:0": x, "y:0": y}
        sess.run(train_op, feed)
        before = lib.state(sess, graph)
        fetches = train_op if mode == "check_numerics" else [train_op, guard.ok]
        value, err = lib.run_step(sess, fetches, {"x:0": bad_x, "y:0": y})
        assert slim_nanguard.is_numerics_error(err) if mode == "check_numerics" else not value[1]
        lib.assert_state_equal(before, lib.state(sess, graph))
        sess.run(train_op, feed)
        assert int(sess.run(tf.compat.v1.train.get_global_step())) == 2
