"""A conv shard: one device's slice of every conv layer's kernels, with its SGD state.

This is the code a worker runs for every FORWARD / BACKWARD it serves, and the code `--local`
runs in-process, so the single-device baseline and a distributed run differ only in transport.
"""
import time

import numpy as np

from hetconv.params import default_init
from hetconv.planner import make_plan


class ShardError(ValueError):
    """A request the shard cannot serve (unknown layer, wrong shapes)."""


class _LayerSlice:
    def __init__(self, device, spec, start, stop, w, b, vw, vb):
        self.spec, self.start, self.stop = spec, start, stop
        self.w, self.b = device.upload(w), device.upload(b)
        self.vw = device.upload(vw) if vw is not None else device.zeros_like(self.w)
        self.vb = device.upload(vb) if vb is not None else device.zeros_like(self.b)
        self.ctx = None


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

    def forward(self, layer, x):
        """x (N, C, H, W) -> this shard's channels of pool(relu(conv(x)))."""
        sl = self._layer(layer)
        if x.ndim != 4 or x.shape[1] != sl.spec.in_channels:
            raise ShardError(f"layer {layer}: input shape {x.shape} does not have {sl.spec.in_channels} channels (N, C, H, W)")
        y, sl.ctx = self.device.conv_relu_pool(x, sl.w, sl.b, sl.spec.padding)
        return y

    def backward(self, layer, dpooled, lr, momentum, weight_decay, need_dx):
        """Gradient of this shard's channels in, SGD on its kernels, partial dX (or None) out."""
        sl = self._layer(layer)
        if sl.ctx is None:
            raise ShardError(f"layer {layer}: backward without a forward to match")
        dx, dw, db = self.device.conv_relu_pool_backward(sl.ctx, sl.w, dpooled, need_dx)
        sl.ctx = None                      # frees the saved input: it is the largest buffer we hold
        self.device.sgd_(sl.w, sl.vw, dw, lr, momentum, weight_decay)
        self.device.sgd_(sl.b, sl.vb, db, lr, momentum, 0.0)
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
        outside load skews neither the speed nor the fitted line for long.

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
            timings.append({"batch": int(shape[0]), "kernels": counts, "forward_s": fwd, "backward_s": bwd})
        return speeds, timings

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


def concat_channels(parts):
    """Workers' channel slices (N, k_i, H, W) in plan order -> the layer's (N, K, H, W)."""
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)


def concat_shards(parts):
    """Per worker (w, b, vw, vb) slices in plan order -> the layer's full (w, b, vw, vb)."""
    return tuple(np.concatenate([p[i] for p in parts], axis=0) for i in range(4))


class LocalEngine:
    """The conv layers run in this process on in-process shards: `--local`, and tests.

    Same interface as the distributed engine: forward/backward per layer, gather for checkpoints."""

    def __init__(self, shards):
        self.shards = dict(shards)          # worker name -> ConvShard
        self.plan = None
        self.fixed_plan = None

    @property
    def workers(self):
        return list(self.shards)

    def plan_for(self, specs, input_shapes, cfg):
        """In-process shards share one machine: split equally unless a plan was set by hand."""
        if self.fixed_plan is not None:
            return self.fixed_plan
        return make_plan([s.kernels for s in specs], {name: None for name in self.shards}, "equal")

    def load(self, plan, specs, params):
        """params: per layer (w, b, vw, vb) full arrays (momentum may be None)."""
        self.plan = plan
        for lp, spec, (w, b, vw, vb) in zip(plan.layers, specs, params):
            for name, (s, e) in lp.ranges.items():
                self.shards[name].load(lp.layer, spec, s, e, w[s:e], b[s:e],
                                       None if vw is None else vw[s:e], None if vb is None else vb[s:e])

    def forward(self, layer, x):
        return concat_channels([self.shards[name].forward(layer, x) for name in self.plan.workers])

    def backward(self, layer, dpooled, lr, momentum, weight_decay, need_dx):
        lp = self.plan.layers[layer]
        dx = None
        for name in self.plan.workers:
            s, e = lp.ranges[name]
            part = self.shards[name].backward(layer, np.ascontiguousarray(dpooled[:, s:e]), lr, momentum, weight_decay, need_dx)
            if need_dx:
                dx = part if dx is None else dx + part
        return dx

    def gather(self):
        out = []
        for lp in self.plan.layers:
            out.append(concat_shards([self.shards[name].fetch(lp.layer) for name in self.plan.workers]))
        return out

    def step_stats(self):
        return {}

    def reset_layer_timings(self):
        pass

    def rebalance(self, specs, min_gain=0.05):
        """In-process shards share one device: nothing to rebalance."""
        return None

    def close(self):
        pass
