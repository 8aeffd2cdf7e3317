"""The guard's settings have one home: `GuardConfig`.

`create_train_op` takes tf-slim's arguments plus each `GuardConfig` field as a keyword, with
the dataclass's default; the launcher has a flag for each field (its defaults the same, but
where it says otherwise below); docs/api.md lists the same keywords and defaults; and no
other function or dataclass of the core writes a default of its own for one of them.
"""

import ast
import dataclasses
import inspect
import pathlib
import re
import runpy

import pytest
import source_trees
from absl import flags

import slim_nanguard
from slim_nanguard import _spike
from slim_nanguard import app

import nanguard_testlib as lib

REPO = pathlib.Path(__file__).resolve().parents[1]
FIELDS = dataclasses.fields(slim_nanguard.GuardConfig)
NAMES = [f.name for f in FIELDS]
DEFAULTS = {f.name: f.default for f in FIELDS}
# Where the launcher deliberately differs from GuardConfig: its flag's default, or why no flag.
LAUNCHER_DEFAULTS = {"nan_policy": "skip", "spike_policy": app.NO_SPIKE_TEST, "reasons": []}
NO_FLAG = {"on_nan": "a Python callback; the launcher's way to add a rule is --reasons"}


def test_create_train_op_takes_every_guard_config_field_with_its_default():
    params = inspect.signature(slim_nanguard.create_train_op).parameters.values()
    keywords = [p for p in params if p.kind is p.KEYWORD_ONLY]
    assert [p.name for p in keywords] == NAMES + ["config"]
    assert {p.name: p.default for p in keywords[:-1]} == DEFAULTS
    # tf-slim's 12 arguments and transform_grads_fn, in tf-slim's order.
    assert [p.name for p in params][:2] == ["total_loss", "optimizer"]
    assert len([p for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]) == 13


def test_every_setting_reaches_the_guard_and_config_takes_the_keywords_on_top():
    settings = dict(autopsy_max_steps=0, losses_before=7, autopsy_keep_first=1, spike_sigma=4.0)
    model = lib.build_model(nan_policy="skip", **settings)
    config = slim_nanguard.get_guard(model.train_op).config
    assert config == slim_nanguard.GuardConfig(nan_policy="skip", **settings)
    base = slim_nanguard.GuardConfig(nan_policy="stop", max_rollbacks=5)
    model = lib.build_model(config=base, max_rollbacks=2)
    assert slim_nanguard.get_guard(model.train_op).config == dataclasses.replace(
        base, max_rollbacks=2
    )


def test_an_unknown_keyword_is_a_type_error_naming_it_and_the_valid_ones():
    with pytest.raises(TypeError) as info:
        lib.build_model(nan_polcy="skip")
    message = str(info.value)
    assert "unexpected keyword argument 'nan_polcy'" in message
    assert all(name in message for name in NAMES)
    with pytest.raises(ValueError, match="^losses_before must be"):
        lib.build_model(losses_before=-1)


def _train_flag_defaults():
    """The default of each flag scripts/train.py defines (loaded here, its flags removed)."""
    before = set(flags.FLAGS)
    runpy.run_path(str(REPO / "scripts" / "train.py"), run_name="settings_test")
    new = set(flags.FLAGS) - before
    defaults = {name: flags.FLAGS[name].default for name in new}
    for name in new:
        delattr(flags.FLAGS, name)
    return defaults


def test_every_guard_config_field_is_a_launcher_flag_with_its_default():
    assert set(app.GUARD_FLAGS) | {app.REASONS_FLAG} == set(NAMES) - set(NO_FLAG)
    defaults = _train_flag_defaults()
    launcher = {name: defaults[name] for name in NAMES if name not in NO_FLAG}
    expected = {name: DEFAULTS[name] for name in launcher} | LAUNCHER_DEFAULTS
    assert launcher == expected
    assert not set(NO_FLAG) & set(defaults)


def test_docs_api_lists_create_train_ops_keywords_and_guard_configs_fields():
    api = (REPO / "docs" / "api.md").read_text()
    signature = re.search(r"^create_train_op\(\n(.*?)^\)$", api, flags=re.M | re.S).group(1)
    keywords = [line.strip().rstrip(",") for line in signature.split("    *,\n", 1)[1].splitlines()]
    pairs = [keyword.split("=", 1) for keyword in keywords]
    assert [name for name, _ in pairs] == NAMES + ["config"]
    assert {name: ast.literal_eval(value) for name, value in pairs[:-1]} == DEFAULTS
    fields = api.split("`GuardConfig`'s fields", 1)[1].split("\n## ", 1)[0]
    assert set(re.findall(r"`(\w+)`", fields)) >= set(NAMES)


def _defaults_outside_guard_config(root: pathlib.Path = REPO):
    """(module, function or class, name, default) of each default the core writes for a
    `GuardConfig` field outside `GuardConfig`: None and () (nothing given) left out."""
    found = []
    for path in sorted((root / "slim_nanguard").glob("*.py")):
        for node in ast.walk(source_trees.parse(path)):
            pairs = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                positional = args.posonlyargs + args.args
                pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults))
                pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d]
                pairs = [(a.arg, d) for a, d in pairs]
            elif isinstance(node, ast.ClassDef) and node.name != "GuardConfig":
                pairs = [
                    (b.target.id, b.value)
                    for b in node.body
                    if isinstance(b, ast.AnnAssign) and b.value and isinstance(b.target, ast.Name)
                ]
            for name, default in pairs:
                if name in DEFAULTS and ast.unparse(default) not in ("None", "()"):
                    found.append((path.name, node.name, name, ast.unparse(default)))
    return found


def test_each_default_is_written_once():
    assert not _defaults_outside_guard_config()
    # The spike test takes GuardConfig's spike_* settings, with no default of its own.
    spike = {f.name: f.default for f in dataclasses.fields(_spike.Spike)}
    assert spike == {name: dataclasses.MISSING for name in ("policy", "sigma", "warmup_steps")}
    assert slim_nanguard.GuardConfig(spike_policy="skip").all_reasons[0] == _spike.Spike(
        "skip", DEFAULTS["spike_sigma"], DEFAULTS["spike_warmup_steps"]
    )


def test_the_scan_sees_a_default_written_twice(tmp_path):
    """The scan above must be able to fail."""
    (tmp_path / "slim_nanguard").mkdir()
    (tmp_path / "slim_nanguard" / "probe.py").write_text(
        "def f(x, *, spike_sigma=6.0, reasons=()):\n    pass\n"
        "class C:\n    max_rollbacks: int = 3\n"
    )
    assert _defaults_outside_guard_config(tmp_path) == [
        ("probe.py", "f", "spike_sigma", "6.0"),
        ("probe.py", "C", "max_rollbacks", "3"),
    ]
