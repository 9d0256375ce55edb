"""BatchNorm and the per-channel layers in training: a PyTorch nn.Sequential using every new layer
trains through `--net FILE.py:build` exactly as torch.optim.SGD moves it (losses, parameters,
running statistics), and a distributed run equals `--local` whatever the split: model layers
(each worker normalises its own channels), data layers (the per-channel sums added among the
workers), micro-batches (whole-batch statistics, never ghost batches), uneven shares, a resume onto
another plan, a worker lost mid-run."""
import numpy as np
import pytest

from _faults import kill_worker_on_step
from _module_runs import BATCH, STEPS, assert_equal_runs, assert_equals_torch, config, local_module_run, quiet
from hetconv.coordinator.remote import RemoteEngine
from hetconv.data import batches, load_dataset
from hetconv.devices import open_device
from hetconv.engine.local import LocalEngine
from hetconv.engine.planner import fixed_plan
from hetconv.engine.shard import ConvShard
from hetconv.net import load_net
from hetconv.training import checkpoint
from hetconv.training.config import Config
from hetconv.training.loop import train

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install 'hetconv[torch]')")

# Every new per-channel layer, in orders a fused block does not cover (pool before BatchNorm,
# BatchNorm before the activation), a conv without bias, BatchNorm with momentum None and without
# affine, and a bias-free classifier. 16x16 inputs (--crop 16).
MODULE = """
import torch
from torch import nn

def build():
    torch.manual_seed(7)
    net = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.MaxPool2d(2), nn.BatchNorm2d(6), nn.GELU(),
        nn.Conv2d(6, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=None), nn.LeakyReLU(0.2), nn.AvgPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1), nn.ELU(0.7), nn.BatchNorm2d(8, affine=False, eps=1e-3),
        nn.SiLU(), nn.Tanh(), nn.CELU(1.3), nn.Sigmoid(), nn.Hardswish(), nn.Identity(),
        nn.Conv2d(8, 10, 1), nn.GELU(approximate="tanh"), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(10, 10, bias=False))
    for m in net:
        if isinstance(m, nn.BatchNorm2d) and m.affine:     # away from 1 and 0, so a wrong gradient shows
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.5, 0.5)
    return net
"""
LAYER_KERNELS = [6, 8, 8, 10]


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """The module's --local run: its losses, final checkpoint and config."""
    return local_module_run(tmp_path_factory.mktemp("bn"), MODULE)


def test_a_module_with_every_new_layer_trains_as_torch_sgd_does(local_run):
    cfg, losses, (_, conv, fc) = local_run
    ours = assert_equals_torch(cfg, losses, conv, fc)        # running statistics and counts included
    assert int(ours["2.num_batches_tracked"]) == STEPS


