"""Three loops, each with a bad batch at a chosen step, in every mode and policy.

The loops: the seed flow (a hand-written `MonitoredTrainingSession` loop), tf-slim's
`training.train` (hooks) and tf-slim's `learning.train` (with `slim_nanguard.train_step`).
Batch 3 of the input is bad; the tests check what the policy did and that the variables after
the bad step are exactly those before it.
"""

import logging

import numpy as np
import pytest
import tensorflow as tf
import test_autopsy as ta
import tf_slim as slim

import slim_nanguard
from slim_nanguard import _policy

import nanguard_testlib as lib

BAD_BATCH = 3
STEPS = 6


def _seed_flow(model, *, mode, checkpoint_dir=None) -> lib.MonitoredRun:
    """The loop of the seed notes, up to global step `STEPS`, until the policy ends it.

    In hook mode the hook comes from `nan_hook`; in check_numerics mode the loop catches the
    error and hands it to `handle_numerics_error`.
    """
    hooks = []
    if mode == "hook":
        hooks.append(slim_nanguard.nan_hook(model.train_op, checkpoint_dir=checkpoint_dir))
    return lib.run_monitored(
        model.train_op,
        hooks=hooks,
        last_step=STEPS,
        checkpoint_dir=checkpoint_dir,
        handle_numerics_errors=True,
        catch_nan_error=True,
    )


@pytest.mark.parametrize("fault", lib.FAULTS)
@lib.each_mode
def test_seed_flow_skip_carries_on_with_the_next_batch(mode, fault):
    """Batch 3 is bad: it is skipped, named, and the run still makes its six good steps."""
    model = lib.build_model(
        check_numerics=lib.MODES[mode], nan_policy="skip", faults={BAD_BATCH: fault}
    )
    run = _seed_flow(model, mode=mode)
    assert run.error is None
    assert run.bad_step_changes == [[]], "the bad step changed variables"
    (event,) = run.events
    assert event.action == "skip"
    assert event.step == BAD_BATCH and event.consecutive == 1
    assert event.loss_kind in lib.FAULTS[fault].loss_kinds
    assert event.loss_kind == lib.loss_kind(event.loss)
    assert set(lib.FAULTS[fault].sure_culprits) <= set(event.culprits)
    if fault == "nan_input" and event.loss_kind == "nan":
        # A NaN input that reached the loss came back through every layer's gradient.
        assert "logits/weights" in event.culprits
    if fault in ("nan_loss", "inf_loss"):
        assert event.culprits == ()
    # Six good steps were still made: the bad batch was stepped over, not retried.
    assert int(run.final["global_step"]) == STEPS
    lib.assert_all_finite(run.final)


@pytest.mark.parametrize("fault", lib.FAULTS)
@lib.each_mode
def test_seed_flow_stop_ends_cleanly_with_the_last_good_weights(mode, fault):
    """Batch 3 is bad under `stop`: the run ends at global step 3, weights finite."""
    model = lib.build_model(
        check_numerics=lib.MODES[mode], nan_policy="stop", faults={BAD_BATCH: fault}
    )
    run = _seed_flow(model, mode=mode)
    assert run.error is None and run.bad_step_changes == [[]]
    assert [e.action for e in run.events] == ["stop"]
    assert int(run.final["global_step"]) == BAD_BATCH
    lib.assert_all_finite(run.final)


@pytest.mark.parametrize("fault", lib.FAULTS)
@lib.each_mode
def test_seed_flow_raise_names_step_value_and_culprits(mode, fault):
    """Batch 3 is bad under `raise`: the error names global step 3, the loss and the
    culprits, and the weights are still those of step 3."""
    model = lib.build_model(check_numerics=lib.MODES[mode], faults={BAD_BATCH: fault})
    run = _seed_flow(model, mode=mode)
    error = run.error
    assert isinstance(error, slim_nanguard.NanLossError)
    assert isinstance(error, tf.compat.v1.train.NanLossDuringTrainingError)
    assert isinstance(error, slim_nanguard.NanGuardError)
    assert run.bad_step_changes == [[]]
    message = str(error)
    assert f"global step {BAD_BATCH}" in message
    expected = {
        "nan_loss": ["loss NaN, gradients finite"],
        "inf_loss": ["loss +Inf, gradients finite"],
        "nan_gradient": ["(finite), non-finite gradients of logits/weights,"],
        # Where the NaN reached the loss it came back through every gradient; where a fused
        # ReLU kernel mapped it to 0, the loss is finite and the first layer's weights are bad.
        "nan_input": [
            "loss NaN, non-finite gradients of fc1/weights, fc1/biases, "
            "logits/weights, logits/biases,",
            "(finite), non-finite gradients of fc1/weights,",
        ],
    }[fault]
    assert any(text in message for text in expected), message
    assert "the nan_policy is 'raise'" in message
    assert int(run.final["global_step"]) == BAD_BATCH


