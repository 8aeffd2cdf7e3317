"""Real loopback clusters: 1 ps and 2 workers, each its own process, started by the launcher.

Every cluster runs on free 127.0.0.1 ports found at run time; every process is bounded by a
timeout and ended by its own PID (`cluster_lib.Cluster`). The faults are NaN losses, so what
the tests assert holds on any CPU kernel: nothing non-finite reaches the ps (every checkpoint
the chief wrote is finite), worker 1's records name it and say what the bad step was, and
every process exits with the status its role and the policy say.
"""

import dataclasses
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

import slim_nanguard
from slim_nanguard import _cluster
from slim_nanguard import _recorders
from slim_nanguard import app
from slim_nanguard.app import cluster as app_cluster

import cluster_lib

REPO = pathlib.Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "scripts" / "train.py")
MODES = {"check_numerics": "--check_numerics", "hook": "--nocheck_numerics"}
_LOG_LINE = re.compile(r"^(WARNING: All log messages|To enable the following|[IWEF]\d{4} )")


def _command(train_dir, *flags):
    return [
        sys.executable,
        TRAIN,
        f"--train_dir={train_dir}",
        "--save_interval_steps=20",
        "--log_every_n_steps=0",
        "--eval_split_name=",
        "--save_summaries_steps=0",
        "--save_summaries_secs=0",
        *flags,
    ]


def _run_cluster(train_dir, flags, worker1=(), chief_last_secs=0.0):
    with cluster_lib.Cluster(_command(train_dir, *flags), workers=2, timeout=170) as cluster:
        cluster.start({"worker1": list(worker1)}, chief_last_secs=chief_last_secs)
        exits = cluster.wait()
    return exits


def _explain(exits, lines=15):
    return "\n".join(f"--- {name} exit {e.code}\n{e.tail(lines)}" for name, e in exits.items())


def _bad_steps(train_dir):
    return [r for r in slim_nanguard.read_events(train_dir) if r["kind"] == "bad_step"]


