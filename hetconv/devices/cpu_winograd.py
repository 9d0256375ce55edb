"""The CPU device's Winograd convolutions: a dense 3x3 conv at stride 1 (any padding up to 2) as
F(4x4, 3x3) (Lavin and Gray 2016), its 36 products per 4x4 output tile batched into 36 GEMMs, in
float32, called as devices/dnnl_conv.py's DirectConvs are (a block's tail adds the bias, applies
the activation and the pool, and sums dB).

Why: oneDNN's direct convolutions already run one core at its FMA peak (resnet18's 3x3 layers
about 105 GFLOP/s on a Zen 4 core), so a faster 3x3 layer has to do fewer multiplications. A 4x4
output tile costs 36 products per (kernel, channel) pair here against 144 directly. Forward and
backward with dX at batch 16 on one core, against oneDNN's direct convolution (bench/winograd.py):
resnet18's 64-, 128- and 256-channel layers 1.8x, 2.1x and 1.9x faster on a Zen 3 core (AVX2); on
a Zen 4 core (AVX-512) 1.25x, 1.17x and 1.10x with the tile kernels of one plane a task (below),
where the GEMMs took 15, 12 and 13 ms of 30, 28 and 29. The rest is the transforms, memory-bound
passes over x, Y, dY and dX and the 2.25x larger V, M, Z and dV.

The three directions are one linear map and its two transposes, in the transformed domain:
  forward   M[f] (K, T) = U[f] (K, C) @ V[f] (C, T),  U = G w G^T, V = B^T x_tile B;
            y_tile = A^T M A  (T: the 4x4 output tiles of the batch, f: the 36 frequencies)
  dX        dV[f] (C, T) = U[f]^T @ Z[f],   Z = A dy_tile A^T;  dx += B dV B^T per tile (tiles
            overlap by 2: one (image, channel) plane is one task, its tiles added in order)
  dW        dU[f] (K, C) = Z[f] @ V[f]^T,   dw = G^T dU G
so backward is the exact gradient of what forward computes. Against a direct convolution the sums
differ in rounding: the interpolation points 0, +-1, +-2 and infinity grow float32's error about
10x over a direct sum's (0.8-1.4e-5 of the largest value on resnet18's layers against a float64
reference, where a direct sum's is ~1e-6; the tests bound it), as cuDNN's and NNPACK's F(4x4, 3x3).

What it costs beyond the GEMMs: V, (C, T) per frequency, is 2.25x the input (36 values per 16
outputs), kept from forward for dW within the saved-cols budget and recomputed otherwise; M, Z and
dV are as big for K and C; the batch is cut into chunks of images so that a chunk's V, M and Z stay
under the device's im2col budget. Every sum has an order fixed by the shapes and the chunking (a
GEMM's own blocking aside): a share of the kernels computes its rows of M as the whole layer does.

Threads: the transforms are Numba loops over the device's threads; on two or more threads the 36
GEMMs of a pass run in one parallel region, each on one thread (devices/dnnl.py's sgemm_each),
not as 36 regions of two-thread GEMMs, each waking the other thread from its sleep. On 2 Zen 3
cores that took vgg-small's 64-channel 16x16 layer at batch 32 (forward and backward) from ~22 ms,
more than its ~16 ms on one thread, to ~11 ms.
"""
import numpy as np
from numba import prange

from hetconv.jit import cached_njit

_jit = cached_njit(parallel=True, nogil=True)
_inline = cached_njit(inline="always", nogil=True)

TILE = 4                    # output tile side: F(4x4, 3x3)
ALPHA = TILE + 2            # input tile side
FREQUENCIES = ALPHA * ALPHA
MAX_PADDING = 2             # a tile reads at most 2 rows and columns beyond the output's


# The four tile transforms, each applied elementwise along lines of a plane's tiles (one tile an
# element, SIMD across them); every tile kernel runs one of them down the columns and then along
# the rows of its tiles. Constants are float32 so that the lines stay float32.
_F2, _F4, _F5, _F8 = np.float32(2.0), np.float32(4.0), np.float32(5.0), np.float32(8.0)


