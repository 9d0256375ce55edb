"""What the CPU device runs on a conv's output after its GEMMs, and on the gradient before them:
bias, activation and pool forward (keeping an argmax or a ReLU mask), their gradients backward,
and the bias's gradient (dY summed per kernel), each on the layouts the conv paths leave.

Layouts, (K, P) with p = (n*ho + i)*wo + j the im2col path's "columns", (ho*nb*wo, K) with row
(i*nb + n)*wo + j the shifted path's "rows", (N, K, H, W) the direct and FFT paths' "planes". Each
pass is one Numba `parallel=True` kernel that also absorbs the layout change: memory-bound work
that costs the same whatever the GEMMs cost.
"""
import numpy as np
from numba import prange
from numpy.lib.stride_tricks import as_strided

from hetconv.geometry import window_output_size
from hetconv.jit import cached_njit

_jit = cached_njit(parallel=True, nogil=True)
# ... for kernels that also sum their output per plane in float64: LLVM may reassociate those sums
# (and so vectorize the whole loop). Without it the loop stays scalar: vgg-small's 32x32 ReLU
# backward with its bias sums ran 1.8 ms on 2 threads, 0.06 ms with it. The order is fixed when
# the kernel is compiled, so a run repeats; it differs from a serial sum by float64 rounding only.
_jit_sums = cached_njit(parallel=True, nogil=True, fastmath={"reassoc"})


# ---- the paper's block: bias, ReLU (or none) and a 2x2 stride-2 max-pool, with an int8 argmax ---
@cached_njit(inline="always", nogil=True)
def _max2_store(out, argmax, n, k, a, e, relu, v0, v1, v2, v3):
    """out[n, k, a, e] = max(v0..v3), through ReLU where `relu`; argmax = the first max in
    row-major window order (0..3), or -1 where ReLU gives it no gradient (the max is not > 0).
    Inlined into both pool kernels, whatever their layout."""
    best, arg = v0, 0
    if v1 > best:
        best, arg = v1, 1
    if v2 > best:
        best, arg = v2, 2
    if v3 > best:
        best, arg = v3, 3
    if best > 0 or not relu:
        out[n, k, a, e] = best
        argmax[n, k, a, e] = arg
    else:
        out[n, k, a, e] = 0.0
        argmax[n, k, a, e] = -1


@_jit
def _bias_act_max2(y, b, n0, n1, ho, wo, relu, out, argmax):
    """out[n, k, a, e] = max over the 2x2 window of act(y + b), act ReLU where `relu`, else the
    identity; argmax = first max in row-major order (0..3), or -1 where ReLU gives it no
    gradient. y is (K, P) with p = ((n-n0)*ho + i)*wo + j."""
    k_out = y.shape[0]
    hp, wp = ho // 2, wo // 2
    for k in prange(k_out):
        bk = b[k]
        for nl in range(n1 - n0):
            base = nl * ho * wo
            for a in range(hp):
                for e in range(wp):
                    p0 = base + (2 * a) * wo + 2 * e
                    _max2_store(out, argmax, n0 + nl, k, a, e, relu, y[k, p0] + bk, y[k, p0 + 1] + bk,
                                y[k, p0 + wo] + bk, y[k, p0 + wo + 1] + bk)