@lib.each_mode
def test_skip_gives_up_after_max_consecutive_bad_steps(mode):
    """Bad batches from 2 on: two skips, then the third in a row raises (the default
    persistent_nan_policy, today's give-up rule), with the weights of step 2."""
    faults = {i: "nan_input" for i in range(2, 10)}
    model = lib.build_model(
        check_numerics=lib.MODES[mode],
        nan_policy="skip",
        max_consecutive_bad_steps=3,
        faults=faults,
    )
    assert slim_nanguard.get_guard(model.train_op).config.persistent_nan_policy == "raise"
    run = _seed_flow(model, mode=mode)
    assert [e.action for e in run.events] == ["skip", "skip"]
    assert isinstance(run.error, slim_nanguard.NanLossError)
    assert run.error.event.consecutive == 3
    assert "3 bad steps in a row reached max_consecutive_bad_steps=3" in str(run.error)
    assert run.bad_step_changes == [[], [], []]
    assert int(run.final["global_step"]) == 2


def _escalating_model(mode, persistent_nan_policy, bad_batches, **create_kwargs):
    """The model under skip, escalating to `persistent_nan_policy`; `bad_batches` are NaN."""
    return lib.build_model(
        check_numerics=lib.MODES[mode],
        nan_policy="skip",
        persistent_nan_policy=persistent_nan_policy,
        faults={i: "nan_input" for i in bad_batches},
        **create_kwargs,
    )


@lib.each_mode
def test_skip_escalates_to_a_rollback_and_the_count_starts_over(tmp_path, mode):
    """Three bad batches in a row: the state is bad, so the guard rolls back and carries on.

    The run of bad steps began at global step 2, whose checkpoint holds the state that went
    bad: the rollback returns to the one before it, step 1, and the bad batch after it is the
    first of a new run (the count started over).
    """
    model = _escalating_model(
        mode,
        "rollback",
        range(2, 6),
        max_consecutive_bad_steps=3,
        rollback_skip_batches=0,
        rollback_lr_factor=0.5,
    )
    run = _seed_flow(model, mode=mode, checkpoint_dir=str(tmp_path))
    assert run.error is None
    assert [(e.step, e.consecutive, e.action) for e in run.events] == [
        (2, 1, "skip"),
        (2, 2, "skip"),
        (2, 3, "rollback"),
        (1, 1, "skip"),
    ]
    # Only the rollback wrote: the two skips before it and the one after it changed nothing.
    assert run.bad_step_changes == [[], [], []]
    state = slim_nanguard.get_guard(model.train_op).state
    assert (state.skips, state.rollbacks, state.learning_rate_scale) == (3, 1, 0.5)
    # Training went on after the rollback: the step limit was reached with finite weights.
    assert int(run.final["global_step"]) == STEPS
    assert run.final["nanguard/learning_rate_scale"] == 0.5
    lib.assert_all_finite(run.final)


@lib.each_mode
def test_skip_escalates_to_a_clean_stop_with_the_last_good_weights(mode):
    """Bad batches from 2 on: two skips, then a clean stop with the weights of step 2."""
    model = _escalating_model(mode, "stop", range(2, 10), max_consecutive_bad_steps=3)
    run = _seed_flow(model, mode=mode)
    assert run.error is None
    assert [(e.consecutive, e.action) for e in run.events] == [
        (1, "skip"),
        (2, "skip"),
        (3, "stop"),
    ]
    assert run.bad_step_changes == [[], [], []]
    assert int(run.final["global_step"]) == 2
    lib.assert_all_finite(run.final)


