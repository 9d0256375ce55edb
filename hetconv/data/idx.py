"""MNIST and Fashion-MNIST: the four IDX files in one directory, gzipped or not.

IDX is big-endian: two zero bytes, a type code (0x08: uint8), the number of dimensions, then
each dimension as a 32-bit count, then the values. Every header is checked against what the file
must be (images: 3 dimensions; labels: 1; counts that agree) and the size it declares is capped
before anything is read, so a small gzip file that claims gigabytes is refused from its header.
"""

from __future__ import annotations

import gzip
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from hetconv.data.base import DataError, DataSet, check_labels

FILES = {"train_x": "train-images-idx3-ubyte", "train_y": "train-labels-idx1-ubyte",
         "test_x": "t10k-images-idx3-ubyte", "test_y": "t10k-labels-idx1-ubyte"}
IMAGES_MAGIC, LABELS_MAGIC = 0x00000803, 0x00000801      # uint8, 3 dimensions / 1 dimension
# MNIST's training images are 47 MB; the cap leaves room for larger IDX sets of the same kind.
MAX_IDX_BYTES = 512 << 20
MAX_SIDE = 4096                                           # rows or columns of one image

MNIST_CLASSES = tuple(str(i) for i in range(10))
FASHION_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                   "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")


def find_dir(path: Path) -> Path | None:
    """The directory holding the IDX files: `path` itself or its raw/ (torchvision's layout)."""
    for root in (path, path / "raw"):
        if _file(root, FILES["train_x"]) is not None:
            return root
    return None


def _file(root: Path, name: str) -> Path | None:
    for candidate in (root / name, root / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _open(path: Path):
    with open(path, "rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if gzipped else open(path, "rb")


def read_idx(path: Path, magic: int) -> np.ndarray:
    """One IDX file -> its uint8 array, after checking the header names what `magic` says."""
    ndim = magic & 0xFF
    kind = "images" if ndim == 3 else "labels"
    try:
        with _open(path) as f:
            head = f.read(4 + 4 * ndim)
            if len(head) < 4:
                raise DataError(f"{path}: {len(head)} bytes; expected an IDX header (magic 0x{magic:08x})")
            (found,) = struct.unpack(">I", head[:4])
            if found != magic:
                raise DataError(f"{path}: magic number 0x{found:08x}; expected 0x{magic:08x} (IDX {kind}, "
                                f"uint8, {ndim} dimension(s))")
            if len(head) < 4 + 4 * ndim:
                raise DataError(f"{path}: header truncated; expected {ndim} dimension sizes")
            dims = struct.unpack(f">{ndim}I", head[4:])
            if ndim == 3 and not (1 <= dims[1] <= MAX_SIDE and 1 <= dims[2] <= MAX_SIDE):
                raise DataError(f"{path}: images of {dims[1]}x{dims[2]}; expected rows and columns in 1..{MAX_SIDE}")
            size = int(np.prod(dims, dtype=np.int64))
            if size > MAX_IDX_BYTES:
                raise DataError(f"{path}: the header declares {dims} = {size} bytes, more than the "
                                f"{MAX_IDX_BYTES >> 20} MB an IDX file may have: not read")
            raw = f.read(size)
            if len(raw) < size:
                raise DataError(f"{path}: truncated: {len(raw)} of the {size} bytes its header {dims} declares")
            if f.read(1):
                raise DataError(f"{path}: more bytes than its header {dims} declares")
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path}: not a readable IDX file (gzip or plain): {type(e).__name__}: {e}") from None
    return np.frombuffer(raw, np.uint8).reshape(dims)


def load_idx(path: str | os.PathLike, fashion: bool | None = None) -> DataSet:
    """MNIST (classes "0".."9") or Fashion-MNIST (its ten names) from a directory of IDX files.
    fashion=None tells them apart by the path: "fashion" in any of its names (FashionMNIST/,
    fashion-mnist/) means Fashion-MNIST; True or False says which."""
    given = Path(path)
    root = find_dir(given)
    if root is None:
        raise DataError(f"{given}: no {FILES['train_x']}[.gz]; expected the four MNIST IDX files "
                        f"({', '.join(FILES.values())}, each optionally .gz) in this directory")
    arrays = {}
    for key, name in FILES.items():
        file = _file(root, name)
        if file is None:
            raise DataError(f"{root / name}: missing (nor {name}.gz); expected the four MNIST IDX files "
                            f"{', '.join(FILES.values())}")
        arrays[key] = read_idx(file, IMAGES_MAGIC if key.endswith("_x") else LABELS_MAGIC)
    for split in ("train", "test"):
        x, y = arrays[f"{split}_x"], arrays[f"{split}_y"]
        if len(x) != len(y):
            raise DataError(f"{_file(root, FILES[f'{split}_y'])}: {len(y)} labels for the {len(x)} images of "
                            f"{_file(root, FILES[f'{split}_x'])}; expected one label per image")
    if arrays["train_x"].shape[1:] != arrays["test_x"].shape[1:]:
        raise DataError(f"{_file(root, FILES['test_x'])}: images of {arrays['test_x'].shape[1:]}; expected the "
                        f"training images' {arrays['train_x'].shape[1:]}")
    if fashion is None:
        fashion = any("fashion" in part.lower() for part in given.resolve().parts)
    classes = FASHION_CLASSES if fashion else MNIST_CLASSES
    for key in ("train_y", "test_y"):
        arrays[key] = check_labels(arrays[key], len(classes), str(_file(root, FILES[key])))
    return DataSet("fashion-mnist" if fashion else "mnist",
                   arrays["train_x"][:, None].copy(), arrays["train_y"],      # (N, 1, 28, 28)
                   arrays["test_x"][:, None].copy(), arrays["test_y"], classes)
