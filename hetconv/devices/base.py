"""The device contract: what every `--device` kind provides, checked once here.

All arrays crossing this interface from the caller are numpy float32, NCHW, weights (K, C, kh, kw),
any stride and zero padding given as an int or an (height, width) pair, cross-correlation as
PyTorch's conv2d. The public methods check shapes, dtypes, strides and paddings and name the
offending values; a backend implements the underscore methods and may assume checked,
C-contiguous float32 input and (height, width) int pairs.

Besides the plain contract (conv2d / conv2d_backward), a device offers the fused form a worker
runs, a conv block: conv + bias, then an activation (ReLU or none), then a pool (max, average or
none) as a `ConvBlock` says, whose backward needs only the opaque `ctx` the forward returned.
conv_relu_pool is the paper's block (ReLU, 2x2 stride-2 max-pool). Parameters may live on the device between steps: `upload` turns a numpy array into the
device's own array type, `download` turns it back, and `sgd_` / `adamw_` update parameters where
they live. For the CPU device both are identities.

The optimizer's arithmetic is written once, here (`update_rules`), and every backend compiles it
with its own correctly rounded operations, each multiply and each add rounded apart: copies of a
weight held by several devices (data-parallel layers on a CPU and a GPU) stay bit-identical after
every update, as they would not if one compiler fused a multiply and an add into an fma.

Per-channel layers (hetconv.channelwise): activation, pool (a Pool or a GlobalPool), BatchNorm
as three calls (channel_sums, batchnorm_apply; batchnorm_grad_sums, batchnorm_backward) so that
a batch held in pieces adds its per-channel sums up between them, and channel_scale for
Dropout2d. numpy float32 NCHW in and out on every device; a forward returns (y, ctx), ctx opaque
and holding what the backward needs (the CPU device keeps the caller's x or its returned y, not a
copy: neither may be changed until the backward has run).
"""
from dataclasses import dataclass
import math
import numbers

import numpy as np

from hetconv.channelwise import Activation, GlobalPool, Pool
from hetconv.geometry import (ACTIVATIONS, PAPER_BLOCK, POOLS, ConvBlock, as_pair,  # noqa: F401  (the contract's names)
                              dilated_size, window_output_size)


class DeviceError(RuntimeError):
    """A device cannot be opened or was asked for something it cannot do."""


def is_channels_last(a):
    """Whether the 4-D array `a` (axes N, C, H, W) lies in memory as NHWC: a view whose
    transpose(0, 2, 3, 1) is C-contiguous, and that is not C-contiguous itself (a map of one
    channel, or of one pixel, is both, and counts as NCHW)."""
    return (isinstance(a, np.ndarray) and a.ndim == 4 and not a.flags.c_contiguous
            and a.transpose(0, 2, 3, 1).flags.c_contiguous)


def nhwc(a):
    """The (N, H, W, C) C-contiguous array under a channels-last `a` (a view, no copy)."""
    return a.transpose(0, 2, 3, 1)


def empty_channels_last(shape, dtype=np.float32):
    """A new array of logical shape (N, C, H, W) laid out in memory as NHWC."""
    n, c, h, w = shape
    return np.empty((n, h, w, c), dtype).transpose(0, 3, 1, 2)


def as_channels_last(a):
    """The 4-D `a` laid out channels-last: itself where it is, else one copy."""
    if is_channels_last(a):
        return a
    out = empty_channels_last(a.shape, a.dtype)
    out[...] = a
    return out


def in_layout_of(a, like):
    """`a` laid out as `like` is (channels-last or C-contiguous NCHW): itself where it already
    is, else one copy. What a kernel reading two maps at the same index needs."""
    return as_channels_last(a) if is_channels_last(like) else np.ascontiguousarray(a)


def concatenate(pieces, axis):
    """np.concatenate of 4-D maps along `axis` (0: images, 1: channels), channels-last where
    every piece is (np.concatenate writes NCHW whatever its inputs)."""
    if len(pieces) == 1:
        return pieces[0]
    if not all(is_channels_last(p) for p in pieces):
        return np.concatenate(pieces, axis=axis)
    shape = list(pieces[0].shape)
    shape[axis] = sum(p.shape[axis] for p in pieces)
    out = empty_channels_last(tuple(shape), pieces[0].dtype)
    at = 0
    for p in pieces:
        index = (slice(None),) * axis + (slice(at, at + p.shape[axis]),)
        out[index] = p
        at += p.shape[axis]
    return out


def as_layout_kept(a):
    """`a` itself where it is C-contiguous or channels-last, else a C-contiguous copy: what may be
    handed on inside a process without reordering a channels-last map."""
    return a if a.flags.c_contiguous or is_channels_last(a) else np.ascontiguousarray(a)


def _as_f32(name, a, ndim, channels_last=False):
    """`a` as a float32 array of `ndim` dimensions, C-contiguous; with `channels_last`, a 4-D
    channels-last array is kept as it is (the device's kernels read its NHWC memory)."""
    a = np.asarray(a)
    if a.dtype != np.float32:
        raise TypeError(f"{name} must be float32, got {a.dtype}")
    if a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {a.shape!r}")
    if channels_last and is_channels_last(a):
        return a
    return np.ascontiguousarray(a)


