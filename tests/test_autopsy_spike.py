"""The autopsy of a spike step: the examples of the batch that carried it.

A spike step is finite: its loss or gradient norm is far above those of the accepted steps.
The stories: slim-style models train for a few steps on an ordinary batch; then one batch has
a few examples scaled up (finite), and the autopsy replays that step from the kept batch. It
must name those examples, highest per-example loss first, with each one's loss as the model
itself computes it, whatever builds the loss: `tf.compat.v1.losses` with a tf-slim
regularizer, `tf_slim.losses`, two loss terms, a hand-written `tf.reduce_mean`, a Keras loss.
A loss on the batch's mean cannot be split per example, and the autopsy says so.

Until the train op tells a spike from a good step, the guard's own path is reached after a
NaN step (which keeps its batch just as a spike step will): `_actions.autopsy_step(..., "spike")`.
"""

import json

import numpy as np
import pytest
import tensorflow as tf
import tf_slim as slim

import slim_nanguard
from slim_nanguard import _actions
from slim_nanguard import _autopsy
from slim_nanguard import autopsy as autopsy_reader

import nanguard_testlib as lib

BATCH = 32
FEATURES = 8
CLASSES = 4
# The examples the spiking batch scales up, the most scaled first.
CARRIERS = (17, 3)


def _hardest_labels(sess, per_example, x, y, xs, ys, carriers=CARRIERS):
    """`ys` with each carrier labelled with the class the model finds least likely, so that
    scaling it up raises its loss (a correct class would take its loss to 0 instead)."""
    losses = [
        sess.run(per_example, {x: xs, y: np.full_like(ys, label)}) for label in range(CLASSES)
    ]
    ys = ys.copy()
    for example in carriers:
        ys[example] = int(np.argmax([loss[example] for loss in losses]))
    return ys


def _batch(seed=0, carriers=CARRIERS):
    """A batch of BATCH examples; `carriers` scaled by 1000 and 100, in that order (finite)."""
    rng = np.random.RandomState(seed)
    xs = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
    ys = rng.randint(0, CLASSES, size=BATCH).astype(np.int64)
    for example, scale in zip(carriers, (1000.0, 100.0)):
        xs[example] *= scale
    return xs, ys


class _Story:
    """A model built in its own graph on fed placeholders, trained a few ordinary steps."""

    def __init__(self, build_loss):
        self.graph = tf.Graph()
        with self.graph.as_default():
            tf.compat.v1.set_random_seed(1)
            self.x = tf.compat.v1.placeholder(tf.float32, [None, FEATURES], name="x")
            self.y = tf.compat.v1.placeholder(tf.int64, [None], name="y")
            self.loss, self.per_example = build_loss(self.x, self.y)
            self.train_op = slim.learning.create_train_op(
                self.loss, tf.compat.v1.train.GradientDescentOptimizer(0.01)
            )
            self.sess = tf.compat.v1.Session(graph=self.graph)
            self.sess.run(tf.compat.v1.global_variables_initializer())
        for seed in range(1, 4):
            self.sess.run(self.train_op, self._feeds(*_batch(seed, carriers=())))

    def _feeds(self, xs, ys):
        return {self.x: xs, self.y: ys}

    def spike(self):
        """The spiking batch, its carriers labelled as the model least expects."""
        xs, ys = _batch()
        if self.per_example is None:
            return xs, ys
        return xs, _hardest_labels(self.sess, self.per_example, self.x, self.y, xs, ys)

    def autopsy(self, xs, ys, **kwargs):
        """The spike autopsy of a step on this batch, from the batch tensors and values."""
        return _autopsy.run_autopsy(
            self.sess, [self.x, self.y], [xs, ys], [self.loss], cause="spike", **kwargs
        )

    def expected(self, xs, ys):
        """Each example's loss as the model computes it (`per_example`)."""
        return self.sess.run(self.per_example, self._feeds(xs, ys))


def _mlp(x, regularizer=None):
    with slim.arg_scope([slim.fully_connected], weights_regularizer=regularizer):
        net = slim.fully_connected(x, 16, scope="fc1")
        return slim.fully_connected(net, CLASSES, activation_fn=None, scope="logits")


def _v1_losses(x, y):
    """tf.compat.v1.losses' cross entropy and a tf-slim L2 regularizer: get_total_loss."""
    logits = _mlp(x, slim.l2_regularizer(0.05))
    tf.compat.v1.losses.sparse_softmax_cross_entropy(y, logits)
    per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
    return tf.compat.v1.losses.get_total_loss(), per_example


def _slim_losses(x, y):
    """tf_slim.losses' softmax cross entropy, its own total loss."""
    logits = _mlp(x)
    slim.losses.softmax_cross_entropy(logits, tf.one_hot(y, CLASSES))
    per_example = tf.nn.softmax_cross_entropy_with_logits(
        labels=tf.one_hot(y, CLASSES), logits=logits
    )
    return slim.losses.get_total_loss(), per_example


