"""A bad step, one function over one value: `judge` reads it (a `_policy.BadStep`), has
`_policy.decide` decide (a `Decision`), records it and carries the decision out (an `Outcome`),
in every loop; the guard's reads of a session and the one place it acts on one (docs/design.md,
"One state, one transition, one place that acts")."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from slim_nanguard import _autopsy
from slim_nanguard import _capture
from slim_nanguard import _errors
from slim_nanguard import _exact_sums
from slim_nanguard import _guard
from slim_nanguard import _log as logging
from slim_nanguard import _nan_event
from slim_nanguard import _policy
from slim_nanguard import _reasons
from slim_nanguard import _recorders
from slim_nanguard import _rollback
from slim_nanguard import _triage
from slim_nanguard import quarantine
from slim_nanguard._types import Action
from slim_nanguard._types import Cause
from slim_nanguard._types import Fault
from slim_nanguard._types import Mode
from slim_nanguard._types import RequestStop
from slim_nanguard._types import SessionLike

if TYPE_CHECKING:  # pragma: no cover
    from slim_nanguard._guard import Guard
    from slim_nanguard._spike import LevelShift


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one judged run came to: the `event` of a bad step (or of an `overflow` of a dynamic
    loss-scale optimizer, no bad step), the `action` carried out on a bad step, and after a
    rollback the global `step` and the `checkpoint` restored (after a skip whose retry trained,
    the global `step` it reached); after a stop that ends a `climb`,
    the global step it began at and the newest checkpoint from before it (None: none)."""

    event: Optional[_nan_event.NanEvent] = None
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
    if checkpoint_dir and guard.autopsy_dir is None:  # Autopsy dumps go next to the checkpoints.
        guard.registry.use_directory(checkpoint_dir)
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


def observe(guard: "Guard", observation: _policy.Observation) -> Optional[_policy.Decision]:
    """Tells `guard` what happened, the one way its state changes; returns `_policy.decide`'s
    decision."""
    decision, guard.cell.state = _policy.decide(guard.config, guard.state, observation)
    return decision


def good_step(guard: "Guard", loss: Optional[float] = None) -> None:
    """Tells `guard` a step went through, and keeps its `loss` (when known)."""
    observe(guard, _policy.GoodStep())
    if loss is not None:
        guard.history.add(float(loss))


def _notify(guard: "Guard", kind: str, event: _nan_event.NanEvent, **extra: Any) -> None:
    """Sends `guard`'s listeners a record of `kind` about `event` (see `Guard.add_listener`)."""
    guard.registry.send(_nan_event.record_of(kind, event, **extra))


def mark_judged(guard: "Guard", session: tf.compat.v1.Session) -> None:
    """Says that the caller applies the policy to `guard`'s bad steps in the raw `session`
    (hook mode, once per session; else a no-op); without it a bad step fails naming it."""
    if guard.judged is None:
        return
    try:
        if session in guard.cell.judged_sessions:
            return
        guard.cell.judged_sessions.add(session)
    except TypeError:  # not weak-referenceable: initialise each time (idempotent)
        pass
    session.run(guard.judged.initializer)


def read_global_step(guard: "Guard", session: tf.compat.v1.Session) -> Optional[int]:
    """The global step in the raw `session`, or None without one."""
    return None if guard.global_step is None else int(session.run(guard.global_step))


def culprits(guard: "Guard", kinds: Optional[Sequence[str]]):
    """Names of the variables whose gradients held NaN or Inf, and what each held, from `kinds`
    (the loss's, then each gradient's; exact); none without them."""
    names = guard.variable_names
    if kinds is None or len(kinds) != len(names) + 1:
        return (), ()
    bad = [(n, k) for n, k in zip(names, kinds[1:]) if k != _exact_sums.FINITE]
    return tuple(n for n, _ in bad), tuple(k for _, k in bad)


