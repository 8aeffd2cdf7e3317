"""A whole guarded run: clean checkpoints, rollback, the event record, resume, Ctrl-C.

Each test trains the small MLP of `nanguard_testlib` with `slim_nanguard.train` (or another
loop), saving a checkpoint every step, with bad batches at chosen indices, and then reads
what the run left on disk.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import tensorflow as tf
import tf_slim as slim

import slim_nanguard
from slim_nanguard import _recorders

import nanguard_testlib as lib

BAD = 3
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


class _AtRollback(tf.compat.v1.train.SessionRunHook):
    """Reads every variable (and the consecutive count) as each rollback is recorded."""

    def __init__(self, model, guard):
        self.states = []
        self._graph = model.graph
        self._guard = guard
        self._session = None
        guard.add_listener(self._on_record)

    def after_create_session(self, session, coord):
        self._session = session  # the raw session

    def _on_record(self, record):
        if record["kind"] == "rollback":
            self.states.append(
                (lib.state(self._session, self._graph), self._guard.state.consecutive_bad_steps)
            )


def _train(
    logdir, *, mode="check_numerics", faults=None, steps=8, hooks=(), model=None, **create_kwargs
):
    """Builds the model and trains it with checkpoints every step; returns (result, model)."""
    model = model or lib.build_model(check_numerics=lib.MODES[mode], faults=faults, **create_kwargs)
    result = slim_nanguard.train(
        model.train_op,
        str(logdir),
        number_of_steps=steps,
        save_checkpoint_steps=1,
        save_summaries_steps=None,
        log_every_n_steps=2,
        hooks=list(hooks),
    )
    return result, model


class TestNoPoisonedCheckpoint:
    @pytest.mark.parametrize("policy", ["raise", "stop", "skip", "rollback"])
    @lib.each_mode
    def test_train_saves_every_step_and_no_checkpoint_holds_nan(self, tmp_path, mode, policy):
        """A NaN input at batch 3, a checkpoint every step: under every policy no
        checkpoint holds a NaN, and the newest is the last good state."""
        snapshots = lib.Snapshots()
        if policy == "raise":
            with pytest.raises(slim_nanguard.NanLossError):
                _train(
                    tmp_path,
                    mode=mode,
                    nan_policy=policy,
                    faults={BAD: "nan_input"},
                    hooks=[snapshots],
                )
        else:
            result, _ = _train(
                tmp_path, mode=mode, nan_policy=policy, faults={BAD: "nan_input"}, hooks=[snapshots]
            )
            assert result.bad_steps == 1
            assert result.global_step == (BAD if policy == "stop" else 8)
            assert result.stop_reason == ("nan_policy_stop" if policy == "stop" else "step_limit")
        lib.assert_no_poisoned_checkpoint(str(tmp_path))
        # The latest checkpoint is the last good state, variable for variable.
        latest = lib.checkpoint_values(tf.train.latest_checkpoint(str(tmp_path)))
        step = int(latest["global_step"])
        assert step == (BAD if policy in ("raise", "stop") else 8)
        expected = snapshots.by_step[step]
        for name, value in expected.items():
            np.testing.assert_array_equal(latest[name], value, err_msg=name)

    @lib.each_mode
    def test_a_users_own_saver_never_writes_an_inf_weight(self, tmp_path, mode):
        """A Scaffold with the user's Saver (over w and global_step only). At batch 3 a huge
        but finite input gives a finite loss and gradient, and the update sends w to -Inf,
        which the guard can only see at the next step (a -Inf loss: stop). The user's saver
        saves every step, and none of its checkpoints holds the -Inf."""
        graph = tf.Graph()
        with graph.as_default():
            inputs = np.zeros(20, np.float32)
            inputs[BAD] = 1e38
            x = tf.compat.v1.data.make_one_shot_iterator(
                tf.data.Dataset.from_tensor_slices(inputs)
            ).get_next()
            w = tf.compat.v1.get_variable("w", [], initializer=tf.compat.v1.ones_initializer())
            train_op = slim_nanguard.create_train_op(
                w * x,
                tf.compat.v1.train.GradientDescentOptimizer(10.0),
                check_numerics=lib.MODES[mode],
                nan_policy="stop",
            )
            saver = tf.compat.v1.train.Saver(
                var_list=[w, tf.compat.v1.train.get_global_step()], max_to_keep=None
            )
            result = slim_nanguard.train(
                train_op,
                str(tmp_path),
                number_of_steps=8,
                save_checkpoint_steps=1,
                save_summaries_steps=None,
                log_every_n_steps=0,
                scaffold=tf.compat.v1.train.Scaffold(saver=saver),
            )
        assert result.stop_reason == "nan_policy_stop" and result.bad_steps == 1
        assert result.global_step == BAD + 1  # the overflowing update went through
        lib.assert_no_poisoned_checkpoint(str(tmp_path))
        latest = lib.checkpoint_values(tf.train.latest_checkpoint(str(tmp_path)))
        assert sorted(latest) == ["global_step", "w"]  # the user's saver wrote it
        assert int(latest["global_step"]) == BAD and np.isfinite(latest["w"])

    @pytest.mark.parametrize("policy", ["stop", "skip"])
    def test_a_plain_monitored_session_with_our_hook(self, tmp_path, policy):
        """Batch 3 is bad in a session saving every step: the newest checkpoint is step 3's
        (stop) or step 6's (skip), and none holds a NaN."""
        model = lib.build_model(check_numerics=False, nan_policy=policy, faults={BAD: "nan_input"})
        lib.run_monitored(
            model.train_op,
            hooks=[slim_nanguard.nan_hook(model.train_op)],
            last_step=6,
            checkpoint_dir=str(tmp_path),
        )
        lib.assert_no_poisoned_checkpoint(str(tmp_path))
        latest = lib.checkpoint_values(tf.train.latest_checkpoint(str(tmp_path)))
        assert int(latest["global_step"]) == (BAD if policy == "stop" else 6)

    def test_tf_slim_training_train_and_learning_train(self, tmp_path):
        model = lib.build_model(
            check_numerics=False, nan_policy="skip", faults={BAD: "nan_gradient"}
        )
        with model.graph.as_default():
            slim.training.train(
                model.train_op,
                str(tmp_path / "training"),
                hooks=[
                    slim_nanguard.nan_hook(model.train_op),
                    tf.compat.v1.train.StopAtStepHook(last_step=6),
                ],
                chief_only_hooks=[
                    tf.compat.v1.train.CheckpointSaverHook(str(tmp_path / "training"), save_steps=1)
                ],
                save_checkpoint_secs=None,
                save_summaries_steps=None,
            )
        lib.assert_no_poisoned_checkpoint(str(tmp_path / "training"))

        model = lib.build_model(check_numerics=True, nan_policy="skip", faults={BAD: "nan_input"})
        with model.graph.as_default():
            slim.learning.train(
                model.train_op,
                str(tmp_path / "learning"),
                train_step_fn=slim_nanguard.train_step,
                number_of_steps=6,
                save_summaries_secs=None,
                save_interval_secs=None,
                saver=slim_nanguard.FiniteSaver(),
            )
        lib.assert_no_poisoned_checkpoint(str(tmp_path / "learning"))
        latest = lib.checkpoint_values(tf.train.latest_checkpoint(str(tmp_path / "learning")))
        assert int(latest["global_step"]) == 6


