"""Makes tf-slim 1.1.0 run on current TensorFlow; tf-slim's gradient helpers.

tf-slim 1.1.0 uses private ``tensorflow.python.*`` names that TensorFlow has since moved or
deleted (``slim.batch_norm`` and the ``tf_slim.nets`` models, ``slim.local_variable``, the
gradient helpers, ``optimize_loss``, metrics and ``tfexample_decoder`` then fail when called).
`install` restores them (`_RESTORES` lists each name and its tf-slim users). Each patch:

* applies only where the name is missing on the running TensorFlow;
* binds it to the object TensorFlow now provides (its public ``tf`` symbol, or tf-keras'
  legacy ``tf.layers`` batch normalization);
* modifies no TensorFlow or tf-keras module: the tf-slim module's reference (e.g.
  ``tf_slim.learning.ops``) becomes a proxy that adds the names and forwards the rest.

`multiply_gradients`, `clip_gradient_norms` and `add_gradients_summaries` keep tf-slim's
contracts on current TensorFlow; the summaries' histograms show finite values only
(TensorFlow's histogram op raises on NaN, which would turn a skipped step into a crash).

Supported: TensorFlow >=2.16,<2.22 with the tf-keras of the same release, and tf-slim 1.1.0.
"""

import importlib
import threading
import types
from typing import Any, Callable, Dict, List, Optional, Tuple

from slim_nanguard import _log as logging
from slim_nanguard._parity import add_gradients_summaries
from slim_nanguard._parity import clip_gradient_norms
from slim_nanguard._parity import multiply_gradients

__all__ = [
    "add_gradients_summaries",
    "clip_gradient_norms",
    "install",
    "is_installed",
    "multiply_gradients",
    "patched",
]

_LOCK = threading.Lock()
_INSTALLED = False
_PATCHED: Tuple[str, ...] = ()


class _ModuleProxy(types.ModuleType):
    """A TensorFlow module plus restored names, for one tf-slim module's namespace.

    Args:
      wrapped: The real TensorFlow module; left untouched, every other name is looked up on it.
      restored: ``{removed name: replacement}``.
    """

    def __init__(self, wrapped: types.ModuleType, restored: Dict[str, Any]) -> None:
        super().__init__(wrapped.__name__, wrapped.__doc__)
        self.__dict__["_slim_nanguard_wrapped"] = wrapped
        self.__dict__.update(restored)

    def __getattr__(self, name: str) -> Any:
        """Forwards lookups of names that were not restored to the real module."""
        return getattr(self.__dict__["_slim_nanguard_wrapped"], name)

    def __repr__(self) -> str:
        wrapped = self.__dict__["_slim_nanguard_wrapped"]
        return f"<slim_nanguard.compat proxy of {wrapped!r}>"


# --------------------------------------------------------------------------------------
# Replacements. Each loader returns the object TensorFlow now provides for a removed
# name; it is only called when the name is missing.
# --------------------------------------------------------------------------------------


def _tf() -> Any:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    return tf


def _legacy_batch_normalization_module() -> Optional[types.ModuleType]:
    """Returns tf-keras' legacy ``tf.layers`` normalization module, or None."""
    # The path TensorFlow's lazy loader asks for, then where tf-keras 2.21 keeps it.
    for name in (
        "tf_keras.legacy_tf_layers.normalization",
        "tf_keras.src.legacy_tf_layers.normalization",
    ):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def _batch_normalization_names() -> Optional[Dict[str, Any]]:
    module = _legacy_batch_normalization_module()
    if module is None:
        return None
    _warn_on_tf_keras_mismatch()
    # tf-slim only uses normalization_layers.BatchNormalization (in slim.batch_norm).
    return {"BatchNormalization": module.BatchNormalization}


def _warn_on_tf_keras_mismatch() -> None:
    """Warns if tf-keras and TensorFlow are not the same major.minor release."""
    try:
        import tf_keras  # pylint: disable=g-import-not-at-top

        tf_version = _tf().__version__.split(".")[:2]
        keras_version = tf_keras.__version__.split(".")[:2]
    except Exception:  # pylint: disable=broad-except
        return
    if tf_version != keras_version:
        logging.warning(
            "slim_nanguard.compat: tf-keras %s does not match TensorFlow %s; "
            "slim.batch_norm needs the tf-keras release matching TensorFlow.",
            tf_keras.__version__,
            _tf().__version__,
        )


def _batch_normalization_is_broken(module: types.ModuleType) -> bool:
    """Probes TensorFlow's lazy ``tensorflow.python.layers.normalization``."""
    try:
        module.BatchNormalization  # noqa: B018  (the attribute access is the probe)
    except ImportError:
        # The lazy import of tf_keras.legacy_tf_layers.normalization failed.
        return True
    except AttributeError:
        return True
    return False


class _Restore:
    """One removed TensorFlow name and the tf-slim modules that still use it.

    Attributes:
      tf_module: Dotted name of the TensorFlow module the name was removed from.
      names: The removed attribute names.
      loader: Returns ``{name: replacement}``, or None if no replacement exists.
      users: ``(tf_slim module, global alias of tf_module in it)`` pairs.
      is_broken: Detects, on the running TensorFlow, whether the names are missing.
    """

    def __init__(
        self,
        tf_module: str,
        names: Tuple[str, ...],
        loader: Callable[[], Optional[Dict[str, Any]]],
        users: Tuple[Tuple[str, str], ...],
        is_broken: Optional[Callable[[types.ModuleType], bool]] = None,
    ) -> None:
        self.tf_module = tf_module
        self.names = names
        self.loader = loader
        self.users = users
        self.is_broken = is_broken or (
            lambda module: not all(hasattr(module, name) for name in names)
        )


