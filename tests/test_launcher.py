"""End-to-end tests of the launchers: scripts/train.py and scripts/eval.py run as subprocesses.

Each run costs a TensorFlow import (about 5 s), so the runs are few and each checks a lot:
the exit status, what stdout and stderr say, the checkpoint values and the event record.
"""

import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

import slim_nanguard
from slim_nanguard.app import cluster as app_cluster
from slim_nanguard.app import datasets

import nanguard_testlib as lib

REPO = pathlib.Path(__file__).resolve().parents[1]
TRAIN = REPO / "scripts" / "train.py"
EVAL = REPO / "scripts" / "eval.py"

# Lines TensorFlow's C++ runtime prints before any of ours, and absl log lines ("I1122 03:17:
# 16.680808 1404 file.py:12] ...").
_LOG_LINE = re.compile(r"^(WARNING: All log messages|To enable the following|[IWEF]\d{4} )")


def _env():
    # The checkout first: a script run by path would otherwise import whatever slim_nanguard
    # is installed (possibly an older, non-editable copy) rather than the code under test.
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=path)


def _run(script, *args):
    return subprocess.run(
        [sys.executable, str(script), *map(str, args)],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def _installed(command):
    """The console command `pip install .` installed beside this Python, or a failure saying
    how to install it (the README's test command installs the package first)."""
    beside = pathlib.Path(sys.executable).parent / command
    path = str(beside) if beside.exists() else shutil.which(command)
    assert path, f"{command} is not installed: run python3 -m pip install '.[test]' first"
    return path


def _run_installed(command, *args, cwd):
    return subprocess.run(
        [_installed(command), *map(str, args)],
        cwd=cwd,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
        capture_output=True,
        text=True,
        timeout=600,
    )


def _plain_stderr(proc):
    """The stderr lines that are neither TensorFlow's start-up noise nor absl log lines."""
    return [line for line in proc.stderr.splitlines() if line.strip() and not _LOG_LINE.match(line)]


def _assert_clean_failure(proc, *words):
    """Exit status 1, one or two plain lines naming `words`, no traceback."""
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = _plain_stderr(proc)
    assert 1 <= len(lines) <= 2, lines
    for word in words:
        assert word in "\n".join(lines), lines


def _assert_finite(checkpoint):
    assert checkpoint is not None
    assert slim_nanguard.non_finite_variables(checkpoint) == ()


def _events(train_dir, kind):
    return [e for e in slim_nanguard.read_events(str(train_dir)) if e["kind"] == kind]


def _accuracy(out):
    """The test accuracy of a run's summary (its evaluation line)."""
    return float(re.search(r"evaluation +test accuracy ([0-9.]+)", out).group(1))


def _tensor(checkpoint, name):
    return tf.train.load_checkpoint(checkpoint).get_tensor(name)


# ---------------------------------------------------------------------------------------------
# A clean run on the digits, resumed, fine-tuned from, evaluated.


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A clean 200-step run on the digits: (train_dir, completed process)."""
    train_dir = tmp_path_factory.mktemp("launcher") / "clean"
    proc = _run(
        TRAIN,
        f"--train_dir={train_dir}",
        "--max_number_of_steps=200",
        "--log_every_n_steps=50",
        "--save_summaries_steps=50",
    )
    return train_dir, proc


def test_clean_run_logs_progress_and_a_summary(trained):
    train_dir, proc = trained
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    progress = [line for line in proc.stderr.splitlines() if "step 150/200: loss" in line]
    assert progress and "steps/s" in progress[0] and "left" in progress[0]
    assert "bad steps 0 (skipped 0, rolled back 0)" in progress[0]
    out = proc.stdout
    assert "Training reached the step limit at global step 200/200." in out
    assert "bad steps     0 (skipped 0, rolled back 0)" in out
    assert f"checkpoint    {train_dir}/model.ckpt-200" in out
    assert f"event record  {train_dir}/nanguard_events.jsonl" in out
    accuracy = _accuracy(out)
    assert accuracy > 0.8
    _assert_finite(tf.train.latest_checkpoint(str(train_dir)))
    (stop,) = _events(train_dir, "stop")
    assert (stop["reason"], stop["step"]) == ("step_limit", 200)
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(train_dir))


def test_the_default_config_writes_a_graph_and_meta_graphs_sized_by_the_model(tmp_path):
    # The digits came into the graph as a constant: a 3.2 MB graph.pbtxt and a 967 KB .meta
    # per checkpoint. What is left is the model, its optimizer and the guard (347 KB and 136
    # KB; the same run unguarded writes a 284 KB graph.pbtxt): the savers and the start-up
    # check share one L2Loss a variable, a failed step's kinds are counted in chunks.
    proc = _run(
        TRAIN,
        "--flagfile=configs/default.cfg",
        f"--train_dir={tmp_path}",
        "--max_number_of_steps=3",
        "--eval_split_name=",
    )
    assert proc.returncode == 0, proc.stderr
    metas = sorted(tmp_path.glob("model.ckpt-*.meta"))
    assert [m.name for m in metas] == ["model.ckpt-0.meta", "model.ckpt-3.meta"]
    assert all(m.stat().st_size < 150_000 for m in metas), [m.stat().st_size for m in metas]
    graph = (tmp_path / "graph.pbtxt").read_text()
    assert len(graph) < 360_000, len(graph)
    # No constant holds data: the longest tensor in the graph is a few shapes' worth.
    contents = [line for line in graph.splitlines() if "tensor_content" in line]
    assert max(map(len, contents)) < 1_000


@pytest.fixture(scope="module")
def resumed(trained):
    train_dir, _ = trained
    return train_dir, _run(
        TRAIN,
        f"--train_dir={train_dir}",
        "--max_number_of_steps=300",
        "--log_every_n_steps=50",
        "--eval_split_name=",
    )


def test_resume_continues_from_the_step_reached(resumed):
    train_dir, proc = resumed
    assert proc.returncode == 0, proc.stderr
    assert "resuming from" in proc.stderr and "model.ckpt-200" in proc.stderr
    assert "at global step 300/300" in proc.stdout
    assert "100 good steps in this run" in proc.stdout
    assert "evaluation" not in proc.stdout
    assert tf.train.latest_checkpoint(str(train_dir)).endswith("model.ckpt-300")
    assert [e["step"] for e in _events(train_dir, "stop")] == [200, 300]


def test_fine_tune_loads_the_hidden_layers_and_trains_the_logits(resumed, tmp_path):
    source_dir, _ = resumed
    source = tf.train.latest_checkpoint(str(source_dir))
    train_dir = tmp_path / "finetune"
    proc = _run(
        TRAIN,
        f"--train_dir={train_dir}",
        f"--checkpoint_path={source_dir}",
        "--checkpoint_exclude_scopes=MLP/logits",
        "--trainable_scopes=MLP/logits",
        "--max_number_of_steps=30",
        "--eval_split_name=",
    )
    assert proc.returncode == 0, proc.stderr
    assert "Fine-tuning from" in proc.stderr
    tuned = tf.train.latest_checkpoint(str(train_dir))
    assert tuned.endswith("model.ckpt-30")
    for name in ("MLP/fc1/weights", "MLP/fc2/biases"):  # restored and frozen
        np.testing.assert_array_equal(_tensor(tuned, name), _tensor(source, name))
    # Excluded: initialised anew, then trained.
    assert _tensor(tuned, "MLP/logits/weights").shape == _tensor(source, "MLP/logits/weights").shape
    assert not np.allclose(
        _tensor(tuned, "MLP/logits/weights"), _tensor(source, "MLP/logits/weights")
    )


def test_fine_tune_from_a_checkpoint_of_another_model_fails_cleanly(resumed, tmp_path):
    source_dir, _ = resumed
    train_dir = tmp_path / "lenet"
    proc = _run(
        TRAIN,
        f"--train_dir={train_dir}",
        f"--checkpoint_path={source_dir}",
        "--model_name=lenet",
        "--train_image_size=8",
        "--max_number_of_steps=5",
    )
    _assert_clean_failure(
        proc,
        "--checkpoint_path",
        "does not match the model",
        "LeNet/conv1/weights",
        "--checkpoint_exclude_scopes",
    )
    assert not train_dir.exists()


def test_eval_prints_accuracy_and_loss(resumed):
    train_dir, _ = resumed
    proc = _run(EVAL, f"--checkpoint_path={train_dir}", "--dataset_split_name=test")
    assert proc.returncode == 0, proc.stderr
    accuracy = float(re.search(r"^eval/accuracy ([0-9.]+)$", proc.stdout, re.M).group(1))
    loss = float(re.search(r"^eval/loss ([0-9.]+)$", proc.stdout, re.M).group(1))
    assert accuracy > 0.8 and 0 < loss < 1
    assert "on 300 examples" in proc.stdout and "(global step 300)" in proc.stdout


def test_eval_refuses_a_checkpoint_with_nan(tmp_path):
    prefix = tmp_path / "nan" / "model.ckpt-7"
    with tf.Graph().as_default():
        tf.compat.v1.get_variable(
            "MLP/fc1/weights", initializer=np.full([64, 4], np.nan, np.float32)
        )
        tf.compat.v1.get_variable("MLP/fc1/biases", initializer=np.zeros([4], np.float32))
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            tf.compat.v1.train.Saver().save(session, str(prefix))
    proc = _run(EVAL, f"--checkpoint_path={prefix.parent}")
    _assert_clean_failure(
        proc, "NaN or Inf", "MLP/fc1/weights", "refusing to evaluate", str(prefix)
    )
    assert "eval/accuracy" not in proc.stdout


# ---------------------------------------------------------------------------------------------
# Each mode x policy, with an injected fault at batch 20 of 40.


@pytest.mark.parametrize(
    "mode, policy, fault",
    [
        ("check_numerics", "raise", "nan_loss"),
        ("check_numerics", "stop", "inf_input"),
        ("check_numerics", "skip", "nan_input"),
        ("check_numerics", "rollback", "nan_gradient"),
        ("hook", "raise", "nan_gradient"),
        ("hook", "stop", "nan_loss"),
        ("hook", "skip", "inf_input"),
        ("hook", "rollback", "nan_input"),
    ],
)
def test_mode_and_policy_with_an_injected_fault(tmp_path, mode, policy, fault):
    train_dir = tmp_path / "run"
    proc = _run(
        TRAIN,
        f"--train_dir={train_dir}",
        "--check_numerics" if lib.MODES[mode] else "--nocheck_numerics",
        f"--nan_policy={policy}",
        f"--inject_fault={fault}:20",
        "--dataset_name=synthetic",
        "--max_number_of_steps=40",
        "--save_interval_steps=10",
        "--log_every_n_steps=10",
        "--eval_split_name=",
    )
    assert "Traceback" not in proc.stderr
    (bad,) = _events(train_dir, "bad_step")
    assert (bad["step"], bad["mode"], bad["action"]) == (20, mode, policy)
    if fault == "nan_gradient":
        assert bad["loss_kind"] == "finite" and bad["culprits"]
    latest = tf.train.latest_checkpoint(str(train_dir))
    _assert_finite(latest)
    stop = _events(train_dir, "stop")[-1]

    if policy == "raise":
        _assert_clean_failure(
            proc, "NaN or Inf during training", "global step 20", "--nan_policy=skip"
        )
        assert stop["reason"] == "nan_error"
        assert latest.endswith("model.ckpt-20")
    elif policy == "stop":
        assert proc.returncode == 3, proc.stderr
        assert "stopped by --nan_policy=stop at a bad step at global step 20/40" in proc.stdout
        assert (stop["reason"], stop["step"]) == ("nan_policy_stop", 20)
    elif policy == "skip":
        assert proc.returncode == 0, proc.stderr
        assert "bad steps     1 (skipped 1, rolled back 0)" in proc.stdout
        assert "step 40/40: loss" in proc.stderr
        assert "bad steps 1 (skipped 1, rolled back 0)" in proc.stderr
        assert (stop["reason"], stop["step"]) == ("step_limit", 40)
    else:
        assert proc.returncode == 0, proc.stderr
        assert "bad steps     1 (skipped 0, rolled back 1)" in proc.stdout
        (rollback,) = _events(train_dir, "rollback")
        assert rollback["checkpoint"].endswith("model.ckpt-20")
        assert (stop["reason"], stop["step"]) == ("step_limit", 40)


# ---------------------------------------------------------------------------------------------
# A real divergence (SGD at learning rate 100, nothing injected) under skip, with escalation.

_DIVERGE_SKIP = ("--flagfile=configs/diverge_skip.cfg", "--max_number_of_steps=300")


def test_diverge_skip_escalates_to_a_rollback_and_learns(tmp_path):
    train_dir = tmp_path / "run"
    proc = _run(TRAIN, *_DIVERGE_SKIP, f"--train_dir={train_dir}", "--eval_split_name=test")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    out = proc.stdout
    assert "Training reached the step limit at global step 300/300." in out
    assert "bad steps     5 (skipped 4, rolled back 1)" in out
    assert "lr scale      0.002 (after rollbacks)" in out
    assert "applying persistent_nan_policy='rollback'" in proc.stderr
    # Four skips at the step where the weights overflowed, then the fifth bad step in a row
    # escalates to a rollback to the checkpoint of step 0.
    records = slim_nanguard.read_events(str(train_dir))
    assert [(r["kind"], r.get("action")) for r in records] == (
        [("bad_step", "skip")] * 4
        + [("bad_step", "rollback"), ("rollback", "rollback"), ("stop", None)]
    )
    assert len({r["step"] for r in records[:5]}) == 1
    assert records[4]["escalation"] == "5 bad steps in a row reached max_consecutive_bad_steps=5"
    assert records[5]["checkpoint"].endswith("model.ckpt-0")
    assert (records[-1]["reason"], records[-1]["step"]) == ("step_limit", 300)
    accuracy = _accuracy(out)
    assert accuracy > 0.9
    _assert_finite(tf.train.latest_checkpoint(str(train_dir)))
    # TensorBoard's learning_rate is the rate in effect: 100 at first, 0.2 after the rollback.
    rates = _scalars(train_dir, "learning_rate")
    assert rates[0][1] == pytest.approx(100.0)
    assert rates[-1][0] >= 200 and all(r == pytest.approx(0.2) for s, r in rates if s >= 100)

    # Resumed, the run carries the scale on and says so.
    proc = _run(
        TRAIN,
        *_DIVERGE_SKIP,
        f"--train_dir={train_dir}",
        "--max_number_of_steps=310",
        "--eval_split_name=",
    )
    assert proc.returncode == 0, proc.stderr
    assert "10 good steps in this run" in proc.stdout
    assert "lr scale      0.002 (after rollbacks)" in proc.stdout
    step, rate = _scalars(train_dir, "learning_rate")[-1]
    assert step > 300 and rate == pytest.approx(0.2)


def _scalars(train_dir, tag):
    """(step, value) of a TensorBoard scalar over every event file of `train_dir`, by step."""
    found = []
    for path in sorted(train_dir.glob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            found += [(event.step, v.simple_value) for v in event.summary.value if v.tag == tag]
    return sorted(found)


def test_diverge_skip_without_escalation_gives_up_cleanly(tmp_path):
    train_dir = tmp_path / "run"
    proc = _run(
        TRAIN,
        *_DIVERGE_SKIP,
        f"--train_dir={train_dir}",
        "--persistent_nan_policy=raise",
        "--eval_split_name=",
    )
    _assert_clean_failure(proc, "--persistent_nan_policy=rollback")
    assert "5 bad steps in a row reached max_consecutive_bad_steps=5" in _plain_stderr(proc)[0]
    records = slim_nanguard.read_events(str(train_dir))
    assert [r.get("action") for r in records] == ["skip"] * 4 + ["raise", None]
    assert records[-1]["reason"] == "nan_error"
    _assert_finite(tf.train.latest_checkpoint(str(train_dir)))


# ---------------------------------------------------------------------------------------------
# A planted spike (batch 100's images x 1,000, all finite): it derails the unguarded run, and
# --spike_policy=skip steps over it. 300 steps (not the config's 2000): the damage is done by
# step 101 and the guarded run is at about 97% by step 300 (98% at 2000).

_SPIKE_SKIP = ("--flagfile=configs/spike_skip.cfg", "--max_number_of_steps=300")


def test_spike_skip_steps_over_the_planted_spike_that_derails_the_unguarded_run(tmp_path):
    unguarded = _run(TRAIN, *_SPIKE_SKIP, f"--train_dir={tmp_path / 'off'}", "--spike_policy=none")
    assert unguarded.returncode == 0, unguarded.stderr
    assert "bad steps     0 (skipped 0, rolled back 0)" in unguarded.stdout
    assert "spikes" not in unguarded.stdout  # no spike test: the summary is as before
    assert _accuracy(unguarded.stdout) < 0.3  # chance is 0.1

    train_dir = tmp_path / "on"
    proc = _run(TRAIN, *_SPIKE_SKIP, f"--train_dir={train_dir}")
    assert proc.returncode == 0, proc.stderr
    assert "bad steps     1 (skipped 1, rolled back 0)" in proc.stdout
    assert "spikes        1 of the bad steps (--spike_policy=skip, --spike_sigma=6)" in proc.stdout
    assert _accuracy(proc.stdout) > 0.9
    (bad,) = _events(train_dir, "bad_step")
    assert (bad["step"], bad["cause"], bad["action"], bad["loss_kind"]) == (
        100,
        "spike",
        "skip",
        "finite",
    )
    spike = bad["spike"]
    assert spike["sigma"] == 6.0 and spike["accepted_steps"] == 100
    assert max(spike["z_loss"], spike["z_grad_norm"]) > 6.0
    assert "global step 100, loss" in proc.stderr and "spike:" in proc.stderr
    _assert_finite(tf.train.latest_checkpoint(str(train_dir)))


def test_every_flag_reaches_the_library_and_every_setting_has_a_flag():
    """The launcher copies flags into TrainConfig (and its GuardConfig, whose ``reasons`` the
    ``--reasons`` flag loads) by name, so a mismatch would be silent."""
    code = (
        "import dataclasses, json, runpy; from absl import flags; "
        f"runpy.run_path({str(TRAIN)!r}, run_name='launcher'); "
        "from slim_nanguard import app; from slim_nanguard.app import config; "
        "print(json.dumps([sorted(f.name for f in flags.FLAGS.flags_by_module_dict()"
        "['launcher']), sorted([f.name for f in dataclasses.fields(app.TrainConfig) "
        "if f.name != 'guard'] + list(app.GUARD_FLAGS) + [config.REASONS_FLAG])]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_env()
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    flag_names, fields = json.loads(proc.stdout.strip().splitlines()[-1])
    launcher_only = {"eval_split_name", "inject_fault"}  # eval's split; parsed into faults
    launcher_only |= set(app_cluster.CLUSTER_FLAGS)  # to app_cluster.Cluster instead
    assert set(flag_names) - launcher_only == set(fields) - {"inject_faults"}


# ---------------------------------------------------------------------------------------------
# Bad input: one or two lines naming the flag, file or value; exit 1; nothing in train_dir.


@pytest.mark.parametrize(
    "args, words",
    [
        (["--nan_policy=sometimes"], ["--nan_policy=sometimes", "raise|stop|skip|rollback"]),
        (["--max_number_of_steps=-5"], ["--max_number_of_steps=-5", ">= 0"]),
        (["--spike_policy=often"], ["--spike_policy=often", "none|raise|stop|skip|rollback"]),
        (["--spike_sigma=0"], ["--spike_sigma=0.0", "spike_sigma must be a number"]),
        (["--flagfile=configs/no_such.cfg"], ["configs/no_such.cfg"]),
    ],
)
def test_bad_flags_fail_at_parse_time(tmp_path, args, words):
    train_dir = tmp_path / "run"
    proc = _run(TRAIN, f"--train_dir={train_dir}", *args)
    _assert_clean_failure(proc, *words)
    assert not train_dir.exists()


def test_rollback_lr_factor_out_of_range_either_way_gets_the_librarys_one_rule(tmp_path):
    """Above 1 or at 0, the same rule and the same words as GuardConfig's."""
    with pytest.raises(ValueError) as library:
        slim_nanguard.GuardConfig(rollback_lr_factor=2.0)
    rule = str(library.value).split(";")[0]  # "rollback_lr_factor must be a number in (0, 1] ..."
    train_dir = tmp_path / "run"
    for value in ("2", "0"):
        proc = _run(TRAIN, f"--train_dir={train_dir}", f"--rollback_lr_factor={value}")
        _assert_clean_failure(proc, f"--rollback_lr_factor={float(value)}", rule)
        assert "range" not in proc.stderr
    assert not train_dir.exists()


def test_tfrecord_without_the_expected_keys(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    example = tf.train.Example(
        features=tf.train.Features(
            feature={
                "image/raw": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"\0" * 64])),
                datasets.LABEL_KEY: tf.train.Feature(int64_list=tf.train.Int64List(value=[3])),
            }
        )
    )
    with tf.io.TFRecordWriter(str(data / "toy_train.tfrecord")) as writer:
        writer.write(example.SerializeToString())
    train_dir = tmp_path / "run"
    proc = _run(
        TRAIN,
        f"--train_dir={train_dir}",
        "--dataset_name=tfrecord",
        f"--dataset_dir={data}",
        "--dataset_split_name=train",
    )
    _assert_clean_failure(proc, "toy_train.tfrecord", datasets.ENCODED_KEY)
    assert not train_dir.exists()


