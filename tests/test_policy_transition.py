"""The guard's one transition, `_policy.decide(config, state, observation)`, told as stories.

No graph and no session: each story feeds observations to `decide`, keeps the state it returns
and reads the decisions and the counts. Every counting rule of the guard is here: bad steps in a
row and when that count starts over, skips, stops, rollbacks, a cluster chief's bound on the
rollbacks its workers ask for, a worker's requests, good steps and loss-scale overflows.
"""

import dataclasses

import pytest

from slim_nanguard import _policy
from slim_nanguard._policy import BadStep
from slim_nanguard._policy import GoodStep
from slim_nanguard._policy import GuardConfig
from slim_nanguard._policy import GuardState
from slim_nanguard._policy import LossScaleOverflow
from slim_nanguard._policy import Retried
from slim_nanguard._policy import RollbackAsked
from slim_nanguard._policy import RollbackRequested
from slim_nanguard._policy import RolledBack


def _tell(config, *observations, state=None):
    """Feeds `observations` to `decide` in turn; returns the decisions and the last state."""
    state = state or GuardState()
    decisions = []
    for observation in observations:
        decision, state = _policy.decide(config, state, observation)
        decisions.append(decision)
    return decisions, state


def test_three_bad_steps_in_a_row_then_a_good_one_start_the_count_over():
    config = GuardConfig(nan_policy="skip", max_consecutive_bad_steps=4)
    decisions, state = _tell(
        config, BadStep(5, "skip"), BadStep(5, "skip"), BadStep(5, "skip"), GoodStep()
    )
    assert [d.action if d else None for d in decisions] == ["skip", "skip", "skip", None]
    assert (state.consecutive_bad_steps, state.total_bad_steps, state.skips) == (0, 3, 3)
    assert state.steps == 1 and state.last_bad_step == 5
    # Three more in a row: the fourth would escalate, the third does not.
    decisions, state = _tell(config, *[BadStep(6, "skip")] * 3, state=state)
    assert [d.action for d in decisions] == ["skip", "skip", "skip"]
    assert state.consecutive_bad_steps == 3 and state.total_bad_steps == 6


def test_four_bad_steps_in_a_row_escalate_to_raise_naming_the_bound():
    config = GuardConfig(nan_policy="skip", max_consecutive_bad_steps=4)
    decisions, state = _tell(config, *[BadStep(5, "skip")] * 4)
    assert [d.action for d in decisions] == ["skip", "skip", "skip", "raise"]
    assert decisions[-1].give_up == "max_consecutive_bad_steps" and decisions[-1].limit == 4
    assert state.skips == 3 and state.total_bad_steps == 4


def test_a_global_step_that_moved_on_unreported_starts_the_count_over():
    """A hand-written loop reports bad steps only: the step moving on says a good one ran."""
    config = GuardConfig(nan_policy="skip", max_consecutive_bad_steps=2)
    decisions, state = _tell(config, BadStep(3, "skip"), BadStep(4, "skip"), BadStep(5, "skip"))
    assert [d.action for d in decisions] == ["skip", "skip", "skip"]
    assert state.consecutive_bad_steps == 1 and state.total_bad_steps == 3
    # Without a global step (-1) nothing says so: the count goes on.
    decisions, _ = _tell(config, BadStep(-1, "skip"), BadStep(-1, "skip"))
    assert [d.action for d in decisions] == ["skip", "raise"]


