"""A .npz of arrays: x_train, y_train, x_test, y_test (and optionally `classes`, their names).

Images are uint8, or float in [0, 1]; NCHW or NHWC, told apart by which axis has 1 or 3
channels (both or neither is refused), or (N, H, W) for one channel. Labels are ints 0..K-1.
x_test and y_test may both be left out: the set then has no test split, and --val-split holds out
part of the training split instead.

Classes: K is the number of names in `classes` when it is there, and a label past it is refused.
Without it K is inferred as the largest label + 1, which a stray label would silently inflate (one
label 250 among 0..9 makes 251 classes, 240 of them never seen); so every inferred class must have
at least one training image, else the file is refused naming the classes that have none, and the
inference is said in a note (DataSet.notes), naming any class with under 1% of the largest class's
training images (a stray label such as one 10 among 0..9 shows there).

Nothing is read before it is bounded: the zip's directory (entries and bytes) before zipfile
parses it, then each member's .npy header (dtype, shape) before its data, checked against caps,
against what the format expects (dimensions, one label per image, train and test images of one
shape), and against the member's zip entry: the size the entry declares must be the header's, and
a compressed entry may expand at most MAX_ZIP_EXPANSION times (a zip bomb is refused unread);
decompression stops at the declared size. Read with allow_pickle=False.
"""

from __future__ import annotations

import os
import zipfile
import zlib
from pathlib import Path

import numpy as np

from hetconv.data.base import MAX_CLASSES, DataError, DataSet, check_labels

KEYS = ("x_train", "y_train", "x_test", "y_test")
MAX_ARRAY_BYTES = 4 << 30                  # one array, as its header declares it
MAX_TOTAL_BYTES = 8 << 30                  # every array read, together
MAX_MEMBERS = 1024                         # zip entries: zipfile holds an object for each
MAX_DIRECTORY_BYTES = 1 << 20              # the zip's central directory, which zipfile parses whole
# np.savez_compressed shrinks image data a few times; 64x is far past that, and a zip bomb (zeros:
# about 1000x) far past 64x. Members up to the floor are cheap whatever they expand by.
MAX_ZIP_EXPANSION = 64
ZIP_FLOOR_BYTES = 16 << 20
RARE_CLASS = 0.01                          # of the largest class's training images: said in the note
CHANNELS = (1, 3)
_FLOAT_CHUNK = 1 << 22                     # float pixels converted per pass: 32 MB of float64 at most


def _open(path, source: str) -> zipfile.ZipFile:
    """The zip, once its end record says its directory is small enough to parse."""
    try:
        with open(path, "rb") as f:
            end = zipfile._EndRecData(f)
        if end is None:
            raise zipfile.BadZipFile("no end of central directory record")
        entries, directory = end[zipfile._ECD_ENTRIES_TOTAL], end[zipfile._ECD_SIZE]
        if entries > MAX_MEMBERS or directory > MAX_DIRECTORY_BYTES:
            raise DataError(f"{source}: its zip directory declares {entries} entries in {directory} bytes, more than "
                            f"the {MAX_MEMBERS} entries or {MAX_DIRECTORY_BYTES >> 20} MB a .npz of arrays may have: "
                            f"not read")
        return zipfile.ZipFile(path)
    except DataError:
        raise
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as e:
        raise DataError(f"{source}: not a readable .npz: {type(e).__name__}: {e}") from None


def _header(zf: zipfile.ZipFile, key: str, source: str):
    """(dtype, shape) of member `key` from its .npy header and zip entry, without reading its data."""
    info = zf.getinfo(f"{key}.npy")
    try:
        with zf.open(info) as f:
            version = np.lib.format.read_magic(f)
            reader = {(1, 0): np.lib.format.read_array_header_1_0,
                      (2, 0): np.lib.format.read_array_header_2_0}.get(version)
            if reader is None:
                raise DataError(f"{source}: {key} has .npy format version {version}; expected 1.0 or 2.0")
            shape, _, dtype = reader(f)
            offset = f.tell()
    except DataError:
        raise
    except (ValueError, OSError, zipfile.BadZipFile, EOFError, zlib.error) as e:
        raise DataError(f"{source}: {key} is not a readable .npy array: {type(e).__name__}: {e}") from None
    if dtype.hasobject:
        raise DataError(f"{source}: {key} holds Python objects; expected numbers (objects are never unpickled)")
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if size > MAX_ARRAY_BYTES:
        raise DataError(f"{source}: {key} is {shape} {dtype} = {size} bytes, more than the "
                        f"{MAX_ARRAY_BYTES >> 30} GB an array may have: not read")
    if info.file_size != offset + size:
        raise DataError(f"{source}: {key}'s zip entry holds {info.file_size} bytes, its .npy header declares "
                        f"{offset + size} ({shape} {dtype}): not read")
    if info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size:
        raise DataError(f"{source}: {key} is stored uncompressed in {info.compress_size} bytes but declares "
                        f"{info.file_size}: not read")
    if info.file_size > max(ZIP_FLOOR_BYTES, MAX_ZIP_EXPANSION * info.compress_size):
        raise DataError(f"{source}: {key} expands from {info.compress_size} bytes to {info.file_size}, more than the "
                        f"{MAX_ZIP_EXPANSION}x any image data compresses by (a zip bomb?): not read")
    return dtype, shape, size


