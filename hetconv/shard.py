"""A conv shard: one device's slice of every conv layer's kernels, with its SGD state.

This is the code a worker runs for every FORWARD / BACKWARD it serves, and the code `--local`
runs in-process, so the single-device baseline and a distributed run differ only in transport.
"""
import time

import numpy as np

from hetconv.geometry import ConvSpec
from hetconv.params import default_init
from hetconv.wire import decode, encode


class ShardError(ValueError):
    """A request the shard cannot serve (unknown layer, wrong shapes)."""


class _LayerSlice:
    def __init__(self, device, spec, start, stop, w, b, vw, vb):
        self.spec, self.start, self.stop = spec, start, stop
        self.w, self.b = device.upload(w), device.upload(b)
        self.vw = device.upload(vw) if vw is not None else device.zeros_like(self.w)
        self.vb = device.upload(vb) if vb is not None else device.zeros_like(self.b)
        self.ctx = {}                      # micro-batch -> what its backward needs
        self.dw = self.db = None           # gradients summed over the step's micro-batches so far


class ConvShard:
    def __init__(self, device):
        self.device = device
        self.layers = {}

    def load(self, layer, spec, start, stop, w, b, vw=None, vb=None):
        k = stop - start
        expect_w = (k, spec.in_channels, spec.ksize, spec.ksize)
        if w.shape != expect_w or b.shape != (k,):
            raise ShardError(f"layer {layer}: weights {w.shape} / bias {b.shape} do not match kernels "
                             f"[{start}, {stop}) of {spec}: expected {expect_w} / {(k,)}")
        for name, a, shape in (("momentum of w", vw, expect_w), ("momentum of b", vb, (k,))):
            if a is not None and a.shape != shape:
                raise ShardError(f"layer {layer}: {name} has shape {a.shape}, expected {shape}")
        self.layers[layer] = _LayerSlice(self.device, spec, start, stop, w, b, vw, vb)

    def _layer(self, layer):
        if layer not in self.layers:
            raise ShardError(f"layer {layer} is not loaded on this shard (loaded: {sorted(self.layers)})")
        return self.layers[layer]

    def forward(self, layer, x, micro=0, keep=True):
        """x (N, C, H, W) -> this shard's channels of pool(relu(conv(x))). With `keep`, what the
        backward of this micro-batch needs stays here until that backward."""
        sl = self._layer(layer)
        if x.ndim != 4 or x.shape[1] != sl.spec.in_channels:
            raise ShardError(f"layer {layer}: input shape {x.shape} does not have {sl.spec.in_channels} channels (N, C, H, W)")
        y, ctx = self.device.conv_relu_pool(x, sl.w, sl.b, sl.spec.padding)
        if keep:
            sl.ctx[micro] = ctx
        return y

    def backward(self, layer, dpooled, need_dx, micro=0, sgd=None):
        """Gradient of this shard's channels in, partial dX (or None) out. The kernels' gradients
        add up over micro-batches; `sgd` = (lr, momentum, weight_decay) on a layer's last
        micro-batch applies the one update of the step to what was summed."""
        sl = self._layer(layer)
        ctx = sl.ctx.pop(micro, None)      # frees the saved input: it is the largest buffer we hold
        if ctx is None:
            raise ShardError(f"layer {layer}: backward of micro-batch {micro} without a forward to match "
                             f"(waiting: {sorted(sl.ctx)})")
        dx, dw, db = self.device.conv_relu_pool_backward(ctx, sl.w, dpooled, need_dx)
        if sl.dw is None:
            sl.dw, sl.db = dw, db          # the device returned fresh arrays: ours to add into
        else:
            self.device.accumulate_(sl.dw, dw)
            self.device.accumulate_(sl.db, db)
        if sgd is not None:
            lr, momentum, weight_decay = sgd
            self.device.sgd_(sl.w, sl.vw, sl.dw, lr, momentum, weight_decay)
            self.device.sgd_(sl.b, sl.vb, sl.db, lr, momentum, 0.0)      # no decay on biases
            sl.dw = sl.db = None
        return dx

    def fetch(self, layer):
        """(w, b, vw, vb) as numpy, for checkpoints."""
        sl = self._layer(layer)
        d = self.device
        return d.download(sl.w), d.download(sl.b), d.download(sl.vw), d.download(sl.vb)

    def calibrate(self, specs, input_shapes, kernels, repeats=3):
        """Time the fused forward and backward on each layer's real input shape at two kernel
        counts, `kernels[i]` and half of it, after a warm-up of each that absorbs JIT compilation
        and buffer growth. Two points separate the per-kernel cost from the part every shard pays
        whatever its share (im2col, the input's trip through memory), which the cost model needs.
        The two counts alternate over `repeats` rounds and each keeps its median, so a burst of
        outside load skews neither the speed nor the fitted line for long. Then the smaller count
        on half the batch (`half_batch`), for the cost of a call apart from its images.

        Returns (kernels/s per layer at kernels[i], per-layer timing dicts)."""
        rng = np.random.default_rng(0)
        speeds, timings = [], []
        for li, (spec, shape, k) in enumerate(zip(specs, input_shapes, kernels)):
            x = rng.standard_normal(shape, dtype=np.float32)
            counts = sorted({max(1, int(k)), max(1, int(k) // 2)}, reverse=True)
            layers = [self._calibration_weights(spec, count, rng) for count in counts]
            samples = [[] for _ in counts]
            for rep in range(repeats + 1):                 # rep 0 is the warm-up
                for i, (w_dev, b_dev) in enumerate(layers):
                    f, b = self._time_once(spec, x, w_dev, b_dev, need_dx=li > 0)
                    if rep:
                        samples[i].append((f, b))
            fwd = [float(np.median([f for f, _ in smp])) for smp in samples]
            bwd = [float(np.median([b for _, b in smp])) for smp in samples]
            speeds.append(counts[0] / (fwd[0] + bwd[0]))
            timing = {"batch": int(shape[0]), "kernels": counts, "forward_s": fwd, "backward_s": bwd}
            if shape[0] >= 2:
                timing["half_batch"] = self._time_half_batch(spec, x[:shape[0] // 2], layers[-1], counts[-1],
                                                             repeats, need_dx=li > 0)
            timing.update(self._time_update(layers[0][0], repeats))
            timings.append(timing)
        return speeds, timings

    def _time_update(self, w_dev, repeats):
        """What a step pays per layer whatever its batch: the SGD update of the weights held, and
        adding one micro-batch's gradient into the step's sum. Both scale with the kernels held."""
        d = self.device
        v, g = d.zeros_like(w_dev), d.zeros_like(w_dev)
        w = d.upload(d.download(w_dev))          # a copy: the update must not change the timed weights
        sgd, add = [], []
        for rep in range(repeats + 1):
            t0 = time.perf_counter()
            d.sgd_(w, v, g, 0.0, 0.9, 0.0)
            d.synchronize()
            t1 = time.perf_counter()
            d.accumulate_(v, g)
            d.synchronize()
            if rep:
                sgd.append(t1 - t0)
                add.append(time.perf_counter() - t1)
        return {"update_kernels": int(w_dev.shape[0]), "update_s": float(np.median(sgd)),
                "accumulate_s": float(np.median(add))}

    def _time_half_batch(self, spec, x, layer, count, repeats, need_dx):
        """The smaller count again on half the images: with the full-batch time it separates what
        each call costs whatever its batch (weights reordered, dW allocated and written, buffers
        touched) from the per-image cost. The cost model charges it once per micro-batch."""
        w_dev, b_dev = layer
        x = np.ascontiguousarray(x)
        samples = [self._time_once(spec, x, w_dev, b_dev, need_dx) for _ in range(repeats + 1)][1:]
        return {"batch": int(x.shape[0]), "kernels": count,
                "forward_s": float(np.median([f for f, _ in samples])),
                "backward_s": float(np.median([b for _, b in samples]))}

    def _calibration_weights(self, spec, k, rng):
        fan_in = spec.in_channels * spec.ksize ** 2
        w = default_init(rng, (k, spec.in_channels, spec.ksize, spec.ksize), fan_in)
        return self.device.upload(w), self.device.upload(np.zeros(k, np.float32))

    def _time_once(self, spec, x, w_dev, b_dev, need_dx):
        t0 = time.perf_counter()
        y, ctx = self.device.conv_relu_pool(x, w_dev, b_dev, spec.padding)
        self.device.synchronize()
        t1 = time.perf_counter()
        self.device.conv_relu_pool_backward(ctx, w_dev, np.ones_like(y), need_dx)
        self.device.synchronize()
        return t1 - t0, time.perf_counter() - t1


class ShardServer:
    """The requests one shard serves, by op: the table a worker process runs for every message
    from the coordinator, and the one `--local` calls in-process with no sockets. Arrays of
    feature maps and gradients arrive and leave in the step's wire dtype (hetconv.wire)."""

    def __init__(self, shard):
        self.shard = shard
        self.handlers = {"CALIBRATE": self.calibrate, "LOAD": self.load, "FORWARD": self.forward,
                         "BACKWARD": self.backward, "FETCH": self.fetch}

    def handle(self, op, arrays, fields):
        """-> (reply op, arrays, fields). Raises ShardError for what it cannot serve."""
        handler = self.handlers.get(op)
        if handler is None:
            raise ShardError(f"a worker does not serve {op!r} here: expected one of {sorted(self.handlers)}")
        return handler(arrays, fields)

    def calibrate(self, arrays, f):
        specs = [ConvSpec.from_json(layer["spec"]) for layer in f["layers"]]
        shapes = [tuple(layer["input_shape"]) for layer in f["layers"]]
        kernels = [int(layer["kernels"]) for layer in f["layers"]]
        speeds, timings = self.shard.calibrate(specs, shapes, kernels, repeats=int(f.get("repeats", 3)))
        return "CALIBRATED", [], {"speeds": speeds, "timings": timings}

    def load(self, arrays, f):
        vw, vb = (arrays[2], arrays[3]) if len(arrays) == 4 else (None, None)
        self.shard.load(int(f["layer"]), ConvSpec.from_json(f["spec"]), int(f["start"]), int(f["stop"]),
                        arrays[0], arrays[1], vw, vb)
        return "LOADED", [], {"layer": f["layer"]}

    def forward(self, arrays, f):
        wire = f.get("wire", "float32")
        y = self.shard.forward(int(f["layer"]), decode(arrays[0], wire), int(f.get("micro", 0)),
                               bool(f.get("keep", True)))
        return "FORWARD_DONE", [encode(y, wire)], {"layer": f["layer"]}

    def backward(self, arrays, f):
        wire = f.get("wire", "float32")
        sgd = f.get("sgd")
        dx = self.shard.backward(int(f["layer"]), decode(arrays[0], wire), bool(f["need_dx"]),
                                 int(f.get("micro", 0)), None if sgd is None else tuple(float(v) for v in sgd))
        return "BACKWARD_DONE", [] if dx is None else [encode(dx, wire)], {"layer": f["layer"]}

    def fetch(self, arrays, f):
        return "SHARD", list(self.shard.fetch(int(f["layer"]))), {"layer": f["layer"]}
