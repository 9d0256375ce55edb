"""The worker's transport: what its peer inbox admits, which route it takes to a peer, and how a
real worker process behaves against a fake coordinator (a ROUTER in the test) that stops
reading, terminates it, or keeps it waiting to join. Worker processes use ipc paths under a
short pytest temp folder (TMPDIR), and every one is ended by the procs fixture."""
import os
import queue
import signal
import stat
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from conftest import python_cmd
from hetconv.transport import protocol as P
from hetconv.transport.keys import PeerKeys
from hetconv.worker.peers import PeerLinks

WORKERS = ("w0", "w1", "w2", "w3")
STARTUP_S = 120          # a worker process imports numpy and numba and opens its device first
EXIT_BOUND_S = 30        # a bound on a hang, not a speed claim


def plan_fields(workers=WORKERS, layers=2, you="w1", **extra):
    return {"you": you, "peers": [{"name": w, "endpoints": [], "host_key": "", **extra.get(w, {})} for w in workers],
            "ranges": [{w: [i, i + 1] for i, w in enumerate(workers)} for _ in range(layers)],
            "timeout": 2.0, "connect": False}


def slice_msg(step, phase="gather", layer=0, micro=0, sender="w0", value=1.0, peer_key=None, arrays=1):
    msg = P.unpack(P.pack("SLICE", 0, [np.full((2, 3, 4, 4), value, np.float32)] * arrays, step=step, phase=phase,
                          layer=layer, micro=micro, sender=sender))
    if peer_key is not None:
        msg.peer_key = peer_key                  # as the worker's I/O thread records it from the connection
    return msg


@pytest.fixture
def links():
    links = PeerLinks(None, "w1", None, queue.Queue(), None)
    links.connect(plan_fields())
    links.logged = []
    links.log = links.logged.append
    return links


# ---- the peer inbox -----------------------------------------------------------------------------

@pytest.mark.parametrize("layer", [[1], {"a": 1}])
def test_an_unhashable_layer_is_dropped_not_raised(links, layer):
    links.hold_early(slice_msg(7, layer=layer, sender="w0"))
    links.hold_early(slice_msg(7, sender="w2"))
    assert list(links.held) == [(7, "gather", 0, 0, "w2")]


def test_a_far_future_step_does_not_evict_the_next_steps_early_slice(links):
    """Before any step of the plan has run the next step's id is unknown: one sender's step 10**9
    must not make another sender's real early slice look overtaken."""
    links.hold_early(slice_msg(10**9, sender="w0"))
    links.hold_early(slice_msg(8, sender="w2", value=4.0))
    assert (8, "gather", 0, 0, "w2") in links.held


def test_once_a_step_has_run_only_the_next_steps_first_gathers_are_held_between_steps(links):
    links.start_step(7, 1)
    links.hold_early(slice_msg(10**9, sender="w0"))
    links.hold_early(slice_msg(6, sender="w0"))
    links.hold_early(slice_msg(8, phase="backward", layer=1, sender="w0"))  # cannot precede our first gather
    links.hold_early(slice_msg(8, sender="w2", value=4.0))
    assert list(links.held) == [(8, "gather", 0, 0, "w2")]
    links.start_step(8, 1)
    got = links._await({(8, "gather", 0, 0, "w2")}, 8)
    np.testing.assert_array_equal(got[(8, "gather", 0, 0, "w2")], 4.0)


@pytest.mark.parametrize("fields", [
    dict(micro=1), dict(micro=-1), dict(micro="0"), dict(layer=3), dict(phase="forward", layer=1),
    dict(phase="backward", layer=0), dict(phase="backward", layer=2), dict(phase="sideways"),
    dict(sender="w1"), dict(sender="w9"), dict(sender=["w0"]), dict(step=3), dict(step=5, phase="backward", layer=1),
    dict(step=True), dict(arrays=2)])
def test_a_slice_outside_the_plan_is_dropped_not_held(links, fields):
    """During step 4 of one micro-batch over two layers: a micro-batch, layer or phase the plan
    does not have, a sender that is this worker or none of the plan's, another step, or a wrong
    number of arrays: dropped, never held (held slices of unexpected keys grew without bound)."""
    links.start_step(4, 1)
    links.requests.put(slice_msg(**{"step": 4, **fields}))
    links.requests.put(slice_msg(4, sender="w0", value=2.0))
    got = links._await({(4, "gather", 0, 0, "w0")}, 4)
    np.testing.assert_array_equal(got[(4, "gather", 0, 0, "w0")], 2.0)
    assert links.held == {}


