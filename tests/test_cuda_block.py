"""The CUDA device's generalized conv block against the numpy reference: strided and rectangular convolutions,
grouped (depthwise included) and dilated ones, ReLU or no activation, max, average or no pool with any
kernel, stride and padding.

Runs on Numba's CUDA simulator where there is no GPU (tests/conftest.py), so shapes are tiny and
the cases few; the paper's block (stride 1, ReLU, 2x2 stride-2 max-pool) is covered by
tests/test_cuda_device.py.
"""
import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from _cuda_sim import assert_close as _close, dev, random_f32 as _random, short_thread_switches  # noqa: E402,F401,F811
from hetconv.net import reference  # noqa: E402
from hetconv.devices.base import ConvBlock  # noqa: E402
import hetconv.devices.cuda as cudadev  # noqa: E402


# ---- the plain contract with stride and rectangular kernels ------------------------------------
# (N, C, H, W, K, kh, kw, stride, padding)
CONV_CASES = [
    (2, 3, 7, 8, 5, 3, 3, (2, 2), (1, 1)),      # stride 2, odd and even sizes
    (1, 2, 6, 9, 18, 3, 5, (1, 1), (1, 2)),     # 3x5 kernel, padding (1, 2), K over one tile
    (2, 2, 9, 7, 3, 3, 5, (2, 3), (1, 2)),      # unequal strides: dx pixels no window covers
]


@pytest.mark.parametrize("case", CONV_CASES, ids=str)
def test_strided_rectangular_conv2d_and_backward(dev, case):
    n, c, h, w, k, kh, kw, stride, padding = case
    rng = np.random.default_rng(0)
    x, wt, b = _random(rng, n, c, h, w), _random(rng, k, c, kh, kw), _random(rng, k)
    y = dev.conv2d(x, wt, b, stride=stride, padding=padding)
    _close(y, reference.conv2d(x, wt, b, stride, padding), "y")
    dy = _random(rng, *y.shape)
    dx, dw, db = dev.conv2d_backward(x, wt, dy, stride=stride, padding=padding)
    rdx, rdw, rdb = reference.conv2d_backward(x, wt, dy, stride, padding)
    _close(dx, rdx, "dx")
    _close(dw, rdw, "dw")
    _close(db, rdb, "db")


# ---- groups and dilation ------------------------------------------------------------------------
# (N, C, H, W, K, kh, kw, stride, padding, dilation, groups); the plain contract runs these
# through the block (activation and pool none), so _conv_block and its backward run them too
GROUPED_CASES = {
    "depthwise": (2, 4, 6, 7, 4, 3, 3, (1, 1), (1, 1), (1, 1), 4),
    "groups2": (1, 4, 6, 5, 36, 3, 3, (1, 1), (1, 1), (1, 1), 2),        # 18 kernels a group: two M tiles each
    "groups4": (1, 8, 5, 6, 8, 3, 2, (1, 1), (1, 0), (1, 1), 4),         # C/G = K/G = 2
    "dilation2": (2, 3, 7, 8, 5, 3, 3, (1, 1), (2, 1), (2, 2), 1),
    "groups2-dilation2-stride2": (2, 4, 9, 8, 6, 3, 3, (2, 2), (2, 1), (2, 2), 2),
}


