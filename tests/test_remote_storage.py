"""Training on remote storage: a ``train_dir`` of ``gs://``, ``hdfs://`` or ``s3://`` works as a
local one does.

TensorFlow's in-process ``ram://`` file system stands in for remote storage: `tf.io.gfile`
serves it like any other, while `os.path` takes ``ram://ng/run`` for a relative local path
(``./ram:/ng/run``). Each test runs in an empty working directory and checks at the end that
nothing was written there, so that a path handled as a local one shows up as a failure.
"""

import uuid

import numpy as np
import pytest
import tensorflow as tf
from test_faults import _config

import slim_nanguard
from slim_nanguard import _autopsy
from slim_nanguard import app
from slim_nanguard import autopsy
from slim_nanguard.app import plot as run_plot

import nanguard_testlib as lib

BAD = 3


@pytest.fixture
def remote(tmp_path, monkeypatch):
    """A fresh ``ram://`` directory; the test runs in an empty local working directory, which
    must still be empty at the end."""
    monkeypatch.chdir(tmp_path)
    path = f"ram://nanguard-{uuid.uuid4().hex[:8]}/run"
    yield path
    assert not list(tmp_path.iterdir()), "a remote path was written as a local one"
    if tf.io.gfile.exists(path):
        tf.io.gfile.rmtree(path)


def _train(logdir, *, mode="check_numerics", steps=6, **create_kwargs):
    model = lib.build_model(check_numerics=lib.MODES[mode], **create_kwargs)
    return slim_nanguard.train(
        model.train_op,
        logdir,
        number_of_steps=steps,
        save_checkpoint_steps=1,
        save_summaries_steps=2,
        log_every_n_steps=2,
    )


def _checkpoints(logdir):
    """Every checkpoint prefix in `logdir`, from its index files."""
    return sorted(p[: -len(".index")] for p in tf.io.gfile.glob(logdir + "/*.index"))


def _assert_no_poisoned_checkpoint(logdir):
    paths = _checkpoints(logdir)
    assert paths, f"no checkpoint in {logdir}"
    for path in paths:
        assert slim_nanguard.non_finite_variables(path) == (), path


@lib.each_mode
def test_a_run_skips_its_bad_step_records_it_and_resumes_on_remote_storage(remote, mode):
    """A NaN input at batch 3 is skipped; checkpoints, the record and the autopsy dump are in
    the remote directory; a second run resumes from its newest checkpoint."""
    first = _train(remote, mode=mode, nan_policy="skip", faults={BAD: "nan_input"})
    assert (first.global_step, first.skips, first.stop_reason) == (6, 1, "step_limit")
    assert first.checkpoint == f"{remote}/model.ckpt-6"
    assert first.events_path == f"{remote}/nanguard_events.jsonl"
    _assert_no_poisoned_checkpoint(remote)
    assert tf.io.gfile.glob(f"{remote}/events.out.tfevents.*")  # the summaries too

    (bad,) = [r for r in slim_nanguard.read_events(remote) if r["kind"] == "bad_step"]
    assert (bad["step"], bad["action"]) == (BAD, "skip")
    dump = bad["autopsy"]["dump"]
    assert dump == f"{remote}/nanguard_autopsy/step{BAD}.json"
    report, batch, _ = _autopsy.read_dump(dump)
    assert report["step"] == BAD
    assert np.isnan(batch["x:0"]).sum() == 1

    second = _train(remote, mode=mode, steps=9)
    assert (second.global_step, second.steps) == (9, 3)  # resumed at step 6, not 0
    assert slim_nanguard.latest_good_checkpoint(remote) == f"{remote}/model.ckpt-9"
    stops = [r["step"] for r in slim_nanguard.read_events(remote) if r["kind"] == "stop"]
    assert stops == [6, 9]  # one record, appended to


