"""The run-time side of a guarded train op: `Guard`, a holder of its graph handles, config,
saver, state cell and listeners, that reads, decides and acts on nothing (`_actions` does, over
`_policy.decide`); the guards of each graph; which errors a guard's check raised."""

from __future__ import annotations

import dataclasses
import operator
import re
import weakref
from typing import Any, Callable, Dict, List, Optional

import tensorflow as tf

from slim_nanguard import _errors
from slim_nanguard import _nan_event
from slim_nanguard import _policy
from slim_nanguard import _recorders
from slim_nanguard import _rollback
from slim_nanguard._handles import GraphHandles
from slim_nanguard._policy import GuardState
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
# chief to roll back instead of restoring here (`Guard.rollback_request`).
RollbackRequest = Callable[[tf.compat.v1.Session, "Guard", _nan_event.NanEvent], Dict[str, Any]]


class Cell:
    """What changes as a guard trains, changed by `_actions` only: the `GuardState` (through
    `_policy.decide`), the last bad step's event, the good steps' losses, the sessions judged."""

    def __init__(self, losses_before: int):
        self.state = GuardState()
        self.last_event: Optional[_nan_event.NanEvent] = None
        self.history = _nan_event.LossHistory(losses_before)
        self.judged_sessions: "weakref.WeakSet" = weakref.WeakSet()


class Guard:
    """One guarded train op, made by `create_train_op` (get it with `get_guard`): a holder of
    its graph handles (each `GraphHandles` field is readable as an attribute), its config, its
    saver (`restorer`), its state `cell` and its `registry` of listeners. It reads no session,
    decides nothing and acts on nothing: `_actions` does, over `_policy.decide`."""

    def __init__(
        self,
        *,
        config: _policy.GuardConfig,
        handles: GraphHandles,
    ):
        self._config = config
        self._handles = handles
        self.cell = Cell(config.losses_before)
        self.registry = _recorders.Registry(self)
        self.restorer = _rollback.Rollback(handles, config)  # Checkpoints and input.
        # Where this guard's rollbacks go instead of restoring here (None: here).
        self.rollback_request: Optional[RollbackRequest] = None

    # Read-only: the `GuardConfig`, the `GraphHandles`, the `GuardState`, the last bad step's
    # event, the good steps' losses, the directory of the autopsy dumps and of the guard's own
    # record, and the one Saver every rollback of this guard restores with (None if none built).
    config = property(operator.attrgetter("_config"))
    handles = property(operator.attrgetter("_handles"))
    state = property(operator.attrgetter("cell.state"))
    last_event = property(operator.attrgetter("cell.last_event"))
    history = property(operator.attrgetter("cell.history"))
    autopsy_dir = property(operator.attrgetter("registry.directory"))
    saver = property(operator.attrgetter("restorer.saver"))

    def add_listener(self, listener: Listener) -> None:
        """Calls ``listener(record)`` with every JSON-ready record the guard sends (its ``kind``:
        ``bad_step``, ``rollback``, ``rollback_requested``, ``loss_scale_overflow``,
        ``level_shift``, ``autopsy_dump_removed``, ``retry`` or ``quarantine``, and the
        `NanEvent`'s fields but in the last); an `EventRecorder` writes this guard's counters
        too."""
        self.registry.add(listener)

    def remove_listener(self, listener: Listener) -> None:
        """Stops calling `listener`."""
        if listener in self.registry.listeners:
            self.registry.listeners.remove(listener)


# Each `GraphHandles` field, read-only: ``guard.loss`` is ``guard.handles.loss``.
for _field in dataclasses.fields(GraphHandles):
    setattr(Guard, _field.name, property(operator.attrgetter(f"_handles.{_field.name}")))


def owner_of(error: BaseException) -> Optional[Guard]:
    """The guard whose check_numerics op raised `error`, or None."""
    graph = getattr(getattr(error, "op", None), "graph", None)
    guards = _REGISTRY.get(graph, ()) if graph is not None else ()
    return next((guard for guard in guards if owns_error(guard, error)), None)


def owns_error(guard: Guard, error: BaseException) -> bool:
    """True if `error` was raised by `guard`'s check_numerics op."""
    if guard.check_op_name is None or not is_numerics_error(error):
        return False
    op = getattr(error, "op", None)
    if op is None or op.type in _FUNCTION_OP_TYPES:  # Raised in a loop body: by name.
        inner = _INNER_NODE.findall(getattr(error, "message", ""))
        return guard.in_loop and guard.check_op_name in inner
    return op.name == guard.check_op_name


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
