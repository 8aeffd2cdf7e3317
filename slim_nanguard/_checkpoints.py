"""Checkpoints that are known to be readable and finite.

`FiniteSaver` refuses to write a checkpoint that holds NaN or Inf (`finite_saver` puts the same
check in front of a user's own `Saver`); `latest_good_checkpoint`
finds the newest checkpoint of a directory that can be read, falling back past a corrupt one
(or past a damaged ``checkpoint`` state file, by listing the directory) with a warning;
`non_finite_variables` says which values of a checkpoint are not finite. A checkpoint whose
files are missing, cut short or garbled is told from any other failure in one place
(`unreadable`), and reported as an `UnreadableCheckpointError` naming the file.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import os
import re
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf

from slim_nanguard import _errors
from slim_nanguard import _log as logging
from slim_nanguard import _paths
from slim_nanguard import _verdict

# The state file a `Saver` writes next to its checkpoints: the latest one, and those kept.
STATE_FILENAME = "checkpoint"

# The checkpoints read lately: path -> (the size and mtime of each of its files, the names of
# its non-finite tensors, or the error that says it cannot be read). A rollback walks back over
# the same few checkpoints again and again, and a run's start reads its newest ones several
# times (the launcher, `train`, the session's init_fn): a damaged one is read, and reported,
# once. A file rewritten since (any shard, not just the index) changes the key: read anew.
_Verdict = Union[Tuple[str, ...], _errors.UnreadableCheckpointError]
_VERIFIED: "collections.OrderedDict[str, Tuple[tuple, _Verdict]]" = collections.OrderedDict()
_VERIFIED_MAX = 32

# What TensorFlow raises on a checkpoint whose files are missing, cut short or garbled
# (tests/test_damaged_checkpoints.py damages real ones): its reader raises an `OpError` of code
# UNKNOWN (a garbled or cut index, a data shard whose checksum fails), `NotFoundError` (no
# index) or a bare `IndexError` (a data shard cut short); a `Saver`'s restore raises
# `DataLossError` or `OutOfRangeError`. Other errors (permissions, an unreachable file system)
# say nothing about the files and are not called damage.
_DAMAGE_ERRORS = (
    IndexError,
    tf.errors.DataLossError,
    tf.errors.OutOfRangeError,
    tf.errors.NotFoundError,
)


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

    Every tensor is read (an integer one too), so a checkpoint this accepts can be restored.

    Args:
      checkpoint_path: A checkpoint prefix (as ``tf.train.latest_checkpoint`` returns).

    Returns:
      The names, sorted; empty when every value is finite.

    Raises:
      UnreadableCheckpointError: A file of the checkpoint is missing, cut short or garbled.
    """
    verdict, _ = _check(checkpoint_path)
    if isinstance(verdict, _errors.UnreadableCheckpointError):
        raise copy.copy(verdict) from None  # A fresh one: no traceback of an earlier raise.
    return verdict


def _check(checkpoint_path: str) -> Tuple[_Verdict, bool]:
    """`non_finite_variables`' verdict on a checkpoint (an error when it cannot be read), and
    whether it was read just now (False: the files are unchanged since a read, see _VERIFIED).
    """
    key = _files_key(checkpoint_path)
    cached = _VERIFIED.get(checkpoint_path)
    if cached is not None and cached[0] == key:
        _VERIFIED.move_to_end(checkpoint_path)
        return cached[1], False
    try:
        verdict: _Verdict = _non_finite(checkpoint_path)
    except _errors.UnreadableCheckpointError as err:
        verdict = err
    _VERIFIED[checkpoint_path] = (key, verdict)
    _VERIFIED.move_to_end(checkpoint_path)
    while len(_VERIFIED) > _VERIFIED_MAX:
        _VERIFIED.popitem(last=False)
    return verdict, True


def _non_finite(checkpoint_path: str) -> Tuple[str, ...]:
    """Reads every tensor of a checkpoint; the names of the floating-point ones not finite."""
    reader = checkpoint_reader(checkpoint_path)
    bad = []
    for name, dtype in sorted(reader.get_variable_to_dtype_map().items()):
        with _damage_named(checkpoint_path, data=True):
            value = reader.get_tensor(name)
        if dtype.is_floating and not np.all(np.isfinite(value)):
            bad.append(name)
    return tuple(bad)


