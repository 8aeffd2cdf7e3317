"""Checkpoints that are known to be readable and finite.

`FiniteSaver` refuses to write a checkpoint that holds NaN or Inf (`finite_saver` puts the same
check in front of a user's own `Saver`); `latest_good_checkpoint`
finds the newest checkpoint of a directory that can be read, falling back past a corrupt one
with a warning; `non_finite_variables` says which values of a checkpoint are not finite.
"""

from __future__ import annotations

import collections
import os
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf

from slim_nanguard import _errors
from slim_nanguard import _log as logging

# The checkpoints read lately: path -> (the size and mtime of each of its files, the names of
# its non-finite tensors). A rollback walks back over the same few checkpoints again and again;
# a file rewritten since (any shard, not just the index) changes the key, so it is read anew.
_VERIFIED: "collections.OrderedDict[str, Tuple[tuple, Tuple[str, ...]]]" = collections.OrderedDict()
_VERIFIED_MAX = 32


def _files_key(checkpoint_path: str) -> tuple:
    """The name, size and mtime of every file of a checkpoint: its index and data shards.

    Through `tf.io.gfile`, so that a checkpoint on a remote file system (``gs://``) has a key
    that changes when its files do.
    """
    files = [
        checkpoint_path + ".index",
        *sorted(tf.io.gfile.glob(checkpoint_path + ".data-*")),
    ]
    key = []
    for name in files:
        try:
            stat = tf.io.gfile.stat(name)
        except tf.errors.OpError:
            key.append((name, None, None))
        else:
            key.append((name, stat.length, stat.mtime_nsec))
    return tuple(key)


def non_finite_variables(checkpoint_path: str) -> Tuple[str, ...]:
    """Names of the floating-point tensors of a checkpoint that hold NaN or Inf.

    Args:
      checkpoint_path: A checkpoint prefix (as ``tf.train.latest_checkpoint`` returns).

    Returns:
      The names, sorted; empty when every value is finite.

    Raises:
      Exception: The checkpoint cannot be read (missing or corrupt); TensorFlow's reader
        raises `tf.errors.OpError`, `ValueError` or `IndexError` depending on the damage.
    """
    key = _files_key(checkpoint_path)
    cached = _VERIFIED.get(checkpoint_path)
    if cached is not None and cached[0] == key:
        _VERIFIED.move_to_end(checkpoint_path)
        return cached[1]
    reader = tf.train.load_checkpoint(checkpoint_path)
    bad = []
    for name, dtype in sorted(reader.get_variable_to_dtype_map().items()):
        if not dtype.is_floating:
            continue
        value = reader.get_tensor(name)
        if not np.all(np.isfinite(value)):
            bad.append(name)
    _VERIFIED[checkpoint_path] = (key, tuple(bad))
    _VERIFIED.move_to_end(checkpoint_path)
    while len(_VERIFIED) > _VERIFIED_MAX:
        _VERIFIED.popitem(last=False)
    return tuple(bad)


def checkpoint_step(checkpoint_path: str) -> Optional[int]:
    """The global step a checkpoint was saved at, from its name (``model.ckpt-1200``)."""
    match = re.search(r"-(\d+)$", checkpoint_path)
    return int(match.group(1)) if match else None


