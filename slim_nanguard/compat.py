"""Compatibility layer that lets tf-slim 1.1.0 run on current TensorFlow.

tf-slim's last release (1.1.0, 2020) reaches into TensorFlow's private
``tensorflow.python.*`` modules. Several names it uses there have since been
moved or deleted, so on TensorFlow 2.21 large parts of tf-slim raise
``AttributeError`` / ``ModuleNotFoundError`` the first time they are called
(importing ``tf_slim`` itself still works, which is why the breakage shows up
late, inside model building or ``create_train_op``).

`install` fixes this with *narrow* patches. Every patch

* first detects whether the original is actually broken on the running
  TensorFlow (``hasattr`` on the TensorFlow module, or an import probe), and does
  nothing if it is not, so behaviour on a TensorFlow where tf-slim works is
  unchanged;
* restores only the missing name, bound to the object TensorFlow now provides
  under a new location (normally its public ``tf.compat.v1`` / ``tf`` symbol, the
  very object the old private name used to refer to);
* never modifies TensorFlow's or tf-keras' own modules: the affected tf-slim
  modules get their module reference (e.g. ``tf_slim.learning.ops``) replaced by
  a thin proxy of the TensorFlow module that adds the missing names and forwards
  everything else to the real module.

What is restored, and which tf-slim code needs it (found by running tf-slim
1.1.0 on TensorFlow 2.21 and by scanning every tf-slim module for attribute
accesses on TensorFlow modules that no longer exist):

``tensorflow.python.layers.normalization.BatchNormalization``
    TensorFlow dropped its private Keras copy of the legacy ``tf.layers``
    batch normalization and now lazy-loads it from
    ``tf_keras.legacy_tf_layers.normalization``; tf-keras 2.21 ships that module
    only as ``tf_keras.src.legacy_tf_layers.normalization``, so the lazy import
    fails. Breaks ``slim.batch_norm`` (fused and not) and therefore every
    ``tf_slim.nets`` model that uses it (resnet_v1/v2 with their arg scopes,
    inception_v1/v2/v3, ...).
``tensorflow.python.framework.ops.Tensor``
    ``Tensor`` moved to ``tensorflow.python.framework.tensor`` and the ``ops``
    alias was removed. Breaks ``layers.utils.constant_value`` (hence
    ``slim.batch_norm`` again), ``learning.multiply_gradients`` (hence
    ``create_train_op(gradient_multipliers=...)``), ``optimize_loss`` and
    ``rev_block_lib.recompute_grad``.
``tensorflow.python.framework.ops.IndexedSlices``
    ``IndexedSlices`` moved to ``tensorflow.python.framework.indexed_slices``.
    Breaks ``clip_gradient_norms``, ``multiply_gradients`` and
    ``add_gradients_summaries`` in both ``tf_slim.learning`` and
    ``tf_slim.training.training`` (hence ``create_train_op`` with
    ``clip_gradient_norm`` / ``summarize_gradients``) and ``optimize_loss``.
``tensorflow.python.ops.variable_scope.variable``
    The private ``variable_scope.variable`` function was deleted (its public
    face, ``tf.compat.v1.Variable``, remains). Breaks ``slim.local_variable``
    and ``slim.global_variable``.
``tensorflow.python.ops.control_flow_ops.{cond, case, while_loop, Assert}``
    Split out into ``cond``, ``control_flow_case``, ``while_loop`` and
    ``control_flow_assert``. Breaks ``layers.utils.smart_cond``, several
    streaming metrics and ``auc_using_histogram``, the clustering losses in
    ``losses.metric_learning`` and image / bounding-box decoding in
    ``data.tfexample_decoder``.
``tensorflow.python.ops.array_ops.{stack, unstack}``
    Moved to ``array_ops_stack``. Breaks ``legacy_fully_connected``,
    ``streaming_concat`` / curve metrics and ``tfexample_decoder``.

tf-slim's gradient helpers are here too, as `create_train_op` uses them: `multiply_gradients`,
`clip_gradient_norms` and `add_gradients_summaries` keep tf-slim's contracts on current
TensorFlow (the summaries' histograms show the finite values only: TensorFlow's histogram op
raises on NaN, which would turn a skipped step into a crash).

Declared support: TensorFlow >=2.16,<2.22 with the tf-keras of the same
release and tf-slim 1.1.0. Tested: TensorFlow 2.21.0 / tf-keras 2.21.0 only.
On a TensorFlow where a name still exists the corresponding patch is skipped;
`patched` tells which ones were applied.
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
    """A stand-in for a TensorFlow module inside one tf-slim module's namespace.

    Names restored by the compatibility layer live in the proxy's own
    ``__dict__``; every other attribute is looked up on the wrapped module, so
    the proxy behaves exactly like the module it wraps plus the restored names.
    The wrapped module itself is left untouched.
    """

    def __init__(self, wrapped: types.ModuleType, restored: Dict[str, Any]) -> None:
        """Initializes the proxy.

        Args:
          wrapped: The real TensorFlow module.
          restored: Mapping from removed attribute name to its replacement.
        """
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
    # The first path is the one TensorFlow's own lazy loader asks for; the second is
    # where tf-keras 2.21 actually keeps the module.
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


# The table of patches. ``users`` lists every tf-slim 1.1.0 module that references the
# name (found by an AST scan of tf_slim for attribute accesses on TensorFlow modules).
_RESTORES: Tuple[_Restore, ...] = (
    # TensorFlow removed its private keras copy of legacy tf.layers BatchNormalization;
    # tensorflow.python.layers.normalization now lazy-loads
    # tf_keras.legacy_tf_layers.normalization, a path tf-keras 2.21 does not provide
    # (it ships tf_keras.src.legacy_tf_layers.normalization). Breaks slim.batch_norm.
    _Restore(
        "tensorflow.python.layers.normalization",
        ("BatchNormalization",),
        _batch_normalization_names,
        (("tf_slim.layers.layers", "normalization_layers"),),
        is_broken=_batch_normalization_is_broken,
    ),
    # TensorFlow moved Tensor to tensorflow.python.framework.tensor and removed the
    # tensorflow.python.framework.ops.Tensor alias.
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
    # TensorFlow moved IndexedSlices to tensorflow.python.framework.indexed_slices and
    # removed the tensorflow.python.framework.ops.IndexedSlices alias.
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
    # TensorFlow deleted the private function variable_scope.variable; its public
    # entry point tf.compat.v1.Variable (VariableV1, same creator stack) remains.
    _Restore(
        "tensorflow.python.ops.variable_scope",
        ("variable",),
        _public(variable="compat.v1.Variable"),
        (("tf_slim.ops.variables", "variable_scope"),),  # local_variable, global_variable
    ),
    # TensorFlow split cond/case/while_loop/Assert out of control_flow_ops into the
    # cond, control_flow_case, while_loop and control_flow_assert modules.
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
    # TensorFlow moved stack/unstack from array_ops to array_ops_stack.
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
    """Makes tf-slim 1.1.0 work on the running TensorFlow.

    Idempotent and thread-safe: the first call detects which TensorFlow names that
    tf-slim uses are gone, restores them inside tf-slim's own module namespaces and
    logs (once, at INFO) what it patched; later calls return immediately. On a
    TensorFlow where tf-slim works unmodified this is a no-op.
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
    """Returns whether `install` has run in this process.

    Returns:
      True once `install` has completed.
    """
    return _INSTALLED


def patched() -> Tuple[str, ...]:
    """Returns the TensorFlow names that `install` restored for tf-slim.

    Returns:
      Dotted ``module.name`` strings, e.g. ``"tensorflow.python.framework.ops.Tensor"``;
      empty before `install` or when nothing needed patching.
    """
    return _PATCHED