@contextlib.contextmanager
def _damage_named(checkpoint_path: str, *, data: bool = False) -> Iterator[None]:
    """Raises what reading `checkpoint_path` raised in the block as the
    `UnreadableCheckpointError` naming the file, when `unreadable` calls it damage."""
    try:
        yield
    except _DAMAGE_ERRORS + (tf.errors.OpError,) as err:
        damage = unreadable(checkpoint_path, err, data=data)
        if damage is None:
            raise
        raise damage from err


def unreadable(
    checkpoint_path: str, error: BaseException, *, data: bool = False
) -> Optional[_errors.UnreadableCheckpointError]:
    """What `error`, raised reading or restoring `checkpoint_path`, says about its files.

    The one place that tells a damaged checkpoint from any other failure.

    Args:
      checkpoint_path: The checkpoint prefix.
      error: What TensorFlow's reader (or a `Saver`'s restore) raised.
      data: The error came reading a tensor (a ``.data`` shard), not opening the checkpoint.

    Returns:
      The error naming the damaged file, or None when `error` is not one a missing, cut or
      garbled file raises (a permission, a file system that cannot be reached).
    """
    reader_error = type(error) is tf.errors.OpError and error.error_code == tf.errors.UNKNOWN
    if not (isinstance(error, _DAMAGE_ERRORS) or reader_error):
        return None
    cause = _errors.op_error_cause(error)
    index = checkpoint_path + ".index"
    shards = sorted(tf.io.gfile.glob(checkpoint_path + ".data-*"))
    if not tf.io.gfile.exists(index):
        return _errors.UnreadableCheckpointError(checkpoint_path, index, "is missing", cause)
    if not shards:
        return _errors.UnreadableCheckpointError(
            checkpoint_path, checkpoint_path + ".data-*", "is missing", cause
        )
    file = index
    if data or "TensorBundle at" in cause:
        shard = re.search(r"shard (\d+)", cause)
        named = [f for f in shards if shard and f"data-{int(shard.group(1)):05d}-of-" in f]
        file = (named or shards)[0]
        if len(shards) > 1 and not named:
            file = checkpoint_path + ".data-* (one of its shards)"
    return _errors.UnreadableCheckpointError(
        checkpoint_path, file, "is cut short or garbled", cause
    )


def checkpoint_reader(path: str) -> Any:
    """`tf.train.load_checkpoint`, except that a checkpoint prefix is always read as one.

    TensorFlow's takes a path that is a directory for a training directory and reads its
    latest checkpoint; some file systems (the in-process ``ram://``) call any prefix of a file
    name a directory, which would send a checkpoint prefix down that road.

    Returns:
      TensorFlow's checkpoint reader (``get_tensor``, ``get_variable_to_shape_map``, ...).

    Raises:
      UnreadableCheckpointError: The checkpoint's index is missing, cut short or garbled.
      ValueError: `path` is a directory that holds no checkpoint.
    """
    with _damage_named(path):
        if tf.io.gfile.isdir(path) and tf.io.gfile.exists(path + ".index"):
            return tf.compat.v1.train.NewCheckpointReader(path)
        return tf.train.load_checkpoint(path)


def checkpoint_step(checkpoint_path: str) -> Optional[int]:
    """The global step a checkpoint was saved at, from its name (``model.ckpt-1200``)."""
    match = re.search(r"-(\d+)$", checkpoint_path)
    return int(match.group(1)) if match else None


