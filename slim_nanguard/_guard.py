"""The run-time side of a guarded train op: counters, events and the policy's decisions.

`create_train_op` builds the graph side (the finiteness test and the gate in front of every
variable update, kept as `GraphHandles`) and registers one `Guard` for the train op with its
graph. The hook (hook mode) and the training loops (check_numerics mode) look it up with
`get_guard` and report each step to it; `_actions` carries out what the guard decided, and
`_rollback` restores a checkpoint. The registry is a weak mapping from graph to guards
rather than a graph collection: a collection of Python objects makes every meta-graph export
(each checkpoint) warn that it cannot be serialised.
"""

from __future__ import annotations

import dataclasses
import math
import re
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from slim_nanguard import _actions
from slim_nanguard import _events
from slim_nanguard import _history
from slim_nanguard import _log as logging
from slim_nanguard import _policy
from slim_nanguard import _record
from slim_nanguard import _rollback
from slim_nanguard import _verdict
from slim_nanguard._handles import GraphHandles
from slim_nanguard._types import Action
from slim_nanguard._types import Listener
from slim_nanguard._types import Mode
from slim_nanguard._types import SessionLike

_REGISTRY: "weakref.WeakKeyDictionary[tf.Graph, List[Guard]]" = weakref.WeakKeyDictionary()

# The modes as module constants (each equals its name: ``MODE_HOOK == "hook"``).
MODE_CHECK_NUMERICS = Mode.CHECK_NUMERICS
MODE_HOOK = Mode.HOOK

# Op types that run a function body: an error raised inside (a train op built in a
# tf.while_loop, a tf.function) is reported on them, with the inner node named in the message.
_FUNCTION_OP_TYPES = frozenset(
    {"While", "StatelessWhile", "If", "StatelessIf", "PartitionedCall", "StatefulPartitionedCall"}
)
# What CheckNumerics says, and the node the message names.
_CHECK_MESSAGE = re.compile(r" : Tensor had (NaN|Inf) values")
_INNER_NODE = re.compile(r"\{\{node ([^}]+)\}\}")


def _handle(name: str) -> property:
    """A read-only attribute of `Guard` that reads the `GraphHandles` field `name`."""

    def get(self: "Guard") -> Any:
        return getattr(self._handles, name)

    get.__doc__ = f"The ``{name}`` of the guard's `GraphHandles`."
    return property(get)


@dataclasses.dataclass
class GuardState:
    """Counters of one guard, kept for the life of the process (across sessions).

    Attributes:
      total_bad_steps: Bad steps seen so far.
      consecutive_bad_steps: Bad steps since the last good one.
      skips: Bad steps the ``skip`` policy stepped over.
      rollbacks: Rollbacks carried out.
      stops: Stops requested by the ``stop`` policy.
      last_bad_step: Global step of the last bad step, or None.
      learning_rate_scale: Product of the ``rollback_lr_factor`` applied so far.
      loss_scale_overflows: Overflow steps of a dynamic loss-scale optimizer: not bad steps
        (the optimizer skipped them and lowered its scale), counted apart.
    """

    total_bad_steps: int = 0
    consecutive_bad_steps: int = 0
    skips: int = 0
    rollbacks: int = 0
    stops: int = 0
    last_bad_step: Optional[int] = None
    learning_rate_scale: float = 1.0
    loss_scale_overflows: int = 0


