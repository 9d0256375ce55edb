"""--precision auto says per conv layer what ran: one log line (`precision auto: conv1 fp32
(im2col-dnnl), conv2 bf16 (direct-bf16)`) and a "precision" metrics record, after calibration and
after the first step of each plan, where it changed; a call shape maps to its layer by the layer's
shapes, whatever a worker's share of kernels and images. In this process with fake timers and a
fake wisdom (a few seconds), one tiny --local run and one with two spawned workers."""
import json
import subprocess
import sys

import numpy as np
import pytest

from _bf16 import needs_dnnl, needs_instructions
from hetconv.cli import coordinator
from hetconv.devices import open_device
from hetconv.devices import wisdom as W
from hetconv.engine.conv_precision import PrecisionReport, checked_choices, precision_line
from hetconv.engine.local import LocalEngine
from hetconv.engine.shard import ConvShard, ShardServer
from hetconv.geometry import ConvBlock, ConvSpec
from hetconv.training.config import Config
from hetconv.training.loop import train
from hetconv.transport import protocol as P

TINY = ["--conv", "3,4", "--fc", "8", "--batch-size", "8", "--synthetic-train", "16", "--synthetic-test", "8",
        "--steps", "1", "--eval-batches", "1", "--seed", "3"]
# the paper's two layers on 32x32x3 images: conv1 3 -> 6 (5x5, 28x28 out, pooled to 14x14), conv2 6 -> 12
SPECS = [ConvSpec.paper(3, 6), ConvSpec.paper(6, 12)]
SHAPES = [(8, 3, 32, 32), (8, 6, 14, 14)]


def choice(x, w, path, calls=1, block=ConvBlock()):
    """A device's reported choice of one call shape, as CpuDevice.conv_path_choices gives it."""
    return {"call": f"x {x} w {w}", "key": W.call_key(x, w, (1, 1), (0, 0), block), "path": path, "why": "timed",
            "seconds": {}, "calls": calls}


def test_a_call_maps_to_its_layer_whatever_the_share_and_the_devices_differ():
    report = PrecisionReport(SPECS, SHAPES)
    records = report.update({
        # a third of conv1's kernels on half the batch, conv2's whole layer: each maps to its layer
        "w0-cpu": [choice((4, 3, 32, 32), (2, 3, 5, 5), "im2col-dnnl"),
                   choice((8, 6, 14, 14), (12, 6, 5, 5), "direct-bf16")],
        "w1-cpu": [choice((4, 3, 32, 32), (4, 3, 5, 5), "im2col-dnnl"),
                   choice((8, 6, 14, 14), (6, 6, 5, 5), "direct-dnnl"),
                   choice((8, 5, 14, 14), (6, 5, 5, 5), "direct-bf16")],      # no layer of this network
        "w2-cuda": []})                                                        # a GPU: no choices
    assert records == [
        {"layer": "conv1", "precision": "fp32", "paths": {"w0-cpu": ["im2col-dnnl"], "w1-cpu": ["im2col-dnnl"]}},
        {"layer": "conv2", "precision": "mixed", "paths": {"w0-cpu": ["direct-bf16"], "w1-cpu": ["direct-dnnl"]}}]
    assert precision_line(records) == ("precision auto: conv1 fp32 (im2col-dnnl), "
                                       "conv2 bf16 (direct-bf16) on w0-cpu, fp32 (direct-dnnl) on w1-cpu")
    assert precision_line(records, calibration=True).endswith(" on w1-cpu (calibration's call shapes)")


