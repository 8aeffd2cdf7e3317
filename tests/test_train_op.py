"""The guarded train op: drop-in arguments, the atomic step, and telling errors apart.

Each test is a short training run in a plain `tf.compat.v1.Session`: a few good steps, one bad
step, and a look at every variable afterwards.
"""

import inspect

import numpy as np
import pytest
import tensorflow as tf
import tf_slim as slim

import slim_nanguard
from slim_nanguard import _actions
from slim_nanguard import _exact_sums

import nanguard_testlib as lib


def test_slim_check_numerics_lets_the_bad_update_reach_the_weights():
    """The measurement we set out to beat: slim raises only after the NaN update landed.

    The bad batch has a NaN loss and a NaN gradient, each made on every CPU kernel alike.
    """
    model = lib.build_model(train_op_fn=slim.learning.create_train_op, check_numerics=True)
    with model.graph.as_default(), tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(model.train_op, model.feed(0))
        _, err = lib.run_step(sess, model.train_op, model.feed(1, "nan_loss", "nan_gradient"))
        assert err is not None and slim_nanguard.is_numerics_error(err)
        weights = sess.run(tf.compat.v1.trainable_variables())
    assert not all(np.all(np.isfinite(w)) for w in weights), "slim no longer poisons weights?"


def test_slim_check_numerics_misses_a_nan_gradient_with_a_finite_loss():
    model = lib.build_model(train_op_fn=slim.learning.create_train_op, check_numerics=True)
    with model.graph.as_default(), tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        loss, err = lib.run_step(sess, model.train_op, model.feed(1, "nan_gradient"))
        assert err is None and np.isfinite(loss)
        assert not np.all(np.isfinite(sess.run(tf.compat.v1.trainable_variables("logits")[0])))


@pytest.mark.parametrize("optimizer", ["adam", "momentum", "sgd"])
@pytest.mark.parametrize("fault", lib.FAULTS)
@lib.each_mode
def test_a_bad_step_changes_no_variable(mode, fault, optimizer):
    """Weights, slots, Adam's beta powers, global_step and the moving mean all stay put."""
    model = lib.build_model(optimizer=optimizer, check_numerics=lib.MODES[mode])
    with model.graph.as_default(), tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for step in range(2):
            sess.run(model.train_op, model.feed(step))
        before = lib.state(sess, model.graph)
        assert int(before["global_step"]) == 2
        lib.mark_judged(sess, model.train_op)
        value, err = lib.run_step(sess, model.train_op, model.feed(2, fault))
        if mode == "check_numerics":
            assert err is not None and slim_nanguard.is_numerics_error(err)
            assert err.op.name == slim_nanguard.get_guard(model.train_op).check_op_name
        else:
            assert err is None and lib.loss_kind(value) in lib.FAULTS[fault].loss_kinds
        after = lib.state(sess, model.graph)
        lib.assert_state_equal(before, after)
        lib.assert_all_finite(after)
        # The next good batch trains as usual.
        sess.run(model.train_op, model.feed(3))
        assert int(sess.run(model.global_step)) == 3
        assert not np.array_equal(after["fc1/weights"], sess.run("fc1/weights:0"))


@lib.each_mode
def test_a_finite_step_matches_slim(mode):
    """Three good steps give tf-slim's weights, slots and moving mean to float tolerance."""
    results = []
    for train_op_fn in (slim.learning.create_train_op, slim_nanguard.create_train_op):
        model = lib.build_model(train_op_fn=train_op_fn, check_numerics=lib.MODES[mode])
        with model.graph.as_default(), tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            losses = [sess.run(model.train_op, model.feed(step)) for step in range(3)]
            results.append((losses, lib.state(sess, model.graph)))
    (slim_losses, slim_state), (our_losses, our_state) = results
    np.testing.assert_allclose(our_losses, slim_losses, rtol=1e-5)
    assert our_state.keys() == slim_state.keys()
    for name in slim_state:
        np.testing.assert_allclose(
            our_state[name], slim_state[name], rtol=1e-5, atol=1e-6, err_msg=name
        )


