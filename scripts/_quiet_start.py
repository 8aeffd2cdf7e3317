"""Start-up of the launchers: keeps TensorFlow's start-up noise off the terminal.

Imported by ``train.py`` and ``eval.py`` before TensorFlow. Importing TensorFlow prints, on
stderr and below any log-level setting, a banner (oneDNN, CUDA drivers, CPU instructions,
"All log messages before absl::InitializeLog()"), twice, and the first session adds a
``cuInit`` error on a machine without a GPU. A launcher's output is its own: progress, the
summary, and for bad input one or two lines. So unless ``--verbosity`` (on the command line)
asks for more, `quiet_imports` sends file descriptor 2 to /dev/null while TensorFlow loads,
and ``TF_CPP_MIN_LOG_LEVEL`` defaults to 3 (an explicit setting in the environment is kept).

Before any of that, `check_flags_early` checks the command line against the launcher's flag
table (``_flag_table.py``: each flag's name, type, choices and bounds), so that a typo or a bad
value is answered at once instead of after TensorFlow's import. ``python3
scripts/_quiet_start.py`` rewrites the table from the launchers' own flag definitions.
"""

import contextlib
import copy
import dataclasses
import functools
import importlib.util
import json
import os
import pprint
import re
import subprocess
import sys
import warnings
from typing import Dict, Iterator, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
# The launchers whose flags the table holds, by script name.
LAUNCHERS = ("train", "eval", "autopsy", "benchmark")

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


