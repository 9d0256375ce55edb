"""The CUDA device's per-channel kernels (numba.cuda): activations, BatchNorm's sums, normalisation
and backward, and Dropout2d's per-(image, channel) scale. The pools run devices/cuda.py's conv-block
pool kernels with no activation.

Simple kernels, each memory-bound: one thread per element. The elementwise kernels over
(N, C, H*W) run a 3-D grid (pixels, channel, image), so no thread divides to find its channel
(grids allow 65535 channels and images). The activations are activation_math's functions, the
very float32 arithmetic the CPU device runs. The sums take one block per channel: each thread adds
a fixed stride of the channel's values in float64, then the block adds its threads' sums as a
tree in shared memory: a fixed order for a given REDUCE_THREADS, so repeated runs agree bit for
bit. They are the only kernels with float64 arithmetic (one add per value: far below the
memory's pace even at a consumer GPU's 1/64 float64 rate).

Functions below the kernels take and return numpy arrays (float32 NCHW), moving them to and from
the GPU; what a backward needs stays on the GPU in `saved`.
"""
import math

import numpy as np
from numba import cuda, float32, float64, int32
from numba.cuda.core import config as cuda_config

from hetconv.devices import activation_math as am
from hetconv.devices.base import DeviceError

SIMULATED = bool(cuda_config.ENABLE_CUDASIM)
if SIMULATED:
    from hetconv.devices.cuda_simulator import share_static_arrays_per_block
    share_static_arrays_per_block()
ELEMENTWISE_THREADS = 32 if SIMULATED else 256     # block of the elementwise kernels
REDUCE_THREADS = 8 if SIMULATED else 256           # block of the per-channel sums: a power of two
GRID_YZ_LIMIT = 65535                              # CUDA's grid limit along y and z


def _activation_forward(x, y, code, param, param2):
    i = cuda.grid(1)
    if i < x.shape[0]:
        y[i] = am.forward(code, x[i], param, param2)


activation_forward_kernel = cuda.jit(_activation_forward)


def _activation_backward(saved, dy, dx, code, param, param2):
    i = cuda.grid(1)
    if i < saved.shape[0]:
        dx[i] = am.backward(code, saved[i], dy[i], param, param2)


activation_backward_kernel = cuda.jit(_activation_backward)


def _channel_sums(a, b, shift, first, second):
    """first[c] = sum of a[:, c, :], second[c] = sum of a[:, c, :] * (b[:, c, :] - shift[c]), in
    float64; one block per channel c, over (N, C, H*W) arrays."""
    c = cuda.blockIdx.x
    t = cuda.threadIdx.x
    n_images, size = a.shape[0], a.shape[2]
    sh = float64(shift[c])
    s1 = float64(0)
    s2 = float64(0)
    for n in range(n_images):
        for j in range(t, size, REDUCE_THREADS):
            v = float64(a[n, c, j])
            s1 += v
            s2 += v * (float64(b[n, c, j]) - sh)
    p1 = cuda.shared.array(REDUCE_THREADS, float64)
    p2 = cuda.shared.array(REDUCE_THREADS, float64)
    p1[t] = s1
    p2[t] = s2
    cuda.syncthreads()
    step = REDUCE_THREADS // 2
    while step > 0:
        if t < step:
            p1[t] += p1[t + step]
            p2[t] += p2[t + step]
        cuda.syncthreads()
        step //= 2
    if t == 0:
        first[c] = p1[0]
        second[c] = p2[0]


channel_sums_kernel = cuda.jit(_channel_sums)


def _normalize(x, mean, scale, shift, y):
    """y = (x - mean[c]) * scale[c] + shift[c] over (N, C, H*W); grid (pixels, C, N)."""
    j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    c = cuda.blockIdx.y
    n = cuda.blockIdx.z
    if j < x.shape[2]:
        y[n, c, j] = (x[n, c, j] - mean[c]) * scale[c] + shift[c]


normalize_kernel = cuda.jit(_normalize)


def _batchnorm_backward(x, dy, mean, mean_dy, k, a, dx):
    """dx = (dy - mean_dy[c] - (x - mean[c]) * k[c]) * a[c] over (N, C, H*W); grid (pixels, C, N)."""
    j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    c = cuda.blockIdx.y
    n = cuda.blockIdx.z
    if j < x.shape[2]:
        dx[n, c, j] = (dy[n, c, j] - mean_dy[c] - (x[n, c, j] - mean[c]) * k[c]) * a[c]


batchnorm_backward_kernel = cuda.jit(_batchnorm_backward)


def _channel_scale(x, mask, y):
    """y = x * mask[n, c] over (N, C, H*W); grid (pixels, C, N)."""
    j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    c = cuda.blockIdx.y
    n = cuda.blockIdx.z
    if j < x.shape[2]:
        y[n, c, j] = x[n, c, j] * mask[n, c]


