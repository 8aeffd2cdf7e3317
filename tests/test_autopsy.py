"""The autopsy of a bad step: the first op that made a non-finite value, and the examples.

The model is tiny and its NaN source is planted: ``log(sum((x * w)^2))`` is ``log(0) = -Inf``
for an example whose features are all 0 (no fused ReLU on the way, so no CPU kernel changes
it), and a NaN in one example of the data makes the input op itself the first bad op. The
tests go through `slim_nanguard.train`, through the hook in a hand-written
`MonitoredTrainingSession`, and through `handle_numerics_error`, in both modes.
"""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import slim_nanguard
from slim_nanguard import _actions
from slim_nanguard import _autopsy
from slim_nanguard import _capture
from slim_nanguard.app import plot as run_plot

import nanguard_testlib as lib

REPO = pathlib.Path(__file__).resolve().parents[1]
BATCH = 6
FEATURES = 4
BAD_BATCH = 2


def _targets(guard):
    """What the guard's autopsy of a non-finite step replays: the loss and the gradients."""
    return [guard.loss, *guard.gradients]


def _batches(fault=None, count=8, bad_example=3):
    """`count` batches of shape [BATCH, FEATURES]; batch BAD_BATCH carries `fault`."""
    xs = np.random.RandomState(0).uniform(0.5, 1.5, (count, BATCH, FEATURES)).astype(np.float32)
    if fault == "log_of_zero":
        xs[BAD_BATCH, bad_example] = 0.0
    elif fault == "nan_input":
        xs[BAD_BATCH, bad_example, 1] = np.nan
    return xs


class _Model:
    """``loss = mean(log(sum((x * w)^2, axis=1)))`` on a placeholder or a tf.data iterator."""

    def __init__(self, mode, *, fault=None, fed=False, extra_loss=None, data=None, **create_kwargs):
        self.graph = tf.Graph()
        self.data = _batches(fault) if data is None else data
        with self.graph.as_default():
            if fed:
                self.x = tf.compat.v1.placeholder(tf.float32, [None, FEATURES], name="x")
            else:
                dataset = tf.data.Dataset.from_tensor_slices(self.data)
                self.x = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
            with tf.compat.v1.variable_scope("model"):
                w = tf.compat.v1.get_variable(
                    "w", [FEATURES], initializer=tf.compat.v1.ones_initializer()
                )
                squared_norm = tf.reduce_sum(tf.square(self.x * w), axis=1, name="squared_norm")
                log_norm = tf.math.log(squared_norm, name="log_norm")  # -Inf where x is all 0
                self.loss = tf.reduce_mean(log_norm, name="loss")
            if extra_loss is not None:
                self.loss = self.loss + extra_loss(self.x)
            create_kwargs.setdefault("nan_policy", "skip")
            self.train_op = slim_nanguard.create_train_op(
                self.loss,
                tf.compat.v1.train.GradientDescentOptimizer(0.01),
                check_numerics=lib.MODES[mode],
                **create_kwargs,
            )
        self.guard = slim_nanguard.get_guard(self.train_op)


def _train(logdir, model, steps=5):
    return slim_nanguard.train(
        model.train_op,
        str(logdir),
        number_of_steps=steps,
        save_checkpoint_steps=1,
        save_summaries_steps=None,
        log_every_n_steps=0,
    )


def _bad_steps(logdir):
    return [r for r in slim_nanguard.read_events(str(logdir)) if r["kind"] == "bad_step"]


# ---------------------------------------------------------------------- the pure parts
def test_health_counts_nan_and_both_infinities_and_the_finite_range():
    h = _autopsy.health(np.array([[0.0, np.nan, np.inf], [-np.inf, -2.0, 5.0]], np.float32))
    assert (h["nan"], h["posinf"], h["neginf"], h["zeros"]) == (1, 1, 1, 1)
    assert (h["finite_min"], h["finite_max"], h["shape"]) == (-2.0, 5.0, [2, 3])
    assert not _autopsy.is_finite_health(h)
    assert _autopsy.health(np.array([np.nan]))["finite_min"] is None


def test_bad_rows_are_counted_only_when_the_leading_dimension_is_the_batch():
    value = np.ones((4, 3), np.float32)
    value[2, 1] = np.nan
    assert _autopsy.bad_rows(value, batch_size=4) == [2]
    assert _autopsy.bad_rows(value, batch_size=5) == []
    assert _autopsy.bad_rows(np.float32(np.nan), batch_size=4) == []


