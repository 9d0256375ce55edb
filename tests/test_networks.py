"""Any sequential CNN: each preset and a JSON network with a strided conv and overlapping max and
average pools train `--local` exactly as PyTorch does for the same weights, a PyTorch
nn.Sequential trains from its own weights as torch.optim.SGD moves them, and a distributed run
equals `--local` in losses and final weights."""
import json

import numpy as np
import pytest

from hetconv.devices.cpu import HostArrays
from hetconv.update import UpdateRule
from hetconv.training import checkpoint
from hetconv.training.config import Config
from hetconv.data import batches, load_dataset
from hetconv.devices import open_device
from hetconv.engine.local import LocalEngine
from hetconv.geometry import ConvSpec
from hetconv.net.head import Network
from hetconv.net import NetSpec, load_net
from hetconv.engine.planner import fixed_plan
from hetconv.coordinator.remote import RemoteEngine
from hetconv.engine.shard import ConvShard
from hetconv.training.loop import train

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install 'hetconv[torch]')")
from hetconv.net.torch_import import to_torch  # noqa: E402

# strided conv, 3x3 stride-2 max-pool, 3x3 stride-2 average pool, a rectangular kernel, no bias
STRIDED = {"input_shape": [3, 32, 32], "classes": 10, "layers": [
    {"type": "conv", "out_channels": 6, "kernel": 3, "stride": 2, "padding": 1},
    {"type": "relu"},
    {"type": "maxpool", "kernel": 3, "stride": 2, "padding": 1},
    {"type": "conv", "out_channels": 8, "kernel": [3, 5], "padding": [1, 2], "bias": False},
    {"type": "relu"},
    {"type": "avgpool", "kernel": 3, "stride": 2, "padding": 1},
    {"type": "flatten"},
    {"type": "linear", "out_features": 16},
    {"type": "relu"},
    {"type": "linear", "out_features": 10}]}

NETS = ["paper@0.01", "lenet5", "cifar10-quick@0.25", "vgg-small@0.125", "strided.json"]


def quiet(*_):
    pass


def net_text(name, tmp_path):
    if name.endswith(".json"):
        path = tmp_path / name
        path.write_text(json.dumps(STRIDED))
        return str(path)
    return name


def without_dropout(spec):
    """The same network with every dropout at p=0: PyTorch's masks come from its own generator."""
    d = spec.to_json()
    d["layers"] = [{**layer, "p": 0.0} if layer["type"] == "dropout" else layer for layer in d["layers"]]
    return NetSpec.from_json(d)


@pytest.mark.parametrize("name", NETS)
def test_local_equals_pytorch_forward_and_backward(name, tmp_path):
    spec = without_dropout(load_net(net_text(name, tmp_path), (3, 32, 32), 10).spec)
    specs = [ConvSpec.from_layer(layer) for layer in spec.conv_layers()]
    rng = np.random.default_rng(3)
    conv, fc = spec.init_params(rng)
    engine = LocalEngine({"local": ConvShard(open_device("cpu", threads=1))})
    engine.load(fixed_plan([s.kernels for s in specs], {"local": [s.kernels for s in specs]}),
                specs, [s.initial_state(w, b) for s, (w, b) in zip(specs, conv)])
    head = [op.layer.to_json() for op in spec.head() if op.type != "flatten"]
    net = Network(specs, head, engine, rng, spec.conv_layers()[-1].output_shape, fc_params=fc, host=HostArrays())
    module = to_torch(spec, conv, fc)
    x = rng.standard_normal((6, 3, 32, 32), dtype=np.float32)
    y = rng.integers(0, 10, 6)

    np.testing.assert_allclose(net.predict(x), module(torch.from_numpy(x)).detach().numpy(), rtol=1e-4, atol=1e-5)
    lr = 0.1
    net.train_step(x, y, UpdateRule(lr=lr, momentum=0.0))
    loss = torch.nn.functional.cross_entropy(module(torch.from_numpy(x)), torch.from_numpy(y))
    loss.backward()
    with torch.no_grad():
        for p in module.parameters():
            p -= lr * p.grad
    ours = [layer[n] for layer in engine.gather() + net.fc_state() for n in ("w", "b")]
    convs = [m for m in module if isinstance(m, torch.nn.Conv2d)]
    linears = [m for m in module if isinstance(m, torch.nn.Linear)]
    theirs = [t for m in convs + linears for t in (m.weight, m.bias if m.bias is not None else torch.zeros(m.weight.shape[0]))]
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b.detach().numpy(), rtol=1e-4, atol=1e-6)