def test_the_silent_case_a_relu_that_maps_nan_to_zero():
    """A NaN input that the forward pass hides (finite loss) still poisons the gradients.

    The fused MatMul+BiasAdd+ReLU of some oneDNN CPU builds turns NaN into 0, so the loss
    stays finite while the first layer's gradient (x^T . delta) is NaN. This machine's kernel
    may propagate NaN instead, so the test spells that ReLU out (`where(z > 0, z, 0)` maps NaN
    to 0) to get the same behaviour on every CPU.
    """

    def build(train_op_fn):
        graph = tf.Graph()
        with graph.as_default():
            tf.compat.v1.set_random_seed(3)
            x = tf.compat.v1.placeholder(tf.float32, [None, 4])
            y = tf.compat.v1.placeholder(tf.int64, [None])
            z = slim.fully_connected(x, 16, activation_fn=None, scope="fc1")
            hidden = tf.where(z > 0, z, tf.zeros_like(z))  # NaN -> 0, like the fused kernel
            logits = slim.fully_connected(hidden, 3, activation_fn=None, scope="out")
            loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(y, logits)
            train_op = train_op_fn(
                loss, tf.compat.v1.train.GradientDescentOptimizer(0.1), check_numerics=True
            )
        return graph, x, y, loss, train_op

    xv = np.random.RandomState(0).randn(8, 4).astype(np.float32)
    xv[2, 1] = np.nan
    yv = np.arange(8) % 3

    graph, x, y, loss, train_op = build(slim.learning.create_train_op)
    with graph.as_default(), tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        # slim: no error, a finite loss, and dead weights.
        assert np.isfinite(sess.run(train_op, {x: xv, y: yv}))
        assert not np.all(np.isfinite(sess.run("fc1/weights:0")))
        # ... and the loss stays finite on clean data while the network is dead.
        assert np.isfinite(sess.run(loss, {x: np.nan_to_num(xv), y: yv}))

    graph, x, y, loss, train_op = build(slim_nanguard.create_train_op)
    with graph.as_default(), tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        before = lib.state(sess, graph)
        _, err = lib.run_step(sess, train_op, {x: xv, y: yv})
        assert err is not None and slim_nanguard.is_numerics_error(err)
        lib.assert_state_equal(before, lib.state(sess, graph))
        with pytest.raises(slim_nanguard.NanLossError) as raised:
            slim_nanguard.handle_numerics_error(sess, err)
        event = raised.value.event
        assert event.loss_kind == "finite" and "fc1/weights" in event.culprits
        assert "out/weights" not in event.culprits


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "not_fused"])
@lib.each_mode
def test_slim_batch_norm_moving_statistics_stay_put(mode, fused):
    """The moving mean and variance that slim.batch_norm's update ops assign are gated too."""
    from slim_nanguard import compat

    compat.install()  # slim.batch_norm needs it on current TensorFlow
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(2)
        x = tf.compat.v1.placeholder(tf.float32, [4, 3, 3, 2])
        y = tf.compat.v1.placeholder(tf.int64, [4])
        net = slim.conv2d(
            x,
            4,
            [3, 3],
            normalizer_fn=slim.batch_norm,
            normalizer_params={"fused": fused, "is_training": True},
            scope="conv",
        )
        logits = slim.fully_connected(slim.flatten(net), 2, activation_fn=None, scope="out")
        loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(y, logits)
        assert len(graph.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)) == 2
        train_op = slim_nanguard.create_train_op(
            loss, tf.compat.v1.train.MomentumOptimizer(0.1, 0.9), check_numerics=lib.MODES[mode]
        )
        rng = np.random.RandomState(0)
        good = {x: rng.randn(4, 3, 3, 2).astype(np.float32), y: np.array([0, 1, 0, 1])}
        bad = dict(good)
        bad[x] = good[x].copy()
        bad[x][1, 1, 1, 0] = np.nan
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(train_op, good)
            before = lib.state(sess, graph)
            assert np.any(before["conv/BatchNorm/moving_mean"])  # the good step moved it
            lib.run_step(sess, train_op, bad)
            lib.assert_state_equal(before, lib.state(sess, graph))
            sess.run(train_op, good)
            after = lib.state(sess, graph)
    assert not np.array_equal(
        after["conv/BatchNorm/moving_variance"], before["conv/BatchNorm/moving_variance"]
    )


def test_the_event_names_the_culprit_variables():
    model = lib.build_model(check_numerics=False, nan_policy="skip")
    guard = slim_nanguard.get_guard(model.train_op)
    with model.graph.as_default(), tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        _actions.mark_judged(guard, sess)
        sess.run(model.train_op, model.feed(0, "nan_gradient"))
        kinds = _exact_sums.kind_names(sess.run(guard.value_kinds))
    assert _actions.culprits(guard, kinds) == (("logits/weights",), ("nan",))
    assert _actions.culprits(guard, None) == ((), ())
    assert guard.variable_names == ("fc1/weights", "fc1/biases", "logits/weights", "logits/biases")


