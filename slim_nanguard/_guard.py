"""The run-time side of a guarded train op: `Guard`, a holder of its graph handles and state
that decides nothing and acts on nothing (`_actions` does, over `_policy.decide`)."""

from __future__ import annotations

import dataclasses
import math
import operator
import re
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from slim_nanguard import _autopsy
from slim_nanguard import _errors
from slim_nanguard import _events
from slim_nanguard import _history
from slim_nanguard import _log as logging
from slim_nanguard import _policy
from slim_nanguard import _reasons
from slim_nanguard import _record
from slim_nanguard import _rollback
from slim_nanguard import _verdict
from slim_nanguard._handles import GraphHandles
from slim_nanguard._policy import GuardState
from slim_nanguard._types import Fault
from slim_nanguard._types import Listener

# The guards of each graph: not a graph collection, which would make every meta-graph export
# warn that it cannot serialise them.
_REGISTRY: "weakref.WeakKeyDictionary[tf.Graph, List[Guard]]" = weakref.WeakKeyDictionary()

# Op types that run a function body: an error raised inside (a train op built in a
# tf.while_loop, a tf.function) is reported on them, with the inner node named in the message.
_FUNCTION_OP_TYPES = frozenset(
    {"While", "StatelessWhile", "If", "StatelessIf", "PartitionedCall", "StatefulPartitionedCall"}
)
# What CheckNumerics says, and the node the message names.
_CHECK_MESSAGE = re.compile(r" : Tensor had (NaN|Inf) values")
_INNER_NODE = re.compile(r"\{\{node ([^}]+)\}\}")


# A cluster's non-chief worker: ``fn(raw_session, guard, event) -> record fields`` asks the
# chief to roll back instead of restoring here (see `Guard.set_rollback_request`).
RollbackRequest = Callable[[tf.compat.v1.Session, "Guard", _events.NanEvent], Dict[str, Any]]