class Guard:
    """One guarded train op: its graph handles, its policy and what it has seen.

    Instances are made by `create_train_op`; get them with `get_guard`. The public surface
    is read-only: the config, the state (counters), the graph handles and the listeners.
    The graph handles (``train_op``, ``loss``, ``ok``, ``grad_sums``, ...) are also readable
    as attributes of the guard; see `GraphHandles`.

    Args:
      config: The `GuardConfig` the train op was built with.
      handles: What `create_train_op` built (`GraphHandles`).
      saver: The Saver rollbacks restore with, if `create_train_op` built one.
    """

    def __init__(
        self,
        *,
        config: _policy.GuardConfig,
        handles: GraphHandles,
        saver: Optional[tf.compat.v1.train.Saver] = None,
    ):
        self._config = config
        self._handles = handles
        self._state = GuardState()
        self._rollback = _rollback.Rollback(handles, config, saver)
        self._judged_sessions: "weakref.WeakSet" = weakref.WeakSet()
        self._listeners: List[Listener] = []
        self._last_event: Optional[_events.NanEvent] = None
        # A cluster's non-chief worker: ``fn(session, guard) -> record fields`` asks the chief
        # to roll back instead of restoring here (set by `_cluster.RollbackRequestHook`).
        self.rollback_request: Optional[Callable[[SessionLike, "Guard"], Dict[str, Any]]] = None
        # Autopsy: the directory dumps go to (set by the loop or the hook) and the count done.
        self._autopsy_dir: Optional[str] = None
        self._autopsies = 0
        # The record in that directory, when no listener keeps one (`_own_recorder`).
        self._recorder: Optional[_record.EventRecorder] = None
        self._recorder_dir: Optional[str] = None
        # The losses of the last good steps, for the record of the next bad step.
        self._history = _history.LossHistory(config.losses_before)

    # ----------------------------------------------------------------- read-only surface
    @property
    def config(self) -> _policy.GuardConfig:
        """The `GuardConfig` the train op was built with."""
        return self._config

    @property
    def handles(self) -> GraphHandles:
        """The graph side of the train op (`GraphHandles`)."""
        return self._handles

    @property
    def state(self) -> GuardState:
        """The `GuardState` counters, kept for the life of the process."""
        return self._state

    @property
    def last_event(self) -> Optional[_events.NanEvent]:
        """The event of the last bad step, or None."""
        return self._last_event

    @property
    def saver(self) -> Optional[tf.compat.v1.train.Saver]:
        """The one Saver every rollback of this guard restores with (None if none built)."""
        return self._rollback.saver

    @property
    def autopsy_dir(self) -> Optional[str]:
        """Where autopsy dumps go (next to the checkpoints), or None."""
        return self._autopsy_dir

    @property
    def autopsies(self) -> int:
        """Autopsies done so far in this process."""
        return self._autopsies

    def use_autopsy_dir(self, path: Optional[str], *, replace: bool = False) -> None:
        """Sends autopsy dumps to `path` (the checkpoint directory); the first one given
        stays unless `replace`.

        The record of bad steps goes there too (``nanguard_events.jsonl``), unless a listener
        keeps one already (an `EventRecorder`: `train`'s own, or the caller's), so that every
        loop that knows a directory leaves a record there, and each bad step is recorded once.
        """
        if path and (replace or self._autopsy_dir is None):
            self._autopsy_dir = path

    def ensure_saver(self) -> tf.compat.v1.train.Saver:
        """The rollback Saver, built now if `create_train_op` built none (a hook whose
        policy override may roll back); call it before the graph is finalized."""
        return self._rollback.ensure_saver()

    mode = _handle("mode")
    train_op = _handle("train_op")
    loss = _handle("loss")
    global_step = _handle("global_step")
    grad_sums = _handle("grad_sums")
    ok = _handle("ok")
    diagnostics = _handle("diagnostics")
    check_op_name = _handle("check_op_name")
    variable_names = _handle("variable_names")
    lr_scale = _handle("lr_scale")
    loss_scale_floor = _handle("loss_scale_floor")
    in_loop = _handle("in_loop")
    judged = _handle("judged")
    pivot = _handle("pivot")
    capture = _handle("capture")
    input_ops = _handle("input_ops")
    value_kinds = _handle("value_kinds")

    # ----------------------------------------------------------------- listeners
    def add_listener(self, listener: Listener) -> None:
        """Calls ``listener(record)`` for each bad step and each rollback.

        A record is a JSON-ready dict: ``kind`` (``"bad_step"`` or ``"rollback"``, and
        ``"loss_scale_overflow"`` for an overflow step of a dynamic loss-scale optimizer) and
        the fields of the `NanEvent` (``step``, ``loss``, ``culprits``, ``action``, ...). A bad
        step whose action came from ``persistent_nan_policy`` adds ``escalation`` (why, e.g.
        ``"5 bad steps in a row reached max_consecutive_bad_steps=5"``); a rollback adds
        ``checkpoint`` and ``skipped_batches`` (and, a cluster chief's rollback for other
        workers, ``requested_by`` and ``requests``). A cluster's non-chief worker sends
        ``"rollback_requested"`` (with ``chief`` and ``skipped_batches``) instead of
        ``"rollback"``.
        """
        if listener not in self._listeners:
            self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        """Stops calling `listener`."""
        if listener in self._listeners:
            self._listeners.remove(listener)

    def _notify(self, kind: str, event: _events.NanEvent, **extra: Any) -> None:
        record = {"kind": kind, **event.to_json(), **extra}
        if kind != "bad_step":
            record.pop("autopsy", None)  # Once, in the bad step's own record.
        self._send(record)

    def _send(self, record: Dict[str, Any]) -> None:
        for listener in list(self._listeners):
            listener(record)
        recorder = self._own_recorder()
        if recorder is not None:
            try:
                recorder(record)
            except (OSError, tf.errors.OpError) as err:  # A record nobody asked for: no crash.
                logging.warning(
                    "slim_nanguard: could not append to %s (%s); training goes on without it",
                    recorder.path,
                    err,
                )

    def _own_recorder(self) -> Optional[_record.EventRecorder]:
        """The record in the autopsy directory, or None: no directory, or a listener that is
        an `EventRecorder` keeps the record (each bad step is recorded once)."""
        if self._autopsy_dir is None or any(
            isinstance(listener, _record.EventRecorder) for listener in self._listeners
        ):
            return None
        if self._recorder is None or self._recorder_dir != self._autopsy_dir:
            # The loop's own summary writer (tf-slim's Supervisor) is not ours to share: a
            # second FileWriter on the same directory can open the same events file in the
            # same second and corrupt it. The TensorBoard counters are `train`'s.
            self._recorder = _record.EventRecorder(self._autopsy_dir, write_summaries=False)
            self._recorder_dir = self._autopsy_dir
        return self._recorder

    def mark_judged(self, session: tf.compat.v1.Session) -> None:
        """Says that the caller applies the policy to this guard's bad steps in `session`.

        Hook mode only (a no-op in check_numerics mode): without it, a bad step fails with an
        error that names what to add. `NanLossHook` calls it when its session is created and
        `train_step` at its first step in a session; a hand-written hook-mode loop that
        checks ``ok`` itself calls it once after creating its session.

        Args:
          session: A raw `tf.compat.v1.Session` (a MonitoredSession's hooks would run).
        """
        if self.judged is None:
            return
        try:
            if session in self._judged_sessions:
                return
            self._judged_sessions.add(session)
        except TypeError:  # not weak-referenceable: initialise each time (idempotent)
            pass
        session.run(self.judged.initializer)

    # ----------------------------------------------------------------- steps
    def _loss_scale_of(self, sums: Optional[Sequence[float]]) -> Optional[float]:
        """The loss scale a step used, from what it stored (None without loss scaling)."""
        if self.loss_scale_floor is None or sums is None:
            return None
        sums = list(sums)
        return float(sums[-1]) if len(sums) == len(self.variable_names) + 2 else None

    def is_loss_scale_overflow(self, sums: Optional[Sequence[float]]) -> bool:
        """Whether a non-finite step was an overflow of a dynamic loss-scale optimizer.

        That is: its loss was finite and its loss scale above the floor (the same test as the
        train op's, on the values the step stored), so the optimizer skipped the update and
        lowered the scale. Such a step is not a bad step.

        Args:
          sums: What a non-finite step stored: the loss, the gradient sums, the loss scale.
        """
        scale = self._loss_scale_of(sums)
        return (
            scale is not None
            and math.isfinite(float(list(sums)[0]))
            and scale > self.loss_scale_floor
        )

    def on_loss_scale_overflow(
        self, *, step: int, sums: Sequence[float], kinds: Optional[Sequence[str]] = None
    ) -> _events.NanEvent:
        """Records an overflow step of a dynamic loss-scale optimizer; no policy applies.

        The optimizer skipped the update and lowered its scale; nothing else was written. The
        step counts neither as a bad step nor toward ``max_consecutive_bad_steps``.

        Args:
          step: The global step the overflow happened at (-1 if unknown).
          sums: What the step stored: the loss, the gradient sums, the loss scale.
          kinds: What the loss and each gradient held (`read_value_kinds`), or None.

        Returns:
          The event, with ``action`` ``"loss_scale_overflow"``; listeners get a record of kind
          ``"loss_scale_overflow"``.
        """
        state = self._state
        state.loss_scale_overflows += 1
        self._history.anchor(int(step))  # The good steps before it end one step before.
        sums = list(sums)
        culprits, culprit_kinds = self._culprits_and_kinds(sums, kinds)
        event = _events.NanEvent(
            step=int(step),
            loss=float(sums[0]),
            loss_kind=_events.classify(float(sums[0])),
            culprits=culprits,
            culprit_kinds=culprit_kinds,
            consecutive=state.consecutive_bad_steps,
            total=state.total_bad_steps,
            mode=self.mode,
            action=_events.LOSS_SCALE_OVERFLOW,
            loss_scale=self._loss_scale_of(sums),
        )
        _events.log_event(event)
        self._notify(_events.LOSS_SCALE_OVERFLOW, event)
        return event

    def note_good_step(self) -> None:
        """Tells the guard a step went through; resets the consecutive count."""
        self.state.consecutive_bad_steps = 0

    def note_loss(self, loss: float) -> None:
        """Keeps the loss of a good step for the record of the next bad step (the last
        ``losses_before`` of them). The loop that fetched the loss calls it once a step."""
        self._history.add(float(loss))

    def culprits(
        self, sums: Sequence[float], kinds: Optional[Sequence[str]] = None
    ) -> Tuple[str, ...]:
        """Names of the variables whose gradients held NaN or Inf.

        Args:
          sums: The loss, then the sum of each gradient.
          kinds: What the loss and each gradient held (`read_value_kinds`): exact, and used
            when given. Without it a non-finite sum names its variable, which a sum that
            overflowed over finite values does too.
        """
        return self._culprits_and_kinds(sums, kinds)[0]

    def _culprits_and_kinds(
        self, sums: Sequence[float], kinds: Optional[Sequence[str]]
    ) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
        """The culprits and what each held (empty kinds when `kinds` is not given)."""
        if kinds is not None and len(kinds) == len(self.variable_names) + 1:
            bad = [(n, k) for n, k in zip(self.variable_names, kinds[1:]) if k != _verdict.FINITE]
            return tuple(n for n, _ in bad), tuple(k for _, k in bad)
        names = tuple(
            name
            for name, s in zip(self.variable_names, list(sums)[1:])
            if not math.isfinite(float(s))
        )
        return names, ()

    def read_value_kinds(self, session: tf.compat.v1.Session) -> Optional[Tuple[str, ...]]:
        """What the loss and each gradient of the last step whose sums were not all finite
        held: ``"finite"``, ``"nan"``, ``"inf"`` or ``"nan_and_inf"``, the loss first.

        Tested element by element on that step (a sum may overflow over finite values; this
        may not). Read it right after a bad step, as `read_bad_step`.

        Args:
          session: A raw `tf.compat.v1.Session`.

        Returns:
          The kinds, or None when the train op keeps none (or none was stored yet).
        """
        if self.value_kinds is None:
            return None
        try:
            codes = session.run(self.value_kinds)
        except tf.errors.FailedPreconditionError:  # never written in this session
            return None
        return tuple(_verdict.kind_name(c) for c in np.asarray(codes))

    def autopsy(self, session: tf.compat.v1.Session, step: int):
        """Replays the bad step just seen, for the first ``autopsy_max_steps`` of them.

        Call it right after the bad step, before any rollback: the variables still hold the
        weights that produced it, and the train op kept its batch.

        Args:
          session: A raw `tf.compat.v1.Session`.
          step: The global step of the bad step.

        Returns:
          The `Autopsy` (its ``error`` says why if it failed: it never raises), or None when
          autopsies are off, past their count, or the train op keeps no batch.
        """
        if (
            self.capture is None
            or not self.capture.tensors
            or self._autopsies >= self.config.autopsy_max_steps
        ):
            return None
        from slim_nanguard import _autopsy  # Local: only a bad step needs it.

        self._autopsies += 1
        result = _autopsy.autopsy_bad_step(
            session,
            self.capture,
            [self.grad_sums],
            step=step,
            dump_dir=self._autopsy_dir,
            timeout_secs=self.config.autopsy_timeout_secs,
        )
        if result.dump:
            self._remove_old_dumps()
        return result

    def _remove_old_dumps(self) -> None:
        """Keeps the first ``autopsy_keep_first`` and the last ``autopsy_keep_last`` dumps of
        the autopsy directory; records each one removed (kind ``autopsy_dump_removed``)."""
        from slim_nanguard import _autopsy  # Local, as in `autopsy`.

        first, last = self.config.autopsy_keep_first, self.config.autopsy_keep_last
        try:
            gone = _autopsy.remove_old_dumps(self._autopsy_dir, first, last)
        except Exception as err:  # pylint: disable=broad-except  (never into training)
            logging.warning("slim_nanguard: could not remove old autopsy dumps: %s", err)
            return
        for removed in gone:
            logging.warning(
                "slim_nanguard: removed the autopsy dump of global step %s (%s): a "
                "directory keeps the first %d and the latest %d dumps "
                "(GuardConfig.autopsy_keep_first, autopsy_keep_last).",
                removed["step"],
                removed["dump"],
                first,
                last,
            )
            self._send(
                {
                    "kind": "autopsy_dump_removed",
                    "dump": removed["dump"],
                    "dump_step": removed["step"],
                    "keep_first": first,
                    "keep_last": last,
                }
            )

    def record_bad_step(
        self,
        *,
        step: int,
        loss: float,
        sums: Optional[Sequence[float]],
        policy: Optional[str] = None,
        autopsy=None,
        kinds: Optional[Sequence[str]] = None,
    ) -> Tuple[_events.NanEvent, _policy.Decision]:
        """Counts a bad step and decides what to do about it; carries nothing out.

        The `on_nan` callback sees the event first and may choose the action; then
        `_policy.decide` applies ``max_consecutive_bad_steps`` (``persistent_nan_policy``)
        and ``max_rollbacks``; an escalated ``rollback`` starts the consecutive count over.
        The event is logged and sent to the listeners (kind ``bad_step``).

        Args:
          step: The global step the bad step was attempted at (-1 if unknown).
          loss: The loss value of the bad step.
          sums: The per-gradient sums (the loss first), or None if unknown.
          policy: The policy to apply instead of the configured one (a hook may say so).
          autopsy: The step's `Autopsy` (see `autopsy`), put in the event, or None.
          kinds: What the loss and each gradient held (`read_value_kinds`), or None: the
            culprits then come from the sums.

        Returns:
          ``(event, decision)``: the event's ``action`` is the decision's, escalation
          included. `_actions.carry_out` carries it out (``raise`` included).
        """
        state = self._state
        if state.last_bad_step is not None and step >= 0 and step != state.last_bad_step:
            # A step went through since the last bad one (global_step moved on).
            state.consecutive_bad_steps = 0
        state.total_bad_steps += 1
        state.consecutive_bad_steps += 1
        state.last_bad_step = step
        culprits, culprit_kinds = (
            self._culprits_and_kinds(sums, kinds) if sums is not None else ((), ())
        )
        losses_before = self._history.anchor(int(step))
        event = _events.NanEvent(
            step=int(step),
            loss=float(loss),
            loss_kind=_events.classify(float(loss)),
            culprits=culprits,
            culprit_kinds=culprit_kinds,
            consecutive=state.consecutive_bad_steps,
            total=state.total_bad_steps,
            mode=self.mode,
            action=Action(policy or self.config.nan_policy),
            loss_scale=self._loss_scale_of(sums),
            autopsy=autopsy,
        )
        action = event.action
        if self.config.on_nan is not None:
            chosen = self.config.on_nan(event)
            if chosen is not None:
                action = _policy.validate_action(chosen, "the on_nan callback")
        decision = _policy.decide(
            self.config,
            action,
            consecutive_bad_steps=state.consecutive_bad_steps,
            rollbacks=state.rollbacks,
        )
        action, escalation = decision.action, decision.escalation
        event = dataclasses.replace(event, action=action)
        if action == Action.SKIP:
            state.skips += 1
        elif action == Action.STOP:
            state.stops += 1
        _events.log_event(event)
        if escalation and action != Action.RAISE:
            logging.warning(
                "slim_nanguard: %s, so the weights, not the batch, went bad: "
                "applying persistent_nan_policy=%r",
                escalation,
                action.value,
            )
            if action == Action.ROLLBACK:
                # Start the count over, or the first bad step after the rollback would
                # escalate again (global_step may come back to the value of this bad step).
                state.consecutive_bad_steps = 0
        extra = {"escalation": escalation} if escalation else {}
        if losses_before:
            extra["losses_before"] = [[s, value] for s, value in losses_before]
        self._notify("bad_step", event, **extra)
        self._last_event = event
        return event, decision

    # ----------------------------------------------------------------- check_numerics mode
    def owns_error(self, error: BaseException) -> bool:
        """True if `error` was raised by this guard's check_numerics op."""
        op = getattr(error, "op", None)
        if self.check_op_name is None or not is_numerics_error(error):
            return False
        if op is None or op.type in _FUNCTION_OP_TYPES:  # Raised in a loop body: by name.
            return self.in_loop and self.check_op_name in _INNER_NODE.findall(
                getattr(error, "message", "")
            )
        return op.name == self.check_op_name

    def read_global_step(self, session: tf.compat.v1.Session) -> Optional[int]:
        """The global step in `session` (a raw session), or None without one."""
        if self.global_step is None:
            return None
        return int(session.run(self.global_step))

    def read_bad_step(self, session: tf.compat.v1.Session) -> Tuple[int, List[float]]:
        """Reads what a bad step left: the global step (-1 if none) and the gradient sums.

        Args:
          session: A raw `tf.compat.v1.Session`, right after the bad step.

        Returns:
          ``(step, sums)``: the sums vector the bad step stored, the loss first.
        """
        fetches = {"sums": self.diagnostics}
        if self.global_step is not None:
            fetches["step"] = self.global_step
        values = session.run(fetches)
        return int(values.get("step", -1)), [float(s) for s in np.asarray(values["sums"])]

    def handle_numerics_error(
        self, session: tf.compat.v1.Session, error: BaseException
    ) -> _events.NanEvent:
        """Records a numerics error raised by this guard's train op and decides about it.

        Args:
          session: A raw `tf.compat.v1.Session` (not a MonitoredSession: reading through one
            would run its hooks).
          error: The `InvalidArgumentError` raised by ``session.run(train_op)``.

        Returns:
          The event (action ``stop``, ``skip`` or ``rollback``, which the caller carries out;
          `slim_nanguard.handle_numerics_error` carries it out too).

        Raises:
          NanLossError: The decision is ``raise`` (the policy, or training gives up; its
            ``cause`` says which), chained to `error`.
        """
        step, sums = self.read_bad_step(session)
        kinds = self.read_value_kinds(session)
        autopsy = self.autopsy(session, step)
        event, decision = self.record_bad_step(
            step=step, loss=sums[0], sums=sums, autopsy=autopsy, kinds=kinds
        )
        if decision.action == Action.RAISE:
            _actions.give_up(event, decision, error)
        return event

    # ----------------------------------------------------------------- rollback
    def rollback(
        self,
        session: tf.compat.v1.Session,
        checkpoint_dir: Optional[str],
        saver: Optional[tf.compat.v1.train.Saver] = None,
        *,
        event: Optional[_events.NanEvent] = None,
        skip_batches: Optional[int] = None,
        **record: Any,
    ) -> str:
        """Restores the latest good checkpoint, skips input and scales the learning rate.

        See `_rollback.Rollback.restore` for the walk back over checkpoints. Counts the
        rollback, logs it and sends the listeners a ``rollback`` record.

        Args:
          session: A raw `tf.compat.v1.Session`.
          checkpoint_dir: Directory the training loop saves checkpoints to.
          saver: Ignored unless it is the guard's own (kept for callers that passed
            ``guard.saver``): every rollback of a guard restores with `saver`.
          event: The bad step this rollback answers (default: the last one this guard saw);
            a cluster's chief passes a worker's request (see `_cluster`).
          skip_batches: Batches of input to skip (default: ``rollback_skip_batches``).
          **record: More fields for the ``rollback`` record.

        Returns:
          The path of the checkpoint restored ("" when `rollback_request` sent the rollback
          to a cluster's chief instead).

        Raises:
          CheckpointNotFoundError: No good checkpoint to roll back to.
        """
        del saver  # One rule: the guard's own saver.
        self._history.clear()  # The global step goes back: the next losses are from there.
        if self.rollback_request is not None and event is None:
            # A cluster's non-chief: the model lives on the ps and the chief restores it.
            fields = self.rollback_request(session, self)
            if self._last_event is not None:
                self._notify("rollback_requested", self._last_event, **fields)
            return ""
        event = event or self._last_event
        restored = self._rollback.restore(
            session,
            checkpoint_dir,
            bad_step=event.step if event is not None else -1,
            learning_rate_scale=self._state.learning_rate_scale,
            skip_batches=skip_batches,
        )
        state = self._state
        state.learning_rate_scale = restored.learning_rate_scale
        state.rollbacks += 1
        if event is not None:
            self._notify(
                "rollback",
                event,
                checkpoint=restored.checkpoint,
                skipped_batches=restored.skipped_batches,
                learning_rate_scale=state.learning_rate_scale,
                **record,
            )
        logging.warning(
            "slim_nanguard: rolled back to %s (rollback %d of at most %d), skipped %d batches, "
            "learning-rate scale now %g",
            restored.checkpoint,
            state.rollbacks,
            self.config.max_rollbacks,
            restored.skipped_batches,
            state.learning_rate_scale,
        )
        return restored.checkpoint

    def skip_input(self, session: tf.compat.v1.Session, batches: int) -> int:
        """Runs the input ops that feed the loss `batches` times; returns how many ran."""
        return self._rollback.skip_input(session, batches)


