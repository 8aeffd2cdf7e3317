"""Runs that judge the spike guard's judgement: traces, unguarded and under candidate rules.

Each run is a small tf.compat.v1 graph trained in a plain session loop, one numpy batch fed
per step (batch ``i`` is the same whatever happened before, so runs compare step by step).
Per step it records the loss, the global gradient norm, the norm of the update the optimizer
applied, and for Adam the norms of its first and second moments. A candidate rule of
`spike_rules` may judge each step: a rejected step is put back (every variable, the
optimizer's slots included, restored to its value before the step), as the guard's gate does,
so on a fixed batch a rejected step repeats exactly and after a learning-rate jump the weights
stay where the last accepted step left them.

research/ is not installed with the package (the wheel holds the library and the four
console commands): run it from a clone, with this checkout's slim_nanguard importable
(``pip install -e .`` or ``PYTHONPATH=.``).

Usage, from the repository root::

    python research/spike_traces.py                 # every run, every rule: the tables
    python research/spike_traces.py --runs=level_shift,lr_jump --rules=today,shift5
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from typing import Callable, Dict, List, Optional

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import spike_rules  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Run:
    """A training run to trace.

    Attributes:
      name: Key on the command line.
      what: One line for the tables.
      kind: ``"shift"``, ``"diverge"``, ``"state"``, ``"clean"`` or ``"spike"``: what the
        guard should do (adapt; stop; move past; flag nothing; reject the planted steps).
      steps: Steps to run.
      model: ``"linear"``, ``"mlp"``, ``"deep"``, ``"deep_linear"`` or ``"bn"``.
      optimizer: ``"sgd"``, ``"momentum"`` or ``"adam"``.
      lr: ``fn(step) -> learning rate``.
      data: ``fn(step, rng) -> (x, y)``, the batch of a step.
      planted: ``{step: factor}``: the batches scaled (a planted spike).
    """

    name: str
    what: str
    kind: str
    steps: int
    model: str
    optimizer: str
    lr: Callable[[int], float]
    data: Callable[[int, np.random.RandomState], tuple]
    planted: Dict[int, float] = dataclasses.field(default_factory=dict)


IN, OUT, CLASSES = 16, 16, 10


def _teacher(seed: int, shape) -> np.ndarray:
    return np.random.RandomState(seed).normal(size=shape) / math.sqrt(shape[0])


def _regression(noise: Callable[[int], float], batch: int = 64, switch=None, scale=1.0):
    """Batches of ``y = x W + noise`` (W's entries of deviation `scale`/4); from step
    `switch` on, another teacher."""
    w1, w2 = scale * _teacher(1, (IN, OUT)), scale * _teacher(2, (IN, OUT))

    def data(step, rng):
        x = rng.normal(size=(batch, IN))
        w = w2 if switch is not None and step >= switch else w1
        return x, x @ w + noise(step) * rng.normal(size=(batch, OUT))

    return data


def _classes(batch: int = 32, label_noise: float = 0.0, switch=None, scale_after=None):
    """Batches labelled by a fixed linear teacher; `label_noise` of them at random; from step
    `switch` on another teacher; from `scale_after` on, inputs x3 + 1 (other augmentation)."""
    w1, w2 = _teacher(3, (64, CLASSES)), _teacher(4, (64, CLASSES))

    def data(step, rng):
        x = rng.normal(size=(batch, 64))
        w = w2 if switch is not None and step >= switch else w1
        y = np.argmax(x @ w, axis=1)
        noisy = rng.uniform(size=batch) < label_noise
        y = np.where(noisy, rng.randint(CLASSES, size=batch), y)
        if scale_after is not None and step >= scale_after:
            x = 3.0 * x + 1.0
        return x, y

    return data


def _fixed(batch: int = 128):
    x = np.random.RandomState(5).normal(size=(batch, 64))
    y = np.random.RandomState(6).randint(CLASSES, size=batch)
    return lambda step, rng: (x, y)


def _cosine_restarts(base: float, period: int):
    return lambda s: base * 0.5 * (1 + math.cos(math.pi * (s % period) / period))


def _planted(name: str, what: str, opt: str, lr: float, planted: Dict[int, float]) -> Run:
    """An MLP run of 400 steps with batches scaled at the `planted` steps."""
    return Run(name, what, "spike", 400, "mlp", opt, lambda s: lr, _classes(), planted=planted)


RUNS: Dict[str, Run] = {
    r.name: r
    for r in (
        Run(
            "level_shift",
            "linear, noisier data from step 300 (loss ~1 -> ~16)",
            "shift",
            600,
            "linear",
            "sgd",
            lambda s: 0.05,
            _regression(lambda s: 4.0 if s >= 300 else 1.0),
        ),
        Run(
            "lr_jump",
            "linear, learning rate 0.05 -> 50 at step 120",
            "diverge",
            200,
            "linear",
            "sgd",
            lambda s: 50.0 if s >= 120 else 0.05,
            _regression(lambda s: 1.0),
        ),
        Run(
            "lr_jump_mlp",
            "MLP, momentum, learning rate 0.05 -> 50 at step 120",
            "diverge",
            200,
            "mlp",
            "momentum",
            lambda s: 50.0 if s >= 120 else 0.05,
            _classes(),
        ),
        Run(
            "lr_jump_adam",
            "MLP, Adam, learning rate 1e-3 -> 1 at step 120",
            "diverge",
            200,
            "mlp",
            "adam",
            lambda s: 1.0 if s >= 120 else 1e-3,
            _classes(),
        ),
        Run(
            "fixed_batch",
            "50 x FC(64), SGD 0.01, one fixed batch of 128",
            "state",
            1500,
            "deep",
            "sgd",
            lambda s: 0.01,
            _fixed(),
        ),
        Run(
            "deep_linear",
            "3-layer linear 16x16, init 1e-2, SGD 0.05, batch 64 (escapes its saddle ~800)",
            "clean",
            1500,
            "deep_linear",
            "sgd",
            lambda s: 0.05,
            _regression(lambda s: 0.1, scale=3.0),
        ),
        Run(
            "lr_warmup",
            "MLP, SGD, learning rate warm-up 0 -> 1.0 over 200 steps",
            "clean",
            500,
            "mlp",
            "sgd",
            lambda s: min(1.0, (s + 1) / 200),
            _classes(),
        ),
        Run(
            "lr_restart",
            "MLP, momentum, cosine 0.1 restarted every 150 steps",
            "clean",
            600,
            "mlp",
            "momentum",
            _cosine_restarts(0.1, 150),
            _classes(),
        ),
        Run(
            "bn_batch4",
            "MLP + batch norm, batch 4, momentum 0.05",
            "clean",
            600,
            "bn",
            "momentum",
            lambda s: 0.05,
            _classes(batch=4),
        ),
        Run(
            "label_noise",
            "MLP, SGD 0.1, 40% random labels",
            "clean",
            600,
            "mlp",
            "sgd",
            lambda s: 0.1,
            _classes(label_noise=0.4),
        ),
        Run(
            "adam_high",
            "MLP, Adam 1e-2",
            "clean",
            600,
            "mlp",
            "adam",
            lambda s: 1e-2,
            _classes(),
        ),
        Run(
            "data_switch",
            "MLP, momentum, another teacher from step 300",
            "clean",
            600,
            "mlp",
            "momentum",
            lambda s: 0.05,
            _classes(switch=300),
        ),
        Run(
            "resume_other",
            "MLP, momentum, inputs x3 + 1 from step 300 (a resume, other augmentation)",
            "clean",
            600,
            "mlp",
            "momentum",
            lambda s: 0.05,
            _classes(scale_after=300),
        ),
        _planted(
            "planted",
            "MLP, momentum 0.05, batch x1000 at step 100 (spike_skip.cfg)",
            "momentum",
            0.05,
            {100: 1000.0},
        ),
        _planted(
            "warmup_spike",
            "MLP, Adam 1e-3, batch x1000 at step 10 (warm-up) and at step 60",
            "adam",
            1e-3,
            {10: 1000.0, 60: 1000.0},
        ),
        _planted(
            "warmup_spike_x30",
            "MLP, Adam 1e-3, batch x1000 at step 10 (warm-up), x30 at step 60",
            "adam",
            1e-3,
            {10: 1000.0, 60: 30.0},
        ),
        _planted(
            "planted_x30",
            "MLP, Adam 1e-3, batch x30 at step 60 (no warm-up spike)",
            "adam",
            1e-3,
            {60: 30.0},
        ),
        _planted(
            "burst4",
            "MLP, momentum 0.05, batches x1000 at steps 200-203 (a bad shard)",
            "momentum",
            0.05,
            {s: 1000.0 for s in range(200, 204)},
        ),
        _planted(
            "burst8",
            "MLP, momentum 0.05, batches x1000 at steps 200-207 (a bad shard)",
            "momentum",
            0.05,
            {s: 1000.0 for s in range(200, 208)},
        ),
        _planted(
            "warmup_spike_x10",
            "MLP, Adam 1e-3, batch x1000 at step 10 (warm-up), x10 at step 60",
            "adam",
            1e-3,
            {10: 1000.0, 60: 10.0},
        ),
        _planted(
            "planted_x10",
            "MLP, Adam 1e-3, batch x10 at step 60 (no warm-up spike)",
            "adam",
            1e-3,
            {60: 10.0},
        ),
    )
}


@dataclasses.dataclass
class Trace:
    """Per step of a run (arrays of ``steps``): values, and what the judge did."""

    loss: np.ndarray
    norm: np.ndarray
    update: np.ndarray
    m: np.ndarray
    v: np.ndarray
    action: List[str]
    events: List[dict]
    seconds: float
    final: float = math.nan  # the loss of the last weights on 8 held-out batches of the last step

    def values(self, step: int) -> Dict[str, float]:
        m_over_v = self.m[step] / math.sqrt(self.v[step]) if self.v[step] > 0 else math.nan
        return {
            "loss": float(self.loss[step]),
            "norm": float(self.norm[step]),
            "update": float(self.update[step]),
            "m_over_v": float(m_over_v),
        }


def _batch_norm(net, tf, decay: float = 0.99):
    """Batch norm of the batch's moments, with moving averages updated in UPDATE_OPS."""
    width = net.shape[-1]
    with tf.compat.v1.variable_scope(None, default_name="bn"):
        beta = tf.compat.v1.get_variable("beta", [width], initializer=tf.zeros_initializer())
        gamma = tf.compat.v1.get_variable("gamma", [width], initializer=tf.ones_initializer())
        mean, var = tf.nn.moments(net, [0])
        for name, value, start in (("mean", mean, 0.0), ("variance", var, 1.0)):
            moving = tf.compat.v1.get_variable(
                f"moving_{name}",
                [width],
                initializer=tf.constant_initializer(start),
                trainable=False,
            )
            update = moving.assign(decay * moving + (1 - decay) * value)
            tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.UPDATE_OPS, update)
    return tf.nn.batch_normalization(net, mean, var, beta, gamma, 1e-3)


