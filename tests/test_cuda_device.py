"""The CUDA device against the numpy reference, on Numba's CUDA simulator when there is no GPU.

The simulator must be chosen before numba.cuda is first imported in this process: tests/conftest.py
sets NUMBA_ENABLE_CUDASIM=1 unless the environment says otherwise, and so does this module when
run alone. Every simulated GPU thread is a Python thread, so shapes are tiny, and the device uses
small tiles (4x4 threads, 16x16 outputs per block) so that these shapes still span several tiles.
"""
import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from numba import cuda  # noqa: E402

from _cuda_sim import assert_close as _close, dev, random_f32 as _random, short_thread_switches  # noqa: E402,F401,F811
from hetconv.net import reference  # noqa: E402
from hetconv.devices import DeviceError, open_device  # noqa: E402
import hetconv.devices.cuda as cudadev  # noqa: E402


# (N, C, H, W, K, kernel, padding): kernel sizes 1..5, padding 0..2, odd and non-square inputs,
# batch 1, one channel; K > 16 and N*Ho*Wo > 16 span several simulated tiles, none dividing evenly.
CASES = [
    (1, 1, 5, 5, 1, 1, 0),
    (2, 3, 6, 7, 5, 2, 0),
    (1, 2, 7, 5, 3, 3, 1),
    (2, 1, 6, 6, 18, 3, 2),
    (1, 3, 7, 7, 4, 4, 1),
    (2, 2, 9, 8, 6, 5, 2),
    (1, 4, 5, 6, 3, 5, 0),
    (3, 2, 5, 5, 17, 1, 1),
]


def _case_arrays(case, seed=0):
    n, c, h, w, k, ks, p = case
    rng = np.random.default_rng(seed)
    return _random(rng, n, c, h, w), _random(rng, k, c, ks, ks), _random(rng, k), p


# ---- opening the device ----------------------------------------------------------------------
def test_open_names_the_device(dev):
    assert dev.name == "cuda:0"
    assert dev.describe().startswith("cuda:0 (")


def test_bad_index_names_what_exists():
    count = len(cuda.gpus)                      # what numba reports: the simulator has one
    if count > 7:
        pytest.skip(f"this machine has {count} GPUs: cuda:7 exists")
    existing = "cuda:0" if count == 1 else f"cuda:0 .. cuda:{count - 1}"
    with pytest.raises(DeviceError, match=rf"cuda:7 requested but this machine has {count} GPUs? \({existing}\)"):
        open_device("cuda:7")


def test_unknown_option_is_refused():
    with pytest.raises(DeviceError, match=r"cuda:0 takes no options, got \['threads'\]"):
        open_device("cuda:0", threads=2)


def test_missing_driver_is_a_device_error():
    """Without the simulator and without a driver, opening says so (skipped where a GPU exists)."""
    code = ("from hetconv.devices import open_device, DeviceError\n"
            "try:\n    open_device('cuda:0')\nexcept DeviceError as e:\n    print('DeviceError:', e)\n"
            "else:\n    print('opened')\n")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    if out.stdout.strip() == "opened":
        pytest.skip("this machine has a CUDA driver and a GPU")
    assert out.stdout.startswith("DeviceError: cuda:0 requested but no CUDA driver found:"), out.stdout


# ---- the plain contract ------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=str)
def test_conv2d_matches_reference(dev, case):
    x, w, b, p = _case_arrays(case)
    _close(dev.conv2d(x, w, b, padding=p), reference.conv2d(x, w, b, padding=p), "y")


def test_conv2d_without_bias(dev):
    x, w, _, p = _case_arrays(CASES[2])
    _close(dev.conv2d(x, w, None, padding=p), reference.conv2d(x, w, None, padding=p), "y")


@pytest.mark.parametrize("case", CASES, ids=str)
def test_conv2d_backward_matches_reference(dev, case):
    x, w, _, p = _case_arrays(case)
    dy = _random(np.random.default_rng(1), *reference.conv2d(x, w, None, padding=p).shape)
    dx, dw, db = dev.conv2d_backward(x, w, dy, padding=p, need_dx=True)
    rdx, rdw, rdb = reference.conv2d_backward(x, w, dy, padding=p)
    _close(dx, rdx, "dx")
    _close(dw, rdw, "dw")
    _close(db, rdb, "db")


