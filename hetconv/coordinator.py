"""`hetconv-coordinator`: data, FC layers, loss, planner, checkpoints; conv kernels on workers.

    hetconv-coordinator --spawn cpu,cpu            # start two local CPU workers and train
    hetconv-coordinator --bind tcp://0.0.0.0:5555 --workers 3   # wait for three external workers
    hetconv-coordinator --local                    # the single-device baseline, in one process

The RemoteEngine below is the distributed counterpart of shard.LocalEngine: the same forward /
backward / gather interface, over a ZeroMQ ROUTER socket. Every wait has a deadline; workers send
heartbeats, so a dead or stuck worker is named within `--worker-timeout` seconds.
"""
import argparse
import atexit
import os
import signal
import subprocess
import sys
import time

import numpy as np

from hetconv import protocol as P
from hetconv.config import (HelpFormatter, add_config_flags, check_endpoint, check_output_dir, check_output_file,
                            check_range, config_from_args, threads_note, usable_cores)
from hetconv.planner import PlanError, make_plan
from hetconv.shard import concat_channels, concat_shards


class WorkerError(RuntimeError):
    """A worker raised while serving a request; its message names the worker and what it was doing,
    and it carries the worker's traceback."""

    def __init__(self, worker, doing, name, message, remote_traceback=""):
        super().__init__(f"worker {worker} failed during {doing}: {name}: {message}")
        self.worker, self.remote_traceback = worker, remote_traceback


class WorkerLost(RuntimeError):
    """A worker stopped answering (died, hung, or its process exited)."""


class _Peer:
    def __init__(self, identity, hello, process=None):
        self.identity = identity                   # bytes: the ROUTER routing id
        self.name = hello.get("name", identity.decode(errors="replace"))
        self.device = hello.get("device", "?")
        self.host = hello.get("host", "?")
        self.pid = hello.get("pid", 0)
        self.description = hello.get("description", self.device)
        self.process = process
        self.last_seen = time.monotonic()
        self.layer_compute = {}                    # layer -> compute seconds since the last reset
        self.layer_calls = {}                      # layer -> forward requests since the last reset
        self.reset_stats()

    def reset_stats(self):
        self.stats = {"compute_s": 0.0, "roundtrip_s": 0.0, "bytes_sent": 0, "bytes_recv": 0}

    def label(self):
        return f"{self.name} ({self.device} on {self.host}, pid {self.pid})"


