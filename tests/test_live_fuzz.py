"""A real coordinator with two spawned workers trains while hostile frames hit its port and one
worker's peer inbox: random bytes, real headers mutated, arrays cut short, wrong dtypes, huge
declared shapes, frames over the run's limit, raw TCP. Both must keep serving and the run must
end as it would have without them: exit 0, a `done` record, the same losses."""
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import numpy as np

from conftest import REPO, python_cmd
from hetconv.geometry import conv_specs, message_limit_bytes

sys.path.insert(0, os.path.join(REPO, "bench"))
import _fuzz  # noqa: E402

NET = ["--conv", "4,8", "--fc", "8", "--batch-size", "8", "--steps", "6", "--split", "equal", "--threads", "1",
       "--synthetic-train", "256", "--synthetic-test", "32", "--calibration-batch", "4", "--data", "synthetic"]
LIMIT = message_limit_bytes(conv_specs([4, 8]), 8)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(procs, tmp_path, name, fuzz_seed=None):
    """One run; with a seed, its port is fuzzed from the start and one worker's peer inbox from
    the moment the worker says where it is, both until the run ends. Returns (exit code, output,
    metrics records, {target: {kind: sent}})."""
    port = free_port()
    metrics, out_path = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.txt"
    with open(out_path, "w") as out:
        # --insecure: with the run's own keys a fuzzer could not even finish a handshake, and
        # what is under test here is what happens to frames that get through one
        coord = procs(python_cmd("hetconv.cli.coordinator", "--spawn", "cpu,cpu", "--bind", f"tcp://127.0.0.1:{port}",
                                 "--insecure", "--verbose", "--metrics", metrics, *NET),  # --verbose: workers print their inboxes
                     stdout=out, stderr=subprocess.STDOUT)
    sent, threads = {}, []
    # until the run has written `done` (its sockets then close: a fuzzer connecting while libzmq
    # tears them down tests libzmq's shutdown, not this run)
    def ended():
        try:
            written = metrics.read_text()
        except FileNotFoundError:     # not yet, or the coordinator's check that it can write there removed it
            written = ""
        return coord.poll() is not None or '"event": "done"' in written

    def fuzz(target, endpoint, seed):
        sent[target] = _fuzz.fuzz(target, endpoint, LIMIT, ["w0-cpu", "w1-cpu"], seed=seed, count=4000,
                                  deadline_s=60, until=ended)

    if fuzz_seed is not None:
        threads.append(threading.Thread(target=fuzz, args=("coordinator", f"tcp://127.0.0.1:{port}", fuzz_seed)))
        threads[-1].start()
        deadline = time.monotonic() + 60
        inboxes = []
        while len(inboxes) < 2 and time.monotonic() < deadline and not ended():
            inboxes = re.findall(r"peers reach it at .*?(tcp://\S+)", out_path.read_text())
            time.sleep(0.01)
        assert len(inboxes) == 2, f"the workers never said where peers reach them:\n{out_path.read_text()}"
        threads.append(threading.Thread(target=fuzz, args=("inbox", inboxes[0], fuzz_seed + 1)))
        threads[-1].start()
    try:
        coord.wait(timeout=90)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the run did not end within 90 s:\n{out_path.read_text()}")
    finally:
        for t in threads:
            t.join(timeout=70)                                # each stops once the run has ended
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return coord.returncode, out_path.read_text(), records, sent


def test_fuzzed_coordinator_and_worker_keep_serving_and_train_the_same(procs, tmp_path):
    # the plain run, on its own port, goes on beside the fuzzed one: each waits mostly on its workers
    plain_run = {}
    beside = threading.Thread(target=lambda: plain_run.update(result=run(procs, tmp_path, "plain")))
    beside.start()
    try:
        code, out, records, sent = run(procs, tmp_path, "fuzzed", fuzz_seed=7)
    finally:
        beside.join(timeout=120)
    assert code == 0, out
    assert records and records[-1]["event"] == "done", out
    # both were hit while the run was live, with every kind of frame
    for target in ("coordinator", "inbox"):
        assert set(sent[target]) == set(_fuzz.KINDS), sent
    assert "ignored a malformed message from a peer" in out and "ignored a malformed message from" in out, out
    assert "dropped worker" not in out and not re.search(r"\blost w\d", out), out
    assert "result" in plain_run, "the plain run did not end (see the error above)"
    code, plain_out, plain, _ = plain_run["result"]
    assert code == 0, plain_out
    losses = [r["loss"] for r in records if r["event"] == "step"]
    assert len(losses) == 6
    np.testing.assert_allclose(losses, [r["loss"] for r in plain if r["event"] == "step"], rtol=1e-6)
