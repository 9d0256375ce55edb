"""A conv shard: one device's slice of every conv layer's kernels, with its SGD state.

This is the code a worker runs for every FORWARD / BACKWARD it serves, and the code `--local`
runs in-process, so the single-device baseline and a distributed run differ only in transport.
"""
import dataclasses
import os
import time

import numpy as np

from hetconv.engine.chain import DropoutDraw, LayerChain
from hetconv.update import UpdateRule, apply_update, slot_name
from hetconv.geometry import ConvSpec
from hetconv.devices.base import as_channels_last, as_layout_kept
from hetconv.devices.cpu import HostArrays
from hetconv.devices.wisdom import MAX_RECORD_CHOICES
from hetconv.params import default_init
from hetconv.transport.protocol import check_fields
from hetconv.transport.wire import carried_dtype, decode, encode

# Every calibration point (a kernel count on a batch, or the update) is the mean over timed calls
# that together measure at least CALIBRATION_FLOOR_S. A core shared with another busy process is
# shared in scheduler slices of several ms, so a call of a few ms runs either at full speed or
# stalled for a slice, and the median of a few such calls is one or the other by luck: a layer's
# fast/slow ratio read from medians of three calls can be off by several times. The mean over a
# window of many slices is what the shared core delivers. What it costs: at most about the floor
# per point beyond the calls that were timed anyway (four points per layer); a call that already
# takes longer than the floor is repeated no more than before, so a calibration takes about twice
# as long as with medians (bench/calibration_noise.py; its runs are in docs/bench-log.md). The cap
# on calls keeps tiny layers, whose calls are microseconds and whose untimed overhead then
# outweighs them, to a fraction of a second.
CALIBRATION_FLOOR_S = 0.25
CALIBRATION_MAX_CALLS = 1000
# HETCONV_CALIBRATION_FLOOR_S (seconds) sets another floor, for every process that inherits it: a
# shorter window calibrates faster and reads a shared core's speed less surely. The test suite,
# whose runs check a plan's arithmetic rather than its speed, sets 0.02.
FLOOR_ENV = "HETCONV_CALIBRATION_FLOOR_S"


def calibration_floor_s():
    """The floor a calibration point's window takes: CALIBRATION_FLOOR_S unless FLOOR_ENV says."""
    raw = os.environ.get(FLOOR_ENV)
    if not raw:
        return CALIBRATION_FLOOR_S
    try:
        floor = float(raw)
    except ValueError:
        floor = float("nan")
    if not 0 < floor <= 10:
        raise ShardError(f"{FLOOR_ENV}={raw!r}: expected the seconds a calibration point is timed over, above 0 "
                         f"and at most 10 (default {CALIBRATION_FLOOR_S})")
    return floor


class ShardError(ValueError):
    """A request the shard cannot serve (unknown layer, wrong shapes)."""


