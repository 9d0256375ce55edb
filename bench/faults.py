"""Fault injection: real coordinator and worker processes on loopback, one fault each, and what
happened, measured rather than assumed. Writes OUT/reliability.json and renders OUT/reliability.md
from it (docs/reliability.md is this script's output).

    python bench/faults.py --out docs                        # every scenario, about 3 minutes on 2 cores
    python bench/faults.py --out /tmp/f --only kill          # the scenarios whose name holds 'kill'
    python bench/faults.py --render docs/reliability.json    # rewrite reliability.md from the JSON only

Every run is the same tiny network (conv 6,12, FC 16, batch 16, synthetic data), so a scenario
costs seconds; the reference for "equal to an uninterrupted run" is `--local` with the same seed,
compared in final weights and momentum (the saved checkpoints) and losses.
"""
import argparse
import glob
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from hetconv import checkpoint  # noqa: E402
from hetconv import protocol as P  # noqa: E402

NET = ["--conv", "6,12", "--fc", "16", "--batch-size", "16", "--synthetic-train", "512", "--synthetic-test", "32",
       "--threads", "1", "--calibration-batch", "4", "--use-all", "--seed", "7", "--rebalance-after", "0"]


def coordinator(*args):
    return [sys.executable, "-m", "hetconv.coordinator", *map(str, args)]


def worker(*args):
    return [sys.executable, "-m", "hetconv.worker", *map(str, args)]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Run:
    """A coordinator started in its own process group, its output in a file; always ended."""

    def __init__(self, workdir, name, args):
        self.dir = os.path.join(workdir, name)
        os.makedirs(self.dir, exist_ok=True)
        self.metrics = os.path.join(self.dir, "metrics.jsonl")
        self.out_path = os.path.join(self.dir, "out.txt")
        self.ckpt = os.path.join(self.dir, "ckpt")
        with open(self.out_path, "w") as out:
            self.proc = subprocess.Popen(coordinator(*args, "--metrics", self.metrics), stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True, cwd=self.dir)
        self.started = time.monotonic()

    def records(self):
        if not os.path.exists(self.metrics):
            return []
        with open(self.metrics) as f:
            return [json.loads(line) for line in f if line.strip()]

    def steps_done(self):
        return max([r["step"] for r in self.records() if r["event"] == "step"], default=0)

    def wait_for_step(self, step, seconds=120):
        deadline = time.monotonic() + seconds
        while self.steps_done() < step:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"step {step} never came: {self.output()[-800:]}")
            time.sleep(0.05)

    def worker_pids(self):
        pids = {}
        for line in self.output().splitlines():
            if line.startswith("worker ") and ", pid " in line:
                pids[line.split()[1]] = int(line.split(", pid ")[1].split(")")[0])
        return pids

    def output(self):
        with open(self.out_path) as f:
            return f.read()

    def finish(self, seconds=180):
        try:
            self.proc.wait(timeout=seconds)
        finally:
            end(self.proc)
        return self.proc.returncode

    def done(self):
        return next((r for r in self.records() if r["event"] == "done"), None)

    def losses(self):
        """Per step, the loss that counted: a replayed step's record replaces the first one."""
        by_step = {r["step"]: r["loss"] for r in self.records() if r["event"] == "step"}
        return [by_step[k] for k in sorted(by_step)]


def end(proc):
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def weights_diff(ckpt_a, ckpt_b):
    """Largest absolute difference over every conv and FC weight and momentum of two checkpoints."""
    _, conv_a, fc_a = checkpoint.load(ckpt_a)
    _, conv_b, fc_b = checkpoint.load(ckpt_b)
    return max(float(np.max(np.abs(a - b))) for ga, gb in zip(conv_a + fc_a, conv_b + fc_b) for a, b in zip(ga, gb))


# ---- scenarios ---------------------------------------------------------------------------------
# Each returns a row: what was done, what happened (the measured facts), and whether that is the
# outcome the design promises ("held"), decided from the facts by a stated rule.

def reference(workdir, steps):
    run = Run(workdir, f"local-{steps}", ["--local", *NET, "--steps", steps, "--checkpoint-dir", "ckpt"])
    assert run.finish() == 0, run.output()
    return run


