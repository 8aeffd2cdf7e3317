"""The gating of writes: every variable write a train op makes waits on the step's test, by a
control input added with TensorFlow's private ``Operation._add_control_input`` (the ops are
already built, and no public API adds an input to one). A write the forward pass makes before
the test waits on a copy of its variable instead, which a bad step writes back.

With `SyncReplicasOptimizer`, the worker's accumulator applies wait on the test (a bad step
accumulates nothing and takes no token), and the chief's apply of the aggregated gradient waits
on a check of its own, which stops its queue runner when finite gradients overflow. The
optimizer's init ops, ready check and queue runner stay ungated, so no run but the train op
takes a batch.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Dict, Iterable, List, Optional, Sequence, Tuple

import tensorflow as tf
from tensorflow.python.ops import control_flow_ops

from slim_nanguard import _exact_sums
from slim_nanguard import _log as logging
from slim_nanguard import _ops

if TYPE_CHECKING:
    from slim_nanguard import _guard


def apply_gradients(
    optimizer, grads, global_step, gates, update_ops, restored, unless_bad
) -> tf.Operation:
    """``optimizer.apply_gradients``, with every write it and the `update_ops` make waiting on
    ``gate`` and, with a dynamic loss scale, all but those of `unless_bad` on ``finite_gate``
    (`gates`: those two of a `_step_test.Gate`). `restored`: the forward-pass writes a bad
    step puts back."""
    gate, finite_gate = gates
    graph = gate.graph
    if isinstance(optimizer, tf.compat.v1.train.SyncReplicasOptimizer):
        grad_updates, gated = apply_sync_replicas(optimizer, grads, global_step, gate)
        new_ops = []
    else:
        first_new_op = len(graph.get_operations())
        with tf.control_dependencies([gate]):
            grad_updates = optimizer.apply_gradients(grads, global_step=global_step)
        new_ops = graph.get_operations()[first_new_op:]
        gated = _gate_writes(graph, new_ops, gate)
    gated_updates = _gate_update_ops(update_ops, gate, restored)
    gated += gated_updates
    if finite_gate is not None:
        # The loss scale's own update runs on an overflow step; every other write does not.
        scale_ops = {v.op for v in unless_bad}
        writes = [op for op in new_ops if _written_variable(op) not in scale_ops]
        _gate_writes(graph, writes, finite_gate)
        _wait_on(finite_gate, gated_updates)
    logging.vlog(1, "slim_nanguard: %d variable writes wait on the finiteness test", len(gated))
    return grad_updates


def _gate_writes(graph: tf.Graph, new_ops: Sequence[tf.Operation], gate: tf.Tensor) -> list:
    """Makes every variable write among `new_ops` but initialisers wait on `gate`."""
    # TensorFlow drops a ``control_dependencies`` edge from ops that already consume an op made
    # in the block, and graph rewrites may fold such producers away: an edge on each write
    # keeps the gate whatever the optimizer.
    initializers = _initializers(graph)
    return _wait_on(gate, [op for op in new_ops if _ops.is_write(op) and op not in initializers])


def _wait_on(gate: tf.Tensor, ops: Iterable[tf.Operation]) -> List[tf.Operation]:
    """Makes each of `ops` that does not wait on `gate` yet wait on it; returns those."""
    gated = []
    for op in ops:
        if gate.op not in op.control_inputs:
            op._add_control_input(gate.op)  # pylint: disable=protected-access
            gated.append(op)
    return gated


def _gate_update_ops(update_ops: Sequence, gate: tf.Tensor, restored: frozenset) -> list:
    """Makes the writes that `update_ops` run wait on `gate`, but those the test itself needs
    (the forward pass), with a warning for one of those not in `restored`."""
    roots = [op for op in (_ops.as_op(u) for u in update_ops) if op is not None]
    if not roots:
        return []
    needed_by_gate = set(_ops.walk([gate.op]))
    gated = _wait_on(
        gate, [op for op in set(_ops.walk(roots)) - needed_by_gate if _ops.is_write(op)]
    )
    for op in roots:
        if op in needed_by_gate and any(
            _ops.is_write(w) and w not in restored for w in _ops.walk([op])
        ):
            logging.warning(
                "slim_nanguard: update op %s feeds the loss, so it runs before the "
                "finiteness test and cannot be rolled back on a bad step.",
                op.name,
            )
    return gated


def _variables(graph: tf.Graph) -> List[tf.Variable]:
    return graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES) + graph.get_collection(
        tf.compat.v1.GraphKeys.LOCAL_VARIABLES
    )


def _initializers(graph: tf.Graph) -> set:
    return {v.initializer for v in _variables(graph)}


def _written_variable(op: tf.Operation) -> Optional[tf.Operation]:
    """The variable op (or handle op) a write op writes to, through cond's Switch ops."""
    return _ops.source(op.inputs[0]).op if op.inputs else None


