"""No lost work: a worker lost outside a training step (evaluation, a checkpoint's gather, a
rebalance, a joiner's calibration) is survived like one lost in a step; SIGTERM saves like Ctrl-C;
joiners that vanish or fail never touch the running plan; checkpoint retention follows the run's
timeline. Real worker processes on loopback, each run compared with an uninterrupted `--local` one."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq

from _faults import join_during_step
from conftest import external_worker, python_cmd
from hetconv.net import NetSpec
from hetconv.training import checkpoint
from hetconv.transport import protocol as P
from hetconv.training.config import Config
from hetconv.devices import open_device
from hetconv.engine.local import LocalEngine
from hetconv.engine.planner import fixed_plan
from hetconv.coordinator.remote import RemoteEngine
from hetconv.engine.shard import ConvShard
from hetconv.training.loop import train

TINY = dict(conv="6,12", fc="32", batch_size=32, synthetic_train=512, synthetic_test=64, lr=0.01, threads=1,
            calibration_batch=4, use_all=True, rebalance_after=0)


def quiet(*_):
    pass


def remote(n, **kw):
    kw.setdefault("worker_timeout", 10.0)
    return RemoteEngine("tcp://127.0.0.1:0", 0, ["cpu"] * n, threads=1, connect_timeout=60, log=quiet, **kw)


def kill(engine, index):
    proc = engine.processes[index][1]
    proc.kill()
    proc.wait()


def records(path):
    return [json.loads(line) for line in open(path)]


def written_records(path):
    """The records of a metrics file a running coordinator is still writing: whole lines only
    (a reader can catch the last one half written, since each record is flushed as it goes)."""
    return [json.loads(line) for line in open(path) if line.endswith("\n")]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The --local run every test here must end equal to: 6 steps, checkpoint at the end."""
    d = tmp_path_factory.mktemp("local")
    summary = train(Config(**TINY, steps=6, checkpoint_dir=str(d)).validate(),
                    LocalEngine({"local": ConvShard(open_device("cpu", threads=1))}), log=quiet)
    return summary, checkpoint.load(str(d))


def assert_same_weights(directory, uninterrupted):
    meta, conv, fc = checkpoint.load(str(directory))
    lmeta, lconv, lfc = uninterrupted[1]
    assert meta["step"] == lmeta["step"]
    for got, want in zip(conv + fc, lconv + lfc):
        assert sorted(got) == sorted(want)
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-6)


def assert_done(metrics, uninterrupted):
    recs = records(metrics)
    assert recs[-1]["event"] == "done"
    assert recs[-1]["test_accuracy"] == uninterrupted[0]["test_accuracy"]
    return recs


def test_a_worker_killed_during_evaluation_is_survived(tmp_path, uninterrupted):
    engine = remote(3)
    real_predict = engine.predict

    def predict(x):
        if not engine.processes[1][1].poll() is not None:
            kill(engine, 1)                              # in the middle of the test set's first batch
        return real_predict(x)
    engine.predict = predict
    metrics = tmp_path / "m.jsonl"
    try:
        summary = train(Config(**TINY, steps=6, checkpoint_dir=str(tmp_path / "ck"), metrics=str(metrics)).validate(),
                        engine, log=quiet)
        survivors = list(engine.plan.workers)
    finally:
        engine.close()
    assert survivors == ["w0-cpu", "w2-cpu"]
    assert summary["test_accuracy"] == uninterrupted[0]["test_accuracy"]
    recs = assert_done(metrics, uninterrupted)
    assert [r["worker"] for r in recs if r["event"] == "worker_lost"] == ["w1-cpu"]
    assert_same_weights(tmp_path / "ck", uninterrupted)


def test_a_worker_killed_during_a_checkpoints_gather_is_survived(tmp_path, uninterrupted):
    engine = remote(3)
    real_gather, calls = engine.gather, {"n": 0}

    def gather():
        calls["n"] += 1
        if calls["n"] == 3:                              # snapshot at 2, checkpoint at 2 (the same), 4: ...
            kill(engine, 2)
        return real_gather()
    engine.gather = gather
    metrics = tmp_path / "m.jsonl"
    try:
        train(Config(**TINY, steps=6, snapshot_every=2, checkpoint_every=2, checkpoint_dir=str(tmp_path / "ck"),
                     metrics=str(metrics)).validate(), engine, log=quiet)
    finally:
        engine.close()
    recs = assert_done(metrics, uninterrupted)
    assert [r["worker"] for r in recs if r["event"] == "worker_lost"] == ["w2-cpu"]
    assert_same_weights(tmp_path / "ck", uninterrupted)
    assert sorted(r["step"] for r in recs if r["event"] == "checkpoint") == [2, 4, 6]


