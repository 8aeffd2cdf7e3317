"""What a user reads on a handled bad step, with TensorFlow's C++ logging at its default level.

In check_numerics mode a bad step fails inside ``session.run``, and TensorFlow's runtime logs
the failing run's message ("Local rendezvous is aborting with status: ...") whether or not
the loop catches the error. These runs keep that logging at TensorFlow's default level
(``TF_CPP_MIN_LOG_LEVEL`` unset for the README's examples; 0 for the launcher, which would
otherwise set 3 for itself) and read every line on stdout and stderr: the guard's message is
there, it says the step was rejected, never that the policy was not applied, and a spike's
lines (its values are all finite) never say NaN.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest
from test_readme import README
from test_readme import readme_examples

REPO = pathlib.Path(__file__).resolve().parents[1]
TRAIN = REPO / "scripts" / "train.py"

# The README's examples whose train op is in check_numerics mode (the default).
CHECK_NUMERICS_EXAMPLES = ("train", "monitored_check_numerics", "learning_train")
# Shipped configs, cut short where their planted fault still occurs: check_numerics.cfg's two
# faults moved to batches 5 and 10; spike_skip.cfg's spike comes at batch 100, after warm-up.
CONFIGS = {
    "check_numerics": (
        "--max_number_of_steps=15",
        "--inject_fault=nan_input:5,nan_gradient:10",
    ),
    "spike_skip": ("--max_number_of_steps=105",),
}
REJECTED = "slim_nanguard rejected the step"
NOT_APPLIED = re.compile(r"not applied|nothing applied|reached you uncaught", re.I)


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return dict(env, PYTHONPATH=path, **extra)


def _lines(proc: subprocess.CompletedProcess) -> list:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return (proc.stdout + proc.stderr).splitlines()


def _assert_true_to_a_handled_step(lines: list) -> None:
    told = "\n".join(lines)
    assert REJECTED in told, "TensorFlow's line of the bad step is missing:\n" + told[-3000:]
    wrong = [line for line in lines if NOT_APPLIED.search(line)]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("name", CHECK_NUMERICS_EXAMPLES)
def test_a_readme_example_in_check_numerics_mode_says_only_what_happened(tmp_path, name):
    """The README's example skips batch 3; TensorFlow logs the check's message as it fails."""
    script = tmp_path / f"{name}.py"
    script.write_text(readme_examples(README.read_text())[name])
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=_env(),
    )
    lines = _lines(proc)
    _assert_true_to_a_handled_step(lines)
    # What the README's "Two modes" says a user sees is what TensorFlow logged.
    quoted = re.search(r"status:\s+INVALID_ARGUMENT: (.*?) \.\.\.`", README.read_text(), re.S)
    assert quoted, "README.md no longer quotes TensorFlow's line of a bad step"
    logged = [line for line in lines if "Local rendezvous is aborting with status" in line]
    assert " ".join(quoted.group(1).split()) in logged[0], logged


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_a_shipped_config_says_only_what_happened(tmp_path, config):
    """The launcher trains a shipped config in check_numerics mode through its bad steps."""
    proc = subprocess.run(
        [sys.executable, str(TRAIN), f"--flagfile={REPO / 'configs' / config}.cfg"]
        + [f"--train_dir={tmp_path / 'run'}", "--log_every_n_steps=0", *CONFIGS[config]],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env=_env(TF_CPP_MIN_LOG_LEVEL="0"),
    )
    lines = _lines(proc)
    _assert_true_to_a_handled_step(lines)
    if config == "spike_skip":
        spike = [line for line in lines if REJECTED in line or "spike" in line.lower()]
        assert any("a spike in the loss or the gradient norm" in line for line in spike)
        assert not [line for line in spike if "NaN" in line], "\n".join(spike)
