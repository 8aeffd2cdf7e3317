"""A third reason to reject a step, added in one module (tests/toy_reasons.py) and nowhere else.

The reviewer's story of issue 27: `toy_reasons.LossCap` rejects a step whose loss is above a
fixed cap. Given to `create_train_op(reasons=[...])`, or to the launcher as
``--reasons=toy_reasons:loss_cap``, it shows in the gate (the step changes nothing, in both
modes), the record (its cause and figures), the log line (its sentence), TensorBoard (its
summary) and the launcher's summary, though no module of the package names it.
"""

import json
import logging
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import toy_reasons

import slim_nanguard

import nanguard_testlib as lib

REPO = pathlib.Path(__file__).resolve().parents[1]
CAPPED_AT = 6  # the batch whose features are x -1,000: a finite loss far above the cap


def _run(mode, steps, **create_kwargs):
    create_kwargs = {"nan_policy": "skip", "reasons": [toy_reasons.LossCap()]} | create_kwargs
    model = lib.build_model(
        optimizer="sgd",
        faults={CAPPED_AT: lib.SPIKE},
        check_numerics=lib.MODES[mode],
        **create_kwargs,
    )
    hooks = [slim_nanguard.nan_hook(model.train_op)] if mode == "hook" else []
    run = lib.run_monitored(
        model.train_op,
        hooks=hooks,
        feeds=[None] * steps,
        handle_numerics_errors=mode == "check_numerics",
    )
    return model, run


@lib.each_mode
def test_a_loss_above_the_cap_changes_nothing_and_says_why_in_its_own_words(mode, caplog):
    with caplog.at_level(logging.WARNING):
        model, run = _run(mode, steps=CAPPED_AT + 3)
    (event,) = run.events
    assert (event.step, event.cause, event.action) == (CAPPED_AT, "loss_cap", "skip")
    assert run.bad_step_changes == [[]]  # no weight, slot, global step or moving mean
    assert event.figures["cap"] == 50.0 and event.figures["loss"] > 50.0
    assert np.isfinite(event.loss) and event.culprits == ()
    # The record: the cause, and its figures under its name.
    record = event.to_json()
    assert record["cause"] == "loss_cap" and record["loss_cap"] == event.figures
    assert "spike" not in record
    # The log line: the reason's own sentence, not a spike's or a NaN's.
    (line,) = [r.getMessage() for r in caplog.records if "bad step" in r.getMessage()]
    assert line.startswith("Model diverging: a loss above its cap; all values finite.")
    assert "is above the cap 50, bad step 1 in a row" in line and "NaN" not in line
    guard = slim_nanguard.get_guard(model.train_op)
    assert dict(guard.state.rejected) == {"loss_cap": 1} and guard.state.spikes == 0
    assert int(run.final["global_step"]) == CAPPED_AT + 2


def test_check_numerics_modes_error_names_the_reason_when_nothing_catches_it():
    model = lib.build_model(
        optimizer="sgd", faults={0: lib.SPIKE}, reasons=[toy_reasons.LossCap(policy="stop")]
    )
    with tf.compat.v1.Session(graph=model.graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        with pytest.raises(tf.errors.InvalidArgumentError) as caught:
            sess.run(model.train_op)
    message = caught.value.message
    assert "a loss above its cap (every value finite)" in message
    assert "loss_cap_policy=stop" in message and "NaN" not in message
    assert slim_nanguard.is_numerics_error(caught.value)


def test_the_summary_shows_the_last_accepted_steps_value_and_takes_no_batch():
    model = lib.build_model(optimizer="sgd", reasons=[toy_reasons.LossCap()])
    with model.graph.as_default():
        (summary,) = [
            s
            for s in tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.SUMMARIES)
            if s.op.name.endswith("accepted_loss")
        ]
    with tf.compat.v1.Session(graph=model.graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        lib.mark_judged(sess, model.train_op)
        loss = sess.run(model.train_op)
        shown = [tf.compat.v1.Summary.FromString(sess.run(summary)) for _ in range(3)]
        step = sess.run(model.global_step)
    assert {v.tag for s in shown for v in s.value} == {"nanguard/accepted_loss"}
    assert all(s.value[0].simple_value == pytest.approx(loss) for s in shown)
    assert step == 1  # three reads of the summary trained nothing


def test_a_reason_with_the_spike_test_the_first_to_reject_names_the_cause():
    model, run = _run("hook", steps=CAPPED_AT + 2, spike_policy="skip", spike_warmup_steps=3)
    (event,) = run.events
    # The spike test comes first (`GuardConfig.all_reasons`), and it rejects the batch too.
    assert event.cause == "spike" and "spike" in event.to_json()
    guard = slim_nanguard.get_guard(model.train_op)
    assert dict(guard.state.rejected) == {"spike": 1}


@pytest.mark.parametrize(
    "reasons, message",
    [
        ([toy_reasons.LossCap(cap=-1.0)], "cap must be > 0"),
        ([toy_reasons.LossCap(policy="ignore")], "loss_cap_policy must be one of"),
        ([toy_reasons.LossCap(), toy_reasons.LossCap()], "two reasons are named 'loss_cap'"),
        (["loss_cap"], "reasons must be slim_nanguard.Reason objects"),
    ],
)
def test_a_bad_reason_is_refused_before_any_graph_is_built(reasons, message):
    with pytest.raises(ValueError, match=message):
        slim_nanguard.GuardConfig(reasons=reasons)


def test_the_launcher_takes_the_reason_by_name_and_counts_what_it_rejected(tmp_path):
    env = dict(
        os.environ,
        TF_CPP_MIN_LOG_LEVEL="2",
        PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]),
    )
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "train.py"),
            f"--train_dir={tmp_path}",
            "--max_number_of_steps=30",
            "--eval_split_name=",
            "--reasons=toy_reasons:loss_cap",
            "--inject_fault=spike_input:10",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "loss_caps     1 of the bad steps (loss_cap_policy=skip, cap=50)" in proc.stdout
    records = [json.loads(line) for line in (tmp_path / "nanguard_events.jsonl").open()]
    (bad,) = [r for r in records if r["kind"] == "bad_step"]
    assert (bad["step"], bad["cause"], bad["action"]) == (10, "loss_cap", "skip")
    assert bad["loss_cap"]["loss"] > 50


def test_the_launcher_names_a_reason_it_cannot_load_in_one_line(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "train.py"),
            f"--train_dir={tmp_path}",
            "--reasons=toy_reasons:no_such_reason",
        ],
        cwd=REPO,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(REPO / "tests")),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.startswith("train.py: error:")]
    assert lines == [
        "train.py: error: --reasons=toy_reasons:no_such_reason: module 'toy_reasons' has no "
        "'no_such_reason'."
    ], proc.stderr
