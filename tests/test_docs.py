"""What the documentation promises, held to what the package and CI do.

docs/model_garden.md tells a user of the TF model garden's ``train_image_classifier.py``
which lines to change. Those lines must name what slim_nanguard and tf_slim really take, and the
loop they build (``tf_slim.learning.train`` with ``train_step_fn`` and ``saver=FiniteSaver()``)
must work in both modes, as the page says. The README says CI tests the oldest TensorFlow that
setup.cfg allows; .ci/oldest_tf must test that version. docs/design.md holds the project's one
module map, and it must name every module the package has.
"""

import ast
import configparser
import inspect
import pathlib
import re

import pytest
import tensorflow as tf
import tf_slim as slim

import slim_nanguard
from slim_nanguard import _policy

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
    assert names >= {"create_train_op", "make_train_step", "FiniteSaver"}
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


@pytest.mark.parametrize("mode", sorted(lib.MODES))
def test_learning_train_with_the_pages_arguments_stops_with_a_finite_checkpoint(tmp_path, mode):
    """The page's loop in either mode: a NaN gradient at batch 3 under `stop` ends the run,
    and learning.train's closing save (through FiniteSaver) holds the last good step."""
    model = lib.build_model(
        check_numerics=lib.MODES[mode], nan_policy="stop", faults={BAD_BATCH: "nan_gradient"}
    )
    with model.graph.as_default():
        slim.learning.train(
            model.train_op,
            str(tmp_path),
            train_step_fn=slim_nanguard.make_train_step(str(tmp_path)),
            saver=slim_nanguard.FiniteSaver(),
            number_of_steps=STEPS,
            save_summaries_secs=None,
            save_interval_secs=None,
        )
    guard = slim_nanguard.get_guard(model.train_op)
    assert (guard.last_event.step, guard.last_event.action) == (BAD_BATCH, "stop")
    values = lib.checkpoint_values(tf.train.latest_checkpoint(str(tmp_path)))
    assert int(values["global_step"]) == BAD_BATCH
    lib.assert_all_finite(values)


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
