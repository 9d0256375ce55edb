"""Real coordinator and worker processes on loopback: the distributed step must equal the
single-process step, and every failure must be named, bounded in time, and leave no process."""
import json
import os
import signal
import socket
import subprocess
import time

import numpy as np
import pytest

from conftest import external_worker, python_cmd
from _faults import join_during_step, kill_worker_on_step
from hetconv.training import checkpoint
from hetconv.net import reference as R
from hetconv.training.config import Config
from hetconv.coordinator.remote import RemoteEngine, WorkerError, WorkerLost
from hetconv.devices import open_device
from hetconv.engine.planner import fixed_plan
from hetconv.geometry import ConvSpec, conv_specs
from hetconv.engine.local import LocalEngine
from hetconv.engine.shard import ConvShard
from hetconv.training.loop import train

# use_all: every worker takes part, so which worker holds what does not depend on how loaded the
# machine was during calibration (the planner may rightly leave a slow one out)
TINY = dict(conv="6,12", fc="32", batch_size=32, synthetic_train=512, synthetic_test=64, lr=0.01, threads=1,
            calibration_batch=4, use_all=True)


def quiet(*_):
    pass


def remote(n, **kw):
    kw.setdefault("worker_timeout", 10.0)
    return RemoteEngine("tcp://127.0.0.1:0", 0, ["cpu"] * n, threads=1, connect_timeout=60, log=quiet, **kw)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:                                    # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_dead(pids, seconds=10):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("local")
    cfg = Config(**TINY, steps=3, checkpoint_dir=str(d)).validate()
    summary = train(cfg, LocalEngine({"local": ConvShard(open_device("cpu", threads=1))}), log=quiet)
    return summary["losses"], checkpoint.load(str(d))


UNEVEN3 = {"w0-cpu": [4, 2], "w1-cpu": [1, 3], "w2-cpu": [1, 7]}


@pytest.mark.parametrize("workers,counts,exchange,micro", [
    (1, None, "peer", 0), (2, None, "peer", 0), (3, None, "peer", 0),
    (2, {"w0-cpu": [1, 11], "w1-cpu": [5, 1]}, "peer", 0),                  # deliberately uneven
    (3, UNEVEN3, "peer", 1), (3, UNEVEN3, "peer", 4),
    (3, UNEVEN3, "star", 1), (2, None, "star", 4),
], ids=["1w", "2w-proportional", "3w-proportional", "2w-uneven", "3w-uneven-peer-m1", "3w-uneven-peer-m4",
        "3w-uneven-star-m1", "2w-star-m4"])
def test_distributed_training_equals_local(local_run, tmp_path, workers, counts, exchange, micro):
    """Local runs the whole batch at once on one shard; every distributed way must give the same
    losses, weights and momenta up to float rounding (micro-batches sum their gradients)."""
    local_losses, (_, local_conv, local_fc) = local_run
    engine = remote(workers, exchange=exchange)
    try:
        if counts:
            engine.fixed_plan = fixed_plan([6, 12], counts)
        cfg = Config(**TINY, steps=3, checkpoint_dir=str(tmp_path), exchange=exchange, micro_batches=micro).validate()
        summary = train(cfg, engine, log=quiet)
        if counts:
            assert {w: engine.plan.layers[1].count(w) for w in engine.workers} == {w: c[1] for w, c in counts.items()}
    finally:
        engine.close()
    np.testing.assert_allclose(summary["losses"], local_losses, rtol=1e-5)
    _, conv, fc = checkpoint.load(str(tmp_path))
    for got, want in zip(conv + fc, local_conv + local_fc):
        assert sorted(got) == sorted(want)                  # w, b and both momenta, every layer
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-6)


def test_a_coordinator_with_no_cpu_worker_on_its_host_sends_the_gradient_before_its_weight_gemms(
        local_run, tmp_path, monkeypatch):
    """Where no CPU worker shares the coordinator's host (this test tells its host apart), each
    micro-batch's features' gradient leaves before the head's weight GEMMs run (head.settle after
    the sends), and the run equals local as any other."""
    import hetconv.coordinator.remote as remote_module
    from hetconv.net.layers import Linear
    monkeypatch.setattr(remote_module, "host_key", lambda: "a host of the coordinator's own")
    computed_late, settle = [], Linear.settle

    def settle_counted(self):
        computed_late.append(self._weight_grads_due is not None)
        settle(self)
    monkeypatch.setattr(Linear, "settle", settle_counted)
    local_losses, (_, local_conv, local_fc) = local_run
    engine = remote(3)
    try:
        engine.fixed_plan = fixed_plan([6, 12], UNEVEN3)
        summary = train(Config(**TINY, steps=3, checkpoint_dir=str(tmp_path), micro_batches=4).validate(), engine,
                        log=quiet)
        assert engine.head_weights_later
    finally:
        engine.close()
    assert sum(computed_late) >= 3 * 4, computed_late    # every micro-batch's, on each FC layer that has one due
    np.testing.assert_allclose(summary["losses"], local_losses, rtol=1e-5)
    _, conv, fc = checkpoint.load(str(tmp_path))
    for got, want in zip(conv + fc, local_conv + local_fc):
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-6)


