"""The CPU's optimizer updates and sum of squares, in place on flat float32 arrays: update_rules'
arithmetic (devices/base.py, written once for every device) compiled by Numba, as a parallel
kernel for large arrays and on the calling thread for small ones. The CPU device runs them on its
layers' weights, HostArrays (devices/cpu.py) on arrays that live on no device.
"""
import operator

import numba
import numpy as np
from numba import prange

from hetconv.devices.base import update_rules
from hetconv.jit import cached_njit

# update_rules' arithmetic with Numba's own operators: without fastmath, LLVM rounds each multiply
# and each add apart (it fuses only what a fast-math flag allows), as the CUDA device's libdevice
# *_rn calls do. The loops are cached (the cache's stamp covers base.py, where the rules live):
# compiled, they cost ~2 s once per process at its first update, on a worker's compute thread.
_sgd_rule, _adamw_rule, _scale_rule, _square_add = (
    numba.njit(nogil=True)(rule) for rule in update_rules(operator.mul, operator.add, operator.truediv, np.sqrt,
                                                         operator.mul, operator.add))
_update_jit = cached_njit(parallel=True, nogil=True)
# sum_of_squares' lanes per parallel task: 64 float32 side by side, one cache line per row
SQUARE_SUM_LANE_BLOCK = 64


def _sgd_loop(param, velocity, grad, lr, momentum, weight_decay, nesterov):
    for i in prange(param.shape[0]):
        param[i], velocity[i] = _sgd_rule(param[i], velocity[i], grad[i], lr, momentum, weight_decay, nesterov)


def _adamw_loop(param, exp_avg, exp_avg_sq, grad, decay, grad_decay, lerp_weight, lerp_from_grad, beta2,
                one_minus_beta2,
                bias_correction2_sqrt, eps, step_size):
    for i in prange(param.shape[0]):
        param[i], exp_avg[i], exp_avg_sq[i] = _adamw_rule(
            param[i], exp_avg[i], exp_avg_sq[i], grad[i], decay, grad_decay, lerp_weight, lerp_from_grad, beta2,
            one_minus_beta2,
            bias_correction2_sqrt, eps, step_size)


# Each update as a parallel kernel, and the same on the calling thread alone (prange runs as range)
# for arrays under SERIAL_UPDATE_SIZE: waking the other threads costs ~50 us a call, more than a
# bias or a small layer's weights take (vgg-small's 20 updates a step: 1.5 ms, ~0.6 of it waking).
SERIAL_UPDATE_SIZE = 1 << 15
_sgd_flat, _adamw_flat = _update_jit(_sgd_loop), _update_jit(_adamw_loop)
_sgd_serial, _adamw_serial = numba.njit(nogil=True)(_sgd_loop), numba.njit(nogil=True)(_adamw_loop)


def _sgd_update(param, velocity, grad, *scalars):
    sgd = _sgd_serial if param.size < SERIAL_UPDATE_SIZE else _sgd_flat
    sgd(param.reshape(-1), velocity.reshape(-1), grad.reshape(-1), *scalars)


def _adamw_update(param, exp_avg, exp_avg_sq, grad, *scalars):
    adamw = _adamw_serial if param.size < SERIAL_UPDATE_SIZE else _adamw_flat
    adamw(param.reshape(-1), exp_avg.reshape(-1), exp_avg_sq.reshape(-1), grad.reshape(-1), *scalars)


@_update_jit
def _scale_flat(a, factor):
    for i in prange(a.shape[0]):
        a[i] = _scale_rule(a[i], factor)


@_update_jit
def _square_sums_flat(a, lanes):
    """lanes[j] = sum of a[i]**2 over i = j (mod len(lanes)), i ascending, in float64: parallel
    over blocks of lanes, each walking the rows of a (len(lanes) wide) in order."""
    n, width = a.shape[0], lanes.shape[0]
    for block in prange((width + SQUARE_SUM_LANE_BLOCK - 1) // SQUARE_SUM_LANE_BLOCK):
        lo = block * SQUARE_SUM_LANE_BLOCK
        hi = min(lo + SQUARE_SUM_LANE_BLOCK, width)
        for j in range(lo, hi):
            lanes[j] = 0.0
        for row in range(0, n, width):
            for j in range(lo, min(hi, n - row)):
                lanes[j] = _square_add(lanes[j], np.float64(a[row + j]))