def test_in_hook_mode_a_good_step_costs_one_boolean_and_a_bad_step_keeps_what_it_held():
    """The hook fetches one boolean per step; only a bad step stores its loss and the kinds of
    its values, for the event."""
    model = lib.build_model(check_numerics=False, nan_policy="skip")
    guard = slim_nanguard.get_guard(model.train_op)
    hook = slim_nanguard.nan_hook(model.train_op)
    with model.graph.as_default(), tf.compat.v1.train.MonitoredSession(hooks=[hook]) as sess:

        def run_of(fetches):
            args = tf.compat.v1.train.SessionRunArgs(fetches)
            return tf.compat.v1.train.SessionRunContext(args, None)

        # One boolean, and the train op the run fetches anyway (its value is the loss the
        # record of a later bad step keeps): the session fetches a tensor once.
        request = hook.before_run(run_of(model.train_op))
        assert request.fetches == {"ok": guard.ok, "loss": model.train_op}
        assert hook.before_run(run_of(model.moving_mean)) is None  # a read: nothing added
        assert guard.ok.dtype == tf.bool and guard.ok.shape.rank == 0
        sess.run(model.train_op, model.feed(0))
        sess.run(model.train_op, model.feed(1, "nan_gradient"))
        first = guard.last_event
        sess.run(model.train_op, model.feed(2))
        sess.run(model.train_op, model.feed(3, "inf_loss"))
        second = guard.last_event
    assert first.culprits == ("logits/weights",) and first.loss_kind == "finite"
    assert second.culprits == () and second.loss_kind == "inf"
    assert (first.step, second.step) == (1, 2)


def test_in_hook_mode_a_run_of_the_loss_alone_is_not_a_step():
    """A run through the hooked session that fetches only the loss trains nothing and is no
    step: the hook adds nothing to it (no backward pass) and judges nothing, even on a bad
    batch. The train op's run on that batch is the bad step, reported with its culprits."""
    model = lib.build_model(check_numerics=False, nan_policy="skip")
    guard = slim_nanguard.get_guard(model.train_op)
    hook = slim_nanguard.nan_hook(model.train_op)
    with model.graph.as_default(), tf.compat.v1.train.MonitoredSession(hooks=[hook]) as sess:
        before = lib.state(sess._tf_sess(), model.graph)  # pylint: disable=protected-access
        sess.run(model.loss, model.feed(0, "nan_gradient"))
        assert guard.last_event is None and hook.last_outcome is None
        sess.run(model.train_op, model.feed(0, "nan_gradient"))
        after = lib.state(sess._tf_sess(), model.graph)  # pylint: disable=protected-access
    assert guard.last_event is not None and guard.state.total_bad_steps == 1
    assert guard.last_event.culprits == ("logits/weights",)
    lib.assert_state_equal(before, after)


def test_the_positional_arguments_are_slims():
    ours = list(inspect.signature(slim_nanguard.create_train_op).parameters.values())
    theirs = list(inspect.signature(slim.learning.create_train_op).parameters.values())
    assert [p.name for p in ours[: len(theirs)]] == [p.name for p in theirs]
    for mine, slims in zip(ours, theirs):
        assert mine.default == slims.default, mine.name
    assert ours[len(theirs)].name == "transform_grads_fn"
    assert all(p.kind == p.KEYWORD_ONLY for p in ours[len(theirs) + 1 :])


@lib.each_mode
def test_the_train_op_is_the_loss_and_joins_the_train_op_collection(mode):
    model = lib.build_model(check_numerics=lib.MODES[mode])
    assert model.train_op in model.graph.get_collection(tf.compat.v1.GraphKeys.TRAIN_OP)
    with model.graph.as_default(), tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        feed = model.feed(0)
        loss_before = sess.run(model.loss, feed)
        assert sess.run(model.train_op, feed) == pytest.approx(loss_before)


def _one_step_delta(**create_kwargs):
    """Runs one SGD step; returns {variable name: change}."""
    model = lib.build_model(optimizer="sgd", **create_kwargs)
    with model.graph.as_default(), tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        before = lib.state(sess, model.graph)
        sess.run(model.train_op, model.feed(0))
        after = lib.state(sess, model.graph)
    return {name: after[name] - before[name] for name in before}


