"""Channels-last maps on the CPU device: every per-channel layer on NHWC memory against the float64
reference (the same checks the NCHW kernels pass), BatchNorm fused with the activation after it
against the two run apart, oneDNN's convolutions on channels-last maps against the reference in
every block form, and a graph network trained on the direct path, where the maps stay
channels-last from conv to conv, against PyTorch's SGD."""
import numpy as np
import pytest

import _channelwise_cases as cases
from hetconv import channelwise as cw
from hetconv.devices import dnnl, dnnl_conv, open_device
from hetconv.devices.base import (ConvBlock, as_channels_last, as_layout_kept, concatenate, empty_channels_last,
                                  is_channels_last)
from hetconv.net import reference as R

needs_dnnl = pytest.mark.skipif(not dnnl.available(), reason=dnnl.unavailable_reason() or "oneDNN is not installed")


def _laid_out(a):
    """A 4-D float32 map made channels-last; anything else as it is."""
    if isinstance(a, np.ndarray) and a.ndim == 4 and a.dtype == np.float32:
        return as_channels_last(a)
    return a


def _assert_kept(out):
    """Every 4-D map a call returned is channels-last (one of one channel or one pixel lies the
    same either way)."""
    for a in out if isinstance(out, tuple) else (out,):
        if isinstance(a, np.ndarray) and a.ndim == 4 and a.size and a.shape[1] > 1 and a.shape[2] * a.shape[3] > 1:
            assert is_channels_last(a), f"a {a.shape} map came back NCHW"


class ChannelsLastCalls:
    """A device whose every call gets its 4-D maps channels-last and must give them back so."""

    def __init__(self, dev):
        self.dev = dev

    def __getattr__(self, name):
        method = getattr(self.dev, name)

        def call(*args, **kwargs):
            out = method(*[_laid_out(a) for a in args], **{k: _laid_out(v) for k, v in kwargs.items()})
            _assert_kept(out)
            return out
        return call


@pytest.fixture(scope="module")
def dev():
    return open_device("cpu", threads=2)


@pytest.fixture(scope="module")
def cl(dev):
    return ChannelsLastCalls(dev)


# ---- the layout's helpers ---------------------------------------------------------------------------
def test_a_map_is_channels_last_only_where_its_memory_is_nhwc_and_not_also_nchw():
    x = np.zeros((2, 3, 4, 5), np.float32)
    assert not is_channels_last(x)
    assert is_channels_last(as_channels_last(x))
    assert not is_channels_last(as_channels_last(x)[:, 1:])          # a channel slice is neither
    assert not is_channels_last(empty_channels_last((2, 1, 4, 5)))   # one channel: NCHW's memory too
    assert not is_channels_last(empty_channels_last((2, 3, 1, 1)))   # one pixel likewise
    assert as_layout_kept(as_channels_last(x)).strides == as_channels_last(x).strides
    assert as_layout_kept(x.transpose(0, 1, 3, 2)).flags.c_contiguous


@pytest.mark.parametrize("axis", [0, 1])
def test_concatenating_channels_last_maps_keeps_the_layout_and_the_values(axis):
    rng = np.random.default_rng(0)
    pieces = [cases.f32(rng, 2, 3, 4, 5), cases.f32(rng, 2, 3, 4, 5)]
    got = concatenate([as_channels_last(p) for p in pieces], axis)
    assert is_channels_last(got)
    np.testing.assert_array_equal(got, np.concatenate(pieces, axis))
    np.testing.assert_array_equal(concatenate(pieces, axis), np.concatenate(pieces, axis))


# ---- per-channel layers: the NCHW kernels' reference checks, on NHWC memory ----------------------------
@pytest.mark.parametrize("shape", [(2, 3, 5, 4), (3, 9, 2, 3)], ids=str)
@pytest.mark.parametrize("act", cases.ACTIVATIONS, ids=lambda a: str(a.to_json()))
def test_activation_on_channels_last_matches_reference(cl, act, shape):
    cases.check_activation(cl, act, shape)


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("pool", cases.POOLS, ids=lambda p: str(p.to_json()))
def test_pool_on_channels_last_matches_reference(cl, pool, ties):
    cases.check_pool(cl, pool, (2, 5, 7, 8), ties)


