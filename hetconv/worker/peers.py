"""The worker side of the peer exchange: the plan's links to the other workers, what may arrive
on them, and the exchanges every step shares (DESIGN.md, "One training step").

Each layer of the plan is "model" (kernels split: a worker computes its channels of every image)
or "data" (images split: it computes every channel of its own images). The step itself, for a
chain as for a graph, is worker.graph_step's: each tensor held in a layout among the workers and
moved only where a reader takes it in another (a chain is the graph whose blocks each read the
one before: GraphPass.chain). PeerLinks holds what that step runs on: the PUSH sockets to each
peer (a second connection for weight gradients), the plan's layers (`layer_plans`), the wait for
messages by key (`_await`, which holds what arrives early), the admission of every message
(`_admit`), a block of a tensor sent by parts (`_send_blocks`), the BatchNorm sums and other
all-reduces in plan order (`_bn_reduce`, `_all_reduce`), and the step's updates: a model layer's
as its backward ends, a data layer's dW and db summed over every worker in plan order (by chunks
with more than two) once backward is done, so every copy of the layer stays the same.
Peers on the same host and network namespace talk over ipc:// where the peer's socket path is
proved reachable (its token file reads back), others over tcp.

A peer's header is never trusted: every SLICE is checked against the plan and the step it serves
before it is matched or held (PeerLinks._admit).
"""
import sys
import time

import numpy as np
import zmq

from hetconv.devices.cpu import HostArrays
from hetconv.engine.graph import GraphPass, norm_states_from
from hetconv.engine.contract import sum_in_order
from hetconv.engine.layouts import index_in, meeting
from hetconv.engine.planner import MODES, LayerPlan
from hetconv.net.spec import NetSpec
from hetconv.update import UpdateRule, clip_factor
from hetconv.transport import protocol
from hetconv.transport.keys import connect_peer
from hetconv.transport.sockets import host_key, ipc_reachable
from hetconv.transport.wire import decode, encode
from hetconv.worker.graph_step import run_graph_step


class StepAbandoned(RuntimeError):
    """The coordinator gave up on the step this worker was in (and will not wait for its reply)."""


# A SLICE's phase: feature maps and gradients between layers; a data-parallel layer's weight
# gradients, and its BatchNorms' sums (forward and backward; `micro` is then the op's index in the
# layer's tail); the workers' parts of a global gradient norm (clipping).
PHASES = ("backward", "dweights", "dweights_sum", "bn_forward", "bn_backward", "gradnorm", "gather", "gather_grad")


STEP_OPS = ("SLICE", "INPUT", "GRAD")        # what a step reads from its queue; any other op ends it


# A step's micro-batch count is known once its STEP is read; a peer's slices that arrive before it
# (a faster peer already in that step) are checked against the most micro-batches a step of the
# plan has, as PEERS says (`micro_batches`), and what is held of one peer's next step against a
# byte budget (`early_bytes`): a peer sends ahead at most its part of the first tensor gathered
# (the images, or a data block's output) and a BatchNorm's sums, each at most the run's largest
# array. Without them (a plan set by hand in a test), these defaults.
MAX_EARLY_MICRO = 256
DEFAULT_EARLY_BYTES = 256 << 20


