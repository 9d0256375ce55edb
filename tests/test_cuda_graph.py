"""A graph network's blocks on the CUDA device (Numba's simulator here, a GPU where there is one):
a residual sum with a projection and a concatenation train two steps as they do on the CPU
device; the coordinator's joins are the same code for either."""
import json

import numpy as np

from _cuda_sim import dev  # noqa: F401 (the fixture)
from hetconv.devices import open_device
from hetconv.engine.local import LocalEngine
from hetconv.engine.shard import ConvShard
from hetconv.training import checkpoint
from hetconv.training.config import Config
from hetconv.training.loop import train

NET = {"input_shape": [3, 6, 6], "classes": 10, "nodes": [
    {"name": "stem", "inputs": ["input"], "type": "conv", "out_channels": 3, "kernel": 3, "padding": 1},
    {"name": "stem_bn", "inputs": ["stem"], "type": "batchnorm"},
    {"name": "stem_relu", "inputs": ["stem_bn"], "type": "relu"},
    {"name": "a", "inputs": ["stem_relu"], "type": "conv", "out_channels": 4, "kernel": 3, "stride": 2, "padding": 1},
    {"name": "a_bn", "inputs": ["a"], "type": "batchnorm"},
    {"name": "skip", "inputs": ["stem_relu"], "type": "conv", "out_channels": 4, "kernel": 1, "stride": 2,
     "bias": False},
    {"name": "sum", "inputs": ["a_bn", "skip"], "type": "add"},
    {"name": "out", "inputs": ["sum"], "type": "relu"},
    {"name": "b", "inputs": ["out"], "type": "conv", "out_channels": 2, "kernel": 1},
    {"name": "cat", "inputs": ["b", "out"], "type": "concat"},
    {"name": "pool", "inputs": ["cat"], "type": "global_avgpool"},
    {"name": "flatten", "inputs": ["pool"], "type": "flatten"},
    {"name": "fc", "inputs": ["flatten"], "type": "linear", "out_features": 10}]}


def run(tmp_path, device, name):
    cfg = Config(net=str(tmp_path / "net.json"), crop=6, batch_size=4, synthetic_train=16, synthetic_test=4, steps=2,
                 lr=0.1, momentum=0.9, weight_decay=0.0, threads=1, rebalance_after=0, eval_batches=1,
                 checkpoint_dir=str(tmp_path / name)).validate()
    losses = train(cfg, LocalEngine({name: ConvShard(device)}), log=lambda *_: None)["losses"]
    return losses, checkpoint.load(str(tmp_path / name))


def test_a_graph_trains_on_the_cuda_device_as_on_the_cpu(dev, tmp_path):  # noqa: F811
    (tmp_path / "net.json").write_text(json.dumps(NET))
    gpu_losses, (_, gpu_conv, gpu_fc) = run(tmp_path, dev, "gpu")
    cpu_losses, (_, cpu_conv, cpu_fc) = run(tmp_path, open_device("cpu", threads=1), "cpu")
    np.testing.assert_allclose(gpu_losses, cpu_losses, rtol=1e-4)
    for g, c in zip(gpu_conv + gpu_fc, cpu_conv + cpu_fc):
        assert sorted(g) == sorted(c)
        for key in c:
            np.testing.assert_allclose(g[key], c[key], rtol=1e-4, atol=1e-5, err_msg=key)
