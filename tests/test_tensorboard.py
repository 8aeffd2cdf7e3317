"""What each loop writes to TensorBoard, read back from its event files.

Every loop trains the same run: batch 3 of the pipeline is NaN and batch 8 a spike, both
skipped, so the bad steps are global steps 3 and 7 (the NaN step does not count), and only
there if no summary took a batch of the pipeline. At each bad step's global step the event
files hold the counters (``nanguard/bad_steps``, ``nanguard/skips``...), and at the spike's its
loss and z-scores (``nanguard/rejected_*``); on the loop's own summary schedule, the counters
as the graph holds them, beside the spike test's ``nanguard/z_loss``.
"""

import pytest
import tensorflow as tf
import tf_slim as slim

import slim_nanguard
from slim_nanguard import _recorders

import nanguard_testlib as lib

NAN_STEP, SPIKE_STEP, STEPS = 3, 7, 10


def _model(mode):
    return lib.build_model(
        faults={3: "nan_loss", 8: lib.SPIKE},
        nan_policy="skip",
        spike_policy="skip",
        spike_warmup_steps=3,
        check_numerics=lib.MODES[mode],
    )


def _scalars(logdir):
    """``{tag: [(step, value), ...]}`` of the guard's tags in every events file of `logdir`."""
    scalars = {}
    for path in tf.io.gfile.glob(f"{logdir}/events.out.tfevents.*"):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag.startswith("nanguard/"):
                    scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def _summaries(logdir):
    """Each summary of the events files of `logdir` in the order written: ``{tag: value}``."""
    return [
        {value.tag: value.simple_value for value in event.summary.value}
        for path in sorted(tf.io.gfile.glob(f"{logdir}/events.out.tfevents.*"))
        for event in tf.compat.v1.train.summary_iterator(path)
        if event.HasField("summary")
    ]


def _assert_written(logdir):
    scalars = _scalars(logdir)
    records = [r for r in slim_nanguard.read_events(logdir) if r["kind"] == "bad_step"]
    assert [(r["step"], r["cause"]) for r in records] == [(NAN_STEP, "non_finite"), (7, "spike")]
    # Each bad step at its global step: the counters, and the spike's loss and z-scores.
    assert (NAN_STEP, 1.0) in scalars["nanguard/bad_steps"]
    assert (NAN_STEP, 1.0) in scalars["nanguard/skips"]
    assert (SPIKE_STEP, 2.0) in scalars["nanguard/bad_steps"]
    assert (SPIKE_STEP, 2.0) in scalars["nanguard/skips"]
    spike = records[1]["spike"]
    assert scalars["nanguard/rejected_loss"] == [(SPIKE_STEP, pytest.approx(records[1]["loss"]))]
    assert scalars["nanguard/rejected_z_loss"] == [(SPIKE_STEP, pytest.approx(spike["z_loss"]))]
    assert scalars["nanguard/rejected_z_grad_norm"] == [
        (SPIKE_STEP, pytest.approx(spike["z_grad_norm"]))
    ]
    assert spike["z_loss"] > 6  # a spike, over spike_sigma
    # The loop's schedule: the graph's counters in each of its summaries; the last, after the
    # spike, counts both bad steps.
    scheduled = [values for values in _summaries(logdir) if "nanguard/z_loss" in values]
    assert all({"nanguard/bad_steps", "nanguard/stops"} <= set(s) for s in scheduled)
    assert scheduled[-1]["nanguard/bad_steps"] == scheduled[-1]["nanguard/skips"] == 2.0
    return scalars


@lib.each_mode
def test_train(tmp_path, mode):
    logdir = str(tmp_path)
    model = _model(mode)
    slim_nanguard.train(
        model.train_op,
        logdir,
        number_of_steps=STEPS,
        save_checkpoint_steps=None,
        save_summaries_steps=2,
        log_every_n_steps=0,
    )
    scalars = _assert_written(logdir)
    assert len(scalars["nanguard/z_loss"]) >= 4  # every other step


