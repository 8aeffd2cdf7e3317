"""The launcher's cluster half: TF1 cluster flags (or ``TF_CONFIG``) to a checked `Cluster`.

A loopback cluster of 1 ps and 2 workers is three commands with the same cluster flags::

    slim-nanguard-train --train_dir=/tmp/c --ps_hosts=127.0.0.1:2222 \\
        --worker_hosts=127.0.0.1:2223,127.0.0.1:2224 --job_name=ps --task=0
    ... --job_name=worker --task=0      # the chief: checkpoints, summaries, evaluation
    ... --job_name=worker --task=1

What each task does (`run_ps` for a ps; `run_training(config, cluster)` for a worker)::

    ps:      start the gRPC server; serve until every worker said it is done; exit 0
             (a worker killed before it could: exit 1 once its port has refused
             connections for ps_timeout_secs, naming it)
    worker:  wait (within ps_timeout_secs) until every ps answers on its port
             start the server; build the graph under replica_device_setter
             (optionally SyncReplicasOptimizer); train with master = this server
             last: tell ps task 0 if this worker stopped or gave up, and every ps it is done

Errors in the flags are `LaunchError`s naming the flag and the value.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from typing import List, Optional, Tuple

import tensorflow as tf
from absl import logging as absl_logging

from slim_nanguard import StopReason
from slim_nanguard import cluster as guard_cluster
from slim_nanguard import storage
from slim_nanguard.app.config import LaunchError

# absl's logger itself: its module functions would configure Python's root logger in a
# script that is not run by absl's app.run (see slim_nanguard/_log.py).
logging = absl_logging.get_absl_logger()

JOBS = ("ps", "worker")

# The launcher's flags that go to `Cluster` (with --task, which TrainConfig has too).
CLUSTER_FLAGS = (
    "ps_hosts",
    "worker_hosts",
    "job_name",
    "sync_replicas",
    "replicas_to_aggregate",
    "ps_timeout_secs",
)


def _hosts(value, flag: str) -> Tuple[str, ...]:
    if isinstance(value, str):
        value = value.split(",")
    hosts = tuple(h.strip() for h in (value or ()) if h.strip())
    for host in hosts:
        name, _, port = host.rpartition(":")
        if not name or not port.isdigit() or not 0 < int(port) < 65536:
            raise LaunchError(
                f"{flag}: {host!r} is not HOST:PORT; give a comma-separated "
                "list such as 127.0.0.1:2222,127.0.0.1:2223."
            )
    if len(set(hosts)) != len(hosts):
        raise LaunchError(f"{flag}={','.join(hosts)} lists an address twice.")
    return hosts


@dataclasses.dataclass(frozen=True)
class Cluster:
    """One task of a ps/worker cluster.

    Attributes:
      ps_hosts: HOST:PORT of each ps task.
      worker_hosts: HOST:PORT of each worker task; worker 0 is the chief.
      job_name: ``ps`` or ``worker``.
      task: This task's index in its job.
      sync_replicas: Aggregate the workers' gradients with `SyncReplicasOptimizer`.
      replicas_to_aggregate: Gradients per synchronous step; None: one per worker (fewer gives
        backup workers).
      ps_timeout_secs: How long a task waits for a peer whose port does not answer: a worker
        for the ps tasks (at its start); a ps for a worker that has not said it is done and
        whose port stopped answering (killed), before it exits with status 1 naming it.
    """

    ps_hosts: Tuple[str, ...]
    worker_hosts: Tuple[str, ...]
    job_name: str
    task: int
    sync_replicas: bool = False
    replicas_to_aggregate: Optional[int] = None
    ps_timeout_secs: float = 60.0
    _state: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "ps_hosts", _hosts(self.ps_hosts, "--ps_hosts"))
        object.__setattr__(self, "worker_hosts", _hosts(self.worker_hosts, "--worker_hosts"))
        if not self.ps_hosts or not self.worker_hosts:
            missing = "--ps_hosts" if not self.ps_hosts else "--worker_hosts"
            raise LaunchError(
                f"{missing} is empty: a cluster needs at least one ps and "
                "one worker (HOST:PORT, comma-separated)."
            )
        if self.job_name not in JOBS:
            raise LaunchError(
                f"--job_name={self.job_name or ''} must be ps or worker when --ps_hosts and "
                "--worker_hosts are given."
            )
        hosts = self.ps_hosts if self.job_name == "ps" else self.worker_hosts
        if not isinstance(self.task, int) or not 0 <= self.task < len(hosts):
            raise LaunchError(
                f"--task={self.task} is out of range: --job_name={self.job_name} has "
                f"{len(hosts)} task{'s' if len(hosts) > 1 else ''} (0 to {len(hosts) - 1})."
            )
        workers = len(self.worker_hosts)
        if self.replicas_to_aggregate is not None and not (
            isinstance(self.replicas_to_aggregate, int)
            and 1 <= self.replicas_to_aggregate <= workers
        ):
            raise LaunchError(
                f"--replicas_to_aggregate={self.replicas_to_aggregate} must be between 1 and "
                f"the number of workers ({workers})."
            )

    @property
    def is_chief(self) -> bool:
        return self.job_name == "worker" and self.task == 0

    @property
    def spec(self) -> tf.train.ClusterSpec:
        return tf.train.ClusterSpec({"ps": list(self.ps_hosts), "worker": list(self.worker_hosts)})

    def aggregate(self) -> int:
        return self.replicas_to_aggregate or len(self.worker_hosts)

    def device_setter(self):
        return tf.compat.v1.train.replica_device_setter(
            cluster=self.spec, worker_device=f"/job:worker/task:{self.task}"
        )

    def session_config(self) -> tf.compat.v1.ConfigProto:
        return guard_cluster.session_config(self.job_name, self.task, timeout_secs=0)

    def start_server(self) -> tf.distribute.Server:
        return tf.distribute.Server(
            self.spec, job_name=self.job_name, task_index=self.task, start=True
        )

    # ------------------------------------------------------------- a worker's run
    def wrap_optimizer(self, optimizer, config=None):
        """`optimizer`, in a `SyncReplicasOptimizer` when ``sync_replicas``.

        Args:
          optimizer: The optimizer the flags chose.
          config: The `slim_nanguard.app.TrainConfig` (every setting works with sync replicas).
        """
        del config  # Every setting works with sync replicas (the learning-rate scale too).
        if not self.sync_replicas:
            return optimizer
        return tf.compat.v1.train.SyncReplicasOptimizer(
            optimizer,
            replicas_to_aggregate=self.aggregate(),
            total_num_replicas=len(self.worker_hosts),
        )

    def hooks(self, optimizer, train_dir: str) -> List[tf.compat.v1.train.SessionRunHook]:
        """This worker's cluster hooks (built after ``apply_gradients``).

        The cluster-stop hook; the chief's hook that carries out the others' rollback requests,
        or a non-chief's that sends its rollbacks to the chief; the sync-replicas hook.
        """
        hooks = [
            self._state.setdefault(
                "stop_hook", guard_cluster.ClusterStopHook(self.task, len(self.worker_hosts))
            )
        ]
        if self.is_chief:
            # With sync replicas, a restore resets the accumulators' step too.
            reset = optimizer.chief_init_op if self.sync_replicas else None
            hooks.append(guard_cluster.ChiefRollbackHook(storage.absolute(train_dir), reset))
        else:
            hooks.append(guard_cluster.RollbackRequestHook(self.task))
        if self.sync_replicas:
            hooks.append(optimizer.make_session_run_hook(is_chief=self.is_chief))
        return hooks

    def start(self, graph: tf.Graph) -> dict:
        """Starts this worker's server once the ps answers; returns `train`'s cluster args.

        A non-chief worker also waits (polling) for the chief to initialise the model.

        Raises:
          LaunchError: A ps does not answer within ``ps_timeout_secs``.
        """
        wait_for_ps(self)
        server = self._state["server"] = self.start_server()
        logging.info("slim_nanguard: %s", describe(self))
        if not self.is_chief:
            try:
                guard_cluster.wait_for_model(
                    graph,
                    server.target,
                    self.session_config(),
                    timeout_secs=max(self.ps_timeout_secs, 120),
                )
            except tf.errors.DeadlineExceededError as err:
                raise LaunchError(
                    f"--worker_hosts: the chief ({self.worker_hosts[0]}) did not initialise "
                    f"the model ({err.message}); start worker 0."
                ) from None
        return {
            "master": server.target,
            "config": self.session_config(),
            "task": self.task,
            "stop_grace_period_secs": 5,
        }

    def finish(self, result):
        """Tells the ps this worker is done (and to stop all, if it stopped or gave up).

        Args:
          result: The `TrainResult`, or None if training raised.

        Returns:
          `result`, with ``stop_reason`` ``cluster_stop`` when another worker stopped the
          cluster.
        """
        if self._state.get("finished") or self.job_name != "worker":
            return result  # once only: the ps counts one goodbye per worker
        self._state["finished"] = True
        server = self._state.get("server")
        if server is not None:
            target, job = server.target, "worker"
        else:  # It failed before it started its server: through ps 0's, once it answers.
            try:
                wait_for_ps(self)
            except LaunchError:
                return result  # no ps to tell
            target, job = f"grpc://{self.ps_hosts[0]}", "ps"
        stopped_here = result is None or result.stop_reason == StopReason.POLICY
        stopped = guard_cluster.finish(
            target,
            task=self.task,
            num_ps=len(self.ps_hosts),
            stop=stopped_here,
            job=job,
            num_workers=len(self.worker_hosts),
        )
        if (
            result is not None
            and stopped
            and not stopped_here
            and (result.stop_reason != StopReason.STEP_LIMIT)
        ):
            result = dataclasses.replace(result, stop_reason=StopReason.CLUSTER_STOP)
        return result


def from_flags(
    *,
    ps_hosts,
    worker_hosts,
    job_name: Optional[str],
    task: int,
    sync_replicas: bool,
    replicas_to_aggregate: Optional[int],
    tf_config: Optional[str],
    ps_timeout_secs: float = 60.0,
) -> Optional[Cluster]:
    """The cluster the flags (or else ``TF_CONFIG``) describe; None for a one-process run.

    ``TF_CONFIG`` is TensorFlow's JSON: ``{"cluster": {"ps": [...], "worker": [...]},
    "task": {"type": "worker", "index": 1}}``; flags given win over it.
    """
    if not (ps_hosts or worker_hosts) and tf_config:
        try:
            parsed = json.loads(tf_config)
            spec, who = parsed.get("cluster", {}), parsed.get("task", {})
            ps_hosts, worker_hosts = spec.get("ps", ()), spec.get("worker", ())
            job_name = job_name or who.get("type")
            task = int(who.get("index", task))
        except (ValueError, AttributeError, TypeError) as err:
            raise LaunchError(
                f"TF_CONFIG is not the JSON TensorFlow expects ({err}); unset it or fix it."
            ) from None
    if not (ps_hosts or worker_hosts):
        if job_name:
            raise LaunchError(
                f"--job_name={job_name} needs --ps_hosts and --worker_hosts (or TF_CONFIG)."
            )
        if sync_replicas:
            raise LaunchError(
                "--sync_replicas needs a cluster: --ps_hosts, "
                "--worker_hosts, --job_name and --task."
            )
        return None
    if not job_name:
        raise LaunchError(
            "--job_name is missing: with --ps_hosts and --worker_hosts, "
            "say --job_name=ps or --job_name=worker (and --task)."
        )
    return Cluster(
        ps_hosts=ps_hosts,
        worker_hosts=worker_hosts,
        job_name=job_name,
        task=task,
        sync_replicas=sync_replicas,
        replicas_to_aggregate=replicas_to_aggregate,
        ps_timeout_secs=ps_timeout_secs,
    )


def wait_for_ps(cluster: Cluster, poll_secs: float = 0.25) -> None:
    """Waits until every ps accepts a connection; LaunchError after ps_timeout_secs."""
    deadline = time.monotonic() + cluster.ps_timeout_secs
    for host in cluster.ps_hosts:
        name, _, port = host.rpartition(":")
        while True:
            try:
                with socket.create_connection((name.strip("[]"), int(port)), timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise LaunchError(
                        f"--ps_hosts: the ps at {host} did not answer within "
                        f"{cluster.ps_timeout_secs:g}s; start it first, or check the "
                        "address."
                    ) from None
                time.sleep(poll_secs)


def run_ps(cluster: Cluster) -> None:
    """Serves as a ps until every worker is done (each says so as its last step).

    Raises:
      LaunchError: A worker never said it is done and its port has refused
        connections for ``ps_timeout_secs`` (it was killed): named, with its address.
    """
    server = cluster.start_server()
    logging.info(
        "ps task %d serving at %s for %d workers",
        cluster.task,
        cluster.ps_hosts[cluster.task],
        len(cluster.worker_hosts),
    )
    gone = guard_cluster.serve_ps(
        server.target,
        task=cluster.task,
        worker_hosts=cluster.worker_hosts,
        timeout_secs=cluster.ps_timeout_secs,
    )
    if gone:
        names = ", ".join(f"{w} ({cluster.worker_hosts[w]})" for w in gone)
        one = len(gone) == 1
        raise LaunchError(
            f"ps task {cluster.task}: worker{'' if one else 's'} {names} never said "
            f"{'it was' if one else 'they were'} done and refused connections for "
            f"--ps_timeout_secs={cluster.ps_timeout_secs:g}s (killed?); every other worker is "
            f"done, so the ps exits. Check {'its log' if one else 'their logs'}."
        )
    logging.info("ps task %d: every worker is done; exiting", cluster.task)


def describe(cluster: Cluster) -> str:
    mode = (
        f"sync replicas, {cluster.aggregate()} of {len(cluster.worker_hosts)} gradients per step"
        if cluster.sync_replicas
        else "async"
    )
    return (
        f"{cluster.job_name} task {cluster.task}{' (chief)' if cluster.is_chief else ''} "
        f"of {len(cluster.ps_hosts)} ps + {len(cluster.worker_hosts)} workers, {mode}"
    )


__all__ = [
    "CLUSTER_FLAGS",
    "Cluster",
    "JOBS",
    "describe",
    "from_flags",
    "run_ps",
    "wait_for_ps",
]
