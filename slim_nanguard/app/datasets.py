"""Input pipelines for training and evaluation: shipped digits, synthetic data, TF-Slim TFRecords.

Every dataset comes out of `get_dataset` as a batched, prefetched ``tf.data.Dataset``
of ``(images, labels)``: ``images`` float32 ``[B, H, W, C]`` scaled to ``[0, 1]``, ``labels``
int64 ``[B]``, together with a `DatasetInfo` that says how many classes and what image
shape to build the model for. The pipelines work in graph mode (``tf.compat.v1``, the
launcher's ``tf.compat.v1.data.make_one_shot_iterator``) as well as in eager mode; nothing
here depends on eager execution being on.

The datasets, by ``name`` (the launcher's ``--dataset_name``):

* ``digits`` (the default): the UCI 8x8 handwritten digits shipped in the package
  (``slim_nanguard/app/data/digits.npz``, 1797 images, 10 classes, splits ``train`` 1497 /
  ``test`` 300). Real data that needs no download.
* ``synthetic``: a deterministic, learnable toy problem of any image size, for tests and
  benchmarks. Each image is a random 4x4 pattern scaled up plus noise; its label is the
  argmax of a fixed linear function of the pattern.
* ``tfrecord``: TFRecord files in TF-Slim's format, as written by tensorflow/models
  ``research/slim/download_and_convert_data.py``: ``tf.train.Example`` records with
  ``image/encoded`` (PNG/JPEG/... bytes), ``image/format`` and ``image/class/label``, files
  named like ``flowers_train_00000-of-00005.tfrecord``, ``mnist_train.tfrecord`` or
  ``train-00000-of-01024`` in ``dataset_dir``, plus an optional ``labels.txt``
  (``0:daisy`` lines). `write_tfrecord` writes that format from arrays.

Bad input is caught when the dataset is built, before any training step runs: a missing or
empty directory, no files for the split, files without records, records without the
expected keys and images that do not decode raise a `DatasetError` (a ``ValueError``)
naming the value, file or key and saying what to do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import types
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
from absl import logging as absl_logging

from slim_nanguard import NanGuardError
from slim_nanguard import quarantine
from slim_nanguard import storage
from slim_nanguard.app import preflight

# absl's logger itself: its module functions would configure Python's root logger in a
# script that is not run by absl's app.run (see slim_nanguard/_log.py).
logging = absl_logging.get_absl_logger()

__all__ = [
    "DATASETS",
    "DATASET_NAMES",
    "DEFAULT_DATASET",
    "DatasetError",
    "DatasetInfo",
    "DatasetSpec",
    "ENCODED_KEY",
    "FORMAT_KEY",
    "LABEL_KEY",
    "LABELS_FILENAME",
    "find_bad_record",
    "get_dataset",
    "read_label_file",
    "write_label_file",
    "write_tfrecord",
]

DEFAULT_DATASET = "digits"

# The keys of TF-Slim's image classification records (slim's dataset_utils.image_to_tfexample).
ENCODED_KEY = "image/encoded"
FORMAT_KEY = "image/format"
LABEL_KEY = "image/class/label"
HEIGHT_KEY = "image/height"
WIDTH_KEY = "image/width"
LABELS_FILENAME = "labels.txt"

# Where the files of a split are looked for, in order, when no file_pattern is given: slim's
# flowers/mnist/cifar10 converters write '<name>_<split>[_NNNNN-of-NNNNN].tfrecord', the
# ImageNet converter writes '<split>-NNNNN-of-NNNNN' without an extension.
DEFAULT_FILE_PATTERNS = ("*{split}*.tfrecord*", "{split}-*-of-*")

_DIGITS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "digits.npz")
_DIGITS_SPLITS = ("train", "test")
_DIGITS_LEVELS = 16.0  # the digits' pixels count 'on' pixels in a 4x4 block: 0..16.

_SYNTHETIC_SPLITS = {"train": 1024, "test": 256}
_SYNTHETIC_SPLIT_SEEDS = {"train": 1, "test": 2}
_SYNTHETIC_DATA_SEED = 20240917
_SYNTHETIC_PATTERN = 4  # images are a 4x4 pattern scaled up, plus noise.
_SYNTHETIC_DEFAULT_SIZE = 8
_SYNTHETIC_DEFAULT_CLASSES = 10

# A split whose files add up to at most this many bytes is read in full when the dataset is
# built: every record's keys and label are checked and the records counted. Larger splits get
# the first record of each file checked only, and their size is reported as unknown.
_SCAN_BYTES = 64 << 20
_MAX_FILES_DECODED = 32
_DEFAULT_TFRECORD_SHUFFLE_BUFFER = 1024
_SUPPORTED_FORMATS = ("png", "jpeg", "jpg", "gif", "bmp", "webp")


class DatasetError(NanGuardError, ValueError):
    """Bad dataset arguments or input files; the message says what to change.

    A ``ValueError`` as well, so that ``except ValueError`` clauses catch it.
    """


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    """What a model needs to know about the dataset it is built for.

    Attributes:
      name: The dataset name, one of ``DATASET_NAMES``.
      split: The split the pipeline reads, e.g. ``'train'``.
      num_classes: The number of classes; labels are in ``[0, num_classes)``.
      image_shape: ``(height, width, channels)`` of each image the pipeline yields.
      num_examples: Examples per split, as far as they are known; ``None`` for a split
        whose size is unknown (large TFRecord splits are not counted).
      class_names: The class names by label, when known (digits, or a ``labels.txt``).
    """

    name: str
    split: str
    num_classes: int
    image_shape: tuple[int, int, int]
    num_examples: Mapping[str, int | None]
    class_names: tuple[str, ...] | None = None

    def __post_init__(self):
        object.__setattr__(self, "image_shape", tuple(int(d) for d in self.image_shape))
        object.__setattr__(self, "num_examples", types.MappingProxyType(dict(self.num_examples)))
        if self.class_names is not None:
            object.__setattr__(self, "class_names", tuple(self.class_names))

    @property
    def split_size(self) -> int | None:
        """The number of examples in ``split``, or ``None`` if unknown."""
        return self.num_examples.get(self.split)


# What a dataset's builder returns: its examples (unbatched), the function that maps one to
# (image, label), its DatasetInfo and its shuffle buffer size.
_Source = Tuple[tf.data.Dataset, Callable[..., Any], DatasetInfo, int]


def get_dataset(
    name: str,
    split: str = "train",
    *,
    batch_size: int,
    dataset_dir: str | None = None,
    shuffle: bool = True,
    repeat: bool = True,
    seed: int | None = None,
    image_size: int | None = None,
    num_classes: int | None = None,
    channels: int | None = None,
    drop_remainder: bool | None = None,
    file_pattern: str | None = None,
    shuffle_buffer_size: int | None = None,
    purpose: str = "input",
    example_index: bool = False,
    quarantine_dir: str | None = None,
) -> tuple[tf.data.Dataset, DatasetInfo]:
    """Builds the input pipeline of a dataset split.

    Args:
      name: ``'digits'``, ``'synthetic'`` or ``'tfrecord'`` (see the module docstring).
      split: The split to read: ``'train'`` or ``'test'`` for digits and synthetic; for
        tfrecord, the split name in the file names (e.g. ``'train'``, ``'validation'``).
      batch_size: Examples per batch.
      dataset_dir: For tfrecord, the directory holding the files (and ``labels.txt``).
        Not used by the other datasets.
      shuffle: Shuffle the examples (and, for tfrecord, the files).
      repeat: Repeat the split forever (training); ``False`` reads it once (evaluation).
      seed: Seed of the shuffling; the same seed gives the same order of examples.
      image_size: If given, images are resized (bilinear) to ``image_size`` squared, e.g.
        28 to feed the digits to LeNet. Required for tfrecord images of varying size.
        For synthetic, the image side (default 8).
      num_classes: For tfrecord, the number of classes when ``dataset_dir`` has no
        ``labels.txt`` (otherwise inferred from the labels when the split is small);
        for synthetic, the number of classes (default 10); digits has 10.
      channels: Image channels to produce: for tfrecord the images are decoded to this
        many (default: those of the first image); synthetic defaults to 1; digits is
        grey (1) and can be repeated to 3.
      drop_remainder: Drop a last, smaller batch so every batch has ``batch_size``
        examples and a static batch dimension. Defaults to ``repeat``: training batches
        are all full; a single evaluation pass keeps every example.
      file_pattern: For tfrecord, a glob relative to ``dataset_dir`` naming the split's
        files, ``%s`` standing for the split (e.g. ``'flowers_%s_*.tfrecord'``); by
        default the patterns in ``DEFAULT_FILE_PATTERNS`` are tried.
      shuffle_buffer_size: Examples in the shuffle buffer; defaults to the whole split
        for digits and synthetic, 1024 for tfrecord.
      purpose: What the pipeline is for, said first in its log line (``"training data"``).
      example_index: Each batch also carries its examples' int64 positions in the split as
        read before shuffling (digits and synthetic: the same example has the same index in
        every epoch; tfrecord: in the order the files are read).
      quarantine_dir: Leave out the examples quarantined in this training directory
        (`slim_nanguard.quarantine`), read when the pipeline first runs, and those the guard
        of this process quarantines later.

    Returns:
      ``(dataset, info)``: the dataset yields ``(images, labels)``, float32
      ``[batch, H, W, C]`` in ``[0, 1]`` and int64 ``[batch]`` (then the int64 ``[batch]``
      example indices, with `example_index`); ``info`` describes it.

    Raises:
      DatasetError: (a ``ValueError``) for an unknown name or split, bad arguments, or
        TFRecord input that cannot be read (see the module docstring); the message says
        what to change.
    """
    spec = DATASETS.get(name)
    if spec is None:
        raise DatasetError(
            f"Unknown dataset name {name!r} (--dataset_name): choose one of "
            f"{', '.join(DATASET_NAMES)}."
        )
    _check_positive_int("batch_size", batch_size)
    if image_size is not None:
        _check_positive_int("image_size", image_size)
    if channels is not None and channels not in (1, 3, 4):
        raise DatasetError(
            f"channels={channels!r}: images can have 1 (grey), 3 (RGB) or 4 (RGBA) channels."
        )
    if num_classes is not None:
        _check_positive_int("num_classes", num_classes)
    if shuffle_buffer_size is not None:
        _check_positive_int("shuffle_buffer_size", shuffle_buffer_size)
    if drop_remainder is None:
        drop_remainder = repeat

    if spec.splits and split not in spec.splits:
        raise DatasetError(
            f"Unknown split {split!r} (--dataset_split_name) for dataset {name}: "
            f"choose one of {', '.join(spec.splits)}."
        )
    dataset, map_fn, info, buffer = spec.build(
        split,
        dataset_dir=dataset_dir,
        file_pattern=file_pattern,
        image_size=image_size,
        num_classes=num_classes,
        channels=channels,
        shuffle=shuffle,
        seed=seed,
    )
    if shuffle_buffer_size is not None:
        buffer = shuffle_buffer_size
    size = info.split_size
    if size is not None and not repeat and drop_remainder and batch_size > size:
        raise DatasetError(
            f"batch_size {batch_size} is larger than the {size} examples of "
            f"{name} split {split!r}, and with drop_remainder and no repeat not "
            "one batch would come out: lower batch_size or pass "
            "drop_remainder=False."
        )

    if example_index:
        dataset, map_fn = dataset.enumerate(), _keeping_index(map_fn)
    if shuffle:
        dataset = dataset.shuffle(buffer, seed=seed, reshuffle_each_iteration=True)
    if repeat:
        dataset = dataset.repeat()
    dataset = dataset.map(map_fn, num_parallel_calls=tf.data.AUTOTUNE)
    if quarantine_dir is not None:  # The examples as the model is fed them: after the map.
        dataset = quarantine.filter_dataset(dataset, quarantine_dir)
    dataset = dataset.batch(batch_size, drop_remainder=drop_remainder)
    dataset = dataset.prefetch(tf.data.AUTOTUNE)
    logging.info(
        "%s: dataset %s split %s, %s examples, images %s, %s classes, batch %s.",
        purpose,
        name,
        split,
        size if size is not None else "unknown number of",
        info.image_shape,
        info.num_classes,
        batch_size,
    )
    return dataset, info


def _keeping_index(map_fn):
    """`map_fn` over ``(index, element)``: its outputs, then the index."""

    def mapped(index, element):
        outputs = map_fn(*element) if isinstance(element, tuple) else map_fn(element)
        return (*outputs, index)

    return mapped


# --------------------------------------------------------------------------------------------
# digits


@functools.lru_cache(maxsize=1)
def _load_digits() -> Mapping[str, np.ndarray]:
    if not os.path.isfile(_DIGITS_PATH):
        raise DatasetError(
            f"The shipped digits file {_DIGITS_PATH} is missing: reinstall "
            "slim_nanguard (its package data must include data/digits.npz), or "
            "regenerate it with research/make_digits_npz.py."
        )
    with np.load(_DIGITS_PATH) as npz:
        return types.MappingProxyType({key: npz[key] for key in npz.files})


def _digits(split, *, image_size, num_classes, channels, **unused) -> _Source:
    del unused  # Read from the package: no directory, files or shuffling of its own.
    if num_classes not in (None, 10):
        raise DatasetError(
            f"num_classes={num_classes}: the digits have 10 classes; leave num_classes unset."
        )
    if channels not in (None, 1, 3):
        raise DatasetError(
            f"channels={channels}: the digits are grey; use 1, or 3 to repeat "
            "the grey level into RGB."
        )
    channels = channels or 1
    arrays = _load_digits()
    images = arrays[f"{split}_images"].astype(np.float32)[..., np.newaxis] / _DIGITS_LEVELS
    labels = arrays[f"{split}_labels"].astype(np.int64)
    side = image_size or images.shape[1]

    def map_fn(image, label):
        if image_size is not None:
            image = _resize(image, image_size)
        if channels == 3:
            image = tf.image.grayscale_to_rgb(image)
        return image, label

    info = DatasetInfo(
        name="digits",
        split=split,
        num_classes=10,
        image_shape=(side, side, channels),
        num_examples={s: len(arrays[f"{s}_labels"]) for s in _DIGITS_SPLITS},
        class_names=tuple(str(d) for d in range(10)),
    )
    # The split comes from Python, once per pass, not as a constant: a constant would put the
    # digits into graph.pbtxt and every checkpoint's .meta.
    dataset = tf.data.Dataset.from_generator(
        lambda: [(images, labels)],
        output_signature=(
            tf.TensorSpec((None,) + images.shape[1:], tf.float32),
            tf.TensorSpec((None,), tf.int64),
        ),
    ).unbatch()
    return dataset, map_fn, info, len(labels)


def _resize(image: tf.Tensor, size: int) -> tf.Tensor:
    """Resizes a float [H, W, C] image in [0, 1] to [size, size, C], staying in [0, 1]."""
    image = tf.image.resize(image, [size, size], method=tf.image.ResizeMethod.BILINEAR)
    return tf.clip_by_value(image, 0.0, 1.0)


# --------------------------------------------------------------------------------------------
# synthetic


def _synthetic(split, *, image_size, num_classes, channels, **unused) -> _Source:
    del unused  # Generated: no directory, files or shuffling of its own.
    side = image_size or _SYNTHETIC_DEFAULT_SIZE
    classes = num_classes or _SYNTHETIC_DEFAULT_CLASSES
    channels = channels or 1
    pattern_shape = [_SYNTHETIC_PATTERN, _SYNTHETIC_PATTERN, channels]
    # The labelling function: the same for every split, so test measures generalisation.
    weights = np.random.RandomState(_SYNTHETIC_DATA_SEED).randn(
        int(np.prod(pattern_shape)), classes
    )
    weights = (weights / np.linalg.norm(weights, axis=0)).astype(np.float32)  # Balances classes.
    split_seed = _SYNTHETIC_SPLIT_SEEDS[split]

    def map_fn(index):
        # Stateless ops keyed on (split, index): the same example every time, in any order.
        pattern = tf.random.stateless_uniform(pattern_shape, seed=tf.stack([split_seed, 2 * index]))
        noise = tf.random.stateless_uniform(
            [side, side, channels], seed=tf.stack([split_seed, 2 * index + 1])
        )
        scores = tf.matmul(tf.reshape(pattern - 0.5, [1, -1]), weights)
        label = tf.argmax(scores[0], output_type=tf.int64)
        image = tf.image.resize(
            pattern, [side, side], method=tf.image.ResizeMethod.NEAREST_NEIGHBOR
        )
        image = 0.75 * image + 0.25 * noise
        image.set_shape([side, side, channels])
        return image, label

    info = DatasetInfo(
        name="synthetic",
        split=split,
        num_classes=classes,
        image_shape=(side, side, channels),
        num_examples=dict(_SYNTHETIC_SPLITS),
    )
    dataset = tf.data.Dataset.range(_SYNTHETIC_SPLITS[split])
    return dataset, map_fn, info, _SYNTHETIC_SPLITS[split]


# --------------------------------------------------------------------------------------------
# tfrecord


@dataclasses.dataclass
class _Scan:
    """What reading a split's files at build time found."""

    num_records: int | None = None  # None: the split was too large to count.
    max_label: int | None = None
    min_label: int | None = None
    max_label_file: str | None = None
    sizes: set = dataclasses.field(default_factory=set)  # (height, width) from the keys.
    first_shape: tuple[int, int, int] | None = None
    empty_files: list = dataclasses.field(default_factory=list)


