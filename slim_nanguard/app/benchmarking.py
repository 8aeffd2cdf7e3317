"""What guarding a TF-Slim train op costs, measured side by side with the alternatives.

`run_benchmark` is what ``slim-nanguard-benchmark`` (``scripts/benchmark.py``) calls. For each
model and optimizer it builds every variant in a graph (variants that differ only in the
loop or the hooks share one), with `Settings.replicas` sessions per variant (each with its own
variables), all alive at once in this one process, then::

    warm up every session (graph rewrites, kernel creation, first allocations)
    for round in rounds:                          # the machine is shared: interleave
        for chunk in chunks:
            for session in shuffled(all sessions):  # a new order each time
                time `steps` runs of its train op   # wall (time.perf_counter) and CPU
                                                    # (time.process_time); gc off
        time[variant] = its fastest chunk, over its sessions  # drops the moments another
                                                              # process ran, and bad layouts
        ratio[variant] = time[variant] / time[reference of variant]   # within the round
    report the median ms/step, and the median ratio with its min and max over the rounds,
      in wall time and in CPU time (each chunk's CPU time, the least per round, alike)
    trace a few steps of each variant: the most bytes its step holds at once
    for the skip and rollback policies: time bad steps (a NaN in the batch), count the
      global steps each lost (their variants run with the autopsy off, so that a bad step's
      time is the guard's own, not the replay's)

The reference of a variant is the unguarded tf-slim train op in the same loop: a plain
``session.run`` loop or a `MonitoredTrainingSession`. ``enable_check_numerics`` cannot build
on reference variables (it wraps their ref output and the initializer breaks), so it and its
own reference use resource variables; every other variant uses what tf-slim makes under
``disable_v2_behavior()``, reference variables.

Every step feeds the same constant batch held in the graph (a ``placeholder_with_default``,
so that a bad batch can be fed without changing the graph); no input pipeline is timed.

Two sessions of one graph can differ by 5-15% on the wide layer for as long as they live
(where their buffers landed); so can a session that page-faults its step's tensors back in
every step because malloc gave them back to the system. The first is why a variant gets
several sessions and its fastest counts; the second is why the launcher tunes glibc malloc
before TensorFlow allocates anything (``--keep_freed_memory``), and why the results record
page faults per step. The ``baseline_again`` variant, a second copy of the reference, shows
what resolution is left.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
import tf_slim

import slim_nanguard
from slim_nanguard.app import models

# ---------------------------------------------------------------------------- models


def _minor_page_faults() -> int:
    """The process's minor page faults so far, or 0 where `resource` is missing (Windows)."""
    try:
        import resource  # POSIX only: imported here so the module imports everywhere
    except ImportError:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model to time: a name, a batch shape and a builder of its logits.

    Attributes:
      name: Key used on the command line and in the results.
      description: One line for the report (``{depth}`` and ``{variables}`` are filled in).
      input_shape: Shape of one example.
      batch_size: Examples per step.
      build: ``fn(images, depth) -> logits`` (10 classes), building in the current graph;
        ``depth`` is `Settings.deep_layers`, which only the deep net uses.
    """

    name: str
    description: str
    input_shape: Tuple[int, ...]
    batch_size: int
    build: Callable[[tf.Tensor, int], tf.Tensor]


NUM_CLASSES = 10


def _mlp(images: tf.Tensor, depth: int) -> tf.Tensor:
    del depth
    return models.mlp(images, NUM_CLASSES, True, hidden_units=(256, 256))


def _lenet(images: tf.Tensor, depth: int) -> tf.Tensor:
    del depth
    return models.lenet(images, NUM_CLASSES, True)


def _deep(images: tf.Tensor, depth: int, width: int = 64) -> tf.Tensor:
    # He initialisation keeps 50 ReLU layers' activations (and gradients) in range.
    with tf.compat.v1.variable_scope("Deep"):
        with tf_slim.arg_scope(
            [tf_slim.fully_connected],
            activation_fn=tf.nn.relu,
            weights_initializer=tf_slim.variance_scaling_initializer(2.0),
        ):
            net = images
            for index in range(depth):
                net = tf_slim.fully_connected(net, width, scope=f"fc{index + 1}")
            return tf_slim.fully_connected(net, NUM_CLASSES, activation_fn=None, scope="logits")


def _wide(images: tf.Tensor, depth: int) -> tf.Tensor:
    del depth
    return models.mlp(images, NUM_CLASSES, True, hidden_units=(2048, 2048), scope="Wide")


def _cifarnet(images: tf.Tensor, depth: int) -> tf.Tensor:
    del depth
    return models.cifarnet(images, NUM_CLASSES, True)


def _mobilenet(images: tf.Tensor, depth: int) -> tf.Tensor:
    del depth
    return models.mobilenet_v1(images, NUM_CLASSES, True, depth_multiplier=0.5)


MODELS: Dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("mlp", "MLP 784-256-256-10, batch 128", (784,), 128, _mlp),
        ModelSpec("lenet", "LeNet CNN on 8x8x1 digits, batch 64", (8, 8, 1), 64, _lenet),
        ModelSpec(
            "deep", "{depth} x FC(64) + logits, {variables} variables, batch 32", (64,), 32, _deep
        ),
        ModelSpec("wide", "784-2048-2048-10, 5.8M parameters, batch 32", (784,), 32, _wide),
        ModelSpec(
            "cifarnet", "CifarNet on 32x32x3, 1.8M parameters, batch 32", (32, 32, 3), 32, _cifarnet
        ),
        ModelSpec(
            "mobilenet",
            "MobileNet v1 x0.5 on 32x32x3, batch norm, 83 variables, batch 32",
            (32, 32, 3),
            32,
            _mobilenet,
        ),
    )
}

OPTIMIZERS: Dict[str, Callable[[], tf.compat.v1.train.Optimizer]] = {
    "sgd": lambda: tf.compat.v1.train.GradientDescentOptimizer(0.01),
    "adam": lambda: tf.compat.v1.train.AdamOptimizer(1e-3),
}

# ---------------------------------------------------------------------------- variants

PLAIN = "session"
MTS = "MonitoredTrainingSession"

# Large enough that the benchmark's repeated bad steps never make the guard give up.
_PATIENT = dict(max_consecutive_bad_steps=1000, max_rollbacks=1000)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of building and running a train op.

    Attributes:
      name: Key in the results.
      label: What the table shows.
      loop: `PLAIN` (``session.run`` in a loop) or `MTS` (`MonitoredTrainingSession`).
      reference: Name of the variant its ratio is taken against (None: itself).
      build: ``fn(loss, optimizer) -> train_op``, in the current graph.
      hooks: ``fn(train_op, checkpoint_dir) -> [SessionRunHook]`` (MTS loop only).
      resource_variables: Build the model on resource variables.
      check_numerics_callback: Build with `tf.debugging.enable_check_numerics` on.
      nan_policy: The guard's policy, for our variants.
      ours: True for slim_nanguard's own variants.
      bad_step: Also time bad steps of it (our skip and rollback variants, which run with
        ``autopsy_max_steps=0``: the autopsy's replay is not the guard's cost).
      graph_of: Name of a variant (earlier in `VARIANTS`) whose graph this one runs too, in
        sessions of its own: it differs only in the loop or the hooks.
    """

    name: str
    label: str
    loop: str
    reference: Optional[str]
    build: Callable[[tf.Tensor, Any], tf.Tensor]
    hooks: Optional[Callable[[tf.Tensor, str], list]] = None
    resource_variables: bool = False
    check_numerics_callback: bool = False
    nan_policy: Optional[str] = None
    ours: bool = False
    bad_step: bool = False
    graph_of: Optional[str] = None


