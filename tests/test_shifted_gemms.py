"""The shifted path on oneDNN's GEMMs: shifted-dnnl (fp32) against the numpy reference at the fp32
tolerances, shifted-bf16 to float32 rounding against the reference on bf16-rounded operands; and
which of them the device's timing may choose, for which calls."""
import contextlib

import numpy as np
import pytest

from hetconv.devices import cpu_path_choice, open_device
from hetconv.devices.base import ConvBlock
from hetconv.net import reference as R
from _bf16 import INSTRUCTIONS_MISSING, bf16_emulated, needs_dnnl, needs_instructions
from test_cpu_precision import (BLOCKS, CONFIGS, CONVS, MISSING, bf16, bf16_close, block_reference_bf16, close,
                                tensors)


def chosen(path, precision, **options):
    """A device timing every call, whose timer finds `path` the fastest (the runs themselves
    still run: the warm-up before the timed rounds)."""
    return open_device("cpu", precision=precision, auto_timed_min_flops=0,
                       auto_timer=lambda p, run: 0.1 if p == path else 1.0, **options)


@pytest.fixture(scope="module", params=list(CONFIGS))
def dnnl_cpu(request):
    if MISSING:
        pytest.skip(f"oneDNN is an optional extra: {MISSING}")
    return chosen("shifted-dnnl", "fp32", **CONFIGS[request.param])


# each config on the CPU's bf16 GEMM (its emulation where it has none), one on the emulation everywhere
@pytest.fixture(scope="module", params=[(c, False) for c in CONFIGS] + [("2threads-chunked", True)],
                ids=lambda p: p[0] + ("-emulated" if p[1] else ""))
def bf16_cpu(request):
    config, on_emulation = request.param
    if MISSING:
        pytest.skip(f"oneDNN is an optional extra: {MISSING}")
    if on_emulation:
        with bf16_emulated():
            return chosen("shifted-bf16", "bf16", **CONFIGS[config])
    return chosen("shifted-bf16", "bf16", **CONFIGS[config])


def bf16_direct(device):
    """The bf16 path a tie goes to: oneDNN's bf16 convolution where the device has one (not on the
    emulation), else im2col-bf16, the first timed."""
    return "direct-bf16" if "direct-bf16" in device.machine_key()["paths"] else "im2col-bf16"


def expected_path(path, stride, fallback):
    """`path` at stride 1, where it times fastest; elsewhere every path the call can take times
    alike, and the tie goes to `fallback`, oneDNN's own convolution on channels-last maps (an NCHW
    path must beat it by AUTO_LAYOUT_MARGIN)."""
    return path if stride in (1, (1, 1)) else fallback


@pytest.mark.parametrize("conv", CONVS, ids=str)
def test_shifted_dnnl_plain_conv_matches_the_reference(dnnl_cpu, conv):
    x, w, b, rng = tensors(conv, 11)
    stride, p = conv[7], conv[8]
    y = dnnl_cpu.conv2d(x, w, b, stride=stride, padding=p)
    close(y, R.conv2d(x, w, b, stride, p))
    dy = rng.standard_normal(y.shape).astype(np.float32)
    for need_dx in (True, False):
        got = dnnl_cpu.conv2d_backward(x, w, dy, stride=stride, padding=p, need_dx=need_dx)
        for a, e in zip(got, R.conv2d_backward(x, w, dy, stride, p, need_dx=need_dx)):
            assert (a is None) == (e is None)
            if e is not None:
                close(a, e)
    # the timed candidates at stride 1 include it; elsewhere the fastest of the rest
    path = list(dnnl_cpu.conv_paths().values())[-1]
    assert path == expected_path("shifted-dnnl", conv[7], "direct-dnnl")


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_shifted_dnnl_blocks_match_the_reference_and_accumulate_dw(dnnl_cpu, block):
    x, w, b, rng = tensors((3, 4, 10, 9, 6, 3, 3), 12)
    out, ctx = dnnl_cpu.conv_block(x, w, b, block)
    close(out, R.conv_block(x, w, b, block))
    dout = rng.standard_normal(out.shape).astype(np.float32)
    expected = R.conv_block_backward(x, w, b, block, dout)
    for got, exp in zip(dnnl_cpu.conv_block_backward(ctx, w, dout, need_dx=True), expected):
        close(got, exp)
    out, ctx = dnnl_cpu.conv_block(x, w, b, block)
    kept = np.ones_like(w)
    dnnl_cpu.conv_block_backward(ctx, w, dout, need_dx=False, dw_out=kept, accumulate=True)
    close(kept, expected[1] + 1)
    assert list(dnnl_cpu.conv_paths().values())[-1] == expected_path("shifted-dnnl", block.stride, "direct-dnnl")


@pytest.mark.parametrize("conv", CONVS, ids=str)
def test_shifted_bf16_plain_conv_is_the_conv_of_rounded_operands(bf16_cpu, conv):
    x, w, b, rng = tensors(conv, 13)
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
    assert bf16_cpu.conv2d_backward(x, w, dy, stride=stride, padding=p, need_dx=False)[0] is None
    path = list(bf16_cpu.conv_paths().values())[-1]
    assert path == expected_path("shifted-bf16", conv[7], bf16_direct(bf16_cpu))


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_shifted_bf16_blocks_round_only_the_gemm_operands(bf16_cpu, block):
    x, w, b, rng = tensors((3, 4, 10, 9, 6, 3, 3), 14)
    out, ctx = bf16_cpu.conv_block(x, w, b, block)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    dx, dw, db = bf16_cpu.conv_block_backward(ctx, w, dout, need_dx=True)
    rout, rdx, rdw, rdb = block_reference_bf16(x, w, b, block, dout)
    close(out, rout)
    close(dx, rdx)
    close(dw, rdw)
    close(db, rdb)
    out, ctx = bf16_cpu.conv_block(x, w, b, block)
    kept = np.ones_like(w)
    bf16_cpu.conv_block_backward(ctx, w, dout, need_dx=False, dw_out=kept, accumulate=True)
    close(kept, rdw + 1)
    assert list(bf16_cpu.conv_paths().values())[-1] == expected_path("shifted-bf16", block.stride, bf16_direct(bf16_cpu))


