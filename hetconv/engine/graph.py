"""The conv part of a network that is a graph, over an engine's shards.

A graph's conv blocks (a conv and the per-channel layers the shards run after it) go through the
engine one at a time, as a chain's do (forward_layer / backward_layer: every micro-batch in one
request, so a block's BatchNorm sees the whole batch). What joins them runs here, on the
coordinator, which holds every block's whole output in this exchange: an `add` (a residual sum),
a `concat` (channels side by side), and the per-channel layers outside a block (the ReLU after a
residual sum, a pool on a concatenation or on the network's input). Their cost is one pass over
the tensors they touch, small beside the convs around them (resnet18 at batch 256: its largest
add is 64x32x32 per image, 67 MB, against the 1.2 GFLOP per image of the convs that feed it).

A BatchNorm between blocks (a pre-activation block's, on the previous block's sum) runs here on
the whole tensor too, exactly as in a block: in training its statistics are the step's whole batch
(every micro-batch's channel sums added in micro-batch order before any is normalised, and in
backward the sums of dy and dy*x_hat likewise: chain.group_sums, the code a block's BatchNorm
sums with), in evaluation the running ones. Its state (weight, bias, running statistics and the
optimizer's slots) lives in this pass, follows the blocks' in the conv part's state (load, gather)
and takes the step's update here with the host's update kernels, as the head's does. In the peer
exchange every worker runs this pass on the same whole tensors, so every worker holds a copy of
that state and moves it by the same arithmetic (as a data-parallel layer's copies). What it
costs: a barrier (every micro-batch's sum before the first is normalised) and one more pass over
the tensor each way, on every worker that runs the joins.

Backward walks the steps in reverse. A tensor read by several steps (a residual block's input:
the block and its skip path) gets the sum of their gradients, added in the reverse order of the
steps that read it, so one network and batch always give the same sums whatever the split.
"""
import math

import numpy as np

from hetconv.channelwise import (Activation, GlobalPool, Pool, batch_statistics, batchnorm_parameter_grads,
                                 eval_statistics, update_running_statistics)
from hetconv.devices.base import as_channels_last, as_layout_kept, concatenate, is_channels_last
from hetconv.engine.chain import ghost_groups, group_sums, statistics_segments
from hetconv.engine.costmodel import GraphShape
from hetconv.engine.layouts import conversion_source, input_layout, read_in
from hetconv.net.spec import Add, Concat, GraphStep
from hetconv.update import apply_update, slot_name


def graph_pass(spec, host):
    """What an engine runs `spec`'s conv part with (its `graph`): a GraphPass where the network is
    not a chain, None for a chain (the engine's own layer-by-layer step)."""
    return None if spec.is_chain() else GraphPass(spec, host)


def norm_states_from(names, arrays):
    """BatchNorm node states from a message: `names`, per node the names of its arrays, which
    follow one after the other in `arrays` -> [{name: array}] (GraphPass.load_norms then checks
    each against its node's layout). ValueError where they do not pair up."""
    if not isinstance(names, list) or not all(isinstance(n, list) and all(isinstance(k, str) for k in n)
                                              for n in names) or sum(map(len, names)) != len(arrays):
        raise ValueError(f"norms {str(names)[:200]}: expected per BatchNorm node the names of its arrays, "
                         f"{len(arrays)} in all")
    states, at = [], 0
    for node in names:
        states.append(dict(zip(node, arrays[at:at + len(node)])))
        at += len(node)
    return states


