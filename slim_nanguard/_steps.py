"""Applying the policy to a bad step, in any loop.

`train_step` plugs the guard into `tf_slim.learning.train`, in both modes;
`handle_numerics_error` does the same for a hand-written check_numerics-mode loop over a
`tf.compat.v1.Session` or a `MonitoredTrainingSession`.

A loop whose policy rolls back needs the checkpoint directory, and each of these refuses to go
on without it as early as it can tell: `make_train_step` when it is called, `train_step` (which
finds `tf_slim.learning.train`'s ``logdir`` by itself) at the first step,
`handle_numerics_error` (which finds the directory of a `MonitoredTrainingSession` by itself)
before it applies the policy to the first bad step.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Dict, Optional, Tuple

import numpy as np
import tensorflow as tf
import tf_slim

from slim_nanguard import _actions
from slim_nanguard import _events
from slim_nanguard import _guard
from slim_nanguard import _log as logging
from slim_nanguard._types import Mode
from slim_nanguard._types import SessionLike


def handle_numerics_error(
    session: SessionLike, error: BaseException, *, checkpoint_dir: Optional[str] = None
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
    checkpoint_dir = _actions.checkpoint_dir_for(
        guard,
        checkpoint_dir,
        session=session,
        advice="pass handle_numerics_error(..., checkpoint_dir=...), the directory "
        "the loop saves checkpoints to",
    )
    return _actions.judge(guard, session, checkpoint_dir=checkpoint_dir, error=error).event


class _JudgingSession:
    """The session `tf_slim.learning.train_step` runs a train op through, to read ``ok``.

    A run of the train op also fetches the guard's ``ok`` boolean, kept in `ok`. Every other
    run passes through as is.
    """

    def __init__(self, session: tf.compat.v1.Session, guard: _guard.Guard):
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
    sess: tf.compat.v1.Session,
    train_op: tf.Tensor,
    global_step: tf.Tensor,
    train_step_kwargs: Dict[str, Any],
    *,
    checkpoint_dir: Optional[str] = None,
) -> Tuple[float, bool]:
    """Drop-in for `tf_slim.learning.train_step` that applies the guard's policy.

    Use it as ``tf_slim.learning.train(train_op, logdir, train_step_fn=slim_nanguard.train_step)``
    in either mode. It finds ``logdir`` in what `tf_slim.learning.train` passes
    (`learning_train_logdir`): the record of bad steps (``nanguard_events.jsonl``), the autopsy
    dumps and a rollback's checkpoints are there. Without it (``summary_writer=None``, a
    non-chief task) it logs one line saying no record is kept, and a policy that rolls back
    refuses at the first step; ``make_train_step(logdir)`` names the directory. A bad step of
    `train_op` is handled by the policy: ``skip`` returns the bad loss and carries on, ``stop``
    returns ``should_stop=True``, ``raise`` raises `NanLossError`. An overflow step of a
    dynamic loss-scale optimizer (either mode) is recorded as a ``loss_scale_overflow`` and is
    no bad step. Every other error propagates untouched.

    Args:
      sess: The session `tf_slim.learning.train` passes.
      train_op: The train op from `create_train_op`.
      global_step: The global step tensor.
      train_step_kwargs: The dict `tf_slim.learning.train` passes.
      checkpoint_dir: Where checkpoints are saved; default: `learning_train_logdir`. The
        record of bad steps (``nanguard_events.jsonl``) and the autopsy dumps go there too.

    Returns:
      ``(total_loss, should_stop)`` as tf-slim's `train_step`.

    Raises:
      ValueError: At the first step, when the policy rolls back and no checkpoint directory
        is known (use `make_train_step`).
    """
    guard = _guard.get_guard(train_op)
    if guard is None:
        return tf_slim.learning.train_step(sess, train_op, global_step, train_step_kwargs)
    logdir = learning_train_logdir(train_step_kwargs)
    checkpoint_dir = _actions.checkpoint_dir_for(
        guard,
        checkpoint_dir,
        logdir=logdir,
        advice="pass train_step_fn=slim_nanguard.make_train_step(logdir) to tf_slim.learning.train",
    )
    if not checkpoint_dir:
        _say_no_record_once(guard)
    if guard.mode == Mode.HOOK:
        if guard.ok is None:
            raise ValueError(
                f"train_step cannot judge {guard.train_op.name!r}: it was built in a loop "
                "body in hook mode, so no run can fetch its verdict. Train it with "
                "slim_nanguard.train, or a MonitoredTrainingSession with "
                "slim_nanguard.nan_hook(train_op)."
            )
        guard.mark_judged(sess)  # once per session: this function applies the policy
    # Hook mode, and check_numerics mode with a dynamic loss-scale optimizer, whose overflow
    # steps do not raise: read the guard's verdict with the step.
    judging = _JudgingSession(sess, guard) if guard.ok is not None else None
    # train_step stops by returning should_stop=True: nothing to ask the session.
    judge = functools.partial(
        _actions.judge, guard, sess, checkpoint_dir=checkpoint_dir, request_stop=_actions.no_stop
    )
    try:
        loss, should_stop = tf_slim.learning.train_step(
            judging or sess, train_op, global_step, train_step_kwargs
        )
    except tf.errors.InvalidArgumentError as error:
        if not guard.owns_error(error):
            raise
        outcome, loss, should_stop = judge(error=error), None, False
    else:
        if judging is None or judging.ok:
            _actions.good_step(guard, loss)
            return loss, should_stop
        outcome = judge()
    if outcome.overflow:  # The optimizer skipped the update and lowered its scale.
        return loss, should_stop
    should_stop = should_stop or outcome.stop
    if not should_stop and "should_stop" in train_step_kwargs:
        should_stop = bool(sess.run(train_step_kwargs["should_stop"]))
    return outcome.event.loss, should_stop


def learning_train_logdir(train_step_kwargs: Dict[str, Any]) -> Optional[str]:
    """The ``logdir`` of the `tf_slim.learning.train` call that passed `train_step_kwargs`.

    tf-slim puts ``logdir`` in the dict only with ``trace_every_n_steps``; otherwise its
    ``summary_writer``, the `Supervisor`'s, writes to ``logdir`` (the directory the
    Supervisor's checkpoints go to as well). None when neither is there: a non-chief task, or
    ``learning.train(..., summary_writer=None)``.
    """
    logdir = train_step_kwargs.get("logdir")
    writer = train_step_kwargs.get("summary_writer")
    if not logdir and writer is not None and hasattr(writer, "get_logdir"):
        logdir = writer.get_logdir()
    return logdir or None


# The guards `train_step` said it keeps no record for (once each).
_TOLD_NO_RECORD: "weakref.WeakSet[_guard.Guard]" = weakref.WeakSet()


def _say_no_record_once(guard: _guard.Guard) -> None:
    """Logs once per guard that `train_step` knows no directory to keep the record in."""
    if guard in _TOLD_NO_RECORD:
        return
    _TOLD_NO_RECORD.add(guard)
    logging.warning(
        "slim_nanguard: train_step knows no directory, so bad steps leave no "
        "nanguard_events.jsonl; pass train_step_fn=slim_nanguard.make_train_step(logdir)."
    )


def make_train_step(checkpoint_dir: str):
    """A `train_step` bound to `checkpoint_dir`: for a `tf_slim.learning.train` call that
    passes no summary writer (``summary_writer=None``), or whose checkpoints are elsewhere.

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