def test_equal_split_equals_local_too(local_run):
    engine = remote(2)
    try:
        summary = train(Config(**{**TINY, "split": "equal"}, steps=3).validate(), engine, log=quiet)
        assert engine.plan.layers[0].ranges == {"w0-cpu": (0, 3), "w1-cpu": (3, 6)}
        # its CPU workers share this host: the head's weight GEMMs run before the gradient leaves
        # (test_a_coordinator_with_no_cpu_worker_on_its_host_... has the other side)
        assert not engine.head_weights_later
    finally:
        engine.close()
    np.testing.assert_allclose(summary["losses"], local_run[0], rtol=1e-5)


@pytest.fixture
def loaded_pair():
    """Two spawned workers holding conv1 (3 -> 4 kernels, 3x3)."""
    engine = remote(2, worker_timeout=2.0)
    spec = ConvSpec.paper(3, 4, 3, 0)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    engine.load(fixed_plan([4], {"w0-cpu": [1], "w1-cpu": [3]}), [spec], [(w, b, None, None)])
    yield engine, w, b
    pids = [p.pid for _, p in engine.processes]
    engine.close()
    assert not wait_dead(pids), "a spawned worker outlived close()"


def test_forward_backward_over_the_wire_match_reference(loaded_pair):
    engine, w, b = loaded_pair
    x = np.random.default_rng(1).standard_normal((2, 3, 8, 8)).astype(np.float32)
    y = engine.forward(0, x)
    np.testing.assert_allclose(y, R.conv_relu_pool(x, w, b), rtol=1e-5, atol=1e-5)
    dp = np.ones_like(y)
    dx = engine.backward(0, dp, need_dx=True)
    np.testing.assert_allclose(dx, R.conv_relu_pool_backward(x, w, b, dp)[0], rtol=1e-4, atol=1e-5)
    stats = engine.step_stats()
    assert stats["w1-cpu"]["bytes_sent"] > stats["w1-cpu"]["bytes_recv"] > 0
    assert stats["w0-cpu"]["compute_s"] > 0
    assert 0 < stats["w0-cpu"]["layer_compute_s"][0] <= stats["w0-cpu"]["compute_s"]     # layer 0's calls, not the load


def test_worker_error_names_the_worker_and_the_worker_keeps_serving(loaded_pair):
    engine, w, b = loaded_pair
    with pytest.raises(WorkerError, match=r"worker w[01]-cpu .* failed during FORWARD layer=0: ShardError: layer 0: input shape \(2, 5, 8, 8\) does not have 3 channels"):
        engine.forward(0, np.ones((2, 5, 8, 8), np.float32))
    x = np.ones((2, 3, 8, 8), np.float32)
    np.testing.assert_allclose(engine.forward(0, x), R.conv_relu_pool(x, w, b), rtol=1e-5, atol=1e-5)


# The failure tests check the cause they name; the clock only guards against a hang (the machine
# may be loaded, so no tighter bound is promised here).
HANG_GUARD_S = 60


def test_dead_worker_is_named_within_seconds(loaded_pair):
    engine, _, _ = loaded_pair
    victim = engine.processes[1][1]
    victim.kill()
    victim.wait()
    t0 = time.monotonic()
    with pytest.raises(WorkerLost, match=r"worker w1-cpu .* exited with code -9 during forward conv1"):
        engine.forward(0, np.ones((2, 3, 8, 8), np.float32))
    assert time.monotonic() - t0 < HANG_GUARD_S


def test_hung_worker_is_named_within_the_heartbeat_limit(loaded_pair):
    engine, _, _ = loaded_pair
    victim = engine.processes[0][1]
    os.kill(victim.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerLost, match=r"worker w0-cpu .* stopped answering \(no heartbeat for .*\) during forward conv1"):
            engine.forward(0, np.ones((2, 3, 8, 8), np.float32))
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    assert time.monotonic() - t0 < HANG_GUARD_S


def test_more_workers_than_kernels_is_refused_clearly(procs):
    p = procs(python_cmd("hetconv.cli.coordinator", "--spawn", "cpu,cpu,cpu", "--conv", "2,8", "--fc", "8", "--steps", "1"))
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 1
    assert "3 workers but a conv layer has only 2 kernels" in out


