"""The spike guard: a finite step whose loss or gradient norm jumps is rejected like a NaN step.

A run trains on clean batches, then meets a batch whose features are 1,000 times too large:
every value is finite, but the loss and the gradient norm jump. With ``spike_policy`` the step
changes no variable (weights, slots, ``global_step``, the moving mean, the spike statistics
themselves), its record says it was a spike and how far above the accepted steps it stood, and
training goes on. A run of spikes escalates as a run of NaN steps does; a rollback restores the
statistics with the weights; a clean run flags nothing; and without ``spike_policy`` the train
op is the one it was before the option existed.
"""

import hashlib

import numpy as np
import pytest
import tensorflow as tf
import tf_slim as slim

import slim_nanguard
from slim_nanguard import _actions
from slim_nanguard import _policy

import nanguard_testlib as lib

SPIKE_AT = 25  # after the warm-up of 20 accepted steps


def _run(mode, *, steps, faults, checkpoint_dir=None, checkpoint_steps=1, **create_kwargs):
    """Trains `steps` batches in a MonitoredTrainingSession, the policy applied as the
    README's loop does in each mode; returns the model and what the loop saw."""
    create_kwargs = {"nan_policy": "skip", "spike_policy": "skip"} | create_kwargs
    model = lib.build_model(faults=faults, check_numerics=lib.MODES[mode], **create_kwargs)
    hooks = []
    if mode == "hook":
        hooks = [slim_nanguard.nan_hook(model.train_op, checkpoint_dir=checkpoint_dir)]
    run = lib.run_monitored(
        model.train_op,
        hooks=hooks,
        feeds=[None] * steps,
        checkpoint_dir=checkpoint_dir,
        checkpoint_steps=checkpoint_steps,
        handle_numerics_errors=mode == "check_numerics",
    )
    return model, run


@lib.each_mode
def test_a_planted_spike_changes_nothing_and_is_recorded_with_its_cause(mode):
    model, run = _run(mode, steps=SPIKE_AT + 5, faults={SPIKE_AT: lib.SPIKE})
    (event,) = run.events
    assert (event.step, event.cause, event.action) == (SPIKE_AT, "spike", "skip")
    assert np.isfinite(event.loss) and event.culprits == ()
    # Nothing changed: not the weights, the Adam slots, the global step, the moving mean,
    # nor the statistics of the spike test.
    assert run.bad_step_changes == [[]]
    spike = event.spike
    assert spike["accepted_steps"] == SPIKE_AT
    assert max(spike["z_loss"], spike["z_grad_norm"]) > spike["sigma"] == 6.0
    assert spike["over"] and set(spike["over"]) <= {"loss", "grad_norm"}
    # The z-scores are those of the accepted steps before it, and the record says so.
    assert spike["loss"] > 10 * spike["typical_loss"]
    assert "spike" in event.describe() and "deviations above" in event.describe()
    record = event.to_json()
    assert record["cause"] == "spike" and record["spike"]["accepted_steps"] == SPIKE_AT
    guard = slim_nanguard.get_guard(model.train_op)
    assert (guard.state.total_bad_steps, guard.state.spikes) == (1, 1)
    # Training went on after it: the global step counts every batch but the spike.
    assert int(run.final["global_step"]) == SPIKE_AT + 4


@lib.each_mode
def test_the_statistics_count_the_accepted_steps_only(mode):
    model, run = _run(mode, steps=SPIKE_AT + 3, faults={SPIKE_AT: lib.SPIKE})
    final = run.final
    assert int(final["nanguard_spike/count"]) == SPIKE_AT + 2
    history = final["nanguard_spike/history"]
    # The spike's loss is in no row: every recorded loss is of the clean batches' size.
    losses = history[: SPIKE_AT + 2, 0]
    assert np.all(losses < 10 * np.median(losses))
    assert np.all(history[SPIKE_AT + 2 :] == 0)


@lib.each_mode
def test_a_non_finite_step_is_still_named_as_such(mode):
    _, run = _run(mode, steps=SPIKE_AT + 2, faults={SPIKE_AT: "nan_loss", SPIKE_AT + 1: "spike"})
    assert [(e.step, e.cause, e.loss_kind) for e in run.events] == [
        (SPIKE_AT, "non_finite", "nan"),
        (SPIKE_AT, "spike", "finite"),
    ]
    assert run.bad_step_changes == [[], []]
    assert "spike" not in run.events[0].to_json()


