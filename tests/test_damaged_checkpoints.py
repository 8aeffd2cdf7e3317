"""A damaged checkpoint is named in one line, and passed over where an older one will do.

A disk that filled up, a copy cut off, a few bytes overwritten: a checkpoint's ``.data`` shard
or ``.index`` file is cut short or garbled, next to intact older checkpoints. Here a run saves
checkpoints, the newest is damaged four ways (each file cut, each file garbled), and every
reader is run on it: `non_finite_variables` and `storage.checkpoint_reader` raise the one
documented error naming the file; `latest_good_checkpoint`, a resume and a rollback go back to
the older checkpoint with one warning naming it; the evaluation, its command and the autopsy's
replay say what is wrong in one line and exit non-zero. No reader loses anything: the older
checkpoints and the record are as they were.
"""

import re
import shutil
import uuid

import numpy as np
import pytest
import tensorflow as tf
from test_autopsy import _Model
from test_autopsy import _run_cli as _run_autopsy
from test_autopsy import _train as _train_with_an_autopsy
from test_faults import _config
from test_launcher import EVAL
from test_launcher import TRAIN
from test_launcher import _plain_stderr
from test_launcher import _run

import slim_nanguard
from slim_nanguard import _checkpoints
from slim_nanguard import app
from slim_nanguard import storage

import nanguard_testlib as lib

DAMAGES = ["data cut", "data garbled", "index cut", "index garbled"]


