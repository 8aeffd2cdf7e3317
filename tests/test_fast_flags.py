"""A bad command line is answered at once: the launchers check their flags before TensorFlow.

A user types ``slim-nanguard-train --nan_policy=rolback``: absl's two lines and exit status 1
come before TensorFlow is imported (which takes seconds). The check reads a table of the
launchers' flags (``scripts/_flag_table.py``); a test keeps it equal to their definitions.
"""

import importlib.util
import os
import pathlib
import signal
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"

# Runs a launcher as its command would, and reports its exit and what it imported.
_RUN = """
import runpy, sys
sys.argv = [{script!r}] + {args!r}
try:
    runpy.run_path({script!r}, run_name="__main__")
except SystemExit as exit_:
    print("EXIT", exit_.code, "tensorflow" in sys.modules)
"""


def _quiet_start():
    spec = importlib.util.spec_from_file_location("quiet_start", SCRIPTS / "_quiet_start.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    code = _RUN.format(script=str(SCRIPTS / f"{script}.py"), args=list(args))
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )


@pytest.mark.parametrize(
    "script, args, error",
    [
        (
            "train",
            ["--nan_policy=rolback"],
            "flag --nan_policy=rolback: value should be one of <raise|stop|skip|rollback|auto>",
        ),
        ("train", ["--train_dir=/tmp/x", "--batch_size=x"], "flag --batch_size=x: invalid"),
        ("train", ["--flagfile=configs/default.cfg", "--spike_policy=skpi"], "--spike_policy"),
        ("eval", ["--checkpoint_path=/tmp/x", "--chekpoint_path=y"], "'chekpoint_path'"),
        ("autopsy", ["--bogus"], "Unknown command line flag 'bogus'"),
        ("benchmark", ["--bogus=1"], "Unknown command line flag 'bogus'"),
    ],
)
def test_a_typo_is_answered_before_tensorflow_is_imported(script, args, error):
    proc = _run(script, *args)
    assert "EXIT 1 False" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("FATAL Flags parsing error: ") and error in lines[0], lines
    assert lines[1:] == ["Pass --helpshort or --helpfull to see help on flags."], lines


def test_the_console_command_checks_its_flags_before_tensorflow_too():
    """``slim-nanguard-train --nan_policy=rolback``: the command imports the launcher module."""
    code = (
        "import sys; sys.argv = ['/usr/bin/slim-nanguard-train', '--nan_policy=rolback']\n"
        "try:\n    from scripts import train\n"
        "except SystemExit as exit_:\n"
        "    print('EXIT', exit_.code, 'tensorflow' in sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert "EXIT 1 False" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert "value should be one of <raise|stop|skip|rollback|auto>" in proc.stderr


def test_every_shipped_config_passes_the_early_check():
    quiet = _quiet_start()
    for config in sorted((REPO / "configs").glob("*.cfg")):
        argv = [str(SCRIPTS / "train.py"), f"--flagfile={config}", "--max_number_of_steps=1"]
        quiet.check_flags_early(argv, "train", "__main__")  # exits on a flag it refuses


def test_the_flag_table_is_the_launchers_flags():
    """The table the early check reads is what the launchers define (run
    ``python3 scripts/_quiet_start.py`` to write it again after changing a flag)."""
    quiet = _quiet_start()
    assert quiet._flag_table() == quiet.launcher_flags()


# Runs a launcher as its command would, with TensorFlow's import made fatal: the process then
# ends at once with status 99 (or with `INTERRUPT`, a stand-in for Ctrl-C during the import).
_NO_TENSORFLOW = """
import os, runpy, sys

class NoTensorFlow:
    def find_spec(self, name, path=None, target=None):
        if name == "tensorflow" or name.startswith("tensorflow."):
            if {interrupt!r}:
                raise KeyboardInterrupt
            os.write(1, b"TENSORFLOW IMPORTED\\n")
            os._exit(99)

sys.meta_path.insert(0, NoTensorFlow())
sys.argv = [{argv0!r}] + {args!r}
{start}
"""


def _run_without_tensorflow(script, *args, interrupt=False, command=False):
    """Runs launcher `script` by its path, or (`command`) as its console command does."""
    path = str(SCRIPTS / f"{script}.py")
    argv0, start = (path, f"runpy.run_path({path!r}, run_name='__main__')")
    if command:
        argv0, start = (f"/usr/bin/slim-nanguard-{script}", f"from scripts import {script}")
    code = _NO_TENSORFLOW.format(argv0=argv0, args=list(args), interrupt=interrupt, start=start)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )


