"""The peer step as data: from a plan, the list of tasks of one training step (each worker's block
forward and backward per micro-batch, the joins between blocks, every message, the head, the
updates), each with the resources it holds and the tasks it waits for; and its price, the
critical path through that list with each worker's compute thread, each host's link directions
and the coordinator as sequential resources.

The description (`describe_peer_step`) follows worker.graph_step's run of the step, micro-batch
by micro-batch; the cost model (`predict_peer_step`, `predict_any`) prices the description with
the calibrated task times and the link (`price`), and the planner prices its candidate plans so.
Each task names whose it is, its block and micro-batch, so a priced step reads as a timeline and
its critical path (`PricedStep.critical_path`) says what the step waits on.

Pricing is list scheduling in the order the tasks are issued, which is the order a worker's
compute thread or the coordinator runs them: a task starts once every task it waits for has
ended and each of its resources is free. Two kinds of task are priced from the link: a message
(`send`: the sender's uplink and the receiver's downlink, each host its own full-duplex link to
a switch) and the CPU work of moving one (`wire cpu`, half at each end, on that host's compute
resource). The weight gradients (`bulk`) travel on a connection of their own (worker.peers:
bulk) that the step's other messages, small and waited for, pass: each takes the link time those
leave, in the order issued, so they are issued once every other message is.
"""
from dataclasses import dataclass
import bisect
import heapq
import math

from hetconv.engine.costmodel import (FLOAT_BYTES, Prediction, batchnorm_sum_bytes, chain_shape,
                                      check_modes, largest_remainder, layer_geometry, predict_step, split_sizes,
                                      weight_gradient_bytes)
from hetconv.engine.layouts import (ROWS, WHOLE, channel_blocks, conversion_source, covered, input_layout,
                                    is_channels, meeting, pieces, read_in, step_reads, tensor_layouts)

COORDINATOR = "coordinator"
# what a task is: a block's forward or backward, a join's (or a BatchNorm node's) on a worker's
# part, the head on the coordinator, an update; a message, its CPU work, a weight-gradient message
COMPUTE = ("forward", "backward dx", "backward dw", "join forward", "join backward", "head", "update")
MESSAGES = ("send", "bulk")


@dataclass(frozen=True)
class Task:
    """One task of a step. `after`: the indices of the tasks it waits for (it starts once the
    last of them ends); `resources`: what it holds while it runs. A compute task's `seconds` are
    its calibrated time; a message's and its CPU work's come from the link when priced."""
    what: str                   # one of COMPUTE, MESSAGES, or "wire cpu"
    resources: tuple
    after: tuple
    seconds: float = 0.0
    worker: str = ""            # whose compute, or a message's sender
    layer: int = -1             # the conv block (-1: none)
    micro: int = -1             # the micro-batch (-1: the whole batch)
    to: str = ""                # a message's receiver
    nbytes: float = 0.0
    kind: str = ""              # a message's kind: what its bytes carry

    def among_workers(self):
        """A message between two workers (theirs to count), not to or from the coordinator."""
        return self.what in MESSAGES and COORDINATOR not in (self.worker, self.to)


@dataclass
class StepTasks:
    """One step's tasks in the order they are issued, the workers in plan order, and the count
    of conv blocks."""
    tasks: list
    workers: list
    layers: int

    def add(self, task):
        self.tasks.append(task)
        return (len(self.tasks) - 1,)