# ---------------------------------------------------------------------------------------------
# Help, start-up noise, and bad input as a user on a fresh machine meets them.


def _raw_run(script, *args):
    """A run with the user's environment: no TF_CPP_MIN_LOG_LEVEL, no filtering of stderr."""
    env = {k: v for k, v in _env().items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    return subprocess.run(
        [sys.executable, str(script), *map(str, args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _as_command(module, *args):
    """Runs a launcher as its console command does: its module imported, then ``run()``."""
    code = (
        f"import sys; sys.argv = ['/usr/bin/slim-nanguard-{module}'] + {list(args)!r}; "
        f"sys.path.insert(0, {str(REPO / 'scripts')!r}); "
        f"from scripts import {module}; {module}.run()"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_help_lists_the_flags_of_both_launchers():
    for proc, flags_shown in (
        (
            _as_command("train", "--helpshort"),
            ["--train_dir", "--nan_policy", "--max_number_of_steps", "--eval_split_name"],
        ),
        (_raw_run(TRAIN, "--help"), ["--train_dir", "--checkpoint_exclude_scopes"]),
        (
            _as_command("eval", "--help"),
            ["--checkpoint_path", "--dataset_split_name", "--max_num_batches"],
        ),
    ):
        assert "Traceback" not in proc.stderr, proc.stderr  # absl's help exits with 1
        for flag in flags_shown:
            assert f"  {flag}:" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.parametrize(
    "command, flags_shown",
    [
        ("autopsy", ["--step", "--replay", "--plot", "--timeout_secs"]),
        ("benchmark", ["--out", "--quick", "--models", "--variants"]),
        ("train", ["--train_dir", "--nan_policy"]),
        ("eval", ["--checkpoint_path"]),
    ],
)
def test_help_of_each_console_command_lists_its_own_flags_and_exits_0(command, flags_shown):
    proc = _as_command(command, "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr
    for flag in flags_shown:
        assert re.search(rf"^  --(\[no\])?{flag[2:]}:", proc.stdout, re.M), proc.stdout[-2000:]


@pytest.mark.parametrize(
    "args, words",
    [
        (["--nan_policy=sometimes"], ["--nan_policy=sometimes", "raise|stop|skip|rollback"]),
        (
            ["--train_dir={tmp}/td --max_number_of_steps=50"],
            ["--train_dir", "holds the flag '--max_number_of_steps=50'", "its own line"],
        ),
        (["--eval_split_name=validation"], ["--eval_split_name", "'validation'", "train, test"]),
    ],
)
def test_bad_input_prints_two_lines_at_most_and_no_tensorflow_noise(tmp_path, args, words):
    train_dir = tmp_path / "run"
    args = [a.format(tmp=tmp_path) for a in args]
    proc = _raw_run(TRAIN, f"--train_dir={train_dir}", *args)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and 1 <= len(lines) <= 2, proc.stderr
    for word in words:
        assert word in proc.stderr
    assert "--dataset_split_name" not in proc.stderr
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------
# A training directory is relocatable; a finished run trains nothing more.


def test_a_moved_or_copied_train_dir_is_resumed_and_evaluated_where_it_is(resumed, tmp_path):
    source, _ = resumed  # at step 300
    moved = tmp_path / "moved"
    shutil.copytree(source, tmp_path / "first")
    (tmp_path / "first").rename(moved)
    assert "model.ckpt-300" in (moved / "checkpoint").read_text()
    assert str(source) not in (moved / "checkpoint").read_text()  # relative paths
    # The finished config run again: resumed from the moved directory, nothing trained.
    proc = _run(
        TRAIN, f"--train_dir={moved}", "--max_number_of_steps=300", "--eval_split_name=test"
    )
    assert proc.returncode == 0, proc.stderr
    assert f"resuming from {moved}/model.ckpt-300" in proc.stderr
    assert "at global step 300/300" in proc.stdout and "0 good steps" in proc.stdout
    assert f"checkpoint    {moved}/model.ckpt-300" in proc.stdout
    assert "(global step 300)" in proc.stdout  # the evaluation of the moved checkpoint

    # A copy whose 'checkpoint' file names the source by absolute path (older writers):
    # it resumes and evaluates its own checkpoints, never the source's.
    copy = tmp_path / "copy"
    shutil.copytree(moved, copy)
    (copy / "checkpoint").write_text(
        f'model_checkpoint_path: "{moved}/model.ckpt-300"\n'
        f'all_model_checkpoint_paths: "{moved}/model.ckpt-300"\n'
    )
    proc = _run(TRAIN, f"--train_dir={copy}", "--max_number_of_steps=310", "--eval_split_name=")
    assert proc.returncode == 0, proc.stderr
    assert f"resuming from {copy}/model.ckpt-300" in proc.stderr
    assert "10 good steps in this run" in proc.stdout
    assert slim_nanguard.latest_good_checkpoint(str(moved)).endswith("moved/model.ckpt-300")
    proc = _run(EVAL, f"--checkpoint_path={copy}")
    assert proc.returncode == 0, proc.stderr
    assert f"checkpoint {copy}/model.ckpt-310 (global step 310)" in proc.stdout

    # --max_number_of_steps=0 in a new directory: initialised and saved, not trained.
    fresh = tmp_path / "fresh"
    proc = _run(TRAIN, f"--train_dir={fresh}", "--max_number_of_steps=0", "--eval_split_name=")
    assert proc.returncode == 0, proc.stderr
    assert "at global step 0/0" in proc.stdout and "0 good steps" in proc.stdout
    assert _checkpoints_step(fresh) == 0


def _checkpoints_step(train_dir):
    return int(_tensor(tf.train.latest_checkpoint(str(train_dir)), "global_step"))


def test_checkpoint_exclude_scopes_with_a_typo_is_an_error(resumed, tmp_path):
    source_dir, _ = resumed
    train_dir = tmp_path / "finetune"
    proc = _run(
        TRAIN,
        f"--train_dir={train_dir}",
        f"--checkpoint_path={source_dir}",
        "--checkpoint_exclude_scopes=MLP/logit,MLP/fc9",
        "--max_number_of_steps=5",
    )
    _assert_clean_failure(
        proc, "--checkpoint_exclude_scopes=MLP/fc9", "matches no variable", "MLP/logits"
    )
    assert not train_dir.exists()


# ---------------------------------------------------------------------------------------------
# The way out costs no work: raise keeps the good state, SIGTERM stops cleanly.


def test_raise_saves_the_good_state_of_the_bad_step(tmp_path):
    train_dir = tmp_path / "run"
    proc = _run(
        TRAIN,
        f"--train_dir={train_dir}",
        "--nan_policy=raise",
        "--inject_fault=nan_loss:40",
        "--dataset_name=synthetic",
        "--max_number_of_steps=100",
        "--eval_split_name=",
    )  # checkpoints every 600 s
    _assert_clean_failure(
        proc,
        "global step 40",
        f"The last good state (global step 40) is saved as {train_dir}/model.ckpt-40",
        "--nan_policy=skip",
    )
    latest = tf.train.latest_checkpoint(str(train_dir))
    assert latest.endswith("model.ckpt-40")
    _assert_finite(latest)
    stop = _events(train_dir, "stop")[-1]
    assert (stop["reason"], stop["checkpoint"]) == ("nan_error", latest)


def _signal_a_long_run(train_dir, signum, *args, installed=False):
    """Starts a long run on synthetic data, sends `signum` some steps in; ``(proc, out, err)``.

    With `installed`, the run is the installed ``slim-nanguard-train`` command."""
    command = [_installed("slim-nanguard-train")] if installed else [sys.executable, str(TRAIN)]
    proc = subprocess.Popen(
        [
            *command,
            f"--train_dir={train_dir}",
            "--dataset_name=synthetic",
            "--max_number_of_steps=10000000",
            "--log_every_n_steps=0",
            *args,
        ],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (train_dir / "model.ckpt-0.index").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        time.sleep(1.5)  # some steps in
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc, out, err


def test_sigterm_stops_like_ctrl_c_with_a_final_checkpoint(tmp_path):
    train_dir = tmp_path / "run"
    proc, out, err = _signal_a_long_run(train_dir, signal.SIGTERM, "--eval_split_name=")
    assert proc.returncode == 143, err
    assert "Traceback" not in err
    assert "Training terminated (SIGTERM), stopped cleanly at global step" in out
    latest = tf.train.latest_checkpoint(str(train_dir))
    _assert_finite(latest)
    stop = _events(train_dir, "stop")[-1]
    assert stop["reason"] == "terminated" and stop["step"] > 0
    assert latest.endswith(f"model.ckpt-{stop['step']}")


def test_ctrl_c_skips_the_evaluation_and_says_how_to_run_it(tmp_path):
    """Ctrl-C the installed ``slim-nanguard-train`` in a run that would evaluate on the test
    split: it stops cleanly (exit 130) and, instead of an evaluation of the whole split, prints
    one line with the command that evaluates its final checkpoint; that command works."""
    train_dir = tmp_path / "run"
    proc, out, err = _signal_a_long_run(train_dir, signal.SIGINT, installed=True)
    assert proc.returncode == 130, err
    assert "Training interrupted (Ctrl-C), stopped cleanly at global step" in out
    latest = tf.train.latest_checkpoint(str(train_dir))
    (line,) = [line for line in out.splitlines() if line.strip().startswith("evaluation")]
    skipped = "evaluation    skipped (interrupted); to evaluate the checkpoint: "
    assert line.strip().startswith(skipped), out
    command = shlex.split(line.split(skipped, 1)[1])
    assert command[:2] == ["slim-nanguard-eval", f"--checkpoint_path={latest}"], command
    evaluated = _run_installed(*command, cwd=REPO)  # the printed command, as a user runs it
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    assert "test accuracy" in evaluated.stdout and latest in evaluated.stdout


def test_a_tfrecord_image_that_fails_in_training_names_the_file_the_record_and_the_cause(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    good = tmp_path / "good.tfrecord"
    rng = np.random.RandomState(0)
    datasets.write_tfrecord(
        str(good), rng.randint(0, 255, [20, 8, 8], np.uint8), [i % 10 for i in range(20)]
    )
    broken = tf.train.Example(
        features=tf.train.Features(
            feature={
                datasets.ENCODED_KEY: tf.train.Feature(
                    bytes_list=tf.train.BytesList(value=[b"\x89PNG but not really"])
                ),
                datasets.LABEL_KEY: tf.train.Feature(int64_list=tf.train.Int64List(value=[3])),
            }
        )
    )
    path = data / "toy_train.tfrecord"
    with tf.io.TFRecordWriter(str(path)) as writer:
        for record in tf.compat.v1.io.tf_record_iterator(str(good)):
            writer.write(record)
        writer.write(broken.SerializeToString())
    train_dir = tmp_path / "run"
    proc = _run(
        TRAIN,
        f"--train_dir={train_dir}",
        "--dataset_name=tfrecord",
        f"--dataset_dir={data}",
        "--batch_size=7",
        "--max_number_of_steps=20",
        "--eval_split_name=",
    )
    _assert_clean_failure(
        proc,
        f"Record 20 of {path} (after 20 good records) does not decode",
        "re-run the conversion",
    )
    assert "Graph execution error" not in proc.stderr
    assert not train_dir.exists()


# ---------------------------------------------------------------------------------------------
# The installed console commands themselves (what `pip install .` puts on PATH), not the scripts
# run by path: their entry points, flag registration and start-up are what a user runs.


@pytest.mark.parametrize(
    "command, flags_shown",
    [
        ("slim-nanguard-autopsy", ["step", "replay", "plot"]),
        ("slim-nanguard-benchmark", ["out", "models", "variants"]),
    ],
)
def test_the_installed_autopsy_and_benchmark_commands_list_their_own_flags(
    tmp_path, command, flags_shown
):
    proc = _run_installed(command, "--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr
    for flag in flags_shown:
        assert re.search(rf"^  --(\[no\])?{flag}:", proc.stdout, re.M), proc.stdout[-2000:]


def test_the_installed_train_command_gives_one_rule_for_rollback_lr_factor(tmp_path):
    with pytest.raises(ValueError) as library:
        slim_nanguard.GuardConfig(rollback_lr_factor=0.0)
    rule = str(library.value).split(";")[0]
    for value in ("2", "0"):
        proc = _run_installed(
            "slim-nanguard-train",
            f"--train_dir={tmp_path / 'run'}",
            f"--rollback_lr_factor={value}",
            cwd=tmp_path,
        )
        _assert_clean_failure(proc, f"--rollback_lr_factor={float(value)}", rule)
    assert not (tmp_path / "run").exists()


def test_the_installed_train_command_resumes_past_a_damaged_state_file(tmp_path):
    """A crash left `checkpoint` garbled next to an intact checkpoint: the next run resumes
    from it, says so in one warning, and rewrites the state file."""
    train_dir = tmp_path / "run"
    flags = [f"--train_dir={train_dir}", "--eval_split_name="]
    proc = _run_installed("slim-nanguard-train", *flags, "--max_number_of_steps=20", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (train_dir / "checkpoint").write_text('model_checkpoint_path: "model.ckpt-2')  # cut short
    proc = _run_installed("slim-nanguard-train", *flags, "--max_number_of_steps=30", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "10 good steps" in proc.stdout, proc.stdout[-2000:]
    (warning,) = [line for line in proc.stderr.splitlines() if "cannot be parsed" in line]
    assert f"{train_dir}/checkpoint" in warning and f"{train_dir}/model.ckpt-20" in warning
    assert f"resuming from {train_dir}/model.ckpt-20" in proc.stderr
    state = tf.train.get_checkpoint_state(str(train_dir))
    assert state is not None and state.model_checkpoint_path.endswith("model.ckpt-30")
