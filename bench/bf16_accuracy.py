"""Does `--precision bf16` cost accuracy? Test accuracy of LeNet-5 on the real handwritten digits
trained by two spawned one-thread CPU workers at --precision fp32 and at bf16, for several seeds.

    python bench/bf16_accuracy.py --out bench/results/precision            # 3 seeds, ~10 min on 2 cores
    python bench/bf16_accuracy.py --render bench/results/precision/bf16_accuracy.json

Per seed the two runs are the same run but for --precision: the same start (the seed's weights),
the same batches in the same order, the same plan rule, and `--wire-dtype auto`, so the bf16 run's
feature maps and gradients travel as bfloat16 (its workers' conv GEMMs take bf16 operands) and the
fp32 run's as float32. bf16: conv GEMM operands in bf16 with float32 sums; weights, their updates,
the loss and the head in float32. The target: bf16's median test accuracy over the seeds within
--margin points of fp32's. Each run records what every worker computed in and what its wire
carried (the plan record's `wire`).

hetconv's bf16 needs oneDNN (pip install -e '.[onednn]'). Writes OUT/bf16_accuracy.json (every
run, the machine, the load) and OUT/bf16_accuracy.md, rendered from the JSON alone.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402
from _speedup_common import ForeignLoad  # noqa: E402

STEM = "bf16_accuracy"
PRECISIONS = ("fp32", "bf16")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.add_digits_run_flags(p, net="lenet5", lr=0.02)
    p.add_argument("--margin", type=float, default=1.0,
                   help="the target: bf16's median test accuracy at most this many points below fp32's")
    p.add_argument("--out", default="", help="folder for bf16_accuracy.json and .md (default: print only)")
    p.add_argument("--render", default="", help="rewrite the .md beside a saved bf16_accuracy.json")
    return p.parse_args(argv)


def make_config(args, seed, precision, metrics=""):
    from hetconv.training.config import Config
    return Config(data=args.data, net=args.net, batch_size=args.batch_size, epochs=args.epochs, lr=args.lr,
                  momentum=args.momentum, seed=seed, precision=precision, wire_dtype="auto",
                  metrics=metrics).validate()


def run_hetconv(args, seed, precision, scratch):
    """One training run with --spawn's workers at `precision`; -> a row."""
    metrics = os.path.join(scratch, f"seed{seed}-{precision}.jsonl")
    cfg = make_config(args, seed, precision, metrics)
    summary, wall, evals, plan, steps = _common.train_on_spawned_workers(cfg, args.spawn, precision=cfg.precision)
    return {"precision": precision, "seed": seed, "test_accuracy": summary["test_accuracy"],
            "test_loss": summary["test_loss"], "test_images": summary["test_images"],
            "final_loss": summary["final_loss"], "steps": summary["step"],
            "epoch_accuracy": [r["test_accuracy"] for r in evals],
            "modes": [layer["mode"] for layer in plan["layers"]], "wire": plan.get("wire"),
            "median_step_s": statistics.median(r["step_s"] for r in steps), "wall_s": wall}


def summarize(doc):
    """The median test accuracy of each precision over the seeds; bf16 - fp32 in points, of the
    medians and seed by seed; whether the target holds."""
    acc = {p: {r["seed"]: r["test_accuracy"] for r in doc["rows"] if r["precision"] == p} for p in PRECISIONS}
    med = {p: statistics.median(a.values()) for p, a in acc.items() if a}
    out = {"median": med}
    if len(med) == 2:
        out["median_points"] = 100.0 * (med["bf16"] - med["fp32"])
        out["per_seed_points"] = {s: 100.0 * (acc["bf16"][s] - acc["fp32"][s]) for s in acc["bf16"] if s in acc["fp32"]}
        out["target_met"] = out["median_points"] >= -doc["margin"]
    return out


def wire_text(wire):
    """'w0-cpu bf16 / bfloat16, w1-cpu ...' from a plan record's wire: what each worker computed
    in, and what the wire carried."""
    if not wire:
        return "-"
    return ", ".join(f"{name} {w['computed']} / {w['carried']}" for name, w in wire["workers"].items())


