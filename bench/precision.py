"""Mixed precision on CPUs: what `--precision bf16` buys a training step, against float32 and
against PyTorch's float32 and bf16 autocast, in one run of alternating rounds.

    python bench/precision.py --out bench/results/precision
    python bench/precision.py --nets airbench94:256 --out DIR     # a network at a batch of its own
    python bench/precision.py --nets vgg-small --configs "hetconv local fp32,hetconv local fp32 spinning,torch fp32"
    python bench/precision.py --render bench/results/precision/precision.json

Each round runs, for each network (the paper network and vgg-small; `--nets NAME:BATCH` gives a
network a batch of its own, else --batch-size, 32), in an order that rotates from round to round:
- hetconv --local --threads 2, --precision fp32, bf16 and auto (bf16 layer by layer where timed faster);
- hetconv --spawn cpu,cpu --threads 1 (two one-thread workers on cores of their own), fp32 and bf16;
- PyTorch with 2 threads, float32 and bf16 autocast (torch.autocast("cpu", torch.bfloat16) around
  the forward and the loss), SGD with momentum, the same layers (bench/_ddp_baseline.torch_net),
  each in both memory layouts, as PyTorch's CPU guidance tunes a conv network: NCHW, and
  channels_last (the model's parameters and each step's input in channels-last memory, the input's
  conversion inside the timed step); rows "torch fp32 (NCHW)", "torch fp32 (channels_last)", ...
  Every comparison with PyTorch (`x torch`, and torch bf16's `x fp32`) takes the mode's faster
  layout, by its median over rounds, and the table says which it was.
fp32 is hetconv's default: each layer's conv path timed on its first call among OpenBLAS's
im2col, shifted and FFT paths and oneDNN's im2col (the device's `--verbose` lines name the pick);
bf16 runs every conv on oneDNN's bf16 GEMM (bf16 operands, float32 sums). A row's number is the
median of its timed steps after the warm-up steps (hetconv's first step times its conv paths).
Every process is the synthetic data set; the losses of the first and last step are kept, so a
precision that stopped learning would show.

hetconv needs oneDNN here (pip install -e '.[onednn]'); the results name the CPU, its SIMD flags
(avx512_bf16, amx_tile), the BLAS kernel, oneDNN's version and ISA, and PyTorch's oneDNN.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402
import _speedup_common as C  # noqa: E402
import _torch_twin as T  # noqa: E402

STEM = "precision"
NETS = ("paper", "vgg-small")
# each config with the row it is compared with in its own precision family ("fp32") and PyTorch's
# row of its precision ("torch"); a PyTorch mode names its rows in both layouts, and is compared by
# the faster (_torch_twin.faster_layout)
CONFIGS = [("hetconv local fp32", {"kind": "hetconv", "mode": "local", "precision": "fp32", "torch": "torch fp32"}),
           ("hetconv local bf16", {"kind": "hetconv", "mode": "local", "precision": "bf16", "fp32": "hetconv local fp32",
                                   "torch": "torch bf16 autocast"}),
           ("hetconv local auto", {"kind": "hetconv", "mode": "local", "precision": "auto", "fp32": "hetconv local fp32",
                                   "torch": "torch bf16 autocast"}),
           ("hetconv 2x1 fp32", {"kind": "hetconv", "mode": "spawn", "precision": "fp32", "torch": "torch fp32"}),
           ("hetconv 2x1 bf16", {"kind": "hetconv", "mode": "spawn", "precision": "bf16", "fp32": "hetconv 2x1 fp32",
                                 "torch": "torch bf16 autocast"}),
           *[(T.layout_config(mode, layout), {**what, "layout": layout}) for mode, what in (
               ("torch fp32", {"kind": "torch", "autocast": False}),
               ("torch bf16 autocast", {"kind": "torch", "autocast": True, "fp32": "torch fp32"}))
             for layout in T.LAYOUTS]]
DEFAULT_CONFIGS = [name for name, _ in CONFIGS]
# hetconv's CPU device puts its OpenMP threads to sleep at the end of each parallel region
# (OMP_WAIT_POLICY=PASSIVE, its default: a spinning thread costs a shared core's other tenants, and
# costs us a scheduler slice where our two threads land on one core); PyTorch runs GNU OpenMP's own
# default, a spin before sleeping. These rows give hetconv that same spin (GOMP_SPINCOUNT, which
# overrides PASSIVE's zero), as a user with cores of their own may: `--configs` picks them.
SPINNING = {"GOMP_SPINCOUNT": "300000"}
CONFIGS += [("hetconv local fp32 spinning", {"kind": "hetconv", "mode": "local", "precision": "fp32", "env": SPINNING,
                                             "fp32": "hetconv local fp32", "torch": "torch fp32"}),
            ("hetconv local bf16 spinning", {"kind": "hetconv", "mode": "local", "precision": "bf16", "env": SPINNING,
                                             "fp32": "hetconv local fp32 spinning", "torch": "torch bf16 autocast"})]
# ... and shorter spins, which a quiet host rewards nearly as much and a shared core punishes less
# (bench/results/precision/targets/vgg_small_spin*.md)
CONFIGS += [(f"hetconv local fp32 spin{count}", {"kind": "hetconv", "mode": "local", "precision": "fp32",
                                                 "env": {"GOMP_SPINCOUNT": str(count)}, "fp32": "hetconv local fp32",
                                                 "torch": "torch fp32"}) for count in (3000, 30000)]
# "cpu device: x (...) w (...) ..., block ...: runs PATH (timed ...)" from the device's --verbose
_CHOSE = re.compile(r"^cpu device: x \(([^)]*)\) w \(([^)]*)\).* runs (\S+) \(.*?(?:; (oneDNN .*))?$")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(HERE, "results", "precision"))
    p.add_argument("--nets", default=",".join(NETS),
                   help="comma list of hetconv --net presets, each NAME or NAME:BATCH (its own batch size)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"comma list of the rows to run, among: {', '.join(name for name, _ in CONFIGS)} (a "
                        f"PyTorch mode without its layout, such as 'torch fp32': both layouts)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2, help="steps not timed (hetconv's first times its conv paths)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per row")
    p.add_argument("--stem", default=STEM, help="the results' file names: STEM.json and STEM.md in --out")
    p.add_argument("--no-gemm", action="store_true", help="leave out conv2's GEMM alone (the paper network's)")
    p.add_argument("--render", default="", metavar="JSON", help="rewrite the .md beside a saved JSON, run nothing")
    p.add_argument("--torch-row", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--gemm-row", metavar="OUT", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- one row, in a process of its own --------------------------------------------------------------
def chosen_configs(text):
    """The (name, what) of CONFIGS that --configs names, in CONFIGS' order (a PyTorch mode without
    its layout names its rows in both); an unknown name exits with one line."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    known = dict(CONFIGS)
    names += [T.layout_config(n, layout) for n in names for layout in T.LAYOUTS if T.layout_config(n, layout) in known]
    unknown = [n for n in names if n not in known and not any(T.layout_of(k)[0] == n for k in known)]
    if unknown or not names:
        raise SystemExit(f"bench/precision.py: --configs {text!r}: expected names among {', '.join(known)}")
    return [(name, what) for name, what in CONFIGS if name in names]


