"""How far a busy neighbour on one core moves calibration: the split of a small network between two
1-thread CPU workers, one of them sharing its core with a CPU-bound loop.

    python bench/calibration_noise.py --out bench/results                         # 5 runs of this code
    python bench/calibration_noise.py --before /tmp/base --out bench/results      # and of another checkout
    python bench/calibration_noise.py --render bench/results/calibration_noise.json   # rewrite the .md only

Each run: a pure-Python busy loop pinned to core 1 starts first, then `hetconv-coordinator --spawn
cpu,cpu --threads 1 --conv 32,96 --steps 1`, whose spawned 1-thread workers are pinned to cores 0
(w0, alone) and 1 (w1, shared; each row records the cores /proc says each worker may use); the
kernel ranges come from the run's first `plan` record. w1 gets about half a core, so w0 should
get about twice w1's kernels of the larger layer (more where the fixed part of a call is large);
a run passes when it gets at least --min-ratio (1.3) times as many. Before each run the script
waits (--quiet-wait) for other processes to leave the cores, and a run during which they used more
than --max-foreign cores anyway is kept but marked and run again (--retries): a tenant on core 0
loads w0 too, and then a ratio near 1 is the truth. With --before DIR the same runs of DIR's code alternate with --after's, so both see the same
machine; with --paper, each code also calibrates the paper network once (`--spawn cpu,cpu
--steps 1`, no busy loop) for what calibration costs there.

Writes OUT/calibration_noise.json (every run's kernels, speeds, ratio, calibration time and the
foreign load, the command, the machine) and OUT/calibration_noise.md, rendered from the JSON.
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import _speedup_common as C  # noqa: E402

FAST, SLOW = "w0-cpu", "w1-cpu"              # --spawn cpu,cpu --threads 1 pins w0 to core 0, w1 to core 1
BUSY_CORE = 1
CALIBRATED = re.compile(r"calibrated (\d+) worker\(s\) in ([0-9.]+)s")


def importable_copy(code_dir, into):
    """A copy of a checkout's package under `into`, importable with PYTHONPATH=into: hetconv/ with
    the checkout's devices/ as hetconv/devices. An editable install maps hetconv.devices to its
    own checkout's devices/ whatever PYTHONPATH says, so a path alone would mix two checkouts. A
    copy rather than links, so Numba's cache is written here, not into the checkout."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(os.path.join(code_dir, "hetconv"), os.path.join(into, "hetconv"), ignore=skip)
    devices = os.path.join(code_dir, "devices")
    if os.path.isdir(devices) and not os.path.exists(os.path.join(into, "hetconv", "devices")):
        shutil.copytree(devices, os.path.join(into, "hetconv", "devices"), ignore=skip)
    return into