def conv_output_shape(x_shape, w_shape, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1):
    """(N, K, Ho, Wo) of conv2d(x, w) at this stride, padding, dilation and groups, or ValueError
    naming the values."""
    n, c, h, w = x_shape
    k, wc, kh, kw = w_shape
    if c % groups or k % groups:
        raise ValueError(f"groups {groups} must divide the input's {c} channels and the {k} kernels: "
                         f"w {tuple(w_shape)!r}, x {tuple(x_shape)!r}")
    if wc * groups != c:
        per_group = "" if groups == 1 else f" ({wc} per group, {groups} groups)"
        raise ValueError(f"weights expect {wc * groups} input channels{per_group} but input has {c}: "
                         f"w {tuple(w_shape)!r}, x {tuple(x_shape)!r}")
    stride = as_pair("stride", stride, 1)
    padding = as_pair("padding", padding, 0)
    dilation = as_pair("dilation", dilation, 1)
    kh, kw = dilated_size(kh, dilation[0]), dilated_size(kw, dilation[1])
    if h + 2 * padding[0] < kh or w + 2 * padding[1] < kw:
        spread = "" if dilation == (1, 1) else f" (dilation {dilation!r})"
        raise ValueError(f"kernel {kh}x{kw}{spread} does not fit input {h}x{w} with padding {padding!r}")
    ho = window_output_size(h, kh, stride[0], padding[0])
    wo = window_output_size(w, kw, stride[1], padding[1])
    return n, k, ho, wo


def block_output_shape(x_shape, w_shape, block):
    """(N, K, Hp, Wp) leaving a conv block: after the conv, the activation and the pool."""
    if not isinstance(block, ConvBlock):
        raise TypeError(f"block must be a ConvBlock, got {type(block).__name__}")
    n, k, ho, wo = conv_output_shape(x_shape, w_shape, block.stride, block.padding, block.dilation, block.groups)
    if block.pool == "none":
        return n, k, ho, wo
    (pkh, pkw), (psh, psw), (pph, ppw) = block.pool_kernel, block.pool_stride, block.pool_padding
    if ho + 2 * pph < pkh or wo + 2 * ppw < pkw:
        raise ValueError(f"conv output {ho}x{wo} is too small for a {pkh}x{pkw} {block.pool}-pool "
                         f"(pool padding {block.pool_padding!r})")
    return n, k, window_output_size(ho, pkh, psh, pph), window_output_size(wo, pkw, psw, ppw)


def pooled_shape(x_shape, w_shape, padding):
    """(N, K, Hp, Wp) leaving the paper's block with this conv padding."""
    return block_output_shape(x_shape, w_shape, ConvBlock(padding=padding))


def _plain_block(stride, padding, dilation, groups):
    """The block of a plain conv2d: the conv alone."""
    return ConvBlock(stride=stride, padding=padding, dilation=dilation, groups=groups, activation="none", pool="none")


# ---- the update arithmetic, written once --------------------------------------------------------
# sum_of_squares' fixed order: element i adds into lane i % SQUARE_SUM_LANES (in float64, lanes
# in ascending i), and the lanes are summed exactly rounded on the host (math.fsum), so the result
# depends on neither the thread count nor the device. Each GPU thread owns a lane (16384 threads
# read a weight tensor coalesced), and the host's fsum over them costs ~0.5 ms.
SQUARE_SUM_LANES = 16384


def update_rules(mul, add, div, sqrt, mul64, add64):
    """(sgd, adamw, scale, square_add): the optimizers' arithmetic on one element, for a backend
    to compile with its own operations. mul, add, div and sqrt are float32's, each correctly
    rounded on its own (no fused multiply-add); mul64 and add64 float64's, for sum_of_squares.
    A subtraction is an add of the negated operand, which rounds the same. Scalars arrive as
    float32, prepared once on the host (Device.sgd_, Device.adamw_); a float literal here would
    be a float64 on the GPU."""

    def sgd(p, v, g, lr, momentum, weight_decay, nesterov):
        """torch.optim.SGD (dampening 0) on one element: returns (param, velocity). The velocity
        adds the decay last, v = (momentum*v + g) + weight_decay*p: torch adds it to the
        gradient first, which can differ in the last bit where weight_decay > 0."""
        decay = mul(weight_decay, p)
        v = add(add(mul(momentum, v), g), decay)
        step = add(add(g, decay), mul(momentum, v)) if nesterov else v
        return add(p, -mul(lr, step)), v

    def adamw(p, m, v, g, decay, grad_decay, lerp_weight, lerp_from_grad, beta2, one_minus_beta2,
              bias_correction2_sqrt, eps, step_size):
        """torch.optim.AdamW's single-tensor step on one element, operation by operation, or with
        decay 1 and grad_decay its weight decay torch.optim.Adam's (the decay added to the
        gradient, from the parameter before it moves): returns (param, exp_avg, exp_avg_sq).
        exp_avg.lerp_(grad, 1 - beta1) is torch's lerp, base + weight*(grad - exp_avg) from
        exp_avg, or from grad with weight - 1 where the weight is at least 0.5; addcmul
        multiplies (1 - beta2)*grad first, then by grad."""
        if grad_decay != 0:
            g = add(g, mul(grad_decay, p))
        p = mul(p, decay)
        m = add(g if lerp_from_grad else m, mul(lerp_weight, add(g, -m)))
        v = add(mul(v, beta2), mul(mul(one_minus_beta2, g), g))
        denom = add(div(sqrt(v), bias_correction2_sqrt), eps)
        return add(p, -div(mul(step_size, m), denom)), m, v

    def scale(x, factor):
        return mul(x, factor)

    def square_add(total, x):
        """total + x*x in float64 (x a float32 widened: its square is exact in float64)."""
        return add64(total, mul64(x, x))

    return sgd, adamw, scale, square_add


