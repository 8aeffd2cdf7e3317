"""The launcher's checkpoints: finding one, checking it fits the model, fine-tuning from it.

A checkpoint that does not fit (a variable missing, a shape that differs) is refused with a
`config.LaunchError` naming the first variables and saying which flag to change; one that
holds NaN or Inf with a `NonFiniteCheckpointError`. All of it happens before training starts.
"""

from __future__ import annotations

import os
from typing import Dict, List, Sequence

import tensorflow as tf
import tf_slim as slim
from absl import logging as absl_logging

import slim_nanguard
from slim_nanguard import storage
from slim_nanguard.app import config as config_lib
from slim_nanguard.app import preflight

# absl's logger itself: its module functions would configure Python's root logger in a
# script that is not run by absl's app.run (see slim_nanguard/_log.py).
logging = absl_logging.get_absl_logger()

__all__ = [
    "check_fits",
    "check_resume",
    "check_finite",
    "checkpoint_shapes",
    "fine_tune_scaffold",
    "in_scopes",
    "names",
    "resolve_checkpoint",
]


def resolve_checkpoint(path: str, flag: str = "--checkpoint_path") -> str:
    """A checkpoint prefix from a prefix or a directory (its latest checkpoint).

    Args:
      path: A checkpoint file prefix (or one of its files), or a directory.
      flag: The flag that gave `path`, named in the error.

    Raises:
      LaunchError: Nothing is there, or the directory holds no checkpoint.
    """
    path = os.fspath(path)
    if tf.io.gfile.exists(path + ".index"):  # First: ram:// calls a prefix a directory too.
        return path
    if tf.io.gfile.isdir(path):
        latest = storage.latest_checkpoint(path)
        config_lib.check(
            latest is not None,
            f"{flag}={path} is a directory without a checkpoint: point it at a training "
            "directory that has saved one, or at a checkpoint file prefix (model.ckpt-N).",
        )
        return latest
    if path.endswith((".index", ".meta")) or ".data-" in path:
        prefix = preflight.checkpoint_prefix(path)
        if tf.io.gfile.exists(prefix + ".index"):
            return prefix
    if tf.io.gfile.exists(path):
        # A TF1 checkpoint (V1 format) is a single file.
        try:
            tf.train.load_checkpoint(path)
            return path
        except (tf.errors.OpError, ValueError):
            pass
        raise config_lib.LaunchError(
            f"{flag}={path} is not a checkpoint TensorFlow can read: pass a "
            "checkpoint prefix (model.ckpt-N, without .index) or its directory."
        )
    raise config_lib.LaunchError(preflight.missing_checkpoint(path, flag))


def checkpoint_shapes(path: str, flag: str) -> Dict[str, List[int]]:
    """The shape of each variable in checkpoint `path`.

    Raises:
      UnreadableCheckpointError: Its index is missing, cut short or garbled (naming `flag`).
      LaunchError: It cannot be read for another reason (naming `flag`).
    """
    try:
        return storage.checkpoint_reader(path).get_variable_to_shape_map()
    except slim_nanguard.UnreadableCheckpointError as err:
        raise _another_checkpoint(err, flag) from None
    except (tf.errors.OpError, ValueError) as err:
        raise config_lib.LaunchError(
            f"{flag}: checkpoint {path} cannot be read "
            f"({storage.op_error_cause(err)}); pass another checkpoint."
        ) from None


def check_finite(path: str, flag: str, use: str) -> None:
    """Reads every value of checkpoint `path`, before it is used to `use` (``"evaluate"``).

    Raises:
      UnreadableCheckpointError: A file of it is missing, cut short or garbled (naming `flag`).
      NonFiniteCheckpointError: It holds NaN or Inf.
    """
    try:
        bad = slim_nanguard.non_finite_variables(path)
    except slim_nanguard.UnreadableCheckpointError as err:
        raise _another_checkpoint(err, flag) from None
    if bad:
        raise slim_nanguard.NonFiniteCheckpointError(
            f"{flag} {path} holds NaN or Inf in {names(list(bad))}; refusing to {use} it. "
            "Pass an earlier checkpoint of that directory (see its 'checkpoint' file)."
        )


def _another_checkpoint(
    err: "slim_nanguard.UnreadableCheckpointError", flag: str
) -> "slim_nanguard.UnreadableCheckpointError":
    """`err`, advising to pass another checkpoint as `flag`."""
    return slim_nanguard.UnreadableCheckpointError(
        err.checkpoint,
        err.file,
        err.problem,
        err.cause,
        f"Pass another checkpoint as {flag} (an older one of its directory), or restore "
        "this one from a copy.",
    )