def test_unknown_device_is_refused_by_worker_and_coordinator(procs):
    w = procs(python_cmd("hetconv.cli.worker", "--device", "gpu", "--connect", "tcp://127.0.0.1:9"))
    out, _ = w.communicate(timeout=30)
    assert w.returncode == 2 and "--device entry 'gpu': expected cpu, cpu:THREADS, cuda:N" in out
    c = procs(python_cmd("hetconv.cli.coordinator", "--spawn", "cpu,gpu", "--steps", "1"))
    out, _ = c.communicate(timeout=30)
    # refused before any worker starts
    assert c.returncode == 2 and "--spawn entry 'gpu'" in out and "waiting for" not in out


@pytest.mark.parametrize("cores", ["x", "0,999"])
def test_bad_core_list_is_refused_clearly(procs, cores):
    w = procs(python_cmd("hetconv.cli.worker", "--device", "cpu", "--connect", "tcp://127.0.0.1:9", "--cores", cores))
    out, _ = w.communicate(timeout=30)
    assert w.returncode == 2 and f"--cores '{cores}': expected a comma list of CPU cores" in out
    assert "Traceback" not in out


def test_worker_without_a_coordinator_gives_up_with_a_message(procs):
    port = free_port()
    w = procs(python_cmd("hetconv.cli.worker", "--device", "cpu", "--connect", f"tcp://127.0.0.1:{port}",
                         "--connect-timeout", "2"))
    out, _ = w.communicate(timeout=30)
    assert w.returncode == 2 and f"no coordinator answered at tcp://127.0.0.1:{port} within 2s" in out


def test_busy_port_and_missing_workers_are_reported(procs):
    port = free_port()
    first = procs(python_cmd("hetconv.cli.coordinator", "--workers", "1", "--bind", f"tcp://127.0.0.1:{port}",
                             "--connect-timeout", "20", "--conv", "2,2", "--fc", "4"))
    time.sleep(2.5)
    second = procs(python_cmd("hetconv.cli.coordinator", "--workers", "1", "--bind", f"tcp://127.0.0.1:{port}",
                              "--connect-timeout", "3", "--conv", "2,2", "--fc", "4"))
    out, _ = second.communicate(timeout=30)
    assert second.returncode != 0 and f"cannot bind tcp://127.0.0.1:{port}" in out and "Address already in use" in out
    first.send_signal(signal.SIGTERM)
    first.communicate(timeout=15)


def test_coordinator_survives_garbage_and_refuses_a_version_mismatch(procs):
    import zmq

    from hetconv.transport import protocol as P
    port = free_port()
    coord = procs(python_cmd("hetconv.cli.coordinator", "--workers", "1", "--bind", f"tcp://127.0.0.1:{port}",
                             "--connect-timeout", "8", "--conv", "2,2", "--fc", "4"))
    deadline = time.monotonic() + 30                                           # a loaded machine starts slowly
    while True:
        try:
            raw = socket.create_connection(("127.0.0.1", port), timeout=5)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    with raw:                                                                  # not even ZMTP
        raw.sendall(os.urandom(512))
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send_multipart([b"\xc1garbage", b"more"])                        # ZMTP, but not our protocol
        # an ERROR from a process it did not start: logged, never a way to stop the coordinator
        dealer.send_multipart(P.pack("ERROR", 0, name="X", message="not yours", worker="a/b/1/c", doing="d",
                                     traceback=""))
        header = P.pack("HELLO", 0, name="old")[0]
        import msgpack
        h = msgpack.unpackb(header)
        h["v"] = 99
        dealer.send_multipart([msgpack.packb(h)])
        assert dealer.poll(10000), "no answer to a HELLO of the wrong version"
        reply = P.unpack(dealer.recv_multipart(), accept_any_version=True)
        assert reply.op == "ERROR" and f"peer speaks protocol version 99, this side speaks {P.PROTOCOL_VERSION}" in reply.fields["message"]
    finally:
        ctx.destroy(linger=0)
    out, _ = coord.communicate(timeout=30)
    assert coord.returncode == 1
    assert "ignored a malformed message" in out and "only 0 of 1 workers connected" in out
    assert "could not start: X: not yours" in out


@pytest.fixture
def fake_coordinator():
    """A bare ROUTER on a free loopback port, playing the coordinator: (socket, port)."""
    import zmq
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    yield router, port
    ctx.destroy(linger=0)


