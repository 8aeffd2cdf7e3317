"""Fine-tuning as tf-slim users do it: an ``init_fn`` from a checkpoint written without the guard.

With a spike policy or ``rollback_lr_factor`` below 1 the guard adds global variables
(``nanguard/learning_rate_scale``, ``nanguard_spike/history`` ...). tf-slim's
``get_variables_to_restore()`` lists every global variable, so an ``init_fn`` built after
``create_train_op`` asks the checkpoint for them; the guide's one-line exclusion,
``get_variables_to_restore(exclude=["nanguard"])``, leaves them out (and built before
``create_train_op`` there is nothing to leave out). The guard's own checkpoints still hold them.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_slim as slim

import slim_nanguard

import nanguard_testlib as lib

GUARD = dict(nan_policy="rollback", spike_policy="skip", rollback_lr_factor=0.5)
GUARD_VARIABLES = {
    "nanguard/learning_rate_scale",
    "nanguard_spike/history",
    "nanguard_spike/count",
    "nanguard_spike/floor",
}


@pytest.fixture(scope="module")
def unguarded_checkpoint(tmp_path_factory):
    """Two steps of the same model and optimizer, trained and saved without the guard."""
    model = lib.build_model(train_op_fn=slim.learning.create_train_op)
    path = str(tmp_path_factory.mktemp("unguarded") / "model.ckpt")
    with model.graph.as_default(), tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(model.train_op)
        sess.run(model.train_op)
        saved = tf.compat.v1.train.Saver().save(sess, path)
    reader = tf.train.load_checkpoint(saved)
    assert not GUARD_VARIABLES & set(reader.get_variable_to_shape_map())
    return saved, {name: reader.get_tensor(name) for name in ("fc1/weights", "global_step")}


def _fine_tune(checkpoint, init_fn_first: bool, exclude):
    """Builds the guarded model with its ``init_fn`` made before or after ``create_train_op``,
    runs the init_fn and one guarded step; returns the restored values, the variables the
    init_fn restored, and the variables a default Saver of the graph saves."""
    built = {}

    def train_op_fn(loss, optimizer, **kwargs):
        if init_fn_first:
            built["vars"] = slim.get_variables_to_restore(exclude=exclude)
        train_op = slim_nanguard.create_train_op(loss, optimizer, **kwargs)
        if not init_fn_first:
            built["vars"] = slim.get_variables_to_restore(exclude=exclude)
        built["init_fn"] = slim.assign_from_checkpoint_fn(checkpoint, built["vars"])
        return train_op

    model = lib.build_model(train_op_fn=train_op_fn, **GUARD)
    with model.graph.as_default(), tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        built["init_fn"](sess)
        weights, step = sess.run(
            [tf.compat.v1.trainable_variables("fc1")[0], tf.compat.v1.train.get_global_step()]
        )
        sess.run(model.train_op)
        saved = {v.op.name for v in tf.compat.v1.global_variables()}
    return weights, step, {v.op.name for v in built["vars"]}, saved


@pytest.mark.parametrize("init_fn_first", [True, False], ids=["init_fn_first", "init_fn_after"])
def test_an_init_fn_from_a_checkpoint_without_the_guard_restores_the_model(
    unguarded_checkpoint, init_fn_first
):
    checkpoint, values = unguarded_checkpoint
    weights, step, restored, saved = _fine_tune(checkpoint, init_fn_first, exclude=["nanguard"])
    np.testing.assert_array_equal(weights, values["fc1/weights"])
    # Built first, the init_fn has no global step to restore (create_train_op makes it).
    assert step == (0 if init_fn_first else values["global_step"])
    assert not restored & GUARD_VARIABLES
    assert GUARD_VARIABLES <= saved  # the guard's own checkpoints keep its state


def test_the_exclusion_leaves_out_the_guards_variables_only(unguarded_checkpoint):
    """Without it, an init_fn built after create_train_op asks the checkpoint for the guard's
    variables (tf-slim's Saver then fails); with it, only they are left out."""
    checkpoint, _ = unguarded_checkpoint
    with pytest.raises((tf.errors.NotFoundError, ValueError)):
        _fine_tune(checkpoint, init_fn_first=False, exclude=None)
    _, _, restored, saved = _fine_tune(checkpoint, init_fn_first=False, exclude=["nanguard"])
    assert saved - restored == GUARD_VARIABLES
