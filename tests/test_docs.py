"""What the documentation promises, held to what the package and CI do.

docs/model_garden.md tells a user of the TF model garden's ``train_image_classifier.py``
which lines to change. Those lines must name what slim_nanguard and tf_slim really take, and the
loop they build (``tf_slim.learning.train`` with ``train_step_fn`` and ``saver=FiniteSaver()``)
must work in both modes, as the page says. The README says CI tests the oldest TensorFlow that
setup.cfg allows; .ci/oldest_tf must test that version. docs/design.md holds the project's one
module map, and it must name every module the package has. Every output README.md and docs/
quote is what the code prints, or is marked as an example; the run time of the shipped configs
is one measured figure, and the plot extra has one install hint.
"""

import ast
import configparser
import dataclasses
import functools
import inspect
import pathlib
import re

import pytest
import source_trees
import tensorflow as tf
import tf_slim as slim

import slim_nanguard
from slim_nanguard import _policy
from slim_nanguard.app import plot as run_plot

import nanguard_testlib as lib

REPO = pathlib.Path(__file__).resolve().parents[1]
GARDEN_PAGE = REPO / "docs" / "model_garden.md"

BAD_BATCH = 3
STEPS = 6


def _garden_diff() -> str:
    """The page's listing of the changed lines (its one ```diff block)."""
    blocks = re.findall(r"```diff\n(.*?)```", GARDEN_PAGE.read_text(), flags=re.S)
    assert len(blocks) == 1, f"{GARDEN_PAGE} should hold one ```diff block, has {len(blocks)}"
    return blocks[0]


def _added_code() -> str:
    return "\n".join(line[1:] for line in _garden_diff().splitlines() if line.startswith("+"))


def _call_keywords(code: str, callee: str) -> set:
    """The keyword arguments of the first call of `callee` in `code` (up to its closing paren)."""
    start = code.index(callee + "(") + len(callee) + 1
    depth, end = 1, start
    while depth:
        depth += {"(": 1, ")": -1}.get(code[end], 0)
        end += 1
    return set(re.findall(r"\b(\w+)=", code[start:end]))


def test_the_model_garden_page_adds_only_names_slim_nanguard_exports():
    names = set(re.findall(r"\bslim_nanguard\.(\w+)", _added_code()))
    assert names >= {"create_train_op", "train_step", "FiniteSaver"}
    assert names <= set(slim_nanguard.__all__)


def test_the_model_garden_page_passes_only_arguments_the_functions_take():
    code = _added_code()
    create = inspect.signature(slim_nanguard.create_train_op).parameters
    assert _call_keywords(code, "slim_nanguard.create_train_op") <= set(create)
    # The lines added to the script's slim.learning.train(...) call.
    loop = set(re.findall(r"^\s+(\w+)=", code, flags=re.M)) - set(create)
    assert loop >= {"train_step_fn", "saver"}
    assert loop <= set(inspect.signature(slim.learning.train).parameters)


def test_the_model_garden_flags_offer_exactly_the_policies():
    code = _added_code()
    enums = dict(re.findall(r"DEFINE_enum\(\s*'(\w+)', '\w+', (\[[^\]]*\])", code))
    assert set(ast.literal_eval(enums["nan_policy"])) == set(_policy.POLICIES)
    persistent = ast.literal_eval(enums["persistent_nan_policy"])
    assert set(persistent) == set(_policy.PERSISTENT_POLICIES)
    # The help text's "10 bad steps in a row" is create_train_op's default.
    assert "what 10 bad steps in a row do" in code
    default = inspect.signature(slim_nanguard.create_train_op).parameters
    assert default["max_consecutive_bad_steps"].default == 10


def test_the_readme_links_the_model_garden_page():
    assert "(docs/model_garden.md)" in (REPO / "README.md").read_text()


def _learning_train(mode, policy, logdir, train_step_fn, finite_saver=True):
    """tf_slim.learning.train over a model whose batch 3 has a NaN gradient (with a
    FiniteSaver, or tf-slim's own Saver); the model."""
    model = lib.build_model(
        check_numerics=lib.MODES[mode], nan_policy=policy, faults={BAD_BATCH: "nan_gradient"}
    )
    with model.graph.as_default():
        slim.learning.train(
            model.train_op,
            str(logdir),
            train_step_fn=train_step_fn,
            number_of_steps=STEPS,
            save_summaries_secs=None,
            save_interval_secs=None,
            saver=slim_nanguard.FiniteSaver() if finite_saver else None,
        )
    return model


