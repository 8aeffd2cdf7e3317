"""Small graphs and helpers the tests build training runs from.

Each model is a two-layer ReLU MLP on 4 features with a batch-norm-like moving mean (an
update op in ``UPDATE_OPS``), fed through placeholders so a test can inject a fault at the
step it chooses:

* ``nan_loss`` / ``inf_loss``: a non-finite offset added to the loss (gradients stay finite);
* ``nan_gradient``: the norm of a zero vector joins the loss (finite loss, NaN gradient);
* ``nan_input``: one NaN in the input batch.

What ``nan_input`` does to the loss depends on the CPU kernel, not on the guard: oneDNN's fused
MatMul+BiasAdd+ReLU maps NaN to 0 on some CPUs (AMD Zen 4 and later), so the loss stays finite
while the first layer's gradient (x^T . delta) is NaN; elsewhere the NaN reaches the loss.
`LOSS_KINDS` and `SURE_CULPRITS` say what holds on every kernel, and tests assert those.
"""

import dataclasses
from typing import Dict, Optional

import numpy as np
import tensorflow as tf
import tf_slim as slim

import slim_nanguard

FAULTS = ("nan_loss", "inf_loss", "nan_gradient", "nan_input")

# The loss kinds a fault can give, on any CPU kernel.
LOSS_KINDS = {
    "nan_loss": {"nan"},
    "inf_loss": {"inf"},
    "nan_gradient": {"finite"},
    "nan_input": {"nan", "finite"},
}

# The variables whose gradient a fault makes non-finite on any CPU kernel.
SURE_CULPRITS = {
    "nan_loss": (),
    "inf_loss": (),
    "nan_gradient": ("logits/weights",),
    "nan_input": ("fc1/weights",),
}


def loss_kind(value) -> str:
    """``nan``, ``inf`` or ``finite``: the kind of a loss value, as a `NanEvent` names it."""
    return "nan" if np.isnan(value) else "inf" if np.isinf(value) else "finite"


BATCH = 8
FEATURES = 4


@dataclasses.dataclass
class Model:
    graph: tf.Graph
    x: tf.Tensor
    y: tf.Tensor
    loss: tf.Tensor
    offset: tf.Tensor
    norm_scale: tf.Tensor
    train_op: tf.Tensor
    global_step: tf.Variable
    moving_mean: tf.Variable

    def feed(self, step_seed: int, *faults: Optional[str]) -> Dict:
        """The feed of batch `step_seed`, with every fault in `faults` (None for none)."""
        rng = np.random.RandomState(step_seed)
        x = rng.randn(BATCH, FEATURES).astype(np.float32)
        y = (x[:, 0] > 0).astype(np.int64)
        feed = {self.x: x, self.y: y}
        for fault in faults:
            if fault == "nan_loss":
                feed[self.offset] = np.float32(np.nan)
            elif fault == "inf_loss":
                feed[self.offset] = np.float32(np.inf)
            elif fault == "nan_gradient":
                feed[self.norm_scale] = np.float32(0.0)
            elif fault == "nan_input":
                x[3, 2] = np.nan
            elif fault is not None:
                raise ValueError(fault)
        return feed


def mark_judged(sess, train_op) -> None:
    """Says that this hand-written loop judges each hook-mode step itself.

    A hook-mode bad step that nothing judges (no NanLossHook) fails instead of being skipped
    unseen; a test that runs the train op in a plain session and checks the result itself
    calls this once per session. A no-op in check_numerics mode.
    """
    guard = slim_nanguard.get_guard(train_op)
    if guard is not None:  # None: tf-slim's own train op, as a baseline
        guard.mark_judged(sess)


def batches(faults: Optional[Dict[int, str]] = None, count: int = 1000):
    """`count` batches as arrays (x, y, loss offset, norm scale), with `faults` {index: kind}."""
    xs, ys, offsets, scales = [], [], [], []
    for i in range(count):
        rng = np.random.RandomState(1000 + i)
        x = rng.randn(BATCH, FEATURES).astype(np.float32)
        y = (x[:, 0] > 0).astype(np.int64)
        offset, scale = 0.0, 1.0
        fault = (faults or {}).get(i)
        if fault == "nan_loss":
            offset = np.nan
        elif fault == "inf_loss":
            offset = np.inf
        elif fault == "nan_gradient":
            scale = 0.0
        elif fault == "nan_input":
            x[3, 2] = np.nan
        elif fault is not None:
            raise ValueError(fault)
        xs.append(x), ys.append(y), offsets.append(offset), scales.append(scale)
    return (np.stack(xs), np.stack(ys), np.array(offsets, np.float32), np.array(scales, np.float32))


