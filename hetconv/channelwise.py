"""Per-channel layers as data: activations, pools, global pools, BatchNorm and channel dropout.

Each layer is a frozen descriptor whose values are checked when it is made (a ValueError names
the key and what was expected), with to_json() / from_json() (unknown keys refused) and
output_hw(h, w), the spatial size it leaves (the pools shrink it, the rest keep it). Semantics
are PyTorch's: nn.ReLU, nn.GELU, nn.SiLU, nn.LeakyReLU, nn.ELU, nn.CELU, nn.Tanh, nn.Sigmoid,
nn.Hardswish, nn.ReLU6, nn.Hardtanh, nn.Hardsigmoid, nn.MaxPool2d / nn.AvgPool2d (floor mode,
count_include_pad=True), nn.AdaptiveAvgPool2d(1) /
nn.AdaptiveMaxPool2d(1), nn.BatchNorm2d and nn.Dropout2d.

The devices run these layers on channel slices (devices/base.py: activation, pool, channel_sums,
batchnorm_apply, batchnorm_grad_sums, batchnorm_backward, channel_scale). BatchNorm is split so
that a batch held in pieces (images on several workers, micro-batches) normalises with the whole
batch's statistics: each piece gives per-channel sums, the sums are added in a fixed order, and
the host-side helpers at the end of this module turn totals into statistics, running statistics
and parameter gradients. Those helpers compute in float64 and hand the devices float32.
"""
from dataclasses import dataclass
import math

import numpy as np

from hetconv.sizes import as_pair, window_output_size


