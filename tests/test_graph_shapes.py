"""The promise in the graphs users build around the train op, in both modes.

Each test is a short training run of a small graph the way TF-Slim users write it: an EMA
chained after the train op, slim.batch_norm updating in place, several steps in one
`tf.while_loop`, and a GAN's two train ops in one graph. A bad step writes nothing, a good
step trains, and the bad step is reported.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_slim as slim

import slim_nanguard
from slim_nanguard import _actions
from slim_nanguard import _guard

import nanguard_testlib as lib


def _raw(sess):
    """The tf.Session under a MonitoredSession (reading through it would run the hooks)."""
    return sess._tf_sess()  # pylint: disable=protected-access


# ------------------------------------------------------------------ EMA after the train op


def _with_ema_after_train_op(check_numerics: bool):
    """The pattern of ExponentialMovingAverage's docstring: averages applied after each step."""
    model = lib.build_model(check_numerics=check_numerics, nan_policy="skip")
    with model.graph.as_default():
        ema = tf.compat.v1.train.ExponentialMovingAverage(0.9)
        with tf.control_dependencies([model.train_op]):
            training_op = ema.apply(tf.compat.v1.trainable_variables())
    return model, training_op


@pytest.mark.parametrize("fault", ["nan_gradient", "nan_loss"])
def test_in_hook_mode_an_ema_chained_after_the_train_op_holds_still_on_a_bad_step(fault):
    model, training_op = _with_ema_after_train_op(check_numerics=False)
    guard = slim_nanguard.get_guard(model.train_op)
    hook = slim_nanguard.nan_hook(model.train_op)
    with model.graph.as_default(), tf.compat.v1.train.MonitoredSession(hooks=[hook]) as sess:
        for step in range(2):
            sess.run(training_op, model.feed(step))
        before = lib.state(_raw(sess), model.graph)
        assert np.any(before["fc1/weights/ExponentialMovingAverage"] != 0)
        loss, _ = sess.run([model.train_op, training_op], model.feed(2, fault))
        assert (fault == "nan_gradient") == bool(np.isfinite(loss))
        lib.assert_state_equal(before, lib.state(_raw(sess), model.graph))
        assert guard.last_event.action == "skip" and guard.state.total_bad_steps == 1
        sess.run(training_op, model.feed(3))  # the next good step moves the averages again
        after = lib.state(_raw(sess), model.graph)
    assert int(after["global_step"]) == 3
    assert not np.array_equal(
        after["fc1/weights/ExponentialMovingAverage"],
        before["fc1/weights/ExponentialMovingAverage"],
    )


def test_in_check_numerics_mode_an_ema_chained_after_the_train_op_holds_still_on_a_bad_step():
    model, training_op = _with_ema_after_train_op(check_numerics=True)
    with model.graph.as_default(), tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for step in range(2):
            sess.run(training_op, model.feed(step))
        before = lib.state(sess, model.graph)
        _, err = lib.run_step(sess, training_op, model.feed(2, "nan_gradient"))
        assert _guard.owns_error(slim_nanguard.get_guard(model.train_op), err)
        lib.assert_state_equal(before, lib.state(sess, model.graph))
        sess.run(training_op, model.feed(3))
        after = lib.state(sess, model.graph)
    assert not np.array_equal(
        after["fc1/weights/ExponentialMovingAverage"],
        before["fc1/weights/ExponentialMovingAverage"],
    )


# ------------------------------------------------------------------ batch norm in place


@pytest.fixture
def control_flow_v2():
    """Functional tf.cond and while loops (TF2's default; the suite runs TF1 behaviour)."""
    from tensorflow.python.ops import control_flow_util

    was = control_flow_util.ENABLE_CONTROL_FLOW_V2
    control_flow_util.ENABLE_CONTROL_FLOW_V2 = True
    yield
    control_flow_util.ENABLE_CONTROL_FLOW_V2 = was


# Variables and is_training: a Python bool on ref or resource variables, a tensor (a tf.cond
# around the updates) with TF1 control flow, or with control flow v2 (writes in a function).
BATCH_NORM_VARIANTS = ["resource", "ref", "cond", "cond_v2"]


