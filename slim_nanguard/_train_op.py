"""`create_train_op`: tf-slim's train op, with every variable update behind a finiteness gate.

Contract of a guarded train op (both modes)::

    loss, grads = forward_and_backward(batch)        # always runs
    sums = [loss] + [reduce_sum(g) for g in grads]   # one reduction per gradient
    if all(isfinite(sums)):                          # one scalar test, in-graph
        apply_gradients(grads); global_step += 1; run(update_ops)
    else:                                            # the bad step
        nothing is written: weights, optimizer slots and accumulators,
        global_step and the variables update_ops assign all keep their values
    return loss

How the bad branch shows itself depends on the mode:

* check_numerics mode (``check_numerics=True``): the test is a `tf.debugging.check_numerics`
  op, and ``session.run(train_op)`` raises its `InvalidArgumentError` before any update ran.
  `is_numerics_error` recognises it; `train`, `train_step` and `Guard.handle_numerics_error`
  apply the policy.
* hook mode (``check_numerics=False``): the test feeds a switch; the run returns normally with
  the non-finite loss, and `NanLossHook.after_run` applies the policy. The hook fetches one
  boolean per step; only the bad branch stores the sums for it to read.

A sum of a gradient is NaN or Inf exactly when an element is (or when finite elements add up
past the float range, which a healthy step never does), so one reduction per gradient replaces
an element-wise `is_finite` and its boolean tensor.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import tensorflow as tf
from absl import logging
from tensorflow.python.ops import control_flow_ops

from slim_nanguard import _cluster
from slim_nanguard import _guard
from slim_nanguard import _policy

# Same value (and, for small ints, the same object) as tf_slim's sentinel, so a caller that
# passes `slim.learning._USE_GLOBAL_STEP` gets the same meaning.
_USE_GLOBAL_STEP = 0

GATE_OP = tf.compat.v1.train.Optimizer.GATE_OP

# Prefixes of the op types that write to a variable.
_WRITE_OP_PREFIXES = ("Assign", "Apply", "ResourceApply", "SparseApply", "ResourceSparseApply",
                      "Scatter", "ResourceScatter", "StridedSliceAssign",
                      "ResourceStridedSliceAssign")

GradsAndVars = List[Tuple[Optional[tf.Tensor], tf.Variable]]


def create_train_op(total_loss: tf.Tensor,
                    optimizer: tf.compat.v1.train.Optimizer,
                    global_step=_USE_GLOBAL_STEP,
                    update_ops: Optional[Iterable] = None,
                    variables_to_train: Optional[Sequence[tf.Variable]] = None,
                    clip_gradient_norm: float = 0,
                    summarize_gradients: bool = False,
                    gate_gradients: int = GATE_OP,
                    aggregation_method=None,
                    colocate_gradients_with_ops: bool = False,
                    gradient_multipliers: Optional[Dict] = None,
                    check_numerics: bool = True,
                    transform_grads_fn: Optional[Callable[[GradsAndVars], GradsAndVars]] = None,
                    *,
                    nan_policy: str = _policy.RAISE,
                    max_consecutive_bad_steps: int = 10,
                    persistent_nan_policy: str = _policy.RAISE,
                    on_nan: Optional[_policy.OnNanCallback] = None,
                    rollback_skip_batches: int = 1,
                    rollback_lr_factor: float = 1.0,
                    max_rollbacks: int = 3,
                    config: Optional[_policy.GuardConfig] = None) -> tf.Tensor:
    """Drop-in for `tf_slim.learning.create_train_op` whose bad steps change nothing.

    The first twelve arguments are tf-slim 1.1.0's, in its order and with its meaning, and the
    return value is the same: a tensor that runs one update and evaluates to the loss, added to
    the ``TRAIN_OP`` collection. ``transform_grads_fn`` is the argument of
    `tf_slim.training.create_train_op`; it runs after the multipliers and the clipping.

    What runs on a step whose loss or any gradient is NaN or Inf: the forward and backward pass,
    one reduction per gradient and the test. What does not: every variable update. The
    trainable variables, the optimizer's slots and accumulators, ``global_step`` and every
    variable the ``update_ops`` assign (batch-norm moving mean and variance) keep their values,
    so any checkpoint saved afterwards holds the last good state. A finite step computes what
    tf-slim's train op computes.

    * ``check_numerics=True`` (the default, as in slim): ``session.run(train_op)`` raises the
      `tf.errors.InvalidArgumentError` of a `tf.debugging.check_numerics` op;
      `is_numerics_error` tells it from any other error. `slim_nanguard.train`,
      `slim_nanguard.train_step` (for `tf_slim.learning.train`) and
      ``get_guard(train_op).handle_numerics_error`` apply the policy.
    * ``check_numerics=False`` (hook mode): the run returns the non-finite loss and a
      `NanLossHook` applies the policy in ``after_run``. The hook the train op needs is ready
      made: ``slim_nanguard.nan_hook(train_op)`` returns it (``get_guard(train_op)`` finds the
      guard registered with the graph), `slim_nanguard.train` attaches it by itself, and a
      ``NanLossHook(total_loss)`` built by hand finds the same guard and behaves the same.

    The policy (``nan_policy``) is the same in both modes: ``raise`` raises `NanLossError`,
    ``stop`` ends the loop cleanly, ``skip`` carries on with the next batch, ``rollback``
    restores the latest good checkpoint; see `GuardConfig`. When ``max_consecutive_bad_steps``
    bad steps come in a row under ``skip`` or ``rollback``, ``persistent_nan_policy`` decides
    (``raise``, ``stop`` or ``rollback``).

    Args:
      total_loss: Scalar floating-point `Tensor`, the total loss.
      optimizer: A `tf.compat.v1.train.Optimizer`.
      global_step: The global step variable; by default `get_or_create_global_step()`; None to
        not count steps.
      update_ops: Ops to run with each good step; None means the ``UPDATE_OPS`` collection.
      variables_to_train: Variables to train; None means all trainable variables.
      clip_gradient_norm: If > 0, each gradient is clipped to this norm.
      summarize_gradients: Whether to add histogram and norm summaries of each gradient
        (histograms show the finite values only, so a bad step cannot break the summary op).
      gate_gradients: As in `Optimizer.compute_gradients`.
      aggregation_method: As in `Optimizer.compute_gradients`.
      colocate_gradients_with_ops: As in `Optimizer.compute_gradients`.
      gradient_multipliers: Dict from `Variable` (or its op name) to a number or scalar
        `Tensor` that multiplies its gradient.
      check_numerics: True for check_numerics mode, False for hook mode.
      transform_grads_fn: Optional function from and to a list of (gradient, variable).
      nan_policy: ``"raise"``, ``"stop"``, ``"skip"`` or ``"rollback"``.
      max_consecutive_bad_steps: Under ``skip`` or ``rollback``, apply
        ``persistent_nan_policy`` once this many bad steps came in a row.
      persistent_nan_policy: ``"raise"`` (give up with `NanLossError`, the default),
        ``"stop"`` (end cleanly with the last good weights) or ``"rollback"`` (restore the
        latest good checkpoint, as the ``rollback`` policy does, within ``max_rollbacks``):
        what happens once ``max_consecutive_bad_steps`` bad steps came in a row, which means
        the weights, not a batch, went bad.
      on_nan: Optional callback ``fn(event) -> policy name or None`` called on each bad step.
      rollback_skip_batches: Batches to skip after a rollback.
      rollback_lr_factor: Learning-rate multiplier applied at each rollback (0 < f <= 1).
      max_rollbacks: Give up (raise) rather than roll back more often than this.
      config: A `GuardConfig`; overrides the seven policy arguments above when given.

    Returns:
      A `Tensor` that, when evaluated, computes the gradients, applies them when they are
      finite and returns the total loss.

    Raises:
      ValueError: A non-tensor, non-floating or non-scalar loss, an optimizer without
        ``compute_gradients``, a variable to train that is not trainable, or a policy argument
        out of range. The message names the argument and the value.
    """
    if config is None:
        config = _policy.GuardConfig(
            nan_policy=nan_policy, max_consecutive_bad_steps=max_consecutive_bad_steps,
            persistent_nan_policy=persistent_nan_policy, on_nan=on_nan,
            rollback_skip_batches=rollback_skip_batches, rollback_lr_factor=rollback_lr_factor,
            max_rollbacks=max_rollbacks)
    elif not isinstance(config, _policy.GuardConfig):
        raise ValueError(f"config must be a slim_nanguard.GuardConfig; got {config!r}.")
    _check_loss(total_loss)
    if not (hasattr(optimizer, "compute_gradients") and hasattr(optimizer, "apply_gradients")):
        raise ValueError("optimizer must be a tf.compat.v1.train.Optimizer (with "
                         f"compute_gradients and apply_gradients); got {optimizer!r}.")
    if clip_gradient_norm is None or clip_gradient_norm < 0:
        raise ValueError(f"clip_gradient_norm must be >= 0 (0 turns clipping off); got "
                         f"{clip_gradient_norm!r}.")

    graph = total_loss.graph
    with graph.as_default():
        if global_step is _USE_GLOBAL_STEP:
            global_step = tf.compat.v1.train.get_or_create_global_step()
        update_ops = _resolve_update_ops(graph, update_ops)
        variables_to_train = _resolve_variables(variables_to_train)
        lr_scale = None
        if config.rollback_lr_factor != 1.0:
            lr_scale = _scale_learning_rate(optimizer)

        grads = optimizer.compute_gradients(
            total_loss, variables_to_train, gate_gradients=gate_gradients,
            aggregation_method=aggregation_method,
            colocate_gradients_with_ops=colocate_gradients_with_ops)
        if gradient_multipliers:
            with tf.name_scope("multiply_grads"):
                grads = multiply_gradients(grads, gradient_multipliers)
        if clip_gradient_norm > 0:
            with tf.name_scope("clip_grads"):
                grads = clip_gradient_norms(grads, clip_gradient_norm)
        if transform_grads_fn is not None:
            grads = transform_grads_fn(grads)
        if summarize_gradients:
            with tf.name_scope("summarize_grads"):
                add_gradients_summaries(grads)
        if all(g is None for g, _ in grads):
            raise ValueError(f"total_loss {total_loss.name!r} has no gradient with respect to "
                             "any of variables_to_train; check that the loss depends on them.")

        with tf.name_scope("nanguard"):
            present = [(g, v) for g, v in grads if g is not None]
            grad_sums = _gradient_sums(total_loss, [g for g, _ in present])
            # The sums are kept for the step that needs them, so that the culprits can be
            # named afterwards. The variable is in no collection: it is neither saved in
            # checkpoints nor initialised (it is only read after a write).
            # Colocated with the sums, so on this worker: a replica_device_setter would
            # put a variable on the ps, shared by all workers, which overwrite each other's.
            with tf.compat.v1.colocate_with(grad_sums.op):
                diagnostics = tf.compat.v1.Variable(
                    tf.zeros_like(grad_sums), trainable=False, collections=[],
                    use_resource=True, name="gradient_sums")
            if check_numerics:
                mode = _guard.MODE_CHECK_NUMERICS
                # Stored on every step, before the check raises.
                store = diagnostics.assign(grad_sums, read_value=False)
                with tf.control_dependencies([store]):
                    gate = tf.debugging.check_numerics(
                        tf.reduce_sum(grad_sums),
                        "slim_nanguard: loss or gradient is NaN or Inf; no variable was updated")
                check_op_name, ok, bad_done = gate.op.name, None, None
            else:
                mode = _guard.MODE_HOOK
                check_op_name = None
                ok = tf.math.is_finite(tf.reduce_sum(grad_sums), name="all_finite")
                untaken, taken = control_flow_ops.switch(ok, ok)
                # Ops that wait on the pivot are dead, so skipped, when `ok` is False. (A
                # control edge straight from a Switch does not carry deadness; from an
                # Identity of its output it does, which is how tf.cond gates its branches.)
                gate = tf.identity(taken, name="pivot")
                # The other side runs on a bad step only: it stores the sums there, so that
                # a good step costs the hook one boolean fetch.
                bad_sums, _ = control_flow_ops.switch(grad_sums, ok)
                store = diagnostics.assign(bad_sums, read_value=False)
                with tf.control_dependencies([store]):
                    bad_done = tf.identity(untaken)
                # What the hook fetches: `ok`, through the store on a bad step, so the sums
                # are there to read even after a run that did not fetch the train op.
                ok, _ = control_flow_ops.merge([gate, bad_done], name="all_finite_checked")

        first_new_op = len(graph.get_operations())
        if _cluster.is_sync_replicas(optimizer):  # Its own init and chief ops stay ungated.
            grad_updates, gated = _cluster.apply_sync_replicas(optimizer, grads, global_step,
                                                               gate)
        else:
            with tf.control_dependencies([gate]):
                grad_updates = optimizer.apply_gradients(grads, global_step=global_step)
            gated = _gate_writes(graph, graph.get_operations()[first_new_op:], gate)
        gated += _gate_update_ops(update_ops, gate)
        logging.vlog(1, "slim_nanguard: %d variable writes wait on the finiteness test",
                     len(gated))

        with tf.name_scope("train_op"):
            with tf.control_dependencies([grad_updates] + list(update_ops)):
                done = tf.identity(gate)
            if bad_done is not None:
                done, _ = control_flow_ops.merge([done, bad_done])
            with tf.control_dependencies([done]):
                train_op = tf.identity(total_loss, name="total_loss")

        train_ops = graph.get_collection_ref(tf.compat.v1.GraphKeys.TRAIN_OP)
        if train_op not in train_ops:
            train_ops.append(train_op)
        guard = _guard.Guard(
            config=config, mode=mode, train_op=train_op, loss=total_loss,
            global_step=global_step, grad_sums=grad_sums, ok=ok, diagnostics=diagnostics,
            check_op_name=check_op_name, variable_names=[v.op.name for _, v in present],
            lr_scale=lr_scale)
        if config.may_roll_back:  # the rollback policy, an escalation to it, or on_nan
            guard.saver = tf.compat.v1.train.Saver(max_to_keep=None, name="nanguard_rollback")
        _guard.register(guard)
    return train_op


def _check_loss(total_loss) -> None:
    if not isinstance(total_loss, tf.Tensor):
        raise ValueError(f"total_loss must be a graph-mode tf.Tensor; got "
                         f"{type(total_loss).__name__} {total_loss!r}.")
    if not total_loss.dtype.is_floating:
        raise ValueError(f"total_loss must be a floating-point tensor; {total_loss.name!r} has "
                         f"dtype {total_loss.dtype.name}.")
    if total_loss.shape.rank not in (None, 0):
        raise ValueError(f"total_loss must be a scalar; {total_loss.name!r} has shape "
                         f"{total_loss.shape}. Reduce it first (for example tf.reduce_mean).")


def _resolve_update_ops(graph: tf.Graph, update_ops) -> list:
    global_update_ops = set(graph.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS))
    resolved = global_update_ops if update_ops is None else set(update_ops)
    if not global_update_ops.issubset(resolved):
        logging.warning("update_ops in create_train_op does not contain all the update_ops in "
                        "GraphKeys.UPDATE_OPS")
    # A stable order, so that two builds of the same graph are the same.
    return sorted(resolved, key=lambda u: getattr(u, "name", str(u)))


def _resolve_variables(variables_to_train):
    trainable = tf.compat.v1.trainable_variables()
    if variables_to_train is None:
        variables_to_train = trainable
    else:
        variables_to_train = list(variables_to_train)
        for v in variables_to_train:
            if not (getattr(v, "trainable", False) or v in trainable):
                raise ValueError(f"variables_to_train holds {v.name!r}, which is not trainable.")
    if not variables_to_train:
        raise ValueError("variables_to_train is empty: the graph has no trainable variables.")
    return variables_to_train


def _gradient_sums(loss: tf.Tensor, grads: Sequence) -> tf.Tensor:
    """One vector: the loss, then the sum of each gradient (NaN/Inf iff one element is)."""
    wide = any(g.dtype.base_dtype == tf.float64 for g in grads) or loss.dtype == tf.float64
    dtype = tf.float64 if wide else tf.float32
    parts = [tf.cast(loss, dtype)]
    for g in grads:
        values = g.values if isinstance(g, tf.IndexedSlices) else g
        if values.dtype.base_dtype != dtype:
            # Half-precision sums overflow long before the gradient does: widen first.
            values = tf.cast(values, dtype)
        parts.append(tf.reduce_sum(values))
    return tf.stack(parts, name="gradient_sums")


def _is_write(op: tf.Operation) -> bool:
    return op.type.startswith(_WRITE_OP_PREFIXES)


def _gate_writes(graph: tf.Graph, new_ops: Sequence[tf.Operation], gate: tf.Tensor) -> list:
    """Makes every variable write among `new_ops` wait on `gate`.

    `apply_gradients` runs under ``control_dependencies([gate])``, but TensorFlow drops that
    edge from ops that already consume an op made in the block, and graph rewrites may fold
    such producers away. An explicit edge on each write keeps the gate whatever the optimizer.
    Variable initialisers (of slots made on the fly) are left alone.
    """
    initializers = {v.initializer for v in graph.get_collection(
        tf.compat.v1.GraphKeys.GLOBAL_VARIABLES) + graph.get_collection(
            tf.compat.v1.GraphKeys.LOCAL_VARIABLES)}
    gated = []
    for op in new_ops:
        if _is_write(op) and op not in initializers and gate.op not in op.control_inputs:
            op._add_control_input(gate.op)  # pylint: disable=protected-access
            gated.append(op)
    return gated


def _ancestors(roots: Iterable[tf.Operation]) -> set:
    seen, stack = set(), list(roots)
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return seen


def _as_op(item) -> Optional[tf.Operation]:
    if isinstance(item, tf.Operation):
        return item
    op = getattr(item, "op", None)
    return op if isinstance(op, tf.Operation) else None


def _gate_update_ops(update_ops: Sequence, gate: tf.Tensor) -> list:
    """Makes the variable writes that `update_ops` run wait on `gate`.

    The writes are found by walking back from each update op, leaving out everything the
    finiteness test itself needs (the forward pass), which must run before it.
    """
    roots = [op for op in (_as_op(u) for u in update_ops) if op is not None]
    if not roots:
        return []
    needed_by_gate = _ancestors([gate.op])
    gated = []
    for op in _ancestors(roots) - needed_by_gate:
        if _is_write(op) and gate.op not in op.control_inputs:
            op._add_control_input(gate.op)  # pylint: disable=protected-access
            gated.append(op)
    for op in roots:
        if op in needed_by_gate:
            logging.warning("slim_nanguard: update op %s feeds the loss, so it runs before the "
                            "finiteness test and cannot be rolled back on a bad step.", op.name)
    return gated


def _scale_learning_rate(optimizer) -> tf.Variable:
    """Multiplies the optimizer's learning rate by a variable the rollback policy can lower."""
    for attr in ("_learning_rate", "_lr"):
        if hasattr(optimizer, attr) and getattr(optimizer, attr) is not None:
            break
    else:
        raise ValueError(
            f"rollback_lr_factor needs an optimizer with a learning rate to scale; "
            f"{type(optimizer).__name__} has neither _learning_rate nor _lr. Use "
            "rollback_lr_factor=1.0 with this optimizer.")
    with tf.compat.v1.variable_scope("nanguard", reuse=tf.compat.v1.AUTO_REUSE):
        scale = tf.compat.v1.get_variable("learning_rate_scale", [], tf.float32,
                                          initializer=tf.compat.v1.ones_initializer(),
                                          trainable=False, use_resource=True)
    rate = getattr(optimizer, attr)
    if callable(rate):
        rate = rate()
    rate = tf.convert_to_tensor(rate)
    setattr(optimizer, attr, rate * tf.cast(scale, rate.dtype))
    return scale


