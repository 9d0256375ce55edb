"""The cost model: a step's time, speedup and wire bytes, predicted from calibrated device timings,
layer shapes, batch size and link bandwidth — before anything is bought or wired. The
`hetconv-plan` command (hetconv/cli/plan.py) measures what this model needs and prints it.

The model of one step, phase by phase (each conv layer's forward, then each one's backward):
- Device time: from calibration, per layer and call (one per micro-batch), seconds = call +
  call_per_kernel * k + batch * (fixed + per_kernel * k): bilinear in kernels and images. Four
  calibration points (k and k/2 kernels, each on the batch and on half of it) fit it exactly.
  Fixed is what every shard pays whatever its share (reading and expanding the input); the call
  terms are what a call pays whatever its batch, which is what splitting a step into
  micro-batches adds. call_per_kernel is large where the kernels' side of a call is streamed
  once per call (the FFT path's kernel spectra and its dW in the frequency domain): there two
  workers each running every kernel on half the images (a data-parallel layer) pay nearly twice
  what each pays for half the kernels on every image. Once per step each device also
  pays the SGD update of the kernels it holds, and per micro-batch after the first the add of its
  dW into the step's sum; both are timed in calibration.
- Wire, --exchange star (predict_step): all traffic goes through the coordinator's one link.
  Requests leave one after another (the layer input is sent to every worker: a broadcast costs n
  sends); a worker starts when its request has arrived; replies come back over the same link in
  the order they are ready.
- Wire, --exchange peer (engine/steptasks.py: predict_peer_step): every host its own link to a
  switch; the step's tasks as data (each worker's compute thread, each link's two directions and
  the coordinator, micro-batch by micro-batch, following worker.graph_step), priced as a
  critical path through them. Any network: a chain is priced as the graph whose
  blocks each read the one before (chain_shape), so one network is priced the same however it
  was written.
- Wire CPU (peer exchange): where hosts have no core to spare for their network, moving a byte
  costs `Link.host_cpu_s_per_byte` of the compute cores at both ends; micro-batches overlap the
  wire with compute, so there it is paid as slower compute (the star overlaps nothing: its wire
  CPU falls in time the devices wait anyway, and is not charged).
- Coordinator: FC layers and loss, and in the star exchange concatenating channel slices and
  summing partial dX, measured on this host (engine/measure.measure_coordinator_s): in the star,
  added once per step (the workers are idle meanwhile); in the peer step, the head per micro-batch
  on the timeline (the workers join the blocks themselves, a pass over a tensor each, not priced).
Everything here is pure: no clocks, no sockets, no devices (those are in hetconv/cli/plan.py).
"""
from dataclasses import asdict, dataclass
import math
import re

from hetconv.geometry import layer_input_shapes

FLOAT_BYTES = 4


