"""Appending whole lines to a file on any file system `tf.io.gfile` serves: the guard's
records and its quarantine."""

from __future__ import annotations

import os

import tensorflow as tf

from slim_nanguard import _paths


def append_lines(path: str, *lines: str) -> None:
    """Appends `lines` to the file `path` in one write, flushed (and, on a local disk, synced);
    a partial line an earlier run left is closed first, so that it stays one unreadable line."""
    text = "".join(line + "\n" for line in lines)
    if _ends_mid_line(path):
        text = "\n" + text
    if _paths.is_url(path):  # Remote storage: written when the file is closed.
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
