"""Small 3x3 layers against PyTorch, layer by layer: where a vgg-small or airbench94 step spends
its time on hetconv's CPU device, and what PyTorch spends on the same layer.

    python bench/small_layers.py --out bench/results/precision
    python bench/small_layers.py --before /tmp/base --out ...   # an earlier checkout's rows beside
    python bench/small_layers.py --render bench/results/precision/small_layers.json

Per network (vgg-small and airbench94 at batch 32, synthetic CIFAR-shaped input), each conv layer
as a shard runs it (`--local --threads 2`: one CPU device with 2 threads, the conv's fused block
and the layer's tail of per-channel ops, hetconv.engine.shard.ConvShard), forward and backward
timed apart, fp32 (each layer's conv path timed on its first call, as --local does) and
--precision bf16; beside it the same layer in PyTorch (the layer's modules of the network's
nn.Sequential, hetconv.net.torch_import.to_torch) with 2 threads, float32 and under bf16
autocast (each layer fed what the network before it gives under autocast: bf16 maps after a conv).
Then the whole training step: hetconv-coordinator --local --threads 2 (fp32 and bf16) against
PyTorch's step (forward, loss, backward, SGD with momentum) in float32 and bf16 autocast. Every
PyTorch row runs in both memory layouts, as PyTorch's CPU guidance tunes a conv network: NCHW and
channels_last (the modules' parameters and the input in channels-last memory; a step converts its
input inside the timed step), named "torch fp32 (NCHW)", "torch step bf16 autocast (channels_last)",
...; hetconv is compared with each mode's faster layout (layers: by the sum of every layer's forward
and backward; the step: by its median), which the tables name.

Where hetconv's time goes: a second series of runs of each layer counts the seconds spent in each
kind of kernel (wrapped at the module level, so the counted runs pay a few microseconds a call
that the timed runs do not): the GEMMs (OpenBLAS or oneDNN), the input's expansion (im2col or the
shifted path's width expansion), its adjoint (col2im, the width fold), layout passes (NCHW <-> the
GEMMs' row layouts, the weights' reorders), the bias / activation / pool pass and its backward,
the bias's gradient sums, bf16 rounding, the layer's tail (BatchNorm, GELU, pools), and "other":
the rest of the call, Python and numpy's own copies and fills. Page faults per call (getrusage)
show fresh memory being touched.

Every row runs in a process of its own; a round runs every row once, in an order that rotates
from round to round, so a change in the shared host's load falls on all of them alike. Each row
records the CPU time other processes used meanwhile (foreign load, in cores). A layer's number is
the median over rounds of each round's median over --reps runs.

Writes OUT/small_layers.json (every row as measured, machine, load) and OUT/small_layers.md,
rendered from the JSON alone.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402
import _speedup_common as C  # noqa: E402
import _torch_twin as T  # noqa: E402

STEM = "small_layers"
NETS = ("vgg-small", "airbench94")
TORCH_MODES = ("fp32", "bf16 autocast")
LAYER_ROWS = ("hetconv fp32", "hetconv bf16",
              *(T.layout_config(f"torch {m}", lay) for m in TORCH_MODES for lay in T.LAYOUTS))
STEP_ROWS = ("hetconv step fp32", "hetconv step bf16",
             *(T.layout_config(f"torch step {m}", lay) for m in TORCH_MODES for lay in T.LAYOUTS))
# hetconv's rows compared with PyTorch's mode of the same precision (its faster layout)
PEERS = {"fp32": "torch fp32", "bf16": "torch bf16 autocast"}
# the kinds of kernel a call's time is counted in: module -> {function name: kind}; "cpu" is the
# CPU device's modules, each of which calls a kernel by the name it imported it under
KINDS = ("gemm", "expand", "fold", "layout", "act/pool", "bias sums", "bf16 round", "tail", "other")
_COUNTED = {
    "cpu": {**dict.fromkeys(("_im2col", "_vexpand"), "expand"), **dict.fromkeys(("_col2im", "_vfold"), "fold"),
            **dict.fromkeys(("_rows_to_nchw", "_nchw_to_rows", "_weights_by_kernel_row", "_weights_from_kernel_rows",
                             "_zero_rows", "_add_into"), "layout"),
            **dict.fromkeys(("_act_pool", "_act_pool_backward", "_bias_act_max2", "_unpool", "_bias_act_max2_rows",
                             "_unpool_rows", "_bias_act_columns", "_bias_act_rows", "_act_backward_columns",
                             "_act_backward_rows"), "act/pool"),
            **dict.fromkeys(("_add_row_sums", "_add_column_sums"), "bias sums")},
    "cpu_channelwise": dict.fromkeys(("activation", "activation_backward", "plane_sums", "normalize",
                                      "batchnorm_backward", "pool", "pool_backward", "channel_scale"), "tail"),
    "dnnl": {"to_bf16": "bf16 round"},
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(HERE, "results", "precision"))
    p.add_argument("--nets", default=",".join(NETS), help="comma list of hetconv --net presets")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=10, help="timed runs of each layer per row")
    p.add_argument("--steps", type=int, default=6, help="timed steps of a step row (after 2 warm-up steps)")
    p.add_argument("--before", default="", metavar="DIR",
                   help="a checkout of an earlier hetconv: its rows run beside this one's, labelled 'before'")
    p.add_argument("--no-steps", action="store_true", help="layer rows only")
    p.add_argument("--render", default="", metavar="JSON", help="rewrite the .md beside a saved JSON, run nothing")
    p.add_argument("--row", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- one row, in a process of its own ------------------------------------------------------------------
def _layers(net, batch):
    from hetconv.geometry import IMAGE_SHAPE, NUM_CLASSES, ConvSpec
    from hetconv.net import load_net
    spec = load_net(net, IMAGE_SHAPE, NUM_CLASSES).spec
    return spec, [(layer, ConvSpec.from_layer(layer), (batch,) + tuple(layer.input_shape)) for layer in spec.conv_layers()]


def _flops(cs, x_shape, first):
    """Forward FLOPs of the conv, and backward's (dW, and dX unless first)."""
    from hetconv.geometry import window_output_size
    (sh, sw), (ph, pw) = cs.block.stride, cs.block.padding
    ho = window_output_size(x_shape[2], cs.kh, sh, ph)
    wo = window_output_size(x_shape[3], cs.kw, sw, pw)
    fwd = 2.0 * x_shape[0] * cs.kernels * cs.in_channels * cs.kh * cs.kw * ho * wo
    return fwd, fwd * (1 if first else 2)


