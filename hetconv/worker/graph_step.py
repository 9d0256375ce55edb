"""The worker side of the peer-exchange step, for every network: a chain is the graph whose blocks
each read the one before (engine.graph.GraphPass.chain).

Every worker runs the graph's steps itself (engine.graph.GraphPass, the code the coordinator runs
in the star exchange), over `LayoutBlocks`, an engine whose blocks are this worker's shard of each
conv block and whose tensors each live in a layout (engine/layouts.py): a worker's rows, its
channels (of one model block, or of each operand of a concatenation of them) or the whole. A
tensor moves only where a reader takes it in another layout (an
all-gather, or an all-to-all between rows and channels); a model block's partial dX is summed
into the layout its input is held in (a reduce-scatter into rows or channels, an all-reduce into
a whole tensor). An all-data network so moves only weight gradients and BatchNorm sums; a block's
output leaves for its readers micro-batch by micro-batch, under the next one's compute, and a
reader takes each micro-batch as it arrives (ArrivingParts), the images, the head's gradient and
the partial dX sums too. The joins (a residual sum, a concatenation, the ReLU and pools between
blocks) run on every worker on its part of their operands, with no traffic. The images come from
the coordinator in rows, and the features go back in their layout, micro-batch by micro-batch as
the block that makes them emits them.

Rounding points are those of the star exchange, where each block's input, output, gradient and
partial dX cross the wire once: a worker rounds each to the wire where it enters or leaves a
block, and nowhere else; what a block makes travels in the wire's dtype, a join's in float32.
"""
import time

import numpy as np

from hetconv.devices.base import as_layout_kept, is_channels_last
from hetconv.engine.chain import DropoutDraw
from hetconv.engine.contract import MAX_TRACE_SPANS, sum_in_order
from hetconv.engine.layouts import (ROWS, WHOLE, channel_blocks, covered, index_in, meeting, pieces, pieces_shape,
                                    read_in, step_reads, tensor_layouts)
from hetconv.engine.planner import layout_rows
from hetconv.transport import protocol
from hetconv.transport.wire import decode, encode, rounded


def _rounded(x, wire):
    """x as it would arrive over the wire, in the layout it is in (x itself for float32): a
    channels-last map a device made stays channels-last for the next block on this worker, which
    reads it in place (a C-contiguous copy would cost a reorder into NCHW and one back)."""
    x = as_layout_kept(np.asarray(x, np.float32))
    if wire == "float32":
        return x
    if is_channels_last(x):
        return rounded(x.transpose(0, 2, 3, 1), wire).transpose(0, 3, 1, 2)
    return rounded(x, wire)


class StepTrace:
    """What one worker did in a step, as spans from the step's start: each block's forward and
    backward (its compute, and inside it the waits for what it reads), each wait for a message
    (named by the message's phase, block and micro-batch), the updates. The coordinator asks for
    it on the steps it traces (STEP's `trace`); it comes back in STEP_DONE's fields, to the
    metrics, for hetconv-report's timeline of the step. A wait shorter than SHORTEST_WAIT_S is
    left out (a message that had already come), and at most MAX_TRACE_SPANS spans are kept."""
    SHORTEST_WAIT_S = 1e-4

    def __init__(self):
        self.t0 = time.perf_counter()
        self.spans = []

    def span(self, what, layer, micro, t0, t1):
        if len(self.spans) < MAX_TRACE_SPANS:
            self.spans.append([what, int(layer), int(micro), round(t0 - self.t0, 6), round(t1 - self.t0, 6)])

    def wait(self, phase, layer, micro, t0, t1):
        if t1 - t0 >= self.SHORTEST_WAIT_S:
            self.span(f"wait {phase}", layer, micro, t0, t1)

    def to_json(self):
        return {"spans": self.spans, "fields": ["what", "layer", "micro", "start_s", "end_s"]}


