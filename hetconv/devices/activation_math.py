"""Every activation's float32 arithmetic, once, for the CPU and the CUDA devices alike.

The functions are Numba @njit scalar functions: the CPU kernels call them in their loops, and
numba-cuda compiles the same Python for the GPU when a kernel calls them (scalars only: a
@njit helper taking arrays would fail under the CUDA simulator).

Arithmetic stays in float32: every constant is an np.float32 (a bare 0.5 would turn the
expression into float64). There is no vectorised libm here (Numba without Intel's SVML), and a
libm call per element stops a loop from vectorising: on a Zen 5 core, expf ~2 ns, tanhf ~14 ns,
erff ~12 ns, expm1f ~10 ns an element. So exp is written out (Cody-Waite reduction by ln 2, Cephes'
expf polynomial, 2^k from a table: within 1e-7 relative, and a sigmoid over the paper-sized
map ran 4x faster than with expf); erf is the rational approximation PyTorch's vectorised CPU
kernel uses (Abramowitz and Stegun 7.1.26, absolute error below 1.5e-7: under float32's
rounding of 1 + erf in GELU); tanh and expm1 are built on exp, with a short Taylor series near 0
where 1 - e^-2a or e^x - 1 would cancel. Relative error stays within a few float32 roundings.
The GPU compiles the same formulas (its compiler may fuse a multiply and an add where the CPU's
does not: the two agree to rounding, not bit for bit).

An activation is `code` (one of the CODES below) and two float32 parameters `param` and `param2`:
negative_slope for leaky_relu, alpha for elu and celu, the bounds (min_val, max_val) for hardtanh
(relu6 is hardtanh from 0 to 6), unused by the others. The backward of
relu, tanh and sigmoid reads the forward's output (as PyTorch's does), the others its input:
SAVES_OUTPUT says which.
"""
import math

import numba
import numba.extending
import numpy as np

from hetconv.jit import cached_njit

(RELU, GELU, GELU_TANH, SILU, LEAKY_RELU, ELU, CELU, TANH, SIGMOID, HARDSWISH, HARDTANH, HARDSIGMOID,
 IDENTITY) = range(13)
CODES = {"relu": RELU, "gelu": GELU, "silu": SILU, "leaky_relu": LEAKY_RELU, "elu": ELU, "celu": CELU,
         "tanh": TANH, "sigmoid": SIGMOID, "hardswish": HARDSWISH, "relu6": HARDTANH, "hardtanh": HARDTANH,
         "hardsigmoid": HARDSIGMOID, "identity": IDENTITY}
SAVES_OUTPUT = (RELU, TANH, SIGMOID)


def code_and_params(act):
    """(code, param, param2) for a hetconv.channelwise.Activation, as the kernels take them."""
    if act.kind == "gelu":
        return (GELU_TANH if act.approximate == "tanh" else GELU), np.float32(0), np.float32(0)
    if act.kind == "relu6":
        return HARDTANH, np.float32(0), np.float32(6)
    if act.kind == "hardtanh":
        return HARDTANH, np.float32(act.min_val), np.float32(act.max_val)
    param = {"leaky_relu": act.negative_slope, "elu": act.alpha, "celu": act.alpha}.get(act.kind, 0.0)
    return CODES[act.kind], np.float32(param), np.float32(0)


_ZERO = np.float32(0)
_ONE = np.float32(1)
_TWO = np.float32(2)
_THREE = np.float32(3)
_SIX = np.float32(6)
_HALF = np.float32(0.5)
_SMALL = np.float32(0.125)          # below it, the Taylor series; its next term is < 1e-8 relative
_SATURATED = np.float32(9)          # tanh(9) rounds to 1 in float32
_INV_SQRT2 = np.float32(1 / math.sqrt(2))
_INV_SQRT_2PI = np.float32(1 / math.sqrt(2 * math.pi))
_GELU_BETA = np.float32(math.sqrt(2 / math.pi))
_GELU_KAPPA = np.float32(0.044715)
_GELU_KAPPA3 = np.float32(3 * 0.044715)
# Abramowitz and Stegun 7.1.26
_ERF_P = np.float32(0.3275911)
_ERF_A1, _ERF_A2, _ERF_A3, _ERF_A4, _ERF_A5 = (np.float32(a) for a in (0.254829592, -0.284496736, 1.421413741,
                                                                       -1.453152027, 1.061405429))