def test_each_key_is_held_once_and_each_kind_of_refusal_logged_once(links):
    links.start_step(4, 2)
    for value in range(50):
        links.requests.put(slice_msg(4, phase="gather_grad", layer=1, sender="w2", value=value))
        links.requests.put(slice_msg(4, micro=7 + value, sender="w2"))
    links.requests.put(slice_msg(4, sender="w0"))
    links._await({(4, "gather", 0, 0, "w0")}, 4)
    assert list(links.held) == [(4, "gather_grad", 1, 0, "w2")]
    np.testing.assert_array_equal(links.held[(4, "gather_grad", 1, 0, "w2")], 0.0)  # the first one kept
    assert len(links.logged) == 2, links.logged                                     # duplicate, micro
    assert links.dropped == 99


def test_a_peer_cannot_pose_as_the_coordinators_input(links):
    links.start_step(4, 1)
    links.requests.put(slice_msg(4, phase="INPUT", sender="coordinator", value=9.0))
    links.requests.put(P.unpack(P.pack("INPUT", 0, [np.full((2, 3, 4, 4), 1.0, np.float32)], step=4, micro=0)))
    got = links._await({(4, "INPUT", -1, 0, "coordinator")}, 4)
    np.testing.assert_array_equal(got[(4, "INPUT", -1, 0, "coordinator")], 1.0)


def test_with_keys_a_sender_must_hold_the_key_its_connection_authenticated():
    """w0 holds key A; w2 and w3 share key B (workers started with one key folder): a slice
    over a B connection may claim w2 or w3, never w0, and one with no authenticated key is
    dropped."""
    a, b = "A" * 40, "B" * 40
    links = PeerLinks(None, "w1", None, queue.Queue(), None, keydir="unused", peer_keys=PeerKeys())
    links.connect(plan_fields(**{"w0": {"public_key": a}, "w1": {"public_key": "C" * 40},
                                 "w2": {"public_key": b}, "w3": {"public_key": b}}))
    links.hold_early(slice_msg(8, sender="w0", peer_key=b))
    links.hold_early(slice_msg(8, sender="w3", peer_key=""))
    links.hold_early(slice_msg(8, sender="w2", peer_key=b))
    links.hold_early(slice_msg(8, sender="w3", micro=1, peer_key=b))
    links.hold_early(slice_msg(8, sender="w0", micro=1, peer_key=a))
    assert sorted(links.held) == [(8, "gather", 0, 0, "w2"), (8, "gather", 0, 1, "w0"),
                                  (8, "gather", 0, 1, "w3")]


def test_a_peer_that_takes_no_slice_fails_the_step_instead_of_blocking_it():
    """A PUSH to a peer that never reads queues to its high-water mark, then a send without a
    deadline blocks the compute thread for good."""
    ctx = zmq.Context()
    links = PeerLinks(ctx, "w1", None, queue.Queue(), None)
    fields = plan_fields(workers=("w0", "w1"))
    fields.update(connect=True, timeout=0.5)
    fields["peers"][0]["endpoints"] = ["tcp://127.0.0.1:9"]       # nobody listens: messages queue
    links.connect(fields)
    raised = []

    def flood():
        try:
            for _ in range(5000):
                links._send_peer("w0", 1, "gather", 0, 0, np.zeros(1, np.float32))
        except TimeoutError as e:
            raised.append(e)

    sender = threading.Thread(target=flood, daemon=True)
    sender.start()
    sender.join(EXIT_BOUND_S)
    assert raised and "peer w0 took no message" in str(raised[0])
    links.close()
    ctx.term()


# ---- the route to a peer ------------------------------------------------------------------------

