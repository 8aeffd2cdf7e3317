"""The guard on TensorFlow's ps/worker cluster (between-graph replication): the public side.

`create_train_op` already gates a worker's writes to the ps variables (and, with
`SyncReplicasOptimizer`, the accumulators' and the chief's aggregated update), so a bad step
pushes nothing to the ps. What a cluster adds is coordination, built from these (the launcher,
``slim_nanguard.app.cluster``, shows them together)::

    every worker:   hooks = [ClusterStopHook(task, num_workers)]
    the chief:      hooks += [ChiefRollbackHook(train_dir, after_restore)]
    other workers:  hooks += [RollbackRequestHook(task)]
    session:        config=session_config("worker", task, timeout_secs=0)
    a non-chief:    wait_for_model(graph, target, config, timeout_secs) before training
    last of all:    finish(target, task=..., num_ps=..., stop=...)   # stopped, or gave up?
    a ps:           serve_ps(target, task=..., worker_hosts=..., timeout_secs=...)

A stop on one worker (its ``stop`` policy) stops every worker, whose `TrainResult` then says
``StopReason.CLUSTER_STOP``; a rollback on any worker is one restore on the ps, carried out
by the chief and counted by it against ``max_rollbacks``.
"""

from slim_nanguard._cluster import ChiefRollbackHook
from slim_nanguard._cluster import ClusterStopHook
from slim_nanguard._cluster import RollbackRequestHook
from slim_nanguard._cluster import finish
from slim_nanguard._cluster import serve_ps
from slim_nanguard._cluster import session_config
from slim_nanguard._cluster import wait_for_model

__all__ = [
    "ChiefRollbackHook",
    "ClusterStopHook",
    "RollbackRequestHook",
    "finish",
    "serve_ps",
    "session_config",
    "wait_for_model",
]
