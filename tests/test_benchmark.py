"""The benchmark launcher runs end to end and reports every variant of every model.

It is a smoke test: a tiny setting (small batches, a shallow deep net, one short round) and no
assertion on any timing, which would only measure the machine the tests run on. The profile
(``--profile``) is checked on what does not depend on the machine: which nodes a step runs.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from slim_nanguard.app import benchmarking

import nanguard_testlib as lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "benchmark.py")


# Every model but MobileNet: its 20 graphs (28 layers with batch norm, each guarded) take
# about 35 s to build on 2 cores. The profile and the model test below build and step it.
QUICK_MODELS = tuple(name for name in benchmarking.MODELS if name != "mobilenet")


def _env():
    # The checkout first, so the script times the code under test, not an installed copy.
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path)


def _run(out, *flags):
    """Runs the launcher in a tiny setting with `flags`; returns its JSON output and stdout."""
    proc = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            *flags,
            f"--out={out}",
            "--batch_scale=0.1",
            "--deep_layers=3",
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


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("benchmark") / "quick.json"
    return _run(
        out,
        "--quick",
        f"--models={','.join(QUICK_MODELS)}",
        "--rounds=1",
        "--chunks=1",
        "--round_seconds=0.001",
    )


def test_every_model_and_variant_is_timed(report):
    data, _ = report
    timed = {(r["model"], r["variant"]) for r in data["results"]}
    expected = {(m, v) for m in QUICK_MODELS for v in benchmarking.VARIANTS}
    assert timed == expected
    for r in data["results"]:
        assert r["optimizer"] == "sgd"  # --quick times SGD only
        assert r["ms_per_step"]["median"] > 0
        assert r["ratio"]["min"] <= r["ratio"]["median"] <= r["ratio"]["max"]
        # CPU time beside wall time: what the step cost the machine, not only how long it took.
        assert r["cpu_ms_per_step"]["median"] > 0
        assert r["cpu_ratio"]["min"] <= r["cpu_ratio"]["median"] <= r["cpu_ratio"]["max"]
        assert r["step_peak_bytes"] > 0 and r["gradient_bytes"] > 0


def test_bad_steps_are_recovered_without_losing_progress_on_skip(report):
    data, _ = report
    kinds = {(b["model"], b["variant"]) for b in data["bad_steps"]}
    expected = {
        (m, f"nanguard_{mode}_{policy}")
        for m in QUICK_MODELS
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
    # Issue 27's targets, both modes, spike guard off and on: the MLP and the deep net, each
    # with its wall and CPU figure and a verdict; met only when both are within the limit.
    ratio_targets = [t for t in data["targets"] if "limit" in t]
    for model, limit in (("mlp", 1.05), ("deep", 1.10)):
        mine = [t for t in ratio_targets if t["model"] == model]
        assert {t["variant"] for t in mine} == set(benchmarking.OUR_MODES)
        for t in mine:
            assert t["limit"] == limit
            assert t["met"] == (t["measured"] <= limit and t["measured_cpu"] <= limit)
    assert "| model | opt | variant | target | wall | CPU | met |" in stdout
    rows = [line for line in stdout.splitlines() if "| <= " in line]
    assert len(rows) == len(data["targets"])
    assert all(row.endswith(("| met |", "| **missed** |")) for row in rows)


def test_the_default_run_times_the_targets_models_with_sgd():
    # Short by default: the two models the targets name, SGD, every variant.
    settings = benchmarking.Settings()
    assert settings.models == ("mlp", "deep") and settings.optimizers == ("sgd",)
    assert set(benchmarking.OUR_MODES) <= set(settings.all_variants())
    assert "batch 32" in benchmarking.model_description("deep", settings)


def test_each_model_shows_both_modes_side_by_side(report):
    data, stdout = report
    headings = " | ".join(heading for heading, _ in benchmarking.SIDE_BY_SIDE)
    assert f"| model | opt | unguarded ms/step, wall / CPU | {headings} |" in stdout
    for name in QUICK_MODELS:
        row = next(
            line
            for line in stdout.splitlines()
            if line.startswith(f"| {data['models'][name]['description']} | sgd |")
        )
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert len(cells) == 3 + len(benchmarking.SIDE_BY_SIDE)
        assert "–" not in cells[2:], row  # every column timed: the ms and each ratio
        assert all(" / " in cell for cell in cells[2:]), row  # wall / CPU in every cell


def test_the_real_slim_nets_build_and_train():
    # CifarNet and MobileNet v1 are written in app/models.py for the benchmark: each builds,
    # steps, and its loss falls on one repeated batch (MobileNet with its batch norm's
    # statistics updated).
    for name in ("cifarnet", "mobilenet"):
        spec = benchmarking.MODELS[name]
        settings = benchmarking.Settings(models=(name,), batch_scale=0.25)
        trainer = benchmarking.Trainer(
            spec, "adam", benchmarking.VARIANTS["baseline"], settings, "unused"
        )
        try:
            with trainer.graph.as_default():
                loss = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.LOSSES)[0]
                moving = [v for v in tf.compat.v1.global_variables() if "moving_mean" in v.name]
            first, moving_before = trainer.session.run([loss, moving])
            for _ in range(8):
                trainer.step()
            last, moving_after = trainer.session.run([loss, moving])
        finally:
            trainer.close()
        assert last < first, (name, first, last)
        assert bool(moving) == (name == "mobilenet")
        assert all(not np.array_equal(b, a) for b, a in zip(moving_before, moving_after))


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile") / "profile.json"
    markdown = out.with_suffix(".md")
    data, stdout = _run(
        out,
        "--profile",
        "--models=deep,mobilenet",
        f"--markdown={markdown}",
        "--profile_steps=2",
        "--profile_top=40",  # every op type, so that the counts below see them all
    )
    return data, stdout, markdown.read_text(encoding="utf-8")


def test_profile_counts_the_nodes_the_guard_adds(profile):
    data, stdout, markdown = profile
    assert [(p["model"], p["optimizer"]) for p in data["profiles"]] == [
        ("deep", "sgd"),
        ("mobilenet", "sgd"),
    ]
    for p in data["profiles"]:
        by_name = {v["variant"]: v for v in p["variants"]}
        assert set(by_name) == {"baseline", "baseline_mts", *benchmarking.OUR_MODES}
        for name in benchmarking.OUR_MODES:
            guarded = by_name[name]
            unguarded = by_name[guarded["reference"]]
            assert unguarded["nodes"] > 0 and unguarded["op_ms"] > 0
            # One L2Loss per stack of same-shape gradients, not one reduction per gradient:
            # fewer reductions than there are variables (issue 20), and no per-gradient Sum.
            variables = 2 * (3 + 1) if p["model"] == "deep" else 83
            assert guarded["nodes"] > unguarded["nodes"], (name, guarded)
            assert guarded["added_nodes"] > 0
            reductions = guarded["by_type"]["L2Loss"]["nodes"]
            assert 0 < reductions < variables, (name, guarded["by_type"])
            assert "nanguard" in guarded["by_scope"]
            # No per-gradient Sum: without the spike guard none at all; with it, at most the
            # three of its statistics and the three of its warm-up's outlier test (over its
            # window of 128 steps, whatever the model).
            sums = guarded["by_type"].get("Sum", {}).get("nodes", 0)
            assert sums <= (6 if name.endswith("_spike") else 0), (name, guarded["by_type"])
            assert 0 < guarded["added_ms"] < guarded["op_ms"]
        # The same graph in another loop runs the same nodes.
        assert by_name["baseline_mts"]["added_nodes"] == 0
        # The executor's graph holds at least the nodes a step runs (the rest are dead).
        for v in p["variants"]:
            assert v["graph_nodes"] >= v["nodes"] - 2 and v["threads"] >= 1, v
    for text in (stdout, markdown):
        assert "| variant | loop | nodes/step | added nodes |" in text
        assert "| variant | added nodes, by op type | nodes/step | µs/step |" in text
        assert "| ours: check_numerics mode, raise | `nanguard` |" in text


def test_startup_times_each_mode_against_tf_slims_op(tmp_path):
    # --startup's shape on the smallest net, one repeat: every variant of every model timed,
    # each guarded figure with its ratio to tf-slim's, and the table printed.
    # The tiny setting's flags _run adds are the step timings'; --startup ignores them.
    data, stdout = _run(
        tmp_path / "startup.json", "--startup", "--models=lenet", "--startup_repeats=1"
    )
    rows = data["startup"]
    assert [(r["model"], r["variant"]) for r in rows] == [
        ("lenet", v) for v in benchmarking.STARTUP_VARIANTS
    ]
    for r in rows:
        assert r["create_train_op_s"] > 0 and r["first_step_s"] > 0 and r["nodes"] > 0
        guarded = r["variant"] != "tf_slim"
        for key in ("create_train_op_s", "graph_s", "first_step_s", "first_step_cpu_s", "nodes"):
            assert (f"{key}_ratio" in r) == guarded
        if guarded:  # The guard adds ops; their count is the same in every repeat.
            assert r["nodes_ratio"]["min"] == r["nodes_ratio"]["max"] > 1
    assert "| model | variant | create_train_op s | whole graph s | first step s | nodes |" in (
        stdout
    )
    assert stdout.count("| lenet |") == len(benchmarking.STARTUP_VARIANTS)