def markdown(doc):
    r = doc["recipe"]
    s = summarize(doc)
    lines = _common.run_header(doc)
    lines += [f"ISA: {doc['isa']}. BLAS: {doc['blas']}. bf16 GEMM: {doc['gemm']}.", "",
              f"`--net {r['net']}` on `{r['data']}` ({doc['data']}), batch {r['batch_size']}, {r['epochs']} epochs "
              f"({r['steps']} steps), SGD lr {r['lr']:g} momentum {r['momentum']:g}, `--spawn {r['spawn']}`, "
              f"`--wire-dtype auto`. Per seed the fp32 and the bf16 run share the start and the batches; only "
              f"`--precision` differs.", ""]
    if "median_points" in s:
        verdict = "met" if s["target_met"] else "missed"
        lines += [f"**Median test accuracy over {len(doc['seeds'])} seeds: fp32 {100 * s['median']['fp32']:.2f}%, "
                  f"bf16 {100 * s['median']['bf16']:.2f}%: {s['median_points']:+.2f} points** (target: at least "
                  f"-{doc['margin']:g}; {verdict}). One test image is {100 / doc['rows'][0]['test_images']:.2f} "
                  f"points.", ""]
    table = [[row["precision"], row["seed"], f"{100 * row['test_accuracy']:.2f}",
              " ".join(f"{100 * a:.1f}" for a in row["epoch_accuracy"]), f"{row['test_loss']:.4f}",
              f"{row['final_loss']:.4f}", "".join(m[0].upper() for m in row["modes"]), wire_text(row["wire"]),
              f"{1e3 * row['median_step_s']:.0f}", f"{row['wall_s']:.0f}", f"{row['foreign_load_cores']:.2f}"]
             for row in doc["rows"]]
    lines.append(_common.markdown_table(
        ["precision", "seed", "test accuracy %", "after each epoch %", "test loss", "last training loss",
         "modes (M model, D data)", "per worker: computed in / wire carried", "median step ms", "wall s",
         "foreign load (cores)"], table))
    if "per_seed_points" in s:
        lines += ["", "bf16 - fp32, seed by seed (points): "
                  + ", ".join(f"seed {k}: {v:+.2f}" for k, v in s["per_seed_points"].items()) + "."]
    lines += ["", "Steps are timed on a shared host, one run after the other: not a speed comparison "
              "(bench/precision.py makes one). Foreign load: cores' worth of CPU that other processes used while "
              "the run went."]
    return "\n".join(lines)


def main(argv):
    args = parse_args(argv)
    if args.render:
        print(f"wrote {_common.render_saved(args.render, STEM, markdown)}")
        return 0
    started, load_start = time.time(), _common.load_average()
    from hetconv.data import load_dataset
    from hetconv.devices import dnnl
    bf16_missing = dnnl.unavailable_reason() or dnnl.load().bf16_error
    if bf16_missing:
        raise SystemExit(f"bench/bf16_accuracy.py: the bf16 runs need oneDNN's bf16 GEMM: {bf16_missing}")
    doc = {"recipe": {"net": args.net, "data": _common.relative_path(args.data), "spawn": args.spawn,
                      "batch_size": args.batch_size, "epochs": args.epochs, "lr": args.lr, "momentum": args.momentum},
           "margin": args.margin, "seeds": list(range(args.seeds)), "gemm": dnnl.load().describe(), "rows": []}
    ds = load_dataset(args.data)
    doc["data"] = repr(ds)
    doc["recipe"]["steps"] = args.epochs * (len(ds.train_y) // args.batch_size)
    with tempfile.TemporaryDirectory(prefix="hetconv-bf16-accuracy-") as scratch:
        for seed in range(args.seeds):
            # the order alternates by seed, so neither precision always runs on a warmer host
            for precision in (PRECISIONS if seed % 2 == 0 else PRECISIONS[::-1]):
                print(f"[seed {seed}] --precision {precision} ... ({_common.load_average()})", flush=True)
                with ForeignLoad() as load:
                    row = run_hetconv(args, seed, precision, scratch)
                row.update(foreign_load_cores=load.cores, load_after=_common.load_average())
                doc["rows"].append(row)
                print(f"    test accuracy {row['test_accuracy']:.4f} (by epoch "
                      f"{', '.join(f'{a:.3f}' for a in row['epoch_accuracy'])}); {wire_text(row['wire'])}; "
                      f"{row['wall_s']:.0f} s", flush=True)
    doc.update(_common.run_facts("bf16_accuracy.py", argv, started, load_start))
    _common.save_or_print(args.out, STEM, doc, markdown)
    return 0


if __name__ == "__main__":
    print(_common.reexec_without_blas_overrides())
    sys.exit(main(sys.argv[1:]))