def latest_good_checkpoint(
    checkpoint_dir: Optional[str], *, before_step: Optional[int] = None
) -> Optional[str]:
    """The newest checkpoint in `checkpoint_dir` that can be read, or None if there is none.

    A newer checkpoint that cannot be read is passed over with a warning naming it and the one
    used instead.

    Args:
      checkpoint_dir: The directory (may be None or missing: no checkpoint).
      before_step: Only consider checkpoints saved at a global step below this one (their
        names end in ``-<step>``).

    Returns:
      The checkpoint prefix, or None when the directory holds no checkpoint at all.

    Raises:
      NonFiniteCheckpointError: The newest readable checkpoint holds NaN or Inf.
      CheckpointNotFoundError: Checkpoints exist but none of them can be read.
    """
    candidates = _candidates(checkpoint_dir)
    if before_step is not None:
        steps = {path: checkpoint_step(path) for path in candidates}
        candidates = [
            path for path in candidates if steps[path] is not None and steps[path] < before_step
        ]
    if not candidates:
        return None
    failures: List[str] = []
    for path in candidates:
        try:
            bad = non_finite_variables(path)
        except Exception as err:  # pylint: disable=broad-except
            # The reader fails in many ways on a broken file (OpError, IndexError on a
            # truncated shard, DataLossError, ...): any of them means "cannot be read".
            failures.append(f"{path} ({_short(err)})")
            continue
        if bad:
            raise _errors.NonFiniteCheckpointError(
                f"checkpoint {path} holds NaN or Inf in {', '.join(bad[:5])}"
                f"{' and more' if len(bad) > 5 else ''}; refusing to train from it. Delete it "
                "(and its entry in the 'checkpoint' file) to resume from an older one."
            )
        if failures:
            logging.warning(
                "slim_nanguard: checkpoint %s cannot be read; using %s instead.",
                ", ".join(failures),
                path,
            )
        return path
    raise _errors.CheckpointNotFoundError(
        f"no checkpoint in {checkpoint_dir} can be read: {'; '.join(failures)}. Remove the "
        "broken files or train in a new directory."
    )


def _candidates(checkpoint_dir: Optional[str]) -> List[str]:
    """Checkpoint prefixes of a directory, newest first, all inside that directory.

    The ``checkpoint`` state file may hold absolute paths (any `Saver` without
    ``save_relative_paths``), which point into the directory where the run was trained. Each
    is re-rooted into `checkpoint_dir` by its file name, so a training directory that was
    moved or copied reads its own checkpoints, never the ones of the place it came from.
    """
    if not checkpoint_dir or not os.path.isdir(checkpoint_dir):
        return []
    state = tf.train.get_checkpoint_state(checkpoint_dir)
    paths: List[str] = []
    if state is not None:
        paths = list(state.all_model_checkpoint_paths or [])
        if state.model_checkpoint_path and state.model_checkpoint_path not in paths:
            paths.append(state.model_checkpoint_path)
        paths = [os.path.join(checkpoint_dir, os.path.basename(p)) for p in paths]
    return list(reversed(paths))


def latest_checkpoint(checkpoint_dir: Optional[str]) -> Optional[str]:
    """`tf.train.latest_checkpoint`, re-rooted into `checkpoint_dir` (see `_candidates`).

    Unlike TensorFlow's, it finds the checkpoint of a training directory that was moved
    (whose ``checkpoint`` file names the old place) and of one that was copied (whose file
    names the source, which must not be read). Returns None when there is none.
    """
    for path in _candidates(checkpoint_dir):
        if tf.io.gfile.exists(path + ".index") or tf.io.gfile.exists(path):
            return path
    return None


def _short(err: BaseException) -> str:
    text = getattr(err, "message", None) or str(err)
    return text.strip().splitlines()[0][:200] if text.strip() else type(err).__name__


def finite_flags(variables: Sequence[tf.Variable]) -> Tuple[tf.Tensor, List[str]]:
    """One op that tells, for each floating-point variable, whether all its values are finite.

    Returns:
      A bool vector (one reduction per variable, no element-wise temporaries) and the
      variable names in the same order.
    """
    variables = [v for v in variables if v.dtype.base_dtype.is_floating]
    names = [v.op.name for v in variables]
    if not variables:
        return tf.constant([], tf.bool), names
    sums = tf.stack([tf.cast(tf.reduce_sum(v), tf.float64) for v in variables])
    return tf.math.is_finite(sums), names


class _FinitenessCheck:
    """The check `FiniteSaver` and `finite_saver` put in front of ``save``.

    Attributes:
      refused_saves: Saves refused so far because a value was not finite.
    """

    def _build_check(self, variables: Sequence[tf.Variable]) -> None:
        with tf.name_scope("nanguard_finite_saver"):
            self._finite_flags, self._checked_names = finite_flags(variables)
        self.refused_saves = 0

    def non_finite(self, sess: tf.compat.v1.Session) -> List[str]:
        """Names of the saved variables that hold NaN or Inf now."""
        flags = sess.run(self._finite_flags)
        return [name for name, ok in zip(self._checked_names, flags) if not ok]

    def _refuse(
        self, sess: tf.compat.v1.Session, save_path: str, global_step: Union[int, tf.Tensor, None]
    ) -> bool:
        """True (after counting and logging it) if no save may happen now: a value is not
        finite."""
        bad = self.non_finite(sess)
        if not bad:
            return False
        self.refused_saves += 1
        logging.error(
            "slim_nanguard: not saving checkpoint %s (step %s): %s hold NaN or Inf. The "
            "latest checkpoint stays the last good one.",
            save_path,
            global_step if not hasattr(global_step, "dtype") else "current",
            ", ".join(bad[:5]),
        )
        return True


