"""`Reason`: the one interface of every test besides NaN/Inf (`_spike.Spike`, a user's
``create_train_op(reasons=...)``); the first that rejects a step names its cause."""

from __future__ import annotations

import abc
import dataclasses
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    ClassVar,
    ContextManager,
    Dict,
    Optional,
    Sequence,
    Tuple,
)

from slim_nanguard._types import Fault

if TYPE_CHECKING:  # pragma: no cover
    import tensorflow as tf

NON_FINITE = Fault.NON_FINITE  # The cause of a step no `Reason` rejected: NaN or Inf.


@dataclasses.dataclass(frozen=True)
class StepValues:
    """What a reason's test is built from.

    Attributes:
      loss: The step's total loss (scalar), as the NaN/Inf verdict takes it.
      grads: The gradients the train op applies (those that are not None).
      global_norm: Float64 scalar, the exact global norm of `grads` (finite where a float32
        norm would overflow).
      state_scope: A context for the reason's own variables: outside any loop body, and on a
        cluster on the ps with the model.
      data_loss: Float64 scalar, `loss` without the regularization losses it adds (the sum
        of its other terms); `loss` itself when it adds none. None: the same as `loss`.
      regularization: The regularization losses `loss` adds (`regularization_terms`).
    """

    loss: tf.Tensor
    grads: Tuple[tf.Tensor, ...]
    global_norm: tf.Tensor
    state_scope: Callable[[], ContextManager]
    data_loss: Optional[tf.Tensor] = None
    regularization: Tuple[tf.Tensor, ...] = ()


@dataclasses.dataclass(frozen=True)
class Test:
    """One reason's test in a train op's graph.

    Attributes:
      reject: Scalar bool, True to reject the step; built before any write, it may read state.
      report: Builds the float64 `Reason.report_fields` a rejected step stores (once, on the
        bad branch).
      judged: Builds the float64 `Reason.judged_fields` an accepted step stores for the
        summaries (once, behind the gate), or None: no summaries.
      writes: Builds an accepted step's writes into the reason's state (once, behind the gate).
      variables: The reason's checkpointed state (a rollback restores it with the weights).
      handles: What the reason's own policy steps need of the graph, or None. Its
        ``figures(report, step) -> figures``, if any, reads a rejected step's figures in place of
        the reason's own `figures`, with what the handles know beyond the graph.
    """

    reject: tf.Tensor
    report: Callable[[], tf.Tensor]
    judged: Callable[[], tf.Tensor] = None
    writes: Callable[[], Sequence[tf.Operation]] = lambda: ()
    variables: Tuple[tf.Variable, ...] = ()
    handles: Any = None


class Reason(abc.ABC):
    """A reason to reject a step. Subclasses are frozen dataclasses with a ``policy`` field.

    Class attributes:
      name: The cause it gives a rejected step (the record's ``cause``, the log line).
      what: What a rejected step had, for a sentence (``"a loss above its cap"``).
      report_fields: The floats a rejected step stores (`Test.report`).
      judged_fields: The floats an accepted step stores for the summaries (`Test.judged`).

    Attributes:
      policy: The action for a step it rejects (``raise``, ``stop``, ``skip``, ``rollback``);
        it escalates as any bad step's does.
    """

    name: ClassVar[str]
    what: ClassVar[str]
    report_fields: ClassVar[Tuple[str, ...]] = ()
    judged_fields: ClassVar[Tuple[str, ...]] = ()
    policy: str

    @property
    def policy_name(self) -> str:
        """How messages name its policy: ``<name>_policy``."""
        return f"{self.name}_policy"

    def settings(self) -> Dict[str, Any]:
        """Its settings by the names a user sets them by (its policy first), for a summary."""
        return {self.policy_name: self.policy}

    def validate(self) -> None:  # noqa: B027 (optional to override)
        """Raises ValueError for a setting out of range (the policy is checked for it)."""

    @abc.abstractmethod
    def build(self, values: StepValues) -> Test:
        """Builds the test in the current graph, from the step's `values`."""

    def figures(self, report: Sequence[float]) -> Dict[str, Any]:
        """The record of a rejected step from its stored `report` (`report_fields`). Pure."""
        return {name: float(value) for name, value in zip(self.report_fields, report)}

    def phrase(self, figures: Dict[str, Any]) -> str:
        """What the log line says of a rejected step's `figures`. Pure."""
        shown = ", ".join(f"{k} {v:.4g}" for k, v in figures.items() if isinstance(v, (int, float)))
        return f"{self.name}: {shown}" if shown else self.name

    def decide(self, config, state, observation) -> Tuple[Any, Any]:
        """This reason's own rules about a bad step it rejected (`observation`, counted in
        `state`), before the policy: ``(decision, state)``, the decision None for the
        policy's. Pure. The base has none, and keeps no run (``GuardState.reason_run``)."""
        return None, dataclasses.replace(state, reason_run=())

    def summaries(self, judged: tf.Tensor) -> Dict[str, tf.Tensor]:
        """TensorBoard's scalars (``nanguard/<key>``) from the last accepted step's `judged`."""
        return {name: judged[i] for i, name in enumerate(self.judged_fields)}


def check(reasons: Sequence[Reason], policies: Sequence[str]) -> None:
    """Raises ValueError unless `reasons` are valid `Reason`s with distinct names, none
    `NON_FINITE`, each with a policy among `policies`."""
    names = set()
    for reason in reasons:
        if not isinstance(reason, Reason):
            raise ValueError(
                f"reasons must be slim_nanguard.Reason objects; got {reason!r} "
                f"({type(reason).__name__})."
            )
        if reason.name == NON_FINITE or reason.name in names:
            raise ValueError(
                f"two reasons are named {reason.name!r} (or one is named like the guard's "
                f"own {NON_FINITE!r}); give each reason its own name."
            )
        names.add(reason.name)
        if reason.policy not in policies:
            raise ValueError(
                f"{reason.policy_name} must be one of {', '.join(policies)}; got {reason.policy!r}."
            )
        reason.validate()
