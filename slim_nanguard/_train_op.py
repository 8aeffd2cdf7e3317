"""`create_train_op`: tf-slim's train op, with every variable update behind a finiteness gate.

Contract of a guarded train op (both modes)::

    loss, grads = forward_and_backward(batch)        # always runs
    sums = [loss] + [reduce_sum(g) for g in grads]   # one reduction per gradient
    ok = isfinite(sum(sums))                         # one scalar test, in-graph
    if not ok:                                       # a sum may overflow: confirm exactly
        kinds = [nan?, inf? of each of loss, grads]  # element-wise, on this branch only
        ok = all(kind == finite for kind in kinds)
    if ok:
        apply_gradients(grads); global_step += 1; run(update_ops)
    else:                                            # the bad step
        nothing is written: weights, optimizer slots and accumulators,
        global_step and the variables update_ops assign all keep their values
    return loss

How the bad branch shows itself depends on the mode:

* check_numerics mode (``check_numerics=True``): the test is a `tf.debugging.check_numerics`
  op, and ``session.run(train_op)`` raises its `InvalidArgumentError` before any update ran.
  `is_numerics_error` recognises it; `train`, `train_step` and `handle_numerics_error`
  apply the policy.
* hook mode (``check_numerics=False``): the test feeds a switch; the run returns normally with
  the non-finite loss, and `NanLossHook.after_run` applies the policy. The hook fetches one
  boolean per step; only the bad branch stores the sums for it to read. The hook (or
  `train_step`) marks each session it judges (`Guard.mark_judged`, once per session); a bad
  step in a session nothing judges (no hook: a loop that would skip it unseen) fails on the
  bad branch with an error naming what to add.

With a dynamic loss-scale optimizer
(`tf.compat.v1.train.experimental.MixedPrecisionLossScaleOptimizer`), a step whose loss is finite
but whose gradients overflowed while the loss scale is above its minimum is the scaler's
business, not a bad step: the scale's own update still runs (the scale drops, as the optimizer
intends), no other variable is written, the run returns normally in both modes, and the
`NanLossHook` records it as a ``loss_scale_overflow``. At the minimum scale it is a bad step.

A sum of a gradient is NaN or Inf when an element is, so a finite sum proves a gradient finite
and a good step pays one reduction per gradient instead of an element-wise `is_finite` and its
boolean tensor. Finite elements can also add up past the float range (1,000 elements of 1e36 in
float32), so a non-finite sum is confirmed element by element before the step is called bad
(`_verdict.Verdict`); that test also says what each value held (NaN, Inf), for the record.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import tensorflow as tf
from tensorflow.python.ops import control_flow_ops

from slim_nanguard import _capture
from slim_nanguard import _cluster
from slim_nanguard import _errors
from slim_nanguard import _guard
from slim_nanguard import _handles
from slim_nanguard import _log as logging
from slim_nanguard import _policy
from slim_nanguard import _verdict
from slim_nanguard._types import Mode

# Same value (and, for small ints, the same object) as tf_slim's sentinel, so a caller that
# passes `slim.learning._USE_GLOBAL_STEP` gets the same meaning.
_USE_GLOBAL_STEP = 0

GATE_OP = tf.compat.v1.train.Optimizer.GATE_OP

# Prefixes of the op types that write to a variable.
_WRITE_OP_PREFIXES = (
    "Assign",
    "Apply",
    "ResourceApply",
    "SparseApply",
    "ResourceSparseApply",
    "Scatter",
    "ResourceScatter",
    "StridedSliceAssign",
    "ResourceStridedSliceAssign",
)

GradsAndVars = List[Tuple[Optional[tf.Tensor], tf.Variable]]


def create_train_op(
    total_loss: tf.Tensor,
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
    config: Optional[_policy.GuardConfig] = None,
) -> tf.Tensor:
    """Drop-in for `tf_slim.learning.create_train_op` whose bad steps change nothing.

    The first twelve arguments are tf-slim 1.1.0's, in its order and with its meaning, and the
    return value is the same: a tensor that runs one update and evaluates to the loss, added to
    the ``TRAIN_OP`` collection. ``transform_grads_fn`` is the argument of
    `tf_slim.training.create_train_op`; it runs after the multipliers and the clipping.

    What runs on a step whose loss or any gradient is NaN or Inf: the forward and backward pass,
    one reduction per gradient and the test, then (the sums being non-finite) an element-wise
    test that confirms it and says what each value held. A step whose values are all finite
    trains, even when its sums overflow (a huge gradient). What does not run: every variable
    update. The
    trainable variables, the optimizer's slots and accumulators, ``global_step`` and every
    variable the ``update_ops`` assign (batch-norm moving mean and variance) keep their values,
    so any checkpoint saved afterwards holds the last good state. A finite step computes what
    tf-slim's train op computes. Writes the loss itself waits on (``slim.batch_norm`` with
    ``updates_collections=None``) run before the test: each waits on a copy of its variable's
    value, which a bad step writes back before the check raises (or on the hook-mode branch).

    * ``check_numerics=True`` (the default, as in slim): ``session.run(train_op)`` raises the
      `tf.errors.InvalidArgumentError` of a `tf.debugging.check_numerics` op;
      `is_numerics_error` tells it from any other error. `slim_nanguard.train`,
      `slim_nanguard.train_step` (for `tf_slim.learning.train`) and
      `slim_nanguard.handle_numerics_error` (for a loop of your own) apply the policy.
    * ``check_numerics=False`` (hook mode): the run returns the non-finite loss and a
      `NanLossHook` applies the policy in ``after_run``. The hook the train op needs is ready
      made: ``slim_nanguard.nan_hook(train_op)`` returns it (``get_guard(train_op)`` finds the
      guard registered with the graph), `slim_nanguard.train` attaches it by itself, and a
      ``NanLossHook(total_loss)`` built by hand finds the same guard and behaves the same.
      Variable writes built later under ``tf.control_dependencies([train_op])`` (an EMA of
      the weights) are gated too, when the hook begins; see `gate_writes_after`.

    Built inside a `tf.while_loop` (several steps per ``session.run``), each iteration is
    judged on its own and a bad one writes nothing: check_numerics mode raises there; in hook
    mode the other iterations train and the hook applies the policy once after the run.

    The policy (``nan_policy``) is the same in both modes: ``raise`` raises `NanLossError`,
    ``stop`` ends the loop cleanly, ``skip`` carries on with the next batch, ``rollback``
    restores the latest good checkpoint; see `GuardConfig`. When ``max_consecutive_bad_steps``
    bad steps come in a row under ``skip`` or ``rollback``, ``persistent_nan_policy`` decides
    (``raise``, ``stop`` or ``rollback``).

    Args:
      total_loss: Scalar floating-point `Tensor`, the total loss.
      optimizer: A `tf.compat.v1.train.Optimizer`; also a dynamic loss-scale one
        (`tf.compat.v1.train.experimental.MixedPrecisionLossScaleOptimizer`), whose overflow
        steps lower the scale and count as no bad step (see the module docstring).
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
      ValueError: A non-tensor, non-floating or non-scalar loss, an optimizer that is not a
        `tf.compat.v1.train.Optimizer` (a Keras one, for example), an empty
        ``variables_to_train``, a variable to train that is not trainable, or a policy argument
        out of range. The message names the argument and the value.
    """
    if config is None:
        config = _policy.GuardConfig(
            nan_policy=nan_policy,
            max_consecutive_bad_steps=max_consecutive_bad_steps,
            persistent_nan_policy=persistent_nan_policy,
            on_nan=on_nan,
            rollback_skip_batches=rollback_skip_batches,
            rollback_lr_factor=rollback_lr_factor,
            max_rollbacks=max_rollbacks,
        )
    elif not isinstance(config, _policy.GuardConfig):
        raise ValueError(f"config must be a slim_nanguard.GuardConfig; got {config!r}.")
    _check_loss(total_loss)
    _check_optimizer(optimizer)
    if clip_gradient_norm is None or clip_gradient_norm < 0:
        raise ValueError(
            f"clip_gradient_norm must be >= 0 (0 turns clipping off); got {clip_gradient_norm!r}."
        )

    graph = total_loss.graph
    with graph.as_default():
        if global_step is _USE_GLOBAL_STEP:
            global_step = tf.compat.v1.train.get_or_create_global_step()
        update_ops = _resolve_update_ops(graph, update_ops)
        variables_to_train = _resolve_variables(variables_to_train)
        loss_scale = _dynamic_loss_scale(optimizer)
        lr_scale = None
        if config.rollback_lr_factor != 1.0:
            lr_scale = _learning_rate_scale(optimizer)

        grads = optimizer.compute_gradients(
            total_loss,
            variables_to_train,
            gate_gradients=gate_gradients,
            aggregation_method=aggregation_method,
            colocate_gradients_with_ops=colocate_gradients_with_ops,
        )
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
            raise ValueError(
                f"total_loss {total_loss.name!r} has no gradient with respect to "
                "any of variables_to_train; check that the loss depends on them."
            )

        with tf.name_scope("nanguard"):
            present = [(g, v) for g, v in grads if g is not None]
            grad_sums = _gradient_sums(total_loss, [g for g, _ in present])
            # What each of the loss and the gradients held, stored when the sums' fast test
            # fails (exact: a finite value is never called NaN or Inf). Like the variable of
            # the sums below: in no collection, only read after a write.
            with _capture.guard_variable_scope(graph, grad_sums):
                kinds = tf.compat.v1.Variable(
                    tf.zeros([len(present) + 1], tf.int32),
                    trainable=False,
                    collections=[],
                    use_resource=True,
                    name="value_kinds",
                )
            verdict = _verdict.Verdict([total_loss] + [g for g, _ in present], grad_sums, kinds)
            kept, scaler = grad_sums, None
            if loss_scale is not None:
                scaler = _OverflowTest(grad_sums, loss_scale, verdict)
                kept = scaler.sums_and_scale
            # The sums are kept for the step that needs them, so that the culprits can be
            # named afterwards. The variable is in no collection: it is neither saved in
            # checkpoints nor initialised (it is only read after a write).
            # Made outside any loop the train op is built in, and on this worker: a
            # replica_device_setter would put it on the ps, shared by all workers.
            with _capture.guard_variable_scope(graph, grad_sums):
                diagnostics = tf.compat.v1.Variable(
                    tf.zeros(kept.shape, kept.dtype),
                    trainable=False,
                    collections=[],
                    use_resource=True,
                    name="gradient_sums",
                )
            # Writes the forward pass makes (slim.batch_norm with updates_collections=None)
            # run before the test: each variable's pre-step value is put back on a bad step.
            snapshots, restored = _snapshot_forward_writes(graph, grad_sums)
            autopsy = _autopsy_possible(config, graph, snapshots)
            if check_numerics:
                mode = Mode.CHECK_NUMERICS
                # Stored on every step, before the check raises.
                store = diagnostics.assign(kept, read_value=False)
                ready = [store]
                if snapshots:  # Put back before the check raises.
                    ok = verdict.ok
                    untaken, taken = control_flow_ops.switch(ok, ok)
                    with tf.control_dependencies(_restore(snapshots, ok)):
                        restored_done = tf.identity(untaken)
                    ready.append(control_flow_ops.merge([tf.identity(taken), restored_done])[0])
                # The batch, kept on a bad step only (for the autopsy): the check waits on a
                # merge of a good-step no-op and the bad step's stores.
                capture = _capture.keep_batch(total_loss, verdict.ok, enabled=autopsy)
                with tf.control_dependencies(ready + capture.control_inputs):
                    gate = tf.debugging.check_numerics(
                        verdict.checked if scaler is None else scaler.unless_overflow,
                        _unhandled_message(config, hook_mode=False),
                    )
                check_op_name, ok, bad_done, judged = gate.op.name, None, None, None
            else:
                mode = Mode.HOOK
                check_op_name = None
                ok = verdict.ok
                untaken, taken = control_flow_ops.switch(ok, ok)
                # Ops that wait on the pivot are dead, so skipped, when `ok` is False. (A
                # control edge straight from a Switch does not carry deadness; from an
                # Identity of its output it does, which is how tf.cond gates its branches.)
                gate = tf.identity(taken, name="pivot")
                # The other side runs on a bad step only: it stores the sums there, so that
                # a good step costs the hook one boolean fetch.
                bad_sums, _ = control_flow_ops.switch(kept, ok)
                store = diagnostics.assign(bad_sums, read_value=False)
                # Whatever applies the policy initialises `judged` in its session, once
                # (Guard.mark_judged: nothing to feed, no cost per step). A bad step in a
                # session where it is not (no hook: tf_slim.learning.train, a plain
                # session.run loop) fails here, naming what to add, instead of being skipped
                # unseen. The variable is in no collection: no initializer, Saver or
                # readiness check touches it. Both tests wait on the bad branch, so they run
                # on bad steps only.
                with _capture.guard_variable_scope(graph, grad_sums):
                    judged = tf.compat.v1.Variable(
                        True, trainable=False, collections=[], use_resource=True, name="judged"
                    )
                bad_pivot = tf.identity(untaken)
                with tf.control_dependencies([bad_pivot]):
                    is_judged = tf.raw_ops.VarIsInitializedOp(resource=judged.handle)
                passes = tf.logical_or(is_judged, bad_pivot)
                if scaler is not None:  # An overflow is the loss scale's business: it passes.
                    passes = tf.logical_or(passes, scaler.overflow)
                unjudged = tf.debugging.Assert(
                    passes,
                    [_unhandled_message(config, hook_mode=True)],
                    name="unjudged",
                )
                # The batch too, for the autopsy, on the same bad branch.
                capture = _capture.keep_batch(total_loss, ok, merge=False, enabled=autopsy)
                with tf.control_dependencies(
                    [store, unjudged] + list(capture.stores) + _restore(snapshots, ok)
                ):
                    bad_done = tf.identity(untaken)
                # What the hook fetches: `ok`, through the store on a bad step, so the sums
                # are there to read even after a run that did not fetch the train op.
                ok, _ = control_flow_ops.merge([gate, bad_done], name="all_finite_checked")
            finite_gate = None
            if scaler is not None:
                gate, finite_gate, ok, bad_done = scaler.gates(gate, ok, bad_done)

        first_new_op = len(graph.get_operations())
        with _scaled_learning_rate(optimizer, lr_scale):
            if _cluster.is_sync_replicas(optimizer):  # Its own init and chief ops stay ungated.
                grad_updates, gated = _cluster.apply_sync_replicas(
                    optimizer, grads, global_step, gate
                )
                new_ops = []
            else:
                with tf.control_dependencies([gate]):
                    grad_updates = optimizer.apply_gradients(grads, global_step=global_step)
                new_ops = graph.get_operations()[first_new_op:]
                gated = _gate_writes(graph, new_ops, gate)
        gated_updates = _gate_update_ops(update_ops, gate, restored)
        gated += gated_updates
        if finite_gate is not None:
            # The loss scale's own update runs on an overflow step; every other write does not.
            scale_ops = {v.op for v in _loss_scale_variables(loss_scale)}
            _gate_writes(
                graph, [op for op in new_ops if _written_variable(op) not in scale_ops], finite_gate
            )
            for op in gated_updates:
                op._add_control_input(finite_gate.op)  # pylint: disable=protected-access
        logging.vlog(1, "slim_nanguard: %d variable writes wait on the finiteness test", len(gated))

        with tf.name_scope("train_op"):
            with tf.control_dependencies(
                [grad_updates]
                + list(update_ops)
                + ([finite_gate] if finite_gate is not None else [])
            ):
                done = tf.identity(gate)
            if bad_done is not None:
                done, _ = control_flow_ops.merge([done, bad_done])
            with tf.control_dependencies([done]):
                train_op = tf.identity(total_loss, name="total_loss")

        train_ops = graph.get_collection_ref(tf.compat.v1.GraphKeys.TRAIN_OP)
        if train_op not in train_ops:
            train_ops.append(train_op)
        in_loop = _in_loop(graph)
        lr_scale_value, lr_scale_assign = _handles.lr_scale_setter(lr_scale, graph)
        handles = _handles.GraphHandles(
            mode=mode,
            train_op=train_op,
            loss=total_loss,
            global_step=global_step,
            grad_sums=grad_sums,
            value_kinds=kinds,
            ok=None if in_loop else ok,
            diagnostics=diagnostics,
            check_op_name=check_op_name,
            variable_names=tuple(v.op.name for _, v in present),
            lr_scale=lr_scale,
            lr_scale_value=lr_scale_value,
            lr_scale_assign=lr_scale_assign,
            loss_scale_floor=None if scaler is None else scaler.floor,
            in_loop=in_loop,
            judged=judged,
            # Hook mode: the tensor a write built later after the train op must also wait
            # on. With a loss-scale optimizer, the gate every write but the scale's waits on.
            pivot=(finite_gate if finite_gate is not None else gate if mode == Mode.HOOK else None),
            capture=capture,  # The batch a bad step keeps, for the autopsy.
            input_ops=tuple(_handles.find_input_ops(total_loss)),
        )
        saver = None
        if config.may_roll_back:  # the rollback policy, an escalation to it, or on_nan
            with tf.init_scope():
                saver = tf.compat.v1.train.Saver(max_to_keep=None, name="nanguard_rollback")
        _guard.register(_guard.Guard(config=config, handles=handles, saver=saver))
    return train_op


def _check_optimizer(optimizer) -> None:
    """Refuses an optimizer that is not a `tf.compat.v1.train.Optimizer` (nor works like one).

    Keras optimizers (Keras 3, tf-keras and its ``legacy`` ones) have other signatures and fail
    deep inside graph construction; one message names them all.
    """
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        return
    compute = getattr(optimizer, "compute_gradients", None)
    works_like_one = False
    if callable(compute) and callable(getattr(optimizer, "apply_gradients", None)):
        try:
            params = inspect.signature(compute).parameters
        except (TypeError, ValueError):
            params = {}
        works_like_one = "gate_gradients" in params or any(
            p.kind == p.VAR_KEYWORD for p in params.values()
        )
    if not works_like_one:
        kind = type(optimizer)
        keras = (
            " Keras optimizers (Keras 3, tf-keras, tf_keras.optimizers.legacy) do not work "
            "in a graph-mode TF-Slim train op."
            if "keras" in kind.__module__
            else ""
        )
        shown = (
            repr(optimizer)
            if kind.__module__ == "builtins"
            else f"{kind.__module__}.{kind.__qualname__}"
        )
        raise ValueError(
            f"optimizer must be a tf.compat.v1.train.Optimizer; got {shown}.{keras} Use the "
            "tf.compat.v1.train optimizer of the same algorithm, for example "
            "tf.compat.v1.train.GradientDescentOptimizer or tf.compat.v1.train.AdamOptimizer."
        )


def _dynamic_loss_scale(optimizer):
    """The `DynamicLossScale` of a loss-scale optimizer, or None.

    A loss-scale optimizer (`tf.compat.v1.train.experimental.MixedPrecisionLossScaleOptimizer`)
    wraps an inner optimizer and has a loss scale. Only a dynamic one skips the update of an
    overflow step and lowers the scale; a fixed scale is a constant factor, and an overflow
    under it is a bad step like any other.
    """
    from tensorflow.python.training.experimental import loss_scale as loss_scale_module

    loss_scale = getattr(optimizer, "_loss_scale", None)
    if hasattr(optimizer, "_optimizer") and isinstance(
        loss_scale, loss_scale_module.DynamicLossScale
    ):
        return loss_scale
    return None


def _loss_scale_variables(loss_scale) -> list:
    """The variables a loss scale updates (the current scale and its count of good steps)."""
    return list(getattr(loss_scale, "_weights", {}).values())


def _written_variable(op: tf.Operation) -> Optional[tf.Operation]:
    """The variable op (or handle op) a write op writes to, through cond's Switch ops."""
    if not op.inputs:
        return None
    tensor = op.inputs[0]
    while (
        tensor.op.type in ("Switch", "RefSwitch", "Identity", "RefIdentity", "Enter", "RefEnter")
        and tensor.op.inputs
    ):
        tensor = tensor.op.inputs[0]
    return tensor.op


