"""`--device cuda:N`: conv layers on one NVIDIA GPU, with numba.cuda kernels.

Design. Every convolution is a GEMM over an implicit im2col: the kernels gather the im2col
operand straight from the NCHW tensor while filling shared memory, so im2col never exists in
global memory. One tiled GEMM kernel body serves all three products:

    forward     y[k, (n,i,j)]     = sum over (c,u,v) of w[k, (c,u,v)] * im2col(x)[(c,u,v), (n,i,j)]
    input grad  dx[c, (n,h,w)]    = sum over (k,u,v) of w[k,c,u,v] * dy[n, k, (h+ph-u*dh)/sh, (w+pw-v*dw)/sw]
    weight grad dw[k, (c,u,v)]    = sum over (n,i,j) of dy[n,k,i,j] * im2col(x)[(c,u,v), (n,i,j)]

where im2col(x)[(c,u,v), (n,i,j)] = x[n, c, i*sh+u*dh-ph, j*sw+v*dw-pw] (zero outside x), with
dilation (dh, dw), and the input gradient's term exists only where (h+ph-u*dh)/sh and
(w+pw-v*dw)/sw are whole and inside dy: each input pixel gathers from the outputs whose window
covers it. With stride s, that GEMM walks s*s times the reduction it needs (the other terms are
zeros it skips loading but still multiplies).

A conv of G groups (weights (K, C/G, kh, kw), as PyTorch's) is G of these GEMMs side by side, one
per blockIdx.z (times the weight gradient's splits): in group q, kernels q*K/G .. (q+1)*K/G - 1
read input channels q*C/G .. (q+1)*C/G - 1, and k and c above count within the group. Groups and
dilation are values of the geometry, not branches: a dense conv runs the same kernels as group 0
of 1 at dilation 1, for a few integer multiply-adds per element gathered. A depthwise conv
(K/G = 1 kernel a group) fills one row of each 64-row output tile: correct, at 1/64 of the
tile's arithmetic.

A block of 16x16 threads computes a 64x64 output tile, each thread a 4x4 register tile, walking
the reduction in steps of 16 through two shared-memory tiles (16x64 each, one column of padding
against bank conflicts). Each operand is loaded so that consecutive threads read consecutive
addresses: along the output pixels for x and dy, along the reduction for w and for the
weight-gradient operands. The weight gradient reduces over N*Ho*Wo while its output is small,
so it is split along the reduction (split-K, blockIdx.z) into per-split partial sums, then
added in a fixed order: deterministic, no atomics. The bias joins in the forward epilogue; the
activation and the pool run in a second kernel; the pre-activation y makes one round trip through
global memory for it. The paper's block (stride 1, ReLU, 2x2 stride-2 max-pool) has its own pool
kernel that records which element of each window won (int8, -1 when ReLU cut it). Any other
block (ReLU or none; max, average or no pool with any kernel, stride and padding, PyTorch's
floor mode) runs one generic kernel per pooled output; its max-pool records the window index of
the first maximum (int32, -1 when ReLU cut it), and its backward is a gather, one thread per
pre-activation element summing the pooled outputs whose window covers it, in a fixed order:
overlapping windows add up deterministically, no atomics. ReLU before an average pool (or no
pool) keeps y for the backward: 4 bytes per conv output. Costs of this design: every gathered
element pays some integer index math (divisions by kh*kw and Ho*Wo), and a tile of 64 kernels
idles rows when a worker holds few. The bias gradient is the weight-gradient GEMM's one extra column,
whose B operand is all ones (db = dy @ 1), so it costs no pass of its own. Pool backward and the
optimizer updates (SGD, AdamW, the sum of squares for gradient clipping) are small elementwise
kernels.

Resident on the GPU between steps: weights, biases, optimizer state (SGD's momentum, AdamW's
moments), and the backward context of the fused forward (the layer input x and the pooling
winners, or y where ReLU needs it). Only layer inputs, pooled outputs, their gradients and dx
cross PCIe.
"""
import math
import operator
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, float64, int8, int32, int64, types
from numba.cuda import libdevice
from numba.core.extending import intrinsic
from numba.cuda.core import config as cuda_config

from hetconv.devices import cuda_channelwise
from hetconv.devices.base import (ConvBlock, Device, DeviceError, _as_f32, block_output_shape, conv_output_shape,
                                  update_rules)

# ---- tile sizes ----------------------------------------------------------------------------
# Under Numba's CUDA simulator every GPU thread is a Python thread, so blocks shrink (same
# kernels, same code paths): tests then cover several tiles per dimension on tiny shapes.
SIMULATED = bool(cuda_config.ENABLE_CUDASIM)
THREADS_X = 4 if SIMULATED else 16  # threads per block along output columns
THREADS_Y = 4 if SIMULATED else 16  # threads per block along output rows
MICRO_M = 4                         # output rows per thread (strided by THREADS_Y)
MICRO_N = 4                         # output columns per thread (strided by THREADS_X)
TILE_R = 8 if SIMULATED else 16     # reduction step held in shared memory
THREADS = THREADS_X * THREADS_Y
TILE_M = THREADS_Y * MICRO_M        # output rows per block (64 on a GPU, 16 simulated)
TILE_N = THREADS_X * MICRO_N        # output columns per block (64 on a GPU, 16 simulated)
A_ROW = TILE_M + 1                  # shared-memory row length: one column of padding against
B_ROW = TILE_N + 1                  # bank conflicts when threads store along the reduction
A_LOADS = TILE_R * TILE_M // THREADS    # elements of the A tile each thread loads per step
B_LOADS = TILE_R * TILE_N // THREADS
ELEMENTWISE_THREADS = 32 if SIMULATED else 256      # block of the 1-D elementwise kernels
BLOCK_2D = (8, 4) if SIMULATED else (32, 8)         # block of the 2-D elementwise kernels

# Split-K for the weight gradient: aim for this many blocks in flight (a few per SM on an
# H100's 132 SMs), but give each split at least this many reduction terms, so the partial
# sums (splits * K * C*kh*kw floats) stay small next to the work.
WGRAD_TARGET_BLOCKS = 512
WGRAD_MIN_R_PER_SPLIT = 1024