@pytest.mark.parametrize("variant", BATCH_NORM_VARIANTS)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "not_fused"])
@lib.each_mode
def test_moving_statistics_updated_in_the_forward_pass_are_put_back_on_a_bad_step(
    mode, fused, variant, request
):
    """slim.batch_norm with updates_collections=None writes its moving mean and variance
    before the loss exists. A bad step (a NaN loss on finite statistics, then a NaN batch)
    leaves them as they were; the good steps around it move them."""
    from slim_nanguard import compat

    compat.install()  # slim.batch_norm needs it on current TensorFlow
    if variant == "cond_v2":
        request.getfixturevalue("control_flow_v2")
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.variable_scope("", use_resource=variant != "ref"):
        tf.compat.v1.set_random_seed(6)
        is_training = (
            True
            if variant in ("resource", "ref")
            else tf.compat.v1.placeholder_with_default(True, [], name="is_training")
        )
        x = tf.compat.v1.placeholder(tf.float32, [4, 3, 3, 2])
        y = tf.compat.v1.placeholder(tf.int64, [4])
        offset = tf.compat.v1.placeholder_with_default(0.0, [])
        net = slim.conv2d(
            x,
            4,
            [3, 3],
            normalizer_fn=slim.batch_norm,
            normalizer_params={
                "fused": fused,
                "is_training": is_training,
                "updates_collections": None,
            },
            scope="conv",
        )
        logits = slim.fully_connected(slim.flatten(net), 2, activation_fn=None, scope="out")
        loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(y, logits) + offset
        assert not graph.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
        assert (variant == "cond_v2") == any(
            op.type in ("If", "StatelessIf") for op in graph.get_operations()
        )
        train_op = slim_nanguard.create_train_op(
            loss,
            tf.compat.v1.train.MomentumOptimizer(0.1, 0.9),
            check_numerics=lib.MODES[mode],
            nan_policy="skip",
        )
        rng = np.random.RandomState(0)
        good = {x: rng.randn(4, 3, 3, 2).astype(np.float32), y: np.array([0, 1, 0, 1])}
        nan_batch = dict(good)
        nan_batch[x] = good[x].copy()
        nan_batch[x][1, 1, 1, 0] = np.nan
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            lib.mark_judged(sess, train_op)  # this loop judges each step itself
            sess.run(train_op, good)
            before = lib.state(sess, graph)
            assert np.any(before["conv/BatchNorm/moving_mean"])  # the good step moved it
            for bad in ({**good, offset: np.nan}, nan_batch):
                value, err = lib.run_step(sess, train_op, bad)
                if mode == "check_numerics":
                    assert _guard.owns_error(slim_nanguard.get_guard(train_op), err)
                else:
                    assert err is None and not np.isfinite(value)
                lib.assert_state_equal(before, lib.state(sess, graph))
            sess.run(train_op, good)
            after = lib.state(sess, graph)
    assert int(after["global_step"]) == 2
    for name in ("conv/BatchNorm/moving_mean", "conv/BatchNorm/moving_variance"):
        assert not np.array_equal(after[name], before[name]), name


@lib.each_mode
def test_an_update_op_the_loss_waits_on_is_put_back_without_a_warning(mode, caplog):
    """A step counter in UPDATE_OPS that the loss reads after the increment: a bad step leaves
    it as it was. A write to a variable in no collection cannot be put back and says so."""
    graph = tf.Graph()
    with graph.as_default():
        w = tf.compat.v1.get_variable("w", [3], initializer=tf.compat.v1.ones_initializer())
        seen = tf.compat.v1.get_variable(
            "examples_seen", [], trainable=False, initializer=tf.compat.v1.zeros_initializer()
        )
        hidden = tf.compat.v1.Variable(0.0, collections=[], name="hidden_counter")
        offset = tf.compat.v1.placeholder_with_default(0.0, [])
        count = tf.compat.v1.assign_add(seen, 1.0)
        tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.UPDATE_OPS, count)
        with tf.control_dependencies([count, tf.compat.v1.assign_add(hidden, 1.0)]):
            loss = tf.reduce_sum(w * w) + offset
        train_op = slim_nanguard.create_train_op(
            loss, tf.compat.v1.train.GradientDescentOptimizer(0.1), check_numerics=lib.MODES[mode]
        )
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert not any("examples_seen" in m or "feeds the loss" in m for m in warnings)
        assert any("hidden_counter" in m and "cannot be undone" in m for m in warnings)
        with tf.compat.v1.Session() as sess:
            sess.run([tf.compat.v1.global_variables_initializer(), hidden.initializer])
            sess.run(train_op)
            before = lib.state(sess, graph)
            assert before["examples_seen"] == 1
            lib.run_step(sess, train_op, {offset: np.inf})
            lib.assert_state_equal(before, lib.state(sess, graph))
            sess.run(train_op)
            assert sess.run(seen) == 2


