"""The GEMMs of the CPU device's shifted path (cpu_gemm_paths.GemmPaths._shifted_forward), by
library and precision: one object per path, as devices/cpu_gemms.py is for the im2col path.

Every GEMM of the path is `out = a @ b + beta * out`, beta 0 or 1, on row-major blocks of the
width expansion xv and dY and on transposed views of the kernel rows:

    forward        Y (rows, Kp)     += xv window u @ W_u.T       one per kernel row u
    weight_grad    dW_u (K, C*kw)    = dY.T @ xv window u         (+= for a later chunk)
    data_grad      dxv window u     += dY @ W_u                   folded back along the width once

- "shifted": numpy's matmul on OpenBLAS, sgemm with beta = 1 for the sums (devices/blas.py).
- "shifted-dnnl": oneDNN's sgemm. Where the environment holds OpenBLAS to its Haswell kernel
  this is the AVX-512 GEMM; on small 3x3 layers it also threads the thin GEMMs differently.
- "shifted-bf16": the `--precision bf16` policy on this layout: the input (before its
  expansion, so xv is bf16 and half the bytes), the kernel rows and dY rounded to bf16 once each,
  products summed in float32 by oneDNN's gemm_bf16bf16f32; Y, dX, dW, the bias, the activation
  and the pool float32. dxv cannot reuse the bf16 expansion, so it takes a float32 work buffer
  of its own (the size of a float32 expansion). The roundings are elementwise, as the im2col-bf16
  path's, so both paths round the same values.
"""
import numpy as np

from hetconv.devices import dnnl
from hetconv.devices.cpu_gemms import scratch16


class ShiftedBlasGemms:
    """numpy's matmul (OpenBLAS)."""

    path = "shifted"
    dtype = np.float32          # of the expansion, the kernel rows and dY as the GEMMs read them

    def __init__(self, device):
        self.device = device

    def input(self, x):
        """What the expansion reads: the layer input as the GEMMs take it."""
        return x

    def kernel_rows(self, wu):
        return wu

    def grad(self, dyt):
        return dyt

    def expansion(self, shape):
        """A work buffer for one chunk's expansion."""
        return self.device._scratch("cols", shape)

    def dxv(self, xv):
        """Where dX's products land: over the chunk's expansion, which backward is done with."""
        return xv

    def gemm(self, a, b, out, beta, work):
        """out = a @ b + beta * out; `work` names a work buffer where the sum cannot run in one call."""
        if beta == 0.0:
            np.matmul(a, b, out=out)
        else:
            self.device._matmul_add(a, b, out, work)


class ShiftedDnnlGemms(ShiftedBlasGemms):
    """oneDNN's sgemm, on the device's threads."""

    path = "shifted-dnnl"

    def __init__(self, device, lib):
        super().__init__(device)
        self.lib = lib

    def gemm(self, a, b, out, beta, work):
        self.lib.sgemm(a, b, out, beta, self.device.threads)


class ShiftedBf16Gemms(ShiftedDnnlGemms):
    """bf16 operands, float32 sums: oneDNN's gemm_bf16bf16f32, or where the CPU has none
    (`emulated`) its emulation, dnnl.Dnnl.emulated_gemm_bf16."""

    path = "shifted-bf16"
    dtype = np.uint16

    def __init__(self, device, lib, emulated=False):
        super().__init__(device, lib)
        self.gemm_bf16 = lib.emulated_gemm_bf16 if emulated else lib.gemm_bf16

    def input(self, x):
        return dnnl.to_bf16(x, scratch16(self.device, "x_bf16", x.shape))

    def kernel_rows(self, wu):
        return dnnl.to_bf16(wu)        # (kh, Kp, C*kw): small, kept by the forward's context

    def grad(self, dyt):
        return dnnl.to_bf16(dyt, scratch16(self.device, "dy_bf16", dyt.shape))

    def expansion(self, shape):
        return scratch16(self.device, "cols", shape)

    def dxv(self, xv):
        return self.device._scratch("dcols", xv.shape)

    def gemm(self, a, b, out, beta, work):
        self.gemm_bf16(a, b, out, beta, self.device.threads)
