"""The app's one-table-per-kind pieces: model and dataset specs, config defaults, flag defaults.

Pure or nearly so: no training. The flag-default test starts one Python per launcher.
"""

import dataclasses
import inspect
import json
import pathlib
import subprocess
import sys

import pytest
import tensorflow as tf

import slim_nanguard
from slim_nanguard import app
from slim_nanguard.app import build
from slim_nanguard.app import datasets
from slim_nanguard.app import models
from slim_nanguard.app import report

REPO = pathlib.Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# Models


def test_every_model_has_one_spec_under_its_name():
    assert models.MODEL_NAMES == tuple(models.MODELS)
    for name, spec in models.MODELS.items():
        assert spec.name == name
        assert spec.min_image_size >= 1
        assert spec.default_image_size is None or spec.default_image_size >= spec.min_image_size
        assert models.DEFAULT_IMAGE_SIZE[name] == spec.default_image_size
        assert models.MIN_IMAGE_SIZE[name] == spec.min_image_size


def test_the_tf_slim_nets_take_rgb_and_say_where_they_live():
    nets = {name for name, spec in models.MODELS.items() if spec.slim_net is not None}
    assert nets == {"resnet_v1_50", "resnet_v2_50", "inception_v1", "vgg_a", "alexnet_v2"}
    for name in nets:
        spec = models.MODELS[name]
        assert spec.channels == 3 and spec.default_image_size == 224
        assert ("dropout_keep_prob" in spec.options) == spec.slim_net.has_dropout
    assert models.MODELS["mlp"].channels is None and models.MODELS["lenet"].channels is None
    for name in ("cifarnet", "cifarnet_bn"):  # the garden's CIFAR-10 net: 32x32 RGB.
        assert (models.MODELS[name].channels, models.MODELS[name].default_image_size) == (3, 32)


def test_the_small_models_options_are_their_keyword_arguments():
    for name in ("mlp", "lenet", "cifarnet"):
        spec = models.MODELS[name]
        keywords = {
            p.name
            for p in inspect.signature(spec.build).parameters.values()
            if p.kind is p.KEYWORD_ONLY
        }
        assert set(spec.options) == keywords
    # cifarnet_bn is cifarnet with batch_norm=True: every option but that one.
    assert set(models.MODELS["cifarnet_bn"].options) == set(models.MODELS["cifarnet"].options) - {
        "batch_norm"
    }


@pytest.mark.parametrize("name, size", [("mlp", 8), ("lenet", 28)])
def test_a_small_model_builds_at_its_default_size(name, size):
    assert models.MODELS[name].default_image_size in (None, size)
    with tf.Graph().as_default():
        images = tf.zeros([2, size, size, 1])
        logits = models.get_model(name)(images, 10, is_training=False)
    assert logits.shape.as_list() == [2, 10]


# ---------------------------------------------------------------------------------------------
# Datasets


def test_every_dataset_has_one_spec_under_its_name():
    assert datasets.DATASET_NAMES == tuple(datasets.DATASETS)
    assert datasets.DEFAULT_DATASET in datasets.DATASETS
    for name, spec in datasets.DATASETS.items():
        assert spec.name == name
        assert (spec.dataset_dir is None) == bool(spec.splits)  # files name their own splits


@pytest.mark.parametrize("name", [n for n, s in datasets.DATASETS.items() if s.dataset_dir is None])
def test_a_dataset_without_files_gives_what_its_spec_says(name):
    spec = datasets.DATASETS[name]
    for split in spec.splits:
        with tf.Graph().as_default():
            _, info = datasets.get_dataset(name, split, batch_size=4)
        assert info.num_classes == spec.num_classes
        assert info.image_shape == (spec.image_size, spec.image_size, spec.channels)
        assert set(info.num_examples) == set(spec.splits)


def test_the_split_check_names_the_dataset_and_its_splits():
    for name in ("digits", "synthetic"):
        with pytest.raises(
            datasets.DatasetError, match=rf"'val'.*{name}: choose one of train, test"
        ):
            datasets.get_dataset(name, "val", batch_size=4)


# ---------------------------------------------------------------------------------------------
# The launcher's build helpers and configs


def test_input_channels_come_from_the_model_and_dataset_specs():
    assert build.input_channels("resnet_v1_50", "digits") == 3
    assert build.input_channels("resnet_v1_50", "tfrecord") is None  # the files' own
    assert build.input_channels("mlp", "digits") is None
    assert build.input_channels("lenet", "synthetic") is None


def test_model_image_size_is_the_requested_or_the_models_default():
    assert build.model_image_size("lenet", None) == 28
    assert build.model_image_size("lenet", 8) == 8
    assert build.model_image_size("mlp", None) is None


