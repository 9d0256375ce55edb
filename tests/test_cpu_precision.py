"""The CPU device's oneDNN paths against the numpy reference: im2col-dnnl and direct-dnnl (oneDNN's
convolutions) in fp32 at the fp32 tolerances, im2col-bf16 and direct-bf16 to float32 rounding
against the reference on bf16-rounded operands, at a bf16 tolerance against the fp32 reference and PyTorch's bf16 autocast; and the
precision option: what it refuses, what it says, and that "auto" never takes bf16 where it is
slower."""
import numpy as np
import pytest

from _bf16 import INSTRUCTIONS_MISSING, emulated, needs_dnnl, needs_instructions
from hetconv.devices import DeviceError, cpu_path_choice, dnnl, open_device
from hetconv.devices.base import ConvBlock, empty_channels_last
from hetconv.net import reference as R

MISSING = dnnl.unavailable_reason()

# (N, C, H, W, K, kh, kw, stride, padding): odd sizes, 1x1 to 5x5 kernels, strides 1 and 2
CONVS = [
    (1, 1, 5, 5, 1, 1, 1, 1, 0),
    (2, 3, 9, 7, 4, 3, 3, 1, 1),
    (3, 2, 8, 8, 5, 5, 5, 1, 2),
    (1, 3, 11, 13, 6, 4, 2, 2, 2),
    (4, 5, 7, 7, 2, 5, 5, 1, 0),
    (2, 6, 10, 9, 7, 3, 3, 2, 1),
]
BLOCKS = [ConvBlock(padding=1),                                               # the paper's block
          ConvBlock(stride=2, padding=1, pool="avg", pool_kernel=3, pool_stride=2, pool_padding=1),
          ConvBlock(padding=2, activation="none", pool="max", pool_kernel=3, pool_stride=1),
          ConvBlock(padding=1, pool="none")]
# chunked (several chunks of images, a short last one) and with backward recomputing the im2col
CONFIGS = {"1thread": {"threads": 1}, "2threads-chunked": {"threads": 2, "im2col_budget_bytes": 4000},
           "2threads-chunked-recomputed": {"threads": 2, "im2col_budget_bytes": 4000, "saved_cols_budget_bytes": 0}}


def tensors(conv, seed):
    n, c, h, w, k, kh, kw = conv[:7]
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, c, h, w)).astype(np.float32), rng.standard_normal((k, c, kh, kw)).astype(np.float32),
            rng.standard_normal(k).astype(np.float32), rng)


def close(a, b, rtol=1e-4):
    scale = max(1.0, float(np.abs(b).max()))
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * 0.1 * scale)


def bf16_close(a, b):
    """Within what bf16 operands cost: a few parts in a thousand of the largest value."""
    assert np.abs(a - b).max() <= 1.5e-2 * max(1.0, float(np.abs(b).max())), float(np.abs(a - b).max())


def bf16(a):
    return dnnl.round_to_bf16(a)


def block_reference_bf16(x, w, b, block, dout):
    """(out, dx, dw, db) of the block with the conv's GEMM operands in bf16: x and w rounded for
    the conv, and dY (after the pool and activation backward) rounded for dX and dW; the bias and
    its gradient from the float32 values."""
    rx, rw = bf16(x), bf16(w)
    y = R.conv2d(rx, rw, b, block.stride, block.padding)
    pool = (block.pool, block.pool_kernel, block.pool_stride, block.pool_padding)
    a = R.activation(y, block.activation)
    out = R.pool2d(a, *pool) if block.pool != "none" else a
    da = R.pool2d_backward(a, dout, *pool) if block.pool != "none" else dout
    dy = R.activation_backward(y, da, block.activation)
    dx, dw, _ = R.conv2d_backward(rx, rw, bf16(dy), block.stride, block.padding)
    return out, dx, dw, dy.sum(axis=(0, 2, 3), dtype=np.float64).astype(np.float32)


# the forced path of each fixture's device: (conv_path, the path it runs); the direct paths once
# with a saved input and once recomputing it (the config's saved-cols budget)
FLOAT32_PATHS = [("im2col-dnnl", "im2col-dnnl", c) for c in CONFIGS] + [
    ("direct-dnnl", "direct-dnnl", c) for c in ("1thread", "2threads-chunked-recomputed")]