def _tfrecord(
    split, *, dataset_dir, file_pattern, image_size, num_classes, channels, shuffle, seed
) -> _Source:
    files, patterns = _split_files(dataset_dir, split, file_pattern)
    scan = _scan_files(files, channels)
    if scan.empty_files:
        if len(scan.empty_files) == len(files):
            raise DatasetError(
                f"The TFRecord files of split {split!r} in {dataset_dir} hold no "
                f"records: {', '.join(scan.empty_files)} (matched by "
                f"{' or '.join(patterns)}). Re-run the conversion that wrote "
                "them, or point --dataset_dir / --dataset_split_name at files "
                "that hold examples."
            )
        logging.warning(
            "Skipping %s TFRecord file(s) with no records: %s",
            len(scan.empty_files),
            ", ".join(scan.empty_files),
        )
        files = [f for f in files if f not in scan.empty_files]

    height, width, decoded_channels = scan.first_shape
    channels = channels or decoded_channels
    if image_size is None and len(scan.sizes) > 1:
        raise DatasetError(
            f"The images of split {split!r} in {dataset_dir} differ in size "
            f"(e.g. {', '.join('%sx%s' % s for s in sorted(scan.sizes)[:3])}) "
            "and cannot be batched: pass image_size (e.g. 224) to resize them."
        )
    image_shape = (
        (image_size, image_size, channels) if image_size is not None else (height, width, channels)
    )

    class_names = None
    labels_path = storage.join(dataset_dir, LABELS_FILENAME)
    if tf.io.gfile.exists(labels_path):
        names = read_label_file(dataset_dir)
        class_names = tuple(names.get(i, str(i)) for i in range(max(names) + 1))
    if num_classes is None:
        if class_names is not None:
            num_classes = len(class_names)
        elif scan.max_label is not None:
            num_classes = scan.max_label + 1
            logging.warning(
                "No %s in %s: taking num_classes=%s from the largest label seen. "
                "Write a labels.txt (write_label_file) or pass num_classes if "
                "some class is missing from split %s.",
                LABELS_FILENAME,
                dataset_dir,
                num_classes,
                split,
            )
        else:
            raise DatasetError(
                f"Cannot tell the number of classes of {dataset_dir}: it has no "
                f"{LABELS_FILENAME} and split {split!r} is too large to scan. "
                f'Pass num_classes, or write {labels_path} with "0:name" lines '
                "(write_label_file)."
            )
    elif class_names is not None and len(class_names) != num_classes:
        logging.warning(
            "num_classes=%s overrides the %s classes of %s.",
            num_classes,
            len(class_names),
            labels_path,
        )
        class_names = None
    if scan.min_label is not None and scan.min_label < 0:
        raise DatasetError(
            f"A record in split {split!r} of {dataset_dir} has the negative label "
            f"{scan.min_label} under {LABEL_KEY!r}: labels must be 0.."
            f"num_classes-1; fix the conversion that wrote the files."
        )
    if scan.max_label is not None and scan.max_label >= num_classes:
        source = labels_path if class_names is not None else "num_classes"
        raise DatasetError(
            f"{scan.max_label_file} has label {scan.max_label} under "
            f"{LABEL_KEY!r}, but there are only {num_classes} classes (from "
            f"{source}): labels must be 0..{num_classes - 1}. Pass the right "
            f"num_classes or fix {LABELS_FILENAME}."
        )

    info = DatasetInfo(
        name="tfrecord",
        split=split,
        num_classes=num_classes,
        image_shape=image_shape,
        num_examples={split: scan.num_records},
        class_names=class_names,
    )

    def map_fn(serialized):
        features = tf.io.parse_single_example(
            serialized,
            {
                ENCODED_KEY: tf.io.FixedLenFeature([], tf.string),
                LABEL_KEY: tf.io.FixedLenFeature([], tf.int64),
            },
        )
        image = tf.io.decode_image(
            features[ENCODED_KEY], channels=channels, expand_animations=False
        )
        image = tf.image.convert_image_dtype(image, tf.float32)
        if image_size is not None:
            image = _resize(image, image_size)
        else:
            same = tf.debugging.assert_equal(
                tf.shape(image)[:2],
                tf.constant([height, width]),
                message=(
                    f"An image of split {split!r} in {dataset_dir} is not "
                    f"{height}x{width} like the first one: pass image_size to resize "
                    "the images to one size."
                ),
            )
            with tf.control_dependencies([same]):
                image = tf.identity(image)
            image.set_shape(image_shape)
        return image, features[LABEL_KEY]

    if shuffle and len(files) > 1:
        dataset = tf.data.Dataset.from_tensor_slices(files).shuffle(len(files), seed=seed)
        dataset = dataset.interleave(
            tf.data.TFRecordDataset,
            cycle_length=min(len(files), 4),
            num_parallel_calls=tf.data.AUTOTUNE,
        )
    else:
        dataset = tf.data.TFRecordDataset(files)
    buffer = _DEFAULT_TFRECORD_SHUFFLE_BUFFER
    if scan.num_records is not None:
        buffer = min(buffer, scan.num_records)
    return dataset, map_fn, info, buffer


