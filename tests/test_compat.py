"""Tests for slim_nanguard.compat: tf-slim 1.1.0 builds and trains on this TensorFlow.

Each feature is exercised twice:

* without the compatibility layer, in one fresh subprocess (patches are
  process-global, so this process cannot show the unpatched behaviour), which must
  fail with the error naming what TensorFlow removed;
* with :func:`slim_nanguard.compat.install`, here, by running one real training step
  (``create_train_op`` + ``GradientDescentOptimizer``) and checking that the loss is
  finite and the weights moved.
"""

import ast
import json
import os
import subprocess
import sys
import textwrap
import threading
import types

import numpy as np
import pytest
import source_trees
import tensorflow as tf

from slim_nanguard import compat

tf1 = tf.compat.v1

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --------------------------------------------------------------------------------------
# Without compat.install(): one subprocess that tries every feature and reports, as
# JSON, "ok" or "<ExceptionType>: <message>" for each.
# --------------------------------------------------------------------------------------

_UNPATCHED_PROBE = textwrap.dedent(r"""
    import json, os, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import tensorflow as tf
    tf.compat.v1.disable_v2_behavior()
    import tf_slim as slim
    from tf_slim.nets import alexnet, inception_v1, resnet_v1, resnet_v2, vgg

    def images(size):
        return tf.zeros([1, size, size, 3])

    def grads_and_vars():
        var = tf.compat.v1.Variable([1.0, 2.0])
        return [(tf.constant([2.0, 4.0]), var)]

    def resnet_v1_50():
        with slim.arg_scope(resnet_v1.resnet_arg_scope()):
            resnet_v1.resnet_v1_50(images(64), 3)

    def resnet_v2_50():
        with slim.arg_scope(resnet_v2.resnet_arg_scope()):
            resnet_v2.resnet_v2_50(images(64), 3)

    def inception_v1_():
        with slim.arg_scope(inception_v1.inception_v1_arg_scope()):
            inception_v1.inception_v1(images(224), 3)

    features = {
        "batch_norm_fused": lambda: slim.batch_norm(images(4), fused=True),
        "batch_norm_unfused": lambda: slim.batch_norm(images(4), fused=False),
        "resnet_v1_50": resnet_v1_50,
        "resnet_v2_50": resnet_v2_50,
        "inception_v1": inception_v1_,
        "vgg_a": lambda: vgg.vgg_a(images(224), 3),
        "alexnet_v2": lambda: alexnet.alexnet_v2(images(224), 3),
        "local_variable": lambda: slim.local_variable(1.0),
        "constant_value": lambda: slim.layers.utils.constant_value(tf.constant(1.0)),
        "learning.multiply_gradients": lambda: slim.learning.multiply_gradients(
            grads_and_vars(), {"Variable": 2.0}),
        "learning.clip_gradient_norms": lambda: slim.learning.clip_gradient_norms(
            grads_and_vars(), 1.0),
        "learning.add_gradients_summaries": lambda: slim.learning.add_gradients_summaries(
            grads_and_vars()),
        "training.multiply_gradients": lambda: slim.training.multiply_gradients(
            grads_and_vars(), {"Variable": 2.0}),
        "training.clip_gradient_norms": lambda: slim.training.clip_gradient_norms(
            grads_and_vars(), 1.0),
        "training.add_gradients_summaries": lambda: slim.training.add_gradients_summaries(
            grads_and_vars()),
    }
    results = {}
    for name, build in features.items():
        with tf.Graph().as_default():
            try:
                build()
                results[name] = "ok"
            except Exception as e:  # what we are after
                results[name] = "%s: %s" % (type(e).__name__, e)
    results["compat_imported"] = "slim_nanguard.compat" in sys.modules
    print("RESULTS=" + json.dumps(results))
""")

_NO_TF_KERAS_LEGACY = "ModuleNotFoundError: No module named 'tf_keras.legacy_tf_layers'"
_NO_OPS_TENSOR = (
    "AttributeError: module 'tensorflow.python.framework.ops' has no attribute 'Tensor'"
)
_NO_OPS_INDEXED_SLICES = (
    "AttributeError: module 'tensorflow.python.framework.ops' has no attribute 'IndexedSlices'"
)
_NO_VARIABLE_SCOPE_VARIABLE = (
    "AttributeError: module 'tensorflow.python.ops.variable_scope' has no attribute 'variable'"
)

