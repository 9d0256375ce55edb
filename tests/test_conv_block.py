"""The generalized conv block: conv (any kernel, stride, padding) -> ReLU or none -> max, average
or no pool. ConvBlock's checks, the shape rules, the numpy reference against PyTorch (the oracle),
and the CPU device against the reference."""
import numpy as np
import pytest

from hetconv.net import reference as R
from hetconv.devices import open_device
from hetconv.devices.base import PAPER_BLOCK, ConvBlock, block_output_shape, conv_output_shape

# (N, C, H, W, K, kh, kw, stride, padding): strides 1, 2, 4 and (1, 2); kernels 1x1, 3x3, 5x5, 3x5,
# 11x11; paddings 0..3 and rectangular; every conv output at least 5x5 so every pool below fits
CONVS = [
    (2, 3, 9, 8, 4, 1, 1, (1, 1), (0, 0)),
    (2, 3, 11, 10, 4, 3, 3, (2, 2), (1, 1)),
    (1, 2, 17, 19, 3, 5, 5, (4, 4), (2, 2)),
    (2, 2, 9, 12, 3, 3, 5, (1, 2), (0, 3)),
    (1, 3, 14, 13, 2, 11, 11, (1, 1), (3, 3)),
    (2, 4, 8, 8, 5, 3, 3, (1, 1), (2, 1)),
    (1, 2, 16, 15, 3, 5, 5, (2, 1), (0, 0)),
    (1, 2, 30, 30, 3, 11, 11, (4, 4), (2, 2)),
]
# (pool, kernel, stride, padding): non-overlapping, overlapping, padded, stride 1, none
POOLS = [(kind, k, s, p) for kind in ("max", "avg") for k, s, p in ((2, 2, 0), (3, 2, 0), (3, 2, 1), (2, 1, 0))]
POOLS.append(("none", 2, 2, 0))
ACTIVATIONS = ("relu", "none")


def block_for(conv, pool, activation):
    kind, k, s, p = pool
    return ConvBlock(stride=conv[7], padding=conv[8], activation=activation, pool=kind, pool_kernel=k,
                     pool_stride=s, pool_padding=p)


def tensors(conv, seed):
    n, c, h, w, k, kh, kw = conv[:7]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    wt = rng.standard_normal((k, c, kh, kw)).astype(np.float32)
    b = rng.standard_normal(k).astype(np.float32)
    return x, wt, b, rng


def ids(values):
    return [str(v).replace(" ", "") for v in values]


# ---- ConvBlock and the shape rules -------------------------------------------------------------

def test_default_block_is_the_paper_block_and_ints_become_pairs():
    assert PAPER_BLOCK == ConvBlock(stride=1, padding=0, pool_kernel=2, pool_stride=2, pool_padding=0)
    assert PAPER_BLOCK.is_paper
    block = ConvBlock(stride=2, padding=(1, 3), pool="avg", pool_kernel=3, pool_stride=[2, 1])
    assert (block.stride, block.padding, block.pool_kernel, block.pool_stride) == ((2, 2), (1, 3), (3, 3), (2, 1))
    assert not block.is_paper and ConvBlock(padding=(1, 2)).is_paper


def test_block_json_round_trip():
    block = ConvBlock(stride=(2, 1), padding=3, activation="none", pool="avg", pool_kernel=(3, 2),
                      pool_stride=2, pool_padding=(1, 0))
    d = block.to_json()
    assert d["stride"] == [2, 1] and d["pool"] == "avg"
    assert ConvBlock.from_json(d) == block
    assert ConvBlock.from_json({}) == PAPER_BLOCK


