"""Trains an image classifier with TF-Slim, guarded against NaN/Inf by slim_nanguard.

The flags follow TF-Slim's train_image_classifier.py (tensorflow/models research/slim) where
one means the same thing; the guard is one flag away (--nan_policy, --check_numerics) and
--inject_fault lets you watch it work. Configs are flagfiles:

    slim-nanguard-train --flagfile=configs/default.cfg
    slim-nanguard-train --train_dir=/tmp/nanguard_runs/run --inject_fault=nan_input:40

Progress goes to stderr (absl logging, INFO), the summary of the run to stdout.
Exit status: 0 finished (step limit or end of data); 1 an error (one or two lines on
stderr; --verbosity=1 adds the Python traceback and TensorFlow's start-up messages); 3
stopped by a policy (--nan_policy, --spike_policy or --persistent_nan_policy=stop) or, on a
cluster, by another worker's stop or failure; 130 interrupted by Ctrl-C and 143 terminated by
SIGTERM (each after a clean stop with a final checkpoint); 75 the disk is full (after the
summary, one line names the newest intact checkpoint: free space, then run the same command
again to resume from it).
"""

import dataclasses
import importlib.util
import os
import sys
import traceback

# The start-up helper next to this file, however the script is started (by path, through
# runpy, or as the installed console command), and before TensorFlow is imported.
_SPEC = importlib.util.spec_from_file_location(
    "slim_nanguard_quiet_start",
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "_quiet_start.py"),
)
_quiet_start = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_quiet_start)

# TensorFlow's start-up banner and C++ messages (which repeat every bad step's CheckNumerics
# message; the guard logs its own) stay out of the output unless --verbosity asks for them.
# A typo or a bad value in the flags is answered before the slow import of TensorFlow.
_quiet_start.check_flags_early(sys.argv, "train", __name__, __doc__)
with _quiet_start.quiet_imports(sys.argv):
    import tensorflow as tf  # noqa: E402
    from absl import app  # noqa: E402
    from absl import flags  # noqa: E402
    from absl import logging  # noqa: E402

    import slim_nanguard  # noqa: E402
    from slim_nanguard import app as nanguard_app  # noqa: E402
    from slim_nanguard import compat  # noqa: E402
    from slim_nanguard.app import cluster as cluster_lib  # noqa: E402
    from slim_nanguard.app import datasets  # noqa: E402
    from slim_nanguard.app import faults  # noqa: E402
    from slim_nanguard.app import models  # noqa: E402

FLAGS = flags.FLAGS
# Every default is the config's (the library's), so that a flag and its field cannot differ.
DEFAULT = nanguard_app.TrainConfig
GUARD = nanguard_app.DEFAULT_GUARD  # the guard's flags: GuardConfig's fields, checked there
POLICIES = [action.value for action in slim_nanguard.Action]

EXIT_ERROR = 1

# ----------------------------------------------------------------------- where and what
flags.DEFINE_string(
    "train_dir",
    None,
    "Directory for checkpoints, summaries and the event "
    "record (nanguard_events.jsonl). A directory with a checkpoint is resumed.",
)
flags.DEFINE_enum("model_name", DEFAULT.model_name, models.MODEL_NAMES, "The model to train.")
flags.DEFINE_enum(
    "dataset_name",
    DEFAULT.dataset_name,
    datasets.DATASET_NAMES,
    "digits: UCI 8x8 digits shipped with the package (offline); synthetic: a "
    "generated toy problem; tfrecord: TF-Slim TFRecords in --dataset_dir.",
)
flags.DEFINE_string(
    "dataset_dir", DEFAULT.dataset_dir, "Directory of the TFRecord files (tfrecord only)."
)
flags.DEFINE_string("dataset_split_name", DEFAULT.dataset_split_name, "The split to train on.")
flags.DEFINE_integer("batch_size", DEFAULT.batch_size, "Examples per step.", lower_bound=1)
flags.DEFINE_integer(
    "train_image_size",
    DEFAULT.train_image_size,
    "Image side fed to the model; default: the "
    "model's own (28 for lenet, 224 for the tf_slim.nets, the data's for mlp).",
    lower_bound=1,
)
flags.DEFINE_integer(
    "seed", DEFAULT.seed, "Seed of the graph and of the shuffling (same seed, same run)."
)

