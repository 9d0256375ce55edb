"""Data-parallel conv layers in the peer step: real worker processes on loopback. Any plan of
modes (every layer data, data then model, model then data then model), with uneven image shares
and micro-batches, trains exactly as --local does up to float rounding; a checkpoint gathered
from a data plan holds --local's weights; and the block exchange between layers gives every
worker exactly the input it needs."""
import json
import queue

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from _faults import join_during_step, kill_worker_on_step
from hetconv.coordinator.remote import RemoteEngine
from hetconv.devices import open_device
from hetconv.engine.local import LocalEngine
from hetconv.engine.planner import LayerPlan, PlanError, fixed_plan
from hetconv.engine.policy import PlanSettings
from hetconv.engine.shard import ConvShard
from hetconv.training import checkpoint
from hetconv.training.config import Config
from hetconv.training.loop import train
from hetconv.transport import protocol as P
from hetconv.engine.layouts import (ROWS, WHOLE, concatenated, contains, covered, index_in, meeting, pieces,
                                    pieces_shape)
from hetconv.engine.planner import image_ranges

# 12x12 images through three conv layers of 4, 6 and 8 kernels: 12 -> 6 -> 3 -> 3
NET = {"input_shape": [3, 12, 12], "classes": 10, "layers": [
    {"type": "conv", "out_channels": 4, "kernel": 3, "padding": 1}, {"type": "relu"}, {"type": "maxpool", "kernel": 2},
    {"type": "conv", "out_channels": 6, "kernel": 3, "padding": 1}, {"type": "relu"}, {"type": "maxpool", "kernel": 2},
    {"type": "conv", "out_channels": 8, "kernel": 3, "padding": 1}, {"type": "relu"},
    {"type": "flatten"}, {"type": "linear", "out_features": 10}]}
KERNELS = [4, 6, 8]
BATCH = 10


def quiet(*_):
    pass


def config(tmp_path, name, **kw):
    net = tmp_path / "net.json"
    net.write_text(json.dumps(NET))
    fields = dict(net=str(net), crop=12, batch_size=BATCH, synthetic_train=60, synthetic_test=20, steps=3, lr=0.05,
                  threads=1, rebalance_after=0, use_all=True, checkpoint_dir=str(tmp_path / name))
    return Config(**{**fields, **kw}).validate()


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("local")
    summary = train(config(d, "ck"), LocalEngine({"local": ConvShard(open_device("cpu", threads=1))}), log=quiet)
    return summary["losses"], checkpoint.load(str(d / "ck"))


def remote(n, **kw):
    return RemoteEngine("tcp://127.0.0.1:0", 0, ["cpu"] * n, threads=1, connect_timeout=60, log=quiet,
                        worker_timeout=10.0, **kw)


def assert_equals_local(local_run, losses, ckdir):
    local_losses, (_, local_conv, local_fc) = local_run
    np.testing.assert_allclose(losses, local_losses, rtol=1e-5)
    _, conv, fc = checkpoint.load(str(ckdir))
    for got, want in zip(conv + fc, local_conv + local_fc):
        assert sorted(got) == sorted(want)                  # w, b and both momenta, every layer
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-6)


# kernels per worker for the model layers (a data layer's entry is not read), images per worker
TWO = {"w0-cpu": [1, 2, 3], "w1-cpu": [3, 4, 5]}
THREE = {"w0-cpu": [1, 1, 2], "w1-cpu": [2, 3, 1], "w2-cpu": [1, 2, 5]}
IMAGES2 = {"w0-cpu": 3, "w1-cpu": 7}
IMAGES3 = {"w0-cpu": 2, "w1-cpu": 5, "w2-cpu": 3}


@pytest.mark.parametrize("counts,images,modes,micro", [
    (TWO, IMAGES2, ["data", "data", "data"], 1),
    (TWO, IMAGES2, ["data", "data", "model"], 4),
    (THREE, IMAGES3, ["model", "data", "model"], 1),
    (THREE, IMAGES3, ["data", "data", "model"], 4),
    (TWO, IMAGES2, ["model", "data", "data"], 4),
], ids=["2w-all-data-m1", "2w-data-data-model-m4", "3w-model-data-model-m1", "3w-data-data-model-m4",
        "2w-model-data-data-m4"])
