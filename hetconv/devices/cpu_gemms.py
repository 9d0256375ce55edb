"""The three GEMMs of the CPU device's im2col path, by library and precision: one object per path.

    forward        Y (K, P)       = W (K, C*kh*kw) @ cols.T      cols (P, C*kh*kw): the im2col
    weight_grad    dW (K, C*kh*kw) = dY (K, P) @ cols               (+= for a later chunk)
    data_grad      dcols (P, C*kh*kw) = dY.T @ W                    folded back by col2im

A grouped conv runs them once per group, on views (a group's kernel rows of W, Y, dY and dW; its
input channels' columns of cols and dcols): data_grad_into writes a group's dcols into one.

- "im2col": numpy's matmul on OpenBLAS (and sgemm with beta = 1 for the sums, devices/blas.py).
- "im2col-dnnl": the same GEMMs in oneDNN's sgemm (devices/dnnl.py): as fast as OpenBLAS's
  AVX-512 kernel on the paper's conv2, 2x an OpenBLAS held to its Haswell kernel.
- "im2col-bf16": the `--precision bf16` path (PyTorch autocast's policy): the input, the weights
  and dY rounded to bf16 (to nearest even), each product summed in float32 by oneDNN's
  gemm_bf16bf16f32; Y, dX, dW, the bias, the activation, the pool and the update stay float32.
  The input is rounded once per call and the im2col written in bf16 from it (half the bytes of
  the float32 one, which it replaces, also where forward keeps it for backward); dY is rounded
  once per chunk and serves both backward GEMMs. What it costs beyond the GEMMs: a pass over the
  input, over the weights (forward and, for dX, backward) and over dY, and dcols needs a float32
  buffer of its own (the bf16 im2col cannot hold it).
Every rounding is elementwise, so a bf16 step rounds the same values whatever the split of
kernels or images among devices.
"""
import numpy as np

from hetconv.devices import dnnl


def scratch16(device, name, shape):
    """A uint16 work buffer kept between calls, carved from the device's float32 ones."""
    size = int(np.prod(shape))
    return device._scratch(name, ((size + 1) // 2,)).view(np.uint16)[:size].reshape(shape)


class BlasGemms:
    """numpy's matmul (OpenBLAS): the device's path without oneDNN."""

    path = "im2col"
    cols_dtype = np.float32

    def __init__(self, device):
        self.device = device

    def input(self, x):
        """What im2col reads: the layer input as the GEMMs take it."""
        return x

    def weights(self, w2):
        return w2

    def grad(self, dy):
        return dy

    def forward(self, w2, cols, y):
        np.matmul(w2, cols.T, out=y)            # the FLOPs: (K, ckk) x (ckk, rows)

    def weight_grad(self, dy, cols, dw, add):
        if add:
            self.device._matmul_add(dy, cols, dw, "dw")
        else:
            np.matmul(dy, cols, out=dw)         # (K, rows) x (rows, ckk)

    def data_grad(self, dy, w2, cols):
        """dcols, written over this chunk's im2col."""
        np.matmul(dy.T, w2, out=cols)
        return cols

    def data_grad_into(self, dy, w2, dcols):
        """dcols (float32, a view: one group's columns) = dY.T @ W."""
        np.matmul(dy.T, w2, out=dcols)


class DnnlGemms(BlasGemms):
    """oneDNN's sgemm, on the device's threads."""

    path = "im2col-dnnl"

    def __init__(self, device, lib):
        super().__init__(device)
        self.lib = lib

    def forward(self, w2, cols, y):
        self.lib.sgemm(w2, cols.T, y, 0.0, self.device.threads)

    def weight_grad(self, dy, cols, dw, add):
        self.lib.sgemm(dy, cols, dw, 1.0 if add else 0.0, self.device.threads)

    def data_grad(self, dy, w2, cols):
        self.lib.sgemm(dy.T, w2, cols, 0.0, self.device.threads)
        return cols

    def data_grad_into(self, dy, w2, dcols):
        self.lib.sgemm(dy.T, w2, dcols, 0.0, self.device.threads)


class Bf16Gemms(DnnlGemms):
    """bf16 operands, float32 sums: oneDNN's gemm_bf16bf16f32, or where the CPU has none
    (`emulated`) its emulation, dnnl.Dnnl.emulated_gemm_bf16."""

    path = "im2col-bf16"
    cols_dtype = np.uint16

    def __init__(self, device, lib, emulated=False):
        super().__init__(device, lib)
        self.gemm_bf16 = lib.emulated_gemm_bf16 if emulated else lib.gemm_bf16

    def input(self, x):
        return dnnl.to_bf16(x, scratch16(self.device, "x_bf16", x.shape))

    def weights(self, w2):
        return dnnl.to_bf16(w2)               # (K, ckk): small, and a fresh array the caller may keep

    def grad(self, dy):
        return dnnl.to_bf16(dy, scratch16(self.device, "dy_bf16", dy.shape))

    def forward(self, w2, cols, y):
        self.gemm_bf16(w2, cols.T, y, 0.0, self.device.threads)

    def weight_grad(self, dy, cols, dw, add):
        self.gemm_bf16(dy, cols, dw, 1.0 if add else 0.0, self.device.threads)

    def data_grad(self, dy, w2, cols):
        dcols = self.device._scratch("dcols", cols.shape)
        self.gemm_bf16(dy.T, w2, dcols, 0.0, self.device.threads)
        return dcols

    def data_grad_into(self, dy, w2, dcols):
        self.gemm_bf16(dy.T, w2, dcols, 0.0, self.device.threads)
