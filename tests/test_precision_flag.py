"""--precision fp32|bf16|auto: checked with the config, carried to --local, spawned workers and
hetconv-plan's calibration, and what each worker's conv GEMMs ran in said and kept in the run's
calibration record."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from _bf16 import needs_dnnl
from hetconv.cli import coordinator
from hetconv.cli import worker as worker_cli
from hetconv.engine.conv_precision import computed_precision as conv_precision
from hetconv.devices import open_device
from hetconv.devices.cpu import CONV_PATHS, PRECISIONS
from hetconv.devices.cpu_options import CpuOptions
from hetconv.engine.measure import calibrate_local
from hetconv.engine.shard import ConvShard, ShardServer
from hetconv.geometry import ConvSpec
from hetconv.training.config import Config

TINY = ["--conv", "3,4", "--fc", "8", "--batch-size", "8", "--synthetic-train", "16", "--synthetic-test", "8",
        "--steps", "1", "--eval-batches", "1", "--seed", "3"]


def says_bf16(text):
    """Whether a CPU device's description in `text` says precision bf16: on the CPU's bf16 GEMM,
    or on its emulation where the CPU has none."""
    return "precision bf16)" in text or "precision bf16 (emulated: no bf16 GEMM on this CPU" in text


def test_the_workers_flags_name_what_the_device_takes():
    assert worker_cli.PRECISIONS == PRECISIONS and worker_cli.CPU_CONV_PATHS == CONV_PATHS


def test_the_default_is_fp32():
    assert Config().precision == "fp32"
    assert worker_cli.build_parser().parse_args(["--device", "cpu"]).precision == "fp32"


@pytest.mark.parametrize("bad", ["fp16", "BF16", ""])
def test_an_unknown_precision_is_refused_naming_the_flag(bad):
    with pytest.raises(ValueError, match=f"^--precision must be one of fp32, bf16, auto, got {bad!r}$"):
        Config(precision=bad).validate()


def test_bf16_with_a_forced_conv_path_is_refused():
    with pytest.raises(ValueError, match="^--precision bf16 runs every CPU conv on its bf16 path: --cpu-conv-path fft "
                                         "cannot be forced with it \\(direct-dnnl can: oneDNN's convolutions in bf16\\)$"):
        Config(precision="bf16", cpu_conv_path="fft").validate()
    Config(precision="auto", cpu_conv_path="fft").validate()
    Config(precision="bf16", cpu_conv_path="direct-dnnl").validate()     # oneDNN's convolutions run bf16


def test_what_a_workers_gemms_ran_in():
    def paths(*names):
        return [{"path": p} for p in names]
    assert conv_precision(paths("im2col", "shifted", "fft")) == "fp32"
    assert conv_precision(paths("im2col-bf16", "im2col-bf16")) == "bf16"
    assert conv_precision(paths("im2col-bf16", "im2col-dnnl", "shifted")) == "bf16 on 1 of 3 call shapes"
    assert conv_precision([]) == "fp32"


@needs_dnnl
def test_calibration_reports_the_bf16_path():
    spec = ConvSpec.paper(3, 4, 3, 0)
    server = ShardServer(ConvShard(open_device("cpu", threads=1, precision="bf16")))
    op, _, fields = server.handle("CALIBRATE", [], {"layers": [{"spec": spec.to_json(), "input_shape": [2, 3, 10, 10],
                                                                "kernels": 4}], "repeats": 1})
    assert op == "CALIBRATED" and conv_precision(fields["conv_paths"]) == "bf16"
    profile = calibrate_local("cpu", [spec], [(2, 3, 10, 10)], [4], threads=1, repeats=1,
                              cpu=CpuOptions(precision="bf16"))
    assert says_bf16(profile.description) and profile.description.endswith("; conv paths im2col-bf16")


@needs_dnnl
def test_local_runs_and_says_its_precision(capsys, tmp_path):
    metrics = tmp_path / "m.jsonl"
    assert coordinator.main(["--local", "--threads", "1", "--precision", "bf16", "--metrics", str(metrics), *TINY]) == 0
    assert says_bf16(capsys.readouterr().out)
    assert json.loads(open(metrics).readline())["config"]["precision"] == "bf16"


@needs_dnnl
def test_on_a_cpu_without_bf16_instructions_bf16_runs_emulated_and_onednns_bf16_convs_are_refused(tmp_path):
    """ONEDNN_MAX_CPU_ISA=AVX2 makes oneDNN what it is on an AVX2 host (no bf16 GEMM): --precision
    bf16 trains on the emulation and says so; a forced direct-dnnl, oneDNN's bf16 convolutions,
    is one line."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    r = subprocess.run([sys.executable, "-m", "hetconv.cli.coordinator", "--local", "--threads", "1", "--precision",
                        "bf16", *TINY], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "precision bf16 (emulated: no bf16 GEMM on this CPU; the same sums, slower than float32))" in r.stdout
    r = subprocess.run([sys.executable, "-m", "hetconv.cli.coordinator", "--local", "--threads", "1", "--precision",
                        "bf16", "--cpu-conv-path", "direct-dnnl", *TINY], capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(
        "hetconv-coordinator: precision bf16 with conv path direct-dnnl runs oneDNN's bf16 convolutions, which this "
        "CPU lacks (")


@needs_dnnl
def test_spawned_workers_run_bf16_and_the_record_says_so(tmp_path):
    metrics = tmp_path / "m.jsonl"
    # --use-all: a tiny network on a busy host can have calibration leave a worker out, and the wire
    # is then decided for the one left; this test is about both workers' bf16
    r = subprocess.run([sys.executable, "-m", "hetconv.cli.coordinator", "--spawn", "cpu,cpu", "--threads", "1",
                        "--precision", "bf16", "--use-all", "--metrics", str(metrics), *TINY],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    # bf16 at every call; its layout by timing where a call is big enough (these are not: im2col)
    assert "w0-cpu conv paths (timed where a call is big enough): im2col-bf16 for " in r.stdout
    assert "; precision bf16" in r.stdout
    record = next(json.loads(line) for line in open(metrics) if '"event": "calibration"' in line)
    assert [w["precision"] for w in record["workers"].values()] == ["bf16", "bf16"]
    assert all(says_bf16(w["description"]) for w in record["workers"].values())
    # the wire follows, decided from what calibration found them computing in
    assert ("feature maps and gradients between layers: bfloat16 (every CPU worker's conv GEMMs run bf16 "
            "(w0-cpu, w1-cpu))") in r.stdout
    plan = next(json.loads(line) for line in open(metrics) if '"event": "plan"' in line)
    assert plan["wire"]["workers"] == {w: {"computed": "bf16", "carried": "bfloat16"} for w in ("w0-cpu", "w1-cpu")}


@needs_dnnl
def test_a_bf16_step_rounds_the_same_whatever_the_split():
    """Three shards (each a third of every layer's kernels) train as one shard, to float rounding,
    as in float32: every bf16 rounding is elementwise. And bf16 follows the float32 run closely."""
    from hetconv.engine.local import LocalEngine
    from hetconv.training.loop import train
    tiny = dict(conv="6,12", fc="32", batch_size=32, synthetic_train=400, synthetic_test=64, lr=0.01, threads=1,
                steps=4, eval_batches=1)

    def losses(precision, shards):
        device = open_device("cpu", threads=1, precision=precision)
        engine = LocalEngine({f"s{i}": ConvShard(device) for i in range(shards)})
        return train(Config(**tiny, precision=precision).validate(), engine, log=lambda *_: None)["losses"]

    one = losses("bf16", 1)
    np.testing.assert_allclose(losses("bf16", 3), one, rtol=1e-5)
    fp32 = losses("fp32", 1)
    np.testing.assert_allclose(one, fp32, rtol=2e-2)
    assert one != fp32                          # and it did round: not the float32 run again
