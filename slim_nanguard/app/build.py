"""The launcher's training graph: dataset, model, loss, learning rate, optimizer, guard.

`build_training` builds, in a new graph and in the order of TF-Slim's
``train_image_classifier.py``::

    dataset (tf.data, batched, prefetched) -> images, labels   [+ injected faults]
    model by name -> logits; cross-entropy + weight decay (slim's regularization losses)
    learning rate (fixed / exponential / polynomial) and optimizer by name
    slim_nanguard.create_train_op(..., check_numerics, nan_policy, ...)
    fine-tuning init_fn (only when train_dir holds no checkpoint yet)

It reads no file in train_dir and writes nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import tensorflow as tf

import slim_nanguard
from slim_nanguard.app import checkpoints
from slim_nanguard.app import config as config_lib
from slim_nanguard.app import datasets
from slim_nanguard.app import faults as faults_lib
from slim_nanguard.app import models

__all__ = [
    "Built",
    "build_training",
    "configure_learning_rate",
    "configure_optimizer",
    "input_channels",
    "model_image_size",
]


def model_image_size(model_name: str, requested: Optional[int]) -> Optional[int]:
    """The image side to feed `model_name`: `requested`, or else the model's default."""
    return requested if requested is not None else models.MODELS[model_name].default_image_size


def input_channels(model_name: str, dataset_name: str) -> Optional[int]:
    """The channels to ask the dataset for; None: its own.

    The tf_slim.nets (and their checkpoints) take RGB: the grey digits are repeated to 3.
    TFRecord images keep the channels they were written with.
    """
    if datasets.DATASETS[dataset_name].adapts_channels:
        return models.MODELS[model_name].channels
    return None


def configure_learning_rate(
    config: config_lib.TrainConfig, global_step: tf.Tensor, split_size: Optional[int]
) -> tf.Tensor:
    """The learning rate as in slim's ``_configure_learning_rate``."""
    kind = config.learning_rate_decay_type
    if kind == "fixed":
        return tf.constant(config.learning_rate, tf.float32, name="fixed_learning_rate")
    config_lib.check(
        split_size is not None,
        f"learning_rate_decay_type {kind} needs the number of examples of the training "
        f"split, and split {config.dataset_split_name!r} is too large to count: use "
        "--learning_rate_decay_type=fixed.",
    )
    decay_steps = max(1, int(split_size / config.batch_size * config.num_epochs_per_decay))
    if kind == "exponential":
        return tf.compat.v1.train.exponential_decay(
            config.learning_rate,
            global_step,
            decay_steps,
            config.learning_rate_decay_factor,
            staircase=True,
            name="exponential_decay_learning_rate",
        )
    return tf.compat.v1.train.polynomial_decay(
        config.learning_rate,
        global_step,
        decay_steps,
        config.end_learning_rate,
        power=1.0,
        cycle=False,
        name="polynomial_decay_learning_rate",
    )


def configure_optimizer(
    config: config_lib.TrainConfig, learning_rate: tf.Tensor
) -> tf.compat.v1.train.Optimizer:
    """The optimizer as in slim's ``_configure_optimizer``."""
    train = tf.compat.v1.train
    name = config.optimizer
    if name == "adadelta":
        return train.AdadeltaOptimizer(
            learning_rate, rho=config.adadelta_rho, epsilon=config.opt_epsilon
        )
    if name == "adagrad":
        return train.AdagradOptimizer(
            learning_rate, initial_accumulator_value=config.adagrad_initial_accumulator_value
        )
    if name == "adam":
        return train.AdamOptimizer(
            learning_rate,
            beta1=config.adam_beta1,
            beta2=config.adam_beta2,
            epsilon=config.opt_epsilon,
        )
    if name == "ftrl":
        return train.FtrlOptimizer(
            learning_rate,
            learning_rate_power=config.ftrl_learning_rate_power,
            initial_accumulator_value=config.ftrl_initial_accumulator_value,
            l1_regularization_strength=config.ftrl_l1,
            l2_regularization_strength=config.ftrl_l2,
        )
    if name == "momentum":
        return train.MomentumOptimizer(learning_rate, momentum=config.momentum, name="Momentum")
    if name == "rmsprop":
        return train.RMSPropOptimizer(
            learning_rate,
            decay=config.rmsprop_decay,
            momentum=config.rmsprop_momentum,
            epsilon=config.opt_epsilon,
        )
    return train.GradientDescentOptimizer(learning_rate)


@dataclasses.dataclass
class Built:
    """A built training graph: its train op and what `slim_nanguard.train` needs besides."""

    graph: tf.Graph
    train_op: tf.Tensor
    scaffold: Optional[tf.compat.v1.train.Scaffold]
    info: datasets.DatasetInfo
    hooks: list = dataclasses.field(default_factory=list)


