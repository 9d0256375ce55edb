"""How fast does hetconv's photo loader feed a step, against PyTorch's DataLoader with torchvision's
transforms doing the same work?

    python bench/make_photos.py /tmp/photos --train 2000 --val 200
    python bench/loader.py /tmp/photos --out bench/results/loader
    python bench/loader.py --render bench/results/loader/loader.json

Both sides load the same training photos with the training transform at --image-size (224):
random-resized-crop then horizontal flip, batches of --batch-size (32) in a shuffled order, with
--workers (2) loader processes, and hand the step a batch of float32 normalised images:

- hetconv: PhotoLoader (hetconv/data/loader.py), the loader a run uses: uint8 in shared memory,
  normalised where the step takes the batch;
- torch: DataLoader(num_workers, persistent_workers=True, shuffle=True, drop_last=True) over the
  same files, each opened as ImageFolder's loader does (Image.open, convert("RGB")), then
  RandomResizedCrop(S), RandomHorizontalFlip(), ToTensor(), Normalize(ImageNet's): the
  ImageNet example's pipeline;
- torch uint8: the same with PILToTensor() and no Normalize (uint8 batches; the float conversion
  left to the step, not timed here): the lightest torchvision pipeline.

Cases run in alternating rounds. Each round first takes, untimed, the batches the case's processes
decoded ahead while the other cases ran (2 x workers on either side), then times --batches batches.
A row gives the median images/s over rounds, and the images per CPU-second of the main process
and its loader processes together (the per-core rate: what a core spent on loading buys), and
the foreign load (cores busy with processes not ours, from /proc/stat) during its rounds. The
machine is shared: read the ratios within a round.

torchvision need not be installed where it can be imported from a folder: --torchvision PATH.
"""
import argparse
import os
import statistics
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

BLAS_NOTE = _common.reexec_without_blas_overrides()

import numpy as np  # noqa: E402

STEM = "loader"
CASES = ("hetconv", "torch", "torch uint8")
TICK = os.sysconf("SC_CLK_TCK")


def import_torchvision(path):
    """torchvision.transforms (v1, PIL-based), from `path` when given; a torchvision built for
    another torch may fail to register its compiled ops, which these transforms do not use."""
    if path:
        sys.path.insert(0, path)
        sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))
    import torchvision
    import torchvision.transforms as T
    return torchvision, T


