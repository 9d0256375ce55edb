"""The CPU device's GEMM paths, im2col and shifted: the conv as GEMMs on an expansion of the input
(the GEMMs themselves, by library and precision: devices/cpu_gemms.py, cpu_shifted_gemms.py), cut
into chunks of images under the device's budgets, with a block's bias, activation and pool
(devices/cpu_tails.py) run on each chunk's output as it comes.

- im2col: one GEMM per chunk of images, Y (K, P) = W (K, C*kh*kw) @ cols.T, cols (P, C*kh*kw)
  the im2col of the chunk (P = images * Ho * Wo); backward writes dcols and folds it with col2im.
- shifted: the input is expanded along the kernel's width only (kw copies, not kh*kw), rows
  ordered (h, image, j), so that kernel row u reads one contiguous block of rows; Y is kh GEMMs
  on those views, dW kh more, and dX kh GEMMs added into overlapping windows, folded back along
  the width once (see GemmPaths._shifted_forward). No col2im, no FLOP computed and thrown away.

GemmPaths is a part of CpuDevice (devices/cpu.py): it works in the device's buffers (`_scratch`,
`_take_saved_cols`, `_give_back_saved_cols`) under its budgets (`im2col_budget_bytes`,
`saved_cols_budget_bytes`), and runs the GEMM objects the device holds per path (`_path_gemms`,
`_shifted_gemms`).
"""
import numpy as np
from numba import prange

from hetconv.devices.cpu_gemms import scratch16
from hetconv.devices.cpu_tails import (
    _BlockContext, _PoolGeometry, _act_backward_columns, _act_backward_rows, _act_pool, _act_pool_backward,
    _add_column_sums, _add_row_sums, _bias_act_columns, _bias_act_max2, _bias_act_max2_rows, _bias_act_rows,
    _flat_planes, _is_max2, _planes_of_columns, _planes_of_rows, _unpool, _unpool_rows)
from hetconv.geometry import dilated_size, window_output_size
from hetconv.jit import cached_njit

# The shifted forward's GEMMs write Y with K rounded up to this many columns (zero kernels):
# conv2 at 375 kernels ran its five forward GEMMs ~4% faster at 384 (SkylakeX sgemm, one thread),
# and ~1 ms of zero columns is less than that. Backward's GEMMs gained nothing and stay at K.
KERNEL_ROW_MULTIPLE = 16

_jit = cached_njit(parallel=True, nogil=True)


