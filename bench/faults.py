"""Fault injection: real coordinator and worker processes on loopback, one fault each, and what
happened, measured rather than assumed. Writes OUT/reliability.json and renders OUT/reliability.md
from it (docs/reliability.md is this script's output).

    python bench/faults.py --out docs                        # every scenario, about 6 minutes on 2 cores
    python bench/faults.py --out /tmp/f --only kill          # the scenarios whose name holds 'kill'
    python bench/faults.py --render docs/reliability.json    # rewrite reliability.md from the JSON only

Every run is the same tiny network (conv 6,12, FC 16, batch 16, synthetic data), so a scenario
costs seconds; the reference for "equal to an uninterrupted run" is `--local` with the same seed,
compared in final weights and momentum (the saved checkpoints) and losses. Where a fault must hit
an exact moment (during a checkpoint's gather, a rebalance, a joiner's calibration), the scenario
runs the coordinator's engine and training loop in this process and wraps one engine method to
inject it there; its row's `how` says "in-process engine". The workers are always real processes.
"""
import argparse
import contextlib
import glob
import json
import os
import random
import re
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
from hetconv.training import checkpoint  # noqa: E402
from hetconv.transport import protocol as P  # noqa: E402

NET = ["--conv", "6,12", "--fc", "16", "--batch-size", "16", "--synthetic-train", "512", "--synthetic-test", "32",
       "--threads", "1", "--calibration-batch", "4", "--use-all", "--seed", "7", "--rebalance-after", "0"]


def coordinator(*args):
    return [sys.executable, "-m", "hetconv.cli.coordinator", *map(str, args)]


def worker(*args):
    return [sys.executable, "-m", "hetconv.cli.worker", *map(str, args)]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Outputs:
    """What a run leaves in its folder: metrics.jsonl, out.txt, ckpt/."""

    def __init__(self, workdir, name):
        self.dir = os.path.join(workdir, name)
        os.makedirs(self.dir, exist_ok=True)
        self.metrics = os.path.join(self.dir, "metrics.jsonl")
        self.out_path = os.path.join(self.dir, "out.txt")
        self.ckpt = os.path.join(self.dir, "ckpt")

    def records(self):
        if not os.path.exists(self.metrics):
            return []
        with open(self.metrics) as f:
            return [json.loads(line) for line in f if line.strip()]

    def output(self):
        with open(self.out_path) as f:
            return f.read()

    def done(self):
        return next((r for r in self.records() if r["event"] == "done"), None)

    def lost(self):
        return [r["worker"] for r in self.records() if r["event"] == "worker_lost"]

    def losses(self):
        """Per step, the loss that counted: a replayed step's record replaces the first one."""
        by_step = {r["step"]: r["loss"] for r in self.records() if r["event"] == "step"}
        return [by_step[k] for k in sorted(by_step)]


class Run(_Outputs):
    """A coordinator started in its own process group, its output in a file, its workers' ipc
    files under its folder (TMPDIR); always ended."""

    def __init__(self, workdir, name, args):
        super().__init__(workdir, name)
        # TMPDIR for the coordinator and for the workers a scenario starts: a killed worker's ipc
        # files stay in the run's folder and go with it, not into /tmp
        self.env = {**os.environ, "TMPDIR": self.dir}
        with open(self.out_path, "w") as out:
            self.proc = subprocess.Popen(coordinator(*args, "--metrics", self.metrics), stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True, cwd=self.dir,
                                         env=self.env)
        self.started = time.monotonic()

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

    def finish(self, seconds=180):
        try:
            self.proc.wait(timeout=seconds)
        finally:
            end(self.proc)
        return self.proc.returncode


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

_references = {}


def reference(workdir, steps, epochs=1):
    """The uninterrupted `--local` run of `steps` steps, run once per script run and shared."""
    key = (workdir, steps, epochs)
    if key not in _references:
        run = Run(workdir, f"local-{steps}-e{epochs}", ["--local", *NET, "--epochs", epochs, "--steps", steps,
                                                        "--checkpoint-dir", "ckpt"])
        code = run.finish()
        if code != 0:
            raise RuntimeError(f"the --local reference exited {code}: {' / '.join(run.output().splitlines()[-3:])}")
        _references[key] = run
    return _references[key]


def newest_step(ckpt):
    """The step of the checkpoint `--resume DIR` would take, or None when none loads."""
    try:
        return checkpoint.load(ckpt)[0]["step"]
    except checkpoint.CheckpointError:
        return None