def test_the_traceback_keeps_the_users_frames_and_names_the_innermost():
    frames = [
        ("/home/me/train.py", 10, "main", ""),
        ("/home/me/model.py", 42, "build", ""),
        ("/usr/lib/python3/site-packages/tf_slim/layers/layers.py", 7, "fc", ""),
        ("/usr/lib/python3/site-packages/tensorflow/python/ops/math_ops.py", 9, "log", ""),
    ]
    lines = _autopsy.user_frames(frames)
    assert lines == ["/home/me/train.py:10 in main", "/home/me/model.py:42 in build"]
    assert _autopsy.where(lines) == "model.py:42"


def test_the_sentence_names_the_op_the_line_the_cause_and_the_examples():
    op = {
        "name": "fc2/Log",
        "type": "Log",
        "where": "model.py:42",
        "inputs": [
            {
                "name": "fc2/Softmax:0",
                "nan": 0,
                "posinf": 0,
                "neginf": 0,
                "zeros": 2,
                "finite_min": 0.0,
                "finite_max": 1.0,
            }
        ],
        "output": [],
    }
    assert _autopsy.explain(
        _autopsy.Autopsy(reproduced=True, first_bad_op=op, bad_examples=(3, 17), batch_size=32)
    ) == (
        "first non-finite value: fc2/Log (Log) at model.py:42, input fc2/Softmax holds a 0; "
        "examples 3, 17 of the batch"
    )
    data = {
        "name": "IteratorGetNext",
        "type": "IteratorGetNext",
        "where": "",
        "inputs": [],
        "output": [{"name": "IteratorGetNext:0", "nan": 1}],
    }
    assert _autopsy.explain(
        _autopsy.Autopsy(reproduced=True, first_bad_op=data, bad_examples=(4,))
    ) == (
        "first non-finite value: IteratorGetNext (IteratorGetNext), the batch itself holds "
        "1 NaN; example 4 of the batch"
    )
    assert "does not reproduce" in _autopsy.explain(_autopsy.Autopsy(reproduced=False))


def test_autopsy_options_are_validated():
    assert slim_nanguard.GuardConfig().autopsy_max_steps == 3
    with pytest.raises(ValueError, match="autopsy_max_steps"):
        slim_nanguard.GuardConfig(autopsy_max_steps=-1)
    with pytest.raises(ValueError, match="autopsy_timeout_secs"):
        slim_nanguard.GuardConfig(autopsy_timeout_secs=0)


# ---------------------------------------------------------------------- capture
@lib.each_mode
def test_good_steps_keep_nothing_and_a_bad_step_keeps_its_batch(mode):
    model = _Model(mode, fault="log_of_zero", fed=True)
    capture = model.guard.capture
    assert [t.name for t in capture.tensors] == ["x:0"]
    with model.graph.as_default(), tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        _actions.mark_judged(model.guard, sess)  # this loop judges each step itself
        for batch in model.data[:BAD_BATCH]:
            sess.run(model.train_op, {model.x: batch})
        # Two good steps: the store never ran, so the variable was never even initialised.
        with pytest.raises(tf.errors.FailedPreconditionError):
            sess.run(capture.variables[0])
        # The bad step: check_numerics mode raises the check's error, hook mode returns.
        _, err = lib.run_step(sess, model.train_op, {model.x: model.data[BAD_BATCH]})
        if mode == "check_numerics":
            assert slim_nanguard.is_numerics_error(err)
        else:
            assert err is None
        (kept,) = _capture.read_kept_batch(sess, capture)
    np.testing.assert_array_equal(kept, model.data[BAD_BATCH])


