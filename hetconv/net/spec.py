"""A network as data: an ordered list of layers (as PyTorch's nn.Sequential), the input shape and
the class count, checked once, with every size inferred from the input.

The stored (JSON) form:

    {"input_shape": [3, 32, 32], "classes": 10, "layers": [
      {"type": "conv", "out_channels": 500, "kernel": [5, 5], "stride": [1, 1], "padding": [0, 0], "bias": true},
      {"type": "batchnorm", "eps": 1e-05, "momentum": 0.1, "affine": true},
      {"type": "relu"},
      {"type": "maxpool", "kernel": [2, 2], "stride": [2, 2], "padding": [0, 0]},
      ...,
      {"type": "flatten"},
      {"type": "linear", "out_features": 256},
      {"type": "relu"},
      {"type": "dropout", "p": 0.5},
      {"type": "linear", "out_features": 10, "bias": false},
      {"type": "scale", "factor": 0.111}]}

A conv may also have "dilation" (an int or a pair, PyTorch's: 1 is a dense kernel) and "groups"
(it must divide the conv's input channels and out_channels; groups == input channels is a
depthwise conv, weights (out_channels, in/groups, kh, kw)); both are written only where they are
not 1, so a dense conv's stored form is what it was before them, and a file without them means 1.
Defaults: stride 1, padding 0, dilation 1, groups 1, bias true; a pool's stride is its kernel, its padding 0; an int
stands for a pair. The conv part is a sequence of blocks: a conv, then any sequence of per-channel
layers (activations: relu, gelu, silu, leaky_relu, elu, celu, tanh, sigmoid, hardswish, relu6, hardtanh,
hardsigmoid, identity;
maxpool, avgpool, global_avgpool, global_maxpool; batchnorm; dropout2d), in any order. Then
exactly one flatten, then the FC part (linear, relu, dropout), whose last linear is as wide as
`classes`, optionally followed by a scale. A violation is a ValueError naming the layer (index and
type) and what was expected.
"""
from dataclasses import dataclass, field, replace
import json
import math

import numpy as np

from hetconv import channelwise
from hetconv.geometry import ConvBlock, NormSpec
from hetconv.params import default_init

# ---- checked values ---------------------------------------------------------------------------