class GraphPass:
    """The steps of NetSpec.graph_steps() run over an engine (`forward_layer`, `backward_layer`)
    and `host`, a device whose activation and pool kernels the coordinator's nodes use."""

    def __init__(self, spec, host):
        self.spec = spec
        self.feature_shape = tuple(spec.feature_shape())
        self.steps = spec.graph_steps()
        self.feature = spec.feature_node()
        self.host = host
        self.norms = dict(zip(spec.norm_nodes(), spec.norm_specs()))     # node -> NormSpec, in order
        self.norm_state = {node: norm.initial_state() for node, norm in self.norms.items()}
        self.norm_grads = {}                # node -> {"weight": dweight, "bias": dbias} of the step
        self._index()

    @classmethod
    def chain(cls, blocks, feature_shape=None, host=None):
        """A chain's pass: `blocks` conv blocks, each reading the one before (the first, the
        images), no joins and no BatchNorm between them: what the peer step runs a chain as (it
        needs no NetSpec: tensor l is block l's output)."""
        self = cls.__new__(cls)
        self.spec, self.host = None, host
        self.feature_shape = None if feature_shape is None else tuple(feature_shape)
        self.steps = [GraphStep("block", l, (l - 1,), block=l) for l in range(int(blocks))]
        self.feature = int(blocks) - 1
        self.norms, self.norm_state, self.norm_grads = {}, {}, {}
        self._index()
        return self

    def _index(self):
        """What the steps imply: which tensors need a gradient, when each is last read, which
        are blocks' outputs, and conversion_key's stride."""
        # which tensors a gradient must reach: a block's output, a BatchNorm node's (its weight
        # and bias train), and what is made from one (the network's input and what is made from
        # it alone need none)
        requires = {-1: False}
        for st in self.steps:
            requires[st.output] = st.kind == "block" or st.output in self.norms or any(requires[j] for j in st.inputs)
        self.requires = requires
        self.block_outputs = {st.output for st in self.steps if st.kind == "block"}
        # the images and the features travel in the wire's dtype where only blocks read the one
        # and a block makes the other (the blocks round them there anyway), else in float32
        self.images_exact = all(st.kind == "block" for st in self.steps if -1 in st.inputs)
        self.features_exact = self.feature in self.block_outputs
        # after which step each tensor is read no more (its forward copy can go)
        last_read = {}
        for n, st in enumerate(self.steps):
            for j in st.inputs:
                last_read[j] = n
        self.last_read = last_read
        self._inputs_most = max([len(st.inputs) for st in self.steps] + [1])    # conversion_key's stride
        self._saved = {}

    # ---- the BatchNorm nodes' state ----------------------------------------------------------------
    def load_norms(self, states, optimizer):
        """Each BatchNorm node's state {name: array} in NetSpec.norm_nodes() order (copied; the
        optimizer's slots may be missing: they start at zero)."""
        if len(states) != len(self.norms):
            raise ValueError(f"the network has {len(self.norms)} BatchNorm nodes between its blocks, "
                             f"{len(states)} states were given")
        for (node, norm), state in zip(self.norms.items(), states):
            held = {}
            for a in norm.state_layout(optimizer):
                if a.name not in state and a.kind != "slot":
                    raise ValueError(f"BatchNorm node {self.spec.names[node]}: no {a.name} in its state")
                v = np.array(state[a.name], a.dtype, copy=True) if a.name in state else np.zeros(a.shape, a.dtype)
                if v.shape != tuple(a.shape):
                    raise ValueError(f"BatchNorm node {self.spec.names[node]}: {a.name} has shape {v.shape}, "
                                     f"expected {tuple(a.shape)}")
                held[a.name] = v
            self.norm_state[node] = held
        self.norm_grads = {}

    def norm_states(self):
        """Copies of each BatchNorm node's state, in NetSpec.norm_nodes() order."""
        return [{name: np.array(a, copy=True) for name, a in self.norm_state[node].items()} for node in self.norms]

    def norm_sum_of_squares(self):
        """The squared norm of the BatchNorm nodes' gradients of the step (float64)."""
        return sum(self.host.sum_of_squares(g) for grads in self.norm_grads.values() for g in grads.values())

    def update_norms(self, rule):
        """The step's one update of each BatchNorm node's weight and bias (`rule`, an UpdateRule)."""
        for node, grads in self.norm_grads.items():
            state = self.norm_state[node]
            for a in self.norms[node].trained():
                slots = {slot: state.setdefault(slot_name(a.name, slot), np.zeros(a.shape, a.dtype))
                         for slot in rule.slots}
                apply_update(self.host, state[a.name], slots, grads[a.name], rule, a.group)
        self.norm_grads = {}

    def shape(self):
        """What the cost model prices a graph's blocks with (costmodel.GraphShape)."""
        needs = {st.block: self.requires[st.inputs[0]] for st in self.steps if st.kind == "block"}
        shapes = self.spec.output_shapes()
        floats = {-1: math.prod(self.spec.input_shape)}
        floats.update({st.output: math.prod(shapes[st.output]) for st in self.steps})
        return GraphShape(tuple(needs[b] for b in sorted(needs)), math.prod(self.feature_shape),
                          steps=tuple(("concat" if isinstance(st.layer, Concat) else st.kind, st.block,
                                       tuple(st.inputs), st.output) for st in self.steps),
                          floats=tuple(sorted(floats.items())), norms=tuple(self.norms), feature=self.feature)

    def conversion_key(self, node, k=0):
        """A step's unique number for converting a tensor between layouts: in forward, the tensor's
        node (converted once per layout); in backward, the reading node and which of its inputs
        (a tensor may be read by several nodes, or twice by one). In range(conversion_keys())."""
        return (node + 1) * self._inputs_most + k

    def conversion_keys(self):
        return (max([st.output for st in self.steps] + [-1]) + 2) * self._inputs_most

    # ---- forward ---------------------------------------------------------------------------------
    def forward(self, engine, xs, train, step=None):
        """The feature maps per micro-batch (the flatten's input). Training keeps each node's
        contexts for backward; the blocks keep theirs on the shards. Where the engine holds
        tensors in layouts (`engine.layouts`, engine/layouts.py: a worker's rows, its channels or
        the whole), each step reads its inputs in its own layout (a concatenation of channel
        ranges each operand as it is held: layouts.input_layout), converted by the engine where
        they differ (once per tensor and layout), and the tensors given and returned are in their
        layouts. A block's output is a value the wire carries (each block rounds it there), so it
        moves in the wire's dtype; a join's, in float32."""
        layouts = getattr(engine, "layouts", None)
        tensors = {-1: xs}
        views = {}                          # (tensor, layout) -> the tensor converted to that layout
        self._saved = {}

        wanted = read_in(self.steps, engine.step_reads, layouts) if layouts is not None else {}

        def read(j, want):
            if layouts is None or layouts[j] == want:
                return tensors[j]
            if (j, want) not in views:
                source = conversion_source(j, want, layouts, wanted)
                # the images too, where they came in the wire's dtype (only blocks read them)
                exact = j in self.block_outputs or (j == -1 and self.images_exact)
                views[(j, want)] = engine.convert(tensors[j] if source == layouts[j] else read(j, source), source,
                                                  want, "forward", self.conversion_key(j), exact=exact)
            return views[(j, want)]

        for n, st in enumerate(self.steps):
            want = engine.step_reads(st) if layouts is not None else None
            if st.kind == "block":
                out = engine.forward_layer(st.block, read(st.inputs[0], want), train, step)
            elif st.output in self.norms:
                out, ctxs = self._norm_forward(st.output, read(st.inputs[0], want), train, engine.bn_ghost_batch)
                if train:
                    self._saved[st.output] = ctxs
            else:
                ins = [read(j, input_layout(st, k, want, layouts)) for k, j in enumerate(st.inputs)]
                out, ctxs = [], []
                for m in range(len(xs)):
                    y, ctx = self._node_forward(st.layer, [x[m] for x in ins])
                    out.append(y)
                    ctxs.append(ctx)
                if train:
                    self._saved[st.output] = ctxs
            tensors[st.output] = out
            for j in st.inputs:
                if self.last_read[j] == n and j != self.feature:
                    del tensors[j]
                    for key in [key for key in views if key[0] == j]:
                        del views[key]
        return tensors[self.feature]

    def _norm_forward(self, node, xs, train, ghost):
        """BatchNorm node `node` over every micro-batch xs: in training with the statistics of
        each group of the step's batch (the whole batch, or `ghost` images each), its running
        statistics moving once per group, as a block's BatchNorm does -> (outputs, per micro-batch
        [(group, first row, end row, context)])."""
        op, state, host = self.norms[node].op, self.norm_state[node], self.host
        weight, bias = (state["weight"], state["bias"]) if op.affine else (None, None)
        if not train:
            mean, invstd = eval_statistics(op, state["running_mean"], state["running_var"])
            return [host.batchnorm_apply(x, mean, invstd, weight, bias)[0] for x in xs], None
        batch = sum(len(x) for x in xs)
        groups, starts = ghost_groups(batch, ghost), np.cumsum([0] + [len(x) for x in xs])
        held = dict(enumerate(xs))
        segments = {m: statistics_segments(slice(int(starts[m]), int(starts[m + 1])), batch, ghost) for m in held}
        sums, counts = group_sums(lambda m, a, b: host.channel_sums(held[m][a:b]), held, segments, groups,
                                  self.norms[node].channels)
        stats = [batch_statistics(op, s[0], s[1], int(n)) for s, n in zip(sums, counts)]
        for group in stats:                 # one BatchNorm call per group, in order
            mean, var, tracked = update_running_statistics(op, state["running_mean"], state["running_var"],
                                                           int(state["num_batches_tracked"]), group)
            state["running_mean"][...], state["running_var"][...] = mean, var
            state["num_batches_tracked"][...] = tracked
        out, ctxs = [], []
        for m in held:
            ys = [host.batchnorm_apply(held[m][a:c], stats[g].mean32, stats[g].invstd32, weight, bias)
                  for g, a, c in segments[m]]
            out.append(_join([y for y, _ in ys]))
            ctxs.append([(g, a, c, ctx) for (g, a, c), (_, ctx) in zip(segments[m], ys)])
        return out, (ctxs, groups)

    def _norm_backward(self, node, saved, dys):
        """Back through BatchNorm node `node`: the sums of dy and dy*x_hat of each statistics
        group over every micro-batch, in micro-batch order, then each micro-batch's dx; the
        weight's and bias's gradients (every group's, in order) kept for the step's update."""
        op, host = self.norms[node].op, self.host
        ctxs, groups = saved
        held = dict(enumerate(dys))
        segments = {m: [(g, a, c) for g, a, c, _ in ctxs[m]] for m in held}
        piece_ctx = {(m, a): ctx for m in held for _, a, _, ctx in ctxs[m]}
        sums, counts = group_sums(lambda m, a, c: host.batchnorm_grad_sums(piece_ctx[m, a], held[m][a:c]), held,
                                  segments, groups, self.norms[node].channels)
        if op.affine:
            dweight, dbias = batchnorm_parameter_grads(sums[:, 0].sum(axis=0), sums[:, 1].sum(axis=0))
            self.norm_grads[node] = {"weight": dweight, "bias": dbias}
        return [_join([host.batchnorm_backward(piece_ctx[m, a], held[m][a:c], sums[g, 0], sums[g, 1], int(counts[g]))
                       for g, a, c in segments[m]]) for m in held]

    def _node_forward(self, layer, inputs):
        if isinstance(layer, Add):
            y = inputs[0]
            for x in inputs[1:]:
                y = y + x                   # left to right, as PyTorch's a + b + c; in their layout
            return as_layout_kept(np.asarray(y, np.float32)), len(inputs)
        if isinstance(layer, Concat):
            return as_layout_kept(concatenate(inputs, axis=1)), [x.shape[1] for x in inputs]
        op = layer.channel_op()
        if isinstance(op, Activation):
            return self.host.activation(inputs[0], op)
        if isinstance(op, (Pool, GlobalPool)):
            return self.host.pool(inputs[0], op)
        raise ValueError(f"the coordinator does not run a {layer.type} between blocks")

    # ---- backward --------------------------------------------------------------------------------
    def backward(self, engine, grads):
        """grads: dL/d(features) per micro-batch; every block's backward runs, its parameters'
        gradients adding up on the shards."""
        layouts = getattr(engine, "layouts", None)
        pending = {self.feature: grads}

        def give(j, dx, have, reader, k=0, exact=False):
            """Add the gradient of tensor j that its reader's input k gives (in the layout `have`,
            a block's dX in the wire's values where `exact`) to j's, in j's layout."""
            if layouts is not None and layouts[j] != have:
                dx = engine.convert(dx, have, layouts[j], "backward", self.conversion_key(reader, k), exact=exact)
            self._accumulate(pending, j, dx)

        for st in reversed(self.steps):
            dy = pending.pop(st.output, None)
            if dy is None:
                raise RuntimeError(f"node {st.output} has no gradient: every node before flatten leads to it")
            have = engine.step_reads(st) if layouts is not None else None
            if st.kind == "block":
                source = st.inputs[0]
                if layouts is not None:
                    # a model block's partial dX is summed straight into its input's layout (a
                    # reduce-scatter into rows or channels), not made whole and then cut
                    dx, have = engine.backward_block(st.block, dy, self.requires[source], layouts[source])
                else:
                    dx = engine.backward_layer(st.block, dy, need_dx=self.requires[source])
                if self.requires[source]:
                    give(source, dx, have, st.output, exact=True)
                continue
            ctxs = self._saved.pop(st.output)
            if st.output in self.norms:
                parts = [[g] for g in self._norm_backward(st.output, ctxs, dy)]
            else:
                parts = [self._node_backward(st.layer, ctx, g) for ctx, g in zip(ctxs, dy)]
            for k, j in enumerate(st.inputs):
                if self.requires[j]:
                    give(j, [p[k] for p in parts], input_layout(st, k, have, layouts), st.output, k)

    @staticmethod
    def _accumulate(pending, j, grads):
        if j not in pending:
            pending[j] = grads
        else:
            pending[j] = [a + b for a, b in zip(pending[j], grads)]   # new arrays: a gradient may be shared

    def _node_backward(self, layer, ctx, dy):
        """Per input of the node, its gradient."""
        if isinstance(layer, Add):
            return [dy] * ctx
        if isinstance(layer, Concat):
            bounds = np.cumsum([0] + ctx)
            laid = as_channels_last if is_channels_last(dy) else np.ascontiguousarray
            return [laid(dy[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
        op = layer.channel_op()
        if isinstance(op, Activation):
            return [self.host.activation_backward(ctx, dy)]
        return [self.host.pool_backward(ctx, dy)]

    # ---- a whole step ----------------------------------------------------------------------------
    def train(self, engine, xs, head, step):
        """Forward over every micro-batch, `head(m, features) -> dfeatures` per micro-batch, then
        backward: the conv part of one training step."""
        features = self.forward(engine, xs, True, step)
        self.backward(engine, [head(m, h) for m, h in enumerate(features)])

    def predict(self, engine, x):
        return self.forward(engine, [x], False)[0]


def _join(pieces):
    return concatenate(pieces, axis=0)
