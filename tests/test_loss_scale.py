"""Mixed precision with a dynamic loss scale: an overflow is the scaler's business.

The model keeps float32 weights and computes in float16, and its optimizer is
`tf.compat.v1.train.experimental.MixedPrecisionLossScaleOptimizer` with a dynamic scale. Its
inputs are large enough that the first steps overflow float16 at the initial scale of 32768:
the optimizer skips them and halves the scale until the gradients fit, then trains. A guarded
train op lets the scale drop as tf-slim's does, writes no other variable on an overflow step,
and records those steps apart from real bad steps.
"""

import numpy as np
import tensorflow as tf
import tf_slim as slim

import slim_nanguard

import nanguard_testlib as lib

BATCH = 8
STEPS = 8
SCALE_VARIABLES = ("current_loss_scale", "good_steps")


def _batches(faults, count=100):
    """`count` batches (x, y, loss offset, norm scale); `faults` maps an index to a kind."""
    xs, ys, offsets, scales = [], [], [], []
    rng = np.random.RandomState(0)
    for i in range(count):
        x = rng.randn(BATCH, 4).astype(np.float32) * 3
        offset, scale = lib.fault((faults or {}).get(i)).corrupt(x)
        xs.append(x), ys.append(rng.randn(BATCH, 1).astype(np.float32))
        offsets.append(offset), scales.append(scale)
    return (np.stack(xs), np.stack(ys), np.array(offsets, np.float32), np.array(scales, np.float32))


def _build(
    train_op_fn=slim_nanguard.create_train_op, *, initial_scale=2**15, faults=None, **create_kwargs
):
    """float32 weights, float16 compute, a moving mean in UPDATE_OPS; returns (graph, op)."""
    graph = tf.Graph()
    with graph.as_default():
        data = tf.data.Dataset.from_tensor_slices(_batches(faults))
        x, y, offset, norm_scale = tf.compat.v1.data.make_one_shot_iterator(data).get_next()
        w = tf.compat.v1.get_variable(
            "w", [4, 1], initializer=tf.compat.v1.constant_initializer(0.5)
        )
        prediction = tf.cast(tf.matmul(tf.cast(x, tf.float16), tf.cast(w, tf.float16)), tf.float32)
        moving_mean = tf.compat.v1.get_variable(
            "moving_mean", [], initializer=tf.compat.v1.zeros_initializer(), trainable=False
        )
        tf.compat.v1.add_to_collection(
            tf.compat.v1.GraphKeys.UPDATE_OPS,
            tf.compat.v1.assign_sub(moving_mean, (moving_mean - tf.reduce_mean(prediction)) * 0.1),
        )
        # The norm's gradient is NaN when norm_scale is 0 (a NaN gradient, finite loss).
        loss = tf.reduce_mean(tf.square(prediction - y)) + 1e-3 * tf.norm(w * norm_scale) + offset
        scale = tf.compat.v1.mixed_precision.DynamicLossScale(initial_loss_scale=initial_scale)
        optimizer = tf.compat.v1.train.experimental.MixedPrecisionLossScaleOptimizer(
            tf.compat.v1.train.GradientDescentOptimizer(1e-3), scale
        )
        train_op = train_op_fn(loss, optimizer, **create_kwargs)
    return graph, train_op


def _steps(graph, train_op, steps=STEPS):
    """Runs `steps` steps in a plain session; returns each step's (loss, state after)."""
    history = []
    with graph.as_default(), tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        # Not marked judged: an overflow is no bad step, so nothing needs to judge it.
        history.append((None, lib.state(sess, graph)))
        for _ in range(steps):
            loss = sess.run(train_op)
            history.append((float(loss), lib.state(sess, graph)))
    return history


def _model_state(values):
    return {name: value for name, value in values.items() if name not in SCALE_VARIABLES}


@lib.each_mode
def test_an_overflow_lowers_the_scale_and_writes_nothing_else(mode):
    """Eight steps: the first ones overflow at 32768, the scale comes down as tf-slim's does
    (it stayed at 32768 for ever when the guard gated its update), and training resumes."""
    slim_history = _steps(*_build(slim.learning.create_train_op))
    ours = _steps(*_build(check_numerics=lib.MODES[mode], nan_policy="raise"))

    slim_scales = [values["current_loss_scale"] for _, values in slim_history]
    our_scales = [values["current_loss_scale"] for _, values in ours]
    assert slim_scales[0] == 32768 and slim_scales[-1] <= 4096
    np.testing.assert_array_equal(our_scales, slim_scales)
    trained = sum(
        after["global_step"] > before["global_step"]
        for (_, before), (_, after) in zip(ours, ours[1:])
    )
    assert trained == int(slim_history[-1][1]["global_step"]) and 0 < trained < STEPS
    np.testing.assert_allclose(ours[-1][1]["w"], slim_history[-1][1]["w"], rtol=1e-6)

    overflows = 0
    for (_, before), (loss, after) in zip(ours, ours[1:]):
        assert np.isfinite(loss)  # an overflow step returns the loss, in both modes
        if after["current_loss_scale"] < before["current_loss_scale"]:
            overflows += 1
            # The weights, global_step and the moving mean of UPDATE_OPS stay put.
            lib.assert_state_equal(_model_state(before), _model_state(after))
        else:
            assert after["global_step"] == before["global_step"] + 1
            assert not np.array_equal(after["moving_mean"], before["moving_mean"])
    assert overflows == STEPS - trained