def _slim(check_numerics: bool):
    def build(loss, optimizer):
        return tf_slim.learning.create_train_op(loss, optimizer, check_numerics=check_numerics)

    return build


def _check_each_gradient(loss, optimizer):
    def transform(grads_and_vars):
        return [
            (tf.debugging.check_numerics(g, f"gradient of {v.op.name}"), v)
            for g, v in grads_and_vars
        ]

    return tf_slim.training.create_train_op(
        loss, optimizer, transform_grads_fn=transform, check_numerics=False
    )


def _loss_scale_skip(loss, optimizer):
    # A dynamic loss scale of 1 that never grows: no scaling, and a skipped step (a tf.cond
    # over one all-finite flag) whenever a gradient is NaN or Inf.
    scale = tf.compat.v1.mixed_precision.DynamicLossScale(
        initial_loss_scale=1, increment_period=2**31 - 1, multiplier=2
    )
    wrapped = tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer(optimizer, scale)
    return tf_slim.learning.create_train_op(loss, wrapped, check_numerics=False)


# The spike variants' threshold. A good step runs every node of the spike test whatever the
# threshold; at 6 deviations the deep net at batch 32 trips on a real loss spike of the
# repeated batch after about 300 steps, and skips that same step from then on, so that the
# run would time bad steps, not the guard.
_SPIKE_SIGMA = 1000.0
# The fewest untraced steps before a profile: a good step of the spike test past its warm-up
# (20 accepted steps by default, whose writes trim the warm-up's outliers) is what it measures.
PROFILE_WARMUP_STEPS = 30


def _ours(
    check_numerics: bool, policy: str, autopsy: bool = True, spike_policy: Optional[str] = None
):
    def build(loss, optimizer):
        if not autopsy:  # No batch kept on bad steps: what the autopsy's capture costs.
            config = slim_nanguard.GuardConfig(nan_policy=policy, autopsy_max_steps=0, **_PATIENT)
            return slim_nanguard.create_train_op(
                loss, optimizer, check_numerics=check_numerics, config=config
            )
        return slim_nanguard.create_train_op(
            loss,
            optimizer,
            check_numerics=check_numerics,
            nan_policy=policy,
            spike_policy=spike_policy,
            **(dict(spike_sigma=_SPIKE_SIGMA) if spike_policy else {}),
            **_PATIENT,
        )

    return build


def _nan_tensor_hook(train_op, checkpoint_dir):
    del checkpoint_dir
    loss = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.LOSSES)[0]
    return [tf.compat.v1.train.NanTensorHook(loss)]


def _our_hook(train_op, checkpoint_dir):
    return [slim_nanguard.nan_hook(train_op, checkpoint_dir=checkpoint_dir)]


POLICY_NAMES = tuple(action.value for action in slim_nanguard.Action)
BAD_STEP_POLICIES = (slim_nanguard.Action.SKIP, slim_nanguard.Action.ROLLBACK)


def _make_variants() -> Dict[str, Variant]:
    variants = [
        Variant("baseline", "slim, unguarded (check_numerics=False)", PLAIN, None, _slim(False)),
        Variant(
            "baseline_again",
            "slim, unguarded: a second copy (the noise floor)",
            PLAIN,
            "baseline",
            _slim(False),
            graph_of="baseline",
        ),
        Variant(
            "baseline_mts",
            "slim, unguarded, in MonitoredTrainingSession",
            MTS,
            "baseline",
            _slim(False),
            graph_of="baseline",
        ),
        Variant(
            "baseline_resource",
            "slim, unguarded, resource variables",
            PLAIN,
            "baseline",
            _slim(False),
            resource_variables=True,
        ),
        Variant(
            "slim_check_numerics",
            "slim check_numerics=True (loss only, not atomic)",
            PLAIN,
            "baseline",
            _slim(True),
        ),
        Variant(
            "nan_tensor_hook",
            "NanTensorHook (loss only, after the update)",
            MTS,
            "baseline_mts",
            _slim(False),
            hooks=_nan_tensor_hook,
            graph_of="baseline",
        ),
        Variant(
            "check_numerics_per_gradient",
            "check_numerics on every gradient (not atomic)",
            PLAIN,
            "baseline",
            _check_each_gradient,
        ),
        Variant(
            "enable_check_numerics",
            "tf.debugging.enable_check_numerics",
            PLAIN,
            "baseline_resource",
            _slim(False),
            resource_variables=True,
            check_numerics_callback=True,
        ),
        Variant(
            "loss_scale_skip",
            "MixedPrecisionLossScaleOptimizer, loss scale 1 (atomic)",
            PLAIN,
            "baseline",
            _loss_scale_skip,
        ),
    ]

    # The skip and rollback variants time bad steps: with the autopsy off, so that the bad
    # step's time is what the guard costs, not the replay of the step (0.1-0.3 s).
    def autopsy_note(policy):
        return ", autopsy off" if policy in BAD_STEP_POLICIES else ""

    for policy in POLICY_NAMES:
        variants.append(
            Variant(
                f"nanguard_check_numerics_{policy}",
                f"ours: check_numerics mode, {policy}{autopsy_note(policy)}",
                PLAIN,
                "baseline",
                _ours(True, policy, autopsy=policy not in BAD_STEP_POLICIES),
                nan_policy=policy,
                ours=True,
                bad_step=policy in BAD_STEP_POLICIES,
            )
        )
    for policy in POLICY_NAMES:
        variants.append(
            Variant(
                f"nanguard_hook_{policy}",
                f"ours: hook mode, {policy}{autopsy_note(policy)}",
                MTS,
                "baseline_mts",
                _ours(False, policy, autopsy=policy not in BAD_STEP_POLICIES),
                hooks=_our_hook,
                nan_policy=policy,
                ours=True,
                bad_step=policy in BAD_STEP_POLICIES,
            )
        )
    # The same guards with the autopsy off (no batch kept on a bad step), timed in the same
    # run: side by side with the raise variants above, the good-step cost of the capture.
    variants.append(
        Variant(
            "nanguard_check_numerics_no_autopsy",
            "ours: check_numerics mode, raise, autopsy off",
            PLAIN,
            "baseline",
            _ours(True, "raise", autopsy=False),
            nan_policy="raise",
            ours=True,
        )
    )
    variants.append(
        Variant(
            "nanguard_hook_no_autopsy",
            "ours: hook mode, raise, autopsy off",
            MTS,
            "baseline_mts",
            _ours(False, "raise", autopsy=False),
            hooks=_our_hook,
            nan_policy="raise",
            ours=True,
        )
    )
    variants.append(
        Variant(
            "nanguard_hook_graph_only",
            "ours: hook-mode graph in a plain loop, no hook",
            PLAIN,
            "baseline",
            _ours(False, "raise"),
            nan_policy="raise",
            ours=True,
            graph_of="nanguard_hook_raise",
        )
    )
    variants += _spike_guard_variants()
    return {v.name: v for v in variants}


