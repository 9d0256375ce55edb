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


@_jit
def _forward(x, x_bits, w, w_bits, sh, sw, ph, pw, dh, dw, bf16, y):
    """y (N, K, Ho, Wo) = the depthwise conv of x (N, C, H, W) with w (K, 1, kh, kw), no bias."""
    n_img, c_in, h, wd = x.shape
    k_out, kh, kw = w.shape[0], w.shape[2], w.shape[3]
    m = k_out // c_in
    ho, wo = y.shape[2], y.shape[3]
    wp = wd + 2 * pw
    for t in prange(n_img * c_in):
        n, c = t // c_in, t % c_in
        xp = np.empty((h + 2 * ph) * wp, np.float32)
        _padded_plane(x, x_bits, n, c, ph, pw, bf16, xp)
        taps = np.empty(kh * kw, np.float32)
        acc = np.empty(wo, np.float32)
        for q in range(m):
            k = c * m + q
            _kernel_taps(w, w_bits, k, bf16, taps)
            for i in range(ho):
                acc[:] = 0.0
                for u in range(kh):
                    row = (i * sh + u * dh) * wp
                    for v in range(kw):
                        tap = taps[u * kw + v]
                        base = row + v * dw
                        if sw == 1:             # contiguous: vectorized
                            for j in range(wo):
                                acc[j] += tap * xp[base + j]
                        else:
                            for j in range(wo):
                                acc[j] += tap * xp[base + j * sw]
                for j in range(wo):
                    y[n, k, i, j] = acc[j]


@_jit
def _backward(x, x_bits, w, w_bits, dy, dy_bits, sh, sw, ph, pw, dh, dw, bf16, need_dx, dx, partial):
    """dx (N, C, H, W) where need_dx, and partial (N, K, kh*kw): each image's dW, for dY (N, K,
    Ho, Wo). Parallel over (image, input channel), each plane's sums in a fixed order."""
    n_img, c_in, h, wd = x.shape
    k_out, kh, kw = w.shape[0], w.shape[2], w.shape[3]
    m = k_out // c_in
    ho, wo = dy.shape[2], dy.shape[3]
    hp, wp = h + 2 * ph, wd + 2 * pw
    for t in prange(n_img * c_in):
        n, c = t // c_in, t % c_in
        xp = np.empty(hp * wp, np.float32)
        _padded_plane(x, x_bits, n, c, ph, pw, bf16, xp)
        dyp = np.empty(ho * wo, np.float32)
        dxp = np.zeros(hp * wp if need_dx else 0, np.float32)
        taps = np.empty(kh * kw, np.float32)
        acc = np.empty(wo, np.float32)
        for q in range(m):
            k = c * m + q
            if bf16:
                dyp_bits = dyp.view(np.uint32)
                for i in range(ho):
                    for j in range(wo):
                        dyp_bits[i * wo + j] = np.uint32(_bf16_of_bits(dy_bits[n, k, i, j])) << 16
            else:
                for i in range(ho):
                    for j in range(wo):
                        dyp[i * wo + j] = dy[n, k, i, j]
            for u in range(kh):
                for v in range(kw):
                    acc[:] = 0.0
                    for i in range(ho):
                        base = (i * sh + u * dh) * wp + v * dw
                        if sw == 1:
                            for j in range(wo):
                                acc[j] += dyp[i * wo + j] * xp[base + j]
                        else:
                            for j in range(wo):
                                acc[j] += dyp[i * wo + j] * xp[base + j * sw]
                    total = np.float32(0.0)
                    for j in range(wo):
                        total += acc[j]
                    partial[n, k, u * kw + v] = total
            if need_dx:
                _kernel_taps(w, w_bits, k, bf16, taps)
                for i in range(ho):
                    for u in range(kh):
                        row = (i * sh + u * dh) * wp
                        for v in range(kw):
                            tap = taps[u * kw + v]
                            base = row + v * dw
                            if sw == 1:
                                for j in range(wo):
                                    dxp[base + j] += tap * dyp[i * wo + j]
                            else:
                                for j in range(wo):
                                    dxp[base + j * sw] += tap * dyp[i * wo + j]
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
        _forward(x, x.view(np.uint32), w, w.view(np.uint32), *stride, *padding, *dilation, self.bf16, y)
        return y

    def backward(self, x, w, dy, stride, padding, need_dx, dw, saved_src=None, dilation=(1, 1), groups=1):
        """dx (N, C, H, W) or None where not asked; dW into dw (K, 1, kh, kw) float32
        C-contiguous. The bias's gradient is the caller's (from the float32 dY)."""
        x, w = np.ascontiguousarray(x, np.float32), np.ascontiguousarray(w, np.float32)
        dy = np.ascontiguousarray(dy, np.float32)
        k, _, kh, kw = w.shape
        dx = np.empty(x.shape, np.float32) if need_dx else np.empty((0, 0, 0, 0), np.float32)
        partial = np.empty((x.shape[0], k, kh * kw), np.float32)
        _backward(x, x.view(np.uint32), w, w.view(np.uint32), dy, dy.view(np.uint32), *stride, *padding, *dilation,
                  self.bf16, bool(need_dx), dx, partial)
        _image_sums(partial, dw.reshape(k, kh * kw))
        return dx if need_dx else None