def test_the_autopsy_report_replay_and_plot_read_a_remote_run(remote):
    """What ``slim-nanguard-autopsy`` shows of a run on remote storage: the report of its bad
    step, the replay from the dump, and the plot, written to remote storage as well."""
    _train(remote, nan_policy="skip", faults={BAD: "nan_input"})
    record = autopsy.find_bad_step(remote)
    assert record["step"] == BAD
    assert f"dump        {remote}/nanguard_autopsy/step{BAD}.json" in autopsy.format_report(record)
    replay = autopsy.replay_dump(record["autopsy"]["dump"], remote)
    assert replay.reproduced and replay.first_bad_op["name"] == "x"
    pytest.importorskip("matplotlib")
    plot = run_plot.plot_run(remote, f"{remote}/run.png")
    with tf.io.gfile.GFile(plot, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_rollback_restores_the_checkpoint_from_remote_storage(remote):
    result = _train(remote, nan_policy="rollback", faults={BAD: "nan_loss"})
    assert (result.global_step, result.rollbacks) == (6, 1)
    (rollback,) = [r for r in slim_nanguard.read_events(remote) if r["kind"] == "rollback"]
    assert rollback["checkpoint"] == f"{remote}/model.ckpt-{BAD}"
    _assert_no_poisoned_checkpoint(remote)


def test_a_monitored_session_with_the_hook_rolls_back_from_remote_storage(remote):
    """The hand-written loop of the README, saving every step to ``checkpoint_dir``: the bad
    step at batch 3 rolls back to the checkpoint of step 3 and the run goes on."""
    model = lib.build_model(check_numerics=False, nan_policy="rollback", faults={BAD: "nan_loss"})
    run = lib.run_monitored(
        model.train_op,
        hooks=[slim_nanguard.nan_hook(model.train_op, checkpoint_dir=remote)],
        last_step=6,
        checkpoint_dir=remote,
    )
    guard = slim_nanguard.get_guard(model.train_op)
    assert guard.state.rollbacks == 1
    assert int(run.final["global_step"]) == 6
    _assert_no_poisoned_checkpoint(remote)


def test_finite_saver_and_latest_good_checkpoint_on_remote_storage(remote):
    """A FiniteSaver writes a finite model and refuses a NaN one; a newest checkpoint cut
    short is passed over for the one before it."""
    with tf.Graph().as_default():
        w = tf.compat.v1.get_variable("w", initializer=[1.0, 2.0])
        saver = slim_nanguard.FiniteSaver()
        with tf.compat.v1.Session() as sess:
            sess.run(w.initializer)
            for step in (1, 2):
                assert saver.save(sess, f"{remote}/model.ckpt", global_step=step)
            sess.run(w.assign([np.nan, 2.0]))
            assert saver.save(sess, f"{remote}/model.ckpt", global_step=3) is None
    assert saver.refused_saves == 1
    assert slim_nanguard.latest_good_checkpoint(remote) == f"{remote}/model.ckpt-2"
    (data,) = tf.io.gfile.glob(f"{remote}/model.ckpt-2.data-*")
    tf.io.gfile.remove(data)  # ram:// appends to a file opened for writing
    with tf.io.gfile.GFile(data, "wb") as f:
        f.write(b"cut")
    assert slim_nanguard.latest_good_checkpoint(remote) == f"{remote}/model.ckpt-1"


def test_the_launchers_run_trains_and_evaluates_on_remote_storage(remote):
    """`app.train_and_evaluate`, what ``slim-nanguard-train`` runs, with ``--train_dir`` on
    remote storage: trained past an injected NaN batch, and the final checkpoint evaluated."""
    lines = []
    config = _config(remote, max_number_of_steps=8, inject_faults="nan_input:4")
    assert app.train_and_evaluate(config, echo=lines.append) == 0
    text = "\n".join(lines)
    assert f"checkpoint    {remote}/model.ckpt-8" in text
    assert f"checkpoint {remote}/model.ckpt-8 (global step 8)" in text  # the evaluation
    _assert_no_poisoned_checkpoint(remote)