def _finite(name, value, low=0.0, high=None, high_open=True):
    """value as a float, or ValueError naming it: finite, >= low, and < high (or <= high)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    value = float(value)
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value!r}")
    if high is not None and (value >= high if high_open else value > high):
        raise ValueError(f"{name} must be {'<' if high_open else '<='} {high}, got {value!r}")
    return value


def sgd_scalars(lr, momentum, weight_decay, nesterov):
    """The float32 scalars an SGD update runs with, checked as torch.optim.SGD checks them."""
    lr, momentum = _finite("lr", lr), _finite("momentum", momentum)
    weight_decay = _finite("weight_decay", weight_decay)
    if nesterov and momentum == 0:
        raise ValueError("nesterov momentum needs a momentum > 0, got 0.0")
    return np.float32(lr), np.float32(momentum), np.float32(weight_decay), bool(nesterov)


def adamw_scalars(lr, beta1, beta2, eps, weight_decay, step, coupled=False):
    """The scalars an AdamW update runs with (update_rules' adamw after its four arrays), or with
    `coupled` an Adam update's (the weight decay added to the gradient instead), derived in
    float64 on the host as torch does, then rounded to float32 where torch's kernels take them.
    step counts updates from 1 (torch's state['step'] after its increment)."""
    lr, eps, weight_decay = _finite("lr", lr), _finite("eps", eps), _finite("weight_decay", weight_decay)
    beta1, beta2 = _finite("beta1", beta1, high=1.0), _finite("beta2", beta2, high=1.0)
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 1:
        raise ValueError(f"step must be an integer >= 1 (the first update is 1), got {step!r}")
    step = int(step)
    lerp_weight = 1.0 - beta1
    lerp_from_grad = not abs(lerp_weight) < 0.5
    if lerp_from_grad:    # torch's lerp: grad - (grad - exp_avg)*(1 - weight), exact in float32
        lerp_weight = np.float32(lerp_weight) - np.float32(1.0)
    decay, grad_decay = (1.0, weight_decay) if coupled else (1.0 - lr * weight_decay, 0.0)
    return (np.float32(decay), np.float32(grad_decay), np.float32(lerp_weight), lerp_from_grad, np.float32(beta2),
            np.float32(1.0 - beta2), np.float32((1.0 - beta2 ** step) ** 0.5), np.float32(eps),
            np.float32(lr / (1.0 - beta1 ** step)))
def _channel_f32(name, a, channels):
    """A (channels,) float32 vector, or the error naming it."""
    a = np.asarray(a)
    if a.dtype != np.float32:
        raise TypeError(f"{name} must be float32, got {a.dtype}")
    if a.shape != (channels,):
        raise ValueError(f"{name} must have one value per channel, {a.shape!r} != {(channels,)!r}")
    return np.ascontiguousarray(a)


def _channel_f64(name, a, channels):
    a = np.asarray(a)
    if not np.issubdtype(a.dtype, np.floating):
        raise TypeError(f"{name} must be floating point, got {a.dtype}")
    if a.shape != (channels,):
        raise ValueError(f"{name} must have one value per channel, {a.shape!r} != {(channels,)!r}")
    return a.astype(np.float64)


@dataclass(frozen=True)
class ChannelContext:
    """What a per-channel forward hands its backward: `op` names the forward ("activation",
    "pool", "batchnorm"), `layer` is its Activation or Pool (a GlobalPool as the Pool of the whole
    map) or, for BatchNorm, the _BatchNormParams it normalised with; `saved` is the backend's."""
    op: str
    layer: object
    in_shape: tuple
    out_shape: tuple
    saved: object


@dataclass(frozen=True)
class _BatchNormParams:
    mean: np.ndarray        # (C,) float32, as batchnorm_apply got them
    invstd: np.ndarray
    weight: np.ndarray      # None when not affine
    scale: np.ndarray = None        # (C,) float32: what x - mean was multiplied by, and shift added
    shift: np.ndarray = None
    activation: Activation = None   # the activation applied after it in the same call, or None


class _Composed:
    """A device's own BatchNorm and activation run one after the other, where it has no fused
    kernel: each one's saved state, and the activation's gradient once the sums computed it."""

    def __init__(self, norm_saved, act_saved):
        self.norm_saved, self.act_saved, self.grad = norm_saved, act_saved, None


class Device:
    """Base class: public, checked methods; backends implement the underscore ones."""

    name = "abstract"
    # whether the per-channel methods and conv_block take channels-last maps as they are (their
    # kernels read NHWC memory) and may return them; a device without turns each into NCHW first
    channels_last = False

    # ---- parameters that may stay resident on the device -------------------------------------
    def upload(self, a):
        """A device-owned copy (never a view of the caller's or a received, read-only buffer), in
        numpy's native float32: astype, unlike np.array, does not keep an equal but distinct
        descriptor (an explicit '<f4', as np.load gives), on which every np.asarray(w, np.float32)
        makes a new view, so that nothing keyed by the weights array ever hits."""
        return np.asarray(a).astype(np.float32, order="C", copy=True)

    def download(self, a):
        return np.asarray(a, dtype=np.float32)

    def zeros_like(self, a):
        return np.zeros_like(a)

    def synchronize(self):
        pass

    # ---- updates, in place where the arrays live -------------------------------------------------
    def sgd_(self, param, velocity, grad, lr, momentum, weight_decay, nesterov=False):
        """In place, torch.optim.SGD with dampening 0: v = momentum*v + grad + weight_decay*param;
        param -= lr*v, or with nesterov param -= lr*(grad + weight_decay*param + momentum*v)."""
        self._check_update("sgd_", param, velocity=velocity, grad=grad)
        self._sgd_(param, velocity, grad, *sgd_scalars(lr, momentum, weight_decay, nesterov))

    def adamw_(self, param, exp_avg, exp_avg_sq, grad, lr, beta1, beta2, eps, weight_decay, step):
        """In place, torch.optim.AdamW (amsgrad and maximize off): param *= 1 - lr*weight_decay;
        exp_avg = lerp(exp_avg, grad, 1 - beta1); exp_avg_sq = beta2*exp_avg_sq + (1-beta2)*grad^2;
        param -= lr/(1 - beta1^step) * exp_avg / (sqrt(exp_avg_sq)/sqrt(1 - beta2^step) + eps).
        step counts this parameter's updates from 1."""
        self._check_update("adamw_", param, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, grad=grad)
        self._adamw_(param, exp_avg, exp_avg_sq, grad, *adamw_scalars(lr, beta1, beta2, eps, weight_decay, step))

    def adam_(self, param, exp_avg, exp_avg_sq, grad, lr, beta1, beta2, eps, weight_decay, step):
        """In place, torch.optim.Adam (amsgrad and maximize off): adamw_ with the weight decay
        coupled, grad + weight_decay*param in place of the gradient, and the parameter not
        shrunk. The same kernel as adamw_ runs it."""
        self._check_update("adam_", param, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, grad=grad)
        self._adamw_(param, exp_avg, exp_avg_sq, grad,
                     *adamw_scalars(lr, beta1, beta2, eps, weight_decay, step, coupled=True))

    def sum_of_squares(self, a):
        """sum(a**2) as a Python float, accumulated in float64 in a fixed order (SQUARE_SUM_LANES):
        the same value on every device and thread count. What global-norm gradient clipping sums
        over all workers' gradients."""
        self._check_update("sum_of_squares", a)
        if not math.prod(self._shape(a)):
            return 0.0
        lanes = self._square_sums(a, min(math.prod(self._shape(a)), SQUARE_SUM_LANES))
        return math.fsum(lanes.tolist())

    def scale_(self, a, factor):
        """In place: a *= factor, rounded to float32 first (torch's clip_grad_norm_ multiplies the
        gradients by its float32 clip coefficient)."""
        self._check_update("scale_", a)
        self._scale_(a, np.float32(_finite("factor", factor, low=-math.inf)))

    def accumulate_(self, total, grad):
        """In place: total += grad, where both live (micro-batches add their gradients up before
        the one update of a step)."""
        if tuple(self._shape(total)) != tuple(self._shape(grad)):
            raise ValueError(f"gradient shape must match the total, {tuple(self._shape(grad))!r} != "
                             f"{tuple(self._shape(total))!r}")
        self._accumulate_(total, grad)

    # ---- the plain contract ------------------------------------------------------------------
    def conv2d(self, x, w, b, stride=1, padding=0, dilation=1, groups=1):
        """y (N, K, Ho, Wo) = conv2d(x, w) + b; stride, padding and dilation an int or an (h, w)
        pair; w (K, C/groups, kh, kw). A dilated or grouped conv runs as a block with no
        activation and no pool (the block is where devices implement them)."""
        x, w = _as_f32("x", x, 4), _as_f32("w", w, 4)
        block = _plain_block(stride, padding, dilation, groups)
        out_shape = conv_output_shape(x.shape, w.shape, block.stride, block.padding, block.dilation, block.groups)
        b = self._check_bias(b, w.shape[0])
        if not block.dense:
            return self.conv_block(x, w, b, block)[0]
        y = self._conv2d(x, w, b, block.stride, block.padding)
        assert y.shape == out_shape, (y.shape, out_shape)
        return y

    def conv2d_backward(self, x, w, dy, stride=1, padding=0, need_dx=True, dilation=1, groups=1):
        """(dx or None, dw, db): the gradients of sum(dy * conv2d(x, w, b)). A dilated or grouped
        conv runs its block's forward again for the context its backward needs."""
        x, w, dy = _as_f32("x", x, 4), _as_f32("w", w, 4), _as_f32("dy", dy, 4)
        block = _plain_block(stride, padding, dilation, groups)
        out_shape = conv_output_shape(x.shape, w.shape, block.stride, block.padding, block.dilation, block.groups)
        if dy.shape != out_shape:
            raise ValueError(f"dy shape must match the conv output, {dy.shape!r} != {out_shape!r}")
        if not block.dense:
            _, ctx = self.conv_block(x, w, np.zeros(w.shape[0], np.float32), block)
            dx, dw, db = self.conv_block_backward(ctx, w, dy, need_dx)
            return dx, self.download(dw), self.download(db)
        return self._conv2d_backward(x, w, dy, block.stride, block.padding, bool(need_dx))

    # ---- the fused form workers run ------------------------------------------------------------
    def conv_block(self, x, w, b, block):
        """Returns (out (N, K, Hp, Wp) numpy float32, ctx for the backward): conv + bias, then the
        block's activation and pool. w and b may be device-resident (uploaded) arrays; b None: no
        bias, and the backward's db is zeros (a device may skip summing dY for it)."""
        x = _as_f32("x", x, 4, self.channels_last)
        out_shape = block_output_shape(x.shape, self._shape(w), block)
        out, ctx = self._conv_block(x, w, b, block)
        assert out.shape == out_shape, (out.shape, out_shape)
        return out, ctx

    def conv_block_backward(self, ctx, w, dout, need_dx=True, dw_out=None, accumulate=False, on_dx=None):
        """Returns (dx numpy or None, dw, db) with dw, db in the device's array type.

        dw_out: an array of w's shape in the device's type (an earlier call's dw): dW is written
        into it, or added to what it holds with `accumulate`, and it is returned as dw. A step's
        micro-batches sum their gradients so with no fresh dW each: on the paper's conv2 a fresh
        dW is 40 MB, mapped, page-faulted and zeroed anew on every call. Without it, dw is fresh.

        on_dx (with need_dx): called with dx as soon as dx is final. A path that computes dX
        apart from dW calls it before dW's work (_conv_block_backward_dx_first), so a worker's
        partial dX is on the wire while its dW computes; elsewhere it is called at the end. dx is
        returned as well. The arithmetic is the same either way: only the order of the work moves."""
        dout = self._check_block_gradient("dout", "the block's output", ctx, dout)
        if dw_out is not None and tuple(self._shape(dw_out)) != tuple(self._shape(w)):
            raise ValueError(f"dw_out shape must match the weights, {tuple(self._shape(dw_out))!r} != "
                             f"{tuple(self._shape(w))!r}")
        if on_dx is not None and need_dx:
            return self._conv_block_backward_dx_first(ctx, w, dout, dw_out, bool(accumulate), on_dx)
        return self._conv_block_backward(ctx, w, dout, bool(need_dx), dw_out, bool(accumulate))

    def _conv_block_backward_dx_first(self, ctx, w, dout, dw_out, accumulate, on_dx):
        """conv_block_backward with on_dx: here no path computes dX apart, so on_dx comes after the
        whole backward. A device whose paths can hand dX over first overrides this."""
        dx, dw, db = self._conv_block_backward(ctx, w, dout, True, dw_out, accumulate)
        on_dx(dx)
        return dx, dw, db

    def conv_relu_pool(self, x, w, b, padding=0):
        """The paper's block: returns (pooled (N,K,H'//2,W'//2) numpy float32, ctx for the backward)."""
        return self.conv_block(x, w, b, ConvBlock(padding=padding))

    def conv_relu_pool_backward(self, ctx, w, dpooled, need_dx=True):
        """Returns (dx numpy or None, dw, db) with dw, db in the device's array type."""
        dpooled = self._check_block_gradient("dpooled", "the pooled output", ctx, dpooled)
        return self._conv_block_backward(ctx, w, dpooled, bool(need_dx), None, False)

    # ---- per-channel layers (hetconv.channelwise) -------------------------------------------------
    def activation(self, x, act):
        """(y, ctx): act (an Activation) applied to every element of x (N, C, H, W)."""
        if not isinstance(act, Activation):
            raise TypeError(f"act must be an Activation, got {type(act).__name__}")
        x = _as_f32("x", x, 4, self.channels_last)
        y, saved = self._activation(x, act)
        return y, ChannelContext("activation", act, x.shape, x.shape, saved)

    def activation_backward(self, ctx, dy):
        """dx: the gradient with respect to the activation's input, given dy for its output."""
        dy = self._check_channel_gradient("activation", ctx, dy)
        return self._activation_backward(ctx.layer, ctx.saved, dy)

    def pool(self, x, pool):
        """(y (N, C, H', W'), ctx): a Pool or a GlobalPool (the Pool of the whole map) of x."""
        x = _as_f32("x", x, 4, self.channels_last)
        n, c, h, w = x.shape
        if isinstance(pool, GlobalPool):
            pool = pool.as_pool(h, w)
        elif not isinstance(pool, Pool):
            raise TypeError(f"pool must be a Pool or a GlobalPool, got {type(pool).__name__}")
        out_shape = (n, c) + pool.output_hw(h, w)
        y, saved = self._pool(x, pool, out_shape)
        assert y.shape == out_shape, (y.shape, out_shape)
        return y, ChannelContext("pool", pool, x.shape, out_shape, saved)

    def pool_backward(self, ctx, dy):
        """dx (N, C, H, W) given dy for the pool's output."""
        dy = self._check_channel_gradient("pool", ctx, dy)
        return self._pool_backward(ctx.layer, ctx.saved, ctx.in_shape, dy)

    def channel_sums(self, x):
        """(s, ss): float64 (C,), the sums of x and of x*x over images, height and width. The
        sums of a batch's pieces add up to the whole batch's (float64 rounding aside) whatever the
        device's thread count."""
        x = _as_f32("x", x, 4, self.channels_last)
        return self._plane_sums(x, x, np.zeros(x.shape[1], np.float32))

    def batchnorm_apply(self, x, mean, invstd, weight, bias, activation=None):
        """(y, ctx): y = (x - mean) * invstd * weight + bias per channel, each a (C,) float32 (the
        batch's statistics in training, the running ones in evaluation: channelwise's
        batch_statistics / eval_statistics); weight and bias both None without affine. With
        `activation` (an Activation), y is that activation of it, in the same call: its backward
        then comes in batchnorm_grad_sums and batchnorm_backward, whose dy is for this y."""
        x = _as_f32("x", x, 4, self.channels_last)
        c = x.shape[1]
        mean, invstd = _channel_f32("mean", mean, c), _channel_f32("invstd", invstd, c)
        if (weight is None) != (bias is None):
            raise ValueError("weight and bias must both be given (affine) or both be None, got "
                             f"weight {'None' if weight is None else 'an array'} and bias "
                             f"{'None' if bias is None else 'an array'}")
        if activation is not None and not isinstance(activation, Activation):
            raise TypeError(f"activation must be an Activation or None, got {type(activation).__name__}")
        if weight is None:
            scale, shift = invstd, np.zeros(c, np.float32)
        else:
            weight, shift = _channel_f32("weight", weight, c), _channel_f32("bias", bias, c)
            scale = (invstd.astype(np.float64) * weight).astype(np.float32)
        if activation is None:
            y, saved = self._normalize(x, mean, scale, shift)
        else:
            y, saved = self._normalize_act(x, mean, scale, shift, activation)
        params = _BatchNormParams(mean, invstd, weight, scale, shift, activation)
        return y, ChannelContext("batchnorm", params, x.shape, x.shape, saved)

    def batchnorm_grad_sums(self, ctx, dy):
        """(sdy, sdyx): float64 (C,), the sums of dy and of dy * xhat (xhat = (x - mean) * invstd)
        over this piece's images, height and width: add the pieces' up, then batchnorm_backward.
        Where batchnorm_apply ran an activation, dy is first taken back through it."""
        dy = self._check_channel_gradient("batchnorm", ctx, dy)
        p = ctx.layer
        if p.activation is None:
            sdy, sdy_centred = self._batchnorm_grad_sums(ctx.saved, dy, p.mean)
        else:
            sdy, sdy_centred = self._batchnorm_act_grad_sums(ctx.saved, dy, p.mean, p.scale, p.shift, p.activation)
        return sdy, sdy_centred * p.invstd.astype(np.float64)

    def batchnorm_backward(self, ctx, dy, sdy, sdyx, count):
        """dx in training: (dy - sdy/count - xhat * sdyx/count) * invstd * weight, with sdy and
        sdyx the WHOLE batch's totals and count its values per channel (images x H x W). In
        evaluation (fixed statistics) pass sdy = sdyx = 0. Where batchnorm_apply ran an
        activation, dy is for its output and is first taken back through it."""
        dy = self._check_channel_gradient("batchnorm", ctx, dy)
        c = dy.shape[1]
        sdy, sdyx = _channel_f64("sdy", sdy, c), _channel_f64("sdyx", sdyx, c)
        if isinstance(count, (bool, np.bool_)) or not isinstance(count, (int, np.integer)) or count < 1:
            raise ValueError(f"count must be a positive integer (values per channel in the whole batch), "
                             f"got {count!r}")
        p = ctx.layer
        invstd = p.invstd.astype(np.float64)
        a = invstd if p.weight is None else invstd * p.weight
        # per channel in float64, then float32 for the elementwise pass
        coefficients = [v.astype(np.float32) for v in (sdy / count, sdyx * invstd / count, a)]
        if p.activation is None:
            return self._batchnorm_backward(ctx.saved, dy, p.mean, *coefficients)
        return self._batchnorm_act_backward(ctx.saved, dy, p.mean, p.scale, p.shift, p.activation, *coefficients)

    # BatchNorm with its activation, on a device without a fused kernel: the two run apart
    def _normalize_act(self, x, mean, scale, shift, act):
        z, norm_saved = self._normalize(x, mean, scale, shift)
        y, act_saved = self._activation(z, act)
        return y, _Composed(norm_saved, act_saved)

    def _composed_grad(self, saved, dy, act):
        if saved.grad is None:
            saved.grad = self._activation_backward(act, saved.act_saved, dy)
        return saved.grad

    def _batchnorm_act_grad_sums(self, saved, dy, mean, scale, shift, act):
        saved.grad = None                   # this dy's, not an earlier call's
        return self._batchnorm_grad_sums(saved.norm_saved, self._composed_grad(saved, dy, act), mean)

    def _batchnorm_act_backward(self, saved, dy, mean, scale, shift, act, mean_dy, k, a):
        g = self._composed_grad(saved, dy, act)
        saved.grad = None
        return self._batchnorm_backward(saved.norm_saved, g, mean, mean_dy, k, a)

    def channel_scale(self, x, mask):
        """x * mask[:, :, None, None], mask (N, C) float32: Dropout2d's forward, and its backward
        with dy for x."""
        x = _as_f32("x", x, 4, self.channels_last)
        mask = _as_f32("mask", mask, 2)
        if mask.shape != x.shape[:2]:
            raise ValueError(f"mask must have one value per (image, channel), {mask.shape!r} != {x.shape[:2]!r}")
        return self._channel_scale(x, mask)

    def _check_channel_gradient(self, op, ctx, grad):
        if not isinstance(ctx, ChannelContext) or ctx.op != op:
            got = ctx.op if isinstance(ctx, ChannelContext) else type(ctx).__name__
            raise TypeError(f"ctx must be what {op}() returned, got {got!r}")
        grad = _as_f32("dy", grad, 4, self.channels_last)
        if grad.shape != ctx.out_shape:
            raise ValueError(f"dy shape must match the {op} output, {grad.shape!r} != {ctx.out_shape!r}")
        return grad

    # ---- helpers -------------------------------------------------------------------------------
    def _shape(self, a):
        return tuple(a.shape)

    def _check_update(self, op, param, **others):
        """The arrays of an update: float32, of param's shape; host arrays C-contiguous (read as
        flat), and writable unless only read (`grad`, or the one array of sum_of_squares): an
        update is in place, and a copy would leave the caller's array as it was."""
        shape = tuple(self._shape(param))
        only = "a" if not others else "param"
        for name, a in ((only, param), *others.items()):
            if getattr(a, "dtype", None) != np.float32:
                raise TypeError(f"{op}: {name} must be float32, got {getattr(a, 'dtype', type(a).__name__)}")
            if tuple(self._shape(a)) != shape:
                raise ValueError(f"{name} shape must match param, {tuple(self._shape(a))!r} != {shape!r}")
            if isinstance(a, np.ndarray):
                if not a.flags.c_contiguous:
                    raise ValueError(f"{op}: {name} must be C-contiguous (it is read as one flat run), "
                                     f"got strides {a.strides!r}")
                if not a.flags.writeable and name != "grad" and op != "sum_of_squares":
                    raise ValueError(f"{op}: {name} is read-only, but it is updated in place")

    def _check_bias(self, b, k):
        if b is None:
            return np.zeros(k, np.float32)
        b = _as_f32("b", b, 1)
        if b.shape != (k,):
            raise ValueError(f"bias must have one value per kernel, {b.shape!r} != {(k,)!r}")
        return b

    def _check_block_gradient(self, name, what, ctx, grad):
        grad = _as_f32(name, grad, 4, self.channels_last)
        expected = tuple(self._ctx_pooled_shape(ctx))
        if grad.shape != expected:
            raise ValueError(f"{name} shape must match {what}, {grad.shape!r} != {expected!r}")
        return grad

    def describe(self):
        """One line for logs and plan tables."""
        return self.name

    def declines_block(self, block):
        """'' where this device runs the conv block `block` (its dilation and groups), else why
        not, in words: what a shard asks before it takes a layer, so a layer no kernel of the
        device runs is refused when the plan is loaded or calibrated, naming the layer, never
        mid-step."""
        return ""

    def conv_block_needs_timing(self, x_shape, w_shape, block):
        """Whether the first conv_block call with these shapes would time the device's paths (a
        CPU device's "auto" choice, seconds per call shape): a step that meets such a shape takes
        that long once, so the engine runs it before the step (ShardEngine.prepare_calls).
        Devices with one path per call shape never time one."""
        return False

    def choose_conv_path(self, x, w, block):
        """Make the choice the first conv_block call of x's and w's shapes would make (timing the
        paths where it times them), without running the call: what ShardEngine.prepare_calls
        asks for a shape conv_block_needs_timing named. The values of x and w do not matter."""

    def conv_paths(self):
        """{conv call shape: the path it runs}, for devices with more than one path."""
        return {}

    def conv_path_choices(self):
        """[{call, key, path, why, seconds, calls}] per conv call shape run so far: the path it
        takes, why ("timed", "rule: ...", "forced", ...), each timed path's seconds and how many
        calls have run it (`key`: the call as devices.wisdom.call_key writes it); what a worker
        reports at calibration. Devices with one path per call shape have none."""
        return []

    def describe_conv_paths(self):
        """One line per conv call shape run so far: the path it takes and why. Devices with one
        path per call shape have nothing to say."""
        return []

    def conv_path_record(self):
        """{machine, choices: [{call, path, why}]}: the choices this device made from a
        measurement, keyed as devices.wisdom keys them, for a run's metrics and checkpoints; None
        for a device with one path per call shape."""
        return None

    def preload_conv_paths(self, records):
        """Run the paths a checkpoint recorded (records as conv_path_record gives them) where
        their machine key is this device's; returns how many call shapes it took (none here)."""
        return 0

    # ---- backend ---------------------------------------------------------------------------------
    def _conv2d(self, x, w, b, stride, padding):
        raise NotImplementedError

    def _conv2d_backward(self, x, w, dy, stride, padding, need_dx):
        raise NotImplementedError

    def _conv_block(self, x, w, b, block):
        """A backend that has only the paper block's fused form (`_conv_relu_pool`, square
        padding as an int) serves that block; any other block needs its own _conv_block."""
        if not (block.is_paper and block.padding[0] == block.padding[1]):
            raise DeviceError(f"the {self.name} device runs only the paper's conv block "
                              f"(stride 1, ReLU, 2x2 max-pool, square padding), not {block!r}")
        return self._conv_relu_pool(x, w, b, block.padding[0])

    def _conv_block_backward(self, ctx, w, dout, need_dx, dw_out, accumulate):
        dx, dw, db = self._conv_relu_pool_backward(ctx, w, dout, need_dx)
        return dx, self._dw_into(dw_out, accumulate, dw), db

    def _dw_into(self, dw_out, accumulate, dw):
        """dw as conv_block_backward returns it, for a backend that made a fresh one: written or
        added into dw_out where one is given (one more pass over dW)."""
        if dw_out is None:
            return dw
        (self._accumulate_ if accumulate else self._assign_)(dw_out, dw)
        return dw_out

    def _conv_relu_pool(self, x, w, b, padding):
        raise NotImplementedError

    def _conv_relu_pool_backward(self, ctx, w, dpooled, need_dx):
        raise NotImplementedError

    def _ctx_pooled_shape(self, ctx):
        return ctx.pooled_shape

    def _sgd_(self, param, velocity, grad, lr, momentum, weight_decay, nesterov):
        raise NotImplementedError

    def _adamw_(self, param, exp_avg, exp_avg_sq, grad, *scalars):
        """scalars: adamw_scalars', in update_rules' adamw order."""
        raise NotImplementedError

    def _square_sums(self, a, lanes):
        """numpy float64 (lanes,): lane j = sum of a.flat[i]**2 over i = j (mod lanes), i ascending."""
        raise NotImplementedError

    def _scale_(self, a, factor):
        raise NotImplementedError

    # per-channel layers: checked float32 C-contiguous arrays in, numpy out; `saved` is the
    # backend's own (what its backward needs)
    def _activation(self, x, act):
        """(y, saved)."""
        raise NotImplementedError

    def _activation_backward(self, act, saved, dy):
        raise NotImplementedError

    def _pool(self, x, pool, out_shape):
        """(y, saved); pool is a Pool (a global pool arrives as the Pool of the whole map)."""
        raise NotImplementedError

    def _pool_backward(self, pool, saved, in_shape, dy):
        raise NotImplementedError

    def _plane_sums(self, a, b, shift):
        """float64 (C,) each: the sums of a and of a * (b - shift[c]) over N, H and W."""
        raise NotImplementedError

    def _normalize(self, x, mean, scale, shift):
        """(y, saved): y = (x - mean) * scale + shift per channel."""
        raise NotImplementedError

    def _batchnorm_grad_sums(self, saved, dy, mean):
        """(sum of dy, sum of dy * (x - mean)) per channel, float64."""
        raise NotImplementedError

    def _batchnorm_backward(self, saved, dy, mean, mean_dy, k, a):
        """dx = (dy - mean_dy - (x - mean) * k) * a per channel."""
        raise NotImplementedError

    def _channel_scale(self, x, mask):
        raise NotImplementedError

    def _accumulate_(self, total, grad):
        np.add(total, grad, out=total)

    def _assign_(self, dst, src):
        np.copyto(dst, src)
