"""The worker side of the peer-exchange step: conv layers back to back with no coordinator in
between (DESIGN.md, "One training step").

For a step over M micro-batches, a worker
- forward: gets 1/P of each micro-batch's images from the coordinator and all-gathers the rest
  from its peers (so the coordinator's link carries the images once, whatever P is); computes
  its channels of layer l for every micro-batch, sending each slice to every peer as soon as it
  is done (the wire runs while the next micro-batch computes), and builds layer l+1's input from
  its own slice and the peers'; the last layer's slices go to the coordinator (FEATURES);
- backward: gets its slice of dL/dY of the last layer from the coordinator (GRAD); every layer's
  full-size partial dX is cut by the layer below's plan and each piece sent to its owner (a
  reduce-scatter); each worker sums the pieces for its own kernels in plan order, so the result
  does not depend on arrival order and equals the star's sum; each layer's last micro-batch
  applies the step's one SGD update.
Peers on the same host and network namespace talk over ipc://, others over tcp.
"""
import os
import socket
import tempfile
import time
import uuid

import numpy as np

from hetconv.engine import concat_channels, sum_in_order
from hetconv.wire import decode, encode


def host_key():
    """Peers with the same key share a filesystem and a network stack: ipc:// reaches them and is
    faster than tcp. A separate network namespace (an emulated host) gets a key of its own."""
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{socket.gethostname()}/{netns}"


def route_address(coordinator):
    """The local address this host uses to reach the coordinator's endpoint: by default the one
    peers can reach us on too."""
    if not coordinator.startswith("tcp://"):
        return "127.0.0.1"
    hostport = coordinator[len("tcp://"):]
    host = hostport.rsplit(":", 1)[0].strip("[]")
    if host in ("*", "0.0.0.0", "localhost") or host.startswith("127."):
        return "127.0.0.1"
    try:
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            probe.connect((host, 9))           # no packet is sent: this only asks the routing table
            return probe.getsockname()[0]
        finally:
            probe.close()
    except OSError:
        return "127.0.0.1"


def bind_inbox(ctx, address, keydir="", log=print, limit=0):
    """A PULL socket other workers push their slices to, on tcp (address) and on ipc. With a key
    folder it is a CURVE server that admits only the plan's workers (see hetconv.keys.serve_peers;
    what it costs: every feature map is encrypted and authenticated, a few hundred MB/s per core
    with libsodium, against the GB/s a loopback or ipc link moves otherwise). Returns (socket,
    [endpoints] ipc first, authenticator or None, PeerKeys or None)."""
    import zmq
    inbox = ctx.socket(zmq.PULL)
    inbox.linger = 0
    if limit:
        from hetconv.keys import set_message_limit
        set_message_limit(inbox, limit)         # before bind: the listener copies it
    auth = peer_keys = None
    if keydir:
        from hetconv.keys import serve_peers
        auth, peer_keys = serve_peers(ctx, inbox, keydir, log)
    port = inbox.bind_to_random_port(f"tcp://{address}")
    path = os.path.join(tempfile.gettempdir(), f"hetconv-{os.getpid()}-{uuid.uuid4().hex[:8]}.ipc")
    endpoints = [f"tcp://{address}:{port}"]
    try:
        inbox.bind(f"ipc://{path}")
        endpoints.insert(0, f"ipc://{path}")
    except zmq.ZMQError:
        pass                                    # no ipc here: tcp serves every peer
    return inbox, endpoints, auth, peer_keys


class StepAbandoned(RuntimeError):
    """The coordinator gave up on the step this worker was in (and will not wait for its reply)."""


