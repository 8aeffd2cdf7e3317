"""Tests of slim_nanguard.datasets: the shipped digits, synthetic data and TF-Slim TFRecords."""

import numpy as np
import pytest
import tensorflow as tf

import slim_nanguard
from slim_nanguard.app import datasets


def _read(name, split="train", num_batches=None, **kwargs):
    """Builds the dataset in a fresh graph, reads batches; returns (images, labels, info, ds)."""
    with tf.Graph().as_default():
        dataset, info = datasets.get_dataset(name, split, **kwargs)
        next_batch = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
        images, labels = [], []
        with tf.compat.v1.Session() as session:
            while num_batches is None or len(images) < num_batches:
                try:
                    batch_images, batch_labels = session.run(next_batch)
                except tf.errors.OutOfRangeError:
                    break
                images.append(batch_images)
                labels.append(batch_labels)
    return images, labels, info, next_batch


def _read_all(name, split="train", **kwargs):
    images, labels, info, _ = _read(name, split, shuffle=False, repeat=False, **kwargs)
    return np.concatenate(images), np.concatenate(labels), info


def _digit_like_images(count, height=8, width=8, channels=1, seed=0):
    return np.random.RandomState(seed).randint(
        0, 256, size=(count, height, width, channels), dtype=np.uint8
    )


# ---------------------------------------------------------------------------------------------
# digits


def test_digits_are_the_1797_uci_images_in_a_fixed_stratified_split():
    _, _, info, _ = _read("digits", batch_size=1, num_batches=1)

    assert info.name == "digits" and info.num_classes == 10
    assert info.image_shape == (8, 8, 1)
    assert dict(info.num_examples) == {"train": 1497, "test": 300}
    assert info.split_size == 1497
    assert info.class_names == tuple("0123456789")
    with np.load(datasets._DIGITS_PATH) as npz:
        assert npz["train_images"].dtype == np.uint8 and npz["train_images"].max() == 16
        index = np.concatenate([npz["train_index"], npz["test_index"]])
        assert sorted(index) == list(range(1797))
        assert np.bincount(npz["test_labels"]).tolist() == [30] * 10


def test_digits_training_batches_are_full_float_images_in_0_1_with_int64_labels():
    images, labels, _, (image_t, label_t) = _read("digits", batch_size=32, seed=1, num_batches=3)

    assert image_t.shape.as_list() == [32, 8, 8, 1]  # static: drop_remainder when repeating.
    assert label_t.shape.as_list() == [32]
    for batch_images, batch_labels in zip(images, labels):
        assert batch_images.shape == (32, 8, 8, 1) and batch_images.dtype == np.float32
        assert batch_labels.shape == (32,) and batch_labels.dtype == np.int64
        assert batch_images.min() >= 0.0 and batch_images.max() <= 1.0
        assert set(batch_labels) <= set(range(10))
    assert max(b.max() for b in images) == 1.0  # 16/16: the full range is used.


def test_digits_test_split_read_once_yields_every_example_once():
    images, labels, _, (image_t, _) = _read(
        "digits", "test", batch_size=64, shuffle=False, repeat=False
    )

    assert [len(b) for b in labels] == [64, 64, 64, 64, 44]  # the remainder is kept.
    assert image_t.shape.as_list() == [None, 8, 8, 1]
    assert np.bincount(np.concatenate(labels)).tolist() == [30] * 10
    with np.load(datasets._DIGITS_PATH) as npz:
        np.testing.assert_array_equal(np.concatenate(images)[..., 0] * 16, npz["test_images"])


def test_digits_resized_to_28_rgb_for_lenet_and_the_nets():
    images, _, info, _ = _read("digits", batch_size=8, image_size=28, channels=3, num_batches=1)

    assert info.image_shape == (28, 28, 3)
    assert images[0].shape == (8, 28, 28, 3)
    assert images[0].min() >= 0.0 and images[0].max() <= 1.0
    np.testing.assert_array_equal(images[0][..., 0], images[0][..., 2])  # grey in RGB.