# ---- the im2col path's kernels ------------------------------------------------------------------
@_jit
def _im2col(x, n0, n1, kh, kw, sh, sw, ph, pw, dh, dw, ho, wo, cols):
    """cols[p, (c*kh+u)*kw+v] = xpad[n, c, i*sh+u*dh, j*sw+v*dw] for p = ((n-n0)*ho + i)*wo + j."""
    c_in, h, w = x.shape[1], x.shape[2], x.shape[3]
    rows = (n1 - n0) * ho * wo
    for p in prange(rows):
        n = n0 + p // (ho * wo)
        i = (p // wo) % ho
        j = p % wo
        col = 0
        for c in range(c_in):
            for u in range(kh):
                r = i * sh + u * dh - ph
                for v in range(kw):
                    s = j * sw + v * dw - pw
                    if 0 <= r < h and 0 <= s < w:
                        cols[p, col] = x[n, c, r, s]
                    else:
                        cols[p, col] = 0.0
                    col += 1


@_jit
def _col2im(dcols, n0, n1, kh, kw, sh, sw, ph, pw, dh, dw, ho, wo, dx):
    """dx[n, c] = the im2col-adjoint of dcols for images n0..n1 (each written whole, so dx may
    start uninitialised); parallel over (image, channel), so race-free."""
    c_in, h, w = dx.shape[1], dx.shape[2], dx.shape[3]
    count = (n1 - n0) * c_in
    for t in prange(count):
        nl = t // c_in
        c = t % c_in
        dx[n0 + nl, c] = 0.0
        for i in range(ho):
            for j in range(wo):
                p = (nl * ho + i) * wo + j
                base = c * kh * kw
                for u in range(kh):
                    r = i * sh + u * dh - ph
                    if r < 0 or r >= h:
                        continue
                    for v in range(kw):
                        s = j * sw + v * dw - pw
                        if 0 <= s < w:
                            dx[n0 + nl, c, r, s] += dcols[p, base + u * kw + v]


# ---- the shifted-GEMM path: kernels on the (rows, C*kw) layout ---------------------------------
# A chunk of nb images is laid out with the image index between the row and the column index:
# row (h*nb + n)*wo + j, so that the rows a kernel row u reads (h = i+u for every output row i,
# every image, every j) are ONE contiguous block starting at u*nb*wo. See GemmPaths._shifted_*.

@_jit
def _vexpand(x, n0, n1, kw, ph, pw, wo, xv):
    """xv[(h*nb + n)*wo + j, c*kw + v] = xpad[n0+n, c, h, j+v] for h over the padded height: the
    input expanded along the kernel's width only (kw copies, not the kh*kw of an im2col)."""
    c_in, h_in, w_in = x.shape[1], x.shape[2], x.shape[3]
    nb = n1 - n0
    hp = h_in + 2 * ph
    for t in prange(hp * nb):
        r = t // nb - ph
        n = n0 + t % nb
        for j in range(wo):
            row = t * wo + j
            for c in range(c_in):
                for v in range(kw):
                    s = j + v - pw
                    if 0 <= r < h_in and 0 <= s < w_in:
                        xv[row, c * kw + v] = x[n, c, r, s]
                    else:
                        xv[row, c * kw + v] = 0.0


@_jit
def _vfold(dxv, n0, n1, kw, ph, pw, wo, dx):
    """The adjoint of _vexpand: dx[n0+n, c, r, s] = sum over v of dxv[((r+ph)*nb + n)*wo +
    s+pw-v, c*kw + v]; parallel over (row, image), each owning dx[n, :, r, :], so race-free.
    dxv is read in order into a (C, wo + kw) row buffer that stays in L1, with no bounds test
    in the inner loop, then stored once (scattered += straight into dx ran ~1.25x slower)."""
    c_in, h_in, w_in = dx.shape[1], dx.shape[2], dx.shape[3]
    nb = n1 - n0
    for t in prange(h_in * nb):
        r = t // nb
        n = n0 + t % nb
        acc = np.zeros((c_in, wo + kw), np.float32)
        base = ((r + ph) * nb + t % nb) * wo
        for j in range(wo):
            for c in range(c_in):
                for v in range(kw):
                    acc[c, j + v] += dxv[base + j, c * kw + v]
        for c in range(c_in):
            for s in range(w_in):
                dx[n, c, r, s] = acc[c, s + pw]


@_jit
def _rows_to_nchw(yt, b, n0, n1, ho, wo, y):
    """y[n0+n, k, i, j] = yt[(i*nb + n)*wo + j, k] + b[k]."""
    k_out = yt.shape[1]
    nb = n1 - n0
    for t in prange(nb * ho):
        nl = t // ho
        i = t % ho
        for j in range(wo):
            row = (i * nb + nl) * wo + j
            for k in range(k_out):
                y[n0 + nl, k, i, j] = yt[row, k] + b[k]


@_jit
def _nchw_to_rows(dy, n0, n1, ho, wo, dyt):
    """dyt[(i*nb + n)*wo + j, k] = dy[n0+n, k, i, j]."""
    k_out = dyt.shape[1]
    nb = n1 - n0
    for t in prange(nb * ho):
        nl = t // ho
        i = t % ho
        for j in range(wo):
            row = (i * nb + nl) * wo + j
            for k in range(k_out):
                dyt[row, k] = dy[n0 + nl, k, i, j]


@_jit
def _weights_by_kernel_row(w, wu):
    """wu[u, k, c*kw + v] = w[k, c, u, v] (numpy's copy of this 4-D transpose ran ~5x slower).
    Reads w in order and writes kh streams: reading it once per kernel row instead ran ~2x slower."""
    k_out, c_in, kh, kw = w.shape
    for k in prange(k_out):
        for c in range(c_in):
            for u in range(kh):
                for v in range(kw):
                    wu[u, k, c * kw + v] = w[k, c, u, v]


@_jit
def _weights_from_kernel_rows(wu, w):
    """The inverse of _weights_by_kernel_row: w[k, c, u, v] = wu[u, k, c*kw + v]."""
    k_out, c_in, kh, kw = w.shape
    for k in prange(k_out):
        for c in range(c_in):
            for u in range(kh):
                for v in range(kw):
                    w[k, c, u, v] = wu[u, k, c * kw + v]


@_jit
def _zero_rows(a, r0):
    """a[r0:] = 0, parallel over rows."""
    for r in prange(r0, a.shape[0]):
        for c in range(a.shape[1]):
            a[r, c] = 0.0


# ---- shapes and views both paths take -------------------------------------------------------------
def _conv_hw(x_shape, w_shape, stride, padding, dilation=(1, 1)):
    """(Ho, Wo) of the conv at this stride, (h, w) padding and dilation."""
    return (window_output_size(x_shape[2], dilated_size(w_shape[2], dilation[0]), stride[0], padding[0]),
            window_output_size(x_shape[3], dilated_size(w_shape[3], dilation[1]), stride[1], padding[1]))


def _group_views(groups, a, b, c, kernel_rows=(0, 2)):
    """Per group of a grouped conv, the views of the im2col path's three GEMM operands that its
    GEMM reads and writes: two of them cut by kernel rows (positions `kernel_rows`: W, Y, dY,
    dW), the other by the group's input-channel columns of the im2col (C/groups * kh * kw of
    them, as cols lays out c outermost). One group: the arrays themselves."""
    if groups == 1:
        return [(a, b, c)]
    arrays = (a, b, c)
    views = []
    for g in range(groups):
        cut = []
        for i, arr in enumerate(arrays):
            if i in kernel_rows:
                rows = arr.shape[0] // groups
                cut.append(arr[g * rows:(g + 1) * rows])
            else:
                width = arr.shape[1] // groups
                cut.append(arr[:, g * width:(g + 1) * width])
        views.append(tuple(cut))
    return views


class _GemmBlockContext(_BlockContext):
    """What a block's backward needs on an im2col or shifted path: as _BlockContext, with the path
    that ran (its GEMMs: `gemms` on an im2col path, `shifted_gemms` on a shifted one), the kept
    im2col or expansion and the forward's kernel rows."""

    def __init__(self, x, w, block, shifted, conv_hw, pool, argmax, mask, pooled_shape, cols, kernel_rows, gemms=None):
        super().__init__(x, w, block, conv_hw, pool, argmax, mask, pooled_shape)
        self.gemms = gemms              # the im2col path's GEMMs (cpu_gemms), which backward runs too
        self.shifted = bool(shifted)
        self.shifted_gemms = shifted or None   # the shifted path's GEMMs (cpu_shifted_gemms), which backward runs too
        self.cols = cols
        self.kernel_rows = kernel_rows


class _PoolContext(_GemmBlockContext):
    """What the fused backward needs: the layer input, the pooling argmax (int8), which path ran
    and, when it fit the budget, the forward's im2col or width expansion of the whole batch (flat;
    None otherwise). On the shifted path also the forward's kernel rows of w (~19 MB for a
    quarter of conv2): the backward given that same array skips their ~5 ms rebuild. Its
    result is defined for the forward's weights only (the argmax came from them), so an array
    changed in place in between is already a caller's error. No block (the paper's: a dense conv
    at stride 1, whose 2x2 pool the argmax routes whole), its padding instead."""

    def __init__(self, x, argmax, padding, w, shifted, cols=None, kernel_rows=None, gemms=None):
        super().__init__(x, w, None, shifted, None, None, argmax, None, argmax.shape, cols, kernel_rows, gemms)
        self.padding = padding


class GemmPaths:
    """The im2col and shifted paths of a CpuDevice: plain convs (_forward_chunks, _shifted_forward
    and their backwards) and blocks (_gemm_block, _gemm_block_backward)."""

    @staticmethod
    def _equal_chunks(n, per_image_bytes, budget_bytes):
        """Image ranges of equal chunks (conv2 at N=32: 11+11+10 images, not 13+13+6), each under
        the budget where one image fits it: a short last chunk runs thin GEMMs, which cost most
        where a worker holds few kernels."""
        step = max(1, min(n, budget_bytes // max(1, per_image_bytes)))
        pieces = (n + step - 1) // step
        step = (n + pieces - 1) // pieces
        return [(n0, min(n, n0 + step)) for n0 in range(0, n, step)], step

    def _chunk_plan(self, x, w, stride, padding, cols_dtype=np.float32, dilation=(1, 1)):
        """What forward and backward share: kernel and output size, W as (K, C/groups*kh*kw), the
        image ranges of each chunk, and an im2col buffer of every input channel sized for the
        largest chunk (float32, or bf16 bits for the bf16 path: chunked as the float32 one)."""
        n, c, h, wd = x.shape
        k, cg, kh, kw = w.shape
        ho, wo = _conv_hw(x.shape, w.shape, stride, padding, dilation)
        ckk = c * kh * kw
        chunks, step = self._equal_chunks(n, ho * wo * ckk * 4, self.im2col_budget_bytes)
        shape = (step * ho * wo, ckk)
        cols = self._scratch("cols", shape) if cols_dtype == np.float32 else scratch16(self, "cols", shape)
        return (kh, kw, ho, wo), w.reshape(k, cg * kh * kw), chunks, cols

    # ---- forward -----------------------------------------------------------------------------
    def _forward_chunks(self, x, w, stride, padding, consume, saved_cols=None, gemms=None, dilation=(1, 1),
                        groups=1):
        """Run Y (K, P) = W @ im2col(chunk).T per chunk and hand each Y to `consume(n0, n1, y)`.
        With `saved_cols` (flat float32, the whole batch's size) im2col goes there, kept for
        backward. `gemms`: the path's GEMMs (cpu_gemms; OpenBLAS's where None). With `groups`,
        one GEMM per group on its kernels' rows of W and its input channels' columns of the
        im2col (see _group_views)."""
        gemms = gemms or self._path_gemms["im2col"]
        (kh, kw, ho, wo), w2, chunks, cols_buf = self._chunk_plan(x, w, stride, padding, gemms.cols_dtype, dilation)
        (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
        ckk = cols_buf.shape[1]
        x_in, w_in = gemms.input(x), gemms.weights(w2)
        if saved_cols is not None:
            saved_cols = saved_cols.view(gemms.cols_dtype)
        y_buf = self._scratch("y", (w.shape[0], cols_buf.shape[0]))
        for n0, n1 in chunks:
            rows = (n1 - n0) * ho * wo
            if saved_cols is None:
                cols = cols_buf[:rows]
            else:
                cols = saved_cols[n0 * ho * wo * ckk:n1 * ho * wo * ckk].reshape(rows, ckk)
            y = y_buf[:, :rows]
            _im2col(x_in, n0, n1, kh, kw, sh, sw, ph, pw, dh, dw, ho, wo, cols)
            for w_g, cols_g, y_g in _group_views(groups, w_in, cols, y):
                gemms.forward(w_g, cols_g, y_g)
            consume(n0, n1, y)
        return ho, wo

    def _gemm_block(self, x, w, b, block, path):
        """The block on an im2col or shifted path: the paper's block where it is one (_is_max2),
        any other through _generic_block."""
        gemms, shifted = self._path_gemms.get(path), self._shifted_gemms.get(path)
        if _is_max2(block):
            return self._paper_block(x, w, b, block.padding, shifted, gemms, block.activation == "relu")
        return self._generic_block(x, w, b, block, shifted, gemms)

    def _fused_forward(self, x, w, stride, padding, shifted, consume_columns, consume_rows, gemms=None,
                       dilation=(1, 1), groups=1):
        """The conv of a fused forward, each chunk's Y handed to consume_columns(n0, n1, y (K, P))
        on an im2col path (its `gemms`) or consume_rows(n0, n1, yt (ho*nb*wo, K)) on a shifted
        one (`shifted`: its GEMMs, cpu_shifted_gemms; None on an im2col path). Returns (shifted,
        the kept im2col or expansion or None, the kernel rows or None) for the context. A dilated
        or grouped conv (`dilation`, `groups`) runs on an im2col path only (see _choose_path)."""
        n, c, h, _ = x.shape
        k, _, kh, kw = w.shape
        ho, wo = _conv_hw(x.shape, w.shape, stride, padding, dilation)
        # what backward reuses: the width expansion (padded height) or the im2col
        cols_size = n * (h + 2 * padding[0]) * wo * c * kw if shifted else n * ho * wo * c * kh * kw
        dtype = shifted.dtype if shifted else gemms.cols_dtype if gemms is not None else np.float32
        cols_size = -(-cols_size * np.dtype(dtype).itemsize // 4)   # in float32 elements: bf16 takes half
        saved_cols = self._take_saved_cols(cols_size) if cols_size * 4 <= self.saved_cols_budget_bytes else None
        kernel_rows = None
        if shifted:
            kernel_rows = self._shifted_forward(x, w, padding, consume_rows, saved=saved_cols, gemms=shifted)
        else:
            self._forward_chunks(x, w, stride, padding, consume_columns, saved_cols=saved_cols, gemms=gemms,
                                 dilation=dilation, groups=groups)
        return shifted, saved_cols, kernel_rows

    def _paper_block(self, x, w, b, padding, shifted, gemms=None, relu=True):
        """Conv + bias + ReLU (or none) + 2x2 stride-2 max-pool in one pass over each chunk's Y,
        keeping an int8 argmax per pooled value."""
        ho, wo = _conv_hw(x.shape, w.shape, (1, 1), padding)
        out = np.empty((x.shape[0], w.shape[0], ho // 2, wo // 2), np.float32)
        argmax = np.empty(out.shape, np.int8)
        shifted, saved_cols, kernel_rows = self._fused_forward(
            x, w, (1, 1), padding, shifted,
            lambda n0, n1, y: _bias_act_max2(y, b, n0, n1, ho, wo, relu, out, argmax),
            lambda n0, n1, yt: _bias_act_max2_rows(yt, b, n0, n1, ho, wo, relu, out, argmax), gemms)
        return out, _PoolContext(x, argmax, padding, w, shifted, cols=saved_cols, kernel_rows=kernel_rows, gemms=gemms)

    def _generic_block(self, x, w, b, block, shifted, gemms=None):
        """Any other block: each chunk's Y, seen as (images, K, ho, wo) planes, goes through the
        activation and the pool in one Numba pass. Backward keeps an int32 argmax per pooled value
        (max-pool) or a byte per conv output where ReLU passes (other pools with ReLU)."""
        stride, padding = block.stride, block.padding
        ho, wo = _conv_hw(x.shape, w.shape, stride, padding, block.dilation)
        pool = _PoolGeometry.of(block)
        out = np.empty((x.shape[0], w.shape[0]) + pool.output_hw(ho, wo), np.float32)
        relu = block.activation == "relu"
        argmax = np.empty(out.shape if pool.is_max else (0, 0, 0, 0), np.int32)
        mask = np.empty(x.shape[:1] + (w.shape[0], ho, wo) if relu and not pool.is_max else (0, 0, 0, 0), np.uint8)

        def consume(n0, planes):
            _act_pool(planes, b, n0, relu, pool.is_max, *pool.args, out, argmax, mask)

        if block.pool == "none":        # out and mask as (N, K, ho*wo), on each layout's own kernel
            out3, mask3 = _flat_planes(out), _flat_planes(mask)
            consume_columns = lambda n0, n1, y: _bias_act_columns(y, b, n0, relu, out3, mask3)  # noqa: E731
            consume_rows = lambda n0, n1, yt: _bias_act_rows(yt, b, n0, n1 - n0, ho, wo, relu, out3, mask3)  # noqa: E731
        else:
            consume_columns = lambda n0, n1, y: consume(n0, _planes_of_columns(y, n1 - n0, ho, wo))  # noqa: E731
            consume_rows = lambda n0, n1, yt: consume(n0, _planes_of_rows(yt, n1 - n0, ho, wo))  # noqa: E731
        shifted, saved_cols, kernel_rows = self._fused_forward(x, w, stride, padding, shifted, consume_columns,
                                                               consume_rows, gemms, block.dilation, block.groups)
        ctx = _GemmBlockContext(x, w, block, shifted, (ho, wo), pool, argmax, mask, out.shape, saved_cols,
                                kernel_rows, gemms)
        return out, ctx

    # ---- backward ----------------------------------------------------------------------------
    def _backward_chunks(self, x, w, stride, padding, need_dx, fill_dy, saved_cols=None, dw_out=None,
                         accumulate=False, gemms=None, dilation=(1, 1), groups=1):
        """dW, db, dx from per-chunk dY (K, P) produced by `fill_dy(n0, n1, dy_out)`. With
        `saved_cols` (the forward's im2col of the whole batch) no im2col runs, and dcols
        overwrites it chunk by chunk (float32 paths). dW into dw_out where given (added, with
        accumulate). `gemms` as _forward_chunks'; db sums the float32 dY on every path; `groups`
        as there, each group's dcols into its own columns."""
        gemms = gemms or self._path_gemms["im2col"]
        (kh, kw, ho, wo), w2, chunks, cols_buf = self._chunk_plan(x, w, stride, padding, gemms.cols_dtype, dilation)
        (sh, sw), (ph, pw), (dh, dwd) = stride, padding, dilation
        k, ckk = w2.shape[0], cols_buf.shape[1]
        ckk_w = w2.shape[1]
        dy_buf = self._scratch("y", (k, cols_buf.shape[0]))
        # returned: never a scratch buffer
        dw = np.empty((k, ckk_w), np.float32) if dw_out is None else dw_out.reshape(k, ckk_w)
        db = np.zeros(k, np.float64)
        dx = np.empty(x.shape, np.float32) if need_dx else None    # every image written by _col2im
        x_in = gemms.input(x) if saved_cols is None else None
        w_in = gemms.weights(w2) if need_dx else None
        if saved_cols is not None:
            saved_cols = saved_cols.view(gemms.cols_dtype)
        for i, (n0, n1) in enumerate(chunks):
            rows = (n1 - n0) * ho * wo
            dy = dy_buf[:, :rows]
            fill_dy(n0, n1, dy)
            _add_row_sums(dy, db)
            if saved_cols is None:
                cols = cols_buf[:rows]
                _im2col(x_in, n0, n1, kh, kw, sh, sw, ph, pw, dh, dwd, ho, wo, cols)
            else:
                cols = saved_cols[n0 * ho * wo * ckk:n1 * ho * wo * ckk].reshape(rows, ckk)
            dy_in = gemms.grad(dy)
            for dy_g, cols_g, dw_g in _group_views(groups, dy_in, cols, dw):
                gemms.weight_grad(dy_g, cols_g, dw_g, add=i > 0 or accumulate)
            if need_dx:
                if groups == 1:
                    dcols = gemms.data_grad(dy_in, w_in, cols)
                else:                   # every group's dcols, float32, before col2im folds them
                    dcols = cols if cols.dtype == np.float32 else self._scratch("dcols_groups", cols.shape)
                    for dy_g, w_g, dcols_g in _group_views(groups, dy_in, w_in, dcols, kernel_rows=(0, 1)):
                        gemms.data_grad_into(dy_g, w_g, dcols_g)
                _col2im(dcols, n0, n1, kh, kw, sh, sw, ph, pw, dh, dwd, ho, wo, dx)
        return dx, (dw.reshape(w.shape) if dw_out is None else dw_out), db.astype(np.float32)

    def _gemm_block_backward(self, ctx, w, dout, need_dx, dw_out, accumulate):
        """dx, dW, db of a block _gemm_block ran: each chunk's dY from dout through the tail's
        gradient (the paper block's unpool, or the activation and pool's), then the path's GEMMs."""
        x = ctx.x
        if isinstance(ctx, _PoolContext):
            ho, wo = _conv_hw(x.shape, w.shape, (1, 1), ctx.padding)
            return self._fused_backward(
                ctx, w, (1, 1), ctx.padding, need_dx, dw_out, accumulate,
                lambda n0, n1, dy: _unpool(dout, ctx.argmax, n0, n1, ho, wo, dy),
                lambda n0, n1, dyt: _unpool_rows(dout, ctx.argmax, n0, n1, ho, wo, dyt))
        (ho, wo), pool = ctx.conv_hw, ctx.pool
        relu = ctx.block.activation == "relu"

        def fill(n0, planes):
            _act_pool_backward(dout, n0, relu, pool.is_max, *pool.args, ctx.argmax, ctx.mask, planes)

        if ctx.block.pool == "none":
            dout3, mask3 = _flat_planes(dout), _flat_planes(ctx.mask)
            fill_columns = lambda n0, n1, dy: _act_backward_columns(dout3, mask3, n0, relu, dy)  # noqa: E731
            fill_rows = lambda n0, n1, dyt: _act_backward_rows(dout3, mask3, n0, n1 - n0, ho, wo, relu, dyt)  # noqa: E731
        else:
            fill_columns = lambda n0, n1, dy: fill(n0, _planes_of_columns(dy, n1 - n0, ho, wo))  # noqa: E731
            fill_rows = lambda n0, n1, dyt: fill(n0, _planes_of_rows(dyt, n1 - n0, ho, wo))  # noqa: E731
        return self._fused_backward(ctx, w, ctx.block.stride, ctx.block.padding, need_dx, dw_out, accumulate,
                                    fill_columns, fill_rows)

    def _fused_backward(self, ctx, w, stride, padding, need_dx, dw_out, accumulate, fill_columns, fill_rows):
        """dx, dW, db of a fused forward, each chunk's dY filled by fill_columns(n0, n1, dy (K, P))
        on the im2col path or fill_rows(n0, n1, dyt (ho*nb*wo, K)) on the shifted one; dW into
        dw_out where given (as conv_block_backward says)."""
        saved_cols, ctx.cols = ctx.cols, None      # overwritten below: a second backward recomputes
        if ctx.shifted:
            kernel_rows = ctx.kernel_rows if w is ctx.forward_weights else None
            dx, dw, db = self._shifted_backward(ctx.x, w, padding, need_dx, fill_rows, saved=saved_cols,
                                                wu=kernel_rows, gemms=ctx.shifted_gemms)
            grads = dx, self._dw_into(dw_out, accumulate, dw), db
        else:
            block = ctx.block                           # a paper block's context has none: a dense conv
            grads = self._backward_chunks(ctx.x, w, stride, padding, need_dx, fill_columns, saved_cols=saved_cols,
                                          dw_out=dw_out, accumulate=accumulate, gemms=ctx.gemms,
                                          **({} if block is None else dict(dilation=block.dilation, groups=block.groups)))
        if saved_cols is not None:
            self._give_back_saved_cols(saved_cols)
        return grads

    # ---- the shifted-GEMM path -------------------------------------------------------------------
    # With the input expanded along the kernel's width only, xv (hp*nb*wo, C*kw) with row
    # (h*nb + n)*wo + j, the output rows (i*nb + n)*wo + j of kernel row u read the input rows
    # (i+u)*nb*wo + ...: one contiguous block of xv starting at u*nb*wo. So
    #     Y (ho*nb*wo, K) = sum over u of xv[u*nb*wo : u*nb*wo + ho*nb*wo] @ W[:, :, u, :].T
    # is kh GEMMs on views, each with a C*kw-long reduction and no FLOP wasted (the batch sits
    # between the row and the column, so no padded columns are computed and thrown away). The
    # expansion is kw copies of the input, not im2col's kh*kw, and dX needs no col2im: its kh
    # GEMMs add into overlapping windows of a dxv laid out like xv, folded back along the width
    # once. The kh products land in Y and in dxv's windows by sgemm with beta = 1 (no temporary,
    # no extra pass). What stays the same at any K: the expansion and the fold (~10-12 ms each on
    # conv2 at N=32) and BLAS packing the xv windows inside each GEMM.
    def _shifted_plan(self, x, w, padding):
        """Output size, padded height and the chunks' image ranges."""
        n, c, h, wd = x.shape
        k, _, kh, kw = w.shape
        ho, wo = _conv_hw(x.shape, w.shape, (1, 1), padding)
        hp = h + 2 * padding[0]
        chunks, _ = self._equal_chunks(n, hp * wo * c * kw * 4, self.im2col_budget_bytes)
        return (kh, kw, ho, wo, hp), chunks

    @staticmethod
    def _kernel_rows(w):
        """W as (kh, Kp, C*kw), one (Kp, C*kw) matrix per kernel row, Kp = K rounded up to
        KERNEL_ROW_MULTIPLE with zero rows: the forward GEMMs' output width. Backward uses the
        first K rows."""
        k, c, kh, kw = w.shape
        kp = -(-k // KERNEL_ROW_MULTIPLE) * KERNEL_ROW_MULTIPLE
        wu = np.empty((kh, kp, c * kw), np.float32)
        _weights_by_kernel_row(w, wu)
        if kp > k:
            wu[:, k:] = 0.0
        return wu

    def _chunk_xv(self, x_in, n0, n1, kw, padding, hp, wo, saved, expand, gemms):
        """The chunk's width expansion of x_in (the input as `gemms` take it): in `saved` (flat,
        the whole batch's size, in float32 elements) or a work buffer, computed there when
        `expand`."""
        ckv = x_in.shape[1] * kw
        rows = hp * (n1 - n0) * wo
        if saved is None:
            xv = gemms.expansion((rows, ckv))
        else:
            xv = saved.view(gemms.dtype)[n0 * hp * wo * ckv:n1 * hp * wo * ckv].reshape(rows, ckv)
        if expand:
            _vexpand(x_in, n0, n1, kw, padding[0], padding[1], wo, xv)
        return xv

    def _shifted_forward(self, x, w, padding, consume, saved=None, gemms=None):
        """Y (ho*nb*wo, K) per chunk (a view into a Kp-wide buffer), handed to
        `consume(n0, n1, yt)`. `gemms`: the path's (cpu_shifted_gemms; OpenBLAS's where None).
        Returns the kernel rows as the GEMMs take them, which a backward can reuse."""
        gemms = gemms or self._shifted_gemms["shifted"]
        (kh, kw, ho, wo, hp), chunks = self._shifted_plan(x, w, padding)
        wu = gemms.kernel_rows(self._kernel_rows(w))
        k, kp = w.shape[0], wu.shape[1]
        x_in = gemms.input(x)
        for n0, n1 in chunks:
            s = (n1 - n0) * wo                  # xv rows per input row
            rows = ho * s
            xv = self._chunk_xv(x_in, n0, n1, kw, padding, hp, wo, saved, True, gemms)
            yt = self._scratch("y", (rows, kp))
            for u in range(kh):
                gemms.gemm(xv[u * s:u * s + rows], wu[u].T, yt, 0.0 if u == 0 else 1.0, "y_part")
            consume(n0, n1, yt[:, :k])
        return wu

    def _shifted_backward(self, x, w, padding, need_dx, fill_dyt, saved=None, wu=None, gemms=None):
        """dW, db, dx from per-chunk dY (ho*nb*wo, K) produced by `fill_dyt(n0, n1, dyt)`. With
        `saved` (the forward's expansion of the whole batch) no expansion runs, and dxv
        overwrites it chunk by chunk where the GEMMs allow. `wu`: the forward's kernel rows of
        these same weights, as `gemms` take them."""
        gemms = gemms or self._shifted_gemms["shifted"]
        (kh, kw, ho, wo, hp), chunks = self._shifted_plan(x, w, padding)
        k, ckv = w.shape[0], w.shape[1] * kw
        wu = (gemms.kernel_rows(self._kernel_rows(w)) if wu is None else wu)[:, :k]
        dwu = np.empty((kh, k, ckv), np.float32)
        db = np.zeros(k, np.float64)
        dx = np.empty(x.shape, np.float32) if need_dx else None     # every row written by _vfold
        x_in = gemms.input(x) if saved is None else None
        for i, (n0, n1) in enumerate(chunks):
            s = (n1 - n0) * wo
            rows = ho * s
            dyt = self._scratch("y", (rows, k))
            fill_dyt(n0, n1, dyt)
            _add_column_sums(dyt, db)
            dyt_in = gemms.grad(dyt)
            xv = self._chunk_xv(x if x_in is None else x_in, n0, n1, kw, padding, hp, wo, saved, saved is None,
                                gemms)
            for u in range(kh):                 # dW[:, :, u, :] (K, C*kw) = dY.T @ window u
                gemms.gemm(dyt_in.T, xv[u * s:u * s + rows], dwu[u], 0.0 if i == 0 else 1.0, "dw")
            if need_dx:
                dxv = gemms.dxv(xv)             # this chunk's expansion is done with: reused where it can be
                gemms.gemm(dyt_in, wu[0], dxv[:rows], 0.0, "dx_part")
                _zero_rows(dxv, rows)
                # kernel row u's product lands on the window shifted by u input rows
                for u in range(1, kh):
                    gemms.gemm(dyt_in, wu[u], dxv[u * s:u * s + rows], 1.0, "dx_part")
                _vfold(dxv, n0, n1, kw, padding[0], padding[1], wo, dx)
        dw = np.empty(w.shape, np.float32)          # returned: never a scratch buffer
        _weights_from_kernel_rows(dwu, dw)
        return dx, dw, db.astype(np.float32)