@pytest.fixture(scope="module")
def grpc_master():
    """An in-process TensorFlow server on localhost (it lives until the process ends)."""
    return tf.distribute.Server.create_local_server().target


@pytest.mark.parametrize(
    "mode, policy", [("check_numerics", "skip"), ("hook", "skip"), ("hook", "rollback")]
)
def test_a_run_through_a_grpc_master_skips_the_bad_step(tmp_path, grpc_master, mode, policy):
    """--master: the session runs the graph on a server, and the guard works the same."""

    class _Target(tf.compat.v1.train.SessionRunHook):
        def after_create_session(self, session, coord):
            self.target = tf.compat.as_str(session.sess_str)

    model = lib.build_model(
        check_numerics=lib.MODES[mode], nan_policy=policy, faults={BAD: "nan_input"}
    )
    target = _Target()
    result = slim_nanguard.train(
        model.train_op,
        str(tmp_path),
        number_of_steps=8,
        master=grpc_master,
        save_checkpoint_steps=1,
        save_summaries_steps=None,
        log_every_n_steps=0,
        hooks=[target],
    )
    assert target.target == grpc_master and grpc_master.startswith("grpc://")
    assert (result.bad_steps, result.global_step) == (1, 8)
    assert (result.skips, result.rollbacks) == ((1, 0) if policy == "skip" else (0, 1))
    lib.assert_no_poisoned_checkpoint(str(tmp_path))


