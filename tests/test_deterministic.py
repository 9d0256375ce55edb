"""--deterministic: the same command gives the same bits, --local and with workers, whatever else the
host runs (one of each pair beside a busy process); --plan runs an earlier run's calibrated plan, and
with --deterministic repeats it bit for bit. Real processes: the wisdom, the conv path choice and
the plan are each process's own."""
import json
import sys

import numpy as np
import pytest

from _bf16 import DNNL_MISSING
from conftest import python_cmd
from hetconv.devices.cpu import CpuDevice
from hetconv.training import checkpoint

FLAGS = ("--conv", "6,12", "--fc", "16", "--batch-size", "32", "--synthetic-train", "256", "--synthetic-test", "32",
         "--threads", "1", "--calibration-batch", "4", "--steps", "5", "--seed", "3", "--rebalance-after", "0")


def _run(procs, tmp_path, name, *args, busy=False):
    """One run to its end (beside a busy process where `busy`); returns (losses, final state)."""
    out = tmp_path / name
    spinner = procs([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        p = procs(python_cmd("hetconv.cli.coordinator", *FLAGS, *args, "--metrics", out / "m.jsonl",
                             "--checkpoint-dir", out / "ck"))
        text, _ = p.communicate(timeout=240)
        assert p.returncode == 0, text
    finally:
        if spinner is not None:
            spinner.kill()
    records = [json.loads(line) for line in open(out / "m.jsonl")]
    losses = [r["loss"] for r in records if r["event"] == "step"]
    _, conv, fc = checkpoint.load(str(out / "ck"))
    return records, losses, {f"{i}.{k}": a for i, layer in enumerate(conv + fc) for k, a in layer.items()}


def _assert_same_bits(a, b):
    (_, losses_a, state_a), (_, losses_b, state_b) = a, b
    assert losses_a == losses_b and len(losses_a) == 5
    assert sorted(state_a) == sorted(state_b)
    for key in state_a:
        assert state_a[key].tobytes() == state_b[key].tobytes(), key


def test_the_same_local_command_twice_gives_the_same_bits(procs, tmp_path):
    _assert_same_bits(_run(procs, tmp_path, "a", "--local", "--deterministic"),
                      _run(procs, tmp_path, "b", "--local", "--deterministic", busy=True))


def test_a_calibrated_plan_given_again_or_resumed_runs_and_repeats_bit_for_bit(procs, tmp_path):
    first, _, _ = _run(procs, tmp_path, "calibrated", "--spawn", "cpu:1,cpu:1")
    given = str(tmp_path / "calibrated" / "m.jsonl")
    again = _run(procs, tmp_path, "given", "--spawn", "cpu:1,cpu:1", "--deterministic", "--plan", given)
    twice = _run(procs, tmp_path, "given-busy", "--spawn", "cpu:1,cpu:1", "--deterministic", "--plan", given, busy=True)
    _assert_same_bits(again, twice)

    def plan(records):
        p = next(r for r in records if r["event"] == "plan")
        return p["workers"], [(lp["mode"], lp["kernels"], lp.get("images")) for lp in p["layers"]]

    assert plan(again[0]) == plan(first) and plan(twice[0]) == plan(first)
    assert not any(r["event"] == "calibration" for r in again[0])        # no split was calibrated
    config = next(r for r in again[0] if r["event"] == "config")["config"]
    assert config["deterministic"] and config["plan"] == given
    assert np.isfinite(again[1]).all()
    # the calibrated run resumed onto the same workers runs its checkpoint's plan, calibrating none
    p = procs(python_cmd("hetconv.cli.coordinator", *FLAGS[:-6], "--steps", "7", "--seed", "3", "--rebalance-after",
                         "0", "--spawn", "cpu:1,cpu:1", "--resume", tmp_path / "calibrated" / "ck", "--metrics",
                         tmp_path / "resumed.jsonl"))
    text, _ = p.communicate(timeout=240)
    assert p.returncode == 0 and "the same workers as the checkpoint's: running its plan" in text, text
    resumed = [json.loads(line) for line in open(tmp_path / "resumed.jsonl")]
    assert plan(resumed) == plan(first) and not any(r["event"] == "calibration" for r in resumed)



def test_the_same_bf16_command_twice_gives_the_same_bits_on_the_shifted_path(procs, tmp_path):
    """Under --precision bf16 the rule puts conv2 (16 channels of 5x5 in, 12 kernels) on
    shifted-bf16, as it puts it on shifted in float32: the same bits, one run beside a busy
    process."""
    if DNNL_MISSING:         # on a CPU without bf16 instructions, the emulated GEMMs: the same bits each run
        pytest.skip(f"precision bf16 needs oneDNN: {DNNL_MISSING}")
    # what the rule takes for conv2's shape, as the runs' devices take it (no record: no clock chose)
    device = CpuDevice(threads=1, precision="bf16", deterministic=True)
    device.conv2d(np.ones((2, 16, 14, 14), np.float32), np.ones((12, 16, 5, 5), np.float32), None)
    assert [c["path"] for c in device.conv_path_choices()] == ["shifted-bf16"]
    flags = ("--local", "--deterministic", "--precision", "bf16", "--conv", "16,12")
    _assert_same_bits(_run(procs, tmp_path, "a", *flags), _run(procs, tmp_path, "b", *flags, busy=True))