def gate_writes_after(guard: "_guard.Guard") -> List[tf.Operation]:
    """Makes the variable writes built after the train op that wait on it (an EMA under
    ``tf.control_dependencies([train_op])``), which a bad step would run too, wait on the
    guard's pivot; returns them. With a finalized graph it gates nothing and warns."""
    pivot = guard.pivot
    if pivot is None:
        return []
    writes = [
        op
        for op in _ops.walk([guard.train_op.op], forward=True)
        if _ops.is_write(op) and pivot.op not in op.control_inputs
    ]
    if writes and guard.train_op.graph.finalized:
        logging.warning(
            "slim_nanguard: %s write variables after %s, but the graph is "
            "finalized, so they also run on a bad step; do not finalize the graph "
            "before the session whose NanLossHook begins on it is made.",
            ", ".join(op.name for op in writes),
            guard.train_op.name,
        )
        return []
    gated = _wait_on(pivot, writes)
    if gated:
        logging.vlog(
            1,
            "slim_nanguard: %d variable writes after %s wait on its finiteness test",
            len(gated),
            guard.train_op.name,
        )
    return gated


@dataclasses.dataclass(frozen=True)
class ForwardWrites:
    """(variable, its value before the forward pass's writes) `snapshots`, and the writes whose
    variable a bad step puts back (`restored`)."""

    snapshots: Tuple[Tuple[tf.Variable, tf.Tensor], ...] = ()
    restored: frozenset = frozenset()

    def put_back(self, ok: tf.Tensor) -> List[tf.Operation]:
        """The writes that put each snapshot back; they run only when `ok` is False.

        On a TF1 ``Switch``, as the gate is: an op fed by its untaken side is skipped in the
        same run (`tf.cond` would build functions no control edge from outside can gate).
        """
        return [
            variable.assign(control_flow_ops.switch(value, ok)[0], read_value=False)
            for variable, value in self.snapshots
        ]


def snapshot_forward_writes(graph: tf.Graph, tested: tf.Tensor) -> ForwardWrites:
    """Makes each write `tested` waits on (before the test: it cannot be gated) wait on a
    copy of its variable's value, which a bad step puts back; warns of those it cannot undo."""
    # By VarHandleOp (resource) or VariableV2 (ref); the first variable of an op wins.
    variables = {v.op: v for v in reversed(_variables(graph))}
    by_variable = _forward_writes(graph, tested, variables)
    if not by_variable:
        return ForwardWrites()
    snapshots, restored = [], set()
    with tf.name_scope("snapshots"):
        for variable_op, ops in by_variable.items():
            variable = variables[variable_op]
            # A copy: a write in place (a ref variable) must not change it.
            value = tf.raw_ops.DeepCopy(x=variable.value())
            _wait_on(value, ops)
            snapshots.append((variable, value))
            restored.update(ops)
    return ForwardWrites(tuple(snapshots), frozenset(restored))


def _forward_writes(
    graph: tf.Graph, tested: tf.Tensor, variables: Dict[tf.Operation, tf.Variable]
) -> Dict[tf.Operation, List[tf.Operation]]:
    """The writes `tested` waits on that a snapshot can undo, by variable op; an op calling
    a control-flow-v2 body (``slim.batch_norm`` with a tensor ``is_training``) stands for it."""
    initializers = _initializers(graph)
    ancestors = sorted(_ops.walk([tested.op]), key=lambda op: op.name)
    context = graph._get_control_flow_context()  # pylint: disable=protected-access
    by_variable: Dict[tf.Operation, List[tf.Operation]] = {}  # variable op -> its writes
    unlisted = (
        "the variable is in no variable collection; put it in GLOBAL_VARIABLES or LOCAL_VARIABLES"
    )

    def lost(op: tf.Operation, written: str, why: str) -> None:  # A snapshot cannot undo it.
        logging.warning(
            "slim_nanguard: %s writes %s in the forward pass, before the finiteness test, and "
            "cannot be undone on a bad step (%s), or make it an update op the loss does not "
            "wait on.",
            op.name,
            written,
            why,
        )

    for op in (op for op in ancestors if _ops.is_write(op) and op not in initializers):
        variable = variables.get(_written_variable(op))
        write_context = op._get_control_flow_context()  # pylint: disable=protected-access
        written = op.inputs[0].op.name if op.inputs else "a variable"
        if write_context is not context and _ops.in_while(write_context):
            lost(op, written, "it sits in a loop body of its own")
        elif variable is None:
            lost(op, written, unlisted)
        else:
            by_variable.setdefault(variable.op, []).append(op)
    for op in (op for op in ancestors if _body_graphs(op)):
        for handle in _handles_written_by(op):
            variable = variables.get(handle.op)
            if variable is None:
                lost(op, handle.op.name, unlisted)
            elif op not in by_variable.setdefault(variable.op, []):
                by_variable[variable.op].append(op)
    return by_variable