class TestPlainTensorFlowPoisonsCheckpoints:
    """What TensorFlow alone does with a bad step, and what ours does instead."""

    def _run(self, logdir, train_op_fn, hook_fn, fail):
        """Eight steps saving every step, the hook raising (`fail`) or stopping at a NaN.

        Batch 3 has a NaN input: fc1's gradient is NaN on every CPU kernel, but the loss only
        where the kernel lets the NaN through. Batch 4's loss is NaN on every kernel, so
        NanTensorHook sees the NaN by then. Returns the non-finite variables of each
        checkpoint written.
        """
        model = lib.build_model(
            train_op_fn=train_op_fn,
            check_numerics=False,
            faults={BAD: "nan_input", BAD + 1: "nan_loss"},
        )
        with model.graph.as_default():
            hook = hook_fn(model.train_op, fail)
        run = lib.run_monitored(
            model.train_op,
            hooks=[hook],
            last_step=8,
            checkpoint_dir=str(logdir),
            catch_nan_error=True,
        )
        assert (run.error is not None) == fail, "the hook did not raise as told"
        return [slim_nanguard.non_finite_variables(p) for p in lib.all_checkpoints(str(logdir))]

    def test_nan_tensor_hook_without_failing_saves_nan_weights_at_the_end(self, tmp_path):
        """NanTensorHook that only stops: the closing save writes NaN weights. Ours stops
        with finite ones."""
        theirs = self._run(
            tmp_path / "tf",
            slim.learning.create_train_op,
            tf.compat.v1.train.NanTensorHook,
            fail=False,
        )
        latest = slim_nanguard.non_finite_variables(
            tf.train.latest_checkpoint(str(tmp_path / "tf"))
        )
        assert "fc1/weights" in latest
        assert any(theirs)
        ours = self._run(
            tmp_path / "ours", slim_nanguard.create_train_op, slim_nanguard.NanLossHook, fail=False
        )
        assert not any(ours)

    def test_the_checkpoint_saver_runs_before_the_nan_hook_raises(self, tmp_path):
        """TensorFlow's saver writes the poisoned step before NanTensorHook raises; ours
        raises as well, and every checkpoint is finite."""
        theirs = self._run(
            tmp_path / "tf",
            slim.learning.create_train_op,
            tf.compat.v1.train.NanTensorHook,
            fail=True,
        )
        assert any("fc1/weights" in bad for bad in theirs)
        ours = self._run(
            tmp_path / "ours", slim_nanguard.create_train_op, slim_nanguard.NanLossHook, fail=True
        )
        assert ours and not any(ours)


class TestRefusingANonFiniteModel:
    def _poison_checkpoint(self, logdir):
        model = lib.build_model()
        with model.graph.as_default(), tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            weights = model.graph.get_tensor_by_name("fc1/weights:0")
            sess.run(
                tf.compat.v1.assign(
                    model.graph.get_operation_by_name("fc1/weights").outputs[0], weights * np.nan
                )
            )
            tf.compat.v1.train.Saver().save(
                sess, os.path.join(str(logdir), "model.ckpt"), global_step=4
            )

    def test_a_nan_checkpoint_in_logdir(self, tmp_path):
        self._poison_checkpoint(tmp_path)
        with pytest.raises(
            slim_nanguard.NonFiniteCheckpointError,
            match=r"model.ckpt-4 holds NaN or Inf in fc1/weights; refusing",
        ):
            _train(tmp_path)

    def test_a_nan_model_from_the_scaffold_init_fn(self, tmp_path):
        model = lib.build_model()
        with model.graph.as_default():
            weights = tf.compat.v1.trainable_variables("fc1")[0]
            poison = tf.compat.v1.assign(weights, weights * np.nan)
            scaffold = tf.compat.v1.train.Scaffold(init_fn=lambda scaffold, sess: sess.run(poison))
        with pytest.raises(
            slim_nanguard.NonFiniteCheckpointError, match="holds NaN or Inf in fc1/weights"
        ):
            slim_nanguard.train(model.train_op, str(tmp_path), number_of_steps=3, scaffold=scaffold)
        assert not lib.all_checkpoints(str(tmp_path))

    def test_an_init_op_that_leaves_the_model_uninitialised_is_told_by_tensorflow(self, tmp_path):
        """The check reads the model after its init_fn: a variable the scaffold's init_op left
        uninitialised is TensorFlow's ready check to report, not a failed read of ours."""
        model = lib.build_model()
        with model.graph.as_default():
            scaffold = tf.compat.v1.train.Scaffold(init_op=tf.no_op())
        with pytest.raises(RuntimeError, match="Init operations did not make model ready"):
            slim_nanguard.train(model.train_op, str(tmp_path), number_of_steps=3, scaffold=scaffold)