def _stops(train_dir):
    """Each task's stop record: its reason, and the worker that stopped it (or None)."""
    return {
        r["task"]: (r["reason"], r.get("stopped_by"))
        for r in slim_nanguard.read_events(train_dir)
        if r["kind"] == "stop"
    }


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync_replicas"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_nan_on_worker_1_reaches_no_ps_variable_and_both_workers_finish(tmp_path, mode, sync):
    """Worker 1 skips 4 bad batches; the cluster trains on to the step limit."""
    flags = [MODES[mode], "--max_number_of_steps=80", "--nan_policy=skip"]
    if sync:
        flags.append("--sync_replicas")
    exits = _run_cluster(tmp_path, flags, worker1=["--inject_fault=nan_loss:3-6"])

    assert [e.code for e in exits.values()] == [0, 0, 0], _explain(exits)
    # StopAtStepHook stops a worker after a run whose global step (read in the run, before the
    # other worker's increments) reaches the limit. Async, when the global step gets there each
    # worker may have a step under way and, after a stale read, one more: 80 to 83.
    last = "8[0-3]" if not sync else "8[01]"
    for name in ("worker0", "worker1"):
        assert re.search(rf"reached the step limit at global step {last}/80", exits[name].stdout), (
            exits[name].stdout
        )
    assert cluster_lib.assert_checkpoints_finite(tmp_path) >= 2
    assert int(slim_nanguard.latest_good_checkpoint(str(tmp_path)).rsplit("-", 1)[1]) >= 80
    # Each record of a bad step is worker 1's own: its NaN loss, not the chief's sums (which
    # overwrote them when the sums lived on the ps).
    bad = _bad_steps(tmp_path)
    # On failure: the records' batches and steps, and what each worker printed.
    assert len(bad) == 4 and {r["task"] for r in bad} == {1}, (
        [(r["task"], r["step"], r.get("consecutive"), r.get("time")) for r in bad],
        _explain(exits, lines=60),
    )
    assert all(
        r["loss_kind"] == "nan"
        and r["culprits"] == []
        and r["action"] == "skip"
        and 0 <= r["step"] <= 81
        and r["mode"] == mode
        for r in bad
    ), bad
    stops = [r for r in slim_nanguard.read_events(tmp_path) if r["kind"] == "stop"]
    assert sorted((r["task"], r["reason"]) for r in stops) == [(0, "step_limit"), (1, "step_limit")]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_auto_on_worker_1_records_its_triage_with_its_task_and_skips_a_bad_example(tmp_path, mode):
    """nan_policy="auto" on a cluster: worker 1's bad example is triaged on its own batch and
    weights (the ps's), recorded with its task, skipped and quarantined in worker 1's own file;
    the cluster ends at its limit."""
    # 200 steps: each worker trains about 100 batches of 32, over two epochs of the 1,497
    # digits, so example 5 comes to worker 1 at least once wherever its shuffle puts it.
    flags = [MODES[mode], "--max_number_of_steps=200", "--nan_policy=auto"]
    exits = _run_cluster(tmp_path, flags, worker1=["--inject_fault=nan_example:5"])

    assert [e.code for e in exits.values()] == [0, 0, 0], _explain(exits)
    bad = _bad_steps(tmp_path)
    assert bad, _explain(exits)
    told = [(r["task"], r["autopsy"]["triage"]["verdict"], r["action"]) for r in bad]
    assert told == [(1, "data", "skip")], told  # Quarantined: worker 1 meets it once only.
    (held,) = slim_nanguard.quarantine.read(str(tmp_path))
    assert (held["task"], held["step"]) == (1, bad[0]["step"])
    assert os.path.exists(slim_nanguard.quarantine.path(str(tmp_path), 1))
    assert cluster_lib.assert_checkpoints_finite(tmp_path) >= 2


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync_replicas"])
def test_a_spike_on_worker_1_is_skipped_against_the_statistics_all_workers_share(tmp_path, sync):
    """The spike statistics live on the ps: both workers' accepted steps feed them, worker 1's
    scaled batch is judged against them and skipped, and the chief's checkpoints hold them."""
    # Sigma 10, not the default 6: async, a worker's step on stale weights can jump the
    # gradient norm several times over (z 4.2 in a clean run here, and one CI run rejected a
    # second step at the default), while the planted batch (images x1000) sits at z 30 and
    # more. This test is about whose statistics judge it, not about the false-alarm rate.
    flags = [
        "--check_numerics",
        "--max_number_of_steps=80",
        "--spike_policy=skip",
        "--spike_sigma=10",
    ]
    if sync:
        flags.append("--sync_replicas")
    exits = _run_cluster(tmp_path, flags, worker1=["--inject_fault=spike_input:30"])

    assert [e.code for e in exits.values()] == [0, 0, 0], _explain(exits)
    bad = _bad_steps(tmp_path)
    assert len(bad) == 1, bad
    (spike,) = bad
    assert (spike["task"], spike["cause"], spike["action"]) == (1, "spike", "skip")
    assert max(spike["spike"]["z_loss"], spike["spike"]["z_grad_norm"]) > 10
    cluster_lib.assert_checkpoints_finite(tmp_path)
    # One set of statistics, fed by both workers: in the chief's last checkpoint it has
    # counted every accepted step of the cluster, where statistics of one worker would hold
    # about half. Async, that is the global step's 80, give or take a step under way; with
    # SyncReplicas each global step takes a gradient from each worker, so twice as many (and
    # a stale gradient the chief drops was accepted by its worker all the same).
    latest = slim_nanguard.latest_good_checkpoint(str(tmp_path))
    reader = slim_nanguard.storage.checkpoint_reader(latest)
    count, step = reader.get_tensor("nanguard_spike/count"), reader.get_tensor("global_step")
    assert step >= 80, step
    if sync:
        assert count >= 2 * (step - 2), (count, step)
    else:
        assert abs(int(count) - int(step)) <= 2, (count, step)


def test_a_stop_on_worker_1_stops_the_whole_cluster_cleanly(tmp_path):
    """Worker 1 stops at its bad batch; the chief follows with a final finite checkpoint."""
    flags = ["--nocheck_numerics", "--max_number_of_steps=5000", "--nan_policy=skip"]
    exits = _run_cluster(
        tmp_path, flags, worker1=["--nan_policy=stop", "--inject_fault=nan_loss:20"]
    )

    assert {n: e.code for n, e in exits.items()} == {"ps0": 0, "worker0": 3, "worker1": 3}, (
        _explain(exits)
    )
    assert "stopped by --nan_policy=stop" in exits["worker1"].stdout
    assert "another worker of the cluster stopped" in exits["worker0"].stdout
    assert cluster_lib.assert_checkpoints_finite(tmp_path) >= 1
    final = slim_nanguard.latest_good_checkpoint(str(tmp_path))
    assert int(final.rsplit("-", 1)[1]) < 5000  # stopped early, with a closing checkpoint
    assert _stops(tmp_path) == {0: ("cluster_stop", 1), 1: ("nan_policy_stop", None)}
    assert [r["task"] for r in _bad_steps(tmp_path)] == [1]