@pytest.mark.parametrize("kwargs,message", [
    ({"stride": 0}, r"ConvBlock stride must be a positive integer or a \(height, width\) pair of them, got 0"),
    ({"stride": (1, 2, 3)}, r"ConvBlock stride .* got \(1, 2, 3\)"),
    ({"padding": -1}, r"ConvBlock padding must be a non-negative integer .* got -1"),
    ({"padding": 1.5}, r"ConvBlock padding .* got 1.5"),
    ({"padding": True}, r"ConvBlock padding .* got True"),
    ({"pool_kernel": (2, 0)}, r"ConvBlock pool_kernel must be a positive integer .* got \(2, 0\)"),
    ({"activation": "tanh"}, r"ConvBlock activation must be one of \('relu', 'none'\), got 'tanh'"),
    ({"pool": "lp"}, r"ConvBlock pool must be one of \('max', 'avg', 'none'\), got 'lp'"),
    ({"pool_kernel": 3, "pool_padding": 2}, r"pool_padding \(2, 2\) must be at most half of pool_kernel \(3, 3\)"),
    ({"pool": "avg", "pool_kernel": (2, 4), "pool_padding": (1, 3)}, r"pool_padding \(1, 3\) must be at most half"),
])
def test_bad_block_values_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ConvBlock(**kwargs)


def test_block_json_with_unknown_keys_or_not_an_object_is_refused():
    with pytest.raises(ValueError, match=r"unknown conv block key\(s\) \['strides'\]"):
        ConvBlock.from_json({"strides": [1, 1]})
    with pytest.raises(ValueError, match="a conv block must be a JSON object, got"):
        ConvBlock.from_json([1, 1])


def test_output_shapes_follow_pytorchs_floor_rule():
    # conv: floor((H + 2p - k) / s) + 1; pool the same on the conv's output
    assert conv_output_shape((2, 3, 32, 32), (8, 3, 5, 5)) == (2, 8, 28, 28)
    assert conv_output_shape((2, 3, 227, 227), (96, 3, 11, 11), 4, 0) == (2, 96, 55, 55)
    assert conv_output_shape((1, 3, 10, 9), (4, 3, 3, 5), (2, 1), (1, 2)) == (1, 4, 5, 9)
    assert block_output_shape((2, 3, 227, 227), (96, 3, 11, 11), ConvBlock(stride=4, pool_kernel=3)) == (2, 96, 27, 27)
    assert block_output_shape((1, 3, 32, 32), (4, 3, 3, 3), ConvBlock(padding=1, pool="avg", pool_kernel=3,
                                                                        pool_padding=1)) == (1, 4, 16, 16)
    assert block_output_shape((1, 3, 7, 7), (4, 3, 3, 3), ConvBlock(pool="none")) == (1, 4, 5, 5)
    assert block_output_shape((1, 3, 7, 8), (4, 3, 3, 3), PAPER_BLOCK) == (1, 4, 2, 3)     # remainder dropped


