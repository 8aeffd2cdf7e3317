"""The record of bad steps, from every loop that knows a directory, and what it keeps.

The model garden's loop (`tf_slim.learning.train` with `make_train_step(logdir)`) and a
hand-written `MonitoredTrainingSession` with `nan_hook(train_op, checkpoint_dir=logdir)` each
meet a planted bad batch and leave ``nanguard_events.jsonl`` next to their autopsy dumps, which
the autopsy report reads; `train` records each bad step once, even when a hook of the user's
knows the directory too; a run with many bad steps keeps only the first and the latest dumps;
and a bad step's record keeps the losses of the steps before it, which the plot draws.
"""

import os

import pytest
import tensorflow as tf
import tf_slim as slim

import slim_nanguard
from slim_nanguard import _autopsy
from slim_nanguard import _recorders
from slim_nanguard import autopsy
from slim_nanguard.app import plot as run_plot

import nanguard_testlib as lib


def _bad_steps(logdir):
    return [r for r in slim_nanguard.read_events(str(logdir)) if r["kind"] == "bad_step"]


def _train(model, logdir, steps, **kwargs):
    """`slim_nanguard.train` for `steps` steps, saving and logging nothing unless asked."""
    kwargs = (
        dict(save_checkpoint_steps=None, save_summaries_steps=None, log_every_n_steps=0) | kwargs
    )
    return slim_nanguard.train(model.train_op, logdir, number_of_steps=steps, **kwargs)


def _dumps(logdir):
    directory = os.path.join(str(logdir), _autopsy.DUMP_DIRNAME)
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


# ---------------------------------------------------------------------- every loop
@lib.each_mode
def test_the_model_gardens_loop_leaves_the_record_the_autopsy_reads(tmp_path, mode):
    logdir = str(tmp_path)
    model = lib.build_model(
        faults={2: "nan_loss"}, nan_policy="skip", check_numerics=lib.MODES[mode]
    )
    with model.graph.as_default():
        slim.learning.train(
            model.train_op,
            logdir,
            train_step_fn=slim_nanguard.make_train_step(logdir),
            number_of_steps=4,
            save_summaries_secs=None,
            save_interval_secs=None,
        )
    (record,) = _bad_steps(logdir)
    assert (record["step"], record["action"], record["loss"]) == (2, "skip", "nan")
    assert [step for step, _ in record["losses_before"]] == [0, 1]  # the two good steps
    report = autopsy.format_report(autopsy.find_bad_step(logdir))
    assert report.startswith("bad step at global step 2")
    assert f"dump        {record['autopsy']['dump']}" in report
    assert os.path.exists(record["autopsy"]["dump"])


@lib.each_mode
def test_the_model_gardens_tensorboard_files_stay_readable(tmp_path, mode):
    """tf-slim's Supervisor writes its summaries (the graph, the session log) to the
    directory the guard records in; the guard's record writes no second events file there (two
    writers opened in one second would share one file name and interleave their records)."""
    logdir = str(tmp_path)
    model = lib.build_model(
        faults={1: "nan_loss"}, nan_policy="skip", check_numerics=lib.MODES[mode]
    )
    with model.graph.as_default():
        # A summary that reads no batch: the Supervisor's summary thread runs it on its own,
        # and a summary of the loss would take a batch of the pipeline (the bad one, at times)
        # away from the train op.
        tf.compat.v1.summary.scalar("global_step", model.global_step)
        slim.learning.train(
            model.train_op,
            logdir,
            train_step_fn=slim_nanguard.make_train_step(logdir),
            number_of_steps=4,
            save_summaries_secs=1,
            save_interval_secs=None,
        )
    (record,) = _bad_steps(logdir)
    files = tf.io.gfile.glob(f"{logdir}/events.out.tfevents.*")
    assert files
    for path in files:  # each reads to its end: no DataLossError
        events = list(tf.compat.v1.train.summary_iterator(path))
        assert events[0].HasField("file_version")


def test_a_hand_written_monitored_session_leaves_the_record_the_autopsy_reads(tmp_path):
    logdir = str(tmp_path)
    model = lib.build_model(faults={2: "nan_loss"}, nan_policy="skip", check_numerics=False)
    hook = slim_nanguard.nan_hook(model.train_op, checkpoint_dir=logdir)
    run = lib.run_monitored(model.train_op, hooks=[hook], last_step=4, checkpoint_dir=logdir)
    assert len(run.events) == 1
    (record,) = _bad_steps(logdir)
    assert (record["step"], record["action"]) == (2, "skip")
    assert autopsy.find_bad_step(logdir)["autopsy"]["dump"] == record["autopsy"]["dump"]
    assert os.path.exists(record["autopsy"]["dump"])


