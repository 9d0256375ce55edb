"""Feature maps and gradients on the wire: float32 (exact, the default) or a 16-bit form that
halves the bytes of every exchange at the cost of rounding.

- float16: IEEE half. 10 mantissa bits, but a range of 6e-8 .. 65504: gradients that small
  flush to zero, so it is the riskier choice for the backward pass.
- bfloat16: the top 16 bits of a float32 (same range, 7 mantissa bits), rounded to nearest even.
  numpy has no bfloat16, so it travels as uint16 and is widened back by a shift.
Arrays are encoded by the sender and decoded to float32 by the receiver; compute is float32.
"""
import numpy as np

WIRE_DTYPES = ("float32", "bfloat16", "float16")


def check_wire_dtype(name):
    if name not in WIRE_DTYPES:
        raise ValueError(f"--wire-dtype must be one of {', '.join(WIRE_DTYPES)}, got {name!r}")
    return name


def value_bytes(wire):
    """Bytes one feature-map value takes on `wire`: what the cost model charges per value."""
    return 4 if check_wire_dtype(wire) == "float32" else 2


def encode(a, wire):
    """float32 array -> what travels for `wire` (the same array for float32: no copy)."""
    if wire == "float32":
        return a
    if wire == "float16":
        return np.asarray(a, np.float32).astype(np.float16)
    if wire == "bfloat16":
        bits = np.ascontiguousarray(a, np.float32).view(np.uint32)
        # round to nearest even on the 16 bits dropped; NaN stays NaN because its exponent is full
        rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
        return (rounded >> np.uint32(16)).astype(np.uint16)
    raise ValueError(f"unknown wire dtype {wire!r}: expected one of {', '.join(WIRE_DTYPES)}")


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
        return (a.astype(np.uint32) << np.uint32(16)).view(np.float32)
    raise ValueError(f"unknown wire dtype {wire!r}: expected one of {', '.join(WIRE_DTYPES)}")
