"""The model garden's `train_image_classifier.py`, guarded, with two clones on "GPUs".

docs/model_garden.md says how to guard the TF model garden's script. Here it runs with
`--num_clones=2 --clone_on_cpu=False`, so model_deploy puts clone i on `/device:GPU:i`. With
fewer GPUs than clones, our wrapper (`WRAPPER` below) sends clone i to `/device:CPU:<i + 1>`
of a session with three logical CPU devices and soft placement off, as `tf_slim.learning.train`
runs it; the variables and the input queues stay on the host, `/device:CPU:0`, where
model_deploy puts them. The wrapper writes 64 random images in the garden's MNIST format and
makes the 20th example out of the preprocessing NaN. In either mode the guard must skip that
batch, record the bad step, and finish the five good steps.

The garden's files are not ours and are not in this repository. NANGUARD_MODEL_GARDEN names
the directory holding `research/slim`, edited as docs/model_garden.md says (default
/work/garden); without it the test is skipped.
"""

import os
import pathlib
import subprocess
import sys

import pytest
import tensorflow as tf

import slim_nanguard

REPO = pathlib.Path(__file__).resolve().parents[1]
GARDEN = pathlib.Path(os.environ.get("NANGUARD_MODEL_GARDEN", "/work/garden"))

pytestmark = pytest.mark.skipif(
    not (GARDEN / "research" / "slim" / "train_image_classifier.py").is_file(),
    reason=f"no model garden at {GARDEN}: set NANGUARD_MODEL_GARDEN to the directory holding "
    "research/slim, edited as docs/model_garden.md says",
)


@pytest.mark.parametrize("mode", ["check_numerics", "nocheck_numerics"])
def test_two_clones_skip_the_nan_batch_and_finish(tmp_path, mode):
    wrapper = tmp_path / "run_two_clones.py"
    wrapper.write_text(WRAPPER)
    train_dir = tmp_path / "train"
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    run = subprocess.run(
        [
            sys.executable,
            str(wrapper),
            f"--garden={GARDEN}",
            "--mnist_examples=64",
            "--plant_nan_example=20",
            "--",
            f"--train_dir={train_dir}",
            f"--dataset_dir={tmp_path / 'mnist'}",
            "--model_name=lenet",
            "--dataset_name=mnist",
            "--dataset_split_name=train",
            "--num_clones=2",
            "--clone_on_cpu=False",
            "--optimizer=sgd",
            "--learning_rate_decay_type=fixed",
            "--max_number_of_steps=5",
            "--batch_size=8",
            "--nan_policy=skip",
            f"--{mode}",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=path),
        check=False,
    )
    log = run.stdout + run.stderr

    assert run.returncode == 0, _gist(log)
    assert tf.train.latest_checkpoint(str(train_dir)).endswith("model.ckpt-5"), _gist(log)
    bad_steps = [e for e in slim_nanguard.read_events(str(train_dir)) if e["kind"] == "bad_step"]
    assert [e["action"] for e in bad_steps] == ["skip"]


def _gist(log):
    """The log's error lines, once each: a failed run's traceback fills thousands of lines."""
    lines = [line for line in log.splitlines() if "Error" in line or "Cannot" in line]
    return "\n".join(dict.fromkeys(lines)) + "\n...\n" + log[-1500:]