class ArrivingParts:
    """A tensor's parts per micro-batch, each received (`fetch(m)`) when it is first read, so its
    reader computes micro-batch m while m + 1 is still on the wire. Seconds spent receiving add
    to `clock[0]` (a block's compute time leaves them out)."""

    def __init__(self, count, fetch, clock):
        self._count, self._fetch, self._clock, self._got = count, fetch, clock, {}

    def __len__(self):
        return self._count

    def __getitem__(self, m):
        if not 0 <= m < self._count:
            raise IndexError(f"micro-batch {m} of {self._count}")
        if m not in self._got:
            t0 = time.perf_counter()
            self._got[m] = self._fetch(m)
            self._clock[0] += time.perf_counter() - t0
        return self._got[m]

    def __iter__(self):
        return (self[m] for m in range(self._count))


class LayoutBlocks:
    """GraphPass's engine on a worker where each tensor of the step has a layout (engine/layouts.py:
    this worker's rows of it, its channels (its blocks: layouts.pieces), or the whole), which
    every data block's one split of the images makes possible. A data block computes its rows
    from rows: nothing moves; its BatchNorm sums are added among the workers, and (with `rule`)
    its weight gradients leave for their sum as soon as its backward ends, while the blocks
    below compute (PeerLinks._after_backward). A model block reads a whole input and leaves its output in its
    channels; as each micro-batch's output is made, the part each reader's layout wants of it
    leaves for that reader (an all-gather where a model block reads it next, an all-to-all where a
    data block does), under the next micro-batch's compute. In backward its partial dX is summed
    into the layout its input is held in: each worker sends each other that worker's part of its
    partial, and sums the partials of its own part in plan order (a reduce-scatter into rows or
    channels, an all-reduce into a whole tensor). `convert` moves any other tensor or complete
    gradient between layouts: each worker is sent what it lacks of its part, by the worker that
    holds it. Block outputs and dX travel in the wire's dtype (a block rounds them there); a
    join's tensors in float32. Rounding points are those of the star exchange: a block's input,
    output, gradient and dX are rounded to the wire where they enter or leave it."""

    def __init__(self, links, step, sizes, rows, layouts, wire, dropout, compute, rule, on_features=None):
        self.links, self.step, self.wire = links, step, wire
        self.on_features = on_features         # (m, this worker's part in the wire's dtype), as each is made
        # seconds the compute thread spent not computing (sending, receiving, the BatchNorm sums'
        # exchange): a block's compute time leaves out what it added during the block
        self.waiting = [0.0]
        self.me, self.order = links.name, links.order
        self.rows, self.mine = rows, rows[links.name]        # {worker: [(r0, r1) per micro-batch]}
        self.plans = links.layer_plans
        self.layouts, self.modes = layouts, [lp.mode for lp in links.layer_plans]
        self.dropout, self.compute, self.rule = dropout, compute, rule
        self.bn_ghost_batch = links.norm_ghost_batch
        self.sizes = list(sizes)
        self.starts = [int(v) for v in np.cumsum([0] + self.sizes)[:-1]]   # each micro-batch's first row
        self.batch = sum(self.sizes)
        self.deferred, self.updates = [], []    # for PeerLinks._apply_updates once backward is done
        graph = links.graph
        # each block output's readers' layouts other than its own: the parts they want leave as
        # each micro-batch is made (_send_part), under the conversion key convert() reads them by
        self.block_output = {st.block: st.output for st in graph.steps if st.kind == "block"}
        wanted = read_in(graph.steps, self.step_reads, layouts)
        self.read_as = {j: [WHOLE] if WHOLE in w else w for j, w in wanted.items()}
        self.sent_ahead = set()                 # (phase, conversion key, layout) whose parts left as they were made

    def step_reads(self, st):
        return step_reads(st, self.modes, self.links.graph.norms, self.layouts)

    def _blocks(self, layout, m, channels):
        """{worker: [its blocks (r0, r1, c0, c1)]} of micro-batch m of a tensor of `channels` held
        in `layout` (engine/layouts.pieces: one, or one per operand of a renumbered concatenation)."""
        n, plans = self.sizes[m], self.plans
        return {w: pieces(layout, n, channels, self.rows[w][m], lambda b: plans[b].ranges[w],
                          lambda b: plans[b].kernels) for w in self.order}

    def _reduce(self, layer):
        if self.modes[layer] != "data" or len(self.order) < 2:
            return None
        return self.links._bn_reduce(self.step, layer, self.waiting)

    # ---- moving a tensor between layouts -----------------------------------------------------------
    def _send_part(self, phase, key, m, sent, have, want):
        """To each worker that lacks part of its blocks of `want`, what this worker holds of them
        (`sent`: its blocks of `have`, already in the wire's dtype)."""
        channels = self._channels_of(sent, have)
        hb, wb = self._blocks(have, m, channels), self._blocks(want, m, channels)
        lacking = {w: wb[w] for w in self.order if not covered(hb[w], wb[w])}
        self.links._send_encoded(self.step, phase, key, m, sent, hb[self.me], lacking)

    def _channels_of(self, own, have):
        """The whole tensor's channel count, from this worker's array `own` of it in `have`."""
        blocks = channel_blocks(have)
        if blocks:
            return sum(self.plans[b].kernels for b in blocks)
        return own.shape[1]

    def _receive_part(self, phase, key, m, own, have, want, wire, channels):
        """This worker's blocks of `want` of micro-batch m: from its own blocks `own` of `have`
        where they cover them, else assembled from what each holder sent (_send_part)."""
        hb, wb = self._blocks(have, m, channels), self._blocks(want, m, channels)
        need, hw = wb[self.me], tuple(own.shape[2:])
        out = np.empty(pieces_shape(need) + hw, np.float32)
        if not out.size:
            return out                                   # no rows or no channels here
        mine = hb[self.me]
        if covered(mine, need):
            for part, i, k in meeting(mine, need):
                out[index_in(part, need, k)] = own[index_in(part, mine, i)]
            return out
        links = self.links
        meets = {w: meeting(hb[w], need) for w in self.order}
        got = links._await({(self.step, phase, key, m, w) for w in self.order if w != self.me and meets[w]}, self.step)
        for w, parts in meets.items():
            if not parts:
                continue
            if w == self.me:
                for part, i, k in parts:
                    out[index_in(part, need, k)] = own[index_in(part, mine, i)]
                continue
            rows = parts[0][0][1] - parts[0][0][0]
            sent = decode(links._check(f"step {self.step}: {phase} {key} of micro-batch {m}", w,
                                       got[(self.step, phase, key, m, w)],
                                       (rows, sum(p[3] - p[2] for p, _, _ in parts)) + hw), wire)
            c = 0
            for part, _, k in parts:
                out[index_in(part, need, k)] = sent[:, c:c + part[3] - part[2]]
                c += part[3] - part[2]
        return out

    def convert(self, arrays, have, want, direction, key, exact=False):
        """Per micro-batch, `arrays` (this worker's parts in layout `have`) as its parts in layout
        `want`, sent under `key` (phase "gather" in forward, "gather_grad" in backward); `exact`:
        the values are the wire's (a block's output or dX), so they travel in its dtype."""
        phase = "gather" if direction == "forward" else "gather_grad"
        wire = self.wire if exact else "float32"
        if have != WHOLE and (phase, key, want) not in self.sent_ahead:     # from whole, nothing moves
            for m, a in enumerate(arrays):
                self._send_part(phase, key, m, encode(np.ascontiguousarray(a, np.float32), wire), have, want)
        return ArrivingParts(len(arrays), lambda m: self._receive_part(
            phase, key, m, arrays[m], have, want, wire, self._channels_of(arrays[m], have)), self.waiting)

    # ---- GraphPass's engine ------------------------------------------------------------------------
    def forward_layer(self, layer, xs, train, step=None):
        model = self.modes[layer] != "data"
        shard, out = self.links.shard, {}
        node = self.block_output[layer]
        key = self.links.graph.conversion_key(node)
        ahead = self.read_as.get(node, [])

        def inputs():
            for m, x in enumerate(xs):
                yield m, _rounded(x, self.wire), self.starts[m] + (0 if model else self.mine[m][0])

        def emit(m, y):
            t0 = time.perf_counter()
            shard.device.synchronize()
            # what leaves travels C-contiguous; what stays here keeps the device's layout
            sending = bool(ahead) or features
            sent = encode(np.ascontiguousarray(y, np.float32), self.wire) if sending else None
            out[m] = decode(sent, self.wire) if sending and self.wire != "float32" else _rounded(y, self.wire)
            for want in ahead:
                self._send_part("gather", key, m, sent, self.layouts[node], want)
            if features:
                self.on_features(m, sent)
            self.waiting[0] += time.perf_counter() - t0

        features = self.on_features is not None and node == self.links.graph.feature
        t0, waited = time.perf_counter(), self.waiting[0]
        shard.forward_layer(layer, inputs(), train, self._reduce(layer), emit, self.dropout, batch=self.batch)
        t1 = time.perf_counter()
        self.compute[layer] += t1 - t0 - (self.waiting[0] - waited)
        if self.links.trace is not None:
            self.links.trace.span("forward", layer, -1, t0, t1)
        self.sent_ahead.update(("gather", key, want) for want in ahead)
        return [out[m] for m in range(len(xs))]

    def backward_block(self, layer, grads, need_dx, into):
        """Block `layer`'s backward from its output's gradient (in its layout) -> (its dX, the
        layout it is in): a data block's in its rows, a model block's partial summed into `into`
        (the layout its input is held in)."""
        model = self.modes[layer] != "data"
        shard, dx_own = self.links.shard, {}
        channels = shard.layers[layer].spec.in_channels
        # a data block's dX, complete for its rows, leaves for the layout its input is held in as
        # each micro-batch's is made (GraphPass.backward's conversion, under the same key)
        key = self.links.graph.conversion_key(self.block_output[layer])
        ahead = not model and need_dx and into != ROWS

        def emit(m, dx):
            if not need_dx:
                return
            t0 = time.perf_counter()
            shard.device.synchronize()
            if model:
                n = self.sizes[m]
                dx_own[m] = self.links._send_blocks(self.step, "backward", layer, m,
                                                    np.ascontiguousarray(dx, np.float32), [(0, n, 0, channels)],
                                                    self._blocks(into, m, channels), self.wire)
            elif ahead:
                sent = encode(np.ascontiguousarray(dx, np.float32), self.wire)
                dx_own[m] = decode(sent, self.wire) if self.wire != "float32" else _rounded(dx, self.wire)
                self._send_part("gather_grad", key, m, sent, ROWS, into)
            else:
                dx_own[m] = _rounded(dx, self.wire)
            self.waiting[0] += time.perf_counter() - t0

        t0, waited = time.perf_counter(), self.waiting[0]
        shard.backward_layer(layer, ((m, _rounded(g, self.wire)) for m, g in enumerate(grads)), need_dx,
                             self._reduce(layer), emit)
        shard.device.synchronize()
        t1 = time.perf_counter()
        self.compute[layer] += t1 - t0 - (self.waiting[0] - waited)
        trace = self.links.trace
        if trace is not None:
            trace.span("backward", layer, -1, t0, t1)
        if self.rule is not None:
            self.links._after_backward(self.step, layer, self.rule, self.rule.max_norm > 0, self.deferred,
                                       self.updates, self.compute)
            if trace is not None:
                trace.span("after backward", layer, -1, t1, time.perf_counter())
        if not need_dx:
            return [None] * len(grads), into if model else ROWS
        if not model:
            if ahead:
                self.sent_ahead.add(("gather_grad", key, into))
            return [dx_own[m] for m in range(len(grads))], ROWS
        return ArrivingParts(len(grads), lambda m: self._sum_partials(layer, m, dx_own[m], into, channels),
                             self.waiting), into

    def _sum_partials(self, layer, m, whole, into, channels):
        """A model block's dX of micro-batch m in this worker's part of layout `into`: every
        worker's partial of that part (`whole`: this worker's, rounded), summed in plan order."""
        links, step = self.links, self.step
        mine, hw = self._blocks(into, m, channels)[self.me], tuple(whole.shape[2:])
        full = [(0, self.sizes[m], 0, channels)]
        own = np.empty(pieces_shape(mine) + hw, np.float32)
        for part, i, k in meeting(full, mine):
            own[index_in(part, mine, k)] = whole[index_in(part, full, i)]
        if not own.size:
            return own
        others = [w for w in self.order if w != self.me]
        got = links._await({(step, "backward", layer, m, w) for w in others}, step)
        return sum_in_order([own if w == self.me else decode(links._check(
            f"step {step}: conv{layer + 1} partial dX of micro-batch {m}", w, got[(step, "backward", layer, m, w)],
            own.shape), self.wire) for w in self.order])