def test_only_what_ran_since_the_counts_is_reported_and_only_where_it_changed():
    report = PrecisionReport(SPECS, SHAPES)
    calibrated = [choice((8, 3, 32, 32), (6, 3, 5, 5), "im2col-dnnl", calls=20),
                  choice((8, 6, 14, 14), (12, 6, 5, 5), "direct-bf16", calls=20),
                  choice((4, 6, 14, 14), (12, 6, 5, 5), "im2col-dnnl", calls=20)]    # half the batch: fp32
    assert precision_line(report.update({"local": calibrated})) == (
        "precision auto: conv1 fp32 (im2col-dnnl), conv2 mixed (direct-bf16/im2col-dnnl)")
    # the step ran the whole batch only: calibration's half-batch call (its count unchanged) is not the step's
    stepped = [dict(c, calls=c["calls"] + (c["key"]["x"][0] == 8)) for c in calibrated]
    assert report.update({"local": stepped}) == [
        {"layer": "conv1", "precision": "fp32", "paths": {"local": ["im2col-dnnl"]}},
        {"layer": "conv2", "precision": "bf16", "paths": {"local": ["direct-bf16"]}}]
    again = [dict(c, calls=c["calls"] + (c["key"]["x"][0] == 8)) for c in stepped]
    assert report.update({"local": again}) is None                  # the same again: nothing to say
    assert report.update({"local": again}) is None                  # nothing ran since
    # two layers of the same shapes run the same paths: a call is counted for each
    twins = PrecisionReport([SPECS[1], SPECS[1]], [SHAPES[1], SHAPES[1]])
    assert [r["layer"] for r in twins.update({"local": calibrated})] == ["conv1", "conv2"]


def test_a_workers_choices_are_checked_before_they_are_read():
    good = choice((8, 3, 32, 32), (6, 3, 5, 5), "im2col-dnnl", calls=3)
    bad_key = {**good, "key": {**good["key"], "x": [8, 3, 32]}}
    bad_calls = {**good, "calls": True}
    kept = checked_choices([good, bad_key, bad_calls, "x"])
    assert kept[0] == good and "key" not in kept[1] and "calls" not in kept[2] and len(kept) == 3
    assert [c["calls"] for c in checked_choices([dict(good, calls=i) for i in range(10)], limit=4)] == [6, 7, 8, 9]
    # a choice without a key (an older worker) says nothing of any layer
    assert PrecisionReport(SPECS, SHAPES).update({"w0": [kept[1]]}) is None


def test_a_fetch_asks_the_choices_and_they_travel():
    device = open_device("cpu", threads=1)
    server = ShardServer(ConvShard(device))
    x, w = np.ones((2, 3, 10, 10), np.float32), np.ones((4, 3, 3, 3), np.float32)
    device.conv2d(x, w, np.zeros(4, np.float32))
    device.conv2d(x, w, np.zeros(4, np.float32))
    op, arrays, fields = server.handle("FETCH", [], {"layer": -1, "conv_paths": True, "conv_path_choices": True})
    assert op == "SHARD" and arrays == [] and "conv_paths" in fields
    (c,) = fields["conv_path_choices"]
    assert c["key"] == W.call_key((2, 3, 10, 10), (4, 3, 3, 3), (1, 1), (0, 0), None) and c["calls"] == 2
    assert P.unpack(P.pack("SHARD", 1, **fields)).fields["conv_path_choices"] == fields["conv_path_choices"]
    with pytest.raises(P.ProtocolError, match="FETCH field 'conv_path_choices' must be"):
        P.check_fields("FETCH", {"layer": -1, "conv_path_choices": 1})


class LayerWisdom:
    """A fake wisdom that says, per call shape, the path its layer runs: bf16 on conv2 only."""

    def lookup(self, machine, call):
        return {"path": "direct-bf16" if json.loads(call)["w"][1] == 6 else "im2col-dnnl"}

    def store(self, machine, call, path, seconds):
        raise AssertionError("nothing is timed where the wisdom knows every call")


TRAIN = dict(conv="6,12", fc="16", batch_size=8, synthetic_train=32, synthetic_test=8, lr=0.01, threads=1, steps=2,
             eval_batches=1)