def placeholders(run: Run, tf):
    """Placeholders of a batch of `run`: (x, y)."""
    regression = run.model in ("linear", "deep_linear")
    x = tf.compat.v1.placeholder(tf.float32, [None, IN if regression else 64])
    y = tf.compat.v1.placeholder(
        tf.float32 if regression else tf.int64, [None, OUT] if regression else [None]
    )
    return x, y


def model_loss(run: Run, x, y, tf):
    """The loss of `run`'s model on the batch ``(x, y)``, built in the current graph."""
    out = _network(run, x, tf)
    if run.model in ("linear", "deep_linear"):
        return tf.reduce_mean(tf.square(out - y))
    return tf.compat.v1.losses.sparse_softmax_cross_entropy(y, out)


def optimizer(run: Run, lr, tf):
    """`run`'s optimizer at learning rate `lr` (a float or a scalar tensor)."""
    return {
        "sgd": lambda: tf.compat.v1.train.GradientDescentOptimizer(lr),
        "momentum": lambda: tf.compat.v1.train.MomentumOptimizer(lr, 0.9),
        "adam": lambda: tf.compat.v1.train.AdamOptimizer(lr),
    }[run.optimizer]()


def _dense(net, units, activation=None, init=None, bias=True):
    import tensorflow as tf
    import tf_slim

    return tf_slim.fully_connected(
        net,
        units,
        activation_fn=activation,
        weights_initializer=init,
        biases_initializer=tf.zeros_initializer() if bias else None,
    )