@pytest.mark.parametrize("mode", sorted(lib.MODES))
def test_learning_train_with_the_pages_arguments_stops_with_a_finite_checkpoint(tmp_path, mode):
    """The page's loop in either mode, written as the README and the page say
    (``train_step_fn=slim_nanguard.train_step``): a NaN gradient at batch 3 under `stop` ends
    the run, learning.train's closing save (through FiniteSaver) holds the last good step, and
    the bad step is in the run's record."""
    model = _learning_train(mode, "stop", tmp_path, slim_nanguard.train_step)
    guard = slim_nanguard.get_guard(model.train_op)
    assert (guard.last_event.step, guard.last_event.action) == (BAD_BATCH, "stop")
    values = lib.checkpoint_values(tf.train.latest_checkpoint(str(tmp_path)))
    assert int(values["global_step"]) == BAD_BATCH
    lib.assert_all_finite(values)
    recorded = [r for r in slim_nanguard.read_events(str(tmp_path)) if r["kind"] == "bad_step"]
    assert [(r["step"], r["action"]) for r in recorded] == [(BAD_BATCH, "stop")]


@pytest.mark.parametrize("mode", sorted(lib.MODES))
def test_train_step_without_a_summary_writer_says_once_that_it_keeps_no_record(
    tmp_path, mode, caplog
):
    """learning.train(summary_writer=None) gives train_step no directory: two bad steps are
    skipped, and one line says no record is kept and what to pass instead."""
    model = lib.build_model(
        check_numerics=lib.MODES[mode],
        nan_policy="skip",
        faults={BAD_BATCH: "nan_gradient", BAD_BATCH + 1: "nan_loss"},
    )
    with model.graph.as_default(), caplog.at_level("WARNING"):
        slim.learning.train(
            model.train_op,
            str(tmp_path),
            train_step_fn=slim_nanguard.train_step,
            saver=slim_nanguard.FiniteSaver(),
            number_of_steps=STEPS,
            summary_writer=None,
            save_summaries_secs=None,
            save_interval_secs=None,
        )
    assert slim_nanguard.get_guard(model.train_op).state.skips == 2
    told = [r.getMessage() for r in caplog.records if "leave no nanguard_events" in r.getMessage()]
    assert len(told) == 1 and "make_train_step(logdir)" in told[0]
    assert slim_nanguard.read_events(str(tmp_path)) == []


def _module_map_rows(prefix: str) -> str:
    """The rows of docs/design.md's module map whose first cell starts with `prefix`."""
    text = (REPO / "docs" / "design.md").read_text()
    section = text.split("## Where each piece lives", 1)[1].split("\n## ", 1)[0]
    return "\n".join(line for line in section.splitlines() if line.startswith(f"| `{prefix}"))


@pytest.mark.parametrize("package", ["slim_nanguard", "slim_nanguard/app"])
def test_the_module_map_names_every_module(package):
    rows = _module_map_rows(package + "/")
    if package == "slim_nanguard":
        rows = "\n".join(row for row in rows.splitlines() if "slim_nanguard/app" not in row)
    modules = sorted(p.name for p in (REPO / package).glob("*.py") if p.name != "__init__.py")
    assert modules
    missing = [name for name in modules if not re.search(rf"[`/]{re.escape(name)}`", rows)]
    assert not missing, f"docs/design.md's module map names no {missing} of {package}/"


def test_the_readme_has_no_module_map_of_its_own():
    assert "slim_nanguard/_" not in (REPO / "README.md").read_text()


def _oldest_tf_script_value(name: str) -> str:
    match = re.search(rf"^{name}=(\S+)$", (REPO / ".ci" / "oldest_tf").read_text(), flags=re.M)
    assert match, f".ci/oldest_tf sets no {name}"
    return match.group(1)


def test_ci_tests_the_oldest_tensorflow_setup_cfg_allows():
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    requires = config["options"]["install_requires"]
    lower = {
        name: re.search(rf"^{name}>=([\d.]+)", requires, flags=re.M).group(1)
        for name in ("tensorflow", "tf-keras")
    }
    oldest = _oldest_tf_script_value("OLDEST_TF")
    assert lower == {"tensorflow": oldest, "tf-keras": oldest}
    script = (REPO / ".ci" / "oldest_tf").read_text()
    core = re.search(r"^CORE_TESTS=\((.*?)\)", script, flags=re.S | re.M).group(1).split()
    assert core and all((REPO / path).is_file() for path in core), core
    assert re.search(r"^\.ci/oldest_tf$", (REPO / ".ci" / "run").read_text(), flags=re.M)


