"""In-process tests of slim_nanguard.app.faults and slim_nanguard.app (no flags, no subprocess).

Each training run here is a few dozen steps on the synthetic or digits data, in its own graph.
"""

import os

import numpy as np
import pytest
import tensorflow as tf

import slim_nanguard
from slim_nanguard import app
from slim_nanguard.app import datasets
from slim_nanguard.app import faults
from slim_nanguard.app import plot as run_plot

import nanguard_testlib as lib

# ---------------------------------------------------------------------------------------------
# FaultSpec


@pytest.mark.parametrize(
    "text, kind, first, last",
    [
        ("nan_input:40", "nan_input", 40, 40),
        ("inf_input:0", "inf_input", 0, 0),
        (" nan_loss : 7 ", "nan_loss", 7, 7),
        ("inf_loss:3-5", "inf_loss", 3, 5),
        ("nan_gradient:12", "nan_gradient", 12, 12),
    ],
)
def test_parse_reads_kind_and_batches(text, kind, first, last):
    spec = faults.FaultSpec.parse(text)
    assert (spec.kind, spec.first, spec.last) == (kind, first, last)
    assert faults.FaultSpec.parse(str(spec)) == spec


@pytest.mark.parametrize(
    "text, words",
    [
        ("nan_foo:3", ["unknown kind 'nan_foo'", "nan_input"]),
        ("nan_loss", ["KIND:STEP", "nan_input:40"]),
        ("nan_loss:-1", ["KIND:STEP"]),
        ("nan_loss:x", ["KIND:STEP"]),
        ("nan_loss:5-3", ["FIRST <= LAST"]),
        ("", ["KIND:STEP"]),
    ],
)
def test_parse_rejects_bad_text_with_a_clear_message(text, words):
    with pytest.raises(ValueError) as info:
        faults.FaultSpec.parse(text)
    for word in words:
        assert word in str(info.value)


def test_parse_list_splits_commas_and_skips_empty_items():
    specs = faults.FaultSpec.parse_list("nan_input:1, ,nan_loss:2-3")
    assert [str(s) for s in specs] == ["nan_input:1", "nan_loss:2-3"]
    assert faults.FaultSpec.parse_list(["inf_input:4"]) == (faults.FaultSpec("inf_input", 4),)
    assert faults.FaultSpec.parse_list("") == ()


# ---------------------------------------------------------------------------------------------
# FaultInjector: what each kind does to the batch, the loss and the gradient


def _run_injected(spec_text, num_batches=4):
    """Per batch: (index, images all finite, loss, gradient all finite) of a tiny model."""
    with tf.Graph().as_default():
        images = np.ones([num_batches * 2, 2, 2, 1], np.float32)
        dataset = tf.data.Dataset.from_tensor_slices(images).batch(2)
        index, batch = tf.compat.v1.data.make_one_shot_iterator(
            faults.enumerate_batches(dataset)
        ).get_next()
        injector = faults.FaultInjector(faults.FaultSpec.parse_list(spec_text), index)
        batch = injector.corrupt_images(batch)
        weights = tf.compat.v1.get_variable("w", [4, 1], initializer=tf.ones_initializer())
        loss = tf.reduce_mean(tf.matmul(tf.reshape(batch, [-1, 4]), weights))
        loss = injector.corrupt_loss(loss)
        (grad,) = tf.gradients(loss, [weights])
        fetch = [
            index,
            tf.reduce_all(tf.math.is_finite(batch)),
            loss,
            tf.reduce_all(tf.math.is_finite(grad)),
        ]
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            return [session.run(fetch) for _ in range(num_batches)]


