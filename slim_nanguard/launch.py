"""The launcher's library half: a training run and an evaluation, from a frozen config.

``scripts/train.py`` and ``scripts/eval.py`` (the ``slim-nanguard-train`` and
``slim-nanguard-eval`` commands) only turn flags into a `TrainConfig` or `EvalConfig` and call
`run_training` or `run_eval`; tests call the same functions with no flags involved. What a
training run does, in the order of TF-Slim's ``train_image_classifier.py``::

    check the config and the fine-tuning checkpoint         # nothing written yet
    in a new graph:
        dataset (tf.data, batched, prefetched) -> images, labels   [+ injected faults]
        model by name -> logits; cross-entropy + weight decay (slim's regularization losses)
        learning rate (fixed / exponential / polynomial) and optimizer by name
        slim_nanguard.create_train_op(..., check_numerics, nan_policy, ...)
        fine-tuning init_fn (only when train_dir holds no checkpoint yet)
    check that a checkpoint already in train_dir fits this graph
    slim_nanguard.train(train_op, train_dir, ...)            # creates train_dir
    on an error before any step was saved: remove the train_dir this run created

Every error about the config or the input is raised before ``train_dir`` is created, as a
`LaunchError` (or a `datasets.DatasetError` / `models.ModelError`, all `ValueError`s under
`NanGuardError`) whose message names the setting (and its flag) and says what to do.
`error_message` turns any error the launchers catch into those one or two lines.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
import tf_slim as slim
from absl import logging

from slim_nanguard import _checkpoints
from slim_nanguard import _errors
from slim_nanguard import _guard
from slim_nanguard import _loop
from slim_nanguard import _policy
from slim_nanguard import _train_op
from slim_nanguard import datasets
from slim_nanguard import faults as faults_lib
from slim_nanguard import models

__all__ = [
    "DECAY_TYPES",
    "OPTIMIZERS",
    "EvalConfig",
    "EvalResult",
    "check_eval_dataset",
    "LaunchError",
    "TrainConfig",
    "describe_training",
    "error_message",
    "resolve_checkpoint",
    "run_eval",
    "run_training",
]

OPTIMIZERS = ("sgd", "momentum", "rmsprop", "adam", "adagrad", "adadelta", "ftrl")
DECAY_TYPES = ("fixed", "exponential", "polynomial")


class LaunchError(_errors.NanGuardError, ValueError):
    """A bad launcher setting or checkpoint; the message names it and says what to do.

    A ``ValueError`` as well, so that ``except ValueError`` clauses catch it.
    """


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise LaunchError(message)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (
        isinstance(value, (int, float, np.integer, np.floating))
        and not isinstance(value, bool)
        and math.isfinite(value)
    )


def _scopes(value) -> Tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = value.split(",")
    return tuple(s.strip() for s in value if s and s.strip())


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs; the fields are the launcher's flags.

    The names and meanings follow TF-Slim's ``train_image_classifier.py`` where there is one.

    Attributes:
      train_dir: Where checkpoints, summaries and the event record go. A run in a directory
        that holds a checkpoint resumes from it (also after the directory was moved or
        copied). A path that holds a flag (``td --max_number_of_steps=50``, what a flagfile
        line with two flags gives) is refused, as in dataset_dir and checkpoint_path.
      model_name: One of `models.MODEL_NAMES`.
      dataset_name: One of `datasets.DATASET_NAMES`.
      dataset_dir: For ``tfrecord``: the directory of the TFRecord files.
      dataset_split_name: The split to train on.
      batch_size: Examples per step.
      train_image_size: Image side fed to the model; None: the model's default
        (`models.DEFAULT_IMAGE_SIZE`), or the dataset's own size for ``mlp``.
      max_number_of_steps: Stop when the global step reaches this; None: train until stopped.
      optimizer: One of `OPTIMIZERS`.
      learning_rate: The initial learning rate.
      learning_rate_decay_type: ``fixed``, ``exponential`` or ``polynomial``.
      learning_rate_decay_factor: Factor of exponential decay.
      num_epochs_per_decay: Epochs after which the exponential rate decays, or over which the
        polynomial one falls to ``end_learning_rate``.
      end_learning_rate: Where polynomial decay ends.
      momentum: Momentum of ``momentum`` (and of ``rmsprop`` through ``rmsprop_momentum``).
      rmsprop_momentum: Momentum of ``rmsprop``.
      rmsprop_decay: Decay of ``rmsprop``.
      adam_beta1: Adam's beta1.
      adam_beta2: Adam's beta2.
      opt_epsilon: Epsilon of adam, rmsprop and adadelta.
      adadelta_rho: Adadelta's rho.
      adagrad_initial_accumulator_value: Adagrad's initial accumulator.
      ftrl_learning_rate_power: FTRL's learning-rate power.
      ftrl_initial_accumulator_value: FTRL's initial accumulator.
      ftrl_l1: FTRL's L1 regularization.
      ftrl_l2: FTRL's L2 regularization.
      weight_decay: L2 coefficient of the model's weights (slim's regularization losses).
      label_smoothing: Label smoothing of the cross-entropy.
      clip_gradient_norm: Clip each gradient to this norm; 0: no clipping.
      log_every_n_steps: Steps between progress lines (0: none).
      save_interval_secs: Seconds between checkpoints (used when save_interval_steps is 0).
      save_interval_steps: Steps between checkpoints; 0: by time.
      save_summaries_secs: Seconds between summaries (used when save_summaries_steps is 0).
      save_summaries_steps: Steps between summaries; 0: by time.
      checkpoint_path: Fine-tune from this checkpoint (a file prefix or a directory, whose
        latest checkpoint is used). Ignored when train_dir already holds a checkpoint.
      checkpoint_exclude_scopes: Variable scopes not restored from checkpoint_path.
      trainable_scopes: Variable scopes to train; empty: all trainable variables.
      ignore_missing_vars: Skip variables missing from checkpoint_path instead of failing.
      master: The TensorFlow master ('' for in-process).
      task: Task id; task 0 is the chief (initialises, restores, saves).
      check_numerics: The guard's mode: True raises at a bad step (check_numerics mode),
        False lets a hook see it (hook mode).
      nan_policy: ``raise``, ``stop``, ``skip`` or ``rollback``.
      max_consecutive_bad_steps: Under ``skip`` or ``rollback``, apply
        ``persistent_nan_policy`` after this many bad steps in a row.
      persistent_nan_policy: ``raise`` (give up), ``stop`` (clean stop) or ``rollback``
        (latest good checkpoint): what happens after ``max_consecutive_bad_steps`` bad steps in
        a row, when the weights, not a batch, went bad.
      rollback_skip_batches: Batches skipped after a rollback.
      rollback_lr_factor: Learning-rate factor at each rollback, in (0, 1].
      max_rollbacks: Give up rather than roll back more often than this.
      inject_faults: Faults to inject (`faults.FaultSpec`s or ``KIND:STEP`` strings).
      seed: Seed of the graph and of the shuffling; None: not seeded.
      max_checkpoints_to_keep: Checkpoints kept in train_dir.
    """

    train_dir: str
    model_name: str = "mlp"
    dataset_name: str = datasets.DEFAULT_DATASET
    dataset_dir: Optional[str] = None
    dataset_split_name: str = "train"
    batch_size: int = 32
    train_image_size: Optional[int] = None
    max_number_of_steps: Optional[int] = 1500
    optimizer: str = "momentum"
    learning_rate: float = 0.05
    learning_rate_decay_type: str = "fixed"
    learning_rate_decay_factor: float = 0.94
    num_epochs_per_decay: float = 2.0
    end_learning_rate: float = 0.0001
    momentum: float = 0.9
    rmsprop_momentum: float = 0.9
    rmsprop_decay: float = 0.9
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    opt_epsilon: float = 1.0
    adadelta_rho: float = 0.95
    adagrad_initial_accumulator_value: float = 0.1
    ftrl_learning_rate_power: float = -0.5
    ftrl_initial_accumulator_value: float = 0.1
    ftrl_l1: float = 0.0
    ftrl_l2: float = 0.0
    weight_decay: float = 0.00004
    label_smoothing: float = 0.0
    clip_gradient_norm: float = 0.0
    log_every_n_steps: int = 100
    save_interval_secs: float = 600
    save_interval_steps: int = 0
    save_summaries_secs: float = 600
    save_summaries_steps: int = 100
    checkpoint_path: Optional[str] = None
    checkpoint_exclude_scopes: Tuple[str, ...] = ()
    trainable_scopes: Tuple[str, ...] = ()
    ignore_missing_vars: bool = False
    master: str = ""
    task: int = 0
    check_numerics: bool = True
    nan_policy: str = _policy.SKIP
    max_consecutive_bad_steps: int = 10
    persistent_nan_policy: str = _policy.RAISE
    rollback_skip_batches: int = 1
    rollback_lr_factor: float = 1.0
    max_rollbacks: int = 3
    inject_faults: Tuple[faults_lib.FaultSpec, ...] = ()
    seed: Optional[int] = 0
    max_checkpoints_to_keep: int = 5

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        set_("checkpoint_exclude_scopes", _scopes(self.checkpoint_exclude_scopes))
        set_("trainable_scopes", _scopes(self.trainable_scopes))
        set_("inject_faults", _fault_specs(self.inject_faults))
        if self.checkpoint_path == "":
            set_("checkpoint_path", None)
        if self.dataset_dir == "":
            set_("dataset_dir", None)
        _check(
            isinstance(self.train_dir, (str, os.PathLike)) and bool(os.fspath(self.train_dir)),
            "train_dir (--train_dir) must name a directory for checkpoints and logs.",
        )
        for name in ("train_dir", "dataset_dir", "checkpoint_path"):
            _check_no_flag_in_path(name, getattr(self, name))
        _check(
            self.model_name in models.MODEL_NAMES,
            f"Unknown model name {self.model_name!r} (--model_name): choose one of "
            f"{', '.join(models.MODEL_NAMES)}.",
        )
        _check(
            self.dataset_name in datasets.DATASET_NAMES,
            f"Unknown dataset name {self.dataset_name!r} (--dataset_name): choose one of "
            f"{', '.join(datasets.DATASET_NAMES)}.",
        )
        _check(
            self.optimizer in OPTIMIZERS,
            f"Unknown optimizer {self.optimizer!r} (--optimizer): choose one of "
            f"{', '.join(OPTIMIZERS)}.",
        )
        _check(
            self.learning_rate_decay_type in DECAY_TYPES,
            f"Unknown learning_rate_decay_type {self.learning_rate_decay_type!r} "
            f"(--learning_rate_decay_type): choose one of {', '.join(DECAY_TYPES)}.",
        )
        _check(
            self.nan_policy in _policy.POLICIES,
            f"Unknown nan_policy {self.nan_policy!r} (--nan_policy): choose one of "
            f"{', '.join(_policy.POLICIES)}.",
        )
        _check(
            self.persistent_nan_policy in _policy.PERSISTENT_POLICIES,
            f"Unknown persistent_nan_policy {self.persistent_nan_policy!r} "
            "(--persistent_nan_policy): choose one of "
            f"{', '.join(_policy.PERSISTENT_POLICIES)} (what happens after "
            "--max_consecutive_bad_steps bad steps in a row).",
        )
        for name in (
            "batch_size",
            "max_consecutive_bad_steps",
            "max_rollbacks",
            "max_checkpoints_to_keep",
        ):
            value = getattr(self, name)
            _check(
                _is_int(value) and value >= 1,
                f"{name} (--{name}) must be a positive integer; got {value!r}.",
            )
        for name in (
            "log_every_n_steps",
            "save_interval_steps",
            "save_summaries_steps",
            "rollback_skip_batches",
            "task",
        ):
            value = getattr(self, name)
            _check(
                _is_int(value) and value >= 0,
                f"{name} (--{name}) must be an integer >= 0; got {value!r}.",
            )
        _check(
            self.max_number_of_steps is None
            or (_is_int(self.max_number_of_steps) and self.max_number_of_steps >= 0),
            "max_number_of_steps (--max_number_of_steps) must be an integer >= 0 (or unset "
            f"to train until stopped); got {self.max_number_of_steps!r}.",
        )
        _check(
            self.train_image_size is None
            or (_is_int(self.train_image_size) and self.train_image_size >= 1),
            "train_image_size (--train_image_size) must be a positive integer; got "
            f"{self.train_image_size!r}.",
        )
        _check(
            _is_number(self.learning_rate) and self.learning_rate > 0,
            f"learning_rate (--learning_rate) must be a positive number; got "
            f"{self.learning_rate!r}.",
        )
        for name in (
            "weight_decay",
            "label_smoothing",
            "clip_gradient_norm",
            "save_interval_secs",
            "save_summaries_secs",
            "end_learning_rate",
        ):
            value = getattr(self, name)
            _check(
                _is_number(value) and value >= 0,
                f"{name} (--{name}) must be a number >= 0; got {value!r}.",
            )
        _check(
            self.label_smoothing < 1,
            f"label_smoothing (--label_smoothing) must be below 1; got {self.label_smoothing!r}.",
        )
        _check(
            _is_number(self.num_epochs_per_decay) and self.num_epochs_per_decay > 0,
            "num_epochs_per_decay (--num_epochs_per_decay) must be a positive number; got "
            f"{self.num_epochs_per_decay!r}.",
        )
        _check(
            _is_number(self.rollback_lr_factor) and 0 < self.rollback_lr_factor <= 1,
            "rollback_lr_factor (--rollback_lr_factor) must be in (0, 1] (1 keeps the "
            f"learning rate); got {self.rollback_lr_factor!r}.",
        )
        _check(
            self.seed is None or _is_int(self.seed),
            f"seed (--seed) must be an integer; got {self.seed!r}.",
        )
        _check(
            self.dataset_name != "tfrecord" or self.dataset_dir is not None,
            "dataset tfrecord needs --dataset_dir: the directory holding the TFRecord files.",
        )

    @property
    def is_chief(self) -> bool:
        return self.task == 0

    def guard_config(self) -> _policy.GuardConfig:
        """The guard's part of the config."""
        return _policy.GuardConfig(
            nan_policy=self.nan_policy,
            max_consecutive_bad_steps=self.max_consecutive_bad_steps,
            persistent_nan_policy=self.persistent_nan_policy,
            rollback_skip_batches=self.rollback_skip_batches,
            rollback_lr_factor=self.rollback_lr_factor,
            max_rollbacks=self.max_rollbacks,
        )