def _split_files(dataset_dir, split, file_pattern):
    """Returns the sorted TFRecord files of a split and the patterns that were tried."""
    problem = preflight.dataset_dir_problem(dataset_dir, tf.io.gfile.exists, tf.io.gfile.isdir)
    if problem:
        raise DatasetError(problem)
    if not split or any(c in split for c in "*?[]/"):
        raise DatasetError(
            f"Bad split name {split!r} (--dataset_split_name): give the word that "
            "names the split's files, e.g. train or validation."
        )
    if file_pattern is not None:
        patterns = [file_pattern % split if "%s" in file_pattern else file_pattern]
    else:
        patterns = [p.format(split=split) for p in DEFAULT_FILE_PATTERNS]
    files = set()
    for pattern in patterns:
        files.update(
            f
            for f in tf.io.gfile.glob(storage.join(dataset_dir, pattern))
            if not tf.io.gfile.isdir(f)
        )
    if not files:
        present = sorted(tf.io.gfile.listdir(dataset_dir))
        shown = ", ".join(present[:8]) + (", ..." if len(present) > 8 else "")
        raise DatasetError(
            f"No TFRecord files for split {split!r} (--dataset_split_name) in "
            f"{dataset_dir}: looked for {' and '.join(patterns)}; the directory "
            f"holds {shown or 'nothing'}. Pass the split your file names hold as "
            "--dataset_split_name (e.g. train, validation), or rename the files to match."
        )
    return sorted(files), patterns