class FiniteSaver(_FinitenessCheck, tf.compat.v1.train.Saver):
    """A `Saver` that refuses to write a checkpoint holding NaN or Inf.

    Before each save it runs one fused finiteness test over the variables it saves (one
    reduction per variable, at save time only). If a value is not finite the save is skipped
    with an error in the log and `save` returns None, so the latest checkpoint on disk stays
    the last good one. Use it as ``Scaffold(saver=FiniteSaver())`` or
    ``tf_slim.learning.train(..., saver=FiniteSaver())``.

    Args:
      *args: As `tf.compat.v1.train.Saver`.
      **kwargs: As `tf.compat.v1.train.Saver`.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._build_check(_saved_variables(self._var_list))

    def save(
        self,
        sess: tf.compat.v1.Session,
        save_path: str,
        global_step: Union[int, tf.Tensor, None] = None,
        *args,
        **kwargs,
    ) -> Optional[str]:
        if self._refuse(sess, save_path, global_step):
            return None
        return super().save(sess, save_path, global_step, *args, **kwargs)


def _saved_variables(var_list: Union[Sequence, Dict[str, Any], None]) -> List[tf.Variable]:
    """The variables a `Saver` built with `var_list` saves (None: all global variables)."""
    if var_list is None:
        return tf.compat.v1.global_variables()
    if isinstance(var_list, dict):
        return [v for v in var_list.values() if isinstance(v, tf.Variable)]
    return [v for v in var_list if isinstance(v, tf.Variable)]


class _FiniteSaving(_FinitenessCheck):
    """A user's `Saver` with `FiniteSaver`'s check in front of `save`.

    Everything else (``restore``, ``saver_def``, ``last_checkpoints``, ``build``, ...) is the
    user's saver's own, so its variable list, sharding, file names and ``max_to_keep`` all
    hold. Made by `finite_saver`.

    Attributes:
      saver: The user's saver.
      refused_saves: Saves refused so far because a value was not finite.
    """

    def __init__(self, saver: tf.compat.v1.train.Saver):
        self.saver = saver
        self._build_check(_saved_variables(saver._var_list))  # pylint: disable=protected-access

    def __getattr__(self, name: str) -> Any:
        return getattr(self.saver, name)

    def save(
        self,
        sess: tf.compat.v1.Session,
        save_path: str,
        global_step: Union[int, tf.Tensor, None] = None,
        *args,
        **kwargs,
    ) -> Optional[str]:
        """As the user's saver's ``save``, except that it refuses a non-finite value."""
        if self._refuse(sess, save_path, global_step):
            return None
        return self.saver.save(sess, save_path, global_step, *args, **kwargs)


def finite_saver(saver: Optional[Any]) -> Optional[Any]:
    """`saver`, made to refuse a checkpoint that holds NaN or Inf, as `FiniteSaver` does.

    A `FiniteSaver` comes back as it is, and so does anything that is not a
    `tf.compat.v1.train.Saver` (a `tf.train.Checkpoint`, which `Scaffold` converts itself). Any
    other `Saver` comes back wrapped: the same saver, with the finiteness check over the
    variables it saves in front of each ``save``. Call it before the graph is finalized (it adds
    the check's ops).

    Args:
      saver: A `tf.compat.v1.train.Saver` (or None, or a `tf.train.Checkpoint`).

    Returns:
      The saver to save with: `saver` itself, or the user's saver behind the check.
    """
    if isinstance(saver, (FiniteSaver, _FiniteSaving)) or not isinstance(
        saver, tf.compat.v1.train.Saver
    ):
        return saver
    return _FiniteSaving(saver)