# ... and whether its bf16 GEMMs run on the emulation (on any CPU) rather than the CPU's own
BF16_FORCED = [("auto", "im2col-bf16", c, False) for c in CONFIGS] + [
    ("direct-dnnl", "direct-bf16", c, False) for c in ("1thread", "2threads-chunked-recomputed")] + [
    ("auto", "im2col-bf16", c, True) for c in ("1thread", "2threads-chunked-recomputed")]


@pytest.fixture(scope="module", params=FLOAT32_PATHS, ids=lambda p: f"{p[0]}-{p[2]}")
def dnnl_cpu(request):
    if MISSING:
        pytest.skip(f"oneDNN is an optional extra: {MISSING}")
    conv_path, runs, config = request.param
    cpu = open_device("cpu", conv_path=conv_path, **CONFIGS[config])
    cpu.expected_path = runs
    return cpu


@pytest.fixture(scope="module", params=BF16_FORCED, ids=lambda p: f"{p[1]}-{p[2]}" + ("-emulated" if p[3] else ""))
def bf16_cpu(request):
    conv_path, runs, config, on_emulation = request.param
    if MISSING:
        pytest.skip(f"oneDNN is an optional extra: {MISSING}")
    if runs == "direct-bf16" and INSTRUCTIONS_MISSING:
        pytest.skip(f"oneDNN's bf16 convolutions need the CPU's bf16 instructions: {INSTRUCTIONS_MISSING}")
    options = dict(precision="bf16", conv_path=conv_path, **CONFIGS[config])
    cpu = emulated(**options) if on_emulation else open_device("cpu", **options)
    cpu.expected_path = runs
    return cpu


# ---- im2col-dnnl: float32 ------------------------------------------------------------------------
@pytest.mark.parametrize("conv", CONVS, ids=str)
def test_dnnl_plain_conv_matches_the_reference(dnnl_cpu, conv):
    x, w, b, rng = tensors(conv, 0)
    stride, p = conv[7], conv[8]
    y = dnnl_cpu.conv2d(x, w, b, stride=stride, padding=p)
    close(y, R.conv2d(x, w, b, stride, p))
    dy = rng.standard_normal(y.shape).astype(np.float32)
    for need_dx in (True, False):
        got = dnnl_cpu.conv2d_backward(x, w, dy, stride=stride, padding=p, need_dx=need_dx)
        want = R.conv2d_backward(x, w, dy, stride, p, need_dx)
        for g, r in zip(got, want):
            assert (g is None) == (r is None)
            if r is not None:
                close(g, r)
    assert set(dnnl_cpu.conv_paths().values()) == {dnnl_cpu.expected_path}
    if dnnl_cpu.expected_path == "direct-dnnl":       # oneDNN names the kernels it ran
        assert all(set(c["kernels"]) == {"forward", "backward-data", "backward-weights"}
                   for c in dnnl_cpu.conv_path_choices())
        assert all("; oneDNN forward " in line for line in dnnl_cpu.describe_conv_paths())


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_dnnl_blocks_match_the_reference_and_accumulate_dw(dnnl_cpu, block):
    x, w, b, rng = tensors((3, 4, 10, 9, 6, 3, 3), 1)
    out, ctx = dnnl_cpu.conv_block(x, w, b, block)
    close(out, R.conv_block(x, w, b, block))
    dout = rng.standard_normal(out.shape).astype(np.float32)
    dx, dw, db = dnnl_cpu.conv_block_backward(ctx, w, dout, need_dx=True)
    rdx, rdw, rdb = R.conv_block_backward(x, w, b, block, dout)
    close(dx, rdx)
    close(dw, rdw)
    close(db, rdb)
    out, ctx = dnnl_cpu.conv_block(x, w, b, block)
    kept = np.ones_like(w)
    dnnl_cpu.conv_block_backward(ctx, w, dout, need_dx=False, dw_out=kept, accumulate=True)
    close(kept, rdw + 1)


