"""A toy third reason to reject a step, written as a user (or a reviewer) would: one module.

`LossCap` rejects a step whose loss is above a fixed cap. Nothing else in the package names
it: the gate, the record, the log line, the summaries and the launcher take it through
`slim_nanguard.Reason` (tests/test_reasons.py tells the story).
"""

import dataclasses
from typing import ClassVar, Tuple

import tensorflow as tf

import slim_nanguard


@dataclasses.dataclass(frozen=True)
class LossCap(slim_nanguard.Reason):
    """Rejects a step whose loss is above `cap`; stores the loss of each accepted step."""

    name: ClassVar[str] = "loss_cap"
    what: ClassVar[str] = "a loss above its cap"
    report_fields: ClassVar[Tuple[str, ...]] = ("loss", "cap")
    judged_fields: ClassVar[Tuple[str, ...]] = ("accepted_loss",)
    policy: str = "skip"
    cap: float = 50.0

    def validate(self) -> None:
        if not self.cap > 0:
            raise ValueError(f"cap must be > 0; got {self.cap!r}.")

    def settings(self):
        return {self.policy_name: self.policy, "cap": self.cap}

    def build(self, values: slim_nanguard.StepValues) -> slim_nanguard.Test:
        loss = tf.cast(values.loss, tf.float64)
        cap = tf.constant(self.cap, tf.float64)
        return slim_nanguard.Test(
            reject=loss > cap,
            report=lambda: tf.stack([loss, cap]),
            judged=lambda: tf.reshape(loss, [1]),
        )

    def phrase(self, figures) -> str:
        return f"loss {figures['loss']:.4g} is above the cap {figures['cap']:g}"


def loss_cap():
    """What ``--reasons=toy_reasons:loss_cap`` loads."""
    return LossCap(cap=50.0)
