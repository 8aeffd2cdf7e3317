"""A new level of training is not a spike: the guard says so, adapts and carries on.

A regression model trains on clean data; at step 150 the data turns four times noisier and
stays so: the loss moves from about 1 to about 16 for good. Every step is then a "spike", and
without more the run would end in the escalation of ``max_consecutive_bad_steps``. Eight spikes
in a row that hold together are a new level: the guard logs one line, records it (cause
``level_shift``, the typical values before and after), starts its statistics again from them
and trains on, in every loop. A learning rate raised a thousandfold still never ends normally,
and the judgement itself is a pure function, tested first without a graph.
"""

import json
import math

import numpy as np
import pytest
import tensorflow as tf
import tf_slim as slim

import slim_nanguard
from slim_nanguard import _policy
from slim_nanguard import _spike as spike_reason
from slim_nanguard._policy import GuardConfig
from slim_nanguard._policy import GuardState

import nanguard_testlib as lib

STEPS, SHIFT = 260, 150


def _spike(step, loss, norm, over=("loss",), typical_loss=1.0, typical_norm=0.7, std=0.2):
    return {
        "step": step,
        "loss": loss,
        "grad_norm": norm,
        "over": list(over),
        "log_mean_loss": math.log(typical_loss),
        "log_mean_grad_norm": math.log(typical_norm),
        "log_std_loss": std,
        "log_std_grad_norm": std,
    }


NEW_LEVEL = (15.0, 23.5, 20.2, 14.5, 14.9, 17.1, 16.0, 19.2)


# ------------------------------------------------------------------ the judgement, pure


def test_eight_spikes_that_hold_together_are_a_new_level_with_its_typical_values():
    run = [_spike(300, loss, 3.0) for loss in NEW_LEVEL]
    level = spike_reason.judge_run(run, 8)
    assert isinstance(level, spike_reason.LevelShift)
    assert level.old["loss"] == pytest.approx(1.0)
    assert level.new["loss"] == pytest.approx(np.exp(np.mean(np.log(NEW_LEVEL))))
    assert level.values[0] == (15.0, 3.0) and level.steps == (300,) * 8
    assert level.floor == (0.2, 0.2)  # The old level's deviation: the least one from now on.
    line = level.describe()
    assert "a new level, not a spike: 8 spikes in a row (at global step 300)" in line
    assert f"loss 1 -> {level.new['loss']:.4g}" in line
    assert "the model's own state" not in line  # Eight batches, eight values.
    assert level.to_json()["cause"] == "level_shift"


def test_the_same_jump_again_and_again_is_the_models_own_state():
    level = spike_reason.judge_run([_spike(1017, 0.03, 0.026, over=("grad_norm",))] * 8, 8)
    assert "the same values each time: the model's own state made them" in level.describe()


@pytest.mark.parametrize(
    "losses, why",
    [
        (NEW_LEVEL[:5], "too few spikes"),
        ((2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0), "growing: the later half far above"),
        (NEW_LEVEL[:7] + (400.0,), "one value far from the rest"),
        (NEW_LEVEL[:7] + (float("inf"),), "not finite"),
        (tuple(1000 * v for v in NEW_LEVEL), "far too high to be a level a run lives with"),
    ],
)
def test_runs_that_do_not_hold_together_are_no_new_level(losses, why):
    run = [_spike(300 + i, loss, 3.0) for i, loss in enumerate(losses)]
    assert spike_reason.judge_run(run, 8) is None, why
    assert spike_reason.judge_run([_spike(300, 15.0, 3.0)] * 8, 0) is None  # 0: never


def _spike_test(config):
    """The spike test of `config`, the reason its spikes carry (`BadStep.reason`)."""
    (spike,) = config.all_reasons
    return spike


def _decide_spikes(config, state, losses, step=300):
    decision = None
    for loss in losses:
        spike = _spike(step, loss, 3.0)
        decision, state = _policy.decide(
            config,
            state,
            _policy.BadStep(step, "skip", cause="spike", figures=spike, reason=_spike_test(config)),
        )
    return decision, state