def net_batches(text, default):
    """[(net, batch)] from --nets: NAME (batch `default`) or NAME:BATCH; a bad batch exits with one line."""
    out = []
    for item in (t for t in text.split(",") if t):
        net, _, batch = item.partition(":")
        if batch and not (batch.isdigit() and int(batch) > 0):
            raise SystemExit(f"bench/precision.py: --nets {item!r}: expected NAME or NAME:BATCH with a positive batch")
        out.append((net, int(batch) if batch else default))
    return out


def hetconv_row(net, what, args, work, tag, batch):
    metrics = os.path.join(work, f"{tag}.jsonl")
    steps = args.warmup + args.steps
    where = ["--local", "--threads", "2"] if what["mode"] == "local" else ["--spawn", "cpu,cpu", "--threads", "1"]
    cmd = [sys.executable, "-m", "hetconv.cli.coordinator", *where, "--net", net, "--precision", what["precision"],
           "--batch-size", str(batch), "--steps", str(steps), "--synthetic-train",
           str(batch * (steps + 1)), "--synthetic-test", str(batch), "--eval-batches", "1",
           "--metrics", metrics, "--verbose"]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=work, timeout=1800,
                          env=dict(os.environ, **what.get("env", {})))
    wall = time.perf_counter() - t0
    if done.returncode:
        return {"ok": False, "error": f"exit {done.returncode}: {done.stderr.strip()[-600:]}", "wall_s": wall}
    records = [json.loads(line) for line in open(metrics)]
    step = [r for r in records if r["event"] == "step"]
    times = [r["step_s"] for r in step]
    row = {"ok": True, "step_s": statistics.median(times[args.warmup:]), "step_s_all": times[args.warmup:],
           "warmup_step_s": times[:args.warmup], "loss_first": step[0]["loss"], "loss_last": step[-1]["loss"],
           "wall_s": wall, "device": next((line.split("local: ", 1)[1] for line in done.stdout.splitlines()
                                           if line.startswith("local: ")), "")}
    calibration = next((r for r in records if r["event"] == "calibration"), None)
    if calibration is not None:             # spawned workers: what each one's device ran, by call shape
        workers = calibration["workers"]
        row["workers"] = {name: {"precision": w.get("precision"), "description": w["description"],
                                 "conv_paths": [f"{c['call'].split(' stride')[0]}: {c['path']} ({c['why'].split(':')[0]})"
                                                + (f" (oneDNN {', '.join(f'{d} {k}' for d, k in c['kernels'].items())})"
                                                   if c.get("kernels") else "") for c in w["conv_paths"]]} for name, w in workers.items()}
        row["device"] = next(iter(workers.values()))["description"]
    else:                                   # --local: the device's --verbose lines
        row["conv_paths"] = [f"x ({m.group(1)}) w ({m.group(2)}): {m.group(3)}"
                             + (f" ({m.group(4)})" if m.group(4) else "") for m in
                             map(_CHOSE.match, done.stderr.splitlines()) if m]
    return row