# ------------------------------------------------------- every quoted output, held to the code
#
# A quoted output is a fenced block with no language (or ``text``, ``console``, ``log``), and
# an inline quote (in backticks or double quotes) of a message: one that names the guard, a
# log line, an error, or a line of the launcher's summary (`_OUTPUT_CUE`). Each is either
#   - produced here by the code (`_PRODUCERS`: the guard's log line of a bad step or a spike,
#     rendered from the quote's own figures, must read as quoted), or
#   - a message of TensorFlow or tf-slim (`_EXTERNAL`: found in the installed package), or
#   - made of the code's own words: with "..." and the figures (numbers, paths) left out,
#     every stretch of text is in one string of slim_nanguard/, scripts/ or research/
#     (`_code_text`), or
#   - in a block marked as an example: the line before its fence is `EXAMPLE_MARKER`.

EXAMPLE_MARKER = re.compile(r"^Example output(?: \(abridged\))?:$")
DOC_PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_OUTPUT_CUE = re.compile(
    r"slim_nanguard[: ]|^WARNING:|^ERROR:|Model diverg|Stopping Training|Finished training"
    r"|not found in checkpoint|rendezvous|Error\b|error\b|The last good state|caught this"
    r"|no NanLossHook|carried the spike|^(?:bad steps|spikes|lr scale|rolled back) \S"
)
# Messages of TensorFlow, tf-slim or tf-keras the docs quote: a fragment and where it is said.
_SITE = pathlib.Path(tf.__file__).resolve().parents[1]
_EXTERNAL = {
    "Stopping Training.": "tf_slim/learning.py",
    "Finished training! Saving model to disk.": "tf_slim/learning.py",
    "Graph execution error": "tensorflow/python/framework/error_interpolation.py",
    "Local rendezvous is aborting with status": "tensorflow/libtensorflow_framework.so.2",
    "not found in checkpoint": "tensorflow/libtensorflow_framework.so.2",
    "is not available with Keras 3": "tensorflow/python/util/lazy_loader.py",
}


@dataclasses.dataclass(frozen=True)
class Quote:
    page: str
    line: int
    text: str
    example: bool  # in a block marked with EXAMPLE_MARKER


def _quotes(path: pathlib.Path):
    """The quoted outputs of one page."""
    text = path.read_text()
    name = path.relative_to(REPO).as_posix()
    fence = re.compile(r"^```(\w*)\n(.*?)^```$", flags=re.S | re.M)
    for block in fence.finditer(text):
        if block.group(1) not in ("", "text", "console", "log"):
            continue
        start = text.count("\n", 0, block.start()) + 1
        before = text[: block.start()].rstrip("\n").rsplit("\n", 1)[-1]
        example = bool(EXAMPLE_MARKER.match(before.strip()))
        for offset, line in enumerate(block.group(2).splitlines(), start=1):
            if line.strip():
                yield Quote(name, start + offset, line.strip(), example)
    prose = fence.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    spans = re.compile(r"`([^`]+)`|(?<![\w`])\"([^\"`]+)\"")
    for span in spans.finditer(prose):
        quoted = " ".join((span.group(1) or span.group(2)).split())
        if " " in quoted and _OUTPUT_CUE.search(quoted):
            line = prose.count("\n", 0, span.start()) + 1
            yield Quote(name, line, quoted, False)


def _all_quotes():
    return [quote for page in DOC_PAGES for quote in _quotes(page)]


def _elided(quote: str) -> re.Pattern:
    """`quote` as a pattern: each "..." stands for any text, all else is literal."""
    pieces = re.split(r"\s*(?<![./\w])\.\.\.(?![/\w])\s*", quote)
    return re.compile(r".*?".join(re.escape(p) for p in pieces), flags=re.S)


def _logged(event) -> str:
    """What `log_event` prints for `event` through Python logging's default format."""
    import io
    import logging as pylogging

    from slim_nanguard import _nan_event

    stream = io.StringIO()
    handler = pylogging.StreamHandler(stream)
    handler.setFormatter(pylogging.Formatter("%(levelname)s:%(name)s:%(message)s"))
    logger = pylogging.getLogger("tensorflow")
    handlers, logger.handlers = logger.handlers, [handler]
    try:
        _nan_event.log_event(event)
    finally:
        logger.handlers = handlers
    return stream.getvalue()