class _Counter:
    """Seconds per kind of kernel, counted by wrapping the device modules' functions."""

    def __init__(self):
        import numpy as np
        from hetconv.devices import cpu, cpu_channelwise, cpu_gemm_paths, cpu_gemms, cpu_tails, dnnl
        self.seconds, self.active = {}, False
        modules = {"cpu": (cpu, cpu_gemm_paths, cpu_tails), "cpu_channelwise": (cpu_channelwise,), "dnnl": (dnnl,)}
        for mod_name, names in _COUNTED.items():
            for name, kind in names.items():
                for mod in modules[mod_name]:
                    if hasattr(mod, name):
                        setattr(mod, name, self.wrap(getattr(mod, name), kind))
        counter = self

        # numpy, with matmul counted as a GEMM: a module object, which Numba's kernels in the same
        # modules read their globals from as from numpy itself (np.inf, np.float32, np.empty)
        numpy_counted = types.ModuleType("numpy")
        numpy_counted.__dict__.update(np.__dict__)
        numpy_counted.matmul = counter.wrap(np.matmul, "gemm")
        for mod in (cpu, cpu_gemms):
            mod.np = numpy_counted
        if dnnl.available():
            lib = dnnl.load()
            lib.sgemm, lib.gemm_bf16 = self.wrap(lib.sgemm, "gemm"), self.wrap(lib.gemm_bf16, "gemm")

    def wrap(self, f, kind):
        def counted(*a, **k):
            if not self.active:
                return f(*a, **k)
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - t0
        return counted

    def device(self, dev):
        if getattr(dev, "_sgemm", None) is not None:
            dev._sgemm = self.wrap(dev._sgemm, "gemm")
        return dev


