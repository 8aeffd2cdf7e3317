"""Shows the autopsy of a recorded bad step; replays it offline; plots the run.

    slim-nanguard-autopsy TRAIN_DIR                 # the latest autopsied bad step
    slim-nanguard-autopsy TRAIN_DIR --step=40       # the bad step at global step 40
    slim-nanguard-autopsy TRAIN_DIR --replay        # ...and replay it from the dump alone
    slim-nanguard-autopsy TRAIN_DIR --plot=run.png  # the loss, bad steps, skips, rollbacks

The report goes to stdout. Exit status: 0 done; 1 an error (one line on stderr, naming the
directory, step or file; --verbosity=1 adds the Python traceback).
"""

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
_quiet_start.check_flags_early(sys.argv, "autopsy", __name__, __doc__)
with _quiet_start.quiet_imports(sys.argv):
    import tensorflow as tf  # noqa: E402
    from absl import app  # noqa: E402
    from absl import flags  # noqa: E402
    from absl import logging  # noqa: E402

    import slim_nanguard  # noqa: E402
    from slim_nanguard import autopsy  # noqa: E402
    from slim_nanguard import storage  # noqa: E402
    from slim_nanguard.app import plot  # noqa: E402

FLAGS = flags.FLAGS
EXIT_ERROR = 1

flags.DEFINE_integer(
    "step",
    None,
    "The global step of the bad step to show (default: the latest one with an autopsy).",
    lower_bound=0,
)
flags.DEFINE_boolean(
    "replay",
    False,
    "Rebuild the graph from the checkpoint's meta graph and "
    "replay the step from its dump (the kept batch and weights).",
)
flags.DEFINE_string(
    "plot",
    None,
    "Draw the loss over steps with the bad steps (spikes apart from NaN/Inf steps), skips and "
    "rollbacks marked, to this .png (needs matplotlib: the 'plot' extra).",
)
# The default is the guard's own limit on one autopsy, so that the two cannot differ.
flags.DEFINE_float(
    "timeout_secs",
    slim_nanguard.GuardConfig.autopsy_timeout_secs,
    "The longest the --replay may take.",
    lower_bound=0,
)


def _prog() -> str:
    return os.path.basename(sys.argv[0]) or "slim-nanguard-autopsy"


def fail(err: BaseException) -> int:
    if FLAGS.verbosity >= 1:
        traceback.print_exception(type(err), err, err.__traceback__)
    print(f"{_prog()}: error: {err}", file=sys.stderr)
    return EXIT_ERROR


def main(argv):
    if len(argv) != 2:
        print(
            f"{_prog()}: error: give one training directory (TRAIN_DIR); got "
            f"{' '.join(argv[1:]) or 'none'}.",
            file=sys.stderr,
        )
        return EXIT_ERROR
    train_dir = argv[1]
    logging.set_verbosity(max(FLAGS.verbosity, logging.WARNING))
    if FLAGS.verbosity < 1:  # TensorFlow's deprecation chatter, unless asked for.
        tf.get_logger().setLevel("ERROR")
        warnings.filterwarnings("ignore", category=UserWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
    tf.compat.v1.disable_v2_behavior()
    if not tf.io.gfile.isdir(train_dir):
        return fail(ValueError(f"{train_dir} is not a directory; give the --train_dir of a run."))
    try:
        if FLAGS.plot:
            print(f"plot: {plot.plot_run(train_dir, FLAGS.plot)}")
            if FLAGS.step is None and not FLAGS.replay:
                return 0
        record = autopsy.find_bad_step(train_dir, FLAGS.step)
        print(autopsy.format_report(record), flush=True)
        if FLAGS.replay:
            dump = (record.get("autopsy") or {}).get("dump")
            if not dump:
                raise ValueError(
                    f"the bad step at global step {record.get('step')} has no "
                    "dump to replay (no autopsy, or no training directory when "
                    "it ran)."
                )
            if record.get("dump_removed"):
                raise ValueError(
                    f"the dump of the bad step at global step {record.get('step')} was "
                    "removed to bound the dumps' disk use (a directory keeps the first "
                    f"{record['dump_removed'].get('keep_first')} and the latest "
                    f"{record['dump_removed'].get('keep_last')}); replay one of those "
                    "with --step."
                )
            dump = _relocated(dump, train_dir)
            result = autopsy.replay_dump(dump, train_dir, timeout_secs=FLAGS.timeout_secs)
            result = autopsy.with_spike_over(result, record)
            print(f"replay: {result.describe()}")
            if result.failed:  # The replay itself failed.
                return EXIT_ERROR
            print(
                f"  cost        {result.cost.get('seconds', 0):.3g} s, "
                f"{result.cost.get('runs', '?')} runs"
            )
    except (slim_nanguard.NanGuardError, ValueError, ImportError, OSError) as err:
        return fail(err)
    return 0


def _relocated(dump: str, train_dir: str) -> str:
    """The dump's path, in `train_dir` if the directory was moved since the run."""
    if tf.io.gfile.exists(dump):
        return dump
    moved = storage.join(train_dir, storage.basename(storage.dirname(dump)), storage.basename(dump))
    return moved if tf.io.gfile.exists(moved) else dump


def run():
    """Entry point of the ``slim-nanguard-autopsy`` command."""
    _quiet_start.show_flags_in_help(__name__, __doc__)
    app.run(main)


if __name__ == "__main__":
    run()
