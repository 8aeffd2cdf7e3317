"""Reading, recording and carrying out a bad step: the one place the guard acts on a session
(docs/design.md, "One state, one transition, one place that acts")."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Tuple

import tensorflow as tf

from slim_nanguard import _errors
from slim_nanguard import _events
from slim_nanguard import _history
from slim_nanguard import _level_shift
from slim_nanguard import _log as logging
from slim_nanguard import _policy
from slim_nanguard import _rollback
from slim_nanguard._types import Action
from slim_nanguard._types import Cause
from slim_nanguard._types import Fault
from slim_nanguard._types import RequestStop
from slim_nanguard._types import SessionLike

if TYPE_CHECKING:  # pragma: no cover
    from slim_nanguard._guard import Guard
    from slim_nanguard._guard import StepReport


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one judged run came to: the `event` of a bad step (or of an `overflow` of a dynamic
    loss-scale optimizer, no bad step), the `action` carried out on a bad step, and after a
    rollback the global `step` and the `checkpoint` restored; after a stop that ends a `climb`,
    the global step it began at and the newest checkpoint from before it (None: none)."""

    event: Optional[_events.NanEvent] = None
    action: Optional[Action] = None
    overflow: bool = False
    stop: bool = False
    step: Optional[int] = None
    checkpoint: Optional[str] = None
    climb: Optional[Tuple[int, Optional[str]]] = None

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


def checkpoint_dir_for(
    guard: "Guard",
    checkpoint_dir: Optional[str],
    *,
    session: Optional[SessionLike] = None,
    logdir: Optional[str] = None,
    advice: str,
) -> Optional[str]:
    """The checkpoint directory a rollback of `guard` uses, the one rule: `checkpoint_dir`,
    else the one `session`'s `CheckpointSaverHook` saves to, else `logdir` (the guard's autopsy
    directory too, unless it has one), else None. Raises ValueError, saying `advice`, when none
    is known and the config rolls back (`_policy.rolls_back`)."""
    if not checkpoint_dir and session is not None:
        # MonitoredSession keeps its hooks in a private list; there is no public accessor.
        hooks = getattr(session, "_hooks", None) or ()
        savers = [h for h in hooks if isinstance(h, tf.compat.v1.train.CheckpointSaverHook)]
        checkpoint_dir = getattr(savers[0], "_checkpoint_dir", None) if savers else None
    checkpoint_dir = checkpoint_dir or logdir
    if not checkpoint_dir and _policy.rolls_back(guard.config):
        message = _policy.checkpoint_dir_message(guard.config, advice)
        logging.error("slim_nanguard: %s", message)
        raise ValueError(message)
    guard.use_autopsy_dir(checkpoint_dir)  # Autopsy dumps go next to the checkpoints.
    return checkpoint_dir


def stop_session(session: SessionLike) -> None:
    """Asks a `MonitoredSession` to stop (``should_stop()`` is then True); not a raw session."""
    # The public route, ``step_context.request_stop()`` in ``run_step_fn``, raises
    # `StopIteration` and leaves ``should_stop()`` False (TensorFlow 2.21).
    creator = getattr(session, "_coordinated_creator", None)  # pylint: disable=protected-access
    if creator is not None and getattr(creator, "coord", None) is not None:
        creator.coord.request_stop()


def no_stop() -> None:
    """A `RequestStop` for a loop that leaves on `Outcome.stop` by itself: asks nothing."""


def good_step(guard: "Guard", loss: Optional[float] = None) -> None:
    """Tells `guard` a step went through, and keeps its `loss` (when known)."""
    guard.observe(_policy.GoodStep())
    if loss is not None:
        guard.history.add(float(loss))


