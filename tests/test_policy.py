"""The policy decision as a pure function: stories of bad steps, no graph and no session.

`decide` takes the config, the guard's state and what happened, and says what happens next
(the chosen action, an escalation to ``persistent_nan_policy``, or giving up) and what the
state becomes.
"""

import pytest

from slim_nanguard import _policy
from slim_nanguard._policy import GuardConfig
from slim_nanguard._policy import GuardState


def decide(config, chosen, *, consecutive_bad_steps, rollbacks):
    """The decision about a bad step that makes `consecutive_bad_steps` in a row, chosen
    `chosen`, once `rollbacks` rollbacks were done."""
    state = GuardState(consecutive_bad_steps=consecutive_bad_steps - 1, rollbacks=rollbacks)
    decision, _ = _policy.decide(config, state, _policy.BadStep(step=-1, chosen=chosen))
    return decision


def _run(config, bad_steps_in_a_row, *, rollbacks=0):
    """The decisions for bad steps 1..n in a row, counting the rollbacks they lead to."""
    decisions = []
    for consecutive in range(1, bad_steps_in_a_row + 1):
        decision = decide(
            config, config.nan_policy, consecutive_bad_steps=consecutive, rollbacks=rollbacks
        )
        decisions.append(decision)
        if decision.action == "rollback":
            rollbacks += 1
    return decisions


def test_skip_skips_until_the_bound_then_gives_up_by_default():
    config = GuardConfig(nan_policy="skip", max_consecutive_bad_steps=3)
    first, second, third = _run(config, 3)
    assert (first.action, second.action) == ("skip", "skip")
    assert first.escalation == first.reason == ""
    assert third.action == "raise"
    assert third.escalation == "3 bad steps in a row reached max_consecutive_bad_steps=3"
    assert third.reason == third.escalation


def test_skip_escalates_to_a_rollback_while_rollbacks_are_left():
    config = GuardConfig(
        nan_policy="skip",
        max_consecutive_bad_steps=2,
        persistent_nan_policy="rollback",
        max_rollbacks=1,
    )
    first, second = _run(config, 2)
    assert (first.action, second.action) == ("skip", "rollback")
    assert "max_consecutive_bad_steps=2" in second.escalation and second.reason == ""
    # Once the one rollback allowed is done, the same escalation gives up, naming both bounds.
    late = decide(config, "skip", consecutive_bad_steps=2, rollbacks=1)
    assert late.action == "raise"
    assert late.reason == (
        "2 bad steps in a row reached max_consecutive_bad_steps=2, and "
        "1 rollbacks already done reached max_rollbacks=1"
    )


def test_skip_escalates_to_a_clean_stop():
    config = GuardConfig(
        nan_policy="skip", max_consecutive_bad_steps=2, persistent_nan_policy="stop"
    )
    assert [d.action for d in _run(config, 2)] == ["skip", "stop"]


def test_rollback_rolls_back_until_max_rollbacks_then_gives_up():
    config = GuardConfig(nan_policy="rollback", max_rollbacks=2, max_consecutive_bad_steps=10)
    decisions = [
        decide(config, "rollback", consecutive_bad_steps=1, rollbacks=done) for done in range(3)
    ]
    assert [d.action for d in decisions] == ["rollback", "rollback", "raise"]
    assert decisions[2].reason == "2 rollbacks already done reached max_rollbacks=2"
    assert decisions[2].escalation == ""


@pytest.mark.parametrize("policy", ["raise", "stop"])
def test_raise_and_stop_never_escalate(policy):
    config = GuardConfig(
        nan_policy=policy,
        max_consecutive_bad_steps=1,
        persistent_nan_policy="rollback",
        max_rollbacks=1,
    )
    decision = decide(config, policy, consecutive_bad_steps=5, rollbacks=0)
    assert decision.action == policy and decision.escalation == ""
    assert decision.reason == ("the nan_policy is 'raise'" if policy == "raise" else "")


def test_a_callbacks_choice_is_decided_like_the_policy():
    """on_nan may pick rollback under a skip policy; the bounds still apply to that choice."""
    config = GuardConfig(nan_policy="skip", max_rollbacks=1)
    decision = decide(config, "rollback", consecutive_bad_steps=1, rollbacks=1)
    assert decision.action == "raise"
    assert decision.reason == "1 rollbacks already done reached max_rollbacks=1"


def test_a_nan_loss_error_survives_pickling():
    """An error sent to another process (or kept by a test runner) reads the same there."""
    import pickle

    import slim_nanguard
    from slim_nanguard._nan_event import NanEvent

    event = NanEvent(
        step=7,
        loss=float("nan"),
        loss_kind="nan",
        culprits=("fc1/weights",),
        consecutive=3,
        total=4,
        mode="hook",
        action="raise",
    )
    error = slim_nanguard.NanLossError(
        event, "3 bad steps in a row reached max_consecutive_bad_steps=3"
    )
    error.checkpoint = "/tmp/run/model.ckpt-7"
    copy = pickle.loads(pickle.dumps(error))
    assert isinstance(copy, slim_nanguard.NanLossError)
    assert str(copy) == str(error) and "global step 7" in str(copy)
    assert copy.reason == error.reason and copy.checkpoint == error.checkpoint
    assert copy.event.culprits == ("fc1/weights",)