@pytest.mark.parametrize("bn", [cw.BatchNorm(), cw.BatchNorm(eps=1e-3, momentum=None), cw.BatchNorm(affine=False)],
                         ids=lambda b: str(b.to_json()))
@pytest.mark.parametrize("cuts", [(), (1, 3)], ids=str)
def test_batchnorm_on_channels_last_pieces_matches_reference(cl, bn, cuts):
    x, dy, weight, bias = cases.batchnorm_inputs((4, 6, 5, 3))
    bounds = (0, *cuts, 4)
    pieces = [(cl, slice(a, b)) for a, b in zip(bounds[:-1], bounds[1:])]
    cases.check_batchnorm_against_reference(pieces, bn, x, dy, weight, bias)


def test_batchnorm_sums_of_a_batch_in_either_layout_agree(dev):
    x, dy, weight, bias = cases.batchnorm_inputs((3, 7, 6, 5))
    nchw = cases.batchnorm_step([(dev, x, dy)], cw.BatchNorm(), weight, bias)
    nhwc = cases.batchnorm_step([(dev, as_channels_last(x), as_channels_last(dy))], cw.BatchNorm(), weight, bias)
    for a, b in zip(nchw[3], nhwc[3]):
        np.testing.assert_allclose(a, b, rtol=1e-12)
    np.testing.assert_array_equal(nchw[0][0], nhwc[0][0])       # the same statistics: the same float32 pass
    np.testing.assert_allclose(nchw[1][0], nhwc[1][0], rtol=1e-6, atol=1e-6)


def test_batchnorm_eval_and_channel_scale_on_channels_last_match_reference(cl):
    cases.check_batchnorm_eval(cl, cw.BatchNorm(), (3, 4, 5, 6))
    cases.check_channel_scale(cl, (3, 4, 5, 6))


def test_a_channels_last_piece_with_no_images(cl):
    cases.check_a_piece_with_no_images(cl)


# ---- BatchNorm with its activation in one call ----------------------------------------------------------
FUSED = [cw.Activation("relu"), cw.Activation("relu6"), cw.Activation("silu"), cw.Activation("leaky_relu", 0.1),
         cw.Activation("hardswish")]


# Every activation on channels-last rows; on NCHW planes (the same loop for every code, each code
# a kernel of its own: ~20 s of compiling each on a cold cache) a plain one, relu6, and one whose
# backward reads its output
FUSED_CASES = ([(act, True) for act in FUSED]
               + [(act, False) for act in FUSED if act.kind in ("relu", "relu6", "silu")])


@pytest.mark.parametrize("act, channels_last", FUSED_CASES,
                         ids=[f"{a.kind}-{'nhwc' if cl else 'nchw'}" for a, cl in FUSED_CASES])
def test_batchnorm_fused_with_its_activation_equals_the_two_run_apart(dev, act, channels_last):
    x, dy, weight, bias = cases.batchnorm_inputs((3, 6, 5, 4), seed=3)
    if channels_last:
        x, dy = as_channels_last(x), as_channels_last(dy)
    s, ss = dev.channel_sums(x)
    stats = cw.batch_statistics(cw.BatchNorm(), s, ss, x.shape[0] * x.shape[2] * x.shape[3])
    count = x.shape[0] * x.shape[2] * x.shape[3]
    z, bn_ctx = dev.batchnorm_apply(x, stats.mean32, stats.invstd32, weight, bias)
    y_apart, act_ctx = dev.activation(z, act)
    g = dev.activation_backward(act_ctx, dy)
    sums_apart = dev.batchnorm_grad_sums(bn_ctx, g)
    dx_apart = dev.batchnorm_backward(bn_ctx, g, *sums_apart, count)

    y, ctx = dev.batchnorm_apply(x, stats.mean32, stats.invstd32, weight, bias, activation=act)
    assert is_channels_last(y) == channels_last
    np.testing.assert_array_equal(y, y_apart)                  # the same float32 operations, bit for bit
    sums = dev.batchnorm_grad_sums(ctx, dy)
    for a, b in zip(sums, sums_apart):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-9)
    dx = dev.batchnorm_backward(ctx, dy, *sums_apart, count)
    assert is_channels_last(dx) == channels_last
    np.testing.assert_array_equal(dx, dx_apart)