class TestEveryArgumentWorks:
    """The arguments that crash in tf-slim 1.1.0 on current TensorFlow work here."""

    def test_clip_gradient_norm(self):
        delta = _one_step_delta(clip_gradient_norm=1e-3)
        # SGD with learning rate 0.1: no variable moves farther than 0.1 * 1e-3.
        for name in ("fc1/weights", "fc1/biases", "logits/weights", "logits/biases"):
            assert np.linalg.norm(delta[name]) <= 0.1 * 1e-3 * (1 + 1e-4), name
        assert np.linalg.norm(_one_step_delta()["fc1/weights"]) > 0.1 * 1e-3

    def test_gradient_multipliers_by_variable_and_by_name(self):
        plain = _one_step_delta()
        graph_free = _one_step_delta(
            gradient_multipliers={"fc1/weights": 0.0, "logits/biases": 2.0}
        )
        assert not np.any(graph_free["fc1/weights"])
        np.testing.assert_allclose(
            graph_free["logits/biases"], 2 * plain["logits/biases"], rtol=1e-5
        )
        np.testing.assert_allclose(graph_free["fc1/biases"], plain["fc1/biases"], rtol=1e-5)

    def test_gradient_multiplier_keyed_by_the_variable_object(self):
        def train_op_fn(loss, opt, **kwargs):
            var = tf.compat.v1.trainable_variables("fc1")[0]
            return slim_nanguard.create_train_op(
                loss, opt, gradient_multipliers={var: 0.0}, **kwargs
            )

        delta = _one_step_delta(train_op_fn=train_op_fn)
        assert not np.any(delta["fc1/weights"]) and np.any(delta["fc1/biases"])

    def test_summarize_gradients_survives_a_skipped_nan_step(self):
        model = lib.build_model(summarize_gradients=True, check_numerics=False, nan_policy="skip")
        with model.graph.as_default(), tf.compat.v1.Session() as sess:
            summaries = tf.compat.v1.summary.merge_all()
            names = [
                op.name for op in model.graph.get_operations() if op.type == "HistogramSummary"
            ]
            assert len(names) == 4
            sess.run(tf.compat.v1.global_variables_initializer())
            for fault in (None, "nan_input"):
                lib.mark_judged(sess, model.train_op)
                _, serialized = sess.run([model.train_op, summaries], model.feed(0, fault))
                assert tf.compat.v1.Summary.FromString(serialized).value

    def test_transform_grads_fn_runs_after_clipping(self):
        seen = []

        def transform(grads_and_vars):
            seen.append([v.op.name for _, v in grads_and_vars])
            return [
                (g * 0.0, v) if v.op.name == "logits/weights" else (g, v) for g, v in grads_and_vars
            ]

        delta = _one_step_delta(transform_grads_fn=transform, clip_gradient_norm=5.0)
        assert seen and "logits/weights" in seen[0]
        assert not np.any(delta["logits/weights"]) and np.any(delta["logits/biases"])

    def test_variables_to_train_and_no_global_step(self):
        def train_op_fn(loss, opt, **kwargs):
            return slim_nanguard.create_train_op(
                loss,
                opt,
                global_step=None,
                variables_to_train=tf.compat.v1.trainable_variables("logits"),
                **kwargs,
            )

        delta = _one_step_delta(train_op_fn=train_op_fn)
        assert not np.any(delta["fc1/weights"]) and np.any(delta["logits/weights"])

    def test_explicit_update_ops_gate_aggregation_and_colocation(self):
        def train_op_fn(loss, opt, **kwargs):
            return slim_nanguard.create_train_op(
                loss,
                opt,
                update_ops=[],
                gate_gradients=tf.compat.v1.train.Optimizer.GATE_NONE,
                aggregation_method=tf.AggregationMethod.ADD_N,
                colocate_gradients_with_ops=True,
                **kwargs,
            )

        delta = _one_step_delta(train_op_fn=train_op_fn)
        assert not np.any(delta["moving_mean"])  # update_ops=[] leaves the moving mean alone
        assert np.any(delta["fc1/weights"]) and int(delta["global_step"]) == 1