@lib.each_mode
def test_a_run_of_spikes_escalates_like_a_run_of_nan_steps(mode):
    faults = {SPIKE_AT + i: lib.SPIKE for i in range(3)}
    with pytest.raises(slim_nanguard.NanLossError) as caught:
        _run(mode, steps=SPIKE_AT + 5, faults=faults, max_consecutive_bad_steps=3)
    error = caught.value
    assert error.cause == "max_consecutive_bad_steps"
    assert error.event.cause == "spike" and error.event.consecutive == 3


@lib.each_mode
def test_a_spike_gets_the_spike_policy_not_the_nan_policy(mode):
    with pytest.raises(slim_nanguard.NanLossError) as caught:
        _run(mode, steps=SPIKE_AT + 2, faults={SPIKE_AT: lib.SPIKE}, spike_policy="raise")
    assert caught.value.event.cause == "spike"
    assert "spike_policy is 'raise'" in str(caught.value)


@lib.each_mode
def test_a_rollback_restores_the_statistics_with_the_weights(mode, tmp_path):
    """Checkpoints every 10 steps; the spike at step 25 rolls back to the one of step 20.
    The five steps accepted since had changed the statistics: the rollback puts back the
    checkpoint's, not the ones the run had before it."""
    logdir = str(tmp_path)
    model, run = _run(
        mode,
        steps=SPIKE_AT + 1,  # ends right after the rollback
        faults={SPIKE_AT: lib.SPIKE},
        checkpoint_dir=logdir,
        checkpoint_steps=10,
        spike_policy="rollback",
        rollback_skip_batches=0,
    )
    (event,) = run.events
    assert (event.cause, event.action) == ("spike", "rollback")
    assert event.spike["accepted_steps"] == SPIKE_AT  # what the statistics held before it
    saved = lib.checkpoint_values(tf.train.latest_checkpoint(logdir))
    assert int(saved["global_step"]) == int(run.final["global_step"]) == 20
    for name in ("nanguard_spike/count", "nanguard_spike/history"):
        np.testing.assert_array_equal(run.final[name], saved[name], err_msg=name)
    assert int(run.final["nanguard_spike/count"]) == 20
    lib.assert_no_poisoned_checkpoint(logdir)
    for path in lib.all_checkpoints(logdir):
        values = lib.checkpoint_values(path)
        assert int(values["nanguard_spike/count"]) == int(values["global_step"])


@lib.each_mode
def test_a_clean_run_flags_nothing(mode):
    model, run = _run(mode, steps=300, faults={})
    assert run.events == []
    guard = slim_nanguard.get_guard(model.train_op)
    assert guard.state.total_bad_steps == 0
    assert int(run.final["nanguard_spike/count"]) == 300


def _graph_digest(**create_kwargs):
    model = lib.build_model(**create_kwargs)
    graph_def = model.graph.as_graph_def()
    for node in graph_def.node:  # Where a node was built is not what it is.
        node.ClearField("experimental_debug_info")
    return hashlib.sha256(graph_def.SerializeToString(deterministic=True)).hexdigest(), {
        node.op for node in graph_def.node
    }


@lib.each_mode
def test_without_a_spike_policy_the_train_op_is_todays(mode):
    check = lib.MODES[mode]
    default, _ = _graph_digest(check_numerics=check)
    off, _ = _graph_digest(check_numerics=check, spike_policy=None, spike_sigma=3.0)
    assert off == default
    on, _ = _graph_digest(check_numerics=check, spike_policy="skip")
    assert on != default
    graph = lib.build_model(check_numerics=check).graph
    names = [op.name for op in graph.get_operations()]
    assert not [n for n in names if "spike" in n or "bad_step_report" in n]
    # Nor anything the spike guard needs around it: a rollback with a learning-rate factor
    # builds its one Saver, not the one for checkpoints written without the statistics.
    rollback = {"nan_policy": "rollback", "rollback_lr_factor": 0.5}
    graph = lib.build_model(check_numerics=check, **rollback).graph
    assert not [op for op in graph.get_operations() if "without_optional" in op.name]
    graph = lib.build_model(check_numerics=check, spike_policy="skip", **rollback).graph
    assert [op for op in graph.get_operations() if "without_optional" in op.name]