def _body_graphs(op: tf.Operation) -> list:
    """The function bodies of a control-flow-v2 op (cond_v2 and while_v2 keep them on it)."""
    bodies = (
        getattr(op, a, None) for a in ("_true_graph", "_false_graph", "_cond_graph", "_body_graph")
    )
    return [g for g in bodies if g is not None]


def _handles_written_by(op: tf.Operation) -> List[tf.Tensor]:
    """The resource handles (inputs of `op`) that a write in one of its bodies writes."""
    offset = 1 if op.type in ("If", "StatelessIf") else 0  # an If's first input is the test
    handles = []
    for body in _body_graphs(op):
        inner_inputs = list(body.inputs)
        for inner in body.get_operations():
            targets = [inner.inputs[0]] if _ops.is_write(inner) and inner.inputs else []
            if _body_graphs(inner):
                targets += _handles_written_by(inner)
            for target in targets:
                if target in inner_inputs:
                    handle = op.inputs[inner_inputs.index(target) + offset]
                    if handle not in handles:
                        handles.append(handle)
    return handles


# The accumulators (ref, resource, sparse): the ops that add one worker's gradient, and those
# that take the aggregate, with the output that holds its values (a sparse one's second).
_KINDS = ("", "Resource", "Sparse")
_ACCUMULATE_OP_TYPES = frozenset(f"{k}AccumulatorApplyGradient" for k in _KINDS)
_TAKE_OP_OUTPUTS = {f"{k}AccumulatorTakeGradient": int(k == "Sparse") for k in _KINDS}

AGGREGATE_CHECK_MESSAGE = (
    "slim_nanguard: the replicas' aggregated gradient is NaN or Inf "
    "(an overflow of finite gradients); no variable was updated"
)


def apply_sync_replicas(
    optimizer, grads_and_vars, global_step, gate: tf.Tensor
) -> Tuple[tf.Operation, List[tf.Operation]]:
    """A `SyncReplicasOptimizer`'s ``apply_gradients`` with its worker-side writes behind
    `gate`, and the chief's behind a check of the aggregate: ``(train_op, the ops gated)``."""
    if global_step is None:
        raise ValueError(
            "SyncReplicasOptimizer needs a global step: pass global_step (or "
            "leave the default) to create_train_op."
        )
    graph = gate.graph
    first_new_op = len(graph.get_operations())
    train_op = optimizer.apply_gradients(grads_and_vars, global_step=global_step)
    new_ops = graph.get_operations()[first_new_op:]
    gated = _wait_on(gate, [op for op in new_ops if op.type in _ACCUMULATE_OP_TYPES])
    if not gated:
        raise ValueError(
            "SyncReplicasOptimizer.apply_gradients made no accumulator op to "
            "gate; this TensorFlow version builds it differently."
        )
    taken = [op.outputs[_TAKE_OP_OUTPUTS[op.type]] for op in new_ops if op.type in _TAKE_OP_OUTPUTS]
    runner = optimizer.get_chief_queue_runner()
    if not taken or runner is None:
        return train_op, gated
    with tf.device(global_step.device), tf.name_scope("nanguard_aggregate"):
        # A sum may overflow over finite values: the verdict confirms a non-finite one exactly.
        check = tf.debugging.check_numerics(
            _exact_sums.Verdict(taken).checked, AGGREGATE_CHECK_MESSAGE
        )
    stop_at = {t.op for t in taken}  # The writes the queue runner waits on, after the take.
    writes = _ops.walk(list(runner.enqueue_ops), stop=stop_at.__contains__)
    return train_op, gated + _wait_on(
        check, [op for op in writes if op not in stop_at and _ops.is_write(op)]
    )
