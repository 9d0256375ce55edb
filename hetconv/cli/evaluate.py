"""hetconv-eval: a checkpoint's network on a data set's test split, in this process (a photo
folder's photos decoded in loader processes).

    hetconv-eval runs/a                        # the newest valid checkpoint, on the data the run used
    hetconv-eval runs/a --data cifar-10-batches-py --json
    hetconv-eval runs/a --tta flip             # each image's logits averaged with its mirror's

The model is read back and run by train.trained_model (`load_model`, `InProcessModel`), as for
hetconv-classify and hetconv-export; no worker is needed.

A checkpoint written before checkpoints kept the network and the data set's meta is still read:
its network comes from the run's paper-family flags (--conv, --fc, --ksize, --padding, --crop)
and its data meta is CIFAR-10's class names and normalisation, which every run of that time used;
each assumption is reported as a note.
"""

import json
import sys

from tqdm.auto import tqdm

from hetconv.data.loader import PhotoLoader
from hetconv.data.photos import MAX_IMAGE_SIZE, FileImages, loader_processes
from hetconv.flags import OneLineParser, add_version
from hetconv.training.trained_model import TTA, InProcessModel, ModelError, evaluate, load_model, load_test_data


def render(result):
    tta = "" if result["tta"] == "none" else f", test-time augmentation {result['tta']}"
    lines = [f"{result['checkpoint']} (step {result['step']}) on {result['data']}: {result['images']} test images{tta}",
             f"loss {result['loss']:.4f}  accuracy {result['accuracy']:.4f} ({result['correct']}/{result['images']})",
             "per class:"]
    width = max(len(c["class"]) for c in result["per_class"])
    for c in result["per_class"]:
        acc = "   -  " if c["accuracy"] is None else f"{c['accuracy']:.4f}"
        lines.append(f"  {c['class']:<{width}}  {acc} ({c['correct']}/{c['images']})")
    lines.append("confusion (rows: true class, columns: predicted, in the order above):")
    cell = max(len(str(v)) for row in result["confusion"] for v in row) + 1
    for c, row in zip(result["per_class"], result["confusion"]):
        lines.append(f"  {c['class']:<{width}} " + "".join(f"{v:>{cell}}" for v in row))
    return "\n".join(lines)


def build_parser():
    p = OneLineParser(prog="hetconv-eval",
                      description="Evaluate a checkpoint on a data set's test split in this process (no workers): "
                                  "loss, accuracy, per-class accuracy and the confusion matrix.")
    p.add_argument("checkpoint", metavar="CHECKPOINT_OR_DIR",
                   help="a checkpoint file, or a directory (its newest valid checkpoint)")
    p.add_argument("--data", default="", help="the data set (as hetconv-coordinator --data; default: the one the "
                                              "run trained on)")
    p.add_argument("--batch-size", type=int, default=256, help="images per forward pass")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for the conv layers (0: every usable core)")
    p.add_argument("--tta", choices=TTA, default="none",
                   help="test-time augmentation: 'flip' averages the logits of each image and of its left-right "
                        "mirror (twice the work)")
    p.add_argument("--loader-workers", type=int, default=0,
                   help="processes that decode a photo folder's photos (0: auto, a quarter of the usable cores; "
                        "more than the usable cores: capped to them)")
    p.add_argument("--image-size", type=int, default=0,
                   help="read --data as a folder of photos of any size, resized and cropped to S x S as a run's "
                        "evaluation does (0: as the run read its data; S must be the model's input size)")
    p.add_argument("--bad-images", choices=("fail", "skip"), default=None,
                   help="a photo folder's unreadable test photos: 'fail' refuses naming them, 'skip' leaves them "
                        "out (default: the run's --bad-images)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return add_version(p)


def check_args(args):
    """The flags' values, checked before the checkpoint is read: ModelError naming the flag."""
    if args.batch_size < 1:
        raise ModelError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.threads < 0:
        raise ModelError(f"--threads must be >= 0, got {args.threads}")
    if args.loader_workers < 0:
        raise ModelError(f"--loader-workers must be >= 0, got {args.loader_workers}")
    if not 0 <= getattr(args, "image_size", 0) <= MAX_IMAGE_SIZE:
        raise ModelError(f"--image-size must be 0..{MAX_IMAGE_SIZE}, got {args.image_size}")


def evaluation(model, ds, args):
    """hetconv-eval's result (what --json prints) of `model` on the test split of `ds`, read with
    load_test_data, per the flags `args`; a progress bar on stderr while it runs. A photo folder's
    photos are decoded in loader processes, batches ahead of the forward pass, as a run's are."""
    runner = InProcessModel(model, threads=args.threads or None)
    loader = None
    if isinstance(ds.test_x, FileImages):
        workers, capped = loader_processes(getattr(args, "loader_workers", 0))
        if capped:
            print(f"hetconv-eval: {capped}", file=sys.stderr)
        loader = PhotoLoader(ds, args.batch_size, workers=workers)
    try:
        batches = loader.test_batches(raw=True) if loader is not None else None
        with tqdm(total=len(ds.test_y), unit="img", disable=None, file=sys.stderr, leave=False) as bar:
            result = evaluate(model, runner, ds.test_x, ds.test_y, args.batch_size, bar, tta=args.tta, batches=batches)
    finally:
        if loader is not None:
            loader.close()
    return {"checkpoint": model.path, "step": model.step, "data": args.data or model.config.get("data")
            or model.data.get("name"), "tta": args.tta, **result}


def main(argv=None):

    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        model = load_model(args.checkpoint)
        ds = load_test_data(model, args.data, args.image_size, args.bad_images, args.loader_workers)
    except ModelError as e:
        print(f"hetconv-eval: {e}", file=sys.stderr)
        return 2
    for note in model.notes:
        print(f"hetconv-eval: note: {note}", file=sys.stderr)
    result = evaluation(model, ds, args)
    print(json.dumps(result) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