def test_a_stop_on_the_sync_replicas_chief_stops_worker_1_waiting_for_its_token(tmp_path):
    """The chief's close ends the token queue; worker 1 must not read that as end of data."""
    flags = ["--check_numerics", "--sync_replicas", "--max_number_of_steps=5000"]
    with cluster_lib.Cluster(_command(tmp_path, *flags), workers=2, timeout=170) as cluster:
        cluster.start({"worker0": ["--nan_policy=stop", "--inject_fault=nan_loss:20"]})
        exits = cluster.wait()

    assert {n: e.code for n, e in exits.items()} == {"ps0": 0, "worker0": 3, "worker1": 3}, (
        _explain(exits)
    )
    assert "another worker of the cluster stopped" in exits["worker1"].stdout
    cluster_lib.assert_checkpoints_finite(tmp_path)
    assert [r["task"] for r in _bad_steps(tmp_path)] == [0]
    assert _stops(tmp_path) == {0: ("nan_policy_stop", None), 1: ("cluster_stop", 0)}


def test_a_raise_on_worker_1_ends_it_with_status_1_and_stops_the_rest(tmp_path):
    flags = ["--check_numerics", "--max_number_of_steps=5000", "--nan_policy=skip"]
    exits = _run_cluster(
        tmp_path, flags, worker1=["--nan_policy=raise", "--inject_fault=nan_loss:20"]
    )

    assert {n: e.code for n, e in exits.items()} == {"ps0": 0, "worker0": 3, "worker1": 1}, (
        _explain(exits)
    )
    assert "NaN" in exits["worker1"].stderr and "Traceback" not in exits["worker1"].stderr
    assert "another worker of the cluster stopped" in exits["worker0"].stdout
    cluster_lib.assert_checkpoints_finite(tmp_path)
    final = slim_nanguard.latest_good_checkpoint(str(tmp_path))
    assert int(final.rsplit("-", 1)[1]) < 5000
    assert _stops(tmp_path) == {0: ("cluster_stop", 1), 1: ("nan_error", None)}


def test_a_worker_with_bad_flags_fails_alone_and_leaves_nothing_running(tmp_path):
    """Worker 1 fails before it starts its server; it still tells the ps, via ps 0's."""
    flags = ["--max_number_of_steps=5000"]
    exits = _run_cluster(tmp_path, flags, worker1=["--dataset_name=tfrecord"])

    assert {n: e.code for n, e in exits.items()} == {"ps0": 0, "worker0": 3, "worker1": 1}, (
        _explain(exits)
    )
    assert "--dataset_dir" in exits["worker1"].stderr
    cluster_lib.assert_checkpoints_finite(tmp_path)


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync_replicas"])
def test_worker_1s_rollback_is_a_request_the_chief_carries_out(tmp_path, sync):
    """The model lives on the ps: worker 1 asks, the chief restores, both carry on.

    With sync replicas the restore takes the global step back below the accumulators' own
    step; the chief resets theirs, or every later gradient would be dropped as stale (a hang).
    """
    # The chief's first checkpoint (step 0) comes before worker 1 trains. Worker 1 starts
    # first and waits for the chief's model, so it trains from the chief's first steps on: 400
    # steps keep the chief training when the request comes (one the chief never sees goes
    # unanswered).
    flags = [
        "--nocheck_numerics",
        "--max_number_of_steps=400",
        "--nan_policy=skip",
        "--rollback_lr_factor=0.5",
    ]
    if sync:
        flags.append("--sync_replicas")
    exits = _run_cluster(
        tmp_path,
        flags,
        worker1=["--nan_policy=rollback", "--inject_fault=nan_loss:10"],
        chief_last_secs=3.0,
    )

    assert [e.code for e in exits.values()] == [0, 0, 0], _explain(exits)
    cluster_lib.assert_checkpoints_finite(tmp_path)
    records = slim_nanguard.read_events(tmp_path)
    kinds = [(r["task"], r["kind"]) for r in records if r["kind"] != "stop"]
    assert kinds == [(1, "bad_step"), (1, "rollback_requested"), (0, "rollback")], records
    bad, request, rollback = (r for r in records if r["kind"] != "stop")
    assert bad["action"] == "rollback" and request["step"] == bad["step"]
    assert request["chief"] == 0 and request["skipped_batches"] == 1
    assert rollback["requested_by"] == [1] and rollback["requests"] == 1
    assert rollback["step"] == bad["step"] and rollback["skipped_batches"] == 0
    assert rollback["checkpoint"].startswith(str(tmp_path))
    # The chief halved the learning rate; the scale lives on the ps, so every worker trains
    # with it, and each one's summary says so.
    assert rollback["learning_rate_scale"] == 0.5
    for name in ("worker0", "worker1"):
        assert re.search(r"lr scale\s+0\.5\b", exits[name].stdout), exits[name].stdout
    assert "rolled back 0, sent 1 to the chief" in exits["worker1"].stdout  # the chief counts it
    assert "rolled back 1" in exits["worker0"].stdout


