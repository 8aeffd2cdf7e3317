"""The op types the guard recognises in a graph: one definition for every module.

`Guard` runs the input ops to skip batches after a rollback, `_capture` keeps the outputs of
placeholders and input ops on a bad step, and the autopsy calls a non-finite value made there
"the batch itself" and does not replay past them.
"""

from __future__ import annotations

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
