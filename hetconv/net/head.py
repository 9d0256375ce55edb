"""The network and one training step.

conv blocks (kernels split across shards by an engine) -> flatten -> the head: linear, ReLU and
dropout layers in the order the network lists them, the last linear as wide as the data set has
classes -> softmax cross-entropy. The conv blocks live behind an engine (in-process or over
ZeroMQ); the head, the loss and their optimizer live here, on the coordinator.
"""
from dataclasses import dataclass

import numpy as np

from hetconv.net.layers import Linear, relu, relu_backward, softmax_cross_entropy
from hetconv.params import default_init, numpy_gemm


def init_conv_params(specs, rng):
    """Each conv layer's state at the start ({name: array}, ConvSpec.state_layout's names), its
    weights drawn before any FC layer so the same seed gives the same conv weights whatever the
    FC sizes; biases zero, BatchNorms at PyTorch's start."""
    params = []
    for spec in specs:
        fan_in = int(np.prod(spec.weight_shape[1:]))         # (C/groups) * kh * kw, as PyTorch's
        w = default_init(rng, spec.weight_shape, fan_in)
        params.append(spec.initial_state(w))
    return params


def paper_head(fc_sizes, classes):
    """The paper family's head in the network's JSON form: linear + ReLU per hidden width, then
    the classes."""
    head = []
    for width in fc_sizes:
        head += [{"type": "linear", "out_features": int(width)}, {"type": "relu"}]
    return head + [{"type": "linear", "out_features": int(classes)}]


@dataclass
class StepResult:
    loss: float
    correct: int
    grad_scale: float = 1.0     # what global-norm clipping multiplied every gradient by (1: not clipped)


def dropout_mask(seed, step, index, shape, p):
    """Keep-mask scaled by 1/(1-p) for the whole batch: drawn from (seed, step, layer) alone, so
    any cut into micro-batches (and a replay of the step after a lost worker) sees the same mask."""
    keep = np.random.default_rng([seed, step, index]).random(shape, dtype=np.float32) >= np.float32(p)
    return keep.astype(np.float32) / np.float32(1.0 - p)


