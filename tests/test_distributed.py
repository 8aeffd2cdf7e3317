"""The guard in a replicated graph, in one process: device placement and sync replicas.

A worker of a between-graph replicated cluster builds its graph under a
`replica_device_setter`; `SyncReplicasOptimizer` adds accumulators, a token queue and a chief
queue runner. These tests build exactly that graph and run it in one process (the real
multi-process clusters are in test_cluster.py).
"""

import time

import numpy as np
import pytest
import tensorflow as tf

import cluster_lib
import nanguard_testlib as lib
import slim_nanguard

MODES = {"check_numerics": True, "hook": False}
CLUSTER = {"ps": ["127.0.0.1:2222"], "worker": ["127.0.0.1:2223", "127.0.0.1:2224"]}


def _session(replica, check_numerics):
    hooks = list(replica.hooks)
    if not check_numerics:
        hooks.append(slim_nanguard.nan_hook(replica.train_op))
    return tf.compat.v1.train.MonitoredTrainingSession(
        is_chief=True, hooks=hooks, save_checkpoint_secs=None, save_summaries_steps=None,
        save_summaries_secs=None, log_step_count_steps=None,
        # The chief's queue runner blocks in take_grad when the session ends; don't wait on it.
        stop_grace_period_secs=1)


def _raw(sess, fetches):
    """Runs `fetches` in the raw session, so that no hook adds its own fetches."""
    return sess.run_step_fn(lambda step_context: step_context.session.run(fetches))


def _step(sess, replica, feed=None):
    """One run of the train op; returns (loss or None, batch index or None, raised)."""
    fetches = [replica.train_op] + ([replica.index] if replica.index is not None else [])
    try:
        values = sess.run(fetches, feed)
    except tf.errors.InvalidArgumentError as err:
        assert slim_nanguard.is_numerics_error(err), err
        return None, None, True
    return values[0], (values[1] if len(values) > 1 else None), False


def _wait_for_step(sess, replica, step, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _raw(sess, replica.global_step) >= step:
            return
        time.sleep(0.02)
    raise AssertionError(f"global_step did not reach {step} in {timeout}s")


def _feed(replica, seed, fault=None):
    x, y, _, _ = lib.batches(count=seed + 1)
    p = replica.placeholders
    return {p["x"]: x[seed], p["y"]: y[seed],
            p["offset"]: np.float32(np.nan if fault == "nan_loss" else 0.0)}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_guards_gradient_sums_stay_on_the_worker_that_made_them(mode):
    """replica_device_setter puts variables on the ps; the guard's own stays on worker 1."""
    replica = cluster_lib.build(cluster=CLUSTER, task=1, check_numerics=MODES[mode])
    guard = slim_nanguard.get_guard(replica.train_op)
    with replica.graph.as_default():
        assert all(v.device == "/job:ps/task:0" for v in tf.compat.v1.global_variables())
    ops = [op for op in replica.graph.get_operations()
           if op.name.startswith(guard.diagnostics.op.name)]
    assert ops and {op.device for op in ops} == {"/job:worker/task:1"}