class _OverflowTest:
    """The finiteness test of a train op whose optimizer scales the loss dynamically.

    A step is one of three kinds:

    * finite (loss and every gradient): every write runs;
    * an overflow: the loss (the user's, unscaled) is finite, a gradient is not, and the loss
      scale is above its floor. The optimizer skips the update and lowers the scale, so the
      scale's writes run and no other;
    * bad: any other non-finite step (a non-finite loss, or an overflow at the floor, where
      lowering the scale cannot help). No write runs.

    Attributes:
      floor: The smallest loss scale (`DynamicLossScale` never goes below 1).
      sums_and_scale: The loss, the sum of each gradient, then the loss scale of the step:
        what the guard keeps for the hook to read.
      finite: Scalar bool, the loss and all gradients finite.
      overflow: Scalar bool, an overflow step.
      unless_overflow: The sum check_numerics mode checks: finite on an overflow step.
    """

    floor = 1.0

    def __init__(self, grad_sums: tf.Tensor, loss_scale, verdict: _verdict.Verdict):
        # The scale this step multiplied the loss by. The scale's writes wait on this test.
        scale = tf.cast(loss_scale(), grad_sums.dtype)
        self.sums_and_scale = tf.concat(
            [grad_sums, tf.reshape(scale, [1])], 0, name="gradient_sums_and_loss_scale"
        )
        self.finite = verdict.ok
        self.overflow = tf.logical_and(
            tf.logical_not(self.finite),
            tf.logical_and(tf.math.is_finite(grad_sums[0]), scale > self.floor),
            name="loss_scale_overflow",
        )
        checked = verdict.checked
        self.unless_overflow = tf.where(self.overflow, tf.zeros_like(checked), checked)

    def gates(self, gate: tf.Tensor, ok: Optional[tf.Tensor], bad_done: Optional[tf.Tensor]):
        """Returns ``(gate, finite_gate, ok, bad_done)`` for a loss-scaled train op.

        ``gate`` is open unless the step is bad (the scale's writes wait on it), and
        ``finite_gate`` only on a finite step (every other write waits on it too). ``ok`` is
        what the hook fetches (False on an overflow step as on a bad one), and ``bad_done`` is
        live when the step is not finite, so the train op yields the loss on an overflow step.

        Args:
          gate: The mode's gate: the check op (check_numerics mode, which lets an overflow
            step through, see `unless_overflow`), or hook mode's pivot, open on finite steps.
          ok: Hook mode's fetched boolean, or None in check_numerics mode.
          bad_done: Hook mode's bad-branch marker, or None.
        """
        if ok is None:  # check_numerics mode
            untaken, taken = control_flow_ops.switch(self.finite, self.finite)
            finite_gate = tf.identity(taken, name="finite_pivot")
            ok, _ = control_flow_ops.merge(
                [finite_gate, tf.identity(untaken)], name="all_finite_checked"
            )
            # The check's output, live past the check on a step that is not finite.
            overflow_done, _ = control_flow_ops.switch(gate, self.finite, name="overflow_done")
            return gate, finite_gate, ok, overflow_done
        writable = tf.logical_or(self.finite, self.overflow)
        _, taken = control_flow_ops.switch(writable, writable)
        return tf.identity(taken, name="pivot_unless_bad"), gate, ok, bad_done


