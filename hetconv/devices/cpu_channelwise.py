"""The CPU device's per-channel kernels (Numba): activations, BatchNorm's sums, normalisation and
backward, and the per-(image, channel) scale of Dropout2d. The pools run devices/cpu.py's
conv-block pool kernels (_act_pool), with no bias and no activation.

All are memory-bound: one pass reading each input once and writing each output once, parallel
over (image, channel) planes (or over elements for the activations), in float32 (as PyTorch's
fp32 CPU kernels) except the sums, which accumulate in float64. A plane's sum runs in a fixed
order on one thread, and the planes' sums are added over the images in order afterwards, so the
totals do not depend on the thread count, and the sums of a batch's pieces add up to the whole
batch's within float64 rounding. What is returned is always a fresh array.
"""
import numpy as np
from numba import prange

from hetconv.devices import activation_math as am
from hetconv.devices.base import in_layout_of
from hetconv.devices.cpu_channels_last import flat, like_layout
from hetconv.jit import cached_njit

_jit = cached_njit(parallel=True, nogil=True)
# for the sums: LLVM may reassociate them, so a plane's loop vectorizes (one running sum waits an
# add's latency per element: resnet18's BatchNorm sums ran 33 ms of a 1.07 s one-thread step).
# The order is fixed when the kernel is compiled, the same for every thread count and every piece
# of a batch; it differs from a serial sum by float64 rounding only.
_jit_sums = cached_njit(parallel=True, nogil=True, fastmath={"reassoc"})


def activation(x, act):
    """(y, saved): y = act(x), in x's layout (NCHW or channels-last: the loop runs over memory);
    saved is what activation_backward needs (x or y, not copied)."""
    code, param, param2 = am.code_and_params(act)
    y = like_layout(x.shape, x)
    am.CPU_KERNELS[code][0](param, param2, flat(x), flat(y))
    return y, (y if code in am.SAVES_OUTPUT else x)


def activation_backward(act, saved, dy):
    """dx in saved's layout (dy is read in it)."""
    code, param, param2 = am.code_and_params(act)
    dy = in_layout_of(dy, saved)
    dx = like_layout(dy.shape, saved)
    am.CPU_KERNELS[code][1](param, param2, flat(saved), flat(dy), flat(dx))
    return dx


@_jit_sums
def _plane_sums(a, b, shift, first, second):
    """first[n, c] = sum of a[n, c, :], second[n, c] = sum of a[n, c, :] * (b[n, c, :] - shift[c]),
    in float64, over (N, C, H*W) views."""
    n_images, channels, size = a.shape
    for t in prange(n_images * channels):
        n = t // channels
        c = t % channels
        sh = np.float64(shift[c])
        s1 = 0.0
        s2 = 0.0
        for j in range(size):
            av = np.float64(a[n, c, j])
            s1 += av
            s2 += av * (np.float64(b[n, c, j]) - sh)
        first[n, c] = s1
        second[n, c] = s2


def _planes(a):
    n, c, h, w = a.shape
    return a.reshape(n, c, h * w)


def plane_sums(a, b, shift):
    """Per channel, float64: (sum of a, sum of a * (b - shift)) over images, height and width."""
    n, c = a.shape[:2]
    first, second = np.empty((n, c)), np.empty((n, c))
    _plane_sums(_planes(a), _planes(b), shift, first, second)
    # over the images in order: numpy adds the rows of a C-contiguous (N, C) array one by one
    return first.sum(axis=0), second.sum(axis=0)


@_jit
def _normalize(x, mean, scale, shift, y):
    """y = (x - mean[c]) * scale[c] + shift[c] over (N, C, H*W) views."""
    n_images, channels, size = x.shape
    for t in prange(n_images * channels):
        n = t // channels
        c = t % channels
        m, s, b = mean[c], scale[c], shift[c]
        for j in range(size):
            y[n, c, j] = (x[n, c, j] - m) * s + b


def normalize(x, mean, scale, shift):
    y = np.empty_like(x)
    _normalize(_planes(x), mean, scale, shift, _planes(y))
    return y