channel_scale_kernel = cuda.jit(_channel_scale)


# ---- signatures of every kernel, as launched; tests compile each to PTX ----------------------------
_F1 = float32[::1]
_F2 = float32[:, ::1]
_F3 = float32[:, :, ::1]
_D1 = float64[::1]
PTX_SIGNATURES = [
    (_activation_forward, (_F1, _F1, int32, float32, float32)),
    (_activation_backward, (_F1, _F1, _F1, int32, float32, float32)),
    (_channel_sums, (_F3, _F3, _F1, _D1, _D1)),
    (_normalize, (_F3, _F1, _F1, _F1, _F3)),
    (_batchnorm_backward, (_F3, _F3, _F1, _F1, _F1, _F1, _F3)),
    (_channel_scale, (_F3, _F2, _F3)),
]
FLOAT64_KERNELS = (_channel_sums,)      # float64 on purpose: the sums' accumulators


# ---- host side -----------------------------------------------------------------------------------------
def _flat(a):
    return a.reshape(int(np.prod(a.shape)))


def _planes(a):
    n, c, h, w = a.shape
    return a.reshape(n, c, h * w)


def _plane_grid(shape):
    """(grid, block) of the (pixels, channel, image) kernels."""
    n, c, h, w = shape
    if n > GRID_YZ_LIMIT or c > GRID_YZ_LIMIT:
        raise DeviceError(f"per-channel kernels take at most {GRID_YZ_LIMIT} images and channels, got {n} "
                          f"images of {c} channels: split the batch")
    return (math.ceil(h * w / ELEMENTWISE_THREADS), c, n), ELEMENTWISE_THREADS


def activation(x, act):
    """(y, saved): saved is the GPU's copy of x or y, whichever the backward reads."""
    code, param, param2 = am.code_and_params(act)
    x_dev = cuda.to_device(x)
    y_dev = cuda.device_array_like(x_dev)
    size = x.size
    if size == 0:           # a piece with no images: CUDA launches no empty grid
        return x.copy(), x_dev
    activation_forward_kernel[math.ceil(size / ELEMENTWISE_THREADS), ELEMENTWISE_THREADS](
        _flat(x_dev), _flat(y_dev), np.int32(code), param, param2)
    return y_dev.copy_to_host(), (y_dev if code in am.SAVES_OUTPUT else x_dev)


def activation_backward(act, saved, dy):
    code, param, param2 = am.code_and_params(act)
    if dy.size == 0:
        return dy.copy()
    dx_dev = cuda.device_array(dy.shape, np.float32)
    activation_backward_kernel[math.ceil(dy.size / ELEMENTWISE_THREADS), ELEMENTWISE_THREADS](
        _flat(saved), _flat(cuda.to_device(dy)), _flat(dx_dev), np.int32(code), param, param2)
    return dx_dev.copy_to_host()


def plane_sums(a_dev, b_dev, shift):
    """Per channel, float64 numpy: (sum of a, sum of a * (b - shift)) over N, H and W."""
    c = a_dev.shape[1]
    if a_dev.size == 0:
        return np.zeros(c), np.zeros(c)
    first, second = cuda.device_array(c, np.float64), cuda.device_array(c, np.float64)
    channel_sums_kernel[c, REDUCE_THREADS](_planes(a_dev), _planes(b_dev), cuda.to_device(shift), first, second)
    return first.copy_to_host(), second.copy_to_host()


def normalize(x, mean, scale, shift):
    """(y, saved): saved is the GPU's copy of x."""
    x_dev = cuda.to_device(x)
    if x.size == 0:
        return x.copy(), x_dev
    y_dev = cuda.device_array_like(x_dev)
    grid, block = _plane_grid(x.shape)
    normalize_kernel[grid, block](_planes(x_dev), cuda.to_device(mean), cuda.to_device(scale),
                                  cuda.to_device(shift), _planes(y_dev))
    return y_dev.copy_to_host(), x_dev


def batchnorm_backward(x_dev, dy, mean, mean_dy, k, a):
    if dy.size == 0:
        return dy.copy()
    dx_dev = cuda.device_array(dy.shape, np.float32)
    grid, block = _plane_grid(dy.shape)
    batchnorm_backward_kernel[grid, block](_planes(x_dev), _planes(cuda.to_device(dy)), cuda.to_device(mean),
                                           cuda.to_device(mean_dy), cuda.to_device(k), cuda.to_device(a),
                                           _planes(dx_dev))
    return dx_dev.copy_to_host()


def channel_scale(x, mask):
    if x.size == 0:
        return x.copy()
    y_dev = cuda.device_array(x.shape, np.float32)
    grid, block = _plane_grid(x.shape)
    channel_scale_kernel[grid, block](_planes(cuda.to_device(x)), cuda.to_device(mask), _planes(y_dev))
    return y_dev.copy_to_host()
