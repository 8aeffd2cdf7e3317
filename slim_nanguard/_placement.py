"""Where the guard's ops go in the user's device layout (GPUs, `model_deploy` clones, a
cluster's workers), with soft placement off.

* A reduction runs beside the tensor it reduces (`beside`), so only its scalar crosses devices.
* The verdict and the gate run beside the gradients when they all sit on one device
  (model_deploy's summed gradients on the host, a single GPU's), where the writes they gate
  are; otherwise, and on a cluster, where the user builds the train op (`verdict_scope`).
* String work (messages, summaries, savers) runs on the host: ``/device:CPU:0``, which merges
  with an enclosing ``/job:worker/task:N`` scope or device function (`on_host`).
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import tensorflow as tf

HOST = "/device:CPU:0"


def on_host():
    """A block whose ops run on the host CPU of the device scope in force."""
    return tf.device(HOST)


def values_of(tensor) -> tf.Tensor:
    """`tensor`, or an `IndexedSlices`' values."""
    return tensor.values if isinstance(tensor, tf.IndexedSlices) else tensor


def beside(tensor: tf.Tensor):
    """A block whose ops are colocated with `tensor` (an `IndexedSlices`' values); for a
    scalar (the loss), a block in the device scope in force: the scalar crosses anyway."""
    values = values_of(tensor)
    if values.shape.rank == 0:
        return contextlib.nullcontext()
    return tf.compat.v1.colocate_with(values.op)


def device_of(tensor: tf.Tensor) -> str:
    """The device `tensor` is placed on in the graph: its op's, or that of the op it is
    colocated with (``""`` when neither names one: the placer decides)."""
    op = tensor.op
    for group in op.colocation_groups():
        name = group.decode()[len("loc:@") :]
        if name != op.name:
            try:
                return op.graph.get_operation_by_name(name).device
            except KeyError:
                break
    return op.device


def verdict_device(loss: tf.Tensor, grads: Sequence) -> Optional[str]:
    """The one device of all `grads` (None for a variable without one) if they share one and
    it names no cluster job, else None. On a cluster the worker's device function already
    puts the verdict beside the worker's gradients, and a device naming the worker would also
    pull the reasons' state, which lives on the parameter servers with the model, onto the
    worker."""
    devices = {device_of(values_of(g)) for g in grads if g is not None}
    if len(devices) != 1:
        return None
    (device,) = devices
    if not device or tf.DeviceSpec.from_string(device).job or device_of(loss).startswith("/job"):
        return None
    return device


def verdict_scope(device: Optional[str]):
    """A block on `device` (from `verdict_device`), or in the device scope in force for None."""
    return contextlib.nullcontext() if device is None else tf.device(device)
