"""The wire format, and the only code that knows msgpack.

A message is a list of ZeroMQ frames: [header, *arrays]. The header is a msgpack map
{v, op, seq, arrays: [[dtype, shape], ...], ...fields}; each array travels as its own raw,
C-contiguous, little-endian frame, so large ones go zero-copy. Nothing is ever pickled, and every received
message is checked here (version, op, declared dtype and shape against each frame, limits)
before anyone looks at it. docs/protocol.md lists every message.
"""
from dataclasses import dataclass, field
import math
import traceback

import msgpack
import numpy as np

PROTOCOL_VERSION = 5

# Coordinator -> worker requests, worker -> coordinator replies and notices, worker -> worker.
REQUESTS = ("WELCOME", "CALIBRATE", "PREPARE", "LOAD", "FORWARD", "BACKWARD", "UPDATE", "NORM", "FETCH", "SHUTDOWN",
            "PEERS", "STEP", "INPUT", "GRAD", "WAIT")
REPLIES = ("HELLO", "HEARTBEAT", "CALIBRATED", "PREPARED", "LOADED", "FORWARD_DONE", "BACKWARD_DONE", "UPDATED", "NORMED",
           "SHARD", "BYE", "ERROR", "PEERS_OK", "FEATURES", "STEP_DONE")
PEER_OPS = ("SLICE",)
OPS = frozenset(REQUESTS + REPLIES + PEER_OPS)

DTYPES = frozenset({"float32", "float64", "float16", "int8", "uint8", "uint16", "int32", "int64"})
MAX_HEADER_BYTES = 1 << 20
MAX_ARRAYS = 64                   # a layer's state: weights, BatchNorm vectors, optimizer slots
MAX_NDIM = 8
MAX_ARRAY_BYTES = 4 << 30         # 4 GiB: far above any layer this project sends


# The fields of every message that drives computation, with their types. The side that serves a
# request checks them with `check_fields` before reading any (a missing or mistyped field is an
# ERROR naming it), so a handler reads f["x"] and never falls back to a default. A peer's SLICE
# and the step's INPUT and GRAD are checked with what the running step adds (worker.peers).
_OPTIONAL_MAP = (dict, type(None))
FIELDS = {
    "CALIBRATE": {"layers": list, "repeats": int},
    "PREPARE": {"calls": list},
    "LOAD": {"layer": int, "spec": dict, "start": int, "stop": int, "wire": str, "optimizer": str, "names": list,
             "bn_ghost_batch": int},
    "FORWARD": {"layer": int, "micros": list, "rows": list, "batch": int, "train": bool, "train_step": int,
                "seed": int},
    "BACKWARD": {"layer": int, "micros": list, "need_dx": bool},
    "UPDATE": {"layer": int, "update": dict},
    "NORM": {},
    "FETCH": {"layer": int},
    "STEP": {"step": int, "micro_batches": int, "train": bool, "update": _OPTIONAL_MAP, "train_step": int,
             "seed": int},
    "INPUT": {"step": int, "micro": int},
    "GRAD": {"step": int, "micro": int},
    "FEATURES": {"step": int, "micro": int},
    "SLICE": {"step": int, "phase": str, "layer": int, "micro": int, "sender": str},
}


# Fields a request may carry beside those, each checked for its type where present.
OPTIONAL_FIELDS = {
    "FETCH": {"conv_paths": bool, "conv_path_choices": bool, "norms": bool},
    "STEP": {"trace": bool},            # the worker's spans of the step back in STEP_DONE (graph_step.StepTrace)
}


class ProtocolError(ValueError):
    """A message that is not well-formed hetconv protocol."""


class ProtocolVersionError(ProtocolError):
    """A well-formed header from a peer that speaks another protocol version."""


@dataclass
class Message:
    op: str
    seq: int
    fields: dict = field(default_factory=dict)
    arrays: list = field(default_factory=list)


def pack(op, seq=0, arrays=(), **fields):
    """-> [header bytes, *array buffers]. Arrays are made C-contiguous (a copy only if they are
    not already); the buffers alias the arrays, so the caller must not modify an array until the
    message has left (pyzmq's send with copy=False keeps a reference until then)."""
    if op not in OPS:
        raise ProtocolError(f"unknown op {op!r}: expected one of {sorted(OPS)}")
    for reserved in ("v", "op", "seq", "arrays"):
        if reserved in fields:
            raise ProtocolError(f"field name {reserved!r} is reserved by the header")
    frames, specs = [], []
    for i, a in enumerate(arrays):
        a = np.asarray(a)
        if not a.flags.c_contiguous:
            a = a.copy(order="C")
        if a.dtype.name not in DTYPES:
            raise ProtocolError(f"array {i} has dtype {a.dtype.name}: expected one of {sorted(DTYPES)}")
        if a.dtype != a.dtype.newbyteorder("<"):
            # the header names a dtype, not a byte order: the wire is little-endian, so a big-endian
            # array (read from a file written on such a host) costs one converted copy here
            a = a.astype(a.dtype.newbyteorder("<"))
        specs.append([a.dtype.name, list(a.shape)])
        frames.append(memoryview(a.reshape(-1)).cast("B") if a.size else b"")
    header = msgpack.packb({"v": PROTOCOL_VERSION, "op": op, "seq": int(seq), "arrays": specs, **fields},
                           use_bin_type=True)
    return [header] + frames