def build_training(
    config: config_lib.TrainConfig, resume: bool, cluster=None, quarantine: bool = False
) -> Built:
    """Builds the training graph of `config`; reads no file in train_dir and writes nothing.

    Args:
      config: A `TrainConfig`.
      resume: Whether train_dir holds a checkpoint to resume from (then no fine-tuning).
      cluster: For a worker of a ps/worker cluster, its `cluster.Cluster`.
      quarantine: Whether the input leaves out the examples quarantined in train_dir (read
        when the input first runs).

    Returns:
      The `Built` graph.

    Raises:
      LaunchError, datasets.DatasetError, models.ModelError: Bad settings or input.
      NonFiniteCheckpointError: The checkpoint to fine-tune from holds NaN or Inf.
    """
    image_size = model_image_size(config.model_name, config.train_image_size)
    fine_tune_from = None
    if config.checkpoint_path is not None and not resume:
        fine_tune_from = checkpoints.resolve_checkpoint(config.checkpoint_path)
    graph = tf.Graph()
    # A cluster's worker: variables on the ps, everything else on this worker.
    with graph.as_default(), tf.compat.v1.device(cluster.device_setter() if cluster else None):
        if config.seed is not None:
            tf.compat.v1.set_random_seed(config.seed)
        with tf.device("/cpu:0"):
            dataset, info = datasets.get_dataset(
                config.dataset_name,
                config.dataset_split_name,
                batch_size=config.batch_size,
                dataset_dir=config.dataset_dir,
                shuffle=True,
                repeat=True,
                seed=config.seed,
                image_size=image_size,
                channels=input_channels(config.model_name, config.dataset_name),
                purpose="training data",
                example_index=faults_lib.needs_example_index(config.inject_faults),
                quarantine_dir=config.train_dir if quarantine else None,
            )
            injector = None
            if config.inject_faults:
                dataset = faults_lib.enumerate_batches(dataset)
                batch_index, (images, labels, *examples) = tf.compat.v1.data.make_one_shot_iterator(
                    dataset
                ).get_next()
                injector = faults_lib.FaultInjector(config.inject_faults, batch_index, *examples)
                images = injector.corrupt_images(images)
                labels = injector.corrupt_labels(labels, info.num_classes)
            else:
                images, labels = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()

        model_fn = models.get_model(config.model_name, weight_decay=config.weight_decay)
        logits = model_fn(images, info.num_classes, is_training=True)
        tf.compat.v1.losses.softmax_cross_entropy(
            tf.one_hot(labels, info.num_classes), logits, label_smoothing=config.label_smoothing
        )
        total_loss = tf.compat.v1.losses.get_total_loss(name="total_loss")
        if injector is not None:
            total_loss = injector.corrupt_loss(total_loss)

        global_step = tf.compat.v1.train.get_or_create_global_step()
        learning_rate = configure_learning_rate(config, global_step, info.split_size)
        if injector is not None:
            learning_rate = injector.corrupt_learning_rate(learning_rate)
        optimizer = configure_optimizer(config, learning_rate)
        if cluster is not None:
            optimizer = cluster.wrap_optimizer(optimizer, config)  # SyncReplicasOptimizer, if asked
        tf.compat.v1.summary.scalar("losses/total_loss", total_loss)

        variables_to_train = None
        if config.trainable_scopes:
            variables_to_train = checkpoints.in_scopes(
                tf.compat.v1.trainable_variables(), config.trainable_scopes
            )
            if not variables_to_train:
                scopes = sorted(
                    {"/".join(v.op.name.split("/")[:2]) for v in tf.compat.v1.trainable_variables()}
                )
                raise config_lib.LaunchError(
                    f"--trainable_scopes={','.join(config.trainable_scopes)} matches no "
                    f"trainable variable of model {config.model_name}; its scopes are "
                    f"{checkpoints.names(scopes, 6)}."
                )

        train_op = slim_nanguard.create_train_op(
            total_loss,
            optimizer,
            variables_to_train=variables_to_train,
            clip_gradient_norm=config.clip_gradient_norm,
            check_numerics=config.check_numerics,
            config=config.guard,
        )
        lr_scale = slim_nanguard.get_guard(train_op).lr_scale
        if lr_scale is not None:
            # The rate in effect: the rollbacks' scale (restored with the model) included.
            learning_rate = learning_rate * tf.cast(lr_scale, learning_rate.dtype)
        tf.compat.v1.summary.scalar("learning_rate", learning_rate)

        scaffold = None
        if fine_tune_from is not None:
            scaffold = checkpoints.fine_tune_scaffold(config, fine_tune_from)
    hooks = cluster.hooks(optimizer, config.train_dir) if cluster is not None else []
    return Built(graph=graph, train_op=train_op, scaffold=scaffold, info=info, hooks=hooks)