def _read(zf: zipfile.ZipFile, key: str, source: str) -> np.ndarray:
    # read_array fills the array it allocates in small pieces, and the zip entry stops at the size
    # it declares, so a lying stream costs no more than its header (already checked) says.
    try:
        with zf.open(f"{key}.npy") as f:
            return np.lib.format.read_array(f, allow_pickle=False)
    except (ValueError, OSError, zipfile.BadZipFile, EOFError, zlib.error) as e:
        raise DataError(f"{source}: {key} is not a readable .npy array: {type(e).__name__}: {e}") from None


def _image_layout(shape: tuple, key: str, source: str) -> str:
    """"NCHW", "NHWC" or "NHW" for an images array of `shape`, from its header."""
    if len(shape) == 3:
        return "NHW"
    if len(shape) == 4:
        first, last = shape[1] in CHANNELS, shape[3] in CHANNELS
        if first and last:
            raise DataError(f"{source}: {key} of shape {shape} is ambiguous: NCHW and NHWC both have "
                            f"1 or 3 channels; store it as (N, H, W, C) or (N, C, H, W) with H, W not 1 or 3")
        if not first and not last:
            raise DataError(f"{source}: {key} of shape {shape}; expected (N, C, H, W) or (N, H, W, C) "
                            f"with C 1 or 3, or (N, H, W)")
        return "NHWC" if last else "NCHW"
    raise DataError(f"{source}: {key} of shape {shape}; expected (N, C, H, W), (N, H, W, C) or (N, H, W)")


def _chw(shape: tuple, layout: str) -> tuple:
    if layout == "NHW":
        return (1, *shape[1:])
    return tuple(shape[1:]) if layout == "NCHW" else (shape[3], shape[1], shape[2])


