"""Checkpoints known to be readable and finite: `FiniteSaver` (and `finite_saver`, for a user's
own `Saver`) never writes NaN or Inf; `latest_good_checkpoint` passes over a damaged checkpoint
or state file with a warning; `non_finite_variables` names a checkpoint's non-finite tensors;
`unreadable` alone tells a damaged checkpoint from any other failure.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import os
import re
import weakref
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf

from slim_nanguard import _errors
from slim_nanguard import _exact_sums
from slim_nanguard import _log as logging
from slim_nanguard import _paths

# The state file a `Saver` writes next to its checkpoints: the latest one, and those kept.
STATE_FILENAME = "checkpoint"

# The checkpoints read lately: path -> (`_files_key`, verdict). A checkpoint is read, and its
# damage reported, once while its files are unchanged (a run's start and a rollback ask often).
_Verdict = Union[Tuple[str, ...], _errors.UnreadableCheckpointError]
_VERIFIED: "collections.OrderedDict[str, Tuple[tuple, _Verdict]]" = collections.OrderedDict()
_VERIFIED_MAX = 32

_Step = Union[int, tf.Tensor, None]  # The global step a save is asked for.

# What TensorFlow raises on a checkpoint whose files are missing, cut short or garbled
# (tests/test_damaged_checkpoints.py), besides the reader's `OpError` of code UNKNOWN. Other
# errors (permissions, an unreachable file system) are not damage.
_DAMAGE_ERRORS = (
    IndexError,
    tf.errors.DataLossError,
    tf.errors.OutOfRangeError,
    tf.errors.NotFoundError,
)


def _shards(checkpoint_path: str) -> List[str]:
    return sorted(tf.io.gfile.glob(checkpoint_path + ".data-*"))


def _files_key(checkpoint_path: str) -> tuple:
    """The name, size and mtime of every file of a checkpoint, local or remote."""
    key = []
    for name in [checkpoint_path + ".index", *_shards(checkpoint_path)]:
        try:
            stat = tf.io.gfile.stat(name)
            key.append((name, stat.length, stat.mtime_nsec))
        except tf.errors.OpError:
            key.append((name, None, None))
    return tuple(key)


def non_finite_variables(checkpoint_path: str) -> Tuple[str, ...]:
    """The sorted names of the floating-point tensors of a checkpoint (a prefix, or a
    directory: its latest checkpoint) that hold NaN or Inf; empty when all are finite.

    Every tensor is read, so a checkpoint this accepts can be restored.

    Raises:
      UnreadableCheckpointError: A file of the checkpoint is missing, cut short or garbled.
    """
    verdict, _ = _check(_prefix_of(checkpoint_path))
    if isinstance(verdict, _errors.UnreadableCheckpointError):
        raise copy.copy(verdict) from None  # A fresh one: no traceback of an earlier raise.
    return verdict


def _check(checkpoint_path: str) -> Tuple[_Verdict, bool]:
    """`non_finite_variables`' verdict (the error when unreadable), and whether it was read
    now rather than taken from `_VERIFIED`."""
    key = _files_key(checkpoint_path)
    cached = _VERIFIED.pop(checkpoint_path, None)  # Put back last: the most recently used.
    if cached is not None and cached[0] == key:
        _VERIFIED[checkpoint_path] = cached
        return cached[1], False
    try:
        reader = checkpoint_reader(checkpoint_path)
        bad = []
        for name, dtype in sorted(reader.get_variable_to_dtype_map().items()):
            with _damage_named(checkpoint_path, data=True):
                value = reader.get_tensor(name)
            if dtype.is_floating and not np.all(np.isfinite(value)):
                bad.append(name)
        verdict: _Verdict = tuple(bad)
    except _errors.UnreadableCheckpointError as err:
        verdict = err
    _VERIFIED[checkpoint_path] = (key, verdict)
    while len(_VERIFIED) > _VERIFIED_MAX:
        _VERIFIED.popitem(last=False)
    return verdict, True


@contextlib.contextmanager
def _damage_named(checkpoint_path: str, *, data: bool = False) -> Iterator[None]:
    """Re-raises damage (`unreadable`) raised in the block as its `UnreadableCheckpointError`."""
    try:
        yield
    except (IndexError, tf.errors.OpError) as err:
        damage = unreadable(checkpoint_path, err, data=data)
        if damage is None:
            raise
        raise damage from err


def unreadable(
    checkpoint_path: str, error: BaseException, *, data: bool = False
) -> Optional[_errors.UnreadableCheckpointError]:
    """The `UnreadableCheckpointError` naming the damaged file of `checkpoint_path`, or None
    when `error` (raised by its reader, or a `Saver`'s restore; `data`: reading a tensor of a
    ``.data`` shard) is not damage."""
    reader_error = type(error) is tf.errors.OpError and error.error_code == tf.errors.UNKNOWN
    if not (isinstance(error, _DAMAGE_ERRORS) or reader_error):
        return None
    cause = _errors.op_error_cause(error)
    index = checkpoint_path + ".index"
    shards = _shards(checkpoint_path)
    file, problem = index, "is cut short or garbled"
    if not tf.io.gfile.exists(index):
        problem = "is missing"
    elif not shards:
        file, problem = checkpoint_path + ".data-*", "is missing"
    elif data or "TensorBundle at" in cause:
        shard = re.search(r"shard (\d+)", cause)
        named = [f for f in shards if shard and f"data-{int(shard.group(1)):05d}-of-" in f]
        file = (named or shards)[0]
        if len(shards) > 1 and not named:
            file = checkpoint_path + ".data-* (one of its shards)"
    return _errors.UnreadableCheckpointError(checkpoint_path, file, problem, cause)


def say_restored_without(save_path: str, names: Sequence[str]) -> None:
    """Warns that `save_path` is restored without the guard's variables `names`."""
    warm_up = any(name.endswith(("/history", "/count")) for name in names)
    logging.warning(
        "slim_nanguard: %s was written without %s (guard options turned on since, or a "
        "release that had no such variable); restoring the rest, these start from their "
        "initial values%s.",
        save_path,
        ", ".join(names),
        " (the spike statistics warm up afresh)" if warm_up else "",
    )