@pytest.mark.parametrize("name", GROUPED_CASES)
def test_grouped_and_dilated_conv2d_and_backward(dev, name, monkeypatch):
    n, c, h, w, k, kh, kw, stride, padding, dilation, groups = GROUPED_CASES[name]
    if "stride2" in name:       # several weight-gradient splits in each group: blockIdx.z = group * splits + split
        monkeypatch.setattr(cudadev, "WGRAD_MIN_R_PER_SPLIT", 8)
    rng = np.random.default_rng(0)
    x, wt, b = _random(rng, n, c, h, w), _random(rng, k, c // groups, kh, kw), _random(rng, k)
    y = dev.conv2d(x, wt, b, stride=stride, padding=padding, dilation=dilation, groups=groups)
    _close(y, reference.conv2d(x, wt, b, stride, padding, dilation, groups), "y")
    dy = _random(rng, *y.shape)
    dx, dw, db = dev.conv2d_backward(x, wt, dy, stride=stride, padding=padding, dilation=dilation, groups=groups)
    rdx, rdw, rdb = reference.conv2d_backward(x, wt, dy, stride, padding, True, dilation, groups)
    _close(dx, rdx, "dx")
    _close(dw, rdw, "dw")
    _close(db, rdb, "db")


def test_grouped_dilated_block_with_relu_and_max_pool(dev):
    """A grouped, dilated conv through the fused block: ReLU and a 3x3 stride-2 max-pool, weights
    resident, dW into a given buffer."""
    block = ConvBlock(padding=(2, 2), dilation=(2, 2), groups=2, pool="max", pool_kernel=(3, 3), pool_stride=(2, 2),
                      pool_padding=(1, 1))
    rng = np.random.default_rng(4)
    x, w, b = _random(rng, 2, 4, 7, 6), _random(rng, 6, 2, 3, 3), _random(rng, 6)
    w_dev, b_dev = dev.upload(w), dev.upload(b)
    out, ctx = dev.conv_block(x, w_dev, b_dev, block)
    _close(out, reference.conv_block(x, w, b, block), "out")
    dout = _random(rng, *out.shape)
    buffer = dev.zeros_like(w)
    dx, dw, db = dev.conv_block_backward(ctx, w_dev, dout, need_dx=True, dw_out=buffer)
    assert dw is buffer
    rdx, rdw, rdb = reference.conv_block_backward(x, w, b, block, dout)
    _close(dx, rdx, "dx")
    _close(dev.download(dw), rdw, "dw")
    _close(dev.download(db), rdb, "db")


# ---- the block, forward and backward -------------------------------------------------------------
BLOCKS = {
    "max3x3s2p1": ConvBlock(padding=(1, 1), pool="max", pool_kernel=(3, 3), pool_stride=(2, 2), pool_padding=(1, 1)),
    "avg3x3s2p1": ConvBlock(padding=(1, 1), pool="avg", pool_kernel=(3, 3), pool_stride=(2, 2), pool_padding=(1, 1)),
    "none-max2x2": ConvBlock(activation="none"),
    "none-avg3x2s1": ConvBlock(activation="none", pool="avg", pool_kernel=(3, 2), pool_stride=(1, 1)),
    "stride2-relu-nopool": ConvBlock(stride=(2, 2), padding=(1, 2), pool="none"),
    "stride2-paper-pool": ConvBlock(stride=(2, 1), padding=(2, 1)),
}


@pytest.mark.parametrize("name", BLOCKS)
def test_conv_block_matches_numpy(dev, name):
    block = BLOCKS[name]
    rng = np.random.default_rng(1)
    x, w, b = _random(rng, 2, 2, 9, 8), _random(rng, 3, 2, 3, 3), _random(rng, 3)
    w_dev, b_dev = dev.upload(w), dev.upload(b)
    out, ctx = dev.conv_block(x, w_dev, b_dev, block)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    _close(out, reference.conv_block(x, w, b, block), "out")
    dout = _random(rng, *out.shape)
    dx, dw, db = dev.conv_block_backward(ctx, w_dev, dout, need_dx=True)
    assert not isinstance(dw, np.ndarray) and not isinstance(db, np.ndarray), "dw, db stay on the device"
    rdx, rdw, rdb = reference.conv_block_backward(x, w, b, block, dout)
    _close(dx, rdx, "dx")
    _close(dev.download(dw), rdw, "dw")
    _close(dev.download(db), rdb, "db")


def test_conv_block_without_dx(dev):
    block = BLOCKS["avg3x3s2p1"]
    rng = np.random.default_rng(2)
    x, w, b = _random(rng, 1, 2, 6, 7), _random(rng, 4, 2, 3, 3), _random(rng, 4)
    out, ctx = dev.conv_block(x, w, b, block)
    dout = _random(rng, *out.shape)
    dx, dw, db = dev.conv_block_backward(ctx, w, dout, need_dx=False)
    _, rdw, rdb = reference.conv_block_backward(x, w, b, block, dout, need_dx=False)
    assert dx is None
    _close(dev.download(dw), rdw, "dw")
    _close(dev.download(db), rdb, "db")


def test_max_pool_pads_with_minus_infinity_and_ties_go_to_the_first(dev):
    """No activation and a zero input: every conv output equals its negative bias, so every
    window ties and a zero padding would win. The pooled value is the bias, and each window's
    gradient goes to its first element inside the input."""
    block = ConvBlock(activation="none", pool="max", pool_kernel=(3, 3), pool_stride=(2, 2), pool_padding=(1, 1))
    x = np.zeros((1, 1, 5, 5), np.float32)
    w = np.ones((1, 1, 1, 1), np.float32)
    b = np.array([-0.5], np.float32)
    out, ctx = dev.conv_block(x, w, b, block)
    np.testing.assert_array_equal(out, np.full((1, 1, 3, 3), -0.5, np.float32))
    dout = np.arange(1, 10, dtype=np.float32).reshape(1, 1, 3, 3)
    dx, _, db = dev.conv_block_backward(ctx, w, dout)
    expected = np.zeros((1, 1, 5, 5), np.float32)
    for i, row in enumerate((0, 1, 3)):         # windows start at -1, 1, 3: first rows inside
        for j, col in enumerate((0, 1, 3)):
            expected[0, 0, row, col] = dout[0, 0, i, j]
    np.testing.assert_array_equal(dx, expected)
    np.testing.assert_array_equal(dev.download(db), [dout.sum()])


def test_overlapping_max_windows_add_up(dev):
    """One large value where four 3x3 stride-2 windows overlap: its gradient is their sum."""
    block = ConvBlock(pool="max", pool_kernel=(3, 3), pool_stride=(2, 2))
    x = np.zeros((1, 1, 7, 7), np.float32)
    x[0, 0, 2, 2] = 5.0
    w = np.ones((1, 1, 1, 1), np.float32)
    out, ctx = dev.conv_block(x, w, None, block)
    np.testing.assert_array_equal(out[0, 0], [[5, 5, 0], [5, 5, 0], [0, 0, 0]])
    dout = np.array([[[[1, 2, 4], [8, 16, 32], [64, 128, 256]]]], np.float32)
    dx, _, _ = dev.conv_block_backward(ctx, w, dout)
    expected = np.zeros_like(x)
    expected[0, 0, 2, 2] = 1 + 2 + 8 + 16       # ReLU cut every other window (max 0)
    np.testing.assert_array_equal(dx, expected)


def test_paper_block_equals_conv_relu_pool(dev):
    """ConvBlock(padding=p) is the paper's block: conv_block and conv_relu_pool agree exactly."""
    rng = np.random.default_rng(3)
    x, w, b = _random(rng, 2, 2, 7, 6), _random(rng, 3, 2, 3, 3), _random(rng, 3)
    out, ctx = dev.conv_block(x, w, b, ConvBlock(padding=(1, 1)))
    pooled, pool_ctx = dev.conv_relu_pool(x, w, b, padding=1)
    np.testing.assert_array_equal(out, pooled)
    _close(out, reference.conv_block(x, w, b, ConvBlock(padding=(1, 1))), "out")
    dout = _random(rng, *out.shape)
    dx, dw, db = dev.conv_block_backward(ctx, w, dout)
    pdx, pdw, pdb = dev.conv_relu_pool_backward(pool_ctx, w, dout)
    np.testing.assert_array_equal(dx, pdx)
    np.testing.assert_array_equal(dev.download(dw), dev.download(pdw))
    np.testing.assert_array_equal(dev.download(db), dev.download(pdb))


def test_backward_writes_or_adds_dw_into_a_given_buffer(dev):
    block = BLOCKS["avg3x3s2p1"]
    rng = np.random.default_rng(3)
    x, x2, w, b = _random(rng, 1, 2, 6, 7), _random(rng, 1, 2, 6, 7), _random(rng, 4, 2, 3, 3), _random(rng, 4)
    w_dev, b_dev = dev.upload(w), dev.upload(b)
    buffer = dev.upload(np.full(w.shape, 7.0, np.float32))
    out, ctx = dev.conv_block(x, w_dev, b_dev, block)
    dout = _random(rng, *out.shape)
    _, dw, _ = dev.conv_block_backward(ctx, w_dev, dout, need_dx=False, dw_out=buffer)
    assert dw is buffer
    _, rdw, _ = reference.conv_block_backward(x, w, b, block, dout, need_dx=False)
    _close(dev.download(dw), rdw, "dw written")
    out2, ctx2 = dev.conv_block(x2, w_dev, b_dev, block)
    dout2 = _random(rng, *out2.shape)
    _, dw, _ = dev.conv_block_backward(ctx2, w_dev, dout2, need_dx=False, dw_out=buffer, accumulate=True)
    _, rdw2, _ = reference.conv_block_backward(x2, w, b, block, dout2, need_dx=False)
    _close(dev.download(dw), rdw + rdw2, "dw accumulated")
