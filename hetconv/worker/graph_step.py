"""The worker side of the peer-exchange step for a network that is a graph.

Every worker runs the graph's steps itself (engine.graph.GraphPass, the code the coordinator runs
in the star exchange), over `PeerBlocks`, an engine whose blocks are this worker's shard of each
conv block and whose tensors are made whole among the workers:
- forward: a block's input is whole here; a model block computes this worker's channels of every
  image, a data block every channel of this worker's images (its BatchNorms' sums added among the
  block's workers, as in a chain); each worker sends its block of the output to every other and
  builds the whole output from its own and theirs (an all-gather). The joins (a residual sum, a
  concatenation, the ReLU and pools between blocks) then run on every worker alike, on whole
  tensors, with no traffic: one pass over each tensor, repeated on each worker, where the
  alternative is a round of messages per join.
- backward: the gradient of a block's output is whole here (every reader's part summed in the
  same fixed order on every worker); the block takes its part of it. A model block's partial dX
  (every image, every input channel, this worker's kernels' share) goes to every other worker and
  each sums all of them in plan order (an all-reduce: the same float sum as the star's and
  --local's); a data block's dX (its images, whole) is all-gathered.
What it costs against a chain's step: a tensor that only per-channel work reads is gathered all
the same (in ResNets and Inception every join's output feeds a conv, which needs it whole anyway),
and a partial dX moves whole to every peer: P - 1 times its size out of each worker, where a
chain's reduce-scatter moves (P - 1) / P, P times less (resnet18 at batch 32 on two workers: 170
MB of partial dX a step where a reduce-scatter would move 85). `LayoutBlocks` below holds a
tensor in rows where data blocks make it, and there reduce-scatters the partial dX. The coordinator
sends the images (each worker 1/P of them, all-gathered) and gets the features from the plan's
first worker; both ways the arrays are float32, so the joins around them compute on what
--local's coordinator computes on.

Rounding points are those of the star exchange, where each block's input, output, gradient and
partial dX cross the wire once: a worker rounds each to the wire where it enters or leaves a
block, and nowhere else.
"""
import time

import numpy as np

from hetconv.engine.chain import DropoutDraw
from hetconv.engine.contract import sum_in_order
from hetconv.engine.layouts import ROWS, step_layout, tensor_layouts
from hetconv.engine.planner import image_ranges, layout_rows
from hetconv.transport import protocol
from hetconv.transport.wire import decode, encode
from hetconv.worker.blocks import block_shape, held_blocks, within


def _rounded(x, wire):
    """x as it would arrive over the wire (x itself for float32)."""
    return decode(encode(np.ascontiguousarray(x, np.float32), wire), wire)