class TestTellingErrorsApart:
    def test_an_unrelated_invalid_argument_error_is_not_a_numerics_error(self):
        graph = tf.Graph()
        with graph.as_default(), tf.compat.v1.Session() as sess:
            x = tf.compat.v1.placeholder(tf.float32, [None])
            bad_reshape = tf.reshape(x, [3])
            with pytest.raises(tf.errors.InvalidArgumentError) as raised:
                sess.run(bad_reshape, {x: np.zeros(4)})
            # Its message even mentions NaN, to prove the test is on the op, not the text.
            check = tf.debugging.Assert(tf.reduce_all(x > 0), ["Tensor had NaN values"])
            with pytest.raises(tf.errors.InvalidArgumentError) as asserted:
                sess.run(check, {x: -np.ones(2)})
        assert not slim_nanguard.is_numerics_error(raised.value)
        assert "NaN values" in str(asserted.value)
        assert not slim_nanguard.is_numerics_error(asserted.value)
        assert not slim_nanguard.is_numerics_error(ValueError("Tensor had NaN values"))

    def test_train_step_lets_other_errors_through_untouched(self):
        """A gather that fails at run time inside the guarded loss propagates as it is."""
        graph = tf.Graph()
        with graph.as_default():
            w = tf.compat.v1.get_variable("w", [4])
            index = tf.compat.v1.get_variable(
                "index", initializer=tf.constant([1]), trainable=False
            )
            loss = tf.reduce_sum(tf.square(tf.gather(w, index)))
            train_op = slim_nanguard.create_train_op(
                loss, tf.compat.v1.train.GradientDescentOptimizer(0.1), nan_policy="skip"
            )
            step = tf.compat.v1.train.get_global_step()
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                loss_value, should_stop = slim_nanguard.train_step(sess, train_op, step, {})
                assert np.isfinite(loss_value) and not should_stop
                sess.run(index.assign([9]))  # out of range
                with pytest.raises(tf.errors.InvalidArgumentError) as raised:
                    slim_nanguard.train_step(sess, train_op, step, {})
        assert raised.value.op.type.startswith("Gather")
        assert not slim_nanguard.is_numerics_error(raised.value)
        assert slim_nanguard.get_guard(train_op).state.total_bad_steps == 0


