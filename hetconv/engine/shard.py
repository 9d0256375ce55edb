"""A conv shard: one device's slice of every conv layer's kernels, with its SGD state.

This is the code a worker runs for every FORWARD / BACKWARD it serves, and the code `--local`
runs in-process, so the single-device baseline and a distributed run differ only in transport.
"""
import time

import numpy as np

from hetconv.geometry import ConvSpec
from hetconv.params import default_init
from hetconv.transport.protocol import check_fields
from hetconv.transport.wire import check_wire_dtype, decode, encode

# Every calibration point (a kernel count on a batch, or the update) is the mean over timed calls
# that together measure at least CALIBRATION_FLOOR_S. A core shared with another busy process is
# shared in scheduler slices of several ms, so a call of a few ms runs either at full speed or
# stalled for a slice, and the median of a few such calls is one or the other by luck (conv 32,96,
# two 1-thread workers, one sharing its core with a busy loop: medians of three calls put the
# larger layer's fast/slow ratio anywhere from 0.63 to 4.65 against ~2). The mean over a window of
# many slices is what the shared core delivers. What it costs: at most about the floor per point
# beyond the calls that were timed anyway (four points per layer); a call that already takes
# longer than the floor is repeated no more than before. On the paper network at the default
# batch of 16 (two 1-thread workers, AMD EPYC, 2 cores, avx512f; other tenants using 0.6-0.8 of
# a core meanwhile) calibration took 17.0 s against 8.6 s with medians of three calls
# (bench/results/calibration_noise.md); conv 32,96 takes 2.0 s against 0.5 s. The cap on calls
# keeps tiny layers, whose calls are microseconds and whose untimed overhead then outweighs
# them, to a fraction of a second.
CALIBRATION_FLOOR_S = 0.25
CALIBRATION_MAX_CALLS = 1000


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
        self.dw_kept = None                # the last step's dW sum, which the next step writes over


