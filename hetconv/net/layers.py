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


def softmax_cross_entropy(logits, labels):
    """Mean cross-entropy over the batch and its gradient with respect to the logits."""
    logits = np.asarray(logits, np.float64)
    n = logits.shape[0]
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    loss = -log_probs[np.arange(n), labels].mean()
    grad = np.exp(log_probs)
    grad[np.arange(n), labels] -= 1
    return float(loss), (grad / n).astype(np.float32)
