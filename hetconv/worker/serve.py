"""`hetconv-worker`: owns a slice of every conv layer's kernels on one device and serves the
coordinator over ZeroMQ.

Two threads. The I/O thread (main) owns the DEALER socket: it forwards requests to the compute
thread, forwards replies back, and sends a HEARTBEAT every `--heartbeat` seconds even while a
long kernel runs (the kernels release the GIL). The compute thread owns the device and the
shard. Requests reach it through a queue, already parsed and checked; replies come back over an
inproc PAIR socket, so a reply wakes the I/O thread's poll at once.
An exception while serving becomes an ERROR message naming the worker, and the worker goes on.
"""
import math
import os
import queue
import socket
import sys
import threading
import time
import uuid

import zmq

from hetconv import __version__, runtimes
from hetconv.devices import DeviceError, open_device, parse_device_list
from hetconv.devices.cpu_options import CpuOptions
from hetconv.engine.shard import ConvShard, ShardServer
from hetconv.flags import check_endpoint, check_range, threads_note, usable_cores
from hetconv.transport import protocol as P
from hetconv.transport.keys import authenticated_key, connect_curve, set_message_limit, worker_keys
from hetconv.transport.sockets import bind_inbox, host_key, remove_ipc_files, route_address, write_ipc_token
from hetconv.transport.worker_argv import COORDINATOR_ENV
from hetconv.worker import WorkerExit
from hetconv.worker.peers import PeerLinks


def _check_args(args):
    """Range and syntax checks of every flag, before a device opens or a socket connects. Turns
    --device cpu:THREADS into --device cpu --threads THREADS."""
    source = "--connect"                        # what a bad address is blamed on
    if not args.connect:
        args.connect, source = os.environ.get(COORDINATOR_ENV, "").strip(), COORDINATOR_ENV
        if not args.connect:
            raise WorkerExit(f"no coordinator address: give --connect tcp://HOST:PORT or set {COORDINATOR_ENV}")
    try:
        check_endpoint(source, args.connect)
        for flag, value in (("--connect-timeout", args.connect_timeout), ("--idle-timeout", args.idle_timeout),
                            ("--heartbeat", args.heartbeat)):
            check_range(flag, value, 0, inclusive=False)
        check_range("--threads", args.threads, 0)
        check_range("--message-limit-mb", args.message_limit_mb, 0, inclusive=False)
        entries = parse_device_list("--device", args.device)
        if len(entries) != 1 or entries[0].count != 1:
            raise ValueError(f"--device {args.device!r}: one device per worker, e.g. cpu or cuda:0")
        if args.curve:
            worker_keys(args.curve)                # every key file read and checked before connecting
    except (ValueError, DeviceError) as e:
        raise WorkerExit(str(e)) from None
    entry = entries[0]
    if args.threads and entry.device != "cpu":
        raise WorkerExit(f"--threads {args.threads} is for a cpu device; --device {args.device} runs on its GPU")
    if entry.threads:
        if args.threads and args.threads != entry.threads:
            raise WorkerExit(f"--device {args.device} and --threads {args.threads} disagree: give one of them")
        args.threads = entry.threads
    args.device = entry.device
    if args.deterministic and args.device == "cpu":
        problem = runtimes.deterministic_problem()
        if problem:
            raise WorkerExit(problem)
        # a fixed count, which the HELLO then tells the coordinator (its plan records it), never
        # a share of the cores this process may use
        args.threads = runtimes.threads_for(args.threads, True)
    if args.heartbeat >= args.idle_timeout:
        raise WorkerExit(f"--heartbeat {args.heartbeat} must be shorter than --idle-timeout {args.idle_timeout}")