def test_ipc_only_where_the_peers_token_file_reads_back(tmp_path):
    """Same host key for all: ipc only for w0, whose token file holds the token it announced. A
    mismatched token, a missing file, no announced token, or a FIFO where the file should be (it
    must not hang the worker) get tcp."""
    token, other = "a1" * 16, "b2" * 16
    paths = {w: str(tmp_path / f"{w}.ipc") for w in ("w0", "w2", "w3", "w4", "w5")}
    for w, content in (("w0", token), ("w2", other), ("w4", token)):
        with open(paths[w] + ".token", "w") as f:
            f.write(content)
    os.mkfifo(paths["w5"] + ".token")
    from hetconv.transport.sockets import host_key
    workers = ("w0", "w1", "w2", "w3", "w4", "w5")
    fields = plan_fields(workers=workers)
    for peer in fields["peers"]:
        if peer["name"] != "w1":
            peer.update(endpoints=[f"ipc://{paths[peer['name']]}", "tcp://127.0.0.1:9"], host_key=host_key())
            if peer["name"] != "w4":
                peer["ipc_token"] = token
    fields["connect"] = True
    ctx = zmq.Context()
    links = PeerLinks(ctx, "w1", None, queue.Queue(), None)
    try:
        routes = links.connect(fields)["routes"]
    finally:
        links.close()
        ctx.term()
    assert routes == {"w0": f"ipc://{paths['w0']}", "w2": "tcp://127.0.0.1:9", "w3": "tcp://127.0.0.1:9",
                      "w4": "tcp://127.0.0.1:9", "w5": "tcp://127.0.0.1:9"}
    assert stat.S_ISFIFO(os.stat(paths["w5"] + ".token").st_mode)


# ---- a worker process against a fake coordinator ------------------------------------------------

@pytest.fixture
def short_tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("w")          # ipc paths must stay under ~100 characters


class FakeCoordinator:
    """A ROUTER where a worker connects; the test decides what it answers."""

    def __init__(self, folder, options=None):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        for option, value in (options or {}).items():
            self.sock.setsockopt(option, value)
        self.address = f"ipc://{folder}/c.ipc"
        self.sock.bind(self.address)
        self.worker = None

    def recv(self, timeout_s):
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        frames = self.sock.recv_multipart()
        self.worker = frames[0]
        return P.unpack(frames[1:])

    def hello(self):
        msg = self.recv(STARTUP_S)
        assert msg is not None and msg.op == "HELLO", msg
        return msg

    def send(self, op, **fields):
        self.sock.send_multipart([self.worker] + P.pack(op, 0, **fields))

    def send_wait(self, seconds):
        """WAIT, packed by hand so the test also runs where the protocol module lacks it."""
        self.sock.send_multipart([self.worker, msgpack.packb({"v": P.PROTOCOL_VERSION, "op": "WAIT", "seq": 0,
                                                              "arrays": [], "seconds": seconds})])

    def await_op(self, op, timeout_s):
        until = time.monotonic() + timeout_s
        while time.monotonic() < until:
            msg = self.recv(until - time.monotonic())
            if msg is not None and msg.op == op:
                return msg
        return None

    def close(self):
        self.sock.close(linger=0)
        self.ctx.term()


def start_worker(procs, coordinator, folder, *flags):
    env = {**os.environ, "TMPDIR": str(folder)}
    return procs(python_cmd("hetconv.cli.worker", "--device", "cpu", "--threads", 1, "--connect", coordinator.address,
                            *flags), env=env)


def test_a_worker_whose_coordinator_stops_reading_exits_after_the_idle_timeout(procs, short_tmp):
    """The fake coordinator takes HELLO, sends WELCOME and a burst of malformed requests (each
    answered with an ERROR), then never reads again but keeps probing that the link is up: the
    worker's replies and heartbeats fill the link's queue. Sends without a deadline would block
    its I/O thread for good; it must give up after --idle-timeout and exit 2."""
    fake = FakeCoordinator(short_tmp, {zmq.RCVHWM: 1, zmq.RCVBUF: 4096, zmq.SNDHWM: 0})
    try:
        worker = start_worker(procs, fake, short_tmp, "--heartbeat", 0.02, "--idle-timeout", 2)
        fake.hello()
        fake.send("WELCOME", message_limit=0)
        for _ in range(5000):
            fake.sock.send_multipart([fake.worker, b"junk"])
        until = time.monotonic() + EXIT_BOUND_S
        while worker.poll() is None and time.monotonic() < until:
            fake.send("HEARTBEAT")                 # requests keep coming: only the send deadline ends it
            time.sleep(0.2)
        assert worker.poll() == 2, f"worker still running {EXIT_BOUND_S}s after its coordinator stopped reading"
        assert "could not send to the coordinator" in worker.stdout.read()
    finally:
        fake.close()