class TestBadInput:
    def _graph_and_opt(self):
        graph = tf.Graph()
        with graph.as_default():
            w = tf.compat.v1.get_variable("w", [3])
        return graph, w, tf.compat.v1.train.GradientDescentOptimizer(0.1)

    def test_a_loss_that_is_not_a_tensor(self):
        _, _, opt = self._graph_and_opt()
        with pytest.raises(
            ValueError, match="total_loss must be a graph-mode tf.Tensor; got float 1.5"
        ):
            slim_nanguard.create_train_op(1.5, opt)

    def test_a_loss_of_the_wrong_dtype_or_shape(self):
        graph, w, opt = self._graph_and_opt()
        with graph.as_default():
            with pytest.raises(ValueError, match="floating-point.*dtype int32"):
                slim_nanguard.create_train_op(tf.constant(1), opt)
            with pytest.raises(ValueError, match=r"scalar.*shape \(3,\)"):
                slim_nanguard.create_train_op(w * 2.0, opt)

    @pytest.mark.parametrize(
        "kwargs, message",
        [
            (
                {"nan_policy": "ignore"},
                "nan_policy must be one of raise, stop, skip, rollback, auto; got 'ignore'",
            ),
            (
                {"max_consecutive_bad_steps": 0},
                "max_consecutive_bad_steps must be an integer >= 1; got 0",
            ),
            ({"max_consecutive_bad_steps": -3}, "got -3"),
            (
                {"persistent_nan_policy": "skip"},
                "persistent_nan_policy must be one of raise, stop, "
                r"rollback \(.*'skip' would never end\); got 'skip'",
            ),
            (
                {"persistent_nan_policy": "retry"},
                "persistent_nan_policy must be one of raise, stop, rollback .*got 'retry'",
            ),
            ({"rollback_lr_factor": 1.5}, r"rollback_lr_factor must be a number in \(0, 1\]"),
            ({"max_rollbacks": 0}, "max_rollbacks must be an integer >= 1; got 0"),
            ({"on_nan": "print"}, "on_nan must be callable"),
            ({"clip_gradient_norm": -1}, "clip_gradient_norm must be >= 0"),
        ],
    )
    def test_guard_options_out_of_range(self, kwargs, message):
        graph, w, opt = self._graph_and_opt()
        with graph.as_default():
            with pytest.raises(ValueError, match=message):
                slim_nanguard.create_train_op(tf.reduce_sum(w * w), opt, **kwargs)

    def test_an_optimizer_that_is_not_a_v1_optimizer(self):
        graph, w, _ = self._graph_and_opt()
        with graph.as_default():
            with pytest.raises(ValueError, match="optimizer must be a tf.compat.v1.train"):
                slim_nanguard.create_train_op(tf.reduce_sum(w * w), "sgd")

    @pytest.mark.parametrize("kind", ["keras", "tf_keras", "tf_keras_legacy"])
    @lib.each_mode
    def test_a_keras_optimizer_is_refused_by_name(self, mode, kind):
        """Keras 3, tf-keras and tf-keras legacy optimizers get the same clear message (a
        tf-keras one used to fail deep inside with a TypeError about gate_gradients)."""
        import keras
        import tf_keras

        optimizer = {
            "keras": keras.optimizers.SGD,
            "tf_keras": tf_keras.optimizers.SGD,
            "tf_keras_legacy": tf_keras.optimizers.legacy.SGD,
        }[kind](0.1)
        name = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        graph, w, _ = self._graph_and_opt()
        with graph.as_default():
            with pytest.raises(ValueError) as raised:
                slim_nanguard.create_train_op(
                    tf.reduce_sum(w * w), optimizer, check_numerics=lib.MODES[mode]
                )
        message = str(raised.value)
        assert message.startswith(f"optimizer must be a tf.compat.v1.train.Optimizer; got {name}.")
        assert "Use the tf.compat.v1.train optimizer of the same algorithm" in message

    def test_an_empty_variables_to_train_says_so(self):
        """variables_to_train=[] is the caller's list, not a graph without trainable variables."""
        graph, w, opt = self._graph_and_opt()
        with graph.as_default():
            with pytest.raises(ValueError) as raised:
                slim_nanguard.create_train_op(tf.reduce_sum(w * w), opt, variables_to_train=[])
        assert str(raised.value).startswith("variables_to_train is empty")
        assert "no trainable variables" not in str(raised.value)
        frozen = tf.Graph()
        with frozen.as_default():
            v = tf.compat.v1.get_variable("v", [3], trainable=False)
            with pytest.raises(ValueError, match="^the graph has no trainable variables"):
                slim_nanguard.create_train_op(tf.reduce_sum(v * v), opt)


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda: tf.compat.v1.train.GradientDescentOptimizer(0.5),
        lambda: tf.compat.v1.train.AdamOptimizer(0.5),
        lambda: tf.compat.v1.train.experimental.MixedPrecisionLossScaleOptimizer(
            tf.compat.v1.train.GradientDescentOptimizer(0.5), "dynamic"
        ),
    ],
    ids=["sgd", "adam", "loss_scale"],
)
def test_the_learning_rate_is_scaled_once_and_the_optimizer_left_as_it_was(make_optimizer):
    """Two create_train_op calls with one optimizer object: each update uses rate * scale
    (not rate * scale * scale), and the optimizer's own attribute is untouched."""
    graph = tf.Graph()
    with graph.as_default():
        optimizer = make_optimizer()
        owner = getattr(optimizer, "_optimizer", optimizer)
        attr = "_lr" if hasattr(owner, "_lr") else "_learning_rate"
        before = getattr(owner, attr)
        x = tf.compat.v1.get_variable("x", [], initializer=tf.compat.v1.constant_initializer(1.0))
        y = tf.compat.v1.get_variable("y", [], initializer=tf.compat.v1.constant_initializer(1.0))
        first = slim_nanguard.create_train_op(
            x * 1.0, optimizer, rollback_lr_factor=0.5, global_step=None
        )
        second = slim_nanguard.create_train_op(
            y * 1.0, optimizer, rollback_lr_factor=0.5, global_step=None
        )
        assert getattr(owner, attr) is before
        scale = slim_nanguard.get_guard(first).lr_scale
        assert scale is slim_nanguard.get_guard(second).lr_scale  # one per graph
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(scale.assign(0.25))
            sess.run(first)
            sess.run(second)
            x_value, y_value = sess.run([x, y])
    # The gradient is 1: the first step of gradient descent, and of Adam, moves the variable
    # by the learning rate it used. (Adam's second train op shares the first one's beta
    # powers, so its step is Adam's second: only the first is compared.)
    moved = [1 - x_value] if attr == "_lr" else [1 - x_value, 1 - y_value]
    np.testing.assert_allclose(moved, [0.5 * 0.25] * len(moved), rtol=1e-4)
