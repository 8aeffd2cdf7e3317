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
`FAULTS` says, per fault, what holds on every kernel, and tests assert those.

Shared by the test files: `MODES` and `each_mode` (the two guard modes), `run_step` (one
session run, its error returned), and `run_monitored` (the hand-written
`MonitoredTrainingSession` loop of the seed notes).
"""

import dataclasses
import glob
import itertools
import math
import os
import subprocess
import sys
import threading
from typing import Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import pytest
import tensorflow as tf
import tf_slim as slim

import slim_nanguard
from slim_nanguard import _actions
from slim_nanguard import _spike

# The guard's two modes: name -> the `check_numerics` argument of `create_train_op`.
MODES = {"check_numerics": True, "hook": False}

# Runs a test once in each mode, as its `mode` argument.
each_mode = pytest.mark.parametrize("mode", sorted(MODES))


@dataclasses.dataclass(frozen=True)
class Fault:
    """A fault a batch can carry, and what it does on every CPU kernel.

    Attributes:
      loss_kinds: the kinds of loss (``nan``, ``inf``, ``finite``) it may give.
      sure_culprits: the variables whose gradient it makes non-finite on every kernel.
      loss_offset: what it adds to the loss.
      norm_scale: the scale of the norm whose gradient is NaN at 0.
      nan_input: whether it puts a NaN in the input batch.
      input_scale: what it multiplies the input batch by (finite: a spike, not a NaN).
      scaled_rows: the examples `input_scale` multiplies (empty: all of them).
    """

    loss_kinds: FrozenSet[str]
    sure_culprits: Tuple[str, ...] = ()
    loss_offset: float = 0.0
    norm_scale: float = 1.0
    nan_input: bool = False
    input_scale: float = 1.0
    scaled_rows: Tuple[int, ...] = ()

    def corrupt(self, x: np.ndarray) -> Tuple[float, float]:
        """Puts the fault's NaN (if any) in the batch `x`, scales it by `input_scale`; returns
        (loss offset, norm scale)."""
        if self.nan_input:
            x[3, 2] = np.nan
        rows = list(self.scaled_rows) or slice(None)
        x[rows] *= self.input_scale
        return self.loss_offset, self.norm_scale


FAULTS: Dict[str, Fault] = {
    "nan_loss": Fault(frozenset({"nan"}), loss_offset=np.nan),
    "inf_loss": Fault(frozenset({"inf"}), loss_offset=np.inf),
    "nan_gradient": Fault(frozenset({"finite"}), ("logits/weights",), norm_scale=0.0),
    "nan_input": Fault(frozenset({"nan", "finite"}), ("fc1/weights",), nan_input=True),
}
# Not in FAULTS (no NaN or Inf): every feature times -1,000 (the labels follow the sign of the
# first feature, so the model is confidently wrong), and the loss and the gradient norm jump,
# all finite. A bad step only for a train op with a spike policy.
SPIKE = "spike"
# The same in two examples of the batch only (5 and 2): the examples that carry the spike.
SPIKE_ROWS = "spike_rows"
SPIKING_EXAMPLES = (5, 2)
_OTHER_FAULTS = {
    SPIKE: Fault(frozenset({"finite"}), input_scale=-1000.0),
    SPIKE_ROWS: Fault(frozenset({"finite"}), input_scale=-1000.0, scaled_rows=SPIKING_EXAMPLES),
}

NO_FAULT = Fault(frozenset({"finite"}))


def fault(name: Optional[str]) -> Fault:
    """The fault named `name` (`NO_FAULT` for None); an unknown name is a ValueError."""
    if name is None:
        return NO_FAULT
    if name not in FAULTS and name not in _OTHER_FAULTS:
        raise ValueError(name)
    return FAULTS.get(name) or _OTHER_FAULTS[name]


def _batch(seed: int) -> Tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(seed)
    x = rng.randn(BATCH, FEATURES).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int64)


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
        x, y = _batch(step_seed)
        feed = {self.x: x, self.y: y}
        for name in faults:
            offset, scale = fault(name).corrupt(x)
            if offset != 0.0:
                feed[self.offset] = np.float32(offset)
            if scale != 1.0:
                feed[self.norm_scale] = np.float32(scale)
        return feed


def mark_judged(sess, train_op) -> None:
    """Says that this hand-written loop judges each hook-mode step itself.

    A hook-mode bad step that nothing judges (no NanLossHook) fails instead of being skipped
    unseen; a test that runs the train op in a plain session and checks the result itself
    calls this once per session. A no-op in check_numerics mode.
    """
    guard = slim_nanguard.get_guard(train_op)
    if guard is not None:  # None: tf-slim's own train op, as a baseline
        _actions.mark_judged(guard, sess)


def batches(faults: Optional[Dict[int, str]] = None, count: int = 1000):
    """`count` batches as arrays (x, y, loss offset, norm scale), with `faults` {index: kind}."""
    xs, ys, offsets, scales = [], [], [], []
    for i in range(count):
        x, y = _batch(1000 + i)
        offset, scale = fault((faults or {}).get(i)).corrupt(x)
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


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_table_script(script: str, *args: str) -> Tuple[List[str], List[List[str]]]:
    """Runs ``research/<script>`` with `args` from the repository root (this checkout first on
    PYTHONPATH); returns its non-blank stdout lines and the cells of each row of the Markdown
    table it prints, the header first and the separator row left out. A failed run fails."""
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "research", script), *args],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=path),
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    table = [line for line in lines if line.startswith("|")]
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table]
    return lines, cells[:1] + cells[2:]


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
    return sorted(p[: -len(".index")] for p in glob.glob(os.path.join(logdir, "*.index")))


def assert_no_poisoned_checkpoint(logdir: str) -> None:
    paths = all_checkpoints(logdir)
    assert paths, f"no checkpoint in {logdir}"
    for path in paths:
        assert slim_nanguard.non_finite_variables(path) == (), path


def saving_every(steps: int, saver, logdir: str, train_step_fn):
    """`train_step_fn` for `tf_slim.learning.train` that first saves a checkpoint with `saver`
    (the loop's) whenever the global step is a multiple of `steps` not saved yet, step 0 too.

    The Supervisor only saves by wall time (``save_interval_secs``), so which checkpoints exist
    would depend on the machine's speed; pass ``save_interval_secs=None`` with this instead.
    """
    saved = set()

    def train_step(sess, train_op, global_step, train_step_kwargs):
        step = int(sess.run(global_step))
        if step % steps == 0 and step not in saved:
            saved.add(step)
            saver.save(sess, os.path.join(logdir, "model.ckpt"), global_step=step)
        return train_step_fn(sess, train_op, global_step, train_step_kwargs)

    return train_step


def learning_train(train_op, logdir: str, train_step_fn, steps: int, **kwargs) -> None:
    """`tf_slim.learning.train` of `train_op` for `steps` steps, saving no checkpoint (and with
    the guard's saver, which never writes a NaN), `kwargs` its other arguments."""
    saver = slim_nanguard.FiniteSaver()
    slim.learning.train(
        train_op,
        logdir,
        train_step_fn=train_step_fn,
        number_of_steps=steps,
        saver=saver,
        save_interval_secs=None,
        **kwargs,
    )


def counted_summaries():
    """``(summary_op, runs)``: the default graph's merged summaries, and a semaphore each run
    of them releases (a test waits on it for tf-slim's summary thread, run by a timer)."""
    runs = threading.Semaphore(0)

    def release():
        runs.release()
        return np.int64(0)

    with tf.control_dependencies([tf.numpy_function(release, [], tf.int64)]):
        return tf.identity(tf.compat.v1.summary.merge_all()), runs


def run_step(sess, fetches, feed=None):
    """Runs `fetches` once; returns (value, None), or (None, error) on an InvalidArgumentError.

    The error is a check_numerics bad step's; a test asserts which outcome its mode gives.
    """
    try:
        return sess.run(fetches, feed), None
    except tf.errors.InvalidArgumentError as err:
        return None, err


@dataclasses.dataclass
class MonitoredRun:
    """What a `run_monitored` loop saw.

    Attributes:
      runs: the runs of the train op that returned.
      events: the `NanEvent` of each bad step the loop carried on from (none for a step that
        raised).
      error: the `NanLossDuringTrainingError` that ended the loop, if `catch_nan_error`.
      bad_step_changes: for each bad step that rolled nothing back, the variables it changed.
      final: every variable when the loop ended.
    """

    runs: int = 0
    events: List = dataclasses.field(default_factory=list)
    error: Optional[BaseException] = None
    bad_step_changes: List[List[str]] = dataclasses.field(default_factory=list)
    final: Dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


def run_monitored(
    train_op,
    *,
    hooks: Sequence = (),
    last_step: Optional[int] = None,
    feeds: Optional[Iterable[Dict]] = None,
    checkpoint_dir: Optional[str] = None,
    handle_numerics_errors: bool = False,
    catch_nan_error: bool = False,
    checkpoint_steps: int = 1,
) -> MonitoredRun:
    """The seed notes' loop: a `MonitoredTrainingSession` running `train_op` until it stops.

    Args:
      train_op: the train op; its graph is the one the session runs.
      hooks: the session's hooks.
      last_step: adds a `StopAtStepHook` at this global step.
      feeds: one feed per run; without them, the loop runs until the session should stop.
      checkpoint_dir: where the session saves a checkpoint every `checkpoint_steps` steps
        (none without it).
      handle_numerics_errors: a check_numerics-mode bad step's `InvalidArgumentError` goes to
        `slim_nanguard.handle_numerics_error`, as the README's loop does.
      catch_nan_error: a `NanLossDuringTrainingError` (ours or TensorFlow's) ends the loop
        and is returned as `error`; otherwise it propagates. Either way it leaves the session
        as it would leave the user's loop, so the hooks' `end` does not run.
    """
    graph = train_op.graph
    guard = slim_nanguard.get_guard(train_op)  # None: tf-slim's own train op, as a baseline
    hooks = list(hooks)
    if last_step is not None:
        hooks.append(tf.compat.v1.train.StopAtStepHook(last_step=last_step))
    step_kwargs = dict(handle_numerics_errors=handle_numerics_errors, checkpoint_dir=checkpoint_dir)
    run = MonitoredRun()
    try:
        with (
            graph.as_default(),
            tf.compat.v1.train.MonitoredTrainingSession(
                hooks=hooks,
                checkpoint_dir=checkpoint_dir,
                save_checkpoint_steps=checkpoint_steps if checkpoint_dir else None,
                save_summaries_steps=None,
                log_step_count_steps=None,
            ) as sess,
        ):
            # Through the raw session: reading through `sess` would run the hooks.
            def read():
                return sess.run_step_fn(lambda step_context: state(step_context.session, graph))

            try:
                for feed in itertools.repeat(None) if feeds is None else feeds:
                    if sess.should_stop():
                        break
                    if guard is None:
                        sess.run(train_op, feed)
                        run.runs += 1
                    else:
                        _guarded_step(sess, train_op, feed, guard, read, run, **step_kwargs)
            except tf.compat.v1.train.NanLossDuringTrainingError as err:
                run.error, run.final = err, read()
                raise
            run.final = read()
    except tf.compat.v1.train.NanLossDuringTrainingError as err:
        if not (catch_nan_error and err is run.error):
            raise
    return run


def _guarded_step(
    sess, train_op, feed, guard, read, run, *, handle_numerics_errors, checkpoint_dir
):
    """One step of `run_monitored`: its event, and what it changed if it was bad."""
    before = read()
    bad_steps, rollbacks = guard.state.total_bad_steps, guard.state.rollbacks
    try:
        try:
            sess.run(train_op, feed)
            run.runs += 1
        except tf.errors.InvalidArgumentError as err:
            if not handle_numerics_errors:
                raise
            run.events.append(
                slim_nanguard.handle_numerics_error(sess, err, checkpoint_dir=checkpoint_dir)
            )
        else:
            if guard.state.total_bad_steps != bad_steps:  # hook mode: the hook judged it
                run.events.append(guard.last_event)
    finally:
        # After the policy acted (even by raising); a rollback rightly writes.
        if guard.state.total_bad_steps != bad_steps and guard.state.rollbacks == rollbacks:
            after = read()
            run.bad_step_changes.append(
                [name for name in before if not np.array_equal(before[name], after[name])]
            )


def reference_z_scores(
    accepted: Sequence[Tuple[float, float]],
    value: Tuple[float, float],
    *,
    window: int = 128,
    warmup: int = 20,
    sigma: float = 6.0,
) -> np.ndarray:
    """`_spike.SpikeTest`'s z-scores, in NumPy, of ``value = (loss, norm)`` against the last
    `window` `accepted` pairs (no warm-up gate); NaN for a value not positive or a column with
    no entry. The test's oracle: the same arithmetic written apart from the graph."""
    accepted = np.asarray(accepted, dtype=np.float64).reshape(-1, len(_spike.COLUMNS))
    index = np.arange(len(accepted))
    keep = index >= len(accepted) - window
    scores = []
    for column, current in enumerate(value):
        positive = keep & (accepted[:, column] > 0)
        warm = positive & (index < warmup)
        logs = np.log(np.where(positive, accepted[:, column], 1.0))
        entries = int(warm.sum())
        if entries >= _spike.MIN_WARMUP_ENTRIES:  # The lower median, as the graph takes it.
            center = np.sort(logs[warm])[(entries - 1) // 2]
            distance = np.abs(logs - center)
            spread = np.sort(distance[warm])[(entries - 1) // 2]
            bar = max(
                _spike.OUTLIER_SIGMAS * sigma * max(_spike.MAD_SCALE * spread, _spike.FLOOR),
                math.log(_spike.OUTLIER_RATIO),
            )
            positive &= ~(warm & (distance > bar))
        if current <= 0 or not positive.any():
            scores.append(np.nan)
            continue
        std = max(logs[positive].std(), _spike.FLOOR)
        scores.append((np.log(current) - logs[positive].mean()) / std)
    return np.asarray(scores)