def test_an_escalated_rollback_starts_the_count_over_and_counts_when_restored():
    config = GuardConfig(
        nan_policy="skip",
        max_consecutive_bad_steps=2,
        persistent_nan_policy="rollback",
        rollback_lr_factor=0.5,
    )
    decisions, state = _tell(config, BadStep(7, "skip"), BadStep(7, "skip"))
    assert [d.action for d in decisions] == ["skip", "rollback"]
    assert decisions[1].escalation.startswith("2 bad steps in a row")
    # Decided, not yet done: no rollback counted; the count in a row starts over at once, so
    # the first bad step after the rollback (back at step 7, say) does not escalate again.
    assert state.rollbacks == 0 and state.consecutive_bad_steps == 0
    decisions, state = _tell(config, RolledBack(learning_rate_scale=0.5), BadStep(7, "skip"))
    assert decisions[0] is None and decisions[1].action == "skip"
    assert (state.rollbacks, state.learning_rate_scale) == (1, 0.5)
    assert state.consecutive_bad_steps == 1


def test_stop_is_counted_and_raise_and_stop_never_escalate():
    config = GuardConfig(nan_policy="stop", max_consecutive_bad_steps=1)
    decisions, state = _tell(config, BadStep(1, "stop"), BadStep(1, "stop"))
    assert [d.action for d in decisions] == ["stop", "stop"]
    assert state.stops == 2 and state.skips == 0


def test_on_nans_choice_is_counted_as_what_was_decided():
    """The policy is skip; the callback chose stop for the second step."""
    config = GuardConfig(nan_policy="skip")
    _, state = _tell(config, BadStep(1, "skip"), BadStep(1, "stop"))
    assert (state.skips, state.stops, state.total_bad_steps) == (1, 1, 2)


def test_a_chief_answers_requests_within_max_rollbacks_then_gives_up_naming_the_workers():
    config = GuardConfig(nan_policy="skip", max_rollbacks=2)
    decisions, state = _tell(
        config,
        RollbackRequested(workers=(1, 2)),
        RolledBack(learning_rate_scale=1.0),
        RollbackRequested(workers=(1,)),
        RolledBack(learning_rate_scale=1.0),
        RollbackRequested(workers=(2, 3)),
    )
    assert [d.action if d else None for d in decisions] == [
        "rollback",
        None,
        "rollback",
        None,
        "raise",
    ]
    last = decisions[-1]
    assert last.reason == (
        "worker 2, 3 asked for a rollback, and 2 rollbacks already done reached max_rollbacks=2"
    )
    assert last.give_up == "max_rollbacks" and last.limit == 2
    # A request is no bad step of the chief's.
    assert state.total_bad_steps == 0 and state.rollbacks == 2


def test_a_chiefs_own_rollbacks_and_answered_ones_share_one_bound():
    config = GuardConfig(nan_policy="rollback", max_rollbacks=2)
    decisions, state = _tell(
        config,
        BadStep(3, "rollback"),
        RolledBack(learning_rate_scale=1.0),
        RollbackRequested(workers=(1,)),
        RolledBack(learning_rate_scale=1.0),
        BadStep(4, "rollback"),
    )
    assert decisions[-1].action == "raise" and decisions[-1].give_up == "max_rollbacks"
    assert state.rollbacks == 2


def test_a_workers_requests_are_counted_apart_and_never_reach_max_rollbacks():
    """A non-chief restores nothing: its requests are the chief's rollbacks to count."""
    config = GuardConfig(nan_policy="rollback", max_rollbacks=1)
    decisions, state = _tell(
        config,
        BadStep(3, "rollback"),
        RollbackAsked(),
        BadStep(4, "rollback"),
        RollbackAsked(),
    )
    assert [d.action if d else None for d in decisions] == ["rollback", None, "rollback", None]
    assert (state.rollbacks, state.rollback_requests) == (0, 2)


def test_an_overflow_is_no_bad_step_and_leaves_the_count_in_a_row_alone():
    config = GuardConfig(nan_policy="skip", max_consecutive_bad_steps=2)
    decisions, state = _tell(config, BadStep(2, "skip"), LossScaleOverflow(), BadStep(2, "skip"))
    assert decisions[1] is None and decisions[2].action == "raise"
    assert state.loss_scale_overflows == 1 and state.total_bad_steps == 2