def _network(run: Run, x, tf):
    import tf_slim

    out = x
    if run.model == "linear":
        return _dense(x, OUT, init=tf.zeros_initializer(), bias=False)
    if run.model == "deep_linear":
        init = tf.compat.v1.random_normal_initializer(stddev=1e-2)
        for _ in range(3):
            out = _dense(out, OUT, init=init, bias=False)
        return out
    if run.model == "deep":
        he = tf_slim.variance_scaling_initializer(2.0)
        for _ in range(50):
            out = _dense(out, 64, tf.nn.relu, he)
        return _dense(out, CLASSES, init=he)
    init = tf.compat.v1.glorot_uniform_initializer()
    for _ in range(2):
        if run.model == "bn":
            out = tf.nn.relu(_batch_norm(_dense(out, 128, None, init, bias=False), tf))
        else:
            out = _dense(out, 128, tf.nn.relu, init)
    return _dense(out, CLASSES, init=init)


def _build(run: Run, tf):
    """The graph of `run`: (placeholders, loss, norm, train op, trainable vars, slots)."""
    x, y = placeholders(run, tf)
    lr = tf.compat.v1.placeholder(tf.float32, [])
    loss = model_loss(run, x, y, tf)
    opt = optimizer(run, lr, tf)
    pairs = opt.compute_gradients(loss)
    norm = tf.linalg.global_norm([g for g, _ in pairs])
    with tf.control_dependencies(tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
        train = opt.apply_gradients(pairs)
    variables = [v for _, v in pairs]
    slots = {}
    if run.optimizer == "adam":
        slots = {k: [opt.get_slot(v, k) for v in variables] for k in ("m", "v")}
    return (x, y, lr), loss, norm, train, variables, slots


def trace(run: Run, rule: Optional[spike_rules.Rule] = None, seed: int = 0) -> Trace:
    """Trains `run`, judged by `rule` (None: unguarded, every step applied)."""
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(seed)
        (x, y, lr), loss, norm, train, variables, slots = _build(run, tf)
        everything = tf.compat.v1.global_variables()
        holders = [tf.compat.v1.placeholder(v.dtype.base_dtype, v.shape) for v in everything]
        restore = tf.group(*[v.assign(h) for v, h in zip(everything, holders)])
        slot_norms = [tf.linalg.global_norm(slots[k]) for k in ("m", "v")] if slots else []
        init = tf.compat.v1.global_variables_initializer()
        where = [next(i for i, e in enumerate(everything) if e is v) for v in variables]
    judge = spike_rules.Judge(rule) if rule else None
    n = run.steps
    out = {k: np.full(n, np.nan) for k in ("loss", "norm", "update", "m", "v")}
    actions: List[str] = []
    start = time.time()
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(init)
        for step in range(n):
            bx, by = run.data(step, np.random.RandomState(1000 + step))
            bx = bx * run.planted.get(step, 1.0)
            feed = {x: bx, y: by, lr: run.lr(step)}
            before = sess.run(everything)
            trainable_before = [before[i] for i in where]
            out["loss"][step], out["norm"][step], _ = sess.run([loss, norm, train], feed)
            after = sess.run(variables)
            out["update"][step] = math.sqrt(
                sum(float(np.sum((a - b) ** 2)) for a, b in zip(after, trainable_before))
            )
            if slot_norms:
                out["m"][step], out["v"][step] = sess.run(slot_norms)
            values = Trace(**out, action=[], events=[], seconds=0).values(step)
            action = judge.decide(step, values) if judge else spike_rules.ACCEPT
            actions.append(action)
            if action not in (spike_rules.ACCEPT, spike_rules.ADAPT):
                sess.run(restore, dict(zip(holders, before)))
            if action == spike_rules.STOP:
                break
        held_out = []
        for i in range(8):
            bx, by = run.data(run.steps - 1, np.random.RandomState(10**6 + i))
            held_out.append(sess.run(loss, {x: bx, y: by}))
    return Trace(
        **out,
        action=actions,
        events=judge.events if judge else [],
        seconds=time.time() - start,
        final=float(np.mean(held_out)),
    )


def cell(judged: Trace, unguarded: Trace) -> str:
    """What a rule did on a run, in a table cell: flags (the first z-scores), shifts, stop,
    and the held-out loss of its last weights over the unguarded run's."""
    spikes = [e for e in judged.events if e["kind"] == spike_rules.SPIKE]
    parts = [f"{len(spikes)} flagged"]
    if spikes:
        first = spikes[0]
        z = ", ".join(
            f"{k} {v:.1f}" for k, v in first["z"].items() if k in ("loss", "norm", "update")
        )
        parts[0] += f" (first: step {first['step']}, z {z})"
    for shift in (e for e in judged.events if e["kind"] == spike_rules.ADAPT):
        old, new = shift["from"]["loss"], shift["to"]["loss"]
        parts.append(f"shift at {shift['step']}: loss {old:.3g} -> {new:.3g}")
    for burst in (e for e in judged.events if e["kind"] == spike_rules.BURST):
        parts.append(f"back under the old level at {burst['step']}: a burst, not a level")
    nonfinite = [e for e in judged.events if e["kind"] == spike_rules.NONFINITE]
    if nonfinite:
        parts.append(f"{len(nonfinite)} non-finite from {nonfinite[0]['step']}")
    stops = [e for e in judged.events if e["kind"] == spike_rules.STOP]
    if stops:
        parts.append(f"**stopped at {stops[0]['step']}**")
    parts.append(f"held-out loss x{_ratio(judged.final, unguarded.final)}")
    return "; ".join(parts)


def _ratio(a: float, b: float) -> str:
    if not (math.isfinite(a) and math.isfinite(b)):
        return f"({a:.3g} vs {b:.3g})"
    return f"{a / b:.2f}"


def main(argv) -> int:
    from absl import flags

    names = flags.FLAGS.runs or list(RUNS)
    rules = [spike_rules.RULES[r] for r in flags.FLAGS.rules]
    print("| run | what | unguarded | " + " | ".join(r.name for r in rules) + " |")
    print("|---|---|---|" + "---|" * len(rules))
    for name in names:
        run = RUNS[name]
        unguarded = trace(run)
        bad = np.flatnonzero(~np.isfinite(unguarded.loss))
        first = f"non-finite from {bad[0]}; " if len(bad) else ""
        cells = [cell(trace(run, rule), unguarded) for rule in rules]
        print(
            f"| {name} ({run.kind}) | {run.what} | {first}held-out loss {unguarded.final:.3g} | "
            + " | ".join(cells)
            + " |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    from absl import app
    from absl import flags

    flags.DEFINE_list("runs", [], "Runs (keys of RUNS; default: all).")
    flags.DEFINE_list("rules", list(spike_rules.RULES), "Rules (keys of spike_rules.RULES).")
    app.run(main)
