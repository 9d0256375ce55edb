"""Per-channel layers: the CPU device's kernels against PyTorch's on one feature map.

    python bench/channelwise.py [--shape 128,500,28,28] [--threads 1] [--budget 20] [--out DIR]

The default map is the paper's conv1 output at batch 128 (50 M values, 200 MB). For each layer,
"fwd" is the forward call and "fwd+bwd" the forward then the backward, as a training step runs
them: hetconv through the device contract (BatchNorm as channel_sums, the host statistics,
batchnorm_apply, then batchnorm_grad_sums and batchnorm_backward; Dropout2d as channel_scale
twice), torch through its functional ops in training mode with autograd (the input and the
BatchNorm parameters requiring grad; Dropout2d as a multiply by the same mask).
torch.set_num_threads(T) against the device's threads=T. Rounds alternate hetconv and torch
(a shared machine slows both alike); medians are reported, every sample is in the JSON.
Results: OUT/channelwise.json (rows, command, machine, load) and OUT/channelwise.md.
"""
import argparse
import sys
import time

import _common

ACTIVATIONS = ["relu", "gelu", "gelu-tanh", "silu", "leaky_relu", "elu", "celu", "tanh", "sigmoid", "hardswish"]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="128,500,28,28", help="N,C,H,W of the feature map")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--budget", type=float, default=20.0, help="seconds of timing rounds (at least 3 rounds)")
    p.add_argument("--out", default="", help="folder for channelwise.json and .md (default: print only)")
    p.add_argument("--render", default="", help="rewrite the .md beside a saved channelwise.json")
    return p.parse_args(argv)


def cases(dev, torch, shape):
    """{name: (hetconv step, torch step)}, each step returning {"fwd": s, "fwd+bwd": s}."""
    import numpy as np
    from hetconv import channelwise as cw
    F = torch.nn.functional
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape, dtype=np.float32)
    dy_full = rng.standard_normal(shape, dtype=np.float32)
    n, c, h, w = shape
    out = {}

    def hetconv_step(forward, backward):
        def step():
            t0 = time.perf_counter()
            y, ctx = forward()
            t1 = time.perf_counter()
            backward(ctx, y)
            t2 = time.perf_counter()
            return {"fwd": t1 - t0, "fwd+bwd": t2 - t0}
        return step

    def torch_step(fn, params=()):
        xt = torch.from_numpy(x).requires_grad_(True)

        def step():
            t0 = time.perf_counter()
            y = fn(xt)
            t1 = time.perf_counter()
            y.backward(torch.from_numpy(dy_full[tuple(slice(0, s) for s in y.shape)]))
            t2 = time.perf_counter()
            xt.grad = None
            for p in params:
                p.grad = None
            return {"fwd": t1 - t0, "fwd+bwd": t2 - t0}
        return step

    for name in ACTIVATIONS:
        act = cw.Activation("gelu", approximate="tanh") if name == "gelu-tanh" else cw.Activation(name)
        fn = {"gelu": F.gelu, "gelu-tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu,
              "leaky_relu": F.leaky_relu, "elu": F.elu, "celu": F.celu, "tanh": torch.tanh,
              "sigmoid": torch.sigmoid, "hardswish": F.hardswish, "relu": F.relu}[name]
        out[f"activation {name}"] = (
            hetconv_step(lambda act=act: dev.activation(x, act), lambda ctx, y: dev.activation_backward(ctx, dy_full)),
            torch_step(fn))
    pools = [("maxpool 2x2", cw.Pool("max", 2), lambda t: F.max_pool2d(t, 2)),
             ("avgpool 2x2", cw.Pool("avg", 2), lambda t: F.avg_pool2d(t, 2)),
             ("maxpool 3x3/2 pad 1", cw.Pool("max", 3, 2, 1), lambda t: F.max_pool2d(t, 3, 2, 1)),
             ("global avgpool", cw.GlobalPool("avg"), lambda t: F.adaptive_avg_pool2d(t, 1)),
             ("global maxpool", cw.GlobalPool("max"), lambda t: F.adaptive_max_pool2d(t, 1))]
    for name, pool, fn in pools:
        y, _ = dev.pool(x, pool)
        dy = np.ascontiguousarray(dy_full[:, :, :y.shape[2], :y.shape[3]])
        out[name] = (hetconv_step(lambda pool=pool: dev.pool(x, pool), lambda ctx, y, dy=dy: dev.pool_backward(ctx, dy)),
                     torch_step(fn))

    bn = cw.BatchNorm()
    weight, bias = np.ones(c, np.float32), np.zeros(c, np.float32)
    count = n * h * w

    def bn_forward():
        stats = cw.batch_statistics(bn, *dev.channel_sums(x), count)
        return dev.batchnorm_apply(x, stats.mean32, stats.invstd32, weight, bias)

    def bn_backward(ctx, y):
        sums = dev.batchnorm_grad_sums(ctx, dy_full)
        cw.batchnorm_parameter_grads(*sums)
        dev.batchnorm_backward(ctx, dy_full, *sums, count)

    wt = torch.ones(c, requires_grad=True)
    bt = torch.zeros(c, requires_grad=True)
    out["batchnorm (train)"] = (hetconv_step(bn_forward, bn_backward),
                                torch_step(lambda t: F.batch_norm(t, None, None, wt, bt, training=True), (wt, bt)))
    mask = cw.dropout2d_mask(cw.Dropout2d(0.5), rng.random((n, c)) < 0.5)
    mask_t = torch.from_numpy(mask)[:, :, None, None]
    out["dropout2d"] = (hetconv_step(lambda: (dev.channel_scale(x, mask), None),
                                     lambda ctx, y: dev.channel_scale(dy_full, mask)),
                        torch_step(lambda t: t * mask_t))
    return out


