"""Turned on mid-run: a job checkpointed for days without the spike guard resumes with it.

The first run trains with no guard option that makes variables, in one of the three loops
users run (`tf_slim.learning.train`, `tf_slim.training.train`, a `MonitoredTrainingSession`)
and checkpoints. The same job is then resumed in the same directory with
``spike_policy="skip"`` (the guard's statistics are new variables) or with
``rollback_lr_factor=0.5`` (the learning-rate scale is one): its checkpoints lack them. The
loop resumes all the same: the global step carries on, the statistics warm up afresh from
nothing, the learning-rate scale starts at 1, and one log line says what was missing.
"""

import logging

import pytest
import tensorflow as tf
import tf_slim as slim

import slim_nanguard
from slim_nanguard import _checkpoints

import nanguard_testlib as lib

FIRST, SECOND = 6, 15  # global steps at the end of the first run and of the resumed one


def _learning_train(model, logdir, steps):
    with model.graph.as_default():
        slim.learning.train(
            model.train_op,
            logdir,
            train_step_fn=slim_nanguard.make_train_step(logdir),
            number_of_steps=steps,
            save_summaries_secs=None,
            save_interval_secs=None,  # learning.train saves once, at the end
            saver=slim_nanguard.FiniteSaver(),  # as the README's learning.train lines have it
        )


def _training_train(model, logdir, steps):
    with model.graph.as_default():
        slim.training.train(
            model.train_op,
            logdir,
            hooks=[tf.compat.v1.train.StopAtStepHook(last_step=steps)],
            save_checkpoint_secs=600,  # at the start and at the end
            save_summaries_steps=None,
        )


def _monitored(model, logdir, steps):
    with (
        model.graph.as_default(),
        tf.compat.v1.train.MonitoredTrainingSession(
            checkpoint_dir=logdir,
            hooks=[tf.compat.v1.train.StopAtStepHook(last_step=steps)],
            save_checkpoint_secs=600,
            save_summaries_steps=None,
            log_step_count_steps=None,
        ) as sess,
    ):
        while not sess.should_stop():
            sess.run(model.train_op)


LOOPS = {
    "learning.train": _learning_train,
    "training.train": _training_train,
    "MonitoredTrainingSession": _monitored,
}
GUARD_OPTIONS = {
    "spike_policy": dict(spike_policy="skip"),
    "rollback_lr_factor": dict(nan_policy="rollback", rollback_lr_factor=0.5),
}


def _resume_lines(caplog):
    return [r.getMessage() for r in caplog.records if "was written without" in r.getMessage()]


@pytest.mark.parametrize("option", list(GUARD_OPTIONS))
@pytest.mark.parametrize("loop", list(LOOPS))
def test_a_job_checkpointed_without_the_guard_resumes_with_it(loop, option, tmp_path, caplog):
    logdir, train = str(tmp_path), LOOPS[loop]
    train(lib.build_model(nan_policy="skip", check_numerics=True), logdir, FIRST)
    before = lib.checkpoint_values(tf.train.latest_checkpoint(logdir))
    assert int(before["global_step"]) == FIRST
    assert not [name for name in before if name.startswith("nanguard")]

    model = lib.build_model(check_numerics=True, **GUARD_OPTIONS[option])
    with caplog.at_level(logging.INFO, logger="absl"):
        train(model, logdir, SECOND)

    after = lib.checkpoint_values(tf.train.latest_checkpoint(logdir))
    assert int(after["global_step"]) == SECOND  # carried on from FIRST, not from 0
    if option == "spike_policy":  # warmed up afresh: the resumed run's steps only
        assert int(after["nanguard_spike/count"]) == SECOND - FIRST
    else:
        assert after["nanguard/learning_rate_scale"] == 1.0
    (line,) = _resume_lines(caplog)
    missing = "nanguard_spike/history" if option == "spike_policy" else "learning_rate_scale"
    assert missing in line and ("warm up afresh" in line) == (option == "spike_policy")


