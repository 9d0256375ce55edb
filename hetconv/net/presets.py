"""Named networks, and `load_net`: the one way a `--net` text becomes a NetSpec.

A preset is defined without an input: the data set gives the input shape and the class count.
`width` multiplies every conv and hidden FC width (at least 1 channel each), so tests and quick
runs use the same shapes at a fraction of the cost.
"""
import math
import os
from typing import NamedTuple

from hetconv.net.spec import Activation, BatchNorm, Conv, Dropout, Flatten, Linear, NetSpec, Pool, ReLU, Scale
from hetconv.net.torch_import import from_torch, load_module

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


PRESETS = {"paper": _paper, "lenet5": _lenet5, "cifar10-quick": _cifar10_quick, "vgg-small": _vgg_small,
           "vgg-small-bn": _vgg_small_bn, "airbench94": _airbench94}


def preset(name, input_shape, classes, width=1.0):
    """The preset `name` sized for this input and class count."""
    if name not in PRESETS:
        raise ValueError(f"unknown network preset {name!r}; expected one of {', '.join(PRESETS)}")
    if isinstance(width, bool) or not isinstance(width, (int, float)) or not math.isfinite(width) or width <= 0:
        raise ValueError(f"width of {name} must be a positive number, got {width!r}")
    return NetSpec(input_shape, classes, tuple(PRESETS[name](width, classes)))


class LoadedNet(NamedTuple):
    spec: NetSpec
    params: tuple = None        # (conv [(w, b)], fc [(w, b)]) when the source carries weights, else None


def _accepted():
    return (f"expected a preset ({', '.join(PRESETS)}, optionally NAME@WIDTH such as vgg-small@0.25), "
            f"a .json file, or path.py:function returning a PyTorch module (an nn.Sequential, or one whose forward "
            f"is a chain of layers)")


def load_net(text, input_shape, classes):
    """A network from a `--net` text, sized for the data set (input_shape, classes):
    - a preset name, optionally NAME@WIDTH;
    - a path to a .json file (the stored form);
    - path.py:function, a function returning a PyTorch module: an nn.Sequential, or an nn.Module whose
      forward torch.fx traces into a chain of layers (its weights come along).
    Returns LoadedNet(spec, params)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"--net {text!r}: {_accepted()}")
    text = text.strip()
    head, sep, _ = text.rpartition(":")
    if sep and head.endswith(".py"):
        try:
            spec, conv, fc = from_torch(load_module(text), input_shape)
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