@dataclass(frozen=True)
class LayerCost:
    """One device on one conv layer: seconds = call + call_per_kernel * kernels + batch * (fixed +
    per_kernel * kernels) for each call (one per micro-batch). `call` and `call_per_kernel`: what
    a call costs whatever its batch (Python and message handling; reordering the weights, writing
    dW, streaming the FFT path's kernel spectra); fixed and per_kernel are per image. Profiles
    saved before these were measured load with 0 for them."""
    forward_fixed_s: float
    forward_per_kernel_s: float
    backward_fixed_s: float
    backward_per_kernel_s: float
    forward_call_s: float = 0.0
    backward_call_s: float = 0.0
    update_per_kernel_s: float = 0.0        # the step's SGD update, once per step
    accumulate_per_kernel_s: float = 0.0    # a micro-batch's dW added into the step's sum
    forward_call_per_kernel_s: float = 0.0
    backward_call_per_kernel_s: float = 0.0
    # the part of a backward call that comes before its dX is handed over: 1 where dX comes
    # with dW at the end (the GEMM paths), less where the path computes dX first (FFT, oneDNN's
    # direct convolutions) and dX travels while dW computes
    backward_dx_share: float = 1.0

    def backward_dx_s(self, kernels, batch):
        """Seconds of a backward call until its dX is handed over."""
        return self.backward_dx_share * self.backward_s(kernels, batch)

    def update_s(self, kernels):
        return self.update_per_kernel_s * kernels

    def accumulate_s(self, kernels):
        return self.accumulate_per_kernel_s * kernels

    def backward_in_step_s(self, kernels, batch, micro, micros):
        """Backward of micro-batch `micro` of `micros`, with what the step adds to it on the
        device: the gradient sum from the second micro-batch on, the update after the last."""
        return (self.backward_s(kernels, batch) + (self.accumulate_s(kernels) if micro > 0 else 0.0)
                + (self.update_s(kernels) if micro == micros - 1 else 0.0))

    def forward_s(self, kernels, batch):
        return (self.forward_call_s + self.forward_call_per_kernel_s * kernels
                + batch * (self.forward_fixed_s + self.forward_per_kernel_s * kernels))

    def backward_s(self, kernels, batch):
        return (self.backward_call_s + self.backward_call_per_kernel_s * kernels
                + batch * (self.backward_fixed_s + self.backward_per_kernel_s * kernels))

    def call_s(self, kernels):
        """Forward + backward seconds of a call of `kernels` kernels whatever its images."""
        return (self.forward_call_s + self.backward_call_s
                + kernels * (self.forward_call_per_kernel_s + self.backward_call_per_kernel_s))

    def step_line(self, batch, calls=1):
        """(fixed, per_kernel) seconds of forward + backward for a step of `batch` images in
        `calls` calls: the planner's cost line."""
        return (calls * (self.forward_call_s + self.backward_call_s)
                + batch * (self.forward_fixed_s + self.backward_fixed_s),
                batch * (self.forward_per_kernel_s + self.backward_per_kernel_s)
                + calls * (self.forward_call_per_kernel_s + self.backward_call_per_kernel_s)
                + self.update_per_kernel_s + (calls - 1) * self.accumulate_per_kernel_s)

    def image_line(self, kernels, calls=1):
        """(fixed, per_image) seconds of forward + backward of all `kernels` for a step in `calls`
        calls, as a line in its images: what a device pays in a data-parallel layer, whose share
        is images, not kernels. The update and the micro-batches' gradient sums are of every
        kernel, whatever the share of images."""
        return (calls * self.call_s(kernels) + self.update_s(kernels) + (calls - 1) * self.accumulate_s(kernels),
                self.forward_fixed_s + self.backward_fixed_s
                + kernels * (self.forward_per_kernel_s + self.backward_per_kernel_s))

    @classmethod
    def fit(cls, timing):
        """From a calibration timing {batch, kernels: [k1, k2], forward_s: [..], backward_s: [..],
        and optionally half_batch: {batch, kernels: [k1, k2] (or k2 alone), forward_s, backward_s}}:
        the same kernel counts on half the images (or the smaller count alone, which leaves
        call_per_kernel at 0)."""
        batch = timing["batch"]
        ks = timing["kernels"]
        half = timing.get("half_batch")
        fitted = {}
        for phase in ("forward", "backward"):
            ts = timing[f"{phase}_s"]
            if half and isinstance(half["kernels"], list) and half["batch"] < batch:
                at_half = _fit_line(half["kernels"], half[f"{phase}_s"])
                call, per_image = _fit_batch(batch, _fit_line(ks, ts), half["batch"], at_half)
            else:
                call = (_fit_call(batch, ts[-1], half["batch"], half[f"{phase}_s"]), 0.0) if half else (0.0, 0.0)
                fixed, per_kernel = _fit_line(ks, [t - call[0] for t in ts])
                per_image = (fixed / batch, per_kernel / batch)
            fitted.update({f"{phase}_fixed_s": per_image[0], f"{phase}_per_kernel_s": per_image[1],
                           f"{phase}_call_s": call[0], f"{phase}_call_per_kernel_s": call[1]})
        k_update = max(1, int(timing.get("update_kernels", 1)))
        return cls(**fitted, update_per_kernel_s=timing.get("update_s", 0.0) / k_update,
                   accumulate_per_kernel_s=timing.get("accumulate_s", 0.0) / k_update,
                   backward_dx_share=_dx_share(timing))


def _dx_share(timing):
    """The mean over the full batch's points of backward's time until dX was handed over, as a
    fraction of the whole backward (1 where calibration did not time it: a layer with no dX, a
    record from before)."""
    shares = [min(1.0, max(0.0, dx / total)) for dx, total in zip(timing.get("backward_dx_s") or (),
                                                                  timing["backward_s"]) if total > 0]
    return sum(shares) / len(shares) if shares else 1.0


def _fit_line(ks, ts):
    """(fixed, per_kernel) through the calibration points; the fixed part is never negative
    (noise can make the two points disagree) and never more than the smallest measurement."""
    if len(ks) < 2 or ks[0] == ks[1]:
        return 0.0, ts[0] / ks[0]
    per_kernel = (ts[0] - ts[1]) / (ks[0] - ks[1])
    fixed = ts[0] - per_kernel * ks[0]
    if per_kernel <= 0 or fixed < 0:
        return 0.0, ts[0] / ks[0]
    return fixed, per_kernel


