"""The wire follows the precision: `--wire-dtype auto` (the default) carries bfloat16 where every
CPU worker computes in bf16 and float32 elsewhere, decided once per plan and recorded with it,
worker by worker; and a distributed bf16 step rounds where --local's bf16 step rounds."""
import json
import os
import sys

import numpy as np
import pytest

from _bf16 import needs_dnnl
from test_data_parallel import KERNELS, NET
from hetconv.cli import coordinator
from hetconv.coordinator.remote import RemoteEngine
from hetconv.devices import open_device
from hetconv.devices.cpu_options import CpuOptions
from hetconv.engine.local import LocalEngine
from hetconv.engine.contract import wire_record
from hetconv.engine.planner import fixed_plan
from hetconv.engine.policy import PlanSettings, wire_for
from hetconv.engine.shard import ConvShard, ShardError, ShardServer
from hetconv.geometry import ConvSpec
from hetconv.training import checkpoint
from hetconv.training.config import Config
from hetconv.training.loop import train
from hetconv.transport.wire import carried_dtype, decode, encode, value_bytes



def quiet(*_):
    pass


# ---- the rule ----------------------------------------------------------------------------------
def test_a_dtype_asked_for_is_the_wire_whatever_the_precision():
    assert wire_for("float16", "bf16") == ("float16", "--wire-dtype float16")
    assert wire_for("float32", "bf16", {"a": ("cpu", "bf16")}) == ("float32", "--wire-dtype float32")


def test_auto_without_a_calibration_follows_the_precision_asked_for():
    assert wire_for("auto", "bf16")[0] == "bfloat16"
    assert wire_for("auto", "fp32") == ("float32", "--precision fp32")
    dtype, why = wire_for("auto", "auto")       # the device decides per layer after the wire is fixed
    assert dtype == "float32" and why.startswith("--precision auto decides per layer as the device runs")


def test_auto_takes_bf16_only_where_every_cpu_worker_computes_in_it():
    dtype, why = wire_for("auto", "auto", {"a": ("cpu", "bf16"), "b": ("cpu", "bf16"), "g": ("cuda:0", "fp32")})
    assert dtype == "bfloat16"
    assert why == "every CPU worker's conv GEMMs run bf16 (a, b); g computes in float32 from what the wire carries"
    dtype, why = wire_for("auto", "auto", {"a": ("cpu", "bf16"), "b": ("cpu", "bf16 on 1 of 2 call shapes")})
    assert (dtype, why) == ("float32", "not every CPU worker computes in bf16: b computes in bf16 on 1 of 2 call shapes")
    assert wire_for("auto", "bf16", {"a": ("cpu", "fp32")})[0] == "float32"      # its own --precision fp32
    assert wire_for("auto", "fp32", {"a": ("cpu", "bf16")})[0] == "bfloat16"     # its own --precision bf16
    assert wire_for("auto", "bf16", {"g": ("cuda:0", "fp32")}) == ("float32",
                                                                    "no CPU worker: GPU kernels compute in float32")


def test_the_default_is_auto_and_a_plans_wire_is_always_a_dtype():
    assert Config().wire_dtype == "auto"
    Config(wire_dtype="auto").validate()
    with pytest.raises(ValueError, match="^a plan's wire must be one of float32, bfloat16, float16, got 'auto'$"):
        carried_dtype("auto")
    with pytest.raises(ValueError, match="got 'auto'"):
        value_bytes("auto")                     # the cost model prices a decided wire, never auto
    spec = ConvSpec.paper(2, 3, 3, 0)
    state = spec.initial_state(np.zeros((3, 2, 3, 3), np.float32))
    names = [a.name for a in spec.state_layout() if a.name in state]
    server = ShardServer(ConvShard(open_device("cpu", threads=1)))
    with pytest.raises(ShardError, match="^LOAD: a plan's wire must be one of float32, bfloat16, float16, got 'auto'$"):
        server.handle("LOAD", [state[n] for n in names], {"layer": 0, "spec": spec.to_json(), "start": 0, "stop": 3,
                                                          "wire": "auto", "optimizer": "sgd", "names": names,
                                                          "bn_ghost_batch": 0})


# ---- engines decide it with the plan -----------------------------------------------------------
SPECS = [ConvSpec.paper(3, 4, 3, 0), ConvSpec.paper(4, 6, 3, 0)]


