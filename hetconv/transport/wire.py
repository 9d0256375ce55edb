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
plan, when what the workers compute in is known (calibration), and every LOAD of the plan names
the dtype it chose (`wire_for`).
"""
import numpy as np
from numba import prange

from hetconv.jit import cached_njit

WIRE_DTYPES = ("float32", "bfloat16", "float16")        # what travels
WIRE_CHOICES = ("auto",) + WIRE_DTYPES                   # what --wire-dtype takes


def check_wire_dtype(name):
    """--wire-dtype's value: a dtype, or auto (decided with each plan, see wire_for)."""
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


def _is_cpu(device):
    return str(device).split(":")[0] == "cpu"


def wire_for(asked, precision, computed=None):
    """The wire dtype of a plan, and why: -> (dtype, reason).

    `asked`: --wire-dtype (a dtype is taken as it is); `precision`: --precision; `computed`:
    {worker: (device, what its conv GEMMs ran in at calibration: "fp32", "bf16" or "bf16 on N
    of M call shapes")}, or None where nothing was calibrated (--local, a plan set by hand).
    auto gives bfloat16 where every CPU worker computes in bf16 (a GPU worker's kernels are
    float32: it decodes the bf16 it gets), and without a calibration where --precision bf16 is
    asked for; float32 otherwise. A worker that took bf16 on only some calls keeps float32: its
    other calls would see maps rounded that its float32 GEMMs would have used whole."""
    if check_wire_dtype(asked) != "auto":
        return asked, f"--wire-dtype {asked}"
    if computed is None:
        if precision == "bf16":
            return "bfloat16", "--precision bf16: the conv GEMMs take bf16 operands"
        if precision == "auto":
            return "float32", ("--precision auto decides per layer as the device runs, after the wire is fixed: "
                               "float32")
        return "float32", f"--precision {precision}"
    cpus = {name: what for name, (device, what) in computed.items() if _is_cpu(device)}
    if not cpus:
        return "float32", "no CPU worker: GPU kernels compute in float32"
    fp32 = [f"{name} computes in {what}" for name, what in cpus.items() if what != "bf16"]
    if fp32:
        return "float32", "not every CPU worker computes in bf16: " + ", ".join(fp32[:3]) + (
            f" and {len(fp32) - 3} more" if len(fp32) > 3 else "")
    others = [name for name in computed if name not in cpus]
    return "bfloat16", (f"every CPU worker's conv GEMMs run bf16 ({', '.join(list(cpus)[:4])}"
                        f"{' ...' if len(cpus) > 4 else ''})"
                        + (f"; {', '.join(others[:4])} computes in float32 from what the wire carries" if others else ""))


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