# ---------------------------------------------------------------------- through train
@lib.each_mode
def test_train_names_the_log_of_zero_and_the_example_in_the_record(tmp_path, mode):
    result = _train(tmp_path, _Model(mode, fault="log_of_zero"))
    assert (result.bad_steps, result.skips) == (1, 1)
    (record,) = _bad_steps(tmp_path)
    autopsy = record["autopsy"]
    assert autopsy["reproduced"] is True
    assert autopsy["first_bad_op"]["name"] == "model/log_norm"
    assert autopsy["first_bad_op"]["type"] == "Log"
    assert autopsy["first_bad_op"]["where"].startswith("test_autopsy.py:")
    assert autopsy["first_bad_op"]["inputs"][0]["zeros"] == 1
    assert autopsy["first_bad_op"]["output"][0]["neginf"] == 1
    assert autopsy["bad_examples"] == [3]
    assert autopsy["summary"].startswith(
        "first non-finite value: model/log_norm (Log) at test_autopsy.py:"
    )
    assert "input model/squared_norm holds a 0; example 3 of the batch" in autopsy["summary"]
    assert autopsy["cost"]["seconds"] > 0 and autopsy["cost"]["peak_bytes"] > 0
    # The dump, next to the checkpoints: the report and the batch.
    assert os.path.dirname(os.path.dirname(autopsy["dump"])) == str(tmp_path)
    report, batch, weights = _autopsy.read_dump(autopsy["dump"])
    assert report["first_bad_op"]["name"] == "model/log_norm"
    np.testing.assert_array_equal(batch["IteratorGetNext:0"], _batches("log_of_zero")[BAD_BATCH])
    assert weights  # the weights the step read, so that --replay needs nothing else


@lib.each_mode
def test_a_nan_in_the_data_makes_the_input_op_the_first_bad_op(tmp_path, mode):
    _train(tmp_path, _Model(mode, fault="nan_input"))
    (record,) = _bad_steps(tmp_path)
    first = record["autopsy"]["first_bad_op"]
    assert (first["name"], first["type"]) == ("IteratorGetNext", "IteratorGetNext")
    assert first["output"][0]["nan"] == 1
    assert record["autopsy"]["bad_examples"] == [3]


def test_only_the_first_autopsy_max_steps_bad_steps_are_autopsied(tmp_path):
    data = _batches("log_of_zero")
    data[BAD_BATCH + 1, 0] = 0.0  # a second bad batch, right after the first
    config = slim_nanguard.GuardConfig(nan_policy="skip", autopsy_max_steps=1)
    result = _train(tmp_path, _Model("hook", data=data, config=config), steps=4)
    assert result.bad_steps == 2
    first, second = _bad_steps(tmp_path)
    assert first["autopsy"]["bad_examples"] == [3]
    assert "autopsy" not in second


# ---------------------------------------------------------------------- hand-written loops
def test_the_hook_in_a_monitored_session_carries_the_autopsy_of_a_fed_batch(tmp_path):
    model = _Model("hook", fault="nan_input", fed=True)
    records = []
    hook = slim_nanguard.nan_hook(
        model.train_op, checkpoint_dir=str(tmp_path), event_listener=records.append
    )
    lib.run_monitored(
        model.train_op,
        hooks=[hook],
        feeds=[{model.x: batch} for batch in model.data[:4]],
        checkpoint_dir=str(tmp_path),
    )
    (record,) = [r for r in records if r["kind"] == "bad_step"]
    first = record["autopsy"]["first_bad_op"]
    assert (first["name"], first["type"]) == ("x", "Placeholder")
    assert record["autopsy"]["bad_examples"] == [3]
    assert model.guard.last_event.autopsy.bad_examples == (3,)
    assert os.path.exists(record["autopsy"]["dump"])


@pytest.mark.parametrize(
    "loop, mode",
    [
        ("learning.train", "check_numerics"),
        ("learning.train", "hook"),
        ("training.train", "hook"),
    ],
)
def test_tf_slims_own_loops_get_the_same_autopsy(tmp_path, loop, mode):
    import tf_slim as slim

    model = _Model(mode, fault="log_of_zero")
    records = []
    model.guard.add_listener(records.append)
    with model.graph.as_default():
        if loop == "learning.train":
            slim.learning.train(
                model.train_op,
                str(tmp_path),
                train_step_fn=slim_nanguard.make_train_step(str(tmp_path)),
                number_of_steps=4,
                save_summaries_secs=None,
                save_interval_secs=None,
            )
        else:
            slim.training.train(
                model.train_op,
                str(tmp_path),
                hooks=[
                    slim_nanguard.nan_hook(model.train_op, checkpoint_dir=str(tmp_path)),
                    tf.compat.v1.train.StopAtStepHook(last_step=4),
                ],
                save_checkpoint_secs=None,
                save_summaries_steps=None,
            )
    (record,) = [r for r in records if r["kind"] == "bad_step"]
    assert record["autopsy"]["first_bad_op"]["name"] == "model/log_norm"
    assert record["autopsy"]["bad_examples"] == [3]
    assert record["autopsy"]["dump"].startswith(str(tmp_path))