def test_one_worker_with_a_bad_shard_skips_it_while_the_other_trains_to_the_limit(tmp_path):
    """Every batch of worker 1 is bad, none of worker 0's: the data, not the weights.

    The global step moves on (worker 0 trains), so worker 1's bad steps are never in a row at
    one global step: it skips them all without escalating, and the cluster ends at the limit.
    """
    flags = ["--nocheck_numerics", "--max_number_of_steps=60", "--nan_policy=skip"]
    # A few bad steps of worker 1 do come at one global step (3 at most, as measured on 2
    # busy cores); 20 leaves a margin for a chief slowed down by a checkpoint.
    worker1 = ["--inject_fault=nan_loss:0-1000000", "--max_consecutive_bad_steps=20"]
    exits = _run_cluster(tmp_path, flags, worker1=worker1)

    assert [e.code for e in exits.values()] == [0, 0, 0], _explain(exits)
    cluster_lib.assert_checkpoints_finite(tmp_path)
    bad = _bad_steps(tmp_path)
    assert bad and {r["task"] for r in bad} == {1}
    assert all(r["action"] == "skip" and "escalation" not in r for r in bad)
    assert _stops(tmp_path) == {0: ("step_limit", None), 1: ("step_limit", None)}


def test_all_workers_bad_freeze_the_global_step_and_escalation_stops_the_cluster(tmp_path):
    """Every batch of both workers is bad from batch 15 on: the weights, not the data."""
    flags = [
        "--nocheck_numerics",
        "--max_number_of_steps=5000",
        "--nan_policy=skip",
        "--max_consecutive_bad_steps=5",
        "--persistent_nan_policy=stop",
        "--inject_fault=nan_loss:15-1000000",
    ]
    exits = _run_cluster(tmp_path, flags)

    assert {n: e.code for n, e in exits.items()} == {"ps0": 0, "worker0": 3, "worker1": 3}, (
        _explain(exits)
    )
    cluster_lib.assert_checkpoints_finite(tmp_path)
    escalated = [r for r in _bad_steps(tmp_path) if "escalation" in r]
    assert escalated and all(r["action"] == "stop" for r in escalated)
    # The first worker to escalate stops the cluster; the other escalates too, or is stopped.
    first = escalated[0]["task"]
    stops = _stops(tmp_path)
    assert stops[first] == ("nan_policy_stop", None)
    assert stops[1 - first] in {("nan_policy_stop", None), ("cluster_stop", first)}


def test_a_killed_worker_leaves_the_ps_waiting_at_most_ps_timeout_secs(tmp_path):
    """Worker 1 is SIGKILLed while training; the chief finishes, the ps exits 1 naming it."""
    flags = ["--nocheck_numerics", "--max_number_of_steps=100", "--nan_policy=skip"]
    with cluster_lib.Cluster(_command(tmp_path, *flags), workers=2, timeout=170) as cluster:
        cluster.start({"ps0": ["--ps_timeout_secs=3"]})
        worker1 = cluster.worker_hosts.split(",")[1]
        events = tmp_path / "nanguard_events.jsonl"
        while not _cluster.answers(worker1) or not list(tmp_path.glob("model.ckpt-*.index")):
            assert time.monotonic() < cluster.deadline and cluster.procs["worker1"].poll() is None
            time.sleep(0.2)
        cluster.procs["worker1"].kill()  # SIGKILL, by its own PID
        exits = cluster.wait()

    assert {n: e.code for n, e in exits.items()} == {"ps0": 1, "worker0": 0, "worker1": -9}, (
        _explain(exits)
    )
    assert "reached the step limit" in exits["worker0"].stdout
    message = [line for line in exits["ps0"].stderr.splitlines() if "never said" in line]
    assert len(message) == 1 and f"worker 1 ({worker1})" in message[0], exits["ps0"].stderr
    assert "--ps_timeout_secs=3" in message[0] and "worker 0" not in message[0]
    assert events.exists() and _stops(tmp_path)[0] == ("step_limit", None)


