"""The single-host baseline: one device with the cores of several CPU workers of a host, priced
from its own calibration (fake profiles here: nothing is timed) against the plan that keeps them
apart, in hetconv-plan's table, in the planner and in the coordinator's plan record."""
import json
import types

import numba
import pytest

from hetconv.devices.cpu_options import CpuOptions
from hetconv.engine.costmodel import DeviceProfile, LayerCost, Link
from hetconv.engine.planner import Plan, PlanError, make_plan, price_plan
from hetconv.engine.policy import (CoresTogether, PlanSettings, WorkersPlan, choose_plan, cpu_groups,
                                   price_cores_together)
from hetconv.geometry import conv_specs

PAPER = conv_specs([500, 1500])
IMAGE = (3, 32, 32)
BATCH = 128
# 4 Gbit/s of payload: slow enough that what the split moves shows in its step (at 8, all-data
# hides its weight gradients under compute and the split ties with one device of both cores)
LINK = Link(5e8)


def _profile(name, per_kernel, call_s=0.0):
    """A CPU whose every layer costs `per_kernel` seconds per image and kernel each way, plus
    `call_s` per call whatever its size."""
    cost = LayerCost(0.0, per_kernel, 0.0, per_kernel, call_s, call_s)
    return DeviceProfile(name, "cpu", f"{name}, faked", (cost,) * len(PAPER))


def _two_workers():
    profiles = {"w0": _profile("cpu:1", 1e-6, 0.05), "w1": _profile("cpu:1", 1e-6, 0.05)}
    chosen = choose_plan(PAPER, IMAGE, BATCH, profiles, LINK)
    return chosen.plan, profiles, chosen.micro_batches, chosen.step_s


# ---- the planner -------------------------------------------------------------------------------

def test_cpu_workers_of_one_host_group_and_others_do_not():
    workers = {"a": ("host1", "cpu"), "b": ("host1", "cpu:2"), "c": ("host2", "cpu"), "g": ("host1", "cuda:0"),
               "d": ("", "cpu"), "e": ("", "cpu")}
    assert cpu_groups(workers) == {"host1": ["a", "b"]}
    assert cpu_groups({"a": ("host1", "cpu")}) == {}


def test_one_device_with_both_cores_is_noted_where_it_is_priced_faster():
    plan, profiles, micro, step_s = _two_workers()
    assert list(plan.workers) == ["w0", "w1"]
    assert price_plan(PAPER, IMAGE, BATCH, plan, profiles, LINK, micro_batches=micro) == pytest.approx(step_s)
    # two threads at twice one's speed, and one call where the split pays two
    scaling = _profile("cpu:2", 0.5e-6, 0.05)
    priced = price_cores_together(PAPER, IMAGE, BATCH, plan, profiles, scaling, 2, ["w0", "w1"], LINK,
                                  plan_micro_batches=micro)
    assert priced.alone and priced.workers == ("w0", "w1") and priced.device == "cpu:2"
    assert priced.plan_step_s == pytest.approx(step_s)
    assert priced.step_s < priced.plan_step_s and priced.faster()
    note = priced.note()
    assert note.startswith("note: one worker with the 2 cores of w0, w1 together (cpu:2) is priced "
                           f"{priced.ratio:.2f}x this plan's step")
    assert note.endswith("--spawn cpu:2 or --local --threads 2") and "\n" not in note
    assert priced.to_json()["note"] == note and priced.to_json()["ratio"] == pytest.approx(priced.ratio)


def test_no_note_where_one_device_is_priced_no_faster():
    plan, profiles, micro, _ = _two_workers()
    # the second thread adds little: the split's two cores win
    poor = _profile("cpu:2", 0.95e-6, 0.05)
    priced = price_cores_together(PAPER, IMAGE, BATCH, plan, profiles, poor, 2, ["w0", "w1"], LINK,
                                  plan_micro_batches=micro)
    assert priced.step_s > priced.plan_step_s and not priced.faster()
    assert priced.note() == "" and "note" not in priced.to_json()
    # within the cost model's error it is no news either
    close = CoresTogether("cpu:2", 2, ("w0", "w1"), 0.99, 1.0, alone=True)
    assert close.note() == "" and CoresTogether("cpu:2", 2, ("w0", "w1"), 0.9, 1.0, alone=True).note()