class PeerBlocks:
    """GraphPass's engine on a worker: forward_layer / backward_layer of conv block `layer` with
    whole tensors in and out, over `links` (worker.peers.PeerLinks) in step `step` of `sizes`
    images per micro-batch. Seconds spent computing are added to `compute[layer]`."""

    def __init__(self, links, step, sizes, wire, dropout, compute):
        self.links, self.step, self.sizes, self.wire = links, step, list(sizes), wire
        self.offsets = [int(v) for v in np.cumsum([0] + self.sizes)[:-1]]
        self.dropout, self.compute = dropout, compute
        self.me, self.order = links.name, links.order
        self.bn_ghost_batch = links.norm_ghost_batch       # what the graph's BatchNorm nodes group by, as the blocks'

    def _reduce(self, layer, waited):
        lp = self.links.layer_plans[layer]
        return self.links._bn_reduce(self.step, layer, waited) if lp.mode == "data" and len(self.order) > 1 else None

    def _all_gather(self, phase, layer, parts, shapes, channels):
        """Per micro-batch m, the whole (n, channels, H, W) array of which each worker holds the
        block held_blocks gives it (`parts[m]`: this worker's, already rounded): the others'
        blocks from them, checked against the plan."""
        lp, links, step = self.links.layer_plans[layer], self.links, self.step
        out = []
        for m, n in enumerate(self.sizes):
            blocks = self._blocks(lp, n, channels, phase)
            senders = [w for w in self.order if w != self.me and block_shape(blocks[w])[0] * block_shape(blocks[w])[1]]
            got = links._await({(step, phase, layer, m, w) for w in senders}, step)
            hw = shapes[m]
            whole = np.empty((n, channels) + hw, np.float32)
            for w in self.order:
                b = blocks[w]
                if not block_shape(b)[0] * block_shape(b)[1]:
                    continue
                piece = parts[m] if w == self.me else decode(links._check(
                    f"step {step}: conv{layer + 1} {phase} block of micro-batch {m}", w,
                    got[(step, phase, layer, m, w)], block_shape(b) + hw), self.wire)
                whole[within(b, (0, n, 0, channels))] = piece
            out.append(whole)
        return out

    @staticmethod
    def _blocks(lp, n, channels, phase):
        """Each worker's block of the tensor an all-gather makes whole: a block's output (forward)
        as held_blocks has it; a data block's dX (backward), its images x every input channel."""
        if phase == "forward":
            return held_blocks(lp, n)
        return {w: (r0, r1, 0, channels) for w, (r0, r1) in image_ranges(lp, n).items()}

    def _send_all(self, phase, layer, m, array):
        """This worker's block of a tensor to every other worker, as the wire carries it; returns
        it rounded, as they see it."""
        sent = encode(np.ascontiguousarray(array, np.float32), self.wire)
        if len(array):
            for peer in self.order:
                if peer != self.me:
                    self.links._send_peer(peer, self.step, phase, layer, m, sent)
        return decode(sent, self.wire)

    # ---- GraphPass's engine ------------------------------------------------------------------------
    def forward_layer(self, layer, xs, train, step=None):
        lp = self.links.layer_plans[layer]
        shard = self.links.shard
        mine, waited, shapes = {}, [0.0], {}

        def inputs():
            for m, x in enumerate(xs):
                r0, r1 = held_blocks(lp, len(x))[self.me][:2] if lp.mode == "data" else (0, len(x))
                yield m, _rounded(x[r0:r1], self.wire), self.offsets[m] + r0

        def emit(m, y):
            t0 = time.perf_counter()
            shard.device.synchronize()
            shapes[m] = tuple(y.shape[2:])
            mine[m] = self._send_all("forward", layer, m, y)
            waited[0] += time.perf_counter() - t0

        t0 = time.perf_counter()
        shard.forward_layer(layer, inputs(), train, self._reduce(layer, waited), emit, self.dropout,
                            batch=sum(self.sizes))
        self.compute[layer] += time.perf_counter() - t0 - waited[0]
        return self._all_gather("forward", layer, mine, [shapes[m] for m in range(len(xs))], lp.kernels)

    def backward_layer(self, layer, grads, need_dx, rows=None):
        """The block's dX, whole; with `rows` ({worker: [(r0, r1) per micro-batch]}, a model
        block), each worker's rows of it: every worker sends each other only that worker's rows of
        its partial dX, and sums the partials of its own rows (a reduce-scatter, 1/P of the
        all-reduce's bytes, the same sums)."""
        lp = self.links.layer_plans[layer]
        shard = self.links.shard
        dx_own, waited = {}, [0.0]

        def pieces():
            for m, g in enumerate(grads):
                r0, r1, c0, c1 = held_blocks(lp, len(g))[self.me]
                yield m, _rounded(g[r0:r1, c0:c1], self.wire)

        def emit(m, dx):
            if not need_dx:
                return
            t0 = time.perf_counter()
            shard.device.synchronize()
            dx_own[m] = self._send_all("backward", layer, m, dx) if rows is None else \
                self._send_rows("backward", layer, m, dx, rows)
            waited[0] += time.perf_counter() - t0

        t0 = time.perf_counter()
        shard.backward_layer(layer, pieces(), need_dx, self._reduce(layer, waited), emit)
        shard.device.synchronize()
        self.compute[layer] += time.perf_counter() - t0 - waited[0]
        if not need_dx:
            return [None] * len(grads)
        channels = shard.layers[layer].spec.in_channels
        shapes = [tuple(dx_own[m].shape[2:]) for m in range(len(grads))]
        if lp.mode == "data":
            return self._all_gather("backward", layer, dx_own, shapes, channels)
        mine = [(0, n) for n in self.sizes] if rows is None else rows[self.me]
        return [self._sum_partials(layer, m, r1 - r0, dx_own[m], channels, shapes[m])
                for m, (r0, r1) in enumerate(mine)]

    def _send_rows(self, phase, layer, m, array, rows):
        """Each other worker's rows (`rows`) of micro-batch m's `array`, as the wire carries it
        (PeerLinks._send_blocks); returns this worker's rows of it, rounded, as they would arrive."""
        n, channels = array.shape[:2]
        receivers = {w: tuple(rows[w][m]) + (0, channels) for w in self.order}
        seen = self.links._send_blocks(self.step, phase, layer, m, np.ascontiguousarray(array, np.float32),
                                       (0, n, 0, channels), receivers, self.wire)
        r0, r1 = rows[self.me][m]
        return np.ascontiguousarray(seen[r0:r1])

    def _sum_partials(self, layer, m, n, own, channels, hw):
        """A model block's dX of micro-batch m (or this worker's `n` rows of it): every worker's
        partial, summed in plan order."""
        links, step = self.links, self.step
        others = [w for w in self.order if w != self.me] if n else []
        got = links._await({(step, "backward", layer, m, w) for w in others}, step)
        return sum_in_order([own if w == self.me else decode(links._check(
            f"step {step}: conv{layer + 1} partial dX of micro-batch {m}", w, got[(step, "backward", layer, m, w)],
            (n, channels) + hw), self.wire) for w in self.order])