class _LayerSlice:
    """A shard's kernels [start, stop) of one conv layer: its state (device arrays for the conv's
    weights, bias and their optimizer slots; host arrays for the per-channel vectors of the
    tail's BatchNorms and theirs), the per-micro-batch contexts a step's backward needs, and the
    gradients summed over the step's micro-batches so far."""

    def __init__(self, device, spec, start, stop, state):
        self.spec, self.start, self.stop = spec, start, stop
        # the block the device runs and the input channels it reads: a grouped conv's slice holds
        # whole groups and reads only their channels (its partial dX is zero elsewhere)
        self.block, self.channels = spec.kernel_slice(start, stop)
        self.device_arrays = {}            # name -> the device's array: "w", "b", "w.momentum_buffer", ...
        self.host = {}                     # name -> numpy: "bn1.weight", "bn1.running_mean", their slots, ...
        for name, (a, on_device) in state.items():
            if on_device:
                self.device_arrays[name] = device.upload(a)
            else:
                self.host[name] = np.array(a, copy=True)
        self.w, self.b = self.device_arrays["w"], self.device_arrays["b"]
        self.ctx = {}                      # micro-batch -> what its backward needs
        self.dw = self.db = None           # the conv's gradients summed over the step's micro-batches so far
        self.dw_kept = None                # the last step's dW sum, which the next step writes over
        self.host_grads = {}               # the tail's parameter gradients of the step (whole-batch sums)
        self.ghost_batch = 0               # images per BatchNorm statistics group (0: the whole batch)
        self.groups = 1                    # statistics groups of the step in flight

    def array(self, name):
        return self.device_arrays[name] if name in self.device_arrays else self.host[name]

    def conv_input(self, x):
        """The channels of the layer input x (N, C, H, W) that this slice's kernels read."""
        c0, c1 = self.channels
        return x if (c0, c1) == (0, x.shape[1]) else x[:, c0:c1]

    def whole_dx(self, dx):
        """This slice's partial dX over the layer's every input channel (zero where its kernels
        read none), as the reduce-scatter of partial dX takes it."""
        c0, c1 = self.channels
        if dx is None or (c0, c1) == (0, self.spec.in_channels):
            return dx
        whole = np.zeros((dx.shape[0], self.spec.in_channels) + dx.shape[2:], np.float32)
        whole[:, c0:c1] = dx
        return whole

    def slots(self, param, rule):
        return {slot: self.array(slot_name(param, slot)) for slot in rule.slots}