def _public(**names: str) -> Callable[[], Dict[str, Any]]:
    """Loader for names whose replacement is a public ``tf`` symbol (dotted path)."""

    def load() -> Dict[str, Any]:
        result = {}
        for name, path in names.items():
            obj = _tf()
            for part in path.split("."):
                obj = getattr(obj, part)
            result[name] = obj
        return result

    return load


# The patches. ``users``: every tf-slim 1.1.0 module that references the name (an AST scan of
# tf_slim for attribute accesses on TensorFlow modules).
_RESTORES: Tuple[_Restore, ...] = (
    # tensorflow.python.layers.normalization lazy-loads tf_keras.legacy_tf_layers.normalization,
    # which tf-keras 2.21 ships only under tf_keras.src. Breaks slim.batch_norm.
    _Restore(
        "tensorflow.python.layers.normalization",
        ("BatchNormalization",),
        _batch_normalization_names,
        (("tf_slim.layers.layers", "normalization_layers"),),
        is_broken=_batch_normalization_is_broken,
    ),
    # Moved to tensorflow.python.framework.tensor.
    _Restore(
        "tensorflow.python.framework.ops",
        ("Tensor",),
        _public(Tensor="Tensor"),
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
        _public(IndexedSlices="IndexedSlices"),
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
        _public(variable="compat.v1.Variable"),
        (("tf_slim.ops.variables", "variable_scope"),),  # local_variable, global_variable
    ),
    # Split out into the cond, control_flow_case, while_loop and control_flow_assert modules.
    _Restore(
        "tensorflow.python.ops.control_flow_ops",
        ("cond",),
        _public(cond="compat.v1.cond"),
        (
            ("tf_slim.layers.utils", "control_flow_ops"),  # smart_cond
            ("tf_slim.metrics.metric_ops", "control_flow_ops"),
            ("tf_slim.data.tfexample_decoder", "control_flow_ops"),
        ),
    ),
    _Restore(
        "tensorflow.python.ops.control_flow_ops",
        ("case",),
        _public(case="compat.v1.case"),
        (("tf_slim.data.tfexample_decoder", "control_flow_ops"),),
    ),
    _Restore(
        "tensorflow.python.ops.control_flow_ops",
        ("while_loop",),
        _public(while_loop="compat.v1.while_loop"),
        (("tf_slim.losses.metric_learning", "control_flow_ops"),),
    ),
    _Restore(
        "tensorflow.python.ops.control_flow_ops",
        ("Assert",),
        _public(Assert="compat.v1.Assert"),
        (("tf_slim.metrics.histogram_ops", "control_flow_ops"),),
    ),
    # Moved to array_ops_stack.
    _Restore(
        "tensorflow.python.ops.array_ops",
        ("stack", "unstack"),
        _public(stack="stack", unstack="unstack"),
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

    # Collect, per TensorFlow module, the missing names and their replacements.
    restored: Dict[str, Dict[str, Any]] = {}
    users: Dict[Tuple[str, str], str] = {}
    applied: List[str] = []
    for restore in _RESTORES:
        tf_module = importlib.import_module(restore.tf_module)
        if not restore.is_broken(tf_module):
            continue  # The original works on this TensorFlow: leave it alone.
        replacements = restore.loader()
        if replacements is None:
            logging.warning(
                "slim_nanguard.compat: %s.%s is missing and no replacement was found "
                "(is a tf-keras matching TensorFlow installed?); not patched.",
                restore.tf_module,
                restore.names[0],
            )
            continue
        restored.setdefault(restore.tf_module, {}).update(replacements)
        applied.extend(f"{restore.tf_module}.{name}" for name in restore.names)
        for user in restore.users:
            users[user] = restore.tf_module

    # One proxy per TensorFlow module, shared by the tf-slim modules that need it.
    proxies = {
        name: _ModuleProxy(importlib.import_module(name), names) for name, names in restored.items()
    }
    for (slim_module_name, alias), tf_module_name in sorted(users.items()):
        slim_module = importlib.import_module(slim_module_name)
        current = getattr(slim_module, alias, None)
        if isinstance(current, _ModuleProxy):
            continue
        if current is not importlib.import_module(tf_module_name):
            logging.warning(
                "slim_nanguard.compat: %s.%s is %r, not %s; left unpatched.",
                slim_module_name,
                alias,
                current,
                tf_module_name,
            )
            continue
        setattr(slim_module, alias, proxies[tf_module_name])
    return tuple(applied)


def install() -> None:
    """Makes tf-slim 1.1.0 work on the running TensorFlow (see the module docstring).

    Idempotent and thread-safe: the first call patches what is missing and logs at INFO what
    it patched; later calls return at once. A no-op where tf-slim works unmodified.
    """
    global _INSTALLED, _PATCHED
    if _INSTALLED:
        return
    with _LOCK:
        if _INSTALLED:
            return
        _PATCHED = _apply()
        _INSTALLED = True
    if _PATCHED:
        logging.info("slim_nanguard.compat: patched tf-slim for %s", ", ".join(_PATCHED))
    else:
        logging.info("slim_nanguard.compat: tf-slim needs no patches on this TensorFlow.")


def is_installed() -> bool:
    """Returns True once `install` has completed in this process."""
    return _INSTALLED


def patched() -> Tuple[str, ...]:
    """Returns the names `install` restored, as dotted ``module.name`` strings (e.g.
    ``"tensorflow.python.framework.ops.Tensor"``); empty before `install` or when nothing
    needed patching."""
    return _PATCHED
