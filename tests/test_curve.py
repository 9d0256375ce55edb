"""Only keyed workers join (ZeroMQ CURVE, Ironhouse): the coordinator admits the public keys in
its --curve DIR, workers and their peer links use the same keys, --spawn makes keys for its own
workers, and an address off loopback is never bound open by accident."""
import json
import os
import subprocess
import time

import numpy as np
import pytest
import zmq

from conftest import python_cmd
from hetconv.transport import keys
from hetconv.transport import protocol as P
from hetconv.transport.sockets import bind_inbox
from hetconv.coordinator.remote import RemoteEngine
from test_cli_checks import assert_one_line_error, run
from test_distributed import free_port, quiet

COMMON = ["--conv", "6,12", "--fc", "16", "--batch-size", "16", "--synthetic-train", "64", "--synthetic-test", "16",
          "--steps", "3", "--threads", "1", "--calibration-batch", "4", "--use-all"]


def losses(path):
    return [json.loads(line)["loss"] for line in open(path) if '"event": "step"' in line]


@pytest.mark.timeout(240)
def test_a_worker_with_another_keygens_keys_never_joins_and_the_run_finishes(procs, tmp_path):
    ours, theirs = tmp_path / "keys", tmp_path / "other-keys"
    assert subprocess.run(python_cmd("hetconv.cli.keygen", ours), capture_output=True).returncode == 0
    assert subprocess.run(python_cmd("hetconv.cli.keygen", ours, "--worker", "second"), capture_output=True).returncode == 0
    assert subprocess.run(python_cmd("hetconv.cli.keygen", theirs), capture_output=True).returncode == 0
    address = f"tcp://127.0.0.1:{free_port()}"
    coord = procs(python_cmd("hetconv.cli.coordinator", "--workers", "2", "--bind", address, "--curve", ours,
                             "--metrics", tmp_path / "dist.jsonl", *COMMON))
    # the stranger comes first, so it is there while the coordinator waits and trains (a run of a few
    # seconds); it gives up after its --connect-timeout, which the local run below overlaps
    stranger = procs(python_cmd("hetconv.cli.worker", "--device", "cpu", "--connect", address, "--threads", "1",
                                "--name", "stranger", "--curve", theirs / "workers" / "worker1",
                                "--connect-timeout", "12"))
    time.sleep(2)
    keyed = [procs(python_cmd("hetconv.cli.worker", "--device", "cpu", "--connect", address, "--threads", "1",
                              "--name", name, "--curve", ours / "workers" / name))
             for name in ("worker1", "second")]
    out, _ = coord.communicate(timeout=180)
    assert coord.returncode == 0, out
    assert "refused a connection from 127.0.0.1" in out, out
    for w in keyed:
        assert w.wait(timeout=15) == 0
    plan = next(json.loads(line) for line in open(tmp_path / "dist.jsonl") if '"event": "plan"' in line)
    assert set(plan["layers"][0]["kernels"]) == {"worker1", "second"}
    local = run("hetconv.cli.coordinator", "--local", "--metrics", str(tmp_path / "local.jsonl"), *COMMON, timeout=120)
    assert local.returncode == 0, local.stderr
    stranger_out, _ = stranger.communicate(timeout=60)
    assert stranger.returncode != 0
    assert "refused this worker's key" in stranger_out, stranger_out
    np.testing.assert_allclose(losses(tmp_path / "dist.jsonl"), losses(tmp_path / "local.jsonl"), rtol=1e-5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("insecure", [False, True])
def test_spawn_makes_keys_for_its_own_workers_unless_insecure(insecure):
    engine = RemoteEngine("tcp://127.0.0.1:0", 0, ["cpu"], threads=1, log=quiet, insecure=insecure)
    try:
        key_dir = engine._key_tmp
        assert bool(engine.sock.curve_server) is (not insecure)
        assert (key_dir is None) is insecure
        peer = next(iter(engine.peers.values()))
        assert bool(peer.public_key) is (not insecure)        # as ZAP authenticated it
        if not insecure:
            assert peer.public_key == keys.own_public_key(engine.worker_keydir)
            assert oct(os.stat(key_dir).st_mode & 0o777) == "0o700"
    finally:
        engine.close()
    assert key_dir is None or not os.path.exists(key_dir), "the run's keys outlived it"


@pytest.mark.parametrize("args,message", [
    (["--workers", "2", "--bind", "tcp://0.0.0.0:{port}"], "refusing to bind tcp://0.0.0.0:"),
    (["--workers", "2", "--curve", "/nonexistent/keys"], "no key directory '/nonexistent/keys'"),
    (["--local", "--curve", "/tmp"], "--curve and --insecure are for workers over the network"),
    (["--workers", "1", "--curve", "/tmp", "--insecure"], "--curve and --insecure contradict each other"),
])
def test_open_binds_and_bad_key_dirs_are_refused_before_any_work(args, message):
    args = [a.format(port=free_port()) for a in args]
    assert_one_line_error(run("hetconv.cli.coordinator", *COMMON, *args, timeout=60), message)


def test_a_worker_with_a_bad_key_dir_says_so_before_connecting(tmp_path):
    assert_one_line_error(run("hetconv.cli.worker", "--device", "cpu", "--connect", "tcp://127.0.0.1:5555",
                              "--curve", str(tmp_path), timeout=30), "is empty: make keys in it")


@pytest.mark.timeout(60)
def test_a_peer_inbox_admits_only_the_plans_workers(tmp_path):
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    keys.make_keys(ours)
    keys.add_worker(ours, "peer")
    keys.make_keys(theirs)
    me, peer, stranger = (os.path.join(ours, "workers", "worker1"), os.path.join(ours, "workers", "peer"),
                          os.path.join(theirs, "workers", "worker1"))
    ctx = zmq.Context()
    refusals = []
    inbox, endpoints, auth, allowed = bind_inbox(ctx, "127.0.0.1", me, log=refusals.append)
    sockets = [inbox]
    try:
        allowed.allowed = frozenset([keys.own_public_key(peer)])      # as PEERS would set it

        def push_from(keydir, tag):
            push = ctx.socket(zmq.PUSH)
            push.linger = 0
            sockets.append(push)
            keys.connect_peer(push, keydir, keys.own_public_key(me))
            push.connect(endpoints[-1])                                   # the tcp endpoint
            push.send_multipart(P.pack("SLICE", 0, [np.zeros(2, np.float32)], step=1, sender=tag))

        push_from(stranger, "stranger")
        push_from(peer, "peer")
        assert inbox.poll(10_000), "the plan's peer never got through"
        assert P.unpack(inbox.recv_multipart()).fields["sender"] == "peer"
        assert not inbox.poll(1_000), "a push with a stranger's key was delivered"
        assert any("refused a connection from 127.0.0.1" in line for line in refusals), refusals
    finally:
        for s in sockets:
            s.close(0)
        auth.stop()
        ctx.term()


def test_a_key_folder_travels_whole_and_nothing_else_is_written(tmp_path):
    """What a Ray actor receives: the worker's three key files, recreated privately; any other
    name is refused rather than written."""
    keys.make_keys(str(tmp_path / "k"))
    folder = str(tmp_path / "k" / "workers" / "worker1")
    files = keys.read_key_folder(folder)
    copy = keys.write_key_folder(files)
    try:
        assert keys.worker_keys(copy) == keys.worker_keys(folder)
        assert oct(os.stat(os.path.join(copy, "worker.key_secret")).st_mode & 0o777) == "0o600"
    finally:
        import shutil
        shutil.rmtree(copy)
    with pytest.raises(keys.KeyDirError, match="unexpected key file name '../evil'"):
        keys.write_key_folder({"../evil": b"x"})
