"""A folder of photos (ImageNet's layout): ROOT/train/<class>/*.jpg and ROOT/val/<class>/... (or
ROOT/test/<class>/...), photos of any size, streamed: listed and checked from their headers up
front, decoded and transformed to --image-size S only when a batch needs them.

Classes are numbered as torchvision's ImageFolder numbers them (sorted train/ subdirectories;
files in sorted order, subdirectories of a class included) and every photo is converted to RGB
as its loader does. The transforms are torchvision's standard ones:

- training with --augment random-resized-crop: RandomResizedCrop(S) (scale 0.08-1, ratio
  3/4-4/3, ten tries then a center-crop fallback, bilinear); flip: RandomHorizontalFlip; crop:
  the random crop of the S x S image padded by 4 pixels that small sets get;
- training without random-resized-crop: Resize(S) (the shorter side) and CenterCrop(S);
- evaluation and classification: Resize(round(S / 0.875)) and CenterCrop(S) (256 and 224).

The crop and the resize are one resize of the crop's box as Pillow's does it (a resize then a crop
to a rounding step: a pixel may differ by 1), in uint8, compiled (hetconv.data.resample); a JPEG much larger than its box needs is decoded at 1/2, 1/4 or 1/8 scale by
libjpeg itself (Image.draft), which is most of a photo's decoding time saved.

Each training image's random choices come from a generator seeded by (seed, epoch, its position
in the epoch), so a batch is the same whichever process decodes it and whenever.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import re
import stat
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from hetconv.data.base import DataError, DataSet, class_directories, loops_note, walk_once

EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp")
FORMATS = ("JPEG", "PNG", "WEBP")
# Normalisation of ImageNet's training photos as torchvision publishes it: measuring a photo
# folder's own would mean decoding every photo before the first step.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
EVAL_CROP_FRACTION = 0.875                # evaluation resizes to S / 0.875, then crops S (224 of 256)
RRC_SCALE = (0.08, 1.0)
RRC_RATIO = (3 / 4, 4 / 3)
CROP_PADDING = 4
MAX_FILE_BYTES = 64 << 20                 # one photo file
MAX_IMAGES = 20_000_000                   # files listed, every split: each is a path held in memory
MAX_IMAGE_SIZE = 2048                     # --image-size
WIDE_MODES = ("I", "I;16", "I;16B", "I;16L", "I;16N", "F")     # 16- and 32-bit: convert("RGB") would clip
PARALLEL_SCAN = 4096                      # files from which the headers are checked in processes
SCAN_CHUNK = 512
BAD_SHOWN = 10                            # bad files named in a message; the rest counted
_PHOTO_STREAM = 0xF070                    # first word of every training photo's generator seed
# What the loader processes' decodes may hold at once, together: a photo's pixels x 4 bytes x the
# loader processes is kept under it, checked from the header before a pixel is decoded
# (pixel_limit). 2 GiB lets 8 processes each decode a 67-megapixel photo (a 50 MP camera's whole).
DECODE_BUDGET_BYTES = 2 << 30
DECODED_BYTES_PER_PIXEL = 4               # Pillow holds RGB, RGBA, CMYK and YCbCr alike in 4 bytes a pixel
MAX_AUTO_LOADERS = 8


class BadImage(DataError):
    """A photo that cannot be used: its path and why."""


def pillow(root=None):
    try:
        from PIL import Image
    except ImportError:
        where = f"{root}: " if root is not None else ""
        raise DataError(f"{where}a photo folder is read with Pillow, which is not installed: "
                        f"pip install 'hetconv[images]'") from None
    return Image


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def auto_workers(cores: int | None = None) -> int:
    """The loader processes when --loader-workers is 0: a quarter of the usable cores (at most
    MAX_AUTO_LOADERS, at least 1): the other three quarters are left to the conv and head compute,
    which a decoded batch is worth nothing without."""
    return max(1, min(MAX_AUTO_LOADERS, (cores or usable_cores()) // 4))


def loader_processes(asked: int) -> tuple[int, str | None]:
    """(the loader processes for --loader-workers `asked`, a line saying why when it is not what
    was asked): 0 is auto_workers(); more than the usable cores is capped to them, as each process
    would only wait for a core (and hold its own decode budget and start-up) while slowing the
    compute."""
    cores = usable_cores()
    if not asked:
        return auto_workers(cores), None
    if asked > cores:
        return cores, (f"--loader-workers {asked} is more than the {cores} usable core{'s' if cores > 1 else ''} "
                       f"(the process's CPU affinity): {cores} loader process{'es' if cores > 1 else ''}")
    return asked, None


def pixel_limit(loaders: int = 1) -> int:
    """The most pixels a photo may have when `loaders` processes decode at once: the decode budget
    over 4 bytes a pixel and the processes, at most Pillow's MAX_IMAGE_PIXELS (where it is set).
    The one limit every decompression-bomb message names."""
    limit = DECODE_BUDGET_BYTES // (DECODED_BYTES_PER_PIXEL * max(1, loaders))
    pillows = pillow().MAX_IMAGE_PIXELS
    return min(limit, pillows) if pillows else limit


def too_many_pixels(pixels: str, limit: int) -> str:
    return (f"a decompression bomb: {pixels} pixels, more than the {limit:,} a photo may have (the decode budget "
            f"hetconv.data.photos.DECODE_BUDGET_BYTES over 4 bytes a pixel and the loader processes, at most "
            f"Pillow's MAX_IMAGE_PIXELS)")


def open_header(path, formats, limit: int):
    """The Pillow image at `path` with only its header read; BadImage when it has more than `limit`
    pixels (too_many_pixels: Pillow's own decompression-bomb warning and error, which name its two
    limits, are replaced by this one)."""
    Image = pillow()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)     # the check below names our limit
        try:
            image = Image.open(path, formats=formats)
        except Image.DecompressionBombError as e:                          # past twice Pillow's limit
            found = re.search(r"\((\d+) pixels\)", str(e))
            raise BadImage(too_many_pixels(f"{int(found[1]):,}" if found else "more", limit)) from None
    width, height = image.size
    if width * height > limit:
        image.close()
        raise BadImage(too_many_pixels(f"{width}x{height} = {width * height:,}", limit))
    return image


def eval_resize(size: int) -> int:
    """The shorter side evaluation resizes a photo to before its center crop of `size`."""
    return round(size / EVAL_CROP_FRACTION)


# ---- which directories are the splits ----------------------------------------------------------

def eval_split_dir(root) -> str | None:
    """The directory of the evaluation split: val/ (ImageNet's name) or test/; None when neither."""
    for name in ("val", "test"):
        if os.path.isdir(os.path.join(root, name)):
            return name
    return None


# ---- listing ---------------------------------------------------------------------------------

def list_split(split_dir: str, classes: tuple[str, ...] | None, budget: int = MAX_IMAGES, loops=None):
    """(class names, [(file, label)], [(path, why)] of what is not a photo) of one split; `classes`
    given: an evaluation split, whose class directories must be among the training classes. A
    class directory with no photo and a file whose name is not a photo's are bad entries. Links
    are followed, each directory once (walk_once); the links not followed are appended to `loops`."""
    classes, entries = class_directories(split_dir, classes, "*.jpg|png|webp")
    index = {c: i for i, c in enumerate(classes)}
    files, bad = [], []
    loops = [] if loops is None else loops
    for name in entries:
        found = 0
        for dirpath, filenames in walk_once(os.path.join(split_dir, name), loops):
            for f in filenames:
                if f.startswith("."):
                    continue
                path = os.path.join(dirpath, f)
                if f.lower().endswith(EXTENSIONS):
                    files.append((path, index[name]))
                    found += 1
                else:
                    bad.append((path, "not a photo by its name (expected .jpg, .jpeg, .png or .webp)"))
            if len(files) > budget:
                raise DataError(f"{os.path.dirname(split_dir)}: more than {MAX_IMAGES} photos: not read")
        if not found:
            bad.append((os.path.join(split_dir, name), "an empty class directory (no .jpg, .jpeg, .png or .webp)"))
    return classes, files, bad


def _jpeg_ends(path: str, size: int) -> bool:
    """Whether a JPEG file ends with its end-of-image marker (a truncated download does not);
    trailing bytes after it, as some cameras write, are allowed."""
    with open(path, "rb") as f:
        f.seek(max(0, size - 4096))
        return b"\xff\xd9" in f.read()


def check_header(path: str, limit: int | None = None) -> tuple[int, int, str]:
    """(width, height, format) of the photo at `path` from its header alone, after the file is
    bounded; BadImage saying why not. A photo of more than `limit` pixels (default pixel_limit())
    is refused as a decompression bomb; a JPEG must end with its end marker, a PNG's chunks must
    verify."""
    Image = pillow()
    try:
        st = os.stat(path)
    except OSError as e:
        raise BadImage(f"cannot be read: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise BadImage("not a regular file (a fifo, socket or device)")
    if st.st_size == 0:
        raise BadImage("an empty file (0 bytes)")
    if st.st_size > MAX_FILE_BYTES:
        raise BadImage(f"{st.st_size} bytes, more than the {MAX_FILE_BYTES >> 20} MB a photo file may have")
    try:
        with open_header(path, FORMATS, limit or pixel_limit()) as image:
            width, height, fmt, mode = image.width, image.height, image.format, image.mode
            if mode in WIDE_MODES:
                raise BadImage(f"mode {mode} ({'16' if '16' in mode else '32'}-bit); expected 8 bits a "
                               f"channel (convert it to 8 bits first)")
            if fmt == "PNG":
                image.verify()            # every chunk's CRC, to the end: a truncated file fails
        if fmt == "JPEG" and not _jpeg_ends(path, st.st_size):
            raise BadImage("a truncated JPEG (no end-of-image marker)")
    except BadImage:
        raise
    except Exception as e:                       # UnidentifiedImageError, SyntaxError, struct.error, ...
        raise BadImage(f"not a readable JPEG, PNG or WebP photo: {type(e).__name__}: {e}") from None
    return width, height, fmt


def _scan(paths, limit=None) -> list:
    out = []
    for path in paths:
        try:
            out.append((path, check_header(path, limit)))
        except BadImage as e:
            out.append((path, str(e)))
    return out


def scan_headers(paths, limit=None) -> list:
    """[(path, (width, height, format)) or (path, why)] in order: check_header on each (`limit`:
    its pixels); a large folder's in processes, one per usable core (nothing else runs yet: this
    is before training), as a header costs a file open and a read, and ImageNet has 1.3 million."""
    paths = list(paths)
    cores = usable_cores()
    if len(paths) < PARALLEL_SCAN or cores < 2:
        return _scan(paths, limit)
    chunks = [paths[i:i + SCAN_CHUNK] for i in range(0, len(paths), SCAN_CHUNK)]
    with ProcessPoolExecutor(max_workers=min(cores, 16), mp_context=multiprocessing.get_context("spawn")) as pool:
        return [row for rows in pool.map(_scan, chunks, [limit] * len(chunks)) for row in rows]


def bad_list(bad, root) -> str:
    """The first BAD_SHOWN bad entries as 'path: why' and a count of the rest."""
    shown = "; ".join(f"{path}: {why}" for path, why in bad[:BAD_SHOWN])
    more = f"; and {len(bad) - BAD_SHOWN} more" if len(bad) > BAD_SHOWN else ""
    return shown + more


# ---- the transforms ------------------------------------------------------------------------

def resize_box(width: int, height: int, resize: int, size: int) -> tuple[float, float, float, float]:
    """The box in the photo's pixels that Resize(resize) (the shorter side) then CenterCrop(size)
    keep, as torchvision computes them: the longer side int(resize * long / short), the crop's
    corner int(round((side - size) / 2))."""
    if width <= height:
        rw, rh = resize, int(resize * height / width)
    else:
        rw, rh = int(resize * width / height), resize
    top, left = int(round((rh - size) / 2.0)), int(round((rw - size) / 2.0))
    sx, sy = width / rw, height / rh
    return left * sx, top * sy, (left + size) * sx, (top + size) * sy


def random_resized_box(width: int, height: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """RandomResizedCrop.get_params: (left, top, right, bottom) of a box of 8-100 % of the area
    with an aspect ratio in 3/4-4/3 (log-uniform), ten tries, then the center crop of the whole
    photo clamped to those ratios."""
    area = width * height
    log_ratio = (math.log(RRC_RATIO[0]), math.log(RRC_RATIO[1]))
    for _ in range(10):
        target = area * rng.uniform(*RRC_SCALE)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return left, top, left + w, top + h
    in_ratio = width / height
    if in_ratio < RRC_RATIO[0]:
        w, h = width, int(round(width / RRC_RATIO[0]))
    elif in_ratio > RRC_RATIO[1]:
        w, h = int(round(height * RRC_RATIO[1])), height
    else:
        w, h = width, height
    top, left = (height - h) // 2, (width - w) // 2
    return left, top, left + w, top + h


def _draft_scale(box, size: int) -> int:
    """The largest of libjpeg's reduced scales (1, 2, 4, 8) that keeps the box at least `size`
    pixels a side."""
    shrink, scale = min(box[2] - box[0], box[3] - box[1]) / size, 1
    while scale < 8 and shrink >= 2 * scale:
        scale *= 2
    return scale


def _scaled_box(box, fx: float, fy: float):
    return box[0] * fx, box[1] * fy, box[2] * fx, box[3] * fy


_simplejpeg = []                # [module or None], once imported


def simplejpeg():
    """The `simplejpeg` module (the fast-jpeg extra) when it is installed, else None."""
    if not _simplejpeg:
        try:
            import simplejpeg as module
        except ImportError:
            module = None
        _simplejpeg.append(module)
    return _simplejpeg[0]


def _decode_jpeg_array(path: str, size: int, box_of, limit: int):
    """(uint8 (H, W, 3) array, box in its pixels) of a JPEG decoded by libjpeg-turbo through
    simplejpeg at the scale decode's draft picks; None where Pillow must do it (not a JPEG, a
    colour space other than YCbCr and grey such as CMYK, or an error, which Pillow then names or,
    for a warning libjpeg alone is strict about, decodes); BadImage past `limit` pixels, from the
    header, before a pixel is decoded. The pixels
    are Pillow's own: the same libjpeg-turbo, the same slow integer DCT and fancy upsampling.
    With the compiled resize after it, a training photo of the loader benchmark's folder at 224 px
    costs 1.7 ms against Pillow's 2.2 (one core of a shared 2-core EPYC)."""
    module = simplejpeg()
    if module is None:
        return None
    with open(path, "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if not data.startswith(b"\xff\xd8\xff") or len(data) > MAX_FILE_BYTES:
        return None
    try:
        height, width, colorspace, _ = module.decode_jpeg_header(data)
    except ValueError:
        return None
    if width * height > limit:
        raise BadImage(too_many_pixels(f"{width}x{height} = {width * height:,}", limit))
    try:
        if colorspace not in ("YCbCr", "Gray"):
            return None
        box = box_of(width, height)
        scale = _draft_scale(box, size)
        array = module.decode_jpeg(data, colorspace="RGB", min_width=math.ceil(width / scale),
                                   min_height=math.ceil(height / scale))
    except ValueError:
        return None
    return array, _scaled_box(box, array.shape[1] / width, array.shape[0] / height)


def decode(path: str, size: int, box_of, flip: bool = False, draft: bool = True,
           limit: int | None = None) -> np.ndarray:
    """uint8 (3, size, size): the photo at `path` converted to RGB, its box `box_of(width,
    height)` resized to size x size (bilinear, in uint8: Pillow's resize, or its arithmetic compiled
    in hetconv.data.resample), mirrored when `flip`. A JPEG whose box is at least twice the size
    asked for is decoded at a reduced scale (draft) that keeps the box at least `size` pixels a
    side; by simplejpeg where it is installed (_decode_jpeg_array: the same pixels). BadImage when
    it cannot be decoded, or has more than `limit` pixels (default pixel_limit(): one process), which
    its header says before anything is decoded."""
    Image = pillow()
    limit = limit or pixel_limit()
    drawn = {}

    def box_once(width, height):            # a random box is drawn once, whichever decoder takes the photo
        if (width, height) not in drawn:
            drawn[width, height] = box_of(width, height)
        return drawn[width, height]
    try:
        decoded = _decode_jpeg_array(path, size, box_once, limit) if draft else None
        if decoded is None:
            out = _decode_with_pillow(Image, path, size, box_once, draft, limit).transpose(2, 0, 1)
    except BadImage:
        raise
    except Exception as e:          # a truncated or corrupt stream, a file gone: Pillow's errors are many
        raise BadImage(f"cannot be decoded: {type(e).__name__}: {e}") from None
    if decoded is not None:
        # Pillow's resize, compiled: from simplejpeg's array without building a Pillow image of it
        # (a copy into 4-byte pixels) and written channels first (a copy fewer); of a Pillow image,
        # reading it out as an array would cost what this saves
        from hetconv.data.resample import resize_box    # imported by the processes that decode only
        out = resize_box(*decoded, size)                  # (3, S, S)
    return out[:, :, ::-1] if flip else out


def _decode_with_pillow(Image, path, size, box_of, draft, limit):
    with open_header(path, FORMATS, limit) as image:
        width, height = image.size
        box = box_of(width, height)
        if image.mode in WIDE_MODES:
            raise BadImage(f"mode {image.mode}; expected 8 bits a channel")
        scale = _draft_scale(box, size) if draft and image.format == "JPEG" else 1
        if scale > 1:
            # Pillow divides each side by the size asked for and rounds down: ask for the sides
            # rounded down, so an odd side still gets the scale (ceil(999 / 2) = 500 would
            # give 999 // 500 = 1, a full decode)
            image.draft("RGB", (width // scale, height // scale))
            box = _scaled_box(box, image.size[0] / width, image.size[1] / height)
        if image.mode != "RGB":
            image = image.convert("RGB")
        return np.asarray(image.resize((size, size), Image.BILINEAR, box=box))     # (S, S, 3)


def eval_image(path: str, size: int, limit: int | None = None) -> np.ndarray:
    """Evaluation's transform: Resize(round(size / 0.875)), CenterCrop(size); uint8 (3, S, S).
    `limit`: decode's pixel limit."""
    resize = eval_resize(size)
    return decode(path, size, lambda w, h: resize_box(w, h, resize, size), limit=limit)


def train_image(path: str, size: int, augment: tuple[str, ...], rng: np.random.Generator,
                limit: int | None = None) -> np.ndarray:
    """Training's transform of one photo with its own generator: random-resized-crop (else
    Resize(S) and CenterCrop(S)), then flip, then crop (4 pixels of padding); uint8 (3, S, S).
    `limit`: decode's pixel limit."""
    if "random-resized-crop" in augment:
        box_of = lambda w, h: random_resized_box(w, h, rng)      # noqa: E731 (drawn once the size is known)
    else:
        box_of = lambda w, h: resize_box(w, h, size, size)       # noqa: E731
    x = decode(path, size, box_of, limit=limit)
    if "flip" in augment and rng.random() < 0.5:
        x = x[:, :, ::-1]
    if "crop" in augment:
        p = CROP_PADDING
        oy, ox = rng.integers(0, 2 * p + 1, 2)
        padded = np.zeros((3, size + 2 * p, size + 2 * p), np.uint8)
        padded[:, p:p + size, p:p + size] = x
        x = padded[:, oy:oy + size, ox:ox + size]
    return x


def image_rng(seed: int, epoch: int, position: int) -> np.random.Generator:
    """The generator of the training photo at `position` in epoch `epoch`'s order."""
    return np.random.default_rng([_PHOTO_STREAM, seed, epoch, position])


# ---- the data set ----------------------------------------------------------------------------

class FileImages:
    """One split's photos as a read-only (N, 3, S, S) uint8 'array' decoded on use: x[i], x[a:b]
    and x[indices] decode with evaluation's transform. Holds paths, never pixels."""

    dtype = np.dtype(np.uint8)
    ndim = 4

    def __init__(self, files, size: int):
        self.files = list(files)
        self.size = size

    @property
    def shape(self):
        return (len(self.files), 3, self.size, self.size)

    def __len__(self):
        return len(self.files)

    def __getitem__(self, key):
        if isinstance(key, (int, np.integer)):
            return eval_image(self.files[key], self.size)
        picked = range(len(self.files))[key] if isinstance(key, slice) else np.asarray(key).ravel()
        out = np.empty((len(picked), 3, self.size, self.size), np.uint8)
        for i, j in enumerate(picked):
            out[i] = eval_image(self.files[j], self.size)
        return out

    def subset(self, keep) -> "FileImages":
        return FileImages([f for f, k in zip(self.files, keep) if k], self.size)

    def __array__(self, dtype=None, copy=None):
        x = self[:]
        return x if dtype is None else x.astype(dtype)


@dataclass
class PhotoSet(DataSet):
    """A DataSet whose train_x and test_x are FileImages: streamed, never held."""
    image_size: int = 0
    skipped: tuple = field(default_factory=tuple)       # (path, why) of the files left out at listing
    bad_images: str = "fail"                            # a photo that fails mid-run: "fail" or "skip"

    def meta(self) -> dict:
        return {**super().meta(), "photos": {"image_size": self.image_size, "eval_resize": eval_resize(self.image_size)}}

    def subset(self, keep_train, name=None):
        """This set with only the training photos where `keep_train` is True."""
        keep_train = np.asarray(keep_train, bool)
        return PhotoSet(self.name, self.train_x.subset(keep_train), self.train_y[keep_train], self.test_x,
                        self.test_y, self.classes, self.mean, self.std, self.notes, self.image_size, self.skipped,
                        self.bad_images)

    def __repr__(self) -> str:
        return (f"PhotoSet({self.name!r}, train={len(self.train_y)}, test={len(self.test_y)}, "
                f"classes={len(self.classes)}, image_size={self.image_size})")


@dataclass
class Survey:
    """What a photo folder holds, from its listing and headers, nothing decoded."""
    root: str
    classes: tuple
    split: str | None                        # "val", "test" or None: the evaluation split's directory
    train: list                              # [(path, label)] of the usable photos
    test: list
    bad: list                                # [(path, why)]
    headers: dict                            # path -> (width, height, format) of the usable photos
    loops: list = field(default_factory=list)    # directory links not followed (walk_once)


def survey(path, scan=None, loaders: int = 0, test_only: bool = False) -> Survey:
    """The photo folder at `path` listed and every photo's header checked (`scan`: a function of a
    list of paths and a pixel limit, as scan_headers), photos past the pixel limit of `loaders`
    processes (--loader-workers: 0 is auto) among the bad. `test_only` and a val/ or test/ split:
    train/ gives its class names only, its photos neither listed nor checked (an evaluation reads
    the test split alone). Refuses a folder with no train/ or no class directory."""
    root = os.fspath(path)
    if not os.path.isdir(os.path.join(root, "train")):
        raise DataError(f"{root}: a photo folder has train/<class>/ and val/<class>/ (or test/<class>/) directories; "
                        f"no train/")
    pillow(root)
    loops = []
    split = eval_split_dir(root)
    if test_only and split is not None:
        classes, _ = class_directories(os.path.join(root, "train"), None, "*.jpg|png|webp")
        train, bad = [], []
    else:
        classes, train, bad = list_split(os.path.join(root, "train"), None, loops=loops)
    test = []
    if split is not None:
        _, test, bad_test = list_split(os.path.join(root, split), classes, MAX_IMAGES - len(train), loops)
        bad += bad_test
    checked = (scan or scan_headers)([f for f, _ in train + test], pixel_limit(loader_processes(loaders)[0]))
    headers = {p: h for p, h in checked if not isinstance(h, str)}
    failed = {p: why for p, why in checked if isinstance(why, str)}
    bad += [(p, failed[p]) for p, _ in train + test if p in failed]
    return Survey(root, classes, split, [(p, y) for p, y in train if p in headers],
                  [(p, y) for p, y in test if p in headers], bad, headers, loops)


def load_photo_folder(path, image_size: int, bad_images: str = "fail", scan=None, loaders: int = 0,
                      test_only: bool = False) -> PhotoSet:
    """The photo folder at `path`, every file's header checked (survey; `loaders`: the
    --loader-workers that will decode it, which set the pixel limit; `test_only`: only the test
    split's, the set then has no training photos, see survey). bad_images "fail": DataError
    naming the bad files (the first ten, then a count); "skip": they are left out and a note says
    how many."""
    root = os.fspath(path)
    if bad_images not in ("fail", "skip"):
        raise ValueError(f"--bad-images must be 'fail' or 'skip', got {bad_images!r}")
    if not 1 <= image_size <= MAX_IMAGE_SIZE:
        raise ValueError(f"--image-size must be 1..{MAX_IMAGE_SIZE}, got {image_size}")
    found = survey(root, scan, loaders, test_only)
    train, test, bad, split = found.train, found.test, found.bad, found.split
    test_only = test_only and split is not None
    notes = [f"{root}: photos resized and cropped to {image_size}x{image_size} (evaluation: the shorter side to "
             f"{eval_resize(image_size)}, then the center); normalised with ImageNet's mean and std"]
    if found.loops:
        notes.append(f"{root}: {loops_note(found.loops)}")
    if bad:
        if bad_images == "fail":
            raise DataError(f"{root}: {len(bad)} bad file{'s' if len(bad) > 1 else ''} (--bad-images skip leaves them "
                            f"out): {bad_list(bad, root)}")
        notes.append(f"{root}: --bad-images skip: left out {len(bad)} bad file{'s' if len(bad) > 1 else ''}: "
                     f"{bad_list(bad, root)}")
        if not train and not test_only:
            raise DataError(f"{root}: no usable training photo is left")
        empty = [] if test_only else sorted(set(range(len(found.classes))) - {label for _, label in train})
        if empty:
            names = ", ".join(found.classes[i] for i in empty[:BAD_SHOWN]) + (" ..." if len(empty) > BAD_SHOWN else "")
            raise DataError(f"{os.path.join(root, 'train')}: {len(empty)} of the {len(found.classes)} classes left "
                            f"with no usable training photo by --bad-images skip ({names}): a network would have "
                            f"outputs for classes it never sees; add photos to them or remove their directories")
    if split is not None and not test:
        raise DataError(f"{os.path.join(root, split)}: no photos; expected {split}/<class>/*.jpg|png|webp (or no "
                        f"val/ and no test/, with --val-split)")
    name = os.path.basename(os.path.normpath(os.path.abspath(root))) or "photos"
    return PhotoSet(name, FileImages([p for p, _ in train], image_size), np.array([y for _, y in train], np.int64),
                    FileImages([p for p, _ in test], image_size), np.array([y for _, y in test], np.int64),
                    found.classes, IMAGENET_MEAN, IMAGENET_STD, tuple(notes), image_size, tuple(bad), bad_images)


def train_batch(files, size: int, augment: tuple[str, ...], seed: int, epoch: int, first: int,
                out: np.ndarray | None = None) -> np.ndarray:
    """uint8 (B, 3, S, S): training's transform of `files`, the epoch's photos at positions
    first, first + 1, ...; each with its own generator (image_rng), written into `out` where given."""
    if out is None:
        out = np.empty((len(files), 3, size, size), np.uint8)
    for k, path in enumerate(files):
        out[k] = train_image(path, size, augment, image_rng(seed, epoch, first + k))
    return out
