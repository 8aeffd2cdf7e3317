"""Every batch accounted for (issue 33): the guard takes no batch from the input pipeline.

The story: each batch carries its own index, and a few batches hold a NaN. Training runs with
the autopsy on, in each mode and each loop, and records the index of every batch that trained
(fetched in the train op's own run, with the verdict of that run: never by a run of its own,
which would take a batch). With ``skip``, every good batch trains exactly once and no bad one
does. With ``rollback``, the batches a rollback says it skipped are exactly the ones that never
trained. With ``stop``, the batches before the first bad one trained once each.

The inputs are those that once lost the batch after each autopsied bad step: a model that
checks the batch's index before it reads its weights (the weights the autopsy dump read ran the
check, so the iterator), and a batch that also carries a sparse feature, which an iterator gives
as a variant no variable keeps (the replay ran the iterator for it). The autopsy of the second
says it cannot replay the step rather than take a batch. A queue pipeline
(`slice_input_producer` + `batch`, under queue runners) checks its index the same way.
"""

import logging

import numpy as np
import pytest
import tensorflow as tf
import tf_slim as slim

import slim_nanguard
from slim_nanguard import _autopsy

import nanguard_testlib as lib

BATCHES = 24
BAD = (3, 9, 15, 21)
BATCH, FEATURES = 8, 4
# The input: (pipeline, what the model does with the batch beside x and y).
CHECKED_DATA, SPARSE_DATA, CHECKED_QUEUE = (
    ("data", "checked"),
    ("data", "sparse"),
    ("queue", "checked"),
)
LOOPS = ("train", "tf_slim", "monitored")
# 3 (the default) autopsies the first three bad steps, 10 every one of them.
AUTOPSIES = (3, 10)


def _data():
    """``BATCHES`` batches (x, y, index): x of the batches in ``BAD`` holds a NaN."""
    rng = np.random.RandomState(0)
    x = rng.randn(BATCHES, BATCH, FEATURES).astype(np.float32)
    x[list(BAD), 3, 2] = np.nan
    return x, (x[..., 0] > 0).astype(np.int64), np.arange(BATCHES, dtype=np.int64)


class _Run:
    """A tiny MLP on an indexed input, its guarded train op, and the batches that trained."""

    def __init__(self, mode, source, *, policy="skip", autopsies=3, **config):
        self.graph = tf.Graph()
        self.trained = []
        pipeline, extra = source
        with self.graph.as_default():
            tf.compat.v1.set_random_seed(1)
            x, y, self.index = self._input(pipeline, extra)
            check = tf.debugging.assert_non_negative(self.index) if extra == "checked" else None
            # Resource variables, as a TF2 script gets them: each read is made where it is used.
            scope = tf.compat.v1.variable_scope(
                tf.compat.v1.get_variable_scope(), use_resource=True
            )
            with scope, tf.control_dependencies([check] if check is not None else []):
                hidden = slim.fully_connected(x, 16, scope="fc1")
                logits = slim.fully_connected(hidden, 2, activation_fn=None, scope="logits")
            loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(y, logits)
            if extra == "sparse":
                loss += 0.0 * tf.sparse.reduce_sum(self._sparse)
            self.train_op = slim_nanguard.create_train_op(
                loss,
                tf.compat.v1.train.GradientDescentOptimizer(0.1),
                check_numerics=lib.MODES[mode],
                config=slim_nanguard.GuardConfig(
                    nan_policy=policy, autopsy_max_steps=autopsies, **config
                ),
            )
        self.guard = slim_nanguard.get_guard(self.train_op)

    def _input(self, pipeline, extra):
        x, y, index = _data()
        if pipeline == "queue":
            one = tf.compat.v1.train.slice_input_producer(
                [x, y, index], shuffle=False, num_epochs=1
            )
            bx, by, bi = tf.compat.v1.train.batch(one, batch_size=1)
            return bx[0], by[0], bi[0]
        data = tf.data.Dataset.from_tensor_slices((x, y, index))
        if extra == "sparse":
            data = data.map(lambda *batch: (*batch, tf.sparse.from_dense(tf.ones([BATCH]))))
        bx, by, bi, *sparse = tf.compat.v1.data.make_one_shot_iterator(data).get_next()
        self._sparse = sparse[0] if sparse else None
        return bx, by, bi

    # What trained: the index and the verdict, fetched in the train op's own run.
    def fetches(self):
        verdict = {"ok": self.guard.ok} if self.guard.ok is not None else {}
        return {"index": self.index, **verdict}

    def ran(self, values):
        """A run of the train op returned `values` (a check_numerics bad step raised instead)."""
        if values.get("ok", True):
            self.trained.append(int(values["index"]))

    @property
    def good(self):
        return [i for i in range(BATCHES) if i not in BAD]


