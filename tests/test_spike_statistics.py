"""The spike test's running statistics, step by step, against the same arithmetic in NumPy
(z-scores of the logarithms of the loss and the gradient norm, over the accepted steps).

A small graph is fed a loss and a gradient norm per step, its update run on an accepted step
only (as the train op's gate runs it); the statistics must follow the accepted steps only, wake
up after the warm-up, and forget what left the window.
"""

import numpy as np
import pytest
import tensorflow as tf

from slim_nanguard import _spike
from slim_nanguard._policy import GuardConfig

import nanguard_testlib as lib


class _Steps:
    """A session over one `SpikeTest` fed ``(loss, norm)`` per step, its update run (as behind
    the train op's gate) only on an accepted step."""

    def __init__(self, sigma=6.0, warmup_steps=5, window=8):
        self.graph = tf.Graph()
        with self.graph.as_default():
            self.loss = tf.compat.v1.placeholder(tf.float32, [])
            self.norm = tf.compat.v1.placeholder(tf.float64, [])
            self.test = _spike.SpikeTest(
                self.loss, self.norm, sigma=sigma, warmup_steps=warmup_steps, window=window
            )
            self.update = self.test.update()
            self.z = self.test.z_scores()
            self.saver = tf.compat.v1.train.Saver()
            self.sess = tf.compat.v1.Session(graph=self.graph)
            self.sess.run(tf.compat.v1.global_variables_initializer())
        self.kept = []  # the accepted (loss, norm) pairs, as the reference keeps them

    def step(self, loss, norm, accept=None):
        """Runs one step; `accept` None accepts it unless it is a spike. Returns (z, spike)."""
        feed = {self.loss: loss, self.norm: norm}
        z, spike = self.sess.run([self.z, self.test.spike], feed)
        accepted = (not spike) if accept is None else accept
        if accepted:
            self.sess.run(self.update, feed)
            self.kept.append((loss, norm))
        return z, bool(spike)

    def variables(self):
        return self.sess.run([self.test.history, self.test.count])


def test_the_z_scores_are_numpys_over_the_accepted_steps_of_the_window():
    steps = _Steps(window=8, warmup_steps=3)
    rng = np.random.default_rng(0)
    for number in range(30):
        loss, norm = float(np.float32(2.0 + rng.normal(0, 0.1))), 1.0 + rng.normal(0, 0.05)
        accept = number % 4 != 3  # every fourth step rejected (as a NaN step would be)
        expected = lib.reference_z_scores(steps.kept, (loss, norm), window=8, warmup=3)
        z, _ = steps.step(loss, norm, accept=accept)
        if len(steps.kept) - int(accept) >= 3:
            np.testing.assert_allclose(z, expected, rtol=1e-9, atol=1e-9)
        else:
            np.testing.assert_array_equal(z, [0.0, 0.0])  # warming up
    assert steps.variables()[1] == len(steps.kept)


def test_a_jump_after_the_warm_up_is_a_spike_and_judging_it_writes_nothing():
    """The test reads the statistics and writes none of them: the train op's gate keeps a
    rejected step's update from running (test_spike_guard's statistics count accepted steps)."""
    steps = _Steps(window=8, warmup_steps=5)
    for loss in [2.0, 2.1, 1.9, 2.0]:
        z, spike = steps.step(loss, 1.0)
        assert list(z) == [0.0, 0.0] and not spike
    assert steps.step(50.0, 1.0)[1] is False  # the fifth step is still warm-up: accepted
    steps = _Steps(window=8, warmup_steps=5)
    for loss in [2.0, 2.1, 1.9, 2.0, 2.05]:
        steps.step(loss, 1.0)
    before = steps.variables()
    z, spike = steps.step(50.0, 1.0)
    assert spike and z[0] > 6 and z[1] == 0.0
    after = steps.variables()
    np.testing.assert_array_equal(before[0], after[0])  # the judgement wrote nothing
    assert before[1] == after[1] == 5
    z, spike = steps.step(2.02, 40.0)  # a gradient-norm spike alone
    assert spike and z[1] > 6