def run_graph_step(links, seq, fields, step, micros, train, rule, sizes):
    """STEP (a chain's too, as GraphPass.chain): each tensor held in a layout (engine/layouts.py)
    among the workers: this worker's rows of the images from the coordinator, the graph over
    LayoutBlocks, the features back (its rows or channels of them, or the whole from the plan's
    first worker where they are whole) and, training, their gradient the same way; each data
    block's weight gradients summed among the workers as its backward ends, then the step's
    updates. -> STEP_DONE's fields."""
    graph, wire = links.graph, links.shard.wire
    links.trace = StepTrace() if fields.get("trace") else None
    rows = rows_of_step(links, step, sizes)
    compute = [0.0] * len(links.layer_plans)
    layouts = tensor_layouts(graph.steps, [lp.mode for lp in links.layer_plans], graph.norms)
    images_wire = wire if graph.images_exact else "float32"
    features_wire = wire if graph.features_exact else "float32"

    def images(m):
        key = (step, "INPUT", -1, m, "coordinator")
        r0, r1 = rows[links.name][m]
        got = links._await({key}, step)[key]
        return decode(links._check(f"step {step}: images of micro-batch {m}", "the coordinator", got,
                                   (r1 - r0,) + _image_shape(links, got)), images_wire)

    def send_features(m, encoded):
        links.send_to_coordinator(protocol.pack("FEATURES", seq, [encoded], step=step, micro=m))

    dropout = DropoutDraw(fields["seed"], fields["train_step"], sum(sizes)) if train else None
    # a block that makes the features sends each micro-batch's part as it is made, so the head
    # runs on micro-batch m while the block computes m + 1
    engine = LayoutBlocks(links, step, sizes, rows, layouts, wire, dropout, compute, rule if train else None,
                          on_features=send_features if graph.features_exact else None)
    features = graph.forward(engine, ArrivingParts(micros, images, engine.waiting), train)
    in_parts = layouts[graph.feature] != WHOLE        # each worker its rows or channels of them
    if not graph.features_exact and (in_parts or links.name == links.order[0]):
        for m, h in enumerate(features):
            send_features(m, encode(np.ascontiguousarray(h, np.float32), features_wire))
    done = {"step": step}
    if train:
        def gradient(m):
            key = (step, "GRAD", -1, m, "coordinator")
            return decode(links._check(f"step {step}: gradient of micro-batch {m}", "the coordinator",
                                       links._await({key}, step)[key], features[m].shape), features_wire)

        grads = ArrivingParts(len(features), gradient, engine.waiting)
        graph.backward(engine, grads)
        if rule is not None:
            t0 = time.perf_counter()
            done.update(links._apply_updates(step, rule, engine.deferred, engine.updates, compute))
            if links.trace is not None:
                links.trace.span("updates", -1, -1, t0, time.perf_counter())
    if links.trace is not None:
        done["trace"] = links.trace.to_json()
    return {**done, "layer_compute_s": compute, "compute_s": sum(compute), "peer_wait_s": links.wait_s,
            "peer_bytes_sent": links.bytes_sent}


def _image_shape(links, got):
    """(C, H, W) of the images the plan expects: the graph's input shape, or for a chain (whose
    pass knows no image size) its first block's channels and the H and W that came."""
    if links.graph.spec is not None:
        return tuple(links.graph.spec.input_shape)
    return (links.shard.layers[0].spec.in_channels,) + tuple(got.shape[2:] if got.ndim == 4 else (-1, -1))


def rows_of_step(links, step, sizes):
    """{worker: its rows of each micro-batch}: the images' layout (planner.layout_rows, the data
    blocks' one split, or an even one where every block is model-parallel)."""
    if sizes is None:
        raise ValueError(f"step {step}: STEP without 'sizes': a graph's step needs each micro-batch's image count")
    rows = layout_rows(links.layer_plans, sizes)
    if rows is None:
        raise ValueError(f"step {step}: the plan's data blocks split the images differently; a graph's data blocks "
                         f"split them alike (each tensor held in one worker's rows between them)")
    return rows