def _mismatches(variables: Sequence[tf.Variable], shapes: Dict[str, List[int]]):
    missing, wrong = [], []
    for v in variables:
        name = v.op.name
        if name not in shapes:
            missing.append(name)
        elif list(shapes[name]) != v.shape.as_list():
            wrong.append(
                f"{name} is {list(shapes[name])} in the checkpoint but {v.shape.as_list()} in "
                "the model"
            )
    return missing, wrong


def names(items: Sequence[str], limit: int = 3) -> str:
    """The first `limit` items, comma-separated, and how many more there are."""
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def check_fits(
    path: str,
    variables: Sequence[tf.Variable],
    shapes,
    *,
    what: str,
    ignore_missing: bool,
    advice: str,
) -> List[tf.Variable]:
    """The variables to restore from `path`; raises LaunchError if the model does not fit.

    `what` names the checkpoint in the message, e.g. ``"--checkpoint_path {path}"``.
    """
    what = what.format(path=path)
    missing, wrong = _mismatches(variables, shapes)
    if wrong:
        raise config_lib.LaunchError(
            f"{what} does not match the model: {names(wrong, 2)}. {advice}"
        )
    if missing and not ignore_missing:
        raise config_lib.LaunchError(
            f"{what} does not match the model: it has no {names(missing)}. {advice}"
        )
    if missing:
        logging.warning("Not in %s, left as initialised: %s", path, names(missing, 10))
    return [v for v in variables if v.op.name not in missing]


def in_scopes(variables: Sequence[tf.Variable], scopes: Sequence[str]) -> List[tf.Variable]:
    """The variables whose names start with one of `scopes`."""
    return [v for v in variables if any(v.op.name.startswith(s) for s in scopes)]


def fine_tune_scaffold(config: config_lib.TrainConfig, path: str) -> tf.compat.v1.train.Scaffold:
    """A scaffold whose init_fn loads the model variables from `path` (slim's _get_init_fn)."""
    model_variables = slim.get_model_variables()
    unmatched = [s for s in config.checkpoint_exclude_scopes if not in_scopes(model_variables, [s])]
    if unmatched:
        scopes = sorted({"/".join(v.op.name.split("/")[:2]) for v in model_variables})
        raise config_lib.LaunchError(
            f"--checkpoint_exclude_scopes={','.join(unmatched)} matches no variable of model "
            f"{config.model_name}; its scopes are {names(scopes, 6)}."
        )
    variables = [
        v
        for v in model_variables
        if not any(v.op.name.startswith(s) for s in config.checkpoint_exclude_scopes)
    ]
    config_lib.check(
        bool(variables),
        f"--checkpoint_exclude_scopes={','.join(config.checkpoint_exclude_scopes)} excludes "
        "every variable of the model: there is nothing to fine-tune from.",
    )
    shapes = checkpoint_shapes(path, "--checkpoint_path")
    restore = check_fits(
        path,
        variables,
        shapes,
        what="--checkpoint_path {path}",
        ignore_missing=config.ignore_missing_vars,
        advice=f"Use a checkpoint of model {config.model_name}, list the scopes that differ "
        "in --checkpoint_exclude_scopes (e.g. the logits), or pass --ignore_missing_vars.",
    )
    config_lib.check(
        bool(restore), f"--checkpoint_path {path} holds none of the model's variables."
    )
    check_finite(path, "--checkpoint_path", "fine-tune from")
    saver = tf.compat.v1.train.Saver(restore, name="fine_tune_saver")
    logging.info(
        "Fine-tuning from %s: %d variables restored, %d excluded.",
        path,
        len(restore),
        len(slim.get_model_variables()) - len(restore),
    )

    def init_fn(unused_scaffold, session):
        saver.restore(session, path)

    return tf.compat.v1.train.Scaffold(init_fn=init_fn)


def check_resume(
    config: config_lib.TrainConfig, graph: tf.Graph, checkpoint: str, train_op: tf.Tensor
) -> None:
    """Raises LaunchError unless `checkpoint` (in train_dir) fits the model in `graph`.

    The guard's own variables may be missing: those of guard options turned on since
    (`slim_nanguard.train` restores around them, and they start afresh).
    """
    optional = {v.op.name for v in slim_nanguard.get_guard(train_op).optional_variables}
    with graph.as_default():
        variables = [
            v
            for v in tf.compat.v1.global_variables()
            if not v.op.name.startswith("nanguard/") and v.op.name not in optional
        ]
    shapes = checkpoint_shapes(checkpoint, "--train_dir")
    check_fits(
        checkpoint,
        variables,
        shapes,
        what="The checkpoint in --train_dir ({path})",
        ignore_missing=False,
        advice="It was written by another model or other options (optimizer, "
        "model_name): resume with the same flags, or use a new --train_dir.",
    )
