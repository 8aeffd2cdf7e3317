"""A bad step travels a short way: traced with `sys.setprofile` in every loop and mode.

Each loop's handling of one step is a window (the hook's ``after_run``, ``train_step``,
``handle_numerics_error``, `train`'s one step); in the window of the one bad step of a run
(autopsy off), at most 8 modules of the package are entered and at most 12 calls go from one
of its modules to another, and `decide` and the counting rule each run once.
"""

import ast
import collections
import dataclasses
import pathlib
import sys
from typing import Dict, List, Set

import pytest
import source_trees
import tf_slim as slim

import slim_nanguard

import nanguard_testlib as lib

MAX_MODULES = 8
MAX_CROSS_CALLS = 12
NAN_AT = 3
SPIKE_AT = 25  # after the spike test's warm-up of 20 accepted steps

# Where a loop takes a step's outcome in hand: (module, function).
_ENTRIES = {
    ("slim_nanguard._hook", "after_run"),
    ("slim_nanguard._steps", "train_step"),
    ("slim_nanguard._steps", "handle_numerics_error"),
    ("slim_nanguard._loop", "_step"),
}
# The transition and the rule that counts a bad step.
_DECIDE = ("slim_nanguard._policy", "decide")
_COUNTED = ("slim_nanguard._policy", "counted")


@dataclasses.dataclass
class Window:
    """What one entry's call did: the package's modules entered, its calls from one of them
    to another (caller, callee), and how often each of its functions ran."""

    bad: bool = False
    modules: Set[str] = dataclasses.field(default_factory=set)
    cross: List = dataclasses.field(default_factory=list)
    runs: Dict = dataclasses.field(default_factory=collections.Counter)


def _module(frame) -> str:
    return frame.f_globals.get("__name__", "") if frame is not None else ""


def _traced(guard_of, run) -> List[Window]:
    """Runs `run()` under a profiler; returns the window of each outermost entry."""
    windows: List[Window] = []
    state = {"frame": None, "bad_steps": 0}

    def profile(frame, event, arg):
        if event not in ("call", "return"):
            return
        module, name = _module(frame), frame.f_code.co_name
        if state["frame"] is None:
            if event == "call" and (module, name) in _ENTRIES:
                state["frame"] = frame
                guard = guard_of()
                state["bad_steps"] = guard.state.total_bad_steps if guard else 0
                windows.append(Window(modules={module}))
            return
        if event == "return":
            if frame is state["frame"]:
                guard = guard_of()
                windows[-1].bad = bool(guard and guard.state.total_bad_steps > state["bad_steps"])
                state["frame"] = None
            return
        if not module.startswith("slim_nanguard"):
            return
        window = windows[-1]
        window.modules.add(module)
        window.runs[(module, name)] += 1
        caller = _module(frame.f_back)
        if caller.startswith("slim_nanguard") and caller != module:
            window.cross.append((caller, f"{module}.{name}"))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return windows


def _model(mode, fault):
    at = NAN_AT if fault == "nan" else SPIKE_AT
    return at, lib.build_model(
        faults={at: "nan_gradient" if fault == "nan" else lib.SPIKE},
        check_numerics=lib.MODES[mode],
        config=slim_nanguard.GuardConfig(
            nan_policy="skip", spike_policy="skip", autopsy_max_steps=0
        ),
    )


def _run_loop(loop, mode, model, steps, logdir):
    train_op = model.train_op
    if loop == "train":
        return lambda: slim_nanguard.train(
            train_op, logdir, number_of_steps=steps, save_summaries_steps=None
        )
    if loop == "train_step":

        def run():
            with model.graph.as_default():
                slim.learning.train(
                    train_op,
                    logdir,
                    train_step_fn=slim_nanguard.train_step,
                    number_of_steps=steps,
                    save_summaries_secs=None,
                    save_interval_secs=None,
                )

        return run
    hooks = [slim_nanguard.nan_hook(train_op, checkpoint_dir=logdir)] if loop == "hook" else []
    return lambda: lib.run_monitored(
        train_op,
        hooks=hooks,
        feeds=[None] * steps,
        checkpoint_dir=logdir,
        handle_numerics_errors=loop == "handle_numerics_error",
    )


_LOOPS = [
    ("train", "check_numerics"),
    ("train", "hook"),
    ("train_step", "check_numerics"),
    ("train_step", "hook"),
    ("hook", "hook"),
    ("handle_numerics_error", "check_numerics"),
]


@pytest.mark.parametrize("fault", ["nan", "spike"])
@pytest.mark.parametrize("loop,mode", _LOOPS)
def test_a_bad_step_crosses_few_modules(tmp_path, loop, mode, fault):
    at, model = _model(mode, fault)
    guard = slim_nanguard.get_guard(model.train_op)
    windows = _traced(lambda: guard, _run_loop(loop, mode, model, at + 3, str(tmp_path)))
    (bad,) = [w for w in windows if w.bad]
    figures = (
        f"{loop}/{mode}/{fault}: {len(bad.modules)} modules {sorted(bad.modules)}, "
        f"{len(bad.cross)} cross-module calls {bad.cross}, decide x{bad.runs[_DECIDE]}, "
        f"counted x{bad.runs[_COUNTED]}"
    )
    print(figures)
    assert guard.last_event.step == at and guard.state.total_bad_steps == 1
    assert bad.runs[_DECIDE] == 1 and bad.runs[_COUNTED] == 1, figures
    assert len(bad.modules) <= MAX_MODULES and len(bad.cross) <= MAX_CROSS_CALLS, figures


def _imports(module: str) -> Set[str]:
    """The modules `module` imports at run time (at the top or in a function; not under
    ``TYPE_CHECKING``), as written."""
    path = pathlib.Path(lib.REPO, *module.split(".")).with_suffix(".py")
    found, stack = set(), [source_trees.parse(path)]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
            found.add(node.module)
        stack.extend(ast.iter_child_nodes(node))
    return found


def test_the_policy_imports_no_tensorflow():
    """`decide` is pure: `_policy` and what it imports, transitively, import no TensorFlow."""
    seen, todo, outside = set(), ["slim_nanguard._policy"], set()
    while todo:
        module = todo.pop()
        seen.add(module)
        for name in _imports(module):
            if name.startswith("slim_nanguard."):
                parts = name.split(".")
                target = ".".join(parts[:2])
                if (
                    target not in seen
                    and pathlib.Path(lib.REPO, *parts[:2]).with_suffix(".py").exists()
                ):
                    todo.append(target)
            else:
                outside.add(name.split(".")[0])
    assert not outside & {"tensorflow", "tf_slim", "numpy"}, (sorted(seen), sorted(outside))
    assert "slim_nanguard._spike" not in seen  # It knows the spike test as a `Reason`.
