"""Slow, obviously correct float64 numpy definitions of the per-channel layers (hetconv.channelwise).

Every device kernel for these layers is tested against this file, and this file against PyTorch.
Arrays go in as any float dtype and come out float64; layout NCHW; each backward takes what its
forward took and dy, the gradient with respect to the forward's output, and returns the gradient
with respect to its input. At the kinks, derivatives are PyTorch's: relu passes nothing at 0,
leaky_relu gives negative_slope there, elu and celu the exponential side, hardswish 0 at -3 and 1 at 3
(the outer pieces), relu6, hardtanh and hardsigmoid 0 at their bounds (the flat pieces).
"""
import math

import numpy as np

from hetconv.channelwise import GlobalPool, Pool
from hetconv.net.reference import _pool64, _pool_backward64

_erf = np.vectorize(math.erf, otypes=[np.float64])
_GELU_TANH_SCALE = math.sqrt(2 / math.pi)
_GELU_TANH_CUBIC = 0.044715


def _f64(a):
    return np.asarray(a, np.float64)


def _sigmoid(x):
    # the branch whose exponent is <= 0 never overflows
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


def _bounds(act):
    return (0.0, 6.0) if act.kind == "relu6" else (act.min_val, act.max_val)


def activation(x, act):
    """act (an Activation) applied to every element of x."""
    x = _f64(x)
    kind = act.kind
    if kind == "relu":
        return np.maximum(x, 0)
    if kind == "gelu" and act.approximate == "none":
        return 0.5 * x * (1 + _erf(x / math.sqrt(2)))
    if kind == "gelu":
        return 0.5 * x * (1 + np.tanh(_GELU_TANH_SCALE * (x + _GELU_TANH_CUBIC * x ** 3)))
    if kind == "silu":
        return x * _sigmoid(x)
    if kind == "leaky_relu":
        return np.where(x > 0, x, act.negative_slope * x)
    if kind == "elu":
        return np.where(x > 0, x, act.alpha * np.expm1(np.minimum(x, 0)))
    if kind == "celu":
        return np.where(x > 0, x, act.alpha * np.expm1(np.minimum(x, 0) / act.alpha))
    if kind == "tanh":
        return np.tanh(x)
    if kind == "sigmoid":
        return _sigmoid(x)
    if kind == "hardswish":
        return x * np.clip(x + 3, 0, 6) / 6
    if kind in ("relu6", "hardtanh"):
        lo, hi = _bounds(act)
        return np.clip(x, lo, hi)
    if kind == "hardsigmoid":
        return np.clip(x + 3, 0, 6) / 6
    if kind == "identity":
        return x.copy()
    raise ValueError(f"unknown activation {act!r}")


def activation_backward(x, dy, act):
    """dy times the derivative of act at x."""
    x, dy = _f64(x), _f64(dy)
    kind = act.kind
    if kind == "relu":
        slope = (x > 0).astype(np.float64)
    elif kind == "gelu" and act.approximate == "none":
        slope = 0.5 * (1 + _erf(x / math.sqrt(2))) + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    elif kind == "gelu":
        t = np.tanh(_GELU_TANH_SCALE * (x + _GELU_TANH_CUBIC * x ** 3))
        slope = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _GELU_TANH_SCALE * (1 + 3 * _GELU_TANH_CUBIC * x * x)
    elif kind == "silu":
        s = _sigmoid(x)
        slope = s * (1 + x * (1 - s))
    elif kind == "leaky_relu":
        slope = np.where(x > 0, 1.0, act.negative_slope)
    elif kind == "elu":
        slope = np.where(x > 0, 1.0, act.alpha * np.exp(np.minimum(x, 0)))
    elif kind == "celu":
        slope = np.where(x > 0, 1.0, np.exp(np.minimum(x, 0) / act.alpha))
    elif kind == "tanh":
        slope = 1 - np.tanh(x) ** 2
    elif kind == "sigmoid":
        s = _sigmoid(x)
        slope = s * (1 - s)
    elif kind == "hardswish":
        slope = np.where(x <= -3, 0.0, np.where(x < 3, x / 3 + 0.5, 1.0))
    elif kind in ("relu6", "hardtanh"):
        lo, hi = _bounds(act)
        slope = ((x > lo) & (x < hi)).astype(np.float64)
    elif kind == "hardsigmoid":
        slope = np.where((x > -3) & (x < 3), 1 / 6, 0.0)
    elif kind == "identity":
        slope = np.ones_like(x)
    else:
        raise ValueError(f"unknown activation {act!r}")
    return dy * slope