def torch_row(spec, out):
    """PyTorch in this process: `threads` threads, SGD with momentum on hetconv's network `net`,
    float32 or with the forward and the loss under bf16 autocast, in memory `layout` (NCHW or
    channels_last: the model's, and each step's input converted inside the timed step, as a
    user's training loop converts each batch)."""
    import torch
    import torch.nn.functional as F
    from _ddp_baseline import torch_net
    torch.set_num_threads(int(spec["threads"]))
    torch.manual_seed(0)
    layout = spec.get("layout", "NCHW")
    model, _ = T.in_layout(torch, layout, torch_net(spec["net"]))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    gen = torch.Generator().manual_seed(0)
    times, losses = [], []
    for _ in range(int(spec["warmup"]) + int(spec["steps"])):
        x = torch.randn(int(spec["batch_size"]), 3, 32, 32, generator=gen)
        y = torch.randint(0, 10, (int(spec["batch_size"]),), generator=gen)
        t0 = time.perf_counter()
        (x,) = T.in_layout(torch, layout, None, [x])[1]
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(spec["autocast"])):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    warm = int(spec["warmup"])
    row = {"ok": True, "step_s": statistics.median(times[warm:]), "step_s_all": times[warm:],
           "warmup_step_s": times[:warm], "loss_first": losses[0], "loss_last": losses[-1],
           "threads": torch.get_num_threads(), "layout": layout}
    _common.write_text(out, json.dumps(row))


def run_torch(net, what, args, work, tag, batch):
    out = os.path.join(work, f"{tag}.json")
    spec = {"net": net, "threads": 2, "batch_size": batch, "warmup": args.warmup, "steps": args.steps,
            "autocast": what["autocast"], "layout": what["layout"]}
    env = dict(os.environ, OMP_NUM_THREADS="2", OPENBLAS_NUM_THREADS="2", MKL_NUM_THREADS="2")
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--torch-row", json.dumps(spec), out],
                          capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode:
        return {"ok": False, "error": f"exit {done.returncode}: {done.stderr.strip()[-600:]}"}
    with open(out) as f:
        row = json.load(f)
    row["wall_s"] = time.perf_counter() - t0
    return row


# ---- the GEMM alone ----------------------------------------------------------------------------------
GEMM_SHAPE = (1500, 12500, 3200)        # conv2's forward at batch 32: (K, C*kh*kw) @ (C*kh*kw, N*Ho*Wo)