def _images(x: np.ndarray, layout: str, key: str, source: str) -> np.ndarray:
    """uint8 or float [0, 1] images in `layout` -> (N, C, H, W) uint8."""
    if layout == "NHW":
        x = x[:, None]
    elif layout == "NHWC":
        x = x.transpose(0, 3, 1, 2)
    if x.dtype == np.uint8:
        return np.ascontiguousarray(x)
    out = np.empty(x.shape, np.uint8)
    flat_in, flat_out = x.reshape(len(x), -1), out.reshape(len(x), -1)
    per_pass = max(1, _FLOAT_CHUNK // max(1, flat_in.shape[1]))
    for start in range(0, len(x), per_pass):           # converted in pieces: no full-size float temporary
        piece = np.asarray(flat_in[start:start + per_pass], np.float64)
        if piece.size and not (np.isfinite(piece).all() and piece.min() >= 0 and piece.max() <= 1):
            raise DataError(f"{source}: {key} has values outside [0, 1] (min {np.nanmin(piece):g}, max "
                            f"{np.nanmax(piece):g}, or not finite); expected float images in [0, 1] or uint8")
        flat_out[start:start + per_pass] = np.rint(piece * 255.0)
    return out


def _infer_classes(train_y: np.ndarray, test_y: np.ndarray, source: str) -> tuple[tuple[str, ...], str]:
    """Class names "0".."K-1" for labels with no `classes` array, and the note that says so."""
    count = int(max(train_y.max(initial=0), test_y.max(initial=0))) + 1
    if count > MAX_CLASSES:
        raise DataError(f"{source}: labels up to {count - 1}; expected at most {MAX_CLASSES} classes")
    for y, key in ((train_y, "y_train"), (test_y, "y_test")):
        check_labels(y, count, f"{source}: {key}")                     # a negative label, named
    per_class = np.bincount(train_y, minlength=count)
    missing = np.flatnonzero(per_class == 0)
    if missing.size:
        shown = ", ".join(map(str, missing[:5])) + (", ..." if missing.size > 5 else "")
        raise DataError(f"{source}: no `classes` array, and the labels up to {count - 1} imply {count} classes, but "
                        f"only {count - missing.size} distinct labels have training images (none for {shown}); "
                        f"number the classes 0..K-1 with no gaps, or give their names as a `classes` array")
    note = f"{source}: no `classes` array: {count} classes inferred from the labels 0..{count - 1}"
    rare = np.flatnonzero(per_class < RARE_CLASS * per_class.max())
    if rare.size:
        note += ("; " + ", ".join(f"class {c} has {per_class[c]} training image(s)" for c in rare[:3])
                 + (", ..." if rare.size > 3 else "")
                 + f" against {per_class.max()} for the largest (a stray label?)")
    return tuple(str(i) for i in range(count)), note


def load_npz(path: str | os.PathLike) -> DataSet:
    source = str(path)
    with _open(path, source) as zf:
        present = {n[:-4] for n in zf.namelist() if n.endswith(".npy")}
        wanted = KEYS if {"x_test", "y_test"} & present or not {"x_train", "y_train"} <= present else KEYS[:2]
        missing = [k for k in wanted if k not in present]
        if missing:
            raise DataError(f"{source}: missing {', '.join(missing)}; expected arrays {', '.join(KEYS)} (or only "
                            f"x_train, y_train), found {', '.join(sorted(present)) or 'none'}")
        keys = list(wanted) + (["classes"] if "classes" in present else [])
        headers = {k: _header(zf, k, source) for k in keys}
        total = sum(size for _, _, size in headers.values())
        if total > MAX_TOTAL_BYTES:
            raise DataError(f"{source}: its arrays are {total} bytes together, more than the "
                            f"{MAX_TOTAL_BYTES >> 30} GB this loader holds: not read")
        # what the headers must say, checked before any data is read
        layouts = {}
        for xk, yk in (("x_train", "y_train"), ("x_test", "y_test")):
            if xk not in headers:
                continue
            (x_dtype, x_shape, _), (y_dtype, y_shape, _) = headers[xk], headers[yk]
            layouts[xk] = _image_layout(x_shape, xk, source)
            if x_dtype != np.uint8 and x_dtype.kind != "f":
                raise DataError(f"{source}: {xk} is {x_dtype}; expected uint8 images or float images in [0, 1]")
            if not (len(y_shape) == 1 or (len(y_shape) == 2 and y_shape[1] == 1)) or \
                    (y_shape[0] and y_dtype.kind not in "iu"):
                raise DataError(f"{source}: {yk} is {y_dtype} of shape {y_shape}; expected a flat array of ints")
            if y_shape[0] != x_shape[0]:
                raise DataError(f"{source}: {y_shape[0]} labels in {yk} for {x_shape[0]} images in {xk}; "
                                f"expected one per image")
        if "x_test" in headers:
            train_chw = _chw(headers["x_train"][1], layouts["x_train"])
            test_chw = _chw(headers["x_test"][1], layouts["x_test"])
            if train_chw != test_chw:
                raise DataError(f"{source}: x_test images are {test_chw}, x_train's {train_chw}; "
                                f"expected one image shape (C, H, W)")
        if headers["y_train"][1][0] == 0:
            raise DataError(f"{source}: y_train is empty; expected at least one training image")
        if "classes" in headers:
            c_dtype, c_shape, _ = headers["classes"]
            if len(c_shape) != 1 or c_dtype.kind != "U" or not 1 <= c_shape[0] <= MAX_CLASSES:
                raise DataError(f"{source}: classes is {c_dtype} of shape {c_shape}; expected a flat array of 1 to "
                                f"{MAX_CLASSES} names")
        train_x = _images(_read(zf, "x_train", source), layouts["x_train"], "x_train", source)
        train_y = _read(zf, "y_train", source).reshape(-1)
        if "x_test" in headers:
            test_x = _images(_read(zf, "x_test", source), layouts["x_test"], "x_test", source)
            test_y = _read(zf, "y_test", source).reshape(-1)
        else:
            test_x = np.empty((0, *train_x.shape[1:]), np.uint8)
            test_y = np.empty(0, np.int64)
        names = _read(zf, "classes", source) if "classes" in headers else None
    notes = ()
    if names is not None:
        classes = tuple(str(n) for n in names)
    else:
        classes, note = _infer_classes(train_y.astype(np.int64), test_y.astype(np.int64), source)
        notes = (note,)
    train_y = check_labels(train_y, len(classes), f"{source}: y_train")
    test_y = check_labels(test_y, len(classes), f"{source}: y_test")
    return DataSet(Path(source).stem, train_x, train_y, test_x, test_y, classes, notes=notes)