def test_a_worker_whose_link_is_full_still_obeys_shutdown(procs, short_tmp):
    """As above, but the coordinator sends SHUTDOWN once the link is full (a dropped worker it
    no longer reads from): the worker exits 0 at once, without waiting out --idle-timeout."""
    fake = FakeCoordinator(short_tmp, {zmq.RCVHWM: 1, zmq.RCVBUF: 4096, zmq.SNDHWM: 0})
    try:
        worker = start_worker(procs, fake, short_tmp, "--heartbeat", 0.02, "--idle-timeout", 600)
        fake.hello()
        fake.send("WELCOME", message_limit=0)
        for _ in range(5000):
            fake.sock.send_multipart([fake.worker, b"junk"])
        fake.send("SHUTDOWN")
        assert worker.wait(EXIT_BOUND_S) == 0
    finally:
        fake.close()


def test_a_stopped_and_resumed_worker_obeys_shutdown(procs, short_tmp):
    """A worker SIGSTOPped long enough to be declared lost, then resumed, is sent SHUTDOWN by the
    coordinator that dropped it: it exits 0 at once, whatever queued up while it was stopped."""
    fake = FakeCoordinator(short_tmp)
    try:
        worker = start_worker(procs, fake, short_tmp, "--heartbeat", 0.05, "--idle-timeout", 600)
        fake.hello()
        fake.send("WELCOME", message_limit=0)
        assert fake.await_op("HEARTBEAT", EXIT_BOUND_S), "the worker never started serving"
        worker.send_signal(signal.SIGSTOP)
        for _ in range(20):
            fake.send("HEARTBEAT")
            time.sleep(0.05)
        worker.send_signal(signal.SIGCONT)
        fake.send("SHUTDOWN")
        assert fake.await_op("BYE", EXIT_BOUND_S)
        assert worker.wait(EXIT_BOUND_S) == 0
    finally:
        fake.close()


def test_sigterm_ends_a_worker_through_its_clean_up(procs, short_tmp):
    fake = FakeCoordinator(short_tmp)
    try:
        worker = start_worker(procs, fake, short_tmp, "--heartbeat", 0.1)
        hello = fake.hello()
        ipc = [e[len("ipc://"):] for e in hello.fields["peer_endpoints"] if e.startswith("ipc://")]
        assert ipc and all(os.path.exists(p) for p in ipc)
        fake.send("WELCOME", message_limit=0)
        assert fake.await_op("HEARTBEAT", EXIT_BOUND_S), "the worker never started serving"
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(EXIT_BOUND_S) == 143
        assert sorted(n for n in os.listdir(short_tmp) if n.startswith("hetconv-")) == []
        assert "terminated (SIGTERM)" in worker.stdout.read()
    finally:
        fake.close()


def test_a_worker_told_to_wait_outlives_its_connect_timeout_then_joins(procs, short_tmp):
    fake = FakeCoordinator(short_tmp)
    try:
        worker = start_worker(procs, fake, short_tmp, "--connect-timeout", 2, "--heartbeat", 0.1)
        fake.hello()
        until = time.monotonic() + 4                # two connect timeouts
        while time.monotonic() < until:
            fake.send_wait(1.0)
            time.sleep(0.5)
            assert worker.poll() is None, "the worker gave up while the coordinator said to wait"
        fake.send("WELCOME", message_limit=0)
        assert fake.await_op("HEARTBEAT", EXIT_BOUND_S), "the worker never started serving"
        fake.send("SHUTDOWN")
        assert fake.await_op("BYE", EXIT_BOUND_S)
        assert worker.wait(EXIT_BOUND_S) == 0
        out = worker.stdout.read()
        assert out.count("admits this worker at its next snapshot, in about 1 s; waiting") == 1, out
    finally:
        fake.close()


def test_a_worker_waiting_to_join_exits_at_once_on_shutdown(procs, short_tmp):
    fake = FakeCoordinator(short_tmp)
    try:
        worker = start_worker(procs, fake, short_tmp, "--connect-timeout", 60)
        fake.hello()
        fake.send_wait(300.0)
        fake.send("SHUTDOWN")
        assert fake.await_op("BYE", EXIT_BOUND_S), "no BYE from a worker waiting to join"
        assert worker.wait(EXIT_BOUND_S) == 0
    finally:
        fake.close()


@pytest.mark.parametrize("seconds, expected", [(42, 42.0), (0.5, 0.5), (0, 0.0), (-1, None), (float("nan"), None),
                                               (float("inf"), None), ("5", None), (True, None), (None, None)])
def test_a_wait_with_a_malformed_estimate_is_ignored(seconds, expected):
    from hetconv.worker.serve import wait_seconds
    assert wait_seconds({"seconds": seconds}) == expected
