"""Does a training run's memory depend on how many photos its folder holds? It should not: photos
are streamed, a bounded number of batches ahead, so 3000 photos cost what 300 do.

    python bench/make_photos.py /tmp/photos300 --train 300 --val 30 --seed 1
    python bench/make_photos.py /tmp/photos3000 --train 3000 --val 300 --seed 1
    python bench/loader_memory.py /tmp/photos300 /tmp/photos3000 --out bench/results/loader
    python bench/loader_memory.py --render bench/results/loader/loader_memory.json

Each folder gets a short training run (`hetconv-coordinator --data ROOT --image-size 128 --local
--steps N --loader-workers 2 --augment random-resized-crop,flip --deterministic`, its evaluation on the folder's
val/ at the end included), in alternating rounds. Every --every seconds the run's process tree
(the coordinator and its loader processes) is read from /proc: the sum of their RSS and of their
PSS (shared pages, as the loaders' shared-memory batches, divided among the processes that map
them, so the sum counts them once), and each process's own peak (VmHWM). A row gives the peaks of
those sums, each process's VmHWM, and the wall time. The targets: the folders' median peak PSS
within 30% of each other, and under 1.5 GB.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

BLAS_NOTE = _common.reexec_without_blas_overrides()

STEM = "loader_memory"
TARGET_GB = 1.5
TARGET_RATIO = 1.3


def tree(pid):
    """pid and every descendant's pid."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def memory(pid):
    """(rss, pss, hwm) of process `pid` in bytes, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            roll = {line.split(":")[0]: int(line.split()[1]) << 10 for line in f if line.split()[-1] == "kB"}
        with open(f"/proc/{pid}/status") as f:
            hwm = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM"))
        with open(f"/proc/{pid}/comm") as f:
            name = f.read().strip()
    except (OSError, StopIteration):
        return None
    return roll.get("Rss", 0), roll.get("Pss", 0), hwm, name


def run_one(args, root):
    cmd = [sys.executable, "-m", "hetconv.cli.coordinator", "--data", root, "--image-size", str(args.image_size),
           "--local", "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--net", args.net,
           "--loader-workers", str(args.workers), "--augment", "random-resized-crop,flip", "--threads", "1"]
    if not args.timed_paths:
        cmd.append("--deterministic")
    env = {**os.environ, "PYTHONPATH": _common.REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    peak_rss = peak_pss = 0
    hwm = {}                                          # pid -> (name, its VmHWM as last read)
    while proc.poll() is None:
        rss = pss = 0
        for pid in tree(proc.pid):
            got = memory(pid)
            if got is None:
                continue
            rss, pss = rss + got[0], pss + got[1]
            hwm[pid] = (got[3], got[2], pid == proc.pid)
        peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
        time.sleep(args.every)
    out = proc.stdout.read()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited with {proc.returncode}:\n{out[-3000:]}")
    loaders = [h for name, h, main in hwm.values() if not main]
    return {"root": root, "command": " ".join(["hetconv-coordinator", *cmd[3:]]), "wall_s": wall,
            "peak_rss_sum_mb": peak_rss / 2**20, "peak_pss_sum_mb": peak_pss / 2**20,
            "coordinator_hwm_mb": next(h for _, h, main in hwm.values() if main) / 2**20,
            "loader_hwm_mb": [h / 2**20 for h in loaders], "processes": len(hwm),
            "last_lines": out.strip().splitlines()[-3:]}


def markdown(doc):
    lines = ["# Peak memory of a photo run against the folder's size", "", *_common.run_header(doc),
             f"ISA: {doc['isa']}. BLAS env: {doc['blas_note']}.", "",
             f"`{doc['rows'][0]['command']}`, on each folder, {len(doc['rows']) // len(doc['roots'])} alternating "
             f"rounds; the process tree read every {doc['every']} s.", ""]
    table = []
    for r in doc["rows"]:
        photos = sum(len(files) for _, _, files in os.walk(os.path.join(r["root"], "train"))) \
            if os.path.isdir(r["root"]) else "?"
        table.append([r["root"], r.get("train_photos", photos), f"{r['peak_pss_sum_mb']:.0f}",
                      f"{r['peak_rss_sum_mb']:.0f}", f"{r['coordinator_hwm_mb']:.0f}",
                      " ".join(f"{v:.0f}" for v in r["loader_hwm_mb"]), f"{r['wall_s']:.1f}"])
    lines.append(_common.markdown_table(
        ["folder", "training photos", "peak PSS, all processes (MB)", "peak RSS, all processes (MB)",
         "coordinator's peak RSS (MB)", "loaders' peak RSS (MB)", "wall (s)"], table))
    v = doc["verdict"]
    # saved before the verdict said what it took: the first runs (timed paths) took each folder's
    # largest; those with --deterministic, the median
    of = v.get("of") or ("median" if "--deterministic" in doc["rows"][0]["command"] else "largest")
    lines += ["", f"Each folder's {of} peak PSS: largest over smallest {v['ratio']:.2f} (target at most "
              f"{TARGET_RATIO}); the largest {v['max_gb']:.2f} GB (target under {TARGET_GB} GB): "
              f"{'met' if v['met'] else 'NOT met'}.",
              "", "PSS divides each shared page (the loaders' shared-memory batches, the libraries) among the "
              "processes that map it, so its sum is the memory the run holds; the RSS sum counts those pages once "
              "per process."]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("roots", nargs="*", help="photo folders (bench/make_photos.py), smallest first")
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--net", default="cifar10-quick")
    p.add_argument("--workers", type=int, default=2, help="--loader-workers")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timed-paths", action="store_true",
                   help="let the CPU device time its conv paths (default --deterministic: paths by rule; timing "
                        "each path's workspace moves the coordinator's peak by hundreds of MB from run to run, "
                        "which would hide what the folder's size does)")
    p.add_argument("--every", type=float, default=0.05, help="seconds between reads of the process tree")
    p.add_argument("--out", default=None)
    p.add_argument("--render", default=None)
    args = p.parse_args()
    if args.render:
        print(f"wrote {_common.render_saved(args.render, STEM, markdown)}")
        return
    if len(args.roots) < 2:
        p.error("give two photo folders or more (or --render)")
    started, load_start = time.time(), _common.load_average()
    doc = {**_common.run_facts("loader_memory.py", sys.argv[1:], started, load_start), "blas_note": BLAS_NOTE,
           "roots": args.roots, "every": args.every, "rows": []}
    for r in range(args.rounds):
        for root in (args.roots if r % 2 == 0 else args.roots[::-1]):
            row = run_one(args, root)
            row["train_photos"] = sum(len(files) for _, _, files in os.walk(os.path.join(root, "train")))
            doc["rows"].append(row)
            print(f"{root}: peak PSS {row['peak_pss_sum_mb']:.0f} MB, RSS {row['peak_rss_sum_mb']:.0f} MB, "
                  f"{row['wall_s']:.1f} s", flush=True)
    peak = {root: statistics.median(r["peak_pss_sum_mb"] for r in doc["rows"] if r["root"] == root)
            for root in args.roots}
    ratio = max(peak.values()) / min(peak.values())
    doc["verdict"] = {"of": "median", "ratio": ratio, "max_gb": max(peak.values()) / 1024,
                      "met": ratio <= TARGET_RATIO and max(peak.values()) / 1024 < TARGET_GB}
    if args.out:
        _common.save_run(args.out, STEM, doc, started, markdown)
    else:
        print(markdown(doc))


if __name__ == "__main__":
    main()
