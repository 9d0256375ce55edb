"""The CPU device's depthwise convolutions: a conv whose groups equal its input channels (weights
(K, 1, kh, kw), K = m*C: kernel k reads input channel k // m), as MobileNet's and EfficientNet's
3x3 and 5x5 layers are, in Numba kernels parallel over (image, channel) planes.

Why: on the im2col paths such a conv runs C GEMMs of one row each (kh*kw long), whose calls cost
more than their FLOPs, after an im2col of kh*kw copies of the input; torchvision's mobilenet_v2 at
width 0.25 trained ~4x slower than PyTorch. Here each plane is read once, into a zero-padded copy
(no bounds tests in the inner loops, and the place where a bf16 path rounds its operands), and each
output row sums its kh*kw taps over a row of the padded plane: memory-bound, a few passes over x
and Y per call.

- forward: y[n, k, i, j] = sum over (u, v) in row-major order of w[k, 0, u, v] * xpad[n, k // m,
  i*sh + u*dh, j*sw + v*dw], accumulated in float32 from zero; no bias (the block's tail pass adds
  it, with the activation and the pool, as on the direct paths).
- backward, one pass per (image, input channel) plane: dX's plane sums its m kernels' products in
  (kernel, output row, u, v) order into a padded float32 plane, then crops it; each kernel's
  dW partial of that image sums, per tap, its output rows column by column and then the columns in
  order (float32); dW sums the images' partials in image order. Every sum has an order fixed by
  the shapes alone: the same bits whatever the thread count.
- bf16 (`--precision bf16`, PyTorch autocast's policy for conv): x, w and dY rounded to bf16
  (nearest even, as dnnl.to_bf16) as each plane is copied in, products and sums in float32. A
  product of two bf16 values is exact in float32, so this is what a bf16 GEMM computes.
What it costs: a per-image partial dW of K*kh*kw floats (1.1 MB for mobilenet_v2's widest
depthwise layer at batch 32), and per thread a padded plane or two.
"""
import numba
import numpy as np
from numba import prange

from hetconv.devices.dnnl import _bf16_of_bits
from hetconv.jit import cached_njit

_jit = cached_njit(parallel=True, nogil=True)


@cached_njit(inline="always", nogil=True)
def _padded_plane(a, bits, n, c, ph, pw, bf16, out):
    """out (flat, (h + 2ph) x (w + 2pw)) = plane a[n, c] zero-padded; rounded to bf16 where
    `bf16` (read from `bits`, a uint32 view of a)."""
    h, w = a.shape[2], a.shape[3]
    wp = w + 2 * pw
    out[:] = 0.0
    if bf16:
        out_bits = out.view(np.uint32)
        for r in range(h):
            row = (r + ph) * wp + pw
            for s in range(w):
                out_bits[row + s] = np.uint32(_bf16_of_bits(bits[n, c, r, s])) << 16
    else:
        for r in range(h):
            row = (r + ph) * wp + pw
            for s in range(w):
                out[row + s] = a[n, c, r, s]


@cached_njit(inline="always", nogil=True)
def _kernel_taps(w, w_bits, k, bf16, out):
    """out (kh*kw) = w[k, 0] in row-major order, rounded to bf16 where `bf16`."""
    kh, kw = w.shape[2], w.shape[3]
    if bf16:
        out_bits = out.view(np.uint32)
        for u in range(kh):
            for v in range(kw):
                out_bits[u * kw + v] = np.uint32(_bf16_of_bits(w_bits[k, 0, u, v])) << 16
    else:
        for u in range(kh):
            for v in range(kw):
                out[u * kw + v] = w[k, 0, u, v]