class TestRollback:
    def test_rollback_restores_skips_ahead_and_lowers_the_learning_rate(self, tmp_path):
        """NaN losses at batches 3 and 4: one rollback to the checkpoint of step 3 skips
        batch 4 and halves the learning rate."""
        snapshots = lib.Snapshots()
        result, model = _train(
            tmp_path,
            nan_policy="rollback",
            rollback_lr_factor=0.5,
            rollback_skip_batches=1,
            hooks=[snapshots],
            faults={BAD: "nan_loss", BAD + 1: "nan_loss"},
        )
        # Batch BAD + 1 was skipped by the rollback, so only one bad step was seen.
        assert (result.bad_steps, result.rollbacks, result.skips) == (1, 1, 0)
        assert result.learning_rate_scale == 0.5
        latest = lib.checkpoint_values(tf.train.latest_checkpoint(str(tmp_path)))
        assert latest["nanguard/learning_rate_scale"] == 0.5
        rollbacks = [r for r in slim_nanguard.read_events(tmp_path) if r["kind"] == "rollback"]
        assert len(rollbacks) == 1
        assert rollbacks[0]["checkpoint"].endswith(f"model.ckpt-{BAD}")
        assert rollbacks[0]["skipped_batches"] == 1
        lib.assert_no_poisoned_checkpoint(str(tmp_path))

    @lib.each_mode
    def test_a_checkpoint_that_goes_bad_again_is_passed_over_by_the_next_rollback(
        self, tmp_path, mode
    ):
        """Batches 3 and 5 are bad. The first rollback restores step 3; the run goes bad again
        before it saves anything newer, so the second one goes a checkpoint further back."""
        model = lib.build_model(
            check_numerics=lib.MODES[mode],
            nan_policy="rollback",
            rollback_skip_batches=1,
            faults={BAD: "nan_loss", BAD + 2: "nan_loss"},
        )
        guard = slim_nanguard.get_guard(model.train_op)
        seen, snapshots = _AtRollback(model, guard), lib.Snapshots()
        result, _ = _train(tmp_path, model=model, hooks=[seen, snapshots])
        assert (result.bad_steps, result.rollbacks, result.global_step) == (2, 2, 8)
        rollbacks = [r for r in slim_nanguard.read_events(tmp_path) if r["kind"] == "rollback"]
        assert [r["checkpoint"].rsplit("-", 1)[1] for r in rollbacks] == [str(BAD), str(BAD - 1)]
        (first, _), (second, _) = seen.states
        assert (first["global_step"], second["global_step"]) == (BAD, BAD - 1)
        # Step BAD - 1 was passed once only, before the faults: its snapshot is the original.
        lib.assert_state_equal(snapshots.by_step[BAD - 1], second)
        lib.assert_no_poisoned_checkpoint(str(tmp_path))

    def test_a_one_off_fault_after_good_steps_does_not_walk_back(self, tmp_path):
        """Bad batches 5 and 9, a checkpoint every 4 steps: good steps came between the two
        faults, so both rollbacks restore step 4."""
        model = lib.build_model(
            nan_policy="rollback", rollback_skip_batches=1, faults={5: "nan_loss", 9: "nan_loss"}
        )
        result = slim_nanguard.train(
            model.train_op,
            str(tmp_path),
            number_of_steps=8,
            save_checkpoint_steps=4,
            save_summaries_steps=None,
            log_every_n_steps=0,
        )
        assert (result.rollbacks, result.global_step) == (2, 8)
        rollbacks = [r for r in slim_nanguard.read_events(tmp_path) if r["kind"] == "rollback"]
        assert [r["checkpoint"].rsplit("-", 1)[1] for r in rollbacks] == ["4", "4"]

    @lib.each_mode
    def test_walking_back_survives_the_restored_step_being_saved_again(self, tmp_path, mode):
        """Every batch from 3 on is bad; checkpoints are saved by time, so the saver writes the
        restored step again during the skipped steps. Each escalated rollback still goes one
        step further back, and each goes before the run of bad steps it ends: the checkpoint
        of the run's first step holds the very state that went bad."""
        model = lib.build_model(
            check_numerics=lib.MODES[mode],
            nan_policy="skip",
            max_consecutive_bad_steps=2,
            persistent_nan_policy="rollback",
            max_rollbacks=3,
            faults={i: "nan_input" for i in range(3, 60)},
        )
        with pytest.raises(slim_nanguard.NanLossError, match="max_rollbacks=3"):
            slim_nanguard.train(
                model.train_op,
                str(tmp_path),
                number_of_steps=20,
                save_checkpoint_secs=1e-6,
                save_summaries_steps=None,
                log_every_n_steps=0,
            )
        rollbacks = [r for r in slim_nanguard.read_events(tmp_path) if r["kind"] == "rollback"]
        assert [r["checkpoint"].rsplit("-", 1)[1] for r in rollbacks] == ["2", "1", "0"]
        assert all("bad steps in a row began at global step" in r["why"] for r in rollbacks)
        lib.assert_no_poisoned_checkpoint(str(tmp_path))

    @lib.each_mode
    def test_rollback_gives_up_after_max_rollbacks(self, tmp_path, mode):
        """An Inf loss at every other batch from 2 on: two rollbacks, then the third bad
        step raises."""
        faults = {i: "inf_loss" for i in range(2, 20, 2)}
        with pytest.raises(
            slim_nanguard.NanLossError, match="2 rollbacks already done reached max_rollbacks=2"
        ):
            _train(
                tmp_path,
                mode=mode,
                nan_policy="rollback",
                max_rollbacks=2,
                rollback_skip_batches=0,
                faults=faults,
                steps=30,
            )
        records = slim_nanguard.read_events(tmp_path)
        assert [r["kind"] for r in records] == ["bad_step", "rollback"] * 2 + ["bad_step", "stop"]
        assert records[-1]["reason"] == "nan_error"

    @lib.each_mode
    def test_skip_escalates_to_a_rollback_to_the_last_checkpoint(self, tmp_path, mode):
        """Batches 4-6 are bad: two skips, then the third in a row rolls back to step 3."""
        model = lib.build_model(
            check_numerics=lib.MODES[mode],
            nan_policy="skip",
            max_consecutive_bad_steps=3,
            persistent_nan_policy="rollback",
            rollback_lr_factor=0.5,
            faults={i: "nan_input" for i in (4, 5, 6)},
        )
        guard = slim_nanguard.get_guard(model.train_op)
        seen = _AtRollback(model, guard)
        result = slim_nanguard.train(
            model.train_op,
            str(tmp_path),
            number_of_steps=10,
            save_checkpoint_steps=3,
            save_summaries_steps=None,
            log_every_n_steps=0,
            hooks=[seen],
        )
        # Batch 7 was skipped by the rollback; training went on from step 3 to the limit.
        assert (result.bad_steps, result.skips, result.rollbacks) == (3, 2, 1)
        assert (result.stop_reason, result.global_step) == ("step_limit", 10)
        assert result.learning_rate_scale == 0.5
        records = slim_nanguard.read_events(tmp_path)
        assert [(r["kind"], r.get("action"), r.get("consecutive")) for r in records] == [
            ("bad_step", "skip", 1),
            ("bad_step", "skip", 2),
            ("bad_step", "rollback", 3),
            ("rollback", "rollback", 3),
            ("stop", None, None),
        ]
        assert records[2]["step"] == 4
        assert records[2]["escalation"] == (
            "3 bad steps in a row reached max_consecutive_bad_steps=3"
        )
        assert "escalation" not in records[0]
        checkpoint = records[3]["checkpoint"]
        assert checkpoint.endswith("model.ckpt-3")
        # Right after the rollback: the weights of the checkpoint (not those of step 4), the
        # lowered learning rate, and a consecutive count that starts over.
        ((restored, consecutive),) = seen.states
        assert consecutive == 0
        expected = lib.checkpoint_values(checkpoint)
        assert int(restored["global_step"]) == 3
        for name, value in restored.items():
            if name != "nanguard/learning_rate_scale":
                np.testing.assert_array_equal(value, expected[name], err_msg=name)
        assert restored["nanguard/learning_rate_scale"] == 0.5
        lib.assert_no_poisoned_checkpoint(str(tmp_path))

    @lib.each_mode
    def test_escalation_to_stop_ends_with_the_last_good_checkpoint(self, tmp_path, mode):
        """Every batch from 3 on is bad: two skips, then a stop whose checkpoint is the
        state of step 3, variable for variable."""
        snapshots = lib.Snapshots()
        result, _ = _train(
            tmp_path,
            mode=mode,
            nan_policy="skip",
            max_consecutive_bad_steps=3,
            persistent_nan_policy="stop",
            hooks=[snapshots],
            faults={i: "nan_input" for i in range(BAD, 20)},
        )
        assert (result.stop_reason, result.global_step) == ("nan_policy_stop", BAD)
        assert (result.bad_steps, result.skips, result.rollbacks) == (3, 2, 0)
        records = slim_nanguard.read_events(tmp_path)
        assert [(r["kind"], r.get("action") or r.get("reason")) for r in records] == [
            ("bad_step", "skip"),
            ("bad_step", "skip"),
            ("bad_step", "stop"),
            ("stop", "nan_policy_stop"),
        ]
        latest = lib.checkpoint_values(tf.train.latest_checkpoint(str(tmp_path)))
        assert int(latest["global_step"]) == BAD
        for name, value in snapshots.by_step[BAD].items():
            np.testing.assert_array_equal(latest[name], value, err_msg=name)
        lib.assert_no_poisoned_checkpoint(str(tmp_path))

    def test_rollback_without_a_checkpoint_fails_clearly(self, tmp_path):
        model = lib.build_model(nan_policy="rollback", faults={2: "nan_input"})
        with pytest.raises(
            slim_nanguard.CheckpointNotFoundError,
            match="rollback needs a good checkpoint in .* and there is none",
        ):
            slim_nanguard.train(
                model.train_op,
                str(tmp_path),
                number_of_steps=5,
                save_checkpoint_secs=None,
                save_summaries_steps=None,
            )