def _autopsy_possible(config: _policy.GuardConfig, graph: tf.Graph, snapshots) -> bool:
    """Whether the train op keeps a bad step's batch for an autopsy (`GuardConfig`).

    Not when the forward pass writes variables (`slim.batch_norm` with
    ``updates_collections=None``): a replay would run those writes again, with the bad batch,
    after the guard put their values back. Not inside a loop body either, whose tensors a
    replay cannot fetch. Either way the guard says so once, at build time.
    """
    if config.autopsy_max_steps <= 0:
        return False
    why = ""
    if snapshots:
        why = "its forward pass writes variables, which a replay would write again"
    elif _in_loop(graph):
        why = "it is built inside a loop, whose tensors a replay cannot fetch"
    if why:
        logging.warning("slim_nanguard: no autopsy of bad steps for this train op: %s.", why)
        return False
    return True


def _in_loop(graph: tf.Graph) -> bool:
    """Whether ops built now land in a loop body (a while_v2 function or a v1 while context)."""
    if getattr(graph, "building_function", False):
        return True
    context = graph._get_control_flow_context()  # pylint: disable=protected-access
    while context is not None:
        if context.IsWhileContext():
            return True
        context = context.outer_context
    return False


def _unhandled_message(config: _policy.GuardConfig, *, hook_mode: bool) -> str:
    """The error a bad step raises when no loop applies the policy (it names what to add).

    In check_numerics mode every bad step raises it, caught or not, and TensorFlow's runtime
    logs it too ("Local rendezvous is aborting with status: ..."), so the advice says that it
    holds for an error nothing caught; `_errors.caught_numerics_error` rewrites it for the
    cause of a `NanLossError` raised after the policy was applied.
    """
    rollback = config.needs_checkpoint_dir
    step_fn = "slim_nanguard.make_train_step(logdir)" if rollback else "slim_nanguard.train_step"
    hook = (
        "slim_nanguard.nan_hook(train_op, checkpoint_dir=logdir)"
        if rollback
        else "slim_nanguard.nan_hook(train_op)"
    )
    if hook_mode:
        return (
            f"slim_nanguard: NaN or Inf in the loss or a gradient, and no NanLossHook saw it, "
            f"so nan_policy={config.nan_policy} was not applied (no variable was updated). "
            f"Add hooks=[{hook}] to MonitoredTrainingSession or tf_slim.training.train; "
            f"with tf_slim.learning.train pass train_step_fn={step_fn}"
        )
    return (
        f"slim_nanguard: NaN or Inf in the loss or a gradient (no variable was updated). "
        f"{_errors.UNCAUGHT} nan_policy={config.nan_policy!r}: with "
        f"tf_slim.learning.train pass train_step_fn={step_fn}; in your own loop catch it "
        "with slim_nanguard.handle_numerics_error(sess, err); with tf_slim.training.train "
        f"build the train op with check_numerics=False and pass hooks=[{hook}]; or train "
        "with slim_nanguard.train"
    )