# ----------------------------------------------------------------------- optimisation
flags.DEFINE_integer(
    "max_number_of_steps", DEFAULT.max_number_of_steps, "Stop when the global step reaches this."
)
flags.DEFINE_enum("optimizer", DEFAULT.optimizer, nanguard_app.OPTIMIZERS, "The optimizer.")
flags.DEFINE_float("learning_rate", DEFAULT.learning_rate, "Initial learning rate.")
flags.DEFINE_enum(
    "learning_rate_decay_type",
    DEFAULT.learning_rate_decay_type,
    nanguard_app.DECAY_TYPES,
    "How the learning rate decays.",
)
flags.DEFINE_float(
    "learning_rate_decay_factor", DEFAULT.learning_rate_decay_factor, "Exponential decay factor."
)
flags.DEFINE_float(
    "num_epochs_per_decay",
    DEFAULT.num_epochs_per_decay,
    "Epochs per exponential decay, or over which polynomial decay reaches --end_learning_rate.",
)
flags.DEFINE_float("end_learning_rate", DEFAULT.end_learning_rate, "Where polynomial decay ends.")
flags.DEFINE_float("momentum", DEFAULT.momentum, "Momentum of the momentum optimizer.")
flags.DEFINE_float("rmsprop_momentum", DEFAULT.rmsprop_momentum, "Momentum of rmsprop.")
flags.DEFINE_float("rmsprop_decay", DEFAULT.rmsprop_decay, "Decay of rmsprop.")
flags.DEFINE_float("adam_beta1", DEFAULT.adam_beta1, "Adam's beta1.")
flags.DEFINE_float("adam_beta2", DEFAULT.adam_beta2, "Adam's beta2.")
flags.DEFINE_float("opt_epsilon", DEFAULT.opt_epsilon, "Epsilon of adam, rmsprop and adadelta.")
flags.DEFINE_float("adadelta_rho", DEFAULT.adadelta_rho, "Adadelta's rho.")
flags.DEFINE_float(
    "adagrad_initial_accumulator_value",
    DEFAULT.adagrad_initial_accumulator_value,
    "Adagrad's initial accumulator.",
)
flags.DEFINE_float(
    "ftrl_learning_rate_power", DEFAULT.ftrl_learning_rate_power, "FTRL's learning-rate power."
)
flags.DEFINE_float(
    "ftrl_initial_accumulator_value",
    DEFAULT.ftrl_initial_accumulator_value,
    "FTRL's initial accumulator.",
)
flags.DEFINE_float("ftrl_l1", DEFAULT.ftrl_l1, "FTRL's L1 regularization.")
flags.DEFINE_float("ftrl_l2", DEFAULT.ftrl_l2, "FTRL's L2 regularization.")
flags.DEFINE_float("weight_decay", DEFAULT.weight_decay, "L2 coefficient of the model's weights.")
flags.DEFINE_float(
    "label_smoothing", DEFAULT.label_smoothing, "Label smoothing of the cross-entropy."
)
flags.DEFINE_float(
    "clip_gradient_norm", DEFAULT.clip_gradient_norm, "Clip each gradient to this norm (0: off)."
)

