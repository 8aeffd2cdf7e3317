"""Replicated models and a loopback cluster for the distributed tests.

`build` makes the test MLP of `nanguard_testlib` as one worker of a between-graph replicated
cluster would: under `replica_device_setter` (when given a cluster), optionally with a
`SyncReplicasOptimizer`. Each run takes the next batch of a `tf.data` pipeline whose batch
index the test can fetch along with the train op, so it can tell which batches the train op
saw; ``fed=True`` uses plain placeholders instead (every run must feed them).

`Cluster` starts 1 ps and N workers as subprocesses on free 127.0.0.1 ports. Every process is
bounded by a timeout and ended by its own PID in `Cluster.close` (never by name).
"""

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional

import numpy as np
import tensorflow as tf
import tf_slim as slim

import slim_nanguard

import nanguard_testlib as lib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@dataclasses.dataclass
class Replica:
    graph: tf.Graph
    train_op: tf.Tensor
    loss: tf.Tensor
    index: Optional[tf.Tensor]
    placeholders: Dict[str, tf.Tensor]
    optimizer: object
    global_step: tf.Variable
    hooks: List


def build(
    *,
    cluster: Optional[Dict] = None,
    task: int = 0,
    sync_replicas: bool = False,
    replicas_to_aggregate: Optional[int] = None,
    fed: bool = False,
    faults: Optional[Dict[int, str]] = None,
    **create_kwargs,
) -> Replica:
    """The test MLP as worker `task` builds it; ``hooks`` holds the sync-replicas hook."""
    graph = tf.Graph()
    with (
        graph.as_default(),
        tf.compat.v1.device(
            tf.compat.v1.train.replica_device_setter(
                cluster=cluster, worker_device=f"/job:worker/task:{task}"
            )
            if cluster
            else None
        ),
    ):
        tf.compat.v1.set_random_seed(1)
        index = None
        placeholders = {}
        if fed:
            x = tf.compat.v1.placeholder(tf.float32, [None, lib.FEATURES], name="x")
            y = tf.compat.v1.placeholder(tf.int64, [None], name="y")
            offset = tf.compat.v1.placeholder(tf.float32, [], name="loss_offset")
            placeholders = {"x": x, "y": y, "offset": offset}
        else:
            data = tf.data.Dataset.from_tensor_slices(lib.batches(faults)).repeat()
            data = data.enumerate()
            index, (x, y, offset, _) = tf.compat.v1.data.make_one_shot_iterator(data).get_next()
        hidden = slim.fully_connected(x, 16, activation_fn=tf.nn.relu, scope="fc1")
        logits = slim.fully_connected(hidden, 2, activation_fn=None, scope="logits")
        loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(y, logits) + offset
        global_step = tf.compat.v1.train.get_or_create_global_step()
        optimizer = tf.compat.v1.train.GradientDescentOptimizer(0.1)
        hooks = []
        if sync_replicas:
            workers = len(cluster["worker"]) if cluster else (replicas_to_aggregate or 1)
            optimizer = tf.compat.v1.train.SyncReplicasOptimizer(
                optimizer,
                replicas_to_aggregate=replicas_to_aggregate or workers,
                total_num_replicas=workers,
            )
        train_op = slim_nanguard.create_train_op(loss, optimizer, **create_kwargs)
        if sync_replicas:
            hooks.append(optimizer.make_session_run_hook(is_chief=task == 0))
    return Replica(graph, train_op, loss, index, placeholders, optimizer, global_step, hooks)


def monitored_session(hooks, **kwargs) -> tf.compat.v1.train.MonitoredTrainingSession:
    """A chief's `MonitoredTrainingSession` that saves nothing (`kwargs` override)."""
    settings = dict(
        is_chief=True,
        hooks=hooks,
        save_checkpoint_secs=None,
        save_summaries_steps=None,
        save_summaries_secs=None,
        log_step_count_steps=None,
        # The chief's queue runner blocks in take_grad when the session ends; don't wait on it.
        stop_grace_period_secs=1,
    )
    settings.update(kwargs)
    return tf.compat.v1.train.MonitoredTrainingSession(**settings)


def raw_run(sess, fetches):
    """Runs `fetches` in the raw session of `sess`, so that no hook sees the run."""
    return sess.run_step_fn(lambda step_context: step_context.session.run(fetches))