def test_data_parallel_plans_train_like_local(local_run, tmp_path, counts, images, modes, micro):
    """Uneven image shares (with 4 micro-batches of 2-3 images some workers get none of one):
    losses, weights and momenta as --local's, so every worker's data layer took the same update.
    The chain runs through the one peer step (each tensor in its layout between the workers), and
    what each worker sends among them is what the layout step's cost model prices for the chain
    taken as a graph: the payload, and a header of at most 128 bytes a message."""
    from hetconv.engine.costmodel import DeviceProfile, LayerCost, Link
    from hetconv.engine.steptasks import predict_any
    from hetconv.engine.costmodel import chain_shape
    from hetconv.geometry import ConvSpec
    from hetconv.net.spec import NetSpec
    engine = remote(len(counts))
    metrics = tmp_path / "m.jsonl"
    try:
        engine.fixed_plan = fixed_plan(KERNELS, counts, modes=modes, images=images)
        summary = train(config(tmp_path, "ck", micro_batches=micro, metrics=str(metrics)), engine, log=quiet)
        assert engine.plan.modes() == modes
        for lp in engine.plan.layers:                # every worker holds a data layer's same weights
            if lp.mode == "data":
                replies = engine._call({w: ("FETCH", [], {"layer": lp.layer}) for w in engine.plan.workers}, "test")
                first = replies[engine.plan.workers[0]][0]
                for w in engine.plan.workers[1:]:
                    for a, b in zip(replies[w][0], first):
                        np.testing.assert_array_equal(a, b)
    finally:
        engine.close()
    assert_equals_local(local_run, summary["losses"], tmp_path / "ck")
    spec = NetSpec.from_json(NET)
    specs = [ConvSpec.from_layer(layer) for layer in spec.conv_layers()]
    flat = DeviceProfile("d", "cpu", "", (LayerCost(0.0, 1e-6, 0.0, 1e-6),) * len(specs))
    priced = predict_any("peer", specs, (3, 12, 12), BATCH, counts, {w: flat for w in counts}, Link(1e9), 0.0, micro,
                         modes=modes, images={w: [n] * len(specs) for w, n in images.items()},
                         graph=chain_shape(specs, (3, 12, 12)))
    steps = [r for r in map(json.loads, open(metrics)) if r["event"] == "step"]
    assert len(steps) == 3
    for record in steps:
        for w in counts:
            sent, want = record["workers"][w]["peer_bytes_sent"], priced.workers[w]
            assert want["sent"] <= sent <= want["sent"] + 128 * want["messages"], (w, sent, want)


def test_star_refuses_data_layers_in_one_line(procs, tmp_path):
    from conftest import python_cmd
    net = tmp_path / "net.json"
    net.write_text(json.dumps(NET))
    p = procs(python_cmd("hetconv.cli.coordinator", "--spawn", "cpu,cpu", "--net", net, "--crop", "12",
                         "--batch-size", "8", "--steps", "1", "--synthetic-train", "16", "--synthetic-test", "8",
                         "--parallel", "data", "--exchange", "star", "--threads", "1"))
    out, _ = p.communicate(timeout=60)
    assert p.returncode != 0
    lines = [line for line in out.splitlines() if "--exchange" in line]
    assert lines and "--parallel data" in lines[0] and "peer" in lines[0], out
    assert "Traceback" not in out


@st.composite
def layer_plans(draw):
    """Two consecutive layers of 1-4 workers, each model or data, and a micro-batch size."""
    workers = [f"w{i}" for i in range(draw(st.integers(1, 4)))]
    n = draw(st.integers(1, 9))
    plans = []
    for li in range(2):
        kernels = draw(st.integers(len(workers), 9))
        if draw(st.booleans()):
            images = {w: draw(st.integers(0, 5)) for w in workers}
            if not sum(images.values()):
                images[workers[0]] = 1
            plans.append(LayerPlan(li, kernels, {w: (0, kernels) for w in workers}, {}, "data", images))
        else:
            cuts = sorted(draw(st.lists(st.integers(1, kernels - 1), min_size=len(workers) - 1,
                                        max_size=len(workers) - 1, unique=True))) if len(workers) > 1 else []
            bounds = [0] + cuts + [kernels]
            plans.append(LayerPlan(li, kernels, {w: (bounds[i], bounds[i + 1]) for i, w in enumerate(workers)}))
    return workers, plans, n


