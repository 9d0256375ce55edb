"""ImageNet-scale networks on one device: torchvision's ResNet-50 and MobileNetV2 (bench/imagenet_nets.py,
a user's file) at 160 px, batch 32, a training step of hetconv `--local --threads 2` beside PyTorch's
step of the same module on the same 2 cores, in alternating rounds.

    python bench/imagenet.py --out bench/results/imagenet
    python bench/imagenet.py --nets resnet50 --rounds 2 --steps 4 --out /tmp/r50     # a quicker look
    python bench/imagenet.py --render bench/results/imagenet/imagenet.json

Rows, each a process of its own, run once a round in an order that rotates from round to round:
- `hetconv fp32` and `hetconv auto`: `hetconv-coordinator --local --threads 2 --net FILE:NET` with
  `--precision fp32` / `auto`, on a .npz of random uint8 images made once (the same for every row),
  SGD with momentum; the row's number is the median `step_s` of its run's steps after the first
  two (the first run of each precision times the conv paths: the wisdom, in a folder of this bench
  run's own, is kept for the later rounds, as on a user's machine);
- `torch fp32 (NCHW)` and `torch fp32 (channels_last)`: the same module in PyTorch, 2 threads,
  torch.optim.SGD with momentum, on the same images (as float32 normalised the same way), the
  median of its steps after the first two; and `torch bf16 autocast (...)` where the CPU has bf16
  instructions (avx512_bf16 or AMX), which is where a user would choose it.
hetconv's rows are compared with PyTorch's faster fp32 layout, `hetconv auto` also with PyTorch's
best mode on this CPU (bf16 autocast counts only where the CPU has bf16 instructions).

Every child runs at the highest priority this process may give (a session of its own whose
scheduling group is niced to -20, where /proc/self/autogroup can be written), so that other work on
a shared host takes less of its cores; the results say whether it could.
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

STEM = "imagenet"
NETS_FILE = os.path.join(HERE, "imagenet_nets.py")
NETS = ("resnet50", "mobilenet_v2")
HETCONV_ROWS = {"hetconv fp32": "fp32", "hetconv auto": "auto"}
BF16_ISA = ("avx512_bf16", "amx_tile")

TORCH_STEP = os.path.join(HERE, "_torch_step.py")


# --profile: where a step's time goes, by kind of work. hetconv's side wraps the device methods each
# kind runs through (a fused BatchNorm + activation counts as BatchNorm), PyTorch's is its profiler's
# self time per operator, both summed over the timed steps and divided by their number.
HETCONV_PROFILE = """
import collections, json, sys, time
sys.path.insert(0, sys.argv[1])
from hetconv.devices.cpu import CpuDevice, HostArrays
from hetconv.engine.graph import GraphPass
from hetconv.net.head import Network
from hetconv.engine.shard import ConvShard
from hetconv.cli import coordinator
spent = collections.Counter()
stack = []
def conv_form(w):
    k, cin_per_group, kh, kw = w.shape
    if cin_per_group == 1 and k > 1:
        return "(depthwise)"
    return "(1x1)" if kh == kw == 1 else f"({kh}x{kw})"
def timed(kind, f, outermost=False):
    def call(*args, **kwargs):
        if outermost:                           # the whole step: the kinds inside it count apart
            t0 = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                spent[kind] += time.perf_counter() - t0
        if stack:                               # nested: the outer call's kind has it
            return f(*args, **kwargs)
        stack.append(kind)
        named = kind + " " + conv_form(args[2]) if kind.startswith("conv") else kind   # (self, x or ctx, w, ...)
        t0 = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            spent[named] += time.perf_counter() - t0
            stack.pop()
    return call
KINDS = {"conv forward": ["conv_block"], "conv backward": ["conv_block_backward"],
         "batchnorm forward": ["channel_sums", "batchnorm_apply"],
         "batchnorm backward": ["batchnorm_grad_sums", "batchnorm_backward"],
         "activation": ["activation", "activation_backward"], "pool": ["pool", "pool_backward"],
         "update": ["sgd_", "adamw_", "accumulate_"]}
for cls in (CpuDevice, HostArrays):
    for kind, names in KINDS.items():
        for name in names:
            if hasattr(cls, name):
                setattr(cls, name, timed(kind, getattr(cls, name)))
GraphPass._node_forward = timed("joins (add, concat)", GraphPass._node_forward)
GraphPass._node_backward = timed("joins (add, concat)", GraphPass._node_backward)
Network.train_step = timed("whole step", Network.train_step, outermost=True)
steps, warmup, out = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
seen = []
original = Network.train_step
def counted(*a, **k):
    if len(seen) == warmup:
        spent.clear()
    seen.append(1)
    return original(*a, **k)
Network.train_step = counted
coordinator.main(sys.argv[5:])
with open(out, "w") as f:
    per_step = {k: v / (steps - warmup) for k, v in spent.items()}
    per_step["other"] = per_step["whole step"] - sum(v for k, v in per_step.items() if k != "whole step")
    json.dump(per_step, f)