def weight_chunks(flat, workers):
    """A data layer's flattened dW and db cut for their sum among `workers`: with two, whole (each
    sends all of it to the other, 1x its size); with more, one chunk per worker in plan order
    (numpy.array_split), each summed by its worker and then all-gathered: 2 (P - 1) / P of its
    size out of each worker where sending it whole to every peer would be P - 1. The sums are the
    same floats either way: each element is added over the workers in plan order."""
    return [flat] * workers if workers <= 2 else np.array_split(flat, workers)


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
        # peer name -> a second PUSH socket, its own TCP connection, for weight gradients: sent
        # under the blocks below's backward, megabytes of them would otherwise sit ahead of those
        # blocks' small BatchNorm sums on one connection and stall each barrier for the transfer
        self.bulk_outboxes = {}
        self.order, self.ranges = [name], []
        self.layer_plans = []                    # per layer: its mode, kernel ranges and (data) images
        self.graph = None                        # engine.graph.GraphPass the plan's steps run (a chain's too)
        self.summed_layers = frozenset()         # (connect) the model layers whose partial dX is summed
        self.norm_ghost_batch = 0                # images per statistics group of its BatchNorm nodes (PEERS)
        self.step, self.micros = None, 0         # the step last started under this plan, its micro-batches
        self.held = {}                           # (step, phase, layer, micro, sender) -> array, arrived early
        self.early_micros = MAX_EARLY_MICRO      # the most micro-batches a step of the plan has (PEERS)
        self.early_bytes = DEFAULT_EARLY_BYTES   # the most bytes of one peer's next step held before it starts
        self.dropped = 0                         # messages refused by _admit, all told
        self.reported = set()                    # the kinds of refusal already logged (once each)
        self.deferred = []                       # a request that ended a step early, to serve next
        self.bytes_sent = 0                      # this step's, sent to peers
        self.wait_s = 0.0                        # this step's, waiting for peers' slices
        self.trace = None                        # graph_step.StepTrace of a step the coordinator asked to trace
        self.timeout = 600.0

    def connect(self, fields, arrays=()):
        """PEERS: the plan's workers in order, their endpoints, and the kernel ranges per layer;
        for a graph with BatchNorms between its blocks, their states (`arrays`, as `norms` names
        them)."""
        self.close()
        me = host_key()
        self.name = str(fields["you"])            # the coordinator's name for this worker in its plan
        self.order = [p["name"] for p in fields["peers"]]
        if self.name not in self.order:
            raise ValueError(f"this worker {self.name!r} is not among the plan's workers {self.order}")
        self.ranges = [{w: tuple(r) for w, r in layer.items()} for layer in fields["ranges"]]
        self.layer_plans = self._layer_plans(fields)
        self.graph = self._graph(fields.get("graph"))
        # the model layers whose partial dX the workers sum (their input takes a gradient)
        self.summed_layers = frozenset(st.block for st in self.graph.steps if st.kind == "block"
                                       and self.graph.requires[st.inputs[0]] and self.layer_plans[st.block].mode == "model")
        self.norm_ghost_batch = 0                # images per statistics group of the graph's BatchNorm nodes
        if self.graph is not None and self.graph.norms:
            self.graph.load_norms(self._norm_states(fields, arrays), fields.get("optimizer"))
            self.norm_ghost_batch = fields.get("bn_ghost_batch")
        self.timeout = float(fields.get("timeout", 600.0))
        self.early_micros, self.early_bytes = self._early_bounds(fields)
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
            for outboxes in (self.outboxes, self.bulk_outboxes):
                push = self.ctx.socket(zmq.PUSH)
                push.linger = 0
                push.sndtimeo = max(1, int(self.timeout * 1000))   # a gone peer fails the step, never blocks it
                if self.keydir:
                    connect_peer(push, self.keydir, str(peer["public_key"]))
                push.connect(endpoint)
                outboxes[peer["name"]] = push
            routes[peer["name"]] = endpoint
        return {"routes": routes}

    def _graph(self, stored):
        """PEERS' `graph`: the network's stored form where it is a graph (None for a chain) ->
        the GraphPass this worker runs its steps with (a chain's: GraphPass.chain), checked
        against the plan's layers."""
        if stored is None:
            return GraphPass.chain(len(self.ranges))
        if not isinstance(stored, dict):
            raise ValueError(f"PEERS graph is {type(stored).__name__}: expected the network's stored form")
        spec = NetSpec.from_json(stored)
        if spec.is_chain():
            raise ValueError("PEERS graph is a chain: a chain's step needs no graph")
        blocks = spec.conv_layers()
        if len(blocks) != len(self.ranges) or any(b.kernels != lp.kernels for b, lp in zip(blocks, self.layer_plans)):
            raise ValueError(f"PEERS graph has conv blocks of {[b.kernels for b in blocks]} kernels, the plan's layers "
                             f"{[lp.kernels for lp in self.layer_plans]}")
        return GraphPass(spec, HostArrays())

    @staticmethod
    def _norm_states(fields, arrays):
        """PEERS' BatchNorm node states (`norms` naming `arrays`), its `optimizer` and
        `bn_ghost_batch` checked."""
        if not isinstance(fields.get("optimizer"), str):
            raise ValueError(f"PEERS optimizer {fields.get('optimizer')!r}: expected the run's optimizer by name")
        ghost = fields.get("bn_ghost_batch")
        if isinstance(ghost, bool) or not isinstance(ghost, int) or ghost < 0 or ghost == 1:
            raise ValueError(f"PEERS bn_ghost_batch {ghost!r}: expected 0 (the whole batch) or at least 2")
        try:
            return norm_states_from(fields.get("norms"), list(arrays))
        except ValueError as e:
            raise ValueError(f"PEERS {e}") from None

    def norm_states_reply(self):
        """FETCH with `norms`: each BatchNorm node's state, every array after the other, and their names."""
        states = self.graph.norm_states() if self.graph is not None else []
        return "SHARD", [a for state in states for a in state.values()], {"layer": -1, "names": [],
                                                                          "norms": [list(s) for s in states]}

    @staticmethod
    def _early_bounds(fields):
        """PEERS' `micro_batches` (>= 1) and `early_bytes` (> 0), checked, or the defaults where
        absent. The count alone bounds nothing (a run may cut a batch into as many pieces as it has
        images): the byte budget does."""
        micros, early = fields.get("micro_batches", MAX_EARLY_MICRO), fields.get("early_bytes", DEFAULT_EARLY_BYTES)
        if not _is_int(micros) or micros < 1:
            raise ValueError(f"PEERS micro_batches {micros!r:.40}: expected the most micro-batches a step has, >= 1")
        if not _is_int(early) or early < 1:
            raise ValueError(f"PEERS early_bytes {early!r:.40}: expected a positive number of bytes")
        return micros, early

    def _layer_plans(self, fields):
        """PEERS' per-layer `modes` (absent: every layer model) and, for a data layer, `images`
        (worker -> images of a batch) -> a LayerPlan per layer, checked: every layer names the
        plan's workers, a data layer gives each of them every kernel and images >= 0."""
        layers = len(self.ranges)
        modes = fields.get("modes")
        modes = ["model"] * layers if modes is None else modes
        if not isinstance(modes, list) or len(modes) != layers or any(m not in MODES for m in modes):
            raise ValueError(f"PEERS modes {modes!r:.80}: expected one of {', '.join(MODES)} for each of the plan's "
                             f"{layers} layers")
        images = fields.get("images")
        images = [{}] * layers if images is None else images
        if not isinstance(images, list) or len(images) != layers:
            raise ValueError(f"PEERS images {images!r:.80}: expected one map per layer ({layers})")
        plans = []
        for li, (mode, ranges, counts) in enumerate(zip(modes, self.ranges, images)):
            if sorted(ranges) != sorted(self.order) or not all(
                    len(r) == 2 and _is_int(r[0]) and _is_int(r[1]) and 0 <= r[0] < r[1] for r in ranges.values()):
                raise ValueError(f"PEERS ranges of layer {li} {ranges!r:.80}: expected [start, stop) of kernels for "
                                 f"each of the plan's workers {self.order}")
            kernels = max(stop for _, stop in ranges.values())
            if mode == "data":
                if not isinstance(counts, dict) or sorted(counts) != sorted(self.order) or not all(
                        _is_int(v) and v >= 0 for v in counts.values()) or sum(counts.values()) < 1:
                    raise ValueError(f"PEERS images of data layer {li} {counts!r:.80}: expected images >= 0 for each "
                                     f"of the plan's workers {self.order}, at least one in all")
                if any(r != (0, kernels) for r in ranges.values()):
                    raise ValueError(f"PEERS ranges of data layer {li} {ranges!r:.80}: every worker holds every kernel")
                counts = {w: counts[w] for w in self.order}     # image_ranges cuts rows in plan order
            else:
                bounds = [ranges[w] for w in self.order]
                if bounds[0][0] != 0 or any(a[1] != b[0] for a, b in zip(bounds, bounds[1:])):
                    raise ValueError(f"PEERS ranges of model layer {li} {ranges!r:.80}: expected contiguous kernel "
                                     f"ranges from 0 in the plan's worker order {self.order}")
                counts = {}
            plans.append(LayerPlan(li, kernels, ranges, {}, mode, counts))
        data = [lp for lp in plans if lp.mode == "data"]
        if any(lp.images != data[0].images for lp in data[1:]):
            raise ValueError(f"PEERS images {images!r:.120}: the data layers split the images differently; the step "
                             f"holds a tensor in one split of rows between them, so every data layer takes the same")
        return plans

    def close(self):
        for sock in [*self.outboxes.values(), *self.bulk_outboxes.values()]:
            sock.close(linger=0)
        self.outboxes, self.bulk_outboxes = {}, {}

    # ---- messages ------------------------------------------------------------------------------
    def _send_peer(self, peer, step, phase, layer, micro, array, bulk=False):
        """One SLICE to `peer`; `bulk` (weight gradients) on the connection of their own."""
        frames = protocol.pack("SLICE", 0, [array], step=step, phase=phase, layer=layer, micro=micro, sender=self.name)
        self.bytes_sent += sum(len(f) for f in frames)
        try:
            (self.bulk_outboxes if bulk else self.outboxes)[peer].send_multipart(frames, copy=False)
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
            if msg.op == "GRAD" and "head_sum_of_squares" in msg.fields:
                self._note_head_norm(key[0], msg.fields["head_sum_of_squares"])
            if key in wanted and key not in got:
                got[key] = msg.arrays[0]
            elif key in got or key in self.held:
                self._drop(msg, "duplicate", f"a second {key[1]} for layer {key[2]}, micro-batch {key[3]}")
            elif key[0] == step or self._within_early_budget(msg, key):
                self.held[key] = msg.arrays[0]
        t1 = time.perf_counter()
        self.wait_s += t1 - t0
        if self.trace is not None and wanted:
            _, phase, layer, micro, _ = min(wanted, key=str)
            self.trace.wait(phase, layer, micro, t0, t1)
        return got

    def _note_head_norm(self, step, value):
        """The coordinator's part of a step's global gradient norm, from its last GRAD."""
        if not (isinstance(value, float) and np.isfinite(value) and value >= 0):
            raise ValueError(f"step {step}: GRAD's head_sum_of_squares {value!r:.60}: expected a finite number >= 0")
        self.head_norms = {step: value}

    def _head_sum_of_squares(self, step):
        value = getattr(self, "head_norms", {}).get(step)
        if value is None:
            raise ValueError(f"step {step}: clipping asks for the global gradient norm, but the coordinator's GRAD "
                             f"carried no head_sum_of_squares")
        return value

    def _check(self, what, sender, got, expected):
        """A piece from a peer (or the coordinator) whose shape is not what the plan says: the
        step fails with an ERROR naming who sent what, instead of a numpy error deep inside."""
        if tuple(got.shape) != tuple(expected):
            raise ValueError(f"{what} from {sender} has shape {tuple(got.shape)}, the plan expects {tuple(expected)}")
        return got

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
        early = False
        if running and step == self.step:
            micros = self.micros
        elif (self.step is None and not running) or (self.step is not None and step == self.step + 1):
            micros = self.early_micros           # the next step's, from a peer that began it first
            early = True
        else:
            late = self.step is not None and step <= self.step
            return self._drop(msg, "step", f"step {step} has ended here (a late slice of an abandoned step)" if late
                              else f"step {step} is neither this plan's current step ({self.step}) nor the next")
        if msg.op == "SLICE" and phase in ("bn_forward", "bn_backward") and _is_int(layer) \
                and 0 <= layer < len(self.layer_plans):
            micros = len(self.shard.layers[layer].spec.tail) if layer in self.shard.layers else 0
        elif msg.op == "SLICE" and phase in ("dweights", "dweights_sum", "gradnorm"):
            micros = 1
        if not _is_int(micro) or not 0 <= micro < micros:
            return self._drop(msg, "micro", f"micro-batch {micro!r} out of range(0, {micros})")
        if msg.op != "SLICE":
            if early:                            # the coordinator sends a step's STEP before its INPUT and GRAD
                return self._drop(msg, "early", f"{phase!r} for step {step} before that step began")
            return (step, phase, layer, micro, sender)
        layers = len(self.ranges)
        data_layers = [lp.layer for lp in self.layer_plans if lp.mode == "data"]
        # tensors move between layouts (engine/layouts.py) by GraphPass.conversion_key, and a
        # model block's partial dX is summed into its input's (graph_step.LayoutBlocks)
        conversions = range(self.graph.conversion_keys()) if self.graph is not None else range(0)
        allowed = {"backward": self.summed_layers, "dweights": data_layers,
                   "dweights_sum": data_layers if len(self.order) > 2 else [], "bn_forward": data_layers,
                   "bn_backward": data_layers, "gradnorm": [-1], "gather": conversions, "gather_grad": conversions}
        if not isinstance(phase, str) or phase not in PHASES:
            return self._drop(msg, "phase", f"phase {phase!r:.40} is not one of {', '.join(PHASES)}")
        # What can precede this worker's own start of a step: a peer that began it first computes
        # alone up to its first exchange, which sends a gather or a BatchNorm's sums. Backward
        # needs every worker's features first.
        if early and phase not in ("bn_forward", "gather"):
            return self._drop(msg, "early", f"{phase!r} for step {step} before that step began")
        if not _is_int(layer) or layer not in allowed[phase]:
            return self._drop(msg, "layer", f"{phase} layer {layer!r:.40} is outside the plan's {layers} layers"
                              + (" (or not a data-parallel one)" if phase == "dweights" else ""))
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
        if self._within_early_budget(msg, key):
            self.held[key] = msg.arrays[0]

    def _within_early_budget(self, msg, key):
        """Whether holding `msg` (key `key`, of a step that has not started here) keeps what its
        sender has sent ahead within early_bytes; dropped (False) otherwise."""
        ahead = sum(v.nbytes for k, v in self.held.items() if k[4] == key[4] and k[0] == key[0])
        if ahead + msg.arrays[0].nbytes <= self.early_bytes:
            return True
        self._drop(msg, "early-bytes", f"{ahead + msg.arrays[0].nbytes} bytes for step {key[0]} before it began here, "
                                       f"over the {self.early_bytes} a peer can send ahead")
        return False

    def start_step(self, step, micros):
        """Forget what was held for other steps (left over from abandoned ones) or for micro-batches
        this step does not have; keep this step's. The step's byte and wait counters start at zero."""
        self.step, self.micros = step, micros
        self.held = {k: v for k, v in self.held.items() if k[0] == step and k[3] < micros}
        self.bytes_sent = 0
        self.wait_s = 0.0
        self.trace = None

    # ---- the step ------------------------------------------------------------------------------
    def _sizes(self, fields, step, micros):
        """STEP's `sizes` (images in each micro-batch), checked, or None where it is not given: a
        data-parallel first layer's worker gets only its own rows, so it learns them here."""
        sizes = fields.get("sizes")
        if sizes is None:
            return None
        if not isinstance(sizes, list) or len(sizes) != micros or not all(_is_int(n) and n >= 1 for n in sizes):
            raise ValueError(f"step {step}: STEP field 'sizes' must list {micros} image counts >= 1, got {sizes!r:.80}")
        return sizes

    def _send_blocks(self, step, phase, layer, m, array, held, receivers, wire):
        """Send each peer the parts of `array` (this worker's blocks `held` of a tensor, side by
        side: engine/layouts.pieces) that lie in the peer's blocks in `receivers`; returns the
        array as the peers see it (rounded by the wire)."""
        sent = encode(array, wire)
        self._send_encoded(step, phase, layer, m, sent, held, receivers)
        return decode(sent, wire)

    def _send_encoded(self, step, phase, layer, m, sent, held, receivers):
        """_send_blocks of an array already in the wire's dtype (`sent`): to each peer in
        `receivers` ({peer: the blocks it needs}) one message, every part where `held` meets its
        blocks side by side along the channels (layouts.meeting's order); a peer missing from
        `receivers`, or whose blocks meet none of `held`, is sent nothing."""
        for peer in self.order:
            if peer == self.name or peer not in receivers:
                continue
            parts = [sent[index_in(part, held, i)] for part, i, _ in meeting(held, receivers[peer])]
            if parts:
                self._send_peer(peer, step, phase, layer, m, np.ascontiguousarray(
                    parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)))

    def _all_reduce(self, step, phase, layer, index, local):
        """Every worker's float64 `local` (the same shape everywhere), summed in plan order: the same
        total on every worker whatever order the parts arrive in. One message to each peer."""
        others = [w for w in self.order if w != self.name]
        for peer in others:
            self._send_peer(peer, step, phase, layer, index, local)
        parts = self._await({(step, phase, layer, index, w) for w in others}, step)
        total = np.zeros_like(local)
        for w in self.order:
            part = local if w == self.name else self._check(f"step {step}: {phase} of layer {layer}", w,
                                                            parts[(step, phase, layer, index, w)], local.shape)
            if part.dtype != np.float64:
                raise ValueError(f"step {step}: {phase} of layer {layer} from {w} is {part.dtype}, expected float64")
            total += part
        return total

    def _bn_reduce(self, step, layer, waited):
        """A data-parallel layer's BatchNorm sums per statistics group, and the groups' counts: each
        worker's (over its images) added among all. The seconds it takes are added to `waited[0]`
        (a barrier: waiting for the slowest worker is not this worker's compute, and counted as
        compute it would hide from the re-split which worker is slower)."""
        def reduce(key, sums, counts):
            phase, index = key
            t0 = time.perf_counter()
            flat = self._all_reduce(step, phase, layer, index, np.append(sums.ravel(), counts.astype(np.float64)))
            waited[0] += time.perf_counter() - t0
            return flat[:sums.size].reshape(sums.shape), np.rint(flat[sums.size:]).astype(np.int64)
        return reduce

    def run_step(self, seq, fields):
        """STEP: every block forward (and backward when training) over the micro-batches, each
        tensor held in a layout among the workers (worker.graph_step: a chain is the graph whose
        blocks each read the one before)."""
        protocol.check_fields("STEP", fields)
        step, micros, train = int(fields["step"]), int(fields["micro_batches"]), bool(fields["train"])
        rule = None if fields["update"] is None else UpdateRule.from_json(fields["update"])
        sizes = self._sizes(fields, step, micros)
        self.start_step(step, micros)
        return "STEP_DONE", [], run_graph_step(self, seq, fields, step, micros, train, rule, sizes)

    def _after_backward(self, step, layer, rule, clip, deferred, updates, compute):
        """What follows a layer's last backward: a model layer's update (after its last dX has
        left: the peers receive it while this worker updates; deferred to `deferred` where the
        update clips, as the factor needs every gradient of the step first); a data layer's dW
        and db to every peer, into `updates` (the sums are made once backward is done)."""
        if self.layer_plans[layer].mode == "model":
            if clip:
                deferred.append(layer)
                return
            t0 = time.perf_counter()
            self.shard.update(layer, rule)
            self.shard.device.synchronize()
            compute[layer] += time.perf_counter() - t0
            return
        dw, db = self.shard.take_gradients(layer)
        flat = np.concatenate([dw.ravel(), db.ravel()])
        chunks = weight_chunks(flat, len(self.order))
        for i, peer in enumerate(self.order):
            if peer != self.name:
                self._send_peer(peer, step, "dweights", layer, 0, np.ascontiguousarray(chunks[i]), bulk=True)
        updates.append((layer, flat, dw.shape, db.shape))

    def _apply_updates(self, step, rule, deferred, updates, compute):
        """The data layers' weight gradients summed over every worker in plan order and applied;
        where the update clips, the global norm (the coordinator's part from its last GRAD) and
        the deferred model layers' updates scaled by it; then a graph's BatchNorm nodes' update,
        the same arithmetic on every worker's copy. -> STEP_DONE's extra fields."""
        norms = self.graph is not None and bool(self.graph.norms)
        others = [w for w in self.order if w != self.name]
        summed, me, chunked = [], self.order.index(self.name), len(self.order) > 2
        own, chunks = {}, {}                      # layer -> this worker's chunk of the sum; its chunks
        for layer, flat, w_shape, b_shape in updates:
            chunks[layer] = weight_chunks(flat, len(self.order))
            chunk = chunks[layer][me]
            keys = {(step, "dweights", layer, 0, w) for w in others}
            parts = self._await(keys, step)
            own[layer] = sum_in_order([chunk if w == self.name else
                                       decode(self._check(f"step {step}: layer {layer} weight gradients", w,
                                                          parts[(step, "dweights", layer, 0, w)], chunk.shape),
                                              "float32")
                                       for w in self.order])
            if chunked:                           # the summed chunk to every other worker (an all-gather)
                for peer in others:
                    self._send_peer(peer, step, "dweights_sum", layer, 0, own[layer], bulk=True)
        for layer, flat, w_shape, b_shape in updates:
            total = own[layer]
            if chunked:
                parts = self._await({(step, "dweights_sum", layer, 0, w) for w in others}, step)
                total = np.concatenate([own[layer] if w == self.name else decode(self._check(
                    f"step {step}: layer {layer} summed weight gradients", w, parts[(step, "dweights_sum", layer, 0, w)],
                    chunks[layer][i].shape), "float32") for i, w in enumerate(self.order)])
            size = int(np.prod(w_shape))
            summed.append((layer, total[:size].reshape(w_shape), total[size:]))
        done = {}
        if rule.max_norm > 0:
            # this worker's part of the global norm: its slices of the model layers, and (counted once,
            # by the plan's first worker) the data layers' sums, which every worker holds alike
            local = sum(self.shard.sum_of_squares(layer) for layer in deferred)
            if self.name == self.order[0]:
                local += sum(self.shard.sum_of_squares(layer, given=(dw, db)) for layer, dw, db in summed)
                local += self.graph.norm_sum_of_squares() if norms else 0.0
            workers = self._all_reduce(step, "gradnorm", -1, 0, np.array([local], np.float64))[0]
            total = self._head_sum_of_squares(step) + workers
            done["sum_of_squares"] = float(total)
            rule = rule.scaled(clip_factor(total, rule.max_norm))
            for layer in deferred:
                t0 = time.perf_counter()
                self.shard.update(layer, rule)
                self.shard.device.synchronize()
                compute[layer] += time.perf_counter() - t0
        for layer, dw, db in summed:
            t0 = time.perf_counter()
            self.shard.apply_update(layer, dw, db, rule)
            self.shard.device.synchronize()
            compute[layer] += time.perf_counter() - t0
        if norms:
            self.graph.update_norms(rule)
        return done
