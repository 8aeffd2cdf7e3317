"""Does the spike guard raise false alarms? Clean runs with ``--spike_policy=skip``, counted.

Two tables, printed as Markdown (docs/guide.md holds them as measured):

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

The wider bench (clean-but-hard runs, and the runs the guard must judge: a new level, a
learning-rate jump, planted spikes and bad shards) is ``scripts/spike_bench.py``.

Usage, from the repository root::

    python scripts/spike_false_alarms.py                  # both tables (about 7 minutes)
    python scripts/spike_false_alarms.py --part=configs --configs=default,lenet
    python scripts/spike_false_alarms.py --part=models --steps=500
"""

import math
import os
import re
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


def _train(config: str, train_dir: str, *extra: str) -> subprocess.CompletedProcess:
    """Runs ``scripts/train.py --flagfile=configs/CONFIG.cfg`` into `train_dir`."""
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


FLAGS = flags.FLAGS
flags.DEFINE_enum("part", "both", ["configs", "models", "both"], "Which table to print.")
flags.DEFINE_list("configs", list(CONFIGS), "The shipped configs to run (names in configs/).")
flags.DEFINE_list("models", [], "Benchmark models to train (default: all).")
flags.DEFINE_list("optimizers", ["sgd", "adam"], "Their optimizers.")
flags.DEFINE_integer("steps", 500, "Steps per benchmark model.")
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
    return 0


if __name__ == "__main__":
    app.run(main)
