"""bench/accuracy.py and bench/airbench.py: the PyTorch twin starts and steps where hetconv does, the
BatchNorm and weight-gradient sums the plan implies are exactly what two workers' metrics count,
and the accuracy table's verdict follows its margin."""
import json
import os
import sys

import numpy as np
import pytest

from hetconv.coordinator.remote import RemoteEngine
from hetconv.data import batches, load_dataset
from hetconv.devices import open_device
from hetconv.engine.local import LocalEngine
from hetconv.engine.shard import ConvShard
from hetconv.net.torch_import import state_dict
from hetconv.training import checkpoint
from hetconv.training.config import Config
from hetconv.training.loop import network_for, train

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install 'hetconv[torch]')")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import _torch_twin  # noqa: E402
import accuracy  # noqa: E402
import airbench  # noqa: E402
from hetconv.net.torch_import import to_torch  # noqa: E402


def quiet(*_):
    pass


def test_the_torch_twin_starts_and_steps_as_hetconv_does(tmp_path):
    """The twin's start is hetconv's for the seed, and its SGD decays what hetconv decays: a large
    weight decay on airbench94 (a conv bias, BatchNorm scales and shifts, a bias-free linear) makes
    a wrong group show in the weights after three steps."""
    cfg = Config(net="airbench94@0.1", batch_size=8, steps=3, synthetic_train=24, synthetic_test=8, eval_batches=1,
                 threads=1, rebalance_after=0, lr=0.1, weight_decay=0.5, seed=3,
                 checkpoint_dir=str(tmp_path / "ck")).validate()
    summary = train(cfg, LocalEngine({"local": ConvShard(open_device("cpu", threads=1))}), log=quiet)
    ds = load_dataset("synthetic", seed=cfg.seed, n_train=24, n_test=8)
    spec = network_for(cfg, ds).spec
    module = to_torch(spec, *_torch_twin.initial_weights(cfg, spec))
    opt = _torch_twin.sgd(torch, module, cfg)
    losses = []
    for x, y in batches(ds, cfg.batch_size, np.random.default_rng([cfg.seed, 0])):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(module(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    np.testing.assert_allclose(summary["losses"], losses, rtol=2e-4)
    _, conv, fc = checkpoint.load(str(tmp_path / "ck"))
    ours = state_dict(spec, conv, [(layer["w"], layer.get("b")) for layer in fc])
    for key, want in module.state_dict().items():
        np.testing.assert_allclose(ours[key], want.numpy(), rtol=2e-4, atol=1e-6, err_msg=key)


def test_the_twin_refuses_a_recipe_it_does_not_copy():
    cfg = Config(net="airbench94@0.1", no_decay="bias,norm").validate()
    with pytest.raises(ValueError, match="--no-decay 'bias,norm'"):
        _torch_twin.sgd(torch, torch.nn.Linear(2, 2), cfg)


def test_two_data_parallel_workers_send_exactly_the_sums_the_plan_implies(tmp_path):
    """Every layer data-parallel: nothing but BatchNorm and weight-gradient sums goes between the
    workers, so the bytes computed from the plan leave no rest."""
    metrics = tmp_path / "run.jsonl"
    cfg = Config(net="airbench94@0.05", batch_size=8, steps=2, synthetic_train=16, synthetic_test=8, eval_batches=1,
                 threads=1, rebalance_after=0, parallel="DDDDDDD", use_all=True, metrics=str(metrics)).validate()
    engine = RemoteEngine("tcp://127.0.0.1:0", 0, ["cpu"] * 2, threads=1, connect_timeout=60, log=quiet)
    try:
        train(cfg, engine, log=quiet)
    finally:
        engine.close()
    row = airbench.row_from_metrics([json.loads(line) for line in metrics.read_text().splitlines()], warmup=1)
    traffic = airbench.traffic(row)
    assert len(traffic) == 2
    for t in traffic.values():
        assert t["batchnorms"] == 6 and t["rest_bytes"] == 0 and t["weight_bytes"] > 0
        assert t["batchnorm_array_bytes"] == 2 * 8 * sum(2 * c + 1 for c in t["channels"])
        assert t["batchnorm_bytes"] > t["batchnorm_array_bytes"]          # and one header a message


def test_only_the_data_layers_batchnorms_are_counted():
    ds_shape, classes = (3, 32, 32), 10
    from hetconv.net import load_net
    network = load_net("airbench94@0.05", ds_shape, classes).spec.to_json()
    modes = "DDDMMMM"
    plan = {"workers": ["w0", "w1", "w2"], "layers": [{"mode": "data" if m == "D" else "model"} for m in modes]}
    sums = airbench.sums_bytes(network, plan, "w0", 1)
    assert sums["batchnorms"] == 2                    # conv1 has none; conv2 and conv3 one each
    assert sums["batchnorm_arrays"] == 2 * 2 * 8 * sum(2 * c + 1 for c in sums["channels"])   # two peers


def accuracy_doc(hetconv, pytorch):
    rows = [{"framework": fw, "seed": s, "test_accuracy": a, "test_loss": 0.1, "test_images": 360, "final_loss": 0.1,
             "steps": 10, "epoch_accuracy": [a], "median_step_s": 0.1, "wall_s": 1.0, "foreign_load_cores": 0.0}
            for fw, accs in (("hetconv", hetconv), ("pytorch", pytorch)) for s, a in enumerate(accs)]
    return {"command": "python bench/accuracy.py", "machine": "test machine", "wall_s": 60.0, "isa": "avx2",
            "blas": "test", "torch": "test", "load": {"start": "load average 0", "end": "load average 0"},
            "recipe": {"net": "vgg-small-bn@0.5", "data": "tests/data/digits", "spawn": "cpu:1,cpu:1",
                       "batch_size": 32, "epochs": 1, "steps": 10, "lr": 0.05, "momentum": 0.9,
                       "weight_decay": 5e-4, "schedule": "cosine", "torch_threads": 1},
            "data": "digits", "margin": 1.0, "seeds": [0, 1, 2], "start_logit_diff": {"0": 0.0}, "rows": rows}


def test_the_accuracy_verdict_follows_the_medians_and_the_margin():
    met = accuracy.markdown(accuracy_doc([0.95, 0.90, 0.99], [0.955, 0.99, 0.90]))     # medians 0.95 and 0.955
    assert "hetconv 95.00%, PyTorch 95.50%: -0.50 points** (target: at least -1; met)" in met
    missed = accuracy.markdown(accuracy_doc([0.93, 0.94, 0.99], [0.955, 0.99, 0.90]))
    assert "-1.50 points** (target: at least -1; missed)" in missed


def test_a_round_is_quiet_only_when_every_run_of_it_went_well_under_the_foreign_load_limit():
    def run(rnd, config, foreign, ok=True):
        return {"round": rnd, "config": config, "foreign_load_cores": foreign, "ok": ok, "step_s": 1.0}
    configs = list(airbench.CONFIGS)
    torch_nchw = "PyTorch (NCHW)"                   # PyTorch runs in both layouts, each a run of the round
    assert configs[2:] == [torch_nchw, "PyTorch (channels_last)"]
    rows = ([run(0, c, 0.1) for c in configs] + [run(1, c, 0.5 if c == torch_nchw else 0.0) for c in configs]
            + [run(2, c, 0.0, ok=c != torch_nchw) for c in configs] + [run(3, c, 0.3) for c in configs[:2]])
    assert airbench.quiet_rounds({"rows": rows, "configs": configs, "max_foreign": 0.3}) == [0]


def test_airbench_compares_with_pytorchs_faster_layout_and_names_it():
    steps = {"hetconv local": (1.0, 1.2), "hetconv 2 workers": (0.8, 0.9), "PyTorch (NCHW)": (2.0, 2.2),
             "PyTorch (channels_last)": (1.6, 1.5)}
    rows = [{"round": rnd, "config": c, "ok": True, "step_s": s, "step_s_all": [s], "warmup_step_s": [s],
             "foreign_load_cores": 0.0, "load_after": ""} for c, per in steps.items() for rnd, s in enumerate(per)]
    assert airbench.torch_peer(rows) == "PyTorch (channels_last)"
    assert airbench.ratios(rows)["hetconv local"]["vs_torch"] == [1.0 / 1.6, 1.2 / 1.5]
    doc = {"command": "python bench/airbench.py", "machine": "test machine", "wall_s": 60.0, "isa": "avx2",
           "blas": "test", "load": {"start": "load average 0", "end": "load average 0"}, "net": "airbench94",
           "batch_size": 256, "warmup": 1, "steps": 1, "threads": 2, "spawn": "cpu:1,cpu:1",
           "configs": list(airbench.CONFIGS), "max_foreign": 0.3, "rows": rows}
    text = airbench.markdown(doc)
    assert "step / PyTorch (channels_last)'s (per round)" in text
    assert "PyTorch: channels_last the faster (1.550 s; NCHW 2.100 s)" in text
    # a result saved before both layouts ran: its one PyTorch row
    old = [dict(r, config="PyTorch") for r in rows if r["config"] == "PyTorch (NCHW)"]
    assert airbench.torch_peer(old) == "PyTorch"
