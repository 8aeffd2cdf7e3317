"""The run's record of bad steps: a JSON-lines file and TensorBoard scalars.

Each record is one line of ``<logdir>/nanguard_events.jsonl``, written with a single
``write`` of the whole line to a file opened for appending, then flushed and synced. A crash
can at worst leave a partial last line; `read_events` skips it, so earlier lines always read.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Dict, List, Optional

import tensorflow as tf

from slim_nanguard import _log as logging
from slim_nanguard import _paths
from slim_nanguard import _policy

EVENTS_FILENAME = "nanguard_events.jsonl"

# The TensorBoard counters (``nanguard/<name>``) and the `GuardState` count each one reads.
_SCALARS = {
    "bad_steps": "total_bad_steps",
    "skips": "skips",
    "rollbacks": "rollbacks",
    "stops": "stops",
    "loss_scale_overflows": "loss_scale_overflows",  # only in runs that have them
}


class Registry:
    """A guard's listeners, and its own record in `directory` (the autopsy dumps' directory,
    next to the checkpoints) while no listener keeps one: `send` gives each record to both."""

    def __init__(self):
        self.listeners: List[Callable[[Dict[str, Any]], None]] = []
        self.directory: Optional[str] = None
        self._own: Optional[EventRecorder] = None

    def add(self, listener: Callable[[Dict[str, Any]], None], guard) -> None:
        """Adds `listener` (once); an `EventRecorder` follows `guard`'s counts from now on."""
        if listener not in self.listeners:
            self.listeners.append(listener)
        if isinstance(listener, EventRecorder):
            listener.follow(guard)  # Its TensorBoard counters are read from the state.

    def use_directory(self, path: Optional[str], *, replace: bool = False) -> None:
        """Keeps the guard's own record in `path`, if first or `replace`."""
        if path and (replace or self.directory is None):
            self.directory = path
            # The loop's own summary writer (tf-slim's Supervisor) is not ours to share: a
            # second FileWriter on the same directory can open the same events file in the
            # same second and corrupt it. The TensorBoard counters are `train`'s.
            self._own = EventRecorder(path, write_summaries=False)

    def send(self, record: Dict[str, Any]) -> None:
        """Sends one record to every listener, and to the guard's own record unless a listener
        keeps one (one record each)."""
        for listener in list(self.listeners):
            listener(record)
        if self._own is None or any(isinstance(x, EventRecorder) for x in self.listeners):
            return
        try:
            self._own(record)
        except (OSError, tf.errors.OpError) as err:  # A record nobody asked for: no crash.
            logging.warning(
                "slim_nanguard: could not append to %s (%s); training goes on without it",
                self._own.path,
                err,
            )


class EventRecorder:
    """A guard listener (``guard.add_listener(recorder)``) that appends each record to the
    event file of `logdir` and, unless `write_summaries` is False, writes the counters of the
    guards it follows as TensorBoard scalars (`FileWriterCache`'s writer of `logdir`). `task` is
    the task id in a cluster (None: none): each record gets a ``task`` field, and task N > 0
    writes ``nanguard_events.taskN.jsonl``.
    """

    def __init__(self, logdir: str, write_summaries: bool = True, task: Optional[int] = None):
        name = f"nanguard_events.task{task}.jsonl" if task else EVENTS_FILENAME
        self.path = _paths.join(logdir, name)
        self._remote = _paths.is_url(self.path)
        self.task = task
        self._logdir = logdir
        self._write_summaries = write_summaries
        # Each guard (a `Guard`) followed, with its state when this recorder began to follow it.
        self._followed: Dict[Any, _policy.GuardState] = {}

    def follow(self, guard) -> None:
        """Counts `guard`'s bad steps, skips, rollbacks and stops from now on."""
        self._followed.setdefault(guard, guard.state)

    def __call__(self, record: Dict[str, Any]) -> None:
        record = dict(record)
        record.setdefault("time", time.time())
        self.append(record)
        if self._write_summaries and "step" in record:
            self.write_scalars(int(record["step"]))

    def append(self, record: Dict[str, Any]) -> None:
        """Appends one record as one line, flushed (and, on a local disk, synced); a partial
        line an earlier run left is closed first, so that it stays one unreadable line."""
        if self.task is not None:
            record = {"task": self.task, **record}
        line = json.dumps(record, sort_keys=True, allow_nan=False, default=str) + "\n"
        if _ends_mid_line(self.path):
            line = "\n" + line
        if self._remote:  # Remote storage: written when the file is closed.
            with tf.io.gfile.GFile(self.path, "a") as f:
                f.write(line)
            return
        with open(self.path, "a", encoding="utf-8") as f:  # Local: synced (gfile cannot fsync).
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def write_scalars(self, step: int, loss: Optional[float] = None) -> None:
        """Writes the counters since this recorder began to follow its guards (and the loss,
        when given) as scalars at `step`."""
        if not self._write_summaries:
            return
        writer = tf.compat.v1.summary.FileWriterCache.get(self._logdir)
        deltas = [guard.state.since(start) for guard, start in self._followed.items()]
        counts = {name: sum(getattr(d, field) for d in deltas) for name, field in _SCALARS.items()}
        values = [
            tf.compat.v1.Summary.Value(tag=f"nanguard/{name}", simple_value=count)
            for name, count in sorted(counts.items())
            if count or name != "loss_scale_overflows"
        ]
        if loss is not None:
            values.append(tf.compat.v1.Summary.Value(tag="nanguard/loss", simple_value=loss))
        writer.add_summary(tf.compat.v1.Summary(value=values), step)
        writer.flush()


def _ends_mid_line(path: str) -> bool:
    if not tf.io.gfile.exists(path) or not (size := tf.io.gfile.stat(path).length):
        return False
    with tf.io.gfile.GFile(path, "rb") as f:
        f.seek(size - 1)
        return f.read(1) != b"\n"


def read_events(logdir_or_path: str) -> List[Dict[str, Any]]:
    """The records of a run (`logdir_or_path`: the training directory or the ``.jsonl`` file
    itself), oldest first; empty if there is no file yet. A partial last line (a crash
    mid-write) is skipped. A directory written by a cluster holds one file per task (task N > 0:
    ``nanguard_events.taskN.jsonl``); their records are merged by time, each with its ``task``.
    """
    path = logdir_or_path
    if tf.io.gfile.isdir(path):
        tasks = sorted(tf.io.gfile.glob(_paths.join(path, "nanguard_events.task*.jsonl")))
        path = _paths.join(path, EVENTS_FILENAME)
        if tasks:
            merged = [r for p in [path, *tasks] for r in read_events(p)]
            return sorted(merged, key=lambda r: r.get("time", 0))  # stable: file order ties
    if not tf.io.gfile.exists(path):
        return []
    records = []
    with tf.io.gfile.GFile(path, "r") as f:
        lines = f.read().split("\n")
    for number, line in enumerate(lines, start=1):
        try:
            if line.strip():
                records.append(json.loads(line))
        except json.JSONDecodeError:
            logging.warning("slim_nanguard: skipping unreadable line %d of %s", number, path)
    return records
