"""airbench94 (a plain sequence with BatchNorm before GELU, a pool before the BatchNorm, a
bias-free classifier and a scaled output) trains with two workers exactly as `--local` does, and
leaves as a torch.export program that runs without hetconv and gives hetconv's own logits; channel
dropout draws one mask for the whole batch, so a data-parallel run in micro-batches drops what
`--local` drops."""
import json

import numpy as np
import pytest

from _exported import exported_logits
from hetconv.cli import export
from hetconv.coordinator.remote import RemoteEngine
from hetconv.data import load_dataset
from hetconv.devices import open_device
from hetconv.engine.local import LocalEngine
from hetconv.engine.planner import fixed_plan
from hetconv.engine.shard import ConvShard
from hetconv.net import load_net
from hetconv.training import checkpoint, trained_model
from hetconv.training.config import Config
from hetconv.training.loop import train

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install 'hetconv[torch]')")

NET = "airbench94@0.125"                    # widths 3, 8, 32, 32: the whole network at a CI's cost
DROPOUT = {"input_shape": [3, 16, 16], "classes": 10, "layers": [
    {"type": "conv", "out_channels": 6, "kernel": 3, "padding": 1, "bias": False},
    {"type": "batchnorm"}, {"type": "relu"}, {"type": "dropout2d", "p": 0.3}, {"type": "maxpool", "kernel": 2},
    {"type": "conv", "out_channels": 8, "kernel": 3, "padding": 1}, {"type": "dropout2d", "p": 0.5},
    {"type": "silu"}, {"type": "global_maxpool"},
    {"type": "flatten"}, {"type": "linear", "out_features": 10}]}


def quiet(*_):
    pass


def local(cfg):
    return train(cfg, LocalEngine({"local": ConvShard(open_device("cpu", threads=1))}), log=quiet)


def two_workers(cfg, tmp_path, kernels, counts, modes, images, micro):
    engine = RemoteEngine("tcp://127.0.0.1:0", 0, ["cpu"] * 2, threads=1, connect_timeout=60, log=quiet)
    engine.fixed_plan = fixed_plan(kernels, counts, modes=["data" if m == "D" else "model" for m in modes],
                                   images=images)
    run = Config(**{**cfg.to_json(), "checkpoint_dir": str(tmp_path / "two"), "micro_batches": micro,
                    "use_all": True})
    try:
        return train(run, engine, log=quiet)
    finally:
        engine.close()


def assert_same_checkpoints(a, b):
    (_, conv_a, fc_a), (_, conv_b, fc_b) = checkpoint.load(a), checkpoint.load(b)
    for got, want in zip(conv_a + fc_a, conv_b + fc_b):
        assert sorted(got) == sorted(want)
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-5, err_msg=key)


@pytest.fixture(scope="module")
def airbench(tmp_path_factory):
    d = tmp_path_factory.mktemp("airbench")
    cfg = Config(net=NET, batch_size=16, synthetic_train=96, synthetic_test=32, steps=3, lr=0.05, threads=1,
                 rebalance_after=0, eval_batches=1, checkpoint_dir=str(d / "local")).validate()
    return cfg, local(cfg)["losses"], d


def test_airbench94_with_two_workers_equals_local(airbench, tmp_path):
    cfg, losses, d = airbench
    kernels = [layer.kernels for layer in load_net(NET, (3, 32, 32), 10).spec.conv_layers()]
    assert kernels == [3, 8, 8, 32, 32, 32, 32]
    counts = {"w0-cpu": [1, 3, 2, 5, 9, 30, 1], "w1-cpu": [2, 5, 6, 27, 23, 2, 31]}
    summary = two_workers(cfg, tmp_path, kernels, counts, "DDMDMMD", {"w0-cpu": 5, "w1-cpu": 11}, 2)
    np.testing.assert_allclose(summary["losses"], losses, rtol=1e-5)
    assert_same_checkpoints(str(tmp_path / "two"), str(d / "local"))


def test_airbench94_exports_to_a_program_that_gives_hetconvs_logits_without_hetconv(airbench, tmp_path):
    cfg, _, d = airbench
    out = tmp_path / "airbench.pt2"
    assert export.main([str(d / "local"), "--format", "torch", "--out", str(out)]) == 0
    model = trained_model.load_model(str(d / "local"))
    ds = load_dataset("synthetic", seed=0, n_train=96, n_test=32)
    images = ds.test_x[:8]
    x01 = (images.astype(np.float32) / 255).astype(np.float32)
    ours = trained_model.InProcessModel(model, threads=1).logits(model.normalize(images))
    np.testing.assert_allclose(exported_logits(out, x01, tmp_path), ours, atol=1e-4, rtol=0)
    # the npz holds the running statistics by PyTorch's names, and the classifier no bias
    assert export.main([str(d / "local"), "--format", "npz", "--out", str(tmp_path / "m.npz")]) == 0
    with np.load(tmp_path / "m.npz", allow_pickle=False) as z:
        assert {"4.running_mean", "4.running_var", "4.num_batches_tracked", "25.weight"} <= set(z.files)
        assert "25.bias" not in z.files and int(z["4.num_batches_tracked"]) == 3


def test_channel_dropout_draws_one_mask_for_the_whole_batch(tmp_path):
    (tmp_path / "net.json").write_text(json.dumps(DROPOUT))
    cfg = Config(net=str(tmp_path / "net.json"), crop=16, batch_size=16, synthetic_train=96, synthetic_test=32,
                 steps=3, lr=0.05, threads=1, rebalance_after=0, eval_batches=1,
                 checkpoint_dir=str(tmp_path / "local")).validate()
    losses = local(cfg)["losses"]
    summary = two_workers(cfg, tmp_path, [6, 8], {"w0-cpu": [2, 3], "w1-cpu": [4, 5]}, "DM",
                          {"w0-cpu": 7, "w1-cpu": 9}, 4)
    np.testing.assert_allclose(summary["losses"], losses, rtol=1e-5)
    assert_same_checkpoints(str(tmp_path / "two"), str(tmp_path / "local"))