class TestTheRecord:
    def test_each_bad_step_is_a_line_and_a_tensorboard_scalar(self, tmp_path):
        """A NaN gradient at batch 2 and an Inf loss at batch 5 (global step 4, after the
        skip): one JSON line each, and TensorBoard scalars."""
        result, _ = _train(tmp_path, nan_policy="skip", faults={2: "nan_gradient", 5: "inf_loss"})
        records = slim_nanguard.read_events(result.events_path)
        assert [(r["kind"], r.get("action"), r.get("step")) for r in records] == [
            ("bad_step", "skip", 2),
            ("bad_step", "skip", 4),
            ("stop", None, 8),
        ]
        assert records[0]["culprits"] == ["logits/weights"] and records[0]["loss_kind"] == "finite"
        assert records[1]["loss"] == "inf" and records[1]["culprits"] == []
        with open(result.events_path) as f:
            assert all(json.loads(line) for line in f)  # plain JSON, one object a line
        scalars = {}
        for path in tf.io.gfile.glob(os.path.join(str(tmp_path), "events.out.tfevents.*")):
            for event in tf.compat.v1.train.summary_iterator(path):
                for value in event.summary.value:
                    scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
        assert (4, 2.0) in scalars["nanguard/bad_steps"]
        assert (4, 2.0) in scalars["nanguard/skips"]
        # The counters at the bad steps; the loss follows the summaries' schedule, off here.
        assert "nanguard/rollbacks" in scalars and "nanguard/loss" not in scalars

    def test_a_line_cut_by_a_crash_leaves_the_earlier_lines_readable(self, tmp_path):
        recorder = _recorders.EventRecorder(str(tmp_path), write_summaries=False)
        recorder({"kind": "bad_step", "step": 1, "action": "skip"})
        recorder({"kind": "bad_step", "step": 2, "action": "skip"})
        with open(recorder.path, "a") as f:
            f.write('{"kind": "bad_step", "st')  # the process died here
        assert [r["step"] for r in slim_nanguard.read_events(str(tmp_path))] == [1, 2]
        recorder({"kind": "bad_step", "step": 3, "action": "skip"})
        assert [r["step"] for r in slim_nanguard.read_events(str(tmp_path))] == [1, 2, 3]


