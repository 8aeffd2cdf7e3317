"""Does the spike guard raise false alarms? Clean runs with ``--spike_policy=skip``, counted.

Two tables, printed as Markdown (docs/performance.md holds them as measured):

* ``--part=configs``: each shipped config in ``configs/`` (all but ``spike_skip.cfg``, whose
  spike is planted) run by ``scripts/train.py`` twice, as shipped and with
  ``--spike_policy=skip``: the spikes flagged, the largest z-scores of loss and gradient norm
  over every step past the warm-up, and the final test accuracy of each run. Both runs write a
  TensorBoard summary every step (``--save_summaries_steps=1``: the z-scores are read from
  there), which changes nothing in training. ``finetune.cfg`` starts from the checkpoint of
  this script's own ``default.cfg`` run.
* ``--part=models``: each model of the benchmark (`slim_nanguard.app.benchmarking.MODELS`)
  with each of its optimizers, trained by `slim_nanguard.train` for ``--steps`` steps with
  ``spike_policy="skip"`` on a new random batch each step, labelled by a fixed random linear
  teacher (so the loss falls, as in training, with the batch-to-batch noise of real data).

* ``--part=converged``: nets trained to convergence, where weight decay is most of the total
  loss (issue 33: LeNet flagged clean late steps at z 6-12 when the total loss was judged):
  LeNet (``configs/lenet.cfg`` by ``scripts/train.py``) and CifarNet (`models.cifarnet`, its
  weight decay of 0.004 on the fully connected layers, batch norm after each convolution, the
  digits at 16x16x3, momentum 0.9 at 0.01, trained here by `slim_nanguard.train`) for
  ``--converged_steps`` steps, each seed of ``--seeds``, with ``spike_policy="skip"`` (every
  other setting at its default) and without a spike policy. A row: the steps judged (the
  guarded run's steps, good and bad, past the warm-up of 20), each false alarm with its
  z-scores and the value over ``spike_sigma`` (its cause), the largest z-scores of data loss
  and gradient norm (TensorBoard's, those of accepted steps), and the test accuracy of each
  run. Its last line is the sentence the README may say. ``--quick``: one seed, 60 steps
  (the table's shape, for tests/test_spike_data_loss.py).
* ``--part=cluster``: LeNet as in ``--part=converged``, in each layout of ``--layouts``: one
  machine, and loopback clusters started by ``scripts/train.py`` (1 ps and 2 or 3 async
  workers, or 2 workers under ``--sync_replicas``; free 127.0.0.1 ports, every task killed by
  its own PID past ``CLUSTER_TIMEOUT_SECS``), ``--converged_steps`` global steps, each seed,
  with ``--spike_policy=skip`` and without. A row: the steps each worker ran (the chief
  first), the steps judged (all workers' steps past the warm-up of 20, which they share: the
  statistics live on the ps), each false alarm with its z-scores, cause and worker (from each
  worker's record), the largest z-scores of the chief's accepted steps, and the chief's test
  accuracy of each run. ``--quick``: async 2 workers, seed 0, 60 steps.

The wider bench (clean-but-hard runs, and the runs the guard must judge: a new level, a
learning-rate jump, planted spikes and bad shards) is ``research/spike_bench.py``.

research/ is not installed with the package (the wheel holds the library and the four
console commands): run it from a clone, with this checkout's slim_nanguard importable
(``pip install -e .`` or ``PYTHONPATH=.``).

Usage, from the repository root::

    python research/spike_false_alarms.py                  # both tables (about 7 minutes)
    python research/spike_false_alarms.py --part=configs --configs=default,lenet
    python research/spike_false_alarms.py --part=models --steps=500
    python research/spike_false_alarms.py --part=converged   # 1,500 steps, seeds 0-2 (~11 min)
    python research/spike_false_alarms.py --part=converged --quick
    python research/spike_false_alarms.py --part=cluster     # 4 layouts x 3 seeds (~40 min)
    python research/spike_false_alarms.py --part=cluster --quick
"""