def test_a_pytorch_sequential_trains_from_its_own_weights_as_torch_sgd_does(tmp_path):
    (tmp_path / "mynet.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "def build():\n"
        "    torch.manual_seed(5)\n"
        "    return nn.Sequential(nn.Conv2d(3, 6, 3, stride=2, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2, 1),\n"
        "                         nn.Sequential(nn.Conv2d(6, 8, 3, padding=1), nn.ReLU()), nn.AvgPool2d(2),\n"
        "                         nn.Flatten(), nn.Linear(8 * 4 * 4, 16), nn.ReLU(), nn.Linear(16, 10))\n")
    target = f"{tmp_path / 'mynet.py'}:build"
    cfg = Config(net=target, batch_size=16, synthetic_train=160, synthetic_test=32, steps=5, lr=0.05, momentum=0.9,
                 weight_decay=0.0, threads=1, rebalance_after=0, checkpoint_dir=str(tmp_path / "ck")).validate()
    train(cfg, LocalEngine({"local": ConvShard(open_device("cpu", threads=1))}), log=quiet)
    _, conv, fc = checkpoint.load(str(tmp_path / "ck"))

    from hetconv.net.torch_import import load_module
    module = load_module(target)
    opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9, weight_decay=0.0)
    ds = load_dataset("synthetic", seed=cfg.seed, n_train=160, n_test=32)
    for step, (x, y) in enumerate(batches(ds, 16, np.random.default_rng([cfg.seed, 0]))):
        if step == 5:
            break
        opt.zero_grad()
        torch.nn.functional.cross_entropy(module(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        opt.step()
    theirs = [p.detach().numpy() for p in module.parameters()]
    ours = [layer[n] for layer in conv + fc for n in ("w", "b")]
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def local_runs(tmp_path_factory):
    """Each network's --local run: its losses and final checkpoint."""
    runs = {}
    root = tmp_path_factory.mktemp("nets")
    for name in NETS:
        d = root / name.replace("@", "_")
        d.mkdir()
        cfg = Config(net=net_text(name, d), batch_size=16, synthetic_train=128, synthetic_test=32, steps=3,
                     threads=1, rebalance_after=0, checkpoint_dir=str(d / "ck")).validate()
        summary = train(cfg, LocalEngine({"local": ConvShard(open_device("cpu", threads=1))}), log=quiet)
        runs[name] = (cfg, summary["losses"], checkpoint.load(str(d / "ck")))
    return runs


@pytest.mark.parametrize("name,workers,exchange,micro", [
    ("paper@0.01", 3, "peer", 4), ("lenet5", 2, "star", 1), ("cifar10-quick@0.25", 3, "star", 4),
    ("vgg-small@0.125", 2, "peer", 4), ("strided.json", 3, "peer", 1), ("strided.json", 2, "star", 4)])
def test_distributed_equals_local(local_runs, tmp_path, name, workers, exchange, micro):
    cfg, losses, (_, local_conv, local_fc) = local_runs[name]
    engine = RemoteEngine("tcp://127.0.0.1:0", 0, ["cpu"] * workers, threads=1, connect_timeout=60, log=quiet,
                          exchange=exchange)
    kernels = [layer.kernels for layer in load_net(cfg.net, (3, 32, 32), 10).spec.conv_layers()]
    # uneven by hand: the first worker one kernel per layer, the rest split what is left
    counts = {f"w{i}-cpu": [1 if i == 0 else (k - 1) // (workers - 1) + (1 if i <= (k - 1) % (workers - 1) else 0)
                            for k in kernels] for i in range(workers)}
    engine.fixed_plan = fixed_plan(kernels, counts)
    dist = cfg.__class__(**{**cfg.to_json(), "checkpoint_dir": str(tmp_path / "ck"), "exchange": exchange,
                            "micro_batches": micro, "use_all": True})
    try:
        summary = train(dist, engine, log=quiet)
    finally:
        engine.close()
    np.testing.assert_allclose(summary["losses"], losses, rtol=1e-5)
    _, conv, fc = checkpoint.load(str(tmp_path / "ck"))
    for got, want in zip(conv + fc, local_conv + local_fc):
        assert sorted(got) == sorted(want)
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name,workers,modes,micro", [
    ("vgg-small@0.125", 2, "DDDDMMMM", 4), ("vgg-small@0.125", 3, "DDDDDDDD", 1),
    ("paper@0.01", 2, "DD", 4), ("paper@0.01", 3, "DM", 1)])
def test_data_parallel_layers_equal_local(local_runs, tmp_path, name, workers, modes, micro):
    """Per-layer data parallelism on the presets (D: images split, whole weights everywhere; M:
    kernels split), uneven image shares, the peer step: losses and final weights as --local."""
    cfg, losses, (_, local_conv, local_fc) = local_runs[name]
    kernels = [layer.kernels for layer in load_net(cfg.net, (3, 32, 32), 10).spec.conv_layers()]
    assert len(modes) == len(kernels)
    names = [f"w{i}-cpu" for i in range(workers)]
    counts = {w: [k // workers + (1 if i < k % workers else 0) for k in kernels] for i, w in enumerate(names)}
    images = {w: n for w, n in zip(names, [3, 13] if workers == 2 else [2, 9, 5])}      # of a batch of 16
    engine = RemoteEngine("tcp://127.0.0.1:0", 0, ["cpu"] * workers, threads=1, connect_timeout=60, log=quiet)
    engine.fixed_plan = fixed_plan(kernels, counts, modes=["data" if m == "D" else "model" for m in modes],
                                   images=images)
    dist = cfg.__class__(**{**cfg.to_json(), "checkpoint_dir": str(tmp_path / "ck"), "micro_batches": micro,
                            "use_all": True})
    try:
        summary = train(dist, engine, log=quiet)
        ran = "".join("D" if m == "data" else "M" for m in engine.plan.modes())
    finally:
        engine.close()
    assert ran == modes
    np.testing.assert_allclose(summary["losses"], losses, rtol=1e-5)
    _, conv, fc = checkpoint.load(str(tmp_path / "ck"))
    for got, want in zip(conv + fc, local_conv + local_fc):
        assert sorted(got) == sorted(want)
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-6)
