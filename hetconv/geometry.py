"""What the network looks like, written once: the image, the classes, one conv layer's spec, and
the size arithmetic every part of hetconv uses (reference, devices, model, cost model, bench).

A conv layer here is always conv (stride 1, zero padding) -> ReLU -> 2x2 max-pool.
"""
from dataclasses import dataclass

IMAGE_SHAPE = (3, 32, 32)           # (C, H, W) of a CIFAR-10 image
NUM_CLASSES = 10


def window_output_size(size, kernel, stride=1, padding=0):
    """How many windows of `kernel` at `stride` fit `size` zero-padded by `padding` on each side,
    PyTorch's floor rule for conv and pool alike: the one place this formula lives."""
    return (size + 2 * padding - kernel) // stride + 1


def conv_output_hw(h, w, kh, kw, padding):
    """Spatial size of a stride-1 convolution's output."""
    return window_output_size(h, kh, 1, padding), window_output_size(w, kw, 1, padding)


def pooled_hw(h, w):
    """Spatial size after a 2x2, stride-2 max-pool (an odd last row or column is dropped)."""
    return h // 2, w // 2


@dataclass(frozen=True)
class ConvSpec:
    """One conv layer of the network: in_channels -> kernels, ksize x ksize, then ReLU + pool."""
    in_channels: int
    kernels: int
    ksize: int = 5
    padding: int = 0

    def to_json(self):
        return {"in_channels": self.in_channels, "kernels": self.kernels, "ksize": self.ksize, "padding": self.padding}

    @classmethod
    def from_json(cls, d):
        return cls(int(d["in_channels"]), int(d["kernels"]), int(d["ksize"]), int(d["padding"]))

    def conv_hw(self, h, w):
        """Spatial size after the conv, before the pool."""
        return conv_output_hw(h, w, self.ksize, self.ksize, self.padding)

    def output_hw(self, h, w):
        """Spatial size after conv and 2x2 pool."""
        return pooled_hw(*self.conv_hw(h, w))


def conv_specs(kernels, ksize=5, padding=0, in_channels=IMAGE_SHAPE[0]):
    """One ConvSpec per entry of `kernels`, each layer's input channels the previous layer's kernels."""
    specs = []
    for k in kernels:
        specs.append(ConvSpec(in_channels, k, ksize, padding))
        in_channels = k
    return specs


def layer_input_shapes(specs, batch, image_shape=IMAGE_SHAPE):
    """(N, C, H, W) entering each conv layer, and the (C, H, W) leaving the last one; raises if
    the image shrinks away."""
    c, h, w = image_shape
    shapes = []
    for i, spec in enumerate(specs):
        ho, wo = spec.conv_hw(h, w)
        if ho < 2 or wo < 2:
            raise ValueError(f"conv layer {i + 1} ({spec.ksize}x{spec.ksize}, padding {spec.padding}) gets a {h}x{w} input: "
                             f"too small for the conv and its 2x2 pool; use fewer conv layers or more padding")
        shapes.append((batch, c, h, w))
        h, w = pooled_hw(ho, wo)
        c = spec.kernels
    return shapes, (c, h, w)


def largest_array_bytes(specs, batch, image_shape=IMAGE_SHAPE, value_bytes=4):
    """The largest array any message of a run moves, in bytes: a conv layer's whole input or
    partial dX, its pooled output, or its weights (a worker holding every kernel). Sockets cap
    each received frame near this (ZMQ_MAXMSGSIZE), so a peer cannot make a process allocate
    more than the run itself ever needs."""
    shapes, (c, h, w) = layer_input_shapes(specs, batch, image_shape)
    sizes = [batch * c * h * w]
    for spec, (n, cin, hin, win) in zip(specs, shapes):
        sizes.append(n * cin * hin * win)
        sizes.append(spec.kernels * cin * spec.ksize * spec.ksize)
    return max(sizes) * value_bytes


# A header frame (msgpack: plans, calibration timings) is small; this much room is given over the
# largest array, and no limit is ever set below it.
MESSAGE_SLACK_BYTES = 1 << 20


def message_limit_bytes(specs, batch, image_shape=IMAGE_SHAPE):
    """ZMQ_MAXMSGSIZE for a run's sockets: the largest array plus room for a header."""
    return largest_array_bytes(specs, batch, image_shape) + MESSAGE_SLACK_BYTES