@lib.each_mode
def test_escalated_rollbacks_are_bounded_by_max_rollbacks(tmp_path, mode):
    """Every batch from 2 on is bad; two in a row roll back, twice at most: skip, rollback,
    skip, rollback, skip, and the next one raises."""
    model = _escalating_model(
        mode,
        "rollback",
        range(2, 40),
        max_consecutive_bad_steps=2,
        max_rollbacks=2,
        rollback_skip_batches=0,
    )
    run = _seed_flow(model, mode=mode, checkpoint_dir=str(tmp_path))
    assert [e.action for e in run.events] == ["skip", "rollback", "skip", "rollback", "skip"]
    assert isinstance(run.error, slim_nanguard.NanLossError)
    assert run.error.event.action == "raise"
    assert (
        "2 bad steps in a row reached max_consecutive_bad_steps=2, and 2 rollbacks "
        "already done reached max_rollbacks=2"
    ) in str(run.error)
    # Each rollback went before the run of bad steps it ended: the first to step 1 (the run
    # began at 2), the second to step 0 (the next run began at 1).
    assert int(run.final["global_step"]) == 0
    lib.assert_all_finite(run.final)


def _learning_train_from_step_0(model, logdir):
    """tf_slim.learning.train of `model` for `STEPS` steps with `make_train_step(logdir)` and
    a `FiniteSaver`, from a checkpoint of step 0 to roll back to; its final loss."""
    with model.graph.as_default():
        saver = slim_nanguard.FiniteSaver()
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            saver.save(sess, str(logdir / "model.ckpt"), global_step=0)
        return slim.learning.train(
            model.train_op,
            str(logdir),
            train_step_fn=slim_nanguard.make_train_step(str(logdir)),
            number_of_steps=STEPS,
            save_summaries_secs=None,
            save_interval_secs=None,
            saver=saver,
        )


def test_tf_slim_learning_train_escalates_with_make_train_step(tmp_path):
    """check_numerics mode in tf-slim's own loop: skip, then the escalated rollback."""
    model = lib.build_model(
        check_numerics=True,
        nan_policy="skip",
        max_consecutive_bad_steps=2,
        persistent_nan_policy="rollback",
        faults={BAD_BATCH: "nan_gradient", BAD_BATCH + 1: "nan_gradient"},
    )
    guard = slim_nanguard.get_guard(model.train_op)
    loss = _learning_train_from_step_0(model, tmp_path)
    assert np.isfinite(loss)
    assert (guard.last_event.step, guard.last_event.action) == (BAD_BATCH, "rollback")
    assert (guard.state.total_bad_steps, guard.state.skips, guard.state.rollbacks) == (2, 1, 1)
    values = lib.checkpoint_values(tf.train.latest_checkpoint(str(tmp_path)))
    assert int(values["global_step"]) == STEPS
    lib.assert_all_finite(values)


def test_the_hook_needs_a_checkpoint_dir_for_an_escalated_rollback():
    model = lib.build_model(
        check_numerics=False, nan_policy="skip", persistent_nan_policy="rollback"
    )
    # nan_hook knows the train op's policy: it refuses at once, before any session.
    with pytest.raises(
        ValueError,
        match=r"nan_policy='skip' with persistent_nan_policy='rollback' rolls back, so the "
        r"loop needs .*nan_hook\(train_op, checkpoint_dir=\.\.\.\)",
    ):
        slim_nanguard.nan_hook(model.train_op)
    # A hook built by hand refuses at session start.
    with model.graph.as_default():
        with pytest.raises(
            ValueError,
            match=r"nan_policy='skip' with persistent_nan_policy='rollback' rolls back, "
            r"so the loop needs .*NanLossHook\(train_op, checkpoint_dir=\.\.\.\)",
        ):
            with tf.compat.v1.train.MonitoredTrainingSession(
                hooks=[slim_nanguard.NanLossHook(model.train_op)], log_step_count_steps=None
            ):
                pass


