"""ResNet-50 on photos at 224 px, batch 32: a training step of hetconv on one device with 2 threads
(`--local --threads 2`) and on two one-thread workers (`--spawn cpu:1,cpu:1`), beside PyTorch's
step of the same network on the same 2 cores, fp32, in alternating rounds.

    python bench/resnet50.py --photos /tmp/photos --out bench/results/photos
    python bench/resnet50.py --image-size 64 --steps 2 --rounds 1 --out /tmp/r50   # a smoke run

hetconv trains `--net resnet50` (torchvision's ImageNet ResNet-50: 7x7 stride-2 stem, max-pool, v1.5
bottlenecks) on a photo folder (`--data DIR --image-size 224`; one loader process, default transforms:
resize and center crop), SGD with momentum; a row's number is the median `step_s` of its run's
steps after the first two (the first times the conv paths, once per machine: the wisdom is kept
for the later rounds), with the loader's wait beside it. The workers' rounds run the plan their
first run calibrated (`--plan` its metrics), as a user repeating a run would. PyTorch trains the module hetconv exports
for the same preset (`to_torch`, the same layers and state_dict keys as torchvision's resnet50) on a
fixed batch of 32 random images in memory (no loader: its number is the step alone), 2 threads,
torch.optim.SGD with momentum, in NCHW and in channels_last, and is compared by the faster.
Without `--photos`, a folder is made with bench/make_photos.py (the sample photographs inside
scikit-image's and scikit-learn's wheels given by --source, or the installed packages).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402
import _torch_twin as T  # noqa: E402

STEM = "resnet50"
HETCONV = {"hetconv local 2 threads": ["--local", "--threads", "2"],
           "hetconv 2 workers x 1 thread": ["--spawn", "cpu:1,cpu:1", "--threads", "1", "--use-all"]}
TORCH_STEP = os.path.join(HERE, "_torch_step.py")


def hetconv_row(args, flags, work, cache, steps):
    """One hetconv run: its steps' seconds (all of them) and loader waits."""
    metrics = os.path.join(work, f"m{time.monotonic_ns()}.jsonl")
    cmd = [sys.executable, "-m", "hetconv.cli.coordinator", "--data", args.photos, "--image-size", str(args.image_size),
           "--net", "resnet50", "--batch-size", str(args.batch_size), "--steps", str(steps), "--loader-workers", "1",
           "--eval-batches", "1", "--metrics", metrics, *flags]
    env = dict(os.environ, HETCONV_CACHE=cache)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in open(metrics)]
    steps = [r for r in records if r["event"] == "step"]
    return {"step_s": [r["step_s"] for r in steps], "data_wait_s": [r.get("data_wait_s", 0.0) for r in steps],
            "loss": steps[-1]["loss"], "metrics": metrics}


def torch_row(args, layout, work):
    out = os.path.join(work, f"t{time.monotonic_ns()}.json")
    env = dict(os.environ, OMP_NUM_THREADS="2")
    done = subprocess.run([sys.executable, TORCH_STEP, "--preset", "resnet50", "--image-size", str(args.image_size),
                           "--batch", str(args.batch_size), "--steps", str(args.steps + 2), "--layout", layout,
                           "--out", out], env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"PyTorch row ({layout}) failed:\n{done.stderr[-3000:]}")
    with open(out) as f:
        got = json.load(f)
    return {"step_s": got["seconds"], "loss": got["loss"]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(HERE, "results", "photos"))
    p.add_argument("--photos", default="", help="a photo folder (train/<class>/...); default: one made here")
    p.add_argument("--source", action="append", default=[], help="for the folder made here: as make_photos.py's")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=3, help="timed steps per run (after two not timed)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800, help="seconds one run may take")
    args = p.parse_args(argv)
    started, load_start = time.time(), _common.load_average()
    import torch
    rows = {name: [] for name in [*HETCONV, *(T.layout_config("torch fp32", layout) for layout in T.LAYOUTS)]}
    extra = {name: {} for name in rows}
    with tempfile.TemporaryDirectory() as work:
        if not args.photos:
            args.photos = os.path.join(work, "photos")
            import make_photos
            make_photos.main([args.photos, "--train", str(args.batch_size * (args.steps + 2) * 2), "--val", "32",
                              *sum((["--source", s] for s in args.source), [])])
        cache = os.path.join(work, "wisdom")
        flags_of = dict(HETCONV)
        for name, flags in HETCONV.items():     # the conv paths timed once, as a second run on a machine finds them
            first = hetconv_row(args, flags, work, cache, 1)
            if "--spawn" in flags:              # the rounds run this plan (--plan): calibrated once, not each round
                flags_of[name] = [*flags, "--plan", first["metrics"]]
        for rnd in range(args.rounds):
            order = list(rows) if rnd % 2 == 0 else list(rows)[::-1]
            for name in order:
                if name in HETCONV:
                    got = hetconv_row(args, flags_of[name], work, cache, args.steps + 2)
                else:
                    got = torch_row(args, T.layout_of(name)[1], work)
                timed = got["step_s"][2:]
                rows[name].extend(timed)
                extra[name].setdefault("data_wait_s", []).extend(got.get("data_wait_s", [0.0] * len(got["step_s"]))[2:])
                extra[name]["loss"] = got["loss"]
                print(f"round {rnd + 1} {name}: {statistics.median(timed):.3f} s", flush=True)
    medians = {name: statistics.median(s) for name, s in rows.items()}
    torch_mode = T.faster_layout(medians, "torch fp32")
    doc = {"machine": _common.cpu_model(), "isa": _common.cpu_isa_flags(), "blas": _common.blas_info(),
           "torch": _common.torch_info(torch), "image_size": args.image_size, "batch_size": args.batch_size,
           "rounds": args.rounds, "steps": args.steps, "photos": args.photos, "medians_s": medians,
           "samples_s": rows, "data_wait_s": {n: e.get("data_wait_s") for n, e in extra.items()},
           "losses": {n: e.get("loss") for n, e in extra.items()}, "torch_compared": torch_mode,
           "load": [load_start, _common.load_average()], "wall_s": time.time() - started,
           "command": _common.recorded_command("resnet50.py", sys.argv[1:] if argv is None else argv)}
    table = _common.markdown_table(
        ["run", "median step (s)", "loader wait (s)", f"x {torch_mode}", "steps timed"],
        [[name, f"{medians[name]:.3f}",
          f"{statistics.median(extra[name]['data_wait_s']):.3f}" if name in HETCONV else "(in memory)",
          f"{medians[torch_mode] / medians[name]:.2f}x", len(rows[name])] for name in rows])
    markdown = "\n".join([
        f"Machine: {doc['machine']}, {doc['isa']}; {doc['blas']}; {doc['torch']}. Command: `{doc['command']}` "
        f"({doc['wall_s'] / 60:.1f} min; {load_start} at start, {doc['load'][1]} at end).", "",
        f"ResNet-50 at {args.image_size} px, batch {args.batch_size}, fp32, SGD with momentum; {args.rounds} alternating "
        f"rounds of {args.steps} timed steps each (after 2 not timed). `x {torch_mode}` is PyTorch's faster layout's "
        f"step over the row's (above 1: the row is faster).", "", table, "",
        T.layout_note(medians, "torch fp32")])
    _common.write_results(args.out, STEM, doc, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