@pytest.mark.parametrize(
    "kind, images_ok, loss_check, grad_ok",
    [
        ("nan_input", False, np.isnan, False),
        ("inf_input", False, np.isinf, False),
        ("nan_loss", True, np.isnan, True),
        ("inf_loss", True, np.isinf, True),
        ("nan_gradient", True, np.isfinite, False),
    ],
)
def test_each_kind_corrupts_only_the_chosen_batch(kind, images_ok, loss_check, grad_ok):
    rows = _run_injected(f"{kind}:2")
    assert [index for index, *_ in rows] == [0, 1, 2, 3]  # batch 2 was among them
    for index, batch_finite, loss, grad_finite in rows:
        if index == 2:
            assert bool(batch_finite) == images_ok
            assert loss_check(loss)
            assert bool(grad_finite) == grad_ok
        else:
            assert batch_finite and np.isfinite(loss) and grad_finite
            assert loss == pytest.approx(4.0)


def test_spike_input_scales_the_chosen_batch_and_keeps_it_finite():
    """A finite spike: batch 2's images times 1,000, so its loss is 1,000 times the others'."""
    rows = _run_injected("spike_input:2,nan_input:3")
    assert [float(loss) for _, _, loss, _ in rows[:3]] == [4.0, 4.0, 4000.0]
    assert rows[2][1] and rows[2][3]  # every image value and gradient finite
    assert not rows[3][1]  # beside a NaN fault of another batch


def test_nan_gradient_keeps_the_loss_value():
    rows = _run_injected("nan_gradient:1")
    assert rows[1][2] == pytest.approx(4.0)
    assert not rows[1][3]


def test_a_range_hits_every_batch_in_it():
    rows = _run_injected("nan_loss:1-2")
    assert [bool(np.isnan(r[2])) for r in rows] == [False, True, True, False]


# ---------------------------------------------------------------------------------------------
# TrainConfig / EvalConfig validation


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"max_number_of_steps": -5}, ["--max_number_of_steps", "-5"]),
        ({"optimizer": "sgdx"}, ["--optimizer", "'sgdx'", "momentum"]),
        ({"learning_rate_decay_type": "cosine"}, ["--learning_rate_decay_type"]),
        ({"nan_policy": "ignore"}, ["--nan_policy", "rollback"]),
        (
            {"persistent_nan_policy": "skip"},
            ["--persistent_nan_policy", "'skip'", "raise, stop, rollback"],
        ),
        ({"model_name": "resnet_v9"}, ["--model_name"]),
        ({"batch_size": 0}, ["--batch_size"]),
        ({"learning_rate": -1.0}, ["--learning_rate"]),
        ({"rollback_lr_factor": 0.0}, ["--rollback_lr_factor"]),
        ({"inject_faults": "nan_foo:3"}, ["--inject_fault", "nan_foo"]),
        ({"dataset_name": "tfrecord"}, ["--dataset_dir"]),
    ],
)
def test_train_config_names_the_bad_setting(kwargs, words, tmp_path):
    with pytest.raises(app.LaunchError) as info:
        app.TrainConfig.from_flags(train_dir=str(tmp_path / "run"), **kwargs)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, slim_nanguard.NanGuardError)
    for word in words:
        assert word in str(info.value)


def test_train_config_normalises_lists():
    config = app.TrainConfig(
        train_dir="/tmp/x",
        checkpoint_exclude_scopes="A/b, C",
        trainable_scopes=["D"],
        inject_faults="nan_loss:3,inf_input:4",
    )
    assert config.checkpoint_exclude_scopes == ("A/b", "C")
    assert config.trainable_scopes == ("D",)
    assert [str(f) for f in config.inject_faults] == ["nan_loss:3", "inf_input:4"]


def test_a_transient_nan_goes_bad_the_first_time_only_and_its_replay_is_finite():
    """A flaky device: batch 2's loss is NaN when it is first run; fed back (as an autopsy
    replays a kept batch) the same batch gives a finite loss, and so does every other batch."""
    rows = _run_injected("transient_nan:2")
    assert [bool(np.isnan(loss)) for _, _, loss, _ in rows] == [False, False, True, False]
    with tf.Graph().as_default():
        index = tf.compat.v1.placeholder_with_default(tf.constant(0, tf.int64), [])
        injector = faults.FaultInjector(["transient_nan:2"], index)
        loss = injector.corrupt_loss(tf.constant(4.0))
        with tf.compat.v1.Session() as session:
            runs = [session.run(loss, {index: i}) for i in (1, 2, 2, 2)]
    assert [bool(np.isnan(v)) for v in runs] == [False, True, False, False]