def _number(owner, name, value, check=None, expected="a finite number"):
    """A finite real number (not a bool) as a Python float, else ValueError naming owner.name."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not math.isfinite(value) or (check is not None and not check(value)):
        raise ValueError(f"{owner} {name} must be {expected}, got {value!r}")
    return float(value)


def _refuse_unknown(owner, d, known):
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise ValueError(f"unknown {owner} key(s) {unknown!r}: expected some of {sorted(known)!r}")


def _typed(owner, d, type_name):
    """d without its optional "type" key, which must name this layer when present."""
    if not isinstance(d, dict):
        raise ValueError(f"{owner} must be a JSON object, got {d!r}")
    if "type" in d and d["type"] != type_name:
        raise ValueError(f"{owner} type must be {type_name!r}, got {d['type']!r}")
    return {k: v for k, v in d.items() if k != "type"}


# ---- activations ----------------------------------------------------------------------------------

# kind -> the parameters it takes besides approximate (gelu only), with their defaults
ACTIVATION_PARAMETERS = {
    "relu": (), "gelu": ("approximate",), "silu": (), "leaky_relu": ("negative_slope",), "elu": ("alpha",),
    "celu": ("alpha",), "tanh": (), "sigmoid": (), "hardswish": (), "relu6": (), "hardtanh": ("min_val", "max_val"),
    "hardsigmoid": (), "identity": (),
}
ACTIVATION_KINDS = tuple(ACTIVATION_PARAMETERS)
GELU_APPROXIMATIONS = ("none", "tanh")
_ACTIVATION_DEFAULTS = {"negative_slope": 0.01, "alpha": 1.0, "approximate": "none", "min_val": -1.0, "max_val": 1.0}


@dataclass(frozen=True)
class Activation:
    """An elementwise activation. Only the keys a kind uses may differ from their defaults:
    negative_slope for leaky_relu, alpha for elu and celu (celu divides by it: nonzero),
    approximate ("none": exact erf, or "tanh") for gelu, min_val < max_val for hardtanh (relu6 is
    hardtanh from 0 to 6, as nn.ReLU6 is)."""
    kind: str
    negative_slope: float = 0.01
    alpha: float = 1.0
    approximate: str = "none"
    min_val: float = -1.0
    max_val: float = 1.0
    type = "activation"

    def __post_init__(self):
        if self.kind not in ACTIVATION_PARAMETERS:
            raise ValueError(f"activation kind must be one of {ACTIVATION_KINDS!r}, got {self.kind!r}")
        used = ACTIVATION_PARAMETERS[self.kind]
        for name, default in _ACTIVATION_DEFAULTS.items():
            if name not in used and getattr(self, name) != default:
                takes = ", ".join(used) if used else "no parameters"
                raise ValueError(f"activation {self.kind} takes {takes}, not {name}={getattr(self, name)!r}")
        object.__setattr__(self, "negative_slope", _number(f"activation {self.kind}", "negative_slope",
                                                           self.negative_slope))
        object.__setattr__(self, "alpha", _number(f"activation {self.kind}", "alpha", self.alpha,
                                                  (lambda a: a != 0) if self.kind == "celu" else None,
                                                  "a finite nonzero number" if self.kind == "celu" else "a finite number"))
        for name in ("min_val", "max_val"):
            object.__setattr__(self, name, _number(f"activation {self.kind}", name, getattr(self, name)))
        if not self.min_val < self.max_val:
            raise ValueError(f"activation hardtanh max_val must be greater than min_val, got min_val {self.min_val!r} "
                             f"and max_val {self.max_val!r}")
        if self.approximate not in GELU_APPROXIMATIONS:
            raise ValueError(f"activation gelu approximate must be one of {GELU_APPROXIMATIONS!r}, "
                             f"got {self.approximate!r}")

    def to_json(self):
        return {"type": self.type, "kind": self.kind,
                **{name: getattr(self, name) for name in ACTIVATION_PARAMETERS[self.kind]}}

    @classmethod
    def from_json(cls, d):
        d = _typed("activation", d, cls.type)
        if "kind" not in d:
            raise ValueError(f"activation needs a kind, one of {ACTIVATION_KINDS!r}; got {d!r}")
        kind = d["kind"]
        if kind in ACTIVATION_PARAMETERS:
            _refuse_unknown(f"activation {kind}", d, ("kind", *ACTIVATION_PARAMETERS[kind]))
        return cls(**d)

    def output_hw(self, h, w):
        return h, w


# ---- pools ------------------------------------------------------------------------------------------

POOL_MODES = ("max", "avg")


@dataclass(frozen=True)
class Pool:
    """nn.MaxPool2d / nn.AvgPool2d: floor mode; max pads with -inf (padding never wins); avg
    counts its zero padding (every window divides by kh*kw); padding at most half the kernel,
    as PyTorch requires. Pairs are (height, width); an int stands for both; stride None is the
    kernel."""
    mode: str
    kernel: tuple
    stride: tuple = None
    padding: tuple = (0, 0)
    type = "pool"

    def __post_init__(self):
        if self.mode not in POOL_MODES:
            raise ValueError(f"pool mode must be one of {POOL_MODES!r}, got {self.mode!r}")
        kernel = as_pair("pool kernel", self.kernel, 1)
        object.__setattr__(self, "kernel", kernel)
        object.__setattr__(self, "stride", kernel if self.stride is None else as_pair("pool stride", self.stride, 1))
        padding = as_pair("pool padding", self.padding, 0)
        # PyTorch refuses more; beyond half a window, some windows would hold only padding
        if any(2 * p > k for p, k in zip(padding, kernel)):
            raise ValueError(f"pool padding {padding!r} must be at most half of the kernel {kernel!r} "
                             f"(as PyTorch requires)")
        object.__setattr__(self, "padding", padding)

    def to_json(self):
        return {"type": self.type, "mode": self.mode, "kernel": list(self.kernel), "stride": list(self.stride),
                "padding": list(self.padding)}

    @classmethod
    def from_json(cls, d):
        d = _typed("pool", d, cls.type)
        _refuse_unknown("pool", d, ("mode", "kernel", "stride", "padding"))
        for key in ("mode", "kernel"):
            if key not in d:
                raise ValueError(f"pool needs a {key}; got {d!r}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})

    def output_hw(self, h, w):
        (kh, kw), (sh, sw), (ph, pw) = self.kernel, self.stride, self.padding
        if h + 2 * ph < kh or w + 2 * pw < kw:
            raise ValueError(f"a {h}x{w} input is too small for a {kh}x{kw} {self.mode}-pool with padding "
                             f"{self.padding!r}")
        return window_output_size(h, kh, sh, ph), window_output_size(w, kw, sw, pw)


@dataclass(frozen=True)
class GlobalPool:
    """nn.AdaptiveAvgPool2d(1) / nn.AdaptiveMaxPool2d(1): one value per (image, channel)."""
    mode: str
    type = "global_pool"

    def __post_init__(self):
        if self.mode not in POOL_MODES:
            raise ValueError(f"global pool mode must be one of {POOL_MODES!r}, got {self.mode!r}")

    def to_json(self):
        return {"type": self.type, "mode": self.mode}

    @classmethod
    def from_json(cls, d):
        d = _typed("global pool", d, cls.type)
        _refuse_unknown("global pool", d, ("mode",))
        if "mode" not in d:
            raise ValueError(f"global pool needs a mode, one of {POOL_MODES!r}; got {d!r}")
        return cls(**d)

    def output_hw(self, h, w):
        return 1, 1

    def as_pool(self, h, w):
        """The same layer on an h x w input as a Pool whose one window is the whole map."""
        return Pool(self.mode, (h, w))


# ---- BatchNorm and channel dropout -------------------------------------------------------------------

@dataclass(frozen=True)
class BatchNorm:
    """nn.BatchNorm2d(C, eps, momentum, affine) with running statistics tracked. momentum None
    is the cumulative moving average (each batch weighs 1/num_batches_tracked)."""
    eps: float = 1e-5
    momentum: float = 0.1
    affine: bool = True
    type = "batchnorm"

    def __post_init__(self):
        object.__setattr__(self, "eps", _number("batchnorm", "eps", self.eps, lambda e: e > 0, "a finite number > 0"))
        if self.momentum is not None:
            object.__setattr__(self, "momentum", _number("batchnorm", "momentum", self.momentum,
                                                         lambda m: 0 <= m <= 1, "a number in [0, 1] or None"))
        if not isinstance(self.affine, (bool, np.bool_)):
            raise ValueError(f"batchnorm affine must be true or false, got {self.affine!r}")
        object.__setattr__(self, "affine", bool(self.affine))

    def to_json(self):
        return {"type": self.type, "eps": self.eps, "momentum": self.momentum, "affine": self.affine}

    @classmethod
    def from_json(cls, d):
        d = _typed("batchnorm", d, cls.type)
        _refuse_unknown("batchnorm", d, ("eps", "momentum", "affine"))
        return cls(**d)

    def output_hw(self, h, w):
        return h, w


@dataclass(frozen=True)
class Dropout2d:
    """nn.Dropout2d(p): zeroes whole channels per image and scales the kept ones by 1/(1-p). The
    mask is drawn by the caller; dropout2d_mask turns kept flags into the mask devices multiply by."""
    p: float = 0.5
    type = "dropout2d"

    def __post_init__(self):
        object.__setattr__(self, "p", _number("dropout2d", "p", self.p, lambda p: 0 <= p < 1, "a number in [0, 1)"))

    def to_json(self):
        return {"type": self.type, "p": self.p}

    @classmethod
    def from_json(cls, d):
        d = _typed("dropout2d", d, cls.type)
        _refuse_unknown("dropout2d", d, ("p",))
        return cls(**d)

    def output_hw(self, h, w):
        return h, w


LAYERS = {cls.type: cls for cls in (Activation, Pool, GlobalPool, BatchNorm, Dropout2d)}


def layer_from_json(d):
    """Any of this module's layers from its to_json() form, picked by its "type"."""
    if not isinstance(d, dict) or d.get("type") not in LAYERS:
        got = d.get("type") if isinstance(d, dict) else d
        raise ValueError(f"a per-channel layer needs a type, one of {sorted(LAYERS)!r}; got {got!r}")
    return LAYERS[d["type"]].from_json(d)


