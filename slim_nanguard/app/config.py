"""The launcher's configs: a training run's and an evaluation's settings, checked.

`TrainConfig` and `EvalConfig` are frozen dataclasses whose fields are the launchers' flags
(``scripts/train.py`` and ``scripts/eval.py`` take their defaults from here). Each checks its
settings when made, before anything is read or written, and raises a `LaunchError` naming the
setting, its flag and the value, and saying what to do.

The guard's settings are not repeated here: a `TrainConfig` holds a `slim_nanguard.GuardConfig`
(``guard``), which declares and checks them; the flags of `GUARD_FLAGS` set its fields of the
same name, and `TrainConfig.from_flags` turns its `ValueError` into a `LaunchError` that opens
with the flag and the value (``--rollback_lr_factor=2.0: rollback_lr_factor must be ...``).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import re
from typing import Mapping, Optional, Tuple

import numpy as np

import slim_nanguard
from slim_nanguard.app import datasets
from slim_nanguard.app import faults as faults_lib
from slim_nanguard.app import models

__all__ = [
    "DECAY_TYPES",
    "DEFAULT_GUARD",
    "GUARD_FLAGS",
    "PERSISTENT_POLICIES",
    "SPIKE_POLICIES",
    "NO_SPIKE_TEST",
    "OPTIMIZERS",
    "EvalConfig",
    "LaunchError",
    "TrainConfig",
]

OPTIMIZERS = ("sgd", "momentum", "rmsprop", "adam", "adagrad", "adadelta", "ftrl")
DECAY_TYPES = ("fixed", "exponential", "polynomial")

# The guard's settings that are launcher flags: each flag is named as its GuardConfig field.
# All but on_nan (a Python callback) and reasons (`REASONS_FLAG`).
GUARD_FLAGS = (
    "nan_policy",
    "max_consecutive_bad_steps",
    "persistent_nan_policy",
    "rollback_skip_batches",
    "rollback_lr_factor",
    "max_rollbacks",
    "autopsy_max_steps",
    "autopsy_timeout_secs",
    "autopsy_keep_first",
    "autopsy_keep_last",
    "losses_before",
    "spike_policy",
    "spike_sigma",
    "spike_warmup_steps",
    "spike_level_shift_steps",
)
# The launcher flag of GuardConfig's reasons: ``module:name`` entries (`load_reason`).
REASONS_FLAG = "reasons"

# The launcher's word for GuardConfig's spike_policy=None (no spike test): ``--spike_policy=none``.
NO_SPIKE_TEST = "none"

# The launcher's guard: GuardConfig's defaults, except that a bad step is skipped.
DEFAULT_GUARD = slim_nanguard.GuardConfig(nan_policy=slim_nanguard.Action.SKIP)


def _accepted(field: str, value) -> bool:
    """Whether GuardConfig accepts `value` for `field` (a flag's choices are what it accepts)."""
    try:
        dataclasses.replace(DEFAULT_GUARD, **{field: value})
    except ValueError:
        return False
    return True


# The choices of --persistent_nan_policy: the policies GuardConfig takes there (not skip).
PERSISTENT_POLICIES = tuple(
    a.value for a in slim_nanguard.Action if _accepted("persistent_nan_policy", a.value)
)
# The policies of --spike_policy.
SPIKE_POLICIES = tuple(a.value for a in slim_nanguard.Action if _accepted("spike_policy", a.value))


class LaunchError(slim_nanguard.NanGuardError, ValueError):
    """A bad launcher setting or checkpoint; the message names it and says what to do.

    A ``ValueError`` as well, so that ``except ValueError`` clauses catch it.
    """


def check(condition: bool, message: str) -> None:
    """Raises `LaunchError` with `message` unless `condition` holds."""
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
        (`models.ModelSpec.default_image_size`), or the dataset's own size for ``mlp``.
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
      guard: The guard's settings (policy, escalation, rollbacks, autopsies): a
        `slim_nanguard.GuardConfig`, which checks them; `DEFAULT_GUARD` skips a bad step. The
        flags of `GUARD_FLAGS` set its fields (`from_flags`).
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
    max_number_of_steps: Optional[int] = 2000
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
    guard: slim_nanguard.GuardConfig = DEFAULT_GUARD
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
        check(
            isinstance(self.train_dir, (str, os.PathLike)) and bool(os.fspath(self.train_dir)),
            "train_dir (--train_dir) must name a directory for checkpoints and logs.",
        )
        for name in ("train_dir", "dataset_dir", "checkpoint_path"):
            _check_no_flag_in_path(name, getattr(self, name))
        _check_model_and_dataset(self.model_name, self.dataset_name)
        check(
            self.optimizer in OPTIMIZERS,
            f"Unknown optimizer {self.optimizer!r} (--optimizer): choose one of "
            f"{', '.join(OPTIMIZERS)}.",
        )
        check(
            self.learning_rate_decay_type in DECAY_TYPES,
            f"Unknown learning_rate_decay_type {self.learning_rate_decay_type!r} "
            f"(--learning_rate_decay_type): choose one of {', '.join(DECAY_TYPES)}.",
        )
        check(
            isinstance(self.guard, slim_nanguard.GuardConfig),
            f"guard must be a slim_nanguard.GuardConfig; got {self.guard!r}.",
        )
        for name in ("batch_size", "max_checkpoints_to_keep"):
            value = getattr(self, name)
            check(
                _is_int(value) and value >= 1,
                f"{name} (--{name}) must be a positive integer; got {value!r}.",
            )
        for name in (
            "log_every_n_steps",
            "save_interval_steps",
            "save_summaries_steps",
            "task",
        ):
            value = getattr(self, name)
            check(
                _is_int(value) and value >= 0,
                f"{name} (--{name}) must be an integer >= 0; got {value!r}.",
            )
        check(
            self.max_number_of_steps is None
            or (_is_int(self.max_number_of_steps) and self.max_number_of_steps >= 0),
            "max_number_of_steps (--max_number_of_steps) must be an integer >= 0 (or unset "
            f"to train until stopped); got {self.max_number_of_steps!r}.",
        )
        check(
            self.train_image_size is None
            or (_is_int(self.train_image_size) and self.train_image_size >= 1),
            "train_image_size (--train_image_size) must be a positive integer; got "
            f"{self.train_image_size!r}.",
        )
        check(
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
            check(
                _is_number(value) and value >= 0,
                f"{name} (--{name}) must be a number >= 0; got {value!r}.",
            )
        check(
            self.label_smoothing < 1,
            f"label_smoothing (--label_smoothing) must be below 1; got {self.label_smoothing!r}.",
        )
        check(
            _is_number(self.num_epochs_per_decay) and self.num_epochs_per_decay > 0,
            "num_epochs_per_decay (--num_epochs_per_decay) must be a positive number; got "
            f"{self.num_epochs_per_decay!r}.",
        )
        check(
            self.seed is None or _is_int(self.seed),
            f"seed (--seed) must be an integer; got {self.seed!r}.",
        )
        _check_dataset_dir(self.dataset_name, self.dataset_dir)

    @classmethod
    def from_flags(cls, **settings) -> TrainConfig:
        """The config of settings named as the launcher's flags, the guard's among them.

        Args:
          **settings: `TrainConfig` fields, and `GuardConfig` fields named in `GUARD_FLAGS`,
            which replace those of ``guard`` (default `DEFAULT_GUARD`); ``spike_policy`` may
            be `NO_SPIKE_TEST` (``"none"``), GuardConfig's None; `REASONS_FLAG`: the
            ``module:name`` entries of GuardConfig's ``reasons`` (`load_reason`).

        Raises:
          LaunchError: A setting is bad: the message names its flag and the value.
        """
        guard = {name: settings.pop(name) for name in GUARD_FLAGS if name in settings}
        if guard.get("spike_policy") == NO_SPIKE_TEST:
            guard["spike_policy"] = None
        if REASONS_FLAG in settings:
            guard["reasons"] = tuple(load_reason(s) for s in settings.pop(REASONS_FLAG) or ())
        try:
            settings["guard"] = dataclasses.replace(settings.get("guard", DEFAULT_GUARD), **guard)
        except ValueError as err:
            raise LaunchError(_flag_error(err, guard)) from None
        return cls(**settings)

    @property
    def is_chief(self) -> bool:
        return self.task == 0


def load_reason(spec) -> slim_nanguard.Reason:
    """The `slim_nanguard.Reason` a ``--reasons`` entry names: ``module:name``, an importable
    module's Reason object, or a function that takes nothing and returns one. A `Reason`
    given as it is passes through.

    Raises:
      LaunchError: The module cannot be imported, has no such name, or it is no Reason.
    """
    if isinstance(spec, slim_nanguard.Reason):
        return spec
    module_name, _, name = str(spec).partition(":")
    where = f"--reasons={spec}"
    if not module_name or not name:
        raise LaunchError(
            f"{where}: give module:name (a slim_nanguard.Reason, or a function of none)."
        )
    try:
        found = getattr(importlib.import_module(module_name), name)
    except ImportError as err:
        raise LaunchError(
            f"{where}: cannot import {module_name!r} ({err}); put it on PYTHONPATH."
        ) from None
    except AttributeError:
        raise LaunchError(f"{where}: module {module_name!r} has no {name!r}.") from None
    reason = found() if callable(found) and not isinstance(found, type) else found
    if not isinstance(reason, slim_nanguard.Reason):
        raise LaunchError(
            f"{where}: {name} is {type(reason).__name__}, not a slim_nanguard.Reason (or a "
            "function of none that returns one)."
        )
    return reason


def _flag_error(err: ValueError, flags: Mapping[str, object]) -> str:
    """GuardConfig's message for a bad setting, opened by the flag that set it and its value.

    GuardConfig's messages begin with the setting's name, which is the flag's.
    """
    name = str(err).split(" ", 1)[0]
    return f"--{name}={flags[name]}: {err}" if name in flags else str(err)


def _check_model_and_dataset(model_name: str, dataset_name: str) -> None:
    """Raises LaunchError naming the flag if the model or the dataset is unknown."""
    check(
        model_name in models.MODEL_NAMES,
        f"Unknown model name {model_name!r} (--model_name): choose one of "
        f"{', '.join(models.MODEL_NAMES)}.",
    )
    check(
        dataset_name in datasets.DATASET_NAMES,
        f"Unknown dataset name {dataset_name!r} (--dataset_name): choose one of "
        f"{', '.join(datasets.DATASET_NAMES)}.",
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
    check(
        match is None,
        f"{name} (--{name}) {text!r} holds the flag {match.group(1) if match else ''!r}: "
        "a flagfile line takes one flag; put each flag on its own line.",
    )


def _check_dataset_dir(dataset_name: str, dataset_dir: Optional[str]) -> None:
    holds = datasets.DATASETS[dataset_name].dataset_dir
    check(
        holds is None or dataset_dir is not None,
        f"dataset {dataset_name} needs --dataset_dir: the directory holding {holds}.",
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
        check(
            isinstance(self.checkpoint_path, (str, os.PathLike))
            and bool(os.fspath(self.checkpoint_path)),
            "checkpoint_path (--checkpoint_path) must name a checkpoint or a training directory.",
        )
        _check_model_and_dataset(self.model_name, self.dataset_name)
        check(
            _is_int(self.batch_size) and self.batch_size >= 1,
            f"batch_size (--batch_size) must be a positive integer; got {self.batch_size!r}.",
        )
        check(
            self.max_num_batches is None
            or (_is_int(self.max_num_batches) and self.max_num_batches >= 1),
            "max_num_batches (--max_num_batches) must be a positive integer (or unset for "
            f"the whole split); got {self.max_num_batches!r}.",
        )
        check(
            self.eval_image_size is None
            or (_is_int(self.eval_image_size) and self.eval_image_size >= 1),
            "eval_image_size (--eval_image_size) must be a positive integer; got "
            f"{self.eval_image_size!r}.",
        )
        _check_dataset_dir(self.dataset_name, self.dataset_dir)
        for name in ("checkpoint_path", "dataset_dir", "eval_dir"):
            _check_no_flag_in_path(name, getattr(self, name))
