"""Tests of slim_nanguard.models: the small models train on the digits, the nets build."""

import numpy as np
import pytest
import tensorflow as tf

import slim_nanguard
from slim_nanguard.app import datasets
from slim_nanguard.app import models


def _train(model_name, steps, *, image_size=None, learning_rate=1e-3, **options):
    """Trains a model on digits batches; returns (losses, test accuracy, logits tensor, graph)."""
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(0)
        dataset, info = datasets.get_dataset("digits", batch_size=64, seed=0, image_size=image_size)
        images, labels = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
        model_fn = models.get_model(model_name, **options)
        logits = model_fn(images, info.num_classes, is_training=True)
        loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
        train_op = tf.compat.v1.train.AdamOptimizer(learning_rate).minimize(loss)

        test_set, _ = datasets.get_dataset(
            "digits", "test", batch_size=300, shuffle=False, repeat=False, image_size=image_size
        )
        test_images, test_labels = tf.compat.v1.data.make_one_shot_iterator(test_set).get_next()
        with tf.compat.v1.variable_scope(tf.compat.v1.get_variable_scope(), reuse=True):
            test_logits = model_fn(test_images, info.num_classes, is_training=False)
        accuracy = tf.reduce_mean(
            tf.cast(tf.equal(tf.argmax(test_logits, 1), test_labels), tf.float32)
        )
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            losses = [session.run([train_op, loss])[1] for _ in range(steps)]
            test_accuracy = session.run(accuracy) if steps else None
    return np.array(losses), test_accuracy, logits, graph


def test_the_registries_cover_every_model():
    assert set(models.MODEL_NAMES) == set(models.DEFAULT_IMAGE_SIZE) == set(models.MIN_IMAGE_SIZE)
    assert models.MODEL_NAMES[:2] == ("mlp", "lenet")
    for name in models.MODEL_NAMES:
        default = models.DEFAULT_IMAGE_SIZE[name]
        assert default is None or default >= models.MIN_IMAGE_SIZE[name]


def test_unknown_model_name_lists_the_choices():
    with pytest.raises(
        ValueError, match=r"'resnet'.*--model_name.*mlp, lenet, cifarnet, cifarnet_bn, resnet_v1_50"
    ):
        models.get_model("resnet")
    with pytest.raises(slim_nanguard.NanGuardError):
        models.get_model("resnet")


def test_unknown_option_lists_the_models_options():
    with pytest.raises(ValueError, match="no option depth.*hidden_units, weight_decay"):
        models.get_model("mlp", depth=3)
    with pytest.raises(ValueError, match="no option dropout_keep_prob.*weight_decay"):
        models.get_model("resnet_v1_50", dropout_keep_prob=0.5)


def test_mlp_learns_the_digits_in_a_few_hundred_steps():
    losses, accuracy, logits, _ = _train("mlp", 300)

    assert logits.shape.as_list() == [64, 10]
    assert np.all(np.isfinite(losses))
    assert losses[-10:].mean() < 0.5 * losses[:10].mean()
    assert accuracy > 0.85


def test_mlp_options_shape_the_layers_and_weight_decay_is_a_regularization_loss():
    with tf.Graph().as_default():
        images = tf.zeros([2, 8, 8, 1])
        models.get_model("mlp", hidden_units=(32,), weight_decay=1e-3)(images, 5, True)
        shapes = {v.op.name: v.shape.as_list() for v in tf.compat.v1.trainable_variables()}
        regularizers = tf.compat.v1.losses.get_regularization_losses()

    assert shapes == {
        "MLP/fc1/weights": [64, 32],
        "MLP/fc1/biases": [32],
        "MLP/logits/weights": [32, 5],
        "MLP/logits/biases": [5],
    }
    assert len(regularizers) == 2


def test_lenet_trains_on_the_8x8_digits():
    losses, accuracy, logits, graph = _train("lenet", 60)

    assert logits.shape.as_list() == [64, 10]
    assert np.all(np.isfinite(losses))
    assert losses[-10:].mean() < 0.5 * losses[:10].mean()
    assert accuracy > 0.5
    names = {v.op.name for v in graph.get_collection("trainable_variables")}
    assert {
        "LeNet/conv1/weights",
        "LeNet/conv2/weights",
        "LeNet/fc3/weights",
        "LeNet/fc4/weights",
    } <= names  # slim's lenet.py names.


def test_lenet_at_28x28_is_slims_lenet_and_drops_out_only_in_training():
    with tf.Graph().as_default():
        images = tf.compat.v1.placeholder(tf.float32, [2, 28, 28, 1])
        model_fn = models.get_model("lenet")
        train_logits = model_fn(images, 10, is_training=True)
        with tf.compat.v1.variable_scope(tf.compat.v1.get_variable_scope(), reuse=True):
            eval_logits = model_fn(images, 10, is_training=False)
        fc3 = [v for v in tf.compat.v1.trainable_variables() if v.op.name == "LeNet/fc3/weights"]
        feed = {images: np.random.RandomState(0).rand(2, 28, 28, 1)}
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            eval_runs = [session.run(eval_logits, feed) for _ in range(2)]
            train_runs = [session.run(train_logits, feed) for _ in range(2)]

    assert fc3[0].shape.as_list() == [7 * 7 * 64, 1024]  # as with slim's 'VALID' pooling.
    np.testing.assert_array_equal(eval_runs[0], eval_runs[1])
    assert not np.array_equal(train_runs[0], train_runs[1])