@pytest.mark.parametrize("call,message", [
    (lambda: conv_output_shape((1, 1, 5, 5), (1, 1, 3, 3), 0), r"stride must be a positive integer .* got 0"),
    (lambda: conv_output_shape((1, 1, 5, 5), (1, 1, 3, 3), 1, (1, -1)), r"padding must be a non-negative integer .* got \(1, -1\)"),
    (lambda: conv_output_shape((1, 1, 5, 2), (1, 1, 3, 5), 1, (0, 1)), r"kernel 3x5 does not fit input 5x2 with padding \(0, 1\)"),
    (lambda: block_output_shape((1, 1, 5, 5), (1, 1, 3, 3), ConvBlock(pool_kernel=4)), r"conv output 3x3 is too small for a 4x4 max-pool"),
    (lambda: block_output_shape((1, 1, 5, 5), (1, 1, 3, 3), "paper"), r"block must be a ConvBlock, got str"),
])
def test_shape_errors_are_named(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call()


# ---- the reference's semantics, by hand ----------------------------------------------------------

def test_max_pool_ties_go_to_the_first_maximum_and_overlapping_windows_add():
    # 3x3 windows at stride 2 over a 5x5 plane share row 2 and column 2; the centre 9 is the
    # maximum of all four windows, so its gradient is the sum of all four
    y = np.zeros((1, 1, 5, 5), np.float32)
    y[0, 0, 2, 2] = 9
    dout = np.array([[1, 2], [3, 4]], np.float32).reshape(1, 1, 2, 2)
    dy = R.pool2d_backward(y, dout, "max", 3, 2, 0)
    assert dy[0, 0, 2, 2] == 10 and np.count_nonzero(dy) == 1
    # all equal: each window's gradient goes to its first element in row-major order
    dy = R.pool2d_backward(np.ones((1, 1, 5, 5), np.float32), dout, "max", 3, 2, 0)
    assert dy[0, 0, 0, 0] == 1 and dy[0, 0, 0, 2] == 2 and dy[0, 0, 2, 0] == 3 and dy[0, 0, 2, 2] == 4
    assert np.count_nonzero(dy) == 4


def test_max_pool_pads_with_minus_infinity_and_avg_pool_counts_its_padding():
    y = -np.arange(1, 10, dtype=np.float32).reshape(1, 1, 3, 3)          # all negative
    assert R.pool2d(y, "max", 2, 2, 1)[0, 0].tolist() == [[-1, -2], [-4, -5]]
    assert R.pool2d(np.ones((1, 1, 3, 3), np.float32), "avg", 2, 2, 1)[0, 0].tolist() == [[0.25, 0.5], [0.5, 1]]
    dy = R.pool2d_backward(np.ones((1, 1, 3, 3), np.float32), np.ones((1, 1, 2, 2), np.float32), "avg", 2, 2, 1)
    assert dy[0, 0].tolist() == [[0.25] * 3] * 3


def test_relu_blocks_the_gradient_where_the_pre_activation_is_not_positive():
    y = np.array([-1, 0, 2], np.float32)
    assert R.activation(y, "relu").tolist() == [0, 0, 2]
    assert R.activation_backward(y, np.ones(3, np.float32), "relu").tolist() == [0, 0, 1]
    assert R.activation_backward(y, np.ones(3, np.float32), "none").tolist() == [1, 1, 1]


def test_the_paper_block_is_the_old_conv_relu_pool():
    x, w, b, rng = tensors((2, 3, 9, 8, 4, 3, 3), 0)
    block = ConvBlock(padding=1)
    out = R.conv_block(x, w, b, block)
    np.testing.assert_allclose(out, R.conv_relu_pool(x, w, b, 1), rtol=1e-6)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    for got, old in zip(R.conv_block_backward(x, w, b, block, dout), R.conv_relu_pool_backward(x, w, b, dout, 1)):
        np.testing.assert_allclose(got, old, rtol=1e-5, atol=1e-6)


# ---- the reference against PyTorch ---------------------------------------------------------------

def torch_block(torch, x, w, b, block, dout):
    """out and (dx, dw, db) of the same block in PyTorch, float64."""
    F = torch.nn.functional
    xt, wt, bt = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (x, w, b))
    y = F.conv2d(xt, wt, bt, stride=block.stride, padding=block.padding)
    if block.activation == "relu":
        y = F.relu(y)
    if block.pool == "max":
        y = F.max_pool2d(y, block.pool_kernel, block.pool_stride, block.pool_padding)
    elif block.pool == "avg":
        y = F.avg_pool2d(y, block.pool_kernel, block.pool_stride, block.pool_padding, count_include_pad=True)
    (y * torch.tensor(dout, dtype=torch.float64)).sum().backward()
    return y.detach().numpy(), (xt.grad.numpy(), wt.grad.numpy(), bt.grad.numpy())


