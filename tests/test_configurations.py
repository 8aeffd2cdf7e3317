"""The promise in the configurations TF-Slim users run, in both modes.

Each case is a three-step training run of a tiny linear model: two good steps, a step with a
NaN loss, a step with a non-finite gradient under a finite loss, and one more good step. The
bad steps change no variable (weights, slots, accumulators, global_step, averages); the good
one trains. The faults reach the loss or the gradients on every CPU kernel: a NaN offset on
the loss, and a gradient scaled by NaN (or Inf) on its way back.
"""

from typing import Callable, Dict, Optional

import numpy as np
import pytest
import tensorflow as tf

import slim_nanguard

import nanguard_testlib as lib

v1 = tf.compat.v1

OPTIMIZERS: Dict[str, Callable[[tf.Variable], v1.train.Optimizer]] = {
    "momentum_nesterov": lambda step: v1.train.MomentumOptimizer(0.05, 0.9, use_nesterov=True),
    "rmsprop_centered": lambda step: v1.train.RMSPropOptimizer(0.01, centered=True),
    "adagrad": lambda step: v1.train.AdagradOptimizer(0.1),
    "adadelta": lambda step: v1.train.AdadeltaOptimizer(1.0),
    "ftrl_shrinkage": lambda step: v1.train.FtrlOptimizer(
        0.1, l2_shrinkage_regularization_strength=0.01
    ),
    "proximal_adagrad": lambda step: v1.train.ProximalAdagradOptimizer(
        0.1, l1_regularization_strength=0.001
    ),
    "adagrad_da": lambda step: v1.train.AdagradDAOptimizer(0.1, step),
    "adam_decayed_lr": lambda step: v1.train.AdamOptimizer(
        v1.train.exponential_decay(0.01, step, 1, 0.5)
    ),
}


def _scale_gradient(x: tf.Tensor, scale: tf.Tensor) -> tf.Tensor:
    """`x` on the way forward; on the way back, a gradient of ``scale`` in every element."""

    @tf.custom_gradient
    def identity(value):
        return tf.identity(value), lambda dy: tf.ones_like(dy) * scale

    return identity(x)


class Run:
    """A tiny model in its own graph, with the two faults it can be fed."""

    def __init__(
        self,
        *,
        optimizer: str = "sgd",
        dtype=tf.float32,
        embedding: str = "",
        ema: bool = False,
        use_resource: bool = True,
        **create_kwargs,
    ):
        self.graph = tf.Graph()
        with self.graph.as_default(), v1.variable_scope("", use_resource=use_resource):
            v1.set_random_seed(8)
            step = v1.train.get_or_create_global_step()
            rng = np.random.RandomState(0)
            self.offset = v1.placeholder_with_default(tf.constant(0.0, dtype), [])
            self.grad_scale = v1.placeholder_with_default(tf.constant(1.0, dtype), [])
            if embedding:
                partitioner = v1.fixed_size_partitioner(2) if embedding == "partitioned" else None
                table = v1.get_variable("table", [6, 3], dtype, partitioner=partitioner)
                ids = tf.constant([0, 2, 2, 5])
                rows = tf.nn.embedding_lookup(table, ids)  # its gradient: IndexedSlices
                features = _scale_gradient(rows, self.grad_scale)
            else:
                x = tf.constant(rng.randn(lib.BATCH, lib.FEATURES), dtype)
                weights = v1.get_variable("weights", [lib.FEATURES, 3], dtype)
                features = tf.matmul(x, _scale_gradient(weights, self.grad_scale))
            biases = v1.get_variable("biases", [3], dtype, v1.zeros_initializer())
            target = tf.constant(rng.randn(features.shape[0], 3), dtype)
            self.loss = tf.reduce_mean(tf.square(features + biases - target)) + self.offset
            if ema:
                average = v1.train.ExponentialMovingAverage(0.9).apply(v1.trainable_variables())
                v1.add_to_collection(v1.GraphKeys.UPDATE_OPS, average)
            opt = (
                v1.train.GradientDescentOptimizer(0.1)
                if optimizer == "sgd"
                else OPTIMIZERS[optimizer](step)
            )
            self.train_op = slim_nanguard.create_train_op(self.loss, opt, **create_kwargs)

    def story(self, bad_gradient: float = np.nan) -> Dict[str, np.ndarray]:
        """Two good steps, two bad ones, a good one; returns what the last one changed."""
        check_numerics = slim_nanguard.get_guard(self.train_op).mode == "check_numerics"
        with self.graph.as_default(), v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            lib.mark_judged(sess, self.train_op)  # this story judges each step itself
            for _ in range(2):
                assert np.isfinite(sess.run(self.train_op))
            before = lib.state(sess, self.graph)
            lib.assert_all_finite(before)
            for fault in ({self.offset: np.nan}, {self.grad_scale: bad_gradient}):
                try:
                    sess.run(self.train_op, fault)
                    assert not check_numerics, "the check did not raise"
                except tf.errors.InvalidArgumentError as err:
                    assert check_numerics and slim_nanguard.is_numerics_error(err)
                lib.assert_state_equal(before, lib.state(sess, self.graph))
            sess.run(self.train_op)
            after = lib.state(sess, self.graph)
        return {name for name in before if not np.array_equal(before[name], after[name])}