def is_numerics_error(error: BaseException) -> bool:
    """Says whether `error` was raised by a `tf.debugging.check_numerics` op.

    The test is on the failing op (its type is CheckNumerics or CheckNumericsV2), not on the
    message, so any other `InvalidArgumentError` (a bad reshape, a bad feed, an out-of-range
    label) is never mistaken for a numerics error. A check inside a function body (a train op
    built in a `tf.while_loop`) fails on the loop op (or on no op the graph knows); then the
    message must carry what CheckNumerics says (``" : Tensor had NaN values"``) and name the
    inner node.

    Args:
      error: Any exception.

    Returns:
      True for an `InvalidArgumentError` whose op is a CheckNumerics op.
    """
    if not isinstance(error, tf.errors.InvalidArgumentError):
        return False
    op = getattr(error, "op", None)
    if op is None or op.type in _FUNCTION_OP_TYPES:
        message = getattr(error, "message", "")
        return bool(_CHECK_MESSAGE.search(message) and _INNER_NODE.search(message))
    return op is not None and op.type in ("CheckNumerics", "CheckNumericsV2")


def get_guard(train_op_or_loss, graph: Optional[tf.Graph] = None) -> Optional[Guard]:
    """Returns the guard of a train op made by `create_train_op`, or None.

    Args:
      train_op_or_loss: The train op `create_train_op` returned, or the loss it was given.
      graph: The graph to look in (default: the tensor's graph).
    """
    if train_op_or_loss is None:
        return None
    if graph is None:
        graph = getattr(train_op_or_loss, "graph", None) or tf.compat.v1.get_default_graph()
    for guard in _REGISTRY.get(graph, ()):
        if train_op_or_loss is guard.train_op or train_op_or_loss is guard.loss:
            return guard
    return None


def guards(graph: Optional[tf.Graph] = None) -> List[Guard]:
    """All guards registered in `graph` (default graph if None)."""
    graph = graph or tf.compat.v1.get_default_graph()
    return list(_REGISTRY.get(graph, ()))


def register(guard: Guard) -> None:
    """Records `guard` as the guard of its train op's graph."""
    _REGISTRY.setdefault(guard.train_op.graph, []).append(guard)