def hetconv_layers(spec_row):
    import resource
    import numpy as np
    counter = _Counter()
    from hetconv.devices import open_device
    from hetconv.engine.shard import ConvShard
    dev = counter.device(open_device("cpu", threads=2, precision=spec_row["precision"]))
    shard = ConvShard(dev)
    _, layers = _layers(spec_row["net"], spec_row["batch_size"])
    rng = np.random.default_rng(0)
    out = []
    for li, (layer, cs, x_shape) in enumerate(layers):
        fan_in = cs.in_channels * cs.kh * cs.kw
        w = (rng.standard_normal((cs.kernels, cs.in_channels, cs.kh, cs.kw)) / np.sqrt(fan_in)).astype(np.float32)
        shard.load(li, cs, 0, cs.kernels, cs.initial_state(w), "sgd")
        x = rng.standard_normal(x_shape).astype(np.float32)
        need_dx = li > 0
        y = shard.forward(li, x)                        # the first call times the conv paths
        g = rng.standard_normal(y.shape).astype(np.float32)
        shard.backward(li, g, need_dx)
        for _ in range(2):
            shard.forward(li, x)
            shard.backward(li, g, need_dx)
        times = {"forward": [], "backward": []}
        for _ in range(spec_row["reps"]):
            t0 = time.perf_counter()
            shard.forward(li, x)
            t1 = time.perf_counter()
            shard.backward(li, g, need_dx)
            times["forward"].append(t1 - t0)
            times["backward"].append(time.perf_counter() - t1)
        kinds, faults = {"forward": {}, "backward": {}}, {"forward": 0, "backward": 0}
        counted = {"forward": 0.0, "backward": 0.0}
        for _ in range(spec_row["reps"]):
            for phase, run in (("forward", lambda: shard.forward(li, x)), ("backward", lambda: shard.backward(li, g, need_dx))):
                counter.seconds, counter.active = {}, True
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0 = time.perf_counter()
                run()
                counted[phase] += time.perf_counter() - t0
                faults[phase] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
                counter.active = False
                for kind, s in counter.seconds.items():
                    kinds[phase][kind] = kinds[phase].get(kind, 0.0) + s
        reps = spec_row["reps"]
        breakdown = {}
        for phase in kinds:
            ms = {kind: 1e3 * s / reps for kind, s in kinds[phase].items()}
            ms["other"] = 1e3 * counted[phase] / reps - sum(ms.values())
            breakdown[phase] = ms
        fwd_flops, bwd_flops = _flops(cs, x_shape, li == 0)
        out.append({"layer": li, "describe": cs.describe(), "x": list(x_shape), "w": list(w.shape),
                    "forward_ms": 1e3 * statistics.median(times["forward"]),
                    "backward_ms": 1e3 * statistics.median(times["backward"]),
                    "breakdown_ms": breakdown, "page_faults": {p: faults[p] / reps for p in faults},
                    "flops": {"forward": fwd_flops, "backward": bwd_flops},
                    "path": list(dev.conv_paths().values())[-1] if dev.conv_paths() else "",
                    "why": (dev.describe_conv_paths() or [""])[-1].split(": ", 1)[-1]})
    return {"layers": out, "device": dev.describe()}


def _torch_model(net, batch):
    """hetconv's network as PyTorch's nn.Sequential, hetconv's start; and its layers."""
    import numpy as np
    from hetconv.net.head import init_conv_params
    from hetconv.net.torch_import import to_torch
    spec, layers = _layers(net, batch)
    rng = np.random.default_rng(0)
    conv = init_conv_params([cs for _, cs, _ in layers], rng)
    fc = [(rng.standard_normal((op.out_features, op.in_features)).astype(np.float32) * 0.01,
           np.zeros(op.out_features, np.float32)) for op in spec.head() if op.type == "linear"]
    return to_torch(spec, conv, fc), layers


