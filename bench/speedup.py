"""Speedup of the paper network over the single-device baseline, per device set and batch size,
measured and predicted by the cost model.

    python bench/speedup.py --quick --out bench/results        # fewer sets at batch 128, 2 timed steps
    python bench/speedup.py --out bench/results                # the full table (9.7 min in results/speedup.json)
    python bench/speedup.py --render bench/results/speedup.json   # rewrite speedup.md from the JSON only
    python bench/speedup.py --gpu cuda:0 --out runs/gpu        # adds cuda rows (needs a GPU)
    python bench/speedup.py --fft --out bench/results/fft      # the CPU's conv paths vs PyTorch, 2 cores

The network: 3x32x32 -> conv 5x5 500 -> ReLU -> pool -> conv 5x5 1500 -> ReLU -> pool -> FC 256 -> FC 10.
Device sets (on a 2-core host):
  local       the conv layers in-process on one 1-thread CPU device, pinned to core 0: the baseline
  local 2 threads   the same on one 2-thread CPU device (--local --threads 2), both cores: on one
              host this is the device to beat; each batch's speedups are against the faster of the two
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

--fft: the whole step on both cores, in alternating rounds (round r runs every configuration once,
the order rotated by r, so a change in the host's load falls on all of them alike):
  hetconv fft / auto / shifted / im2col   --local --threads 2 with that cpu_conv_path (whole network)
  PyTorch 2 threads (NCHW), (channels_last)  the same network in one process, torch.set_num_threads(2),
                                           in each memory layout (channels_last: the model and each
                                           step's input in channels-last memory, as PyTorch's CPU
                                           guidance tunes a conv network)
  PyTorch DDP 2x1 thread                   two one-thread ranks (gloo, 127.0.0.1), one core each, as
                                           DDP runs by default (NCHW, bucket_cap_mb 25)
"direct" is the faster of shifted and im2col in the same round (the closest forced runs to the
path the device took before the FFT path: conv1 im2col, conv2 shifted). Each row's ratios are to
the direct row and to the faster PyTorch row of its own round (either layout, or DDP), which the
table names. No cost-model prediction here.
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
import _torch_twin  # noqa: E402


LOCAL_THREADS = 2       # the second baseline's threads: the cores the 2-worker sets use together


def device_sets(gpus):
    """(set name, devices, splits, co-runner core or None) in the order they run."""
    sets = [("local", ["cpu"], ["equal"], None),
            ("local 2 threads", ["cpu"], ["equal"], None),
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
            if args.quick and batch > min(args.batch_sizes) and name not in ("local", "local 2 threads", "2 workers"):
                continue                 # --quick: at the larger batches only the baselines and the 2-core target
            for split in splits:
                runs.append({"set": name, "devices": devices, "batch_size": batch, "split": split,
                             "local": name.startswith("local"), "pin": [0] if name == "local" else None,
                             "threads": LOCAL_THREADS if name == "local 2 threads" else 1, "corunner": corunner})
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
    p.add_argument("--fft", action="store_true",
                   help="the CPU conv paths (--local --threads 2) against PyTorch on 2 cores, in alternating rounds")
    p.add_argument("--rounds", type=int, default=3, help="--fft: rounds at most (at least 2 are run)")
    p.add_argument("--budget-min", type=float, default=25.0,
                   help="--fft: start no further round (after 2) that the mean round so far would take past this")
    p.add_argument("--render", default="", metavar="JSON",
                   help="run nothing: rewrite speedup.md (and the plots) beside a saved speedup.json")
    args = p.parse_args(argv)
    if args.render:
        _common.rerender(args.render, "speedup", markdown, plot)
        return 0
    args.batch_sizes = [int(b) for b in (args.batch_sizes or ("128" if args.fft else "32,128")).split(",")]
    args.steps = args.steps or (2 if args.quick else 3)
    if args.warmup < 1:
        p.error("--warmup must be >= 1: the first step pays JIT compilation and first-touch")
    if args.fft:
        return run_fft(args, argv if argv is not None else sys.argv[1:])
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


# ---- --fft: the CPU's conv paths against PyTorch on the same two cores ------------------------

FFT_CONFIGS = [          # (name, what runs); the order of round 0, rotated by one each round
    ("hetconv fft", {"kind": "hetconv", "conv_path": "fft"}),
    ("hetconv auto", {"kind": "hetconv", "conv_path": "auto"}),
    ("hetconv shifted", {"kind": "hetconv", "conv_path": "shifted"}),
    ("hetconv im2col", {"kind": "hetconv", "conv_path": "im2col"}),
    *((_torch_twin.layout_config("PyTorch 2 threads", layout), {"kind": "torch", "world": 1, "threads": 2,
                                                                  "layout": layout})
      for layout in _torch_twin.LAYOUTS),
    ("PyTorch DDP 2x1 thread", {"kind": "torch", "world": 2, "threads": 1}),
]
DIRECT = ("hetconv shifted", "hetconv im2col")


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torch(world, threads, batch, warmup, steps, out_dir, tag, layout="NCHW"):
    """PyTorch on this host (bench/_ddp_baseline.py): world ranks of `threads` threads on 127.0.0.1,
    each rank pinned to its own core when world > 1 (as bench/bandwidth.py's DDP rows), in memory
    `layout`."""
    import json
    import subprocess
    out = os.path.join(out_dir, f"torch-{tag}.json")
    cores = sorted(os.sched_getaffinity(0))
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads))
    port, procs = free_port(), []
    t0 = time.perf_counter()
    try:
        for rank in range(world):
            spec = {"rank": rank, "world": world, "master": "127.0.0.1", "port": port, "threads": threads,
                    "batch_size": batch, "warmup": warmup, "steps": steps, "layout": layout}
            pin = ["taskset", "-c", str(cores[rank % len(cores)])] if world > 1 else []
            procs.append(subprocess.Popen([*pin, sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                           "_ddp_baseline.py"), json.dumps(spec), out],
                                          env={**env, "GLOO_SOCKET_IFNAME": "lo"}, start_new_session=True))
    except BaseException:
        for p in procs:
            C._kill_group(p)
        raise
    row = C.ddp_row(procs, out)
    row["wall_s"] = time.perf_counter() - t0
    return row


def run_fft(args, argv):
    scratch = args.runs_dir or tempfile.mkdtemp(prefix="hetconv-speedup-fft-")
    os.makedirs(scratch, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    started, load_start = time.time(), _common.load_average()
    import numpy  # noqa: F401  (loaded here so that run_facts names the BLAS the hetconv rows load)
    import torch
    doc = {"mode": "fft", **_common.run_facts("speedup.py", argv, started, load_start),
           "torch": "; ".join(_common.torch_info(torch)),
           "warmup": args.warmup, "steps": args.steps, "batch_sizes": args.batch_sizes,
           "configs": [name for name, _ in FFT_CONFIGS], "direct": list(DIRECT), "rows": []}
    print(f"machine: {doc['machine']}; {load_start}; per-run files: {scratch}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(143)))
    round_s = []
    try:
        for rnd in range(max(2, args.rounds)):
            elapsed = time.time() - started
            if rnd >= 2 and elapsed + sum(round_s) / len(round_s) > args.budget_min * 60:
                print(f"round {rnd}: would end past --budget-min {args.budget_min:g}: stopping", flush=True)
                break
            t_round = time.time()
            order = FFT_CONFIGS[rnd % len(FFT_CONFIGS):] + FFT_CONFIGS[:rnd % len(FFT_CONFIGS)]
            for batch in args.batch_sizes:
                for name, what in order:
                    tag = f"r{rnd}-b{batch}-{name.replace(' ', '_')}"
                    print(f"[round {rnd}, batch {batch}] {name} ... ({_common.load_average()})", flush=True)
                    with C.ForeignLoad() as load:
                        if what["kind"] == "hetconv":
                            spec = {"tag": tag, "set": name, "devices": ["local"], "local": True, "pin": None,
                                    "batch_size": batch, "split": "equal", "warmup": args.warmup,
                                    "steps": args.steps, "out_dir": scratch, "threads": 2,
                                    "conv_path": what["conv_path"], "predict": False}
                            row = C.run_in_subprocess(spec)
                        else:
                            row = run_torch(what["world"], what["threads"], batch, args.warmup, args.steps,
                                            scratch, tag, what.get("layout", "NCHW"))
                    row.update(config=name, round=rnd, batch_size=batch, foreign_load_cores=load.cores,
                               load_after=_common.load_average(), **{k: v for k, v in what.items() if k != "kind"})
                    doc["rows"].append(row)
                    print(f"    -> {fft_row_text(row)}; foreign load {load.cores:.2f} cores", flush=True)
            round_s.append(time.time() - t_round)
            doc["round_s"] = round_s
            _save_fft(args.out, doc, started)           # after every round: a stopped run keeps its rounds
    except KeyboardInterrupt:
        print("interrupted: writing the rows measured so far", file=sys.stderr)
    finally:
        _save_fft(args.out, doc, started)
    return 0 if doc["rows"] and all(r.get("ok") for r in doc["rows"]) else 1


def _save_fft(out_dir, doc, started):
    doc.update(wall_s=time.time() - started)
    doc["load"]["end"] = _common.load_average()
    add_fft_ratios(doc["rows"])
    _common.save_outputs(out_dir, "speedup", doc, markdown)


def fft_row_text(r):
    if not r.get("ok"):
        return f"FAILED: {r.get('error')}"
    return (f"step {r['step_s']:.3f}s (timed {', '.join(f'{s:.2f}' for s in r['step_s_all'])}; warm-up "
            f"{', '.join(f'{s:.2f}' for s in r.get('warmup_step_s', []))})")


def add_fft_ratios(rows):
    """Each row's direct_s and torch_s (the faster shifted/im2col and PyTorch rows of its own round and
    batch) and its ratios to them (> 1: this row is faster)."""
    for r in rows:
        mates = [m for m in rows if m.get("ok") and m["round"] == r["round"] and m["batch_size"] == r["batch_size"]]
        direct = [m for m in mates if m["config"] in DIRECT]
        torch = [m for m in mates if m["config"].startswith("PyTorch")]
        if not r.get("ok"):
            continue
        if direct:
            best = min(direct, key=lambda m: m["step_s"])
            r.update(direct_config=best["config"], direct_s=best["step_s"], vs_direct=best["step_s"] / r["step_s"])
        if torch:
            best = min(torch, key=lambda m: m["step_s"])
            r.update(torch_config=best["config"], torch_s=best["step_s"], vs_torch=best["step_s"] / r["step_s"])


def fft_markdown(doc):
    import statistics
    # every row's step s and ratios again from its saved timed steps: the median, as the hetconv rows
    # take it (_ddp_baseline.py once took the upper middle, with 2 timed steps the slower one)
    rows = [dict(r, step_s=statistics.median(r["step_s_all"])) if r.get("ok") else dict(r) for r in doc["rows"]]
    add_fft_ratios(rows)
    out = _common.run_header(doc) + [
        f"ISA: {doc.get('isa', '?')}. BLAS: {doc.get('blas', '?')}. PyTorch: {doc.get('torch', '?')}.", "",
        f"Each configuration in a fresh process per round, {doc['warmup']} warm-up step(s) then {doc['steps']} "
        "timed; step s = median of the timed steps, spread = their min-max. hetconv rows: the coordinator's "
        "--local engine with --threads 2 and the named cpu_conv_path for the whole network (auto times the "
        "paths on the first call of each big layer shape: that is in its warm-up step). PyTorch rows: the same "
        "network, SGD with momentum, one process with torch.set_num_threads(2), or DDP (gloo, 127.0.0.1) with "
        "two one-thread ranks, each on its own core and half the batch. x direct = (the faster of shifted and "
        "im2col in the same round) / this row; x PyTorch = (the faster PyTorch row in the same round) / this "
        "row; > 1: this row is faster. Foreign load = cores' worth of CPU used by other processes while the "
        "row ran; load = the 1/5/15-minute load average after it."
        + (" The one-process PyTorch rows run in each memory layout (NCHW; channels_last: the model and each "
           "step's input in channels-last memory); DDP as it runs by default." if any(
               _torch_twin.layout_of(c)[1] for c in doc["configs"]) else ""), ""]
    for batch in doc["batch_sizes"]:
        here = [r for r in rows if r["batch_size"] == batch]
        if not here:
            continue
        medians = {c: statistics.median(ok) if (ok := [r["step_s"] for r in here if r["config"] == c and r.get("ok")])
                   else None for c in doc["configs"]}
        note = _torch_twin.layout_note(medians, "PyTorch 2 threads")
        out += [f"### Batch {batch}: per configuration, over {len({r['round'] for r in here})} round(s)", "",
                *([f"PyTorch's faster layout in one process: {note}.", ""] if note else []),
                "| configuration | median step s | rounds' step s | x direct (median; per round) | "
                "x PyTorch (median; per round) |", "|---|---:|---|---|---|"]
        for name in doc["configs"]:
            ok = [r for r in here if r["config"] == name and r.get("ok")]
            if not ok:
                continue
            ratio = lambda key: (f"{statistics.median([r[key] for r in ok if key in r]):.2f}x; " + ", ".join(   # noqa: E731
                f"{r[key]:.2f}" for r in ok if key in r)) if any(key in r for r in ok) else "-"
            steps_text = ", ".join(f"{r['step_s']:.3f}" for r in ok)
            out.append(f"| {name} | {statistics.median([r['step_s'] for r in ok]):.3f} | "
                       f"{steps_text} | {ratio('vs_direct')} | {ratio('vs_torch')} |")
        out += ["", f"Batch {batch}, per round (rows in the order they ran):", "",
                "| round | configuration | step s | spread s | warm-up s | setup s | x direct | direct is | "
                "x PyTorch | PyTorch best | foreign load | load after |",
                "|---:|---|---:|---|---|---:|---:|---|---:|---|---:|---|"]
        for r in here:
            if not r.get("ok"):
                out.append(f"| {r['round']} | {r['config']} | failed: {r.get('error', '?')} |")
                continue
            spread = f"{min(r['step_s_all']):.3f}-{max(r['step_s_all']):.3f}"
            warm = ", ".join(f"{s:.2f}" for s in r.get("warmup_step_s", []))
            setup = f"{r['setup_s']:.1f}" if "setup_s" in r else "-"
            out.append(f"| {r['round']} | {r['config']} | {r['step_s']:.3f} | {spread} | {warm} | {setup} | "
                       f"{r.get('vs_direct', float('nan')):.2f} | {r.get('direct_config', '-')} | "
                       f"{r.get('vs_torch', float('nan')):.2f} | {r.get('torch_config', '-')} | "
                       f"{r['foreign_load_cores']:.2f} | {r.get('load_after', '')} |")
        out.append("")
    paths = next((r["conv_paths"] for r in rows if r.get("config") == "hetconv auto" and r.get("conv_paths")), None)
    if paths:
        out += ["What the auto device chose (its first round):", ""] + [f"- `{line}`" for line in paths] + [""]
    if doc.get("round_s"):
        out += [f"Rounds took {', '.join(f'{s / 60:.1f}' for s in doc['round_s'])} min.", ""]
    return "\n".join(out)


def add_speedups(rows):
    """Each row's speedup and efficiency against the faster single device of its batch (one
    thread on one core, or one device with both cores: `speedup_against` names it), and its
    speedup over the one-thread device (`speedup_1core`); the predicted speedup against the
    same baseline's prediction."""
    one_core = {r["batch_size"]: r for r in rows if r.get("ok") and r["set"] == "local"}
    singles = {}
    for r in rows:
        if r.get("ok") and r["set"] in ("local", "local 2 threads"):
            b = singles.get(r["batch_size"])
            singles[r["batch_size"]] = r if b is None or r["step_s"] < b["step_s"] else b
    for r in rows:
        b = singles.get(r["batch_size"])
        if not r.get("ok") or b is None:
            continue
        n = len(r["devices"])
        r["n_devices"] = n
        r["speedup"] = b["step_s"] / r["step_s"]
        r["speedup_against"] = b["set"]
        r["efficiency"] = r["speedup"] / n
        r["predicted_speedup"] = b["predicted_step_s"] / r["predicted_step_s"]
        if r["batch_size"] in one_core:
            r["speedup_1core"] = one_core[r["batch_size"]]["step_s"] / r["step_s"]


