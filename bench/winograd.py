"""Winograd F(4x4, 3x3) against oneDNN's direct convolution and PyTorch, per 3x3 stride-1 layer.

Each case is one conv block's forward and backward with dX (conv + bias, no activation or pool:
the conv alone, as a resnet's conv is followed by its BatchNorm) on hetconv's CPU device with the
path forced, `winograd` and `direct-dnnl`, and PyTorch's conv2d + autograd in NCHW and
channels_last, in alternating rounds (bench/_common.time_interleaved). The ratios are within the
run: `direct/winograd` > 1 where Winograd is faster, `torch/winograd` against PyTorch's faster
layout. Each thread count runs in processes of its own (Numba's and OpenMP's thread counts are
per process), hetconv's paths in one and PyTorch's in another: each side's OpenMP threads wait as
its users' do (hetconv's sleep, OMP_WAIT_POLICY=PASSIVE; PyTorch's spin first, GNU OpenMP's
default), which a process can set only once, before its OpenMP runtime starts. With PyTorch
imported first, hetconv's oneDNN GEMMs ran on PyTorch's spinning runtime, as no hetconv run does.
The error column is Winograd's against a float64 reference on the case's own tensors (max
|difference| over max |reference|, forward and dX and dW).

    python bench/winograd.py --threads 1,2 --out bench/results/winograd
"""
import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (before numpy: may re-exec without BLAS overrides)

# resnet18's (CIFAR) 3x3 stride-1 layers and vgg-small's widest, at a worker's and a whole batch
LAYERS = {"r18-64x32": (64, 64, 32), "r18-128x16": (128, 128, 16), "r18-256x8": (256, 256, 8),
          "r18-512x4": (512, 512, 4), "vgg-64x16": (64, 64, 16)}


def run_one(threads, batches, budget, side):
    """`side` "hetconv": Winograd and the direct path, and Winograd's error; "torch": PyTorch's
    two layouts, in a process where hetconv's device was never imported."""
    import numpy as np
    if side == "hetconv":
        from hetconv.devices import open_device
        from hetconv.devices.base import ConvBlock
        from hetconv.net import reference as R
        block = ConvBlock(padding=1, activation="none", pool="none")
        devices = {p: open_device("cpu", threads=threads, conv_path=p) for p in ("winograd", "direct-dnnl")}
    else:
        import torch
        torch.set_num_threads(threads)
    rows = []
    for name, (c, k, hw) in LAYERS.items():
        for n in batches:
            rng = np.random.default_rng(0)
            x = rng.standard_normal((n, c, hw, hw)).astype(np.float32)
            w = (rng.standard_normal((k, c, 3, 3)) / np.sqrt(9 * c)).astype(np.float32)
            b = np.zeros(k, np.float32)
            dout = rng.standard_normal((n, k, hw, hw)).astype(np.float32)

            def hetconv(dev):
                def step():
                    t0 = time.perf_counter()
                    out, ctx = dev.conv_block(x, w, b, block)
                    t1 = time.perf_counter()
                    dev.conv_block_backward(ctx, w, dout, True)
                    return {"fwd": t1 - t0, "fwd+bwd": time.perf_counter() - t0}
                return step

            def pytorch(layout):
                fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
                tx = torch.from_numpy(x).contiguous(memory_format=fmt).requires_grad_()
                tw = torch.from_numpy(w).contiguous(memory_format=fmt).requires_grad_()
                tb = torch.from_numpy(b).requires_grad_()
                tg = torch.from_numpy(dout).contiguous(memory_format=fmt)

                def step():
                    t0 = time.perf_counter()
                    y = torch.nn.functional.conv2d(tx, tw, tb, padding=1)
                    t1 = time.perf_counter()
                    y.backward(tg)
                    return {"fwd": t1 - t0, "fwd+bwd": time.perf_counter() - t0}
                return step

            if side == "hetconv":
                cases = {"winograd": hetconv(devices["winograd"]), "direct-dnnl": hetconv(devices["direct-dnnl"])}
            else:
                cases = {"torch NCHW": pytorch("NCHW"), "torch channels_last": pytorch("channels_last")}
            samples = _common.time_interleaved(cases, min_reps=5, max_reps=60, budget_s=budget)
            med = {case: {phase: _common.summarize(s)["median_ms"] for phase, s in phases.items()}
                   for case, phases in samples.items()}
            row = {"layer": name, "batch": n, "threads": threads, "median_ms": med}
            if side == "hetconv":
                out, ctx = devices["winograd"].conv_block(x, w, b, block)
                dx, dw, _ = devices["winograd"].conv_block_backward(ctx, w, dout, True)
                ref = R._conv64(x, w, b, 1, 1)
                rdx, rdw = R._conv_backward64(x, w, dout, 1, 1, True)[:2]
                row["error"] = max(float(np.abs(a - r).max() / np.abs(r).max())
                                   for a, r in ((out, ref), (dx, rdx), (dw, rdw)))
                row["paths"] = {p: d.conv_path_choices()[-1]["path"] for p, d in devices.items()}
            rows.append(row)
            print(f"  {threads} thread(s) {name} N={n}: " + ", ".join(
                f"{case} {m['fwd+bwd']:.1f} ms" for case, m in med.items())
                + (f"; error {row['error']:.1e}" if "error" in row else ""), flush=True)
    return rows