def distributed(cfg, tmp_path, workers, modes, images, micro, counts=None, fault=None, resume=None, steps=None):
    names = [f"w{i}-cpu" for i in range(workers)]
    counts = counts or {w: [k // workers + (1 if i < k % workers else 0) for k in LAYER_KERNELS]
                        for i, w in enumerate(names)}
    engine = RemoteEngine("tcp://127.0.0.1:0", 0, ["cpu"] * workers, threads=1, connect_timeout=60, log=quiet)
    engine.fixed_plan = fixed_plan(LAYER_KERNELS, counts, modes=["data" if m == "D" else "model" for m in modes],
                                   images=dict(zip(names, images)))
    if fault:
        fault(engine)
    run = Config(**{**cfg.to_json(), "checkpoint_dir": str(tmp_path / "ck"), "micro_batches": micro,
                    "use_all": True, "snapshot_every": 1, **({"steps": steps} if steps else {})})
    try:
        summary = train(run, engine, log=quiet, resume=resume)
    finally:
        engine.close()
    return summary, checkpoint.load(str(tmp_path / "ck"))


@pytest.mark.parametrize("workers,modes,images,micro", [
    (2, "MMMM", [8, 8], 1),          # every BatchNorm local to its channels' owner
    (2, "DDDD", [3, 13], 4),         # every BatchNorm's sums added among the workers, four micro-batches
    (3, "DMDM", [5, 0, 11], 4),      # mixed, a worker with no images of the data layers
])
def test_distributed_equals_local(local_run, tmp_path, workers, modes, images, micro):
    cfg, losses, local = local_run
    summary, got = distributed(cfg, tmp_path, workers, modes, images, micro)
    np.testing.assert_allclose(summary["losses"], losses, rtol=1e-5)
    assert_equal_runs(got, local)


def test_uneven_shares_a_lost_worker_and_a_resume_onto_another_plan(local_run, tmp_path):
    """Three workers, one holding a single kernel of each model layer, the third killed in step 3:
    the survivors replay from the snapshot (BatchNorm's running statistics are state) and the run
    stops at step 4; a resume onto two workers in the other modes finishes it: equal to --local."""
    cfg, losses, local = local_run
    counts = {"w0-cpu": [1, 1, 1, 1], "w1-cpu": [3, 4, 4, 5], "w2-cpu": [2, 3, 3, 4]}
    summary, _ = distributed(cfg, tmp_path, 3, "MDMD", [2, 9, 5], 2, counts=counts, steps=STEPS - 1,
                             fault=lambda engine: kill_worker_on_step(engine, 2, 3))
    np.testing.assert_allclose(summary["losses"], losses[:STEPS - 1], rtol=1e-5)
    summary, got = distributed(cfg, tmp_path, 2, "DMDM", [10, 6], 1, resume=str(tmp_path / "ck"))
    np.testing.assert_allclose(summary["losses"], losses[STEPS - 1:], rtol=1e-5)
    assert_equal_runs(got, local)


GHOST = """
import torch
from torch import nn

def build():
    torch.manual_seed(11)
    net = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(6, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8, momentum=None), nn.GELU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    for m in net:
        if isinstance(m, nn.BatchNorm2d):
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.5, 0.5)
    return net
"""


class _InGroups(torch.nn.Module):
    """A BatchNorm2d run on each group of `size` consecutive images in turn: ghost batch norm."""

    def __init__(self, bn, size):
        super().__init__()
        self.bn, self.size = bn, size

    def forward(self, x):
        return torch.cat([self.bn(part) for part in torch.split(x, self.size)])


def test_ghost_batches_are_batchnorm_run_on_each_group_in_turn_whatever_the_split(tmp_path):
    """--bn-ghost-batch 6 on batches of 16: groups of 6, 6 and 4 images, each normalised by its own
    statistics, the running ones moving three times a step; --local as PyTorch does it, and two
    workers holding 3 and 13 images in micro-batches that cut the groups elsewhere as --local."""
    (tmp_path / "ghost.py").write_text(GHOST)
    target = f"{tmp_path / 'ghost.py'}:build"
    cfg = config(target, tmp_path, bn_ghost_batch=6)
    local = train(cfg, LocalEngine({"local": ConvShard(open_device("cpu", threads=1))}), log=quiet)

    from hetconv.net.torch_import import load_module, state_dict
    module = load_module(target)
    for i, m in enumerate(module):
        if isinstance(m, torch.nn.BatchNorm2d):
            module[i] = _InGroups(m, 6)
    opt = torch.optim.SGD(module.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    ds = load_dataset("synthetic", seed=cfg.seed, n_train=160, n_test=32)
    torch_losses = []
    for step, (x, y) in enumerate(batches(ds, BATCH, np.random.default_rng([cfg.seed, 0]))):
        if step == STEPS:
            break
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(module(torch.from_numpy(np.ascontiguousarray(x[:, :, 8:24, 8:24]))),
                                                 torch.from_numpy(y))
        loss.backward()
        opt.step()
        torch_losses.append(loss.item())
    np.testing.assert_allclose(local["losses"], torch_losses, rtol=1e-4)
    _, conv, fc = checkpoint.load(str(tmp_path / "ck"))
    ours = state_dict(load_net(target, (3, 16, 16), 10).spec, conv, [(layer["w"], layer["b"]) for layer in fc])
    theirs = {k.replace(".bn.", "."): v.detach().numpy() for k, v in module.state_dict().items()}
    for key, want in theirs.items():
        np.testing.assert_allclose(ours[key], want, rtol=1e-4, atol=1e-5, err_msg=key)
    assert int(ours["1.num_batches_tracked"]) == 3 * STEPS

    names = ["w0-cpu", "w1-cpu"]
    engine = RemoteEngine("tcp://127.0.0.1:0", 0, ["cpu"] * 2, threads=1, connect_timeout=60, log=quiet)
    engine.fixed_plan = fixed_plan([6, 8], {"w0-cpu": [2, 3], "w1-cpu": [4, 5]}, modes=["data", "model"],
                                   images=dict(zip(names, [3, 13])))
    run = Config(**{**cfg.to_json(), "checkpoint_dir": str(tmp_path / "two"), "micro_batches": 4, "use_all": True})
    try:
        summary = train(run, engine, log=quiet)
    finally:
        engine.close()
    np.testing.assert_allclose(summary["losses"], local["losses"], rtol=1e-5)
    assert_equal_runs(checkpoint.load(str(tmp_path / "two")), checkpoint.load(str(tmp_path / "ck")))