# ---- im2col-bf16 ----------------------------------------------------------------------------------
@pytest.mark.parametrize("conv", CONVS, ids=str)
def test_bf16_plain_conv_is_the_conv_of_rounded_operands(bf16_cpu, conv):
    x, w, b, rng = tensors(conv, 2)
    stride, p = conv[7], conv[8]
    y = bf16_cpu.conv2d(x, w, b, stride=stride, padding=p)
    close(y, R.conv2d(bf16(x), bf16(w), b, stride, p))
    bf16_close(y, R.conv2d(x, w, b, stride, p))
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dx, dw, db = bf16_cpu.conv2d_backward(x, w, dy, stride=stride, padding=p)
    rdx, rdw, _ = R.conv2d_backward(bf16(x), bf16(w), bf16(dy), stride, p)
    close(dx, rdx)
    close(dw, rdw)
    close(db, R.conv2d_backward(x, w, dy, stride, p)[2])           # the bias's gradient: float32 dY
    fdx, fdw, _ = R.conv2d_backward(x, w, dy, stride, p)
    bf16_close(dx, fdx)
    bf16_close(dw, fdw)
    assert bf16_cpu.conv2d_backward(x, w, dy, stride=stride, padding=p, need_dx=False)[0] is None


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_bf16_blocks_round_only_the_gemm_operands(bf16_cpu, block):
    x, w, b, rng = tensors((3, 4, 10, 9, 6, 3, 3), 3)
    out, ctx = bf16_cpu.conv_block(x, w, b, block)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    dx, dw, db = bf16_cpu.conv_block_backward(ctx, w, dout, need_dx=True)
    rout, rdx, rdw, rdb = block_reference_bf16(x, w, b, block, dout)
    close(out, rout)
    close(dx, rdx)
    close(dw, rdw)
    close(db, rdb)
    bf16_close(out, R.conv_block(x, w, b, block))
    out, ctx = bf16_cpu.conv_block(x, w, b, block)
    kept = np.ones_like(w)
    bf16_cpu.conv_block_backward(ctx, w, dout, need_dx=False, dw_out=kept, accumulate=True)
    close(kept, rdw + 1)
    assert set(bf16_cpu.conv_paths().values()) == {bf16_cpu.expected_path}


@needs_dnnl
@pytest.mark.parametrize("conv_path", ["auto", "direct-dnnl"])
@pytest.mark.parametrize("conv", CONVS[1:4], ids=str)
def test_bf16_conv_agrees_with_pytorchs_bf16_autocast(conv, conv_path):
    if conv_path == "direct-dnnl" and INSTRUCTIONS_MISSING:
        pytest.skip(f"oneDNN's bf16 convolutions need the CPU's bf16 instructions: {INSTRUCTIONS_MISSING}")
    torch = pytest.importorskip("torch", reason="PyTorch is an optional extra")
    F = torch.nn.functional
    x, w, b, rng = tensors(conv, 4)
    stride, p = conv[7], conv[8]
    cpu = open_device("cpu", threads=1, precision="bf16", conv_path=conv_path)
    y = cpu.conv2d(x, w, b, stride=stride, padding=p)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dx, dw, db = cpu.conv2d_backward(x, w, dy, stride=stride, padding=p)
    tx, tw, tb = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ty = F.conv2d(tx, tw, tb, stride=stride, padding=p)
    assert ty.dtype == torch.bfloat16
    ty.float().backward(torch.tensor(dy))
    for ours, theirs in ((y, ty), (dx, tx.grad), (dw, tw.grad), (db, tb.grad)):
        bf16_close(ours, theirs.detach().float().numpy())


# ---- the precision option -------------------------------------------------------------------------
def test_an_unknown_precision_is_refused():
    with pytest.raises(DeviceError, match="^precision must be one of fp32, bf16, auto, got 'fp16'$"):
        open_device("cpu", precision="fp16")


def test_bf16_with_a_forced_float32_path_is_refused():
    with pytest.raises(DeviceError, match="^precision bf16 runs every conv on a bf16 path: conv path 'shifted' "
                                          "cannot be forced with it \\(direct-dnnl can: oneDNN's convolutions in "
                                          "bf16\\)$"):
        open_device("cpu", precision="bf16", conv_path="shifted")


@pytest.mark.parametrize("options,asked", [({"precision": "bf16"}, "precision bf16"),
                                          ({"conv_path": "im2col-dnnl"}, "conv path im2col-dnnl")])
def test_asking_for_onednn_without_it_is_one_line(monkeypatch, options, asked):
    monkeypatch.delenv(dnnl.LIBRARY_ENV, raising=False)
    monkeypatch.setattr(dnnl, "_candidates", lambda: [])
    monkeypatch.setattr(dnnl, "_loaded", {})
    with pytest.raises(DeviceError) as e:
        open_device("cpu", threads=1, **options)
    assert str(e.value).startswith(f"{asked} needs oneDNN: oneDNN is not installed")
    assert "pip install 'hetconv[onednn]'" in str(e.value) and "\n" not in str(e.value)


