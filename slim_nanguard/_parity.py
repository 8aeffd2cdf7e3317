"""What `create_train_op` does as tf-slim 1.1.0's does, in the same order and on current
TensorFlow (where tf-slim's own helpers fail on names TensorFlow removed): the argument checks
(refusing at once what tf-slim would fail on late), the update ops and variables, and the
gradients, multiplied, clipped, transformed and summarized. Nothing here knows of the guard.
"""

from __future__ import annotations

import inspect
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from slim_nanguard import _log as logging
from slim_nanguard import _placement

# tf_slim's sentinel (`slim.learning._USE_GLOBAL_STEP`), so that passing it means the same.
USE_GLOBAL_STEP = 0

GradsAndVars = List[Tuple[Optional[tf.Tensor], tf.Variable]]


def check_arguments(total_loss, optimizer, clip_gradient_norm) -> None:
    """Raises ValueError for a loss, optimizer or clipping norm tf-slim's train op cannot use."""
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
    _check_optimizer(optimizer)
    if clip_gradient_norm is None or clip_gradient_norm < 0:
        raise ValueError(
            f"clip_gradient_norm must be >= 0 (0 turns clipping off); got {clip_gradient_norm!r}."
        )


def compute_gradients(
    total_loss: tf.Tensor,
    optimizer: tf.compat.v1.train.Optimizer,
    variables_to_train: Sequence[tf.Variable],
    *,
    gradient_multipliers: Optional[Dict],
    clip_gradient_norm: float,
    transform_grads_fn: Optional[Callable[[GradsAndVars], GradsAndVars]],
    summarize_gradients: bool,
    **compute_kwargs,
) -> GradsAndVars:
    """The (gradient, variable) pairs tf-slim's train op applies, built in its order."""
    grads = optimizer.compute_gradients(total_loss, variables_to_train, **compute_kwargs)
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
    return grads


def _check_optimizer(optimizer) -> None:
    """Refuses (naming Keras ones) an optimizer that neither is nor works like a v1 one."""
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        return
    compute = getattr(optimizer, "compute_gradients", None)
    if callable(compute) and callable(getattr(optimizer, "apply_gradients", None)):
        try:
            params = inspect.signature(compute).parameters
        except (TypeError, ValueError):
            params = {}
        if "gate_gradients" in params or any(p.kind == p.VAR_KEYWORD for p in params.values()):
            return
    module = type(optimizer).__module__
    keras = (
        " Keras optimizers (Keras 3, tf-keras, tf_keras.optimizers.legacy) do not work "
        "in a graph-mode TF-Slim train op."
        if "keras" in module
        else ""
    )
    shown = repr(optimizer) if module == "builtins" else f"{module}.{type(optimizer).__qualname__}"
    raise ValueError(
        f"optimizer must be a tf.compat.v1.train.Optimizer; got {shown}.{keras} Use the "
        "tf.compat.v1.train optimizer of the same algorithm, for example "
        "tf.compat.v1.train.GradientDescentOptimizer or tf.compat.v1.train.AdamOptimizer."
    )


def resolve_update_ops(graph: tf.Graph, update_ops) -> list:
    """`update_ops`, or the graph's ``UPDATE_OPS`` when None, sorted by name (two builds of one
    graph are the same); as tf-slim, warns when given ops leave out some of ``UPDATE_OPS``."""
    global_update_ops = set(graph.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS))
    resolved = global_update_ops if update_ops is None else set(update_ops)
    if not global_update_ops.issubset(resolved):
        logging.warning(
            "update_ops in create_train_op does not contain all the update_ops in "
            "GraphKeys.UPDATE_OPS"
        )
    return sorted(resolved, key=lambda u: getattr(u, "name", str(u)))


def resolve_variables(variables_to_train) -> list:
    """`variables_to_train`, or every trainable variable when None; never none."""
    trainable = tf.compat.v1.trainable_variables()
    if variables_to_train is None:
        if not trainable:
            raise ValueError(
                "the graph has no trainable variables: variables_to_train is None, "
                "so every trainable variable would be trained, and there is none."
            )
        return trainable
    variables_to_train = list(variables_to_train)
    for v in variables_to_train:
        if not (getattr(v, "trainable", False) or v in trainable):
            raise ValueError(f"variables_to_train holds {v.name!r}, which is not trainable.")
    if not variables_to_train:
        raise ValueError(
            "variables_to_train is empty: pass the variables to train, or "
            "None to train all trainable variables."
        )
    return variables_to_train


def multiply_gradients(grads_and_vars: GradsAndVars, gradient_multipliers: Dict) -> GradsAndVars:
    """`tf_slim.learning.multiply_gradients` on current TensorFlow: `grads_and_vars` (a list)
    with the gradients of the variables `gradient_multipliers` names (a `Variable` or its op's
    name -> a number or tensor) multiplied.

    Raises:
      ValueError: An argument of the wrong type, or a named variable without a gradient.
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
            grad = _on_values(grad, lambda values: values * multiplier)  # noqa: B023 (called at once)
        result.append((grad, var))
    return result


def clip_gradient_norms(grads_and_vars: GradsAndVars, max_norm: float) -> GradsAndVars:
    """Clips each gradient to `max_norm` (as `tf_slim.learning.clip_gradient_norms`)."""
    return [
        (None if g is None else _on_values(g, lambda v: tf.clip_by_norm(v, max_norm)), var)
        for g, var in grads_and_vars
    ]


def _on_values(grad, fn: Callable[[tf.Tensor], tf.Tensor]):
    """`fn` of a gradient, or of a `tf.IndexedSlices`' values (indices kept)."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(fn(grad.values), grad.indices, grad.dense_shape)
    return fn(grad)


def add_gradients_summaries(grads_and_vars: GradsAndVars) -> List[tf.Tensor]:
    """`tf_slim.learning.add_gradients_summaries`: a histogram and a norm summary of each
    gradient, the histogram of its finite values only (TensorFlow's raises on a NaN, which
    would turn a skipped step into a crash)."""
    summaries = []
    for grad, var in grads_and_vars:
        if grad is None:
            logging.info("Var %s has no gradient", var.op.name)
            continue
        values = _placement.values_of(grad)
        finite = tf.boolean_mask(values, tf.math.is_finite(values))
        norm = tf.linalg.global_norm([values])
        with _placement.on_host():  # Summaries have no GPU kernel.
            summaries.append(tf.compat.v1.summary.histogram(var.op.name + "/gradient", finite))
            summaries.append(tf.compat.v1.summary.scalar(var.op.name + "/gradient_norm", norm))
    return summaries