def _serve_compute(ctx, endpoint, requests, device_spec, threads, identity, name, keydir="", peer_keys=None,
                   cpu=CpuOptions()):
    """The compute thread: one request (a Message the I/O thread already checked) in from the
    `requests` queue, its reply out over the PAIR socket, strictly in order; None stops it. A
    STEP reads its further messages (INPUT, GRAD, peers' SLICEs) from the same queue. `cpu`: a
    CPU device's options (devices.cpu_options.CpuOptions, the command's flags)."""


    pair = ctx.socket(zmq.PAIR)
    pair.linger = 0
    pair.connect(endpoint)
    try:
        device = open_device(device_spec, **(cpu.device_options(threads) if device_spec == "cpu" else {}))
        shard = ConvShard(device)
        server = ShardServer(shard)
        pair.send_multipart(P.pack("HELLO", 0, description=device.describe()))
    except Exception as e:
        pair.send_multipart(P.pack("ERROR", 0, **P.error_fields(e, identity, f"opening device {device_spec}")))
        return
    peers = PeerLinks(ctx, name, shard, requests, lambda frames: pair.send_multipart(frames, copy=False),
                      keydir=keydir, peer_keys=peer_keys)
    try:
        while True:
            msg = peers.deferred.pop(0) if peers.deferred else requests.get()
            if msg is None:
                return
            seq = msg.seq
            doing = " ".join([msg.op] + [f"{k}={v}" for k, v in msg.fields.items() if k in ("layer", "need_dx", "step")])
            try:
                t0 = time.perf_counter()
                if msg.op == "STEP":
                    op, arrays, fields = peers.run_step(seq, msg.fields)
                elif msg.op == "PEERS":
                    op, arrays, fields = ("PEERS_OK", [], peers.connect(msg.fields, msg.arrays))
                elif msg.op == "FETCH" and msg.fields.get("norms") is True:
                    op, arrays, fields = peers.norm_states_reply()
                elif msg.op == "WELCOME":        # a resumed run's conv paths, before any work
                    device.preload_conv_paths(msg.fields.get("conv_paths"))
                    continue
                elif msg.op in ("SLICE", "INPUT", "GRAD"):
                    peers.hold_early(msg)        # may overtake its STEP: kept for that step (or dropped by the next)
                    continue
                else:
                    op, arrays, fields = server.handle(msg.op, msg.arrays, msg.fields)
                device.synchronize()
                # compute time rides in the header, so the coordinator can separate it from the wire
                fields.setdefault("compute_s", time.perf_counter() - t0)
                reply = P.pack(op, seq, arrays, **fields)
            except InterruptedError:
                return                           # shutting down in the middle of a step
            except Exception as e:
                reply = P.pack("ERROR", seq, **P.error_fields(e, identity, doing))
            pair.send_multipart(reply, copy=False)
            msg = None                           # drop the received frames before blocking again
    finally:
        peers.close()
        # closed here, not left to garbage collection: run()'s ctx.term() waits for every socket,
        # and a reference cycle through the step's objects would keep this one open
        pair.close(linger=0)