_NUMBER = r"(-?(?:\d[\d.e+-]*|nan|inf))"


def _bad_step_line(quote: str) -> str:
    """The guard's log line for the bad step `quote` describes (its figures, its culprits)."""
    from slim_nanguard import _nan_event

    head = re.search(r"bad step \((\w+) mode\), action (\w+): global step (-?\d+)", quote)
    loss = re.search(rf"loss {_NUMBER} \((\w+)\)", quote)
    counts = re.search(r"bad step (\d+) in a row \((\d+) in all\)", quote)
    culprits = re.search(r"non-finite gradients of (.+?)(?:, holding (\w+))?, bad step", quote)
    names = tuple(culprits.group(1).split(", ")) if culprits else ()
    kinds = {"NaN": "nan", "Inf": "inf", "NaN and Inf": "nan_and_inf"}
    held = kinds.get(culprits.group(2)) if culprits and culprits.group(2) else None
    event = _nan_event.NanEvent(
        step=int(head.group(3)),
        loss=float(loss.group(1)),
        loss_kind=loss.group(2),
        culprits=names,
        consecutive=int(counts.group(1)),
        total=int(counts.group(2)),
        mode=head.group(1),
        action=head.group(2),
        culprit_kinds=(held,) * len(names) if held else (),
    )
    return _logged(event)


def _spike_line(quote: str) -> str:
    """The guard's log line for the spike `quote` describes (which value, its figures)."""
    from slim_nanguard import _nan_event
    from slim_nanguard import _spike
    from slim_nanguard._types import Fault

    names = {"loss": "loss", "data loss": "loss", "gradient norm": "grad_norm"}
    over = re.search(
        rf"spike: (loss|gradient norm) {_NUMBER} is {_NUMBER} deviations above the typical "
        rf"{_NUMBER} \(spike_sigma={_NUMBER}, over the last (\d+) accepted steps"
        rf"(?:; ((?:data )?loss|gradient norm) z {_NUMBER})?\)",
        quote,
    )
    assert over, f"no spike figures in {quote!r}"
    jumped, other = names[over.group(1)], names.get(over.group(7) or "", None)
    report = {
        jumped: float(over.group(2)),
        "z_" + jumped: float(over.group(3)),
        "typical_" + jumped: float(over.group(4)),
        "sigma": float(over.group(5)),
        "window_steps": int(over.group(6)),
        "accepted_steps": int(over.group(6)),
        "over": [jumped],
    }
    if other:
        report["z_" + other] = float(over.group(8))
    if over.group(7) == "data loss":  # regularization taken out of the loss judged
        report["regularization_terms"] = 1
    event = _nan_event.NanEvent(
        step=0,
        loss=1.0,
        loss_kind="finite",
        culprits=(),
        consecutive=1,
        total=1,
        mode="check_numerics",
        action="skip",
        cause=Fault.SPIKE,
        figures=report,
        reason=_spike.Spike("skip", report["sigma"], _policy.GuardConfig().spike_warmup_steps),
    )
    return _logged(event)


# Quotes the code can print again, by what they say: a pattern, and what renders them.
_PRODUCERS = [
    (re.compile(r"slim_nanguard: bad step \("), _bad_step_line),
    (re.compile(r"^Model diverging: .*spike: "), _spike_line),
]


@functools.lru_cache(maxsize=None)
def _code_text() -> str:
    """Every string literal of slim_nanguard/, scripts/ and research/, the pieces of f-strings
    apart, one per line."""
    pieces = []
    for root in ("slim_nanguard", "scripts", "research"):
        for path in sorted((REPO / root).rglob("*.py")):
            for node in ast.walk(source_trees.parse(path)):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    pieces.append(node.value)
    return "\n".join(pieces)


# What a quote leaves to the code's arguments: elisions, quoted values, and words with a "/",
# a "_", a digit or an inner "." (numbers, paths, op and file names); and where one string of
# the code may end and the next begin (after ". ", ", ", "; ", ": ", around parentheses). What
# lies between is the code's own words.
_FIGURE = re.compile(
    r"(?<![./\w])\.\.\.(?![/\w])|'[^']*'|\"[^\"]*\"|\S*(?:[/_\d]|\w\.\w)\S*"
    r"|[.;:,](?:\s|$)|\s\(|\)"
)