def test_autopsy_max_steps_reaches_the_guard_config(tmp_path):
    default = app.TrainConfig(train_dir=str(tmp_path))
    assert default.guard.autopsy_max_steps == slim_nanguard.GuardConfig().autopsy_max_steps
    off = app.TrainConfig.from_flags(train_dir=str(tmp_path), autopsy_max_steps=0)
    assert off.guard.autopsy_max_steps == 0
    with pytest.raises(app.LaunchError, match="--autopsy_max_steps"):
        app.TrainConfig.from_flags(train_dir=str(tmp_path), autopsy_max_steps=-1)


def test_a_dataset_that_reads_files_asks_for_dataset_dir(tmp_path):
    for make in (
        lambda: app.TrainConfig(train_dir=str(tmp_path), dataset_name="tfrecord"),
        lambda: app.EvalConfig(checkpoint_path=str(tmp_path), dataset_name="tfrecord"),
    ):
        with pytest.raises(app.LaunchError, match="tfrecord needs --dataset_dir.*TFRecord files"):
            make()


def test_import_slim_nanguard_imports_no_app_module():
    code = (
        "import sys, slim_nanguard; "
        "print([m for m in sys.modules if m.startswith('slim_nanguard.app')])"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


# ---------------------------------------------------------------------------------------------
# Flag defaults: the config's, so that the two cannot differ.


@pytest.mark.parametrize("script, config", [("train.py", "TrainConfig"), ("eval.py", "EvalConfig")])
def test_every_flag_default_is_the_configs(script, config):
    code = (
        "import dataclasses, json, runpy; from absl import flags; "
        f"runpy.run_path({str(REPO / 'scripts' / script)!r}, run_name='launcher'); "
        "from slim_nanguard import app; "
        "print(json.dumps({f.name: flags.FLAGS[f.name].default "
        f"for f in dataclasses.fields(app.{config}) if f.name in flags.FLAGS}}, default=str))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    flag_defaults = json.loads(proc.stdout.strip().splitlines()[-1])
    cls = getattr(app, config)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert len(flag_defaults) >= len(fields) - 2  # every field but a parsed one or two
    for name, flag_default in flag_defaults.items():
        field_default = fields[name].default
        if field_default is dataclasses.MISSING:
            assert flag_default is None, name  # required: train_dir, checkpoint_path
        elif isinstance(field_default, tuple):
            assert flag_default == list(field_default), name
        else:
            assert flag_default == field_default, name
    if config == "TrainConfig":
        assert flag_defaults["max_number_of_steps"] == 2000


def test_every_guard_flag_default_is_the_launchers_guard_configs():
    """The guard's flags set GuardConfig fields: their defaults are `app.DEFAULT_GUARD`'s."""
    code = (
        "import json, runpy; from absl import flags; "
        f"runpy.run_path({str(REPO / 'scripts' / 'train.py')!r}, run_name='launcher'); "
        "from slim_nanguard import app; "
        "print(json.dumps({name: flags.FLAGS[name].default for name in app.GUARD_FLAGS}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    flag_defaults = json.loads(proc.stdout.strip().splitlines()[-1])
    # The launcher's word for "no spike test" (GuardConfig's None) is --spike_policy=none.
    assert flag_defaults["spike_policy"] == app.NO_SPIKE_TEST
    flag_defaults["spike_policy"] = None
    assert flag_defaults == {name: getattr(app.DEFAULT_GUARD, name) for name in app.GUARD_FLAGS}
    assert flag_defaults["nan_policy"] == "skip"


@pytest.mark.parametrize(
    "cause, advice",
    [
        (slim_nanguard.Cause.POLICY, "--nan_policy=skip"),
        (slim_nanguard.Cause.MAX_CONSECUTIVE_BAD_STEPS, "--persistent_nan_policy=rollback"),
        (slim_nanguard.Cause.MAX_ROLLBACKS, "Rolling back did not help"),
        (slim_nanguard.Cause.UNGUARDED_LOSS, "slim_nanguard.create_train_op"),
    ],
)
def test_the_launchers_advice_follows_why_training_gave_up(cause, advice):
    """The advice comes from the error's cause, whatever its message says."""
    err = slim_nanguard.NanLossError(None, "a reason naming max_rollbacks", cause=cause, limit=5)
    lines = app.error_message(err).splitlines()
    assert advice in lines[-1]
    assert len(lines) <= 3


def test_every_cause_has_its_own_advice():
    assert set(report._GIVE_UP_ADVICE) == set(slim_nanguard.Cause)