def gemm_rows(rounds=3):
    """conv2's forward GEMM on one thread, in this process: numpy's OpenBLAS sgemm, oneDNN's sgemm
    and its bf16 GEMM (operands rounded beforehand, not timed), alternating; GFLOP/s per round."""
    import numpy as np
    from threadpoolctl import threadpool_limits
    from hetconv.devices import dnnl
    lib = dnnl.load()
    m, k, n = GEMM_SHAPE
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
    a16, b16, c = dnnl.to_bf16(a), dnnl.to_bf16(b), np.empty((m, n), np.float32)
    runs = {"OpenBLAS sgemm": lambda: np.matmul(a, b, out=c), "oneDNN sgemm": lambda: lib.sgemm(a, b, c, 0.0, 1)}
    if not lib.bf16_error:
        runs["oneDNN bf16 GEMM"] = lambda: lib.gemm_bf16(a16, b16, c, 0.0, 1)
    seconds = {name: [] for name in runs}
    with threadpool_limits(limits=1, user_api="blas"):
        for name, run in runs.items():
            run()                                   # first use: packing buffers, JIT kernels
        for r in range(rounds):
            for name, run in (runs.items() if r % 2 == 0 else list(runs.items())[::-1]):
                t0 = time.perf_counter()
                run()
                seconds[name].append(time.perf_counter() - t0)
    rows = {"shape": list(GEMM_SHAPE), "gflops": {name: [2 * m * k * n / t / 1e9 for t in ts]
                                                   for name, ts in seconds.items()}}
    if lib.bf16_error:
        return {**rows, "bf16_missing": lib.bf16_error}
    want = a.astype(np.float64)[:64] @ b
    lib.gemm_bf16(a16, b16, c, 0.0, 1)
    return {**rows, "bf16_relative_error": float(np.abs(c[:64] - want).max() / np.abs(want).max())}


def gemm_tables():
    """gemm_rows in this process (the BLAS overrides dropped, as every row here runs) and, where
    the environment had set some, in a process that keeps them: what hetconv gets on this host
    when nobody drops them."""
    tables = {"OpenBLAS's own kernel choice": gemm_rows()}
    dropped = os.environ.get(_common._DROPPED_MARK, "")
    if dropped:
        env = {k: v for k, v in os.environ.items() if k != _common._DROPPED_MARK}
        env.update(item.split("=", 1) for item in dropped.split())
        with tempfile.TemporaryDirectory() as work:
            out = os.path.join(work, "gemm.json")
            subprocess.run([sys.executable, os.path.abspath(__file__), "--gemm-row", out], env=env, check=True,
                           timeout=600)
            with open(out) as f:
                tables[f"with {dropped} (as this host's environment sets it)"] = json.load(f)
    return tables


# ---- the run ---------------------------------------------------------------------------------------
def machine_facts(argv, started, load_start, env_line):
    import numpy  # noqa: F401  (the BLAS the hetconv rows load, for run_facts to name)
    import torch
    from hetconv.devices import dnnl
    gemm = dnnl.load().describe() if dnnl.available() else f"none: {dnnl.unavailable_reason()}"
    torch_dnnl = [line.strip(" -") for line in torch.__config__.show().splitlines() if "MKL-DNN" in line]
    return {**_common.run_facts("precision.py", argv, started, load_start), "gemm": gemm,
            "torch": "; ".join(_common.torch_info(torch) + torch_dnnl), "env": env_line}


