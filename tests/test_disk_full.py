"""A full disk ends a run as a stop does: the summary, the stop record if it fits, and one line
naming the newest intact checkpoint and what to do; a rerun after space is freed resumes.

The launcher's runs write to a real full disk: a small tmpfs mounted for the test (root only,
else skipped), filled with a file up to a few hundred KB. The library's run (any user) gets
the error TensorFlow raises on a full disk, taken from a write to /dev/full, from its saver's
third save.
"""

import json
import os
import pickle
import re
import subprocess
from unittest import mock

import pytest
import tensorflow as tf
from test_launcher import TRAIN
from test_launcher import _plain_stderr
from test_launcher import _run

import slim_nanguard
from slim_nanguard import app

import nanguard_testlib as lib

RUN = ("--max_number_of_steps={}", "--save_interval_steps=100", "--log_every_n_steps=100")


def _run_to(train_dir, steps):
    flags = [flag.format(steps) for flag in RUN]
    return _run(TRAIN, f"--train_dir={train_dir}", *flags, "--eval_split_name=")


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MB tmpfs of its own (mounted for the test, unmounted after)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)])
    if done.returncode:
        pytest.skip("this machine cannot mount a tmpfs")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def _fill(disk, leave_kb):
    """Fills `disk` up to `leave_kb` KB of free space; returns the file that does it."""
    filler = disk / "filler"
    stat = os.statvfs(disk)
    free_kb = stat.f_bavail * stat.f_frsize // 1024
    with open(filler, "wb") as f:
        f.write(b"\0" * (free_kb - leave_kb) * 1024)
    return filler


def _assert_one_line_naming_the_intact_checkpoint(proc, train_dir):
    """Exit status EXIT_DISK_FULL, no traceback, one plain line naming the newest checkpoint
    whose files all read; returns that checkpoint."""
    assert proc.returncode == app.EXIT_DISK_FULL == 75, proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = _plain_stderr(proc)
    assert "the disk is full (" in line and "No space left on device" in line, line
    named = line.split("the newest intact checkpoint is ")[1].split(". Free space")[0]
    assert named == slim_nanguard.latest_good_checkpoint(str(train_dir))
    assert named == tf.train.latest_checkpoint(str(train_dir))
    reader = tf.train.load_checkpoint(named)
    for name in reader.get_variable_to_shape_map():
        reader.get_tensor(name)  # every tensor reads: not a half-written checkpoint
    assert line.endswith("then run the same training again: it resumes from that checkpoint.")
    assert "Training stopped by a full disk at global step" in proc.stdout
    assert f"  checkpoint    {named}" in proc.stdout
    return named


@pytest.mark.parametrize("leave_kb", [1500, 300])
def test_a_full_disk_names_the_intact_checkpoint_and_a_rerun_resumes_from_it(small_disk, leave_kb):
    # 1500 KB: the session starts, trains, and a checkpoint's save runs out of space;
    # 300 KB: the graph.pbtxt of the session's start does not fit.
    train_dir = small_disk / "run"
    assert _run_to(train_dir, 200).returncode == 0
    filler = _fill(small_disk, leave_kb)
    full = _run_to(train_dir, 400)
    named = _assert_one_line_naming_the_intact_checkpoint(full, train_dir)
    step = int(named.rsplit("-", 1)[1])
    reached = int(re.search(r"at global step (\d+)/400\.", full.stdout).group(1))
    assert 200 <= step <= reached <= 400 and f"global step {reached};" in full.stderr
    # Every step that ran is counted, the one whose checkpoint did not fit too.
    assert f"  steps         {reached - 200} good steps in this run" in full.stdout
    stop = [e for e in slim_nanguard.read_events(str(train_dir)) if e["kind"] == "stop"][-1]
    assert (stop["reason"], stop["step"]) == ("disk_full", reached)  # the record had room
    filler.unlink()
    resumed = _run_to(train_dir, 400)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from {named}" in resumed.stderr
    assert f"{400 - step} good steps in this run" in resumed.stdout
    assert tf.train.latest_checkpoint(str(train_dir)).endswith("model.ckpt-400")


def test_a_disk_full_from_the_start_says_so_without_a_stop_record(small_disk):
    # Nothing fits: no checkpoint, no event record; the run still ends in one line.
    _fill(small_disk, 0)
    proc = _run_to(small_disk / "run", 100)
    assert proc.returncode == 75, proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = _plain_stderr(proc)
    assert "training stopped at global step 0 (no room for the stop record either)" in line
    assert "no checkpoint was saved" in line and line.endswith("it starts again.")
    assert "Training stopped by a full disk at global step 0/100." in proc.stdout


def _disk_full_error():
    """What TensorFlow raises when a write finds the disk full."""
    try:
        with tf.io.gfile.GFile("/dev/full", "w") as f:
            f.write("x")
    except tf.errors.OpError as err:
        return err
    pytest.skip("/dev/full does not fail writes here")


@lib.each_mode
def test_train_raises_disk_full_error_naming_the_last_checkpoint_saved(tmp_path, mode):
    error = _disk_full_error()
    assert isinstance(error, tf.errors.ResourceExhaustedError), error
    assert slim_nanguard._errors.is_disk_full(error)
    assert slim_nanguard._errors.is_disk_full(OSError(28, "No space left on device"))
    assert not slim_nanguard._errors.is_disk_full(OSError(13, "Permission denied"))
    save = tf.compat.v1.train.Saver.save
    saves = []

    def third_save_fails(saver, sess, path, *args, **kwargs):
        saves.append(path)
        if len(saves) == 3:
            raise error
        return save(saver, sess, path, *args, **kwargs)

    model = lib.build_model(nan_policy="skip", repeat=True, check_numerics=lib.MODES[mode])
    with mock.patch.object(tf.compat.v1.train.Saver, "save", third_save_fails):
        with pytest.raises(slim_nanguard.DiskFullError) as caught:
            with model.graph.as_default():
                slim_nanguard.train(
                    model.train_op,
                    str(tmp_path),
                    number_of_steps=20,
                    save_checkpoint_steps=5,
                    log_every_n_steps=0,
                )
    err = caught.value
    assert err.__cause__ is error
    assert err.checkpoint == str(tmp_path / "model.ckpt-5") and err.recorded
    assert (err.result.stop_reason, err.result.global_step) == ("disk_full", 10)
    assert err.result.steps == 10  # the step whose checkpoint did not fit ran, and counts
    copy = pickle.loads(pickle.dumps(err))  # e.g. to a parent process
    assert (type(copy), str(copy), copy.result, copy.recorded) == (
        slim_nanguard.DiskFullError,
        str(err),
        err.result,
        True,
    )
    assert str(err) == (
        "the disk is full (/dev/full; No space left on device): training stopped at global "
        f"step 10; the newest intact checkpoint is {tmp_path}/model.ckpt-5. Free space on the "
        f"disk of {tmp_path}, then run the same training again: it resumes from that checkpoint."
    )
    with open(tmp_path / "nanguard_events.jsonl") as f:
        stop = json.loads(f.readlines()[-1])
    assert (stop["kind"], stop["reason"], stop["step"]) == ("stop", "disk_full", 10)
    with model.graph.as_default():
        result = slim_nanguard.train(
            model.train_op, str(tmp_path), number_of_steps=20, log_every_n_steps=0
        )
    assert (result.stop_reason, result.steps) == ("step_limit", 15)  # resumed from step 5