# ------------------------------------------------------------------ tf.while_loop

ITERATIONS = 3


def _build_loop_model(check_numerics: bool):
    """Three SGD steps per run in a while loop, each on its own slice of the fed batches.

    Each iteration also counts the examples it saw, in a write its loss waits on."""
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.variable_scope("", use_resource=True):
        tf.compat.v1.set_random_seed(4)
        global_step = tf.compat.v1.train.get_or_create_global_step()
        xs = tf.compat.v1.placeholder(tf.float32, [None, lib.BATCH, lib.FEATURES], name="xs")
        weights = tf.compat.v1.get_variable("w", [lib.FEATURES, 1])
        seen = tf.compat.v1.get_variable(
            "examples_seen", [], trainable=False, initializer=tf.compat.v1.zeros_initializer()
        )
        opt = tf.compat.v1.train.MomentumOptimizer(0.05, 0.9)
        inner = []

        def body(i, total):
            with tf.control_dependencies([seen.assign_add(lib.BATCH)]):
                loss = tf.reduce_mean(tf.square(tf.matmul(xs[i], weights) - 1.0))
            train_op = slim_nanguard.create_train_op(
                loss, opt, check_numerics=check_numerics, nan_policy="skip"
            )
            inner.append(train_op)
            return i + 1, total + train_op

        _, total = tf.compat.v1.while_loop(
            lambda i, _: i < tf.shape(xs)[0],
            body,
            [tf.constant(0), tf.constant(0.0)],
            parallel_iterations=1,
        )
    return graph, xs, total, inner[0], global_step


def _loop_batches(count: int, bad=()):
    xs = np.random.RandomState(7).randn(count, lib.BATCH, lib.FEATURES).astype(np.float32)
    for i in bad:
        xs[i, 0, 1] = np.nan
    return xs


@pytest.fixture(params=["v1", "v2"], ids=["tf1_while", "functional_while"])
def while_loop_kind(request):
    """TF1 while loops (the suite's default) or control flow v2 (TF2's), where the body is a
    function of its own."""
    if request.param == "v2":
        request.getfixturevalue("control_flow_v2")
    return request.param


def test_in_check_numerics_mode_a_bad_iteration_raises_before_anything_is_written(while_loop_kind):
    """The loop builds; a bad first iteration raises the guard's error and writes nothing."""
    graph, xs, total, train_op, global_step = _build_loop_model(check_numerics=True)
    guard = slim_nanguard.get_guard(train_op)
    with graph.as_default(), tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(total, {xs: _loop_batches(ITERATIONS)})
        assert sess.run(global_step) == ITERATIONS  # three steps in one run
        before = lib.state(sess, graph)
        _, err = lib.run_step(sess, total, {xs: _loop_batches(ITERATIONS, bad=[0])})
        assert err is not None and slim_nanguard.is_numerics_error(err)
        assert _guard.owns_error(guard, err)
        lib.assert_state_equal(before, lib.state(sess, graph))
        # The executor, with the guard: the train op lives in the loop body's graph.
        event = _actions.judge(guard, sess, checkpoint_dir=None, error=err).event
        assert event.action == "skip" and event.culprits == ("w",)
        assert event.step == ITERATIONS
        sess.run(total, {xs: _loop_batches(ITERATIONS)})
        assert sess.run(global_step) == 2 * ITERATIONS


