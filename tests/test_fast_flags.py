"""A bad command line is answered at once: the launchers check their flags before TensorFlow.

A user types ``slim-nanguard-train --nan_policy=rolback``: absl's two lines and exit status 1
come before TensorFlow is imported (which takes seconds). The check reads a table of the
launchers' flags (``scripts/_flag_table.py``); a test keeps it equal to their definitions.
"""

import importlib.util
import pathlib
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
            "flag --nan_policy=rolback: value should be one of <raise|stop|skip|rollback>",
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
    assert "value should be one of <raise|stop|skip|rollback>" in proc.stderr


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