@_jit
def _batchnorm_backward(x, dy, mean, mean_dy, k, a, dx):
    """dx = (dy - mean_dy[c] - (x - mean[c]) * k[c]) * a[c] over (N, C, H*W) views."""
    n_images, channels, size = x.shape
    for t in prange(n_images * channels):
        n = t // channels
        c = t % channels
        m, md, kc, ac = mean[c], mean_dy[c], k[c], a[c]
        for j in range(size):
            dx[n, c, j] = (dy[n, c, j] - md - (x[n, c, j] - m) * kc) * ac


def batchnorm_backward(x, dy, mean, mean_dy, k, a):
    dx = np.empty_like(dy)
    _batchnorm_backward(_planes(x), _planes(dy), mean, mean_dy, k, a, _planes(dx))
    return dx


@_jit
def _channel_scale(x, mask, y):
    n_images, channels, size = x.shape
    for t in prange(n_images * channels):
        n = t // channels
        c = t % channels
        f = mask[n, c]
        for j in range(size):
            y[n, c, j] = x[n, c, j] * f


def channel_scale(x, mask):
    y = np.empty_like(x)
    _channel_scale(_planes(x), mask, _planes(y))
    return y


@_jit
def _pool(x, is_max, kh, kw, sh, sw, ph, pw, y, argmax):
    """y[n, c] = the max or average of each window of x[n, c]; windows start at a*sh - ph,
    e*sw - pw and are clipped to the map (a max-pool's padding never wins; an average divides by
    the whole kh*kw, padding counted as zeros; the sum in float64). Max: argmax = the flat index
    in the plane of the window's first maximum in row-major order. A NaN is not propagated as
    PyTorch does (a test for it made the max loop ~10x slower), as in the conv block's pools."""
    n_images, channels, h, w = x.shape
    hp, wp = y.shape[2], y.shape[3]
    area = kh * kw
    for t in prange(n_images * channels):
        n = t // channels
        c = t % channels
        for a in range(hp):
            r0 = max(a * sh - ph, 0)
            r1 = min(a * sh - ph + kh, h)
            for e in range(wp):
                s0 = max(e * sw - pw, 0)
                s1 = min(e * sw - pw + kw, w)
                if is_max:
                    best = x[n, c, r0, s0]
                    arg = r0 * w + s0
                    for r in range(r0, r1):
                        for s in range(s0, s1):
                            v = x[n, c, r, s]
                            if v > best:        # strict: the first maximum wins
                                best = v
                                arg = r * w + s
                    y[n, c, a, e] = best
                    argmax[n, c, a, e] = arg
                else:
                    total = 0.0
                    for r in range(r0, r1):
                        for s in range(s0, s1):
                            total += x[n, c, r, s]
                    y[n, c, a, e] = total / area


@_jit
def _pool_backward(dy, is_max, kh, kw, sh, sw, ph, pw, argmax, dx):
    """dx[n, c] = each window's gradient sent back: to its argmax (max), or spread over it
    (average); overlapping windows add, in a fixed order."""
    n_images, channels, h, w = dx.shape
    hp, wp = dy.shape[2], dy.shape[3]
    area = np.float32(kh * kw)
    for t in prange(n_images * channels):
        n = t // channels
        c = t % channels
        for r in range(h):
            for s in range(w):
                dx[n, c, r, s] = 0
        for a in range(hp):
            r0 = max(a * sh - ph, 0)
            r1 = min(a * sh - ph + kh, h)
            for e in range(wp):
                g = dy[n, c, a, e]
                if is_max:
                    arg = argmax[n, c, a, e]
                    dx[n, c, arg // w, arg % w] += g
                else:
                    g = g / area
                    s0 = max(e * sw - pw, 0)
                    s1 = min(e * sw - pw + kw, w)
                    for r in range(r0, r1):
                        for s in range(s0, s1):
                            dx[n, c, r, s] += g


def pool(x, pool, out_shape):
    """(y, argmax or None): argmax (int32, flat index in the plane) for a max-pool's backward."""
    is_max = pool.mode == "max"
    y = np.empty(out_shape, np.float32)
    argmax = np.empty(out_shape if is_max else (0, 0, 0, 0), np.int32)
    _pool(x, is_max, *pool.kernel, *pool.stride, *pool.padding, y, argmax)
    return y, argmax


def pool_backward(pool, argmax, in_shape, dy):
    dx = np.empty(in_shape, np.float32)
    _pool_backward(dy, pool.mode == "max", *pool.kernel, *pool.stride, *pool.padding, argmax, dx)
    return dx
