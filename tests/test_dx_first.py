"""A block's dX handed over before its dW computes (conv_block_backward's on_dx): the FFT,
oneDNN direct and Winograd paths compute dX first, so a worker's partial dX is on the wire while its dW
computes; the GEMM paths, which interleave both per chunk of images, hand it over at the end.
Either way the gradients are bit for bit those of a backward without on_dx. And calibration
times when dX is ready, which the cost model prices."""
import numpy as np
import pytest

from hetconv.devices import dnnl, open_device
from hetconv.devices.base import ConvBlock
from hetconv.engine.costmodel import LayerCost, DeviceProfile, Link
from hetconv.engine.steptasks import predict_any
from hetconv.engine.shard import ConvShard
from hetconv.geometry import ConvSpec

MISSING = dnnl.unavailable_reason()

# 1 thread, one block of frequencies; 2 threads with every frequency its own block and dY's
# spectra too big to keep between the passes (transformed again per block)
DEVICES = {
    "fft": dict(conv_path="fft", threads=1),
    "fft-blocked": dict(conv_path="fft", threads=2, im2col_budget_bytes=4000, saved_cols_budget_bytes=0),
    "direct-dnnl": dict(conv_path="direct-dnnl", threads=1),
    "im2col": dict(conv_path="im2col", threads=1),
    "winograd": dict(conv_path="winograd", threads=2, im2col_budget_bytes=4000, saved_cols_budget_bytes=0),
}
DX_FIRST = {"fft", "fft-blocked", "direct-dnnl", "winograd"}


def _device(name):
    if name == "direct-dnnl" and MISSING:
        pytest.skip(f"oneDNN is an optional extra: {MISSING}")
    return open_device("cpu", **DEVICES[name])


@pytest.mark.parametrize("name", list(DEVICES))
@pytest.mark.parametrize("accumulate", [False, True])
def test_dx_handed_over_first_is_the_same_dx_and_dw_comes_after(name, accumulate):
    dev = _device(name)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 6, 9, 9)).astype(np.float32)
    w = (rng.standard_normal((5, 6, 3, 3)) / 6).astype(np.float32)
    b = rng.standard_normal(5).astype(np.float32)
    block = ConvBlock(padding=1)
    out, ctx = dev.conv_block(x, w, b, block)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    start = rng.standard_normal(w.shape).astype(np.float32)
    want_dw = start.copy()
    want_dx, want_dw, want_db = dev.conv_block_backward(ctx, w, dout, True, dw_out=want_dw, accumulate=accumulate)

    out, ctx = dev.conv_block(x, w, b, block)
    dw_out = start.copy()
    seen = []

    def on_dx(dx):
        # where dX comes first, dW's buffer still holds what it held before the call
        seen.append((dx.copy(), np.array_equal(dw_out, start)))

    dx, dw, db = dev.conv_block_backward(ctx, w, dout, True, dw_out=dw_out, accumulate=accumulate, on_dx=on_dx)
    assert len(seen) == 1
    handed, dw_untouched = seen[0]
    assert dw_untouched == (name in DX_FIRST)
    np.testing.assert_array_equal(handed, want_dx)
    np.testing.assert_array_equal(dx, want_dx)
    np.testing.assert_array_equal(dev.download(dw), dev.download(want_dw))
    np.testing.assert_array_equal(dev.download(db), dev.download(want_db))


def test_no_dx_asked_means_no_call():
    dev = _device("fft")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    out, ctx = dev.conv_block(x, w, np.zeros(4, np.float32), ConvBlock())
    called = []
    dx, _, _ = dev.conv_block_backward(ctx, w, np.ones_like(out), False, on_dx=called.append)
    assert dx is None and called == []


def test_calibration_times_when_dx_is_ready():
    """Calibration's backward of a layer that needs dX says how much of it came before dX was
    handed over: on the FFT path, less than all of it; the first layer (no dX) says nothing."""
    dev = open_device("cpu", conv_path="fft", threads=1)
    specs = [ConvSpec(3, 8, 3, 3, ConvBlock(padding=1)), ConvSpec(8, 12, 3, 3, ConvBlock(padding=1))]
    _, timings = ConvShard(dev).calibrate(specs, [(4, 3, 12, 12), (4, 8, 6, 6)], [8, 12], repeats=1)
    assert "backward_dx_s" not in timings[0]
    second = timings[1]
    for dx_s, total in zip(second["backward_dx_s"], second["backward_s"]):
        assert 0.0 < dx_s < total
    cost = LayerCost.fit(second)
    assert 0.0 < cost.backward_dx_share < 1.0


def test_the_cost_model_sends_dx_when_it_is_ready():
    """Two workers, two model layers: a dX that leaves before dW (share 0.5) makes the step
    shorter by the time the link would have waited for dW, and never longer."""
    specs = [ConvSpec(3, 64, 3, 3, ConvBlock(padding=1)), ConvSpec(64, 64, 3, 3, ConvBlock(padding=1))]
    late = LayerCost(0.0, 1e-5, 0.0, 4e-5)
    early = LayerCost(0.0, 1e-5, 0.0, 4e-5, backward_dx_share=0.5)
    link = Link(10e6, name="slow")          # slow enough that dX's trip is on the step's path

    def step(cost):
        profiles = {w: DeviceProfile(w, "cpu", "", (cost, cost)) for w in ("a", "b")}
        counts = {"a": [32, 32], "b": [32, 32]}
        return predict_any("peer", specs, (3, 16, 16), 8, counts, profiles, link, 0.0).step_s

    backward_s = late.backward_s(32, 8)
    assert step(early) < step(late)
    assert step(late) - step(early) == pytest.approx(0.5 * backward_s, rel=1e-6)