def oracle_close(got, expected):
    # 1e-5 relative; the absolute floor, 1e-7 of the largest magnitude, only covers entries
    # that sum to ~0
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7 * max(1.0, float(np.abs(expected).max())))


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("pool", POOLS, ids=ids(POOLS))
@pytest.mark.parametrize("conv", CONVS, ids=ids(CONVS))
def test_reference_block_matches_pytorch(conv, pool, activation):
    torch = pytest.importorskip("torch", reason="PyTorch is the oracle for the reference (pip install torch)")
    block = block_for(conv, pool, activation)
    x, w, b, rng = tensors(conv, 1)
    out = R.conv_block(x, w, b, block)
    assert out.shape == block_output_shape(x.shape, w.shape, block)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    expected_out, expected_grads = torch_block(torch, x, w, b, block, dout)
    oracle_close(out, expected_out)
    grads = R.conv_block_backward(x, w, b, block, dout)
    for name, got, expected in zip(("dx", "dw", "db"), grads, expected_grads):
        assert got.dtype == np.float32, name
        oracle_close(got, expected)
    dx, dw, db = R.conv_block_backward(x, w, b, block, dout, need_dx=False)
    assert dx is None
    oracle_close(dw, expected_grads[1])


@pytest.mark.parametrize("conv", CONVS, ids=ids(CONVS))
def test_reference_plain_conv_matches_pytorch(conv):
    torch = pytest.importorskip("torch", reason="PyTorch is the oracle for the reference (pip install torch)")
    x, w, b, rng = tensors(conv, 2)
    stride, padding = conv[7], conv[8]
    y = R.conv2d(x, w, b, stride, padding)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    expected_y, expected_grads = torch_block(torch, x, w, b, ConvBlock(stride=stride, padding=padding,
                                                                       activation="none", pool="none"), dy)
    oracle_close(y, expected_y)
    for got, expected in zip(R.conv2d_backward(x, w, dy, stride, padding), expected_grads):
        oracle_close(got, expected)


# ---- the CPU device against the reference ----------------------------------------------------------

def close(got, expected):
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5 * scale)


# both conv paths (the shifted one serves stride 1 only: a strided conv forced onto it takes
# im2col); one thread, whole batch, the forward's im2col kept for backward; two threads, chunked
# (one or two images per chunk), recomputed per chunk
CONFIGS = {"1thread": {"threads": 1},
           "2threads-chunked-recomputed": {"threads": 2, "im2col_budget_bytes": 6000, "saved_cols_budget_bytes": 0}}


@pytest.fixture(scope="module", params=[(name, path) for path in ("im2col", "shifted") for name in CONFIGS],
                ids=lambda p: f"{p[1]}-{p[0]}")
def cpu(request):
    name, path = request.param
    return open_device("cpu", conv_path=path, **CONFIGS[name])


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("pool", POOLS, ids=ids(POOLS))
@pytest.mark.parametrize("conv", CONVS, ids=ids(CONVS))
def test_cpu_block_matches_reference(cpu, conv, pool, activation):
    block = block_for(conv, pool, activation)
    x, w, b, rng = tensors(conv, 3)
    out, ctx = cpu.conv_block(x, w, b, block)
    assert out.dtype == np.float32
    close(out, R.conv_block(x, w, b, block))
    dout = rng.standard_normal(out.shape).astype(np.float32)
    expected = R.conv_block_backward(x, w, b, block, dout)
    for got, exp in zip(cpu.conv_block_backward(ctx, w, dout, need_dx=True), expected):
        close(got, exp)
    dx, dw, db = cpu.conv_block_backward(ctx, w, dout, need_dx=False)
    assert dx is None
    close(dw, expected[1])
    close(db, expected[2])


@pytest.mark.parametrize("conv", CONVS, ids=ids(CONVS))
def test_cpu_plain_conv_with_any_stride_matches_reference(cpu, conv):
    x, w, b, rng = tensors(conv, 4)
    stride, padding = conv[7], conv[8]
    y = cpu.conv2d(x, w, b, stride, padding)
    close(y, R.conv2d(x, w, b, stride, padding))
    dy = rng.standard_normal(y.shape).astype(np.float32)
    for need_dx in (True, False):
        got = cpu.conv2d_backward(x, w, dy, stride=stride, padding=padding, need_dx=need_dx)
        expected = R.conv2d_backward(x, w, dy, stride, padding, need_dx=need_dx)
        assert (got[0] is None) == (not need_dx)
        for a, e in zip(got, expected):
            if e is not None:
                close(a, e)