def _coordinator_socket(ctx, identity, args, limit):
    """The DEALER socket to the coordinator, not yet connected: its identity, send timeout, frame
    limit and CURVE keys are set before connect (libzmq copies them into the connection)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.setsockopt(zmq.IDENTITY, identity.encode())
    # A backstop for any blocking send: the I/O loop itself sends with NOBLOCK (see _io_loop).
    dealer.sndtimeo = int(min(args.idle_timeout, 10.0) * 1000)
    set_message_limit(dealer, limit)
    if args.curve:
        connect_curve(dealer, args.curve)          # the handshake proves both sides' keys
    return dealer


def _join(dealer, first, hello, args, limit):
    """Send the device's first word to the coordinator (its ERROR, or HELLO with `hello`'s fields
    and the device's description) and wait to be admitted: -> the WELCOME, or None where the
    coordinator shut down first. WorkerExit where the device failed or the run's frames exceed
    --message-limit-mb (said to the coordinator first)."""
    if first.op == "ERROR":
        dealer.send_multipart(P.pack("ERROR", 0, **first.fields))
        time.sleep(0.2)                         # let the error leave before the socket closes
        if args.verbose and first.fields.get("traceback"):
            print(first.fields["traceback"], file=sys.stderr)
        raise WorkerExit(f"{first.fields['doing']}: {first.fields['message']}")
    dealer.send_multipart(P.pack("HELLO", 0, description=first.fields["description"], **hello))
    welcome = _await_welcome(dealer, args)
    if welcome is None:
        return None
    needed = int(welcome.fields.get("message_limit") or 0)
    if needed > limit:
        why = (f"this run moves frames of up to {needed / 1e6:.1f} MB, more than --message-limit-mb "
               f"{args.message_limit_mb:g} allows: start the worker with --message-limit-mb {-(-needed // 1_000_000)}")
        # seq -1: not an answer to a request, an error the coordinator raises naming this worker
        dealer.send_multipart(P.pack("ERROR", -1, name="MessageLimitError", message=why, worker=hello["identity"],
                                     doing="joining", traceback=""))
        time.sleep(0.2)                         # let it leave before the socket closes
        raise WorkerExit(why)
    return welcome


def run(args):


    _check_args(args)
    args.parent_was_ppid = bool(args.parent_pid) and os.getppid() == args.parent_pid
    if args.threads and not args.parent_pid:      # a spawned worker's coordinator has said it already
        note = threads_note(args.threads)
        if note:
            print(f"hetconv-worker: {note}", file=sys.stderr)
    host = socket.gethostname()
    label = args.name or f"{args.device}@{host}"
    # Unique per incarnation: a restarted worker is a new peer, never mistaken for the old one.
    identity = f"{label}/{host}/{os.getpid()}/{uuid.uuid4().hex[:8]}"

    ctx = zmq.Context()
    endpoint = f"inproc://compute-{uuid.uuid4().hex}"
    pair = ctx.socket(zmq.PAIR)
    pair.linger = 0
    pair.bind(endpoint)
    limit = int(args.message_limit_mb * 1e6)
    dealer = _coordinator_socket(ctx, identity, args, limit)
    requests = queue.Queue()
    peer_address = args.peer_address or route_address(args.connect)
    auth = None
    try:
        inbox, peer_endpoints, auth, peer_keys = bind_inbox(ctx, peer_address, args.curve, log=_log, limit=limit)
    except zmq.ZMQError as e:
        raise WorkerExit(f"--peer-address {peer_address}: cannot listen for peers there ({e.strerror})") from None
    ipc_token = write_ipc_token(peer_endpoints)   # "" : no ipc path proved, peers reach this worker over tcp
    compute = threading.Thread(target=_serve_compute,
                               args=(ctx, endpoint, requests, args.device, args.threads, identity, label,
                                     args.curve, peer_keys, CpuOptions.of(args)),
                               name="compute", daemon=True)
    compute.start()
    heartbeats = None
    try:
        # The device opens first (it may fail: no GPU, bad index) and says so before we connect;
        # a GPU's can take many seconds, during which the coordinator may go.
        while not pair.poll(1000):
            _check_parent(args)
        first = P.unpack(pair.recv_multipart())
        dealer.connect(args.connect)
        hello = dict(name=label, identity=identity, device=args.device, host=host, pid=os.getpid(),
                     version=__version__, threads=args.threads, peer_endpoints=peer_endpoints,
                     host_key=host_key(), ipc_token=ipc_token, cores=usable_cores())
        welcome = _join(dealer, first, hello, args, limit)
        if welcome is None:
            return                                  # SHUTDOWN while waiting to join
        if welcome.fields.get("conv_paths"):
            requests.put(welcome)                   # the compute thread's device takes them first
        heartbeats = _heartbeat_socket(ctx, args.connect, welcome.fields, args.curve)
        print(f"hetconv-worker {identity}: serving {first.fields['description']} for {args.connect}; "
              f"peers reach it at {' '.join(peer_endpoints)}", flush=True)
        _io_loop(dealer, pair, inbox, requests, args, heartbeats, identity)
    finally:
        if heartbeats is not None:
            heartbeats.close(linger=0)
        requests.put(None)
        compute.join(timeout=2)
        inbox.close(linger=0)
        remove_ipc_files(peer_endpoints)
        dealer.close(linger=0)
        pair.close(linger=0)
        if auth is not None:
            auth.stop()
        if compute.is_alive():                   # a kernel still runs: its sockets end with the process
            _compute_still_running.append(compute)
        else:
            ctx.term()


# The compute thread of a run() that ended while it was still inside a kernel (see exit_process).
_compute_still_running = []


def exit_process(code):
    """End the worker process with `code`. Where run() left its compute thread inside a kernel
    (SHUTDOWN or SIGTERM mid-step; it is a daemon thread), the interpreter's own exit would tear
    down native state under it, oneDNN's objects, OpenMP's pool, LLVM's JIT, while it still runs
    there: so stdout and stderr are flushed and the process ends by os._exit, running no more
    Python. Otherwise the ordinary exit."""
    if any(t.is_alive() for t in _compute_still_running):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    sys.exit(code)


def wait_seconds(fields):
    """A WAIT's `seconds` (the coordinator's estimate until it admits this worker), or None when it
    is not a finite number >= 0: such a WAIT is ignored."""
    seconds = fields.get("seconds")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        return None
    return float(seconds) if math.isfinite(seconds) and seconds >= 0 else None


def _await_welcome(dealer, args):
    """WELCOME, or None when the coordinator sent SHUTDOWN instead. A WAIT (a run admits a joiner
    only at its next snapshot, which can be minutes away) moves the deadline to its estimate plus
    --connect-timeout."""
    deadline = time.monotonic() + args.connect_timeout
    told = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            refused = (" or it refused this worker's key (CURVE: is this worker's public key in the coordinator's "
                       "--curve DIR/authorized, and coordinator.key its key?)") if args.curve else (
                       "; a coordinator that uses keys needs --curve here too")
            raise WorkerExit(f"no coordinator answered at {args.connect} within {args.connect_timeout:.0f}s "
                             f"(is hetconv-coordinator running and bound there?{refused})")
        if dealer.poll(int(min(left, 1.0) * 1000), zmq.POLLIN):
            frames = dealer.recv_multipart()
            try:
                msg = P.unpack(frames, accept_any_version=True)
            except P.ProtocolError as e:
                print(f"hetconv-worker: ignoring a malformed message while waiting for WELCOME: {e}", file=sys.stderr)
                continue
            if msg.op == "ERROR":
                raise WorkerExit(f"the coordinator refused this worker: {msg.fields.get('message')}")
            if msg.op == "WELCOME":
                return msg
            if msg.op == "SHUTDOWN":
                _send_or_drop(dealer, P.pack("BYE", msg.seq))
                time.sleep(0.05)                # let BYE leave before the socket closes
                print("hetconv-worker: the coordinator ended the run before admitting this worker", file=sys.stderr)
                return None
            seconds = wait_seconds(msg.fields) if msg.op == "WAIT" else None
            if seconds is not None:
                deadline = max(deadline, time.monotonic() + seconds + args.connect_timeout)
                if not told:
                    told = True
                    print(f"hetconv-worker: the run admits this worker at its next snapshot, in about "
                          f"{seconds:.0f} s; waiting", file=sys.stderr, flush=True)
        _check_parent(args)


def _send_or_drop(sock, frames, copy=True):
    """Send without blocking; False when the link cannot take it now (its queue is full: the
    other end is gone or not reading)."""
    try:
        sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)
        return True
    except zmq.Again:
        return False


def _log(line):
    print(f"hetconv-worker: {line}", file=sys.stderr, flush=True)


def _heartbeat_socket(ctx, connect, welcome, keydir=""):
    """A PUSH to the coordinator's heartbeat channel, where WELCOME says it is (a port on the
    host --connect names, or an ipc path); None from a coordinator without one. Its own
    connection, so a heartbeat is never queued behind a large reply on a slow link."""
    port, endpoint = int(welcome.get("heartbeat_port") or 0), str(welcome.get("heartbeat_endpoint") or "")
    if port and connect.startswith("tcp://"):
        endpoint = f"{connect.rsplit(':', 1)[0]}:{port}"
    if not endpoint:
        return None
    sock = ctx.socket(zmq.PUSH)
    sock.linger = 0
    sock.sndhwm = 4                      # a gone coordinator: drop heartbeats, never pile them up
    if keydir:
        connect_curve(sock, keydir)
    sock.connect(endpoint)
    return sock


def _check_parent(args):
    if args.parent_pid and not _parent_alive(args.parent_pid, getattr(args, "parent_was_ppid", False)):
        raise WorkerExit(f"the coordinator process {args.parent_pid} that started this worker is gone")


def _parent_alive(pid, was_ppid):
    """Whether the process `pid` that started this worker still runs. A killed parent that its own
    parent has not reaped (a notebook or a wrapper reading its output) is a zombie, which
    os.kill(pid, 0) finds alive; but this worker was handed to another process (init, a
    subreaper) the moment it died, so its parent pid changed (`was_ppid`: `pid` was the parent
    at start), and /proc says Z."""
    if was_ppid and os.getppid() != pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return not _is_zombie(pid)


def _is_zombie(pid):
    """Whether /proc says `pid` has exited (Z, zombie; X, dead); False where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    state = stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3]     # the name in brackets may hold ")"
    return state in (b"Z", b"X")


