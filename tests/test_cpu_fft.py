"""The CPU device's FFT path (conv_path="fft") against the numpy reference: plain and fused, every
gradient, normwise relative error at most 1e-5; its kernel spectra computed once per step of the
shard's pattern and never stale; and where it declines (stride, memory budget), the direct path.
Then conv_path="auto": the path each call shape runs, chosen by timing the candidates (a fake
timer here), kept per shape, skipped for small layers, and reported."""
import numpy as np
import pytest

from hetconv.update import UpdateRule
from hetconv.net import reference as R
from hetconv.devices import DeviceError, open_device
from hetconv.devices.base import ConvBlock
from hetconv.devices.cpu_fft import kept_frequencies
from hetconv.geometry import ConvSpec
from hetconv.engine.shard import ConvShard

TOLERANCE = 1e-5

# 1 thread with the whole spectrum in one block of frequencies, the fused forward keeping the
# input's spectra for backward; 2 threads with a work budget so small that every frequency is its
# own block (the inverse transforms add block after block) and no spectra kept (backward
# transforms the input again)
CONFIGS = {"1thread": {"threads": 1},
           "2threads-blocked": {"threads": 2, "im2col_budget_bytes": 4000, "saved_cols_budget_bytes": 0}}


@pytest.fixture(scope="module", params=list(CONFIGS))
def fft(request):
    return open_device("cpu", conv_path="fft", **CONFIGS[request.param])


