"""A state you can resume from: what `raise` and `stop` say when the steps before the bad one
were already on a climb.

The story: ``configs/diverge_rollback.cfg`` trains plain SGD at a learning rate of 100. Its
losses climb from about 2.3 to 1e35 in five accepted steps, each with finite weights, and the
loss of global step 5 is NaN. The weights of the last accepted step (``model.ckpt-5``) are
finite, but they evaluate at loss inf and chance accuracy: no state to resume from. The guard
finds where the climb began (as a rollback does), names the newest checkpoint from before it,
and calls nothing on the climb good. After steady training an isolated NaN is no climb: the
newest checkpoint is the last good state, as before.
"""

import logging
import math
import os
import pickle

import pytest

import slim_nanguard
from slim_nanguard import app
from slim_nanguard import storage

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIVERGE = os.path.join(REPO, "configs", "diverge_rollback.cfg")


def _flag_value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _diverge_config(train_dir, **overrides) -> app.TrainConfig:
    """The settings of ``diverge_rollback.cfg``, read from the file, with `overrides`: a checkpoint
    every 2 steps, so one from before the climb exists."""
    settings = {}
    with open(DIVERGE) as f:
        for line in f:
            if line.startswith("--"):
                name, _, value = line.strip()[2:].partition("=")
                settings[name] = _flag_value(value) if value else True
    assert settings.pop("eval_split_name") == "test"  # The launcher's, not the training's.
    settings.update(
        train_dir=str(train_dir),
        max_number_of_steps=20,
        save_interval_steps=2,
        log_every_n_steps=0,
        **overrides,
    )
    return app.TrainConfig.from_flags(**settings)


def _evaluate(checkpoint: str) -> app.EvalResult:
    return app.run_eval(
        app.EvalConfig(checkpoint_path=checkpoint, model_name="mlp", dataset_name="digits")
    )


def _losses_before(train_dir):
    (bad,) = [r for r in slim_nanguard.read_events(str(train_dir)) if r["kind"] == "bad_step"]
    return dict(bad["losses_before"])


def _assert_climbed_from(train_dir, climb: int, resume_from: str) -> None:
    """The climb began at global step `climb`: every accepted loss from it on is at least twice
    the first step's, and they rose many times over; `resume_from` predates it."""
    losses = _losses_before(train_dir)
    assert 0 < climb < 5
    assert all(losses[s] > 2 * losses[0] for s in range(climb, 5))
    assert losses[4] > 1e6 * losses[climb]
    assert storage.checkpoint_step(resume_from) < climb


def test_raise_after_a_climb_names_the_checkpoint_before_it(tmp_path):
    train_dir = tmp_path / "raise"
    with pytest.raises(slim_nanguard.NanLossError) as info:
        app.run_training(_diverge_config(train_dir, nan_policy="raise"))
    err = info.value
    assert err.event.step == 5 and err.cause == "policy"
    # The state of the last accepted step is kept (no good step lost), and it is on the climb.
    assert storage.checkpoint_step(err.checkpoint) == 5
    _assert_climbed_from(train_dir, err.climb, err.resume_from)
    assert err.resume_from == str(train_dir / "model.ckpt-0")

    # The library's message says so, with the keyword of the policy that applies.
    assert (
        f"already climbing from global step {err.climb} on, so the last accepted state is not "
        f"a good one: resume from {err.resume_from}, the newest checkpoint from before the climb"
    ) in str(err)
    assert "nan_policy=rollback" in str(err)

    # The launcher's advice: the state kept is not good; resume from before the climb.
    message = app.error_message(err)
    advice = message.splitlines()[-1]
    assert "last good" not in message
    assert advice.startswith("The state of the last accepted step (global step 5) is saved as ")
    assert f"it is not a good state. Resume from {err.resume_from}" in advice
    assert "--learning_rate" in advice and "--nan_policy=rollback" in advice
    assert "--nan_policy=skip" not in advice  # Skipping the bad batch would not help.

    # What the evaluation says: the state kept is at chance with an infinite loss; the one
    # named to resume from (the initial weights: the climb began at once) has a finite loss.
    kept = _evaluate(err.checkpoint)
    assert not math.isfinite(kept.loss) and kept.accuracy <= 0.2
    assert math.isfinite(_evaluate(err.resume_from).loss)