def test_decide_takes_the_new_level_at_the_eighth_spike_and_the_run_starts_over():
    config = GuardConfig(nan_policy="skip", spike_policy="skip")
    decision, state = _decide_spikes(config, GuardState(steps=200), NEW_LEVEL[:7])
    assert decision.level_shift is None and state.consecutive_bad_steps == 7
    decision, state = _decide_spikes(config, state, NEW_LEVEL[7:])
    assert decision.action == "skip" and decision.level_shift is not None
    assert (state.consecutive_bad_steps, state.level_shifts, state.spikes) == (0, 1, 8)
    assert state.reason_run == () and state.level_taken_at == 300


@pytest.mark.parametrize(
    "persistent, action, cause",
    [("raise", "raise", "divergence"), ("stop", "stop", None), ("rollback", "rollback", None)],
)
def test_a_spike_on_the_new_levels_probation_is_a_divergence(persistent, action, cause):
    config = GuardConfig(nan_policy="skip", spike_policy="skip", persistent_nan_policy=persistent)
    _, state = _decide_spikes(config, GuardState(steps=200), NEW_LEVEL, step=300)
    for _ in range(5):  # Five steps accepted at the new level ...
        _, state = _policy.decide(config, state, _policy.GoodStep())
    decision, state = _decide_spikes(config, state, (400.0,), step=305)  # ... then a spike.
    assert decision.action == action and decision.give_up == cause
    assert "a spike 5 steps after taking a new level at global step 300" in decision.escalation
    assert "that level was a divergence" in decision.escalation
    # A rollback goes back before the run that was taken for a new level.
    assert decision.before_step == (300 if action == "rollback" else None)


def test_after_the_probation_a_spike_is_a_spike_again():
    # Counted in global steps: a loop that reports no good step (a MonitoredTrainingSession
    # with handle_numerics_error) ends the probation as well.
    config = GuardConfig(nan_policy="skip", spike_policy="skip")
    _, state = _decide_spikes(config, GuardState(), NEW_LEVEL)
    decision, state = _decide_spikes(config, state, (400.0,), step=300 + 190)
    assert decision.action == "skip" and decision.give_up is None


def test_a_non_finite_step_inside_the_run_is_no_new_level():
    config = GuardConfig(nan_policy="skip", spike_policy="skip")
    state = GuardState()
    kinds = ["spike", "spike", "non_finite"] + ["spike"] * 6
    for kind in kinds:
        spike = _spike(300, 15.0, 3.0) if kind == "spike" else None
        reason = _spike_test(config) if kind == "spike" else None
        decision, state = _policy.decide(
            config, state, _policy.BadStep(300, "skip", cause=kind, figures=spike, reason=reason)
        )
        assert decision.level_shift is None
    assert state.consecutive_bad_steps == 9


def test_a_rolling_back_spike_policy_takes_no_new_level():
    # Each rollback moves the global step back: the run of spikes a level needs never forms,
    # so only spike_policy="skip" takes new levels (the guide says so).
    config = GuardConfig(nan_policy="skip", spike_policy="rollback", max_rollbacks=20)
    state, decision = GuardState(), None
    for loss in NEW_LEVEL:
        spike = _spike(300, loss, 3.0)
        decision, state = _policy.decide(
            config,
            state,
            _policy.BadStep(
                300, "rollback", cause="spike", figures=spike, reason=_spike_test(config)
            ),
        )
    assert decision.level_shift is None and decision.action == "rollback"


def test_a_run_escalates_first_when_the_new_level_would_need_as_many_spikes():
    config = GuardConfig(nan_policy="skip", spike_policy="skip", max_consecutive_bad_steps=8)
    decision, _ = _decide_spikes(config, GuardState(), NEW_LEVEL)
    assert decision.level_shift is None and decision.give_up == "max_consecutive_bad_steps"
    with pytest.raises(ValueError, match=r"^spike_level_shift_steps must be an integer >= 0"):
        GuardConfig(spike_policy="skip", spike_level_shift_steps=-1)