def kill_worker(workdir):
    steps = 12
    ref = reference(workdir, steps)
    run = Run(workdir, "kill", ["--spawn", "cpu:1,cpu:1,cpu:1", *NET, "--steps", steps, "--snapshot-every", 3,
                                "--checkpoint-dir", "ckpt"])
    run.wait_for_step(5)
    victim_name, victim = sorted(run.worker_pids().items())[1]
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    code = run.finish()
    lost = [r for r in run.records() if r["event"] == "worker_lost"]
    replans = [r for r in run.records() if r["event"] == "plan" and str(r.get("reason", "")).startswith("lost")]
    replayed = (lost[0]["step"] - 1 - replans[0]["step"]) if lost and replans else None
    diff = weights_diff(run.ckpt, ref.ckpt) if code == 0 else None
    facts = {"exit_code": code, "done_record": run.done() is not None, "lost": [r["worker"] for r in lost],
             "steps_replayed": replayed, "snapshot_every": 3, "max_weight_diff_vs_local": diff,
             "loss_max_rel_diff": _rel(run.losses(), ref.losses()), "seconds_after_kill": time.monotonic() - killed_at}
    held = (code == 0 and facts["done_record"] and facts["lost"] == [victim_name] and replayed is not None
            and replayed <= 3 and diff is not None and diff < 1e-4)
    return row("kill -9 one of three spawned workers at step 6",
               f"`--spawn cpu:1,cpu:1,cpu:1 --snapshot-every 3 --steps {steps}`; SIGKILL {victim_name} after step 5",
               facts, held, "exit 0 with a done record; the victim named; at most --snapshot-every steps replayed; "
                            "final weights and momentum within 1e-4 of the uninterrupted --local run")


