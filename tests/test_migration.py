"""The one-line migration, as a TF-Slim user meets it, in a fresh process.

A script that imports slim_nanguard and changes only the ``create_train_op`` line must, in
each loop (tf_slim.learning.train, tf_slim.training.train, its own MonitoredTrainingSession),
either apply the policy or fail at its first bad step with an error naming the one thing to
add; never skip a bad step unseen. The process is fresh so that nothing but
``import slim_nanguard`` has installed the compatibility layer that ``slim.batch_norm`` needs.
One subprocess runs every scenario and reports what happened as JSON.
"""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

REPO = pathlib.Path(__file__).resolve().parents[1]

_SCRIPT = textwrap.dedent(r"""
    import json, os, sys, tempfile
    import numpy as np
    import tensorflow as tf
    tf.compat.v1.disable_v2_behavior()
    import tf_slim as slim

    import slim_nanguard  # the only addition to the user's script, with create_train_op below

    BAD = 3  # the batch whose loss is NaN
    STEPS = 6
    report = {"compat_attribute": hasattr(slim_nanguard, "compat")}
    slim_nanguard.compat.install()  # as the README writes it; already done by the import

    def build(check_numerics, policy, **kwargs):
        graph = tf.Graph()
        with graph.as_default():
            tf.compat.v1.set_random_seed(0)
            index = tf.compat.v1.data.make_one_shot_iterator(
                tf.data.Dataset.range(10000)).get_next()
            x = tf.random.stateless_normal([8, 4], seed=tf.stack([index, 0]))
            y = tf.cast(x[:, 0] > 0, tf.int64)
            net = slim.fully_connected(x, 8, normalizer_fn=slim.batch_norm,
                                       normalizer_params={"is_training": True})
            logits = slim.fully_connected(net, 2, activation_fn=None)
            loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(y, logits)
            loss += tf.where(tf.equal(index, BAD), np.float32(np.nan), np.float32(0))
            train_op = slim_nanguard.create_train_op(
                loss, tf.compat.v1.train.GradientDescentOptimizer(0.1),
                check_numerics=check_numerics, nan_policy=policy, **kwargs)
        return graph, train_op, slim_nanguard.get_guard(train_op)

    def outcome(name, fn, guard):
        try:
            fn()
            result = {"error": None}
        except Exception as err:  # pylint: disable=broad-except
            text = getattr(err, "message", None) or str(err)
            # A graph error's cause comes after the stack where the op was defined.
            result = {"error": type(err).__name__, "message": text[max(text.find("Node:"), 0):]}
        result.update(bad_steps=guard.state.total_bad_steps, skips=guard.state.skips,
                      rollbacks=guard.state.rollbacks)
        report[name] = result

    def latest_step(logdir):
        path = tf.train.latest_checkpoint(logdir)
        return None if path is None else int(tf.train.load_checkpoint(path).get_tensor(
            "global_step"))

    def learning_train(check_numerics, policy, step_fn=None, loop=None, **kwargs):
        graph, train_op, guard = build(check_numerics, policy, **kwargs)
        logdir = tempfile.mkdtemp()
        extra = {} if step_fn is None else {"train_step_fn": step_fn}
        extra.update(loop or {})
        def run():
            with graph.as_default():
                slim.learning.train(train_op, logdir, number_of_steps=STEPS,
                                    save_summaries_secs=None, save_interval_secs=None,
                                    **extra)
        return guard, run, logdir

    # tf_slim.learning.train, only create_train_op changed: fails at the bad step.
    for mode, check in (("check_numerics", True), ("hook", False)):
        guard, run, _ = learning_train(check, "skip")
        outcome(f"learning_plain_{mode}", run, guard)
        # With train_step_fn=slim_nanguard.train_step: the policy applies, in both modes.
        guard, run, logdir = learning_train(check, "skip", slim_nanguard.train_step)
        outcome(f"learning_train_step_{mode}", run, guard)
        report[f"learning_train_step_{mode}"]["step"] = latest_step(logdir)

    # tf_slim.training.train in hook mode: without the hook it fails, with it the policy runs.
    for with_hook in (False, True):
        graph, train_op, guard = build(False, "raise")
        def run():
            with graph.as_default():
                hooks = [tf.compat.v1.train.StopAtStepHook(last_step=STEPS)]
                if with_hook:
                    hooks.append(slim_nanguard.nan_hook(train_op))
                slim.training.train(train_op, tempfile.mkdtemp(), hooks=hooks,
                                    save_checkpoint_secs=None, save_summaries_steps=None)
        outcome(f"training_{'hook' if with_hook else 'plain'}", run, guard)

    # A hand-written MonitoredTrainingSession loop, check_numerics mode, without handling.
    graph, train_op, guard = build(True, "skip")
    def run():
        with graph.as_default(), tf.compat.v1.train.MonitoredTrainingSession(
                log_step_count_steps=None) as sess:
            for _ in range(STEPS):
                sess.run(train_op)
    outcome("monitored_plain_check_numerics", run, guard)

    # Rollback without a checkpoint directory: refused as early as the loop can tell.
    try:
        slim_nanguard.make_train_step(None)
        report["make_train_step_none"] = None
    except ValueError as err:
        report["make_train_step_none"] = str(err)
    graph, train_op, guard = build(False, "rollback")
    try:
        slim_nanguard.nan_hook(train_op)
        report["nan_hook_no_dir"] = None
    except ValueError as err:
        report["nan_hook_no_dir"] = str(err)
    # learning.train without a summary writer: train_step cannot find its logdir.
    guard, run, logdir = learning_train(True, "skip", slim_nanguard.train_step,
                                        loop={"summary_writer": None},
                                        persistent_nan_policy="rollback")
    outcome("learning_rollback_no_dir", run, guard)
    report["learning_rollback_no_dir"]["step"] = latest_step(logdir)
    graph, train_op, guard = build(True, "rollback")
    def run():
        with graph.as_default(), tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for _ in range(STEPS):
                try:
                    sess.run(train_op)
                except tf.errors.InvalidArgumentError as err:
                    slim_nanguard.handle_numerics_error(sess, err)
    outcome("handle_rollback_no_dir", run, guard)
    # A MonitoredTrainingSession that saves checkpoints: handle_numerics_error finds them.
    graph, train_op, guard = build(True, "rollback")
    def run():
        with graph.as_default(), tf.compat.v1.train.MonitoredTrainingSession(
                checkpoint_dir=tempfile.mkdtemp(), save_checkpoint_steps=1,
                save_summaries_steps=None, log_step_count_steps=None) as sess:
            for _ in range(STEPS):
                try:
                    sess.run(train_op)
                except tf.errors.InvalidArgumentError as err:
                    slim_nanguard.handle_numerics_error(sess, err)
    outcome("handle_rollback_monitored", run, guard)
    print("REPORT", json.dumps(report))
""")