@_inline
def _bt_lines(d0, d1, d2, d3, d4, d5, o0, o1, o2, o3, o4, o5):
    """o = B^T d: the input transform, 6 lines into 6."""
    for e in range(o0.shape[0]):
        o0[e] = _F4 * d0[e] - _F5 * d2[e] + d4[e]
        o1[e] = d3[e] + d4[e] - _F4 * (d1[e] + d2[e])
        o2[e] = _F4 * (d1[e] - d2[e]) + d4[e] - d3[e]
        o3[e] = _F2 * (d3[e] - d1[e]) + d4[e] - d2[e]
        o4[e] = _F2 * (d1[e] - d3[e]) + d4[e] - d2[e]
        o5[e] = _F4 * d1[e] - _F5 * d3[e] + d5[e]


@_inline
def _b_lines(v0, v1, v2, v3, v4, v5, o0, o1, o2, o3, o4, o5):
    """o = B v: the transpose of _bt_lines (dX's transform), 6 lines into 6."""
    for e in range(o0.shape[0]):
        o0[e] = _F4 * v0[e]
        o1[e] = _F4 * (v2[e] - v1[e] + v5[e]) + _F2 * (v4[e] - v3[e])
        o2[e] = -_F5 * v0[e] - _F4 * (v1[e] + v2[e]) - v3[e] - v4[e]
        o3[e] = v1[e] - v2[e] + _F2 * (v3[e] - v4[e]) - _F5 * v5[e]
        o4[e] = v0[e] + v1[e] + v2[e] + v3[e] + v4[e]
        o5[e] = v5[e]


@_inline
def _at_lines(m0, m1, m2, m3, m4, m5, o0, o1, o2, o3):
    """o = A^T m: the output transform, 6 lines into 4."""
    for e in range(o0.shape[0]):
        a, b = m1[e] + m2[e], m1[e] - m2[e]
        c, d = m3[e] + m4[e], m3[e] - m4[e]
        o0[e] = m0[e] + a + c
        o1[e] = b + _F2 * d
        o2[e] = a + _F4 * c
        o3[e] = b + _F8 * d + m5[e]


@_inline
def _a_lines(g0, g1, g2, g3, o0, o1, o2, o3, o4, o5):
    """o = A g: the transpose of _at_lines (dY's transform), 4 lines into 6."""
    for e in range(o0.shape[0]):
        even, odd = g0[e] + g2[e], g1[e] + g3[e]
        even4, odd2 = g0[e] + _F4 * g2[e], _F2 * g1[e] + _F8 * g3[e]
        o0[e] = g0[e]
        o1[e] = even + odd
        o2[e] = even - odd
        o3[e] = even4 + odd2
        o4[e] = even4 - odd2
        o5[e] = g3[e]


@_inline
def _six_runs(a, start, step, nt):
    """Six runs of `nt` values of flat `a`, `step` apart from `start`: one plane's tiles of six
    frequencies in a frequency-major buffer."""
    return (a[start:start + nt], a[start + step:start + step + nt], a[start + 2 * step:start + 2 * step + nt],
            a[start + 3 * step:start + 3 * step + nt], a[start + 4 * step:start + 4 * step + nt],
            a[start + 5 * step:start + 5 * step + nt])


_SIXTH, _TWELFTH, _TWENTYFOURTH = 1.0 / 6.0, 1.0 / 12.0, 1.0 / 24.0


@_inline
def _g(g0, g1, g2):
    """G g: the weights' transform of one line of 3 into 6."""
    even, odd = (g0 + g2) * _SIXTH, g1 * _SIXTH
    quarter = g0 * _TWENTYFOURTH + g2 * _SIXTH
    return 0.25 * g0, -even - odd, odd - even, quarter + 0.5 * odd, quarter - 0.5 * odd, g2


@_inline
def _gt(u0, u1, u2, u3, u4, u5):
    """G^T u: the transpose of _g (dW's transform), 6 into 3."""
    low, high = (u1 + u2) * _SIXTH, u3 + u4
    return (0.25 * u0 - low + high * _TWENTYFOURTH,
            (u2 - u1) * _SIXTH + (u3 - u4) * _TWELFTH,
            high * _SIXTH - low + u5)