def _prefix_of(path: str) -> str:
    """`path`, or the latest checkpoint of the directory `path` (so that an error names that
    checkpoint's files, not the directory's)."""
    if tf.io.gfile.isdir(path) and not tf.io.gfile.exists(path + ".index"):
        return latest_checkpoint(path) or path
    return path


def checkpoint_reader(path: str) -> Any:
    """TensorFlow's checkpoint reader, as `tf.train.load_checkpoint`, except that a checkpoint
    prefix is always read as one (``ram://`` calls any prefix of a file name a directory).

    Raises:
      UnreadableCheckpointError: The checkpoint's index is missing, cut short or garbled.
      ValueError: `path` is a directory that holds no checkpoint.
    """
    path = _prefix_of(path)
    with _damage_named(path):
        if tf.io.gfile.isdir(path) and tf.io.gfile.exists(path + ".index"):
            return tf.compat.v1.train.NewCheckpointReader(path)
        return tf.train.load_checkpoint(path)


def checkpoint_step(checkpoint_path: str) -> Optional[int]:
    """The global step a checkpoint was saved at, from its name (``model.ckpt-1200``)."""
    match = re.search(r"-(\d+)$", checkpoint_path)
    return int(match.group(1)) if match else None


def latest_good_checkpoint(
    checkpoint_dir: Optional[str], *, before_step: Optional[int] = None, repair_state: bool = False
) -> Optional[str]:
    """The prefix of the newest checkpoint in `checkpoint_dir` that can be read, or None when
    the directory (which may be None or missing) holds no checkpoint at all.

    A newer unreadable checkpoint is passed over with one warning naming the damaged file (no
    second one while its files are unchanged); so is a state file that cannot be parsed (the
    checkpoints are then found by listing the directory).

    Args:
      before_step: Only consider checkpoints saved below this global step (``-<step>`` names).
      repair_state: Rewrite a damaged state file to name the checkpoints found. Only the run
        that trains in `checkpoint_dir` may (its `Saver` writes the file).

    Raises:
      NonFiniteCheckpointError: The newest readable checkpoint holds NaN or Inf.
      CheckpointNotFoundError: Checkpoints exist but none of them can be read.
    """
    found, damaged = candidates(checkpoint_dir)
    if before_step is not None:
        found = [
            p for p in found if (step := checkpoint_step(p)) is not None and step < before_step
        ]
    if not found:
        return None
    failures: List[_errors.UnreadableCheckpointError] = []
    reported = True  # Every damage found was reported before (see _VERIFIED).
    for number, path in enumerate(found):
        verdict, fresh = _check(path)
        if isinstance(verdict, _errors.UnreadableCheckpointError):
            failures.append(verdict)
            reported = reported and not fresh
            continue
        if verdict:
            raise _errors.NonFiniteCheckpointError(
                f"checkpoint {path} holds NaN or Inf in {_exact_sums.listed(verdict)}; refusing "
                "to train from it. Delete it (and its entry in the 'checkpoint' file) to resume "
                "from an older one."
            )
        if failures and not reported:
            logging.warning(
                "slim_nanguard: %s; using %s instead. Restore the damaged files from a copy, "
                "or move them out of the directory.",
                "; ".join(f.damage for f in failures),
                path,
            )
        if damaged and before_step is None:
            _report_damaged_state(checkpoint_dir, found[number:], repair=repair_state)
        return path
    raise _errors.CheckpointNotFoundError(
        f"no checkpoint in {checkpoint_dir} can be read: "
        f"{'; '.join(f.damage for f in failures)}. Restore the damaged files from a "
        "copy, or train in a new directory."
    )