def _as_pool(x, pool):
    if isinstance(pool, GlobalPool):
        return pool.as_pool(*np.shape(x)[2:])
    if not isinstance(pool, Pool):
        raise TypeError(f"pool must be a Pool or a GlobalPool, got {type(pool).__name__}")
    return pool


def pool(x, pool):
    """A Pool or GlobalPool of x: max pads with -inf, avg divides every window by its whole area."""
    p = _as_pool(x, pool)
    return _pool64(x, p.mode, p.kernel, p.stride, p.padding)


def pool_backward(x, dy, pool):
    """Max sends each output's gradient to the first maximum of its window (row-major); avg
    spreads it evenly over the window; overlapping windows add."""
    p = _as_pool(x, pool)
    return _pool_backward64(x, dy, p.mode, p.kernel, p.stride, p.padding)


# ---- BatchNorm2d ------------------------------------------------------------------------------------

def _affine(bn, weight, bias, channels):
    if not bn.affine:
        return np.ones(channels), np.zeros(channels)
    return _f64(weight), _f64(bias)


def _per_channel(v):
    return np.asarray(v)[None, :, None, None]


def batchnorm_train(x, bn, weight, bias, running_mean, running_var, num_batches_tracked):
    """Training mode: (y, (running_mean, running_var, num_batches_tracked)) after this batch."""
    x = _f64(x)
    n, c, h, w = x.shape
    count = n * h * w
    mean = x.mean(axis=(0, 2, 3))
    var = ((x - _per_channel(mean)) ** 2).mean(axis=(0, 2, 3))
    weight, bias = _affine(bn, weight, bias, c)
    y = (x - _per_channel(mean)) / np.sqrt(_per_channel(var) + bn.eps) * _per_channel(weight) + _per_channel(bias)
    tracked = num_batches_tracked + 1
    f = 1 / tracked if bn.momentum is None else bn.momentum
    running_mean = (1 - f) * _f64(running_mean) + f * mean
    running_var = (1 - f) * _f64(running_var) + f * var * count / (count - 1)
    return y, (running_mean, running_var, tracked)


def batchnorm_train_backward(x, dy, bn, weight):
    """Training mode: (dx, dweight, dbias); dweight and dbias are None without affine. The batch
    statistics depend on x, so dx has the two terms through the mean and the variance."""
    x, dy = _f64(x), _f64(dy)
    n, c, h, w = x.shape
    m = n * h * w
    mean = _per_channel(x.mean(axis=(0, 2, 3)))
    invstd = 1 / np.sqrt(_per_channel(((x - mean) ** 2).mean(axis=(0, 2, 3))) + bn.eps)
    xhat = (x - mean) * invstd
    g = _per_channel(_f64(weight)) if bn.affine else 1.0
    dxhat = dy * g
    dx = invstd / m * (m * dxhat - dxhat.sum(axis=(0, 2, 3), keepdims=True)
                       - xhat * (dxhat * xhat).sum(axis=(0, 2, 3), keepdims=True))
    if not bn.affine:
        return dx, None, None
    return dx, (dy * xhat).sum(axis=(0, 2, 3)), dy.sum(axis=(0, 2, 3))


def batchnorm_eval(x, bn, weight, bias, running_mean, running_var):
    """Evaluation mode: normalised by the running statistics."""
    x = _f64(x)
    weight, bias = _affine(bn, weight, bias, x.shape[1])
    invstd = 1 / np.sqrt(_f64(running_var) + bn.eps)
    return (x - _per_channel(_f64(running_mean))) * _per_channel(invstd * weight) + _per_channel(bias)


def batchnorm_eval_backward(dy, bn, weight, running_var):
    """Evaluation mode's dx: the statistics are constants."""
    dy = _f64(dy)
    weight, _ = _affine(bn, weight, None, dy.shape[1])
    return dy * _per_channel(weight / np.sqrt(_f64(running_var) + bn.eps))


def dropout2d(x, mask):
    """x times the (N, C) mask, per channel of each image: Dropout2d's forward and its backward."""
    return _f64(x) * _f64(mask)[:, :, None, None]