def test_in_hook_mode_a_bad_iteration_is_skipped_and_reported(while_loop_kind):
    """Iteration 1 of 3 is bad: the run trains exactly as the two good iterations alone do,
    and the hook reports the bad one."""
    good = _loop_batches(ITERATIONS)
    with_bad = good.copy()
    with_bad[1, 0, 1] = np.nan
    results = {}
    for name, batches in (("with_bad", with_bad), ("good_only", good[[0, 2]])):
        graph, xs, total, train_op, global_step = _build_loop_model(check_numerics=False)
        guard = slim_nanguard.get_guard(train_op)
        assert guard.in_loop and guard.ok is None
        assert (while_loop_kind == "v2") == any(op.type == "While" for op in graph.get_operations())
        hook = slim_nanguard.nan_hook(train_op)
        with graph.as_default(), tf.compat.v1.train.MonitoredSession(hooks=[hook]) as sess:
            sess.run(total, {xs: batches})
            sess.run(total, {xs: good})  # a clean run after it reports nothing
            results[name] = lib.state(_raw(sess), graph)
        results[name + "_events"] = guard.state.total_bad_steps
        results[name + "_event"] = guard.last_event
    assert results["with_bad_events"] == 1 and results["good_only_events"] == 0
    event = results["with_bad_event"]
    assert event.culprits == ("w",) and event.action == "skip"
    assert int(results["with_bad"]["global_step"]) == 2 + ITERATIONS
    assert results["with_bad"]["examples_seen"] == (2 + ITERATIONS) * lib.BATCH
    for name, value in results["good_only"].items():
        np.testing.assert_allclose(results["with_bad"][name], value, rtol=1e-6, err_msg=name)


def test_in_hook_mode_a_finite_overflow_after_a_bad_iteration_hides_nothing(while_loop_kind):
    """Iteration 1 is NaN; iteration 2's gradients are finite but so large that the fast sum
    of squares overflows (its exact test finds every value finite: a good iteration). The run
    still reports the NaN iteration, with its culprit: the good one wrote nothing over it."""
    batches = _loop_batches(ITERATIONS, bad=[1])
    batches[2] = 3e17
    graph, xs, total, train_op, _ = _build_loop_model(check_numerics=False)
    guard = slim_nanguard.get_guard(train_op)
    hook = slim_nanguard.nan_hook(train_op)
    with graph.as_default(), tf.compat.v1.train.MonitoredSession(hooks=[hook]) as sess:
        sess.run(total, {xs: batches})
    assert guard.state.total_bad_steps == 1
    assert guard.last_event.culprits == ("w",) and guard.last_event.action == "skip"


# ------------------------------------------------------------------ two train ops (a GAN)


def _build_gan(check_numerics: bool):
    """A generator and a discriminator, each with its own guarded train op and loss offset."""
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(5)
        z = tf.compat.v1.placeholder_with_default(
            np.random.RandomState(0).randn(lib.BATCH, 2).astype(np.float32), [None, 2]
        )
        real = tf.compat.v1.placeholder_with_default(
            np.random.RandomState(1).randn(lib.BATCH, 2).astype(np.float32) + 3.0, [None, 2]
        )
        g_offset = tf.compat.v1.placeholder_with_default(0.0, [], name="g_offset")
        d_offset = tf.compat.v1.placeholder_with_default(0.0, [], name="d_offset")
        fake = slim.fully_connected(z, 2, activation_fn=None, scope="generator")

        def discriminator(x, reuse):
            return slim.fully_connected(
                x, 1, activation_fn=None, scope="discriminator", reuse=reuse
            )

        d_real, d_fake = discriminator(real, False), discriminator(fake, True)
        d_loss = (
            tf.reduce_mean(tf.nn.softplus(-d_real))
            + tf.reduce_mean(tf.nn.softplus(d_fake))
            + d_offset
        )
        g_loss = tf.reduce_mean(tf.nn.softplus(-d_fake)) + g_offset
        g_train = slim_nanguard.create_train_op(
            g_loss,
            tf.compat.v1.train.AdamOptimizer(0.01),
            global_step=None,
            variables_to_train=tf.compat.v1.trainable_variables("generator"),
            check_numerics=check_numerics,
            nan_policy="raise",
        )
        d_train = slim_nanguard.create_train_op(
            d_loss,
            tf.compat.v1.train.AdamOptimizer(0.01),
            variables_to_train=tf.compat.v1.trainable_variables("discriminator"),
            check_numerics=check_numerics,
            nan_policy="skip",
        )
    return graph, g_train, d_train, g_offset, d_offset


