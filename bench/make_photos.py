"""A folder of real photographs of varied sizes for the loader benchmarks: OUT/train/<class>/*.jpg and
OUT/val/<class>/*.jpg, each a random crop (a random part of a source photo at a random aspect) saved
as a JPEG at a random size, as a photo folder a user trains on is (ImageNet's average photo is about
400x350, its shorter sides mostly 333-500 px).

    python bench/make_photos.py /tmp/photos --train 2000 --val 200
    python bench/make_photos.py /tmp/photos --source /path/to/scikit_image-*.whl --source /path/to/scikit_learn-*.whl

The sources are the sample photographs that scikit-image (skimage/data: astronaut, chelsea, coffee,
motorcycles, rocket, retina, hubble, ...) and scikit-learn (china.jpg, flower.jpg) ship inside
their packages, so nothing is downloaded: taken from the installed packages, or read straight out
of their wheels (`pip download --no-deps scikit-image scikit-learn`) given as --source, or from a
folder of photos. One class per source photo. Only colour photographs are used (the grey and
synthetic test images are left out). With no source at all the photos are Pillow-drawn scenes
(gradients, shapes and noise), which JPEG compresses unlike photographs: the folder's made.json
says which it was, and a benchmark on such a folder should say so.

Nothing here is committed: the folder is made where it is needed, from a seed.
"""
import argparse
import io
import json
import os
import sys
import zipfile

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

# colour photographs among the packages' sample images (the rest are grey, drawings or test patterns)
PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "motorcycle_left.png", "motorcycle_right.png",
          "rocket.jpg", "retina.jpg", "hubble_deep_field.jpg", "ihc.png", "china.jpg", "flower.jpg")
SHORT_SIDE = (160, 720)          # the made photo's shorter side, drawn log-uniform
ASPECT = (0.6, 1.8)              # width / height, log-uniform (portrait and landscape)
CROP_AREA = (0.25, 1.0)          # the part of the source photo each one shows
QUALITY = (75, 95)


def photos_from_dir(path):
    return {name: Image.open(os.path.join(path, name)).convert("RGB") for name in PHOTOS
            if os.path.exists(os.path.join(path, name))}


def photos_from_wheel(path):
    found = {}
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            name = os.path.basename(info.filename)
            if name in PHOTOS and ("/data/" in info.filename or "/images/" in info.filename):
                found[name] = Image.open(io.BytesIO(z.read(info))).convert("RGB")
    return found


def installed_photos():
    """(photos, where) from the installed scikit-image and scikit-learn, where there are any."""
    found, where = {}, []
    try:
        import skimage.data
        found.update(photos_from_dir(os.path.dirname(skimage.data.__file__)))
        where.append("scikit-image (installed)")
    except ImportError:
        pass
    try:
        import sklearn.datasets
        found.update(photos_from_dir(os.path.join(os.path.dirname(sklearn.datasets.__file__), "images")))
        where.append("scikit-learn (installed)")
    except ImportError:
        pass
    return found, where


def drawn_scene(rng, size=900):
    """A Pillow-drawn stand-in for a photograph: a sky-to-ground gradient, blurred shapes, noise."""
    top, bottom = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
    t = np.linspace(0, 1, size)[:, None, None]
    img = (top * (1 - t) + bottom * t) * np.ones((1, size, 1))
    image = Image.fromarray(img.astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(8, 30))):
        x, y = rng.integers(0, size, 2)
        r = int(rng.integers(20, size // 3))
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x - r, y - r, x + r, y + r), fill=color)
    image = image.filter(ImageFilter.GaussianBlur(float(rng.uniform(1, 4))))
    noise = rng.normal(0, 8, (size, size, 3))
    return Image.fromarray(np.clip(np.asarray(image) + noise, 0, 255).astype(np.uint8))


def log_uniform(rng, low, high):
    return float(np.exp(rng.uniform(np.log(low), np.log(high))))


def random_photo(source, rng):
    """A random crop of `source` (CROP_AREA of it at a random aspect) resized to a random size."""
    aspect = log_uniform(rng, *ASPECT)
    short = log_uniform(rng, *SHORT_SIDE)
    w_out, h_out = (round(short * aspect), round(short)) if aspect >= 1 else (round(short), round(short / aspect))
    sw, sh = source.size
    area = rng.uniform(*CROP_AREA) * sw * sh
    cw = min(sw, round(np.sqrt(area * aspect)))
    ch = min(sh, round(cw / aspect))
    cw = min(cw, round(ch * aspect))
    left, top = int(rng.integers(0, sw - cw + 1)), int(rng.integers(0, sh - ch + 1))
    return source.resize((w_out, h_out), Image.BICUBIC, box=(left, top, left + cw, top + ch))


def make(out, sources, train, val, seed):
    rng = np.random.default_rng(seed)
    names = sorted(sources)
    sizes = []
    for split, count in (("train", train), ("val", val)):
        for i in range(count):
            name = names[i % len(names)]
            cls = os.path.splitext(name)[0]
            os.makedirs(os.path.join(out, split, cls), exist_ok=True)
            photo = random_photo(sources[name], rng)
            photo.save(os.path.join(out, split, cls, f"{i:06d}.jpg"), quality=int(rng.integers(*QUALITY)))
            sizes.append(photo.size)
    return np.array(sizes)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the folder to make (train/ and val/ inside); must not hold a train/ yet")
    p.add_argument("--train", type=int, default=2000, help="training photos")
    p.add_argument("--val", type=int, default=200, help="evaluation photos")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--source", action="append", default=[],
                   help="a wheel of scikit-image or scikit-learn, or a folder holding their sample photos "
                        "(repeatable); default: the installed packages")
    p.add_argument("--drawn", action="store_true", help="Pillow-drawn scenes, not photographs")
    args = p.parse_args(argv)
    if os.path.exists(os.path.join(args.out, "train")):
        p.error(f"{args.out}/train exists: give a new folder")
    sources, where = {}, []
    if not args.drawn:
        for src in args.source:
            got = photos_from_wheel(src) if src.endswith(".whl") else photos_from_dir(src)
            sources.update(got)
            where.append(f"{os.path.basename(src)} ({len(got)} photos)")
        if not args.source:
            sources, where = installed_photos()
    if not sources:
        if not args.drawn:
            print("no sample photographs found (neither scikit-image nor scikit-learn, no --source): "
                  "making Pillow-drawn scenes instead, which are not photographs", file=sys.stderr)
        rng = np.random.default_rng([args.seed, 1])
        sources = {f"scene{i}.png": drawn_scene(rng) for i in range(10)}
        where = ["Pillow-drawn scenes (not photographs)"]
    sizes = make(args.out, sources, args.train, args.val, args.seed)
    short = sizes.min(axis=1)
    facts = {"sources": where, "photos": sorted(sources), "drawn": where[0].startswith("Pillow-drawn"),
             "train": args.train, "val": args.val, "seed": args.seed,
             "shorter_side_px": {"min": int(short.min()), "median": float(np.median(short)), "max": int(short.max())},
             "mean_size_px": [float(sizes[:, 0].mean()), float(sizes[:, 1].mean())]}
    with open(os.path.join(args.out, "made.json"), "w") as f:
        json.dump(facts, f, indent=1)
    print(f"{args.out}: {args.train} train + {args.val} val JPEGs in {len(sources)} classes from {', '.join(where)}; "
          f"shorter side {short.min()}-{short.max()} px (median {np.median(short):.0f})")


if __name__ == "__main__":
    main()
