"""Graph networks in training: a traced PyTorch module with residual sums (an identity shortcut
and a 1x1 projection), a concatenation of branches and a pooled branch trains through
`--net FILE.py:build` exactly as torch.optim.SGD moves it (losses, parameters, running
statistics); the resnet9, resnet18 and inception-small presets' graphs do too; a distributed run
equals `--local` with even and uneven shares, micro-batches, a worker lost mid-run and a resume
onto another plan; the export gives back the module's own state_dict keys and hetconv's logits."""
import dataclasses
import json

import numpy as np
import pytest

from _faults import kill_worker_on_step
from _module_runs import (STEPS, assert_equal_runs, assert_equals_torch, build_with_batchnorm_away_from_one, config,
                          local_module_run, quiet)
from hetconv.coordinator.remote import RemoteEngine
from hetconv.devices import open_device
from hetconv.engine.local import LocalEngine
from hetconv.engine.planner import fixed_plan
from hetconv.engine.shard import ConvShard
from hetconv.net import load_net
from hetconv.training import checkpoint
from hetconv.training.config import Config
from hetconv.training.loop import train

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install 'hetconv[torch]')")

# torchvision's BasicBlock and ResNet layout (module names included) at a small width, then an
# Inception-style mixed block: a 1x1 branch, a 3x3 branch on a 3x3 max-pool, and the block's input,
# concatenated. 16x16 inputs (--crop 16).
MODULE = """
import torch
from torch import nn
import torch.nn.functional as F


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout, momentum=None)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(6)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.Identity()
        self.layer1 = BasicBlock(6, 6, 1)
        self.layer2 = BasicBlock(6, 8, 2)
        self.a = nn.Conv2d(8, 4, 1)
        self.b = nn.Conv2d(8, 5, 3, padding=1)
        self.fc = nn.Linear(4 + 5 + 8, 10)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        x = torch.cat([self.a(x), F.gelu(self.b(F.max_pool2d(x, 3, 1, 1))), x], dim=1)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))

""" + build_with_batchnorm_away_from_one("Net", 5)


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """The module's --local run: its losses, final checkpoint and config."""
    return local_module_run(tmp_path_factory.mktemp("graph"), MODULE)


def test_a_residual_and_branching_module_trains_as_torch_sgd_does(local_run):
    cfg, losses, (_, conv, fc) = local_run
    assert_equals_torch(cfg, losses, conv, fc)
    spec = load_net(cfg.net, (3, 16, 16), 10).spec
    joins = [(spec.names[i], layer.type) for i, layer in enumerate(spec.layers) if layer.type in ("add", "concat")]
    assert joins == [("add", "add"), ("add_1", "add"), ("cat", "concat")]
    # the blocks: what the shards run; the rest joins them on the coordinator
    blocks = [(spec.names[b.index], spec.names[b.source] if b.source >= 0 else "input") for b in spec.conv_layers()]
    assert blocks == [("conv1", "input"), ("layer1.conv1", "relu"), ("layer1.conv2", "layer1.relu"),   # Identity passes on
                      ("layer2.conv1", "layer1_relu_1"), ("layer2.conv2", "layer2.relu"),
                      ("layer2.downsample.0", "layer1_relu_1"), ("a", "layer2_relu_1"), ("b", "max_pool2d")]


# the presets' graphs, as modules hetconv itself exports (random weights, BatchNorm at PyTorch's start)
PRESET_MODULE = """
import numpy as np
from hetconv.net import preset
from hetconv.net.torch_import import to_torch

def build():
    spec = preset({name!r}, (3, 16, 16), 10, {width})
    return to_torch(spec, *spec.init_params(np.random.default_rng(3)))
"""


@pytest.mark.parametrize("name,width", [("resnet18", 0.0625), ("resnet9", 0.0625), ("inception-small", 0.25)])
def test_each_graph_preset_trains_as_torch_sgd_does_on_two_shards_with_micro_batches(tmp_path, name, width):
    """At lr 0.01 and parameters to 3e-4: in these deeper networks a ReLU input within float32
    rounding of zero now and then falls on the other side in one of the two implementations
    (resnet18@0.25's first step: one of 8,192 elements of a residual sum, 1.2e-6 in PyTorch), and
    the one gradient element that makes differ grows with the learning rate over the steps
    (resnet18@0.0625's stem after five steps: 8e-5 at lr 0.01, 1.4e-3 at lr 0.05)."""
    (tmp_path / "preset.py").write_text(PRESET_MODULE.format(name=name, width=width))
    cfg = config(f"{tmp_path / 'preset.py'}:build", tmp_path, micro_batches=2, lr=0.01)
    engine = LocalEngine({f"s{i}": ConvShard(open_device("cpu", threads=1)) for i in range(2)})
    losses = train(cfg, engine, log=quiet)["losses"]
    _, conv, fc = checkpoint.load(str(tmp_path / "ck"))
    assert_equals_torch(cfg, losses, conv, fc, atol=3e-4)