def test_a_device_without_fused_kernels_runs_them_apart(dev):
    """The contract's default (what the CUDA device runs): BatchNorm, then the activation, with
    the activation's gradient computed once and used by both backward calls."""
    from hetconv.devices.base import Device
    x, dy, weight, bias = cases.batchnorm_inputs((2, 4, 3, 3), seed=5)
    act = cw.Activation("relu6")
    mean, invstd = np.zeros(4, np.float32), np.ones(4, np.float32)
    fused = dev.batchnorm_apply(x, mean, invstd, weight, bias, activation=act)
    apart = Device._normalize_act(dev, x, mean, invstd * weight, bias, act)
    np.testing.assert_array_equal(fused[0], apart[0])
    sums = Device._batchnorm_act_grad_sums(dev, apart[1], dy, mean, invstd * weight, bias, act)
    for a, b in zip(sums, dev.batchnorm_grad_sums(fused[1], dy)):
        np.testing.assert_allclose(a * invstd, b, rtol=1e-9)


# ---- oneDNN's convolutions on channels-last maps ----------------------------------------------------
BLOCKS = [ConvBlock(padding=1, activation="none", pool="none"), ConvBlock(padding=1),
          ConvBlock(stride=2, padding=1, activation="none", pool="none"),
          ConvBlock(padding=1, activation="relu", pool="avg", pool_kernel=(3, 3), pool_stride=(2, 2),
                    pool_padding=(1, 1)),
          ConvBlock(padding=2, dilation=(2, 2), activation="none", pool="none"),
          ConvBlock(padding=1, groups=8, activation="relu", pool="none")]