@pytest.mark.parametrize("pool", [p for p in POOLS if p[0] == "max"], ids=ids([p for p in POOLS if p[0] == "max"]))
@pytest.mark.parametrize("bias,activation", [(1.0, "relu"), (-1.0, "none")])
def test_cpu_max_pool_ties_go_to_the_first_maximum(cpu, pool, bias, activation):
    """Zero weights make every conv output equal to the bias: every window is a tie, and dW
    (the sum of dY times the input under each routed position) shows where the gradient went.
    With a negative bias and no ReLU, a padded window's maximum is -1, never the padding."""
    conv = (2, 3, 9, 8, 4, 3, 3, (1, 1), (1, 1))
    block = block_for(conv, pool, activation)
    x, _, _, rng = tensors(conv, 5)
    w = np.zeros((4, 3, 3, 3), np.float32)
    b = np.full(4, bias, np.float32)
    out, ctx = cpu.conv_block(x, w, b, block)
    np.testing.assert_array_equal(out, R.conv_block(x, w, b, block))
    assert np.all(out == bias)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    for got, expected in zip(cpu.conv_block_backward(ctx, w, dout), R.conv_block_backward(x, w, b, block, dout)):
        close(got, expected)


def test_paper_blocks_run_the_fused_paper_kernels():
    """conv_block with the paper's block (any conv padding, rectangular too) is conv_relu_pool:
    same outputs, and the 1-byte argmax of the fused paper kernels."""
    dev = open_device("cpu", threads=1)
    conv = (2, 3, 9, 8, 4, 3, 3)
    x, w, b, rng = tensors(conv, 6)
    out, ctx = dev.conv_block(x, w, b, ConvBlock(padding=1))
    old, old_ctx = dev.conv_relu_pool(x, w, b, 1)
    np.testing.assert_array_equal(out, old)
    assert ctx.argmax.dtype == np.int8 and old_ctx.argmax.dtype == np.int8
    block = ConvBlock(padding=(0, 2))
    out, ctx = dev.conv_block(x, w, b, block)
    assert ctx.argmax.dtype == np.int8
    close(out, R.conv_block(x, w, b, block))
    dout = rng.standard_normal(out.shape).astype(np.float32)
    for got, expected in zip(dev.conv_block_backward(ctx, w, dout), R.conv_block_backward(x, w, b, block, dout)):
        close(got, expected)


def test_auto_path_takes_shifted_gemms_for_a_generic_block_with_long_rows():
    dev = open_device("cpu", threads=1)
    conv = (2, 16, 7, 9, 3, 3, 5)
    x, w, b, rng = tensors(conv, 7)
    for stride, shifted in (((1, 1), True), ((2, 1), False)):
        block = ConvBlock(stride=stride, padding=(1, 2), pool="avg", pool_kernel=3, pool_stride=2, pool_padding=1)
        out, ctx = dev.conv_block(x, w, b, block)
        assert ctx.shifted is shifted
        close(out, R.conv_block(x, w, b, block))
        dout = rng.standard_normal(out.shape).astype(np.float32)
        for got, expected in zip(dev.conv_block_backward(ctx, w, dout), R.conv_block_backward(x, w, b, block, dout)):
            close(got, expected)


