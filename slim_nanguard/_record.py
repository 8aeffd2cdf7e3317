"""The run's record of bad steps: a JSON-lines file and TensorBoard scalars.

Each record is one line of ``<logdir>/nanguard_events.jsonl``, written with a single
``write`` of the whole line to a file opened for appending, then flushed and synced. A crash
can at worst leave a partial last line; `read_events` skips it, so earlier lines always read.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List, Optional

import tensorflow as tf

from slim_nanguard import _log as logging
from slim_nanguard import _paths

EVENTS_FILENAME = "nanguard_events.jsonl"


def events_filename(task: Optional[int] = None) -> str:
    """The record of one task of a cluster: task 0 (the chief, or no cluster) keeps the usual
    name, task N writes ``nanguard_events.taskN.jsonl`` next to it."""
    return EVENTS_FILENAME if not task else f"nanguard_events.task{task}.jsonl"


class EventRecorder:
    """Appends records to the event file and writes counters as TensorBoard scalars.

    Use it as a guard listener: ``guard.add_listener(recorder)``.

    Args:
      logdir: The training directory.
      summary_writer: Where the scalars go; default: the `FileWriterCache` writer of
        `logdir` (the one the training session's summaries use). None-able for tests.
      write_summaries: False to write the JSON lines only.
      task: The task id in a cluster: each record gets a ``task`` field, and task N > 0
        writes its own file (`events_filename`). None: no cluster.
    """

    def __init__(
        self,
        logdir: str,
        summary_writer: Optional[tf.compat.v1.summary.FileWriter] = None,
        write_summaries: bool = True,
        task: Optional[int] = None,
    ):
        self.path = _paths.join(logdir, events_filename(task))
        self.task = task
        self._logdir = logdir
        self._writer = summary_writer
        self._write_summaries = write_summaries
        self.counts = {"bad_steps": 0, "skips": 0, "rollbacks": 0, "stops": 0}

    def __call__(self, record: Dict[str, Any]) -> None:
        record = dict(record)
        record.setdefault("time", time.time())
        kind = record.get("kind")
        if kind == "bad_step":
            self.counts["bad_steps"] += 1
            if record.get("action") == "skip":
                self.counts["skips"] += 1
            elif record.get("action") == "stop":
                self.counts["stops"] += 1
        elif kind == "rollback":
            self.counts["rollbacks"] += 1
        elif kind == "loss_scale_overflow":  # counted apart; only runs that have them show it
            self.counts["loss_scale_overflows"] = self.counts.get("loss_scale_overflows", 0) + 1
        self.append(record)
        if self._write_summaries and "step" in record:
            self.write_scalars(int(record["step"]))

    def append(self, record: Dict[str, Any]) -> None:
        """Appends one record as one line, flushed and synced to disk.

        If an earlier run died mid-line, the partial line is closed first, so that it stays
        one unreadable line instead of swallowing this one.
        """
        if self.task is not None:
            record = {"task": self.task, **record}
        line = json.dumps(record, sort_keys=True, allow_nan=False, default=str) + "\n"
        if _ends_mid_line(self.path):
            line = "\n" + line
        if _paths.is_url(self.path):  # Remote storage: written when the file is closed.
            with tf.io.gfile.GFile(self.path, "a") as f:
                f.write(line)
            return
        with open(self.path, "a", encoding="utf-8") as f:  # Local: synced (gfile cannot fsync).
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def write_scalars(self, step: int, loss: Optional[float] = None) -> None:
        """Writes the counters (and the loss, when given) as scalars at `step`."""
        if not self._write_summaries:
            return
        writer = self._writer
        if writer is None:
            writer = tf.compat.v1.summary.FileWriterCache.get(self._logdir)
        values = [
            tf.compat.v1.Summary.Value(tag=f"nanguard/{name}", simple_value=count)
            for name, count in sorted(self.counts.items())
        ]
        if loss is not None:
            values.append(tf.compat.v1.Summary.Value(tag="nanguard/loss", simple_value=loss))
        writer.add_summary(tf.compat.v1.Summary(value=values), step)
        writer.flush()


def _ends_mid_line(path: str) -> bool:
    if not tf.io.gfile.exists(path):
        return False
    size = tf.io.gfile.stat(path).length
    if size == 0:
        return False
    with tf.io.gfile.GFile(path, "rb") as f:
        f.seek(size - 1)
        return f.read(1) != b"\n"


def read_events(logdir_or_path: str) -> List[Dict[str, Any]]:
    """Reads the records of a run; a partial last line (a crash mid-write) is skipped.

    A directory written by a cluster holds one file per task (`events_filename`); their
    records are merged by time, each with its ``task`` field.

    Args:
      logdir_or_path: The training directory or the ``.jsonl`` file itself.

    Returns:
      The records, oldest first; empty if there is no file yet.
    """
    path = logdir_or_path
    if tf.io.gfile.isdir(path):
        tasks = sorted(tf.io.gfile.glob(_paths.join(path, "nanguard_events.task*.jsonl")))
        if tasks:
            merged = [
                r for p in [_paths.join(path, EVENTS_FILENAME)] + tasks for r in read_events(p)
            ]
            return sorted(merged, key=lambda r: r.get("time", 0))  # stable: file order ties
        path = _paths.join(path, EVENTS_FILENAME)
    if not tf.io.gfile.exists(path):
        return []
    records = []
    with tf.io.gfile.GFile(path, "r") as f:
        lines = f.read().split("\n")
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            logging.warning("slim_nanguard: skipping unreadable line %d of %s", number, path)
    return records