@lib.each_mode
def test_the_record_shows_overflows_apart_from_bad_steps(tmp_path, mode):
    """Three overflows in a row, then a NaN loss. max_consecutive_bad_steps=2 would give up at
    the second overflow if overflows counted; the NaN loss is the one bad step."""
    graph, train_op = _build(
        check_numerics=lib.MODES[mode],
        nan_policy="skip",
        max_consecutive_bad_steps=2,
        faults={5: "nan_loss"},
    )
    with graph.as_default():
        result = slim_nanguard.train(
            train_op,
            str(tmp_path),
            number_of_steps=5,
            save_checkpoint_steps=1,
            save_summaries_steps=None,
            log_every_n_steps=0,
        )
    records = slim_nanguard.read_events(result.events_path)
    overflows = [r for r in records if r["kind"] == "loss_scale_overflow"]
    bad = [r for r in records if r["kind"] == "bad_step"]
    assert [r["loss_scale"] for r in overflows[:3]] == [32768, 16384, 8192]
    assert all(
        r["action"] == "loss_scale_overflow"
        and r["culprits"] == ["w"]
        and r["loss_kind"] == "finite"
        for r in overflows
    )
    assert len(bad) == 1 and (bad[0]["action"], bad[0]["loss"]) == ("skip", "nan")
    assert (result.bad_steps, result.skips) == (1, 1)
    assert result.loss_scale_overflows == len(overflows) >= 3
    assert result.global_step == 5 and result.stop_reason == "step_limit"
    lib.assert_no_poisoned_checkpoint(str(tmp_path))


@lib.each_mode
def test_at_the_scale_floor_a_non_finite_gradient_is_a_bad_step(tmp_path, mode):
    """A NaN gradient at scale 2 is taken for an overflow (the scale drops to its floor, 1);
    the next one, at the floor, is a bad step, and the policy applies."""
    graph, train_op = _build(
        check_numerics=lib.MODES[mode],
        nan_policy="stop",
        initial_scale=2,
        faults={1: "nan_gradient", 2: "nan_gradient"},
    )
    with graph.as_default():
        result = slim_nanguard.train(
            train_op,
            str(tmp_path),
            number_of_steps=5,
            save_checkpoint_steps=1,
            save_summaries_steps=None,
            log_every_n_steps=0,
        )
    records = [r for r in slim_nanguard.read_events(result.events_path) if r["kind"] != "stop"]
    assert [(r["kind"], r["action"], r["step"], r["loss_scale"]) for r in records] == [
        ("loss_scale_overflow", "loss_scale_overflow", 1, 2),
        ("bad_step", "stop", 1, 1),
    ]
    assert records[1]["culprits"] == ["w"]
    assert (result.loss_scale_overflows, result.bad_steps) == (1, 1)
    assert result.stop_reason == "nan_policy_stop" and result.global_step == 1
    lib.assert_no_poisoned_checkpoint(str(tmp_path))


@lib.each_mode
def test_a_rollback_lowers_the_inner_optimizers_learning_rate(tmp_path, mode):
    """The overflows at the start roll nothing back; a NaN loss at batch 5 rolls back once, and
    rollback_lr_factor scales the learning rate of the optimizer the loss-scale one wraps."""
    graph, train_op = _build(
        check_numerics=lib.MODES[mode],
        nan_policy="rollback",
        rollback_lr_factor=0.5,
        faults={5: "nan_loss"},
    )
    with graph.as_default():
        result = slim_nanguard.train(
            train_op,
            str(tmp_path),
            number_of_steps=5,
            save_checkpoint_steps=1,
            save_summaries_steps=None,
            log_every_n_steps=0,
        )
    assert (result.bad_steps, result.rollbacks, result.learning_rate_scale) == (1, 1, 0.5)
    assert result.loss_scale_overflows >= 3 and result.global_step == 5
    kinds = [r["kind"] for r in slim_nanguard.read_events(result.events_path)]
    assert kinds.count("bad_step") == kinds.count("rollback") == 1
    lib.assert_no_poisoned_checkpoint(str(tmp_path))


@lib.each_mode
def test_train_step_records_overflows_in_both_modes(mode):
    """tf_slim.learning.train's step function, by hand: the first steps overflow. In either
    mode each one is a ``loss_scale_overflow`` record, not a good step and not a bad one."""
    graph, train_op = _build(check_numerics=lib.MODES[mode], nan_policy="raise")
    guard = slim_nanguard.get_guard(train_op)
    records = []
    guard.add_listener(records.append)
    with graph.as_default(), tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        step = tf.compat.v1.train.get_global_step()
        for _ in range(STEPS):
            loss, should_stop = slim_nanguard.train_step(sess, train_op, step, {})
            assert np.isfinite(loss) and not should_stop
        trained = int(sess.run(step))
    overflows = [r for r in records if r["kind"] == "loss_scale_overflow"]
    assert len(overflows) == STEPS - trained >= 3
    assert [r["loss_scale"] for r in overflows[:3]] == [32768, 16384, 8192]
    assert all(r["action"] == "loss_scale_overflow" for r in overflows)
    assert not [r for r in records if r["kind"] == "bad_step"]
    assert guard.state.loss_scale_overflows == len(overflows)
    assert guard.state.total_bad_steps == 0