def test_without_onednn_fp32_and_auto_run_as_before(monkeypatch):
    monkeypatch.delenv(dnnl.LIBRARY_ENV, raising=False)
    monkeypatch.setattr(dnnl, "_candidates", lambda: [])
    monkeypatch.setattr(dnnl, "_loaded", {})
    timed = []
    for precision in ("fp32", "auto"):
        cpu = open_device("cpu", threads=1, precision=precision, auto_timed_min_flops=0,
                          auto_timer=lambda path, run: timed.append(path) or 1.0)
        x, w, b, _ = tensors((2, 4, 9, 9, 3, 3, 3), 5)
        cpu.conv2d(x, w, b)
        assert cpu.describe().endswith(f"precision {precision})" if precision == "fp32" else
                                       "precision auto (float32 only: no oneDNN))")
    assert set(timed) == {"im2col", "shifted", "fft"}


def test_a_device_opened_without_onednn_runs_as_without_it():
    """onednn=False: OpenBLAS's paths only, whatever is installed; bf16 cannot be asked of it."""
    cpu = open_device("cpu", threads=1, precision="auto", onednn=False, auto_timed_min_flops=0,
                      auto_timer=lambda path, run: {"im2col": 1.0, "shifted": 2.0, "fft": 3.0}[path])
    x, w, b, _ = tensors((2, 4, 9, 9, 3, 3, 3), 8)
    cpu.conv2d(x, w, b)
    assert set(cpu.conv_path_choices()[0]["seconds"]) == {"im2col", "shifted", "fft"}
    assert cpu.describe().endswith("precision auto (float32 only: no oneDNN))")
    with pytest.raises(DeviceError, match="^precision bf16 needs oneDNN, which this device was opened without$"):
        open_device("cpu", precision="bf16", onednn=False)


@needs_dnnl
def test_the_device_names_its_gemm_library_and_precision():
    cpu = open_device("cpu", threads=1, precision="auto")
    lib = dnnl.load()
    assert f"oneDNN {lib.version} ({lib.runtime}, {lib.isa})" in cpu.describe()
    assert cpu.describe().endswith("precision auto)" if not lib.bf16_error else "")


def _faked(precision, seconds, **options):
    """A device whose path timings are `seconds` (path -> seconds of one run), timing every call."""
    return open_device("cpu", threads=1, precision=precision, auto_timed_min_flops=0,
                       auto_timer=lambda path, run: seconds[path], **options)


SLOWER_BF16 = {"im2col": 1.0, "shifted": 1.2, "fft": 3.0, "im2col-dnnl": 0.9, "im2col-bf16": 0.95,
               "shifted-dnnl": 1.1, "shifted-bf16": 0.97, "direct-dnnl": 1.15, "direct-bf16": 1.1}


@needs_instructions
@pytest.mark.parametrize("seconds,chosen", [
    (SLOWER_BF16, "im2col-dnnl"),                                   # bf16 slower than the best fp32 path
    ({**SLOWER_BF16, "im2col-bf16": 0.88}, "im2col-dnnl"),          # faster, but within its margin
    ({**SLOWER_BF16, "im2col-bf16": 0.5}, "im2col-bf16"),           # well faster
    ({**SLOWER_BF16, "direct-dnnl": 0.95}, "direct-dnnl"),          # im2col-dnnl (NCHW) within the layout margin
    ({**SLOWER_BF16, "im2col-bf16": 0.5, "direct-bf16": 0.55}, "direct-bf16"),   # the same among bf16 paths
    ({**SLOWER_BF16, "im2col-bf16": 0.5, "fft": 0.4}, "fft"),      # FFT faster still
    ({**SLOWER_BF16, "direct-dnnl": 0.6}, "direct-dnnl"),           # oneDNN's own convolution
    ({**SLOWER_BF16, "direct-dnnl": 0.6, "direct-bf16": 0.3}, "direct-bf16"),
    ({**SLOWER_BF16, "direct-dnnl": 0.6, "direct-bf16": 0.59}, "direct-dnnl"),   # bf16 within its margin
])
def test_auto_takes_bf16_only_where_it_times_faster(seconds, chosen):
    cpu = _faked("auto", seconds)
    x, w, b, _ = tensors((2, 4, 9, 9, 3, 3, 3), 6)
    cpu.conv2d(x, w, b)
    out, ctx = cpu.conv_block(x, w, b, ConvBlock())
    assert set(cpu.conv_paths().values()) == {chosen}
    assert all(set(c["seconds"]) == set(seconds) for c in cpu.conv_path_choices())