# ------------------------------------------------------------------ stories, every loop


def _data(shift=SHIFT, steps=STEPS + 20, spike_at=None):
    """Regression batches whose noise turns four times larger at batch `shift`; the batch
    `spike_at`, if any, is scaled x100 (a one-off spike)."""
    rng = np.random.RandomState(0)
    w = rng.randn(8, 1).astype(np.float32)
    xs = rng.randn(steps, 64, 8).astype(np.float32)
    noise = np.where(np.arange(steps)[:, None, None] < shift, 1.0, 4.0)
    ys = (xs @ w + noise * rng.randn(steps, 64, 1)).astype(np.float32)
    if spike_at is not None:
        xs[spike_at] *= 100.0
    return xs, ys


def _build(mode, learning_rate=0.05, jump_at=None, optimizer="sgd", spike_at=None, **guard):
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(1)
        x, y = tf.compat.v1.data.make_one_shot_iterator(
            tf.data.Dataset.from_tensor_slices(_data(spike_at=spike_at))
        ).get_next()
        hidden = slim.fully_connected(x, 16, activation_fn=tf.nn.relu, scope="hidden")
        prediction = slim.fully_connected(hidden, 1, activation_fn=None, scope="out")
        loss = tf.reduce_mean(tf.square(prediction - y))
        step = tf.compat.v1.train.get_or_create_global_step()
        rate = learning_rate
        if jump_at is not None:
            rate = tf.compat.v1.train.piecewise_constant(
                step, [jump_at], [learning_rate, learning_rate * 1000]
            )
        guard = {"nan_policy": "skip", "spike_policy": "skip"} | guard
        make = {
            "sgd": tf.compat.v1.train.GradientDescentOptimizer,
            "adam": tf.compat.v1.train.AdamOptimizer,
        }[optimizer]
        train_op = slim_nanguard.create_train_op(
            loss,
            make(rate),
            check_numerics=lib.MODES[mode],
            **guard,
        )
    return graph, train_op, loss


def _records(logdir):
    path = f"{logdir}/nanguard_events.jsonl"
    with tf.io.gfile.GFile(path) as f:
        return [json.loads(line) for line in f]


def _assert_new_level_taken(records, guard):
    (shift,) = [r for r in records if r["kind"] == "level_shift"]
    level = shift["level_shift"]
    assert level["cause"] == "level_shift" and len(level["steps"]) == 8
    assert level["steps"][0] >= SHIFT - 1  # Not before the data changed.
    assert 0.5 < level["old"]["loss"] < 3 and 8 < level["new"]["loss"] < 40
    assert guard.state.level_shifts == 1
    assert guard.state.spikes == 8  # The eight of the new level, no more after it.


@lib.each_mode
def test_train_lives_with_a_new_level_of_the_loss_and_learns_on_it(mode, tmp_path):
    graph, train_op, _ = _build(mode)
    with graph.as_default():
        result = slim_nanguard.train(
            train_op, logdir=str(tmp_path), number_of_steps=STEPS, save_checkpoint_steps=100
        )
    assert result.stop_reason == "step_limit" and result.global_step == STEPS
    assert result.spikes == 8 and result.bad_steps == 8
    _assert_new_level_taken(_records(tmp_path), slim_nanguard.get_guard(train_op))
    assert 8 < result.final_loss < 40  # Trained on the new level: the noise's 16.