def test_local_decides_from_the_precision_and_loads_the_plan_with_it():
    for precision, wire in (("fp32", "float32"), ("bf16", "bfloat16")):
        shard = ConvShard(open_device("cpu", threads=1))
        engine = LocalEngine({"local": shard}, wire="auto")
        plan = engine.plan_for(SPECS, [(2, 3, 10, 10), (2, 4, 4, 4)],
                               PlanSettings.of(Config(conv="4,6", precision=precision)))
        engine.load(plan, SPECS, [s.initial_state(np.zeros((s.kernels, s.in_channels, 3, 3), np.float32)) for s in SPECS])
        assert engine.wire == wire
        assert shard.wire == "float32"          # in one process the engine rounds; the shard takes float32
        assert engine.wire_choice["workers"] == {"local": {"computed": precision, "carried": wire}}
    # an engine made with a dtype keeps it, whatever the precision (the API's callers name theirs)
    engine = LocalEngine({"local": ConvShard(open_device("cpu", threads=1))})
    engine.plan_for(SPECS, [(2, 3, 10, 10), (2, 4, 4, 4)], PlanSettings.of(Config(conv="4,6", precision="bf16")))
    assert engine.wire == "float32"


def test_local_rounds_each_map_once_and_its_own_output_not_again(monkeypatch):
    from hetconv.engine import local as local_module
    from hetconv.transport.wire import rounded
    calls = []
    monkeypatch.setattr(local_module, "rounded", lambda a, wire: calls.append(a.shape) or rounded(a, wire))
    shard = ConvShard(open_device("cpu", threads=1))
    engine = LocalEngine({"local": shard}, wire="bfloat16")
    plan = engine.plan_for(SPECS, [(2, 3, 10, 10), (2, 4, 4, 4)], PlanSettings.of(Config(conv="4,6")))
    engine.load(plan, SPECS, [s.initial_state(np.full((s.kernels, s.in_channels, 3, 3), 0.1, np.float32))
                              for s in SPECS])
    x = np.random.default_rng(0).standard_normal((2, 3, 10, 10)).astype(np.float32)
    h = engine.forward(0, x)
    out = engine.forward(1, h)
    assert calls == [x.shape, h.shape, out.shape]       # the images, then each output once: h went back as it came
    assert not h.flags.writeable and not out.flags.writeable
    np.testing.assert_array_equal(h, decode(encode(h.copy(), "bfloat16"), "bfloat16"))
    dh = engine.backward(1, np.ones_like(out), need_dx=True)
    engine.backward(0, dh, need_dx=False)
    assert calls[3:] == [out.shape, h.shape]            # the head's gradient, then dX once: dh went back as it came


def calibrated_engine(computed):
    """A RemoteEngine without workers, holding the calibration of workers that computed in
    `computed` ({name: (device, precision)})."""
    timing = {"batch": 4, "kernels": [4, 2], "forward_s": [0.01, 0.005], "backward_s": [0.02, 0.01]}
    engine = RemoteEngine.__new__(RemoteEngine)
    engine.exchange, engine.wire, engine.mode_choice, engine.micro_choice = "peer", "auto", None, None
    engine.peers = dict.fromkeys(computed)
    engine.log = quiet
    engine.calibration = {w: {"device": device, "precision": precision, "description": "", "speeds": [100.0, 100.0],
                              "layers": [timing, timing]} for w, (device, precision) in computed.items()}
    return engine


def test_the_coordinator_decides_once_the_workers_precision_is_known_and_again_when_it_changes():
    engine = calibrated_engine({"w0": ("cpu", "bf16"), "w1": ("cpu", "bf16"), "g": ("cuda:0", "fp32")})
    said = []
    engine.log = said.append
    settings = PlanSettings.of(Config(conv="4,6", batch_size=4, precision="bf16", parallel="model").validate())
    speeds = {w: [100.0, 100.0] for w in engine.peers}
    engine._plan_from_calibration(SPECS, [(4, 3, 10, 10), (4, 4, 4, 4)], speeds, settings)
    assert engine.wire == "bfloat16" and not said
    assert engine.wire_choice["workers"] == {"w0": {"computed": "bf16", "carried": "bfloat16"},
                                             "w1": {"computed": "bf16", "carried": "bfloat16"},
                                             "g": {"computed": "fp32", "carried": "bfloat16"}}
    # a CPU worker that computes in float32 joins: the next plan's wire is float32, and it is said
    engine.calibration["w2"] = dict(engine.calibration["w0"], precision="fp32")
    engine._plan_from_calibration(SPECS, [(4, 3, 10, 10), (4, 4, 4, 4)], {**speeds, "w2": [100.0, 100.0]}, settings)
    assert engine.wire == "float32"
    assert said == ["feature maps and gradients between layers: float32 from this plan on, was bfloat16 (not every "
                    "CPU worker computes in bf16: w2 computes in fp32)"]