def _check_no_flag_in_path(name: str, value) -> None:
    """Refuses a path that holds a flag, as a flagfile line with two flags gives.

    absl reads ``--train_dir=td --max_number_of_steps=50`` on one flagfile line as the
    directory ``td --max_number_of_steps=50``; training there would hide the second flag.
    """
    if value is None:
        return
    text = os.fspath(value)
    match = re.search(r"(?:^|\s)(--?[A-Za-z_]\w*(?:=\S*)?)", text)
    _check(
        match is None,
        f"{name} (--{name}) {text!r} holds the flag {match.group(1) if match else ''!r}: "
        "a flagfile line takes one flag; put each flag on its own line.",
    )


def _fault_specs(value) -> Tuple[faults_lib.FaultSpec, ...]:
    items = [value] if isinstance(value, (str, faults_lib.FaultSpec)) else list(value or ())
    specs = []
    for item in items:
        if isinstance(item, faults_lib.FaultSpec):
            specs.append(item)
            continue
        try:
            specs.extend(faults_lib.FaultSpec.parse_list(item))
        except ValueError as err:
            raise LaunchError(f"--inject_fault: {err}") from None
    return tuple(specs)


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """What an evaluation needs; the fields are ``scripts/eval.py``'s flags.

    Attributes:
      checkpoint_path: A checkpoint file prefix, or a directory (its latest checkpoint).
      model_name: The model the checkpoint was trained as.
      dataset_name: One of `datasets.DATASET_NAMES`.
      dataset_dir: For ``tfrecord``: the directory of the TFRecord files.
      dataset_split_name: The split to evaluate on.
      batch_size: Examples per evaluation batch.
      eval_image_size: Image side fed to the model (as in training); None: as in
        `TrainConfig.train_image_size`.
      max_num_batches: Evaluate at most this many batches; None: the whole split, once.
      eval_dir: Where to write the evaluation summaries; None: none written.
      master: The TensorFlow master.
    """

    checkpoint_path: str
    model_name: str = "mlp"
    dataset_name: str = datasets.DEFAULT_DATASET
    dataset_dir: Optional[str] = None
    dataset_split_name: str = "test"
    batch_size: int = 100
    eval_image_size: Optional[int] = None
    max_num_batches: Optional[int] = None
    eval_dir: Optional[str] = None
    master: str = ""

    def __post_init__(self):
        if self.dataset_dir == "":
            object.__setattr__(self, "dataset_dir", None)
        if self.eval_dir == "":
            object.__setattr__(self, "eval_dir", None)
        _check(
            isinstance(self.checkpoint_path, (str, os.PathLike))
            and bool(os.fspath(self.checkpoint_path)),
            "checkpoint_path (--checkpoint_path) must name a checkpoint or a training directory.",
        )
        _check(
            self.model_name in models.MODEL_NAMES,
            f"Unknown model name {self.model_name!r} (--model_name): choose one of "
            f"{', '.join(models.MODEL_NAMES)}.",
        )
        _check(
            self.dataset_name in datasets.DATASET_NAMES,
            f"Unknown dataset name {self.dataset_name!r} (--dataset_name): choose one of "
            f"{', '.join(datasets.DATASET_NAMES)}.",
        )
        _check(
            _is_int(self.batch_size) and self.batch_size >= 1,
            f"batch_size (--batch_size) must be a positive integer; got {self.batch_size!r}.",
        )
        _check(
            self.max_num_batches is None
            or (_is_int(self.max_num_batches) and self.max_num_batches >= 1),
            "max_num_batches (--max_num_batches) must be a positive integer (or unset for "
            f"the whole split); got {self.max_num_batches!r}.",
        )
        _check(
            self.eval_image_size is None
            or (_is_int(self.eval_image_size) and self.eval_image_size >= 1),
            "eval_image_size (--eval_image_size) must be a positive integer; got "
            f"{self.eval_image_size!r}.",
        )
        _check(
            self.dataset_name != "tfrecord" or self.dataset_dir is not None,
            "dataset tfrecord needs --dataset_dir: the directory holding the TFRecord files.",
        )
        for name in ("checkpoint_path", "dataset_dir", "eval_dir"):
            _check_no_flag_in_path(name, getattr(self, name))


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


