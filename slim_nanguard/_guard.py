"""The run-time side of a guarded train op: counters, events, policy decisions, rollback.

`create_train_op` builds the graph side (the finiteness test and the gate in front of every
variable update) and registers one `Guard` for the train op with its graph. The hook (hook
mode) and the training loops (check_numerics mode) look it up with `get_guard` and report
each step to it. The registry is a weak mapping from graph to guards rather than a graph
collection: a collection of Python objects makes every meta-graph export (each checkpoint)
warn that it cannot be serialised.
"""

from __future__ import annotations

import dataclasses
import math
import re
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
from absl import logging

from slim_nanguard import _errors
from slim_nanguard import _events
from slim_nanguard import _policy

_REGISTRY: "weakref.WeakKeyDictionary[tf.Graph, List[Guard]]" = weakref.WeakKeyDictionary()

MODE_CHECK_NUMERICS = "check_numerics"
MODE_HOOK = "hook"

# Op types that fetch the next batch; a rollback runs them to skip input.
_INPUT_OP_TYPES = frozenset(
    {
        "IteratorGetNext",
        "IteratorGetNextSync",
        "IteratorGetNextAsOptional",
        "QueueDequeueV2",
        "QueueDequeueManyV2",
        "QueueDequeueUpToV2",
        "QueueDequeue",
        "QueueDequeueMany",
        "QueueDequeueUpTo",
        "ReaderReadV2",
        "ReaderReadUpToV2",
    }
)

# Op types that run a function body: an error raised inside (a train op built in a
# tf.while_loop, a tf.function) is reported on them, with the inner node named in the message.
_FUNCTION_OP_TYPES = frozenset(
    {"While", "StatelessWhile", "If", "StatelessIf", "PartitionedCall", "StatefulPartitionedCall"}
)
# What CheckNumerics says, and the node the message names.
_CHECK_MESSAGE = re.compile(r" : Tensor had (NaN|Inf) values")
_INNER_NODE = re.compile(r"\{\{node ([^}]+)\}\}")

