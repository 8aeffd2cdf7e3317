"""`GraphHandles`: the tensors and ops `create_train_op` built, frozen. Nothing here runs a
session."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Mapping, Optional, Tuple

import tensorflow as tf

from slim_nanguard._types import Mode

if TYPE_CHECKING:  # pragma: no cover
    from slim_nanguard._capture import Capture


@dataclasses.dataclass(frozen=True)
class GraphHandles:
    """What `create_train_op` built for one guarded train op; None for what it did not build.

    Attributes:
      grad_sums: The loss, then the sum of each gradient (in the order of ``variable_names``).
      ok: The boolean the hook fetches (False on a bad step or a loss-scale overflow): hook
        mode, or a dynamic loss-scale optimizer, when not ``in_loop``.
      diagnostics: Where a step whose fast test failed leaves its ``grad_sums`` (then, with a
        dynamic loss-scale optimizer, its loss scale); ``value_kinds``: the kind of each value,
        which a bad step fetches as ``kinds_read``.
      check_op_name: The op a bad step raises from in check_numerics mode.
      lr_scale: The variable a rollback lowers the learning rate with, through the
        ``lr_scale_value`` placeholder and ``lr_scale_assign``.
      in_loop: Built in a `tf.while_loop` or function body, whose tensors a run cannot fetch.
      judged: Hook mode: the variable whatever applies the policy initialises in its session.
      pivot: What a write built after the train op waits on (`gate_writes_after`).
      input_ops: The ops among the ancestors of ``loss`` that fetch a new batch when run.
      report: With reasons (`_reasons.Reason`, in its order), the variable a bad step leaves
        its cause and the reasons' reports in; ``reason_handles``: each `Test.handles`.
      optional_variables: The guard's variables only some options make (the learning-rate
        scale, the spike statistics); a checkpoint without them still restores the rest.
    """

    mode: Mode
    train_op: tf.Tensor
    loss: tf.Tensor
    global_step: Optional[tf.Variable]
    grad_sums: tf.Tensor
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

    def missing_from(self, checkpoint: str) -> Tuple[tf.Variable, ...]:
        """The `optional_variables` that `checkpoint` lacks (it has a ``checkpoint_reader``)."""
        from slim_nanguard import _checkpoints  # Local: reading a checkpoint is rare.

        reader = _checkpoints.checkpoint_reader(checkpoint)
        return tuple(v for v in self.optional_variables if not reader.has_tensor(v.op.name))