class _Recorder(tf.compat.v1.train.SessionRunHook):
    """Adds the index and the verdict to each run of `train`'s loop (only the train op's)."""

    def __init__(self, run):
        self._run = run

    def before_run(self, run_context):
        return tf.compat.v1.train.SessionRunArgs(self._run.fetches())

    def after_run(self, run_context, run_values):
        self._run.ran(run_values.results)


class _RecordingSession:
    """The session `tf_slim.learning.train` gives its train step: a run of the train op also
    fetches the index and the verdict; every other run (the guard's) passes through."""

    def __init__(self, session, run):
        self._session, self._run = session, run

    def run(self, fetches, feed_dict=None, options=None, run_metadata=None):
        if not any(f is self._run.train_op for f in tf.nest.flatten(fetches)):
            return self._session.run(fetches, feed_dict, options, run_metadata)
        values, extra = self._session.run(
            [fetches, self._run.fetches()], feed_dict, options, run_metadata
        )
        self._run.ran(extra)
        return values

    def __getattr__(self, name):
        return getattr(self._session, name)


def _train(run, loop, logdir, *, checkpoint_steps=None):
    """Trains `run` to the end of its data in `loop`."""
    logdir = str(logdir)
    with run.graph.as_default():
        if loop == "train":
            slim_nanguard.train(
                run.train_op,
                logdir,
                hooks=[_Recorder(run)],
                save_checkpoint_secs=None,
                save_checkpoint_steps=checkpoint_steps,
                save_summaries_steps=None,
                log_every_n_steps=0,
            )
        elif loop == "tf_slim":
            step = slim_nanguard.make_train_step(logdir)
            slim.learning.train(
                run.train_op,
                logdir,
                train_step_fn=lambda sess, *args: step(_RecordingSession(sess, run), *args),
                save_summaries_secs=None,
                save_interval_secs=None,
            )
        else:
            _monitored(run, logdir, checkpoint_steps)


def _monitored(run, logdir, checkpoint_steps):
    """The user's own loop: nan_hook in hook mode, handle_numerics_error in check_numerics mode."""
    hook_mode = run.guard.ok is not None
    hooks = [slim_nanguard.nan_hook(run.train_op, checkpoint_dir=logdir)] if hook_mode else []
    with tf.compat.v1.train.MonitoredTrainingSession(
        checkpoint_dir=logdir,
        hooks=hooks,
        save_checkpoint_secs=None,
        save_checkpoint_steps=checkpoint_steps,
        save_summaries_steps=None,
        log_step_count_steps=None,
    ) as sess:
        while not sess.should_stop():
            try:
                _, values = sess.run([run.train_op, run.fetches()])
            except tf.errors.InvalidArgumentError as err:
                slim_nanguard.handle_numerics_error(sess, err, checkpoint_dir=logdir)
            else:
                run.ran(values)


def _records(logdir, kind):
    return [r for r in slim_nanguard.read_events(str(logdir)) if r["kind"] == kind]


def _cases(*sources, autopsies=(3,), loops=LOOPS):
    return [
        pytest.param(mode, loop, source, n, id=f"{mode}-{loop}-{'_'.join(source)}-autopsy{n}")
        for source in sources
        for loop in loops
        for mode in sorted(lib.MODES)
        for n in autopsies
    ]