@pytest.mark.parametrize("check_numerics", [True, False], ids=["check_numerics", "hook"])
def test_stop_after_a_climb_does_not_call_the_closing_checkpoint_good(tmp_path, check_numerics):
    train_dir = tmp_path / "stop"
    config = _diverge_config(train_dir, nan_policy="stop", check_numerics=check_numerics)
    result = app.run_training(config)
    assert result.stop_reason == "nan_policy_stop" and result.global_step == 5
    _assert_climbed_from(train_dir, result.climb, result.resume_from)
    assert storage.checkpoint_step(result.checkpoint) == 5

    summary = app.describe_training(result, config)
    assert f"checkpoint    {result.checkpoint} (not a good state: " in summary
    assert f"resume from   {result.resume_from} (before the climb;" in summary
    assert "--nan_policy=rollback" in summary and "good weights" not in summary

    closing = _evaluate(result.checkpoint)
    assert not math.isfinite(closing.loss) and closing.accuracy <= 0.2


def test_stop_after_a_climb_says_so_in_the_log(tmp_path, caplog):
    """The library itself (no launcher summary) says it, with the keyword that applies."""
    with caplog.at_level(logging.WARNING, logger="absl"):
        result = app.run_training(_diverge_config(tmp_path / "stop", nan_policy="stop"))
    (line,) = [r.getMessage() for r in caplog.records if "stopping at" in r.getMessage()]
    assert line.startswith("slim_nanguard: stopping at global step 5; the accepted steps")
    assert f"resume from {result.resume_from}, the newest checkpoint from before" in line
    assert "use nan_policy=rollback" in line


def _steady_config(train_dir, policy: str) -> app.TrainConfig:
    """The same net and data at a learning rate that trains steadily, and a NaN at step 12."""
    return _diverge_config(
        train_dir, learning_rate=0.1, nan_policy=policy, inject_faults=("nan_loss:12",)
    )


def test_an_isolated_nan_after_steady_training_keeps_the_newest_state_good(tmp_path):
    """No climb: under raise the newest checkpoint is still "the last good state", under stop
    the summary has no resume line."""
    with pytest.raises(slim_nanguard.NanLossError) as info:
        app.run_training(_steady_config(tmp_path / "raise", "raise"))
    err = info.value
    assert (err.climb, err.resume_from) == (None, None)
    assert f"The last good state (global step 12) is saved as {err.checkpoint}" in (
        app.error_message(err)
    )
    assert "climb" not in app.error_message(err)

    config = _steady_config(tmp_path / "stop", "stop")
    result = app.run_training(config)
    assert (result.global_step, result.climb, result.resume_from) == (12, None, None)
    assert "climb" not in app.describe_training(result, config)


def _spike_error(cause=None) -> slim_nanguard.NanLossError:
    from slim_nanguard import _nan_event

    # A finite loss of 1e6 at global step 9, the first bad step, in hook mode.
    spike = slim_nanguard.GuardConfig(spike_policy="raise").all_reasons[0]
    event = _nan_event.NanEvent(
        9, 1e6, "finite", (), 1, 1, "hook", "raise", cause="spike", reason=spike
    )
    return slim_nanguard.NanLossError(event, "the spike_policy is 'raise'", cause=cause)


@pytest.mark.parametrize(
    "cause, keyword",
    [(None, "spike_policy=rollback"), ("max_consecutive_bad_steps", "persistent_nan_policy=")],
)
def test_a_climb_to_a_spike_names_the_setting_that_gave_up(cause, keyword):
    """A spike after a climb (no checkpoint kept from before it): the message names the setting
    that chose to give up, not nan_policy, and says no checkpoint predates the climb; the error
    pickles with its climb."""
    err = _spike_error(cause)
    err.climb = 6
    copy = pickle.loads(pickle.dumps(err))
    assert (copy.climb, copy.resume_from) == (6, None) and str(copy) == str(err)
    message = str(err)
    assert "climbing from global step 6 on" in message
    assert "no checkpoint predates the climb: train again with a lower learning rate" in message
    assert keyword in message and "nan_policy=rollback" not in message.replace(keyword, "")
    advice = app.error_message(err).splitlines()[-1]
    assert advice.startswith("No checkpoint predates the climb") and f"--{keyword}" in advice


def test_one_hard_batch_before_a_nan_is_no_climb():
    """One loss three times the others (a hard example) is not a climb; two rising ones are."""
    from slim_nanguard import _rollback

    steady = [(step, 0.05) for step in range(10)]
    assert _rollback.before_climb(None, 11, steady + [(10, 0.15)]) == (None, None)
    assert _rollback.before_climb(None, 12, steady + [(10, 0.15), (11, 0.4)]) == (10, None)
