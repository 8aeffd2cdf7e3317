"""Applying the policy to a bad step, in any loop.

`train_step` plugs the guard into `tf_slim.learning.train`, in both modes;
`handle_numerics_error` does the same for a hand-written check_numerics-mode loop over a
`tf.compat.v1.Session` or a `MonitoredTrainingSession`.

A loop whose policy rolls back needs the checkpoint directory, and each of these refuses to go
on without it as early as it can tell: `make_train_step` when it is called, `train_step` at the
first step, `handle_numerics_error` (which finds the directory of a `MonitoredTrainingSession`
by itself) before it applies the policy to the first bad step.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import numpy as np
import tensorflow as tf
import tf_slim
from absl import logging

from slim_nanguard import _events
from slim_nanguard import _guard
from slim_nanguard import _policy


def _raw_session_call(session, fn):
    """Calls ``fn(raw_session)``, going around a MonitoredSession's hooks if need be."""
    if hasattr(session, "run_step_fn"):
        return session.run_step_fn(lambda step_context: fn(step_context.session))
    return fn(session)


def _session_checkpoint_dir(session) -> Optional[str]:
    """The directory a MonitoredTrainingSession's `CheckpointSaverHook` saves to, if any."""
    for hook in getattr(session, "_hooks", None) or ():
        if isinstance(hook, tf.compat.v1.train.CheckpointSaverHook):
            return getattr(hook, "_checkpoint_dir", None)
    return None


def _require_checkpoint_dir(guard: _guard.Guard, checkpoint_dir: Optional[str], what: str) -> None:
    """Raises ValueError if `guard`'s policy rolls back and `checkpoint_dir` is unknown."""
    if guard.config.needs_checkpoint_dir and not checkpoint_dir:
        message = (
            f"nan_policy={guard.config.nan_policy!r} (persistent_nan_policy="
            f"{guard.config.persistent_nan_policy!r}) rolls back, so it needs the "
            f"checkpoint directory: {what}."
        )
        logging.error("slim_nanguard: %s", message)
        raise ValueError(message)


def handle_numerics_error(
    session, error: BaseException, *, checkpoint_dir: Optional[str] = None
) -> _events.NanEvent:
    """Applies the guard's policy to an error raised by ``session.run(train_op)``.

    For a hand-written check_numerics-mode loop::

        while not sess.should_stop():
            try:
                sess.run(train_op)
            except tf.errors.InvalidArgumentError as err:
                event = slim_nanguard.handle_numerics_error(sess, err)
                if event.action == "stop":
                    break

    Args:
      session: A `tf.compat.v1.Session` or a `MonitoredSession` (its hooks are not run).
      error: The exception ``session.run`` raised.
      checkpoint_dir: Where checkpoints are saved; needed for the ``rollback`` policy and
        for ``persistent_nan_policy="rollback"``. Default: the directory a
        `MonitoredTrainingSession`'s checkpoint hook saves to.

    Returns:
      The event; its ``action`` (``stop``, ``skip`` or ``rollback``) has been carried out,
      except ``stop``, which the caller carries out by leaving the loop (a MonitoredSession is
      also asked to stop).

    Raises:
      NanLossError: The policy is ``raise`` or training gives up.
      ValueError: The policy rolls back and no checkpoint directory is known; raised at the
        first bad step, before the policy is applied.
      Exception: `error` itself, re-raised untouched, when no guard's check raised it.
    """
    graph = getattr(getattr(error, "op", None), "graph", None)
    guard = next((g for g in _guard.guards(graph) if g.owns_error(error)), None) if graph else None
    if guard is None:
        raise error
    checkpoint_dir = checkpoint_dir or _session_checkpoint_dir(session)
    _require_checkpoint_dir(
        guard,
        checkpoint_dir,
        "pass handle_numerics_error(..., checkpoint_dir=...), the directory "
        "the loop saves checkpoints to",
    )
    if checkpoint_dir and guard.autopsy_dir is None:
        guard.autopsy_dir = checkpoint_dir  # Autopsy dumps go next to the checkpoints.
    event = _raw_session_call(session, lambda raw: guard.handle_numerics_error(raw, error))
    if event.action == _policy.STOP:
        if hasattr(session, "_coordinated_creator"):
            # MonitoredSession has no public request_stop; its coordinator does.
            session._coordinated_creator.coord.request_stop()  # pylint: disable=protected-access
    elif event.action == _policy.ROLLBACK:
        _raw_session_call(
            session, lambda raw: guard.rollback(raw, checkpoint_dir, saver=guard.saver)
        )
    return event


class _JudgingSession:
    """The session `tf_slim.learning.train_step` runs a hook-mode train op through.

    A run of the train op also fetches the guard's ``ok`` boolean, kept in `ok`. Every other
    run passes through as is.
    """

    def __init__(self, session, guard: _guard.Guard):
        self._session = session
        self._guard = guard
        self.ok = True

    def run(self, fetches, feed_dict=None, options=None, run_metadata=None):
        items = fetches if isinstance(fetches, (list, tuple)) else [fetches]
        if not any(item is self._guard.train_op for item in items):
            return self._session.run(
                fetches, feed_dict=feed_dict, options=options, run_metadata=run_metadata
            )
        values, ok = self._session.run(
            [fetches, self._guard.ok],
            feed_dict=feed_dict,
            options=options,
            run_metadata=run_metadata,
        )
        self.ok = bool(np.asarray(ok))
        return values

    def __getattr__(self, name):
        return getattr(self._session, name)