def _epochs_of_example_faults(spec_text, epochs=3, batch_size=16):
    """Each batch of `epochs` shuffled passes over the synthetic split with `spec_text`
    injected: (its example indices, which rows are finite, which rows are over 100)."""
    with tf.Graph().as_default():
        dataset, info = datasets.get_dataset(
            "synthetic", batch_size=batch_size, seed=3, example_index=True
        )
        images, _, examples = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
        batch = tf.constant(0, tf.int64)
        images = faults.FaultInjector([spec_text], batch, examples).corrupt_images(images)
        rows = tf.reshape(images, [batch_size, -1])
        fetch = [examples, tf.reduce_all(tf.math.is_finite(rows), 1), tf.reduce_max(rows, 1)]
        with tf.compat.v1.Session() as session:
            steps = epochs * info.split_size // batch_size
            return [session.run(fetch) for _ in range(steps)]


def test_an_example_fault_follows_its_example_through_every_epochs_shuffle():
    """nan_example:7 is example 7 of the split: one NaN in its image in each of 3 shuffled
    epochs, wherever the shuffle puts it, and no other row; spike_example scales it."""
    batches = _epochs_of_example_faults("nan_example:7")
    seen = np.concatenate([examples for examples, _, _ in batches])
    assert sorted(seen.tolist()) == sorted(list(range(1024)) * 3)  # every example, each epoch
    hits = [(b, examples[~finite].tolist()) for b, (examples, finite, _) in enumerate(batches)]
    hits = [(b, bad) for b, bad in hits if bad]
    assert [bad for _, bad in hits] == [[7], [7], [7]], hits
    assert len({b for b, _ in hits}) == 3  # three different batches
    for examples, finite, _ in batches:
        assert finite[examples != 7].all()
    batches = _epochs_of_example_faults("spike_example:7", epochs=1)
    for examples, finite, top in batches:
        assert finite.all()
        assert ((top > 100) == (examples == 7)).all()  # images are in [0, 1]; x1000 is over


def test_spike_example_gives_its_example_the_next_class_and_no_other():
    with tf.Graph().as_default():
        examples = tf.constant([3, 7, 9, 7], tf.int64)
        injector = faults.FaultInjector(["spike_example:7"], tf.constant(0, tf.int64), examples)
        labels = injector.corrupt_labels(tf.constant([1, 2, 9, 9], tf.int64), 10)
        with tf.compat.v1.Session() as session:
            assert session.run(labels).tolist() == [1, 3, 9, 0]


def test_lr_jump_scales_the_learning_rate_of_the_chosen_batch_only():
    with tf.Graph().as_default():
        index = tf.compat.v1.placeholder(tf.int64, [])
        injector = faults.FaultInjector(["lr_jump:5"], index)
        rate = injector.corrupt_learning_rate(tf.constant(0.01))
        with tf.compat.v1.Session() as session:
            rates = [session.run(rate, {index: i}) for i in (4, 5, 6)]
    assert rates == pytest.approx([0.01, 1e10, 0.01])


def test_example_faults_need_the_example_indices():
    with tf.Graph().as_default(), pytest.raises(ValueError, match="example indices"):
        faults.FaultInjector(["nan_example:3"], tf.constant(0, tf.int64))
    assert faults.needs_example_index(["nan_loss:3", "spike_example:2"])
    assert not faults.needs_example_index(["nan_loss:3", "lr_jump:2"])


# ---------------------------------------------------------------------------------------------
# run_training


def _config(train_dir, **kwargs):
    values = dict(
        train_dir=str(train_dir),
        dataset_name="synthetic",
        batch_size=16,
        max_number_of_steps=30,
        log_every_n_steps=0,
        save_summaries_steps=0,
        save_summaries_secs=0,
    )
    values.update(kwargs)
    return app.TrainConfig.from_flags(**values)


