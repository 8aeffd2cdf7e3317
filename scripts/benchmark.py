"""Times slim_nanguard's guard against the unguarded train op and TensorFlow's alternatives.

    slim-nanguard-benchmark --out=benchmark.json            # the targets: MLP, deep net, SGD
    slim-nanguard-benchmark --quick --out=quick.json        # a look
    slim-nanguard-benchmark --models=mlp,lenet,deep,wide --optimizers=sgd,adam  # more models
    slim-nanguard-benchmark --models=mlp --optimizers=adam --variants=nanguard_hook_raise
    slim-nanguard-benchmark --profile --models=deep,lenet   # where a step's time goes
    slim-nanguard-benchmark --startup        # build and first-step times, resnet_v1_50 etc.
    slim-nanguard-benchmark --faults         # a fault of each cause under skip and rollback

All the variants of a model live in this one process, each in sessions of its own, and are
timed in interleaved rounds (see `slim_nanguard.app.benchmarking`). Before TensorFlow allocates
anything, glibc malloc is told to keep freed memory (--keep_freed_memory), so that no
session pays page faults for its step's tensors every step. The tables go to stdout
(Markdown; --markdown also writes them to a file) and, with --out, the same figures
and more (per-round times, per-session medians, page faults, memory) to a JSON file.

By default it times the two models the targets name (the MLP and the 102-variable deep net),
with SGD, every variant: a few minutes on 2 cores. Each ratio is shown in wall time and in CPU
time (the process's, over its threads), which another process taking a core moves less; a
target is met when both medians are within it. The four small models with both optimizers took
5 minutes; CifarNet and MobileNet, whose steps take 40-80 ms there, add roughly as much again
each (their 20 variants' graphs take 20-35 s to build, and every variant runs at least 3 steps
per chunk).

--profile times nothing: it traces steps of each variant (TensorFlow's RunMetadata
step stats) and prints, against the unguarded op, the nodes executed, their summed time and
the nodes the guard adds, grouped by op type and by name scope.
"""

import ctypes
import ctypes.util
import importlib.util
import json
import os
import sys

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
_quiet_start.check_flags_early(sys.argv, "benchmark", __name__, __doc__)
with _quiet_start.quiet_imports(sys.argv):
    import tensorflow as tf  # noqa: E402
    from absl import app  # noqa: E402
    from absl import flags  # noqa: E402
    from absl import logging  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Write the results as JSON to this file.")
flags.DEFINE_string("markdown", None, "Also write the tables as Markdown to this file.")
flags.DEFINE_bool(
    "quick",
    False,
    "The default models and every variant, SGD only, one session each, a few "
    "short rounds: a look in under two minutes. Flags given explicitly still win.",
)
flags.DEFINE_list(
    "models",
    None,
    "Models to time (default: mlp,deep, the targets'): mlp, lenet, deep, wide, cifarnet, "
    "mobilenet.",
)
flags.DEFINE_list("optimizers", None, "Optimizers (default: sgd): sgd, adam.")
flags.DEFINE_list(
    "variants",
    None,
    "Variants to time (default: all); the baselines they are compared with are added.",
)
flags.DEFINE_integer("rounds", None, "Interleaved rounds (default 7; quick 3).")
flags.DEFINE_integer(
    "chunks", None, "Timed chunks per session and round; the fastest counts (default 2)."
)
flags.DEFINE_integer(
    "replicas",
    None,
    "Sessions per variant (own variables, own memory "
    "layout); the fastest counts (default 2; quick 1).",
)
flags.DEFINE_float(
    "round_seconds", None, "Time of one variant in one round (default 0.12; quick 0.03)."
)
flags.DEFINE_integer("warmup_steps", None, "Untimed steps per session (default 10; quick 5).")
flags.DEFINE_integer("bad_step_repeats", None, "Bad steps timed per policy (default 3; quick 1).")
flags.DEFINE_float("batch_scale", None, "Multiplies every batch size (default 1).")
flags.DEFINE_integer("deep_layers", None, "Hidden layers of the deep narrow net (default 50).")
flags.DEFINE_integer("intra_op_threads", None, "Session intra-op threads (0: TensorFlow's).")
flags.DEFINE_integer("inter_op_threads", None, "Session inter-op threads (0: TensorFlow's).")
flags.DEFINE_integer("seed", None, "Seed of the data, weights and variant order.")
flags.DEFINE_bool(
    "memory", True, "Trace a few steps of each variant for the most bytes its step holds at once."
)
flags.DEFINE_bool(
    "profile",
    False,
    "Instead of timing, profile traced steps of each variant against the unguarded op "
    "(RunMetadata step stats): nodes executed, op time, and what the guard adds by op type "
    "and name scope. Defaults: --models=deep --optimizers=sgd and our two modes (raise); "
    "flags given explicitly still win.",
)
flags.DEFINE_bool(
    "startup",
    False,
    "Instead of timing steps, time what a user waits for before the first step: building "
    "the train op and the graph, then session, initializers and first step, guarded (both "
    "modes) against tf-slim's, in fresh graphs. Default --models=resnet_v1_50,inception_v1 "
    "(the launcher's nets, any of slim_nanguard.app.models').",
)
flags.DEFINE_integer("startup_repeats", 3, "Repeats per variant for --startup (medians).")
flags.DEFINE_bool(
    "faults",
    False,
    "Instead of timing, train the default config's run with a fault of each cause (a "
    "transient NaN, a bad example, a learning-rate jump, and none) under each of "
    "--fault_policies, and print the test accuracy, the bad steps and the triage's verdicts.",
)
flags.DEFINE_list("fault_policies", ["skip", "rollback"], "The nan_policy values for --faults.")
flags.DEFINE_list(
    "fault_modes", ["check_numerics"], "The modes for --faults: check_numerics, hook."
)
flags.DEFINE_integer("fault_steps", 2000, "Training steps of each --faults run.")
flags.DEFINE_string(
    "fault_workdir", None, "Where the --faults runs train; default: a temporary directory."
)
flags.DEFINE_integer("profile_steps", 10, "Traced steps per variant for --profile (averaged).")
flags.DEFINE_integer("profile_top", 8, "Largest groups shown per variant for --profile.")

