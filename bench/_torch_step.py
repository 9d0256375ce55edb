"""PyTorch's training step of one module, run by the benches as a process of its own (each row its
own threads and memory): SGD with momentum, in NCHW or channels_last, fp32 or bf16 autocast. Writes
JSON: every step's seconds, the last loss and torch's build; with --profile WARMUP, its profiler's
self time per kind of work a step instead (after WARMUP steps not profiled).

    python bench/_torch_step.py --module imagenet_nets:resnet50 --data images.npz --out t.json
    python bench/_torch_step.py --preset resnet50 --image-size 224 --batch 32 --layout NCHW --out t.json

--module FILE:FUNCTION names a function of a module beside this file, called with num_classes=1000,
trained on a .npz's (x, y) (uint8 images scaled to [0, 1]); --preset NAME is hetconv's preset as
hetconv.net.torch_import.to_torch makes it (10 classes), trained on --batch random images.
"""
import argparse
import collections
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))

# the profiler's operators by the kind of work the benches' tables name (the first match wins)
PROFILE_KINDS = [("conv backward", ("convolution_backward",)), ("conv forward", ("convolution", "conv2d")),
                 ("batchnorm backward", ("batch_norm_backward",)), ("batchnorm forward", ("batch_norm",)),
                 ("activation", ("relu", "hardtanh", "threshold_backward", "clamp")),
                 ("pool", ("pool", "adaptive_avg", "mean")), ("joins (add, concat)", ("add", "cat")),
                 ("update", ("sgd", "foreach", "_fused", "mul_", "add_")),
                 ("reorders", ("copy_", "contiguous", "to_dense", "clone"))]


def module_and_batch(torch, args):
    if args.module:
        sys.path.insert(0, HERE)
        file, function = args.module.split(":")
        module = getattr(__import__(file), function)(num_classes=1000)
        with np.load(args.data) as f:
            x = torch.from_numpy(f["x"].astype(np.float32) / 255.0)
            y = torch.from_numpy(f["y"].astype(np.int64))
        return module, x, y
    from hetconv.net import preset
    from hetconv.net.torch_import import to_torch
    spec = preset(args.preset, (3, args.image_size, args.image_size), 10)
    module = to_torch(spec, *spec.init_params(np.random.default_rng(0)))
    g = torch.Generator().manual_seed(0)
    return (module, torch.rand(args.batch, 3, args.image_size, args.image_size, generator=g),
            torch.randint(0, 10, (args.batch,), generator=g))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--module", help="FILE:FUNCTION, FILE a module beside this file")
    source.add_argument("--preset", help="a hetconv preset, as to_torch makes it")
    p.add_argument("--data", help="with --module: a .npz holding x (uint8 NCHW) and y")
    p.add_argument("--image-size", type=int, default=224, help="with --preset")
    p.add_argument("--batch", type=int, default=32, help="with --preset")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--layout", default="NCHW", choices=("NCHW", "channels_last"))
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="bf16: autocast")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--profile", type=int, default=None, metavar="WARMUP")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.module and (not args.data or args.module.count(":") != 1):
        p.error(f"--module FILE:FUNCTION with --data NPZ, got --module {args.module!r} --data {args.data!r}")
    import torch
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    module, x, y = module_and_batch(torch, args)
    channels_last = args.layout == "channels_last"
    if channels_last:
        module = module.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9)

    def step():
        xs = x.contiguous(memory_format=torch.channels_last) if channels_last else x
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
            loss = torch.nn.functional.cross_entropy(module(xs), y)
        loss.backward()
        opt.step()
        return loss

    if args.profile is None:
        seconds = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            loss = step()
            seconds.append(time.perf_counter() - t0)
        got = {"seconds": seconds, "loss": loss.item(),
               "info": [torch.__version__, torch.__config__.parallel_info().splitlines()[:6]]}
    else:
        for _ in range(args.profile):
            step()
        timed = args.steps - args.profile
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(timed):
                step()
            whole = time.perf_counter() - t0
        spent = collections.Counter()
        for e in prof.key_averages():
            name = e.key.lower()
            kind = next((k for k, words in PROFILE_KINDS if any(w in name for w in words)), "other")
            spent[kind] += e.self_cpu_time_total / 1e6
        spent["whole step"] = whole
        got = {k: v / timed for k, v in spent.items()}
    with open(args.out, "w") as f:
        json.dump(got, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