@lib.each_mode
def test_a_spike_after_the_new_level_says_what_its_window_holds(mode, tmp_path, caplog):
    """The new level's eight values fill the statistics' warm-up three times over; a one-off
    spike 50-odd steps later is rejected, and its line and record count the window as it is:
    24 entries from the new level's spikes and one per step accepted since, not "accepted
    steps" it never had."""
    graph, train_op, _ = _build(mode, spike_at=SHIFT + 70)
    with graph.as_default():
        result = slim_nanguard.train(
            train_op, logdir=str(tmp_path), number_of_steps=STEPS, save_checkpoint_steps=100
        )
    assert result.stop_reason == "step_limit" and result.spikes == 9
    records = _records(tmp_path)
    (shift,) = [r for r in records if r["kind"] == "level_shift"]
    taken_at = shift["step"]
    (spike,) = [r for r in records if r["kind"] == "bad_step" and r["step"] > taken_at]
    figures = spike["spike"]
    since = spike["step"] - taken_at  # The eight spikes did not move the global step.
    assert (figures["level_entries"], figures["level_values"], figures["level_repeats"]) == (
        24,
        8,
        3,
    )
    assert figures["window_steps"] == 24 + since
    (line,) = [
        r.getMessage()
        for r in caplog.records
        if f"global step {spike['step']}" in r.getMessage() and "spike:" in r.getMessage()
    ]
    assert (
        f"over the {24 + since} values of its window: 24 from a new level's 8 spikes, each "
        f"taken 3 times, and {since} accepted since" in line
    ), line
    (said,) = [
        r.getMessage() for r in caplog.records if "a new level, not a spike" in r.getMessage()
    ]
    assert "start again from these 8 values (each taken 3 times, to fill the warm-up)" in said
    assert "a spike in the next 20 global steps will be taken for a divergence" in said


@lib.each_mode
def test_a_monitored_session_lives_with_a_new_level(mode, tmp_path):
    graph, train_op, _ = _build(mode)
    hooks = []
    if mode == "hook":
        hooks = [slim_nanguard.nan_hook(train_op, checkpoint_dir=str(tmp_path))]
    with graph.as_default():
        guard = slim_nanguard.get_guard(train_op)
        guard.registry.use_directory(str(tmp_path))
        global_step = tf.compat.v1.train.get_global_step()
        with tf.compat.v1.train.MonitoredTrainingSession(
            hooks=hooks, log_step_count_steps=None, save_summaries_steps=None
        ) as sess:
            while sess.run(global_step) < STEPS:
                try:
                    sess.run(train_op)
                except tf.errors.InvalidArgumentError as err:
                    slim_nanguard.handle_numerics_error(sess, err, checkpoint_dir=str(tmp_path))
    _assert_new_level_taken(_records(tmp_path), guard)


@lib.each_mode
def test_tf_slims_learning_train_lives_with_a_new_level(mode, tmp_path):
    graph, train_op, _ = _build(mode)
    with graph.as_default():
        final_loss = slim.learning.train(
            train_op,
            str(tmp_path),
            number_of_steps=STEPS,
            train_step_fn=slim_nanguard.make_train_step(str(tmp_path)),
            saver=slim_nanguard.FiniteSaver(),
            save_summaries_secs=None,
            log_every_n_steps=1000,
        )
    _assert_new_level_taken(_records(tmp_path), slim_nanguard.get_guard(train_op))
    assert 8 < final_loss < 40


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@lib.each_mode
def test_a_learning_rate_raised_a_thousandfold_never_ends_normally(mode, optimizer, tmp_path):
    # The step with the jump is accepted (its values come before its update); the next ones
    # are a run of spikes as flat as a new level's, and may be taken for one. What follows
    # shows the divergence: a spike on the new level's probation or a run of NaN steps; and a
    # level a hundred times above the old one is none (Adam's never reaches a NaN). Either way
    # the run gives up.
    graph, train_op, _ = _build(mode, learning_rate=0.01, jump_at=120, optimizer=optimizer)
    with graph.as_default(), pytest.raises(slim_nanguard.NanLossError) as raised:
        slim_nanguard.train(
            train_op, logdir=str(tmp_path), number_of_steps=STEPS, save_checkpoint_steps=50
        )
    assert raised.value.cause in ("divergence", "max_consecutive_bad_steps")
    assert raised.value.event.step < 150
    lib.assert_no_poisoned_checkpoint(str(tmp_path))