def candidates(checkpoint_dir: Optional[str]) -> Tuple[List[str], bool]:
    """The checkpoint prefixes of a directory, newest first (none may be readable) and
    re-rooted into it by file name (a moved or copied directory reads its own), and whether
    its state file is there but cannot be parsed (the directory is then listed)."""
    if not checkpoint_dir or not tf.io.gfile.isdir(checkpoint_dir):
        return [], False
    try:
        state = tf.train.get_checkpoint_state(checkpoint_dir)
    except ValueError:  # Empty (it names no checkpoint), or not even text.
        state = None
    if state is None:
        damaged = tf.io.gfile.exists(_paths.join(checkpoint_dir, STATE_FILENAME))
        return (_listed(checkpoint_dir) if damaged else []), damaged
    paths = list(state.all_model_checkpoint_paths or [])
    if state.model_checkpoint_path and state.model_checkpoint_path not in paths:
        paths.append(state.model_checkpoint_path)
    return [_paths.join(checkpoint_dir, _paths.basename(p)) for p in reversed(paths)], False


def _listed(checkpoint_dir: str) -> List[str]:
    """The run's checkpoints, by the directory's ``*.index`` files, highest step first: only
    ``<name>-<step>`` of the name of the highest step (a ``pretrained.ckpt`` beside them must
    never reach the run's `Saver`, which deletes past ``max_to_keep``); all, by name, when
    none has a step."""
    prefixes = [
        _paths.join(checkpoint_dir, name[: -len(".index")])
        for name in tf.io.gfile.listdir(checkpoint_dir)
        if name.endswith(".index")
    ]
    stepped = [p for p in prefixes if checkpoint_step(p) is not None]
    if not stepped:
        return sorted(prefixes, reverse=True)
    stepped.sort(key=lambda p: (checkpoint_step(p), p), reverse=True)
    stem = stepped[0].rpartition("-")[0]  # ``.../model.ckpt`` of ``.../model.ckpt-1200``
    return [p for p in stepped if p.rpartition("-")[0] == stem]


def _report_damaged_state(checkpoint_dir: str, found: List[str], *, repair: bool) -> None:
    """Warns that the state file cannot be parsed and names the checkpoint found instead;
    with `repair`, rewrites the file to name `found` unless `found[0]` has no step."""
    # update_checkpoint_state keeps the paths of an absolute local directory and makes those
    # of any other relative: either way the file holds names only.
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
            done = f"but could not rewrite the state file ({_errors.op_error_cause(err)})"
    logging.warning(
        "slim_nanguard: the checkpoint state file %s cannot be parsed (garbled, cut short or "
        "empty); found the checkpoints by listing the directory: using %s, %s.",
        _paths.join(checkpoint_dir, STATE_FILENAME),
        found[0],
        done,
    )


def latest_checkpoint(checkpoint_dir: Optional[str]) -> Optional[str]:
    """`tf.train.latest_checkpoint`, re-rooted into `checkpoint_dir` (`candidates`): a moved
    or copied directory finds its own checkpoint, and a damaged state file is passed over by
    listing the directory, with a warning (the file is not repaired). None when there is none."""
    found, damaged = candidates(checkpoint_dir)
    for number, path in enumerate(found):
        if tf.io.gfile.exists(path + ".index") or tf.io.gfile.exists(path):
            if damaged:
                _report_damaged_state(checkpoint_dir, found[number:], repair=False)
            return path
    return None