def test_worker_answers_malformed_requests_with_errors_and_keeps_serving(procs, fake_coordinator):
    from hetconv.transport import protocol as P
    router, port = fake_coordinator
    w = procs(python_cmd("hetconv.cli.worker", "--device", "cpu", "--connect", f"tcp://127.0.0.1:{port}",
                         "--threads", "1", "--name", "probe"))

    def recv():
        while True:
            assert router.poll(30000), "worker went silent"
            frames = router.recv_multipart()
            msg = P.unpack(frames[1:])
            if msg.op != "HEARTBEAT":
                return frames[0], msg

    ident, hello = recv()
    assert hello.op == "HELLO" and hello.fields["name"] == "probe" and hello.fields["device"] == "cpu"
    router.send_multipart([ident] + P.pack("WELCOME", 1))
    router.send_multipart([ident, b"\x00not msgpack"])
    _, err = recv()
    assert err.op == "ERROR" and "header is not msgpack" in err.fields["message"]
    router.send_multipart([ident] + P.pack("CALIBRATED", 6))              # a reply op, not a request
    _, err = recv()
    assert err.op == "ERROR" and "a worker does not serve 'CALIBRATED'" in err.fields["message"]
    router.send_multipart([ident] + P.pack("FORWARD", 7, [np.ones((1, 3, 6, 6), np.float32)], layer=0))
    _, err = recv()                                                     # every field of a request is required
    assert err.op == "ERROR" and err.seq == 7 and err.fields["message"] == "FORWARD without its 'micros' field"
    step = {"micros": [0], "rows": [0], "batch": 1, "train_step": 0, "seed": 0}
    router.send_multipart([ident] + P.pack("FORWARD", 8, [np.ones((1, 3, 6, 6), np.float32)], layer=0, **step,
                                           train="yes"))
    _, err = recv()
    assert err.op == "ERROR" and "FORWARD field 'train' must be boolean, got 'yes'" in err.fields["message"]
    router.send_multipart([ident] + P.pack("FORWARD", 2, [np.ones((1, 3, 6, 6), np.float32)], layer=0, **step,
                                           train=False))
    _, err = recv()
    assert err.op == "ERROR" and err.seq == 2 and "layer 0 is not loaded on this shard" in err.fields["message"]
    assert err.fields["worker"].startswith("probe/")
    w0 = np.ones((2, 3, 3, 3), np.float32)
    router.send_multipart([ident] + P.pack("LOAD", 3, [w0, np.zeros(2, np.float32)], layer=0,
                                           spec=ConvSpec.paper(3, 2, 3, 0).to_json(), start=0, stop=2, wire="float32",
                                           optimizer="sgd", names=["w", "b"], bn_ghost_batch=0))
    assert recv()[1].op == "LOADED"
    x = np.ones((1, 3, 6, 6), np.float32)
    router.send_multipart([ident] + P.pack("FORWARD", 4, [x], layer=0, **step, train=False))
    _, done = recv()
    assert done.op == "FORWARD_DONE" and done.seq == 4 and done.fields["compute_s"] >= 0
    np.testing.assert_allclose(done.arrays[0], R.conv_relu_pool(x, w0, np.zeros(2, np.float32)), rtol=1e-6)
    router.send_multipart([ident] + P.pack("SHUTDOWN", 5))
    assert recv()[1].op == "BYE"
    assert w.wait(timeout=10) == 0


def test_refused_worker_exits_with_the_coordinators_reason(procs, fake_coordinator):
    from hetconv.transport import protocol as P
    router, port = fake_coordinator
    w = procs(python_cmd("hetconv.cli.worker", "--device", "cpu", "--connect", f"tcp://127.0.0.1:{port}"))
    assert router.poll(30000)
    ident = router.recv_multipart()[0]
    router.send_multipart([ident] + P.pack("ERROR", 0, name="ProtocolVersionError", message="speaks 2, not 1",
                                           worker="", doing="HELLO", traceback=""))
    out, _ = w.communicate(timeout=15)
    assert w.returncode == 2 and "the coordinator refused this worker: speaks 2, not 1" in out


def coordinator_pids(out_path):
    pids = []
    for line in open(out_path):
        if line.startswith("worker ") and ", pid " in line:
            pids.append(int(line.split(", pid ")[1].split(")")[0]))
    return pids


def wait_for_step(metrics, seconds=90):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if metrics.exists() and any('"event": "step"' in line for line in metrics.read_text().splitlines()):
            return
        time.sleep(0.2)
    raise AssertionError("no training step was recorded in time")


def start_long_run(procs, tmp_path, *extra):
    """A --spawn cpu,cpu run far longer than any test, its output in tmp_path/out.txt; returns
    once it has finished a step."""
    metrics = tmp_path / "m.jsonl"
    with open(tmp_path / "out.txt", "w") as out:
        coord = procs(python_cmd("hetconv.cli.coordinator", "--spawn", "cpu,cpu", "--conv", "6,12", "--fc", "16",
                                 "--batch-size", "32", "--synthetic-train", "20000", "--synthetic-test", "64",
                                 "--calibration-batch", "4", "--metrics", metrics, *extra),
                      stdout=out, stderr=subprocess.STDOUT)
    wait_for_step(metrics)
    return coord, metrics, tmp_path / "out.txt"


