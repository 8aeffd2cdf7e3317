"""Carrying out the guard's decisions: the one place a bad step's action acts on a session.

The guard decides (`Guard.record_bad_step`, over the pure `_policy.decide`); this module acts.
Every caller goes through it: `NanLossHook.after_run` (hook mode), `train_step` and
`handle_numerics_error` (any loop), and `slim_nanguard.train`. What each action does::

    raise    -> NanLossError(event, reason, cause, limit), chained to the numerics error
                (its message now saying that the policy was applied)
    stop     -> request_stop() (the hook's run_context, a MonitoredSession's coordinator,
                or nothing: the caller reads Outcome.stop)
    skip     -> nothing: the bad step wrote nothing, the next run takes the next batch
    rollback -> rollback(raw_session, checkpoint_dir): the guard's, unless the caller
                passes its own (a cluster worker may ask its chief instead); then the
                global step is read again

One rule for the saver: a rollback restores with the guard's own (`Guard.saver`: built by
`create_train_op` when the config may roll back, or by `NanLossHook.begin` for a policy
override that may). One rule for the checkpoint directory (`checkpoint_dir_for`): the one
the caller gives, else the one the session's `CheckpointSaverHook` saves to, else the loop's
log directory.

`Outcome` says what a judged run came to, so a loop reads it instead of comparing counters.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Optional, Sequence, Tuple

import tensorflow as tf

from slim_nanguard import _errors
from slim_nanguard import _events
from slim_nanguard import _log as logging
from slim_nanguard import _policy
from slim_nanguard._types import Action
from slim_nanguard._types import RequestStop
from slim_nanguard._types import SessionLike

if TYPE_CHECKING:  # pragma: no cover
    from slim_nanguard._guard import Guard

# How a rollback is done: ``fn(raw_session, checkpoint_dir) -> checkpoint path``.
RollbackFn = Callable[[tf.compat.v1.Session, Optional[str]], str]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one judged run came to, and what was done about it.

    Attributes:
      event: The bad step's (or the loss-scale overflow's) `NanEvent`; None for a good step.
      action: The `Action` carried out; None for a good step and for an overflow.
      overflow: True for an overflow step of a dynamic loss-scale optimizer (no bad step:
        the optimizer skipped the update and lowered its scale).
      stop: True when the loop is to stop (the ``stop`` action).
      step: The global step after a rollback (None otherwise, or without a global step).
      checkpoint: The checkpoint a rollback restored, else None.
    """

    event: Optional[_events.NanEvent] = None
    action: Optional[Action] = None
    overflow: bool = False
    stop: bool = False
    step: Optional[int] = None
    checkpoint: Optional[str] = None

    @property
    def bad(self) -> bool:
        """True for a bad step (whatever was done about it)."""
        return self.action is not None

    @property
    def good(self) -> bool:
        """True for a step that trained (the global step moved on)."""
        return not self.bad and not self.overflow


GOOD = Outcome()


def raw_call(session: SessionLike, fn: Callable[[tf.compat.v1.Session], Any]) -> Any:
    """Calls ``fn(raw_session)``, going around a MonitoredSession's hooks if need be."""
    if hasattr(session, "run_step_fn"):
        return session.run_step_fn(lambda step_context: fn(step_context.session))
    return fn(session)


def session_checkpoint_dir(session: SessionLike) -> Optional[str]:
    """The directory a MonitoredTrainingSession's `CheckpointSaverHook` saves to, if any."""
    # MonitoredSession keeps its hooks in a private list; there is no public accessor.
    for hook in getattr(session, "_hooks", None) or ():
        if isinstance(hook, tf.compat.v1.train.CheckpointSaverHook):
            return getattr(hook, "_checkpoint_dir", None)
    return None


def checkpoint_dir_for(
    guard: "Guard",
    checkpoint_dir: Optional[str],
    *,
    session: Optional[SessionLike] = None,
    logdir: Optional[str] = None,
    policy: Optional[str] = None,
    advice: str,
) -> Optional[str]:
    """The checkpoint directory a rollback of `guard` uses: the one rule.

    `checkpoint_dir` when given, else the directory `session`'s `CheckpointSaverHook` saves
    to, else `logdir`. Autopsy dumps go there too (the first directory a guard is given).

    Args:
      guard: The guard.
      checkpoint_dir: The directory the caller gave, or None.
      session: The session, to look for a `CheckpointSaverHook` in.
      logdir: The loop's log directory, the last resort.
      policy: The policy applied, when a hook overrides the configured one.
      advice: What to pass, said when the directory is needed and unknown.

    Returns:
      The directory, or None when none is known and none is needed.

    Raises:
      ValueError: The policy rolls back (`_policy.rolls_back`) and no directory is known.
    """
    if not checkpoint_dir and session is not None:
        checkpoint_dir = session_checkpoint_dir(session)
    checkpoint_dir = checkpoint_dir or logdir
    if not checkpoint_dir and _policy.rolls_back(guard.config, policy):
        config = guard.config
        message = (
            f"nan_policy={str(policy or config.nan_policy)!r} (persistent_nan_policy="
            f"{str(config.persistent_nan_policy)!r}) rolls back, so it needs the "
            f"checkpoint directory: {advice}."
        )
        logging.error("slim_nanguard: %s", message)
        raise ValueError(message)
    guard.use_autopsy_dir(checkpoint_dir)  # Autopsy dumps go next to the checkpoints.
    return checkpoint_dir