@pytest.mark.parametrize("call,message", [
    (lambda d: d.conv2d(np.ones((1, 1, 5, 5), np.float32), np.ones((1, 1, 3, 3), np.float32), None, stride=0),
     r"stride must be a positive integer or a \(height, width\) pair of them, got 0"),
    (lambda d: d.conv2d(np.ones((1, 1, 5, 5), np.float32), np.ones((1, 1, 3, 3), np.float32), None, padding=(1, 2, 3)),
     r"padding must be a non-negative integer .* got \(1, 2, 3\)"),
    (lambda d: d.conv2d_backward(np.ones((1, 1, 5, 5), np.float32), np.ones((1, 1, 3, 3), np.float32),
                                 np.ones((1, 1, 3, 3), np.float32), stride=2),
     r"dy shape must match the conv output, \(1, 1, 3, 3\) != \(1, 1, 2, 2\)"),
    (lambda d: d.conv_block(np.ones((1, 1, 5, 5), np.float32), np.ones((1, 1, 3, 3), np.float32), None, "avg"),
     "block must be a ConvBlock, got str"),
    (lambda d: d.conv_block(np.ones((1, 1, 5, 5), np.float32), np.ones((1, 1, 3, 3), np.float32), None,
                            ConvBlock(stride=2, pool_kernel=3)), r"conv output 2x2 is too small for a 3x3 max-pool"),
])
def test_bad_block_input_is_named(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call(open_device("cpu", threads=1))


def test_block_backward_with_wrong_gradient_shape_is_named():
    dev = open_device("cpu", threads=1)
    w = np.ones((2, 1, 3, 3), np.float32)
    out, ctx = dev.conv_block(np.ones((1, 1, 7, 7), np.float32), w, None, ConvBlock(pool="avg", pool_kernel=3, pool_stride=1))
    assert out.shape == (1, 2, 3, 3)
    with pytest.raises(ValueError, match=r"dout shape must match the block's output, \(1, 2, 2, 2\) != \(1, 2, 3, 3\)"):
        dev.conv_block_backward(ctx, w, np.ones((1, 2, 2, 2), np.float32))


@pytest.mark.parametrize("path", ("im2col", "shifted", "fft"))
@pytest.mark.parametrize("block", [PAPER_BLOCK, ConvBlock(padding=1, pool="avg", pool_kernel=3, pool_stride=2)],
                         ids=("paper", "avg3s2"))
def test_backward_writes_or_adds_dw_into_a_given_buffer(path, block):
    """dw_out takes dW in place of a fresh array (written, then added to with `accumulate`), so a
    step's micro-batches and steps reuse one buffer: the sums equal the fresh dWs' sums, and a
    written dw_out forgets what it held."""
    dev = open_device("cpu", threads=1, im2col_budget_bytes=3000, conv_path=path)   # chunked: dW sums over chunks
    conv = (3, 4, 10, 10, 5, 3, 3)
    x, w, b, rng = tensors(conv, 8)
    x2 = rng.standard_normal(x.shape).astype(np.float32)
    out, ctx = dev.conv_block(x, w, b, block)
    out2, ctx2 = dev.conv_block(x2, w, b, block)
    dout, dout2 = (rng.standard_normal(out.shape).astype(np.float32) for _ in range(2))
    fresh = dev.conv_block_backward(ctx, w, dout, need_dx=True)
    fresh2 = dev.conv_block_backward(ctx2, w, dout2, need_dx=False)
    out, ctx = dev.conv_block(x, w, b, block)
    out2, ctx2 = dev.conv_block(x2, w, b, block)
    buffer = np.full(w.shape, 7.0, np.float32)
    dx, dw, db = dev.conv_block_backward(ctx, w, dout, need_dx=True, dw_out=buffer)
    assert dw is buffer
    np.testing.assert_array_equal(dx, fresh[0])
    close(dw, fresh[1])
    np.testing.assert_array_equal(db, fresh[2])
    _, dw, _ = dev.conv_block_backward(ctx2, w, dout2, need_dx=False, dw_out=buffer, accumulate=True)
    assert dw is buffer
    close(dw, fresh[1] + fresh2[1])
    close(dw, R.conv_block_backward(x, w, b, block, dout)[1] + R.conv_block_backward(x2, w, b, block, dout2)[1])


def test_dw_out_of_the_wrong_shape_is_named():
    dev = open_device("cpu", threads=1)
    w = np.ones((2, 1, 3, 3), np.float32)
    out, ctx = dev.conv_block(np.ones((1, 1, 6, 6), np.float32), w, None, PAPER_BLOCK)
    with pytest.raises(ValueError, match=r"dw_out shape must match the weights, \(2, 1, 3, 2\) != \(2, 1, 3, 3\)"):
        dev.conv_block_backward(ctx, w, np.ones_like(out), dw_out=np.zeros((2, 1, 3, 2), np.float32))


# ---- dilation and groups on each CPU path that takes them ------------------------------------------
# (N, C, H, W, K, kh, kw, stride, padding, dilation, groups, pool): a grouped 3x3 (ResNeXt), a
# depthwise 3x3 and a strided one (MobileNet), a dilated dense conv and a dilated depthwise one
# (dilated ResNets), uneven pairs, a depthwise 5x5 with two kernels a channel (K = 2C), a strided
# 3x2 one with three and a dilated one at stride 1 (the depthwise path's other loops); each
# through a pool, or none
GROUPED = [
    (2, 4, 9, 8, 6, 3, 3, (1, 1), (1, 1), (1, 1), 2, ("max", 2, 2, 0)),
    (2, 4, 8, 8, 4, 3, 3, (1, 1), (1, 1), (1, 1), 4, ("none", 2, 2, 0)),
    (2, 6, 9, 9, 6, 3, 3, (2, 2), (1, 1), (1, 1), 6, ("avg", 3, 2, 1)),
    (2, 3, 11, 10, 4, 3, 3, (1, 1), (2, 2), (2, 2), 1, ("max", 3, 2, 1)),
    (1, 4, 12, 11, 8, 3, 3, (1, 2), (2, 1), (2, 1), 4, ("none", 2, 2, 0)),
    (2, 6, 10, 10, 3, 3, 2, (2, 1), (3, 0), (3, 2), 3, ("avg", 2, 2, 0)),
    (2, 3, 9, 10, 6, 5, 5, (1, 1), (2, 2), (1, 1), 3, ("max", 2, 2, 0)),
    (1, 2, 9, 8, 6, 3, 2, (2, 1), (1, 0), (1, 2), 2, ("none", 2, 2, 0)),
    (2, 4, 10, 9, 4, 3, 3, (1, 1), (2, 1), (2, 3), 4, ("avg", 2, 2, 0)),
]
# the paths that run them (oneDNN's where installed), and the forced ones that do not, which take im2col
GROUPED_PATHS = {"im2col": {"threads": 1}, "im2col-chunked": {"threads": 2, "conv_path": "im2col",
                                                              "im2col_budget_bytes": 3000,
                                                              "saved_cols_budget_bytes": 0},
                 "im2col-dnnl": {"threads": 1}, "direct-dnnl": {"threads": 1}, "shifted": {"threads": 1},
                 "fft": {"threads": 1}, "depthwise": {"threads": 2}}


@pytest.fixture(scope="module", params=list(GROUPED_PATHS))
def grouped_cpu(request):
    options = dict(GROUPED_PATHS[request.param])
    options.setdefault("conv_path", request.param)
    try:
        return request.param, open_device("cpu", **options)
    except Exception as e:              # noqa: BLE001  (oneDNN not installed: its paths only)
        if "dnnl" in request.param:
            pytest.skip(f"no oneDNN here: {e}")
        raise


def test_dilated_and_grouped_blocks_match_the_reference_on_every_cpu_path(grouped_cpu):
    name, cpu = grouped_cpu
    for case in GROUPED:
        n, c, h, wd, k, kh, kw, stride, padding, dilation, groups, pool = case
        kind, pk, ps, pp = pool
        rng = np.random.default_rng(11)
        x = rng.standard_normal((n, c, h, wd)).astype(np.float32)
        w = rng.standard_normal((k, c // groups, kh, kw)).astype(np.float32)
        b = rng.standard_normal(k).astype(np.float32)
        for activation in ACTIVATIONS:
            block = ConvBlock(stride=stride, padding=padding, dilation=dilation, groups=groups,
                              activation=activation, pool=kind, pool_kernel=pk, pool_stride=ps, pool_padding=pp)
            out, ctx = cpu.conv_block(x, w, b, block)
            close(out, R.conv_block(x, w, b, block))
            dout = rng.standard_normal(out.shape).astype(np.float32)
            expected = R.conv_block_backward(x, w, b, block, dout)
            for got, exp in zip(cpu.conv_block_backward(ctx, w, dout, need_dx=True), expected):
                close(got, exp)
        # the plain contract takes them too
        y = cpu.conv2d(x, w, b, stride, padding, dilation, groups)
        close(y, R.conv2d(x, w, b, stride, padding, dilation, groups))
        dy = rng.standard_normal(y.shape).astype(np.float32)
        for got, exp in zip(cpu.conv2d_backward(x, w, dy, stride, padding, True, dilation, groups),
                            R.conv2d_backward(x, w, dy, stride, padding, True, dilation, groups)):
            close(got, exp)
    runs = {c["path"]: c["why"] for c in cpu.conv_path_choices()}
    if name in ("shifted", "fft"):      # refused in the path choice: im2col runs them, and says why
        assert set(runs) == {"im2col"}, runs
        assert all("runs dense convs only" in why for why in runs.values()), runs
    elif name == "depthwise":           # the depthwise convs; the others im2col, saying why
        assert runs == {"depthwise": "forced", "im2col": "forced path depthwise runs depthwise convs only "
                                                         "(groups equal to the input channels)"}, runs
    else:
        assert set(runs) == {name.split("-chunked")[0]}, runs


DEPTHWISE = [case for case in GROUPED if case[10] == case[1]]


@pytest.mark.parametrize("case", DEPTHWISE, ids=ids(DEPTHWISE))
def test_the_depthwise_bf16_kernels_compute_the_reference_on_bf16_operands_in_the_same_bits_on_1_and_2_threads(case):
    """depthwise-bf16 (and float32, the same kernels) against the reference given x, w and dY
    rounded to bf16; every sum in an order fixed by the shapes, so a thread count changes no bit."""
    import numba

    from hetconv.devices.cpu_depthwise import DepthwiseConvs
    from hetconv.devices.dnnl import round_to_bf16
    n, c, h, wd, k, kh, kw, stride, padding, dilation, groups, _ = case
    rng = np.random.default_rng(12)
    x = rng.standard_normal((n, c, h, wd)).astype(np.float32)
    w = rng.standard_normal((k, 1, kh, kw)).astype(np.float32)
    y_shape = conv_output_shape(x.shape, w.shape, stride, padding, dilation, groups)
    dy = rng.standard_normal(y_shape).astype(np.float32)
    bits = {}
    for bf16 in (False, True):
        convs = DepthwiseConvs(bf16)
        for threads in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
            before = numba.get_num_threads()
            numba.set_num_threads(threads)
            try:
                y, dw = np.empty(y_shape, np.float32), np.empty(w.shape, np.float32)
                convs.forward(x, w, stride, padding, y, dilation=dilation, groups=groups)
                dx = convs.backward(x, w, dy, stride, padding, True, dw, dilation=dilation, groups=groups)
            finally:
                numba.set_num_threads(before)
            bits.setdefault(bf16, (y, dx, dw))
            for got, first in zip((y, dx, dw), bits[bf16]):
                np.testing.assert_array_equal(got, first)
        xr, wr, dyr = (round_to_bf16(a) for a in (x, w, dy)) if bf16 else (x, w, dy)
        zero = np.zeros(k, np.float32)
        close(y, R.conv2d(xr, wr, zero, stride, padding, dilation, groups))
        exp_dx, exp_dw, _ = R.conv2d_backward(xr, wr, dyr, stride, padding, True, dilation, groups)
        close(dx, exp_dx)
        close(dw, exp_dw)
    assert not np.array_equal(bits[False][0], bits[True][0])        # bf16 rounded something
