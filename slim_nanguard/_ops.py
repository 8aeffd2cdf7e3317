"""The graph vocabulary of the guard: which op types mean what (the batch, a write), what a
tensor passes on, the one walk over a graph, and `RunsOp` (which runs run a train op)."""

from __future__ import annotations

from typing import Callable, Container, Iterable, Iterator, List, Optional, Sequence, Tuple

import tensorflow as tf

# Ops that fetch the next batch when run: iterators, queues and readers.
INPUT_OP_TYPES = frozenset(
    "IteratorGetNext IteratorGetNextSync IteratorGetNextAsOptional QueueDequeueV2 "
    "QueueDequeueManyV2 QueueDequeueUpToV2 QueueDequeue QueueDequeueMany QueueDequeueUpTo "
    "ReaderReadV2 ReaderReadUpToV2".split()
)

# Ops whose output is a fed batch (a placeholder_with_default may sit over an iterator).
PLACEHOLDER_TYPES = frozenset({"Placeholder", "PlaceholderV2", "PlaceholderWithDefault"})

# Ops whose outputs are the batch: what a replay feeds and cannot run past.
BATCH_OP_TYPES = PLACEHOLDER_TYPES | INPUT_OP_TYPES

_WRITE_OP_PREFIXES = tuple(
    "Assign Apply ResourceApply SparseApply ResourceSparseApply Scatter ResourceScatter "
    "StridedSliceAssign ResourceStridedSliceAssign".split()
)

# Ops that pass a tensor through unchanged: into a TF1 tf.cond (Switch) or while loop (Enter).
_PASS_THROUGH_TYPES = ("Switch", "RefSwitch", "Identity", "RefIdentity", "Enter", "RefEnter")


def is_write(op: tf.Operation) -> bool:
    """Whether `op` writes a variable (an assignment, an optimizer's apply, a scatter)."""
    return op.type.startswith(_WRITE_OP_PREFIXES)


def walk(
    roots: Iterable[tf.Operation],
    *,
    forward: bool = False,
    control: bool = True,
    stop: Optional[Callable[[tf.Operation], bool]] = None,
    fed: Container[tf.Tensor] = (),
) -> Iterator[tf.Operation]:
    """Each op reachable from `roots` (included), once, depth first: backward to inputs, or
    `forward` to consumers, through control edges too with `control`, not past a `stop` op,
    nor back through a `fed` tensor to its op."""
    seen, stack = set(), list(roots)
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        yield op
        if stop is not None and stop(op):
            continue
        if forward:
            stack.extend(c for t in op.outputs for c in t.consumers())
            if control:
                stack.extend(op._control_outputs)  # pylint: disable=protected-access
        else:
            stack.extend(t.op for t in op.inputs if t not in fed)
            if control:
                stack.extend(op.control_inputs)


def sources(
    roots: Iterable[tf.Operation], types: frozenset, *, control_inputs: bool = True
) -> List[tf.Operation]:
    """The ops of `types` that `roots` depend on, in the order the walk meets them, not looking
    past them: what lies behind an input op or a placeholder is not the batch."""
    found = walk(roots, control=control_inputs, stop=lambda op: op.type in types)
    return [op for op in found if op.type in types]


def executed(fetches: Iterable, fed: Iterable[tf.Tensor]) -> Iterator[tf.Operation]:
    """Each op a ``session.run`` of `fetches` (tensors or ops) with the `fed` tensors fed runs,
    once: back through every control edge, and every data edge but a fed tensor's. An op with
    one output fed still runs for another that is not, or for a control edge."""
    fed = set(fed)
    # A fed tensor fetched is its fed value: its op does not run for it.
    roots = [as_op(f) for f in fetches if not (isinstance(f, tf.Tensor) and f in fed)]
    return walk([op for op in roots if op is not None], fed=fed)


def source(tensor: tf.Tensor) -> tf.Tensor:
    """What `tensor` passes on: through the ``Switch``, ``Enter`` and ``Identity`` ops of TF1
    control flow, and out of a function body to the tensor it captured."""
    while True:
        if tensor.op.type in _PASS_THROUGH_TYPES:
            tensor = tensor.op.inputs[0]
            continue
        captured = {id(inner): outer for outer, inner in getattr(tensor.graph, "captures", ())}
        if id(tensor) not in captured:
            return tensor
        tensor = captured[id(tensor)]


def as_op(item) -> Optional[tf.Operation]:
    """The op of `item` (an op, a tensor, a variable), or None for anything else."""
    op = item if isinstance(item, tf.Operation) else getattr(item, "op", None)
    return op if isinstance(op, tf.Operation) else None


def read_once_written(variable: tf.Variable, fill, name: Optional[str] = None) -> tf.Tensor:
    """`variable`'s value once something wrote it, else a tensor of its shape full of `fill`
    (for the guard's variables in no collection, which no initializer runs), read beside it."""
    with tf.compat.v1.colocate_with(variable.handle.op):
        return tf.cond(
            variable.is_initialized(),
            variable.read_value,
            lambda: tf.fill(_shape(variable), tf.constant(fill, variable.dtype.base_dtype)),
            name=name,
        )