# The stride-1 kernels run each tap as one loop over a plane's output "wide": row i of the output
# at i*wp, wp the padded input's width, the columns from Wo to wp junk (computed, never read). A tap
# then reads the padded plane at one offset, u*dh*wp + v*dw: kh*kw loops of ~Ho*wp, not Ho*kh*kw
# loops of Wo (on 4x4 and 8x8 maps the loops' set-up cost more than their arithmetic), for
# (wp - Wo)/wp more products (6% at 32x32, a third at 4x4).
LANES = 8       # the weight gradient's running sums per tap: products p = LANES*r + l go to lane l


@cached_njit(inline="always", nogil=True)
def _wide_forward(xp, taps, kh, kw, dh, dw, wp, ho, wo, wide):
    """wide[i*wp + j] = sum over (u, v) in row-major order of taps[u*kw + v] * xp[(i + u*dh)*wp +
    j + v*dw], from zero (stride 1)."""
    length = wide.shape[0]
    wide[:] = 0.0
    for u in range(kh):
        for v in range(kw):
            tap = taps[u * kw + v]
            start = u * dh * wp + v * dw
            window = xp[start:start + length]
            for p in range(length):
                wide[p] += tap * window[p]


@cached_njit(inline="always", nogil=True)
def _wide_weight_grad(xp, dyw, kh, kw, dh, dw, wp, lanes, out):
    """out[u*kw + v] = sum over p of dyw[p] * xp[u*dh*wp + v*dw + p]: LANES running sums (product
    p into lane p mod LANES, in order), then the lanes added in order; float32 throughout."""
    length = dyw.shape[0]
    full = length - length % LANES
    for u in range(kh):
        for v in range(kw):
            start = u * dh * wp + v * dw
            window = xp[start:start + length]
            lanes[:] = 0.0
            for r in range(0, full, LANES):
                for lane in range(LANES):
                    lanes[lane] += dyw[r + lane] * window[r + lane]
            for p in range(full, length):
                lanes[p - full] += dyw[p] * window[p]
            total = np.float32(0.0)
            for lane in range(LANES):
                total += lanes[lane]
            out[u * kw + v] = total


@cached_njit(inline="always", nogil=True)
def _wide_data_grad(dyw, taps, kh, kw, dh, dw, wp, dxp):
    """dxp[u*dh*wp + v*dw + p] += taps[u*kw + v] * dyw[p], (u, v) in row-major order."""
    length = dyw.shape[0]
    for u in range(kh):
        for v in range(kw):
            tap = taps[u * kw + v]
            start = u * dh * wp + v * dw
            window = dxp[start:start + length]
            for p in range(length):
                window[p] += tap * dyw[p]