def multiply_gradients(grads_and_vars: GradsAndVars, gradient_multipliers: Dict) -> GradsAndVars:
    """Multiplies the gradients of the variables named in `gradient_multipliers`.

    Same contract as `tf_slim.learning.multiply_gradients`, on current TensorFlow.

    Args:
      grads_and_vars: A list of (gradient, variable).
      gradient_multipliers: Dict from `Variable` or variable op name to a number or tensor.

    Returns:
      The list with the named gradients scaled.

    Raises:
      ValueError: If the arguments have the wrong type, or a named variable has no gradient.
    """
    if not isinstance(grads_and_vars, list):
        raise ValueError("grads_and_vars must be a list of (gradient, variable).")
    if not isinstance(gradient_multipliers, dict) or not gradient_multipliers:
        raise ValueError(f"gradient_multipliers must be a non-empty dict; got "
                         f"{gradient_multipliers!r}.")
    result = []
    for grad, var in grads_and_vars:
        key = var if var in gradient_multipliers else var.op.name
        if key in gradient_multipliers:
            if grad is None:
                raise ValueError(f"gradient_multipliers names {var.op.name!r}, which has no "
                                 "gradient.")
            multiplier = gradient_multipliers[key]
            if not isinstance(multiplier, tf.Tensor):
                multiplier = tf.constant(multiplier, dtype=grad.dtype)
            if isinstance(grad, tf.IndexedSlices):
                grad = tf.IndexedSlices(grad.values * multiplier, grad.indices, grad.dense_shape)
            else:
                grad = grad * multiplier
        result.append((grad, var))
    return result