def test_a_spike_is_counted_and_decided_by_its_own_policy():
    config = _policy.GuardConfig(nan_policy="skip", spike_policy="raise")
    state = _policy.GuardState()
    decision, state = _policy.decide(
        config, state, _policy.BadStep(5, "raise", cause=slim_nanguard.Fault.SPIKE)
    )
    assert decision.action == "raise" and "spike_policy" in decision.reason
    assert (state.total_bad_steps, state.spikes) == (1, 1)
    decision, state = _policy.decide(config, state, _policy.BadStep(5, "skip"))
    assert (state.total_bad_steps, state.spikes, state.consecutive_bad_steps) == (2, 1, 2)
    assert state.since(_policy.GuardState()).spikes == 1


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"spike_policy": "ignore"}, "spike_policy"),
        ({"spike_sigma": 0}, "spike_sigma"),
        ({"spike_sigma": float("nan")}, "spike_sigma"),
        ({"spike_warmup_steps": 1}, "spike_warmup_steps"),
        ({"spike_warmup_steps": 129}, "spike_warmup_steps"),
    ],
)
def test_bad_spike_settings_are_refused_by_name(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name} must"):
        slim_nanguard.GuardConfig(**kwargs)


def test_a_spike_policy_that_rolls_back_needs_the_checkpoint_directory():
    config = _policy.GuardConfig(nan_policy="skip", spike_policy="rollback")
    assert _policy.rolls_back(config) and _policy.may_roll_back(config)
    quiet = _policy.GuardConfig(nan_policy="skip", spike_policy="skip")
    assert not _policy.rolls_back(quiet)


def test_the_summaries_carry_the_data_loss_the_gradient_norm_and_both_z_scores():
    model = lib.build_model(spike_policy="skip")
    with model.graph.as_default(), tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        loss, _ = sess.run([model.loss, model.train_op])  # the last accepted step's values
        merged = sess.run(tf.compat.v1.summary.merge_all())
    summary = tf.compat.v1.Summary.FromString(merged)
    values = {v.tag: v.simple_value for v in summary.value}
    assert set(values) == {
        "nanguard/data_loss",
        "nanguard/grad_norm",
        "nanguard/z_loss",
        "nanguard/z_grad_norm",
        *(f"nanguard/{n}" for n in ("bad_steps", "skips", "rollbacks", "stops", "level_shifts")),
    }
    assert values["nanguard/data_loss"] == np.float32(loss)  # no regularization: the loss
    assert values["nanguard/grad_norm"] > 0
    assert values["nanguard/z_loss"] == 0.0  # in the warm-up


def _bad_steps(logdir):
    return [r for r in slim_nanguard.read_events(str(logdir)) if r["kind"] == "bad_step"]


@lib.each_mode
def test_the_model_gardens_loop_skips_the_spike_and_records_it(mode, tmp_path):
    logdir = str(tmp_path)
    model = lib.build_model(
        faults={SPIKE_AT: lib.SPIKE},
        nan_policy="skip",
        spike_policy="skip",
        check_numerics=lib.MODES[mode],
    )
    with model.graph.as_default():
        slim.learning.train(
            model.train_op,
            logdir,
            train_step_fn=slim_nanguard.make_train_step(logdir),
            number_of_steps=SPIKE_AT + 2,
            save_summaries_secs=None,
            save_interval_secs=None,
        )
    (record,) = _bad_steps(logdir)
    assert (record["step"], record["cause"], record["action"]) == (SPIKE_AT, "spike", "skip")
    assert record["spike"]["accepted_steps"] == SPIKE_AT


@lib.each_mode
def test_train_counts_the_spike_and_its_autopsy_names_the_examples_that_carried_it(mode, tmp_path):
    model = lib.build_model(
        faults={SPIKE_AT: lib.SPIKE_ROWS},
        nan_policy="skip",
        spike_policy="skip",
        check_numerics=lib.MODES[mode],
    )
    result = slim_nanguard.train(
        model.train_op,
        str(tmp_path),
        number_of_steps=SPIKE_AT + 2,
        save_checkpoint_steps=None,
        save_summaries_steps=None,
        log_every_n_steps=0,
    )
    assert (result.bad_steps, result.spikes, result.skips) == (1, 1, 1)
    assert "1 bad (1 of them spikes, 1 skipped" in result.describe()
    (record,) = _bad_steps(tmp_path)
    autopsy = record["autopsy"]
    assert (record["cause"], autopsy["cause"]) == ("spike", "spike")
    named = [index for index, _ in autopsy["top_examples"]][: len(lib.SPIKING_EXAMPLES)]
    assert sorted(named) == sorted(lib.SPIKING_EXAMPLES)
    assert "carried the spike" in autopsy["summary"]


