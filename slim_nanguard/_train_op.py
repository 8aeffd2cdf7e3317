"""`create_train_op`: tf-slim's train op, with every variable update behind a finiteness gate.

Contract of a guarded train op (both modes)::

    loss, grads = forward_and_backward(batch)        # always runs
    total = loss + l2_loss(stack(same_shape_grads))  # one reduction per stack of grads
    ok = isfinite(total)                             # one scalar test, in-graph
    if not ok:                                       # squares may overflow: confirm exactly
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

How it is built, one module per idea: `_parity` does what tf-slim's train op does (the
argument checks, the gradients, multipliers, clipping and summaries); `_finiteness` builds the
per-step test and puts it in front of the writes in the mode's way; `_gating` makes every
variable write wait on it (and puts back what the forward pass wrote); `_learning_rate` holds
the scale a rollback lowers the learning rate by. `create_train_op` calls them in that order
and registers the `Guard` that the loops and the hook find.

A square is NaN or Inf when its element is, so a finite sum of squares proves the gradients
finite: a good step pays one ``L2Loss`` per stack of same-shape gradients (and one ``AddN``
with the loss) instead of an element-wise `is_finite` and its boolean tensor, and the same sum
gives the global gradient norm (`_verdict.Verdict.global_norm`). Finite squares can also add up
past the float range (1,000 elements of 1e36 in float32), so a non-finite sum is confirmed
element by element before the step is called bad (`_verdict.Verdict`); that test also says what
each value held (NaN, Inf), and only that branch sums each gradient for the record.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, Optional, Sequence

import tensorflow as tf

from slim_nanguard import _checkpoints
from slim_nanguard import _finiteness
from slim_nanguard import _gating
from slim_nanguard import _guard
from slim_nanguard import _handles
from slim_nanguard import _learning_rate
from slim_nanguard import _log as logging
from slim_nanguard import _ops
from slim_nanguard import _parity
from slim_nanguard import _policy
from slim_nanguard import _reasons

# The keyword-only arguments of `create_train_op` that are `GuardConfig` fields.
_POLICY_ARGUMENTS = (
    "nan_policy",
    "max_consecutive_bad_steps",
    "persistent_nan_policy",
    "on_nan",
    "rollback_skip_batches",
    "rollback_lr_factor",
    "max_rollbacks",
    "spike_policy",
    "spike_sigma",
    "spike_warmup_steps",
    "spike_level_shift_steps",
    "reasons",
)


def create_train_op(
    total_loss: tf.Tensor,
    optimizer: tf.compat.v1.train.Optimizer,
    global_step=_parity.USE_GLOBAL_STEP,
    update_ops: Optional[Iterable] = None,
    variables_to_train: Optional[Sequence[tf.Variable]] = None,
    clip_gradient_norm: float = 0,
    summarize_gradients: bool = False,
    gate_gradients: int = _parity.GATE_OP,
    aggregation_method=None,
    colocate_gradients_with_ops: bool = False,
    gradient_multipliers: Optional[Dict] = None,
    check_numerics: bool = True,
    transform_grads_fn: Optional[Callable[[_parity.GradsAndVars], _parity.GradsAndVars]] = None,
    *,
    nan_policy: str = _policy.RAISE,
    max_consecutive_bad_steps: int = 10,
    persistent_nan_policy: str = _policy.RAISE,
    on_nan: Optional[_policy.OnNanCallback] = None,
    rollback_skip_batches: int = 1,
    rollback_lr_factor: float = 1.0,
    max_rollbacks: int = 3,
    spike_policy: Optional[str] = None,
    spike_sigma: float = 6.0,
    spike_warmup_steps: int = 20,
    spike_level_shift_steps: int = 8,
    reasons: Sequence[_reasons.Reason] = (),
    config: Optional[_policy.GuardConfig] = None,
) -> tf.Tensor:
    """Drop-in for `tf_slim.learning.create_train_op` whose bad steps change nothing.

    The first twelve arguments are tf-slim 1.1.0's, in its order and with its meaning, and the
    return value is the same: a tensor that runs one update and evaluates to the loss, added to
    the ``TRAIN_OP`` collection. ``transform_grads_fn`` is the argument of
    `tf_slim.training.create_train_op`; it runs after the multipliers and the clipping.

    What runs on a step whose loss or any gradient is NaN or Inf: the forward and backward pass,
    one sum-of-squares reduction per stack of same-shape gradients and the test, then (that
    sum being non-finite) an element-wise test that confirms it and says what each value held,
    and the sum of each gradient for the record. A step whose values are all finite
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
      spike_policy: The policy for a spike step, or None (the default: no spike test, the
        same graph as without it). A spike step has a finite loss and finite gradients, but
        its loss or its global gradient norm is more than ``spike_sigma`` deviations above
        those of the last 128 accepted steps (of their logarithms), once
        ``spike_warmup_steps`` steps were accepted. It changes no variable, as a non-finite
        step, does not enter the statistics, and counts toward
        ``max_consecutive_bad_steps``. Not inside a `tf.while_loop` (a ValueError says
        so). The statistics are variables of the graph (``nanguard_spike/``): saved in
        checkpoints and restored by a rollback.
        The norm tested is that of the gradients the optimizer applies: after
        ``gradient_multipliers``, ``clip_gradient_norm`` and ``transform_grads_fn`` (a
        clipped gradient's spike shows less in it; the loss's does not).
      spike_sigma: How many deviations above the mean make a spike.
      spike_warmup_steps: Accepted steps before a step can be a spike (2 to 128).
      spike_level_shift_steps: Spikes in a row that hold together make a new level of
        training, not spikes: the guard says so, starts its statistics again from them and
        carries on (with ``spike_policy="skip"``; `GuardConfig.spike_level_shift_steps`;
        0: never).
      reasons: More reasons to reject a step (`slim_nanguard.Reason` objects, each with its
        policy), judged after non-finite values and the spike test.
      config: A `GuardConfig`; overrides the twelve policy arguments above when given.

    Returns:
      A `Tensor` that, when evaluated, computes the gradients, applies them when they are
      finite and returns the total loss.

    Raises:
      ValueError: A non-tensor, non-floating or non-scalar loss, an optimizer that is not a
        `tf.compat.v1.train.Optimizer` (a Keras one, for example), an empty
        ``variables_to_train``, a variable to train that is not trainable, a policy argument
        out of range, or a spike policy for a train op built in a loop body. The message
        names the argument and the value.
    """
    # First, while the locals are the arguments.
    policy = {name: value for name, value in locals().items() if name in _POLICY_ARGUMENTS}
    config = _guard_config(config, **policy)
    _parity.check_arguments(total_loss, optimizer, clip_gradient_norm)
    graph = total_loss.graph
    _check_reasons_outside_loops(config, graph)
    with graph.as_default():
        if global_step is _parity.USE_GLOBAL_STEP:
            global_step = tf.compat.v1.train.get_or_create_global_step()
        update_ops = _parity.resolve_update_ops(graph, update_ops)
        variables_to_train = _parity.resolve_variables(variables_to_train)
        # Before the gradients, as the graph always had them.
        scales = (
            _finiteness.dynamic_loss_scale(optimizer),
            _learning_rate.scale_variable(optimizer, config.rollback_lr_factor),
        )
        grads = _parity.compute_gradients(
            total_loss,
            optimizer,
            variables_to_train,
            gate_gradients=gate_gradients,
            aggregation_method=aggregation_method,
            colocate_gradients_with_ops=colocate_gradients_with_ops,
            gradient_multipliers=gradient_multipliers,
            clip_gradient_norm=clip_gradient_norm,
            transform_grads_fn=transform_grads_fn,
            summarize_gradients=summarize_gradients,
        )
        return _gated(
            config, total_loss, optimizer, grads, global_step, update_ops, *scales, check_numerics
        )


def _gated(
    config, total_loss, optimizer, grads, global_step, update_ops, loss_scale, lr_scale, check
):
    """The train op of `grads`: the test, the mode's gate (check_numerics mode if `check`),
    every write behind it, registered with its guard (in the loss's graph)."""
    check_numerics = check
    test, forward, gate = _test_and_gate(
        config, total_loss, grads, loss_scale, check_numerics=check_numerics
    )
    with _learning_rate.scaled(optimizer, lr_scale):
        grad_updates = _gating.apply_gradients(
            optimizer,
            grads,
            global_step,
            gate.gate,
            update_ops=update_ops,
            restored=forward.restored,
            finite_gate=gate.finite_gate,
            unless_bad=_finiteness.loss_scale_variables(loss_scale),
        )
    writes = [grad_updates] + list(update_ops)
    if test.reasons:  # An accepted step writes its reasons' state.
        opened = gate.gate if gate.finite_gate is None else gate.finite_gate
        with tf.control_dependencies([opened]):
            writes += test.accepted_writes()
    train_op = gate.loss_after(total_loss, writes)
    _register(config, test, gate, train_op, total_loss, global_step, lr_scale)
    return train_op


def _check_reasons_outside_loops(config: _policy.GuardConfig, graph: tf.Graph) -> None:
    """Raises ValueError for a reason to reject (a spike policy) on a train op built in a
    loop body."""
    reasons = config.all_reasons
    if reasons and _in_loop(graph):
        names = ", ".join(r.policy_name for r in reasons)
        raise ValueError(
            f"{names} needs a train op built outside any tf.while_loop or function body "
            "(the loop's hook cannot see a rejected iteration); build it outside the loop, or "
            "leave it unset there."
        )


def _test_and_gate(
    config: _policy.GuardConfig,
    total_loss: tf.Tensor,
    grads,
    loss_scale,
    *,
    check_numerics: bool,
):
    """The step's test (`_finiteness.StepTest`), the forward pass's writes it puts back on a
    bad step, and the mode's gate, in the ``nanguard`` name scope: ``(test, forward, gate)``."""
    graph = total_loss.graph
    with tf.name_scope("nanguard"):
        reasons = config.all_reasons
        test = _finiteness.StepTest(total_loss, grads, loss_scale, reasons)
        # Writes the forward pass makes (slim.batch_norm with updates_collections=None) run
        # before the test: each variable's pre-step value is put back on a bad step.
        forward = _gating.snapshot_forward_writes(graph, test.grad_sums)
        gate = _finiteness.build_gate(
            test,
            config,
            check_numerics=check_numerics,
            forward=forward,
            loss=total_loss,
            autopsy=_autopsy_possible(config, graph, forward.snapshots),
        )
    return test, forward, gate


def _guard_config(config: Optional[_policy.GuardConfig], **policy) -> _policy.GuardConfig:
    """`config`, or when None the `GuardConfig` of `create_train_op`'s policy arguments.

    Raises:
      ValueError: `config` is not a `GuardConfig`, or a policy argument is out of range.
    """
    if config is None:
        return _policy.GuardConfig(**policy)
    if not isinstance(config, _policy.GuardConfig):
        raise ValueError(f"config must be a slim_nanguard.GuardConfig; got {config!r}.")
    return config


def _register(
    config: _policy.GuardConfig,
    test: _finiteness.StepTest,
    gate: _finiteness.Gate,
    train_op: tf.Tensor,
    loss: tf.Tensor,
    global_step,
    lr_scale: Optional[tf.Variable],
) -> None:
    """Registers `train_op` with its graph: in the ``TRAIN_OP`` collection (as tf-slim does),
    and its `Guard`, what the loops and the hook read.

    With a policy that may roll back (the rollback policy, an escalation to it, or
    ``on_nan``), the guard gets the saver every rollback restores with.
    """
    graph = train_op.graph
    train_ops = graph.get_collection_ref(tf.compat.v1.GraphKeys.TRAIN_OP)
    if train_op not in train_ops:
        train_ops.append(train_op)
    in_loop = _in_loop(graph)
    lr_scale_value, lr_scale_assign = _handles.lr_scale_setter(lr_scale, graph)
    handles = _handles.GraphHandles(
        mode=gate.mode,
        train_op=train_op,
        loss=loss,
        global_step=global_step,
        grad_sums=test.grad_sums,
        value_kinds=test.kinds,
        kinds_read=_handles.kinds_read(test.kinds, bool(test.reasons)),
        ok=None if in_loop else gate.ok,
        diagnostics=test.diagnostics,
        check_op_name=gate.check_op_name,
        variable_names=tuple(v.op.name for _, v in test.present),
        lr_scale=lr_scale,
        lr_scale_value=lr_scale_value,
        lr_scale_assign=lr_scale_assign,
        loss_scale_floor=None if test.scaler is None else test.scaler.floor,
        in_loop=in_loop,
        judged=gate.judged,
        # Hook mode: the tensor a write built later after the train op must also wait on.
        pivot=gate.pivot,
        capture=gate.capture,  # The batch a bad step keeps, for the autopsy.
        input_ops=tuple(_handles.find_input_ops(loss)),
        report=test.report,
        reasons=test.reasons,
        reason_handles={r.name: t.handles for r, t in zip(test.reasons, test.tests)},
        optional_variables=tuple(v for v in (lr_scale, *test.reason_variables()) if v is not None),
    )
    saver = None
    if config.may_roll_back:
        with tf.init_scope():
            saver = tf.compat.v1.train.Saver(max_to_keep=None, name="nanguard_rollback")
    _guard.register(_guard.Guard(config=config, handles=handles, saver=saver))
    if handles.optional_variables:
        _register_default_saver(graph)


def _register_default_saver(graph: tf.Graph) -> None:
    """Makes a `ResumingSaver` the graph's default saver, when it has none yet.

    `Scaffold` (so `MonitoredTrainingSession` and `tf_slim.training.train`) saves and restores
    with the saver of the ``SAVERS`` collection, and makes one when it is empty. This one is
    that default (sharded, empty allowed, built when the scaffold is finalized, so it saves
    every variable made by then), except that it also resumes from checkpoints written
    without the guard's optional variables. A saver already in the collection, or one given
    to the `Scaffold`, is left as it is.
    """
    if graph.get_collection(tf.compat.v1.GraphKeys.SAVERS):
        return
    saver = _checkpoints.ResumingSaver(sharded=True, allow_empty=True, defer_build=True)
    graph.add_to_collection(tf.compat.v1.GraphKeys.SAVERS, saver)


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
    return any(c.IsWhileContext() for c in _ops.control_flow_contexts(context))