def _fit_call(batch, t_batch, half, t_half):
    """The intercept of time against batch through (half, t_half) and (batch, t_batch), the same
    kernels: never negative (noise), never more than half of the smaller call's time, 0 where the
    two batches are equal."""
    if half >= batch or half < 1:
        return 0.0
    per_image = (t_batch - t_half) / (batch - half)
    call = t_half - per_image * half
    return min(max(0.0, call), 0.5 * t_half)


def _fit_batch(batch, line, half, half_line):
    """((call, call_per_kernel), (fixed, per_kernel) per image) from the kernel lines (intercept,
    slope) at `batch` and at `half` images: each coefficient of the line is a call part plus
    images times a per-image part. The line at the full batch is always kept (what a whole-batch
    call costs is measured there; micro-batches and data layers read the split). Noise can make
    a part negative: a negative call part is 0; where half the images took no less than all of
    them, the call gets at most half, as _fit_call gives it, so that a device's cost still grows
    with its images (a data layer's images are split by that growth)."""
    parts = []
    for at_batch, at_half in zip(line, half_line):
        per_image = (at_batch - at_half) / (batch - half)
        if per_image <= 0:
            per_image = (at_batch - 0.5 * min(at_half, at_batch)) / batch
        call = at_batch - per_image * batch
        if call < 0:
            call, per_image = 0.0, at_batch / batch
        parts.append((call, per_image))
    (call, fixed), (call_per_kernel, per_kernel) = parts
    return (call, call_per_kernel), (fixed, per_kernel)


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    device: str
    description: str
    layers: tuple                     # LayerCost per conv layer
    precision: str = "fp32"           # what its conv GEMMs ran in (conv_precision.computed_precision)
    speeds: tuple = ()                # kernels/s per layer measured at calibration (what a split falls
                                      # back to where the cost lines cannot split), () where not kept

    def to_json(self):
        return {"name": self.name, "device": self.device, "description": self.description,
                "layers": [asdict(lc) for lc in self.layers], "precision": self.precision,
                "speeds": list(self.speeds)}

    @classmethod
    def from_json(cls, d):
        """The inverse of to_json; a profile saved without precision or speeds computes in fp32
        and has none."""
        precision, speeds = d.get("precision", "fp32"), d.get("speeds", [])
        if not isinstance(precision, str):
            raise TypeError(f"precision {precision!r}, expected text such as fp32 or bf16")
        if not (isinstance(speeds, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                 and math.isfinite(v) and v > 0 for v in speeds)):
            raise TypeError(f"speeds {speeds!r:.200}, expected positive kernels/s per layer")
        return cls(d["name"], d["device"], d.get("description", ""), tuple(LayerCost(**lc) for lc in d["layers"]),
                   precision, tuple(float(v) for v in speeds))


def profiles_from_calibration(calibration):
    """RemoteEngine.calibration -> {worker: DeviceProfile}, each with the precision its worker
    computed in and the speeds it measured."""
    return {name: DeviceProfile(name, c["device"], c.get("description", ""),
                                tuple(LayerCost.fit(t) for t in c["layers"]), c.get("precision", "fp32"),
                                tuple(c.get("speeds", ())))
            for name, c in calibration.items()}


@dataclass(frozen=True)
class Link:
    """A host's link: bytes per second, a per-message latency, and the CPU seconds per byte that
    moving data costs the hosts at its two ends on the cores their devices compute on (sender and
    receiver together: the kernel's network stack, ZeroMQ's I/O thread, the receive thread's
    copies). That last is 0 where a host has cores to spare for its network (a worker of one
    thread on a larger machine); where it has none, a transfer that overlaps compute slows the
    compute down. bench/bandwidth.py measures it on its emulated hosts, which share two cores."""
    bytes_per_s: float
    latency_s: float = 50e-6
    name: str = ""
    host_cpu_s_per_byte: float = 0.0


# What a full TCP segment carries over what it occupies on the link: 1448 bytes of payload in a
# 1500-byte MTU (20 IP + 20 TCP + 12 timestamp option), plus the frame around it. On Ethernet the
# frame adds 38 (header 14, FCS 4, preamble 8, inter-frame gap 12), so 1 Gbit/s carries 941
# Mbit/s of payload; tc's tbf, which bench/bandwidth.py shapes with, counts 14 (the header).
TCP_PAYLOAD = 1448
ETHERNET_FRAMING = 90            # 1538 - 1448: what hetconv-plan assumes of a real network
TBF_FRAMING = 66                 # 1514 - 1448: what tbf counts on an emulated one


