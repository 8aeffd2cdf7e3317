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
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Callable, Dict, Iterable, Optional, Sequence

import tensorflow as tf

from slim_nanguard import _checkpoints
from slim_nanguard import _exact_sums
from slim_nanguard import _gated_writes
from slim_nanguard import _guard
from slim_nanguard import _handles
from slim_nanguard import _learning_rate
from slim_nanguard import _log as logging
from slim_nanguard import _ops
from slim_nanguard import _parity
from slim_nanguard import _placement
from slim_nanguard import _policy
from slim_nanguard import _step_test


def create_train_op(
    total_loss: tf.Tensor,
    optimizer: tf.compat.v1.train.Optimizer,
    global_step=_parity.USE_GLOBAL_STEP,
    update_ops: Optional[Iterable] = None,
    variables_to_train: Optional[Sequence[tf.Variable]] = None,
    clip_gradient_norm: float = 0,
    summarize_gradients: bool = False,
    gate_gradients: int = tf.compat.v1.train.Optimizer.GATE_OP,
    aggregation_method=None,
    colocate_gradients_with_ops: bool = False,
    gradient_multipliers: Optional[Dict] = None,
    check_numerics: bool = True,
    transform_grads_fn: Optional[Callable[[_parity.GradsAndVars], _parity.GradsAndVars]] = None,
    *,
    config: Optional[_policy.GuardConfig] = None,
    **guard_settings,
) -> tf.Tensor:
    """Drop-in for `tf_slim.learning.create_train_op` whose bad steps change nothing.

    The first twelve arguments and the return value are tf-slim 1.1.0's (the train op is added
    to the ``TRAIN_OP`` collection; ``summarize_gradients``' histograms show the finite values
    only); ``transform_grads_fn`` is `tf_slim.training.create_train_op`'s, run after the
    multipliers and the clipping. The other keyword arguments are `GuardConfig`'s fields, with
    its defaults (``inspect.signature(create_train_op)`` lists them).

    A step whose loss or any gradient is NaN or Inf writes no variable: the trainable
    variables, the optimizer's slots and accumulators, ``global_step`` and the variables the
    ``update_ops`` assign keep their values, and forward-pass writes (``slim.batch_norm`` with
    ``updates_collections=None``) are put back. A step whose values are all finite computes
    what tf-slim's train op computes, even when its sums of squares overflow. Built inside a
    `tf.while_loop`, each iteration is judged on its own. With a dynamic loss-scale optimizer,
    a finite loss whose gradients overflowed above the minimum scale is no bad step (only the
    scale's update runs).

    * ``check_numerics=True``: ``session.run(train_op)`` raises a
      `tf.errors.InvalidArgumentError` (`is_numerics_error`); `train`, `train_step` or
      `handle_numerics_error` applies the policy.
    * ``check_numerics=False`` (hook mode): the run returns the non-finite loss and
      ``nan_hook(train_op)`` applies the policy; a bad step in a session no hook judges fails
      with an error naming what to add. Writes built later under
      ``tf.control_dependencies([train_op])`` are gated too, when the hook begins.

    Args:
      check_numerics: True for check_numerics mode, False for hook mode.
      nan_policy: ``"raise"`` (`NanLossError`), ``"stop"`` (end the loop cleanly), ``"skip"``
        (carry on with the next batch) or ``"rollback"`` (restore the latest good checkpoint).
      config: A `GuardConfig`; the settings given as keywords replace its fields.
      **guard_settings: `GuardConfig`'s fields (``nan_policy``, ``spike_policy``, ...; see
        its attributes). ``spike_policy=None`` (the default) builds the graph tf-slim's would.

    Returns:
      A `Tensor` that computes the gradients, applies them when finite and returns the loss.

    Raises:
      TypeError: A keyword that is neither tf-slim's nor a `GuardConfig` field.
      ValueError: An argument tf-slim's train op cannot use (a loss that is not a scalar
        floating-point tensor, no `tf.compat.v1.train.Optimizer`, no variable to train), a
        policy argument out of range, a ``config`` that is not a `GuardConfig`, or a spike
        policy or reasons for a train op built in a loop body.
    """
    config = _guard_config(config, guard_settings)
    _parity.check_arguments(total_loss, optimizer, clip_gradient_norm)
    graph = total_loss.graph
    _check_reasons_outside_loops(config, graph)
    with graph.as_default():
        if global_step is _parity.USE_GLOBAL_STEP:
            global_step = tf.compat.v1.train.get_or_create_global_step()
        update_ops = _parity.resolve_update_ops(graph, update_ops)
        variables_to_train = _parity.resolve_variables(variables_to_train)
        # Made before the gradients: the ops keep their order, so the GraphDef is unchanged.
        scales = (
            _step_test.dynamic_loss_scale(optimizer),
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


def _guard_config(config: Optional[_policy.GuardConfig], settings: dict) -> _policy.GuardConfig:
    """`config` (default `GuardConfig()`) with the keyword `settings` in place of its fields."""
    fields = [f.name for f in dataclasses.fields(_policy.GuardConfig)]
    unknown = sorted(set(settings) - set(fields))
    if unknown:
        raise TypeError(
            f"create_train_op() got an unexpected keyword argument {unknown[0]!r}: besides "
            f"tf-slim's arguments it takes config= and GuardConfig's fields: {', '.join(fields)}."
        )
    if config is None:
        return _policy.GuardConfig(**settings)
    if not isinstance(config, _policy.GuardConfig):
        raise ValueError(f"config must be a slim_nanguard.GuardConfig; got {config!r}.")
    return dataclasses.replace(config, **settings)


def _signature() -> inspect.Signature:
    """`create_train_op`'s signature as help() shows it: each `GuardConfig` field a keyword,
    with the dataclass's default (declared there only), before ``config``."""
    *tf_slim, config, _ = inspect.signature(create_train_op).parameters.values()
    settings = [
        inspect.Parameter(
            f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type
        )
        for f in dataclasses.fields(_policy.GuardConfig)
    ]
    return inspect.signature(create_train_op).replace(parameters=[*tf_slim, *settings, config])


create_train_op.__signature__ = _signature()


def _gated(
    config, total_loss, optimizer, grads, global_step, update_ops, loss_scale, lr_scale, check
):
    """The train op of `grads`, every write behind the mode's gate, registered with its guard."""
    graph = total_loss.graph
    device = _placement.verdict_device(total_loss, [g for g, _ in grads])
    beside_grads = functools.partial(_placement.verdict_scope, device)
    with tf.name_scope("nanguard"), beside_grads():
        test = _step_test.StepTest(total_loss, grads, loss_scale, config.all_reasons)
        forward = _gated_writes.snapshot_forward_writes(graph, test.anchor)
        autopsy = _autopsy_possible(config, graph, forward.snapshots)
        gate = _step_test.build_gate(
            test, config, check_numerics=check, forward=forward, loss=total_loss, autopsy=autopsy
        )
    with _learning_rate.scaled(optimizer, lr_scale):
        # What a loss scale updates (the scale and its count of good steps).
        unless_bad = list(getattr(loss_scale, "_weights", {}).values())
        gates = (gate.gate, gate.finite_gate)
        grad_updates = _gated_writes.apply_gradients(
            optimizer, grads, global_step, gates, update_ops, forward.restored, unless_bad
        )
    writes = [grad_updates] + list(update_ops)
    if test.reasons:  # An accepted step writes its reasons' state.
        opened = gate.gate if gate.finite_gate is None else gate.finite_gate
        with tf.control_dependencies([opened]), beside_grads():  # Beside their state.
            writes += test.accepted_writes()
    train_op = gate.loss_after(total_loss, writes)
    _register(config, test, gate, train_op, total_loss, global_step, lr_scale)
    return train_op


def _check_reasons_outside_loops(config: _policy.GuardConfig, graph: tf.Graph) -> None:
    """Raises ValueError for reasons (a spike policy) on a train op built in a loop body."""
    reasons = config.all_reasons
    if reasons and _in_loop(graph):
        names = ", ".join(r.policy_name for r in reasons)
        raise ValueError(
            f"{names} needs a train op built outside any tf.while_loop or function body "
            "(the loop's hook cannot see a rejected iteration); build it outside the loop, or "
            "leave it unset there."
        )


def _register(config, test, gate, train_op, loss, global_step, lr_scale) -> None:
    """Adds `train_op` (a new tensor) to the ``TRAIN_OP`` collection; registers its `Guard`."""
    graph = train_op.graph
    graph.add_to_collection(tf.compat.v1.GraphKeys.TRAIN_OP, train_op)
    in_loop = _in_loop(graph)
    lr_scale_value = lr_scale_assign = None
    if lr_scale is not None:
        # init_scope: in the outermost graph, even for a train op built in a loop body.
        with graph.as_default(), tf.init_scope():
            lr_scale_value = tf.compat.v1.placeholder(
                lr_scale.dtype.base_dtype, [], name="nanguard_lr_scale_value"
            )
            lr_scale_assign = tf.compat.v1.assign(lr_scale, lr_scale_value).op
    kinds_read = test.kinds
    if kinds_read is not None and test.reasons:  # A rejected finite step does not write it.
        with kinds_read.graph.as_default(), tf.init_scope(), tf.device(kinds_read.device):
            kinds_read = _ops.read_once_written(kinds_read, -1, name="nanguard_value_kinds_read")
    handles = _handles.GraphHandles(
        mode=gate.mode,
        train_op=train_op,
        loss=loss,
        global_step=global_step,
        gradients=test.gradients,
        value_kinds=test.kinds,
        kinds_read=kinds_read,
        ok=None if in_loop else gate.ok,
        diagnostics=test.diagnostics,
        check_op_name=gate.check_op_name,
        variable_names=tuple(v.op.name for _, v in test.present),
        lr_scale=lr_scale,
        lr_scale_value=lr_scale_value,
        lr_scale_assign=lr_scale_assign,
        loss_scale_floor=None if test.overflow is None else _exact_sums.LOSS_SCALE_FLOOR,
        in_loop=in_loop,
        judged=gate.judged,
        pivot=gate.pivot,
        capture=gate.capture,
        input_ops=tuple(_ops.sources([loss.op], _ops.INPUT_OP_TYPES)),
        report=test.report,
        reasons=test.reasons,
        reason_handles={r.name: t.handles for r, t in zip(test.reasons, test.tests)},
        optional_variables=tuple(v for v in (lr_scale, *test.reason_variables()) if v is not None),
        counters=None if in_loop else test.counters(),
    )
    guard = _guard.Guard(config=config, handles=handles)
    if _policy.may_roll_back(config):
        guard.restorer.ensure_saver()
    _guard.register(guard)
    _checkpoints.add_optional_variables(graph, handles.optional_variables)
    if handles.optional_variables and not graph.get_collection(tf.compat.v1.GraphKeys.SAVERS):
        # The default saver a `Scaffold` would make, which also resumes from checkpoints
        # lacking the guard's optional variables.
        saver = _checkpoints.ResumingSaver(sharded=True, allow_empty=True, defer_build=True)
        graph.add_to_collection(tf.compat.v1.GraphKeys.SAVERS, saver)


def _autopsy_possible(config: _policy.GuardConfig, graph: tf.Graph, snapshots) -> bool:
    """Whether the train op keeps a bad step's batch for an autopsy (else warns why not)."""
    if config.autopsy_max_steps <= 0:
        return False
    if snapshots:
        why = "its forward pass writes variables, which a replay would write again"
    elif _in_loop(graph):
        why = "it is built inside a loop, whose tensors a replay cannot fetch"
    else:
        return True
    logging.warning("slim_nanguard: no autopsy of bad steps for this train op: %s.", why)
    return False


def _in_loop(graph: tf.Graph) -> bool:
    """Whether ops built now land in a loop body (a while_v2 function or a v1 while context)."""
    if getattr(graph, "building_function", False):
        return True
    context = graph._get_control_flow_context()  # pylint: disable=protected-access
    return _ops.in_while(context)