# ----------------------------------------------------------------------- logging and saving
flags.DEFINE_integer(
    "log_every_n_steps",
    DEFAULT.log_every_n_steps,
    "Steps between progress lines (0: none).",
    lower_bound=0,
)
flags.DEFINE_integer(
    "save_interval_secs",
    int(DEFAULT.save_interval_secs),
    "Seconds between checkpoints.",
    lower_bound=0,
)
flags.DEFINE_integer(
    "save_interval_steps",
    DEFAULT.save_interval_steps,
    "Steps between checkpoints; when > 0 it replaces --save_interval_secs.",
    lower_bound=0,
)
flags.DEFINE_integer(
    "save_summaries_secs",
    int(DEFAULT.save_summaries_secs),
    "Seconds between summaries (when --save_summaries_steps is 0).",
    lower_bound=0,
)
flags.DEFINE_integer(
    "save_summaries_steps",
    DEFAULT.save_summaries_steps,
    "Steps between summaries (0: by time).",
    lower_bound=0,
)
flags.DEFINE_integer(
    "max_checkpoints_to_keep",
    DEFAULT.max_checkpoints_to_keep,
    "Checkpoints kept in --train_dir (all "
    "finite: more of them give rollback older points to return to).",
    lower_bound=1,
)
flags.DEFINE_string(
    "eval_split_name",
    "test",
    "After training, evaluate the final checkpoint on this split ('' to skip).",
)

# ----------------------------------------------------------------------- fine-tuning
flags.DEFINE_string(
    "checkpoint_path",
    DEFAULT.checkpoint_path,
    "Fine-tune from this checkpoint (prefix or "
    "directory); ignored when --train_dir already holds a checkpoint.",
)
flags.DEFINE_list(
    "checkpoint_exclude_scopes",
    list(DEFAULT.checkpoint_exclude_scopes),
    "Comma-separated variable scopes not restored from --checkpoint_path (e.g. MLP/logits).",
)
flags.DEFINE_list(
    "trainable_scopes",
    list(DEFAULT.trainable_scopes),
    "Comma-separated variable scopes to train (default: all).",
)
flags.DEFINE_boolean(
    "ignore_missing_vars",
    DEFAULT.ignore_missing_vars,
    "Leave variables missing from --checkpoint_path initialised instead of failing.",
)

# ----------------------------------------------------------------------- distribution
flags.DEFINE_string("master", DEFAULT.master, "The TensorFlow master ('' runs in-process).")
flags.DEFINE_integer("task", DEFAULT.task, "Task id; task 0 is the chief.", lower_bound=0)
flags.DEFINE_list(
    "ps_hosts",
    [],
    "Parameter servers, HOST:PORT comma-separated (with "
    "--worker_hosts, --job_name and --task: a ps/worker cluster; or TF_CONFIG).",
)
flags.DEFINE_list(
    "worker_hosts",
    [],
    "Workers, HOST:PORT comma-separated; worker 0 is the "
    "chief (checkpoints, summaries, evaluation).",
)
flags.DEFINE_enum("job_name", None, ("ps", "worker"), "This task's job in the cluster.")
flags.DEFINE_boolean(
    "sync_replicas",
    False,
    "Aggregate the workers' gradients each step "
    "(SyncReplicasOptimizer) instead of training asynchronously.",
)
flags.DEFINE_integer(
    "replicas_to_aggregate",
    None,
    "With --sync_replicas: gradients per "
    "step (default: one per worker; fewer gives backup workers).",
    lower_bound=1,
)
flags.DEFINE_float(
    "ps_timeout_secs",
    60.0,
    "How long a worker waits for the ps to answer at its start; and how long a ps waits, at "
    "the end, for a worker whose port stopped answering (killed) before exiting 1 naming it.",
    lower_bound=0.0,
)

