"""The executor and the loop's bookkeeping, in process: stories with fakes, no training run.

`_actions.carry_out` is the one code that acts on a decision; each test hands it a decision
and a fake guard or session and reads the `Outcome`. `_loop._Progress` takes its clock as an
argument, so its lines are checked with a fake clock and no sleep.
"""

import dataclasses
import logging
import pickle

import pytest
import tensorflow as tf

import slim_nanguard
from slim_nanguard import _actions
from slim_nanguard import _loop
from slim_nanguard import _nan_event
from slim_nanguard import _ops
from slim_nanguard import _policy
from slim_nanguard import _rollback
from slim_nanguard._nan_event import NanEvent
from slim_nanguard._types import Action
from slim_nanguard._types import Cause

import nanguard_testlib as lib


def _event(action, step=4):
    return NanEvent(
        step=step,
        loss=float("nan"),
        loss_kind="nan",
        culprits=("w",),
        consecutive=1,
        total=1,
        mode="hook",
        action=action,
    )


class _FakeRestorer:
    """A guard's restorer that restores nothing and says which checkpoint it would."""

    def __init__(self, rollbacks):
        self._rollbacks = rollbacks

    def restore(
        self,
        session,
        checkpoint_dir,
        *,
        bad_step,
        learning_rate_scale,
        skip_batches,
        before_step=None,
        why="",
    ):
        self._rollbacks.append((session, checkpoint_dir))
        return _rollback.Restored(f"{checkpoint_dir}/model.ckpt-2", 2, 0, learning_rate_scale)


class _FakeSession:
    """A raw session whose every run reads global step 2."""

    def run(self, fetches):
        return 2


_SESSION = _FakeSession()
# The fields every record carries of its event: what a record adds is the rest.
_EVENT_FIELDS = {"kind", *_event("skip").to_json()}


class _FakeGuard:
    """What carry_out reads of a guard: its restorer (or rollback request), its global step,
    and the state it observes; its records are kept (kind, what the record adds)."""

    def __init__(self):
        self.rollbacks = []
        self.records = []
        self.restorer = _FakeRestorer(self.rollbacks)
        self.rollback_request = None
        self.history = _nan_event.LossHistory(0)
        self.config = _policy.GuardConfig()
        self.cell = self  # The state cell: `state`.
        self.state = _policy.GuardState()
        self.registry = self  # The listeners: `send`.
        self.global_step = "global_step"

    def send(self, record):
        added = {k: v for k, v in record.items() if k not in _EVENT_FIELDS}
        self.records.append((record["kind"], added))


def _carry_out(action, **kwargs):
    guard = _FakeGuard()
    decision = _policy.Decision(Action(action))
    outcome = _actions.carry_out(
        guard, _SESSION, _event(action), decision, checkpoint_dir="/run", **kwargs
    )
    return guard, outcome


def test_skip_does_nothing_and_says_the_step_was_bad():
    guard, outcome = _carry_out("skip", request_stop=lambda: pytest.fail("no stop"))
    assert (outcome.action, outcome.stop, outcome.bad, outcome.good) == ("skip", False, True, False)
    assert guard.rollbacks == []


def test_stop_asks_the_given_stop_once():
    asked = []
    _, outcome = _carry_out("stop", request_stop=lambda: asked.append(True))
    assert asked == [True] and outcome.stop and outcome.action is Action.STOP


def test_rollback_uses_the_guards_rollback_and_reports_the_new_step():
    guard, outcome = _carry_out("rollback")
    assert guard.rollbacks == [(_SESSION, "/run")]
    assert (outcome.step, outcome.checkpoint) == (2, "/run/model.ckpt-2")
    assert not outcome.stop


