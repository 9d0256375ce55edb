"""Does hetconv train on a folder of photos as well as PyTorch with torchvision's transforms? Top-1
accuracy on the folder's val/ after the same recipe, by hetconv with two spawned one-thread CPU
workers and by PyTorch in one process, for several seeds.

    pip download --no-deps -d /tmp/wheels scikit-image scikit-learn    # the sample photos, if not installed
    python bench/photo_accuracy.py --source /tmp/wheels/scikit_image-*.whl --source /tmp/wheels/scikit_learn-*.whl \\
        --torchvision /tmp/tvpath --out bench/results/photos          # 3 seeds, ~15-20 min on 2 cores
    python bench/photo_accuracy.py --render bench/results/photos/photo_accuracy.json

The photos: bench/make_photos.py's folder, made in a scratch folder with --photos-seed (or
--photos DIR, an existing folder): random crops at random sizes of the sample
photographs scikit-image and scikit-learn ship (from the installed packages or the wheels given
as --source), one class per source photo (11 with both wheels; motorcycle_left and
motorcycle_right are the two views of one stereo pair). Without either package the photos are
Pillow-drawn scenes, and the table says so.

Per seed both sides start from the same weights and train with the same recipe:
- the weights are hetconv's own start for that seed (bench/_torch_twin.py), handed to hetconv's
  training and to PyTorch through hetconv.net.torch_import.to_torch;
- the recipe: --epochs over the training photos in batches of --batch-size (the last partial
  batch dropped), SGD with momentum, weight decay on weights and not on biases, the rate annealed
  to 0 on a cosine over every step;
- hetconv: the photo loader (--loader-workers processes) with --augment random-resized-crop,flip
  at --image-size S, evaluation's Resize(round(S / 0.875)) and CenterCrop(S);
- PyTorch: torch.utils.data.DataLoader (the same number of worker processes) over the same files,
  opened as ImageFolder does, with torchvision's RandomResizedCrop(S), RandomHorizontalFlip(),
  ToTensor() and Normalize (ImageNet's mean and std, as hetconv's photo folders) for training,
  Resize(round(S / 0.875)), CenterCrop(S) for evaluation; its order and crops from
  torch.manual_seed(seed). The two runs share the recipe, not the batches or the random crops.
Both evaluate on val/ after every epoch, BatchNorm on its running statistics.

Writes OUT/photo_accuracy.json (every run's per-epoch accuracy, the plan, the machine, the load)
and OUT/photo_accuracy.md, rendered from the JSON alone.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402
import _torch_twin  # noqa: E402
from _speedup_common import ForeignLoad  # noqa: E402

STEM = "photo_accuracy"
AUGMENT = "random-resized-crop,flip"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--photos", default="", help="an existing photo folder (default: make one with make_photos.py)")
    p.add_argument("--source", action="append", default=[],
                   help="make_photos.py's --source: a wheel of scikit-image or scikit-learn, or a folder of their "
                        "sample photos (repeatable; default: the installed packages)")
    p.add_argument("--train", type=int, default=1100, help="training photos to make (100 a class)")
    p.add_argument("--val", type=int, default=330, help="evaluation photos to make (30 a class)")
    p.add_argument("--photos-seed", type=int, default=0, help="make_photos.py's --seed")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--net", default="resnet18@0.125")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--spawn", default="cpu,cpu", help="hetconv's workers, as hetconv-coordinator --spawn")
    p.add_argument("--loader-workers", type=int, default=1, help="photo-decoding processes, each side")
    p.add_argument("--torch-threads", type=int, default=2, help="torch.set_num_threads for the PyTorch runs")
    p.add_argument("--torchvision", default=None, help="a folder to import torchvision from")
    p.add_argument("--out", default="", help="folder for photo_accuracy.json and .md (default: print only)")
    p.add_argument("--render", default="", help="rewrite the .md beside a saved photo_accuracy.json")
    return p.parse_args(argv)


def make_config(args, photos, seed, metrics="", plan=""):
    from hetconv.training.config import Config
    return Config(data=photos, image_size=args.image_size, augment=AUGMENT, loader_workers=args.loader_workers,
                  net=args.net, batch_size=args.batch_size, epochs=args.epochs, lr=args.lr, momentum=args.momentum,
                  weight_decay=args.weight_decay, schedule="cosine", seed=seed, metrics=metrics, plan=plan).validate()


def make_photo_folder(args, scratch):
    """args.photos, or a folder bench/make_photos.py makes in `scratch`; -> (path, its made.json or None)."""
    if args.photos:
        path = args.photos
    else:
        import make_photos
        path = os.path.join(scratch, "photos")
        argv = [path, "--train", str(args.train), "--val", str(args.val), "--seed", str(args.photos_seed)]
        for source in args.source:
            argv += ["--source", source]
        make_photos.main(argv)
    made = os.path.join(path, "made.json")
    return path, (json.load(open(made)) if os.path.exists(made) else None)


def run_hetconv(args, photos, seed, ds, loaded, scratch, plan=""):
    """hetconv's training with --spawn's workers and its photo loader, from `loaded`'s weights; -> a
    row. `plan`: an earlier run's metrics file whose plan it runs (--plan), instead of calibrating
    one (about 50 s on the shared 2 cores); the plan decides where work runs, not what it computes."""
    metrics = os.path.join(scratch, f"hetconv-seed{seed}.jsonl")
    cfg = make_config(args, photos, seed, metrics, plan)
    summary, wall, evals, plan, steps = _common.train_on_spawned_workers(cfg, args.spawn, dataset=ds, network=loaded)
    return {"framework": "hetconv", "seed": seed, "top1": summary["test_accuracy"], "test_loss": summary["test_loss"],
            "val_images": summary["test_images"], "final_loss": summary["final_loss"], "steps": summary["step"],
            "epoch_top1": [r["test_accuracy"] for r in evals],
            "modes": [layer["mode"] for layer in plan["layers"]], "workers": plan["workers"],
            "plan_from": "an earlier seed's run" if cfg.plan else "calibrated",
            "median_step_s": statistics.median(r["step_s"] for r in steps), "wall_s": wall}


def run_torch(args, photos, seed, ds, module, torch, T):
    """The same recipe in PyTorch with torchvision's transforms on `module` (trained in place); -> a row."""
    from hetconv.data.photos import IMAGENET_MEAN, IMAGENET_STD, eval_resize
    cfg = make_config(args, photos, seed)
    size = args.image_size
    torch.manual_seed(seed)                        # the loader's order and its workers' random crops
    train_tf = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(),
                          T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    eval_tf = T.Compose([T.Resize(eval_resize(size)), T.CenterCrop(size), T.ToTensor(),
                         T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    workers = args.loader_workers
    train_dl = torch.utils.data.DataLoader(_common.PhotoFiles(ds.train_x.files, ds.train_y, train_tf), batch_size=cfg.batch_size,
                                           shuffle=True, drop_last=True, num_workers=workers,
                                           persistent_workers=workers > 0)
    val_dl = torch.utils.data.DataLoader(_common.PhotoFiles(ds.test_x.files, ds.test_y, eval_tf), batch_size=cfg.batch_size,
                                         num_workers=workers, persistent_workers=workers > 0)
    opt = _torch_twin.sgd(torch, module, cfg)
    steps_per_epoch = len(ds.train_y) // cfg.batch_size
    # stepped after every update, as hetconv's schedule counts updates (hetconv.training.schedule)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs * steps_per_epoch)
    epoch_top1, step_s, loss = [], [], None
    t0 = time.perf_counter()
    for _ in range(cfg.epochs):
        module.train()
        for x, y in train_dl:
            t_step = time.perf_counter()
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(module(x), y)
            loss.backward()
            opt.step()
            scheduler.step()
            step_s.append(time.perf_counter() - t_step)
        epoch_top1.append(evaluate(torch, module, val_dl)[0])
    top1, test_loss, seen = evaluate(torch, module, val_dl)
    return {"framework": "pytorch", "seed": seed, "top1": top1, "test_loss": test_loss, "val_images": seen,
            "final_loss": float(loss.item()), "steps": cfg.epochs * steps_per_epoch, "epoch_top1": epoch_top1,
            "median_step_s": statistics.median(step_s), "wall_s": time.perf_counter() - t0}


def evaluate(torch, module, loader):
    """(top-1, mean cross-entropy, images) on val/, BatchNorm on its running statistics."""
    module.eval()
    correct = seen = 0
    loss = 0.0
    with torch.no_grad():
        for x, y in loader:
            logits = module(x).double()
            correct += int((logits.argmax(1) == y).sum())
            loss += float(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
            seen += len(y)
    return correct / seen, loss / seen, seen


def summarize(doc):
    """Per framework: mean, sample standard deviation, min and max of top-1 over the seeds; the
    difference of the means in points."""
    out = {}
    for fw in ("hetconv", "pytorch"):
        top1 = [r["top1"] for r in doc["rows"] if r["framework"] == fw]
        if top1:
            out[fw] = {"mean": statistics.fmean(top1), "std": statistics.stdev(top1) if len(top1) > 1 else 0.0,
                       "min": min(top1), "max": max(top1), "runs": len(top1)}
    if len(out) == 2:
        out["mean_points"] = 100.0 * (out["hetconv"]["mean"] - out["pytorch"]["mean"])
    return out


def photos_text(made):
    if not made:
        return "a given photo folder"
    if made.get("drawn"):
        return "Pillow-drawn scenes, not photographs"
    short = made["shorter_side_px"]
    return (f"random crops of {len(made['photos'])} sample photographs of scikit-image and scikit-learn, one class "
            f"each, shorter side {short['min']}-{short['max']} px (median {short['median']:.0f})")


def markdown(doc):
    r = doc["recipe"]
    s = summarize(doc)
    lines = ["# Training on a photo folder: hetconv against PyTorch with torchvision's transforms", "",
             *_common.run_header(doc),
             f"ISA: {doc['isa']}. BLAS: {doc['blas']}. PyTorch: {doc['torch']}. {doc['torchvision']}.", "",
             f"Photos: {doc['data']['train']} training and {doc['data']['val']} val photos in "
             f"{doc['data']['classes']} classes ({photos_text(doc['data']['made'])}). `--net {r['net']}` at "
             f"{r['image_size']}x{r['image_size']}, `--augment {AUGMENT}`, batch {r['batch_size']}, {r['epochs']} "
             f"epochs ({r['steps']} steps), SGD lr {r['lr']:g} momentum {r['momentum']:g}, weight decay "
             f"{r['weight_decay']:g} except biases, cosine learning rate. hetconv: `--spawn {r['spawn']}` "
             f"(`--parallel auto`, calibrated for seed 0, that plan run by the later seeds), {r['loader_workers']} loader "
             f"process(es). PyTorch: the same network from the same "
             f"start (to_torch), a DataLoader with {r['loader_workers']} worker(s) and torchvision's "
             f"RandomResizedCrop, RandomHorizontalFlip, ToTensor, Normalize; evaluation Resize "
             f"{round(r['image_size'] / 0.875)}, CenterCrop {r['image_size']}; torch.set_num_threads("
             f"{r['torch_threads']}). Each seed's two starts differ on val/ by at most "
             f"{max(doc['start_logit_diff'].values()):.1e} in a logit. The two sides share the recipe, "
             f"not the batches or the random crops.", ""]
    summary = [[fw, s[fw]["runs"], f"{100 * s[fw]['mean']:.2f}", f"{100 * s[fw]['std']:.2f}",
                f"{100 * s[fw]['min']:.2f}-{100 * s[fw]['max']:.2f}"] for fw in ("hetconv", "pytorch") if fw in s]
    lines.append(_common.markdown_table(["framework", "seeds", "top-1 % (mean)", "std (points)", "min-max %"],
                                        summary))
    if "mean_points" in s:
        lines += ["", f"**hetconv - PyTorch: {s['mean_points']:+.2f} points of mean top-1** (one val photo is "
                      f"{100 / doc['rows'][0]['val_images']:.2f} points)."]
    table = [[row["framework"], row["seed"], f"{100 * row['top1']:.2f}",
              " ".join(f"{100 * a:.1f}" for a in row["epoch_top1"]), f"{row['test_loss']:.4f}",
              f"{row['final_loss']:.4f}", "".join(m[0].upper() for m in row.get("modes", [])) or "-",
              f"{1e3 * row['median_step_s']:.0f}", f"{row['wall_s']:.0f}", f"{row['foreign_load_cores']:.2f}"]
             for row in doc["rows"]]
    lines += ["", _common.markdown_table(
        ["framework", "seed", "top-1 %", "after each epoch %", "val loss", "last training loss",
         "modes (M model, D data)", "median step ms", "wall s", "foreign load (cores)"], table)]
    lines += ["", "std: the sample standard deviation over seeds. A step is timed as each side's training step on a "
              "shared host, one run after the other: not a speed comparison. Foreign load: cores' worth of CPU "
              "that other processes used while the run went."]
    return "\n".join(lines)


def import_torchvision(path):
    """torchvision.transforms (v1, PIL-based), from `path` when given (as bench/loader.py does)."""
    import types
    if path:
        sys.path.insert(0, path)
        sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))
    import torchvision
    import torchvision.transforms as T
    return torchvision, T


def main(argv):
    args = parse_args(argv)
    if args.render:
        print(f"wrote {_common.render_saved(args.render, STEM, markdown)}")
        return 0
    started, load_start = time.time(), _common.load_average()
    import torch
    from hetconv.data import load_dataset
    from hetconv.net import LoadedNet
    from hetconv.net.torch_import import to_torch
    from hetconv.training.loop import network_for
    torch.set_num_threads(args.torch_threads)
    torchvision, T = import_torchvision(args.torchvision)
    doc = {"recipe": {"net": args.net, "image_size": args.image_size, "spawn": args.spawn,
                      "batch_size": args.batch_size, "epochs": args.epochs, "lr": args.lr, "momentum": args.momentum,
                      "weight_decay": args.weight_decay, "loader_workers": args.loader_workers,
                      "torch_threads": args.torch_threads},
           "torchvision": f"torchvision {torchvision.__version__}, Pillow {__import__('PIL').__version__}",
           "seeds": list(range(args.seeds)), "rows": [], "start_logit_diff": {}}
    with tempfile.TemporaryDirectory(prefix="hetconv-photo-accuracy-") as scratch:
        photos, made = make_photo_folder(args, scratch)
        for seed in range(args.seeds):
            cfg = make_config(args, photos, seed)
            ds = load_dataset(cfg.data, **cfg.dataset_options())
            spec = network_for(cfg, ds).spec
            conv, fc = _torch_twin.initial_weights(cfg, spec)
            doc["data"] = {"train": len(ds.train_y), "val": len(ds.test_y), "classes": len(ds.classes), "made": made}
            doc["recipe"]["steps"] = cfg.epochs * (len(ds.train_y) // cfg.batch_size)
            module = to_torch(spec, conv, fc)
            doc["start_logit_diff"][seed] = start_logit_diff(spec, conv, fc, module, ds, cfg.batch_size)
            for run in ("hetconv", "pytorch"):
                print(f"[seed {seed}] {run} ... ({_common.load_average()})", flush=True)
                with ForeignLoad() as load:
                    row = (run_hetconv(args, photos, seed, ds, LoadedNet(spec, _torch_twin.copied(conv, fc)), scratch,
                                       plan=os.path.join(scratch, "hetconv-seed0.jsonl") if seed else "")
                           if run == "hetconv" else run_torch(args, photos, seed, ds, module, torch, T))
                row.update(foreign_load_cores=load.cores, load_after=_common.load_average())
                doc["rows"].append(row)
                print(f"    top-1 {row['top1']:.4f} (by epoch {', '.join(f'{a:.3f}' for a in row['epoch_top1'])}), "
                      f"{row['wall_s']:.0f} s", flush=True)
    doc.update(_common.run_facts("photo_accuracy.py", argv, started, load_start),
               torch="; ".join(_common.torch_info(torch)))
    _common.save_or_print(args.out, STEM, doc, markdown)
    return 0


def start_logit_diff(spec, conv, fc, module, ds, batch_size):
    """The largest |logit| difference on the first val batch between hetconv's network at these
    weights and the PyTorch module made from them (bench/accuracy.py's check, on photos)."""
    import accuracy
    from hetconv.data import DataSet
    x = ds.test_x[0:batch_size]
    small = DataSet(ds.name, x, ds.test_y[:batch_size], x, ds.test_y[:batch_size], ds.classes, ds.mean, ds.std)
    return accuracy.check_same_start(spec, conv, fc, module, small, batch_size)


if __name__ == "__main__":
    print(_common.reexec_without_blas_overrides())
    sys.exit(main(sys.argv[1:]))