@dataclass
class PricedStep:
    """A step's tasks with each one's start and end (seconds from the step's start), each
    resource's busy seconds, and the step's seconds."""
    step: StepTasks
    start: list
    end: list
    busy: dict
    step_s: float
    # which task (index) held a task back where a resource, not a task it waits for, set its start
    held_by: dict

    def critical_path(self):
        """The tasks that set the step's length, first to last: from the task that ends last,
        back through whichever ended latest of the tasks it waited for and the task before it
        on its resources."""
        if not self.end:
            return []
        i = max(range(len(self.end)), key=lambda k: self.end[k])
        path = [i]
        while True:
            task = self.step.tasks[i]
            waited = [j for j in task.after if self.end[j] >= self.start[i]]
            # a task started late either for a task it waited for or for its resources, never both
            j = self.held_by.get(i, max(waited, key=self.end.__getitem__, default=None))
            if j is None:
                return path[::-1]
            path.append(j)
            i = j

    def critical_seconds(self):
        """{what: seconds} of the step's critical path, by what each of its tasks is (a block's
        forward, its dX, its dW, a join, the head, an update; a message by what it carries, its
        CPU work): what the step waits on. The seconds sum to the step's."""
        out, before = {}, 0.0
        for i in self.critical_path():
            task = self.step.tasks[i]
            label = (f"{task.kind} (message)" if task.what in MESSAGES else "message CPU" if task.what == "wire cpu"
                     else task.what)
            out[label] = out.get(label, 0.0) + self.end[i] - before
            before = self.end[i]
        return out


def price(step, link):
    """The priced step (PricedStep): list scheduling of `step`'s tasks in their order over
    sequential resources, a message's seconds and its CPU work's from `link` (costmodel.Link)."""
    free, busy, held_by = {}, {}, {}
    owner = {}                          # resource -> the task that last held it
    sent = {}                           # a host's direction -> [(start, end) of each send], in time order
    start, end = [], []
    for i, task in enumerate(step.tasks):
        ready = max((end[j] for j in task.after), default=0.0)
        if task.what == "bulk":
            s, e = _behind(task, ready, link, free, sent)
            seconds = task.nbytes / link.bytes_per_s + link.latency_s if task.nbytes else 0.0
        else:
            seconds = _seconds(task, link)
            if seconds is None:         # CPU work of a message where moving bytes costs no CPU
                start.append(ready)
                end.append(ready)
                continue
            s = max([ready] + [free.get(r, 0.0) for r in task.resources])
            e = s + seconds
            if task.what == "send":
                for r in task.resources:
                    sent.setdefault(r, []).append((s, e))
        blocking = [owner[r] for r in task.resources if r in owner and free[r] > ready and free[r] == s]
        if blocking:
            held_by[i] = blocking[0]
        for r in task.resources:
            if task.what != "bulk" or task.nbytes:
                free[r] = e
                owner[r] = i
            busy[r] = busy.get(r, 0.0) + seconds
        start.append(s)
        end.append(e)
    return PricedStep(step, start, end, busy, max(end, default=0.0), held_by)


def _seconds(task, link):
    if task.what == "send":
        return task.nbytes / link.bytes_per_s + link.latency_s
    if task.what == "wire cpu":
        return 0.5 * task.nbytes * link.host_cpu_s_per_byte if link.host_cpu_s_per_byte else None
    return task.seconds


def _behind(task, ready, link, free, sent):
    """(start, end) of a weight-gradient message in the link time the sends placed so far leave
    its hosts' two directions, from `ready` on; its own lanes take one such message at a time."""
    if not task.nbytes:
        return ready, ready
    src, dst = task.worker, task.to
    lanes = task.resources
    at = max([ready] + [free.get(r, 0.0) for r in lanes])
    left = task.nbytes / link.bytes_per_s + link.latency_s
    # each direction's sends lie in time order (a resource's tasks never overlap): from the first
    # that ends after `at`, the two merged
    later = []
    for r in (f"{src} out", f"{dst} in"):
        sends = sent.get(r, [])
        later.append(sends[bisect.bisect_right(sends, at, key=lambda s: s[1]):])
    begin = at
    for s, e in heapq.merge(*later):
        if e <= at:
            continue
        if s > at:
            if s - at >= left:
                break
            left -= s - at
        at = max(at, e)
    return begin, at + left


def predict_peer_step(specs, image_shape, batch, counts, images, profiles, link, coordinator_s, graph, modes,
                      micro_batches=1, value_bytes=FLOAT_BYTES, join_s=None):
    """Predicted seconds of one peer step of any network (a chain as the graph whose blocks each
    read the one before: costmodel.chain_shape): describe_peer_step's tasks, priced (price).
    Returns a costmodel.Prediction whose `priced` is the PricedStep."""
    step = describe_peer_step(specs, image_shape, batch, counts, images, profiles, coordinator_s, graph, modes,
                              micro_batches, value_bytes, join_s)
    return prediction_of(price(step, link), coordinator_s)