def test_the_plan_record_carries_the_wire_and_what_each_worker_computes_in(tmp_path):
    metrics = tmp_path / "m.jsonl"
    cfg = Config(conv="3,4", fc="8", batch_size=8, synthetic_train=16, synthetic_test=8, steps=1, eval_batches=1,
                 threads=1, metrics=str(metrics)).validate()
    said = []
    train(cfg, LocalEngine({"local": ConvShard(open_device("cpu", threads=1))}, wire="auto"), log=said.append)
    plan = next(json.loads(line) for line in open(metrics) if '"event": "plan"' in line)
    assert plan["wire"] == {"dtype": "float32", "reason": "--precision fp32",
                            "workers": {"local": {"computed": "fp32", "carried": "float32"}}}
    assert not any(line.startswith("feature maps and gradients") for line in said)   # float32 at fp32: nothing new
    assert wire_record(object()) == {}


@needs_dnnl
def test_local_bf16_says_its_wire(capsys, tmp_path):
    metrics = tmp_path / "m.jsonl"
    assert coordinator.main(["--local", "--threads", "1", "--precision", "bf16", "--metrics", str(metrics),
                             "--conv", "3,4", "--fc", "8", "--batch-size", "8", "--synthetic-train", "16",
                             "--synthetic-test", "8", "--steps", "1", "--eval-batches", "1"]) == 0
    out = capsys.readouterr()
    assert ("feature maps and gradients between layers: bfloat16 (--precision bf16: the conv GEMMs take bf16 "
            "operands)") in out.out
    assert "note: --local has no wire" not in out.err
    plan = next(json.loads(line) for line in open(metrics) if '"event": "plan"' in line)
    assert plan["wire"]["workers"] == {"local": {"computed": "bf16", "carried": "bfloat16"}}


# ---- a distributed bf16 step against --local's ---------------------------------------------------
# the distributed tests' network: 12x12 images through conv layers of 4, 6 and 8 kernels
COUNTS = {"w0-cpu": [1, 2, 3], "w1-cpu": [3, 4, 5]}     # a model layer's kernels per worker
IMAGES = {"w0-cpu": 3, "w1-cpu": 7}                     # a data layer's images of a batch per worker


def bf16_config(tmp_path, name, **kw):
    net = tmp_path / "net.json"
    net.write_text(json.dumps(NET))
    return Config(net=str(net), crop=12, batch_size=10, synthetic_train=40, synthetic_test=10, steps=3, lr=0.05,
                  threads=1, rebalance_after=0, micro_batches=2, precision="bf16", checkpoint_dir=str(tmp_path / name),
                  **kw).validate()


def bf16_local(cfg, counts=None):
    """--local's run at bf16, its wire auto: one shard, or one per worker of `counts` (the
    coordinator's sums over a model plan in this process)."""
    device = open_device("cpu", threads=1, precision="bf16")
    names = list(counts or {"local": None})
    engine = LocalEngine({name: ConvShard(device) for name in names}, wire="auto")
    if counts:
        engine.fixed_plan = fixed_plan(KERNELS, counts)
    summary = train(cfg, engine, log=quiet)
    assert engine.wire == "bfloat16"
    return summary["losses"], checkpoint.load(cfg.checkpoint_dir)


def weights_close(got_dir, want, rtol):
    _, conv, fc = checkpoint.load(str(got_dir))
    _, want_conv, want_fc = want
    for got_layer, want_layer in zip(conv + fc, want_conv + want_fc):
        assert sorted(got_layer) == sorted(want_layer)
        for key in want_layer:
            np.testing.assert_allclose(got_layer[key], want_layer[key], rtol=rtol, atol=rtol * 1e-2, err_msg=key)


def assert_bytes_as_priced(metrics, modes):
    """What each worker sent among the workers each step is what the cost model prices on the
    bf16 wire: a model first layer's images gathered in it (they came in it), the data layers'
    weight gradients in float32; the payload, and a header of at most 128 bytes a message."""
    from hetconv.engine.costmodel import DeviceProfile, LayerCost, Link, chain_shape
    from hetconv.engine.steptasks import predict_any
    from hetconv.net.spec import NetSpec
    specs = [ConvSpec.from_layer(layer) for layer in NetSpec.from_json(NET).conv_layers()]
    flat = DeviceProfile("d", "cpu", "", (LayerCost(0.0, 1e-6, 0.0, 1e-6),) * len(specs))
    priced = predict_any("peer", specs, (3, 12, 12), 10, COUNTS, {w: flat for w in COUNTS}, Link(1e9), 0.0, 2,
                         value_bytes("bfloat16"), modes=modes, images={w: [n] * len(specs) for w, n in IMAGES.items()},
                         graph=chain_shape(specs, (3, 12, 12)))
    steps = [r for r in map(json.loads, open(metrics)) if r["event"] == "step"]
    assert steps
    for record in steps:
        for w in COUNTS:
            sent, want = record["workers"][w]["peer_bytes_sent"], priced.workers[w]
            assert want["sent"] <= sent <= want["sent"] + 128 * want["messages"], (w, sent, want)


