"""Applying the policy to a numerics error, in any loop.

`train_step` plugs the guard into `tf_slim.learning.train`; `handle_numerics_error` does the
same for a hand-written loop over a `tf.compat.v1.Session` or a `MonitoredTrainingSession`.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import tensorflow as tf
import tf_slim

from slim_nanguard import _events
from slim_nanguard import _guard
from slim_nanguard import _policy


def _raw_session_call(session, fn):
    """Calls ``fn(raw_session)``, going around a MonitoredSession's hooks if need be."""
    if hasattr(session, "run_step_fn"):
        return session.run_step_fn(lambda step_context: fn(step_context.session))
    return fn(session)


def handle_numerics_error(session, error: BaseException, *,
                          checkpoint_dir: Optional[str] = None) -> _events.NanEvent:
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
        for ``persistent_nan_policy="rollback"``.

    Returns:
      The event; its ``action`` (``stop``, ``skip`` or ``rollback``) has been carried out,
      except ``stop``, which the caller carries out by leaving the loop (a MonitoredSession is
      also asked to stop).

    Raises:
      NanLossError: The policy is ``raise`` or training gives up.
      Exception: `error` itself, re-raised untouched, when no guard's check raised it.
    """
    graph = getattr(getattr(error, "op", None), "graph", None)
    guard = next((g for g in _guard.guards(graph) if g.owns_error(error)), None) if graph else None
    if guard is None:
        raise error
    if checkpoint_dir and guard.autopsy_dir is None:
        guard.autopsy_dir = checkpoint_dir  # Autopsy dumps go next to the checkpoints.
    event = _raw_session_call(session, lambda raw: guard.handle_numerics_error(raw, error))
    if event.action == _policy.STOP:
        if hasattr(session, "_coordinated_creator"):
            # MonitoredSession has no public request_stop; its coordinator does.
            session._coordinated_creator.coord.request_stop()  # pylint: disable=protected-access
    elif event.action == _policy.ROLLBACK:
        _raw_session_call(session, lambda raw: guard.rollback(raw, checkpoint_dir,
                                                              saver=guard.saver))
    return event


def train_step(sess, train_op, global_step, train_step_kwargs, *,
               checkpoint_dir: Optional[str] = None) -> Tuple[float, bool]:
    """Drop-in for `tf_slim.learning.train_step` that applies the guard's policy.

    Use it as ``tf_slim.learning.train(train_op, logdir, train_step_fn=slim_nanguard.train_step)``
    (for the ``rollback`` policy or ``persistent_nan_policy="rollback"``:
    ``train_step_fn=slim_nanguard.make_train_step(logdir)``).
    A numerics error from the guard of `train_op` is handled by the policy: ``skip`` returns
    the bad loss and carries on, ``stop`` returns ``should_stop=True``, ``raise`` raises
    `NanLossError`. Every other error propagates untouched.

    Args:
      sess: The session `tf_slim.learning.train` passes.
      train_op: The train op from `create_train_op`.
      global_step: The global step tensor.
      train_step_kwargs: The dict `tf_slim.learning.train` passes.
      checkpoint_dir: Where checkpoints are saved (rollback only, escalated or not); default:
        the ``logdir`` of `train_step_kwargs` when present.

    Returns:
      ``(total_loss, should_stop)`` as tf-slim's `train_step`.
    """
    guard = _guard.get_guard(train_op)
    try:
        loss, should_stop = tf_slim.learning.train_step(sess, train_op, global_step,
                                                        train_step_kwargs)
    except tf.errors.InvalidArgumentError as error:
        if guard is None or not guard.owns_error(error):
            raise
        dump_dir = checkpoint_dir or train_step_kwargs.get("logdir")
        if dump_dir and guard.autopsy_dir is None:
            guard.autopsy_dir = dump_dir  # Autopsy dumps go next to the checkpoints.
        event = guard.handle_numerics_error(sess, error)
        should_stop = event.action == _policy.STOP
        if event.action == _policy.ROLLBACK:
            guard.rollback(sess, checkpoint_dir or train_step_kwargs.get("logdir"),
                           saver=guard.saver)
        if not should_stop and "should_stop" in train_step_kwargs:
            should_stop = bool(sess.run(train_step_kwargs["should_stop"]))
        return event.loss, should_stop
    if guard is not None:
        guard.note_good_step()
    return loss, should_stop


def make_train_step(checkpoint_dir: str):
    """A `train_step` bound to `checkpoint_dir`, for ``rollback`` (as policy or escalation)."""
    return functools.partial(train_step, checkpoint_dir=checkpoint_dir)
