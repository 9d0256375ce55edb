"""An image folder: root/train/<class>/*.png|jpg|jpeg and root/val/<class>/... or root/test/<class>/...,
as torchvision's ImageFolder reads it: classes numbered in sorted order of the train/
subdirectories, files taken in sorted order (subdirectories of a class included). val/ and test/
may be left out: the set then has no test split, and --val-split holds out part of train/ instead.
This reader holds every image in memory, all of one size; photos of any size are photos.py's
(--image-size), streamed.

Every image must have one size. Modes follow torchvision's loader, which converts every image to
RGB: an alpha channel is dropped, a palette expanded, grey repeated in three channels; but a folder
whose images are all grey (L, LA or 1-bit) stays one channel. 16-bit and float images are refused
(converting them to 8 bits would clip). Pillow is needed for this format only, so it is imported
here and nowhere else.

Nothing is decoded before it is bounded: the listing stops at MAX_IMAGES, every file must be a
regular file (a fifo would block the read, a device never end) of at most MAX_FILE_BYTES, every
header is read first (size, mode, and the photo folder's pixel limit for one process,
photos.pixel_limit, named as in every decompression-bomb message), and the decoded total is
checked against MAX_TOTAL_BYTES before the array that holds it is allocated.
"""

from __future__ import annotations

import os
import stat
import struct
import zlib
from pathlib import Path

import numpy as np

from hetconv.data.base import DataError, DataSet, class_directories, loops_note, walk_once
from hetconv.data.photos import BadImage, open_header, pixel_limit

EXTENSIONS = (".png", ".jpg", ".jpeg")
GREY_MODES = ("1", "L", "LA")
COLOUR_MODES = ("RGB", "RGBA", "RGBX", "P", "PA", "CMYK", "YCbCr")   # 8 bits a channel: convert("RGB")
MAX_FILE_BYTES = 64 << 20                 # one image file
MAX_TOTAL_BYTES = 8 << 30                 # every decoded image together: the arrays held in memory
MAX_IMAGES = 2_000_000                    # files listed, both splits: each is a path held in memory


def is_image_folder(path: Path) -> bool:
    return (path / "train").is_dir()


def _pillow(root: Path):
    try:
        from PIL import Image
    except ImportError:
        raise DataError(f"{root}: an image folder is read with Pillow, which is not installed: "
                        f"pip install 'hetconv[images]'") from None
    return Image


def _listing(split_dir: Path, classes: tuple[str, ...] | None, budget: int,
             loops: list) -> tuple[tuple[str, ...], list[tuple[Path, int]]]:
    """(class names, [(file, label)]) of one split, at most `budget` files; `classes` given: the
    test split, whose class directories must be among the training classes. Links are followed as
    torchvision's ImageFolder follows them, each directory once (walk_once: the links not followed
    are appended to `loops`)."""
    classes, found = class_directories(split_dir, classes, "*.png|jpg|jpeg")
    index = {c: i for i, c in enumerate(classes)}
    files = []
    for name in found:
        in_class = []
        for dirpath, filenames in walk_once(split_dir / name, loops):
            in_class += [Path(dirpath) / f for f in filenames
                         if f.lower().endswith(EXTENSIONS) and not f.startswith(".")]
            if len(files) + len(in_class) > budget:
                raise DataError(f"{split_dir.parent}: more than {MAX_IMAGES} images: not read")
        if not in_class and split_dir.name == "train":
            raise DataError(f"{split_dir / name}: no images; expected *.png, *.jpg or *.jpeg files")
        files += [(f, index[name]) for f in in_class]
    return classes, files


