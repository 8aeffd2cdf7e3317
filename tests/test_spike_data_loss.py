"""What the spike test judges: the data loss, the total loss without the regularization losses
it adds (issue 33), found by walking back from the total through sums only.

And ``research/spike_false_alarms.py --part=converged --quick``, the bench of nets trained to
convergence, prints its table and a sentence that says what the table says.
"""

import os
import re
import sys

import numpy as np
import pytest
import tensorflow as tf
import tf_slim as slim

import slim_nanguard
from slim_nanguard import _ops

import nanguard_testlib as lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model(weight_decay=0.5):
    """A linear classifier with slim's weight decay: (cross-entropy, total loss)."""
    images = tf.constant(np.random.RandomState(0).normal(size=(8, 4)), tf.float32)
    labels = tf.constant([0, 1] * 4)
    logits = slim.fully_connected(
        images,
        2,
        activation_fn=None,
        weights_regularizer=slim.l2_regularizer(weight_decay),
        scope="fc",
    )
    cross_entropy = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    return cross_entropy, tf.compat.v1.losses.get_total_loss()


def test_the_total_loss_splits_into_the_data_loss_and_its_regularization():
    with tf.Graph().as_default():
        cross_entropy, total = _model()
        data, regularization = _ops.loss_terms(total)
        assert data == (cross_entropy,)
        assert regularization == tuple(tf.compat.v1.losses.get_regularization_losses())
        # Through the sum of the regularization losses too.
        summed = tf.identity(cross_entropy + tf.compat.v1.losses.get_regularization_loss())
        assert _ops.loss_terms(summed) == (data, regularization)


def test_a_scaled_or_absent_regularization_stays_in_the_loss():
    with tf.Graph().as_default():
        cross_entropy, total = _model()
        # Scaled on its way: no term of the loss, so the loss judged is the loss itself.
        scaled = 0.5 * total
        assert _ops.loss_terms(scaled) == ((scaled,), ())
        # A regularization loss the loss does not depend on is not taken out of it.
        assert _ops.loss_terms(cross_entropy) == ((cross_entropy,), ())
    with tf.Graph().as_default():
        cross_entropy, total = _model(weight_decay=0.0)  # slim adds no regularizer at 0
        assert _ops.loss_terms(total)[1] == ()


@pytest.mark.parametrize("check_numerics", [True, False])
def test_a_step_is_judged_on_its_data_loss_and_its_total_still_checked(check_numerics):
    """Weight decay most of the total loss: the statistics hold the cross-entropy, and a NaN
    total (the data loss finite) is still a non-finite bad step."""
    with tf.Graph().as_default() as graph:
        cross_entropy, total = _model(weight_decay=50.0)
        poison = tf.compat.v1.placeholder_with_default(0.0, [])
        train_op = slim_nanguard.create_train_op(
            total + poison,
            tf.compat.v1.train.GradientDescentOptimizer(1e-4),
            spike_policy="skip",
            check_numerics=check_numerics,
        )
        (history,) = [v for v in graph.get_collection("variables") if "history" in v.name]
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            lib.mark_judged(sess, train_op)
            expected, whole = sess.run([cross_entropy, total])
            sess.run(train_op)
            assert whole > 10 * expected
            np.testing.assert_allclose(sess.run(history)[0, 0], expected, rtol=1e-6)
            if check_numerics:
                with pytest.raises(tf.errors.InvalidArgumentError):
                    sess.run(train_op, {poison: np.nan})
            else:  # hook mode: the gate stays shut, the run returns
                sess.run(train_op, {poison: np.nan})
            assert sess.run(history)[1].tolist() == [0.0, 0.0]  # the NaN step wrote nothing