class ConvShard:
    def __init__(self, device, clock=time.perf_counter):
        self.device = device
        self.host_device = HostArrays()    # updates of the per-channel vectors, the same arithmetic everywhere
        self.wire = "float32"              # feature maps and gradients between devices; the plan's LOADs set it
        self.layers = {}
        self.clock = clock                 # calibration's timer (tests give a fake one)

    def load(self, layer, spec, start, stop, state, optimizer="sgd", ghost_batch=0):
        """Kernels [start, stop) of conv layer `layer`: `state` maps the names of
        spec.state_layout() to this slice's arrays (per-kernel arrays cut to stop - start rows,
        scalars whole). Every param and buffer must be there, each of its shape and dtype;
        `optimizer`'s slots start at zero where they are not given; anything else is refused.
        `ghost_batch`: images per BatchNorm statistics group (0: the whole batch)."""
        if isinstance(ghost_batch, bool) or not isinstance(ghost_batch, int) or ghost_batch < 0 or ghost_batch == 1:
            raise ShardError(f"layer {layer}: ghost_batch {ghost_batch!r}: expected 0 (the whole batch) or at least 2")
        k = stop - start
        if not 0 <= start < stop <= spec.kernels:
            raise ShardError(f"layer {layer}: kernels [{start}, {stop}) are not a range of its {spec.kernels}")
        try:
            spec.kernel_slice(start, stop)
        except ValueError as e:
            raise ShardError(f"layer {layer}: {e}") from None
        self._check_runs(layer, spec)
        layout = spec.state_layout(optimizer)
        known = {a.name: a for a in layout}
        unknown = sorted(set(state) - set(known))
        if unknown:
            raise ShardError(f"layer {layer}: unknown state array(s) {unknown[:4]} for {spec.describe()} with "
                             f"{optimizer}: expected some of {sorted(known)}")
        arrays = {}
        for a in layout:
            shape = ((k,) + a.shape[1:]) if a.per_kernel else ()
            given = state.get(a.name)
            if given is None:
                if a.kind != "slot":
                    raise ShardError(f"layer {layer}: no {a.name!r} in its state (expected {sorted(known)})")
                given = np.zeros(shape, a.dtype)
            given = np.asarray(given)
            if tuple(given.shape) != shape or given.dtype != np.dtype(a.dtype):
                raise ShardError(f"layer {layer}: {a.name} is {given.dtype}{tuple(given.shape)}, kernels [{start}, "
                                 f"{stop}) of {spec.describe()} need {a.dtype}{shape}")
            arrays[a.name] = (given, a.on_device)
        self.layers[layer] = _LayerSlice(self.device, spec, start, stop, arrays)
        self.layers[layer].ghost_batch = ghost_batch

    def _check_runs(self, layer, spec):
        """ShardError naming the layer where this shard's device has no kernel for its conv."""
        declined = self.device.declines_block(spec.block)
        if declined:
            raise ShardError(f"conv layer {layer + 1} ({spec.describe()}): {declined}")

    def _layer(self, layer):
        if layer not in self.layers:
            raise ShardError(f"layer {layer} is not loaded on this shard (loaded: {sorted(self.layers)})")
        return self.layers[layer]

    def _chain(self, layer):
        return LayerChain(self.device, self._layer(layer), layer)

    def forward_layer(self, layer, inputs, train, reduce=None, emit=None, dropout=None, batch=None):
        """The layer over a step's micro-batches (engine.chain.LayerChain.forward): inputs are
        (micro-batch, x (N, C, H, W), its first row in the step's `batch` images; None: the inputs
        are the whole batch), taken one by one as they come (a caller may still be receiving the
        next); outputs are this shard's channels of the layer's output, emitted as they are final or
        returned by micro-batch."""
        sl = self._layer(layer)

        def checked():
            for m, x, row0 in inputs:
                if x.ndim != 4 or x.shape[1] != sl.spec.in_channels:
                    raise ShardError(f"layer {layer}: input shape {x.shape} does not have {sl.spec.in_channels} "
                                     f"channels (N, C, H, W)")
                yield m, x, row0
        return self._chain(layer).forward(checked() if batch is not None else list(checked()), train, reduce, emit,
                                          dropout, batch, sl.ghost_batch)

    def backward_layer(self, layer, grads, need_dx, reduce=None, emit=None):
        """Gradients of this shard's channels of the layer's output in, by micro-batch; partial dX
        out (None where not needed). Parameter gradients add up over the step."""
        return self._chain(layer).backward(grads, need_dx, reduce, emit)

    def forward(self, layer, x, micro=0, keep=True, dropout=None):
        """One micro-batch that is the layer's whole batch here (its BatchNorms' statistics are this
        call's): x (N, C, H, W) -> this shard's channels of the layer's output. With `keep`
        (training), what backward needs stays here until that backward."""
        return self.forward_layer(layer, [(micro, x, 0)], keep, dropout=dropout)[micro]

    def backward(self, layer, dout, need_dx, micro=0, update=None):
        """Gradient of this shard's channels in, partial dX (or None) out; `update` (an
        UpdateRule) on a layer's last micro-batch applies the step's one update (as `update`)."""
        dx = self.backward_layer(layer, [(micro, dout)], need_dx)[micro]
        if update is not None:
            self.update(layer, update)
        return dx

    def _params(self, sl):
        """(name, group, on device, gradient) of every parameter of a slice that trains this step."""
        grads = {"w": sl.dw, "b": sl.db}
        out = []
        for a in sl.spec.trained():
            g = grads.get(a.name) if a.on_device else sl.host_grads.get(a.name)
            out.append((a.name, a.group, a.on_device, g))
        return out

    def update(self, layer, rule):
        """The step's one update of a layer with the gradients its backward calls summed (rule: an
        engine.update.UpdateRule). Apart from backward, so a worker can send its last dX first and
        update while its peers receive it. The dW buffer is kept for the next step."""
        sl = self._layer(layer)
        if sl.dw is None:                  # no backward of this step ran here (no images): nothing to apply
            return
        self._apply(sl, rule, self._params(sl))
        sl.dw_kept, sl.dw, sl.db = sl.dw, None, None

    def _apply(self, sl, rule, params):
        for name, group, on_device, grad in params:
            if grad is None:
                continue
            device = self.device if on_device else self.host_device
            apply_update(device, sl.array(name), sl.slots(name, rule), grad, rule, group)
        sl.host_grads = {}

    def sum_of_squares(self, layer, given=None):
        """The squared norm of the layer's gradients of the step (float64): this shard's part of a
        global norm. `given`: the conv's (dW, db) summed over every worker (a data-parallel layer's,
        on the host), in place of the ones held here; a bias the layer does not have counts nothing."""
        sl = self._layer(layer)
        total = 0.0
        for name, group, on_device, grad in self._params(sl):
            if given is not None and on_device:
                grad, device = given[0 if name == "w" else 1], self.host_device
            else:
                device = self.device if on_device else self.host_device
            if grad is not None:
                total += device.sum_of_squares(grad)
        return total

    def take_gradients(self, layer):
        """(dW, db) of the conv summed over the step's micro-batches so far, as numpy float32, and
        forgotten here: a data-parallel layer's share of the step's gradient, which the workers sum
        among themselves before apply_update. Zeros when this shard had no images of the step. (The
        tail's parameter gradients are whole-batch sums already, the same on every worker.)"""
        sl = self._layer(layer)
        d = self.device
        if sl.dw is None:
            dw, db = np.zeros(sl.w.shape, np.float32), np.zeros(sl.b.shape, np.float32)
        else:
            dw, db = np.asarray(d.download(sl.dw), np.float32), np.asarray(d.download(sl.db), np.float32)
        sl.dw = sl.db = None               # handed out (the CPU's download is the array itself): not kept
        return dw, db

    def apply_update(self, layer, dw, db, rule):
        """The step's one update of a data-parallel layer with given conv gradients (summed over
        every worker) and the tail's own: every worker given the same arrays holds the same
        weights after it, bit for bit."""
        sl = self._layer(layer)
        if tuple(dw.shape) != tuple(sl.w.shape) or tuple(db.shape) != tuple(sl.b.shape):
            raise ShardError(f"layer {layer}: gradients {tuple(dw.shape)} / {tuple(db.shape)} do not match its weights "
                             f"{tuple(sl.w.shape)} / {tuple(sl.b.shape)}")
        given = {"w": self.device.upload(np.ascontiguousarray(dw, np.float32)),
                 "b": self.device.upload(np.ascontiguousarray(db, np.float32))}
        self._apply(sl, rule, [(name, group, on_device, given[name] if on_device else grad)
                               for name, group, on_device, grad in self._params(sl)])
        sl.dw = sl.db = None

    def fetch(self, layer):
        """{name: numpy array} of the slice's whole state, for snapshots and checkpoints."""
        sl = self._layer(layer)
        out = {name: np.asarray(self.device.download(a), np.float32) for name, a in sl.device_arrays.items()}
        out.update({name: np.array(a, copy=True) for name, a in sl.host.items()})
        return out

    def calibrate(self, specs, input_shapes, kernels, repeats=3):
        """Time the fused forward and backward on each layer's real input shape at two kernel
        counts, `kernels[i]` and half of it, after a warm-up of each that absorbs JIT compilation
        and buffer growth. Two points separate the per-kernel cost from the part every shard pays
        whatever its share (im2col, the input's trip through memory), which the cost model needs.
        The same two counts on half the batch (`half_batch`) separate what a call costs apart
        from its images, per kernel and not: what micro-batches add, and what a data-parallel
        layer (every kernel on a part of the images) pays. Each is the mean over a block of at
        least `repeats` calls and at least the floor (CALIBRATION_FLOOR_S), one point after the
        other.

        Returns (kernels/s per layer at kernels[i], per-layer timing dicts)."""
        rng = np.random.default_rng(0)
        speeds, timings = [], []
        for li, spec in enumerate(specs):           # every layer this device cannot run, before timing any
            self._check_runs(li, spec)
        for li, (spec, shape, k) in enumerate(zip(specs, input_shapes, kernels)):
            x = rng.standard_normal(shape, dtype=np.float32)
            if li > 0 and getattr(self.device, "channels_last", False):
                # a layer past the first gets its input in the layout the device's last layer left
                # it in (channels-last where the device keeps it): its price without a reorder the
                # step does not pay
                x = as_channels_last(x)
            counts = sorted({spec.whole_groups(max(1, int(k))), spec.whole_groups(max(1, int(k) // 2))}, reverse=True)
            slices = [self._calibration_slice(spec, count, rng) for count in counts]
            need_dx = li > 0
            timers = [self._call_timer(sl, x, need_dx) for sl in slices]
            half = as_layout_kept(x[:shape[0] // 2]) if shape[0] >= 2 else None
            if half is not None:
                # the smaller count first: the path a CPU device times for it is kept for the larger
                timers += [self._call_timer(sl, half, need_dx) for sl in reversed(slices)]
            means = self._mean_times(timers, repeats)
            fwd = [f for f, _, _ in means[:len(counts)]]
            bwd = [b_dx + b_rest for _, b_dx, b_rest in means[:len(counts)]]
            speeds.append(counts[0] / (fwd[0] + bwd[0]))
            timing = {"batch": int(shape[0]), "kernels": counts, "forward_s": fwd, "backward_s": bwd}
            if need_dx:             # how much of backward came before dX was handed over
                timing["backward_dx_s"] = [b_dx for _, b_dx, _ in means[:len(counts)]]
            if half is not None:
                timing["half_batch"] = self._half_batch_timing(half, counts, means[len(counts):][::-1])
            timing.update(self._time_update(slices[0].w, repeats))
            timings.append(timing)
        return speeds, timings

    def prepare_calls(self, calls):
        """Choose the conv path of each call shape of `calls` ((layer, spec, input shape, kernels)
        a step of the plan will run) whose first call would time the device's paths: the timing
        happens here, announced, and not inside the training step that meets the shape first (a
        CPU device times its paths once per call shape, seconds each). The device's timing runs
        the paths on zeros of the call's shapes; no layer runs, and the loaded slices, their
        statistics and gradients are not touched. Returns (call shapes asked, shapes timed,
        seconds)."""
        t0, ran = time.perf_counter(), 0
        for layer, spec, shape, k in calls:
            self._check_runs(layer, spec)
            k = spec.whole_groups(k)
            block, (c0, c1) = spec.kernel_slice(0, k)            # a slice of the layer's first k kernels
            x_shape = (shape[0], c1 - c0) + tuple(shape[2:])
            w_shape = (k,) + tuple(spec.weight_shape[1:])
            if not self.device.conv_block_needs_timing(x_shape, w_shape, block):
                continue
            x = np.zeros(x_shape, np.float32)
            if layer > 0 and getattr(self.device, "channels_last", False):
                x = as_channels_last(x)             # as the step hands it on (see calibrate)
            self.device.choose_conv_path(x, np.zeros(w_shape, np.float32), block)
            ran += 1
        return len(calls), ran, time.perf_counter() - t0

    def _mean_times(self, timers, min_calls):
        """Each timer (a call that returns a tuple of seconds, one per phase) once untimed, then
        in a block of calls of its own until the block has run at least `min_calls` calls and
        the floor (calibration_floor_s), or CALIBRATION_MAX_CALLS calls. -> per timer, each phase's mean:
        the block's time over its calls, split between the phases as they measured. A block is
        the window a core shared by time slices averages over: every stall in it is counted once
        (in the gaps between timed phases too) and its edges miss at most one slice. Calls of
        several timers alternated one by one would share the stalls by where the slices happen
        to fall in the round, not by their length."""
        means, floor = [], calibration_floor_s()
        for timer in timers:
            timer()                                # warm-up: JIT compilation, buffer growth
            totals, calls = None, 0
            start = self.clock()
            while True:
                seconds = timer()
                totals = seconds if totals is None else tuple(a + b for a, b in zip(totals, seconds))
                calls += 1
                block = self.clock() - start
                if calls >= max(1, min_calls) and (block >= floor or calls >= CALIBRATION_MAX_CALLS):
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
        return {"batch": int(x.shape[0]), "kernels": list(counts), "forward_s": [f for f, _, _ in means],
                "backward_s": [b_dx + b_rest for _, b_dx, b_rest in means]}

    def _calibration_slice(self, spec, k, rng):
        """A slice of `k` kernels of the layer with fresh weights, as a step would hold it."""
        fan_in = int(np.prod(spec.weight_shape[1:]))
        if spec.groups == 1:
            spec = dataclasses.replace(spec, kernels=k)
        k = spec.whole_groups(k)        # a grouped conv's slice: its first groups (calibrate counts so)
        state = spec.initial_state(default_init(rng, (k,) + spec.weight_shape[1:], fan_in))
        return _LayerSlice(self.device, spec, 0, k, {a.name: (state[a.name], a.on_device) for a in spec.state_layout()})

    def _call_timer(self, sl, x, need_dx):
        chain = LayerChain(self.device, sl, -1)
        dropout = DropoutDraw(0, 0, len(x))

        def time_once():
            """(forward seconds, backward seconds until dX was handed over, the rest of backward)
            of one call of the whole layer: the conv's fused block and the tail, dW written into
            the last call's, dX handed over as a step's backward hands it to the wire (the whole
            backward is before it where the path computes dX with dW, or no dX is asked)."""
            t0 = self.clock()
            y = chain.forward([(0, x, 0)], True, dropout=dropout)[0]
            self.device.synchronize()
            t1 = self.clock()
            handed = []

            def emit(m, dx):
                self.device.synchronize()
                handed.append(self.clock())

            chain.backward([(0, np.ones_like(y))], need_dx, emit=emit)
            self.device.synchronize()
            sl.dw_kept, sl.dw, sl.db, sl.host_grads = sl.dw, None, None, {}
            t2 = self.clock()
            t_dx = handed[0] if handed else t2
            return t1 - t0, t_dx - t1, t2 - t_dx

        return time_once


class ShardServer:
    """The requests one shard serves, by op: the table a worker process runs for every message
    from the coordinator, and the one `--local` calls in-process with no sockets. Arrays of
    feature maps and gradients arrive and leave in the plan's wire dtype (transport.wire), which
    every LOAD names: it is fixed once per plan, not sent with every message."""

    def __init__(self, shard):
        self.shard = shard
        self.handlers = {"CALIBRATE": self.calibrate, "PREPARE": self.prepare, "LOAD": self.load, "FORWARD": self.forward,
                         "BACKWARD": self.backward, "UPDATE": self.update, "NORM": self.norm, "FETCH": self.fetch}

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

    def prepare(self, arrays, f):
        calls = []
        for i, call in enumerate(f["calls"]):
            try:
                layer, spec = int(call["layer"]), ConvSpec.from_json(call["spec"])
                shape, kernels = [int(v) for v in call["input_shape"]], int(call["kernels"])
            except (KeyError, TypeError, ValueError) as e:
                raise ShardError(f"PREPARE call {i}: {e!r:.120}: expected layer, spec, input_shape and kernels")
            if len(shape) != 4 or min(shape) < 1 or shape[1] != spec.in_channels or not 1 <= kernels <= spec.kernels:
                raise ShardError(f"PREPARE call {i}: input shape {shape!r:.80} and {kernels} kernels do not fit conv "
                                 f"layer {layer + 1} ({spec.in_channels} input channels, {spec.kernels} kernels)")
            calls.append((layer, spec, shape, kernels))
        asked, ran, seconds = self.shard.prepare_calls(calls)
        return "PREPARED", [], {"calls": asked, "ran": ran, "seconds": seconds}

    def load(self, arrays, f):
        names = f["names"]
        if len(names) != len(arrays) or not all(isinstance(n, str) for n in names):
            raise ShardError(f"LOAD names {names!r:.120} do not name its {len(arrays)} arrays one each")
        try:
            self.shard.wire = carried_dtype(f["wire"])
        except ValueError as e:
            raise ShardError(f"LOAD: {e}") from None
        self.shard.load(int(f["layer"]), ConvSpec.from_json(f["spec"]), int(f["start"]), int(f["stop"]),
                        dict(zip(names, arrays)), f["optimizer"], f["bn_ghost_batch"])
        return "LOADED", [], {"layer": f["layer"]}

    @staticmethod
    def _micros(op, f, arrays):
        micros = f["micros"]
        if len(micros) != len(arrays) or not all(isinstance(m, int) and not isinstance(m, bool) for m in micros):
            raise ShardError(f"{op} micros {micros!r:.120} do not name its {len(arrays)} arrays one each")
        return micros

    def forward(self, arrays, f):
        """A layer over all of a step's micro-batches at once (the whole batch of its channels is here,
        so its BatchNorms' statistics are the batch's), in order."""
        wire = self.shard.wire
        micros, rows = self._micros("FORWARD", f, arrays), f["rows"]
        if len(rows) != len(micros):
            raise ShardError(f"FORWARD rows {rows!r:.120}: expected the first row of each of its {len(micros)} "
                             f"micro-batches")
        dropout = DropoutDraw(f["seed"], f["train_step"], f["batch"]) if f["train"] else None
        out = self.shard.forward_layer(int(f["layer"]), [(m, decode(a, wire), int(r)) for m, a, r in
                                                         zip(micros, arrays, rows)], f["train"], dropout=dropout,
                                       batch=f["batch"])
        return "FORWARD_DONE", [encode(out[m], wire) for m in micros], {"layer": f["layer"]}

    def backward(self, arrays, f):
        wire = self.shard.wire
        micros = self._micros("BACKWARD", f, arrays)
        out = self.shard.backward_layer(int(f["layer"]), [(m, decode(a, wire)) for m, a in zip(micros, arrays)],
                                        bool(f["need_dx"]))
        return "BACKWARD_DONE", [encode(out[m], wire) for m in micros] if f["need_dx"] else [], {"layer": f["layer"]}

    def update(self, arrays, f):
        try:
            rule = UpdateRule.from_json(f["update"])
        except (TypeError, ValueError) as e:
            raise ShardError(f"UPDATE: {e}") from None
        self.shard.update(int(f["layer"]), rule)
        return "UPDATED", [], {"layer": f["layer"]}

    def norm(self, arrays, f):
        total = sum(self.shard.sum_of_squares(layer) for layer in sorted(self.shard.layers))
        return "NORMED", [], {"sum_of_squares": float(total)}

    def fetch(self, arrays, f):
        """A layer's slice; with `conv_paths` true, also the device's conv path record
        (conv_path_record: what a checkpoint keeps), asked once per worker and gather. Layer -1
        with `conv_paths`: the record alone (a worker that holds no layer the gather fetches
        from it: every layer data-parallel, where the plan's first worker gives the weights). With
        `conv_path_choices` true, also the device's choices per call shape (conv_path_choices: every
        one, the rule's too, with its count of calls; the latest MAX_RECORD_CHOICES), which
        --precision auto's per-layer report reads; layer -1 with it: those alone."""
        paths = {"conv_paths": self.shard.device.conv_path_record()} if f.get("conv_paths") is True else {}
        if f.get("conv_path_choices") is True:
            paths["conv_path_choices"] = self.shard.device.conv_path_choices()[-MAX_RECORD_CHOICES:]
        if f["layer"] == -1 and paths:
            return "SHARD", [], {"layer": -1, "names": [], **paths}
        state = self.shard.fetch(int(f["layer"]))
        return "SHARD", list(state.values()), {"layer": f["layer"], "names": list(state), **paths}