def _damage(prefix, how):
    """Damages one file of checkpoint `prefix` as `how` says; returns the file's path."""
    which, kind = how.split()
    (path,) = [prefix + ".index"] if which == "index" else tf.io.gfile.glob(prefix + ".data-*")
    with tf.io.gfile.GFile(path, "rb") as f:
        data = f.read()
    if kind == "cut":  # a copy or a write that stopped half way
        data = data[: len(data) // 2]
    else:  # sixteen bytes overwritten a third of the way in
        at = len(data) // 3
        data = data[:at] + b"\xde\xad\xbe\xef" * 4 + data[at + 16 :]
    tf.io.gfile.remove(path)  # (ram:// appends to a file opened for writing)
    with tf.io.gfile.GFile(path, "wb") as f:
        f.write(data)
    return path


def _files(directory):
    """Every file under `directory` and its bytes."""
    found = {}
    for root, _, names in tf.io.gfile.walk(directory):
        for name in names:
            with tf.io.gfile.GFile(f"{root}/{name}", "rb") as f:
                found[f"{root}/{name}"] = f.read()
    return found


def _values(path):
    reader = storage.checkpoint_reader(path)
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


def _warnings(caplog, path):
    return [r.getMessage() for r in caplog.records if f"{path} cannot be read" in r.getMessage()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A launcher's run to step 6 with checkpoints at steps 0, 3 and 6 (made once)."""
    train_dir = tmp_path_factory.mktemp("trained") / "run"
    app.run_training(_config(train_dir, max_number_of_steps=3))
    app.run_training(_config(train_dir, max_number_of_steps=6))
    assert tf.train.latest_checkpoint(str(train_dir)) == f"{train_dir}/model.ckpt-6"
    return train_dir


@pytest.fixture(params=["local", "ram"])
def train_dir(request, trained, tmp_path):
    """A copy of the trained run: a local directory, or one on remote storage (``ram://``)."""
    if request.param == "local":
        shutil.copytree(trained, tmp_path / "run")
        yield str(tmp_path / "run")
        return
    path = f"ram://nanguard-{uuid.uuid4().hex[:8]}/run"
    for name, data in _files(str(trained)).items():
        target = path + name[len(str(trained)) :]
        tf.io.gfile.makedirs(target.rsplit("/", 1)[0])
        with tf.io.gfile.GFile(target, "wb") as f:
            f.write(data)
    yield path
    tf.io.gfile.rmtree(path)


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
    """Each story reads its checkpoints afresh (the cache is per process)."""
    monkeypatch.setattr(_checkpoints, "_VERIFIED", type(_checkpoints._VERIFIED)())


# ---------------------------------------------------------------------------------------------
# What TensorFlow raises, and the one place that reads it.


@pytest.mark.parametrize("how", DAMAGES)
def test_every_error_tensorflow_raises_on_a_damaged_file_is_known_as_damage(trained, tmp_path, how):
    """TensorFlow's reader and a `Saver`'s restore each fail on the damaged checkpoint, with
    errors that differ by damage (IndexError, an OpError of code UNKNOWN, DataLossError,
    OutOfRangeError): every one of them is classified as a damaged file, and the reader's
    names the file that was damaged."""
    shutil.copytree(trained, tmp_path / "run")
    prefix = f"{tmp_path}/run/model.ckpt-6"
    damaged = _damage(prefix, how)
    errors = []
    try:
        reader = tf.train.load_checkpoint(prefix)
        errors.append(None)
        for name in reader.get_variable_to_shape_map():
            reader.get_tensor(name)
    except (IndexError, tf.errors.OpError) as err:
        errors.append(err)
    with tf.Graph().as_default():
        variables = [
            tf.compat.v1.get_variable(name, shape, dtype=dtype)
            for name, shape, dtype in _shapes_and_dtypes(f"{tmp_path}/run/model.ckpt-3")
        ]
        with tf.compat.v1.Session() as sess, pytest.raises(tf.errors.OpError) as restore:
            tf.compat.v1.train.Saver(variables).restore(sess, prefix)
    data = errors[0] is None  # the index opened: the data shard failed
    read = errors[-1]
    assert read is not None, "TensorFlow read the damaged checkpoint"
    assert _checkpoints.unreadable(prefix, read, data=data).file == damaged
    assert _checkpoints.unreadable(prefix, restore.value) is not None
    assert (
        _checkpoints.unreadable(prefix, tf.errors.PermissionDeniedError(None, None, "no")) is None
    )


def _shapes_and_dtypes(path):
    reader = tf.train.load_checkpoint(path)
    dtypes = reader.get_variable_to_dtype_map()
    return [
        (name, shape, dtypes[name]) for name, shape in reader.get_variable_to_shape_map().items()
    ]


# ---------------------------------------------------------------------------------------------
# The library's readers.


@pytest.mark.parametrize("how", DAMAGES)
def test_the_readers_raise_one_error_naming_the_damaged_file(train_dir, how):
    """`non_finite_variables` (and `storage.checkpoint_reader`, for a damaged index) raise
    `UnreadableCheckpointError`: one line naming the file and what to do. Nothing is
    changed on disk."""
    prefix = f"{train_dir}/model.ckpt-6"
    damaged = _damage(prefix, how)
    before = _files(train_dir)
    with pytest.raises(slim_nanguard.UnreadableCheckpointError) as raised:
        slim_nanguard.non_finite_variables(prefix)
    err = raised.value
    assert (err.checkpoint, err.file) == (prefix, damaged)
    (line,) = str(err).splitlines()
    assert line.startswith(f"checkpoint {prefix} cannot be read: {damaged.rsplit('/', 1)[1]} ")
    assert "Restore it from a copy, or move model.ckpt-6.* out of its directory" in line
    # Asked again, the same answer (remembered, not read again).
    with pytest.raises(slim_nanguard.UnreadableCheckpointError, match=re.escape(line)):
        slim_nanguard.non_finite_variables(prefix)
    if how.startswith("index"):
        with pytest.raises(slim_nanguard.UnreadableCheckpointError) as opened:
            storage.checkpoint_reader(prefix)
        assert opened.value.file == damaged
    assert slim_nanguard.non_finite_variables(f"{train_dir}/model.ckpt-3") == ()
    assert _files(train_dir) == before


@pytest.mark.parametrize("how", ["data cut", "index garbled"])
def test_asked_about_the_directory_the_readers_name_its_latest_checkpoints_file(train_dir, how):
    """`non_finite_variables` and `storage.checkpoint_reader` take a directory for its latest
    checkpoint: the error names that checkpoint and its damaged file, not the directory."""
    prefix = f"{train_dir}/model.ckpt-6"
    damaged = _damage(prefix, how)
    with pytest.raises(slim_nanguard.UnreadableCheckpointError) as raised:
        slim_nanguard.non_finite_variables(train_dir)
    assert (raised.value.checkpoint, raised.value.file) == (prefix, damaged)
    assert "move model.ckpt-6.* out of its directory" in str(raised.value)
    if how.startswith("index"):
        with pytest.raises(slim_nanguard.UnreadableCheckpointError) as opened:
            storage.checkpoint_reader(train_dir)
        assert opened.value.file == damaged


@pytest.mark.parametrize("how", DAMAGES)
def test_latest_good_checkpoint_passes_over_it_with_one_warning(train_dir, caplog, how):
    """Asked three times, as a launcher's start asks (the launcher, `train`, the session's
    init_fn), and for a rollback's walk back: the checkpoint of step 3 each time, and one
    warning naming the damaged file."""
    damaged = _damage(f"{train_dir}/model.ckpt-6", how)
    before = _files(train_dir)
    for _ in range(3):
        assert slim_nanguard.latest_good_checkpoint(train_dir) == f"{train_dir}/model.ckpt-3"
    assert slim_nanguard.latest_good_checkpoint(train_dir, before_step=7).endswith("ckpt-3")
    (warning,) = _warnings(caplog, f"{train_dir}/model.ckpt-6")
    assert damaged.rsplit("/", 1)[1] in warning
    assert f"using {train_dir}/model.ckpt-3 instead" in warning and "\n" not in warning
    assert _files(train_dir) == before


def test_no_readable_checkpoint_at_all_is_one_error_naming_each_file(train_dir):
    """Both checkpoints the state file names are damaged: one error, naming each file."""
    damaged = [_damage(f"{train_dir}/model.ckpt-{step}", "data cut") for step in (3, 6)]
    with pytest.raises(slim_nanguard.CheckpointNotFoundError) as raised:
        slim_nanguard.latest_good_checkpoint(train_dir)
    (line,) = str(raised.value).splitlines()
    assert all(path.rsplit("/", 1)[1] in line for path in damaged)
    assert line.endswith("Restore the damaged files from a copy, or train in a new directory.")


# ---------------------------------------------------------------------------------------------
# Resume and rollback.


@pytest.mark.parametrize("how", ["data cut", "index garbled"])
def test_the_launcher_resumes_from_the_older_checkpoint_and_warns_once(train_dir, caplog, how):
    """The newest checkpoint (step 6) is damaged: the run to step 9 resumes at step 3, says so
    once, and keeps the older checkpoint's values and the record it had."""
    damaged = _damage(f"{train_dir}/model.ckpt-6", how)
    older = _values(f"{train_dir}/model.ckpt-3")
    with tf.io.gfile.GFile(f"{train_dir}/nanguard_events.jsonl", "rb") as f:
        record = f.read()
    result = app.run_training(_config(train_dir, max_number_of_steps=9))
    assert (result.global_step, result.steps) == (9, 6)
    (warning,) = _warnings(caplog, f"{train_dir}/model.ckpt-6")
    assert damaged.rsplit("/", 1)[1] in warning
    for name, value in _values(f"{train_dir}/model.ckpt-3").items():
        np.testing.assert_array_equal(value, older[name], err_msg=name)
    with tf.io.gfile.GFile(f"{train_dir}/nanguard_events.jsonl", "rb") as f:
        assert f.read().startswith(record)


class _DamageTheNewestCheckpoint(tf.compat.v1.train.SessionRunHook):
    """Before run `at` (global step `at` to `at` + 1), damages the checkpoint of step `at`."""

    def __init__(self, logdir, at, how):
        self.logdir, self.at, self.how = logdir, at, how
        self.runs = 0
        self.damaged = None

    def before_run(self, run_context):
        if self.runs == self.at:
            self.damaged = _damage(f"{self.logdir}/model.ckpt-{self.at}", self.how)
        self.runs += 1


@pytest.mark.parametrize("how", ["data cut", "index garbled"])
def test_a_rollback_walks_back_past_a_checkpoint_damaged_during_the_run(tmp_path, caplog, how):
    """A checkpoint every step; the newest (step 3) is damaged just before batch 3, which is
    bad: the rollback restores step 2, says once which file it passed over, and the run
    goes on to step 8."""
    bad = 3
    model = lib.build_model(nan_policy="rollback", faults={bad: "nan_input"})
    damage = _DamageTheNewestCheckpoint(tmp_path, at=bad, how=how)
    result = slim_nanguard.train(
        model.train_op,
        str(tmp_path),
        number_of_steps=8,
        save_checkpoint_steps=1,
        save_summaries_steps=None,
        log_every_n_steps=0,
        hooks=[damage],
    )
    assert (result.global_step, result.rollbacks) == (8, 1)
    (rollback,) = [r for r in slim_nanguard.read_events(str(tmp_path)) if r["kind"] == "rollback"]
    assert rollback["checkpoint"] == f"{tmp_path}/model.ckpt-2"
    (warning,) = _warnings(caplog, f"{tmp_path}/model.ckpt-3")
    assert damage.damaged.rsplit("/", 1)[1] in warning
    lib.assert_no_poisoned_checkpoint(str(tmp_path))


# ---------------------------------------------------------------------------------------------
# The evaluation, and the commands.


@pytest.mark.parametrize("how", DAMAGES)
def test_the_evaluation_names_the_file_and_the_flag(train_dir, how):
    """`run_eval` of the directory (its newest checkpoint is damaged) or of the prefix."""
    prefix = f"{train_dir}/model.ckpt-6"
    damaged = _damage(prefix, how)
    before = _files(train_dir)
    for path in (train_dir, prefix):
        config = app.EvalConfig(checkpoint_path=path, dataset_name="synthetic", batch_size=64)
        with pytest.raises(slim_nanguard.UnreadableCheckpointError) as raised:
            app.run_eval(config)
        assert raised.value.file == damaged
        (line,) = app.error_message(raised.value).splitlines()
        assert line.endswith(
            "Pass another checkpoint as --checkpoint_path (an older one of its directory), "
            "or restore this one from a copy."
        )
    assert _files(train_dir) == before


@pytest.mark.parametrize("how", ["data cut", "index garbled"])
def test_fine_tuning_from_it_names_the_file_and_writes_nothing(train_dir, tmp_path, how):
    """``--checkpoint_path`` of a new run names a damaged checkpoint: refused before training,
    and the new run's directory is not left behind."""
    prefix = f"{train_dir}/model.ckpt-6"
    damaged = _damage(prefix, how)
    config = _config(tmp_path / "tuned", checkpoint_path=prefix, max_number_of_steps=3)
    with pytest.raises(slim_nanguard.UnreadableCheckpointError) as raised:
        app.run_training(config)
    assert raised.value.file == damaged and "--checkpoint_path" in str(raised.value)
    assert not (tmp_path / "tuned").exists()


@pytest.mark.parametrize("how", ["data cut", "index garbled"])
def test_the_eval_command_says_it_in_one_line_and_exits_1(trained, tmp_path, how):
    """The issue's case: ``truncate -s ... model.ckpt-6.data-00000-of-00001`` (and a garbled
    index), then ``slim-nanguard-eval --checkpoint_path=<the directory>``."""
    shutil.copytree(trained, tmp_path / "run")
    damaged = _damage(f"{tmp_path}/run/model.ckpt-6", how)
    proc = _run(EVAL, f"--checkpoint_path={tmp_path}/run", "--dataset_name=synthetic")
    assert proc.returncode == 1, proc.stdout
    assert "Traceback" not in proc.stderr
    (line,) = _plain_stderr(proc)  # the user's lines: no TensorFlow noise
    assert f"checkpoint {tmp_path}/run/model.ckpt-6 cannot be read: " in line
    assert damaged.rsplit("/", 1)[1] in line and "--checkpoint_path" in line


def test_the_train_command_resumes_from_the_older_checkpoint(trained, tmp_path):
    shutil.copytree(trained, tmp_path / "run")
    damaged = _damage(f"{tmp_path}/run/model.ckpt-6", "data cut")
    proc = _run(
        TRAIN,
        f"--train_dir={tmp_path}/run",
        "--dataset_name=synthetic",
        "--max_number_of_steps=9",
        "--eval_split_name=",
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if "cannot be read" in line]
    assert damaged.rsplit("/", 1)[1] in line and f"{tmp_path}/run/model.ckpt-3" in line
    assert "at global step 9/9" in proc.stdout


def test_the_autopsy_replay_says_it_in_one_line_and_exits_1(tmp_path):
    """A bad step was recorded with its dump; then the run's newest checkpoint is cut short:
    ``slim-nanguard-autopsy --replay`` names it, and the report and dump stay as they were."""
    _train_with_an_autopsy(tmp_path, _Model("check_numerics", fault="log_of_zero"))
    damaged = _damage(tf.train.latest_checkpoint(str(tmp_path)), "data cut")
    before = _files(str(tmp_path))
    proc = _run_autopsy(str(tmp_path), "--step=2", "--replay")
    assert proc.returncode == 1, proc.stdout
    assert "Traceback" not in proc.stderr
    (line,) = _plain_stderr(proc)  # the user's lines: no TensorFlow noise
    assert damaged.rsplit("/", 1)[1] in line and "move model.ckpt-" in line
    assert "first non-finite value: model/log_norm (Log)" in proc.stdout  # the report still
    assert _files(str(tmp_path)) == before