"""

def profile_rows(net, data, steps, warmup, batch, cache, workdir):
    """{row: {kind: seconds a step}} for hetconv fp32 and PyTorch's two fp32 layouts."""
    rows = {}
    out = os.path.join(workdir, f"profile-{net}-hetconv.json")
    script = os.path.join(workdir, "hetconv_profile.py")
    with open(script, "w") as f:
        f.write(HETCONV_PROFILE)
    args = ["--local", "--threads", "2", "--data", data, "--net", f"{NETS_FILE}:{net}", "--batch-size", str(batch),
            "--steps", str(steps), "--eval-every", "0", "--augment", "none"]
    cmd, _ = prioritized([sys.executable, script, _common.REPO, str(steps), str(warmup), out, *args])
    done = subprocess.run(cmd, env=dict(os.environ, HETCONV_CACHE=cache), capture_output=True, text=True,
                          timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"hetconv profile {net} failed: {done.stderr[-2000:]}")
    with open(out) as f:
        rows["hetconv fp32"] = json.load(f)
    for layout in T.LAYOUTS:
        out = os.path.join(workdir, f"profile-{net}-{layout}.json")
        cmd, _ = prioritized([sys.executable, TORCH_STEP, "--module", f"imagenet_nets:{net}", "--data", data,
                              "--steps", str(steps), "--layout", layout, "--profile", str(warmup), "--out", out])
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise SystemExit(f"torch profile {net} {layout} failed: {done.stderr[-2000:]}")
        with open(out) as f:
            rows[T.layout_config("torch fp32", layout)] = json.load(f)
    return rows


def prioritized(cmd):
    """`cmd` run in a session of its own whose scheduling group is niced to -20 (the kernel's
    autogroups share the CPU between sessions, so a process's own nice alone decides nothing
    against another session's work), and niced to -19 itself; as it is where that is refused."""
    try:
        with open("/proc/self/autogroup", "w") as f:     # can this user raise priority at all?
            f.write("-20")
        os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0))
    except OSError:
        return cmd, False
    shell = 'echo -20 > /proc/self/autogroup 2>/dev/null; exec nice -n -19 "$@"'
    return ["setsid", "-w", "bash", "-c", shell, "prioritized", *cmd], True


def make_data(path, size, batch, seed=0):
    """A .npz of `batch` random uint8 images (3, size, size) and labels of 1000 classes: the train
    split hetconv reads (x_train, one step's worth repeated), and (x, y) for PyTorch."""
    import numpy as np
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (batch, 3, size, size), dtype=np.uint8)
    y = rng.integers(0, 1000, batch)
    classes = np.array([f"class{i}" for i in range(1000)])
    np.savez(path, x_train=np.concatenate([x] * 4), y_train=np.concatenate([y] * 4), x_test=x[:8], y_test=y[:8],
             classes=classes, x=x, y=y)


def hetconv_row(net, data, precision, steps, batch, cache, workdir):
    metrics = os.path.join(workdir, f"{net}-{precision}-{time.monotonic_ns()}.jsonl")
    cmd = [sys.executable, "-m", "hetconv.cli.coordinator", "--local", "--threads", "2", "--data", data,
           "--net", f"{NETS_FILE}:{net}", "--batch-size", str(batch), "--steps", str(steps), "--eval-every", "0",
           "--precision", precision, "--augment", "none", "--metrics", metrics]
    cmd, raised = prioritized(cmd)
    env = dict(os.environ, HETCONV_CACHE=cache, PYTHONPATH=_common.REPO)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"hetconv {net} {precision} failed: {done.stderr[-2000:]}")
    with open(metrics) as f:
        records = [json.loads(line) for line in f]
    seconds = [r["step_s"] for r in records if r.get("event") == "step"]
    paths = [c["path"] for r in records if r.get("event") == "conv_paths" for d in r["devices"] for c in d["choices"]]
    device = next((line for line in done.stdout.splitlines() if line.startswith("local: ")), "")
    return {"seconds": seconds, "raised": raised, "device": device, "paths": paths}


def torch_row(net, data, layout, dtype, steps, workdir):
    out = os.path.join(workdir, f"torch-{net}-{layout}-{dtype}.json")
    cmd, raised = prioritized([sys.executable, TORCH_STEP, "--module", f"imagenet_nets:{net}", "--data", data,
                               "--steps", str(steps), "--layout", layout, "--dtype", dtype, "--out", out])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"torch {net} {layout} {dtype} failed: {done.stderr[-2000:]}")
    with open(out) as f:
        got = json.load(f)
    return {"seconds": got["seconds"], "raised": raised, "device": " ".join(got["info"][:1])}