def record_bad_step(
    guard: "Guard", read: "StepReport", policy: Optional[str] = None, autopsy=None
) -> Tuple[_events.NanEvent, _policy.Decision]:
    """Records the bad step `read` and has the guard decide about it: ``(event, decision)``.
    ``on_nan`` sees the event first (with the counts this step makes) and may choose the action
    instead of the reason's policy, or `policy` (a hook's override) or ``nan_policy``."""
    config, step = guard.config, read.step
    chosen = Action(policy or config.nan_policy if read.reason is None else read.reason.policy)
    event = _new_event(guard, _policy.counted(guard.state, step), read, chosen, autopsy)
    choice = None if config.on_nan is None else config.on_nan(event)
    if choice is not None and choice not in _policy.POLICIES:
        raise ValueError(
            f"the on_nan callback must return one of {', '.join(_policy.POLICIES)} or None; "
            f"got {choice!r}."
        )
    chosen = chosen if choice is None else Action(choice)
    bad_step = _policy.BadStep(step, chosen, cause=read.cause, figures=read.figures)
    decision = guard.observe(bad_step, event=event)
    event = guard.last_event  # With the action decided, escalation included.
    _events.log_event(event)
    if decision.escalation and decision.action != Action.RAISE:
        logging.warning(
            "slim_nanguard: %s, so the weights, not the batch, went bad: "
            "applying persistent_nan_policy=%r",
            decision.escalation,
            decision.action.value,
        )
    extra = {"escalation": decision.escalation} if decision.escalation else {}
    losses_before = guard.history.anchor(step)
    if losses_before:
        extra["losses_before"] = [[s, value] for s, value in losses_before]
    guard.notify("bad_step", event, **extra)
    return event, decision


def _new_event(
    guard: "Guard", counts: _policy.GuardState, read: "StepReport", action: str, autopsy=None
) -> _events.NanEvent:
    """The event of the step `read`, with the guard's `counts`."""
    loss = read.sums[0]
    culprits, culprit_kinds = guard.culprits_and_kinds(read.sums, read.kinds)
    return _events.NanEvent(
        step=read.step,
        loss=loss,
        loss_kind=_events.classify(loss),
        culprits=culprits,
        culprit_kinds=culprit_kinds,
        consecutive=counts.consecutive_bad_steps,
        total=counts.total_bad_steps,
        mode=guard.mode,
        action=action,
        loss_scale=read.loss_scale,
        autopsy=autopsy,
        cause=read.cause,
        figures=read.figures,
        reason=read.reason,
    )


def carry_out(
    guard: Optional["Guard"],
    session: SessionLike,
    event: _events.NanEvent,
    decision: _policy.Decision,
    *,
    checkpoint_dir: Optional[str],
    request_stop: Optional[RequestStop] = None,
    error: Optional[BaseException] = None,
    skip_batches: Optional[int] = None,
    **record: Any,
) -> Outcome:
    """Carries out `decision` about `event` against `session`: the only code that acts.

    `guard` is None for a loss no guarded train op made. A rollback restores from
    `checkpoint_dir` (or raises `CheckpointNotFoundError`), skips `skip_batches` batches (default
    ``rollback_skip_batches``) and adds `record` to its record. A stop calls `request_stop`
    (default `stop_session`); a raise is chained to `error`."""
    action = Action(decision.action)
    climb = resume = None
    giving_up = action in (Action.RAISE, Action.STOP) and decision.cause != Cause.MAX_ROLLBACKS
    if guard is not None and giving_up:
        # Steps that climbed to it: say what to resume from (not once rollbacks gave up).
        points = guard.history.points()
        climb, resume = _rollback.before_climb(checkpoint_dir, guard.state.run_start, points)
    if action is Action.RAISE:
        nan_error = _errors.NanLossError(
            event, decision.reason, cause=decision.cause, limit=decision.limit
        )
        nan_error.climb, nan_error.resume_from = climb, resume
        if error is not None:
            raise nan_error from _errors.caught_numerics_error(error)
        raise nan_error
    if action is Action.SKIP:
        if decision.level_shift is not None:
            raw_call(session, lambda raw: _take_new_level(guard, raw, event, decision.level_shift))
        return Outcome(event=event, action=action)
    if action is Action.STOP:
        if climb is not None:
            policy = _errors.policy_name(event, bool(decision.escalation))
            advice = _history.climb_advice(climb, resume, f"{policy}=")
            logging.warning("slim_nanguard: stopping at global step %d; %s.", event.step, advice)
        if request_stop is not None:
            request_stop()
        else:
            stop_session(session)
        climb = None if climb is None else (climb, resume)
        return Outcome(event=event, action=action, stop=True, climb=climb)
    path = raw_call(  # A rollback, the only action left.
        session,
        lambda raw: _roll_back(
            guard, raw, checkpoint_dir, event, skip_batches, record, decision.before_step
        ),
    )
    step = raw_call(session, guard.read_global_step)
    return Outcome(event=event, action=action, step=step, checkpoint=path)


