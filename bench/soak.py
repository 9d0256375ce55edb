"""Soak: runs stopped by SIGTERM or Ctrl-C at random steps and resumed, over and over, beside a busy
process and under glibc's checking allocator; counts deaths by signal, heap errors and resumed
runs that end away from the uninterrupted run, bit for bit (`--deterministic`). Writes
OUT/soak.json and renders its table into docs/reliability.md's "Soak" section.

    python bench/soak.py --rounds 25 --out docs           # both modes, 25 rounds each (~25 min on 2 cores)
    python bench/soak.py --rounds 2 --out /tmp/soak       # a quick look
    python bench/soak.py --render docs/soak.json          # rewrite the section from the JSON only
    python bench/soak.py --modes local --out /tmp/a & python bench/soak.py --modes workers --out /tmp/b
    python bench/soak.py --render /tmp/a/soak.json,/tmp/b/soak.json --out docs   # two soaks side by side

Each round, for each mode (`--local`, and two spawned one-thread workers): a run of
`--data synthetic --conv 8,16 --fc 16 --batch-size 32 --threads 1 --seed 9 --eval-every 0 --deterministic`
with `--checkpoint-dir`, a signal (SIGTERM to the
coordinator, or SIGINT to its process group, as a terminal's Ctrl-C) once its metrics show a step
drawn at random, then `--resume` to the last step. The reference is one uninterrupted run per mode
with the same flags. The allocator: LD_PRELOAD of glibc's libc_malloc_debug.so.0 with
MALLOC_CHECK_=3 (a heap inconsistency aborts the process at once) and MALLOC_PERTURB_ (freed and
new memory filled with a pattern, so a read of freed memory shows as wrong numbers). Every run's
stderr (the workers' too) is searched for glibc's, LLVM's and Python's fatal messages. A fresh
Numba cache directory per soak: the first runs compile side by side into it.
"""
import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from hetconv.training import checkpoint  # noqa: E402

MALLOC_DEBUG = "/lib/x86_64-linux-gnu/libc_malloc_debug.so.0"
NET = ["--data", "synthetic", "--conv", "8,16", "--fc", "16", "--batch-size", "32", "--threads", "1", "--seed", "9",
       "--eval-every", "0", "--deterministic"]
MODES = {"local": ["--local"], "workers": ["--spawn", "cpu:1,cpu:1"]}
SIGNALS = {"SIGTERM": (signal.SIGTERM, 143), "Ctrl-C": (signal.SIGINT, 130)}
# what a process that died of a bad heap, a JIT assertion or a fault leaves on stderr
FATAL = re.compile(r"corrupted|malloc\(\)|free\(\)|double free|munmap_chunk|realloc\(\)|malloc_consolidate|"
                   r"Fatal Python error|Segmentation fault|Assertion .* failed|LLVM ERROR|DenseMap|core dumped")
SECTION = "## Soak: stops and resumes under a checking allocator"


def coordinator(*args):
    return [sys.executable, "-m", "hetconv.cli.coordinator", *map(str, args)]


def records(path):
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass                               # a line cut by the signal
    except FileNotFoundError:                          # not written yet (or gone between two polls)
        return []
    return out


def reached(path):
    return max((r["step"] for r in records(path) if r.get("event") == "step"), default=0)


def run_to_end(cmd, env, log_path, timeout):
    with open(log_path, "a") as log:
        p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
        try:
            return p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            return "timeout"
        except BaseException:                           # the soak itself stopped: leave no run behind
            _end_group(p)
            raise


def interrupted_run(cmd, env, log_path, metrics, at_step, signum, timeout):
    """Start `cmd`, send `signum` once the metrics show step `at_step` (SIGINT to the process
    group, as a terminal does; SIGTERM to the coordinator), wait. Returns (exit code, step reached
    when signalled)."""
    with open(log_path, "a") as log:
        p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
        try:
            deadline = time.monotonic() + timeout
            while reached(metrics) < at_step and p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            step = reached(metrics)
            if p.poll() is None:
                (os.killpg if signum == signal.SIGINT else os.kill)(p.pid, signum)
            return p.wait(timeout=timeout), step
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            return "timeout", reached(metrics)
        except BaseException:
            _end_group(p)
            raise