def test_a_nan_in_a_queued_batch_makes_the_dequeue_the_first_bad_op():
    graph = tf.Graph()
    data = _batches("nan_input")
    with graph.as_default():
        queue = tf.compat.v1.FIFOQueue(len(data), [tf.float32], shapes=[[BATCH, FEATURES]])
        enqueue = queue.enqueue_many([data])
        x = queue.dequeue(name="dequeue")
        w = tf.compat.v1.get_variable("w", [FEATURES])
        train_op = slim_nanguard.create_train_op(
            tf.reduce_sum(x * w),
            tf.compat.v1.train.GradientDescentOptimizer(0.1),
            nan_policy="skip",
        )
        with tf.compat.v1.Session() as sess:
            sess.run([tf.compat.v1.global_variables_initializer(), enqueue])
            events = []
            for _ in range(BAD_BATCH + 2):
                try:
                    sess.run(train_op)
                except tf.errors.InvalidArgumentError as err:
                    events.append(slim_nanguard.handle_numerics_error(sess, err))
            left = sess.run(queue.size())
    (event,) = events
    assert (event.autopsy.first_bad_op["name"], event.autopsy.first_bad_op["type"]) == (
        "dequeue",
        "QueueDequeueV2",
    )
    assert event.autopsy.bad_examples == (3,)
    assert left == len(data) - (BAD_BATCH + 2)  # the autopsy dequeued nothing


def test_nan_loss_error_carries_the_autopsy_in_a_check_numerics_loop():
    model = _Model("check_numerics", fault="log_of_zero", fed=True, nan_policy="raise")
    run = lib.run_monitored(
        model.train_op,
        feeds=[{model.x: batch} for batch in model.data[:4]],
        handle_numerics_errors=True,
        catch_nan_error=True,
    )
    assert isinstance(run.error, slim_nanguard.NanLossError)
    autopsy = run.error.event.autopsy
    assert autopsy.first_bad_op["name"] == "model/log_norm"
    assert autopsy.bad_examples == (3,)
    assert autopsy.dump is None  # no checkpoint directory, so no dump
    assert "first non-finite value: model/log_norm (Log)" in str(run.error)


# ---------------------------------------------------------------------- findings and failures
def _nan_on_first_call_only():
    calls = []

    def flaky(x):
        calls.append(1)
        return np.float32(np.nan if len(calls) == 1 else 0.0)

    return lambda x: tf.compat.v1.py_func(flaky, [x], tf.float32, stateful=True)


@lib.each_mode
def test_a_bad_step_that_does_not_reproduce_says_so(tmp_path, mode):
    model = _Model(mode, extra_loss=_nan_on_first_call_only())
    result = _train(tmp_path, model, steps=3)
    assert result.bad_steps == 1
    (record,) = _bad_steps(tmp_path)
    assert record["autopsy"]["reproduced"] is False
    assert record["autopsy"]["first_bad_op"] is None
    assert "does not reproduce" in record["autopsy"]["summary"]


