"""The coordinator's head in the peer step: its time until the features' gradient can leave, with
the FC weights' gradients computed at once (a coordinator sharing its host with CPU workers)
against computed after the gradient has gone (head.settle: a coordinator whose workers are
elsewhere, coordinator/remote.py), alternating in one process, each side run by the cost model's
stand-in for the workers (engine.measure.HeadOnlyEngine).

    python bench/head.py                                  # the paper network's head, batch 32
    python bench/head.py --features 512,4,4 --fc 512 --batch 128 --out bench/results/head
"""
import _common

_common.reexec_without_blas_overrides()

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numba  # noqa: E402
import numpy as np  # noqa: E402

from hetconv.devices.cpu import HostArrays  # noqa: E402
from hetconv.engine.measure import HeadOnlyEngine  # noqa: E402
from hetconv.net.head import Network, paper_head  # noqa: E402
from hetconv.update import UpdateRule  # noqa: E402


def markdown(doc):
    lines = _common.run_header(doc)
    lines.append(f"Head: features {doc['features']} -> FC {doc['fc']} -> {doc['classes']} classes, batch "
                 f"{doc['batch']}, {doc['threads']} thread(s) (the coordinator's GEMMs: oneDNN's sgemm where "
                 f"installed); {doc['steps']} steps a side after 2 untimed, alternating. BLAS: {doc['blas']}.")
    lines.append("")
    rows = []
    for name in ("at once", "weights later"):
        r = doc["sides"][name]
        rows.append([name, f"**{r['until_gradient_ms']:.1f}**", f"{r['until_gradient_min_ms']:.1f}",
                     f"{r['settle_ms']:.1f}"])
    lines.append(_common.markdown_table(
        ["FC weight gradients", "until the gradient can leave, ms (median)", "min ms",
         "after it has left, ms (median)"], rows))
    lines.append("")
    at_once, later = (doc["sides"][k]["until_gradient_ms"] for k in ("at once", "weights later"))
    lines.append(f"The gradient leaves {at_once - later:.1f} ms sooner ({at_once / later:.2f}x).")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--features", default="1500,5,5", help="the features' shape C,H,W (default: the paper network's)")
    p.add_argument("--fc", default="256", help="hidden FC widths, comma-separated (default: 256)")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=20, help="timed steps a side")
    p.add_argument("--threads", type=int, default=0, help="the head's threads (0: every core, as the coordinator)")
    p.add_argument("--out", default=None, help="write OUT/head.json and head.md")
    args = p.parse_args(argv)
    try:
        shape = tuple(int(v) for v in args.features.split(","))
        widths = [int(v) for v in args.fc.split(",") if v]
        if len(shape) != 3 or min(shape) < 1 or not widths or min(widths) < 1:
            raise ValueError
    except ValueError:
        sys.exit(f"--features {args.features!r} --fc {args.fc!r}: expected C,H,W and widths, positive integers")
    if args.batch < 1 or args.steps < 1:
        sys.exit(f"--batch {args.batch} --steps {args.steps}: expected positive integers")
    if args.threads:
        numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    started, load_start = time.time(), _common.load_average()
    images = np.zeros((args.batch, 3, 8, 8), np.float32)
    labels = np.random.default_rng(0).integers(0, args.classes, args.batch)
    sides, timed = {}, {}
    for name, later in (("at once", False), ("weights later", True)):
        engine = HeadOnlyEngine(shape, weights_later=later)
        net = Network([], paper_head(widths, args.classes), engine, np.random.default_rng(0), shape, host=HostArrays())
        sides[name], timed[name] = (net, engine), {"until_gradient": [], "settle": []}
    for step in range(args.steps + 2):
        for name in (("at once", "weights later") if step % 2 == 0 else ("weights later", "at once")):
            net, engine = sides[name]
            before = (engine.head_s, engine.settle_s)
            net.train_step(images, labels, UpdateRule(lr=1e-6, momentum=0.0), step=step)
            if step >= 2:                       # the first two untimed: first-call costs
                timed[name]["until_gradient"].append(engine.head_s - before[0])
                timed[name]["settle"].append(engine.settle_s - before[1])
    doc = {**_common.run_facts("head.py", sys.argv[1:] if argv is None else argv, started, load_start),
           "features": list(shape), "fc": widths, "classes": args.classes, "batch": args.batch,
           "steps": args.steps, "threads": numba.get_num_threads(), "sides": {}}
    for name, t in timed.items():
        doc["sides"][name] = {"until_gradient_ms": 1e3 * statistics.median(t["until_gradient"]),
                              "until_gradient_min_ms": 1e3 * min(t["until_gradient"]),
                              "settle_ms": 1e3 * statistics.median(t["settle"])}
    _common.save_or_print(args.out, "head", doc, markdown)


if __name__ == "__main__":
    main()