def _spike_guard_variants() -> List[Variant]:
    """The spike guard's variants: our raise variants with ``spike_policy="skip"`` on top (the
    raise variants are the same guard with it off), one per mode."""
    return [
        Variant(
            "nanguard_check_numerics_spike",
            "ours: check_numerics mode, raise, spike guard on (skip)",
            PLAIN,
            "baseline",
            _ours(True, "raise", spike_policy="skip"),
            nan_policy="raise",
            ours=True,
        ),
        Variant(
            "nanguard_hook_spike",
            "ours: hook mode, raise, spike guard on (skip)",
            MTS,
            "baseline_mts",
            _ours(False, "raise", spike_policy="skip"),
            hooks=_our_hook,
            nan_policy="raise",
            ours=True,
        ),
    ]


VARIANTS: Dict[str, Variant] = _make_variants()

# Our two modes with the atomic step, spike guard off and on, as the targets name them.
OUR_MODES = (
    "nanguard_check_numerics_raise",
    "nanguard_hook_raise",
    "nanguard_check_numerics_spike",
    "nanguard_hook_spike",
)
# Target: median ratio at most this, per model (issue 27: 1.05 on the MLP, 1.10 on the
# 102-variable deep net; issue 20: 1.02 on the real slim nets, 1.05 on the wide layer).
TARGETS = {
    "mlp": 1.05,
    "deep": 1.10,
    "wide": 1.05,
    "lenet": 1.02,
    "cifarnet": 1.02,
    "mobilenet": 1.02,
}
# The columns of the first table, (heading, variant): each model's ratio to the unguarded
# op, side by side for both modes, spike guard off and on, in one run.
SIDE_BY_SIDE: Tuple[Tuple[str, str], ...] = (
    ("noise floor", "baseline_again"),
    ("slim check_numerics=True", "slim_check_numerics"),
    ("loss-scale skip", "loss_scale_skip"),
    ("ours, check_numerics mode", "nanguard_check_numerics_raise"),
    ("ours, hook mode (MTS)", "nanguard_hook_raise"),
    ("ours + spike, check_numerics mode", "nanguard_check_numerics_spike"),
    ("ours + spike, hook mode (MTS)", "nanguard_hook_spike"),
)

# ---------------------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True)
class Settings:
    """How long and what to measure.

    Attributes:
      models: Model names (keys of `MODELS`; by default the two the targets of issue 27 name).
      optimizers: Optimizer names (keys of `OPTIMIZERS`; by default SGD, as the targets).
      variants: Variant names (keys of `VARIANTS`); the references they need are added.
      rounds: Interleaved rounds; each gives one time per variant and one ratio.
      chunks: Timed chunks per session and round, interleaved (ABC ABC ABC); the round's
        time of a variant is its fastest chunk, which filters out the moments another
        process took the cores.
      replicas: Sessions per variant, each with its own variables. Two sessions of one graph
        can differ by several percent (up to 40% for Adam on the wide layer) for as long as
        they live, with where their buffers landed in memory; the fastest counts, as for
        chunks, so that no variant is judged by one unlucky layout.
      round_seconds: Target time of one variant in one round, all chunks and sessions
        together (sets the steps per chunk from the baseline's speed).
      min_steps: Fewest steps per chunk.
      warmup_steps: Untimed steps of each variant before the first round.
      bad_step_repeats: Bad steps timed per policy and mode.
      rollback_distance: Good steps between the checkpoint and the bad step (rollback).
      batch_scale: Multiplies every model's batch size (below 1 for a tiny smoke test).
      deep_layers: Hidden layers of the deep narrow net (50; fewer for a smoke test).
      intra_op_threads: Session ``intra_op_parallelism_threads`` (0: TensorFlow's choice).
      inter_op_threads: Session ``inter_op_parallelism_threads`` (0: TensorFlow's choice).
      seed: Seed of the data, the weights and the order of the variants.
    """

    models: Tuple[str, ...] = ("mlp", "deep")
    optimizers: Tuple[str, ...] = ("sgd",)
    variants: Tuple[str, ...] = tuple(VARIANTS)
    rounds: int = 7
    chunks: int = 2
    replicas: int = 2
    round_seconds: float = 0.12
    min_steps: int = 3
    warmup_steps: int = 10
    bad_step_repeats: int = 3
    rollback_distance: int = 10
    batch_scale: float = 1.0
    deep_layers: int = 50
    intra_op_threads: int = 0
    inter_op_threads: int = 0
    seed: int = 0

    def __post_init__(self):
        for kind, names, known in (
            ("model", self.models, MODELS),
            ("optimizer", self.optimizers, OPTIMIZERS),
            ("variant", self.variants, VARIANTS),
        ):
            unknown = [n for n in names if n not in known]
            if unknown or not names:
                raise ValueError(
                    f"unknown or no {kind} names {unknown or list(names)}; "
                    f"choose from {', '.join(known)}."
                )
        if (
            min(self.rounds, self.chunks, self.replicas, self.min_steps) < 1
            or self.warmup_steps < 0
        ):
            raise ValueError(
                f"rounds, chunks, replicas and min_steps must be >= 1 and "
                f"warmup_steps >= 0; got {self.rounds}, {self.chunks}, "
                f"{self.replicas}, {self.min_steps}, {self.warmup_steps}."
            )
        if self.deep_layers < 1:
            raise ValueError(f"deep_layers must be >= 1; got {self.deep_layers}.")
        if self.round_seconds <= 0 or self.batch_scale <= 0:
            raise ValueError(
                f"round_seconds and batch_scale must be > 0; got "
                f"{self.round_seconds}, {self.batch_scale}."
            )

    def all_variants(self) -> Tuple[str, ...]:
        """The chosen variants and every reference they are compared with, in table order."""
        wanted = set(self.variants)
        for name in self.variants:
            ref = VARIANTS[name].reference
            while ref is not None:
                wanted.add(ref)
                ref = VARIANTS[ref].reference
        return tuple(n for n in VARIANTS if n in wanted)

    def session_config(self) -> tf.compat.v1.ConfigProto:
        return tf.compat.v1.ConfigProto(
            intra_op_parallelism_threads=self.intra_op_threads,
            inter_op_parallelism_threads=self.inter_op_threads,
        )


# --quick: the default models, every variant, SGD only, few short rounds.
QUICK = dict(
    optimizers=("sgd",),
    rounds=3,
    chunks=2,
    replicas=1,
    round_seconds=0.03,
    warmup_steps=5,
    bad_step_repeats=1,
)

# ---------------------------------------------------------------------------- one variant


