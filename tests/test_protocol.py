import re
import pickle

import msgpack
import numpy as np
import pytest

from hetconv.transport import protocol as P


@pytest.mark.parametrize("dtype", sorted(P.DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 3, 4), (1, 1, 1, 1, 1)])
def test_round_trip_over_dtypes_and_shapes(dtype, shape):
    a = (np.arange(int(np.prod(shape)), dtype=np.float64) - 3).astype(dtype).reshape(shape)
    msg = P.unpack(P.pack("FORWARD", 7, [a], layer=1))
    assert msg.op == "FORWARD" and msg.seq == 7 and msg.fields == {"layer": 1}
    assert msg.arrays[0].dtype == a.dtype and msg.arrays[0].shape == a.shape
    np.testing.assert_array_equal(msg.arrays[0], a)


def test_non_contiguous_input_arrives_equal():
    base = np.arange(60, dtype=np.float32).reshape(3, 4, 5)
    views = [base[:, ::2], base.transpose(2, 0, 1), base[..., 1]]
    msg = P.unpack(P.pack("BACKWARD", 1, views))
    for got, want in zip(msg.arrays, views):
        np.testing.assert_array_equal(got, want)


def test_received_arrays_are_read_only():
    msg = P.unpack([bytes(f) for f in P.pack("FORWARD", 1, [np.ones(3, np.float32)])])
    with pytest.raises(ValueError):
        msg.arrays[0][0] = 2


def test_fields_survive_and_reserved_names_are_refused():
    msg = P.unpack(P.pack("HELLO", 0, name="w0", threads=2, speeds=[1.5, 2.0], nested={"a": [1]}))
    assert msg.fields == {"name": "w0", "threads": 2, "speeds": [1.5, 2.0], "nested": {"a": [1]}}
    with pytest.raises(P.ProtocolError, match="reserved"):
        P.pack("HELLO", 0, arrays_=1, v=3)


@pytest.mark.parametrize("array,message", [
    (np.array([object()]), "dtype object"),
    (np.array(["text"]), "dtype str"),
    (np.ones(2, np.complex64), "dtype complex64"),
])
def test_pack_refuses_dtypes_off_the_whitelist(array, message):
    with pytest.raises(P.ProtocolError, match=message):
        P.pack("FORWARD", 1, [array])


def header(**overrides):
    h = {"v": P.PROTOCOL_VERSION, "op": "FORWARD", "seq": 1, "arrays": [["float32", [2]]]}
    h.update(overrides)
    return msgpack.packb(h, use_bin_type=True)


GOOD_FRAME = np.ones(2, np.float32).tobytes()


@pytest.mark.parametrize("frames,message", [
    ([], "empty message"),
    ([b"\xc1\xff garbage"], "header is not msgpack"),
    ([msgpack.packb([1, 2, 3])], "header must be a msgpack map"),
    ([header(op="LAUNCH_MISSILES"), GOOD_FRAME], "unknown op 'LAUNCH_MISSILES'"),
    ([header(seq="1"), GOOD_FRAME], "seq must be an integer"),
    ([header(), GOOD_FRAME, GOOD_FRAME], "declares 1 arrays but 2 array frames arrived"),
    ([header()], "declares 1 arrays but 0 array frames arrived"),
    ([header(arrays=[["object", [2]]]), GOOD_FRAME], "dtype 'object' is not allowed"),
    ([header(arrays=[["float32", [-2]]]), GOOD_FRAME], "must be at most 8 non-negative integers"),
    ([header(arrays=[["float32", [3]]]), GOOD_FRAME], r"needs 12 bytes, the frame has 8"),
    ([header(arrays=[["float32", [1 << 40]]]), GOOD_FRAME], "the limit is"),
    ([header(arrays=[["float32"]]), GOOD_FRAME], r"spec must be \[dtype, shape\]"),
    ([header(arrays="float32"), GOOD_FRAME], "'arrays' must be a list"),
    ([b"\x00" * (P.MAX_HEADER_BYTES + 1)], "header is"),
    # found by tests/test_protocol_fuzz.py: an unhashable op raised TypeError, and a declared
    # shape whose dimensions overflow int64 (even next to a 0) got past the size check to numpy
    ([header(op=[], arrays=[])], r"unknown op \[\]"),
    ([header(op={"a": 1}, arrays=[])], "unknown op"),
    ([header(arrays=[["float64", [0, 1 << 60]]]), b""], "declares 9223372036854775808 bytes, the limit is"),
    ([header(arrays=[["float32", [1 << 62, 4]]]), GOOD_FRAME], "the limit is"),
    ([header(arrays=[["int8", [(1 << 64) - 1]]]), GOOD_FRAME], "the limit is"),
])
def test_malformed_messages_are_refused_with_a_reason(frames, message):
    with pytest.raises(P.ProtocolError, match=message):
        P.unpack(frames)