def test_shuffling_follows_the_seed():
    first = _read("digits", batch_size=16, seed=5, num_batches=2)[1]
    again = _read("digits", batch_size=16, seed=5, num_batches=2)[1]
    other = _read("digits", batch_size=16, seed=6, num_batches=2)[1]

    np.testing.assert_array_equal(np.concatenate(first), np.concatenate(again))
    assert not np.array_equal(np.concatenate(first), np.concatenate(other))


# ---------------------------------------------------------------------------------------------
# synthetic


def test_synthetic_is_deterministic_for_a_seed_and_of_any_size():
    kwargs = dict(batch_size=16, seed=3, image_size=12, channels=3, num_classes=4, num_batches=2)
    images, labels, info, _ = _read("synthetic", **kwargs)
    images_again, labels_again, _, _ = _read("synthetic", **kwargs)

    assert info.image_shape == (12, 12, 3) and info.num_classes == 4
    assert dict(info.num_examples) == {"train": 1024, "test": 256}
    np.testing.assert_array_equal(np.concatenate(images), np.concatenate(images_again))
    np.testing.assert_array_equal(np.concatenate(labels), np.concatenate(labels_again))
    assert images[0].shape == (16, 12, 12, 3) and images[0].dtype == np.float32
    assert images[0].min() >= 0.0 and images[0].max() <= 1.0
    assert set(np.concatenate(labels)) <= set(range(4))


def test_synthetic_labels_are_learnable_by_a_linear_classifier():
    train_x, train_y, _ = _read_all("synthetic", "train", batch_size=256)
    test_x, test_y, _ = _read_all("synthetic", "test", batch_size=256)

    def features(x):
        return np.c_[x.reshape(len(x), -1), np.ones(len(x))]

    weights = np.linalg.lstsq(features(train_x), np.eye(10)[train_y], rcond=None)[0]
    accuracy = np.mean(features(test_x).dot(weights).argmax(1) == test_y)
    assert len(set(train_y)) == 10
    assert accuracy > 0.4  # chance is about 0.15.


# ---------------------------------------------------------------------------------------------
# tfrecord


def test_a_tfrecord_written_with_write_tfrecord_reads_back_the_same_pixels_and_labels(tmp_path):
    pixels = _digit_like_images(10)
    labels = np.arange(10) % 3
    assert datasets.write_tfrecord(str(tmp_path / "digits_train.tfrecord"), pixels, labels) == 10
    datasets.write_label_file(str(tmp_path), ["zero", "one", "two"])

    images, read_labels, info = _read_all(
        "tfrecord", "train", dataset_dir=str(tmp_path), batch_size=4
    )

    np.testing.assert_array_equal(read_labels, labels)
    np.testing.assert_array_equal(np.round(images * 255).astype(np.uint8), pixels)  # PNG.
    assert info.image_shape == (8, 8, 1) and info.num_classes == 3
    assert info.class_names == ("zero", "one", "two")
    assert dict(info.num_examples) == {"train": 10}


def test_tfrecord_reads_slims_shard_names_and_only_the_asked_split(tmp_path):
    rgb = _digit_like_images(6, 5, 7, 3)
    for shard in range(2):
        datasets.write_tfrecord(
            str(tmp_path / f"flowers_train_{shard:05d}-of-00002.tfrecord"),
            rgb[3 * shard : 3 * shard + 3],
            [shard] * 3,
        )
    datasets.write_tfrecord(
        str(tmp_path / "flowers_validation_00000-of-00001.tfrecord"), rgb[:1], [4]
    )
    datasets.write_tfrecord(str(tmp_path / "validation-00000-of-00001"), rgb[:1], [4])

    train_images, train_labels, train_info = _read_all(
        "tfrecord", "train", dataset_dir=str(tmp_path), batch_size=4, num_classes=5
    )
    _, validation_labels, validation_info = _read_all(
        "tfrecord", "validation", dataset_dir=str(tmp_path), batch_size=4
    )

    assert sorted(train_labels) == [0, 0, 0, 1, 1, 1]
    assert train_images.shape == (6, 5, 7, 3)
    assert train_info.num_classes == 5
    assert validation_labels.tolist() == [4, 4]  # slim style and ImageNet style files.
    assert validation_info.num_classes == 5  # no labels.txt: the largest label + 1.