def coordinator_run(code_dir, args, metrics, timeout):
    """Run hetconv-coordinator from an importable copy (importable_copy); -> (exit code,
    stdout+stderr, wall s, worker cores). Its process group (the coordinator and its workers) is
    ended on every exit path."""
    env = dict(os.environ, PYTHONPATH=code_dir, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "hetconv.cli.coordinator", *args, "--metrics", metrics]
    log = metrics + ".log"
    t0 = time.perf_counter()
    with open(log, "w") as out_file:
        proc = subprocess.Popen(cmd, cwd=code_dir, env=env, stdout=out_file, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        pinning = workers_cores(proc, wanted=2, until=t0 + timeout)
        proc.wait(timeout=max(1.0, t0 + timeout - time.perf_counter()))
        stopped = ""
    except subprocess.TimeoutExpired:
        stopped = f"\n[bench] stopped after {timeout}s"
    finally:
        if proc.poll() is None:
            C._kill_group(proc)
    with open(log) as f:
        return proc.returncode, f.read() + stopped, time.perf_counter() - t0, pinning


def workers_cores(proc, wanted, until):
    """{worker name: the cores it may use} of the workers `proc` spawned (hetconv-worker
    --parent-pid PID), read from /proc once `wanted` of them are there and each has applied
    its --cores (a worker pins itself as it starts), or as they are when `proc` ends."""
    found, cores = {}, {}
    while proc.poll() is None and time.perf_counter() < until:
        for pid in os.listdir("/proc"):
            if len(found) >= wanted:
                break
            if not pid.isdigit() or pid in found:
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().decode(errors="replace").split("\0")
            except OSError:
                continue
            if "hetconv.cli.worker" in argv and "--parent-pid" in argv and "--name" in argv \
                    and argv[argv.index("--parent-pid") + 1] == str(proc.pid):
                found[pid] = (argv[argv.index("--name") + 1],
                              argv[argv.index("--cores") + 1] if "--cores" in argv else None)
        for pid, (name, asked) in found.items():
            try:
                with open(f"/proc/{pid}/status") as f:
                    cores[name] = next((line.split(":", 1)[1].strip() for line in f
                                        if line.startswith("Cpus_allowed_list")), "?")
            except OSError:
                pass
        if len(found) >= wanted and all(asked is None or cores.get(name) == asked for name, asked in found.values()):
            break
        time.sleep(0.1)
    return cores


def first_plan(metrics):
    try:
        with open(metrics) as f:
            for line in f:
                record = json.loads(line)
                if record.get("event") == "plan":
                    return record
    except (OSError, ValueError):
        pass
    return None


def calibration_seconds(output):
    m = CALIBRATED.search(output)
    return float(m.group(2)) if m else None


def wait_for_quiet(max_wait_s, below_cores=0.15, sample_s=2.0):
    """Wait (up to max_wait_s) until other processes use less than `below_cores` of the machine
    over `sample_s`: on a shared host another tenant on core 0 makes the unloaded worker loaded
    too. -> (seconds waited, the last sample's cores)."""
    t0 = time.perf_counter()
    while True:
        busy0 = C._busy_s()
        time.sleep(sample_s)
        cores = (C._busy_s() - busy0) / sample_s
        waited = time.perf_counter() - t0
        if cores < below_cores or waited >= max_wait_s:
            return waited, cores


def noise_run(label, code_dir, conv, scratch, index, min_ratio, timeout, quiet_wait_s):
    """One calibration with the busy loop on core 1 -> a row."""
    metrics = os.path.join(scratch, f"{label}-{index}.jsonl")
    waited, before_cores = wait_for_quiet(quiet_wait_s) if quiet_wait_s > 0 else (0.0, None)
    args = ["--spawn", "cpu,cpu", "--threads", "1", "--conv", conv, "--steps", "1"]
    with C.ForeignLoad() as load:
        with C.CoRunner(BUSY_CORE):
            code, out, wall, pinning = coordinator_run(code_dir, args, metrics, timeout)
    row = {"code": label, "run": index, "exit_code": code, "wall_s": wall, "foreign_load_cores": load.cores,
           "worker_cores": pinning,
           "calibration_s": calibration_seconds(out), "quiet_wait_s": waited, "load_before_cores": before_cores}
    plan = first_plan(metrics)
    if code != 0 or plan is None or FAST not in plan.get("workers", []):
        row.update(ok=False, error=out.strip().splitlines()[-5:] if out.strip() else ["no output"])
        return row
    # a worker the planner leaves out (its fixed work outweighs its share) holds no kernels
    layers = [{"kernels": {w: int(layer["kernels"].get(w, 0)) for w in (FAST, SLOW)},
               "speeds": {w: float(layer["speeds"][w]) for w in (FAST, SLOW) if w in layer["speeds"]}}
              for layer in plan["layers"]]
    for layer in layers:
        k = layer["kernels"]
        layer["ratio"] = k[FAST] / k[SLOW] if k[SLOW] else None
    big = max(range(len(layers)), key=lambda i: sum(layers[i]["kernels"].values()))
    pinned = pinning.get(FAST) == "0" and pinning.get(SLOW) == str(BUSY_CORE)
    ratio = layers[big]["ratio"]
    row.update(ok=True, layers=layers, big_layer=big, ratio=ratio, left_out=plan.get("left_out", {}), pinned=pinned,
               passed=pinned and ratio is not None and ratio >= min_ratio)
    return row


def paper_run(label, code_dir, scratch, timeout):
    """The paper network's calibration time on two workers (no busy loop) -> a row."""
    metrics = os.path.join(scratch, f"{label}-paper.jsonl")
    with C.ForeignLoad() as load:
        code, out, wall, pinning = coordinator_run(code_dir, ["--spawn", "cpu,cpu", "--steps", "1"], metrics, timeout)
    return {"code": label, "exit_code": code, "wall_s": wall, "foreign_load_cores": load.cores, "worker_cores": pinning,
            "calibration_s": calibration_seconds(out)}


def report(label, index, runs, row):
    if not row["ok"]:
        print(f"[{label} {index}/{runs}] failed: {row['error']}", flush=True)
        return
    kernels = " ".join("/".join(str(v) for v in layer["kernels"].values()) for layer in row["layers"])
    ratio = f"{row['ratio']:.2f}" if row["ratio"] is not None else "w1 left out"
    print(f"[{label} {index}/{runs}] kernels {kernels}, ratio {ratio}, calibrated in {row['calibration_s']}s, "
          f"foreign load {row['foreign_load_cores']:.2f}" + (" (loaded: run again)" if row["loaded"] else ""),
          flush=True)


def git_state(code_dir):
    """(short commit, files that differ from it) of a checkout, as git reports them."""
    def git(*args):
        try:
            return subprocess.run(["git", "-C", code_dir, *args], capture_output=True, text=True,
                                  timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return ""
    changed = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]
    return git("rev-parse", "--short", "HEAD").strip() or None, changed


def markdown(doc):
    lines = ["# Calibration next to a busy neighbour", ""] + _common.run_header(doc)
    lines += [f"ISA: {', '.join(doc['isa_flags']) or 'unknown'}. BLAS: {'; '.join(doc['blas']) or 'unknown'}.", "",
              f"Two 1-thread CPU workers (`--spawn cpu,cpu --threads 1`, w0 on core 0, w1 on core {doc['busy_core']} "
              f"with a busy loop), `--conv {doc['conv']}`. The ratio is w0's kernels of the larger layer over "
              f"w1's (about 2 expected, more where a call's fixed part is large); a run passes at "
              f"{doc['min_ratio']} or more with both workers pinned as asked and in the plan (a worker left "
              "out, for fixed work calibrated larger than its share saves, is a failed calibration here: the "
              "step is slower without it). Foreign load: cores' worth "
              "of CPU used by processes other than the run's own during it.", ""]
    code_of = {c["label"]: c for c in doc["codes"]}
    rows = []
    for r in doc["rows"]:
        run = f"{r['run']}" + (f" ({r['attempt']})" if r.get("attempt", 1) > 1 else "")
        if not r.get("ok"):
            rows.append([r["code"], run, "failed", "", "", "", "", "", f"{r['foreign_load_cores']:.2f}"])
            continue
        kernels = ["/".join(str(layer["kernels"][w]) for w in (FAST, SLOW)) for layer in r["layers"]]
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "w1 left out"
        cores = "/".join(r["worker_cores"].get(w, "?") for w in (FAST, SLOW))
        verdict = "loaded" if r.get("loaded") else "yes" if r["passed"] else "NO"
        rows.append([r["code"], run, cores, *kernels[:2], ratio, verdict,
                     f"{r['calibration_s']:.1f}" if r["calibration_s"] is not None else "",
                     f"{r['foreign_load_cores']:.2f}"])
    lines.append(_common.markdown_table(["code", "run", "cores w0/w1", "conv1 w0/w1", "conv2 w0/w1", "ratio", "pass",
                                         "calibration s", "foreign load"], rows))
    lines.append("")
    lines.append(f"A run (its attempt number in brackets) during which other processes used more than "
                 f"{doc['max_foreign']} cores is marked loaded and run again; the counts below leave loaded "
                 "attempts out.")
    lines.append("")
    for label, c in code_of.items():
        clean = [r for r in doc["rows"] if r["code"] == label and not r.get("loaded")]
        ratios = [r["ratio"] for r in clean if r.get("ok") and r["ratio"] is not None]
        left_out = sum(1 for r in clean if r.get("ok") and r["ratio"] is None)
        runs = len(clean)
        passed = sum(1 for r in clean if r.get("passed"))
        span = f"ratios {min(ratios):.2f} to {max(ratios):.2f}" if ratios else "no ratios"
        span += f"; w1 left out of the plan in {left_out}" if left_out else ""
        changed = f" with {', '.join(c['changed'])} changed" if c.get("changed") else ""
        lines.append(f"- {label} (commit {c['commit'] or 'unknown'}{changed}): {passed} of {runs} runs pass; {span}.")
    if doc.get("paper"):
        lines += ["", "The paper network's calibration on two workers (`--spawn cpu,cpu --steps 1`, no busy loop):", ""]
        lines.append(_common.markdown_table(
            ["code", "calibration s", "run wall s", "foreign load"],
            [[p["code"], f"{p['calibration_s']:.1f}" if p["calibration_s"] is not None else f"failed ({p['exit_code']})",
              f"{p['wall_s']:.0f}", f"{p['foreign_load_cores']:.2f}"] for p in doc["paper"]]))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[1])
    p.add_argument("--out", default="bench/results", help="directory for calibration_noise.json / .md")
    p.add_argument("--runs", type=int, default=5, help="runs per code (default 5)")
    p.add_argument("--conv", default="32,96", help="--conv of the network calibrated (default 32,96)")
    p.add_argument("--min-ratio", type=float, default=1.3, help="w0/w1 kernels of the larger layer a run must reach")
    p.add_argument("--before", default="", metavar="DIR", help="another checkout whose runs alternate with --after's")
    p.add_argument("--after", default=_common.REPO, metavar="DIR", help="the checkout under test (default: this one)")
    p.add_argument("--paper", action="store_true", help="also time each code's calibration of the paper network")
    p.add_argument("--timeout", type=int, default=600, help="seconds a run may take before it is stopped")
    p.add_argument("--max-foreign", type=float, default=0.2, metavar="CORES",
                   help="a run during which other processes used more than this is marked and run again")
    p.add_argument("--retries", type=int, default=3, help="extra attempts per run for runs over --max-foreign")
    p.add_argument("--quiet-wait", type=float, default=120.0, metavar="S",
                   help="before each run, wait up to S seconds for other processes to leave the cores (0: don't)")
    p.add_argument("--render", default="", metavar="JSON", help="run nothing: rewrite the .md beside a saved JSON")
    args = p.parse_args(argv)
    if args.render:
        _common.render_saved(args.render, "calibration_noise", markdown)
        return 0
    if args.runs < 1:
        p.error(f"--runs {args.runs}: expected at least 1")
    for flag, path in (("--before", args.before), ("--after", args.after)):
        if path and not os.path.isdir(os.path.join(path, "hetconv")):
            p.error(f"{flag} {path}: expected a checkout holding hetconv/")
    cores = sorted(os.sched_getaffinity(0))
    if cores[:2] != [0, 1]:
        p.error(f"needs cores 0 and 1 (the workers are pinned to them), this process may use {cores}")
    note = _common.reexec_without_blas_overrides()
    import numpy  # noqa: F401  (loaded, so threadpoolctl reports the BLAS the workers get)

    codes = [{"label": label, "dir": os.path.abspath(path), **dict(zip(("commit", "changed"), git_state(path)))}
             for label, path in (("before", args.before), ("after", args.after)) if path]
    scratch = tempfile.mkdtemp(prefix="hetconv-calnoise-")
    for c in codes:
        c["run_dir"] = importable_copy(c["dir"], os.path.join(scratch, c["label"]))
    print(f"each code's copy, and every run's metrics and output: {scratch}", flush=True)
    command = _common.recorded_command("calibration_noise.py", argv if argv is not None else sys.argv[1:])
    load_start = _common.load_average()
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(143)))
    rows, paper, t_all = [], [], time.perf_counter()
    try:
        for i in range(args.runs):
            for c in codes:            # alternating, so a change of the machine's load hits both alike
                for attempt in range(1 + max(0, args.retries)):
                    row = noise_run(c["label"], c["run_dir"], args.conv, scratch, i + 1, args.min_ratio, args.timeout,
                                    args.quiet_wait)
                    row.update(attempt=attempt + 1, loaded=row["foreign_load_cores"] > args.max_foreign)
                    rows.append(row)
                    report(c["label"], i + 1, args.runs, row)
                    if not row["loaded"]:
                        break
        if args.paper:
            for c in codes:
                paper.append(paper_run(c["label"], c["run_dir"], scratch, args.timeout))
                print(f"[{c['label']} paper] calibrated in {paper[-1]['calibration_s']}s", flush=True)
    except KeyboardInterrupt:
        print("interrupted: writing the runs measured so far", file=sys.stderr)
    finally:
        doc = {"machine": _common.cpu_model(), "isa_flags": _common.cpu_isa_flags(), "blas": _common.blas_info(),
               "blas_env": note, "command": command, "wall_s": time.perf_counter() - t_all,
               "load": {"start": load_start, "end": _common.load_average()},
               "conv": args.conv, "busy_core": BUSY_CORE, "min_ratio": args.min_ratio, "max_foreign": args.max_foreign,
               "codes": [{k: c[k] for k in ("label", "commit", "changed")} for c in codes], "rows": rows, "paper": paper}
        os.makedirs(args.out, exist_ok=True)
        json_path = os.path.join(args.out, "calibration_noise.json")
        _common.write_text(json_path, json.dumps(doc, indent=1) + "\n")
        print(f"wrote {json_path} and {_common.render_saved(json_path, 'calibration_noise', markdown)}")
    return 0 if rows and all(r.get("passed") for r in rows if r["code"] == "after" and not r.get("loaded")) else 1


if __name__ == "__main__":
    sys.exit(main())