def test_conv2d_backward_without_dx(dev):
    x, w, _, p = _case_arrays(CASES[3])
    dy = _random(np.random.default_rng(1), *reference.conv2d(x, w, None, padding=p).shape)
    dx, dw, db = dev.conv2d_backward(x, w, dy, padding=p, need_dx=False)
    _, rdw, rdb = reference.conv2d_backward(x, w, dy, padding=p, need_dx=False)
    assert dx is None
    _close(dw, rdw, "dw")
    _close(db, rdb, "db")


def test_weight_grad_split_k_matches_reference(dev, monkeypatch):
    """Several reduction splits (as a GPU runs a large batch) add up to the same dw and db."""
    monkeypatch.setattr(cudadev, "WGRAD_MIN_R_PER_SPLIT", 8)   # N*Ho*Wo = 72 -> 9 splits
    x, w, _, p = _case_arrays((2, 2, 6, 6, 5, 3, 1))
    dy = _random(np.random.default_rng(1), 2, 5, 6, 6)
    _, dw, db = dev.conv2d_backward(x, w, dy, padding=p, need_dx=False)
    _, rdw, rdb = reference.conv2d_backward(x, w, dy, padding=p, need_dx=False)
    _close(dw, rdw, "dw")
    _close(db, rdb, "db")


# ---- the fused form ---------------------------------------------------------------------------
FUSED_CASES = [c for c in CASES if min(c[2], c[3]) + 2 * c[6] - c[5] + 1 >= 2]   # conv output fits a 2x2 pool


def _check_fused(dev, x, w, b, p, need_dx, resident):
    w_arg, b_arg = (dev.upload(w), dev.upload(b)) if resident else (w, b)
    pooled, ctx = dev.conv_relu_pool(x, w_arg, b_arg, padding=p)
    assert isinstance(pooled, np.ndarray) and pooled.dtype == np.float32
    _close(pooled, reference.conv_relu_pool(x, w, b, p), "pooled")
    assert tuple(ctx.pooled_shape) == pooled.shape

    dpooled = _random(np.random.default_rng(2), *pooled.shape)
    dx, dw, db = dev.conv_relu_pool_backward(ctx, w_arg, dpooled, need_dx=need_dx)
    rdx, rdw, rdb = reference.conv_relu_pool_backward(x, w, b, dpooled, p, need_dx=need_dx)
    assert not isinstance(dw, np.ndarray) and not isinstance(db, np.ndarray), "dw, db stay on the device"
    _close(dev.download(dw), rdw, "dw")
    _close(dev.download(db), rdb, "db")
    if need_dx:
        _close(dx, rdx, "dx")
    else:
        assert dx is None


@pytest.mark.parametrize("case", FUSED_CASES, ids=str)
def test_conv_relu_pool_matches_reference(dev, case):
    x, w, b, p = _case_arrays(case)
    _check_fused(dev, x, w, b, p, need_dx=True, resident=False)


def test_conv_relu_pool_with_resident_weights_and_no_dx(dev):
    x, w, b, p = _case_arrays(CASES[5])          # 9x8 input, 5x5 kernel, padding 2: odd conv output
    _check_fused(dev, x, w, b, p, need_dx=False, resident=True)


def test_pool_ties_go_to_the_first_maximum_and_relu_cuts(dev):
    """A zero input makes every conv output equal its bias: all windows tie. Positive bias: the
    gradient goes to each window's top-left element; negative bias: ReLU passes none."""
    x = np.zeros((1, 2, 5, 5), np.float32)
    w = _random(np.random.default_rng(3), 2, 2, 1, 1)
    b = np.array([0.5, -0.5], np.float32)
    _check_fused(dev, x, w, b, 0, need_dx=True, resident=False)


def test_fused_backward_checks_the_weight_shape(dev):
    x, w, b, p = _case_arrays(CASES[1])
    _, ctx = dev.conv_relu_pool(x, w, b, padding=p)
    dpooled = np.zeros(ctx.pooled_shape, np.float32)
    with pytest.raises(ValueError, match=r"w shape must be \(5, 3, 2, 2\), got \(5, 3, 3, 3\)"):
        dev.conv_relu_pool_backward(ctx, np.zeros((5, 3, 3, 3), np.float32), dpooled)


