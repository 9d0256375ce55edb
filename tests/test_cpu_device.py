"""The CPU device against the numpy reference, over many shapes, plain and fused."""
import numpy as np
import pytest

from hetconv.net import reference as R
from hetconv.devices import DeviceError, open_device, parse_device
from hetconv.params import sgd_update

# (N, C, H, W, K, kh, kw, padding): batch 1, one channel, odd sizes, padding 0..2, kernels 1..5
SHAPES = [
    (1, 1, 5, 5, 1, 1, 1, 0),
    (1, 1, 6, 6, 1, 3, 3, 1),
    (2, 3, 9, 7, 4, 3, 3, 1),
    (3, 2, 8, 8, 5, 5, 5, 2),
    (2, 4, 6, 7, 3, 2, 3, 0),
    (1, 3, 11, 13, 6, 4, 2, 2),
    (4, 5, 7, 7, 2, 5, 5, 0),
    (2, 1, 10, 9, 7, 1, 4, 1),
]


def tensors(shape, seed):
    n, c, h, w, k, kh, kw, p = shape
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    wt = rng.standard_normal((k, c, kh, kw)).astype(np.float32)
    b = rng.standard_normal(k).astype(np.float32)
    return x, wt, b, p, rng


def close(a, b):
    scale = max(1.0, float(np.abs(b).max()))
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale)


# every configuration on both conv paths (the test shapes' C*kw is small, so "auto" would take
# im2col for all of them)
CONFIGS = {"1thread": {"threads": 1}, "2threads-chunked": {"threads": 2, "im2col_budget_bytes": 4000},
           "2threads-chunked-recomputed": {"threads": 2, "im2col_budget_bytes": 4000, "saved_cols_budget_bytes": 0}}
PATHS = ("im2col", "shifted")


@pytest.fixture(scope="module", params=[(name, path) for path in PATHS for name in CONFIGS],
                ids=lambda p: f"{p[1]}-{p[0]}")
def cpu(request):
    name, path = request.param
    return open_device("cpu", conv_path=path, **CONFIGS[name])


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_plain_forward_and_backward_match_reference(cpu, shape):
    x, w, b, p, rng = tensors(shape, 0)
    y = cpu.conv2d(x, w, b, padding=p)
    close(y, R.conv2d(x, w, b, padding=p))
    dy = rng.standard_normal(y.shape).astype(np.float32)
    for need_dx in (True, False):
        dx, dw, db = cpu.conv2d_backward(x, w, dy, padding=p, need_dx=need_dx)
        rdx, rdw, rdb = R.conv2d_backward(x, w, dy, padding=p, need_dx=need_dx)
        close(dw, rdw)
        close(db, rdb)
        if need_dx:
            close(dx, rdx)
        else:
            assert dx is None


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[2] + 2 * s[7] - s[5] >= 1 and s[3] + 2 * s[7] - s[6] >= 1], ids=str)
def test_fused_forward_and_backward_match_reference(cpu, shape):
    x, w, b, p, rng = tensors(shape, 1)
    y, ctx = cpu.conv_relu_pool(x, w, b, p)
    close(y, R.conv_relu_pool(x, w, b, p))
    dp = rng.standard_normal(y.shape).astype(np.float32)
    dx, dw, db = cpu.conv_relu_pool_backward(ctx, w, dp, need_dx=True)
    rdx, rdw, rdb = R.conv_relu_pool_backward(x, w, b, dp, p)
    close(dx, rdx)
    close(dw, rdw)
    close(db, rdb)
    dx, dw2, _ = cpu.conv_relu_pool_backward(ctx, w, dp, need_dx=False)
    assert dx is None
    close(dw2, rdw)


@pytest.mark.parametrize("path", PATHS)
def test_chunking_does_not_change_results(path):
    x, w, b, p, rng = tensors((9, 3, 8, 8, 4, 3, 3, 1), 2)
    whole = open_device("cpu", threads=1, conv_path=path)
    chunked = open_device("cpu", threads=1, im2col_budget_bytes=1, conv_path=path)    # one image per chunk
    y1, c1 = whole.conv_relu_pool(x, w, b, p)
    y2, c2 = chunked.conv_relu_pool(x, w, b, p)
    # The shifted path's GEMMs get narrower with one image per chunk, and the BLAS's edge
    # kernels for a narrow GEMM may sum in another order (seen with OpenBLAS's Haswell kernel):
    # equal up to float rounding there, bit-equal on the im2col path.
    if path == "im2col":
        np.testing.assert_array_equal(y1, y2)
    else:
        close(y2, y1)
    dp = rng.standard_normal(y1.shape).astype(np.float32)
    for a, r in zip(chunked.conv_relu_pool_backward(c2, w, dp), whole.conv_relu_pool_backward(c1, w, dp)):
        close(a, r)