class Trainer:
    """One variant of one model: a graph, and a session of its own.

    Attributes:
      variant: The `Variant`.
      graph: Its graph.
      train_op: The train op.
      images: The input (a ``placeholder_with_default`` over the constant batch).
      guard: The slim_nanguard guard, for our variants.
      ops: Number of operations in the graph.
      gradient_bytes: Bytes of one copy of the gradients (one per trainable variable).
      page_faults: Minor page faults of the process during this session's timed steps.
      timed_steps: Steps timed by `time_steps`.
    """

    def __init__(
        self,
        model: ModelSpec,
        optimizer: str,
        variant: Variant,
        settings: Settings,
        checkpoint_dir: str,
    ):
        self.variant = variant
        self.checkpoint_dir = checkpoint_dir
        self.graph = tf.Graph()
        batch = max(1, int(round(model.batch_size * settings.batch_scale)))
        rng = np.random.RandomState(settings.seed)
        self.batch_images = rng.standard_normal((batch,) + model.input_shape).astype(np.float32)
        labels = rng.randint(0, NUM_CLASSES, size=batch).astype(np.int64)
        with self.graph.as_default():
            tf.compat.v1.set_random_seed(settings.seed)
            if variant.check_numerics_callback:
                tf.debugging.enable_check_numerics()
            try:
                with tf.compat.v1.variable_scope(
                    "", use_resource=True if variant.resource_variables else None
                ):
                    self.images = tf.compat.v1.placeholder_with_default(
                        self.batch_images, self.batch_images.shape, name="images"
                    )
                    logits = model.build(self.images, settings.deep_layers)
                    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(
                        tf.constant(labels), logits
                    )
                    self.train_op = variant.build(loss, OPTIMIZERS[optimizer]())
            finally:
                if variant.check_numerics_callback:
                    tf.debugging.disable_check_numerics()
            self.ops = len(self.graph.get_operations())
            self.guard = slim_nanguard.get_guard(self.train_op)
            self.global_step = tf.compat.v1.train.get_global_step()
            self.gradient_bytes = sum(
                v.shape.num_elements() * v.dtype.base_dtype.size
                for v in tf.compat.v1.trainable_variables()
            )
            self._init_op = tf.compat.v1.global_variables_initializer()
        self._settings = settings
        self.page_faults = self.timed_steps = 0
        self.session = self._new_session()

    def replica(self, checkpoint_dir: str, variant: Optional[Variant] = None) -> "Trainer":
        """The same graph in another session, with its own variables (so its own memory
        layout), run as `variant` runs it (default: as this one)."""
        twin = object.__new__(Trainer)
        twin.__dict__.update(self.__dict__)
        twin.variant = variant or self.variant
        twin.checkpoint_dir = checkpoint_dir
        twin.page_faults = twin.timed_steps = 0
        twin.session = twin._new_session()  # pylint: disable=protected-access
        return twin

    def _new_session(self):
        config = self._settings.session_config()
        with self.graph.as_default():
            if self.variant.loop == MTS:
                hooks = (
                    self.variant.hooks(self.train_op, self.checkpoint_dir)
                    if self.variant.hooks
                    else []
                )
                return tf.compat.v1.train.MonitoredTrainingSession(
                    hooks=hooks,
                    config=config,
                    checkpoint_dir=None,
                    save_checkpoint_secs=None,
                    save_checkpoint_steps=None,
                    save_summaries_steps=None,
                    save_summaries_secs=None,
                    log_step_count_steps=None,
                )
            session = tf.compat.v1.Session(graph=self.graph, config=config)
            session.run(self._init_op)
            return session

    def raw_session(self):
        if isinstance(self.session, tf.compat.v1.Session):
            return self.session
        return self.session._tf_sess()  # pylint: disable=protected-access

    def step(self, feed_dict=None):
        """Runs one step as the variant's loop would; a numerics error goes to the guard."""
        try:
            return self.session.run(self.train_op, feed_dict=feed_dict)
        except tf.errors.InvalidArgumentError as error:
            if self.guard is None:
                raise
            return slim_nanguard.handle_numerics_error(
                self.session, error, checkpoint_dir=self.checkpoint_dir
            )

    def time_steps(self, steps: int) -> Tuple[float, float]:
        """Wall and CPU seconds per step over `steps` steps (the same loop for every variant).

        CPU time is the process's, over all its threads (`time.process_time`): what the
        step costs the machine, which another process taking a core does not change the way
        it changes wall time. Also adds the page faults the process took meanwhile to
        `page_faults`.
        """
        step = self.step
        enabled = gc.isenabled()
        gc.disable()
        try:
            faults = _minor_page_faults()
            cpu_start, start = time.process_time(), time.perf_counter()
            for _ in range(steps):
                step()
            seconds = (time.perf_counter() - start) / steps
            cpu_seconds = (time.process_time() - cpu_start) / steps
            self.page_faults += _minor_page_faults() - faults
            self.timed_steps += steps
            return seconds, cpu_seconds
        finally:
            if enabled:
                gc.enable()

    def global_step_value(self) -> int:
        return int(self.raw_session().run(self.global_step))

    def bad_batch(self) -> np.ndarray:
        bad = self.batch_images.copy()
        bad.flat[len(bad.flat) // 2] = np.nan
        return bad

    def save(self) -> str:
        return self.guard.saver.save(
            self.raw_session(),
            os.path.join(self.checkpoint_dir, "model.ckpt"),
            global_step=self.global_step_value(),
        )

    def close(self):
        self.session.close()


# ---------------------------------------------------------------------------- memory


def _traced_step(session, train_op: tf.Tensor) -> tf.compat.v1.RunMetadata:
    """Runs `train_op` once with ``FULL_TRACE``; returns the run's metadata (step stats, and
    the graphs the executor ran, after graph rewrites)."""
    options = tf.compat.v1.RunOptions(
        trace_level=tf.compat.v1.RunOptions.FULL_TRACE, output_partition_graphs=True
    )
    metadata = tf.compat.v1.RunMetadata()
    session.run(train_op, options=options, run_metadata=metadata)
    return metadata


def transient_peak_bytes(trainer: Trainer, steps: int = 3) -> int:
    """The most bytes a step's tensors hold at once, over `steps` traced steps.

    A traced run (``FULL_TRACE``) records every allocation and deallocation the step's ops make
    (requested bytes, with a time stamp); summing them in time order gives the live bytes of
    the step, whose maximum is returned. Variables and slots are not in it (they live across
    steps); gradients, activations and any temporary are. An allocation and a deallocation
    stamped the same microsecond are counted allocation first, so the figure errs high.
    """
    peak = 0
    for _ in range(steps):
        metadata = _traced_step(trainer.raw_session(), trainer.train_op)
        events = sorted(
            (
                (r.alloc_micros, -r.alloc_bytes)
                for device in metadata.step_stats.dev_stats
                for node in device.node_stats
                for memory in node.memory
                for r in memory.allocation_records
            )
        )
        live = 0
        for _, negated in events:
            live -= negated
            peak = max(peak, live)
    return peak


# ---------------------------------------------------------------------------- measurement


def _summary(values: Sequence[float]) -> Dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _time_bad_steps(trainer: Trainer, settings: Settings) -> Dict[str, Any]:
    """Times good and bad fed steps of a skip or rollback variant; counts the steps lost."""
    policy = trainer.variant.nan_policy
    good_times, bad_times, lost = [], [], []
    bad = trainer.bad_batch()
    # A fed run is a new signature for the session: the first one builds an executor.
    trainer.step({trainer.images: trainer.batch_images})
    for _ in range(settings.bad_step_repeats):
        start = time.perf_counter()
        trainer.step({trainer.images: trainer.batch_images})
        good_times.append(time.perf_counter() - start)
        if policy == "rollback":
            trainer.save()
            for _ in range(settings.rollback_distance):
                trainer.step()
        before = trainer.global_step_value()
        start = time.perf_counter()
        trainer.step({trainer.images: bad})
        bad_times.append(time.perf_counter() - start)
        lost.append(before - trainer.global_step_value())
        for _ in range(3):
            trainer.step()
    state = trainer.guard.state
    return {
        "model": None,
        "optimizer": None,
        "variant": trainer.variant.name,
        "policy": policy,
        "good_step_ms": 1e3 * statistics.median(good_times),
        "bad_step_ms": _summary([1e3 * t for t in bad_times]),
        "steps_lost": _summary(lost),
        "skips": state.skips,
        "rollbacks": state.rollbacks,
        "bad_steps": state.total_bad_steps,
    }


def _measure_one(
    model_name: str, optimizer: str, settings: Settings, memory: bool, log: Callable[[str], None]
) -> Tuple[List[Dict], List[Dict]]:
    model = MODELS[model_name]
    names = settings.all_variants()
    workdir = tempfile.mkdtemp(prefix="nanguard_bench_")
    trainers: Dict[str, List[Trainer]] = {}
    try:
        start = time.perf_counter()
        for name, first in _first_trainers(model, optimizer, names, settings, workdir):
            trainers[name] = [first]
        # The other sessions in later passes, not right after the first: two sessions made
        # one after the other get the same relative placement of their buffers, so share
        # their luck with it, and the fastest of them would not undo a bad one.
        for i in range(1, settings.replicas):
            for name in names:
                trainers[name].append(trainers[name][0].replica(_directory(workdir, name, i)))
        for replicas in trainers.values():
            for trainer in replicas:
                for _ in range(settings.warmup_steps):
                    trainer.step()
        per_step, _ = trainers["baseline"][0].time_steps(max(settings.min_steps, 10))
        samples = settings.chunks * settings.replicas
        steps = max(settings.min_steps, int(round(settings.round_seconds / samples / per_step)))
        log(
            f"{model_name}/{optimizer}: {len(names)} variants x {settings.replicas} sessions "
            f"built and warmed up in {time.perf_counter() - start:.1f} s; {samples} x {steps} "
            f"steps per variant and round ({1e3 * per_step:.2f} ms/step)"
        )
        times, cpu_times, session_times = _timed_rounds(trainers, names, steps, settings)
        peaks = {n: transient_peak_bytes(trainers[n][0]) for n in names} if memory else {}
        results = []
        for name in names:
            variant = VARIANTS[name]
            ref = variant.reference or name
            ratios = [t / r for t, r in zip(times[name], times[ref])]
            cpu_ratios = [t / r for t, r in zip(cpu_times[name], cpu_times[ref])]
            results.append(
                {
                    "model": model_name,
                    "optimizer": optimizer,
                    "variant": name,
                    "label": variant.label,
                    "loop": variant.loop,
                    "reference": ref,
                    "ms_per_step": _summary([1e3 * t for t in times[name]]),
                    "round_ms": [1e3 * t for t in times[name]],
                    "session_median_ms": [
                        1e3 * statistics.median(session_times[name, i])
                        for i in range(settings.replicas)
                    ],
                    "ratio": _summary(ratios),
                    "cpu_ms_per_step": _summary([1e3 * t for t in cpu_times[name]]),
                    "cpu_ratio": _summary(cpu_ratios),
                    "rounds": settings.rounds,
                    "chunks": settings.chunks,
                    "steps_per_chunk": steps,
                    "replicas": settings.replicas,
                    # Minor page faults per timed step, per session: memory handed back to the
                    # system and faulted in again every step shows here (and in the time).
                    "page_faults_per_step": [
                        t.page_faults / max(t.timed_steps, 1) for t in trainers[name]
                    ],
                    "graph_ops": trainers[name][0].ops,
                    "graph_ops_added": trainers[name][0].ops - trainers[ref][0].ops,
                    "gradient_bytes": trainers[name][0].gradient_bytes,
                }
            )
            # Memory against the unguarded op on the same kind of variables.
            base = "baseline_resource" if variant.resource_variables else "baseline"
            if memory and base in peaks:
                extra = peaks[name] - peaks[base]
                results[-1].update(
                    step_peak_bytes=peaks[name],
                    extra_peak_bytes=extra,
                    extra_gradient_copies=extra / trainers[name][0].gradient_bytes,
                )
        bad_steps = []
        for name in names:
            if VARIANTS[name].bad_step:
                record = _time_bad_steps(trainers[name][0], settings)
                record.update(
                    model=model_name,
                    optimizer=optimizer,
                    baseline_ms=1e3 * statistics.median(times[VARIANTS[name].reference]),
                )
                bad_steps.append(record)
        return results, bad_steps
    finally:
        for replicas in trainers.values():
            for trainer in replicas:
                trainer.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _timed_rounds(
    trainers: Dict[str, List["Trainer"]], names: Sequence[str], steps: int, settings: Settings
) -> Tuple[Dict[str, List[float]], Dict[str, List[float]], Dict[Tuple[str, int], List[float]]]:
    """Times `steps` steps of every session in interleaved rounds (see the module docstring).

    Returns:
      ``(wall, cpu, per_session)``: per variant and round, the wall and the CPU seconds per
      step of its fastest chunk over its sessions (the fastest by each measure), and per
      session and round its fastest chunk's wall seconds.
    """
    order = [(name, i) for name in names for i in range(settings.replicas)]
    rng = random.Random(settings.seed)
    wall: Dict[str, List[float]] = {n: [] for n in names}
    cpu: Dict[str, List[float]] = {n: [] for n in names}
    per_session: Dict[Tuple[str, int], List[float]] = {key: [] for key in order}
    for _ in range(settings.rounds):
        fastest = {key: math.inf for key in order}
        least_cpu = {key: math.inf for key in order}
        for _ in range(settings.chunks):
            rng.shuffle(order)
            for name, i in order:
                seconds, cpu_seconds = trainers[name][i].time_steps(steps)
                fastest[name, i] = min(fastest[name, i], seconds)
                least_cpu[name, i] = min(least_cpu[name, i], cpu_seconds)
        for key, seconds in fastest.items():
            per_session[key].append(seconds)
        for name in names:
            sessions = range(settings.replicas)
            wall[name].append(min(fastest[name, i] for i in sessions))
            cpu[name].append(min(least_cpu[name, i] for i in sessions))
    return wall, cpu, per_session


def _first_trainers(
    model: ModelSpec, optimizer: str, names: Sequence[str], settings: Settings, workdir: str
) -> Iterator[Tuple[str, Trainer]]:
    """Yields one `Trainer` per variant, as it is made (so that the caller can close those
    made before an error); a variant with `Variant.graph_of` gets a session of that graph."""
    made: Dict[str, Trainer] = {}
    for name in names:
        variant = VARIANTS[name]
        directory = _directory(workdir, name, 0)
        if variant.graph_of in made:
            made[name] = made[variant.graph_of].replica(directory, variant)
        else:
            made[name] = Trainer(model, optimizer, variant, settings, directory)
        yield name, made[name]


def _directory(workdir: str, name: str, replica: int) -> str:
    path = os.path.join(workdir, f"{name}_{replica}")
    os.makedirs(path, exist_ok=True)
    return path


def machine_info() -> Dict[str, Any]:
    """The CPU, core count and software versions the figures come from."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "tf_slim": getattr(tf_slim, "__version__", "1.1.0"),
        "platform": platform.platform(),
    }


def model_description(name: str, settings: Settings) -> str:
    """The model's one-line description for the tables (the deep net's depth filled in)."""
    depth = settings.deep_layers
    return MODELS[name].description.format(depth=depth, variables=2 * (depth + 1))


def run_profile(settings: Settings, *, steps: int = 10, top: int = 8) -> Dict[str, Any]:
    """`profile_step` of every model and optimizer of `settings`, one model at a time.

    Returns:
      A JSON-ready dict: ``machine``, ``settings``, ``profiles`` (one per model and optimizer,
      each with its ``description``) and ``seconds``.
    """
    start = time.perf_counter()
    profiles = []
    for model_name in settings.models:
        for optimizer in settings.optimizers:
            profile = profile_step(model_name, optimizer, settings, steps=steps, top=top)
            profile["description"] = model_description(model_name, settings)
            profiles.append(profile)
    return {
        "machine": machine_info(),
        "settings": dataclasses.asdict(settings),
        "profiles": profiles,
        "seconds": time.perf_counter() - start,
    }


def run_benchmark(
    settings: Settings, *, memory: bool = True, log: Callable[[str], None] = print
) -> Dict[str, Any]:
    """Times every variant of `settings` on every model and optimizer.

    Args:
      settings: What to measure and for how long.
      memory: Also measure each variant's transient memory (`transient_peak_bytes`).
      log: Called with a progress line now and then.

    Returns:
      A JSON-ready dict: ``machine``, ``settings``, ``results`` (one per model, optimizer and
      variant), ``bad_steps``, ``targets`` and ``seconds``.
    """
    start = time.perf_counter()
    results, bad_steps = [], []
    for model_name in settings.models:
        for optimizer in settings.optimizers:
            r, b = _measure_one(model_name, optimizer, settings, memory, log)
            results += r
            bad_steps += b
    models_used = {
        name: {
            "description": model_description(name, settings),
            "input_shape": list(MODELS[name].input_shape),
            "batch_size": max(1, int(round(MODELS[name].batch_size * settings.batch_scale))),
        }
        for name in settings.models
    }
    report = {
        "machine": machine_info(),
        "settings": dataclasses.asdict(settings),
        "models": models_used,
        "results": results,
        "bad_steps": bad_steps,
        "targets": check_targets(results),
        "seconds": time.perf_counter() - start,
    }
    return report


# ---------------------------------------------------------------------------- profile

# What ``--profile`` looks at unless told otherwise: our two modes (their references, the
# unguarded op in a plain loop and in MonitoredTrainingSession, are added), SGD, the net with
# the most small variables.
PROFILE_VARIANTS = OUR_MODES
PROFILE = dict(models=("deep",), optimizers=("sgd",), variants=PROFILE_VARIANTS)


def _op_type(node) -> str:
    """The kernel a traced node ran, from its timeline label ``name = Type(inputs)``.

    The label names the op after graph rewrites (e.g. ``_MklNativeFusedMatMul``), which the
    graph does not.
    """
    _, _, call = node.timeline_label.partition(" = ")
    return call.partition("(")[0] or node.node_name


def _scope(name: str) -> str:
    """The name scope of a node, at most two levels deep (``nanguard/verdict``)."""
    parts = name.split("/")[:-1]
    return "/".join(parts[:2]) or "(root)"


def _group(nodes: Sequence[Tuple[str, str, int]], key: Callable, steps: int) -> Dict[str, Dict]:
    """Nodes per step and microseconds per step, by `key(name, op_type)`."""
    groups: Dict[str, Dict[str, float]] = {}
    for name, op_type, micros in nodes:
        group = groups.setdefault(key(name, op_type), {"nodes": 0.0, "micros": 0.0})
        group["nodes"] += 1 / steps
        group["micros"] += micros / steps
    return dict(sorted(groups.items(), key=lambda item: -item[1]["micros"]))


@dataclasses.dataclass
class _Trace:
    """The traced steps of one variant: which nodes ran and for how long.

    Attributes:
      nodes: ``(name, op type, microseconds)`` of every node run, over all traced steps.
      walls: The wall time of each traced step (first node's start to last node's end), µs.
      graph_nodes: The nodes of the graph the executor ran, per traced step: those a step
        runs and those it skips as dead (the untaken side of a switch), which cost the
        executor a little each and show in no step stats.
      threads: The threads that ran a node, per traced step.
    """

    nodes: List[Tuple[str, str, int]] = dataclasses.field(default_factory=list)
    walls: List[int] = dataclasses.field(default_factory=list)
    graph_nodes: List[int] = dataclasses.field(default_factory=list)
    threads: List[int] = dataclasses.field(default_factory=list)

    def add(self, metadata: tf.compat.v1.RunMetadata) -> None:
        starts, ends, threads = [], [], set()
        for device in metadata.step_stats.dev_stats:
            for node in device.node_stats:
                self.nodes.append((node.node_name, _op_type(node), node.all_end_rel_micros))
                starts.append(node.all_start_micros)
                ends.append(node.all_start_micros + node.all_end_rel_micros)
                threads.add(node.thread_id)
        self.walls.append(max(ends) - min(starts))
        self.graph_nodes.append(sum(len(g.node) for g in metadata.partition_graphs))
        self.threads.append(len(threads))

    def names(self) -> set:
        return {name for name, _, _ in self.nodes}


def profile_step(
    model_name: str,
    optimizer: str,
    settings: Settings,
    *,
    steps: int = 10,
    top: int = 8,
) -> Dict[str, Any]:
    """A per-op profile of one step of each variant, against its unguarded reference.

    Builds every variant of ``settings.all_variants()`` (one session each), warms each up
    with ``settings.warmup_steps`` steps (at least `PROFILE_WARMUP_STEPS`: past the spike
    test's warm-up, whose writes trim outliers) and one traced step, then traces `steps` steps of
    each (``RunOptions(trace_level=FULL_TRACE)``, run as the variant's loop runs it, hooks
    included), the variants taking turns so that they share the machine's moments. Per
    variant and step, averaged over the steps: the nodes executed, the sum of their times
    (op time: CPU time across threads, not wall time) and the step's wall time. The nodes
    a variant executes that its reference does not ("added") are grouped by op type and by
    name scope; their time, and the change in the time of the nodes both run, split the
    difference in op time between what the guard adds and what it slows down.

    Args:
      model_name: A key of `MODELS`.
      optimizer: A key of `OPTIMIZERS`.
      settings: The variants, warm-up, batch scale, threads and seed.
      steps: Traced steps per variant.
      top: Groups kept per variant in ``by_type`` and ``by_scope`` (the largest by time).

    Returns:
      A JSON-ready dict: ``model``, ``optimizer``, ``steps`` and ``variants``, one dict per
      variant with ``variant``, ``loop``, ``reference``, ``nodes``, ``op_ms``, ``wall_ms``,
      ``graph_nodes`` and ``threads`` (see `_Trace`),
      ``added_nodes``, ``added_ms``, ``shared_ms_change`` (op time of the nodes the reference
      runs too, minus the reference's own op time), ``by_type`` and ``by_scope`` (name to
      ``{"nodes", "micros"}`` per step, of the added nodes).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1; got {steps}.")
    names = settings.all_variants()
    workdir = tempfile.mkdtemp(prefix="nanguard_profile_")
    trainers: Dict[str, Trainer] = {}
    try:
        for name, trainer in _first_trainers(
            MODELS[model_name], optimizer, names, settings, workdir
        ):
            trainers[name] = trainer
        for trainer in trainers.values():
            for _ in range(max(settings.warmup_steps, PROFILE_WARMUP_STEPS)):
                trainer.step()
            _traced_step(trainer.session, trainer.train_op)  # Tracing's own first-run costs.
        traces = {name: _Trace() for name in names}
        order = list(names)
        rng = random.Random(settings.seed)
        for _ in range(steps):
            rng.shuffle(order)
            for name in order:
                traces[name].add(_traced_step(trainers[name].session, trainers[name].train_op))
    finally:
        for trainer in trainers.values():
            trainer.close()
        shutil.rmtree(workdir, ignore_errors=True)

    def op_ms(nodes):
        return sum(micros for _, _, micros in nodes) / steps / 1e3

    variants = []
    for name in names:
        variant, trace = VARIANTS[name], traces[name]
        ref = variant.reference or name
        known = traces[ref].names()
        added = [node for node in trace.nodes if node[0] not in known]
        shared = [node for node in trace.nodes if node[0] in known]
        variants.append(
            {
                "variant": name,
                "label": variant.label,
                "loop": variant.loop,
                "reference": ref,
                "nodes": len(trace.nodes) / steps,
                "op_ms": op_ms(trace.nodes),
                "wall_ms": statistics.mean(trace.walls) / 1e3,
                "graph_nodes": statistics.mean(trace.graph_nodes),
                "threads": statistics.mean(trace.threads),
                "added_nodes": len(added) / steps,
                "added_ms": op_ms(added),
                "shared_ms_change": op_ms(shared) - op_ms(traces[ref].nodes),
                "by_type": dict(
                    list(_group(added, lambda _, op_type: op_type, steps).items())[:top]
                ),
                "by_scope": dict(
                    list(_group(added, lambda name, _: _scope(name), steps).items())[:top]
                ),
            }
        )
    return {"model": model_name, "optimizer": optimizer, "steps": steps, "variants": variants}


def format_profile(profile: Dict[str, Any]) -> str:
    """A profile of `profile_step` as Markdown: the totals, then what the guard adds."""
    title = profile.get("description", profile["model"])
    lines = [
        f"Per-op profile, {title}, {profile['optimizer']}: mean of {profile['steps']} traced "
        "steps. Op time is the sum of the nodes' times (over both threads), not wall time. "
        "The executor's graph also holds the nodes a step skips as dead (no step stats).",
        "",
        "| variant | loop | nodes/step | added nodes | op ms/step | added nodes' ms | "
        "shared nodes' change, ms | step wall ms | executor's graph nodes | threads |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for v in profile["variants"]:
        own = v["reference"] == v["variant"]
        loop = "MTS" if v["loop"] == MTS else "session"
        added = "–" if own else f"{v['added_nodes']:.0f}"
        added_ms = "–" if own else f"{v['added_ms']:.3f}"
        change = "–" if own else f"{v['shared_ms_change']:+.3f}"
        lines.append(
            f"| {v['label']} | {loop} | {v['nodes']:.0f} | {added} | {v['op_ms']:.3f} | "
            f"{added_ms} | {change} | {v['wall_ms']:.3f} | {v['graph_nodes']:.0f} | "
            f"{v['threads']:.1f} |"
        )
    for kind, heading in (("by_type", "op type"), ("by_scope", "name scope")):
        lines += [
            "",
            f"| variant | added nodes, by {heading} | nodes/step | µs/step |",
            "| --- | --- | ---: | ---: |",
        ]
        for v in profile["variants"]:
            for group, figures in v[kind].items():
                lines.append(
                    f"| {v['label']} | `{group}` | {figures['nodes']:.0f} | "
                    f"{figures['micros']:.0f} |"
                )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- targets


def check_targets(results: List[Dict]) -> List[Dict[str, Any]]:
    """The issues' targets, each with the measured figure and whether it is met.

    A ratio target (`TARGETS`) is met when the median ratio is at most the limit in wall time
    and in CPU time (``measured`` and ``measured_cpu``).
    """
    by_key = {(r["model"], r["optimizer"], r["variant"]): r for r in results}
    checks = []
    for (model, optimizer, name), r in by_key.items():
        if name not in OUR_MODES:
            continue
        ratio = r["ratio"]["median"]
        limit = TARGETS.get(model)
        if limit is not None:
            cpu_ratio = r["cpu_ratio"]["median"]
            checks.append(
                {
                    "model": model,
                    "optimizer": optimizer,
                    "variant": name,
                    "target": f"<= {limit:.2f}x {r['reference']}",
                    "limit": limit,
                    "measured": ratio,
                    "measured_cpu": cpu_ratio,
                    "met": ratio <= limit and cpu_ratio <= limit,
                }
            )
        scale = by_key.get((model, optimizer, "loss_scale_skip"))
        if scale is not None:
            checks.append(
                {
                    "model": model,
                    "optimizer": optimizer,
                    "variant": name,
                    "target": f"<= loss_scale_skip ({scale['ratio']['median']:.3f}x)",
                    "measured": ratio,
                    "met": ratio <= scale["ratio"]["median"],
                }
            )
        if "extra_gradient_copies" in r:
            checks.append(
                {
                    "model": model,
                    "optimizer": optimizer,
                    "variant": name,
                    "target": "<= 1 extra copy of the gradients at peak",
                    "measured": r["extra_gradient_copies"],
                    "met": r["extra_gradient_copies"] <= 1.0,
                }
            )
    return checks


# ---------------------------------------------------------------------------- tables


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def _ratio_cell(r: Optional[Dict[str, Any]], cpu: bool = False) -> str:
    """The median ratio with its min–max; with `cpu`, the CPU time's median after a slash."""
    if r is None:
        return "–"
    ratio = r["ratio"]
    cell = f"{ratio['median']:.3f} ({ratio['min']:.2f}–{ratio['max']:.2f})"
    return f"{cell} / {r['cpu_ratio']['median']:.3f}" if cpu else cell


def format_side_by_side(report: Dict[str, Any]) -> str:
    """One row per model and optimizer: the `SIDE_BY_SIDE` variants' ratios, as Markdown.

    Each cell is the wall-time ratio (median, min–max over the rounds), then after a slash
    the CPU-time ratio's median; the unguarded column, wall / CPU ms per step. A variant
    that was not timed shows "–".
    """
    by_key = {(r["model"], r["optimizer"], r["variant"]): r for r in report["results"]}
    rows = sorted(
        {(r["model"], r["optimizer"]) for r in report["results"]},
        key=lambda key: (list(MODELS).index(key[0]), list(OPTIMIZERS).index(key[1])),
    )
    lines = [
        "| model | opt | unguarded ms/step, wall / CPU | "
        + " | ".join(heading for heading, _ in SIDE_BY_SIDE)
        + " |",
        "| --- | --- | ---: | " + " | ".join("---:" for _ in SIDE_BY_SIDE) + " |",
    ]
    for model, optimizer in rows:
        base = by_key.get((model, optimizer, "baseline"))
        ms = "–"
        if base:
            ms = f"{base['ms_per_step']['median']:.2f} / {base['cpu_ms_per_step']['median']:.2f}"
        description = report["models"][model]["description"]
        cells = [
            _ratio_cell(by_key.get((model, optimizer, name)), cpu=True) for _, name in SIDE_BY_SIDE
        ]
        lines.append(f"| {description} | {optimizer} | {ms} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_targets(report: Dict[str, Any]) -> str:
    """The targets as Markdown: each with its wall and CPU figure and "met" or "missed"."""
    lines = [
        "| model | opt | variant | target | wall | CPU | met |",
        "| --- | --- | --- | --- | ---: | ---: | --- |",
    ]
    for t in report["targets"]:
        cpu = f"{t['measured_cpu']:.3f}" if "measured_cpu" in t else "–"
        lines.append(
            f"| {t['model']} | {t['optimizer']} | {t['variant']} | {t['target']} "
            f"| {t['measured']:.3f} | {cpu} | {'met' if t['met'] else '**missed**'} |"
        )
    return "\n".join(lines)


def format_tables(report: Dict[str, Any]) -> str:
    """The report as Markdown: the side-by-side ratios, step times, bad steps, targets."""
    lines = [
        format_side_by_side(report),
        "",
        "| model | opt | variant | loop | ms/step | ratio (min–max) | CPU ms/step | CPU ratio | "
        "ops added | extra peak MiB (× gradients) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["results"]:
        ms = r["ms_per_step"]
        cpu = r["cpu_ms_per_step"]["median"]
        if r["reference"] == r["variant"]:
            shown, cpu_ratio = "1 (reference)", "1"
        else:
            shown, cpu_ratio = _ratio_cell(r), f"{r['cpu_ratio']['median']:.3f}"
        memory = "–"
        if "extra_peak_bytes" in r:
            memory = f"{_mib(r['extra_peak_bytes'])} ({r['extra_gradient_copies']:.2f})"
        lines.append(
            f"| {r['model']} | {r['optimizer']} | {r['label']} | "
            f"{'MTS' if r['loop'] == MTS else 'session'} | {ms['median']:.2f} | "
            f"{shown} | {cpu:.2f} | {cpu_ratio} | {r['graph_ops_added']} | {memory} |"
        )
    if report["bad_steps"]:
        lines += [
            "",
            "| model | opt | variant | good step ms | bad step ms, median (min–max) | "
            "global steps lost |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for b in report["bad_steps"]:
            bad = b["bad_step_ms"]
            lines.append(
                f"| {b['model']} | {b['optimizer']} | {VARIANTS[b['variant']].label} "
                f"| {b['good_step_ms']:.2f} | {bad['median']:.2f} "
                f"({bad['min']:.2f}–{bad['max']:.2f}) | "
                f"{b['steps_lost']['median']:g} |"
            )
    if report["targets"]:
        lines += ["", format_targets(report)]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- start-up

# What ``--startup`` times: the launcher's larger nets (issue 36's "quick to build and to
# start"), at their smallest image size and a batch of 2: graph size and start-up, not math.
STARTUP_MODELS = ("resnet_v1_50", "inception_v1")
STARTUP_VARIANTS = ("tf_slim", "nanguard_check_numerics", "nanguard_hook")
STARTUP_LIMIT = 1.2


def _startup_once(model: str, variant: str, batch: int = 2) -> Dict[str, float]:
    """Builds `model`'s train op as `variant` in a fresh graph, then makes a session, runs the
    initializers and one step: what the user waits for, in seconds, and the graph's nodes."""
    side = max(models.MIN_IMAGE_SIZE[model], 32)
    gc.collect()  # Each variant starts without the last one's garbage to collect.
    clocks = [(time.perf_counter(), time.process_time())]
    with tf.Graph().as_default() as graph:
        tf.compat.v1.set_random_seed(0)
        images = tf.random.uniform([batch, side, side, 3])
        labels = tf.one_hot(tf.range(batch) % NUM_CLASSES, NUM_CLASSES)
        logits = models.get_model(model)(images, NUM_CLASSES, True)
        tf.compat.v1.losses.softmax_cross_entropy(labels, logits)
        loss = tf.compat.v1.losses.get_total_loss()
        optimizer = tf.compat.v1.train.MomentumOptimizer(0.01, 0.9)
        clocks.append((time.perf_counter(), time.process_time()))
        if variant == "tf_slim":
            train_op = tf_slim.learning.create_train_op(loss, optimizer)
        else:
            check = variant == "nanguard_check_numerics"
            train_op = slim_nanguard.create_train_op(loss, optimizer, check_numerics=check)
        clocks.append((time.perf_counter(), time.process_time()))
        init = tf.group(
            tf.compat.v1.global_variables_initializer(), tf.compat.v1.local_variables_initializer()
        )
        clocks.append((time.perf_counter(), time.process_time()))
        nodes = len(graph.as_graph_def().node)
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(init)
        session.run(train_op)
    clocks.append((time.perf_counter(), time.process_time()))
    figures = {"nodes": nodes}
    for clock, suffix in ((0, "s"), (1, "cpu_s")):
        figures[f"create_train_op_{suffix}"] = clocks[2][clock] - clocks[1][clock]
        figures[f"graph_{suffix}"] = clocks[3][clock] - clocks[0][clock]
        figures[f"first_step_{suffix}"] = clocks[4][clock] - clocks[3][clock]
    return figures


def run_startup(
    models_to_time: Sequence[str] = STARTUP_MODELS,
    repeats: int = 3,
    log: Callable[[str], None] = print,
) -> Dict[str, Any]:
    """Times `_startup_once` of every variant, `repeats` times in a new order each repeat.

    Returns:
      A JSON-ready dict: ``machine``, ``startup`` (per model and variant: the median of each
      figure over the repeats and, but for the reference, its median, min and max ratio to
      the tf_slim op's of the same repeat) and ``seconds``.
    """
    start = time.perf_counter()
    for variant in STARTUP_VARIANTS:  # Untimed: the first build of each pays for imports.
        _startup_once("lenet", variant)
    rows = []
    for model in models_to_time:
        runs: Dict[str, List[Dict[str, float]]] = {v: [] for v in STARTUP_VARIANTS}
        for repeat in range(repeats):
            order = list(STARTUP_VARIANTS)
            random.Random(repeat).shuffle(order)
            for variant in order:
                runs[variant].append(_startup_once(model, variant))
            log(f"start-up: {model}, repeat {repeat + 1} of {repeats}")
        for variant, mine in runs.items():
            row = {"model": model, "variant": variant}
            for key in mine[0]:
                row[key] = statistics.median(r[key] for r in mine)
                if variant != "tf_slim":
                    ratios = [r[key] / ref[key] for r, ref in zip(mine, runs["tf_slim"])]
                    row[f"{key}_ratio"] = _summary(ratios)
            rows.append(row)
    return {"machine": machine_info(), "startup": rows, "seconds": time.perf_counter() - start}


def format_startup(report: Dict[str, Any]) -> str:
    """The start-up table: seconds (medians) and ratios to tf-slim's, median (min–max)."""
    keys = ("create_train_op", "graph", "first_step")
    lines = [
        "| model | variant | create_train_op s | whole graph s | first step s | nodes |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in report["startup"]:
        cells = [_startup_cell(row, f"{key}_s") for key in keys] + [_startup_cell(row, "nodes")]
        lines.append(f"| {row['model']} | {row['variant']} | {' | '.join(cells)} |")
    lines.append(
        f"\nSeconds and nodes: medians; guarded/unguarded: wall (min–max), CPU; "
        f"target <= {STARTUP_LIMIT}x."
    )
    return "\n".join(lines)


def _startup_cell(row: Dict[str, Any], key: str) -> str:
    """``12.3 (1.05×, 0.98–1.10; CPU 1.02×)``: the median and its ratios, if any."""
    if f"{key}_ratio" not in row:
        return f"{row[key]:.3g}"
    r = row[f"{key}_ratio"]
    cell = f"{row[key]:.3g} ({r['median']:.2f}×, {r['min']:.2f}–{r['max']:.2f}"
    cpu = row.get(f"{key[:-2]}_cpu_s_ratio")
    return cell + (f"; CPU {cpu['median']:.2f}×)" if cpu else ")")