@_jit
def _weights_forward(w, u, fs, ld):
    """u (36, K, C) = G w[k, c] G^T for every pair, in float64 then rounded."""
    kk, cc = w.shape[0], w.shape[1]
    for k in prange(kk):
        t = np.empty((ALPHA, 3))
        for c in range(cc):
            for s in range(3):
                col = _g(np.float64(w[k, c, 0, s]), np.float64(w[k, c, 1, s]), np.float64(w[k, c, 2, s]))
                t[0, s] = col[0]
                t[1, s] = col[1]
                t[2, s] = col[2]
                t[3, s] = col[3]
                t[4, s] = col[4]
                t[5, s] = col[5]
            for r in range(ALPHA):
                row = _g(t[r, 0], t[r, 1], t[r, 2])
                at = r * ALPHA * fs + k * ld + c     # frequency (r, 0)'s (k, c); (r, s) is s * fs on
                u[at] = row[0]
                u[at + fs] = row[1]
                u[at + 2 * fs] = row[2]
                u[at + 3 * fs] = row[3]
                u[at + 4 * fs] = row[4]
                u[at + 5 * fs] = row[5]


@_jit
def _weights_backward(du, fs, ld, dw):
    """dw (K, C, 3, 3) = G^T du[:, k, c] G for every pair, in float64 then rounded; du flat,
    frequency f's (K, C) matrix at f * fs with rows ld apart (as every frequency-major buffer here)."""
    kk, cc = dw.shape[0], dw.shape[1]
    for k in prange(kk):
        t = np.empty((ALPHA, 3))
        for c in range(cc):
            for r in range(ALPHA):
                at = r * ALPHA * fs + k * ld + c
                row = _gt(np.float64(du[at]), np.float64(du[at + fs]), np.float64(du[at + 2 * fs]),
                          np.float64(du[at + 3 * fs]), np.float64(du[at + 4 * fs]), np.float64(du[at + 5 * fs]))
                t[r, 0] = row[0]
                t[r, 1] = row[1]
                t[r, 2] = row[2]
            for s in range(3):
                col = _gt(t[0, s], t[1, s], t[2, s], t[3, s], t[4, s], t[5, s])
                dw[k, c, 0, s] = col[0]
                dw[k, c, 1, s] = col[1]
                dw[k, c, 2, s] = col[2]


# The tile kernels run over tasks of (channel, run of consecutive images): a channel's tiles of
# consecutive images lie side by side in V, M, Z and dV, so a task's lines run over all its
# images' tiles (about LINE_TILES) and each of the 36 frequency streams is written front to back.
# Each pass is one of the *_lines transforms over a task's lines at once, in float32: long
# contiguous loops SIMD takes whole. Rows move between the tensors and the work buffers by slice
# assignment (a copy Numba vectorises), and tiles are gathered and scattered a tile row at a time,
# the six (or four) values of a column each. Against tasks of one (image, channel) plane, which
# gave resnet18's 8x8 and 4x4 layers lines of 4 and 1 tiles and wrote the streams 4 KB apart from
# task to task, measured on one Zen 3 core at batch 16: the input transform 3.7 -> 2.5 ms (64
# channels, 32x32), 4.2 -> 1.4 (128, 16x16), 2.6 -> 0.95 (256, 8x8); the whole forward and
# backward 1.12x, 1.34x and 1.12x faster. Lines of 256 tiles beat 64 and 128 by 5-20% though a
# task's work buffers then outgrow L1.
LINE_TILES = 256


