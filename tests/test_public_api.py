"""The public line: what `slim_nanguard` exports, and that its first user needs nothing else.

The launcher's library half (`slim_nanguard/app/`) and the scripts use only public names: no
module with a leading underscore, and of `slim_nanguard` itself only its `__all__`. The
guard's settings are declared and checked once, in `GuardConfig`; the launcher's config holds
one, and a bad value gets GuardConfig's one message, opened by the flag that set it.
"""

import ast
import dataclasses
import pathlib

import pytest
import source_trees

import slim_nanguard
from slim_nanguard import app

REPO = pathlib.Path(__file__).resolve().parents[1]
PUBLIC_MODULES = ("autopsy", "cluster", "compat", "quarantine", "storage")


def _sources():
    paths = sorted((REPO / "slim_nanguard" / "app").glob("*.py"))
    return (
        paths + sorted((REPO / "scripts").glob("*.py")) + sorted((REPO / "research").glob("*.py"))
    )


def _private_uses(path: pathlib.Path):
    """Each `slim_nanguard` name `path` imports or reads that is not public: module paths with
    a part that begins with an underscore, and package attributes outside `__all__`."""
    tree = source_trees.parse(path)
    public = set(slim_nanguard.__all__) | {"app"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
            if node.module == "slim_nanguard":
                found += [a.name for a in node.names if a.name not in public]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "slim_nanguard" and node.attr not in public:
                found.append(f"slim_nanguard.{node.attr}")
            continue
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[0] == "slim_nanguard" and any(p.startswith("_") for p in parts):
                found.append(module)
    return found


def test_the_ast_scan_sees_a_private_import(tmp_path):
    """The scan below must be able to fail."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import slim_nanguard\nfrom slim_nanguard import _paths, storage\n"
        "from slim_nanguard._errors import op_error_cause\nslim_nanguard.EventRecorder\n"
    )
    assert sorted(_private_uses(probe)) == [
        "_paths",
        "slim_nanguard.EventRecorder",
        "slim_nanguard._errors",
    ]


@pytest.mark.parametrize("path", _sources(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_the_app_and_the_scripts_use_only_public_names(path):
    assert _private_uses(path) == []


def test_every_public_name_and_module_is_there():
    assert len(slim_nanguard.__all__) == len(set(slim_nanguard.__all__))
    for name in slim_nanguard.__all__:
        assert hasattr(slim_nanguard, name), name
    for module in PUBLIC_MODULES:
        assert module in slim_nanguard.__all__
        names = getattr(getattr(slim_nanguard, module), "__all__", ())  # autopsy has none
        assert all(hasattr(getattr(slim_nanguard, module), n) for n in names), module


def test_the_package_namespace_is_its_all():
    """No private plumbing reachable as a public-looking attribute of the package."""
    names = {n for n in vars(slim_nanguard) if not n.startswith("_")}
    assert names - {"app"} == set(slim_nanguard.__all__)  # app: imported by this test


def test_tf_slims_gradient_helpers_are_in_compat():
    assert {"multiply_gradients", "clip_gradient_norms", "add_gradients_summaries"} <= set(
        slim_nanguard.compat.__all__
    )


def test_the_cluster_module_has_what_the_launcher_uses():
    assert {"ClusterStopHook", "ChiefRollbackHook", "RollbackRequestHook"} <= set(
        slim_nanguard.cluster.__all__
    )


# ---------------------------------------------------------------------------------------------
# One declaration, one check, one message per bad value.

BAD_GUARD_VALUES = {
    "nan_policy": "sometimes",
    "max_consecutive_bad_steps": 0,
    "persistent_nan_policy": "skip",
    "rollback_skip_batches": -1,
    "rollback_lr_factor": 2.0,
    "max_rollbacks": 0,
    "autopsy_max_steps": -1,
    "autopsy_timeout_secs": 0.0,
    "autopsy_keep_first": -1,
    "autopsy_keep_last": 0,
    "losses_before": -1,
    "spike_policy": "sometimes",
    "spike_sigma": 0.0,
    "spike_warmup_steps": 1,
    "spike_level_shift_steps": -1,
}


def test_every_guard_flag_is_a_guard_config_field_with_a_bad_value_here():
    fields = {f.name for f in dataclasses.fields(slim_nanguard.GuardConfig)}
    assert set(app.GUARD_FLAGS) <= fields
    assert set(BAD_GUARD_VALUES) == set(app.GUARD_FLAGS)
    assert not set(app.GUARD_FLAGS) & {f.name for f in dataclasses.fields(app.TrainConfig)}


@pytest.mark.parametrize("name", sorted(BAD_GUARD_VALUES))
def test_guard_config_names_the_bad_setting_first(name):
    """The launcher finds the flag by the first word of GuardConfig's message."""
    with pytest.raises(ValueError) as info:
        slim_nanguard.GuardConfig(**{name: BAD_GUARD_VALUES[name]})
    assert str(info.value).startswith(f"{name} must be ")


@pytest.mark.parametrize("name", sorted(BAD_GUARD_VALUES))
def test_a_bad_guard_flag_gets_guard_configs_message_naming_the_flag_once(name, tmp_path):
    value = BAD_GUARD_VALUES[name]
    with pytest.raises(ValueError) as library:
        slim_nanguard.GuardConfig(**{name: value})
    with pytest.raises(app.LaunchError) as launcher:
        app.TrainConfig.from_flags(train_dir=str(tmp_path / "run"), **{name: value})
    message = str(launcher.value)
    assert message == f"--{name}={value}: {library.value}"
    assert message.count(f"--{name}") == 1
    assert len(app.error_message(launcher.value).splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_the_launchers_config_holds_the_guard_config(tmp_path):
    config = app.TrainConfig.from_flags(
        train_dir=str(tmp_path), nan_policy="rollback", rollback_lr_factor=0.5, max_rollbacks=7
    )
    assert config.guard == dataclasses.replace(
        app.DEFAULT_GUARD, nan_policy="rollback", rollback_lr_factor=0.5, max_rollbacks=7
    )
    assert app.TrainConfig(train_dir=str(tmp_path)).guard == app.DEFAULT_GUARD
    assert app.DEFAULT_GUARD.nan_policy == slim_nanguard.Action.SKIP
    with pytest.raises(app.LaunchError, match="guard must be a slim_nanguard.GuardConfig"):
        app.TrainConfig(train_dir=str(tmp_path), guard={"nan_policy": "skip"})
