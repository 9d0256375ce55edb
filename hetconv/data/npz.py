"""A .npz of arrays: x_train, y_train, x_test, y_test (and optionally `classes`, their names).

Images are uint8, or float in [0, 1]; NCHW or NHWC, told apart by which axis has 1 or 3
channels (both or neither is refused), or (N, H, W) for one channel. Labels are ints 0..K-1; K is
the number of names in `classes`, else the largest label + 1. Read with allow_pickle=False, and
each array's header (dtype, shape) is checked against a cap before its bytes are read.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import numpy as np

from hetconv.data.base import DataError, DataSet, check_labels

KEYS = ("x_train", "y_train", "x_test", "y_test")
MAX_ARRAY_BYTES = 4 << 30                  # one array, as its header declares it
MAX_CLASSES = 100_000
CHANNELS = (1, 3)


def _header(npz, key: str, source: str):
    """(dtype, shape) from the .npy header of member `key`, without reading its data."""
    try:
        with npz.zip.open(f"{key}.npy") as f:
            version = np.lib.format.read_magic(f)
            reader = {(1, 0): np.lib.format.read_array_header_1_0,
                      (2, 0): np.lib.format.read_array_header_2_0}.get(version)
            if reader is None:
                raise DataError(f"{source}: {key} has .npy format version {version}; expected 1.0 or 2.0")
            shape, _, dtype = reader(f)
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as e:
        raise DataError(f"{source}: {key} is not a readable .npy array: {type(e).__name__}: {e}") from None
    return dtype, shape


def _array(npz, key: str, source: str) -> np.ndarray:
    dtype, shape = _header(npz, key, source)
    if dtype.hasobject:
        raise DataError(f"{source}: {key} holds Python objects; expected numbers (objects are never unpickled)")
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if size > MAX_ARRAY_BYTES:
        raise DataError(f"{source}: {key} is {shape} {dtype} = {size} bytes, more than the "
                        f"{MAX_ARRAY_BYTES >> 30} GB an array may have: not read")
    try:
        return npz[key]
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as e:
        raise DataError(f"{source}: {key} is not a readable .npy array: {type(e).__name__}: {e}") from None


def _images(x: np.ndarray, key: str, source: str) -> np.ndarray:
    """(N, C, H, W), (N, H, W, C) or (N, H, W) uint8 or float in [0, 1] -> (N, C, H, W) uint8."""
    if x.ndim == 3:
        x = x[:, None]
    elif x.ndim == 4:
        first, last = x.shape[1] in CHANNELS, x.shape[3] in CHANNELS
        if first and last:
            raise DataError(f"{source}: {key} of shape {x.shape} is ambiguous: NCHW and NHWC both have "
                            f"1 or 3 channels; store it as (N, H, W, C) or (N, C, H, W) with H, W not 1 or 3")
        if not first and not last:
            raise DataError(f"{source}: {key} of shape {x.shape}; expected (N, C, H, W) or (N, H, W, C) "
                            f"with C 1 or 3, or (N, H, W)")
        if last:
            x = x.transpose(0, 3, 1, 2)
    else:
        raise DataError(f"{source}: {key} of shape {x.shape}; expected (N, C, H, W), (N, H, W, C) or (N, H, W)")
    if x.dtype == np.uint8:
        return np.ascontiguousarray(x)
    if x.dtype.kind != "f":
        raise DataError(f"{source}: {key} is {x.dtype}; expected uint8 images or float images in [0, 1]")
    if x.size and not (np.isfinite(x).all() and x.min() >= 0 and x.max() <= 1):
        raise DataError(f"{source}: {key} has values outside [0, 1] (min {np.nanmin(x):g}, max {np.nanmax(x):g}, "
                        f"or not finite); expected float images in [0, 1] or uint8")
    return np.ascontiguousarray(np.rint(x * 255.0).astype(np.uint8))


def _labels(y: np.ndarray, key: str, source: str) -> np.ndarray:
    if y.ndim == 2 and y.shape[1] == 1:                     # (N, 1), as Keras stores them
        y = y[:, 0]
    if y.ndim != 1 or (y.size and y.dtype.kind not in "iu"):
        raise DataError(f"{source}: {key} is {y.dtype} of shape {y.shape}; expected a flat array of ints")
    return y


def load_npz(path: str | os.PathLike) -> DataSet:
    source = str(path)
    try:
        npz = np.load(path, allow_pickle=False)
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as e:
        raise DataError(f"{source}: not a readable .npz: {type(e).__name__}: {e}") from None
    if not isinstance(npz, np.lib.npyio.NpzFile):
        raise DataError(f"{source}: a single .npy array; expected a .npz holding {', '.join(KEYS)}")
    with npz:
        missing = [k for k in KEYS if k not in npz.files]
        if missing:
            raise DataError(f"{source}: missing {', '.join(missing)}; expected arrays {', '.join(KEYS)}, "
                            f"found {', '.join(npz.files) or 'none'}")
        train_x = _images(_array(npz, "x_train", source), "x_train", source)
        test_x = _images(_array(npz, "x_test", source), "x_test", source)
        train_y = _labels(_array(npz, "y_train", source), "y_train", source)
        test_y = _labels(_array(npz, "y_test", source), "y_test", source)
        names = _array(npz, "classes", source) if "classes" in npz.files else None
    if train_x.shape[1:] != test_x.shape[1:]:
        raise DataError(f"{source}: x_test images are {test_x.shape[1:]}, x_train's {train_x.shape[1:]}; "
                        f"expected one image shape (C, H, W)")
    for x, y, xk, yk in ((train_x, train_y, "x_train", "y_train"), (test_x, test_y, "x_test", "y_test")):
        if len(x) != len(y):
            raise DataError(f"{source}: {len(y)} labels in {yk} for {len(x)} images in {xk}; expected one per image")
    if len(train_y) == 0:
        raise DataError(f"{source}: y_train is empty; expected at least one training image")
    if names is not None:
        if names.ndim != 1 or names.dtype.kind != "U":
            raise DataError(f"{source}: classes is {names.dtype} of shape {names.shape}; expected a flat array of names")
        classes = tuple(str(n) for n in names)
    else:
        count = int(max(train_y.max(initial=0), test_y.max(initial=0))) + 1
        if count > MAX_CLASSES:
            raise DataError(f"{source}: labels up to {count - 1}; expected at most {MAX_CLASSES} classes")
        classes = tuple(str(i) for i in range(count))
    train_y = check_labels(train_y, len(classes), f"{source}: y_train")
    test_y = check_labels(test_y, len(classes), f"{source}: y_test")
    return DataSet(Path(source).stem, train_x, train_y, test_x, test_y, classes)
