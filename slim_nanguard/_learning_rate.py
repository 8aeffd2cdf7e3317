"""The learning rate the rollback policy lowers: one variable the optimizer's rate is scaled by.

With ``rollback_lr_factor`` below 1, each rollback multiplies a variable of the graph (the
scale, 1 at first) by the factor, and the optimizer's update reads ``rate * scale``. The
optimizer is left as the caller made it: its rate attribute holds the scaled rate only while
`create_train_op` builds the update (`scaled`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Tuple

import tensorflow as tf

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


def scale_variable(optimizer, factor: float) -> Optional[tf.Variable]:
    """The variable the rollback policy lowers the learning rate with (one per graph).

    Args:
      optimizer: The optimizer whose learning rate is scaled.
      factor: ``rollback_lr_factor``; 1.0 scales nothing, and makes no variable.

    Returns:
      The variable, or None when `factor` is 1.0.

    Raises:
      ValueError: The optimizer has no learning rate to scale (checked now, before any graph
        is built around it).
    """
    if factor == 1.0:
        return None
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
def scaled(optimizer, scale: Optional[tf.Variable]) -> Iterator[None]:
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
