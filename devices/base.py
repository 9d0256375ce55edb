"""The device contract: what every `--device` kind provides, checked once here.

All arrays crossing this interface from the caller are numpy float32, NCHW, weights (K, C, kh, kw),
stride 1, cross-correlation as PyTorch's conv2d. The public methods check shapes and dtypes and
name the offending values; a backend implements the underscore methods and may assume checked,
C-contiguous float32 input.

Besides the plain contract (conv2d / conv2d_backward), a device offers the fused form a worker
runs: conv + bias + ReLU + 2x2 max-pool, whose backward needs only the opaque `ctx` the forward
returned. Parameters may live on the device between steps: `upload` turns a numpy array into the
device's own array type, `download` turns it back, and `sgd_` updates parameters where they live.
For the CPU device both are identities.
"""
import numpy as np

from hetconv.geometry import conv_output_hw, pooled_hw


class DeviceError(RuntimeError):
    """A device cannot be opened or was asked for something it cannot do."""


def _as_f32(name, a, ndim):
    a = np.asarray(a)
    if a.dtype != np.float32:
        raise TypeError(f"{name} must be float32, got {a.dtype}")
    if a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {a.shape!r}")
    return np.ascontiguousarray(a)


def conv_output_shape(x_shape, w_shape, padding):
    n, c, h, w = x_shape
    k, wc, kh, kw = w_shape
    if wc != c:
        raise ValueError(f"weights expect {wc} input channels but input has {c}: w {tuple(w_shape)!r}, x {tuple(x_shape)!r}")
    if not isinstance(padding, (int, np.integer)) or padding < 0:
        raise ValueError(f"padding must be a non-negative integer, got {padding!r}")
    ho, wo = conv_output_hw(h, w, kh, kw, padding)
    if ho < 1 or wo < 1:
        raise ValueError(f"kernel {kh}x{kw} does not fit input {h}x{w} with padding {padding}")
    return n, k, ho, wo


def pooled_shape(x_shape, w_shape, padding):
    n, k, ho, wo = conv_output_shape(x_shape, w_shape, padding)
    if ho < 2 or wo < 2:
        raise ValueError(f"conv output {ho}x{wo} is too small for a 2x2 max-pool")
    return (n, k) + pooled_hw(ho, wo)


class Device:
    """Base class: public, checked methods; backends implement the underscore ones."""

    name = "abstract"

    # ---- parameters that may stay resident on the device -------------------------------------
    def upload(self, a):
        """A device-owned copy (never a view of the caller's or a received, read-only buffer)."""
        return np.array(a, dtype=np.float32, order="C", copy=True)

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
    def conv2d(self, x, w, b, padding=0):
        x, w = _as_f32("x", x, 4), _as_f32("w", w, 4)
        out_shape = conv_output_shape(x.shape, w.shape, padding)
        b = self._check_bias(b, w.shape[0])
        y = self._conv2d(x, w, b, int(padding))
        assert y.shape == out_shape, (y.shape, out_shape)
        return y

    def conv2d_backward(self, x, w, dy, padding=0, need_dx=True):
        x, w, dy = _as_f32("x", x, 4), _as_f32("w", w, 4), _as_f32("dy", dy, 4)
        out_shape = conv_output_shape(x.shape, w.shape, padding)
        if dy.shape != out_shape:
            raise ValueError(f"dy shape must match the conv output, {dy.shape!r} != {out_shape!r}")
        return self._conv2d_backward(x, w, dy, int(padding), bool(need_dx))

    # ---- the fused form workers run ------------------------------------------------------------
    def conv_relu_pool(self, x, w, b, padding=0):
        """Returns (pooled (N,K,H'//2,W'//2) numpy float32, ctx for the backward)."""
        x = _as_f32("x", x, 4)
        w_shape = self._shape(w)
        out_shape = pooled_shape(x.shape, w_shape, padding)
        y, ctx = self._conv_relu_pool(x, w, b, int(padding))
        assert y.shape == out_shape, (y.shape, out_shape)
        return y, ctx

    def conv_relu_pool_backward(self, ctx, w, dpooled, need_dx=True):
        """Returns (dx numpy or None, dw, db) with dw, db in the device's array type."""
        dpooled = _as_f32("dpooled", dpooled, 4)
        expected = self._ctx_pooled_shape(ctx)
        if dpooled.shape != tuple(expected):
            raise ValueError(f"dpooled shape must match the pooled output, {dpooled.shape!r} != {tuple(expected)!r}")
        return self._conv_relu_pool_backward(ctx, w, dpooled, bool(need_dx))

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

    def describe(self):
        """One line for logs and plan tables."""
        return self.name

    # ---- backend ---------------------------------------------------------------------------------
    def _conv2d(self, x, w, b, padding):
        raise NotImplementedError

    def _conv2d_backward(self, x, w, dy, padding, need_dx):
        raise NotImplementedError

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
