"""A damaged ``checkpoint`` state file does not restart a run.

A crash while a `Saver` rewrites ``train_dir/checkpoint`` can leave it garbled, cut short or
empty, next to intact checkpoints. A run started again must resume from the newest of them
(found by listing the directory), say so in one warning line, and rewrite the state file; the
evaluation of that directory finds the same checkpoint and leaves the file to the run. Here a
run saves checkpoints, its state file is damaged, and the run (or the evaluation) is started
again: through the library, the launcher's library entry, and the launcher's commands.
"""

import uuid

import pytest
import tensorflow as tf
from test_autopsy import _train as train_saving_every_step
from test_faults import _config
from test_launcher import EVAL
from test_launcher import TRAIN
from test_launcher import _run

import slim_nanguard
from slim_nanguard import _checkpoints
from slim_nanguard import app

import nanguard_testlib as lib

DAMAGES = ["garbled", "truncated", "empty"]


def _damage(train_dir, how):
    """Damages the state file of `train_dir` as a crash while it was rewritten would."""
    path = f"{train_dir}/checkpoint"
    with tf.io.gfile.GFile(path, "r") as f:
        text = f.read()
    assert text.startswith("model_checkpoint_path:")  # the state file as a Saver wrote it
    damaged = {
        "garbled": text.replace("_", "\x00", 3).encode(),  # a few bytes overwritten
        "truncated": text[: len(text) - 12].encode(),  # cut inside the last quoted name
        "empty": b"",
        "not text": b"\x9f\xe2\x00\xff" + text.encode()[4:],  # not even UTF-8
    }[how]
    tf.io.gfile.remove(path)  # (ram:// appends to a file opened for writing)
    with tf.io.gfile.GFile(path, "wb") as f:
        f.write(damaged)


def _assert_state_names(train_dir, step):
    """The state file parses and names model.ckpt-`step`, by name (relative to the directory)."""
    state = tf.train.get_checkpoint_state(str(train_dir))
    assert state.model_checkpoint_path == f"{train_dir}/model.ckpt-{step}"
    with tf.io.gfile.GFile(f"{train_dir}/checkpoint", "r") as f:
        assert f.readline() == f'model_checkpoint_path: "model.ckpt-{step}"\n'


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if "cannot be parsed" in r.getMessage()]


def _train(logdir, steps):
    """A run to global step `steps` saving every step (`test_autopsy`'s loop)."""
    return train_saving_every_step(logdir, lib.build_model(check_numerics=True), steps)


@pytest.mark.parametrize("how", DAMAGES)
def test_train_resumes_from_the_newest_checkpoint_past_a_damaged_state_file(tmp_path, caplog, how):
    """Five steps saved, the state file damaged: the next run to step 8 resumes at step 5,
    says so once, and leaves a state file that parses."""
    _train(tmp_path, steps=5)
    _damage(tmp_path, how)
    result = _train(tmp_path, steps=8)
    assert (result.global_step, result.steps) == (8, 3)  # resumed at step 5, not 0
    (warning,) = _warnings(caplog)
    assert f"{tmp_path}/checkpoint" in warning and f"{tmp_path}/model.ckpt-5" in warning
    _assert_state_names(tmp_path, 8)


@pytest.fixture(params=["local", "ram"])
def train_dir(request, tmp_path):
    """A local directory, or one on remote storage (TensorFlow's in-process ``ram://``)."""
    if request.param == "local":
        yield str(tmp_path)
        return
    path = f"ram://nanguard-{uuid.uuid4().hex[:8]}/run"
    yield path
    if tf.io.gfile.exists(path):
        tf.io.gfile.rmtree(path)


@pytest.mark.parametrize("how", DAMAGES)
def test_the_checkpoints_are_found_by_listing_and_the_state_file_rewritten(train_dir, caplog, how):
    """After the damage, the newest checkpoint is found at once; the run that trains there
    (``repair_state=True``) rewrites the state file to name it and the older ones, by name,
    as the run's saver writes it."""
    _train(train_dir, steps=4)  # checkpoints 0 to 4; a Saver keeps the last 5
    _damage(train_dir, how)
    found = slim_nanguard.latest_good_checkpoint(train_dir, repair_state=True)
    assert found == f"{train_dir}/model.ckpt-4"
    assert len(_warnings(caplog)) == 1
    _assert_state_names(train_dir, 4)
    state = tf.train.get_checkpoint_state(train_dir)
    assert list(state.all_model_checkpoint_paths) == [
        f"{train_dir}/model.ckpt-{step}" for step in range(5)
    ]
    # Repaired: the next look reads the state file and says nothing more.
    assert slim_nanguard.latest_good_checkpoint(train_dir) == f"{train_dir}/model.ckpt-4"
    assert len(_warnings(caplog)) == 1