class Guard:
    """One guarded train op, made by `create_train_op` (get it with `get_guard`): its graph
    handles (each `GraphHandles` field is readable as an attribute), its config and its state,
    which changes only through `observe`. It holds and reads; it neither decides nor acts."""

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
        self._judged_sessions: "weakref.WeakSet" = weakref.WeakSet()
        self._listeners: List[Listener] = []
        self._last_event: Optional[_events.NanEvent] = None
        # The record in `autopsy_dir` (next to the checkpoints), when no listener keeps one.
        self._recorder: Optional[_record.EventRecorder] = None
        self._recorder_dir: Optional[str] = None
        self.autopsy_dir: Optional[str] = None
        self.restorer = _rollback.Rollback(handles, config, saver)  # Checkpoints and input.
        self.history = _history.LossHistory(config.losses_before)  # The last good steps' losses.
        self.rollback_request: Optional[RollbackRequest] = None  # See `set_rollback_request`.

    # Read-only: the `GuardConfig`, the `GraphHandles`, the `GuardState`, the last bad step's
    # event and the one Saver every rollback of this guard restores with (None if none built).
    config = property(operator.attrgetter("_config"))
    handles = property(operator.attrgetter("_handles"))
    state = property(operator.attrgetter("_state"))
    last_event = property(operator.attrgetter("_last_event"))
    saver = property(operator.attrgetter("restorer.saver"))

    def observe(
        self, observation: _policy.Observation, event: Optional[_events.NanEvent] = None
    ) -> Optional[_policy.Decision]:
        """Tells the guard what happened, the one way its state changes; returns the decision of
        `_policy.decide`. A bad step's `event` is kept as `last_event`, with the action decided."""
        decision, self._state = _policy.decide(self._config, self._state, observation)
        if event is not None and decision is not None:
            self._last_event = dataclasses.replace(event, action=decision.action)
        return decision

    def use_autopsy_dir(self, path: Optional[str], *, replace: bool = False) -> None:
        """Sends autopsy dumps (and the guard's own record) to `path`, if first or `replace`."""
        if path and (replace or self.autopsy_dir is None):
            self.autopsy_dir = path

    def ensure_saver(self) -> tf.compat.v1.train.Saver:
        """The rollback Saver, built now (before the graph is finalized) if there is none."""
        return self.restorer.ensure_saver()

    def set_rollback_request(self, request: Optional[RollbackRequest]) -> None:
        """Sends this guard's rollbacks to `request` instead of restoring here (None: here)."""
        self.rollback_request = request

    def add_listener(self, listener: Listener) -> None:
        """Calls ``listener(record)`` with every JSON-ready record the guard sends (its ``kind``:
        ``bad_step``, ``rollback``, ``rollback_requested``, ``loss_scale_overflow``,
        ``level_shift`` or ``autopsy_dump_removed``, and the `NanEvent`'s fields but in the
        last); an `EventRecorder` counts this guard's state from now on."""
        if listener not in self._listeners:
            self._listeners.append(listener)
        if isinstance(listener, _record.EventRecorder):
            listener.follow(self)  # Its TensorBoard counters are read from the state.

    def remove_listener(self, listener: Listener) -> None:
        """Stops calling `listener`."""
        if listener in self._listeners:
            self._listeners.remove(listener)

    def notify(self, kind: str, event: _events.NanEvent, **extra: Any) -> None:
        """Sends the listeners a record of `kind` about `event` (see `add_listener`)."""
        record = {"kind": kind, **event.to_json(), **extra}
        if kind != "bad_step":
            record.pop("autopsy", None)  # Once, in the bad step's own record.
        self.send(record)

    def send(self, record: Dict[str, Any]) -> None:
        """Sends one record to every listener, and to the guard's own record in the autopsy
        directory unless a listener keeps one (one record each)."""
        for listener in list(self._listeners):
            listener(record)
        if self.autopsy_dir is None or any(
            isinstance(listener, _record.EventRecorder) for listener in self._listeners
        ):
            return
        if self._recorder is None or self._recorder_dir != self.autopsy_dir:
            # The loop's own summary writer (tf-slim's Supervisor) is not ours to share: a
            # second FileWriter on the same directory can open the same events file in the
            # same second and corrupt it. The TensorBoard counters are `train`'s.
            self._recorder = _record.EventRecorder(self.autopsy_dir, write_summaries=False)
            self._recorder_dir = self.autopsy_dir
        try:
            self._recorder(record)
        except (OSError, tf.errors.OpError) as err:  # A record nobody asked for: no crash.
            logging.warning(
                "slim_nanguard: could not append to %s (%s); training goes on without it",
                self._recorder.path,
                err,
            )

    def mark_judged(self, session: tf.compat.v1.Session) -> None:
        """Says that the caller applies the policy to this guard's bad steps in the raw `session`
        (hook mode, once per session; else a no-op); without it a bad step fails naming it."""
        if self.judged is None:
            return
        try:
            if session in self._judged_sessions:
                return
            self._judged_sessions.add(session)
        except TypeError:  # not weak-referenceable: initialise each time (idempotent)
            pass
        session.run(self.judged.initializer)

    def culprits_and_kinds(
        self, sums: Sequence[float], kinds: Optional[Sequence[str]]
    ) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
        """Names of the variables whose gradients held NaN or Inf, and what each held: exact from
        `kinds`, else from `sums` (an overflow of finite values too) with no kinds."""
        if kinds is not None and len(kinds) == len(self.variable_names) + 1:
            bad = [(n, k) for n, k in zip(self.variable_names, kinds[1:]) if k != _verdict.FINITE]
            return tuple(n for n, _ in bad), tuple(k for _, k in bad)
        grads = zip(self.variable_names, list(sums)[1:])
        return tuple(name for name, s in grads if not math.isfinite(float(s))), ()

    def autopsy(
        self,
        session: tf.compat.v1.Session,
        step: int,
        cause: str = _reasons.NON_FINITE,
        over: Sequence[str] = (),
    ):
        """The `Autopsy` (never failing: its ``error`` says why) of the bad step just seen, before
        any rollback, or None: autopsies off or used up, or no batch kept. `cause` rejected the
        step (ValueError if no such reason), on the values `over`."""
        causes = [_reasons.NON_FINITE, Fault.SPIKE, *(r.name for r in self.reasons)]
        if cause not in causes:
            raise ValueError(f"cause is {cause!r}; it must be one of {', '.join(causes)}.")
        kept = self.capture is not None and self.capture.tensors
        if not kept or not _policy.wants_autopsy(self._config, self._state):
            return None
        self.observe(_policy.Autopsied())
        result = _autopsy.autopsy_bad_step(
            session,
            self.capture,
            [self.grad_sums] if cause == _reasons.NON_FINITE else [self.loss],
            step=step,
            dump_dir=self.autopsy_dir,
            timeout_secs=self.config.autopsy_timeout_secs,
            cause=cause,
            spike_over=over,
        )
        if result.dump:
            self._remove_old_dumps()
        return result

    def _remove_old_dumps(self) -> None:
        """Keeps the first and the last dumps the config says; records each one removed."""
        first, last = self.config.autopsy_keep_first, self.config.autopsy_keep_last
        try:
            gone = _autopsy.remove_old_dumps(self.autopsy_dir, first, last)
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
            self.send(
                {
                    "kind": "autopsy_dump_removed",
                    "dump": removed["dump"],
                    "dump_step": removed["step"],
                    "keep_first": first,
                    "keep_last": last,
                }
            )

    def owns_error(self, error: BaseException) -> bool:
        """True if `error` was raised by this guard's check_numerics op."""
        if self.check_op_name is None or not is_numerics_error(error):
            return False
        op = getattr(error, "op", None)
        if op is None or op.type in _FUNCTION_OP_TYPES:  # Raised in a loop body: by name.
            inner = _INNER_NODE.findall(getattr(error, "message", ""))
            return self.in_loop and self.check_op_name in inner
        return op.name == self.check_op_name

    def read_global_step(self, session: tf.compat.v1.Session) -> Optional[int]:
        """The global step in the raw `session`, or None without one."""
        if self.global_step is None:
            return None
        return int(session.run(self.global_step))

    def read_step_report(
        self,
        session: tf.compat.v1.Session,
        stored: Optional[Tuple[int, Sequence[float]]] = None,
    ) -> "StepReport":
        """Everything about the bad step just seen (a `StepReport`), in one ``session.run`` of
        the raw `session`; `stored` is ``(step, sums)`` already read, or None to read them."""
        fetches = {"report": self.report, "kinds": self.kinds_read}
        if stored is None:
            fetches.update(sums=self.diagnostics, step=self.global_step)
        fetches = {name: tensor for name, tensor in fetches.items() if tensor is not None}
        values = session.run(fetches) if fetches else {}
        step, sums = _stored(values) if stored is None else stored
        # The report's code: 2 + the index of the reason that rejected the step, its slice after.
        report = np.asarray(values.get("report", [0]))
        index = int(report[0]) - 2
        reason, figures, kinds = None, None, None
        if 0 <= index < len(self.reasons):
            reason = self.reasons[index]
            start = 1 + sum(len(r.report_fields) for r in self.reasons[:index])
            figures = reason.figures(report[start : start + len(reason.report_fields)])
            # What the reason's graph handles know beyond the graph.
            annotate = getattr(self.reason_handles.get(reason.name), "annotate", None)
            if annotate is not None:
                figures = annotate(figures, int(step))
        elif "kinds" in values and np.min(values["kinds"], initial=0) >= 0:
            kinds = tuple(_verdict.kind_name(c) for c in np.asarray(values["kinds"]))
        sums, count = [float(s) for s in sums], len(self.variable_names)
        scale = None if self.loss_scale_floor is None else _verdict.stored_loss_scale(sums, count)
        overflow = reason is None and scale is not None and _verdict.stored_overflow(sums, count)
        return StepReport(int(step), sums, reason, figures, kinds, scale, overflow)

    def read_bad_step(self, session: tf.compat.v1.Session) -> Tuple[int, List[float]]:
        """``(step, sums)`` the bad step just seen stored in the raw `session` (the loss first)."""
        fetches = {"sums": self.diagnostics, "step": self.global_step}
        return _stored(session.run({k: t for k, t in fetches.items() if t is not None}))


