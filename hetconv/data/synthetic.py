"""`synthetic`: a built-in, deterministic, learnable CIFAR-shaped data set, so every command runs
on a fresh machine with no download."""

from __future__ import annotations

import numpy as np

from hetconv.data.base import CIFAR10_CLASSES, CIFAR10_MEAN, CIFAR10_STD, DataSet
from hetconv.geometry import NUM_CLASSES

# The knobs below were tuned so that the classes are learnable but not trivial: on 5000/1000
# images a nearest-class-mean classifier gets about 75%, 300 SGD steps of logistic regression
# about 90%, and a small conv net (which shares weights across the shifts) more.
_SYNTH_COARSE = 6        # class pattern = 6x6 random colours, smoothly upsampled: low frequency,
                         # so a small conv net picks it up in a few hundred steps
_SYNTH_SHARED = 0.5      # fraction of every class pattern that is one pattern common to all
                         # classes, so classes differ in part of the image signal, not all of it
_SYNTH_MAX_SHIFT = 4     # each image is a 32x32 crop at a random offset (0..8) of a 40x40 pattern
_SYNTH_CLUTTER = 1.5     # per-image smooth random blobs (4x4 upsampled), in pattern units: the
                         # nuisance that makes pixel-space distances unreliable
_SYNTH_NOISE = 1.0       # per-pixel noise standard deviation, in pattern units
_SYNTH_TO_U8 = 36.0      # uint8 = 128 + 36 * value: about 5% of pixels saturate at 0 or 255


def _interp_matrix(n_out: int, n_in: int) -> np.ndarray:
    """(n_out, n_in) bilinear resampling weights, pixel centres aligned."""
    pos = np.clip((np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5, 0, n_in - 1)
    lo = np.floor(pos).astype(int)
    hi = np.minimum(lo + 1, n_in - 1)
    frac = pos - lo
    m = np.zeros((n_out, n_in))
    m[np.arange(n_out), lo] += 1 - frac
    m[np.arange(n_out), hi] += frac
    return m


def _synthetic_images(patterns: np.ndarray, n: int, rng: np.random.Generator):
    """n balanced labels; each image its class pattern shifted, rescaled, cluttered, noised."""
    labels = rng.permutation(np.arange(n) % NUM_CLASSES).astype(np.int64)
    span = 2 * _SYNTH_MAX_SHIFT + 1
    oy = rng.integers(0, span, n)
    ox = rng.integers(0, span, n)
    # (10, 3, span, span, 32, 32) view of every crop; indexing copies only the n chosen ones.
    crops = np.lib.stride_tricks.sliding_window_view(patterns, (32, 32), axis=(2, 3))
    x = crops[labels, :, oy, ox]                             # (n, 3, 32, 32) float32
    x *= rng.uniform(0.6, 1.4, (n, 1, 1, 1)).astype(np.float32)          # contrast
    x += rng.normal(0.0, 0.3, (n, 1, 1, 1)).astype(np.float32)           # brightness
    up = _interp_matrix(32, 4).astype(np.float32)
    blobs = rng.standard_normal((n, 3, 4, 4), dtype=np.float32)
    blobs *= _SYNTH_CLUTTER
    x += up @ blobs @ up.T                                   # (32,4) @ (n,3,4,4) @ (4,32)
    # Uniform noise with the spread of N(0, noise^2): a fifth of the cost of normal samples.
    noise = rng.random(x.shape, dtype=np.float32)
    noise -= 0.5
    noise *= _SYNTH_NOISE * np.sqrt(12.0, dtype=np.float32)
    x += noise
    x *= _SYNTH_TO_U8
    x += 128.0
    return np.clip(x, 0, 255).astype(np.uint8), labels


def synthetic(n_train: int = 5000, n_test: int = 1000, seed: int = 0) -> DataSet:
    """A deterministic, learnable CIFAR-shaped data set (same seed -> same bytes), no download.

    Each class is a smooth random colour pattern; each image is its class pattern at a random
    shift (up to 4 px each way), contrast and brightness, over smooth random clutter, plus pixel
    noise. Classes are balanced. The test images do not depend on n_train.
    """
    if n_train < 0 or n_test < 0:
        raise ValueError(f"n_train and n_test must be >= 0, got {n_train}, {n_test}")
    pattern_rng, train_rng, test_rng = (np.random.default_rng(s)
                                        for s in np.random.SeedSequence(seed).spawn(3))
    coarse_shape = (3, _SYNTH_COARSE, _SYNTH_COARSE)
    own = pattern_rng.standard_normal((NUM_CLASSES, *coarse_shape))
    common = pattern_rng.standard_normal(coarse_shape)
    coarse = _SYNTH_SHARED * common + (1 - _SYNTH_SHARED) * own
    up = _interp_matrix(32 + 2 * _SYNTH_MAX_SHIFT, _SYNTH_COARSE)
    patterns = np.einsum("ij,ncjk,lk->ncil", up, coarse, up)
    patterns /= patterns.std()
    patterns = patterns.astype(np.float32)                   # (10, 3, 40, 40)
    train_x, train_y = _synthetic_images(patterns, n_train, train_rng)
    test_x, test_y = _synthetic_images(patterns, n_test, test_rng)
    # CIFAR-10's statistics, not this split's: the generator is scaled to CIFAR's pixel range, and
    # the normalisation must not change with n_train (a bigger set would train on other inputs)
    return DataSet("synthetic", train_x, train_y, test_x, test_y, CIFAR10_CLASSES, CIFAR10_MEAN, CIFAR10_STD)
