"""What every data set is: uint8 images (N, C, H, W) and int64 labels (N,) in memory, class names,
and the per-channel normalisation of its own training split.

Images stay uint8 until a batch is used (`normalize` makes float32 then), so 50000 CIFAR images
cost 150 MiB, not 600.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer",
                   "dog", "frog", "horse", "ship", "truck")
# Per-channel statistics of the CIFAR-10 training set as published (torchvision recipes use the
# same), so a CIFAR-10 model here and one trained elsewhere see the same inputs.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)

# Pixels summed per pass when computing a training split's statistics: 1024 CIFAR images are
# 12 MiB of float32, where converting a whole split at once would be 600 MiB.
_STATS_CHUNK = 1024
# A channel whose pixels are all equal has std 0; dividing by it would make every batch inf.
_MIN_STD = 1e-6


class DataError(ValueError):
    """A data set that cannot be used: missing, truncated, or not what its name promises."""


def channel_stats(x: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """uint8 images (N, C, H, W) -> per-channel (mean, std) of the pixels scaled to [0, 1]."""
    n, c = x.shape[:2]
    if n == 0:
        return (0.5,) * c, (0.25,) * c                       # nothing to measure: a neutral guess
    total = np.zeros(c)
    squares = np.zeros(c)
    for start in range(0, n, _STATS_CHUNK):
        chunk = x[start:start + _STATS_CHUNK].astype(np.float32)
        total += chunk.sum(axis=(0, 2, 3), dtype=np.float64)
        squares += np.square(chunk).sum(axis=(0, 2, 3), dtype=np.float64)
    count = n * x.shape[2] * x.shape[3]
    mean = total / count
    var = np.maximum(squares / count - mean ** 2, 0.0)
    std = np.sqrt(var)
    mean, std = mean / 255.0, std / 255.0
    return (tuple(round(float(m), 6) for m in mean),
            tuple(round(max(float(s), _MIN_STD), 6) for s in std))


def normalize(x: np.ndarray, mean=CIFAR10_MEAN, std=CIFAR10_STD) -> np.ndarray:
    """uint8 images (..., C, H, W) -> float32 ((x / 255) - mean) / std per channel, C-contiguous.

    mean and std are per channel, of pixels in [0, 1]; CIFAR-10's unless given.
    """
    channels = len(mean)
    if x.dtype != np.uint8 or x.ndim < 3 or x.shape[-3] != channels:
        raise ValueError(f"normalize expects uint8 images (..., {channels}, H, W), got {x.dtype} {x.shape}")
    # ((x / 255) - mean) / std folded into one multiply-add per element
    std32 = np.asarray(std, np.float32).reshape(channels, 1, 1)
    scale = 1.0 / (255.0 * std32)
    shift = np.asarray(mean, np.float32).reshape(channels, 1, 1) / std32
    out = x.astype(np.float32)
    out *= scale
    out -= shift
    return out


@dataclass
class DataSet:
    name: str
    train_x: np.ndarray                      # (N, C, H, W) uint8
    train_y: np.ndarray                      # (N,) int64, 0..classes-1
    test_x: np.ndarray                       # (M, C, H, W) uint8
    test_y: np.ndarray                       # (M,) int64
    classes: tuple[str, ...] = CIFAR10_CLASSES
    mean: tuple[float, ...] | None = None    # per channel, of [0, 1] pixels; None: from train_x
    std: tuple[float, ...] | None = None
    notes: tuple[str, ...] = ()              # what the loader inferred or did, for the run's log

    def __post_init__(self):
        if self.mean is None or self.std is None:
            self.mean, self.std = channel_stats(self.train_x)
        self.mean = tuple(float(m) for m in self.mean)
        self.std = tuple(float(s) for s in self.std)
        self.classes = tuple(self.classes)
        self.notes = tuple(self.notes)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(int(d) for d in self.train_x.shape[1:])

    def normalize(self, x: np.ndarray) -> np.ndarray:
        """uint8 images (..., C, H, W) -> float32, normalised with this data set's statistics."""
        return normalize(x, self.mean, self.std)

    def meta(self) -> dict:
        """What a model trained on this set needs to be used without it (checkpoints keep it)."""
        return {"name": self.name, "classes": list(self.classes), "image_shape": list(self.image_shape),
                "mean": list(self.mean), "std": list(self.std)}

    def __repr__(self) -> str:
        return (f"DataSet({self.name!r}, train={len(self.train_y)}, test={len(self.test_y)}, "
                f"classes={len(self.classes)})")


