"""The cost model: a step's time, speedup and wire bytes, predicted from calibrated device timings,
layer shapes, batch size and link bandwidth — before anything is bought or wired. The
`hetconv-predict` command (hetconv/predict.py) measures what this model needs and prints it.

The model of one step, phase by phase (each conv layer's forward, then each one's backward):
- Device time: from calibration, per layer, seconds = batch * (fixed + per_kernel * k). Two
  calibration points (k and k/2 kernels) separate the part every shard pays whatever its share
  (im2col, reading the input) from the per-kernel GEMM cost.
- Wire: all traffic goes through the coordinator's one link. Requests leave one after another
  (the layer input is sent to every worker: a broadcast costs n sends); a worker starts when its
  request has arrived; replies come back over the same link in the order they are ready.
- Coordinator: FC layers, loss, concatenating channel slices and summing partial dX, measured
  on this host and added once per step (the workers are idle meanwhile: a step is synchronous).
Everything here is pure: no clocks, no sockets, no devices (those are in hetconv/predict.py).
"""
import re
from dataclasses import asdict, dataclass

from hetconv.geometry import layer_input_shapes

FLOAT_BYTES = 4


@dataclass(frozen=True)
class LayerCost:
    """One device on one conv layer, per image: seconds = fixed + per_kernel * kernels."""
    forward_fixed_s: float
    forward_per_kernel_s: float
    backward_fixed_s: float
    backward_per_kernel_s: float

    def forward_s(self, kernels, batch):
        return batch * (self.forward_fixed_s + self.forward_per_kernel_s * kernels)

    def backward_s(self, kernels, batch):
        return batch * (self.backward_fixed_s + self.backward_per_kernel_s * kernels)

    @classmethod
    def fit(cls, timing):
        """From a calibration timing {batch, kernels: [k1, k2], forward_s: [..], backward_s: [..]}."""
        batch = timing["batch"]
        ks = timing["kernels"]
        out = []
        for ts in (timing["forward_s"], timing["backward_s"]):
            fixed, per_kernel = _fit_line(ks, ts)
            out += [fixed / batch, per_kernel / batch]
        return cls(*out)


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


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    device: str
    description: str
    layers: tuple                     # LayerCost per conv layer

    def to_json(self):
        return {"name": self.name, "device": self.device, "description": self.description,
                "layers": [asdict(lc) for lc in self.layers]}

    @classmethod
    def from_json(cls, d):
        return cls(d["name"], d["device"], d.get("description", ""), tuple(LayerCost(**lc) for lc in d["layers"]))


def profiles_from_calibration(calibration):
    """RemoteEngine.calibration -> {worker: DeviceProfile}."""
    return {name: DeviceProfile(name, c["device"], c.get("description", ""),
                                tuple(LayerCost.fit(t) for t in c["layers"]))
            for name, c in calibration.items()}


@dataclass(frozen=True)
class Link:
    """The coordinator's link: bytes per second, and a per-message latency."""
    bytes_per_s: float
    latency_s: float = 50e-6
    name: str = ""


def parse_bandwidth(text):
    """'100mbit', '1gbit', '10gbit', '2.5gbit' (bits per second, as tc writes them) or '500MB'
    (bytes per second) -> Link."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgKMG])(bit|B)\s*", str(text))
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"bandwidth {text!r}: expected a rate such as 100mbit, 1gbit, 10gbit or 500MB")
    per_s = float(m.group(1)) * {"k": 1e3, "m": 1e6, "g": 1e9}[m.group(2).lower()]
    return Link(per_s / 8 if m.group(3) == "bit" else per_s, name=text)


def layer_geometry(specs, image_shape, batch):
    """Per layer: (input shape (N,C,H,W), pooled output shape without K (N,H',W'))."""
    shapes, last = layer_input_shapes(specs, batch, image_shape)
    outputs = [s[2:] for s in shapes[1:]] + [last[1:]]
    return [(shape, (batch,) + tuple(hw)) for shape, hw in zip(shapes, outputs)]


def wire_bytes(specs, image_shape, batch, counts):
    """Bytes per step each way for each worker: {worker: {"sent": to it, "recv": from it}}, and
    the same per phase. counts: {worker: [kernels per layer]}."""
    geometry = layer_geometry(specs, image_shape, batch)
    per_worker = {w: {"sent": 0, "recv": 0} for w in counts}
    phases = []
    for li, ((n, c, h, wd), (_, hp, wp)) in enumerate(geometry):
        x_bytes = n * c * h * wd * FLOAT_BYTES
        fwd = {w: (x_bytes, n * counts[w][li] * hp * wp * FLOAT_BYTES) for w in counts}
        phases.append(("forward", li, fwd))
    for li in reversed(range(len(geometry))):
        (n, c, h, wd), (_, hp, wp) = geometry[li]
        dx_bytes = n * c * h * wd * FLOAT_BYTES if li > 0 else 0
        bwd = {w: (n * counts[w][li] * hp * wp * FLOAT_BYTES, dx_bytes) for w in counts}
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
        return {"step_s": self.step_s, "coordinator_s": self.coordinator_s, "workers": self.workers,
                "phases": [{"phase": p, "layer": l, "seconds": s} for p, l, s in self.phases]}


def predict_step(specs, image_shape, batch, counts, profiles, link, coordinator_s):
    """Predicted seconds for one training step of `counts` kernels per worker per layer."""
    per_worker, phases = wire_bytes(specs, image_shape, batch, counts)
    workers = {w: {"compute_s": 0.0, "wire_s": 0.0, "sent": per_worker[w]["sent"], "recv": per_worker[w]["recv"]}
               for w in counts}
    timeline = []
    total = coordinator_s
    for phase, li, traffic in phases:
        compute = {}
        for w in counts:
            cost = profiles[w].layers[li]
            k = counts[w][li]
            compute[w] = cost.forward_s(k, batch) if phase == "forward" else cost.backward_s(k, batch)
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


def predict_local(specs, batch, profile, coordinator_s):
    """The single-device baseline: every kernel on one device, in process, no wire."""
    conv = sum(profile.layers[li].forward_s(s.kernels, batch) + profile.layers[li].backward_s(s.kernels, batch)
               for li, s in enumerate(specs))
    return conv + coordinator_s
