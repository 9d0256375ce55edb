"""The CPU device's FFT path: stride-1 convolutions as products of spectra, the transforms and the
products all GEMMs in OpenBLAS.

Why: per (input, output) channel pair, a direct conv2d costs kh*kw*Ho*Wo multiply-adds; in the
frequency domain it costs one complex multiply-add per frequency kept. The paper's conv2 (14x14
input, 5x5 kernels, 10x10 output): 25*100 = 2500 real multiply-adds against 100 complex ones, each
three real GEMM terms (below), so ~8x fewer multiplications in the products, whose share of the
work is then what the transforms and the kernel spectra cost.

How:
- Transform size P x Q with P = max(H + ph, kh, Ho), Q likewise: the input sits at offset (ph, pw)
  of a circular P x Q plane whose other rows and columns are the zero padding, so what wraps
  around lands on zeros (forward, dW) or on padding that is cropped away (dX). The spectrum of a
  real plane is Hermitian, so only one frequency of each conjugate pair is kept (F = 100 of 196 for
  14x14), and the inverse counts the others twice.
- Every transform is GEMMs against DFT matrices built here, with the padding offset, the crop
  and the scale folded in: dY's spectra (planes*F, N*K) = M (planes*F, Ho*Wo) @ dY^T, and the way
  back y (N*K, Ho*Wo) = spectra^T @ G. The two paid whatever a worker's share of the kernels, the
  input's and dX's inverse, are separable: the input's along the rows first (one GEMM per input
  row), then along the columns, one GEMM per column frequency; dX's inverse in the reverse order.
  Each frequency's spectra are contiguous (N, C) and (K, C) matrices, so its product is a plain
  GEMM.
- Complex products by Gauss's three-multiplication form: with T1 shared by the real and the
  imaginary part, one GEMM fewer than four. The transform matrices produce the sums and signs the
  form needs as extra planes (x: re, im, re+im, -(re+im); dY: re, im, re+im, re-im), so every
  term is a GEMM with beta 1 into the output and none needs alpha = -1.
- The kernel spectra (3 planes x F x K x C: re, im-re, -(re+im), which serve forward's conj(W)
  and dX's W alike) are the cost to design around: 3*F/(kh*kw) = 12x the weights' bytes (900 MB
  for the whole conv2, 225 MB for a quarter share), and they change with every update. They are
  cached per weight array, with a copy of the weights they came from: a call whose weights are
  bitwise the copy reuses them (one pass over the weights, ~10 ms for the whole conv2), any
  other recomputes them into the same buffer. So a step (forwards, backwards, then sgd_ in place)
  computes them once, and a caller who changes weights in place is never served stale spectra.
- Frequencies are processed in blocks, so the batch-side spectra and dW's (2 x F x K x C) stay
  under a work budget; the inverse transforms add each block's part in with sgemm beta = 1.
- Threads: every GEMM here runs with ONE BLAS thread, and the device's threads split the work
  themselves (a Python pool; sgemm releases the GIL): each frequency's product by rows of its
  output (kernels, or channels for dX), each transform by its output's longer side. OpenBLAS's own
  threading of these thin GEMMs ((1500, 500) @ (500, 32) per frequency, ~1300 of them per conv2
  step) made two threads slower than one: 1.07 s against 0.53 s for conv2's forward at N=32, on a
  quiet 2-core machine, each call paying a wake-up and a join of the BLAS threads.
- What is returned is freshly allocated; work buffers come from the device's scratch pool.
"""
import contextlib
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numba import prange

from hetconv.jit import cached_njit

KERNEL_PLANES = 3       # re, im - re, -(re + im)
INPUT_PLANES = 4        # re, im, re + im, -(re + im)
GRAD_PLANES = 4         # dY's re, im, re + im, re - im

_jit = cached_njit(parallel=True, nogil=True)


@_jit
def _same_bits(a, b):
    """Whether two int32 views of equal size hold the same bits (float compare would call -0.0
    and 0.0 equal and NaN unequal to itself)."""
    size = a.size
    blocks = 64
    step = (size + blocks - 1) // blocks
    differs = np.zeros(blocks, np.uint8)
    for t in prange(blocks):
        for i in range(t * step, min(size, (t + 1) * step)):
            if a[i] != b[i]:
                differs[t] = 1
                break
    return differs.sum() == 0


@_jit
def swap_leading(a, out):
    """out[j, i, :] = a[i, j, :] for 3-D arrays: (K, N, plane) to (N, K, plane) and back."""
    for t in prange(a.shape[0] * a.shape[1]):
        i = t // a.shape[1]
        j = t % a.shape[1]
        for m in range(a.shape[2]):
            out[j, i, m] = a[i, j, m]