def timed(seconds, warmup):
    return statistics.median(seconds[warmup:]) if len(seconds) > warmup else None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[3:6]))
    p.add_argument("--nets", default=",".join(NETS), help="comma list of: " + ", ".join(NETS))
    p.add_argument("--image-size", type=int, default=160)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=6, help="steps a row's run takes; the first --warmup are not counted")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rows", default="", help="comma list of row names to run (default: all)")
    p.add_argument("--out", default="", help="folder for imagenet.json and imagenet.md")
    p.add_argument("--render", default="", metavar="JSON", help="run nothing: render the tables from a saved JSON")
    p.add_argument("--profile", action="store_true", help="also a per-kind profile of each network's step (hetconv "
                                                          "fp32 and PyTorch's fp32 layouts), after the rounds")
    args = p.parse_args(argv)
    if args.render:
        _common.render_saved(args.render, STEM, markdown)
        return 0
    nets = [n for n in args.nets.split(",") if n]
    if any(n not in NETS for n in nets) or args.steps <= args.warmup:
        p.error(f"--nets of {', '.join(NETS)}; --steps above --warmup")
    started, load_start = time.time(), _common.load_average()
    bf16_cpu = any(flag in _common.cpu_isa_flags() for flag in BF16_ISA)
    torch_modes = [("fp32", "fp32")] + ([("bf16 autocast", "bf16")] if bf16_cpu else [])
    rows = [*HETCONV_ROWS] + [T.layout_config(f"torch {mode}", lay) for mode, _ in torch_modes for lay in T.LAYOUTS]
    if args.rows:
        rows = [r for r in rows if r in args.rows.split(",")]
    doc = {**_common.run_facts("imagenet.py", sys.argv[1:] if argv is None else argv, started, load_start),
           "image_size": args.image_size, "batch": args.batch_size, "warmup": args.warmup, "bf16_cpu": bf16_cpu,
           "results": {net: {row: [] for row in rows} for net in nets}}
    workdir = tempfile.mkdtemp(prefix="hetconv-imagenet-")
    data = os.path.join(workdir, "images.npz")
    make_data(data, args.image_size, args.batch_size)
    cache = os.path.join(workdir, "cache")
    order = [(net, row) for net in nets for row in rows]
    for r in range(args.rounds):
        shift = r % len(order)
        for net, row in order[shift:] + order[:shift]:
            if row in HETCONV_ROWS:
                got = hetconv_row(net, data, HETCONV_ROWS[row], args.steps, args.batch_size, cache, workdir)
            else:
                mode, layout = T.layout_of(row)
                dtype = dict(torch_modes)[mode.removeprefix("torch ")]
                got = torch_row(net, data, layout, dtype, args.steps, workdir)
            got["median_s"] = timed(got["seconds"], args.warmup)
            got["round"] = r
            doc["results"][net][row].append(got)
            print(f"round {r} {net} {row}: {got['median_s']:.3f} s", flush=True)
        if args.out:
            _common.save_run(args.out, STEM, doc, started, markdown)
    if args.profile:
        doc["profile"] = {net: profile_rows(net, data, args.steps, args.warmup, args.batch_size, cache, workdir)
                          for net in nets}
        if args.out:
            _common.save_run(args.out, STEM, doc, started, markdown)
    if not args.out:
        print(markdown(doc))
    return 0


def markdown(doc):
    lines = _common.run_header(doc) + [
        f"One device with 2 threads, {doc['image_size']} px, batch {doc['batch']}, fp32 unless named; each number the "
        f"median over rounds of a run's median step after {doc['warmup']} steps. `x faster torch` is PyTorch's faster "
        f"fp32 layout's step over the row's (above 1: the row is faster).", ""]
    for net, rows in doc["results"].items():
        med = {row: statistics.median([g["median_s"] for g in got]) for row, got in rows.items() if got}
        torch_fp32 = [v for k, v in med.items() if k.startswith("torch fp32")]
        best_torch = min(torch_fp32) if torch_fp32 else None
        table = []
        for row, value in med.items():
            got = rows[row]
            spread = f"{min(g['median_s'] for g in got):.3f}-{max(g['median_s'] for g in got):.3f}"
            ratio = f"{best_torch / value:.2f}x" if best_torch else ""
            table.append([row, f"{value:.3f}", spread, len(got), ratio])
        lines += [f"### {net}", "", _common.markdown_table(["row", "step (s)", "rounds' range", "rounds",
                                                            "x faster torch fp32"], table), ""]
        devices = sorted({g["device"] for got in rows.values() for g in got if g.get("device")})
        lines += [f"- {d}" for d in devices]
        raised = all(g.get("raised") for got in rows.values() for g in got)
        lines += [f"- every row at the highest priority: {raised}", ""]
    for net, rows in doc.get("profile", {}).items():
        kinds = sorted({k for r in rows.values() for k in r}, key=lambda k: (k == "whole step", k == "other", k))
        lines += [f"### {net}: where a step's time goes (ms a step, one profiled run each)", "",
                  _common.markdown_table(["kind", *rows], [[k, *(f"{r[k] * 1e3:.0f}" if k in r else "" for r in rows.values())]
                                                           for k in kinds]), ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