def test_a_run_of_outliers_is_never_absorbed():
    """Rejected steps do not move the mean: the tenth outlier is as much a spike as the first."""
    steps = _Steps(window=8, warmup_steps=5)
    for loss in [2.0, 2.1, 1.9, 2.0, 2.05]:
        steps.step(loss, 1.0)
    flagged = [steps.step(40.0, 1.0)[1] for _ in range(10)]
    assert flagged == [True] * 10


def test_the_window_forgets_the_old_scale():
    """After steep descent, only the last `window` accepted steps count."""
    steps = _Steps(window=8, warmup_steps=5, sigma=3.0)
    for loss in np.linspace(100.0, 10.0, 20):
        steps.step(float(loss), 1.0, accept=True)
    last = np.float32(np.linspace(100.0, 10.0, 20))[-8:]
    np.testing.assert_allclose(steps.sess.run(steps.test.mean)[0], np.mean(np.log(last)))


def test_a_nan_is_left_to_the_finiteness_test_and_an_inf_is_over_any_threshold():
    """A NaN is no spike (the finiteness test rejects it) and scores 0; an Inf is over any
    threshold and scores Inf: a float64 gradient norm overflows past about 1e154 while every
    gradient is finite, and that is the largest spike there is."""
    steps = _Steps(window=8, warmup_steps=2)
    for loss in [2.0, 2.1, 2.0]:
        steps.step(loss, 1.0)
    for loss, norm, column, is_spike in [
        (np.nan, 1.0, 0, False),
        (2.0, np.nan, 1, False),
        (np.inf, 1.0, 0, True),
        (2.0, np.inf, 1, True),
    ]:
        before = steps.variables()
        z, spike = steps.step(loss, norm, accept=False)
        assert z[column] == (np.inf if is_spike else 0.0) and spike == is_spike
        assert np.isfinite(z[1 - column])
        np.testing.assert_array_equal(steps.variables()[0], before[0])


def test_an_accepted_value_that_is_not_finite_is_kept_as_no_value():
    """In the warm-up nothing is a spike: a step whose norm overflowed is accepted, and its
    Inf must not reach the statistics (nor a checkpoint, which refuses non-finite values)."""
    steps = _Steps(window=8, warmup_steps=5)
    steps.step(2.0, 1.0)
    steps.step(2.0, np.inf, accept=True)
    history, count = steps.variables()
    assert np.isfinite(history).all() and count == 2
    np.testing.assert_array_equal(history[1], [2.0, 0.0])


def test_a_constant_loss_does_not_make_the_first_small_change_a_spike():
    """The deviation of a constant loss is 0; its floor (a factor of 1.05) keeps a change of a
    fraction of a percent ordinary, while a doubling is still a spike."""
    steps = _Steps(window=8, warmup_steps=3)
    for _ in range(5):
        steps.step(2.0, 1.0)
    assert steps.step(2.001, 1.0)[1] is False
    assert steps.step(4.0, 1.0)[1] is True


def test_the_statistics_are_saved_and_restored_with_the_checkpoint(tmp_path):
    """They are graph variables: a rollback's restore brings back the statistics it saved."""
    steps = _Steps(window=8, warmup_steps=3)
    for loss in [2.0, 2.1, 1.9]:
        steps.step(loss, 1.0)
    path = steps.saver.save(steps.sess, str(tmp_path / "model.ckpt"))
    saved = steps.variables()
    for loss in [5.0, 6.0, 7.0]:
        steps.step(loss, 2.0, accept=True)
    steps.saver.restore(steps.sess, path)
    restored = steps.variables()
    np.testing.assert_array_equal(restored[0], saved[0])
    assert restored[1] == saved[1] == 3


def test_a_heavy_tailed_loss_late_in_training_is_not_a_spike():
    """Most batches near 0.01, one in ten near 0.1: ordinary for a small batch late in
    training (a linear z-score would call the 0.1 batches 6-sigma spikes)."""
    steps = _Steps(window=128, warmup_steps=20)
    rng = np.random.default_rng(1)
    losses = np.where(rng.random(300) < 0.1, 0.1, 0.01) * np.exp(rng.normal(0, 0.3, 300))
    linear = []
    for loss in losses:
        if len(steps.kept) >= 20:
            recent = np.array(steps.kept[-128:])[:, 0]
            linear.append((loss - recent.mean()) / recent.std())
        assert steps.step(float(loss), 1.0)[1] is False
    assert max(linear) > 6  # what a linear z-score would have flagged
    assert steps.step(30.0, 1.0)[1] is True  # a loss 1,000 times the usual still is a spike