def stop_session(session: SessionLike) -> None:
    """Asks a `MonitoredSession` to stop: its ``should_stop()`` is True afterwards.

    TensorFlow's public route, ``run_step_fn(lambda step_context:
    step_context.request_stop())``, raises `StopIteration` out of ``run_step_fn`` and leaves
    ``should_stop()`` False (TensorFlow 2.21): a caller looping ``while not
    sess.should_stop()`` would not stop, and one inside ``with MonitoredSession()`` would
    leave the block without the event. So this asks the session's coordinator, which only
    the session's private ``_coordinated_creator`` reaches. A raw session has no stop to
    ask: the caller reads `Outcome.stop`.
    """
    creator = getattr(session, "_coordinated_creator", None)  # pylint: disable=protected-access
    if creator is not None and getattr(creator, "coord", None) is not None:
        creator.coord.request_stop()


def give_up(
    event: _events.NanEvent, decision: _policy.Decision, error: Optional[BaseException] = None
) -> NoReturn:
    """Raises the `NanLossError` of a decision to raise, chained to `error` if given.

    The policy was applied, so a numerics error is chained as `_errors.caught_numerics_error`
    tells it: its advice for an error nothing caught does not hold here.
    """
    nan_error = _errors.NanLossError(
        event, decision.reason, cause=decision.cause, limit=decision.limit
    )
    if error is not None:
        raise nan_error from _errors.caught_numerics_error(error)
    raise nan_error


def carry_out(
    guard: "Guard",
    session: SessionLike,
    event: _events.NanEvent,
    decision: _policy.Decision,
    *,
    checkpoint_dir: Optional[str],
    request_stop: Optional[RequestStop] = None,
    rollback: Optional[RollbackFn] = None,
    error: Optional[BaseException] = None,
) -> Outcome:
    """Carries out `decision` about `event` against `session`.

    Args:
      guard: The guard that decided.
      session: A raw session or a `MonitoredSession` (a rollback goes around its hooks).
      event: The bad step's event.
      decision: What `Guard.record_bad_step` decided.
      checkpoint_dir: Where the loop saves checkpoints (see `checkpoint_dir_for`).
      request_stop: How to ask the loop to stop; default: `stop_session` on `session`.
      rollback: How to roll back, ``fn(raw_session, checkpoint_dir) -> path``; default:
        `Guard.rollback`.
      error: The numerics error of the bad step (check_numerics mode), chained to a raise.

    Returns:
      The `Outcome`.

    Raises:
      NanLossError: The decision is ``raise``.
      CheckpointNotFoundError: A rollback found no good checkpoint.
    """
    action = Action(decision.action)
    if action is Action.RAISE:
        give_up(event, decision, error)
    if action is Action.SKIP:
        return Outcome(event=event, action=action)
    if action is Action.STOP:
        if request_stop is not None:
            request_stop()
        else:
            stop_session(session)
        return Outcome(event=event, action=action, stop=True)
    if action is Action.ROLLBACK:
        roll = rollback or guard.rollback
        path = raw_call(session, lambda raw: roll(raw, checkpoint_dir))
        step = raw_call(session, guard.read_global_step)
        return Outcome(event=event, action=action, step=step, checkpoint=path)
    raise ValueError(f"no way to carry out the action {action.value!r}; add it to carry_out.")


def judge(
    guard: "Guard",
    session: SessionLike,
    *,
    checkpoint_dir: Optional[str],
    policy: Optional[str] = None,
    stored: Optional[Tuple[int, Sequence[float]]] = None,
    error: Optional[BaseException] = None,
    request_stop: Optional[RequestStop] = None,
    rollback: Optional[RollbackFn] = None,
) -> Outcome:
    """Handles a run the guard found not finite: reads it, records it, acts on it.

    Reads what the step stored (the global step and the sums), tells an overflow of a dynamic
    loss-scale optimizer from a bad step, autopsies a bad step (before any rollback), lets
    the guard decide and carries the decision out.

    Args:
      guard: The guard of the train op that ran.
      session: A raw session or a `MonitoredSession` (its hooks are not run).
      checkpoint_dir: Where the loop saves checkpoints.
      policy: The policy to apply instead of the configured one (a hook's override).
      stored: ``(step, sums)`` already read, or None to read them.
      error: The numerics error of the step (check_numerics mode).
      request_stop: See `carry_out`.
      rollback: See `carry_out`.

    Returns:
      The `Outcome`.

    Raises:
      NanLossError: The decision is ``raise`` (chained to `error`).
    """

    def record(raw: tf.compat.v1.Session):
        step, sums = stored or guard.read_bad_step(raw)
        kinds = guard.read_value_kinds(raw)  # Exact, unlike a sum that may overflow.
        if guard.is_loss_scale_overflow(sums):
            # The loss-scale optimizer skipped the update and lowered its scale.
            return guard.on_loss_scale_overflow(step=step, sums=sums, kinds=kinds), None
        autopsy = guard.autopsy(raw, step)  # Before any rollback.
        return guard.record_bad_step(
            step=step, loss=sums[0], sums=sums, policy=policy, autopsy=autopsy, kinds=kinds
        )

    event, decision = raw_call(session, record)
    if decision is None:
        return Outcome(event=event, overflow=True)
    return carry_out(
        guard,
        session,
        event,
        decision,
        checkpoint_dir=checkpoint_dir,
        request_stop=request_stop,
        rollback=rollback,
        error=error,
    )