def latest_good_checkpoint(
    checkpoint_dir: Optional[str],
    *,
    before_step: Optional[int] = None,
    repair_state: bool = False,
) -> Optional[str]:
    """The newest checkpoint in `checkpoint_dir` that can be read, or None if there is none.

    A newer checkpoint that cannot be read (a file missing, cut short or garbled) is passed
    over with one warning naming the file and the checkpoint used instead; asked again while
    its files are unchanged (a run's start asks several times, a rollback walks back), it is
    passed over without another. A ``checkpoint`` state file that cannot be parsed is passed
    over too: the checkpoints (``<name>-<step>`` of the newest name) are found by listing the
    directory, with a warning saying so.

    Args:
      checkpoint_dir: The directory (may be None or missing: no checkpoint).
      before_step: Only consider checkpoints saved at a global step below this one (their
        names end in ``-<step>``).
      repair_state: Rewrite a damaged state file to name the checkpoints found. Only the run
        that trains in `checkpoint_dir` should (`train` does): its `Saver` is the file's
        writer, and a reader beside it (an evaluation) must not race it.

    Returns:
      The checkpoint prefix, or None when the directory holds no checkpoint at all.

    Raises:
      NonFiniteCheckpointError: The newest readable checkpoint holds NaN or Inf.
      CheckpointNotFoundError: Checkpoints exist but none of them can be read.
    """
    candidates, damaged = _candidates(checkpoint_dir)
    if before_step is not None:
        steps = {path: checkpoint_step(path) for path in candidates}
        candidates = [
            path for path in candidates if steps[path] is not None and steps[path] < before_step
        ]
    if not candidates:
        return None
    failures: List[_errors.UnreadableCheckpointError] = []
    reported = True  # Every damage found was reported before (see _VERIFIED).
    for path in candidates:
        verdict, fresh = _check(path)
        if isinstance(verdict, _errors.UnreadableCheckpointError):
            failures.append(verdict)
            reported = reported and not fresh
            continue
        if verdict:
            raise _errors.NonFiniteCheckpointError(
                f"checkpoint {path} holds NaN or Inf in {', '.join(verdict[:5])}"
                f"{' and more' if len(verdict) > 5 else ''}; refusing to train from it. Delete "
                "it (and its entry in the 'checkpoint' file) to resume from an older one."
            )
        if failures and not reported:
            logging.warning(
                "slim_nanguard: %s; using %s instead. Restore the damaged files from a copy, "
                "or move them out of the directory.",
                "; ".join(f.damage for f in failures),
                path,
            )
        if damaged and before_step is None:
            _report_damaged_state(
                checkpoint_dir, candidates[candidates.index(path) :], repair=repair_state
            )
        return path
    raise _errors.CheckpointNotFoundError(
        f"no checkpoint in {checkpoint_dir} can be read: "
        f"{'; '.join(f.damage for f in failures)}. Restore the damaged files from a "
        "copy, or train in a new directory."
    )


def candidates(checkpoint_dir: Optional[str]) -> List[str]:
    """The checkpoint prefixes of `checkpoint_dir`, newest first (none may be readable)."""
    return _candidates(checkpoint_dir)[0]


def _candidates(checkpoint_dir: Optional[str]) -> Tuple[List[str], bool]:
    """Checkpoint prefixes of a directory, newest first, all inside that directory.

    The ``checkpoint`` state file may hold absolute paths (any `Saver` without
    ``save_relative_paths``), which point into the directory where the run was trained. Each
    is re-rooted into `checkpoint_dir` by its file name, so a training directory that was
    moved or copied reads its own checkpoints, never the ones of the place it came from.

    A state file that cannot be parsed (a crash while it was rewritten garbles, truncates or
    empties it) names nothing: the checkpoints are then found by listing the directory's
    ``*.index`` files, the highest global step first.

    Returns:
      The prefixes, and whether the state file is there but could not be parsed.
    """
    if not checkpoint_dir or not tf.io.gfile.isdir(checkpoint_dir):
        return [], False
    try:
        state = tf.train.get_checkpoint_state(checkpoint_dir)
    except ValueError:  # Empty (it names no checkpoint), or not even text.
        state = None
    if state is None:
        if tf.io.gfile.exists(_state_file(checkpoint_dir)):
            return _listed(checkpoint_dir), True
        return [], False
    paths = list(state.all_model_checkpoint_paths or [])
    if state.model_checkpoint_path and state.model_checkpoint_path not in paths:
        paths.append(state.model_checkpoint_path)
    paths = [_paths.join(checkpoint_dir, _paths.basename(p)) for p in paths]
    return list(reversed(paths)), False


def _state_file(checkpoint_dir: str) -> str:
    """The path of the ``checkpoint`` state file of `checkpoint_dir`."""
    return _paths.join(checkpoint_dir, STATE_FILENAME)


def _listed(checkpoint_dir: str) -> List[str]:
    """The checkpoints of a directory that a `Saver` wrote, by its ``*.index`` files: those
    named ``<name>-<step>`` for the name of the highest global step, highest step first.

    Other checkpoints in the directory (a ``pretrained.ckpt`` kept beside the run) are not the
    run's: a state file that named them would hand them to the run's `Saver`, which deletes
    the oldest it manages past ``max_to_keep``. Only when no checkpoint has a step are the
    others listed (by name), so that such a directory still has something to read.
    """
    prefixes = [
        _paths.join(checkpoint_dir, name[: -len(".index")])
        for name in tf.io.gfile.listdir(checkpoint_dir)
        if name.endswith(".index")
    ]
    stepped = [p for p in prefixes if checkpoint_step(p) is not None]
    if not stepped:
        return sorted(prefixes, reverse=True)
    stepped.sort(key=lambda p: (checkpoint_step(p), p), reverse=True)
    stem = _stem(stepped[0])
    return [p for p in stepped if _stem(p) == stem]