@pytest.mark.parametrize("chosen, cause", [("raise", "unguarded_loss"), ("stop", None)])
def test_a_bare_loss_raises_saying_nothing_was_gated_or_stops(chosen, cause):
    config = GuardConfig(nan_policy=chosen, max_consecutive_bad_steps=1)
    decisions, state = _tell(
        config, BadStep(-1, chosen, guarded=False), BadStep(-1, chosen, guarded=False)
    )
    assert [d.action for d in decisions] == [chosen, chosen]  # never escalates
    assert decisions[0].give_up == cause
    if chosen == "raise":
        assert "no guarded train op" in decisions[0].reason
    assert (state.consecutive_bad_steps, state.total_bad_steps) == (2, 2)


def test_a_run_is_the_difference_of_two_states():
    """`TrainResult` and the record's counters: what happened since a state, not since ever."""
    config = GuardConfig(nan_policy="skip", persistent_nan_policy="rollback")
    _, start = _tell(config, GoodStep(), BadStep(1, "skip"), RolledBack(0.5))
    _, end = _tell(
        config,
        GoodStep(),
        BadStep(2, "skip"),
        LossScaleOverflow(),
        BadStep(3, "rollback"),
        RolledBack(0.25),
        BadStep(3, "rollback"),
        RollbackAsked(),
        GoodStep(),
        state=start,
    )
    run = end.since(start)
    counts = (
        run.steps,
        run.total_bad_steps,
        run.skips,
        run.rollbacks,
        run.loss_scale_overflows,
        run.rollback_requests,
    )
    assert counts == (2, 3, 1, 1, 1, 1)
    assert run.learning_rate_scale == 0.25 and run.consecutive_bad_steps == 0


def test_decide_is_pure():
    config = GuardConfig(nan_policy="skip")
    state = GuardState()
    _, after = _policy.decide(config, state, BadStep(1, "skip"))
    assert state == GuardState() and after is not state
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.skips = 1
    with pytest.raises(TypeError, match="no observation"):
        _policy.decide(config, state, "bad step")


def test_the_first_bad_steps_get_an_autopsy_and_later_ones_do_not():
    config = GuardConfig(nan_policy="skip", autopsy_max_steps=2)
    state = GuardState()
    wanted = []
    for step in range(4):
        wanted.append(_policy.wants_autopsy(config, state))
        _, state = _tell(config, BadStep(step, "skip", autopsied=wanted[-1]), state=state)
    assert wanted == [True, True, False, False] and state.autopsies == 2
    assert not _policy.wants_autopsy(GuardConfig(autopsy_max_steps=0), GuardState())


def test_auto_retries_a_transient_skips_a_bad_example_and_rolls_back_a_broken_state():
    """nan_policy="auto": the triage's verdict chooses; a chance step is run again before it
    is skipped (it counts as a skip only if that fails); without a verdict (no autopsy, or a
    replay that failed) the step is skipped, and a run of them escalates as skips do."""
    config = GuardConfig(nan_policy="auto", max_consecutive_bad_steps=3)
    steps = [BadStep(10, "auto", verdict="chance"), BadStep(20, "auto", verdict="data")]
    steps += [BadStep(30, "auto", verdict="state"), BadStep(40, "auto")]
    decisions, state = _tell(config, *steps)
    assert [d.action for d in decisions] == ["skip", "skip", "rollback", "skip"]
    assert [d.retry for d in decisions] == [True, False, False, False]
    assert (state.skips, state.retries, state.total_bad_steps) == (2, 0, 4)
    _, trained = _tell(config, Retried(11, True), state=state)
    _, failed = _tell(config, Retried(-1, False), state=state)
    assert (trained.skips, trained.retries) == (2, 1) and (failed.skips, failed.retries) == (3, 0)
    decisions, _ = _tell(config, *[BadStep(50, "auto", verdict="data")] * 3)
    assert [d.action for d in decisions] == ["skip", "skip", "raise"]
    assert decisions[-1].give_up == "max_consecutive_bad_steps"
    config = GuardConfig(nan_policy="auto", max_rollbacks=1)
    decisions, _ = _tell(config, BadStep(7, "auto", verdict="state"), state=GuardState(rollbacks=1))
    assert decisions[0].action == "raise" and decisions[0].give_up == "max_rollbacks"


