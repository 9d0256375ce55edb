"""The CPU device's Winograd F(4x4, 3x3) path (devices/cpu_winograd.py) against the numpy
reference: its kernels alone (every padding it takes, outputs that end inside a tile, chunks of
images, V kept from forward or recomputed, 1 and 2 threads), the device's blocks forced onto it,
what it declines and why, and when the timed choice takes it."""
import re

import numpy as np
import pytest

from hetconv.devices import cpu_path_choice, cpu_winograd, open_device
from hetconv.devices.base import ConvBlock
from hetconv.devices.cpu_winograd import FREQUENCIES, WinogradConvs, frequency_stride
from hetconv.net import reference as R


def close(a, b, rtol=1e-4):
    """Winograd's float32 rounding: a few parts in 1e5 of the largest value (a direct sum's is
    about ten times less), and no more."""
    scale = max(1.0, float(np.abs(b).max()))
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * 0.1 * scale)


def numpy_convs(budget_bytes=64 << 20):
    buffers = {}

    def scratch(name, shape):
        size = int(np.prod(shape))
        if name not in buffers or buffers[name].size < size:
            buffers[name] = np.empty(size, np.float32)
        return buffers[name][:size].reshape(shape)

    def gemm(a, b, c, beta):
        c[...] = a @ b if beta == 0.0 else a @ b + c

    return WinogradConvs(gemm, scratch, budget_bytes)


# (N, C, H, W, K, padding): outputs a whole number of tiles and not, padding 0, 1, 2 and uneven,
# an output smaller than one tile, wide and tall inputs
SHAPES = [(2, 3, 10, 10, 4, (1, 1)), (3, 5, 9, 7, 6, (0, 0)), (1, 4, 7, 11, 3, (2, 2)),
          (2, 2, 6, 9, 5, (2, 0)), (2, 3, 3, 4, 2, (0, 1)), (1, 6, 17, 5, 7, (1, 2))]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("budget", [64 << 20, 1], ids=("one-chunk", "image-chunks"))
@pytest.mark.parametrize("keep_v", [True, False], ids=("kept", "recomputed"))
def test_the_kernels_compute_the_reference(shape, budget, keep_v):
    n, c, h, wd, k, padding = shape
    rng = np.random.default_rng(sum(shape[:5]))
    x = rng.standard_normal((n, c, h, wd)).astype(np.float32)
    w = rng.standard_normal((k, c, 3, 3)).astype(np.float32)
    convs = numpy_convs(budget)
    assert convs.declines(x.shape, w.shape, (1, 1), padding) == ""
    assert len(convs._chunks(x.shape, w.shape, padding)) == (n if budget == 1 else 1)
    ho, wo = h + 2 * padding[0] - 2, wd + 2 * padding[1] - 2
    y = np.full((n, k, ho, wo), np.nan, np.float32)
    saved = np.empty(convs.src_nbytes(x.shape, w.shape, (1, 1), padding), np.uint8) if keep_v else None
    convs.forward(x, w, (1, 1), padding, y, saved)
    close(y, R.conv2d(x, w, np.zeros(k, np.float32), 1, padding))
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dw = np.full(w.shape, np.nan, np.float32)
    handed = []
    dx = convs.backward(x, w, dy, (1, 1), padding, True, dw, saved, on_dx=lambda a: handed.append(a.copy()))
    rdx, rdw, _ = R.conv2d_backward(x, w, dy, 1, padding)
    close(dx, rdx)
    close(dw, rdw)
    np.testing.assert_array_equal(handed[0], dx)
    dw2 = np.empty_like(dw)
    assert convs.backward(x, w, dy, (1, 1), padding, False, dw2, saved) is None
    np.testing.assert_array_equal(dw2, dw)


@pytest.mark.parametrize("line_tiles", [1, 20], ids=("an-image-a-task", "two-images-a-task"))
def test_tasks_of_a_few_images_give_the_same_bits_as_one_task_a_channel(monkeypatch, line_tiles):
    """The tile kernels cut a channel's images into runs of about LINE_TILES tiles: with runs of
    one image, or of two with a shorter last one (5 images of 12 tiles, two chunks), every value
    is the one a task of the whole chunk computes; at the default every chunk is one run here."""
    n, c, h, wd, k, padding = 5, 4, 10, 14, 3, (1, 1)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((n, c, h, wd)).astype(np.float32)
    w = rng.standard_normal((k, c, 3, 3)).astype(np.float32)
    dy = rng.standard_normal((n, k, h, wd)).astype(np.float32)

    def run():
        convs = numpy_convs(budget_bytes=3 * FREQUENCIES * 12 * (2 * c + k) * 4)     # chunks of 3 and 2 images
        assert [n1 - n0 for n0, n1 in convs._chunks(x.shape, w.shape, padding)] == [3, 2]
        y, dw = np.empty((n, k, h, wd), np.float32), np.empty(w.shape, np.float32)
        convs.forward(x, w, (1, 1), padding, y)
        return y, convs.backward(x, w, dy, (1, 1), padding, True, dw), dw

    whole = run()
    monkeypatch.setattr(cpu_winograd, "LINE_TILES", line_tiles)
    assert cpu_winograd._images_per_task(12, 3) == (1 if line_tiles == 1 else 2)
    for got, want in zip(run(), whole):
        np.testing.assert_array_equal(got, want)
    close(whole[0], R.conv2d(x, w, np.zeros(k, np.float32), 1, padding))