def _end_group(p):
    """SIGKILL to a run's process group (its spawned workers too), if it still runs."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def final_state(ckpt_dir):
    meta, conv, fc = checkpoint.load(ckpt_dir)
    arrays = {}
    for i, layer in enumerate(conv + fc):
        for key, value in layer.items():
            arrays[f"{i}.{key}"] = np.asarray(value)
    return meta["step"], arrays


def difference(a, b):
    """(bit-identical, largest absolute difference) between two final states."""
    if sorted(a) != sorted(b):
        return False, float("inf")
    same = all(a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes() for k in a)
    diff = max((float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)))) if a[k].size else 0.0
                for k in a), default=0.0)
    return same, diff


def fatal_lines(log_path):
    with open(log_path, errors="replace") as f:
        return [line.strip() for line in f if FATAL.search(line)][:5]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[4:8]))
    p.add_argument("--rounds", type=int, default=10, help="rounds; each stops and resumes one run of every mode")
    p.add_argument("--steps", type=int, default=40, help="steps of every run (a stop lands at 2..steps-10)")
    p.add_argument("--modes", default="local,workers", help="comma list of: " + ", ".join(MODES))
    p.add_argument("--out", default=os.path.join(REPO, "docs"), help="folder for soak.json; a folder named docs also "
                                                                      "gets its section in reliability.md")
    p.add_argument("--seed", type=int, default=0, help="draws the signals and their steps")
    p.add_argument("--no-busy", action="store_true", help="no busy process beside the runs")
    p.add_argument("--no-malloc-debug", action="store_true", help="glibc's ordinary allocator")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any one run may take (a hang guard)")
    p.add_argument("--keep", action="store_true", help="keep the runs' folders (logs, metrics, checkpoints)")
    p.add_argument("--render", default="", metavar="JSON[,JSON...]",
                   help="run nothing: render the section from saved JSON; several (soaks run side by side, one per "
                        "mode) are merged into OUT/soak.json first")
    args = p.parse_args(argv)
    if args.render:
        parts = args.render.split(",")
        doc = merged([json.load(open(path)) for path in parts])
        out_dir = args.out if len(parts) > 1 else os.path.dirname(os.path.abspath(parts[0]))
        if len(parts) > 1:
            _common.write_text(os.path.join(out_dir, "soak.json"), json.dumps(doc, indent=1) + "\n")
        print(write_section(doc, out_dir))
        return 0
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown or args.rounds < 1 or args.steps < 12:
        p.error(f"--modes of {', '.join(MODES)} (got {unknown}), --rounds >= 1, --steps >= 12")
    malloc_debug = not args.no_malloc_debug
    if malloc_debug and not os.path.exists(MALLOC_DEBUG):
        p.error(f"{MALLOC_DEBUG} is missing (glibc 2.34+ ships it; --no-malloc-debug runs without)")

    started, load_start = time.time(), _common.load_average()
    workdir = tempfile.mkdtemp(prefix="hetconv-soak-")
    env = dict(os.environ, PYTHONPATH=REPO, NUMBA_CACHE_DIR=os.path.join(workdir, "numba-cache"),
               PYTHONFAULTHANDLER="1", LIBC_FATAL_STDERR_="1")
    if malloc_debug:
        env.update(LD_PRELOAD=MALLOC_DEBUG, MALLOC_CHECK_="3", MALLOC_PERTURB_="165")
    # SIGTERM ends the soak as Ctrl-C does: through the clean-up below (the busy process, the run
    # in flight and its workers), keeping the rounds already written
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    busy = None if args.no_busy else subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                                       start_new_session=True)
    rng = random.Random(args.seed)
    doc = {**_common.run_facts("soak.py", sys.argv[1:] if argv is None else argv, started, load_start),
           "malloc_debug": malloc_debug, "busy": busy is not None, "steps": args.steps, "rounds": []}
    try:
        reference = {}
        for mode in modes:
            d = os.path.join(workdir, f"reference-{mode}")
            os.makedirs(d)
            code = run_to_end(coordinator(*NET, *MODES[mode], "--steps", args.steps, "--checkpoint-dir",
                                          os.path.join(d, "ckpt")), env, os.path.join(d, "out.txt"), args.timeout)
            if code != 0:
                raise SystemExit(f"the uninterrupted {mode} run failed (exit {code}): see {d}/out.txt")
            reference[mode] = final_state(os.path.join(d, "ckpt"))[1]
            print(f"reference {mode}: {args.steps} steps", flush=True)
        for r in range(args.rounds):
            for mode in modes:
                name = rng.choice(sorted(SIGNALS))
                signum, expected = SIGNALS[name]
                at = rng.randint(2, args.steps - 10)
                d = os.path.join(workdir, f"round{r:03d}-{mode}")
                os.makedirs(d)
                log, metrics, ckpt = (os.path.join(d, f) for f in ("out.txt", "metrics.jsonl", "ckpt"))
                t0 = time.monotonic()
                code, signalled_at = interrupted_run(
                    coordinator(*NET, *MODES[mode], "--steps", args.steps, "--checkpoint-dir", ckpt, "--metrics", metrics),
                    env, log, metrics, at, signum, args.timeout)
                resume_code = run_to_end(coordinator(*NET, *MODES[mode], "--steps", args.steps, "--resume", ckpt,
                                                     "--metrics", metrics), env, log, args.timeout)
                row = {"round": r, "mode": mode, "signal": name, "at_step": signalled_at, "exit": code,
                       "expected_exit": expected, "resume_exit": resume_code, "seconds": time.monotonic() - t0,
                       "fatal": fatal_lines(log),
                       "lost_workers": sum(r_["event"] == "worker_lost" for r_ in records(metrics))}
                row["died_by_signal"] = any(isinstance(c, int) and c < 0 for c in (code, resume_code))
                # the run ended before the signal reached it (every step done): a stop that never happened
                row["missed"] = code == 0 and signalled_at >= args.steps
                if resume_code == 0:
                    step, state = final_state(ckpt)
                    row["final_step"] = step
                    row["bit_identical"], row["max_abs_diff"] = difference(state, reference[mode])
                else:
                    row["bit_identical"], row["max_abs_diff"] = False, None
                row["ok"] = ((code == expected or row["missed"]) and resume_code == 0 and not row["fatal"]
                             and row["bit_identical"] and row.get("final_step") == args.steps)
                doc["rounds"].append(row)
                print(f"round {r} {mode}: {name} at step {signalled_at}: exit {code}, resume {resume_code}, "
                      f"{'bit-identical' if row['bit_identical'] else 'DIFFERS'}"
                      f"{', FATAL: ' + row['fatal'][0] if row['fatal'] else ''}", flush=True)
                if not row["ok"] and args.keep is False:
                    shutil.copytree(d, os.path.join(args.out, "soak-failures", os.path.basename(d)), dirs_exist_ok=True)
                elif not args.keep:
                    shutil.rmtree(d, ignore_errors=True)
            doc["wall_s"] = time.time() - started
            doc["load"]["end"] = _common.load_average()
            os.makedirs(args.out, exist_ok=True)
            _common.write_text(os.path.join(args.out, "soak.json"), json.dumps(doc, indent=1) + "\n")
    finally:
        if busy is not None:
            os.killpg(busy.pid, signal.SIGKILL)
            busy.wait()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"runs kept in {workdir}")
    print(write_section(doc, args.out))
    return 0 if all(row["ok"] for row in doc["rounds"]) else 1


def merged(docs):
    """One document from soaks run side by side (one per mode): their rounds together, the longest
    wall time, the first start's load and the last end's, every command."""
    if len(docs) == 1:
        return docs[0]
    doc = dict(docs[0])
    doc["rounds"] = [row for d in docs for row in d["rounds"]]
    doc["wall_s"] = max(d["wall_s"] for d in docs)
    doc["command"] = "` and, side by side, `".join(d["command"] for d in docs)
    doc["load"] = {"start": docs[0]["load"]["start"], "end": docs[-1]["load"]["end"]}
    for key in ("malloc_debug", "busy", "steps"):
        if any(d[key] != doc[key] for d in docs):
            raise SystemExit(f"cannot merge soaks with different {key}: {[d[key] for d in docs]}")
    return doc


def summary(doc):
    rows = doc["rounds"]
    by_mode = {}
    for row in rows:
        by_mode.setdefault(row["mode"], []).append(row)
    table = []
    for mode, got in by_mode.items():
        table.append([mode, len(got), sum(r["signal"] == "SIGTERM" for r in got), sum(r["signal"] == "Ctrl-C" for r in got),
                      sum(r["died_by_signal"] for r in got), sum(bool(r["fatal"]) for r in got),
                      sum(r.get("missed", False) for r in got),
                      sum((r["exit"] != r["expected_exit"] and not r.get("missed")) or r["resume_exit"] != 0 for r in got),
                      sum(r["resume_exit"] == 0 and not r["bit_identical"] for r in got),
                      sum(r["lost_workers"] for r in got)])
    return table


def markdown(doc):
    allocator = (f"glibc's checking allocator (`LD_PRELOAD={MALLOC_DEBUG} MALLOC_CHECK_=3 MALLOC_PERTURB_=165`)"
                 if doc["malloc_debug"] else "glibc's ordinary allocator")
    lines = [SECTION, "",
             f"Machine: {doc['machine']} ({doc['isa']}). Command: `{doc['command']}` ({doc['wall_s'] / 60:.1f} min); "
             f"{doc['load']['start']} at start, {doc['load']['end']} at end; "
             f"{'a busy process beside every run' if doc['busy'] else 'no busy process'}; {allocator}.", "",
             f"Each round stops one run of each mode with SIGTERM (to the coordinator) or Ctrl-C (SIGINT to its "
             f"process group) at a random step of {doc['steps']}, then resumes it to the end; `--deterministic`, so "
             f"the resumed run must end bit for bit where the uninterrupted run of the same flags ends. Deaths: "
             f"an exit by a signal (SIGABRT, SIGSEGV); heap errors: glibc's, LLVM's or Python's fatal messages in "
             f"any process's stderr; a stop missed: the run had ended before the signal came (its resume must "
             f"still end where the uninterrupted run ends). Nothing below is edited by hand (`python bench/soak.py --render docs/soak.json`).",
             "",
             _common.markdown_table(["mode", "rounds", "SIGTERM", "Ctrl-C", "deaths", "heap errors", "stops missed",
                                     "wrong exit codes", "mismatches", "workers lost"], summary(doc))]
    bad = [r for r in doc["rounds"] if not r["ok"]]
    lines += ["", f"{len(doc['rounds']) - len(bad)} of {len(doc['rounds'])} stops and resumes held."]
    for r in bad[:10]:
        lines.append(f"- round {r['round']} {r['mode']}: {r['signal']} at step {r['at_step']}: exit {r['exit']} "
                     f"(expected {r['expected_exit']}), resume {r['resume_exit']}, max difference {r['max_abs_diff']}"
                     + (f"; {r['fatal'][0]}" if r["fatal"] else ""))
    return "\n".join(lines) + "\n"


def write_section(doc, out_dir):
    """Render the section; in a folder named docs, replace (or append) it in reliability.md."""
    text = markdown(doc)
    if os.path.basename(os.path.normpath(out_dir)) != "docs":
        return text
    path = os.path.join(out_dir, "reliability.md")
    old = open(path).read() if os.path.exists(path) else ""
    at = old.find("\n" + SECTION)
    if at < 0:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        end = old.find("\n## ", at + 1)
        new = old[:at + 1] + text + (old[end:] if end >= 0 else "")
    _common.write_text(path, new)
    return text + f"\n(written into {path})"


if __name__ == "__main__":
    sys.exit(main())
