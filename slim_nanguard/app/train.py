"""The launcher's training run: `run_training`, from a `TrainConfig`.

What a run does::

    check the config and the fine-tuning checkpoint         # nothing written yet
    build the graph (`build.build_training`); the input leaves out quarantined examples
    check that a checkpoint already in train_dir fits this graph
    slim_nanguard.train(train_op, train_dir, ...)            # creates train_dir
    on an error before any step was saved: remove the train_dir this run created

Every error about the config or the input is raised before ``train_dir`` is created, as a
`config.LaunchError` (or a `datasets.DatasetError` / `models.ModelError`, all `ValueError`s
under `NanGuardError`) whose message names the setting (and its flag) and says what to do.
"""

from __future__ import annotations

import tensorflow as tf
from absl import logging as absl_logging

import slim_nanguard
from slim_nanguard import storage
from slim_nanguard.app import build
from slim_nanguard.app import checkpoints
from slim_nanguard.app import config as config_lib
from slim_nanguard.app import datasets

# absl's logger itself: its module functions would configure Python's root logger in a
# script that is not run by absl's app.run (see slim_nanguard/_log.py).
logging = absl_logging.get_absl_logger()

__all__ = ["run_training"]


def run_training(config: config_lib.TrainConfig, cluster=None) -> slim_nanguard.TrainResult:
    """Builds the graph of `config` and trains it with `slim_nanguard.train`.

    Everything is checked and the graph built before ``config.train_dir`` is created; if the
    run then fails before it saved a checkpoint past step 0, a train_dir this call created is
    removed again, so a failed start leaves nothing behind.

    Args:
      config: A `TrainConfig`.
      cluster: For a worker of a ps/worker cluster, its `cluster.Cluster` (then
        ``config.task`` is the worker's index; worker 0 is the chief).

    Returns:
      The `slim_nanguard.TrainResult` of the run.

    Raises:
      LaunchError, datasets.DatasetError, models.ModelError: Bad settings or input (before
        anything is written).
      NanLossError: The policy is ``raise``, or the guard gave up.
      DiskFullError: The disk filled up (`slim_nanguard.train`'s; train_dir is kept).
      NonFiniteCheckpointError: The checkpoint to resume or fine-tune from holds NaN or Inf.
      tf.errors.OpError: TensorFlow failed while training. A tfrecord record that fails
        (an image that does not decode) is raised as a `datasets.DatasetError` naming the file,
        the record and the cause.
    """
    if not isinstance(config, config_lib.TrainConfig):
        raise config_lib.LaunchError(
            f"run_training takes a TrainConfig; got {type(config).__name__}."
        )
    train_dir = storage.absolute(config.train_dir)
    config_lib.check(
        not tf.io.gfile.exists(train_dir) or tf.io.gfile.isdir(train_dir),
        f"--train_dir={train_dir} is a file, not a directory: choose a directory.",
    )
    existing = (
        slim_nanguard.latest_good_checkpoint(train_dir, repair_state=True)
        if config.is_chief
        else None
    )
    if existing and config.checkpoint_path:
        logging.info(
            "Ignoring --checkpoint_path because %s already holds a checkpoint: resuming from %s.",
            train_dir,
            existing,
        )
    # Under auto the guard may quarantine examples; a quarantine from before stays in force.
    auto = "auto" in (config.guard.nan_policy, config.guard.spike_policy)
    quarantine = auto or bool(slim_nanguard.quarantine.read(train_dir))
    built = build.build_training(
        config, resume=existing is not None, cluster=cluster, quarantine=quarantine
    )
    if existing:
        checkpoints.check_resume(config, built.graph, existing, built.train_op)

    created = not tf.io.gfile.exists(train_dir)
    try:
        cluster_kwargs = cluster.start(built.graph) if cluster is not None else {}
        with built.graph.as_default():
            result = slim_nanguard.train(
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
        kept = (slim_nanguard.NanLossError, slim_nanguard.DiskFullError)  # they name its files
        if created and config.is_chief and not isinstance(err, kept):
            _remove_if_unused(train_dir)
        reads_files = datasets.DATASETS[config.dataset_name].dataset_dir is not None
        if isinstance(err, tf.errors.OpError) and reads_files:
            # The input pipeline's error names neither the file nor the record: find them.
            found = datasets.find_bad_record(
                config.dataset_dir,
                config.dataset_split_name,
                channels=build.input_channels(config.model_name, config.dataset_name),
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
    if not tf.io.gfile.isdir(train_dir):
        return
    latest = storage.latest_checkpoint(train_dir)
    if latest is not None and not latest.endswith("-0"):
        return
    logging.info("Removing %s: the run failed before it saved any progress.", train_dir)
    try:
        tf.io.gfile.rmtree(train_dir)
    except tf.errors.OpError as err:  # Left behind: the run's own error is what matters.
        logging.warning("Could not remove %s: %s", train_dir, err.message)