def _flag_table() -> Dict[str, dict]:
    spec = importlib.util.spec_from_file_location(
        "slim_nanguard_flag_table", os.path.join(HERE, "_flag_table.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FLAGS


def started_as(argv: Sequence[str], script: str, module_name: str) -> bool:
    """Whether launcher `script` (its module named `module_name`) was started by `argv`: run
    by path as the main module, or as its console command (not imported or run by a test)."""
    name = os.path.basename(argv[0]) if argv else ""
    if module_name == "__main__":
        return name == f"{script}.py"
    return name == f"slim-nanguard-{script}"


def check_flags_early(argv: Sequence[str], script: str, module_name: str, doc: str = "") -> None:
    """Answers a bad command line of launcher `script`, or ``--help``, before TensorFlow.

    Parses `argv` (flagfiles included) against the table's flags of `script` and absl's own.
    ``--help`` (``--helpshort``) prints `doc` and the launcher's flags and exits with status
    0. An unknown flag, a bad value or a missing required flag prints absl's two lines and
    exits with status 1, as ``app.run`` does; so does a problem ``slim_nanguard/app/
    preflight.py`` sees in the values (a bad ``--inject_fault``, a missing ``--dataset_dir``,
    an unwritable local ``--train_dir``), in the launcher's one or two lines. Does nothing
    unless `argv` started the launcher (`started_as`); ``--helpfull`` and ``--helpxml`` (which
    list TensorFlow's flags too) are left to ``app.run``, as are the checks the table cannot
    make (the launcher's validators across flags).

    Args:
      argv: The command line (``sys.argv``).
      script: The launcher: ``"train"``, ``"eval"``, ``"autopsy"`` or ``"benchmark"``.
      module_name: The launcher module's ``__name__``.
      doc: The launcher's docstring, the head of its help.
    """
    if not started_as(argv, script, module_name) or any(
        re.match(r"^--?(no(help|helpshort)|helpfull|helpxml)(=|$)", arg) for arg in argv[1:]
    ):
        return
    from absl import app  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    from absl import flags  # pylint: disable=import-outside-toplevel
    from absl import logging  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import

    one_line_interrupt(argv)
    values = copy.deepcopy(flags.FLAGS)
    table = _flag_table()
    for name, spec in {**table["common"], **table[script]}.items():
        if name not in values:
            _define(flags, values, name, spec)
    if any(re.match(r"^--?(help|helpshort)(=|$)", arg) for arg in argv[1:]):
        _print_help(flags, table[script], argv[0], doc)
    try:
        values(list(argv))
    except flags.Error as error:
        sys.stderr.write(f"FATAL Flags parsing error: {error}\n")
        sys.stderr.write("Pass --helpshort or --helpfull to see help on flags.\n")
        sys.exit(1)
    if script == "train":
        given = {name: values[name].value for name in table[script]}
        problems = _preflight().train_problems(given)
        problems += [] if given.get("ps_hosts") else _guard_problems(given)
    elif script == "eval":
        problems = _preflight().eval_problems({"checkpoint_path": values["checkpoint_path"].value})
    else:
        problems = []
    for line in problems[:1]:
        print(f"{os.path.basename(argv[0])}: error: {line}", file=sys.stderr)
    if problems:
        sys.exit(1)


def _print_help(flags, specs: Dict[str, dict], prog: str, doc: str) -> None:
    """Prints what absl's ``--help`` prints (`doc`, then the flags `specs` describe); exits 0."""
    values = flags.FlagValues()
    for name, spec in specs.items():
        _define(flags, values, name, spec)
        values.register_key_flag_for_module(prog, values[name])
    print(doc or f"\nUSAGE: {prog} [flags]\n")
    print(f"flags:\n{values.module_help(prog)}\n")
    print("Try --helpfull to get a list of all flags.")
    sys.exit(0)


def one_line_interrupt(argv: Sequence[str]) -> None:
    """Makes a Ctrl-C that nothing caught (one during start-up: TensorFlow's import, the graph's
    build) end with one line instead of a traceback, unless `argv` asks for verbosity. The exit
    status stays 130 (Python's for an uncaught ``KeyboardInterrupt``)."""
    if verbosity_asked(argv):
        return
    prog = os.path.basename(argv[0])
    previous = sys.excepthook

    def hook(kind, value, traceback):
        if not issubclass(kind, KeyboardInterrupt):
            previous(kind, value, traceback)
            return
        print(f"{prog}: interrupted by Ctrl-C (--verbosity=1 shows where).", file=sys.stderr)

    sys.excepthook = hook


def _preflight():
    """``slim_nanguard/app/preflight.py``, loaded by its path: ``import slim_nanguard`` would
    import TensorFlow."""
    package = importlib.util.find_spec("slim_nanguard").submodule_search_locations[0]
    spec = importlib.util.spec_from_file_location(
        "slim_nanguard_preflight", os.path.join(package, "app", "preflight.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses looks the module up
    spec.loader.exec_module(module)
    return module


def _guard_problems(given: Dict[str, object]) -> list:
    """What ``GuardConfig`` (the guard's one home of its settings' checks) says of the guard
    flags in `given`, opened by the flag and its value as the run says it (none: []).

    ``slim_nanguard/_policy.py`` and the two modules it imports need no TensorFlow; they are
    loaded under a stand-in of the package (its ``__init__`` imports TensorFlow), which is
    then removed, so that the run imports the package whole."""
    if "slim_nanguard" in sys.modules:  # Imported already (TensorFlow too): use it.
        guard_config = importlib.import_module("slim_nanguard._policy").GuardConfig
    else:
        package = importlib.util.find_spec("slim_nanguard").submodule_search_locations[0]
        stand_in = type(sys)("slim_nanguard")
        stand_in.__path__ = [package]
        before = set(sys.modules)
        sys.modules["slim_nanguard"] = stand_in
        try:
            guard_config = importlib.import_module("slim_nanguard._policy").GuardConfig
        finally:
            for name in set(sys.modules) - before:
                if name.partition(".")[0] == "slim_nanguard":
                    del sys.modules[name]
    settings = {f.name: given[f.name] for f in dataclasses.fields(guard_config) if f.name in given}
    settings.pop("reasons", None)  # module:name entries, imported by the run
    if settings.get("spike_policy") == "none":
        settings["spike_policy"] = None
    try:
        guard_config(**settings)
    except ValueError as err:
        name = str(err).split(" ", 1)[0]
        return [f"--{name}={given[name]}: {err}" if name in given else str(err)]
    return []


def _define(flags, values, name: str, spec: dict) -> None:
    """Defines flag `name` of the table in `values`, with its default and help."""
    kind, default, text = spec["type"], spec.get("default"), spec.get("help", "")
    common = dict(flag_values=values, short_name=spec.get("short"))
    if kind == "enum":
        flags.DEFINE_enum(name, default, spec["choices"], text, **common)
    elif kind == "bool":
        flags.DEFINE_boolean(name, default, text, **common)
    elif kind in ("int", "float"):
        define = flags.DEFINE_integer if kind == "int" else flags.DEFINE_float
        bounds = dict(lower_bound=spec.get("lower"), upper_bound=spec.get("upper"))
        define(name, default, text, **bounds, **common)
    elif kind == "list":
        flags.DEFINE_list(name, default, text, **common)
    else:
        flags.DEFINE_string(name, default, text, **common)
    values[name].help = text  # DEFINE_enum put its choices in front: the table has them
    if spec.get("required"):
        flags.mark_flag_as_required(name, flag_values=values)


_PARSER_TYPES = {
    "EnumParser": "enum",
    "BooleanParser": "bool",
    "IntegerParser": "int",
    "FloatParser": "float",
    "ListParser": "list",
}


def describe_flags(flag_values, names: Sequence[str], shown: bool = True) -> Dict[str, dict]:
    """The table's entries of flags `names` of `flag_values` (absl `FlagValues`); their help and
    default only if they are `shown` by ``--help`` (TensorFlow's, some set by the environment,
    are not)."""
    table = {}
    for name in sorted(names):
        flag = flag_values[name]
        spec = {"type": _PARSER_TYPES.get(type(flag.parser).__name__, "string")}
        if shown:
            spec["help"], spec["default"] = flag.help, flag.default
        if spec["type"] == "enum":
            spec["choices"] = list(flag.parser.enum_values)
        for key, attr in (("lower", "lower_bound"), ("upper", "upper_bound")):
            if getattr(flag.parser, attr, None) is not None:
                spec[key] = getattr(flag.parser, attr)
        if flag.short_name:
            spec["short"] = flag.short_name
        if any(
            "must have a value other than None" in getattr(v, "message", "")
            for v in flag.validators
        ):
            spec["required"] = True
        table[name] = spec
    return table


# Run in a fresh process: loads each launcher (its flags, not its main) and prints the table.
_DESCRIBE = """
import json, runpy, sys
from absl import app, flags, logging
sys.path.insert(0, {here!r})
import importlib.util
spec = importlib.util.spec_from_file_location("q", {quiet!r})
quiet = importlib.util.module_from_spec(spec); spec.loader.exec_module(quiet)
absl_flags = set(flags.FLAGS)
import tensorflow, slim_nanguard.app  # their flags too: any launcher accepts them
table = {{"common": quiet.describe_flags(flags.FLAGS, set(flags.FLAGS) - absl_flags, False)}}
for script in {launchers!r}:
    before = set(flags.FLAGS)
    runpy.run_path({here!r} + "/" + script + ".py", run_name="flag_table")
    new = set(flags.FLAGS) - before
    table[script] = quiet.describe_flags(flags.FLAGS, new)
    for name in new:
        delattr(flags.FLAGS, name)
print("TABLE" + json.dumps(table))
"""


def launcher_flags() -> Dict[str, Dict[str, dict]]:
    """The table as the launchers define their flags today (imports TensorFlow, in a child):
    ``{"common": flags TensorFlow's import defines, launcher: its flags}``."""
    code = _DESCRIBE.format(
        here=HERE, quiet=os.path.join(HERE, "_quiet_start.py"), launchers=LAUNCHERS
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"reading the launchers' flags failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.split("TABLE", 1)[1])


_TABLE_HEADER = '''"""The launchers' flags, for `_quiet_start.check_flags_early` (no TensorFlow).

Written by ``python3 scripts/_quiet_start.py``; tests/test_fast_flags.py checks it against the
launchers' own definitions.
"""

'''

if __name__ == "__main__":
    TABLE = pprint.pformat(launcher_flags(), sort_dicts=False)
    with open(os.path.join(HERE, "_flag_table.py"), "w", encoding="utf-8") as out:
        out.write(f"{_TABLE_HEADER}FLAGS = {TABLE}\n")
