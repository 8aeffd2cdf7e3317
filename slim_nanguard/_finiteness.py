"""The per-step test: whether a step's loss and gradients are all finite, built once.

Both modes build the same test (`StepTest`): the exact verdict of `_verdict` over the loss
and the gradients (one reduction pass: the loss plus half the gradients' sum of squares, one
``L2Loss`` per stack of same-shape gradients; element-wise only when that is not finite),
the sum of each gradient for the record (summed only on a step whose fast test failed), and,
with a dynamic loss-scale optimizer, the overflow test. Then each mode puts it in front of
the writes its own way (`build_gate`):

* check_numerics mode: a `tf.debugging.check_numerics` op on the verdict (with a spike
  policy an ``Assert`` whose message names the step's cause), which the writes wait on; a
  bad step raises before any of them runs. The sums are stored on a step whose
  fast test failed, before the check raises; the forward pass's writes are put back, and the
  batch kept for the autopsy, before it raises too.
* hook mode: a ``Switch`` on the verdict; the writes wait on its taken side (the pivot), and
  only the untaken side, live on a bad step, stores the sums, puts the forward pass's writes
  back, keeps the batch and checks that something judges the step (`Guard.mark_judged`).
  The hook fetches one boolean (``ok``) per step.

With a spike policy (`_policy.GuardConfig.spike_policy`), the test has one more reason to
fail: the spike test of `_spike` over the loss and the verdict's global gradient norm, so
``ok`` is "all finite and no spike". Every part of the gate then switches on that ``ok``; a
bad step (either cause) stores a report (its cause, and the spike's values and statistics)
for the loop to read, and check_numerics mode checks a value that is NaN on a spike step
(with an ``Assert``: CheckNumerics would say "Tensor had NaN values" of a finite step).
Without a spike policy none of that is built: the graph is the same as without the option.

The result is a `Gate`: what the writes wait on (`_gating`), what the hook fetches, and the
branch that yields the loss on a bad step.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import control_flow_ops

from slim_nanguard import _capture
from slim_nanguard import _errors
from slim_nanguard import _ops
from slim_nanguard import _policy
from slim_nanguard import _reasons
from slim_nanguard import _verdict
from slim_nanguard._gating import ForwardWrites
from slim_nanguard._types import Mode


class StepTest:
    """The finiteness test of one train op, the same for both modes.

    Attributes:
      present: The (gradient, variable) pairs that have a gradient, in order.
      grad_sums: Vector: the loss, then the sum of each gradient of `present`. Nothing the
        train op runs waits on it: it runs when fetched (the autopsy's replay).
      kinds: Int32 variable: what each of the loss and the gradients held (`_verdict` kind
        codes), stored on a step whose fast test failed.
      verdict: The exact `_verdict.Verdict` over the loss and the gradients.
      scaler: The `_OverflowTest` of a dynamic loss-scale optimizer, or None.
      kept: What a bad step stores for the hook to read: the sums of `grad_sums`, built on
        the bad branch (`when_bad`: a good step does not sum each gradient), and with a loss
        scale the scale of the step after them.
      diagnostics: The variable `kept` is stored in.
      reasons: The `_reasons.Reason`s besides non-finite values, and `tests` their tests.
      ok: Scalar bool, True on a step that may write: `verdict.ok`, and no reason rejects.
      checked: What check_numerics mode checks: `verdict.checked`, NaN on a rejected step.
      cause: With reasons, int32: 0 for a non-finite step, else 1 + the index of the first
        reason that rejects it; else None.
      report: With reasons, the float64 variable a bad step stores ``cause + 1`` and each
        reason's report in (`read_report`), for the loop to read; else None.
      judged: With reasons, the float64 variable an accepted step stores each reason's
        judged values in (`accepted_writes`), which the summaries read; else None.
    """

    def __init__(
        self,
        loss: tf.Tensor,
        grads_and_vars,
        loss_scale=None,
        reasons: Sequence[_reasons.Reason] = (),
    ):
        """Builds the test in the current name scope.

        Args:
          loss: The total loss.
          grads_and_vars: The (gradient, variable) pairs the train op applies.
          loss_scale: The `DynamicLossScale` of a loss-scale optimizer (`dynamic_loss_scale`),
            or None.
          reasons: The reasons to reject a step besides non-finite values, in order (the
            first that rejects names the cause). None: the test of non-finite values alone.
        """
        graph = loss.graph
        self.present = [(g, v) for g, v in grads_and_vars if g is not None]
        self.grad_sums = _gradient_sums(loss, [g for g, _ in self.present])
        # What each of the loss and the gradients held, stored when the verdict's fast test
        # fails (exact: a finite value is never called NaN or Inf). Like the variable of
        # the sums below: in no collection, only read after a write.
        with _capture.guard_variable_scope(graph, self.grad_sums):
            self.kinds = tf.compat.v1.Variable(
                tf.zeros([len(self.present) + 1], tf.int32),
                trainable=False,
                collections=[],
                use_resource=True,
                name="value_kinds",
            )
        self.verdict = _verdict.Verdict(
            [g for g, _ in self.present], loss=loss, kinds_variable=self.kinds
        )
        self.ok, self.checked = self.verdict.ok, self.verdict.checked
        self.report = self.judged = self.cause = self._bad = self._switch = None
        self.reasons, self.tests = (), ()
        if reasons:
            self._add_reasons(loss, reasons)
        with self.when_bad():  # The sums a bad step leaves, summed on that step only.
            self.kept = _gradient_sums(loss, [g for g, _ in self.present])
        self.scaler = None
        if loss_scale is not None:
            self.scaler = _OverflowTest(self.kept, loss_scale, self)
            self.kept = self.scaler.sums_and_scale
        # The sums are kept for the step that needs them, so that the culprits can be
        # named afterwards. The variable is in no collection: it is neither saved in
        # checkpoints nor initialised (it is only read after a write).
        # Made outside any loop the train op is built in, and on this worker: a
        # replica_device_setter would put it on the ps, shared by all workers.
        with _capture.guard_variable_scope(graph, self.grad_sums):
            self.diagnostics = tf.compat.v1.Variable(
                tf.zeros(self.kept.shape, self.kept.dtype),
                trainable=False,
                collections=[],
                use_resource=True,
                name="gradient_sums",
            )

    def _add_reasons(self, loss: tf.Tensor, reasons: Sequence[_reasons.Reason]) -> None:
        """Makes each reason one more way to fail: `ok`, `checked`, the bad branch, `report`
        and `judged`."""
        graph = loss.graph
        values = _reasons.StepValues(
            loss,
            tuple(g for g, _ in self.present),
            self.verdict.global_norm,
            # In the checkpoints, so outside any loop body and not colocated with the step:
            # on a cluster, on the ps with the model (one state for all workers).
            state_scope=lambda: _outside_loops(graph),
        )
        self.reasons = tuple(reasons)
        self.tests = tuple(reason.build(values) for reason in self.reasons)
        rejects = [test.reject for test in self.tests]
        rejected = rejects[0] if len(rejects) == 1 else tf.reduce_any(tf.stack(rejects))
        # A rejection adds a NaN to the checked value: `checked` is non-finite, and `ok`
        # False, exactly when a value is non-finite or a reason rejects the step.
        dtype = self.verdict.checked.dtype
        penalty = tf.where(rejected, tf.constant(np.nan, dtype), tf.constant(0.0, dtype))
        self.checked = tf.add(self.verdict.checked, penalty, name="checked_no_spike")
        self.ok = tf.math.is_finite(self.checked, name="ok_no_spike")
        untaken, self._good = self.ok_switch()
        self._bad = tf.identity(untaken, name="bad_step")
        # 0 for a non-finite step, else 1 + the index of the first reason that rejects it.
        self.cause = tf.where(self.verdict.ok, _first(rejects) + 1, 0, name="cause")
        with self.when_bad():
            stored = [tf.reshape(tf.cast(self.cause + 1, tf.float64), [1])]
            report = tf.concat(stored + [test.report() for test in self.tests], 0)
        self.report = _scratch(graph, self.grad_sums, report.shape, "bad_step_report")
        self._report_store = self.report.assign(report, read_value=False)
        # What the summaries read: written by an accepted step (`accepted_writes`), in no
        # collection (neither saved nor initialised), on the worker that computes it.
        fields = sum(len(r.judged_fields) for r in self.reasons)
        self.judged = _scratch(graph, self.grad_sums, [fields], "last_accepted_step")
        # For TensorBoard, with the summaries a loop writes (tf-slim merges the collection),
        # tagged nanguard/... whatever the scope.
        with tf.name_scope("nanguard/"):
            self._add_summaries()

    def accepted_writes(self) -> list:
        """What an accepted step writes for its reasons, in the current control context: the
        train op builds it behind its gate, so a rejected step writes nothing (not even the
        summaries' values)."""
        writes = [op for test in self.tests for op in test.writes()]
        judged = [test.judged() for test in self.tests if test.judged is not None]
        if judged:
            vector = judged[0] if len(judged) == 1 else tf.concat(judged, 0)
            writes.append(self.judged.assign(vector, read_value=False))
        return writes

    def _add_summaries(self) -> None:
        """Each reason's summaries of the last accepted step (zeros before the first one in
        a session), read from `judged`: a run of the summary op that is no train step (a
        summary thread, a hook firing on another run) takes no batch. Run with a train
        step, it may read that step's values or the ones before."""
        stored = _ops.read_once_written(self.judged, 0.0)
        start = 0
        for reason in self.reasons:
            size = len(reason.judged_fields)
            if not size:
                continue
            mine = stored if size == stored.shape[0] else stored[start : start + size]
            start += size
            for name, value in reason.summaries(mine).items():
                tf.compat.v1.summary.scalar(name, value)

    def reason_variables(self) -> Tuple[tf.Variable, ...]:
        """The reasons' state in the checkpoints (none without reasons)."""
        return tuple(v for test in self.tests for v in test.variables)

    def ok_switch(self) -> Tuple[tf.Tensor, tf.Tensor]:
        """``(untaken, taken)``: `ok` switched on itself, built once (in the current name
        scope) and shared by whatever branches on the step's verdict: the untaken side has a
        value on a bad step only, the taken side on a good one."""
        if self._switch is None:
            self._switch = control_flow_ops.switch(self.ok, self.ok)
        return self._switch

    @contextlib.contextmanager
    def when_bad(self) -> Iterator[None]:
        """Ops built in this block run on a step that is bad, or may be: without a spike test,
        when the verdict's fast test failed (`Verdict.when_failed`), else when `ok` is False."""
        if self._bad is None:
            with self.verdict.when_failed():
                yield
        else:
            with tf.control_dependencies([self._bad]):
                yield

    def stores(self) -> list:
        """What a bad step stores for the loop besides the sums: the report, with reasons."""
        return [] if self.report is None else [self._report_store]

    def after_bad_stores(self, ops: Sequence) -> tf.Tensor:
        """With a spike test: a tensor live on every step, after `ops` (built in `when_bad`)
        and the report's store on a bad step, at once on any other."""
        with tf.control_dependencies(list(ops) + self.stores()):
            done = tf.identity(self._bad)
        return control_flow_ops.merge([tf.identity(self._good), done])[0]


@contextlib.contextmanager
def _outside_loops(graph: tf.Graph) -> Iterator[None]:
    with _capture.outside_control_flow(graph), tf.init_scope():
        yield


@dataclasses.dataclass(frozen=True)
class Gate:
    """The test, put in front of the writes of one mode.

    Attributes:
      mode: `Mode.CHECK_NUMERICS` or `Mode.HOOK`.
      gate: What every write waits on: the check's output (check_numerics mode) or the
        pivot, live on a good step only (hook mode). With a loss-scale optimizer, open on an
        overflow step too: the scale's writes wait on it alone.
      finite_gate: With a loss-scale optimizer, open on a finite step only: every write but
        the scale's waits on it too. Else None.
      ok: The boolean the hook fetches (True on a finite step), or None.
      bad_done: Live on a step that is not finite (after the bad branch's work), or None: the
        train op yields the loss through it.
      check_op_name: The name of the op that raises a bad step's error (check_numerics
        mode: the CheckNumerics op, or with a spike policy the Assert), or None.
      judged: Hook mode's variable that the loop judging the session initialises, or None.
      capture: The batch a bad step keeps, for the autopsy.
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
        """What a write built after the train op must wait on (`_gating.gate_writes_after`).

        Hook mode's pivot; with a loss-scale optimizer, the finite gate (in both modes: an
        overflow step does not raise). None in check_numerics mode otherwise.
        """
        if self.finite_gate is not None:
            return self.finite_gate
        return self.gate if self.mode == Mode.HOOK else None

    def loss_after(self, loss: tf.Tensor, writes: Sequence) -> tf.Tensor:
        """The train op: `loss`, once `writes` ran (a good step) or the bad branch did."""
        with tf.name_scope("train_op"):
            extra = [self.finite_gate] if self.finite_gate is not None else []
            with tf.control_dependencies(list(writes) + extra):
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
    """Puts `test` in front of the writes, in the mode `check_numerics` picks.

    Args:
      test: The step's test.
      config: The guard's config (its policy names what to add in the error of a bad step
        nothing judges).
      check_numerics: True for check_numerics mode, False for hook mode.
      forward: The forward pass's writes, put back on a bad step.
      loss: The total loss (its batch is kept for the autopsy).
      autopsy: Whether to keep a bad step's batch.
    """
    build = _check_numerics_gate if check_numerics else _hook_gate
    gate = build(test, config, forward, loss, autopsy)
    if test.scaler is None:
        return gate
    pivot, finite_gate, ok, bad_done = test.scaler.gates(gate.gate, gate.ok, gate.bad_done)
    return dataclasses.replace(gate, gate=pivot, finite_gate=finite_gate, ok=ok, bad_done=bad_done)


def _check_numerics_gate(test, config, forward, loss, autopsy) -> Gate:
    """Check_numerics mode: a check op the writes wait on; a bad step raises there."""
    # Stored on a step whose fast test failed (or that is a spike), before the check raises.
    store = test.diagnostics.assign(test.kept, read_value=False)
    ready = []
    if not test.reasons:
        test.verdict.confirm_after([store])
    else:
        ready.append(test.after_bad_stores([store]))
    if forward.snapshots:  # Put back before the check raises.
        ok = test.ok
        untaken, taken = test.ok_switch()
        with tf.control_dependencies(forward.put_back(ok)):
            restored_done = tf.identity(untaken)
        ready.append(control_flow_ops.merge([tf.identity(taken), restored_done])[0])
    # The batch, kept on a bad step only (for the autopsy): the check waits on a merge of a
    # good-step no-op and the bad step's stores.
    capture = _capture.keep_batch(loss, test.ok, enabled=autopsy)
    checked = test.checked if test.scaler is None else test.scaler.unless_overflow
    with tf.control_dependencies(ready + capture.control_inputs):
        if not test.reasons:
            check = tf.debugging.check_numerics(checked, _check_message(config))
            check_op = check.op
        else:
            check, check_op = _reasons_check(test, checked, config)
    return Gate(Mode.CHECK_NUMERICS, check, capture, check_op_name=check_op.name)


def _reasons_check(test: StepTest, checked: tf.Tensor, config) -> Tuple[tf.Tensor, tf.Operation]:
    """With reasons: ``(gate, op)``, an ``Assert`` that `checked` is finite, whose message
    names the step's cause (CheckNumerics would add "Tensor had NaN values" to a finite
    step's), and `checked` once it passed."""
    messages = [_check_message(config)] + [_check_message(config, r) for r in test.reasons]
    message = tf.gather(tf.constant(messages), test.cause, name="check_message")
    check = tf.debugging.Assert(tf.math.is_finite(checked), [message], name="check_numerics")
    with tf.control_dependencies([check]):
        return tf.identity(checked, name="checked"), check