@pytest.mark.parametrize("how", ["garbled", "empty"])
def test_a_reader_finds_the_newest_checkpoint_and_leaves_the_state_file_to_the_run(
    train_dir, caplog, how
):
    """An evaluation beside a run reads a damaged state file's directory without writing it:
    the run's `Saver` is the file's only writer."""
    _train(train_dir, steps=4)
    _damage(train_dir, how)
    with tf.io.gfile.GFile(f"{train_dir}/checkpoint", "rb") as f:
        damaged = f.read()
    assert slim_nanguard.latest_good_checkpoint(train_dir) == f"{train_dir}/model.ckpt-4"
    assert _checkpoints.latest_checkpoint(train_dir) == f"{train_dir}/model.ckpt-4"
    (first, second) = _warnings(caplog)
    assert "left the state file as it is" in first and "left the state file as it is" in second
    with tf.io.gfile.GFile(f"{train_dir}/checkpoint", "rb") as f:
        assert f.read() == damaged


def test_a_pretrained_checkpoint_beside_the_run_survives_a_resume_past_a_damaged_state(
    tmp_path, caplog
):
    """A model garden run keeps ``pretrained.ckpt`` in its train_dir (its --checkpoint_path).
    The listing that stands in for a damaged state file names only the run's own
    ``model.ckpt-<step>``: were the pretrained weights listed, the run's `Saver` would take
    them for its oldest checkpoint and delete them past ``max_to_keep``."""
    _train(tmp_path, steps=2)
    for name in tf.io.gfile.glob(f"{tmp_path}/model.ckpt-0.*"):
        tf.io.gfile.copy(name, name.replace("model.ckpt-0", "pretrained.ckpt"))
    _damage(tmp_path, "garbled")
    result = _train(tmp_path, steps=12)  # ten more checkpoints: the Saver keeps five
    assert (result.global_step, result.steps) == (12, 10)
    assert tf.io.gfile.exists(f"{tmp_path}/pretrained.ckpt.index")
    state = tf.train.get_checkpoint_state(str(tmp_path))
    assert [p.rsplit("/", 1)[1] for p in state.all_model_checkpoint_paths] == [
        f"model.ckpt-{step}" for step in range(8, 13)
    ]
    assert tf.train.load_variable(f"{tmp_path}/pretrained.ckpt", "global_step") == 0


def test_a_damaged_state_file_and_an_unreadable_newest_checkpoint(tmp_path, caplog):
    """The listing passes over a checkpoint that cannot be read, as the state file's does."""
    _train(tmp_path, steps=4)
    _damage(tmp_path, "not text")
    for data in tf.io.gfile.glob(f"{tmp_path}/model.ckpt-4.data*"):
        with open(data, "r+b") as f:
            f.truncate(3)
    found = slim_nanguard.latest_good_checkpoint(str(tmp_path), repair_state=True)
    assert found == f"{tmp_path}/model.ckpt-3"
    _assert_state_names(tmp_path, 3)


# ---------------------------------------------------------------------------------------------
# The launcher: its library entry, and its commands.


@pytest.mark.parametrize("how", DAMAGES)
def test_the_launchers_run_and_eval_resume_past_a_damaged_state_file(tmp_path, caplog, how):
    train_dir = tmp_path / "run"
    app.run_training(_config(train_dir, max_number_of_steps=6))
    _damage(train_dir, how)
    with tf.io.gfile.GFile(f"{train_dir}/checkpoint", "rb") as f:
        damaged = f.read()
    evaluation = app.run_eval(
        app.EvalConfig(checkpoint_path=str(train_dir), dataset_name="synthetic", batch_size=64)
    )
    assert evaluation.global_step == 6
    assert len(_warnings(caplog)) == 1
    with tf.io.gfile.GFile(f"{train_dir}/checkpoint", "rb") as f:
        assert f.read() == damaged  # an evaluation reads; the run that trains writes
    result = app.run_training(_config(train_dir, max_number_of_steps=9))
    assert (result.global_step, result.steps) == (9, 3)
    _assert_state_names(train_dir, 9)  # the training run rewrote it


def test_the_commands_resume_and_evaluate_past_a_damaged_state_file(tmp_path):
    """``slim-nanguard-train`` run again in a directory whose state file was garbled carries
    on from its checkpoint; ``slim-nanguard-eval`` of a directory whose state file is empty
    evaluates its newest checkpoint. Each says so."""
    train_dir = tmp_path / "run"
    proc = _run(TRAIN, f"--train_dir={train_dir}", "--max_number_of_steps=20", "--eval_split_name=")
    assert proc.returncode == 0, proc.stderr
    _damage(train_dir, "garbled")
    proc = _run(TRAIN, f"--train_dir={train_dir}", "--max_number_of_steps=30", "--eval_split_name=")
    assert proc.returncode == 0, proc.stderr
    (warning,) = [line for line in proc.stderr.splitlines() if "cannot be parsed" in line]
    assert f"{train_dir}/checkpoint" in warning and f"{train_dir}/model.ckpt-20" in warning
    assert f"resuming from {train_dir}/model.ckpt-20" in proc.stderr
    assert "at global step 30/30" in proc.stdout and "10 good steps" in proc.stdout
    _damage(train_dir, "empty")
    proc = _run(EVAL, f"--checkpoint_path={train_dir}")
    assert proc.returncode == 0, proc.stderr
    assert f"checkpoint {train_dir}/model.ckpt-30 (global step 30)" in proc.stdout
    assert "cannot be parsed" in proc.stderr and "Invalid checkpoint state" not in proc.stderr
    assert tf.io.gfile.GFile(f"{train_dir}/checkpoint", "rb").read() == b""  # an eval reads