@lib.each_mode
def test_a_failing_autopsy_never_takes_training_down(tmp_path, mode, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise MemoryError("simulated: the replay ran out of memory")

    monkeypatch.setattr(_autopsy, "replay", out_of_memory)
    result = _train(tmp_path, _Model(mode, fault="log_of_zero"))
    assert (result.bad_steps, result.skips, result.steps) == (1, 1, 5)
    (record,) = _bad_steps(tmp_path)
    assert record["action"] == "skip"
    assert record["autopsy"]["error"] == "MemoryError: simulated: the replay ran out of memory"
    assert record["autopsy"]["summary"].startswith("autopsy failed: MemoryError")


def _replay_session(model):
    """A session after the bad batch, and the batch as the autopsy would feed it."""
    sess = tf.compat.v1.Session(graph=model.graph)
    with model.graph.as_default():
        sess.run(tf.compat.v1.global_variables_initializer())
    return sess, {model.x: model.data[BAD_BATCH]}


def test_a_replay_without_the_batch_runs_nothing_and_says_what_is_missing():
    model = _Model("hook", fault="log_of_zero")  # the batch comes from an iterator
    with model.graph.as_default(), tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        result = _autopsy.replay(sess, {}, _targets(model.guard))
        first = sess.run(model.x)  # the iterator was not touched by the replay
    assert result.reproduced is None and result.cost["runs"] == 0
    assert "IteratorGetNext (IteratorGetNext), which was not kept" in result.error
    np.testing.assert_array_equal(first, model.data[0])


def test_the_replay_fetches_in_chunks_and_finds_the_same_op():
    model = _Model("hook", fault="log_of_zero", fed=True)
    sess, feeds = _replay_session(model)
    with sess:
        whole = _autopsy.replay(sess, feeds, _targets(model.guard))
        chunked = _autopsy.replay(sess, feeds, _targets(model.guard), max_chunk_bytes=1)
    assert whole.first_bad_op["name"] == chunked.first_bad_op["name"] == "model/log_norm"
    assert chunked.cost["runs"] > whole.cost["runs"]
    assert chunked.cost["peak_bytes"] < whole.cost["peak_bytes"]


def test_a_replay_past_its_deadline_stops_and_says_where():
    model = _Model("hook", fault="log_of_zero", fed=True)
    sess, feeds = _replay_session(model)
    ticks = iter(range(0, 10_000, 100))
    with sess:
        result = _autopsy.replay(
            sess, feeds, _targets(model.guard), timeout_secs=50, clock=lambda: next(ticks)
        )
    assert result.reproduced is True and result.first_bad_op is None
    assert result.error.startswith("gave up after")


# ---------------------------------------------------------------------- the console command
def _run_cli(*args):
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=path)
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "autopsy.py"), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_console_command_prints_and_replays_a_recorded_bad_step(tmp_path):
    _train(tmp_path, _Model("check_numerics", fault="log_of_zero"))
    shown = _run_cli(str(tmp_path))
    assert shown.returncode == 0, shown.stderr
    assert "global step 2" in shown.stdout
    assert "first non-finite value: model/log_norm (Log)" in shown.stdout
    assert "example 3 of the batch" in shown.stdout
    replayed = _run_cli(str(tmp_path), "--step=2", "--replay")
    assert replayed.returncode == 0, replayed.stderr
    assert "replay: first non-finite value: model/log_norm (Log)" in replayed.stdout
    missing = _run_cli(str(tmp_path), "--step=7")
    assert missing.returncode == 1
    assert "no bad step 7" in missing.stderr


def test_the_autopsy_of_a_fed_default_never_takes_a_batch_from_the_iterator():
    """x = placeholder_with_default(iterator): the replay feeds x and leaves the iterator be."""
    graph = tf.Graph()
    with graph.as_default():
        data = tf.data.Dataset.from_tensor_slices(_batches("nan_input"))
        batch = tf.compat.v1.data.make_one_shot_iterator(data).get_next()
        x = tf.compat.v1.placeholder_with_default(batch, [None, FEATURES], name="x")
        w = tf.compat.v1.get_variable("w", [FEATURES])
        loss = tf.reduce_sum(x * w)
        train_op = slim_nanguard.create_train_op(
            loss,
            tf.compat.v1.train.GradientDescentOptimizer(0.1),
            check_numerics=False,
            nan_policy="skip",
        )
        guard = slim_nanguard.get_guard(train_op)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            _actions.mark_judged(guard, sess)  # this loop judges each step itself
            for _ in range(BAD_BATCH + 1):
                sess.run(train_op)
            result = _actions.autopsy_step(guard, sess, step=BAD_BATCH)
            after = sess.run(x)  # the batch after the bad one: none was taken meanwhile
    assert (result.first_bad_op["name"], result.first_bad_op["inputs"]) == ("x", [])
    np.testing.assert_array_equal(after, _batches("nan_input")[BAD_BATCH + 1])


def test_a_rollback_splits_the_loss_into_what_was_kept_and_what_was_dropped():

    # Steps 1-4 diverge, step 5 is bad, the rollback goes back to 0 and steps 1-3 follow.
    written = [(1, 2.0), (2, 50.0), (3, 1e9), (4, 1e30), (1, 2.0), (2, 1.5), (3, 1.2)]
    (kept, dropped), (after, none) = run_plot.split_at_rollbacks(written)
    assert kept == [] and dropped == written[:4]
    assert after == written[4:] and none == []