def train_step(
    sess, train_op, global_step, train_step_kwargs, *, checkpoint_dir: Optional[str] = None
) -> Tuple[float, bool]:
    """Drop-in for `tf_slim.learning.train_step` that applies the guard's policy.

    Use it as ``tf_slim.learning.train(train_op, logdir, train_step_fn=slim_nanguard.train_step)``
    (for the ``rollback`` policy or ``persistent_nan_policy="rollback"``:
    ``train_step_fn=slim_nanguard.make_train_step(logdir)``), in either mode. A bad step of
    `train_op` is handled by the policy: ``skip`` returns the bad loss and carries on, ``stop``
    returns ``should_stop=True``, ``raise`` raises `NanLossError`. Every other error
    propagates untouched.

    Args:
      sess: The session `tf_slim.learning.train` passes.
      train_op: The train op from `create_train_op`.
      global_step: The global step tensor.
      train_step_kwargs: The dict `tf_slim.learning.train` passes.
      checkpoint_dir: Where checkpoints are saved (rollback only, escalated or not); default:
        the ``logdir`` of `train_step_kwargs` when present.

    Returns:
      ``(total_loss, should_stop)`` as tf-slim's `train_step`.

    Raises:
      ValueError: At the first step, when the policy rolls back and no checkpoint directory
        is known (use `make_train_step`).
    """
    guard = _guard.get_guard(train_op)
    if guard is None:
        return tf_slim.learning.train_step(sess, train_op, global_step, train_step_kwargs)
    checkpoint_dir = checkpoint_dir or train_step_kwargs.get("logdir")
    _require_checkpoint_dir(
        guard,
        checkpoint_dir,
        "pass train_step_fn=slim_nanguard.make_train_step(logdir) to tf_slim.learning.train",
    )
    if checkpoint_dir and guard.autopsy_dir is None:
        guard.autopsy_dir = checkpoint_dir  # Autopsy dumps go next to the checkpoints.
    if guard.mode == _guard.MODE_HOOK:
        guard.mark_judged(sess)  # once per session: this function applies the policy
        judging = _JudgingSession(sess, guard)
        loss, should_stop = tf_slim.learning.train_step(
            judging, train_op, global_step, train_step_kwargs
        )
        if judging.ok:
            guard.note_good_step()
            return loss, should_stop
        step, sums = guard.read_bad_step(sess)
        if guard.is_loss_scale_overflow(sums):
            # The loss-scale optimizer skipped the update and lowered its scale: not a bad step.
            guard.on_loss_scale_overflow(step=step, sums=sums)
            return loss, should_stop
        autopsy = guard.autopsy(sess, step)  # Before any rollback.
        event = guard.on_bad_step(step=step, loss=sums[0], sums=sums, autopsy=autopsy)
        return _carry_out(sess, guard, event, checkpoint_dir, train_step_kwargs, should_stop)
    try:
        loss, should_stop = tf_slim.learning.train_step(
            sess, train_op, global_step, train_step_kwargs
        )
    except tf.errors.InvalidArgumentError as error:
        if not guard.owns_error(error):
            raise
        event = guard.handle_numerics_error(sess, error)
        return _carry_out(sess, guard, event, checkpoint_dir, train_step_kwargs, False)
    guard.note_good_step()
    return loss, should_stop


def _carry_out(
    sess,
    guard: _guard.Guard,
    event: _events.NanEvent,
    checkpoint_dir: Optional[str],
    train_step_kwargs,
    should_stop: bool,
) -> Tuple[float, bool]:
    """Carries out `event`'s action for `train_step`; returns ``(loss, should_stop)``."""
    should_stop = should_stop or event.action == _policy.STOP
    if event.action == _policy.ROLLBACK:
        guard.rollback(sess, checkpoint_dir, saver=guard.saver)
    if not should_stop and "should_stop" in train_step_kwargs:
        should_stop = bool(sess.run(train_step_kwargs["should_stop"]))
    return event.loss, should_stop


def make_train_step(checkpoint_dir: str):
    """A `train_step` bound to `checkpoint_dir`, for ``rollback`` (as policy or escalation).

    Raises:
      ValueError: `checkpoint_dir` is empty.
    """
    if (
        not checkpoint_dir
        or not isinstance(checkpoint_dir, (str, bytes))
        and not hasattr(checkpoint_dir, "__fspath__")
    ):
        raise ValueError(
            f"make_train_step needs the directory tf_slim.learning.train saves "
            f"checkpoints to (its logdir); got {checkpoint_dir!r}."
        )
    return functools.partial(train_step, checkpoint_dir=checkpoint_dir)