def test_a_worker_killed_during_a_rebalance_is_survived_and_rebalancing_is_armed_again(tmp_path, uninterrupted):
    engine = remote(3)
    proposals = []

    def propose_rebalance(specs, **kw):                  # move two kernels, whatever the timings say
        proposals.append(len(engine.plan.workers))
        counts = {n: [lp.count(n) for lp in engine.plan.layers] for n in engine.plan.workers}
        most = max(counts, key=lambda n: counts[n][1])          # it holds at least 4 of conv2's 12 kernels
        other = next(n for n in counts if n != most)
        counts[most][1] -= 2
        counts[other][1] += 2
        return fixed_plan([s.kernels for s in specs], counts)
    engine.propose_rebalance = propose_rebalance
    real_load = engine.load

    def load(plan, specs, params):
        if len(proposals) == 1 and engine.processes[1][1].poll() is None:
            kill(engine, 1)                              # while the kernels move
        return real_load(plan, specs, params)
    engine.load = load
    metrics = tmp_path / "m.jsonl"
    try:
        train(Config(**{**TINY, "rebalance_after": 2, "parallel": "model"}, steps=6, checkpoint_dir=str(tmp_path / "ck"),
                     metrics=str(metrics)).validate(), engine, log=quiet)
    finally:
        engine.close()
    recs = assert_done(metrics, uninterrupted)
    assert [r["worker"] for r in recs if r["event"] == "worker_lost"] == ["w1-cpu"]
    assert_same_weights(tmp_path / "ck", uninterrupted)
    assert proposals[0] == 3 and 2 in proposals[1:], "rebalancing was not armed again after the loss"


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_worker_killed_while_a_joiner_calibrates_is_survived_and_the_joiner_is_calibrated(
        tmp_path, procs, uninterrupted):
    engine = remote(2)
    join_during_step(engine, procs, 2)
    real_calibrate = engine._calibrate_some

    def calibrate_some(specs, input_shapes, settings, names):
        if "late" in names and engine.processes[1][1].poll() is None:
            kill(engine, 1)
        return real_calibrate(specs, input_shapes, settings, names)
    engine._calibrate_some = calibrate_some
    metrics = tmp_path / "m.jsonl"
    try:
        train(Config(**TINY, steps=6, snapshot_every=2, checkpoint_dir=str(tmp_path / "ck"),
                     metrics=str(metrics)).validate(), engine, log=quiet)
        workers, calibrated = list(engine.plan.workers), set(engine.calibration)
    finally:
        engine.close()
    assert workers == ["w0-cpu", "late"]
    assert calibrated == set(workers), "a worker was planned without a calibration"
    recs = assert_done(metrics, uninterrupted)
    assert [r["worker"] for r in recs if r["event"] == "worker_lost"] == ["w1-cpu"]
    assert_same_weights(tmp_path / "ck", uninterrupted)


def test_a_joiner_with_too_small_a_frame_limit_is_dropped_and_the_run_goes_on(tmp_path, procs, uninterrupted):
    engine = remote(2, message_limit=4_000_000)
    join_during_step(engine, procs, 2, "--message-limit-mb", "0.001")
    metrics = tmp_path / "m.jsonl"
    lines = []
    engine.log = lines.append
    try:
        train(Config(**TINY, steps=6, snapshot_every=2, checkpoint_dir=str(tmp_path / "ck"),
                     metrics=str(metrics)).validate(), engine, log=quiet)
        workers = list(engine.plan.workers)
    finally:
        engine.close()
    assert workers == ["w0-cpu", "w1-cpu"]
    assert sum("not admitted" in line and "MessageLimitError" in line for line in lines) == 1, lines
    recs = assert_done(metrics, uninterrupted)
    assert not [r for r in recs if r["event"] in ("worker_lost", "worker_joined")]
    assert [r.get("reason") for r in recs if r["event"] == "plan"] == [None]
    assert_same_weights(tmp_path / "ck", uninterrupted)