def prediction_of(priced, coordinator_s):
    """The costmodel.Prediction of a priced step: per worker its compute, wire and wait seconds,
    bytes and messages, per layer its compute; the bytes by what they carry."""
    step = priced.step
    names, layers = step.workers, step.layers
    totals = {w: {"compute_s": 0.0, "sent": 0, "recv": 0, "layer_compute_s": [0.0] * layers, "messages": 0}
              for w in names}
    kinds, coordinator_bytes = {}, 0.0
    for task in step.tasks:
        if task.what == "send" and COORDINATOR in (task.worker, task.to):
            coordinator_bytes += task.nbytes
        elif task.among_workers():
            totals[task.worker]["sent"] += task.nbytes
            totals[task.to]["recv"] += task.nbytes
            totals[task.worker]["messages"] += 1
            kinds[task.kind] = kinds.get(task.kind, 0.0) + task.nbytes
        elif task.what in COMPUTE and task.worker in totals:
            totals[task.worker]["compute_s"] += task.seconds
            if task.layer >= 0:
                totals[task.worker]["layer_compute_s"][task.layer] += task.seconds
    step_s = priced.step_s
    workers = {w: {"compute_s": t["compute_s"],
                   "wire_s": sum(v for r, v in priced.busy.items() if r.startswith(f"{w} ")),
                   "wait_s": max(0.0, step_s - t["compute_s"]), "sent": t["sent"], "recv": t["recv"],
                   "layer_compute_s": t["layer_compute_s"], "messages": t["messages"]}
               for w, t in totals.items()}
    pred = Prediction(step_s, coordinator_s, workers, [("step", -1, step_s)])
    pred.bytes_by_kind = {"images and features (coordinator)": coordinator_bytes, **kinds}
    pred.coordinator_bytes = coordinator_bytes
    pred.busy = dict(priced.busy)
    pred.priced = priced
    return pred


def describe_peer_step(specs, image_shape, batch, counts, images, profiles, coordinator_s, graph, modes,
                       micro_batches=1, value_bytes=FLOAT_BYTES, join_s=None):
    """One peer step's tasks (StepTasks) as worker.graph_step runs it: every worker's compute
    thread, every message between hosts and the coordinator's head. `images`: {worker: images of
    the batch} (the data blocks' one split; any equal weights where every block is
    model-parallel); counts: {worker: [kernels per layer]} (model blocks); profiles: {worker:
    costmodel.DeviceProfile}; graph: a costmodel.GraphShape.

    What it follows, per micro-batch:
    - the coordinator sends each worker its rows of the images; every tensor is held in a layout
      (engine/layouts.py: a worker's rows, a model block's channels, or the whole) and moves only
      where a step reads it in another (each worker sent what it lacks of its part by the worker
      that holds it); a block's output leaves for the layouts its readers want as each
      micro-batch of it is made, any other conversion when the reading step is reached; a step
      reads micro-batch m as soon as it has arrived, while m + 1 is still on the wire;
    - a block computes its micro-batches one after another on its worker's one compute thread
      (a BatchNorm in it waits for all of them, and a data block's adds its sums among the
      workers); a join (and a BatchNorm node between blocks, which waits for its every
      micro-batch) runs on each worker's compute thread on its part of the tensor: `join_s`
      {node: (forward s, backward s) on the whole batch} (engine/measure.measure_join_s) times
      the fraction of it the worker holds (none: they cost nothing here);
    - the features go to the coordinator as the block that makes them emits each micro-batch
      (after the forward where a join makes them); the head runs there per micro-batch and the
      gradient goes back;
    - backward in reverse: a model block's partial dX is sent, each worker its part of the
      layout its input is held in, as the device hands it over (before dW on the FFT and oneDNN
      direct paths), and summed when the step below reads it; a data block's dX leaves for its
      input's layout the same way, and its weight gradients leave for their sum when its
      backward ends, under the blocks below (in two rounds beyond two workers: chunks summed,
      then the sums all-gathered);
    - the updates at the end, once every sum a worker needs has arrived.
    Block outputs and dX travel in the wire's dtype (`value_bytes`), a join's tensors in float32;
    the images and the features in the wire's dtype where only blocks read or make them."""
    describer = _PeerStep(specs, image_shape, batch, counts, images, profiles, graph, check_modes(modes, len(specs)),
                          micro_batches, value_bytes, join_s)
    for st in describer.steps:
        describer.forward(st)
    grad = describer.features_and_head(coordinator_s)
    describer.backward(grad)
    describer.updates()
    return describer.out