def torch_layers(spec_row):
    import torch
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model, layers = _torch_model(spec_row["net"], spec_row["batch_size"])
    layout = spec_row.get("layout", "NCHW")
    model, _ = T.in_layout(torch, layout, model)
    model.train()
    autocast = bool(spec_row["autocast"])
    ctx = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)  # noqa: E731
    modules = list(model)
    # a conv layer's modules: from its conv to the next conv, or to the flatten after the last
    ends = [layer.index for layer, _, _ in layers[1:]] + [next(i for i, m in enumerate(modules)
                                                               if isinstance(m, torch.nn.Flatten))]
    (x,) = T.in_layout(torch, layout, None, [torch.randn(*layers[0][2])])[1]
    out = []
    for li, (layer, cs, x_shape) in enumerate(layers):
        block = torch.nn.Sequential(*modules[layer.index:ends[li]])
        xin = x.detach().requires_grad_(li > 0)
        with ctx():
            y = block(xin)
        g = torch.randn_like(y)
        for _ in range(3):
            with ctx():
                y = block(xin)
            y.backward(g)
        times = {"forward": [], "backward": []}
        for _ in range(spec_row["reps"]):
            t0 = time.perf_counter()
            with ctx():
                y = block(xin)
            t1 = time.perf_counter()
            y.backward(g)
            times["forward"].append(t1 - t0)
            times["backward"].append(time.perf_counter() - t1)
        fwd_flops, bwd_flops = _flops(cs, x_shape, li == 0)
        out.append({"layer": li, "describe": cs.describe(), "forward_ms": 1e3 * statistics.median(times["forward"]),
                    "backward_ms": 1e3 * statistics.median(times["backward"]), "input_dtype": str(xin.dtype),
                    "flops": {"forward": fwd_flops, "backward": bwd_flops}})
        with torch.no_grad(), ctx():
            x = block(x)                     # the next layer's input, as the network gives it
    return {"layers": out, "threads": torch.get_num_threads(), "layout": layout}


def torch_step(spec_row):
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model, layers = _torch_model(spec_row["net"], spec_row["batch_size"])
    layout = spec_row.get("layout", "NCHW")
    model, _ = T.in_layout(torch, layout, model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(2 + spec_row["steps"]):
        x = torch.randn(*layers[0][2], generator=gen)
        y = torch.randint(0, 10, (spec_row["batch_size"],), generator=gen)
        t0 = time.perf_counter()
        (x,) = T.in_layout(torch, layout, None, [x])[1]
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(spec_row["autocast"])):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times[2:]), "step_s_all": times[2:], "layout": layout}


def hetconv_step(spec_row, work):
    """hetconv-coordinator --local --threads 2 for 2 + steps steps; the median of the timed ones."""
    metrics = os.path.join(work, "metrics.jsonl")
    steps = 2 + spec_row["steps"]
    batch = spec_row["batch_size"]
    cmd = [sys.executable, "-m", "hetconv.cli.coordinator", "--local", "--threads", "2", "--net", spec_row["net"],
           "--precision", spec_row["precision"], "--batch-size", str(batch), "--steps", str(steps),
           "--synthetic-train", str(batch * (steps + 1)), "--synthetic-test", str(batch), "--eval-batches", "1",
           "--metrics", metrics]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=work, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"exit {done.returncode}: {done.stderr.strip()[-600:]}")
    with open(metrics) as f:
        times = [r["step_s"] for r in map(json.loads, f) if r["event"] == "step"]
    return {"step_s": statistics.median(times[2:]), "step_s_all": times[2:]}


def run_row(spec_row, out):
    kind = spec_row["kind"]
    with tempfile.TemporaryDirectory(prefix="hetconv-small-") as work:
        row = {"hetconv": hetconv_layers, "torch": torch_layers, "torch step": torch_step,
               "hetconv step": lambda s: hetconv_step(s, work)}[kind](spec_row)
    _common.write_text(out, json.dumps(row))


# ---- the run -------------------------------------------------------------------------------------------
def rows_to_run(args):
    """(name, spec) of every row of a round, per network: this checkout's and, with --before, the
    earlier one's hetconv rows."""
    trees = [("", "")] + ([(" (before)", os.path.abspath(args.before))] if args.before else [])
    rows = []
    for net in [n for n in args.nets.split(",") if n]:
        base = {"net": net, "batch_size": args.batch_size, "reps": args.reps, "steps": args.steps}
        for precision in ("fp32", "bf16"):
            for label, tree in trees:
                rows.append((f"hetconv {precision}{label}", {**base, "kind": "hetconv", "precision": precision,
                                                             "tree": tree}))
                if not args.no_steps:
                    rows.append((f"hetconv step {precision}{label}", {**base, "kind": "hetconv step",
                                                                      "precision": precision, "tree": tree}))
        for autocast in (False, True):
            name = "bf16 autocast" if autocast else "fp32"
            for layout in T.LAYOUTS:
                rows.append((T.layout_config(f"torch {name}", layout),
                             {**base, "kind": "torch", "autocast": autocast, "layout": layout, "tree": ""}))
                if not args.no_steps:
                    rows.append((T.layout_config(f"torch step {name}", layout),
                                 {**base, "kind": "torch step", "autocast": autocast, "layout": layout, "tree": ""}))
    return rows