def _scan_files(files: Sequence[str], channels: int | None) -> _Scan:
    """Reads the files far enough to fail now, not in the middle of training, on bad input."""
    scan = _Scan()
    sizes = {f: tf.io.gfile.stat(f).length for f in files}
    full = sum(sizes.values()) <= _SCAN_BYTES
    scan.num_records = 0 if full else None
    firsts = []  # (file, first record's encoded image)
    with _scratch_session() as session:
        reader = _RecordReader(session)
        for path in files:
            if sizes[path] == 0:
                scan.empty_files.append(path)
                continue
            count = 0
            for index, record in reader.records(path, only_first=not full):
                example = _parse_example(path, index, record)
                if count == 0 and len(firsts) < _MAX_FILES_DECODED:
                    firsts.append((path, example[ENCODED_KEY]))
                label = example[LABEL_KEY]
                if scan.max_label is None or label > scan.max_label:
                    scan.max_label, scan.max_label_file = label, path
                if scan.min_label is None or label < scan.min_label:
                    scan.min_label = label
                if example["size"]:
                    scan.sizes.add(example["size"])
                count += 1
            if count == 0:
                scan.empty_files.append(path)
            elif full:
                scan.num_records += count
        if firsts:
            scan.first_shape = _decode_first_images(session, firsts, channels)
    if not full:
        # Labels of a partial scan say nothing about the number of classes.
        scan.max_label = scan.min_label = scan.max_label_file = None
    return scan