# ----------------------------------------------------------------------- the guard
flags.DEFINE_boolean(
    "check_numerics",
    DEFAULT.check_numerics,
    "The guard's mode: a bad step raises inside the "
    "step (check_numerics mode); --nocheck_numerics lets a session hook see "
    "it (hook mode). Both write nothing on a bad step.",
)
flags.DEFINE_enum(
    "nan_policy",
    GUARD.nan_policy,
    POLICIES,
    "What a bad step (NaN/Inf loss or gradient) does: raise (exit 1), stop "
    "(clean stop, exit 3), skip (next batch), rollback (latest good checkpoint), auto (the "
    "autopsy's triage decides: skip a transient or a bad example, roll back a broken state).",
)
flags.DEFINE_integer(
    "max_consecutive_bad_steps",
    GUARD.max_consecutive_bad_steps,
    "Under skip or rollback, apply --persistent_nan_policy after this many bad steps in a row.",
    lower_bound=1,
)
flags.DEFINE_enum(
    "persistent_nan_policy",
    GUARD.persistent_nan_policy,
    nanguard_app.PERSISTENT_POLICIES,
    "What --max_consecutive_bad_steps bad steps in a row (the weights, not a "
    "batch, went bad) do under skip or rollback: raise (exit 1), stop (clean "
    "stop, exit 3), rollback (latest good checkpoint, within --max_rollbacks); not skip, which "
    "would never end.",
)
flags.DEFINE_integer(
    "rollback_skip_batches",
    GUARD.rollback_skip_batches,
    "Batches skipped after a rollback.",
    lower_bound=0,
)
flags.DEFINE_float(
    "rollback_lr_factor",
    GUARD.rollback_lr_factor,
    "Multiply the learning rate by this at each rollback, in (0, 1].",
)
flags.DEFINE_integer(
    "max_rollbacks",
    GUARD.max_rollbacks,
    "Give up (exit 1) rather than roll back more often.",
    lower_bound=1,
)
flags.DEFINE_integer(
    "autopsy_max_steps",
    GUARD.autopsy_max_steps,
    "How many bad steps get an autopsy: the step replayed from its kept batch to name the "
    "first op that made a NaN or Inf (slim-nanguard-autopsy shows it); 0: none, and no "
    "batch is kept.",
    lower_bound=0,
)
flags.DEFINE_float(
    "autopsy_timeout_secs",
    GUARD.autopsy_timeout_secs,
    "Seconds an autopsy's replay may take before it is given up (training goes on).",
)
flags.DEFINE_integer(
    "autopsy_keep_first",
    GUARD.autopsy_keep_first,
    "Autopsy dumps kept in --train_dir from the first bad steps (the oldest).",
)
flags.DEFINE_integer(
    "autopsy_keep_last",
    GUARD.autopsy_keep_last,
    "Autopsy dumps kept in --train_dir from the latest bad steps (at least 1).",
)
flags.DEFINE_integer(
    "losses_before",
    GUARD.losses_before,
    "Losses of the good steps before a bad step that its record keeps.",
)
flags.DEFINE_enum(
    "spike_policy",
    GUARD.spike_policy or nanguard_app.NO_SPIKE_TEST,
    [nanguard_app.NO_SPIKE_TEST, *nanguard_app.SPIKE_POLICIES],
    "What a spike does: a step whose values are all finite but whose loss or global gradient "
    "norm is more than --spike_sigma deviations above those of the accepted steps (it then "
    "changes nothing, and counts as a bad step in a row): raise, stop, skip, rollback or auto, "
    "as --nan_policy; none (the default): no spike test.",
)
flags.DEFINE_float(
    "spike_sigma",
    GUARD.spike_sigma,
    "With --spike_policy: how many standard deviations (of the logarithms, over the last 128 "
    "accepted steps) above their mean make a spike.",
)
flags.DEFINE_integer(
    "spike_warmup_steps",
    GUARD.spike_warmup_steps,
    "With --spike_policy: steps accepted before the first spike test (2 to 128).",
    lower_bound=2,
    upper_bound=128,
)
flags.DEFINE_integer(
    "spike_level_shift_steps",
    GUARD.spike_level_shift_steps,
    "With --spike_policy=skip: this many spikes in a row that hold together are "
    "a new level of training, not spikes: the guard says so, starts its statistics again "
    "from them and goes on (below --max_consecutive_bad_steps; 0: never).",
    lower_bound=0,
)
flags.DEFINE_list(
    "reasons",
    [],
    "More reasons to reject a step, comma-separated module:name entries: each a "
    "slim_nanguard.Reason object of an importable module, or a function of none that returns "
    "one (its policy is its own). Judged after NaN/Inf and --spike_policy.",
)
flags.DEFINE_list(
    "inject_fault",
    [],
    "Faults to inject, KIND:STEP or KIND:FIRST-LAST, comma-"
    f"separated; KIND is one of {', '.join(faults.FAULT_KINDS)}; STEP counts "
    "batches from 0 (in a fresh run, the global step of the bad step), or for "
    f"{' and '.join(faults.EXAMPLE_KINDS)} an example's position in the split, bad in "
    "every epoch.",
)