def markdown(doc):
    lines = ["# Winograd F(4x4, 3x3) against oneDNN's direct convolution and PyTorch", ""]
    lines += _common.run_header(doc)
    lines += [f"BLAS: {doc['blas']}. {doc['torch']}.", "",
              "Forward and backward with dX of one conv (bias, no activation or pool), median ms over "
              "alternating rounds; `direct/winograd` and `torch/winograd` > 1 where Winograd is faster "
              "(torch: its faster layout, named). Error: Winograd's against float64, forward, dX and dW.",
              "",
              "hetconv's paths and PyTorch's ran in processes of their own, each with its own OpenMP waiting "
              "(hetconv's threads sleep, PyTorch's spin first, as each runs for its users)."
              if doc.get("sides") == "separate" else
              "hetconv and PyTorch ran in one process with PyTorch imported first: hetconv's oneDNN GEMMs ran "
              "on PyTorch's spinning OpenMP runtime, not as a hetconv run does.", ""]
    table = []
    for r in doc["rows"]:
        m = r["median_ms"]
        torch_best = min(("torch NCHW", "torch channels_last"), key=lambda c: m[c]["fwd+bwd"])
        table.append([r["threads"], r["layer"], r["batch"], f"{m['winograd']['fwd+bwd']:.1f}",
                      f"{m['direct-dnnl']['fwd+bwd']:.1f}", f"{m[torch_best]['fwd+bwd']:.1f} ({torch_best[6:]})",
                      f"**{m['direct-dnnl']['fwd+bwd'] / m['winograd']['fwd+bwd']:.2f}**",
                      f"{m[torch_best]['fwd+bwd'] / m['winograd']['fwd+bwd']:.2f}", f"{r['error']:.1e}"])
    lines.append(_common.markdown_table(["threads", "layer (C=K x H=W)", "N", "winograd ms", "direct-dnnl ms",
                                         "torch ms", "direct/winograd", "torch/winograd", "error"], table))
    return "\n".join(lines)


def main(argv=None):
    note = _common.reexec_without_blas_overrides()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", default="1,2", help="comma list; each count in a process of its own")
    p.add_argument("--batches", default="16,32")
    p.add_argument("--budget", type=float, default=3.0, help="seconds of rounds per case at least")
    p.add_argument("--out", default="", help="folder for winograd.json and .md (default: print only)")
    p.add_argument("--render", default="", help="only rewrite the .md beside this saved JSON")
    p.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)      # a child process's thread count
    p.add_argument("--side", default="hetconv", help=argparse.SUPPRESS)       # ... and what it times
    args = p.parse_args(argv)
    if args.render:
        print(f"wrote {_common.render_saved(args.render, 'winograd', markdown)}")
        return
    batches = [int(v) for v in args.batches.split(",")]
    if args.one:
        print(json.dumps(run_one(args.one, batches, args.budget, args.side)))
        return
    started, load = time.time(), _common.load_average()
    rows = []
    for threads in [int(v) for v in args.threads.split(",")]:
        sides = {}
        for side in ("hetconv", "torch"):
            print(f"{threads} thread(s), {side} ...", flush=True)
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", str(threads), "--side", side,
                                   "--batches", args.batches, "--budget", str(args.budget)],
                                  capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"the {threads}-thread {side} run failed:\n{done.stderr[-2000:]}")
            print("\n".join(line for line in done.stdout.splitlines() if line.startswith("  ")))
            sides[side] = json.loads(done.stdout.strip().splitlines()[-1])
        theirs = {(r["layer"], r["batch"]): r["median_ms"] for r in sides["torch"]}
        rows += [{**row, "median_ms": {**row["median_ms"], **theirs[row["layer"], row["batch"]]}}
                 for row in sides["hetconv"]]
    import torch
    doc = {**_common.run_facts("winograd.py", sys.argv[1:] if argv is None else argv, started, load),
           "torch": _common.torch_info(torch), "environment": note, "sides": "separate", "rows": rows}
    _common.save_or_print(args.out, "winograd", doc, markdown)


if __name__ == "__main__":
    main()