def _missing_words(quote: str):
    """The stretches of two words or more of `quote` that no string of the code holds."""
    text = _code_text()
    stretches = [" ".join(s.split()) for s in _FIGURE.split(quote)]
    return [s for s in stretches if len(s.split()) >= 2 and s not in text]


def _external_source(quote: str):
    for fragment, source in _EXTERNAL.items():
        if fragment in quote:
            return fragment, _SITE / source
    return None


def _in_file(fragment: str, path: pathlib.Path) -> bool:
    import mmap

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return data.find(fragment.encode()) >= 0


def _verdict(quote: Quote) -> str:
    """Why `quote` is true, or what is wrong with it (a sentence starting with "wrong")."""
    for pattern, produce in _PRODUCERS:
        if pattern.search(quote.text):
            printed = produce(quote.text)
            if _elided(quote.text).search(printed):
                return "produced"
            return f"wrong: the code prints {printed.strip()!r}"
    external = _external_source(quote.text)
    if external:
        fragment, path = external
        return "external" if _in_file(fragment, path) else f"wrong: {path} has no {fragment!r}"
    missing = _missing_words(quote.text)
    if not missing:
        return "the code's words"
    if quote.example:
        return "example"
    return f"wrong: no string of the code holds {missing}"


def test_the_docs_quote_what_the_code_prints():
    quotes = _all_quotes()
    assert len(quotes) > 10, "the finder of quoted outputs finds (almost) none"
    wrong = [
        f"{q.page}:{q.line}: {q.text[:100]!r}: {verdict}"
        for q in quotes
        for verdict in [_verdict(q)]
        if verdict.startswith("wrong")
    ]
    assert not wrong, "quoted outputs the code does not print:\n" + "\n".join(wrong)


def test_the_quote_checker_tells_todays_line_from_yesterdays():
    """The model garden page once quoted a finite loss under NaN's opening sentence."""
    stale = (
        "WARNING:tensorflow:Model diverged with loss = NaN. slim_nanguard: bad step "
        "(check_numerics mode), action skip: global step 5, loss 6.912142276763916 (finite), "
        "non-finite gradients of LeNet/conv1/weights, bad step 1 in a row (1 in all)"
    )
    assert _verdict(Quote("x", 1, stale, True)).startswith("wrong")
    today = stale.replace(
        "Model diverged with loss = NaN.",
        "Model diverged with non-finite gradients; the loss is finite.",
    )
    assert _verdict(Quote("x", 1, today, False)) == "produced"
    assert _verdict(Quote("x", 1, "slim_nanguard: the guard sang a song", False)).startswith(
        "wrong"
    )


# ------------------------------------------------------ one run time, one install hint
_TIME = re.compile(
    r"\b(?:\d[\d.]*|one|two|three|five|ten|a few)\s*(?:s|secs?|seconds?|minutes?|min)\b"
)


def test_the_default_run_time_is_one_measured_figure_with_its_machine():
    """The guide states the run time of the shipped configs once, measured, with the machine;
    the README's quick start and the configs refer to it and state none of their own."""
    launcher = (REPO / "docs" / "guide.md").read_text().split("## The launcher", 1)[1]
    figure = launcher.split("**Run time**", 1)[1].split("\n\n", 1)[0]
    assert re.search(r"configs/default\.cfg` took \*\*\d+ s\*\*", figure)
    assert "lscpu" in figure and "2 cores" in figure and "load average" in figure
    quick_start = (REPO / "README.md").read_text().split("## Quick start", 1)[1]
    quick_start = quick_start.split("\n## ", 1)[0].split("Install with the test extras", 1)[0]
    assert not _TIME.search(quick_start), quick_start
    assert "(docs/guide.md#the-launcher)" in quick_start
    for config in sorted((REPO / "configs").glob("*.cfg")):
        comments = " ".join(line for line in config.read_text().splitlines() if line[:1] == "#")
        assert not _TIME.search(" ".join(comments.split())), f"{config.name} states a run time"