def _stem(path: str) -> str:
    """``model.ckpt`` of ``.../model.ckpt-1200``."""
    return re.sub(r"-\d+$", "", _paths.basename(path))


def _report_damaged_state(checkpoint_dir: str, found: List[str], *, repair: bool) -> None:
    """Says in one warning line that the state file cannot be parsed and which checkpoint was
    found instead; with `repair`, rewrites it to name `found` (newest first).

    The file holds names relative to the directory, as `FiniteSaver` writes it. A state file
    that cannot be rewritten (a read-only directory) is left as it is: the next call lists
    the directory again. Neither is one whose newest checkpoint has no step (its `Saver`
    would manage, and delete, a checkpoint that is not its own).
    """
    path = _state_file(checkpoint_dir)
    # update_checkpoint_state keeps the paths it is given when the directory is an absolute
    # local one, and makes them relative to any other (a URL too): names in the one case,
    # paths in the other, so that either way the file holds names only.
    local = not _paths.is_url(checkpoint_dir) and os.path.isabs(checkpoint_dir)
    names = [_paths.basename(p) if local else p for p in reversed(found)]
    if not repair or checkpoint_step(found[0]) is None:
        done = "left the state file as it is"
    else:
        try:
            tf.compat.v1.train.update_checkpoint_state(
                checkpoint_dir, names[-1], all_model_checkpoint_paths=names
            )
            done = "and rewrote the state file to name it"
        except (OSError, tf.errors.OpError) as err:
            done = f"but could not rewrite the state file ({_short(err)})"
    logging.warning(
        "slim_nanguard: the checkpoint state file %s cannot be parsed (garbled, cut short or "
        "empty); found the checkpoints by listing the directory: using %s, %s.",
        path,
        found[0],
        done,
    )


def latest_checkpoint(checkpoint_dir: Optional[str]) -> Optional[str]:
    """`tf.train.latest_checkpoint`, re-rooted into `checkpoint_dir` (see `_candidates`).

    Unlike TensorFlow's, it finds the checkpoint of a training directory that was moved
    (whose ``checkpoint`` file names the old place) and of one that was copied (whose file
    names the source, which must not be read), and of one whose state file is damaged (by
    listing the directory, with a warning; a reader leaves the file to the run that trains
    there). Returns None when there is none.
    """
    candidates, damaged = _candidates(checkpoint_dir)
    for number, path in enumerate(candidates):
        if tf.io.gfile.exists(path + ".index") or tf.io.gfile.exists(path):
            if damaged:
                _report_damaged_state(checkpoint_dir, candidates[number:], repair=False)
            return path
    return None


def _short(err: BaseException) -> str:
    text = getattr(err, "message", None) or str(err)
    return text.strip().splitlines()[0][:200] if text.strip() else type(err).__name__


class FinitenessTest:
    """Which of some variables hold NaN or Inf, and which of the two: exact, cheap when all is
    finite.

    One sum per variable is the fast test (a finite sum proves a variable finite); a variable
    whose sum is not finite (the sum may have overflowed over finite weights: LeNet at a
    learning rate of 1e36 leaves weights of 5e36) is then tested element by element, alone.
    Build it before the graph is finalized; `non_finite` runs it.

    Attributes:
      names: The op names of the floating-point variables tested, in order.
    """

    def __init__(self, variables: Sequence[tf.Variable]):
        variables = [v for v in variables if v.dtype.base_dtype.is_floating]
        self.names = [v.op.name for v in variables]
        if not variables:
            self._fast, self._kinds = None, []
            return
        # One reduction per variable; the element-wise tests are built now and run only for
        # the variables whose sum is not finite.
        self._fast = tf.math.is_finite(tf.stack([_wide_sum(v) for v in variables]))
        self._kinds = [_verdict.kind_code(v) for v in variables]

    def non_finite(self, sess: tf.compat.v1.Session) -> List[Tuple[str, str]]:
        """``(name, kind)`` of each variable that holds NaN or Inf now (kinds as
        `_verdict.kind_name` gives them: ``"nan"``, ``"inf"`` or ``"nan_and_inf"``)."""
        if self._fast is None:
            return []
        flagged = [i for i, ok in enumerate(sess.run(self._fast)) if not ok]
        if not flagged:
            return []
        codes = sess.run([self._kinds[i] for i in flagged])
        kinds = [(self.names[i], _verdict.kind_name(c)) for i, c in zip(flagged, codes)]
        return [(name, kind) for name, kind in kinds if kind != _verdict.FINITE]