def relative_error(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def assert_close(got, want, what):
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = relative_error(got, want)
    assert err <= TOLERANCE, f"{what}: normwise relative error {err:.3g} > {TOLERANCE}"


def tensors(n, c, h, w, k, kh, kw, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    wt = (rng.standard_normal((k, c, kh, kw)) / np.sqrt(c * kh * kw)).astype(np.float32)
    b = rng.standard_normal(k).astype(np.float32)
    return x, wt, b, rng


def check_plain(dev, x, w, b, padding, rng):
    y = dev.conv2d(x, w, b, padding=padding)
    assert_close(y, R.conv2d(x, w, b, padding=padding), "y")
    dy = rng.standard_normal(y.shape).astype(np.float32)
    for need_dx in (True, False):
        got = dev.conv2d_backward(x, w, dy, padding=padding, need_dx=need_dx)
        want = R.conv2d_backward(x, w, dy, padding=padding, need_dx=need_dx)
        assert (got[0] is None) == (not need_dx)
        for name, g, r in zip(("dx", "dw", "db"), got, want):
            if r is not None:
                assert_close(g, r, name)


# kernel sizes 3, 5, 7 with paddings 0..3 (each that leaves an output), odd and even sizes
@pytest.mark.parametrize("kernel", (3, 5, 7))
@pytest.mark.parametrize("padding", (0, 1, 2, 3))
def test_plain_forward_and_gradients_match_reference(fft, kernel, padding):
    x, w, b, rng = tensors(2, 3, 9, 8, 4, kernel, kernel, seed=kernel * 10 + padding)
    if 8 + 2 * padding < kernel:
        pytest.skip("the kernel does not fit this input and padding")
    check_plain(fft, x, w, b, padding, rng)


@pytest.mark.parametrize("shape", [
    (1, 2, 6, 11, 3, 3, 5, (0, 2)),     # rectangular kernel, padding per axis
    (2, 1, 5, 5, 2, 1, 1, (0, 0)),      # 1x1 kernel
    (1, 2, 3, 4, 2, 7, 7, (3, 3)),      # kernel larger than the input
    (3, 4, 10, 10, 5, 2, 4, (1, 3)),    # even kernel sizes
])
def test_plain_odd_shapes_match_reference(fft, shape):
    n, c, h, w, k, kh, kw, padding = shape
    x, wt, b, rng = tensors(n, c, h, w, k, kh, kw, seed=7)
    check_plain(fft, x, wt, b, padding, rng)


def test_without_the_accumulating_sgemm_numpy_matmul_gives_the_same_result():
    """Where the BLAS's sgemm cannot be called directly, every GEMM of the path (into strided
    views of the work buffers) goes through numpy's matmul: same results, blocked and not."""
    for options in CONFIGS.values():
        dev = open_device("cpu", conv_path="fft", **options)
        dev._sgemm = None
        x, w, b, rng = tensors(2, 3, 9, 8, 4, 5, 3, seed=5)
        check_plain(dev, x, w, b, (2, 1), rng)


@pytest.mark.parametrize("layer", ["conv1", "conv2-share"])
def test_paper_network_layers_match_reference(layer):
    """The paper's conv1 input (3x32x32, 5x5 kernels) and conv2's (500x14x14, 5x5): their transform
    sizes and conv2's 500-long channel sums, the error bound's hard case; fewer kernels than the
    layers' 500 and 1500 (each kernel's output is computed alike, and the reference's time grows
    with them)."""
    dev = open_device("cpu", conv_path="fft", threads=2)
    c, h, k = (3, 32, 40) if layer == "conv1" else (500, 14, 40)
    x, w, b, rng = tensors(2, c, h, h, k, 5, 5, seed=3)
    check_plain(dev, x, w, b, 0, rng)
    out, ctx = dev.conv_relu_pool(x, w, b, 0)
    assert_close(out, R.conv_relu_pool(x, w, b, 0), "pooled")
    dout = rng.standard_normal(out.shape).astype(np.float32)
    for name, g, r in zip(("dx", "dw", "db"), dev.conv_relu_pool_backward(ctx, w, dout),
                          R.conv_relu_pool_backward(x, w, b, dout, 0)):
        assert_close(g, r, name)


BLOCKS = [ConvBlock(padding=1),                                             # the paper's block
          ConvBlock(padding=(2, 1), pool="avg", pool_kernel=3, pool_stride=2, pool_padding=1),
          ConvBlock(padding=0, activation="none", pool="max", pool_kernel=3, pool_stride=1),
          ConvBlock(padding=3, activation="relu", pool="none"),
          ConvBlock(padding=2, activation="none", pool="none")]


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_fused_blocks_match_reference(fft, block):
    x, w, b, rng = tensors(2, 3, 11, 10, 4, 5, 5, seed=11)
    out, ctx = fft.conv_block(x, w, b, block)
    assert_close(out, R.conv_block(x, w, b, block), "out")
    dout = rng.standard_normal(out.shape).astype(np.float32)
    for need_dx in (True, False):
        out, ctx = fft.conv_block(x, w, b, block)
        got = fft.conv_block_backward(ctx, w, dout, need_dx)
        want = R.conv_block_backward(x, w, b, block, dout, need_dx)
        assert (got[0] is None) == (not need_dx)
        for name, g, r in zip(("dx", "dw", "db"), got, want):
            if r is not None:
                assert_close(g, r, name)


def test_a_second_backward_of_one_forward_recomputes_what_the_first_used(fft):
    x, w, b, rng = tensors(2, 3, 9, 8, 4, 3, 3, seed=12)
    block = ConvBlock(padding=1)
    out, ctx = fft.conv_block(x, w, b, block)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    want = R.conv_block_backward(x, w, b, block, dout, True)
    for _ in range(2):
        for name, g, r in zip(("dx", "dw", "db"), fft.conv_block_backward(ctx, w, dout, True), want):
            assert_close(g, r, name)


@pytest.mark.parametrize("arrival", ["in process", "over the wire"])
def test_spectra_computed_once_per_step_of_the_shard(arrival):
    """Two micro-batches (two forwards, two backwards, then sgd_ in place), three steps: one kernel
    spectra computation per step, made by the update (the first step's forward computes the
    first), so no forward after an update pays for them; the weights move as on the im2col path.
    Over the wire: the weights a worker's LOAD brings (decoded from the message's frames, as
    little-endian float32) hit the cache as well."""
    from hetconv.engine.shard import ShardServer
    from hetconv.transport import protocol as P
    spec = ConvSpec(in_channels=3, kernels=4, kh=3, kw=3, block=ConvBlock(padding=1))
    x, w, b, rng = tensors(4, 3, 8, 8, 4, 3, 3, seed=5)
    shards = {}
    for path in ("fft", "im2col"):
        shard = ConvShard(open_device("cpu", conv_path=path, threads=1))
        if arrival == "over the wire":
            fields = {"layer": 0, "spec": spec.to_json(), "start": 0, "stop": 4, "wire": "float32",
                      "optimizer": "sgd", "names": ["w", "b"], "bn_ghost_batch": 0}
            ShardServer(shard).load(P.unpack(P.pack("LOAD", 1, [w, b], **fields)).arrays, fields)
        else:
            shard.load(0, spec, 0, 4, {"w": w, "b": b})
        shards[path] = shard
    fft_device = shards["fft"].device
    counted = []
    for step in range(3):
        douts = [rng.standard_normal((2, 4, 4, 4)).astype(np.float32) for _ in range(2)]
        for shard in shards.values():
            for micro in range(2):
                shard.forward(0, x[2 * micro:2 * micro + 2], micro)
            if shard is shards["fft"]:
                counted.append(fft_device._fft.spectra_computed)
            for micro in (1, 0):
                shard.backward(0, douts[micro], need_dx=True, micro=micro,
                               update=UpdateRule(lr=0.1, momentum=0.9, weight_decay=1e-4) if micro == 0 else None)
        counted.append(fft_device._fft.spectra_computed)
    assert counted == [1, 2, 2, 3, 3, 4]       # (after the forwards, after the update) per step
    got, want = shards["fft"].fetch(0), shards["im2col"].fetch(0)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5)


def test_the_spectra_cache_keeps_no_weights_alive_and_reuses_a_gone_arrays_buffer():
    """Calibration times layers on weight arrays it then drops; the training weights that follow
    (same shape) take over their spectra buffer instead of allocating another and pushing the
    live ones out of the budget; the cache holds the weights only weakly."""
    import gc
    import weakref
    dev = open_device("cpu", conv_path="fft", threads=1)
    x, w, b, rng = tensors(2, 3, 9, 9, 4, 3, 3, seed=3)
    calibration = w.copy()
    dev.conv2d(x, calibration, b, padding=1)
    (entry,) = dev._fft._entries
    buffer = entry.spectra
    gone = weakref.ref(calibration)
    del calibration
    gc.collect()
    assert gone() is None                      # the cache did not keep it
    assert_close(dev.conv2d(x, w, b, padding=1), R.conv2d(x, w, b, padding=1), "y on new weights")
    (entry,) = dev._fft._entries
    assert entry.spectra is buffer and entry.holds(w)
    del w
    gc.collect()                               # a spare until an array of another shape misses
    other = tensors(2, 3, 9, 9, 6, 3, 3, seed=4)[1]
    dev.conv2d(x, other, np.zeros(6, np.float32), padding=1)
    assert [e.spectra.shape[2] for e in dev._fft._entries] == [6]


def test_weights_changed_in_place_are_never_served_stale_spectra():
    dev = open_device("cpu", conv_path="fft", threads=1)
    x, w, b, rng = tensors(2, 3, 9, 9, 4, 3, 3, seed=2)
    dev.conv2d(x, w, b, padding=1)
    w[1, 2, 0, 1] += 0.5               # one weight, in place: the same array object
    assert_close(dev.conv2d(x, w, b, padding=1), R.conv2d(x, w, b, padding=1), "y after an in-place change")
    dy = rng.standard_normal((2, 4, 9, 9)).astype(np.float32)
    w *= -1.0
    got = dev.conv2d_backward(x, w, dy, padding=1)
    for name, g, r in zip(("dx", "dw", "db"), got, R.conv2d_backward(x, w, dy, padding=1)):
        assert_close(g, r, name)
    assert dev._fft.spectra_computed == 3


def test_spectra_over_the_budget_take_the_direct_path_and_say_why(capsys):
    x, w, b, rng = tensors(2, 3, 9, 9, 4, 3, 3, seed=4)
    dev = open_device("cpu", conv_path="fft", threads=1, fft_budget_bytes=1000, verbose=True)
    check_plain(dev, x, w, b, 1, rng)
    out, ctx = dev.conv_block(x, w, b, ConvBlock(padding=1))
    assert_close(out, R.conv_block(x, w, b, ConvBlock(padding=1)), "out")
    assert dev._fft.spectra_computed == 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines          # once per layer shape, not once per call
    assert "takes the direct path, not FFT" in lines[0] and "over the FFT budget of 0 MB" in lines[0]


def test_strided_layers_take_the_direct_path(fft):
    x, w, b, rng = tensors(2, 3, 11, 10, 4, 3, 3, seed=6)
    y = fft.conv2d(x, w, b, stride=2, padding=1)
    assert_close(y, R.conv2d(x, w, b, stride=2, padding=1), "y")
    block = ConvBlock(stride=2, padding=1, pool="max", pool_kernel=2, pool_stride=2)
    out, ctx = fft.conv_block(x, w, b, block)
    assert_close(out, R.conv_block(x, w, b, block), "out")


def test_unknown_conv_path_names_the_choices():
    with pytest.raises(DeviceError, match=r"conv_path must be one of \('auto', 'im2col', 'shifted', 'fft', 'im2col-dnnl', 'direct-dnnl', 'depthwise', 'winograd'\), "
                                           r"got 'fftw'"):
        open_device("cpu", conv_path="fftw")


@pytest.mark.parametrize("p,q", [(14, 14), (5, 7), (1, 1), (32, 32), (6, 3)])
def test_kept_frequencies_stand_for_the_whole_spectrum(p, q):
    """One frequency per conjugate pair, weights summing to P*Q: each kept frequency and its
    conjugate cover every frequency exactly once."""
    kept = kept_frequencies(p, q)
    covered = {}
    for fp, fq, weight in kept:
        for pair in {(fp, fq), ((-fp) % p, (-fq) % q)}:
            covered[pair] = covered.get(pair, 0) + 1
        assert weight == len({(fp, fq), ((-fp) % p, (-fq) % q)})
    assert sorted(covered) == [(a, e) for a in range(p) for e in range(q)]
    assert set(covered.values()) == {1}
    assert int(kept[:, 2].sum()) == p * q


# ---- conv_path="auto": the path per call shape, by timing -----------------------------------------
class FakeTimer:
    """Seconds per path as given, counting the calls: no real timing in a unit test."""

    def __init__(self, seconds):
        self.seconds, self.calls = seconds, []

    def __call__(self, path, run):
        run()
        self.calls.append(path)
        return self.seconds[path]


def auto_device(seconds, **options):
    """The OpenBLAS paths' choice (oneDNN's paths, where installed, are timed in test_cpu_precision)."""
    timer = FakeTimer(seconds)
    options = {"threads": 1, "auto_timed_min_flops": 0, "onednn": False, **options}
    return open_device("cpu", conv_path="auto", auto_timer=timer, **options), timer


@pytest.mark.parametrize("fastest", ["im2col", "shifted", "fft"])
def test_auto_runs_the_path_its_timer_finds_fastest(fastest):
    """Whichever path the timer calls fastest is the one the call runs (the others slower by 10%
    and 50%), with correct results; every candidate is timed in each round."""
    from hetconv.devices.cpu_path_choice import AUTO_TIMED_ROUNDS
    seconds = {p: 1.5 for p in ("im2col", "shifted", "fft")}
    seconds[fastest] = 1.0
    seconds[{"im2col": "shifted", "shifted": "fft", "fft": "im2col"}[fastest]] = 1.1
    dev, timer = auto_device(seconds)
    x, w, b, rng = tensors(2, 3, 9, 8, 4, 3, 3, seed=21)
    check_plain(dev, x, w, b, 1, rng)
    assert list(dev.conv_paths().values()) == [fastest]
    assert sorted(timer.calls) == sorted(["im2col", "shifted", "fft"] * AUTO_TIMED_ROUNDS)
    # the FFT trial's spectra stay only where FFT won: an update refreshes every cached entry
    assert any(e.holds(w) for e in dev._fft._entries) == (fastest == "fft")
    dev.conv_block(x, w, b, ConvBlock(padding=1))               # the block form's own timing
    spectra_before = dev._fft.spectra_computed
    w[0, 0, 0, 0] += 0.25               # new weights: the FFT path must compute their spectra
    out, ctx = dev.conv_block(x, w, b, ConvBlock(padding=1))
    assert_close(out, R.conv_block(x, w, b, ConvBlock(padding=1)), "out")
    assert (dev._fft.spectra_computed > spectra_before) == (fastest == "fft")
    assert list(dev.conv_paths().values()) == [fastest, fastest]


def test_auto_times_a_path_far_behind_only_once():
    """After the first round, a path over AUTO_DROP_FACTOR times the fastest is not timed again."""
    from hetconv.devices.cpu_path_choice import AUTO_DROP_FACTOR, AUTO_TIMED_ROUNDS
    dev, timer = auto_device({"im2col": 1.0, "shifted": 1.0 * AUTO_DROP_FACTOR, "fft": 1.01 * AUTO_DROP_FACTOR})
    x, w, b, rng = tensors(2, 3, 9, 8, 4, 3, 3, seed=27)
    dev.conv2d(x, w, b, padding=1)
    assert timer.calls.count("fft") == 1
    assert timer.calls.count("im2col") == timer.calls.count("shifted") == AUTO_TIMED_ROUNDS


def test_short_calls_are_timed_in_more_rounds():
    """Runs that add up to less than AUTO_TIMED_MIN_SECONDS get more rounds, at most
    AUTO_TIMED_MAX_ROUNDS; the fastest minimum still wins."""
    from hetconv.devices.cpu_path_choice import AUTO_TIMED_MAX_ROUNDS, AUTO_TIMED_MIN_SECONDS, AUTO_TIMED_ROUNDS
    for im2col_s, rounds in ((AUTO_TIMED_MIN_SECONDS, AUTO_TIMED_ROUNDS), (1e-6, AUTO_TIMED_MAX_ROUNDS)):
        dev, timer = auto_device({"im2col": im2col_s, "shifted": 1.2 * im2col_s, "fft": 1.4 * im2col_s})
        x, w, b, rng = tensors(2, 3, 9, 8, 4, 3, 3, seed=28)
        dev.conv2d(x, w, b, padding=1)
        assert [timer.calls.count(p) for p in ("im2col", "shifted", "fft")] == [rounds] * 3
        assert list(dev.conv_paths().values()) == ["im2col"]


def test_auto_choice_is_kept_per_call_shape():
    """One timing per (input shape, weights shape, stride, padding, form): the same call again
    times nothing; another padding or the block form each time once, and so does another batch
    size whose work is more than AUTO_REUSE_FACTOR from the timed call's."""
    from hetconv.devices.cpu_path_choice import AUTO_REUSE_FACTOR
    dev, timer = auto_device({"im2col": 2.0, "shifted": 3.0, "fft": 1.0})
    x, w, b, rng = tensors(5, 3, 9, 8, 4, 3, 3, seed=22)
    dev.conv2d(x, w, b, padding=1)
    timed_once = len(timer.calls)
    dev.conv2d(x, w, b, padding=1)
    dev.conv2d_backward(x, w, np.ones((5, 4, 9, 8), np.float32), padding=1)
    assert len(timer.calls) == timed_once
    assert 5 / 2 > AUTO_REUSE_FACTOR
    dev.conv2d(x[:2], w, b, padding=1)
    dev.conv2d(x, w, b, padding=0)
    dev.conv_block(x, w, b, ConvBlock(padding=1))
    assert len(timer.calls) == 4 * timed_once
    assert len(dev.conv_paths()) == 4 and set(dev.conv_paths().values()) == {"fft"}


def test_a_layer_timed_once_keeps_its_choice_for_calls_of_similar_work():
    """Calls of a timed layer on the same images with kernels within AUTO_REUSE_FACTOR of the
    timed call's (calibration's half share; a training share) run its path untimed and say where
    it was timed, even where the timer now favours another path; another batch size is timed
    again (the FFT path's kernel spectra are paid once a call, whatever the images)."""
    from hetconv.devices.cpu_path_choice import AUTO_REUSE_FACTOR
    dev, timer = auto_device({"im2col": 2.0, "shifted": 3.0, "fft": 1.0})
    x, w, b, rng = tensors(4, 3, 9, 8, 8, 3, 3, seed=29)
    dev.conv2d(x, w, b, padding=1)
    timed_once = len(timer.calls)
    timer.seconds = {"im2col": 1.0, "shifted": 3.0, "fft": 2.0}
    assert 2 <= AUTO_REUSE_FACTOR < 8
    check_plain(dev, x, np.ascontiguousarray(w[:4]), b[:4], 1, rng)     # half the kernels
    assert len(timer.calls) == timed_once
    choices = dev.conv_path_choices()
    assert [c["path"] for c in choices] == ["fft"] * 2
    assert choices[1]["why"].startswith("as timed for x (4, 3, 9, 8) w (8, 3, 3, 3)")
    dev.conv2d(x, np.ascontiguousarray(w[:1]), b[:1], padding=1)          # 8x fewer kernels: timed again
    check_plain(dev, x[:2], w, b, 1, rng)                                   # half the batch: timed again
    assert len(timer.calls) > timed_once
    assert [c["path"] for c in dev.conv_path_choices()[2:]] == ["im2col", "im2col"]
    # more images than a call that chose FFT (an evaluation's batch): FFT's lead only grows, untimed
    timed_twice = len(timer.calls)
    dev.conv2d(np.concatenate([x, x]), w, b, padding=1)
    assert len(timer.calls) == timed_twice and dev.conv_path_choices()[-1]["path"] == "fft"
    # ... but more images than a call that chose a direct path (the one kernel's, above) are timed
    dev.conv2d(np.concatenate([x, x]), np.ascontiguousarray(w[:1]), b[:1], padding=1)
    assert len(timer.calls) > timed_twice


def test_auto_takes_the_median_of_its_rounds_and_fft_only_by_a_margin():
    """A path's one lucky run does not choose it (the median of its rounds does), and the FFT
    path must beat the fastest direct path by AUTO_FFT_MARGIN; a direct path by any amount."""
    from hetconv.devices.cpu_path_choice import AUTO_FFT_MARGIN, AUTO_TIMED_ROUNDS
    x, w, b, rng = tensors(2, 3, 9, 8, 4, 3, 3, seed=31)
    lucky = {"im2col": [1.0] * 9, "shifted": [1.2] * 9, "fft": [0.8] + [1.3] * 8}     # fft the fastest minimum

    def timer(path, run):
        run()
        return lucky[path].pop(0)

    dev = open_device("cpu", conv_path="auto", auto_timer=timer, threads=1, auto_timed_min_flops=0, onednn=False)
    dev.conv2d(x, w, b, padding=1)
    assert AUTO_TIMED_ROUNDS >= 2 and list(dev.conv_paths().values()) == ["im2col"]
    for fft_s, path in ((1.0 - 0.5 * AUTO_FFT_MARGIN, "im2col"), (1.0 - 2 * AUTO_FFT_MARGIN, "fft")):
        dev, _ = auto_device({"im2col": 1.0, "shifted": 1.5, "fft": fft_s})
        dev.conv2d(x, w, b, padding=1)
        assert list(dev.conv_paths().values()) == [path]
    dev, _ = auto_device({"im2col": 1.0, "shifted": 0.99, "fft": 2.0})
    dev.conv2d(x, w, b, padding=1)
    assert list(dev.conv_paths().values()) == ["shifted"]


def test_paths_warmed_on_a_bigger_call_are_timed_without_a_warm_up():
    """Each path's first timing runs it once untimed (its first use); a later timing of a call
    no bigger than one it was warmed on does not."""
    dev, timer = auto_device({"im2col": 2.0, "shifted": 3.0, "fft": 1.0})
    runs = []
    backward = dev._conv2d_backward
    dev._conv2d_backward = lambda *a, **k: runs.append(dev._trial_path) or backward(*a, **k)
    x, w, b, rng = tensors(8, 3, 9, 8, 4, 3, 3, seed=30)
    dev.conv2d(x, w, b, padding=1)
    assert len(runs) == len(timer.calls) + 3                    # one warm-up per path
    runs.clear(), timer.calls.clear()
    dev.conv2d(x[:1], w, b, padding=1)                          # 8x less work: timed, not warmed
    assert len(runs) == len(timer.calls) > 0
    runs.clear(), timer.calls.clear()
    dev.conv2d(x, w, b, padding=2)                              # a bigger output: warmed again
    assert len(runs) == len(timer.calls) + 3


def test_auto_times_only_the_paths_a_layer_can_take():
    """Over the FFT budget only the direct paths are timed; at stride 2 im2col is the only path,
    run untimed."""
    dev, timer = auto_device({"im2col": 2.0, "shifted": 1.0}, fft_budget_bytes=1000)
    x, w, b, rng = tensors(2, 3, 9, 8, 4, 3, 3, seed=23)
    check_plain(dev, x, w, b, 1, rng)
    assert "fft" not in timer.calls and list(dev.conv_paths().values()) == ["shifted"]
    timer.calls.clear()
    assert_close(dev.conv2d(x, w, b, stride=2, padding=1), R.conv2d(x, w, b, stride=2, padding=1), "y")
    assert timer.calls == [] and list(dev.conv_paths().values())[-1] == "im2col"


def test_small_layers_keep_the_rule_untimed():
    """Under auto_timed_min_flops (default 20 MFLOP per forward call) nothing is timed: the
    rule's path runs, and the report says so."""
    def no_timing(path, run):
        raise AssertionError(f"timed {path} on a small layer")

    # OpenBLAS's paths, as auto_device: where oneDNN is installed the rule runs on its sgemm
    dev = open_device("cpu", conv_path="auto", threads=1, auto_timer=no_timing, onednn=False)
    x, w, b, rng = tensors(2, 3, 9, 8, 4, 3, 3, seed=24)       # ~0.03 MFLOP
    check_plain(dev, x, w, b, 1, rng)
    assert list(dev.conv_paths().values()) == ["im2col"]
    (line,) = dev.describe_conv_paths()
    assert "rule:" in line and "under the 20 timed" in line


def test_auto_choice_is_reported(capsys):
    """conv_paths() names each call shape and its path; describe_conv_paths() and the verbose
    log give every path's time."""
    dev, _ = auto_device({"im2col": 0.004, "shifted": 0.003, "fft": 0.002}, verbose=True)
    x, w, b, rng = tensors(2, 3, 9, 8, 4, 3, 3, seed=25)
    dev.conv_block(x, w, b, ConvBlock(padding=1))
    (key, path), = dev.conv_paths().items()
    assert path == "fft" and "x (2, 3, 9, 8) w (4, 3, 3, 3)" in key and "padding (1, 1)" in key and "block" in key
    (line,) = dev.describe_conv_paths()
    assert line.endswith("fft (timed forward+backward: fft 2.0 ms, shifted 3.0 ms, im2col 4.0 ms)")
    assert capsys.readouterr().err.strip() == f"cpu device: {line.replace(': fft (', ' runs fft (')}"


def test_forced_paths_are_reported_as_forced():
    dev = open_device("cpu", conv_path="fft", threads=1, fft_budget_bytes=1000)
    x, w, b, rng = tensors(2, 3, 9, 8, 4, 3, 3, seed=26)
    dev.conv2d(x, w, b, padding=1)
    (line,) = dev.describe_conv_paths()
    assert "fft declined: its kernel spectra need" in line
    dev = open_device("cpu", conv_path="shifted", threads=1)
    dev.conv2d(x, w, b, padding=1)
    assert dev.describe_conv_paths()[0].endswith("shifted (forced)")


def test_a_reused_fft_choice_keeps_the_fft_budget():
    """A layer timed at k kernels chose FFT; a call of the same layer with 2k kernels (calibration
    times half the share first; a worker's share grows when another is lost) whose kernel spectra
    exceed the FFT budget runs the fastest direct path of that timing, untimed, never FFT."""
    from hetconv.devices.cpu_fft import spectra_bytes
    x, w, b, rng = tensors(4, 3, 9, 8, 8, 3, 3, seed=32)
    probe = open_device("cpu", threads=1)
    g = probe._fft.geometry(x.shape, w.shape, (1, 1))
    budget = (spectra_bytes(g, 4, 3) + spectra_bytes(g, 8, 3)) // 2        # 4 kernels fit, 8 do not
    dev, timer = auto_device({"im2col": 2.0, "shifted": 3.0, "fft": 1.0}, fft_budget_bytes=budget)
    half = np.ascontiguousarray(w[:4])
    dev.conv2d(x, half, b[:4], padding=1)
    timed_once = len(timer.calls)
    assert dev.conv_path_choices()[0]["path"] == "fft"
    check_plain(dev, x, w, b, 1, rng)                                        # twice the kernels
    assert len(timer.calls) == timed_once
    choice = dev.conv_path_choices()[-1]
    assert choice["path"] == "im2col" and "fft declined: its kernel spectra need" in choice["why"]
    assert not any(e.holds(w) for e in dev._fft._entries)


def test_a_large_map_is_declined_from_its_shape_without_building_its_transform():
    """A 128x128 map's transform matrices grow with the square of its area (~10 GB in float64):
    the path declines it from the shapes alone, and builds nothing."""
    dev = open_device("cpu", threads=1)
    why = dev._fft.declines((32, 3, 128, 128), (32, 3, 5, 5), (2, 2))
    assert why.startswith("its transform matrices need 9") and "over the 256 MB a layer" in why, why
    assert not dev._fft._geometries
    assert dev._fft.declines((32, 3, 32, 32), (32, 3, 5, 5), (2, 2)) == ""


@pytest.mark.parametrize("p,q", [(1, 1), (2, 3), (5, 4), (8, 8), (7, 9), (36, 36), (35, 20)])
def test_the_kept_frequencies_are_counted_without_listing_them(p, q):
    from hetconv.devices.cpu_fft import kept_count, kept_frequencies
    assert kept_count(p, q) == len(kept_frequencies(p, q))
