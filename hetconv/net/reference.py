"""Slow, obviously correct numpy definitions of every conv operation hetconv runs.

This file is the definition that every device kernel is tested against, so it is written for
clarity, not speed: a convolution is a sum over the kh*kw kernel offsets of strided views of the
padded input, each contracted with one tap of the weights; a pool is a loop over its output
positions, each reducing one window. Cross-correlation (as PyTorch's conv2d), NCHW, weights
(K, C/groups, kh, kw), stride, zero padding and dilation an int or an (height, width) pair;
with `groups` g, kernel group i (kernels i*K/g ...) reads input channel group i only. A conv block is conv +
bias -> activation (ReLU or none) -> pool (max, average or none), with PyTorch's semantics: floor
mode; a max-pool pads with -inf and routes each output's gradient to the first maximum of its
window in row-major order; an average pool counts its zero padding (divides by the whole
window); overlapping windows add their gradients.
Everything is computed in float64 and returned as float32.
"""
import numpy as np

from hetconv.geometry import window_output_size


def _pair(v):
    return tuple(int(a) for a in v) if isinstance(v, (tuple, list)) else (int(v), int(v))


def _conv64(x, w, b, stride, padding, dilation=1, groups=1):
    """conv2d in float64: y[n,k,i,j] = b[k] + sum_{c,u,v} xpad[n,g*Cg+c,i*sh+u*dh,j*sw+v*dw] * w[k,c,u,v],
    g = k // (K/groups) the kernel's group, Cg = C/groups."""
    (sh, sw), (ph, pw), (dh, dw) = _pair(stride), _pair(padding), _pair(dilation)
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    n, c, h, wd = x.shape
    k, cg, kh, kw = w.shape
    kg = k // groups
    ho = window_output_size(h, dh * (kh - 1) + 1, sh, ph)
    wo = window_output_size(wd, dw * (kw - 1) + 1, sw, pw)
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    y = np.zeros((n, k, ho, wo))
    for g in range(groups):
        for u in range(kh):
            for v in range(kw):
                patch = xp[:, g * cg:(g + 1) * cg, u * dh:u * dh + sh * (ho - 1) + 1:sh,
                           v * dw:v * dw + sw * (wo - 1) + 1:sw]                   # (N, Cg, Ho, Wo)
                y[:, g * kg:(g + 1) * kg] += np.einsum("nchw,kc->nkhw", patch, w[g * kg:(g + 1) * kg, :, u, v])
    if b is not None:
        y += np.asarray(b, np.float64)[None, :, None, None]
    return y


def _conv_backward64(x, w, dy, stride, padding, need_dx, dilation=1, groups=1):
    (sh, sw), (ph, pw), (dh, dwd) = _pair(stride), _pair(padding), _pair(dilation)
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    dy = np.asarray(dy, np.float64)
    n, c, h, wd = x.shape
    k, cg, kh, kw = w.shape
    kg = k // groups
    ho, wo = dy.shape[2], dy.shape[3]
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    dw = np.zeros(w.shape)
    dxp = np.zeros(xp.shape)
    for g in range(groups):
        ks, cs = slice(g * kg, (g + 1) * kg), slice(g * cg, (g + 1) * cg)
        for u in range(kh):
            for v in range(kw):
                window = (slice(None), cs, slice(u * dh, u * dh + sh * (ho - 1) + 1, sh),
                          slice(v * dwd, v * dwd + sw * (wo - 1) + 1, sw))
                dw[ks, :, u, v] = np.einsum("nchw,nkhw->kc", xp[window], dy[:, ks])
                if need_dx:
                    dxp[window] += np.einsum("nkhw,kc->nchw", dy[:, ks], w[ks, :, u, v])
    db = dy.sum(axis=(0, 2, 3))
    dx = dxp[:, :, ph:ph + h, pw:pw + wd] if need_dx else None
    return dx, dw, db


def conv2d(x, w, b, stride=1, padding=0, dilation=1, groups=1):
    """y[n,k,i,j] = b[k] + sum_{c,u,v} xpad[n,g*Cg+c,i*sh+u*dh,j*sw+v*dw] * w[k,c,u,v] (see _conv64)."""
    return _conv64(x, w, b, stride, padding, dilation, groups).astype(np.float32)


def conv2d_backward(x, w, dy, stride=1, padding=0, need_dx=True, dilation=1, groups=1):
    """Gradients of sum(dy * conv2d(x, w, b)) with respect to x (None unless need_dx), w and b."""
    dx, dw, db = _conv_backward64(x, w, dy, stride, padding, need_dx, dilation, groups)
    return (None if dx is None else dx.astype(np.float32)), dw.astype(np.float32), db.astype(np.float32)


def activation(y, kind):
    """relu(y) or y itself ("none"); y is the conv's output with bias (the pre-activation)."""
    if kind == "relu":
        return np.maximum(y, 0)
    if kind == "none":
        return y
    raise ValueError(f"activation must be 'relu' or 'none', got {kind!r}")


def activation_backward(y, dy, kind):
    """The gradient with respect to the pre-activation `y`, given `dy` with respect to
    activation(y). ReLU passes it where y > 0 only (zero at y == 0, as PyTorch)."""
    if kind == "relu":
        return np.where(np.asarray(y) > 0, dy, 0).astype(np.asarray(dy).dtype)
    if kind == "none":
        return dy
    raise ValueError(f"activation must be 'relu' or 'none', got {kind!r}")