def _hook_gate(test, config, forward, loss, autopsy) -> Gate:
    """Hook mode: a switch whose taken side the writes wait on; the other is the bad step's."""
    ok = test.ok
    untaken, taken = test.ok_switch()
    # Ops that wait on the pivot are dead, so skipped, when `ok` is False. (A control edge
    # straight from a Switch does not carry deadness; from an Identity of its output it does,
    # which is how tf.cond gates its branches.)
    pivot = tf.identity(taken, name="pivot")
    # The other side runs on a bad step only: it stores the sums there, so that a good step
    # costs the hook one boolean fetch.
    bad_sums, _ = control_flow_ops.switch(test.kept, ok)
    store = test.diagnostics.assign(bad_sums, read_value=False)
    # Whatever applies the policy initialises `judged` in its session, once
    # (Guard.mark_judged: nothing to feed, no cost per step). A bad step in a session where it
    # is not (no hook: tf_slim.learning.train, a plain session.run loop) fails here, naming
    # what to add, instead of being skipped unseen. The variable is in no collection: no
    # initializer, Saver or readiness check touches it. Both tests wait on the bad branch, so
    # they run on bad steps only.
    with _capture.guard_variable_scope(loss.graph, test.grad_sums):
        judged = tf.compat.v1.Variable(
            True, trainable=False, collections=[], use_resource=True, name="judged"
        )
    bad_pivot = tf.identity(untaken)
    with tf.control_dependencies([bad_pivot]):
        is_judged = tf.raw_ops.VarIsInitializedOp(resource=judged.handle)
    passes = tf.logical_or(is_judged, bad_pivot)
    if test.scaler is not None:  # An overflow is the loss scale's business: it passes.
        passes = tf.logical_or(passes, test.scaler.overflow)
    unjudged = tf.debugging.Assert(passes, [_unjudged_message(config)], name="unjudged")
    # The batch too, for the autopsy, on the same bad branch.
    capture = _capture.keep_batch(loss, ok, merge=False, enabled=autopsy)
    stores = [store, unjudged] + test.stores() + list(capture.stores) + forward.put_back(ok)
    with tf.control_dependencies(stores):
        bad_done = tf.identity(untaken)
    # What the hook fetches: `ok`, through the store on a bad step, so the sums are there to
    # read even after a run that did not fetch the train op.
    ok, _ = control_flow_ops.merge([pivot, bad_done], name="all_finite_checked")
    return Gate(Mode.HOOK, pivot, capture, ok=ok, bad_done=bad_done, judged=judged)


