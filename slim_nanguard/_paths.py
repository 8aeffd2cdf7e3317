"""Paths that may name remote storage (``gs://``, ``hdfs://``, ``s3://``, ``ram://``) or local
files: a URL is left as it is (`os.path.abspath` would make ``gs://b/run`` ``<cwd>/gs:/b/run``),
a local path is treated as `os.path` does."""

from __future__ import annotations

import os
import posixpath
import re
from typing import Union

# A URL's scheme, as tf.io.gfile parses it: ``scheme://`` at the start of the path.
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(path: Union[str, os.PathLike]) -> bool:
    """Whether `path` names a file system by its scheme (``gs://...``), not a local path."""
    return bool(_SCHEME.match(os.fspath(path)))


def absolute(path: Union[str, os.PathLike]) -> str:
    """`path` as a string, made absolute if it is local; a URL is returned as it is."""
    path = os.fspath(path)
    return path if is_url(path) else os.path.abspath(path)


def join(path: Union[str, os.PathLike], *names: str) -> str:
    """`names` joined under the directory `path`: with ``/`` for a URL, as `os.path` locally."""
    return (posixpath if is_url(path) else os.path).join(path, *names)


def basename(path: Union[str, os.PathLike]) -> str:
    """The last component of `path` (of a URL's path, split at ``/``)."""
    return (posixpath if is_url(path) else os.path).basename(path)


def dirname(path: Union[str, os.PathLike]) -> str:
    """The directory of `path` (a URL's keeps its scheme)."""
    return (posixpath if is_url(path) else os.path).dirname(path)