def _pool_windows(shape, kernel, stride, padding):
    """(a, e, rows, cols) for every output position of a pool over a (H, W) plane: the slices of
    its window in the padded plane."""
    (kh, kw), (sh, sw), (ph, pw) = _pair(kernel), _pair(stride), _pair(padding)
    h, w = shape[-2:]
    hp, wp = window_output_size(h, kh, sh, ph), window_output_size(w, kw, sw, pw)
    for a in range(hp):
        for e in range(wp):
            yield a, e, slice(a * sh, a * sh + kh), slice(e * sw, e * sw + kw)


def _pool64(y, kind, kernel, stride, padding):
    y = np.asarray(y, np.float64)
    if kind == "none":
        return y
    (kh, kw), (sh, sw), (ph, pw) = _pair(kernel), _pair(stride), _pair(padding)
    if kind not in ("max", "avg"):
        raise ValueError(f"pool must be 'max', 'avg' or 'none', got {kind!r}")
    n, k, h, w = y.shape
    # max pads with -inf (never a window's maximum), avg with zeros (counted in the average)
    yp = np.pad(y, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=-np.inf if kind == "max" else 0.0)
    out = np.zeros((n, k, window_output_size(h, kh, sh, ph), window_output_size(w, kw, sw, pw)))
    for a, e, rows, cols in _pool_windows(y.shape, kernel, stride, padding):
        window = yp[:, :, rows, cols]
        out[:, :, a, e] = window.max(axis=(2, 3)) if kind == "max" else window.sum(axis=(2, 3)) / (kh * kw)
    return out


def _pool_backward64(y, dout, kind, kernel, stride, padding):
    y = np.asarray(y, np.float64)
    dout = np.asarray(dout, np.float64)
    if kind == "none":
        return dout
    (kh, kw), (sh, sw), (ph, pw) = _pair(kernel), _pair(stride), _pair(padding)
    n, k, h, w = y.shape
    yp = np.pad(y, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=-np.inf)
    dyp = np.zeros(yp.shape)
    for a, e, rows, cols in _pool_windows(y.shape, kernel, stride, padding):
        if kind == "avg":
            dyp[:, :, rows, cols] += dout[:, :, a, e][:, :, None, None] / (kh * kw)
            continue
        first_max = yp[:, :, rows, cols].reshape(n, k, kh * kw).argmax(axis=2)    # (N, K): first wins
        for t in range(kh * kw):
            dyp[:, :, rows.start + t // kw, cols.start + t % kw] += np.where(first_max == t, dout[:, :, a, e], 0)
    return dyp[:, :, ph:ph + h, pw:pw + w]


def pool2d(y, kind, kernel, stride, padding):
    """max-pool or average pool (kind "max" / "avg") of y, or y itself ("none")."""
    return _pool64(y, kind, kernel, stride, padding).astype(np.float32)


def pool2d_backward(y, dout, kind, kernel, stride, padding):
    """The gradient with respect to the pool's input `y`, given `dout` with respect to its output."""
    return _pool_backward64(y, dout, kind, kernel, stride, padding).astype(np.float32)


def _block_args(block):
    return block.pool, block.pool_kernel, block.pool_stride, block.pool_padding


def conv_block(x, w, b, block):
    """pool(activation(conv2d(x, w, b))) as the ConvBlock `block` says."""
    y = _conv64(x, w, b, block.stride, block.padding, block.dilation, block.groups)
    return _pool64(activation(y, block.activation), *_block_args(block)).astype(np.float32)


def conv_block_backward(x, w, b, block, dout, need_dx=True):
    """(dx or None, dw, db): the gradients of sum(dout * conv_block(x, w, b, block))."""
    y = _conv64(x, w, b, block.stride, block.padding, block.dilation, block.groups)
    da = _pool_backward64(activation(y, block.activation), dout, *_block_args(block))
    dy = activation_backward(y, da, block.activation)
    dx, dw, db = _conv_backward64(x, w, dy, block.stride, block.padding, need_dx, block.dilation, block.groups)
    return (None if dx is None else dx.astype(np.float32)), dw.astype(np.float32), db.astype(np.float32)


def relu_maxpool2(y):
    """max-pool 2x2 (stride 2, floor: a trailing odd row/column is dropped) of relu(y)."""
    y = np.maximum(np.asarray(y, np.float32), 0)
    n, k, h, w = y.shape
    hp, wp = h // 2, w // 2
    blocks = y[:, :, :2 * hp, :2 * wp].reshape(n, k, hp, 2, wp, 2)
    return blocks.max(axis=(3, 5))


def relu_maxpool2_backward(y, dpooled):
    """Gradient with respect to the pre-activation y. The gradient of each pooling window goes
    to its first maximal element (row-major order), and only where that maximum is > 0."""
    y = np.asarray(y, np.float32)
    n, k, h, w = y.shape
    hp, wp = h // 2, w // 2
    dy = np.zeros(y.shape, np.float32)
    for i in range(hp):
        for j in range(wp):
            window = y[:, :, 2 * i:2 * i + 2, 2 * j:2 * j + 2].reshape(n, k, 4)
            first_max = window.argmax(axis=2)                   # (N, K), first maximum wins
            active = window.max(axis=2) > 0
            for t in range(4):
                hit = (first_max == t) & active
                dy[:, :, 2 * i + t // 2, 2 * j + t % 2] += np.where(hit, dpooled[:, :, i, j], 0)
    return dy


def conv_relu_pool(x, w, b, padding=0):
    """The paper's block: max-pool 2x2 of relu(conv2d(x, w, b))."""
    return relu_maxpool2(conv2d(x, w, b, padding=padding))


def conv_relu_pool_backward(x, w, b, dpooled, padding=0, need_dx=True):
    y = conv2d(x, w, b, padding=padding)
    dy = relu_maxpool2_backward(y, dpooled)
    return conv2d_backward(x, w, dy, padding=padding, need_dx=need_dx)