# Called with one record (a JSON-ready dict with a "kind" key) per bad step and rollback.
Listener = Callable[[Dict[str, Any]], None]


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
    """One guarded train op: its tensors, its policy and what it has seen.

    Instances are made by `create_train_op`; get them with `get_guard`.

    Attributes:
      config: The `GuardConfig` the train op was built with.
      mode: ``"check_numerics"`` or ``"hook"``.
      train_op: The train op tensor `create_train_op` returned.
      loss: The user's total loss tensor.
      global_step: The global step variable, or None.
      grad_sums: The loss, then the sum of each gradient, as one vector.
      ok: Hook mode: the boolean the hook fetches each step (loss and gradients all finite).
        None in check_numerics mode, whose check raises instead, unless the optimizer scales
        the loss dynamically: then it is False on an overflow step, which does not raise.
      diagnostics: The variable a bad step leaves its ``grad_sums`` in (check_numerics mode
        stores them before every check; hook mode only on the bad branch); with a dynamic
        loss-scale optimizer the loss scale of the step follows the sums.
      loss_scale_floor: The smallest loss scale of a dynamic loss-scale optimizer (an overflow
        there is a bad step), or None without one.
      in_loop: True when the train op was built inside a `tf.while_loop` (or another function
        body), whose tensors a run cannot fetch: `ok` is then None and `NanLossHook` reads
        `diagnostics` after each run instead.
      judged: Hook mode: a variable in no collection that whatever applies the policy
        (`NanLossHook`, `train_step`) initialises in its session with `mark_judged`. A bad
        step in a session where it is not initialised fails with an error naming what to
        add, rather than being skipped unseen. None in check_numerics mode.
      state: The `GuardState` counters.
    """

    def __init__(
        self,
        *,
        config: _policy.GuardConfig,
        mode: str,
        train_op: tf.Tensor,
        loss: tf.Tensor,
        global_step,
        grad_sums: tf.Tensor,
        ok: Optional[tf.Tensor],
        diagnostics: tf.Variable,
        check_op_name: Optional[str],
        variable_names: Sequence[str],
        lr_scale: Optional[tf.Variable],
        loss_scale_floor: Optional[float] = None,
        in_loop: bool = False,
    ):
        self.config = config
        self.mode = mode
        self.train_op = train_op
        self.loss = loss
        self.global_step = global_step
        self.grad_sums = grad_sums
        self.ok = ok
        self.diagnostics = diagnostics
        self.check_op_name = check_op_name
        self.variable_names = tuple(variable_names)
        self.lr_scale = lr_scale
        self.loss_scale_floor = loss_scale_floor
        self.in_loop = in_loop
        self.judged: Optional[tf.Variable] = None  # Set by create_train_op in hook mode.
        self._judged_sessions: "weakref.WeakSet" = weakref.WeakSet()
        self.state = GuardState()
        self.last_event: Optional[_events.NanEvent] = None
        # The Saver a rollback restores with; create_train_op builds it when a rollback can
        # happen (the graph is finalized once training starts).
        self.saver = None
        self.input_ops = _find_input_ops(loss)
        self._listeners: List[Listener] = []
        # The global step the last rollback restored (None before any, or without a step).
        self._restored_step: Optional[int] = None
        # A cluster's non-chief worker: ``fn(session, guard) -> record fields`` asks the chief
        # to roll back instead of restoring here (set by `_cluster.RollbackRequestHook`).
        self.rollback_request: Optional[Callable[[Any, "Guard"], Dict[str, Any]]] = None
        # Autopsy: the batch a bad step keeps (a `_capture.Capture`, set by create_train_op),
        # the directory dumps go to (set by the loop or the hook), and the autopsies done.
        self.capture = None
        self.autopsy_dir: Optional[str] = None
        self.autopsies = 0
        if lr_scale is not None:
            # init_scope: in the outermost graph, even for a train op built in a loop body.
            with loss.graph.as_default(), tf.init_scope():
                self._lr_scale_value = tf.compat.v1.placeholder(
                    lr_scale.dtype.base_dtype, [], name="nanguard_lr_scale_value"
                )
                self._lr_scale_assign = tf.compat.v1.assign(lr_scale, self._lr_scale_value)

    # ----------------------------------------------------------------- listeners
    def add_listener(self, listener: Listener) -> None:
        """Calls ``listener(record)`` for each bad step and each rollback.

        A record is a JSON-ready dict: ``kind`` (``"bad_step"`` or ``"rollback"``, and
        ``"loss_scale_overflow"`` for an overflow step of a dynamic loss-scale optimizer) and
        the fields of the `NanEvent` (``step``, ``loss``, ``culprits``, ``action``, ...). A bad
        step whose action came from ``persistent_nan_policy`` adds ``escalation`` (why, e.g.
        ``"5 bad steps in a row reached max_consecutive_bad_steps=5"``); a rollback adds
        ``checkpoint`` and ``skipped_batches``.
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
        for listener in list(self._listeners):
            listener(record)

    def mark_judged(self, session) -> None:
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

    def on_loss_scale_overflow(self, *, step: int, sums: Sequence[float]) -> _events.NanEvent:
        """Records an overflow step of a dynamic loss-scale optimizer; no policy applies.

        The optimizer skipped the update and lowered its scale; nothing else was written. The
        step counts neither as a bad step nor toward ``max_consecutive_bad_steps``.

        Args:
          step: The global step the overflow happened at (-1 if unknown).
          sums: What the step stored: the loss, the gradient sums, the loss scale.

        Returns:
          The event, with ``action`` ``"loss_scale_overflow"``; listeners get a record of kind
          ``"loss_scale_overflow"``.
        """
        state = self.state
        state.loss_scale_overflows += 1
        sums = list(sums)
        event = _events.NanEvent(
            step=int(step),
            loss=float(sums[0]),
            loss_kind=_events.classify(float(sums[0])),
            culprits=self.culprits(sums),
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

    def culprits(self, sums: Sequence[float]) -> Tuple[str, ...]:
        """Names of the variables whose gradient sums in `sums` (loss first) are non-finite."""
        return tuple(
            name
            for name, s in zip(self.variable_names, list(sums)[1:])
            if not math.isfinite(float(s))
        )

    def autopsy(self, session, step: int):
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
            or self.autopsies >= self.config.autopsy_max_steps
        ):
            return None
        from slim_nanguard import _autopsy  # Local: only a bad step needs it.

        self.autopsies += 1
        return _autopsy.autopsy_bad_step(
            session,
            self.capture,
            [self.grad_sums],
            step=step,
            dump_dir=self.autopsy_dir,
            timeout_secs=self.config.autopsy_timeout_secs,
        )

    def on_bad_step(
        self,
        *,
        step: int,
        loss: float,
        sums: Optional[Sequence[float]],
        policy: Optional[str] = None,
        autopsy=None,
    ) -> _events.NanEvent:
        """Counts a bad step, asks the policy (and the `on_nan` callback) what to do.

        After ``max_consecutive_bad_steps`` bad steps in a row under ``skip`` or ``rollback``
        (after the `on_nan` callback), the action becomes the config's
        ``persistent_nan_policy``; an escalated ``rollback`` starts the consecutive count over.

        Args:
          step: The global step the bad step was attempted at (-1 if unknown).
          loss: The loss value of the bad step.
          sums: The per-gradient sums (the loss first), or None if unknown.
          policy: The policy to apply instead of the configured one (a hook may say so).
          autopsy: The step's `Autopsy` (see `autopsy`), put in the event, or None.

        Returns:
          The event, with ``action`` set to ``"stop"``, ``"skip"`` or ``"rollback"``: what is to
          be done, escalation included; the caller carries the action out.

        Raises:
          NanLossError: When the action is ``raise``: the policy says so, or training gives up
            (too many bad steps in a row with ``persistent_nan_policy="raise"``, or too many
            rollbacks).
        """
        state = self.state
        if state.last_bad_step is not None and step >= 0 and step != state.last_bad_step:
            # A step went through since the last bad one (global_step moved on).
            state.consecutive_bad_steps = 0
        state.total_bad_steps += 1
        state.consecutive_bad_steps += 1
        state.last_bad_step = step
        event = _events.NanEvent(
            step=int(step),
            loss=float(loss),
            loss_kind=_events.classify(float(loss)),
            culprits=self.culprits(sums) if sums is not None else (),
            consecutive=state.consecutive_bad_steps,
            total=state.total_bad_steps,
            mode=self.mode,
            action=policy or self.config.nan_policy,
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
        if action == _policy.SKIP:
            state.skips += 1
        elif action == _policy.STOP:
            state.stops += 1
        _events.log_event(event)
        if escalation and action != _policy.RAISE:
            logging.warning(
                "slim_nanguard: %s, so the weights, not the batch, went bad: "
                "applying persistent_nan_policy=%r",
                escalation,
                action,
            )
            if action == _policy.ROLLBACK:
                # Start the count over, or the first bad step after the rollback would
                # escalate again (global_step may come back to the value of this bad step).
                state.consecutive_bad_steps = 0
        self._notify("bad_step", event, **({"escalation": escalation} if escalation else {}))
        self.last_event = event
        if action == _policy.RAISE:
            raise _errors.NanLossError(event, decision.reason)
        return event

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

    def read_bad_step(self, session) -> Tuple[int, List[float]]:
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

    def handle_numerics_error(self, session, error: BaseException) -> _events.NanEvent:
        """Applies the policy to a numerics error raised by this guard's train op.

        Args:
          session: A raw `tf.compat.v1.Session` (not a MonitoredSession: reading through one
            would run its hooks).
          error: The `InvalidArgumentError` raised by ``session.run(train_op)``.

        Returns:
          The event (action ``stop``, ``skip`` or ``rollback``, which the caller carries out).

        Raises:
          NanLossError: As `on_bad_step`, chained to `error`.
        """
        step, sums = self.read_bad_step(session)
        autopsy = self.autopsy(session, step)
        try:
            return self.on_bad_step(step=step, loss=sums[0], sums=sums, autopsy=autopsy)
        except _errors.NanLossError as nan_error:
            raise nan_error from error

    # ----------------------------------------------------------------- rollback
    def rollback(
        self,
        session,
        checkpoint_dir: Optional[str],
        saver=None,
        *,
        event: Optional[_events.NanEvent] = None,
        skip_batches: Optional[int] = None,
        **record: Any,
    ) -> str:
        """Restores the latest good checkpoint, skips input and scales the learning rate.

        When the bad step came at the very step the previous rollback restored (no step went
        through since), that state did not hold up: this rollback goes to the newest
        checkpoint of an earlier step instead, and so on, one further back each time, as long
        as older readable checkpoints are kept (then the oldest one is restored again).

        Args:
          session: A raw `tf.compat.v1.Session`.
          checkpoint_dir: Directory the training loop saves checkpoints to.
          saver: The `Saver` to restore with (default: a saver over all global variables,
            which must have been built before the graph was finalized).
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
        from slim_nanguard import _checkpoints  # Local: only rollback needs it.

        if self.rollback_request is not None and event is None:
            # A cluster's non-chief: the model lives on the ps and the chief restores it.
            fields = self.rollback_request(session, self)
            if self.last_event is not None:
                self._notify("rollback_requested", self.last_event, **fields)
            return ""
        event = event or self.last_event
        path = _checkpoints.latest_good_checkpoint(checkpoint_dir)
        bad_step = event.step if event is not None else -1
        if (
            path is not None
            and self._restored_step is not None
            and (bad_step == self._restored_step)
        ):
            # No step went through since the last rollback restored this step: the state it
            # restored went bad at once (finite weights can already be diverging). Go back to
            # an earlier step's checkpoint, if one is kept.
            older = _checkpoints.latest_good_checkpoint(
                checkpoint_dir, before_step=self._restored_step
            )
            if older is not None:
                logging.warning(
                    "slim_nanguard: training went bad again at step %d, right "
                    "after rolling back to it; rolling back further, to %s",
                    bad_step,
                    older,
                )
                path = older
            else:  # None earlier is kept: the same step again (not a newer, failed one).
                path = (
                    _checkpoints.latest_good_checkpoint(
                        checkpoint_dir, before_step=self._restored_step + 1
                    )
                    or path
                )
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
        if saver is None:
            raise ValueError("rollback needs a Saver built before the graph was finalized.")
        if self.lr_scale is not None:
            # The scale the session trains with: in a resumed process, the one the checkpoint
            # brought back; after a session recovery, the lower of it and this process's own.
            live = float(session.run(self.lr_scale))
            self.state.learning_rate_scale = min(self.state.learning_rate_scale, live)
        saver.restore(session, path)
        self._restored_step = (
            int(session.run(self.global_step)) if self.global_step is not None else None
        )
        if self.lr_scale is not None:
            self.state.learning_rate_scale *= self.config.rollback_lr_factor
            session.run(
                self._lr_scale_assign, {self._lr_scale_value: self.state.learning_rate_scale}
            )
        skipped = self.skip_input(
            session, self.config.rollback_skip_batches if skip_batches is None else skip_batches
        )
        self.state.rollbacks += 1
        if event is not None:
            self._notify(
                "rollback",
                event,
                checkpoint=path,
                skipped_batches=skipped,
                learning_rate_scale=self.state.learning_rate_scale,
                **record,
            )
        logging.warning(
            "slim_nanguard: rolled back to %s (rollback %d of at most %d), skipped %d batches, "
            "learning-rate scale now %g",
            path,
            self.state.rollbacks,
            self.config.max_rollbacks,
            skipped,
            self.state.learning_rate_scale,
        )
        return path

    def skip_input(self, session, batches: int) -> int:
        """Runs the input ops that feed the loss `batches` times; returns how many ran."""
        if not self.input_ops or batches <= 0:
            return 0
        done = 0
        for _ in range(batches):
            try:
                session.run(self.input_ops)
            except tf.errors.OutOfRangeError:
                break
            done += 1
        return done


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


def _find_input_ops(loss: tf.Tensor) -> List[tf.Operation]:
    """The ops among the ancestors of `loss` that produce a new batch when run."""
    found, seen, stack = [], set(), [loss.op]
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        if op.type in _INPUT_OP_TYPES:
            found.append(op)
            continue
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return found
