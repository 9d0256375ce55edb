"""The peer a user would otherwise pick: PyTorch DistributedDataParallel (gloo), one rank per host,
the same network, global batch and synthetic data shapes as hetconv's bandwidth rows.

    python bench/_ddp_baseline.py '{"rank": 0, "world": 2, "master": "10.0.0.1", "port": 29500,
                                    "batch_size": 32, "conv": "500,1500", "fc": "256", "warmup": 1,
                                    "steps": 2, "threads": 1}' OUT.json
    ... "net": "vgg-small" ...     a hetconv --net text (preset, NAME@WIDTH, .json) instead of conv/fc
    ... "module": "bench/imagenet_nets.py:resnet50", "image_size": 160, "classes": 1000 ...
                                   a user's file's PyTorch module, on images of that size

Each rank trains on batch_size / world images a step (data parallel: the global batch is the
same as hetconv's), `threads` CPU threads, SGD with momentum; DDP all-reduces every gradient (conv
and FC) each step. World 1 is plain PyTorch in one process: no process group, no DDP wrapper
(master and port unused). Rank 0 writes the row: median step seconds over the timed steps, and the bytes one
all-reduce moves.

DDP runs as a user gets it: `DistributedDataParallel(net)` with no options, so every one of them
keeps PyTorch's default (bucket_cap_mb 25, broadcast_buffers, no gradient_as_bucket_view, no
static_graph), and the benches' DDP rows run NCHW. `"layout": "channels_last"` (default "NCHW")
puts the model and each step's input in channels-last memory (the input converted inside the
timed step), as PyTorch's CPU guidance tunes a conv network: bench/speedup.py --fft runs its one-
process row (world 1) in both layouts (bench/_torch_twin.py LAYOUTS).
"""
import json
import os
import statistics
import sys
import time

from _torch_twin import in_layout


def main(spec, out_path):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    torch.set_num_threads(int(spec.get("threads", 1)))
    rank, world = int(spec["rank"]), int(spec["world"])
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://{spec['master']}:{spec['port']}", rank=rank,
                                world_size=world, timeout=__import__("datetime").timedelta(seconds=600))
    kernels = [int(k) for k in spec.get("conv", "500,1500").split(",")]
    hidden = [int(k) for k in spec.get("fc", "256").split(",") if k]

    class Net(nn.Module):               # the paper network: conv 5x5 -> ReLU -> pool, twice; FC
        def __init__(self):
            super().__init__()
            chans = [3] + kernels
            self.convs = nn.ModuleList(nn.Conv2d(a, b, 5) for a, b in zip(chans[:-1], chans[1:]))
            size = 32
            for _ in kernels:
                size = (size - 4) // 2
            widths = [kernels[-1] * size * size] + hidden + [10]
            self.fcs = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))

        def forward(self, x):
            for conv in self.convs:
                x = F.max_pool2d(F.relu(conv(x)), 2)
            x = x.flatten(1)
            for i, fc in enumerate(self.fcs):
                x = fc(x)
                if i < len(self.fcs) - 1:
                    x = F.relu(x)
            return x

    torch.manual_seed(0)
    net = user_module(spec["module"]) if spec.get("module") else torch_net(spec["net"]) if spec.get("net") else Net()
    size, classes = int(spec.get("image_size", 32)), int(spec.get("classes", 10))
    layout = spec.get("layout", "NCHW")
    net, _ = in_layout(torch, layout, net)
    model = nn.parallel.DistributedDataParallel(net) if world > 1 else net     # every DDP option its default
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    local_batch = int(spec["batch_size"]) // world
    gen = torch.Generator().manual_seed(rank)
    times = []
    for step in range(int(spec["warmup"]) + int(spec["steps"])):
        x = torch.randn(local_batch, 3, size, size, generator=gen)
        y = torch.randint(0, classes, (local_batch,), generator=gen)
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        (x,) = in_layout(torch, layout, None, [x])[1]
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()                    # DDP all-reduces the gradients in buckets here
        opt.step()
        times.append(time.perf_counter() - t0)
    params = sum(p.numel() for p in model.parameters())
    if world > 1:
        dist.destroy_process_group()
    if rank == 0:
        timed = times[int(spec["warmup"]):]
        # the median, as hetconv's rows take it (np.median: with 2 timed steps, their mean)
        row = {"ok": True, "step_s": statistics.median(timed), "step_s_all": timed,
               "allreduce_mb": params * 4 / 1e6, "local_batch": local_batch, "torch": torch.__version__,
               "threads": torch.get_num_threads(), "warmup_step_s": times[:int(spec["warmup"])], "layout": layout}
        tmp = out_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(row, f)
        os.replace(tmp, out_path)


def user_module(target):
    """FILE.py:FUNCTION's module, as hetconv's --net FILE.py:FUNCTION builds it."""
    import runpy
    path, func = target.rsplit(":", 1)
    return runpy.run_path(path)[func]()


def torch_net(text):
    """hetconv's network `text` (--net: a preset such as vgg-small@0.5 or resnet18, or a .json) on
    CIFAR-shaped input as PyTorch modules (hetconv.net.torch_import.to_torch: an nn.Sequential for
    a chain, the graph module for a graph), from hetconv's own start for seed 0: the same layers
    and shapes as hetconv trains."""
    import numpy as np
    from hetconv.geometry import IMAGE_SHAPE, NUM_CLASSES
    from hetconv.net import load_net
    from hetconv.net.torch_import import to_torch
    net = load_net(text, IMAGE_SHAPE, NUM_CLASSES).spec
    return to_torch(net, *net.init_params(np.random.default_rng(0)))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), sys.argv[2])