# What each feature does on TensorFlow 2.21 / tf-keras 2.21 without the compat layer.
_EXPECTED_UNPATCHED = {
    "batch_norm_fused": _NO_TF_KERAS_LEGACY,
    "batch_norm_unfused": _NO_TF_KERAS_LEGACY,
    "resnet_v1_50": _NO_TF_KERAS_LEGACY,
    "resnet_v2_50": _NO_TF_KERAS_LEGACY,
    "inception_v1": _NO_TF_KERAS_LEGACY,
    # vgg_a and alexnet_v2 use no batch norm: they build unpatched and are tested
    # below only to show that the compat layer does not break them.
    "vgg_a": "ok",
    "alexnet_v2": "ok",
    "local_variable": _NO_VARIABLE_SCOPE_VARIABLE,
    "constant_value": _NO_OPS_TENSOR,
    "learning.multiply_gradients": _NO_OPS_TENSOR,
    "learning.clip_gradient_norms": _NO_OPS_INDEXED_SLICES,
    "learning.add_gradients_summaries": _NO_OPS_INDEXED_SLICES,
    "training.multiply_gradients": _NO_OPS_INDEXED_SLICES,
    "training.clip_gradient_norms": _NO_OPS_INDEXED_SLICES,
    "training.add_gradients_summaries": _NO_OPS_INDEXED_SLICES,
}


def _tf_at_least_tested_version() -> bool:
    major, minor = (int(x) for x in tf.__version__.split(".")[:2])
    return (major, minor) >= (2, 21)


