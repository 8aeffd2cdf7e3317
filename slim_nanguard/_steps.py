"""Applying the policy to a bad step in tf-slim's loops and your own: `train_step` (or
`make_train_step`) plugs the guard into `tf_slim.learning.train`, in both modes;
`handle_numerics_error` into a hand-written check_numerics-mode loop."""

from __future__ import annotations

import functools
import os
import weakref
from typing import Any, Dict, Optional, Tuple

import numpy as np
import tensorflow as tf
import tf_slim

from slim_nanguard import _actions
from slim_nanguard import _guard
from slim_nanguard import _log as logging
from slim_nanguard import _nan_event
from slim_nanguard._types import Mode
from slim_nanguard._types import SessionLike

# The guards `train_step` said it keeps no record for (once each).
_TOLD_NO_RECORD: "weakref.WeakSet[_guard.Guard]" = weakref.WeakSet()


def handle_numerics_error(
    session: SessionLike, error: BaseException, *, checkpoint_dir: Optional[str] = None
) -> _nan_event.NanEvent:
    """Applies the guard's policy to an error raised by ``session.run(train_op)``; returns the
    event, its ``action`` carried out (``stop``: a `MonitoredSession` is asked to stop, and the
    caller leaves its loop). For a hand-written check_numerics-mode loop::

        while not sess.should_stop():
            try:
                sess.run(train_op)
            except tf.errors.InvalidArgumentError as err:
                if slim_nanguard.handle_numerics_error(sess, err).action == "stop":
                    break

    Args:
      session: A `tf.compat.v1.Session` or a `MonitoredSession` (its hooks are not run).
      checkpoint_dir: Where checkpoints are saved, for a policy that rolls back; default: the
        directory a `MonitoredTrainingSession`'s checkpoint hook saves to.

    Raises:
      NanLossError: The policy is ``raise``, or training gives up.
      CheckpointNotFoundError: A rollback found no good checkpoint.
      ValueError: The policy rolls back and no checkpoint directory is known (checked first).
      Exception: `error` itself, re-raised untouched, when no guard's check raised it.
    """
    guard = _guard.owner_of(error)
    if guard is None:
        raise error
    advice = "pass handle_numerics_error(..., checkpoint_dir=...), the directory the loop saves "
    outcome = _actions.judge(
        guard, session, checkpoint_dir=checkpoint_dir, error=error, advice=advice + "checkpoints to"
    )
    return outcome.event


class _JudgingSession:
    """The session `tf_slim.learning.train_step` runs through: a run of the train op also
    fetches the guard's ``ok`` (kept in `ok`); every other run passes through as is."""

    def __init__(self, session: tf.compat.v1.Session, guard: _guard.Guard):
        self._session = session
        self._guard = guard
        self.ok = True

    def run(self, fetches, feed_dict=None, options=None, run_metadata=None):
        items = fetches if isinstance(fetches, (list, tuple)) else [fetches]
        if not any(item is self._guard.train_op for item in items):
            return self._session.run(fetches, feed_dict, options, run_metadata)
        values, ok = self._session.run([fetches, self._guard.ok], feed_dict, options, run_metadata)
        self.ok = bool(np.asarray(ok))
        return values

    def __getattr__(self, name):
        return getattr(self._session, name)


