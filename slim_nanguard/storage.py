"""A run's files on any file system `tf.io.gfile` serves: local, ``gs://``, ``hdfs://``, ...

What a launcher needs beside the guard to find its way in a training directory:

* paths that may be URLs (`os.path` reads ``gs://bucket/run`` as a relative local path):
  `absolute`, `join`, `dirname`, `basename`, `is_url`;
* a run's checkpoints: `latest_checkpoint` (`tf.train.latest_checkpoint`, also for a moved or
  copied directory and past a damaged state file), `checkpoint_step`, `checkpoint_reader`
  (which raises `slim_nanguard.UnreadableCheckpointError` naming a damaged index);
* `op_error_cause`: the line of a TensorFlow error that says what went wrong.

The newest checkpoint that can be read, and whether one is finite, are the guard's own:
`slim_nanguard.latest_good_checkpoint`, `slim_nanguard.non_finite_variables`.
"""

from slim_nanguard._checkpoints import checkpoint_reader
from slim_nanguard._checkpoints import checkpoint_step
from slim_nanguard._checkpoints import latest_checkpoint
from slim_nanguard._errors import op_error_cause
from slim_nanguard._paths import absolute
from slim_nanguard._paths import basename
from slim_nanguard._paths import dirname
from slim_nanguard._paths import is_url
from slim_nanguard._paths import join

__all__ = [
    "absolute",
    "basename",
    "checkpoint_reader",
    "checkpoint_step",
    "dirname",
    "is_url",
    "join",
    "latest_checkpoint",
    "op_error_cause",
]