def test_a_guards_rollback_request_is_its_one_other_route():
    """A cluster worker asks its chief instead of restoring here: no restore, a request
    counted and recorded, and an outcome that restored nothing."""
    asked = []
    guard = _FakeGuard()
    guard.rollback_request = lambda session, g, event: asked.append(event.step) or {"chief": 0}
    outcome = _actions.carry_out(
        guard,
        _SESSION,
        _event("rollback"),
        _policy.Decision(Action.ROLLBACK),
        checkpoint_dir="/run",
    )
    assert asked == [4] and guard.rollbacks == [] and outcome.checkpoint == ""
    assert (guard.state.rollback_requests, guard.state.rollbacks) == (1, 0)
    assert guard.records == [("rollback_requested", {"chief": 0})]


def test_a_restore_is_counted_by_the_state_and_recorded():
    guard, _ = _carry_out("rollback")
    assert (guard.state.rollbacks, guard.state.rollback_requests) == (1, 0)
    assert [kind for kind, _ in guard.records] == ["rollback"]


def test_raise_raises_the_error_with_its_cause_chained_to_the_numerics_error():
    cause = ValueError("the check")
    decision = _policy.Decision(
        Action.RAISE, reason="3 rollbacks", give_up=Cause.MAX_ROLLBACKS, limit=3
    )
    with pytest.raises(slim_nanguard.NanLossError) as caught:
        _actions.carry_out(
            _FakeGuard(), "s", _event("raise"), decision, checkpoint_dir=None, error=cause
        )
    assert caught.value.cause is Cause.MAX_ROLLBACKS and caught.value.limit == 3
    assert caught.value.__cause__ is cause
    assert pickle.loads(pickle.dumps(caught.value)).cause is Cause.MAX_ROLLBACKS


def test_a_good_outcome_is_good():
    assert _actions.GOOD.good and not _actions.GOOD.bad and not _actions.GOOD.stop
    overflow = _actions.Outcome(overflow=True)
    assert not overflow.good and not overflow.bad


def test_the_loop_tallies_its_result_from_the_guards_state():
    """A good step, a skip, an overflow, a restore, a worker's request, a good step: the
    call's counts are the guard's state since it began (the transition's own stories are in
    test_policy_transition)."""
    guard = _FakeGuard()

    def bad_step(action):
        decision = _actions.observe(guard, _policy.BadStep(-1, Action(action)))
        _actions.carry_out(guard, _SESSION, _event(action), decision, checkpoint_dir="/run")

    bad_step("skip")  # before the call: not in its counts
    start = guard.state
    _actions.good_step(guard, 1.0)
    bad_step("skip")
    _actions.observe(guard, _policy.LossScaleOverflow())
    bad_step("rollback")
    # A cluster worker's rollback request: the chief restores, and counts it, not this task.
    guard.rollback_request = lambda session, g, event: {}
    bad_step("rollback")
    _actions.good_step(guard, 1.0)
    counts = guard.state.since(start)
    assert (
        counts.steps,
        counts.total_bad_steps,
        counts.skips,
        counts.rollbacks,
        counts.loss_scale_overflows,
        counts.rollback_requests,
    ) == (2, 3, 1, 1, 1, 1)


def test_the_input_op_types_have_one_definition():
    # No module of the package keeps a list of input op types of its own: every one that
    # names them (the guard, the capture, the autopsy) reads _ops's.
    import importlib
    import pkgutil

    definitions = (_ops.INPUT_OP_TYPES, _ops.PLACEHOLDER_TYPES, _ops.BATCH_OP_TYPES)
    copies = []
    for info in pkgutil.iter_modules(slim_nanguard.__path__):
        module = importlib.import_module(f"slim_nanguard.{info.name}")
        for name, value in vars(module).items():
            if not isinstance(value, (frozenset, set, tuple, list)):
                continue
            if {"IteratorGetNext", "Placeholder"} & {v for v in value if isinstance(v, str)}:
                if not any(value is d for d in definitions):
                    copies.append(f"{info.name}.{name}")
    assert not copies, f"input op types defined outside _ops: {copies}"


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_progress_lines_show_rate_time_left_and_this_runs_counts(caplog):
    """Steps 0..20 at 4 steps a second, a line every 10 steps, 40 steps in all."""
    clock = _Clock()
    progress = _loop._Progress(10, 40, recorder=None, clock=clock)
    counts = _policy.GuardState(steps=20, total_bad_steps=3, skips=2, rollbacks=1)
    progress.start(0)
    with caplog.at_level(logging.INFO, logger="absl"):
        for step in range(1, 21):
            clock.now += 0.25
            progress(step, 0.5, lambda: counts)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert lines == [
        "step 10/40: loss 0.5000, 4.0 steps/s, 7s left; bad steps 3 (skipped 2, rolled back 1)",
        "step 20/40: loss 0.5000, 4.0 steps/s, 5s left; bad steps 3 (skipped 2, rolled back 1)",
    ]