def test_auto_autopsies_every_bad_step_unless_autopsies_are_off():
    state = GuardState(autopsies=50)
    assert _policy.wants_autopsy(GuardConfig(nan_policy="auto", autopsy_max_steps=3), state)
    assert not _policy.wants_autopsy(GuardConfig(nan_policy="skip", autopsy_max_steps=3), state)
    with pytest.raises(ValueError, match="nan_policy='auto' decides from each bad step's autopsy"):
        GuardConfig(nan_policy="auto", autopsy_max_steps=0)
    # A hook's override of nan_policy counts as the policy.
    assert _policy.wants_autopsy(GuardConfig(nan_policy="skip", autopsy_max_steps=3), state, "auto")


def test_auto_is_for_nan_and_spikes_and_needs_the_checkpoint_directory():
    assert _policy.rolls_back(GuardConfig(nan_policy="auto"))
    message = _policy.checkpoint_dir_message(GuardConfig(nan_policy="auto"), "pass logdir")
    assert message.startswith("nan_policy='auto' rolls back")
    assert GuardConfig(spike_policy="auto").spike_policy == "auto"
    with pytest.raises(ValueError, match="persistent_nan_policy"):
        GuardConfig(persistent_nan_policy="auto")
    with pytest.raises(ValueError, match="spike_policy='auto' decides from each bad step's"):
        GuardConfig(spike_policy="auto", autopsy_max_steps=0)


def test_a_transient_that_keeps_coming_back_escalates_though_each_retry_trains():
    """Each retry trains, but the next step is bad again: the retried steps count as bad steps
    in a row, so the run escalates at max_consecutive_bad_steps; a plain good step between
    two of them starts the count over."""
    config = GuardConfig(nan_policy="auto", max_consecutive_bad_steps=3)
    chance = lambda step: BadStep(step, "auto", verdict="chance")  # noqa: E731
    decisions, state = _tell(
        config, chance(5), Retried(6, True), chance(6), Retried(7, True), chance(7)
    )
    actions = [(d.action, d.retry) for d in decisions if d is not None]
    assert actions == [("skip", True), ("skip", True), ("raise", False)]
    assert decisions[-1].give_up == "max_consecutive_bad_steps" and state.retries == 2
    decisions, state = _tell(
        config, chance(5), Retried(6, True), GoodStep(), chance(7), Retried(8, True), chance(8)
    )
    assert [d.action for d in decisions if d is not None] == ["skip", "skip", "skip"]
    assert state.consecutive_bad_steps == 2


def test_auto_quarantines_only_what_it_skips_as_data_after_on_nan_has_spoken():
    """The quarantine follows the decision: auto on data, not turned into another policy by
    on_nan, nor escalated; on_nan choosing auto on a data verdict quarantines too."""
    config = GuardConfig(nan_policy="auto", max_consecutive_bad_steps=2)
    data = BadStep(10, "auto", verdict="data")
    (decision,), _ = _tell(config, data)
    assert (decision.action, decision.quarantine, decision.retry) == ("skip", True, False)
    (overridden,), _ = _tell(config, dataclasses.replace(data, choose=lambda s, r: "skip"))
    assert (overridden.action, overridden.quarantine) == ("skip", False)
    chose_auto = BadStep(10, "skip", verdict="data", choose=lambda s, r: "auto")
    (chosen,), _ = _tell(GuardConfig(nan_policy="skip"), chose_auto)
    assert chosen.quarantine
    decisions, _ = _tell(config, data, data)
    assert [(d.action, d.quarantine) for d in decisions] == [("skip", True), ("raise", False)]