class TestResume:
    def test_a_second_run_carries_on_and_appends_to_the_record(self, tmp_path):
        """A run stops at its bad step 3; a second run in the same directory goes on to
        step 8 and appends to the same record."""
        first, _ = _train(tmp_path, nan_policy="stop", faults={BAD: "nan_input"})
        assert (first.stop_reason, first.global_step) == ("nan_policy_stop", BAD)
        second, _ = _train(tmp_path, nan_policy="skip", faults={1: "inf_loss"}, steps=8)
        assert second.global_step == 8 and second.steps == 8 - BAD
        kinds = [(r["kind"], r.get("reason")) for r in slim_nanguard.read_events(tmp_path)]
        assert kinds == [
            ("bad_step", None),
            ("stop", "nan_policy_stop"),
            ("bad_step", None),
            ("stop", "step_limit"),
        ]
        lib.assert_no_poisoned_checkpoint(str(tmp_path))

    def test_resuming_with_another_rollback_lr_factor(self, tmp_path):
        """The guard's learning-rate scale exists only with a factor below 1: resume anyway."""
        first, _ = _train(tmp_path, steps=3)
        assert "nanguard/learning_rate_scale" not in lib.checkpoint_values(first.checkpoint)
        second, _ = _train(
            tmp_path, steps=6, nan_policy="rollback", rollback_lr_factor=0.5, faults={1: "nan_loss"}
        )
        assert (second.steps, second.rollbacks, second.learning_rate_scale) == (3, 1, 0.5)
        assert lib.checkpoint_values(second.checkpoint)["nanguard/learning_rate_scale"] == 0.5

    def test_the_lowered_learning_rate_carries_into_a_resumed_run(self, tmp_path):
        """A new guard (as in a new process) starts from the scale the checkpoint holds."""
        first, _ = _train(
            tmp_path, steps=4, nan_policy="rollback", rollback_lr_factor=0.5, faults={1: "nan_loss"}
        )
        assert first.learning_rate_scale == 0.5
        second, _ = _train(
            tmp_path, steps=8, nan_policy="rollback", rollback_lr_factor=0.5, faults={1: "nan_loss"}
        )
        assert (second.rollbacks, second.learning_rate_scale) == (1, 0.25)
        assert lib.checkpoint_values(second.checkpoint)["nanguard/learning_rate_scale"] == 0.25

    @lib.each_mode
    def test_a_recovered_session_carries_on_from_the_last_checkpoint(self, tmp_path, mode):
        """An AbortedError (a preempted worker) makes MonitoredSession create a new session:
        it must start from the newest checkpoint, not from where the run began."""

        class _AbortOnce(tf.compat.v1.train.SessionRunHook):
            def __init__(self):
                self.starts, self._aborted = [], False

            def after_create_session(self, session, coord):
                self.starts.append(int(session.run(tf.compat.v1.train.get_global_step())))

            def after_run(self, run_context, run_values):
                step = run_context.session.run(tf.compat.v1.train.get_global_step())
                if step >= 5 and not self._aborted:
                    self._aborted = True
                    raise tf.errors.AbortedError(None, None, "worker preempted (test)")

        abort = _AbortOnce()
        result, _ = _train(tmp_path, mode=mode, steps=8, hooks=[abort])
        assert result.global_step == 8
        assert abort.starts[0] == 0 and abort.starts[1] >= 4, abort.starts
        assert result.steps <= 8 - abort.starts[1] + 5

    def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_one(self, tmp_path, caplog):
        """Four steps, then the newest checkpoint (step 4) is cut short: the next run
        resumes from step 3 and says why."""
        _train(tmp_path, steps=4)
        latest = tf.train.latest_checkpoint(str(tmp_path))
        assert latest.endswith("model.ckpt-4")
        for data in tf.io.gfile.glob(latest + ".data*"):
            with open(data, "r+b") as f:
                f.truncate(3)
        result, _ = _train(tmp_path, steps=6)
        assert result.steps == 3  # resumed from step 3, not 4 and not 0
        warning = " ".join(r.getMessage() for r in caplog.records)
        assert "model.ckpt-4" in warning and "model.ckpt-3 instead" in warning

    def test_no_readable_checkpoint_at_all(self, tmp_path):
        _train(tmp_path, steps=2)
        for data in tf.io.gfile.glob(os.path.join(str(tmp_path), "model.ckpt-*.data*")):
            with open(data, "r+b") as f:
                f.truncate(3)
        with pytest.raises(
            slim_nanguard.CheckpointNotFoundError, match="no checkpoint in .* can be read"
        ):
            _train(tmp_path, steps=4)