@pytest.mark.parametrize("log_every_n_steps", [0, 3])
def test_trains_loss_follows_the_summaries_schedule_not_the_progress_lines(
    tmp_path, log_every_n_steps
):
    """`train` writes the step's loss as ``nanguard/loss`` at every ``save_summaries_steps``-th
    global step, whatever ``log_every_n_steps`` is; the progress lines add no scalar."""
    logdir = str(tmp_path)
    slim_nanguard.train(
        _model("hook").train_op,
        logdir,
        number_of_steps=STEPS,
        save_checkpoint_steps=None,
        save_summaries_steps=4,
        log_every_n_steps=log_every_n_steps,
    )
    scalars = _scalars(logdir)
    assert [step for step, _ in scalars["nanguard/loss"]] == [4, 8]
    # Steps 6 and 9 are neither a bad step nor on the summaries' schedule: a progress line
    # (every third step) writes nothing there.
    written_at = {step for points in scalars.values() for step, _ in points}
    assert not written_at & {6, 9}, sorted(written_at)


@lib.each_mode
def test_learning_train_with_train_step(tmp_path, mode):
    """tf-slim's Supervisor runs the summaries on a timer, in a thread of its own: the steps
    wait for a run of it after each bad step, so that one comes after the spike."""
    logdir = str(tmp_path)
    model = _model(mode)
    with model.graph.as_default():
        summary_op, summary_runs = lib.counted_summaries()
        guard = slim_nanguard.get_guard(model.train_op)

        def train_step(sess, *args):
            bad_steps = guard.state.total_bad_steps
            loss, should_stop = slim_nanguard.train_step(sess, *args)
            if guard.state.total_bad_steps != bad_steps:
                while summary_runs.acquire(blocking=False):  # runs before the bad step
                    pass
                # The second run to end from now began after the first: after the bad step.
                for _ in range(2):
                    assert summary_runs.acquire(timeout=120), "the summary thread never ran"
            return loss, should_stop

        lib.learning_train(
            model.train_op,
            logdir,
            train_step,
            STEPS,
            summary_op=summary_op,
            save_summaries_secs=0.01,
        )
    _assert_written(logdir)


def test_training_train_with_the_hook(tmp_path):
    """tf-slim's other loop takes hooks: hook mode only (a check would raise out of it)."""
    logdir = str(tmp_path)
    model = _model("hook")
    with model.graph.as_default():
        slim.training.train(
            model.train_op,
            logdir,
            hooks=[
                slim_nanguard.nan_hook(model.train_op, checkpoint_dir=logdir),
                tf.compat.v1.train.StopAtStepHook(last_step=STEPS),
            ],
            save_checkpoint_secs=None,
            save_summaries_steps=2,
        )
    _assert_written(logdir)


@pytest.mark.parametrize("mode", ["hook", "check_numerics"])
def test_a_monitored_session_of_ones_own(tmp_path, mode):
    """Hook mode with `nan_hook`; check_numerics mode with `handle_numerics_error`."""
    logdir = str(tmp_path)
    model = _model(mode)
    hooks = [tf.compat.v1.train.StopAtStepHook(last_step=STEPS)]
    if mode == "hook":
        hooks.append(slim_nanguard.nan_hook(model.train_op, checkpoint_dir=logdir))
    with (
        model.graph.as_default(),
        tf.compat.v1.train.MonitoredTrainingSession(
            checkpoint_dir=logdir,
            hooks=hooks,
            save_checkpoint_steps=1000,
            save_summaries_steps=2,
            log_step_count_steps=None,
        ) as sess,
    ):
        while not sess.should_stop():
            try:
                sess.run(model.train_op)
            except tf.errors.InvalidArgumentError as err:
                slim_nanguard.handle_numerics_error(sess, err)
    _assert_written(logdir)


def test_a_bad_steps_scalars_are_its_loss_and_its_reasons_z_scores():
    record = {"kind": "bad_step", "step": 4, "loss": 9.5, "cause": "spike"}
    record["spike"] = {"z_loss": 8.0, "z_grad_norm": "inf", "loss": 9.5, "over": ["loss"]}
    assert _recorders.event_scalars(record) == {
        "nanguard/rejected_loss": 9.5,
        "nanguard/rejected_z_loss": 8.0,
    }
    nan = {"kind": "bad_step", "step": 4, "loss": "nan", "cause": "non_finite"}
    assert _recorders.event_scalars(nan) == {}  # no NaN in TensorBoard: the counters say it
    assert _recorders.event_scalars({"kind": "rollback", "step": 4, "loss": 1.0}) == {}