def _shape(variable: tf.Variable):
    """The static shape of `variable` when known: `tf.shape` reads the variable (an
    uninitialised one too) on no device, not beside it."""
    return variable.shape.as_list() if variable.shape.is_fully_defined() else tf.shape(variable)


def in_while(context) -> bool:
    """Whether `context` (a TF1 control-flow context, or None) is or sits in a while loop."""
    while context is not None and not context.IsWhileContext():
        context = context.outer_context
    return context is not None


class RunsOp:
    """Tells whether a ``session.run(fetches)`` runs one of `ops` (a guarded train op), through
    data or control edges, or the op that calls a function body holding it."""

    def __init__(self, *ops: tf.Operation):
        callers = [_caller_in_outermost_graph(op) for op in ops]
        self._targets = {op for op in callers if op is not None}
        # A function body that no op calls: count every run rather than miss the op's.
        self._every_run = not self._targets or None in callers
        # The session's graph, where a fetched name is looked up.
        self._graph = next(iter(self._targets)).graph if self._targets else None
        self._answers = {}

    def __call__(self, fetches) -> bool:
        if self._every_run:
            return True
        roots = [op for op in map(self._as_op, _flatten_fetches(fetches)) if op is not None]
        key = tuple(op.name for op in roots)
        if key not in self._answers:
            self._answers[key] = any(op in self._targets for op in walk(roots))
        return self._answers[key]

    def _as_op(self, item) -> Optional[tf.Operation]:
        if isinstance(item, str):
            try:
                item = self._graph.as_graph_element(item)
            except (KeyError, TypeError, ValueError):
                return None  # Not in the graph: session.run raises its own error.
        return as_op(item)


def _flatten_fetches(fetches) -> Iterator:
    """The leaves of a ``session.run`` fetch structure, as `Session` reads it."""
    if isinstance(fetches, dict):
        fetches = fetches.values()
    elif not isinstance(fetches, (list, tuple)):
        if not hasattr(type(fetches), "__attrs_attrs__"):
            yield fetches
            return
        fetches = [getattr(fetches, a.name) for a in type(fetches).__attrs_attrs__]
    for value in fetches:
        yield from _flatten_fetches(value)


def _caller_in_outermost_graph(op: tf.Operation) -> Optional[tf.Operation]:
    """`op`, or the op of the outermost graph that calls its function body (None: no op)."""
    while getattr(op.graph, "outer_graph", None) is not None:
        body = op.graph
        op = next(
            (o for o in body.outer_graph.get_operations() if body.name in _functions_called(o)),
            None,
        )
        if op is None:
            return None
    return op


def _functions_called(op: tf.Operation) -> set:
    attrs = op.node_def.attr.values()
    called = {a.func.name for a in attrs if a.HasField("func")}
    return called | {f.name for a in attrs for f in a.list.func}


# The ops a regularization loss passes through unchanged on its way into the total loss.
_ADDITIVE = frozenset({"Identity", "Add", "AddV2", "AddN"})


def loss_terms(loss: tf.Tensor) -> Tuple[Tuple[tf.Tensor, ...], Tuple[tf.Tensor, ...]]:
    """``(data, regularization)``: the terms `loss` sums, walking back through sums and
    identities only (each as often as it is added), split into the graph's regularization
    losses (``REGULARIZATION_LOSSES``: slim's ``weights_regularizer``, ``tf.compat.v1.losses``)
    and the rest. A regularization loss scaled or otherwise changed on its way into `loss` is
    no term of it: it stays in the data. ``((loss,), ())`` when `loss` adds none."""
    collected = loss.graph.get_collection(tf.compat.v1.GraphKeys.REGULARIZATION_LOSSES)
    wanted = {t.name for t in collected if isinstance(t, tf.Tensor)}
    if not wanted:
        return (loss,), ()
    data, regularization, stack = [], [], [loss]
    while stack:
        tensor = stack.pop()
        if tensor.name in wanted:
            regularization.append(tensor)
        elif tensor.op.type in _ADDITIVE and tensor.op.inputs:
            stack.extend(reversed(tensor.op.inputs))
        else:
            data.append(tensor)
    if not regularization:
        return (loss,), ()
    return tuple(data), tuple(regularization)


def float64_sum(terms: Sequence[tf.Tensor], name: Optional[str] = None) -> tf.Tensor:
    """The sum of the loss `terms` in float64 (0 for none): a data loss summed apart from the
    regularization, not the total less it, so no rounding of the total is left in it."""
    if not terms:
        return tf.constant(0.0, tf.float64, name=name)
    return tf.add_n([tf.cast(t, tf.float64) for t in terms], name=name)