def _loss_scaled(loss, optimizer, **kwargs):
    scale = tf.compat.v1.mixed_precision.DynamicLossScale(initial_loss_scale=2.0**10)
    wrapped = tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer(optimizer, scale)
    return slim_nanguard.create_train_op(loss, wrapped, **kwargs)


@lib.each_mode
def test_with_a_dynamic_loss_scale_a_spike_is_a_spike_and_an_overflow_an_overflow(mode):
    faults = {SPIKE_AT: lib.SPIKE, SPIKE_AT + 1: "nan_gradient"}
    model, run = _run(mode, steps=SPIKE_AT + 3, faults=faults, train_op_fn=_loss_scaled)
    (spike,) = run.events  # The overflow is no bad step: the loop carries on, unreported.
    assert (spike.cause, spike.action, spike.step) == ("spike", "skip", SPIKE_AT)
    # The spike wrote nothing, not even the loss scale.
    assert run.bad_step_changes == [[]]
    guard = slim_nanguard.get_guard(model.train_op)
    assert (guard.state.spikes, guard.state.total_bad_steps) == (1, 1)
    # The overflow lowered the scale once, as the optimizer intends (1024 -> 512).
    (scale,) = [v for name, v in run.final.items() if name.endswith("current_loss_scale")]
    assert float(scale) == 2.0**9


# ---------------------------------------------------------------- turned on mid-run
def _train_steps(model, logdir, steps):
    return slim_nanguard.train(
        model.train_op,
        logdir,
        number_of_steps=steps,
        save_checkpoint_steps=5,
        save_summaries_steps=None,
        log_every_n_steps=0,
    )


@lib.each_mode
def test_a_run_resumes_with_the_spike_guard_turned_on_after_a_divergence(mode, tmp_path):
    """The run that diverged had no spike guard; its last good checkpoint has no statistics.
    Resumed from it with the guard on, training goes on (the statistics warm up again), and
    a rollback to that checkpoint restores the model and keeps the statistics."""
    logdir = str(tmp_path)
    check = lib.MODES[mode]
    _train_steps(lib.build_model(nan_policy="skip", check_numerics=check), logdir, 5)
    model = lib.build_model(
        faults={12: "nan_loss"},  # global step 17, after the resumed run's first save
        nan_policy="rollback",
        spike_policy="skip",
        rollback_skip_batches=0,
        check_numerics=check,
    )
    result = _train_steps(model, logdir, 20)
    assert result.global_step == 20 and result.rollbacks == 1
    lib.assert_no_poisoned_checkpoint(logdir)
    newest = lib.checkpoint_values(slim_nanguard.storage.latest_checkpoint(logdir))
    assert int(newest["nanguard_spike/count"]) > 0


def test_a_rollback_to_a_checkpoint_from_before_the_spike_guard_restores_the_model(tmp_path):
    """A rollback that lands on a checkpoint the run without the guard wrote (a walk back, a
    state file that still names it) restores the model and keeps the statistics."""
    logdir = str(tmp_path)
    old = lib.build_model(nan_policy="skip")
    _train_steps(old, logdir, 5)
    model = lib.build_model(nan_policy="rollback", spike_policy="skip")
    guard = slim_nanguard.get_guard(model.train_op)
    with model.graph.as_default(), tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        _actions.mark_judged(guard, sess)
        for _ in range(3):
            sess.run(model.train_op)
        statistics = sess.run("nanguard_spike/count/Read/ReadVariableOp:0")
        restored = guard.restorer.restore(sess, logdir, bad_step=3, learning_rate_scale=1.0)
        assert restored.step == 5 and restored.checkpoint.endswith("-5")
        after = lib.state(sess, model.graph)
    saved = lib.checkpoint_values(restored.checkpoint)
    assert "nanguard_spike/count" not in saved
    for name, value in saved.items():  # The model is the checkpoint's ...
        np.testing.assert_array_equal(after[name], value, err_msg=name)
    assert after["nanguard_spike/count"] == statistics == 3  # ... the statistics are kept.