_C3 = np.float32(1 / 3)
_C5 = np.float32(2 / 15)
_C7 = np.float32(17 / 315)
_E2, _E3, _E4, _E5 = (np.float32(1 / f) for f in (2, 6, 24, 120))

# exp: e^v = 2^k * e^r, k = round(v / ln 2), r = v - k ln 2 in [-ln2/2, ln2/2] (ln 2 in two parts,
# the first exact in a few bits, so k * _LN2_HI has no rounding error); Cephes' expf polynomial
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_LO = np.float32(-87.33654)     # e^v below it is not a normal float32: held at ~2^-126 (1.2e-38)
_EXP_HI = np.float32(88.0)          # 2^k stays finite in the table: e^88 = 1.65e38, held beyond
_EXP_P = tuple(np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                                       1.6666665459e-1, 5.0000001201e-1))
_EXP_P0, _EXP_P1, _EXP_P2, _EXP_P3, _EXP_P4, _EXP_P5 = _EXP_P
_EXP_INDEX_SHIFT = np.float32(127.5)
_EXP2 = np.array([2.0 ** k for k in range(-127, 128)], np.float32)      # 2^k at k + 127

_scalar = cached_njit(nogil=True, inline="always")


@_scalar
def exp(v):
    """e^v, NaN kept; held within [~2^-126, e^88] (see _EXP_LO, _EXP_HI)."""
    x = v if v > _EXP_LO else _EXP_LO          # a NaN lands here too: a valid table index below
    x = x if x < _EXP_HI else _EXP_HI
    # index = k + 127 = floor(v / ln 2 + 1/2) + 127: the sum is positive, so truncation floors
    index = np.int32(x * _LOG2E + _EXP_INDEX_SHIFT)
    kf = np.float32(index - 127)
    r = x - kf * _LN2_HI - kf * _LN2_LO
    p = ((((_EXP_P0 * r + _EXP_P1) * r + _EXP_P2) * r + _EXP_P3) * r + _EXP_P4) * r + _EXP_P5
    e = (p * (r * r) + r + _ONE) * _EXP2[index]
    return e if v == v else v


@_scalar
def expm1(v):
    """e^v - 1."""
    if -_SMALL < v < _SMALL:
        return v * (_ONE + v * (_E2 + v * (_E3 + v * (_E4 + v * _E5))))
    return exp(v) - _ONE


@_scalar
def tanh(v):
    a = abs(v)
    if a < _SMALL:
        a2 = a * a
        t = a * (_ONE - a2 * (_C3 - a2 * (_C5 - a2 * _C7)))
    elif a > _SATURATED:
        t = _ONE
    else:
        e = exp(-_TWO * a)
        t = (_ONE - e) / (_ONE + e)
    return t if v >= _ZERO else -t


@_scalar
def erf(v):
    a = abs(v)
    t = _ONE / (_ONE + _ERF_P * a)
    poly = t * (_ERF_A1 + t * (_ERF_A2 + t * (_ERF_A3 + t * (_ERF_A4 + t * _ERF_A5))))
    r = _ONE - poly * exp(-a * a)
    return r if v >= _ZERO else -r


@_scalar
def sigmoid(v):
    # below -88, exp(-v) is held at e^88: 1 / (1 + 1.65e38), ~6e-39, where the true value is smaller still
    return _ONE / (_ONE + exp(-v))


# ---- one forward and one backward per activation: (v, param) and (saved, g, param) ------------------
# backward: the gradient with respect to the input given g with respect to the output; `saved`
# is the forward's output for the SAVES_OUTPUT codes, its input otherwise. Kinks as PyTorch's:
# relu passes nothing at 0, leaky_relu gives param * g there, hardswish 0 at -3 and g at 3,
# hardtanh and hardsigmoid nothing at either bound.

@_scalar
def relu(v, param):
    return v if v > _ZERO else _ZERO


@_scalar
def relu_backward(y, g, param):
    return g if y > _ZERO else _ZERO


@_scalar
def gelu(v, param):
    return _HALF * v * (_ONE + erf(v * _INV_SQRT2))


