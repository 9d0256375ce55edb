"""Data sets: CIFAR-10 in its official python format, and a built-in synthetic stand-in.

A data set is uint8 images (N, 3, 32, 32) and int64 labels (N,) in memory; `normalize` turns a
batch into float32 NCHW only when it is used, so 50000 CIFAR images cost 150 MiB, not 600.

The official CIFAR-10 files are pickles. Unpickling runs whatever callable the file names, so
they are read with `_CifarUnpickler`, which admits only what plain containers and numpy arrays
need and refuses everything else before it is called.
"""

from __future__ import annotations

import os
import pickle
import struct
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from hetconv.geometry import IMAGE_SHAPE, NUM_CLASSES

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer",
                   "dog", "frog", "horse", "ship", "truck")
# Per-channel statistics of the CIFAR-10 training set, fixed so that every run (and every data
# set, synthetic included) is normalized the same way.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)

ROW_BYTES = 3 * 32 * 32                      # one image in a CIFAR file: R, G, B planes of 32x32

DIR_NAME = "cifar-10-batches-py"
TAR_NAME = "cifar-10-python.tar.gz"
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"
META_FILE = "batches.meta"
# The most bytes read from any one file or archive member: a CIFAR-10 batch is about 31 MB. A gzip
# archive of 0.3 MB can hold a member of 300 MB of zeros; the cap refuses it before it is read.
MAX_MEMBER_BYTES = 64 << 20


class DataError(ValueError):
    """A data set that cannot be used: missing, truncated, or not what its name promises."""


@dataclass
class DataSet:
    name: str
    train_x: np.ndarray                      # (N, 3, 32, 32) uint8
    train_y: np.ndarray                      # (N,) int64, 0..9
    test_x: np.ndarray                       # (M, 3, 32, 32) uint8
    test_y: np.ndarray                       # (M,) int64, 0..9
    classes: tuple[str, ...] = CIFAR10_CLASSES

    def __repr__(self) -> str:
        return (f"DataSet({self.name!r}, train={len(self.train_y)}, test={len(self.test_y)}, "
                f"classes={len(self.classes)})")


# ---------------------------------------------------------------------------------------------
# Batches

# ((x / 255) - mean) / std folded into one multiply-add per element.
_MEAN = np.asarray(CIFAR10_MEAN, np.float32).reshape(3, 1, 1)
_STD = np.asarray(CIFAR10_STD, np.float32).reshape(3, 1, 1)
_SCALE = 1.0 / (255.0 * _STD)
_SHIFT = _MEAN / _STD


def normalize(x: np.ndarray) -> np.ndarray:
    """uint8 images (..., 3, H, W) -> float32 ((x / 255) - mean) / std per channel, C-contiguous."""
    if x.dtype != np.uint8 or x.ndim < 3 or x.shape[-3] != 3:
        raise ValueError(f"normalize expects uint8 images (..., 3, H, W), got {x.dtype} {x.shape}")
    out = x.astype(np.float32)
    out *= _SCALE
    out -= _SHIFT
    return out


Batch = tuple[np.ndarray, np.ndarray]        # (x float32 (B, 3, 32, 32), y int64 (B,))


def batches(ds: DataSet, batch_size: int, rng: np.random.Generator | None,
            shuffle: bool = True, drop_last: bool = True) -> Iterator[Batch]:
    """One epoch over the training set: (x float32 (B, 3, 32, 32), y int64 (B,)).

    The order depends only on `rng`; each image is used at most once. With drop_last the final
    short batch is skipped, so every step has the same shape (and the same per-step cost).
    """
    n = len(ds.train_y)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if drop_last and batch_size > n:
        raise ValueError(f"batch_size {batch_size} is larger than the {n} training images of "
                         f"{ds.name!r}: with drop_last no batch would be yielded")
    if shuffle:
        if rng is None:
            raise ValueError("shuffle=True needs a numpy Generator, got rng=None")
        order = rng.permutation(n)
    else:
        order = np.arange(n)
    stop = n - n % batch_size if drop_last else n
    for start in range(0, stop, batch_size):
        idx = order[start:start + batch_size]
        yield normalize(ds.train_x[idx]), ds.train_y[idx]