def run(args, argv, env_line):
    from hetconv.devices import dnnl
    if not dnnl.available():
        raise SystemExit(f"bench/precision.py: hetconv's bf16 rows need oneDNN: {dnnl.unavailable_reason()}")
    started, load_start = time.time(), _common.load_average()
    batches = net_batches(args.nets, args.batch_size)
    configs = chosen_configs(args.configs)
    nets = [n for n, _ in batches]
    doc = {**machine_facts(argv, started, load_start, env_line), "batch_size": args.batch_size, "warmup": args.warmup,
           "steps": args.steps, "nets": nets, "net_batch": dict(batches), "configs": [name for name, _ in configs],
           "peers": {name: {k: what[k] for k in ("fp32", "torch") if k in what} for name, what in configs},
           "config_env": {name: what["env"] for name, what in configs if what.get("env")},
           "rows": []}
    print(f"machine: {doc['machine']}; isa {doc['isa']}; {doc['gemm']}; {load_start}", flush=True)
    if not args.no_gemm:
        doc["gemm_alone"] = gemm_tables()
        print(f"conv2's GEMM, one thread, GFLOP/s: {doc['gemm_alone']}", flush=True)
    with tempfile.TemporaryDirectory(prefix="hetconv-precision-") as work:
        try:
            for rnd in range(args.rounds):
                order = configs[rnd % len(configs):] + configs[:rnd % len(configs)]
                order = order if rnd % 2 == 0 else order[::-1]
                for net, batch in batches:
                    for name, what in order:
                        tag = f"r{rnd}-{net}-{name.replace(' ', '_')}"
                        print(f"[round {rnd}] {net}: {name} ... ({_common.load_average()})", flush=True)
                        with C.ForeignLoad() as load:
                            runner = hetconv_row if what["kind"] == "hetconv" else run_torch
                            row = runner(net, what, args, work, tag, batch)
                        row.update(net=net, batch_size=batch, config=name, round=rnd, foreign_load_cores=load.cores,
                                   load_after=_common.load_average())
                        doc["rows"].append(row)
                        print(f"    -> {row_text(row)}; foreign load {load.cores:.2f} cores", flush=True)
                # after every round: a stopped run keeps its rounds
                _common.save_run(args.out, args.stem, doc, started, markdown)
        except KeyboardInterrupt:
            print("interrupted: writing the rows measured so far", file=sys.stderr)
        finally:
            _common.save_run(args.out, args.stem, doc, started, markdown)
    return 0 if doc["rows"] and all(r.get("ok") for r in doc["rows"]) else 1


def row_text(r):
    if not r.get("ok"):
        return f"FAILED: {r.get('error')}"
    return (f"step {r['step_s']:.3f}s (timed {', '.join(f'{s:.2f}' for s in r['step_s_all'])}; warm-up "
            f"{', '.join(f'{s:.2f}' for s in r['warmup_step_s'])}); loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}")


# ---- the table, from the saved JSON alone -------------------------------------------------------------
def markdown(doc):
    lines = ["# Mixed precision on CPUs: bf16 GEMMs against float32 and PyTorch", ""] + _common.run_header(doc)
    lines += [f"CPU SIMD flags: {doc['isa']}. BLAS: {doc['blas']}. hetconv's GEMM library: {doc['gemm']}. "
              f"PyTorch: {doc['torch']}. Environment: {doc.get('env', '')}.", "",
              f"Batch {doc['batch_size']} unless a network's heading says otherwise, synthetic data; each row the "
              f"median of {doc['steps']} timed steps after "
              f"{doc['warmup']} warm-up steps, in {max([r['round'] for r in doc['rows']], default=-1) + 1} rounds of "
              f"alternating order. `x fp32` is the row's step over the float32 row of the same "
              f"kind (hetconv in the same mode, or torch fp32), `x torch` over PyTorch's step in the row's precision "
              f"(auto: bf16 autocast), both the median of per-round ratios (< 1: faster)."
              + (" PyTorch's rows name their memory layout (NCHW, or channels_last: the model and each step's "
                 "input); a comparison with a PyTorch mode takes its faster layout (by median), named under each "
                 "table." if any(T.layout_of(c)[1] for c in doc["configs"]) else ""), ""]
    tables = doc.get("gemm_alone")
    if tables:
        m, k, n = next(iter(tables.values()))["shape"]
        lines += ["## The GEMM alone", "", f"conv2's forward GEMM at batch 32 ({m}x{k} @ {k}x{n}), one thread, "
                  f"alternating rounds; bf16 operands rounded beforehand.", ""]
        rows = []
        for blas, gemm in tables.items():
            base = statistics.median(gemm["gflops"]["OpenBLAS sgemm"])
            rows += [[name, blas, f"**{statistics.median(g):.0f}**", " / ".join(f"{v:.0f}" for v in g),
                      f"{statistics.median(g) / base:.2f}"] for name, g in gemm["gflops"].items()]
        first = next(iter(tables.values()))
        lines += [_common.markdown_table(["GEMM", "OpenBLAS kernel", "GFLOP/s (median)", "per round", "x OpenBLAS"],
                                         rows), "",
                  f"No bf16 GEMM here: {first['bf16_missing']}." if "bf16_missing" in first else
                  f"Relative error of the bf16 product against float64: {first['bf16_relative_error']:.1e}.", ""]
    for net in doc["nets"]:
        rows = [r for r in doc["rows"] if r["net"] == net]
        batch = doc.get("net_batch", {}).get(net, doc["batch_size"])
        lines += [f"## {net}" + (f", batch {batch}" if batch != doc["batch_size"] else ""), ""]
        table = []
        medians = {name: statistics.median(ok) if (ok := [r["step_s"] for r in rows if r["config"] == name
                                                          and r.get("ok")]) else None for name in doc["configs"]}
        for name in doc["configs"]:
            mine = [r for r in rows if r["config"] == name]
            ok = [r for r in mine if r.get("ok")]
            if not ok:
                table.append([name, "failed" if mine else "not run", "", "", "", "", ""])
                continue
            # the row each peer is compared by: a PyTorch mode's faster layout
            peers = {k: T.faster_layout(medians, v) for k, v in doc["peers"].get(name, {}).items()}
            per_round = " / ".join(f"{r['step_s']:.3f}" for r in ok)
            losses = " / ".join(f"{r['loss_first']:.2f}->{r['loss_last']:.2f}" for r in ok)
            table.append([name, f"**{statistics.median(r['step_s'] for r in ok):.3f}**", per_round,
                          _ratio(rows, name, peers["fp32"]) if peers.get("fp32") else "",
                          _ratio(rows, name, peers["torch"]) if peers.get("torch") else "", losses,
                          f"{statistics.median(r['foreign_load_cores'] for r in ok):.2f}"])
        lines += [_common.markdown_table(["config", "step s (median)", "per round", "x fp32", "x torch", "loss first->last",
                                          "foreign load (cores)"], table), ""]
        layouts = [note for mode in dict.fromkeys(T.layout_of(c)[0] for c in doc["configs"] if T.layout_of(c)[1])
                   if (note := T.layout_note(medians, mode))]
        if layouts:
            lines += ["PyTorch's faster layout, which `x torch` and torch's `x fp32` compare with: "
                      + "; ".join(layouts) + ".", ""]
        lines += _paths_lines(rows) + [""]
    if doc.get("config_env"):
        lines += ["Rows run with more environment: " + "; ".join(
            f"{name}: {' '.join(f'{k}={v}' for k, v in env.items())}" for name, env in doc["config_env"].items())
            + " (GNU OpenMP's own spin before its threads sleep, which PyTorch's rows run with; hetconv's "
            "default is OMP_WAIT_POLICY=PASSIVE).", ""]
    failed = [r for r in doc["rows"] if not r.get("ok")]
    if failed:
        lines += ["## Failed rows", ""] + [f"- round {r['round']} {r['net']} {r['config']}: {r.get('error')}"
                                           for r in failed] + [""]
    return "\n".join(lines)