def _two_terms(x, y):
    """Cross entropy, a weighted squared error on a second head, and L2 regularization."""
    logits = _mlp(x, slim.l2_regularizer(0.05))
    reconstruction = slim.fully_connected(logits, FEATURES, activation_fn=None, scope="decoder")
    tf.compat.v1.losses.sparse_softmax_cross_entropy(y, logits)
    tf.compat.v1.losses.mean_squared_error(x, reconstruction, weights=0.5)
    cross_entropy = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
    squared = 0.5 * tf.reduce_mean(tf.square(x - reconstruction), axis=1)
    return tf.compat.v1.losses.get_total_loss(), cross_entropy + squared


def _reduce_mean(x, y):
    """A hand-written loss: tf.reduce_mean of per-example terms, plus a weight decay."""
    logits = _mlp(x)
    cross_entropy = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
    confidence = tf.reduce_sum(tf.square(logits), axis=1)
    decay = 1e-3 * tf.add_n([tf.nn.l2_loss(v) for v in tf.compat.v1.trainable_variables()])
    loss = tf.reduce_mean(cross_entropy) + 0.01 * tf.reduce_mean(confidence) + decay
    return loss, cross_entropy + 0.01 * confidence


def _keras_loss(x, y):
    """A Keras loss object's mean, in a graph."""
    logits = _mlp(x)
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, logits)
    per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
    return loss, per_example


def _loss_of_the_batch_mean(x, y):
    """A loss on the batch's mean logits: no example has a loss of its own."""
    logits = _mlp(x)
    mean_logits = tf.reduce_mean(logits, axis=0)
    target = tf.reduce_mean(tf.one_hot(y, CLASSES), axis=0)
    return tf.reduce_sum(tf.square(mean_logits - target)), None


SPLITTABLE = {
    "v1_losses": (_v1_losses, "xentropy"),
    "slim_losses": (_slim_losses, "softmax_cross_entropy_loss"),
    "two_terms": (_two_terms, " + "),
    "reduce_mean": (_reduce_mean, " + "),
    "keras": (_keras_loss, "sparse_categorical_crossentropy"),
}


# ---------------------------------------------------------------------- the pure parts
def test_examples_are_ranked_highest_loss_first_ties_by_index_and_nan_left_out():
    losses = [0.1, 5.0, np.nan, 5.0, np.inf, 0.2]
    assert _autopsy.rank_examples(losses, k=4) == [(4, np.inf), (1, 5.0), (3, 5.0), (5, 0.2)]
    assert _autopsy.rank_examples([0.3, 0.1], k=5) == [(0, 0.3), (1, 0.1)]
    assert _autopsy.median_loss(losses) == 5.0  # of 0.1, 0.2, 5, 5, inf
    assert _autopsy.median_loss([np.nan]) is None


def test_the_examples_that_stand_out_are_cut_at_the_largest_ratio():
    spike = [(3, 812.3), (17, 95.1), (5, 0.5), (1, 0.4), (8, 0.3)]
    assert _autopsy.standing_out(spike, 0.041) == 2
    assert _autopsy.standing_out([(0, 800.0), (1, 790.0), (2, 810.0)], 0.05) == 3
    calm = [(0, 0.5), (1, 0.49), (2, 0.48), (3, 0.47), (4, 0.46)]
    assert _autopsy.standing_out(calm, 0.3) == 0
    # Zero and negative losses are the bottom of the chain, one step of 4 below the rest.
    assert _autopsy.standing_out([(0, 1043.0), (1, 100.4), (2, 0.0)], 0.0) == 1
    assert _autopsy.standing_out([(0, 812.3), (1, 395.1), (2, 0.0)], 0.0) == 2
    assert _autopsy.standing_out([(0, 2.0), (1, -1.0)], -1.0) == 1
    assert _autopsy.standing_out([(0, 0.0), (1, -1.0)], -0.5) == 0  # no loss above 0
    assert _autopsy.standing_out([(0, np.inf), (1, 1.0)], 0.5) == 1
    assert _autopsy.standing_out(spike, None) == 0


def _spike_sentence(top, batch_size, median, per_example_loss, error=None):
    """`_autopsy.explain_spike` of a spike's autopsy with these figures."""
    result = _autopsy.Autopsy(
        cause="spike",
        top_examples=top,
        batch_size=batch_size,
        median_loss=median,
        per_example_loss=per_example_loss,
        error=error,
    )
    return _autopsy.explain_spike(result)