def run_in_process(spec_row, work, tag):
    out = os.path.join(work, f"{tag}.json")
    env = dict(os.environ, OMP_NUM_THREADS="2", OPENBLAS_NUM_THREADS="2", MKL_NUM_THREADS="2")
    # PyTorch's rows under the OpenMP wait policy hetconv's run under (the environment line says
    # which): with its threads spinning, a PyTorch layer on this shared 2-core host ran 3-10x slower
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    repo = spec_row["tree"] or os.path.dirname(HERE)
    env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--row", json.dumps(spec_row), out],
                          capture_output=True, text=True, env=env, cwd=repo, timeout=3600)
    if done.returncode:
        return {"ok": False, "error": f"exit {done.returncode}: {done.stderr.strip()[-800:]}"}
    with open(out) as f:
        row = json.load(f)
    row.update(ok=True, wall_s=time.perf_counter() - t0)
    return row


def run(args, argv, env_line):
    import torch
    from hetconv.devices import dnnl
    started, load_start = time.time(), _common.load_average()
    gemm = dnnl.load().describe() if dnnl.available() else f"none: {dnnl.unavailable_reason()}"
    doc = {**_common.run_facts("small_layers.py", argv, started, load_start), "gemm": gemm, "env": env_line,
           "torch": "; ".join(_common.torch_info(torch)), "batch_size": args.batch_size, "reps": args.reps,
           "steps": args.steps, "nets": [n for n in args.nets.split(",") if n], "before": args.before, "rows": []}
    print(f"machine: {doc['machine']}; {gemm}; {load_start}", flush=True)
    rows = rows_to_run(args)
    with tempfile.TemporaryDirectory(prefix="hetconv-small-layers-") as work:
        try:
            for rnd in range(args.rounds):
                order = rows[rnd % len(rows):] + rows[:rnd % len(rows)]
                for name, spec_row in (order if rnd % 2 == 0 else order[::-1]):
                    print(f"[round {rnd}] {spec_row['net']}: {name} ... ({_common.load_average()})", flush=True)
                    with C.ForeignLoad() as load:
                        row = run_in_process(spec_row, work, f"r{rnd}-{spec_row['net']}-{name.replace(' ', '_')}")
                    row.update(net=spec_row["net"], config=name, round=rnd, foreign_load_cores=load.cores)
                    doc["rows"].append(row)
                    print(f"    -> {row_text(row)}; foreign load {load.cores:.2f} cores", flush=True)
                _common.save_run(args.out, STEM, doc, started, markdown)
        except KeyboardInterrupt:
            print("interrupted: writing the rows measured so far", file=sys.stderr)
        finally:
            _common.save_run(args.out, STEM, doc, started, markdown)
    return 0 if doc["rows"] and all(r.get("ok") for r in doc["rows"]) else 1


def row_text(r):
    if not r.get("ok"):
        return f"FAILED: {r.get('error')}"
    if "layers" in r:
        return " ".join(f"L{x['layer']} {x['forward_ms']:.1f}/{x['backward_ms']:.1f}" for x in r["layers"])
    return f"step {r['step_s'] * 1e3:.1f} ms ({', '.join(f'{s * 1e3:.0f}' for s in r['step_s_all'])})"


# ---- the tables, from the saved JSON alone ----------------------------------------------------------------
def _median_layers(rows, net, config):
    """{layer: {forward_ms, backward_ms, ...}}: each number the median over rounds; the rest from
    the first round."""
    ok = [r for r in rows if r["net"] == net and r["config"] == config and r.get("ok")]
    if not ok:
        return {}
    out = {}
    for layer in ok[0]["layers"]:
        li = layer["layer"]
        per = [next(x for x in r["layers"] if x["layer"] == li) for r in ok]
        merged = dict(layer)
        for key in ("forward_ms", "backward_ms"):
            merged[key] = statistics.median(p[key] for p in per)
        if "breakdown_ms" in layer:
            merged["breakdown_ms"] = {ph: {k: statistics.median(p["breakdown_ms"][ph].get(k, 0.0) for p in per)
                                           for k in KINDS} for ph in ("forward", "backward")}
            merged["paths"] = sorted({p["path"] for p in per})
        out[li] = merged
    return out