def test_one_install_hint_for_the_plot_extra(monkeypatch, tmp_path):
    """The package is installed from a clone, so the hint is ``pip install '.[plot]'``
    everywhere: in the docs and in the autopsy's error."""
    import sys

    files = [*DOC_PAGES, *(REPO / "slim_nanguard").rglob("*.py")]
    files += [*(REPO / "scripts").glob("*.py"), *(REPO / "research").glob("*.py")]
    files += sorted((REPO / "configs").glob("*.cfg"))
    other = [str(f.relative_to(REPO)) for f in files if "slim_nanguard[" in f.read_text()]
    assert not other, f"{other} name the extra as slim_nanguard[...]; write '.[plot]'"
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install '\.\[plot\]'"):
        run_plot.plot_run(str(tmp_path), str(tmp_path / "run.png"))
    assert "pip install '.[plot]'" in (REPO / "docs" / "guide.md").read_text()


def _launcher_help_texts():
    """Every text ``--help`` shows: the launchers' docstrings and their flags' help."""
    for script in ("train", "eval", "autopsy", "benchmark"):
        tree = source_trees.parse(REPO / "scripts" / f"{script}.py")
        yield f"{script}.py", ast.get_docstring(tree, clean=False)
    namespace = {}
    exec((REPO / "scripts" / "_flag_table.py").read_text(), namespace)
    for script, table in namespace["FLAGS"].items():
        if script != "common":
            for name, spec in table.items():
                yield f"{script} --{name}", spec["help"]


def test_the_help_texts_carry_no_rst_and_name_the_console_commands():
    texts = dict(_launcher_help_texts())
    assert len(texts) > 100
    for where, text in texts.items():
        assert "``" not in text and "::" not in text, (where, text)
        assert "python scripts/" not in text and "python3 scripts/" not in text, (where, text)
    assert "slim-nanguard-train --flagfile=configs/default.cfg" in texts["train.py"]


@pytest.mark.parametrize("config", sorted((REPO / "configs").glob("*.cfg")), ids=lambda p: p.name)
def test_each_config_names_the_console_command_and_a_train_dir_not_named_like_the_package(config):
    """As the README does: ``slim-nanguard-train --flagfile=configs/...``. A train dir named
    /tmp/slim_nanguard/... would be imported as an empty ``slim_nanguard`` namespace package by
    any Python started in /tmp with an editable install."""
    text = config.read_text()
    assert "scripts/train.py" not in text
    assert f"slim-nanguard-train --flagfile=configs/{config.name}" in text
    train_dir = re.search(r"^--train_dir=(.*)$", text, re.M).group(1)
    assert "slim_nanguard" not in pathlib.PurePath(train_dir).parts, train_dir
    assert "slim-nanguard-train --flagfile=configs/" in (REPO / "README.md").read_text()
    for doc in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        assert "/tmp/slim_nanguard/" not in doc.read_text(), doc


# ------------------------------------------------------ a train_step_fn of one's own
def _guide_train_step_fn():
    """The guide's ``my_train_step``: its ```python block, run as written."""
    guide = (REPO / "docs" / "guide.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```$", guide, flags=re.S | re.M)
    code = [block for block in blocks if "def my_train_step(" in block]
    assert len(code) == 1, "docs/guide.md should show my_train_step once"
    namespace = {}
    exec(code[0], namespace)
    return namespace["my_train_step"]


@pytest.mark.parametrize("mode", sorted(lib.MODES))
def test_the_guides_own_train_step_fn_applies_the_policy(tmp_path, mode):
    """A train_step_fn of one's own that calls slim_nanguard.train_step, as the guide shows:
    the NaN gradient at batch 3 is skipped and recorded, and the checkpoint is finite."""
    model = _learning_train(mode, "skip", tmp_path, _guide_train_step_fn())
    assert slim_nanguard.get_guard(model.train_op).state.skips == 1
    lib.assert_all_finite(lib.checkpoint_values(tf.train.latest_checkpoint(str(tmp_path))))
    recorded = [r["action"] for r in slim_nanguard.read_events(str(tmp_path))]
    assert recorded == ["skip"]


@pytest.mark.parametrize("mode", sorted(lib.MODES))
def test_keeping_tf_slims_train_step_inside_ones_own_fails_with_advice_that_fits(tmp_path, mode):
    """The same function with slim.learning.train_step inside: the first bad step ends the loop,
    and the error says what to call instead."""

    def unguarded_step(sess, train_op, global_step, train_step_kwargs):
        return slim.learning.train_step(sess, train_op, global_step, train_step_kwargs)

    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        _learning_train(mode, "skip", tmp_path, unguarded_step, finite_saver=False)
    advice = "a train_step_fn of your own calls it instead of tf_slim.learning.train_step"
    assert advice in raised.value.message