def checkpoint_files(ckpt):
    return sorted(n for n in os.listdir(ckpt) if n.endswith(".npz")) if os.path.isdir(ckpt) else []


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
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                env=run.env)
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
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
                                env=run.env)
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
        subprocess.run([sys.executable, "-m", "hetconv.cli.keygen", d], check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "hetconv.cli.keygen", keys_dir, "--worker", "second"], check=True, capture_output=True)
    address = f"tcp://127.0.0.1:{free_port()}"
    run = Run(workdir, "keys", ["--workers", 2, "--bind", address, "--curve", keys_dir, *NET, "--steps", 4])
    stranger = subprocess.Popen(worker("--device", "cpu", "--connect", address, "--name", "stranger",
                                       "--curve", os.path.join(other, "workers", "worker1"), "--connect-timeout", 15),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                env=run.env)
    time.sleep(1.5)
    keyed = [subprocess.Popen(worker("--device", "cpu", "--connect", address, "--threads", 1, "--name", name,
                                     "--curve", os.path.join(keys_dir, "workers", name)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                              env=run.env)
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
    if code != 0:
        facts["coordinator_said"] = run.output().strip().splitlines()[-1][:200]
    held = (code == 0 and facts["plan_workers"] == ["second", "worker1"] and bool(refused)
            and stranger.returncode != 0)
    return row("a worker with keys from another hetconv-keygen", "`--curve keys`; the stranger connects first",
               facts, held, "never joins (refusal logged with its address), the keyed workers train, exit 0")


# ---- a worker lost outside a training step: the engine in this process -------------------------
# The moment must be exact (during a checkpoint's gather, while kernels move, while a joiner
# calibrates), so these scenarios run the coordinator's engine and training loop in this process,
# as tests/test_no_lost_work.py does, and wrap one engine method to inject the fault there. The
# workers are real processes; train() returns or raises instead of an exit code.

def cli_config(*args):
    """The Config `hetconv-coordinator` builds from NET and `args`."""
    from hetconv.training.config import config_from_args
    from hetconv.cli.coordinator import build_parser
    return config_from_args(build_parser().parse_args([*NET, *map(str, args)]))


@contextlib.contextmanager
def redirected(path, tmpdir):
    """This process's stdout and stderr go to `path`, and TMPDIR is `tmpdir`, until the block
    ends: the workers it spawns meanwhile inherit both, so their output and ipc files stay with
    the run."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    previous_tmpdir = os.environ.get("TMPDIR")
    with open(path, "a") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    os.environ["TMPDIR"] = tmpdir
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
        if previous_tmpdir is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = previous_tmpdir


class EngineRun(_Outputs):
    """RemoteEngine with `workers` spawned `cpu:1` workers (as `--spawn cpu:1,...` starts them,
    with the CLI's frame limit) and train(), in this process."""

    def __init__(self, workdir, name, workers, *args):
        super().__init__(workdir, name)
        self.cfg = cli_config(*args, "--checkpoint-dir", self.ckpt, "--metrics", self.metrics)
        self.workers = workers
        self.lines = []                                 # what the engine and the loop logged
        self.engine = None
        self.raised, self.seconds, self.plan_workers, self.calibrated = None, None, [], []
        self.joiner, self.joiner_err, self.hello_at, self.admitted_at = None, None, None, None

    def run(self, inject):
        """Start the engine, let `inject(self)` wrap its methods, train; the engine is closed after."""
        from hetconv.geometry import conv_specs, message_limit_bytes
        from hetconv.coordinator.remote import RemoteEngine
        from hetconv.training.loop import train
        cfg = self.cfg
        limit = message_limit_bytes(conv_specs(cfg.conv_kernels(), cfg.ksize, cfg.padding), cfg.batch_size,
                                    cfg.image_shape())
        with redirected(self.out_path, self.dir):
            self.engine = RemoteEngine("tcp://127.0.0.1:0", 0, ["cpu:1"] * self.workers, threads=cfg.threads,
                                       connect_timeout=60, log=self.log, message_limit=limit)
            try:
                inject(self)
                t0 = time.monotonic()
                try:
                    train(cfg, self.engine, log=self.log)
                except Exception as e:                  # a promise that did not hold is a fact, not a crash
                    self.raised = f"{type(e).__name__}: {e}"[:300]
                self.seconds = time.monotonic() - t0
                self.plan_workers = list(self.engine.plan.workers) if self.engine.plan else []
                self.calibrated = sorted(self.engine.calibration or {})
            finally:
                self.engine.close()
                if self.joiner is not None:
                    try:
                        self.joiner.wait(timeout=30)    # told SHUTDOWN at close, or already gone
                    except subprocess.TimeoutExpired:
                        pass
                    end(self.joiner)
        return self

    def log(self, line):
        self.lines.append(line)
        print(line, flush=True)                         # into out.txt, beside the workers' output

    def said(self, *words):
        return [line for line in self.lines if all(w in line for w in words)]

    def joiner_said(self):
        with open(self.joiner_err) as f:
            return f.read().strip().splitlines()


def kill_spawned(engine, index):
    """SIGKILL the engine's index-th spawned worker and wait for it; returns its name in the plan."""
    _, proc = engine.processes[index]
    name = next(n for n, p in engine.peers.items() if p.process is proc)
    proc.kill()
    proc.wait()
    return name


def recovered(run, ref, killed, steps):
    """The facts of a run that lost `killed` and must end as the uninterrupted `ref`, and whether
    it did: no exception, a done record with ref's test accuracy, only the victims lost, and the
    checkpoint of the last step within 1e-4 of ref's."""
    done, ref_done = run.done(), ref.done()
    step = newest_step(run.ckpt)
    diff = weights_diff(run.ckpt, ref.ckpt) if step == steps else None
    facts = {"raised": run.raised, "done_record": done is not None,
             "test_accuracy": done["test_accuracy"] if done else None, "local_test_accuracy": ref_done["test_accuracy"],
             "killed": killed, "lost": run.lost(), "checkpoint_step": step, "max_weight_diff_vs_local": diff,
             "train_s": run.seconds}
    held = (run.raised is None and done is not None and facts["test_accuracy"] == facts["local_test_accuracy"]
            and killed and facts["lost"] == killed and diff is not None and diff < 1e-4)
    return facts, held


RECOVERED = ("train() returns with a done record holding the uninterrupted run's test accuracy; only the "
             "victim lost; final weights and momentum within 1e-4 of the uninterrupted --local run")


def lost_in_evaluation(workdir):
    steps = 6
    ref = reference(workdir, steps)
    run = EngineRun(workdir, "lost-eval", 3, "--steps", steps)
    killed = []

    def inject(run):
        engine, real_predict = run.engine, run.engine.predict

        def predict(x):
            if not killed:
                killed.append(kill_spawned(engine, 1))  # in the middle of the test set's first batch
            return real_predict(x)
        engine.predict = predict
    run.run(inject)
    facts, held = recovered(run, ref, killed, steps)
    facts["survivors"] = run.plan_workers
    return row("kill -9 one of three workers during the test evaluation",
               f"in-process engine, `predict` wrapped: SIGKILL {killed[0] if killed else '?'} as the first test "
               f"batch goes out (after step {steps})", facts, held, RECOVERED)


def lost_in_checkpoint_gather(workdir):
    steps = 6
    ref = reference(workdir, steps)
    run = EngineRun(workdir, "lost-gather", 3, "--steps", steps, "--checkpoint-every", 2, "--snapshot-every", 100)
    killed = []

    def inject(run):
        engine, real_gather, calls = run.engine, run.engine.gather, {"n": 0}

        def gather():
            calls["n"] += 1
            if calls["n"] == 2:                         # the step-4 checkpoint's
                killed.append(kill_spawned(engine, 2))
            return real_gather()
        engine.gather = gather
    run.run(inject)
    facts, held = recovered(run, ref, killed, steps)
    facts["checkpoint_records"] = sorted(r["step"] for r in run.records() if r["event"] == "checkpoint")
    held = held and facts["checkpoint_records"] == [2, 4, 6]
    return row("kill -9 one of three workers while a checkpoint gathers the weights",
               "in-process engine, `gather` wrapped; `--checkpoint-every 2 --snapshot-every 100` (every gather is a "
               f"checkpoint's): SIGKILL {killed[0] if killed else '?'} as the step-4 checkpoint's gather starts",
               facts, held, RECOVERED + "; checkpoints of steps 2, 4, 6 written")


def lost_in_rebalance(workdir):
    from hetconv.engine.planner import fixed_plan
    steps = 6
    ref = reference(workdir, steps)
    run = EngineRun(workdir, "lost-rebalance", 3, "--steps", steps, "--rebalance-after", 2)
    killed, proposals = [], []

    def inject(run):
        engine = run.engine

        def propose_rebalance(specs, **kw):             # move up to two kernels, whatever the timings say
            proposals.append(len(engine.plan.workers))
            counts = {n: [lp.count(n) for lp in engine.plan.layers] for n in engine.plan.workers}
            away = max(engine.plan.workers, key=lambda n: counts[n][1])
            to = next(n for n in engine.plan.workers if n != away)
            moved = min(2, counts[away][1] - 1)         # every worker keeps a kernel of every layer
            counts[to][1] += moved
            counts[away][1] -= moved
            return fixed_plan([s.kernels for s in specs], counts)
        engine.propose_rebalance = propose_rebalance
        real_load = engine.load

        def load(plan, specs, params):
            if len(proposals) == 1 and not killed:
                killed.append(kill_spawned(engine, 1))  # while the kernels move
            return real_load(plan, specs, params)
        engine.load = load
    run.run(inject)
    facts, held = recovered(run, ref, killed, steps)
    facts["workers_at_each_proposal"] = proposals
    rearmed = bool(proposals) and proposals[0] == 3 and 2 in proposals[1:]
    return row("kill -9 one of three workers while a rebalance moves kernels",
               "in-process engine, `propose_rebalance` forced to move 2 of conv2's kernels at step 2 "
               "(`--rebalance-after 2`), "
               f"`load` wrapped: SIGKILL {killed[0] if killed else '?'} as the moved plan is loaded",
               facts, held and rearmed, RECOVERED + "; rebalancing armed again on the survivors")


def start_joiner(run, name, *flags):
    """An external hetconv-worker asking to join the run's engine (with the run's keys), its
    stderr and ipc files in a folder of its own."""
    folder = os.path.join(run.dir, name)
    os.makedirs(folder, exist_ok=True)
    run.joiner_err = os.path.join(folder, "stderr.txt")
    with open(run.joiner_err, "w") as err:
        run.joiner = subprocess.Popen(worker("--device", "cpu", "--connect", run.engine.address, "--threads", 1,
                                             "--name", name, "--curve", run.engine.worker_keydir, *flags),
                                      stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
                                      env={**os.environ, "TMPDIR": folder})


def join_during_step(run, at_step, *flags, slow_steps=(), slow_s=0.0):
    """Wrap conv_step: as step `at_step` starts, a joiner named 'late' is started and the step
    waits (the engine reading its socket, as between the messages of a step) until its HELLO has
    come; steps in `slow_steps` take `slow_s` longer. Wrap admit to time the admission."""
    engine = run.engine
    real_step, real_admit, calls = engine.conv_step, engine.admit, {"n": 0}

    def conv_step(*args, **kw):
        calls["n"] += 1
        if calls["n"] == at_step:
            start_joiner(run, "late", *flags)
            deadline = time.monotonic() + 90
            while not engine.joining and time.monotonic() < deadline and run.joiner.poll() is None:
                engine._receive({}, deadline + 1, "waiting for a joiner's HELLO")
            run.hello_at = time.monotonic() if engine.joining else None
        if calls["n"] in slow_steps:
            time.sleep(slow_s)
        return real_step(*args, **kw)

    def admit(*args, **kw):
        plan = real_admit(*args, **kw)
        if plan is not None and run.admitted_at is None:
            run.admitted_at = time.monotonic()
        return plan
    engine.conv_step, engine.admit = conv_step, admit


def lost_while_joiner_calibrates(workdir):
    steps = 6
    ref = reference(workdir, steps)
    run = EngineRun(workdir, "lost-joiner-calibration", 2, "--steps", steps, "--snapshot-every", 2)
    killed = []

    def inject(run):
        engine = run.engine
        join_during_step(run, 2, "--connect-timeout", 60, "--idle-timeout", 120)
        real_calibrate = engine._calibrate_some

        def calibrate_some(specs, input_shapes, settings, names):
            if "late" in names and not killed:
                killed.append(kill_spawned(engine, 1))
            return real_calibrate(specs, input_shapes, settings, names)
        engine._calibrate_some = calibrate_some
    run.run(inject)
    facts, held = recovered(run, ref, killed, steps)
    facts.update(joiner_heard=run.hello_at is not None, plan_workers=run.plan_workers, calibrated=run.calibrated)
    held = (held and run.hello_at is not None and "late" in run.plan_workers
            and sorted(run.plan_workers) == run.calibrated)
    return row("kill -9 a worker while a joiner is calibrated",
               "in-process engine: an external worker joins during step 2 (`--snapshot-every 2`), `_calibrate_some` "
               f"wrapped: SIGKILL {killed[0] if killed else '?'} as the joiner's calibration starts",
               facts, held, RECOVERED + "; the joiner is in the plan, and every planned worker calibrated")


def joiner_with_small_frame_limit(workdir):
    steps = 6
    ref = reference(workdir, steps)
    run = EngineRun(workdir, "joiner-small-limit", 2, "--steps", steps, "--snapshot-every", 2)
    run.run(lambda run: join_during_step(run, 2, "--message-limit-mb", "0.001", "--connect-timeout", 60))
    done = run.done()
    diff = weights_diff(run.ckpt, ref.ckpt) if newest_step(run.ckpt) == steps else None
    said = run.said("not admitted")
    reasons = [r.get("reason") for r in run.records() if r["event"] == "plan"]
    membership = [r["event"] for r in run.records() if r["event"] in ("worker_lost", "worker_joined")]
    joiner = run.joiner_said()
    facts = {"raised": run.raised, "done_record": done is not None, "joiner_heard": run.hello_at is not None,
             "not_admitted_lines": len(said), "said": said[0][:200] if said else None,
             "joiner_exit_code": run.joiner.returncode, "joiner_said": joiner[-1][:200] if joiner else None,
             "membership_records": membership, "plan_reasons": reasons, "plan_workers": run.plan_workers,
             "max_weight_diff_vs_local": diff}
    held = (run.raised is None and done is not None and run.hello_at is not None and len(said) == 1
            and "MessageLimitError" in said[0] and not membership and reasons == [None]
            and run.plan_workers == ["w0-cpu:1", "w1-cpu:1"] and diff is not None and diff < 1e-4)
    return row("a joiner whose --message-limit-mb is too small for the run",
               "in-process engine (2 workers, `--snapshot-every 2`): `hetconv-worker --message-limit-mb 0.001` "
               "joins during step 2", facts, held,
               "dropped once with one `not admitted` line naming MessageLimitError; no re-plan, no lost or joined "
               "worker; the run ends with the uninterrupted --local run's weights (within 1e-4)")


def joiner_told_to_wait(workdir):
    steps, every, connect_timeout = 12, 10, 1.0
    ref = reference(workdir, steps)
    run = EngineRun(workdir, "joiner-wait", 2, "--steps", steps, "--snapshot-every", every)
    run.run(lambda run: join_during_step(run, 2, "--connect-timeout", connect_timeout, "--heartbeat", 0.2,
                                         slow_steps=range(1, every + 1), slow_s=0.5))
    done = run.done()
    diff = weights_diff(run.ckpt, ref.ckpt) if newest_step(run.ckpt) == steps else None
    joiner = run.joiner_said()
    waits = [line for line in joiner if "admits this worker at its next snapshot" in line]
    estimate = re.search(r"in about ([0-9.]+) s", waits[0]) if waits else None
    waited = run.admitted_at - run.hello_at if run.hello_at and run.admitted_at else None
    joined = [r["step"] for r in run.records() if r["event"] == "worker_joined"]
    facts = {"raised": run.raised, "done_record": done is not None, "joiner_connect_timeout_s": connect_timeout,
             "joiner_said": waits[0][:200] if waits else None, "wait_lines": len(waits),
             "estimate_s": float(estimate.group(1)) if estimate else None, "hello_to_admission_s": waited,
             "joined_at_step": joined, "plan_workers": run.plan_workers, "joiner_exit_code": run.joiner.returncode,
             "max_weight_diff_vs_local": diff}
    held = (run.raised is None and done is not None and len(waits) == 1 and facts["estimate_s"] is not None
            and facts["estimate_s"] > connect_timeout and waited is not None and waited > connect_timeout
            and joined == [every] and "late" in run.plan_workers and run.joiner.returncode == 0
            and diff is not None and diff < 1e-4)
    return row("a joiner with a 1 s --connect-timeout and a snapshot seconds away",
               f"in-process engine (2 workers, `--snapshot-every {every}`), steps 1 to {every} made 0.5 s longer: "
               "`hetconv-worker --connect-timeout 1` says HELLO during step 2", facts, held,
               "it hears WAIT with the seconds until the snapshot (over its --connect-timeout), says so once, waits "
               "that long, joins at the snapshot; the run ends with the uninterrupted --local run's weights "
               "(within 1e-4)")


# ---- SIGTERM, resume and retention: the command line ---------------------------------------------

def sigterm_coordinator(workdir):
    long_run = ["--epochs", 100, "--steps", 3000]
    run = Run(workdir, "sigterm", ["--spawn", "cpu:1,cpu:1", *NET, *long_run, "--checkpoint-dir", "ckpt"])
    run.wait_for_step(3)
    run.proc.send_signal(signal.SIGTERM)                # the coordinator alone: its workers serve the last step
    signalled = time.monotonic()
    code = run.finish(60)
    stop_s = time.monotonic() - signalled
    reached = run.steps_done()
    last = (run.records() or [{}])[-1]
    saved = newest_step(run.ckpt)
    again = Run(workdir, "sigterm-resume", ["--spawn", "cpu:1,cpu:1", *NET, "--epochs", 100, "--steps", reached + 2,
                                            "--resume", run.ckpt])
    code2 = again.finish()
    resumed = next((r for r in again.records() if r["event"] == "resume"), {})
    said = [line for line in again.output().splitlines() if "where the run resumed from" in line]
    final = newest_step(run.ckpt)
    ref = reference(workdir, reached + 2, epochs=100)
    diff = weights_diff(run.ckpt, ref.ckpt) if final == reached + 2 else None
    facts = {"exit_code": code, "seconds_to_exit": stop_s, "last_record": last.get("event"), "step_reached": reached,
             "checkpoint_step": saved, "resume_exit_code": code2, "resumed_step": resumed.get("step"),
             "resume_said": said[0].replace(run.dir + os.sep, "")[:160] if said else None,
             "final_checkpoint_step": final,
             "max_weight_diff_vs_local": diff}
    held = (code == 143 and last.get("event") == "interrupted" and last.get("step") == reached and saved == reached
            and code2 == 0 and resumed.get("step") == reached and bool(said) and diff is not None and diff < 1e-4)
    return row("SIGTERM to the coordinator mid-run, then `--resume DIR` with no --checkpoint-dir",
               "`--spawn cpu:1,cpu:1 --checkpoint-dir ckpt`; SIGTERM the coordinator's pid after step 3; then "
               "`--resume ckpt --steps REACHED+2`", facts, held,
               "the step finishes, a checkpoint of the step reached is written, exit 143; the resumed run writes "
               "into DIR and ends within 1e-4 of an uninterrupted --local run of as many steps")


def sigterm_while_worker_hangs(workdir):
    grace = 2.0
    run = Run(workdir, "sigterm-hung", ["--spawn", "cpu:1,cpu:1", *NET, "--epochs", 100, "--steps", 3000,
                                        "--snapshot-every", 2, "--worker-timeout", 120, "--stop-grace", grace,
                                        "--checkpoint-dir", "ckpt"])
    run.wait_for_step(3)
    victim = sorted(run.worker_pids().values())[0]
    os.kill(victim, signal.SIGSTOP)
    try:
        time.sleep(0.5)                                 # the step now waits on the stopped worker
        run.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        code = run.finish(60)
        stop_s = time.monotonic() - signalled
    finally:
        if alive(victim):
            os.kill(victim, signal.SIGCONT)
    said = [line for line in run.output().splitlines() if "did not complete within --stop-grace" in line]
    snapshots = [r["step"] for r in run.records() if r["event"] == "snapshot"]
    saved = newest_step(run.ckpt)
    facts = {"exit_code": code, "stop_grace_s": grace, "seconds_to_exit": stop_s,
             "said": said[0][:200] if said else None,
             "newest_snapshot_step": max(snapshots, default=None), "checkpoint_step": saved,
             "hung_process_ended": not alive(victim)}
    held = (code == 143 and bool(said) and snapshots and saved == max(snapshots) and stop_s < grace + 10
            and facts["hung_process_ended"])
    return row("SIGTERM to the coordinator while a worker hangs (SIGSTOP)",
               f"`--spawn cpu:1,cpu:1 --snapshot-every 2 --worker-timeout 120 --stop-grace {grace:g}`; SIGSTOP a "
               "worker after step 3, SIGTERM the coordinator 0.5 s later", facts, held,
               "after --stop-grace the last in-memory snapshot is saved as a checkpoint, said in one line, exit 143 "
               "(within --stop-grace + 10 s: a bound on a hang)")


def resume_earlier_checkpoint(workdir):
    spawn = ["--spawn", "cpu:1,cpu:1", *NET]
    first = Run(workdir, "timeline", [*spawn, "--steps", 12, "--checkpoint-every", 4, "--checkpoint-dir", "ckpt"])
    code1 = first.finish()
    files1 = checkpoint_files(first.ckpt)
    earlier = os.path.join(first.ckpt, "ckpt-step0000004.npz")
    second = Run(workdir, "timeline-from-4", [*spawn, "--steps", 10, "--checkpoint-every", 2, "--checkpoint-dir",
                                              first.ckpt, "--resume", earlier])
    code2 = second.finish()
    files2 = checkpoint_files(first.ckpt)
    third = Run(workdir, "timeline-resume-dir", [*spawn, "--steps", 12, "--resume", first.ckpt])
    code3 = third.finish()
    resumed = next((r for r in third.records() if r["event"] == "resume"), {})
    ref = reference(workdir, 12)
    final = newest_step(first.ckpt)
    diff = weights_diff(first.ckpt, ref.ckpt) if final == 12 else None
    facts = {"exit_codes": [code1, code2, code3], "first_run_kept": files1, "kept_after_resuming_step_4": files2,
             "resume_dir_took_step": resumed.get("step"), "final_checkpoint_step": final,
             "max_weight_diff_vs_local": diff}
    held = (code1 == code2 == code3 == 0 and files2 == [f"ckpt-step{s:07d}.npz" for s in (6, 8, 10)]
            and resumed.get("step") == 10 and diff is not None and diff < 1e-4)
    return row("resume from an earlier checkpoint into the same directory",
               "run to 12 (`--checkpoint-every 4`: 4, 8, 12 kept); `--resume ckpt/ckpt-step0000004.npz "
               "--checkpoint-dir ckpt --checkpoint-every 2 --steps 10`; then `--resume ckpt --steps 12`",
               facts, held,
               "the resumed run's checkpoints (6, 8, 10) are the 3 kept, not the abandoned 12; `--resume DIR` "
               "continues from its 10 and ends within 1e-4 of an uninterrupted --local run")


# ---- the worker's own end: SIGTERM and a coordinator that stops reading ---------------------------

def hetconv_files(folder):
    return sorted(n for n in os.listdir(folder) if n.startswith("hetconv-"))


def external_worker(folder, address, name, *flags):
    """A hetconv-worker of its own session, its stderr and ipc files (TMPDIR) in `folder`."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "stderr.txt"), "w") as err:
        return subprocess.Popen(worker("--device", "cpu", "--connect", address, "--threads", 1, "--name", name, *flags),
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
                                env={**os.environ, "TMPDIR": folder})


def last_line(folder):
    with open(os.path.join(folder, "stderr.txt")) as f:
        lines = f.read().strip().splitlines()
    return lines[-1][:200] if lines else None


def sigterm_worker(workdir):
    # Short: float rounding (another plan sums in another order) can flip a max-pool or ReLU tie
    # after a few hundred steps, and the runs part by far more than 1e-4 without any fault.
    steps, epochs = 60, 2
    ref = reference(workdir, steps, epochs)
    address = f"tcp://127.0.0.1:{free_port()}"
    run = Run(workdir, "worker-sigterm", ["--workers", 2, "--bind", address, *NET, "--epochs", epochs, "--steps", steps,
                                          "--snapshot-every", 3, "--checkpoint-dir", "ckpt"])
    folders = [os.path.join(run.dir, f"ext{i}") for i in range(2)]
    workers = [external_worker(folder, address, f"ext{i}") for i, folder in enumerate(folders)]
    try:
        run.wait_for_step(3)
        before = hetconv_files(folders[1])
        workers[1].send_signal(signal.SIGTERM)
        worker_code = workers[1].wait(timeout=60)
        after = hetconv_files(folders[1])
        code = run.finish()
    finally:
        for w in workers:
            end(w)
    diff = weights_diff(run.ckpt, ref.ckpt) if code == 0 and newest_step(run.ckpt) == steps else None
    lost = [r for r in run.records() if r["event"] == "worker_lost"]
    facts = {"worker_exit_code": worker_code, "worker_said": last_line(folders[1]), "its_files_before": len(before),
             "its_files_after": after, "exit_code": code, "done_record": run.done() is not None, "lost": run.lost(),
             "lost_at_step": lost[0]["step"] if lost else None, "reason": lost[0]["reason"][:160] if lost else None,
             "max_weight_diff_vs_local": diff, "loss_max_rel_diff": _rel(run.losses(), ref.losses()),
             "first_step_off_by_1e-4": _first_off(run.losses(), ref.losses())}
    held = (worker_code == 143 and before and after == [] and code == 0 and facts["done_record"]
            and facts["lost"] == ["ext1"] and diff is not None and diff < 1e-4)
    return row("SIGTERM to one of two external workers mid-run",
               "`--workers 2`; SIGTERM ext1 after step 3; its TMPDIR listed before and after", facts, held,
               "the worker exits 143 through its clean-up, leaving no hetconv-*.ipc file; the run recovers and ends "
               "within 1e-4 of the uninterrupted --local run")


def coordinator_stops_reading(workdir):
    idle = 3.0
    address = f"tcp://127.0.0.1:{free_port()}"
    run = Run(workdir, "coordinator-stopped", ["--workers", 1, "--bind", address, *NET, "--epochs", 100,
                                               "--steps", 3000])
    folder = os.path.join(run.dir, "ext0")
    proc = external_worker(folder, address, "ext0", "--idle-timeout", idle)
    try:
        run.wait_for_step(3)
        os.kill(run.proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            worker_code = proc.wait(timeout=idle + 30)
        except subprocess.TimeoutExpired:
            worker_code = None
        exit_s = time.monotonic() - stopped if worker_code is not None else None
    finally:
        end(proc)
        end(run.proc)                                   # SIGKILL ends a stopped process too
    facts = {"worker_exit_code": worker_code, "idle_timeout_s": idle, "seconds_after_stop": exit_s,
             "worker_said": last_line(folder), "its_files_left": hetconv_files(folder)}
    held = worker_code == 2 and exit_s is not None and exit_s < idle + 2.0 and facts["its_files_left"] == []
    return row("the coordinator stops (SIGSTOP) under a running external worker",
               f"`--workers 1`; the worker has `--idle-timeout {idle:g}`; SIGSTOP the coordinator after step 3",
               facts, held, "the worker exits (code 2, one line) within --idle-timeout (+2 s for its poll and a "
                            "step in flight), leaving no hetconv-*.ipc file")


def _rel(a, b):
    if not a or len(a) != len(b):
        return None
    return float(max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)))


def _first_off(a, b, rel=1e-4):
    """The first step (1-based) whose loss differs from the reference's by more than `rel`, or None."""
    return next((i + 1 for i, (x, y) in enumerate(zip(a, b)) if abs(x - y) > rel * max(abs(y), 1e-12)), None)


def row(fault, how, facts, held, promise):
    return {"fault": fault, "how": how, "facts": facts, "held": bool(held), "promise": promise}


SCENARIOS = [("kill-worker", kill_worker), ("hang-worker", hang_worker), ("kill-external", kill_external),
             ("below-min-workers", below_min_workers), ("damaged-checkpoint", damaged_checkpoint),
             ("kill-coordinator", kill_coordinator_while_saving), ("garbage-frames", garbage_frames),
             ("foreign-keys", foreign_keys), ("lost-in-evaluation", lost_in_evaluation),
             ("lost-in-checkpoint-gather", lost_in_checkpoint_gather), ("lost-in-rebalance", lost_in_rebalance),
             ("lost-while-joiner-calibrates", lost_while_joiner_calibrates),
             ("joiner-small-frame-limit", joiner_with_small_frame_limit), ("joiner-told-to-wait", joiner_told_to_wait),
             ("sigterm-coordinator", sigterm_coordinator), ("sigterm-while-worker-hangs", sigterm_while_worker_hangs),
             ("resume-earlier-checkpoint", resume_earlier_checkpoint), ("sigterm-worker", sigterm_worker),
             ("coordinator-stops-reading", coordinator_stops_reading)]


def markdown(doc):
    header = [line.replace("; foreign load below is per row.", " (a loaded machine: the faults, not the "
                                                                   "timings, are the point).")
              for line in _common.run_header(doc)]
    lines = ["# Reliability: faults injected and what happened", ""] + header
    lines += ["Each row is a real run on loopback (the tiny network of `bench/faults.py`), the fault injected as "
              "written, and the facts measured in that run. A row whose `how` says \"in-process engine\" ran the "
              "coordinator's engine and training loop inside the script, one engine method wrapped to inject the "
              "fault at an exact moment; its workers are real processes, and it reports whether train() raised "
              "instead of an exit code. `held` is decided from the facts by the rule in "
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
                  "`tests/test_ray_launcher.py` (a killed Ray actor is a lost worker), "
                  "`tests/test_no_lost_work.py` (workers lost outside a step, SIGTERM and --stop-grace, joiners, "
                  "retention by timeline), `tests/test_worker_transport.py` (a worker's SIGTERM clean-up, send "
                  "deadline and WAIT against a fake coordinator)."]
    return "\n".join(lines) + "\n" + _hostile_files_section()


HOSTILE_FILES = "## Hostile files"


def _hostile_files_section():
    """docs/reliability.md's hostile-files part, from its heading to the end, as it stands: other
    generators write it (tests/_hostile_checkpoints.py, bench/hostile_data.py), so a render of the
    faults keeps it."""
    path = os.path.join(REPO, "docs", "reliability.md")
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return ""
    at = text.find("\n" + HOSTILE_FILES)
    return "" if at < 0 else text[at:]


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
