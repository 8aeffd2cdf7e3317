"""The launcher's evaluation: one pass of a split over a checkpoint, the TF-Slim way."""

from __future__ import annotations

import dataclasses
from typing import Optional

import tensorflow as tf
import tf_slim as slim

from slim_nanguard.app import build
from slim_nanguard.app import checkpoints
from slim_nanguard.app import config as config_lib
from slim_nanguard.app import datasets
from slim_nanguard.app import models

__all__ = ["EvalResult", "check_eval_dataset", "run_eval"]


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """What `run_eval` measured.

    Attributes:
      accuracy: Top-1 accuracy over the examples seen.
      loss: Mean cross-entropy over the examples seen.
      num_examples: Examples evaluated.
      global_step: The checkpoint's global step (None if it has none).
      checkpoint_path: The checkpoint evaluated.
      split: The split evaluated.
    """

    accuracy: float
    loss: float
    num_examples: int
    global_step: Optional[int]
    checkpoint_path: str
    split: str

    def describe(self) -> str:
        step = f" (global step {self.global_step})" if self.global_step is not None else ""
        return (
            f"{self.split} accuracy {self.accuracy:.4f}, loss {self.loss:.4f} on "
            f"{self.num_examples} examples; checkpoint {self.checkpoint_path}{step}"
        )


def _eval_dataset(config: config_lib.EvalConfig, purpose: str = "evaluation data"):
    """The evaluation split as the model reads it (in order, once); ``(dataset, info)``."""
    return datasets.get_dataset(
        config.dataset_name,
        config.dataset_split_name,
        batch_size=config.batch_size,
        dataset_dir=config.dataset_dir,
        shuffle=False,
        repeat=False,
        image_size=build.model_image_size(config.model_name, config.eval_image_size),
        channels=build.input_channels(config.model_name, config.dataset_name),
        purpose=purpose,
    )


def check_eval_dataset(
    config: config_lib.EvalConfig,
    split_flag: str = "--dataset_split_name",
    purpose: str = "checking the evaluation split",
) -> datasets.DatasetInfo:
    """Builds the evaluation input of `config` in a scratch graph, to fail early on bad input.

    Args:
      config: An `EvalConfig`.
      split_flag: The flag that set ``config.dataset_split_name``, named in the error (the
        training launcher's evaluation split is ``--eval_split_name``).
      purpose: What the check is for, said first in its log line.

    Raises:
      datasets.DatasetError: The split cannot be read.
    """
    try:
        with tf.Graph().as_default():
            _, info = _eval_dataset(config, purpose)
    except datasets.DatasetError as err:
        if split_flag == "--dataset_split_name":
            raise
        raise datasets.DatasetError(str(err).replace("--dataset_split_name", split_flag)) from None
    return info


def run_eval(config: config_lib.EvalConfig) -> EvalResult:
    """Evaluates a checkpoint on one pass of a split, the TF-Slim way.

    ``tf_slim.evaluation.evaluate_once`` runs the streaming metrics (accuracy, mean loss)
    over the split until its end, and a ``FinalOpsHook`` reads them.

    Args:
      config: An `EvalConfig`.

    Returns:
      An `EvalResult`.

    Raises:
      LaunchError: No checkpoint there, or one that does not fit the model.
      NonFiniteCheckpointError: The checkpoint holds NaN or Inf.
      UnreadableCheckpointError: A file of the checkpoint is missing, cut short or garbled.
      datasets.DatasetError, models.ModelError: Bad dataset or model settings.
    """
    if not isinstance(config, config_lib.EvalConfig):
        raise config_lib.LaunchError(f"run_eval takes an EvalConfig; got {type(config).__name__}.")
    path = checkpoints.resolve_checkpoint(config.checkpoint_path)
    shapes = checkpoints.checkpoint_shapes(path, "--checkpoint_path")
    checkpoints.check_finite(path, "--checkpoint_path", "evaluate")
    graph = tf.Graph()
    with graph.as_default():
        with tf.device("/cpu:0"):
            dataset, info = _eval_dataset(config)
            images, labels = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
        model_fn = models.get_model(config.model_name)
        logits = model_fn(images, info.num_classes, is_training=False)
        variables = slim.get_model_variables()
        restore = checkpoints.check_fits(
            path,
            variables,
            shapes,
            what="--checkpoint_path {path}",
            ignore_missing=False,
            advice=f"Evaluate with the --model_name, dataset and image size the checkpoint was "
            f"trained with; this evaluation asked for {config.model_name} on "
            f"{info.image_shape[0]}x{info.image_shape[1]}x{info.image_shape[2]} "
            f"{config.dataset_name} images with {info.num_classes} classes.",
        )
        global_step = tf.compat.v1.train.get_or_create_global_step()
        if global_step.op.name in shapes:
            restore.append(global_step)
        predictions = tf.argmax(logits, axis=1)
        losses = tf.compat.v1.losses.sparse_softmax_cross_entropy(
            labels, logits, reduction=tf.compat.v1.losses.Reduction.NONE
        )
        accuracy, accuracy_update = tf.compat.v1.metrics.accuracy(labels, predictions)
        mean_loss, loss_update = tf.compat.v1.metrics.mean(losses)
        count = tf.compat.v1.Variable(
            0,
            dtype=tf.int64,
            trainable=False,
            name="eval_count",
            collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES],
        )
        count_update = count.assign_add(tf.shape(labels, out_type=tf.int64)[0])
        summary_op = None
        if config.eval_dir:
            summary_op = tf.compat.v1.summary.merge(
                [
                    tf.compat.v1.summary.scalar("eval/accuracy", accuracy),
                    tf.compat.v1.summary.scalar("eval/loss", mean_loss),
                ]
            )
        final = {
            "accuracy": accuracy,
            "loss": mean_loss,
            "count": count,
            "global_step": global_step,
        }
        values = slim.evaluation.evaluate_once(
            master=config.master,
            checkpoint_path=path,
            logdir=config.eval_dir,
            num_evals=config.max_num_batches,
            eval_op=[accuracy_update, loss_update, count_update],
            final_op=final,
            summary_op=summary_op,
            variables_to_restore=restore,
        )
    step = int(values["global_step"]) if global_step.op.name in shapes else None
    return EvalResult(
        accuracy=float(values["accuracy"]),
        loss=float(values["loss"]),
        num_examples=int(values["count"]),
        global_step=step,
        checkpoint_path=path,
        split=config.dataset_split_name,
    )
