"""Slow, obviously correct numpy definitions of every conv operation hetconv runs.

This file is the definition that every device kernel is tested against, so it is written for
clarity, not speed: a convolution is a sum over the kh*kw kernel offsets of shifted views of the
padded input, each contracted with one tap of the weights. Cross-correlation (as PyTorch's
conv2d), NCHW, weights (K, C, kh, kw), stride 1, zero padding `padding` on every side.
Everything is computed in float64 and returned as float32.
"""
import numpy as np

from hetconv.geometry import conv_output_hw


def conv2d(x, w, b, padding=0):
    """y[n,k,i,j] = b[k] + sum_{c,u,v} xpad[n,c,i+u,j+v] * w[k,c,u,v]."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    n, c, h, wd = x.shape
    k, _, kh, kw = w.shape
    ho, wo = conv_output_hw(h, wd, kh, kw, padding)
    xp = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    y = np.zeros((n, k, ho, wo))
    for u in range(kh):
        for v in range(kw):
            patch = xp[:, :, u:u + ho, v:v + wo]               # (N, C, Ho, Wo)
            y += np.einsum("nchw,kc->nkhw", patch, w[:, :, u, v])
    if b is not None:
        y += np.asarray(b, np.float64)[None, :, None, None]
    return y.astype(np.float32)


def conv2d_backward(x, w, dy, padding=0, need_dx=True):
    """Gradients of sum(dy * conv2d(x, w, b)) with respect to x, w and b."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    dy = np.asarray(dy, np.float64)
    n, c, h, wd = x.shape
    k, _, kh, kw = w.shape
    ho, wo = conv_output_hw(h, wd, kh, kw, padding)
    xp = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    dw = np.zeros(w.shape)
    dxp = np.zeros(xp.shape)
    for u in range(kh):
        for v in range(kw):
            patch = xp[:, :, u:u + ho, v:v + wo]
            dw[:, :, u, v] = np.einsum("nchw,nkhw->kc", patch, dy)
            if need_dx:
                dxp[:, :, u:u + ho, v:v + wo] += np.einsum("nkhw,kc->nchw", dy, w[:, :, u, v])
    db = dy.sum(axis=(0, 2, 3))
    dx = None
    if need_dx:
        dx = dxp[:, :, padding:padding + h, padding:padding + wd].astype(np.float32)
    return dx, dw.astype(np.float32), db.astype(np.float32)


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
    """The fused form workers run: max-pool 2x2 of relu(conv2d(x, w, b))."""
    return relu_maxpool2(conv2d(x, w, b, padding))


def conv_relu_pool_backward(x, w, b, dpooled, padding=0, need_dx=True):
    y = conv2d(x, w, b, padding)
    dy = relu_maxpool2_backward(y, dpooled)
    return conv2d_backward(x, w, dy, padding, need_dx)