# ------------------------------------------------------------------------- edges
def test_two_train_ops_of_one_graph_keep_statistics_of_their_own():
    """A GAN's two halves, or a head trained before the whole net: each train op's steps
    are judged against its own accepted steps, never the other's (whose loss may be 100
    times larger and quite normal)."""
    model = lib.build_model(nan_policy="skip", spike_policy="skip")
    with model.graph.as_default():
        second = slim_nanguard.create_train_op(
            100.0 * model.loss,
            tf.compat.v1.train.GradientDescentOptimizer(1e-4),
            global_step=None,
            nan_policy="skip",
            spike_policy="skip",
        )
    first, other = (slim_nanguard.get_guard(op) for op in (model.train_op, second))
    assert {v.op.name for v in first.handles.optional_variables} == {
        "nanguard_spike/history",
        "nanguard_spike/count",
        "nanguard_spike/floor",
    }
    assert {v.op.name for v in other.handles.optional_variables} == {
        "nanguard_spike_1/history",
        "nanguard_spike_1/count",
        "nanguard_spike_1/floor",
    }
    with model.graph.as_default(), tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for guard in (first, other):
            _actions.mark_judged(guard, sess)
        for _ in range(SPIKE_AT):  # the first op's statistics warm up
            sess.run(model.train_op)
        for _ in range(SPIKE_AT):  # the second op's steps are its own normal
            assert np.isfinite(sess.run(second))
    assert (first.state.total_bad_steps, other.state.total_bad_steps) == (0, 0)


@lib.each_mode
def test_a_float64_gradient_norm_that_overflows_is_a_spike_and_never_enters_the_statistics(
    mode,
):
    """Finite float64 gradients of 1e160 square past float64's range: every value is finite,
    so the finiteness test passes, and the norm (Inf) is the largest spike there is."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float64, [lib.BATCH, lib.FEATURES])
        scale = tf.compat.v1.placeholder_with_default(tf.constant(0.0, tf.float64), [])
        w = tf.compat.v1.get_variable("w", [lib.FEATURES, 1], tf.float64)
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - 1.0))
        # The same loss value, with a gradient of `scale` in every weight.
        loss += scale * (tf.reduce_sum(w) - tf.reduce_sum(tf.stop_gradient(w)))
        tf.compat.v1.train.get_or_create_global_step()
        train_op = slim_nanguard.create_train_op(
            loss,
            tf.compat.v1.train.GradientDescentOptimizer(1e-3),
            check_numerics=lib.MODES[mode],
            nan_policy="skip",
            spike_policy="skip",
        )
    rng = np.random.RandomState(0)
    feeds = [{x: rng.randn(lib.BATCH, lib.FEATURES)} for _ in range(SPIKE_AT + 2)]
    feeds[SPIKE_AT][scale] = 1e160
    run = lib.run_monitored(
        train_op,
        hooks=[slim_nanguard.nan_hook(train_op)] if mode == "hook" else [],
        feeds=feeds,
        handle_numerics_errors=mode == "check_numerics",
    )
    (event,) = run.events
    assert (event.cause, event.step) == ("spike", SPIKE_AT)
    assert event.spike["grad_norm"] == np.inf and "grad_norm" in event.spike["over"]
    assert run.bad_step_changes == [[]]
    lib.assert_all_finite(run.final)  # no Inf in the statistics: every checkpoint can be saved


def _in_scope(loss, optimizer, **kwargs):
    with tf.compat.v1.variable_scope("student"):
        return slim_nanguard.create_train_op(loss, optimizer, **kwargs)


def test_a_train_op_built_in_a_variable_scope_resumes_with_the_spike_guard_turned_on(tmp_path):
    """The statistics are the guard's own variables wherever they are named
    (``student/nanguard_spike/...``), not by a name prefix."""
    logdir = str(tmp_path)
    _train_steps(lib.build_model(nan_policy="skip", train_op_fn=_in_scope), logdir, 5)
    model = lib.build_model(nan_policy="skip", spike_policy="skip", train_op_fn=_in_scope)
    names = {v.op.name for v in slim_nanguard.get_guard(model.train_op).handles.optional_variables}
    assert names == {
        "student/nanguard_spike/history",
        "student/nanguard_spike/count",
        "student/nanguard_spike/floor",
    }
    result = _train_steps(model, logdir, 10)
    assert result.global_step == 10 and result.bad_steps == 0
