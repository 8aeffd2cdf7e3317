"""Makes tf-slim 1.1.0 run on current TensorFlow; tf-slim's gradient helpers.

tf-slim 1.1.0 uses private ``tensorflow.python.*`` names that TensorFlow has since moved or
deleted (``slim.batch_norm`` and the ``tf_slim.nets`` models, ``slim.local_variable``, the
gradient helpers, ``optimize_loss``, metrics and ``tfexample_decoder`` then fail when called).
`install` restores each name missing on the running TensorFlow (`_RESTORES`) as the object
TensorFlow now provides (its public ``tf`` symbol, or tf-keras' legacy ``tf.layers`` batch
normalization), modifying no TensorFlow or tf-keras module: the tf-slim module's reference
(e.g. ``tf_slim.learning.ops``) becomes a proxy that adds the names and forwards the rest.

`multiply_gradients`, `clip_gradient_norms` and `add_gradients_summaries` keep tf-slim's
contracts on current TensorFlow (the histograms show finite values only).

Supported: TensorFlow >=2.16,<2.22 with the tf-keras of the same release, and tf-slim 1.1.0.
"""

import dataclasses
import functools
import importlib
import threading
import types
from typing import Any, Dict, Optional, Tuple

import tensorflow as tf

from slim_nanguard import _log as logging
from slim_nanguard._parity import add_gradients_summaries
from slim_nanguard._parity import clip_gradient_norms
from slim_nanguard._parity import multiply_gradients

__all__ = [
    "add_gradients_summaries",
    "clip_gradient_norms",
    "install",
    "multiply_gradients",
]

_LOCK = threading.Lock()
_PATCHED: Optional[Tuple[str, ...]] = None  # None until `install` has run.


class _ModuleProxy(types.ModuleType):
    """The TensorFlow module `wrapped` (left untouched) plus the `restored` names."""

    def __init__(self, wrapped: types.ModuleType, restored: Dict[str, Any]) -> None:
        super().__init__(wrapped.__name__, wrapped.__doc__)
        self.__dict__["_slim_nanguard_wrapped"] = wrapped
        self.__dict__.update(restored)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_slim_nanguard_wrapped"], name)

    def __repr__(self) -> str:
        return f"<slim_nanguard.compat proxy of {self.__dict__['_slim_nanguard_wrapped']!r}>"


@dataclasses.dataclass(frozen=True)
class _Restore:
    """Names removed from TensorFlow module `tf_module`, and the tf-slim modules using them.

    ``users`` are ``(tf_slim module, its global alias of tf_module)`` pairs; ``paths`` the
    replacements' public ``tf`` paths, one per name (default: the names).
    """

    tf_module: str
    names: Tuple[str, ...]
    users: Tuple[Tuple[str, str], ...]
    paths: Tuple[str, ...] = ()

    def is_broken(self, module: types.ModuleType) -> bool:
        """Whether the names are missing from `module` on the running TensorFlow."""
        try:
            return not all(hasattr(module, name) for name in self.names)
        except ImportError:  # A lazy module's import failed (the legacy batch normalization).
            return True

    def load(self) -> Optional[Dict[str, Any]]:
        """Returns ``{name: replacement}``, or None if no replacement exists (a subclass's)."""
        return {
            name: functools.reduce(getattr, path.split("."), tf)
            for name, path in zip(self.names, self.paths or self.names)
        }


class _BatchNormalization(_Restore):
    """TensorFlow's lazy ``normalization`` module asks for tf_keras.legacy_tf_layers, which
    tf-keras 2.21 ships only under tf_keras.src; slim.batch_norm fails."""

    def load(self) -> Optional[Dict[str, Any]]:
        # The path TensorFlow's lazy loader asks for, then where tf-keras 2.21 keeps it.
        for name in (
            "tf_keras.legacy_tf_layers.normalization",
            "tf_keras.src.legacy_tf_layers.normalization",
        ):
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            _warn_on_tf_keras_mismatch()
            return {"BatchNormalization": module.BatchNormalization}
        return None


def _warn_on_tf_keras_mismatch() -> None:
    try:
        import tf_keras  # pylint: disable=g-import-not-at-top

        mismatch = tf.__version__.split(".")[:2] != tf_keras.__version__.split(".")[:2]
    except Exception:  # pylint: disable=broad-except
        return
    if mismatch:
        logging.warning(
            "slim_nanguard.compat: tf-keras %s does not match TensorFlow %s; "
            "slim.batch_norm needs the tf-keras release matching TensorFlow.",
            tf_keras.__version__,
            tf.__version__,
        )


def _control_flow(name: str, *users: str) -> _Restore:
    """``control_flow_ops.name``, split out of it into its own module; now tf.compat.v1's."""
    users_ = tuple((user, "control_flow_ops") for user in users)
    return _Restore(
        "tensorflow.python.ops.control_flow_ops", (name,), users_, (f"compat.v1.{name}",)
    )