@needs_dnnl
def test_both_bf16_layouts_give_the_same_values():
    """Each rounds the same operands (elementwise, to nearest even): only the order of the
    float32 sums differs."""
    x, w, b, _ = tensors((4, 8, 12, 12, 16, 3, 3), 15)
    block = ConvBlock(padding=1, pool="none")
    results = []
    for path in ("im2col-bf16", "shifted-bf16"):
        dev = chosen(path, "bf16", threads=2)
        out, ctx = dev.conv_block(x, w, b, block)
        results.append((out,) + dev.conv_block_backward(ctx, w, np.ones_like(out)))
        assert set(dev.conv_paths().values()) == {path}
    for a, e in zip(*results):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-4)


@needs_dnnl
@pytest.mark.parametrize("on_emulation", [False, True], ids=["cpus-own", "emulated"])
def test_precision_bf16_times_the_shifted_path_at_stride_1_only(on_emulation):
    """And oneDNN's bf16 convolutions (direct-bf16) only where the CPU has the instructions: the
    emulation has GEMMs only."""
    timed = []
    seconds = {"im2col-bf16": 1.0, "shifted-bf16": 0.5, "direct-bf16": 0.7}
    with bf16_emulated() if on_emulation else contextlib.nullcontext():
        dev = open_device("cpu", threads=1, precision="bf16", auto_timed_min_flops=0,
                          auto_timer=lambda p, run: timed.append(p) or seconds[p])
    direct = [] if dev.bf16_missing else ["direct-bf16"]
    assert bool(dev.bf16_missing) == (on_emulation or bool(INSTRUCTIONS_MISSING))
    x, w, b, _ = tensors((2, 4, 9, 9, 3, 3, 3), 16)
    dev.conv2d(x, w, b, stride=1, padding=1)
    assert set(timed) == {"im2col-bf16", "shifted-bf16", *direct}
    timed.clear()
    dev.conv2d(x, w, b, stride=2, padding=1)
    assert set(timed) == ({"im2col-bf16", *direct} if direct else set())      # one candidate: none timed
    assert [c["path"] for c in dev.conv_path_choices()] == ["shifted-bf16", (direct or ["im2col-bf16"])[0]]
    untimed = open_device("cpu", threads=1, precision="bf16")        # under the timed size: the rule
    untimed.conv2d(x, w, b, stride=1, padding=1)
    assert set(untimed.conv_paths().values()) == {"im2col-bf16"}


@needs_instructions
def test_auto_times_the_shifted_onednn_paths_at_stride_1():
    timed = []
    seconds = {"im2col": 1.0, "shifted": 1.0, "fft": 3.0, "im2col-dnnl": 1.0, "im2col-bf16": 1.0,
               "shifted-dnnl": 0.8, "shifted-bf16": 0.5, "direct-dnnl": 0.9, "direct-bf16": 0.9}
    dev = open_device("cpu", threads=1, precision="auto", auto_timed_min_flops=0,
                      auto_timer=lambda p, run: timed.append(p) or seconds[p])
    x, w, b, _ = tensors((2, 4, 9, 9, 3, 3, 3), 17)
    dev.conv2d(x, w, b, stride=1, padding=1)
    assert set(timed) == set(seconds)
    assert dev.conv_path_choices()[0]["path"] == "shifted-bf16"
    timed.clear()
    dev.conv2d(x, w, b, stride=2, padding=1)
    assert set(timed) == {"im2col", "im2col-dnnl", "im2col-bf16", "direct-dnnl", "direct-bf16"}


def test_with_only_bf16_paths_timed_the_fastest_is_taken():
    assert cpu_path_choice._fastest({"im2col-bf16": 1.0, "shifted-bf16": 0.99}) == "shifted-bf16"
    assert cpu_path_choice._fastest({"im2col-bf16": 0.7, "shifted-bf16": 0.99}) == "im2col-bf16"
    # against float32, either bf16 path needs its margin
    assert cpu_path_choice._fastest({"im2col-dnnl": 1.0, "shifted-bf16": 0.97}) == "im2col-dnnl"
    assert cpu_path_choice._fastest({"im2col-dnnl": 1.0, "shifted-dnnl": 0.9, "shifted-bf16": 0.8}) == "shifted-bf16"


@pytest.mark.skipif(bool(MISSING), reason=f"oneDNN is an optional extra: {MISSING}")
@pytest.mark.parametrize("c,shifted", [(4, False), (32, True)])
def test_an_untimed_call_takes_the_rules_layout_on_onednn(c, shifted):
    """Under the timed size the rule picks the layout (shifted where C*kw >= 64) and, where
    oneDNN is installed, its sgemm runs it; a device opened without oneDNN keeps OpenBLAS's."""
    x, w, b, rng = tensors((2, c, 7, 7, 3, 3, 3), 18)
    expected = R.conv2d(x, w, b, 1, 1)
    for onednn, path in ((None, "shifted-dnnl" if shifted else "im2col-dnnl"),
                         (False, "shifted" if shifted else "im2col")):
        dev = open_device("cpu", threads=1, onednn=onednn)
        close(dev.conv2d(x, w, b, padding=1), expected)
        [choice] = dev.conv_path_choices()
        assert choice["path"] == path and choice["why"].startswith("rule: ")