def dynamic_loss_scale(optimizer) -> Optional[tf.compat.v1.mixed_precision.DynamicLossScale]:
    """The `DynamicLossScale` of a loss-scale optimizer, or None.

    A loss-scale optimizer (`tf.compat.v1.train.experimental.MixedPrecisionLossScaleOptimizer`)
    wraps an inner optimizer and has a loss scale. Only a dynamic one skips the update of an
    overflow step and lowers the scale; a fixed scale is a constant factor, and an overflow
    under it is a bad step like any other.
    """
    loss_scale = getattr(optimizer, "_loss_scale", None)
    if hasattr(optimizer, "_optimizer") and isinstance(
        loss_scale, tf.compat.v1.mixed_precision.DynamicLossScale
    ):
        return loss_scale
    return None


def loss_scale_variables(loss_scale) -> list:
    """The variables a loss scale updates (the current scale and its count of good steps)."""
    return list(getattr(loss_scale, "_weights", {}).values())


def _gradient_sums(loss: tf.Tensor, grads: Sequence) -> tf.Tensor:
    """One vector: the loss, then the sum of each gradient (NaN/Inf iff one element is)."""
    return _verdict.tensor_sums([loss] + list(grads), name="gradient_sums")


class _OverflowTest:
    """The finiteness test of a train op whose optimizer scales the loss dynamically.

    A step is one of three kinds:

    * finite (loss and every gradient): every write runs;
    * an overflow (`_verdict.overflow_rule`): the loss (the user's, unscaled) is finite, a
      gradient is not, and the loss scale is above its floor. The optimizer skips the update
      and lowers the scale, so the scale's writes run and no other;
    * bad: any other non-finite step (a non-finite loss, or an overflow at the floor, where
      lowering the scale cannot help). No write runs.

    Attributes:
      floor: The smallest loss scale (`DynamicLossScale` never goes below 1).
      sums_and_scale: The loss, the sum of each gradient, then the loss scale of the step:
        what the guard keeps for the hook to read (it has a value on a step whose fast test
        failed only, as the sums do).
      finite: Scalar bool, the loss and all gradients finite.
      overflow: Scalar bool, an overflow step.
      unless_overflow: The sum check_numerics mode checks: finite on an overflow step.
    """

    floor = _verdict.LOSS_SCALE_FLOOR

    def __init__(self, grad_sums: tf.Tensor, loss_scale, test: StepTest):
        # The scale this step multiplied the loss by. The scale's writes wait on this test.
        scale = tf.cast(loss_scale(), grad_sums.dtype)
        self.sums_and_scale = tf.concat(
            [grad_sums, tf.reshape(scale, [1])], 0, name="gradient_sums_and_loss_scale"
        )
        verdict = test.verdict
        self.finite = test.ok  # And no rejection by a reason, with reasons.
        self.overflow = _verdict.overflow_rule(
            tf.logical_not(verdict.ok),
            tf.math.is_finite(verdict.tensors[0]),
            scale,
            both=tf.logical_and,
            name="loss_scale_overflow",
        )
        checked = test.checked
        self.unless_overflow = tf.where(self.overflow, tf.zeros_like(checked), checked)

    def gates(self, gate: tf.Tensor, ok: Optional[tf.Tensor], bad_done: Optional[tf.Tensor]):
        """Returns ``(gate, finite_gate, ok, bad_done)`` for a loss-scaled train op.

        ``gate`` is open unless the step is bad (the scale's writes wait on it), and
        ``finite_gate`` only on a finite step (every other write waits on it too). ``ok`` is
        what the hook fetches (False on an overflow step as on a bad one), and ``bad_done`` is
        live when the step is not finite, so the train op yields the loss on an overflow step.

        Args:
          gate: The mode's gate: the check op (check_numerics mode, which lets an overflow
            step through, see `unless_overflow`), or hook mode's pivot, open on finite steps.
          ok: Hook mode's fetched boolean, or None in check_numerics mode.
          bad_done: Hook mode's bad-branch marker, or None.
        """
        if ok is None:  # check_numerics mode
            untaken, taken = control_flow_ops.switch(self.finite, self.finite)
            finite_gate = tf.identity(taken, name="finite_pivot")
            ok, _ = control_flow_ops.merge(
                [finite_gate, tf.identity(untaken)], name="all_finite_checked"
            )
            # The check's output, live past the check on a step that is not finite.
            overflow_done, _ = control_flow_ops.switch(gate, self.finite, name="overflow_done")
            return gate, finite_gate, ok, overflow_done
        writable = tf.logical_or(self.finite, self.overflow)
        _, taken = control_flow_ops.switch(writable, writable)
        return tf.identity(taken, name="pivot_unless_bad"), gate, ok, bad_done


