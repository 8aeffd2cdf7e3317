"""The per-step test (`StepTest`), the same for both modes, and each mode's `Gate` in front of
the writes: a check op that raises, or a ``Switch`` on ``ok`` the hook fetches. A bad step
stores its loss (and report), puts the forward pass's writes back and keeps its batch."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import control_flow_ops

from slim_nanguard import _capture
from slim_nanguard import _errors
from slim_nanguard import _exact_sums
from slim_nanguard import _ops
from slim_nanguard import _placement
from slim_nanguard import _policy
from slim_nanguard import _reasons
from slim_nanguard import _recorders
from slim_nanguard._gated_writes import ForwardWrites
from slim_nanguard._types import Fault
from slim_nanguard._types import Mode


class StepTest:
    """The test of one train op, the same for both modes.

    Attributes:
      gradients: The gradients of `present` (an `IndexedSlices`' values): with the loss, what
        an autopsy replays.
      kinds: Int64 variable (int32 has no GPU kernel), the `_exact_sums` kind codes a step whose
        fast test failed stores.
      kept: What a bad step stores in `diagnostics`: its loss (then a loss scale's scale).
      overflow: With a dynamic loss scale, True on an overflow (`_exact_sums.overflow_rule`): a
        finite step runs every write, an overflow the scale's only, any other none; else None.
      unless_overflow: With `overflow`, what check_numerics mode checks: `checked`, but finite
        on an overflow step.
      ok: Scalar bool, True on a step that may write: `verdict.ok`, and no reason rejects.
      checked: What check_numerics mode checks: `verdict.checked`, NaN on a rejected step.
      cause: With reasons, int32: 0 for a non-finite step, else 1 + the index of the first
        reason that rejects it.
      report: With reasons, the variable a bad step stores ``cause + 1`` and the reports in.
      judged: With reasons, the variable an accepted step stores the judged values in.
      stores: With reasons, the report's store: what a bad step stores besides its loss.
    """

    def __init__(
        self,
        loss: tf.Tensor,
        grads_and_vars,
        loss_scale=None,
        reasons: Sequence[_reasons.Reason] = (),
    ):
        """Builds the test in the current name scope (`loss_scale`: a `DynamicLossScale`)."""
        self.present = [(g, v) for g, v in grads_and_vars if g is not None]
        grads = [g for g, _ in self.present]
        self.gradients = tuple(map(_placement.values_of, grads))
        self.verdict = _exact_sums.Verdict(grads, loss=loss)
        self.anchor = self.verdict.total  # Where the guard's scratch variables live.
        self.kinds = _scratch(self.anchor, [len(grads) + 1], "value_kinds", tf.int64)
        self.verdict.store_kinds(self.kinds)
        self.ok, self.checked = self.verdict.ok, self.verdict.checked
        self.report = self.judged = self.cause = self._bad = self._switch = None
        self._summary_read = None
        self.reasons, self.tests, self.stores = (), (), []
        if reasons:
            self._add_reasons(loss, reasons)
        with self.when_bad():  # The loss a bad step leaves (its kinds name the culprits).
            dtype = self.anchor.dtype
            self.kept = tf.reshape(tf.cast(loss, dtype), [1], name="bad_loss")
        self.overflow = self.unless_overflow = None
        if loss_scale is not None:
            # The scale this step multiplied the loss by.
            scale = tf.cast(loss_scale(), dtype)
            self.kept = tf.concat([self.kept, tf.reshape(scale, [1])], 0, name="loss_and_scale")
            self.overflow = _exact_sums.overflow_rule(
                tf.logical_not(self.verdict.ok),
                tf.math.is_finite(self.verdict.tensors[0]),
                scale,
                both=tf.logical_and,
                name="loss_scale_overflow",
            )
            self.unless_overflow = tf.where(
                self.overflow, tf.zeros_like(self.checked), self.checked
            )
        self.diagnostics = _scratch(self.anchor, self.kept.shape, "bad_loss", self.kept.dtype)

    def _add_reasons(self, loss: tf.Tensor, reasons: Sequence[_reasons.Reason]) -> None:
        """Makes each reason one more way to fail."""
        data, regularization = _ops.loss_terms(loss)
        values = _reasons.StepValues(
            loss,
            tuple(g for g, _ in self.present),
            self.verdict.global_norm,
            # In the checkpoints, so outside any loop body and not colocated with the step:
            # on a cluster, on the ps with the model (one state for all workers).
            state_scope=lambda: _outside_loops(loss.graph),
            data_loss=(
                _ops.float64_sum(data, "loss_without_regularization") if regularization else None
            ),
            regularization=regularization,
        )
        self.reasons = tuple(reasons)
        self.tests = tuple(reason.build(values) for reason in self.reasons)
        rejects = [test.reject for test in self.tests]
        rejected = rejects[0] if len(rejects) == 1 else tf.reduce_any(tf.stack(rejects))
        # A rejection adds a NaN: `checked` is non-finite exactly when a value is or a reason
        # rejects the step.
        dtype = self.verdict.checked.dtype
        penalty = tf.where(rejected, tf.constant(np.nan, dtype), tf.constant(0.0, dtype))
        self.checked = tf.add(self.verdict.checked, penalty, name="checked_no_spike")
        self.ok = tf.math.is_finite(self.checked, name="ok_no_spike")
        untaken, self._good = self.ok_switch()
        self._bad = tf.identity(untaken, name="bad_step")
        self.cause = tf.where(self.verdict.ok, _first(rejects) + 1, 0, name="cause")
        with self.when_bad():
            stored = [tf.reshape(tf.cast(self.cause + 1, tf.float64), [1])]
            report = tf.concat(stored + [test.report() for test in self.tests], 0)
        self.report = _scratch(self.anchor, report.shape, "bad_step_report")
        self.stores = [self.report.assign(report, read_value=False)]
        fields = sum(len(r.judged_fields) for r in self.reasons)
        self.judged = _scratch(self.anchor, [fields], "last_accepted_step")
        with tf.name_scope("nanguard/"):  # Tagged nanguard/... whatever the scope.
            self._add_summaries()

    def accepted_writes(self) -> list:
        """What an accepted step writes for its reasons (build behind the gate)."""
        writes = [op for test in self.tests for op in test.writes()]
        judged = [test.judged() for test in self.tests if test.judged is not None]
        if judged:
            vector = judged[0] if len(judged) == 1 else tf.concat(judged, 0)
            # After the summaries' read: a run that fetches both shows the step before it,
            # whichever op the executor happens to run first.
            with tf.control_dependencies([self._summary_read]):
                writes.append(self.judged.assign(vector, read_value=False))
        return writes

    def _add_summaries(self) -> None:
        """Each reason's summaries of the last accepted step, read from `judged` (no batch)."""
        stored = self._summary_read = _ops.read_once_written(self.judged, 0.0)
        start = 0
        for reason in self.reasons:
            size = len(reason.judged_fields)
            if not size:
                continue
            mine = stored if size == stored.shape[0] else stored[start : start + size]
            start += size
            for name, value in reason.summaries(mine).items():
                with _placement.on_host():
                    tf.compat.v1.summary.scalar(name, value)

    def counters(self) -> tf.Variable:
        """The guard's `_recorders.SCALARS` counters, which `_actions` writes after a bad step, and
        their summaries (``nanguard/bad_steps``, ...; the optional ones where this test can
        count them), read from it: no batch."""
        with tf.name_scope("nanguard/"):
            counters = _scratch(self.anchor, [len(_recorders.SCALARS)], "counters")
            shown = _ops.read_once_written(counters, 0.0, name="counters_read")
            spikes = any(reason.name == Fault.SPIKE for reason in self.reasons)
            has = {"level_shifts": spikes, "loss_scale_overflows": self.overflow is not None}
            for name, value in zip(_recorders.SCALARS, tf.unstack(shown)):
                if has.get(name, True):
                    with _placement.on_host():
                        tf.compat.v1.summary.scalar(name, value)
        return counters

    def reason_variables(self) -> Tuple[tf.Variable, ...]:
        """The reasons' state in the checkpoints (none without reasons)."""
        return tuple(v for test in self.tests for v in test.variables)

    def ok_switch(self) -> Tuple[tf.Tensor, tf.Tensor]:
        """``(untaken, taken)``: `ok` switched on itself, built once."""
        if self._switch is None:
            self._switch = control_flow_ops.switch(self.ok, self.ok)
        return self._switch

    def when_bad(self):
        """A block whose ops run on a bad step only (when the fast test failed, without reasons)."""
        if self._bad is None:
            return self.verdict.when_failed()
        return tf.control_dependencies([self._bad])

    def after_bad_stores(self, ops: Sequence) -> tf.Tensor:
        """With reasons: live on every step, after `ops` and the report's store on a bad step."""
        return _after(list(ops) + self.stores, self._bad, self._good)


@contextlib.contextmanager
def _outside_loops(graph: tf.Graph) -> Iterator[None]:
    with _capture.outside_control_flow(graph), tf.init_scope():
        yield


@dataclasses.dataclass(frozen=True)
class Gate:
    """The test, put in front of the writes of one mode.

    Attributes:
      gate: What every write waits on: the check's output, or hook mode's pivot; with a
        loss-scale optimizer, open on an overflow step too (the scale's writes wait on it).
      finite_gate: With a loss-scale optimizer, open on a finite step only: every write but
        the scale's waits on it too.
      ok: The boolean the hook fetches (True on a finite step).
      bad_done: Live on a step that is not finite, after the bad branch's work.
    """

    mode: Mode
    gate: tf.Tensor
    capture: _capture.Capture
    finite_gate: Optional[tf.Tensor] = None
    ok: Optional[tf.Tensor] = None
    bad_done: Optional[tf.Tensor] = None
    check_op_name: Optional[str] = None
    judged: Optional[tf.Variable] = None

    @property
    def pivot(self) -> Optional[tf.Tensor]:
        """What a write built after the train op must wait on (`GraphHandles.pivot`)."""
        if self.finite_gate is not None:
            return self.finite_gate
        return self.gate if self.mode == Mode.HOOK else None

    def loss_after(self, loss: tf.Tensor, writes: Sequence) -> tf.Tensor:
        """The train op: `loss`, once `writes` ran (a good step) or the bad branch did."""
        with tf.name_scope("train_op"):
            extra = [self.finite_gate] if self.finite_gate is not None else []
            # Beside the gate: the user's device gets one control edge, as tf-slim's.
            with tf.control_dependencies(list(writes) + extra), _placement.beside(self.gate):
                done = tf.identity(self.gate)
                if self.bad_done is not None:
                    done, _ = control_flow_ops.merge([done, self.bad_done])
            with tf.control_dependencies([done]):
                return tf.identity(loss, name="total_loss")


def build_gate(
    test: StepTest,
    config: _policy.GuardConfig,
    *,
    check_numerics: bool,
    forward: ForwardWrites,
    loss: tf.Tensor,
    autopsy: bool,
) -> Gate:
    """Puts `test` in front of the writes: a bad step puts `forward`'s writes back and, with
    `autopsy`, keeps `loss`'s batch. `config` names the policy in the errors."""
    build = _check_numerics_gate if check_numerics else _hook_gate
    gate = build(test, config, forward, loss, autopsy)
    return gate if test.overflow is None else _loss_scaled(test, gate)


def _check_numerics_gate(test, config, forward, loss, autopsy) -> Gate:
    """A check op the writes wait on; a bad step raises there."""
    # Stored on a step whose fast test failed (or that is a spike), before the check raises.
    store = test.diagnostics.assign(test.kept, read_value=False)
    ready = []
    if not test.reasons:
        test.verdict.confirm_after([store])
    else:
        ready.append(test.after_bad_stores([store]))
    if forward.snapshots:  # Put back before the check raises.
        untaken, taken = test.ok_switch()
        ready.append(_after(forward.put_back(test.ok), untaken, taken))
    # The batch, kept on a bad step only (for the autopsy).
    capture = _capture.keep_batch(loss, test.ok, enabled=autopsy)
    checked = test.checked if test.overflow is None else test.unless_overflow
    with tf.control_dependencies(ready + capture.control_inputs):
        if not test.reasons:
            check = tf.debugging.check_numerics(checked, _check_message(config))
            return Gate(Mode.CHECK_NUMERICS, check, capture, check_op_name=check.op.name)
        # An Assert whose message names the cause (CheckNumerics: "Tensor had NaN values").
        messages = [_check_message(config)] + [_check_message(config, r) for r in test.reasons]
        # One scalar to the host, after `ready`: -1 on a step that may write, else the cause.
        code = tf.where(tf.math.is_finite(checked), -1, test.cause, name="check_code")
    # On the host, no string having a GPU kernel; ordered after `ready` by `code` alone (a
    # reason's train op is built outside loops: no control-flow context is dropped here).
    with tf.control_dependencies(None), _placement.on_host():
        message = tf.gather(tf.constant(messages), tf.maximum(code, 0), name="check_message")
        check_op = tf.debugging.Assert(code < 0, [message], name="check_numerics")
    with tf.control_dependencies(ready + capture.control_inputs + [check_op]):
        check = tf.identity(checked, name="checked")
    return Gate(Mode.CHECK_NUMERICS, check, capture, check_op_name=check_op.name)


def _after(ops: Sequence, bad: tf.Tensor, good: tf.Tensor) -> tf.Tensor:
    """Live on every step: `good`'s side, or `bad`'s once `ops` ran."""
    with tf.control_dependencies(ops):
        done = tf.identity(bad)
    return control_flow_ops.merge([tf.identity(good), done])[0]


def _hook_gate(test, config, forward, loss, autopsy) -> Gate:
    """A switch whose taken side the writes wait on; the other is the bad step's."""
    ok = test.ok
    untaken, taken = test.ok_switch()
    # A control edge from an Identity of a dead Switch output carries deadness (not one
    # straight from the Switch): what waits on the pivot is skipped when `ok` is False.
    pivot = tf.identity(taken, name="pivot")
    # The other side runs on a bad step only, so a good step costs the hook one boolean.
    bad_loss, _ = control_flow_ops.switch(test.kept, ok)
    store = test.diagnostics.assign(bad_loss, read_value=False)
    # Whatever applies the policy initialises `judged` (`_actions.mark_judged`); a bad step in a
    # session where it is not fails here.
    judged = _scratch(test.anchor, [], "judged", tf.bool)
    bad_pivot = tf.identity(untaken)
    with tf.control_dependencies([bad_pivot]):
        is_judged = tf.raw_ops.VarIsInitializedOp(resource=judged.handle)
    passes = tf.logical_or(is_judged, bad_pivot)
    if test.overflow is not None:  # An overflow is the loss scale's business: it passes.
        passes = tf.logical_or(passes, test.overflow)
    with _placement.on_host():
        unjudged = tf.debugging.Assert(passes, [_unjudged_message(config)], name="unjudged")
    # The batch too, for the autopsy, on the same bad branch.
    capture = _capture.keep_batch(loss, ok, merge=False, enabled=autopsy)
    stores = [store, unjudged] + test.stores + list(capture.stores) + forward.put_back(ok)
    with tf.control_dependencies(stores):
        bad_done = tf.identity(untaken)
    # What the hook fetches: through the store on a bad step, so the loss is there to read
    # even after a run that did not fetch the train op.
    ok, _ = control_flow_ops.merge([pivot, bad_done], name="all_finite_checked")
    return Gate(Mode.HOOK, pivot, capture, ok=ok, bad_done=bad_done, judged=judged)


def dynamic_loss_scale(optimizer) -> Optional[tf.compat.v1.mixed_precision.DynamicLossScale]:
    """The `DynamicLossScale` of a loss-scale optimizer, or None (a fixed scale too: under it
    an overflow is a bad step)."""
    loss_scale = getattr(optimizer, "_loss_scale", None)
    dynamic = isinstance(loss_scale, tf.compat.v1.mixed_precision.DynamicLossScale)
    return loss_scale if dynamic and hasattr(optimizer, "_optimizer") else None


def _loss_scaled(test: StepTest, gate: Gate) -> Gate:
    """The mode's `gate` for a loss-scaled train op (its ``ok`` False on an overflow)."""
    if gate.ok is None:  # check_numerics mode
        untaken, taken = control_flow_ops.switch(test.ok, test.ok)
        finite_gate = tf.identity(taken, name="finite_pivot")
        ok, _ = control_flow_ops.merge(
            [finite_gate, tf.identity(untaken)], name="all_finite_checked"
        )
        # The check's output, live past the check on a step that is not finite.
        done, _ = control_flow_ops.switch(gate.gate, test.ok, name="overflow_done")
        return dataclasses.replace(gate, finite_gate=finite_gate, ok=ok, bad_done=done)
    writable = tf.logical_or(test.ok, test.overflow)
    _, taken = control_flow_ops.switch(writable, writable)
    pivot = tf.identity(taken, name="pivot_unless_bad")
    return dataclasses.replace(gate, gate=pivot, finite_gate=gate.gate)


def _loops(config: _policy.GuardConfig) -> Tuple[str, str]:
    """``(step_fn, hook)`` for tf-slim's learning loop and a hook-mode loop."""
    mine = " (a train_step_fn of your own calls it instead of tf_slim.learning.train_step)"
    if _policy.rolls_back(config):
        return (
            "slim_nanguard.make_train_step(logdir)" + mine,
            "slim_nanguard.nan_hook(train_op, checkpoint_dir=logdir)",
        )
    return "slim_nanguard.train_step" + mine, "slim_nanguard.nan_hook(train_op)"


def _check_message(config: _policy.GuardConfig, reason: Optional[_reasons.Reason] = None) -> str:
    """The check's message on a step `reason` (None: a non-finite step) rejected: true whether
    or not a loop catches it (`_errors.caught_numerics_error` rewrites the advice once one did)."""
    step_fn, hook = _loops(config)
    if reason is not None:
        what = f"{reason.what} (every value finite)"
        policy = f"{reason.policy_name}={reason.policy}"
    else:
        what = "NaN or Inf in the loss or a gradient"
        policy = f"nan_policy={config.nan_policy}"
    return (
        f"{_errors.REJECTED}: {what}; no variable was updated. {_errors.LOOP_ADVICE} "
        f"{policy} when it catches this error: slim_nanguard.train; tf_slim.learning.train "
        f"with train_step_fn={step_fn}; your own loop with "
        "slim_nanguard.handle_numerics_error(sess, err); tf_slim.training.train in hook mode "
        f"(check_numerics=False, hooks=[{hook}])"
    )


def _unjudged_message(config: _policy.GuardConfig) -> str:
    """The error of a hook-mode bad step that nothing judges (it names what to add)."""
    step_fn, hook = _loops(config)
    reasons = config.all_reasons
    what = ", or ".join(["NaN or Inf in the loss or a gradient"] + [r.what for r in reasons])
    policies = ", ".join(f"{r.policy_name}={r.policy}" for r in reasons)
    return (
        f"slim_nanguard: {what}, and no NanLossHook saw it, so "
        f"nan_policy={config.nan_policy}{f' ({policies})' if policies else ''} was not "
        f"applied (no variable was updated). Add hooks=[{hook}] to "
        "MonitoredTrainingSession or tf_slim.training.train; with tf_slim.learning.train "
        f"pass train_step_fn={step_fn}"
    )


def _first(flags: Sequence[tf.Tensor]) -> tf.Tensor:
    """Int32 scalar: the index of the first True of `flags` (0 if none is)."""
    if len(flags) == 1:
        return tf.constant(0, tf.int32)
    return tf.argmax(tf.cast(tf.stack(flags), tf.int32), output_type=tf.int32)


def _scratch(anchor: tf.Tensor, shape, name: str, dtype=tf.float64):
    """A variable of zeros in no collection (neither saved nor initialised: only read after a
    write), outside any loop, on the worker that computes `anchor` (not on the ps, where a
    replica_device_setter would share it among workers)."""
    with _capture.guard_variable_scope(anchor.graph, anchor):
        return tf.compat.v1.Variable(
            tf.zeros(shape, dtype), trainable=False, collections=[], use_resource=True, name=name
        )