_SETTING_FLAGS = (
    "rounds",
    "chunks",
    "replicas",
    "round_seconds",
    "warmup_steps",
    "bad_step_repeats",
    "batch_scale",
    "deep_layers",
    "intra_op_threads",
    "inter_op_threads",
    "seed",
)


def settings_from_flags():
    """The `Settings` the flags ask for (--quick first, explicit flags over it)."""
    from slim_nanguard.app import benchmarking  # pylint: disable=import-outside-toplevel

    values = dict(benchmarking.QUICK) if FLAGS.quick else {}
    if FLAGS.profile:
        values.update(benchmarking.PROFILE)
    for name in ("models", "optimizers", "variants"):
        if FLAGS[name].value:
            values[name] = tuple(FLAGS[name].value)
    for name in _SETTING_FLAGS:
        if FLAGS[name].value is not None:
            values[name] = FLAGS[name].value
    try:
        return benchmarking.Settings(**values)
    except ValueError as err:
        raise app.UsageError(str(err)) from None


flags.DEFINE_bool(
    "keep_freed_memory",
    True,
    "Have glibc malloc keep freed memory (one "
    "arena, no trim, no mmap below 32 MiB) so that no session page-faults its "
    "step's tensors back in every step; which sessions did so was down to "
    "allocation history, not to the variant, and moved their times by up to 10%.",
)

# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def keep_freed_memory() -> bool:
    """Stops glibc returning freed memory to the system; True if it took effect."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # Not glibc: nothing to tune.
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    # One arena: a thread's own arena unmaps a heap as soon as it is empty, whatever the trim
    # threshold, so a 16 MiB gradient freed by another thread was faulted in again each step.
    return all(
        mallopt(param, value)
        for param, value in (
            (_M_ARENA_MAX, 1),
            (_M_MMAP_THRESHOLD, 32 * 2**20),
            (_M_TRIM_THRESHOLD, 2**31 - 1),
        )
    )


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if FLAGS.keep_freed_memory and not keep_freed_memory():
        logging.warning("could not tune malloc (not glibc?); times may include page faults.")
    tf.compat.v1.disable_v2_behavior()
    from slim_nanguard.app import benchmarking  # pylint: disable=import-outside-toplevel

    # The guard logs each bad step it is shown; the benchmark shows it many on purpose.
    logging.set_verbosity(logging.ERROR)
    if FLAGS.faults:
        _faults()
        return
    if FLAGS.startup:
        report = benchmarking.run_startup(
            FLAGS.models or benchmarking.STARTUP_MODELS,
            repeats=FLAGS.startup_repeats,
            log=lambda line: print(line, flush=True),
        )
        print(benchmarking.format_startup(report))
        if FLAGS.out:
            with tf.io.gfile.GFile(FLAGS.out, "w") as f:
                json.dump(report, f, indent=1)
        return
    settings = settings_from_flags()
    if FLAGS.profile:
        if FLAGS.profile_steps < 1:
            raise app.UsageError(f"--profile_steps must be >= 1; got {FLAGS.profile_steps}.")
        report = benchmarking.run_profile(
            settings, steps=FLAGS.profile_steps, top=FLAGS.profile_top
        )
        tables = "\n\n".join(benchmarking.format_profile(p) for p in report["profiles"])
        method = f"{FLAGS.profile_steps} traced steps per variant"
    else:
        report = benchmarking.run_benchmark(
            settings, memory=FLAGS.memory, log=lambda line: print(line, flush=True)
        )
        tables = benchmarking.format_tables(report)
        method = (
            f"{settings.rounds} rounds x {settings.replicas} sessions x {settings.chunks} chunks"
        )
    machine = report["machine"]
    header = (
        f"{machine['cores']} cores, {machine['cpu']}, TensorFlow {machine['tensorflow']}, "
        f"Python {machine['python']}; {method}; {report['seconds']:.0f} s"
    )
    _show(report, header + "\n\n" + tables)


def _show(report, text: str) -> None:
    """Prints `text`; writes `report` to --out and `text` to --markdown when asked."""
    print(text)
    if FLAGS.out:
        with tf.io.gfile.GFile(FLAGS.out, "w") as f:
            json.dump(report, f, indent=1)
    if FLAGS.markdown:
        with tf.io.gfile.GFile(FLAGS.markdown, "w") as f:
            f.write(text + "\n")


def _faults() -> None:
    """--faults: every fault under every policy, as one table."""
    import tempfile  # pylint: disable=import-outside-toplevel

    from slim_nanguard.app import fault_bench  # pylint: disable=import-outside-toplevel

    workdir = FLAGS.fault_workdir or tempfile.mkdtemp(prefix="nanguard_faults_")
    print(f"training in {workdir}", flush=True)
    report = fault_bench.run_fault_bench(
        workdir, policies=FLAGS.fault_policies, steps=FLAGS.fault_steps, modes=FLAGS.fault_modes
    )
    _show(report, fault_bench.format_fault_bench(report))


def run():
    """Entry point of the ``slim-nanguard-benchmark`` command."""
    _quiet_start.show_flags_in_help(__name__, __doc__)
    app.run(main)


if __name__ == "__main__":
    run()
