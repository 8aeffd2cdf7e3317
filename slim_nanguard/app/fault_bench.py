"""A fault of each cause under each policy: what the triage said and what the run ended at.

    slim-nanguard-benchmark --faults          # the default config's run, a fault in each

Each row plants one fault (`slim_nanguard.app.faults`) in the default config's run (the MLP
on the digits, momentum 0.05, 2,000 steps, a checkpoint every 100 steps); the first row plants
none and is the reference. Each column trains it under one ``nan_policy`` in one mode
(check_numerics mode; ``(hook)``: hook mode). A cell gives the test accuracy at the end, the
bad steps, and how many of the triage's verdicts (in the bad steps' autopsies: the first
`GuardConfig.autopsy_max_steps` bad steps) name the cause the fault stands for: ``chance`` for
a transient, ``data`` for a bad example (NaN, or a mislabelled x1000 one, a spike: its column's
policy is then ``spike_policy``), ``state`` for a learning-rate jump. A run whose
policy gave up is evaluated at the checkpoint it left.

`score` and `format_fault_bench` are pure; `run_fault_bench` trains.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import slim_nanguard
from slim_nanguard.app import config as config_lib
from slim_nanguard.app import evaluate
from slim_nanguard.app import train

# Each fault, and the triage verdict that names its cause (None: the reference, no fault).
FAULTS: Dict[str, Optional[str]] = {
    "": None,
    "transient_nan:300": "chance",
    "nan_example:7": "data",
    "spike_example:7": "data",
    "lr_jump:300": "state",
}
POLICIES = ("skip", "rollback")

# The default config's run (configs/default.cfg), checkpointed often enough to roll back to.
_RUN = dict(
    model_name="mlp",
    dataset_name="digits",
    batch_size=32,
    optimizer="momentum",
    learning_rate=0.05,
    weight_decay=0.00004,
    seed=0,
    save_interval_steps=100,
    log_every_n_steps=0,
    save_summaries_steps=0,
    save_summaries_secs=0,
)


@dataclasses.dataclass(frozen=True)
class Cell:
    """One run: its test `accuracy`, its `bad_steps`, the triage verdicts that named the
    fault's cause (`right`) of those given (`judged`), and whether the policy `gave_up`."""

    accuracy: float
    bad_steps: int
    right: int
    judged: int
    gave_up: bool = False


def score(records: Sequence[Mapping[str, Any]], cause: Optional[str]) -> Tuple[int, int]:
    """``(right, judged)``: of the bad steps in `records` whose autopsy holds a triage
    verdict, how many name `cause`."""
    verdicts = [
        ((r.get("autopsy") or {}).get("triage") or {}).get("verdict")
        for r in records
        if r.get("kind") == "bad_step"
    ]
    verdicts = [v for v in verdicts if v is not None]
    return sum(v == cause for v in verdicts), len(verdicts)


def run_one(
    workdir: str,
    fault: str,
    policy: str,
    *,
    steps: int = 2000,
    dataset_name: str = "digits",
    mode: str = "check_numerics",
) -> Cell:
    """Trains the default config's run with `fault` (``""``: none) under `policy` in `mode`
    (``check_numerics`` or ``hook``) in a directory of `workdir`, and evaluates what it left
    on the test split."""
    name = f"{fault.replace(':', '_') or 'no_fault'}-{column(policy, mode).replace(' (', '-')}"
    name = name.rstrip(")")
    run = dict(_RUN, dataset_name=dataset_name, max_number_of_steps=steps)
    config = config_lib.TrainConfig.from_flags(
        train_dir=os.path.join(workdir, name),
        nan_policy=policy,
        # A spike fault is judged by the spike test, under the column's policy.
        spike_policy=policy if fault.startswith("spike_") else None,
        inject_faults=fault,
        check_numerics=mode == "check_numerics",
        **run,
    )
    gave_up = False
    try:
        train.run_training(config)
    except slim_nanguard.NanLossError:
        gave_up = True
    records = slim_nanguard.read_events(config.train_dir)  # A fresh directory: this run's.
    bad_steps = sum(r.get("kind") == "bad_step" for r in records)
    right, judged = score(records, FAULTS.get(fault))
    evaluated = evaluate.run_eval(
        config_lib.EvalConfig(
            checkpoint_path=config.train_dir,
            model_name=config.model_name,
            dataset_name=dataset_name,
            dataset_split_name="test",
        )
    )
    return Cell(evaluated.accuracy, bad_steps, right, judged, gave_up)


def column(policy: str, mode: str) -> str:
    """A column's name: the policy, and `` (hook)`` in hook mode."""
    return policy if mode == "check_numerics" else f"{policy} (hook)"


def run_fault_bench(
    workdir: str,
    *,
    faults: Sequence[str] = tuple(FAULTS),
    policies: Sequence[str] = POLICIES,
    steps: int = 2000,
    dataset_name: str = "digits",
    modes: Sequence[str] = ("check_numerics",),
) -> Dict[str, Any]:
    """Every fault under every policy in every mode (`run_one`); the report
    `format_fault_bench` prints, a column a policy and mode."""
    columns = [(p, m) for m in modes for p in policies]
    cells = {
        fault: {
            column(policy, mode): dataclasses.asdict(
                run_one(workdir, fault, policy, steps=steps, dataset_name=dataset_name, mode=mode)
            )
            for policy, mode in columns
        }
        for fault in faults
    }
    names = [column(p, m) for p, m in columns]
    return {"steps": steps, "dataset": dataset_name, "policies": names, "cells": cells}


def _cell(cell: Mapping[str, Any], cause: Optional[str]) -> str:
    text = f"{cell['accuracy']:.3f}, {cell['bad_steps']} bad"
    if cause is not None:
        judged = cell["judged"]
        text += f", verdicts {cell['right']}/{judged} {cause}" if judged else ", no verdict"
    return text + (", gave up" if cell["gave_up"] else "")


def format_fault_bench(report: Mapping[str, Any]) -> str:
    """The report as a Markdown table: a row a fault, a column a policy."""
    policies: List[str] = report["policies"]
    lines = [
        f"Faults under each policy: {report['dataset']}, {report['steps']} steps; a cell: test "
        "accuracy, bad steps, triage verdicts naming the fault's cause (right/given).",
        "",
        "| fault (its cause) | " + " | ".join(f"`{p}`" for p in policies) + " |",
        "| --- |" + " --- |" * len(policies),
    ]
    for fault, row in report["cells"].items():
        cause = FAULTS.get(fault)
        name = f"`{fault}` ({cause})" if fault else "none (the reference)"
        lines.append(f"| {name} | " + " | ".join(_cell(row[p], cause) for p in policies) + " |")
    return "\n".join(lines)