@dataclass(frozen=True)
class _Step:
    """A graph step as GraphShape.steps holds it (engine/layouts reads kind, block, inputs, output)."""
    kind: str
    block: int
    inputs: tuple
    output: int


def _latest(*whens):
    """The moment all of `whens` have come (each a tuple of task indices: it comes when the last
    of them ends)."""
    return tuple(sorted(set().union(*whens)))


class _PeerStep:
    """The describer's state as it walks the graph: each worker's compute thread's place (`pc`:
    when it gets to what is described next), every tensor held in each layout per micro-batch,
    the gradients waiting for a step. A moment is a tuple of task indices (see _latest)."""

    def __init__(self, specs, image_shape, batch, counts, images, profiles, graph, modes, micro_batches, value_bytes,
                 join_s):
        self.specs, self.image_shape, self.batch, self.profiles, self.graph = specs, image_shape, batch, profiles, graph
        self.modes, self.value_bytes, self.join_s = modes, value_bytes, join_s or {}
        self.names = names = list(images)
        self.p = len(names)
        self.sizes = split_sizes(batch, micro_batches)
        self.M = len(self.sizes)
        # each worker's rows of each micro-batch, as the workers cut them (planner.layout_rows), and
        # its kernels of each model block: the blocks it holds
        cut = [largest_remainder(b, [images[w] for w in names], 0, "image") for b in self.sizes]
        self.rows = {w: [(sum(c[:i]), sum(c[:i + 1])) for c in cut] for i, w in enumerate(names)}
        self.counts = counts
        self.kernel_ranges = [{w: (sum(counts[v][li] for v in names[:i]), sum(counts[v][li] for v in names[:i + 1]))
                               for i, w in enumerate(names)} for li in range(len(specs))]
        self.floats = dict(graph.floats)
        self.steps = [_Step(*st) for st in graph.steps]
        self.layouts = tensor_layouts(self.steps, modes, graph.norms)
        self.geometry = layer_geometry(specs, image_shape, batch)
        self.block_outputs = {st.output: st.block for st in self.steps if st.kind == "block"}
        self.out = StepTasks([], names, len(specs))
        self.pc = {w: () for w in names}
        self.parts = {}
        self.behind = []            # weight-gradient messages, issued once every other message is
        self.summed_in = {w: () for w in names}
        # the images and the features in the wire's dtype where only blocks read the one and a block
        # makes the other (engine.graph.GraphPass: images_exact, features_exact)
        self.images_value = (value_bytes if all(st.kind == "block" for st in self.steps if -1 in st.inputs)
                             else FLOAT_BYTES)
        self.feature_value = value_bytes if graph.feature in self.block_outputs else FLOAT_BYTES
        self.wanted = read_in(self.steps, self.reads, self.layouts)
        self.ahead = {j: [WHOLE] if WHOLE in self.wanted.get(j, ()) else self.wanted.get(j, [])
                      for j in self.block_outputs}
        self.held = {(-1, ROWS): self.images_sent()}

    def reads(self, st):
        return step_reads(st, self.modes, self.graph.norms, self.layouts)

    # ---- who holds what ----------------------------------------------------------------------------
    def kernels_of(self, w, li):
        return self.specs[li].kernels if self.modes[li] == "data" else self.counts[w][li]

    def rows_of(self, w, li, m):
        r0, r1 = self.rows[w][m]
        return r1 - r0 if self.modes[li] == "data" else self.sizes[m]

    def part(self, layout, w, m):
        """The blocks (r0, r1, c0, c1) of micro-batch m that w holds in `layout` (layouts.pieces):
        rows of the micro-batch, channels as fractions of the tensor's."""
        key = (layout, w, m)
        if key not in self.parts:
            specs, blocks = self.specs, channel_blocks(layout)
            channels = sum(specs[b].kernels for b in blocks) if blocks else 1.0
            self.parts[key] = [(r0, r1, c0 / channels, c1 / channels) for r0, r1, c0, c1 in pieces(
                layout, self.sizes[m], channels, self.rows[w][m], lambda b: self.kernel_ranges[b][w],
                lambda b: specs[b].kernels)]
        return self.parts[key]

    def share(self, a, b, m):
        """The fraction of micro-batch m's tensor that blocks a and blocks b hold both."""
        return sum((p[1] - p[0]) * (p[3] - p[2]) for p, _, _ in meeting(a, b)) / self.sizes[m]

    def fraction(self, layout, w, m):
        """The fraction of micro-batch m's tensor that w holds in `layout`."""
        return self.share(self.part(layout, w, m), self.part(WHOLE, w, m), m)

    # ---- tasks ---------------------------------------------------------------------------------------
    def send(self, src, dst, nbytes, ready, kind):
        """A message (and its CPU work at both ends) -> when it has arrived."""
        if src == dst or nbytes <= 0:
            return ready
        self.wire_cpu(src, dst, nbytes, ready)
        return self.out.add(Task("send", (f"{src} out", f"{dst} in"), ready, worker=src, to=dst, nbytes=nbytes,
                                 kind=kind))

    def wire_cpu(self, src, dst, nbytes, ready):
        for host in (src, dst):
            self.out.add(Task("wire cpu", (host,), ready, worker=host, nbytes=nbytes))

    def send_gradients(self, src, dst, nbytes, ready):
        """Weight gradients, on a connection of their own: their CPU now, their message once
        every other message of the step is issued (place_behind)."""
        self.wire_cpu(src, dst, nbytes, ready)
        self.behind.append(Task("bulk", (f"{src} bulk out", f"{dst} bulk in"), ready, worker=src, to=dst,
                                nbytes=nbytes, kind="weight gradients"))

    def place_behind(self):
        for task in self.behind:
            self.summed_in[task.to] = _latest(self.summed_in[task.to], self.out.add(task))
        self.behind.clear()

    def run(self, w, what, li, m, ready, seconds):
        """A task on w's compute thread once `ready` -> when it ends."""
        self.pc[w] = self.out.add(Task(what, (w,), _latest(ready, self.pc[w]), seconds, worker=w, layer=li, micro=m))
        return self.pc[w]

    def join(self, node, direction, m):
        """A join's (or BatchNorm node's) forward (direction 0) or backward (1) on micro-batch m,
        each worker on its part of the tensor, on its compute thread."""
        seconds = self.join_s.get(node, (0.0, 0.0))[direction] * self.sizes[m] / self.batch
        if seconds > 0:
            for w in self.names:
                self.run(w, ("join forward", "join backward")[direction], -1, m, (),
                         seconds * self.fraction(self.layouts[node], w, m))

    def barrier(self, ready):
        """Every micro-batch's moments -> each worker's moment once it holds all of them."""
        return {w: _latest(*(r[w] for r in ready)) for w in self.names}

    def batchnorm_sums(self, li, at):
        """A data block's BatchNorm barriers: each worker's sums to every peer, one exchange per
        BatchNorm -> when each worker holds the totals."""
        for _ in self.specs[li].batchnorms:
            start = dict(at)
            for src in self.names:
                for dst in self.names:
                    if dst != src:
                        at[dst] = _latest(at[dst], self.send(src, dst, batchnorm_sum_bytes(self.specs[li]),
                                                             start[src], "BatchNorm sums"))
        for w in self.names:
            self.pc[w] = _latest(self.pc[w], at[w])
        return at

    # ---- moving tensors between layouts ------------------------------------------------------------
    def images_sent(self):
        """The images from the coordinator, each worker its rows of each micro-batch."""
        image_floats = math.prod(self.image_shape)
        arrived = []
        for m, b in enumerate(self.sizes):
            nbytes = {w: self.fraction(ROWS, w, m) * b * image_floats * self.images_value for w in self.names}
            arrived.append({w: self.send(COORDINATOR, w, nbytes[w], (), "images") for w in self.names})
        return arrived

    def convert(self, j, held, have, want, issued, per_value, kind):
        """Tensor j (or its gradient), held per micro-batch at `held` [{w: moment}] in layout
        `have`, to `want`: [{w: when its part has arrived}]. Each holder sends at `issued(m, w)`."""
        if have == want or have == WHOLE:
            return held
        out = []
        for m, b in enumerate(self.sizes):
            whole = b * self.floats[j] * per_value
            arrived = {}
            for v in self.names:
                need = self.part(want, v, m)
                arrived[v] = held[m][v]
                if covered(self.part(have, v, m), need):
                    continue
                for w in self.names:
                    piece = self.share(self.part(have, w, m), need, m) if w != v else 0.0
                    if piece > 0:
                        arrived[v] = _latest(arrived[v], self.send(w, v, whole * piece, issued(m, w), kind))
            out.append(arrived)
        return out

    def read(self, j, want):
        """Tensor j per micro-batch in layout `want`, converted (through another layout where
        layouts.conversion_source says) on first read."""
        if (j, want) not in self.held:
            source = conversion_source(j, want, self.layouts, self.wanted)
            if source != self.layouts[j]:
                self.read(j, source)
            have = self.held[(j, source)]
            exact = j in self.block_outputs
            early = exact and source == self.layouts[j] and want in self.ahead[j]
            pc = self.pc
            issued = (lambda m, w: have[m][w]) if early else (lambda m, w: _latest(pc[w], have[m][w]))
            kind = "block outputs" if exact and is_channels(source) else "layout gathers"
            per_value = self.value_bytes if exact else self.images_value if j == -1 else FLOAT_BYTES
            self.held[(j, want)] = self.convert(j, have, source, want, issued, per_value, kind)
        return self.held[(j, want)]

    # ---- forward -----------------------------------------------------------------------------------
    def forward(self, st):
        want = self.reads(st)
        ins = [self.read(j, input_layout(st, k, want, self.layouts)) for k, j in enumerate(st.inputs)]
        names, M = self.names, self.M
        if st.kind == "block":
            li = st.block
            done = [{w: self.run(w, "forward", li, m, ins[0][m][w], self.profiles[w].layers[li].forward_s(
                self.kernels_of(w, li), self.rows_of(w, li, m))) for w in names} for m in range(M)]
            if self.specs[li].batchnorms:
                whole = self.barrier(done)
                if self.modes[li] == "data" and self.p > 1:
                    whole = self.batchnorm_sums(li, whole)
                done = [dict(whole) for _ in range(M)]
        elif st.output in self.graph.norms:
            whole = self.barrier([{w: _latest(self.pc[w], r[w]) for w in names} for r in ins[0]])
            self.pc.update(whole)
            for m in range(M):
                self.join(st.output, 0, m)
            done = [dict(self.pc) for _ in range(M)]
        else:                   # a join: micro-batch by micro-batch as its inputs come
            done = []
            for m in range(M):
                for w in names:
                    self.pc[w] = _latest(self.pc[w], *(r[m][w] for r in ins))
                self.join(st.output, 0, m)
                done.append(dict(self.pc))
        self.held[(st.output, self.layouts[st.output])] = done

    def features_and_head(self, coordinator_s):
        """The features to the coordinator (each worker its part, or the whole from the first),
        the head there per micro-batch, and its gradient back (each worker its part, the whole to
        every worker where they are whole) -> [{w: when its gradient has arrived}]."""
        feature, names, layouts = self.graph.feature, self.names, self.layouts
        made = self.held[(feature, layouts[feature])]
        nbytes = [{w: self.fraction(layouts[feature], w, m) * self.sizes[m] * self.graph.feature_floats
                   * self.feature_value for w in names} for m in range(self.M)]
        senders = names if layouts[feature] != WHOLE else names[:1]
        grad = []
        for m, b in enumerate(self.sizes):
            arrived = _latest(*(self.send(w, COORDINATOR, nbytes[m][w], made[m][w] if feature in self.block_outputs
                                          else _latest(self.pc[w], made[m][w]), "features")
                                for w in senders))
            head = self.out.add(Task("head", (COORDINATOR,), arrived, coordinator_s * b / self.batch,
                                     worker=COORDINATOR, micro=m))
            grad.append({w: self.send(COORDINATOR, w, nbytes[m][w], head, "feature gradients")
                         for w in names})
        return grad

    # ---- backward ----------------------------------------------------------------------------------
    def backward(self, grad):
        """Every step's backward in reverse, from the features' gradient; the weight gradients'
        messages placed behind every other message, then (beyond two workers) each summed chunk
        to every peer once its sums are in."""
        requires = {-1: False}
        for st in self.steps:
            requires[st.output] = (st.kind == "block" or st.output in self.graph.norms
                                   or any(requires[j] for j in st.inputs))
        self.pending, self.after_sums = {self.graph.feature: grad}, []
        for st in reversed(self.steps):
            dy = self.pending.pop(st.output)
            if st.kind == "block":
                self.backward_block(st, dy, requires[st.inputs[0]])
            else:
                self.backward_join(st, dy, requires)
        self.place_behind()
        for li, after in self.after_sums:
            start = {w: _latest(self.pc[w], self.summed_in[w]) for w in self.names}
            for src in self.names:
                for dst in self.names:
                    if dst != src:
                        self.send_gradients(src, dst, after / (self.p - 1), start[src])
            self.place_behind()

    def give(self, j, ready):
        """Gradient of tensor j arriving per micro-batch at `ready`, with any given already."""
        if j in self.pending:
            self.pending[j] = [{w: _latest(a[w], b[w]) for w in self.names} for a, b in zip(self.pending[j], ready)]
        else:
            self.pending[j] = ready

    def backward_block(self, st, dy, need_dx):
        li, spec, names, M = st.block, self.specs[st.block], self.names, self.M
        data = self.modes[li] == "data"
        if spec.batchnorms:
            whole = self.barrier([{w: _latest(self.pc[w], r[w]) for w in names} for r in dy])
            if data and self.p > 1:
                whole = self.batchnorm_sums(li, whole)
            dy = [dict(whole) for _ in range(M)]
        dx_ready = []
        for m in range(M):
            ready = {}
            for w in names:
                cost, k, r = self.profiles[w].layers[li], self.kernels_of(w, li), self.rows_of(w, li, m)
                # dX leaves when the device hands it over: before dW where the path computes it
                # first (the FFT and oneDNN direct paths), so the backward is two tasks
                dx_s = cost.backward_dx_s(k, r) + (cost.accumulate_s(k) if m > 0 else 0.0)
                ready[w] = self.run(w, "backward dx", li, m, dy[m][w], dx_s)
                self.run(w, "backward dw", li, m, (), cost.backward_s(k, r) - cost.backward_dx_s(k, r))
            dx_ready.append(ready)
        if data and self.p > 1:
            dw, after = weight_gradient_bytes(spec, self.p)
            for src in names:
                for dst in names:
                    if dst != src:
                        self.send_gradients(src, dst, dw / (self.p - 1), self.pc[src])
            if after:
                self.after_sums.append((li, after))
        if not need_dx:
            return
        source = st.inputs[0]
        into = self.layouts[source]
        if data:
            self.give(source, self.convert(source, dx_ready, ROWS, into, lambda m, w: dx_ready[m][w],
                                           self.value_bytes, "layout gathers"))
            return
        (_, ch, h, wd), _ = self.geometry[li]
        arrived = []
        for m, b in enumerate(self.sizes):
            whole = b * ch * h * wd * self.value_bytes
            got = {}
            for v in names:
                got[v] = dx_ready[m][v]
                piece = self.fraction(into, v, m)
                for w in names:
                    if w != v and piece > 0:
                        got[v] = _latest(got[v], self.send(w, v, whole * piece, dx_ready[m][w],
                                                           "partial input gradients"))
            arrived.append(got)
        self.give(source, arrived)

    def backward_join(self, st, dy, requires):
        """A BatchNorm node's or a join's backward: it takes every micro-batch's gradient first."""
        have = self.reads(st)
        whole = self.barrier([{w: _latest(self.pc[w], r[w]) for w in self.names} for r in dy])
        self.pc.update(whole)
        for m in range(self.M):
            self.join(st.output, 1, m)
        ready = [dict(self.pc) for _ in range(self.M)]
        pc = self.pc
        for k, j in enumerate(st.inputs):
            if requires[j]:
                self.give(j, self.convert(j, ready, input_layout(st, k, have, self.layouts), self.layouts[j],
                                          lambda m, w: _latest(pc[w], ready[m][w]), FLOAT_BYTES, "layout gathers"))

    def updates(self):
        """Each worker's updates, block by block, once its backward is done and every sum it
        needs has arrived."""
        for w in self.names:
            ready = _latest(self.pc[w], self.summed_in[w])
            for li in range(len(self.specs)):
                ready = self.run(w, "update", li, -1, ready, self.profiles[w].layers[li].update_s(
                    self.kernels_of(w, li)))