# resnet50 as hetconv's preset makes it, each residual branch's last BatchNorm scaled down to 0.2:
# at its own start (scale 1), 16 bottlenecks at a width of 4 to 128 channels explode the gradient
# (the stem's gradient norm 400-900 against a weight norm of 1.1, on 32-64 px images), and
# float32 rounding alone then moves one step's gradients by up to 2% between any two conv paths,
# --local against itself included; at 0.2 the stem's gradient norm is about 20.
RESNET50_MODULE = """
import numpy as np
from hetconv.net import preset
from hetconv.net.torch_import import to_torch

def build():
    spec = preset("resnet50", (3, 32, 32), 10, 0.0625)
    net = to_torch(spec, *spec.init_params(np.random.default_rng(3)))
    for name, m in net.named_modules():
        if name.endswith("bn3"):
            m.weight.data.fill_(0.2)
    return net
"""


def test_resnet50s_bottlenecks_train_on_two_shards_as_on_one(tmp_path):
    """resnet50@0.0625 (53 convs: the 7x7 stride-2 stem and its max-pool, 1x1 convs around a strided
    3x3, projections with stride 1 and 2) on 32x32 images: two in-process shards holding a third
    and two thirds of every conv's kernels (the stem's 4: 1 and 3), with two micro-batches, give
    --local's losses and final state. Two steps: on an AVX2 Zen 3 the split and whole runs'
    stem weights were 2e-6 (relative) apart after one step and 5e-6 after two, then 6.6e-4 after
    a third: float32 rounding that a tie turned the other way."""
    (tmp_path / "resnet50.py").write_text(RESNET50_MODULE)
    cfg = Config(net=f"{tmp_path / 'resnet50.py'}:build", batch_size=16, synthetic_train=48, synthetic_test=16, steps=2,
                 lr=0.05, momentum=0.9, weight_decay=0.0, threads=1, rebalance_after=0, eval_batches=1,
                 checkpoint_dir=str(tmp_path / "local")).validate()
    local = train(cfg, LocalEngine({"local": ConvShard(open_device("cpu", threads=1))}), log=quiet)["losses"]
    kernels = [b.kernels for b in load_net(cfg.net, (3, 32, 32), 10).spec.conv_layers()]
    assert len(kernels) == 53 and kernels[:4] == [4, 4, 4, 16]
    engine = LocalEngine({w: ConvShard(open_device("cpu", threads=1)) for w in ("s0", "s1")})
    engine.fixed_plan = fixed_plan(kernels, {"s0": [k // 3 for k in kernels], "s1": [k - k // 3 for k in kernels]})
    split = train(Config(**{**cfg.to_json(), "checkpoint_dir": str(tmp_path / "split"), "micro_batches": 2}), engine,
                  log=quiet)["losses"]
    np.testing.assert_allclose(split, local, rtol=1e-5)
    assert_equal_runs(checkpoint.load(str(tmp_path / "split")), checkpoint.load(str(tmp_path / "local")),
                      atol=1e-4)


def even_counts(kernels, names):
    """{worker: [its kernels of each layer]}: each layer's kernels as evenly as they go, the first
    workers one more."""
    return {w: [k // len(names) + (1 if i < k % len(names) else 0) for k in kernels] for i, w in enumerate(names)}


def assert_each_worker_sent_what_is_priced(metrics, cfg, workers_images, modes):
    """Every step's bytes each worker sent among the workers (the run's metrics) are what the
    cost model prices for the run's plan (even counts, `workers_images` {worker: images}, modes
    a "MD" text): its payload, the measured count adding each message's ~100-byte header.
    Returns the prediction."""
    from hetconv.engine.costmodel import DeviceProfile, LayerCost, Link
    from hetconv.engine.steptasks import predict_any
    from hetconv.engine.graph import GraphPass
    from hetconv.devices.cpu import HostArrays
    from hetconv.geometry import ConvSpec
    spec = load_net(cfg.net, (3, 16, 16), 10).spec
    specs = [ConvSpec.from_layer(layer) for layer in spec.conv_layers()]
    flat = DeviceProfile("d", "cpu", "", (LayerCost(0.0, 1e-6, 0.0, 1e-6),) * len(specs))
    priced = predict_any("peer", specs, (3, 16, 16), cfg.batch_size, even_counts([s.kernels for s in specs],
                                                                                 list(workers_images)),
                         {w: flat for w in workers_images}, Link(1e9), 0.0, 2,
                         modes=[{"M": "model", "D": "data"}[m] for m in modes],
                         images={w: [n] * len(specs) for w, n in workers_images.items()},
                         graph=GraphPass(spec, HostArrays()).shape())
    steps = [r for r in map(json.loads, open(metrics)) if r["event"] == "step"]
    assert len(steps) == STEPS
    for record in steps:
        for w in workers_images:
            sent, want = record["workers"][w]["peer_bytes_sent"], priced.workers[w]
            assert want["sent"] <= sent <= want["sent"] + 128 * want["messages"], (w, sent, want["sent"])
    return priced


def distributed(cfg, tmp_path, workers, micro, counts=None, fault=None, resume=None, steps=None, modes=None,
                images=None, exchange="peer"):
    spec = load_net(cfg.net, (3, 16, 16), 10).spec
    kernels = [b.kernels for b in spec.conv_layers()]
    counts = counts or even_counts(kernels, [f"w{i}-cpu" for i in range(workers)])
    modes = [{"M": "model", "D": "data"}[m] for m in modes] if modes else None
    engine = RemoteEngine("tcp://127.0.0.1:0", 0, ["cpu"] * workers, threads=1, connect_timeout=60, log=quiet,
                          exchange=exchange)
    engine.fixed_plan = fixed_plan(kernels, counts, modes=modes, images=images)
    if fault:
        fault(engine)
    run = Config(**{**cfg.to_json(), "checkpoint_dir": str(tmp_path / "ck"), "micro_batches": micro,
                    "exchange": exchange, "use_all": True, "snapshot_every": 1, **({"steps": steps} if steps else {})})
    try:
        summary = train(run, engine, log=quiet, resume=resume)
    finally:
        engine.close()
    return summary, checkpoint.load(str(tmp_path / "ck"))


def test_two_workers_equal_local_and_three_uneven_ones_survive_a_lost_worker_and_a_resume(local_run, tmp_path):
    """Through the coordinator (star), two workers: as --local. Then the peer step: three workers
    with two micro-batches, model blocks with one worker holding a single kernel of each and data
    blocks with uneven images, the third killed in step 3: the survivors replay from the snapshot
    on a plan the cost model makes (--parallel auto) and stop at step 4; a resume onto two workers
    with other modes and shares and four micro-batches finishes the run: as --local."""
    cfg, losses, local = local_run
    summary, got = distributed(cfg, tmp_path / "star", 2, 1, exchange="star")
    np.testing.assert_allclose(summary["losses"], losses, rtol=1e-5)
    assert_equal_runs(got, local)

    counts = {"w0-cpu": [1] * 8, "w1-cpu": [3, 3, 3, 4, 4, 4, 2, 2], "w2-cpu": [2, 2, 2, 3, 3, 3, 1, 2]}
    summary, _ = distributed(cfg, tmp_path / "uneven", 3, 2, counts=counts, steps=STEPS - 1, modes="MDDMMDMD",
                             images={"w0-cpu": 3, "w1-cpu": 9, "w2-cpu": 4},
                             fault=lambda engine: kill_worker_on_step(engine, 2, 3))
    np.testing.assert_allclose(summary["losses"], losses[:STEPS - 1], rtol=1e-5)
    summary, got = distributed(cfg, tmp_path / "uneven", 2, 4, counts={"w0-cpu": [5, 5, 5, 7, 7, 7, 3, 4],
                                                                       "w1-cpu": [1, 1, 1, 1, 1, 1, 1, 1]},
                               modes="DMDDMDMD", images={"w0-cpu": 13, "w1-cpu": 3},
                               resume=str(tmp_path / "uneven" / "ck"))
    np.testing.assert_allclose(summary["losses"], losses[STEPS - 1:], rtol=1e-5)
    assert_equal_runs(got, local)


@pytest.mark.parametrize("modes,workers", [("DDDDDDDD", 2), ("DDDDDMMM", 2), ("DDDDDMMM", 3), ("DMMDDMMD", 3)])
def test_a_graph_holds_rows_where_its_blocks_are_data_and_moves_what_the_cost_model_prices(local_run, tmp_path, modes,
                                                                                          workers):
    """Data blocks with one uneven split of the images, two micro-batches: each worker holds its
    rows of what data blocks read and write (the joins run on rows), model blocks gather what
    they read and leave their output in their channels (gathered for a model block, sent
    all-to-all for a data block or a join on rows, their partial dX summed into the channels or
    rows their input is held in). The step equals --local's; what moves among the workers is
    what the cost model prices, per worker (its payload; the measured count adds each message's
    header). All data, that is each BatchNorm's sums and each block's weight gradients, as data
    parallelism moves. Three workers sum the weight gradients by chunks (a reduce-scatter, then
    an all-gather)."""
    from hetconv.engine.costmodel import batchnorm_sum_bytes, weight_floats
    from hetconv.geometry import ConvSpec
    cfg, losses, local = local_run
    cfg = Config(**{**cfg.to_json(), "metrics": str(tmp_path / "layouts.jsonl")})
    images = {"w0-cpu": 6, "w1-cpu": 10} if workers == 2 else {"w0-cpu": 4, "w1-cpu": 7, "w2-cpu": 5}
    summary, got = distributed(cfg, tmp_path, workers, 2, modes=modes, images=images)
    np.testing.assert_allclose(summary["losses"], losses, rtol=1e-5)
    assert_equal_runs(got, local)

    priced = assert_each_worker_sent_what_is_priced(tmp_path / "layouts.jsonl", cfg, images, modes)
    specs = [ConvSpec.from_layer(layer) for layer in load_net(cfg.net, (3, 16, 16), 10).spec.conv_layers()]
    if "M" not in modes:
        payload = sum(weight_floats(s) * 4 * (workers - 1) * (1 if workers == 2 else 2 / workers)
                      + 2 * len(s.batchnorms) * batchnorm_sum_bytes(s) * (workers - 1) for s in specs)
        assert all(priced.workers[w]["sent"] == payload for w in images)
        assert set(priced.bytes_by_kind) == {"images and features (coordinator)", "weight gradients", "BatchNorm sums"}
    else:
        assert {"layout gathers", "block outputs"} <= set(priced.bytes_by_kind)


@pytest.mark.parametrize("name,width,workers,modes", [("resnet9", 0.0625, 2, "DDMMDMDM"),
                                                      ("inception-small", 0.25, 3, "DMDDDMDMMDMDM")])
def test_graph_presets_train_as_torch_sgd_does_on_workers_with_model_and_data_blocks(tmp_path, name, width, workers,
                                                                                    modes):
    """The presets' graphs over the peer step, model and data blocks mixed, uneven images and two
    micro-batches: as PyTorch's SGD (as on two shards in one process above)."""
    (tmp_path / "preset.py").write_text(PRESET_MODULE.format(name=name, width=width))
    cfg = config(f"{tmp_path / 'preset.py'}:build", tmp_path, lr=0.01)
    images = {f"w{i}-cpu": n for i, n in enumerate([5, 11] if workers == 2 else [3, 8, 5])}
    summary, (_, conv, fc) = distributed(cfg, tmp_path, workers, 2, modes=modes, images=images)
    assert_equals_torch(cfg, summary["losses"], conv, fc, atol=3e-4)


def test_on_a_bfloat16_wire_the_peer_step_rounds_where_the_coordinator_would(local_run, tmp_path):
    """A 16-bit wire rounds each block's input, output, gradient and partial dX once, where they
    would cross it through the coordinator: the peer step's model blocks give, bit for bit, what
    the same split gives in one process (star, the coordinator joining the blocks), with the
    update clipped by the global gradient norm the workers sum among themselves."""
    cfg, _, _ = local_run
    cfg = Config(**{**cfg.to_json(), "wire_dtype": "bfloat16", "micro_batches": 2, "clip_grad_norm": 0.3,
                    "checkpoint_dir": str(tmp_path / "one" / "ck"), "metrics": str(tmp_path / "one.jsonl")})
    spec = load_net(cfg.net, (3, 16, 16), 10).spec
    kernels = [b.kernels for b in spec.conv_layers()]
    counts = {w: [k // 2 + (1 if i < k % 2 else 0) for k in kernels] for i, w in enumerate(("w0-cpu", "w1-cpu"))}
    engine = LocalEngine({w: ConvShard(open_device("cpu", threads=1)) for w in counts}, wire="auto")
    engine.fixed_plan = fixed_plan(kernels, counts)
    losses = train(cfg, engine, log=quiet)["losses"]
    engine = RemoteEngine("tcp://127.0.0.1:0", 0, ["cpu"] * 2, threads=1, connect_timeout=60, log=quiet, wire="auto")
    engine.fixed_plan = fixed_plan(kernels, counts)
    try:
        summary = train(Config(**{**cfg.to_json(), "checkpoint_dir": str(tmp_path / "ck"),
                                   "metrics": str(tmp_path / "peer.jsonl")}), engine, log=quiet)
    finally:
        engine.close()
    assert engine.wire == "bfloat16"
    assert summary["losses"] == losses
    for metrics in ("one.jsonl", "peer.jsonl"):           # every step clipped, in both runs
        scales = [r["grad_scale"] for r in map(json.loads, open(tmp_path / metrics)) if r["event"] == "step"]
        assert len(scales) == STEPS and max(scales) < 0.9
    assert_equal_runs(checkpoint.load(str(tmp_path / "ck")), checkpoint.load(str(tmp_path / "one" / "ck")), rtol=0,
                      atol=0)


def test_the_export_keeps_the_modules_keys_and_gives_hetconvs_logits(local_run, tmp_path):
    from hetconv.cli import export
    from hetconv.training.trained_model import InProcessModel, load_model
    cfg, _, _ = local_run
    ck = cfg.checkpoint_dir
    assert export.main([ck, "--format", "torch", "--out", str(tmp_path / "m.pt2")]) in (0, None)
    assert export.main([ck, "--format", "npz", "--out", str(tmp_path / "m.npz")]) in (0, None)
    from hetconv.net.torch_import import load_module
    want_keys = set(load_module(cfg.net).state_dict())
    with np.load(tmp_path / "m.npz") as z:
        assert want_keys <= set(z.files)
    model = load_model(ck)
    images = np.random.default_rng(0).integers(0, 256, (4, 3, 16, 16), dtype=np.uint8)
    program = torch.export.load(str(tmp_path / "m.pt2")).module()     # float images in [0, 1]
    theirs = program(torch.from_numpy(images.astype(np.float32) / 255)).detach().numpy()
    ours = InProcessModel(model, threads=1).logits(model.normalize(images))
    np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-4)


def test_planning_prices_a_graphs_blocks_on_their_own_shapes_and_times_its_joins():
    """The cost model's geometry is each block's own input and output (a block need not read the
    one before it), and timing the coordinator's share runs the graph's joins."""
    from hetconv.engine.costmodel import layer_geometry
    from hetconv.engine.measure import measure_coordinator_s
    from hetconv.geometry import ConvSpec
    from hetconv.net import preset
    spec = preset("resnet18", (3, 16, 16), 10, 0.0625)
    blocks = spec.conv_layers()
    specs = [ConvSpec.from_layer(b) for b in blocks]
    assert layer_geometry(specs, spec.input_shape, 4) == [((4,) + b.input_shape, (4,) + b.output_shape[1:])
                                                          for b in blocks]
    fc = [op.layer.to_json() for op in spec.head() if op.type != "flatten"]
    assert measure_coordinator_s(specs, fc, spec.input_shape, 4, 2, repeats=1, network=spec) > 0


def test_the_joins_are_timed_one_by_one_and_a_chain_has_none():
    """measure_join_s: a forward and a backward time for each step between a graph's blocks (its
    sums, the ReLUs after them, its pools), none for its blocks; {} for a chain or no network."""
    from hetconv.engine.graph import GraphPass
    from hetconv.engine.measure import measure_join_s
    from hetconv.net import preset
    spec = preset("resnet9", (3, 16, 16), 10, 0.0625)
    joins = measure_join_s(spec, 4, repeats=1)
    between = {st.output for st in GraphPass(spec, None).steps if st.kind != "block"}
    assert set(joins) == between and len(between) >= 3
    assert all(forward > 0 and backward > 0 for forward, backward in joins.values())
    assert measure_join_s(preset("paper", (3, 32, 32), 10), 4) == {} and measure_join_s(None, 4) == {}


def test_in_the_peer_exchange_the_coordinators_share_is_the_head_alone(monkeypatch):
    """The peer step's workers join the blocks among themselves: timing the coordinator's share
    for it runs the head on features of the network's shape and nothing of the star's (the
    workers' blocks concatenated, their dX summed, the graph's joins); --local (one device) and
    the star exchange run those too."""
    from hetconv.engine import measure
    from hetconv.geometry import ConvSpec
    from hetconv.net import preset
    spec = preset("resnet18", (3, 16, 16), 10, 0.0625)
    specs = [ConvSpec.from_layer(b) for b in spec.conv_layers()]
    fc = [op.layer.to_json() for op in spec.head() if op.type != "flatten"]
    star_engines, heads = [], []
    timing_engine, conv_step = measure._timing_engine, measure.HeadOnlyEngine.conv_step
    monkeypatch.setattr(measure, "_timing_engine", lambda *a: star_engines.append(a) or timing_engine(*a))

    def counted(self, xs, head, *rest):
        heads.append([(len(x),) + self.feature_shape for x in xs])
        return conv_step(self, xs, head, *rest)
    monkeypatch.setattr(measure.HeadOnlyEngine, "conv_step", counted)
    assert measure.measure_coordinator_s(specs, fc, spec.input_shape, 4, 2, repeats=1, network=spec,
                                         exchange="peer") > 0
    assert not star_engines and heads == [[(4,) + tuple(spec.feature_shape())]] * 2
    for workers, exchange in ((2, "star"), (1, "peer")):
        measure.measure_coordinator_s(specs, fc, spec.input_shape, 4, workers, repeats=1, network=spec,
                                      exchange=exchange)
    assert len(star_engines) == 2 and len(heads) == 2


def test_with_no_worker_on_its_host_the_coordinators_share_leaves_out_the_fc_weight_gradients(monkeypatch):
    """The peer step computes the FC weights' gradients after the features' gradient has gone where
    no CPU worker shares the coordinator's host (coordinator.remote), while the workers' backward
    runs: timing the coordinator's share for such workers leaves them out, and only then."""
    import time
    from hetconv.engine import measure
    from hetconv.geometry import ConvSpec
    from hetconv.net import preset
    from hetconv.net.layers import Linear
    spec = preset("resnet18", (3, 16, 16), 10, 0.0625)
    specs = [ConvSpec.from_layer(b) for b in spec.conv_layers()]
    fc = [op.layer.to_json() for op in spec.head() if op.type != "flatten"]
    weight_grads = Linear._weight_grads

    def slow(self, *due):                      # a weight GEMM far longer than the rest of this small head
        time.sleep(0.25)
        weight_grads(self, *due)
    monkeypatch.setattr(Linear, "_weight_grads", slow)
    shared, elsewhere = (measure.measure_coordinator_s(specs, fc, spec.input_shape, 4, 2, repeats=1, network=spec,
                                                       exchange="peer", workers_elsewhere=apart)
                         for apart in (False, True))
    assert shared >= 0.25 > elsewhere, (shared, elsewhere)


def test_hetconv_plan_prices_a_graphs_blocks_in_the_modes_asked_naming_them(tmp_path, capsys):
    from test_parallel_plan import cpu_profile
    from hetconv.cli import plan
    from hetconv.geometry import IMAGE_SHAPE, NUM_CLASSES, ConvSpec
    from hetconv.net import preset
    spec = preset("resnet9", IMAGE_SHAPE, NUM_CLASSES, 0.0625)
    specs = [ConvSpec.from_layer(b) for b in spec.conv_layers()]
    (tmp_path / "cpu.json").write_text(json.dumps(cpu_profile("cpu", specs, IMAGE_SHAPE).to_json()))
    devices = ["--net", "resnet9@0.0625", "--devices", f"@{tmp_path / 'cpu.json'}x2", "--link", "1gbit"]
    assert plan.main(devices + ["--parallel", "data", "--json"]) == 0
    out = capsys.readouterr()
    row = json.loads(out.out)["rows"][-1]
    assert row["modes"] == ["data"] * len(specs) and row["blocks"][:2] == ["prep.conv", "layer1.conv"]
    by_kind = row["prediction"]["bytes_by_kind"]
    assert by_kind["weight gradients"] > 0
    assert row["wire_mb"] == pytest.approx(sum(by_kind.values()) / 1e6)     # each byte once, as it crosses
    assert "each worker holding its rows of what data blocks read and write" in out.err
    assert plan.main(devices + ["--parallel", "model"]) == 0
    out = capsys.readouterr().out
    assert "\nconv1 " in out and "model (prep.conv)" in out
    assert "by what they carry: images and features (coordinator)" in out and "partial input gradients" in out
    # what the step waits on: its critical path, by what each task on it is, adding up to the step
    waits = row["prediction"]["critical_path_s"]
    assert sum(waits.values()) == pytest.approx(row["step_s"]) and waits["forward"] > 0
    assert "waits on (its critical path" in out and "backward dw" in out


def test_the_cost_model_prices_each_graph_block_as_the_graph_step_moves_it():
    """Priced with every tensor whole between the blocks (what chooses each block's cheaper mode),
    each block is priced on its own: a block fed by the images alone pays no dX, a model block's
    partial dX goes whole to every other worker. The plans are priced as the step runs them,
    each tensor in its layout: all-data moves the fewest bytes, a plan priced alike that moves
    fewer is taken, and all-model sums each partial dX into its input's channels."""
    from test_parallel_plan import cpu_profile
    from hetconv.engine.costmodel import GraphShape, parse_bandwidth
    from hetconv.engine.steptasks import predict_any, predict_peer_step
    from hetconv.engine.graph import graph_pass
    from hetconv.engine.planner import TRAFFIC_TIE, choose_modes, mode_shares, one_image_split
    from hetconv.geometry import ConvSpec
    from hetconv.net import preset
    spec = preset("resnet18", (3, 32, 32), 10)
    specs = [ConvSpec.from_layer(b) for b in spec.conv_layers()]
    shape = graph_pass(spec, None).shape()
    assert shape.needs_dx == (False,) + (True,) * (len(specs) - 1) and shape.feature_floats == 512
    profiles = {w: cpu_profile(w, specs, spec.input_shape) for w in ("a", "b")}
    link, batch = parse_bandwidth("1gbit"), 128
    # a plan with data blocks holds its tensors in layouts (priced apart, below): here every
    # tensor whole, as a plan whose data blocks split the images differently runs it
    whole = dataclasses.replace(shape, steps=())
    choice = choose_modes(specs, spec.input_shape, batch, profiles, link, "auto", graph=whole)
    node = choice.costs.node
    assert choice.modes == [min(("model", "data"), key=lambda m: (node[li][m], m == "data")) for li in range(len(specs))]
    assert set(choice.modes) == {"model", "data"}        # early wide maps data, late heavy weights model
    assert choice.chosen_s == pytest.approx(sum(node[li][m] for li, m in enumerate(choice.modes)))

    # with rows kept, all-data moves only weight gradients and BatchNorm sums; the plan taken (the
    # last, weight-heavy blocks model-parallel) is priced within TRAFFIC_TIE of it or below, and
    # moves fewer bytes, and auto says why
    rows = choose_modes(specs, spec.input_shape, batch, profiles, link, "auto", graph=shape)
    split, (shares, _) = one_image_split(specs, batch, profiles), mode_shares(specs, batch, profiles)

    def layout(modes):
        return predict_peer_step(specs, spec.input_shape, batch, shares, split, profiles, link, 0.0, shape, modes)
    all_data, chosen = layout(["data"] * len(specs)), layout(rows.modes)
    k = rows.modes.count("data")
    assert rows.modes == ["data"] * k + ["model"] * (len(specs) - k) and 0 < k < len(specs)
    assert chosen.step_s == pytest.approx(rows.chosen_s)
    assert chosen.step_s <= (1 + TRAFFIC_TIE) * all_data.step_s
    assert sum(v["sent"] for v in chosen.workers.values()) < sum(v["sent"] for v in all_data.workers.values())
    assert rows.chosen_s < choice.chosen_s and "rows" in rows.reason

    detail = choice.costs.detail
    for li, ((n, c, h, w), (_, hp, wp)) in enumerate(layer_geometry_of(specs, spec.input_shape, batch)):
        out_half, whole_in = n * specs[li].kernels * hp * wp * 4 / 2, n * c * h * w * 4
        assert detail[li]["model"]["sent_bytes"][0] == pytest.approx(out_half + (whole_in if li else 0))
    # all-model runs the layout step too: each block's output gathered from its channels, the
    # images from their rows, each partial dX summed into its input's layout (the channels of the
    # block before it: a reduce-scatter, half the all-reduce's bytes on two workers)
    counts = {w: [s.kernels // 2 for s in specs] for w in profiles}
    pred = predict_any("peer", specs, spec.input_shape, batch, counts, profiles, link, 0.0, graph=shape)
    among = {k: v for k, v in pred.bytes_by_kind.items() if "coordinator" not in k}
    assert sorted(among) == ["block outputs", "layout gathers", "partial input gradients"]
    assert sum(among.values()) == pytest.approx(sum(w["sent"] for w in pred.workers.values()))
    assert among["layout gathers"] >= batch * 3 * 32 * 32 * 4 / 2                   # the images, at least
    whole_dx = sum(2 * n * c * h * w * 4 for li, ((n, c, h, w), _) in
                   enumerate(layer_geometry_of(specs, spec.input_shape, batch)) if li)
    assert among["partial input gradients"] < whole_dx
    no_dx = choose_modes(specs, spec.input_shape, batch, profiles, link, "model",
                         graph=GraphShape((True,) * len(specs), 512)).costs.detail
    assert no_dx[0]["model"]["wire_s"] > detail[0]["model"]["wire_s"]


def layer_geometry_of(specs, image_shape, batch):
    from hetconv.engine.costmodel import layer_geometry
    return layer_geometry(specs, image_shape, batch)


def test_a_worker_refuses_a_graph_that_is_not_its_plans():
    """PEERS' graph comes from the network: it must be a graph whose conv blocks are the plan's
    layers, or the worker says what it got."""
    from types import SimpleNamespace
    from hetconv.engine.planner import LayerPlan
    from hetconv.net import preset
    from hetconv.worker.peers import PeerLinks
    spec = preset("resnet9", (3, 16, 16), 10, 0.0625)
    kernels = [b.kernels for b in spec.conv_layers()]
    links = SimpleNamespace(ranges=[{"a": (0, k)} for k in kernels],
                            layer_plans=[LayerPlan(li, k, {"a": (0, k)}, {}) for li, k in enumerate(kernels)])
    assert PeerLinks._graph(links, spec.to_json()).spec == spec
    with pytest.raises(ValueError, match="PEERS graph is a chain"):
        PeerLinks._graph(links, preset("vgg-small", (3, 16, 16), 10).to_json())
    with pytest.raises(ValueError, match=r"conv blocks of \[4, 8, 8, 8, 16, 32, 32, 32\] kernels, the plan's layers "
                                         r"\[4, 8, 8, 8, 16, 32, 32, 33\]"):
        PeerLinks._graph(SimpleNamespace(ranges=links.ranges, layer_plans=links.layer_plans[:-1] + [
            LayerPlan(7, 33, {"a": (0, 33)}, {})]), spec.to_json())
    with pytest.raises(ValueError, match="PEERS graph is list"):
        PeerLinks._graph(links, [1, 2])


# Two concatenations of conv branches (an Inception module's shape): the first pooled and read by
# one conv, the second pooled into the features.
CONCAT_MODULE = """
import torch
from torch import nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 6, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(6)
        self.a = nn.Conv2d(6, 5, 1)
        self.b = nn.Conv2d(6, 7, 3, padding=1)
        self.c = nn.Conv2d(12, 8, 3, padding=1)
        self.d = nn.Conv2d(8, 4, 1)
        self.e = nn.Conv2d(8, 6, 3, padding=1)
        self.fc = nn.Linear(10, 10)

    def forward(self, x):
        x = F.relu(self.bn(self.stem(x)))
        x = F.max_pool2d(torch.cat([self.a(x), F.relu(self.b(x))], 1), 2)
        x = F.relu(self.c(x))
        x = torch.cat([self.d(x), torch.tanh(self.e(x))], 1)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))

""" + build_with_batchnorm_away_from_one("Net", 7)


@pytest.fixture(scope="module")
def concat_run(tmp_path_factory):
    return local_module_run(tmp_path_factory.mktemp("concat"), CONCAT_MODULE)


@pytest.mark.parametrize("modes,workers", [("DMMDMM", 2), ("DMMMDD", 3)])
def test_a_concatenation_of_channel_ranges_is_a_renumbering(concat_run, tmp_path, modes, workers):
    """Model branches concatenated: each worker keeps its kernels' channels of every branch, side
    by side, through the concatenation and the pool after it, with nothing moved; a data block
    reading the result takes its rows by an all-to-all, a model block gathers it, and where it is
    the features each worker sends the coordinator its ranges of them. The step equals --local's
    (which equals PyTorch's), and what moves among the workers is what the cost model prices."""
    from hetconv.engine.graph import GraphPass
    from hetconv.engine.layouts import ROWS, concatenated, tensor_layouts
    from hetconv.devices.cpu import HostArrays
    from hetconv.net.spec import Concat
    cfg, losses, local = concat_run
    if workers == 2:
        assert_equals_torch(cfg, losses, local[1], local[2])
    graph_pass = GraphPass(load_net(cfg.net, (3, 16, 16), 10).spec, HostArrays())
    mode_names = [{"M": "model", "D": "data"}[m] for m in modes]
    layouts = tensor_layouts(graph_pass.steps, mode_names, graph_pass.norms)
    concats = [st.output for st in graph_pass.steps if isinstance(st.layer, Concat)]
    assert len(concats) == 2 and layouts[concats[0]] == concatenated((1, 2))
    assert layouts[concats[1]] == (concatenated((4, 5)) if modes == "DMMDMM" else ROWS)
    assert layouts[graph_pass.feature] == layouts[concats[1]]

    cfg = Config(**{**cfg.to_json(), "metrics": str(tmp_path / "concat.jsonl")})
    images = {"w0-cpu": 6, "w1-cpu": 10} if workers == 2 else {"w0-cpu": 4, "w1-cpu": 7, "w2-cpu": 5}
    summary, got = distributed(cfg, tmp_path, workers, 2, modes=modes, images=images)
    np.testing.assert_allclose(summary["losses"], losses, rtol=1e-5)
    assert_equal_runs(got, local)
    assert_each_worker_sent_what_is_priced(tmp_path / "concat.jsonl", cfg, images, modes)
