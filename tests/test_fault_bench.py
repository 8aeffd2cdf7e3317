"""The faults bench (``slim-nanguard-benchmark --faults``): its scoring, its table, one run."""

from slim_nanguard.app import fault_bench


def _bad(verdict=None):
    autopsy = {"triage": {"verdict": verdict}} if verdict else {"bad_examples": []}
    return {"kind": "bad_step", "autopsy": autopsy}


def test_a_verdict_is_right_when_it_names_the_faults_cause_and_steps_without_one_do_not_count():
    records = [
        _bad("data"),
        _bad("state"),
        {"kind": "bad_step"},  # no autopsy (past autopsy_max_steps)
        _bad(),  # an autopsy without a triage
        {"kind": "rollback", "autopsy": {"triage": {"verdict": "data"}}},
        _bad("data"),
    ]
    assert fault_bench.score(records, "data") == (2, 3)
    assert fault_bench.score(records, "chance") == (0, 3)
    assert fault_bench.score([], "state") == (0, 0)


def test_the_table_has_a_row_a_fault_and_says_what_each_cell_holds():
    cell = dict(accuracy=0.9733, bad_steps=9, right=2, judged=3, gave_up=False)
    report = {
        "steps": 2000,
        "dataset": "digits",
        "policies": ["skip", "rollback"],
        "cells": {
            "": {"skip": {**cell, "bad_steps": 0}, "rollback": {**cell, "bad_steps": 0}},
            "nan_example:7": {"skip": cell, "rollback": {**cell, "judged": 0, "gave_up": True}},
        },
    }
    lines = fault_bench.format_fault_bench(report).splitlines()
    assert lines[2] == "| fault (its cause) | `skip` | `rollback` |"
    assert lines[4] == "| none (the reference) | 0.973, 0 bad | 0.973, 0 bad |"
    assert lines[5] == (
        "| `nan_example:7` (data) | 0.973, 9 bad, verdicts 2/3 data "
        "| 0.973, 9 bad, no verdict, gave up |"
    )


def test_one_fault_under_one_policy_trains_evaluates_and_counts_its_bad_step(tmp_path):
    report = fault_bench.run_fault_bench(
        str(tmp_path),
        faults=["transient_nan:5"],
        policies=["skip"],
        steps=12,
        dataset_name="synthetic",
        modes=["check_numerics", "hook"],
    )
    assert report["policies"] == ["skip", "skip (hook)"]
    for column, directory in [
        ("skip", "transient_nan_5-skip"),
        ("skip (hook)", "transient_nan_5-skip-hook"),
    ]:
        cell = report["cells"]["transient_nan:5"][column]
        assert (cell["bad_steps"], cell["gave_up"]) == (1, False)
        assert 0.0 <= cell["accuracy"] <= 1.0
        assert (tmp_path / directory / "checkpoint").exists()