class LayoutBlocks:
    """GraphPass's engine on a worker where each tensor of the step has a layout (engine/layouts.py:
    this worker's rows of it, or the whole), which every data block's one split of the images
    makes possible. A data block computes its rows from rows: nothing moves; its BatchNorm sums
    are added among the workers, and (with `rule`) its weight gradients leave for their sum as
    soon as its backward ends, while the blocks below compute (PeerLinks._after_backward). A
    model block reads whole tensors and makes its output whole, as the whole-tensor step
    (PeerBlocks) does. `convert` moves a tensor or a gradient between layouts: rows to whole is an
    all-gather (float32: a join's output is not a value the wire carries), whole to rows takes
    this worker's rows. Rounding points are the whole-tensor step's: a block's input, output,
    gradient and dX are rounded to the wire where they enter or leave it."""

    def __init__(self, links, step, sizes, rows, layouts, wire, dropout, compute, rule):
        self.links, self.step, self.wire = links, step, wire
        self.rows, self.mine = rows, rows[links.name]        # {worker: [(r0, r1) per micro-batch]}
        self.layouts, self.modes = layouts, [lp.mode for lp in links.layer_plans]
        self.dropout, self.compute, self.rule = dropout, compute, rule
        self.bn_ghost_batch = links.norm_ghost_batch
        self.sizes = list(sizes)
        self.starts = [int(v) for v in np.cumsum([0] + self.sizes)[:-1]]   # each micro-batch's first row
        self.batch = sum(self.sizes)
        self.whole = PeerBlocks(links, step, sizes, wire, dropout, compute)
        self.deferred, self.updates = [], []    # for PeerLinks._apply_updates once backward is done

    def step_layout(self, st):
        return step_layout(st, self.modes, self.links.graph.norms, self.layouts)

    def _reduce(self, layer, waited):
        return self.links._bn_reduce(self.step, layer, waited) if len(self.links.order) > 1 else None

    def forward_layer(self, layer, xs, train, step=None):
        if self.modes[layer] != "data":
            return self.whole.forward_layer(layer, xs, train, step)
        shard, mine, waited = self.links.shard, {}, [0.0]

        def inputs():
            for m, x in enumerate(xs):
                yield m, _rounded(x, self.wire), self.starts[m] + self.mine[m][0]

        def emit(m, y):
            t0 = time.perf_counter()
            shard.device.synchronize()
            mine[m] = _rounded(y, self.wire)
            waited[0] += time.perf_counter() - t0

        t0 = time.perf_counter()
        shard.forward_layer(layer, inputs(), train, self._reduce(layer, waited), emit, self.dropout, batch=self.batch)
        self.compute[layer] += time.perf_counter() - t0 - waited[0]
        return [mine[m] for m in range(len(xs))]

    def backward_layer(self, layer, grads, need_dx):
        if self.modes[layer] != "data":
            dx = self.whole.backward_layer(layer, grads, need_dx)
            self._after_backward(layer)
            return dx
        shard, dx_own, waited = self.links.shard, {}, [0.0]

        def emit(m, dx):
            if need_dx:
                t0 = time.perf_counter()
                shard.device.synchronize()
                dx_own[m] = _rounded(dx, self.wire)
                waited[0] += time.perf_counter() - t0

        t0 = time.perf_counter()
        shard.backward_layer(layer, ((m, _rounded(g, self.wire)) for m, g in enumerate(grads)), need_dx,
                             self._reduce(layer, waited), emit)
        shard.device.synchronize()
        self.compute[layer] += time.perf_counter() - t0 - waited[0]
        self._after_backward(layer)
        return [dx_own[m] for m in range(len(grads))] if need_dx else [None] * len(grads)

    def backward_layer_into_rows(self, layer, grads, need_dx):
        """A model block's backward whose input is held in rows: its dX in this worker's rows
        (PeerBlocks.backward_layer's reduce-scatter)."""
        dx = self.whole.backward_layer(layer, grads, need_dx, rows=self.rows)
        self._after_backward(layer)
        return dx

    def _after_backward(self, layer):
        if self.rule is not None:
            self.links._after_backward(self.step, layer, self.rule, self.rule.max_norm > 0, self.deferred,
                                       self.updates, self.compute)

    def convert(self, arrays, have, want, direction, key):
        """Per micro-batch, `arrays` (in layout `have`) in layout `want`: this worker's rows of a
        whole tensor, or the whole of a tensor each worker holds rows of (sent to every other
        worker under `key`, phase "gather" in forward, "gather_grad" in backward)."""
        if want == ROWS:
            return [np.ascontiguousarray(a[r0:r1]) for a, (r0, r1) in zip(arrays, self.mine)]
        links, step, phase = self.links, self.step, "gather" if direction == "forward" else "gather_grad"
        out = []
        for m, a in enumerate(arrays):
            a = np.ascontiguousarray(a, np.float32)
            if len(a):
                for peer in links.order:
                    if peer != links.name:
                        links._send_peer(peer, step, phase, key, m, a)
            senders = [w for w in links.order if w != links.name and self.rows[w][m][1] > self.rows[w][m][0]]
            got = links._await({(step, phase, key, m, w) for w in senders}, step)
            whole = np.empty((self.sizes[m],) + a.shape[1:], np.float32)
            for w in links.order:
                r0, r1 = self.rows[w][m]
                if r1 > r0:
                    whole[r0:r1] = a if w == links.name else links._check(
                        f"step {step}: {phase} {key} of micro-batch {m}", w, got[(step, phase, key, m, w)],
                        (r1 - r0,) + a.shape[1:])
            out.append(whole)
        return out


