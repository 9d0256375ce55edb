"""The numpy reference is the definition every device is tested against: check it against
finite differences, and against a direct loop for the forward."""
import numpy as np
import pytest

from hetconv.geometry import ConvBlock
from hetconv.net import reference as R


def direct_conv(x, w, b, padding):
    """The textbook six-loop definition, for tiny shapes."""
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    n, c, h, wd = xp.shape
    k, _, kh, kw = w.shape
    y = np.zeros((n, k, h - kh + 1, wd - kw + 1))
    for a in range(n):
        for o in range(k):
            for i in range(y.shape[2]):
                for j in range(y.shape[3]):
                    y[a, o, i, j] = b[o] + np.sum(xp[a, :, i:i + kh, j:j + kw] * w[o])
    return y


@pytest.mark.parametrize("padding", [0, 1, 2])
def test_forward_matches_direct_loops(padding):
    rng = np.random.default_rng(padding)
    x = rng.standard_normal((2, 3, 6, 5)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 2)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    np.testing.assert_allclose(R.conv2d(x, w, b, padding=padding), direct_conv(x, w, b, padding), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("padding,kh,kw", [(0, 3, 3), (1, 2, 3), (2, 5, 5), (0, 1, 1)])
def test_backward_matches_finite_differences(padding, kh, kw):
    # L = sum(dy * conv(x, w, b)) is linear in each of x, w, b: a central difference along a
    # random direction is exact up to float32 rounding of the forward.
    rng = np.random.default_rng(kh * 10 + padding)
    x = rng.standard_normal((2, 3, 7, 6)).astype(np.float32)
    w = rng.standard_normal((4, 3, kh, kw)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    dy = rng.standard_normal(R.conv2d(x, w, b, padding=padding).shape)
    dx, dw, db = R.conv2d_backward(x, w, dy.astype(np.float32), padding=padding)

    def loss(x_, w_, b_):
        return float(np.sum(dy * R.conv2d(x_, w_, b_, padding=padding).astype(np.float64)))

    for name, grad, args, i in (("dx", dx, (x, w, b), 0), ("dw", dw, (x, w, b), 1), ("db", db, (x, w, b), 2)):
        v = rng.standard_normal(args[i].shape).astype(np.float32)
        plus, minus = list(args), list(args)
        plus[i], minus[i] = args[i] + v, args[i] - v
        numeric = (loss(*plus) - loss(*minus)) / 2
        analytic = float(np.sum(grad.astype(np.float64) * v))
        assert numeric == pytest.approx(analytic, rel=1e-4, abs=1e-3), name


def test_backward_without_dx_returns_none():
    x = np.ones((1, 1, 4, 4), np.float32)
    w = np.ones((1, 1, 3, 3), np.float32)
    dx, dw, db = R.conv2d_backward(x, w, np.ones((1, 1, 2, 2), np.float32), need_dx=False)
    assert dx is None and dw.shape == w.shape and db.shape == (1,)


def test_relu_pool_backward_matches_finite_differences():
    rng = np.random.default_rng(3)
    # distinct values 0.01 apart, none near 0: a 1e-3 step never changes a window's argmax or ReLU
    y = (rng.permutation(2 * 3 * 7 * 6) * 0.01 - 1.255).astype(np.float32).reshape(2, 3, 7, 6)  # odd height
    dp = rng.standard_normal((2, 3, 3, 3))
    grad = R.relu_maxpool2_backward(y, dp.astype(np.float32))
    eps = 1e-3
    v = rng.standard_normal(y.shape).astype(np.float32)
    numeric = (np.sum(dp * R.relu_maxpool2(y + eps * v)) - np.sum(dp * R.relu_maxpool2(y - eps * v))) / (2 * eps)
    assert numeric == pytest.approx(float(np.sum(grad * v)), rel=1e-3, abs=1e-3)
    assert np.all(grad[:, :, 6, :] == 0)


def test_pool_ties_go_to_first_maximum_and_negative_windows_get_nothing():
    y = np.array([[[[2, 2], [2, 2]], [[-1, -2], [-3, -4]]]], np.float32).reshape(1, 2, 2, 2)
    grad = R.relu_maxpool2_backward(y, np.ones((1, 2, 1, 1), np.float32))
    assert grad[0, 0].tolist() == [[1, 0], [0, 0]]
    assert not grad[0, 1].any()
    assert R.relu_maxpool2(y)[0, :, 0, 0].tolist() == [2, 0]


# (C, K, groups, dilation, stride, padding): grouped, depthwise, depthwise dilated, dilated dense,
# uneven pairs, and both at a stride
GROUPED_DILATED = [(4, 6, 2, 1, 1, 1), (4, 4, 4, 1, 1, 1), (4, 8, 4, 2, 1, 2), (3, 6, 1, 2, 2, 1),
                   (6, 3, 3, (2, 1), 1, (1, 0)), (4, 8, 2, 3, 2, 2)]


@pytest.mark.parametrize("c, k, groups, dilation, stride, padding", GROUPED_DILATED)
def test_grouped_and_dilated_conv_matches_torch_forward_and_backward(c, k, groups, dilation, stride, padding):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, c, 9, 8)).astype(np.float32)
    w = rng.standard_normal((k, c // groups, 3, 3)).astype(np.float32)
    b = rng.standard_normal(k).astype(np.float32)
    tx, tw, tb = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (x, w, b))
    ty = torch.nn.functional.conv2d(tx, tw, tb, stride, padding, dilation, groups)
    dy = rng.standard_normal(ty.shape).astype(np.float32)
    ty.backward(torch.tensor(dy, dtype=torch.float64))
    y = R.conv2d(x, w, b, stride, padding, dilation, groups)
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-5, atol=1e-5)
    dx, dw, db = R.conv2d_backward(x, w, dy, stride, padding, True, dilation, groups)
    for mine, theirs in ((dx, tx), (dw, tw), (db, tb)):
        np.testing.assert_allclose(mine, theirs.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_a_grouped_dilated_block_matches_torch():
    torch = pytest.importorskip("torch")
    block = ConvBlock(stride=1, padding=2, dilation=2, groups=2, activation="relu", pool="max")
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 4, 10, 10)).astype(np.float32)
    w = rng.standard_normal((6, 2, 3, 3)).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    tx, tw, tb = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (x, w, b))
    F = torch.nn.functional
    ty = F.max_pool2d(F.relu(F.conv2d(tx, tw, tb, 1, 2, 2, 2)), 2)
    dout = rng.standard_normal(ty.shape).astype(np.float32)
    ty.backward(torch.tensor(dout, dtype=torch.float64))
    np.testing.assert_allclose(R.conv_block(x, w, b, block), ty.detach().numpy(), rtol=1e-5, atol=1e-5)
    dx, dw, db = R.conv_block_backward(x, w, b, block, dout)
    for mine, theirs in ((dx, tx), (dw, tw), (db, tb)):
        np.testing.assert_allclose(mine, theirs.grad.numpy(), rtol=1e-5, atol=1e-5)