def _open(Image, file: Path):
    """The image at `file` with only its header read (size and mode), after the file is bounded."""
    try:
        st = os.stat(file)
    except OSError as e:
        raise DataError(f"{file}: cannot be read: {type(e).__name__}: {e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise DataError(f"{file}: not a regular file (a fifo, socket or device); expected a PNG or JPEG image")
    if st.st_size > MAX_FILE_BYTES:
        raise DataError(f"{file}: {st.st_size} bytes, more than the {MAX_FILE_BYTES >> 20} MB an image file may have: "
                        f"not read")
    try:
        # the photo folder's pixel limit for one process, named as it names it
        return open_header(file, ("PNG", "JPEG"), pixel_limit(1))
    except BadImage as e:
        raise DataError(f"{file}: {e}") from None
    except (OSError, ValueError, SyntaxError, EOFError, struct.error) as e:
        raise DataError(f"{file}: not a readable PNG or JPEG image: {type(e).__name__}: {e}") from None


def _headers(Image, files) -> tuple[tuple[int, int], bool]:
    """Every file's header: ((width, height) they all have, whether all are grey)."""
    size, grey = None, True
    for file, _ in files:
        with _open(Image, file) as image:
            if image.mode not in GREY_MODES + COLOUR_MODES:
                raise DataError(f"{file}: mode {image.mode}; expected 8 bits a channel, grey or colour (convert "
                                f"16-bit or float images first)")
            if size is None:
                size, first = image.size, file
            elif image.size != size:
                raise DataError(f"{file}: {image.size[0]}x{image.size[1]}; expected every image {size[0]}x{size[1]}, "
                                f"as {first} (resize them to one size, or give --image-size S to resize and "
                                f"crop photos of any size to S x S as they stream)")
            grey = grey and image.mode in GREY_MODES
    return size, grey


def _decode(Image, files, size, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """Every file's pixels in one (N, C, H, W) uint8 array, each converted to `mode`."""
    (width, height), channels = size, 1 if mode == "L" else 3
    x = np.empty((len(files), channels, height, width), np.uint8)
    for i, (file, _) in enumerate(files):
        with _open(Image, file) as image:
            if image.size != size or image.mode not in GREY_MODES + COLOUR_MODES:
                raise DataError(f"{file}: changed while it was read: now {image.size[0]}x{image.size[1]} {image.mode}")
            try:
                pixels = np.asarray(image if image.mode == mode else image.convert(mode))   # (H, W) or (H, W, 3)
            except (OSError, ValueError, SyntaxError, EOFError, struct.error, zlib.error,
                    Image.DecompressionBombError) as e:
                raise DataError(f"{file}: not a readable image: {type(e).__name__}: {e}") from None
        x[i] = pixels.reshape(height, width, channels).transpose(2, 0, 1)
    y = np.array([label for _, label in files], np.int64)
    return x, y


def load_image_folder(path: str | os.PathLike) -> DataSet:
    root = Path(path)
    if not is_image_folder(root):
        raise DataError(f"{root}: expected an image folder with train/<class>/ (and val/<class>/ or test/<class>/) "
                        f"directories")
    Image = _pillow(root)
    loops = []
    classes, train_files = _listing(root / "train", None, MAX_IMAGES, loops)
    test_files = []
    split = next((s for s in ("val", "test") if (root / s).is_dir()), None)
    if split is not None:
        _, test_files = _listing(root / split, classes, MAX_IMAGES - len(train_files), loops)
        if not test_files:
            raise DataError(f"{root / split}: no images; expected {split}/<class>/*.png|jpg|jpeg (or neither val/ "
                            f"nor test/, with --val-split)")
    size, grey = _headers(Image, train_files + test_files)
    mode = "L" if grey else "RGB"
    count = len(train_files) + len(test_files)
    total = count * size[0] * size[1] * (1 if grey else 3)
    if total > MAX_TOTAL_BYTES:
        raise DataError(f"{root}: {count} images of {size[0]}x{size[1]} {mode} are {total >> 20} MB decoded, more than "
                        f"the {MAX_TOTAL_BYTES >> 30} GB this loader holds: not read")
    train_x, train_y = _decode(Image, train_files, size, mode)
    test_x, test_y = _decode(Image, test_files, size, mode)
    notes = (f"{root}: {loops_note(loops)}",) if loops else ()
    return DataSet(root.resolve().name or "images", train_x, train_y, test_x, test_y, classes, notes=notes)
