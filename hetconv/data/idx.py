"""MNIST and Fashion-MNIST: the four IDX files in one directory, gzipped or not.

IDX is big-endian: two zero bytes, a type code (0x08: uint8), the number of dimensions, then
each dimension as a 32-bit count, then the values. Every header is checked against what the file
must be (images: 3 dimensions; labels: 1, as many as the images; test images the training images'
size) and the size it declares is capped before anything is read: against MAX_IDX_BYTES, against
the file's own size when it is plain, and against MAX_GZIP_EXPANSION times the file's size when it
is gzipped, so a small gzip file that claims (or really holds) gigabytes is refused from its
header. Decompression stops one byte past what the header declares.
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
# gzip shrinks MNIST's images 4.7x and Fashion-MNIST's 1.8x; 64x is far past any image data, and
# a gzip bomb (zeros: about 1000x) is far past 64x. Sizes up to the floor are cheap whatever they are.
MAX_GZIP_EXPANSION = 64
GZIP_FLOOR_BYTES = 16 << 20
_CHUNK = 1 << 22                                          # bytes decompressed per read

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
    return (gzip.open(path, "rb") if gzipped else open(path, "rb")), gzipped


def read_idx(path: Path, magic: int, count: int | None = None, counted: Path | None = None,
             image_shape: tuple | None = None, shaped: Path | None = None) -> np.ndarray:
    """One IDX file -> its uint8 array, after checking the header names what `magic` says. count:
    the number of entries it must declare (the images of `counted`); image_shape: the (rows, columns)
    its images must have (those of `shaped`). Every check is made before the values are read."""
    ndim = magic & 0xFF
    kind = "images" if ndim == 3 else "labels"
    try:
        on_disk = path.stat().st_size
        f, gzipped = _open(path)
        with f:
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
            if count is not None and dims[0] != count:
                raise DataError(f"{path}: {dims[0]} {kind} for the {count} images of {counted}; expected one "
                                f"label per image")
            if image_shape is not None and tuple(dims[1:]) != tuple(image_shape):
                raise DataError(f"{path}: images of {tuple(dims[1:])}; expected the training images' "
                                f"{tuple(image_shape)} (those of {shaped})")
            size = int(np.prod(dims, dtype=np.int64))
            if size > MAX_IDX_BYTES:
                raise DataError(f"{path}: the header declares {dims} = {size} bytes, more than the "
                                f"{MAX_IDX_BYTES >> 20} MB an IDX file may have: not read")
            if not gzipped and on_disk != len(head) + size:
                raise DataError(f"{path}: {'truncated' if on_disk < len(head) + size else 'more bytes than its header'}"
                                f": {on_disk - len(head)} bytes of values where its header {dims} declares {size}")
            if gzipped and size > max(GZIP_FLOOR_BYTES, MAX_GZIP_EXPANSION * on_disk):
                raise DataError(f"{path}: the header declares {size} bytes from {on_disk} gzipped, a {size // on_disk}x "
                                f"expansion; image data gzips at most {MAX_GZIP_EXPANSION}x (a gzip bomb?): not read")
            # read into place: no second copy, and pages a short file never fills are never touched
            values = np.empty(size, np.uint8)
            view, got = memoryview(values), 0
            while got < size:
                n = f.readinto(view[got:got + _CHUNK])
                if not n:
                    break
                got += n
            if got < size:
                raise DataError(f"{path}: truncated: {got} of the {size} bytes its header {dims} declares")
            if f.read(1):
                raise DataError(f"{path}: more bytes than its header {dims} declares")
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path}: not a readable IDX file (gzip or plain): {type(e).__name__}: {e}") from None
    return values.reshape(dims)


def _is_fashion(given: Path) -> bool:
    """Fashion-MNIST when the data set's own directory says so: `given`, or the directory holding
    raw/ when `given` is raw/ itself. The directories above it say nothing about the files."""
    own = given.resolve()
    if own.name == "raw":
        own = own.parent
    return "fashion" in own.name.lower()


def load_idx(path: str | os.PathLike, fashion: bool | None = None) -> DataSet:
    """MNIST (classes "0".."9") or Fashion-MNIST (its ten names) from a directory of IDX files.
    fashion=None tells them apart by the data set's own directory: "fashion" in its name
    (FashionMNIST/, fashion-mnist/, or FashionMNIST/raw/) means Fashion-MNIST; True or False says
    which. A label past the ten classes is refused, naming the file."""
    given = Path(path)
    root = find_dir(given)
    if root is None:
        raise DataError(f"{given}: no {FILES['train_x']}[.gz]; expected the four MNIST IDX files "
                        f"({', '.join(FILES.values())}, each optionally .gz) in this directory")
    files = {}
    for key, name in FILES.items():
        files[key] = _file(root, name)
        if files[key] is None:
            raise DataError(f"{root / name}: missing (nor {name}.gz); expected the four MNIST IDX files "
                            f"{', '.join(FILES.values())}")
    train_x = read_idx(files["train_x"], IMAGES_MAGIC)
    train_y = read_idx(files["train_y"], LABELS_MAGIC, len(train_x), files["train_x"])
    test_x = read_idx(files["test_x"], IMAGES_MAGIC, image_shape=train_x.shape[1:], shaped=files["train_x"])
    test_y = read_idx(files["test_y"], LABELS_MAGIC, len(test_x), files["test_x"])
    if fashion is None:
        fashion = _is_fashion(given)
    classes = FASHION_CLASSES if fashion else MNIST_CLASSES
    train_y = check_labels(train_y, len(classes), str(files["train_y"]))
    test_y = check_labels(test_y, len(classes), str(files["test_y"]))
    return DataSet("fashion-mnist" if fashion else "mnist",
                   train_x[:, None], train_y,      # (N, 1, 28, 28): a view of the array read, no copy
                   test_x[:, None], test_y, classes)
