"""The run's record of bad steps: a JSON-lines file and TensorBoard scalars.

Each record is one line of ``<logdir>/nanguard_events.jsonl``, written with a single
``write`` of the whole line to a file opened for appending, then flushed and synced. A crash
can at worst leave a partial last line; `read_events` skips it, so earlier lines always read.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Callable, Dict, List, Optional

import tensorflow as tf

from slim_nanguard import _log as logging
from slim_nanguard import _paths

EVENTS_FILENAME = "nanguard_events.jsonl"

# The TensorBoard counters (``nanguard/<name>``) and the `GuardState` count each one reads; the
# `OPTIONAL` ones only in runs that can have them.
SCALARS = {
    "bad_steps": "total_bad_steps",
    "skips": "skips",
    "rollbacks": "rollbacks",
    "stops": "stops",
    "level_shifts": "level_shifts",
    "loss_scale_overflows": "loss_scale_overflows",
}
OPTIONAL = ("level_shifts", "loss_scale_overflows")


def event_scalars(record: Dict[str, Any]) -> Dict[str, float]:
    """What a bad step's `record` shows at its step besides the counters (pure): its loss
    (``nanguard/rejected_loss``) and the z-scores of the reason that rejected it
    (``nanguard/rejected_z_loss``, ...), where finite; nothing for other records."""
    if record.get("kind") != "bad_step":
        return {}
    figures, values = record.get(str(record.get("cause"))), {"loss": record.get("loss")}
    if isinstance(figures, dict):
        values |= {name: value for name, value in figures.items() if name.startswith("z_")}
    return {
        f"nanguard/rejected_{name}": float(value)
        for name, value in values.items()
        if isinstance(value, (int, float)) and math.isfinite(value)
    }


class Registry:
    """A guard's listeners, and its own record in `directory` (the autopsy dumps' directory,
    next to the checkpoints) while no listener keeps one: `send` gives each record to both."""

    def __init__(self, guard):
        self._guard = guard
        self.listeners: List[Callable[[Dict[str, Any]], None]] = []
        self.directory: Optional[str] = None
        self._own: Optional[EventRecorder] = None

    def add(self, listener: Callable[[Dict[str, Any]], None]) -> None:
        """Adds `listener` (once); an `EventRecorder` writes the guard's counters too."""
        if listener not in self.listeners:
            self.listeners.append(listener)
        if isinstance(listener, EventRecorder):
            listener.follow(self._guard)  # Its TensorBoard counters are read from the state.

    def use_directory(self, path: Optional[str], *, replace: bool = False, **recorder) -> None:
        """Keeps the guard's own record and its autopsy dumps (`Guard.autopsy_dir`) in `path`, if
        first or `replace`, with the TensorBoard scalars `recorder` (`EventRecorder`'s keywords)
        says."""
        if path and (replace or self.directory is None):
            self.directory = path
            self._own = EventRecorder(path, **recorder)
            self._own.follow(self._guard)

    @property
    def task(self) -> Optional[int]:
        """The task id its record names (a cluster's task), or None."""
        recorders = [x for x in self.listeners if isinstance(x, EventRecorder)] + [self._own]
        return next((r.task for r in recorders if r is not None and r.task is not None), None)

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
    event file of `logdir` and, unless `write_summaries` is False, writes at the record's step
    the counters of the guards it follows and `event_scalars` as TensorBoard scalars, with
    `writer` (default: `FileWriterCache`'s of `logdir`, which `MonitoredTrainingSession`'s hooks
    share; a second writer of the directory could open their file's name in the same second).
    `task` is the task id in a cluster (None: none): each record gets a ``task`` field, and task
    N > 0 writes ``nanguard_events.taskN.jsonl``.
    """

    def __init__(
        self,
        logdir: str,
        write_summaries: bool = True,
        task: Optional[int] = None,
        writer: Any = None,
    ):
        name = f"nanguard_events.task{task}.jsonl" if task else EVENTS_FILENAME
        self.path = _paths.join(logdir, name)
        self._remote = _paths.is_url(self.path)  # Once, not per record (test_bad_step_trace).
        self.task = task
        self._logdir = logdir
        self._write_summaries = write_summaries
        self._writer = writer
        self._followed: List[Any] = []  # The guards (`Guard`s) whose counters it writes.

    def follow(self, guard) -> None:
        """Writes `guard`'s counters too."""
        if guard not in self._followed:
            self._followed.append(guard)

    def __call__(self, record: Dict[str, Any]) -> None:
        record = dict(record)
        record.setdefault("time", time.time())
        self.append(record)
        if self._write_summaries and "step" in record:
            self.write_scalars(int(record["step"]), more=event_scalars(record))

    def append(self, record: Dict[str, Any]) -> None:
        """Appends one record as one line (`append_lines`)."""
        if self.task is not None:
            record = {"task": self.task, **record}
        line = json.dumps(record, sort_keys=True, allow_nan=False, default=str)
        append_lines(self.path, line, remote=self._remote)

    def write_scalars(
        self,
        step: int,
        loss: Optional[float] = None,
        more: Dict[str, float] = None,
        counters: bool = True,
    ) -> None:
        """Writes the counters of the guards it follows (if `counters`; the `OPTIONAL` ones once
        not 0), the loss when given, and `more` (``{tag: value}``) as scalars at `step`."""
        if not self._write_summaries:
            return
        writer = self._writer or tf.compat.v1.summary.FileWriterCache.get(self._logdir)
        states = [guard.state for guard in self._followed] if counters else []
        totals = [sum(float(getattr(s, field)) for s in states) for field in SCALARS.values()]
        shown = {f"nanguard/{name}": n for name, n in zip(SCALARS, totals)} if states else {}
        shown |= {"nanguard/loss": loss} if loss is not None else {}
        values = [
            tf.compat.v1.Summary.Value(tag=tag, simple_value=value)
            for tag, value in {**shown, **(more or {})}.items()
            if value or tag.split("/")[1] not in OPTIONAL
        ]
        writer.add_summary(tf.compat.v1.Summary(value=values), step)
        writer.flush()


def append_lines(path: str, *lines: str, remote: Optional[bool] = None) -> None:
    """Appends `lines` to the file `path` in one write, flushed (and, on a local disk, synced);
    a partial line an earlier run left is closed first, so that it stays one unreadable line.
    `remote`: whether `path` is a URL (None: `_paths.is_url` says)."""
    text = "".join(line + "\n" for line in lines)
    if _ends_mid_line(path):
        text = "\n" + text
    if _paths.is_url(path) if remote is None else remote:  # Remote: written when closed.
        with tf.io.gfile.GFile(path, "a") as f:
            f.write(text)
        return
    with open(path, "a", encoding="utf-8") as f:  # Local: synced (gfile cannot fsync).
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


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
    return read_json_lines(path) if tf.io.gfile.exists(path) else []


def read_json_lines(path: str, accept: Callable[[Any], bool] = lambda record: True) -> List[Any]:
    """The records of the JSON-lines file `path`, in order; a line that does not parse, or
    whose record `accept` refuses, is skipped with a warning (blank lines silently)."""
    records = []
    with tf.io.gfile.GFile(path, "r") as f:
        lines = f.read().split("\n")
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            if accept(record := json.loads(line)):
                records.append(record)
                continue
        except json.JSONDecodeError:
            pass
        logging.warning("slim_nanguard: skipping unreadable line %d of %s", number, path)
    return records
