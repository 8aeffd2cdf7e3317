"""The README's examples, run as a user copies them.

Each fenced ``python`` block of README.md whose first line is ``# example: <name>`` is a complete
script: it trains a tiny model on 8 batches, of which batch 3 holds a NaN, in one of the loops
the guard supports. Each runs here as written, in a fresh process from an empty directory, and
must end with exit status 0 and print that the bad step was skipped and the weights are finite.
The README stays a five-minute read (under 15 KB), and its quick start's test command is the
one CI runs.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
README = REPO / "README.md"

# What each example must print: the lines that show batch 3 was a bad step, skipped, and that
# the weights (or the checkpoint holding them) stayed finite.
SKIPPED = "bad steps 1, skipped 1"
CHECKPOINT_FINITE = "non-finite in the checkpoint: ()"
WEIGHTS_FINITE = "weights finite: True"
EXPECTED = {
    "train": (SKIPPED, CHECKPOINT_FINITE),
    "monitored_hook": ("batch 3: loss nan", SKIPPED, WEIGHTS_FINITE),
    "monitored_check_numerics": ("batch 3: loss nan, action skip", SKIPPED, WEIGHTS_FINITE),
    "training_train": (SKIPPED, CHECKPOINT_FINITE),
    "learning_train": (SKIPPED, CHECKPOINT_FINITE, "recorded in nanguard_events.jsonl: ['skip']"),
}


def readme_examples(text: str) -> dict:
    """The runnable blocks of `text`: ``{name: code}`` for each ```python block that opens with
    ``# example: <name>``."""
    blocks = re.findall(r"^```python\n# example: (\w+)\n(.*?)^```$", text, flags=re.S | re.M)
    names = [name for name, _ in blocks]
    assert len(names) == len(set(names)), f"README.md names an example twice: {names}"
    return {name: f"# example: {name}\n{code}" for name, code in blocks}


def test_the_readme_holds_one_example_per_loop():
    assert set(readme_examples(README.read_text())) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_example_runs_and_skips_the_bad_batch(tmp_path, name):
    code = readme_examples(README.read_text())[name]
    script = tmp_path / f"{name}.py"
    script.write_text(code)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=path),
    )
    assert proc.returncode == 0, f"README example {name!r} failed:\n{proc.stderr[-3000:]}"
    lines = proc.stdout.splitlines()
    for expected in EXPECTED[name]:
        assert expected in lines, f"README example {name!r} printed no {expected!r}:\n{proc.stdout}"


def test_the_readme_is_a_five_minute_read():
    size = len(README.read_bytes())
    assert size < 15_000, f"README.md is {size} bytes; move detail to docs/guide.md"


def test_the_quick_start_test_command_is_the_one_ci_runs():
    quick_start = README.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "python3 -m pip install '.[test]' && python3 -m pytest -q tests" in quick_start
    assert "slim-nanguard-train --flagfile=configs/default.cfg" in quick_start
    assert (REPO / "configs" / "default.cfg").is_file()
    ci = (REPO / ".ci" / "run").read_text()  # the same, listing the 25 slowest tests
    assert re.search(r"^python3 -m pytest -q --durations=25 tests$", ci, re.M)
    assert 'python3 -m pytest -q -m "not slow" tests' in quick_start  # the quick tier