# ---- between the device calls: BatchNorm statistics and Dropout2d masks (host side, numpy) -----------

def _channel_vector(name, a, channels=None):
    a = np.asarray(a)
    if a.ndim != 1 or (channels is not None and a.shape[0] != channels):
        want = f"({channels},)" if channels is not None else "(C,)"
        raise ValueError(f"{name} must have shape {want}, got {a.shape!r}")
    if not np.issubdtype(a.dtype, np.floating):
        raise TypeError(f"{name} must be floating point, got {a.dtype}")
    return a.astype(np.float64)


def _training_count(count):
    if isinstance(count, (bool, np.bool_)) or not isinstance(count, (int, np.integer)) or count < 2:
        # PyTorch refuses it too: one value per channel has no variance to normalise by
        raise ValueError(f"batchnorm in training needs more than one value per channel (images x height x "
                         f"width of the whole batch), got count {count!r}")
    return int(count)


@dataclass(frozen=True)
class BatchStatistics:
    """A batch's per-channel statistics (float64, (C,)): mean, biased variance, and
    invstd = 1/sqrt(var + eps); mean32 / invstd32 are what batchnorm_apply takes."""
    mean: np.ndarray
    var: np.ndarray
    invstd: np.ndarray
    count: int

    @property
    def mean32(self):
        return self.mean.astype(np.float32)

    @property
    def invstd32(self):
        return self.invstd.astype(np.float32)