def predict_any(exchange, specs, image_shape, batch, counts, profiles, link, coordinator_s, micro_batches=1,
                value_bytes=FLOAT_BYTES, modes=None, images=None, graph=None, join_s=None):
    """predict_peer_step for any network (a chain, `graph` None, priced as the graph whose blocks
    each read the one before: chain_shape) or, for --exchange star, costmodel.predict_step once
    per micro-batch (the star overlaps nothing, so micro-batches only add round trips; it has
    model layers only). images: {worker: [images of the batch per layer]}, read for the data
    layers, which split the images alike. join_s: the peer step's, see describe_peer_step (the
    star's joins are in `coordinator_s`)."""
    if exchange == "peer":
        modes = check_modes(modes, len(specs))
        data = [li for li, m in enumerate(modes) if m == "data"]
        if data and not (images and all(len(images.get(w, ())) == len(specs) for w in counts)):
            raise ValueError(f"data layers need images: {{worker: [images of the batch per layer]}} for each of "
                             f"{list(counts)}, got {images!r}")
        if data and not all(len({images[w][li] for li in data}) == 1 for w in counts):
            raise ValueError("the data layers split the images alike: each worker the same images in every one")
        # the images' rows: the data layers' split, or an even one (weights alike)
        rows = {w: images[w][data[0]] for w in counts} if data else {w: 1 for w in counts}
        return predict_peer_step(specs, image_shape, batch, counts, rows, profiles, link, coordinator_s,
                                 graph if graph is not None else chain_shape(specs, image_shape), modes,
                                 micro_batches, value_bytes, join_s)
    if exchange != "star":
        raise ValueError(f"exchange must be 'peer' or 'star', got {exchange!r}")
    if modes is not None and "data" in modes:
        raise ValueError("--exchange star moves every layer through the coordinator: its layers are model-parallel "
                         "only (use --exchange peer or --parallel model)")
    sizes = split_sizes(batch, micro_batches)
    parts = [predict_step(specs, image_shape, b, counts, profiles, link, coordinator_s * b / batch, value_bytes,
                          micro=m, micros=len(sizes))
             for m, b in enumerate(sizes)]
    workers = {w: {key: sum(p.workers[w][key] for p in parts) for key in parts[0].workers[w]} for w in counts}
    pred = Prediction(sum(p.step_s for p in parts), coordinator_s, workers, [ph for p in parts for ph in p.phases])
    pred.coordinator_bytes = sum(v["sent"] + v["recv"] for v in workers.values())
    return pred

