"""Does `--augment crop,flip` slow a training step? The crops and flips of the next batch are made
in a background thread while the current step runs; this measures whether that overlap holds.

    python bench/augment.py --out bench/results                 # paper and cifar10-quick, --local
    python bench/augment.py --render bench/results/augment.json

For each network, blocks of `--steps` consecutive training steps (a fresh batch iterator per block,
so every block pays for its first batch, which nothing overlaps) run with and without
augmentation in alternating rounds, on the built-in synthetic set, in one process with the CPU
device on `--threads` threads: the same conv code a worker runs. The row's ratio is the median
block time with augmentation over the median without.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

BLAS_NOTE = _common.reexec_without_blas_overrides()

import numpy as np  # noqa: E402

from hetconv.devices.cpu import HostArrays  # noqa: E402
from hetconv.update import UpdateRule  # noqa: E402
from hetconv.training.config import Config  # noqa: E402
from hetconv.data import batches, load_dataset, parse_augment  # noqa: E402
from hetconv.devices import open_device  # noqa: E402
from hetconv.engine.local import LocalEngine  # noqa: E402
from hetconv.geometry import ConvSpec, layer_input_shapes  # noqa: E402
from hetconv.net.head import Network, init_conv_params  # noqa: E402
from hetconv.engine.planner import fixed_plan  # noqa: E402
from hetconv.engine.shard import ConvShard  # noqa: E402

STEM = "augment"


def build(net_name, ds, threads, seed=0):
    cfg = Config(net=net_name)
    spec = cfg.network(tuple(ds.train_x.shape[1:]), len(ds.classes)).spec
    specs = [ConvSpec.from_layer(layer) for layer in spec.conv_layers()]
    rng = np.random.default_rng(seed)
    engine = LocalEngine({"local": ConvShard(open_device("cpu", threads=threads))})
    engine.load(fixed_plan([s.kernels for s in specs], {"local": [s.kernels for s in specs]}), specs,
                init_conv_params(specs, rng))
    _, feature_shape = layer_input_shapes(specs, 1, spec.input_shape)
    head = [op.layer.to_json() for op in spec.head() if op.type != "flatten"]
    return Network(specs, head, engine, rng, feature_shape, host=HostArrays())


def block(net, ds, batch, steps, augment, epoch):
    """`steps` training steps from a fresh prefetching iterator; returns the block's seconds."""
    t0 = time.perf_counter()
    it = batches(ds, batch, np.random.default_rng([0, epoch]), augment=augment, seed=0, epoch=epoch, prefetch=True)
    for i, (x, y) in enumerate(it):
        net.train_step(x, y, UpdateRule(lr=0.01, momentum=0.9, weight_decay=5e-4))
        if i + 1 == steps:
            break
    close = getattr(it, "close", None)
    if close:
        close()
    return time.perf_counter() - t0


def run(args):
    ds = load_dataset("synthetic", n_train=args.batch_size * (args.steps + 1) * 4, n_test=16)
    rows = []
    for net_name in args.nets:
        net = build(net_name, ds, args.threads)
        counter = {"epoch": 0}

        def case(augment):
            def one():
                counter["epoch"] += 1
                return {"block": block(net, ds, args.batch_size, args.steps, augment, counter["epoch"])}
            return one
        samples = _common.time_interleaved({"plain": case(()), "crop,flip": case(parse_augment("crop,flip"))},
                                           args.rounds, args.rounds, 0.0, burn_in=1)
        plain, aug = samples["plain"]["block"], samples["crop,flip"]["block"]
        rows.append({"net": net_name, "batch_size": args.batch_size, "threads": args.threads, "steps": args.steps,
                     "plain": _common.summarize([s / args.steps for s in plain]),
                     "augmented": _common.summarize([s / args.steps for s in aug]),
                     "ratio": float(np.median(aug) / np.median(plain)),
                     "round_ratios": [a / p for a, p in zip(aug, plain)]})
        print(f"{net_name}: augmented/plain {rows[-1]['ratio']:.3f}", flush=True)
    return rows


def markdown(doc):
    lines = ["# Augmentation and the step", ""] + _common.run_header(doc)
    lines += [f"ISA: {doc['isa']}. BLAS: {doc['blas']} ({doc['blas_note']}).", "",
              "Per network: blocks of consecutive `--local` training steps on the synthetic set, each block from a "
              "fresh prefetching batch iterator, with and without `crop,flip`, in alternating rounds. Seconds are "
              "per step (block time over its steps); the ratio is the median block with augmentation over the "
              "median without; below 1.0x + the rounds' spread, the augmentation thread hides behind the step.", ""]
    table = [[r["net"], r["batch_size"], r["threads"], f"{r['plain']['median_ms'] / 1e3:.3f}",
              f"{r['augmented']['median_ms'] / 1e3:.3f}", f"{r['ratio']:.3f}",
              " ".join(f"{v:.3f}" for v in r["round_ratios"])] for r in doc["rows"]]
    lines.append(_common.markdown_table(["network", "batch", "threads", "plain s/step", "crop,flip s/step",
                                         "ratio", "per-round ratios"], table))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nets", nargs="+", default=["paper", "cifar10-quick"])
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="steps per timed block")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="")
    p.add_argument("--render", default="", help="rewrite the .md beside a saved JSON, running nothing")
    args = p.parse_args(argv)
    if args.render:
        print(f"wrote {_common.render_saved(args.render, STEM, markdown)}")
        return 0
    t0 = time.time()
    load_start = _common.load_average()
    rows = run(args)
    doc = {**_common.run_facts("augment.py", sys.argv[1:] if argv is None else argv, t0, load_start),
           "blas_note": BLAS_NOTE or "BLAS environment as found", "rows": rows}
    _common.save_or_print(args.out, STEM, doc, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