def hang_worker(workdir):
    run = Run(workdir, "hang", ["--spawn", "cpu:1,cpu:1,cpu:1", *NET, "--steps", 10, "--snapshot-every", 3,
                                "--worker-timeout", 3])
    run.wait_for_step(3)
    victim_name, victim = sorted(run.worker_pids().items())[0]
    os.kill(victim, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        deadline = stopped + 60
        lost = []
        while not lost and time.monotonic() < deadline and run.proc.poll() is None:
            lost = [r for r in run.records() if r["event"] == "worker_lost"]
            time.sleep(0.05)
        detected_s = time.monotonic() - stopped if lost else None
        code = run.finish()
    finally:
        if alive(victim):
            os.kill(victim, signal.SIGCONT)
    facts = {"exit_code": code, "done_record": run.done() is not None, "detected_after_s": detected_s,
             "worker_timeout_s": 3.0, "reason": lost[0]["reason"][:120] if lost else None,
             "hung_process_ended": not alive(victim)}
    held = (code == 0 and facts["done_record"] and detected_s is not None and detected_s < 3.0 + 1.5
            and facts["hung_process_ended"])
    return row("SIGSTOP one of three spawned workers (hung, connection open)",
               "`--worker-timeout 3`; SIGSTOP after step 3", facts, held,
               "named within --worker-timeout (+1.5 s for a step boundary), the hung process ended, run finishes")


def kill_external(workdir):
    address = f"tcp://127.0.0.1:{free_port()}"
    run = Run(workdir, "external", ["--workers", 3, "--bind", address, *NET, "--steps", 10, "--snapshot-every", 3,
                                    "--worker-timeout", 60])
    workers = [subprocess.Popen(worker("--device", "cpu", "--connect", address, "--threads", 1, "--name", f"ext{i}"),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
               for i in range(3)]
    try:
        run.wait_for_step(3)
        workers[2].kill()
        killed = time.monotonic()
        lost = []
        while not lost and time.monotonic() < killed + 70 and run.proc.poll() is None:
            lost = [r for r in run.records() if r["event"] == "worker_lost"]
            time.sleep(0.02)
        detected_s = time.monotonic() - killed if lost else None
        code = run.finish()
    finally:
        for w in workers:
            end(w)
    facts = {"exit_code": code, "done_record": run.done() is not None, "detected_after_s": detected_s,
             "heartbeat_limit_s": 60.0, "reason": lost[0]["reason"][:120] if lost else None}
    held = code == 0 and facts["done_record"] and detected_s is not None and detected_s < 3.0
    return row("kill -9 one of three external workers (no process handle)",
               "`--workers 3 --worker-timeout 60`; SIGKILL ext2 after step 3", facts, held,
               "heard on the socket monitor within 3 s (not the 60 s heartbeat limit); run finishes")


def below_min_workers(workdir):
    run = Run(workdir, "floor", ["--spawn", "cpu:1,cpu:1,cpu:1", *NET, "--steps", 200, "--snapshot-every", 2,
                                 "--min-workers", 2, "--checkpoint-dir", "ckpt"])
    run.wait_for_step(3)
    pids = sorted(run.worker_pids().values())
    for pid in pids[:2]:
        os.kill(pid, signal.SIGKILL)
    code = run.finish()
    saved = sorted(glob.glob(os.path.join(run.ckpt, "*.npz")))
    message = [line for line in run.output().splitlines() if "below --min-workers" in line]
    loads = False
    if saved:
        try:
            checkpoint.load(run.ckpt)
            loads = True
        except Exception:
            loads = False
    facts = {"exit_code": code, "checkpoints": len(saved), "newest_loads": loads,
             "message": message[0][:200] if message else None}
    held = code == 1 and loads and bool(message)
    return row("two of three workers killed under `--min-workers 2`", "SIGKILL two workers after step 3",
               facts, held, "a checkpoint of the last snapshot is written and loads; one clear line; exit 1")


def damaged_checkpoint(workdir):
    first = Run(workdir, "damaged", ["--spawn", "cpu:1,cpu:1", *NET, "--steps", 6, "--checkpoint-every", 2,
                                     "--checkpoint-dir", "ckpt"])
    code1 = first.finish()
    files = sorted(glob.glob(os.path.join(first.ckpt, "*.npz")))
    newest = files[-1]
    with open(newest, "r+b") as f:
        f.truncate(os.path.getsize(newest) // 2)
    second = Run(workdir, "damaged", ["--spawn", "cpu:1,cpu:1", *NET, "--steps", 8, "--checkpoint-dir", "ckpt",
                                      "--resume", first.ckpt])
    code2 = second.finish()
    resume = next((r for r in second.records() if r["event"] == "resume"), {})
    said = [line for line in second.output().splitlines() if "skipp" in line.lower()]
    facts = {"first_exit_code": code1, "truncated": os.path.basename(newest), "exit_code": code2,
             "resumed_from": os.path.basename(resume.get("path", "")), "resumed_step": resume.get("step"),
             "skipped": resume.get("skipped"), "said": said[0][:200] if said else None}
    held = (code2 == 0 and facts["resumed_from"] == os.path.basename(files[-2]) and bool(said))
    return row("newest checkpoint truncated, then `--resume DIR`", f"truncate {os.path.basename(newest)} to half",
               facts, held, "resumes from the previous checkpoint, says which it skipped and why, finishes")


def kill_coordinator_while_saving(workdir, trials=6):
    """SIGKILL the coordinator at random moments of a run that checkpoints every step: whatever
    the moment, the newest checkpoint that loads is a whole one (writes go to a temp file, then
    rename)."""
    rng = random.Random(3)
    outcomes = []
    for trial in range(trials):
        run = Run(workdir, f"coord-kill-{trial}", ["--spawn", "cpu:1", *NET, "--conv", "64,256", "--steps", 500,
                                                   "--checkpoint-every", 1, "--checkpoint-dir", "ckpt"])
        try:
            run.wait_for_step(2)
            time.sleep(rng.uniform(0.0, 0.5))
            os.killpg(run.proc.pid, signal.SIGKILL)
        finally:
            run.finish(30)
        leftovers = [n for n in os.listdir(run.ckpt) if not n.endswith(".npz")] if os.path.isdir(run.ckpt) else []
        try:
            meta, _, _ = checkpoint.load(run.ckpt)
            outcomes.append({"loads": True, "step": meta.get("step"), "temp_files_left": leftovers})
        except Exception as e:
            outcomes.append({"loads": False, "error": str(e)[:160], "temp_files_left": leftovers})
    facts = {"trials": trials, "newest_valid_loads": sum(o["loads"] for o in outcomes), "outcomes": outcomes}
    held = all(o["loads"] for o in outcomes)
    return row("kill -9 the coordinator while it checkpoints every step", f"{trials} random moments after step 2",
               facts, held, "in every trial the newest valid checkpoint loads")


def garbage_frames(workdir):
    steps = 8
    ref = reference(workdir, steps)
    address = f"tcp://127.0.0.1:{free_port()}"
    run = Run(workdir, "fuzz", ["--workers", 2, "--bind", address, *NET, "--steps", steps, "--snapshot-every", 100,
                                "--checkpoint-dir", "ckpt"])
    workers = [subprocess.Popen(worker("--device", "cpu", "--connect", address, "--threads", 1, "--name", f"w{i}"),
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
               for i in range(2)]
    import zmq
    ctx = zmq.Context()
    sent = {"coordinator": 0, "over_limit": 0}
    rng = random.Random(11)
    seeds = [P.pack("HEARTBEAT", 0), P.pack("ERROR", 3, name="X", message="m", worker="w", doing="d", traceback=""),
             P.pack("FORWARD_DONE", 5, [np.ones((2, 3), np.float32)], layer=0),
             P.pack("STEP_DONE", 9, step=1)]
    try:
        sockets = []
        while run.steps_done() < steps and run.proc.poll() is None:
            dealer = ctx.socket(zmq.DEALER)
            dealer.linger = 0
            dealer.connect(address)
            sockets.append(dealer)
            for _ in range(20):
                frames = [bytes(f) for f in rng.choice(seeds)]
                kind = rng.randrange(4)
                if kind == 0:
                    frames = [os.urandom(rng.randrange(1, 64)) for _ in range(rng.randrange(1, 4))]
                elif kind == 1:
                    i = rng.randrange(len(frames))
                    b = bytearray(frames[i])
                    for _ in range(rng.randrange(1, 8)):
                        if b:
                            b[rng.randrange(len(b))] = rng.randrange(256)
                    frames[i] = bytes(b)
                elif kind == 2:
                    frames = frames[:1] + [b"\0" * rng.randrange(0, 32)]
                dealer.send_multipart(frames)
                sent["coordinator"] += 1
            if rng.random() < 0.2:
                dealer.send_multipart([P.pack("HEARTBEAT", 0)[0], b"\0" * (64 << 20)])    # over the run's limit
                sent["over_limit"] += 1
            time.sleep(0.05)
        code = run.finish()
        for s in sockets:
            s.close(0)
    finally:
        for w in workers:
            end(w)
        ctx.term()
    diff = weights_diff(run.ckpt, ref.ckpt) if code == 0 else None
    facts = {"exit_code": code, "done_record": run.done() is not None, "frames_sent": sent,
             "max_weight_diff_vs_local": diff, "loss_max_rel_diff": _rel(run.losses(), ref.losses())}
    held = code == 0 and facts["done_record"] and diff is not None and diff < 1e-4
    return row("random, mutated and over-limit frames at the coordinator's port during training",
               "raw DEALERs: random bytes, mutated headers, truncated arrays, 64 MB frames", facts, held,
               "the run finishes with the weights of a run without them")


def foreign_keys(workdir):
    keys_dir, other = os.path.join(workdir, "keys"), os.path.join(workdir, "other-keys")
    for d in (keys_dir, other):
        shutil.rmtree(d, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "hetconv.keys", d], check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "hetconv.keys", keys_dir, "--worker", "second"], check=True, capture_output=True)
    address = f"tcp://127.0.0.1:{free_port()}"
    run = Run(workdir, "keys", ["--workers", 2, "--bind", address, "--curve", keys_dir, *NET, "--steps", 4])
    stranger = subprocess.Popen(worker("--device", "cpu", "--connect", address, "--name", "stranger",
                                       "--curve", os.path.join(other, "workers", "worker1"), "--connect-timeout", 15),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    time.sleep(1.5)
    keyed = [subprocess.Popen(worker("--device", "cpu", "--connect", address, "--threads", 1, "--name", name,
                                     "--curve", os.path.join(keys_dir, "workers", name)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
             for name in ("worker1", "second")]
    try:
        code = run.finish()
        _, stranger_err = stranger.communicate(timeout=60)
    finally:
        for p in keyed + [stranger]:
            end(p)
    plan = next((r for r in run.records() if r["event"] == "plan"), {})
    refused = [line for line in run.output().splitlines() if "refused a connection" in line]
    facts = {"exit_code": code, "done_record": run.done() is not None,
             "plan_workers": sorted(plan.get("layers", [{}])[0].get("kernels", {})),
             "coordinator_logged": refused[0][:160] if refused else None, "stranger_exit_code": stranger.returncode,
             "stranger_said": stranger_err.strip().splitlines()[-1][:200] if stranger_err.strip() else None}
    held = (code == 0 and facts["plan_workers"] == ["second", "worker1"] and bool(refused)
            and stranger.returncode != 0)
    return row("a worker with keys from another hetconv-keygen", "`--curve keys`; the stranger connects first",
               facts, held, "never joins (refusal logged with its address), the keyed workers train, exit 0")


def _rel(a, b):
    if not a or len(a) != len(b):
        return None
    return float(max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)))


def row(fault, how, facts, held, promise):
    return {"fault": fault, "how": how, "facts": facts, "held": bool(held), "promise": promise}


SCENARIOS = [("kill-worker", kill_worker), ("hang-worker", hang_worker), ("kill-external", kill_external),
             ("below-min-workers", below_min_workers), ("damaged-checkpoint", damaged_checkpoint),
             ("kill-coordinator", kill_coordinator_while_saving), ("garbage-frames", garbage_frames),
             ("foreign-keys", foreign_keys)]


def markdown(doc):
    header = [line.replace("; foreign load below is per row.", " (a loaded machine: the faults, not the "
                                                                   "timings, are the point).")
              for line in _common.run_header(doc)]
    lines = ["# Reliability: faults injected and what happened", ""] + header
    lines += ["Each row is a real run on loopback (the tiny network of `bench/faults.py`), the fault injected as "
              "written, and the facts measured in that run. `held` is decided from the facts by the rule in "
              "the last column. Nothing below is edited by hand: `python bench/faults.py --render "
              "docs/reliability.json` rewrites it.", ""]
    lines += ["| fault | how | held | the promise | measured |", "|---|---|---|---|---|"]
    for r in doc["rows"]:
        facts = "; ".join(f"{k}: {_fmt(v)}" for k, v in r["facts"].items() if k != "outcomes")
        lines.append(f"| {r['fault']} | {r['how']} | {'yes' if r['held'] else '**no**'} | {r['promise']} | {facts} |")
    held = sum(r["held"] for r in doc["rows"])
    lines += ["", f"{held} of {len(doc['rows'])} faults held. Also tested in the suite: "
                  "`tests/test_distributed.py` (kill, hang, disconnect, join, --min-workers, resume onto another "
                  "plan), `tests/test_checkpoint.py` (checksums, keep-K, damaged files), `tests/test_curve.py` "
                  "(keys), `tests/test_limits.py` (frame limits), `tests/test_protocol_fuzz.py` (hypothesis: "
                  "`unpack` on arbitrary frames returns a Message or raises ProtocolError), "
                  "`tests/test_heartbeats.py` (a busy link does not hide a live worker), `tests/test_live_fuzz.py` (hostile "
                  "frames at a live coordinator's port and a worker's peer inbox: the run trains the same), "
                  "`tests/test_ray_launcher.py` (a killed Ray actor is a lost worker)."]
    return "\n".join(lines) + "\n"


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v).replace("|", "/")


def no_plot(out_dir, rows, machine):
    return None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[3:7]))
    p.add_argument("--out", default=os.path.join(REPO, "docs"), help="folder for reliability.json and .md")
    p.add_argument("--only", default="", help="run only the scenarios whose name contains this")
    p.add_argument("--keep", action="store_true", help="keep the runs' folders (logs, metrics, checkpoints)")
    p.add_argument("--render", default="", metavar="JSON", help="run nothing: rewrite the .md beside a saved JSON")
    args = p.parse_args(argv)
    if args.render:
        _common.rerender(args.render, "reliability", markdown, no_plot)
        return 0
    os.makedirs(args.out, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="hetconv-faults-")
    t0 = time.monotonic()
    load_start = _common.load_average()
    rows = []
    try:
        for name, scenario in SCENARIOS:
            if args.only and args.only not in name:
                continue
            print(f"[{name}] ...", flush=True)
            s0 = time.monotonic()
            try:
                r = scenario(workdir)
            except Exception as e:             # a scenario that cannot even run is a result too
                r = row(name, "did not run to the end", {"error": f"{type(e).__name__}: {e}"[:300]}, False, "")
            r["seconds"] = time.monotonic() - s0
            print(f"    held: {r['held']}  {json.dumps(r['facts'])[:300]}", flush=True)
            rows.append(r)
    finally:
        if args.keep:
            print(f"runs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    doc = {"command": _common.recorded_command("faults.py", sys.argv[1:] if argv is None else argv),
           "machine": _common.cpu_model(), "wall_s": time.monotonic() - t0,
           "load": {"start": load_start, "end": _common.load_average()}, "rows": rows}
    _common.save_outputs(args.out, "reliability", doc, markdown, no_plot)
    return 0 if all(r["held"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