def _check_loss(total_loss) -> None:
    if not isinstance(total_loss, tf.Tensor):
        raise ValueError(
            f"total_loss must be a graph-mode tf.Tensor; got "
            f"{type(total_loss).__name__} {total_loss!r}."
        )
    if not total_loss.dtype.is_floating:
        raise ValueError(
            f"total_loss must be a floating-point tensor; {total_loss.name!r} has "
            f"dtype {total_loss.dtype.name}."
        )
    if total_loss.shape.rank not in (None, 0):
        raise ValueError(
            f"total_loss must be a scalar; {total_loss.name!r} has shape "
            f"{total_loss.shape}. Reduce it first (for example tf.reduce_mean)."
        )


def _resolve_update_ops(graph: tf.Graph, update_ops) -> list:
    global_update_ops = set(graph.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS))
    resolved = global_update_ops if update_ops is None else set(update_ops)
    if not global_update_ops.issubset(resolved):
        logging.warning(
            "update_ops in create_train_op does not contain all the update_ops in "
            "GraphKeys.UPDATE_OPS"
        )
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
            raise ValueError(
                "variables_to_train is empty: pass the variables to train, or "
                "None to train all trainable variables."
            )
    if not variables_to_train:
        raise ValueError(
            "the graph has no trainable variables: variables_to_train is None, "
            "so every trainable variable would be trained, and there is none."
        )
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

    The edge is added with TensorFlow's private ``Operation._add_control_input``: the ops
    are already built (by the optimizer), and no public API adds an input to one.
    """
    initializers = {
        v.initializer
        for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
        + graph.get_collection(tf.compat.v1.GraphKeys.LOCAL_VARIABLES)
    }
    gated = []
    for op in new_ops:
        if _is_write(op) and op not in initializers and gate.op not in op.control_inputs:
            op._add_control_input(gate.op)  # pylint: disable=protected-access
            gated.append(op)
    return gated


def gate_writes_after(guard: _guard.Guard) -> List[tf.Operation]:
    """Hook mode: gates the variable writes built after the train op that wait on it.

    The train op yields the loss on a bad step too (the hook and the caller see it), so an op
    made under ``tf.control_dependencies([train_op])``, such as an `ExponentialMovingAverage`
    of the weights in the pattern of its docstring, would still run. Each variable write
    downstream of the train op gets the pivot of the finiteness test as a control input, so
    it is skipped on a bad step, as the train op's own writes are. So is whatever waits on
    such a write: on a bad step, fetch the train op (or run the op as a target); a tensor
    computed after the write has no value then. `NanLossHook.begin` calls this, before the
    graph is finalized; calling it again gates only what was built since.

    This edits ops already built with TensorFlow's private ``Operation._add_control_input``
    (there is no public way to add an input to an existing op): each write gains a control
    input on the pivot, so a run that fetches that write alone now also runs the forward and
    backward pass and the finiteness test.

    Args:
      guard: The guard of a train op made by `create_train_op`.

    Returns:
      The write ops gated by this call. In hook mode they wait on the hook-mode pivot. In
      check_numerics mode a bad step raises before anything after the train op can run, so
      there is nothing to gate, except with a dynamic loss-scale optimizer: an overflow step
      does not raise, and the writes wait on the gate that lets only the loss scale's own
      update run on it.
    """
    pivot = guard.pivot
    if pivot is None:
        return []
    seen, stack, writes = set(), [guard.train_op.op], []
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        if _is_write(op) and pivot.op not in op.control_inputs:
            writes.append(op)
        stack.extend(c for t in op.outputs for c in t.consumers())
        stack.extend(op._control_outputs)  # pylint: disable=protected-access
    if writes and guard.train_op.graph.finalized:
        logging.warning(
            "slim_nanguard: %s write variables after %s, but the graph is "
            "finalized, so they also run on a bad step; do not finalize the graph "
            "before the session whose NanLossHook begins on it is made.",
            ", ".join(op.name for op in writes),
            guard.train_op.name,
        )
        return []
    gated = []
    for op in writes:
        op._add_control_input(pivot.op)  # pylint: disable=protected-access
        gated.append(op)
    if gated:
        logging.vlog(
            1,
            "slim_nanguard: %d variable writes after %s wait on its finiteness test",
            len(gated),
            guard.train_op.name,
        )
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


def _snapshot_forward_writes(graph: tf.Graph, grad_sums: tf.Tensor):
    """Takes each variable's value before the writes the loss or the gradients wait on.

    Such a write (a moving average that slim.batch_norm with ``updates_collections=None``
    updates inside the forward pass) runs before the finiteness test, so it cannot be gated;
    instead it is made to wait on a copy of its variable's value, which a bad step puts back.
    The wait is a control input added with TensorFlow's private
    ``Operation._add_control_input`` (the write is the user's, already built): the write
    then also runs the copy, which is all it changes.

    Returns:
      ``(snapshots, restored)``: a list of (variable, pre-step value) and the frozenset of
      the write ops covered. A write whose variable is not in the graph's variable
      collections (or that sits in a loop body of its own) is logged as one that cannot be
      undone.
    """
    initializers = {
        v.initializer
        for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
        + graph.get_collection(tf.compat.v1.GraphKeys.LOCAL_VARIABLES)
    }
    ancestors = _ancestors([grad_sums.op])
    writes = sorted(
        (op for op in ancestors if _is_write(op) and op not in initializers), key=lambda op: op.name
    )
    # A functional tf.cond or while loop (control flow v2: slim.batch_norm with a tensor
    # is_training) writes in a body of its own: it waits on the copies of what it writes.
    calls = {op: _handles_written_by(op) for op in ancestors if _body_graphs(op)}
    calls = {op: handles for op, handles in calls.items() if handles}
    if not writes and not calls:
        return [], frozenset()
    variables = {}
    for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES) + graph.get_collection(
        tf.compat.v1.GraphKeys.LOCAL_VARIABLES
    ):
        variables.setdefault(v.op, v)  # VarHandleOp (resource) or VariableV2 (ref)
    context = graph._get_control_flow_context()  # pylint: disable=protected-access
    by_variable: Dict[tf.Operation, List[tf.Operation]] = {}  # variable op -> its writes
    for op in writes:
        variable = variables.get(_source(op.inputs[0]).op) if op.inputs else None
        write_context = op._get_control_flow_context()  # pylint: disable=protected-access
        in_other_loop = write_context is not context and any(
            c.IsWhileContext() for c in _contexts(write_context)
        )
        if variable is None or in_other_loop:
            why = (
                "it sits in a loop body of its own"
                if in_other_loop
                else "the variable is in no variable collection; put it in GLOBAL_VARIABLES or "
                "LOCAL_VARIABLES"
            )
            logging.warning(
                "slim_nanguard: %s writes %s in the forward pass, before the "
                "finiteness test, and cannot be undone on a bad step (%s), or "
                "make it an update op the loss does not wait on.",
                op.name,
                op.inputs[0].op.name if op.inputs else "a variable",
                why,
            )
            continue
        by_variable.setdefault(variable.op, []).append(op)
    for op, handles in sorted(calls.items(), key=lambda item: item[0].name):
        for handle in handles:
            variable = variables.get(handle.op)
            if variable is None:
                logging.warning(
                    "slim_nanguard: %s writes %s in the forward pass, before the "
                    "finiteness test, and cannot be undone on a bad step (the "
                    "variable is in no variable collection).",
                    op.name,
                    handle.op.name,
                )
            elif op not in by_variable.setdefault(variable.op, []):
                by_variable[variable.op].append(op)
    snapshots, restored = [], set()
    with tf.name_scope("snapshots"):
        for variable_op, ops in by_variable.items():
            variable = variables[variable_op]
            # A copy: a write in place (a ref variable) must not change it.
            value = tf.raw_ops.DeepCopy(x=variable.value())
            for op in ops:
                op._add_control_input(value.op)  # pylint: disable=protected-access
            snapshots.append((variable, value))
            restored.update(ops)
    return snapshots, frozenset(restored)


def _source(tensor: tf.Tensor) -> tf.Tensor:
    """What a TF1 tf.cond or while loop passed in (through a Switch or an Enter), or what a
    function body (control flow v2) captured; else `tensor` itself."""
    while True:
        if tensor.op.type in (
            "Switch",
            "RefSwitch",
            "Identity",
            "RefIdentity",
            "Enter",
            "RefEnter",
        ):
            tensor = tensor.op.inputs[0]
            continue
        captured = {id(inner): outer for outer, inner in getattr(tensor.graph, "captures", ())}
        if id(tensor) not in captured:
            return tensor
        tensor = captured[id(tensor)]


def _body_graphs(op: tf.Operation) -> list:
    """The function bodies of a control-flow-v2 op (cond_v2 and while_v2 keep them on it)."""
    return [
        g
        for g in (
            getattr(op, attr, None)
            for attr in ("_true_graph", "_false_graph", "_cond_graph", "_body_graph")
        )
        if g is not None
    ]


def _handles_written_by(op: tf.Operation) -> List[tf.Tensor]:
    """The resource handles (inputs of `op`) that a write in one of its bodies writes."""
    offset = 1 if op.type in ("If", "StatelessIf") else 0  # an If's first input is the test
    handles = []
    for body in _body_graphs(op):
        inner_inputs = list(body.inputs)
        for inner in body.get_operations():
            targets = [inner.inputs[0]] if _is_write(inner) and inner.inputs else []
            if _body_graphs(inner):
                targets += _handles_written_by(inner)
            for target in targets:
                if target in inner_inputs:
                    handle = op.inputs[inner_inputs.index(target) + offset]
                    if handle not in handles:
                        handles.append(handle)
    return handles


def _contexts(context):
    while context is not None:
        yield context
        context = context.outer_context


def _restore(snapshots, ok: tf.Tensor) -> List[tf.Operation]:
    """The writes that put each snapshot back; they run only when `ok` is False.

    Built on the TF1 ``Switch`` of the private ``control_flow_ops`` module, as the train
    op's gate is: an op fed by the untaken side of a ``Switch`` is dead, so skipped, in the
    same run; `tf.cond` would build functions (control flow v2) that no control edge from
    outside can gate this way.
    """
    restores = []
    for variable, value in snapshots:
        bad_value, _ = control_flow_ops.switch(value, ok)
        restores.append(variable.assign(bad_value, read_value=False))
    return restores


def _gate_update_ops(
    update_ops: Sequence, gate: tf.Tensor, restored: frozenset = frozenset()
) -> list:
    """Makes the variable writes that `update_ops` run wait on `gate`.

    The writes are found by walking back from each update op, leaving out everything the
    finiteness test itself needs (the forward pass), which must run before it; those are
    put back on a bad step when they are among `restored`.

    The edges are added with TensorFlow's private ``Operation._add_control_input`` (the
    user's update ops are built before the train op). What it changes for the caller: a
    write an update op runs now waits on the finiteness test, so fetching that update op
    alone (outside the train op) also runs the forward and backward pass.
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
        if op in needed_by_gate and any(
            _is_write(w) and w not in restored for w in _ancestors([op])
        ):
            logging.warning(
                "slim_nanguard: update op %s feeds the loss, so it runs before the "
                "finiteness test and cannot be rolled back on a bad step.",
                op.name,
            )
    return gated


# Attributes through which an optimizer wraps another one: a loss-scale optimizer's
# ``_optimizer``, SyncReplicasOptimizer's ``_opt``. The learning rate is the inner one's.
_WRAPPED_OPTIMIZER_ATTRS = ("_optimizer", "_opt")
# Attributes a tf.compat.v1 optimizer keeps its learning rate in (Adam: ``_lr``).
_LEARNING_RATE_ATTRS = ("_learning_rate", "_lr")


def _rate_owner(optimizer) -> Tuple[object, str]:
    """The optimizer object that holds the learning rate, and the attribute it is in.

    Raises:
      ValueError: Neither `optimizer` nor one it wraps has a learning rate attribute.
    """
    for attr in _LEARNING_RATE_ATTRS:
        if getattr(optimizer, attr, None) is not None:
            return optimizer, attr
    for wrapped in _WRAPPED_OPTIMIZER_ATTRS:
        inner = getattr(optimizer, wrapped, None)
        if isinstance(inner, tf.compat.v1.train.Optimizer):
            return _rate_owner(inner)
    raise ValueError(
        f"rollback_lr_factor needs an optimizer with a learning rate to scale; "
        f"{type(optimizer).__name__} has neither _learning_rate nor _lr. Use "
        "rollback_lr_factor=1.0 with this optimizer."
    )


def _learning_rate_scale(optimizer) -> tf.Variable:
    """The variable the rollback policy lowers the learning rate with (one per graph).

    Raises:
      ValueError: The optimizer has no learning rate to scale (checked now, before any graph
        is built around it).
    """
    _rate_owner(optimizer)
    with tf.init_scope(), tf.compat.v1.variable_scope("nanguard", reuse=tf.compat.v1.AUTO_REUSE):
        return tf.compat.v1.get_variable(
            "learning_rate_scale",
            [],
            tf.float32,
            initializer=tf.compat.v1.ones_initializer(),
            trainable=False,
            use_resource=True,
        )


@contextlib.contextmanager
def _scaled_learning_rate(optimizer, scale: Optional[tf.Variable]) -> Iterator[None]:
    """While active, the optimizer's learning rate is multiplied by `scale`.

    A tf.compat.v1 optimizer reads its learning rate attribute when ``apply_gradients``
    builds the update (``_prepare``), and has no public way to change it. So the attribute
    (``_learning_rate`` or ``_lr``, of the innermost optimizer of a loss-scale or
    SyncReplicas wrapper) is set to ``rate * scale`` for the build only and put back after:
    the caller's optimizer is left as it was, and a second `create_train_op` with the same
    optimizer scales its rate once, not twice. A callable rate is called here, as the
    optimizer itself would. During the build the attribute holds the scaled rate: two threads
    building train ops with one optimizer object at once would see each other's (build a
    graph from one thread, as TensorFlow's graph building asks anyway).
    """
    if scale is None:
        yield
        return
    owner, attr = _rate_owner(optimizer)
    original = getattr(owner, attr)
    rate = tf.convert_to_tensor(original() if callable(original) else original)
    setattr(owner, attr, rate * tf.cast(scale, rate.dtype))
    try:
        yield
    finally:
        setattr(owner, attr, original)


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
        raise ValueError(
            f"gradient_multipliers must be a non-empty dict; got {gradient_multipliers!r}."
        )
    result = []
    for grad, var in grads_and_vars:
        key = var if var in gradient_multipliers else var.op.name
        if key in gradient_multipliers:
            if grad is None:
                raise ValueError(
                    f"gradient_multipliers names {var.op.name!r}, which has no gradient."
                )
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
            grad = tf.IndexedSlices(
                tf.clip_by_norm(grad.values, max_norm), grad.indices, grad.dense_shape
            )
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
        summaries.append(
            tf.compat.v1.summary.scalar(
                var.op.name + "/gradient_norm", tf.linalg.global_norm([values])
            )
        )
    return summaries
