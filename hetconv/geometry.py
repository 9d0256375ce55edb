"""One conv layer's spec as the shards run it, and the size arithmetic every part of hetconv uses
(reference, devices, model, cost model, bench), written once.

A conv layer is a block: conv (kh x kw, any stride and zero padding) + bias, then an activation
(ReLU or none), then a pool (max, average or none), as its ConvBlock says. The network as a whole
(blocks, head, input shape, classes) is hetconv.net's NetSpec; this module sits below it and below
the devices, which import ConvBlock from here.
"""
from dataclasses import dataclass, field, fields, replace

import numpy as np

from hetconv import channelwise
from hetconv.sizes import as_pair, dilated_size, window_output_size  # noqa: F401  (every part's size arithmetic, from here)
from hetconv.update import SLOTS, slot_name

IMAGE_SHAPE = (3, 32, 32)           # (C, H, W) of a CIFAR-10 image
NUM_CLASSES = 10


ACTIVATIONS = ("relu", "none")
POOLS = ("max", "avg", "none")


@dataclass(frozen=True)
class ConvBlock:
    """What follows a conv layer's GEMM, and its stride, padding, dilation and groups: everything a
    device needs besides the weights' shape. Pairs are (height, width); an int stands for (int, int).
    Dilation and groups are PyTorch's: dilation 1 is a dense kernel; with `groups` g the input
    channels and the kernels are cut in g equal parts, kernel part i reading input part i only
    (weights (K, C/g, kh, kw)); g == C is a depthwise conv.
    Semantics are PyTorch's: the activation applies before the pool; pools use floor mode; a
    max-pool pads with -inf; an average pool counts its zero padding (every window divides by
    pkh*pkw); a pool's padding is at most half its kernel, as PyTorch requires."""
    stride: tuple = (1, 1)
    padding: tuple = (0, 0)
    activation: str = "relu"        # "relu" or "none"
    pool: str = "max"               # "max", "avg" or "none"
    pool_kernel: tuple = (2, 2)
    pool_stride: tuple = (2, 2)
    pool_padding: tuple = (0, 0)
    dilation: tuple = (1, 1)
    groups: int = 1

    def __post_init__(self):
        for name, minimum in (("stride", 1), ("padding", 0), ("pool_kernel", 1), ("pool_stride", 1),
                              ("pool_padding", 0), ("dilation", 1)):
            object.__setattr__(self, name, as_pair(f"ConvBlock {name}", getattr(self, name), minimum))
        if isinstance(self.groups, bool) or not isinstance(self.groups, (int, np.integer)) or self.groups < 1:
            raise ValueError(f"ConvBlock groups must be an integer >= 1, got {self.groups!r}")
        object.__setattr__(self, "groups", int(self.groups))
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"ConvBlock activation must be one of {ACTIVATIONS!r}, got {self.activation!r}")
        if self.pool not in POOLS:
            raise ValueError(f"ConvBlock pool must be one of {POOLS!r}, got {self.pool!r}")
        if self.pool != "none" and any(2 * p > k for p, k in zip(self.pool_padding, self.pool_kernel)):
            raise ValueError(f"ConvBlock pool_padding {self.pool_padding!r} must be at most half of pool_kernel "
                             f"{self.pool_kernel!r} (as PyTorch requires)")

    def to_json(self):
        """Every field, but dilation and groups only where they are not 1: a dense block's form
        (and the wisdom keys made from it) stays what it was before convs had them."""
        d = {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v for f in fields(self)}
        if self.dilation == (1, 1):
            del d["dilation"]
        if self.groups == 1:
            del d["groups"]
        return d

    @classmethod
    def from_json(cls, d):
        """The inverse of to_json; missing keys take the defaults, unknown keys raise ValueError."""
        if not isinstance(d, dict):
            raise ValueError(f"a conv block must be a JSON object, got {d!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown conv block key(s) {unknown!r}: expected some of {sorted(known)!r}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})

    @property
    def is_paper(self):
        """Stride 1, ReLU, 2x2 stride-2 max-pool with no pool padding (any conv padding): the
        block devices run with their own fused kernels."""
        return (self.stride == (1, 1) and self.dense and self.activation == "relu" and self.pool == "max"
                and self.pool_kernel == (2, 2) and self.pool_stride == (2, 2) and self.pool_padding == (0, 0))


    @property
    def dense(self):
        """No dilation and one group: the plain conv every path runs."""
        return self.dilation == (1, 1) and self.groups == 1

    def kernel_span(self, kh, kw):
        """(height, width) a kh x kw kernel covers at this dilation."""
        return dilated_size(kh, self.dilation[0]), dilated_size(kw, self.dilation[1])


PAPER_BLOCK = ConvBlock()           # stride 1, no padding, ReLU, 2x2 stride-2 max-pool: today's block


@dataclass(frozen=True)
class StateArray:
    """One array of a layer's state: a parameter the optimizer moves, a buffer (BatchNorm's running
    statistics), or an optimizer's slot for a parameter (momentum, Adam's moments)."""
    name: str                   # "w", "b", "bn1.weight", "bn1.running_mean", "w.momentum_buffer", ...
    shape: tuple                # the whole layer's: (K, ...) split by kernels, or () kept whole by every holder
    dtype: str = "float32"      # "float32", or "int64" for a count
    kind: str = "param"         # "param", "buffer" or "slot"
    group: str = ""             # a param's (and its slots') weight-decay group: "weight", "bias" or "norm"
    on_device: bool = False     # lives where the device computes (conv weights); else a host numpy array

    @property
    def per_kernel(self):
        return len(self.shape) > 0


@dataclass(frozen=True)
class ConvSpec:
    """One conv layer: in_channels -> kernels, kh x kw, then `block` (stride, padding, and the
    activation and pool a device runs fused with the conv), then `tail`: the per-channel layers
    after those (hetconv.channelwise: BatchNorm, activations, pools, channel dropout), in order.
    Without `bias` the bias stays zero."""
    in_channels: int
    kernels: int
    kh: int = 5
    kw: int = 5
    block: ConvBlock = PAPER_BLOCK
    bias: bool = True
    tail: tuple = ()
    # (C, H, W) entering the conv where the network says (a graph's block need not read the one
    # before it); planning and pricing only: a shard takes the shape of what it is sent
    input_shape: tuple = field(default=None, compare=False)

    def __post_init__(self):
        g = self.block.groups
        if self.in_channels % g or self.kernels % g:
            raise ValueError(f"conv groups {g} must divide both the input channels ({self.in_channels}) and the "
                             f"kernels ({self.kernels})")

    @property
    def groups(self):
        return self.block.groups

    @property
    def weight_shape(self):
        """(K, C/groups, kh, kw): each kernel reads its group's input channels only."""
        return (self.kernels, self.in_channels // self.block.groups, self.kh, self.kw)

    @property
    def kernel_group(self):
        """Kernels per group: a kernel range of a shard holds whole groups where it starts and
        stops at multiples of this."""
        return self.kernels // self.block.groups

    def whole_groups(self, k):
        """`k` kernels rounded down to whole groups, at least one group: what a shard of a grouped
        conv can hold (k itself for a conv of one group)."""
        if self.block.groups == 1:
            return int(k)
        kg = self.kernel_group
        return max(kg, int(k) // kg * kg)

    def kernel_slice(self, start, stop):
        """(the block a shard holding kernels [start, stop) runs, the input channels [c0, c1) its
        kernels read). A conv of one group reads every channel; a grouped conv's range must hold
        whole groups, and reads only theirs: a depthwise conv's shard reads its own channels."""
        g = self.block.groups
        if g == 1:
            return self.block, (0, self.in_channels)
        kg, cg = self.kernel_group, self.in_channels // g
        if start % kg or stop % kg:
            raise ValueError(f"kernels [{start}, {stop}) of a conv of {g} groups ({kg} kernels each) must start and "
                             f"stop at whole groups")
        g0, g1 = start // kg, stop // kg
        return replace(self.block, groups=g1 - g0), (g0 * cg, g1 * cg)

    @classmethod
    def paper(cls, in_channels, kernels, ksize=5, padding=0):
        """The paper family's layer: ksize x ksize, stride 1, ReLU, 2x2 max-pool."""
        return cls(in_channels, kernels, ksize, ksize, ConvBlock(padding=padding))

    @classmethod
    def from_layer(cls, layer):
        """From a hetconv.net ConvLayer."""
        return cls(layer.in_channels, layer.kernels, layer.kernel[0], layer.kernel[1], layer.block, layer.bias,
                   tuple(layer.tail), tuple(layer.input_shape))

    def to_json(self):
        d = {"in_channels": self.in_channels, "kernels": self.kernels, "kernel": [self.kh, self.kw],
             "block": self.block.to_json(), "bias": self.bias}
        if self.tail:
            d["tail"] = [op.to_json() for op in self.tail]
        return d

    @classmethod
    def from_json(cls, d):
        kh, kw = as_pair("conv kernel", d["kernel"], 1)
        tail = d.get("tail", [])
        if not isinstance(tail, list):
            raise ValueError(f"a conv layer's tail must be a list of per-channel layers, got {tail!r:.80}")
        return cls(int(d["in_channels"]), int(d["kernels"]), kh, kw, ConvBlock.from_json(d["block"]),
                   bool(d.get("bias", True)), tuple(channelwise.layer_from_json(op) for op in tail))

    @property
    def batchnorms(self):
        """(tail index, BatchNorm) of every BatchNorm in the tail."""
        return [(i, op) for i, op in enumerate(self.tail) if op.type == "batchnorm"]

    def state_layout(self, optimizer=None):
        """Every array of the layer's state, in a fixed order: the conv's weights and bias (kept on
        the device), each BatchNorm's weight, bias and running statistics (per-channel vectors,
        kept on the host), and with `optimizer`, its slots for every parameter that trains (a bias
        the layer does not have stays zero and takes no slot)."""
        k = self.kernels
        arrays = [StateArray("w", self.weight_shape, group="weight", on_device=True),
                  StateArray("b", (k,), group="bias", on_device=True)]
        for i, bn in self.batchnorms:
            arrays += batchnorm_arrays(f"bn{i}.", k, bn)
        return arrays + _slots(self.trained(arrays), optimizer)

    def trained(self, arrays=None):
        """The params the optimizer moves: all but a bias the layer does not have."""
        return [a for a in (arrays if arrays is not None else self.state_layout())
                if a.kind == "param" and (self.bias or a.name != "b")]

    def initial_state(self, w, b=None):
        """The layer's state at the start of a run: these conv weights (and bias, zero where None),
        BatchNorm's PyTorch defaults (weight 1, bias 0, running mean 0 and variance 1, no batches
        tracked). Per-kernel arrays have as many rows as `w` (a shard's slice, or the layer)."""
        k = len(w)
        state = {"w": np.asarray(w, np.float32), "b": np.zeros(k, np.float32) if b is None
                 else np.asarray(b, np.float32)}
        state.update(_initial(self.state_layout()[2:], k))
        return state

    def conv_hw(self, h, w):
        """Spatial size after the conv, before the activation and pool."""
        (sh, sw), (ph, pw) = self.block.stride, self.block.padding
        kh, kw = self.block.kernel_span(self.kh, self.kw)
        return window_output_size(h, kh, sh, ph), window_output_size(w, kw, sw, pw)

    def block_hw(self, h, w):
        """Spatial size leaving the fused block (conv, activation, pool), before the tail."""
        h, w = self.conv_hw(h, w)
        if self.block.pool == "none":
            return h, w
        (kh, kw), (sh, sw), (ph, pw) = self.block.pool_kernel, self.block.pool_stride, self.block.pool_padding
        return window_output_size(h, kh, sh, ph), window_output_size(w, kw, sw, pw)

    def output_hw(self, h, w):
        """Spatial size leaving the layer: the block, then every op of the tail."""
        h, w = self.block_hw(h, w)
        for op in self.tail:
            h, w = op.output_hw(h, w)
        return h, w

    def describe(self):
        b = self.block
        pool = "" if b.pool == "none" else f", {b.pool}-pool {b.pool_kernel[0]}x{b.pool_kernel[1]}/{b.pool_stride[0]}"
        return (f"conv {self.kernels} {self.kh}x{self.kw}/{b.stride[0]} pad {b.padding[0]}"
                + (f" dilation {b.dilation[0]}" if b.dilation != (1, 1) else "")
                + (f" groups {b.groups}" if b.groups != 1 else "")
                + (", relu" if b.activation == "relu" else "") + pool
                + "".join(f", {_op_text(op)}" for op in self.tail))


def batchnorm_arrays(prefix, channels, bn):
    """A BatchNorm's state over `channels`, its names under `prefix`: weight and bias (where
    affine), running mean and variance, and the count of batches tracked, as BatchNorm2d's
    state_dict has them."""
    arrays = []
    if bn.affine:
        arrays += [StateArray(f"{prefix}weight", (channels,), group="norm"),
                   StateArray(f"{prefix}bias", (channels,), group="bias")]
    return arrays + [StateArray(f"{prefix}running_mean", (channels,), kind="buffer"),
                     StateArray(f"{prefix}running_var", (channels,), kind="buffer"),
                     StateArray(f"{prefix}num_batches_tracked", (), "int64", "buffer")]


def _slots(trained, optimizer):
    """The optimizer's slot arrays of every parameter that trains (none without an optimizer)."""
    if not optimizer:
        return []
    return [StateArray(slot_name(a.name, slot), a.shape, a.dtype, "slot", a.group, a.on_device)
            for a in trained for slot in SLOTS[optimizer]]


def _initial(arrays, rows=None):
    """BatchNorm's PyTorch start for these arrays: weights and running variances 1, the rest 0;
    per-channel arrays with `rows` rows where given."""
    return {a.name: np.full((rows,) + a.shape[1:] if rows is not None and a.per_kernel else a.shape,
                            1 if a.name.rsplit(".", 1)[-1] in ("weight", "running_var") else 0, a.dtype)
            for a in arrays}


@dataclass(frozen=True)
class NormSpec:
    """A BatchNorm between conv blocks (on a residual sum, a concatenation, or a per-channel layer
    after one): the graph runs it where the tensor is whole, and its state lives there, named as
    BatchNorm2d's state_dict names it ("weight", "running_mean", ...)."""
    channels: int
    op: channelwise.BatchNorm

    def state_layout(self, optimizer=None):
        arrays = batchnorm_arrays("", self.channels, self.op)
        return arrays + _slots(self.trained(arrays), optimizer)

    def trained(self, arrays=None):
        return [a for a in (arrays if arrays is not None else self.state_layout()) if a.kind == "param"]

    def initial_state(self):
        """BatchNorm2d's start: weight 1, bias 0, running mean 0 and variance 1, no batches tracked."""
        return _initial(self.state_layout())


def layer_state(spec, state):
    """A layer's state as {name: array}: a dict as it is, or the (w, b, vw, vb) of a layer with no
    tail (momentum may be None) in those names."""
    if isinstance(state, dict):
        return state
    w, b, vw, vb = state
    out = spec.initial_state(w, b)
    if vw is not None:
        out["w.momentum_buffer"], out["b.momentum_buffer"] = vw, vb
    return out


def _op_text(op):
    """A tail op in a few words, for plan tables and errors."""
    if op.type == "activation":
        return op.kind
    if op.type == "pool":
        return f"{op.mode}-pool {op.kernel[0]}x{op.kernel[1]}/{op.stride[0]}"
    if op.type == "global_pool":
        return f"global {op.mode}-pool"
    if op.type == "dropout2d":
        return f"dropout2d {op.p:g}"
    return op.type


def conv_specs(kernels, ksize=5, padding=0, in_channels=IMAGE_SHAPE[0]):
    """One ConvSpec per entry of `kernels`, each layer's input channels the previous layer's kernels."""
    specs = []
    for k in kernels:
        specs.append(ConvSpec.paper(in_channels, k, ksize, padding))
        in_channels = k
    return specs


def layer_input_shapes(specs, batch, image_shape=IMAGE_SHAPE):
    """(N, C, H, W) entering each conv layer, and the (C, H, W) leaving the last one; raises if
    the image shrinks away."""
    c, h, w = image_shape
    shapes = []
    for i, spec in enumerate(specs):
        if spec.input_shape is not None:       # a graph's block reads what the network says
            c, h, w = spec.input_shape
        ho, wo = spec.output_hw(h, w)
        if min(spec.conv_hw(h, w)) < 1 or ho < 1 or wo < 1:
            raise ValueError(f"conv layer {i + 1} ({spec.describe()}) gets a {h}x{w} input: too small for its "
                             f"window and pool; use fewer conv layers, more padding or a larger input")
        shapes.append((batch, c, h, w))
        h, w = ho, wo
        c = spec.kernels
    return shapes, (c, h, w)


def largest_array_bytes(specs, batch, image_shape=IMAGE_SHAPE, value_bytes=4):
    """The largest array any message of a run moves, in bytes: a conv layer's whole input or
    partial dX, its pooled output, or its weights (a worker holding every kernel). Sockets cap
    each received frame near this (ZMQ_MAXMSGSIZE), so a peer cannot make a process allocate
    more than the run itself ever needs."""
    shapes, (c, h, w) = layer_input_shapes(specs, batch, image_shape)
    sizes = [batch * c * h * w]
    for spec, (n, cin, hin, win) in zip(specs, shapes):
        sizes.append(n * cin * hin * win)
        sizes.append(int(np.prod(spec.weight_shape)))
    return max(sizes) * value_bytes


# A header frame (msgpack: plans, calibration timings) is small; this much room is given over the
# largest array, and no limit is ever set below it.
MESSAGE_SLACK_BYTES = 1 << 20


def message_limit_bytes(specs, batch, image_shape=IMAGE_SHAPE):
    """ZMQ_MAXMSGSIZE for a run's sockets: the largest array plus room for a header."""
    return largest_array_bytes(specs, batch, image_shape) + MESSAGE_SLACK_BYTES