import functools
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = (
    "default",
    "lenet",
    "hook",
    "check_numerics",
    "finetune",
    "diverge_skip",
    "diverge_rollback",
)
Z_TAGS = ("nanguard/z_loss", "nanguard/z_grad_norm")


def _train_command(config: str, train_dir: str, *extra: str):
    """``scripts/train.py --flagfile=configs/CONFIG.cfg`` into `train_dir`: (argv, env)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    args = [
        sys.executable,
        os.path.join(REPO, "scripts", "train.py"),
        f"--flagfile=configs/{config}.cfg",
        f"--train_dir={train_dir}",
        "--save_summaries_steps=1",
        *extra,
    ]
    return args, env


def _train(config: str, train_dir: str, *extra: str) -> subprocess.CompletedProcess:
    """Runs ``scripts/train.py --flagfile=configs/CONFIG.cfg`` into `train_dir`."""
    args, env = _train_command(config, train_dir, *extra)
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{config} {' '.join(extra)} failed:\n{proc.stderr[-3000:]}")
    return proc


def _accuracy(stdout: str) -> float:
    return float(re.search(r"evaluation +test accuracy ([0-9.]+)", stdout).group(1))


def _spikes(train_dir: str):
    """The steps of the spikes in `train_dir`'s record, and its other bad steps."""
    import slim_nanguard

    bad = [r for r in slim_nanguard.read_events(train_dir) if r.get("kind") == "bad_step"]
    spikes = [r for r in bad if r.get("cause") == "spike"]
    return spikes, len(bad) - len(spikes)