@_jit
def _unpool(dpooled, argmax, n0, n1, ho, wo, dy):
    """dy (K, P) = the gradient routed back through max-pool and ReLU; zero elsewhere."""
    k_out = dy.shape[0]
    hp, wp = ho // 2, wo // 2
    for k in prange(k_out):
        for p in range(dy.shape[1]):
            dy[k, p] = 0.0
        for nl in range(n1 - n0):
            base = nl * ho * wo
            for a in range(hp):
                for e in range(wp):
                    arg = argmax[n0 + nl, k, a, e]
                    if arg >= 0:
                        p = base + (2 * a + arg // 2) * wo + 2 * e + arg % 2
                        dy[k, p] = dpooled[n0 + nl, k, a, e]


@_jit
def _bias_act_max2_rows(yt, b, n0, n1, ho, wo, relu, out, argmax):
    """As _bias_act_max2, from yt (ho*nb*wo, K) with row (i*nb + n)*wo + j."""
    k_out = yt.shape[1]
    nb = n1 - n0
    hp, wp = ho // 2, wo // 2
    for t in prange(nb * hp):
        nl = t // hp
        a = t % hp
        r0 = ((2 * a) * nb + nl) * wo
        r1 = ((2 * a + 1) * nb + nl) * wo
        for e in range(wp):
            for k in range(k_out):
                bk = b[k]
                _max2_store(out, argmax, n0 + nl, k, a, e, relu, yt[r0 + 2 * e, k] + bk, yt[r0 + 2 * e + 1, k] + bk,
                            yt[r1 + 2 * e, k] + bk, yt[r1 + 2 * e + 1, k] + bk)


@_jit
def _unpool_rows(dpooled, argmax, n0, n1, ho, wo, dyt):
    """As _unpool, into dyt (ho*nb*wo, K) with row (i*nb + n)*wo + j."""
    k_out = dyt.shape[1]
    nb = n1 - n0
    hp, wp = ho // 2, wo // 2
    for r in prange(dyt.shape[0]):
        for k in range(k_out):
            dyt[r, k] = 0.0
    for t in prange(nb * hp):
        nl = t // hp
        a = t % hp
        for e in range(wp):
            for k in range(k_out):
                arg = argmax[n0 + nl, k, a, e]
                if arg >= 0:
                    row = ((2 * a + arg // 2) * nb + nl) * wo + 2 * e + arg % 2
                    dyt[row, k] = dpooled[n0 + nl, k, a, e]


# ---- a block with no pool: bias and activation, on the conv paths' own layouts ----------------------
# Typed 2-D and 3-D arrays whose rows are contiguous, which LLVM vectorizes: _act_pool on the
# strided 4-D views of the same buffers (below) ran ~12x slower on the im2col layout and ~4x on
# the shifted one (vgg-small's first layer at batch 32, 2 threads: 4.2 ms against 0.34, and 4.4
# against 1.1).
# The mask is a byte per conv output where ReLU passes (empty without ReLU).

@_jit
def _bias_act_columns(y, b, n0, relu, out, mask):
    """out[n0+n, k] = act(y[k, n*hw:(n+1)*hw] + b[k]) for y (K, nb*hw); out, mask (N, K, hw)."""
    k_out, hw = y.shape[0], out.shape[2]
    nb = y.shape[1] // hw
    for t in prange(nb * k_out):
        nl = t // k_out
        k = t % k_out
        n = n0 + nl
        bk = b[k]
        base = nl * hw
        if relu:
            for j in range(hw):
                v = y[k, base + j] + bk
                v = v if not v < 0 else np.float32(0.0)
                out[n, k, j] = v
                mask[n, k, j] = 1 if v > 0 else 0
        else:
            for j in range(hw):
                out[n, k, j] = y[k, base + j] + bk


@_jit
def _bias_act_rows(yt, b, n0, nb, ho, wo, relu, out, mask):
    """As _bias_act_columns, from yt (ho*nb*wo, K) with row (i*nb + n)*wo + j: parallel over
    (image, row), each reading one contiguous (wo, K) block."""
    k_out = yt.shape[1]
    for t in prange(nb * ho):
        nl = t // ho
        i = t % ho
        n = n0 + nl
        r0 = (i * nb + nl) * wo
        for k in range(k_out):
            bk = b[k]
            for j in range(wo):
                v = yt[r0 + j, k] + bk
                if relu:
                    v = v if not v < 0 else np.float32(0.0)
                    mask[n, k, i * wo + j] = 1 if v > 0 else 0
                out[n, k, i * wo + j] = v


@_jit
def _act_backward_columns(dout, mask, n0, relu, dy):
    """dy (K, nb*hw) = dout[n0+n, k] where the mask passes (everywhere without ReLU)."""
    k_out, hw = dy.shape[0], dout.shape[2]
    nb = dy.shape[1] // hw
    for t in prange(nb * k_out):
        nl = t // k_out
        k = t % k_out
        n = n0 + nl
        base = nl * hw
        if relu:
            for j in range(hw):
                dy[k, base + j] = dout[n, k, j] if mask[n, k, j] else np.float32(0.0)
        else:
            for j in range(hw):
                dy[k, base + j] = dout[n, k, j]


@_jit
def _act_backward_rows(dout, mask, n0, nb, ho, wo, relu, dyt):
    """As _act_backward_columns, into dyt (ho*nb*wo, K) with row (i*nb + n)*wo + j."""
    k_out = dyt.shape[1]
    for t in prange(nb * ho):
        nl = t // ho
        i = t % ho
        n = n0 + nl
        r0 = (i * nb + nl) * wo
        for j in range(wo):
            for k in range(k_out):
                g = dout[n, k, i * wo + j]
                dyt[r0 + j, k] = g if not relu or mask[n, k, i * wo + j] else np.float32(0.0)


# ---- any activation and pool: kernels on (images, K, ho, wo) planes ------------------------------
# Both conv paths' chunk layouts are seen as strided 4-D views (no copy), so one pair of kernels
# serves both; parallel over (image, kernel) planes, each owned by one thread, so overlapping
# windows add their gradients without races.

def _planes_of_columns(y, nb, ho, wo):
    """(nb, K, ho, wo) view of y (K, P) with p = (n*ho + i)*wo + j: the im2col path's Y."""
    s0, s1 = y.strides
    return as_strided(y, (nb, y.shape[0], ho, wo), (ho * wo * s1, s0, wo * s1, s1))


def _planes_of_rows(yt, nb, ho, wo):
    """(nb, K, ho, wo) view of yt (ho*nb*wo, K) with row (i*nb + n)*wo + j: the shifted path's Y."""
    s0, s1 = yt.strides
    return as_strided(yt, (nb, yt.shape[1], ho, wo), (wo * s0, s1, nb * wo * s0, s0))


@_jit
def _act_pool(y, b, n0, relu, is_max, pkh, pkw, psh, psw, pph, ppw, out, argmax, mask):
    """out[n0+n, k] = pool(act(y[n, k] + b[k])). Max: padding never wins (as -inf), ties go to
    the first maximum in row-major window order, argmax = its index i*wo + j in the conv output,
    or -1 where ReLU gives the window no gradient. Average: the window's sum over pkh*pkw, padding
    counted as zeros. mask (when not empty): 1 where ReLU passes, for the backward."""
    nb, k_out, ho, wo = y.shape
    hp, wp = out.shape[2], out.shape[3]
    area = pkh * pkw
    for t in prange(nb * k_out):
        nl = t // k_out
        k = t % k_out
        n = n0 + nl
        bk = b[k]
        if mask.shape[0] > 0:
            for i in range(ho):
                for j in range(wo):
                    mask[n, k, i, j] = 1 if y[nl, k, i, j] + bk > 0 else 0
        for a in range(hp):
            r0 = a * psh - pph
            for e in range(wp):
                s0 = e * psw - ppw
                best = -np.inf
                arg = -1
                total = 0.0
                for u in range(pkh):
                    r = r0 + u
                    if r < 0 or r >= ho:
                        continue
                    for v in range(pkw):
                        s = s0 + v
                        if s < 0 or s >= wo:
                            continue
                        val = y[nl, k, r, s] + bk
                        if relu and val < 0:
                            val = 0.0
                        total += val
                        if val > best:
                            best = val
                            arg = r * wo + s
                if is_max:
                    out[n, k, a, e] = best
                    argmax[n, k, a, e] = -1 if relu and best <= 0 else arg
                else:
                    out[n, k, a, e] = total / area


@_jit
def _act_pool_backward(dout, n0, relu, is_max, pkh, pkw, psh, psw, pph, ppw, argmax, mask, dy):
    """dy[n, k] (the chunk's planes) = the gradient of _act_pool's output dout[n0+n, k] with
    respect to its input y."""
    nb, k_out, ho, wo = dy.shape
    hp, wp = dout.shape[2], dout.shape[3]
    area = pkh * pkw
    for t in prange(nb * k_out):
        nl = t // k_out
        k = t % k_out
        n = n0 + nl
        for i in range(ho):
            for j in range(wo):
                dy[nl, k, i, j] = 0.0
        for a in range(hp):
            for e in range(wp):
                if is_max:
                    arg = argmax[n, k, a, e]
                    if arg >= 0:
                        dy[nl, k, arg // wo, arg % wo] += dout[n, k, a, e]
                    continue
                g = dout[n, k, a, e] / area
                for r in range(max(0, a * psh - pph), min(ho, a * psh - pph + pkh)):
                    for s in range(max(0, e * psw - ppw), min(wo, e * psw - ppw + pkw)):
                        dy[nl, k, r, s] += g
        if relu and not is_max:
            for i in range(ho):
                for j in range(wo):
                    if mask[n, k, i, j] == 0:
                        dy[nl, k, i, j] = 0.0


# ---- the direct paths' block tails: on the conv output's (N, K, H, W) planes, one parallel pass
# each way; backward sums each plane's gradient for the bias in the same pass
@_jit
def _bias_act_planes(y, b, relu, out, mask):
    """out = act(y + b[k]) over (N, K, P) views; mask 1 where ReLU passes (left alone without it)."""
    for t in prange(y.shape[0] * y.shape[1]):
        n, k = t // y.shape[1], t % y.shape[1]
        bk = b[k]
        for j in range(y.shape[2]):
            v = y[n, k, j] + bk
            if relu:
                passes = v > 0
                mask[n, k, j] = passes
                v = v if passes else np.float32(0.0)
            out[n, k, j] = v


@_jit_sums
def _act_backward_planes(dout, mask, relu, dy, sums):
    """dy = dout where ReLU passed (everywhere without it), over (N, K, P) views; sums[n, k] =
    the plane's sum of dy, in float64."""
    for t in prange(dy.shape[0] * dy.shape[1]):
        n, k = t // dy.shape[1], t % dy.shape[1]
        total = 0.0
        for j in range(dy.shape[2]):
            g = dout[n, k, j] if not relu or mask[n, k, j] else np.float32(0.0)
            dy[n, k, j] = g
            total += g
        sums[n, k] = total


@_jit
def _bias_act_max2_planes(y, b, relu, out, argmax):
    """As _bias_act_max2, on y (N, K, ho, wo)."""
    hp, wp = out.shape[2], out.shape[3]
    for t in prange(y.shape[0] * y.shape[1]):
        n, k = t // y.shape[1], t % y.shape[1]
        bk = b[k]
        for a in range(hp):
            for e in range(wp):
                i, j = 2 * a, 2 * e
                _max2_store(out, argmax, n, k, a, e, relu, y[n, k, i, j] + bk, y[n, k, i, j + 1] + bk,
                            y[n, k, i + 1, j] + bk, y[n, k, i + 1, j + 1] + bk)


@_jit_sums
def _unpool_planes(dpooled, argmax, dy, sums):
    """As _unpool, into dy (N, K, ho, wo); sums[n, k] = the plane's sum of dy, in float64."""
    hp, wp = dpooled.shape[2], dpooled.shape[3]
    for t in prange(dy.shape[0] * dy.shape[1]):
        n, k = t // dy.shape[1], t % dy.shape[1]
        dy[n, k] = 0.0
        total = 0.0
        for a in range(hp):
            for e in range(wp):
                arg = argmax[n, k, a, e]
                if arg >= 0:
                    g = dpooled[n, k, a, e]
                    dy[n, k, 2 * a + arg // 2, 2 * e + arg % 2] = g
                    total += g
        sums[n, k] = total


@_jit_sums
def _plane_totals(a, out):
    """out[n, k] = the sum of a[n, k, :] (a (N, K, P)), in float64."""
    for t in prange(a.shape[0] * a.shape[1]):
        n, k = t // a.shape[1], t % a.shape[1]
        total = 0.0
        for j in range(a.shape[2]):
            total += a[n, k, j]
        out[n, k] = total


def _bias_grad(plane_sums):
    """A bias's gradient from its per-(image, channel) float64 sums: over the images in order."""
    return plane_sums.sum(axis=0).astype(np.float32)


def _channel_totals(a):
    """Per channel of a (N, K, H, W): the float32 sum over images and planes, added in float64
    (a bias's gradient)."""
    n, k = a.shape[:2]
    out = np.empty((n, k))
    _plane_totals(a.reshape(n, k, -1), out)
    return _bias_grad(out)


# ---- the bias's gradient: dY summed per kernel in float64, along (K, P) rows or (rows, K) columns
@_jit
def _add_row_sums(a, out):
    """out[r] += sum of row r of a, accumulated in float64: four running sums over the columns
    in turn (c mod 4), added at the end. One running sum waits an add's latency per element
    (vgg-small's first layer at batch 32: 32 rows of 32768, ~1 ms on 2 threads)."""
    n = a.shape[1]
    full = n - n % 4
    for r in prange(a.shape[0]):
        t0 = t1 = t2 = t3 = 0.0
        for c in range(0, full, 4):
            t0 += a[r, c]
            t1 += a[r, c + 1]
            t2 += a[r, c + 2]
            t3 += a[r, c + 3]
        for c in range(full, n):
            t0 += a[r, c]
        out[r] += (t0 + t1) + (t2 + t3)


# Rows per partial sum of _add_column_sums: a fixed block, not a thread's share, so that its
# result does not depend on the thread count. Parallel over column blocks of 64 alone, a layer
# of up to 64 kernels summed on one thread (vgg-small's first: 32768 rows x 32, ~1 ms).
COLUMN_SUM_ROW_BLOCK = 1024


@_jit
def _add_column_sums(a, out):
    """out[c] += sum of column c of a, accumulated in float64: partial sums over fixed blocks of
    rows in parallel (each row's columns in order, which vectorizes), added in block order."""
    rows, cols = a.shape
    blocks = (rows + COLUMN_SUM_ROW_BLOCK - 1) // COLUMN_SUM_ROW_BLOCK
    parts = np.zeros((blocks, cols), np.float64)
    for i in prange(blocks):
        for r in range(i * COLUMN_SUM_ROW_BLOCK, min(rows, (i + 1) * COLUMN_SUM_ROW_BLOCK)):
            for c in range(cols):
                parts[i, c] += a[r, c]
    for i in range(blocks):
        for c in range(cols):
            out[c] += parts[i, c]


def _is_max2(block):
    """Whether a block runs the 2x2 kernels with an int8 argmax (the paper's block, and the same
    with no activation): a dense conv at stride 1, ReLU or none, a 2x2 stride-2 max-pool without
    padding."""
    return (block.stride == (1, 1) and block.dense and block.pool == "max" and block.pool_kernel == (2, 2)
            and block.pool_stride == (2, 2) and block.pool_padding == (0, 0))


def _flat_planes(a):
    """(N, K, H*W) view of a C-contiguous (N, K, H, W) array, the empty mask included (where a
    -1 in reshape cannot say what it means)."""
    n, k, h, w = a.shape
    return a.reshape(n, k, h * w)


class _PoolGeometry:
    """A block's pool as the kernels take it; no pool is a 1x1 average (the identity)."""

    def __init__(self, is_max, kernel, stride, padding):
        self.is_max = is_max
        self.kernel, self.stride, self.padding = kernel, stride, padding
        self.args = kernel + stride + padding

    @classmethod
    def of(cls, block):
        if block.pool == "none":
            return cls(False, (1, 1), (1, 1), (0, 0))
        return cls(block.pool == "max", block.pool_kernel, block.pool_stride, block.pool_padding)

    def output_hw(self, ho, wo):
        return (window_output_size(ho, self.kernel[0], self.stride[0], self.padding[0]),
                window_output_size(wo, self.kernel[1], self.stride[1], self.padding[1]))


class _BlockContext:
    """What a block's backward needs on every path: the layer input, the forward's weights (their
    shape, and the array itself: a path reuses what its forward kept only for these very weights),
    the block, its conv output size and pool, the argmax (max-pool) or ReLU mask (other pools) and
    the block's output shape. Each path's context adds what that path kept."""

    def __init__(self, x, w, block, conv_hw, pool, argmax, mask, pooled_shape):
        self.x = x
        self.w_shape = w.shape
        self.forward_weights = w
        self.block = block
        self.conv_hw = conv_hw
        self.pool = pool
        self.argmax = argmax
        self.mask = mask
        self.pooled_shape = pooled_shape