def test_version_mismatch_is_its_own_error_and_can_be_read_leniently():
    frames = [header(v=99, op="HELLO", arrays=[]), ]
    with pytest.raises(P.ProtocolVersionError, match=f"peer speaks protocol version 99, this side speaks {P.PROTOCOL_VERSION}"):
        P.unpack(frames)
    assert P.unpack(frames, accept_any_version=True).op == "HELLO"


def test_a_pickled_header_is_refused_and_ours_is_msgpack():
    # a pickle arriving from the network is never unpickled: unpack refuses it as not msgpack
    frames = P.pack("HELLO", 0, [np.ones(2, np.float32)], name="w")
    fields = msgpack.unpackb(frames[0])
    assert fields["name"] == "w"
    with pytest.raises(P.ProtocolError, match="header is not msgpack"):
        P.unpack([pickle.dumps(fields)] + frames[1:])


def test_error_fields_carry_name_message_and_traceback():
    try:
        raise ValueError("bad shape")
    except ValueError as e:
        f = P.error_fields(e, "w0", "FORWARD layer=1")
    assert f["name"] == "ValueError" and f["message"] == "bad shape" and "Traceback" in f["traceback"]
    assert P.unpack(P.pack("ERROR", 3, **f)).fields["worker"] == "w0"


@pytest.mark.parametrize("op,fields,error", [
    ("FORWARD", {"layer": 0, "rows": [0], "batch": 4, "train": True, "train_step": 0, "seed": 0},
     "FORWARD without its 'micros' field"),
    ("FORWARD", {"layer": 0, "micros": [0], "rows": [0], "batch": 4, "train": 1, "train_step": 0, "seed": 0},
     "FORWARD field 'train' must be boolean, got 1"),
    ("BACKWARD", {"layer": 0, "micros": [0], "need_dx": 1}, "BACKWARD field 'need_dx' must be boolean, got 1"),
    ("UPDATE", {"layer": 0, "update": [0.1, 0.9]}, "UPDATE field 'update' must be map, got [0.1, 0.9]"),
    ("LOAD", {"layer": 0, "spec": [], "start": 0, "stop": 1, "wire": "float32", "optimizer": "sgd", "names": []},
     "LOAD field 'spec' must be map"),
    ("STEP", {"step": 1, "micro": 2, "train": True, "update": None, "train_step": 0, "seed": 0},
     "STEP without its 'micro_batches' field"),
    ("STEP", {"step": 1, "micro_batches": 2, "train": True, "update": "fast", "train_step": 0, "seed": 0},
     "STEP field 'update' must be map or nil, got 'fast'"),
])
def test_a_request_without_its_typed_fields_is_refused_naming_the_field(op, fields, error):
    with pytest.raises(P.ProtocolError, match="^" + re.escape(error)):
        P.check_fields(op, fields)


def test_a_request_with_its_typed_fields_passes_and_unlisted_ops_are_free():
    P.check_fields("BACKWARD", {"layer": 1, "micros": [0, 1], "need_dx": False})
    P.check_fields("STEP", {"step": 4, "micro_batches": 2, "train": False, "update": None, "train_step": 3, "seed": 0})
    P.check_fields("HEARTBEAT", {})