def markdown(doc):
    lines = _common.run_header(doc)
    lines += [f"Map {tuple(doc['shape'])} float32, {doc['threads']} thread(s), {doc['torch']}. Median ms.", ""]
    rows = [[r["layer"], f"{r['hetconv']['fwd']['median_ms']:.1f}", f"{r['torch']['fwd']['median_ms']:.1f}",
             f"{r['hetconv']['fwd+bwd']['median_ms']:.1f}", f"{r['torch']['fwd+bwd']['median_ms']:.1f}",
             f"{r['hetconv']['fwd+bwd']['median_ms'] / r['torch']['fwd+bwd']['median_ms']:.2f}"] for r in doc["rows"]]
    lines.append(_common.markdown_table(["layer", "hetconv fwd", "torch fwd", "hetconv fwd+bwd", "torch fwd+bwd",
                                         "fwd+bwd hetconv/torch"], rows))
    return "\n".join(lines)


def main(argv):
    args = parse_args(argv)
    if args.render:
        print(f"wrote {_common.render_saved(args.render, 'channelwise', markdown)}")
        return
    started, load_start = time.time(), _common.load_average()
    import torch
    from hetconv.devices import open_device
    torch.set_num_threads(args.threads)
    dev = open_device("cpu", threads=args.threads)
    shape = tuple(int(v) for v in args.shape.split(","))
    rows = []
    for name, (ours, theirs) in cases(dev, torch, shape).items():
        samples = _common.time_interleaved({"hetconv": ours, "torch": theirs}, min_reps=3, max_reps=50,
                                           budget_s=args.budget / 22)
        rows.append({"layer": name, **{who: {phase: _common.summarize(s) for phase, s in phases.items()}
                                       for who, phases in samples.items()}})
        print(f"{name}: hetconv {rows[-1]['hetconv']['fwd+bwd']['median_ms']:.1f} ms, "
              f"torch {rows[-1]['torch']['fwd+bwd']['median_ms']:.1f} ms (fwd+bwd)", flush=True)
    doc = {**_common.run_facts("channelwise.py", argv, started, load_start), "shape": list(shape),
           "threads": args.threads, "torch": _common.torch_info(torch), "rows": rows}
    _common.save_or_print(args.out, "channelwise", doc, markdown)


if __name__ == "__main__":
    print(_common.reexec_without_blas_overrides())
    main(sys.argv[1:])
