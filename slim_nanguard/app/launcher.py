"""What one run of ``slim-nanguard-train`` does, from its config: train, report, evaluate.

``scripts/train.py`` turns its flags into a `config.TrainConfig` (and, for a ps/worker
cluster, a `cluster.Cluster`) and calls `train_and_evaluate`, which returns the exit status::

    ps task:   serve until every worker is done                           -> 0
    worker or one process:
        check the training split and the evaluation split (if any)        # nothing written
        run_training(config, cluster)                                     # errors raise
        print the summary of the run
        the chief: evaluate the final checkpoint on the evaluation split, print the result
                   (not after Ctrl-C or SIGTERM: one line with the command that does it)
        -> 0 finished; 3 stopped by a policy (or by another worker); 130 Ctrl-C; 143 SIGTERM
    a full disk: the summary printed, then `slim_nanguard.DiskFullError` raised: the
    launcher's one line names the newest intact checkpoint, its exit status is EXIT_DISK_FULL
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import tensorflow as tf

import slim_nanguard
from slim_nanguard import StopReason
from slim_nanguard.app import cluster as cluster_lib
from slim_nanguard.app import config as config_lib
from slim_nanguard.app import evaluate
from slim_nanguard.app import report
from slim_nanguard.app import train

__all__ = [
    "EXIT_DISK_FULL",
    "EXIT_INTERRUPTED",
    "EXIT_NAN_STOP",
    "EXIT_OK",
    "EXIT_TERMINATED",
    "train_and_evaluate",
]

EXIT_OK = 0
EXIT_NAN_STOP = 3
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # 128 + SIGTERM, as a shell reports a process SIGTERM ended.
# sysexits.h's EX_TEMPFAIL ("a temporary failure: the user is invited to retry"): free
# space, then run the same command again to resume.
EXIT_DISK_FULL = 75

_EXIT_STATUS = {
    StopReason.POLICY: EXIT_NAN_STOP,
    StopReason.CLUSTER_STOP: EXIT_NAN_STOP,
    StopReason.INTERRUPTED: EXIT_INTERRUPTED,
    StopReason.TERMINATED: EXIT_TERMINATED,
}

# Runs the user ended (Ctrl-C, SIGTERM): no evaluation after them, and the word for each.
_SKIPS_EVALUATION = {
    StopReason.INTERRUPTED: "interrupted",
    StopReason.TERMINATED: "terminated",
}


def _echo(line: str) -> None:
    print(line, flush=True)


def train_and_evaluate(
    config: config_lib.TrainConfig,
    cluster: Optional[cluster_lib.Cluster] = None,
    *,
    eval_split_name: str = "test",
    echo: Callable[[str], None] = _echo,
) -> int:
    """Trains as `config` says, prints the summary, evaluates the final checkpoint.

    Args:
      config: The run's `TrainConfig`.
      cluster: This task's `cluster.Cluster` in a ps/worker cluster; None: one process.
      eval_split_name: After training, evaluate the final checkpoint on this split (the
        launcher's ``--eval_split_name``); empty: no evaluation. Not after Ctrl-C or SIGTERM:
        then one line says so and gives the ``slim-nanguard-eval`` command that evaluates it.
      echo: Prints one line of the summary (to stdout, by default).

    Returns:
      The exit status: `EXIT_OK`, `EXIT_NAN_STOP`, `EXIT_INTERRUPTED` or `EXIT_TERMINATED`.

    Raises:
      LaunchError, DatasetError, ModelError: Bad settings or input (before anything is
        written); an evaluation split that cannot be read is a LaunchError naming
        ``--eval_split_name``.
      NanLossError, NonFiniteCheckpointError, tf.errors.OpError: As `train.run_training`.
      DiskFullError: The disk filled up; the summary of the run is printed first.
    """
    if cluster is not None and cluster.job_name == "ps":
        cluster_lib.run_ps(cluster)  # returns once every worker is done
        echo(f"ps task {cluster.task}: every worker is done.")
        return EXIT_OK
    if cluster is not None:
        config = dataclasses.replace(config, task=cluster.task)
    eval_config = None
    if eval_split_name:
        eval_config = config_lib.EvalConfig(
            checkpoint_path=config.train_dir,
            model_name=config.model_name,
            dataset_name=config.dataset_name,
            dataset_dir=config.dataset_dir,
            dataset_split_name=eval_split_name,
            eval_image_size=config.train_image_size,
            master=config.master,
        )
        # The training split first, so that its errors name --dataset_split_name.
        evaluate.check_eval_dataset(
            dataclasses.replace(eval_config, dataset_split_name=config.dataset_split_name),
            purpose="checking the training split before training",
        )
        try:
            evaluate.check_eval_dataset(
                eval_config,
                split_flag="--eval_split_name",
                purpose="checking the evaluation split before training",
            )
        except ValueError as err:
            raise config_lib.LaunchError(
                f"--eval_split_name={eval_split_name}: {err} "
                "(--eval_split_name='' skips the evaluation)"
            ) from None
    try:
        result = train.run_training(config, cluster)
    except slim_nanguard.DiskFullError as err:
        echo(report.describe_training(err.result, config))
        raise
    echo(report.describe_training(result, config))
    if eval_config is not None and result.checkpoint and config.is_chief:
        eval_config = dataclasses.replace(eval_config, checkpoint_path=result.checkpoint)
        if result.stop_reason in _SKIPS_EVALUATION:
            # The user asked the run to end: an evaluation of the whole split is not theirs.
            echo(
                f"  evaluation    skipped ({_SKIPS_EVALUATION[result.stop_reason]}); to "
                f"evaluate the checkpoint: {report.eval_command(eval_config)}"
            )
            return _EXIT_STATUS[result.stop_reason]
        try:
            evaluation = evaluate.run_eval(eval_config)
            echo(f"  evaluation    {evaluation.describe()}")
        except (slim_nanguard.NanGuardError, ValueError, OSError, tf.errors.OpError) as err:
            echo(f"  evaluation    not possible: {report.error_message(err)}")
    return _EXIT_STATUS.get(result.stop_reason, EXIT_OK)
