"""Rollback: the walk back over checkpoints, the restore, the learning-rate scale, input skipping.
A `Rollback` belongs to one guard and owns the one Saver its rollbacks restore with."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import List, Optional, Sequence, Tuple

import tensorflow as tf

from slim_nanguard import _checkpoints
from slim_nanguard import _errors
from slim_nanguard import _log as logging
from slim_nanguard import _placement
from slim_nanguard._handles import GraphHandles
from slim_nanguard._policy import GuardConfig


@dataclasses.dataclass(frozen=True)
class Restored:
    """What one rollback did: the checkpoint restored, its global step (None without a global
    step), the batches of input thrown away after it, the learning-rate scale after it, and
    why this checkpoint and not the newest ("" for the newest)."""

    checkpoint: str
    step: Optional[int]
    skipped_batches: int
    learning_rate_scale: float
    why: str = ""


def onset(
    run_start: Optional[int], run_length: int, losses: Sequence[Tuple[int, float]]
) -> Tuple[Optional[int], str]:
    """``(before_step, why)``: restore below ``before_step`` (None: the newest), for the reason
    `why`: before the climb of the losses that led to a run of bad steps starting at
    `run_start` (None: unknown), else before the run if it had more than one bad step.
    `losses`: ``(step, loss)`` of the good steps before it, oldest first."""
    if run_start is None or run_start < 0:
        return None, ""
    climb = climb_start(list(losses), run_start)
    if climb is not None:
        return climb, (
            f"the losses were climbing from global step {climb} to the bad step at "
            f"{run_start}, so the rollback goes before the climb"
        )
    if run_length > 1:
        return run_start, (
            f"{run_length} bad steps in a row began at global step {run_start}, so the "
            "rollback goes before them"
        )
    return None, ""


def before_climb(
    checkpoint_dir: Optional[str], run_start: Optional[int], losses: Sequence[Tuple[int, float]]
) -> Tuple[Optional[int], Optional[str]]:
    """For `raise` and `stop`: ``(climb, checkpoint)`` when two or more accepted steps before a
    run of bad steps starting at `run_start` were climbing (`onset`): the global step the climb
    began at, and the newest good checkpoint of `checkpoint_dir` below it (None: none); else
    ``(None, None)``."""
    climb, _ = onset(run_start, 1, losses)  # One bad step: the climb only, not the run.
    if climb is not None and sum(climb <= s < run_start for s, _ in losses) < 2:
        climb = None  # One loss above the others is a hard batch, not a climb.
    if climb is None or not checkpoint_dir:
        return climb, None
    try:
        return climb, _checkpoints.latest_good_checkpoint(checkpoint_dir, before_step=climb)
    except _errors.NanGuardError:  # None readable, or not finite: none to resume from.
        return climb, None


class Rollback:
    """Restores a guard's model from its checkpoints, with `saver` (the Saver every rollback
    restores with; None until `ensure_saver` builds one)."""

    def __init__(self, handles: GraphHandles, config: GuardConfig):
        self._handles = handles
        self._config = config
        self.saver: Optional[tf.compat.v1.train.Saver] = None
        # The Saver for a checkpoint written without some of the guard's optional variables.
        self._without_optional: Optional[tf.compat.v1.train.Saver] = None
        # The global step the last rollback restored (None before any, or without a step).
        self._restored_step: Optional[int] = None

    def ensure_saver(self) -> tf.compat.v1.train.Saver:
        """Builds the Saver if there is none yet (before the graph is finalized); returns it.
        With reasons, also one of all but the optional variables, for a checkpoint written
        without some (else the graph stays as it was: one lacking the learning-rate scale
        fails the restore)."""
        if self.saver is None:
            with self._handles.train_op.graph.as_default(), tf.init_scope(), _placement.on_host():
                self.saver = tf.compat.v1.train.Saver(max_to_keep=None, name="nanguard_rollback")
                if self._handles.report is not None:
                    optional = set(self._handles.optional_variables)
                    kept = [v for v in tf.compat.v1.global_variables() if v not in optional]
                    self._without_optional = tf.compat.v1.train.Saver(
                        kept, max_to_keep=None, name="nanguard_rollback_without_optional"
                    )
        return self.saver

    def restore(
        self,
        session: tf.compat.v1.Session,
        checkpoint_dir: Optional[str],
        *,
        bad_step: int,
        learning_rate_scale: float,
        skip_batches: Optional[int] = None,
        before_step: Optional[int] = None,
        why: str = "",
    ) -> Restored:
        """Restores the latest good checkpoint of `checkpoint_dir` into the raw `session`, skips
        `skip_batches` of input (default: ``rollback_skip_batches``) and scales the learning
        rate (`learning_rate_scale`: the scale applied so far in this process).

        A bad step at the very step the previous rollback restored goes one checkpoint
        further back each time, while older readable ones are kept (then the oldest again).
        With `before_step` (`onset`), the newest good checkpoint saved below it is restored
        if one is kept, and `why` is said in the log and kept in `Restored.why`. Raises
        CheckpointNotFoundError without a good checkpoint, ValueError without a Saver.
        """
        path, why = self._choose(checkpoint_dir, bad_step, before_step, why)
        if path is None:
            where = (
                f"in {checkpoint_dir!r}"
                if checkpoint_dir
                else "and no checkpoint directory was given (pass checkpoint_dir=..., the "
                "directory the loop saves checkpoints to)"
            )
            raise _errors.CheckpointNotFoundError(
                f"rollback needs a good checkpoint {where} and there is none; save "
                "checkpoints from the first step (save_checkpoint_steps), or choose policies "
                "that do not roll back (nan_policy, persistent_nan_policy)."
            )
        if self.saver is None:
            raise ValueError(
                "rollback needs a Saver built before the graph was finalized; build the "
                "train op with a policy that may roll back, or let NanLossHook.begin run "
                "before the graph is finalized."
            )
        handles = self._handles
        if handles.lr_scale is not None:
            # The lower of the session's (a resumed or recovered one) and this process's.
            learning_rate_scale = min(learning_rate_scale, float(session.run(handles.lr_scale)))
        missing = handles.missing_from(path) if self._without_optional else ()
        if missing:
            logging.info(
                "slim_nanguard: %s has no %s; they keep their values.",
                path,
                ", ".join(v.op.name for v in missing),
            )
        (self._without_optional if missing else self.saver).restore(session, path)
        self._restored_step = (
            int(session.run(handles.global_step)) if handles.global_step is not None else None
        )
        if handles.lr_scale is not None:
            learning_rate_scale *= self._config.rollback_lr_factor
            session.run(handles.lr_scale_assign, {handles.lr_scale_value: learning_rate_scale})
        if skip_batches is None:
            skip_batches = self._config.rollback_skip_batches
        skipped = self.skip_input(session, skip_batches)
        return Restored(path, self._restored_step, skipped, learning_rate_scale, why)

    def _choose(
        self, checkpoint_dir: Optional[str], bad_step: int, before_step: Optional[int], why: str
    ) -> Tuple[Optional[str], str]:
        """The checkpoint a rollback restores, and why (see `restore`); None: there is none."""
        latest = _checkpoints.latest_good_checkpoint
        path = latest(checkpoint_dir)
        if path is None:
            return None, why
        if before_step is not None:
            older = latest(checkpoint_dir, before_step=before_step)
            if older is None:  # The oldest kept is the least far into the run or the climb.
                kept = _checkpoints.candidates(checkpoint_dir)[0]
                steps = [s for s in map(_checkpoints.checkpoint_step, kept) if s is not None]
                if steps:
                    older = latest(checkpoint_dir, before_step=min(steps) + 1)
                why = f"{why}, but no checkpoint older than step {before_step} is kept: the oldest"
            path = older or path
            logging.warning("slim_nanguard: %s: rolling back to %s", why, path)
        elif self._restored_step is not None and bad_step == self._restored_step:
            # The state the last rollback restored went bad at once: go further back.
            older = latest(checkpoint_dir, before_step=self._restored_step)
            if older is not None:
                logging.warning(
                    "slim_nanguard: training went bad again at step %d, right "
                    "after rolling back to it; rolling back further, to %s",
                    bad_step,
                    older,
                )
                path = older
            else:  # None earlier is kept: the same step again (not a newer, failed one).
                path = latest(checkpoint_dir, before_step=self._restored_step + 1) or path
        return path, why

    def skip_input(self, session: tf.compat.v1.Session, batches: int) -> int:
        """Runs the input ops that feed the loss `batches` times; returns how many ran."""
        input_ops = list(self._handles.input_ops)
        if not input_ops or batches <= 0:
            return 0
        for done in range(batches):
            try:
                session.run(input_ops)
            except tf.errors.OutOfRangeError:
                return done
        return batches


# A loss this many times the typical loss of the steps before is part of a climb.
CLIMB_FACTOR = 2.0


def climb_start(losses: List[Tuple[int, float]], before: int) -> Optional[int]:
    """The step at which the ``(step, loss)`` of good steps, oldest first, started climbing to
    the first bad step, at global step `before`: the run of the newest points before it each
    above `CLIMB_FACTOR` times the median of the older half. None without one, or with fewer
    than four points."""
    points = [(s, v) for s, v in losses if s < before and math.isfinite(v)]
    if len(points) < 4:
        return None
    older = sorted(v for _, v in points[: len(points) // 2])
    typical = older[len(older) // 2]
    if typical <= 0:  # No factor of a loss that is not positive means a climb.
        return None
    climb = list(itertools.takewhile(lambda p: p[1] > CLIMB_FACTOR * typical, reversed(points)))
    return climb[-1][0] if climb else None
