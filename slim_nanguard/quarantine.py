"""Examples a run will not train on again: the quarantine of ``nan_policy="auto"``.

When the triage of a bad step says ``data`` (the batch without some examples is finite),
``auto`` skips the batch and quarantines those examples: one JSON line each in
``<train_dir>/nanguard_quarantine.jsonl`` (task N > 0 of a cluster:
``nanguard_quarantine.taskN.jsonl``), written through `tf.io.gfile` (``gs://`` works). A line
names the example by its **fingerprint**, a short sha1 of its bytes as the model was fed them
(each batch component the loss reads, in the iterator's order), and says which components were
hashed, the global step, the row in its batch and any scalar integer or string component (an
id, an index) of that row.

An input pipeline leaves the quarantined examples out with `filter_dataset` (tf.data: apply it
to the unbatched examples, after any map and before ``batch``) or `keep` (a predicate: for
``tf.data.Dataset.filter``, or as ``keep_input`` of ``tf.compat.v1.train.maybe_batch`` in a
queue pipeline such as tf-slim's ``DatasetDataProvider``). A pipeline reads the file when it
first runs, and in the same process learns at once what the guard quarantines later, so the
next epoch already goes without it; a resumed run reads it back.

The fingerprint is of the bytes as fed: an example that a random augmentation changes on every
read has no stable fingerprint, so filter such a pipeline before the augmentation with an id of
your own, or fix the example. To read the list: `read`; to edit it, remove lines from the file;
to clear it: `clear`.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from slim_nanguard import _log as logging
from slim_nanguard import _paths
from slim_nanguard import _recorders
from slim_nanguard._triage import Spec
from slim_nanguard._triage import fingerprint
from slim_nanguard._triage import spec_of

FILENAME = "nanguard_quarantine.jsonl"

__all__ = ["read", "keep", "filter_dataset", "clear", "fingerprint", "path"]


def path(directory: str, task: Optional[int] = None) -> str:
    """The quarantine file `task` (None or 0: the only task, or the chief) writes in `directory`."""
    return _paths.join(directory, f"nanguard_quarantine.task{task}.jsonl" if task else FILENAME)


def _files(directory: str) -> List[str]:
    tasks = tf.io.gfile.glob(_paths.join(directory, "nanguard_quarantine.task*.jsonl"))
    return [p for p in [path(directory, None), *sorted(tasks)] if tf.io.gfile.exists(p)]


def read(directory: str) -> List[Dict[str, Any]]:
    """The quarantined examples of the run in `directory` (every task's file), oldest first:
    each line's record (``fingerprint``, ``components``, ``step``, ...). Empty if none; an
    unreadable line (an edit gone wrong, a crash mid-write) is skipped with a warning."""
    records = [r for p in _files(directory) for r in _recorders.read_json_lines(p, _well_formed)]
    return sorted(records, key=lambda r: r.get("time", 0))


def _well_formed(record: Any) -> bool:
    """Whether `record` is a quarantine line the filter can use (a hand edit may break one)."""
    try:
        return (
            isinstance(record["fingerprint"], str)
            and isinstance(record.get("time", 0), (int, float))
            and all(
                isinstance(component["dtype"], str)
                and all(isinstance(d, int) for d in component["shape"])
                for component in record.get("components", ())
            )
        )
    except (KeyError, TypeError):  # Not a dict, or one without those keys.
        return False


def clear(directory: str) -> int:
    """Removes every quarantine file of `directory`; returns how many examples they held.
    Pipelines already running in this process forget them too."""
    held = len(read(directory))
    for file in _files(directory):
        tf.io.gfile.remove(file)
    with _LOCK:
        live = _LIVE.get(_key(directory))
        if live is not None:  # Running filters hold it: empty it where they look.
            live.prints.clear()
    return held


class _Live:
    """The quarantine of one directory as this process's pipelines see it: read from the
    files when first asked for, then told of each example the guard adds."""

    def __init__(self, directory: str):
        self.prints: Dict[Tuple[Spec, ...], set] = {}  # Hashed components' specs: prints.
        records = read(directory)
        for record in records:
            self.note(record)
        if records:
            logging.info(
                "slim_nanguard: %d quarantined example(s) in %s are left out of the input.",
                len(records),
                directory,
            )

    def note(self, record: Mapping[str, Any]) -> None:
        specs = tuple(
            (str(c["dtype"]), tuple(int(d) for d in c["shape"]))
            for c in record.get("components", ())
        )
        self.prints.setdefault(specs, set()).add(str(record["fingerprint"]))

    def holds(self, arrays: Sequence[np.ndarray]) -> bool:
        if not self.prints:
            return False
        specs = tuple(spec_of(a) for a in arrays)
        for hashed, prints in list(self.prints.items()):
            positions = _subsequence(hashed, specs)
            if positions is not None and fingerprint([arrays[i] for i in positions]) in prints:
                return True
        return False


@functools.cache
def _subsequence(wanted: Tuple[Spec, ...], specs: Tuple[Spec, ...]) -> Optional[tuple]:
    """The first positions in `specs` that hold `wanted`, in order, or None."""
    positions, rest = [], iter(enumerate(specs))  # Each search goes on where the last ended.
    for spec in wanted:
        found = next((i for i, s in rest if s == spec), None)
        if found is None:
            return None
        positions.append(found)
    return tuple(positions)


_LOCK = threading.Lock()
_LIVE: Dict[str, _Live] = {}


def _key(directory: str) -> str:
    return _paths.absolute(directory).rstrip("/")


def _live(directory: str, key: Optional[str] = None) -> _Live:
    key = key or _key(directory)
    with _LOCK:
        if key not in _LIVE:
            _LIVE[key] = _Live(directory)
        return _LIVE[key]


def keep(directory: str) -> Callable[..., tf.Tensor]:
    """A predicate over one example (its components as `tf.data.Dataset.filter` passes them,
    or as a list of tensors): a scalar bool tensor, False for an example quarantined in
    `directory`. It reads the files when it first runs, not when built, and sees what the guard
    of this process quarantines afterwards. It runs in Python, once per example: a
    `tf.numpy_function` call and, once anything is quarantined, a sha1 of the example's bytes."""
    key, found = _key(directory), []  # The directory as given now, whatever the cwd later.

    def not_held(*arrays: np.ndarray) -> np.bool_:
        if not found:  # Once: no lock per example.
            found.append(_live(directory, key))
        return np.bool_(not found[0].holds(arrays))

    def predicate(*example: Any) -> tf.Tensor:
        flat = tf.nest.flatten(example)
        kept = tf.numpy_function(not_held, flat, tf.bool, stateful=True, name="not_quarantined")
        kept.set_shape([])
        return kept

    return predicate


def filter_dataset(dataset: tf.data.Dataset, directory: str) -> tf.data.Dataset:
    """`dataset` (of single examples: apply before ``batch``, after any ``map`` that makes what
    the model is fed) without the examples quarantined in `directory`."""
    return dataset.filter(keep(directory))


def add(directory: str, task: Optional[int], step: int, triage: Mapping[str, Any]) -> List[str]:
    """Quarantines the examples of a ``data`` `triage` (`_triage.triage`'s record: its
    ``fingerprints``, ``components`` and ``ids``) found at global `step` by `task` (None: no
    cluster); returns the fingerprints it added, not those already held. Raises what gfile
    raises."""
    live = _live(directory)
    components = list(triage.get("components") or ())
    specs = tuple((str(c["dtype"]), tuple(c["shape"])) for c in components)
    held, ids = set(live.prints.get(specs, ())), triage.get("ids") or {}
    added = []
    for row, print_ in sorted((int(r), p) for r, p in (triage.get("fingerprints") or {}).items()):
        if print_ in held:
            continue
        held.add(print_)
        record = {"fingerprint": print_, "step": int(step), "row": row, "time": time.time()}
        record |= {"components": components, "ids": ids.get(str(row), {})}
        added.append(record | ({"task": task} if task is not None else {}))
    if added:
        lines = [json.dumps(record, sort_keys=True, default=str) for record in added]
        _recorders.append_lines(path(directory, task), *lines)
        for record in added:
            live.note(record)
    return [record["fingerprint"] for record in added]