class FinitenessTest:
    """Which of some variables hold NaN or Inf, and which: exact. One op a variable in the
    graph (its half sum of squares, tested on the host, is finite only if every element is);
    a variable that fails it, which may be an overflow, is read and tested element-wise.
    Build it before the graph is finalized; `non_finite` tests the floating-point variables."""

    def __init__(self, variables: Sequence[tf.Variable]):
        self.variables = [v for v in variables if v.dtype.base_dtype.is_floating]
        self._squares = [_half_squares(v) for v in self.variables]

    def non_finite(self, sess: tf.compat.v1.Session) -> List[Tuple[str, str]]:
        """``(name, kind)`` of each variable that holds NaN or Inf now (kinds as
        `_exact_sums.kind_names` names them)."""
        if not self.variables:
            return []
        squares = sess.run(self._squares)
        flagged = [v for v, s in zip(self.variables, squares) if not np.isfinite(s)]
        if not flagged:
            return []
        kinds = [(v.op.name, _exact_sums.value_kind(x)) for v, x in zip(flagged, sess.run(flagged))]
        return [(name, kind) for name, kind in kinds if kind != _exact_sums.FINITE]


def _half_squares(variable: tf.Variable) -> tf.Tensor:
    """`variable`'s half sum of squares (half precision's in float32): NaN or Inf if an element
    is (or if it overflows)."""
    if variable.dtype.base_dtype in (tf.float16, tf.bfloat16):
        variable = tf.cast(variable, tf.float32)
    return tf.nn.l2_loss(variable)


def finiteness_test(variables: Sequence[tf.Variable]) -> FinitenessTest:
    """The `FinitenessTest` of `variables` in the default graph, built there once per set of
    variables (under ``nanguard_finite``) and shared by the savers' checks and the loop's
    start-up check. The first call for a set must come before the graph is finalized."""
    # Kept on the graph itself: a table beside it would keep every graph alive (its tests
    # hold the graph's tensors).
    graph = tf.compat.v1.get_default_graph()
    tests = getattr(graph, "_nanguard_finiteness_tests", None)
    if tests is None:
        tests = graph._nanguard_finiteness_tests = {}  # pylint: disable=protected-access
    key = frozenset(v.op.name for v in variables if v.dtype.base_dtype.is_floating)
    if key not in tests:
        with tf.name_scope("nanguard_finite"):
            tests[key] = FinitenessTest(variables)
    return tests[key]


class _FinitenessCheck:
    """The check `FiniteSaver` and `finite_saver` put in front of a saver's ``save``
    (`_unchecked_save`); `refused_saves` counts the saves it refused."""

    def _build_check(self, var_list: Union[Sequence, Dict[str, Any], None]) -> None:
        """Tests the variables a `Saver` of `var_list` saves (None: all global variables)."""
        if var_list is None:
            variables = tf.compat.v1.global_variables()
        else:
            values = var_list.values() if isinstance(var_list, dict) else var_list
            variables = [v for v in values if isinstance(v, tf.Variable)]
        self._test = finiteness_test(variables)
        self.refused_saves = 0

    def save(
        self, sess: tf.compat.v1.Session, save_path: str, global_step: _Step = None, *args, **kwargs
    ) -> Optional[str]:
        """As the saver's ``save``, except that it refuses (None, counted and logged) to write
        a value that is not finite."""
        bad = self._test.non_finite(sess)
        if not bad:
            return self._unchecked_save(sess, save_path, global_step, *args, **kwargs)
        self.refused_saves += 1
        step = "no global step given" if global_step is None else f"step {global_step}"
        if hasattr(global_step, "dtype"):
            try:
                step = f"step {tf.compat.v1.train.global_step(sess, global_step)}"
            except (tf.errors.OpError, TypeError, ValueError) as err:
                step = f"step unknown: {_errors.op_error_cause(err)}"
        logging.error(
            "slim_nanguard: not saving checkpoint %s (%s): %s. The latest checkpoint stays the "
            "last good one.",
            save_path,
            step,
            _exact_sums.describe(bad),
        )
        return None


# Each graph's guards' `GraphHandles.optional_variables` (`create_train_op` adds them).
_OPTIONAL_VARIABLES: "weakref.WeakKeyDictionary[tf.Graph, list]" = weakref.WeakKeyDictionary()


def add_optional_variables(graph: tf.Graph, variables: Sequence[tf.Variable]) -> None:
    """Makes every `ResumingSaver` of `graph` built from now on resume without `variables`."""
    _OPTIONAL_VARIABLES.setdefault(graph, []).extend(variables)


