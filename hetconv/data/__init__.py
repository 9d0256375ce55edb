"""Data sets: one module per format, the built-in synthetic set, batches and augmentation.

Every data set is a DataSet (base.py): uint8 images (N, C, H, W), int64 labels, class names, and
the per-channel normalisation of its training split. `load_dataset(spec)` tells the format from
what `spec` is (the name "synthetic", a directory's contents, a file's magic) and refuses anything
else with one line naming the path and the forms it accepts.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np

from hetconv.data import cifar, folder, idx
from hetconv.data.base import (CIFAR10_CLASSES, CIFAR10_MEAN, CIFAR10_STD, DataError, DataSet, channel_stats,
                               normalize)
from hetconv.data.batches import AUGMENTATIONS, Batch, augment, batches, parse_augment, test_batches
from hetconv.data.cifar import (DIR_NAME, MAX_MEMBER_BYTES, META_FILE, ROW_BYTES, TAR_NAME, TEST_FILE, TRAIN_FILES,
                                load_cifar, load_cifar10, load_cifar100)
from hetconv.data.folder import load_image_folder
from hetconv.data.idx import load_idx
from hetconv.data.npz import load_npz
from hetconv.data.photos import PhotoSet, load_photo_folder
from hetconv.data.synthetic import synthetic

__all__ = ["AUGMENTATIONS", "Batch", "CIFAR10_CLASSES", "CIFAR10_MEAN", "CIFAR10_STD", "DataError", "DataSet",
           "augment", "batches", "channel_stats", "hold_out", "load_cifar", "load_cifar10", "load_cifar100", "load_dataset",
           "load_idx", "load_image_folder", "load_npz", "load_photo_folder", "PhotoSet", "normalize", "parse_augment", "synthetic", "test_batches",
           "DIR_NAME", "MAX_MEMBER_BYTES", "META_FILE", "ROW_BYTES", "TAR_NAME", "TEST_FILE", "TRAIN_FILES"]

ACCEPTED = ("'synthetic'; a CIFAR-10 or CIFAR-100 python directory or .tar.gz; a directory of MNIST or "
            "Fashion-MNIST IDX files (train-images-idx3-ubyte[.gz], ...); an image folder with "
            "train/<class>/ and val/<class>/ or test/<class>/ (or train/ alone, with --val-split; photos of any size "
            "with --image-size); or a .npz with x_train, y_train, "
            "x_test, y_test")

_GZIP, _ZIP = b"\x1f\x8b", b"PK\x03\x04"


def _file_format(path: Path) -> str | None:
    """A file's format from its first bytes (a tar's from its name or its ustar mark)."""
    with open(path, "rb") as f:
        head = f.read(512)
    if head.startswith(_ZIP) or head.startswith(b"PK\x05\x06"):            # an empty zip is a (refused) npz
        return "npz"
    if head.startswith(_GZIP) or path.name.endswith((".tar.gz", ".tgz", ".tar")) or head[257:262] == b"ustar":
        return "cifar"
    return None


def detect_format(path: Path) -> str:
    """"cifar", "idx", "images" or "npz" for what `path` holds, else DataError naming it."""
    if not path.exists():
        raise DataError(f"{path}: does not exist; expected {ACCEPTED}")
    if path.is_dir():
        if cifar.resolve_path(path) is not None:
            return "cifar"
        if idx.find_dir(path) is not None:
            return "idx"
        if folder.is_image_folder(path):
            return "images"
        raise DataError(f"{path}: a directory of no known data set format; expected {ACCEPTED}")
    try:
        if not stat.S_ISREG(path.stat().st_mode):          # a fifo would block the read below, a device never end
            raise DataError(f"{path}: not a regular file or directory; expected {ACCEPTED}")
        found = _file_format(path)
    except OSError as e:
        raise DataError(f"{path}: cannot be read: {e}") from None
    if found is None:
        raise DataError(f"{path}: a file of no known data set format (neither a .tar.gz nor a .npz); "
                        f"expected {ACCEPTED}")
    return found


def hold_out(ds: DataSet, fraction: float, seed: int, source: str) -> DataSet:
    """`ds` with `fraction` of its training images, picked by `seed`, moved to its (empty) test split.

    Per class: round(fraction x its images) of each class, so every class with enough images is in
    both splits; the images keep their order in each split. The same seed and files give the same
    split, so a run and a later hetconv-eval of it see the same test images."""
    rng = np.random.default_rng(seed)
    held = np.zeros(len(ds.train_y), bool)
    for label in range(len(ds.classes)):
        members = np.flatnonzero(ds.train_y == label)
        held[rng.permutation(members)[:round(fraction * len(members))]] = True
    if not held.any() or held.all():
        raise DataError(f"{source}: --val-split {fraction:g} of {len(ds.train_y)} training images holds out "
                        f"{int(held.sum())}; expected at least one image in each split")
    if isinstance(ds, PhotoSet):
        test = ds.subset(held)
        ds = ds.subset(~held)
        ds.test_x, ds.test_y = test.train_x, test.train_y
    note = (f"{source}: no test split; --val-split {fraction:g} held out {int(held.sum())} of the {len(ds.train_y)} "
            f"training images (per class, seed {seed}) as the test split")
    if isinstance(ds, PhotoSet):
        ds.notes += (note,)
        return ds
    # the normalisation is the remaining training images' own, as for any set read from files
    return DataSet(ds.name, ds.train_x[~held], ds.train_y[~held], ds.train_x[held], ds.train_y[held], ds.classes,
                   notes=ds.notes + (note,))


def load_dataset(spec: str | os.PathLike, seed: int = 0, n_train: int | None = None,
                 n_test: int | None = None, labels: str | None = None, fashion: bool | None = None,
                 val_split: float = 0.0, image_size: int = 0, bad_images: str = "fail",
                 loader_workers: int = 0, test_only: bool = False) -> DataSet:
    """"synthetic" -> synthetic(n_train, n_test, seed); anything else a path, its format detected.

    labels: CIFAR-100's "fine" (the default) or "coarse". fashion: an IDX directory is
    Fashion-MNIST (True) or MNIST (False); None: Fashion-MNIST when the data set's own directory
    says "fashion". Either is refused for a data set it does not apply to. For a data set read from
    files, n_train / n_test (when given) keep the first n images of each split, for quick runs.
    val_split: for a data set with no test split (an image folder without test/, a .npz without
    x_test), the fraction of the training images held out as its test split, picked by seed
    (hold_out); refused for a data set that has one, whose own test split is what its results are
    compared by. A data set with neither is refused.
    image_size: an image folder is a photo folder (photos.py): photos of any size, streamed and
    transformed to image_size x image_size; bad_images ("fail" or "skip") says what its unreadable
    files do. 0: an image folder is read whole into memory, every image of one size.
    loader_workers: the --loader-workers that will decode a photo folder (0: auto), which set the
    most pixels a photo may have (photos.pixel_limit); ignored for any other set.
    test_only: a photo folder with a val/ or test/ split is read for its test split alone (train/
    gives the class names; its photos are neither listed nor checked), as an evaluation needs.
    """
    if not 0 <= val_split < 1:
        raise DataError(f"--val-split must be in [0, 1), got {val_split}")
    if isinstance(spec, str) and spec == "synthetic":
        if labels is not None or fashion is not None:
            raise DataError("'synthetic' has one kind of label: labels= and fashion= apply to CIFAR-100 and "
                            "IDX directories")
        if image_size:
            raise DataError(f"--image-size {image_size} applies to an image folder; 'synthetic' images are 3x32x32")
        if val_split:
            raise DataError("--val-split applies to a data set with no test split; 'synthetic' has one "
                            "(--synthetic-test sizes it)")
        sizes = {k: v for k, v in (("n_train", n_train), ("n_test", n_test)) if v is not None}
        return synthetic(seed=seed, **sizes)
    path = Path(spec)
    kind = detect_format(path)
    if image_size and kind != "images":
        raise DataError(f"{path}: --image-size {image_size} applies to an image folder (train/<class>/...), "
                        f"not to this {kind} data set, whose images have their own size")
    if labels is not None and kind != "cifar":
        raise DataError(f"{path}: labels={labels!r} applies to CIFAR-100 only")
    if fashion is not None and kind != "idx":
        raise DataError(f"{path}: fashion={fashion!r} applies to a directory of IDX files only")
    if kind == "cifar":
        ds = load_cifar(path, labels)
    elif kind == "idx":
        ds = load_idx(path, fashion)
    elif kind == "images" and image_size:
        ds = load_photo_folder(path, image_size, bad_images, loaders=loader_workers, test_only=test_only)
    elif kind == "images":
        ds = load_image_folder(path)
    else:
        ds = load_npz(path)
    if val_split and len(ds.test_y):
        raise DataError(f"{path}: --val-split applies to a data set with no test split; this one has {len(ds.test_y)} "
                        f"test images, which results on it are compared by (drop --val-split)")
    if not len(ds.test_y):
        if not val_split:
            raise DataError(f"{path}: no test split (no val/ or test/ directory, or no x_test and y_test); give "
                            f"--val-split FRACTION to hold out that part of the training images as one")
        ds = hold_out(ds, val_split, seed, str(path))
    for name, n, have in (("n_train", n_train, len(ds.train_y)),
                          ("n_test", n_test, len(ds.test_y))):
        if n is not None and not 0 <= n <= have:
            raise ValueError(f"{name}={n}, but {spec} has {have} images in that split")
    if isinstance(ds, PhotoSet):                       # slicing FileImages would decode
        if n_train is not None:
            ds = ds.subset(np.arange(len(ds.train_y)) < n_train)
        if n_test is not None:
            ds.test_x = ds.test_x.subset(np.arange(len(ds.test_y)) < n_test)
            ds.test_y = ds.test_y[:n_test]
        return ds
    if n_train is not None:
        ds.train_x, ds.train_y = ds.train_x[:n_train], ds.train_y[:n_train]
    if n_test is not None:
        ds.test_x, ds.test_y = ds.test_x[:n_test], ds.test_y[:n_test]
    return ds
