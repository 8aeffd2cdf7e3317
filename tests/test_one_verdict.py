"""One verdict per step, whatever the timing.

The same short run, trained again and again, leaves the same record: the same bad steps,
causes, actions and spike figures, in hook mode as in check_numerics mode. What could make it
depend on timing is an op of a step that reads a variable the same step writes with no edge
between them: TensorFlow's executor runs such ops in whatever order the threads reach them. So
within one run of the train op (with the summaries, as a summary hook fetches them), every read
of a guard's variable is ordered with every write of it.
"""

import os
import sys

import numpy as np
import pytest
import tensorflow as tf
import tf_slim as slim

import slim_nanguard

import nanguard_testlib as lib

sys.path.insert(0, os.path.join(lib.REPO, "research"))
import spike_traces  # noqa: E402

SPIKE_AT = 25  # after the warm-up of 20 accepted steps
REPEATS = 10


def _record(mode, logdir):
    model = lib.build_model(
        faults={SPIKE_AT: lib.SPIKE, SPIKE_AT + 2: "nan_loss"},
        nan_policy="skip",
        spike_policy="skip",
        check_numerics=lib.MODES[mode],
    )
    with model.graph.as_default():
        result = slim_nanguard.train(
            model.train_op,
            logdir,
            number_of_steps=SPIKE_AT + 4,
            save_checkpoint_steps=None,
            save_checkpoint_secs=None,
            save_summaries_steps=1,  # the summaries run with every step
            log_every_n_steps=0,
        )
    bad = [r for r in slim_nanguard.read_events(logdir) if r["kind"] == "bad_step"]
    steps = [(r["step"], r["cause"], r["action"]) for r in bad]
    figures = [sorted((r.get("spike") or {}).items()) for r in bad]
    return steps, figures, result.final_loss, result.global_step


def test_the_same_run_leaves_the_same_record_in_both_modes(tmp_path):
    records = {
        mode: [_record(mode, str(tmp_path / f"{mode}{i}")) for i in range(REPEATS)]
        for mode in sorted(lib.MODES)
    }
    first = records["check_numerics"][0]
    assert first[0] == [(SPIKE_AT, "spike", "skip"), (SPIKE_AT + 1, "non_finite", "skip")]
    for mode, runs in records.items():
        for number, run in enumerate(runs):
            assert run == first, (mode, number)


# Issue 33's run: a batch x10 inside the warm-up, another just after it (its z, 6.6, is near
# spike_sigma=6: any difference in what the step was judged against would flip the verdict).
X10_AT = (10, 22)
X10_STEPS = 40


def _x10_batches():
    """research/spike_traces.py's classification batches (32 examples of 64 features), `X10_AT`
    x10."""
    data, rng = spike_traces._classes(), np.random.RandomState(0)
    x, y = zip(*(data(step, rng) for step in range(X10_STEPS)))
    x = np.stack(x)
    x[list(X10_AT)] *= 10.0
    return x.astype(np.float32), np.stack(y)


def _x10_record(mode, loop, logdir):
    """The record of bad steps (step, cause, z rounded) of one run of the x10 batches, with
    summaries and checkpoints on wall-clock timers (they fire whenever the machine allows)."""
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(0)
        data = tf.data.Dataset.from_tensor_slices(_x10_batches())
        x, y = tf.compat.v1.data.make_one_shot_iterator(data).get_next()
        loss = spike_traces.model_loss(spike_traces.RUNS["warmup_spike_x10"], x, y, tf)
        train_op = slim_nanguard.create_train_op(
            loss,
            tf.compat.v1.train.AdamOptimizer(1e-3),
            check_numerics=lib.MODES[mode],
            nan_policy="skip",
            spike_policy="skip",
        )
        if loop == "train":
            slim_nanguard.train(
                train_op,
                logdir,
                number_of_steps=X10_STEPS,
                save_checkpoint_secs=0.01,
                save_summaries_secs=0.01,
                log_every_n_steps=0,
            )
        else:  # tf-slim's Supervisor: its summary thread runs beside the steps
            slim.learning.train(
                train_op,
                logdir,
                number_of_steps=X10_STEPS,
                train_step_fn=slim_nanguard.make_train_step(logdir),
                save_summaries_secs=0.01,
                save_interval_secs=0.01,
                saver=slim_nanguard.FiniteSaver(),
                log_every_n_steps=1000,
            )
    bad = [r for r in slim_nanguard.read_events(logdir) if r["kind"] == "bad_step"]
    return [
        (r["step"], r["cause"], round(r["spike"]["z_loss"], 3), round(r["spike"]["z_grad_norm"], 3))
        for r in bad
    ]