def test_gpu_tile_sizes_under_the_simulator(dev, monkeypatch):
    """The tile sizes a real GPU uses (16x16 threads, 64x64 outputs, 16-deep reduction), run once."""
    threads, micro, depth = 16, 4, 16
    for name, value in dict(THREADS_X=threads, THREADS_Y=threads, THREADS=threads * threads,
                            MICRO_M=micro, MICRO_N=micro, TILE_M=threads * micro, TILE_N=threads * micro,
                            A_ROW=threads * micro + 1, B_ROW=threads * micro + 1, TILE_R=depth,
                            A_LOADS=depth * micro // threads, B_LOADS=depth * micro // threads).items():
        assert hasattr(cudadev, name), name
        monkeypatch.setattr(cudadev, name, value)
    x, w, b, p = _case_arrays((1, 2, 5, 5, 3, 3, 1))
    _check_fused(dev, x, w, b, p, need_dx=True, resident=True)


# ---- parameters on the device ------------------------------------------------------------------
def test_upload_download_zeros_like(dev):
    a = _random(np.random.default_rng(4), 3, 2, 2, 2)
    on_device = dev.upload(a)
    assert not isinstance(on_device, np.ndarray)
    assert dev._shape(on_device) == a.shape
    np.testing.assert_array_equal(dev.download(on_device), a)
    zeros = dev.zeros_like(on_device)
    np.testing.assert_array_equal(dev.download(zeros), np.zeros_like(a))
    dev.synchronize()


@pytest.mark.parametrize("shape", [(3, 2, 3, 3), (7,)], ids=["weights", "bias"])
def test_sgd_matches_pytorch_formula(dev, shape):
    rng = np.random.default_rng(5)
    param, grad = _random(rng, *shape), _random(rng, *shape)
    velocity = np.zeros(shape, np.float32)
    p_dev, v_dev, g_dev = dev.upload(param), dev.zeros_like(param), dev.upload(grad)
    lr, momentum, weight_decay = 0.05, 0.9, 1e-3
    for _ in range(3):   # the momentum term matters from the second step on
        dev.sgd_(p_dev, v_dev, g_dev, lr, momentum, weight_decay)
        velocity = momentum * velocity + grad + weight_decay * param
        param = param - lr * velocity
    np.testing.assert_allclose(dev.download(v_dev), velocity, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dev.download(p_dev), param, rtol=1e-5, atol=1e-6)


def test_sgd_refuses_host_arrays(dev):
    a = np.zeros(4, np.float32)
    with pytest.raises(TypeError, match="sgd_ updates arrays on cuda:0: param is ndarray, upload it first"):
        dev.sgd_(a, dev.upload(a), dev.upload(a), 0.1, 0.9, 0.0)


def test_sgd_checks_shapes(dev):
    with pytest.raises(ValueError, match=r"grad shape must match param, \(5,\) != \(4,\)"):
        dev.sgd_(dev.upload(np.zeros(4, np.float32)), dev.zeros_like(np.zeros(4, np.float32)),
                 dev.upload(np.zeros(5, np.float32)), 0.1, 0.9, 0.0)


def test_a_dilated_or_grouped_layer_loads_on_a_shard(dev):
    """The kernels run grouped and dilated convs (tests/test_cuda_block.py checks them): a shard on
    this device takes such a layer."""
    from hetconv.engine.shard import ConvShard
    from hetconv.geometry import ConvBlock, ConvSpec
    depthwise = ConvSpec(4, 4, 3, 3, ConvBlock(groups=4, activation="none", pool="none"))
    dilated = ConvSpec(4, 4, 3, 3, ConvBlock(dilation=2, pool="none"))
    shard = ConvShard(dev)
    for layer, spec in enumerate((depthwise, dilated)):
        assert dev.declines_block(spec.block) == ""
        shard.load(layer, spec, 0, 4, spec.initial_state(np.zeros(spec.weight_shape, np.float32)))
    assert sorted(shard.layers) == [0, 1]
