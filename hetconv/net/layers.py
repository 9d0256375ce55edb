"""The layers that stay on the coordinator: fully connected, ReLU, softmax cross-entropy.

Plain numpy on float32; the FC GEMMs go to BLAS. Shapes are noted as (batch, features).
"""
import numpy as np

from hetconv.params import default_init, sgd_update


class Linear:
    """y = x @ w.T + b, with w (out, in) as in PyTorch."""

    def __init__(self, w, b):
        self.w = np.ascontiguousarray(w, np.float32)
        self.b = np.ascontiguousarray(b, np.float32)
        self.vw = np.zeros_like(self.w)
        self.vb = np.zeros_like(self.b)
        self._x = None

    @classmethod
    def init(cls, n_in, n_out, rng):
        return cls(default_init(rng, (n_out, n_in), n_in), np.zeros(n_out, np.float32))

    def forward(self, x):                           # (N, in) -> (N, out)
        self._x = x
        return x @ self.w.T + self.b

    def backward(self, dy, accumulate=False):        # (N, out) -> (N, in); keeps (or adds to) dw, db
        dw, db = dy.T @ self._x, dy.sum(axis=0)
        if accumulate:                               # a later micro-batch of the same step
            self.dw += dw
            self.db += db
        else:
            self.dw, self.db = dw, db
        dx = dy @ self.w
        self._x = None
        return dx

    def step(self, lr, momentum, weight_decay):
        sgd_update(self.w, self.vw, self.dw, lr, momentum, weight_decay)
        sgd_update(self.b, self.vb, self.db, lr, momentum, 0.0)   # no decay on biases
        self.dw = self.db = None


def relu(x):
    return np.maximum(x, 0)


def relu_backward(y, dy):
    """Given y = relu(x) and dL/dy, dL/dx."""
    return np.where(y > 0, dy, 0).astype(np.float32)


def softmax_cross_entropy(logits, labels, label_smoothing=0.0):
    """Mean cross-entropy over the batch and its gradient with respect to the logits, as
    F.cross_entropy(logits, labels, label_smoothing=e): the target is (1 - e) on the label plus
    e / classes on every class. Computed in float64, the gradient returned in float32."""
    logits = np.asarray(logits, np.float64)
    labels = np.asarray(labels)
    if logits.ndim != 2:
        raise ValueError(f"logits must be (batch, classes), got shape {logits.shape!r}")
    n, classes = logits.shape
    if labels.shape != (n,) or (n and not np.issubdtype(labels.dtype, np.integer)):
        raise ValueError(f"labels must be {n} integers (one per row of logits), "
                         f"got {labels.dtype} shape {labels.shape!r}")
    if n and (labels.min() < 0 or labels.max() >= classes):
        raise ValueError(f"labels must be class indices in 0..{classes - 1}, got {labels.min()}..{labels.max()}")
    smoothing_ok = isinstance(label_smoothing, (int, float)) and not isinstance(label_smoothing, bool)
    if not (smoothing_ok and 0.0 <= label_smoothing <= 1.0):
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    target = np.full_like(log_probs, label_smoothing / classes)
    target[np.arange(n), labels] += 1.0 - label_smoothing
    loss = -(target * log_probs).sum(axis=1).mean()
    grad = np.exp(log_probs) - target
    return float(loss), (grad / n).astype(np.float32)
