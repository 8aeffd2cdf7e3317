"""Shared pytest setup: graph-mode TensorFlow, quiet logs."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

tf.compat.v1.disable_v2_behavior()
