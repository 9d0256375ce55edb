"""The float64 reference of the per-channel layers against PyTorch in float64: the reference is
the definition the devices are held to, so it is held to PyTorch here."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from hetconv import channelwise as cw  # noqa: E402
from hetconv.net import reference_channelwise as R  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)

ACTIVATIONS = [
    (cw.Activation("relu"), F.relu),
    (cw.Activation("gelu"), lambda t: F.gelu(t)),
    (cw.Activation("gelu", approximate="tanh"), lambda t: F.gelu(t, approximate="tanh")),
    (cw.Activation("silu"), F.silu),
    (cw.Activation("leaky_relu", negative_slope=0.2), lambda t: F.leaky_relu(t, 0.2)),
    (cw.Activation("leaky_relu"), lambda t: F.leaky_relu(t)),
    (cw.Activation("elu", alpha=0.7), lambda t: F.elu(t, 0.7)),
    (cw.Activation("elu"), F.elu),
    (cw.Activation("celu", alpha=1.8), lambda t: F.celu(t, 1.8)),
    (cw.Activation("tanh"), torch.tanh),
    (cw.Activation("sigmoid"), torch.sigmoid),
    (cw.Activation("hardswish"), F.hardswish),
    (cw.Activation("identity"), lambda t: t),
    (cw.Activation("relu6"), F.relu6),
    (cw.Activation("hardtanh"), F.hardtanh),
    (cw.Activation("hardtanh", min_val=-2.5, max_val=0.5), lambda t: F.hardtanh(t, -2.5, 0.5)),
    (cw.Activation("hardsigmoid"), F.hardsigmoid),
]


def activation_input(rng):
    """Values over the interesting range, with the kinks (0, -3, 3) and large magnitudes hit exactly."""
    x = 3 * rng.standard_normal((2, 3, 5, 4))
    x.flat[:11] = [0.0, -3.0, 3.0, -40.0, 40.0, 1e-6, -1e-6, 6.0, -1.0, 1.0, -2.5]
    return x


def torch_forward_backward(fn, x, dy):
    t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    y = fn(t)
    y.backward(torch.tensor(dy))
    return y.detach().numpy(), t.grad.numpy()


@pytest.mark.parametrize("act,fn", ACTIVATIONS, ids=lambda a: a.to_json().__repr__() if isinstance(a, cw.Activation) else "")
def test_activation_matches_torch(act, fn):
    rng = np.random.default_rng(0)
    x = activation_input(rng)
    dy = rng.standard_normal(x.shape)
    y, dx = torch_forward_backward(fn, x, dy)
    np.testing.assert_allclose(R.activation(x, act), y, **TOL)
    np.testing.assert_allclose(R.activation_backward(x, dy, act), dx, **TOL)


POOLS = [
    cw.Pool("max", 2),
    cw.Pool("max", 3, stride=2, padding=1),         # overlapping windows, padding
    cw.Pool("max", (3, 2), stride=(1, 2)),          # overlapping rows, non-square
    cw.Pool("max", 3, stride=1, padding=1),
    cw.Pool("avg", 2),
    cw.Pool("avg", 3, stride=2, padding=1),
    cw.Pool("avg", (2, 3), stride=1, padding=(1, 1)),
    cw.Pool("avg", 3, stride=3),                    # floor mode drops the last column
]


def torch_pool(pool):
    if pool.mode == "max":
        return lambda t: F.max_pool2d(t, pool.kernel, pool.stride, pool.padding)
    return lambda t: F.avg_pool2d(t, pool.kernel, pool.stride, pool.padding, count_include_pad=True)


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("pool", POOLS, ids=lambda p: str(p.to_json()))
def test_pool_matches_torch(pool, ties):
    rng = np.random.default_rng(1)
    shape = (2, 3, 7, 8)
    # small integers: most windows hold their maximum more than once
    x = rng.integers(-2, 3, shape).astype(np.float64) if ties else rng.standard_normal(shape)
    y, _ = torch_forward_backward(torch_pool(pool), x, np.zeros(R.pool(x, pool).shape))
    dy = rng.standard_normal(y.shape)
    y, dx = torch_forward_backward(torch_pool(pool), x, dy)
    np.testing.assert_allclose(R.pool(x, pool), y, **TOL)
    np.testing.assert_allclose(R.pool_backward(x, dy, pool), dx, **TOL)


@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_global_pool_matches_torch(mode, ties):
    rng = np.random.default_rng(2)
    x = rng.integers(-1, 2, (3, 4, 5, 3)).astype(np.float64) if ties else rng.standard_normal((3, 4, 5, 3))
    fn = (lambda t: F.adaptive_avg_pool2d(t, 1)) if mode == "avg" else (lambda t: F.adaptive_max_pool2d(t, 1))
    dy = rng.standard_normal((3, 4, 1, 1))
    y, dx = torch_forward_backward(fn, x, dy)
    np.testing.assert_allclose(R.pool(x, cw.GlobalPool(mode)), y, **TOL)
    np.testing.assert_allclose(R.pool_backward(x, dy, cw.GlobalPool(mode)), dx, **TOL)


@pytest.mark.parametrize("bn", [cw.BatchNorm(), cw.BatchNorm(eps=1e-3, momentum=0.3), cw.BatchNorm(momentum=None),
                                cw.BatchNorm(affine=False)], ids=lambda b: str(b.to_json()))
def test_batchnorm_training_steps_and_evaluation_match_torch(bn):
    rng = np.random.default_rng(3)
    c = 4
    module = torch.nn.BatchNorm2d(c, eps=bn.eps, momentum=bn.momentum, affine=bn.affine).double()
    weight, bias = 1 + 0.5 * rng.standard_normal(c), rng.standard_normal(c)
    if bn.affine:
        with torch.no_grad():
            module.weight.copy_(torch.tensor(weight))
            module.bias.copy_(torch.tensor(bias))
    running = (np.zeros(c), np.ones(c), 0)
    for step in range(3):
        # shifted, scaled channels: the statistics differ from step to step and from channel to channel
        x = rng.standard_normal((3, c, 5, 4)) * rng.uniform(0.5, 3, c)[None, :, None, None] + 2 * step
        dy = rng.standard_normal(x.shape)
        module.train()
        t = torch.tensor(x, requires_grad=True)
        y_t = module(t)
        y_t.backward(torch.tensor(dy))
        y, running = R.batchnorm_train(x, bn, weight, bias, *running)
        np.testing.assert_allclose(y, y_t.detach().numpy(), **TOL)
        dx, dweight, dbias = R.batchnorm_train_backward(x, dy, bn, weight)
        np.testing.assert_allclose(dx, t.grad.numpy(), **TOL)
        if bn.affine:
            np.testing.assert_allclose(dweight, module.weight.grad.numpy(), **TOL)
            np.testing.assert_allclose(dbias, module.bias.grad.numpy(), **TOL)
            module.weight.grad = module.bias.grad = None
        else:
            assert dweight is None and dbias is None
        np.testing.assert_allclose(running[0], module.running_mean.numpy(), **TOL)
        np.testing.assert_allclose(running[1], module.running_var.numpy(), **TOL)
        assert running[2] == int(module.num_batches_tracked)

    module.eval()
    t = torch.tensor(x, requires_grad=True)
    y_t = module(t)
    y_t.backward(torch.tensor(dy))
    np.testing.assert_allclose(R.batchnorm_eval(x, bn, weight, bias, running[0], running[1]), y_t.detach().numpy(), **TOL)
    np.testing.assert_allclose(R.batchnorm_eval_backward(dy, bn, weight, running[1]), t.grad.numpy(), **TOL)


@pytest.mark.parametrize("p", [0.0, 0.3, 0.75])
def test_dropout2d_with_torch_mask_matches_torch(p):
    """PyTorch draws Dropout2d's noise as (N, C, 1, 1) whatever the map: drawn once on a 1x1
    map and once on the real one from the same seed, it is the same mask."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 6, 3, 5))
    dy = rng.standard_normal(x.shape)
    torch.manual_seed(7)
    drawn = F.dropout2d(torch.ones(4, 6, 1, 1, dtype=torch.float64), p, training=True).numpy()[:, :, 0, 0]
    torch.manual_seed(7)
    y, dx = torch_forward_backward(lambda t: F.dropout2d(t, p, training=True), x, dy)
    mask = cw.dropout2d_mask(cw.Dropout2d(p), drawn != 0)
    np.testing.assert_allclose(mask, drawn, rtol=1e-7)
    np.testing.assert_allclose(R.dropout2d(x, mask), y, **TOL)
    np.testing.assert_allclose(R.dropout2d(dy, mask), dx, **TOL)
