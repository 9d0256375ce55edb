"""The distributed engine: conv shards in hetconv-worker processes, reached over ZeroMQ.

The coordinator binds a ROUTER; workers connect with DEALERs (so one can join late and a dead one
can be replaced) and send heartbeats, so a dead or stuck worker is named within
`worker_timeout` seconds. Every wait has a deadline.

Two ways through a training step (`exchange`):
- "peer" (default): one STEP per step; the workers pass feature maps and partial dX among
  themselves (hetconv.peers), so this link carries the images once, the last layer's features
  and their gradient, whatever the number of workers; micro-batches overlap wire and compute,
  and the FC work here overlaps the workers' next micro-batch.
- "star": every layer's input goes out from here to every worker and every partial dX comes back
  here, layer by layer (ShardEngine.conv_step): the first design, kept for comparison.
"""
import atexit
import errno
import math
import os
import shutil
import subprocess
import time

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from hetconv import runtimes
from hetconv.devices.cpu_options import CpuOptions
from hetconv.engine.calibrated import CalibratedEngine
from hetconv.engine.contract import WorkerError, WorkerLost  # noqa: F401  (raised here, caught by callers)
from hetconv.engine.graph import norm_states_from
from hetconv.engine.layouts import WHOLE, index_in, pieces, pieces_shape, tensor_layouts
from hetconv.engine.planner import PlanError, layout_rows
from hetconv.engine.policy import head_weights_later
from hetconv.transport import keys
from hetconv.transport import protocol as P
from hetconv.transport.keys import authenticated_key, handshake_refusal, read_key_folder
from hetconv.transport.sockets import host_key
from hetconv.transport.wire import check_wire_dtype, decode, encode
from hetconv.transport.worker_argv import command as worker_command
from hetconv.update import clip_factor

EXCHANGES = ("peer", "star")
DISCONNECT_PROBE_S = 5.0     # how long after a dropped connection the workers are probed
MAX_JOINING = 32             # HELLOs kept from workers waiting to join a run, until its next snapshot


def spawned_worker_names(devices):
    """The names the workers of a --spawn list (`devices`, one string each) run under, in order:
    known before any starts, so a --plan can be checked against them first."""
    return [f"w{i}-{d}" for i, d in enumerate(devices)]


def _placed_features(parts, senders, m, images, shape):
    """Micro-batch m's features, whole: the one sender's, or each sender's rows and channels of
    them placed together."""
    if len(senders) == 1:
        return next(iter(parts.values()))
    h = np.empty((images,) + tuple(shape), np.float32)
    for name in senders:
        held = senders[name][m]
        for i, (r0, r1, c0, c1) in enumerate(held):
            h[r0:r1, c0:c1] = parts[name][index_in(held[i], held, i)]
    return h


class _Peer:
    """A worker as its HELLO describes it; planning reads it as a policy.Place (host_key, device,
    threads, cores, host)."""

    def __init__(self, identity, hello, process=None, public_key=""):
        self.identity = identity                   # bytes: the ROUTER routing id
        self.public_key = public_key               # z85, as ZAP authenticated it ("" without keys)
        self.name = hello.get("name", identity.decode(errors="replace"))
        self.device = hello.get("device", "?")
        self.host = hello.get("host", "?")
        self.pid = hello.get("pid", 0)
        self.description = hello.get("description", self.device)
        self.peer_endpoints = list(hello.get("peer_endpoints", []))
        self.host_key = hello.get("host_key", "")
        threads = hello.get("threads", 0)              # 0: all the cores it may run on
        self.threads = threads if isinstance(threads, int) and not isinstance(threads, bool) and threads > 0 else 0
        cores = hello.get("cores", 0)                  # the cores it may run on (0: not said)
        self.cores = cores if isinstance(cores, int) and not isinstance(cores, bool) and 0 < cores < 1 << 20 else 0
        self.ipc_token = hello.get("ipc_token", "")         # proves its ipc path is readable from a peer's host
        self.process = process
        self.last_seen = time.monotonic()

    def label(self):
        return f"{self.name} ({self.device} on {self.host}, pid {self.pid})"


