"""The CPU device's per-channel kernels on channels-last maps (NHWC memory under the contract's
logical N, C, H, W axes), and BatchNorm fused with the activation after it, in either layout.

Why channels-last: oneDNN's convolutions read and write NHWC directly (devices/dnnl_conv.py), so a
map can stay in that layout from one conv through its BatchNorm, activation, sum and pool to the
next, with no reorder between them. A per-channel op on NHWC runs along rows of C contiguous
channels: every row applies the same C per-channel constants, so the inner loop vectorises over
channels whatever the map's height and width (an NCHW plane of a 5x5 map is 25 values, too short
for a vector loop to pay its set-up), and BatchNorm's sums are C running sums a row adds into.

Fusing BatchNorm with the activation after it: forward, y = act((x - mean) * scale + shift) in
one pass instead of two (one map written and read less); backward, the activation's gradient is
recomputed from the BatchNorm's input inside BatchNorm's two passes (its sums, then dx) instead of
a pass of its own, and nothing of the activation is kept. The recomputed BatchNorm output is the
forward's, bit for bit: the same float32 operations in the same order (no fused multiply-add).

Sums: per image and channel, over the image's rows in order, in float64 (an NCHW plane's sum adds
the same values in the same order); the images' sums are added in order by the caller. So the
totals do not depend on the thread count. Every kernel runs `parallel=True` over images or rows.

An inner loop indexes only with its own loop variable, on a row sliced out before it
(`x_row = x[n, r, c0:c1]; x_row[c]`): an index computed in the loop (`x[n, r, c0 + c]`) may be
negative as far as Numba knows, and the wraparound test it then adds per element keeps LLVM from
vectorising the loop: the sums kernels ran several times slower that way (docs/bench-log.md).
"""
import numpy as np
from numba import prange

from hetconv.devices import activation_math as am
from hetconv.devices.base import empty_channels_last, is_channels_last, nhwc
from hetconv.jit import cached_njit

_jit = cached_njit(parallel=True, nogil=True)
# rows a task of a row-parallel kernel takes at least: below it the task's set-up costs more than
# its work
_ROWS_PER_TASK = 64
# channels a task of a sums kernel takes: the (image, channel block) tasks keep every thread busy
# on a micro-batch of a few images
_CHANNEL_BLOCK = 256


def rows_view(a):
    """(N, H*W, C): the rows of a channels-last map."""
    n, c, h, w = a.shape
    return nhwc(a).reshape(n, h * w, c)


def flat_rows(a):
    """(N*H*W, C): every row of a channels-last map."""
    n, c, h, w = a.shape
    return nhwc(a).reshape(n * h * w, c)


def like_layout(shape, like):
    """A new float32 array of `shape` laid out as `like` is."""
    return empty_channels_last(shape) if is_channels_last(like) else np.empty(shape, np.float32)


# ---- BatchNorm's sums ----------------------------------------------------------------------------
@_jit
def _rows_sums(a, b, shift, first, second):
    """first[n, c] = sum of a[n, :, c], second[n, c] = sum of a[n, :, c] * (b[n, :, c] - shift[c]),
    float64, over (N, R, C) rows in order."""
    n_images, rows, channels = a.shape
    blocks = (channels + _CHANNEL_BLOCK - 1) // _CHANNEL_BLOCK
    for t in prange(n_images * blocks):
        n = t // blocks
        c0 = (t % blocks) * _CHANNEL_BLOCK
        c1 = min(channels, c0 + _CHANNEL_BLOCK)
        s1 = np.zeros(c1 - c0)
        s2 = np.zeros(c1 - c0)
        sh = shift[c0:c1].astype(np.float64)
        for r in range(rows):
            a_row, b_row = a[n, r, c0:c1], b[n, r, c0:c1]
            for c in range(c1 - c0):
                av = np.float64(a_row[c])
                s1[c] += av
                s2[c] += av * (np.float64(b_row[c]) - sh[c])
        first[n, c0:c1] = s1
        second[n, c0:c1] = s2