def test_the_sentence_names_the_examples_that_carried_the_spike():
    spike = ((3, 812.3), (17, 95.1), (5, 0.5), (1, 0.4), (8, 0.3))
    assert _spike_sentence(spike, 32, 0.041, "xent:0") == (
        "examples 3, 17 of 32 carried the spike (per-example loss 812.3, 95.1; next highest: "
        "examples 5, 1, 8 at 0.5, 0.4, 0.3; batch median 0.041)"
    )
    assert _spike_sentence(spike[:1] + spike[2:], 32, 0.041, "xent:0").startswith(
        "example 3 of 32 carried the spike (per-example loss 812.3; next highest: examples 5, "
    )
    calm = ((0, 0.5), (1, 0.49))
    assert _spike_sentence(calm, 2, 0.495, "xent:0") == (
        "no example of the batch of 2 stands out: the highest per-example losses are "
        "examples 0, 1 (0.5, 0.49; batch median 0.495), so the batch as a whole carried "
        "the spike"
    )
    assert _spike_sentence((), 32, None, None) == (
        "the loss cannot be split per example, so no example of the batch can be named as "
        "the spike's"
    )
    assert _spike_sentence((), 32, None, None, "OOM") == ("the autopsy of the spike failed: OOM")


def test_per_example_values_sum_the_terms_and_leave_out_a_larger_unsplit_one():
    ce = np.array([0.5, 4.0, 0.5, 1.0]) / 4  # a mean over the batch: each 1/4 of the loss
    mse = np.array([[0.1, 0.3], [0.2, 0.2], [0.0, 0.0], [1.0, 1.0]]) / 8
    np.testing.assert_allclose(
        _autopsy.per_example_values([ce, mse], [], 4),
        [0.7, 4.2, 0.5, 2.0],  # row means of mse
    )
    # A term that is not the batch's (its leading dimension is 3) cannot be split.
    np.testing.assert_allclose(
        _autopsy.per_example_values([ce, np.ones(3) * 0.1], [0.2], 4), [0.5, 4.0, 0.5, 1.0]
    )
    assert _autopsy.per_example_values([ce], [2.0], 4) is None  # the largest is not split
    assert _autopsy.per_example_values([np.ones(3)], [], 4) is None
    assert _autopsy.per_example_values([], [1.0], 4) is None


def test_a_spike_autopsy_round_trips_through_json_and_never_says_did_not_reproduce():
    result = _autopsy.Autopsy(
        cause="spike",
        top_examples=((17, 812.25), (3, np.inf)),
        per_example_loss="xent:0",
        median_loss=0.041,
        batch_size=32,
        step=7,
    )
    data = result.to_json()
    assert data["top_examples"] == [[17, 812.25], [3, "inf"]]
    back = _autopsy.Autopsy.from_json(data)
    assert back == result
    assert back.describe() == data["summary"]
    assert result.reproduced is None and not result.failed
    assert "reproduce" not in result.describe()
    old = _autopsy.Autopsy.from_json({"reproduced": True, "step": 3})  # a record from before
    assert old.cause == "non_finite" and old.top_examples == ()


def test_a_record_holds_numpy_values_as_json_and_non_finite_floats_as_strings():
    """What a replay leaves in the record may be numpy's (a row index, a loss) or a value JSON
    has no word for: the record is strict JSON all the same, and never NaN or Inf."""
    runs = [{"fed": "same batch", "loss": np.float64(np.nan), "rows": [np.int64(3)]}]
    result = _autopsy.Autopsy(
        median_loss=np.float32(np.inf), triage={"verdict": None, "runs": runs, "note": b"x"}
    )
    data = result.to_json()
    json.dumps(data, allow_nan=False)  # strict JSON: raises on a NaN or an Inf
    assert data["median_loss"] == "inf" and data["triage"]["runs"][0]["loss"] == "nan"
    assert data["triage"]["runs"][0]["rows"] == [3] and data["triage"]["note"] == "b'x'"


# ---------------------------------------------------------------------- the stories
@pytest.mark.parametrize("name", sorted(SPLITTABLE))
def test_the_spike_autopsy_names_the_scaled_examples_in_order(name):
    build, tensor_name = SPLITTABLE[name]
    story = _Story(build)
    xs, ys = story.spike()
    with story.sess:
        result = story.autopsy(xs, ys)
        expected = story.expected(xs, ys)
    assert result.error is None, result.error
    assert result.cause == "spike" and result.batch_size == BATCH
    assert tensor_name in result.per_example_loss
    indices = [i for i, _ in result.top_examples]
    assert indices[:2] == list(CARRIERS)
    assert len(indices) == _autopsy.TOP_EXAMPLES
    # Each example's loss is the model's own, and the median is the batch's.
    losses = dict(result.top_examples)
    np.testing.assert_allclose([losses[i] for i in indices], expected[indices], rtol=1e-4)
    assert result.median_loss == pytest.approx(float(np.median(expected)), rel=1e-4)
    assert result.describe().startswith(f"examples {CARRIERS[0]}, {CARRIERS[1]} of 32 carried")
    assert result.cost["runs"] == 1


