"""The 16-bit wire forms against their definitions."""
import numpy as np
import pytest

from hetconv.transport.wire import WIRE_DTYPES, check_wire_dtype, decode, encode, round_in_place, rounded


def test_float32_is_passed_through_untouched():
    a = np.arange(6, dtype=np.float32)
    assert encode(a, "float32") is a
    assert decode(a, "float32") is a


def test_bfloat16_rounds_to_nearest_even_and_halves_the_bytes():
    rng = np.random.default_rng(0)
    a = (rng.standard_normal(10000) * 10.0 ** rng.integers(-20, 20, 10000)).astype(np.float32)
    wire = encode(a, "bfloat16")
    assert wire.dtype == np.uint16 and wire.nbytes == a.nbytes // 2
    back = decode(wire, "bfloat16")
    assert back.dtype == np.float32
    np.testing.assert_array_less(np.abs(back - a), np.abs(a) * 2.0 ** -8 + 1e-45)
    # exactly representable values survive; a tie goes to the even neighbour
    exact = np.array([1.0, -2.5, 0.0, 3.140625], np.float32)
    np.testing.assert_array_equal(decode(encode(exact, "bfloat16"), "bfloat16"), exact)
    tie = np.array([1.0 + 2.0 ** -8], np.float32)        # halfway between 1 and 1 + 2^-7
    assert decode(encode(tie, "bfloat16"), "bfloat16")[0] == 1.0
    assert np.isnan(decode(encode(np.array([np.nan], np.float32), "bfloat16"), "bfloat16")[0])


def test_float16_round_trip():
    a = np.array([0.5, -1.25, 1000.0], np.float32)
    wire = encode(a, "float16")
    assert wire.dtype == np.float16
    np.testing.assert_array_equal(decode(wire, "float16"), a)


def test_a_wire_of_the_wrong_dtype_is_refused():
    with pytest.raises(ValueError, match="a bfloat16 wire carried float32"):
        decode(np.zeros(2, np.float32), "bfloat16")
    with pytest.raises(ValueError, match="--wire-dtype must be one of auto, float32, bfloat16, float16, got .int8."):
        check_wire_dtype("int8")
    assert set(WIRE_DTYPES) == {"float32", "bfloat16", "float16"}


@pytest.mark.parametrize("wire", WIRE_DTYPES)
def test_rounding_in_place_gives_what_the_wire_would_have_carried(wire):
    rng = np.random.default_rng(1)
    decades = 3 if wire == "float16" else 30             # within float16's range: no overflow to say
    a = (rng.standard_normal(4096) * 10.0 ** rng.integers(-decades, decades, 4096)).astype(np.float32).reshape(8, 512)
    a[0, :3] = [1.0 + 2.0 ** -8, np.inf, np.nan]         # a tie to even, and the values with a full exponent
    want = decode(encode(a, wire), wire)
    got = a.copy()
    assert round_in_place(got, wire) is got
    np.testing.assert_array_equal(got, want)
    kept = a.copy()                                      # --local's one pass: a new array, the input untouched
    fresh = rounded(a[:, ::2], wire)
    np.testing.assert_array_equal(fresh, want[:, ::2])
    np.testing.assert_array_equal(a, kept)
    assert fresh.dtype == np.float32 and fresh.flags.c_contiguous and not np.shares_memory(fresh, a)


def test_bfloat16_kernels_equal_the_bit_arithmetic_on_every_kind_of_value_and_layout():
    """encode, decode and round_in_place against the definition written out in numpy: every
    float32 bit pattern class (normals, subnormals, ties, infinities, NaNs, both signs), a 4-D map,
    and views that are not contiguous (a channel slice, a transposed block)."""
    rng = np.random.default_rng(2)
    bits = rng.integers(0, 2 ** 32, (6, 5, 4, 3), dtype=np.uint64).astype(np.uint32)
    bits.reshape(-1)[:8] = [0x3F808000, 0x3F818000, 0x7F800000, 0xFF800000, 0x7FC00001, 0x00000001, 0x80008000,
                            0x7F7FFFFF]
    a = bits.view(np.float32)

    def want_encoded(x):
        b = np.ascontiguousarray(x).view(np.uint32).astype(np.uint64)
        return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)

    for x in (a, a[:, 1:3], a.transpose(1, 0, 2, 3)):
        got = encode(x, "bfloat16")
        np.testing.assert_array_equal(got, want_encoded(x))
        np.testing.assert_array_equal(decode(got, "bfloat16").view(np.uint32), got.astype(np.uint32) << 16)
        rounded = np.array(x, copy=True)
        round_in_place(rounded, "bfloat16")
        np.testing.assert_array_equal(rounded.view(np.uint32), want_encoded(x).astype(np.uint32) << 16)
    view = np.array(a, copy=True)[:, 1:3]                   # rounded in place through a strided view
    whole = view.base if view.base is not None else view
    before = np.array(whole, copy=True)
    round_in_place(view, "bfloat16")
    np.testing.assert_array_equal(view.view(np.uint32), want_encoded(a[:, 1:3]).astype(np.uint32) << 16)
    np.testing.assert_array_equal(whole[:, [0, 3, 4]], before[:, [0, 3, 4]])
