"""Start-up of the launchers: keeps TensorFlow's start-up noise off the terminal.

Imported by ``train.py`` and ``eval.py`` before TensorFlow. Importing TensorFlow prints, on
stderr and below any log-level setting, a banner (oneDNN, CUDA drivers, CPU instructions,
"All log messages before absl::InitializeLog()"), twice, and the first session adds a
``cuInit`` error on a machine without a GPU. A launcher's output is its own: progress, the
summary, and for bad input one or two lines. So unless ``--verbosity`` (on the command line)
asks for more, `quiet_imports` sends file descriptor 2 to /dev/null while TensorFlow loads,
and ``TF_CPP_MIN_LOG_LEVEL`` defaults to 3 (an explicit setting in the environment is kept).
"""

import contextlib
import functools
import os
import re
import sys
import warnings
from typing import Iterator, Sequence

_VERBOSITY = re.compile(r"^--?(?:verbosity|v)(?:=(.*))?$")

# absl's help flags: each shows the help and exits with status 1.
_HELP_FLAGS = ("help", "helpshort", "helpfull", "helpxml")


def verbosity_asked(argv: Sequence[str]) -> bool:
    """Whether the command line sets ``--verbosity`` (or ``-v``) to 1 or more."""
    for index, arg in enumerate(argv[1:], 1):
        match = _VERBOSITY.match(arg)
        if match:
            value = match.group(1)
            if value is None:
                value = argv[index + 1] if index + 1 < len(argv) else ""
            try:
                return int(value) >= 1
            except ValueError:
                return False
    return False


@contextlib.contextmanager
def quiet_imports(argv: Sequence[str]) -> Iterator[None]:
    """While active, and unless `argv` asks for verbosity, C-level stderr goes nowhere."""
    if verbosity_asked(argv):
        yield
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def quiet_tensorflow(verbosity: int) -> None:
    """Hides TensorFlow's and tf-slim's deprecation chatter unless `verbosity` asks for it.

    Call it once TensorFlow is imported, before training.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    # absl's handler on the root logger prints TensorFlow's lines; TensorFlow's own handler
    # would print each one a second time.
    for handler in list(tf.get_logger().handlers):
        tf.get_logger().removeHandler(handler)
    if verbosity < 1:
        # Errors only, and the guard's own lines: it logs each bad step on TensorFlow's
        # logger, where NanTensorHook logs its "Model diverged with loss = NaN.".
        tf.get_logger().addFilter(
            lambda record: (
                record.levelno >= tf.compat.v1.logging.ERROR
                or "slim_nanguard:" in record.getMessage()
            )
        )
        warnings.filterwarnings("ignore", category=UserWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)


def show_flags_in_help(module_name: str, doc: str) -> None:
    """Makes ``--help`` and ``--helpshort`` list the launcher's flags, however it is started.

    absl lists the key flags of the module named ``sys.argv[0]``. Run by path
    (``python scripts/train.py``) those are the script's flags; run as a console command
    (``slim-nanguard-train``) the main module is the generated wrapper, which has none, and
    no docstring either. This registers the launcher's flags for it, and its docstring.

    absl's help flags (``--help``, ``--helpshort``, ``--helpfull``, ``--helpxml``) also exit
    with status 1 once the help is shown; help that was asked for is no error, so here they
    exit with 0. Call it in the launcher's ``run()``, before ``app.run``.
    """
    from absl import app  # pylint: disable=import-outside-toplevel
    from absl import flags  # pylint: disable=import-outside-toplevel

    app.define_help_flags()  # Idempotent: app.run calls it too.
    for name in _HELP_FLAGS:
        flag = flags.FLAGS[name]
        if not isinstance(flag.parse, functools.partial):  # once per flag
            flag.parse = functools.partial(_help_exits_zero, flag.parse)
    main = sys.modules.get("__main__")
    if main is not None and not getattr(main, "__doc__", None):
        main.__doc__ = doc
    if module_name == "__main__":
        return
    for flag in flags.FLAGS.flags_by_module_dict().get(module_name, ()):
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)


def _help_exits_zero(parse, argument: str) -> None:
    """Parses a help flag; the exit after the help it shows is a success (status 0)."""
    try:
        parse(argument)
    except SystemExit as exit_:
        if exit_.code == 1:
            raise SystemExit(0) from None
        raise
