"""`resize_box`: Pillow's bilinear resize of a box of an image (`Image.resize(size, BILINEAR,
box)`), compiled with Numba, from an (H, W, 3) uint8 array straight into a (3, S, S) one.

Why not Pillow's own: simplejpeg decodes a photo into an array, and Pillow's path from there is an
RGB image built from the array (a copy into its 4-byte pixels), the resize in scalar C, an array
read back out and a transposing copy to channels first; here the resize's vertical pass runs over
whole rows (vectorised) and writes channels first: about half of Pillow's time an image on the
loader benchmark's photos (bench/loader.py; its runs are in docs/bench-log.md).

The arithmetic is Pillow's (libImaging/Resample.c: precompute_coeffs, normalize_coeffs_8bpc and
the 8-bit passes): the same coefficients in 22-bit fixed point, rounded the same way, the box's
corners as C floats, and the horizontal pass first, over the rows the vertical pass reads, each
pass rounded to uint8: Pillow's C source in that order up to its 13.0.0.dev0 (August 2026).
The Pillow 13.0.0 wheel runs the vertical pass first for some shapes, where a pixel may then
differ by 1 (0.013 of a level on average on the benchmark's photos at 224 px).
"""
import math

import numpy as np

from hetconv.jit import cached_njit

PRECISION_BITS = 32 - 8 - 2            # Pillow's: 8 bits of result, 2 of headroom, in an int32


@cached_njit(nogil=True)
def _coefficients(in_size, in0, in1, out_size):
    """Pillow's precompute_coeffs then normalize_coeffs_8bpc for the bilinear filter (support 1):
    (bounds (out_size, 2): first input pixel and count; kk (out_size, ksize): fixed-point weights).
    in0, in1: the box's edges as float32, as Pillow's C receives them."""
    scale = np.float64(np.float32(in1 - in0)) / out_size
    filterscale = scale if scale >= 1.0 else 1.0
    support = filterscale
    ksize = int(math.ceil(support)) * 2 + 1
    bounds = np.empty((out_size, 2), np.int64)
    kk = np.zeros((out_size, ksize), np.int32)
    k = np.empty(ksize, np.float64)
    ss = 1.0 / filterscale
    for xx in range(out_size):
        center = np.float64(in0) + (xx + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)          # int(): C's truncation toward zero
        xmax = min(int(center + support + 0.5), in_size) - xmin
        ww = 0.0
        for x in range(xmax):
            t = abs((x + xmin - center + 0.5) * ss)
            k[x] = 1.0 - t if t < 1.0 else 0.0
            ww += k[x]
        for x in range(xmax):
            w = k[x] / ww if ww != 0.0 else k[x]
            kk[xx, x] = int(0.5 + w * (1 << PRECISION_BITS))      # w >= 0: the bilinear filter has no lobes
        bounds[xx, 0] = xmin
        bounds[xx, 1] = xmax
    return bounds, kk


@cached_njit(nogil=True)
def _clip8(v):
    v >>= PRECISION_BITS
    return 0 if v < 0 else (255 if v > 255 else v)


@cached_njit(nogil=True)
def _resize_box(src, x0, y0, x1, y1, out):
    height, width = src.shape[0], src.shape[1]
    size_y, size_x = out.shape[1], out.shape[2]
    hb, hk = _coefficients(width, x0, x1, size_x)
    vb, vk = _coefficients(height, y0, y1, size_y)
    first = vb[0, 0]
    rows = vb[size_y - 1, 0] + vb[size_y - 1, 1] - first
    half = 1 << (PRECISION_BITS - 1)
    across = np.empty((rows, size_x, 3), np.int32)          # the horizontal pass, rounded to 0..255
    for y in range(rows):
        line = src[first + y]
        for x in range(size_x):
            xmin = hb[x, 0]
            s0 = s1 = s2 = half
            for t in range(hb[x, 1]):
                w = hk[x, t]
                s0 += np.int32(line[xmin + t, 0]) * w
                s1 += np.int32(line[xmin + t, 1]) * w
                s2 += np.int32(line[xmin + t, 2]) * w
            across[y, x, 0] = _clip8(s0)
            across[y, x, 1] = _clip8(s1)
            across[y, x, 2] = _clip8(s2)
    acc = np.empty((size_x, 3), np.int32)
    for y in range(size_y):
        ymin = vb[y, 0] - first
        acc[:] = half
        for t in range(vb[y, 1]):                            # whole rows at a time: vectorised
            w = vk[y, t]
            row = across[ymin + t]
            for x in range(size_x):
                for c in range(3):
                    acc[x, c] += row[x, c] * w
        for c in range(3):
            for x in range(size_x):
                out[c, y, x] = _clip8(acc[x, c])


def resize_box(src: np.ndarray, box, size: int) -> np.ndarray:
    """uint8 (3, size, size): the box (left, top, right, bottom) of `src`, uint8 (H, W, 3),
    resized as Pillow's Image.resize((size, size), BILINEAR, box=box) resizes it."""
    if src.dtype != np.uint8 or src.ndim != 3 or src.shape[2] != 3:
        raise ValueError(f"resize_box takes uint8 (H, W, 3) images, got {src.dtype} {src.shape}")
    left, top, right, bottom = (np.float32(v) for v in box)
    if not (0 <= left < right <= src.shape[1] and 0 <= top < bottom <= src.shape[0]):
        raise ValueError(f"box {tuple(box)!r} is not inside the {src.shape[1]}x{src.shape[0]} image")
    out = np.empty((3, size, size), np.uint8)
    _resize_box(np.ascontiguousarray(src), left, top, right, bottom, out)
    return out
