"""What the tests that train a PyTorch module through `--net FILE.py:build` share: the run's
config (16x16 crops of the synthetic set, five steps of 16 images, SGD with momentum), the same
steps in PyTorch, and the check that two runs' final states agree."""
import numpy as np

from hetconv.data import batches, load_dataset
from hetconv.devices import open_device
from hetconv.engine.local import LocalEngine
from hetconv.engine.shard import ConvShard
from hetconv.training import checkpoint
from hetconv.training.config import Config
from hetconv.training.loop import train

STEPS, BATCH = 5, 16


def quiet(*_):
    pass


def config(target, tmp_path, lr=0.05, steps=STEPS, **kw):
    return Config(net=target, crop=16, batch_size=BATCH, synthetic_train=160, synthetic_test=32, steps=steps,
                  lr=lr, momentum=0.9, weight_decay=0.0, threads=1, rebalance_after=0, eval_batches=1,
                  checkpoint_dir=str(tmp_path / "ck"), **kw).validate()


def local_module_run(folder, module_source, **kw):
    """`module_source` written to folder/mynet.py and trained with --local (one 1-thread shard) on
    config()'s recipe (`kw`: its other settings) -> (its config, losses, final checkpoint (meta,
    conv, fc))."""
    (folder / "mynet.py").write_text(module_source)
    cfg = config(f"{folder / 'mynet.py'}:build", folder, **kw)
    summary = train(cfg, LocalEngine({"local": ConvShard(open_device("cpu", threads=1))}), log=quiet)
    return cfg, summary["losses"], checkpoint.load(str(folder / "ck"))


def torch_run(cfg, module=None):
    """The module (default: the one cfg.net builds), batches and recipe in PyTorch (gradients
    clipped to cfg.clip_grad_norm where it is set): the losses and the final state_dict."""
    import torch
    from hetconv.net.torch_import import load_module
    module = module if module is not None else load_module(cfg.net)
    opt = torch.optim.SGD(module.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=0.0)
    ds = load_dataset("synthetic", seed=cfg.seed, n_train=160, n_test=32)
    losses = []
    for step, (x, y) in enumerate(batches(ds, BATCH, np.random.default_rng([cfg.seed, 0]))):
        if step == cfg.steps:
            break
        x = x[:, :, 8:24, 8:24]                              # --crop 16
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(module(torch.from_numpy(np.ascontiguousarray(x))),
                                                 torch.from_numpy(y))
        loss.backward()
        if cfg.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(module.parameters(), cfg.clip_grad_norm)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().numpy() for k, v in module.state_dict().items()}


def assert_equal_runs(got, want, rtol=1e-4, atol=1e-5):
    """Two checkpoints (checkpoint.load's (meta, conv, fc)) hold the same state, name by name."""
    (_, conv, fc), (_, other_conv, other_fc) = got, want
    for g, w in zip(conv + fc, other_conv + other_fc):
        assert sorted(g) == sorted(w)
        for key in w:
            np.testing.assert_allclose(g[key], w[key], rtol=rtol, atol=atol, err_msg=key)


def assert_equals_torch(cfg, losses, conv, fc, atol=1e-5):
    """The run's losses and final state (conv, fc: a checkpoint's) against the same steps in
    PyTorch, its module's own state_dict keys, running statistics included; -> hetconv's state
    under those keys."""
    from hetconv.net import load_net
    from hetconv.net.torch_import import state_dict
    torch_losses, state = torch_run(cfg)
    np.testing.assert_allclose(losses, torch_losses, rtol=1e-4)
    spec = load_net(cfg.net, (3, 16, 16), 10).spec
    ours = state_dict(spec, conv, [(layer["w"], layer["b"]) for layer in fc])
    assert sorted(ours) == sorted(state)
    for key, want in state.items():
        np.testing.assert_allclose(ours[key], want, rtol=1e-4, atol=atol, err_msg=key)
    return ours


def build_with_batchnorm_away_from_one(net_class, seed):
    """A user file's `build()` for a module written above it: `net_class()` made under
    torch.manual_seed(seed), each BatchNorm's weight drawn from 0.5-1.5 and bias from -0.5-0.5, away
    from 1 and 0, so that a wrong gradient shows."""
    return f"""

def build():
    torch.manual_seed({seed})
    net = {net_class}()
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.5, 0.5)
    return net
"""