def test_a_listener_that_records_already_is_the_only_record(tmp_path):
    """A hand-written loop that followed the old advice (its own `EventRecorder`) is recorded
    once: the guard leaves the record to it."""
    logdir = str(tmp_path)
    model = lib.build_model(faults={2: "nan_loss"}, nan_policy="skip", check_numerics=False)
    recorder = _recorders.EventRecorder(logdir, write_summaries=False)
    hook = slim_nanguard.nan_hook(model.train_op, checkpoint_dir=logdir, event_listener=recorder)
    lib.run_monitored(model.train_op, hooks=[hook], last_step=4, checkpoint_dir=logdir)
    assert [r["step"] for r in _bad_steps(logdir)] == [2]


@pytest.mark.parametrize(
    "mode, users_hook", [("hook", True), ("hook", False), ("check_numerics", False)]
)
def test_train_records_each_bad_step_once(tmp_path, mode, users_hook):
    """`train` keeps its own record; a hook of the user's that knows the directory too, and
    the guard's record in its autopsy directory, add nothing to it."""
    logdir = str(tmp_path)
    model = lib.build_model(
        faults={1: "nan_loss", 3: "inf_loss"}, nan_policy="skip", check_numerics=lib.MODES[mode]
    )
    hooks = [slim_nanguard.nan_hook(model.train_op, checkpoint_dir=logdir)] if users_hook else []
    result = _train(model, logdir, 4, hooks=hooks)
    assert result.bad_steps == 2
    assert [(r["step"], r["loss"]) for r in _bad_steps(logdir)] == [(1, "nan"), (2, "inf")]


@lib.each_mode
def test_train_with_the_users_hook_keeps_the_losses_before_the_bad_step(tmp_path, mode):
    """A user who passes ``hooks=[nan_hook(train_op)]`` to `train` out of habit, in either
    mode: the bad step's record still holds the losses of the good steps before it."""
    logdir = str(tmp_path)
    model = lib.build_model(
        faults={3: "nan_loss"}, nan_policy="skip", check_numerics=lib.MODES[mode]
    )
    hooks = [slim_nanguard.nan_hook(model.train_op, checkpoint_dir=logdir)]
    result = _train(model, logdir, 5, hooks=hooks)
    assert result.bad_steps == 1
    (record,) = _bad_steps(logdir)
    assert [step for step, _ in record["losses_before"]] == [0, 1, 2]


# ---------------------------------------------------------------------- the dumps' disk use
def test_many_bad_steps_keep_the_first_and_the_latest_dumps_and_say_which_went(tmp_path):
    logdir = str(tmp_path)
    config = slim_nanguard.GuardConfig(
        nan_policy="skip", autopsy_max_steps=10, autopsy_keep_first=2, autopsy_keep_last=2
    )
    # Every other batch is bad: bad steps at global steps 1 to 6, each with a dump.
    model = lib.build_model(
        faults={i: "nan_loss" for i in (1, 3, 5, 7, 9, 11)}, check_numerics=False, config=config
    )
    result = _train(model, logdir, 7)
    assert result.bad_steps == 6
    records = slim_nanguard.read_events(logdir)
    dumps = {r["step"]: r["autopsy"]["dump"] for r in records if r["kind"] == "bad_step"}
    assert sorted(dumps) == [1, 2, 3, 4, 5, 6]
    # The first two and the latest two are on disk, each with its arrays; 3 and 4 are gone.
    assert _dumps(logdir) == sorted(
        f"step{step}.{ext}" for step in (1, 2, 5, 6) for ext in ("json", "npz")
    )
    removed = [r for r in records if r["kind"] == "autopsy_dump_removed"]
    assert [(r["dump_step"], r["dump"]) for r in removed] == [(3, dumps[3]), (4, dumps[4])]
    # The record of a removed dump still reads right: its autopsy, and that the dump went.
    report = autopsy.format_report(autopsy.find_bad_step(logdir, step=3))
    assert "autopsy     first non-finite value" in report
    assert f"{dumps[3]}, removed later: a directory keeps the first 2 and the latest 2" in report
    kept = autopsy.format_report(autopsy.find_bad_step(logdir, step=5))
    assert f"  dump        {dumps[5]}" in kept.splitlines() and "removed" not in kept