class RemoteEngine(CalibratedEngine):
    in_process = False          # the shards are in hetconv-worker processes

    def __init__(self, bind, expected_workers, spawn=(), threads=0, worker_timeout=10.0,
                 connect_timeout=60.0, op_timeout=600.0, pin=True, log=print, exchange="peer", wire="float32",
                 curve="", insecure=False, message_limit=0, launcher=None, verbose=False,
                 cpu=CpuOptions(use_wisdom=True), conv_paths=()):
        """`cpu`: the run's CPU device options (devices.cpu_options.CpuOptions, by default the
        workers' own defaults with this machine's wisdom): every spawned worker's flags, and the
        device this process calibrates with its workers' cores together.
        Under its `deterministic`, a spawned `cpu` worker's threads are `threads`, else
        runtimes.DETERMINISTIC_THREADS, never a share of this process's cores (which the host's
        affinity mask decides). `conv_paths`:
        the conv path records of the checkpoint a run resumes from (checkpoint.recorded_conv_paths),
        told every worker in its WELCOME: a device whose machine key is a record's runs its paths."""
        super().__init__(log=log, cpu=cpu)          # self.peers: name -> _Peer, in plan order
        if exchange not in EXCHANGES:
            raise ValueError(f"--exchange must be one of {', '.join(EXCHANGES)}, got {exchange!r}")
        self.exchange, self.wire = exchange, check_wire_dtype(wire)     # auto: decided with each plan
        self.step_id = 0
        self.head_weights_later = False     # load() decides, per plan
        self.zmq = zmq
        self.verbose = verbose                              # spawned workers' own start-up lines too
        self.resume_conv_paths = list(conv_paths)           # what WELCOME tells each worker's device to run
        self.worker_timeout, self.connect_timeout, self.op_timeout = worker_timeout, connect_timeout, op_timeout
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)      # an unknown peer is an error, not a silent drop
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
        # A worker that stops reading (stopped, or its link dead without a close) fills its queue;
        # a send then waits at most one request's deadline and the worker counts as lost.
        self.sock.sndtimeo = int(op_timeout * 1000)
        self.processes = []                                 # (label, Popen or a launcher's look-alike)
        self.spawn_threads = 0                              # threads of a spawned `cpu` worker (0: none spawned)
        self.launcher = launcher                            # None: spawned here; else e.g. launch_ray.RayLauncher
        self.by_identity = {}
        self.seq = 0
        self._sent_bytes, self._recv_bytes = {}, {}
        self.heartbeats = self.ctx.socket(zmq.PULL)
        self.heartbeats.linger = 0
        self.heartbeats.setsockopt(zmq.MAXMSGSIZE, 4096)
        # A frame over the run's largest array is cut off by libzmq, which drops that connection:
        # the worker counts as lost, and nothing of that size is ever allocated here.
        self.message_limit = int(message_limit)
        if self.message_limit:
            keys.set_message_limit(self.sock, self.message_limit)
        self.auth, self._key_tmp, self.worker_keydir = None, None, ""
        try:
            self._start_keys(spawn, curve, insecure)
        except BaseException:
            self.close()
            raise
        self._bind(bind)
        self._listen()
        self.joining = {}                                   # routing id -> HELLO fields, admitted at a snapshot
        self.joiners_refused = 0                            # HELLOs refused since the last admission: joining was full
        self.join_wait_s = 0.0                              # what a joiner is told to wait, beyond its own timeout
        self._probe_until = 0.0                             # probe for vanished workers until then
        atexit.register(self.close)
        try:
            self._spawn(spawn, threads, pin)
            self._await_workers(expected_workers + len(spawn))
        except BaseException:
            self.close()
            raise

    def _start_keys(self, spawn, curve, insecure):
        """Keys: --curve DIR admits the workers whose public keys DIR/authorized holds; --spawn
        without --curve makes a keypair for this run's own workers (removed at close), so no other
        process can join even on loopback; --insecure turns keys off."""
        if spawn and not curve and not insecure:
            self._key_tmp = keys.private_temp_dir()
            curve, self.worker_keydir = keys.ephemeral_keys(self._key_tmp)
        elif spawn and curve:
            self.worker_keydir = keys.first_worker_dir(curve)
        self.curve = curve
        if curve:
            self.auth = keys.serve_curve(self.ctx, self.sock, curve, log=self.log, also=(self.heartbeats,))

    def _bind(self, bind):
        """The ROUTER on --bind (a random port for :0 or :*): SystemExit naming the address and
        the likely cause where it cannot be bound."""
        try:
            if bind.endswith(":0") or bind.endswith(":*"):
                port = self.sock.bind_to_random_port(bind.rsplit(":", 1)[0])
                self.address = f"{bind.rsplit(':', 1)[0]}:{port}"
            else:
                self.sock.bind(bind)
                self.address = bind
        except zmq.ZMQError as e:
            self.close()
            why = ("is another coordinator running there? choose another --bind port" if e.errno == errno.EADDRINUSE
                   else "is that address one of this host's? --bind takes tcp://ADDRESS:PORT of a local interface, "
                        "tcp://0.0.0.0:PORT for all of them, or ipc://PATH")
            raise SystemExit(f"hetconv-coordinator: cannot bind {bind}: {e.strerror} ({why})") from None

    def _listen(self):
        """Bind the heartbeats' socket beside the ROUTER, and poll both and the ROUTER's monitor.

        Heartbeats ride a connection of their own: on a slow link a big reply (a snapshot's
        150 MB of weights takes 12 s at 100 Mbit/s) holds back everything behind it on the
        worker's main connection, and a live worker would look silent. A PULL costs one more
        port and one small message per worker per second.
        A killed worker's TCP connection closes at once: the monitor hears it long before a
        heartbeat is missed, and a probe (ROUTER_MANDATORY) tells which worker it was. With keys,
        a failed handshake is heard there too, with the peer's address."""
        if self.address.startswith("tcp://"):
            self.heartbeat_port = self.heartbeats.bind_to_random_port(self.address.rsplit(":", 1)[0])
            self.heartbeat_endpoint = ""
        else:
            self.heartbeat_port, self.heartbeat_endpoint = 0, self.address + ".heartbeat"
            self.heartbeats.bind(self.heartbeat_endpoint)
        events = zmq.EVENT_DISCONNECTED
        if self.auth is not None:
            events |= (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                       | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        self.monitor = self.sock.get_monitor_socket(events)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.poller.register(self.heartbeats, zmq.POLLIN)

    # ---- processes ---------------------------------------------------------------------------
    def _spawn(self, devices, threads, pin):
        if not devices:
            return
        if self.launcher is not None:                       # placed elsewhere; pinning is the launcher's
            self.processes += self.launcher.start(list(zip(spawned_worker_names(devices), devices)), self.address,
                                                  threads, self.connect_timeout, extra_args=self._limit_args(),
                                                  key_files=read_key_folder(self.worker_keydir) if self.worker_keydir
                                                  else None)
            return
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count()))
        plain = [i for i, d in enumerate(devices) if d == "cpu"]
        per_worker = (runtimes.threads_for(threads, True) if self.cpu.deterministic
                      else threads or max(1, len(cores) // max(1, len(plain))))
        self.spawn_threads = per_worker                     # a plan record keeps it (thread_counts)
        # each CPU worker's threads: `cpu` shares the cores (or --threads), `cpu:N` asked for N;
        # pinned to consecutive cores of their own where they all fit, else left to the scheduler
        cpu_threads = {i: per_worker if d == "cpu" else int(d.split(":", 1)[1])
                       for i, d in enumerate(devices) if d == "cpu" or d.startswith("cpu:")}
        fits = pin and sum(cpu_threads.values()) <= len(cores)
        first = 0
        for i, (name, device) in enumerate(zip(spawned_worker_names(devices), devices)):
            cmd = worker_command(self.address, name, device, self.connect_timeout, os.getpid(),
                                 threads=per_worker if device == "cpu" else 0, curve=self.worker_keydir,
                                 extra=self._limit_args())
            if i in cpu_threads and fits:
                mine = cores[first:first + cpu_threads[i]]
                first += cpu_threads[i]
                cmd += ["--cores", ",".join(map(str, mine))]
            # A session of its own: Ctrl-C reaches only the coordinator, which finishes the step,
            # checkpoints and then ends its workers itself. Its stdout holds only its start-up line,
            # which the coordinator's own line for it repeats; its errors go to stderr, kept.
            self.processes.append((name, subprocess.Popen(
                cmd, start_new_session=True, stdout=None if self.verbose else subprocess.DEVNULL)))

    def _await_workers(self, n):
        deadline = time.monotonic() + self.connect_timeout
        self.log(f"waiting for {n} worker(s) on {self.address} ...")
        while len(self.peers) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                keys = f" --curve {os.path.join(self.curve, 'workers', 'NAME')}" if self.curve and not self._key_tmp else ""
                starting = [f"{label} (pid {proc.pid})" for label, proc in self.processes
                            if label not in self.peers and proc.poll() is None]
                if starting:
                    # a process this coordinator started and that still runs is slow, not missing:
                    # on a host with more runnable threads than cores, Python, Numba and oneDNN
                    # can take minutes to load
                    hint = (f"{', '.join(starting)} started but did not connect yet (a loaded host?): "
                            f"--connect-timeout {max(120, 2 * self.connect_timeout):.0f} waits longer")
                elif self.launcher is not None:
                    hint = "can the Ray nodes reach this address? (choose one with --bind)"
                else:
                    hint = f"start more with `hetconv-worker --device cpu --connect {self.address}{keys}`"
                raise WorkerLost(f"only {len(self.peers)} of {n} workers connected to {self.address} within "
                                 f"{self.connect_timeout:.0f}s: {hint}")
            self._check_processes("starting")
            if self.monitor.poll(0):
                self._read_monitor()                 # nobody is in a plan yet: only refusals matter
            if not self.sock.poll(int(min(left, 0.5) * 1000)):
                continue
            frames = self.sock.recv_multipart(copy=False)
            identity = frames[0].bytes
            try:
                msg = P.unpack(frames[1:])
            except P.ProtocolVersionError as e:
                try:
                    self._send_raw(identity, P.pack("ERROR", 0, name="ProtocolVersionError", message=str(e),
                                                    worker=identity.decode(errors="replace"), doing="HELLO", traceback=""))
                except WorkerLost:
                    pass                                   # it has gone already: nobody to tell
                self.log(f"refused worker {identity!r:.80}: {e}")
                continue
            except P.ProtocolError as e:
                self.log(f"ignored a malformed message from {identity!r:.80}: {e}")
                continue
            if msg.op == "ERROR":
                # A worker that could not start (no such GPU) says so instead of HELLO. One we spawned
                # ends the run, named; anyone else's is only logged: a stranger's ERROR must not be
                # a way to stop a coordinator.
                if self._spawned_here(msg.fields.get("worker")):
                    raise WorkerError(msg.fields.get("worker"), msg.fields.get("doing"), msg.fields.get("name"),
                                      msg.fields.get("message"), msg.fields.get("traceback", ""))
                self.log(f"a worker at {identity!r:.80} could not start: {msg.fields.get('name')}: "
                         f"{str(msg.fields.get('message'))[:200]}")
                continue
            if msg.op != "HELLO":
                continue
            base = str(msg.fields.get("name", "worker"))
            name = self._unique_name(base)
            process = next((p for label, p in self.processes if label == base and p.pid == msg.fields.get("pid")), None)
            peer = _Peer(identity, {**msg.fields, "name": name}, process, authenticated_key(frames[1]))
            self.peers[name] = peer
            self._welcome(peer)
            self.log(f"worker {peer.label()}: {peer.description}")
        # Spawned workers first, in the order asked, then external ones by arrival.
        order = [n for label, _ in self.processes for n, p in self.peers.items() if p.name == label]
        order += [n for n in self.peers if n not in order]
        self.peers = {n: self.peers[n] for n in order}
        self.by_identity = {p.identity: p for p in self.peers.values()}   # routing id -> peer

    def _limit_args(self):
        """The worker flags of a spawned worker: this run's frame limit (rounded up to 1 kB), and
        its CPU device's options (--cpu-conv-path, ...)."""
        limit = ["--message-limit-mb", f"{-(-self.message_limit // 1000) / 1000:.3f}"] if self.message_limit else []
        return limit + self.cpu.worker_flags()

    def _welcome(self, peer):
        """Admit a worker and tell it where to send heartbeats (a port on the host it reached us
        on, or an ipc path)."""
        self._send(peer, "WELCOME", heartbeat_port=self.heartbeat_port, heartbeat_endpoint=self.heartbeat_endpoint,
                   message_limit=self.message_limit,
                   **({"conv_paths": self.resume_conv_paths} if self.resume_conv_paths else {}))

    def _note_heartbeats(self):
        """Drain the heartbeat channel: each names the worker's identity. Anything else there is
        ignored (a stranger cannot do more than keep a name alive that it knows)."""
        now = time.monotonic()
        while self.heartbeats.poll(0):
            try:
                msg = P.unpack(self.heartbeats.recv_multipart())
            except P.ProtocolError:
                continue
            peer = self.by_identity.get(str(msg.fields.get("identity", "")).encode())
            if msg.op == "HEARTBEAT" and peer is not None:
                peer.last_seen = now

    def _spawned_here(self, worker_identity):
        """Whether an identity ('label/host/pid/id', as hetconv-worker makes it) names one of the
        processes this engine started."""
        try:
            pid = int(str(worker_identity).rsplit("/", 2)[-2])
        except (ValueError, IndexError):
            return False
        return any(proc.pid == pid for _, proc in self.processes)

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
        self._sent_bytes[peer.name] = self._sent_bytes.get(peer.name, 0) + sum(len(f) for f in frames)
        try:
            self._send_raw(peer.identity, frames)
        except WorkerLost:
            if peer.process is not None and peer.process.poll() is not None:
                raise WorkerLost(f"worker {peer.label()} exited with code {peer.process.returncode} during {doing or op}",
                                 [peer.name]) from None
            raise WorkerLost(f"worker {peer.label()} is unreachable during {doing or op}: "
                             f"it disconnected or died", [peer.name]) from None
        return self.seq

    def _check_alive(self, names, doing):
        now = time.monotonic()
        for name in names:
            peer = self.peers.get(name)
            if peer is None:
                raise WorkerLost(f"worker {name} disconnected during {doing}", [name])
            if now - peer.last_seen > self.worker_timeout:
                raise WorkerLost(f"worker {peer.label()} stopped answering (no heartbeat for "
                                 f"{now - peer.last_seen:.1f}s) during {doing}", [name])
            if peer.process is not None and peer.process.poll() is not None:
                raise WorkerLost(f"worker {peer.label()} exited with code {peer.process.returncode} during {doing}", [name])

    def _receive(self, pending, deadline, doing):
        """The next message from a known worker, or None after a 200 ms poll. pending: {seq: worker}
        of the requests still waited on. Heartbeats, strangers, malformed messages and errors
        about abandoned requests are absorbed here; an ERROR about a pending request raises
        WorkerError naming the worker; a silent or exited worker among them raises WorkerLost."""
        waiting_on = list(pending.values())
        if time.monotonic() > deadline:
            late = ", ".join(self.peers[n].label() for n in waiting_on)
            raise WorkerLost(f"no reply within {self.op_timeout:.0f}s from {late} during {doing}", waiting_on)
        events = dict(self.poller.poll(200))
        if self.heartbeats in events:
            self._note_heartbeats()
        self._check_alive(waiting_on, doing)
        if self.monitor in events or time.monotonic() <= self._probe_until:
            self._probe_after_disconnect(doing, waiting_on)
        if self.sock not in events:
            return None
        frames = self.sock.recv_multipart(copy=False)
        peer = self.by_identity.get(frames[0].bytes)
        if peer is None:
            self._note_stranger(frames)                    # a worker joining mid-run, or a stale one
            return None
        peer.last_seen = time.monotonic()
        try:
            msg = P.unpack(frames[1:])
        except P.ProtocolError as e:
            self.log(f"ignored a malformed message from {peer.label()}: {e}")
            return None
        if msg.op == "HEARTBEAT":
            return None
        if msg.op == "ERROR":
            if pending.get(msg.seq) != peer.name and msg.seq != -1:
                return None                                # about a request given up on earlier
            raise WorkerError(peer.label(), msg.fields.get("doing", doing), msg.fields.get("name", "Error"),
                              msg.fields.get("message", ""), msg.fields.get("traceback", ""), workers=[peer.name])
        self._recv_bytes[peer.name] = self._recv_bytes.get(peer.name, 0) + sum(len(f) for f in frames[1:])
        return peer, msg

    def _incoming(self, pending, doing):
        """(peer, message) as they arrive, until `pending` ({seq: worker}, emptied by the caller)
        is empty; one deadline of op_timeout for all of it."""
        deadline = time.monotonic() + self.op_timeout
        while pending:
            got = self._receive(pending, deadline, doing)
            if got is not None:
                yield got

    def _call(self, requests, doing, layer=None):
        """Sends every request, then waits for every reply. Raises WorkerError / WorkerLost naming
        the worker. Stale replies (to abandoned requests) are dropped."""
        pending, sent_at = {}, {}
        for name, (op, arrays, fields) in requests.items():
            pending[self._send(self.peers[name], op, arrays, doing=doing, **fields)] = name
            sent_at[name] = time.perf_counter()
        replies = {}
        for peer, msg in self._incoming(pending, doing):
            if pending.get(msg.seq) != peer.name:
                continue                                   # stale reply to an abandoned request
            del pending[msg.seq]
            replies[peer.name] = (msg.arrays, msg.fields)
            self._record(peer.name, layer, msg.fields, roundtrip_s=time.perf_counter() - sent_at[peer.name])
        return replies

    def thread_counts(self):
        """A spawned `cpu` worker's threads (0: none spawned), and each worker's as it said at HELLO."""
        return self.spawn_threads, {name: peer.threads for name, peer in self.peers.items()}

    def step_stats(self):
        stats = super().step_stats()
        for name, s in stats.items():
            s["bytes_sent"] = self._sent_bytes.get(name, 0)
            s["bytes_recv"] = self._recv_bytes.get(name, 0)
        self._sent_bytes, self._recv_bytes = {}, {}
        return stats

    # ---- losing and gaining workers -----------------------------------------------------------------
    def _read_monitor(self):
        """Drain the monitor; log refused handshakes (once per host). True if a connection dropped."""

        dropped = False
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            reason = handshake_refusal(event)
            if reason is not None:
                self.auth.refusals.refused(event.get("endpoint", b"").decode("utf-8", "replace"), reason)
            elif event.get("event") == self.zmq.EVENT_DISCONNECTED:
                dropped = True
        return dropped

    def _probe_after_disconnect(self, doing, waiting_on=()):
        """Some connection dropped: a send to a vanished routing id fails at once. A vanished
        worker in the plan or waited on (a joiner calibrating) is lost; any other is forgotten.
        The monitor can report the drop before the socket has let go of the routing id (its I/O
        thread tells the socket later, sooner on an idle machine), so a probe that finds nobody
        gone is repeated on every poll for DISCONNECT_PROBE_S: one tiny send per worker each time."""
        now = time.monotonic()
        if self._read_monitor():
            self._probe_until = now + DISCONNECT_PROBE_S
        if now > self._probe_until:
            return
        lost = []
        for name, peer in self.peers.items():
            try:
                self.sock.send_multipart([peer.identity] + P.pack("HEARTBEAT", 0), flags=self.zmq.NOBLOCK)
            except self.zmq.ZMQError as e:
                if e.errno == self.zmq.EHOSTUNREACH:          # gone; a full queue (EAGAIN) is a slow reader
                    lost.append(name)
        in_plan = [n for n in lost if self.plan is None or n in self.plan.workers or n in waiting_on]
        self.drop([n for n in lost if n not in in_plan])      # idle, left out of the plan: nothing to redo
        if in_plan:
            raise WorkerLost(f"worker {', '.join(self.peers[n].label() for n in in_plan)} disconnected during {doing}",
                             in_plan)

    def _note_stranger(self, frames):
        """A HELLO from a routing id outside the run: kept, to be admitted at the next snapshot,
        up to MAX_JOINING at a time (without keys anyone can say HELLO, each time from a new
        routing id, and each kept HELLO holds its header, up to 1 MiB); one more is refused."""
        try:
            msg = P.unpack(frames[1:])
        except P.ProtocolError:
            return
        if msg.op != "HELLO":
            return
        identity, name = frames[0].bytes, str(msg.fields.get("name", "?"))[:80]
        if identity not in self.joining and len(self.joining) >= MAX_JOINING:
            why = (f"{len(self.joining)} workers wait to join this run already (at most {MAX_JOINING} at a time): "
                   f"start this one after its next snapshot")
            try:
                self.sock.send_multipart([identity] + P.pack("ERROR", 0, name="JoinRefused", message=why, worker=name,
                                                             doing="HELLO", traceback=""), flags=self.zmq.NOBLOCK)
            except self.zmq.ZMQError:
                pass                                        # gone already: nobody to tell
            self.joiners_refused += 1
            if self.joiners_refused == 1:
                self.log(f"refused worker {name} (further refusals are not logged until the next snapshot): {why}")
            return
        self.joining[identity] = (msg.fields, authenticated_key(frames[1]))
        self.log(f"worker {name} asks to join: admitted at the next snapshot")
        self._tell_to_wait(identity)

    def _tell_to_wait(self, identity):
        """WAIT: how long until a joiner is admitted, so it waits that long, not its own
        --connect-timeout. One that cannot be reached any more is forgotten, once."""
        try:
            self.sock.send_multipart([identity] + P.pack("WAIT", 0, seconds=float(self.join_wait_s)),
                                     flags=self.zmq.NOBLOCK)
        except self.zmq.ZMQError:
            hello, _ = self.joining.pop(identity, ({}, ""))
            self.log(f"worker {hello.get('name', '?')} asked to join but has gone")

    def keep_joiners_waiting(self, seconds):
        """Called between steps with the time until the next snapshot admits the joiners."""
        self.join_wait_s = max(0.0, float(seconds))
        for identity in list(self.joining):
            self._tell_to_wait(identity)

    def drop(self, names):
        """Forget lost workers; a spawned one that is still running (hung) is ended, and any other
        is told to shut down, which a stopped one reads when it runs again."""
        for name in names:
            peer = self.peers.pop(name, None)
            if peer is None:
                continue
            self.by_identity.pop(peer.identity, None)
            try:
                self.sock.send_multipart([peer.identity] + P.pack("SHUTDOWN", 0), flags=self.zmq.NOBLOCK)
            except self.zmq.ZMQError:
                pass                                        # gone already
            if peer.process is not None and peer.process.poll() is None:
                peer.process.kill()
            self.log(f"dropped worker {peer.label()}")
        if self.calibration:
            self.calibration = {n: c for n, c in self.calibration.items() if n in self.peers}

    def admit(self, specs, input_shapes, settings):
        """Workers that said HELLO mid-run join now: welcomed, calibrated, and given a plan with
        everyone. A joiner that has gone or fails on the way (an ERROR, a frame limit too small)
        is dropped, once, and never touches the running plan. Returns the new plan, or None when
        nobody joined."""
        joining, self.joining = self.joining, {}
        self.joiners_refused = 0
        new = []
        for identity, (hello, public_key) in joining.items():
            name = self._unique_name(str(hello.get("name", "worker")))
            peer = _Peer(identity, {**hello, "name": name}, public_key=public_key)
            try:
                self._welcome(peer)
            except WorkerLost:
                self.log(f"worker {peer.label()} asked to join but has gone")
                continue
            self.peers[name] = peer
            self.by_identity[identity] = peer
            new.append(name)
        while new:
            try:
                self._calibrate_some(specs, input_shapes, settings, new)
                break
            except (WorkerLost, WorkerError) as e:
                failed = [n for n in e.workers if n in new]
                if not failed or len(failed) < len(e.workers):
                    raise                                   # a worker of the plan: the loop recovers
                self.log(f"not admitted: {e}")
                self.drop(failed)
                new = [n for n in new if n not in failed]
        if not new:
            return None
        for name in new:
            self.log(f"worker {self.peers[name].label()} joined: {self.peers[name].description}")
        self.fixed_plan = None                              # a hand-set plan does not cover the newcomers
        return self.replan(specs, input_shapes, settings)

    def _unique_name(self, name):
        base, k = name, 2
        while name in self.peers:                            # labels need not be unique; names in plans must
            name, k = f"{base}#{k}", k + 1
        return name

    # ---- the engine interface ------------------------------------------------------------------
    @property
    def workers(self):
        return list(self.peers)

    def load(self, plan, specs, params):
        super().load(plan, specs, params)
        self.head_weights_later = head_weights_later(self.peers, plan.workers, host_key())
        if self.exchange == "peer":
            self._connect_peers()

    def _connect_peers(self):
        """Tell every worker of the plan who its peers are, where to reach them, and who holds
        which kernels; each connects to the others (ipc on its own host, tcp elsewhere)."""
        peers = [{"name": name, "endpoints": self.peers[name].peer_endpoints, "host_key": self.peers[name].host_key,
                  "public_key": self.peers[name].public_key, "ipc_token": self.peers[name].ipc_token}
                 for name in self.plan.workers]
        missing = [p["name"] for p in peers if not p["endpoints"]]
        if missing:
            raise WorkerLost(f"worker(s) {', '.join(missing)} announced no peer address: they cannot take part in "
                             f"--exchange peer (use --exchange star, or a hetconv-worker of this version)")
        ranges = [{name: list(lp.ranges[name]) for name in self.plan.workers} for lp in self.plan.layers]
        modes = self.plan.modes()
        images = [{name: int(lp.images[name]) for name in self.plan.workers} if lp.mode == "data" else {}
                  for lp in self.plan.layers]
        # Twice: first every worker learns whom to admit, then they connect. With keys, a peer
        # that connects before its inbox knows it is refused, and libzmq does not retry a CURVE
        # handshake that ZAP denied: its slices would never arrive. One more round trip per plan.
        graph = None if self.graph is None else self.graph.spec.to_json()
        # a graph's BatchNorm nodes: every worker runs them on its whole tensors, so each holds their state
        states = self.graph.norm_states() if self.graph is not None else []
        norms = ({"norms": [list(s) for s in states], "optimizer": self.optimizer,
                  "bn_ghost_batch": self.bn_ghost_batch} if states else {})
        arrays = [a for s in states for a in s.values()]
        for connect in (False, True):
            self._call({name: ("PEERS", arrays, {"peers": peers, "ranges": ranges, "modes": modes, "images": images,
                                                 "graph": graph, **norms,
                                                 "you": name, "timeout": self.op_timeout, "connect": connect,
                                                 **self.step_bounds})
                        for name in self.plan.workers}, "connecting workers to each other")

    def gather(self):
        """ShardEngine.gather; in the peer exchange a graph's BatchNorm nodes' states from the plan's
        first worker (every worker holds the same), which this process's copy then follows."""
        out = super().gather()
        if self.exchange != "peer" or self.graph is None or not self.graph.norms:
            return out
        first = self.plan.workers[0]
        doing = "gathering the BatchNorm nodes' state"
        arrays, fields = self._call({first: ("FETCH", [], {"layer": -1, "norms": True})}, doing)[first]
        try:
            self.graph.load_norms(norm_states_from(fields.get("norms"), list(arrays)), self.optimizer)
        except ValueError as e:
            raise WorkerError(first, doing, "ShapeError", str(e)) from None
        return out[:len(self.specs)] + self.graph.norm_states()

    def conv_step(self, xs, head, update, step=(0, 0), head_sum_of_squares=None):
        if self.exchange == "star":
            return super().conv_step(xs, head, update, step, head_sum_of_squares)
        self.batch = sum(len(x) for x in xs)
        _, factor = self._peer_step(xs, head, update, step, head_sum_of_squares)
        self.close_measured_step()
        return factor

    def predict(self, x):
        if self.exchange == "star":
            return super().predict(x)
        return self._peer_step([x], None, None)[0][0]

    def _start_step(self, step, xs, train, update, train_step, doing):
        """STEP to every worker of the plan -> {seq: worker}, the replies the step waits for."""
        pending = {}
        # the metrics number a training step from 1, train_step from 0
        traced = {"trace": True} if train and self.trace_step == int(train_step[0]) + 1 else {}
        for name in self.plan.workers:
            seq = self._send(self.peers[name], "STEP", doing=doing, step=step, micro_batches=len(xs), train=train,
                             update=None if update is None else update.to_json(), sizes=[len(x) for x in xs],
                             train_step=int(train_step[0]), seed=int(train_step[1]), **traced)
            pending[seq] = name
        return pending

    def _step_result(self, features, received, norms, doing, clipping):
        """(features, clipping factor) once every worker has said STEP_DONE: every micro-batch's
        features must have come (`received` of them), and where the update clips (`clipping`, its
        rule) every worker must report the same global gradient norm, as each summed the same parts
        in the same order."""
        if received < len(features):
            raise WorkerLost(f"{doing}: the workers finished without sending micro-batch {received}'s features")
        if clipping is None:
            return features, 1.0
        names = self.plan.workers
        totals = {norms.get(name) for name in names}
        total = totals.pop() if len(totals) == 1 else None
        if not (isinstance(total, float) and math.isfinite(total) and total >= 0):
            raise WorkerError(names[0], doing, "NormError", f"the workers report different or no global gradient "
                                                             f"norms: {dict((n, norms.get(n)) for n in names)}")
        return features, clip_factor(total, clipping.max_norm)

    def _peer_step(self, xs, head, update, train_step=(0, 0), head_sum_of_squares=None):
        """One STEP through the workers (worker.graph_step; a chain is the graph whose blocks each
        read the one before): each worker its rows of every micro-batch's images (the layout the
        step holds them in), which they gather where they need them whole; the features, whole,
        from the plan's first worker, or each worker's rows or channels of them, placed together;
        with a head (training), the FC work here on micro-batch m while the workers compute m+1,
        and the gradient back: whole to every worker, or each its part. The images travel in the
        wire's dtype where only blocks read them, the features and their gradient where a block
        makes them (the blocks round them there anyway), else in float32: a join next to them
        runs on the workers on what it would run on here in the star exchange. Where the update
        clips (max_norm), the last GRAD carries the head's part of the global norm
        (`head_sum_of_squares()`), and the workers, having summed theirs among themselves, report
        the whole. Returns (the features per micro-batch when there is no head, the clipping
        factor)."""
        self.step_id += 1
        step, names, micros = self.step_id, self.plan.workers, len(xs)
        train = head is not None
        doing = f"{'training' if train else 'inference'} step {step}"
        graph = self.step_graph(tuple(xs[0].shape[2:]))
        shape = graph.feature_shape
        images_wire = self.wire if graph.images_exact else "float32"
        features_wire = self.wire if graph.features_exact else "float32"
        features_dtype = encode(np.zeros(1, np.float32), features_wire).dtype
        sent_at = time.perf_counter()
        pending = self._start_step(step, xs, train, update, train_step, doing)
        rows = self._graph_rows([len(x) for x in xs])
        for m, x in enumerate(xs):
            x = np.ascontiguousarray(x, np.float32)
            pieces = [x[rows[name][m][0]:rows[name][m][1]] for name in names]
            for name, piece in zip(names, pieces):
                self._send(self.peers[name], "INPUT", [encode(piece, images_wire)], doing=doing, step=step, micro=m)
        senders, grads = self._graph_feature_blocks(graph, [len(x) for x in xs], rows)
        later = train and self.head_weights_later and hasattr(head, "settle")
        parts = [dict() for _ in range(micros)]
        features, next_micro, norms = [None] * micros, 0, {}
        clip = train and update is not None and update.max_norm > 0
        for peer, msg in self._incoming(pending, doing):
            if msg.fields.get("step") != step:
                continue                                       # from an abandoned step
            if msg.op == "FEATURES":
                m = self._features_micro(peer, msg, senders, parts, shape, features_dtype, doing)
                parts[m][peer.name] = decode(msg.arrays[0], features_wire)
                # in micro-batch order, so the FC gradients add up in the same order as anywhere else
                while next_micro < micros and len(parts[next_micro]) == len(senders):
                    h = _placed_features(parts[next_micro], senders, next_micro, len(xs[next_micro]), shape)
                    parts[next_micro] = None
                    if train:
                        grad = np.ascontiguousarray(head(next_micro, h, weights_later=True) if later
                                                    else head(next_micro, h), np.float32)
                        norm = ({"head_sum_of_squares": float(head_sum_of_squares())}
                                if clip and next_micro == micros - 1 else {})
                        for name in names:
                            got = [grad[r0:r1, c0:c1] for r0, r1, c0, c1 in grads[name][next_micro]]
                            self._send(self.peers[name], "GRAD", [encode(np.ascontiguousarray(
                                got[0] if len(got) == 1 else np.concatenate(got, axis=1)), features_wire)],
                                       doing=doing, step=step, micro=next_micro, **norm)
                        if later:
                            head.settle()
                    else:
                        features[next_micro] = h
                    next_micro += 1
            elif msg.op == "STEP_DONE" and pending.get(msg.seq) == peer.name:
                del pending[msg.seq]
                self._record(peer.name, None, msg.fields, roundtrip_s=time.perf_counter() - sent_at)
                norms[peer.name] = msg.fields.get("sum_of_squares")
        return self._step_result(features, next_micro, norms, doing, update if clip else None)

    @staticmethod
    def _features_micro(peer, msg, senders, parts, shape, features_dtype, doing):
        """The micro-batch a FEATURES message from `peer` is for, once it is checked against the
        plan (a sender of that micro-batch, its part's shape and the wire's dtype, not yet
        received), else WorkerError naming what came and what the plan expects."""
        micros = len(parts)
        m = msg.fields.get("micro")
        known = isinstance(m, int) and not isinstance(m, bool) and 0 <= m < micros and peer.name in senders
        got = tuple(msg.arrays[0].shape) if msg.arrays else ()
        want = pieces_shape(senders[peer.name][m]) + tuple(shape[1:]) if known else None
        if not known or got != want or msg.arrays[0].dtype != features_dtype or peer.name in parts[m]:
            raise WorkerError(peer.label(), doing, "ShapeError",
                              f"FEATURES for micro-batch {m!r}: {msg.arrays[0].dtype if msg.arrays else 'no'} "
                              f"{got}; the plan expects {features_dtype} {want or 'its part'} for micro-batch "
                              f"{m if known else f'0..{micros - 1}'}, from {', '.join(senders)}"
                              + (" (once)" if known and peer.name in parts[m] else ""), "")
        return m

    def _graph_rows(self, sizes):
        """{worker: [(r0, r1) per micro-batch]}: each worker's rows of the images, the layout a
        graph's step holds them in (worker.graph_step.rows_of_step)."""
        rows = layout_rows(self.plan.layers, sizes)
        if rows is None:
            raise PlanError("the plan's data blocks split the images differently; a graph's data blocks split "
                            "them alike (planner.plan_from_lines with one_split)")
        return rows

    def _graph_feature_blocks(self, graph, sizes, rows):
        """({worker: [its blocks (r0, r1, c0, c1) of each micro-batch's features, side by side in
        what it sends]} for the workers that send them, the same for the blocks of their gradient
        each worker gets): where the step holds its tensors in layouts and the features in rows or
        channel ranges, each worker its own part both ways (engine/layouts.pieces); else the whole
        from the plan's first worker, their gradient to all."""
        names, channels, layers = self.plan.workers, graph.feature_shape[0], self.plan.layers
        layout = tensor_layouts(graph.steps, self.plan.modes(), graph.norms)[graph.feature]
        if layout == WHOLE:
            whole = [[(0, n, 0, channels)] for n in sizes]
            return {names[0]: whole}, {w: whole for w in names}
        parts = {w: [pieces(layout, n, channels, rows[w][m], lambda b: layers[b].ranges[w], lambda b: layers[b].kernels)
                     for m, n in enumerate(sizes)] for w in names}
        return parts, parts

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
        if getattr(self, "monitor", None) is not None:
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
        self.sock.close(linger=0)
        if getattr(self, "heartbeats", None) is not None:
            self.heartbeats.close(linger=0)
        if getattr(self, "auth", None) is not None:
            self.auth.stop()                                # its ZAP socket lives on this context
        self.ctx.term()
        if getattr(self, "_key_tmp", None):
            shutil.rmtree(self._key_tmp, ignore_errors=True)
