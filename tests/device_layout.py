"""The model garden's multi-device layout, with logical CPU devices standing in for GPUs.

`model_deploy` puts the input pipeline and the variables on the host and each clone's forward
and backward pass under its own device; each clone dequeues its batch inside its device scope,
and the loss the train op minimises is the sum of the clones' losses. Here the host is
``/device:CPU:0`` and clone ``i`` is ``/device:CPU:<i + 1>`` of a session with three logical
CPU devices and soft placement off, as `tf_slim.learning.train` runs.

Every example carries its index through the pipeline, so a test can tell which batches a run
trained on; the examples named in ``nan_examples`` hold a NaN, those in ``scaled_examples`` are
multiplied by ``scale`` (a finite spike).

`send_ops` counts the transfers between devices in a step's partition graphs;
`without_gpu_kernel` lists the ops of a graph placed on a GPU that TensorFlow's kernel registry
has no GPU kernel for (the pip TensorFlow knows its GPU kernels without a GPU).
"""

import contextlib
import dataclasses
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
import tf_slim as slim
from tensorflow.python.framework import kernels

import slim_nanguard
from slim_nanguard import _placement

HOST = "/device:CPU:0"
DEVICES = 3
FEATURES = 6
CLASSES = 3
BATCH = 4
EXAMPLES = 4096


def clone_device(i: int) -> str:
    return f"/device:CPU:{i + 1}"


def session_config() -> tf.compat.v1.ConfigProto:
    """Three logical CPU devices, soft placement off (`tf_slim.learning.train`'s default)."""
    return tf.compat.v1.ConfigProto(device_count={"CPU": DEVICES}, allow_soft_placement=False)


@dataclasses.dataclass
class Layout:
    graph: tf.Graph
    train_op: tf.Tensor
    global_step: tf.Variable
    indices: Tuple[tf.Tensor, ...]  # each clone's batch of example indices
    clone_losses: Tuple[tf.Tensor, ...]

    def variables(self, sess) -> Dict[str, np.ndarray]:
        """Every global variable's value."""
        variables = self.graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
        return {v.op.name: np.array(x) for v, x in zip(variables, sess.run(variables))}


def data(
    nan_examples: Sequence[int] = (), scaled_examples: Sequence[int] = (), scale: float = 1.0
) -> Tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(0)
    x = rng.randn(EXAMPLES, FEATURES).astype(np.float32)
    y = (np.argmax(x[:, :CLASSES], 1)).astype(np.int64)
    x[list(scaled_examples)] *= scale
    x[list(nan_examples), 1] = np.nan
    return x, y


def _pipeline(kind: str, x: np.ndarray, y: np.ndarray, num_clones: int):
    """``dequeue()``: one batch ``(x, y, index)``, taken from a queue on the host."""
    with tf.device(HOST):
        (index,) = tf.compat.v1.train.slice_input_producer(
            [tf.range(EXAMPLES, dtype=tf.int64)], shuffle=False
        )
        example = (tf.gather(tf.constant(x), index), tf.gather(tf.constant(y), index), index)
        if kind == "prefetch":  # train_image_classifier.py: train.batch, then prefetch_queue
            batch = tf.compat.v1.train.batch(example, batch_size=BATCH, num_threads=1)
            queue = slim.prefetch_queue.prefetch_queue(batch, capacity=2 * num_clones)
            return queue.dequeue
        if kind == "fifo":  # a FIFOQueue of single examples, dequeued a batch at a time
            queue = tf.queue.FIFOQueue(
                64, [tf.float32, tf.int64, tf.int64], shapes=[[FEATURES], [], []]
            )
            runner = tf.compat.v1.train.QueueRunner(queue, [queue.enqueue(example)])
            tf.compat.v1.train.add_queue_runner(runner)
            return lambda: queue.dequeue_many(BATCH)
    raise ValueError(kind)


