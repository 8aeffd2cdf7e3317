"""What the launchers print: the summary of a run, and one or two lines for an error."""

from __future__ import annotations

import dataclasses
import shlex
from typing import List, Optional

import tensorflow as tf

import slim_nanguard
from slim_nanguard import Cause
from slim_nanguard import StopReason
from slim_nanguard import storage
from slim_nanguard.app import config as config_lib

__all__ = ["describe_training", "error_message", "eval_command"]


def describe_training(
    result: slim_nanguard.TrainResult, config: Optional[config_lib.TrainConfig] = None
) -> str:
    """The summary printed at the end of a run: a few labelled lines.

    Args:
      result: What `run_training` returned (its spikes are shown with a spike test, or
        when there were any).
      config: The run's config, for the step limit, the policy that stopped it and the spike
        test.

    Returns:
      The lines, without a final newline.
    """
    total = ""
    if config is not None and config.max_number_of_steps is not None:
        total = f"/{config.max_number_of_steps}"
    policy, stopped_by = "--nan_policy", "--nan_policy=stop at a bad step"
    if config is not None and config.guard.nan_policy != slim_nanguard.Action.STOP:
        # The launcher has no on_nan: only an escalation stops a run under another policy.
        policy = "--persistent_nan_policy"
        stopped_by = (
            f"--persistent_nan_policy=stop after --max_consecutive_bad_steps="
            f"{config.guard.max_consecutive_bad_steps} bad steps in a row"
        )
    # Each headline one string, "{}" for the global step (the docs' quotes are held to them).
    headlines = {
        StopReason.STEP_LIMIT: "Training reached the step limit at global step {}.",
        StopReason.POLICY: f"Training stopped by {stopped_by} at global step {{}}.",
        StopReason.INTERRUPTED: "Training interrupted (Ctrl-C), stopped cleanly at global step {}.",
        StopReason.TERMINATED: "Training terminated (SIGTERM), stopped cleanly at global step {}.",
        StopReason.END_OF_DATA: "Training the input ran out at global step {}.",
        StopReason.REQUESTED: "Training a hook asked to stop at global step {}.",
        StopReason.CLUSTER_STOP: (
            "Training stopped because another worker of the cluster stopped or failed at "
            "global step {}."
        ),
        StopReason.DISK_FULL: "Training stopped by a full disk at global step {}.",
    }
    default = f"Training {result.stop_reason} at global step {{}}."
    headline = headlines.get(result.stop_reason, default)
    lines = [
        headline.format(f"{result.global_step}{total}"),
        f"  final loss    {result.final_loss:.4f}"
        if result.steps
        else "  final loss    - (no step in this run)",
        f"  steps         {result.steps} good steps in this run",
        f"  bad steps     {result.bad_steps} (skipped {result.skips}, rolled back "
        f"{result.rollbacks}"
        + (
            f", sent {result.rollback_requests} to the chief to roll back"
            if result.rollback_requests
            else ""
        )
        + ")",
    ]
    lines += _rejected_lines(result, config)
    if result.learning_rate_scale != 1.0:
        lines.append(f"  lr scale      {result.learning_rate_scale:g} (after rollbacks)")
    lines.append(f"  checkpoint    {result.checkpoint}")
    if result.climb is not None:  # The steps before the bad one climbed: no good state.
        lines[-1] += f" (not a good state: the steps climbed to it from global step {result.climb})"
        resume = result.resume_from or "none: no checkpoint predates the climb"
        lines.append(
            f"  resume from   {resume} (before the climb; with a lower --learning_rate, or use "
            f"{policy}=rollback, which goes back before the climb)"
        )
    lines.append(f"  event record  {result.events_path}")
    return "\n".join(lines)


def _rejected_lines(result, config) -> List[str]:
    """A line per reason to reject a step (the spike test, the user's): how many bad steps
    it rejected, with its settings (``--`` before those that are launcher flags)."""
    reasons = config.guard.all_reasons if config is not None else ()
    counts = dict(result.rejected)
    settings = {r.name: r.settings() for r in reasons}
    lines = []
    for name in list(settings) + [n for n in counts if n not in settings]:
        shown = ", ".join(
            f"{'--' if key in config_lib.GUARD_FLAGS else ''}{key}={_setting(value)}"
            for key, value in settings.get(name, {}).items()
        )
        shown = f" ({shown})" if shown else ""
        lines.append(f"  {name + 's':<13} {counts.get(name, 0)} of the bad steps{shown}")
    return lines