def rows_sums(a, b, shift):
    """Per channel, float64: (sum of a, sum of a * (b - shift)) over images, height and width,
    of two channels-last maps."""
    n, c = a.shape[:2]
    first, second = np.empty((n, c)), np.empty((n, c))
    _rows_sums(rows_view(a), rows_view(b), shift, first, second)
    return first.sum(axis=0), second.sum(axis=0)


# ---- per-code kernels: an activation fused into BatchNorm, in each layout --------------------------
def _kernels(code):
    """The kernels of one activation code (a constant inside each: activation_math's *_of
    functions give each kernel that activation's arithmetic alone): BatchNorm + activation
    forward, the sums and dx of their backward, on channels-last rows (R, C) and on NCHW planes
    (N, C, H*W). They close over the code alone: Numba's cache keys a closure by its cells'
    pickled contents, and a cell holding a jitted function pickles differently in every process:
    a kernel closing over one would be compiled again by every process, each worker's start paying
    four parallel kernels per activation and layout (tests/test_jit_cache.py holds this)."""
    @_jit
    def norm_act_rows(x, mean, scale, shift, p1, p2, y):
        rows, channels = x.shape
        tasks = (rows + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK
        for t in prange(tasks):
            for r in range(t * _ROWS_PER_TASK, min(rows, (t + 1) * _ROWS_PER_TASK)):
                for c in range(channels):
                    y[r, c] = am.forward_of(code, (x[r, c] - mean[c]) * scale[c] + shift[c], p1, p2)

    @_jit
    def norm_act_planes(x, mean, scale, shift, p1, p2, y):
        n_images, channels, size = x.shape
        for t in prange(n_images * channels):
            n = t // channels
            c = t % channels
            m, s, b = mean[c], scale[c], shift[c]
            for j in range(size):
                y[n, c, j] = am.forward_of(code, (x[n, c, j] - m) * s + b, p1, p2)

    @_jit
    def grad_sums_rows(x, dy, mean, scale, shift, p1, p2, first, second):
        """first[n, c] = sum of g, second[n, c] = sum of g * (x - mean[c]), g the activation's
        gradient of dy at the BatchNorm's output (recomputed from x), over (N, R, C) rows."""
        n_images, rows, channels = x.shape
        blocks = (channels + _CHANNEL_BLOCK - 1) // _CHANNEL_BLOCK
        for t in prange(n_images * blocks):
            n = t // blocks
            c0 = (t % blocks) * _CHANNEL_BLOCK
            c1 = min(channels, c0 + _CHANNEL_BLOCK)
            s1 = np.zeros(c1 - c0)
            s2 = np.zeros(c1 - c0)
            m, sc, sh = mean[c0:c1], scale[c0:c1], shift[c0:c1]
            for r in range(rows):
                x_row, dy_row = x[n, r, c0:c1], dy[n, r, c0:c1]
                for c in range(c1 - c0):
                    xv = x_row[c]
                    g = np.float64(am.gradient_of(code, (xv - m[c]) * sc[c] + sh[c], dy_row[c], p1, p2))
                    s1[c] += g
                    s2[c] += g * (np.float64(xv) - np.float64(m[c]))
            first[n, c0:c1] = s1
            second[n, c0:c1] = s2

    @_jit
    def grad_sums_planes(x, dy, mean, scale, shift, p1, p2, first, second):
        n_images, channels, size = x.shape
        for t in prange(n_images * channels):
            n = t // channels
            c = t % channels
            m, s, b = mean[c], scale[c], shift[c]
            m64 = np.float64(m)
            s1 = 0.0
            s2 = 0.0
            for j in range(size):
                xv = x[n, c, j]
                g = np.float64(am.gradient_of(code, (xv - m) * s + b, dy[n, c, j], p1, p2))
                s1 += g
                s2 += g * (np.float64(xv) - m64)
            first[n, c] = s1
            second[n, c] = s2

    @_jit
    def backward_rows(x, dy, mean, scale, shift, p1, p2, mean_dy, k, a, dx):
        rows, channels = x.shape
        tasks = (rows + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK
        for t in prange(tasks):
            for r in range(t * _ROWS_PER_TASK, min(rows, (t + 1) * _ROWS_PER_TASK)):
                for c in range(channels):
                    xv = x[r, c]
                    g = am.gradient_of(code, (xv - mean[c]) * scale[c] + shift[c], dy[r, c], p1, p2)
                    dx[r, c] = (g - mean_dy[c] - (xv - mean[c]) * k[c]) * a[c]

    @_jit
    def backward_planes(x, dy, mean, scale, shift, p1, p2, mean_dy, k, a, dx):
        n_images, channels, size = x.shape
        for t in prange(n_images * channels):
            n = t // channels
            c = t % channels
            m, s, b, md, kc, ac = mean[c], scale[c], shift[c], mean_dy[c], k[c], a[c]
            for j in range(size):
                xv = x[n, c, j]
                g = am.gradient_of(code, (xv - m) * s + b, dy[n, c, j], p1, p2)
                dx[n, c, j] = (g - md - (xv - m) * kc) * ac

    return {"norm_act_rows": norm_act_rows, "norm_act_planes": norm_act_planes,
            "grad_sums_rows": grad_sums_rows, "grad_sums_planes": grad_sums_planes,
            "backward_rows": backward_rows, "backward_planes": backward_planes}


_KERNELS = {}


def _of(code):
    if code not in _KERNELS:
        _KERNELS[code] = _kernels(code)
    return _KERNELS[code]


def _planes(a):
    n, c, h, w = a.shape
    return a.reshape(n, c, h * w)


def norm_act(x, mean, scale, shift, code, p1, p2):
    """y = act((x - mean) * scale + shift) per channel, in x's layout (IDENTITY: BatchNorm alone)."""
    y = like_layout(x.shape, x)
    if is_channels_last(x):
        _of(code)["norm_act_rows"](flat_rows(x), mean, scale, shift, p1, p2, flat_rows(y))
    else:
        _of(code)["norm_act_planes"](_planes(x), mean, scale, shift, p1, p2, _planes(y))
    return y


def grad_sums(x, dy, mean, scale, shift, code, p1, p2):
    """Per channel, float64: (sum of g, sum of g * (x - mean)) over images, height and width, g
    the gradient of dy through the activation at act's input (x normalised again): BatchNorm's
    backward sums with the activation's backward folded in. dy is read in x's layout."""
    n, c = x.shape[:2]
    first, second = np.empty((n, c)), np.empty((n, c))
    if is_channels_last(x):
        _of(code)["grad_sums_rows"](rows_view(x), rows_view(dy), mean, scale, shift, p1, p2, first, second)
    else:
        _of(code)["grad_sums_planes"](_planes(x), _planes(dy), mean, scale, shift, p1, p2, first, second)
    return first.sum(axis=0), second.sum(axis=0)


def backward(x, dy, mean, scale, shift, code, p1, p2, mean_dy, k, a):
    """dx = (g - mean_dy - (x - mean) * k) * a per channel, g as grad_sums has it, in x's layout."""
    dx = like_layout(x.shape, x)
    if is_channels_last(x):
        _of(code)["backward_rows"](flat_rows(x), flat_rows(dy), mean, scale, shift, p1, p2, mean_dy, k, a,
                                   flat_rows(dx))
    else:
        _of(code)["backward_planes"](_planes(x), _planes(dy), mean, scale, shift, p1, p2, mean_dy, k, a,
                                     _planes(dx))
    return dx


# ---- pools and the per-(image, channel) scale, on rows ------------------------------------------
@_jit
def _pool_rows(x, is_max, kh, kw, sh, sw, ph, pw, y, argmax):
    """x (N, H, W, C) -> y (N, Hp, Wp, C): each window's max (argmax: the flat index in the plane
    of its first maximum in row-major window order) or average (padding counted as zeros,
    divided by kh*kw, summed in float64), as the NCHW kernel (cpu_channelwise._pool) does."""
    n_images, h, w, channels = x.shape
    hp, wp = y.shape[1], y.shape[2]
    area = kh * kw
    for t in prange(n_images * hp):
        n = t // hp
        a = t % hp
        r0 = max(a * sh - ph, 0)
        r1 = min(a * sh - ph + kh, h)
        total = np.zeros(channels)
        for e in range(wp):
            s0 = max(e * sw - pw, 0)
            s1 = min(e * sw - pw + kw, w)
            if is_max:
                for c in range(channels):
                    y[n, a, e, c] = x[n, r0, s0, c]
                    argmax[n, a, e, c] = r0 * w + s0
                for r in range(r0, r1):
                    for s in range(s0, s1):
                        for c in range(channels):
                            v = x[n, r, s, c]
                            if v > y[n, a, e, c]:           # strict: the first maximum wins
                                y[n, a, e, c] = v
                                argmax[n, a, e, c] = r * w + s
            else:
                total[:] = 0.0
                for r in range(r0, r1):
                    for s in range(s0, s1):
                        for c in range(channels):
                            total[c] += x[n, r, s, c]
                for c in range(channels):
                    y[n, a, e, c] = total[c] / area


@_jit
def _pool_rows_backward(dy, is_max, kh, kw, sh, sw, ph, pw, argmax, dx):
    """dx (N, H, W, C) = each window's gradient sent back, to its argmax or spread over it;
    overlapping windows add in a fixed order (as cpu_channelwise._pool_backward)."""
    n_images, h, w, channels = dx.shape
    hp, wp = dy.shape[1], dy.shape[2]
    area = np.float32(kh * kw)
    for n in prange(n_images):
        for r in range(h):
            for s in range(w):
                for c in range(channels):
                    dx[n, r, s, c] = 0
        for a in range(hp):
            r0 = max(a * sh - ph, 0)
            r1 = min(a * sh - ph + kh, h)
            for e in range(wp):
                if is_max:
                    for c in range(channels):
                        arg = argmax[n, a, e, c]
                        dx[n, arg // w, arg % w, c] += dy[n, a, e, c]
                else:
                    s0 = max(e * sw - pw, 0)
                    s1 = min(e * sw - pw + kw, w)
                    for r in range(r0, r1):
                        for s in range(s0, s1):
                            for c in range(channels):
                                dx[n, r, s, c] += dy[n, a, e, c] / area


def pool(x, pool, out_shape):
    """(y, argmax or None) as cpu_channelwise.pool, on a channels-last x (y and argmax channels-last)."""
    is_max = pool.mode == "max"
    y = empty_channels_last(out_shape)
    argmax = empty_channels_last(out_shape if is_max else (0, 0, 0, 0), np.int32)
    _pool_rows(nhwc(x), is_max, *pool.kernel, *pool.stride, *pool.padding, nhwc(y), nhwc(argmax))
    return y, argmax


def pool_backward(pool, argmax, in_shape, dy):
    dx = empty_channels_last(in_shape)
    _pool_rows_backward(nhwc(dy), pool.mode == "max", *pool.kernel, *pool.stride, *pool.padding, nhwc(argmax),
                        nhwc(dx))
    return dx


@_jit
def _scale_rows(x, mask, y):
    n_images, rows, channels = x.shape
    for n in prange(n_images):
        for r in range(rows):
            for c in range(channels):
                y[n, r, c] = x[n, r, c] * mask[n, c]


def channel_scale(x, mask):
    y = empty_channels_last(x.shape)
    _scale_rows(rows_view(x), mask, rows_view(y))
    return y


def flat(a):
    """Every value of a C-contiguous or channels-last map, in memory order (a view)."""
    return nhwc(a).reshape(-1) if is_channels_last(a) else a.reshape(-1)