def check_labels(y: np.ndarray, classes: int, source: str) -> np.ndarray:
    """Labels -> int64, each in 0..classes-1, else DataError naming the first bad one."""
    if y.ndim != 1 or (y.size and y.dtype.kind not in "iu"):
        raise DataError(f"{source}: labels must be a flat list of ints 0..{classes - 1}, "
                        f"got {y.dtype} shape {y.shape}")
    if y.size and (y.min() < 0 or y.max() >= classes):
        bad = y[(y < 0) | (y >= classes)][0]
        raise DataError(f"{source}: label {int(bad)} out of range; expected 0..{classes - 1} (the data set's "
                        f"{classes} classes)")
    return y.astype(np.int64)


def check_bytes(source: str, size: int, cap: int, what: str) -> None:
    """Refuse something of `size` bytes before reading it when it is over `cap`."""
    if size > cap:
        raise DataError(f"{source}: {size} bytes, more than the {cap >> 20} MB {what}: not read")


MAX_CLASSES = 100_000          # class directories a folder's split may hold (each a class)


def class_directories(split_dir, classes, expected) -> tuple[tuple[str, ...], list[str]]:
    """(the classes, the class directory names found, sorted) of an image folder's split, read
    with a bound; `classes` given: an evaluation split, whose class directories must be among the
    training classes. `expected` says what a class directory holds (for the error of none)."""
    split_dir = os.fspath(split_dir)
    found = []
    try:
        for entry in os.scandir(split_dir):
            if entry.is_dir() and not entry.name.startswith("."):
                found.append(entry.name)
                if len(found) > MAX_CLASSES:
                    raise DataError(f"{split_dir}: more than {MAX_CLASSES} class directories: not read")
    except OSError as e:
        raise DataError(f"{split_dir}: cannot be listed: {e}") from None
    found.sort()
    if not found:
        raise DataError(f"{split_dir}: no class directories; expected {split_dir}/<class>/{expected}")
    if classes is None:
        return tuple(found), found
    unknown = [c for c in found if c not in classes]
    if unknown:
        raise DataError(f"{os.path.join(split_dir, unknown[0])}: class {unknown[0]!r} is not among the "
                        f"{len(classes)} classes of {os.path.join(os.path.dirname(split_dir), 'train')}")
    return tuple(classes), found


def walk_once(top, loops: list):
    """os.walk of `top` following links, each directory visited once by (st_dev, st_ino): a link
    back into the tree (`ln -s . a`) or a second way to a directory already walked is not entered
    but appended to `loops`, so a class folder with two links to itself lists its photos once, not
    once for each of the 2^depth paths. Hidden directories are not entered. Yields (dirpath,
    sorted filenames)."""
    try:
        st = os.stat(top)
        seen = {(st.st_dev, st.st_ino)}
    except OSError:
        seen = set()
    for dirpath, dirnames, filenames in os.walk(top, followlinks=True):
        kept = []
        for name in sorted(d for d in dirnames if not d.startswith(".")):
            path = os.path.join(dirpath, name)
            try:
                st = os.stat(path)
            except OSError:
                continue                           # gone since the listing, or a link to nowhere
            key = (st.st_dev, st.st_ino)
            if key in seen:
                loops.append(path)
                continue
            seen.add(key)
            kept.append(name)
        dirnames[:] = kept
        yield dirpath, sorted(filenames)


def loops_note(loops: list) -> str:
    """One line saying which directory links were not followed (walk_once), the first few named."""
    shown = ", ".join(loops[:3]) + (f" and {len(loops) - 3} more" if len(loops) > 3 else "")
    return (f"skipped {len(loops)} link{'s' if len(loops) > 1 else ''} to a directory already listed (a link loop "
            f"or a second way in), so no photo is listed twice: {shown}")