def test_the_plot_marks_the_bad_step_on_the_loss(tmp_path):

    slim_nanguard.train(
        _Model("hook", fault="log_of_zero").train_op,
        str(tmp_path),
        number_of_steps=5,
        save_checkpoint_steps=1,
        save_summaries_steps=1,
        log_every_n_steps=1,
    )
    tag, points = run_plot.read_scalars(str(tmp_path))
    assert tag == "nanguard/loss" and [step for step, _ in points] == [1, 2, 3, 4, 5]
    out = run_plot.plot_run(str(tmp_path), str(tmp_path / "run.png"))
    assert pathlib.Path(out).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_plot_without_matplotlib_says_how_to_install_it(tmp_path, monkeypatch):

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install '\.\[plot\]'"):
        run_plot.plot_run(str(tmp_path), str(tmp_path / "run.png"))


def test_a_nan_constant_is_not_the_culprit_the_op_that_lets_it_in_is():
    """A NaN constant is there on every step (a mask, a fault injector): blame its use."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, FEATURES], name="x")
        w = tf.compat.v1.get_variable("w", [FEATURES])
        nan = tf.constant(np.nan, tf.float32, name="nan")
        picked = tf.where(x > 100.0, tf.fill(tf.shape(x), nan), x, name="picked")
        loss = tf.reduce_sum(picked * w)
        train_op = slim_nanguard.create_train_op(
            loss, tf.compat.v1.train.GradientDescentOptimizer(0.1), check_numerics=False
        )
        data = np.ones((BATCH, FEATURES), np.float32)
        data[5, 0] = 1000.0
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            result = _autopsy.replay(sess, {x: data}, _targets(slim_nanguard.get_guard(train_op)))
    assert result.first_bad_op["name"] == "picked"
    assert result.bad_examples == (5,)
    assert "input Fill holds 24 NaN" in result.describe()


@lib.each_mode
def test_with_autopsies_off_nothing_of_the_capture_is_built(mode):
    def ops(autopsy_max_steps):
        model = _Model(mode, config=slim_nanguard.GuardConfig(autopsy_max_steps=autopsy_max_steps))
        return model.graph.get_operations()

    on, off = ops(3), ops(0)
    assert [op for op in on if "keep_batch" in op.name]
    assert not [op for op in off if "keep_batch" in op.name]
    if mode == "check_numerics":
        # Only the capture, the exact verdict and the TensorBoard counters' read (of a variable
        # no initializer runs) put control flow in this mode's graph: the verdict's is one
        # Switch on the sums' fast test and one Merge after its exact test, and one Switch and
        # Merge around the kinds' store (written only when a value holds NaN or Inf).
        flow = [op for op in off if op.type in ("Switch", "Merge", "IsFinite", "If")]
        verdict = [op for op in flow if "/verdict/" in op.name]
        assert all(op in verdict or op.name.startswith("nanguard/counters_read") for op in flow), [
            op.name for op in flow
        ]
        expected = ["IsFinite", "IsFinite", "Merge", "Merge", "Switch", "Switch"]
        assert sorted(op.type for op in verdict) == expected


@lib.each_mode
def test_a_model_whose_forward_pass_writes_gets_no_autopsy_and_keeps_its_promise(tmp_path, mode):
    """A replay would run the forward pass's writes again with the bad batch, after the guard
    put their values back; so such a train op keeps no batch, and a bad step writes nothing."""

    def moving_average_the_loss_waits_on(x):
        moving = tf.compat.v1.get_variable(
            "moving", [], initializer=tf.compat.v1.constant_initializer(0.5), trainable=False
        )
        update = moving.assign(0.9 * moving + 0.1 * tf.reduce_mean(x))
        with tf.control_dependencies([update]):
            return 0.0 * tf.identity(moving)

    model = _Model(mode, fault="nan_input", extra_loss=moving_average_the_loss_waits_on)
    assert not model.guard.capture.tensors  # no autopsy: nothing kept
    result = _train(tmp_path, model, steps=5)
    # One bad step, skipped; the moving average stayed finite, so every later step was good.
    assert (result.bad_steps, result.skips, result.global_step) == (1, 1, 5)
    values = tf.train.load_checkpoint(result.checkpoint)
    assert np.isfinite(values.get_tensor("moving"))
    (record,) = [r for r in slim_nanguard.read_events(tmp_path) if r["kind"] == "bad_step"]
    assert "autopsy" not in record