def test_the_error_is_winograds_and_not_more():
    """On a layer of resnet18's size the float32 error against a float64 reference stays under 3e-5
    of the output's largest value (about 10x a direct sum's), forward and backward."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 64, 16, 16)).astype(np.float32)
    w = (rng.standard_normal((64, 64, 3, 3)) / 24).astype(np.float32)
    convs = numpy_convs()
    y = np.empty((2, 64, 16, 16), np.float32)
    convs.forward(x, w, (1, 1), (1, 1), y)
    ref = R._conv64(x, w, None, 1, 1)
    assert np.abs(y - ref).max() <= 3e-5 * np.abs(ref).max()
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dw = np.empty_like(w)
    dx = convs.backward(x, w, dy, (1, 1), (1, 1), True, dw)
    rdx, rdw = R._conv_backward64(x, w, dy, 1, 1, True)[:2]
    assert np.abs(dx - rdx).max() <= 3e-5 * np.abs(rdx).max()
    assert np.abs(dw - rdw).max() <= 3e-5 * np.abs(rdw).max()


def test_the_36_frequencies_start_apart_in_the_cache():
    """Frequency matrices a multiple of 4 KB apart fell into the same cache sets (8x slower weight
    transform): each stride is 64 bytes past a multiple of 4 KB and holds its matrix."""
    for rows, cols in [(64, 64), (256, 256), (3, 5), (1, 1), (512, 1024)]:
        stride = frequency_stride(rows, cols)
        assert stride >= rows * cols and (stride * 4) % 4096 == 64
    convs = numpy_convs()
    x_shape, w_shape = (4, 8, 12, 12), (8, 8, 3, 3)
    assert convs.src_nbytes(x_shape, w_shape, (1, 1), (1, 1)) == FREQUENCIES * frequency_stride(8, 4 * 9) * 4


@pytest.mark.parametrize("call,why", [
    (((1, 3, 8, 8), (4, 3, 5, 5), (1, 1), (1, 1)), "takes dense 3x3 convs at stride 1, got 5x5 kernels"),
    (((1, 3, 8, 8), (4, 3, 3, 3), (2, 2), (1, 1)), r"stride \(2, 2\)"),
    (((1, 4, 8, 8), (4, 2, 3, 3), (1, 1), (1, 1), (1, 1), 2), "2 groups"),
    (((1, 3, 8, 8), (4, 3, 3, 3), (1, 1), (1, 1), (2, 2)), r"dilation \(2, 2\)"),
    (((1, 3, 8, 8), (4, 3, 3, 3), (1, 1), (3, 3)), r"takes padding 0 to 2, got \(3, 3\)"),
    (((1, 3, 2, 8), (4, 3, 3, 3), (1, 1), (0, 0)), "no output"),
])
def test_what_it_declines_is_named(call, why):
    assert re.search(why, WinogradConvs.declines(*call))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("block", [ConvBlock(padding=1), ConvBlock(padding=1, pool="none"),
                                   ConvBlock(padding=0, activation="none", pool="avg", pool_kernel=3, pool_stride=2),
                                   ConvBlock(stride=2, padding=1, pool="none")], ids=str)
def test_the_forced_path_runs_blocks_and_plain_convs_as_the_reference(threads, block):
    """conv_path="winograd": 3x3 stride-1 blocks and plain convs on it (dW written and added into a
    buffer, dX before dW), a stride-2 block on the rule's path, saying why."""
    cpu = open_device("cpu", threads=threads, conv_path="winograd", im2col_budget_bytes=20000)
    rng = np.random.default_rng(threads)
    x = rng.standard_normal((3, 5, 11, 10)).astype(np.float32)
    w = (rng.standard_normal((6, 5, 3, 3)) / 4).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    out, ctx = cpu.conv_block(x, w, b, block)
    close(out, R.conv_block(x, w, b, block))
    dout = rng.standard_normal(out.shape).astype(np.float32)
    rdx, rdw, rdb = R.conv_block_backward(x, w, b, block, dout)
    start = rng.standard_normal(w.shape).astype(np.float32)
    dw_out = start.copy()
    seen = []
    dx, dw, db = cpu.conv_block_backward(ctx, w, dout, True, dw_out=dw_out, accumulate=True,
                                         on_dx=lambda a: seen.append(np.array_equal(dw_out, start)))
    close(dx, rdx)
    close(dw, start + rdw)
    close(db, rdb)
    paths = cpu.conv_path_choices()
    if block.stride == (1, 1):
        assert seen == [True]                       # dX handed over before dW was added
        assert [(c["path"], c["why"]) for c in paths] == [("winograd", "forced")]
        y = cpu.conv2d(x, w, b, stride=1, padding=1)
        close(y, R.conv2d(x, w, b, 1, 1))
        gy = rng.standard_normal(y.shape).astype(np.float32)
        for got, want in zip(cpu.conv2d_backward(x, w, gy, stride=1, padding=1), R.conv2d_backward(x, w, gy, 1, 1)):
            close(got, want)
    else:
        assert len(paths) == 1 and paths[0]["path"] != "winograd"
        assert paths[0]["why"].startswith("winograd declined: Winograd F(4x4, 3x3) takes dense 3x3 convs at stride 1")


