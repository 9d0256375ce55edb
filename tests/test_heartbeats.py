"""Liveness rides a channel of its own: a worker whose main connection is busy (a large reply
crawling over a slow link) is alive as long as its heartbeats arrive, and one that sends none is
named after --worker-timeout. A fake worker (a raw DEALER in a thread) stands in for the real one,
so the main connection can be held silent on purpose."""
import socket
import threading
import time

import pytest
import zmq

from hetconv.transport import protocol as P
from hetconv.coordinator.remote import RemoteEngine, WorkerLost

WORKER_TIMEOUT_S = 1.0
SILENT_S = 3 * WORKER_TIMEOUT_S          # the main connection says nothing for this long


class FakeWorker(threading.Thread):
    """Says HELLO, takes WELCOME, then answers the first request after SILENT_S, heartbeating on
    the heartbeat channel (or not at all) meanwhile."""

    def __init__(self, address, beat):
        super().__init__(daemon=True)
        self.address, self.beat = address, beat
        self.identity = f"fake/{id(self)}"
        self.stop = threading.Event()
        self.error = None

    def run(self):
        ctx = zmq.Context.instance()
        dealer = ctx.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.identity = self.identity.encode()
        dealer.connect(self.address)
        beats = None
        try:
            dealer.send_multipart(P.pack("HELLO", 0, name="fake", identity=self.identity, device="cpu", pid=0,
                                         peer_endpoints=[], host_key=""))
            welcome = P.unpack(dealer.recv_multipart())
            assert welcome.op == "WELCOME", welcome.op
            port = welcome.fields["heartbeat_port"]
            assert port, "the coordinator announced no heartbeat channel"
            beats = ctx.socket(zmq.PUSH)
            beats.linger = 0
            beats.connect(f"{self.address.rsplit(':', 1)[0]}:{port}")
            if not dealer.poll(10_000):
                return
            request = P.unpack(dealer.recv_multipart())
            until = time.monotonic() + SILENT_S
            while time.monotonic() < until and not self.stop.is_set():
                if self.beat:
                    beats.send_multipart(P.pack("HEARTBEAT", 0, identity=self.identity))
                time.sleep(0.2)
            if not self.stop.is_set():
                dealer.send_multipart(P.pack("SHARD", request.seq))
                self.stop.wait(10)                  # stay connected: a drop right after would be a loss
        except Exception as e:                      # reported by the test, not lost in the thread
            self.error = e
        finally:
            dealer.close(0)
            if beats is not None:
                beats.close(0)


def engine_with(beat):
    with socket.socket() as probe:                            # a free loopback port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    worker = FakeWorker(f"tcp://127.0.0.1:{port}", beat)
    worker.start()
    engine = RemoteEngine(f"tcp://127.0.0.1:{port}", 1, worker_timeout=WORKER_TIMEOUT_S, connect_timeout=20,
                          op_timeout=30, log=lambda *_: None)
    return engine, worker


@pytest.mark.timeout(60)
def test_a_worker_heartbeating_on_its_own_channel_is_alive_while_its_reply_is_held_back():
    engine, worker = engine_with(beat=True)
    try:
        t0 = time.monotonic()
        replies = engine._call({"fake": ("FETCH", [], {"layer": 0})}, "fetching a large shard")
        assert list(replies) == ["fake"]
        assert time.monotonic() - t0 >= SILENT_S - 0.5      # it really waited past --worker-timeout
    finally:
        worker.stop.set()
        engine.close()
        worker.join(5)
    assert worker.error is None, worker.error


@pytest.mark.timeout(60)
def test_a_worker_silent_on_both_channels_is_named_after_the_timeout():
    engine, worker = engine_with(beat=False)
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerLost, match=r"worker fake .* stopped answering \(no heartbeat for"):
            engine._call({"fake": ("FETCH", [], {"layer": 0})}, "fetching a large shard")
        assert time.monotonic() - t0 < SILENT_S             # named before the held-back reply came
    finally:
        worker.stop.set()
        engine.close()
        worker.join(5)
    assert worker.error is None, worker.error
