"""Batches: an epoch's order, augmentation (random crop with zero padding, horizontal flip) and
normalisation with the data set's own statistics, optionally prepared one batch ahead in a
background thread while the current step runs.

What a batch holds depends only on (the order's generator, seed, epoch, the batch's index), never
on which thread made it nor on whether earlier batches were made: a resumed or replaying run that
starts at batch `start` sees exactly the batches an uninterrupted run saw.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import numpy as np

from hetconv.data.base import DataSet
from hetconv.data.photos import FileImages, train_batch

Batch = tuple[np.ndarray, np.ndarray]        # (x float32 (B, C, H, W), y int64 (B,))

AUGMENTATIONS = ("crop", "flip", "random-resized-crop")      # the last for photo folders only
CROP_PADDING = 4
# First word of every augmentation generator's seed: keeps its stream apart from the epoch order's
# np.random.default_rng([seed, epoch]) (a trailing 0 in a seed list does not change the stream).
_AUGMENT_STREAM = 0xA06


def parse_augment(text: str) -> tuple[str, ...]:
    """--augment text -> names: "crop,flip", "flip", "" or "none" (no augmentation)."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if names == ("none",):
        return ()
    bad = [n for n in names if n not in AUGMENTATIONS]
    if bad or len(set(names)) != len(names):
        raise ValueError(f"--augment {text!r}: expected a comma-separated list of {', '.join(AUGMENTATIONS)} "
                         f"(each once), or 'none'")
    return names


def augment(x: np.ndarray, rng: np.random.Generator, crop_padding: int = CROP_PADDING,
            flip: bool = True) -> np.ndarray:
    """uint8 images (N, C, H, W) -> a new array of the same shape: each image cropped at a random
    offset from the image padded with `crop_padding` zero pixels each side (0: no crop), then
    mirrored left-right with probability 1/2 when `flip`. Draws offsets then flips from `rng`."""
    if x.dtype != np.uint8 or x.ndim != 4:
        raise ValueError(f"augment expects uint8 images (N, C, H, W), got {x.dtype} {x.shape}")
    if crop_padding < 0:
        raise ValueError(f"crop_padding must be >= 0, got {crop_padding}")
    n, _, h, w = x.shape
    if crop_padding:
        p = crop_padding
        padded = np.zeros((*x.shape[:2], h + 2 * p, w + 2 * p), np.uint8)
        padded[:, :, p:p + h, p:p + w] = x
        oy = rng.integers(0, 2 * p + 1, n)
        ox = rng.integers(0, 2 * p + 1, n)
        # (N, C, 2p+1, 2p+1, H, W) view of every crop; indexing copies only the chosen one per image
        windows = np.lib.stride_tricks.sliding_window_view(padded, (h, w), axis=(2, 3))
        out = windows[np.arange(n), :, oy, ox]                  # (N, C, H, W)
    else:
        out = x.copy()
    if flip:
        mirrored = rng.random(n) < 0.5
        out[mirrored] = out[mirrored, :, :, ::-1]
    return out


_augment = augment                           # batches() has a parameter of the same name


def _check_augment(names, photos=False) -> tuple[str, ...]:
    names = tuple(names or ())
    bad = [n for n in names if n not in AUGMENTATIONS]
    if bad:
        raise ValueError(f"augment={names!r}: {bad[0]!r} is not one of {', '.join(AUGMENTATIONS)}")
    if "random-resized-crop" in names and not photos:
        raise ValueError("augment random-resized-crop applies to a photo folder (--image-size), whose photos are "
                         "cropped from their full size; this data set's images are already their final size")
    return names


def batches(ds: DataSet, batch_size: int, rng: np.random.Generator | None,
            shuffle: bool = True, drop_last: bool = True, augment: tuple[str, ...] = (),
            seed: int = 0, epoch: int = 0, start: int = 0, prefetch: bool = False) -> Iterator[Batch]:
    """One epoch over the training set: (x float32 (B, C, H, W), y int64 (B,)).

    The order depends only on `rng`; each image is used at most once. With drop_last the final
    short batch is skipped, so every step has the same shape (and the same per-step cost).
    augment: names from AUGMENTATIONS ("crop", "flip"); batch i is augmented with a generator
    seeded by (seed, epoch, i). start: the first batch to yield (those before it are not made).
    prefetch: batch i + 1 is made in a background thread while the caller works on batch i;
    the batches are exactly those made without it.
    """
    n = len(ds.train_y)
    photos = isinstance(ds.train_x, FileImages)
    names = _check_augment(augment, photos)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if drop_last and batch_size > n:
        raise ValueError(f"batch_size {batch_size} is larger than the {n} training images of "
                         f"{ds.name!r}: with drop_last no batch would be yielded")
    if shuffle:
        if rng is None:
            raise ValueError("shuffle=True needs a numpy Generator, got rng=None")
        order = rng.permutation(n)
    else:
        order = np.arange(n)
    stop = n - n % batch_size if drop_last else n
    count = -(-stop // batch_size)

    def make(i: int) -> Batch:
        idx = order[i * batch_size:(i + 1) * batch_size]
        if photos:                           # decoded here, in this process (loader.py: in several)
            x = train_batch([ds.train_x.files[j] for j in idx], ds.train_x.size, names, seed, epoch, i * batch_size)
            return ds.normalize(x), ds.train_y[idx]
        x = ds.train_x[idx]
        if names:
            x = _augment(x, np.random.default_rng([_AUGMENT_STREAM, seed, epoch, i]),
                         crop_padding=CROP_PADDING if "crop" in names else 0, flip="flip" in names)
        return ds.normalize(x), ds.train_y[idx]

    if not prefetch:
        for i in range(start, count):
            yield make(i)
        return
    # one thread, one batch ahead: numpy's copies and arithmetic release the GIL, so making the
    # next batch overlaps the caller's step; the cost is one more batch held in memory
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="hetconv-batches") as pool:
        ahead = pool.submit(make, start) if start < count else None
        try:
            for i in range(start, count):
                batch = ahead.result()
                ahead = pool.submit(make, i + 1) if i + 1 < count else None
                yield batch
        finally:
            if ahead is not None:                # the caller stopped early: drop the batch made ahead
                ahead.cancel()


def test_batches(ds: DataSet, batch_size: int) -> Iterator[Batch]:
    """Every test image once, in order; the last batch may be smaller."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    for start in range(0, len(ds.test_y), batch_size):
        yield ds.normalize(ds.test_x[start:start + batch_size]), ds.test_y[start:start + batch_size]


test_batches.__test__ = False                # a library function, not a pytest test