@_scalar
def gelu_backward(v, g, param):
    cdf = _HALF * (_ONE + erf(v * _INV_SQRT2))
    return g * (cdf + v * _INV_SQRT_2PI * exp(-_HALF * v * v))


@_scalar
def gelu_tanh(v, param):
    return _HALF * v * (_ONE + tanh(_GELU_BETA * (v + _GELU_KAPPA * v * v * v)))


@_scalar
def gelu_tanh_backward(v, g, param):
    v2 = v * v
    t = tanh(_GELU_BETA * (v + _GELU_KAPPA * v2 * v))
    return g * (_HALF * (_ONE + t) + _HALF * v * (_ONE - t * t) * _GELU_BETA * (_ONE + _GELU_KAPPA3 * v2))


@_scalar
def silu(v, param):
    return v * sigmoid(v)


@_scalar
def silu_backward(v, g, param):
    s = sigmoid(v)
    return g * (s * (_ONE + v * (_ONE - s)))


@_scalar
def leaky_relu(v, param):
    return v if v > _ZERO else v * param


@_scalar
def leaky_relu_backward(v, g, param):
    return g if v > _ZERO else g * param


@_scalar
def elu(v, param):
    return v if v > _ZERO else param * expm1(v)


@_scalar
def elu_backward(v, g, param):
    return g if v > _ZERO else g * (param * exp(v))


@_scalar
def celu(v, param):
    return v if v > _ZERO else param * expm1(v / param)


@_scalar
def celu_backward(v, g, param):
    return g if v > _ZERO else g * exp(v / param)


@_scalar
def tanh_backward(y, g, param):
    return g * (_ONE - y * y)


@_scalar
def sigmoid_backward(y, g, param):
    return g * (y * (_ONE - y))


@_scalar
def hardswish(v, param):
    return v * min(max(v + _THREE, _ZERO), _SIX) / _SIX


@_scalar
def hardswish_backward(v, g, param):
    if v <= -_THREE:
        return _ZERO
    if v < _THREE:
        return g * (v * _C3 + _HALF)
    return g


@_scalar
def hardtanh(v, lo, hi):
    return min(max(v, lo), hi)


@_scalar
def hardtanh_backward(v, g, lo, hi):
    return g if lo < v < hi else _ZERO


@_scalar
def hardsigmoid(v, param):
    return min(max(v + _THREE, _ZERO), _SIX) / _SIX


@_scalar
def hardsigmoid_backward(v, g, param):
    return g / _SIX if -_THREE < v < _THREE else _ZERO


# by code; the CUDA kernels take it as an argument (the branch is the same for every thread of a
# launch), the CPU loops as a constant (below)
@_scalar
def forward(code, v, param, param2):
    if code == RELU:
        return relu(v, param)
    if code == GELU:
        return gelu(v, param)
    if code == GELU_TANH:
        return gelu_tanh(v, param)
    if code == SILU:
        return silu(v, param)
    if code == LEAKY_RELU:
        return leaky_relu(v, param)
    if code == ELU:
        return elu(v, param)
    if code == CELU:
        return celu(v, param)
    if code == TANH:
        return tanh(v)
    if code == SIGMOID:
        return sigmoid(v)
    if code == HARDSWISH:
        return hardswish(v, param)
    if code == HARDTANH:
        return hardtanh(v, param, param2)
    if code == HARDSIGMOID:
        return hardsigmoid(v, param)
    return v


@_scalar
def backward(code, saved, g, param, param2):
    if code == RELU:
        return relu_backward(saved, g, param)
    if code == GELU:
        return gelu_backward(saved, g, param)
    if code == GELU_TANH:
        return gelu_tanh_backward(saved, g, param)
    if code == SILU:
        return silu_backward(saved, g, param)
    if code == LEAKY_RELU:
        return leaky_relu_backward(saved, g, param)
    if code == ELU:
        return elu_backward(saved, g, param)
    if code == CELU:
        return celu_backward(saved, g, param)
    if code == TANH:
        return tanh_backward(saved, g, param)
    if code == SIGMOID:
        return sigmoid_backward(saved, g, param)
    if code == HARDSWISH:
        return hardswish_backward(saved, g, param)
    if code == HARDTANH:
        return hardtanh_backward(saved, g, param, param2)
    if code == HARDSIGMOID:
        return hardsigmoid_backward(saved, g, param)
    return g