def test_a_good_step_resets_the_consecutive_count():
    """Bad batches 2-3 and 5-6 around a good batch 4: each pair counts 1, 2 and never
    reaches max_consecutive_bad_steps=3."""
    faults = {2: "nan_input", 3: "nan_input", 5: "inf_loss", 6: "inf_loss"}
    model = lib.build_model(
        check_numerics=True, nan_policy="skip", max_consecutive_bad_steps=3, faults=faults
    )
    run = _seed_flow(model, mode="check_numerics")
    assert run.error is None
    assert [(e.step, e.consecutive, e.total) for e in run.events] == [
        (2, 1, 1),
        (2, 2, 2),
        (3, 1, 3),
        (3, 2, 4),
    ]


@lib.each_mode
def test_the_on_nan_callback_sees_each_event_and_may_override_the_policy(mode):
    """Bad batches 2 and 4 under skip: the callback sees both and turns the second one into
    a stop at global step 3."""
    seen = []

    def on_nan(event):
        seen.append(event)
        return "stop" if event.total == 2 else None

    model = lib.build_model(
        check_numerics=lib.MODES[mode],
        nan_policy="skip",
        on_nan=on_nan,
        faults={2: "nan_loss", 4: "nan_gradient"},
    )
    run = _seed_flow(model, mode=mode)
    assert run.error is None
    assert [(e.step, e.action) for e in seen] == [(2, "skip"), (3, "skip")]
    assert [e.action for e in run.events] == ["skip", "stop"]
    assert int(run.final["global_step"]) == 3


def test_an_on_nan_callback_returning_nonsense_is_an_error():
    model = lib.build_model(
        check_numerics=False, on_nan=lambda event: "ignore", faults={1: "nan_loss"}
    )
    with pytest.raises(
        ValueError,
        match="the on_nan callback must return one of raise, stop, "
        "skip, rollback, auto or None; got 'ignore'",
    ):
        _seed_flow(model, mode="hook")


def test_a_hand_built_hook_behaves_as_the_ready_one():
    """The seed flow: the user builds NanLossHook(total_loss, fail_on_nan_loss=True). Batch 2
    is bad; with either hook it is skipped, and six runs end at the same weights of step 5."""
    results = []
    for hand_built in (False, True):
        model = lib.build_model(check_numerics=False, nan_policy="skip", faults={2: "nan_input"})
        hook = (
            slim_nanguard.NanLossHook(model.loss, fail_on_nan_loss=True)
            if hand_built
            else slim_nanguard.nan_hook(model.train_op)
        )
        snapshots = lib.Snapshots()
        lib.run_monitored(model.train_op, hooks=[hook, snapshots], last_step=5)
        assert hook.guard is slim_nanguard.get_guard(model.train_op)
        assert isinstance(hook, tf.compat.v1.train.NanTensorHook)
        results.append((hook.guard.state.skips, snapshots.runs, snapshots.by_step[5]))
    assert results[0][:2] == results[1][:2] == (1, 6)
    lib.assert_state_equal(results[0][2], results[1][2])


def test_after_create_session_keeps_the_runs_counters_and_judges_on():
    faults = {1: "nan_loss", 4: "nan_loss"}
    model = lib.build_model(check_numerics=False, nan_policy="skip", faults=faults)
    hook = slim_nanguard.nan_hook(model.train_op)
    with model.graph.as_default():
        with tf.compat.v1.train.MonitoredTrainingSession(
            hooks=[hook], log_step_count_steps=None
        ) as sess:
            for _ in range(3):
                sess.run(model.train_op)
            assert hook.guard.state.total_bad_steps == 1
            # What MonitoredSession does when it recovers a session.
            hook.after_create_session(
                sess.run_step_fn(lambda step_context: step_context.session), None
            )
            for _ in range(3):
                sess.run(model.train_op)  # the bad batch 4 is judged, not unjudged
            assert hook.last_outcome.good
            assert (hook.guard.state.total_bad_steps, hook.guard.state.skips) == (2, 2)