def _load(rows, net, config):
    ok = [r["foreign_load_cores"] for r in rows if r["net"] == net and r["config"] == config and r.get("ok")]
    return f"{statistics.median(ok):.2f}" if ok else ""


def _fmt(v):
    return f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def markdown(doc):
    lines = ["# Small layers: hetconv's CPU device against PyTorch, layer by layer", ""] + _common.run_header(doc)
    lines += [f"BLAS: {doc['blas']}. hetconv's GEMM library: {doc['gemm']}. PyTorch: {doc['torch']}. Environment: "
              f"{doc.get('env', '')}.", "",
              f"Batch {doc['batch_size']}, 2 threads everywhere. A layer's forward and backward are timed apart: "
              f"the median of {doc['reps']} runs per row, then the median over "
              f"{max([r['round'] for r in doc['rows']], default=-1) + 1} rounds of alternating order. hetconv's "
              f"layer is the conv's fused block and the layer's tail as a shard runs them; PyTorch's, the same "
              f"modules of the network. `x torch`: hetconv over PyTorch in the same precision (< 1: faster)"
              + (", in its faster memory layout (each PyTorch row names its layout: NCHW, or channels_last, the "
                 "modules and the input in channels-last memory)"
                 if any(T.layout_of(r["config"])[1] for r in doc["rows"]) else "")
              + ". GFLOP/s counts the conv's FLOPs only.", ""]
    rows = doc["rows"]
    befores = sorted({r["config"] for r in rows if r["config"].endswith("(before)")})
    for net in doc["nets"]:
        lines += [f"## {net}", ""]
        for precision, mode in PEERS.items():
            # PyTorch's mode in its faster layout: the least forward + backward over every layer
            per_layout = {config: sum(x["forward_ms"] + x["backward_ms"] for x in layers.values())
                          for config in {r["config"] for r in rows
                                         if r["net"] == net and T.layout_of(r["config"])[0] == mode}
                          if (layers := _median_layers(rows, net, config))}
            peer = T.faster_layout(per_layout, mode) or mode
            mine, theirs = _median_layers(rows, net, f"hetconv {precision}"), _median_layers(rows, net, peer)
            before = _median_layers(rows, net, f"hetconv {precision} (before)")
            if not mine:
                continue
            head = ["layer", "conv", "path", "fwd ms", "bwd ms"]
            head += ["before fwd", "before bwd"] if before else []
            head += [f"{peer} fwd", f"{peer} bwd", "x torch fwd", "x torch bwd", "GFLOP/s fwd+bwd"]
            table, totals = [], [0.0] * 6
            for li, m in sorted(mine.items()):
                t = theirs.get(li, {})
                b = before.get(li, {})
                gflops = (m["flops"]["forward"] + m["flops"]["backward"]) / (m["forward_ms"] + m["backward_ms"]) / 1e6
                cells = [str(li), f"{m['describe']} on {tuple(m['x'][1:])}", "/".join(m["paths"]),
                         _fmt(m["forward_ms"]), _fmt(m["backward_ms"])]
                if before:
                    cells += [_fmt(b.get("forward_ms", 0)), _fmt(b.get("backward_ms", 0))]
                cells += [_fmt(t.get("forward_ms", 0)), _fmt(t.get("backward_ms", 0)),
                          f"{m['forward_ms'] / t['forward_ms']:.2f}" if t else "",
                          f"{m['backward_ms'] / t['backward_ms']:.2f}" if t else "", f"{gflops:.0f}"]
                table.append(cells)
                for i, v in enumerate((m["forward_ms"], m["backward_ms"], b.get("forward_ms", 0),
                                       b.get("backward_ms", 0), t.get("forward_ms", 0), t.get("backward_ms", 0))):
                    totals[i] += v
            cells = ["all", "", "", f"**{_fmt(totals[0])}**", f"**{_fmt(totals[1])}**"]
            cells += [_fmt(totals[2]), _fmt(totals[3])] if before else []
            cells += [_fmt(totals[4]), _fmt(totals[5]),
                      f"{totals[0] / totals[4]:.2f}" if totals[4] else "", f"{totals[1] / totals[5]:.2f}" if totals[5] else "",
                      ""]
            table.append(cells)
            loads = f"foreign load (cores, median over rounds): hetconv {_load(rows, net, f'hetconv {precision}')}, " \
                    f"{peer} {_load(rows, net, peer)}"
            layout = T.layout_note(per_layout, mode, fmt="{:.1f}", suffix=" ms")
            lines += [f"### {precision}: hetconv --precision {precision} against {peer}", "",
                      _common.markdown_table(head, table), "", loads + ".", ""]
            lines += [f"PyTorch's faster layout, which `x torch` compares with (forward + backward over every layer): "
                      f"{layout}.", ""] if layout else []
            lines += _breakdown(mine) + [""]
        lines += _steps(rows, net, befores) + [""]
    failed = [r for r in rows if not r.get("ok")]
    if failed:
        lines += ["## Failed rows", ""] + [f"- round {r['round']} {r['net']} {r['config']}: {r.get('error')}"
                                           for r in failed] + [""]
    return "\n".join(lines)