@pytest.mark.parametrize("script", ["train", "eval", "autopsy", "benchmark"])
@pytest.mark.parametrize("help_flag", ["--help", "--helpshort"])
def test_help_is_answered_before_tensorflow_is_imported(script, help_flag):
    proc = _run_without_tensorflow(script, help_flag)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr == ""
    assert "\nflags:\n" in proc.stdout and "  --verbosity" not in proc.stdout
    assert proc.stdout.rstrip().endswith("Try --helpfull to get a list of all flags.")


def test_the_help_names_no_choice_the_run_refuses_and_carries_no_markup():
    proc = _run_without_tensorflow("train", "--help")
    assert "--persistent_nan_policy: <raise|stop|rollback>:" in proc.stdout, proc.stdout
    assert "--nan_policy: <raise|stop|skip|rollback|auto>:" in proc.stdout
    assert "--spike_policy: <none|raise|stop|skip|rollback|auto>:" in proc.stdout
    assert "slim-nanguard-train --flagfile=configs/default.cfg" in proc.stdout
    assert "``" not in proc.stdout and "::\n" not in proc.stdout


def _unwritable_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """A directory this process cannot create files in (root ignores modes: /sys then)."""
    if os.geteuid() == 0:
        return pathlib.Path("/sys")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    return locked


@pytest.mark.parametrize(
    "args, error",
    [
        (
            ["--persistent_nan_policy=skip"],
            "FATAL Flags parsing error: flag --persistent_nan_policy=skip: value should be one "
            "of <raise|stop|rollback>",
        ),
        (
            ["--dataset_name=tfrecord"],
            "train.py: error: Dataset tfrecord needs dataset_dir (--dataset_dir): the directory",
        ),
        (
            ["--dataset_name=tfrecord", "--dataset_dir=/nonexistent/records"],
            "train.py: error: dataset_dir (--dataset_dir) /nonexistent/records does not exist: "
            "pass the directory that holds the TFRecord files.",
        ),
        (
            ["--inject_fault=nan_inptu:40"],
            "train.py: error: --inject_fault: fault 'nan_inptu:40' has the unknown kind "
            "'nan_inptu': choose one of nan_input, inf_input, spike_input,",
        ),
        (["--inject_fault=nan_input"], "train.py: error: --inject_fault: fault 'nan_input' is"),
        (
            ["--flagfile=/nonexistent/run.cfg"],
            "FATAL Flags parsing error: ERROR:: Unable to open flagfile: [Errno 2] No such file",
        ),
        (
            ["--spike_warmup_steps=1"],
            "FATAL Flags parsing error: flag --spike_warmup_steps=1: 1 is not an integer in the "
            "range [2, 128]",
        ),
        (["--max_rollbacks=0"], "FATAL Flags parsing error: flag --max_rollbacks=0: 0 is not"),
        # GuardConfig's own checks, beyond what a flag's bounds can say: the run's words.
        (
            ["--rollback_lr_factor=0"],
            "train.py: error: --rollback_lr_factor=0.0: rollback_lr_factor must be a number in "
            "(0, 1] (1 keeps the learning rate); got 0.0.",
        ),
        (
            ["--autopsy_timeout_secs=0"],
            "train.py: error: --autopsy_timeout_secs=0.0: autopsy_timeout_secs must be a number "
            "of seconds > 0; got 0.0.",
        ),
    ],
)
def test_a_bad_setting_is_answered_in_a_line_or_two_before_tensorflow(args, error, tmp_path):
    proc = _run_without_tensorflow("train", f"--train_dir={tmp_path / 'run'}", *args)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    assert 1 <= len(lines) <= 2 and lines[0].startswith(error), lines
    assert not (tmp_path / "run").exists()


def test_an_unwritable_train_dir_is_answered_before_tensorflow(tmp_path):
    for train_dir, error in (
        (
            _unwritable_dir(tmp_path) / "run",
            "is not writable ({}: Permission denied). Choose a directory you can write to.",
        ),
        (tmp_path / "a_file" / "run", "cannot be made: {} is a file."),
    ):
        (tmp_path / "a_file").touch()
        proc = _run_without_tensorflow("train", f"--train_dir={train_dir}")
        assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert proc.stderr.splitlines() == [
            f"train.py: error: train_dir (--train_dir) {train_dir} "
            + error.format(train_dir.parent)
            + ("" if "writable" in error else " Choose a directory for checkpoints and logs.")
        ]