class RemoteEngine:
    def __init__(self, bind, expected_workers, spawn=(), threads=0, worker_timeout=10.0,
                 connect_timeout=60.0, op_timeout=600.0, pin=True, log=print):
        import zmq
        self.zmq = zmq
        self.log = log
        self.worker_timeout, self.connect_timeout, self.op_timeout = worker_timeout, connect_timeout, op_timeout
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)      # an unknown peer is an error, not a silent drop
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
        self.processes = []
        self.peers = {}                                     # name -> _Peer, in plan order
        self.by_identity = {}
        self.seq = 0
        self.plan = None
        self.fixed_plan = None          # set by hand (tests, experiments) to skip calibration
        self.calibration = {}
        self.calibration_s = 0.0
        self.batch = 0
        try:
            if bind.endswith(":0") or bind.endswith(":*"):
                port = self.sock.bind_to_random_port(bind.rsplit(":", 1)[0])
                self.address = f"{bind.rsplit(':', 1)[0]}:{port}"
            else:
                self.sock.bind(bind)
                self.address = bind
        except zmq.ZMQError as e:
            self.close()
            raise SystemExit(f"hetconv-coordinator: cannot bind {bind}: {e.strerror} "
                             f"(is another coordinator running there? choose another --bind port)") from None
        atexit.register(self.close)
        try:
            self._spawn(spawn, threads, pin)
            self._await_workers(expected_workers + len(spawn))
        except BaseException:
            self.close()
            raise

    # ---- processes ---------------------------------------------------------------------------
    def _spawn(self, devices, threads, pin):
        if not devices:
            return
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count()))
        cpu_workers = [i for i, d in enumerate(devices) if d == "cpu"]
        per_worker = threads or max(1, len(cores) // max(1, len(cpu_workers)))
        for i, device in enumerate(devices):
            cmd = [sys.executable, "-m", "hetconv.worker", "--device", device, "--connect", self.address,
                   "--name", f"w{i}-{device}", "--parent-pid", str(os.getpid()),
                   "--connect-timeout", str(self.connect_timeout)]
            if device == "cpu":
                cmd += ["--threads", str(per_worker)]
                slot = cpu_workers.index(i)
                if pin and len(cores) >= per_worker * len(cpu_workers):
                    mine = cores[slot * per_worker:(slot + 1) * per_worker]
                    cmd += ["--cores", ",".join(map(str, mine))]
            # A session of its own: Ctrl-C reaches only the coordinator, which finishes the step,
            # checkpoints and then ends its workers itself.
            self.processes.append((f"w{i}-{device}", subprocess.Popen(cmd, start_new_session=True)))

    def _await_workers(self, n):
        deadline = time.monotonic() + self.connect_timeout
        self.log(f"waiting for {n} worker(s) on {self.address} ...")
        while len(self.peers) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerLost(f"only {len(self.peers)} of {n} workers connected to {self.address} within "
                                 f"{self.connect_timeout:.0f}s: start more with `hetconv-worker --device cpu --connect {self.address}`")
            self._check_processes("starting")
            if not self.sock.poll(int(min(left, 0.5) * 1000)):
                continue
            frames = self.sock.recv_multipart(copy=False)
            identity = frames[0].bytes
            try:
                msg = P.unpack(frames[1:])
            except P.ProtocolVersionError as e:
                self._send_raw(identity, P.pack("ERROR", 0, name="ProtocolVersionError", message=str(e),
                                                worker=identity.decode(errors="replace"), doing="HELLO", traceback=""))
                self.log(f"refused worker {identity.decode(errors='replace')}: {e}")
                continue
            except P.ProtocolError as e:
                self.log(f"ignored a malformed message from {identity!r:.80}: {e}")
                continue
            if msg.op == "ERROR":
                raise WorkerError(msg.fields.get("worker"), msg.fields.get("doing"), msg.fields.get("name"),
                                  msg.fields.get("message"), msg.fields.get("traceback", ""))
            if msg.op != "HELLO":
                continue
            name = str(msg.fields.get("name", "worker"))
            base, k = name, 2
            while name in self.peers:                        # labels need not be unique; names in plans must
                name, k = f"{base}#{k}", k + 1
            process = next((p for label, p in self.processes if label == base and p.pid == msg.fields.get("pid")), None)
            peer = _Peer(identity, {**msg.fields, "name": name}, process)
            self.peers[name] = peer
            self._send(peer, "WELCOME")
            self.log(f"worker {peer.label()}: {peer.description}")
        # Spawned workers first, in the order asked, then external ones by arrival.
        order = [n for label, _ in self.processes for n, p in self.peers.items() if p.name == label]
        order += [n for n in self.peers if n not in order]
        self.peers = {n: self.peers[n] for n in order}
        self.by_identity = {p.identity: p for p in self.peers.values()}   # routing id -> peer

    def _check_processes(self, doing):
        for label, proc in self.processes:
            code = proc.poll()
            if code is not None:
                raise WorkerLost(f"worker {label} (pid {proc.pid}) exited with code {code} while {doing}")

    # ---- messaging ---------------------------------------------------------------------------
    def _send_raw(self, identity, frames):
        try:
            self.sock.send_multipart([identity] + frames, copy=False)
        except self.zmq.ZMQError as e:
            raise WorkerLost(f"cannot send to {identity.decode(errors='replace')}: {e.strerror}") from None

    def _send(self, peer, op, arrays=(), doing="", **fields):
        self.seq += 1
        frames = P.pack(op, self.seq, arrays, **fields)
        peer.stats["bytes_sent"] += sum(len(f) for f in frames)
        try:
            self._send_raw(peer.identity, frames)
        except WorkerLost as e:
            if peer.process is not None and peer.process.poll() is not None:
                raise WorkerLost(f"worker {peer.label()} exited with code {peer.process.returncode} during {doing or op}") from None
            raise WorkerLost(f"worker {peer.label()} is unreachable ({e}) during {doing or op}: "
                             f"it disconnected or died") from None
        return self.seq

    def _request_all(self, requests, doing, layer=None):
        """requests: {peer name: (op, arrays, fields)}; sends all, then waits for every reply.
        Returns {peer name: Message}. Raises WorkerError / WorkerLost naming the worker."""
        pending, sent_at = {}, {}
        for name, (op, arrays, fields) in requests.items():
            peer = self.peers[name]
            pending[self._send(peer, op, arrays, doing=doing, **fields)] = name
            sent_at[name] = time.perf_counter()
        replies = {}
        deadline = time.monotonic() + self.op_timeout
        while pending:
            now = time.monotonic()
            if now > deadline:
                late = ", ".join(self.peers[n].label() for n in pending.values())
                raise WorkerLost(f"no reply within {self.op_timeout:.0f}s from {late} during {doing}")
            for name in pending.values():
                peer = self.peers[name]
                if now - peer.last_seen > self.worker_timeout:
                    raise WorkerLost(f"worker {peer.label()} stopped answering (no heartbeat for "
                                     f"{now - peer.last_seen:.1f}s) during {doing}")
                if peer.process is not None and peer.process.poll() is not None:
                    raise WorkerLost(f"worker {peer.label()} exited with code {peer.process.returncode} during {doing}")
            if not self.sock.poll(200):
                continue
            frames = self.sock.recv_multipart(copy=False)
            peer = self.by_identity.get(frames[0].bytes)
            if peer is None:
                continue                                   # a stranger (late or stale worker): ignore
            peer.last_seen = time.monotonic()
            try:
                msg = P.unpack(frames[1:])
            except P.ProtocolError as e:
                self.log(f"ignored a malformed message from {peer.label()}: {e}")
                continue
            if msg.op == "HEARTBEAT":
                continue
            if msg.op == "ERROR" and (msg.seq in pending or msg.seq == -1):
                raise WorkerError(peer.label(), msg.fields.get("doing", doing), msg.fields.get("name", "Error"),
                                  msg.fields.get("message", ""), msg.fields.get("traceback", ""))
            if msg.seq not in pending or pending[msg.seq] != peer.name:
                continue                                   # stale reply to an abandoned request
            del pending[msg.seq]
            replies[peer.name] = msg
            peer.stats["bytes_recv"] += sum(len(f) for f in frames[1:])
            peer.stats["compute_s"] += float(msg.fields.get("compute_s", 0.0))
            if layer is not None:
                peer.layer_compute[layer] = peer.layer_compute.get(layer, 0.0) + float(msg.fields.get("compute_s", 0.0))
                if msg.op == "FORWARD_DONE":
                    peer.layer_calls[layer] = peer.layer_calls.get(layer, 0) + 1
            peer.stats["roundtrip_s"] += time.perf_counter() - sent_at[peer.name]
        return replies

    # ---- the engine interface ------------------------------------------------------------------
    @property
    def workers(self):
        return list(self.peers)

    def calibrate(self, specs, input_shapes, cfg):
        """Each worker times its fused kernels on the real layer shapes, its equal share of kernels,
        after a JIT warm-up. Returns {worker: [kernels/s per layer]} and the raw replies."""
        batch = min(cfg.calibration_batch, cfg.batch_size)
        n = len(self.peers)
        layers = [{"spec": s.to_json(), "input_shape": [batch] + list(shape[1:]), "kernels": -(-s.kernels // n)}
                  for s, shape in zip(specs, input_shapes)]
        t0 = time.perf_counter()
        replies = self._request_all({name: ("CALIBRATE", [], {"layers": layers}) for name in self.peers}, "calibration")
        self.calibration_s = time.perf_counter() - t0
        self.calibration = {name: {"device": self.peers[name].device, "description": self.peers[name].description,
                                   "speeds": list(m.fields["speeds"]), "layers": list(m.fields["timings"])}
                            for name, m in replies.items()}
        return {name: list(replies[name].fields["speeds"]) for name in self.peers}

    def plan_for(self, specs, input_shapes, cfg):
        kernels = [s.kernels for s in specs]
        too_few = [k for k in kernels if k < len(self.peers)]
        if too_few:
            raise PlanError(f"{len(self.peers)} workers but a conv layer has only {min(too_few)} kernels: "
                            f"every worker needs at least one kernel of every layer (use fewer workers or wider --conv)")
        if self.fixed_plan is not None:
            return self.fixed_plan
        speeds = self.calibrate(specs, input_shapes, cfg)
        self.log(f"calibrated {len(self.peers)} worker(s) in {self.calibration_s:.1f}s")
        return make_plan(kernels, speeds, cfg.split)

    def load(self, plan, specs, params):
        self.plan = plan
        for lp, spec, (w, b, vw, vb) in zip(plan.layers, specs, params):
            requests = {}
            for name, (s, e) in lp.ranges.items():
                arrays = [w[s:e], b[s:e]] + ([] if vw is None else [vw[s:e], vb[s:e]])
                requests[name] = ("LOAD", arrays, {"layer": lp.layer, "spec": spec.to_json(), "start": s, "stop": e})
            self._request_all(requests, f"loading conv{lp.layer + 1}")
        for peer in self.peers.values():
            peer.reset_stats()

    def forward(self, layer, x):
        x = np.ascontiguousarray(x)
        self.batch = x.shape[0]     # one buffer, sent to every worker, never written while in flight
        replies = self._request_all({name: ("FORWARD", [x], {"layer": layer}) for name in self.plan.workers},
                                    f"forward conv{layer + 1}", layer)
        return concat_channels([replies[name].arrays[0] for name in self.plan.workers])

    def backward(self, layer, dpooled, lr, momentum, weight_decay, need_dx):
        lp = self.plan.layers[layer]
        fields = {"layer": layer, "lr": lr, "momentum": momentum, "weight_decay": weight_decay, "need_dx": need_dx}
        requests = {name: ("BACKWARD", [np.ascontiguousarray(dpooled[:, s:e])], fields)
                    for name, (s, e) in lp.ranges.items()}
        replies = self._request_all(requests, f"backward conv{layer + 1}", layer)
        if not need_dx:
            return None
        dx = None
        for name in self.plan.workers:                    # the one reduction: dX = sum of partial dX
            part = replies[name].arrays[0]
            dx = part.copy() if dx is None else np.add(dx, part, out=dx)
        return dx

    def gather(self):
        out = []
        for lp in self.plan.layers:
            replies = self._request_all({name: ("FETCH", [], {"layer": lp.layer}) for name in self.plan.workers},
                                        f"fetching conv{lp.layer + 1} for a checkpoint")
            out.append(concat_shards([replies[name].arrays for name in self.plan.workers]))
        return out

    def step_stats(self):
        """Per worker, since the last call: compute seconds, round-trip seconds, bytes each way."""
        stats = {name: dict(peer.stats) for name, peer in self.peers.items()}
        for peer in self.peers.values():
            peer.reset_stats()
        return stats

    def reset_layer_timings(self):
        for peer in self.peers.values():
            peer.layer_compute, peer.layer_calls = {}, {}

    def rebalance(self, specs, min_gain=0.05):
        """Re-split the kernels from what training measured: each worker's compute seconds per
        layer since reset_layer_timings(), under the current plan. Calibration can be fooled (a
        burst of outside load, a cache that behaves differently at the calibration batch); real
        steps cannot. Each worker's calibrated line (fixed + per-kernel cost) is scaled by how far
        the real steps were from it, so a worker holding few kernels, whose time is mostly the
        fixed im2col pass, is not mistaken for a slow one. Moves kernels (gather, then load) only
        if the slowest worker's predicted compute drops by more than `min_gain`. Returns the new
        plan or None."""
        if self.plan is None or len(self.plan.workers) < 2:
            return None
        from hetconv.costmodel import profiles_from_calibration
        profiles = profiles_from_calibration(self.calibration) if self.calibration else {}
        fixed, per_kernel, now = {}, {}, {}
        for name in self.plan.workers:
            peer = self.peers[name]
            steps = peer.layer_calls.get(0, 0)
            if steps == 0 or any(peer.layer_compute.get(lp.layer, 0.0) <= 0 for lp in self.plan.layers):
                return None
            fixed[name], per_kernel[name] = [], []
            for lp in self.plan.layers:
                measured = peer.layer_compute[lp.layer] / steps            # seconds per step
                k = lp.count(name)
                cost = profiles[name].layers[lp.layer] if name in profiles else None
                if cost is not None:
                    f = self.batch * (cost.forward_fixed_s + cost.backward_fixed_s)
                    p = self.batch * (cost.forward_per_kernel_s + cost.backward_per_kernel_s)
                    scale = measured / (f + p * k)      # how far real steps are from calibration
                    f, p = f * scale, p * scale
                else:                                   # no calibration: all of it per kernel
                    f, p = 0.0, measured / k
                fixed[name].append(f)
                per_kernel[name].append(p)
            now[name] = sum(peer.layer_compute[lp.layer] for lp in self.plan.layers) / steps
        speeds = {name: [1.0 / p for p in per_kernel[name]] for name in self.plan.workers}
        proposal = make_plan([lp.kernels for lp in self.plan.layers], speeds, "proportional")
        then = {name: sum(fixed[name][lp.layer] + lp.count(name) * per_kernel[name][lp.layer]
                          for lp in proposal.layers) for name in proposal.workers}
        if max(then.values()) > (1 - min_gain) * max(now.values()):
            return None
        self.load(proposal, specs, self.gather())
        return proposal

    def close(self):
        """Shut every worker down; on every exit path, spawned processes end."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        for peer in list(self.peers.values()):
            try:
                self.sock.send_multipart([peer.identity] + P.pack("SHUTDOWN", 0), flags=self.zmq.NOBLOCK)
            except Exception:
                pass
        deadline = time.monotonic() + 3.0
        for label, proc in self.processes:
            try:
                proc.wait(timeout=max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.terminate()
        for label, proc in self.processes:
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.sock.close(linger=0)
        self.ctx.term()


# ---- command line --------------------------------------------------------------------------------

EXAMPLES = """examples:
  hetconv-coordinator --spawn cpu,cpu                       two local CPU workers (the default)
  hetconv-coordinator --spawn cpu:1,cpu:1,cuda:0            two 1-thread CPU workers and GPU 0
  hetconv-coordinator --local --conv 4,8 --fc 8 --steps 2   a tiny single-device run
  hetconv-coordinator --bind tcp://0.0.0.0:5555 --workers 3 wait for three hetconv-worker processes
  hetconv-coordinator --spawn cpu,cpu --checkpoint-dir ckpt --metrics run.jsonl
  hetconv-coordinator --spawn cpu,cpu --resume ckpt --checkpoint-dir ckpt --metrics run.jsonl"""


def build_parser():
    p = argparse.ArgumentParser(
        prog="hetconv-coordinator",
        description="Train a CNN with each conv layer's kernels split across CPU/GPU workers in proportion to "
                    "their measured speed; FC layers, loss and checkpoints stay here. With no mode flag it "
                    "spawns two local CPU workers (--spawn cpu,cpu) and trains the paper network on the "
                    "built-in synthetic data set.",
        epilog=EXAMPLES, formatter_class=HelpFormatter)
    group = p.add_argument_group("where the conv layers run (choose one)")
    mode = group.add_mutually_exclusive_group()
    mode.add_argument("--local", action="store_true", help="in this process on one CPU device: the single-device baseline")
    mode.add_argument("--spawn", default=None,
                      help="start these workers on this host: a comma list of cpu, cpu:THREADS, cuda:N, each "
                           "optionally xCOUNT, e.g. cpu,cpu or cpu:1x2,cuda:0 (default: cpu,cpu)")
    mode.add_argument("--workers", type=int, default=None, help="wait for this many external hetconv-worker processes")
    net = p.add_argument_group("network")
    net.add_argument("--bind", default="", help="address to listen on (default: tcp://127.0.0.1:5555 with --workers, "
                                                "a free loopback port with --spawn)")
    net.add_argument("--worker-timeout", type=float, default=10.0, help="seconds without a heartbeat before a worker counts as lost")
    net.add_argument("--connect-timeout", type=float, default=60.0, help="seconds to wait for workers to connect")
    net.add_argument("--op-timeout", type=float, default=600.0, help="seconds any one request may take")
    net.add_argument("--no-pin", action="store_true", help="do not pin spawned CPU workers to disjoint cores")
    p.add_argument("--resume", default="", help="a checkpoint file, or a directory (its newest checkpoint)")
    p.add_argument("--verbose", action="store_true", help="print a failing worker's own traceback too")
    add_config_flags(p)
    return p


def _spawn_list(args):
    """--spawn's devices, one string per worker: 'cpu', 'cpu:THREADS' or 'cuda:N'."""
    from hetconv.devices import parse_device_list
    entries = parse_device_list("--spawn", "cpu,cpu" if args.spawn is None else args.spawn)
    return [e.label for e in entries for _ in range(e.count)]


def _check_args(args, cfg):
    """Every value that can be checked before any work starts (workers, calibration, training)."""
    for flag, value in (("--worker-timeout", args.worker_timeout), ("--connect-timeout", args.connect_timeout),
                        ("--op-timeout", args.op_timeout)):
        check_range(flag, value, 0, inclusive=False)
    if args.workers is not None:
        check_range("--workers", args.workers, 1)
    if args.bind:
        check_endpoint("--bind", args.bind, bind=True)
    check_output_dir("--checkpoint-dir", cfg.checkpoint_dir)
    check_output_file("--metrics", cfg.metrics)
    if args.resume and not os.path.exists(args.resume):
        raise ValueError(f"--resume {args.resume!r}: no such checkpoint file or directory")


def _pinning_note(spawn, threads, pin):
    """A line when spawned CPU workers cannot each have their own cores (so they are not pinned)."""
    cores = usable_cores()
    cpu_workers = spawn.count("cpu")
    if pin and threads and cpu_workers and threads * cpu_workers > cores:
        return (f"note: {cpu_workers} CPU worker(s) x --threads {threads} is more than the {cores} core(s) "
                f"this process may use: the workers are not pinned to cores and will share them")
    return ""


def _on_sigterm(signum, frame):
    # SIGTERM ends the run like an exception, so the finally in main still ends every worker.
    print("hetconv-coordinator: terminated (SIGTERM): stopping the workers, no checkpoint is written",
          file=sys.stderr, flush=True)
    raise SystemExit(143)


def main(argv=None):
    args = build_parser().parse_args(argv)
    from hetconv.checkpoint import CheckpointError
    from hetconv.data import DataError, load_dataset
    from hetconv.devices import DeviceError
    try:
        cfg = config_from_args(args)
        _check_args(args, cfg)
        spawn = [] if args.local or args.workers else _spawn_list(args)
        # the data set is read before any worker starts: a wrong --data costs nothing
        ds = load_dataset(cfg.data, seed=cfg.seed,
                          n_train=cfg.synthetic_train if cfg.data == "synthetic" else None,
                          n_test=cfg.synthetic_test if cfg.data == "synthetic" else None)
    except (ValueError, DeviceError, DataError) as e:
        print(f"hetconv-coordinator: {e}", file=sys.stderr)
        return 2
    note = threads_note(cfg.threads) if args.local else _pinning_note(spawn, cfg.threads, not args.no_pin)
    if note:
        print(note, file=sys.stderr)
    signal.signal(signal.SIGTERM, _on_sigterm)
    engine = None
    summary = {}
    try:
        if args.local:
            from hetconv.devices import open_device
            from hetconv.shard import ConvShard, LocalEngine
            device = open_device("cpu", threads=cfg.threads or None)
            print(f"local: {device.describe()}")
            engine = LocalEngine({"local": ConvShard(device)})
        else:
            bind = args.bind or ("tcp://127.0.0.1:0" if spawn else "tcp://127.0.0.1:5555")
            engine = RemoteEngine(bind, args.workers or 0, spawn, threads=cfg.threads,
                                  worker_timeout=args.worker_timeout, connect_timeout=args.connect_timeout,
                                  op_timeout=args.op_timeout, pin=not args.no_pin)
        from hetconv.train import train
        summary = train(cfg, engine, resume=args.resume or None, dataset=ds)
    except (WorkerError, WorkerLost, PlanError, DeviceError, DataError, CheckpointError, ValueError, FloatingPointError) as e:
        print(f"hetconv-coordinator: {e}", file=sys.stderr)
        if args.verbose and isinstance(e, WorkerError) and e.remote_traceback:
            print(f"--- worker traceback ---\n{e.remote_traceback}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("hetconv-coordinator: interrupted", file=sys.stderr)
        return 130
    finally:
        if engine is not None:
            engine.close()
    return 0 if not summary.get("interrupted") else 130


if __name__ == "__main__":
    sys.exit(main())