def test_tfrecord_shuffled_training_batches_have_a_static_shape(tmp_path):
    datasets.write_tfrecord(str(tmp_path / "x_train.tfrecord"), _digit_like_images(10), [1] * 10)

    _, labels, info, (image_t, label_t) = _read(
        "tfrecord", dataset_dir=str(tmp_path), batch_size=4, seed=0, num_batches=5
    )

    assert image_t.shape.as_list() == [4, 8, 8, 1] and label_t.dtype == tf.int64
    assert len(labels) == 5 and info.num_classes == 2


def test_tfrecord_images_of_varying_size_need_image_size(tmp_path):
    images = [np.zeros((6, 6, 3), np.uint8), np.full((9, 4, 3), 255, np.uint8)]
    datasets.write_tfrecord(str(tmp_path / "mixed_train.tfrecord"), images, [0, 1])

    with pytest.raises(ValueError, match="differ in size.*image_size"):
        datasets.get_dataset("tfrecord", dataset_dir=str(tmp_path), batch_size=2)
    resized, labels, info = _read_all(
        "tfrecord", dataset_dir=str(tmp_path), batch_size=2, image_size=16
    )
    assert resized.shape == (2, 16, 16, 3) and info.image_shape == (16, 16, 3)
    np.testing.assert_allclose(resized[0], 0.0)
    np.testing.assert_allclose(resized[1], 1.0)
    assert labels.tolist() == [0, 1]


def test_tfrecord_jpeg_reads_back_close_to_the_original(tmp_path):
    smooth = np.tile(np.linspace(0, 255, 16, dtype=np.uint8), (4, 16, 1))[..., None]
    datasets.write_tfrecord(
        str(tmp_path / "j_test.tfrecord"), np.repeat(smooth, 3, -1), [0] * 4, format="jpeg"
    )

    images, _, info = _read_all("tfrecord", "test", dataset_dir=str(tmp_path), batch_size=4)

    assert info.image_shape == (16, 16, 3)
    assert np.abs(images * 255 - np.repeat(smooth, 3, -1)).mean() < 4


# ---------------------------------------------------------------------------------------------
# bad input: errors at build time that name the value and say what to do


def _write_examples(path, features_list):
    with tf.io.TFRecordWriter(str(path)) as writer:
        for features in features_list:
            writer.write(
                tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString()
            )


def _bytes(value):
    return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))


def _int64(value):
    return tf.train.Feature(int64_list=tf.train.Int64List(value=[value]))


def test_unknown_dataset_name_lists_the_choices():
    with pytest.raises(ValueError, match=r"'mnist'.*--dataset_name.*digits, synthetic, tfrecord"):
        datasets.get_dataset("mnist", batch_size=8)


def test_dataset_errors_are_slim_nanguard_errors_and_value_errors():
    with pytest.raises(slim_nanguard.NanGuardError) as caught:
        datasets.get_dataset("mnist", batch_size=8)
    assert isinstance(caught.value, ValueError)
    assert isinstance(caught.value, datasets.DatasetError)


def test_unknown_split_lists_the_splits():
    with pytest.raises(ValueError, match=r"'validation'.*--dataset_split_name.*train, test"):
        datasets.get_dataset("digits", "validation", batch_size=8)


@pytest.mark.parametrize(
    "argument, match",
    [
        (dict(batch_size=0), "batch_size=0"),
        (dict(batch_size=8, image_size=-1), "image_size=-1"),
        (dict(batch_size=8, channels=2), "channels=2"),
        (dict(batch_size=8, num_classes=7), "num_classes=7.*10 classes"),
    ],
)
def test_bad_arguments_are_named(argument, match):
    with pytest.raises(ValueError, match=match):
        datasets.get_dataset("digits", **argument)