@needs_dnnl
@pytest.mark.parametrize("conv", [(2, 4, 9, 9, 3, 3, 3), (2, 4, 9, 9, 4, 3, 3, 1, 1, 2)], ids=["dense", "grouped"])
def test_auto_on_a_cpu_without_bf16_times_and_takes_exactly_the_float32_choice(conv):
    """The emulation is for correctness, never speed: auto neither times nor takes it, even where
    its timings would be the fastest, and chooses as precision fp32 does."""
    groups = conv[9] if len(conv) > 9 else 1
    block = ConvBlock(groups=groups, activation="none", pool="none")
    n, c, h, wd, k, kh, kw = conv[:7]
    rng = np.random.default_rng(12)
    x = rng.standard_normal((n, c, h, wd)).astype(np.float32)
    w = rng.standard_normal((k, c // groups, kh, kw)).astype(np.float32)
    b = rng.standard_normal(k).astype(np.float32)
    seconds = {**SLOWER_BF16, "im2col-bf16": 0.01, "shifted-bf16": 0.01, "direct-bf16": 0.01, "depthwise": 2.0}
    choices = {}
    for precision in ("auto", "fp32"):
        timed = []
        cpu = emulated(threads=1, precision=precision, auto_timed_min_flops=0,
                       auto_timer=lambda path, run: timed.append(path) or seconds[path])
        cpu.conv_block(x, w, b, block)
        assert not [p for p in timed if p.endswith("-bf16")], timed
        choices[precision] = (sorted(timed), cpu.conv_paths())
    assert choices["auto"] == choices["fp32"]
    assert cpu.describe().endswith("precision fp32)")
    auto = emulated(threads=1, precision="auto")
    assert auto.describe().endswith("precision auto (float32 only: no bf16 GEMM on this CPU))")


@needs_dnnl
def test_bf16_on_a_cpu_without_bf16_runs_emulated_gemms_and_refuses_onednns_bf16_convolutions():
    cpu = emulated(threads=1, precision="bf16")
    assert cpu.describe().endswith("precision bf16 (emulated: no bf16 GEMM on this CPU; the same sums, slower than "
                                   "float32))")
    x, w, b, _ = tensors((2, 4, 9, 9, 3, 3, 3), 13)
    close(cpu.conv2d(x, w, b), R.conv2d(bf16(x), bf16(w), b, 1, 0), rtol=1e-5)
    assert set(cpu.conv_paths().values()) == {"im2col-bf16"}
    with pytest.raises(DeviceError, match=r"^precision bf16 with conv path direct-dnnl runs oneDNN's bf16 "
                                          r"convolutions, which this CPU lacks \(.*\); conv path auto runs bf16 on "
                                          r"emulated GEMMs here$"):
        emulated(threads=1, precision="bf16", conv_path="direct-dnnl")


@needs_dnnl
def test_fp32_never_times_bf16_and_small_calls_stay_float32():
    cpu = _faked("fp32", {**SLOWER_BF16, "im2col-bf16": 0.01, "shifted-bf16": 0.01, "direct-bf16": 0.01})
    x, w, b, _ = tensors((2, 4, 9, 9, 3, 3, 3), 7)
    cpu.conv2d(x, w, b)
    assert cpu.conv_paths() and set(cpu.conv_paths().values()) == {"im2col-dnnl"}
    untimed = open_device("cpu", threads=1, precision="auto")         # a call under the timed size: the rule
    untimed.conv2d(x, w, b)
    assert set(untimed.conv_paths().values()) <= {"im2col-dnnl", "shifted-dnnl"}


def test_the_choice_among_timed_paths():
    """_fastest, the rule auto follows, on every side of each margin."""
    fastest = cpu_path_choice._fastest
    assert fastest({"im2col": 1.0, "im2col-bf16": 1.1}) == "im2col"
    assert fastest({"im2col": 1.0, "im2col-bf16": 0.97}) == "im2col"
    assert fastest({"im2col": 1.0, "im2col-bf16": 0.9}) == "im2col-bf16"
    assert fastest({"im2col": 1.0, "im2col-dnnl": 0.6, "im2col-bf16": 0.59}) == "im2col-dnnl"
    assert fastest({"im2col": 1.0, "fft": 0.9, "im2col-bf16": 0.8}) == "im2col-bf16"
    assert fastest({"im2col": 1.0, "fft": 0.7, "im2col-bf16": 0.8}) == "fft"
    # an NCHW path over oneDNN's channels-last convolution only past AUTO_LAYOUT_MARGIN
    assert fastest({"shifted": 0.9, "direct-dnnl": 1.0}) == "direct-dnnl"
    assert fastest({"shifted": 0.8, "direct-dnnl": 1.0}) == "shifted"
    assert fastest({"shifted": 0.9, "direct-dnnl": 1.0, "direct-bf16": 0.5}) == "direct-bf16"
    assert fastest({"shifted-bf16": 0.45, "direct-bf16": 0.5}) == "direct-bf16"


@needs_dnnl
def test_a_multi_thread_device_with_onednn_times_no_openblas_path():
    """OpenBLAS's threads would spin on the cores the next layer needs: with two threads and
    oneDNN, auto never times (or runs) im2col or shifted, and holds OpenBLAS to one thread; one
    thread, or a forced path, keeps OpenBLAS as it was."""
    import numba
    from threadpoolctl import threadpool_info
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one core: no device of two threads here")
    x, w, b, _ = tensors((2, 4, 9, 9, 3, 3, 3), 8)
    timed = []
    cpu = open_device("cpu", threads=2, auto_timed_min_flops=0,
                      auto_timer=lambda path, run: timed.append(path) or SLOWER_BF16[path])
    assert cpu.openmp_gemms_only
    assert {i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"} == {1}
    close(cpu.conv2d(x, w, b, padding=1), R.conv2d(x, w, b, 1, 1))
    assert set(timed) == {"fft", "im2col-dnnl", "shifted-dnnl", "direct-dnnl"}
    assert set(cpu.conv_paths().values()) == {"im2col-dnnl"}
    one = _faked("fp32", SLOWER_BF16)
    one.conv2d(x, w, b)
    assert not one.openmp_gemms_only and set(one.conv_paths().values()) == {"im2col-dnnl"}
    assert set(one.conv_path_choices()[0]["seconds"]) == {"im2col", "shifted", "fft", "im2col-dnnl", "shifted-dnnl",
                                                          "direct-dnnl"}
    forced = open_device("cpu", threads=2, conv_path="im2col")
    assert not forced.openmp_gemms_only
    assert {i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"} == {2}


@needs_dnnl
def test_a_conv_onednn_cannot_run_is_named_where_forced_and_left_out_of_auto(monkeypatch):
    from hetconv.devices.dnnl_conv import DirectConvs
    monkeypatch.setattr(DirectConvs, "declines", lambda self, *call: "no implementation of it here")
    x, w, b, _ = tensors((2, 4, 9, 9, 3, 3, 3), 9)
    forced = open_device("cpu", threads=1, conv_path="direct-dnnl")
    with pytest.raises(DeviceError, match=r"^conv path direct-dnnl cannot run x \(2, 4, 9, 9\) w \(3, 4, 3, 3\) "
                                          r"stride \(1, 1\) padding \(0, 0\), plain conv: no implementation of it here$"):
        forced.conv2d(x, w, b)
    cpu = _faked("auto", {**SLOWER_BF16, "direct-dnnl": 0.1, "direct-bf16": 0.1})
    cpu.conv2d(x, w, b)
    assert set(cpu.conv_paths().values()) == {"im2col-dnnl"}
    assert not {"direct-dnnl", "direct-bf16"} & set(cpu.conv_path_choices()[0]["seconds"])


@needs_dnnl
def test_a_device_keeps_the_primitives_of_its_latest_call_shapes_only(monkeypatch):
    from hetconv.devices import dnnl_conv
    monkeypatch.setattr(dnnl_conv, "MAX_PLANS", 2)
    cpu = open_device("cpu", threads=1, conv_path="direct-dnnl")
    for n in (1, 2, 3, 2):                               # the third shape pushes out the first
        x, w, b, _ = tensors((n, 3, 6, 6, 4, 3, 3), n)
        close(cpu.conv2d(x, w, b, padding=1), R.conv2d(x, w, b, 1, 1))
    assert [key[0][0] for key in cpu._direct["direct-dnnl"]._plans] == [3, 2]


@needs_dnnl
def test_what_onednn_has_no_kernel_for_is_named_and_a_wrong_array_never_reaches_it(monkeypatch):
    from hetconv.devices import dnnl_conv

    def unsupported(*args, **kwargs):
        raise dnnl_conv._Unsupported("the backward-data convolution")
    convs = dnnl_conv.DirectConvs(dnnl.load(), 1, bf16=False)
    with monkeypatch.context() as m:
        m.setattr(dnnl_conv, "ConvPlan", unsupported)
        why = convs.declines((2, 3, 6, 6), (4, 3, 3, 3), (1, 1), (1, 1))
    assert why == f"oneDNN {dnnl.load().version} has no implementation of the backward-data convolution here"
    assert convs.declines((2, 3, 6, 6), (4, 3, 3, 3), (1, 1), (1, 1)) == why      # remembered, not tried again
    with pytest.raises(DeviceError, match="has no implementation of the backward-data convolution"):
        convs.forward(*tensors((2, 3, 6, 6, 4, 3, 3), 10)[:2], (1, 1), (1, 1), empty_channels_last((2, 4, 6, 6)))
    convs = dnnl_conv.DirectConvs(dnnl.load(), 1, bf16=False)
    x, w, _, _ = tensors((2, 3, 6, 6, 4, 3, 3), 10)
    with pytest.raises(ValueError, match="^oneDNN's layout takes a C-contiguous array of 1152 bytes, got"):
        convs.forward(x, w, (1, 1), (1, 1), empty_channels_last((2, 4, 5, 6)))       # too small
    for y in (np.empty((2, 4, 6, 6), np.float32), empty_channels_last((2, 4, 6, 12))[..., ::2]):
        with pytest.raises(ValueError, match="^a channels-last map was expected"):
            convs.forward(x, w, (1, 1), (1, 1), y)      # the right size, but NCHW, then strided
    assert not convs.declines((2, 3, 6, 6), (4, 3, 5, 5), (1, 1), (2, 2))


@needs_dnnl
def test_a_library_without_a_cpu_engine_declines_the_direct_paths_and_keeps_its_gemms(monkeypatch):
    """A SYCL build of oneDNN has no CPU engine where no SYCL CPU device is installed: the device
    still opens, its im2col/shifted bf16 paths run, and a forced direct path says why it cannot."""
    from hetconv.devices import dnnl_conv

    def no_engine(lib):
        raise DeviceError("oneDNN failed creating a CPU engine (status 2)")
    monkeypatch.setattr(dnnl_conv, "_Library", no_engine)
    monkeypatch.setattr(dnnl_conv, "_libraries", {})
    x, w, b, _ = tensors((2, 4, 9, 9, 3, 3, 3), 7)
    dev = open_device("cpu", conv_path="auto", precision="bf16", threads=1)
    assert dev.conv2d(x, w, b).shape == (2, 3, 7, 7)
    assert set(dev.conv_paths().values()) <= {"im2col-bf16", "shifted-bf16"}
    forced = open_device("cpu", conv_path="direct-dnnl", threads=1)
    with pytest.raises(DeviceError, match=r"^conv path direct-dnnl cannot run .*: oneDNN failed creating a CPU engine"):
        forced.conv2d(x, w, b)


@needs_dnnl
def test_auto_where_bf16_cannot_run_is_fp32s_machine_and_runs_the_paths_fp32_timed(monkeypatch):
    """--precision auto on a CPU without bf16 has only fp32's candidates: it keys the wisdom as fp32
    does, so it takes the paths fp32 timed, never ones its own timing at another moment picked."""
    lib = dnnl.load()
    monkeypatch.setattr(lib, "bf16_error", "no bf16 GEMM on this CPU")
    fp32, auto = (open_device("cpu", threads=1, precision=p) for p in ("fp32", "auto"))
    assert auto.bf16_missing and auto.machine_key() == fp32.machine_key()
    monkeypatch.setattr(lib, "bf16_error", "")
    with_bf16 = open_device("cpu", threads=1, precision="auto")
    assert with_bf16.machine_key() != open_device("cpu", threads=1, precision="fp32").machine_key()
