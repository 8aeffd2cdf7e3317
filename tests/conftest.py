"""Shared pytest setup: graph-mode TensorFlow, quiet logs."""

import ast
import functools
import os
import pathlib
from typing import FrozenSet, Set

import pytest
import source_trees

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

tf.compat.v1.disable_v2_behavior()


# ------------------------------------------------------------------------------- two tiers
# ``pytest -m "not slow"`` is the quick tier (the README gives its time); the default run and CI
# run both tiers. The slow tier holds
# - every test that starts a Python process (found in its module's source: a reference to
#   subprocess, sys.executable or run_table_script, directly or through a function or fixture
#   of the module): each pays seconds for ``import tensorflow`` alone;
# - the further cases of a parametrized test: the quick tier runs each test function once,
#   with its first parameters, the slow tier the rest of the matrix;
# - whole files of end-to-end stories (`SLOW_FILES`) and single tests (`SLOW_TESTS`), with why.
_STARTS_A_PROCESS = {"subprocess", "executable", "run_table_script", "Popen"}
_NETS = ("resnet_v1_50", "resnet_v2_50", "inception_v1", "vgg_a", "alexnet_v2")
SLOW_FILES = {
    "test_every_batch.py": "every loop x mode x input x autopsy setting, trained to the end",
    "test_devices.py": "five device layouts x both modes, each partitioned and run",
    "test_faults.py": "the launcher's library (slim_nanguard.app) trains with injected faults",
    "test_damaged_state.py": "the launcher's runs resumed past damaged state files",
}
_REAL_NET = "a tf-slim net (resnet, inception, vgg, alexnet, lenet) built and trained"
SLOW_TESTS = {
    "test_benchmark.py::test_the_real_slim_nets_build_and_train": _REAL_NET,
    **{f"test_compat.py::test_{net}_trains": _REAL_NET for net in _NETS},
    "test_models.py::test_lenet_trains_on_the_8x8_digits": _REAL_NET,
    "test_models.py::test_mlp_learns_the_digits_in_a_few_hundred_steps": "hundreds of steps",
    "test_one_verdict.py::test_the_same_run_leaves_the_same_record_in_both_modes": "two runs",
    "test_one_verdict.py::test_a_x10_batch_after_the_warm_up_gets_one_verdict": (
        "26 runs of 40 steps"
    ),
    "test_fast_flags.py::test_the_flag_table_is_the_launchers_flags": "a Python process",
    "test_distributed.py::test_sync_replicas_a_spiking_gradient_never_enters_the_accumulators": (
        "a sync-replicas cluster trained past its spike warm-up"
    ),
}


def _names(node: ast.AST) -> Set[str]:
    """The names, attributes and arguments (fixtures) `node` mentions."""
    found = set()
    for n in ast.walk(node):
        found.add(getattr(n, "id", None) or getattr(n, "attr", None) or getattr(n, "arg", None))
    return found


@functools.lru_cache(maxsize=None)
def _process_starters(path: pathlib.Path) -> FrozenSet[str]:
    """The functions and classes of `path` that start a process, directly or through another
    (of `path`, or imported from a module beside it: ``from test_launcher import _run``)."""
    tree = source_trees.parse(path)
    keys = set(_STARTS_A_PROCESS)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (path.parent / f"{node.module}.py").is_file():
            theirs = _process_starters(path.parent / f"{node.module}.py")
            keys |= {a.asname or a.name for a in node.names if a.name in theirs}
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if (path.parent / f"{alias.name}.py").is_file():
                    keys |= _process_starters(path.parent / f"{alias.name}.py")
    defined = (ast.FunctionDef, ast.ClassDef)
    functions = {n.name: _names(n) for n in ast.walk(tree) if isinstance(n, defined)}
    found = {name for name, names in functions.items() if names & keys}
    while True:
        more = {name for name, names in functions.items() if names & found} - found
        if not more:
            return frozenset(found)
        found |= more


def _is_slow(item, seen: Set[str]) -> bool:
    path = pathlib.Path(str(item.fspath))
    name = getattr(item, "originalname", item.name)
    function = f"{path.name}::{name}"
    if hasattr(item, "callspec"):
        further_case = item.nodeid.split("[")[0] in seen
        seen.add(item.nodeid.split("[")[0])
        if further_case:
            return True
    return path.name in SLOW_FILES or function in SLOW_TESTS or name in _process_starters(path)


def pytest_collection_modifyitems(items):
    seen: Set[str] = set()
    for item in items:
        if _is_slow(item, seen):
            item.add_marker(pytest.mark.slow)