def test_batches(ds: DataSet, batch_size: int) -> Iterator[Batch]:
    """Every test image once, in order; the last batch may be smaller."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    for start in range(0, len(ds.test_y), batch_size):
        yield normalize(ds.test_x[start:start + batch_size]), ds.test_y[start:start + batch_size]


test_batches.__test__ = False                # a library function, not a pytest test


# ---------------------------------------------------------------------------------------------
# Restricted unpickling

# The numpy callables an array pickle names, resolved from numpy itself rather than by import:
# numpy 1.x files say numpy.core.multiarray, numpy 2.x files say numpy._core.multiarray, and
# importing numpy.core on numpy 2 only to find the same function warns.
_reconstruct = np.ndarray.__reduce__(np.zeros(1, np.uint8))[0]
_scalar = np.uint8(0).__reduce__()[0]
_frombuffer = np.zeros(1, np.uint8).__reduce_ex__(5)[0]    # what protocol 5 pickles name


def _latin1_encode(text, encoding="latin1"):
    # Python 3 pickles bytes at protocol <= 2 as _codecs.encode(str, "latin1"). codecs.encode
    # with another codec name is not needed by any array file, so only latin-1 is let through.
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise pickle.UnpicklingError(f"_codecs.encode is only allowed for latin1 text, "
                                     f"got encoding {encoding!r}")
    return text.encode("latin1")


_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy.core.multiarray", "scalar"): _scalar,
    ("numpy._core.multiarray", "scalar"): _scalar,
    ("numpy.core.numeric", "_frombuffer"): _frombuffer,
    ("numpy._core.numeric", "_frombuffer"): _frombuffer,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): _latin1_encode,
}


class _CifarUnpickler(pickle.Unpickler):
    """Unpickler for data files: plain containers and numpy arrays, nothing that runs code."""

    def __init__(self, file, source: str):
        # encoding="bytes": the official files were pickled by Python 2, whose str is bytes.
        super().__init__(file, encoding="bytes")
        self.source = source

    def find_class(self, module, name):
        allowed = _ALLOWED_GLOBALS.get((module, name))
        if allowed is None:
            raise DataError(f"{self.source}: refusing to unpickle {module}.{name}: only plain "
                            f"containers and numpy arrays are allowed")
        return allowed

    def persistent_load(self, pid):
        raise DataError(f"{self.source}: refusing a persistent id in the pickle: only plain "
                        f"containers and numpy arrays are allowed")


def _unpickle(stream, source: str):
    try:
        return _CifarUnpickler(stream, source).load()
    except DataError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError,
            AttributeError, struct.error, UnicodeDecodeError, OverflowError, MemoryError) as e:
        raise DataError(f"{source}: not a readable CIFAR-10 pickle (truncated or a different "
                        f"file?): {type(e).__name__}: {e}") from None


def _str_keys(obj, source: str, what: str) -> dict:
    if not isinstance(obj, dict):
        raise DataError(f"{source}: expected a pickled dict ({what}), got {type(obj).__name__}")
    return {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in obj.items()}


def _parse_batch(obj, source: str) -> tuple[np.ndarray, np.ndarray]:
    """A data_batch_i / test_batch dict -> images (N, 3, 32, 32) uint8, labels (N,) int64."""
    d = _str_keys(obj, source, "with 'data' and 'labels'")
    missing = [k for k in ("data", "labels") if k not in d]
    if missing:
        raise DataError(f"{source}: missing key(s) {missing}; expected 'data' and 'labels', "
                        f"found {sorted(map(str, d))}")
    data, labels = d["data"], d["labels"]
    if not isinstance(data, np.ndarray):
        raise DataError(f"{source}: 'data' must be a numpy array (N x {ROW_BYTES} uint8), "
                        f"got {type(data).__name__}")
    if data.dtype != np.uint8:
        raise DataError(f"{source}: 'data' must be uint8, got {data.dtype}")
    if data.ndim != 2 or data.shape[1] != ROW_BYTES:
        raise DataError(f"{source}: 'data' must be N x {ROW_BYTES} (R, G, B planes of 32x32), "
                        f"got shape {data.shape}")
    try:
        y = np.asarray(labels)
    except (ValueError, TypeError) as e:
        raise DataError(f"{source}: 'labels' must be a list of ints 0..9: {e}") from None
    if y.ndim != 1 or (y.size and y.dtype.kind not in "iu"):
        raise DataError(f"{source}: 'labels' must be a flat list of ints 0..9, "
                        f"got {y.dtype} shape {y.shape}")
    if len(y) != len(data):
        raise DataError(f"{source}: {len(y)} labels for {len(data)} images; expected one label "
                        f"per row of 'data'")
    if y.size and (y.min() < 0 or y.max() >= NUM_CLASSES):
        bad = y[(y < 0) | (y >= NUM_CLASSES)][0]
        raise DataError(f"{source}: label {int(bad)} out of range; expected 0..{NUM_CLASSES - 1}")
    # Row-major reshape: the first 1024 bytes of a row are the R plane -> channel 0, and so on.
    return data.reshape(-1, *IMAGE_SHAPE), y.astype(np.int64)


def _parse_meta(obj, source: str) -> tuple[str, ...]:
    d = _str_keys(obj, source, "with 'label_names'")
    names = d.get("label_names")
    if not isinstance(names, (list, tuple)) or len(names) != NUM_CLASSES:
        raise DataError(f"{source}: 'label_names' must be a list of {NUM_CLASSES} names, "
                        f"got {names!r:.200}")
    return tuple(n.decode("latin1") if isinstance(n, bytes) else str(n) for n in names)


# ---------------------------------------------------------------------------------------------
# CIFAR-10 on disk

def _resolve_cifar_path(path: Path) -> Path:
    """A cifar-10-batches-py dir, a dir holding it (or the archive), or the archive itself."""
    if not path.exists():
        raise DataError(f"{path}: does not exist; expected a {DIR_NAME}/ directory, a directory "
                        f"containing it, or the {TAR_NAME} archive (or the name 'synthetic')")
    if path.is_dir():
        if (path / DIR_NAME).is_dir():
            return path / DIR_NAME
        if not (path / TRAIN_FILES[0]).exists() and (path / TAR_NAME).is_file():
            return path / TAR_NAME
    return path


def _load_from_dir(root: Path) -> dict:
    loaded = {}
    for name in TRAIN_FILES + (TEST_FILE, META_FILE):
        file = root / name
        if not file.is_file():
            if name == META_FILE:
                continue
            raise DataError(f"{file}: missing; expected the CIFAR-10 python files "
                            f"{', '.join(TRAIN_FILES)} and {TEST_FILE} in {root}")
        _check_size(str(file), file.stat().st_size)
        with open(file, "rb") as f:
            loaded[name] = _unpickle(f, str(file))
    return loaded


def _check_size(source: str, size: int) -> None:
    if size > MAX_MEMBER_BYTES:
        raise DataError(f"{source}: {size} bytes, more than the {MAX_MEMBER_BYTES >> 20} MB any CIFAR-10 file "
                        f"may have (a batch is about 31 MB): not read")


def _load_from_tar(archive: Path) -> dict:
    # Members are unpickled straight from the decompressed stream, in archive order: nothing is
    # extracted to disk, and only one member's bytes are held at a time. A member's size comes
    # from its header, and extractfile never reads past it, so the cap holds for what is read.
    wanted = set(TRAIN_FILES + (TEST_FILE, META_FILE))
    loaded = {}
    try:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar:
                name = member.name.rsplit("/", 1)[-1]
                if not member.isfile() or name not in wanted or name in loaded:
                    continue
                _check_size(f"{archive}:{member.name}", member.size)
                stream = tar.extractfile(member)
                loaded[name] = _unpickle(stream, f"{archive}:{member.name}")
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
        raise DataError(f"{archive}: not a readable {TAR_NAME} archive (truncated or a different "
                        f"file?): {type(e).__name__}: {e}") from None
    for name in TRAIN_FILES + (TEST_FILE,):
        if name not in loaded:
            raise DataError(f"{archive}: member {DIR_NAME}/{name} missing; expected "
                            f"{', '.join(TRAIN_FILES)} and {TEST_FILE}")
    return loaded


def load_cifar10(path: str | os.PathLike) -> DataSet:
    """CIFAR-10 from the official python format: the directory or the .tar.gz archive.

    Every file is checked (shape, dtype, label range, counts); a problem raises DataError naming
    the file and what was expected.
    """
    source = _resolve_cifar_path(Path(path))
    loaded = _load_from_tar(source) if source.is_file() else _load_from_dir(source)

    def where(name):
        return f"{source}:{DIR_NAME}/{name}" if source.is_file() else str(source / name)

    train = [_parse_batch(loaded[name], where(name)) for name in TRAIN_FILES]
    test_x, test_y = _parse_batch(loaded[TEST_FILE], where(TEST_FILE))
    classes = _parse_meta(loaded[META_FILE], where(META_FILE)) if META_FILE in loaded \
        else CIFAR10_CLASSES
    return DataSet(
        name="cifar10",
        train_x=np.concatenate([x for x, _ in train]),      # (50000, 3, 32, 32): one copy, 150 MiB
        train_y=np.concatenate([y for _, y in train]),
        test_x=np.ascontiguousarray(test_x),
        test_y=test_y,
        classes=classes,
    )


# ---------------------------------------------------------------------------------------------
# Synthetic data

# The knobs below were tuned so that the classes are learnable but not trivial: on 5000/1000
# images a nearest-class-mean classifier gets about 75%, 300 SGD steps of logistic regression
# about 90%, and a small conv net (which shares weights across the shifts) more.
_SYNTH_COARSE = 6        # class pattern = 6x6 random colours, smoothly upsampled: low frequency,
                         # so a small conv net picks it up in a few hundred steps
_SYNTH_SHARED = 0.5      # fraction of every class pattern that is one pattern common to all
                         # classes, so classes differ in part of the image signal, not all of it
_SYNTH_MAX_SHIFT = 4     # each image is a 32x32 crop at a random offset (0..8) of a 40x40 pattern
_SYNTH_CLUTTER = 1.5     # per-image smooth random blobs (4x4 upsampled), in pattern units: the
                         # nuisance that makes pixel-space distances unreliable
_SYNTH_NOISE = 1.0       # per-pixel noise standard deviation, in pattern units
_SYNTH_TO_U8 = 36.0      # uint8 = 128 + 36 * value: about 5% of pixels saturate at 0 or 255


def _interp_matrix(n_out: int, n_in: int) -> np.ndarray:
    """(n_out, n_in) bilinear resampling weights, pixel centres aligned."""
    pos = np.clip((np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5, 0, n_in - 1)
    lo = np.floor(pos).astype(int)
    hi = np.minimum(lo + 1, n_in - 1)
    frac = pos - lo
    m = np.zeros((n_out, n_in))
    m[np.arange(n_out), lo] += 1 - frac
    m[np.arange(n_out), hi] += frac
    return m


def _synthetic_images(patterns: np.ndarray, n: int, rng: np.random.Generator):
    """n balanced labels; each image its class pattern shifted, rescaled, cluttered, noised."""
    labels = rng.permutation(np.arange(n) % NUM_CLASSES).astype(np.int64)
    span = 2 * _SYNTH_MAX_SHIFT + 1
    oy = rng.integers(0, span, n)
    ox = rng.integers(0, span, n)
    # (10, 3, span, span, 32, 32) view of every crop; indexing copies only the n chosen ones.
    crops = np.lib.stride_tricks.sliding_window_view(patterns, (32, 32), axis=(2, 3))
    x = crops[labels, :, oy, ox]                             # (n, 3, 32, 32) float32
    x *= rng.uniform(0.6, 1.4, (n, 1, 1, 1)).astype(np.float32)          # contrast
    x += rng.normal(0.0, 0.3, (n, 1, 1, 1)).astype(np.float32)           # brightness
    up = _interp_matrix(32, 4).astype(np.float32)
    blobs = rng.standard_normal((n, 3, 4, 4), dtype=np.float32)
    blobs *= _SYNTH_CLUTTER
    x += up @ blobs @ up.T                                   # (32,4) @ (n,3,4,4) @ (4,32)
    # Uniform noise with the spread of N(0, noise^2): a fifth of the cost of normal samples.
    noise = rng.random(x.shape, dtype=np.float32)
    noise -= 0.5
    noise *= _SYNTH_NOISE * np.sqrt(12.0, dtype=np.float32)
    x += noise
    x *= _SYNTH_TO_U8
    x += 128.0
    return np.clip(x, 0, 255).astype(np.uint8), labels


def synthetic(n_train: int = 5000, n_test: int = 1000, seed: int = 0) -> DataSet:
    """A deterministic, learnable CIFAR-shaped data set (same seed -> same bytes), no download.

    Each class is a smooth random colour pattern; each image is its class pattern at a random
    shift (up to 4 px each way), contrast and brightness, over smooth random clutter, plus pixel
    noise. Classes are balanced. The test images do not depend on n_train.
    """
    if n_train < 0 or n_test < 0:
        raise ValueError(f"n_train and n_test must be >= 0, got {n_train}, {n_test}")
    pattern_rng, train_rng, test_rng = (np.random.default_rng(s)
                                        for s in np.random.SeedSequence(seed).spawn(3))
    coarse_shape = (3, _SYNTH_COARSE, _SYNTH_COARSE)
    own = pattern_rng.standard_normal((NUM_CLASSES, *coarse_shape))
    common = pattern_rng.standard_normal(coarse_shape)
    coarse = _SYNTH_SHARED * common + (1 - _SYNTH_SHARED) * own
    up = _interp_matrix(32 + 2 * _SYNTH_MAX_SHIFT, _SYNTH_COARSE)
    patterns = np.einsum("ij,ncjk,lk->ncil", up, coarse, up)
    patterns /= patterns.std()
    patterns = patterns.astype(np.float32)                   # (10, 3, 40, 40)
    train_x, train_y = _synthetic_images(patterns, n_train, train_rng)
    test_x, test_y = _synthetic_images(patterns, n_test, test_rng)
    return DataSet("synthetic", train_x, train_y, test_x, test_y, CIFAR10_CLASSES)


def load_dataset(spec: str | os.PathLike, seed: int = 0, n_train: int | None = None,
                 n_test: int | None = None) -> DataSet:
    """"synthetic" -> synthetic(n_train, n_test, seed); anything else is a CIFAR-10 path.

    For CIFAR-10, n_train / n_test (when given) keep the first n images of each split, for
    quick runs; seed is not used (the files fix the data).
    """
    if isinstance(spec, str) and spec == "synthetic":
        sizes = {k: v for k, v in (("n_train", n_train), ("n_test", n_test)) if v is not None}
        return synthetic(seed=seed, **sizes)
    ds = load_cifar10(spec)
    for name, n, have in (("n_train", n_train, len(ds.train_y)),
                          ("n_test", n_test, len(ds.test_y))):
        if n is not None and not 0 <= n <= have:
            raise ValueError(f"{name}={n}, but {spec} has {have} images in that split")
    if n_train is not None:
        ds.train_x, ds.train_y = ds.train_x[:n_train], ds.train_y[:n_train]
    if n_test is not None:
        ds.test_x, ds.test_y = ds.test_x[:n_test], ds.test_y[:n_test]
    return ds
