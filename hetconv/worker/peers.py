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
Peers on the same host and network namespace talk over ipc:// where the peer's socket path is
proved reachable (its token file reads back), others over tcp.

A peer's header is never trusted: every SLICE is checked against the plan and the step it serves
before it is matched or held (PeerLinks._admit).
"""
import sys
import time

import numpy as np
import zmq

from hetconv.engine.contract import concat_channels, sum_in_order
from hetconv.transport import protocol
from hetconv.transport.keys import connect_peer
from hetconv.transport.sockets import host_key, ipc_reachable
from hetconv.transport.wire import decode, encode


class StepAbandoned(RuntimeError):
    """The coordinator gave up on the step this worker was in (and will not wait for its reply)."""


PHASES = ("images", "forward", "backward")    # a SLICE's phase


STEP_OPS = ("SLICE", "INPUT", "GRAD")        # what a step reads from its queue; any other op ends it


# A step's micro-batch count is known once its STEP is read; a peer's images that arrive before it
# (a faster peer already in that step) are checked against this ceiling instead. What it costs:
# between steps up to this many images slices per peer may be held, each within the message limit.
MAX_EARLY_MICRO = 256


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


class PeerLinks:
    """The compute thread's sockets to the other workers of the plan, and the step it runs."""

    def __init__(self, ctx, name, shard, requests, send_to_coordinator, keydir="", peer_keys=None,
                 log=None):
        self.ctx, self.name, self.shard = ctx, name, shard
        self.keydir, self.peer_keys = keydir, peer_keys      # CURVE: own keys, and who may push to us
        self.key_owners = {}                     # z85 public key -> the plan's workers holding it (with keys)
        self.requests = requests                 # the compute thread's queue: coordinator and peer messages
        self.send_to_coordinator = send_to_coordinator
        self.log = log or (lambda line: print(f"hetconv-worker: {line}", file=sys.stderr, flush=True))
        self.outboxes = {}                       # peer name -> PUSH socket
        self.order, self.ranges = [name], []
        self.step, self.micros = None, 0         # the step last started under this plan, its micro-batches
        self.held = {}                           # (step, phase, layer, micro, sender) -> array, arrived early
        self.dropped = 0                         # messages refused by _admit, all told
        self.reported = set()                    # the kinds of refusal already logged (once each)
        self.deferred = []                       # a request that ended a step early, to serve next
        self.bytes_sent = 0                      # this step's, sent to peers
        self.wait_s = 0.0                        # this step's, waiting for peers' slices
        self.timeout = 600.0

    def connect(self, fields):
        """PEERS: the plan's workers in order, their endpoints, and the kernel ranges per layer."""
        self.close()
        me = host_key()
        self.name = str(fields["you"])            # the coordinator's name for this worker in its plan
        self.order = [p["name"] for p in fields["peers"]]
        if self.name not in self.order:
            raise ValueError(f"this worker {self.name!r} is not among the plan's workers {self.order}")
        self.ranges = [{w: tuple(r) for w, r in layer.items()} for layer in fields["ranges"]]
        self.timeout = float(fields.get("timeout", 600.0))
        self.step, self.micros, self.held = None, 0, {}    # a new plan: its first step's id comes with its STEP
        others = [p for p in fields["peers"] if p["name"] != self.name]
        if self.keydir:
            keyless = [p["name"] for p in others if not p.get("public_key")]
            if keyless:
                raise ValueError(f"workers {keyless} have no authenticated public key: this worker uses keys "
                                 f"(--curve) and talks only to keyed peers")
            self.peer_keys.allowed = frozenset(str(p["public_key"]) for p in others)
            self.key_owners = {}
            for p in others:                     # workers started with one key folder share a key
                self.key_owners.setdefault(str(p["public_key"]), set()).add(p["name"])
        if fields.get("connect") is False:
            return {"routes": {}}                # keys first: see RemoteEngine._connect_peers
        routes = {}
        for peer in fields["peers"]:
            if peer["name"] == self.name:
                continue
            endpoints = peer["endpoints"]
            same_host = peer.get("host_key") == me
            endpoint = next((e for e in endpoints if e.startswith("ipc://")), None) if same_host else None
            if endpoint and not ipc_reachable(endpoint, peer.get("ipc_token")):
                endpoint = None                  # its path is not this worker's /tmp, or unproved: tcp
            endpoint = endpoint or next(e for e in endpoints if e.startswith("tcp://"))
            push = self.ctx.socket(zmq.PUSH)
            push.linger = 0
            push.sndtimeo = max(1, int(self.timeout * 1000))   # a gone peer fails the step, never blocks it
            if self.keydir:
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
        frames = protocol.pack("SLICE", 0, [array], step=step, phase=phase, layer=layer, micro=micro, sender=self.name)
        self.bytes_sent += sum(len(f) for f in frames)
        try:
            self.outboxes[peer].send_multipart(frames, copy=False)
        except zmq.Again:
            raise TimeoutError(f"step {step}: peer {peer} took no message for {self.timeout:.0f}s: "
                               f"it is gone or stalled") from None

    def _await(self, wanted, step):
        """Block until the messages with keys `wanted` have arrived (or are held); returns their
        arrays by key. Messages for later phases (or the next step's images) that arrive meanwhile
        are held, one per key."""
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
            if msg.op not in STEP_OPS:
                # The coordinator moved on (a worker was lost and the survivors are being
                # reloaded, or it is shutting down): give up this step, serve that request next.
                self.deferred.append(msg)
                raise StepAbandoned(f"step {step} abandoned: the coordinator sent {msg.op} before it ended")
            key = self._admit(msg, running=True)
            if key is None:
                continue
            if key in wanted and key not in got:
                got[key] = msg.arrays[0]
            elif key in got or key in self.held:
                self._drop(msg, "duplicate", f"a second {key[1]} for layer {key[2]}, micro-batch {key[3]}")
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

    def _drop(self, msg, kind, why):
        """Refuse a message: counted, and logged once per kind, so a misbehaving peer cannot
        flood the log. Returns None, what _admit returns for it."""
        self.dropped += 1
        if kind not in self.reported:
            self.reported.add(kind)
            sender = msg.fields.get("sender", "the coordinator") if msg.op == "SLICE" else "the coordinator"
            self.log(f"dropped a {msg.op} from {sender!r:.60}: {why:.200} (further drops of this kind are not reported)")
        return None

    def _admit(self, msg, running):
        """The key (step, phase, layer, micro, sender) of a SLICE, INPUT or GRAD whose every header
        field is what the plan allows, or None (dropped). `running`: during step self.step, its
        own messages and the next step's images are admitted; between steps, only the next step's
        images (any step's while no step has run under this plan: a worker that joins, or a new
        plan, does not know the next step's id until its STEP). Without these checks an unhashable
        field would raise deep inside, a far-future step would evict a real early slice, keys
        outside the plan would be held without bound, and a peer could pose as another peer or as
        the coordinator's INPUT or GRAD."""
        f = msg.fields
        step, micro = f.get("step"), f.get("micro")
        if msg.op == "SLICE":
            phase, layer, sender = f.get("phase"), f.get("layer"), f.get("sender")
        else:
            phase, layer, sender = msg.op, -1, "coordinator"
        if len(msg.arrays) != 1:
            return self._drop(msg, "arrays", f"{len(msg.arrays)} arrays, expected 1")
        if not _is_int(step) or step < 0:
            return self._drop(msg, "step", f"step {step!r} is not a step number")
        if running and step == self.step:
            micros = self.micros
        elif (self.step is None and not running) or (self.step is not None and step == self.step + 1):
            micros = MAX_EARLY_MICRO             # the next step's: only a faster peer's images come early
            if phase != "images":
                return self._drop(msg, "early", f"{phase!r} for step {step} before that step began")
        else:
            late = self.step is not None and step <= self.step
            return self._drop(msg, "step", f"step {step} has ended here (a late slice of an abandoned step)" if late
                              else f"step {step} is neither this plan's current step ({self.step}) nor the next")
        if not _is_int(micro) or not 0 <= micro < micros:
            return self._drop(msg, "micro", f"micro-batch {micro!r} out of range(0, {micros})")
        if msg.op != "SLICE":
            return (step, phase, layer, micro, sender)
        layers = len(self.ranges)
        allowed = {"images": range(-1, 0), "forward": range(0, layers - 1), "backward": range(1, layers)}
        if not isinstance(phase, str) or phase not in PHASES:
            return self._drop(msg, "phase", f"phase {phase!r:.40} is not one of {', '.join(PHASES)}")
        if not _is_int(layer) or layer not in allowed[phase]:
            return self._drop(msg, "layer", f"{phase} layer {layer!r:.40} is outside the plan's {layers} layers")
        if not isinstance(sender, str) or sender == self.name or sender not in self.order:
            return self._drop(msg, "sender", f"sender {sender!r:.60} is not another worker of the plan")
        # With keys the inbox knows which key each connection authenticated (ZAP), so a sender
        # must be a worker holding that key. Workers sharing one key folder (--spawn) cannot be
        # told apart, nor can any sender without keys (loopback, --insecure): there the checks
        # above bound what a peer can do, not whom it claims to be.
        if self.keydir and sender not in self.key_owners.get(getattr(msg, "peer_key", ""), ()):
            return self._drop(msg, "key", f"sender {sender!r} does not hold the key its connection authenticated")
        return (step, phase, layer, micro, sender)

    def hold_early(self, msg):
        """A SLICE (or INPUT, GRAD) the compute thread reads between steps. A peer's slice travels
        on another connection than the coordinator's STEP and can overtake it: a faster peer
        already in step S sends its images before this worker has read STEP S (one run in four
        of the simulated-GPU join test hung on exactly that, when it was dropped here as a left-
        over). Only the next step's images are admitted (_admit), one per key; while that step's
        id is unknown, each sender's newest step's, so no sender can evict another's. start_step
        drops whatever belongs to another step."""
        key = self._admit(msg, running=False)
        if key is None:
            return
        sender = key[4]
        if any(k[4] == sender and k[0] > key[0] for k in self.held):
            return                               # older than what this sender already sent: a left-over
        if key in self.held:
            self._drop(msg, "duplicate", f"a second {key[1]} for step {key[0]}, micro-batch {key[3]}")
            return
        self.held = {k: v for k, v in self.held.items() if k[4] != sender or k[0] == key[0]}
        self.held[key] = msg.arrays[0]

    def start_step(self, step, micros):
        """Forget what was held for other steps (left over from abandoned ones) or for micro-batches
        this step does not have; keep this step's. The step's byte and wait counters start at zero."""
        self.step, self.micros = step, micros
        self.held = {k: v for k, v in self.held.items() if k[0] == step and k[3] < micros}
        self.bytes_sent = 0
        self.wait_s = 0.0

    # ---- the step ------------------------------------------------------------------------------
    def run_step(self, seq, fields):
        """STEP: run every layer forward (and backward when training) over the micro-batches."""
        protocol.check_fields("STEP", fields)
        step, micros, train = int(fields["step"]), int(fields["micro_batches"]), bool(fields["train"])
        wire = self.shard.wire                  # fixed for the plan by its LOADs
        sgd = None if fields.get("sgd") is None else tuple(float(v) for v in fields["sgd"])
        layers = len(self.ranges)
        self.start_step(step, micros)
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
                    self.send_to_coordinator(protocol.pack("FEATURES", seq, [sent], step=step, micro=m))
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
