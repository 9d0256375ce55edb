"""The size arithmetic every part of hetconv uses (layer specs, per-channel layers, devices, the
reference), written once: how many windows fit, and what counts as a (height, width) pair."""
import numpy as np


def window_output_size(size, kernel, stride=1, padding=0):
    """How many windows of `kernel` at `stride` fit `size` zero-padded by `padding` on each side,
    PyTorch's floor rule for conv and pool alike: the one place this formula lives."""
    return (size + 2 * padding - kernel) // stride + 1


def dilated_size(kernel, dilation=1):
    """The span a kernel of `kernel` taps covers with `dilation` between taps (PyTorch's
    dilation: 1 is a dense kernel): what window_output_size takes as a dilated conv's kernel."""
    return dilation * (kernel - 1) + 1


def _is_int(v):
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def as_pair(name, value, minimum):
    """An int or an (height, width) pair of ints, each >= minimum, as a tuple of two Python ints;
    anything else raises ValueError naming `name` and the value."""
    pair = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    if len(pair) != 2 or not all(_is_int(v) and v >= minimum for v in pair):
        what = "positive" if minimum == 1 else "non-negative"
        raise ValueError(f"{name} must be a {what} integer or a (height, width) pair of them, got {value!r}")
    return int(pair[0]), int(pair[1])