def clip_gradient_norms(grads_and_vars: GradsAndVars, max_norm: float) -> GradsAndVars:
    """Clips each gradient to `max_norm` (as `tf_slim.learning.clip_gradient_norms`)."""
    result = []
    for grad, var in grads_and_vars:
        if isinstance(grad, tf.IndexedSlices):
            grad = tf.IndexedSlices(tf.clip_by_norm(grad.values, max_norm), grad.indices,
                                    grad.dense_shape)
        elif grad is not None:
            grad = tf.clip_by_norm(grad, max_norm)
        result.append((grad, var))
    return result


def add_gradients_summaries(grads_and_vars: GradsAndVars) -> List[tf.Tensor]:
    """Adds a histogram and a norm summary of each gradient.

    As `tf_slim.learning.add_gradients_summaries`, except that the histogram shows only the
    finite values: TensorFlow's histogram op raises on NaN, which would turn a skipped step
    into a crash.
    """
    summaries = []
    for grad, var in grads_and_vars:
        if grad is None:
            logging.info("Var %s has no gradient", var.op.name)
            continue
        values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
        finite = tf.boolean_mask(values, tf.math.is_finite(values))
        summaries.append(tf.compat.v1.summary.histogram(var.op.name + "/gradient", finite))
        summaries.append(tf.compat.v1.summary.scalar(var.op.name + "/gradient_norm",
                                                     tf.linalg.global_norm([values])))
    return summaries
