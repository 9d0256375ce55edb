"""Speedup of the paper network over the single-device baseline, per device set and batch size,
measured and predicted by the cost model.

    python bench/speedup.py --quick --out bench/results        # fewer sets at batch 128, 2 timed steps
    python bench/speedup.py --out bench/results                # the full table (9.7 min in results/speedup.json)
    python bench/speedup.py --render bench/results/speedup.json   # rewrite speedup.md from the JSON only
    python bench/speedup.py --gpu cuda:0 --out runs/gpu        # adds cuda rows (needs a GPU)

The network: 3x32x32 -> conv 5x5 500 -> ReLU -> pool -> conv 5x5 1500 -> ReLU -> pool -> FC 256 -> FC 10.
Device sets (on a 2-core host):
  local       the conv layers in-process on one 1-thread CPU device, pinned to core 0: the baseline
  1 worker    one 1-thread CPU worker on core 0: the baseline plus the wire
  2 workers   two 1-thread CPU workers pinned to cores 0 and 1
  hetero      the same two workers while a CPU-bound co-runner shares core 1 (started before the
              workers calibrate, stopped after the timed steps), under --split equal and proportional
Each configuration runs in a fresh process (bench/_speedup_common.py). Step time is the median of
the timed steps after the warm-up steps; JIT warm-up and calibration are reported apart
(calibration_s, setup_s). Per worker: compute (what the worker reports), wire (round trip minus
compute), wait (step minus round trip), bytes each way. predicted_step_s comes from
hetconv.costmodel with the run's own calibration and the measured loopback bandwidth.

Writes OUT/speedup.json (one row per configuration), OUT/speedup.md, OUT/speedup.png (speedup vs
devices, with the ideal line) and OUT/speedup_breakdown.png (per-worker compute / wire / wait).
"""
import argparse
import os
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import _speedup_common as C  # noqa: E402


def device_sets(gpus):
    """(set name, devices, splits, co-runner core or None) in the order they run."""
    sets = [("local", ["cpu"], ["equal"], None),
            ("1 worker", ["cpu"], ["proportional"], None),
            ("2 workers", ["cpu", "cpu"], ["proportional"], None),
            ("hetero (co-runner on core 1)", ["cpu", "cpu"], ["equal", "proportional"], 1)]
    for g in gpus:
        sets.append((f"1 worker {g}", [g], ["proportional"], None))
    if gpus:
        sets.append(("cpu + " + " + ".join(gpus), ["cpu"] + list(gpus), ["equal", "proportional"], None))
    return sets


