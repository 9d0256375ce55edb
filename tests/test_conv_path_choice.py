"""A CPU device's conv path is the user's to force (--cpu-conv-path, for --local, spawned workers and
hetconv-plan), and what each device chose is said at calibration and kept in the run's metrics."""
import json
import subprocess
import sys

import numpy as np
import pytest

from hetconv.cli import worker as worker_cli
from hetconv.engine.conv_precision import checked_choices
from hetconv.devices import open_device
from hetconv.devices.cpu import CONV_PATHS
from hetconv.devices.cpu_options import CpuOptions
from hetconv.engine.measure import calibrate_local
from hetconv.engine.shard import ConvShard, ShardServer
from hetconv.geometry import ConvSpec
from hetconv.training.config import Config
from hetconv.transport import protocol as P

TINY = ["--conv", "3,4", "--fc", "8", "--batch-size", "8", "--synthetic-train", "16", "--synthetic-test", "8",
        "--steps", "1", "--eval-batches", "1", "--seed", "3"]


def test_the_workers_flag_names_every_path_the_device_has():
    assert worker_cli.CPU_CONV_PATHS == CONV_PATHS


@pytest.mark.parametrize("bad", ["direct", "FFT", ""])
def test_an_unknown_path_is_refused_naming_the_flag(bad):
    with pytest.raises(ValueError, match="^--cpu-conv-path must be one of auto, im2col, shifted, fft, im2col-dnnl, "
                                         f"direct-dnnl, depthwise, winograd, got {bad!r}$"):
        Config(cpu_conv_path=bad).validate()


def test_calibration_says_which_path_a_forced_device_runs():
    spec = ConvSpec.paper(3, 4, 3, 0)
    server = ShardServer(ConvShard(open_device("cpu", threads=1, conv_path="fft")))
    op, _, fields = server.handle("CALIBRATE", [], {"layers": [{"spec": spec.to_json(), "input_shape": [2, 3, 10, 10],
                                                                "kernels": 4}], "repeats": 1})
    assert op == "CALIBRATED"
    assert fields["conv_paths"] and all(c["path"] == "fft" and c["why"] == "forced" for c in fields["conv_paths"])
    assert P.unpack(P.pack("CALIBRATED", 1, **fields)).fields["conv_paths"] == fields["conv_paths"]   # it travels


def test_hetconv_plans_in_process_calibration_names_the_path():
    spec = ConvSpec.paper(3, 4, 3, 0)
    profile = calibrate_local("cpu", [spec], [(2, 3, 10, 10)], [4], threads=1, repeats=1,
                              cpu=CpuOptions(conv_path="shifted"))
    assert profile.description.endswith("; conv paths shifted")


def test_spawned_workers_run_the_path_the_coordinator_was_given(tmp_path):
    metrics = tmp_path / "m.jsonl"
    r = subprocess.run([sys.executable, "-m", "hetconv.cli.coordinator", "--spawn", "cpu,cpu", "--threads", "1",
                        "--cpu-conv-path", "im2col", "--metrics", str(metrics), *TINY],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "w0-cpu conv paths (forced): im2col for " in r.stdout
    record = next(json.loads(line) for line in open(metrics) if '"event": "calibration"' in line)
    chosen = [c for worker in record["workers"].values() for c in worker["conv_paths"]]
    assert chosen and all(c["path"] == "im2col" and c["why"] == "forced" for c in chosen)


def test_a_workers_malformed_conv_path_report_is_dropped_not_trusted():
    good = {"call": "x (2, 3, 8, 8)", "path": "fft", "why": "timed", "seconds": {"fft": 0.5, "im2col": 1, "x": "slow"}}
    got = checked_choices([good, "fft", {"path": 3}, {**good, "seconds": None}, None])
    assert got == [{"call": good["call"], "path": "fft", "why": "timed", "seconds": {"fft": 0.5, "im2col": 1.0}}]
    assert checked_choices("everything") == []
    assert len(checked_choices([good] * 100)) == 64
    direct = {**good, "path": "direct-bf16", "kernels": {"forward": "jit_bf16:avx512_core_bf16", "backward-data": 7,
                                                          "x" * 99: "y" * 99, "four": "a", "five": "b"}}
    kernels = checked_choices([direct])[0]["kernels"]
    assert kernels == {"forward": "jit_bf16:avx512_core_bf16", "x" * 20: "y" * 60}    # strings, 3 entries, cut


def test_spawned_workers_on_the_winograd_path_train_as_the_local_run_does(tmp_path):
    """--cpu-conv-path winograd end to end: two spawned workers each run their share of 3x3
    layers on it (said in the calibration record) and train as --local on the same path does: the
    conv weights after four steps (which moved from their start) equal, to Winograd's rounding."""
    from hetconv.training import checkpoint
    flags = ["--cpu-conv-path", "winograd", "--threads", "1", "--conv", "6,8", "--ksize", "3", "--padding", "1",
             "--fc", "8", "--batch-size", "8", "--synthetic-train", "32", "--synthetic-test", "8", "--steps", "4",
             "--eval-batches", "1", "--seed", "3", "--lr", "0.5"]
    convs = {}
    for mode in (["--spawn", "cpu,cpu"], ["--local"], ["--local", "--lr", "1e-12"]):     # the last: (all but) the start
        name = "-".join(m.strip("-") for m in mode)
        metrics, ck = tmp_path / f"{name}.jsonl", tmp_path / name
        r = subprocess.run([sys.executable, "-m", "hetconv.cli.coordinator", *flags, *mode, "--metrics", str(metrics),
                            "--checkpoint-dir", str(ck)], capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
        convs[mode[0] if len(mode) < 3 else "start"] = checkpoint.load(str(ck))[1]
        if mode[0] == "--spawn":
            records = [json.loads(line) for line in open(metrics)]
            calibration = next(rec for rec in records if rec["event"] == "calibration")
            chosen = [c for worker in calibration["workers"].values() for c in worker["conv_paths"]]
            assert chosen and all(c["path"] == "winograd" and c["why"] == "forced" for c in chosen)
    for spawned, local, start in zip(convs["--spawn"], convs["--local"], convs["start"]):
        assert np.abs(local["w"] - start["w"]).max() > 1e-3          # the conv layers learned
        np.testing.assert_allclose(spawned["w"], local["w"], rtol=1e-4, atol=1e-6)