def test_ctrl_c_finishes_the_step_checkpoints_and_ends_every_worker(procs, tmp_path):
    coord, metrics, log = start_long_run(procs, tmp_path, "--checkpoint-dir", tmp_path / "ck")
    coord.send_signal(signal.SIGINT)
    assert coord.wait(timeout=60) == 130
    text = log.read_text()
    assert "finishing this step, then saving a checkpoint and stopping" in text
    saved = checkpoint.latest(str(tmp_path / "ck"))
    assert saved is not None
    last = json.loads(metrics.read_text().splitlines()[-1])
    assert last["event"] == "interrupted" and last["checkpoint"] == saved
    pids = coordinator_pids(log)
    assert len(pids) == 2 and not wait_dead(pids, 10)


def test_killed_coordinator_leaves_no_worker_behind(procs, tmp_path):
    coord, metrics, log = start_long_run(procs, tmp_path)
    coord.kill()
    coord.wait(timeout=10)
    pids = coordinator_pids(log)
    assert len(pids) == 2 and not wait_dead(pids, 10), "workers outlived a SIGKILLed coordinator"


def test_external_workers_join_and_match_local(procs, tmp_path):
    port = free_port()
    common = ["--conv", "6,12", "--fc", "16", "--batch-size", "32", "--synthetic-train", "256", "--synthetic-test",
              "64", "--steps", "3", "--threads", "1", "--calibration-batch", "4", "--use-all"]
    coord = procs(python_cmd("hetconv.cli.coordinator", "--workers", "2", "--bind", f"tcp://127.0.0.1:{port}",
                             "--metrics", tmp_path / "dist.jsonl", *common))
    workers = [procs(python_cmd("hetconv.cli.worker", "--device", "cpu", "--connect", f"tcp://127.0.0.1:{port}",
                                "--threads", "1", "--name", f"ext{i}")) for i in range(2)]
    out, _ = coord.communicate(timeout=120)
    assert coord.returncode == 0, out
    for w in workers:
        assert w.wait(timeout=15) == 0
    local = subprocess.run(python_cmd("hetconv.cli.coordinator", "--local", "--metrics", tmp_path / "local.jsonl", *common),
                           capture_output=True, text=True, timeout=120)
    assert local.returncode == 0, local.stderr

    def losses(path):
        return [json.loads(l)["loss"] for l in open(path) if '"event": "step"' in l]
    np.testing.assert_allclose(losses(tmp_path / "dist.jsonl"), losses(tmp_path / "local.jsonl"), rtol=1e-5)
    plan = next(json.loads(l) for l in open(tmp_path / "dist.jsonl") if '"event": "plan"' in l)
    assert set(plan["layers"][0]["kernels"]) == {"ext0", "ext1"}
    assert all(s > 0 for s in plan["layers"][1]["speeds"].values())


def gpu_count():
    """What numba reports: the simulator's one GPU, the real GPUs, or 0 with no driver."""
    pytest.importorskip("numba_cuda", reason="numba-cuda is not installed (pip install 'hetconv[cuda]')")
    from numba import cuda
    try:
        return len(cuda.gpus)
    except Exception:
        return 0


def test_cuda_worker_joins_and_matches_local(tmp_path, monkeypatch):
    if gpu_count() == 0:
        pytest.skip("numba reports no GPU and the simulator is off")
    # one timed call a calibration point instead of three: under the simulator a call takes about a
    # second, and the split this test checks needs only the order of the two devices' speeds
    import hetconv.engine.calibrated
    monkeypatch.setattr(hetconv.engine.calibrated, "CALIBRATION_REPEATS", 1)
    # under the simulator (conftest's default) CUDA is very slow, so calibration gives it a small share
    # 10x10 crops and 3x3 kernels keep the simulated GPU's share of work to seconds
    cfg = Config(**{**TINY, "conv": "4,6", "fc": "8", "batch_size": 4, "synthetic_train": 64, "synthetic_test": 8,
                    "crop": 10, "ksize": 3, "calibration_batch": 2, "use_all": True}, steps=2).validate()
    local = train(cfg, LocalEngine({"local": ConvShard(open_device("cpu", threads=1))}), log=quiet)["losses"]
    # with the run's keys: the slow simulated GPU once let the CPU worker's slice overtake its
    # STEP message, which the compute loop then dropped (PeerLinks.hold_early; tests/test_peers.py)
    engine = RemoteEngine("tcp://127.0.0.1:0", 0, ["cpu", "cuda:0"], threads=1, connect_timeout=60, log=quiet,
                          op_timeout=240)
    try:
        summary = train(cfg, engine, log=quiet)
        # each worker's part of a layer: its kernels (model mode) or its images of a batch (data)
        counts = {w: [lp.images[w] if lp.mode == "data" else lp.count(w) for lp in engine.plan.layers]
                  for w in engine.workers}
    finally:
        engine.close()
    np.testing.assert_allclose(summary["losses"], local, rtol=1e-5)
    # the faster device by its own calibration (the CPU under the simulator, the GPU on real
    # hardware) holds more of the large layer's work, in the mode the planner chose for it
    speed = {w: engine.calibration[w]["speeds"][1] for w in counts}
    fast, slow = sorted(speed, key=speed.get, reverse=True)
    assert counts[fast][1] >= counts[slow][1], (counts, speed)