def _faked(seconds, threads=1):
    """A device whose path timings are `seconds` (path -> seconds of one run), timing every call."""
    return open_device("cpu", threads=threads, auto_timed_min_flops=0,
                       auto_timer=lambda path, run: seconds[path])


TIMES = {"im2col": 1.0, "shifted": 1.1, "fft": 3.0, "im2col-dnnl": 0.9, "shifted-dnnl": 0.95, "direct-dnnl": 0.8}


@pytest.mark.parametrize("winograd,chosen", [(0.5, "winograd"), (0.78, "direct-dnnl"), (0.9, "direct-dnnl")])
def test_auto_takes_winograd_only_by_its_margin_and_only_on_layers_wide_enough(winograd, chosen):
    cpu = _faked({**TIMES, "winograd": winograd})
    have = set(cpu.machine_key()["paths"])
    if "direct-dnnl" not in have:                   # without oneDNN: the OpenBLAS paths only
        chosen = "winograd" if winograd < 0.96 * 1.0 else "im2col"
    rng = np.random.default_rng(0)
    c = cpu_path_choice.WINOGRAD_MIN_CHANNELS
    x = rng.standard_normal((1, c, 6, 6)).astype(np.float32)
    w = rng.standard_normal((c, c, 3, 3)).astype(np.float32) / c
    out, ctx = cpu.conv_block(x, w, np.zeros(c, np.float32), ConvBlock(padding=1, pool="none"))
    choice = cpu.conv_path_choices()[0]
    assert "winograd" in choice["seconds"] and choice["path"] == chosen
    narrow = _faked({**TIMES, "winograd": 0.01})    # fewer kernels than the minimum: not a candidate
    narrow.conv_block(x, w[:c - 1], np.zeros(c - 1, np.float32), ConvBlock(padding=1, pool="none"))
    assert "winograd" not in narrow.conv_path_choices()[0]["seconds"]


def test_where_winograd_is_a_candidate_each_kernel_count_is_timed_for_itself():
    """A choice timed with a worker's share of the kernels is not reused for the layer's call with
    all of them (a data-parallel block's) where Winograd is a candidate: its fixed cost per call
    ranks it differently. Without Winograd among the candidates (a 5x5 layer) the choice carries
    over, as before."""
    timed = []

    def timer(path, run):
        timed.append(path)
        return {"winograd": 0.5}.get(path, 1.0)

    cpu = open_device("cpu", threads=1, auto_timed_min_flops=0, auto_timer=timer)
    c = cpu_path_choice.WINOGRAD_MIN_CHANNELS
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, c, 6, 6)).astype(np.float32)
    block = ConvBlock(padding=1, pool="none")
    for kernels in (2 * c, 4 * c):
        w = rng.standard_normal((kernels, c, 3, 3)).astype(np.float32) / c
        cpu.conv_block(x, w, np.zeros(kernels, np.float32), block)
    whys = [choice["why"] for choice in cpu.conv_path_choices()]
    assert whys == ["timed", "timed"] and timed.count("winograd") >= 4
    for kernels in (2 * c, 4 * c):
        w = rng.standard_normal((kernels, c, 5, 5)).astype(np.float32) / c
        cpu.conv_block(x, w, np.zeros(kernels, np.float32), ConvBlock(padding=2, pool="none"))
    assert cpu.conv_path_choices()[3]["why"].startswith("as timed for")