def plan_runs(args):
    gpus = [g.strip() for g in args.gpu.split(",") if g.strip()]
    runs = []
    for batch in args.batch_sizes:
        for name, devices, splits, corunner in device_sets(gpus):
            if args.quick and batch > min(args.batch_sizes) and name not in ("local", "2 workers"):
                continue                 # --quick: at the larger batches only the baseline and the 2-core target
            for split in splits:
                runs.append({"set": name, "devices": devices, "batch_size": batch, "split": split,
                             "local": name == "local", "pin": [0] if name == "local" else None,
                             "corunner": corunner})
    return runs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[1])
    p.add_argument("--out", default="bench/results", help="directory for speedup.json / .md / .png")
    p.add_argument("--quick", action="store_true",
                   help="1 warm-up + 2 timed steps; at batch 128 only local and 2 workers")
    p.add_argument("--batch-sizes", default="", help="comma list (default 32,128)")
    p.add_argument("--warmup", type=int, default=1, help="steps discarded before timing (>= 1: JIT, first-touch)")
    p.add_argument("--steps", type=int, default=0, help="timed steps per configuration (default 2 quick, 3 full)")
    p.add_argument("--gpu", default="", help="comma list of cuda devices, e.g. cuda:0: adds GPU rows")
    p.add_argument("--only", default="", help="run only the sets whose name contains this (debugging)")
    p.add_argument("--runs-dir", default="", help="keep each run's metrics JSON lines here (default: a temp dir)")
    p.add_argument("--no-wire-cpu", dest="wire_cpu", action="store_false",
                   help="do not measure what moving a byte costs the workers' cores (the model then charges none)")
    p.add_argument("--render", default="", metavar="JSON",
                   help="run nothing: rewrite speedup.md (and the plots) beside a saved speedup.json")
    args = p.parse_args(argv)
    if args.render:
        _common.rerender(args.render, "speedup", markdown, plot)
        return 0
    args.batch_sizes = [int(b) for b in (args.batch_sizes or "32,128").split(",")]
    args.steps = args.steps or (2 if args.quick else 3)
    if args.warmup < 1:
        p.error("--warmup must be >= 1: the first step pays JIT compilation and first-touch")
    os.makedirs(args.out, exist_ok=True)
    scratch = args.runs_dir or tempfile.mkdtemp(prefix="hetconv-speedup-")
    os.makedirs(scratch, exist_ok=True)
    print(f"per-run metrics and rows: {scratch}", flush=True)

    runs = [r for r in plan_runs(args) if args.only in r["set"]]
    machine = C.machine()
    command = _common.recorded_command("speedup.py", argv if argv is not None else sys.argv[1:])
    load_start = _common.load_average()
    print(f"machine: {machine}\n{len(runs)} configurations; {args.warmup} warm-up + {args.steps} timed steps each",
          flush=True)
    # SIGTERM ends the run like Ctrl-C: the finally blocks stop the runner, its workers and the co-runner
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(143)))
    rows, t_all, wire_cpu = [], time.perf_counter(), None
    try:
        if args.wire_cpu and any(len(r["devices"]) > 1 for r in runs):
            # the workers share this host's cores with each other's wire (ipc between them)
            import _wire_cpu
            print("the wire's CPU on the workers' cores (ipc) ...", flush=True)
            wire_cpu = _wire_cpu.measure(f"ipc://{scratch}/wire-cpu.ipc", log=lambda msg: print(f"    | {msg}", flush=True))
            print(f"    -> {wire_cpu['host_cpu_s_per_byte'] * 1e9:.2f} ns a byte", flush=True)
        for i, run in enumerate(runs):
            spec = {**run, "tag": f"{i:02d}", "warmup": args.warmup, "steps": args.steps, "out_dir": scratch,
                    "wire_cpu_s_per_byte": wire_cpu["host_cpu_s_per_byte"] if wire_cpu else 0.0}
            print(f"[{i + 1}/{len(runs)}] {run['set']}: devices {','.join(run['devices'])}, batch {run['batch_size']}, "
                  f"split {run['split']} ...", flush=True)
            with C.ForeignLoad() as load:
                if run["corunner"] is not None:
                    with C.CoRunner(run["corunner"]):
                        row = C.run_in_subprocess(spec)
                else:
                    row = C.run_in_subprocess(spec)
            row.update(set=run["set"], corunner_core=run["corunner"], foreign_load_cores=load.cores)
            rows.append(row)
            print(f"    -> {C.fmt_row(row)}; foreign load {load.cores:.2f} cores", flush=True)
    except KeyboardInterrupt:
        print("interrupted: writing the rows measured so far", file=sys.stderr)
    finally:
        add_speedups(rows)
        doc = {"machine": machine, "command": command, "wall_s": time.perf_counter() - t_all,
               "load": {"start": load_start, "end": _common.load_average()}, "rows": rows, "wire_cpu": wire_cpu}
        _common.save_outputs(args.out, "speedup", doc, markdown, plot)
    return 0 if rows and all(r.get("ok") for r in rows) else 1


def add_speedups(rows):
    base = {r["batch_size"]: r for r in rows if r.get("ok") and r["set"] == "local"}
    for r in rows:
        b = base.get(r["batch_size"])
        if not r.get("ok") or b is None:
            continue
        n = len(r["devices"])
        r["n_devices"] = n
        r["speedup"] = b["step_s"] / r["step_s"]
        r["efficiency"] = r["speedup"] / n
        r["predicted_speedup"] = b["predicted_step_s"] / r["predicted_step_s"]


def kernels_text(r):
    counts = r.get("counts") or {}
    return " / ".join("+".join(str(c[li]) for c in counts.values()) for li in range(2)) if counts else "500 / 1500"


