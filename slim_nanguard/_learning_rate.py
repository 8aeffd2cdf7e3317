"""The learning rate the rollback policy lowers: one variable the optimizer's rate is scaled by.

With ``rollback_lr_factor`` below 1, the update reads ``rate * scale``; each rollback
multiplies the scale (1 at first) by the factor. The caller's optimizer is left unchanged.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Tuple

import tensorflow as tf

# Attributes through which an optimizer wraps another one (loss-scale, SyncReplicas).
_WRAPPED_OPTIMIZER_ATTRS = ("_optimizer", "_opt")
# Attributes a tf.compat.v1 optimizer keeps its learning rate in (Adam: ``_lr``).
_LEARNING_RATE_ATTRS = ("_learning_rate", "_lr")


def _rate_owner(optimizer) -> Tuple[object, str]:
    """The optimizer object (`optimizer` or one it wraps) that holds the learning rate, and the
    attribute it is in; a ValueError when there is none."""
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
    """The variable (one per graph) the rollback policy lowers `optimizer`'s learning rate with;
    None when `factor` (``rollback_lr_factor``) is 1.0. ValueError: no learning rate to scale."""
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
    """While active, the optimizer's learning rate is multiplied by `scale` (None: unchanged):
    build the update (``apply_gradients``) inside it.

    The rate attribute of the (innermost) optimizer holds ``rate * scale`` in the block and
    its own value after (a callable rate is called here, once). Not thread-safe for one
    optimizer object. ValueError: the optimizer has no learning rate to scale.
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
