"""A rollback after a run of bad steps goes back before the run began, or before the climb.

A regression model trains at a learning rate of 0.01 with a checkpoint every three steps; at
step 120 the rate jumps a hundredfold. The accepted steps after the jump climb, then the loss
overflows and ten bad steps in a row escalate to ``persistent_nan_policy="rollback"``. The
newest checkpoint was written inside the climb: restoring it would only start the bad run
again. The rollback goes to the newest checkpoint before the climb, and its record says why.
The rule is a pure function of the run and the losses before it, tested first.
"""

import json

import numpy as np
import tensorflow as tf
import tf_slim as slim

import slim_nanguard
from slim_nanguard import _rollback

import nanguard_testlib as lib

JUMP = 120


def test_a_climb_is_the_newest_losses_above_twice_the_typical_one():
    flat = [(s, 1.0 + 0.1 * (s % 3)) for s in range(100, 120)]
    climbing = flat + [(120, 1.05), (121, 3.0), (122, 9.0), (123, 40.0)]
    assert _rollback.climb_start(climbing, 124) == 121
    assert _rollback.climb_start(flat, 120) is None  # Noise is no climb.
    assert _rollback.climb_start(flat[:3], 103) is None  # Too few points to say.
    # Only the points before the bad step count.
    assert _rollback.climb_start(climbing, 121) is None


def test_the_onset_of_a_run_is_its_first_step_or_the_start_of_the_climb_before_it():
    flat = [(s, 1.0) for s in range(100, 124)]
    assert _rollback.onset(124, 1, flat) == (None, "")  # One bad step: the newest checkpoint.
    before, why = _rollback.onset(124, 10, flat)
    assert before == 124 and why.startswith("10 bad steps in a row began at global step 124")
    climbing = flat[:-3] + [(121, 3.0), (122, 9.0), (123, 40.0)]
    before, why = _rollback.onset(124, 1, climbing)
    assert before == 121 and "climbing from global step 121" in why
    assert _rollback.onset(None, 10, flat) == (None, "")


def _build(mode):
    rng = np.random.RandomState(0)
    w = rng.randn(8, 1).astype(np.float32)
    xs = rng.randn(250, 64, 8).astype(np.float32)
    ys = (xs @ w + rng.randn(250, 64, 1)).astype(np.float32)
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(1)
        x, y = tf.compat.v1.data.make_one_shot_iterator(
            tf.data.Dataset.from_tensor_slices((xs, ys)).repeat()
        ).get_next()
        hidden = slim.fully_connected(x, 16, activation_fn=tf.nn.relu, scope="hidden")
        prediction = slim.fully_connected(hidden, 1, activation_fn=None, scope="out")
        loss = tf.reduce_mean(tf.square(prediction - y))
        step = tf.compat.v1.train.get_or_create_global_step()
        rate = tf.compat.v1.train.piecewise_constant(step, [JUMP], [0.01, 1.0])
        train_op = slim_nanguard.create_train_op(
            loss,
            tf.compat.v1.train.GradientDescentOptimizer(rate),
            check_numerics=lib.MODES[mode],
            nan_policy="skip",
            persistent_nan_policy="rollback",
            rollback_lr_factor=0.5,
            max_rollbacks=5,
        )
    return graph, train_op


def _rollbacks(logdir):
    with tf.io.gfile.GFile(f"{logdir}/nanguard_events.jsonl") as f:
        records = [json.loads(line) for line in f]
    return [r for r in records if r["kind"] == "rollback"]


def _assert_before_the_climb(rollbacks):
    first = rollbacks[0]
    restored = slim_nanguard.storage.checkpoint_step(first["checkpoint"])
    # The jump's first update is at step 120: its state and every older one are good.
    assert restored <= JUMP + 1, first["checkpoint"]
    assert "climbing from global step" in first["why"] and "before the climb" in first["why"]


@lib.each_mode
def test_an_escalated_rollback_goes_back_before_the_climb(mode, tmp_path):
    graph, train_op = _build(mode)
    with graph.as_default():
        result = slim_nanguard.train(
            train_op, logdir=str(tmp_path), number_of_steps=200, save_checkpoint_steps=3
        )
    assert result.rollbacks >= 1
    _assert_before_the_climb(_rollbacks(tmp_path))
    lib.assert_no_poisoned_checkpoint(str(tmp_path))


@lib.each_mode
def test_tf_slims_learning_train_rolls_back_before_the_climb(mode, tmp_path):
    graph, train_op = _build(mode)
    with graph.as_default():
        saver = slim_nanguard.FiniteSaver(max_to_keep=100)
        # Every three steps, as above, with the loop's saver: the Supervisor saves by wall
        # time only, which would make where the rollback lands depend on the machine's speed.
        step_fn = slim_nanguard.make_train_step(str(tmp_path))
        slim.learning.train(
            train_op,
            str(tmp_path),
            number_of_steps=200,
            train_step_fn=lib.saving_every(3, saver, str(tmp_path), step_fn),
            saver=saver,
            save_interval_secs=None,
            save_summaries_secs=None,
            log_every_n_steps=1000,
        )
    _assert_before_the_climb(_rollbacks(tmp_path))


def test_a_steady_loss_below_zero_is_no_climb():
    negative = [(s, -3.0 - 0.01 * (s % 2)) for s in range(100, 124)]
    assert _rollback.climb_start(negative, 124) is None


def test_with_nothing_kept_before_the_run_the_rollback_takes_the_oldest_kept(tmp_path):
    graph = tf.Graph()
    with graph.as_default():
        step = tf.compat.v1.train.get_or_create_global_step()
        saver = tf.compat.v1.train.Saver(max_to_keep=3)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for at in (5, 6, 7, 8):
                sess.run(step.assign(at))
                saver.save(sess, str(tmp_path / "model.ckpt"), global_step=at)
    restorer = _rollback.Rollback.__new__(_rollback.Rollback)
    restorer._restored_step = None
    path, why = restorer._choose(str(tmp_path), 8, 3, "the run began at global step 3")
    # Kept: 6, 7, 8. None is older than 3: the oldest kept is the least far into the run.
    assert path.endswith("model.ckpt-6")
    assert why.endswith("but no checkpoint older than step 3 is kept: the oldest")