_ZERO = np.float32(0)
_ONE = np.float32(1)

# geometry, one int32 tuple passed to every conv kernel:
# (N, C, H, W, K, KH, KW, HO, WO, PH, PW, SH, SW, DH, DW, CG, KG): padding (PH, PW), stride
# (SH, SW), dilation (DH, DW), and per group CG = C/groups input channels and KG = K/groups
# kernels (a dense conv: dilation 1, CG = C, KG = K).
# Index math is 32-bit: a 64-bit integer division is a ~70-instruction software routine on the
# GPU, and the gathers divide by kh*kw and Ho*Wo for every element they load.
GEOMETRY = types.UniTuple(int32, 17)
INDEX_LIMIT = 2**31 - 1


def _geometry(x_shape, w_shape, stride, padding, dilation=(1, 1), groups=1):
    """The conv kernels' int32 geometry; stride, padding and dilation are (h, w) pairs, and
    groups divides C and K, all already checked."""
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    n, c, h, w = x_shape
    k, cg, kh, kw = w_shape
    _, _, ho, wo = conv_output_shape(x_shape, w_shape, stride=(sh, sw), padding=(ph, pw), dilation=(dh, dw),
                                     groups=groups)
    g = tuple(int(v) for v in (n, c, h, w, k, kh, kw, ho, wo, ph, pw, sh, sw, dh, dw, cg, k // groups))
    # every flat index the kernels form is below one of these: tensor sizes, GEMM extents, and
    # the padded input's extent that the input gradient's index math reaches
    largest = max(n * c * h * w, n * k * ho * wo, k * cg * kh * kw, h + ph, w + pw,
                  *_forward_dims(g), *_input_grad_dims(g), *_weight_grad_dims(g))
    if largest > INDEX_LIMIT:
        raise DeviceError(f"conv too large for 32-bit indices: {largest} elements > {INDEX_LIMIT} "
                          f"(x {tuple(x_shape)!r}, w {tuple(w_shape)!r}); split the batch")
    if groups > cuda_channelwise.GRID_YZ_LIMIT:     # one group per blockIdx.z
        raise DeviceError(f"a conv on {cuda_channelwise.GRID_YZ_LIMIT} groups at most runs on the GPU, got {groups}")
    return tuple(np.int32(v) for v in g)


# ---- GEMM sizes (M rows, N columns, R reduction) of one group, host and device ---------------
# A grouped conv is `groups` independent GEMMs of these sizes, one per blockIdx.z (times the
# weight gradient's splits); a dense conv is one.
def _forward_dims(g):
    n, c, h, w, k, kh, kw, ho, wo, ph, pw, sh, sw, dh, dw, cg, kg = g
    return kg, n * ho * wo, cg * kh * kw


def _input_grad_dims(g):
    n, c, h, w, k, kh, kw, ho, wo, ph, pw, sh, sw, dh, dw, cg, kg = g
    return cg, n * h * w, kg * kh * kw


def _weight_grad_dims(g):
    n, c, h, w, k, kh, kw, ho, wo, ph, pw, sh, sw, dh, dw, cg, kg = g
    return kg, cg * kh * kw + 1, n * ho * wo      # the extra column is db


_forward_dims_dev = cuda.jit(device=True)(_forward_dims)
_input_grad_dims_dev = cuda.jit(device=True)(_input_grad_dims)
_weight_grad_dims_dev = cuda.jit(device=True)(_weight_grad_dims)


# ---- index math shared by the kernels ------------------------------------------------------
if SIMULATED:
    @cuda.jit(device=True)
    def _udiv32(a, b):
        """a // b for indices (a >= 0, b > 0, both below 2**31); the simulator runs Python."""
        return a // b
else:
    @intrinsic
    def _udiv32(typingctx, a, b):
        """a // b for indices (a >= 0, b > 0, both below 2**31) as one 32-bit unsigned division:
        Numba widens integer arithmetic to int64, and even int32 operands get a 64-bit div.s64
        (a software routine on the GPU) plus a floor fix-up for negative values."""
        def codegen(context, builder, sig, args):
            a32, b32 = (context.cast(builder, v, t, int32) for v, t in zip(args, sig.args))
            return builder.udiv(a32, b32)
        return int32(a, b), codegen


@cuda.jit(device=True)
def _divmod32(a, b):
    """(a // b, a % b) for indices, one 32-bit division."""
    q = _udiv32(a, b)
    return q, a - q * b


@cuda.jit(device=True)
def _split3(flat, mid, last):
    """flat index over (outer, mid, last) -> (outer, m, l)."""
    outer, rest = _divmod32(flat, mid * last)
    m, l = _divmod32(rest, last)
    return outer, m, l


@cuda.jit(device=True)
def _im2col(x, g, group, tap, pixel):
    """im2col(x)[(c,u,v), (n,i,j)] of a group = x padded at [n, group*CG + c, i*sh + u*dh, j*sw + v*dw];
    zero in the padding."""
    n, c, h, w, k, kh, kw, ho, wo, ph, pw, sh, sw, dh, dw, cg, kg = g
    ci, u, v = _split3(tap, kh, kw)
    ni, i, j = _split3(pixel, ho, wo)
    row, col = i * sh + u * dh - ph, j * sw + v * dw - pw
    if 0 <= row < h and 0 <= col < w:
        return x[ni, group * cg + ci, row, col]
    return _ZERO


@cuda.jit(device=True)
def _covering_output(pos, pad, offset, stride, size):
    """The output index o whose window puts the kernel tap at `offset` (tap times dilation) on
    input position `pos` (o*stride + offset - pad == pos), or -1 where there is none."""
    t = pos + pad - offset
    if t < 0:
        return -1
    o = t
    if stride != 1:         # uniform across a launch: stride 1 pays no division
        o, rest = _divmod32(t, stride)
        if rest != 0:
            return -1
    if o >= size:
        return -1
    return o


# Every operand below is a group's: `group` offsets the kernel index by group*KG and the
# channel index by group*CG (0 for a dense conv: one multiply-add per element loaded, next to
# the two divisions each gather already pays).

# forward: A = w viewed as (K, CG*kh*kw), B = im2col(x), C = y (+ bias)
@cuda.jit(device=True)
def _forward_a(w2, g, group, kernel, tap):
    n, c, h, w, k, kh, kw, ho, wo, ph, pw, sh, sw, dh, dw, cg, kg = g
    return w2[group * kg + kernel, tap]


@cuda.jit(device=True)
def _forward_b(x, g, group, tap, pixel):
    return _im2col(x, g, group, tap, pixel)


@cuda.jit(device=True)
def _forward_store(y, bias, g, group, kernel, pixel, split, value):
    n, c, h, w, k, kh, kw, ho, wo, ph, pw, sh, sw, dh, dw, cg, kg = g
    ni, i, j = _split3(pixel, ho, wo)
    ki = group * kg + kernel
    y[ni, ki, i, j] = value + bias[ki]


# input grad: A[c, (k,u,v)] = w[k,c,u,v], B[(k,u,v), (n,h,w)] = dy[n, k, (h+ph-u*dh)/sh, (w+pw-v*dw)/sw]
# where both quotients are whole and inside dy, else zero
@cuda.jit(device=True)
def _input_grad_a(w, g, group, channel, tap):
    n, c, h, wd, k, kh, kw, ho, wo, ph, pw, sh, sw, dh, dw, cg, kg = g
    ki, u, v = _split3(tap, kh, kw)
    return w[group * kg + ki, channel, u, v]


@cuda.jit(device=True)
def _input_grad_b(dy, g, group, tap, pixel):
    n, c, h, w, k, kh, kw, ho, wo, ph, pw, sh, sw, dh, dw, cg, kg = g
    ki, u, v = _split3(tap, kh, kw)
    ni, row, col = _split3(pixel, h, w)
    i = _covering_output(row, ph, u * dh, sh, ho)
    j = _covering_output(col, pw, v * dw, sw, wo)
    if i >= 0 and j >= 0:
        return dy[ni, group * kg + ki, i, j]
    return _ZERO


@cuda.jit(device=True)
def _input_grad_store(dx, bias, g, group, channel, pixel, split, value):
    n, c, h, w, k, kh, kw, ho, wo, ph, pw, sh, sw, dh, dw, cg, kg = g
    ni, row, col = _split3(pixel, h, w)
    dx[ni, group * cg + channel, row, col] = value


# weight grad: A[k, (n,i,j)] = dy[n,k,i,j], B[(n,i,j), (c,u,v)] = im2col(x)[(c,u,v), (n,i,j)],
# and B's last column, tap = CG*kh*kw, is all ones: that output column is db
@cuda.jit(device=True)
def _weight_grad_a(dy, g, group, kernel, pixel):
    n, c, h, w, k, kh, kw, ho, wo, ph, pw, sh, sw, dh, dw, cg, kg = g
    ni, i, j = _split3(pixel, ho, wo)
    return dy[ni, group * kg + kernel, i, j]


@cuda.jit(device=True)
def _weight_grad_b(x, g, group, pixel, tap):
    n, c, h, w, k, kh, kw, ho, wo, ph, pw, sh, sw, dh, dw, cg, kg = g
    if tap == cg * kh * kw:
        return _ONE
    return _im2col(x, g, group, tap, pixel)


@cuda.jit(device=True)
def _weight_grad_store(partial, bias, g, group, kernel, tap, split, value):
    n, c, h, w, k, kh, kw, ho, wo, ph, pw, sh, sw, dh, dw, cg, kg = g
    partial[split, group * kg + kernel, tap] = value


def _implicit_gemm(gemm_dims, load_a, load_b, store, a_along_r, b_along_r):
    """A tiled GEMM kernel out = A @ B whose operands are gathered by load_a(a_src, g, group, m, r)
    and load_b(b_src, g, group, r, n) and whose result goes through
    store(out, bias, g, group, m, n, split, value), m, n and r counted within the group.
    a_along_r / b_along_r: the operand is contiguous along the reduction, so consecutive threads
    load consecutive r (otherwise consecutive m or n). blockIdx.z is group * splits + split: the
    group's GEMM, and the slice of its reduction of r_per_split terms (split-K)."""

    def kernel(a_src, b_src, out, bias, g, r_per_split):
        m_size, n_size, r_size = gemm_dims(g)
        a_tile = cuda.shared.array((TILE_R, A_ROW), float32)   # a_tile[r, m]
        b_tile = cuda.shared.array((TILE_R, B_ROW), float32)   # b_tile[r, n]
        acc = cuda.local.array((MICRO_M, MICRO_N), float32)
        a_frag = cuda.local.array(MICRO_M, float32)
        b_frag = cuda.local.array(MICRO_N, float32)
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        tid = ty * THREADS_X + tx
        m0 = cuda.blockIdx.y * TILE_M
        n0 = cuda.blockIdx.x * TILE_N
        # one 32-bit division per block; a launch without split-K has r_per_split = r_size
        group, split = _divmod32(cuda.blockIdx.z, _udiv32(r_size + r_per_split - 1, r_per_split))
        r_begin = split * r_per_split
        r_end = min(r_begin + r_per_split, r_size)
        for a in range(MICRO_M):
            for b in range(MICRO_N):
                acc[a, b] = 0

        for r0 in range(r_begin, r_end, TILE_R):
            for t in range(A_LOADS):
                e = tid + t * THREADS
                if a_along_r:
                    rr, mm = e % TILE_R, e // TILE_R
                else:
                    rr, mm = e // TILE_M, e % TILE_M
                if m0 + mm < m_size and r0 + rr < r_end:
                    a_tile[rr, mm] = load_a(a_src, g, group, m0 + mm, r0 + rr)
                else:
                    a_tile[rr, mm] = 0
            for t in range(B_LOADS):
                e = tid + t * THREADS
                if b_along_r:
                    rr, nn = e % TILE_R, e // TILE_R
                else:
                    rr, nn = e // TILE_N, e % TILE_N
                if n0 + nn < n_size and r0 + rr < r_end:
                    b_tile[rr, nn] = load_b(b_src, g, group, r0 + rr, n0 + nn)
                else:
                    b_tile[rr, nn] = 0
            cuda.syncthreads()
            for rr in range(TILE_R):
                for a in range(MICRO_M):
                    a_frag[a] = a_tile[rr, ty + a * THREADS_Y]
                for b in range(MICRO_N):
                    b_frag[b] = b_tile[rr, tx + b * THREADS_X]
                for a in range(MICRO_M):
                    for b in range(MICRO_N):
                        acc[a, b] += a_frag[a] * b_frag[b]
            cuda.syncthreads()   # the tiles are overwritten next step

        for a in range(MICRO_M):
            m = m0 + ty + a * THREADS_Y
            for b in range(MICRO_N):
                n = n0 + tx + b * THREADS_X
                if m < m_size and n < n_size:
                    store(out, bias, g, group, m, n, split, acc[a, b])

    return kernel


_conv_forward_py = _implicit_gemm(_forward_dims_dev, _forward_a, _forward_b, _forward_store,
                                  a_along_r=True, b_along_r=False)
_conv_input_grad_py = _implicit_gemm(_input_grad_dims_dev, _input_grad_a, _input_grad_b, _input_grad_store,
                                     a_along_r=True, b_along_r=False)
_conv_weight_grad_py = _implicit_gemm(_weight_grad_dims_dev, _weight_grad_a, _weight_grad_b, _weight_grad_store,
                                      a_along_r=True, b_along_r=True)
conv_forward_kernel = cuda.jit(_conv_forward_py)
conv_input_grad_kernel = cuda.jit(_conv_input_grad_py)
conv_weight_grad_kernel = cuda.jit(_conv_weight_grad_py)


def _weight_grad_finish(partial, dw, db):
    """Adds the split-K partial sums in order s = 0, 1, ... (deterministic) and separates the
    GEMM's columns: dw[k, tap] for the C/groups*kh*kw taps, db[k] from the last column."""
    tap, kernel = cuda.grid(2)
    splits, k, columns = partial.shape
    if kernel < k and tap < columns:
        total = partial[0, kernel, tap]
        for s in range(1, splits):
            total += partial[s, kernel, tap]
        if tap < columns - 1:
            dw[kernel, tap] = total
        else:
            db[kernel] = total


weight_grad_finish_kernel = cuda.jit(_weight_grad_finish)


def _relu_maxpool2(y, pooled, winner):
    """pooled = max of relu(y) over each 2x2 window; winner = row-major index (0..3) of the
    window's first maximum, or -1 where that maximum is <= 0 (ReLU passes no gradient)."""
    pixel, plane = cuda.grid(2)
    nk, kk, hp, wp = pooled.shape
    if pixel < hp * wp and plane < nk * kk:
        ni, ki = _divmod32(plane, kk)
        i, j = _divmod32(pixel, wp)
        best = y[ni, ki, 2 * i, 2 * j]
        arg = 0
        for t in range(1, 4):
            v = y[ni, ki, 2 * i + t // 2, 2 * j + t % 2]
            if v > best:            # strict: the first maximum wins
                best = v
                arg = t
        if best > 0:
            pooled[ni, ki, i, j] = best
            winner[ni, ki, i, j] = arg
        else:
            pooled[ni, ki, i, j] = 0
            winner[ni, ki, i, j] = -1


relu_maxpool2_kernel = cuda.jit(_relu_maxpool2)


def _relu_maxpool2_backward(winner, dpooled, dy):
    """dy (pre-activation) gets each window's gradient at its winner; zero elsewhere, including
    the odd trailing row/column the pool dropped. One thread per dy element: no zero-fill pass."""
    pixel, plane = cuda.grid(2)
    nk, kk, ho, wo = dy.shape
    hp, wp = winner.shape[2], winner.shape[3]
    if pixel < ho * wo and plane < nk * kk:
        ni, ki = _divmod32(plane, kk)
        row, col = _divmod32(pixel, wo)
        i, j = row // 2, col // 2
        value = _ZERO
        if i < hp and j < wp and winner[ni, ki, i, j] == (row % 2) * 2 + col % 2:
            value = dpooled[ni, ki, i, j]
        dy[ni, ki, row, col] = value


relu_maxpool2_backward_kernel = cuda.jit(_relu_maxpool2_backward)

# pool geometry, one int32 tuple passed to the generic activation + pool kernels:
# (PKH, PKW, PSH, PSW, PPH, PPW, RELU, MAX): pool kernel, stride and padding as (h, w), then
# 1 for ReLU (0: no activation) and 1 for a max-pool (0: average, count_include_pad). No pool is
# an average over 1x1 windows of stride 1.
POOL_GEOMETRY = types.UniTuple(int32, 8)


def _activation_pool(y, pooled, winner, pg):
    """pooled = pool(activation(y)), one thread per pooled value. Windows start at i*psh - pph and
    j*psw - ppw; positions outside y are -inf for the max and 0 for the average, which always
    divides by pkh*pkw. Max: winner = row-major window index of the first maximum, -1 where ReLU
    cut it (that maximum is <= 0: no gradient). Average: winner is not written."""
    pixel, plane = cuda.grid(2)
    nk, kk, hp, wp = pooled.shape
    ho, wo = y.shape[2], y.shape[3]
    pkh, pkw, psh, psw, pph, ppw, relu, is_max = pg
    if pixel < hp * wp and plane < nk * kk:
        ni, ki = _divmod32(plane, kk)
        i, j = _divmod32(pixel, wp)
        row0, col0 = i * psh - pph, j * psw - ppw
        best = _ZERO
        arg = -1
        total = _ZERO
        for du in range(pkh):
            row = row0 + du
            if 0 <= row < ho:
                for dv in range(pkw):
                    col = col0 + dv
                    if 0 <= col < wo:
                        v = y[ni, ki, row, col]
                        if is_max:
                            if arg < 0 or v > best:     # strict: the first maximum wins
                                best = v
                                arg = du * pkw + dv
                        elif v > 0 or not relu:
                            total += v
        if is_max:
            if relu and best <= 0:      # relu(y)'s maximum is 0, where ReLU passes no gradient
                pooled[ni, ki, i, j] = 0
                winner[ni, ki, i, j] = -1
            else:
                pooled[ni, ki, i, j] = best
                winner[ni, ki, i, j] = arg
        else:
            pooled[ni, ki, i, j] = total / float32(pkh * pkw)


activation_pool_kernel = cuda.jit(_activation_pool)


@cuda.jit(device=True)
def _covering_windows(pos, kernel, stride, pad, size):
    """First and last pool window (lo, hi) along one axis that covers position `pos`: windows
    o with o*stride - pad <= pos <= o*stride - pad + kernel - 1, within 0..size-1; lo > hi
    when none does."""
    hi = _udiv32(pos + pad, stride)
    if hi > size - 1:
        hi = size - 1
    lo = 0
    t = pos + pad - kernel + 1
    if t > 0:
        lo = _udiv32(t + stride - 1, stride)
    return lo, hi


def _activation_pool_backward(y, winner, dpooled, dy, pg):
    """dy (pre-activation) from dpooled, one thread per dy element: it gathers, in a fixed
    order, every pooled value whose window covers it (overlapping windows add up), then applies
    the activation's derivative. Max: a window's gradient goes to its winner only (ReLU's cut
    is winner -1); average: each covered window gives dpooled / (pkh*pkw), zero where y <= 0
    under ReLU (y is read only then)."""
    pixel, plane = cuda.grid(2)
    nk, kk, ho, wo = dy.shape
    hp, wp = dpooled.shape[2], dpooled.shape[3]
    pkh, pkw, psh, psw, pph, ppw, relu, is_max = pg
    if pixel < ho * wo and plane < nk * kk:
        ni, ki = _divmod32(plane, kk)
        row, col = _divmod32(pixel, wo)
        i_lo, i_hi = _covering_windows(row, pkh, psh, pph, hp)
        j_lo, j_hi = _covering_windows(col, pkw, psw, ppw, wp)
        total = _ZERO
        for i in range(i_lo, i_hi + 1):
            du = row - (i * psh - pph)
            for j in range(j_lo, j_hi + 1):
                if is_max:
                    if winner[ni, ki, i, j] == du * pkw + col - (j * psw - ppw):
                        total += dpooled[ni, ki, i, j]
                else:
                    total += dpooled[ni, ki, i, j]
        if not is_max:
            total = total / float32(pkh * pkw)
            if relu and y[ni, ki, row, col] <= 0:
                total = _ZERO
        dy[ni, ki, row, col] = total


activation_pool_backward_kernel = cuda.jit(_activation_pool_backward)


# ---- optimizer updates ----------------------------------------------------------------------------
# update_rules' arithmetic (written once, in devices/base.py) with libdevice's correctly rounded
# *_rn operations: NVVM contracts a plain a*b + c into one fma.rn, rounded once where the CPU
# device rounds twice (after one SGD step with weight decay, 28% of the velocity's elements then
# differ), but never an operation with an explicit rounding mode. Its sqrt.rn and div.rn are
# IEEE's, as the CPU's.
# The simulator runs kernels as Python, where libdevice is only stubs: there numpy's float32 and
# float64 scalars give the same roundings.
if SIMULATED:
    _UPDATE_ARITHMETIC = (operator.mul, operator.add, operator.truediv, np.sqrt, operator.mul, operator.add)
else:
    _UPDATE_ARITHMETIC = (libdevice.fmul_rn, libdevice.fadd_rn, libdevice.fdiv_rn, libdevice.fsqrt_rn,
                          libdevice.dmul_rn, libdevice.dadd_rn)
_sgd_rule, _adamw_rule, _scale_rule, _square_add = (cuda.jit(device=True)(rule)
                                                    for rule in update_rules(*_UPDATE_ARITHMETIC))


def _sgd(param, velocity, grad, lr, momentum, weight_decay, nesterov):
    i = cuda.grid(1)
    if i < param.shape[0]:
        param[i], velocity[i] = _sgd_rule(param[i], velocity[i], grad[i], lr, momentum, weight_decay, nesterov)


sgd_kernel = cuda.jit(_sgd)


def _adamw(param, exp_avg, exp_avg_sq, grad, decay, grad_decay, lerp_weight, lerp_from_grad, beta2,
           one_minus_beta2,
           bias_correction2_sqrt, eps, step_size):
    i = cuda.grid(1)
    if i < param.shape[0]:
        param[i], exp_avg[i], exp_avg_sq[i] = _adamw_rule(
            param[i], exp_avg[i], exp_avg_sq[i], grad[i], decay, grad_decay, lerp_weight, lerp_from_grad, beta2,
            one_minus_beta2,
            bias_correction2_sqrt, eps, step_size)


adamw_kernel = cuda.jit(_adamw)


def _scale(a, factor):
    i = cuda.grid(1)
    if i < a.shape[0]:
        a[i] = _scale_rule(a[i], factor)


scale_kernel = cuda.jit(_scale)


def _square_sums(a, lanes, rows):
    """lanes[j] = sum of a[i]**2 over i = j (mod len(lanes)), i ascending, in float64: one thread
    per lane, so a warp reads consecutive elements. rows = ceil(len(a) / len(lanes)), from the
    host: a loop to a bound computed here would divide 64-bit integers for its trip count."""
    j = cuda.grid(1)
    width = lanes.shape[0]
    if j < width:
        total = float64(0.0)
        for row in range(rows):
            i = row * width + j
            if i < a.shape[0]:
                total = _square_add(total, float64(a[i]))
        lanes[j] = total


square_sums_kernel = cuda.jit(_square_sums)
# kernels with float64 arithmetic on purpose (tests/test_cuda_ptx.py flags it in any other)
FLOAT64_KERNELS = (_square_sums,)
# kernels whose arithmetic must round as the CPU device's does (tests/test_cuda_ptx.py reads their PTX)
UPDATE_KERNELS = (_sgd, _adamw, _scale, _square_sums)


def _accumulate(total, grad):
    """total += grad, elementwise: micro-batch gradients summed where they live."""
    i = cuda.grid(1)
    if i < total.shape[0]:
        total[i] += grad[i]


accumulate_kernel = cuda.jit(_accumulate)


# ---- signatures of every kernel, as launched; tests compile each to PTX --------------------
_F1 = float32[::1]
_F2 = float32[:, ::1]
_F3 = float32[:, :, ::1]
_F4 = float32[:, :, :, ::1]
_I4 = int8[:, :, :, ::1]
_W4 = int32[:, :, :, ::1]
PTX_SIGNATURES = [
    (_conv_forward_py, (_F2, _F4, _F4, _F1, GEOMETRY, int32)),
    (_conv_input_grad_py, (_F4, _F4, _F4, _F1, GEOMETRY, int32)),
    (_conv_weight_grad_py, (_F4, _F4, _F3, _F1, GEOMETRY, int32)),
    (_weight_grad_finish, (_F3, _F2, _F1)),
    (_relu_maxpool2, (_F4, _F4, _I4)),
    (_relu_maxpool2_backward, (_I4, _F4, _F4)),
    (_activation_pool, (_F4, _F4, _W4, POOL_GEOMETRY)),
    (_activation_pool_backward, (_F4, _W4, _F4, _F4, POOL_GEOMETRY)),
    (_sgd, (_F1, _F1, _F1, float32, float32, float32, types.boolean)),
    (_adamw, (_F1, _F1, _F1, _F1, float32, float32, float32, types.boolean, float32, float32, float32, float32,
              float32)),
    (_scale, (_F1, float32)),
    (_square_sums, (_F1, float64[::1], int64)),
    (_accumulate, (_F1, _F1)),
]


# ---- host side ---------------------------------------------------------------------------------
def _is_device_array(a):
    return hasattr(a, "copy_to_host")


def _pool_geometry(block):
    """POOL_GEOMETRY of a block the generic kernels run; no pool is a 1x1 average."""
    relu = {"relu": 1, "none": 0}[block.activation]
    if block.pool == "none":
        values = (1, 1, 1, 1, 0, 0, relu, 0)
    else:
        values = (*block.pool_kernel, *block.pool_stride, *block.pool_padding, relu,
                  {"max": 1, "avg": 0}[block.pool])
    return tuple(np.int32(v) for v in values)


@dataclass
class _BlockContext:
    """What the fused backward needs, kept on the GPU."""
    x: object               # device (N, C, H, W) float32: the layer input
    w_shape: tuple
    block: ConvBlock
    conv_shape: tuple       # (N, K, Ho, Wo)
    pooled_shape: tuple     # (N, K, Hp, Wp): the block's output
    winner: object          # device int8 (paper pool) or int32 (generic max) winners, -1 = cut by
                            # ReLU; None for an average or no pool
    y: object               # device pre-activation, kept for ReLU before an average or no pool; else None
    pool_geometry: tuple    # POOL_GEOMETRY of the generic kernels; None for the paper pool


class CudaDevice(Device):
    def __init__(self, index, gpu_name):
        self.index = index
        self.name = f"cuda:{index}"
        self.gpu_name = gpu_name
        self._no_bias = cuda.to_device(np.zeros(1, np.float32))   # for kernels that add none
        # stand-ins for the generic pool backward's y and winner where it reads neither
        self._no_y = cuda.to_device(np.zeros((1, 1, 1, 1), np.float32))
        self._no_winner = cuda.to_device(np.zeros((1, 1, 1, 1), np.int32))

    def describe(self):
        return f"{self.name} ({self.gpu_name})"

    # ---- arrays -----------------------------------------------------------------------------
    def upload(self, a):
        return cuda.to_device(np.ascontiguousarray(a, dtype=np.float32))

    def download(self, a):
        if _is_device_array(a):
            return a.copy_to_host()     # note: a CPU-GPU sync point
        return np.asarray(a, dtype=np.float32)

    def zeros_like(self, a):
        # a host-side zero buffer crosses PCIe once: used when optimizer state is created
        return cuda.to_device(np.zeros(tuple(a.shape), np.float32))

    def synchronize(self):
        cuda.synchronize()

    def _resident(self, name, a, shape):
        """A device float32 array of `shape`: device arrays are used as they are, numpy uploaded."""
        if _is_device_array(a):
            if a.dtype != np.float32:
                raise TypeError(f"{name} must be float32, got {a.dtype}")
            if tuple(a.shape) != tuple(shape):
                raise ValueError(f"{name} shape must be {tuple(shape)!r}, got {tuple(a.shape)!r}")
            return a
        a = _as_f32(name, a, len(shape))
        if a.shape != tuple(shape):
            raise ValueError(f"{name} shape must be {tuple(shape)!r}, got {a.shape!r}")
        return cuda.to_device(a)

    # ---- kernel launches --------------------------------------------------------------------
    def _forward(self, x_dev, w_dev, b_dev, stride, padding, dilation=(1, 1), groups=1):
        """y = conv2d(x, w) + b on the device, (N, K, Ho, Wo)."""
        g = _geometry(x_dev.shape, w_dev.shape, stride, padding, dilation, groups)
        m, n, r = _forward_dims(g)      # one group's
        k = int(g[4])
        y = cuda.device_array((int(g[0]), k, int(g[7]), int(g[8])), np.float32)
        grid = (math.ceil(n / TILE_N), math.ceil(m / TILE_M), groups)
        conv_forward_kernel[grid, (THREADS_X, THREADS_Y)](w_dev.reshape(k, r), x_dev, y, b_dev, g, np.int32(r))
        return y

    def _relu_pool(self, y):
        nb, k, ho, wo = y.shape
        pooled = cuda.device_array((nb, k, ho // 2, wo // 2), np.float32)
        winner = cuda.device_array((nb, k, ho // 2, wo // 2), np.int8)
        grid = (math.ceil((ho // 2) * (wo // 2) / BLOCK_2D[0]), math.ceil(nb * k / BLOCK_2D[1]))
        relu_maxpool2_kernel[grid, BLOCK_2D](y, pooled, winner)
        return pooled, winner

    def _activation_pool(self, y, pooled_shape, pg):
        """(pooled, winner or None) of the generic kernel; winner only for a max-pool."""
        nb, k, hp, wp = pooled_shape
        pooled = cuda.device_array(pooled_shape, np.float32)
        winner = cuda.device_array(pooled_shape, np.int32) if pg[7] else None
        grid = (math.ceil(hp * wp / BLOCK_2D[0]), math.ceil(nb * k / BLOCK_2D[1]))
        activation_pool_kernel[grid, BLOCK_2D](y, pooled, self._no_winner if winner is None else winner, pg)
        return pooled, winner

    def _gradients(self, x_dev, w_dev, dy_dev, stride, padding, need_dx, dilation=(1, 1), groups=1):
        """(dx device or None, dw device, db device) from the pre-activation gradient dy."""
        g = _geometry(x_dev.shape, w_dev.shape, stride, padding, dilation, groups)
        kg, columns, r = _weight_grad_dims(g)       # one group's
        k = int(g[4])

        # dw and db: split-K over N*Ho*Wo so that a small dw still fills the GPU
        blocks = math.ceil(columns / TILE_N) * math.ceil(kg / TILE_M) * groups
        splits = max(1, min(math.ceil(WGRAD_TARGET_BLOCKS / blocks), r // WGRAD_MIN_R_PER_SPLIT,
                            cuda_channelwise.GRID_YZ_LIMIT // groups))      # groups * splits blocks along z
        r_per_split = math.ceil(math.ceil(r / splits) / TILE_R) * TILE_R
        splits = math.ceil(r / r_per_split)
        partial = cuda.device_array((splits, k, columns), np.float32)
        grid = (math.ceil(columns / TILE_N), math.ceil(kg / TILE_M), groups * splits)
        conv_weight_grad_kernel[grid, (THREADS_X, THREADS_Y)](dy_dev, x_dev, partial, self._no_bias, g,
                                                              np.int32(r_per_split))
        dw = cuda.device_array(w_dev.shape, np.float32)
        db = cuda.device_array(k, np.float32)
        grid = (math.ceil(columns / BLOCK_2D[0]), math.ceil(k / BLOCK_2D[1]))
        weight_grad_finish_kernel[grid, BLOCK_2D](partial, dw.reshape(k, columns - 1), db)

        dx = None
        if need_dx:
            cg, pixels, r = _input_grad_dims(g)
            dx = cuda.device_array(x_dev.shape, np.float32)
            grid = (math.ceil(pixels / TILE_N), math.ceil(cg / TILE_M), groups)
            conv_input_grad_kernel[grid, (THREADS_X, THREADS_Y)](w_dev, dy_dev, dx, self._no_bias, g, np.int32(r))
        return dx, dw, db

    # ---- the contract -----------------------------------------------------------------------
    def _conv2d(self, x, w, b, stride, padding):
        y = self._forward(cuda.to_device(x), cuda.to_device(w), cuda.to_device(b), stride, padding)
        return y.copy_to_host()

    def _conv2d_backward(self, x, w, dy, stride, padding, need_dx):
        dx, dw, db = self._gradients(cuda.to_device(x), cuda.to_device(w), cuda.to_device(dy), stride, padding,
                                     need_dx)
        return (dx.copy_to_host() if need_dx else None), dw.copy_to_host(), db.copy_to_host()

    def _conv_block(self, x, w, b, block):
        w_shape = tuple(w.shape)
        w_dev = self._resident("w", w, w_shape)
        b_dev = self._resident("b", np.zeros(w_shape[0], np.float32) if b is None else b, (w_shape[0],))
        x_dev = cuda.to_device(x)
        y = self._forward(x_dev, w_dev, b_dev, block.stride, block.padding, block.dilation, block.groups)
        out_shape = tuple(block_output_shape(x.shape, w_shape, block))
        if block.is_paper:          # the fused 2x2 kernels with int8 winners
            pooled, winner = self._relu_pool(y)
            pg, kept_y = None, None
        else:
            pg = _pool_geometry(block)
            pooled, winner = self._activation_pool(y, out_shape, pg)
            kept_y = y if (pg[6] and not pg[7]) else None
        ctx = _BlockContext(x=x_dev, w_shape=w_shape, block=block, conv_shape=tuple(y.shape),
                            pooled_shape=out_shape, winner=winner, y=kept_y, pool_geometry=pg)
        return pooled.copy_to_host(), ctx

    def _conv_block_backward(self, ctx, w, dout, need_dx, dw_out, accumulate):
        w_dev = self._resident("w", w, ctx.w_shape)
        dy = cuda.device_array(ctx.conv_shape, np.float32)
        nb, k, ho, wo = ctx.conv_shape
        grid = (math.ceil(ho * wo / BLOCK_2D[0]), math.ceil(nb * k / BLOCK_2D[1]))
        if ctx.pool_geometry is None:
            relu_maxpool2_backward_kernel[grid, BLOCK_2D](ctx.winner, cuda.to_device(dout), dy)
        else:
            activation_pool_backward_kernel[grid, BLOCK_2D](
                self._no_y if ctx.y is None else ctx.y, self._no_winner if ctx.winner is None else ctx.winner,
                cuda.to_device(dout), dy, ctx.pool_geometry)
        block = ctx.block
        dx, dw, db = self._gradients(ctx.x, w_dev, dy, block.stride, block.padding, need_dx, block.dilation,
                                     block.groups)
        return (dx.copy_to_host() if need_dx else None), self._dw_into(dw_out, accumulate, dw), db

    def _on_device(self, op, verb="updates", **arrays):
        for name, a in arrays.items():
            if not _is_device_array(a):
                raise TypeError(f"{op} {verb} arrays on {self.name}: {name} is {type(a).__name__}, upload it first")

    def _elementwise(self, kernel, first, *args):
        """Launch a 1-D elementwise kernel over the size of `first`, its device arrays flattened
        and its scalars as they are."""
        size = int(np.prod(first.shape))
        if size:
            flat = [a.reshape(size) if _is_device_array(a) else a for a in (first, *args)]
            kernel[math.ceil(size / ELEMENTWISE_THREADS), ELEMENTWISE_THREADS](*flat)

    def _sgd_(self, param, velocity, grad, lr, momentum, weight_decay, nesterov):
        self._on_device("sgd_", param=param, velocity=velocity, grad=grad)
        self._elementwise(sgd_kernel, param, velocity, grad, lr, momentum, weight_decay, nesterov)

    def _adamw_(self, param, exp_avg, exp_avg_sq, grad, *scalars):
        self._on_device("adamw_", param=param, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, grad=grad)
        self._elementwise(adamw_kernel, param, exp_avg, exp_avg_sq, grad, *scalars)

    def _square_sums(self, a, lanes):
        self._on_device("sum_of_squares", "reads", a=a)
        sums = cuda.device_array(lanes, np.float64)
        size = int(np.prod(a.shape))
        square_sums_kernel[math.ceil(lanes / ELEMENTWISE_THREADS), ELEMENTWISE_THREADS](
            a.reshape(size), sums, np.int64(math.ceil(size / lanes)))
        return sums.copy_to_host()       # note: a sync point; lanes * 8 bytes cross PCIe

    def _scale_(self, a, factor):
        self._on_device("scale_", a=a)
        self._elementwise(scale_kernel, a, factor)

    def _accumulate_(self, total, grad):
        if not (_is_device_array(total) and _is_device_array(grad)):
            raise TypeError(f"accumulate_ adds arrays on {self.name}: upload them first")
        size = int(np.prod(total.shape))
        grid = math.ceil(size / ELEMENTWISE_THREADS)
        accumulate_kernel[grid, ELEMENTWISE_THREADS](total.reshape(size), grad.reshape(size))

    def _assign_(self, dst, src):
        if not (_is_device_array(dst) and _is_device_array(src)):
            raise TypeError(f"assigning dW on {self.name} takes arrays on it: upload them first")
        dst.copy_to_device(src)

    # ---- per-channel layers (devices/cuda_channelwise.py; the pools are the conv block's kernels) ----
    def _activation(self, x, act):
        return cuda_channelwise.activation(x, act)

    def _activation_backward(self, act, saved, dy):
        return cuda_channelwise.activation_backward(act, saved, dy)

    def _pool(self, x, pool, out_shape):
        """The generic block pool kernel with no activation: POOL_GEOMETRY's RELU is 0."""
        _check_planes(out_shape)
        if x.size == 0:         # a piece with no images: CUDA launches no empty grid
            return np.zeros(out_shape, np.float32), (None, None)
        pg = tuple(np.int32(v) for v in (*pool.kernel, *pool.stride, *pool.padding, 0, pool.mode == "max"))
        pooled, winner = self._activation_pool(cuda.to_device(x), out_shape, pg)
        return pooled.copy_to_host(), (pg, winner)

    def _pool_backward(self, pool, saved, in_shape, dy):
        pg, winner = saved
        if dy.size == 0:
            return np.zeros(in_shape, np.float32)
        nb, c, h, w = in_shape
        dx = cuda.device_array(in_shape, np.float32)
        grid = (math.ceil(h * w / BLOCK_2D[0]), math.ceil(nb * c / BLOCK_2D[1]))
        activation_pool_backward_kernel[grid, BLOCK_2D](self._no_y, self._no_winner if winner is None else winner,
                                                        cuda.to_device(dy), dx, pg)
        return dx.copy_to_host()

    def _plane_sums(self, a, b, shift):
        a_dev = cuda.to_device(a)
        return cuda_channelwise.plane_sums(a_dev, a_dev if b is a else cuda.to_device(b), shift)

    def _normalize(self, x, mean, scale, shift):
        return cuda_channelwise.normalize(x, mean, scale, shift)

    def _batchnorm_grad_sums(self, saved, dy, mean):
        return cuda_channelwise.plane_sums(cuda.to_device(dy), saved, mean)

    def _batchnorm_backward(self, saved, dy, mean, mean_dy, k, a):
        return cuda_channelwise.batchnorm_backward(saved, dy, mean, mean_dy, k, a)

    def _channel_scale(self, x, mask):
        return cuda_channelwise.channel_scale(x, mask)


def _check_planes(shape):
    """The 2-D pool kernels put (image, channel) planes on the grid's y axis, BLOCK_2D[1] a block."""
    planes = shape[0] * shape[1]
    if math.ceil(planes / BLOCK_2D[1]) > cuda_channelwise.GRID_YZ_LIMIT:
        raise DeviceError(f"a pool takes at most {cuda_channelwise.GRID_YZ_LIMIT * BLOCK_2D[1]} (image, channel) "
                          f"planes, got {planes} ({shape[0]} x {shape[1]}): split the batch")


def _gpu_count(requested):
    """Number of GPUs numba.cuda sees; DeviceError when there is no usable driver."""
    try:
        return len(cuda.gpus)
    except Exception as e:   # CudaSupportError and driver errors carry the reason
        reason = " ".join(str(e).split()).rstrip(" :")
        raise DeviceError(f"{requested} requested but no CUDA driver found: {reason}") from e


def open(index=0, **options):
    """Open cuda:`index` (DeviceError names what was asked and what exists)."""
    requested = f"cuda:{index}"
    if options:
        raise DeviceError(f"{requested} takes no options, got {sorted(options)!r}")
    count = _gpu_count(requested)
    if count == 0:
        raise DeviceError(f"{requested} requested but this machine has no GPU")
    if not 0 <= index < count:
        existing = "cuda:0" if count == 1 else f"cuda:0 .. cuda:{count - 1}"
        raise DeviceError(f"{requested} requested but this machine has {count} GPU{'s' if count > 1 else ''} ({existing})")
    try:
        cuda.select_device(index)
        gpu = cuda.get_current_device()
    except Exception as e:
        raise DeviceError(f"{requested} could not be opened: {' '.join(str(e).split())}") from e
    gpu_name = getattr(gpu, "name", "CUDA simulator")
    if isinstance(gpu_name, bytes):
        gpu_name = gpu_name.decode()
    return CudaDevice(index, gpu_name)