# Our wrapper, written out by the test; /work/garden/run_two_clones.py is the same file.
WRAPPER = r'''"""Runs the model garden's training script with GPU clones on logical CPU devices.

    python run_two_clones.py --garden=DIR [--script=NAME] [--mnist_examples=N]
        [--plant_nan_example=K] -- GARDEN_FLAGS...

DIR holds research/slim. Under --clone_on_cpu=False, model_deploy puts clone i on
/device:GPU:i. Where there are fewer GPUs than clones, clone i goes to /device:CPU:<i + 1>
instead, and tf_slim.learning.train's session gets one logical CPU device per clone besides
the host (/device:CPU:0) and no GPU, with soft placement off as learning.train has it.
model_deploy's layout is otherwise untouched: the variables, the input queues and the
optimizer stay on the host (/device:CPU:0).

--mnist_examples=N writes N random 28x28x1 PNG images in the garden's MNIST format
(mnist_train.tfrecord, as datasets/download_and_convert_mnist.py writes it, and labels.txt)
into --dataset_dir unless the file is there. --plant_nan_example=K makes the K-th example
the preprocessing hands out (counted from 1) all NaN: one bad batch in the whole run.
"""

import argparse
import os
import runpy
import struct
import sys
import zlib


def png(pixels, width, height):
    """An 8-bit grayscale PNG of `pixels` (bytes, row by row), without TensorFlow."""

    def chunk(kind, data):
        return (
            struct.pack(">I", len(data))
            + kind
            + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        )

    rows = b"".join(b"\0" + pixels[y * width : (y + 1) * width] for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


def write_mnist(dataset_dir, count):
    """mnist_train.tfrecord as download_and_convert_mnist.py writes it, with random images."""
    import random

    import tensorflow as tf
    from datasets import dataset_utils

    path = os.path.join(dataset_dir, "mnist_train.tfrecord")
    if os.path.exists(path):
        return
    os.makedirs(dataset_dir, exist_ok=True)
    rng = random.Random(0)
    with tf.io.TFRecordWriter(path) as writer:
        for _ in range(count):
            pixels = bytes(rng.randrange(256) for _ in range(28 * 28))
            example = dataset_utils.image_to_tfexample(
                png(pixels, 28, 28), b"png", 28, 28, rng.randrange(10)
            )
            writer.write(example.SerializeToString())
    dataset_utils.write_label_file({i: str(i) for i in range(10)}, dataset_dir)


def too_few_gpus(num_clones):
    import tensorflow as tf

    return len(tf.config.list_physical_devices("GPU")) < num_clones


def put_gpu_clones_on_logical_cpus(num_clones):
    """/device:GPU:i -> /device:CPU:<i + 1>, in a session of 1 + num_clones CPUs and no GPU."""
    import tensorflow as tf
    import tf_slim
    from deployment import model_deploy

    clone_device = model_deploy.DeploymentConfig.clone_device

    def logical_clone_device(self, clone_index):
        device = clone_device(self, clone_index)
        gpu = "/device:GPU:%d" % clone_index
        if device.endswith(gpu) and too_few_gpus(self.num_clones):
            device = device[: -len(gpu)] + "/device:CPU:%d" % (clone_index + 1)
        return device

    model_deploy.DeploymentConfig.clone_device = logical_clone_device

    train = tf_slim.learning.train

    def train_with_logical_cpus(train_op, *args, **kwargs):
        devices = {}
        for op in train_op.graph.get_operations():
            devices[op.device] = devices.get(op.device, 0) + 1
        print("run_two_clones: ops per device: %s" % sorted(devices.items()), flush=True)
        if kwargs.get("session_config") is None and too_few_gpus(num_clones):
            kwargs["session_config"] = tf.compat.v1.ConfigProto(
                device_count={"CPU": 1 + num_clones, "GPU": 0}, allow_soft_placement=False
            )
        return train(train_op, *args, **kwargs)

    tf_slim.learning.train = train_with_logical_cpus


def plant_nan(example):
    """The `example`-th image out of lenet's preprocessing (counted from 1) is all NaN."""
    import tensorflow as tf
    from preprocessing import lenet_preprocessing

    preprocess_image = lenet_preprocessing.preprocess_image

    def preprocess_image_with_nan(image, *args, **kwargs):
        image = preprocess_image(image, *args, **kwargs)
        v1 = tf.compat.v1
        with v1.variable_scope("plant_nan"):
            count = v1.get_variable(
                "count",
                [],
                tf.int64,
                initializer=v1.zeros_initializer(),
                trainable=False,
                collections=[v1.GraphKeys.LOCAL_VARIABLES],
            )
        n = count.assign_add(1, use_locking=True)
        return image + tf.where(tf.equal(n, example), float("nan"), 0.0)

    lenet_preprocessing.preprocess_image = preprocess_image_with_nan


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--garden", required=True, help="the directory holding research/slim")
    parser.add_argument("--script", default="train_image_classifier.py")
    parser.add_argument("--mnist_examples", type=int, default=0)
    parser.add_argument("--plant_nan_example", type=int, default=0)
    if "--" in argv:
        split = argv.index("--")
        ours, garden_flags = argv[:split], argv[split + 1 :]
    else:
        ours, garden_flags = argv, []
    args = parser.parse_args(ours)

    slim_dir = os.path.join(os.path.abspath(args.garden), "research", "slim")
    script = os.path.join(slim_dir, args.script)
    sys.path.insert(0, slim_dir)

    flags = dict(f[2:].split("=", 1) for f in garden_flags if f.startswith("--") and "=" in f)
    if args.mnist_examples:
        write_mnist(flags["dataset_dir"], args.mnist_examples)
    put_gpu_clones_on_logical_cpus(int(flags.get("num_clones", 1)))
    if args.plant_nan_example:
        plant_nan(args.plant_nan_example)

    sys.argv = [script] + garden_flags
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
'''
