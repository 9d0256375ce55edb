"""Property tests: whatever frames arrive, unpack returns a Message or raises ProtocolError.

A peer that is buggy or hostile must never crash the receiver with some other exception (a
TypeError deep in numpy, a MemoryError from a declared shape): the coordinator and worker
catch ProtocolError only. Bounded so the file runs in seconds.
"""
import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetconv.transport import protocol as P

# no example database: a failure prints its example, which then becomes a case in test_protocol.py
FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])


def unpack_is_total(frames):
    try:
        msg = P.unpack(frames)
    except P.ProtocolError:
        return None
    assert isinstance(msg, P.Message)
    for spec, a in zip(msgpack.unpackb(bytes(frames[0]), raw=False).get("arrays", []), msg.arrays):
        assert a.dtype.name == spec[0] and list(a.shape) == spec[1]
    return msg


# msgpack values of any shape: what a header's fields or its declared specs might hold
scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1),
                    st.floats(allow_nan=True), st.text(max_size=20), st.binary(max_size=20))
junk = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.one_of(st.text(max_size=8), st.binary(max_size=8)), inner,
                                                  max_size=4)), max_leaves=12)
dims = st.one_of(st.integers(min_value=0, max_value=4), st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1),
                 st.sampled_from([1 << 31, 1 << 32, 1 << 62, (1 << 63) - 1, (1 << 64) - 1]), junk)
shapes = st.one_of(st.lists(dims, max_size=10), junk)
specs = st.one_of(st.tuples(st.sampled_from(sorted(P.DTYPES) + ["object", "float16", "<f4", ""]), shapes).map(list),
                  junk)


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=5))
def test_random_frames(frames):
    unpack_is_total(frames)


@FUZZ
@given(op=st.one_of(st.sampled_from(sorted(P.OPS)), junk), seq=st.one_of(st.integers(0, 10), junk),
       v=st.one_of(st.just(P.PROTOCOL_VERSION), junk), arrays=st.one_of(st.lists(specs, max_size=4), junk),
       extra=st.dictionaries(st.one_of(st.text(max_size=8), st.binary(max_size=8), st.integers()), junk, max_size=3),
       frames=st.lists(st.binary(max_size=48), max_size=4))
def test_headers_with_junk_in_every_field(op, seq, v, arrays, extra, frames):
    header = {**extra, "v": v, "op": op, "seq": seq, "arrays": arrays}
    try:
        raw = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        return                                      # not expressible in msgpack: nothing to send
    unpack_is_total([raw, *frames])


@FUZZ
@given(shape=st.lists(dims, max_size=9), dtype=st.sampled_from(sorted(P.DTYPES)), size=st.integers(0, 64))
def test_huge_or_odd_declared_shapes(shape, dtype, size):
    try:
        raw = msgpack.packb({"v": P.PROTOCOL_VERSION, "op": "FORWARD", "seq": 1, "arrays": [[dtype, shape]]},
                            use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        return
    unpack_is_total([raw, b"\0" * size])


def valid_message(draw):
    n = draw(st.integers(0, 3))
    arrays = []
    for _ in range(n):
        dtype = draw(st.sampled_from(sorted(P.DTYPES)))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        arrays.append(np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape))
    op = draw(st.sampled_from(sorted(P.OPS)))
    return [bytes(f) for f in P.pack(op, draw(st.integers(0, 1 << 40)), arrays, layer=draw(st.integers(0, 3)))]


@st.composite
def mutated_messages(draw):
    frames = valid_message(draw)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["flip", "truncate", "drop", "duplicate", "append", "swap"]))
        i = draw(st.integers(0, len(frames) - 1)) if frames else 0
        if kind == "flip" and frames and frames[i]:
            b = bytearray(frames[i])
            b[draw(st.integers(0, len(b) - 1))] ^= 1 << draw(st.integers(0, 7))
            frames[i] = bytes(b)
        elif kind == "truncate" and frames:
            frames[i] = frames[i][:draw(st.integers(0, max(0, len(frames[i]) - 1)))]
        elif kind == "drop" and frames:
            del frames[i]                           # wrong array count, or no header at all
        elif kind == "duplicate" and frames:
            frames.insert(i, frames[i])
        elif kind == "append":
            frames.append(draw(st.binary(max_size=32)))
        elif kind == "swap" and len(frames) > 1:
            j = draw(st.integers(0, len(frames) - 1))
            frames[i], frames[j] = frames[j], frames[i]
    return frames


@FUZZ
@given(mutated_messages())
def test_mutations_of_valid_messages(frames):
    unpack_is_total(frames)


@FUZZ
@given(st.data())
def test_valid_messages_still_round_trip(data):
    frames = valid_message(data.draw)
    assert unpack_is_total(frames) is not None