@pytest.mark.parametrize(
    "mode, loop, source, autopsies",
    _cases(CHECKED_DATA, autopsies=AUTOPSIES) + _cases(SPARSE_DATA, CHECKED_QUEUE),
)
def test_skip_trains_every_good_batch_once_and_no_bad_one(tmp_path, mode, loop, source, autopsies):
    run = _Run(mode, source, autopsies=autopsies)
    _train(run, loop, tmp_path)

    assert run.trained == run.good  # in order, each once: none taken by the guard
    bad = _records(tmp_path, "bad_step")
    assert [r["step"] for r in bad] == [b - i for i, b in enumerate(BAD)]  # the global step
    autopsied = [r["autopsy"] for r in bad if r.get("autopsy")]
    assert len(autopsied) == min(autopsies, len(BAD))
    if source == SPARSE_DATA:  # The variant is not kept: the autopsy says so and runs nothing.
        assert all("IteratorGetNext:3 (variant) was not kept" in a["error"] for a in autopsied)
        assert all(a["cost"]["runs"] == 0 for a in autopsied)
    else:
        assert all(a["reproduced"] for a in autopsied)


@pytest.mark.parametrize(
    "mode, loop, source, autopsies",
    _cases(CHECKED_DATA, CHECKED_QUEUE, autopsies=(10,), loops=("train", "monitored")),
)
def test_a_rollback_skips_the_batches_it_says_and_no_other(
    tmp_path, caplog, mode, loop, source, autopsies
):
    run = _Run(mode, source, policy="rollback", autopsies=autopsies, max_rollbacks=10)
    with caplog.at_level(logging.WARNING, logger="absl"):
        _train(run, loop, tmp_path, checkpoint_steps=2)

    rollbacks = _records(tmp_path, "rollback")
    assert len(rollbacks) == len(BAD)
    assert [r["skipped_batches"] for r in rollbacks] == [1] * len(BAD)
    lines = [r.getMessage() for r in caplog.records if "rolled back to" in r.getMessage()]
    assert len(lines) == len(BAD) and all("skipped 1 batch," in line for line in lines)
    # The batches never trained are exactly those skipped: the one after each bad batch.
    skipped = [b + 1 for b in BAD if b + 1 < BATCHES]
    assert run.trained == [i for i in run.good if i not in skipped]
    assert sum(r["skipped_batches"] for r in rollbacks) == len(run.good) - len(run.trained)


@pytest.mark.parametrize(
    "mode, loop, source, autopsies", _cases(CHECKED_DATA, loops=("train", "monitored"))
)
def test_stop_leaves_the_batches_before_it_trained_once(tmp_path, mode, loop, source, autopsies):
    run = _Run(mode, source, policy="stop", autopsies=autopsies)
    _train(run, loop, tmp_path)

    assert run.trained == list(range(BAD[0]))
    (bad,) = _records(tmp_path, "bad_step")
    assert (bad["step"], bad["action"], bad["autopsy"]["reproduced"]) == (BAD[0], "stop", True)


def test_the_autopsy_dump_keeps_the_weights_it_read_with_the_batch_fed(tmp_path):
    """The read of the weights for the dump: the run that took the next batch before."""
    run = _Run("hook", CHECKED_DATA)
    _train(run, "train", tmp_path)

    (first, *_) = _records(tmp_path, "bad_step")
    report, batch, weights = _autopsy.read_dump(first["autopsy"]["dump"])
    assert sorted(name.split("/")[0] for name in weights) == ["fc1", "fc1", "logits", "logits"]
    assert batch["IteratorGetNext:2"] == BAD[0]  # the bad batch's own index
    assert run.trained == run.good


def test_a_replay_that_would_run_the_iterator_through_a_control_edge_runs_nothing():
    """Every output of the iterator fed, but the loss waits on the iterator's op itself."""
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.Session() as sess:
        x, _, index = _data()
        data = tf.data.Dataset.from_tensor_slices((x, index))
        bx, bi = tf.compat.v1.data.make_one_shot_iterator(data).get_next()
        with tf.control_dependencies([bx.op]):
            loss = tf.reduce_sum(tf.math.log(bx))
        result = _autopsy.replay(sess, {bx: x[BAD[0]], bi: BAD[0]}, [loss])
        assert sess.run(bi) == 0  # the replay took no batch
    assert result.reproduced is None and result.cost["runs"] == 0
    assert "runs IteratorGetNext (IteratorGetNext) through a control dependency" in result.error