def _wide_sum(variable: tf.Variable) -> tf.Tensor:
    """The sum of a variable as float64; a half-precision one is summed in float32, so that
    finite float16 weights (max 65504) rarely overflow their own sum and send the test to
    the element-wise branch."""
    if variable.dtype.base_dtype in (tf.float16, tf.bfloat16):
        return tf.cast(tf.reduce_sum(tf.cast(variable, tf.float32)), tf.float64)
    return tf.cast(tf.reduce_sum(variable), tf.float64)


class _FinitenessCheck:
    """The check `FiniteSaver` and `finite_saver` put in front of ``save``.

    Attributes:
      refused_saves: Saves refused so far because a value was not finite.
    """

    def _build_check(self, variables: Sequence[tf.Variable]) -> None:
        with tf.name_scope("nanguard_finite_saver"):
            self._test = FinitenessTest(variables)
        self.refused_saves = 0

    def non_finite(self, sess: tf.compat.v1.Session) -> List[str]:
        """Names of the saved variables that hold NaN or Inf now."""
        return [name for name, _ in self._test.non_finite(sess)]

    def _refuse(
        self, sess: tf.compat.v1.Session, save_path: str, global_step: Union[int, tf.Tensor, None]
    ) -> bool:
        """True (after counting and logging it) if no save may happen now: a value is not
        finite."""
        bad = self._test.non_finite(sess)
        if not bad:
            return False
        self.refused_saves += 1
        logging.error(
            "slim_nanguard: not saving checkpoint %s (%s): %s. The latest checkpoint stays the "
            "last good one.",
            save_path,
            _step_text(sess, global_step),
            _verdict.describe(bad),
        )
        return True


def _step_text(sess: tf.compat.v1.Session, global_step: Union[int, tf.Tensor, None]) -> str:
    """``"step 1200"``: the step a save was asked for (a tensor or variable is read)."""
    if global_step is None:
        return "no global step given"
    if hasattr(global_step, "dtype"):
        try:
            global_step = tf.compat.v1.train.global_step(sess, global_step)
        except (tf.errors.OpError, TypeError, ValueError) as err:
            return f"step unknown: {_short(err)}"
    return f"step {global_step}"


class ResumingSaver(tf.compat.v1.train.Saver):
    """A `Saver` that also restores a checkpoint written without the guard's optional variables.

    The guard makes some variables only with some options (`GraphHandles.optional_variables`:
    the spike statistics with a spike policy, the learning-rate scale with
    ``rollback_lr_factor`` < 1), so a job checkpointed without those options and resumed with
    them meets a checkpoint that lacks them. `restore` then restores every other variable,
    restores the optional ones the checkpoint has, starts those it lacks from their initial
    values (the spike statistics warm up afresh) and says so in one log line. A checkpoint that
    lacks any other variable fails the restore as TensorFlow's `Saver` does.

    What it restores with is built with the saver (at ``build``, for ``defer_build=True``), and
    only when the graph holds a guarded train op with optional variables that this saver saves:
    build it after `create_train_op`. Otherwise it is TensorFlow's `Saver`, op for op.

    Args:
      *args: As `tf.compat.v1.train.Saver`.
      **kwargs: As `tf.compat.v1.train.Saver`.
    """

    def build(self) -> None:
        """As `tf.compat.v1.train.Saver.build`, and the restore of a checkpoint without the
        guard's optional variables (once)."""
        super().build()
        if not hasattr(self, "_resume"):
            self._resume = _OptionalRestore.build(self._var_list, self._sharded)

    def save(self, sess: tf.compat.v1.Session, save_path: str, *args, **kwargs) -> Optional[str]:
        """As `tf.compat.v1.train.Saver.save`; a deferred saver is built first if it can be."""
        self._built_for(sess.graph)
        return super().save(sess, save_path, *args, **kwargs)

    def _built_for(self, graph: tf.Graph) -> None:
        """Builds a deferred saver that nothing built (a `Supervisor` does not, unlike a
        `Scaffold`), or says what to do when its graph is finalized already."""
        if getattr(self, "_is_built", True) or tf.executing_eagerly():
            return
        if not graph.finalized:
            with graph.as_default():
                self.build()
            return
        raise RuntimeError(
            "slim_nanguard: the graph's default saver (the resuming saver create_train_op "
            "registers for a Scaffold) was never built, and the graph is finalized; pass "
            "saver=slim_nanguard.FiniteSaver() to tf.compat.v1.train.Supervisor."
        )

    def restore(self, sess: tf.compat.v1.Session, save_path: Optional[str]) -> None:
        """As `tf.compat.v1.train.Saver.restore`, except that the guard's optional variables
        may be missing from the checkpoint (see the class docstring)."""
        self._built_for(sess.graph)
        resume = getattr(self, "_resume", None)
        if resume is None or not resume.restore_without_missing(sess, save_path):
            super().restore(sess, save_path)