class _RecordReader:
    """Reads the records of TFRecord files through a session on a scratch graph."""

    _BATCH = 512

    def __init__(self, session: tf.compat.v1.Session):
        self._session = session
        with session.graph.as_default():
            self._path = tf.compat.v1.placeholder(tf.string, [])
            records = tf.data.TFRecordDataset(self._path)
            self._all = tf.compat.v1.data.make_initializable_iterator(records.batch(self._BATCH))
            self._first = tf.compat.v1.data.make_initializable_iterator(records.take(1).batch(1))
            self._one = tf.compat.v1.data.make_initializable_iterator(records)
            self._next_all = self._all.get_next()
            self._next_first = self._first.get_next()
            self._next_one = self._one.get_next()

    def count_readable(self, path: str) -> int:
        """How many records of `path` read before the first that does not."""
        count = 0
        try:
            self._session.run(self._one.initializer, {self._path: path})
            while True:
                self._session.run(self._next_one)
                count += 1
        except tf.errors.OpError:  # OutOfRange at the end, DataLoss at a broken record.
            return count

    def records(self, path: str, only_first: bool) -> Iterator[tuple[int, bytes]]:
        """Yields (index, serialized record) of the file: all of them, or the first only."""
        iterator, get_next = (
            (self._first, self._next_first) if only_first else (self._all, self._next_all)
        )
        index = 0
        try:
            self._session.run(iterator.initializer, {self._path: path})
            while True:
                try:
                    batch = self._session.run(get_next)
                except tf.errors.OutOfRangeError:
                    return
                for record in batch:
                    yield index, record
                    index += 1
        except tf.errors.OpError as err:
            # Records are read in batches: count the good ones one by one.
            index = self.count_readable(path)
            raise DatasetError(
                f"{path} is not a readable TFRecord file after {index} records "
                f"({storage.op_error_cause(err)}); it may be truncated, compressed or of "
                "another format: re-run the conversion, or move the file out of "
                "--dataset_dir."
            ) from err


