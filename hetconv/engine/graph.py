"""The conv part of a network that is a graph, over an engine's shards.

A graph's conv blocks (a conv and the per-channel layers the shards run after it) go through the
engine one at a time, as a chain's do (forward_layer / backward_layer: every micro-batch in one
request, so a block's BatchNorm sees the whole batch). What joins them runs here, on the
coordinator, which holds every block's whole output in this exchange: an `add` (a residual sum),
a `concat` (channels side by side), and the per-channel layers outside a block (the ReLU after a
residual sum, a pool on a concatenation or on the network's input). Their cost is one pass over
the tensors they touch, small beside the convs around them (resnet18 at batch 256: its largest
add is 64x32x32 per image, 67 MB, against the 1.2 GFLOP per image of the convs that feed it).

Backward walks the steps in reverse. A tensor read by several steps (a residual block's input:
the block and its skip path) gets the sum of their gradients, added in the reverse order of the
steps that read it, so one network and batch always give the same sums whatever the split.
"""
import math

import numpy as np

from hetconv.channelwise import Activation, GlobalPool, Pool
from hetconv.engine.costmodel import GraphShape
from hetconv.net.spec import Add, Concat


def graph_pass(spec, host):
    """What an engine runs `spec`'s conv part with (its `graph`): a GraphPass where the network is
    not a chain, None for a chain (the engine's own layer-by-layer step)."""
    return None if spec.is_chain() else GraphPass(spec, host)


class GraphPass:
    """The steps of NetSpec.graph_steps() run over an engine (`forward_layer`, `backward_layer`)
    and `host`, a device whose activation and pool kernels the coordinator's nodes use."""

    def __init__(self, spec, host):
        self.spec = spec
        self.feature_shape = tuple(spec.feature_shape())
        self.steps = spec.graph_steps()
        self.feature = spec.feature_node()
        self.host = host
        # which tensors a gradient must reach: a block's output and what is made from one (the
        # network's input and what is made from it alone need none)
        requires = {-1: False}
        for st in self.steps:
            requires[st.output] = st.kind == "block" or any(requires[j] for j in st.inputs)
        self.requires = requires
        # after which step each tensor is read no more (its forward copy can go)
        last_read = {}
        for n, st in enumerate(self.steps):
            for j in st.inputs:
                last_read[j] = n
        self.last_read = last_read
        self._saved = {}

    def shape(self):
        """What the cost model prices a graph's blocks with (costmodel.GraphShape)."""
        needs = {st.block: self.requires[st.inputs[0]] for st in self.steps if st.kind == "block"}
        return GraphShape(tuple(needs[b] for b in sorted(needs)), math.prod(self.feature_shape))

    # ---- forward ---------------------------------------------------------------------------------
    def forward(self, engine, xs, train, step=None):
        """The feature maps per micro-batch (the flatten's input). Training keeps each node's
        contexts for backward; the blocks keep theirs on the shards."""
        tensors = {-1: list(xs)}
        self._saved = {}
        for n, st in enumerate(self.steps):
            if st.kind == "block":
                out = engine.forward_layer(st.block, tensors[st.inputs[0]], train, step)
            else:
                out, ctxs = [], []
                for m in range(len(xs)):
                    y, ctx = self._node_forward(st.layer, [tensors[j][m] for j in st.inputs])
                    out.append(y)
                    ctxs.append(ctx)
                if train:
                    self._saved[st.output] = ctxs
            tensors[st.output] = out
            for j in st.inputs:
                if self.last_read[j] == n and j != self.feature:
                    del tensors[j]
        return tensors[self.feature]

    def _node_forward(self, layer, inputs):
        if isinstance(layer, Add):
            y = inputs[0]
            for x in inputs[1:]:
                y = y + x                   # left to right, as PyTorch's a + b + c
            return np.ascontiguousarray(y, np.float32), len(inputs)
        if isinstance(layer, Concat):
            return np.ascontiguousarray(np.concatenate(inputs, axis=1)), [x.shape[1] for x in inputs]
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
        pending = {self.feature: list(grads)}
        for st in reversed(self.steps):
            dy = pending.pop(st.output, None)
            if dy is None:
                raise RuntimeError(f"node {st.output} has no gradient: every node before flatten leads to it")
            if st.kind == "block":
                source = st.inputs[0]
                dx = engine.backward_layer(st.block, dy, need_dx=self.requires[source])
                if self.requires[source]:
                    self._accumulate(pending, source, dx)
                continue
            ctxs = self._saved.pop(st.output)
            parts = [self._node_backward(st.layer, ctx, g) for ctx, g in zip(ctxs, dy)]
            for k, j in enumerate(st.inputs):
                if self.requires[j]:
                    self._accumulate(pending, j, [p[k] for p in parts])

    @staticmethod
    def _accumulate(pending, j, grads):
        if j not in pending:
            pending[j] = list(grads)
        else:
            pending[j] = [a + b for a, b in zip(pending[j], grads)]   # new arrays: a gradient may be shared

    def _node_backward(self, layer, ctx, dy):
        """Per input of the node, its gradient."""
        if isinstance(layer, Add):
            return [dy] * ctx
        if isinstance(layer, Concat):
            bounds = np.cumsum([0] + ctx)
            return [np.ascontiguousarray(dy[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
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