class TestBadInput:
    def test_a_logdir_that_is_a_file_or_cannot_be_created(self, tmp_path):
        model = lib.build_model()
        blocker = tmp_path / "file"
        blocker.write_text("x")
        with pytest.raises(ValueError, match="logdir .*file is a file, not a directory"):
            slim_nanguard.train(model.train_op, str(blocker), number_of_steps=1)
        with pytest.raises(ValueError, match="logdir .*file/run cannot be written to"):
            slim_nanguard.train(model.train_op, str(blocker / "run"), number_of_steps=1)

    def test_a_missing_logdir_is_created(self, tmp_path):
        result, _ = _train(tmp_path / "new" / "run", steps=2)
        assert result.checkpoint.startswith(str(tmp_path / "new" / "run"))

    @pytest.mark.parametrize("steps", [-1, 2.5, True])
    def test_a_bad_step_count_writes_nothing(self, tmp_path, steps):
        model = lib.build_model()
        with pytest.raises(ValueError, match="number_of_steps must be a non-negative integer"):
            slim_nanguard.train(model.train_op, str(tmp_path / "run"), number_of_steps=steps)
        assert not (tmp_path / "run").exists()

    def test_an_unguarded_train_op(self, tmp_path):
        model = lib.build_model(train_op_fn=slim.learning.create_train_op)
        with pytest.raises(ValueError, match="was not made by slim_nanguard.create_train_op"):
            slim_nanguard.train(model.train_op, str(tmp_path), number_of_steps=1)

    def test_the_loss_in_place_of_the_train_op_trains_nothing_and_is_refused(self, tmp_path):
        # The guard is found by its loss too (the hook judges the loss), but a loop that ran
        # the loss would never update a weight.
        model = lib.build_model()
        with pytest.raises(ValueError, match="is the loss of a guarded train op; pass the train"):
            slim_nanguard.train(model.loss, str(tmp_path / "run"), number_of_steps=1)
        assert not (tmp_path / "run").exists()

    def test_learning_train_s_step_refuses_the_loss_in_place_of_the_train_op(self, tmp_path):
        model = lib.build_model()
        with model.graph.as_default(), tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            before = sess.run(tf.compat.v1.trainable_variables())
            with pytest.raises(ValueError, match="is the loss of a guarded train op; pass the"):
                slim_nanguard.train_step(sess, model.loss, model.global_step, {})
            after = sess.run(tf.compat.v1.trainable_variables())
        assert all((b == a).all() for b, a in zip(before, after))

    def test_a_graph_without_a_global_step_is_refused_in_one_line(self, tmp_path):
        # TensorFlow's own hooks would fail on it inside the session, in a wall of frames.
        graph = tf.Graph()
        with graph.as_default():
            weights = tf.compat.v1.get_variable("w", [2], initializer=tf.ones_initializer())
            loss = tf.reduce_sum(weights * weights)
            optimizer = tf.compat.v1.train.GradientDescentOptimizer(0.1)
            train_op = slim_nanguard.create_train_op(loss, optimizer, global_step=None)
            with pytest.raises(ValueError, match="train needs a global step .* has none"):
                slim_nanguard.train(train_op, str(tmp_path / "run"), number_of_steps=3)
        assert not (tmp_path / "run").exists()

    def test_a_train_op_that_does_not_count_steps_is_refused_in_one_line(self, tmp_path):
        # The graph has a global step, but this train op never moves it: the step limit would
        # never be reached (the loop ran until killed, then failed on its final values).
        graph = tf.Graph()
        with graph.as_default():
            tf.compat.v1.train.get_or_create_global_step()
            weights = tf.compat.v1.get_variable("w", [2], initializer=tf.ones_initializer())
            loss = tf.reduce_sum(weights * weights)
            optimizer = tf.compat.v1.train.GradientDescentOptimizer(0.1)
            train_op = slim_nanguard.create_train_op(
                loss, optimizer, global_step=None, rollback_lr_factor=0.5
            )
            with pytest.raises(ValueError, match="does not increment it .*global_step=None"):
                slim_nanguard.train(train_op, str(tmp_path / "run"), number_of_steps=3)
        assert not (tmp_path / "run").exists()


