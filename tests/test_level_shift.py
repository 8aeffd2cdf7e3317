"""A new level of training is not a spike: the guard says so, adapts and carries on.

A regression model trains on clean data; at step 150 the data turns four times noisier and
stays so: the loss moves from about 1 to about 16 for good. Every step is then a "spike", and
without more the run would end in the escalation of ``max_consecutive_bad_steps``. Five spikes
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
from slim_nanguard import _level_shift
from slim_nanguard import _policy
from slim_nanguard._policy import GuardConfig
from slim_nanguard._policy import GuardState

import nanguard_testlib as lib

STEPS, SHIFT = 260, 150


def _spike(step, loss, norm, over=("loss",), typical_loss=1.0, typical_norm=0.7):
    return {
        "step": step,
        "loss": loss,
        "grad_norm": norm,
        "over": list(over),
        "log_mean_loss": math.log(typical_loss),
        "log_mean_grad_norm": math.log(typical_norm),
    }


# ------------------------------------------------------------------ the judgement, pure


def test_five_spikes_that_hold_together_are_a_new_level_with_its_typical_values():
    run = [_spike(300, loss, 3.0) for loss in (15.0, 23.5, 20.2, 14.5, 14.9)]
    level = _level_shift.judge_run(run, 5)
    assert isinstance(level, _level_shift.LevelShift)
    assert level.old["loss"] == pytest.approx(1.0)
    assert level.new["loss"] == pytest.approx(np.exp(np.mean(np.log([15, 23.5, 20.2, 14.5, 14.9]))))
    assert level.values[0] == (15.0, 3.0) and level.steps == (300,) * 5
    assert "a new level, not a spike: 5 spikes in a row (at global step 300)" in level.describe()
    assert level.to_json()["cause"] == "level_shift"


@pytest.mark.parametrize(
    "losses, why",
    [
        ((15.0, 16.0, 15.5), "too few spikes"),
        ((2.0, 4.0, 8.0, 16.0, 32.0), "growing: a divergence"),
        ((15.0, 15.0, 400.0, 15.0, 15.0), "one value far from the rest"),
        ((15.0, float("inf"), 15.0, 15.0, 15.0), "not finite"),
    ],
)
def test_runs_that_do_not_hold_together_are_no_new_level(losses, why):
    run = [_spike(300 + i, loss, 3.0) for i, loss in enumerate(losses)]
    assert _level_shift.judge_run(run, 5) is None, why


def test_a_second_new_level_soon_after_the_first_is_refused_as_a_divergence():
    run = [_spike(300, 15.0, 3.0)] * 5
    refusal = _level_shift.judge_run(run, 5, steps_since_last=12)
    assert isinstance(refusal, _level_shift.Refusal)
    assert "only 12 steps were accepted since the last new level" in refusal.reason
    assert isinstance(_level_shift.judge_run(run, 5, steps_since_last=500), _level_shift.LevelShift)
    assert _level_shift.judge_run(run, 0) is None  # 0: never


def test_decide_takes_the_new_level_at_the_fifth_spike_and_the_run_starts_over():
    config = GuardConfig(nan_policy="skip", spike_policy="skip")
    state = GuardState(steps=200)
    decisions = []
    for loss in (15.0, 23.5, 20.2, 14.5, 14.9):
        observation = _policy.BadStep(300, "skip", cause="spike", spike=_spike(300, loss, 3.0))
        decision, state = _policy.decide(config, state, observation)
        decisions.append(decision)
    assert [d.level_shift is None for d in decisions] == [True] * 4 + [False]
    assert decisions[-1].action == "skip"
    assert (state.consecutive_bad_steps, state.level_shifts, state.spikes) == (0, 1, 5)
    assert state.spike_run == () and state.steps_at_level_shift == 200


def test_a_non_finite_step_inside_the_run_is_no_new_level():
    config = GuardConfig(nan_policy="skip", spike_policy="skip")
    state = GuardState()
    kinds = ["spike", "spike", "non_finite", "spike", "spike", "spike"]
    for kind in kinds:
        spike = _spike(300, 15.0, 3.0) if kind == "spike" else None
        decision, state = _policy.decide(
            config, state, _policy.BadStep(300, "skip", cause=kind, spike=spike)
        )
        assert decision.level_shift is None
    assert state.consecutive_bad_steps == 6


def test_a_run_escalates_first_when_the_new_level_would_need_as_many_spikes():
    config = GuardConfig(nan_policy="skip", spike_policy="skip", max_consecutive_bad_steps=5)
    state, decision = GuardState(), None
    for _ in range(5):
        spike = _spike(300, 15.0, 3.0)
        decision, state = _policy.decide(
            config, state, _policy.BadStep(300, "skip", cause="spike", spike=spike)
        )
    assert decision.level_shift is None and decision.cause == "max_consecutive_bad_steps"
    with pytest.raises(ValueError, match=r"^spike_level_shift_steps must be an integer >= 0"):
        GuardConfig(spike_policy="skip", spike_level_shift_steps=-1)


# ------------------------------------------------------------------ stories, every loop


def _data(shift=SHIFT, steps=STEPS + 20):
    """Regression batches whose noise turns four times larger at batch `shift`."""
    rng = np.random.RandomState(0)
    w = rng.randn(8, 1).astype(np.float32)
    xs = rng.randn(steps, 64, 8).astype(np.float32)
    noise = np.where(np.arange(steps)[:, None, None] < shift, 1.0, 4.0)
    ys = (xs @ w + noise * rng.randn(steps, 64, 1)).astype(np.float32)
    return xs, ys


def _build(mode, learning_rate=0.05, jump_at=None, **guard):
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(1)
        x, y = tf.compat.v1.data.make_one_shot_iterator(
            tf.data.Dataset.from_tensor_slices(_data())
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
        train_op = slim_nanguard.create_train_op(
            loss,
            tf.compat.v1.train.GradientDescentOptimizer(rate),
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
    assert level["cause"] == "level_shift" and len(level["steps"]) == 5
    assert level["steps"][0] >= SHIFT - 1  # Not before the data changed.
    assert 0.5 < level["old"]["loss"] < 3 and 8 < level["new"]["loss"] < 40
    assert guard.state.level_shifts == 1
    assert guard.state.spikes == 5  # The five of the new level, no more after it.


@lib.each_mode
def test_train_lives_with_a_new_level_of_the_loss_and_learns_on_it(mode, tmp_path):
    graph, train_op, _ = _build(mode)
    with graph.as_default():
        result = slim_nanguard.train(
            train_op, logdir=str(tmp_path), number_of_steps=STEPS, save_checkpoint_steps=100
        )
    assert result.stop_reason == "step_limit" and result.global_step == STEPS
    assert result.spikes == 5 and result.bad_steps == 5
    _assert_new_level_taken(_records(tmp_path), slim_nanguard.get_guard(train_op))
    assert 8 < result.final_loss < 40  # Trained on the new level: the noise's 16.


@lib.each_mode
def test_a_monitored_session_lives_with_a_new_level(mode, tmp_path):
    graph, train_op, _ = _build(mode)
    hooks = []
    if mode == "hook":
        hooks = [slim_nanguard.nan_hook(train_op, checkpoint_dir=str(tmp_path))]
    with graph.as_default():
        guard = slim_nanguard.get_guard(train_op)
        guard.use_autopsy_dir(str(tmp_path))
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


@lib.each_mode
def test_a_learning_rate_raised_a_thousandfold_never_ends_normally(mode, tmp_path):
    # Unguarded, the weights blow up a few steps after the jump; guarded, the run of spikes
    # may be taken for a new level, but what follows is not finite, and the run gives up.
    graph, train_op, _ = _build(mode, learning_rate=0.01, jump_at=120)
    with graph.as_default(), pytest.raises(slim_nanguard.NanLossError) as raised:
        slim_nanguard.train(
            train_op, logdir=str(tmp_path), number_of_steps=STEPS, save_checkpoint_steps=50
        )
    assert raised.value.cause == "max_consecutive_bad_steps"
    lib.assert_no_poisoned_checkpoint(str(tmp_path))