@pytest.mark.parametrize("fault", ["inf_loss", "nan_gradient"])
def test_tensorflows_nan_tensor_hook_misses_what_ours_catches(fault):
    """NanTensorHook checks np.isnan on the loss: an Inf loss and a NaN gradient get through.

    Two steps, the second one bad. Which hooks raise at that step?
    """
    variants = {
        "NanTensorHook": (tf.compat.v1.train.NanTensorHook, slim.learning.create_train_op),
        "NanLossHook, slim train op": (slim_nanguard.NanLossHook, slim.learning.create_train_op),
        "NanLossHook, guarded train op": (slim_nanguard.NanLossHook, slim_nanguard.create_train_op),
    }
    caught = {}
    for name, (hook_cls, train_op_fn) in variants.items():
        model = lib.build_model(train_op_fn=train_op_fn, check_numerics=False, faults={1: fault})
        with model.graph.as_default():
            hook = hook_cls(model.train_op)
        run = lib.run_monitored(model.train_op, hooks=[hook], last_step=2, catch_nan_error=True)
        caught[name] = run.error is not None
    assert caught == {
        "NanTensorHook": False,
        # A loss-only check (no guard behind slim's train op) catches Inf, not a NaN gradient.
        "NanLossHook, slim train op": fault == "inf_loss",
        "NanLossHook, guarded train op": True,
    }


@pytest.mark.parametrize(
    "policy, level",
    [("raise", logging.ERROR), ("stop", logging.WARNING), ("skip", logging.WARNING)],
)
@lib.each_mode
def test_a_bad_step_logs_nan_tensor_hooks_sentence_on_tensorflows_logger(
    mode, policy, level, caplog
):
    """Alerting greps TensorFlow's log for NanTensorHook's "Model diverged with loss = NaN".

    An Inf loss at batch 3 (which NanTensorHook would miss) gives one line in those words, the
    loss called what it was ("Model diverged with loss = Inf."), on the 'tensorflow' logger:
    at error level when the run gives up, at warning level when it stops or skips, as
    NanTensorHook logs when it raises or stops; the line goes on with the step, the real loss
    and the action.
    """
    model = lib.build_model(
        check_numerics=lib.MODES[mode], nan_policy=policy, faults={BAD_BATCH: "inf_loss"}
    )
    with caplog.at_level(logging.INFO, logger="tensorflow"):
        _seed_flow(model, mode=mode)
    lines = [r for r in caplog.records if "Model diverged with" in r.getMessage()]
    assert len(lines) == 1
    assert (lines[0].name, lines[0].levelno) == ("tensorflow", level)
    message = lines[0].getMessage()
    assert message.startswith("Model diverged with loss = Inf.")
    assert f"global step {BAD_BATCH}, loss +Inf, " in message
    assert f"action {policy}" in message


@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_tf_slim_training_train_with_the_hook(tmp_path, policy):
    """tf-slim's training.train with the hook, a NaN loss at batch 3: `skip` reaches step
    6, `stop` ends at step 3 and returns the bad loss."""
    # A NaN loss on every CPU kernel: `stop` returns the bad step's loss.
    model = lib.build_model(check_numerics=False, nan_policy=policy, faults={BAD_BATCH: "nan_loss"})
    snapshots = lib.Snapshots()
    with model.graph.as_default():
        loss = slim.training.train(
            model.train_op,
            str(tmp_path),
            hooks=[
                slim_nanguard.nan_hook(model.train_op),
                snapshots,
                tf.compat.v1.train.StopAtStepHook(last_step=STEPS),
            ],
            save_checkpoint_secs=None,
            save_summaries_steps=None,
        )
    guard = slim_nanguard.get_guard(model.train_op)
    assert np.isfinite(loss) if policy == "skip" else np.isnan(loss)
    assert max(snapshots.by_step) == (STEPS if policy == "skip" else BAD_BATCH)
    assert guard.state.total_bad_steps == 1
    lib.assert_all_finite(snapshots.by_step[max(snapshots.by_step)])