def _read(guard: "Guard", session, policy: Optional[str]):
    """The bad step just seen, in one ``session.run`` of the raw `session`, and its autopsy
    (before any rollback): ``(BadStep, Autopsy or None)``. What the step stored: its loss
    (then its loss scale), the global step (-1 without one), the kinds and the report."""
    fetches = {
        "report": guard.report,
        "kinds": guard.kinds_read,
        "sums": guard.diagnostics,
        "step": guard.global_step,
    }
    values = session.run({name: tensor for name, tensor in fetches.items() if tensor is not None})
    step, sums = int(values.get("step", -1)), [float(s) for s in np.asarray(values["sums"])]
    # The report's code: 2 + the index of the reason that rejected the step, its slice after.
    report, reasons = np.asarray(values.get("report", [0])), guard.reasons
    index = int(report[0]) - 2
    reason, figures, kinds = None, None, None
    if 0 <= index < len(reasons):
        reason = reasons[index]
        start = 1 + sum(len(r.report_fields) for r in reasons[:index])
        stored = report[start : start + len(reason.report_fields)]
        # The reason's graph handles may know more than the graph (`Test.handles`).
        read = getattr(guard.reason_handles.get(reason.name), "figures", None)
        figures = reason.figures(stored) if read is None else read(stored, step)
    elif "kinds" in values and np.min(values["kinds"], initial=0) >= 0:
        kinds = _exact_sums.kind_names(values["kinds"])
    scale = None if guard.loss_scale_floor is None else _exact_sums.stored_loss_scale(sums)
    overflow = reason is None and scale is not None and _exact_sums.stored_overflow(sums)
    cause = _reasons.NON_FINITE if reason is None else reason.name
    autopsy = None
    kept = not overflow and guard.capture is not None and guard.capture.tensors
    chosen = Action(policy or guard.config.nan_policy if reason is None else reason.policy)
    if kept and _policy.wants_autopsy(guard.config, guard.state, chosen):
        autopsy = autopsy_step(guard, session, step, cause, figures)
    choose = None if guard.config.on_nan is None else _on_nan(guard, autopsy)
    fields = (figures, reason, sums[0], *culprits(guard, kinds), scale, overflow)
    verdict = (autopsy.triage or {}).get("verdict") if autopsy is not None else None
    autopsied = autopsy is not None
    read = _policy.BadStep(step, chosen, True, cause, *fields, autopsied, choose, verdict)
    return read, autopsy


def _on_nan(guard: "Guard", autopsy):
    """``choose`` of a `BadStep`: ``on_nan`` shown its event, with the counts it makes."""

    def choose(counts: _policy.GuardState, read: _policy.BadStep) -> Optional[str]:
        event = _nan_event.event_of(
            read,
            mode=guard.mode,
            action=read.chosen,
            consecutive=counts.consecutive_bad_steps,
            total=counts.total_bad_steps,
            autopsy=autopsy,
        )
        choice = guard.config.on_nan(event)
        if choice is not None and choice not in _policy.POLICIES:
            raise ValueError(
                f"the on_nan callback must return one of {', '.join(_policy.POLICIES)} or "
                f"None; got {choice!r}."
            )
        return choice

    return choose


def autopsy_step(
    guard: "Guard",
    session: tf.compat.v1.Session,
    step: int,
    cause: str = _reasons.NON_FINITE,
    figures: Optional[Mapping[str, Any]] = None,
):
    """The `Autopsy` (never failing: its ``error`` says why) of the bad step just seen, before
    any rollback, or None (no batch kept). `cause` rejected the step (ValueError if no such
    reason); a spike's `figures` give the values it was ``over`` and its triage's threshold."""
    causes = [_reasons.NON_FINITE, Fault.SPIKE, *(r.name for r in guard.reasons)]
    if cause not in causes:
        raise ValueError(f"cause is {cause!r}; it must be one of {', '.join(causes)}.")
    if guard.capture is None or not guard.capture.tensors:
        return None
    result = _autopsy.autopsy_bad_step(
        session,
        guard.capture,
        [guard.loss, *guard.gradients] if cause == _reasons.NON_FINITE else [guard.loss],
        step=step,
        dump_dir=guard.autopsy_dir,
        timeout_secs=guard.config.autopsy_timeout_secs,
        cause=cause,
        spike_over=(figures or {}).get("over", ()),
        spike_threshold=_triage.spike_threshold(figures) if cause == Fault.SPIKE else None,
    )
    if result.dump:
        _remove_old_dumps(guard)
    return result


def _remove_old_dumps(guard: "Guard") -> None:
    """Keeps the first and the last dumps the config says; records each one removed."""
    first, last = guard.config.autopsy_keep_first, guard.config.autopsy_keep_last
    try:
        gone = _autopsy.remove_old_dumps(guard.autopsy_dir, first, last)
    except Exception as err:  # pylint: disable=broad-except  (never into training)
        logging.warning("slim_nanguard: could not remove old autopsy dumps: %s", err)
        return
    for removed in gone:
        logging.warning(
            "slim_nanguard: removed the autopsy dump of global step %s (%s): a directory keeps "
            "the first %d and the latest %d dumps (GuardConfig.autopsy_keep_first, "
            "autopsy_keep_last).",
            removed["step"],
            removed["dump"],
            first,
            last,
        )
        kept = {"keep_first": first, "keep_last": last}
        record = {"kind": "autopsy_dump_removed", "dump": removed["dump"]}
        guard.registry.send({**record, "dump_step": removed["step"], **kept})