def transform_size(h, kh, pad, ho):
    """One axis of the circular transform: the input plus the padding before it (what would wrap
    around is zero), and never less than the kernel or the output."""
    return max(h + pad, kh, ho)


def kept_frequencies(p_size, q_size):
    """(p, q, weight) of one frequency per conjugate pair of a real P x Q plane's spectrum:
    weight 1 where the frequency is its own conjugate, 2 where it stands for its pair too."""
    kept = []
    for q in range(q_size // 2 + 1):
        self_q = (2 * q) % q_size == 0
        for p in range(p_size // 2 + 1 if self_q else p_size):
            weight = 1 if self_q and (2 * p) % p_size == 0 else 2
            kept.append((p, q, weight))
    return np.array(kept, np.int64)


class FftGeometry:
    """The transform of one layer shape (C, H, W, K, kh, kw, padding): sizes, frequencies and the
    DFT matrices, in float64 until cast once to float32."""

    def __init__(self, h, w, kh, kw, padding):
        ph, pw = padding
        self.h, self.w, self.kh, self.kw, self.padding = h, w, kh, kw, padding
        self.ho, self.wo = h + 2 * ph - kh + 1, w + 2 * pw - kw + 1
        self.p = transform_size(h, kh, ph, self.ho)
        self.q = transform_size(w, kw, pw, self.wo)
        freqs = kept_frequencies(self.p, self.q)
        self.f = len(freqs)
        self._p, self._q, self._weight = (freqs[:, i].astype(np.float64) for i in range(3))
        w_cos, w_sin = self._angles(kh, kw, 0, 0)
        y_cos, y_sin = self._angles(self.ho, self.wo, 0, 0)
        # the input's transform, separable: along each row first (one (2*qk, W) matrix: re, im of
        # each distinct column frequency q), then along the columns per q, every frequency's
        # INPUT_PLANES rows together (F, planes, 2H) over (re, im) x rows of the first stage.
        # ~25x fewer FLOPs than one GEMM over all H*W positions (conv2: ~0.1 + 0.4 GFLOP
        # against 2.5 at N=32), which cost ~40 ms of a step at one thread whatever the share.
        self.qk = self.q // 2 + 1
        q_angle = 2 * np.pi * np.arange(self.qk)[:, None] * (np.arange(w) + pw)[None, :] / self.q
        self.row_transform = np.stack([np.cos(q_angle), -np.sin(q_angle)], axis=1).reshape(2 * self.qk, w)
        self.row_transform = self.row_transform.astype(np.float32)
        p_angle = 2 * np.pi * self._p[:, None] * (np.arange(h) + ph)[None, :] / self.p       # (F, H)
        cos_p, sin_p = np.cos(p_angle), np.sin(p_angle)
        re, im = np.concatenate([cos_p, sin_p], axis=1), np.concatenate([-sin_p, cos_p], axis=1)
        self.column_transform = np.stack([re, im, re + im, -(re + im)], axis=1).reshape(
            self.f * INPUT_PLANES, 2 * h).astype(np.float32)
        qs = freqs[:, 1]
        self.q_runs = [(int(q), int(np.searchsorted(qs, q)), int(np.searchsorted(qs, q, side="right")))
                       for q in range(self.qk)]                 # (q, first, end) frequency of each q
        # forward transforms: each plane a (F, positions) block
        self.kernel_planes = np.stack([w_cos, -w_sin - w_cos, w_sin - w_cos]).astype(np.float32)
        self.grad_planes = np.stack([y_cos, -y_sin, y_cos - y_sin, y_cos + y_sin])
        # inverse transforms: (re, im) of each kept frequency back to the positions wanted
        scale = self._weight[:, None] / (self.p * self.q)
        self.y_inverse = np.stack([scale * y_cos, -scale * y_sin])
        # dX's inverse, separable as the input's transform, whose cost does not shrink with a
        # worker's share of the kernels: per q, its frequencies' (re, im) pairs to (U, V) x input
        # row (a (2H, 2m) block of column_inverse), then per input row, every q's (U, V) to the W
        # columns (row_inverse): conv2 at N=32 ~0.3 GFLOP against 1.25 for one GEMM over all H*W
        # positions, ~30 ms of a step at one thread whatever the share.
        # value = cos(a + b) re - sin(a + b) im = cos(b) (re cos a - im sin a) - sin(b) (re sin a + im cos a)
        s = (self._weight / (self.p * self.q))[None, :]                     # (1, F)
        cos_a, sin_a = cos_p.T, sin_p.T                                     # (H, F)
        inverse = np.empty((2, h, self.f, 2))
        inverse[0, :, :, 0], inverse[0, :, :, 1] = s * cos_a, -s * sin_a   # U from re, im
        inverse[1, :, :, 0], inverse[1, :, :, 1] = s * sin_a, s * cos_a    # V from re, im
        self.column_inverse = inverse.reshape(2 * h, 2 * self.f).astype(np.float32)
        b_angle = 2 * np.pi * np.arange(self.qk)[:, None] * (np.arange(w) + pw)[None, :] / self.q
        self.row_inverse = np.stack([np.cos(b_angle), -np.sin(b_angle)], axis=1).reshape(
            2 * self.qk, w).astype(np.float32)
        self.dw_inverse = -np.stack([scale * w_cos, -scale * w_sin])     # backward computes -dW's spectra
        self._blocks = {}

    def _angles(self, rows, cols, r0, c0):
        """cos and sin of 2*pi*(p*(r + r0)/P + q*(c + c0)/Q) for every kept (p, q) and position."""
        r = np.arange(rows, dtype=np.float64) + r0
        c = np.arange(cols, dtype=np.float64) + c0
        theta = 2 * np.pi * ((self._p[:, None, None] * r[None, :, None]) / self.p
                             + (self._q[:, None, None] * c[None, None, :]) / self.q)
        theta = theta.reshape(self.f, rows * cols)
        return np.cos(theta), np.sin(theta)

    def q_runs_in(self, blk):
        """(q, f0, f1, first) for each column frequency q with kept frequencies in block `blk`:
        its frequencies [f0, f1) within the block, and whether the block holds q's first one."""
        return [(q, max(f0, blk.f0), min(f1, blk.f1), f0 >= blk.f0)
                for q, f0, f1 in self.q_runs if f0 < blk.f1 and f1 > blk.f0]

    def blocks(self, block):
        """_Block per run of at most `block` frequencies: each matrix contiguous float32, planes
        stacked (plane, frequency in the block)."""
        if block not in self._blocks:
            out = []
            for f0 in range(0, self.f, block):
                f1 = min(self.f, f0 + block)

                def rows(planes):
                    return np.ascontiguousarray(planes[:, f0:f1].reshape(-1, planes.shape[2]), np.float32)

                out.append(_Block(f0, f1, rows(self.grad_planes), rows(self.y_inverse), rows(self.dw_inverse)))
            self._blocks[block] = out
        return self._blocks[block]


class _Block:
    """One run of frequencies [f0, f1) and its slices of the transform matrices."""

    def __init__(self, f0, f1, grad_rows, y_cols, dw_rows):
        self.f0, self.f1 = f0, f1
        self.grad_rows = grad_rows                           # (planes*fb, positions)
        self.y_cols = y_cols                                 # (2fb, positions)
        self.dw_rows = dw_rows                               # (2fb, kh*kw)


# A layer's transform matrices (FftGeometry) while built: 48 MB for a 32x32 map and a 5x5 kernel,
# 680 MB at 64x64 and 10 GB at 128x128, as they grow with the square of the map's area; so does the
# inverse transform's work per channel, which at 64x64 already exceeds a direct conv's.
GEOMETRY_BUDGET_BYTES = 256 << 20


def kept_count(p_size, q_size):
    """len(kept_frequencies(p_size, q_size)), without listing them."""
    def self_conjugate(n):                      # 0, and n/2 where n is even
        return 2 if n % 2 == 0 else 1
    return (p_size * q_size + self_conjugate(p_size) * self_conjugate(q_size)) // 2


def geometry_bytes(f, ho, wo):
    """Bytes an FftGeometry of `f` kept frequencies and an ho x wo output holds at its peak while
    built: float64 planes over every frequency and output position, the six it keeps (grad_planes'
    four, y_inverse's two) and the angles, cosines and sines they are made from."""
    return 8 * (4 + 2 + 3) * f * ho * wo


def spectra_bytes(geometry, k, c):
    """Bytes of a weight array's cached kernel spectra, with the copy of the weights they came from."""
    return 4 * k * c * (KERNEL_PLANES * geometry.f + geometry.kh * geometry.kw)


def block_bytes_per_frequency(n, k, c):
    """Work bytes per frequency of a block: backward's, the larger (x and dY spectra, dX's and
    dW's products)."""
    return 4 * (INPUT_PLANES * n * c + GRAD_PLANES * n * k + 2 * n * c + 2 * k * c)


class _SpectraEntry:
    """A weight array's kernel spectra and the copy of the weights they came from. The array is
    held by a weak reference: the cache neither keeps weights alive nor keeps the spectra of
    weights that are gone (calibration's, a timing's), whose buffers a new array of the same
    shape takes over instead of allocating (and first-touching) hundreds of MB again."""

    def __init__(self, weights, copy, spectra, geometry):
        self.copy, self.spectra, self.geometry = copy, spectra, geometry
        self.adopt(weights)

    def adopt(self, w):
        """The spectra (to be computed into these buffers) are now w's."""
        self._weights = weakref.ref(w)

    def release(self):
        """No array's any more: a spare buffer for the next array of its shape."""
        self._weights = _no_array

    def holds(self, w):
        return self._weights() is w

    def is_spare(self):
        return self._weights() is None

    def fits(self, shape, w_shape):
        return self.spectra.shape == shape and self.copy.shape == w_shape


def row_ranges(rows, parts, multiple=16):
    """`parts` contiguous [r0, r1) ranges covering rows, as equal as whole multiples of `multiple`
    rows allow (aligned starts keep each part's rows on whole cache lines); empty ones dropped."""
    step = -(-rows // parts)
    step = -(-step // multiple) * multiple if rows >= parts * multiple else step
    return [(r0, min(rows, r0 + step)) for r0 in range(0, rows, max(1, step))]


class FftConv:
    """The FFT path of one device. `gemm(a, b, c, beta)`: c = a @ b + beta*c on float32 2-D
    views, any row- or column-major view, c row-contiguous; `scratch(name, shape)`: a float32
    work buffer kept between calls. Spectra of at most `budget_bytes` in all are cached (least
    recently used first out); work buffers per frequency block stay under `block_budget_bytes`.
    `threads` split every GEMM; `one_blas_thread()`: a context in which BLAS runs each call on
    the calling thread alone."""

    def __init__(self, gemm, scratch, budget_bytes, block_budget_bytes, threads=1, one_blas_thread=None):
        self._gemm, self._scratch = gemm, scratch
        self.budget_bytes = int(budget_bytes)
        self.block_budget_bytes = int(block_budget_bytes)
        self.threads = int(threads)
        self._one_blas_thread = one_blas_thread or contextlib.nullcontext
        self._pool = None           # threads - 1 helpers; the calling thread does one part itself
        self._geometries = {}
        self._entries = []          # _SpectraEntry, most recently used last
        self.spectra_computed = 0   # kernel spectra computations so far (tests count them)

    # ---- splitting the work among the threads ----------------------------------------------------
    def _in_parallel(self, part, rows):
        """part(r0, r1) over `rows` split among the threads; returns when every part is done (an
        exception in a part is raised here)."""
        ranges = row_ranges(rows, self.threads)
        if len(ranges) == 1:
            part(0, rows)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="hetconv-fft")
        pending = [self._pool.submit(part, r0, r1) for r0, r1 in ranges[1:]]
        try:
            part(*ranges[0])
        finally:
            for job in pending:
                job.result()

    def _split_gemm(self, a, b, c, beta):
        """c = a @ b + beta*c, the threads each taking a slice of c's longer side."""
        gemm = self._gemm
        if c.shape[0] >= c.shape[1]:
            self._in_parallel(lambda r0, r1: gemm(a[r0:r1], b, c[r0:r1], beta), c.shape[0])
        else:
            self._in_parallel(lambda c0, c1: gemm(a, b[:, c0:c1], c[:, c0:c1], beta), c.shape[1])

    def geometry(self, x_shape, w_shape, padding):
        key = (x_shape[2], x_shape[3], w_shape[2], w_shape[3], tuple(padding))
        if key not in self._geometries:
            self._geometries[key] = FftGeometry(*key)
        return self._geometries[key]

    def declines(self, x_shape, w_shape, padding):
        """'' where this path takes the layer, else why not (its transform matrices or its spectra
        would exceed the budget). Sized from the shapes alone: a geometry is built only for a layer
        this path takes, as its matrices grow with the square of the map's area (~10 GB at 128x128)."""
        (h, w), (kh, kw) = x_shape[2:], w_shape[2:]
        ho, wo = h + 2 * padding[0] - kh + 1, w + 2 * padding[1] - kw + 1
        f = kept_count(transform_size(h, kh, padding[0], ho), transform_size(w, kw, padding[1], wo))
        need = 4 * w_shape[0] * w_shape[1] * (KERNEL_PLANES * f + kh * kw)        # spectra_bytes, before a geometry
        if need > self.budget_bytes:
            return (f"its kernel spectra need {need / 2**20:.0f} MB ({KERNEL_PLANES} planes x {f} frequencies x "
                    f"{w_shape[0]}x{w_shape[1]} channel pairs), over the FFT budget of {self.budget_bytes / 2**20:.0f} MB")
        matrices = geometry_bytes(f, ho, wo)
        if matrices > GEOMETRY_BUDGET_BYTES:
            return (f"its transform matrices need {matrices / 2**20:.0f} MB ({f} frequencies x {ho}x{wo} output "
                    f"positions), over the {GEOMETRY_BUDGET_BYTES >> 20} MB a layer's transform may have")
        return ""

    def _block(self, g, n, k, c):
        return max(1, min(g.f, self.block_budget_bytes // block_bytes_per_frequency(n, k, c)))

    # ---- the kernel spectra -------------------------------------------------------------------
    def kernel_spectra(self, w, g):
        """(KERNEL_PLANES, F, K, C) spectra of w, from the cache where w is bitwise what they were
        computed from, else recomputed (into the entry's buffer when its shape is unchanged)."""
        k, c, kh, kw = w.shape
        shape = (KERNEL_PLANES, g.f, k, c)
        entry = next((e for e in self._entries if e.holds(w)), None)
        if (entry is not None and entry.fits(shape, w.shape)
                and _same_bits(entry.copy.reshape(-1).view(np.int32), w.reshape(-1).view(np.int32))):
            self._entries.remove(entry)
            self._entries.append(entry)
            return entry.spectra
        if entry is not None:
            self._entries.remove(entry)
            if not entry.fits(shape, w.shape):
                entry = None
        if entry is None:
            spare = next((e for e in self._entries if e.is_spare() and e.fits(shape, w.shape)), None)
            self._entries = [e for e in self._entries if not e.is_spare()]     # the others' memory goes now
            if spare is not None:
                entry = spare
                entry.adopt(w)
            else:
                need = spectra_bytes(g, k, c)
                while self._entries and sum(spectra_bytes_of(e) for e in self._entries) + need > self.budget_bytes:
                    self._entries.pop(0)
                entry = _SpectraEntry(w, np.empty(w.shape, np.float32), np.empty(shape, np.float32), g)
        entry.geometry = g
        self._compute_spectra(entry, w)
        self._entries.append(entry)
        return entry.spectra

    def _compute_spectra(self, entry, w):
        k, c, kh, kw = w.shape
        g = entry.geometry
        np.copyto(entry.copy, w)
        # (3F, K*C) = (3F, kh*kw) @ w (K*C, kh*kw)^T: one GEMM writes every plane
        self._split_gemm(g.kernel_planes.reshape(-1, kh * kw), w.reshape(k * c, kh * kw).T,
                         entry.spectra.reshape(KERNEL_PLANES * g.f, k * c), 0.0)
        self.spectra_computed += 1

    def refresh(self, w):
        """w has just changed in place (the step's update): its cached spectra, if any, are
        computed anew now, so the step's update pays for them, not the next step's first forward
        (calibration times the update, so the cost model sees them where a step pays them)."""
        entry = next((e for e in self._entries if e.holds(w)), None)
        if entry is not None:
            with self._one_blas_thread():
                self._compute_spectra(entry, w)

    def drop(self, w):
        """The spectra cached for w, if any, go with their memory: w runs another path, and an
        update must not recompute spectra no call will read."""
        self._entries = [e for e in self._entries if not e.holds(w)]

    def forget(self, w):
        """The spectra cached for the array w, if any, are not served again: the next call with w
        computes them anew, into the same buffer."""
        for e in self._entries:
            if e.holds(w):
                e.release()

    # ---- forward ---------------------------------------------------------------------------------
    def forward(self, x, w, padding, y, x_spectra=None):
        """y (K*N, Ho*Wo), C-contiguous, kernel-major (K, N, Ho, Wo) = conv2d(x, w) without bias;
        returns the kernel spectra. Kernel-major because each frequency's product runs as
        W (K, C) @ X^T (C, N): ~2x faster in sgemm than X @ W^T at N=32 (the big operand on the
        left). `x_spectra`: a flat float32 buffer of x_spectra_size() elements where x's spectra
        are left for a backward on this same x (which then skips its transform of x)."""
        with self._one_blas_thread():
            return self._forward(x, w, padding, y, x_spectra)

    def x_spectra_size(self, x_shape, w_shape, padding):
        """Elements of the input's spectra, all planes and frequencies: 4 F N C (12.8 M for conv2
        at N=32, 51 MB); keeping them spares backward a pass over x and its transform."""
        g = self.geometry(x_shape, w_shape, padding)
        return INPUT_PLANES * g.f * x_shape[0] * x_shape[1]

    def _row_spectra(self, x, g):
        """The first stage of the input's transform: z (qk, 2H, N*C), each distinct column
        frequency's (re, im) x input row, one GEMM per input row."""
        n, c, h, wd = x.shape
        rows = x.reshape(n * c, h, wd)
        z = self._scratch("fft_z", (2 * g.qk, h, n * c))
        gemm = self._gemm

        def part(r0, r1):
            for r in range(r0, r1):     # (2qk, W) @ (W, N*C), rows r of x across every plane
                gemm(g.row_transform, rows[:, r, :].T, z[:, r, :], 0.0)

        self._in_parallel(part, h)
        return z.reshape(g.qk, 2 * h, n * c)

    def _input_spectra(self, g, blk, z, nc, x_spectra):
        """The block's input spectra (fb*INPUT_PLANES, N*C), frequency-major: in x_spectra where
        given (computed there when z, the row spectra, is given), else in a work buffer."""
        rows = INPUT_PLANES * (blk.f1 - blk.f0)
        if x_spectra is None:
            xs = self._scratch("fft_x", (rows, nc))
        else:
            xs = x_spectra[INPUT_PLANES * blk.f0 * nc:INPUT_PLANES * blk.f1 * nc].reshape(rows, nc)
        if z is not None:
            runs = g.q_runs_in(blk)
            gemm, ct, p = self._gemm, g.column_transform, INPUT_PLANES

            def part(c0, c1):
                for q, f0, f1, _ in runs:   # (planes*m, 2H) @ (2H, N*C): this q's frequencies in the block
                    gemm(ct[p * f0:p * f1], z[q, :, c0:c1], xs[p * (f0 - blk.f0):p * (f1 - blk.f0), c0:c1], 0.0)

            self._in_parallel(part, nc)
        return xs

    def _forward(self, x, w, padding, y, x_spectra):
        n, c, h, wd = x.shape
        k = w.shape[0]
        g = self.geometry(x.shape, w.shape, padding)
        spectra = self.kernel_spectra(w, g)
        z = self._row_spectra(x, g)
        gemm = self._gemm
        for bi, blk in enumerate(g.blocks(self._block(g, n, k, c))):
            f0, fb = blk.f0, blk.f1 - blk.f0
            xs = self._input_spectra(g, blk, z, n * c, x_spectra)
            xs = xs.reshape(fb, INPUT_PLANES, n, c)
            ys = self._scratch("fft_y", (2 * fb, k * n))
            ys4 = ys.reshape(2, fb, k, n)

            def products(k0, k1):
                for j in range(fb):
                    ar, d, ns = (spectra[p, f0 + j, k0:k1] for p in range(KERNEL_PLANES))
                    re, im = ys4[0, j, k0:k1], ys4[1, j, k0:k1]
                    # Y^T = conj(W) X^T: T1 = Wr (Xr + Xi)^T; re = T1 + (Wi - Wr) Xi^T; im = T1 - (Wr + Wi) Xr^T
                    gemm(ar, xs[j, 2].T, re, 0.0)
                    np.copyto(im, re)
                    gemm(d, xs[j, 1].T, re, 1.0)
                    gemm(ns, xs[j, 0].T, im, 1.0)

            self._in_parallel(products, k)
            self._split_gemm(ys.T, blk.y_cols, y, 0.0 if bi == 0 else 1.0)  # (K*N, 2fb) @ (2fb, Ho*Wo)
        return spectra

    # ---- backward --------------------------------------------------------------------------------
    def backward(self, x, w, dy, padding, need_dx, spectra=None, x_spectra=None, dw_out=None, accumulate=False,
                 on_dx=None):
        """(dx (N, C, H, W) or None, dw (K, C, kh, kw)) of sum(dy * conv2d(x, w)); dy (K*N, Ho*Wo)
        C-contiguous, kernel-major as forward's y. `spectra`: the forward's kernel spectra of this
        same w (else looked up). `x_spectra`: what a forward on this same x left there (else x
        is transformed again). `dw_out` (C-contiguous, w's shape): dW is written there, or added
        to it with `accumulate`, by the inverse GEMM's beta (no extra pass), and returned.
        `on_dx` (with need_dx): dX is computed first, over every frequency, and handed to it
        before dW's products start (see _backward_dx_first); the values are the same."""
        with self._one_blas_thread():
            if need_dx and on_dx is not None:
                return self._backward_dx_first(x, w, dy, padding, spectra, x_spectra, dw_out, accumulate, on_dx)
            return self._backward(x, w, dy, padding, need_dx, spectra, x_spectra, dw_out, accumulate)

    def _backward_start(self, x, w, padding, need_dx, spectra, x_spectra, dw_out):
        """What both orders of backward start from: the geometry, the kernel spectra (for dX), the
        input's row spectra (where the forward left none), dW's buffer and dX's two inverse stages."""
        n, c, h, wd = x.shape
        k, _, kh, kw = w.shape
        g = self.geometry(x.shape, w.shape, padding)
        if need_dx and spectra is None:
            spectra = self.kernel_spectra(w, g)
        z = self._row_spectra(x, g) if x_spectra is None else None
        # returned, so never a scratch buffer; written in its own layout by the inverse GEMM (as
        # fast as writing it taps-first, and no transpose after: ~70 ms on the whole conv2)
        dw = np.empty((k * c, kh * kw), np.float32) if dw_out is None else dw_out.reshape(k * c, kh * kw)
        # dX by rows of the plane, then channel-major (C*N, H*W): the inverse's two stages, below
        dx_rows = self._scratch("fft_dx_rows", (g.qk, 2 * h, c * n)) if need_dx else None
        dx_cn = self._scratch("fft_dx_cn", (c * n, h * wd)) if need_dx else None
        return g, spectra, z, dw, dx_rows, dx_cn

    def _grad_spectra(self, blk, dyt, gs):
        """dY's spectra over the block's frequencies into gs (GRAD_PLANES*fb, K*N), returned."""
        self._split_gemm(blk.grad_rows, dyt, gs, 0.0)
        return gs

    def _dw_block(self, g, blk, z, x_spectra, gs, n, k, c, dw, beta):
        """The block's dW products, added into dw by the inverse GEMM (beta)."""
        fb = blk.f1 - blk.f0
        gemm = self._gemm
        xs = self._input_spectra(g, blk, z, n * c, x_spectra).reshape(fb, INPUT_PLANES, n, c)
        gs = gs.reshape(GRAD_PLANES, fb, k, n)
        dws = self._scratch("fft_dw", (2 * fb, k * c))
        dws4 = dws.reshape(2, fb, k, c)

        def dw_products(k0, k1):
            for j in range(fb):
                # -dW = -conj(dY)^T X: -re = dYr^T (-(Xr+Xi)) + (dYr - dYi)^T Xi; -im = same T1 + (dYr + dYi)^T Xr
                re, im = dws4[0, j, k0:k1], dws4[1, j, k0:k1]
                gemm(gs[0, j, k0:k1], xs[j, 3], re, 0.0)
                np.copyto(im, re)
                gemm(gs[3, j, k0:k1], xs[j, 1], re, 1.0)
                gemm(gs[2, j, k0:k1], xs[j, 0], im, 1.0)

        self._in_parallel(dw_products, k)
        self._split_gemm(dws.T, blk.dw_rows, dw, beta)  # (K*C, 2fb) @ (2fb, kh*kw)

    def _dx_block(self, g, blk, spectra, gs, n, c, dx_rows):
        """The block's dX products, added into dx_rows by the inverse's first stage."""
        f0, fb = blk.f0, blk.f1 - blk.f0
        gemm = self._gemm
        gs = gs.reshape(GRAD_PLANES, fb, -1, n)
        dxs = self._scratch("fft_dx", (2 * fb, c * n))      # (re, im) of each frequency together
        dxs4 = dxs.reshape(fb, 2, c, n)

        def dx_products(c0, c1):
            for j in range(fb):
                ar, d, ns = (spectra[p, f0 + j, :, c0:c1] for p in range(KERNEL_PLANES))
                # dX^T = W^T dY^T: T1 = Wr^T (dYr + dYi); re = T1 - (Wr + Wi)^T dYi; im = T1 + (Wi - Wr)^T dYr
                re, im = dxs4[j, 0, c0:c1], dxs4[j, 1, c0:c1]
                gemm(ar.T, gs[2, j], re, 0.0)
                np.copyto(im, re)
                gemm(ns.T, gs[1, j], re, 1.0)
                gemm(d.T, gs[0, j], im, 1.0)

        self._in_parallel(dx_products, c)
        self._dx_to_rows(g, blk, dxs, dx_rows)

    def _dx_of(self, g, x_shape, dx_rows, dx_cn):
        """dX (N, C, H, W), fresh, from the first stage's rows."""
        n, c, h, wd = x_shape
        self._dx_rows_to_plane(g, dx_rows, dx_cn)
        dx = np.empty(x_shape, np.float32)
        swap_leading(dx_cn.reshape(c, n, h * wd), dx.reshape(n, c, h * wd))
        return dx

    def _backward(self, x, w, dy, padding, need_dx, spectra, x_spectra, dw_out, accumulate):
        """Frequency block by block, dW's products and dX's of each block together."""
        n, c = x.shape[:2]
        k = w.shape[0]
        g, spectra, z, dw, dx_rows, dx_cn = self._backward_start(x, w, padding, need_dx, spectra, x_spectra, dw_out)
        dyt = dy.T                                          # (Ho*Wo, K*N)
        for bi, blk in enumerate(g.blocks(self._block(g, n, k, c))):
            gs = self._grad_spectra(blk, dyt, self._scratch("fft_dy", (GRAD_PLANES * (blk.f1 - blk.f0), k * n)))
            self._dw_block(g, blk, z, x_spectra, gs, n, k, c, dw, 0.0 if bi == 0 and not accumulate else 1.0)
            if need_dx:
                self._dx_block(g, blk, spectra, gs, n, c, dx_rows)
        dx = self._dx_of(g, x.shape, dx_rows, dx_cn) if need_dx else None
        return dx, (dw.reshape(w.shape) if dw_out is None else dw_out)

    def _backward_dx_first(self, x, w, dy, padding, spectra, x_spectra, dw_out, accumulate, on_dx):
        """dX over every frequency block, handed to on_dx, then dW's blocks: the caller sends dX
        while dW computes. dY's spectra are kept from the first pass for the second where the
        whole of them (GRAD_PLANES*F*K*N floats: 38 MB for half of conv2 at N=32) fits the
        block budget, else transformed again per block (one GEMM of ~Ho*Wo taps a frequency)."""
        n, c = x.shape[:2]
        k = w.shape[0]
        g, spectra, z, dw, dx_rows, dx_cn = self._backward_start(x, w, padding, True, spectra, x_spectra, dw_out)
        dyt = dy.T
        blocks = g.blocks(self._block(g, n, k, c))
        keep = 4 * GRAD_PLANES * g.f * k * n <= self.block_budget_bytes
        kept = self._scratch("fft_dy_kept", (GRAD_PLANES * g.f, k * n)) if keep else None
        grads = []
        for blk in blocks:
            rows = GRAD_PLANES * (blk.f1 - blk.f0)
            buf = (kept[GRAD_PLANES * blk.f0:GRAD_PLANES * blk.f0 + rows] if keep
                   else self._scratch("fft_dy", (rows, k * n)))
            gs = self._grad_spectra(blk, dyt, buf)
            grads.append(gs if keep else None)
            self._dx_block(g, blk, spectra, gs, n, c, dx_rows)
        dx = self._dx_of(g, x.shape, dx_rows, dx_cn)
        on_dx(dx)
        for bi, blk in enumerate(blocks):
            gs = grads[bi]
            if gs is None:
                gs = self._grad_spectra(blk, dyt, self._scratch("fft_dy", (GRAD_PLANES * (blk.f1 - blk.f0), k * n)))
            self._dw_block(g, blk, z, x_spectra, gs, n, k, c, dw, 0.0 if bi == 0 and not accumulate else 1.0)
        return dx, (dw.reshape(w.shape) if dw_out is None else dw_out)

    def _dx_to_rows(self, g, blk, dxs, dx_rows):
        """dX's inverse, first stage, for one block: per q, (U, V) x input row (2H, C*N) of its
        frequencies' (re, im) pairs, added into dx_rows[q] (set by the block holding the q's
        first frequency)."""
        runs = g.q_runs_in(blk)
        gemm, ci = self._gemm, g.column_inverse

        def part(c0, c1):
            for q, f0, f1, first in runs:    # (2H, 2m) @ (2m, C*N)
                gemm(ci[:, 2 * f0:2 * f1], dxs[2 * (f0 - blk.f0):2 * (f1 - blk.f0), c0:c1], dx_rows[q, :, c0:c1],
                     0.0 if first else 1.0)

        self._in_parallel(part, dxs.shape[1])

    def _dx_rows_to_plane(self, g, dx_rows, dx_cn):
        """dX's inverse, second stage: per input row, every q's (U, V) to the W columns of that
        row of dx_cn (C*N, H*W)."""
        h, wd = g.h, g.w
        by_row = dx_rows.reshape(2 * g.qk, h, -1)           # rows (q, U/V): one stride apart
        plane = dx_cn.reshape(-1, h, wd)
        gemm, ri = self._gemm, g.row_inverse

        def part(c0, c1):
            for r in range(h):               # (C*N, 2qk) @ (2qk, W)
                gemm(by_row[:, r, c0:c1].T, ri, plane[c0:c1, r, :], 0.0)

        self._in_parallel(part, plane.shape[0])


def _no_array():
    """A released entry's weak reference: it refers to no array."""
    return None


def spectra_bytes_of(entry):
    return entry.spectra.nbytes + entry.copy.nbytes