def markdown(doc):
    """speedup.md, from speedup.json's contents alone."""
    rows = doc["rows"]
    notes = []
    if doc.get("wire_cpu"):
        notes.append(f"Moving a byte between the workers (ipc) costs their cores "
                     f"{doc['wire_cpu']['host_cpu_s_per_byte'] * 1e9:.2f} ns, measured at the start of this run "
                     f"(bench/_wire_cpu.py); the model charges it where the wire overlaps compute.")
    if any(r.get("calibration_drift") for r in rows):
        notes.append("Each row's devices are calibrated before its steps (the plan) and after them; the model gets "
                     "the average, and `calibration drift` is after/before per device (1.00: the host held its speed).")
    out = _common.run_header(doc) + ([" ".join(notes), ""] if notes else []) + [
        "| set | batch | split | kernels conv1 / conv2 | step s | predicted s | model error | speedup | "
        "efficiency | calibration s | calibration drift | setup s | foreign load |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if not r.get("ok"):
            out.append(f"| {r['set']} | {r['batch_size']} | {r['split']} | failed: {r.get('error', '?')} |")
            continue
        out.append(f"| {r['set']} | {r['batch_size']} | {r['split']} | {kernels_text(r)} | {r['step_s']:.3f} | "
                   f"{r['predicted_step_s']:.3f} | {r['model_error_pct']:+.1f}% | {r.get('speedup', float('nan')):.2f}x | "
                   f"{r.get('efficiency', float('nan')):.2f} | {r['calibration_s']:.1f} | {C.drift_text(r)} | "
                   f"{r['setup_s']:.1f} | "
                   f"{r['foreign_load_cores']:.2f} |")
    out += ["", "Per worker, per step (medians over the timed steps; compute = reported by the worker, "
                "wire = round trip - compute, wait = step - round trip; MB = 1e6 bytes):", "",
            "| set | batch | split | worker | kernels | compute s | wire s | wait s | MB to worker | MB from worker | "
            "predicted compute s | predicted wire s |",
            "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        for w, m in (r.get("workers") or {}).items() if r.get("ok") and "counts" in r else ():   # local rows hold no split
            pw = r["prediction"]["workers"].get(w, {})
            out.append(f"| {r['set']} | {r['batch_size']} | {r['split']} | {w} | "
                       f"{'+'.join(map(str, r['counts'][w]))} | {m['compute_s']:.3f} | {m['wire_s']:.3f} | "
                       f"{m['wait_s']:.3f} | {m['sent'] / 1e6:.1f} | {m['recv'] / 1e6:.1f} | "
                       f"{pw.get('compute_s', float('nan')):.3f} | {pw.get('wire_s', float('nan')):.3f} |")
    return "\n".join(out) + "\n"


def plot(out_dir, rows, machine):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("ok") and "speedup" in r]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    top = max([r["n_devices"] for r in ok] + [2])
    ax.plot([1, top], [1, top], "k--", lw=1, label="ideal (speedup = devices)")
    markers = {"local": "o", "1 worker": "s", "2 workers": "^"}
    for batch in sorted({r["batch_size"] for r in ok}):
        for r in [r for r in ok if r["batch_size"] == batch]:
            label = f"b{batch} {r['set']}" + (f" {r['split']}" if r["set"].startswith("hetero") or "+" in r["set"] else "")
            m = markers.get(r["set"], "D" if r["split"] == "proportional" else "x")
            ax.plot(r["n_devices"], r["speedup"], m, ms=8, label=label)
            ax.plot(r["n_devices"], r["predicted_speedup"], m, ms=8, mfc="none", color="grey")
    ax.set_xlabel("devices")
    ax.set_ylabel("speedup over local (1 thread, 1 core)")
    ax.set_title(f"paper net speedup (hollow grey: cost model)\n{machine}", fontsize=9)
    ax.set_xticks(range(1, top + 1))
    ax.legend(fontsize=7)
    ax.grid(alpha=.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "speedup.png"), dpi=120)
    plt.close(fig)

    dist = [r for r in ok if r.get("workers")]
    labels, comp, wire, wait = [], [], [], []
    for r in dist:
        for w, m in r["workers"].items():
            labels.append(f"b{r['batch_size']} {r['set'].split(' (')[0]}\n{r['split'][:4]} {w}")
            comp.append(m["compute_s"])
            wire.append(m["wire_s"])
            wait.append(m["wait_s"])
    if not labels:
        return
    import numpy as np
    fig, ax = plt.subplots(figsize=(max(6, 0.75 * len(labels)), 4.8))
    x = np.arange(len(labels))
    ax.bar(x, comp, label="compute")
    ax.bar(x, wire, bottom=comp, label="wire (round trip - compute)")
    ax.bar(x, wait, bottom=np.add(comp, wire), label="wait (step - round trip)")
    ax.set_xticks(x)
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("seconds per step")
    ax.set_title("per worker: where a step goes (hetero rows: equal vs proportional)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "speedup_breakdown.png"), dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