@lib.each_mode
def test_skip_steps_over_an_injected_nan_batch(tmp_path, mode):
    """A NaN batch at step 10 of 30: skipped, recorded, and the run reaches step 30."""
    result = app.run_training(
        _config(tmp_path / "run", check_numerics=lib.MODES[mode], inject_faults="nan_input:10")
    )
    assert (result.global_step, result.bad_steps, result.skips) == (30, 1, 1)
    assert result.stop_reason == "step_limit"
    assert not slim_nanguard.non_finite_variables(result.checkpoint)
    bad = [e for e in slim_nanguard.read_events(result.events_path) if e["kind"] == "bad_step"]
    assert [(e["step"], e["action"]) for e in bad] == [(10, "skip")]


@lib.each_mode
def test_spike_skip_steps_over_a_planted_spike_and_counts_it(tmp_path, mode):
    """A finite spike at batch 25 of 30 (after the 20 warm-up steps): skipped as a spike,
    recorded with its cause, counted in the run's result; the same config with
    ``spike_policy="none"`` (the launcher's word for no spike test) trains on it."""
    settings = dict(check_numerics=lib.MODES[mode], inject_faults="spike_input:25")
    result = app.run_training(_config(tmp_path / "on", spike_policy="skip", **settings))
    assert isinstance(result, slim_nanguard.TrainResult)
    assert (result.global_step, result.bad_steps, result.skips, result.spikes) == (30, 1, 1, 1)
    bad = [e for e in slim_nanguard.read_events(result.events_path) if e["kind"] == "bad_step"]
    assert [(e["step"], e["cause"], e["action"]) for e in bad] == [(25, "spike", "skip")]
    config = _config(tmp_path / "off", spike_policy=app.NO_SPIKE_TEST, **settings)
    assert config.guard.spike_policy is None
    result = app.run_training(config)
    assert (result.global_step, result.bad_steps, result.spikes) == (30, 0, 0)


def _bad_steps(result):
    return [e for e in slim_nanguard.read_events(result.events_path) if e["kind"] == "bad_step"]


@lib.each_mode
def test_a_transient_nan_is_one_bad_step_whose_replay_does_not_reproduce_it(tmp_path, mode):
    """The flaky device of the triage stories: batch 10's loss is NaN once. The step is skipped
    and the autopsy, replaying the kept batch on the same weights, finds it finite."""
    settings = dict(check_numerics=lib.MODES[mode], inject_faults="transient_nan:10")
    result = app.run_training(_config(tmp_path / "run", nan_policy="skip", **settings))
    assert (result.global_step, result.bad_steps, result.skips) == (30, 1, 1)
    (bad,) = _bad_steps(result)
    assert (bad["step"], bad["loss_kind"], bad["autopsy"]["reproduced"]) == (10, "nan", False)


def test_a_bad_example_comes_back_every_epoch_and_the_autopsy_names_its_row(tmp_path):
    """nan_example:7 under skip: the one bad example costs a batch in each of 3 epochs of the
    synthetic split (1,024 examples, 64 batches of 16); each autopsy names one example of the
    batch, the row holding example 7."""
    config = _config(
        tmp_path / "run", nan_policy="skip", inject_faults="nan_example:7", max_number_of_steps=190
    )
    result = app.run_training(config)
    assert (result.global_step, result.stop_reason) == (190, "step_limit")
    bad = _bad_steps(result)
    # 190 trained batches and the skipped ones: 3,040 examples and more, so 3 epochs begun.
    assert len(bad) == result.skips == 3, [(e["step"], e["action"]) for e in bad]
    # Non-finite: the loss, or (where a fused kernel drops the NaN pixel) the gradients.
    assert all(e["cause"] == "non_finite" and e["action"] == "skip" for e in bad)
    for record in bad:
        if record.get("autopsy"):
            assert len(record["autopsy"]["bad_examples"]) == 1, record["autopsy"]