# ------------------------------------------------------------------------------------------
# Checkpoints


def resolve_checkpoint(path: str, flag: str = "--checkpoint_path") -> str:
    """A checkpoint prefix from a prefix or a directory (its latest checkpoint).

    Raises:
      LaunchError: Nothing is there, or the directory holds no checkpoint.
    """
    path = os.fspath(path)
    if tf.io.gfile.isdir(path):
        latest = _checkpoints.latest_checkpoint(path)
        _check(
            latest is not None,
            f"{flag}={path} is a directory without a checkpoint: point it at a training "
            "directory that has saved one, or at a checkpoint file prefix (model.ckpt-N).",
        )
        return latest
    if tf.io.gfile.exists(path + ".index"):
        return path
    if path.endswith((".index", ".meta")) or ".data-" in path:
        prefix = path.split(".data-")[0] if ".data-" in path else path.rsplit(".", 1)[0]
        if tf.io.gfile.exists(prefix + ".index"):
            return prefix
    if tf.io.gfile.exists(path):
        # A TF1 checkpoint (V1 format) is a single file.
        try:
            tf.train.load_checkpoint(path)
            return path
        except (tf.errors.OpError, ValueError):
            pass
        raise LaunchError(
            f"{flag}={path} is not a checkpoint TensorFlow can read: pass a "
            "checkpoint prefix (model.ckpt-N, without .index) or its directory."
        )
    raise LaunchError(
        f"{flag}={path} does not exist: pass a checkpoint prefix "
        "(train_dir/model.ckpt-N) or a training directory."
    )