def cpu_s(pid):
    """utime + stime of process `pid` (all its threads), seconds; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def busy_s():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / TICK


def endless(make_epoch):
    epoch = 0
    while True:
        yield from make_epoch(epoch)
        epoch += 1


class Case:
    """A loader kept open over every round, its batches as one endless stream."""

    def __init__(self, stream, pids, ahead, close):
        self.stream, self.pids, self.ahead, self.close = stream, pids, ahead, close

    def round(self, batches):
        for _ in range(self.ahead):                  # decoded while the other cases ran: not timed
            next(self.stream)
        pids = self.pids()
        cpu0 = time.process_time() + sum(cpu_s(p) for p in pids)
        busy0, t0 = busy_s(), time.perf_counter()
        images = 0
        for _ in range(batches):
            x, y = next(self.stream)
            images += len(y)
        wall = time.perf_counter() - t0
        ours = time.process_time() + sum(cpu_s(p) for p in pids) - cpu0
        return {"images": images, "wall_s": wall, "cpu_s": ours,
                "foreign_cores": max(0.0, (busy_s() - busy0 - ours) / wall), "dtype": str(x.dtype)}


def open_cases(args, T, torch):
    from hetconv.data.loader import PhotoLoader
    from hetconv.data.photos import IMAGENET_MEAN, IMAGENET_STD, load_photo_folder
    ds = load_photo_folder(args.data, args.image_size)
    files, labels = ds.train_x.files, ds.train_y
    cases = {}
    loader = PhotoLoader(ds, args.batch_size, ("random-resized-crop", "flip"), seed=0, workers=args.workers)
    cases["hetconv"] = Case(endless(loader.epoch), lambda: [p.pid for p in loader.workers], loader.slots, loader.close)
    pipelines = {
        "torch": T.Compose([T.RandomResizedCrop(args.image_size), T.RandomHorizontalFlip(), T.ToTensor(),
                            T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]),
        "torch uint8": T.Compose([T.RandomResizedCrop(args.image_size), T.RandomHorizontalFlip(), T.PILToTensor()]),
    }
    for name, transform in pipelines.items():
        dl = torch.utils.data.DataLoader(_common.PhotoFiles(files, labels, transform), batch_size=args.batch_size,
                                         shuffle=True, num_workers=args.workers, drop_last=True,
                                         persistent_workers=True)
        state = {}

        def epoch(_, dl=dl, state=state):
            state["it"] = iter(dl)
            return state["it"]
        cases[name] = Case(endless(epoch), lambda state=state: [w.pid for w in state["it"]._workers],
                           2 * args.workers, lambda: None)          # prefetch_factor 2 a worker
    return ds, cases


STAGES = ("open, header, box", "generator", "draft", "decode", "resize", "resize, reducing_gap 2",
          "to array, slot copy")


def profile(ds, size, count):
    """ms an image in each stage of hetconv's training transform (photos.decode's steps, taken apart),
    in this process on the first `count` training photos, and of the normalisation the main process
    does (a batch of 32, per image). The resize is also timed with reducing_gap=2 (Image.reduce first)."""
    import math
    from PIL import Image
    from hetconv.data.photos import image_rng, random_resized_box
    spent = dict.fromkeys(STAGES, 0.0)
    drafted = 0
    slot = np.empty((32, 3, size, size), np.uint8)
    files = ds.train_x.files[:count]
    clock = time.process_time
    for i, path in enumerate(files):
        t0 = clock()
        rng = image_rng(0, 0, i)
        t1 = clock()
        image = Image.open(path, formats=("JPEG", "PNG", "WEBP"))
        width, height = image.size
        box = random_resized_box(width, height, rng)
        t2 = clock()
        shrink, scale = min(box[2] - box[0], box[3] - box[1]) / size, 1
        while scale < 8 and shrink >= 2 * scale:
            scale *= 2
        if scale > 1 and image.format == "JPEG":
            drafted += 1
            image.draft("RGB", (math.ceil(width / scale), math.ceil(height / scale)))
            fx, fy = image.size[0] / width, image.size[1] / height
            box = (box[0] * fx, box[1] * fy, box[2] * fx, box[3] * fy)
        t3 = clock()
        image.load()
        t4 = clock()
        out = image.resize((size, size), Image.BILINEAR, box=box)
        t5 = clock()
        image.resize((size, size), Image.BILINEAR, box=box, reducing_gap=2.0)
        t6 = clock()
        slot[i % 32] = np.asarray(out).transpose(2, 0, 1)
        t7 = clock()
        image.close()
        for stage, seconds in zip(STAGES, (t2 - t1, t1 - t0, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t7 - t6)):
            spent[stage] += seconds
    ms = {stage: spent[stage] / len(files) * 1e3 for stage in STAGES}
    t0, reps = clock(), 10
    for _ in range(reps):
        ds.normalize(slot)
    ms["normalise (main process)"] = (clock() - t0) / reps / len(slot) * 1e3
    return {"photos": len(files), "drafted": drafted, "ms_per_image": ms}


def jpeg_decoder():
    """Which decoder hetconv's loader processes give JPEGs to (hetconv.data.photos.simplejpeg)."""
    from hetconv.data.photos import simplejpeg
    module = simplejpeg()
    return (f"hetconv's JPEGs: simplejpeg {module.__version__}" if module is not None else
            "hetconv's JPEGs: Pillow (simplejpeg not installed)")


def run(args):
    started, load_start = time.time(), _common.load_average()
    import torch
    torch.set_num_threads(1)               # the main process only unpacks batches; workers take 1 each
    torchvision, T = import_torchvision(args.torchvision)
    ds, cases = open_cases(args, T, torch)
    import json
    made = os.path.join(args.data, "made.json")
    doc = {**_common.run_facts("loader.py", sys.argv[1:], started, load_start),
           "blas_note": BLAS_NOTE,
           "versions": [*_common.torch_info(torch)[:1], f"torchvision {torchvision.__version__}",
                        f"Pillow {__import__('PIL').__version__}", jpeg_decoder()],
           "data": {"train": len(ds.train_y), "classes": len(ds.classes),
                    "made": json.load(open(made)) if os.path.exists(made) else None},
           "image_size": args.image_size, "batch_size": args.batch_size, "workers": args.workers,
           "batches": args.batches, "rounds": []}
    if args.profile:
        doc["profile"] = profile(ds, args.image_size, args.profile)
    try:
        for name in CASES:                                  # burn-in: processes started, imports, caches
            cases[name].round(2)
        for r in range(args.rounds):
            order = CASES if r % 2 == 0 else CASES[::-1]
            doc["rounds"].append({name: cases[name].round(args.batches) for name in order})
            print(f"round {r}: " + ", ".join(f"{n} {row['images'] / row['wall_s']:.1f} img/s"
                                             for n, row in doc["rounds"][-1].items()), flush=True)
    finally:
        for case in cases.values():
            case.close()
    doc["rows"] = summarise(doc["rounds"])
    if args.out:
        _common.save_run(args.out, STEM, doc, started, markdown)
    else:
        print(markdown(doc))


