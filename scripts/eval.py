"""Evaluates a checkpoint on a dataset split: accuracy and loss, the TF-Slim way.

The flags follow TF-Slim's eval_image_classifier.py. One pass over the split with
tf_slim.evaluation.evaluate_once and streaming metrics read by a FinalOpsHook:

    slim-nanguard-eval --checkpoint_path=/tmp/nanguard_runs/default
    slim-nanguard-eval --checkpoint_path=/tmp/run/model.ckpt-2000 --dataset_split_name=test

A checkpoint holding NaN or Inf is refused. The result goes to stdout as one line; errors
to stderr as one or two lines (--verbosity=1 adds the traceback), with exit status 1.
"""

import dataclasses
import importlib.util
import os
import sys
import traceback
import warnings

# The start-up helper next to this file, however the script is started (by path, through
# runpy, or as the installed console command), and before TensorFlow is imported.
_SPEC = importlib.util.spec_from_file_location(
    "slim_nanguard_quiet_start",
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "_quiet_start.py"),
)
_quiet_start = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_quiet_start)

# TensorFlow's start-up banner stays out of the output unless --verbosity asks for it.
# A typo or a bad value in the flags is answered before the slow import of TensorFlow.
_quiet_start.check_flags_early(sys.argv, "eval", __name__, __doc__)
with _quiet_start.quiet_imports(sys.argv):
    import tensorflow as tf  # noqa: E402
    from absl import app  # noqa: E402
    from absl import flags  # noqa: E402
    from absl import logging  # noqa: E402

    import slim_nanguard  # noqa: E402
    from slim_nanguard import app as nanguard_app  # noqa: E402
    from slim_nanguard import compat  # noqa: E402
    from slim_nanguard.app import datasets  # noqa: E402
    from slim_nanguard.app import models  # noqa: E402

FLAGS = flags.FLAGS
# Every default is the config's (the library's), so that a flag and its field cannot differ.
DEFAULT = nanguard_app.EvalConfig

EXIT_ERROR = 1

flags.DEFINE_string(
    "checkpoint_path",
    None,
    "The checkpoint to evaluate: a file prefix "
    "(model.ckpt-N) or a training directory (its latest checkpoint).",
)
flags.DEFINE_enum(
    "model_name", DEFAULT.model_name, models.MODEL_NAMES, "The model the checkpoint holds."
)
flags.DEFINE_enum(
    "dataset_name", DEFAULT.dataset_name, datasets.DATASET_NAMES, "The dataset to evaluate on."
)
flags.DEFINE_string(
    "dataset_dir", DEFAULT.dataset_dir, "Directory of the TFRecord files (tfrecord only)."
)
flags.DEFINE_string("dataset_split_name", DEFAULT.dataset_split_name, "The split to evaluate on.")
flags.DEFINE_integer(
    "batch_size", DEFAULT.batch_size, "Examples per evaluation batch.", lower_bound=1
)
flags.DEFINE_integer(
    "eval_image_size",
    DEFAULT.eval_image_size,
    "Image side fed to the model (as in training); default: the model's own.",
    lower_bound=1,
)
flags.DEFINE_integer(
    "max_num_batches",
    DEFAULT.max_num_batches,
    "Evaluate at most this many batches (default: the whole split).",
    lower_bound=1,
)
flags.DEFINE_string(
    "eval_dir", DEFAULT.eval_dir, "Where to write the evaluation summaries (default: none written)."
)
flags.DEFINE_string("master", DEFAULT.master, "The TensorFlow master ('' runs in-process).")

flags.mark_flag_as_required("checkpoint_path")


def _prog() -> str:
    return os.path.basename(sys.argv[0]) or "slim-nanguard-eval"


def main(argv):
    if len(argv) > 1:
        print(
            f"{_prog()}: error: unexpected arguments {' '.join(argv[1:])!r}: every setting "
            "is a --flag (see --helpshort).",
            file=sys.stderr,
        )
        return EXIT_ERROR
    if FLAGS.verbosity < 1:
        tf.get_logger().setLevel("ERROR")
        warnings.filterwarnings("ignore", category=UserWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
    logging.set_verbosity(max(FLAGS.verbosity, logging.INFO))
    tf.compat.v1.disable_v2_behavior()
    compat.install()
    try:
        config = nanguard_app.EvalConfig(
            **{f.name: FLAGS[f.name].value for f in dataclasses.fields(nanguard_app.EvalConfig)}
        )
        result = nanguard_app.run_eval(config)
    except (slim_nanguard.NanGuardError, ValueError, OSError, tf.errors.OpError) as err:
        if FLAGS.verbosity >= 1:
            traceback.print_exception(type(err), err, err.__traceback__)
        for line in nanguard_app.error_message(err).splitlines():
            print(f"{_prog()}: error: {line}", file=sys.stderr)
        return EXIT_ERROR
    print(f"eval/accuracy {result.accuracy:.4f}")
    print(f"eval/loss {result.loss:.4f}")
    print(result.describe(), flush=True)
    return 0


def run():
    """Entry point of the ``slim-nanguard-eval`` command."""
    _quiet_start.show_flags_in_help(__name__, __doc__)
    app.run(main)


if __name__ == "__main__":
    run()