def test_an_lr_jump_breaks_the_state_and_rollback_brings_the_run_back(tmp_path):
    """lr_jump:25: batch 25's update is 10**12 times too large. It is accepted (its loss and
    gradients were finite), the weights it leaves send later losses to NaN or Inf, and the rollback
    returns to a checkpoint from before it; the run ends at its limit with finite weights."""
    config = _config(
        tmp_path / "run",
        nan_policy="rollback",
        inject_faults="lr_jump:25",
        save_interval_steps=10,
        max_number_of_steps=40,
        learning_rate=0.1,
    )
    result = app.run_training(config)
    assert (result.global_step, result.stop_reason) == (40, "step_limit")
    assert result.rollbacks >= 1 and result.bad_steps >= 1
    assert not slim_nanguard.non_finite_variables(result.checkpoint)
    rollbacks = [
        e for e in slim_nanguard.read_events(result.events_path) if e["kind"] == "rollback"
    ]
    assert rollbacks and all(int(e["checkpoint"].rsplit("-", 1)[1]) <= 25 for e in rollbacks)


def test_the_plot_marks_a_spike_apart_from_a_nan_step(tmp_path):
    """A run with a spike (batch 25, finite) and a NaN batch (27), both skipped: each has its
    own marker and its own entry in the legend of `run_plot.plot_run`, from the records' cause."""
    pytest.importorskip("matplotlib")
    from matplotlib import pyplot as plt

    config = _config(
        tmp_path,
        save_summaries_steps=1,
        inject_faults="spike_input:25,nan_input:27",
        spike_policy="skip",
    )
    assert app.run_training(config).spikes == 1
    records = slim_nanguard.read_events(str(tmp_path))
    bad = [r for r in records if r["kind"] == "bad_step"]
    assert [(r["step"], r["cause"]) for r in bad] == [(25, "spike"), (26, "non_finite")]
    tag, pieces = run_plot.loss_pieces(str(tmp_path))
    figure, axes = plt.subplots()
    run_plot._draw(axes, tag, pieces, records)
    _, labels = axes.get_legend_handles_labels()
    # Each label names the kind and the action, then where it is drawn (its loss, or the top).
    assert any(label.startswith("spike, skipped, at its loss") for label in labels), labels
    assert any(label.startswith("bad step, skipped") for label in labels), labels
    spike, nan = (run_plot._bad_step_mark(r) for r in bad)
    assert spike[0] != nan[0] and spike[2] != nan[2]
    plt.close(figure)
    out = run_plot.plot_run(str(tmp_path), str(tmp_path / "run.png"))
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "optimizer, decay",
    [
        ("sgd", "fixed"),
        ("momentum", "exponential"),
        ("rmsprop", "polynomial"),
        ("adam", "fixed"),
        ("adagrad", "fixed"),
        ("adadelta", "fixed"),
        ("ftrl", "fixed"),
    ],
)
def test_every_optimizer_and_decay_trains(tmp_path, optimizer, decay):
    result = app.run_training(
        _config(
            tmp_path / "run",
            optimizer=optimizer,
            learning_rate_decay_type=decay,
            learning_rate=0.01,
            max_number_of_steps=5,
            rollback_lr_factor=0.5,
            nan_policy="rollback",
        )
    )
    assert result.global_step == 5 and np.isfinite(result.final_loss)


def test_bad_dataset_dir_fails_before_train_dir_is_created(tmp_path):
    train_dir = tmp_path / "run"
    with pytest.raises(datasets.DatasetError, match="does not exist"):
        app.run_training(
            _config(train_dir, dataset_name="tfrecord", dataset_dir=str(tmp_path / "missing"))
        )
    assert not train_dir.exists()