def _run_layout_step(links, seq, fields, step, micros, train, rule, sizes, rows):
    """run_graph_step where each tensor has a layout (engine/layouts.py): this worker's rows of
    the images from the coordinator, the graph over LayoutBlocks, the features back (its rows of
    them, or the whole from the plan's first worker where they are whole) and, training, their
    gradient the same way; each data block's weight gradients summed among the workers as its
    backward ends."""
    graph = links.graph
    compute = [0.0] * len(links.layer_plans)
    channels_hw = tuple(graph.spec.input_shape)
    layouts = tensor_layouts(graph.steps, [lp.mode for lp in links.layer_plans], graph.norms)
    mine = rows[links.name]
    xs = []
    for m in range(micros):
        key = (step, "INPUT", -1, m, "coordinator")
        r0, r1 = mine[m]
        xs.append(decode(links._check(f"step {step}: images of micro-batch {m}", "the coordinator",
                                      links._await({key}, step)[key], (r1 - r0,) + channels_hw), "float32"))
    dropout = DropoutDraw(fields["seed"], fields["train_step"], sum(sizes)) if train else None
    engine = LayoutBlocks(links, step, sizes, rows, layouts, links.shard.wire, dropout, compute,
                          rule if train else None)
    features = graph.forward(engine, xs, train)
    in_rows = layouts[graph.feature] == ROWS
    return _features_back(links, seq, step, features, in_rows or links.name == links.order[0], train, engine, compute,
                          lambda: links._apply_updates(step, rule, engine.deferred, engine.updates, compute)
                          if rule is not None else {})