class PeerLinks:
    """The compute thread's sockets to the other workers of the plan, and the step it runs."""

    def __init__(self, ctx, name, shard, requests, send_to_coordinator, protocol, keydir="", peer_keys=None):
        self.ctx, self.name, self.shard = ctx, name, shard
        self.keydir, self.peer_keys = keydir, peer_keys      # CURVE: own keys, and who may push to us
        self.requests = requests                 # the compute thread's queue: coordinator and peer messages
        self.send_to_coordinator = send_to_coordinator
        self.P = protocol
        self.outboxes = {}                       # peer name -> PUSH socket
        self.order, self.ranges = [name], []
        self.held = {}                           # (step, phase, layer, micro, sender) -> array, arrived early
        self.deferred = []                       # a request that ended a step early, to serve next
        self.bytes_sent = 0                      # this step's, sent to peers
        self.wait_s = 0.0                        # this step's, waiting for peers' slices
        self.timeout = 600.0

    def connect(self, fields):
        """PEERS: the plan's workers in order, their endpoints, and the kernel ranges per layer."""
        import zmq
        self.close()
        me = host_key()
        self.name = str(fields["you"])            # the coordinator's name for this worker in its plan
        self.order = [p["name"] for p in fields["peers"]]
        if self.name not in self.order:
            raise ValueError(f"this worker {self.name!r} is not among the plan's workers {self.order}")
        self.ranges = [{w: tuple(r) for w, r in layer.items()} for layer in fields["ranges"]]
        self.timeout = float(fields.get("timeout", 600.0))
        others = [p for p in fields["peers"] if p["name"] != self.name]
        if self.keydir:
            keyless = [p["name"] for p in others if not p.get("public_key")]
            if keyless:
                raise ValueError(f"workers {keyless} have no authenticated public key: this worker uses keys "
                                 f"(--curve) and talks only to keyed peers")
            self.peer_keys.allowed = frozenset(str(p["public_key"]) for p in others)
        if fields.get("connect") is False:
            return {"routes": {}}                # keys first: see RemoteEngine._connect_peers
        routes = {}
        for peer in fields["peers"]:
            if peer["name"] == self.name:
                continue
            endpoints = peer["endpoints"]
            same_host = peer.get("host_key") == me
            endpoint = next((e for e in endpoints if e.startswith("ipc://")), None) if same_host else None
            endpoint = endpoint or next(e for e in endpoints if e.startswith("tcp://"))
            push = self.ctx.socket(zmq.PUSH)
            push.linger = 0
            if self.keydir:
                from hetconv.keys import connect_peer
                connect_peer(push, self.keydir, str(peer["public_key"]))
            push.connect(endpoint)
            self.outboxes[peer["name"]] = push
            routes[peer["name"]] = endpoint
        return {"routes": routes}

    def close(self):
        for sock in self.outboxes.values():
            sock.close(linger=0)
        self.outboxes = {}

    # ---- messages ------------------------------------------------------------------------------
    def _send_peer(self, peer, step, phase, layer, micro, array):
        frames = self.P.pack("SLICE", 0, [array], step=step, phase=phase, layer=layer, micro=micro, sender=self.name)
        self.bytes_sent += sum(len(f) for f in frames)
        self.outboxes[peer].send_multipart(frames, copy=False)

    def _await(self, wanted, step):
        """Block until the messages with keys `wanted` have arrived (or are held); returns their
        arrays by key. Messages for later phases that arrive meanwhile are held."""
        got = {k: self.held.pop(k) for k in list(wanted) if k in self.held}
        deadline = time.monotonic() + self.timeout
        t0 = time.perf_counter()
        while len(got) < len(wanted):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(wanted) - set(got))
                raise TimeoutError(f"step {step}: waited {self.timeout:.0f}s for {missing[:3]} "
                                   f"({len(missing)} missing): a peer or the coordinator is gone")
            try:
                msg = self.requests.get(timeout=min(left, 1.0))
            except Exception:
                continue
            if msg is None:
                raise InterruptedError("worker shutting down")
            key = self._key(msg)
            if key is None:
                # The coordinator moved on (a worker was lost and the survivors are being
                # reloaded, or it is shutting down): give up this step, serve that request next.
                self.deferred.append(msg)
                raise StepAbandoned(f"step {step} abandoned: the coordinator sent {msg.op} before it ended")
            if key[0] != step:
                continue                         # left over from an abandoned step
            if key in wanted:
                got[key] = msg.arrays[0]
            else:
                self.held[key] = msg.arrays[0]
        self.wait_s += time.perf_counter() - t0
        return got

    def _check(self, what, sender, got, expected):
        """A piece from a peer (or the coordinator) whose shape is not what the plan says: the
        step fails with an ERROR naming who sent what, instead of a numpy error deep inside."""
        if tuple(got.shape) != tuple(expected):
            raise ValueError(f"{what} from {sender} has shape {tuple(got.shape)}, the plan expects {tuple(expected)}")
        return got

    def _width(self, layer, worker):
        start, stop = self.ranges[layer][worker]
        return stop - start

    @staticmethod
    def _key(msg):
        f = msg.fields
        if msg.op == "SLICE":
            return (f.get("step"), f.get("phase"), f.get("layer"), f.get("micro"), f.get("sender"))
        if msg.op in ("INPUT", "GRAD"):
            return (f.get("step"), msg.op, -1, f.get("micro"), "coordinator")
        return None

    def hold_early(self, msg):
        """A SLICE (or INPUT, GRAD) the compute thread reads between steps. A peer's slice travels
        on another connection than the coordinator's STEP and can overtake it: a faster peer
        already in step S sends its images before this worker has read STEP S (one run in four
        of the simulated-GPU join test hung on exactly that, when it was dropped here as a left-
        over). Kept by its key, for the newest step seen only: what is held between steps stays
        one step's worth, as during a step, whatever a peer sends. start_step drops whatever
        belongs to another step."""
        key = self._key(msg)
        if key is None or not msg.arrays or not isinstance(key[0], int):
            return
        newest = max((k[0] for k in self.held), default=key[0])
        if key[0] < newest:
            return                               # an older step's, overtaken: the next step drops it anyway
        if key[0] > newest:
            self.held = {}
        self.held[key] = msg.arrays[0]

    def start_step(self, step):
        """Forget what was held for other steps (left over from abandoned ones); keep this step's.
        The step's byte and wait counters start at zero."""
        self.held = {k: v for k, v in self.held.items() if k[0] == step}
        self.bytes_sent = 0
        self.wait_s = 0.0

    # ---- the step ------------------------------------------------------------------------------
    def run_step(self, seq, fields):
        """STEP: run every layer forward (and backward when training) over the micro-batches."""
        step, micros, train = int(fields["step"]), int(fields["micro"]), bool(fields["train"])
        wire = fields.get("wire", "float32")
        sgd = None if fields.get("sgd") is None else tuple(float(v) for v in fields["sgd"])
        layers = len(self.ranges)
        self.start_step(step)
        compute = [0.0] * layers
        others = [w for w in self.order if w != self.name]

        outputs_prev = {}
        # forward: images first, gathered by rows (each worker got 1/P of every micro-batch)
        inputs = {}
        mine = self._await({(step, "INPUT", -1, m, "coordinator") for m in range(micros)}, step)
        for m in range(micros):
            piece = mine[(step, "INPUT", -1, m, "coordinator")]
            if piece.ndim != 4 or piece.shape[1] != self.shard.layers[0].spec.in_channels:
                raise ValueError(f"step {step}: images of micro-batch {m} have shape {piece.shape}, expected "
                                 f"(N, {self.shard.layers[0].spec.in_channels}, H, W)")
            for peer in others:
                self._send_peer(peer, step, "images", -1, m, piece)
        for m in range(micros):
            parts = self._await({(step, "images", -1, m, w) for w in others}, step)
            own = mine[(step, "INPUT", -1, m, "coordinator")]
            rows = [own if w == self.name else
                    self._check(f"step {step}: images of micro-batch {m}", w, parts[(step, "images", -1, m, w)],
                                (parts[(step, "images", -1, m, w)].shape[0],) + own.shape[1:])
                    for w in self.order]
            inputs[m] = decode(np.concatenate(rows, axis=0) if len(rows) > 1 else rows[0], wire)
        for layer in range(layers):
            last = layer == layers - 1
            outputs = {}
            for m in range(micros):
                if layer > 0:
                    parts = self._await({(step, "forward", layer - 1, m, w) for w in others}, step)
                    n, _, hp, wp = outputs_prev[m].shape
                    inputs[m] = concat_channels([
                        outputs_prev[m] if w == self.name else
                        decode(self._check(f"step {step}: layer {layer - 1} output of micro-batch {m}", w,
                                           parts[(step, "forward", layer - 1, m, w)],
                                           (n, self._width(layer - 1, w), hp, wp)), wire)
                        for w in self.order])
                t0 = time.perf_counter()
                y = self.shard.forward(layer, inputs[m], micro=m, keep=train)
                self.shard.device.synchronize()
                compute[layer] += time.perf_counter() - t0
                inputs[m] = None                 # the shard keeps what backward needs
                sent = encode(y, wire)
                if last:
                    self.send_to_coordinator(self.P.pack("FEATURES", seq, [sent], step=step, micro=m))
                else:
                    for peer in others:
                        self._send_peer(peer, step, "forward", layer, m, sent)
                    outputs[m] = decode(sent, wire)      # rounded as the peers see it
            outputs_prev = outputs

        # backward: the last layer's gradient from the coordinator, the rest reduce-scattered
        if train:
            grads = {}
            for layer in reversed(range(layers)):
                pieces = {}
                for m in range(micros):
                    if layer == layers - 1:
                        key = (step, "GRAD", -1, m, "coordinator")
                        grad = decode(self._await({key}, step)[key], wire)   # the device checks its shape
                    else:
                        parts = self._await({(step, "backward", layer + 1, m, w) for w in others}, step)
                        grad = sum_in_order([
                            grads[m] if w == self.name else
                            decode(self._check(f"step {step}: layer {layer + 1} partial dX of micro-batch {m}", w,
                                               parts[(step, "backward", layer + 1, m, w)], grads[m].shape), wire)
                            for w in self.order])
                    t0 = time.perf_counter()
                    dx = self.shard.backward(layer, grad, need_dx=layer > 0, micro=m,
                                             sgd=sgd if m == micros - 1 else None)
                    self.shard.device.synchronize()
                    compute[layer] += time.perf_counter() - t0
                    if layer > 0:                # reduce-scatter by the layer below's kernel ranges
                        below = self.ranges[layer - 1]
                        for peer in others:
                            s, e = below[peer]
                            self._send_peer(peer, step, "backward", layer, m, encode(np.ascontiguousarray(dx[:, s:e]), wire))
                        s, e = below[self.name]
                        pieces[m] = decode(encode(np.ascontiguousarray(dx[:, s:e]), wire), wire)
                grads = pieces
        return "STEP_DONE", [], {"step": step, "layer_compute_s": compute, "compute_s": sum(compute),
                                 "peer_wait_s": self.wait_s, "peer_bytes_sent": self.bytes_sent}