def test_tfrecord_with_an_image_that_does_not_decode(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    example = tf.train.Example(
        features=tf.train.Features(
            feature={
                datasets.ENCODED_KEY: tf.train.Feature(
                    bytes_list=tf.train.BytesList(value=[b"junk"])
                ),
                datasets.FORMAT_KEY: tf.train.Feature(
                    bytes_list=tf.train.BytesList(value=[b"png"])
                ),
                datasets.LABEL_KEY: tf.train.Feature(int64_list=tf.train.Int64List(value=[1])),
            }
        )
    )
    with tf.io.TFRecordWriter(str(data / "toy_train.tfrecord")) as writer:
        writer.write(example.SerializeToString())
    train_dir = tmp_path / "run"
    with pytest.raises(ValueError) as info:
        app.run_training(_config(train_dir, dataset_name="tfrecord", dataset_dir=str(data)))
    message = app.error_message(info.value)
    assert "toy_train.tfrecord" in message and len(message.splitlines()) <= 2
    assert not train_dir.exists()


def test_resume_with_another_model_is_refused(tmp_path):
    train_dir = tmp_path / "run"
    app.run_training(_config(train_dir, max_number_of_steps=3))
    before = sorted(os.listdir(train_dir))
    with pytest.raises(app.LaunchError) as info:
        app.run_training(_config(train_dir, model_name="lenet", train_image_size=8))
    assert "does not match the model" in str(info.value)
    assert "--train_dir" in str(info.value)
    assert sorted(os.listdir(train_dir)) == before


def test_raise_policy_keeps_the_run_directory_with_a_finite_checkpoint(tmp_path):
    train_dir = tmp_path / "run"
    with pytest.raises(slim_nanguard.NanLossError) as info:
        app.run_training(
            _config(
                train_dir, nan_policy="raise", save_interval_steps=5, inject_faults="nan_loss:12"
            )
        )
    assert "global step 12" in str(info.value)
    latest = tf.train.latest_checkpoint(str(train_dir))
    # Before raising, the good state of the bad step is saved: no good step is lost.
    assert latest.endswith("-12") and not slim_nanguard.non_finite_variables(latest)
    assert info.value.checkpoint == latest
    message = app.error_message(info.value)
    assert f"The last good state (global step 12) is saved as {latest}" in message
    assert "--nan_policy=skip" in message


def test_tf_slim_net_by_name_trains_and_evaluates(tmp_path):
    # Batch 4 and a small learning rate: with batch 2 at the default rate, resnet's last batch
    # norms (1x1 maps, statistics over 2 values) blow the loss up to 1e13 within three steps
    # with oneDNN off, and this test is not about divergence.
    train_dir = tmp_path / "run"
    result = app.run_training(
        _config(
            train_dir,
            model_name="resnet_v1_50",
            train_image_size=32,
            batch_size=4,
            learning_rate=0.001,
            max_number_of_steps=2,
            inject_faults="nan_gradient:0",
        )
    )
    assert (result.global_step, result.skips) == (2, 1)
    evaluation = app.run_eval(
        app.EvalConfig(
            checkpoint_path=str(train_dir),
            model_name="resnet_v1_50",
            dataset_name="synthetic",
            eval_image_size=32,
            batch_size=4,
            max_num_batches=1,
        )
    )
    assert evaluation.num_examples == 4 and evaluation.global_step == 2


# ---------------------------------------------------------------------------------------------
# run_eval


def test_eval_reads_the_whole_split_once(tmp_path):
    train_dir = tmp_path / "run"
    app.run_training(_config(train_dir, max_number_of_steps=20))
    result = app.run_eval(
        app.EvalConfig(checkpoint_path=str(train_dir), dataset_name="synthetic", batch_size=100)
    )
    assert result.num_examples == 256  # the synthetic test split, last batch partial
    assert result.global_step == 20
    # An accuracy over the whole split counts each of its 256 examples once.
    assert result.accuracy * 256 == pytest.approx(round(result.accuracy * 256), abs=1e-3)
    assert np.isfinite(result.loss)


def test_eval_refuses_a_missing_or_empty_checkpoint(tmp_path):
    with pytest.raises(app.LaunchError, match="does not exist"):
        app.run_eval(app.EvalConfig(checkpoint_path=str(tmp_path / "nope")))
    with pytest.raises(app.LaunchError, match="without a checkpoint"):
        app.run_eval(app.EvalConfig(checkpoint_path=str(tmp_path)))


def test_giving_up_after_a_run_of_spikes_says_what_the_kept_state_is(tmp_path):
    """Every batch from step 12 on is a spike (x1000): after max_consecutive_bad_steps the
    run gives up with the state of the last accepted step saved, and the message calls it
    that (not "good": a run of bad steps may follow a climb) and does not claim NaN or Inf."""
    train_dir = tmp_path / "run"
    spikes = ",".join(f"spike_input:{step}" for step in range(24, 40))
    with pytest.raises(slim_nanguard.NanLossError) as info:
        app.run_training(
            _config(
                train_dir,
                spike_policy="skip",
                max_consecutive_bad_steps=3,
                max_number_of_steps=45,
                inject_faults=spikes,
            )
        )
    assert info.value.cause == "max_consecutive_bad_steps"
    message = app.error_message(info.value)
    assert "The state of the last accepted step (global step 24) is saved as " in message
    assert "an older checkpoint of the directory may be the better start" in message
    assert "NaN or Inf" not in message.splitlines()[-1]
    assert "rejected (NaN, Inf or a spike)" in message


def test_giving_up_on_a_spike_names_the_spike_flag(tmp_path):
    """The advice after a spike under --spike_policy=raise names --spike_policy, not
    --nan_policy (which the spike never went through)."""
    with pytest.raises(slim_nanguard.NanLossError) as info:
        app.run_training(
            _config(tmp_path / "run", spike_policy="raise", inject_faults=("spike_input:25",))
        )
    assert info.value.event.cause == "spike"
    advice = app.error_message(info.value).splitlines()[-1]
    assert "--spike_policy=skip or --spike_policy=rollback" in advice
    assert "--nan_policy" not in advice


@lib.each_mode
@pytest.mark.parametrize(
    "fault, verdict, action",
    [
        ("transient_nan:10", "chance", "skip"),
        ("nan_example:7", "data", "skip"),
        ("lr_jump:15", "state", "rollback"),
    ],
    ids=["transient", "bad_example", "lr_jump"],
)
def test_auto_acts_on_the_triages_verdict_for_a_fault_of_each_cause(
    tmp_path, mode, fault, verdict, action
):
    """nan_policy="auto" on the injected faults: each bad step's triage names the fault's
    cause and the action follows it; the run ends at its step limit with finite weights."""
    config = _config(
        tmp_path / "run",
        check_numerics=lib.MODES[mode],
        nan_policy="auto",
        inject_faults=fault,
        max_number_of_steps=70,
        save_interval_steps=10,
        learning_rate=0.1,
    )
    result = app.run_training(config)
    assert (result.global_step, result.stop_reason) == (70, "step_limit")
    assert not slim_nanguard.non_finite_variables(result.checkpoint)
    bad = _bad_steps(result)
    assert bad, "the fault made no bad step"
    told = [(r["autopsy"]["triage"]["verdict"], r["action"]) for r in bad]
    assert told == [(verdict, action)] * len(bad), told


@lib.each_mode
def test_under_auto_a_bad_example_costs_one_batch_in_three_epochs_and_none_after_a_resume(
    tmp_path, mode
):
    """nan_example:7 comes back in every epoch of the synthetic split (64 batches of 16). auto
    quarantines it at its first batch: 190 steps (3 epochs) hold one bad step, not three,
    and a resumed run to 320 steps, under skip, reads the quarantine back and meets it no more."""
    run = tmp_path / "run"
    common = dict(check_numerics=lib.MODES[mode], inject_faults="nan_example:7")
    first = app.run_training(_config(run, nan_policy="auto", max_number_of_steps=190, **common))
    assert (first.global_step, first.bad_steps) == (190, 1)
    (held,) = slim_nanguard.quarantine.read(str(run))
    assert held["ids"]["IteratorGetNext:3"] == 7  # The example index the batch carries.
    resumed = app.run_training(_config(run, nan_policy="skip", max_number_of_steps=320, **common))
    assert (resumed.global_step, resumed.bad_steps) == (320, 0)
    assert len(_bad_steps(resumed)) == 1


@lib.each_mode
def test_under_auto_a_transient_costs_one_extra_run_not_its_batch(tmp_path, mode, caplog):
    """transient_nan:10: batch 10's loss is NaN once. auto's triage finds the replay finite
    (chance) and runs the step again on the kept batch, which trains: no batch is skipped, so
    70 steps take 70 batches, as in a run without the fault."""
    config = _config(
        tmp_path / "run",
        check_numerics=lib.MODES[mode],
        nan_policy="auto",
        inject_faults="transient_nan:10",
        max_number_of_steps=70,
        seed=0,
    )
    result = app.run_training(config)
    assert (result.global_step, result.bad_steps, result.skips, result.retries) == (70, 1, 0, 1)
    records = slim_nanguard.read_events(result.events_path)
    (retry,) = [r for r in records if r["kind"] == "retry"]
    assert (retry["step"], retry["trained"]) == (10, True)
    assert "1 run again and trained, 0 skipped" in result.describe()
    said = [r.getMessage() for r in caplog.records if "run again on its batch" in r.getMessage()]
    assert said == [
        "slim_nanguard: global step 10: run again on its batch (triage: chance), it trained; "
        "global step now 11"
    ]
    # Every batch trained once: the run ends with the weights of the same seeded run whose
    # fault never fires (batch 100,000; the same graph). A batch skipped, or one taken by the
    # retry, would leave other weights.
    clean = app.run_training(
        _config(
            tmp_path / "clean",
            check_numerics=lib.MODES[mode],
            nan_policy="auto",
            inject_faults="transient_nan:100000",
            max_number_of_steps=70,
            seed=0,
        )
    )
    assert clean.bad_steps == 0
    ours, theirs = lib.checkpoint_values(result.checkpoint), lib.checkpoint_values(clean.checkpoint)
    weights = [n for n in theirs if n.startswith("MLP/")]
    assert weights, sorted(theirs)
    for name in weights:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-5, atol=1e-7, err_msg=name)