def _int(name, value, minimum):
    # bool is an int to Python, never to a user writing "kernel": true
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _pair(name, value, minimum):
    """An int or a pair of ints -> (a, b), each at least `minimum`."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise ValueError(f"{name} must be an integer or a pair of integers, got {value!r}")
        return (_int(name, value[0], minimum), _int(name, value[1], minimum))
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer or a pair of integers, got {value!r}")
    v = _int(name, value, minimum)
    return (v, v)


def _bool(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return bool(value)


def _window_out(size, kernel, stride, padding):
    """Output length of a window sliding over `size` (PyTorch's floor rule), or None if the
    window does not fit the padded input."""
    if size + 2 * padding < kernel:
        return None
    return (size + 2 * padding - kernel) // stride + 1


# ---- layers -----------------------------------------------------------------------------------

class ChannelLayer:
    """A per-channel layer of the conv part (hetconv.channelwise's op inside): it stays with
    whoever holds the channel."""

    def channel_op(self):
        raise NotImplementedError


@dataclass(frozen=True)
class Conv:
    out_channels: int
    kernel: tuple
    stride: tuple = (1, 1)
    padding: tuple = (0, 0)
    bias: bool = True
    dilation: tuple = (1, 1)
    groups: int = 1
    type = "conv"

    def __post_init__(self):
        object.__setattr__(self, "out_channels", _int("out_channels", self.out_channels, 1))
        object.__setattr__(self, "kernel", _pair("kernel", self.kernel, 1))
        object.__setattr__(self, "stride", _pair("stride", self.stride, 1))
        object.__setattr__(self, "padding", _pair("padding", self.padding, 0))
        object.__setattr__(self, "bias", _bool("bias", self.bias))
        object.__setattr__(self, "dilation", _pair("dilation", self.dilation, 1))
        object.__setattr__(self, "groups", _int("groups", self.groups, 1))
        if self.out_channels % self.groups:
            raise ValueError(f"groups {self.groups} must divide out_channels {self.out_channels}")

    @property
    def span(self):
        """(height, width) the kernel covers at its dilation."""
        return tuple(d * (k - 1) + 1 for k, d in zip(self.kernel, self.dilation))

    def to_json(self):
        d = {"type": "conv", "out_channels": self.out_channels, "kernel": list(self.kernel),
             "stride": list(self.stride), "padding": list(self.padding), "bias": self.bias}
        if self.dilation != (1, 1):
            d["dilation"] = list(self.dilation)
        if self.groups != 1:
            d["groups"] = self.groups
        return d

    def text(self):
        return (f"conv {self.out_channels} {self.kernel[0]}x{self.kernel[1]} stride {_pair_text(self.stride)} "
                f"padding {_pair_text(self.padding)}"
                + (f" dilation {_pair_text(self.dilation)}" if self.dilation != (1, 1) else "")
                + (f" groups {self.groups}" if self.groups != 1 else "")
                + ('' if self.bias else ' no bias'))


@dataclass(frozen=True)
class ReLU(ChannelLayer):
    type = "relu"

    def channel_op(self):
        return channelwise.Activation("relu")

    def to_json(self):
        return {"type": "relu"}

    def text(self):
        return "relu"


@dataclass(frozen=True)
class Pool(ChannelLayer):
    """Max or average pooling over a window; average counts padded zeros (PyTorch's default)."""
    mode: str                               # "max" or "avg"
    kernel: tuple
    stride: tuple = None                    # None: the kernel
    padding: tuple = (0, 0)

    def __post_init__(self):
        if self.mode not in ("max", "avg"):
            raise ValueError(f"pool mode must be 'max' or 'avg', got {self.mode!r}")
        kernel = _pair("kernel", self.kernel, 1)
        object.__setattr__(self, "kernel", kernel)
        object.__setattr__(self, "stride", kernel if self.stride is None else _pair("stride", self.stride, 1))
        padding = _pair("padding", self.padding, 0)
        # PyTorch refuses more; beyond half a window, some windows would hold only padding
        if padding[0] > kernel[0] // 2 or padding[1] > kernel[1] // 2:
            raise ValueError(f"padding {list(padding)} must be at most half the kernel {list(kernel)}")
        object.__setattr__(self, "padding", padding)

    @property
    def type(self):
        return self.mode + "pool"

    def channel_op(self):
        return channelwise.Pool(self.mode, self.kernel, self.stride, self.padding)

    def to_json(self):
        return {"type": self.type, "kernel": list(self.kernel), "stride": list(self.stride),
                "padding": list(self.padding)}

    def text(self):
        return (f"{self.type} {self.kernel[0]}x{self.kernel[1]} stride {_pair_text(self.stride)} "
                f"padding {_pair_text(self.padding)}")


@dataclass(frozen=True)
class Flatten:
    type = "flatten"

    def to_json(self):
        return {"type": "flatten"}

    def text(self):
        return "flatten"


@dataclass(frozen=True)
class Linear:
    out_features: int
    bias: bool = True
    type = "linear"

    def __post_init__(self):
        object.__setattr__(self, "out_features", _int("out_features", self.out_features, 1))
        object.__setattr__(self, "bias", _bool("bias", self.bias))

    def to_json(self):
        return {"type": "linear", "out_features": self.out_features, "bias": self.bias}

    def text(self):
        return f"linear {self.out_features}{'' if self.bias else ' no bias'}"


@dataclass(frozen=True)
class Dropout:
    p: float = 0.5
    type = "dropout"

    def __post_init__(self):
        p = self.p
        if isinstance(p, bool) or not isinstance(p, (int, float, np.floating, np.integer)) \
                or not math.isfinite(p) or not 0 <= p < 1:
            raise ValueError(f"p must be a number in [0, 1), got {p!r}")
        object.__setattr__(self, "p", float(p))

    def to_json(self):
        return {"type": "dropout", "p": self.p}

    def text(self):
        return f"dropout {self.p:g}"


@dataclass(frozen=True)
class Activation(ChannelLayer):
    """Every activation but relu (ReLU, kept apart for the head and the fused conv block):
    "type" is its kind, with the parameters the kind takes, if any."""
    kind: str
    negative_slope: float = 0.01
    alpha: float = 1.0
    approximate: str = "none"
    min_val: float = -1.0
    max_val: float = 1.0

    def __post_init__(self):
        op = self.channel_op()
        for name in ("negative_slope", "alpha", "min_val", "max_val"):
            object.__setattr__(self, name, getattr(op, name))

    @property
    def type(self):
        return self.kind

    def channel_op(self):
        return channelwise.Activation(self.kind, self.negative_slope, self.alpha, self.approximate, self.min_val,
                                      self.max_val)

    def to_json(self):
        d = self.channel_op().to_json()
        del d["kind"]
        d["type"] = self.kind
        return d

    def text(self):
        args = ", ".join(f"{k} {v}" for k, v in self.to_json().items() if k != "type")
        return self.kind + (f" ({args})" if args else "")


@dataclass(frozen=True)
class GlobalPool(ChannelLayer):
    """AdaptiveAvgPool2d(1) / AdaptiveMaxPool2d(1): one value per image and channel."""
    mode: str

    def __post_init__(self):
        channelwise.GlobalPool(self.mode)

    @property
    def type(self):
        return f"global_{self.mode}pool"

    def channel_op(self):
        return channelwise.GlobalPool(self.mode)

    def to_json(self):
        return {"type": self.type}

    def text(self):
        return self.type


@dataclass(frozen=True)
class BatchNorm(ChannelLayer):
    """BatchNorm2d: statistics of the step's whole batch in training, running ones in evaluation."""
    eps: float = 1e-5
    momentum: float = 0.1
    affine: bool = True
    type = "batchnorm"

    def __post_init__(self):
        op = channelwise.BatchNorm(self.eps, self.momentum, self.affine)
        object.__setattr__(self, "eps", op.eps)
        object.__setattr__(self, "momentum", op.momentum)

    def channel_op(self):
        return channelwise.BatchNorm(self.eps, self.momentum, self.affine)

    def to_json(self):
        return {"type": "batchnorm", "eps": self.eps, "momentum": self.momentum, "affine": self.affine}

    def text(self):
        momentum = "cumulative" if self.momentum is None else f"momentum {self.momentum:g}"
        return f"batchnorm eps {self.eps:g} {momentum}{'' if self.affine else ' no affine'}"


@dataclass(frozen=True)
class Dropout2d(ChannelLayer):
    """Dropout2d: whole channels of an image zeroed with probability p, the rest scaled by 1/(1-p)."""
    p: float = 0.5
    type = "dropout2d"

    def __post_init__(self):
        object.__setattr__(self, "p", channelwise.Dropout2d(self.p).p)

    def channel_op(self):
        return channelwise.Dropout2d(self.p)

    def to_json(self):
        return {"type": "dropout2d", "p": self.p}

    def text(self):
        return f"dropout2d {self.p:g}"


@dataclass(frozen=True)
class Scale:
    """Multiplies the logits by a constant (airbench's x / 9 after its classifier)."""
    factor: float
    type = "scale"

    def __post_init__(self):
        f = self.factor
        if isinstance(f, bool) or not isinstance(f, (int, float, np.floating, np.integer)) or not math.isfinite(f):
            raise ValueError(f"factor must be a finite number, got {f!r}")
        object.__setattr__(self, "factor", float(f))

    def to_json(self):
        return {"type": "scale", "factor": self.factor}

    def text(self):
        return f"scale {self.factor:g}"


@dataclass(frozen=True)
class Add:
    """The elementwise sum of two or more inputs of one shape (a residual connection), in the
    order its inputs are named."""
    type = "add"

    def to_json(self):
        return {"type": "add"}

    def text(self):
        return "add"


@dataclass(frozen=True)
class Concat:
    """Its inputs side by side along channels, in the order they are named (torch.cat(dim=1))."""
    type = "concat"

    def to_json(self):
        return {"type": "concat"}

    def text(self):
        return "concat"


MERGES = (Add, Concat)


def _pair_text(p):
    return str(p[0]) if p[0] == p[1] else f"{p[0]}x{p[1]}"


# type -> (constructor, keys it accepts besides "type")
_LAYER_TYPES = {
    "conv": (Conv, ("out_channels", "kernel", "stride", "padding", "bias", "dilation", "groups")),
    "relu": (ReLU, ()),
    **{kind: ((lambda kind: lambda **kw: Activation(kind, **kw))(kind), params)
       for kind, params in channelwise.ACTIVATION_PARAMETERS.items() if kind != "relu"},
    "maxpool": (lambda **kw: Pool("max", **kw), ("kernel", "stride", "padding")),
    "avgpool": (lambda **kw: Pool("avg", **kw), ("kernel", "stride", "padding")),
    "global_avgpool": (lambda: GlobalPool("avg"), ()),
    "global_maxpool": (lambda: GlobalPool("max"), ()),
    "batchnorm": (BatchNorm, ("eps", "momentum", "affine")),
    "dropout2d": (Dropout2d, ("p",)),
    "flatten": (Flatten, ()),
    "linear": (Linear, ("out_features", "bias")),
    "dropout": (Dropout, ("p",)),
    "scale": (Scale, ("factor",)),
    "add": (Add, ()),
    "concat": (Concat, ()),
}
_REQUIRED = {"conv": ("out_channels", "kernel"), "maxpool": ("kernel",), "avgpool": ("kernel",),
             "linear": ("out_features",), "scale": ("factor",)}
LAYER_TYPES = tuple(_LAYER_TYPES)


def layer_from_json(d):
    """One layer from its stored form; raises ValueError (without the layer's index: the caller
    knows it) on an unknown type or key, a missing key or a bad value."""
    if not isinstance(d, dict):
        raise ValueError(f"a layer must be an object with a \"type\", got {d!r}")
    kind = d.get("type")
    if not isinstance(kind, str) or kind not in _LAYER_TYPES:
        raise ValueError(f"unknown type {kind!r}; expected one of {', '.join(LAYER_TYPES)}")
    make, keys = _LAYER_TYPES[kind]
    unknown = [k for k in d if k != "type" and k not in keys]
    if unknown:
        accepted = ", ".join(keys) if keys else "no keys besides type"
        raise ValueError(f"unknown key {unknown[0]!r}; {kind} accepts {accepted}")
    missing = [k for k in _REQUIRED.get(kind, ()) if k not in d]
    if missing:
        raise ValueError(f"missing key {missing[0]!r}")
    return make(**{k: v for k, v in d.items() if k != "type"})


def _where(index, layer):
    return f"layer {index} ({layer.type})"


class LayerError(ValueError):
    """A network is refused because of one layer; `index` is its position, so a caller that
    built the list from something else (a PyTorch module) can name its own source."""

    def __init__(self, index, layer, problem):
        super().__init__(f"{_where(index, layer)}: {problem}")
        self.index = index
        self.problem = problem


# ---- what the network gives the rest of hetconv ------------------------------------------------

@dataclass(frozen=True)
class ConvLayer:
    """One conv block as the shards run it: conv, then the activation and pool a device fuses with
    it (in `block`), then the per-channel ops after those (`tail`, hetconv.channelwise ops)."""
    index: int                  # the conv's position in NetSpec.layers
    in_channels: int
    kernels: int                # out_channels: what the planner splits
    kernel: tuple               # (kh, kw)
    bias: bool
    block: ConvBlock
    input_shape: tuple          # (C, H, W) entering the conv
    conv_shape: tuple           # (K, H, W) after the conv, before activation and pool
    output_shape: tuple         # (K, H, W) leaving the block
    tail: tuple = ()            # channelwise ops after the fused block, in order
    layer_indices: tuple = ()   # NetSpec.layers positions of the block's per-channel layers, in order
    source: int = -1            # the node whose output the conv reads (-1: the network's input)
    node: int = -1              # the node whose output the block gives (its last layer's position)
    members: tuple = ()         # every NetSpec.layers position the block runs: conv, fused activation and pool, tail


@dataclass(frozen=True)
class HeadOp:
    """One op of the FC part; in/out are feature counts per image."""
    index: int                  # position in NetSpec.layers
    layer: object
    in_features: int
    out_features: int

    @property
    def type(self):
        return self.layer.type


@dataclass(frozen=True)
class GraphStep:
    """One step of the conv part in order: a conv block (`block`: its position in conv_layers(),
    run by the shards), or a node the coordinator computes itself (`node`: an add, a concat, or a
    per-channel layer outside every block: after a join, on the network's input, or a BatchNorm on
    a block's output that another node reads too). `inputs` are node positions
    (-1: the network's input); `output` is the node whose tensor the step makes."""
    kind: str                   # "block" or "node"
    output: int
    inputs: tuple
    block: int = -1
    layer: object = None        # the node's layer (kind "node")


INPUT_NAME = "input"            # what a node's inputs call the network's input
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.")
MAX_NAME_CHARS = 200


def _check_name(i, name):
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS or not set(name) <= _NAME_CHARS \
            or name == INPUT_NAME:
        raise ValueError(f"node {i}: name {name!r:.80}: expected 1 to {MAX_NAME_CHARS} letters, digits, '_' or "
                         f"'.', other than {INPUT_NAME!r}")
    return name


@dataclass(frozen=True)
class NetSpec:
    """The layers in order, and for a graph what each reads: `inputs[i]` are the positions of
    layer i's inputs (-1: the network's input; None: a chain, each layer reading the one before),
    `names[i]` its name (None: its position), which export and import use as PyTorch's
    state_dict prefix."""
    input_shape: tuple          # (C, H, W), from the data set
    classes: int                # from the data set; the last linear's width
    layers: tuple
    inputs: tuple = None
    names: tuple = None
    _shapes: tuple = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self):
        shape = self.input_shape
        if not isinstance(shape, (list, tuple)) or len(shape) != 3:
            raise ValueError(f"input_shape must be [channels, height, width], got {shape!r}")
        object.__setattr__(self, "input_shape", tuple(_int("input_shape", v, 1) for v in shape))
        object.__setattr__(self, "classes", _int("classes", self.classes, 1))
        if not isinstance(self.layers, (list, tuple)):
            raise ValueError(f"layers must be a list of layers, got {type(self.layers).__name__}")
        layers = tuple(self.layers)
        for i, layer in enumerate(layers):
            if not isinstance(layer, (Conv, ChannelLayer, Flatten, Linear, Dropout, Scale) + MERGES):
                raise ValueError(f"layer {i} ({type(layer).__name__}): not a layer; expected one of "
                                 f"{', '.join(LAYER_TYPES)}")
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "inputs", self._checked_inputs())
        names = self.names
        if names is None:
            names = tuple(str(i) for i in range(len(layers)))
        elif not isinstance(names, (list, tuple)) or len(names) != len(layers):
            raise ValueError(f"names must be one per layer ({len(layers)}), got {names!r:.120}")
        names = tuple(_check_name(i, n) for i, n in enumerate(names))
        repeated = next((n for i, n in enumerate(names) if n in names[:i]), None)
        if repeated is not None:
            raise ValueError(f"two nodes are named {repeated!r}; every node's name is its own")
        object.__setattr__(self, "names", names)
        if self.is_chain():
            self._check_order()
        else:
            self._check_graph()
        object.__setattr__(self, "_shapes", self._infer_shapes())
        if not self.is_chain():
            self.conv_layers()          # refuses a per-channel layer no block or the coordinator can run

    def _checked_inputs(self):
        n = len(self.layers)
        if self.inputs is None:
            return tuple((i - 1,) for i in range(n))
        if not isinstance(self.inputs, (list, tuple)) or len(self.inputs) != n:
            raise ValueError(f"inputs must be one list per layer ({n}), got {self.inputs!r:.120}")
        out = []
        for i, given in enumerate(self.inputs):
            if not isinstance(given, (list, tuple)) or not given or any(
                    isinstance(j, bool) or not isinstance(j, (int, np.integer)) or not -1 <= j < i for j in given):
                raise LayerError(i, self.layers[i], f"inputs {given!r:.80}: expected one or more earlier nodes")
            out.append(tuple(int(j) for j in given))
        return tuple(out)

    def is_chain(self):
        """Whether each layer reads the one before it (the first, the network's input)."""
        return all(given == (i - 1,) for i, given in enumerate(self.inputs))

    def _check_graph(self):
        """A graph: merges take two or more inputs, every other layer one; one flatten, after it a
        chain of head layers as in a chain network (checked by _check_order on that part); every
        node before it feeds something."""
        layers, inputs = self.layers, self.inputs
        flatten_at = [i for i, layer in enumerate(layers) if layer.type == "flatten"]
        if len(flatten_at) != 1:
            at = flatten_at[1] if flatten_at else len(layers) - 1
            raise LayerError(at, layers[at], "a network has exactly one flatten, between its conv part and its "
                                             f"linear layers ({len(flatten_at)} found)")
        flatten_at = flatten_at[0]
        for i, layer in enumerate(layers):
            arity = len(inputs[i])
            if isinstance(layer, MERGES) and arity < 2:
                raise LayerError(i, layer, f"{layer.type} takes two or more inputs, got {arity}")
            if not isinstance(layer, MERGES) and arity != 1:
                raise LayerError(i, layer, f"takes one input, got {arity} ({', '.join(self._name(j) for j in inputs[i])})")
            if i < flatten_at and isinstance(layer, (Linear, Dropout, Scale)):
                raise LayerError(i, layer, "expected flatten before the FC part (conv, per-channel layers, add, concat "
                                           "or flatten here)")
            if i > flatten_at and inputs[i] != (i - 1,):
                raise LayerError(i, layer, "after flatten the layers form a chain: each reads the one before it")
            if i > flatten_at and isinstance(layer, MERGES):
                raise LayerError(i, layer, "after flatten only linear, relu, dropout and scale are allowed")
        if not any(isinstance(layer, Conv) for layer in layers[:flatten_at]):
            raise LayerError(0, layers[0], "the conv part has no conv layer")
        used = {j for i in range(len(layers)) for j in inputs[i]}
        for i in range(flatten_at):
            if i not in used:
                raise LayerError(i, layers[i], "its output is used by no node (every node before flatten must "
                                               "lead to it)")
        try:                            # the head's order, checked as a chain's (a 1x1 conv stands for the conv part)
            NetSpec(self.input_shape, self.classes, (Conv(1, 1),) + layers[flatten_at:])
        except LayerError as e:
            at = flatten_at + e.index - 1
            raise LayerError(at, layers[at], e.problem) from None

    def _name(self, j):
        return INPUT_NAME if j < 0 else self.names[j] if self.names is not None and len(self.names) > j else str(j)

    def _check_order(self):
        layers = self.layers
        if not layers:
            raise ValueError("the network has no layers; expected conv blocks, flatten, then linear layers")
        if layers[0].type != "conv":
            raise LayerError(0, layers[0], "the first layer must be conv")
        flatten_at = None
        prev = None                 # previous layer's type (dropouts skipped in the FC part)
        for i, layer in enumerate(layers):
            kind = layer.type
            if isinstance(layer, MERGES):
                raise LayerError(i, layer, f"{kind} joins two or more nodes: a network with one names each node's "
                                           f"inputs (the \"nodes\" form)")
            if kind == "flatten":
                if flatten_at is not None:
                    raise LayerError(i, layer, f"only one flatten is allowed, the first is layer {flatten_at}")
                flatten_at = i
            elif flatten_at is None:            # conv part: conv, then any per-channel layers, block after block
                if kind in ("linear", "dropout", "scale"):
                    raise LayerError(i, layer, "expected flatten before the FC part (conv, per-channel layers or "
                                               "flatten here)")
            else:                               # FC part: linear, relu, dropout; a scale after the last linear
                if isinstance(layer, Conv) or (isinstance(layer, ChannelLayer) and kind != "relu"):
                    raise LayerError(i, layer, "after flatten only linear, relu, dropout and scale are allowed")
                if kind == "relu" and prev != "linear":
                    raise LayerError(i, layer, f"relu in the FC part must follow a linear "
                                               f"(with at most a dropout between), not {prev}")
                if kind == "dropout" and layers[i - 1].type == "dropout":
                    raise LayerError(i, layer, "two dropouts in a row; expected linear or relu before it")
                if kind == "scale" and any(later.type != "scale" for later in layers[i + 1:]):
                    raise LayerError(i, layer, "a scale comes only after the last linear (it scales the logits)")
            if not (kind == "dropout" and flatten_at is not None):
                prev = kind
        end, last = len(layers) - 1, layers[-1]
        if flatten_at is None:
            raise LayerError(end, last, "the conv part must be followed by one flatten, then linear layers; "
                                        "the list ends here")
        classifier_at = self._classifier_index()
        if classifier_at is None or classifier_at < flatten_at:
            raise LayerError(end, last, f"the network must end with a linear layer of out_features = classes "
                                        f"({self.classes}), then at most a scale")
        classifier = layers[classifier_at]
        if classifier.out_features != self.classes:
            raise LayerError(classifier_at, classifier, f"the last linear has out_features {classifier.out_features}, "
                                                        f"expected classes = {self.classes}")

    def _classifier_index(self):
        """The position of the last linear where only scales follow it, else None."""
        i = len(self.layers) - 1
        while i >= 0 and self.layers[i].type == "scale":
            i -= 1
        return i if i >= 0 and self.layers[i].type == "linear" else None

    def _infer_shapes(self):
        """The output shape of every layer: (C, H, W) up to flatten, (features,) after."""
        shapes = []
        for i, layer in enumerate(self.layers):
            given = [self.input_shape if j < 0 else shapes[j] for j in self.inputs[i]]
            if isinstance(layer, Add):
                if any(s != given[0] for s in given):
                    raise LayerError(i, layer, "adds inputs of different shapes: "
                                               + ", ".join(f"{self._name(j)} {'x'.join(map(str, s))}"
                                                           for j, s in zip(self.inputs[i], given)))
                shapes.append(given[0])
                continue
            if isinstance(layer, Concat):
                if any(s[1:] != given[0][1:] for s in given):
                    raise LayerError(i, layer, "joins maps of different heights and widths: "
                                               + ", ".join(f"{self._name(j)} {'x'.join(map(str, s))}"
                                                           for j, s in zip(self.inputs[i], given)))
                shapes.append((sum(s[0] for s in given),) + given[0][1:])
                continue
            shape = given[0]
            if isinstance(layer, (Conv, Pool)) and len(shape) == 3:
                c, h, w = shape
                if isinstance(layer, Conv) and c % layer.groups:
                    raise LayerError(i, layer, f"groups {layer.groups} must divide its {c} input channels (and its "
                                               f"{layer.out_channels} out_channels)")
                kh, kw = layer.span if isinstance(layer, Conv) else layer.kernel
                (sh, sw), (ph, pw) = layer.stride, layer.padding
                ho, wo = _window_out(h, kh, sh, ph), _window_out(w, kw, sw, pw)
                if ho is None or wo is None:
                    what = f"kernel {kh}x{kw}" + (f" (dilation {_pair_text(layer.dilation)})" if isinstance(
                        layer, Conv) and layer.dilation != (1, 1) else "")
                    raise LayerError(i, layer, f"{what} does not fit its {h}x{w} input with padding "
                                               f"{_pair_text(layer.padding)} (padded {h + 2 * ph}x{w + 2 * pw})")
                shapes.append((layer.out_channels if isinstance(layer, Conv) else c, ho, wo))
            elif isinstance(layer, ChannelLayer) and len(shape) == 3:
                c, h, w = shape
                try:
                    h, w = layer.channel_op().output_hw(h, w)
                except ValueError as e:
                    raise LayerError(i, layer, str(e)) from None
                shapes.append((c, h, w))
            elif isinstance(layer, Flatten):
                shapes.append((int(np.prod(shape)),))
            elif isinstance(layer, Linear):
                shapes.append((layer.out_features,))
            else:                               # dropout, scale, the head's relu: shape unchanged
                shapes.append(shape)
        return tuple(shapes)

    # ---- sizes ----------------------------------------------------------------------------------
    def output_shapes(self):
        """Each layer's output shape, in order: (C, H, W) before flatten, (features,) from it on."""
        return list(self._shapes)

    def _flatten_index(self):
        return next(i for i, layer in enumerate(self.layers) if layer.type == "flatten")

    def feature_node(self):
        """The node whose output the flatten reads."""
        return self.inputs[self._flatten_index()][0]

    def feature_shape(self):
        """(C, H, W) of what the head flattens."""
        return self._shapes[self.feature_node()]

    def consumers(self):
        """Per node, the nodes that read its output, in order."""
        users = [[] for _ in self.layers]
        for i, given in enumerate(self.inputs):
            for j in given:
                if j >= 0 and i not in users[j]:
                    users[j].append(i)
        return users

    def _block_members(self, users, conv_at, flatten_at):
        """The conv at `conv_at` and the per-channel layers the shards run after it: each next one
        is the only reader of the one before and reads nothing else."""
        members = [conv_at]
        while True:
            last = members[-1]
            following = users[last]
            if len(following) != 1:
                return members
            nxt = following[0]
            if nxt >= flatten_at or not isinstance(self.layers[nxt], ChannelLayer) or self.inputs[nxt] != (last,):
                return members
            members.append(nxt)

    def conv_layers(self):
        """One ConvLayer per conv block, in the order of their convs. The block a device fuses with
        the conv takes a relu right after it and then a max or average pool; every other per-channel
        layer is the tail, in order."""
        flatten_at = self._flatten_index()
        users = self.consumers()
        blocks, owned = [], set()
        for i in range(flatten_at):
            if not isinstance(self.layers[i], Conv):
                continue
            members = self._block_members(users, i, flatten_at)
            owned.update(members)
            conv, rest = self.layers[i], members[1:]
            activation, pool = "none", None
            if rest and self.layers[rest[0]].type == "relu":
                activation = "relu"
                rest.pop(0)
            if rest and self.layers[rest[0]].type in ("maxpool", "avgpool"):
                pool = self.layers[rest.pop(0)]
            pooling = (dict(pool=pool.mode, pool_kernel=pool.kernel, pool_stride=pool.stride,
                            pool_padding=pool.padding) if pool else dict(pool="none"))
            block = ConvBlock(stride=conv.stride, padding=conv.padding, activation=activation,
                              dilation=conv.dilation, groups=conv.groups, **pooling)
            source = self.inputs[i][0]
            in_shape = self.input_shape if source < 0 else self._shapes[source]
            blocks.append(ConvLayer(index=i, in_channels=in_shape[0], kernels=conv.out_channels,
                                    kernel=conv.kernel, bias=conv.bias, block=block, input_shape=in_shape,
                                    conv_shape=self._shapes[i], output_shape=self._shapes[members[-1]],
                                    tail=tuple(self.layers[j].channel_op() for j in rest),
                                    layer_indices=tuple(rest), source=source, node=members[-1],
                                    members=tuple(members)))
        for i in range(flatten_at):
            layer = self.layers[i]
            if i not in owned and isinstance(layer, Dropout2d):
                raise LayerError(i, layer, f"reads {self._name(self.inputs[i][0])}, which is not a conv block's "
                                           f"output: a {layer.type} runs where its channels are, in the block of the "
                                           f"conv before it (conv, then per-channel layers, each the only reader of "
                                           f"the one before); a sum or concatenation may be followed by activations, "
                                           f"pools and BatchNorm (the graph runs them on the whole tensor), not by a "
                                           f"{layer.type}")
        return blocks

    def norm_nodes(self):
        """The positions of the BatchNorms outside every conv block (on a residual sum, a
        concatenation, or a per-channel layer after one: a pre-activation block's), in order. The
        graph runs them; their state follows the blocks' in the conv part's state."""
        if self.is_chain():
            return []
        owned = {i for b in self.conv_layers() for i in b.members}
        return [i for i in range(self._flatten_index()) if i not in owned and isinstance(self.layers[i], BatchNorm)]

    def norm_specs(self):
        """A NormSpec (channels, op) per norm_nodes() entry."""
        return [NormSpec(self._shapes[i][0], self.layers[i].channel_op()) for i in self.norm_nodes()]

    def graph_steps(self):
        """The conv part as GraphSteps in order: each block where its conv is, each node the
        coordinator computes (merges, and per-channel layers outside a block) where it is. For a
        chain: its blocks alone, each reading the one before."""
        blocks = self.conv_layers()
        by_conv = {b.index: n for n, b in enumerate(blocks)}
        owned = {i for b in blocks for i in b.members}       # a fused activation and pool too
        steps = []
        for i in range(self._flatten_index()):
            if i in by_conv:
                b = blocks[by_conv[i]]
                steps.append(GraphStep("block", b.node, (b.source,), block=by_conv[i]))
            elif i not in owned:
                steps.append(GraphStep("node", i, self.inputs[i], layer=self.layers[i]))
        return steps

    def head(self):
        """The FC part as ops, flatten first (in = out = the flattened features' count)."""
        flatten_at = self._flatten_index()
        ops = []
        features = int(np.prod(self.feature_shape()))
        for i in range(flatten_at, len(self.layers)):
            out = self._shapes[i][0]
            ops.append(HeadOp(index=i, layer=self.layers[i], in_features=features, out_features=out))
            features = out
        return ops

    def with_input(self, input_shape, classes):
        """The same layers on another data set: sizes follow its input shape, and the last linear
        (the classifier) is as wide as its class count."""
        classes = _int("classes", classes, 1)
        layers = list(self.layers)
        at = self._classifier_index()
        layers[at] = replace(layers[at], out_features=classes)
        return NetSpec(input_shape, classes, tuple(layers), None if self.is_chain() else self.inputs, self.names)

    # ---- parameters ------------------------------------------------------------------------------
    def parameter_shapes(self):
        """([(w, b)] per conv, [(w, b)] per linear) shapes; b is None where a layer has no bias.
        conv w is (K, C/groups, kh, kw), linear w is (out, in), as in PyTorch."""
        conv = [((c.kernels, c.in_channels // c.block.groups) + c.kernel, (c.kernels,) if c.bias else None)
                for c in self.conv_layers()]
        fc = [((op.out_features, op.in_features), (op.out_features,) if op.layer.bias else None)
              for op in self.head() if op.type == "linear"]
        return conv, fc

    def init_params(self, rng):
        """PyTorch's default start: weights kaiming-uniform with a=sqrt(5), which is uniform in
        +-1/sqrt(fan_in), and biases uniform in +-1/sqrt(fan_in). Drawn layer by layer, conv
        first, weight before bias, so one seed gives one network."""
        conv_shapes, fc_shapes = self.parameter_shapes()

        def draw(shapes):
            params = []
            for w_shape, b_shape in shapes:
                fan_in = int(np.prod(w_shape[1:]))
                w = default_init(rng, w_shape, fan_in)
                b = default_init(rng, b_shape, fan_in) if b_shape is not None else None
                params.append((w, b))
            return params

        return draw(conv_shapes), draw(fc_shapes)

    def parameter_count(self):
        conv, fc = self.parameter_shapes()
        norms = sum(2 * layer.kernels for layer in self.conv_layers() for op in layer.tail
                    if op.type == "batchnorm" and op.affine)
        norms += sum(2 * norm.channels for norm in self.norm_specs() if norm.op.affine)
        return sum(int(np.prod(w)) + (int(np.prod(b)) if b else 0) for w, b in conv + fc) + norms

    # ---- stored form and logs -------------------------------------------------------------------
    def _default_names(self):
        return self.names == tuple(str(i) for i in range(len(self.layers)))

    def to_json(self):
        """The stored form, a dict ready for json.dumps (every default written out): a chain with
        positional names as "layers", anything else as "nodes", each with its name and inputs."""
        if self.is_chain() and self._default_names():
            return {"input_shape": list(self.input_shape), "classes": self.classes,
                    "layers": [layer.to_json() for layer in self.layers]}
        return {"input_shape": list(self.input_shape), "classes": self.classes,
                "nodes": [{"name": name, "inputs": [self._name(j) for j in given], **layer.to_json()}
                          for layer, name, given in zip(self.layers, self.names, self.inputs)]}

    def dumps(self):
        return json.dumps(self.to_json(), indent=1)

    @classmethod
    def from_json(cls, data):
        """A NetSpec from its stored form: a dict, or the JSON text of one."""
        if isinstance(data, (str, bytes)):
            try:
                data = json.loads(data)
            except json.JSONDecodeError as e:
                raise ValueError(f"the network is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"the network must be a JSON object with input_shape, classes and layers, "
                             f"got {type(data).__name__}")
        form = "nodes" if "nodes" in data else "layers"
        keys = ("input_shape", "classes", form)
        unknown = [k for k in data if k not in keys]
        if unknown:
            raise ValueError(f"unknown key {unknown[0]!r} in the network; expected {', '.join(keys)}"
                             + (" (layers for a chain, or nodes for a graph, not both)" if unknown[0] in
                                ("layers", "nodes") else ""))
        missing = [k for k in keys if k not in data]
        if missing:
            raise ValueError(f"the network has no {missing[0]!r}; expected {', '.join(keys)}")
        if not isinstance(data[form], list):
            raise ValueError(f"{form} must be a list, got {type(data[form]).__name__}")
        layers, names, inputs = [], [], []
        for i, d in enumerate(data[form]):
            kind = d.get("type", "no type") if isinstance(d, dict) else type(d).__name__
            if form == "nodes":
                if not isinstance(d, dict) or "name" not in d or "inputs" not in d:
                    raise ValueError(f"node {i} ({kind}): expected an object with \"name\", \"inputs\" and \"type\"")
                d = dict(d)
                name, given = d.pop("name"), d.pop("inputs")
                _check_name(i, name)
                known = {n: j for j, n in enumerate(names)}
                if name in known:
                    raise ValueError(f"node {i}: two nodes are named {name!r}; every node's name is its own")
                if not isinstance(given, list) or not given or any(
                        not isinstance(g, str) or (g != INPUT_NAME and g not in known) for g in given):
                    raise ValueError(f"node {i} ({name}): inputs {given!r:.120}: expected a list of earlier nodes' "
                                     f"names or {INPUT_NAME!r}")
                names.append(name)
                inputs.append(tuple(-1 if g == INPUT_NAME else known[g] for g in given))
            try:
                layers.append(layer_from_json(d))
            except (ValueError, TypeError) as e:
                raise ValueError(f"{'node' if form == 'nodes' else 'layer'} {i} ({kind}): {e}") from None
        if form == "nodes":
            return cls(data["input_shape"], data["classes"], tuple(layers), tuple(inputs), tuple(names))
        return cls(data["input_shape"], data["classes"], tuple(layers))

    def describe(self):
        """One line per layer: what it is, its output shape, its parameter count (for logs); a
        graph's lines name each node and its inputs."""
        conv_shapes, fc_shapes = self.parameter_shapes()
        counts = iter([int(np.prod(w)) + (int(np.prod(b)) if b else 0) for w, b in conv_shapes + fc_shapes])
        graph = not self.is_chain() or not self._default_names()
        lines = [f"input {'x'.join(map(str, self.input_shape))}, {self.classes} classes"]
        for i, (layer, shape) in enumerate(zip(self.layers, self._shapes)):
            params = next(counts) if layer.type in ("conv", "linear") else 0
            if layer.type == "batchnorm" and layer.affine:
                params = 2 * shape[0]
            what = layer.text()
            if graph:
                what = f"{self.names[i]} = {what} ({', '.join(self._name(j) for j in self.inputs[i])})"
            lines.append(f"{i:>3} {what:<40} -> {'x'.join(map(str, shape)):<14} {params:>12,} params")
        lines.append(f"    total {self.parameter_count():,} parameters")
        return "\n".join(lines)