def line_rate(text):
    """'100mbit', '1gbit', '10gbit', '2.5gbit' (bits per second on the line, as tc writes them;
    also 1gbps, 1Gb/s, 1gbit/s) or '500MB' (bytes per second of payload; also 500MB/s, 500MBps)
    -> (bytes per second, whether it was given in bits). A lower-case b is bits, an upper-case B
    bytes, as network vendors write them."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgKMG])(bits?(?:/s)?|bps|b/s|B|B/s|Bps)\s*", str(text))
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"bandwidth {text!r}: expected a rate such as 100mbit, 1gbit (or 1gbps), 10gbit or 500MB")
    per_s = float(m.group(1)) * {"k": 1e3, "m": 1e6, "g": 1e9}[m.group(2).lower()]
    return (per_s / 8, True) if m.group(3).startswith("b") else (per_s, False)


def parse_bandwidth(text, framing=ETHERNET_FRAMING):
    """A rate as line_rate reads it -> the Link of its TCP payload: a rate in bits is a line
    rate, of which full segments carry TCP_PAYLOAD bytes in every TCP_PAYLOAD + `framing`; a rate
    in bytes is payload already."""
    per_s, bits = line_rate(text)
    return Link(per_s * TCP_PAYLOAD / (TCP_PAYLOAD + framing) if bits else per_s, name=text)


def layer_geometry(specs, image_shape, batch):
    """Per layer: (input shape (N,C,H,W), pooled output shape without K (N,H',W'))."""
    shapes, _ = layer_input_shapes(specs, batch, image_shape)
    return [(shape, (batch,) + tuple(spec.output_hw(*shape[2:]))) for spec, shape in zip(specs, shapes)]


def wire_bytes(specs, image_shape, batch, counts, value_bytes=FLOAT_BYTES):
    """Bytes per step each way for each worker: {worker: {"sent": to it, "recv": from it}}, and
    the same per phase. counts: {worker: [kernels per layer]}."""
    geometry = layer_geometry(specs, image_shape, batch)
    per_worker = {w: {"sent": 0, "recv": 0} for w in counts}
    phases = []
    for li, ((n, c, h, wd), (_, hp, wp)) in enumerate(geometry):
        x_bytes = n * c * h * wd * value_bytes
        fwd = {w: (x_bytes, n * counts[w][li] * hp * wp * value_bytes) for w in counts}
        phases.append(("forward", li, fwd))
    for li in reversed(range(len(geometry))):
        (n, c, h, wd), (_, hp, wp) = geometry[li]
        dx_bytes = n * c * h * wd * value_bytes if li > 0 else 0
        bwd = {w: (n * counts[w][li] * hp * wp * value_bytes, dx_bytes) for w in counts}
        phases.append(("backward", li, bwd))
    for _, _, traffic in phases:
        for w, (sent, recv) in traffic.items():
            per_worker[w]["sent"] += sent
            per_worker[w]["recv"] += recv
    return per_worker, phases


@dataclass
class Prediction:
    step_s: float
    coordinator_s: float
    workers: dict            # worker -> {compute_s, wire_s, wait_s, sent, recv}
    phases: list             # (phase, layer, seconds)

    def to_json(self):
        d = {"step_s": self.step_s, "coordinator_s": self.coordinator_s, "workers": self.workers,
             "phases": [{"phase": p, "layer": l, "seconds": s} for p, l, s in self.phases]}
        if getattr(self, "bytes_by_kind", None):
            d["bytes_by_kind"] = dict(self.bytes_by_kind)     # a graph's step: what its bytes carry
        if getattr(self, "priced", None) is not None:
            d["critical_path_s"] = self.priced.critical_seconds()  # a peer step: what it waits on
        return d


def predict_step(specs, image_shape, batch, counts, profiles, link, coordinator_s, value_bytes=FLOAT_BYTES,
                 micro=0, micros=1):
    """Predicted seconds for one --exchange star training step of `counts` kernels per worker per
    layer (or micro-batch `micro` of `micros` of one: the update comes with the last)."""
    per_worker, phases = wire_bytes(specs, image_shape, batch, counts, value_bytes)
    workers = {w: {"compute_s": 0.0, "wire_s": 0.0, "sent": per_worker[w]["sent"], "recv": per_worker[w]["recv"]}
               for w in counts}
    timeline = []
    total = coordinator_s
    for phase, li, traffic in phases:
        compute = {}
        for w in counts:
            cost = profiles[w].layers[li]
            k = counts[w][li]
            compute[w] = (cost.forward_s(k, batch) if phase == "forward"
                          else cost.backward_in_step_s(k, batch, micro, micros))
            workers[w]["compute_s"] += compute[w]
        # requests leave one after another over the coordinator's link
        link_free, ready = 0.0, {}
        for w in counts:
            sent = traffic[w][0]
            link_free += sent / link.bytes_per_s + link.latency_s
            workers[w]["wire_s"] += sent / link.bytes_per_s
            ready[w] = link_free + compute[w]
        # replies share the link, in the order they are ready
        end = 0.0
        for w in sorted(counts, key=lambda name: ready[name]):
            recv = traffic[w][1]
            end = max(end, ready[w]) + recv / link.bytes_per_s + link.latency_s
            workers[w]["wire_s"] += recv / link.bytes_per_s
        timeline.append((phase, li, end))
        total += end
    for w in workers:
        workers[w]["wait_s"] = max(0.0, total - coordinator_s - workers[w]["compute_s"] - workers[w]["wire_s"])
    return Prediction(total, coordinator_s, workers, timeline)


class PlanError(ValueError):
    """No plan fits what was asked: said before anything runs it (engine.planner raises most of
    them and is where callers import it from)."""


def largest_remainder(total, weights, minimum=1, unit="kernel"):
    """Integer shares of `total` in proportion to `weights` (finite, >= 0, a positive sum), summing
    to total: each exact share rounded down, what that left handed out biggest remainder first
    (ties to the earlier one), then any share under `minimum` raised to it, one at a time from
    whoever holds the most (a slow worker of a model layer still holds a kernel). Weights that
    are already the exact shares (affine_shares') come back rounded. PlanError where there is
    nobody to share among, the weights are not so, or `total` cannot give everyone `minimum`
    `unit`s."""
    n = len(weights)
    if n == 0:
        raise PlanError(f"no workers to split {unit}s across")
    if total < minimum * n:
        raise PlanError(f"cannot give {n} workers at least {minimum} {unit}(s) each of {total} {unit}s: use at most "
                        f"{total // max(minimum, 1)} workers or a wider layer")
    if not all(math.isfinite(w) and w >= 0 for w in weights) or not sum(weights) > 0:
        raise PlanError(f"{unit} shares need finite weights >= 0 with a positive sum, got {list(weights)!r}")
    s = float(sum(weights))
    exact = [total * w / s for w in weights]
    shares = [int(e) for e in exact]
    order = sorted(range(n), key=lambda i: (-(exact[i] - shares[i]), i))
    for i in order[:total - sum(shares)]:
        shares[i] += 1
    for i in range(n):
        while shares[i] < minimum:
            donor = max(range(n), key=lambda j: (shares[j], -j))
            shares[donor] -= 1
            shares[i] += 1
    return shares


def split_sizes(total, parts):
    """The sizes numpy.array_split gives: the first total % parts pieces one larger."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def batchnorm_sum_bytes(spec):
    """What one worker sends one peer at one BatchNorm barrier of a data layer: the per-channel
    sums (two float64 a channel) and the count."""
    return (2 * spec.kernels + 1) * 8


def check_modes(modes, layers):
    """`modes` (None: every layer "model") as a list, one of MODES for each of `layers` conv
    layers; PlanError (a ValueError) naming them where they are not."""
    if modes is None:
        return ["model"] * layers
    modes = list(modes)
    if len(modes) != layers or any(m not in MODES for m in modes):
        raise PlanError(f"modes {modes!r}: expected one of {', '.join(MODES)} for each of the {layers} conv layers")
    return modes


def dominant_term(pred):
    """The resource busiest during a predicted step, in words: what to buy or fix first."""
    busy = getattr(pred, "busy", None)
    if not busy:
        busy = {w: v["compute_s"] for w, v in pred.workers.items()}
        busy["coordinator link"] = sum(v["wire_s"] for v in pred.workers.values())   # the star: all of it
        busy["coordinator"] = pred.coordinator_s
    name, seconds = max(busy.items(), key=lambda kv: kv[1])
    if name == "coordinator":
        what = "the coordinator's FC work"
    elif name.endswith(" out") or name.endswith(" in"):
        host, direction = name.rsplit(" ", 1)
        what = f"{host}'s link ({'sending' if direction == 'out' else 'receiving'})"
    elif name == "coordinator link":
        what = "the coordinator's link"
    elif name == "peer links":
        what = "the links between the workers"
    else:
        what = f"{name}'s compute"
    return what, seconds, seconds / pred.step_s if pred.step_s else 0.0


def predict_local(specs, batch, profile, coordinator_s):
    """The single-device baseline: every kernel on one device, in process, no wire."""
    conv = sum(profile.layers[li].forward_s(s.kernels, batch) + profile.layers[li].backward_in_step_s(s.kernels, batch, 0, 1)
               for li, s in enumerate(specs))
    return conv + coordinator_s


# ---- per layer: model- or data-parallel ------------------------------------------------------
#
# Each conv layer's two modes are priced apart, so a dynamic programme over the chain can pick
# the cheapest (planner.choose_modes). The price of a layer is the slowest worker's compute plus
# the busiest host link's seconds for what the layer itself moves; a boundary between two layers
# adds what its transition moves. Compute and wire are added, not overlapped: micro-batches hide
# some of the wire in a real step, so these prices rank chains, and predict_peer_step stays the
# estimate of a step.

MODES = ("model", "data")


def weight_floats(spec):
    """|W| + |b| of a conv layer: what a data layer's dW all-gather sends to each peer."""
    return math.prod(spec.weight_shape) + (spec.kernels if spec.bias else 0)     # a grouped conv's (K, C/g, kh, kw)


def weight_gradient_bytes(spec, p):
    """What each of `p` workers sends for a data layer's dW and db sum (worker.peers.weight_chunks):
    (bytes while the blocks below compute backward, bytes once backward is done). Two workers send
    each other the whole; more reduce-scatter it in P chunks under the backward and all-gather the
    summed chunks after it."""
    size = weight_floats(spec) * FLOAT_BYTES
    return (size * (p - 1), 0.0) if p <= 2 else (size * (p - 1) / p, size * (p - 1) / p)


def _links_s(out_bytes, in_bytes, link):
    """Seconds of a collective on a switched network: each host's uplink and downlink run at
    once, so the busiest direction of the busiest host sets the time."""
    busiest = max(max(o, i) for o, i in zip(out_bytes, in_bytes))
    cpu = max(0.5 * (o + i) * link.host_cpu_s_per_byte for o, i in zip(out_bytes, in_bytes))
    return busiest / link.bytes_per_s + cpu


def _compute_s(cost, kernels, images, sizes, batch):
    """A worker's forward + backward of `kernels` kernels on its `images` of a batch of `batch`,
    cut into micro-batches of `sizes` (its rows of each in proportion), with the step's update."""
    return sum(cost.forward_s(kernels, b * images / batch)
               + cost.backward_in_step_s(kernels, b * images / batch, m, len(sizes)) for m, b in enumerate(sizes))


def transition_s(boundary_bytes, prev_mode, mode, channels, images, link, messages=1):
    """Seconds to move a boundary tensor (layer l-1's pooled output, all images x all channels:
    `boundary_bytes`) from layer l-1 in `prev_mode` to layer l in `mode`, forward and its
    gradient back. channels: each worker's fraction of the boundary's channels (its kernels of
    layer l-1, model); images: each worker's fraction of the images (data).
    - model -> model: all-gather of channel slices; partial dX reduce-scattered by channel.
    - data -> model: all-gather by images; the partial dX reduce-scattered by images.
    - model -> data: all-to-all (all images x my channels -> my images x all channels), and back.
    - data -> data: nothing (each worker keeps its images)."""
    s, p = boundary_bytes, len(channels)
    if prev_mode == "data" and mode == "data" or p < 2:
        return 0.0
    if prev_mode == "model" and mode == "model":
        fwd = [(s * c * (p - 1), s * (1 - c)) for c in channels]
    elif prev_mode == "data":
        fwd = [(s * r * (p - 1), s * (1 - r)) for r in images]
    else:
        fwd = [(s * c * (1 - r), s * r * (1 - c)) for c, r in zip(channels, images)]
    # backward moves the same amounts the other way
    seconds = _links_s([o for o, _ in fwd], [i for _, i in fwd], link)
    seconds += _links_s([i for _, i in fwd], [o for o, _ in fwd], link)
    return seconds + 2 * messages * (p - 1) * link.latency_s


@dataclass
class ModeCosts:
    """Per conv layer, the price of each mode (seconds a step), and per boundary between layers
    l-1 and l the price of each (previous mode, mode) transition. node[l][mode] holds the layer's
    compute, its own traffic (a data layer's dW all-gather) and, for the first and last layers,
    the coordinator's traffic; detail[l][mode] splits it up."""
    node: list          # [{mode: seconds}]
    edge: list          # [{(prev_mode, mode): seconds}], edge[0] empty (no layer before the first)
    detail: list        # [{mode: {"compute_s", "wire_s", "coordinator_s"}}]

    def chain_s(self, modes):
        """The priced seconds of one assignment of modes to the layers."""
        total = sum(self.node[li][m] for li, m in enumerate(modes))
        return total + sum(self.edge[li][(modes[li - 1], modes[li])] for li in range(1, len(modes)))

    def to_json(self):
        return [{"layer": li, "mode_s": dict(self.node[li]), "detail": self.detail[li],
                 "transition_s": {f"{a}->{b}": v for (a, b), v in self.edge[li].items()}}
                for li in range(len(self.node))]


def mode_costs(specs, image_shape, batch, counts, images, profiles, link, micro_batches=1, value_bytes=FLOAT_BYTES):
    """Price every conv layer in both modes (see ModeCosts).
    counts: {worker: [kernels per layer]}, each layer's split in model mode;
    images: {worker: [images of the batch per layer]}, each layer's split in data mode.
    The coordinator's link: to the first layer the images (1/P to each worker, then all-gathered
    among them for a model layer; each worker its own for a data layer); from the last layer the
    features and back their gradient (the same bytes in both modes)."""
    names = list(counts)
    p = len(names)
    geometry = layer_geometry(specs, image_shape, batch)
    sizes = split_sizes(batch, micro_batches)
    node, edge, detail = [], [], []
    for li, (spec, ((n, c, h, wd), (_, hp, wp))) in enumerate(zip(specs, geometry)):
        total = spec.kernels
        compute = {"model": max(_compute_s(profiles[w].layers[li], counts[w][li], batch, sizes, batch) for w in names),
                   "data": max(_compute_s(profiles[w].layers[li], total, images[w][li], sizes, batch) for w in names)}
        dw = sum(weight_gradient_bytes(spec, p))                # to the peers, and from them
        wire = {"model": 0.0, "data": (dw / link.bytes_per_s + (p - 1) * link.latency_s) if p > 1 else 0.0}
        coordinator = {"model": 0.0, "data": 0.0}
        if li == 0:
            x_bytes = n * c * h * wd * value_bytes
            coordinator["data"] = x_bytes / link.bytes_per_s
            coordinator["model"] = x_bytes / link.bytes_per_s + (
                _links_s([x_bytes * (p - 1) / p] * p, [x_bytes * (p - 1) / p] * p, link) if p > 1 else 0.0)
        if li == len(specs) - 1:
            y_bytes = n * total * hp * wp * value_bytes
            for m in MODES:
                coordinator[m] += 2 * y_bytes / link.bytes_per_s
        node.append({m: compute[m] + wire[m] + coordinator[m] for m in MODES})
        detail.append({m: {"compute_s": compute[m], "wire_s": wire[m], "coordinator_s": coordinator[m]} for m in MODES})
        if li == 0:
            edge.append({})
            continue
        boundary = n * c * h * wd * value_bytes
        channels = [counts[w][li - 1] / specs[li - 1].kernels for w in names]
        edge.append({(a, b): transition_s(boundary, a, b, channels,
                                          [images[w][li if b == "data" else li - 1] / batch for w in names],
                                          link, len(sizes))
                     for a in MODES for b in MODES})
    return ModeCosts(node, edge, detail)


def graph_mode_costs(specs, image_shape, batch, counts, images, profiles, link, needs_dx, micro_batches=1,
                     value_bytes=FLOAT_BYTES, feature_floats=0):
    """Price every conv block of a graph in both modes, as the graph's peer step runs them
    (worker.graph_step): a block's output all-gathered among the workers whatever reads it, and
    where its input needs a gradient (`needs_dx[l]`), a model block's partial dX sent whole to
    every other worker, a data block's dX (its images) all-gathered. Every tensor is whole on
    every worker between blocks, so a block's price does not depend on its neighbours' modes:
    the edges are all zero, and the cheapest assignment is each block's cheaper mode.
    counts, images: as mode_costs. The coordinator's link, the same in both modes, is priced on
    the first block: the images (float32, 1/P to each worker, all-gathered among them) and the
    features (`feature_floats` a step, float32) from the plan's first worker, their gradient to
    every worker."""
    names = list(counts)
    p = len(names)
    geometry = layer_geometry(specs, image_shape, batch)
    sizes = split_sizes(batch, micro_batches)
    messages = (p - 1) * len(sizes) * link.latency_s
    node, edge, detail = [], [], []
    for li, (spec, ((n, c, h, wd), (_, hp, wp))) in enumerate(zip(specs, geometry)):
        total = spec.kernels
        compute = {"model": max(_compute_s(profiles[w].layers[li], counts[w][li], batch, sizes, batch) for w in names),
                   "data": max(_compute_s(profiles[w].layers[li], total, images[w][li], sizes, batch) for w in names)}
        wire = {"model": 0.0, "data": 0.0}
        moved = {m: ([0.0] * p, [0.0] * p) for m in MODES}       # bytes each worker sends and receives
        kinds = {m: {} for m in MODES}                          # bytes sent by all workers, by what they carry
        if p > 1:
            out_bytes, in_bytes = n * total * hp * wp * value_bytes, n * c * h * wd * value_bytes
            shares = {"model": [counts[w][li] / total for w in names], "data": [images[w][li] / batch for w in names]}
            for mode, fractions in shares.items():
                traffic = [("block outputs", [out_bytes * f * (p - 1) for f in fractions],
                            [out_bytes * (1 - f) for f in fractions])]
                if needs_dx[li] and mode == "model":
                    traffic.append(("partial input gradients", [in_bytes * (p - 1)] * p, [in_bytes * (p - 1)] * p))
                elif needs_dx[li]:
                    traffic.append(("input gradients", [in_bytes * r * (p - 1) for r in fractions],
                                    [in_bytes * (1 - r) for r in fractions]))
                if mode == "data":
                    dw = sum(weight_gradient_bytes(spec, p))
                    traffic.append(("weight gradients", [dw] * p, [dw] * p))
                for kind, sent, recv in traffic:
                    wire[mode] += _links_s(sent, recv, link) + messages
                    moved[mode] = ([a + b for a, b in zip(moved[mode][0], sent)],
                                   [a + b for a, b in zip(moved[mode][1], recv)])
                    kinds[mode][kind] = kinds[mode].get(kind, 0.0) + sum(sent)
        coordinator = 0.0
        if li == 0:
            x_bytes = batch * math.prod(image_shape) * FLOAT_BYTES
            coordinator = x_bytes / link.bytes_per_s + (feature_floats * FLOAT_BYTES * (1 + p)) / link.bytes_per_s
            if p > 1:
                coordinator += _links_s([x_bytes * (p - 1) / p] * p, [x_bytes * (p - 1) / p] * p, link)
        node.append({m: compute[m] + wire[m] + coordinator for m in MODES})
        detail.append({m: {"compute_s": compute[m], "wire_s": wire[m], "coordinator_s": coordinator,
                           "sent_bytes": moved[m][0], "recv_bytes": moved[m][1], "bytes_by_kind": kinds[m]}
                       for m in MODES})
        edge.append({} if li == 0 else {(a, b): 0.0 for a in MODES for b in MODES})
    return ModeCosts(node, edge, detail)


@dataclass(frozen=True)
class GraphShape:
    """What the cost model needs of a network that is a graph beyond its conv blocks' specs:
    whether each block's input needs a gradient (not where it is made from the images alone),
    and the floats per image of the features the head reads."""
    needs_dx: tuple
    feature_floats: int
    # the steps as engine/layouts.py reads them, (kind, block, inputs, output) in order, with the
    # floats per image of every tensor they make (-1: the images) and the BatchNorm nodes between
    # blocks: what prices a step that holds its tensors in layouts (predict_peer_step)
    steps: tuple = ()
    floats: tuple = ()                  # ((node, floats per image), ...)
    norms: tuple = ()
    feature: int = -1


def chain_shape(specs, image_shape):
    """The GraphShape of a chain of conv blocks (ConvSpecs) on images of `image_shape` (C, H, W):
    the graph whose blocks each read the one before, which the peer step runs a chain as
    (engine.graph.GraphPass.chain) and the cost model prices it as."""
    hw, floats, steps = tuple(image_shape[1:]), [(-1, math.prod(image_shape))], []
    for block, spec in enumerate(specs):
        hw = spec.output_hw(*hw)
        floats.append((block, spec.kernels * math.prod(hw)))
        steps.append(("block", block, (block - 1,), block))
    return GraphShape((False,) + (True,) * (len(specs) - 1), floats[-1][1], steps=tuple(steps), floats=tuple(floats),
                      norms=(), feature=len(specs) - 1)
