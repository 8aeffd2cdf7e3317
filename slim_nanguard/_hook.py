"""`NanLossHook`: the hook-mode half of the guard, for `MonitoredTrainingSession`.

Life cycle, as `tf.compat.v1.train.SessionRunHook` defines it, and what the hook does in it::

    begin()                  # finds the guard of its loss; builds the rollback saver
    after_create_session()   # forgets per-session state (also after a session recovery);
                             #   marks the session judged (else a bad step fails in-graph)
    while not stop:
      before_run()           # asks for one boolean: were the loss and all gradients finite
      run(train_op)          # a bad step writes no variable (create_train_op's gate)
      after_run()            # finite: note a good step. Not finite: read the sums the bad
                             #   step stored (loss first); an overflow of a dynamic
                             #   loss-scale optimizer is recorded and is no bad step
                             #   (the optimizer lowered its scale). Else build a NanEvent,
                             #   and _actions.carry_out acts on the guard's decision:
                             #   raise  -> raise NanLossError (end() is then not called:
                             #             no closing checkpoint, none is needed)
                             #   stop   -> run_context.request_stop(); end() runs and the
                             #             closing checkpoint holds the last good weights
                             #   skip   -> nothing; the next run takes the next batch
                             #   rollback -> restore the latest good checkpoint, skip input
                             # (max_consecutive_bad_steps bad steps in a row under skip or
                             # rollback: the action is persistent_nan_policy's)
    end()                    # nothing of the hook's own

Which runs a hook judges: a hook of a guarded train op judges only the runs that run that
train op (their fetches hold it, its op or its name, or something that waits on it), and adds
nothing to any other run: ``before_run`` returns None and ``after_run`` does nothing. So a
weight read for logging between steps (``sess.run(w)``) pulls no batch from the input
pipeline, runs no backward pass, and is never judged as a step; nor is a run of the loss
alone, or of another guarded train op (a GAN's generator and discriminator each have their
own hook). The loss-only form, ``NanLossHook(loss)`` with a loss no guarded train op made,
fetches its loss on every run, as `NanTensorHook` does. A train op built in a
`tf.while_loop` cannot be fetched from: the hook then reads the sums a bad iteration stored
after each run of the loop (one extra small run per step) and reports one event per run,
whatever the number of bad iterations in it; the bad iterations wrote nothing, the others
trained.

After a bad step the weights, the optimizer slots, ``global_step`` and the batch-norm moving
statistics are as they were before it, because the train op gated every write (see
`create_train_op`); so whatever a `CheckpointSaverHook` saves, before or after this hook runs,
holds finite values. With a loss that no guarded train op produced (for example one from
`tf_slim.learning.create_train_op`) the hook still catches NaN *and* Inf loss, but it cannot
undo an update that already happened, and it sees no gradient.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import tensorflow as tf

from slim_nanguard import _actions
from slim_nanguard import _events
from slim_nanguard import _gating
from slim_nanguard import _guard
from slim_nanguard import _log as logging
from slim_nanguard import _ops
from slim_nanguard import _policy
from slim_nanguard._types import Action
from slim_nanguard._types import Listener
from slim_nanguard._types import Mode


class NanLossHook(tf.compat.v1.train.NanTensorHook):
    """Catches NaN and Inf loss and gradients and applies the guard's policy in `after_run`.

    A drop-in for `tf.compat.v1.train.NanTensorHook` (same first two arguments). With a loss
    or train op made by `slim_nanguard.create_train_op(..., check_numerics=False)` it uses that
    train op's guard: the same policy, counters and culprits as the hook
    ``slim_nanguard.nan_hook(train_op)`` returns, so building it by hand or taking the ready
    one is the same.

    Which policy applies: ``nan_policy`` when given; else the guard's policy (except that
    ``fail_on_nan_loss=False`` turns a guard's ``raise`` into ``stop``, as it does for
    `NanTensorHook`); with no guard, ``raise`` if ``fail_on_nan_loss`` else ``stop``.

    Args:
      loss_tensor: The loss, or the train op `create_train_op` returned.
      fail_on_nan_loss: As in `NanTensorHook`: raise on a bad step (True) or stop (False).
      nan_policy: Optional policy name that overrides the above. ``skip`` and ``rollback``
        need a guarded train op (nothing else can undo the step's update). It is for
        non-finite steps: a spike keeps the train op's ``spike_policy``.
      checkpoint_dir: Where the loop saves checkpoints; needed by the ``rollback`` policy and
        by ``persistent_nan_policy="rollback"``.
      event_listener: Optional ``fn(record)`` called for each bad step and rollback (see
        `Guard.add_listener`).

    Raises:
      ValueError: `nan_policy` is no policy, or is ``skip`` or ``rollback`` for a loss that
        no guarded train op made (yet: build the train op first).

    Every action, a bare loss's included, is carried out by `_actions.carry_out`; a rollback
    takes the guard's one route (a cluster's non-chief asks its chief: `_cluster`).
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
        if nan_policy in (Action.SKIP, Action.ROLLBACK) and _guard.get_guard(loss_tensor) is None:
            # Refused now: at the bad step the update has happened, and skip would do nothing.
            name = getattr(loss_tensor, "name", loss_tensor)
            raise ValueError(
                f"NanLossHook got nan_policy={nan_policy!r} for {name!r}, which comes from "
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
        self._last_outcome: Optional[_actions.Outcome] = None
        # The guard's bad-step count when the session was created; a bare loss, having no
        # guard, keeps a state of its own (one per session).
        self._session_start = 0
        self._unguarded_state = _policy.GuardState()
        # A guarded train op's hook judges only the runs that run it (set in begin()).
        self._runs_train_op: Optional[_ops.RunsOp] = None
        self._judging = False

    @property
    def guard(self) -> Optional[_guard.Guard]:
        """The guard this hook reports to (None before `begin`, or with an unguarded loss)."""
        return self._guard

    @property
    def loss(self) -> tf.Tensor:
        """The loss (or train op) the hook was given."""
        return self._loss_tensor

    @property
    def last_outcome(self) -> Optional[_actions.Outcome]:
        """What the last run this hook judged came to (`Outcome`; ``GOOD`` for a finite
        step), or None when the last run was not judged (another guard's train op). A loop
        reads it after each run instead of comparing counters."""
        return self._last_outcome

    @property
    def session_bad_steps(self) -> int:
        """Bad steps of this hook's guard since the current session was created (judged by
        this hook or by the loop it runs in: the guard's one tally)."""
        if self._guard is None:
            return self._unguarded_state.total_bad_steps
        return self._guard.state.total_bad_steps - self._session_start

    def begin(self):
        self._guard = _guard.get_guard(self._loss_tensor)
        if self._guard is None:
            logging.info(
                "slim_nanguard: %s comes from no guarded train op; the hook checks the "
                "loss only and cannot undo an update.",
                self._loss_tensor.name,
            )
            self._run_args = tf.compat.v1.train.SessionRunArgs({"loss": self._loss_tensor})
            return
        guard = self._guard
        if guard.ok is None:
            logging.info(
                "slim_nanguard: the train op of %s is in check_numerics mode; its "
                "check raises before this hook could run.",
                self._loss_tensor.name,
            )
        # One boolean per step. A bad step stored its gradient sums (the loss first) in the
        # guard's diagnostics variable, read with the global step on bad steps only.
        if guard.ok is not None:
            self._run_args = tf.compat.v1.train.SessionRunArgs(guard.ok)
            if not guard.in_loop:  # The train op's value is the loss of the step.
                self._loss_args = tf.compat.v1.train.SessionRunArgs(
                    {"ok": guard.ok, "loss": guard.train_op}
                )
        # Writes built after the train op that wait on it (an EMA chained after it).
        _gating.gate_writes_after(guard)
        self._runs_train_op = _ops.RunsOp(guard.train_op.op)
        if self._event_listener is not None:
            guard.add_listener(self._event_listener)
        guard.use_autopsy_dir(self._checkpoint_dir)  # Autopsy dumps go next to checkpoints.
        policy = self._effective_policy()
        if _policy.rolls_back(guard.config, policy) and not self._checkpoint_dir:
            raise ValueError(
                _policy.checkpoint_dir_message(
                    guard.config, "NanLossHook(train_op, checkpoint_dir=...)", policy
                )
            )
        if _policy.may_roll_back(guard.config, policy):
            # Built here if create_train_op did not (a policy override): after begin() the
            # graph is finalized. Kept by the guard: every rollback restores with it.
            guard.ensure_saver()

    def after_create_session(
        self, session: tf.compat.v1.Session, coord: tf.train.Coordinator
    ) -> None:
        # Per-session state only: the guard's counters describe the whole run.
        self._unguarded_state = _policy.GuardState()
        if self._guard is not None:
            self._session_start = self._guard.state.total_bad_steps
        if self._guard is not None and self._guard.in_loop and (self._guard.mode == Mode.HOOK):
            # Zeros until a bad iteration stores its (non-finite) sums.
            session.run(self._guard.diagnostics.initializer)
        if self._guard is not None:
            # This hook applies the policy here: a bad step must not fail as unjudged.
            self._guard.mark_judged(session)

    def before_run(self, run_context: tf.compat.v1.train.SessionRunContext):
        self._last_outcome = None
        # The loss-only form judges every run (NanTensorHook's contract); a guarded train
        # op's hook only the runs of that train op, and asks nothing of the others.
        self._judging = self._runs_train_op is None or self._runs_train_op(
            run_context.original_args.fetches
        )
        if self._judging and self._loss_args is not None:
            if self._fetches_train_op(run_context.original_args.fetches):
                return self._loss_args
        return self._run_args if self._judging else None

    def _fetches_train_op(self, fetches) -> bool:
        """Whether a run fetches the train op itself, whose value is the loss: asking for it
        too costs nothing (the session fetches a tensor once), and the guard keeps it for the
        record of the next bad step."""
        try:
            return any(f is self._guard.train_op for f in tf.nest.flatten(fetches))
        except (TypeError, ValueError):  # A structure tf.nest cannot walk: not ours to read.
            return False

    def after_run(
        self,
        run_context: tf.compat.v1.train.SessionRunContext,
        run_values: tf.compat.v1.train.SessionRunValues,
    ) -> None:
        results = run_values.results
        if not self._judging:  # Not a run of this hook's train op: nothing to judge.
            return
        guard = self._guard
        if guard is None:
            loss = float(np.asarray(results["loss"]))
            if not math.isfinite(loss):
                self._unguarded_bad_step(run_context, loss)
            self._last_outcome = _actions.GOOD
            return
        loss = None
        if isinstance(results, dict):  # `_loss_args`: the verdict and the loss.
            results, loss = results["ok"], results["loss"]
        stored = None
        if guard.in_loop and guard.mode == Mode.HOOK:
            stored = guard.read_bad_step(run_context.session)
            results = bool(np.all(np.isfinite(stored[1])))
            if not results:  # A bad iteration stored its sums; zero them for the next run.
                run_context.session.run(guard.diagnostics.initializer)
        if results is None or results:  # A finite step (or a check_numerics-mode op).
            _actions.good_step(guard, loss)
            self._last_outcome = _actions.GOOD
            return
        self._last_outcome = _actions.judge(
            guard,
            run_context.session,
            checkpoint_dir=self._checkpoint_dir,
            policy=self._effective_policy(),
            stored=stored,
            request_stop=run_context.request_stop,
        )

    def _effective_policy(self) -> Action:
        if self._nan_policy is not None:
            return Action(self._nan_policy)
        policy = Action(self._guard.config.nan_policy)
        if policy == Action.RAISE and not self._fail_on_nan_loss:
            return Action.STOP
        return policy

    def _unguarded_bad_step(
        self, run_context: tf.compat.v1.train.SessionRunContext, loss: float
    ) -> None:
        # No guard: nothing was gated, so there is nothing to skip or roll back; raise or stop
        # (skip and rollback were refused at construction).
        policy = Action(
            self._nan_policy or (Action.RAISE if self._fail_on_nan_loss else Action.STOP)
        )
        decision, self._unguarded_state = _policy.decide(
            _policy.GuardConfig(nan_policy=policy),
            self._unguarded_state,
            _policy.BadStep(-1, policy, guarded=False),
        )
        state = self._unguarded_state
        event = _events.NanEvent(
            step=-1,
            loss=loss,
            loss_kind=_events.classify(loss),
            culprits=(),
            consecutive=state.consecutive_bad_steps,
            total=state.total_bad_steps,
            mode=Mode.HOOK,
            action=decision.action,
        )
        _events.log_event(event)
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
      checkpoint_dir: The directory checkpoints are saved to (needed by ``rollback``, and by
        ``persistent_nan_policy="rollback"``). The record of bad steps
        (``nanguard_events.jsonl``) and the autopsy dumps go there too.
      event_listener: Optional ``fn(record)`` for each bad step and rollback.

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
    if guard.config.needs_checkpoint_dir and not checkpoint_dir:
        # Refused now, not at the first bad step: the information is all here.
        raise ValueError(
            _policy.checkpoint_dir_message(guard.config, "nan_hook(train_op, checkpoint_dir=...)")
        )
    return NanLossHook(guard.train_op, checkpoint_dir=checkpoint_dir, event_listener=event_listener)