def summarise(rounds):
    rows = {}
    for name in CASES:
        rates = [r[name]["images"] / r[name]["wall_s"] for r in rounds]
        per_core = [r[name]["images"] / r[name]["cpu_s"] for r in rounds]
        rows[name] = {"images_s": statistics.median(rates), "images_s_all": rates,
                      "images_per_cpu_s": statistics.median(per_core),
                      "cpu_cores": statistics.median(r[name]["cpu_s"] / r[name]["wall_s"] for r in rounds),
                      "foreign_cores": statistics.median(r[name]["foreign_cores"] for r in rounds),
                      "dtype": rounds[0][name]["dtype"]}
    for name in CASES:                          # hetconv over each: the median of the per-round ratios
        rows[name]["hetconv_over"] = statistics.median(
            (r["hetconv"]["images"] / r["hetconv"]["wall_s"]) / (r[name]["images"] / r[name]["wall_s"]) for r in rounds)
    return rows


def markdown(doc):
    rows = doc["rows"]
    made = (doc["data"].get("made") or {})
    src = ("Pillow-drawn scenes, not photographs" if made.get("drawn") else
           f"photographs: random crops of {len(made.get('photos', []))} sample photos of scikit-image and "
           f"scikit-learn, shorter side {made['shorter_side_px']['min']}-{made['shorter_side_px']['max']} px "
           f"(median {made['shorter_side_px']['median']:.0f})") if made else "a photo folder"
    lines = ["# The photo loader against PyTorch's DataLoader", "", *_common.run_header(doc),
             f"ISA: {doc['isa']}. {'; '.join(doc['versions'])}. BLAS env: {doc['blas_note']}.", "",
             f"{doc['data']['train']} training photos in {doc['data']['classes']} classes ({src}); "
             f"random-resized-crop to {doc['image_size']} and flip, batches of {doc['batch_size']}, "
             f"{doc['workers']} loader processes each, {len(doc['rounds'])} alternating rounds of "
             f"{doc['batches']} batches.", ""]
    table = [[name, f"{r['images_s']:.1f}", " ".join(f"{v:.0f}" for v in r["images_s_all"]),
              f"{r['images_per_cpu_s']:.1f}", f"{r['cpu_cores']:.2f}", r["dtype"], f"{r['hetconv_over']:.2f}",
              f"{r['foreign_cores']:.2f}"] for name, r in rows.items()]
    lines.append(_common.markdown_table(
        ["loader", "images/s (median)", "per round", "images per CPU-second", "cores used", "batch", "hetconv / it",
         "foreign load (cores)"], table))
    lines += ["", "images per CPU-second: the images of a round over the CPU time of the main process and its "
              "loader processes in it (the per-core rate). hetconv / it: the median over rounds of hetconv's "
              "images/s over the row's, taken in the same round. torch: ToTensor + Normalize in the workers "
              "(float32 batches, as hetconv's); torch uint8: PILToTensor, no normalisation (uint8 batches)."]
    prof = doc.get("profile")
    if prof:
        ms = prof["ms_per_image"]
        shown = [s for s in ms if s != "resize, reducing_gap 2"]
        lines += ["", f"Where hetconv's time goes, ms an image (one process, CPU time, the first {prof['photos']} "
                  f"photos, {prof['drafted']} of them decoded at a reduced scale by Image.draft; the pipeline's stages "
                  f"are {sum(ms[s] for s in shown):.2f} ms in all):", "",
                  _common.markdown_table(list(ms), [[f"{v:.3f}" for v in ms.values()]]),
                  "", "resize, reducing_gap 2: the same resize with Image.reduce first (an alternative, not in the "
                  "sum); normalise: the main process's uint8 -> float32 of a batch, per image."]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", nargs="?", help="a photo folder (bench/make_photos.py makes one)")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2, help="loader processes, each side")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batches", type=int, default=20, help="batches timed a round, each case")
    p.add_argument("--profile", type=int, default=300, help="time the stages of hetconv's transform on this many "
                                                              "photos first (0: not)")
    p.add_argument("--torchvision", default=None, help="a folder to import torchvision from")
    p.add_argument("--out", default=None, help="write OUT/loader.json and .md (else print)")
    p.add_argument("--render", default=None, help="rewrite the .md beside a saved loader.json")
    args = p.parse_args()
    if args.render:
        print(f"wrote {_common.render_saved(args.render, STEM, markdown)}")
        return
    if not args.data:
        p.error("give a photo folder (or --render)")
    run(args)


if __name__ == "__main__":
    main()
