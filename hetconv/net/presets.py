"""Named networks, and `load_net`: the one way a `--net` text becomes a NetSpec.

A preset is defined without an input: the data set gives the input shape and the class count.
`width` multiplies every conv and hidden FC width (at least 1 channel each), so tests and quick
runs use the same shapes at a fraction of the cost; mobilenet_v2 rounds its widths to multiples of
8 as torchvision's width_mult does, resnext29 its groups' widths to whole channels a group.
"""
import math
import os
from typing import NamedTuple

from hetconv.net.spec import (INPUT_NAME, Activation, Add, BatchNorm, Concat, Conv, Dropout, Flatten, GlobalPool,
                              Linear, NetSpec, Pool, ReLU, Scale)
from hetconv.net.torch_import import from_torch, given_module, load_module

DEFAULT_NET = "paper"
JSON_MAX_BYTES = 1 << 20            # a network's stored form is a few kB; a bigger file is not one


def _scaled(n, width):
    return max(1, int(round(n * width)))


def _paper(width, classes):
    """The network of Marques, Falcao and Alexandre (2018) on CIFAR-10."""
    return [Conv(_scaled(500, width), 5), ReLU(), Pool("max", 2),
            Conv(_scaled(1500, width), 5), ReLU(), Pool("max", 2),
            Flatten(), Linear(_scaled(256, width)), ReLU(), Linear(classes)]


def _lenet5(width, classes):
    return [Conv(_scaled(6, width), 5, padding=2), ReLU(), Pool("max", 2),
            Conv(_scaled(16, width), 5), ReLU(), Pool("max", 2),
            Flatten(), Linear(_scaled(120, width)), ReLU(), Linear(_scaled(84, width)), ReLU(),
            Linear(classes)]


def _cifar10_quick(width, classes):
    """Caffe's examples/cifar10 "quick" network. Caffe puts the first ReLU after the first
    max-pool; ReLU is monotone, so max-pool and ReLU commute (each window has a real value, padding
    being at most half the window) and relu-then-pool keeps the block form conv, act, pool at no
    change in the result. Caffe pools in ceil mode without padding; floor mode with padding 1 gives
    the same sizes (32 -> 16 -> 8 -> 4), with windows shifted by one pixel. Caffe has no ReLU
    between its two inner products."""
    return [Conv(_scaled(32, width), 5, padding=2), ReLU(), Pool("max", 3, stride=2, padding=1),
            Conv(_scaled(32, width), 5, padding=2), ReLU(), Pool("avg", 3, stride=2, padding=1),
            Conv(_scaled(64, width), 5, padding=2), ReLU(), Pool("avg", 3, stride=2, padding=1),
            Flatten(), Linear(_scaled(64, width)), Linear(classes)]


def _vgg_small(width, classes):
    layers = []
    for stage in (32, 64, 128, 256):
        for _ in range(2):
            layers += [Conv(_scaled(stage, width), 3, padding=1), ReLU()]
        layers.append(Pool("max", 2))
    return layers + [Flatten(), Linear(_scaled(256, width)), ReLU(), Dropout(0.5), Linear(classes)]


def _vgg_small_bn(width, classes):
    """vgg-small with a BatchNorm between every conv and its ReLU (convs without bias, which the
    BatchNorm's shift makes redundant), as torchvision's vgg*_bn."""
    layers = []
    for stage in (32, 64, 128, 256):
        for _ in range(2):
            layers += [Conv(_scaled(stage, width), 3, padding=1, bias=False), BatchNorm(), ReLU()]
        layers.append(Pool("max", 2))
    return layers + [Flatten(), Linear(_scaled(256, width)), ReLU(), Dropout(0.5), Linear(classes)]


