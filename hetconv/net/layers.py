"""The layers that stay on the coordinator: fully connected, ReLU, softmax cross-entropy.

Plain numpy on float32. Shapes are noted as (batch, features). A Linear's GEMMs are numpy's, or
those of the host device the network gives it (HostArrays.gemm: oneDNN's sgemm where installed,
see there for why).
"""
import numpy as np

from hetconv.params import default_init, numpy_gemm
from hetconv.update import SLOTS, apply_update, slot_name


class Linear:
    """y = x @ w.T + b, with w (out, in) as in PyTorch; without a bias, b stays zero. `slots`:
    the optimizer's state per parameter, {"w.momentum_buffer": ..., ...}, made at the first
    update (or loaded)."""

    def __init__(self, w, b, has_bias=True, gemm=numpy_gemm):
        self.gemm = gemm                             # gemm(a, b, out=None, accumulate=False), as numpy_gemm
        self.w = np.ascontiguousarray(w, np.float32)
        self.b = np.ascontiguousarray(b, np.float32)
        self.has_bias = has_bias
        self.slots = {}
        self.dw = self.db = None
        self._x = None
        self._weight_grads_due = None                # (dy, x, accumulate) of a backward(weights_later=True)

    @classmethod
    def init(cls, n_in, n_out, rng, gemm=numpy_gemm):
        return cls(default_init(rng, (n_out, n_in), n_in), np.zeros(n_out, np.float32), gemm=gemm)

    def forward(self, x):                           # (N, in) -> (N, out)
        self._x = x
        y = self.gemm(x, self.w.T)
        y += self.b
        return y

    def backward(self, dy, accumulate=False, weights_later=False):
        """(N, out) -> (N, in); keeps (or adds to, where `accumulate`: a later micro-batch of the
        same step) dw and db. `weights_later`: dw and db wait for settle() (or the next use of the
        gradients), so the input's gradient can leave before the weights' GEMM runs: on the paper
        network's head (37500 -> 256 -> 10, batch 32) that halves the time to its gradient."""
        if accumulate:
            self.settle()                            # the micro-batches add up in order
        else:
            self._weight_grads_due = None            # a step abandoned before its update leaves nothing
        dx = self.gemm(dy, self.w)
        due, self._x = (dy, self._x, accumulate), None
        if weights_later:
            self._weight_grads_due = due
        else:
            self._weight_grads(*due)
        return dx

    def settle(self):
        """Compute the weights' gradients a backward(weights_later=True) left due, if any."""
        if self._weight_grads_due is not None:
            due, self._weight_grads_due = self._weight_grads_due, None
            self._weight_grads(*due)

    def _weight_grads(self, dy, x, accumulate):
        db = dy.sum(axis=0)
        if accumulate:
            self.gemm(dy.T, x, out=self.dw, accumulate=True)
            self.db += db
        else:
            self.dw, self.db = self.gemm(dy.T, x), db

    def params(self):
        """(name, group, array, gradient) of the parameters that train."""
        self.settle()
        out = [("w", "weight", self.w, self.dw)]
        if self.has_bias:
            out.append(("b", "bias", self.b, self.db))
        return out

    def state(self, optimizer):
        """{name: array} of the layer's weights and `optimizer`'s slots (zeros before any update)."""
        out = {"w": self.w, "b": self.b}
        for name, _, array, _ in self.params():
            for slot in SLOTS[optimizer]:
                key = slot_name(name, slot)
                out[key] = self.slots.get(key, np.zeros_like(array))
        return out

    def load_state(self, state):
        """Weights and slots from state(): copied in; a slot not given starts at zero."""
        self.w[...], self.b[...] = state["w"], state["b"]
        self._weight_grads_due = None
        self.slots = {k: np.array(v, np.float32, copy=True) for k, v in state.items() if k not in ("w", "b")}

    def step(self, rule, host):
        """The step's one update (an hetconv.update.UpdateRule) with the gradients summed, by
        `host`'s update kernels (a device's arithmetic on numpy arrays: devices.cpu.HostArrays)."""
        for name, group, array, grad in self.params():
            slots = {}
            for slot in rule.slots:
                key = slot_name(name, slot)
                if key not in self.slots:
                    self.slots[key] = np.zeros_like(array)
                slots[slot] = self.slots[key]
            apply_update(host, array, slots, grad, rule, group)
        self.dw = self.db = None

    def sum_of_squares(self, host):
        """The squared norm of the step's gradients (float64), the head's part of a global norm."""
        return sum(host.sum_of_squares(grad) for _, _, _, grad in self.params())


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