@pytest.mark.parametrize("path", PATHS)
def test_saved_im2col_gives_the_recomputed_results_across_interleaved_steps(path):
    """Backward from the forward's kept im2col (or width expansion) equals backward that
    recomputes it, chunk boundaries included, when two forwards are in flight and buffers come
    back to the pool."""
    shapes = [(5, 3, 8, 7, 4, 3, 3, 1), (3, 2, 9, 9, 6, 5, 5, 2)]
    saved = open_device("cpu", threads=1, im2col_budget_bytes=700, conv_path=path)
    recomputed = open_device("cpu", threads=1, im2col_budget_bytes=700, saved_cols_budget_bytes=0, conv_path=path)
    for step in range(2):
        runs = []
        for seed, shape in enumerate(shapes):
            x, w, b, p, rng = tensors(shape, 10 * step + seed)
            y, ctx = saved.conv_relu_pool(x, w, b, p)
            y_ref, ctx_ref = recomputed.conv_relu_pool(x, w, b, p)
            assert ctx.cols is not None and ctx_ref.cols is None
            np.testing.assert_array_equal(y, y_ref)
            runs.append((ctx, ctx_ref, w, rng.standard_normal(y.shape).astype(np.float32)))
        for ctx, ctx_ref, w, dp in reversed(runs):
            for a, r in zip(saved.conv_relu_pool_backward(ctx, w, dp), recomputed.conv_relu_pool_backward(ctx_ref, w, dp)):
                np.testing.assert_array_equal(a, r)
            assert ctx.cols is None
    assert saved._saved_cols_pool, "backward hands its im2col buffer back for the next step"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", [s for s in SHAPES if s[2] + 2 * s[7] - s[5] >= 1 and s[3] + 2 * s[7] - s[6] >= 1], ids=str)
def test_sums_of_gemms_agree_with_and_without_blas_beta(path, shape):
    """Where the BLAS's sgemm cannot be called with beta = 1 the device adds each product from a
    temporary; both ways give the reference's results (chunked, so dW sums over chunks too)."""
    x, w, b, p, rng = tensors(shape, 5)
    with_beta = open_device("cpu", threads=1, im2col_budget_bytes=1, conv_path=path)
    without = open_device("cpu", threads=1, im2col_budget_bytes=1, conv_path=path)
    without._sgemm = None
    y1, c1 = with_beta.conv_relu_pool(x, w, b, p)
    y2, c2 = without.conv_relu_pool(x, w, b, p)
    close(y1, y2)
    dp = rng.standard_normal(y1.shape).astype(np.float32)
    got = with_beta.conv_relu_pool_backward(c1, w, dp)
    for a, r in zip(got, without.conv_relu_pool_backward(c2, w, dp)):
        close(a, r)
    close(y1, R.conv_relu_pool(x, w, b, p))
    for a, r in zip(got, R.conv_relu_pool_backward(x, w, b, dp, p)):
        close(a, r)