def batch_statistics(bn, s, ss, count):
    """BatchStatistics from the whole batch's channel_sums totals: s = sum of x, ss = sum of x*x
    over images, height and width, count = values per channel. float64 keeps ss - count*mean^2
    exact enough while |mean| / std stays below ~1e5 (beyond, the variance loses digits)."""
    count = _training_count(count)
    s = _channel_vector("s", s)
    ss = _channel_vector("ss", ss, s.shape[0])
    mean = s / count
    var = np.maximum(ss / count - mean * mean, 0.0)     # rounding may leave a tiny negative
    return BatchStatistics(mean, var, 1.0 / np.sqrt(var + bn.eps), count)


def eval_statistics(bn, running_mean, running_var):
    """(mean32, invstd32) for batchnorm_apply in evaluation: the running statistics."""
    mean = _channel_vector("running_mean", running_mean)
    var = _channel_vector("running_var", running_var, mean.shape[0])
    return mean.astype(np.float32), (1.0 / np.sqrt(var + bn.eps)).astype(np.float32)


def update_running_statistics(bn, running_mean, running_var, num_batches_tracked, stats):
    """(running_mean, running_var, num_batches_tracked) after one training batch, as BatchNorm2d:
    the count goes up by one; each statistic moves by factor f = momentum (or 1/count of batches
    when momentum is None) towards the batch's mean and unbiased variance var*n/(n-1). New float32
    arrays; the inputs are not changed."""
    mean = _channel_vector("running_mean", running_mean, stats.mean.shape[0])
    var = _channel_vector("running_var", running_var, stats.mean.shape[0])
    if isinstance(num_batches_tracked, (bool, np.bool_)) or not isinstance(num_batches_tracked, (int, np.integer)) \
            or num_batches_tracked < 0:
        raise ValueError(f"num_batches_tracked must be a non-negative integer, got {num_batches_tracked!r}")
    tracked = int(num_batches_tracked) + 1
    f = 1.0 / tracked if bn.momentum is None else bn.momentum
    unbiased = stats.var * (stats.count / (stats.count - 1))
    return (((1 - f) * mean + f * stats.mean).astype(np.float32),
            ((1 - f) * var + f * unbiased).astype(np.float32), tracked)


def batchnorm_parameter_grads(sdy, sdyx):
    """(dweight, dbias) float32 from the whole batch's batchnorm_grad_sums totals."""
    return _channel_vector("sdyx", sdyx).astype(np.float32), _channel_vector("sdy", sdy).astype(np.float32)


def dropout2d_mask(dropout, keep):
    """The (N, C) float32 mask channel_scale multiplies by: 1/(1-p) where keep is true, 0 elsewhere."""
    keep = np.asarray(keep)
    if keep.ndim != 2 or keep.dtype != np.bool_:
        raise ValueError(f"keep must be an (N, C) bool array, got {keep.dtype} of shape {keep.shape!r}")
    return np.where(keep, np.float32(1.0 / (1.0 - dropout.p)), np.float32(0)).astype(np.float32)