def _loops(config: _policy.GuardConfig) -> Tuple[str, str]:
    """``(step_fn, hook)``: what tf-slim's learning loop and a hook-mode loop take."""
    if config.needs_checkpoint_dir:
        return (
            "slim_nanguard.make_train_step(logdir)",
            "slim_nanguard.nan_hook(train_op, checkpoint_dir=logdir)",
        )
    return "slim_nanguard.train_step", "slim_nanguard.nan_hook(train_op)"


def _check_message(config: _policy.GuardConfig, reason: Optional[_reasons.Reason] = None) -> str:
    """The message of check_numerics mode's check on a step that `reason` rejected (None: a
    non-finite step).

    TensorFlow's runtime logs it on every failing run ("Local rendezvous is aborting with
    status: ..."), whether or not a loop catches the error, so it says only what holds
    either way: the step was rejected and why, and which loops apply the policy when they
    catch it (what to add when none did). A reason's names no NaN or Inf: its values are
    finite. `_errors.caught_numerics_error` rewrites the advice once a loop applied it.
    """
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
    """Int32 scalar: the index of the first of `flags` that is True (0 if none is)."""
    if len(flags) == 1:
        return tf.constant(0, tf.int32)
    return tf.argmax(tf.cast(tf.stack(flags), tf.int32), output_type=tf.int32)


def _scratch(graph: tf.Graph, anchor: tf.Tensor, shape, name: str) -> tf.Variable:
    """A float64 variable of the guard's per-step scratch, zeros at first: in no collection
    (neither saved nor initialised: only read after a write), on the worker that computes
    `anchor`, outside any loop."""
    with _capture.guard_variable_scope(graph, anchor):
        return tf.compat.v1.Variable(
            tf.zeros(shape, tf.float64),
            trainable=False,
            collections=[],
            use_resource=True,
            name=name,
        )