def _changed(before, after, prefix):
    return [
        name
        for name in before
        if name.startswith(prefix) and not np.array_equal(before[name], after[name])
    ]


def test_in_hook_mode_each_gan_hook_judges_only_the_runs_of_its_own_train_op():
    """A discriminator step on a batch where the generator's loss is NaN trains the
    discriminator; the generator's hook does not run the generator's pass nor fire its
    'raise' policy. A generator step on that batch does raise, and writes nothing."""
    graph, g_train, d_train, g_offset, d_offset = _build_gan(check_numerics=False)
    g_guard, d_guard = slim_nanguard.get_guard(g_train), slim_nanguard.get_guard(d_train)
    hooks = [slim_nanguard.nan_hook(g_train), slim_nanguard.nan_hook(d_train)]
    with graph.as_default(), tf.compat.v1.train.MonitoredSession(hooks=hooks) as sess:
        before = lib.state(_raw(sess), graph)
        sess.run(d_train, {g_offset: np.nan})
        after = lib.state(_raw(sess), graph)
        assert _changed(before, after, "discriminator") and not _changed(before, after, "generator")
        assert g_guard.state.total_bad_steps == 0 and d_guard.state.total_bad_steps == 0
        # Nor does a run that only evaluates the generator's loss (nothing trains).
        assert not np.isfinite(sess.run(g_guard.loss, {g_offset: np.nan}))
        assert g_guard.state.total_bad_steps == 0
        # The discriminator's own bad step is its hook's business alone.
        sess.run(d_train, {d_offset: np.nan})
        assert (d_guard.state.skips, g_guard.state.total_bad_steps) == (1, 0)
        lib.assert_state_equal(after, lib.state(_raw(sess), graph))
        sess.run([g_train, d_train])  # one run of both: each hook judges it, both train
        trained = lib.state(_raw(sess), graph)
        assert _changed(after, trained, "generator") and _changed(after, trained, "discriminator")
        sess.run([g_train, d_train], {d_offset: np.nan})
        assert (d_guard.state.skips, g_guard.state.total_bad_steps) == (2, 0)
        trained = lib.state(_raw(sess), graph)
        with pytest.raises(slim_nanguard.NanLossError):
            sess.run(g_train, {g_offset: np.nan})
        lib.assert_state_equal(trained, lib.state(_raw(sess), graph))
    assert g_guard.state.total_bad_steps == 1 and d_guard.state.total_bad_steps == 2


def test_in_check_numerics_mode_each_gan_train_op_checks_only_its_own_step():
    graph, g_train, d_train, g_offset, d_offset = _build_gan(check_numerics=True)
    g_guard, d_guard = slim_nanguard.get_guard(g_train), slim_nanguard.get_guard(d_train)
    with graph.as_default(), tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        before = lib.state(sess, graph)
        _, err = lib.run_step(sess, d_train, {g_offset: np.nan})
        assert err is None
        after = lib.state(sess, graph)
        assert _changed(before, after, "discriminator") and not _changed(before, after, "generator")
        _, err = lib.run_step(sess, g_train, {g_offset: np.nan})
        assert _guard.owns_error(g_guard, err) and not _guard.owns_error(d_guard, err)
        lib.assert_state_equal(after, lib.state(sess, graph))


def test_a_spike_policy_in_a_loop_body_is_refused_with_what_to_do(while_loop_kind):
    """The hook of a train op built in a loop cannot tell which iteration spiked: refused."""
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.variable_scope("", use_resource=True):
        xs = tf.compat.v1.placeholder(tf.float32, [None, lib.BATCH, lib.FEATURES])
        weights = tf.compat.v1.get_variable("w", [lib.FEATURES, 1])
        opt = tf.compat.v1.train.GradientDescentOptimizer(0.05)

        def body(i, total):
            loss = tf.reduce_mean(tf.square(tf.matmul(xs[i], weights) - 1.0))
            train_op = slim_nanguard.create_train_op(loss, opt, spike_policy="skip")
            return i + 1, total + train_op

        with pytest.raises(ValueError, match="^spike_policy needs a train op built outside"):
            tf.compat.v1.while_loop(
                lambda i, _: i < tf.shape(xs)[0], body, [tf.constant(0), tf.constant(0.0)]
            )
