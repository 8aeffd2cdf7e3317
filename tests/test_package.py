"""The wheel holds what users run: the library and the four console commands, no research.

setup.cfg installs `slim_nanguard`, `slim_nanguard.app` and `slim_nanguard_scripts` (which is
scripts/); research/ (the spike bench, its traces and rules, the false-alarm counts, the digits'
regenerator) stays in the repository. The listing, for a reviewer::

    pip wheel --no-deps -w /tmp/whl . && unzip -l /tmp/whl/slim_nanguard-*.whl
"""

import ast
import configparser
import pathlib

import source_trees

REPO = pathlib.Path(__file__).resolve().parents[1]
# The console commands' modules and the helpers they import: what scripts/ may hold.
COMMANDS = {"train", "eval", "benchmark", "autopsy"}
HELPERS = {"__init__", "_flag_table", "_quiet_start"}


def _options():
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    return config


def _imported_modules(path: pathlib.Path):
    """Every module name `path` imports, at any depth (inside functions too), each part."""
    names = set()
    for node in ast.walk(source_trees.parse(path)):
        if isinstance(node, ast.Import):
            names |= {part for alias in node.names for part in alias.name.split(".")}
        elif isinstance(node, ast.ImportFrom):
            names |= set((node.module or "").split("."))
            names |= {alias.name for alias in node.names}
    return names


def test_the_wheel_installs_the_library_and_the_console_commands_only():
    config = _options()
    packages = config["options"]["packages"].split()
    assert packages == ["slim_nanguard", "slim_nanguard.app", "slim_nanguard_scripts"]
    assert config["options"]["package_dir"].split() == ["slim_nanguard_scripts", "=", "scripts"]
    entry_points = config["options.entry_points"]["console_scripts"].strip().splitlines()
    targets = {line.split("=")[1].strip() for line in entry_points}
    assert targets == {f"slim_nanguard_scripts.{name}:run" for name in COMMANDS}
    installed = {path.stem for path in (REPO / "scripts").glob("*.py")}
    assert installed == COMMANDS | HELPERS, (
        f"scripts/ is installed: move {installed - COMMANDS - HELPERS} to research/"
    )


def test_no_installed_module_imports_research_code():
    research = {path.stem for path in (REPO / "research").glob("*.py")}
    assert {"spike_bench", "spike_rules", "make_digits_npz"} <= research
    installed = [*(REPO / "slim_nanguard").rglob("*.py"), *(REPO / "scripts").glob("*.py")]
    found = {
        str(path.relative_to(REPO)): sorted(_imported_modules(path) & research)
        for path in installed
    }
    assert not {path: names for path, names in found.items() if names}


def test_the_import_scan_sees_a_research_import(tmp_path):
    """The scan above must be able to fail: nested and `from` imports count."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from research import spike_rules\n    import spike_traces\n")
    assert {"spike_rules", "spike_traces"} <= _imported_modules(probe)