def test_each_loop_applies_the_policy_or_fails_naming_what_to_add():
    env = dict(
        os.environ,
        TF_CPP_MIN_LOG_LEVEL="3",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    )
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.split("REPORT", 1)[1])
    # `import slim_nanguard` made slim.batch_norm work and slim_nanguard.compat reachable.
    assert report["compat_attribute"] is True

    # tf_slim.learning.train with only create_train_op changed: the bad step fails, with a
    # message that names the train_step_fn to add; in hook mode no bad step passes unseen.
    check = report["learning_plain_check_numerics"]
    assert check["error"] == "InvalidArgumentError"
    assert "A loop applies nan_policy=skip when it catches this error" in check["message"]
    assert "train_step_fn=slim_nanguard.train_step" in check["message"]
    assert (
        "tf_slim.training.train in hook mode (check_numerics=False, "
        "hooks=[slim_nanguard.nan_hook(train_op)])" in check["message"]
    )
    hook = report["learning_plain_hook"]
    assert hook["error"] == "InvalidArgumentError"
    assert "no NanLossHook saw it, so nan_policy=skip was not applied" in hook["message"]
    assert "hooks=[slim_nanguard.nan_hook(train_op)]" in hook["message"]
    assert "train_step_fn=slim_nanguard.train_step" in hook["message"]
    # With train_step_fn=slim_nanguard.train_step the policy applies in both modes.
    for mode in ("check_numerics", "hook"):
        result = report[f"learning_train_step_{mode}"]
        assert (result["error"], result["bad_steps"], result["skips"]) == (None, 1, 1), result
        assert result["step"] == 6

    # tf_slim.training.train, hook mode: without the hook the bad step fails naming it; with
    # it, the policy (raise) applies.
    plain = report["training_plain"]
    assert plain["error"] == "InvalidArgumentError" and plain["bad_steps"] == 0
    assert "hooks=[slim_nanguard.nan_hook(train_op)]" in plain["message"]
    hooked = report["training_hook"]
    assert (hooked["error"], hooked["bad_steps"]) == ("NanLossError", 1)

    # Own MonitoredTrainingSession loop in check_numerics mode that does not handle the error.
    own = report["monitored_plain_check_numerics"]
    assert own["error"] == "InvalidArgumentError"
    assert "slim_nanguard.handle_numerics_error(sess, err)" in own["message"]

    # Rollback with no checkpoint directory: refused at once where the loop can tell.
    assert "make_train_step needs the directory" in report["make_train_step_none"]
    assert "nan_hook(train_op, checkpoint_dir=...)" in report["nan_hook_no_dir"]
    learning = report["learning_rollback_no_dir"]
    assert learning["error"] == "ValueError" and learning["bad_steps"] == 0
    assert "train_step_fn=slim_nanguard.make_train_step(logdir)" in learning["message"]
    assert learning["step"] is None  # refused at the first step: nothing trained or saved
    handled = report["handle_rollback_no_dir"]
    assert handled["error"] == "ValueError" and handled["bad_steps"] == 0
    assert "handle_numerics_error(..., checkpoint_dir=...)" in handled["message"]
    monitored = report["handle_rollback_monitored"]
    assert (monitored["error"], monitored["bad_steps"], monitored["rollbacks"]) == (None, 1, 1)