def _parse_example(path: str, index: int, record: bytes) -> dict:
    try:
        example = tf.train.Example.FromString(record)
    except Exception as err:  # protobuf raises its own DecodeError.
        raise DatasetError(
            f"Record {index} of {path} is not a tf.train.Example ({err}): the "
            "tfrecord dataset reads TF-Slim image records; re-run the conversion "
            "that wrote the file."
        ) from err
    feature = example.features.feature
    for key in (ENCODED_KEY, LABEL_KEY):
        if key not in feature:
            raise DatasetError(
                f"Record {index} of {path} has no {key!r} key (it has "
                f"{', '.join(sorted(feature)) or 'no keys'}): the tfrecord "
                f"dataset needs {ENCODED_KEY!r} and {LABEL_KEY!r} as written by "
                "slim's download_and_convert_data.py or write_tfrecord."
            )
    encoded = feature[ENCODED_KEY].bytes_list.value
    if len(encoded) != 1:
        raise DatasetError(
            f"Record {index} of {path}: {ENCODED_KEY!r} must hold one encoded "
            f"image (bytes), it holds {len(encoded)} bytes values. Re-write the "
            "file with one image per record."
        )
    labels = feature[LABEL_KEY].int64_list.value
    if len(labels) != 1:
        raise DatasetError(
            f"Record {index} of {path}: {LABEL_KEY!r} must hold one int64 label, "
            f"it holds {len(labels)} int64 values. Re-write the file with one "
            "integer label per record."
        )
    if FORMAT_KEY in feature:
        fmt = b"".join(feature[FORMAT_KEY].bytes_list.value).decode("utf-8", "replace").lower()
        if fmt and fmt not in _SUPPORTED_FORMATS:
            raise DatasetError(
                f"Record {index} of {path} has {FORMAT_KEY!r} {fmt!r}: only "
                f"encoded images ({', '.join(_SUPPORTED_FORMATS)}) can be read; "
                "convert the images to PNG or JPEG (write_tfrecord does)."
            )
    size = None
    if HEIGHT_KEY in feature and WIDTH_KEY in feature:
        heights = feature[HEIGHT_KEY].int64_list.value
        widths = feature[WIDTH_KEY].int64_list.value
        if len(heights) == 1 and len(widths) == 1:
            size = (int(heights[0]), int(widths[0]))
    return {ENCODED_KEY: encoded[0], LABEL_KEY: int(labels[0]), "size": size}


@contextlib.contextmanager
def _scratch_session() -> Iterator[tf.compat.v1.Session]:
    """A one-thread session on a throwaway graph: works in eager and graph mode alike."""
    graph = tf.Graph()
    config = tf.compat.v1.ConfigProto(
        intra_op_parallelism_threads=1, inter_op_parallelism_threads=1
    )
    with graph.as_default(), tf.compat.v1.Session(graph=graph, config=config) as session:
        yield session