@pytest.mark.parametrize("policy", ["skip", "stop", "raise"])
def test_tf_slim_learning_train_with_train_step(tmp_path, policy):
    """tf-slim's learning.train with train_step, a NaN gradient at batch 3: the policy
    applies, naming logits/weights; unless it raised, the last checkpoint is finite."""
    model = lib.build_model(
        check_numerics=True, nan_policy=policy, faults={BAD_BATCH: "nan_gradient"}
    )
    with model.graph.as_default():
        run = lambda: slim.learning.train(  # noqa: E731
            model.train_op,
            str(tmp_path),
            train_step_fn=slim_nanguard.train_step,
            number_of_steps=STEPS,
            save_summaries_secs=None,
            save_interval_secs=None,
            log_every_n_steps=1,
        )
        if policy == "raise":
            with pytest.raises(slim_nanguard.NanLossError, match=f"global step {BAD_BATCH}"):
                run()
        else:
            loss = run()
            assert np.isfinite(loss)
    guard = slim_nanguard.get_guard(model.train_op)
    assert guard.state.total_bad_steps == 1
    assert guard.last_event.culprits == ("logits/weights",)
    checkpoint = tf.train.latest_checkpoint(str(tmp_path))
    if policy != "raise":
        values = lib.checkpoint_values(checkpoint)
        assert int(values["global_step"]) == (STEPS if policy == "skip" else BAD_BATCH)
        lib.assert_all_finite(values)


def _auto_records(events):
    """(verdict, action) of each bad step's event under nan_policy="auto"."""
    return [((e.autopsy.triage or {}).get("verdict"), e.action) for e in events]


@pytest.mark.parametrize("fault", ["nan_loss", "nan_input"])
@lib.each_mode
def test_auto_in_the_seed_flow_acts_on_each_verdict(tmp_path, mode, fault):
    """MonitoredTrainingSession with the hook (hook mode) or handle_numerics_error
    (check_numerics mode): each bad step is triaged (the batch holds the NaN: data) and the
    action is the verdict's."""
    model = lib.build_model(
        check_numerics=lib.MODES[mode], nan_policy="auto", faults={BAD_BATCH: fault}
    )
    run = _seed_flow(model, mode=mode, checkpoint_dir=str(tmp_path))
    told = _auto_records(run.events)
    # Both faults are in the batch itself (a NaN offset of the batch's loss, a NaN input).
    assert told == [("data", "skip")], told
    if fault == "nan_loss":  # The offset is the batch's, no example's: nothing to quarantine.
        sentence = run.events[0].autopsy.describe()
        assert sentence.endswith(
            "triage: data — the batch itself holds NaN or Inf, in no one example's row"
        )
        assert slim_nanguard.quarantine.read(str(tmp_path)) == []
    # A skipped bad step changed nothing (a rollback rightly writes).
    assert run.error is None and run.bad_step_changes == ([[]] if told[0][1] == "skip" else [])
    lib.assert_all_finite(run.final)


def test_auto_in_tf_slims_learning_train_with_make_train_step(tmp_path):
    model = lib.build_model(
        check_numerics=True, nan_policy="auto", faults={BAD_BATCH: "nan_gradient"}
    )
    guard = slim_nanguard.get_guard(model.train_op)
    loss = _learning_train_from_step_0(model, tmp_path)
    assert np.isfinite(loss)
    event = guard.last_event
    verdict = event.autopsy.triage["verdict"]
    assert (event.step, event.action) == (BAD_BATCH, _policy.AUTO_ACTIONS[verdict])


def _flaky_model(mode, flaky=True):
    """test_autopsy's model (8 fixed batches) whose loss is NaN on its first run only."""
    extra = ta._nan_on_first_call_only() if flaky else (lambda x: tf.constant(0.0))
    return ta._Model(mode, extra_loss=extra, nan_policy="auto")


