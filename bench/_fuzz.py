"""Malformed and hostile frames for a live coordinator and a worker's peer inbox, from a seed:
the live fuzz test and bench/faults.py send the same sequence.

Every frame here must be refused or ignored by a correct receiver without changing the run:
no mutation yields a valid HELLO (a stranger's HELLO would join the run at the next snapshot)
or a SLICE with a real sender and the right shape (it would be taken as that peer's data).
"""
import socket
import time

import msgpack
import numpy as np

from hetconv.transport import protocol as P

KINDS = ("random", "mutated", "truncated", "dtype", "huge", "over_limit", "raw_tcp")


def _header(frames):
    return msgpack.unpackb(frames[0], raw=False)


def _pack(header, arrays=()):
    return [msgpack.packb(header, use_bin_type=True)] + [bytes(a) for a in arrays]


def _templates():
    """Real headers, as the run sends them: what the mutations start from."""
    x = np.ones((2, 3, 8, 8), np.float32)
    return {
        "HELLO": P.pack("HELLO", 0, name="fuzz", identity="fuzz/1", device="cpu", host="h", pid=1, version="0",
                        threads=1, description="cpu", peer_endpoints=[], host_key="h"),
        "HEARTBEAT": P.pack("HEARTBEAT", 0, identity="w0-cpu/h/1/abcd"),
        "ERROR": P.pack("ERROR", -1, name="ValueError", message="boom", worker="w0-cpu", doing="FORWARD", traceback=""),
        "FORWARD": P.pack("FORWARD_DONE", 3, [x], layer=0, compute_s=0.1),
        "SLICE": P.pack("SLICE", 0, [x], step=1, phase="forward", layer=0, micro=0, sender="w0-cpu"),
    }


def _breaking(rng, header):
    """A header change that makes unpack refuse the message whatever the op."""
    h = dict(header)
    choice = int(rng.integers(5))
    if choice == 0:
        h["v"] = int(rng.integers(3, 1000))                  # another protocol version
    elif choice == 1:
        h["op"] = "HELL" + "O" * int(rng.integers(2, 5))     # an unknown op
    elif choice == 2:
        h["seq"] = "seven"
    elif choice == 3:
        h["arrays"] = "everything"
    else:
        h["arrays"] = [["float32", [4]]] * int(rng.integers(1, 4))   # arrays declared, none sent
    return h


def frames_for(rng, target, limit, senders):
    """One fuzz message for `target` ('coordinator' or 'inbox'): (kind, frames) or (kind, None)
    for raw TCP bytes. `senders`: the run's worker names (slices from them get wrong shapes)."""
    kind = KINDS[int(rng.integers(len(KINDS)))]
    templates = _templates()
    ops = ["SLICE"] if target == "inbox" else ["HELLO", "HEARTBEAT", "ERROR", "FORWARD"]
    op = ops[int(rng.integers(len(ops)))]
    frames = templates[op]
    header = _header(frames)
    if kind == "random":
        return kind, [rng.bytes(int(rng.integers(0, 300))) for _ in range(int(rng.integers(1, 4)))]
    if kind == "mutated":
        if op == "SLICE":
            # a real sender with a shape no layer of a tiny run has, or a stranger with any shape
            h = dict(header, sender=senders[int(rng.integers(len(senders)))] if senders else "w0-cpu")
            shape = [int(rng.integers(1, 5)), 997, 3, 3]
            if rng.integers(2):
                h["sender"], shape = "mallory", [2, 3, 8, 8]
            h["step"], h["micro"] = int(rng.integers(1, 8)), int(rng.integers(0, 2))
            h["arrays"] = [["float32", shape]]
            return kind, _pack(h, [np.zeros(shape, np.float32)])
        if op == "HELLO" or rng.integers(2):
            return kind, _pack(_breaking(rng, header), [bytes(f) for f in frames[1:]])
        raw = bytearray(frames[0])
        for _ in range(int(rng.integers(1, 4))):
            raw[int(rng.integers(len(raw)))] = int(rng.integers(256))
        if raw[:1] and b"HELLO" in raw:
            raw = raw.replace(b"HELLO", b"HELLX")            # never a HELLO by chance
        return kind, [bytes(raw)] + [bytes(f) for f in frames[1:]]
    if kind == "truncated":                                  # the array frame cut short
        if len(frames) < 2:
            frames = templates["SLICE" if target == "inbox" else "FORWARD"]
        return kind, [bytes(frames[0]), bytes(frames[1])[:int(rng.integers(0, len(frames[1])))]]
    if kind == "dtype":
        h = dict(_header(templates["SLICE" if target == "inbox" else "FORWARD"]))
        h["arrays"] = [[["object", "float128", "complex64", "<f4", "float32"][int(rng.integers(5))], [2, 3, 8, 8]]]
        body = np.zeros(2 * 3 * 8 * 8 * 2, np.float32)       # twice the bytes float32 needs
        if target == "inbox" and h["arrays"][0][0] == "float32":
            h["sender"] = "mallory"
        return kind, _pack(h, [body])
    if kind == "huge":
        h = dict(_header(templates["SLICE" if target == "inbox" else "FORWARD"]))
        h["arrays"] = [["float32", [1 << 40, 1 << 40, 3, 3]]]
        return kind, _pack(h, [b"\0" * 64])
    if kind == "over_limit":                                 # libzmq cuts the connection
        return kind, [frames[0], b"\0" * (limit + 1 + int(rng.integers(1024)))]
    return kind, None


def fuzz(target, endpoint, limit, senders, seed=0, count=400, deadline_s=20.0, gap_s=0.002, until=None):
    """Send up to `count` messages from `seed` to `target` ('coordinator': tcp://host:port of its
    ROUTER; 'inbox': a worker's tcp peer endpoint), stopping at the deadline or when `until()`
    is true. Returns {kind: sent}."""
    import zmq
    rng = np.random.default_rng(seed)
    ctx = zmq.Context()
    sent = {}
    try:
        sock = ctx.socket(zmq.DEALER if target == "coordinator" else zmq.PUSH)
        sock.linger = 0
        sock.sndtimeo = 200                                  # a cut connection: drop, never block
        sock.connect(endpoint)
        end = time.monotonic() + deadline_s
        for _ in range(count):
            if time.monotonic() > end or (until is not None and until()):
                break
            kind, frames = frames_for(rng, target, limit, senders)
            if frames is None:
                host, port = endpoint[len("tcp://"):].rsplit(":", 1)
                try:
                    with socket.create_connection((host, int(port)), timeout=2) as raw:
                        raw.sendall(rng.bytes(256))
                except OSError:
                    pass
            else:
                try:
                    sock.send_multipart(frames)
                except zmq.Again:
                    pass
            sent[kind] = sent.get(kind, 0) + 1
            time.sleep(gap_s)
    finally:
        ctx.destroy(linger=0)
    return sent