def _take_new_level(
    guard: "Guard",
    session: tf.compat.v1.Session,
    event: _events.NanEvent,
    level: _level_shift.LevelShift,
) -> None:
    """Makes `level`'s values the whole spike statistics, says so and records it."""
    test = guard.reason_handles[Fault.SPIKE]  # The `_spike.SpikeTest`.
    # At least a warm-up's worth of rows (the values repeated whole): the test judges the
    # next step at once, against the new level.
    repeats = -(-guard.config.spike_warmup_steps // len(level.values))
    rows = ([list(v) for v in level.values] * repeats)[: test.window]
    session.run(test.reseed, {test.reseed_values: rows, test.reseed_floor: level.floor})
    test.note_reseed(event.step, len(level.values), repeats)
    guard.history.clear()  # The losses before the new level climb to it: no divergence.
    logging.warning(
        "slim_nanguard: global step %d: %s.",
        event.step,
        level.describe(repeats=repeats, probation_steps=guard.config.spike_warmup_steps),
    )
    guard.notify("level_shift", event, level_shift=level.to_json())


def _roll_back(
    guard: "Guard",
    session: tf.compat.v1.Session,
    checkpoint_dir: Optional[str],
    event: _events.NanEvent,
    skip_batches: Optional[int],
    record: dict,
    before_step: Optional[int] = None,
) -> str:
    """Rolls back after `event`: restores and records ``rollback``, or on a cluster's non-chief
    sends the guard's `rollback_request`. Returns the checkpoint restored, or "" for a request."""
    if before_step is None:
        before_step, why = _rollback.onset(
            guard.state.run_start, event.consecutive, guard.history.points()
        )
    else:
        why = f"the new level taken from global step {before_step} was a divergence"
    guard.history.clear()  # The global step goes back: the next losses are from there.
    if guard.rollback_request is not None:
        # A cluster's non-chief: the model lives on the ps and the chief restores it.
        fields = guard.rollback_request(session, guard, event)
        guard.observe(_policy.RollbackAsked())
        guard.notify("rollback_requested", event, **fields)
        return ""
    restored = guard.restorer.restore(
        session,
        checkpoint_dir,
        bad_step=event.step,
        learning_rate_scale=guard.state.learning_rate_scale,
        skip_batches=skip_batches,
        before_step=before_step,
        why=why,
    )
    guard.observe(_policy.RolledBack(restored.learning_rate_scale))
    if restored.why:
        record = {"why": restored.why, **record}
    state = guard.state
    guard.notify(
        "rollback",
        event,
        checkpoint=restored.checkpoint,
        skipped_batches=restored.skipped_batches,
        learning_rate_scale=state.learning_rate_scale,
        **record,
    )
    logging.warning(
        "slim_nanguard: rolled back to %s (rollback %d of at most %d), skipped %s, "
        "learning-rate scale now %g",
        restored.checkpoint,
        state.rollbacks,
        guard.config.max_rollbacks,
        logging.batches(restored.skipped_batches),
        state.learning_rate_scale,
    )
    return restored.checkpoint


def judge(
    guard: "Guard",
    session: SessionLike,
    *,
    checkpoint_dir: Optional[str],
    policy: Optional[str] = None,
    stored: Optional[Tuple[int, Sequence[float]]] = None,
    error: Optional[BaseException] = None,
    request_stop: Optional[RequestStop] = None,
) -> Outcome:
    """Handles a run the guard found not finite: reads it (unless `stored` holds ``(step,
    sums)``), records it and acts on it (`carry_out`). `session` may be a `MonitoredSession` (its
    hooks are not run); `policy` is a hook's override of ``nan_policy``."""

    def record(raw: tf.compat.v1.Session):
        read = guard.read_step_report(raw, stored)  # The one read of the bad step.
        if read.overflow:
            # The loss-scale optimizer skipped the update and lowered its scale: no bad step.
            guard.observe(_policy.LossScaleOverflow())
            guard.history.anchor(read.step)  # The good steps before it end one step before.
            event = _new_event(guard, guard.state, read, _events.LOSS_SCALE_OVERFLOW)
            _events.log_event(event)
            guard.notify(_events.LOSS_SCALE_OVERFLOW, event)
            return event, None
        over = (read.figures or {}).get("over") or ()
        autopsy = guard.autopsy(raw, read.step, read.cause, over)  # Before any rollback.
        return record_bad_step(guard, read, policy, autopsy)

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
        error=error,
    )