def build(
    *,
    guarded: bool = True,
    num_clones: int = 2,
    variables_on: str = "host",
    pipeline: str = "prefetch",
    train_op_device: Optional[str] = None,
    nan_examples: Sequence[int] = (),
    scaled_examples: Sequence[int] = (),
    scale: float = 1.0,
    **guard_kwargs,
) -> Layout:
    """The layout in a new graph, its train op tf-slim's (`guarded` False) or slim_nanguard's.

    Args:
      variables_on: ``"host"`` (model_deploy's ``variables_device``) or ``"clone"`` (each
        variable where the first clone makes it).
      train_op_device: A device scope the train op is built in (None: none, as
        train_image_classifier.py does).
      guard_kwargs: `slim_nanguard.create_train_op`'s keywords.
    """
    graph = tf.Graph()
    x, y = data(nan_examples, scaled_examples, scale)
    # Where an op with no device goes: the first GPU on a GPU machine, so the first clone.
    with graph.as_default(), tf.device(clone_device(0)):
        tf.compat.v1.set_random_seed(1)
        with tf.device(HOST):
            global_step = tf.compat.v1.train.get_or_create_global_step()
        dequeue = _pipeline(pipeline, x, y, num_clones)
        losses, indices, first_updates = [], [], None
        var_device = HOST if variables_on == "host" else None
        for i in range(num_clones):
            scope = f"clone_{i}"
            reuse = True if i else None
            with tf.device(clone_device(i)), tf.name_scope(scope):
                with tf.compat.v1.variable_scope(tf.compat.v1.get_variable_scope(), reuse=reuse):
                    with slim.arg_scope([slim.model_variable, slim.variable], device=var_device):
                        images, labels, index = dequeue()
                        net = slim.fully_connected(
                            images, 16, normalizer_fn=slim.batch_norm, scope="fc1"
                        )
                        logits = slim.fully_connected(net, CLASSES, activation_fn=None, scope="fc2")
                        # A path batch norm does not rescale: a scaled batch moves the loss.
                        logits += slim.fully_connected(
                            images, CLASSES, activation_fn=None, scope="direct"
                        )
                    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(
                        labels, logits, loss_collection=None
                    )
                    losses.append(loss / num_clones)
                    indices.append(index)
            if i == 0:
                first_updates = tf.compat.v1.get_collection(
                    tf.compat.v1.GraphKeys.UPDATE_OPS, scope
                )
        total_loss = tf.math.add_n(losses, name="total_loss")  # no device, as model_deploy's
        with tf.device(HOST):
            optimizer = tf.compat.v1.train.MomentumOptimizer(0.05, 0.9)
        create = slim_nanguard.create_train_op if guarded else slim.learning.create_train_op
        kwargs = guard_kwargs if guarded else {}
        with tf.device(train_op_device) if train_op_device else contextlib.nullcontext():
            train_op = create(
                total_loss,
                optimizer,
                global_step=global_step,
                update_ops=first_updates,
                colocate_gradients_with_ops=True,
                **kwargs,
            )
    return Layout(graph, train_op, global_step, tuple(indices), tuple(losses))


def send_ops(run_metadata: tf.compat.v1.RunMetadata) -> int:
    """The number of transfers (``_Send`` and ``_HostSend`` nodes) in a run's partitions."""
    return sum(
        node.op in ("_Send", "_HostSend")
        for graph in run_metadata.partition_graphs
        for node in graph.node
    )


def run_with_partitions(sess, fetches, **kwargs):
    """``(values, send_ops)`` of one run whose partition graphs are returned."""
    options = tf.compat.v1.RunOptions(output_partition_graphs=True)
    metadata = tf.compat.v1.RunMetadata()
    values = sess.run(fetches, options=options, run_metadata=metadata, **kwargs)
    return values, send_ops(metadata)


def has_kernel(op: tf.Operation, device_type: str) -> bool:
    """Whether TensorFlow's kernel registry has a kernel of `op` for `device_type` (or the
    DEFAULT device, which serves every device) that takes `op`'s types."""
    for kernel in kernels.get_registered_kernels_for_op(op.type).kernel:
        if kernel.device_type not in (device_type, "DEFAULT") or kernel.label:
            continue
        if all(_allows(constraint, op) for constraint in kernel.constraint):
            return True
    return False


def _allows(constraint, op: tf.Operation) -> bool:
    attr = op.node_def.attr.get(constraint.name)
    if attr is None:
        return True
    types = list(attr.list.type) if attr.HasField("list") else [attr.type]
    return all(t in constraint.allowed_values.list.type for t in types)


def placed(op: tf.Operation) -> tf.DeviceSpec:
    """Where `op` runs as the graph places it: its device, or that of the op it is colocated
    with (an op with neither goes to the default device: the first GPU on a GPU machine)."""
    return tf.DeviceSpec.from_string(
        _placement.device_of(op.outputs[0]) if op.outputs else op.device
    )


def without_gpu_kernel(graph: tf.Graph) -> list:
    """``(name, type, device)`` of each op placed on a GPU, or on no device, that has no GPU
    kernel for its types."""
    found = []
    for op in graph.get_operations():
        spec = placed(op)
        if spec.device_type != "CPU" and not has_kernel(op, "GPU"):
            found.append((op.name, op.type, spec.to_string()))
    return found