def test_workers_elsewhere_stay_in_the_plan_with_one_device_in_the_place_of_a_hosts_cpus():
    profiles = {"w0": _profile("cpu:1", 1e-6, 0.05), "w1": _profile("cpu:1", 1e-6, 0.05),
                "far": _profile("cpu", 1e-6, 0.05)}
    chosen = choose_plan(PAPER, IMAGE, BATCH, profiles, LINK)
    plan, micro = chosen.plan, chosen.micro_batches
    priced = price_cores_together(PAPER, IMAGE, BATCH, plan, profiles, _profile("cpu:2", 0.3e-6, 0.05), 2,
                                  ["w0", "w1"], LINK, plan_micro_batches=micro, host="box")
    assert not priced.alone and priced.faster()
    assert "(cpu:2 on box) in their place" in priced.note()
    assert priced.note().endswith("run one hetconv-worker --device cpu:2 there instead")
    with pytest.raises(PlanError, match="two or more of the plan's, got \\['w0'\\]"):
        price_cores_together(PAPER, IMAGE, BATCH, plan, profiles, _profile("cpu:2", 0.3e-6), 2, ["w0", "gone"], LINK)


def test_the_plan_keeps_what_was_priced_through_json():
    plan = make_plan([4, 8], {"a": [1.0, 1.0], "b": [1.0, 1.0]})
    assert "cores_together" not in plan.to_json()
    record = CoresTogether("cpu:2", 2, ("a", "b"), 1.0, 2.0, alone=True).to_json()
    noted = Plan.from_json(json.loads(json.dumps(
        {**plan.to_json(), "cores_together": record})))
    assert noted.cores_together == record and noted.to_json()["cores_together"]["note"].startswith("note: ")
    with pytest.raises(PlanError, match="not a stored plan"):
        Plan.from_json({**plan.to_json(), "cores_together": 5})


# ---- hetconv-plan --------------------------------------------------------------------------------

