"""Small 3x3 layers (vgg-small's and airbench94's blocks) on the CPU device: the conv with no pool
and the 2x2 max-pool with no activation run their own kernels on each conv path's layout, and
give the numpy reference's outputs and gradients."""
import numpy as np
import pytest

from hetconv.devices import open_device
from hetconv.devices.base import ConvBlock
from hetconv.net import reference as R


def close(a, b):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-4)


def tensors(n, c, h, w, k, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, c, h, w)).astype(np.float32),
            (rng.standard_normal((k, c, 3, 3)) / np.sqrt(9 * c)).astype(np.float32),
            rng.standard_normal(k).astype(np.float32), rng)


# chunked: an im2col budget of ~2 images, so the kernels see n0 > 0 and a short last chunk
@pytest.fixture(scope="module", params=[(p, b) for p in ("im2col", "shifted") for b in (1 << 26, 12000)],
                ids=lambda p: f"{p[0]}-{'whole' if p[1] > 12000 else 'chunked'}")
def cpu(request):
    path, budget = request.param
    return open_device("cpu", threads=2, conv_path=path, im2col_budget_bytes=budget, saved_cols_budget_bytes=0)


@pytest.mark.parametrize("activation", ["relu", "none"])
def test_a_conv_without_pool_matches_the_reference(cpu, activation):
    x, w, b, rng = tensors(5, 3, 8, 6, 7, 1)
    block = ConvBlock(padding=1, activation=activation, pool="none")
    out, ctx = cpu.conv_block(x, w, b, block)
    close(out, R.conv_block(x, w, b, block))
    # a byte per conv output where ReLU passes; nothing kept without ReLU
    assert ctx.mask.dtype == np.uint8
    assert ctx.mask.shape == ((5, 7, 8, 6) if activation == "relu" else (0, 0, 0, 0))
    if activation == "relu":
        np.testing.assert_array_equal(ctx.mask, (out > 0).astype(np.uint8))
    dout = rng.standard_normal(out.shape).astype(np.float32)
    for got, expected in zip(cpu.conv_block_backward(ctx, w, dout), R.conv_block_backward(x, w, b, block, dout)):
        close(got, expected)


def test_relu_passes_no_gradient_where_the_conv_output_is_zero(cpu):
    """Zero weights and a zero bias: every conv output is 0, where ReLU (as PyTorch's) passes
    nothing back, so dW and db are zero."""
    x, _, _, rng = tensors(3, 2, 6, 6, 4, 2)
    w, b = np.zeros((4, 2, 3, 3), np.float32), np.zeros(4, np.float32)
    out, ctx = cpu.conv_block(x, w, b, ConvBlock(padding=1, pool="none"))
    assert not out.any()
    _, dw, db = cpu.conv_block_backward(ctx, w, rng.standard_normal(out.shape).astype(np.float32))
    assert not dw.any() and not db.any()


def test_a_max_pool_without_activation_runs_the_2x2_kernels(cpu):
    """airbench94's conv -> 2x2 max-pool (BatchNorm and GELU after it): the fused 2x2 kernels with
    a 1-byte argmax, every window routing its gradient (negative maxima included)."""
    x, w, b, rng = tensors(5, 3, 8, 6, 4, 3)
    b -= 3.0                                        # most maxima negative: ReLU's rule must not apply
    block = ConvBlock(padding=1, activation="none")
    out, ctx = cpu.conv_block(x, w, b, block)
    assert ctx.argmax.dtype == np.int8 and ctx.argmax.min() >= 0
    assert (out < 0).mean() > 0.5
    close(out, R.conv_block(x, w, b, block))
    dout = rng.standard_normal(out.shape).astype(np.float32)
    for got, expected in zip(cpu.conv_block_backward(ctx, w, dout), R.conv_block_backward(x, w, b, block, dout)):
        close(got, expected)


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (32, 4099), (5, 1024)])
def test_bias_sums_match_numpy_whatever_the_thread_count(shape):
    """The bias gradient's sums over rows (im2col layout) and over columns (shifted layout), in
    float64 whatever their order, and the same bits on 1 and 2 threads."""
    import numba

    from hetconv.devices.cpu_tails import _add_column_sums, _add_row_sums
    a = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
    got = {}
    for threads in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
        before = numba.get_num_threads()
        numba.set_num_threads(threads)
        try:
            rows, columns = np.ones(shape[0]), np.ones(shape[0])
            _add_row_sums(a, rows)
            _add_column_sums(np.ascontiguousarray(a.T), columns)
        finally:
            numba.set_num_threads(before)
        np.testing.assert_allclose(rows, 1 + a.sum(axis=1, dtype=np.float64), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(columns, 1 + a.sum(axis=1, dtype=np.float64), rtol=1e-12, atol=1e-12)
        got[threads] = (rows, columns)
    for rows, columns in got.values():
        np.testing.assert_array_equal(rows, got[1][0])
        np.testing.assert_array_equal(columns, got[1][1])