def _io_loop(dealer, pair, inbox, requests, args, heartbeats=None, identity=""):
    """Every send to the coordinator is NOBLOCK: a coordinator that is gone (or stopped reading)
    fills the link's queue, and a blocking send would hold this loop, its idle timeout and
    SHUTDOWN handling, for good. A reply the link cannot take waits here (no further reply is
    read meanwhile); a heartbeat or an ERROR about a malformed request is dropped. Nothing sent
    for --idle-timeout ends the worker."""

    poller = zmq.Poller()
    poller.register(dealer, zmq.POLLIN)
    poller.register(pair, zmq.POLLIN)
    poller.register(inbox, zmq.POLLIN)
    hb = P.pack("HEARTBEAT", 0)
    hb_named = P.pack("HEARTBEAT", 0, identity=identity)
    last_request = last_sent = last_beat = time.monotonic()
    reply = None                              # a reply the coordinator's link could not take yet
    stuck_since = None                        # when a send last failed, with none succeeding since

    def send(frames, copy=True):
        nonlocal last_sent, stuck_since
        if _send_or_drop(dealer, frames, copy=copy):
            last_sent, stuck_since = time.monotonic(), None
            return True
        stuck_since = stuck_since or time.monotonic()
        return False

    while True:
        events = dict(poller.poll(int(args.heartbeat * 1000)))
        now = time.monotonic()
        if dealer in events and events[dealer] & zmq.POLLIN:
            frames = dealer.recv_multipart(copy=False)
            last_request = now
            try:
                msg = P.unpack(frames)
            except P.ProtocolError as e:
                # A malformed request never reaches the device: answer it and keep serving.
                send(P.pack("ERROR", -1, **P.error_fields(e, identity, "reading a request")))
                msg = None
            if msg is None or msg.op in ("HEARTBEAT", "WAIT"):
                pass                          # a probe that this link is up; a WAIT that crossed WELCOME
            elif msg.op == "SHUTDOWN":
                send(P.pack("BYE", msg.seq))
                time.sleep(0.05)
                return
            else:
                requests.put(msg)             # checked once, here; the arrays keep their frames alive
        if inbox in events:
            frames = inbox.recv_multipart(copy=False)
            try:
                msg = P.unpack(frames)
            except P.ProtocolError as e:
                print(f"hetconv-worker: ignored a malformed message from a peer: {e}", file=sys.stderr, flush=True)
                msg = None
            if msg is not None and msg.op == "SLICE":
                msg.peer_key = authenticated_key(frames[0])   # whom the sender must be (PeerLinks._admit)
                requests.put(msg)             # only slices come from peers; the compute thread matches them
        if reply is None and pair in events:
            reply = pair.recv_multipart(copy=False)
        if reply is not None and send(reply, copy=False):
            reply = None
        # Wake when the link frees up for a waiting reply; read no further reply meanwhile.
        poller.register(dealer, zmq.POLLIN | (zmq.POLLOUT if reply is not None else 0))
        poller.register(pair, 0 if reply is not None else zmq.POLLIN)
        if now - last_sent >= args.heartbeat:
            send(hb)
            last_sent = now
        if heartbeats is not None and now - last_beat >= args.heartbeat:
            _send_or_drop(heartbeats, hb_named)
            last_beat = now
        if stuck_since is not None and now - stuck_since > args.idle_timeout:
            raise WorkerExit(f"could not send to the coordinator for {args.idle_timeout:.0f}s (--idle-timeout): "
                             f"it is gone or not reading; exiting")
        if now - last_request > args.idle_timeout:
            raise WorkerExit(f"no request for {args.idle_timeout:.0f}s: the coordinator is gone or idle; exiting")
        _check_parent(args)