def carry_out(
    guard: Optional["Guard"],
    session: SessionLike,
    event: _nan_event.NanEvent,
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
    giving_up = action in (Action.RAISE, Action.STOP) and decision.give_up != Cause.MAX_ROLLBACKS
    if guard is not None and giving_up:
        # Steps that climbed to it: say what to resume from (not once rollbacks gave up).
        points = guard.history.points()
        climb, resume = _rollback.before_climb(checkpoint_dir, guard.state.run_start, points)
    if action is Action.RAISE:
        nan_error = _errors.NanLossError(
            event, decision.reason, cause=decision.give_up, limit=decision.limit
        )
        nan_error.climb, nan_error.resume_from = climb, resume
        if error is not None:
            raise nan_error from _errors.caught_numerics_error(error)
        raise nan_error
    if action is Action.SKIP:
        if decision.level_shift is not None:
            raw_call(session, lambda raw: _take_new_level(guard, raw, event, decision.level_shift))
        step = raw_call(session, lambda raw: _retry(guard, raw, event)) if decision.retry else None
        return Outcome(event=event, action=action, step=step)
    if action is Action.STOP:
        if climb is not None:
            policy = _errors.policy_name(event, bool(decision.escalation))
            advice = _errors.climb_advice(climb, resume, f"{policy}=")
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
    step = raw_call(session, lambda raw: read_global_step(guard, raw))
    return Outcome(event=event, action=action, step=step, checkpoint=path)


def _retry(
    guard: "Guard", session: tf.compat.v1.Session, event: _nan_event.NanEvent
) -> Optional[int]:
    """Runs the train op again on the bad step's kept batch (no new batch; the triage found
    its replay finite): returns the global step after it if it trained, else None (bad again,
    it failed, or it cannot run without a new batch), and the step is skipped. Never raises
    but KeyboardInterrupt; says so and records it."""
    trained, step, why_not = False, None, ""
    try:
        capture = guard.capture
        feeds = dict(zip(capture.tensors, _capture.read_kept_batch(session, capture)))
        why_not = _autopsy.takes_a_batch([guard.train_op], feeds)
        if guard.mode is Mode.HOOK and guard.ok is None:
            why_not = "its train op was built in a loop body, whose verdict a run cannot fetch"
        if not why_not:
            # The verdict as the step gives it: `ok` where built (hook mode, and a loss-scale
            # optimizer's overflow in check_numerics mode), else the check's error.
            fetches = [guard.train_op] + ([guard.ok] if guard.ok is not None else [])
            try:
                values = session.run(fetches, feeds)
                ok = bool(values[-1]) if guard.ok is not None else True
            except tf.errors.InvalidArgumentError as err:
                if not _guard.owns_error(guard, err):
                    raise
                ok = False
            step = read_global_step(guard, session) if ok else None
            trained = ok and (step is None or step > event.step)
    except Exception as err:  # pylint: disable=broad-except  (the step is skipped instead)
        why_not = f"the run again failed: {_errors.op_error_cause(err) or err}"
    step = step if trained else None
    observe(guard, _policy.Retried(-1 if step is None else step, trained))
    _notify(guard, "retry", event, trained=trained, **({"why_not": why_not} if why_not else {}))
    logging.warning(
        "slim_nanguard: global step %d: %s",
        event.step,
        f"run again on its batch (triage: chance), it trained; global step now {step}"
        if trained
        else f"not run again ({why_not}); skipped"
        if why_not
        else "run again on its batch (triage: chance), it was bad again; skipped",
    )
    return step


def _take_new_level(
    guard: "Guard",
    session: tf.compat.v1.Session,
    event: _nan_event.NanEvent,
    level: "LevelShift",
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
    _notify(guard, "level_shift", event, level_shift=level.to_json())


def _roll_back(
    guard: "Guard",
    session: tf.compat.v1.Session,
    checkpoint_dir: Optional[str],
    event: _nan_event.NanEvent,
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
        observe(guard, _policy.RollbackAsked())
        _notify(guard, "rollback_requested", event, **fields)
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
    observe(guard, _policy.RolledBack(restored.learning_rate_scale))
    if restored.why:
        record = {"why": restored.why, **record}
    state = guard.state
    _notify(
        guard,
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
    error: Optional[BaseException] = None,
    request_stop: Optional[RequestStop] = None,
    advice: Optional[str] = None,
) -> Outcome:
    """The one way a bad step goes, in every loop: one read, one `decide`, one record, one
    action (`carry_out`). `session` may be a
    `MonitoredSession` (its hooks are not run); `policy` is a hook's override of
    ``nan_policy``. With `advice`, the checkpoint directory is `checkpoint_dir_for`'s."""
    if advice is not None:
        checkpoint_dir = checkpoint_dir_for(guard, checkpoint_dir, session=session, advice=advice)
    read, autopsy = raw_call(session, lambda raw: _read(guard, raw, policy))
    if read.overflow:
        # The loss-scale optimizer skipped the update and lowered its scale: no bad step.
        observe(guard, _policy.LossScaleOverflow())
        state, extra, action = guard.state, {}, _nan_event.LOSS_SCALE_OVERFLOW
        counts = dict(consecutive=state.consecutive_bad_steps, total=state.total_bad_steps)
    else:
        decision = observe(guard, read)
        action = decision.action
        counts = dict(consecutive=decision.consecutive, total=decision.total)
        extra = {"escalation": decision.escalation} if decision.escalation else {}
    fields = dict(mode=guard.mode, action=action, autopsy=autopsy, **counts)
    event = _nan_event.publish(guard.registry.send, guard.history, read, extra, **fields)
    if read.overflow:
        return _counted(guard, session, Outcome(event=event, overflow=True))
    guard.cell.last_event = event
    if decision.escalation and decision.action != Action.RAISE:
        logging.warning(
            "slim_nanguard: %s, so the weights, not the batch, went bad: "
            "applying persistent_nan_policy=%r",
            decision.escalation,
            decision.action.value,
        )
    outcome = carry_out(
        guard,
        session,
        event,
        decision,
        checkpoint_dir=checkpoint_dir,
        request_stop=request_stop,
        error=error,
    )
    if decision.quarantine and outcome.action is Action.SKIP:
        _quarantine(guard, event, autopsy.triage)
    return _counted(guard, session, outcome)


def _quarantine(guard: "Guard", event: _nan_event.NanEvent, triage: dict) -> None:
    """Under ``auto``, the examples a ``data`` verdict names go to the quarantine in the
    guard's directory, and a record says so; an example back again is named with what to do.
    Never raises but KeyboardInterrupt: training goes on without the quarantine."""
    rows, prints = triage.get("examples") or (), triage.get("fingerprints") or {}
    if not rows:
        return  # The batch itself holds the NaN, in no example's row: nothing to name.
    directory = guard.autopsy_dir
    if directory is None:
        logging.warning(
            "slim_nanguard: global step %d: example(s) %s of the batch are not quarantined: "
            "the guard knows no directory (pass the loop's logdir or checkpoint_dir).",
            event.step,
            ", ".join(map(str, rows)),
        )
        return
    try:
        added = quarantine.add(directory, guard.registry.task, event.step, triage)
    except Exception as err:  # pylint: disable=broad-except  (never into training)
        logging.warning(
            "slim_nanguard: global step %d: could not quarantine example(s) %s in %s (%s); the "
            "input may bring them again, and each time the step is skipped.",
            event.step,
            ", ".join(map(str, rows)),
            directory,
            err,
        )
        return
    new = [i for i in rows if prints.get(str(i)) in added]
    again = [i for i in rows if i not in new]
    if new:
        named = ", ".join(f"{i} (fingerprint {prints[str(i)]})" for i in new)
        logging.warning(
            "slim_nanguard: global step %d: quarantined example%s %s of the batch in %s; an "
            "input filtered with slim_nanguard.quarantine.filter_dataset leaves %s out from "
            "now on.",
            event.step,
            "s" if len(new) > 1 else "",
            named,
            quarantine.path(directory, guard.registry.task),
            "them" if len(new) > 1 else "it",
        )
        _notify(guard, "quarantine", event, fingerprints=added)
    if again:
        logging.warning(
            "slim_nanguard: global step %d: example%s %s of the batch came again though "
            "quarantined: this input is not filtered; filter it with "
            "slim_nanguard.quarantine.filter_dataset(dataset, %r).",
            event.step,
            "s" if len(again) > 1 else "",
            ", ".join(map(str, again)),
            directory,
        )


def _counted(guard: "Guard", session: SessionLike, outcome: Outcome) -> Outcome:
    """`outcome`, once the summaries' counters hold the guard's (not after a stop: no summary
    follows), written by their initializer: no batch."""
    if guard.counters is not None and not outcome.stop:
        values = [float(getattr(guard.state, f)) for f in _recorders.SCALARS.values()]
        feed = {guard.counters.initializer.inputs[1]: values}
        raw_call(session, lambda raw: raw.run(guard.counters.initializer, feed))
    return outcome
