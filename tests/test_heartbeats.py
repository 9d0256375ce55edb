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


# ---- a worker whose coordinator is gone -----------------------------------------------------------

def _children(pid):
    """Pids whose parent is `pid`, from /proc."""
    import os
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat[stat.rfind(b")") + 2:].split()[1]) == pid:
                found.append(int(entry))
    return found


def _running(pid):
    """Whether `pid` runs (exists and is not a zombie)."""
    from hetconv.worker.serve import _is_zombie
    import os
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not _is_zombie(pid)


def test_an_unreaped_dead_parent_counts_as_gone():
    """A process that has exited but is not reaped (a zombie) answers os.kill(pid, 0); the worker's
    check does not take it for alive."""
    import subprocess
    import sys

    from hetconv.worker.serve import _is_zombie, _parent_alive
    import os
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 10
        while not _is_zombie(child.pid) and time.monotonic() < deadline:
            time.sleep(0.05)                     # never polled meanwhile: it stays a zombie
        os.kill(child.pid, 0)                    # what the old check read as alive
        assert not _parent_alive(child.pid, False)
        assert _parent_alive(os.getppid(), True) and not _parent_alive(os.getpid(), True)
    finally:
        child.wait()


@pytest.mark.timeout(120)
def test_spawned_workers_exit_when_their_coordinator_is_killed_and_never_reaped(procs):
    """This test is the parent that never reaps its coordinator (a notebook reading its output):
    the coordinator is SIGKILLed while its spawned workers run; they exit within a few seconds,
    not at their 900 s idle timeout."""
    import os
    import signal

    from conftest import python_cmd
    coord = procs(python_cmd("hetconv.cli.coordinator", "--spawn", "cpu:1,cpu:1", "--conv", "4,8", "--fc", "8",
                             "--batch-size", "8", "--synthetic-train", "64", "--synthetic-test", "16", "--epochs", "50",
                             "--connect-timeout", "60"))
    workers, pids = [], []
    try:
        for line in coord.stdout:                # each spawned worker announced: both connected
            if line.startswith("worker w") and len(workers) < 2:
                workers.append(line)
            if len(workers) == 2:
                break
        assert len(workers) == 2, "the coordinator ended before its workers connected"
        pids = _children(coord.pid)
        assert len(pids) == 2, pids
        os.kill(coord.pid, signal.SIGKILL)       # and never waited for: a zombie until the fixture ends
        deadline = time.monotonic() + 15
        while any(_running(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_running(p) for p in pids), "a worker outlived its killed coordinator"
    finally:
        for p in set(pids + _children(coord.pid)):      # the workers are not in the fixture's process group
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
