"""Checkpoint verification: what `non_finite_variables` remembers, and when it reads again."""

import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

import slim_nanguard
from slim_nanguard import _checkpoints


def _save(directory, values, step):
    """Saves one variable `w` holding `values` as ``directory/model.ckpt-step``."""
    with tf.Graph().as_default():
        w = tf.compat.v1.get_variable("w", initializer=np.asarray(values, np.float32))
        saver = tf.compat.v1.train.Saver([w])
        with tf.compat.v1.Session() as sess:
            sess.run(w.initializer)
            return saver.save(sess, os.path.join(directory, "model.ckpt"), global_step=step)


def test_a_data_shard_rewritten_after_a_check_is_read_again(tmp_path, monkeypatch):
    """A finite checkpoint is verified; then its data shard is overwritten by a NaN one.

    The index file is untouched, so a cache keyed on it alone would still answer "finite".
    """
    good = _save(str(tmp_path), [1.0, 2.0], step=1)
    bad = _save(str(tmp_path), [np.nan, 2.0], step=2)
    assert slim_nanguard.non_finite_variables(good) == ()
    assert slim_nanguard.non_finite_variables(bad) == ("w",)

    index_stat = os.stat(good + ".index")
    (shard,) = [n for n in os.listdir(tmp_path) if n.startswith("model.ckpt-1.data-")]
    (bad_shard,) = [n for n in os.listdir(tmp_path) if n.startswith("model.ckpt-2.data-")]
    shutil.copyfile(tmp_path / bad_shard, tmp_path / shard)
    os.utime(tmp_path / shard, ns=(index_stat.st_mtime_ns + 10**9,) * 2)
    assert os.stat(good + ".index").st_mtime_ns == index_stat.st_mtime_ns

    # Read again: the NaN is found, or the reader's checksum refuses the shard (the documented
    # error naming the shard). Either way the checkpoint is no longer reported finite.
    reads = []
    real = tf.train.load_checkpoint
    monkeypatch.setattr(tf.train, "load_checkpoint", lambda p: reads.append(p) or real(p))
    try:
        found = slim_nanguard.non_finite_variables(good)
    except slim_nanguard.UnreadableCheckpointError as err:
        assert err.file == str(tmp_path / shard)
        found = "unreadable"
    assert reads == [good]
    assert found in (("w",), "unreadable")


def test_an_unchanged_checkpoint_is_not_read_twice(tmp_path, monkeypatch):
    path = _save(str(tmp_path), [1.0], step=1)
    assert slim_nanguard.non_finite_variables(path) == ()
    reads = []
    real = tf.train.load_checkpoint
    monkeypatch.setattr(tf.train, "load_checkpoint", lambda p: reads.append(p) or real(p))
    assert slim_nanguard.non_finite_variables(path) == ()
    assert reads == []


def test_the_cache_stays_bounded_on_a_long_run(tmp_path, monkeypatch):
    """Many checkpoints verified over a long run: only the latest few are remembered."""
    monkeypatch.setattr(_checkpoints, "_VERIFIED_MAX", 3)
    paths = [_save(str(tmp_path), [float(step)], step=step) for step in range(1, 7)]
    for path in paths:
        assert slim_nanguard.non_finite_variables(path) == ()
    assert list(_checkpoints._VERIFIED)[-3:] == paths[-3:]
    assert len(_checkpoints._VERIFIED) <= 3


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
    monkeypatch.setattr(_checkpoints, "_VERIFIED", type(_checkpoints._VERIFIED)())


def test_the_savers_and_the_start_up_check_share_one_finiteness_test(tmp_path):
    """`train` builds a FiniteSaver and a start-up check of the same variables: the graph
    holds their test once, one op a variable, and the save still refuses NaN."""
    graph = tf.Graph()
    with graph.as_default():
        w = tf.compat.v1.get_variable("w", initializer=tf.ones([3]), use_resource=True)
        tf.compat.v1.train.get_or_create_global_step()
        saver = slim_nanguard.FiniteSaver()
        users = _checkpoints.finite_saver(tf.compat.v1.train.Saver())
        test = _checkpoints.finiteness_test(tf.compat.v1.global_variables())
        scopes = {op.name.split("/")[0] for op in graph.get_operations()}
        assert "nanguard_finite" in scopes and "nanguard_finite_1" not in scopes
        assert sum(op.type == "L2Loss" for op in graph.get_operations()) == 1  # w only
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            assert test.non_finite(sess) == []
            sess.run(w.assign([1.0, np.nan, 2.0]))
            assert test.non_finite(sess) == [("w", "nan")]
            assert saver.save(sess, str(tmp_path / "model.ckpt")) is None
            assert users.save(sess, str(tmp_path / "model.ckpt")) is None