@pytest.mark.parametrize("loop", list(LOOPS))
def test_a_job_that_had_the_guard_resumes_its_statistics_silently(loop, tmp_path, caplog):
    """The usual resume: the checkpoint has the statistics, which carry on, and nothing is
    said about missing variables."""
    logdir, train = str(tmp_path), LOOPS[loop]
    train(lib.build_model(spike_policy="skip", check_numerics=True), logdir, FIRST)
    with caplog.at_level(logging.INFO, logger="absl"):
        train(lib.build_model(spike_policy="skip", check_numerics=True), logdir, SECOND)
    after = lib.checkpoint_values(tf.train.latest_checkpoint(logdir))
    assert int(after["nanguard_spike/count"]) == int(after["global_step"]) == SECOND
    assert _resume_lines(caplog) == []


def _graph_with_train_op(own_saver: bool, **create_kwargs):
    graph = tf.Graph()
    with graph.as_default():
        w = tf.compat.v1.get_variable("w", [1], use_resource=True)
        if own_saver:
            tf.compat.v1.add_to_collection(
                tf.compat.v1.GraphKeys.SAVERS, tf.compat.v1.train.Saver()
            )
        loss = tf.reduce_sum(tf.square(w))
        slim_nanguard.create_train_op(
            loss, tf.compat.v1.train.GradientDescentOptimizer(0.1), **create_kwargs
        )
    return graph.get_collection(tf.compat.v1.GraphKeys.SAVERS)


def test_the_default_saver_resumes_only_where_the_guard_made_optional_variables():
    """With optional variables, the graph's default saver (what `Scaffold` saves with) is a
    `ResumingSaver`; a saver of the user's own already there stays the only one (a second one
    would make `Scaffold` refuse to choose); without them the collection is left empty."""
    (default,) = _graph_with_train_op(False, spike_policy="skip")
    assert isinstance(default, _checkpoints.ResumingSaver)
    (own,) = _graph_with_train_op(True, spike_policy="skip")
    assert not isinstance(own, _checkpoints.ResumingSaver)
    assert _graph_with_train_op(False) == []


def test_a_supervisor_with_its_default_saver_is_told_to_pass_a_finite_saver(tmp_path):
    """A `Supervisor` takes the graph's default saver, which create_train_op registers for a
    `Scaffold` to build, and never builds it: the first save says what to pass instead."""
    model = lib.build_model(nan_policy="skip", spike_policy="skip")
    with model.graph.as_default():
        supervisor = tf.compat.v1.train.Supervisor(logdir=str(tmp_path), save_model_secs=0)
        with supervisor.managed_session() as sess:
            sess.run(model.train_op)
            with pytest.raises(RuntimeError, match=r"pass saver=slim_nanguard\.FiniteSaver\(\)"):
                supervisor.saver.save(sess, str(tmp_path / "model.ckpt"), global_step=1)


def test_the_launcher_resumes_a_run_with_the_spike_guard_turned_on(tmp_path, caplog):
    """The launcher's run of 6 steps without the spike guard, resumed in its --train_dir with
    ``--spike_policy=skip``: no refusal (the checkpoint lacks only the guard's statistics),
    the global step carries on, and the one line says the statistics warm up afresh."""
    from test_faults import _config

    from slim_nanguard import app

    caplog.set_level(logging.INFO)
    first = app.run_training(_config(tmp_path / "run", max_number_of_steps=FIRST))
    assert first.global_step == FIRST
    resumed = app.run_training(
        _config(tmp_path / "run", max_number_of_steps=SECOND, spike_policy="skip")
    )
    assert (resumed.global_step, resumed.stop_reason) == (SECOND, "step_limit")
    (line,) = _resume_lines(caplog)
    assert "nanguard_spike/history" in line and "warm up afresh" in line
    assert slim_nanguard.non_finite_variables(resumed.checkpoint) == ()
