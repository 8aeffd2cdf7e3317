"""Image classifiers in TF-Slim layers, by name: small ones that train in seconds, and tf_slim.nets.

`get_model` returns a model function ``fn(images, num_classes, is_training) -> logits``
that builds the model in the current graph (``tf.compat.v1`` graph mode) from
``images`` float32 ``[B, H, W, C]`` and returns ``logits`` float32 ``[B, num_classes]``.
Weight decay, where asked for, goes into the graph's regularization losses
(``tf.compat.v1.losses.get_regularization_loss()``); batch-norm statistics updates go into
``tf.compat.v1.GraphKeys.UPDATE_OPS``, as usual for TF-Slim.

The models, by name (the launcher's ``--model_name``):

* ``mlp``: flatten, then fully connected ReLU layers (256-256 by default), then logits. Any
  image size; made for the 8x8 digits.
* ``lenet``: the LeNet of tensorflow/models ``research/slim/nets/lenet.py`` (conv 32 5x5,
  pool, conv 64 5x5, pool, fc 1024, dropout, logits), with 'SAME' pooling so it also takes
  small or odd sizes such as the 8x8 digits; identical to slim's at its 28x28.
* ``resnet_v1_50``, ``resnet_v2_50``, ``inception_v1``, ``vgg_a``, ``alexnet_v2``: the
  ``tf_slim.nets`` classifiers under their own arg scopes. They need
  ``slim_nanguard.compat.install()`` on current TensorFlow (``slim.batch_norm`` is broken
  without it), which the model function calls itself. At the net's default image size the
  variables and the graph are those of tf_slim.nets (so slim checkpoints fit); at larger
  sizes the final spatial logits are averaged to ``[B, num_classes]``.

* ``cifarnet``: the CifarNet of tensorflow/models ``research/slim/nets/cifarnet.py``
  (conv 64 5x5, pool, LRN, conv 64 5x5, LRN, pool, fc 384, dropout, fc 192, logits; weight
  decay on the fully connected weights), with its variable names; 32x32 RGB is its size.
* ``cifarnet_bn``: the same with ``slim.batch_norm`` after each convolution (the builder's
  ``batch_norm=True``), as TF-Slim users add it with an arg scope.

One more builder, ``mobilenet_v1``, is written here from its paper for the benchmark
(``slim-nanguard-benchmark``); it is not in `MODELS`.

To build a second copy sharing the variables (e.g. an evaluation tower), call the model
function under ``tf.compat.v1.variable_scope(tf.compat.v1.get_variable_scope(), reuse=True)``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence, Tuple

import tensorflow as tf
import tf_slim as slim
from absl import logging as absl_logging

from slim_nanguard import NanGuardError

# absl's logger itself: its module functions would configure Python's root logger in a
# script that is not run by absl's app.run (see slim_nanguard/_log.py).
logging = absl_logging.get_absl_logger()

__all__ = [
    "DEFAULT_IMAGE_SIZE",
    "MIN_IMAGE_SIZE",
    "MODELS",
    "MODEL_NAMES",
    "ModelError",
    "ModelFn",
    "ModelSpec",
    "SlimNet",
    "cifarnet",
    "get_model",
    "lenet",
    "mlp",
    "mobilenet_v1",
]


class ModelError(NanGuardError, ValueError):
    """An unknown model or option, or images the model cannot take; says what to change.

    A ``ValueError`` as well, so that ``except ValueError`` clauses catch it.
    """


class ModelFn(Protocol):
    """Builds a classifier in the current graph."""

    def __call__(self, images: tf.Tensor, num_classes: int, is_training: bool) -> tf.Tensor:
        """Returns the logits.

        Args:
          images: Float32 ``[batch, height, width, channels]``.
          num_classes: The number of classes.
          is_training: Build for training (dropout on, batch norm in training mode) or for
            inference.

        Returns:
          Float32 logits ``[batch, num_classes]``.
        """


def mlp(
    images: tf.Tensor,
    num_classes: int,
    is_training: bool,
    *,
    hidden_units: Sequence[int] = (256, 256),
    weight_decay: float = 0.0,
    scope: str = "MLP",
) -> tf.Tensor:
    """A multi-layer perceptron: flatten, ReLU fully connected layers, linear logits.

    Args:
      images: Float32 ``[batch, height, width, channels]``, any size.
      num_classes: The number of classes.
      is_training: Unused (the MLP has no dropout or batch norm); part of the signature.
      hidden_units: The width of each hidden layer, e.g. ``(256, 256)``; ``()`` gives a
        linear classifier.
      weight_decay: The L2 regularization coefficient of the weights (0 disables it).
      scope: The variable scope.

    Returns:
      Float32 logits ``[batch, num_classes]``.
    """
    del is_training  # No layer behaves differently in training.
    with tf.compat.v1.variable_scope(scope, "MLP", [images]):
        with slim.arg_scope(
            [slim.fully_connected],
            activation_fn=tf.nn.relu,
            weights_regularizer=slim.l2_regularizer(weight_decay),
        ):
            net = slim.flatten(images)
            for index, units in enumerate(hidden_units):
                net = slim.fully_connected(net, units, scope=f"fc{index + 1}")
            return slim.fully_connected(net, num_classes, activation_fn=None, scope="logits")


def lenet(
    images: tf.Tensor,
    num_classes: int,
    is_training: bool,
    *,
    dropout_keep_prob: float = 0.5,
    weight_decay: float = 0.0,
    scope: str = "LeNet",
) -> tf.Tensor:
    """LeNet as in tensorflow/models ``research/slim/nets/lenet.py``, with 'SAME' pooling.

    The variable names match slim's ``LeNet/conv1`` ... ``LeNet/fc4``. Pooling pads ('SAME')
    so that any image size works (slim's 'VALID' pooling is the same at 28x28).

    Args:
      images: Float32 ``[batch, height, width, channels]``; 28x28 is LeNet's size, 8x8
        (the digits) works too.
      num_classes: The number of classes.
      is_training: Dropout is applied only in training.
      dropout_keep_prob: The fraction of the fc3 activations kept by dropout.
      weight_decay: The L2 regularization coefficient of the weights (0 disables it).
      scope: The variable scope.

    Returns:
      Float32 logits ``[batch, num_classes]``.
    """
    with tf.compat.v1.variable_scope(scope, "LeNet", [images]):
        with slim.arg_scope(
            [slim.conv2d, slim.fully_connected],
            weights_regularizer=slim.l2_regularizer(weight_decay),
            weights_initializer=tf.compat.v1.truncated_normal_initializer(stddev=0.1),
            activation_fn=tf.nn.relu,
        ):
            with slim.arg_scope([slim.max_pool2d], padding="SAME"):
                net = slim.conv2d(images, 32, [5, 5], scope="conv1")
                net = slim.max_pool2d(net, [2, 2], 2, scope="pool1")
                net = slim.conv2d(net, 64, [5, 5], scope="conv2")
                net = slim.max_pool2d(net, [2, 2], 2, scope="pool2")
                net = slim.flatten(net)
                net = slim.fully_connected(net, 1024, scope="fc3")
                net = slim.dropout(
                    net, dropout_keep_prob, is_training=is_training, scope="dropout3"
                )
                return slim.fully_connected(net, num_classes, activation_fn=None, scope="fc4")


def cifarnet(
    images: tf.Tensor,
    num_classes: int,
    is_training: bool,
    *,
    dropout_keep_prob: float = 0.5,
    weight_decay: float = 0.004,
    batch_norm: bool = False,
    scope: str = "CifarNet",
) -> tf.Tensor:
    """CifarNet, the CIFAR-10 net of tensorflow/models ``research/slim/nets/cifarnet.py``.

    Two 5x5 convolutions of 64 filters, each followed by 2x2 max pooling and local response
    normalization, then fully connected layers of 384 and 192 units and linear logits.
    Written here from that architecture (tf_slim.nets has no CifarNet). Without batch norm
    the variables are the garden's (``CifarNet/conv1/weights`` ... ``CifarNet/logits``).

    Args:
      images: Float32 ``[batch, height, width, channels]``; 32x32x3 is its size, any side
        from 4 builds.
      num_classes: The number of classes.
      is_training: Dropout (after the 384-unit layer) is applied only in training, and batch
        norm (if on) is in training mode.
      dropout_keep_prob: The fraction of those activations kept by dropout.
      weight_decay: The L2 regularization coefficient of the fully connected weights.
      batch_norm: Put ``slim.batch_norm`` (decay 0.9, statistics updates in ``UPDATE_OPS``)
        after each convolution, in place of its biases, through an arg scope as TF-Slim's
        nets do; needs ``slim_nanguard.compat.install()``, which it then calls itself.
      scope: The variable scope.

    Returns:
      Float32 logits ``[batch, num_classes]``.
    """

    def normalize(net, name):
        return tf.nn.local_response_normalization(
            net, depth_radius=4, bias=1.0, alpha=0.001 / 9.0, beta=0.75, name=name
        )

    if batch_norm:
        from slim_nanguard import compat  # pylint: disable=import-outside-toplevel

        compat.install()
    with tf.compat.v1.variable_scope(scope, "CifarNet", [images]):
        with (
            slim.arg_scope(
                [slim.conv2d],
                activation_fn=tf.nn.relu,
                weights_initializer=tf.compat.v1.truncated_normal_initializer(stddev=0.05),
            ),
            # Only with batch_norm: a caller's own arg scopes are left as they are without.
            slim.arg_scope([slim.conv2d] if batch_norm else [], normalizer_fn=slim.batch_norm),
            slim.arg_scope(
                [slim.batch_norm] if batch_norm else [], is_training=is_training, decay=0.9
            ),
            slim.arg_scope(
                [slim.fully_connected],
                activation_fn=tf.nn.relu,
                weights_initializer=tf.compat.v1.truncated_normal_initializer(stddev=0.04),
                weights_regularizer=slim.l2_regularizer(weight_decay),
                biases_initializer=tf.compat.v1.constant_initializer(0.1),
            ),
        ):
            net = slim.conv2d(images, 64, [5, 5], scope="conv1")
            net = normalize(slim.max_pool2d(net, [2, 2], 2, scope="pool1"), "norm1")
            net = slim.conv2d(net, 64, [5, 5], scope="conv2")
            net = slim.max_pool2d(normalize(net, "norm2"), [2, 2], 2, scope="pool2")
            net = slim.fully_connected(slim.flatten(net), 384, scope="fc3")
            net = slim.dropout(net, dropout_keep_prob, is_training=is_training, scope="dropout3")
            net = slim.fully_connected(net, 192, scope="fc4")
            return slim.fully_connected(
                net,
                num_classes,
                activation_fn=None,
                weights_initializer=tf.compat.v1.truncated_normal_initializer(stddev=1 / 192),
                biases_initializer=tf.compat.v1.zeros_initializer(),
                weights_regularizer=None,
                scope="logits",
            )


# MobileNet v1's 13 depthwise-separable blocks: (pointwise filters, stride) before the depth
# multiplier.
_MOBILENET_V1_BLOCKS = (
    (64, 1),
    (128, 2),
    (128, 1),
    (256, 2),
    (256, 1),
    (512, 2),
    (512, 1),
    (512, 1),
    (512, 1),
    (512, 1),
    (512, 1),
    (1024, 2),
    (1024, 1),
)


def mobilenet_v1(
    images: tf.Tensor,
    num_classes: int,
    is_training: bool,
    *,
    depth_multiplier: float = 1.0,
    min_depth: int = 8,
    dropout_keep_prob: float = 0.999,
    weight_decay: float = 4e-5,
    scope: str = "MobilenetV1",
) -> tf.Tensor:
    """MobileNet v1 (Howard et al. 2017) in TF-Slim layers, with batch norm and ReLU6.

    A 3x3 convolution of stride 2, then 13 blocks of a 3x3 depthwise convolution and a 1x1
    pointwise one, each followed by batch norm and ReLU6, then global average pooling,
    dropout and 1x1 logits. Written here from the paper (tf_slim.nets has no MobileNet);
    not registered in `MODELS`, the benchmark builds it. Needs
    ``slim_nanguard.compat.install()`` (slim.batch_norm), which it calls itself.

    Args:
      images: Float32 ``[batch, height, width, channels]``, any size (224x224x3 is the
        paper's; the benchmark uses 32x32).
      num_classes: The number of classes.
      is_training: Batch norm in training mode (statistics updates in ``UPDATE_OPS``) and
        dropout on.
      depth_multiplier: Multiplies every layer's filters (the paper's width multiplier).
      min_depth: The fewest filters a layer gets.
      dropout_keep_prob: The fraction of the pooled features kept by dropout.
      weight_decay: The L2 regularization coefficient of the convolution weights.
      scope: The variable scope.

    Returns:
      Float32 logits ``[batch, num_classes]``.
    """
    from slim_nanguard import compat  # pylint: disable=import-outside-toplevel

    compat.install()

    def depth(filters):
        return max(int(filters * depth_multiplier), min_depth)

    with tf.compat.v1.variable_scope(scope, "MobilenetV1", [images]):
        with (
            slim.arg_scope(
                [slim.conv2d, slim.separable_conv2d],
                activation_fn=tf.nn.relu6,
                normalizer_fn=slim.batch_norm,
                weights_initializer=tf.compat.v1.truncated_normal_initializer(stddev=0.09),
                padding="SAME",
            ),
            slim.arg_scope(
                [slim.batch_norm],
                is_training=is_training,
                decay=0.9997,
                epsilon=0.001,
                center=True,
                scale=True,
            ),
            slim.arg_scope([slim.conv2d], weights_regularizer=slim.l2_regularizer(weight_decay)),
        ):
            net = slim.conv2d(images, depth(32), [3, 3], stride=2, scope="Conv2d_0")
            for index, (filters, stride) in enumerate(_MOBILENET_V1_BLOCKS):
                net = slim.separable_conv2d(
                    net,
                    None,
                    [3, 3],
                    depth_multiplier=1,
                    stride=stride,
                    scope=f"Conv2d_{index + 1}_depthwise",
                )
                net = slim.conv2d(
                    net, depth(filters), [1, 1], scope=f"Conv2d_{index + 1}_pointwise"
                )
            net = tf.reduce_mean(net, [1, 2], keepdims=True, name="AvgPool")
            net = slim.dropout(net, dropout_keep_prob, is_training=is_training, scope="Dropout")
            net = slim.conv2d(
                net,
                num_classes,
                [1, 1],
                activation_fn=None,
                normalizer_fn=None,
                biases_initializer=tf.compat.v1.zeros_initializer(),
                scope="Logits",
            )
            return tf.squeeze(net, [1, 2], name="logits")


@dataclasses.dataclass(frozen=True)
class SlimNet:
    """Where a ``tf_slim.nets`` classifier lives.

    Attributes:
      module: The module of ``tf_slim.nets``, e.g. ``resnet_v1``.
      function: The network function in it, e.g. ``resnet_v1_50``.
      arg_scope: The function in it that gives the net's arg scope.
      has_dropout: Whether the net takes ``dropout_keep_prob`` (and ``spatial_squeeze``).
    """

    module: str
    function: str
    arg_scope: str
    has_dropout: bool


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Everything the launcher knows about one model: how to build it and what it takes.

    Attributes:
      name: The model's name (the launcher's ``--model_name``).
      build: ``fn(images, num_classes, is_training, **options) -> logits``.
      options: The keyword options `get_model` passes on to `build`.
      default_image_size: The image side the model is made for; None: any, the launcher
        feeds the dataset's own size.
      min_image_size: The smallest image side the model can be built for.
      channels: The image channels the model takes (3: RGB, as the tf_slim.nets and their
        checkpoints do); None: any, the dataset's own.
      slim_net: For a ``tf_slim.nets`` classifier, where it lives; such a model needs
        ``slim_nanguard.compat.install()``, which its `build` calls. None for the small
        models of this module.
    """

    name: str
    build: Callable[..., tf.Tensor]
    options: Tuple[str, ...]
    default_image_size: Optional[int]
    min_image_size: int = 1
    channels: Optional[int] = None
    slim_net: Optional[SlimNet] = None


def _keyword_options(fn: Callable[..., tf.Tensor]) -> Tuple[str, ...]:
    return tuple(
        p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY
    )


def _net(
    images: tf.Tensor,
    num_classes: int,
    is_training: bool,
    *,
    name: str,
    weight_decay: Optional[float] = None,
    dropout_keep_prob: Optional[float] = None,
) -> tf.Tensor:
    """Builds a tf_slim.nets classifier; returns logits [batch, num_classes]."""
    _check_images(name, images)
    # Imported here, not at the top: compat is the TF-2 compatibility layer for tf-slim
    # (slim.batch_norm fails on current TensorFlow without it), and the small models do not
    # need it. install() is expected to be idempotent.
    from slim_nanguard import compat  # pylint: disable=import-outside-toplevel

    compat.install()
    from tf_slim import nets  # pylint: disable=import-outside-toplevel

    spec = MODELS[name].slim_net
    module = getattr(nets, spec.module)
    net_fn = getattr(module, spec.function)
    scope_fn = getattr(module, spec.arg_scope)
    kwargs: dict[str, Any] = {"num_classes": num_classes, "is_training": is_training}
    if spec.has_dropout:
        kwargs["spatial_squeeze"] = False  # Squeezed below, after checking the map is 1x1.
        if dropout_keep_prob is not None:
            kwargs["dropout_keep_prob"] = dropout_keep_prob
    elif dropout_keep_prob is not None:
        raise ModelError(f"Model {name} has no dropout: leave dropout_keep_prob unset.")
    scope_kwargs = {} if weight_decay is None else {"weight_decay": weight_decay}
    with slim.arg_scope(scope_fn(**scope_kwargs)):
        net, _ = net_fn(images, **kwargs)
    return _to_logits(net, name)


def _slim_net(name: str, net: SlimNet, min_image_size: int) -> ModelSpec:
    return ModelSpec(
        name=name,
        build=functools.partial(_net, name=name),
        options=("weight_decay", "dropout_keep_prob") if net.has_dropout else ("weight_decay",),
        default_image_size=224,
        min_image_size=min_image_size,
        channels=3,
        slim_net=net,
    )


# The smallest image sides: the resnets are fully convolutional with global pooling and build
# for any size, though below 32 their last blocks see a 1x1 map. The others end in a
# fixed-size 'VALID' layer that needs a large enough feature map: inception_v1's 7x7 average
# pool, vgg_a's 7x7 and alexnet_v2's 5x5 fc6 convolutions.
_SPECS = (
    ModelSpec("mlp", mlp, _keyword_options(mlp), default_image_size=None),
    ModelSpec("lenet", lenet, _keyword_options(lenet), default_image_size=28),
    ModelSpec("cifarnet", cifarnet, _keyword_options(cifarnet), 32, min_image_size=4, channels=3),
    ModelSpec(
        "cifarnet_bn",
        functools.partial(cifarnet, batch_norm=True),
        tuple(o for o in _keyword_options(cifarnet) if o != "batch_norm"),
        32,
        min_image_size=4,
        channels=3,
    ),
    _slim_net("resnet_v1_50", SlimNet("resnet_v1", "resnet_v1_50", "resnet_arg_scope", False), 1),
    _slim_net("resnet_v2_50", SlimNet("resnet_v2", "resnet_v2_50", "resnet_arg_scope", False), 1),
    _slim_net(
        "inception_v1", SlimNet("inception", "inception_v1", "inception_v1_arg_scope", True), 193
    ),
    _slim_net("vgg_a", SlimNet("vgg", "vgg_a", "vgg_arg_scope", True), 224),
    _slim_net("alexnet_v2", SlimNet("alexnet", "alexnet_v2", "alexnet_v2_arg_scope", True), 195),
)

# The models by name: the one table the launcher, its flags and the checks read.
MODELS: Mapping[str, ModelSpec] = types.MappingProxyType({s.name: s for s in _SPECS})

MODEL_NAMES: Tuple[str, ...] = tuple(MODELS)

# Views of MODELS: the image side each model is made for (None: any, the dataset's own),
# and the smallest it can be built for.
DEFAULT_IMAGE_SIZE: Mapping[str, Optional[int]] = types.MappingProxyType(
    {s.name: s.default_image_size for s in _SPECS}
)
MIN_IMAGE_SIZE: Mapping[str, int] = types.MappingProxyType(
    {s.name: s.min_image_size for s in _SPECS}
)


def _to_logits(net: tf.Tensor, name: str) -> tf.Tensor:
    """Turns the nets' [B, h, w, num_classes] output into [B, num_classes]."""
    if net.shape.rank == 2:
        return net
    height, width = net.shape[1], net.shape[2]
    if height == 1 and width == 1:
        return tf.squeeze(net, [1, 2], name="logits")
    logging.info(
        "Model %s: averaging its %sx%s map of logits (input larger than its default %s).",
        name,
        height,
        width,
        MODELS[name].default_image_size,
    )
    return tf.reduce_mean(net, [1, 2], name="logits")


def _check_images(name: str, images: tf.Tensor) -> None:
    shape = images.shape
    if shape.rank is not None and shape.rank != 4:
        raise ModelError(
            f"Model {name} takes images [batch, height, width, channels], got shape {shape}."
        )
    spec = MODELS[name]
    minimum = spec.min_image_size
    sides = [d for d in (shape[1:3] if shape.rank else []) if d is not None]
    if any(side < minimum for side in sides):
        raise ModelError(
            f"Model {name} needs images of at least {minimum}x{minimum}, got "
            f"{shape[1]}x{shape[2]}: resize them with image_size (e.g. "
            f"{spec.default_image_size}, its default) or choose a small model "
            "(mlp, lenet)."
        )


def get_model(name: str, **options: Any) -> ModelFn:
    """Returns the model function of a model, by name.

    Args:
      name: One of `MODEL_NAMES`.
      **options: The model's keyword options (`ModelSpec.options`): for ``mlp``
        ``hidden_units`` and ``weight_decay``; for ``lenet`` ``dropout_keep_prob`` and
        ``weight_decay``; for ``cifarnet`` those and ``batch_norm`` (``cifarnet_bn``: all
        but ``batch_norm``); for the tf_slim.nets ``weight_decay`` (``None``: the net's own
        default) and, except the resnets, ``dropout_keep_prob``.

    Returns:
      ``fn(images, num_classes, is_training) -> logits [batch, num_classes]``.

    Raises:
      ModelError: (a ``ValueError``) for an unknown name or option.
    """
    spec = MODELS.get(name)
    if spec is None:
        raise ModelError(
            f"Unknown model name {name!r} (--model_name): choose one of {', '.join(MODEL_NAMES)}."
        )
    unknown = sorted(set(options) - set(spec.options))
    if unknown:
        raise ModelError(
            f"Model {name} has no option {', '.join(unknown)}: its options are "
            f"{', '.join(spec.options)}."
        )
    return functools.partial(spec.build, **options)
