"""Writes the four MNIST IDX files of this directory from scikit-learn's digits.csv.gz.

    pip download --no-deps scikit-learn==1.5.2 -d /tmp/skl
    unzip -j /tmp/skl/scikit_learn-1.5.2-*.whl sklearn/datasets/data/digits.csv.gz -d /tmp/skl
    python tests/data/digits/make_digits.py /tmp/skl/digits.csv.gz

Each 8x8 image (pixels 0..16) becomes 28x28 uint8: scaled to 0..255, each pixel repeated 3x3
(24x24), two zero pixels added on every side. The split is fixed: a permutation seeded with 0,
the first 1437 images for training, the other 360 for testing. Same input -> same bytes.
"""
import gzip
import struct
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
N_TRAIN = 1437


def write_idx(path, array):
    head = struct.pack(">I", 0x800 | array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as f:
        f.write(head + np.ascontiguousarray(array, np.uint8).tobytes())


def main(csv_gz):
    rows = np.loadtxt(csv_gz, delimiter=",", dtype=np.int64)            # (1797, 65): 64 pixels, label
    pixels, labels = rows[:, :64].reshape(-1, 8, 8), rows[:, 64]
    images = np.rint(pixels * (255 / 16)).astype(np.uint8)
    images = images.repeat(3, axis=1).repeat(3, axis=2)                 # (N, 24, 24)
    images = np.pad(images, ((0, 0), (2, 2), (2, 2)))                   # (N, 28, 28)
    order = np.random.default_rng(0).permutation(len(labels))
    train, test = order[:N_TRAIN], order[N_TRAIN:]
    write_idx(HERE / "train-images-idx3-ubyte.gz", images[train])
    write_idx(HERE / "train-labels-idx1-ubyte.gz", labels[train].astype(np.uint8))
    write_idx(HERE / "t10k-images-idx3-ubyte.gz", images[test])
    write_idx(HERE / "t10k-labels-idx1-ubyte.gz", labels[test].astype(np.uint8))


if __name__ == "__main__":
    main(sys.argv[1])