def test_missing_gpu_is_named_through_the_coordinator(procs):
    count = gpu_count()
    if count > 7:
        pytest.skip(f"this machine has {count} GPUs: cuda:7 exists")
    c = procs(python_cmd("hetconv.cli.coordinator", "--spawn", "cpu,cuda:7", "--conv", "2,2", "--fc", "4", "--steps", "1"))
    out, _ = c.communicate(timeout=60)
    assert c.returncode == 1
    assert "opening device cuda:7" in out
    assert f"cuda:7 requested but this machine has {count or 'no'} GPU" in out or "no CUDA driver found" in out


def test_resume_restores_a_checkpoint_onto_a_different_plan(tmp_path):
    straight = train(Config(**TINY, steps=5).validate(),
                     LocalEngine({"local": ConvShard(open_device("cpu", threads=1))}), log=quiet)["losses"]
    first = remote(2)
    try:
        train(Config(**TINY, steps=2, checkpoint_dir=str(tmp_path)).validate(), first, log=quiet)
    finally:
        first.close()
    second = remote(3)                                  # more workers, a plan the checkpoint never saw
    try:
        second.fixed_plan = fixed_plan([6, 12], {"w0-cpu": [1, 2], "w1-cpu": [4, 3], "w2-cpu": [1, 7]})
        resumed = train(Config(**TINY, steps=5).validate(), second, log=quiet, resume=str(tmp_path))
    finally:
        second.close()
    np.testing.assert_allclose(resumed["losses"], straight[2:], rtol=1e-5)


def test_a_bad_split_is_rebalanced_from_measured_steps_without_changing_the_math(tmp_path):
    cfg = Config(**{**TINY, "conv": "32,256"}, steps=10, rebalance_after=3, metrics=str(tmp_path / "m.jsonl")).validate()
    local = train(cfg, LocalEngine({"local": ConvShard(open_device("cpu", threads=1))}), log=quiet)["losses"]
    engine = remote(2)
    calibrate_then_plan = engine.plan_for

    def fooled(*args):                              # as if calibration had been badly fooled
        calibrate_then_plan(*args)
        return fixed_plan([32, 256], {"w0-cpu": [2, 8], "w1-cpu": [30, 248]})
    engine.plan_for = fooled
    measured_rebalance = engine.propose_rebalance

    def as_if_measured_on_equal_cores(specs, **kwargs):
        # what the steps would measure on two equally fast, otherwise idle cores (compute in
        # proportion to kernels held), so the decision does not depend on what else this machine
        # runs; the gather / re-load it triggers mid-run is real
        steps = engine.measured_steps
        for name in engine.plan.workers:
            engine.layer_compute[name] = {lp.layer: steps * 1e-3 * lp.count(name) for lp in engine.plan.layers}
        return measured_rebalance(specs, **kwargs)
    engine.propose_rebalance = as_if_measured_on_equal_cores
    try:
        summary = train(cfg, engine, log=quiet)
        final = {w: engine.plan.layers[1].count(w) for w in engine.workers}
    finally:
        engine.close()
    np.testing.assert_allclose(summary["losses"], local, rtol=1e-5)
    plans = [json.loads(l) for l in open(tmp_path / "m.jsonl") if '"event": "plan"' in l]
    assert len(plans) >= 2 and plans[1]["reason"] == "rebalance" and plans[1]["step"] == 3
    # w0 was given 8 of 256 kernels on a core as fast as w1's: kernels move to it (how far depends on
    # the calibrated fixed costs, which are real measurements; the direction does not)
    assert plans[1]["layers"][1]["kernels"]["w0-cpu"] > 8 and final["w0-cpu"] > 8, (plans[1], final)
    # step 3 (--trace-step's default) was traced: each worker's blocks forward and backward, in
    # time order, its updates last; no other step was
    steps = {r["step"]: r for r in map(json.loads, open(tmp_path / "m.jsonl")) if r["event"] == "step"}
    assert [s for s, r in steps.items() if any("trace" in w for w in r["workers"].values())] == [3]
    for name, stats in steps[3]["workers"].items():
        spans = stats["trace"]["spans"]
        blocks = [(what, layer) for what, layer, _, _, _ in spans if what in ("forward", "backward")]
        assert blocks == [("forward", 0), ("forward", 1), ("backward", 1), ("backward", 0)], (name, spans)
        assert spans[-1][0] == "updates" and all(0 <= s[3] <= s[4] <= spans[-1][4] for s in spans)
    # the worker with 8 of conv2's 256 kernels waits for the other's partial dX
    waits = [what for what, *_ in steps[3]["workers"]["w0-cpu"]["trace"]["spans"] if what.startswith("wait ")]
    assert "wait backward" in waits, waits