flags.mark_flag_as_required("train_dir")
flags.register_validator(
    "max_number_of_steps",
    lambda value: value is None or value >= 0,
    message="must be >= 0: the global step at which training stops.",
)


def _check_faults(values):
    for value in values:
        try:
            faults.FaultSpec.parse(value)
        except ValueError as err:
            raise flags.ValidationError(str(err)) from None
    return True


flags.register_validator("inject_fault", _check_faults)


def train_config_from_flags() -> nanguard_app.TrainConfig:
    """The TrainConfig the flags describe (a bad guard setting: a LaunchError naming its flag)."""
    names = [f.name for f in dataclasses.fields(nanguard_app.TrainConfig)]
    names += [*nanguard_app.GUARD_FLAGS, nanguard_app.REASONS_FLAG]
    values = {name: FLAGS[name].value for name in names if name in FLAGS}
    values["inject_faults"] = tuple(FLAGS.inject_fault)
    return nanguard_app.TrainConfig.from_flags(**values)


def fail(err: BaseException) -> int:
    """Prints the one-or-two-line message of `err` (and the traceback if asked); returns 1
    (a full disk: `EXIT_DISK_FULL`)."""
    if FLAGS.verbosity >= 1:
        traceback.print_exception(type(err), err, err.__traceback__)
    for line in nanguard_app.error_message(err).splitlines():
        print(f"{_prog()}: error: {line}", file=sys.stderr)
    if isinstance(err, slim_nanguard.DiskFullError):
        return nanguard_app.EXIT_DISK_FULL
    return EXIT_ERROR


def _prog() -> str:
    return os.path.basename(sys.argv[0]) or "slim-nanguard-train"


def main(argv):
    if len(argv) > 1:
        # Not app.UsageError: it prints the whole flag list.
        print(
            f"{_prog()}: error: unexpected arguments {' '.join(argv[1:])!r}: every setting "
            "is a --flag (see --helpshort).",
            file=sys.stderr,
        )
        return EXIT_ERROR
    _quiet_start.quiet_tensorflow(FLAGS.verbosity)
    logging.set_verbosity(max(FLAGS.verbosity, logging.INFO))
    tf.compat.v1.disable_v2_behavior()
    compat.install()
    cluster = None
    try:
        cluster = cluster_lib.from_flags(
            **{name: FLAGS[name].value for name in cluster_lib.CLUSTER_FLAGS},
            task=FLAGS.task,
            tf_config=os.environ.get("TF_CONFIG"),
        )
        config = train_config_from_flags()
        return nanguard_app.train_and_evaluate(
            config, cluster, eval_split_name=FLAGS.eval_split_name
        )
    except (slim_nanguard.NanGuardError, ValueError, OSError, tf.errors.OpError) as err:
        # Bad input or a NaN the policy gave up on; anything else is a bug: shown in full.
        if cluster is not None:
            cluster.finish(None)  # a worker failing early still stops the others, frees the ps
        return fail(err)


def run():
    """Entry point of the ``slim-nanguard-train`` command."""
    _quiet_start.show_flags_in_help(__name__, __doc__)
    app.run(main)


if __name__ == "__main__":
    run()