def test_an_ordinary_batch_has_no_example_that_stands_out():
    story = _Story(_v1_losses)
    xs, ys = _batch(seed=9, carriers=())
    with story.sess:
        result = story.autopsy(xs, ys)
    assert len(result.top_examples) == _autopsy.TOP_EXAMPLES
    assert result.describe().startswith("no example of the batch of 32 stands out")


def test_a_loss_on_the_batch_mean_cannot_be_split_and_the_autopsy_says_so():
    story = _Story(_loss_of_the_batch_mean)
    xs, ys = story.spike()
    with story.sess:
        result = story.autopsy(xs, ys)
    assert _autopsy.find_per_example_loss(story.loss) is None
    assert result.error is None and result.per_example_loss is None
    assert result.top_examples == () and result.cost["runs"] == 0
    assert result.describe().startswith("the loss cannot be split per example")


def test_regularization_alone_is_no_per_example_loss_and_a_batch_term_is_found_beside_it():
    story = _Story(_v1_losses)
    terms, others = _autopsy.find_per_example_loss(story.loss)
    names = [term.tensor.name for term in terms]
    assert names == ["sparse_softmax_cross_entropy_loss/xentropy/xentropy:0"]
    assert others == []  # the L2 terms read no batch: left out
    story.sess.close()


def test_a_spike_past_its_deadline_stops_and_says_so():
    story = _Story(_v1_losses)
    xs, ys = story.spike()
    ticks = iter(range(0, 10_000, 100))
    with story.sess:
        result = story.autopsy(xs, ys, timeout_secs=50, clock=lambda: next(ticks))
    assert result.failed and result.error.startswith("gave up after")
    assert result.describe().startswith("the autopsy of the spike failed: gave up after")


# ---------------------------------------------------------------------- through the guard
@lib.each_mode
def test_the_guard_autopsies_a_kept_batch_as_a_spike_writes_and_reads_its_dump(tmp_path, mode):
    """After a bad step that kept its batch, `_actions.autopsy_step(..., cause="spike")` names the
    scaled examples (the one NaN example has no loss to rank); the dump shows them, and its
    offline replay names them again."""
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(1)
        x = tf.compat.v1.placeholder(tf.float32, [None, FEATURES], name="x")
        y = tf.compat.v1.placeholder(tf.int64, [None], name="y")
        loss, per_example = _v1_losses(x, y)
        train_op = slim_nanguard.create_train_op(
            loss,
            tf.compat.v1.train.GradientDescentOptimizer(0.01),
            check_numerics=lib.MODES[mode],
            nan_policy="skip",
        )
        guard = slim_nanguard.get_guard(train_op)
        guard.registry.use_directory(str(tmp_path))
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            _actions.mark_judged(guard, sess)
            xs, ys = _batch()
            ys = _hardest_labels(sess, per_example, x, y, xs, ys)
            xs[20, 0] = np.nan
            lib.run_step(sess, train_op, {x: xs, y: ys})
            with pytest.raises(ValueError, match="cause is 'bogus'"):
                _actions.autopsy_step(guard, sess, 1, cause="bogus")
            result = _actions.autopsy_step(guard, sess, 1, cause="spike")
            tf.compat.v1.train.Saver().save(sess, str(tmp_path / "model.ckpt"), global_step=1)
    assert result.cause == "spike" and result.error is None, result.error
    assert [i for i, _ in result.top_examples][:2] == list(CARRIERS)
    assert 20 not in dict(result.top_examples)
    report, batch, _ = _autopsy.read_dump(result.dump)
    assert report["cause"] == "spike" and report["targets"] == [loss.name]
    assert sorted(batch) == ["x:0", "y:0"]
    assert _autopsy.Autopsy.from_json(report).top_examples == result.top_examples
    shown = autopsy_reader.format_report(
        {"step": 1, "mode": mode, "loss": 1e3, "action": "skip", "autopsy": result.to_json()}
    )
    assert f"examples {CARRIERS[0]}, {CARRIERS[1]} of 32 carried the spike" in shown
    assert f"highest     example {CARRIERS[0]}: " in shown
    assert "per example sparse_softmax_cross_entropy_loss/xentropy/xentropy:0" in shown
    # Offline, from the checkpoint's meta graph and the dump alone: the same examples.
    replayed = autopsy_reader.replay_dump(result.dump, str(tmp_path))
    assert replayed.cause == "spike" and not replayed.failed, replayed.error
    assert [i for i, _ in replayed.top_examples] == [i for i, _ in result.top_examples]