def _run_plan(monkeypatch, capsys, together_per_kernel, *extra):
    """hetconv-plan --devices cpu:1x2 with calibration faked: one thread's profile at its share and
    on the whole layers, and cpu:2's at `together_per_kernel`."""
    from hetconv.cli import plan as plan_cli
    calls = []

    def fake_rounds(runs, specs, input_shapes, **options):
        calls.append([(device, threads) for device, threads, _ in runs])
        return [_profile(f"cpu:{threads}", together_per_kernel if threads == 2 else 1e-6, 0.05)
                for device, threads, _ in runs]

    monkeypatch.setattr(plan_cli, "calibrate_rounds", fake_rounds)
    monkeypatch.setattr(plan_cli, "measure_coordinator_s", lambda *a, **kw: 0.01)
    monkeypatch.setattr(plan_cli, "usable_cores", lambda: 2)
    # every device on this host: the one device is priced in their place over loopback, as the coordinator prices it
    monkeypatch.setattr(plan_cli, "measure_loopback", lambda: 20e9)
    code = plan_cli.main(["--devices", "cpu:1x2", "--net", "paper", "--batch-size", str(BATCH), "--link", "20GB",
                          *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    # one round of calibrations: the one thread at its share and whole, and the two cores whole
    assert calls == [[("cpu", 1), ("cpu", 1), ("cpu", 2)]]
    return out


def test_hetconv_plan_shows_both_baselines_and_prices_against_the_stronger(monkeypatch, capsys):
    out = _run_plan(monkeypatch, capsys, 0.4e-6)
    lines = out.splitlines()
    one = next(line for line in lines if line.startswith("single-device baseline cpu:1:"))
    two = next(line for line in lines if line.startswith("single-device baseline cpu:2:"))
    assert "against this one" in two and "against this one" not in one
    assert "one device with the 2 cores the CPU devices use together" in two
    note = [line for line in lines if line.startswith("note: ")]
    assert len(note) == 1 and note[0].endswith("--spawn cpu:2 or --local --threads 2"), out
    data = json.loads(_run_plan(monkeypatch, capsys, 0.4e-6, "--json"))
    assert [b["device"] for b in data["baselines"]] == ["cpu:1", "cpu:2"] and data["speedup_against"] == "cpu:2"
    stronger = data["baselines"][1]["step_s"]
    assert stronger < data["baselines"][0]["step_s"]
    for row in data["rows"]:
        assert row["speedup"] == pytest.approx(stronger / row["step_s"])
        assert row["efficiency"] == pytest.approx(row["speedup"] / len(row["devices"]))
    assert data["note"] == note[0]


def test_hetconv_plan_notes_nothing_where_the_split_is_faster(monkeypatch, capsys):
    out = _run_plan(monkeypatch, capsys, 0.95e-6)
    assert "single-device baseline cpu:2:" in out and "note: one worker" not in out
    data = json.loads(_run_plan(monkeypatch, capsys, 2e-6, "--json"))
    # two cores priced slower than one (a loaded host): the one-thread device is the one to beat
    assert data["speedup_against"] == "cpu:1" and data["note"] == ""


def test_hetconv_plan_has_one_baseline_where_one_device_has_every_core(monkeypatch, capsys):
    from hetconv.cli import plan as plan_cli

    def fake_rounds(runs, specs, input_shapes, **options):
        assert [threads for _, threads, _ in runs] == [2]
        return [_profile("cpu:2", 1e-6, 0.01)]

    monkeypatch.setattr(plan_cli, "calibrate_rounds", fake_rounds)
    monkeypatch.setattr(plan_cli, "measure_coordinator_s", lambda *a, **kw: 0.01)
    monkeypatch.setattr(plan_cli, "usable_cores", lambda: 2)
    assert plan_cli.main(["--devices", "cpu:2", "--net", "paper", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [b["device"] for b in data["baselines"]] == ["cpu:2"] and data["note"] == ""


# ---- the coordinator ---------------------------------------------------------------------------

def _coordinator(monkeypatch, together_per_kernel, calibration_s=1.0, hosts=("here", "here")):
    """A RemoteEngine's state as plan_for leaves it after calibrating two one-thread CPU workers,
    this process's calibration of their cores together faked (None: it fails)."""
    from hetconv.engine import calibrated
    from hetconv.training.config import Config
    monkeypatch.setattr(calibrated, "host_key", lambda: "here")
    monkeypatch.setattr(calibrated, "usable_cores", lambda: 2)
    monkeypatch.setattr(calibrated, "measure_loopback", lambda: 20e9)
    asked = []

    def fake_calibrate(device, specs, shapes, kernels, threads=None, **options):
        asked.append((device, threads, list(kernels)))
        if together_per_kernel is None:
            raise MemoryError("no room")
        return _profile(f"cpu:{threads}", together_per_kernel, 0.05)

    monkeypatch.setattr(calibrated, "calibrate_local", fake_calibrate)
    logged = []
    peers = {w: types.SimpleNamespace(host_key=h, device="cpu", threads=1, host="box") for w, h in zip(("w0", "w1"), hosts)}
    one = _profile("cpu:1", 1e-6, 0.05)
    calibration = {w: {"device": "cpu", "description": "", "speeds": [1.0, 1.0],
                       "layers": [{"forward": [[1, 1, 1.0]], "backward": [[1, 1, 1.0]]}]} for w in peers}
    monkeypatch.setattr(calibrated, "profiles_from_calibration", lambda cal: {w: one for w in cal})
    chosen = choose_plan(PAPER, IMAGE, BATCH, {"w0": one, "w1": one}, LINK)
    plan = chosen.plan
    planned = WorkersPlan(chosen, LINK, LINK, "float32", "--wire-dtype float32", {w: ("cpu", "fp32") for w in peers})
    engine = types.SimpleNamespace(peers=peers, calibration=calibration, calibration_s=calibration_s,
                                   workers_plan=planned, exchange="peer", wire="float32", cpu=CpuOptions(),
                                   log=logged.append, _graph_shape=lambda: None)
    cfg = Config(net="paper", batch_size=BATCH, link="1gbit").validate()
    shapes = [(BATCH,) + IMAGE, (BATCH, 500, 14, 14)]
    got = calibrated.CalibratedEngine._price_cores_together(engine, plan, PAPER, shapes, PlanSettings.of(cfg))
    return got, logged, asked


def test_the_coordinator_logs_and_records_one_device_priced_faster(monkeypatch):
    plan, logged, asked = _coordinator(monkeypatch, 0.4e-6)
    assert asked == [("cpu", 2, [500, 1500])]
    record = plan.cores_together
    assert record["device"] == "cpu:2" and record["workers"] == ["w0", "w1"] and record["ratio"] < 1
    assert record["note"] in logged and record["note"].endswith("--spawn cpu:2 or --local --threads 2")
    assert plan.to_json()["cores_together"] == record


def test_the_coordinator_records_without_a_note_where_the_split_is_faster(monkeypatch):
    plan, logged, _ = _coordinator(monkeypatch, 0.95e-6)
    assert plan.cores_together["ratio"] > 1 and "note" not in plan.cores_together
    assert not [line for line in logged if line.startswith("note:")]
    assert logged[-1].startswith("one worker with the 2 cores of w0, w1 together (cpu:2) is priced ")
    assert logged[-1].endswith(": the plan stands")


def test_the_coordinator_prices_nothing_it_cannot_calibrate_cheaply_or_at_all(monkeypatch):
    plan, logged, asked = _coordinator(monkeypatch, 0.5e-6, calibration_s=1e6)
    assert asked == [] and "would cost more than 50 of this plan's steps" in plan.cores_together["not_priced"]
    plan, logged, asked = _coordinator(monkeypatch, 0.5e-6, hosts=("here", "elsewhere"))
    assert asked == [] and plan.cores_together == {}


def test_the_coordinator_goes_on_where_that_calibration_fails(monkeypatch):
    plan, logged, asked = _coordinator(monkeypatch, None)
    assert asked and plan.cores_together["not_priced"] == "MemoryError: no room"
    assert logged[-1] == "one worker with the cores of w0, w1 together not priced: MemoryError: no room"


# ---- calibration in this process ----------------------------------------------------------------

def test_calibration_rounds_time_a_device_per_thread_count_and_give_the_threads_back(monkeypatch):
    from hetconv.engine import shard
    from hetconv.engine.measure import calibrate_rounds
    monkeypatch.setattr(shard, "CALIBRATION_FLOOR_S", 0.01)     # what is timed is not read here: be quick
    from hetconv.geometry import layer_input_shapes
    specs = conv_specs([4, 4])
    shapes, _ = layer_input_shapes(specs, 2, IMAGE)
    before = numba.get_num_threads()
    one, whole, two = calibrate_rounds([("cpu", 1, [2, 2]), ("cpu", 1, [4, 4]), ("cpu", 2, [4, 4])], specs, shapes,
                                       repeats=1, cpu=CpuOptions(conv_path="im2col"))
    assert numba.get_num_threads() == before
    assert (one.name, whole.name, two.name) == ("cpu:1", "cpu:1", "cpu:2")
    assert "(1 thread," in one.description and "(2 threads," in two.description
    assert all(layer.forward_per_kernel_s >= 0 and layer.backward_s(4, 2) > 0 for layer in two.layers)


# ---- bench/speedup.py ----------------------------------------------------------------------------

def _speedup_bench():
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import speedup
    return speedup


@pytest.mark.parametrize("two_threads_s,against", [(2.1, "local 2 threads"), (4.5, "local")])
def test_the_speedup_bench_divides_by_the_faster_single_device_of_each_batch(two_threads_s, against):
    speedup = _speedup_bench()

    def row(name, step_s, devices=("cpu",), batch=128):
        return {"ok": True, "set": name, "devices": list(devices), "batch_size": batch, "split": "equal",
                "step_s": step_s, "predicted_step_s": step_s * 1.1, "model_error_pct": 10.0, "calibration_s": 1.0,
                "setup_s": 1.0, "foreign_load_cores": 0.0, "step_s_all": [step_s]}

    rows = [row("local", 4.0), row("local 2 threads", two_threads_s), row("2 workers", 2.5, ("cpu", "cpu")),
            row("local", 1.0, batch=32), row("2 workers", 0.8, ("cpu", "cpu"), batch=32)]
    speedup.add_speedups(rows)
    best = min(4.0, two_threads_s)
    workers = rows[2]
    assert workers["speedup_against"] == against and workers["speedup"] == pytest.approx(best / 2.5)
    assert workers["efficiency"] == pytest.approx(best / 2.5 / 2)
    assert workers["predicted_speedup"] == pytest.approx(best / 2.5)
    assert workers["speedup_1core"] == pytest.approx(4.0 / 2.5)
    assert rows[4]["speedup_against"] == "local" and rows[4]["speedup"] == pytest.approx(1.25)   # no 2-thread row
    table = speedup.markdown({"machine": "test", "command": "test", "wall_s": 60.0, "load": {}, "rows": rows})
    line = next(line for line in table.splitlines() if line.startswith("| 2 workers | 128 |"))
    assert f"| {best / 2.5:.2f}x | {against} | 1.60x |" in line


def test_the_speedup_bench_runs_the_two_thread_baseline_beside_the_one_core_one():
    speedup = _speedup_bench()
    args = types.SimpleNamespace(gpu="", batch_sizes=[32, 128], quick=True)
    runs = {(r["set"], r["batch_size"]): r for r in speedup.plan_runs(args)}
    two = runs[("local 2 threads", 128)]
    assert two["local"] and two["threads"] == 2 and two["pin"] is None and two["devices"] == ["cpu"]
    assert runs[("local", 128)]["threads"] == 1 and runs[("local", 128)]["pin"] == [0]
    assert not runs[("2 workers", 128)]["local"]


def test_the_fft_table_takes_the_faster_pytorch_row_of_each_round_in_either_layout():
    speedup = _speedup_bench()
    configs = [name for name, _ in speedup.FFT_CONFIGS]
    assert "PyTorch 2 threads (NCHW)" in configs and "PyTorch 2 threads (channels_last)" in configs
    assert dict(speedup.FFT_CONFIGS)["PyTorch DDP 2x1 thread"].get("layout") is None      # DDP as it runs by default
    steps = {"hetconv shifted": (1.0, 1.0), "hetconv im2col": (1.2, 1.2), "hetconv auto": (1.0, 0.9),
             "PyTorch 2 threads (NCHW)": (1.5, 1.4), "PyTorch 2 threads (channels_last)": (1.2, 1.6),
             "PyTorch DDP 2x1 thread": (2.0, 2.0)}
    rows = [{"ok": True, "config": c, "round": rnd, "batch_size": 128, "step_s": s, "step_s_all": [s],
             "warmup_step_s": [s], "foreign_load_cores": 0.0, "load_after": ""}
            for c, per in steps.items() for rnd, s in enumerate(per)]
    doc = {"mode": "fft", "machine": "test", "command": "test", "wall_s": 60.0, "load": {}, "warmup": 1, "steps": 1,
           "batch_sizes": [128], "configs": list(steps), "direct": list(speedup.DIRECT), "rows": rows}
    text = speedup.markdown(doc)
    auto = [r for r in rows if r["config"] == "hetconv auto"]
    speedup.add_fft_ratios(rows)
    assert [r["torch_config"] for r in auto] == ["PyTorch 2 threads (channels_last)", "PyTorch 2 threads (NCHW)"]
    assert "PyTorch's faster layout in one process: PyTorch 2 threads: channels_last the faster (1.400 s; NCHW " \
           "1.450 s)." in text
