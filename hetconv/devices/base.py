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
device's own array type, `download` turns it back, and `sgd_` updates parameters where they live.
For the CPU device both are identities.
"""
import numpy as np

from hetconv.geometry import (ACTIVATIONS, PAPER_BLOCK, POOLS, ConvBlock, as_pair,  # noqa: F401  (the contract's names)
                              window_output_size)


class DeviceError(RuntimeError):
    """A device cannot be opened or was asked for something it cannot do."""


def _as_f32(name, a, ndim):
    a = np.asarray(a)
    if a.dtype != np.float32:
        raise TypeError(f"{name} must be float32, got {a.dtype}")
    if a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {a.shape!r}")
    return np.ascontiguousarray(a)


def conv_output_shape(x_shape, w_shape, stride=(1, 1), padding=(0, 0)):
    """(N, K, Ho, Wo) of conv2d(x, w) at this stride and padding, or ValueError naming the values."""
    n, c, h, w = x_shape
    k, wc, kh, kw = w_shape
    if wc != c:
        raise ValueError(f"weights expect {wc} input channels but input has {c}: w {tuple(w_shape)!r}, x {tuple(x_shape)!r}")
    stride = as_pair("stride", stride, 1)
    padding = as_pair("padding", padding, 0)
    if h + 2 * padding[0] < kh or w + 2 * padding[1] < kw:
        raise ValueError(f"kernel {kh}x{kw} does not fit input {h}x{w} with padding {padding!r}")
    ho = window_output_size(h, kh, stride[0], padding[0])
    wo = window_output_size(w, kw, stride[1], padding[1])
    return n, k, ho, wo


def block_output_shape(x_shape, w_shape, block):
    """(N, K, Hp, Wp) leaving a conv block: after the conv, the activation and the pool."""
    if not isinstance(block, ConvBlock):
        raise TypeError(f"block must be a ConvBlock, got {type(block).__name__}")
    n, k, ho, wo = conv_output_shape(x_shape, w_shape, block.stride, block.padding)
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


class Device:
    """Base class: public, checked methods; backends implement the underscore ones."""

    name = "abstract"

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

    def sgd_(self, param, velocity, grad, lr, momentum, weight_decay):
        """In place: v = momentum*v + grad + weight_decay*param; param -= lr*v (PyTorch's SGD)."""
        self._sgd_(param, velocity, grad, float(lr), float(momentum), float(weight_decay))

    def accumulate_(self, total, grad):
        """In place: total += grad, where both live (micro-batches add their gradients up before
        the one update of a step)."""
        if tuple(self._shape(total)) != tuple(self._shape(grad)):
            raise ValueError(f"gradient shape must match the total, {tuple(self._shape(grad))!r} != "
                             f"{tuple(self._shape(total))!r}")
        self._accumulate_(total, grad)

    # ---- the plain contract ------------------------------------------------------------------
    def conv2d(self, x, w, b, stride=1, padding=0):
        """y (N, K, Ho, Wo) = conv2d(x, w) + b; stride and padding an int or an (h, w) pair."""
        x, w = _as_f32("x", x, 4), _as_f32("w", w, 4)
        stride, padding = as_pair("stride", stride, 1), as_pair("padding", padding, 0)
        out_shape = conv_output_shape(x.shape, w.shape, stride, padding)
        b = self._check_bias(b, w.shape[0])
        y = self._conv2d(x, w, b, stride, padding)
        assert y.shape == out_shape, (y.shape, out_shape)
        return y

    def conv2d_backward(self, x, w, dy, stride=1, padding=0, need_dx=True):
        """(dx or None, dw, db): the gradients of sum(dy * conv2d(x, w, b))."""
        x, w, dy = _as_f32("x", x, 4), _as_f32("w", w, 4), _as_f32("dy", dy, 4)
        stride, padding = as_pair("stride", stride, 1), as_pair("padding", padding, 0)
        out_shape = conv_output_shape(x.shape, w.shape, stride, padding)
        if dy.shape != out_shape:
            raise ValueError(f"dy shape must match the conv output, {dy.shape!r} != {out_shape!r}")
        return self._conv2d_backward(x, w, dy, stride, padding, bool(need_dx))

    # ---- the fused form workers run ------------------------------------------------------------
    def conv_block(self, x, w, b, block):
        """Returns (out (N, K, Hp, Wp) numpy float32, ctx for the backward): conv + bias, then the
        block's activation and pool. w and b may be device-resident (uploaded) arrays."""
        x = _as_f32("x", x, 4)
        out_shape = block_output_shape(x.shape, self._shape(w), block)
        out, ctx = self._conv_block(x, w, b, block)
        assert out.shape == out_shape, (out.shape, out_shape)
        return out, ctx

    def conv_block_backward(self, ctx, w, dout, need_dx=True, dw_out=None, accumulate=False):
        """Returns (dx numpy or None, dw, db) with dw, db in the device's array type.

        dw_out: an array of w's shape in the device's type (an earlier call's dw): dW is written
        into it, or added to what it holds with `accumulate`, and it is returned as dw. A step's
        micro-batches sum their gradients so with no fresh dW each: on the paper's conv2 a fresh
        dW is 40 MB, mapped, page-faulted and zeroed anew on every call. Without it, dw is fresh."""
        dout = self._check_block_gradient("dout", "the block's output", ctx, dout)
        if dw_out is not None and tuple(self._shape(dw_out)) != tuple(self._shape(w)):
            raise ValueError(f"dw_out shape must match the weights, {tuple(self._shape(dw_out))!r} != "
                             f"{tuple(self._shape(w))!r}")
        return self._conv_block_backward(ctx, w, dout, bool(need_dx), dw_out, bool(accumulate))

    def conv_relu_pool(self, x, w, b, padding=0):
        """The paper's block: returns (pooled (N,K,H'//2,W'//2) numpy float32, ctx for the backward)."""
        return self.conv_block(x, w, b, ConvBlock(padding=padding))

    def conv_relu_pool_backward(self, ctx, w, dpooled, need_dx=True):
        """Returns (dx numpy or None, dw, db) with dw, db in the device's array type."""
        dpooled = self._check_block_gradient("dpooled", "the pooled output", ctx, dpooled)
        return self._conv_block_backward(ctx, w, dpooled, bool(need_dx), None, False)

    # ---- helpers -------------------------------------------------------------------------------
    def _shape(self, a):
        return tuple(a.shape)

    def _check_bias(self, b, k):
        if b is None:
            return np.zeros(k, np.float32)
        b = _as_f32("b", b, 1)
        if b.shape != (k,):
            raise ValueError(f"bias must have one value per kernel, {b.shape!r} != {(k,)!r}")
        return b

    def _check_block_gradient(self, name, what, ctx, grad):
        grad = _as_f32(name, grad, 4)
        expected = tuple(self._ctx_pooled_shape(ctx))
        if grad.shape != expected:
            raise ValueError(f"{name} shape must match {what}, {grad.shape!r} != {expected!r}")
        return grad

    def describe(self):
        """One line for logs and plan tables."""
        return self.name

    def conv_paths(self):
        """{conv call shape: the path it runs}, for devices with more than one path."""
        return {}

    def conv_path_choices(self):
        """[{call, path, why, seconds}] per conv call shape run so far: the path it takes, why
        ("timed", "rule: ...", "forced", ...) and each timed path's seconds; what a worker reports
        at calibration. Devices with one path per call shape have none."""
        return []

    def describe_conv_paths(self):
        """One line per conv call shape run so far: the path it takes and why. Devices with one
        path per call shape have nothing to say."""
        return []

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

    def _sgd_(self, param, velocity, grad, lr, momentum, weight_decay):
        raise NotImplementedError

    def _accumulate_(self, total, grad):
        np.add(total, grad, out=total)

    def _assign_(self, dst, src):
        np.copyto(dst, src)