def test_a_single_pass_too_small_for_one_full_batch_is_refused():
    with pytest.raises(ValueError, match="batch_size 400 is larger than the 300 examples"):
        datasets.get_dataset("digits", "test", batch_size=400, repeat=False, drop_remainder=True)


def test_tfrecord_without_dataset_dir_asks_for_it():
    with pytest.raises(ValueError, match="--dataset_dir"):
        datasets.get_dataset("tfrecord", batch_size=8)


def test_dataset_dir_that_does_not_exist(tmp_path):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=f"{missing} does not exist"):
        datasets.get_dataset("tfrecord", dataset_dir=missing, batch_size=8)


def test_dataset_dir_that_is_a_file(tmp_path):
    path = tmp_path / "flowers_train.tfrecord"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="is not a directory"):
        datasets.get_dataset("tfrecord", dataset_dir=str(path), batch_size=8)


def test_no_files_for_the_split_says_the_pattern_and_what_is_there(tmp_path):
    datasets.write_tfrecord(str(tmp_path / "flowers_train.tfrecord"), _digit_like_images(1), [0])
    with pytest.raises(
        ValueError, match=r"split 'validation'.*\*validation\*\.tfrecord\*.*flowers_train"
    ):
        datasets.get_dataset("tfrecord", "validation", dataset_dir=str(tmp_path), batch_size=8)


def test_files_with_no_records(tmp_path):
    (tmp_path / "flowers_train_00000-of-00001.tfrecord").write_bytes(b"")
    with pytest.raises(
        ValueError,
        match="flowers_train_00000-of-00001.tfrecord.*no records|"
        "no records.*flowers_train_00000-of-00001.tfrecord",
    ):
        datasets.get_dataset("tfrecord", dataset_dir=str(tmp_path), batch_size=8)


def test_a_file_that_is_not_a_tfrecord(tmp_path):
    path = tmp_path / "notes_train.tfrecord"
    path.write_bytes(b"this is not a TFRecord file at all, just text\n" * 4)
    with pytest.raises(ValueError, match=f"{path} is not a readable TFRecord"):
        datasets.get_dataset("tfrecord", dataset_dir=str(tmp_path), batch_size=8)


@pytest.mark.parametrize("missing", ["image/encoded", "image/class/label"])
def test_a_record_without_a_required_key_names_the_key_and_the_file(tmp_path, missing):
    good = tmp_path / "good.tfrecord"
    datasets.write_tfrecord(str(good), _digit_like_images(1), [0])
    record = tf.train.Example.FromString(next(iter(_raw_records(good))))
    features = dict(record.features.feature)
    del features[missing]
    path = tmp_path / "keys_train.tfrecord"
    _write_examples(path, [features])
    good.unlink()

    with pytest.raises(ValueError, match=f"{path} has no '{missing}' key"):
        datasets.get_dataset("tfrecord", dataset_dir=str(tmp_path), batch_size=8)


def _raw_records(path):
    with tf.Graph().as_default():
        next_record = tf.compat.v1.data.make_one_shot_iterator(
            tf.data.TFRecordDataset(str(path))
        ).get_next()
        with tf.compat.v1.Session() as session:
            while True:
                try:
                    yield session.run(next_record)
                except tf.errors.OutOfRangeError:
                    return


def test_an_image_that_does_not_decode_names_the_file(tmp_path):
    path = tmp_path / "broken_train.tfrecord"
    _write_examples(
        path,
        [
            {
                "image/encoded": _bytes(b"\x89PNG but not really"),
                "image/format": _bytes(b"png"),
                "image/class/label": _int64(0),
            }
        ],
    )
    with pytest.raises(ValueError, match=f"first image of {path} does not decode"):
        datasets.get_dataset("tfrecord", dataset_dir=str(tmp_path), batch_size=8)


def test_raw_pixel_records_are_refused_with_what_to_do(tmp_path):
    path = tmp_path / "raw_train.tfrecord"
    _write_examples(
        path,
        [
            {
                "image/encoded": _bytes(bytes(64)),
                "image/format": _bytes(b"RAW"),
                "image/class/label": _int64(0),
            }
        ],
    )
    with pytest.raises(ValueError, match=f"{path} has 'image/format' 'raw'.*PNG or JPEG"):
        datasets.get_dataset("tfrecord", dataset_dir=str(tmp_path), batch_size=8)


