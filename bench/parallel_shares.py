"""Data-parallel image shares on uneven workers: two 1-thread workers, one sharing its core with a
busy loop, hetconv-coordinator --parallel data; how many images of each batch each worker gets.

    python bench/parallel_shares.py --out bench/results/parallel
    python bench/parallel_shares.py --net vgg-small@0.5 --rounds 1 --steps 12

Set-up: worker "free" pinned to the first core, worker "loaded" to the second; in a loaded round a
pure-Python busy loop (bench/_speedup_common.CoRunner) is pinned to the second core too, in a
control round nothing is. The coordinator runs unpinned on the same machine, over loopback.
Rounds alternate control and loaded. From each run's metrics: the calibrated plan (the first "plan"
record) and every plan after rebalancing (reason "rebalance", every --rebalance-after steps), each
data layer's images per worker; the ratio free/loaded of the last plan is the finding.

Writes OUT/NAME.json (the command, machine, load, every run's plan records) and NAME.md from it.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import _speedup_common as C  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
NAMES = ("free", "loaded")      # worker names: the first core's, and the one a busy loop shares in a loaded round


def run_once(args, loaded, tag, scratch):
    """One hetconv-coordinator --parallel data run -> its row (plans' images per worker, steps)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs two cores: one worker on each")
    address = f"tcp://127.0.0.1:{_free_port()}"
    metrics = os.path.join(scratch, f"metrics-{tag}.jsonl")
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    steps = args.warmup + args.steps
    flags = ["--workers", "2", "--bind", address, "--connect-timeout", "180", "--net", args.net,
             "--parallel", "data", "--batch-size", str(args.batch_size), "--steps", str(steps),
             "--synthetic-train", str(args.batch_size * steps), "--synthetic-test", str(args.batch_size),
             "--eval-batches", "1", "--threads", "1", "--rebalance-after", str(args.rebalance_after),
             "--metrics", metrics]
    row = {"tag": tag, "loaded": loaded, "command": "hetconv-coordinator " + " ".join(flags), "ok": False}
    procs = []
    busy = C.CoRunner(cores[1]) if loaded else None
    try:
        if busy:
            busy.__enter__()
        for name, core in zip(NAMES, cores):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "hetconv.cli.worker", "--device", "cpu", "--connect", address, "--threads", "1",
                 "--cores", str(core), "--name", name, "--connect-timeout", "180", "--idle-timeout", "600"],
                env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        with open(os.path.join(scratch, f"log-{tag}.txt"), "w") as log, C.ForeignLoad() as load:
            coordinator = subprocess.Popen([sys.executable, "-m", "hetconv.cli.coordinator", *flags], env=env,
                                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            procs.append(coordinator)
            coordinator.wait(timeout=1800)
            for w in procs[:-1]:                 # reaped inside the block: their CPU is ours, not foreign
                try:
                    w.wait(timeout=10)           # the coordinator's SHUTDOWN normally ends the workers
                except subprocess.TimeoutExpired:
                    C._kill_group(w)
        row["foreign_load_cores"] = load.cores      # the busy loop counts here: it is not a child we reap
        row["exit"] = coordinator.returncode
        with open(metrics) as f:
            records = [json.loads(line) for line in f if line.strip()]
        plans = [r for r in records if r["event"] == "plan"]
        row["plans"] = [{"reason": p.get("reason", "calibrated"), "step": p.get("step", 0),
                         "images": [layer.get("images") for layer in p["layers"] if layer.get("mode") == "data"],
                         "mode_choice": p.get("mode_choice")} for p in plans]
        step_s = [r["step_s"] for r in records if r["event"] == "step"][args.warmup:]
        row["step_s"] = statistics.median(step_s) if step_s else None
        row["step_s_all"] = step_s
        for key, plan in (("first", row["plans"][0]), ("last", row["plans"][-1])):
            per_worker = {w: statistics.median(im[w] for im in plan["images"]) for w in NAMES}
            row[f"{key}_images"] = per_worker
            row[f"{key}_ratio"] = per_worker["free"] / per_worker["loaded"] if per_worker["loaded"] else None
        row["ok"] = True
    except (OSError, ValueError, KeyError, IndexError, subprocess.TimeoutExpired) as e:
        row["error"] = f"{type(e).__name__}: {e}"
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    p.wait(timeout=5)            # the coordinator's SHUTDOWN normally ends the workers
                except subprocess.TimeoutExpired:
                    C._kill_group(p)
        if busy:
            busy.__exit__()
    return row


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_outputs(out_dir, name, result):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    rows = result["rows"]
    med = lambda xs: f"{statistics.median(xs):.2f}" if xs else ""   # noqa: E731
    lines = [f"Machine: {result['machine']}. Command: `{result['command']}` ({result['wall_s'] / 60:.1f} min; "
             f"{result['load_before']} before, {result['load_after']} after).",
             f"Network {result['net']}, batch {result['batch_size']}, every conv layer data-parallel (--parallel data) "
             f"on two 1-thread workers over loopback: `free` pinned to one core, `loaded` to the other, which a "
             f"pure-Python busy loop shares in a loaded round (none in a control round); the coordinator unpinned. "
             f"Images per worker: the median over the data layers of that plan's images of a batch; `calibrated`: "
             f"the first plan, `last`: after --rebalance-after {result['rebalance_after']} rebalancing. Foreign "
             f"load: cores' worth of CPU of processes other than the run's (the busy loop included).", "",
             "| busy loop on `loaded`'s core | runs | free/loaded images, calibrated (median) | free/loaded images, "
             "last plan (median) |", "|---|---:|---:|---:|"]
    for loaded in (False, True):
        mine = [r for r in rows if r.get("ok") and r["loaded"] == loaded]
        lines.append(f"| {'yes' if loaded else 'no (control)'} | {len(mine)} | "
                     f"{med([r['first_ratio'] for r in mine if r['first_ratio']])} | "
                     f"{med([r['last_ratio'] for r in mine if r['last_ratio']])} |")
    lines += ["", "| run | busy loop | plan | step | images per data layer (free/loaded) | s/step (median) | "
              "foreign load |", "|---|---|---|---:|---|---:|---:|"]
    for r in rows:
        if not r.get("ok"):
            lines.append(f"| {r['tag']} | {'yes' if r['loaded'] else 'no'} | failed: {r.get('error')} |")
            continue
        for p in r["plans"]:
            images = ", ".join(f"{im['free']}/{im['loaded']}" for im in p["images"])
            lines.append(f"| {r['tag']} | {'yes' if r['loaded'] else 'no'} | {p['reason']} | {p['step']} | {images} | "
                         f"{r['step_s']:.3f} | {r.get('foreign_load_cores', 0):.2f} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(text)
    print("\n" + text)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(HERE, "results", "parallel"))
    p.add_argument("--name", default="shares", help="OUT/NAME.json and NAME.md")
    p.add_argument("--net", default="vgg-small")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="timed steps; rebalancing happens among them")
    p.add_argument("--rebalance-after", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="each a control run, then a loaded run")
    args = p.parse_args(argv)
    scratch = tempfile.mkdtemp(prefix="hetconv-shares-")
    print(f"per-run metrics and logs: {scratch}", flush=True)
    result = {"command": "python bench/parallel_shares.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": C.machine(), "load_before": _common.load_average(), "net": args.net,
              "batch_size": args.batch_size, "rebalance_after": args.rebalance_after, "rows": []}
    t0 = time.perf_counter()
    try:
        for rnd in range(args.rounds):
            for loaded in (False, True):
                tag = f"{'loaded' if loaded else 'control'}-{rnd}"
                print(f"[round {rnd + 1}/{args.rounds}] {tag} ...", flush=True)
                row = run_once(args, loaded, tag, scratch)
                result["rows"].append(row)
                print(f"    -> {row.get('error') or ('images free/loaded ' + str(row['first_images']) + ' calibrated, ' + str(row['last_images']) + ' last')}",
                      flush=True)
    except KeyboardInterrupt:
        print("interrupted: writing the runs measured so far", file=sys.stderr)
    finally:
        result["wall_s"] = time.perf_counter() - t0
        result["load_after"] = _common.load_average()
        write_outputs(args.out, args.name, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