def train_step(
    sess: tf.compat.v1.Session,
    train_op: tf.Tensor,
    global_step: tf.Tensor,
    train_step_kwargs: Dict[str, Any],
    *,
    checkpoint_dir: Optional[str] = None,
) -> Tuple[float, bool]:
    """Drop-in for `tf_slim.learning.train_step` that applies the guard's policy, in either mode.

    Use it as ``tf_slim.learning.train(..., train_step_fn=slim_nanguard.train_step)``; it
    returns ``(total_loss, should_stop)`` as tf-slim's. The record of bad steps, the autopsy
    dumps and a rollback's checkpoints go to `checkpoint_dir`, by default the loop's ``logdir``
    (its summary writer's); without one (``summary_writer=None``, a non-chief task) it keeps no
    record and says so once, and a policy that rolls back needs `make_train_step`. A bad step
    returns its loss (``stop``: with ``should_stop=True``); a loss-scale overflow is recorded
    and is no bad step. A train op no guard has runs as tf-slim's; other errors propagate
    untouched.

    Raises:
      NanLossError: The policy is ``raise``, or training gives up.
      CheckpointNotFoundError: A rollback found no good checkpoint.
      ValueError: `train_op` is a guarded loss, not its train op; or at the first step: the
        policy rolls back and no checkpoint directory is known, or a hook-mode train op was
        built in a loop body (no run can fetch its verdict).
    """
    guard = _guard.guard_of_train_op(train_op)
    if guard is None:
        return tf_slim.learning.train_step(sess, train_op, global_step, train_step_kwargs)
    # tf_slim.learning.train's logdir: train_step_kwargs has it only with trace_every_n_steps.
    logdir, writer = train_step_kwargs.get("logdir"), train_step_kwargs.get("summary_writer")
    if not logdir and hasattr(writer, "get_logdir"):
        logdir = writer.get_logdir()
    if guard.autopsy_dir is None:
        # The record's scalars go through the loop's writer (a second writer of the directory
        # could open its file's name in the same second); none without one.
        directory = checkpoint_dir or logdir
        guard.registry.use_directory(directory, writer=writer, write_summaries=writer is not None)
    checkpoint_dir = _actions.checkpoint_dir_for(
        guard,
        checkpoint_dir,
        logdir=logdir or None,
        advice="pass train_step_fn=slim_nanguard.make_train_step(logdir) to tf_slim.learning.train",
    )
    if not checkpoint_dir and guard not in _TOLD_NO_RECORD:
        _TOLD_NO_RECORD.add(guard)
        logging.warning(
            "slim_nanguard: train_step knows no directory, so bad steps leave no "
            "nanguard_events.jsonl; pass train_step_fn=slim_nanguard.make_train_step(logdir)."
        )
    if guard.mode == Mode.HOOK:
        if guard.ok is None:
            raise ValueError(
                f"train_step cannot judge {guard.train_op.name!r}: it was built in a loop "
                "body in hook mode, so no run can fetch its verdict. Train it with "
                "slim_nanguard.train, or a MonitoredTrainingSession with "
                "slim_nanguard.nan_hook(train_op)."
            )
        _actions.mark_judged(guard, sess)  # once per session: this function applies the policy
    # Hook mode, and check_numerics mode with a dynamic loss-scale optimizer, whose overflow
    # steps do not raise: read the guard's verdict with the step.
    judging = _JudgingSession(sess, guard) if guard.ok is not None else None
    error = None
    try:
        loss, should_stop = tf_slim.learning.train_step(
            judging or sess, train_op, global_step, train_step_kwargs
        )
    except tf.errors.InvalidArgumentError as err:
        if not _guard.owns_error(guard, err):
            raise
        error, loss, should_stop = err, None, False
    if error is None and (judging is None or judging.ok):
        _actions.good_step(guard, loss)
        return loss, should_stop
    # train_step stops by returning should_stop=True: nothing to ask the session.
    outcome = _actions.judge(
        guard, sess, checkpoint_dir=checkpoint_dir, error=error, request_stop=_actions.no_stop
    )
    if outcome.overflow:  # The optimizer skipped the update and lowered its scale.
        return loss, should_stop
    should_stop = should_stop or outcome.stop
    if not should_stop and "should_stop" in train_step_kwargs:
        should_stop = bool(sess.run(train_step_kwargs["should_stop"]))
    return outcome.event.loss, should_stop


def make_train_step(checkpoint_dir: str):
    """A `train_step` bound to `checkpoint_dir`, for a `tf_slim.learning.train` call with no
    summary writer (``summary_writer=None``) or whose checkpoints are elsewhere.

    Raises:
      ValueError: `checkpoint_dir` is empty or not a path.
    """
    if not checkpoint_dir or not isinstance(checkpoint_dir, (str, bytes, os.PathLike)):
        raise ValueError(
            f"make_train_step needs the directory tf_slim.learning.train saves "
            f"checkpoints to (its logdir); got {checkpoint_dir!r}."
        )
    return functools.partial(train_step, checkpoint_dir=checkpoint_dir)