def _largest_z(train_dir: str):
    """The largest TensorBoard z-scores of loss and gradient norm (0 in the warm-up)."""
    import tensorflow as tf

    largest = {tag: -math.inf for tag in Z_TAGS}
    for path in tf.io.gfile.glob(os.path.join(train_dir, "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                # By the end of the tag: the train op's name scope may come before it.
                for tag in (t for t in Z_TAGS if value.tag.endswith(t)):
                    largest[tag] = max(largest[tag], value.simple_value)
    return tuple(largest[tag] for tag in Z_TAGS)


def _over_words(record) -> str:
    """What a spike's record says was over ``spike_sigma``, in words (its cause)."""
    spike = record["spike"]
    data = "data loss" if spike.get("regularization_terms") else "loss"
    words = {"loss": data, "grad_norm": "gradient norm"}
    return " and ".join(words.get(c, c) for c in spike.get("over") or ()) or "none"


def _spike_cell(spikes) -> str:
    if not spikes:
        return "0"
    shown = ", ".join(
        f"step {r['step']} (z loss {r['spike']['z_loss']:.1f}, "
        f"z norm {r['spike']['z_grad_norm']:.1f})"
        for r in spikes
    )
    return f"**{len(spikes)}**: {shown}"


def configs_table(names, workdir: str) -> str:
    """Runs each config with and without the spike guard; the Markdown table."""
    import tensorflow as tf

    rows = [
        "| config | steps | spikes flagged | other bad steps (with / without) | largest z loss "
        "| largest z grad norm | test accuracy without | with `--spike_policy=skip` |",
        "|---|---|---|---|---|---|---|---|",
    ]
    default_dir = os.path.join(workdir, "default_without")
    for name in names:
        extra = []
        if name == "finetune":  # from this script's default run (made here if not yet)
            if not tf.io.gfile.isdir(default_dir):
                _train("default", default_dir)
            extra = [f"--checkpoint_path={default_dir}"]
        start = time.time()
        without_dir = os.path.join(workdir, f"{name}_without")
        with_dir = os.path.join(workdir, f"{name}_with")
        without = _train(name, without_dir, *extra)
        with_ = _train(name, with_dir, *extra, "--spike_policy=skip")
        spikes, others = _spikes(with_dir)
        _, others_without = _spikes(without_dir)
        z_loss, z_norm = _largest_z(with_dir)
        steps = re.search(r"global step (\d+)", with_.stdout).group(1)
        acc_without = _accuracy(without.stdout)
        rows.append(
            f"| {name} | {steps} | {_spike_cell(spikes)} | {others} / {others_without} "
            f"| {z_loss:.2f} | {z_norm:.2f} | {acc_without:.4f} | {_accuracy(with_.stdout):.4f} |"
        )
        print(f"{name}: {time.time() - start:.0f} s", file=sys.stderr, flush=True)
    return "\n".join(rows)


def _model_run(name: str, optimizer: str, steps: int, logdir: str, seed: int = 0):
    """Trains benchmark model `name` clean with the spike guard; (spikes, largest z's, s)."""
    import numpy as np
    import tensorflow as tf

    import slim_nanguard
    from slim_nanguard.app import benchmarking

    spec = benchmarking.MODELS[name]
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(seed)
        shape = (spec.batch_size,) + spec.input_shape
        images = tf.random.normal(shape, seed=seed)  # a new batch each step
        size = int(np.prod(spec.input_shape))
        teacher = np.random.RandomState(seed).normal(size=(size, benchmarking.NUM_CLASSES))
        flat = tf.reshape(images, [spec.batch_size, size])
        labels = tf.argmax(tf.matmul(flat, tf.constant(teacher, tf.float32)), axis=1)
        logits = spec.build(images, benchmarking.Settings().deep_layers)
        loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
        train_op = slim_nanguard.create_train_op(
            loss, benchmarking.OPTIMIZERS[optimizer](), spike_policy="skip"
        )
        start = time.time()
        slim_nanguard.train(
            train_op,
            logdir,
            number_of_steps=steps,
            save_summaries_steps=1,
            save_checkpoint_secs=None,
            log_every_n_steps=0,
        )
        seconds = time.time() - start
        state = slim_nanguard.get_guard(train_op).state
    spikes, _ = _spikes(logdir)
    assert len(spikes) == state.spikes, (spikes, state)
    return spikes, _largest_z(logdir), seconds


def models_table(names, optimizers, steps: int, workdir: str) -> str:
    """Trains each benchmark model clean with the spike guard; the Markdown table."""
    rows = [
        "| model | optimizer | steps | spikes flagged | spikes per step | largest z loss "
        "| largest z grad norm |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in names:
        for optimizer in optimizers:
            logdir = os.path.join(workdir, f"model_{name}_{optimizer}")
            spikes, (z_loss, z_norm), seconds = _model_run(name, optimizer, steps, logdir)
            rows.append(
                f"| {name} | {optimizer} | {steps} | {_spike_cell(spikes)} "
                f"| {len(spikes) / steps:.3g} | {z_loss:.2f} | {z_norm:.2f} |"
            )
            print(f"{name}/{optimizer}: {seconds:.0f} s", file=sys.stderr, flush=True)
    return "\n".join(rows)


CONVERGED_MODELS = ("lenet", "cifarnet")
WARMUP_STEPS = 20  # the spike guard's default spike_warmup_steps
CONVERGED_COLUMNS = (
    "model",
    "seed",
    "steps judged",
    "false alarms (step: z data loss / z grad norm, over sigma)",
    "largest z data loss",
    "largest z grad norm",
    "test accuracy unguarded",
    "guarded",
)


def _cifarnet_converged(seed: int, steps: int, logdir: str, guarded: bool):
    """CifarNet with batch norm on the digits for `steps` steps: ([steps run], test accuracy)."""
    import tensorflow as tf
    import tf_slim as slim

    import slim_nanguard
    from slim_nanguard import compat
    from slim_nanguard.app import datasets
    from slim_nanguard.app import models

    compat.install()  # slim.batch_norm on current TensorFlow

    def net(images, is_training):
        with (
            slim.arg_scope([slim.conv2d], normalizer_fn=slim.batch_norm),
            slim.arg_scope([slim.batch_norm], is_training=is_training, decay=0.9),
        ):
            return models.cifarnet(images, 10, is_training)

    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(seed)
        digits = {"image_size": 16, "channels": 3, "seed": seed}
        with tf.device("/cpu:0"):
            train_data, _ = datasets.get_dataset("digits", "train", batch_size=32, **digits)
            test_data, _ = datasets.get_dataset(
                "digits", "test", batch_size=1000, shuffle=False, repeat=False, **digits
            )
            images, labels = tf.compat.v1.data.make_one_shot_iterator(train_data).get_next()
            test_images, test_labels = tf.compat.v1.data.make_one_shot_iterator(
                test_data
            ).get_next()
        logits = net(images, True)
        tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
        total_loss = tf.compat.v1.losses.get_total_loss()
        with tf.compat.v1.variable_scope(tf.compat.v1.get_variable_scope(), reuse=True):
            test_logits = net(test_images, False)
        correct = tf.equal(tf.argmax(test_logits, 1), test_labels)
        accuracy = tf.reduce_mean(tf.cast(correct, tf.float32))
        optimizer = tf.compat.v1.train.MomentumOptimizer(0.01, 0.9)
        train_op = slim_nanguard.create_train_op(
            total_loss, optimizer, spike_policy="skip" if guarded else None
        )
        measured = []

        class _Evaluate(tf.compat.v1.train.SessionRunHook):
            def end(self, session):
                measured.append(float(session.run(accuracy)))

        result = slim_nanguard.train(
            train_op,
            logdir,
            number_of_steps=steps,
            hooks=[_Evaluate()],
            save_summaries_steps=1,
            save_checkpoint_secs=None,
            log_every_n_steps=0,
        )
    return [result.steps + result.bad_steps], measured[0]


def _alarms_cell(spikes, by_worker: bool = False) -> str:
    if not spikes:
        return "0"
    shown = ", ".join(
        f"{r['step']}: {r['spike']['z_loss']:.1f} / {r['spike']['z_grad_norm']:.1f}, "
        f"{_over_words(r)}" + (f", worker {r.get('task', 0)}" if by_worker else "")
        for r in spikes
    )
    return f"**{len(spikes)}**: {shown}"


def _sentence(runs: int, trained: str, what: str, judged: int, alarms: int) -> str:
    """The table's last line: what it shows, no more."""
    return (
        f"On {runs} run{'s' if runs != 1 else ''} trained {trained} ({what}; "
        f"{judged} steps judged) the spike guard at its defaults flagged {alarms} "
        f"clean step{'' if alarms == 1 else 's'}."
    )


def _pair(run, base: str):
    """``run(train_dir, guarded)`` into BASE_without, then guarded into BASE_with:
    (what the guarded run said it ran, the test accuracy of each, the guarded run's spikes,
    its largest z-scores). A non-finite step in the guarded run is an error: the runs are clean."""
    _, acc_without = run(base + "_without", False)
    ran, acc_with = run(base + "_with", True)
    spikes, others = _spikes(base + "_with")
    if others:
        raise RuntimeError(f"{base}_with: {others} non-finite steps in a clean run")
    return ran, acc_without, acc_with, spikes, _largest_z(base + "_with")


def _bench(columns, cases, trained: str, what: str, by_worker: bool = False) -> str:
    """Runs each case unguarded, then guarded; the table and its sentence.

    Args:
      columns: The table's columns.
      cases: (the row's first cells, BASE (the runs go to BASE_without and BASE_with),
        ``run(train_dir, guarded)`` returning (the steps each worker ran, test accuracy)).
      trained: How long each run trained, in words.
      what: What was run, in words.
      by_worker: Show the steps and each false alarm's worker (a cluster's table).
    """
    rows = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    alarms = judged_total = 0
    for cells, base, run in cases:
        start = time.time()
        counts, acc_without, acc_with, spikes, (z_loss, z_norm) = _pair(run, base)
        judged = max(sum(counts) - WARMUP_STEPS, 0)
        alarms += len(spikes)
        judged_total += judged
        cells = [*cells, *([" + ".join(map(str, counts))] if by_worker else []), str(judged)]
        cells += [_alarms_cell(spikes, by_worker), f"{z_loss:.2f}", f"{z_norm:.2f}"]
        rows.append("| " + " | ".join(cells + [f"{acc_without:.4f}", f"{acc_with:.4f}"]) + " |")
        print(f"{base}: {time.time() - start:.0f} s\n{rows[-1]}", file=sys.stderr, flush=True)
    return "\n".join(rows + ["", _sentence(len(cases), trained, what, judged_total, alarms)])


def converged_table(names, seeds, steps: int, workdir: str) -> str:
    """Trains each net with and without the spike guard; the table and the README's line."""
    runs = {"lenet": functools.partial(_lenet_run, "local"), "cifarnet": _cifarnet_converged}
    cases = [
        (
            [name, str(seed)],
            os.path.join(workdir, f"converged_{name}_{seed}"),
            functools.partial(runs[name], seed, steps),
        )
        for name in names
        for seed in seeds
    ]
    what = f"{', '.join(names)}; seeds {', '.join(str(s) for s in seeds)}"
    return _bench(CONVERGED_COLUMNS, cases, f"{steps} steps", what)


# --part=cluster's layouts by flag value: (the table's words, workers (0: no cluster), sync).
LAYOUTS = {
    "local": ("1 machine", 0, False),
    "async2": ("async 2 workers", 2, False),
    "async3": ("async 3 workers", 3, False),
    "sync2": ("sync 2 replicas", 2, True),
}
CLUSTER_COLUMNS = (
    "layout",
    "net",
    "seed",
    "steps by worker",
    "steps judged",
    "false alarms (step: z data loss / z grad norm, over sigma, worker)",
    "largest z data loss (chief)",
    "largest z grad norm (chief)",
    "test accuracy unguarded",
    "guarded",
)
CLUSTER_TIMEOUT_SECS = 1800  # per cluster run: every task is killed (by its PID) past it


def _free_ports(count: int):
    """`count` distinct ports free on 127.0.0.1 now (bound, read, released)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _run_tasks(commands, env, timeout: float):
    """Starts each command; waits for all of them, `timeout` seconds in all; each one's
    (exit status, stdout, stderr). A task still running at the deadline (or when this fails)
    is killed by its own PID; its status is then None."""
    procs, outputs = [], []
    deadline = time.monotonic() + timeout
    try:
        for argv in commands:
            # Files, not pipes: a task must never block on output nobody reads yet.
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            outputs.append((out, err))
            procs.append(subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=err))
        exits = []
        for proc, (out, err) in zip(procs, outputs):
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
                code = None
            out.seek(0)
            err.seek(0)
            exits.append((code, out.read(), err.read()))
        return exits
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        for out, err in outputs:
            out.close()
            err.close()


def _lenet_run(layout: str, seed: int, steps: int, train_dir: str, guarded: bool):
    """``configs/lenet.cfg`` for `steps` global steps in `layout` (a key of `LAYOUTS`), on a
    loopback cluster of 1 ps and its workers (free 127.0.0.1 ports) unless ``local``:
    (the steps each worker ran, good and bad, the chief first; the chief's test accuracy)."""
    _, workers, sync = LAYOUTS[layout]
    extra = [f"--seed={seed}", f"--max_number_of_steps={steps}", "--log_every_n_steps=0"]
    extra += ["--spike_policy=skip"] if guarded else []
    if not workers:
        outs = [_train("lenet", train_dir, *extra).stdout]
    else:
        ps, *ports = _free_ports(1 + workers)
        extra += [
            f"--ps_hosts=127.0.0.1:{ps}",
            "--worker_hosts=" + ",".join(f"127.0.0.1:{p}" for p in ports),
            *(["--sync_replicas"] if sync else []),
        ]
        argv, env = _train_command("lenet", train_dir, *extra)
        tasks = [("ps", 0)] + [("worker", t) for t in range(workers)]
        commands = [argv + [f"--job_name={job}", f"--task={t}"] for job, t in tasks]
        exits = _run_tasks(commands, env, CLUSTER_TIMEOUT_SECS)
        if any(code != 0 for code, _, _ in exits):
            said = "\n".join(
                f"--- {job}{t}: exit {code}\n{err[-1500:]}"
                for (job, t), (code, _, err) in zip(tasks, exits)
            )
            raise RuntimeError(f"lenet {layout} seed {seed} failed:\n{said}")
        outs = [out for _, out, _ in exits[1:]]
    counts = []
    for out in outs:
        good = int(re.search(r"^  steps +(\d+) good steps", out, re.M).group(1))
        bad = int(re.search(r"^  bad steps +(\d+)", out, re.M).group(1))
        counts.append(good + bad)
    return counts, _accuracy(outs[0])


def cluster_table(layouts, seeds, steps: int, workdir: str) -> str:
    """Trains LeNet in each layout with and without the spike guard; the table and its line.

    The spike statistics of a cluster live on the ps, so its warm-up is the first
    `WARMUP_STEPS` steps of all the workers together: the steps judged are every worker's
    steps but those.
    """
    cases = [
        (
            [LAYOUTS[layout][0], "lenet", str(seed)],
            os.path.join(workdir, f"cluster_{layout}_{seed}"),
            functools.partial(_lenet_run, layout, seed, steps),
        )
        for layout in layouts
        for seed in seeds
    ]
    what = "lenet; " + ", ".join(LAYOUTS[k][0] for k in layouts)
    what += f"; seeds {', '.join(str(s) for s in seeds)}"
    return _bench(CLUSTER_COLUMNS, cases, f"{steps} global steps", what, by_worker=True)


FLAGS = flags.FLAGS
flags.DEFINE_enum(
    "part", "both", ["configs", "models", "both", "converged", "cluster"], "Which table to print."
)
flags.DEFINE_list("configs", list(CONFIGS), "The shipped configs to run (names in configs/).")
flags.DEFINE_list("models", [], "Benchmark models to train (default: all).")
flags.DEFINE_list("optimizers", ["sgd", "adam"], "Their optimizers.")
flags.DEFINE_integer("steps", 500, "Steps per benchmark model.")
flags.DEFINE_list("converged_models", list(CONVERGED_MODELS), "Nets of --part=converged.")
flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds of --part=converged.")
flags.DEFINE_integer("converged_steps", 1500, "Steps per run of --part=converged.")
flags.DEFINE_list("layouts", list(LAYOUTS), f"Layouts of --part=cluster: {', '.join(LAYOUTS)}.")
flags.DEFINE_bool(
    "quick",
    False,
    "--part=converged or cluster on seed 0 for 60 steps (cluster: async2 only): the table's shape.",
)
flags.DEFINE_string("workdir", "", "Where the runs go (default: a new temporary directory).")


def main(argv) -> int:
    del argv
    import tensorflow as tf

    workdir = FLAGS.workdir or tempfile.mkdtemp(prefix="spike_false_alarms_")
    if tf.io.gfile.exists(workdir) and tf.io.gfile.listdir(workdir):
        print(f"--workdir={workdir} is not empty: the runs need a fresh directory.")
        return 2
    print(f"runs in {workdir}", file=sys.stderr)
    if FLAGS.part in ("configs", "both"):
        print(configs_table(FLAGS.configs, workdir))
    if FLAGS.part in ("models", "both"):
        from slim_nanguard.app import benchmarking

        tf.compat.v1.disable_v2_behavior()
        names = FLAGS.models or list(benchmarking.MODELS)
        print(models_table(names, FLAGS.optimizers, FLAGS.steps, workdir))
    if FLAGS.part == "converged":
        tf.compat.v1.disable_v2_behavior()
        seeds = [0] if FLAGS.quick else [int(s) for s in FLAGS.seeds]
        steps = 60 if FLAGS.quick else FLAGS.converged_steps
        print(converged_table(FLAGS.converged_models, seeds, steps, workdir))
    if FLAGS.part == "cluster":
        seeds = [0] if FLAGS.quick else [int(s) for s in FLAGS.seeds]
        steps = 60 if FLAGS.quick else FLAGS.converged_steps
        unknown = sorted(set(FLAGS.layouts) - set(LAYOUTS))
        if unknown:
            print(f"--layouts: {', '.join(unknown)} unknown; choose from {', '.join(LAYOUTS)}.")
            return 2
        print(cluster_table(["async2"] if FLAGS.quick else FLAGS.layouts, seeds, steps, workdir))
    return 0


if __name__ == "__main__":
    app.run(main)
