"""An image folder: root/train/<class>/*.png|jpg|jpeg and root/test/<class>/..., as torchvision's
ImageFolder reads it: classes numbered in sorted order of the train/ subdirectories, files taken in
sorted order (subdirectories of a class included). Every image must have one size and one mode, RGB
or L. Pillow is needed for this format only, so it is imported here and nowhere else.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from hetconv.data.base import DataError, DataSet

EXTENSIONS = (".png", ".jpg", ".jpeg")
MODES = {"RGB": 3, "L": 1}
MAX_FILE_BYTES = 64 << 20                 # one image file
MAX_TOTAL_BYTES = 8 << 30                 # every decoded image together: the arrays held in memory


def is_image_folder(path: Path) -> bool:
    return (path / "train").is_dir() and (path / "test").is_dir()


def _pillow(root: Path):
    try:
        from PIL import Image
    except ImportError:
        raise DataError(f"{root}: an image folder is read with Pillow, which is not installed: "
                        f"pip install 'hetconv[images]'") from None
    return Image


def _listing(split_dir: Path, classes: tuple[str, ...] | None) -> tuple[tuple[str, ...], list[tuple[Path, int]]]:
    """(class names, [(file, label)]) of one split; `classes` given: the test split, whose class
    directories must be among the training classes."""
    found = sorted(d.name for d in split_dir.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not found:
        raise DataError(f"{split_dir}: no class directories; expected {split_dir}/<class>/*.png|jpg|jpeg")
    if classes is None:
        classes = tuple(found)
    else:
        unknown = [c for c in found if c not in classes]
        if unknown:
            raise DataError(f"{split_dir / unknown[0]}: class {unknown[0]!r} is not among the "
                            f"{len(classes)} classes of {split_dir.parent / 'train'}")
    index = {c: i for i, c in enumerate(classes)}
    files = []
    for name in found:
        in_class = []
        for dirpath, dirnames, filenames in os.walk(split_dir / name):
            dirnames.sort()
            in_class += [Path(dirpath) / f for f in sorted(filenames)
                         if f.lower().endswith(EXTENSIONS) and not f.startswith(".")]
        if not in_class and split_dir.name == "train":
            raise DataError(f"{split_dir / name}: no images; expected *.png, *.jpg or *.jpeg files")
        files += [(f, index[name]) for f in in_class]
    return classes, files


def _read_split(Image, files, shape_mode, split_dir: Path):
    """Decode every file into one (N, C, H, W) uint8 array; shape_mode: ((w, h), mode) every image must have."""
    (width, height), mode = shape_mode
    channels = MODES[mode]
    x = np.empty((len(files), channels, height, width), np.uint8)
    for i, (file, _) in enumerate(files):
        image = _open(Image, file)
        with image:
            if (image.size, image.mode) != ((width, height), mode):
                raise DataError(f"{file}: {image.size[0]}x{image.size[1]} {image.mode}; expected every image "
                                f"{width}x{height} {mode}, as the first one (convert them to one size and mode)")
            try:
                pixels = np.asarray(image)                          # (H, W) or (H, W, 3)
            except (OSError, ValueError, SyntaxError) as e:
                raise DataError(f"{file}: not a readable image: {type(e).__name__}: {e}") from None
        x[i] = pixels.reshape(height, width, channels).transpose(2, 0, 1)
    y = np.array([label for _, label in files], np.int64)
    return x, y


def _open(Image, file: Path):
    size = file.stat().st_size
    if size > MAX_FILE_BYTES:
        raise DataError(f"{file}: {size} bytes, more than the {MAX_FILE_BYTES >> 20} MB an image file may have: not read")
    try:
        return Image.open(file)                      # reads the header only: size and mode, no pixels yet
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise DataError(f"{file}: not a readable PNG or JPEG image: {type(e).__name__}: {e}") from None


def load_image_folder(path: str | os.PathLike) -> DataSet:
    root = Path(path)
    if not is_image_folder(root):
        raise DataError(f"{root}: expected an image folder with train/<class>/ and test/<class>/ directories")
    Image = _pillow(root)
    classes, train_files = _listing(root / "train", None)
    _, test_files = _listing(root / "test", classes)
    if not test_files:
        raise DataError(f"{root / 'test'}: no images; expected test/<class>/*.png|jpg|jpeg")
    first = train_files[0][0]
    with _open(Image, first) as image:
        shape_mode = image.size, image.mode
    if shape_mode[1] not in MODES:
        raise DataError(f"{first}: mode {shape_mode[1]}; expected RGB or L (convert the images first)")
    (width, height), mode = shape_mode
    total = (len(train_files) + len(test_files)) * width * height * MODES[mode]
    if total > MAX_TOTAL_BYTES:
        raise DataError(f"{root}: {len(train_files) + len(test_files)} images of {width}x{height} {mode} are "
                        f"{total >> 20} MB decoded, more than the {MAX_TOTAL_BYTES >> 30} GB this loader holds")
    train_x, train_y = _read_split(Image, train_files, shape_mode, root / "train")
    test_x, test_y = _read_split(Image, test_files, shape_mode, root / "test")
    return DataSet(root.resolve().name or "images", train_x, train_y, test_x, test_y, classes)