@pytest.mark.parametrize(
    "flags, words",
    [
        (
            dict(ps_hosts="127.0.0.1", worker_hosts="127.0.0.1:2", job_name="worker"),
            ["--ps_hosts", "HOST:PORT"],
        ),
        (
            dict(
                ps_hosts="127.0.0.1:1",
                worker_hosts="127.0.0.1:2,127.0.0.1:3",
                job_name="worker",
                task=2,
            ),
            ["--task=2", "out of range"],
        ),
        (dict(ps_hosts="127.0.0.1:1", worker_hosts="127.0.0.1:2"), ["--job_name"]),
        (dict(job_name="worker"), ["--job_name=worker", "--ps_hosts"]),
        (
            dict(
                ps_hosts="127.0.0.1:1",
                worker_hosts="127.0.0.1:2",
                job_name="worker",
                replicas_to_aggregate=2,
            ),
            ["--replicas_to_aggregate=2"],
        ),
    ],
)
def test_bad_cluster_flags_name_the_flag(flags, words):
    args = dict(
        ps_hosts=[],
        worker_hosts=[],
        job_name=None,
        task=0,
        sync_replicas=False,
        replicas_to_aggregate=None,
        tf_config=None,
    )
    args.update(flags)
    with pytest.raises(app.LaunchError) as info:
        app_cluster.from_flags(**args)
    message = str(info.value)
    assert len(message.splitlines()) == 1
    for word in words:
        assert word in message


def test_every_cluster_flag_is_a_field_of_the_cluster():
    fields = {f.name for f in dataclasses.fields(app_cluster.Cluster)} - {"_state"}
    assert fields == set(app_cluster.CLUSTER_FLAGS) | {"task"}


def test_tf_config_describes_the_same_cluster_as_the_flags():
    tf_config = (
        '{"cluster": {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", '
        '"127.0.0.1:3"]}, "task": {"type": "worker", "index": 1}}'
    )
    cluster = app_cluster.from_flags(
        ps_hosts=[],
        worker_hosts=[],
        job_name=None,
        task=0,
        sync_replicas=True,
        replicas_to_aggregate=None,
        tf_config=tf_config,
    )
    assert cluster == app_cluster.Cluster(
        ps_hosts=("127.0.0.1:1",),
        worker_hosts=("127.0.0.1:2", "127.0.0.1:3"),
        job_name="worker",
        task=1,
        sync_replicas=True,
    )
    assert not cluster.is_chief and cluster.aggregate() == 2


def test_an_unreachable_ps_is_one_clear_line_and_exit_1(tmp_path):
    port, worker = cluster_lib.free_ports(2)
    train_dir = tmp_path / "run"
    proc = subprocess.run(
        _command(
            train_dir,
            f"--ps_hosts=127.0.0.1:{port}",
            f"--worker_hosts=127.0.0.1:{worker}",
            "--job_name=worker",
            "--task=0",
            "--ps_timeout_secs=1",
        ),
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2"),
    )
    lines = [
        line for line in proc.stderr.splitlines() if line.strip() and not _LOG_LINE.match(line)
    ]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "--ps_hosts" in lines[0]
    assert not train_dir.exists()


def test_read_events_returns_every_tasks_records_oldest_first(tmp_path):
    chief = _recorders.EventRecorder(str(tmp_path), write_summaries=False, task=0)
    worker1 = _recorders.EventRecorder(str(tmp_path), write_summaries=False, task=1)
    worker1({"kind": "bad_step", "step": 3, "time": 1.0})
    chief({"kind": "bad_step", "step": 4, "time": 2.0})
    worker1({"kind": "stop", "reason": "nan_policy_stop", "time": 3.0})
    assert pathlib.Path(worker1.path).name == "nanguard_events.task1.jsonl"
    assert [(r["task"], r["kind"]) for r in slim_nanguard.read_events(tmp_path)] == [
        (1, "bad_step"),
        (0, "bad_step"),
        (1, "stop"),
    ]
    assert [r["task"] for r in slim_nanguard.read_events(worker1.path)] == [1, 1]