def _airbench94(width, classes):
    """The network of Keller Jordan's airbench94 (arXiv 2404.00498; 94% on CIFAR-10 in 3.8 s on an
    A100): a 2x2 whitening-sized conv, then three blocks of conv, max-pool, BatchNorm, GELU, conv,
    BatchNorm, GELU at widths 64, 256, 256, a 3x3 max-pool and a bias-free classifier whose
    logits are divided by 9. Its BatchNorms use momentum 0.4 (airbench's 0.6 as PyTorch counts it)
    and eps 1e-12. Trained as airbench does, the first conv's weights come from the data's patch
    whitening and stay frozen; here it is a plain conv, trained like the rest."""
    gelu = Activation("gelu")
    layers = [Conv(_scaled(24, width), 2, bias=True), gelu]
    for stage in (64, 256, 256):
        k = _scaled(stage, width)
        layers += [Conv(k, 3, padding=1, bias=False), Pool("max", 2), BatchNorm(1e-12, 0.4), gelu,
                   Conv(k, 3, padding=1, bias=False), BatchNorm(1e-12, 0.4), gelu]
    return layers + [Pool("max", 3), Flatten(), Linear(classes, bias=False), Scale(1 / 9)]


class _Graph:
    """A graph preset as it is written: each node named, reading named nodes (INPUT_NAME: the
    images); `node` returns the name, so a block reads as a chain of calls."""

    def __init__(self):
        self.layers, self.names, self.inputs = [], [], []

    def node(self, name, layer, *inputs):
        self.layers.append(layer)
        self.names.append(name)
        self.inputs.append(tuple(-1 if i == INPUT_NAME else self.names.index(i) for i in inputs))
        return name

    def conv_bn_relu(self, prefix, x, out, kernel, stride=1, relu=True, conv="conv", bn="bn"):
        """conv (no bias: the BatchNorm's shift stands for it), BatchNorm, then ReLU when asked."""
        x = self.node(f"{prefix}{conv}", Conv(out, kernel, stride, kernel // 2, bias=False), x)
        x = self.node(f"{prefix}{bn}", BatchNorm(), x)
        return self.node(f"{prefix}relu{conv[4:]}", ReLU(), x) if relu else x

    def spec(self, input_shape, classes):
        return NetSpec(input_shape, classes, tuple(self.layers), tuple(self.inputs), tuple(self.names))


def _resnet18(width, classes):
    """torchvision's resnet18 as the CIFAR recipes use it (He et al. 2016): a 3x3 stem without the
    max-pool, then four stages of two basic blocks (conv, BatchNorm, ReLU, conv, BatchNorm, plus
    the block's input or its 1x1 projection where the stage halves the map, ReLU) at widths 64,
    128, 256, 512, a global average pool and the classifier. Nodes are named as torchvision names
    its modules, so the state_dict keys are torchvision's own."""
    g = _Graph()
    x = g.conv_bn_relu("", INPUT_NAME, _scaled(64, width), 3, conv="conv1", bn="bn1")
    return _resnet_stages(g, x, _scaled(64, width), width, classes, (2, 2, 2, 2), bottleneck=False)


def _resnet_stages(g, x, cin, width, classes, blocks, bottleneck):
    """torchvision's four ResNet stages on `x` (`cin` channels) of `blocks` basic or bottleneck
    blocks each at widths 64, 128, 256, 512 (a bottleneck's output 4x that; v1.5: the stride on
    its 3x3 conv), each stage after the first halving the map, the block's input or its 1x1
    projection added before the last ReLU; then the global average pool and the classifier."""
    expansion = 4 if bottleneck else 1
    for stage, (channels, count) in enumerate(zip((64, 128, 256, 512), blocks), start=1):
        planes = _scaled(channels, width)
        out = planes * expansion
        for b in range(count):
            stride = 2 if stage > 1 and b == 0 else 1
            p = f"layer{stage}.{b}."
            if bottleneck:
                h = g.conv_bn_relu(p, x, planes, 1, conv="conv1", bn="bn1")
                h = g.conv_bn_relu(p, h, planes, 3, stride, conv="conv2", bn="bn2")
                h = g.conv_bn_relu(p, h, out, 1, relu=False, conv="conv3", bn="bn3")
            else:
                h = g.conv_bn_relu(p, x, planes, 3, stride, conv="conv1", bn="bn1")
                h = g.conv_bn_relu(p, h, planes, 3, relu=False, conv="conv2", bn="bn2")
            skip = x
            if stride != 1 or cin != out:
                skip = g.node(p + "downsample.0", Conv(out, 1, stride, bias=False), x)
                skip = g.node(p + "downsample.1", BatchNorm(), skip)
            x = g.node(p + "relu_out", ReLU(), g.node(p + "add", Add(), h, skip))
            cin = out
    x = g.node("avgpool", GlobalPool("avg"), x)
    x = g.node("flatten", Flatten(), x)
    g.node("fc", Linear(classes), x)
    return g


def _preact_resnet18(width, classes):
    """PreAct-ResNet-18 (He et al. 2016, "Identity Mappings in Deep Residual Networks") as the CIFAR
    recipes write it (kuangliu's pytorch-cifar PreActBlock): a 3x3 stem conv alone, then four
    stages of two pre-activation blocks (BatchNorm, ReLU, conv, BatchNorm, ReLU, conv, plus the
    block's input, or a 1x1 projection of its first ReLU where the stage halves the map) at widths
    64, 128, 256, 512; BatchNorm and ReLU after the last sum (the paper's; that code leaves them
    out), a global average pool and the classifier. Nodes are named as that code names its
    modules. Each block's first BatchNorm reads the sum before it, so it runs where the joins run
    (engine.graph), on the whole tensor."""
    g = _Graph()
    cin = _scaled(64, width)
    x = g.node("conv1", Conv(cin, 3, 1, 1, bias=False), INPUT_NAME)
    for stage, channels in enumerate((64, 128, 256, 512), start=1):
        planes = _scaled(channels, width)
        for b in range(2):
            stride = 2 if stage > 1 and b == 0 else 1
            p = f"layer{stage}.{b}."
            pre = g.node(p + "relu1", ReLU(), g.node(p + "bn1", BatchNorm(), x))
            skip = x
            if stride != 1 or cin != planes:
                skip = g.node(p + "shortcut.0", Conv(planes, 1, stride, bias=False), pre)
            h = g.node(p + "conv1", Conv(planes, 3, stride, 1, bias=False), pre)
            h = g.node(p + "relu2", ReLU(), g.node(p + "bn2", BatchNorm(), h))
            x = g.node(p + "add", Add(), g.node(p + "conv2", Conv(planes, 3, 1, 1, bias=False), h), skip)
            cin = planes
    x = g.node("relu", ReLU(), g.node("bn", BatchNorm(), x))
    x = g.node("avgpool", GlobalPool("avg"), x)
    x = g.node("flatten", Flatten(), x)
    g.node("linear", Linear(classes), x)
    return g


def _resnet9(width, classes):
    """David Page's ResNet-9 (the DAWNBench CIFAR-10 record, 94% in 26 s on a V100): a conv at 64,
    then conv-BatchNorm-ReLU-max-pool stages at 128, 256 and 512, the first and last followed by a
    residual pair of conv-BatchNorm-ReLU added to its input; a global max pool, a bias-free
    classifier and logits scaled by 1/8."""
    g = _Graph()
    x = g.conv_bn_relu("prep.", INPUT_NAME, _scaled(64, width), 3)
    for stage, channels in ((1, 128), (2, 256), (3, 512)):
        p = f"layer{stage}."
        x = g.node(p + "pool", Pool("max", 2), g.conv_bn_relu(p, x, _scaled(channels, width), 3))
        if stage != 2:
            h = g.conv_bn_relu(p + "res1.", x, _scaled(channels, width), 3)
            h = g.conv_bn_relu(p + "res2.", h, _scaled(channels, width), 3)
            x = g.node(p + "add", Add(), x, h)
    x = g.node("pool", GlobalPool("max"), x)
    x = g.node("flatten", Flatten(), x)
    x = g.node("linear", Linear(classes, bias=False), x)
    g.node("scale", Scale(0.125), x)
    return g


def _inception_small(width, classes):
    """A small Inception (Szegedy et al. 2015) for 32x32 inputs: a 3x3 stem, two mixed blocks, a
    max-pool, a third mixed block, a global average pool and the classifier. A mixed block
    concatenates a 1x1 branch, a 1x1-then-3x3 branch and a 3x3 max-pool-then-1x1 branch, every conv
    followed by BatchNorm and ReLU."""
    g = _Graph()
    x = g.conv_bn_relu("stem.", INPUT_NAME, _scaled(32, width), 3)

    def mixed(name, x, c1, c3r, c3, cp):
        a = g.conv_bn_relu(f"{name}.b1.", x, _scaled(c1, width), 1)
        b = g.conv_bn_relu(f"{name}.b2.", x, _scaled(c3r, width), 1)
        b = g.conv_bn_relu(f"{name}.b3.", b, _scaled(c3, width), 3)
        c = g.node(f"{name}.pool", Pool("max", 3, stride=1, padding=1), x)
        c = g.conv_bn_relu(f"{name}.b4.", c, _scaled(cp, width), 1)
        return g.node(f"{name}.cat", Concat(), a, b, c)

    x = mixed("mixed1", x, 16, 16, 24, 8)
    x = mixed("mixed2", x, 24, 24, 32, 16)
    x = g.node("pool", Pool("max", 2), x)
    x = mixed("mixed3", x, 32, 32, 48, 16)
    x = g.node("avgpool", GlobalPool("avg"), x)
    x = g.node("flatten", Flatten(), x)
    g.node("fc", Linear(classes), x)
    return g


def _imagenet_resnet(width, classes, blocks, bottleneck):
    """torchvision's ImageNet ResNet (He et al. 2016; v1.5): a 7x7 stride-2 stem conv, BatchNorm,
    ReLU and a 3x3 stride-2 max-pool, then _resnet_stages. Nodes are named as torchvision names its
    modules, so the state_dict keys are torchvision's own (conv1.weight, bn1.running_mean,
    layer1.0.downsample.0.weight, fc.bias)."""
    g = _Graph()
    stem = _scaled(64, width)
    x = g.conv_bn_relu("", INPUT_NAME, stem, 7, 2, conv="conv1", bn="bn1")
    x = g.node("maxpool", Pool("max", 3, stride=2, padding=1), x)
    return _resnet_stages(g, x, stem, width, classes, blocks, bottleneck)


def _resnet34(width, classes):
    return _imagenet_resnet(width, classes, (3, 4, 6, 3), bottleneck=False)


def _resnet50(width, classes):
    return _imagenet_resnet(width, classes, (3, 4, 6, 3), bottleneck=True)


def _divisible(v, divisor=8):
    """torchvision's _make_divisible: v rounded to the nearest multiple of `divisor` (at least
    that), rounded up once more where that lost over 10% of v."""
    rounded = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * v else rounded


def _mobilenet_v2(width, classes):
    """torchvision's mobilenet_v2 (Sandler et al. 2018) as the CIFAR ports run it: its stem conv at
    stride 1, and its second stage (24 channels) at stride 1 too, so a 32x32 image reaches the last
    stage at 4x4, not 1x1. Inverted residual blocks: a 1x1 expansion (six times, not in the first
    block), a 3x3 depthwise conv (the stride), each followed by BatchNorm and ReLU6, then a 1x1
    projection and BatchNorm, plus the block's input where the stride is 1 and the channels stay.
    `width` is torchvision's width_mult (every width a multiple of 8, the last conv's 1280 never
    narrower). Nodes are named as torchvision names its modules, so the state_dict keys are
    torchvision's own (features.1.conv.0.0.weight, features.18.1.running_var, classifier.1.bias)."""
    g = _Graph()
    relu6 = Activation("relu6")

    def conv_bn_relu6(prefix, x, out, kernel, stride=1, groups=1):
        x = g.node(prefix + "0", Conv(out, kernel, stride, kernel // 2, bias=False, groups=groups), x)
        return g.node(prefix + "2", relu6, g.node(prefix + "1", BatchNorm(), x))

    cin = _divisible(32 * width)
    x = conv_bn_relu6("features.0.", INPUT_NAME, cin, 3)
    index = 1
    # (expansion, channels, blocks, stride of the first): torchvision's, the 24-channel stage at stride 1
    for t, c, n, s in ((1, 16, 1, 1), (6, 24, 2, 1), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                       (6, 320, 1, 1)):
        out = _divisible(c * width)
        for b in range(n):
            stride = s if b == 0 else 1
            p = f"features.{index}."
            hidden = int(round(cin * t))
            h, part = x, 0
            if t != 1:
                h, part = conv_bn_relu6(f"{p}conv.0.", h, hidden, 1), 1
            h = conv_bn_relu6(f"{p}conv.{part}.", h, hidden, 3, stride, groups=hidden)
            h = g.node(f"{p}conv.{part + 1}", Conv(out, 1, bias=False), h)
            h = g.node(f"{p}conv.{part + 2}", BatchNorm(), h)
            x = g.node(p + "add", Add(), x, h) if stride == 1 and cin == out else h
            cin, index = out, index + 1
    x = conv_bn_relu6(f"features.{index}.", x, _divisible(1280 * max(1.0, width)), 1)
    x = g.node("avgpool", GlobalPool("avg"), x)
    x = g.node("flatten", Flatten(), x)
    x = g.node("classifier.0", Dropout(0.2), x)
    g.node("classifier.1", Linear(classes), x)
    return g


def _resnext29(width, classes):
    """A small ResNeXt-29 (Xie et al. 2017) for CIFAR: a 3x3 stem of 64, then three stages of three
    bottleneck blocks (1x1 conv, a 3x3 conv of 8 groups with the stage's stride, 1x1 conv, each
    followed by BatchNorm, ReLU after the first two), cardinality 8 and 4 channels a group in the
    first stage (8x4d; the paper's 8x64d has 34M parameters), the groups' width doubling and the
    map halving at each later stage, the output twice the groups' width (64, 128, 256); the
    block's input or its 1x1 projection added before the last ReLU; a global average pool and the
    classifier. Nodes are named as torchvision names its ResNets' modules."""
    g = _Graph()
    cin = _scaled(64, width)
    x = g.conv_bn_relu("", INPUT_NAME, cin, 3, conv="conv1", bn="bn1")
    cardinality = 8
    for stage in range(3):
        group_width = cardinality * max(1, int(round(4 * width))) * 2 ** stage
        out = 2 * group_width
        for b in range(3):
            stride = 2 if stage > 0 and b == 0 else 1
            p = f"layer{stage + 1}.{b}."
            h = g.conv_bn_relu(p, x, group_width, 1, conv="conv1", bn="bn1")
            h = g.node(p + "conv2", Conv(group_width, 3, stride, 1, bias=False, groups=cardinality), h)
            h = g.node(p + "relu2", ReLU(), g.node(p + "bn2", BatchNorm(), h))
            h = g.conv_bn_relu(p, h, out, 1, relu=False, conv="conv3", bn="bn3")
            skip = x
            if stride != 1 or cin != out:
                skip = g.node(p + "downsample.0", Conv(out, 1, stride, bias=False), x)
                skip = g.node(p + "downsample.1", BatchNorm(), skip)
            x = g.node(p + "relu_out", ReLU(), g.node(p + "add", Add(), h, skip))
            cin = out
    x = g.node("avgpool", GlobalPool("avg"), x)
    x = g.node("flatten", Flatten(), x)
    g.node("fc", Linear(classes), x)
    return g


PRESETS = {"paper": _paper, "lenet5": _lenet5, "cifar10-quick": _cifar10_quick, "vgg-small": _vgg_small,
           "vgg-small-bn": _vgg_small_bn, "airbench94": _airbench94, "resnet9": _resnet9, "resnet18": _resnet18,
           "preact-resnet18": _preact_resnet18, "inception-small": _inception_small, "resnet34": _resnet34,
           "resnet50": _resnet50, "mobilenet_v2": _mobilenet_v2, "resnext29": _resnext29}


def preset(name, input_shape, classes, width=1.0):
    """The preset `name` sized for this input and class count."""
    if name not in PRESETS:
        raise ValueError(f"unknown network preset {name!r}; expected one of {', '.join(PRESETS)}")
    if isinstance(width, bool) or not isinstance(width, (int, float)) or not math.isfinite(width) or width <= 0:
        raise ValueError(f"width of {name} must be a positive number, got {width!r}")
    made = PRESETS[name](width, classes)
    if isinstance(made, _Graph):
        return made.spec(input_shape, classes)
    return NetSpec(input_shape, classes, tuple(made))


class LoadedNet(NamedTuple):
    spec: NetSpec
    params: tuple = None        # (conv [(w, b)], fc [(w, b)]) when the source carries weights, else None


def _accepted():
    return (f"expected a preset ({', '.join(PRESETS)}, optionally NAME@WIDTH such as vgg-small@0.25), "
            f"a .json file, or path.py:function returning a PyTorch module (an nn.Sequential, or one whose forward "
            f"torch.fx traces into supported layers, sums and concatenations)")


def load_net(text, input_shape, classes):
    """A network from a `--net` text, sized for the data set (input_shape, classes):
    - a preset name, optionally NAME@WIDTH;
    - a path to a .json file (the stored form);
    - path.py:function, a function returning a PyTorch module: an nn.Sequential, or an nn.Module whose
      forward torch.fx traces into supported layers, sums and concatenations (its weights come along);
    - module:NAME#N, a module hetconv.train(net=module) was given (torch_import.given_module_name).
    Returns LoadedNet(spec, params)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"--net {text!r}: {_accepted()}")
    text = text.strip()
    head, sep, _ = text.rpartition(":")
    if (sep and head.endswith(".py")) or text.startswith("module:"):
        try:
            module = given_module(text) if text.startswith("module:") else load_module(text)
            spec, conv, fc = from_torch(module, input_shape)
        except ImportError as e:            # the torch extra is missing: say so as a --net error
            raise ValueError(f"--net {text}: {e}") from None
        if spec.classes != classes:
            raise ValueError(f"--net {text}: the network's last Linear has {spec.classes} outputs, "
                             f"but the data set has {classes} classes")
        return LoadedNet(spec, (conv, fc))
    if text.endswith(".json") or os.path.isfile(text):
        return LoadedNet(_load_json(text, input_shape, classes))
    name, at, width_text = text.partition("@")
    if name not in PRESETS:
        raise ValueError(f"--net {text}: not a preset nor an existing file; {_accepted()}")
    width = 1.0
    if at:
        try:
            width = float(width_text)
        except ValueError:
            width = float("nan")
        if not math.isfinite(width) or width <= 0:
            raise ValueError(f"--net {text}: the width after @ must be a positive number, got {width_text!r}")
    try:
        return LoadedNet(preset(name, input_shape, classes, width))
    except ValueError as e:
        raise ValueError(f"--net {text} on input {_shape_text(input_shape)} with {classes!r} classes: {e}") from None


def _shape_text(shape):
    if isinstance(shape, (list, tuple)):
        return "x".join(str(v) for v in shape)
    return repr(shape)


def _load_json(path, input_shape, classes):
    try:
        size = os.path.getsize(path)
        if size > JSON_MAX_BYTES:
            raise ValueError(f"--net {path}: {size} bytes is too big for a network's stored form "
                             f"(at most {JSON_MAX_BYTES})")
        with open(path, "rb") as f:
            raw = f.read(JSON_MAX_BYTES + 1)
    except OSError as e:
        raise ValueError(f"--net {path}: cannot read it ({e.strerror or e}); {_accepted()}") from None
    try:
        spec = NetSpec.from_json(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"--net {path}: not a UTF-8 text file") from None
    except ValueError as e:
        raise ValueError(f"--net {path}: {e}") from None
    if spec.classes != classes:
        raise ValueError(f"--net {path}: the network has {spec.classes} classes, the data set {classes}")
    if tuple(spec.input_shape) != tuple(input_shape):
        # the layers hold no input size (conv and linear inputs are inferred): re-size for this data set
        try:
            spec = spec.with_input(input_shape, classes)
        except ValueError as e:
            raise ValueError(f"--net {path} on input {_shape_text(input_shape)}: {e}") from None
    return spec