def _stored(values: Dict[str, Any]) -> Tuple[int, List[float]]:
    """``(step, sums)`` of what a bad step stored, as read: the step -1 without a global step."""
    return int(values.get("step", -1)), [float(s) for s in np.asarray(values["sums"])]


# Each `GraphHandles` field, read-only: ``guard.loss`` is ``guard.handles.loss``.
for _field in dataclasses.fields(GraphHandles):
    setattr(Guard, _field.name, property(operator.attrgetter(f"_handles.{_field.name}")))


@dataclasses.dataclass(frozen=True)
class StepReport:
    """What a bad step left, read at once: its global step (-1 without one), the loss then each
    gradient's sum (then the loss scale), the reason that rejected it and its figures (None if
    non-finite), the exact kinds of the loss and each gradient, when kept, the loss scale it used
    (None without loss scaling), and whether it was a loss-scale optimizer's overflow."""

    step: int
    sums: List[float]
    reason: Optional[_reasons.Reason]
    figures: Optional[Dict[str, Any]]
    kinds: Optional[Tuple[str, ...]]
    loss_scale: Optional[float]
    overflow: bool

    @property
    def cause(self) -> str:
        """``"non_finite"`` or the name of the reason."""
        return _reasons.NON_FINITE if self.reason is None else self.reason.name


