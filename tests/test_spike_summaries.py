"""The spike guard's summaries take no batch: they read what the last accepted step stored.

A run trains with ``spike_policy="skip"`` from an input pipeline that counts the batches it
hands out. The summaries ``nanguard/data_loss``, ``grad_norm``, ``z_loss`` and ``z_grad_norm``
are run besides the train steps, as the loops do: tf-slim's `learning.train` from its `Supervisor`'s
summary thread, every few milliseconds; a `MonitoredTrainingSession` from a
`SummarySaverHook` that fires on a run that only reads a weight. Every batch handed out was
trained on: as many batches as train steps. What the summaries show is the last accepted
step's data loss, gradient norm and z-scores, as the statistics recorded them.
"""

import itertools
import time

import numpy as np
import pytest
import tensorflow as tf
import tf_slim as slim

import slim_nanguard

import nanguard_testlib as lib


class CountingModel:
    """A small MLP whose every batch comes through a counter (`handed_out`)."""

    def __init__(self, check_numerics: bool):
        self.handed_out = 0
        self.graph = tf.Graph()
        with self.graph.as_default():
            tf.compat.v1.set_random_seed(1)
            x, y, _, _ = lib.batches(count=50)
            data = tf.data.Dataset.from_tensor_slices((x, y)).repeat()
            bx, by = tf.compat.v1.data.make_one_shot_iterator(data).get_next()
            bx = tf.numpy_function(self._count, [bx], tf.float32)
            bx.set_shape([lib.BATCH, lib.FEATURES])
            hidden = slim.fully_connected(bx, 16, activation_fn=tf.nn.relu, scope="fc1")
            logits = slim.fully_connected(hidden, 2, activation_fn=None, scope="logits")
            loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(by, logits)
            self.train_op = slim_nanguard.create_train_op(
                loss,
                tf.compat.v1.train.GradientDescentOptimizer(0.1),
                check_numerics=check_numerics,
                spike_policy="skip",
            )
            self.weight = tf.compat.v1.trainable_variables("fc1")[0]

    def _count(self, batch):
        self.handed_out += 1
        return batch


def test_learning_trains_summary_thread_takes_no_batch(tmp_path):
    model, steps = CountingModel(check_numerics=True), 300
    logdir = str(tmp_path)
    with model.graph.as_default():
        step = slim_nanguard.make_train_step(logdir)
        summary_op, summary_runs = lib.counted_summaries()
        started = []

        def waiting_step(*args):
            # Every 25th step waits for a run of the summary thread: it runs between the steps
            # at least 12 times, however slow the machine (its timer says when, not how often).
            if len(started) % 25 == 0:
                assert summary_runs.acquire(timeout=120), "the summary thread never ran"
            started.append(None)
            return step(*args)

        lib.learning_train(
            model.train_op,
            logdir,
            waiting_step,
            steps,
            summary_op=summary_op,
            save_summaries_secs=0.02,
        )
    written = [
        value
        for event in tf.compat.v1.train.summary_iterator(
            tf.io.gfile.glob(str(tmp_path / "events.out.tfevents.*"))[0]
        )
        for value in event.summary.value
        if value.tag == "nanguard/grad_norm"
    ]
    assert len(written) > 10  # the thread ran, again and again ...
    assert model.handed_out == steps  # ... and no batch went anywhere but into a step


@pytest.mark.parametrize("every", ["5 steps", "10 ms"])
@lib.each_mode
def test_a_summary_hook_firing_on_weight_reads_takes_no_batch(mode, every, tmp_path):
    """The hook fires on the first run (a read) and, by time, on reads as well as steps."""
    model, steps = CountingModel(check_numerics=lib.MODES[mode]), 60
    with model.graph.as_default():
        when = {"save_steps": 5} if every == "5 steps" else {"save_secs": 0.01}
        hooks = [
            tf.compat.v1.train.SummarySaverHook(
                output_dir=str(tmp_path), summary_op=tf.compat.v1.summary.merge_all(), **when
            )
        ]
        if mode == "hook":
            hooks.append(slim_nanguard.nan_hook(model.train_op))
        with tf.compat.v1.train.MonitoredTrainingSession(
            hooks=hooks, save_summaries_steps=None, log_step_count_steps=None
        ) as sess:
            for _ in range(steps):
                sess.run(model.weight)  # a read: the hook fires on it too
                time.sleep(0.006)
                sess.run(model.train_op)
    assert model.handed_out == steps


@lib.each_mode
def test_the_summaries_show_the_last_accepted_step(mode):
    """Before any step they show zeros (nothing was judged yet); after one, its gradient
    norm and its z-scores against the steps accepted before it, as the statistics hold
    them."""
    model = lib.build_model(spike_policy="skip", check_numerics=lib.MODES[mode])
    count, history = "nanguard_spike/count", "nanguard_spike/history"
    with model.graph.as_default(), tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        lib.mark_judged(sess, model.train_op)
        summary_op = tf.compat.v1.summary.merge_all()
        before = _values(sess.run(summary_op))
        for _ in itertools.repeat(None, 30):
            sess.run(model.train_op)
        after = _values(sess.run(summary_op))
        for _ in range(3):
            sess.run(summary_op)
        final = lib.state(sess, model.graph)
    assert before == {
        "nanguard/data_loss": 0.0,
        "nanguard/grad_norm": 0.0,
        "nanguard/z_loss": 0.0,
        "nanguard/z_grad_norm": 0.0,
        # The guard's counters, beside them (no bad step yet).
        "nanguard/bad_steps": 0.0,
        "nanguard/skips": 0.0,
        "nanguard/rollbacks": 0.0,
        "nanguard/stops": 0.0,
        "nanguard/level_shifts": 0.0,
    }
    assert int(final["global_step"]) == int(final[count]) == 30
    rows = final[history][:30]
    assert after["nanguard/data_loss"] == np.float32(rows[-1, 0])  # the loss judged
    assert after["nanguard/grad_norm"] == np.float32(rows[-1, 1])
    z = lib.reference_z_scores(rows[:-1].tolist(), tuple(rows[-1]))
    np.testing.assert_allclose(
        [after["nanguard/z_loss"], after["nanguard/z_grad_norm"]], z, rtol=1e-5, atol=1e-5
    )
    assert after["nanguard/z_loss"] != 0.0  # past the warm-up


def _values(serialized):
    summary = tf.compat.v1.Summary.FromString(serialized)
    return {v.tag: v.simple_value for v in summary.value}