def _decode_first_images(session, firsts, channels) -> tuple[int, int, int]:
    """Decodes the first image of each file; returns the first one's (H, W, C)."""
    shapes = []
    with session.graph.as_default():
        encoded = tf.compat.v1.placeholder(tf.string, [])
        shape = tf.shape(
            tf.io.decode_image(encoded, channels=channels or 0, expand_animations=False)
        )
    for path, data in firsts:
        try:
            shapes.append(tuple(int(d) for d in session.run(shape, {encoded: data})))
        except tf.errors.OpError as err:
            raise DatasetError(
                f"The first image of {path} does not decode "
                f"({storage.op_error_cause(err)}): {ENCODED_KEY!r} must hold PNG, JPEG, "
                "GIF, BMP or WebP bytes. Re-run the conversion that wrote the "
                "file."
            ) from err
    return shapes[0]


# --------------------------------------------------------------------------------------------
# The registry


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """Everything the launcher knows about one dataset: how to read it and what it holds.

    Attributes:
      name: The dataset's name (the launcher's ``--dataset_name``).
      build: ``fn(split, *, dataset_dir, file_pattern, image_size, num_classes, channels,
        shuffle, seed)`` returning the split's unbatched examples, the function that maps
        one to ``(image, label)``, its `DatasetInfo` and its shuffle buffer size.
        `get_dataset` checks the arguments they all share first.
      splits: The splits it has; empty: any split its files name.
      num_classes: Its number of classes; None: the data's (or the caller's) own.
      image_size: The side of its images when no image_size is asked for; None: the files'.
      channels: The channels of its images by default; None: the files'.
      dataset_dir: What the ``--dataset_dir`` it needs holds (``"the TFRecord files"``);
        None: it reads no directory.
      adapts_channels: Whether it gives the channels a model takes (the grey digits
        repeated to RGB for the tf_slim.nets); False: its images keep their own.
    """

    name: str
    build: Callable[..., _Source]
    splits: Tuple[str, ...]
    num_classes: Optional[int]
    image_size: Optional[int]
    channels: Optional[int]
    dataset_dir: Optional[str] = None
    adapts_channels: bool = True


# The datasets by name: the one table the launcher, its flags and the checks read.
DATASETS: Mapping[str, DatasetSpec] = types.MappingProxyType(
    {
        spec.name: spec
        for spec in (
            DatasetSpec(
                "digits", _digits, _DIGITS_SPLITS, num_classes=10, image_size=8, channels=1
            ),
            DatasetSpec(
                "synthetic",
                _synthetic,
                tuple(_SYNTHETIC_SPLITS),
                num_classes=_SYNTHETIC_DEFAULT_CLASSES,
                image_size=_SYNTHETIC_DEFAULT_SIZE,
                channels=1,
            ),
            DatasetSpec(
                "tfrecord",
                _tfrecord,
                (),
                num_classes=None,
                image_size=None,
                channels=None,
                dataset_dir="the TFRecord files",
                adapts_channels=False,
            ),
        )
    }
)

DATASET_NAMES: Tuple[str, ...] = tuple(DATASETS)


def find_bad_record(
    dataset_dir: str, split: str, *, channels: int | None = None, file_pattern: str | None = None
) -> str | None:
    """Reads every record of a split to name the first one that cannot be used.

    For an input error that surfaced in the middle of training (an image that does not
    decode, a record cut short), where the pipeline's own error names neither the file nor
    the record. It reads the whole split, so call it only once something failed.

    Returns:
      A sentence naming the file, the record's index (how many records of that file read
      before it) and the cause; None if every record reads and decodes.
    """
    files, _ = _split_files(dataset_dir, split, file_pattern)
    with _scratch_session() as session:
        reader = _RecordReader(session)
        with session.graph.as_default():
            encoded = tf.compat.v1.placeholder(tf.string, [])
            decoded = tf.shape(
                tf.io.decode_image(encoded, channels=channels or 0, expand_animations=False)
            )
        for path in files:
            try:
                for index, record in reader.records(path, only_first=False):
                    example = _parse_example(path, index, record)
                    try:
                        session.run(decoded, {encoded: example[ENCODED_KEY]})
                    except tf.errors.OpError as err:
                        return (
                            f"Record {index} of {path} (after {index} good records) does "
                            f"not decode ({storage.op_error_cause(err)})"
                        )
            except DatasetError as err:
                return str(err)
    return None


def read_label_file(dataset_dir: str, filename: str = LABELS_FILENAME) -> dict[int, str]:
    """Reads slim's ``labels.txt``: one ``label:class name`` line per class.

    Args:
      dataset_dir: The directory holding the file.
      filename: The file's name.

    Returns:
      A dict from label to class name.

    Raises:
      DatasetError: If a line is not ``<int>:<name>`` or the file lists no class.
    """
    path = storage.join(dataset_dir, filename)
    with tf.io.gfile.GFile(path, "r") as f:
        lines = f.read().splitlines()
    names = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        label, sep, name = line.partition(":")
        try:
            names[int(label)] = name
        except ValueError:
            sep = ""
        if not sep:
            raise DatasetError(
                f'Line {number} of {path} is {line!r}, not "<label>:<class '
                'name>" (e.g. "0:daisy"): fix or remove the file.'
            )
    if not names:
        raise DatasetError(
            f'{path} lists no class: write one "<label>:<class name>" line per '
            "class, or remove the file."
        )
    if min(names) < 0:
        raise DatasetError(f"{path} has the negative label {min(names)}: labels are 0..N-1.")
    return names