@lib.each_mode
def test_spike_auto_quarantines_a_mislabelled_example_and_meets_it_once(tmp_path, mode):
    """spike_example:7 (image x1000, label the next class) under --spike_policy=auto: the first
    batch holding it is a spike whose triage blames example 7 (the batch without it is under
    the spike threshold); it is skipped and quarantined, so 3 epochs hold one spike, not 3."""
    config = _config(
        tmp_path / "run",
        check_numerics=lib.MODES[mode],
        spike_policy="auto",
        inject_faults="spike_example:7",
        max_number_of_steps=190,
    )
    result = app.run_training(config)
    assert (result.global_step, result.bad_steps, result.spikes) == (190, 1, 1)
    (bad,) = _bad_steps(result)
    triage = bad["autopsy"]["triage"]
    assert (bad["cause"], triage["verdict"], bad["action"]) == ("spike", "data", "skip")
    without, threshold = triage["runs"][-1]["loss"], triage["runs"][0]["threshold"]
    assert without <= threshold < triage["runs"][0]["loss"]
    (held,) = slim_nanguard.quarantine.read(str(tmp_path / "run"))
    assert held["ids"]["IteratorGetNext:3"] == 7


@lib.each_mode
def test_a_retry_that_trains_the_last_step_ends_the_run_there(tmp_path, mode):
    """transient_nan:29 in a 30-step run: the retry trains global step 29 to 30 outside the
    session's hooks, and the run stops at 30, not one step later."""
    config = _config(
        tmp_path / "run",
        check_numerics=lib.MODES[mode],
        nan_policy="auto",
        inject_faults="transient_nan:29",
        max_number_of_steps=30,
    )
    result = app.run_training(config)
    assert (result.global_step, result.retries, result.stop_reason) == (30, 1, "step_limit")
    assert slim_nanguard.storage.checkpoint_step(result.checkpoint) == 30
