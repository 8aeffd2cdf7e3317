"""The op types the guard recognises in a graph: one definition for every module.

`Guard` runs the input ops to skip batches after a rollback, `_capture` keeps the outputs of
placeholders and input ops on a bad step, and the autopsy calls a non-finite value made there
"the batch itself" and does not replay past them.
"""

from __future__ import annotations

from typing import Iterable, List

import tensorflow as tf

# Ops that fetch the next batch when run: iterators, queues and readers.
INPUT_OP_TYPES = frozenset(
    {
        "IteratorGetNext",
        "IteratorGetNextSync",
        "IteratorGetNextAsOptional",
        "QueueDequeueV2",
        "QueueDequeueManyV2",
        "QueueDequeueUpToV2",
        "QueueDequeue",
        "QueueDequeueMany",
        "QueueDequeueUpTo",
        "ReaderReadV2",
        "ReaderReadUpToV2",
    }
)

# Ops whose output is a fed batch (a placeholder_with_default may sit over an iterator).
PLACEHOLDER_TYPES = frozenset({"Placeholder", "PlaceholderV2", "PlaceholderWithDefault"})

# Ops whose outputs are the batch: what a replay feeds and cannot run past.
BATCH_OP_TYPES = PLACEHOLDER_TYPES | INPUT_OP_TYPES


def sources(
    roots: Iterable[tf.Operation], types: frozenset, *, control_inputs: bool = True
) -> List[tf.Operation]:
    """The ops of `types` that `roots` depend on, without looking past them.

    The walk goes back over data edges (and control edges when `control_inputs`) and stops
    at an op of `types`: what lies behind an input op or a placeholder is not the batch.

    Args:
      roots: The ops to start from (a loss's op, for one).
      types: The op types to find.
      control_inputs: Whether control dependencies count as edges.

    Returns:
      The ops found, in the order the walk met them.
    """
    found, seen, stack = [], set(), list(roots)
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        if op.type in types:
            found.append(op)
            continue
        stack.extend(t.op for t in op.inputs)
        if control_inputs:
            stack.extend(op.control_inputs)
    return found
