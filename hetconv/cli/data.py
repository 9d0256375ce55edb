"""hetconv-data: what a data set holds, and how fast its training loader feeds a step.

    hetconv-data ~/imagenet                                   # classes, photos per split, sizes, formats, bad files
    hetconv-data ~/imagenet --image-size 224 --augment random-resized-crop,flip --bench

A photo folder is surveyed from its listing and headers only (nothing decoded): its classes, the
photos of each split, a histogram of their shorter sides and of their formats, and the files that
cannot be used, as a run would name them. Any other data set is loaded and summarised.

--bench times the training loader alone, with the run's flags (--image-size, --batch-size,
--augment, --loader-workers, --seed): batches decoded, transformed and normalised as the run's
first epoch takes them, the first one (the processes' start) left out of the timing. Its last
line ends in images/s.
"""
import os
import sys
import time
from collections import Counter

from hetconv.data import DataError, load_dataset
from hetconv.data.base import loops_note
from hetconv.data.loader import open_loader
from hetconv.data.photos import bad_list, survey
from hetconv.flags import OneLineParser, add_version
from hetconv.training.config import Config, add_config_flags

SIDE_BINS = (64, 128, 256, 512, 1024)            # shorter-side histogram edges, pixels
BENCH_FLAGS = ("image_size", "batch_size", "augment", "loader_workers", "bad_images", "seed")


def side_bin(side):
    lower = 0
    for edge in SIDE_BINS:
        if side < edge:
            return f"{lower}-{edge - 1}"
        lower = edge
    return f">={SIDE_BINS[-1]}"


def describe_photos(root, out, loaders=0):
    """A photo folder's survey as lines on `out` (photos past the pixel limit of `loaders`
    processes, --loader-workers, among the bad files); returns the survey."""
    found = survey(root, loaders=loaders)
    classes = found.classes
    if found.loops:
        out(f"{root}: {loops_note(found.loops)}")
    shown = ", ".join(classes[:10]) + (f", ... ({len(classes) - 10} more)" if len(classes) > 10 else "")
    out(f"{root}: a photo folder of {len(classes)} classes: {shown}")
    for name, files in (("train", found.train), (found.split or "val/test", found.test)):
        per_class = Counter(label for _, label in files)
        if files:
            low, high = min(per_class.values()), max(per_class.values())
            out(f"  {name}/: {len(files)} photos, {low} to {high} a class"
                + (f", {len(classes) - len(per_class)} classes with none" if len(per_class) < len(classes) else ""))
        else:
            out(f"  {name}/: none" + ("" if found.split else " (no val/ or test/: a run needs --val-split)"))
    sides = Counter(side_bin(min(w, h)) for w, h, _ in found.headers.values())
    order = [side_bin(edge - 1) for edge in SIDE_BINS] + [side_bin(SIDE_BINS[-1])]
    out("  shorter side: " + ", ".join(f"{b} px {sides[b]}" for b in order if sides[b]))
    formats = Counter(fmt for _, _, fmt in found.headers.values())
    out("  formats: " + ", ".join(f"{fmt} {n}" for fmt, n in formats.most_common()))
    if found.bad:
        out(f"  bad files: {len(found.bad)} (a run refuses the folder; --bad-images skip leaves them out): "
            f"{bad_list(found.bad, root)}")
    else:
        out("  bad files: none")
    return found


def describe_other(spec, out):
    ds = load_dataset(spec)
    out(f"{spec}: {ds!r}; images {'x'.join(map(str, ds.image_shape))}; classes: "
        + ", ".join(ds.classes[:10]) + (" ..." if len(ds.classes) > 10 else ""))


def bench(cfg, batches, out):
    """Time the training loader of `cfg` over `batches` batches (after one untimed); returns images/s."""
    ds = load_dataset(cfg.data, **cfg.dataset_options())
    for note in ds.notes:
        out(note)
    steps = len(ds.train_y) // cfg.batch_size
    if steps < 2:
        raise DataError(f"--bench needs at least 2 batches of {cfg.batch_size}; {cfg.data} has {len(ds.train_y)} "
                        f"training images")
    timed = min(batches, steps - 1) if batches else steps - 1
    loader = open_loader(ds, cfg.batch_size, cfg.augment_kinds(), cfg.seed, cfg.loader_workers, log=out)
    try:
        stream = loader.epoch(0)
        next(stream)                                  # the processes' start and first batch: not timed
        start = time.perf_counter()
        images = 0
        for _, (_, y) in zip(range(timed), stream):
            images += len(y)
        seconds = time.perf_counter() - start
    finally:
        loader.close()
    rate = images / seconds
    out(f"training loader: {timed} batches of {cfg.batch_size} in {seconds:.2f}s: {rate:.1f} images/s")
    return rate


def build_parser():
    p = OneLineParser(prog="hetconv-data",
                      description="Describe a data set (a photo folder from its listing and headers: classes, photos "
                                  "per split, sizes, formats, bad files); --bench times its training loader alone.")
    p.add_argument("data", metavar="DATA", help="a data set, as hetconv-coordinator --data takes it")
    p.add_argument("--bench", action="store_true", help="time the training loader with the run's flags; the last "
                                                        "line ends in images/s")
    p.add_argument("--bench-batches", type=int, default=50, help="batches timed by --bench (0: one epoch; default: "
                                                                 "%(default)s)")
    group = add_config_flags(p, names=BENCH_FLAGS, title="the run's data flags (for --bench)")
    for action in group._group_actions:          # the run's defaults, which --bench times when not given
        action.help += " (default: %(default)r)" if isinstance(action.default, str) else " (default: %(default)s)"
    return add_version(p)


def main(argv=None):
    args = build_parser().parse_args(argv)
    out = print
    try:
        if args.bench_batches < 0:
            raise ValueError(f"--bench-batches must be >= 0, got {args.bench_batches}")
        cfg = Config(data=args.data, **{name: getattr(args, name) for name in BENCH_FLAGS}).validate()
        if args.bench:
            if args.data != "synthetic" and not cfg.image_size and _is_photo_folder(args.data):
                raise ValueError("--bench on a folder of photos needs --image-size S (the run's)")
            bench(cfg, args.bench_batches, out)
        elif _is_photo_folder(args.data):
            describe_photos(args.data, out, cfg.loader_workers)
        else:
            describe_other(args.data, out)
    except (DataError, ValueError, OSError) as e:
        print(f"hetconv-data: {e}", file=sys.stderr)
        return 2
    return 0


def _is_photo_folder(spec):
    return spec != "synthetic" and os.path.isdir(os.path.join(spec, "train"))


if __name__ == "__main__":
    sys.exit(main())
