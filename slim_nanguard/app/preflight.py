"""The launchers' checks that need no TensorFlow: fault specs, local directories, checkpoints.

Standard library only, so that ``scripts/_quiet_start.py`` can load this file by its path
(without importing ``slim_nanguard``, which imports TensorFlow) and answer a bad
``--inject_fault``, a missing ``--dataset_dir`` or an unwritable ``--train_dir`` at once. The
run checks the same things with the same functions (`FaultSpec.parse`, `dataset_dir_problem`);
paths with a scheme (``gs://...``) are left to the run, which reads them through
``tf.io.gfile``.

A fault is a kind and a batch index, written ``KIND:STEP`` or ``KIND:FIRST-LAST``
(`slim_nanguard.app.faults` injects it).
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
from typing import Any, Callable, Iterable, List, Mapping, Optional, Tuple

NAN_INPUT = "nan_input"
INF_INPUT = "inf_input"
NAN_LOSS = "nan_loss"
INF_LOSS = "inf_loss"
NAN_GRADIENT = "nan_gradient"
SPIKE_INPUT = "spike_input"
SPIKE_SCALE = 1000.0
TRANSIENT_NAN = "transient_nan"
NAN_EXAMPLE = "nan_example"
SPIKE_EXAMPLE = "spike_example"
LR_JUMP = "lr_jump"
LR_JUMP_SCALE = 1e12

INPUT_KINDS = (NAN_INPUT, INF_INPUT, SPIKE_INPUT)
LOSS_KINDS = (NAN_LOSS, INF_LOSS, NAN_GRADIENT, TRANSIENT_NAN)
# Their index is an example's position in the split (the same example in every epoch).
EXAMPLE_KINDS = (NAN_EXAMPLE, SPIKE_EXAMPLE)
STATE_KINDS = (LR_JUMP,)
FAULT_KINDS = INPUT_KINDS + LOSS_KINDS + EXAMPLE_KINDS + STATE_KINDS

_SPEC = re.compile(r"^\s*([a-z_]+)\s*:\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


@dataclasses.dataclass(frozen=True)
class FaultSpec:
    """One injected fault: a kind and the batches (or, for `EXAMPLE_KINDS`, the examples) it
    hits.

    Attributes:
      kind: One of `FAULT_KINDS`.
      first: Index of the first bad batch (0 is the first batch of the run); for
        `EXAMPLE_KINDS`, of the first bad example (its position in the split, read in every
        epoch).
      last: Index of the last one (inclusive); equal to `first` for a single one.
    """

    kind: str
    first: int
    last: int = -1

    def __post_init__(self):
        if self.kind not in FAULT_KINDS:
            raise ValueError(
                f"unknown fault kind {self.kind!r}: choose one of {', '.join(FAULT_KINDS)}."
            )
        if isinstance(self.first, bool) or not isinstance(self.first, int) or self.first < 0:
            raise ValueError(
                f"the batch index of a fault must be an integer >= 0; got {self.first!r}."
            )
        if self.last == -1:
            object.__setattr__(self, "last", self.first)
        if isinstance(self.last, bool) or not isinstance(self.last, int) or self.last < self.first:
            raise ValueError(
                f"the last batch of fault {self.kind}:{self.first}-{self.last} comes "
                "before its first; write KIND:FIRST-LAST with FIRST <= LAST."
            )

    @classmethod
    def parse(cls, text: str) -> "FaultSpec":
        """Parses ``KIND:STEP`` or ``KIND:FIRST-LAST``.

        Raises:
          ValueError: The text is not of that form, or names an unknown kind; the message
            quotes the text and lists the kinds.
        """
        match = _SPEC.match(text or "")
        if not match:
            raise ValueError(
                f"fault {text!r} is not KIND:STEP or KIND:FIRST-LAST (for example "
                f"nan_input:40); KIND is one of {', '.join(FAULT_KINDS)}."
            )
        kind, first, last = match.group(1), int(match.group(2)), match.group(3)
        if kind not in FAULT_KINDS:
            raise ValueError(
                f"fault {text!r} has the unknown kind {kind!r}: choose one of "
                f"{', '.join(FAULT_KINDS)}."
            )
        return cls(kind, first, int(last) if last is not None else first)

    @classmethod
    def parse_list(cls, texts: "str | Iterable[str]") -> Tuple["FaultSpec", ...]:
        """Parses a comma-separated string, or a sequence of strings; empty items are ignored."""
        if isinstance(texts, str):
            texts = texts.split(",")
        return tuple(cls.parse(t) for t in texts if t and t.strip())

    def __str__(self) -> str:
        if self.last == self.first:
            return f"{self.kind}:{self.first}"
        return f"{self.kind}:{self.first}-{self.last}"


def is_local(path: str) -> bool:
    """Whether `path` is a local file name (not ``gs://``, ``ram://`` or another scheme)."""
    return "://" not in path


def dataset_dir_problem(
    dataset_dir: Optional[str],
    exists: Callable[[str], bool] = os.path.exists,
    isdir: Callable[[str], bool] = os.path.isdir,
) -> Optional[str]:
    """What is wrong with the ``--dataset_dir`` of the tfrecord dataset (None: nothing).

    Args:
      dataset_dir: The flag's value.
      exists: Tells whether a path exists (the run passes ``tf.io.gfile.exists``).
      isdir: Tells whether a path is a directory (the run passes ``tf.io.gfile.isdir``).
    """
    if dataset_dir is None:
        return (
            "Dataset tfrecord needs dataset_dir (--dataset_dir): the directory "
            "holding the TF-Slim TFRecord files, e.g. the --dataset_dir given to "
            "slim's download_and_convert_data.py."
        )
    if not exists(dataset_dir):
        return (
            f"dataset_dir (--dataset_dir) {dataset_dir} does not exist: pass the "
            "directory that holds the TFRecord files."
        )
    if not isdir(dataset_dir):
        return (
            f"dataset_dir (--dataset_dir) {dataset_dir} is not a directory: pass "
            "the directory that holds the TFRecord files, not a file."
        )
    return None


def train_dir_problem(train_dir: str) -> Optional[str]:
    """What keeps the run from writing to local directory `train_dir` (None: nothing).

    The directory, or the nearest of its parents that exists, must be a directory this
    process can create a file in (tried with a nameless temporary file, which leaves nothing).
    """
    path = os.path.abspath(train_dir)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        return (
            f"train_dir (--train_dir) {train_dir} cannot be made: {path} is a file. "
            "Choose a directory for checkpoints and logs."
        )
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        return (
            f"train_dir (--train_dir) {train_dir} is not writable ({path}: "
            f"{err.strerror}). Choose a directory you can write to."
        )
    return None


def checkpoint_prefix(path: str) -> str:
    """The prefix of checkpoint file `path` (``.index``, ``.meta`` or a ``.data-`` shard);
    `path` itself when it names none of them."""
    if ".data-" in path:
        return path.split(".data-")[0]
    return re.sub(r"\.(index|meta)$", "", path)


def missing_checkpoint(path: str, flag: str) -> str:
    """The problem of checkpoint `path`, given by `flag`, when nothing is there."""
    return (
        f"{flag}={path} does not exist: pass a checkpoint prefix (train_dir/model.ckpt-N) or a "
        "training directory."
    )


def eval_problems(values: Mapping[str, Any]) -> List[str]:
    """The problems of the eval launcher's flag `values` this module can see: nothing at a
    local ``--checkpoint_path`` (a prefix, one of its files, or a directory); whether what is
    there is a checkpoint is the run's to tell."""
    path = values.get("checkpoint_path")
    if not path or not is_local(path):
        return []
    if os.path.exists(path) or os.path.exists(checkpoint_prefix(path) + ".index"):
        return []
    return [missing_checkpoint(path, "--checkpoint_path")]


def train_problems(values: Mapping[str, Any]) -> List[str]:
    """The problems of the train launcher's flag `values` this module can see, in flag order.

    None for a task of a cluster (``--ps_hosts`` set): it answers bad input after TensorFlow,
    where it can still tell the ps that it failed (so the ps and the chief end too), and a ps
    writes nothing to ``--train_dir``."""
    if values.get("ps_hosts"):
        return []
    problems = []
    for text in values.get("inject_fault") or ():
        try:
            FaultSpec.parse(text)
        except ValueError as err:
            problems.append(f"--inject_fault: {err}")
    dataset_dir = values.get("dataset_dir")
    if values.get("dataset_name") == "tfrecord" and (dataset_dir is None or is_local(dataset_dir)):
        problems.append(dataset_dir_problem(dataset_dir))
    train_dir = values.get("train_dir")
    if train_dir and is_local(train_dir):
        problems.append(train_dir_problem(train_dir))
    return [problem for problem in problems if problem]