# ---- the CPU loops' dispatch: the code a constant of the loop, chosen when the loop is typed ----------
# forward_of, backward_of and gradient_of compute what forward and backward do. A CPU loop closes
# over its code (an int) and passes it: Numba types that constant as a literal, and the overloads
# below give the loop that one activation's function alone. Inlining forward's whole chain
# instead put every activation's IR into every loop, where Numba's parallel passes copy it again
# and again before LLVM prunes it: twice the compile of a parallel loop. A jitted caller must pass
# a constant code (the CUDA kernels, whose code is an argument, call forward and backward).
def forward_of(code, v, param, param2):
    return forward(code, v, param, param2)


def backward_of(code, saved, g, param, param2):
    return backward(code, saved, g, param, param2)


def gradient_of(code, z, g, param, param2):
    """The activation's gradient of g at its input z: its output recomputed first where its
    backward reads the output."""
    return backward(code, forward(code, z, param, param2) if code in SAVES_OUTPUT else z, g, param, param2)


def _literal(code):
    return code.literal_value if isinstance(code, numba.types.IntegerLiteral) else None


@numba.extending.overload(forward_of, inline="always")
def _forward_of(code, v, param, param2):
    c = _literal(code)
    if c is None:
        return None
    one = {RELU: relu, GELU: gelu, GELU_TANH: gelu_tanh, SILU: silu, LEAKY_RELU: leaky_relu, ELU: elu, CELU: celu,
           HARDSWISH: hardswish, HARDSIGMOID: hardsigmoid}.get(c)
    if one is not None:
        return lambda code, v, param, param2: one(v, param)
    if c == TANH:
        return lambda code, v, param, param2: tanh(v)
    if c == SIGMOID:
        return lambda code, v, param, param2: sigmoid(v)
    if c == HARDTANH:
        return lambda code, v, param, param2: hardtanh(v, param, param2)
    return lambda code, v, param, param2: v


@numba.extending.overload(backward_of, inline="always")
def _backward_of(code, saved, g, param, param2):
    c = _literal(code)
    if c is None:
        return None
    one = {RELU: relu_backward, GELU: gelu_backward, GELU_TANH: gelu_tanh_backward, SILU: silu_backward,
           LEAKY_RELU: leaky_relu_backward, ELU: elu_backward, CELU: celu_backward, TANH: tanh_backward,
           SIGMOID: sigmoid_backward, HARDSWISH: hardswish_backward, HARDSIGMOID: hardsigmoid_backward}.get(c)
    if one is not None:
        return lambda code, saved, g, param, param2: one(saved, g, param)
    if c == HARDTANH:
        return lambda code, saved, g, param, param2: hardtanh_backward(saved, g, param, param2)
    return lambda code, saved, g, param, param2: g


@numba.extending.overload(gradient_of, inline="always")
def _gradient_of(code, z, g, param, param2):
    c = _literal(code)
    if c is None:
        return None
    if c in SAVES_OUTPUT:
        return lambda code, z, g, param, param2: backward_of(code, forward_of(code, z, param, param2), g, param, param2)
    return lambda code, z, g, param, param2: backward_of(code, z, g, param, param2)


def _cpu_kernels(code):
    """(forward, backward) parallel loops over flat float32 arrays for the CPU device, made per
    code: `code` is a constant inside each, so each loop is its activation's own few instructions
    (relu, leaky_relu, the hard ones, identity and the exp-based ones vectorise). They close over
    the code alone (an int), which Numba's cache keys them by (a closure's cells are its key: a
    jitted function in one pickles differently in every process). They live in this file because
    Numba's cache knows only the file of the function it caches: a loop cached elsewhere would
    keep an inlined copy of these functions after they change."""
    @cached_njit(parallel=True, nogil=True)
    def forward_loop(param, param2, x, y):
        for i in numba.prange(x.shape[0]):
            y[i] = forward_of(code, x[i], param, param2)

    @cached_njit(parallel=True, nogil=True)
    def backward_loop(param, param2, saved, dy, dx):
        for i in numba.prange(saved.shape[0]):
            dx[i] = backward_of(code, saved[i], dy[i], param, param2)

    return forward_loop, backward_loop


CPU_KERNELS = {code: _cpu_kernels(code) for code in range(IDENTITY + 1)}