@pytest.mark.parametrize("loop, repeats", [("train", REPEATS), ("learning.train", 3)])
def test_a_x10_batch_after_the_warm_up_gets_one_verdict(loop, repeats, tmp_path):
    records = [
        (mode, _x10_record(mode, loop, str(tmp_path / f"{mode}{i}")))
        for i in range(repeats)
        for mode in sorted(lib.MODES)
    ]
    assert records[0][1] == [(X10_AT[1], "spike", 6.62, 4.645)]
    assert [record for _, record in records] == [records[0][1]] * len(records)


def _ops_run(fetches):
    """The ops a run of `fetches` may execute, and each one's ancestors (data and control)."""
    ancestors = {}

    def above(op):
        if op not in ancestors:
            found, stack = set(), [t.op for t in op.inputs] + list(op.control_inputs)
            while stack:
                one = stack.pop()
                if one not in found:
                    found.add(one)
                    stack.extend([t.op for t in one.inputs] + list(one.control_inputs))
            ancestors[op] = found
        return ancestors[op]

    ops = set()
    for fetch in fetches:
        ops |= above(fetch.op) | {fetch.op}
    return ops, above


def _variable_of(op):
    """The `VarHandleOp` whose resource `op` takes, or None."""
    for tensor in op.inputs:
        if tensor.dtype == tf.resource:
            source = tensor.op
            while source.type == "Identity":
                source = source.inputs[0].op
            if source.type == "VarHandleOp":
                return source
    return None


@lib.each_mode
def test_no_read_of_a_guard_variable_races_a_write_of_it_in_one_step(mode):
    model = lib.build_model(nan_policy="skip", spike_policy="skip", check_numerics=lib.MODES[mode])
    guard = slim_nanguard.get_guard(model.train_op)
    with model.graph.as_default():
        summaries = tf.compat.v1.summary.merge_all()
    fetches = [model.train_op, summaries] + ([guard.ok] if guard.ok is not None else [])
    ops, above = _ops_run(fetches)
    reads, writes = {}, {}
    for op in ops:
        variable = _variable_of(op)
        if variable is None or not variable.name.startswith(("nanguard", "nanguard_spike")):
            continue
        if op.type in ("ReadVariableOp", "VarIsInitializedOp"):
            reads.setdefault(variable.name, []).append(op)
        elif op.type.startswith(("Assign", "ResourceScatter")):
            writes.setdefault(variable.name, []).append(op)
    assert {"nanguard_spike/count", "nanguard/last_accepted_step"} <= writes.keys()
    unordered = [
        (name, read.name, write.name)
        for name, written in sorted(writes.items())
        for write in written
        for read in reads.get(name, [])
        if read not in above(write) and write not in above(read)
    ]
    assert not unordered


def test_summaries_run_with_a_step_show_the_step_accepted_before_it():
    """The summaries fetched with a step read the last accepted step before it, every time."""
    model = lib.build_model(nan_policy="skip", spike_policy="skip", check_numerics=True)
    with model.graph.as_default(), tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        summaries = tf.compat.v1.summary.merge_all()
        shown = []
        for _ in range(30):
            _, summary = sess.run([model.train_op, summaries])
            values = tf.compat.v1.Summary.FromString(summary).value
            shown.append({v.tag: v.simple_value for v in values}["nanguard/grad_norm"])
    assert shown[0] == 0.0  # before any accepted step
    assert np.all(np.asarray(shown[1:]) > 0)