def build_model(
    *,
    optimizer: str = "adam",
    train_op_fn=None,
    faults: Optional[Dict[int, str]] = None,
    repeat: bool = False,
    **create_kwargs,
) -> Model:
    """Builds the MLP in a new graph; `train_op_fn` defaults to slim_nanguard's.

    Unless fed, each run takes the next batch of a `tf.data` pipeline of 1000 batches (for
    ever with `repeat`) in which the batches named in `faults` ({batch index: fault kind})
    are bad.
    """
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(1)
        data = tf.data.Dataset.from_tensor_slices(batches(faults))
        if repeat:
            data = data.repeat()
        bx, by, boffset, bscale = tf.compat.v1.data.make_one_shot_iterator(data).get_next()
        x = tf.compat.v1.placeholder_with_default(bx, [None, FEATURES], name="x")
        y = tf.compat.v1.placeholder_with_default(by, [None], name="y")
        offset = tf.compat.v1.placeholder_with_default(boffset, [], name="loss_offset")
        norm_scale = tf.compat.v1.placeholder_with_default(bscale, [], name="norm_scale")
        hidden = slim.fully_connected(x, 16, activation_fn=tf.nn.relu, scope="fc1")
        moving_mean = tf.compat.v1.get_variable(
            "moving_mean", [16], initializer=tf.compat.v1.zeros_initializer(), trainable=False
        )
        update = tf.compat.v1.assign_sub(
            moving_mean, (moving_mean - tf.reduce_mean(hidden, 0)) * 0.1
        )
        tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.UPDATE_OPS, update)
        logits = slim.fully_connected(hidden, 2, activation_fn=None, scope="logits")
        loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(y, logits)
        # A norm whose gradient is NaN when norm_scale is 0 (d|v|/dv at v = 0).
        w = tf.compat.v1.trainable_variables("logits")[0]
        loss = loss + 1e-3 * tf.norm(w * norm_scale) + offset
        opt = (
            tf.compat.v1.train.AdamOptimizer(0.01)
            if optimizer == "adam"
            else tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
            if optimizer == "momentum"
            else tf.compat.v1.train.GradientDescentOptimizer(0.1)
        )
        train_op_fn = train_op_fn or slim_nanguard.create_train_op
        train_op = train_op_fn(loss, opt, **create_kwargs)
        global_step = tf.compat.v1.train.get_global_step()
    return Model(graph, x, y, loss, offset, norm_scale, train_op, global_step, moving_mean)


def state(sess, graph: tf.Graph) -> Dict[str, np.ndarray]:
    """Every global variable's value (weights, slots, accumulators, global step, moving stats)."""
    variables = graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
    values = sess.run(variables)
    return {v.op.name: np.array(value) for v, value in zip(variables, values)}


def assert_state_equal(before: Dict, after: Dict) -> None:
    assert before.keys() == after.keys()
    changed = [name for name in before if not np.array_equal(before[name], after[name])]
    assert not changed, f"a bad step changed {changed}"


def assert_all_finite(values: Dict) -> None:
    bad = [name for name, value in values.items() if not np.all(np.isfinite(value))]
    assert not bad, f"non-finite values in {bad}"


class Snapshots(tf.compat.v1.train.SessionRunHook):
    """Records every global variable after each run, keyed by the global step value."""

    def __init__(self):
        self.by_step: Dict[int, Dict[str, np.ndarray]] = {}
        self.runs = 0

    def begin(self):
        self._graph = tf.compat.v1.get_default_graph()

    def after_run(self, run_context, run_values):
        self.runs += 1
        values = state(run_context.session, self._graph)
        self.by_step[int(values["global_step"])] = values


def checkpoint_values(path: str) -> Dict[str, np.ndarray]:
    reader = tf.train.load_checkpoint(path)
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


def all_checkpoints(logdir: str):
    """Every checkpoint prefix in `logdir` (from the index files, not the state file)."""
    import glob
    import os

    return sorted(p[: -len(".index")] for p in glob.glob(os.path.join(logdir, "*.index")))


def assert_no_poisoned_checkpoint(logdir: str) -> None:
    paths = all_checkpoints(logdir)
    assert paths, f"no checkpoint in {logdir}"
    for path in paths:
        assert slim_nanguard.non_finite_variables(path) == (), path