class ResumingSaver(tf.compat.v1.train.Saver):
    """A `Saver` that also restores a checkpoint lacking the guard's optional variables.

    `restore` of a checkpoint without some of `GraphHandles.optional_variables` restores the
    rest, starts those from their initial values and says so in one log line. A checkpoint
    lacking any other variable fails as with TensorFlow's `Saver`. Build it after
    `create_train_op`, with `tf.compat.v1.train.Saver`'s arguments; without optional variables
    it is TensorFlow's `Saver`, op for op.
    """

    def build(self) -> None:
        """As `tf.compat.v1.train.Saver.build`, plus (once) `_optional`: ``(variable, name in
        the checkpoint, placeholder, assign op)`` of each of the default graph's guards'
        optional variables (`add_optional_variables`) it saves, and `_rest`, the `Saver` of
        the others (when any)."""
        super().build()
        if hasattr(self, "_optional"):
            return
        graph = tf.compat.v1.get_default_graph()
        optional = {id(v): v for v in _OPTIONAL_VARIABLES.get(graph, ())}
        var_list = self._var_list
        if isinstance(var_list, dict):
            rest = {name: v for name, v in var_list.items() if id(v) not in optional}
            named = [(v, name) for name, v in var_list.items() if id(v) in optional]
        else:
            rest = [v for v in var_list or () if id(v) not in optional]
            named = [(v, v.op.name) for v in var_list or () if id(v) in optional]
        self._optional = []
        if not named:
            return
        with tf.name_scope("nanguard_resume"):
            for variable, name in named:
                value = tf.compat.v1.placeholder(variable.dtype.base_dtype, variable.shape)
                setter = tf.compat.v1.assign(variable, value).op
                self._optional.append((variable, name, value, setter))
            self._rest = tf.compat.v1.train.Saver(
                rest, sharded=self._sharded, allow_empty=True, name="without_optional"
            )

    def save(self, sess: tf.compat.v1.Session, save_path: str, *args, **kwargs) -> Optional[str]:
        """As `tf.compat.v1.train.Saver.save`; a deferred saver is built first if it can be."""
        self._built_for(sess.graph)
        return super().save(sess, save_path, *args, **kwargs)

    def _built_for(self, graph: tf.Graph) -> None:
        """Builds a deferred saver that nothing built (a `Supervisor` does not); a
        RuntimeError if its graph is finalized."""
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
        """As `tf.compat.v1.train.Saver.restore`; the optional variables may be missing (logged)."""
        self._built_for(sess.graph)
        reader = None
        if getattr(self, "_optional", None) and save_path is not None:
            with contextlib.suppress(Exception):  # Unreadable: TensorFlow's restore says so.
                reader = checkpoint_reader(save_path)
        optional = self._optional if reader is not None else ()
        missing = [name for _, name, _, _ in optional if not reader.has_tensor(name)]
        if not missing:
            super().restore(sess, save_path)
            return
        say_restored_without(save_path, missing)
        self._rest.restore(sess, save_path)
        for variable, name, value, assign in self._optional:
            if name in missing:
                sess.run(variable.initializer)
            else:
                sess.run(assign, {value: reader.get_tensor(name)})


class FiniteSaver(_FinitenessCheck, ResumingSaver):
    """A `Saver` that refuses to write a checkpoint holding NaN or Inf.

    Before each save it tests the variables it saves (`FinitenessTest`). If a value is not
    finite, the save is skipped with an error in the log and `save` returns None: the latest
    checkpoint stays the last good one. Use it as ``Scaffold(saver=FiniteSaver())`` or
    ``tf_slim.learning.train(..., saver=FiniteSaver())``. Made after `create_train_op`, it also
    restores a checkpoint lacking the guard's optional variables (`ResumingSaver`). It takes
    `tf.compat.v1.train.Saver`'s arguments.
    """

    _unchecked_save = ResumingSaver.save

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._build_check(self._var_list)


class _FiniteSaving(_FinitenessCheck):
    """A user's `Saver` (`saver`) with `FiniteSaver`'s check in front of `save`; everything
    else is the user's saver's own. Made by `finite_saver`."""

    def __init__(self, saver: tf.compat.v1.train.Saver):
        self.saver = saver
        self._unchecked_save = saver.save
        self._build_check(saver._var_list)  # pylint: disable=protected-access

    def __getattr__(self, name: str) -> Any:
        return getattr(self.saver, name)


def finite_saver(saver: Optional[Any]) -> Optional[Any]:
    """`saver` behind `FiniteSaver`'s check, when it is a `tf.compat.v1.train.Saver` but not
    a `FiniteSaver`; else `saver` itself (None, or a `tf.train.Checkpoint`). Call it before
    the graph is finalized (it adds the check's ops)."""
    if isinstance(saver, tf.compat.v1.train.Saver) and not isinstance(saver, FiniteSaver):
        return _FiniteSaving(saver)
    return saver
