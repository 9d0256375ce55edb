"""Conv kernels: hetconv's devices against PyTorch on the paper's two conv layers.

    python bench/conv.py [--quick] [--device cpu|cuda:0] [--out DIR]
    python bench/conv.py --share-scaling [--share 375] [--threads 1] [--batches 32]
    add --cpu-conv-path im2col|shifted|fft to force the CPU device's conv path (default auto)
    python bench/conv.py --fft [--layers conv2] [--batches 32,128] [--threads 1,2] [--fft-share 0.25]
    python bench/conv.py --auto-check [--batches 32] [--threads 1,2] [--out bench/results/fft]

What it measures, per layer, batch N and thread count T (CPU) or per layer and N (CUDA):
- hetconv plain: the contract, conv2d then conv2d_backward (dx only where a layer below needs it:
  conv2 yes, conv1 no);
- hetconv fused: conv_relu_pool then conv_relu_pool_backward, what a worker runs each step;
- torch: F.conv2d (plain) and F.max_pool2d(F.relu(F.conv2d)) (fused), backward by autograd with
  the input requiring grad only for conv2; torch.set_num_threads(T) against hetconv's threads=T;
  in both memory layouts, as PyTorch's guidance tunes a conv network: NCHW, and channels_last (x,
  w and the output gradients in channels-last memory). A row's ratio is to the faster layout of its
  layer, N, T and form (by the fwd+bwd median), which the row names.
--fft adds the CPU device's FFT path (conv_path="fft") as a third contender beside the direct path
(--cpu-conv-path) and torch, all three alternating in the same rounds; each row then carries
"fft" (its times), fft/direct and fft/torch (medians over rounds of the ratio within a round).
"fwd" is the forward part of the training step, "fwd+bwd" the whole step (torch's forward
therefore records its autograd graph, as in training). --fft-share F (default 0.25) adds, in the
same rounds, the FFT path's fused step on the first F*K kernels (what a worker holding that share
runs, on a device of its own so the two layers' kernel spectra do not evict each other from one
budget): the fused rows then carry "fft_share" and fft_share_vs_full, the median over rounds of
t(share) / t(whole layer), both on the FFT path (ideal: F).

--auto-check asks whether conv_path="auto" picks the fastest path: for every conv layer of the
presets (paper, lenet5, cifar10-quick, vgg-small, on CIFAR-10's 3x32x32 input) at each batch and
thread count, the block's fused step (forward, backward with dX) on each path the layer can take,
forced, in alternating rounds, beside what a fresh "auto" device chose for it (its own timing
runs first, on the same shapes), each layer and thread count in a process of its own (one process
for them all inflated the two-thread direct paths 2-3x). auto/best = median over rounds of t(auto's
path) / t(fastest path in that round). Results: OUT/conv_auto.json and OUT/conv_auto.md.

Correctness first: on a small batch every output and gradient must match torch (allclose, rtol
1e-3, atol 1e-3 x the reference's magnitude) or the script stops before timing anything. Then
one burn-in step per case, then rounds that alternate hetconv and torch (a shared machine slows
both alike) until a time budget is spent; the median is reported, the min and all samples are in
the JSON. FLOPs: forward 2*N*K*C*kh*kw*Ho*Wo; backward 2x that with dx (dW and dX), 1x without.
Results: a markdown table on stdout, OUT/conv.json (the header lines and the rows) and OUT/conv.md,
which `--render OUT/conv.json` rewrites from the JSON alone.

--share-scaling asks whether a CPU worker's time is proportional to the kernels it holds: conv2's
fused step with dx (what a worker runs) at a share of the kernels (w[:share]) against the full
1500, hetconv and torch alternating in one run, one thread and N=32 by default. The ratio is the
median over rounds of t(share) / t(full) within each round (ideal share/1500 = 0.25); the full
layer's hetconv / torch ratio sits beside it. Results: OUT/conv_share_scaling.json (rows plus the
command, machine, BLAS, load during the run and wall time) and OUT/conv_share_scaling.md.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import _common
import _torch_twin

LAYERS = {  # the paper network's conv layers: input (C, H, W), weights (K, C, kh, kw); padding 0
    "conv1": {"x": (3, 32, 32), "w": (500, 3, 5, 5), "need_dx": False},
    "conv2": {"x": (500, 14, 14), "w": (1500, 500, 5, 5), "need_dx": True},
}
PADDING = 0
CHECK_BATCH = 2             # batch of the correctness check
RTOL, ATOL = 1e-3, 1e-3     # atol is relative to the reference's largest magnitude

# fp32 FMA lanes per SM by compute capability (NVIDIA CUDA C programming guide, arithmetic throughput)
CORES_PER_SM = {(5, 0): 128, (5, 2): 128, (5, 3): 128, (6, 0): 64, (6, 1): 128, (6, 2): 128,
                (7, 0): 64, (7, 2): 64, (7, 5): 64, (8, 0): 64, (8, 6): 128, (8, 7): 128,
                (8, 9): 128, (9, 0): 128, (10, 0): 128, (10, 3): 128, (12, 0): 128, (12, 1): 128}
# Fallback: published dense fp32 peaks (TFLOP/s, boost clock), matched as a substring of the name
KNOWN_PEAK_TFLOPS = [("H200", 66.9), ("H100 SXM", 66.9), ("H100 80GB HBM3", 66.9), ("H100 NVL", 60.0),
                     ("H100 PCIe", 51.2), ("H100", 51.2), ("A100", 19.5), ("L40S", 91.6), ("L4", 30.3), ("A10", 31.2),
                     ("RTX 4090", 82.6), ("RTX 3090", 35.6), ("V100", 15.7), ("T4", 8.1)]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="batch 32 only, fewer repeats (~2 min on 2 cores)")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                   help="where conv.json and conv.md go (default bench/results)")
    p.add_argument("--layers", default="conv1,conv2", help="subset to re-run, e.g. conv2")
    p.add_argument("--batches", default=None, help="comma list; default 32,128 (--quick: 32)")
    p.add_argument("--threads", default=None, help="comma list of CPU threads; default 1,2")
    p.add_argument("--budget", type=float, default=None, help="seconds of timing per (layer, N, T)")
    p.add_argument("--keep-blas-env", action="store_true", help="do not drop OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE")
    p.add_argument("--share-scaling", action="store_true",
                   help="conv2 fused fwd+bwd at --share kernels over the full layer (CPU; default T=1, N=32)")
    p.add_argument("--share", type=int, default=375, help="kernels a worker holds in --share-scaling")
    p.add_argument("--cpu-conv-path", default="auto", choices=("auto", "im2col", "shifted", "fft"),
                   help="the CPU device's conv path (auto: timed per layer shape over 20 MFLOP per call; "
                        "below, shifted GEMMs where C*kw >= 64, im2col otherwise)")
    p.add_argument("--fft", action="store_true",
                   help="also time the FFT path (conv_path=fft) against the direct path and torch in the same rounds")
    p.add_argument("--fft-share", type=float, default=0.25, metavar="F",
                   help="with --fft: also the FFT path's fused step on F of the kernels (0 for none; default 0.25)")
    p.add_argument("--auto-check", action="store_true",
                   help="every preset conv layer on each path, forced, against what conv_path=auto picks (CPU)")
    p.add_argument("--render", default="", metavar="JSON", help="run nothing: rewrite conv.md beside a saved conv.json")
    p.add_argument("--auto-check-layer", default="", help=argparse.SUPPRESS)     # PRESET:LAYER:N:THREADS, a child's
    args = p.parse_args()
    if args.share_scaling:
        if args.device != "cpu":
            p.error("--share-scaling measures the CPU device")
        if not 1 <= args.share <= LAYERS["conv2"]["w"][0]:
            p.error(f"--share must be 1..{LAYERS['conv2']['w'][0]}, got {args.share}")
        args.layers = "conv2"
        args.batches = args.batches or "32"
        args.threads = args.threads or "1"
    if not 0 <= args.fft_share <= 1:
        p.error(f"--fft-share must be a fraction in [0, 1], got {args.fft_share}")
    if args.auto_check:
        if args.device != "cpu":
            p.error("--auto-check measures the CPU device")
        args.batches = args.batches or "32"
    args.layers = args.layers.split(",")
    unknown = [name for name in args.layers if name not in LAYERS]
    if unknown:
        p.error(f"unknown layers {unknown!r}; known: {sorted(LAYERS)!r}")
    args.batches = [int(v) for v in (args.batches or ("32" if args.quick else "32,128")).split(",")]
    args.threads = [int(v) for v in (args.threads or "1,2").split(",")]
    # share scaling: a ratio of two timings on a shared machine, so more rounds (one round is
    # ~7 s: 375 and 1500 kernels, hetconv and torch; 11-15 rounds, ~1.5-2 min)
    args.min_reps, args.max_reps = (2, 3) if args.quick else (11, 15) if args.share_scaling else (3, 7)
    if args.budget is None:
        args.budget = 5.0 if args.quick else 75.0 if args.share_scaling else 10.0 if args.auto_check else 30.0
    return args


ARGS = parse_args()
BLAS_ENV_NOTE = _common.reexec_without_blas_overrides(keep=ARGS.keep_blas_env)   # before numpy loads

import numpy as np  # noqa: E402


def geometry(layer, n):
    spec = LAYERS[layer]
    c, h, wd = spec["x"]
    k, _, kh, kw = spec["w"]
    ho, wo = h + 2 * PADDING - kh + 1, wd + 2 * PADDING - kw + 1
    return (n, c, h, wd), spec["w"], (n, k, ho, wo), (n, k, ho // 2, wo // 2)


def flops(layer, n):
    """(forward, forward+backward) FLOPs; backward is dW (= forward) plus dX (= forward) if needed."""
    _, (k, c, kh, kw), (_, _, ho, wo), _ = geometry(layer, n)
    fwd = 2 * n * k * c * kh * kw * ho * wo
    return fwd, fwd * (3 if LAYERS[layer]["need_dx"] else 2)


def make_inputs(layer, n, seed=0):
    """Unit-scale data (no denormals): x, w (PyTorch's default init scale), b, dy, dpooled."""
    x_shape, w_shape, y_shape, p_shape = geometry(layer, n)
    rng = np.random.default_rng(seed)
    fan_in = w_shape[1] * w_shape[2] * w_shape[3]
    return {"x": rng.standard_normal(x_shape, dtype=np.float32),
            "w": (rng.uniform(-1, 1, w_shape) / np.sqrt(fan_in)).astype(np.float32),
            "b": (rng.uniform(-1, 1, w_shape[0]) / np.sqrt(fan_in)).astype(np.float32),
            "dy": rng.standard_normal(y_shape, dtype=np.float32),
            "dpooled": rng.standard_normal(p_shape, dtype=np.float32)}


# ---- one training step of each contender, returning {phase: seconds} ---------------------------
def hetconv_steps(dev, data, need_dx):
    x, w, b, dy, dpooled = (data[k] for k in ("x", "w", "b", "dy", "dpooled"))
    w = w.copy()                                     # changed in place below: not the caller's
    w_dev, b_dev = dev.upload(w), dev.upload(b)      # the fused form keeps parameters resident
    first = (w.flat[0], np.nextafter(w.flat[0], np.float32(np.inf)))
    steps = [0]

    def new_weights(a):
        """One weight moved by one ulp, in place, as an update would move them all: a path that
        caches what it derives from the weights (the FFT path's kernel spectra) pays for it once
        per step, as in training."""
        steps[0] += 1
        a.flat[0] = first[steps[0] % 2]

    def plain():
        new_weights(w)
        t0 = time.perf_counter()
        y = dev.conv2d(x, w, b, padding=PADDING)
        dev.synchronize()
        t1 = time.perf_counter()
        grads = dev.conv2d_backward(x, w, dy, padding=PADDING, need_dx=need_dx)
        dev.synchronize()        # note: without it a GPU timer stops at launch, not at completion
        t2 = time.perf_counter()
        return {"fwd": t1 - t0, "fwd+bwd": t2 - t0, "out": (y, *grads)}

    def fused():
        new_weights(w_dev)
        t0 = time.perf_counter()
        pooled, ctx = dev.conv_relu_pool(x, w_dev, b_dev, PADDING)
        dev.synchronize()
        t1 = time.perf_counter()
        dx, dw, db = dev.conv_relu_pool_backward(ctx, w_dev, dpooled, need_dx)
        dev.synchronize()
        t2 = time.perf_counter()
        return {"fwd": t1 - t0, "fwd+bwd": t2 - t0, "out": (pooled, dx, dev.download(dw), dev.download(db))}

    return {"plain": plain, "fused": fused}


def torch_steps(torch, tdev, data, need_dx, layout="NCHW"):
    F = torch.nn.functional
    t = {k: torch.from_numpy(v).to(tdev) for k, v in data.items()}
    t = dict(zip(t, _torch_twin.in_layout(torch, layout, None, list(t.values()))[1]))   # x, w, dy, dpooled
    x = t["x"].requires_grad_(need_dx)
    w, b = t["w"].requires_grad_(True), t["b"].requires_grad_(True)
    sync = torch.cuda.synchronize if tdev.startswith("cuda") else (lambda: None)

    def step(forward, grad_out):
        def run():
            x.grad = w.grad = b.grad = None          # no gradient accumulation inside the timing
            t0 = time.perf_counter()
            y = forward()
            sync()
            t1 = time.perf_counter()
            y.backward(grad_out)
            sync()
            t2 = time.perf_counter()
            out = [y.detach(), x.grad if need_dx else None, w.grad, b.grad]
            return {"fwd": t1 - t0, "fwd+bwd": t2 - t0,
                    "out": tuple(None if a is None else a.cpu().numpy() for a in out)}
        return run

    return {"plain": step(lambda: F.conv2d(x, w, b, padding=PADDING), t["dy"]),
            "fused": step(lambda: F.max_pool2d(F.relu(F.conv2d(x, w, b, padding=PADDING)), 2), t["dpooled"])}


def timed(step):
    """A step for timing: drop the outputs, keep the phases."""
    def run():
        result = step()
        return {k: v for k, v in result.items() if k != "out"}
    return run


def share_inputs(layer, n, kernels, seed=0):
    """make_inputs with only the first `kernels` kernels: what a worker holding them gets."""
    data = make_inputs(layer, n, seed)
    for name in ("w", "b"):
        data[name] = np.ascontiguousarray(data[name][:kernels])
    for name in ("dy", "dpooled"):
        data[name] = np.ascontiguousarray(data[name][:, :kernels])
    return data


# ---- correctness first -------------------------------------------------------------------------
def check_against_torch(dev, torch, layers):
    """Every output and gradient of both hetconv forms against torch CPU on a small batch."""
    names = ("y", "dx", "dw", "db")
    for layer in layers:
        data = make_inputs(layer, CHECK_BATCH, seed=1)
        need_dx = LAYERS[layer]["need_dx"]
        ours = hetconv_steps(dev, data, need_dx)
        for form, layout in ((f, lay) for f in ("plain", "fused") for lay in _torch_twin.LAYOUTS):
            got, ref = ours[form]()["out"], torch_steps(torch, "cpu", data, need_dx, layout)[form]()["out"]
            for name, a, r in zip(names, got, ref):
                if (a is None) != (r is None):
                    sys.exit(f"ABORT: {layer} {form} {name}: hetconv gave {a is not None and 'an array'} "
                             f"where torch gave {r is not None and 'an array'}")
                if a is None:
                    continue
                a = np.asarray(a)
                if a.shape != r.shape:
                    sys.exit(f"ABORT: {layer} {form} {name} shape {a.shape!r} != torch {r.shape!r}")
                scale = max(float(np.abs(r).max()), 1e-30)
                err = float(np.abs(a - r).max())
                if not np.allclose(a, r, rtol=RTOL, atol=ATOL * scale):
                    sys.exit(f"ABORT: hetconv {dev.describe()} differs from torch ({layout}) on {layer} {form} {name}: "
                             f"max |diff| {err:.3g}, max |torch| {scale:.3g} (rtol {RTOL}, atol {ATOL} x magnitude)")
        print(f"check {layer} (N={CHECK_BATCH}): plain and fused y, dx, dw, db match torch in both layouts", flush=True)


# ---- the GPU's peak ----------------------------------------------------------------------------
def gpu_peak_flops(gpu_name):
    """(fp32 FLOP/s, how it was obtained): 2 * SMs * fp32 lanes per SM * clock, else a table."""
    try:
        from numba import cuda
        gpu = cuda.get_current_device()
        cc = tuple(gpu.compute_capability)
        sms, clock_khz = int(gpu.MULTIPROCESSOR_COUNT), int(gpu.CLOCK_RATE)
        if cc in CORES_PER_SM and clock_khz > 0:
            cores = CORES_PER_SM[cc]
            return (2.0 * sms * cores * clock_khz * 1e3,
                    f"2 x {sms} SMs x {cores} lanes (cc {cc[0]}.{cc[1]}) x {clock_khz / 1e6:.3f} GHz")
    except Exception as e:   # attribute missing on this driver: fall through to the table
        print(f"note: could not read SM count/clock from numba.cuda ({' '.join(str(e).split())})")
    for key, tflops in KNOWN_PEAK_TFLOPS:
        if key.lower() in gpu_name.lower():
            return tflops * 1e12, f"published peak for {key}"
    return None, "unknown GPU: no peak"


# ---- share scaling ---------------------------------------------------------------------------
def share_scaling(args, torch, header, open_device):
    """conv2 fused fwd+bwd at args.share kernels and at all of them, hetconv and torch, alternating."""
    layer, started = "conv2", time.time()
    full = LAYERS[layer]["w"][0]
    check_dev = open_device("cpu", threads=max(args.threads), conv_path=args.cpu_conv_path)
    check_against_torch(check_dev, torch, [layer])
    del check_dev
    loads = [os.getloadavg()[0]]

    def sampling_load(step):
        def run():
            result = step()
            loads.append(os.getloadavg()[0])
            return result
        return run

    rows, summary = [], []
    for threads in args.threads:
        dev = open_device("cpu", threads=threads, conv_path=args.cpu_conv_path)
        torch.set_num_threads(threads)
        print(f"timing {dev.describe()} vs torch with {torch.get_num_threads()} threads", flush=True)
        for n in args.batches:
            cases = {}
            for kernels in (args.share, full):
                data = share_inputs(layer, n, kernels)
                cases[("hetconv", kernels)] = sampling_load(timed(hetconv_steps(dev, data, True)["fused"]))
                cases[("torch", kernels)] = sampling_load(timed(torch_steps(torch, "cpu", data, True)["fused"]))
            samples = _common.time_interleaved(cases, args.min_reps, args.max_reps, args.budget)
            stats = {case: _common.summarize(samples[case]["fwd+bwd"]) for case in cases}

            def round_ratios(num, den):
                """num/den in each round, both timed in the same round"""
                a, b = samples[num]["fwd+bwd"], samples[den]["fwd+bwd"]
                return [x / y for x, y in zip(a, b)]

            def per_round(num, den):
                return float(np.median(round_ratios(num, den)))

            for who in ("hetconv", "torch"):
                rows.append({"who": who, "layer": layer, "N": n, "threads": threads, "form": "fused",
                             "phase": "fwd+bwd", "need_dx": True, "share": args.share, "full": full,
                             "share_ms": stats[(who, args.share)], "full_ms": stats[(who, full)],
                             "share_ratio": per_round((who, args.share), (who, full)),
                             "share_ratio_quartiles": [float(q) for q in np.percentile(
                                 round_ratios((who, args.share), (who, full)), [25, 75])],
                             "rounds": len(samples[(who, full)]["fwd+bwd"]),
                             "share_ratio_of_medians": stats[(who, args.share)]["median_ms"] / stats[(who, full)]["median_ms"],
                             "share_ratio_of_mins": stats[(who, args.share)]["min_ms"] / stats[(who, full)]["min_ms"],
                             "ideal": args.share / full})
            vs_torch = {"full_vs_torch": per_round(("hetconv", full), ("torch", full)),
                        "full_vs_torch_of_mins": stats[("hetconv", full)]["min_ms"] / stats[("torch", full)]["min_ms"],
                        "share_vs_torch": per_round(("hetconv", args.share), ("torch", args.share))}
            rows[-2].update(vs_torch)
            summary.append((threads, n, rows[-2], rows[-1]))
            print(f"  N={n} T={threads}: hetconv {rows[-2]['share_ratio']:.3f} of full at {args.share}/{full} "
                  f"(torch {rows[-1]['share_ratio']:.3f}); full layer hetconv/torch {vs_torch['full_vs_torch']:.2f}", flush=True)
        del dev

    wall_s = time.time() - started
    load = {"start": loads[0], "max": max(loads), "mean": float(np.mean(loads)), "end": os.getloadavg()[0],
            "samples": len(loads)}
    headers = ["N", "T", "kernels", "hetconv ms", f"hetconv t({args.share})/t({full})", "torch ms",
               f"torch t({args.share})/t({full})", "hetconv/torch"]
    table = []

    def quartile_cell(row):
        low, high = row["share_ratio_quartiles"]
        return f"{row['share_ratio']:.3f} ({low:.3f}-{high:.3f})"

    for threads, n, ours, theirs in summary:
        for kernels, key in ((args.share, "share_ms"), (full, "full_ms")):
            table.append([n, threads, kernels, fmt(ours[key]["median_ms"]),
                          quartile_cell(ours) if kernels == args.share else "-",
                          fmt(theirs[key]["median_ms"]),
                          quartile_cell(theirs) if kernels == args.share else "-",
                          f"{ours['share_vs_torch' if kernels == args.share else 'full_vs_torch']:.2f}"])
    md = _common.markdown_table(headers, table)
    print("\n" + md)
    load_line = (f"1-minute load average during the run: {load['start']:.2f} at start, mean {load['mean']:.2f}, "
                 f"max {load['max']:.2f} ({load['samples']} samples), {load['end']:.2f} at end; wall time {wall_s:.0f} s")
    notes = ["", load_line + ". Layer conv2 (x (N,500,14,14), w (K,500,5,5)), fused conv+bias+ReLU+2x2 max-pool, "
             "forward and backward with dx. ms = median of the timed runs. t(share)/t(full) = median over "
             f"{summary[0][2]['rounds']} rounds of the ratio within each round, its quartiles in brackets "
             f"(ideal {args.share / full:.3f}); hetconv/torch = the same for hetconv "
             "against torch at that kernel count (<= 1.00: hetconv at least as fast)."]
    result = {"command": header[0].partition(": ")[2], "machine": _common.cpu_model(), "isa": _common.cpu_isa_flags(),
              "blas": _common.blas_info(), "blas_env": BLAS_ENV_NOTE, "torch": _common.torch_info(torch),
              "cpu_conv_path": args.cpu_conv_path, "out": _common.relative_path(args.out), "load_average_1min": load, "wall_s": wall_s,
              "timing": {"budget_s": args.budget, "min_reps": args.min_reps, "max_reps": args.max_reps}, "rows": rows}
    json_path, md_path = _common.write_results(
        args.out, "conv_share_scaling", result,
        "\n".join(f"- {h}" for h in header) + f"\n- ISA: {' '.join(result['isa'])}\n\n" + md + "\n".join(notes))
    print(f"\nwrote {_common.relative_path(json_path)} and {_common.relative_path(md_path)}")


# ---- whether conv_path="auto" picks the fastest path ---------------------------------------------
AUTO_CHECK_PRESETS = ("paper", "lenet5", "cifar10-quick", "vgg-small")
AUTO_CHECK_INPUT, AUTO_CHECK_CLASSES = (3, 32, 32), 10      # CIFAR-10
AUTO_CHECK_TOLERANCE = 1.05     # auto's path may be at most 5% slower than the fastest one
FORCED_PATHS = ("im2col", "shifted", "fft")


def block_step(dev, x, w, b, dout, block):
    """A worker's fused step on one block, conv_block then its backward with dX, the weights moved
    by one ulp before each (what a path caches from them is paid once per step, as in training)."""
    w = w.copy()
    first = (w.flat[0], np.nextafter(w.flat[0], np.float32(np.inf)))
    steps = [0]

    def run():
        steps[0] += 1
        w.flat[0] = first[steps[0] % 2]
        t0 = time.perf_counter()
        out, ctx = dev.conv_block(x, w, b, block)
        dev.conv_block_backward(ctx, w, dout, True)
        return {"fwd+bwd": time.perf_counter() - t0}
    return run


def auto_check(args, header, open_device):
    """Each preset conv layer's fused step on every path it can take, forced, in alternating rounds,
    against the path a fresh conv_path="auto" device picked for the same call. Each layer and thread
    count runs in a process of its own (auto_check_layer): in one process holding a device per path
    and per layer, vgg-small's two-thread direct paths ran 2-3x slower than in a fresh one, and which
    path was fastest moved from run to run."""
    from hetconv.net.presets import preset
    started, loads = time.time(), [os.getloadavg()[0]]
    rows = []
    for threads in args.threads:
        for name in AUTO_CHECK_PRESETS:
            for index, _ in enumerate(preset(name, AUTO_CHECK_INPUT, AUTO_CHECK_CLASSES).conv_layers()):
                for n in args.batches:
                    cmd = [sys.executable, os.path.abspath(__file__), "--auto-check", "--budget", str(args.budget),
                           "--auto-check-layer", f"{name}:{index}:{n}:{threads}"]
                    child = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
                    if child.returncode != 0:
                        sys.exit(f"auto check of {name} layer {index} (N={n}, T={threads}) failed: "
                                 f"{child.stderr.strip()[-2000:]}")
                    row = json.loads(child.stdout.strip().splitlines()[-1])
                    rows.append(row)
                    loads.append(os.getloadavg()[0])
                    print(f"  {name} layer {index} N={n} T={threads}: "
                          + ", ".join(f"{p} {row['paths'][p]['median_ms']:.1f} ms" for p in row["paths"])
                          + f"; auto picked {row['auto']} ({row['auto_vs_best']:.3f} of the fastest per round)",
                          flush=True)
    doc = {"header": header, "isa": _common.cpu_isa_flags(), "wall_s": time.time() - started,
           "load_average_1min": {"start": loads[0], "max": max(loads), "mean": float(np.mean(loads)),
                                 "end": os.getloadavg()[0], "samples": len(loads)},
           "tolerance": AUTO_CHECK_TOLERANCE, "timing": {"budget_s": args.budget, "min_reps": args.min_reps,
                                                         "max_reps": args.max_reps}, "rows": rows}
    json_path, md_path = _common.write_results(args.out, "conv_auto", doc, auto_check_markdown(doc))
    print("\n" + auto_check_markdown(doc) + f"\n\nwrote {_common.relative_path(json_path)} and "
          f"{_common.relative_path(md_path)}")


def auto_check_layer(args, open_device):
    """One layer of the auto check (--auto-check-layer PRESET:LAYER:N:THREADS), in this process
    alone: prints its row as JSON on the last line."""
    from hetconv.devices.base import block_output_shape
    from hetconv.net.presets import preset
    name, index, n, threads = args.auto_check_layer.split(":")
    index, n, threads = int(index), int(n), int(threads)
    layer = preset(name, AUTO_CHECK_INPUT, AUTO_CHECK_CLASSES).conv_layers()[index]
    rng = np.random.default_rng(index)
    w_shape = (layer.kernels, layer.in_channels) + tuple(layer.kernel)
    fan_in = w_shape[1] * w_shape[2] * w_shape[3]
    x = rng.standard_normal((n,) + tuple(layer.input_shape), dtype=np.float32)
    w = (rng.uniform(-1, 1, w_shape) / np.sqrt(fan_in)).astype(np.float32)
    b = (rng.uniform(-1, 1, w_shape[0]) / np.sqrt(fan_in)).astype(np.float32)
    block = layer.block
    dout = rng.standard_normal(block_output_shape(x.shape, w.shape, block), dtype=np.float32)
    auto = open_device("cpu", threads=threads, conv_path="auto")
    t0 = time.perf_counter()
    auto.conv_block_backward(auto.conv_block(x, w, b, block)[1], w, dout, True)
    first_call_s = time.perf_counter() - t0
    ((call, chosen),), (why,) = auto.conv_paths().items(), auto.describe_conv_paths()
    del auto
    cases = {}
    forced = {path: open_device("cpu", threads=threads, conv_path=path) for path in FORCED_PATHS}
    for path, dev in forced.items():    # the paths this layer takes: a forced one may decline
        step = block_step(dev, x, w, b, dout, block)
        step()
        if dev.conv_paths()[call] == path:
            cases[path] = step
    samples = _common.time_interleaved(cases, args.min_reps, args.max_reps, args.budget)
    rounds = [dict(zip(cases, ts)) for ts in zip(*(samples[p]["fwd+bwd"] for p in cases))]
    stats = {path: _common.summarize(samples[path]["fwd+bwd"]) for path in cases}
    ratio = float(np.median([r[chosen] / min(r.values()) for r in rounds]))
    ho_wo = layer.conv_shape[1] * layer.conv_shape[2]
    row = {"preset": name, "layer": index, "call": call, "x": list(x.shape), "w": list(w_shape),
           "block": str(block), "N": n, "threads": threads,
           "forward_mflop": 2e-6 * n * ho_wo * w.size, "paths": stats, "auto": chosen, "auto_why": why,
           "auto_first_call_s": first_call_s, "fastest": min(stats, key=lambda p: stats[p]["median_ms"]),
           "auto_vs_best": ratio, "within_tolerance": ratio <= AUTO_CHECK_TOLERANCE,
           "rounds": len(rounds)}
    print(json.dumps(row))


def auto_check_markdown(doc):
    """conv_auto.md, from conv_auto.json's contents alone."""
    headers = ["preset", "layer", "x", "w", "T", "fwd MFLOP", *(f"{p} ms" for p in FORCED_PATHS),
               "auto picks", "fastest", "auto/fastest", "auto's first call s"]
    table = []
    for r in doc["rows"]:
        table.append([r["preset"], r["layer"], "x".join(map(str, r["x"])), "x".join(map(str, r["w"])), r["threads"],
                      f"{r['forward_mflop']:.0f}",
                      *(fmt(r["paths"][p]["median_ms"]) if p in r["paths"] else "-" for p in FORCED_PATHS),
                      r["auto"], r["fastest"], f"{r['auto_vs_best']:.3f}" + ("" if r["within_tolerance"] else " (over)"),
                      f"{r['auto_first_call_s']:.2f}"])
    load = doc["load_average_1min"]
    missed = [r for r in doc["rows"] if not r["within_tolerance"]]
    notes = (f"1-minute load average during the run: {load['start']:.2f} at start, mean {load['mean']:.2f}, max "
             f"{load['max']:.2f} ({load['samples']} samples), {load['end']:.2f} at end; wall time "
             f"{doc['wall_s'] / 60:.1f} min. ISA: {' '.join(doc['isa'])}. Each layer's fused step (conv + bias + "
             "activation + pool, forward and backward with dX) on CIFAR-10's 3x32x32 input, each path forced on a "
             "device of its own (\"-\": the path does not take the layer), in alternating rounds; ms = median. "
             "auto picks = what a fresh conv_path=\"auto\" device chose on its first call with that shape (its "
             "reason is in the JSON: timed, or the rule under the timing threshold); auto/fastest = median over "
             f"rounds of t(auto's path) / t(fastest path in that round), over {doc['tolerance']} marked; auto's "
             "first call s = that first call, its own timing included. "
             + (f"{len(missed)} of {len(doc['rows'])} layers over the tolerance." if missed else
                f"All {len(doc['rows'])} layers within the tolerance."))
    return ("\n".join(f"- {h}" for h in doc["header"]) + "\n\n" + _common.markdown_table(headers, table)
            + "\n\n" + notes)


# ---- main ---------------------------------------------------------------------------------------
def direct_options(args):
    """The CPU device's options for the "hetconv" contender. Beside the FFT path (--fft), "auto"
    would time the FFT path too and pick it, so there it stays on its untimed rule: the direct
    path (shifted GEMMs or im2col) it takes without timing."""
    if args.fft and args.cpu_conv_path == "auto":
        return {"conv_path": "auto", "auto_timed_min_flops": float("inf")}
    return {"conv_path": args.cpu_conv_path}


def fmt(v, digits=1):
    return "-" if v is None else f"{v:.{digits}f}"


def markdown(doc):
    """conv.md, from conv.json's contents alone."""
    rows = doc["rows"]
    peak = any("peak_fraction" in r for r in rows)
    with_torch = any(r["torch"] for r in rows)
    headers = ["layer", "N", "T", "form", "phase", "hetconv ms", "GFLOP/s"]
    headers += ["% peak"] if peak else []
    layouts = any(r.get("torch_channels_last") for r in rows)      # results saved before: NCHW alone
    headers += (["torch NCHW ms", "torch channels_last ms", "faster", "GFLOP/s", "ratio", "ratio of mins"] if layouts
                else ["torch ms", "GFLOP/s", "ratio", "ratio of mins"]) if with_torch else []
    with_fft = any("fft" in r for r in rows)
    headers += ["fft ms", "fft spread", "fft/direct"] + (["fft/torch"] if with_torch else []) if with_fft else []
    with_share = any("fft_share" in r for r in rows)
    headers += ["fft share", "share ms", "share/whole"] if with_share else []
    table = []
    for r in rows:
        cells = [r["layer"], r["N"], r["threads"] or "-", r["form"], r["phase"],
                 fmt(r["hetconv"]["median_ms"]), fmt(r["hetconv_gflops"])]
        cells += [fmt(100 * r["peak_fraction"])] if peak else []
        if with_torch:
            cells += ([fmt(r["torch"]["median_ms"]), fmt(r["torch_channels_last"]["median_ms"]), r["torch_layout"]]
                      if layouts else [fmt(r["torch"]["median_ms"])])
            cells += [fmt(r["torch_gflops"]), f"{r['ratio']:.2f}", f"{r['ratio_min']:.2f}"]
        if with_fft:
            cells += [fmt(r["fft"]["median_ms"]), f"{r['fft']['spread']:.0%}", f"{r['fft_vs_direct']:.2f}"]
            cells += [f"{r['fft_vs_torch']:.2f}"] if with_torch else []
        if with_share:
            cells += ([r["share_kernels"], fmt(r["fft_share"]["median_ms"]), f"{r['fft_share_vs_full']:.3f}"]
                      if "fft_share" in r else ["-", "-", "-"])
        table.append(cells)
    wall = f" Wall time {doc['wall_s'] / 60:.1f} min." if "wall_s" in doc else ""
    if "load_average_1min" in doc:
        load = doc["load_average_1min"]
        wall += (f" 1-minute load average during the run: {load['start']:.2f} at start, mean {load['mean']:.2f}, "
                 f"max {load['max']:.2f} ({load['samples']} samples). ISA: {' '.join(doc.get('isa', []))}.")
    if with_fft:
        wall += (" fft = the CPU device's FFT path (conv_path=fft) timed in the same rounds; fft/direct and "
                 "fft/torch = median over rounds of the ratio within a round; fft spread = (max - min) / median.")
    if with_share:
        wall += (" fft share = kernels of the layer held (the first ones), on the FFT path, fused step, timed in "
                 "the same rounds on a device of its own; share/whole = median over rounds of its time over the "
                 "whole layer's on the FFT path (ideal: share / kernels).")
    if layouts:
        wall += (" torch runs in both memory layouts (channels_last: x, w and the output gradients in "
                 "channels-last memory); faster = the layout with the lesser fwd+bwd median for the row's layer, N, "
                 "T and form, which GFLOP/s, ratio, ratio of mins and fft/torch take.")
    notes = (f"{doc['load_end']} at end.{wall} ms = median of the timed runs; ratio = hetconv / torch "
             "medians (<= 1.00: hetconv at least as fast); ratio of mins = the same on the fastest runs, "
             "less sensitive to a shared machine. fused = conv+bias+ReLU+2x2 max-pool (torch: "
             "F.max_pool2d(F.relu(F.conv2d))). FLOPs count the convolutions only.")
    return ("\n".join(f"- {h}" for h in doc["header"]) + "\n\n" + _common.markdown_table(headers, table)
            + "\n" + notes)


def main():
    args = ARGS
    if args.render:
        stem, render = ("conv_auto", auto_check_markdown) if args.auto_check else ("conv", markdown)
        print(f"wrote {_common.render_saved(args.render, stem, render)}")
        return
    t_start = time.perf_counter()
    from threadpoolctl import threadpool_info  # noqa: F401  (fail early if the venv lacks it)
    # hetconv first: its CPU device sets OMP_WAIT_POLICY before any OpenMP runtime starts. With torch
    # first, torch's libgomp (which Numba's threads then share) spins between regions and hetconv's
    # two-thread direct paths ran 2-3x slower here than in a hetconv process (vgg-small's layer 5,
    # shifted: 42.8 ms against 15.6); torch, in the same process, then runs under the same policy.
    from hetconv.devices import DeviceError, open_device
    if args.auto_check_layer:
        return auto_check_layer(args, open_device)
    try:
        import torch
    except ImportError:
        sys.exit("bench/conv.py needs torch: pip install -e '.[bench]' (torch==2.13.0)")

    is_cuda = args.device.startswith("cuda")
    if is_cuda and os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        sys.exit("refusing to benchmark under Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM is set): "
                 "its timings say nothing about a GPU. Unset it and run on a machine with a GPU.")
    header = [f"command: {_common.recorded_command('conv.py', sys.argv[1:])}",
              f"machine: {_common.cpu_model()}; {_common.load_average()} at start",
              f"BLAS env: {BLAS_ENV_NOTE}",
              f"hetconv cpu conv path: {args.cpu_conv_path} (auto: the fastest path by timing where a call is over "
              f"20 MFLOP, else shifted GEMMs where C*kw >= 64, im2col below)"
              + ("; with --fft, the direct contender is auto's untimed rule (shifted GEMMs where C*kw >= 64 and "
                 "K < 0.4 C*kw, else im2col)" if args.fft and args.cpu_conv_path == "auto" else ""),
              *(f"BLAS: {line}" for line in _common.blas_info()),
              *_common.torch_info(torch)]
    print("\n".join(header), flush=True)
    if args.share_scaling:
        return share_scaling(args, torch, header, open_device)
    if args.auto_check:
        return auto_check(args, header, open_device)

    peak, peak_note = None, ""
    if is_cuda:
        try:
            devices = {None: open_device(args.device)}
        except DeviceError as e:
            sys.exit(f"no GPU to benchmark: {e}")
        peak, peak_note = gpu_peak_flops(devices[None].describe())
        torch_dev = "cuda" if torch.cuda.is_available() else None
        header.append(f"GPU: {devices[None].describe()}; fp32 peak "
                      f"{fmt(peak and peak / 1e12)} TFLOP/s ({peak_note})")
        if torch_dev is None:
            header.append("torch has no CUDA here: no torch comparison on the GPU")
        print("\n".join(header[-2 if torch_dev is None else -1:]), flush=True)
    else:
        devices = {t: None for t in args.threads}        # opened per thread count, below
        torch_dev = "cpu"

    check_dev = devices[None] if is_cuda else open_device("cpu", threads=max(args.threads), conv_path=args.cpu_conv_path)
    check_against_torch(check_dev, torch, args.layers)
    del check_dev
    with_fft = args.fft and not is_cuda
    if with_fft:
        check_against_torch(open_device("cpu", threads=max(args.threads), conv_path="fft"), torch, args.layers)
    loads = [os.getloadavg()[0]]

    rows = []
    for threads in devices:
        if is_cuda:
            dev = devices[None]
            print(f"timing {dev.describe()}" + (" vs torch on the same GPU" if torch_dev else ""), flush=True)
        else:
            dev = open_device("cpu", threads=threads, **direct_options(args))   # sets Numba's (process-wide) and BLAS threads
            fft_dev = open_device("cpu", threads=threads, conv_path="fft") if with_fft else None
            share_dev = open_device("cpu", threads=threads, conv_path="fft") if with_fft and args.fft_share else None
            torch.set_num_threads(threads)
            print(f"timing {dev.describe()} vs torch with {torch.get_num_threads()} threads", flush=True)
        for layer in args.layers:
            need_dx = LAYERS[layer]["need_dx"]
            for n in args.batches:
                data = make_inputs(layer, n)
                cases = {("hetconv", form): timed(step) for form, step in hetconv_steps(dev, data, need_dx).items()}
                if with_fft:
                    cases.update({("fft", form): timed(step) for form, step in hetconv_steps(fft_dev, data, need_dx).items()})
                share_kernels = max(1, round(args.fft_share * LAYERS[layer]["w"][0])) if share_dev else None
                if share_kernels:
                    cases[("fft-share", "fused")] = timed(hetconv_steps(
                        share_dev, share_inputs(layer, n, share_kernels), need_dx)["fused"])
                if torch_dev is not None:
                    cases.update({("torch", form): timed(step)
                                  for form, step in torch_steps(torch, torch_dev, data, need_dx).items()})
                    cases.update({("torch channels_last", form): timed(step)
                                  for form, step in torch_steps(torch, torch_dev, data, need_dx,
                                                                "channels_last").items()})
                samples = _common.time_interleaved(cases, args.min_reps, args.max_reps, args.budget)
                loads.append(os.getloadavg()[0])

                def per_round(num, den, phase):
                    """median over rounds of num/den, both timed in the same round"""
                    return float(np.median([a / b for a, b in zip(samples[num][phase], samples[den][phase])]))
                fwd_flops, step_flops = flops(layer, n)
                for form in ("plain", "fused"):
                    # PyTorch's faster layout for this layer, N, T and form: by its whole step's median
                    faster = (min(("torch", "torch channels_last"),
                                  key=lambda who: float(np.median(samples[(who, form)]["fwd+bwd"])))
                              if torch_dev else None)
                    for phase, flop in (("fwd", fwd_flops), ("fwd+bwd", step_flops)):
                        ours = _common.summarize(samples[("hetconv", form)][phase])
                        nchw = _common.summarize(samples[("torch", form)][phase]) if torch_dev else None
                        last = _common.summarize(samples[("torch channels_last", form)][phase]) if torch_dev else None
                        ref = last if faster == "torch channels_last" else nchw
                        row = {"layer": layer, "N": n, "threads": threads, "form": form, "phase": phase,
                               "need_dx": need_dx, "gflop": flop / 1e9, "device": dev.describe(),
                               "hetconv": ours, "hetconv_gflops": flop / ours["median_ms"] / 1e6,
                               # torch: NCHW's; torch_layout: the faster layout, which the ratios take
                               "torch": nchw, "torch_channels_last": last,
                               "torch_layout": faster and ("channels_last" if faster != "torch" else "NCHW"),
                               "torch_gflops": ref and flop / ref["median_ms"] / 1e6,
                               "ratio": ref and ours["median_ms"] / ref["median_ms"],
                               "ratio_min": ref and ours["min_ms"] / ref["min_ms"]}
                        if peak:
                            row["peak_fraction"] = row["hetconv_gflops"] * 1e9 / peak
                        if with_fft:
                            row["fft"] = _common.summarize(samples[("fft", form)][phase])
                            row["fft_vs_direct"] = per_round(("fft", form), ("hetconv", form), phase)
                            row["fft_vs_torch"] = ref and per_round(("fft", form), (faster, form), phase)
                        if share_kernels and form == "fused":
                            row["share_kernels"] = share_kernels
                            row["fft_share"] = _common.summarize(samples[("fft-share", form)][phase])
                            row["fft_share_vs_full"] = per_round(("fft-share", form), ("fft", form), phase)
                            print(f"  {layer} N={n} T={threads} {form:5s} {phase:7s} fft on {share_kernels} kernels "
                                  f"{row['fft_share']['median_ms']:9.1f} ms  of the whole layer's {row['fft_share_vs_full']:.3f}",
                                  flush=True)
                            print(f"  {layer} N={n} T={threads} {form:5s} {phase:7s} fft {row['fft']['median_ms']:9.1f} ms"
                                  f"  fft/direct {row['fft_vs_direct']:.2f}" + (f"  fft/torch {row['fft_vs_torch']:.2f}" if ref else "")
                                  + f"  (spread {row['fft']['spread']:.0%})", flush=True)
                        rows.append(row)
                        print(f"  {layer} N={n} T={threads} {form:5s} {phase:7s} hetconv "
                              f"{ours['median_ms']:9.1f} ms {row['hetconv_gflops']:6.1f} GFLOP/s"
                              + (f" | torch NCHW {nchw['median_ms']:9.1f} ms, channels_last {last['median_ms']:9.1f} ms"
                                 f"  ratio to {row['torch_layout']} {row['ratio']:.2f}" if ref else "")
                              + f"  ({len(ours['samples_ms'])} runs, spread {ours['spread']:.0%})", flush=True)
        if not is_cuda:
            del dev, fft_dev, share_dev

    rows.sort(key=lambda r: (r["layer"], r["N"], r["threads"] or 0, r["form"] != "plain", r["phase"]))
    doc = {"header": header, "load_end": _common.load_average(), "wall_s": time.perf_counter() - t_start, "rows": rows,
           "isa": _common.cpu_isa_flags(),
           "load_average_1min": {"start": loads[0], "max": max(loads), "mean": float(np.mean(loads)),
                                 "end": os.getloadavg()[0], "samples": len(loads)}}
    md = markdown(doc)
    print("\n" + md)
    json_path, md_path = _common.write_results(args.out, "conv", doc, md)
    print(f"\nwrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