def test_rebalance_after_one_step_is_refused():
    with pytest.raises(ValueError, match="--rebalance-after must be 0 \\(never\\) or at least 2"):
        Config(rebalance_after=1).validate()


def _coordinator_bytes_per_step(workers, exchange, tmp_path):
    metrics = tmp_path / f"{exchange}-{workers}.jsonl"
    engine = remote(workers, exchange=exchange)
    try:
        # an equal split set by hand: what the link carries does not depend on a calibration
        engine.fixed_plan = fixed_plan([6, 12], {name: [6 // workers, 12 // workers] for name in engine.workers})
        train(Config(**TINY, steps=2, exchange=exchange, micro_batches=1, metrics=str(metrics)).validate(),
              engine, log=quiet)
    finally:
        engine.close()
    steps = [json.loads(l) for l in open(metrics) if '"event": "step"' in l]
    return sum(w["bytes_sent"] + w["bytes_recv"] for w in steps[-1]["workers"].values())


def test_peer_exchange_keeps_the_coordinators_bytes_flat_as_workers_are_added(tmp_path):
    peer2, peer3 = (_coordinator_bytes_per_step(n, "peer", tmp_path) for n in (2, 3))
    star2, star3 = (_coordinator_bytes_per_step(n, "star", tmp_path) for n in (2, 3))
    assert peer3 < 1.02 * peer2, (peer2, peer3)          # headers only: a few hundred bytes a worker
    assert star3 > 1.3 * star2, (star2, star3)           # the star's link carries every layer per worker
    assert peer2 < star2


def test_a_snapshots_traffic_is_its_own_not_the_next_steps(tmp_path):
    metrics = tmp_path / "m.jsonl"
    engine = remote(2)
    try:
        train(Config(**TINY, steps=4, snapshot_every=2, micro_batches=1, rebalance_after=0,  # a rebalance's gather
              metrics=str(metrics)).validate(), engine, log=quiet)                             # is a snapshot too
    finally:
        engine.close()
    records = [json.loads(line) for line in open(metrics)]
    step_bytes = {r["step"]: sum(w["bytes_sent"] + w["bytes_recv"] for w in r["workers"].values())
                  for r in records if r["event"] == "step"}
    snapshots = [r for r in records if r["event"] == "snapshot"]
    assert [r["step"] for r in snapshots] == [2, 4]
    weights = 2 * 4 * sum(s.kernels * (s.in_channels * s.kh * s.kw + 1) for s in conv_specs(Config(**TINY).conv_kernels()))
    assert all(r["bytes"] >= weights for r in snapshots), (snapshots, weights)   # every weight and momentum
    assert step_bytes[3] < step_bytes[2] + weights / 2, step_bytes   # step 3 carries none of it
    # each step books every worker's compute per conv layer too: most of its total (the rest is
    # work of no layer, such as unpacking the step's request)
    for r in records:
        if r["event"] == "step":
            for stats in r["workers"].values():
                assert len(stats["layer_compute_s"]) == 2 and min(stats["layer_compute_s"]) > 0, stats
                assert 0.5 * stats["compute_s"] < sum(stats["layer_compute_s"]) <= stats["compute_s"] + 1e-9, stats


@pytest.mark.parametrize("wire", ["bfloat16", "float16"])
def test_a_16_bit_wire_trains_like_float32(local_run, wire):
    engine = remote(2, wire=wire)
    try:
        summary = train(Config(**TINY, steps=3, wire_dtype=wire).validate(), engine, log=quiet)
    finally:
        engine.close()
    np.testing.assert_allclose(summary["losses"], local_run[0], rtol=2e-2)
    assert not np.allclose(summary["losses"], local_run[0], rtol=1e-7, atol=0), "a 16-bit wire cannot be exact"


def test_a_killed_worker_is_survived_and_the_run_equals_an_uninterrupted_one(tmp_path):
    cfg = dict(TINY, steps=6, snapshot_every=2, rebalance_after=0)
    local_dir, dist_dir = tmp_path / "local", tmp_path / "dist"
    local = train(Config(**cfg, checkpoint_dir=str(local_dir)).validate(),
                  LocalEngine({"local": ConvShard(open_device("cpu", threads=1))}), log=quiet)
    metrics = tmp_path / "m.jsonl"
    engine = remote(3)
    kill_worker_on_step(engine, 1, at_step=4)             # snapshots after steps 2 and 4: steps 3 (and 4) replay
    try:
        summary = train(Config(**cfg, checkpoint_dir=str(dist_dir), metrics=str(metrics)).validate(), engine, log=quiet)
        survivors = list(engine.plan.workers)
    finally:
        engine.close()
    assert survivors == ["w0-cpu", "w2-cpu"]
    np.testing.assert_allclose(summary["losses"], local["losses"], rtol=1e-4)   # another plan: other dX sums
    _, conv, fc = checkpoint.load(str(dist_dir))
    _, local_conv, local_fc = checkpoint.load(str(local_dir))
    for got, want in zip(conv + fc, local_conv + local_fc):
        assert sorted(got) == sorted(want)
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-6)
    records = [json.loads(line) for line in open(metrics)]
    lost = [r for r in records if r["event"] == "worker_lost"]
    assert len(lost) == 1 and lost[0]["worker"] == "w1-cpu" and lost[0]["step"] == 4
    assert any(r["event"] == "plan" and r.get("reason") == "lost w1-cpu" and r["step"] == 2 for r in records)
    assert records[-1]["event"] == "done"


def test_below_min_workers_the_run_checkpoints_and_stops_clearly(tmp_path):
    engine = remote(2)
    kill_worker_on_step(engine, 0, at_step=3)
    try:
        with pytest.raises(WorkerLost, match=r"1 worker\(s\) left, below --min-workers 2: saved step 2 to .*ckpt-step0000002"):
            train(Config(**TINY, steps=5, snapshot_every=2, min_workers=2, checkpoint_dir=str(tmp_path)).validate(),
                  engine, log=quiet)
    finally:
        engine.close()
    meta, _, _ = checkpoint.load(str(tmp_path))
    assert meta["step"] == 2


def test_a_second_loss_while_the_survivors_reload_is_survived_too_or_stops_at_the_floor(tmp_path):
    engine = remote(3)
    real, calls = engine.conv_step, {"n": 0}

    def conv_step(*args, **kw):                     # two workers die at once in step 4
        calls["n"] += 1
        if calls["n"] == 4:
            for _, proc in engine.processes[:2]:
                proc.kill()
                proc.wait()
        return real(*args, **kw)
    engine.conv_step = conv_step
    try:
        with pytest.raises(WorkerLost, match=r"1 worker\(s\) left, below --min-workers 2: saved step 2"):
            train(Config(**TINY, steps=8, snapshot_every=2, min_workers=2, rebalance_after=0,
                         checkpoint_dir=str(tmp_path / "ckpt")).validate(), engine, log=quiet)
    finally:
        engine.close()
    meta, _, _ = checkpoint.load(str(tmp_path / "ckpt"))
    assert meta["step"] == 2


def test_a_killed_external_worker_is_heard_disconnecting_not_waited_out(procs):
    """No process handle and a heartbeat limit of a minute: only the socket monitor can name it."""
    address = f"tcp://127.0.0.1:{free_port()}"
    workers = [external_worker(procs, address, f"ext{i}") for i in range(2)]
    engine = RemoteEngine(address, 2, [], threads=1, connect_timeout=60, worker_timeout=60, op_timeout=60, log=quiet)
    try:
        spec = ConvSpec.paper(3, 4, 3, 0)
        w = np.ones((4, 3, 3, 3), np.float32)
        engine.load(fixed_plan([4], {"ext0": [2], "ext1": [2]}), [spec], [(w, np.zeros(4, np.float32), None, None)])
        workers[1].kill()
        workers[1].wait()
        with pytest.raises(WorkerLost, match=r"worker ext1 .* disconnected") as lost:
            for _ in range(50):                          # the first calls may still find the socket open
                engine.forward(0, np.ones((2, 3, 8, 8), np.float32))
        assert lost.value.workers == ["ext1"]
    finally:
        engine.close()


def test_a_worker_that_connects_mid_run_joins_at_a_snapshot(tmp_path, procs):
    cfg = dict(TINY, steps=6, snapshot_every=2, rebalance_after=0)
    local = train(Config(**cfg).validate(), LocalEngine({"local": ConvShard(open_device("cpu", threads=1))}), log=quiet)
    metrics = tmp_path / "m.jsonl"
    engine = remote(2)
    join_during_step(engine, procs, 2)                   # its HELLO arrives while step 2 runs
    try:
        summary = train(Config(**cfg, metrics=str(metrics)).validate(), engine, log=quiet)
        workers = list(engine.plan.workers)
    finally:
        engine.close()
    assert workers == ["w0-cpu", "w1-cpu", "late"]
    np.testing.assert_allclose(summary["losses"], local["losses"], rtol=1e-5)
    records = [json.loads(line) for line in open(metrics)]
    assert any(r["event"] == "worker_joined" for r in records)
    assert any(r["event"] == "plan" and r.get("reason") == "worker joined" for r in records)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores to pin two workers apart")
def test_spawned_cpu_workers_with_their_own_thread_counts_are_pinned_to_cores_of_their_own():
    engine = RemoteEngine("tcp://127.0.0.1:0", 0, ["cpu:1", "cpu:1"], threads=0, connect_timeout=60, log=quiet)
    try:
        affinity = [sorted(os.sched_getaffinity(proc.pid)) for _, proc in engine.processes]
    finally:
        engine.close()
    assert all(len(cores) == 1 for cores in affinity) and affinity[0] != affinity[1], affinity
