"""One verdict per step, whatever the timing.

The same short run, trained again and again, leaves the same record: the same bad steps,
causes, actions and spike figures, in hook mode as in check_numerics mode. What could make it
depend on timing is an op of a step that reads a variable the same step writes with no edge
between them: TensorFlow's executor runs such ops in whatever order the threads reach them. So
within one run of the train op (with the summaries, as a summary hook fetches them), every read
of a guard's variable is ordered with every write of it.
"""

import numpy as np
import tensorflow as tf

import slim_nanguard

import nanguard_testlib as lib

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