def _frame_bytes(frame):
    """bytes-like view of a frame: zmq.Frame (copy=False), bytes or memoryview."""
    buffer = getattr(frame, "buffer", None)
    return buffer if buffer is not None else memoryview(frame)


def unpack(frames, accept_any_version=False):
    """[header, *arrays] -> Message. Raises ProtocolError, with what was wrong, for anything
    malformed; arrays are read-only views of the received frames (never write into them)."""
    if not frames:
        raise ProtocolError("empty message: expected [header, *arrays]")
    raw = _frame_bytes(frames[0])
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header is {len(raw)} bytes, the limit is {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as e:
        raise ProtocolError(f"header is not msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a msgpack map, got {type(header).__name__}")
    version = header.get("v")
    if version != PROTOCOL_VERSION and not accept_any_version:
        raise ProtocolVersionError(f"peer speaks protocol version {version!r}, this side speaks {PROTOCOL_VERSION}")
    op, seq, specs = header.get("op"), header.get("seq"), header.get("arrays", [])
    if not isinstance(op, str) or op not in OPS:     # a list or map is unhashable: test the type first
        raise ProtocolError(f"unknown op {op!r:.200}: expected one of {sorted(OPS)}")
    if not isinstance(seq, int) or isinstance(seq, bool):
        raise ProtocolError(f"seq must be an integer, got {seq!r}")
    if not isinstance(specs, list) or len(specs) > MAX_ARRAYS:
        raise ProtocolError(f"'arrays' must be a list of at most {MAX_ARRAYS} [dtype, shape] pairs, got {specs!r:.200}")
    if len(specs) != len(frames) - 1:
        raise ProtocolError(f"header declares {len(specs)} arrays but {len(frames) - 1} array frames arrived")
    arrays = []
    for i, (spec, frame) in enumerate(zip(specs, frames[1:])):
        arrays.append(_array_from_frame(i, spec, frame))
    fields = {k: v for k, v in header.items() if k not in ("v", "op", "seq", "arrays")}
    return Message(op, seq, fields, arrays)


def _array_from_frame(i, spec, frame):
    if (not isinstance(spec, list) or len(spec) != 2 or not isinstance(spec[0], str)
            or not isinstance(spec[1], list)):
        raise ProtocolError(f"array {i}: spec must be [dtype, shape], got {spec!r:.200}")
    dtype, shape = spec
    if dtype not in DTYPES:
        raise ProtocolError(f"array {i}: dtype {dtype!r} is not allowed: expected one of {sorted(DTYPES)}")
    if len(shape) > MAX_NDIM or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ProtocolError(f"array {i}: shape {shape!r:.200} must be at most {MAX_NDIM} non-negative integers")
    itemsize = np.dtype(dtype).itemsize
    # Python ints, not np.prod: a hostile shape must not wrap around int64 to a small size. numpy
    # also refuses an empty array whose other dimensions overflow, so those count towards the limit.
    declared = itemsize * math.prod(d for d in shape if d)
    if declared > MAX_ARRAY_BYTES:
        raise ProtocolError(f"array {i}: {dtype}{tuple(shape)} declares {declared} bytes, the limit is {MAX_ARRAY_BYTES}")
    expected = itemsize * math.prod(shape)
    buf = _frame_bytes(frame)
    if len(buf) != expected:
        raise ProtocolError(f"array {i}: declared {dtype}{tuple(shape)} needs {expected} bytes, the frame has {len(buf)}")
    # Little-endian on the wire. Through its type string, so that on a little-endian host this is
    # numpy's own native dtype: a distinct '<' descriptor compares equal but is not the same, and
    # np.asarray(a, np.float32) then returns a new view on every call, which defeats every cache
    # keyed by the array (the FFT path's kernel spectra were recomputed on every call).
    wire = np.dtype(np.dtype(dtype).newbyteorder("<").str)
    a = np.frombuffer(buf, dtype=wire) if expected else np.empty(0, wire)
    a = a.reshape(shape)
    a.flags.writeable = False
    return a


def _type_names(types):
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join("nil" if t is type(None) else {"dict": "map", "str": "string", "bool": "boolean",
                                                       "int": "integer"}.get(t.__name__, t.__name__) for t in types)


def check_fields(op, fields):
    """Raise ProtocolError unless `fields` has every field FIELDS lists for `op`, each of its type,
    and each of OPTIONAL_FIELDS it has of its type too (a boolean is not an integer here, as msgpack
    keeps them apart)."""
    optional = OPTIONAL_FIELDS.get(op, {})
    for name, types in [*FIELDS.get(op, {}).items(), *optional.items()]:
        if name not in fields:
            if name in optional:
                continue
            raise ProtocolError(f"{op} without its {name!r} field")
        value = fields[name]
        wanted = types if isinstance(types, tuple) else (types,)
        if (isinstance(value, bool) and bool not in wanted) or not isinstance(value, wanted):
            raise ProtocolError(f"{op} field {name!r} must be {_type_names(types)}, got {value!r:.60}")


def error_fields(exc, worker, doing):
    """The fields of an ERROR message for an exception raised while `doing` something."""
    return {"name": type(exc).__name__, "message": str(exc)[:4000], "worker": worker, "doing": doing,
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-8000:]}
