"""Regenerates ``slim_nanguard/app/data/digits.npz`` from scikit-learn's copy of the UCI digits.

Dev-only: this script needs scikit-learn, which is *not* a dependency of slim_nanguard.
The package ships the resulting ``.npz`` so that the default dataset works offline on a
fresh machine without scikit-learn. It lives in research/, which is not installed: run it
from a clone, only to rebuild or audit that file::

    pip install scikit-learn
    python research/make_digits_npz.py [--output slim_nanguard/app/data/digits.npz]

The output is deterministic for a given scikit-learn copy of the data: a stratified
split with ``TEST_PER_CLASS`` examples of each digit in ``test`` (300 in all) and the
remaining 1497 in ``train``, chosen with ``numpy.random.RandomState(SEED)``.

Arrays in the file:
    train_images, test_images: uint8 [N, 8, 8], pixel values 0..16.
    train_labels, test_labels: uint8 [N], digit 0..9.
    train_index, test_index: int16 [N], row of each example in ``load_digits()``.
"""

import argparse
import os
import sys

import numpy as np

SEED = 20240917
TEST_PER_CLASS = 30
DEFAULT_OUTPUT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "slim_nanguard",
    "app",
    "data",
    "digits.npz",
)


def build_arrays(images: np.ndarray, labels: np.ndarray) -> dict:
    """Splits the digits into train/test arrays.

    Args:
        images: float or int array [N, 8, 8] with integer values 0..16.
        labels: int array [N] with values 0..9.

    Returns:
        A dict of arrays, as stored in the ``.npz`` (see the module docstring).
    """
    images = np.asarray(images)
    if images.min() < 0 or images.max() > 16 or not np.all(images == np.round(images)):
        raise ValueError(
            "expected integer pixel values in 0..16, got range %s..%s"
            % (images.min(), images.max())
        )
    labels = np.asarray(labels).astype(np.int64)
    rng = np.random.RandomState(SEED)
    test_index = []
    for digit in range(10):
        rows = np.flatnonzero(labels == digit)
        test_index.extend(rng.permutation(rows)[:TEST_PER_CLASS])
    test_index = np.sort(np.asarray(test_index))
    train_index = np.setdiff1d(np.arange(len(labels)), test_index)
    images_u8 = images.astype(np.uint8)
    labels_u8 = labels.astype(np.uint8)
    return {
        "train_images": images_u8[train_index],
        "train_labels": labels_u8[train_index],
        "train_index": train_index.astype(np.int16),
        "test_images": images_u8[test_index],
        "test_labels": labels_u8[test_index],
        "test_index": test_index.astype(np.int16),
    }


def main(argv=None) -> int:
    """Writes the ``.npz``; returns a process exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=DEFAULT_OUTPUT, help="where to write the .npz")
    args = parser.parse_args(argv)
    try:
        from sklearn.datasets import load_digits  # pylint: disable=import-outside-toplevel
    except ImportError:
        print(
            "make_digits_npz.py needs scikit-learn (dev-only): pip install scikit-learn",
            file=sys.stderr,
        )
        return 1
    digits = load_digits()
    arrays = build_arrays(digits.images, digits.target)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    np.savez_compressed(args.output, **arrays)
    print(
        "wrote %s: %d train, %d test, %d bytes"
        % (
            args.output,
            len(arrays["train_labels"]),
            len(arrays["test_labels"]),
            os.path.getsize(args.output),
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