def _breakdown(mine):
    head = ["layer", "phase", "ms"] + list(KINDS) + ["page faults"]
    table = []
    for li, m in sorted(mine.items()):
        for phase in ("forward", "backward"):
            parts = m["breakdown_ms"][phase]
            table.append([str(li), phase, _fmt(m[f"{phase}_ms"])] + [_fmt(parts[k]) if parts[k] else "" for k in KINDS]
                         + [f"{m['page_faults'][phase]:.0f}"])
    return ["Where hetconv's time goes (ms per call, counted in separate runs; `other` is the rest of "
            "the call: Python, numpy's copies and fills):", "", _common.markdown_table(head, table)]


def _steps(rows, net, befores):
    # a PyTorch step row of results saved before both layouts were measured has none in its name
    configs = list(STEP_ROWS[:2]) + [c for m in TORCH_MODES for c in (f"torch step {m}", *STEP_ROWS[2:])
                                     if T.layout_of(c)[0] == f"torch step {m}"]
    configs += [f"hetconv step {p} (before)" for p in ("fp32", "bf16") if f"hetconv {p} (before)" in befores]
    medians = {c: statistics.median(ok) if (ok := [r["step_s"] for r in rows if r["net"] == net and r["config"] == c
                                                   and r.get("ok")]) else None for c in configs}
    table = []
    for name in configs:
        ok = [r for r in rows if r["net"] == net and r["config"] == name and r.get("ok")]
        if not ok:
            continue
        mode = "torch step bf16 autocast" if "bf16" in name else "torch step fp32"
        peer = T.faster_layout(medians, mode)          # PyTorch's step in its faster layout
        ratios = []
        for r in ok:
            other = [o for o in rows if o["net"] == net and o["config"] == peer and o["round"] == r["round"] and o.get("ok")]
            if other and name.startswith("hetconv"):
                ratios.append(r["step_s"] / other[0]["step_s"])
        table.append([name, f"**{1e3 * statistics.median(r['step_s'] for r in ok):.1f}**",
                      " / ".join(f"{1e3 * r['step_s']:.1f}" for r in ok),
                      f"{statistics.median(ratios):.2f}" if ratios else "",
                      " / ".join(f"{r['foreign_load_cores']:.2f}" for r in ok)])
    if not table:
        return []
    layouts = [note for m in TORCH_MODES if (note := T.layout_note(medians, f"torch step {m}", 1e3, "{:.1f}", " ms"))]
    return ["### The whole step", "", "hetconv-coordinator --local --threads 2 and PyTorch's training step (2 threads), "
            "ms: the median of the timed steps per round, then over rounds; `x torch` is the median of per-round "
            "ratios to PyTorch's step in the same precision" + (" and its faster layout" if layouts else "") + ".", "",
            _common.markdown_table(["config", "step ms (median)", "per round", "x torch", "foreign load per round"],
                                   table)] \
        + (["", "PyTorch's faster layout, which `x torch` compares with: " + "; ".join(layouts) + "."]
           if layouts else [])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.row:
        run_row(json.loads(args.row[0]), args.row[1])
        return 0
    if args.render:
        print(f"wrote {_common.render_saved(args.render, STEM, markdown)}")
        return 0
    env_line = _common.reexec_without_blas_overrides()     # before numpy loads: it may re-execute
    return run(args, argv, env_line)


if __name__ == "__main__":
    sys.exit(main())
