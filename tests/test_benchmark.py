"""The benchmark launcher runs end to end and reports every variant of every model.

It is a smoke test: a tiny setting (small batches, a shallow deep net, one short round) and no
assertion on any timing, which would only measure the machine the tests run on.
"""

import json
import os
import subprocess
import sys

import pytest

from slim_nanguard.app import benchmarking

import nanguard_testlib as lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "benchmark.py")


def _env():
    # The checkout first, so the script times the code under test, not an installed copy.
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("benchmark") / "quick.json"
    proc = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--quick",
            f"--out={out}",
            "--batch_scale=0.1",
            "--deep_layers=3",
            "--rounds=1",
            "--chunks=1",
            "--round_seconds=0.001",
            "--warmup_steps=1",
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out, encoding="utf-8") as f:
        return json.load(f), proc.stdout


def test_every_model_and_variant_is_timed(report):
    data, _ = report
    timed = {(r["model"], r["variant"]) for r in data["results"]}
    expected = {(m, v) for m in benchmarking.MODELS for v in benchmarking.VARIANTS}
    assert timed == expected
    for r in data["results"]:
        assert r["optimizer"] == "sgd"  # --quick times SGD only
        assert r["ms_per_step"]["median"] > 0
        assert r["ratio"]["min"] <= r["ratio"]["median"] <= r["ratio"]["max"]
        assert r["step_peak_bytes"] > 0 and r["gradient_bytes"] > 0


def test_bad_steps_are_recovered_without_losing_progress_on_skip(report):
    data, _ = report
    kinds = {(b["model"], b["variant"]) for b in data["bad_steps"]}
    expected = {
        (m, f"nanguard_{mode}_{policy}")
        for m in benchmarking.MODELS
        for mode in lib.MODES
        for policy in ("skip", "rollback")
    }
    assert kinds == expected
    for b in data["bad_steps"]:
        if b["policy"] == "skip":
            assert b["steps_lost"]["max"] == 0 and b["skips"] >= 1
        else:
            assert b["steps_lost"]["min"] == data["settings"]["rollback_distance"]
            assert b["rollbacks"] >= 1


def test_targets_and_tables_are_reported(report):
    data, stdout = report
    assert {t["variant"] for t in data["targets"]} == set(benchmarking.OUR_MODES)
    assert data["machine"]["tensorflow"]
    assert "| model | opt | variant |" in stdout