def is_numerics_error(error: BaseException) -> bool:
    """Says whether `error` (any exception) was raised by a guard's check (check_numerics mode):
    an `InvalidArgumentError` of a CheckNumerics op or a guard's own check op, and no other (a
    bad reshape, feed or label, a user's ``Assert``)."""
    if not isinstance(error, tf.errors.InvalidArgumentError):
        return False
    op = getattr(error, "op", None)
    if op is None or op.type in _FUNCTION_OP_TYPES:
        # A check in a function body (a train op built in a `tf.while_loop`) fails on the loop
        # op: the message must say what the check says and name the inner node.
        message = getattr(error, "message", "")
        said = _CHECK_MESSAGE.search(message) or _errors.REJECTED in message
        return bool(said and _INNER_NODE.search(message))
    if op.type == "Assert":
        return any(guard.check_op_name == op.name for guard in _REGISTRY.get(op.graph, ()))
    return op.type in ("CheckNumerics", "CheckNumericsV2")


def get_guard(train_op_or_loss, graph: Optional[tf.Graph] = None) -> Optional[Guard]:
    """Returns the guard of a train op made by `create_train_op` (or of the loss it was given),
    or None; `graph` is where to look (default: the tensor's graph)."""
    if graph is None:
        graph = getattr(train_op_or_loss, "graph", None) or tf.compat.v1.get_default_graph()
    for guard in _REGISTRY.get(graph, ()):
        if train_op_or_loss is guard.train_op or train_op_or_loss is guard.loss:
            return guard
    return None


def guard_of_train_op(train_op) -> Optional[Guard]:
    """`get_guard` for a loop that runs `train_op`: None for a train op no guard has; a
    ValueError for a guarded loss in its place (a loop running it would update nothing)."""
    guard = get_guard(train_op)
    if guard is not None and train_op is not guard.train_op:
        raise ValueError(
            f"train_op {train_op.name!r} is the loss of a guarded train op; pass the train op "
            f"create_train_op returned ({guard.train_op.name!r}), which updates the weights."
        )
    return guard


def guards(graph: Optional[tf.Graph] = None) -> List[Guard]:
    """All guards registered in `graph` (default graph if None)."""
    graph = graph or tf.compat.v1.get_default_graph()
    return list(_REGISTRY.get(graph, ()))


def register(guard: Guard) -> None:
    """Records `guard` as the guard of its train op's graph."""
    _REGISTRY.setdefault(guard.train_op.graph, []).append(guard)