LAYOUT_KINDS = ("whole", "rows", "channels")


@settings(max_examples=300, deadline=None)
@given(layer_plans(), st.sampled_from(LAYOUT_KINDS), st.sampled_from(LAYOUT_KINDS), st.booleans())
def test_each_worker_gets_exactly_its_blocks_of_a_layout_from_the_holders(case, have, want, joined):
    """A tensor between any two layouts (a worker's rows, its channel ranges of one model block or
    of two concatenated, the whole): the parts every holder sends a receiver lie in what the
    sender holds and cover the receiver's blocks exactly once, each addressed inside both arrays;
    a receiver whose blocks its own cover is sent nothing it lacks."""
    workers, plans, n = case
    model = [b for b, lp in enumerate(plans) if lp.mode != "data"]
    data = [lp for lp in plans if lp.mode == "data"]
    assume(model or "channels" not in (have, want))
    blocks = (tuple(model) + tuple(model[:1]) if joined else tuple(model[:1])) if model else ()
    channels = sum(plans[b].kernels for b in blocks) if blocks else plans[0].kernels
    in_ranges = (concatenated(blocks) if len(blocks) > 1 else ("channels", blocks[0])) if blocks else None
    rows = image_ranges(data[0], n) if data else {w: (0, n) if i == 0 else (n, n) for i, w in enumerate(workers)}

    def held(kind):
        layout = {"whole": WHOLE, "rows": ROWS, "channels": in_ranges}[kind]
        return {w: pieces(layout, n, channels, rows[w], lambda b: plans[b].ranges[w], lambda b: plans[b].kernels)
                for w in workers}

    hb, wb = held(have), held(want)
    for receiver in workers:
        need = wb[receiver]
        if have == "whole":
            assert covered(hb[receiver], need)          # its own copy: nothing moves
            continue
        cover = np.zeros((n, channels), int)
        for sender in workers:
            parts = meeting(hb[sender], need)
            if covered(hb[receiver], need) and sender != receiver:
                assert not parts
            for part, i, k in parts:
                for blocks_held, j in ((hb[sender], i), (need, k)):
                    assert contains(blocks_held[j], part)
                    rs, cs = index_in(part, blocks_held, j)
                    rows_held, channels_held = pieces_shape(blocks_held)
                    assert 0 <= rs.start < rs.stop <= rows_held and 0 <= cs.start < cs.stop <= channels_held
                    assert (rs.stop - rs.start, cs.stop - cs.start) == (part[1] - part[0], part[3] - part[2])
                cover[part[0]:part[1], part[2]:part[3]] += 1
        for r0, r1, c0, c1 in need:
            assert (cover[r0:r1, c0:c1] == 1).all()
        assert cover.sum() == sum((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in need)


def test_a_data_plan_is_refused_by_the_star_engine():
    engine = LocalEngine({"a": ConvShard(open_device("cpu", threads=1)), "b": ConvShard(open_device("cpu", threads=1))})
    plan = fixed_plan([4], {"a": [2], "b": [2]}, modes=["data"], images={"a": 1, "b": 1})
    with pytest.raises(PlanError, match="--exchange peer"):
        engine.load(plan, [], [])


def test_parallel_data_is_planned_from_calibration_and_survives_a_lost_worker(tmp_path):
    """--parallel data over calibrated workers: every layer data, the choice in the metrics'
    plan record; a worker killed mid-run is re-planned away (still all data) and the run still
    equals --local's."""
    local = train(config(tmp_path, "local", steps=6), LocalEngine({"local": ConvShard(open_device("cpu", threads=1))}),
                  log=quiet)
    metrics = tmp_path / "m.jsonl"
    engine = remote(3)
    kill_worker_on_step(engine, 1, at_step=4)             # snapshots after steps 2 and 4: steps 3 (and 4) replay
    try:
        summary = train(config(tmp_path, "ck", steps=6, parallel="data", snapshot_every=2, calibration_batch=4,
                               metrics=str(metrics)), engine, log=quiet)
        survivors, modes = list(engine.plan.workers), engine.plan.modes()
    finally:
        engine.close()
    assert survivors == ["w0-cpu", "w2-cpu"] and modes == ["data"] * 3
    plans = [json.loads(line) for line in open(metrics) if '"event": "plan"' in line]
    assert plans[0]["mode_choice"]["modes"] == ["data"] * 3 and plans[0]["mode_choice"]["reason"] == "--parallel data"
    assert [layer["mode"] for layer in plans[-1]["layers"]] == ["data"] * 3 and plans[-1]["reason"] == "lost w1-cpu"
    assert plans[-1]["wire"]["workers"] == {w: {"computed": "fp32", "carried": "float32"} for w in survivors}
    np.testing.assert_allclose(summary["losses"], local["losses"], rtol=1e-4)
    assert_equals_local((local["losses"], checkpoint.load(str(tmp_path / "local"))), summary["losses"], tmp_path / "ck")


def test_a_chain_of_modes_is_planned_from_calibration_and_trains_like_local(local_run, tmp_path):
    """--parallel DMD: each layer in the mode its letter forces, the data layers' images split
    by calibration, the chain and its price in the plan record; the run equals --local's."""
    metrics = tmp_path / "m.jsonl"
    engine = remote(2)
    try:
        summary = train(config(tmp_path, "ck", parallel="DMD", calibration_batch=4, metrics=str(metrics)), engine,
                        log=quiet)
        modes = engine.plan.modes()
    finally:
        engine.close()
    assert modes == ["data", "model", "data"]
    plan = next(json.loads(line) for line in open(metrics) if '"event": "plan"' in line)
    assert plan["mode_choice"]["modes"] == modes and plan["mode_choice"]["reason"] == "--parallel DMD"
    assert sum(plan["layers"][0]["images"].values()) == BATCH
    assert_equals_local(local_run, summary["losses"], tmp_path / "ck")


@pytest.mark.parametrize("wire", ["bfloat16", "float16"])
def test_a_16_bit_wire_with_data_layers_trains_like_float32(local_run, tmp_path, wire):
    """Feature maps between a data and a model layer (and the last layer's features) cross the
    wire in 16 bits; a data layer's dW all-gather stays float32, so every worker's copy of it is
    the same: the run stays close to --local's, not equal."""
    engine = remote(2, wire=wire)
    try:
        summary = train(config(tmp_path, "ck", parallel="DMD", wire_dtype=wire, calibration_batch=4), engine,
                        log=quiet)
        modes = engine.plan.modes()
        replies = engine._call({w: ("FETCH", [], {"layer": 2}) for w in engine.plan.workers}, "test")
    finally:
        engine.close()
    assert modes == ["data", "model", "data"]
    np.testing.assert_allclose(summary["losses"], local_run[0], rtol=2e-2)
    assert not np.allclose(summary["losses"], local_run[0], rtol=1e-7, atol=0), "a 16-bit wire cannot be exact"
    first, second = (replies[w][0] for w in engine.plan.workers)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


def test_a_worker_that_joins_a_data_plan_gets_its_share_of_the_images(local_run, tmp_path, procs):
    """A worker connecting mid-run under --parallel data joins at a snapshot: the plan is made
    again over three workers, every layer still data, the batch split three ways, and the run
    equals --local's."""
    metrics = tmp_path / "m.jsonl"
    engine = remote(2)
    join_during_step(engine, procs, 2)                   # its HELLO arrives while step 2 runs
    try:
        summary = train(config(tmp_path, "ck", parallel="data", snapshot_every=1, calibration_batch=4,
                               metrics=str(metrics)), engine, log=quiet)
        workers, modes = list(engine.plan.workers), engine.plan.modes()
        images = dict(engine.plan.layers[0].images)
    finally:
        engine.close()
    assert workers == ["w0-cpu", "w1-cpu", "late"] and modes == ["data"] * 3
    assert sum(images.values()) == BATCH and images["late"] > 0
    records = [json.loads(line) for line in open(metrics)]
    assert any(r["event"] == "worker_joined" for r in records)
    joined = [r for r in records if r["event"] == "plan" and r.get("reason") == "worker joined"]
    assert joined and [layer["mode"] for layer in joined[0]["layers"]] == ["data"] * 3
    assert list(joined[0]["wire"]["workers"]) == workers and joined[0]["wire"]["dtype"] == "float32"
    assert_equals_local(local_run, summary["losses"], tmp_path / "ck")


def test_a_bad_image_split_is_rebalanced_and_a_data_checkpoint_resumes_onto_a_model_plan(tmp_path):
    """A data plan that gives w0 one image of ten is rebalanced from measured steps (images move
    to it, the modes stay); its checkpoint, resumed on three workers with another plan, goes on
    exactly as --local."""
    local = train(config(tmp_path, "local", steps=5), LocalEngine({"local": ConvShard(open_device("cpu", threads=1))}),
                  log=quiet)
    metrics = tmp_path / "m.jsonl"
    engine = remote(2)
    calibrate_then_plan = engine.plan_for

    def fooled(*args):                              # as if calibration had been badly fooled
        calibrate_then_plan(*args)
        return fixed_plan(KERNELS, TWO, modes=["data", "data", "model"], images={"w0-cpu": 1, "w1-cpu": 9})
    engine.plan_for = fooled
    measured_rebalance = engine.propose_rebalance

    def as_if_measured_on_equal_cores(specs, **kwargs):
        # compute in proportion to the work held (images of a data layer, kernels of a model
        # one), so the decision does not depend on what else this machine runs
        steps = engine.measured_steps
        for name in engine.plan.workers:
            engine.layer_compute[name] = {lp.layer: steps * 1e-3 * (lp.images[name] if lp.mode == "data" else
                                                                    lp.count(name)) for lp in engine.plan.layers}
        return measured_rebalance(specs, **kwargs)
    engine.propose_rebalance = as_if_measured_on_equal_cores
    try:
        first = train(config(tmp_path, "ck", steps=3, rebalance_after=2, calibration_batch=4, metrics=str(metrics)),
                      engine, log=quiet)
    finally:
        engine.close()
    plans = [json.loads(line) for line in open(metrics) if '"event": "plan"' in line]
    assert len(plans) == 2 and plans[1]["reason"] == "rebalance", plans
    assert [layer["mode"] for layer in plans[1]["layers"]] == ["data", "data", "model"]
    assert plans[1]["layers"][0]["images"]["w0-cpu"] > 1
    second = remote(3)                               # a plan the checkpoint never saw
    try:
        second.fixed_plan = fixed_plan(KERNELS, THREE, modes=["model", "data", "model"], images=IMAGES3)
        resumed = train(config(tmp_path, "ck2", steps=5), second, log=quiet, resume=str(tmp_path / "ck"))
    finally:
        second.close()
    assert_equals_local((local["losses"], checkpoint.load(str(tmp_path / "local"))), first["losses"] + resumed["losses"],
                        tmp_path / "ck2")


def peer_links(modes, images=None, you="w1", workers=2):
    """A PeerLinks told a plan of `workers` workers over len(modes) layers of 4 kernels, no sockets."""
    from hetconv.worker.peers import PeerLinks
    links = PeerLinks(None, you, None, queue.Queue(), None)
    names = [f"w{i}" for i in range(workers)]
    cuts = [0, 1, 4] if workers == 2 else [0, 1, 2, 4]
    ranges = [{w: [0, 4] for w in names} if m == "data" else {w: [cuts[i], cuts[i + 1]] for i, w in enumerate(names)}
              for m in modes]
    links.connect({"you": you, "peers": [{"name": w, "endpoints": [], "host_key": ""} for w in names],
                   "ranges": ranges, "modes": modes, "timeout": 2.0, "connect": False,
                   "images": images if images is not None else
                   [{w: 3 + 2 * i for i, w in enumerate(names)} if m == "data" else {} for m in modes]})
    return links


def slice_msg(step, phase, layer, micro=0, sender="w0"):
    return P.unpack(P.pack("SLICE", 0, [np.zeros(5, np.float32)], step=step, phase=phase, layer=layer, micro=micro,
                           sender=sender))


def test_peer_checks_follow_the_plans_modes():
    """Weight gradients are admitted only for a data layer, once a step (micro 0); a partial dX
    only for a model layer whose input takes a gradient (not one reading the images); tensors
    between layouts only under the step's conversion keys (a chain's: one per layer). The chain
    step's old phases (images, forward) are no protocol's any more."""
    links = peer_links(["data", "model", "data"])
    links.start_step(1, 2)
    assert links._admit(slice_msg(1, "dweights", 0), running=True) == (1, "dweights", 0, 0, "w0")
    assert links._admit(slice_msg(1, "dweights", 2), running=True) == (1, "dweights", 2, 0, "w0")
    assert links._admit(slice_msg(1, "dweights", 1), running=True) is None       # a model layer
    assert links._admit(slice_msg(1, "dweights", 0, micro=1), running=True) is None
    assert links._admit(slice_msg(1, "backward", 1), running=True) == (1, "backward", 1, 0, "w0")
    assert links._admit(slice_msg(1, "backward", 0), running=True) is None       # a data layer sums no partials
    for phase in ("gather", "gather_grad"):
        assert links._admit(slice_msg(1, phase, 0), running=True) == (1, phase, 0, 0, "w0")
        assert links._admit(slice_msg(1, phase, links.graph.conversion_keys()), running=True) is None
    for phase, layer in (("images", -1), ("forward", 0)):
        assert links._admit(slice_msg(1, phase, layer), running=True) is None
    assert links.dropped == 7
    model_first = peer_links(["model", "data"])
    model_first.start_step(1, 1)
    assert model_first._admit(slice_msg(1, "backward", 0), running=True) is None  # it reads the images: no dX
    assert model_first._admit(slice_msg(1, "dweights", 0), running=True) is None


def test_summed_weight_gradient_chunks_are_admitted_only_where_more_than_two_workers_sum_by_chunks():
    """Two workers send each other whole weight gradients; from three on each sums its chunk and
    all-gathers it (`dweights_sum`), for a data layer, once a step."""
    pair = peer_links(["data", "model"])
    pair.start_step(1, 1)
    assert pair._admit(slice_msg(1, "dweights_sum", 0), running=True) is None
    three = peer_links(["data", "model", "data"], workers=3)
    three.start_step(1, 2)
    assert three._admit(slice_msg(1, "dweights_sum", 2), running=True) == (1, "dweights_sum", 2, 0, "w0")
    assert three._admit(slice_msg(1, "dweights_sum", 1), running=True) is None         # a model layer
    assert three._admit(slice_msg(1, "dweights_sum", 0, micro=1), running=True) is None
    assert three._admit(slice_msg(2, "dweights_sum", 0), running=False) is None       # never before its step
    assert (pair.dropped, three.dropped) == (1, 3)


def test_a_graph_worker_admits_layout_gathers_only_under_its_graphs_conversion_keys():
    """A step moves tensors between layouts under GraphPass.conversion_key numbers (a chain's
    pass: one per layer): a `gather` or `gather_grad` under any other number is refused, not held."""
    links = peer_links(["data", "model", "data"])
    keys = links.graph.conversion_keys()
    links.start_step(1, 2)
    for phase in ("gather", "gather_grad"):
        assert links._admit(slice_msg(1, phase, keys - 1, micro=1), running=True) == (1, phase, keys - 1, 1, "w0")
        for key in (keys, -1, "2", 2.0):
            assert links._admit(slice_msg(1, phase, key), running=True) is None
    assert links.dropped == 8


@pytest.mark.parametrize("modes,images,why", [
    (["data", "fast"], None, "PEERS modes"),
    (["data", "model"], [{"w0": 3}, {}], "PEERS images of data layer 0"),
    (["data", "model"], [{"w0": -1, "w1": 2}, {}], "PEERS images of data layer 0"),
    (["data", "model"], [{"w0": 0, "w1": 0}, {}], "PEERS images of data layer 0"),
])
def test_a_plan_with_bad_modes_or_images_is_refused_when_it_arrives(modes, images, why):
    with pytest.raises(ValueError, match=why):
        peer_links(modes, images if images is not None else [{}] * len(modes))


def test_a_peer_that_began_the_step_first_is_heard_up_to_its_first_exchange():
    """A worker computes alone up to its first exchange, so a faster peer's gather or BatchNorm
    sums can arrive before this worker's STEP: they are held for the step, not dropped (dropping
    them left the step waiting for pieces that had come and gone). Backward and weight gradients
    never can."""
    for modes in (["data", "model", "data"], ["model", "data"]):
        links = peer_links(modes)
        links.start_step(1, 2)
        links.hold_early(slice_msg(2, "gather", 0))
        assert (2, "gather", 0, 0, "w0") in links.held
        assert links._admit(slice_msg(2, "backward", 1), running=False) is None
        assert links._admit(slice_msg(2, "dweights", 0), running=False) is None
        assert links._admit(slice_msg(2, "gather_grad", 0), running=False) is None


def test_a_plan_whose_data_layers_split_the_images_differently_is_refused_when_it_arrives():
    """PEERS refuses it, the cost model will not price it, and a STEP without its image counts
    names what is missing."""
    from hetconv.engine.costmodel import DeviceProfile, LayerCost, Link
    from hetconv.engine.steptasks import predict_any
    from hetconv.engine.costmodel import chain_shape
    from hetconv.geometry import ConvSpec
    from hetconv.net.spec import NetSpec
    from hetconv.worker.graph_step import rows_of_step
    with pytest.raises(ValueError, match="split the images differently"):
        peer_links(["data", "model", "data"], [{"w0": 3, "w1": 5}, {}, {"w0": 4, "w1": 4}])
    specs = [ConvSpec.from_layer(layer) for layer in NetSpec.from_json(NET).conv_layers()]
    flat = DeviceProfile("d", "cpu", "", (LayerCost(0.0, 1e-6, 0.0, 1e-6),) * len(specs))
    with pytest.raises(ValueError, match="split the images alike"):
        predict_any("peer", specs, (3, 12, 12), BATCH, TWO, {w: flat for w in TWO}, Link(1e9), 0.0,
                    modes=["data", "model", "data"], images={"w0-cpu": [3, 0, 4], "w1-cpu": [7, 0, 6]},
                    graph=chain_shape(specs, (3, 12, 12)))
    with pytest.raises(ValueError, match="STEP without 'sizes'"):
        rows_of_step(peer_links(["data", "model", "data"]), 3, None)


@pytest.mark.parametrize("parallel", ["model", "data"])
def test_a_calibration_too_noisy_for_cost_lines_splits_by_measured_speed(monkeypatch, parallel):
    """A calibration whose cost lines cannot be split by (noise: a share no slower than its half)
    must not end the run: the plan falls back to the measured speeds, and says so."""
    from hetconv.engine import policy
    from hetconv.engine.planner import PlanError as PlanningError
    from hetconv.geometry import ConvSpec

    def unusable(*args, **kwargs):
        raise PlanningError("no device has a usable cost line (per-kernel cost must be > 0)")

    monkeypatch.setattr(policy, "plan_from_lines", unusable)
    monkeypatch.setattr(policy, "choose_modes", lambda *a, **k: type("Choice", (), {"modes": ["data", "data"]})())
    engine = RemoteEngine.__new__(RemoteEngine)
    engine.exchange, engine.wire, engine.mode_choice, engine.peers = "peer", "float32", None, {}
    said = []
    engine.log = said.append
    timing = {"batch": 4, "kernels": [4, 2], "forward_s": [0.01, 0.005], "backward_s": [0.02, 0.01]}
    engine.calibration = {w: {"device": "cpu", "description": "", "speeds": [s, s], "layers": [timing, timing]}
                          for w, s in (("a", 300.0), ("b", 100.0))}
    cfg = Config(conv="8,8", batch_size=8, parallel=parallel).validate()
    specs = [ConvSpec.paper(3, 8, 5, 0), ConvSpec.paper(8, 8, 5, 0)]
    plan = engine._plan_from_calibration(specs, [(8, 3, 32, 32), (8, 8, 14, 14)],
                                         {"a": [300.0, 300.0], "b": [100.0, 100.0]}, PlanSettings.of(cfg))
    assert any("splitting by measured speed" in line for line in said)
    if parallel == "model":
        assert [lp.count("a") for lp in plan.layers] == [6, 6]            # 3:1, by speed
    else:
        assert plan.modes() == ["data", "data"] and plan.layers[0].images == {"a": 6, "b": 2}