@needs_dnnl
@pytest.mark.parametrize("input_layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"s{b.stride[0]}d{b.dilation[0]}g{b.groups}-{b.activation}-{b.pool}")
def test_direct_block_on_channels_last_matches_reference(input_layout, block, monkeypatch):
    dev = open_device("cpu", threads=2, conv_path="direct-dnnl")
    reorder = dnnl_conv.ConvPlan.reorder

    def reorder_into_other_memory(plan, src, dst, src_array, dst_array):
        # a reorder onto the same memory is a wasted pass over the map (or a race, where the
        # layouts differ)
        assert not np.shares_memory(src_array, dst_array), f"a reorder of {src_array.shape} onto itself"
        return reorder(plan, src, dst, src_array, dst_array)
    monkeypatch.setattr(dnnl_conv.ConvPlan, "reorder", reorder_into_other_memory)
    rng = np.random.default_rng(1)
    x = cases.f32(rng, 3, 8, 9, 10)
    w = cases.f32(rng, 16, 8 // block.groups, 3, 3, scale=0.3)
    b = cases.f32(rng, 16)
    if input_layout == "nhwc":
        x = as_channels_last(x)
    out, ctx = dev.conv_block(x, w, b, block)
    assert is_channels_last(out)
    cases.close(out, R.conv_block(np.ascontiguousarray(x), w, b, block), "forward")
    dout = cases.f32(rng, *out.shape)
    dx, dw, db = dev.conv_block_backward(ctx, w, dout)
    assert is_channels_last(dx) == (input_layout == "nhwc")
    dx_ref, dw_ref, db_ref = R.conv_block_backward(np.ascontiguousarray(x), w, b, block, dout)
    cases.close(dx, dx_ref, "dx")
    cases.close(dw, dw_ref, "dw")
    cases.close(db, db_ref, "db")


@needs_dnnl
def test_a_block_without_a_bias_adds_none_and_its_db_is_zero():
    dev = open_device("cpu", threads=2, conv_path="direct-dnnl")
    rng = np.random.default_rng(3)
    block = ConvBlock(padding=1, activation="none", pool="none")
    x, w = as_channels_last(cases.f32(rng, 3, 8, 9, 10)), cases.f32(rng, 16, 8, 3, 3, scale=0.3)
    out, ctx = dev.conv_block(x, w, None, block)
    zero = np.zeros(16, np.float32)
    cases.close(out, R.conv_block(np.ascontiguousarray(x), w, zero, block), "forward")
    dout = cases.f32(rng, *out.shape)
    dx, dw, db = dev.conv_block_backward(ctx, w, dout)
    dx_ref, dw_ref, db_ref = R.conv_block_backward(np.ascontiguousarray(x), w, zero, block, dout)
    cases.close(dx, dx_ref, "dx")
    cases.close(dw, dw_ref, "dw")
    assert np.abs(db_ref).max() > 0.1           # what a bias would have been given
    assert db.shape == (16,) and db.dtype == np.float32 and not db.any()


@needs_dnnl
def test_the_plain_contract_on_the_direct_path_still_gives_nchw():
    dev = open_device("cpu", threads=1, conv_path="direct-dnnl")
    rng = np.random.default_rng(2)
    x, w, b = cases.f32(rng, 2, 4, 6, 6), cases.f32(rng, 5, 4, 3, 3), cases.f32(rng, 5)
    y = dev.conv2d(x, w, b, padding=1)
    assert y.flags.c_contiguous
    cases.close(y, R.conv2d(x, w, b, padding=1))
    dx, dw, db = dev.conv2d_backward(x, w, np.ones_like(y), padding=1)
    assert dx.flags.c_contiguous
    cases.close(dx, R.conv2d_backward(x, w, np.ones_like(y), padding=1)[0])


# ---- a graph network on the direct path, end to end ------------------------------------------------
@needs_dnnl
def test_a_graph_trained_on_channels_last_maps_equals_pytorch(tmp_path):
    """The residual and concatenated module of test_graph_training on oneDNN's direct path: every
    block's output channels-last, its BatchNorm and ReLU fused, the sums and pools on NHWC; the
    losses and the final state as torch.optim.SGD's."""
    pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install 'hetconv[torch]')")
    from _module_runs import assert_equals_torch, config, quiet
    from test_graph_training import MODULE
    from hetconv.engine.local import LocalEngine
    from hetconv.engine.shard import ConvShard
    from hetconv.training import checkpoint
    from hetconv.training.loop import train

    dev = open_device("cpu", threads=1, conv_path="direct-dnnl")
    seen = []
    block = dev.conv_block

    def spying(x, w, b, blk):
        out = block(x, w, b, blk)
        seen.append((is_channels_last(x), is_channels_last(out[0])))
        return out
    dev.conv_block = spying
    (tmp_path / "mynet.py").write_text(MODULE)
    cfg = config(f"{tmp_path / 'mynet.py'}:build", tmp_path)
    summary = train(cfg, LocalEngine({"local": ConvShard(dev)}), log=quiet)
    _, conv, fc = checkpoint.load(str(tmp_path / "ck"))
    assert_equals_torch(cfg, summary["losses"], conv, fc)
    assert all(out for _, out in seen)
    assert sum(x for x, _ in seen) >= len(seen) // 2      # past the images, blocks read channels-last maps


MALLOC_DEBUG = "/lib/x86_64-linux-gnu/libc_malloc_debug.so.0"
HEAP_CHECK = """
import gc, sys
import numpy as np
from hetconv.devices import dnnl
from hetconv.devices.base import as_channels_last, empty_channels_last
from hetconv.devices.dnnl_conv import DirectConvs
rng = np.random.default_rng(0)
# (kernel, stride, padding, channels in, out, groups, images, size): every form a torchvision
# network's convs take, at sizes where oneDNN picks its brgemm kernels
for k, s, p, cin, cout, g, n, hw in [(1, 2, 0, 3, 8, 1, 16, 16), (1, 2, 0, 6, 8, 1, 16, 16), (1, 1, 0, 6, 8, 1, 16, 16),
                                     (3, 2, 1, 6, 8, 1, 16, 16), (3, 1, 1, 8, 8, 8, 8, 20), (7, 2, 3, 3, 16, 1, 8, 20)]:
    for x_channels_last in (True, False):
        convs = DirectConvs(dnnl.load(), int(sys.argv[1]), bf16=False)
        x = rng.standard_normal((n, cin, hw, hw), dtype=np.float32)
        x = as_channels_last(x) if x_channels_last else x
        w = rng.standard_normal((cout, cin // g, k, k), dtype=np.float32)
        ho = (hw + 2 * p - k) // s + 1
        y = empty_channels_last((n, cout, ho, ho))
        convs.forward(x, w, (s, s), (p, p), y, groups=g)
        dy = as_channels_last(rng.standard_normal(y.shape, dtype=np.float32))
        convs.backward(x, w, dy, (s, s), (p, p), True, np.empty_like(w), groups=g)
        del convs
        gc.collect()                # the primitives go, and glibc checks the blocks they held
print("intact")
"""


@needs_dnnl
@pytest.mark.skipif(not __import__("os").path.exists(MALLOC_DEBUG), reason=f"{MALLOC_DEBUG} is missing (glibc 2.34+)")
@pytest.mark.parametrize("threads", [1, 2])
def test_every_conv_form_on_channels_last_leaves_the_heap_intact(threads):
    """Under glibc's checking allocator, each form's primitives made, run forward and backward,
    and destroyed: a primitive that wrote past a block it holds (oneDNN 3.2's strided 1x1
    convolutions on NHWC did, on AVX2) aborts the process when the block is freed."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, LD_PRELOAD=MALLOC_DEBUG, MALLOC_CHECK_="3")
    done = subprocess.run([sys.executable, "-c", HEAP_CHECK, str(threads)], env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0 and "intact" in done.stdout, (done.returncode, done.stderr[-2000:])


# ---- calibration prices a layer in the layout the step gives it -------------------------------------
@needs_dnnl
def test_calibration_times_a_later_layer_on_the_layout_its_device_keeps():
    from hetconv.engine.shard import ConvShard
    from hetconv.geometry import conv_specs, layer_input_shapes

    dev = open_device("cpu", threads=1, conv_path="direct-dnnl")
    seen = []
    conv_block = dev.conv_block

    def recording(x, *args, **kwargs):
        seen.append(is_channels_last(x))
        return conv_block(x, *args, **kwargs)

    dev.conv_block = recording
    specs = conv_specs([8, 8], ksize=3, padding=1)
    shapes, _ = layer_input_shapes(specs, 4)
    ConvShard(dev).calibrate(specs[:1], shapes[:1], [8], repeats=1)
    first_layer_alone = list(seen)
    del seen[:]
    ConvShard(dev).calibrate(specs, shapes, [8, 8], repeats=1)
    assert first_layer_alone and not any(first_layer_alone)      # the wire's NCHW images
    first_nhwc = seen.index(True)                                  # layer 1's calls, then layer 2's
    assert first_nhwc > 0 and all(seen[first_nhwc:]) and not any(seen[:first_nhwc])


def test_a_map_kept_on_its_worker_keeps_its_layout_and_is_rounded_as_the_wire_would():
    """Between two blocks on one worker of the peer step, a channels-last map is handed on as it
    is (float32) or rounded in place of a reorder (a 16-bit wire): the values the wire would
    carry, in the layout the next block reads."""
    from hetconv.transport.wire import decode, encode
    from hetconv.worker.graph_step import _rounded
    x = as_channels_last(np.random.default_rng(0).standard_normal((2, 5, 3, 4), dtype=np.float32))
    assert _rounded(x, "float32") is x
    for wire in ("bfloat16", "float16"):
        got = _rounded(x, wire)
        assert is_channels_last(got) and got is not x
        np.testing.assert_array_equal(got, decode(encode(np.ascontiguousarray(x), wire), wire))
    nchw = np.ascontiguousarray(x)
    assert _rounded(nchw, "float32") is nchw and _rounded(nchw, "bfloat16").flags.c_contiguous


@needs_dnnl
@pytest.mark.parametrize("wire,modes", [("float32", "DDDDDMMM"), ("bfloat16", "MMMMMMMM")])
def test_the_peer_step_on_channels_last_maps_equals_one_process(tmp_path, wire, modes):
    """oneDNN's direct path on two workers, two micro-batches: each block's channels-last output
    stays on its worker in its layout. Data blocks with uneven images, then model blocks, equal
    --local's run; on a 16-bit wire, model blocks give bit for bit what the same split gives in
    one process (the rounding points of test_bf16_wire's; data blocks' sums, in another order,
    can round a value the other way, which the steps after amplify)."""
    pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install 'hetconv[torch]')")
    from _module_runs import assert_equal_runs, config, quiet
    from test_graph_training import MODULE
    from hetconv.coordinator.remote import RemoteEngine
    from hetconv.devices.cpu_options import CpuOptions
    from hetconv.engine.local import LocalEngine
    from hetconv.engine.planner import fixed_plan
    from hetconv.engine.shard import ConvShard
    from hetconv.net import load_net
    from hetconv.training import checkpoint
    from hetconv.training.config import Config
    from hetconv.training.loop import train

    (tmp_path / "mynet.py").write_text(MODULE)
    cfg = config(f"{tmp_path / 'mynet.py'}:build", tmp_path / "one", wire_dtype=wire, micro_batches=2,
                 cpu_conv_path="direct-dnnl")
    kernels = [b.kernels for b in load_net(cfg.net, (3, 16, 16), 10).spec.conv_layers()]
    counts = {w: [k // 2 + (1 if i < k % 2 else 0) for k in kernels] for i, w in enumerate(("w0-cpu", "w1-cpu"))}
    shards = {"local": None} if "D" in modes else counts
    local = LocalEngine({w: ConvShard(open_device("cpu", threads=1, conv_path="direct-dnnl")) for w in shards},
                        wire=wire)
    if "D" not in modes:
        local.fixed_plan = fixed_plan(kernels, counts)
    losses = train(cfg, local, log=quiet)["losses"]
    engine = RemoteEngine("tcp://127.0.0.1:0", 0, ["cpu"] * 2, threads=1, connect_timeout=60, log=quiet, wire=wire,
                          cpu=CpuOptions(conv_path="direct-dnnl"))
    engine.fixed_plan = fixed_plan(kernels, counts, modes=[{"D": "data", "M": "model"}[m] for m in modes],
                                   images={"w0-cpu": 6, "w1-cpu": 10} if "D" in modes else None)
    try:
        summary = train(Config(**{**cfg.to_json(), "checkpoint_dir": str(tmp_path / "ck"), "use_all": True}), engine,
                        log=quiet)
    finally:
        engine.close()
    exact = {"rtol": 0, "atol": 0} if wire != "float32" else {}
    np.testing.assert_allclose(summary["losses"], losses, rtol=exact.get("rtol", 1e-5))
    assert_equal_runs(checkpoint.load(str(tmp_path / "ck")), checkpoint.load(str(tmp_path / "one" / "ck")), **exact)