def trained(precision, device, shards=1, tmp_path=None):
    lines, metrics = [], tmp_path / f"{precision}.jsonl"
    engine = LocalEngine({f"s{i}": ConvShard(device) for i in range(shards)})
    train(Config(**TRAIN, precision=precision, metrics=str(metrics)).validate(), engine, log=lines.append)
    records = [json.loads(line) for line in open(metrics)]
    return lines, [r for r in records if r["event"] == "precision"]


@needs_instructions
def test_local_auto_says_per_layer_what_the_first_step_ran(tmp_path):
    device = open_device("cpu", threads=1, precision="auto", auto_timed_min_flops=0, wisdom=LayerWisdom())
    lines, records = trained("auto", device, tmp_path=tmp_path)
    assert [line for line in lines if line.startswith("precision")] == [
        "precision auto: conv1 fp32 (im2col-dnnl), conv2 bf16 (direct-bf16)"]
    assert records == [{"event": "precision", "step": 1, "calibration": False, "bytes": 0, "layers": [
        {"layer": "conv1", "precision": "fp32", "paths": {"s0": ["im2col-dnnl"]}},
        {"layer": "conv2", "precision": "bf16", "paths": {"s0": ["direct-bf16"]}}]}]


@needs_instructions
def test_a_timed_choice_is_reported_and_shards_of_one_device_agree(tmp_path):
    """A fake timer: direct-bf16 is the fastest everywhere, so every layer runs it."""
    seconds = {"im2col": 1.0, "shifted": 1.2, "fft": 3.0, "im2col-dnnl": 0.9, "im2col-bf16": 0.95,
               "shifted-dnnl": 1.1, "shifted-bf16": 0.97, "direct-dnnl": 0.92, "direct-bf16": 0.3}
    device = open_device("cpu", threads=1, precision="auto", auto_timed_min_flops=0,
                         auto_timer=lambda path, run: seconds[path])
    lines, records = trained("auto", device, shards=2, tmp_path=tmp_path)
    assert "precision auto: conv1 bf16 (direct-bf16), conv2 bf16 (direct-bf16)" in lines
    assert [r["layers"][1]["paths"] for r in records] == [{"s0": ["direct-bf16"], "s1": ["direct-bf16"]}]


def test_fp32_and_bf16_say_nothing_per_layer(tmp_path):
    device = open_device("cpu", threads=1, precision="fp32", auto_timed_min_flops=0, auto_timer=lambda p, run: 1.0)
    lines, records = trained("fp32", device, tmp_path=tmp_path)
    assert records == [] and not any(line.startswith("precision auto") for line in lines)


@needs_dnnl
def test_a_local_run_says_it(capsys, tmp_path):
    metrics = tmp_path / "m.jsonl"
    assert coordinator.main(["--local", "--threads", "1", "--precision", "auto", "--metrics", str(metrics), *TINY]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("precision auto: "))
    (record,) = [json.loads(r) for r in open(metrics) if '"event": "precision"' in r]
    assert [r["layer"] for r in record["layers"]] == ["conv1", "conv2"] and record["step"] == 1
    # these layers are too small to time: float32, by the rule
    assert line == "precision auto: " + ", ".join(f"{r['layer']} fp32 ({r['paths']['local'][0]})"
                                                  for r in record["layers"])


@needs_dnnl
def test_spawned_workers_say_it_after_calibration(tmp_path):
    metrics = tmp_path / "m.jsonl"
    r = subprocess.run([sys.executable, "-m", "hetconv.cli.coordinator", "--spawn", "cpu,cpu", "--threads", "1",
                        "--precision", "auto", "--metrics", str(metrics), *TINY],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "precision auto: conv1 fp32 (" in r.stdout and "(calibration's call shapes)" in r.stdout
    records = [json.loads(line) for line in open(metrics) if '"event": "precision"' in line]
    assert records[0]["calibration"] and records[0]["step"] == 0
    assert set(records[0]["layers"][0]["paths"]) <= {"w0-cpu", "w1-cpu"}     # the plan's (it may leave one out)
    assert all(not r["calibration"] and r["bytes"] > 0 for r in records[1:])
