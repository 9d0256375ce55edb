"""CURVE keys: only keyed workers reach the coordinator's socket; every wait here is bounded."""
import os
import re
import stat
import subprocess
import sys
import time

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from hetconv.transport import keys

SHORT = 1000          # ms a message that should arrive gets; one that must not arrive is waited for as long


class Sockets:
    """One context, and everything opened on it closed at the end, linger 0, whatever happens."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.sockets, self.auths = [], []

    def make(self, kind):
        s = self.ctx.socket(kind)
        s.linger = 0
        self.sockets.append(s)
        return s

    def close(self):
        for s in self.sockets:
            s.close(linger=0)
        for a in self.auths:
            a.stop()
        self.ctx.term()


@pytest.fixture
def ctx():
    sockets = Sockets()
    yield sockets
    sockets.close()


def server(ctx, keydir, log):
    router = ctx.make(zmq.ROUTER)
    ctx.auths.append(keys.serve_curve(ctx.ctx, router, str(keydir), log))
    port = router.bind_to_random_port("tcp://127.0.0.1")
    return router, f"tcp://127.0.0.1:{port}"


def client(ctx, address, keydir=None):
    dealer = ctx.make(zmq.DEALER)
    if keydir is not None:
        keys.connect_curve(dealer, str(keydir))
    dealer.connect(address)
    return dealer


def receive(sock, timeout_ms):
    return sock.recv_multipart() if sock.poll(timeout_ms) else None


def test_a_keyed_worker_reaches_the_coordinator_and_back(ctx, tmp_path):
    worker_dir = keys.make_keys(str(tmp_path / "k"))
    refusals = []
    router, address = server(ctx, tmp_path / "k", refusals.append)
    dealer = client(ctx, address, worker_dir)
    dealer.send_multipart([b"hello", b"\x00" * 1000])
    got = receive(router, 5 * SHORT)
    assert got is not None and got[1:] == [b"hello", b"\x00" * 1000]
    router.send_multipart([got[0], b"welcome"])
    assert receive(dealer, 5 * SHORT) == [b"welcome"]
    assert refusals == []


def test_the_whole_key_dir_works_for_a_worker_while_it_holds_one(ctx, tmp_path):
    keys.make_keys(str(tmp_path / "k"))
    router, address = server(ctx, tmp_path / "k", print)
    client(ctx, address, tmp_path / "k").send(b"hi")
    assert receive(router, 5 * SHORT)[1:] == [b"hi"]
    keys.add_worker(str(tmp_path / "k"), "second")
    with pytest.raises(keys.KeyDirError, match="holds keys for workers second, worker1: pass one worker's folder"):
        keys.connect_curve(ctx.make(zmq.DEALER), str(tmp_path / "k"))


def test_keys_from_another_keygen_run_never_get_through_and_are_logged(ctx, tmp_path):
    keys.make_keys(str(tmp_path / "ours"))
    stranger = keys.make_keys(str(tmp_path / "theirs"))
    refusals = []
    router, address = server(ctx, tmp_path / "ours", refusals.append)
    # a stranger who knows our coordinator's public key (it is public) but holds no admitted key
    knows_server = tmp_path / "knows-server"
    os.makedirs(knows_server)
    for name in ("worker.key_secret", "worker.key"):
        os.link(os.path.join(stranger, name), knows_server / name)
    os.link(tmp_path / "ours" / "coordinator.key", knows_server / "coordinator.key")
    intruder = client(ctx, address, knows_server)
    intruder.send(b"let me in")
    # a stranger with its own run's coordinator key: its handshake fails before any ZAP request
    wrong_server = client(ctx, address, stranger)
    wrong_server.send(b"let me in")
    assert receive(router, SHORT) is None
    deadline = time.monotonic() + 5
    while not refusals and time.monotonic() < deadline:
        time.sleep(0.05)
    assert refusals and "refused a connection from 127.0.0.1" in refusals[0]
    # the same server still admits its own worker: the refusal above was about the keys
    client(ctx, address, os.path.join(tmp_path / "ours", "workers", keys.DEFAULT_WORKER)).send(b"ours")
    assert receive(router, 5 * SHORT)[1:] == [b"ours"]


def test_a_worker_without_curve_is_refused(ctx, tmp_path):
    keys.make_keys(str(tmp_path / "k"))
    router, address = server(ctx, tmp_path / "k", print)
    client(ctx, address, None).send(b"plain text")
    assert receive(router, SHORT) is None


def test_a_frame_over_the_message_limit_disconnects_its_sender(ctx):
    router = ctx.make(zmq.ROUTER)
    keys.set_message_limit(router, 4096)
    monitor = router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        small = client(ctx, f"tcp://127.0.0.1:{port}")
        small.send(b"x" * 4096)
        assert receive(router, 5 * SHORT)[1:] == [b"x" * 4096]
        big = client(ctx, f"tcp://127.0.0.1:{port}")
        big.send(b"x" * 4097)
        assert receive(router, SHORT) is None
        assert monitor.poll(5 * SHORT), "the router never dropped the sender of the oversized frame"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
    finally:
        router.disable_monitor()
        monitor.close(linger=0)


@pytest.mark.parametrize("nbytes", [0, -1, 1.5, True, "1k"])
def test_message_limit_must_be_a_positive_byte_count(ctx, nbytes):
    with pytest.raises(ValueError, match=f"positive number of bytes, got {nbytes!r}"):
        keys.set_message_limit(ctx.make(zmq.ROUTER), nbytes)


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:5555", "tcp://127.3.4.5:0", "tcp://localhost:5555",
                                     "tcp://[::1]:5555", "ipc:///tmp/hetconv.sock", "inproc://coordinator"])
def test_loopback_binds_need_no_keys(address):
    keys.refuse_open_bind(address, curve_dir="", insecure=False)


@pytest.mark.parametrize("address", ["tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.0.0.5:5555",
                                     "tcp://[::]:5555", "tcp://myhost:5555", "tcp://eth0:5555", "5555"])
def test_an_open_bind_without_keys_is_refused_unless_keyed_or_insecure(address):
    with pytest.raises(ValueError, match=r"refusing to bind .* without keys.*`hetconv-keygen DIR`.*`--curve DIR`"
                                         r".*--insecure"):
        keys.refuse_open_bind(address, curve_dir="", insecure=False)
    keys.refuse_open_bind(address, curve_dir="keys", insecure=False)
    keys.refuse_open_bind(address, curve_dir="", insecure=True)


def test_secret_key_files_are_private(tmp_path):
    worker = keys.make_keys(str(tmp_path / "k"))
    for secret in (tmp_path / "k" / "coordinator.key_secret", os.path.join(worker, "worker.key_secret")):
        assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(worker).st_mode) == 0o700


def keygen(*args):
    return subprocess.run([sys.executable, "-m", "hetconv.cli.keygen", *args], capture_output=True, text=True, timeout=60)


def test_keygen_cli_makes_and_adds_keys_and_explains_the_layout(tmp_path):
    done = keygen(str(tmp_path / "k"))
    assert done.returncode == 0, done.stderr
    assert keygen(str(tmp_path / "k"), "--worker", "gpu-box").returncode == 0
    assert sorted(os.listdir(tmp_path / "k" / "authorized")) == ["gpu-box.key", "worker1.key"]
    assert keys.worker_keys(str(tmp_path / "k" / "workers" / "gpu-box"))[2] == keys.coordinator_keys(
        str(tmp_path / "k"))[0]
    help_text = keygen("--help").stdout
    for part in ("coordinator.key_secret", "authorized/NAME.key", "workers/NAME/worker.key_secret", "--curve"):
        assert part in help_text


@pytest.mark.parametrize("setup,args,message", [
    (None, ["{d}"], None),
    ("keys", ["{d}"], "already holds coordinator keys"),
    (None, ["{d}", "--worker", "w"], "no key directory"),
    ("empty", ["{d}", "--worker", "w"], "missing key file .*coordinator.key_secret"),
    ("keys", ["{d}", "--worker", "worker1"], "worker 'worker1' already has keys"),
    ("keys", ["{d}", "--worker", "../escape"], "worker name '../escape' must be letters"),
    ("garbage", ["{d}", "--worker", "w"], "coordinator.key_secret is not a zmq certificate"),
])
def test_keygen_cli_errors_are_clear(tmp_path, setup, args, message):
    d = tmp_path / "k"
    if setup == "keys":
        keys.make_keys(str(d))
    elif setup == "empty":
        d.mkdir()
    elif setup == "garbage":
        d.mkdir()
        (d / "coordinator.key_secret").write_text("not a certificate\n")
    done = keygen(*[a.format(d=d) for a in args])
    if message is None:
        assert done.returncode == 0, done.stderr
    else:
        assert done.returncode == 2 and done.stderr.startswith("hetconv-keygen: ")
        assert re.search(message, done.stderr), done.stderr


def test_reading_keys_names_what_is_wrong(tmp_path):
    with pytest.raises(keys.KeyDirError, match="no key directory .*missing.*hetconv-keygen DIR"):
        keys.coordinator_keys(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(keys.KeyDirError, match="key directory .*empty is empty"):
        keys.worker_keys(str(tmp_path / "empty"))
    worker = keys.make_keys(str(tmp_path / "k"))
    os.unlink(os.path.join(worker, "coordinator.key"))
    with pytest.raises(keys.KeyDirError, match="missing key file .*coordinator.key"):
        keys.worker_keys(worker)
    with open(os.path.join(worker, "worker.key_secret"), "w") as f:
        f.write("public-key = \"short\"\nsecret-key = \"short\"\n")
    with pytest.raises(keys.KeyDirError, match="worker.key_secret is not a zmq certificate: its public-key"):
        keys.worker_keys(worker)
    os.unlink(tmp_path / "k" / "authorized" / "worker1.key")
    with pytest.raises(keys.KeyDirError, match="holds no worker public keys"):
        keys.coordinator_keys(str(tmp_path / "k"))
    for name in os.listdir(worker):
        os.unlink(os.path.join(worker, name))
    with pytest.raises(keys.KeyDirError, match="is empty"):
        keys.worker_keys(worker)


def test_ephemeral_keys_admit_the_spawned_workers(ctx, tmp_path):
    coordinator_dir, worker_dir = keys.ephemeral_keys(str(tmp_path / "run"))
    router, address = server(ctx, coordinator_dir, print)
    client(ctx, address, worker_dir).send(b"spawned")
    assert receive(router, 5 * SHORT)[1:] == [b"spawned"]


def test_stale_temp_key_folders_of_dead_processes_are_removed(tmp_path, monkeypatch):
    """A coordinator or Ray actor killed with -9 leaves its temp key folder; the next one made on
    this host removes it, and only it."""
    import subprocess
    import sys
    import tempfile

    from hetconv.transport import keys as K
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host = K._temp_tag().rsplit("-", 2)[0]
    dead = tmp_path / f"{K.TEMP_PREFIX}{host}-{gone.pid}-abc123"
    alive = tmp_path / f"{K.TEMP_PREFIX}{host}-{os.getpid()}-def456"
    elsewhere = tmp_path / f"{K.TEMP_PREFIX}otherhost{host}-{gone.pid}-ghi789"
    unrelated = tmp_path / "hetconv-keys-made-by-hand"
    for d in (dead, alive, elsewhere, unrelated):
        d.mkdir()
        (d / "worker.key_secret").write_text("x")
    made = K.private_temp_dir()
    assert not dead.exists()
    assert alive.exists() and elsewhere.exists() and unrelated.exists()
    assert os.path.dirname(made) == str(tmp_path) and os.stat(made).st_mode & 0o777 == 0o700
    assert os.path.basename(made).startswith(f"{K.TEMP_PREFIX}{host}-{os.getpid()}-")
    assert K.remove_stale_key_dirs(str(tmp_path)) == []          # the new one's maker (us) is alive