def write_label_file(
    dataset_dir: str, class_names: Sequence[str], filename: str = LABELS_FILENAME
) -> str:
    """Writes slim's ``labels.txt`` (``0:name`` lines) for the tfrecord dataset.

    Args:
      dataset_dir: The directory to write into (created if missing).
      class_names: The class names, by label.
      filename: The file's name.

    Returns:
      The path written.
    """
    tf.io.gfile.makedirs(dataset_dir)
    path = storage.join(dataset_dir, filename)
    with tf.io.gfile.GFile(path, "w") as f:
        for label, class_name in enumerate(class_names):
            f.write(f"{label}:{class_name}\n")
    return path


def write_tfrecord(
    path: str,
    images: np.ndarray | Sequence[np.ndarray],
    labels: Sequence[int] | np.ndarray,
    format: str = "png",
) -> int:  # pylint: disable=redefined-builtin
    """Writes images and labels as a TFRecord file in TF-Slim's format.

    Each record is a ``tf.train.Example`` with ``image/encoded``, ``image/format``,
    ``image/class/label``, ``image/height`` and ``image/width``, as slim's
    ``dataset_utils.image_to_tfexample`` writes them; the ``tfrecord`` dataset reads it
    back. Name the file after its split, e.g. ``mydata_train.tfrecord``.

    Args:
      path: The file to write (its directory is created if missing).
      images: Uint8 images, an array ``[N, H, W]`` or ``[N, H, W, C]`` or a sequence of
        ``[H, W]`` / ``[H, W, C]`` arrays (which may differ in size); C is 1, 3 or 4
        (1 or 3 for JPEG).
      labels: N integer labels, 0..num_classes-1.
      format: ``'png'`` (lossless) or ``'jpeg'``.

    Returns:
      The number of records written.

    Raises:
      DatasetError: If the images are not uint8, have a bad shape, or do not match the
        labels in number.
    """
    fmt = format.lower()
    if fmt not in ("png", "jpeg", "jpg"):
        raise DatasetError(f"format={format!r}: write_tfrecord writes 'png' or 'jpeg'.")
    fmt = "jpeg" if fmt == "jpg" else fmt
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise DatasetError(
            f"labels must be a 1-D sequence of integers, got shape "
            f"{labels.shape} of {labels.dtype}."
        )
    if len(images) != len(labels):
        raise DatasetError(
            f"{len(images)} images but {len(labels)} labels: pass one label per image."
        )
    arrays = []
    for index, image in enumerate(images):
        image = np.asarray(image)
        if image.dtype != np.uint8:
            raise DatasetError(
                f"Image {index} is {image.dtype}, not uint8: convert it, e.g. "
                "(np.clip(image, 0, 1) * 255).round().astype(np.uint8)."
            )
        if image.ndim == 2:
            image = image[..., np.newaxis]
        if image.ndim != 3 or image.shape[-1] not in ((1, 3) if fmt == "jpeg" else (1, 3, 4)):
            raise DatasetError(
                f"Image {index} has shape {image.shape}: pass [H, W] or [H, W, C] "
                f"with C in {(1, 3) if fmt == 'jpeg' else (1, 3, 4)} for {fmt}."
            )
        arrays.append(image)
    parent = storage.dirname(path)
    if parent:
        tf.io.gfile.makedirs(parent)
    with _scratch_session() as session:
        pixels = tf.compat.v1.placeholder(tf.uint8, [None, None, None])
        encode = tf.io.encode_png(pixels) if fmt == "png" else tf.io.encode_jpeg(pixels)
        with tf.io.TFRecordWriter(path) as writer:
            for image, label in zip(arrays, labels):
                encoded = session.run(encode, {pixels: image})
                example = tf.train.Example(
                    features=tf.train.Features(
                        feature={
                            ENCODED_KEY: _bytes_feature(encoded),
                            FORMAT_KEY: _bytes_feature(fmt.encode("ascii")),
                            LABEL_KEY: _int64_feature(int(label)),
                            HEIGHT_KEY: _int64_feature(image.shape[0]),
                            WIDTH_KEY: _int64_feature(image.shape[1]),
                        }
                    )
                )
                writer.write(example.SerializeToString())
    logging.info("Wrote %s records to %s.", len(arrays), path)
    return len(arrays)


def _bytes_feature(value: bytes) -> tf.train.Feature:
    return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))


def _int64_feature(value: int) -> tf.train.Feature:
    return tf.train.Feature(int64_list=tf.train.Int64List(value=[int(value)]))


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise DatasetError(f"{name}={value!r}: pass a positive integer.")