def test_a_loss_that_is_not_positive_is_never_a_spike_nor_counted():
    steps = _Steps(window=8, warmup_steps=3)
    for loss in [2.0, 2.1, 1.9, 2.0]:
        steps.step(loss, 1.0)
    for loss in [0.0, -5.0]:
        z, spike = steps.step(loss, 1.0)
        assert z[0] == 0.0 and not spike
    np.testing.assert_allclose(
        steps.sess.run(steps.test.mean)[0], np.mean(np.log(np.float32([2.0, 2.1, 1.9, 2.0])))
    )
    assert np.isnan(lib.reference_z_scores([(2.0, 1.0)], (0.0, 1.0))[0])


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"sigma": 0.0}, "spike_sigma"),
        ({"sigma": float("nan")}, "spike_sigma"),
        ({"warmup_steps": 1}, "spike_warmup_steps"),
        ({"warmup_steps": 500}, "spike_warmup_steps"),
    ],
)
def test_bad_settings_are_refused_by_name_where_they_are_checked(kwargs, flag):
    """`GuardConfig` is the one place a setting is checked; the test is built from one."""
    settings = {f"spike_{name}": value for name, value in kwargs.items()}
    with pytest.raises(ValueError, match=f"^{flag} must be"):
        GuardConfig(spike_policy="skip", **settings)


@pytest.mark.parametrize("later", [30.0, 10.0])
def test_a_spike_accepted_inside_the_warm_up_does_not_hide_the_next_one(later):
    """A batch a thousand times too large comes at step 10, inside the warm-up, where nothing
    is tested: it is accepted. Fifty steps later a batch `later` times too large comes: it
    is rejected all the same, at the z-score it would have had without the first, because
    the warm-up's outlier is left out of the statistics (and the NumPy arithmetic agrees)."""
    rng = np.random.default_rng(3)

    def run(first_spike):
        steps = _Steps(window=128, warmup_steps=20)
        for i in range(60):
            loss = 0.5 * np.exp(rng.normal(0, 0.1))
            scale = 1000.0 if (first_spike and i == 10) else 1.0
            _, spike = steps.step(loss * scale, 1.0)
            assert not spike  # The warm-up accepts all; after it, clean steps pass.
        z, spike = steps.step(0.5 * later, 1.0)
        reference = lib.reference_z_scores(steps.kept, (0.5 * later, 1.0))
        np.testing.assert_allclose(z[0], reference[0], rtol=1e-6)
        return z[0], spike

    z_alone, caught_alone = run(first_spike=False)
    z_after, caught_after = run(first_spike=True)
    assert caught_alone and caught_after
    assert z_after == pytest.approx(z_alone, rel=0.25)


def test_a_heavy_tail_seen_once_in_the_warm_up_stays_in_the_statistics():
    """One batch in the warm-up at ten times the loss is a tail, not a spike: it is kept."""
    steps = _Steps(window=128, warmup_steps=20)
    for i in range(20):
        steps.step(0.01 * (10.0 if i == 7 else 1.0) * (1 + 0.01 * i), 1.0)
    mean = steps.sess.run(steps.test.mean, {steps.loss: 0.01, steps.norm: 1.0})
    logs = np.log([0.01 * (10.0 if i == 7 else 1.0) * (1 + 0.01 * i) for i in range(20)])
    np.testing.assert_allclose(mean[0], logs.mean(), rtol=1e-9)


def _warm_up_with_an_outlier(steps, warmup, at=3, rng_seed=4):
    """Accepts `warmup` clean steps (loss about 0.5, norm about 1) but one loss at step `at`
    a thousand times too large."""
    rng = np.random.default_rng(rng_seed)
    for i in range(warmup):
        loss = 0.5 * np.exp(rng.normal(0, 0.1)) * (1000.0 if i == at else 1.0)
        steps.step(float(np.float32(loss)), 1.0 + rng.normal(0, 0.05), accept=True)