class _OptionalRestore:
    """The ops that restore a checkpoint lacking some of the guard's optional variables: a
    `Saver` of every other variable, and for each optional variable a placeholder and an
    assign op that set it from the checkpoint's value.

    Args:
      rest: The `Saver` of the variables that are not optional.
      optional: ``(variable, name in the checkpoint, placeholder, assign op)`` of each
        optional variable.
    """

    def __init__(self, rest: tf.compat.v1.train.Saver, optional: List[Tuple[Any, str, Any, Any]]):
        self._rest, self._optional = rest, optional

    @classmethod
    def build(cls, var_list: Any, sharded: bool) -> Optional["_OptionalRestore"]:
        """The ops for a `Saver` of `var_list` (what it saves, after its build), or None when
        it saves none of the optional variables of the default graph's guards."""
        from slim_nanguard import _guard  # Local: the guard's module needs this one.

        optional = {id(v): v for guard in _guard.guards() for v in guard.handles.optional_variables}
        if isinstance(var_list, dict):
            rest = {name: v for name, v in var_list.items() if id(v) not in optional}
            named = [(v, name) for name, v in var_list.items() if id(v) in optional]
        else:
            rest = [v for v in var_list or () if id(v) not in optional]
            named = [(v, v.op.name) for v in var_list or () if id(v) in optional]
        if not named:
            return None
        setters = []
        with tf.name_scope("nanguard_resume"):
            for variable, name in named:
                value = tf.compat.v1.placeholder(variable.dtype.base_dtype, variable.shape)
                setters.append((variable, name, value, tf.compat.v1.assign(variable, value).op))
            rest = tf.compat.v1.train.Saver(
                rest, sharded=sharded, allow_empty=True, name="without_optional"
            )
        return cls(rest, setters)

    def restore_without_missing(self, sess: tf.compat.v1.Session, save_path: Optional[str]) -> bool:
        """Restores `save_path` if it lacks an optional variable (and logs which); returns
        False, having done nothing, when it lacks none or cannot be read (the `Saver`'s own
        restore then reports it)."""
        if save_path is None:
            return False
        try:
            reader = checkpoint_reader(save_path)
        except Exception:  # pylint: disable=broad-except
            return False
        missing = [s for s in self._optional if not reader.has_tensor(s[1])]
        if not missing:
            return False
        names = [name for _, name, _, _ in missing]
        warm_up = any(name.endswith(("/history", "/count")) for name in names)
        logging.info(
            "slim_nanguard: %s was written without %s (guard options turned on since, or a "
            "release that had no such variable); restoring the rest, these start from their "
            "initial values%s.",
            save_path,
            ", ".join(names),
            " (the spike statistics warm up afresh)" if warm_up else "",
        )
        self._rest.restore(sess, save_path)
        for variable, name, value, assign in self._optional:
            if reader.has_tensor(name):
                sess.run(assign, {value: reader.get_tensor(name)})
            else:
                sess.run(variable.initializer)
        return True


class FiniteSaver(_FinitenessCheck, ResumingSaver):
    """A `Saver` that refuses to write a checkpoint holding NaN or Inf.

    Before each save it runs one fused finiteness test over the variables it saves (one
    reduction per variable, at save time only). If a value is not finite the save is skipped
    with an error in the log and `save` returns None, so the latest checkpoint on disk stays
    the last good one. Use it as ``Scaffold(saver=FiniteSaver())`` or
    ``tf_slim.learning.train(..., saver=FiniteSaver())``. Made after `create_train_op`, it
    also restores a checkpoint written without the guard's optional variables
    (`ResumingSaver`).

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
