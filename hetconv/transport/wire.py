"""Feature maps and gradients on the wire: float32 (exact, the default) or a 16-bit form that
halves the bytes of every exchange at the cost of rounding.

- float16: IEEE half. 10 mantissa bits, but a range of 6e-8 .. 65504: gradients that small
  flush to zero, so it is the riskier choice for the backward pass.
- bfloat16: the top 16 bits of a float32 (same range, 7 mantissa bits), rounded to nearest even.
  numpy has no bfloat16, so it travels as uint16 and is widened back by a shift.
Arrays are encoded by the sender and decoded to float32 by the receiver, whatever the device
computes in (a GPU worker's kernels take the decoded float32).

The bfloat16 conversions are Numba kernels, one pass each on the threads Numba runs on (numpy's
bit arithmetic takes four passes with temporaries, three to four times as long: docs/bench-log.md);
a bf16 step pays them at every block's input, output, gradient and partial dX, `--local` included.

`--wire-dtype auto` (the default) follows the compute: bfloat16 where every CPU worker's conv
GEMMs run bf16 (their operands are rounded to bf16 anyway, so the wire halves the bytes and
rounds a map once more only where it was not yet bf16), float32 elsewhere. It is decided once per
plan, when what the workers compute in is known (calibration: engine.policy.wire_for), and
every LOAD of the plan names the dtype it chose.
"""
import numpy as np
from numba import prange

from hetconv.jit import cached_njit

WIRE_DTYPES = ("float32", "bfloat16", "float16")        # what travels
WIRE_CHOICES = ("auto",) + WIRE_DTYPES                   # what --wire-dtype takes


def check_wire_dtype(name):
    """--wire-dtype's value: a dtype, or auto (decided with each plan: engine.policy.wire_for)."""
    if name not in WIRE_CHOICES:
        raise ValueError(f"--wire-dtype must be one of {', '.join(WIRE_CHOICES)}, got {name!r}")
    return name


def carried_dtype(name):
    """A dtype that travels, as a plan's LOAD names it: auto is decided before any array moves."""
    if name not in WIRE_DTYPES:
        raise ValueError(f"a plan's wire must be one of {', '.join(WIRE_DTYPES)}, got {name!r}")
    return name


def value_bytes(wire):
    """Bytes one feature-map value takes on `wire`: what the cost model charges per value."""
    return 4 if carried_dtype(wire) == "float32" else 2


def encode(a, wire):
    """float32 array -> what travels for `wire` (the same array for float32: no copy)."""
    if wire == "float32":
        return a
    if wire == "float16":
        return np.asarray(a, np.float32).astype(np.float16)
    if wire == "bfloat16":
        bits = np.ascontiguousarray(a, np.float32)
        out = np.empty(bits.shape, np.uint16)
        _to_bf16(bits.reshape(-1).view(np.uint32), out.reshape(-1))
        return out
    raise ValueError(f"unknown wire dtype {wire!r}: expected one of {', '.join(WIRE_DTYPES)}")


def round_in_place(a, wire):
    """Round a float32 array (C-contiguous, writable) to the values `wire` carries, as
    decode(encode(a)) would, without a copy: a sum of parts that each crossed the wire becomes a
    value that could have crossed it itself."""
    if wire == "float32":
        return a
    if wire == "float16":
        a[...] = a.astype(np.float16)
        return a
    if wire == "bfloat16" and a.flags.c_contiguous:
        flat = a.reshape(-1).view(np.uint32)
        _round_bf16_into(flat, flat)
        return a
    if wire == "bfloat16":
        bits = a.view(np.uint32)
        bits += np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))   # as encode: to nearest even
        bits &= np.uint32(0xFFFF0000)
        return a
    raise ValueError(f"unknown wire dtype {wire!r}: expected one of {', '.join(WIRE_DTYPES)}")


def rounded(a, wire):
    """A new float32 array of a's values as `wire` carries them: decode(encode(a)) in one pass,
    for an engine in one process, where nothing travels but the values must be what would have."""
    a = np.ascontiguousarray(a, np.float32)
    if wire == "float32":
        return a.copy()
    if wire == "bfloat16":
        out = np.empty(a.shape, np.float32)
        _round_bf16_into(a.reshape(-1).view(np.uint32), out.reshape(-1).view(np.uint32))
        return out
    return decode(encode(a, wire), wire)


def decode(a, wire):
    """What arrived -> float32 (a received float32 array is returned as is: read-only)."""
    if wire == "float32":
        if a.dtype != np.float32:
            raise ValueError(f"a float32 wire carried {a.dtype}")
        return a
    if wire == "float16":
        if a.dtype != np.float16:
            raise ValueError(f"a float16 wire carried {a.dtype}")
        return a.astype(np.float32)
    if wire == "bfloat16":
        if a.dtype != np.uint16:
            raise ValueError(f"a bfloat16 wire carried {a.dtype}, expected its uint16 form")
        out = np.empty(a.shape, np.uint32)
        _from_bf16(np.ascontiguousarray(a).reshape(-1), out.reshape(-1))
        return out.view(np.float32)
    raise ValueError(f"unknown wire dtype {wire!r}: expected one of {', '.join(WIRE_DTYPES)}")


# Round to nearest even on the 16 bits dropped: add 0x7FFF plus the lowest kept bit, then cut. NaN
# stays NaN (its exponent is full, so the carry cannot reach the sign), an infinity stays one.
@cached_njit(parallel=True, nogil=True)
def _to_bf16(bits, out):
    for i in prange(bits.size):
        b = bits[i]
        out[i] = np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@cached_njit(parallel=True, nogil=True)
def _round_bf16_into(bits, out):
    """out = bits rounded to bf16's (kept in the upper 16 bits); out may be bits itself."""
    for i in prange(bits.size):
        b = bits[i]
        out[i] = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)


@cached_njit(parallel=True, nogil=True)
def _from_bf16(halves, out):
    for i in prange(halves.size):
        out[i] = np.uint32(halves[i]) << np.uint32(16)
