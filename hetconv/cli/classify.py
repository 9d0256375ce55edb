"""hetconv-classify: the classes a checkpoint's model gives images, with their probabilities.

    hetconv-classify runs/a cat.png dog.jpg --top 3

Images are JPEG, PNG or WebP files, read with Pillow (pip install 'hetconv[images]'), of any
size. A model trained on a photo folder (--image-size S) sees each photo as its run's evaluation
did: the shorter side resized to round(S / 0.875), then the center S x S. For any other model, an
image of the network's input size (or of the data set's, when the run trained on centre crops,
--crop) is taken as it is, and one of another size is resized and center-cropped the same way to
the data set's (square) size. Grey and colour images are converted to the network's channel count
(1: grey, 3: RGB; an alpha channel is dropped). Pixels are normalised with the data set's mean and
std stored in the checkpoint.
"""
import json
import sys

import numpy as np

from hetconv.data.photos import BadImage, eval_image
from hetconv.flags import OneLineParser, add_version
from hetconv.training.trained_model import InProcessModel, ModelError, load_model, log_softmax

IMAGES_INSTALL = "pip install 'hetconv[images]' (in a checkout: pip install -e '.[images]')"
FORMATS = ("PNG", "JPEG", "WEBP")
FORMAT_NAMES = "JPEG, PNG or WebP"
MODES = {1: "L", 3: "RGB"}               # network channels -> the Pillow mode its images are read in
EIGHT_BIT_MODES = ("1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr", "La")


def _pillow():
    try:
        from PIL import Image
    except ImportError:
        raise ModelError(f"reading images needs Pillow, which is not installed: {IMAGES_INSTALL}") from None
    return Image


def read_image(path, model):
    """uint8 (C, H, W) of the image at `path` for the model: as it is where it has the size the
    model takes, else resized and center-cropped as the run's evaluation does (photos.eval_image).
    Only the header is read before the size is known, and Pillow's pixel limit bounds it."""
    Image = _pillow()
    channels, height, width = model.spec.input_shape
    if channels not in MODES:
        raise ModelError(f"the network takes {channels}-channel images; image files give 1 (grey) or 3 (RGB)")
    sizes = [(height, width)]
    data_hw = tuple(model.data["image_shape"][1:])
    if data_hw != (height, width):
        sizes.append(data_hw)                     # the run trained on centre crops of these
    photos = model.data.get("photos")
    try:
        with Image.open(path, formats=FORMATS) as img:
            if img.mode not in EIGHT_BIT_MODES:
                raise ModelError(f"{path}: Pillow mode {img.mode!r}, expected 8 bits per channel (grey or colour)")
            if not isinstance(photos, dict) and (img.height, img.width) in sizes:
                pixels = np.asarray(img.convert(MODES[channels]), np.uint8)
            elif data_hw[0] != data_hw[1]:
                accepted = " or ".join(f"{w}x{h}" for h, w in sizes)
                raise ModelError(f"{path}: the image is {img.width}x{img.height} (width x height), the network takes "
                                 f"{accepted} and its data set's images are not square; resize it first")
            else:
                pixels = None
        if pixels is None:
            rgb = eval_image(str(path), data_hw[0]).transpose(1, 2, 0)     # (S, S, 3)
            pixels = rgb if channels == 3 else np.asarray(Image.fromarray(rgb).convert("L"), np.uint8)
    except ModelError:
        raise
    except BadImage as e:
        raise ModelError(f"{path}: not a {FORMAT_NAMES} image Pillow can read ({e})") from None
    except FileNotFoundError:
        raise ModelError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ModelError(f"{path}: a directory, expected an image file") from None
    except Exception as e:                         # Pillow's UnidentifiedImageError, a truncated file, ...
        raise ModelError(f"{path}: not a {FORMAT_NAMES} image Pillow can read "
                         f"({type(e).__name__}: {e})") from None
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    return np.ascontiguousarray(pixels.transpose(2, 0, 1))        # (H, W, C) -> (C, H, W)


def top_classes(model, probabilities, k):
    """[(class name, probability)] of the k most probable classes, most probable first (ties by
    class index, as argmax breaks them)."""
    order = np.argsort(-probabilities, kind="stable")[:k]
    return [(model.classes[i], float(probabilities[i])) for i in order]


def build_parser():
    p = OneLineParser(prog="hetconv-classify",
                      description="Label JPEG, PNG or WebP images with a checkpoint's model, in this process: the most "
                                  "probable classes of each image and their probabilities.",
                      epilog="An image that cannot be used (unreadable, or of another shape where the network's is not square) is reported in one "
                             "line on stderr and the others are still classified. Exit status: 0 when every image "
                             "was classified; 1 when some were and any other was refused; 2 when none was (a bad "
                             "checkpoint or option, or every image refused).")
    p.add_argument("checkpoint", metavar="CHECKPOINT_OR_DIR",
                   help="a checkpoint file, or a directory (its newest valid checkpoint)")
    p.add_argument("images", metavar="IMAGE", nargs="+", help="JPEG, PNG or WebP files, of any size")
    p.add_argument("--top", type=int, default=3, metavar="K", help="classes shown per image")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for the conv layers (0: every usable core)")
    p.add_argument("--json", action="store_true", help="print one JSON object per classified image")
    return add_version(p)


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        if args.threads < 0:
            raise ModelError(f"--threads must be >= 0, got {args.threads}")
        _pillow()
        model = load_model(args.checkpoint)
        if not 1 <= args.top <= len(model.classes):
            raise ModelError(f"--top must be 1..{len(model.classes)} (the model's classes), got {args.top}")
    except ModelError as e:
        print(f"hetconv-classify: {e}", file=sys.stderr)
        return 2
    for note in model.notes:
        print(f"hetconv-classify: note: {note}", file=sys.stderr)
    # each image on its own: one that cannot be used is named and the rest still classified
    paths, inputs = [], []
    for path in args.images:
        try:
            # cropped one by one: a crop-trained network takes images of either size
            inputs.append(model.crop(model.normalize(read_image(path, model)[None])))
            paths.append(path)
        except ModelError as e:
            print(f"hetconv-classify: {e}", file=sys.stderr)
    if not paths:
        return 2
    runner = InProcessModel(model, threads=args.threads or None)
    probabilities = np.exp(log_softmax(runner.logits(np.concatenate(inputs))))
    for path, p in zip(paths, probabilities):
        top = top_classes(model, p, args.top)
        if args.json:
            print(json.dumps({"image": path, "top": [{"class": name, "probability": prob} for name, prob in top]}))
        else:
            print(f"{path}: " + ", ".join(f"{name} {prob:.3f}" for name, prob in top))
    return 1 if len(paths) < len(args.images) else 0


if __name__ == "__main__":
    sys.exit(main())