@needs_dnnl
def test_a_distributed_bf16_step_rounds_where_locals_does(tmp_path):
    """Two bf16 workers and --local at bf16, both with the bf16 wire auto gives them: images, every
    layer's output and gradient are rounded elementwise at each layer boundary in both, so a plan
    whose exchanges only move values (data layers; a model layer whose dX is not needed or goes
    whole to one holder) trains as --local does, to float32 rounding. A model layer above the
    first sums its workers' partial dX after the wire rounded each one, where --local rounds the
    one sum: the same run in this process with the same split (the coordinator summing the
    shards' rounded partials) is what it equals, and --local is near."""
    local_losses, local_ckpt = bf16_local(bf16_config(tmp_path, "local"))
    engine = RemoteEngine("tcp://127.0.0.1:0", 0, ["cpu", "cpu"], threads=1, connect_timeout=60, worker_timeout=10.0,
                          log=quiet, wire="auto", cpu=CpuOptions(precision="bf16", use_wisdom=True))
    try:
        for modes in (["data", "data", "data"], ["model", "data", "data"]):
            name = "-".join(m[0] for m in modes)
            engine.fixed_plan = fixed_plan(KERNELS, COUNTS, modes=modes, images=IMAGES)
            metrics = tmp_path / f"{name}.jsonl"
            summary = train(bf16_config(tmp_path, name, metrics=str(metrics)), engine, log=quiet)
            assert engine.wire == "bfloat16" and engine.plan.modes() == modes
            np.testing.assert_allclose(summary["losses"], local_losses, rtol=1e-5, err_msg=name)
            weights_close(tmp_path / name, local_ckpt, 1e-4)
            assert_bytes_as_priced(metrics, modes)
        engine.fixed_plan = fixed_plan(KERNELS, COUNTS)
        summary = train(bf16_config(tmp_path, "mmm"), engine, log=quiet)
    finally:
        engine.close()
    same_split_losses, same_split_ckpt = bf16_local(bf16_config(tmp_path, "local-split"), COUNTS)
    np.testing.assert_allclose(summary["losses"], same_split_losses, rtol=1e-5)
    weights_close(tmp_path / "mmm", same_split_ckpt, 1e-4)
    # the sums' own rounding: 2.5e-5 of the loss after three steps where this was written
    np.testing.assert_allclose(summary["losses"], local_losses, rtol=1e-3)


# ---- bench/bf16_accuracy.py's verdict ------------------------------------------------------------
def bf16_accuracy_doc(fp32, bf16):
    wire = {"dtype": "bfloat16", "reason": "", "workers": {"w0": {"computed": "bf16", "carried": "bfloat16"}}}
    rows = [{"precision": p, "seed": s, "test_accuracy": a, "test_loss": 0.1, "test_images": 360, "final_loss": 0.1,
             "steps": 10, "epoch_accuracy": [a], "modes": ["data", "model"], "wire": wire, "median_step_s": 0.1,
             "wall_s": 1.0, "foreign_load_cores": 0.0}
            for p, accs in (("fp32", fp32), ("bf16", bf16)) for s, a in enumerate(accs)]
    return {"command": "python bench/bf16_accuracy.py", "machine": "test machine", "wall_s": 60.0, "isa": "avx512_bf16",
            "blas": "test", "gemm": "test", "load": {"start": "load average 0", "end": "load average 0"},
            "recipe": {"net": "lenet5", "data": "tests/data/digits", "spawn": "cpu:1,cpu:1", "batch_size": 32,
                       "epochs": 1, "steps": 10, "lr": 0.02, "momentum": 0.9},
            "data": "digits", "margin": 1.0, "seeds": [0, 1, 2], "rows": rows}


def test_the_bf16_accuracy_verdict_follows_the_medians_and_the_margin():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import bf16_accuracy
    met = bf16_accuracy.markdown(bf16_accuracy_doc([0.95, 0.90, 0.99], [0.945, 0.99, 0.90]))   # medians .95, .945
    assert "fp32 95.00%, bf16 94.50%: -0.50 points** (target: at least -1; met)" in met
    assert "| bf16 | 0 | 94.50 |" in met and "w0 bf16 / bfloat16" in met
    missed = bf16_accuracy.markdown(bf16_accuracy_doc([0.95, 0.90, 0.99], [0.93, 0.99, 0.90]))
    assert "-2.00 points** (target: at least -1; missed)" in missed
