"""`GraphHandles`: the tensors and ops `create_train_op` built, frozen. Nothing here runs a
session."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Mapping, Optional, Tuple

import tensorflow as tf

from slim_nanguard import _checkpoints
from slim_nanguard._types import Mode

if TYPE_CHECKING:  # pragma: no cover
    from slim_nanguard._capture import Capture


@dataclasses.dataclass(frozen=True)
class GraphHandles:
    """What `create_train_op` built for one guarded train op; None for what it did not build.

    ``gradients``: the gradient of each of ``variable_names`` (an `IndexedSlices`' values);
    ``value_kinds`` the kind of the loss, then of each, on a bad step, read as ``kinds_read``. A
    bad step leaves its loss in ``diagnostics`` (then, with a dynamic loss-scale optimizer, its
    loss scale). ``ok``: what the hook
    fetches (False on a bad step or an overflow), unless ``in_loop`` (built in a
    `tf.while_loop` or function body, whose tensors a run cannot fetch). ``judged``: hook mode's
    variable that whatever applies the policy initialises. ``pivot``: what a later write waits
    on (`gate_writes_after`). ``input_ops``: the ancestors of ``loss`` that fetch a batch.
    ``report``: where a bad step leaves its cause and the ``reasons``' reports (their
    ``reason_handles``: each `Test.handles`). ``optional_variables``: the learning-rate scale
    and the spike statistics, which a checkpoint may lack (it still restores the rest).
    ``counters``: the `_recorders.SCALARS` counters the summaries show (None in a loop body).
    """

    mode: Mode
    train_op: tf.Tensor
    loss: tf.Tensor
    global_step: Optional[tf.Variable]
    gradients: Tuple[tf.Tensor, ...]
    ok: Optional[tf.Tensor]
    diagnostics: tf.Variable
    check_op_name: Optional[str]
    variable_names: Tuple[str, ...]
    lr_scale: Optional[tf.Variable] = None
    lr_scale_value: Optional[tf.Tensor] = None
    lr_scale_assign: Optional[tf.Operation] = None
    loss_scale_floor: Optional[float] = None
    in_loop: bool = False
    judged: Optional[tf.Variable] = None
    pivot: Optional[tf.Tensor] = None
    capture: Optional["Capture"] = None
    input_ops: Tuple[tf.Operation, ...] = ()
    value_kinds: Optional[tf.Variable] = None
    kinds_read: Optional[tf.Tensor] = None
    report: Optional[tf.Variable] = None
    reasons: Tuple[Any, ...] = ()
    reason_handles: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    optional_variables: Tuple[tf.Variable, ...] = ()
    counters: Optional[tf.Variable] = None

    def missing_from(self, checkpoint: str) -> Tuple[tf.Variable, ...]:
        """The `optional_variables` that `checkpoint` lacks (it has a ``checkpoint_reader``)."""
        reader = _checkpoints.checkpoint_reader(checkpoint)
        return tuple(v for v in self.optional_variables if not reader.has_tensor(v.op.name))