# ``users``: every tf-slim 1.1.0 module that references the name (an AST scan of tf_slim for
# attribute accesses on TensorFlow modules).
_RESTORES: Tuple[_Restore, ...] = (
    _BatchNormalization(
        "tensorflow.python.layers.normalization",
        ("BatchNormalization",),
        (("tf_slim.layers.layers", "normalization_layers"),),
    ),
    # Moved to tensorflow.python.framework.tensor.
    _Restore(
        "tensorflow.python.framework.ops",
        ("Tensor",),
        (
            ("tf_slim.layers.utils", "ops"),  # constant_value (used by batch_norm)
            ("tf_slim.learning", "ops"),  # multiply_gradients
            ("tf_slim.layers.optimizers", "ops"),  # optimize_loss
            ("tf_slim.layers.rev_block_lib", "framework_ops"),  # recompute_grad
        ),
    ),
    # Moved to tensorflow.python.framework.indexed_slices.
    _Restore(
        "tensorflow.python.framework.ops",
        ("IndexedSlices",),
        (
            ("tf_slim.learning", "ops"),  # clip/multiply gradients, gradient summaries
            ("tf_slim.training.training", "ops"),  # same helpers, tf_slim.training copy
            ("tf_slim.layers.optimizers", "ops"),  # optimize_loss gradient transforms
        ),
    ),
    # Deleted; its public face tf.compat.v1.Variable (same creator stack) remains.
    _Restore(
        "tensorflow.python.ops.variable_scope",
        ("variable",),
        (("tf_slim.ops.variables", "variable_scope"),),  # local_variable, global_variable
        ("compat.v1.Variable",),
    ),
    _control_flow(
        "cond",
        "tf_slim.layers.utils",
        "tf_slim.metrics.metric_ops",
        "tf_slim.data.tfexample_decoder",
    ),
    _control_flow("case", "tf_slim.data.tfexample_decoder"),
    _control_flow("while_loop", "tf_slim.losses.metric_learning"),
    _control_flow("Assert", "tf_slim.metrics.histogram_ops"),
    # Moved to array_ops_stack.
    _Restore(
        "tensorflow.python.ops.array_ops",
        ("stack", "unstack"),
        (
            ("tf_slim.layers.layers", "array_ops"),  # legacy_fully_connected
            ("tf_slim.metrics.metric_ops", "array_ops"),
            ("tf_slim.data.tfexample_decoder", "array_ops"),
        ),
    ),
)


def _apply() -> Tuple[str, ...]:
    """Applies every needed patch; returns the restored ``module.name`` strings."""
    import tf_slim  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import

    # Per TensorFlow module, the missing names' replacements; per tf-slim user, its module.
    restored: Dict[str, Dict[str, Any]] = {}
    users: Dict[Tuple[str, str], str] = {}
    for restore in _RESTORES:
        if not restore.is_broken(importlib.import_module(restore.tf_module)):
            continue  # The original works on this TensorFlow: leave it alone.
        replacements = restore.load()
        if replacements is None:
            logging.warning(
                "slim_nanguard.compat: %s.%s is missing and no replacement was found "
                "(is a tf-keras matching TensorFlow installed?); not patched.",
                restore.tf_module,
                restore.names[0],
            )
            continue
        restored.setdefault(restore.tf_module, {}).update(replacements)
        users.update(dict.fromkeys(restore.users, restore.tf_module))

    # One proxy per TensorFlow module, shared by the tf-slim modules that need it.
    proxies = {
        name: _ModuleProxy(importlib.import_module(name), names) for name, names in restored.items()
    }
    for (slim_module_name, alias), tf_module_name in sorted(users.items()):
        slim_module = importlib.import_module(slim_module_name)
        current = getattr(slim_module, alias, None)
        if current is importlib.import_module(tf_module_name):
            setattr(slim_module, alias, proxies[tf_module_name])
        elif not isinstance(current, _ModuleProxy):
            logging.warning(
                "slim_nanguard.compat: %s.%s is %r, not %s; left unpatched.",
                slim_module_name,
                alias,
                current,
                tf_module_name,
            )
    # `_RESTORES` lists each module's names together: this is their order there.
    return tuple(f"{module}.{name}" for module, names in restored.items() for name in names)


def install() -> None:
    """Makes tf-slim 1.1.0 work on the running TensorFlow (see the module docstring).

    Idempotent and thread-safe: the first call patches what is missing and logs at INFO what
    it patched; later calls return at once. A no-op where tf-slim works unmodified.
    """
    global _PATCHED
    with _LOCK:
        if _PATCHED is not None:
            return
        _PATCHED = _apply()
    if _PATCHED:
        logging.info("slim_nanguard.compat: patched tf-slim for %s", ", ".join(_PATCHED))
    else:
        logging.info("slim_nanguard.compat: tf-slim needs no patches on this TensorFlow.")