@_jit
def _forward(x, x_bits, w, w_bits, sh, sw, ph, pw, dh, dw, bf16, per_task, y):
    """y (N, K, Ho, Wo) = the depthwise conv of x (N, C, H, W) with w (K, 1, kh, kw), no bias.
    Each task takes `per_task` (image, channel) planes in turn, with its buffers allocated once."""
    n_img, c_in, h, wd = x.shape
    k_out, kh, kw = w.shape[0], w.shape[2], w.shape[3]
    m = k_out // c_in
    ho, wo = y.shape[2], y.shape[3]
    wp = wd + 2 * pw
    span = (wo - 1) * sw + 1                # the padded columns one output row's tap reads
    planes = n_img * c_in
    for task in prange((planes + per_task - 1) // per_task):
        xp = np.empty((h + 2 * ph) * wp, np.float32)
        taps = np.empty(kh * kw, np.float32)
        wide = np.empty((ho - 1) * wp + wo, np.float32)
        for t in range(task * per_task, min(planes, (task + 1) * per_task)):
            n, c = t // c_in, t % c_in
            _padded_plane(x, x_bits, n, c, ph, pw, bf16, xp)
            for q in range(m):
                k = c * m + q
                _kernel_taps(w, w_bits, k, bf16, taps)
                if sh == 1 and sw == 1:
                    _wide_forward(xp, taps, kh, kw, dh, dw, wp, ho, wo, wide)
                    for i in range(ho):
                        for j in range(wo):
                            y[n, k, i, j] = wide[i * wp + j]
                    continue
                for i in range(ho):
                    out = y[n, k, i]
                    out[:] = 0.0
                    for u in range(kh):
                        row = (i * sh + u * dh) * wp
                        for v in range(kw):
                            tap = taps[u * kw + v]
                            # a view per tap: its index starts at 0, so no negative-index test in the loop
                            window = xp[row + v * dw:row + v * dw + span:sw]
                            for j in range(wo):
                                out[j] += tap * window[j]


@_jit
def _backward(x, x_bits, w, w_bits, dy, dy_bits, sh, sw, ph, pw, dh, dw, bf16, need_dx, per_task, dx, partial):
    """dx (N, C, H, W) where need_dx, and partial (N, K, kh*kw): each image's dW, for dY (N, K,
    Ho, Wo). Parallel over (image, input channel) planes, `per_task` a task, each plane's sums in a
    fixed order."""
    n_img, c_in, h, wd = x.shape
    k_out, kh, kw = w.shape[0], w.shape[2], w.shape[3]
    m = k_out // c_in
    ho, wo = dy.shape[2], dy.shape[3]
    hp, wp = h + 2 * ph, wd + 2 * pw
    span = (wo - 1) * sw + 1
    planes = n_img * c_in
    for task in prange((planes + per_task - 1) // per_task):
        xp = np.empty(hp * wp, np.float32)
        dyp = np.empty(ho * wo, np.float32)
        dyp_bits = dyp.view(np.uint32)
        dxp = np.empty(hp * wp if need_dx else 0, np.float32)
        taps = np.empty(kh * kw, np.float32)
        acc = np.empty(wo, np.float32)
        dyw = np.empty((ho - 1) * wp + wo, np.float32)
        dyw_bits = dyw.view(np.uint32)
        lanes = np.empty(LANES, np.float32)
        for t in range(task * per_task, min(planes, (task + 1) * per_task)):
            n, c = t // c_in, t % c_in
            _padded_plane(x, x_bits, n, c, ph, pw, bf16, xp)
            if need_dx:
                dxp[:] = 0.0
            for q in range(m):
                k = c * m + q
                if sh == 1 and sw == 1:
                    # dY laid out as the wide forward's rows, zero in the columns past Wo
                    for i in range(ho):
                        for j in range(wo, wp if i < ho - 1 else wo):
                            dyw[i * wp + j] = 0.0
                        for j in range(wo):
                            if bf16:
                                dyw_bits[i * wp + j] = np.uint32(_bf16_of_bits(dy_bits[n, k, i, j])) << 16
                            else:
                                dyw[i * wp + j] = dy[n, k, i, j]
                    _wide_weight_grad(xp, dyw, kh, kw, dh, dw, wp, lanes, partial[n, k])
                    if need_dx:
                        _kernel_taps(w, w_bits, k, bf16, taps)
                        _wide_data_grad(dyw, taps, kh, kw, dh, dw, wp, dxp)
                    continue
                for i in range(ho):
                    for j in range(wo):
                        if bf16:
                            dyp_bits[i * wo + j] = np.uint32(_bf16_of_bits(dy_bits[n, k, i, j])) << 16
                        else:
                            dyp[i * wo + j] = dy[n, k, i, j]
                for u in range(kh):
                    for v in range(kw):
                        acc[:] = 0.0
                        for i in range(ho):
                            start = (i * sh + u * dh) * wp + v * dw
                            window = xp[start:start + span:sw]
                            grad = dyp[i * wo:(i + 1) * wo]
                            for j in range(wo):
                                acc[j] += grad[j] * window[j]
                        total = np.float32(0.0)
                        for j in range(wo):
                            total += acc[j]
                        partial[n, k, u * kw + v] = total
                if need_dx:
                    _kernel_taps(w, w_bits, k, bf16, taps)
                    for i in range(ho):
                        grad = dyp[i * wo:(i + 1) * wo]
                        for u in range(kh):
                            row = (i * sh + u * dh) * wp
                            for v in range(kw):
                                tap = taps[u * kw + v]
                                window = dxp[row + v * dw:row + v * dw + span:sw]
                                for j in range(wo):
                                    window[j] += tap * grad[j]
            if need_dx:
                for r in range(h):
                    row = (r + ph) * wp + pw
                    for s in range(wd):
                        dx[n, c, r, s] = dxp[row + s]


@_jit
def _image_sums(partial, dw):
    """dw (K, kh*kw) = partial (N, K, kh*kw) summed over images in order, in float32."""
    n_img, k_out, taps = partial.shape
    for k in prange(k_out):
        for e in range(taps):
            total = np.float32(0.0)
            for n in range(n_img):
                total += partial[n, k, e]
            dw[k, e] = total


def _planes_per_task(x_shape):
    """(image, channel) planes a task takes: about eight tasks a thread, so a task's buffers are
    allocated a few times a call, not once a plane (mobilenet_v2's 4x4 layers: 30,720 planes of 16
    values at batch 32), and a thread left behind by another tenant holds an eighth of its share.
    Results do not depend on it: each plane's sums are its own."""
    return max(1, x_shape[0] * x_shape[1] // (8 * numba.get_num_threads()))


class DepthwiseConvs:
    """The depthwise convolutions of a CPU device, as devices/dnnl_conv.py's DirectConvs are
    called (a block's tail adds the bias, applies the activation and the pool, and sums dB):
    float32, or bf16 operands with float32 sums (`bf16`)."""

    def __init__(self, bf16):
        self.bf16 = bool(bf16)

    @staticmethod
    def declines(x_shape, w_shape, stride, padding, dilation=(1, 1), groups=1):
        """'' where the conv is depthwise (groups == input channels, one input channel a
        kernel), else why not."""
        c = x_shape[1]
        if groups != c or w_shape[1] != 1:
            return f"not depthwise: {groups} groups of {w_shape[1]} input channels, {c} channels in all"
        return ""

    @staticmethod
    def src_nbytes(x_shape, w_shape, stride, padding, dilation=(1, 1), groups=1):
        """Nothing is kept from forward for backward but the input itself."""
        return 0

    def forward(self, x, w, stride, padding, y, saved_src=None, dilation=(1, 1), groups=1):
        """y (N, K, Ho, Wo), float32 C-contiguous = conv(x, w), no bias."""
        x, w = np.ascontiguousarray(x, np.float32), np.ascontiguousarray(w, np.float32)
        _forward(x, x.view(np.uint32), w, w.view(np.uint32), *stride, *padding, *dilation, self.bf16,
                 _planes_per_task(x.shape), y)
        return y

    def backward(self, x, w, dy, stride, padding, need_dx, dw, saved_src=None, dilation=(1, 1), groups=1,
                 on_dx=None):
        """dx (N, C, H, W) or None where not asked; dW into dw (K, 1, kh, kw) float32
        C-contiguous. The bias's gradient is the caller's (from the float32 dY). dX and dW come
        from one pass here: on_dx (where given) gets dx at the end."""
        x, w = np.ascontiguousarray(x, np.float32), np.ascontiguousarray(w, np.float32)
        dy = np.ascontiguousarray(dy, np.float32)
        k, _, kh, kw = w.shape
        dx = np.empty(x.shape, np.float32) if need_dx else np.empty((0, 0, 0, 0), np.float32)
        partial = np.empty((x.shape[0], k, kh * kw), np.float32)
        _backward(x, x.view(np.uint32), w, w.view(np.uint32), dy, dy.view(np.uint32), *stride, *padding, *dilation,
                  self.bf16, bool(need_dx), _planes_per_task(x.shape), dx, partial)
        _image_sums(partial, dw.reshape(k, kh * kw))
        if need_dx and on_dx is not None:
            on_dx(dx)
        return dx if need_dx else None