def test_ctrl_c_ends_with_a_final_clean_checkpoint_and_a_summary(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {TESTS_DIR!r})
        import tensorflow as tf
        from absl import logging
        tf.compat.v1.disable_v2_behavior()
        logging.set_verbosity(logging.INFO)
        import nanguard_testlib as lib
        import slim_nanguard
        model = lib.build_model(nan_policy="skip", faults={{5: "nan_input"}}, repeat=True)
        result = slim_nanguard.train(model.train_op, {str(tmp_path)!r}, number_of_steps=10**6,
                                     save_checkpoint_secs=3600, save_summaries_steps=None,
                                     log_every_n_steps=50)
        print("RESULT", result.stop_reason, result.global_step, flush=True)
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    try:
        # Wait until training is under way (a progress line), then press Ctrl-C.
        for line in proc.stderr:
            if "step 100/" in line:
                break
            assert time.monotonic() < deadline, "no progress line within 120 s"
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-2000:]
    reason, step = stdout.split("RESULT")[1].split()
    assert reason == "interrupted" and int(step) >= 100
    latest = tf.train.latest_checkpoint(str(tmp_path))
    assert latest.endswith(f"model.ckpt-{step}")  # the closing save, not the timer's
    assert slim_nanguard.non_finite_variables(latest) == ()
    assert slim_nanguard.read_events(tmp_path)[-1]["reason"] == "interrupted"


@lib.each_mode
def test_giving_up_first_saves_the_good_state_of_the_bad_step(tmp_path, mode):
    """No checkpoint by time or by steps, yet raising costs no good step: the state the guard
    kept at the bad step is saved before the error leaves `train`."""
    model = lib.build_model(
        check_numerics=lib.MODES[mode], nan_policy="raise", faults={BAD: "nan_loss"}
    )
    with pytest.raises(slim_nanguard.NanLossError) as raised:
        slim_nanguard.train(
            model.train_op,
            str(tmp_path),
            number_of_steps=8,
            save_checkpoint_secs=None,
            save_summaries_steps=None,
            log_every_n_steps=0,
        )
    assert raised.value.checkpoint == str(tmp_path / f"model.ckpt-{BAD}")
    values = lib.checkpoint_values(raised.value.checkpoint)
    assert int(values["global_step"]) == BAD
    lib.assert_all_finite(values)
    stop = slim_nanguard.read_events(tmp_path)[-1]
    assert (stop["reason"], stop["checkpoint"]) == ("nan_error", raised.value.checkpoint)