def test_progress_without_a_step_limit_or_a_rate(caplog):
    clock = _Clock()
    progress = _loop._Progress(5, None, recorder=None, clock=clock)
    progress.start(5)  # resumed at step 5: its first line has no steps to time yet
    with caplog.at_level(logging.INFO, logger="absl"):
        progress(5, float("nan"), _policy.GuardState)
        progress(6, 1.0, _policy.GuardState)  # not a multiple of 5: no line
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert lines == ["step 5: loss nan, -- steps/s; bad steps 0 (skipped 0, rolled back 0)"]


def test_the_guard_is_read_only_and_its_graph_handles_frozen():
    model = lib.build_model(check_numerics=False, nan_policy="skip")
    guard = slim_nanguard.get_guard(model.train_op)
    for name in ("config", "state", "train_op", "loss", "ok", "saver", "mode"):
        with pytest.raises(AttributeError):
            setattr(guard, name, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        guard.handles.ok = None
    assert guard.ok is guard.handles.ok and guard.mode == "hook"
    assert guard.mode is slim_nanguard.Mode.HOOK


def test_the_hook_exposes_its_loss_and_the_outcome_of_each_run():
    model = lib.build_model(check_numerics=False, nan_policy="skip", faults={1: "nan_loss"})
    hook = slim_nanguard.nan_hook(model.train_op)
    assert hook.loss is model.train_op
    outcomes = []
    with model.graph.as_default():
        with tf.compat.v1.train.MonitoredTrainingSession(
            hooks=[hook], log_step_count_steps=None, save_summaries_steps=None
        ) as sess:
            for _ in range(3):
                sess.run(model.train_op)
                outcomes.append(hook.last_outcome)
    assert [o.good for o in outcomes] == [True, False, True]
    assert outcomes[1].action == "skip" and outcomes[1].event.step == 1


def test_a_hooks_rollback_override_builds_the_guards_one_saver(tmp_path):
    """The train op's policy never rolls back (no saver built); a hook that overrides it with
    rollback builds the saver on the guard, where every rollback finds it."""
    model = lib.build_model(check_numerics=False, nan_policy="skip")
    guard = slim_nanguard.get_guard(model.train_op)
    assert guard.saver is None
    with pytest.raises(
        ValueError,
        match=r"^nan_policy='rollback' rolls back, so the loop needs .*"
        r"NanLossHook\(train_op, checkpoint_dir=\.\.\.\)",
    ):
        with model.graph.as_default():
            slim_nanguard.NanLossHook(model.loss, nan_policy="rollback").begin()
    hook = slim_nanguard.NanLossHook(
        model.loss, nan_policy="rollback", checkpoint_dir=str(tmp_path)
    )
    with model.graph.as_default():
        hook.begin()
    assert guard.saver is not None and guard.autopsy_dir == str(tmp_path)


def test_a_message_quotes_a_default_setting_as_the_user_would_write_it():
    """The defaults are enum members; a message that quotes one with !r reads as a string."""
    config = slim_nanguard.GuardConfig(nan_policy="rollback")
    assert config.persistent_nan_policy == Action.RAISE
    message = (
        f"nan_policy={config.nan_policy!r} (persistent_nan_policy={config.persistent_nan_policy!r})"
    )
    assert message == "nan_policy='rollback' (persistent_nan_policy='raise')"
    assert f"{Action.STOP}" == str(Action.STOP) == "stop"
