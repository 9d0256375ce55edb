"""The network and one training step.

conv layers (kernels split across shards by an engine) -> flatten -> FC + ReLU ... -> FC 10 ->
softmax cross-entropy. The conv layers live behind an engine (in-process or over ZeroMQ); the FC
layers, the loss and their optimizer live here, on the coordinator.
"""
from dataclasses import dataclass

import numpy as np

from hetconv.geometry import IMAGE_SHAPE, NUM_CLASSES, layer_input_shapes
from hetconv.layers import Linear, relu, relu_backward, softmax_cross_entropy
from hetconv.params import default_init


def init_conv_params(specs, rng):
    """Initial (w, b, vw=None, vb=None) per conv layer, drawn before any FC layer so the
    same seed gives the same conv weights whatever the FC sizes."""
    params = []
    for spec in specs:
        fan_in = spec.in_channels * spec.ksize ** 2
        w = default_init(rng, (spec.kernels, spec.in_channels, spec.ksize, spec.ksize), fan_in)
        params.append((w, np.zeros(spec.kernels, np.float32), None, None))
    return params


@dataclass
class StepResult:
    loss: float
    correct: int


class Network:
    def __init__(self, specs, fc_sizes, engine, rng, image_shape=IMAGE_SHAPE):
        self.specs = specs
        self.engine = engine
        _, (c, h, w) = layer_input_shapes(specs, 1, image_shape)
        widths = [c * h * w] + list(fc_sizes) + [NUM_CLASSES]
        self.fc = [Linear.init(a, b, rng) for a, b in zip(widths[:-1], widths[1:])]

    def _fc_forward(self, flat):
        acts = [flat]
        h = flat
        for i, fc in enumerate(self.fc):
            h = fc.forward(h)
            if i < len(self.fc) - 1:
                h = relu(h)
            acts.append(h)
        return h, acts

    def train_step(self, x, labels, lr, momentum, weight_decay, micro_batches=1):
        """One SGD step on the batch, cut into `micro_batches` pieces whose gradients add up to
        the whole batch's (the loss is the mean over the whole batch)."""
        xs = np.array_split(x, micro_batches)
        ys = np.array_split(labels, micro_batches)
        total = len(labels)
        result = StepResult(0.0, 0)

        def head(m, features):
            # FC forward, loss, FC backward on micro-batch m: all local; its gradients add up
            logits, acts = self._fc_forward(features.reshape(features.shape[0], -1))
            loss, grad = softmax_cross_entropy(logits, ys[m])        # mean over this micro-batch
            share = len(ys[m]) / total
            if share != 1.0:
                grad *= np.float32(share)                              # ... made a mean over the batch
            result.loss += loss * share
            result.correct += int((logits.argmax(axis=1) == ys[m]).sum())
            for i in reversed(range(len(self.fc))):
                if i < len(self.fc) - 1:
                    grad = relu_backward(acts[i + 1], grad)
                grad = self.fc[i].backward(grad, accumulate=m > 0)
            return grad.reshape(features.shape)

        # conv forward, head, conv backward per micro-batch: the engine decides how they overlap;
        # the conv kernels get their one update per step where they live
        self.engine.conv_step(xs, head, (lr, momentum, weight_decay))
        for fc in self.fc:
            fc.step(lr, momentum, weight_decay)
        return result

    def predict(self, x):
        """Logits, without touching any training state."""
        features = self.engine.predict(x)
        logits, _ = self._fc_forward(features.reshape(features.shape[0], -1))
        return logits

    # ---- state for checkpoints ------------------------------------------------------------
    def fc_state(self):
        return [(fc.w, fc.b, fc.vw, fc.vb) for fc in self.fc]

    def load_fc_state(self, state):
        if len(state) != len(self.fc):
            raise ValueError(f"checkpoint has {len(state)} FC layers, the network has {len(self.fc)}")
        for fc, (w, b, vw, vb) in zip(self.fc, state):
            if w.shape != fc.w.shape:
                raise ValueError(f"checkpoint FC weights {w.shape} do not match the network's {fc.w.shape}")
            fc.w[...], fc.b[...], fc.vw[...], fc.vb[...] = w, b, vw, vb