def _checkpoint_shapes(path: str, flag: str) -> Dict[str, List[int]]:
    try:
        return tf.train.load_checkpoint(path).get_variable_to_shape_map()
    except (tf.errors.OpError, ValueError) as err:
        raise LaunchError(
            f"{flag}: checkpoint {path} cannot be read "
            f"({_first_line(err)}); pass another checkpoint."
        ) from None


def _mismatches(variables: Sequence[tf.Variable], shapes: Dict[str, List[int]]):
    missing, wrong = [], []
    for v in variables:
        name = v.op.name
        if name not in shapes:
            missing.append(name)
        elif list(shapes[name]) != v.shape.as_list():
            wrong.append(f"{name} is {list(shapes[name])} there but {v.shape.as_list()} here")
    return missing, wrong


def _names(items: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _check_fits(
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
        raise LaunchError(f"{what} does not match the model: {_names(wrong, 2)}. {advice}")
    if missing and not ignore_missing:
        raise LaunchError(f"{what} does not match the model: it has no {_names(missing)}. {advice}")
    if missing:
        logging.warning("Not in %s, left as initialised: %s", path, _names(missing, 10))
    return [v for v in variables if v.op.name not in missing]


# ------------------------------------------------------------------------------------------
# Training


def _image_size(model_name: str, requested: Optional[int]) -> Optional[int]:
    return requested if requested is not None else models.DEFAULT_IMAGE_SIZE[model_name]


def _channels(model_name: str, dataset_name: str) -> Optional[int]:
    # The tf_slim.nets (and their checkpoints) take RGB; grey digits are repeated to 3.
    if model_name not in ("mlp", "lenet") and dataset_name != "tfrecord":
        return 3
    return None


def _learning_rate(config: TrainConfig, global_step, split_size: Optional[int]) -> tf.Tensor:
    """The learning rate as in slim's ``_configure_learning_rate``."""
    kind = config.learning_rate_decay_type
    if kind == "fixed":
        return tf.constant(config.learning_rate, tf.float32, name="fixed_learning_rate")
    _check(
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


def _optimizer(config: TrainConfig, learning_rate) -> tf.compat.v1.train.Optimizer:
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


def _in_scopes(variables, scopes: Sequence[str]):
    return [v for v in variables if any(v.op.name.startswith(s) for s in scopes)]


@dataclasses.dataclass
class _Built:
    graph: tf.Graph
    train_op: tf.Tensor
    scaffold: Optional[tf.compat.v1.train.Scaffold]
    info: datasets.DatasetInfo
    hooks: list = dataclasses.field(default_factory=list)


def _build_training(config: TrainConfig, resume: bool, cluster=None) -> _Built:
    """Builds the training graph; reads no file in train_dir and writes nothing."""
    image_size = _image_size(config.model_name, config.train_image_size)
    fine_tune_from = None
    if config.checkpoint_path is not None and not resume:
        fine_tune_from = resolve_checkpoint(config.checkpoint_path)
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
                channels=_channels(config.model_name, config.dataset_name),
            )
            injector = None
            if config.inject_faults:
                dataset = faults_lib.enumerate_batches(dataset)
                batch_index, (images, labels) = tf.compat.v1.data.make_one_shot_iterator(
                    dataset
                ).get_next()
                injector = faults_lib.FaultInjector(config.inject_faults, batch_index)
                images = injector.corrupt_images(images)
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
        learning_rate = _learning_rate(config, global_step, info.split_size)
        optimizer = _optimizer(config, learning_rate)
        if cluster is not None:
            optimizer = cluster.wrap_optimizer(optimizer, config)  # SyncReplicasOptimizer, if asked
        tf.compat.v1.summary.scalar("losses/total_loss", total_loss)

        variables_to_train = None
        if config.trainable_scopes:
            variables_to_train = _in_scopes(
                tf.compat.v1.trainable_variables(), config.trainable_scopes
            )
            if not variables_to_train:
                scopes = sorted(
                    {"/".join(v.op.name.split("/")[:2]) for v in tf.compat.v1.trainable_variables()}
                )
                raise LaunchError(
                    f"--trainable_scopes={','.join(config.trainable_scopes)} matches no "
                    f"trainable variable of model {config.model_name}; its scopes are "
                    f"{_names(scopes, 6)}."
                )

        train_op = _train_op.create_train_op(
            total_loss,
            optimizer,
            variables_to_train=variables_to_train,
            clip_gradient_norm=config.clip_gradient_norm,
            check_numerics=config.check_numerics,
            config=config.guard_config(),
        )
        lr_scale = _guard.get_guard(train_op).lr_scale
        if lr_scale is not None:
            # The rate in effect: the rollbacks' scale (restored with the model) included.
            learning_rate = learning_rate * tf.cast(lr_scale, learning_rate.dtype)
        tf.compat.v1.summary.scalar("learning_rate", learning_rate)

        scaffold = None
        if fine_tune_from is not None:
            scaffold = _fine_tune_scaffold(config, fine_tune_from)
    hooks = cluster.hooks(optimizer, config.train_dir) if cluster is not None else []
    return _Built(graph=graph, train_op=train_op, scaffold=scaffold, info=info, hooks=hooks)


def _fine_tune_scaffold(config: TrainConfig, path: str) -> tf.compat.v1.train.Scaffold:
    """A scaffold whose init_fn loads the model variables from `path` (slim's _get_init_fn)."""
    model_variables = slim.get_model_variables()
    unmatched = [
        s for s in config.checkpoint_exclude_scopes if not _in_scopes(model_variables, [s])
    ]
    if unmatched:
        scopes = sorted({"/".join(v.op.name.split("/")[:2]) for v in model_variables})
        raise LaunchError(
            f"--checkpoint_exclude_scopes={','.join(unmatched)} matches no variable of model "
            f"{config.model_name}; its scopes are {_names(scopes, 6)}."
        )
    variables = [
        v
        for v in model_variables
        if not any(v.op.name.startswith(s) for s in config.checkpoint_exclude_scopes)
    ]
    _check(
        bool(variables),
        f"--checkpoint_exclude_scopes={','.join(config.checkpoint_exclude_scopes)} excludes "
        "every variable of the model: there is nothing to fine-tune from.",
    )
    shapes = _checkpoint_shapes(path, "--checkpoint_path")
    restore = _check_fits(
        path,
        variables,
        shapes,
        what="--checkpoint_path {path}",
        ignore_missing=config.ignore_missing_vars,
        advice=f"Use a checkpoint of model {config.model_name}, list the scopes that differ "
        "in --checkpoint_exclude_scopes (e.g. the logits), or pass --ignore_missing_vars.",
    )
    _check(bool(restore), f"--checkpoint_path {path} holds none of the model's variables.")
    bad = _checkpoints.non_finite_variables(path)
    if bad:
        raise _errors.NonFiniteCheckpointError(
            f"--checkpoint_path {path} holds NaN or Inf in {_names(list(bad))}; refusing to "
            "fine-tune from it. Pick an earlier checkpoint."
        )
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


def _check_resume(config: TrainConfig, built: _Built, checkpoint: str) -> None:
    with built.graph.as_default():
        # The guard's own variables may be missing (slim_nanguard.train restores around them).
        variables = [
            v for v in tf.compat.v1.global_variables() if not v.op.name.startswith("nanguard/")
        ]
    shapes = _checkpoint_shapes(checkpoint, "--train_dir")
    _check_fits(
        checkpoint,
        variables,
        shapes,
        what="The checkpoint in --train_dir ({path})",
        ignore_missing=False,
        advice="It was written by another model or other options (optimizer, "
        "model_name): resume with the same flags, or use a new --train_dir.",
    )


def run_training(config: TrainConfig, cluster=None) -> _loop.TrainResult:
    """Builds the graph of `config` and trains it with `slim_nanguard.train`.

    Everything is checked and the graph built before ``config.train_dir`` is created; if the
    run then fails before it saved a checkpoint past step 0, a train_dir this call created is
    removed again, so a failed start leaves nothing behind.

    Args:
      config: A `TrainConfig`.
      cluster: For a worker of a ps/worker cluster, its `launch_cluster.Cluster` (then
        ``config.task`` is the worker's index; worker 0 is the chief).

    Returns:
      The `slim_nanguard.TrainResult` of the run.

    Raises:
      LaunchError, datasets.DatasetError, models.ModelError: Bad settings or input (before
        anything is written).
      NanLossError: The policy is ``raise``, or the guard gave up.
      NonFiniteCheckpointError: The checkpoint to resume or fine-tune from holds NaN or Inf.
      tf.errors.OpError: TensorFlow failed while training. A tfrecord record that fails
        (an image that does not decode) is raised as a `datasets.DatasetError` naming the file,
        the record and the cause.
    """
    if not isinstance(config, TrainConfig):
        raise LaunchError(f"run_training takes a TrainConfig; got {type(config).__name__}.")
    train_dir = os.path.abspath(os.fspath(config.train_dir))
    _check(
        not os.path.exists(train_dir) or os.path.isdir(train_dir),
        f"--train_dir={train_dir} is a file, not a directory: choose a directory.",
    )
    existing = _checkpoints.latest_good_checkpoint(train_dir) if config.is_chief else None
    if existing and config.checkpoint_path:
        logging.info(
            "Ignoring --checkpoint_path because %s already holds a checkpoint: resuming from %s.",
            train_dir,
            existing,
        )
    built = _build_training(config, resume=existing is not None, cluster=cluster)
    if existing:
        _check_resume(config, built, existing)

    created = not os.path.exists(train_dir)
    try:
        cluster_kwargs = cluster.start(built.graph) if cluster is not None else {}
        with built.graph.as_default():
            result = _loop.train(
                built.train_op,
                train_dir,
                number_of_steps=config.max_number_of_steps,
                master=cluster_kwargs.pop("master", config.master),
                is_chief=config.is_chief,
                scaffold=built.scaffold,
                hooks=built.hooks,
                **cluster_kwargs,
                save_checkpoint_secs=None
                if config.save_interval_steps
                else (config.save_interval_secs or None),
                save_checkpoint_steps=config.save_interval_steps or None,
                save_summaries_steps=config.save_summaries_steps or None,
                save_summaries_secs=None
                if config.save_summaries_steps
                else (config.save_summaries_secs or None),
                log_every_n_steps=config.log_every_n_steps,
                max_checkpoints_to_keep=config.max_checkpoints_to_keep,
            )
    except BaseException as err:
        if cluster is not None:
            cluster.finish(None)  # tells the others to stop, and the ps this worker is done
        if created and config.is_chief and not isinstance(err, _errors.NanLossError):
            _remove_if_unused(train_dir)
        if isinstance(err, tf.errors.OpError) and config.dataset_name == "tfrecord":
            # The input pipeline's error names neither the file nor the record: find them.
            found = datasets.find_bad_record(
                config.dataset_dir,
                config.dataset_split_name,
                channels=_channels(config.model_name, config.dataset_name),
            )
            if found:
                raise datasets.DatasetError(
                    f"{found}: re-run the conversion that wrote it, or move the file out of "
                    "--dataset_dir."
                ) from err
        raise
    return cluster.finish(result) if cluster is not None else result


def _remove_if_unused(train_dir: str) -> None:
    """Removes a train_dir this run created if it holds no checkpoint past step 0."""
    if not os.path.isdir(train_dir):
        return
    latest = _checkpoints.latest_checkpoint(train_dir)
    if latest is not None and not latest.endswith("-0"):
        return
    logging.info("Removing %s: the run failed before it saved any progress.", train_dir)
    shutil.rmtree(train_dir, ignore_errors=True)


# ------------------------------------------------------------------------------------------
# Evaluation


def check_eval_dataset(
    config: EvalConfig, split_flag: str = "--dataset_split_name"
) -> datasets.DatasetInfo:
    """Builds the evaluation input of `config` in a scratch graph, to fail early on bad input.

    Args:
      config: An `EvalConfig`.
      split_flag: The flag that set ``config.dataset_split_name``, named in the error (the
        training launcher's evaluation split is ``--eval_split_name``).

    Raises:
      datasets.DatasetError: The split cannot be read.
    """
    try:
        with tf.Graph().as_default():
            _, info = datasets.get_dataset(
                config.dataset_name,
                config.dataset_split_name,
                batch_size=config.batch_size,
                dataset_dir=config.dataset_dir,
                shuffle=False,
                repeat=False,
                image_size=_image_size(config.model_name, config.eval_image_size),
                channels=_channels(config.model_name, config.dataset_name),
            )
    except datasets.DatasetError as err:
        if split_flag == "--dataset_split_name":
            raise
        raise datasets.DatasetError(str(err).replace("--dataset_split_name", split_flag)) from None
    return info


def run_eval(config: EvalConfig) -> EvalResult:
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
      datasets.DatasetError, models.ModelError: Bad dataset or model settings.
    """
    if not isinstance(config, EvalConfig):
        raise LaunchError(f"run_eval takes an EvalConfig; got {type(config).__name__}.")
    path = resolve_checkpoint(config.checkpoint_path)
    shapes = _checkpoint_shapes(path, "--checkpoint_path")
    bad = _checkpoints.non_finite_variables(path)
    if bad:
        raise _errors.NonFiniteCheckpointError(
            f"checkpoint {path} holds NaN or Inf in {_names(list(bad))}; refusing to evaluate "
            "it. Evaluate an earlier checkpoint of that directory (see its 'checkpoint' file)."
        )
    image_size = _image_size(config.model_name, config.eval_image_size)
    graph = tf.Graph()
    with graph.as_default():
        with tf.device("/cpu:0"):
            dataset, info = datasets.get_dataset(
                config.dataset_name,
                config.dataset_split_name,
                batch_size=config.batch_size,
                dataset_dir=config.dataset_dir,
                shuffle=False,
                repeat=False,
                image_size=image_size,
                channels=_channels(config.model_name, config.dataset_name),
            )
            images, labels = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
        model_fn = models.get_model(config.model_name)
        logits = model_fn(images, info.num_classes, is_training=False)
        variables = slim.get_model_variables()
        restore = _check_fits(
            path,
            variables,
            shapes,
            what="--checkpoint_path {path}",
            ignore_missing=False,
            advice=f"Evaluate with the --model_name, dataset and image size it was trained "
            f"with (here: {config.model_name} on {info.image_shape[0]}x{info.image_shape[1]}x"
            f"{info.image_shape[2]} {config.dataset_name} images, {info.num_classes} classes).",
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


# ------------------------------------------------------------------------------------------
# Reporting


def describe_training(result: _loop.TrainResult, config: Optional[TrainConfig] = None) -> str:
    """The summary printed at the end of a run: a few labelled lines."""
    total = ""
    if config is not None and config.max_number_of_steps is not None:
        total = f"/{config.max_number_of_steps}"
    stopped_by = "--nan_policy=stop at a bad step"
    if config is not None and config.nan_policy != _policy.STOP:
        # The launcher has no on_nan: only an escalation stops a run under another policy.
        stopped_by = (
            f"--persistent_nan_policy=stop after --max_consecutive_bad_steps="
            f"{config.max_consecutive_bad_steps} bad steps in a row"
        )
    reasons = {
        _loop.STOP_STEP_LIMIT: "reached the step limit",
        _loop.STOP_POLICY: f"stopped by {stopped_by}",
        _loop.STOP_INTERRUPTED: "interrupted (Ctrl-C), stopped cleanly",
        _loop.STOP_TERMINATED: "terminated (SIGTERM), stopped cleanly",
        _loop.STOP_END_OF_DATA: "the input ran out",
        _loop.STOP_REQUESTED: "a hook asked to stop",
        "cluster_stop": "stopped because another worker of the cluster stopped or failed",
    }
    lines = [
        f"Training {reasons.get(result.stop_reason, result.stop_reason)} at global step "
        f"{result.global_step}{total}.",
        f"  final loss    {result.final_loss:.4f}"
        if result.steps
        else "  final loss    - (no step in this run)",
        f"  steps         {result.steps} good steps in this run",
        f"  bad steps     {result.bad_steps} (skipped {result.skips}, rolled back "
        f"{result.rollbacks})",
    ]
    if result.learning_rate_scale != 1.0:
        lines.append(f"  lr scale      {result.learning_rate_scale:g} (after rollbacks)")
    lines += [f"  checkpoint    {result.checkpoint}", f"  event record  {result.events_path}"]
    return "\n".join(lines)


def _first_line(err: BaseException) -> str:
    return _errors.op_error_cause(err)


def error_message(err: BaseException) -> str:
    """One or two lines for a user: what went wrong and what to do.

    Errors of slim_nanguard (and ValueErrors) carry their own advice; TensorFlow's errors
    are cut to their first line, which names the op and the problem.
    """
    if isinstance(err, _errors.NanLossError):
        reason = getattr(err, "reason", "") or ""
        if "max_consecutive_bad_steps" in reason and "max_rollbacks" not in reason:
            advice = (
                "Every batch now gives NaN or Inf, so the weights went bad before the loss "
                "did (a learning rate too high?). After that many bad steps in a row, "
                "--persistent_nan_policy=rollback restores the last good checkpoint (with "
                "--rollback_lr_factor to lower the learning rate), and "
                "--persistent_nan_policy=stop ends the run cleanly."
            )
        elif "rollback" in reason:
            advice = (
                "Rolling back did not help: lower --learning_rate, or --rollback_lr_factor "
                "so that each rollback lowers it further."
            )
        else:
            advice = "To carry on past bad steps, use --nan_policy=skip or --nan_policy=rollback."
        checkpoint = getattr(err, "checkpoint", None)
        if checkpoint:
            step = _checkpoints.checkpoint_step(checkpoint)
            kept = f" (global step {step})" if step is not None else ""
            advice = f"The last good state{kept} is saved as {checkpoint}. {advice}"
        return f"{err}\n{advice}"
    if isinstance(err, tf.errors.NotFoundError):
        return f"{_first_line(err)}\nCheck the file and directory flags."
    if isinstance(err, tf.errors.OpError):
        text = _first_line(err)
        if "decode" in text.lower() or "image" in text.lower():
            return (
                f"{text}\nAn image in the dataset does not decode: re-run the conversion "
                "that wrote the TFRecord files."
            )
        return text
    if isinstance(err, OSError) and err.filename:
        return f"{err.strerror}: {err.filename}"
    text = str(err).strip() or type(err).__name__
    lines = text.splitlines()
    return "\n".join(lines[:2])