def test_a_joiner_is_told_to_wait_and_one_that_vanishes_is_forgotten_once(tmp_path, uninterrupted):
    """A joiner hears WAIT (how long until the next snapshot admits it); one that has gone by then
    is forgotten once: no re-plan, no reload, the running plan untouched."""
    engine = remote(2, insecure=True)                      # a plain socket plays the joiner: no keys
    ctx = zmq.Context()
    joiner = ctx.socket(zmq.DEALER)
    joiner.linger = 0
    heard = []
    real, calls = engine.conv_step, {"n": 0}

    def conv_step(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            joiner.connect(engine.address)
            joiner.send_multipart(P.pack("HELLO", 0, name="ghost", identity="ghost/h/1/x", device="cpu", host="h",
                                         pid=1, peer_endpoints=[], host_key=""))
        if calls["n"] == 3:
            while joiner.poll(2000):
                heard.append(P.unpack(joiner.recv_multipart()))
            joiner.close()                               # gone before the snapshot after step 4
        return real(*args, **kw)
    engine.conv_step = conv_step
    lines = []
    engine.log = lines.append
    metrics = tmp_path / "m.jsonl"
    try:
        train(Config(**TINY, steps=6, snapshot_every=4, checkpoint_dir=str(tmp_path / "ck"),
                     metrics=str(metrics)).validate(), engine, log=quiet)
        workers = list(engine.plan.workers)
    finally:
        engine.close()
        ctx.term()
    assert heard and all(m.op == "WAIT" for m in heard)
    assert heard[-1].fields["seconds"] > 0
    assert workers == ["w0-cpu", "w1-cpu"]
    assert sum("ghost" in line and "has gone" in line for line in lines) == 1, lines
    recs = assert_done(metrics, uninterrupted)
    assert [r.get("reason") for r in recs if r["event"] == "plan"] == [None]
    assert_same_weights(tmp_path / "ck", uninterrupted)


def test_the_rescue_checkpoint_is_the_newest_state_and_keeps_what_retention_allows(tmp_path):
    """At the --min-workers floor: checkpoints every step, snapshots every 4. The rescue must not
    be an older snapshot than the checkpoints on disk, and must not delete past --keep-checkpoints."""
    engine = remote(2)
    real, calls = engine.conv_step, {"n": 0}

    def conv_step(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 4:
            kill(engine, 0)
        return real(*args, **kw)
    engine.conv_step = conv_step
    ck = tmp_path / "ck"
    try:
        with pytest.raises(Exception, match=r"below --min-workers 2: saved step 3 to .*ckpt-step0000003"):
            train(Config(**TINY, steps=8, snapshot_every=4, checkpoint_every=1, keep_checkpoints=10, min_workers=2,
                         checkpoint_dir=str(ck)).validate(), engine, log=quiet)
    finally:
        engine.close()
    assert sorted(os.listdir(ck)) == [f"ckpt-step{s:07d}.npz" for s in (1, 2, 3)]
    assert checkpoint.load(str(ck))[0]["step"] == 3


def test_resume_without_checkpoint_dir_writes_to_the_resume_directory(tmp_path):
    cfg = dict(TINY, steps=2)
    local = LocalEngine({"local": ConvShard(open_device("cpu", threads=1))})
    train(Config(**cfg, checkpoint_dir=str(tmp_path)).validate(), local, log=quiet)
    train(Config(**{**cfg, "steps": 4}).validate(), local, log=quiet, resume=str(tmp_path))
    assert checkpoint.load(str(tmp_path))[0]["step"] == 4


def test_resuming_an_earlier_checkpoint_starts_a_timeline_that_retention_and_resume_follow(tmp_path):
    """The directory held 10, 20, 30; a run resumed from 10 saves 15, 20, 25. What is left, and
    what a later --resume DIR takes, is that run's: 15, 20, 25, and 25."""
    spec = NetSpec.from_json({"input_shape": [3, 4, 4], "classes": 10, "layers": [
        {"type": "conv", "out_channels": 4, "kernel": 3}, {"type": "flatten"}, {"type": "linear", "out_features": 10}]})

    def save(step):
        rng = np.random.default_rng(step)
        names = ("w", "b", "w.momentum_buffer", "b.momentum_buffer")
        conv = [{n: rng.standard_normal(s).astype(np.float32) for n, s in zip(names, ((4, 3, 3, 3), (4,), (4, 3, 3, 3),
                                                                                      (4,)))}]
        fc = [{n: rng.standard_normal(s).astype(np.float32) for n, s in zip(names, ((10, 16), (10,), (10, 16), (10,)))}]
        checkpoint.save(str(tmp_path), step, 0, Config(), conv, fc, keep=3, network=spec.to_json())
    for step in (10, 20, 30, 15, 20, 25):
        save(step)
    assert sorted(os.listdir(tmp_path)) == [f"ckpt-step{s:07d}.npz" for s in (15, 20, 25)]
    assert checkpoint.load(str(tmp_path))[0]["step"] == 25


_FLAGS = ("--conv", "6,12", "--fc", "32", "--batch-size", "32", "--synthetic-train", "512", "--synthetic-test", "64",
          "--threads", "1", "--calibration-batch", "4", "--use-all", "--rebalance-after", "0", "--lr", "0.01")


def _coordinator(procs, tmp_path, *args):
    """A coordinator run, its output in out.txt; with Python's fault handler on, so that a crash names
    where each thread was (a heap corruption has aborted these runs: see docs/reliability.md)."""
    log = open(tmp_path / "out.txt", "a")
    return procs(python_cmd("hetconv.cli.coordinator", *_FLAGS, *args), stdout=log, stderr=subprocess.STDOUT,
                 env={**os.environ, "PYTHONFAULTHANDLER": "1", "LIBC_FATAL_STDERR_": "1"})


def _wait_for_step(metrics, step, seconds=120):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if metrics.exists() and any(r["event"] == "step" and r["step"] >= step
                                    for r in written_records(metrics) if metrics.stat().st_size):
            return
        time.sleep(0.1)
    raise AssertionError(f"no step {step} within {seconds}s")


def assert_bit_identical(directory, other):
    (meta, conv, fc), (other_meta, other_conv, other_fc) = checkpoint.load(str(directory)), checkpoint.load(str(other))
    assert meta["step"] == other_meta["step"]
    for got, want in zip(conv + fc, other_conv + other_fc):
        assert sorted(got) == sorted(want)
        for key in want:
            assert got[key].dtype == want[key].dtype and got[key].tobytes() == want[key].tobytes(), key


@pytest.mark.parametrize("mode", [["--local"], ["--spawn", "cpu:1,cpu:1"]])
def test_sigterm_checkpoints_the_step_reached_and_resume_finishes_like_an_uninterrupted_run(procs, tmp_path, mode):
    """--deterministic, so the resumed run ends bit for bit where the uninterrupted one does: --local
    against the same run in this process, two workers against an uninterrupted two-worker run."""
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    coord = _coordinator(procs, tmp_path, *mode, "--deterministic", "--epochs", "25", "--steps", "400",
                         "--checkpoint-dir", ck, "--metrics", metrics)
    _wait_for_step(metrics, 2)
    coord.send_signal(signal.SIGTERM)
    assert coord.wait(timeout=60) == 143, (tmp_path / "out.txt").read_text()
    last = records(metrics)[-1]
    reached = max(r["step"] for r in records(metrics) if r["event"] == "step")
    assert last["event"] == "interrupted" and last["step"] == reached < 400
    assert checkpoint.load(str(ck))[0]["step"] == reached
    # resumed with no --checkpoint-dir: its checkpoints go on into the directory it resumed from
    again = _coordinator(procs, tmp_path, *mode, "--deterministic", "--epochs", "25", "--steps", reached + 2,
                         "--resume", ck)
    whole = tmp_path / "whole"                          # the uninterrupted run, while the resumed one runs
    if mode == ["--local"]:
        train(Config(**TINY, epochs=25, steps=reached + 2, checkpoint_dir=str(whole), deterministic=True).validate(),
              LocalEngine({"local": ConvShard(open_device("cpu", threads=1, deterministic=True))}), log=quiet)
    else:
        uninterrupted = procs(python_cmd("hetconv.cli.coordinator", *_FLAGS, *mode, "--deterministic", "--epochs",
                                         "25", "--steps", reached + 2, "--checkpoint-dir", whole),
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        assert uninterrupted.wait(timeout=120) == 0
    assert again.wait(timeout=120) == 0, (tmp_path / "out.txt").read_text()
    assert_bit_identical(ck, whole)


def test_a_stop_that_cannot_finish_its_step_saves_the_last_snapshot_within_the_grace(procs, tmp_path):
    """A worker hangs (SIGSTOP) and SIGTERM comes: the step cannot finish, so after --stop-grace
    the coordinator saves its in-memory snapshot, which needs no worker, and exits 143."""
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    coord = _coordinator(procs, tmp_path, "--spawn", "cpu:1,cpu:1", "--epochs", "25", "--steps", "400",
                         "--snapshot-every", "2", "--worker-timeout", "120", "--stop-grace", "2",
                         "--checkpoint-dir", ck, "--metrics", metrics, "--verbose")   # the workers' own lines
    _wait_for_step(metrics, 3)
    pids = [int(line.split("/")[2]) for line in (tmp_path / "out.txt").read_text().splitlines()
            if line.startswith("hetconv-worker w")]
    os.kill(pids[0], signal.SIGSTOP)
    try:
        time.sleep(0.5)
        coord.send_signal(signal.SIGTERM)
        assert coord.wait(timeout=60) == 143, (tmp_path / "out.txt").read_text()
    finally:
        try:
            os.kill(pids[0], signal.SIGCONT)
        except ProcessLookupError:                       # the coordinator ended it already
            pass
    out = (tmp_path / "out.txt").read_text()
    assert "the stop did not complete within --stop-grace 2s: saved the snapshot of step" in out, out
    snapshots = [r["step"] for r in records(metrics) if r["event"] == "snapshot"]
    assert checkpoint.load(str(ck))[0]["step"] == max(snapshots)


def test_a_bind_to_an_address_not_of_this_host_is_not_blamed_on_another_coordinator():
    with pytest.raises(SystemExit) as e:
        RemoteEngine("tcp://192.0.2.1:5555", 1, [], log=quiet, connect_timeout=1)
    message = str(e.value)
    assert "cannot bind tcp://192.0.2.1:5555" in message and "another coordinator" not in message
    assert "is that address one of this host's?" in message


def test_the_hint_for_missing_workers_names_the_keys_they_need(tmp_path):
    from hetconv.transport import keys
    keys.make_keys(str(tmp_path / "k"))
    with pytest.raises(Exception, match=r"start more with `hetconv-worker --device cpu --connect tcp://127.0.0.1:\d+ "
                                        r"--curve .*k/workers/NAME`"):
        RemoteEngine("tcp://127.0.0.1:0", 1, [], log=quiet, connect_timeout=1, curve=str(tmp_path / "k"))


def test_a_worker_dropped_while_stopped_is_told_to_shut_down(procs, tmp_path):
    """An external worker that was SIGSTOPped is dropped as lost; when it runs again it reads the
    SHUTDOWN the coordinator left it and exits, instead of living on for --idle-timeout."""
    address = f"tcp://127.0.0.1:{_free_port()}"
    workers = [external_worker(procs, address, f"ext{i}") for i in range(2)]
    engine = RemoteEngine(address, 2, [], threads=1, connect_timeout=60, worker_timeout=2, op_timeout=60, log=quiet)
    try:
        os.kill(workers[1].pid, signal.SIGSTOP)
        time.sleep(2.5)
        with pytest.raises(Exception) as lost:
            engine._call({"ext1": ("FETCH", [], {"layer": 0})}, "probing")
        assert getattr(lost.value, "workers", None) == ["ext1"], lost.value
        engine.drop(["ext1"])
        os.kill(workers[1].pid, signal.SIGCONT)
        assert workers[1].wait(timeout=20) == 0
    finally:
        engine.close()


def test_a_spawned_worker_still_starting_at_the_connect_timeout_is_named_with_the_flag_that_waits_longer(
        monkeypatch):
    """A process the coordinator started and that still runs is slow, not missing: the line names
    it and --connect-timeout, not a hetconv-worker command to start by hand; the process is ended."""
    from hetconv.coordinator import remote
    started = []

    def slow_worker(*args, **kwargs):
        return [sys.executable, "-c", "import time; time.sleep(60)"]

    real_popen = subprocess.Popen

    def popen(cmd, **kwargs):
        p = real_popen(cmd, **kwargs)
        started.append(p)
        return p

    monkeypatch.setattr(remote, "worker_command", slow_worker)
    monkeypatch.setattr(remote.subprocess, "Popen", popen)
    with pytest.raises(Exception, match=r"only 0 of 1 workers connected .* within 1s: w0-cpu \(pid \d+\) started "
                                        r"but did not connect yet \(a loaded host\?\): --connect-timeout 120 "
                                        r"waits longer$"):
        RemoteEngine("tcp://127.0.0.1:0", 0, ["cpu"], threads=1, log=quiet, connect_timeout=1)
    assert started
    for p in started:
        try:
            assert p.wait(timeout=10) is not None         # the coordinator ended what it started
        finally:
            if p.poll() is None:
                p.kill()