def run_graph_step(links, seq, fields, step, micros, train, rule, sizes):
    """STEP for a graph: the images all-gathered, the graph forward over every micro-batch, the
    features to the coordinator (the plan's first worker sends them), and when training the
    gradient from it and the graph backward, then the step's updates (PeerLinks.finish_updates).
    Where the data blocks split the images alike, each tensor is held in a layout instead, a
    worker's rows or the whole (_run_layout_step).
    -> STEP_DONE's fields."""
    graph, wire = links.graph, links.shard.wire
    rows = rows_of_step(links, sizes)
    if rows is not None:
        return _run_layout_step(links, seq, fields, step, micros, train, rule, sizes, rows)
    others = [w for w in links.order if w != links.name]
    compute = [0.0] * len(links.layer_plans)
    xs, n = links._first_inputs(step, micros, sizes, "float32", others, whole=True)
    dropout = DropoutDraw(fields["seed"], fields["train_step"], sum(n)) if train else None
    engine = PeerBlocks(links, step, n, wire, dropout, compute)
    features = graph.forward(engine, [xs[m] for m in range(micros)], train)
    return _features_back(links, seq, step, features, links.name == links.order[0], train, engine, compute,
                          lambda: links.finish_updates(step, rule, range(len(links.layer_plans)), compute)
                          if rule is not None else {})


def _features_back(links, seq, step, features, send, train, engine, compute, updates):
    """The end of a graph step on a worker: its features to the coordinator where it `send`s them
    (float32), and when training their gradient back, the graph's backward over `engine`, then
    `updates()` (the step's updates -> STEP_DONE's extra fields). -> STEP_DONE's fields."""
    if send:
        for m, h in enumerate(features):
            links.send_to_coordinator(protocol.pack("FEATURES", seq, [np.ascontiguousarray(h, np.float32)],
                                                    step=step, micro=m))
    done = {"step": step}
    if train:
        grads = []
        for m, h in enumerate(features):
            key = (step, "GRAD", -1, m, "coordinator")
            grads.append(decode(links._check(f"step {step}: gradient of micro-batch {m}", "the coordinator",
                                             links._await({key}, step)[key], h.shape), "float32"))
        links.graph.backward(engine, grads)
        done.update(updates())
    return {**done, "layer_compute_s": compute, "compute_s": sum(compute), "peer_wait_s": links.wait_s,
            "peer_bytes_sent": links.bytes_sent}


def rows_of_step(links, sizes):
    """{worker: its rows of each micro-batch} where a step of the graph holds its tensors in
    layouts (two or more workers, every data block splitting the images alike, at least one data
    block; planner.layout_rows), else None: every tensor whole (PeerBlocks)."""
    if sizes is None or len(links.order) < 2 or not any(lp.mode == "data" for lp in links.layer_plans):
        return None
    return layout_rows(links.layer_plans, sizes)