def _setting(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def eval_command(config: config_lib.EvalConfig) -> str:
    """The ``slim-nanguard-eval`` command line that runs the evaluation `config` describes.

    Args:
      config: The evaluation; its ``checkpoint_path`` is always given, every other setting
        only where it differs from the default.

    Returns:
      The command, its values quoted for a POSIX shell.
    """
    words = ["slim-nanguard-eval"]
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.name == "checkpoint_path" or (value is not None and value != field.default):
            words.append(f"--{field.name}={value}")
    return " ".join(shlex.quote(word) for word in words)


# What to do, by why training gave up (`NanLossError.cause`).
_GIVE_UP_ADVICE = {
    Cause.MAX_CONSECUTIVE_BAD_STEPS: (
        "Every batch is now rejected (NaN, Inf or a spike), so the weights went bad in the "
        "steps before (a learning rate too high?). After that many bad steps in a row, "
        "--persistent_nan_policy=rollback restores the last good checkpoint (with "
        "--rollback_lr_factor to lower the learning rate), and "
        "--persistent_nan_policy=stop ends the run cleanly."
    ),
    Cause.MAX_ROLLBACKS: (
        "Rolling back did not help: lower --learning_rate, or --rollback_lr_factor "
        "so that each rollback lowers it further."
    ),
    Cause.POLICY: "To carry on past bad steps, use --nan_policy=skip or --nan_policy=rollback.",
    Cause.DIVERGENCE: (
        "What the guard took for a new level of the loss was a divergence (a spike followed "
        "it at once): lower --learning_rate, or --persistent_nan_policy=rollback to go back "
        "before it."
    ),
    Cause.UNGUARDED_LOSS: (
        "The loss comes from no guarded train op: build it with slim_nanguard.create_train_op."
    ),
}


def error_message(err: BaseException) -> str:
    """One or two lines for a user: what went wrong and what to do.

    Errors of slim_nanguard (and ValueErrors) carry their own advice; TensorFlow's errors
    are cut to their first line, which names the op and the problem.
    """
    if isinstance(err, slim_nanguard.NanLossError):
        advice = _GIVE_UP_ADVICE.get(err.cause, _GIVE_UP_ADVICE[Cause.POLICY])
        reason = getattr(err.event, "reason", None)
        if err.cause in (None, Cause.POLICY) and reason is not None:
            # The flag of the reason that rejected the step: a spike is --spike_policy's.
            flag = f"--{reason.policy_name}"
            advice = f"To carry on past {reason.what}, use {flag}=skip or {flag}=rollback."
        if err.climb is not None:  # The accepted steps climbed to it: skipping won't help.
            resume = (
                f"Resume from {err.resume_from}, the newest checkpoint from before the climb,"
                if err.resume_from
                else "No checkpoint predates the climb: train again"
            )
            advice = (
                f"{resume} with a lower --learning_rate, or use --{err.policy_name}=rollback, "
                "which goes back before the climb."
            )
        checkpoint = getattr(err, "checkpoint", None)
        if checkpoint:
            step = storage.checkpoint_step(checkpoint)
            kept = f" (global step {step})" if step is not None else ""
            if err.climb is not None:
                advice = (
                    f"The state of the last accepted step{kept} is saved as {checkpoint}; the "
                    f"steps climbed to it from global step {err.climb} on: it is not a good "
                    f"state. {advice}"
                )
            elif err.cause == Cause.POLICY:  # One bad step: the state before it is good.
                advice = f"The last good state{kept} is saved as {checkpoint}. {advice}"
            else:  # A run of bad steps: the accepted steps before it may have climbed.
                advice = (
                    f"The state of the last accepted step{kept} is saved as {checkpoint}; "
                    "it may be on the climb that led to the bad steps, so an older checkpoint "
                    f"of the directory may be the better start. {advice}"
                )
        return f"{err}\n{advice}"
    if isinstance(err, tf.errors.NotFoundError):
        return f"{storage.op_error_cause(err)}\nCheck the file and directory flags."
    if isinstance(err, tf.errors.OpError):
        text = storage.op_error_cause(err)
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