def test_a_nan_loss_error_carries_its_cause_and_limit_through_pickling():
    import pickle

    import slim_nanguard
    from slim_nanguard._nan_event import NanEvent

    event = NanEvent(
        step=9,
        loss=float("inf"),
        loss_kind="inf",
        culprits=(),
        consecutive=5,
        total=5,
        mode=slim_nanguard.Mode.HOOK,
        action=slim_nanguard.Action.RAISE,
    )
    error = slim_nanguard.NanLossError(
        event,
        "5 bad steps in a row reached max_consecutive_bad_steps=5",
        cause=slim_nanguard.Cause.MAX_CONSECUTIVE_BAD_STEPS,
        limit=5,
    )
    copy = pickle.loads(pickle.dumps(error))
    assert copy.cause is slim_nanguard.Cause.MAX_CONSECUTIVE_BAD_STEPS
    assert copy.cause == "max_consecutive_bad_steps"
    assert copy.limit == 5
    assert copy.reason == error.reason and str(copy) == str(error)
    assert copy.event == error.event
    # Raised without a cause (by user code, say): None, and still pickles.
    bare = pickle.loads(pickle.dumps(slim_nanguard.NanLossError()))
    assert bare.cause is None and bare.limit is None and bare.event is None


@pytest.mark.parametrize(
    "chosen, consecutive, rollbacks, cause, limit",
    [
        ("raise", 1, 0, "policy", None),
        ("skip", 3, 0, "max_consecutive_bad_steps", 3),
        ("rollback", 1, 2, "max_rollbacks", 2),
    ],
)
def test_a_decision_to_raise_names_its_cause_and_limit(
    chosen, consecutive, rollbacks, cause, limit
):
    config = GuardConfig(
        nan_policy=chosen,
        max_consecutive_bad_steps=3,
        max_rollbacks=2,
    )
    decision = decide(config, chosen, consecutive_bad_steps=consecutive, rollbacks=rollbacks)
    assert decision.action == "raise"
    assert decision.give_up == cause and decision.limit == limit


def test_a_decision_that_goes_on_has_no_cause():
    decision = decide(GuardConfig(nan_policy="skip"), "skip", consecutive_bad_steps=1, rollbacks=0)
    assert decision.action is _policy.Action.SKIP and decision.give_up is None


def test_actions_modes_and_causes_are_strings_to_users_and_records():
    import json

    from slim_nanguard import Action
    from slim_nanguard import Cause
    from slim_nanguard import Mode
    from slim_nanguard import StopReason

    assert Action.SKIP == "skip" and f"{Action.ROLLBACK}" == "rollback"
    assert str(Mode.CHECK_NUMERICS) == "check_numerics"
    assert StopReason.POLICY == "nan_policy_stop" and Cause.MAX_ROLLBACKS == "max_rollbacks"
    assert json.dumps({"action": Action.STOP}) == '{"action": "stop"}'
    assert _policy.POLICIES == ("raise", "stop", "skip", "rollback", "auto")
    assert _policy.REASON_POLICIES == ("raise", "stop", "skip", "rollback")
    assert _policy.PERSISTENT_POLICIES == ("raise", "stop", "rollback")


@pytest.mark.parametrize(
    "policy, persistent, on_nan, rolls, may",
    [
        ("rollback", "raise", False, True, True),
        ("skip", "rollback", False, True, True),
        # raise and stop never escalate: persistent_nan_policy never applies.
        ("stop", "rollback", False, False, False),
        ("raise", "rollback", False, False, False),
        ("skip", "raise", True, False, True),
    ],
)
def test_whether_a_policy_rolls_back_is_decided_in_one_place(
    policy, persistent, on_nan, rolls, may
):
    config = GuardConfig(
        nan_policy=policy,
        persistent_nan_policy=persistent,
        on_nan=(lambda event: None) if on_nan else None,
    )
    assert _policy.rolls_back(config) is rolls
    assert _policy.may_roll_back(config) is may
    # A hook's override is judged with the same rule.
    assert _policy.rolls_back(config, "rollback") is True
    assert _policy.rolls_back(config, "stop") is False


@pytest.mark.parametrize(
    "settings, named",
    [
        # The spike policy rolls back, the NaN policy does not: the message names the spike's.
        (dict(nan_policy="skip", spike_policy="rollback"), "spike_policy='rollback' rolls back"),
        (dict(nan_policy="rollback"), "nan_policy='rollback' rolls back"),
        (
            dict(nan_policy="skip", persistent_nan_policy="rollback"),
            "nan_policy='skip' with persistent_nan_policy='rollback' rolls back",
        ),
        (
            dict(nan_policy="rollback", spike_policy="skip", persistent_nan_policy="rollback"),
            "nan_policy='rollback' and spike_policy='skip' with "
            "persistent_nan_policy='rollback' roll back",
        ),
    ],
)
def test_a_missing_checkpoint_directory_is_blamed_on_the_policy_that_rolls_back(settings, named):
    message = _policy.checkpoint_dir_message(GuardConfig(**settings), "pass checkpoint_dir")
    assert message.startswith(named + ", so the loop needs")
    assert message.endswith(": pass checkpoint_dir.")


def test_the_three_loops_refuse_a_spike_rollback_without_a_directory_naming_spike_policy():
    import tensorflow as tf

    import slim_nanguard
    from slim_nanguard import _actions

    import nanguard_testlib as lib

    model = lib.build_model(check_numerics=False, nan_policy="skip", spike_policy="rollback")
    train_op = model.train_op
    with model.graph.as_default():
        expected = r"^spike_policy='rollback' rolls back, so the loop needs"
        with pytest.raises(ValueError, match=expected):
            slim_nanguard.nan_hook(train_op)
        with pytest.raises(ValueError, match=expected):
            _actions.checkpoint_dir_for(
                slim_nanguard.get_guard(train_op), None, advice="pass checkpoint_dir"
            )
        with pytest.raises(ValueError, match=expected):
            with tf.compat.v1.train.MonitoredTrainingSession(
                hooks=[slim_nanguard.NanLossHook(train_op)], log_step_count_steps=None
            ):
                pass