def in_process_servers():
    """A ps and one worker server in this process: (cluster spec dict, ps server, worker server).

    TensorFlow cannot stop them; they end with the process (use one pair per test module).
    """
    ps, worker = free_ports(2)
    spec = {"ps": [f"127.0.0.1:{ps}"], "worker": [f"127.0.0.1:{worker}"]}
    cluster = tf.train.ClusterSpec(spec)
    ps_server = tf.distribute.Server(cluster, job_name="ps", task_index=0, start=True)
    worker_server = tf.distribute.Server(cluster, job_name="worker", task_index=0, start=True)
    return spec, ps_server, worker_server


def free_ports(count: int) -> List[int]:
    """`count` distinct ports free on 127.0.0.1 now (bound, read, released)."""
    sockets, ports = [], []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in sockets:
            s.close()
    return ports


class Cluster:
    """1 ps and `workers` workers of a script, each a subprocess with a timeout.

    Args:
      argv: The command every task runs (before its own cluster flags).
      workers: How many workers.
      timeout: Seconds after which `wait` gives up and `close` ends what is left.
      env: Extra environment variables.
    """

    def __init__(
        self,
        argv: List[str],
        workers: int = 2,
        timeout: float = 150,
        env: Optional[Dict[str, str]] = None,
    ):
        ports = free_ports(1 + workers)
        self.ps_hosts = f"127.0.0.1:{ports[0]}"
        self.worker_hosts = ",".join(f"127.0.0.1:{p}" for p in ports[1:])
        self.deadline = time.monotonic() + timeout
        self.procs: Dict[str, subprocess.Popen] = {}
        self._argv = argv
        self._env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([ROOT, HERE]),
            TF_CPP_MIN_LOG_LEVEL="2",
            **(env or {}),
        )
        self._workers = workers

    def flags(self, job: str, task: int) -> List[str]:
        return [
            f"--ps_hosts={self.ps_hosts}",
            f"--worker_hosts={self.worker_hosts}",
            f"--job_name={job}",
            f"--task={task}",
        ]

    def start(
        self, extra: Optional[Dict[str, List[str]]] = None, chief_last_secs: float = 0.0
    ) -> "Cluster":
        """Starts every task; `extra` maps ``"worker1"`` (etc.) to more arguments.

        `chief_last_secs` > 0 starts the chief (worker 0) last, that many seconds after the
        others: they are then waiting for its model when it starts, and start training with
        it, not a few seconds into its run (a story that needs worker 1 early in the run).
        """
        extra = extra or {}
        tasks = [("ps", 0)] + [("worker", i) for i in range(self._workers)]
        if chief_last_secs > 0:
            tasks = tasks[:1] + tasks[2:] + tasks[1:2]
        for job, task in tasks:
            if chief_last_secs > 0 and (job, task) == ("worker", 0):
                time.sleep(chief_last_secs)
            name = f"{job}{task}"
            self.procs[name] = subprocess.Popen(
                self._argv + self.flags(job, task) + extra.get(name, []),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=self._env,
            )
        return self

    def wait(self) -> Dict[str, "Exit"]:
        """Waits for every task until the deadline; returns each one's exit and output."""
        exits = {}
        for name, proc in self.procs.items():
            left = max(1.0, self.deadline - time.monotonic())
            try:
                out, err = proc.communicate(timeout=left)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
                err += f"\n[cluster_lib: {name} killed after the timeout]"
                exits[name] = Exit(None, out, err)
                continue
            exits[name] = Exit(proc.returncode, out, err)
        return exits

    def close(self) -> None:
        """Ends every task still running, each by its own PID."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


@dataclasses.dataclass
class Exit:
    code: Optional[int]
    stdout: str
    stderr: str

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.stderr.splitlines()[-lines:])


def read_json_lines(path: str) -> List[Dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def assert_checkpoints_finite(train_dir: str) -> int:
    """Asserts every checkpoint in `train_dir` is finite; returns how many there are."""
    paths = lib.all_checkpoints(train_dir)
    assert paths, f"no checkpoint in {train_dir}"
    for path in paths:
        assert slim_nanguard.non_finite_variables(path) == (), path
    return len(paths)


def python() -> List[str]:
    return [sys.executable]


def all_finite(values) -> bool:
    return all(np.all(np.isfinite(v)) for v in values)