def test_auto_path_takes_shifted_gemms_only_for_long_rows():
    """The per-layer rule: conv1 (C*kw = 3*5) on im2col, conv2 (500*5) and anything with C*kw >= 64
    on shifted GEMMs; the fused context records which ran, and both agree with the reference."""
    from hetconv.devices.cpu_path_choice import SHIFTED_MIN_REDUCTION
    dev = open_device("cpu", threads=1)
    assert not dev._shifted((500, 3, 5, 5)) and dev._shifted((750, 500, 5, 5))
    assert not dev._shifted((1500, 500, 5, 5))      # the whole layer on one device: im2col is faster
    for c, kw, shifted in ((SHIFTED_MIN_REDUCTION // 4 - 1, 4, False), (SHIFTED_MIN_REDUCTION // 4, 4, True)):
        x, w, b, p, rng = tensors((2, c, 7, 6, 3, 2, kw, 1), 5)
        y, ctx = dev.conv_relu_pool(x, w, b, p)
        assert ctx.shifted is shifted
        close(y, R.conv_relu_pool(x, w, b, p))
        dp = rng.standard_normal(y.shape).astype(np.float32)
        for a, r in zip(dev.conv_relu_pool_backward(ctx, w, dp), R.conv_relu_pool_backward(x, w, b, dp, p)):
            close(a, r)


def test_unknown_conv_path_is_refused():
    with pytest.raises(DeviceError, match=r"conv_path must be one of \('auto', 'im2col', 'shifted', 'fft', 'im2col-dnnl', 'direct-dnnl', 'depthwise', 'winograd'\), "
                                           r"got 'direct'"):
        open_device("cpu", conv_path="direct")


def test_fused_forward_accepts_read_only_input(cpu):
    # arrays received from the network are read-only views of the frames
    x, w, b, p, rng = tensors((2, 2, 6, 6, 3, 3, 3, 0), 3)
    x.flags.writeable = False
    y, ctx = cpu.conv_relu_pool(x, w, b, p)
    dp = np.ones_like(y)
    dp.flags.writeable = False
    cpu.conv_relu_pool_backward(ctx, w, dp)


def test_sgd_matches_the_fc_rule(cpu):
    rng = np.random.default_rng(4)
    p, v, g = (rng.standard_normal(10).astype(np.float32) for _ in range(3))
    p2, v2 = p.copy(), v.copy()
    cpu.sgd_(p, v, g, 0.05, 0.9, 1e-3)
    sgd_update(p2, v2, g, 0.05, 0.9, 1e-3)
    np.testing.assert_array_equal(p, p2)
    np.testing.assert_array_equal(v, v2)


def test_upload_copies_so_received_buffers_are_never_written(cpu):
    w = np.ones(4, np.float32)
    w.flags.writeable = False
    owned = cpu.upload(w)
    owned += 1
    assert w[0] == 1 and owned.flags.writeable


@pytest.mark.parametrize("call,message", [
    (lambda d: d.conv2d(np.ones((1, 2, 5, 5)), np.ones((1, 2, 3, 3), np.float32), None), "x must be float32, got float64"),
    (lambda d: d.conv2d(np.ones((1, 2, 5, 5), np.float32), np.ones((1, 3, 3, 3), np.float32), None), "weights expect 3 input channels but input has 2"),
    (lambda d: d.conv2d(np.ones((2, 5, 5), np.float32), np.ones((1, 2, 3, 3), np.float32), None), "x must have 4 dimensions"),
    (lambda d: d.conv2d(np.ones((1, 1, 2, 2), np.float32), np.ones((1, 1, 3, 3), np.float32), None), "kernel 3x3 does not fit input 2x2"),
    (lambda d: d.conv2d(np.ones((1, 1, 5, 5), np.float32), np.ones((2, 1, 3, 3), np.float32), np.ones(3, np.float32)), "bias must have one value per kernel"),
    (lambda d: d.conv2d(np.ones((1, 1, 5, 5), np.float32), np.ones((2, 1, 3, 3), np.float32), None, padding=-1), "padding must be a non-negative integer"),
    (lambda d: d.conv2d_backward(np.ones((1, 1, 5, 5), np.float32), np.ones((2, 1, 3, 3), np.float32), np.ones((1, 2, 2, 2), np.float32)), "dy shape must match the conv output"),
    (lambda d: d.conv_relu_pool(np.ones((1, 1, 3, 3), np.float32), np.ones((1, 1, 3, 3), np.float32), None), "too small for a 2x2 max-pool"),
])
def test_bad_input_is_named(cpu, call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call(cpu)


def test_backward_with_wrong_gradient_shape_is_named(cpu):
    y, ctx = cpu.conv_relu_pool(np.ones((1, 1, 6, 6), np.float32), np.ones((2, 1, 3, 3), np.float32), None)
    with pytest.raises(ValueError, match=r"dpooled shape must match the pooled output, \(1, 2, 1, 1\) != \(1, 2, 2, 2\)"):
        cpu.conv_relu_pool_backward(ctx, np.ones((2, 1, 3, 3), np.float32), np.ones((1, 2, 1, 1), np.float32))


@pytest.mark.parametrize("spec", ["gpu", "cpu:1", "cuda:x", "tpu:0", ""])
def test_unknown_device_strings_are_refused(spec):
    with pytest.raises(DeviceError, match="unknown device"):
        parse_device(spec)


def test_threads_must_be_positive():
    with pytest.raises(DeviceError, match="threads must be a positive integer, got 0"):
        open_device("cpu", threads=0)


def test_numba_threads_sleep_between_parallel_regions_unless_the_user_chose():
    """Importing the CPU device sets OMP_WAIT_POLICY=PASSIVE before Numba starts its OpenMP
    threads (spinning ones took the cores from the BLAS threads: 1.5-3.4x slower small layers on
    two threads), and leaves a user's own setting alone."""
    import os
    import subprocess
    import sys
    code = "import os, hetconv.devices.cpu; print(os.environ.get('OMP_WAIT_POLICY'))"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    unset = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    chosen = subprocess.run([sys.executable, "-c", code], env={**env, "OMP_WAIT_POLICY": "ACTIVE"},
                            capture_output=True, text=True, timeout=120)
    assert (unset.stdout.strip(), chosen.stdout.strip()) == ("PASSIVE", "ACTIVE"), (unset.stderr, chosen.stderr)