def test_eval_answers_a_checkpoint_path_with_nothing_there_before_tensorflow(tmp_path):
    missing = tmp_path / "run" / "model.ckpt-5"
    proc = _run_without_tensorflow("eval", f"--checkpoint_path={missing}")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [
        f"eval.py: error: --checkpoint_path={missing} does not exist: pass a checkpoint prefix "
        "(train_dir/model.ckpt-N) or a training directory."
    ]
    # A prefix, one of its files and a directory are there: the run (TensorFlow) judges them.
    (tmp_path / "model.ckpt-5.index").touch()
    for there in ("model.ckpt-5", "model.ckpt-5.index", "model.ckpt-5.data-00000-of-00001", ""):
        proc = _run_without_tensorflow("eval", f"--checkpoint_path={tmp_path / there}")
        assert proc.returncode == 99, (there, proc.stderr[-2000:])


def test_a_good_command_line_gets_past_the_early_checks_to_tensorflow(tmp_path):
    """The checks refuse nothing good: a valid run goes on to import TensorFlow."""
    proc = _run_without_tensorflow(
        "train", f"--train_dir={tmp_path}", "--flagfile=configs/default.cfg"
    )
    assert proc.returncode == 99 and proc.stdout == "TENSORFLOW IMPORTED\n", proc.stderr[-2000:]


def test_ctrl_c_during_start_up_is_one_line():
    proc = _run_without_tensorflow("train", "--train_dir=/tmp/nanguard_runs/x", interrupt=True)
    assert proc.returncode == -signal.SIGINT, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [
        "train.py: interrupted by Ctrl-C (--verbosity=1 shows where)."
    ]


def test_the_console_command_answers_help_before_tensorflow():
    proc = _run_without_tensorflow("train", "--help", command=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "  --train_dir: " in proc.stdout and "  --persistent_nan_policy: " in proc.stdout


def test_the_guard_flags_bounds_and_choices_are_what_guardconfig_accepts():
    """The early check's bounds and choices of the guard's flags (from the table) agree with
    GuardConfig, which checks them in the run: each bound is accepted, one past it refused."""
    import dataclasses

    from slim_nanguard import app as nanguard_app

    def accepts(**field):
        try:
            dataclasses.replace(nanguard_app.DEFAULT_GUARD, spike_policy="skip", **field)
        except ValueError:
            return False
        return True

    table = _quiet_start()._flag_table()["train"]
    checked = 0
    for name in nanguard_app.GUARD_FLAGS:
        spec = table[name]
        if spec["type"] == "int":
            for key, outside in (("lower", -1), ("upper", +1)):
                if key in spec:
                    assert accepts(**{name: spec[key]}), (name, spec)
                    assert not accepts(**{name: spec[key] + outside}), (name, spec)
                    checked += 1
        if spec["type"] == "enum" and name != "spike_policy":
            assert [c for c in spec["choices"] if accepts(**{name: c})] == spec["choices"]
            assert not accepts(**{name: "skip"}) or "skip" in spec["choices"], name
            checked += 1
    assert checked >= 8


def test_a_parameter_server_is_not_asked_to_write_the_train_dir(tmp_path):
    """A ps writes nothing there: its --train_dir may be a path only the workers can write."""
    proc = _run_without_tensorflow(
        "train",
        f"--train_dir={_unwritable_dir(tmp_path) / 'run'}",
        "--job_name=ps",
        "--ps_hosts=127.0.0.1:1",
        "--worker_hosts=127.0.0.1:2",
    )
    assert proc.returncode == 99 and proc.stdout == "TENSORFLOW IMPORTED\n", proc.stderr[-2000:]


def test_a_cluster_worker_with_bad_input_answers_after_tensorflow_to_tell_the_ps(tmp_path):
    """A worker of a cluster that would fail its checks fails where it can still tell the ps (so
    the ps and the chief end too, tests/test_cluster.py); the same flags alone answer at once."""
    bad = ["--dataset_name=tfrecord", f"--train_dir={tmp_path / 'run'}"]
    alone = _run_without_tensorflow("train", *bad)
    assert alone.returncode == 1 and "--dataset_dir" in alone.stderr, alone.stderr[-2000:]
    cluster = ["--job_name=worker", "--ps_hosts=127.0.0.1:1", "--worker_hosts=127.0.0.1:2"]
    proc = _run_without_tensorflow("train", *bad, *cluster)
    assert proc.returncode == 99 and proc.stdout == "TENSORFLOW IMPORTED\n", proc.stderr[-2000:]