def _ratio(rows, name, base):
    """The median over rounds of this config's step over `base`'s in the same round."""
    ratios = []
    for r in rows:
        if r["config"] == name and r.get("ok"):
            other = [o for o in rows if o["config"] == base and o["round"] == r["round"] and o.get("ok")]
            if other:
                ratios.append(r["step_s"] / other[0]["step_s"])
    return f"{statistics.median(ratios):.2f}" if ratios else ""


def _paths_lines(rows):
    """What each hetconv row's devices ran, from its first successful round."""
    lines = []
    for r in rows:
        if not (r.get("ok") and r["config"].startswith("hetconv")) or r["round"] != min(
                o["round"] for o in rows if o["config"] == r["config"] and o.get("ok")):
            continue
        if "workers" in r:
            first = next(iter(r["workers"].values()))
            paths = "; ".join(dict.fromkeys(first["conv_paths"])) or "?"
            lines.append(f"- {r['config']}: worker 0 ran {first['precision']}: {paths}")
        else:
            lines.append(f"- {r['config']}: {'; '.join(r['conv_paths']) or 'every conv forced or untimed (the rule)'}")
    head = "Conv paths (timed on the first call; untimed small calls take the rule's layout):"
    return [head, *lines] if lines else []


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.torch_row:
        torch_row(json.loads(args.torch_row[0]), args.torch_row[1])
        return 0
    if args.gemm_row:
        _common.write_text(args.gemm_row, json.dumps(gemm_rows()))
        return 0
    if args.render:
        print(f"wrote {_common.render_saved(args.render, args.stem, markdown)}")
        return 0
    env_line = _common.reexec_without_blas_overrides()     # before numpy loads: it may re-execute
    return run(args, argv, env_line)


if __name__ == "__main__":
    sys.exit(main())