# name: (image side for the forward run, is_training)
_NET_CASES = {
    "cifarnet": (models.MIN_IMAGE_SIZE["cifarnet"], False),
    "cifarnet_bn": (models.MIN_IMAGE_SIZE["cifarnet_bn"], True),
    "resnet_v1_50": (32, True),
    "resnet_v2_50": (32, True),
    "inception_v1": (models.MIN_IMAGE_SIZE["inception_v1"], False),
    "alexnet_v2": (models.MIN_IMAGE_SIZE["alexnet_v2"], False),
    "vgg_a": (models.MIN_IMAGE_SIZE["vgg_a"], False),
}


def test_every_net_has_a_case():
    assert set(_NET_CASES) == set(models.MODEL_NAMES[2:])


@pytest.mark.parametrize("name", sorted(_NET_CASES))
def test_net_runs_at_its_smallest_size_and_returns_batch_by_classes_logits(name):
    size, is_training = _NET_CASES[name]
    with tf.Graph().as_default():
        images = tf.compat.v1.placeholder(tf.float32, [2, size, size, 3])
        logits = models.get_model(name)(images, 7, is_training=is_training)
        regularizers = tf.compat.v1.losses.get_regularization_losses()
        update_ops = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            values = session.run(logits, {images: np.random.RandomState(0).rand(2, size, size, 3)})

    assert logits.shape.as_list() == [2, 7]
    assert values.shape == (2, 7) and np.all(np.isfinite(values))
    assert regularizers  # the net's own default weight decay.
    if name.startswith("resnet") or name == "cifarnet_bn":
        assert update_ops  # batch norm in training mode.


def test_cifarnet_has_the_gardens_variables_and_cifarnet_bn_batch_norm_in_place_of_biases():
    def variables(name):
        with tf.Graph().as_default():
            models.get_model(name)(tf.zeros([2, 32, 32, 3]), 10, is_training=True)
            return (
                {v.op.name: v.shape.as_list() for v in tf.compat.v1.global_variables()},
                len(tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)),
                len(tf.compat.v1.losses.get_regularization_losses()),
            )

    garden, garden_updates, garden_decays = variables("cifarnet")
    assert garden == {  # research/slim/nets/cifarnet.py's names and shapes at 32x32x3.
        "CifarNet/conv1/weights": [5, 5, 3, 64],
        "CifarNet/conv1/biases": [64],
        "CifarNet/conv2/weights": [5, 5, 64, 64],
        "CifarNet/conv2/biases": [64],
        "CifarNet/fc3/weights": [8 * 8 * 64, 384],
        "CifarNet/fc3/biases": [384],
        "CifarNet/fc4/weights": [384, 192],
        "CifarNet/fc4/biases": [192],
        "CifarNet/logits/weights": [192, 10],
        "CifarNet/logits/biases": [10],
    }
    assert (garden_updates, garden_decays) == (0, 2)  # weight decay on fc3 and fc4 only.
    normed, updates, decays = variables("cifarnet_bn")
    for conv in ("conv1", "conv2"):
        del garden[f"CifarNet/{conv}/biases"]
        for statistic in ("beta", "moving_mean", "moving_variance"):
            garden[f"CifarNet/{conv}/BatchNorm/{statistic}"] = [64]
    assert normed == garden
    assert (updates, decays) == (4, 2)  # each convolution's mean and variance.


def test_net_weight_decay_goes_through_its_arg_scope():
    with tf.Graph().as_default():
        images = tf.zeros([1, 195, 195, 3])
        models.get_model("alexnet_v2", weight_decay=0.0)(images, 3, is_training=False)
        assert not tf.compat.v1.losses.get_regularization_losses()
    with tf.Graph().as_default():
        images = tf.zeros([1, 195, 195, 3])
        models.get_model("alexnet_v2", weight_decay=0.125)(images, 3, is_training=False)
        losses = tf.compat.v1.losses.get_regularization_losses()
        assert losses
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            weights = [v for v in tf.compat.v1.trainable_variables() if "weights" in v.op.name]
            total, values = session.run([tf.add_n(losses), weights])
    np.testing.assert_allclose(total, sum(0.125 * 0.5 * np.sum(w**2) for w in values), rtol=1e-4)


def test_net_larger_than_its_default_averages_its_map_of_logits():
    with tf.Graph().as_default():
        images = tf.compat.v1.placeholder(tf.float32, [2, 256, 256, 3])
        logits = models.get_model("alexnet_v2")(images, 7, is_training=False)
    assert logits.shape.as_list() == [2, 7]


@pytest.mark.parametrize("name", ["inception_v1", "alexnet_v2", "vgg_a"])
def test_net_below_its_minimum_size_says_to_resize(name):
    with tf.Graph().as_default():
        images = tf.zeros([1, 64, 64, 3])
        with pytest.raises(ValueError, match=f"{name} needs images of at least.*image_size"):
            models.get_model(name)(images, 10, is_training=False)