@pytest.fixture(scope="module")
def unpatched_results():
    """Runs the probe once in a subprocess that never imports slim_nanguard.compat."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run(
        [sys.executable, "-c", _UNPATCHED_PROBE],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=REPO_ROOT,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS=")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    results = json.loads(lines[-1][len("RESULTS=") :])
    assert results.pop("compat_imported") is False
    return results


@pytest.mark.skipif(
    not _tf_at_least_tested_version(), reason="expected failures are those of TensorFlow 2.21"
)
@pytest.mark.parametrize("feature", sorted(_EXPECTED_UNPATCHED))
def test_feature_without_compat(unpatched_results, feature):
    assert unpatched_results[feature].startswith(_EXPECTED_UNPATCHED[feature]), unpatched_results[
        feature
    ]


# --------------------------------------------------------------------------------------
# With compat.install().
# --------------------------------------------------------------------------------------


def _patched():
    """The names `compat.install` restored (its private record: no public name needed it)."""
    return compat._PATCHED  # pylint: disable=protected-access


@pytest.fixture(scope="module", autouse=True)
def installed():
    compat.install()
    return _patched()


def test_install_is_idempotent_and_thread_safe(installed):
    threads = [threading.Thread(target=compat.install) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    compat.install()
    assert _patched() is installed  # the first call's record: no call patched again
    assert len(set(installed)) == len(installed)


def test_patches_only_what_this_tensorflow_removed(installed):
    import tf_slim.learning
    from tensorflow.python.framework import ops
    from tensorflow.python.ops import array_ops
    from tensorflow.python.ops import control_flow_ops
    from tensorflow.python.ops import variable_scope

    expected = set()
    for module, names in (
        (ops, ("Tensor", "IndexedSlices")),
        (variable_scope, ("variable",)),
        (control_flow_ops, ("cond", "case", "while_loop", "Assert")),
        (array_ops, ("stack", "unstack")),
    ):
        expected.update(f"{module.__name__}.{n}" for n in names if not hasattr(module, n))
    try:
        import tf_keras.legacy_tf_layers.normalization  # noqa: F401
    except ImportError:
        expected.add("tensorflow.python.layers.normalization.BatchNormalization")
    assert set(installed) == expected
    if _tf_at_least_tested_version():
        assert len(expected) == 10  # everything listed above is gone in TF 2.21

    # TensorFlow's own modules are untouched; tf-slim sees the restored names.
    assert ("tensorflow.python.framework.ops.Tensor" in installed) == (not hasattr(ops, "Tensor"))
    assert tf_slim.learning.ops.Tensor is tf.Tensor
    assert tf_slim.learning.ops.IndexedSlices is tf.IndexedSlices
    assert tf_slim.learning.ops.GraphKeys is ops.GraphKeys  # forwarded to the real module
    # (tf_slim's star import shadows the tf_slim.ops package attribute: use sys.modules.)
    assert sys.modules["tf_slim.ops.variables"].variable_scope.variable is tf1.Variable


def test_no_tf_slim_module_uses_a_missing_tensorflow_name():
    """Scans every tf_slim module for `alias.name` where alias is a TF module."""
    import importlib

    import tf_slim

    root = os.path.dirname(tf_slim.__file__)
    missing = []
    scanned = 0
    for dirpath, _, filenames in os.walk(root):
        for filename in filenames:
            if not filename.endswith(".py") or filename.endswith("_test.py"):
                continue
            path = os.path.join(dirpath, filename)
            rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
            name = "tf_slim" if rel == "__init__" else "tf_slim." + rel.replace(".__init__", "")
            module = importlib.import_module(name)
            tree = source_trees.parse(path)
            scanned += 1
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)):
                    continue
                target = getattr(module, node.value.id, None)
                if not (
                    isinstance(target, types.ModuleType)
                    and target.__name__.startswith("tensorflow")
                ):
                    continue
                try:
                    found = hasattr(target, node.attr)
                except ImportError:
                    found = False
                if not found:
                    missing.append(f"{name}:{node.lineno}: {node.value.id}.{node.attr}")
    assert scanned > 40
    assert not missing, missing


# --------------------------------------------------------------------------------------
# One training step per feature.
# --------------------------------------------------------------------------------------


def _train_one_step(loss, watch, extra_fetches=None, **create_train_op_kwargs):
    """Runs one SGD step; returns (loss, {var: (before, after)}, extra values)."""
    import tf_slim as slim

    optimizer = tf1.train.GradientDescentOptimizer(0.01)
    train_op = slim.learning.create_train_op(loss, optimizer, **create_train_op_kwargs)
    with tf1.Session() as sess:
        sess.run([tf1.global_variables_initializer(), tf1.local_variables_initializer()])
        before = sess.run(watch)
        loss_value = sess.run(train_op)
        after = sess.run(watch)
        extra = sess.run(extra_fetches) if extra_fetches is not None else None
    assert np.isfinite(loss_value), loss_value
    values = {v.op.name: (b, a) for v, b, a in zip(watch, before, after)}
    return float(loss_value), values, extra


def _assert_changed(values):
    for name, (before, after) in values.items():
        assert np.all(np.isfinite(after)), name
        assert not np.allclose(before, after), f"{name} did not change"


def _images_and_labels(batch, size, num_classes):
    rng = np.random.RandomState(0)
    images = tf.constant(rng.uniform(-1, 1, (batch, size, size, 3)).astype(np.float32))
    labels = tf.one_hot(np.arange(batch) % num_classes, num_classes)
    return images, labels


def _classification_loss(logits, labels):
    import tf_slim as slim

    logits = tf.reshape(logits, [tf.shape(logits)[0], -1])
    slim.losses.softmax_cross_entropy(logits, labels)
    return slim.losses.get_total_loss()


@pytest.mark.parametrize("fused", [True, False])
def test_batch_norm_trains(fused):
    import tf_slim as slim

    with tf.Graph().as_default():
        images, labels = _images_and_labels(2, 4, 3)
        net = slim.conv2d(
            images,
            4,
            [3, 3],
            normalizer_fn=slim.batch_norm,
            normalizer_params={"fused": fused, "is_training": True, "scale": True},
        )
        logits = slim.fully_connected(slim.flatten(net), 3, activation_fn=None)
        loss = _classification_loss(logits, labels)
        bn_vars = {
            v.op.name.split("/")[-1]: v for v in tf1.global_variables() if "BatchNorm" in v.op.name
        }
        assert set(bn_vars) == {"beta", "gamma", "moving_mean", "moving_variance"}
        _, values, _ = _train_one_step(
            loss,
            [bn_vars["beta"], bn_vars["gamma"], bn_vars["moving_mean"], bn_vars["moving_variance"]],
        )
    # beta/gamma are trained; the moving statistics are updated by the UPDATE_OPS
    # that create_train_op runs with the step.
    _assert_changed(values)


def _net_step(build, size, batch=1, num_classes=3, watch_scopes=()):
    with tf.Graph().as_default():
        images, labels = _images_and_labels(batch, size, num_classes)
        logits = build(images, num_classes)
        assert logits.shape[-1] == num_classes
        loss = _classification_loss(logits, labels)
        trainable = tf1.trainable_variables()
        watch = [next(v for v in trainable if scope in v.op.name) for scope in watch_scopes]
        _, values, _ = _train_one_step(loss, watch)
    _assert_changed(values)
    return values


def test_resnet_v1_50_trains():
    import tf_slim as slim
    from tf_slim.nets import resnet_v1

    def build(images, num_classes):
        with slim.arg_scope(resnet_v1.resnet_arg_scope()):
            return resnet_v1.resnet_v1_50(images, num_classes)[0]

    _net_step(
        build,
        64,
        batch=2,
        watch_scopes=(
            "conv1/BatchNorm/beta",
            "block4/unit_3/bottleneck_v1/conv3/weights",
            "logits/weights",
        ),
    )


def test_resnet_v2_50_trains():
    import tf_slim as slim
    from tf_slim.nets import resnet_v2

    def build(images, num_classes):
        with slim.arg_scope(resnet_v2.resnet_arg_scope()):
            return resnet_v2.resnet_v2_50(images, num_classes)[0]

    _net_step(
        build, 64, batch=2, watch_scopes=("conv1/weights", "postnorm/gamma", "logits/weights")
    )


def test_inception_v1_trains():
    import tf_slim as slim
    from tf_slim.nets import inception_v1

    # The 7x7 VALID average pool before the logits needs a 224x224 input.
    def build(images, num_classes):
        with slim.arg_scope(inception_v1.inception_v1_arg_scope()):
            return inception_v1.inception_v1(images, num_classes)[0]

    _net_step(
        build, 224, watch_scopes=("Conv2d_1a_7x7/BatchNorm/beta", "Logits/Conv2d_0c_1x1/weights")
    )


def test_vgg_a_trains():
    from tf_slim.nets import vgg

    # fc6 is a 7x7 VALID convolution: the net needs a 224x224 input.
    _net_step(
        lambda images, n: vgg.vgg_a(images, n)[0],
        224,
        watch_scopes=("conv1/conv1_1/weights", "fc8/weights"),
    )


def test_alexnet_v2_trains():
    from tf_slim.nets import alexnet

    # fc6 is a 5x5 VALID convolution: the net needs a 224x224 input.
    _net_step(
        lambda images, n: alexnet.alexnet_v2(images, n)[0],
        224,
        watch_scopes=("conv1/weights", "fc8/weights"),
    )


def test_local_variable_in_training_step():
    import tf_slim as slim

    with tf.Graph().as_default():
        weights = tf1.Variable([1.0, -2.0], name="weights")
        loss = tf.reduce_sum(tf.square(weights))  # 5.0
        # A step counter kept in a local variable, as streaming metrics do.
        steps_seen = slim.local_variable(0, name="steps_seen")
        constant = slim.global_variable(7, name="constant")
        assert steps_seen in tf1.local_variables()
        assert steps_seen not in tf1.global_variables() + tf1.trainable_variables()
        assert constant in tf1.global_variables()
        assert constant not in tf1.trainable_variables()
        tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, tf1.assign_add(steps_seen, 1))
        loss_value, values, extra = _train_one_step(
            loss, [weights], extra_fetches=[steps_seen, constant]
        )
    # The reported loss may be read before or after the update (ref variables).
    assert 4.8 <= loss_value <= 5.0 + 1e-5
    assert extra[0] == 1  # the update op ran once, with the step
    assert extra[1] == 7
    np.testing.assert_allclose(values["weights"][1], [1.0 - 0.02, -2.0 + 0.04], rtol=1e-6)


def test_constant_value():
    import tf_slim as slim

    with tf.Graph().as_default():
        assert bool(slim.layers.utils.constant_value(tf.constant(True))) is True
        assert slim.layers.utils.constant_value(tf1.placeholder(tf.bool)) is None
        assert slim.layers.utils.constant_value(tf1.Variable(1.0)) is None
        assert slim.layers.utils.constant_value(3) == 3
        with pytest.raises(ValueError, match="wrong type"):
            slim.layers.utils.constant_value(tf.constant(1.0), dtype=tf.int32)


def _embedding_grads():
    """A dense and an IndexedSlices gradient (from tf.gather) with known values."""
    dense = tf1.Variable([1.0, 2.0], name="dense")
    table = tf1.Variable([[1.0, 1.0], [3.0, 4.0]], name="table")
    row = tf.gather(table, [1])
    loss = tf.reduce_sum(tf.square(dense)) + tf.reduce_sum(tf.square(row))
    grads = tf1.train.GradientDescentOptimizer(1.0).compute_gradients(loss)
    return loss, dense, table, grads


@pytest.mark.parametrize("module_name", ["learning", "training"])
def test_gradient_helpers(module_name):
    import tf_slim as slim

    helpers = getattr(slim, module_name)
    with tf.Graph().as_default():
        _, dense, table, grads = _embedding_grads()
        assert isinstance(grads[1][0], tf.IndexedSlices)
        multiplied = helpers.multiply_gradients(grads, {dense: 2.0, table: tf.constant(0.5)})
        clipped = helpers.clip_gradient_norms(grads, 1.0)
        summaries = helpers.add_gradients_summaries(grads)
        assert len(summaries) == 4  # histogram + norm per variable
        assert isinstance(multiplied[1][0], tf.IndexedSlices)
        assert isinstance(clipped[1][0], tf.IndexedSlices)
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            mult, clip = sess.run([[g for g, _ in multiplied], [g for g, _ in clipped]])
            sess.run(summaries)
    np.testing.assert_allclose(mult[0], [4.0, 8.0])  # 2 * (2 * [1, 2])
    np.testing.assert_allclose(mult[1].values, [[3.0, 4.0]])  # 0.5 * (2 * [3, 4])
    np.testing.assert_allclose(clip[0], np.array([2.0, 4.0]) / np.hypot(2.0, 4.0), rtol=1e-6)
    np.testing.assert_allclose(clip[1].values, [[0.6, 0.8]], rtol=1e-6)


def test_create_train_op_with_gradient_helpers():
    with tf.Graph().as_default():
        loss, dense, table, _ = _embedding_grads()
        loss_value, values, _ = _train_one_step(
            loss,
            [dense, table],
            clip_gradient_norm=5.0,
            summarize_gradients=True,
            gradient_multipliers={dense: 2.0},
        )
    assert 29.0 < loss_value <= 30.0 + 1e-5  # read before or after the update
    # dense: grad [2, 4] times 2 -> [4, 8] (norm sqrt(80)), clipped to norm 5; lr 0.01.
    np.testing.assert_allclose(
        values["dense"][1],
        [1.0, 2.0] - 0.01 * 5.0 * np.array([4.0, 8.0]) / np.sqrt(80.0),
        rtol=1e-6,
    )
    # table row 1: grad [6, 8] has norm 10, clipped to 5 -> [3, 4]; row 0 untouched.
    np.testing.assert_allclose(
        values["table"][1], [[1.0, 1.0], [3.0 - 0.03, 4.0 - 0.04]], rtol=1e-6
    )


def test_other_restored_control_flow_and_stack_users():
    """Paths that use control_flow_ops.{cond,case,while_loop,Assert}, array_ops.stack."""
    import tf_slim as slim
    from tf_slim.layers import utils
    from tf_slim.losses import metric_learning
    from tf_slim.metrics import histogram_ops

    with tf.Graph().as_default():
        flag = tf1.placeholder(tf.bool, [])
        chosen = utils.smart_cond(flag, lambda: tf.constant(1.0), lambda: tf.constant(2.0))
        values, update = slim.metrics.streaming_concat(tf.constant([1.0, 2.0]))
        auc, auc_update = histogram_ops.auc_using_histogram(
            tf.constant([True, False, True]), tf.constant([0.9, 0.1, 0.8]), [0.0, 1.0], nbins=10
        )
        # The while_loop part of the cluster loss (cluster_loss itself needs scikit-learn).
        clustering = metric_learning.compute_gt_cluster_score(
            metric_learning.pairwise_distance(tf.constant([[0.0, 0.0], [0.1, 0.0], [5.0, 5.0]])),
            tf.constant([0, 0, 1]),
        )
        legacy = slim.layers.legacy_fully_connected(tf.ones([2, 3]), 2)
        with tf1.Session() as sess:
            sess.run([tf1.global_variables_initializer(), tf1.local_variables_initializer()])
            assert sess.run(chosen, {flag: False}) == 2.0
            sess.run(update)
            np.testing.assert_allclose(sess.run(values), [1.0, 2.0])
            sess.run(auc_update)
            assert sess.run(auc) == pytest.approx(1.0, abs=0.05)
            assert np.isfinite(sess.run(clustering))
            assert sess.run(legacy).shape == (2, 2)