def test_the_window_turning_over_the_warm_up_judges_as_numpy_does():
    """A thousandfold loss late in the warm-up, then the window turns over the warm-up's rows
    one by one: at every step the z-scores are NumPy's. The outlier is left out while enough
    warm-up rows remain to tell it (`MIN_WARMUP_ENTRIES`), counted again after, then gone
    with its row."""
    steps = _Steps(window=12, warmup_steps=8)
    _warm_up_with_an_outlier(steps, 8, at=6)
    rng = np.random.default_rng(5)
    for number in range(30):
        loss = float(np.float32(0.5 * np.exp(rng.normal(0, 0.1))))
        norm = 1.0 + rng.normal(0, 0.05)
        expected = lib.reference_z_scores(steps.kept, (loss, norm), window=12, warmup=8)
        z, spike = steps.step(loss, norm, accept=True)
        if number == 0:  # Seven losses count: the loss column is still warming up.
            expected[0] = 0.0
        np.testing.assert_allclose(z, expected, rtol=1e-9, atol=1e-9)
        assert not spike


def test_the_warm_up_is_trimmed_by_its_writes_and_a_good_step_sorts_nothing():
    """The outlier is stored negated (no statistic counts it) by the write that made it one;
    after the warm-up, a good step's test and write run no sort at all."""
    steps = _Steps(window=128, warmup_steps=20)
    _warm_up_with_an_outlier(steps, 20, at=3)
    history, count = steps.variables()
    assert count == 20 and history[3, 0] < 0 and (np.delete(history[:20], 3, axis=0) > 0).all()
    kinds = _op_types_run(steps, [steps.test.spike, steps.update])
    assert "Greater" in kinds and not {"TopKV2", "Sort", "Transpose"} & kinds
    steps = _Steps(window=128, warmup_steps=20)
    _warm_up_with_an_outlier(steps, 10, at=3)
    assert "TopKV2" in _op_types_run(steps, [steps.test.spike, steps.update])  # warming up


def _op_types_run(steps, fetches):
    """The op types a traced run of an accepted clean step executes."""
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    metadata = tf.compat.v1.RunMetadata()
    feed = {steps.loss: 0.5, steps.norm: 1.0}
    steps.sess.run(fetches, feed, options=options, run_metadata=metadata)
    steps.kept.append((0.5, 1.0))
    return {
        node.timeline_label.split(" = ")[-1].split("(")[0]
        for device in metadata.step_stats.dev_stats
        for node in device.node_stats
    }


def test_a_restore_then_a_step_judges_as_before(tmp_path):
    """The trimmed warm-up is in the checkpoint: a step after a restore gets the z-scores it
    got when the checkpoint was written, and NumPy's."""
    steps = _Steps(window=16, warmup_steps=8)
    _warm_up_with_an_outlier(steps, 10)
    path = steps.saver.save(steps.sess, str(tmp_path / "model.ckpt"))
    kept = list(steps.kept)
    feed = {steps.loss: 0.9, steps.norm: 1.2}
    before = steps.sess.run(steps.z, feed)
    for loss in [5.0, 0.5, 0.6, 0.5]:
        steps.step(loss, 1.0, accept=True)
    steps.saver.restore(steps.sess, path)
    np.testing.assert_array_equal(steps.sess.run(steps.z, feed), before)
    expected = lib.reference_z_scores(kept, (float(np.float32(0.9)), 1.2), window=16, warmup=8)
    np.testing.assert_allclose(before, expected, rtol=1e-9)


def test_a_reseed_trims_its_values_as_the_writes_would():
    """A new level's values (`_spike.judge_run`) with an outlier among the first of them: the
    next step is judged as NumPy judges it after those values alone."""
    steps = _Steps(window=16, warmup_steps=8)
    _warm_up_with_an_outlier(steps, 12)
    rng = np.random.default_rng(6)
    rows = [[float(5.0 * np.exp(rng.normal(0, 0.1))), 2.0 + 0.01 * i] for i in range(10)]
    rows[2][0] *= 1000.0
    test = steps.test
    steps.sess.run(test.reseed, {test.reseed_values: rows, test.reseed_floor: [0.05, 0.05]})
    z = steps.sess.run(steps.z, {steps.loss: 6.0, steps.norm: 2.1})
    expected = lib.reference_z_scores(rows, (6.0, 2.1), window=16, warmup=8)
    np.testing.assert_allclose(z, expected, rtol=1e-9)
    assert steps.variables()[0][2, 0] < 0
