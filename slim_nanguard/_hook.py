"""`NanLossHook`: the hook-mode half of the guard, for `MonitoredTrainingSession`.

Life cycle (`tf.compat.v1.train.SessionRunHook`)::

    begin()                  # finds the guard of its loss; builds the rollback saver
    after_create_session()   # resets per-session state; marks the session judged
    while not stop:
      before_run()           # fetches one boolean: were the loss and all gradients finite
      run(train_op)          # a bad step writes no variable (create_train_op's gate)
      after_run()            # bad step: NanEvent, then the decided action:
                             #   raise    -> NanLossError (end() is not called)
                             #   stop     -> request_stop(); end() and the closing
                             #               checkpoint see the last accepted weights
                             #   skip     -> nothing; the next run takes the next batch
                             #   rollback -> restore the latest good checkpoint, skip input
                             # max_consecutive_bad_steps in a row: persistent_nan_policy
                             # a dynamic loss-scale overflow is recorded, not a bad step
    end()                    # nothing of the hook's own
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import tensorflow as tf

from slim_nanguard import _actions
from slim_nanguard import _gated_writes
from slim_nanguard import _guard
from slim_nanguard import _log as logging
from slim_nanguard import _nan_event
from slim_nanguard import _ops
from slim_nanguard import _policy
from slim_nanguard._types import Action
from slim_nanguard._types import Listener
from slim_nanguard._types import Mode


class NanLossHook(tf.compat.v1.train.NanTensorHook):
    """Catches NaN and Inf loss and gradients and applies the guard's policy in `after_run`.

    A drop-in for `tf.compat.v1.train.NanTensorHook` (same first two arguments). Given a loss
    or train op of `create_train_op(..., check_numerics=False)` it shares that train op's
    guard (policy, counters) and judges only the runs that run that train op; given a loss no
    guarded train op made, it fetches the loss on every run and can only raise or stop.

    Args:
      loss_tensor: The loss, or the train op `create_train_op` returned.
      fail_on_nan_loss: As in `NanTensorHook`: False turns the policy ``raise`` (the guard's,
        or an unguarded loss's) into ``stop``.
      nan_policy: Policy name that overrides both, for non-finite steps (a spike keeps
        ``spike_policy``). ``skip`` and ``rollback`` need a guarded train op.
      checkpoint_dir: Where the loop saves checkpoints; needed when the policy may roll back.
      event_listener: ``fn(record)`` called for each bad step and rollback.

    Raises:
      ValueError: `nan_policy` is no policy, or is ``skip`` or ``rollback`` for a loss that
        no guarded train op made (yet: build the train op first). In `begin`: the policy
        rolls back and no `checkpoint_dir` was given.
    """

    def __init__(
        self,
        loss_tensor: tf.Tensor,
        fail_on_nan_loss: bool = True,
        *,
        nan_policy: Optional[str] = None,
        checkpoint_dir: Optional[str] = None,
        event_listener: Optional[Listener] = None,
    ):
        super().__init__(loss_tensor, fail_on_nan_loss=fail_on_nan_loss)
        if nan_policy is not None and nan_policy not in _policy.POLICIES:
            raise ValueError(
                f"nan_policy must be one of {', '.join(_policy.POLICIES)} or None; "
                f"got {nan_policy!r}."
            )
        gated = (Action.SKIP, Action.ROLLBACK, Action.AUTO)  # Only a guarded op's steps.
        if nan_policy in gated and _guard.get_guard(loss_tensor) is None:
            raise ValueError(
                f"NanLossHook got nan_policy={nan_policy!r} for "
                f"{getattr(loss_tensor, 'name', loss_tensor)!r}, which comes from "
                "no guarded train op (or whose train op is not built yet: build it first): "
                "by the time the hook sees the loss, the update has happened, so it can only "
                "raise or stop. Build the train op with slim_nanguard.create_train_op and pass "
                "hooks=[slim_nanguard.nan_hook(train_op)] (or nan_policy='raise' or 'stop' for "
                "a loss-only check)."
            )
        self._nan_policy = nan_policy
        self._checkpoint_dir = checkpoint_dir
        self._event_listener = event_listener
        self._guard: Optional[_guard.Guard] = None
        self._run_args = None
        self._loss_args = None  # `_run_args` and the loss, for runs that fetch the train op
        # The last run's `Outcome` (``GOOD``: finite), or None if this hook did not judge it.
        self.last_outcome: Optional[_actions.Outcome] = None
        # Per session: a bare loss's own state.
        self._unguarded_state = _policy.GuardState()
        self._runs_train_op: Optional[_ops.RunsOp] = None  # None: judge every run
        self._judging = False

    @property
    def guard(self) -> Optional[_guard.Guard]:
        """The guard this hook reports to (None before `begin`, or with an unguarded loss)."""
        return self._guard

    @property
    def loss(self) -> tf.Tensor:
        """The loss (or train op) the hook was given."""
        return self._loss_tensor

    def begin(self):
        guard = self._guard = _guard.get_guard(self._loss_tensor)
        if guard is None:
            logging.info(
                "slim_nanguard: %s comes from no guarded train op; the hook checks the "
                "loss only and cannot undo an update.",
                self._loss_tensor.name,
            )
            self._run_args = tf.compat.v1.train.SessionRunArgs({"loss": self._loss_tensor})
            return
        if guard.mode == Mode.CHECK_NUMERICS and guard.ok is None:
            logging.info(
                "slim_nanguard: the train op of %s is in check_numerics mode; its "
                "check raises before this hook could run.",
                self._loss_tensor.name,
            )
        elif guard.ok is not None:  # (None in a loop body: `after_run` reads what it stored.)
            # One boolean per step (the loss too when the train op, its value, is fetched).
            self._run_args = tf.compat.v1.train.SessionRunArgs({"ok": guard.ok})
            self._loss_args = tf.compat.v1.train.SessionRunArgs(
                {"ok": guard.ok, "loss": guard.train_op}
            )
        _gated_writes.gate_writes_after(guard)
        self._runs_train_op = _ops.RunsOp(guard.train_op.op)
        if self._event_listener is not None:
            guard.add_listener(self._event_listener)
        guard.registry.use_directory(self._checkpoint_dir)  # Autopsy dumps go next to checkpoints.
        policy = self._effective_policy()
        if _policy.rolls_back(guard.config, policy) and not self._checkpoint_dir:
            advice = "NanLossHook(train_op, checkpoint_dir=...)"
            raise ValueError(_policy.checkpoint_dir_message(guard.config, advice, policy))
        if _policy.may_roll_back(guard.config, policy):
            # Built here if create_train_op did not (a policy override): after begin() the
            # graph is finalized. Kept by the guard: every rollback restores with it.
            guard.restorer.ensure_saver()

    def after_create_session(self, session, coord) -> None:
        # Per-session state only: the guard's counters describe the whole run.
        self._unguarded_state = _policy.GuardState()
        guard = self._guard
        if guard is None:
            return
        if guard.in_loop and guard.mode == Mode.HOOK:
            # Zeros until a bad iteration stores its loss and the kinds of its values.
            session.run(_in_loop_stores(guard))
        # This hook applies the policy here: a bad step must not fail as unjudged.
        _actions.mark_judged(guard, session)

    def before_run(self, run_context):
        self.last_outcome = None
        # The loss-only form judges every run (NanTensorHook's contract); a guarded train
        # op's hook only the runs of that train op, and asks nothing of the others.
        fetches = run_context.original_args.fetches
        self._judging = self._runs_train_op is None or self._runs_train_op(fetches)
        if not self._judging:
            return None
        if self._loss_args is not None:  # A run that fetches the train op gets the loss free.
            try:
                if any(f is self._guard.train_op for f in tf.nest.flatten(fetches)):
                    return self._loss_args
            except (TypeError, ValueError):  # A structure tf.nest cannot walk: not ours to read.
                pass
        return self._run_args

    def after_run(self, run_context, run_values) -> None:
        if not self._judging:  # Not a run of this hook's train op: nothing to judge.
            return
        results = run_values.results or {}  # Empty: a check_numerics-mode op fetches nothing.
        guard = self._guard
        if guard is None:
            loss = float(np.asarray(results["loss"]))
            if not math.isfinite(loss):
                self._unguarded_bad_step(run_context, loss)
            self.last_outcome = _actions.GOOD
            return
        ok, loss = results.get("ok"), results.get("loss")
        in_loop = guard.in_loop and guard.mode == Mode.HOOK
        if in_loop:  # No `ok` to fetch: a bad iteration stored the kinds of its values.
            ok = not np.any(run_context.session.run(guard.value_kinds))
        if ok is None or ok:  # A finite step (or a check_numerics-mode op).
            _actions.good_step(guard, loss)
            self.last_outcome = _actions.GOOD
            return
        try:
            self.last_outcome = _actions.judge(
                guard,
                run_context.session,
                checkpoint_dir=self._checkpoint_dir,
                policy=self._effective_policy(),
                request_stop=run_context.request_stop,
            )
        finally:
            if in_loop:  # A bad iteration's stores, read: zeros for the next run.
                run_context.session.run(_in_loop_stores(guard))

    def _effective_policy(self) -> Action:
        if self._nan_policy is not None:
            return Action(self._nan_policy)
        policy = Action(Action.RAISE if self._guard is None else self._guard.config.nan_policy)
        return Action.STOP if policy == Action.RAISE and not self._fail_on_nan_loss else policy

    def _unguarded_bad_step(self, run_context, loss: float) -> None:
        # Nothing was gated, so raise or stop (skip and rollback were refused at construction).
        read = _policy.BadStep(-1, self._effective_policy(), guarded=False, loss=loss)
        decision, self._unguarded_state = _policy.decide(
            _policy.GuardConfig(nan_policy=read.chosen), self._unguarded_state, read
        )
        counts = dict(consecutive=decision.consecutive, total=decision.total)
        event = _nan_event.event_of(read, mode=Mode.HOOK, action=decision.action, **counts)
        _nan_event.log_event(event)
        _actions.carry_out(
            None,
            run_context.session,
            event,
            decision,
            checkpoint_dir=None,
            request_stop=run_context.request_stop,
        )


def nan_hook(
    train_op: tf.Tensor,
    *,
    checkpoint_dir: Optional[str] = None,
    event_listener: Optional[Listener] = None,
) -> NanLossHook:
    """Returns the `NanLossHook` a train op from `create_train_op` needs in hook mode.

    Args:
      train_op: The tensor `create_train_op(..., check_numerics=False)` returned.
      checkpoint_dir: The directory checkpoints are saved to; needed when the policy may roll
        back. The record of bad steps (``nanguard_events.jsonl``) and autopsy dumps go there too.
      event_listener: ``fn(record)`` called for each bad step and rollback.

    Raises:
      ValueError: If `train_op` was not made by `slim_nanguard.create_train_op`, or its
        policy rolls back (``rollback``, or ``skip`` escalating to it) and `checkpoint_dir`
        is not given.
    """
    guard = _guard.get_guard(train_op)
    if guard is None:
        raise ValueError(
            f"{getattr(train_op, 'name', train_op)!r} was not made by "
            "slim_nanguard.create_train_op; build it with that, or use "
            "NanLossHook(loss) for a loss-only check."
        )
    if _policy.rolls_back(guard.config) and not checkpoint_dir:
        # Refused now, not at the first bad step: the information is all here.
        raise ValueError(
            _policy.checkpoint_dir_message(guard.config, "nan_hook(train_op, checkpoint_dir=...)")
        )
    return NanLossHook(guard.train_op, checkpoint_dir=checkpoint_dir, event_listener=event_listener)


def _in_loop_stores(guard) -> list:
    """The initializers of what a bad iteration of a hook-mode train op built in a loop body
    stores: its loss, and its values' kinds (all finite: zeros)."""
    return [guard.diagnostics.initializer, guard.value_kinds.initializer]