@pytest.mark.parametrize("loop", ["seed_flow", "learning_train"])
@lib.each_mode
def test_auto_runs_a_transient_again_and_the_batch_trains_in_every_loop(tmp_path, mode, loop):
    """The first step's NaN does not repeat (chance): auto runs it again on the kept batch and
    it trains, so the run ends with the weights of a run without the fault (no batch skipped,
    none taken by the retry)."""

    def train(model, logdir):
        if loop == "seed_flow":
            return _seed_flow(model, mode=mode, checkpoint_dir=str(logdir)).final["model/w"]
        _learning_train_from_step_0(model, logdir)
        return lib.checkpoint_values(tf.train.latest_checkpoint(str(logdir)))["model/w"]

    flaky, clean = _flaky_model(mode), _flaky_model(mode, flaky=False)
    ours, theirs = train(flaky, tmp_path / "flaky"), train(clean, tmp_path / "clean")
    event = flaky.guard.last_event
    assert (event.step, event.autopsy.triage["verdict"], event.action) == (0, "chance", "skip")
    assert (flaky.guard.state.retries, flaky.guard.state.skips) == (1, 0)
    retries = [
        r for r in slim_nanguard.read_events(str(tmp_path / "flaky")) if r["kind"] == "retry"
    ]
    assert [(r["step"], r["trained"]) for r in retries] == [(0, True)]
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    assert not np.array_equal(theirs, np.ones_like(theirs))  # It trained.


def _first_bad_step(logdir):
    return next(r for r in slim_nanguard.read_events(str(logdir)) if r["kind"] == "bad_step")


@pytest.mark.parametrize("loop", ["seed_flow", "learning_train"])
@pytest.mark.parametrize("cause", ["data", "state"])
@lib.each_mode
def test_auto_names_the_cause_and_acts_on_it_in_every_loop(tmp_path, mode, cause, loop):
    """One example's NaN is data (skipped, quarantined); weights of 1e30 that overflow every
    example are state (rolled back, until max_rollbacks gives up): in the seed flow and in
    tf_slim.learning.train with make_train_step, both modes."""
    if cause == "data":
        model = ta._Model(mode, fault="nan_input", nan_policy="auto")
    else:
        model = ta._Model(mode, extra_loss=_weights_of_1e30, nan_policy="auto")
    if loop == "seed_flow":
        run = _seed_flow(model, mode=mode, checkpoint_dir=str(tmp_path))
        assert (run.error is None) == (cause == "data")
    elif cause == "data":
        _learning_train_from_step_0(model, tmp_path)
    else:
        with pytest.raises(slim_nanguard.NanLossError, match="max_rollbacks"):
            _learning_train_from_step_0(model, tmp_path)
    bad = _first_bad_step(tmp_path)
    told = (bad["autopsy"]["triage"]["verdict"], bad["action"])
    assert told == ((cause, "skip") if cause == "data" else (cause, "rollback")), told
    held = slim_nanguard.quarantine.read(str(tmp_path))
    assert len(held) == (1 if cause == "data" else 0)


def _weights_of_1e30(x):
    """A term whose weights (finite) overflow every example's square: a broken state."""
    v = tf.compat.v1.get_variable("v", [ta.FEATURES], initializer=tf.constant_initializer(1e30))
    return tf.reduce_mean(tf.reduce_sum(tf.square(x * v), axis=1))


def _nan_on_calls(*bad_calls):
    calls = []

    def flaky(x):
        calls.append(1)
        return np.float32(np.nan if len(calls) in bad_calls else 0.0)

    return lambda x: tf.compat.v1.py_func(flaky, [x], tf.float32, stateful=True)


@lib.each_mode
def test_a_retry_that_is_bad_again_is_skipped_and_says_so(tmp_path, mode, caplog):
    """The loss is NaN on the step's run and on the retry, finite on the triage's replay
    between them (call 2): the retry fails, the step is skipped and counted as a skip."""
    model = ta._Model(mode, extra_loss=_nan_on_calls(1, 3), nan_policy="auto")
    run = _seed_flow(model, mode=mode, checkpoint_dir=str(tmp_path))
    assert run.error is None
    assert (model.guard.state.retries, model.guard.state.skips) == (0, 1)
    (retry,) = [r for r in slim_nanguard.read_events(str(tmp_path)) if r["kind"] == "retry"]
    assert (retry["step"], retry["trained"]) == (0, False)
    said = [r.getMessage() for r in caplog.records if "run again on its batch" in r.getMessage()]
    assert said == [
        "slim_nanguard: global step 0: run again on its batch (triage: chance), it was bad "
        "again; skipped"
    ]
