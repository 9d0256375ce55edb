"""The model zoo's pieces in one traceable module, as a user would write it: a MobileNetV2 inverted
residual (depthwise conv, ReLU6, a residual sum), a pre-activation BatchNorm and ReLU on that sum, a
grouped conv, a dilated conv, Hardtanh, and the idioms people write (`x.mean((2, 3))`, `x.flatten(1)`). It trains six steps as PyTorch's SGD does
with --local, on two worker processes planned by --parallel auto, and on two model-parallel
workers; its exported program gives PyTorch's own eval logits, computed without hetconv."""
import numpy as np
import pytest

from _module_runs import assert_equal_runs, assert_equals_torch, build_with_batchnorm_away_from_one, config, quiet
from hetconv.coordinator.remote import RemoteEngine
from hetconv.devices import open_device
from hetconv.engine.local import LocalEngine
from hetconv.engine.shard import ConvShard
from hetconv.net import load_net
from hetconv.training import checkpoint
from hetconv.training.config import Config
from hetconv.training.loop import train

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install 'hetconv[torch]')")

ZOO = """
import torch
from torch import nn
import torch.nn.functional as F


class InvertedResidual(nn.Module):
    def __init__(self, channels, expand):
        super().__init__()
        hidden = channels * expand
        self.conv = nn.Sequential(
            nn.Conv2d(channels, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, hidden, 3, 1, 1, groups=hidden, bias=False), nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, channels, 1, bias=False), nn.BatchNorm2d(channels))

    def forward(self, x):
        return x + self.conv(x)


class Zoo(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU6())
        self.inverted = InvertedResidual(8, 2)
        self.pre_bn = nn.BatchNorm2d(8)
        self.grouped = nn.Conv2d(8, 12, 3, stride=2, padding=1, groups=4)
        self.dilated = nn.Conv2d(12, 12, 3, padding=2, dilation=2, bias=False)
        self.bn = nn.BatchNorm2d(12)
        self.fc = nn.Linear(12, 10)

    def forward(self, x):
        x = F.relu(self.pre_bn(self.inverted(self.stem(x))))      # BatchNorm on a residual sum
        x = F.hardtanh(self.grouped(x), -2.0, 2.0)
        x = F.relu(self.bn(self.dilated(x)))
        return self.fc(x.mean((2, 3)).flatten(1))

""" + build_with_batchnorm_away_from_one("Zoo", 11)

STEPS = 6


@pytest.fixture(scope="module")
def zoo_local(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zoo")
    (folder / "zoo.py").write_text(ZOO)
    cfg = config(f"{folder / 'zoo.py'}:build", folder, lr=0.02, steps=STEPS)
    summary = train(cfg, LocalEngine({"local": ConvShard(open_device("cpu", threads=1))}), log=quiet)
    return cfg, summary["losses"], checkpoint.load(str(folder / "ck"))


def test_the_zoo_module_trains_six_steps_as_torch_sgd_does(zoo_local):
    cfg, losses, (_, conv, fc) = zoo_local
    spec = load_net(cfg.net, (3, 16, 16), 10).spec
    assert sorted({(c.groups, c.dilation) for c in spec.layers if c.type == "conv"}) == [(1, (1, 1)), (1, (2, 2)),
                                                                                       (4, (1, 1)), (16, (1, 1))]
    assert len(losses) == STEPS and len(spec.norm_nodes()) == 1
    assert_equals_torch(cfg, losses, conv, fc)


@pytest.mark.parametrize("parallel", ["auto", "model"])
def test_the_zoo_module_on_two_workers_equals_local(zoo_local, tmp_path, parallel):
    """Two one-thread worker processes, the plan made by the planner (auto: the cost model picks
    each block's mode; model: every block's kernels split, the grouped conv's at a group boundary)."""
    cfg, losses, local = zoo_local
    engine = RemoteEngine("tcp://127.0.0.1:0", 0, ["cpu", "cpu"], threads=1, connect_timeout=60, log=quiet)
    run = Config(**{**cfg.to_json(), "checkpoint_dir": str(tmp_path / "ck"), "parallel": parallel, "use_all": True})
    try:
        summary = train(run, engine, log=quiet)
        workers = list(engine.plan.workers)
    finally:
        engine.close()
    assert len(workers) == 2
    np.testing.assert_allclose(summary["losses"], losses, rtol=1e-5)
    assert_equal_runs(checkpoint.load(str(tmp_path / "ck")), local)


def test_the_zoo_modules_exported_program_gives_pytorchs_eval_logits(zoo_local, tmp_path):
    from _exported import exported_logits
    from hetconv.cli import export
    from hetconv.net.torch_import import load_module, state_dict
    cfg, _, (_, conv, fc) = zoo_local
    assert export.main([cfg.checkpoint_dir, "--format", "torch", "--out", str(tmp_path / "zoo.pt2")]) in (0, None)
    module = load_module(cfg.net)
    spec = load_net(cfg.net, (3, 16, 16), 10).spec
    trained = state_dict(spec, conv, [(layer["w"], layer["b"]) for layer in fc])
    module.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in trained.items()})
    module.eval()
    model_meta = checkpoint.load(cfg.checkpoint_dir)[0]
    images = np.random.default_rng(1).random((4, 3, 16, 16), dtype=np.float32)
    theirs = exported_logits(tmp_path / "zoo.pt2", images, tmp_path)
    mean = np.asarray(model_meta["data"]["mean"], np.float32).reshape(1, 3, 1, 1)
    std = np.asarray(model_meta["data"]["std"], np.float32).reshape(1, 3, 1, 1)
    with torch.no_grad():
        want = module(torch.from_numpy((images - mean) / std)).numpy()
    np.testing.assert_allclose(theirs, want, rtol=1e-4, atol=1e-5)


def test_hetconv_plan_prints_a_grouped_convs_split_at_whole_groups_as_the_run_loads_it(tmp_path, capsys):
    import json
    from test_parallel_plan import cpu_profile
    from hetconv.cli import plan
    from hetconv.geometry import IMAGE_SHAPE, ConvSpec
    (tmp_path / "zoo.py").write_text(ZOO)
    net = f"{tmp_path / 'zoo.py'}:build"
    specs = [ConvSpec.from_layer(b) for b in load_net(net, IMAGE_SHAPE, 10).spec.conv_layers()]
    for name, flops in (("fast", 5e8), ("slow", 1e8)):     # 12 kernels at 5:1 is 10 and 2 (compute-bound)
        (tmp_path / f"{name}.json").write_text(json.dumps(cpu_profile(name, specs, IMAGE_SHAPE, flops=flops).to_json()))
    assert plan.main(["--net", net, "--devices", f"@{tmp_path / 'fast.json'},@{tmp_path / 'slow.json'}",
                      "--link", "10gbit", "--parallel", "model", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["rows"][-1]
    grouped = next(i for i, s in enumerate(specs) if s.groups == 4)
    counts = [row["counts"][w][grouped] for w in sorted(row["counts"])]
    assert sum(counts) == 12 and all(c % 3 == 0 for c in counts), counts