class ConvShard:
    def __init__(self, device, clock=time.perf_counter):
        self.device = device
        self.wire = "float32"              # feature maps and gradients between devices; the plan's LOADs set it
        self.layers = {}
        self.clock = clock                 # calibration's timer (tests give a fake one)

    def load(self, layer, spec, start, stop, w, b, vw=None, vb=None):
        k = stop - start
        expect_w = (k, spec.in_channels, spec.kh, spec.kw)
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
        y, ctx = self.device.conv_block(x, sl.w, sl.b, sl.spec.block)
        if keep:
            sl.ctx[micro] = ctx
        return y

    def backward(self, layer, dpooled, need_dx, micro=0, sgd=None):
        """Gradient of this shard's channels in, partial dX (or None) out. The kernels' gradients
        add up over micro-batches, the device writing each one's dW into the step's sum; `sgd` =
        (lr, momentum, weight_decay) on a layer's last micro-batch applies the one update of the
        step to what was summed (as `update` does)."""
        sl = self._layer(layer)
        ctx = sl.ctx.pop(micro, None)      # frees the saved input: it is the largest buffer we hold
        if ctx is None:
            raise ShardError(f"layer {layer}: backward of micro-batch {micro} without a forward to match "
                             f"(waiting: {sorted(sl.ctx)})")
        first = sl.dw is None
        dx, dw, db = self.device.conv_block_backward(ctx, sl.w, dpooled, need_dx,
                                                     dw_out=sl.dw_kept if first else sl.dw, accumulate=not first)
        if first:
            sl.dw, sl.db, sl.dw_kept = dw, db, None
        else:
            self.device.accumulate_(sl.db, db)
        if sgd is not None:
            self.update(layer, sgd)
        return dx

    def update(self, layer, sgd):
        """The step's one SGD update of a layer with the gradients its backward calls summed; sgd
        = (lr, momentum, weight_decay). Apart from backward, so a worker can send its last dX
        first and update while its peers receive it. The dW buffer is kept for the next step."""
        sl = self._layer(layer)
        if sl.dw is None:                  # no backward of this step ran here (no images): nothing to apply
            return
        lr, momentum, weight_decay = sgd
        self.device.sgd_(sl.w, sl.vw, sl.dw, lr, momentum, weight_decay)
        if sl.spec.bias:                                             # a layer without bias keeps b at 0
            self.device.sgd_(sl.b, sl.vb, sl.db, lr, momentum, 0.0)  # no decay on biases
        sl.dw_kept, sl.dw, sl.db = sl.dw, None, None

    def take_gradients(self, layer):
        """(dW, db) summed over the step's micro-batches so far, as numpy float32, and forgotten
        here: a data-parallel layer's share of the step's gradient, which the workers sum among
        themselves before apply_update. Zeros when this shard had no images of the step."""
        sl = self._layer(layer)
        d = self.device
        if sl.dw is None:
            dw, db = np.zeros(sl.w.shape, np.float32), np.zeros(sl.b.shape, np.float32)
        else:
            dw, db = np.asarray(d.download(sl.dw), np.float32), np.asarray(d.download(sl.db), np.float32)
        sl.dw = sl.db = None               # handed out (the CPU's download is the array itself): not kept
        return dw, db

    def apply_update(self, layer, dw, db, sgd):
        """The step's one SGD update of a layer with given gradients (a data-parallel layer's,
        summed over every worker): every worker given the same arrays holds the same weights
        after it, bit for bit. sgd = (lr, momentum, weight_decay); no decay on biases."""
        sl = self._layer(layer)
        if tuple(dw.shape) != tuple(sl.w.shape) or tuple(db.shape) != tuple(sl.b.shape):
            raise ShardError(f"layer {layer}: gradients {tuple(dw.shape)} / {tuple(db.shape)} do not match its weights "
                             f"{tuple(sl.w.shape)} / {tuple(sl.b.shape)}")
        lr, momentum, weight_decay = sgd
        self.device.sgd_(sl.w, sl.vw, self.device.upload(np.ascontiguousarray(dw, np.float32)), lr, momentum,
                         weight_decay)
        if sl.spec.bias:                                                 # a layer without bias keeps b at 0
            self.device.sgd_(sl.b, sl.vb, self.device.upload(np.ascontiguousarray(db, np.float32)), lr, momentum, 0.0)
        sl.dw = sl.db = None

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
        The same two counts on half the batch (`half_batch`) separate what a call costs apart
        from its images, per kernel and not: what micro-batches add, and what a data-parallel
        layer (every kernel on a part of the images) pays. Each is the mean over a block of at
        least `repeats` calls and at least CALIBRATION_FLOOR_S (see there), one point after the
        other.

        Returns (kernels/s per layer at kernels[i], per-layer timing dicts)."""
        rng = np.random.default_rng(0)
        speeds, timings = [], []
        for li, (spec, shape, k) in enumerate(zip(specs, input_shapes, kernels)):
            x = rng.standard_normal(shape, dtype=np.float32)
            counts = sorted({max(1, int(k)), max(1, int(k) // 2)}, reverse=True)
            layers = [self._calibration_weights(spec, count, rng) for count in counts]
            need_dx = li > 0
            timers = [self._call_timer(spec, x, w_dev, b_dev, need_dx) for w_dev, b_dev in layers]
            half = np.ascontiguousarray(x[:shape[0] // 2]) if shape[0] >= 2 else None
            if half is not None:
                # the smaller count first: the path a CPU device times for it is kept for the larger
                timers += [self._call_timer(spec, half, w_dev, b_dev, need_dx) for w_dev, b_dev in reversed(layers)]
            means = self._mean_times(timers, repeats)
            fwd = [f for f, _ in means[:len(counts)]]
            bwd = [b for _, b in means[:len(counts)]]
            speeds.append(counts[0] / (fwd[0] + bwd[0]))
            timing = {"batch": int(shape[0]), "kernels": counts, "forward_s": fwd, "backward_s": bwd}
            if half is not None:
                timing["half_batch"] = self._half_batch_timing(half, counts, means[len(counts):][::-1])
            timing.update(self._time_update(layers[0][0], repeats))
            timings.append(timing)
        return speeds, timings

    def _mean_times(self, timers, min_calls):
        """Each timer (a call that returns a tuple of seconds, one per phase) once untimed, then
        in a block of calls of its own until the block has run at least `min_calls` calls and
        CALIBRATION_FLOOR_S, or CALIBRATION_MAX_CALLS calls. -> per timer, each phase's mean:
        the block's time over its calls, split between the phases as they measured. A block is
        the window a core shared by time slices averages over: every stall in it is counted once
        (in the gaps between timed phases too) and its edges miss at most one slice. Calls of
        several timers alternated one by one would share the stalls by where the slices happen
        to fall in the round, not by their length."""
        means = []
        for timer in timers:
            timer()                                # warm-up: JIT compilation, buffer growth
            totals, calls = None, 0
            start = self.clock()
            while True:
                seconds = timer()
                totals = seconds if totals is None else tuple(a + b for a, b in zip(totals, seconds))
                calls += 1
                block = self.clock() - start
                if calls >= max(1, min_calls) and (block >= CALIBRATION_FLOOR_S or calls >= CALIBRATION_MAX_CALLS):
                    break
            measured = sum(totals)
            scale = block / measured if measured > 0 else 1.0
            means.append(tuple(float(t * scale / calls) for t in totals))
        return means

    def _time_update(self, w_dev, repeats):
        """What a step pays per layer whatever its batch: the SGD update of the weights held (with
        what a device redoes for weights that changed: the CPU's FFT path recomputes their kernel
        spectra there), and adding one micro-batch's gradient into the step's sum. Both scale
        with the kernels held. The update runs on the timed weights themselves, which lr = 0 and
        zero gradients leave bit for bit as they were, so that what the device keeps for them is
        redone as after a real update."""
        d = self.device
        v, g = d.zeros_like(w_dev), d.zeros_like(w_dev)

        def update_and_add():
            t0 = self.clock()
            d.sgd_(w_dev, v, g, 0.0, 0.9, 0.0)
            d.synchronize()
            t1 = self.clock()
            d.accumulate_(v, g)
            d.synchronize()
            return t1 - t0, self.clock() - t1

        (sgd, add), = self._mean_times([update_and_add], repeats)
        return {"update_kernels": int(w_dev.shape[0]), "update_s": sgd, "accumulate_s": add}

    @staticmethod
    def _half_batch_timing(x, counts, means):
        """The kernel counts again on half the images (`means` in the order of `counts`): with the
        full-batch times they separate what each call costs whatever its batch (weights
        reordered, dW written, kernel spectra streamed) from the per-image cost. The cost model
        charges it once per micro-batch."""
        return {"batch": int(x.shape[0]), "kernels": list(counts), "forward_s": [f for f, _ in means],
                "backward_s": [b for _, b in means]}

    def _calibration_weights(self, spec, k, rng):
        fan_in = spec.in_channels * spec.kh * spec.kw
        w = default_init(rng, (k, spec.in_channels, spec.kh, spec.kw), fan_in)
        return self.device.upload(w), self.device.upload(np.zeros(k, np.float32))

    def _call_timer(self, spec, x, w_dev, b_dev, need_dx):
        kept = []                                  # dW written into the last call's, as a step's backward does

        def time_once():
            """(forward seconds, backward seconds) of one fused call."""
            t0 = self.clock()
            y, ctx = self.device.conv_block(x, w_dev, b_dev, spec.block)
            self.device.synchronize()
            t1 = self.clock()
            _, dw, _ = self.device.conv_block_backward(ctx, w_dev, np.ones_like(y), need_dx,
                                                       dw_out=kept[0] if kept else None)
            self.device.synchronize()
            kept[:] = [dw]
            return t1 - t0, self.clock() - t1

        return time_once


class ShardServer:
    """The requests one shard serves, by op: the table a worker process runs for every message
    from the coordinator, and the one `--local` calls in-process with no sockets. Arrays of
    feature maps and gradients arrive and leave in the plan's wire dtype (transport.wire), which
    every LOAD names: it is fixed once per plan, not sent with every message."""

    def __init__(self, shard):
        self.shard = shard
        self.handlers = {"CALIBRATE": self.calibrate, "LOAD": self.load, "FORWARD": self.forward,
                         "BACKWARD": self.backward, "FETCH": self.fetch}

    def handle(self, op, arrays, fields):
        """-> (reply op, arrays, fields). Raises ShardError for what it cannot serve."""
        handler = self.handlers.get(op)
        if handler is None:
            raise ShardError(f"a worker does not serve {op!r} here: expected one of {sorted(self.handlers)}")
        check_fields(op, fields)
        return handler(arrays, fields)

    def calibrate(self, arrays, f):
        specs = [ConvSpec.from_json(layer["spec"]) for layer in f["layers"]]
        shapes = [tuple(layer["input_shape"]) for layer in f["layers"]]
        kernels = [int(layer["kernels"]) for layer in f["layers"]]
        speeds, timings = self.shard.calibrate(specs, shapes, kernels, repeats=f["repeats"])
        return "CALIBRATED", [], {"speeds": speeds, "timings": timings,
                                  "conv_paths": self.shard.device.conv_path_choices()}

    def load(self, arrays, f):
        vw, vb = (arrays[2], arrays[3]) if len(arrays) == 4 else (None, None)
        self.shard.wire = check_wire_dtype(f["wire"])
        self.shard.load(int(f["layer"]), ConvSpec.from_json(f["spec"]), int(f["start"]), int(f["stop"]),
                        arrays[0], arrays[1], vw, vb)
        return "LOADED", [], {"layer": f["layer"]}

    def forward(self, arrays, f):
        wire = self.shard.wire
        y = self.shard.forward(int(f["layer"]), decode(arrays[0], wire), int(f["micro"]), bool(f["keep"]))
        return "FORWARD_DONE", [encode(y, wire)], {"layer": f["layer"]}

    def backward(self, arrays, f):
        wire = self.shard.wire
        sgd = f["sgd"]
        dx = self.shard.backward(int(f["layer"]), decode(arrays[0], wire), bool(f["need_dx"]),
                                 int(f["micro"]), None if sgd is None else tuple(float(v) for v in sgd))
        return "BACKWARD_DONE", [] if dx is None else [encode(dx, wire)], {"layer": f["layer"]}

    def fetch(self, arrays, f):
        return "SHARD", list(self.shard.fetch(int(f["layer"]))), {"layer": f["layer"]}