def test_a_label_beyond_labels_txt_names_the_file_and_the_label(tmp_path):
    path = tmp_path / "cats_train.tfrecord"
    datasets.write_tfrecord(str(path), _digit_like_images(3), [0, 1, 2])
    datasets.write_label_file(str(tmp_path), ["cat", "dog"])
    with pytest.raises(ValueError, match=f"{path} has label 2.*only 2 classes.*labels.txt"):
        datasets.get_dataset("tfrecord", dataset_dir=str(tmp_path), batch_size=8)


def test_a_malformed_labels_txt_names_the_line(tmp_path):
    datasets.write_tfrecord(str(tmp_path / "a_train.tfrecord"), _digit_like_images(1), [0])
    (tmp_path / "labels.txt").write_text("0:cat\ndog\n")
    with pytest.raises(ValueError, match="Line 2 of .*labels.txt is 'dog'"):
        datasets.get_dataset("tfrecord", dataset_dir=str(tmp_path), batch_size=8)


def test_write_tfrecord_wants_uint8_images_and_one_label_each(tmp_path):
    with pytest.raises(ValueError, match="float32, not uint8"):
        datasets.write_tfrecord(str(tmp_path / "f.tfrecord"), np.zeros((1, 4, 4), np.float32), [0])
    with pytest.raises(ValueError, match="2 images but 1 labels"):
        datasets.write_tfrecord(str(tmp_path / "f.tfrecord"), _digit_like_images(2), [0])


def test_building_a_dataset_leaves_the_callers_graph_clean(tmp_path):
    datasets.write_tfrecord(str(tmp_path / "c_train.tfrecord"), _digit_like_images(2), [0, 1])
    with tf.Graph().as_default() as graph:
        datasets.get_dataset("tfrecord", dataset_dir=str(tmp_path), batch_size=2)
        op_types = {op.type for op in graph.get_operations()}
    # The checks ran on a scratch graph: no decode or placeholder ops leaked into this one.
    assert "Placeholder" not in op_types and "DecodeImage" not in op_types


def test_a_tfrecord_broken_after_good_records_names_the_file_the_count_and_the_cause(tmp_path):
    path = tmp_path / "cut_train.tfrecord"
    datasets.write_tfrecord(str(path), _digit_like_images(100), [i % 10 for i in range(100)])
    with open(path, "ab") as f:
        f.write(b"garbage that is no record" * 3)
    with pytest.raises(ValueError) as raised:
        datasets.get_dataset("tfrecord", dataset_dir=str(tmp_path), batch_size=8)
    message = str(raised.value)
    assert f"{path} is not a readable TFRecord file after 100 records (" in message
    assert "Graph execution error" not in message and "\n" not in message
    assert "corrupted record" in message or "truncated record" in message  # TF's cause


def test_find_bad_record_names_the_file_the_record_and_the_cause(tmp_path):
    path = tmp_path / "late_train.tfrecord"
    datasets.write_tfrecord(str(path), _digit_like_images(6), list(range(6)))
    broken = tmp_path / "broken.tfrecord"
    _write_examples(
        broken,
        [
            {
                "image/encoded": _bytes(b"\x89PNG but not really"),
                "image/format": _bytes(b"png"),
                "image/class/label": _int64(0),
            }
        ],
    )
    with tf.io.TFRecordWriter(str(tmp_path / "joined_train.tfrecord")) as writer:
        for record in list(_raw_records(path)) + list(_raw_records(broken)):
            writer.write(record)
    path.unlink()
    broken.unlink()
    found = datasets.find_bad_record(str(tmp_path), "train")
    assert found.startswith(
        f"Record 6 of {tmp_path / 'joined_train.tfrecord'} (after 6 good records) does not decode ("
    )
    assert "Graph execution error" not in found