def test_the_dumps_are_bounded_across_runs_in_one_directory(tmp_path):
    """A run resumed again and again (preemption) autopsies a few bad steps each time; the
    directory still keeps only the first and the latest."""
    logdir = str(tmp_path)
    config = slim_nanguard.GuardConfig(
        nan_policy="skip", autopsy_max_steps=2, autopsy_keep_first=1, autopsy_keep_last=2
    )
    for last_step in (3, 6):
        model = lib.build_model(
            faults={1: "nan_loss", 3: "nan_loss"}, check_numerics=True, config=config
        )
        _train(model, logdir, last_step, save_checkpoint_steps=1)
    steps = [r["step"] for r in _bad_steps(logdir)]
    assert steps == [1, 2, 4, 5]  # the second run resumed at 3 and met its own two bad batches
    assert _dumps(logdir) == ["step1.json", "step1.npz", "step4.json", "step4.npz"] + [
        "step5.json",
        "step5.npz",
    ]


def test_the_dump_bounds_are_validated():
    with pytest.raises(ValueError, match="autopsy_keep_last must be an integer >= 1; got 0"):
        slim_nanguard.GuardConfig(autopsy_keep_last=0)
    with pytest.raises(ValueError, match="autopsy_keep_first must be an integer >= 0"):
        slim_nanguard.GuardConfig(autopsy_keep_first=-1)
    with pytest.raises(ValueError, match="losses_before must be an integer >= 0"):
        slim_nanguard.GuardConfig(losses_before=1.5)


# ---------------------------------------------------------------------- the losses before
def test_the_record_keeps_the_losses_the_loop_saw_before_the_bad_step(tmp_path):
    """A hand-written loop fetches the loss of each step (the train op's value); the hook
    keeps the ones it judged good, and the bad step's record holds them with their steps."""
    logdir = str(tmp_path)
    model = lib.build_model(faults={3: "nan_gradient"}, nan_policy="skip", check_numerics=False)
    hook = slim_nanguard.nan_hook(model.train_op, checkpoint_dir=logdir)
    seen = []
    with (
        model.graph.as_default(),
        tf.compat.v1.train.MonitoredTrainingSession(
            hooks=[hook], log_step_count_steps=None
        ) as sess,
    ):
        for _ in range(5):
            loss = sess.run(model.train_op)
            if hook.last_outcome.good:
                seen.append(float(loss))
    (record,) = _bad_steps(logdir)
    assert record["step"] == 3 and record["loss_kind"] == "finite"  # only the gradient went bad
    assert record["losses_before"] == [[0, seen[0]], [1, seen[1]], [2, seen[2]]]
    # No TensorBoard loss in this run: the plot draws the record's.
    tag, pieces = run_plot.loss_pieces(logdir)
    assert (tag, pieces) == (
        run_plot.RECORD_TAG,
        [([(0, seen[0]), (1, seen[1]), (2, seen[2])], [])],
    )
    low, high = run_plot.zoom_window(record)
    assert -1 < low < 0 and 3 < high  # from the first loss kept to past the bad step


def _diverging_run(logdir, mode):
    """SGD on ``w^2`` at a learning rate of 10: ``w`` grows 19-fold a step, the loss overflows
    float32 at global step 16, and the rollback to the checkpoint of step 0 (the only one)
    lowers the rate 100-fold, after which the loss falls. The loss is summarised every 5 steps."""
    graph = tf.Graph()
    with graph.as_default():
        w = tf.compat.v1.get_variable("w", [], initializer=tf.compat.v1.ones_initializer())
        config = slim_nanguard.GuardConfig(nan_policy="rollback", rollback_lr_factor=0.01)
        train_op = slim_nanguard.create_train_op(
            tf.square(w),
            tf.compat.v1.train.GradientDescentOptimizer(10.0),
            check_numerics=lib.MODES[mode],
            config=config,
        )
    return slim_nanguard.train(
        train_op,
        logdir,
        number_of_steps=25,
        save_checkpoint_steps=1000,
        save_summaries_steps=5,
        log_every_n_steps=5,
    )


@lib.each_mode
def test_the_plot_shows_the_climb_between_summaries_and_what_the_rollback_undid(tmp_path, mode):
    logdir = str(tmp_path)
    result = _diverging_run(logdir, mode)
    assert (result.rollbacks, result.global_step) == (1, 25)
    (record,) = _bad_steps(logdir)
    assert record["step"] == 16
    before = [tuple(pair) for pair in record["losses_before"]]
    assert [step for step, _ in before] == list(range(16))
    assert all(later > 300 * earlier for (_, earlier), (_, later) in zip(before, before[1:]))
    tag, pieces = run_plot.loss_pieces(logdir)
    assert tag == "nanguard/loss"
    (kept, dropped), (after, none) = pieces
    # Undone by the rollback to step 0: the record's climb (the summaries of steps 5, 10 and
    # 15 in it give way to it); then the summaries of the steps trained again.
    assert kept == [] and dropped == before
    assert [step for step, _ in after] == [5, 10, 15, 20, 25] and none == []
    low, high = run_plot.zoom_window(record)
    assert -1 < low < 0 and 16 < high < 25