@pytest.mark.parametrize("use_resource", [True, False], ids=["resource", "ref"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@lib.each_mode
def test_each_optimizer_skips_a_bad_step_and_trains_on_a_good_one(mode, optimizer, use_resource):
    changed = Run(
        optimizer=optimizer, use_resource=use_resource, check_numerics=lib.MODES[mode]
    ).story()
    assert {"weights", "biases", "global_step"} <= changed


CONFIGURATIONS: Dict[str, Dict] = {
    # The gradient rows of the looked-up embeddings go NaN: IndexedSlices with NaN values.
    "embedding": dict(embedding="plain", optimizer="adagrad"),
    "partitioned_embedding": dict(embedding="partitioned"),
    "ema_in_update_ops": dict(ema=True, optimizer="momentum_nesterov"),
    "float16": dict(dtype=tf.float16),
    "float64": dict(dtype=tf.float64, optimizer="adam_decayed_lr"),
    "gate_none_with_aggregation_method": dict(
        gate_gradients=v1.train.Optimizer.GATE_NONE,
        aggregation_method=tf.AggregationMethod.EXPERIMENTAL_TREE,
    ),
    "no_update_ops": dict(ema=True, update_ops=[]),
    "no_global_step": dict(global_step=None, optimizer="rmsprop_centered"),
}

EXPECTED_CHANGES: Dict[str, Optional[set]] = {
    "embedding": {"table", "table/Adagrad", "biases"},
    "partitioned_embedding": {"table/part_0", "table/part_1", "biases"},
    "ema_in_update_ops": {"weights/ExponentialMovingAverage", "biases/ExponentialMovingAverage"},
}


@pytest.mark.parametrize("name", sorted(CONFIGURATIONS))
@lib.each_mode
def test_each_configuration_skips_a_bad_step_and_trains_on_a_good_one(mode, name):
    run = Run(check_numerics=lib.MODES[mode], **CONFIGURATIONS[name])
    if "embedding" in name:  # the NaN rows reach the table as IndexedSlices: a sparse update
        assert any(
            op.type.startswith(("SparseApply", "ResourceSparseApply", "Scatter", "ResourceScatter"))
            for op in run.graph.get_operations()
        )
    changed = run.story()
    assert EXPECTED_CHANGES.get(name, {"weights", "biases"}) <= changed
    assert ("global_step" in changed) == (name != "no_global_step")
    if name == "no_update_ops":  # the averages in UPDATE_OPS are not run at all
        assert not any("ExponentialMovingAverage" in n for n in changed)


@lib.each_mode
def test_an_inf_only_gradient_under_a_finite_loss_is_a_bad_step(mode):
    changed = Run(check_numerics=lib.MODES[mode], optimizer="adagrad").story(bad_gradient=np.inf)
    assert {"weights", "weights/Adagrad", "global_step"} <= changed