class Network:
    """`head`: the layers after flatten, in the network's JSON form ({"type": "linear",
    "out_features", "bias"}, {"type": "relu"}, {"type": "dropout", "p"}, {"type": "scale",
    "factor"}); `feature_shape`: (C, H, W) leaving the last conv block; `fc_params`: [(w, b)]
    per linear to start from (else drawn)."""

    def __init__(self, specs, head, engine, rng, feature_shape, fc_params=None, seed=0, optimizer="sgd", host=None):
        self.specs = specs
        self.engine = engine
        self.seed = seed
        self.optimizer = optimizer          # whose slots the head's state holds
        self.host = host                    # the head's GEMMs and update kernels (devices.cpu.HostArrays); None: predict only
        self.ops, self.fc = [], []
        width = int(np.prod(feature_shape))
        given = list(fc_params) if fc_params is not None else None
        for layer in head:
            kind = layer["type"]
            if kind == "linear":
                out = int(layer["out_features"])
                gemm = host.gemm if host is not None else numpy_gemm
                if given is not None:
                    w, b = given[len(self.fc)]
                    fc = Linear(w, b if b is not None else np.zeros(out, np.float32), gemm=gemm)
                else:
                    fc = Linear.init(width, out, rng, gemm=gemm)
                fc.has_bias = bool(layer.get("bias", True))
                if not fc.has_bias:
                    fc.b[...] = 0
                self.ops.append(("linear", len(self.fc)))
                self.fc.append(fc)
                width = out
            elif kind == "relu":
                self.ops.append(("relu", None))
            elif kind == "dropout":
                self.ops.append(("dropout", float(layer["p"])))
            elif kind == "scale":
                self.ops.append(("scale", np.float32(layer["factor"])))
            else:
                raise ValueError(f"head layer {layer!r}: expected linear, relu, dropout or scale")
        self.classes = width

    def _head_forward(self, flat, masks=None):
        """-> (logits, what the backward needs per op). masks: per op index, the rows' dropout
        mask (training), or None (inference: dropout is the identity)."""
        saved, h = [], flat
        for i, (kind, arg) in enumerate(self.ops):
            if kind == "linear":
                h = self.fc[arg].forward(h)
                saved.append(None)
            elif kind == "relu":
                h = relu(h)
                saved.append(h)
            elif kind == "scale":
                h = h * arg
                saved.append(None)
            elif masks is not None and arg > 0:
                h = h * masks[i]
                saved.append(masks[i])
            else:
                saved.append(None)
        return h, saved

    def _head_backward(self, grad, saved, accumulate, weights_later=False):
        for i in reversed(range(len(self.ops))):
            kind, arg = self.ops[i]
            if kind == "linear":
                grad = self.fc[arg].backward(grad, accumulate=accumulate, weights_later=weights_later)
            elif kind == "relu":
                grad = relu_backward(saved[i], grad)
            elif kind == "scale":
                grad = grad * arg
            elif saved[i] is not None:
                grad = grad * saved[i]
        return grad

    def _masks(self, step, total):
        """Per dropout op, the whole batch's mask at `step`."""
        masks, width = {}, None
        for i, (kind, arg) in enumerate(self.ops):
            if kind == "linear":
                width = self.fc[arg].w.shape[0]
            elif kind == "dropout" and arg > 0:
                features = width if width is not None else self.fc[0].w.shape[1]
                masks[i] = dropout_mask(self.seed, step, i, (total, features), arg)
        return masks

    def train_step(self, x, labels, rule, micro_batches=1, step=0, label_smoothing=0.0):
        """One update (`rule`, an engine.update.UpdateRule) on the batch, cut into `micro_batches`
        pieces whose gradients add up to the whole batch's (the loss is the mean over the whole
        batch). `step` seeds dropout."""
        xs = np.array_split(x, micro_batches)
        ys = np.array_split(labels, micro_batches)
        total = len(labels)
        starts = np.cumsum([0] + [len(y) for y in ys])
        result = StepResult(0.0, 0)
        dropout = any(kind == "dropout" and arg > 0 for kind, arg in self.ops)
        batch_masks = self._masks(step, total) if dropout else {}

        def head(m, features, weights_later=False):
            # head forward, loss, head backward on micro-batch m: all local; its gradients add up.
            # weights_later: the FC weights' gradients wait for head.settle(), which the caller
            # runs once the features' gradient is on its way (`features` must stay as they are)
            masks = {i: mask[starts[m]:starts[m + 1]] for i, mask in batch_masks.items()}
            logits, saved = self._head_forward(features.reshape(features.shape[0], -1), masks)
            loss, grad = softmax_cross_entropy(logits, ys[m], label_smoothing)   # mean over this micro-batch
            share = len(ys[m]) / total
            if share != 1.0:
                grad *= np.float32(share)                              # ... made a mean over the batch
            result.loss += loss * share
            result.correct += int((logits.argmax(axis=1) == ys[m]).sum())
            grad = self._head_backward(grad, saved, accumulate=m > 0, weights_later=weights_later)
            return grad.reshape(features.shape)

        def settle():
            for fc in self.fc:
                fc.settle()
        head.settle = settle

        # conv forward, head, conv backward per micro-batch: the engine decides how they overlap;
        # the conv kernels get their one update per step where they live
        if self.host is None:
            raise ValueError("this Network was made without a host device for the head's updates: it predicts only")
        factor = self.engine.conv_step(xs, head, rule, (step, self.seed), self.head_sum_of_squares)
        result.grad_scale = factor
        rule = rule.scaled(factor) if factor != 1.0 else rule
        for fc in self.fc:
            fc.step(rule, self.host)
        return result

    def head_sum_of_squares(self):
        """The squared norm of the head's gradients of the step (float64)."""
        return sum(fc.sum_of_squares(self.host) for fc in self.fc)

    def predict(self, x):
        """Logits, without touching any training state."""
        features = self.engine.predict(x)
        logits, _ = self._head_forward(features.reshape(features.shape[0], -1))
        return logits

    # ---- state for checkpoints ------------------------------------------------------------
    def fc_state(self):
        """Per linear layer, {name: array}: weights and the run's optimizer's slots (copies)."""
        return [{k: np.array(v, copy=True) for k, v in fc.state(self.optimizer).items()} for fc in self.fc]

    def load_fc_state(self, state):
        """Per linear layer {name: array} (or the old (w, b, vw, vb))."""
        if len(state) != len(self.fc):
            raise ValueError(f"checkpoint has {len(state)} FC layers, the network has {len(self.fc)}")
        for fc, layer in zip(self.fc, state):
            if not isinstance(layer, dict):
                w, b, vw, vb = layer
                layer = {"w": w, "b": b, "w.momentum_buffer": vw, "b.momentum_buffer": vb}
            if layer["w"].shape != fc.w.shape or layer["b"].shape != fc.b.shape:
                raise ValueError(f"checkpoint FC weights {layer['w'].shape} / {layer['b'].shape} do not match the "
                                 f"network's {fc.w.shape} / {fc.b.shape}")
            fc.load_state(layer)