def _images_per_task(tiles_per_image, images):
    """Images a tile kernel's task takes: its lines about LINE_TILES tiles long."""
    return max(1, min(images, -(-LINE_TILES // tiles_per_image)))


@_inline
def _runs(n0, n1, per_task):
    """Runs of `per_task` consecutive images in n0..n1, the last one shorter where they do not divide."""
    return (n1 - n0 + per_task - 1) // per_task


@_inline
def _task(task, runs, n0, n1, per_task, nt, ld):
    """A tile kernel's task `task` of `runs` per plane: (its channel or kernel, its first image, one
    past its last, its tiles, where its lines start in a frequency's matrix)."""
    plane, na = task // runs, n0 + (task % runs) * per_task
    nb = min(n1, na + per_task)
    return plane, na, nb, (nb - na) * nt, plane * ld + (na - n0) * nt


@_jit
def _input_tiles(x, n0, n1, ph, pw, th, tw, per_task, v, fs, ld):
    """v (36, C, T) = B^T d B for each 6x6 input tile d of images n0..n1 (zero outside the
    input), tile t = ((n - n0) * th + i) * tw + j; `per_task` images a task."""
    cc, h, wd = x.shape[1], x.shape[2], x.shape[3]
    nt = th * tw
    runs = _runs(n0, n1, per_task)
    for task in prange(cc * runs):
        c, na, nb, ln, base = _task(task, runs, n0, n1, per_task, nt, ld)
        xp = np.zeros((th * TILE + 2, tw * TILE + 2), np.float32)   # border and beyond stay 0
        d = np.empty((ALPHA, ALPHA, ln), np.float32)
        t = np.empty((ALPHA, ALPHA, ln), np.float32)
        for n in range(na, nb):
            for r in range(h):
                xp[r + ph, pw:pw + wd] = x[n, c, r]
            for i in range(th):                      # each tile's (a, b) value, side by side
                at = (n - na) * nt + i * tw
                for a in range(ALPHA):
                    row = xp[i * TILE + a]
                    for j in range(tw):
                        d[a, 0, at + j] = row[TILE * j]
                        d[a, 1, at + j] = row[TILE * j + 1]
                        d[a, 2, at + j] = row[TILE * j + 2]
                        d[a, 3, at + j] = row[TILE * j + 3]
                        d[a, 4, at + j] = row[TILE * j + 4]
                        d[a, 5, at + j] = row[TILE * j + 5]
        for b in range(ALPHA):                       # B^T down each column of the tiles
            _bt_lines(d[0, b], d[1, b], d[2, b], d[3, b], d[4, b], d[5, b],
                      t[0, b], t[1, b], t[2, b], t[3, b], t[4, b], t[5, b])
        for r in range(ALPHA):                       # ... then along each row, into V
            v0, v1, v2, v3, v4, v5 = _six_runs(v, r * ALPHA * fs + base, fs, ln)
            _bt_lines(t[r, 0], t[r, 1], t[r, 2], t[r, 3], t[r, 4], t[r, 5], v0, v1, v2, v3, v4, v5)


@_jit
def _output_tiles(m, fs, ld, n0, n1, th, tw, per_task, y):
    """y[n0..n1] = A^T M A per tile, cut at the output's edge."""
    kk, ho, wo = y.shape[1], y.shape[2], y.shape[3]
    nt = th * tw
    runs = _runs(n0, n1, per_task)
    for task in prange(kk * runs):
        k, na, nb, ln, base = _task(task, runs, n0, n1, per_task, nt, ld)
        t = np.empty((TILE, ALPHA, ln), np.float32)
        o = np.empty((TILE, TILE, ln), np.float32)
        line = np.empty(TILE * tw, np.float32)
        for s in range(ALPHA):                       # A^T down each column of the frequencies
            m0, m1, m2, m3, m4, m5 = _six_runs(m, s * fs + base, ALPHA * fs, ln)
            _at_lines(m0, m1, m2, m3, m4, m5, t[0, s], t[1, s], t[2, s], t[3, s])
        for r in range(TILE):                        # ... then along each row
            _at_lines(t[r, 0], t[r, 1], t[r, 2], t[r, 3], t[r, 4], t[r, 5], o[r, 0], o[r, 1], o[r, 2], o[r, 3])
        for n in range(na, nb):
            for yr in range(ho):
                i, r = yr // TILE, yr % TILE
                at = (n - na) * nt + i * tw
                for j in range(tw):
                    line[TILE * j] = o[r, 0, at + j]
                    line[TILE * j + 1] = o[r, 1, at + j]
                    line[TILE * j + 2] = o[r, 2, at + j]
                    line[TILE * j + 3] = o[r, 3, at + j]
                y[n, k, yr] = line[:wo]


@_jit
def _grad_tiles(dy, n0, n1, th, tw, per_task, z, fs, ld):
    """z (36, K, T) = A g A^T for each 4x4 tile g of dY (zero beyond its edge)."""
    kk, ho, wo = dy.shape[1], dy.shape[2], dy.shape[3]
    nt = th * tw
    runs = _runs(n0, n1, per_task)
    for task in prange(kk * runs):
        k, na, nb, ln, base = _task(task, runs, n0, n1, per_task, nt, ld)
        g = np.zeros((TILE, TILE, ln), np.float32)   # rows beyond the output's edge stay 0
        t = np.empty((ALPHA, TILE, ln), np.float32)
        line = np.zeros(TILE * tw, np.float32)       # ... and columns
        for n in range(na, nb):
            for yr in range(ho):                     # each tile's (r, q) value, side by side
                i, r = yr // TILE, yr % TILE
                at = (n - na) * nt + i * tw
                line[:wo] = dy[n, k, yr]
                for j in range(tw):
                    g[r, 0, at + j] = line[TILE * j]
                    g[r, 1, at + j] = line[TILE * j + 1]
                    g[r, 2, at + j] = line[TILE * j + 2]
                    g[r, 3, at + j] = line[TILE * j + 3]
        for q in range(TILE):                        # A down each column
            _a_lines(g[0, q], g[1, q], g[2, q], g[3, q], t[0, q], t[1, q], t[2, q], t[3, q], t[4, q], t[5, q])
        for r in range(ALPHA):                       # ... then along each row, into Z
            z0, z1, z2, z3, z4, z5 = _six_runs(z, r * ALPHA * fs + base, fs, ln)
            _a_lines(t[r, 0], t[r, 1], t[r, 2], t[r, 3], z0, z1, z2, z3, z4, z5)


@_jit
def _input_grad_tiles(dv, fs, ld, n0, n1, ph, pw, th, tw, per_task, dx):
    """dx[n0..n1] = the sum over tiles of B dV B^T, each added where its tile read the input."""
    cc, h, wd = dx.shape[1], dx.shape[2], dx.shape[3]
    nt = th * tw
    runs = _runs(n0, n1, per_task)
    for task in prange(cc * runs):
        c, na, nb, ln, base = _task(task, runs, n0, n1, per_task, nt, ld)
        t = np.empty((ALPHA, ALPHA, ln), np.float32)
        o = np.empty((ALPHA, ALPHA, ln), np.float32)
        acc = np.empty((th * TILE + 2, tw * TILE + 2), np.float32)
        for s in range(ALPHA):                       # B down each column of the frequencies
            v0, v1, v2, v3, v4, v5 = _six_runs(dv, s * fs + base, ALPHA * fs, ln)
            _b_lines(v0, v1, v2, v3, v4, v5, t[0, s], t[1, s], t[2, s], t[3, s], t[4, s], t[5, s])
        for r in range(ALPHA):                       # ... then along each row
            _b_lines(t[r, 0], t[r, 1], t[r, 2], t[r, 3], t[r, 4], t[r, 5],
                     o[r, 0], o[r, 1], o[r, 2], o[r, 3], o[r, 4], o[r, 5])
        for n in range(na, nb):
            acc[:] = 0.0                             # tiles overlap by 2: added in tile order
            for i in range(th):
                at = (n - na) * nt + i * tw
                for r in range(ALPHA):
                    # a tile's columns 4 and 5 are the next tile's 0 and 1, added before them,
                    # so that no iteration reads what the one before it wrote (in the order of
                    # one add a column after another: the same sums)
                    row, add0, add1, add2, add3 = acc[i * TILE + r], o[r, 0], o[r, 1], o[r, 2], o[r, 3]
                    add4, add5 = o[r, 4], o[r, 5]
                    row[0] += add0[at]
                    row[1] += add1[at]
                    row[2] += add2[at]
                    row[3] += add3[at]
                    for j in range(1, tw):
                        row[TILE * j] = (row[TILE * j] + add4[at + j - 1]) + add0[at + j]
                        row[TILE * j + 1] = (row[TILE * j + 1] + add5[at + j - 1]) + add1[at + j]
                        row[TILE * j + 2] += add2[at + j]
                        row[TILE * j + 3] += add3[at + j]
                    # the last tile's columns 4 and 5 through acc itself: Numba 0.68's parallel
                    # lowering lost these adds when written through `row` (column 4 tw of dX
                    # wrong on every shape, right with parallel=False)
                    acc[i * TILE + r, TILE * tw] += add4[at + tw - 1]
                    acc[i * TILE + r, TILE * tw + 1] += add5[at + tw - 1]
            for r in range(h):
                dx[n, c, r] = acc[r + ph, pw:pw + wd]


def frequency_stride(rows, cols):
    """Floats from one frequency's (rows, cols) matrix to the next's in a work buffer: the matrix
    rounded up so that the 36 start 64 bytes apart modulo 4 KB. Packed (a multiple of 4 KB apart
    for most layers), the 36 streams a tile kernel writes side by side fell into the same L1 sets:
    the weights' transform of a 256x256 layer took 8.3 ms where it takes 0.8."""
    size = rows * cols
    return -(-(size - 16) // 1024) * 1024 + 16 if size > 16 else 16


class FrequencyPlanes:
    """36 (rows, cols) float32 matrices in one flat buffer, frequency_stride apart: `f[i]` is
    frequency i's matrix (a view the GEMMs take), `flat`, `fs` and `ld` what the kernels index."""

    def __init__(self, flat, rows, cols):
        self.fs, self.ld = frequency_stride(rows, cols), cols
        if flat.size < FREQUENCIES * self.fs:
            raise ValueError(f"a buffer of {flat.size} floats cannot hold 36 frequencies of {rows}x{cols}")
        self.flat = flat[:FREQUENCIES * self.fs]
        self.f = np.lib.stride_tricks.as_strided(self.flat, (FREQUENCIES, rows, cols), (self.fs * 4, cols * 4, 4))

    @property
    def args(self):
        return self.flat, self.fs, self.ld


def tiles(x_shape, padding):
    """(output height, width, tile rows, tile columns) of a 3x3 stride-1 conv."""
    ho, wo = x_shape[2] + 2 * padding[0] - 2, x_shape[3] + 2 * padding[1] - 2
    return ho, wo, -(-ho // TILE), -(-wo // TILE)


class WinogradConvs:
    """A CPU device's F(4x4, 3x3) convolutions. `gemm_each(a, b, c, beta)`: c[f] = a[f] @ b[f] +
    beta * c[f] for each frequency f of 3-D float32 views (the device's: in one parallel region
    where it can, devices/dnnl.py's sgemm_each); `scratch(name, shape)`: the device's kept float32
    work buffers; a chunk's V, M and Z within `budget_bytes`."""

    path = "winograd"

    def __init__(self, gemm_each, scratch, budget_bytes):
        self._gemm_each, self._scratch, self.budget_bytes = gemm_each, scratch, int(budget_bytes)

    @staticmethod
    def declines(x_shape, w_shape, stride, padding, dilation=(1, 1), groups=1):
        """'' where this path takes the conv (3x3, stride 1, no dilation, one group, padding at
        most 2, an output at least one pixel), else why not."""
        if tuple(w_shape[2:]) != (3, 3) or tuple(stride) != (1, 1) or tuple(dilation) != (1, 1) or groups != 1:
            return (f"Winograd F(4x4, 3x3) takes dense 3x3 convs at stride 1, got {w_shape[2]}x{w_shape[3]} "
                    f"kernels, stride {tuple(stride)}, dilation {tuple(dilation)}, {groups} groups")
        if max(padding) > MAX_PADDING or min(padding) < 0:
            return f"Winograd F(4x4, 3x3) takes padding 0 to {MAX_PADDING}, got {tuple(padding)}"
        ho, wo, _, _ = tiles(x_shape, padding)
        if ho < 1 or wo < 1:
            return f"no output: input {tuple(x_shape[2:])} with padding {tuple(padding)}"
        return ""

    def _images_per_chunk(self, x_shape, w_shape, padding):
        """Images a chunk takes: its V, M (or Z) and dV within the budget, at least one."""
        _, _, th, tw = tiles(x_shape, padding)
        per_image = FREQUENCIES * th * tw * (2 * x_shape[1] + w_shape[0]) * 4
        return max(1, min(x_shape[0], self.budget_bytes // per_image))

    def src_nbytes(self, x_shape, w_shape, stride, padding, dilation=(1, 1), groups=1):
        """The bytes of V for the whole batch: what forward can keep for dW."""
        return sum(FREQUENCIES * frequency_stride(x_shape[1], count) * 4
                   for count in self._chunk_tiles(x_shape, w_shape, padding))

    def _chunk_tiles(self, x_shape, w_shape, padding):
        _, _, th, tw = tiles(x_shape, padding)
        return [(n1 - n0) * th * tw for n0, n1 in self._chunks(x_shape, w_shape, padding)]

    def _chunks(self, x_shape, w_shape, padding):
        step = self._images_per_chunk(x_shape, w_shape, padding)
        return [(n0, min(n0 + step, x_shape[0])) for n0 in range(0, x_shape[0], step)]

    def _saved_v(self, saved_src, x_shape, w_shape, padding, n0):
        """The chunk's V inside the kept buffer: chunk after chunk, each (36, C, its tiles)."""
        start = 0
        for (c0, _), count in zip(self._chunks(x_shape, w_shape, padding), self._chunk_tiles(x_shape, w_shape, padding)):
            if c0 == n0:
                return FrequencyPlanes(saved_src.view(np.float32)[start:], x_shape[1], count)
            start += FREQUENCIES * frequency_stride(x_shape[1], count)
        raise ValueError(f"no chunk starts at image {n0}")

    def _planes(self, name, rows, cols):
        return FrequencyPlanes(self._scratch(name, (FREQUENCIES * frequency_stride(rows, cols),)), rows, cols)

    def _v(self, x, w_shape, n0, n1, padding, th, tw, saved_src):
        count = (n1 - n0) * th * tw
        v = (self._planes("winograd_v", x.shape[1], count) if saved_src is None
             else self._saved_v(saved_src, x.shape, w_shape, padding, n0))
        _input_tiles(x, n0, n1, padding[0], padding[1], th, tw, _images_per_task(th * tw, n1 - n0), *v.args)
        return v

    def _u(self, w):
        u = self._planes("winograd_u", w.shape[0], w.shape[1])
        _weights_forward(w, *u.args)
        return u

    def forward(self, x, w, stride, padding, y, saved_src=None, dilation=(1, 1), groups=1):
        """y (N, K, Ho, Wo), float32 C-contiguous = conv(x, w), no bias. With `saved_src` (a uint8
        buffer of src_nbytes()) V is left there for backward."""
        x, w = np.ascontiguousarray(x, np.float32), np.ascontiguousarray(w, np.float32)
        _, _, th, tw = tiles(x.shape, padding)
        k = w.shape[0]
        u = self._u(w)
        for n0, n1 in self._chunks(x.shape, w.shape, padding):
            v = self._v(x, w.shape, n0, n1, padding, th, tw, saved_src)
            m = self._planes("winograd_m", k, v.ld)
            self._gemm_each(u.f, v.f, m.f, 0.0)
            _output_tiles(*m.args, n0, n1, th, tw, _images_per_task(th * tw, n1 - n0), y)
        return y

    def backward(self, x, w, dy, stride, padding, need_dx, dw, saved_src=None, dilation=(1, 1), groups=1,
                 on_dx=None):
        """dx (N, C, H, W) or None where not asked; dW into dw (K, C, 3, 3) float32
        C-contiguous. The bias's gradient is the caller's. dX's GEMMs run first, chunk by chunk,
        and dx goes to on_dx (where given) before dW's run."""
        x, w = np.ascontiguousarray(x, np.float32), np.ascontiguousarray(w, np.float32)
        dy = np.ascontiguousarray(dy, np.float32)
        _, _, th, tw = tiles(x.shape, padding)
        k, c = w.shape[0], w.shape[1]
        chunks = self._chunks(x.shape, w.shape, padding)
        z = None
        dx = None
        if need_dx:
            u = self._u(w)
            dx = np.empty(x.shape, np.float32)
            for n0, n1 in chunks:
                z = self._z(dy, n0, n1, th, tw)
                dv = self._planes("winograd_dv", c, z.ld)
                self._gemm_each(u.f.transpose(0, 2, 1), z.f, dv.f, 0.0)
                _input_grad_tiles(*dv.args, n0, n1, padding[0], padding[1], th, tw, _images_per_task(th * tw, n1 - n0),
                                  dx)
            if on_dx is not None:
                on_dx(dx)
        du = self._planes("winograd_du", k, c)
        for i, (n0, n1) in enumerate(chunks):
            if z is None or len(chunks) > 1:
                z = self._z(dy, n0, n1, th, tw)
            v = (self._saved_v(saved_src, x.shape, w.shape, padding, n0) if saved_src is not None
                 else self._v(x, w.shape, n0, n1, padding, th, tw, None))
            self._gemm_each(z.f, v.f.transpose(0, 2, 1), du.f, 0.0 if i == 0 else 1.0)
        _weights_backward(*du.args, dw)
        return dx

    def _z(self, dy, n0, n1, th, tw):
        z = self._planes("winograd_z", dy.shape[1], (n1 - n0) * th * tw)
        _grad_tiles(dy, n0, n1, th, tw, _images_per_task(th * tw, n1 - n0), *z.args)
        return z