def test_the_quick_converged_bench_prints_its_table_and_a_true_sentence(tmp_path):
    sys.path.insert(0, os.path.join(REPO, "research"))
    import spike_false_alarms

    lines, cells = lib.run_table_script(
        "spike_false_alarms.py", "--part=converged", "--quick", f"--workdir={tmp_path / 'runs'}"
    )
    header, rows = cells[0], [dict(zip(cells[0], r)) for r in cells[1:]]
    assert tuple(header) == spike_false_alarms.CONVERGED_COLUMNS
    assert [(r["model"], r["seed"]) for r in rows] == [("lenet", "0"), ("cifarnet", "0")]
    alarms = 0
    for row in rows:
        assert int(row["steps judged"]) == 60 - spike_false_alarms.WARMUP_STEPS, row
        cell = row[header[3]]
        count = 0 if cell == "0" else int(cell.strip("*").split("**")[0].rstrip(":*"))
        listed = re.findall(r"(\d+): (-?[0-9.]+) / (-?[0-9.]+), ([a-z ]+)", cell)
        assert count == len(listed), row
        alarms += count
        for acc in (row["test accuracy unguarded"], row["guarded"]):
            assert 0.0 <= float(acc) <= 1.0, row
    judged = sum(int(r["steps judged"]) for r in rows)
    assert lines[-1] == (
        f"On 2 runs trained 60 steps (lenet, cifarnet; seeds 0; {judged} steps judged) the "
        f"spike guard at its defaults flagged {alarms} clean step{'' if alarms == 1 else 's'}."
    )


def test_the_quick_cluster_bench_reads_every_workers_steps_and_prints_a_true_sentence(tmp_path):
    """``--part=cluster --quick``: LeNet on a loopback cluster of 1 ps and 2 async workers
    (free 127.0.0.1 ports; the script kills each task by its PID past its timeout)."""
    sys.path.insert(0, os.path.join(REPO, "research"))
    import spike_false_alarms

    lines, cells = lib.run_table_script(
        "spike_false_alarms.py", "--part=cluster", "--quick", f"--workdir={tmp_path / 'runs'}"
    )
    header, rows = cells[0], [dict(zip(cells[0], r)) for r in cells[1:]]
    assert tuple(header) == spike_false_alarms.CLUSTER_COLUMNS
    assert [(r["layout"], r["net"], r["seed"]) for r in rows] == [("async 2 workers", "lenet", "0")]
    (row,) = rows
    counts = [int(c) for c in row["steps by worker"].split(" + ")]
    # Async, every step of either worker is one global step: 60, give or take a step under way.
    assert len(counts) == 2 and 60 <= sum(counts) <= 63, row
    judged = int(row["steps judged"])
    assert judged == sum(counts) - spike_false_alarms.WARMUP_STEPS, row
    cell = row[header[5]]
    count = 0 if cell == "0" else int(cell.strip("*").split("**")[0].rstrip(":*"))
    listed = re.findall(r"(\d+): (-?[0-9.]+) / (-?[0-9.]+), ([a-z ]+), worker ([01])", cell)
    assert count == len(listed), row
    for acc in (row["test accuracy unguarded"], row["guarded"]):
        assert 0.0 <= float(acc) <= 1.0, row
    # Both workers wrote their own record into the one training directory.
    run = tmp_path / "runs" / "cluster_lenet_async2_0_with"
    assert {r.get("task", 0) for r in slim_nanguard.read_events(str(run))} == {0, 1}
    assert lines[-1] == (
        f"On 1 run trained 60 global steps (lenet; async 2 workers; seeds 0; {judged} steps "
        f"judged) the spike guard at its defaults flagged {count} clean "
        f"step{'' if count == 1 else 's'}."
    )


def test_a_false_alarm_in_a_cluster_names_its_step_z_cause_and_worker():
    sys.path.insert(0, os.path.join(REPO, "research"))
    import spike_false_alarms

    record = {
        "step": 1234,
        "task": 2,
        "spike": {"z_loss": 7.3, "z_grad_norm": 2.5, "over": ["loss"], "regularization_terms": 4},
    }
    assert spike_false_alarms._alarms_cell([record], by_worker=True) == (
        "**1**: 1234: 7.3 / 2.5, data loss, worker 2"
    )
    assert spike_false_alarms._alarms_cell([record]) == "**1**: 1234: 7.3 / 2.5, data loss"
    assert spike_false_alarms._alarms_cell([]) == "0"