def _times(value):
    return "-" if value is None else f"{value:.2f}x"


def kernels_text(r):
    counts = r.get("counts") or {}
    return " / ".join("+".join(str(c[li]) for c in counts.values()) for li in range(2)) if counts else "500 / 1500"


def markdown(doc):
    """speedup.md, from speedup.json's contents alone."""
    if doc.get("mode") == "fft":
        return fft_markdown(doc)
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
        "| set | batch | split | kernels conv1 / conv2 | step s | predicted s | model error | speedup | against | "
        "over 1 core | efficiency | calibration s | calibration drift | setup s | foreign load |",
        "|---|---:|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if not r.get("ok"):
            out.append(f"| {r['set']} | {r['batch_size']} | {r['split']} | failed: {r.get('error', '?')} |")
            continue
        out.append(f"| {r['set']} | {r['batch_size']} | {r['split']} | {kernels_text(r)} | {r['step_s']:.3f} | "
                   f"{r['predicted_step_s']:.3f} | {r['model_error_pct']:+.1f}% | {r.get('speedup', float('nan')):.2f}x | "
                   f"{r.get('speedup_against', '-')} | {_times(r.get('speedup_1core'))} | "
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
    if not ok:                      # --fft rows: no device-count plot
        return
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    top = max([r["n_devices"] for r in ok] + [2])
    ax.plot([1, top], [1, top], "k--", lw=1, label="ideal (speedup = devices)")
    markers = {"local": "o", "local 2 threads": "P", "1 worker": "s", "2 workers": "^"}
    for batch in sorted({r["batch_size"] for r in ok}):
        for r in [r for r in ok if r["batch_size"] == batch]:
            label = f"b{batch} {r['set']}" + (f" {r['split']}" if r["set"].startswith("hetero") or "+" in r["set"] else "")
            m = markers.get(r["set"], "D" if r["split"] == "proportional" else "x")
            ax.plot(r["n_devices"], r["speedup"], m, ms=8, label=label)
            ax.plot(r["n_devices"], r["predicted_speedup"], m, ms=8, mfc="none", color="grey")
    ax.set_xlabel("devices")
    ax.set_ylabel("speedup over the faster single device (1 or 2 threads)")
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
