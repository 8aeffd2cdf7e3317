"""What the package logs and says: true to what happened, and nothing it was not asked for.

Each test is a small run (or a fresh process, for what an import does) and reads the lines a
user would read: the log lines of a bad step, the error raised when training gives up and its
chained cause, a hook refusing what it cannot do.
"""

import os
import pathlib
import re
import subprocess
import sys
import traceback
from unittest import mock

import pytest
import tensorflow as tf
import tf_slim as slim
from tensorflow.python.platform import tf_logging

import slim_nanguard

import nanguard_testlib as lib

REPO = pathlib.Path(__file__).resolve().parents[1]
BAD_BATCH = 3
STEPS = 6


def _python(code: str) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh Python, with this checkout's slim_nanguard first on the path."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=path)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )


# ---------------------------------------------------------------------------------------------
# Importing the package configures no logging.


def test_importing_the_package_leaves_pythons_logging_to_the_user():
    """A user's script imports slim_nanguard and builds a guarded train op (the library logs
    while it does), logs through TensorFlow, then sets up its own logging: the TensorFlow
    line prints once, and the user's basicConfig takes effect."""
    proc = _python(
        "import logging, sys\n"
        "import slim_nanguard, tensorflow as tf\n"
        "print('root handlers:', len(logging.root.handlers), file=sys.stderr)\n"
        "tf.compat.v1.disable_eager_execution()\n"
        "w = tf.compat.v1.get_variable('w', [], initializer=tf.compat.v1.ones_initializer())\n"
        "slim_nanguard.create_train_op(w * w, tf.compat.v1.train.GradientDescentOptimizer(0.1))\n"
        "print('root handlers:', len(logging.root.handlers), file=sys.stderr)\n"
        "tf.compat.v1.logging.warning('a line of the user script')\n"
        "logging.basicConfig(format='USER %(levelname)s %(message)s')\n"
        "logging.getLogger('user').warning('set up by the user')\n"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("root handlers: 0") == 2, proc.stderr
    assert proc.stderr.count("a line of the user script") == 1, proc.stderr
    assert "USER WARNING set up by the user" in proc.stderr


def test_the_launchers_library_leaves_pythons_logging_to_the_user(tmp_path):
    """A script of the user's that trains and evaluates through the launcher's library half
    (`slim_nanguard.app`, which logs as it goes) outside absl's app.run: no handler is put on
    Python's root logger, so the user's basicConfig still takes effect."""
    proc = _python(
        "import logging, sys\n"
        "from slim_nanguard import app\n"
        f"config = app.TrainConfig.from_flags(train_dir={str(tmp_path / 'run')!r},\n"
        "    dataset_name='synthetic', batch_size=8, max_number_of_steps=3,\n"
        "    log_every_n_steps=0, save_summaries_steps=0, save_summaries_secs=0)\n"
        "app.run_training(config)\n"
        f"app.run_eval(app.EvalConfig(checkpoint_path={str(tmp_path / 'run')!r},\n"
        "    dataset_name='synthetic', batch_size=8))\n"
        "print('root handlers:', len(logging.root.handlers), file=sys.stderr)\n"
        "logging.basicConfig(format='USER %(levelname)s %(message)s')\n"
        "logging.getLogger('user').warning('set up by the user')\n"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "root handlers: 0" in proc.stderr, proc.stderr[-3000:]
    assert "USER WARNING set up by the user" in proc.stderr


# ---------------------------------------------------------------------------------------------
# Giving up after the policy was applied: the chained cause says that it was.


def _assert_told_the_policy_was_applied(error: BaseException) -> None:
    cause = error.__cause__
    assert slim_nanguard.is_numerics_error(cause), repr(cause)
    assert "caught this error and applied the policy" in cause.message
    told = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    assert "nothing applied" not in told, told
    assert "If this error reached you" not in told


def test_tf_slim_learning_train_with_train_step_that_raises_says_the_policy_was_applied(
    tmp_path,
):
    """The migrated loop of the README (train_step_fn=slim_nanguard.train_step) applies
    nan_policy='raise' at batch 3; the error it raises does not say that nothing applied it."""
    model = lib.build_model(nan_policy="raise", faults={BAD_BATCH: "nan_loss"})
    with model.graph.as_default(), pytest.raises(slim_nanguard.NanLossError) as raised:
        slim.learning.train(
            model.train_op,
            str(tmp_path),
            train_step_fn=slim_nanguard.train_step,
            number_of_steps=STEPS,
            save_summaries_secs=None,
            save_interval_secs=None,
        )
    _assert_told_the_policy_was_applied(raised.value)


def test_train_giving_up_after_max_rollbacks_says_the_policy_was_applied(tmp_path):
    """Every batch from 2 on is bad; slim_nanguard.train rolls back once, then gives up."""
    model = lib.build_model(
        nan_policy="rollback",
        max_rollbacks=1,
        rollback_skip_batches=0,
        faults={i: "nan_loss" for i in range(2, 40)},
    )
    with model.graph.as_default(), pytest.raises(slim_nanguard.NanLossError) as raised:
        slim_nanguard.train(
            model.train_op,
            str(tmp_path),
            number_of_steps=STEPS,
            save_checkpoint_steps=1,
            log_every_n_steps=0,
        )
    assert raised.value.cause is slim_nanguard.Cause.MAX_ROLLBACKS
    _assert_told_the_policy_was_applied(raised.value)


def test_an_uncaught_check_still_names_what_to_add():
    """No loop applies the policy: the check's own error says which loops apply it (what to
    add), in words that are true too when a loop caught it (TensorFlow logs the message of
    every failing run, caught or not)."""
    model = lib.build_model(nan_policy="skip")
    with model.graph.as_default(), tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        with pytest.raises(tf.errors.InvalidArgumentError) as raised:
            sess.run(model.train_op, model.feed(0, "nan_loss"))
    message = raised.value.message
    assert "slim_nanguard rejected the step: NaN or Inf in the loss or a gradient" in message
    assert "A loop applies nan_policy=skip when it catches this error" in message
    assert "not applied" not in message and "nothing applied" not in message
    assert "train_step_fn=slim_nanguard.train_step" in message
    assert slim_nanguard.is_numerics_error(raised.value)


# ---------------------------------------------------------------------------------------------
# A loss-only NanLossHook refuses at once what it cannot do.


@pytest.mark.parametrize("policy", ["skip", "rollback"])
def test_a_loss_only_hook_refuses_a_policy_it_cannot_carry_out(tmp_path, policy):
    """tf-slim's own train op updates before any hook sees the loss: nothing to skip or undo."""
    model = lib.build_model(train_op_fn=slim.learning.create_train_op, check_numerics=False)
    with pytest.raises(ValueError) as refused:
        slim_nanguard.NanLossHook(model.loss, nan_policy=policy, checkpoint_dir=str(tmp_path))
    message = str(refused.value)
    assert f"nan_policy={policy!r}" in message and "no guarded train op" in message
    assert "slim_nanguard.create_train_op" in message
    assert "hooks=[slim_nanguard.nan_hook(train_op)]" in message


def test_the_loss_only_forms_of_nan_tensor_hook_still_work():
    """The upstream forms (fail_on_nan_loss, raise, stop) on an unguarded loss, and skip on a
    guarded one, are built as before."""
    unguarded = lib.build_model(train_op_fn=slim.learning.create_train_op, check_numerics=False)
    for kwargs in (
        {},
        {"fail_on_nan_loss": False},
        {"nan_policy": "raise"},
        {"nan_policy": "stop"},
    ):
        slim_nanguard.NanLossHook(unguarded.loss, **kwargs)
    guarded = lib.build_model(check_numerics=False, nan_policy="raise")
    hook = slim_nanguard.NanLossHook(guarded.loss, nan_policy="skip")
    with guarded.graph.as_default():
        hook.begin()
    assert hook.guard is slim_nanguard.get_guard(guarded.train_op)


# ---------------------------------------------------------------------------------------------
# A bad step's line says which value was bad.


@pytest.mark.parametrize(
    "fault, policy, opening",
    [
        ("nan_loss", "skip", "Model diverged with loss = NaN."),
        ("inf_loss", "skip", "Model diverged with loss = Inf."),
        ("nan_gradient", "skip", "Model diverged with non-finite gradients; the loss is finite."),
        ("nan_gradient", "raise", "Model diverged with non-finite gradients; the loss is finite."),
    ],
)
@lib.each_mode
def test_a_bad_steps_line_says_which_value_was_bad(mode, fault, policy, opening):
    """Batch 3 is bad. Its one line goes through tf_logging.warning (skip) or .error (raise),
    the names NanTensorHook calls and alerting patches, and opens with what was bad: "loss =
    NaN" only for a NaN loss; a finite loss is called finite, the gradients named."""
    model = lib.build_model(
        check_numerics=lib.MODES[mode], nan_policy=policy, faults={BAD_BATCH: fault}
    )
    hooks = [slim_nanguard.nan_hook(model.train_op)] if mode == "hook" else []
    called = "error" if policy == "raise" else "warning"
    with mock.patch.object(tf_logging, called, autospec=True) as log:
        lib.run_monitored(
            model.train_op,
            hooks=hooks,
            last_step=STEPS,
            handle_numerics_errors=True,
            catch_nan_error=True,
        )
    lines = [call.args[0] % call.args[1:] for call in log.call_args_list]
    (line,) = [line for line in lines if "slim_nanguard: bad step" in line]
    assert line.startswith(opening), line
    assert ("loss = NaN" in line) == (fault == "nan_loss"), line
    if fault == "nan_gradient":
        assert "non-finite gradients of logits/weights" in line


@pytest.mark.parametrize(
    "loss, kind, said",
    [
        (float("nan"), "nan", "global step 5, loss NaN, gradients finite,"),
        (float("inf"), "inf", "global step 5, loss +Inf, gradients finite,"),
        (float("-inf"), "inf", "global step 5, loss -Inf, gradients finite,"),
        (6.5, "finite", "global step 5, loss 6.5 (finite), no culprit known,"),
    ],
)
def test_a_bad_steps_line_names_its_loss_in_one_word(loss, kind, said):
    """Not ``loss nan (nan)``: the value once, as the autopsy writes it (NaN, +Inf, -Inf)."""
    event = slim_nanguard.NanEvent(
        step=5, loss=loss, loss_kind=kind, culprits=(), consecutive=1, total=1, mode="hook"
    )
    assert said in event.describe(), event.describe()


def test_a_run_that_trained_no_step_says_its_final_loss_is_none(tmp_path):
    """Not ``final loss nan``, which grep and alerting on "nan" take for a bad run: none, and
    null in the record's stop event."""
    model = lib.build_model(nan_policy="skip")
    with model.graph.as_default():
        result = slim_nanguard.train(
            model.train_op, str(tmp_path), number_of_steps=0, log_every_n_steps=0
        )
    assert (result.steps, result.global_step) == (0, 0)
    assert "; final loss none (no step trained); 0 good steps," in result.describe()
    assert not re.search(r"\bnan\b", result.describe(), re.I), result.describe()
    (stop,) = [r for r in slim_nanguard.read_events(str(tmp_path)) if r["kind"] == "stop"]
    assert "final_loss" in stop and stop["final_loss"] is None, stop


def test_evals_model_mismatch_says_which_shape_and_model_is_the_checkpoints(tmp_path):
    """``here: lenet on 28x28x1`` read as what the checkpoint holds: the sentence names the
    checkpoint's shapes and what this evaluation asked for, each as such."""
    from slim_nanguard import app  # pylint: disable=import-outside-toplevel

    train_dir = str(tmp_path / "lenet")
    app.run_training(
        app.TrainConfig.from_flags(
            train_dir=train_dir,
            model_name="lenet",
            dataset_name="synthetic",
            max_number_of_steps=1,
            log_every_n_steps=0,
            save_summaries_steps=0,
            save_summaries_secs=0,
        )
    )
    config = app.EvalConfig(
        checkpoint_path=train_dir, dataset_name="synthetic", model_name="lenet", eval_image_size=14
    )
    with pytest.raises(app.LaunchError) as raised:
        app.run_eval(config)
    assert str(raised.value).endswith(
        "does not match the model: LeNet/fc3/weights is [3136, 1024] in the checkpoint but "
        "[1024, 1024] in the model. Evaluate with the --model_name, dataset and image size the "
        "checkpoint was trained with; this evaluation asked for lenet on 14x14x1 synthetic "
        "images with 10 classes."
    ), raised.value


def test_guard_state_in_a_check_numerics_loop_of_ones_own_is_as_of_the_last_bad_step():
    """What GuardState's docstring says of a loop that only calls handle_numerics_error: the
    guard sees its bad steps alone, so ``steps`` stays 0 and the run of bad steps is the one
    of ``last_bad_step``; the next bad step, the global step having moved, starts a new run."""
    model = lib.build_model(nan_policy="skip", faults={3: "nan_loss", 20: "nan_loss"})
    guard = slim_nanguard.get_guard(model.train_op)
    with model.graph.as_default(), tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        seen = []
        for _ in range(30):
            try:
                sess.run(model.train_op)
            except tf.errors.InvalidArgumentError as err:
                slim_nanguard.handle_numerics_error(sess, err)
                seen.append((guard.state.last_bad_step, guard.state.consecutive_bad_steps))
        global_step = sess.run(model.global_step)
    assert seen == [(3, 1), (19, 1)]  # batch 20 is trained at global step 19 (3 was skipped)
    assert global_step == 28
    state = guard.state
    assert (state.steps, state.total_bad_steps, state.skips) == (0, 2, 2)
    assert (state.consecutive_bad_steps, state.last_bad_step) == (1, 19)
    assert "there ``steps`` stays 0" in type(state).__doc__
