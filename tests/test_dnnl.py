"""oneDNN's GEMMs through ctypes (every operand layout against numpy, bad views named, the thread
count obeyed), the bf16 rounding against PyTorch's, and the one line a missing library gives."""
import os
import subprocess
import sys

import numpy as np
import pytest

from hetconv.devices import dnnl
from hetconv.devices.base import DeviceError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MISSING = dnnl.unavailable_reason()
needs_dnnl = pytest.mark.skipif(bool(MISSING), reason=f"oneDNN is an optional extra: {MISSING}")


@pytest.fixture(scope="module")
def lib():
    if MISSING:
        pytest.skip(f"oneDNN is an optional extra: {MISSING}")
    return dnnl.load()


# ---- bf16 rounding (Numba only: runs everywhere) --------------------------------------------------
def _torch_bf16_bits(x):
    torch = pytest.importorskip("torch", reason="PyTorch is an optional extra")
    return torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def test_rounding_matches_pytorch_on_every_kind_of_float():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 2 ** 32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = x[~np.isnan(x)]                                     # every exponent, subnormals, infinities
    np.testing.assert_array_equal(dnnl.to_bf16(x), _torch_bf16_bits(x))


def test_ties_go_to_even_and_the_largest_floats_round_to_infinity():
    halfway = ((np.arange(1 << 16, dtype=np.uint32) << 16) | 0x8000).view(np.float32)
    halfway = halfway[~np.isnan(halfway)]
    got = dnnl.to_bf16(halfway)
    np.testing.assert_array_equal(got & 1, 0)               # the even neighbour, always
    np.testing.assert_array_equal(got, _torch_bf16_bits(halfway))
    big = np.array([3.4028235e38, -3.4028235e38, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8], np.float32)
    np.testing.assert_array_equal(dnnl.to_bf16(big), [0x7F80, 0xFF80, 0x3F80, 0x3F82])


def test_nan_stays_a_nan():
    x = np.array([np.nan, -np.nan], np.float32)
    x[1] = np.frombuffer(np.uint32(0xFFC12345).tobytes(), np.float32)[0]
    np.testing.assert_array_equal(dnnl.to_bf16(x), [0x7FC0, 0x7FC0])
    assert np.isnan(dnnl.from_bf16(dnnl.to_bf16(x))).all()


def test_a_window_of_a_wider_buffer_is_rounded_in_place_of_a_copy():
    rng = np.random.default_rng(2)
    wide = rng.standard_normal((13, 40)).astype(np.float32)
    out = np.zeros((13, 64), np.uint16)
    dnnl.to_bf16(wide[:, 3:30], out[:, :27])
    np.testing.assert_array_equal(out[:, :27], dnnl.to_bf16(np.ascontiguousarray(wide[:, 3:30])))
    np.testing.assert_array_equal(out[:, 27:], 0)
    np.testing.assert_array_equal(dnnl.from_bf16(dnnl.to_bf16(wide)), dnnl.round_to_bf16(wide))
    assert (np.abs(dnnl.round_to_bf16(wide) - wide) <= np.abs(wide) * 2.0 ** -8).all()     # half an ulp of 8 bits


def test_rounding_refuses_what_is_not_float32():
    with pytest.raises(TypeError, match="to_bf16 takes a float32 numpy array, got float64"):
        dnnl.to_bf16(np.zeros(3))
    with pytest.raises(ValueError, match=r"out must be a uint16 array of shape \(3,\), got float32 \(3,\)"):
        dnnl.to_bf16(np.zeros(3, np.float32), np.zeros(3, np.float32))


# ---- the GEMMs ------------------------------------------------------------------------------------
def _operands(trans_a, trans_b, m=37, k=53, n=29, seed=3):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    view = (lambda t: np.ascontiguousarray(t.T).T)
    return a, b, (view(a) if trans_a else a), (view(b) if trans_b else b), rng.standard_normal((m, n)).astype(np.float32)


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
def test_sgemm_every_layout_matches_numpy(lib, trans_a, trans_b, beta):
    a, b, a_view, b_view, c = _operands(trans_a, trans_b)
    want = a.astype(np.float64) @ b + beta * c
    lib.sgemm(a_view, b_view, c, beta)
    np.testing.assert_allclose(c, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_bf16_gemm_sums_the_rounded_operands_in_float32(lib, trans_a, trans_b, beta):
    """Exact to float32 rounding against the product of the bf16 operands: only the operands are
    bf16, never the sum. Needs the CPU's instructions (the emulation's own test is below)."""
    if lib.bf16_error:
        pytest.skip(f"needs the CPU's bf16 GEMM: {lib.bf16_error}")
    a, b, a_view, b_view, c = _operands(trans_a, trans_b, k=300)
    want = dnnl.round_to_bf16(a).astype(np.float64) @ dnnl.round_to_bf16(b) + beta * c
    lib.gemm_bf16(dnnl.to_bf16(a_view), dnnl.to_bf16(b_view), c, beta)
    np.testing.assert_allclose(c, want, rtol=1e-5, atol=1e-4)
    fp32 = a.astype(np.float64) @ b + beta * c
    assert np.abs(c - fp32).max() > 1e-3                    # and they were rounded: not an sgemm


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_the_emulated_bf16_gemm_is_sgemm_on_the_rounded_operands_on_any_cpu(lib, trans_a, trans_b, beta):
    """The emulation (what runs where the CPU has no bf16 GEMM) is bit for bit oneDNN's sgemm of
    the operands rounded to bf16, in every layout: the same products, float32 sums, and not the
    float32 product of the unrounded operands."""
    a, b, a_view, b_view, c = _operands(trans_a, trans_b, k=300)
    a_bits, b_bits = dnnl.to_bf16(a_view), dnnl.to_bf16(b_view)
    want, c0 = c.copy(), c.copy()
    lib.sgemm(dnnl.from_bf16(a_bits), dnnl.from_bf16(b_bits), want, beta)     # widened in the bits' layout
    lib.emulated_gemm_bf16(a_bits, b_bits, c, beta)
    np.testing.assert_array_equal(c, want)
    a16, b16 = dnnl.round_to_bf16(a), dnnl.round_to_bf16(b)
    np.testing.assert_allclose(c, a16.astype(np.float64) @ b16 + beta * c0, rtol=1e-5, atol=1e-4)
    assert np.abs(c - (a.astype(np.float64) @ b)).max() > 1e-3                # the operands were rounded


def test_the_emulated_bf16_gemm_takes_windows_and_names_bad_operands(lib):
    rng = np.random.default_rng(5)
    a = dnnl.to_bf16(rng.standard_normal((20, 50)).astype(np.float32))
    b = dnnl.to_bf16(rng.standard_normal((60, 30)).astype(np.float32))
    out = np.zeros((25, 40), np.float32)
    lib.emulated_gemm_bf16(a[:15, 5:45], b[10:50, 2:22], out[5:20, 10:30])
    want = dnnl.from_bf16(a[:15, 5:45]).astype(np.float64) @ dnnl.from_bf16(b[10:50, 2:22])
    np.testing.assert_allclose(out[5:20, 10:30], want, rtol=1e-5, atol=1e-5)
    assert not out[:5].any() and not out[:, :10].any() and not out[:, 30:].any()
    with pytest.raises(ValueError, match="gemm_bf16: a must be a 2-D uint16 view, got float32"):
        lib.emulated_gemm_bf16(np.zeros((3, 4), np.float32), np.zeros((4, 2), np.uint16), np.zeros((3, 2), np.float32))


def test_the_emulation_agrees_with_the_cpus_bf16_gemm(lib):
    """Where the CPU has the instructions: the same products, summed in another order, so equal to
    the float32 rounding of the sums: within 2^-20 of the sum of the products' magnitudes (k = 3000
    float32 additions, each off by at most 2^-24 of a partial sum, bound that by 2^-24 * 3000)."""
    if lib.bf16_error:
        pytest.skip(f"needs the CPU's bf16 GEMM to compare with: {lib.bf16_error}")
    rng = np.random.default_rng(6)
    a = dnnl.to_bf16(rng.standard_normal((40, 3000)).astype(np.float32))
    b = dnnl.to_bf16(rng.standard_normal((3000, 30)).astype(np.float32))
    hardware, emulated = np.empty((40, 30), np.float32), np.empty((40, 30), np.float32)
    lib.gemm_bf16(a, b, hardware)
    lib.emulated_gemm_bf16(a, b, emulated)
    magnitude = np.abs(dnnl.from_bf16(a)).astype(np.float64) @ np.abs(dnnl.from_bf16(b))
    assert (np.abs(hardware.astype(np.float64) - emulated) <= 2.0 ** -20 * magnitude).all()


def test_windows_of_wider_buffers_as_operands_and_output(lib):
    rng = np.random.default_rng(4)
    a = rng.standard_normal((20, 50)).astype(np.float32)
    b = rng.standard_normal((60, 30)).astype(np.float32)
    out = np.zeros((25, 40), np.float32)
    lib.sgemm(a[:15, 5:45], b[10:50, 2:22], out[5:20, 10:30])
    np.testing.assert_allclose(out[5:20, 10:30], a[:15, 5:45].astype(np.float64) @ b[10:50, 2:22], rtol=1e-4, atol=1e-4)
    assert not out[:5].any() and not out[:, :10].any() and not out[:, 30:].any()


def _planes(count, rows, cols, stride, rng):
    """`count` (rows, cols) matrices `stride` floats apart in one flat buffer (as the Winograd
    path's frequency planes are), filled with normal values, and the buffer."""
    flat = rng.standard_normal(count * stride).astype(np.float32)
    return np.lib.stride_tricks.as_strided(flat, (count, rows, cols), (stride * 4, cols * 4, 4)), flat


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("beta", [0.0, 1.0])
@pytest.mark.parametrize("count", [36, 3], ids=["36-matrices", "3-matrices-cut-in-column-blocks"])
def test_sgemm_each_matches_numpy_on_every_layout(lib, trans_a, trans_b, beta, count, monkeypatch):
    """Every matrix of the batch, in one parallel region of one-thread GEMMs (and with fewer
    matrices than tasks, each cut into column blocks): the product numpy gives, nothing written
    between the matrices; with runs_each off (the TBB build), the one-by-one loop's same values."""
    import numba
    rng = np.random.default_rng(count)
    m, k, n = 13, 21, 35
    a, _ = _planes(count, k if trans_a else m, m if trans_a else k, 300, rng)
    b, _ = _planes(count, n if trans_b else k, k if trans_b else n, 800, rng)
    a_op, b_op = (a.transpose(0, 2, 1) if trans_a else a), (b.transpose(0, 2, 1) if trans_b else b)
    c, c_flat = _planes(count, m, n, 500, rng)
    before = c_flat.copy()
    want = np.einsum("imk,ikn->imn", a_op.astype(np.float64), b_op) + beta * c
    threads = numba.get_num_threads()
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    try:
        lib.sgemm_each(a_op, b_op, c, beta, threads=2)
    finally:
        numba.set_num_threads(threads)
    np.testing.assert_allclose(c, want, rtol=1e-4, atol=1e-4)
    gaps = np.ones(c_flat.size, bool)
    for i in range(count):
        gaps[i * 500:i * 500 + m * n] = False
    np.testing.assert_array_equal(c_flat[gaps], before[gaps])
    looped = before.copy()
    c2 = np.lib.stride_tricks.as_strided(looped, c.shape, c.strides)
    monkeypatch.setattr(lib, "runs_each", False)
    lib.sgemm_each(a_op, b_op, c2, beta, threads=2)
    np.testing.assert_allclose(c2, want, rtol=1e-4, atol=1e-4)


def test_sgemm_each_names_a_batch_that_does_not_match_and_a_failing_gemm(lib, monkeypatch):
    a = np.zeros((3, 4, 5), np.float32)
    with pytest.raises(ValueError, match=r"sgemm_each: a, b and c must be 3-D views of one count of matrices, "
                                         r"got shapes \(3, 4, 5\), \(2, 5, 2\), \(3, 4, 2\)"):
        lib.sgemm_each(a, np.zeros((2, 5, 2), np.float32), np.zeros((3, 4, 2), np.float32))
    with pytest.raises(ValueError, match=r"sgemm_each shapes do not chain: a \(4, 5\) @ b \(4, 2\)"):
        lib.sgemm_each(a, np.zeros((3, 4, 2), np.float32), np.zeros((3, 4, 2), np.float32))
    with pytest.raises(ValueError, match=r"sgemm_each: a, b and c must be 3-D views .* got shapes None"):
        lib.sgemm_each([[[1.0]]], a, a)
    c = np.ones((3, 2, 2), np.float32)                      # an empty reduction scales every c[i] by beta
    lib.sgemm_each(np.empty((3, 2, 0), np.float32), np.empty((3, 0, 2), np.float32), c, 0.5)
    np.testing.assert_array_equal(c, 0.5)
    if lib.runs_each:
        monkeypatch.setattr(dnnl, "_sgemm_each", lambda *args: 2)        # oneDNN's invalid_arguments
        with pytest.raises(DeviceError, match=r"oneDNN's sgemm failed \(status 2\) in a batch of 3 a \(4, 5\) @ b \(5, 2\)"):
            lib.sgemm_each(a, np.zeros((3, 5, 2), np.float32), np.zeros((3, 4, 2), np.float32))


def test_bad_operands_are_named(lib):
    a = np.zeros((3, 4), np.float32)
    with pytest.raises(ValueError, match=r"sgemm shapes do not chain: a \(3, 4\) @ b \(3, 4\) into c \(3, 4\)"):
        lib.sgemm(a, a, np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError, match="gemm_bf16: a must be a 2-D uint16 view, got float32"):
        lib.gemm_bf16(a, np.zeros((4, 2), np.uint16), np.zeros((3, 2), np.float32))
    if lib.bf16_error:          # good operands on a CPU without the bf16 GEMM: the CPU is named
        with pytest.raises(DeviceError, match="no bf16 GEMM for this CPU"):
            lib.gemm_bf16(np.zeros((3, 4), np.uint16), np.zeros((4, 2), np.uint16), np.zeros((3, 2), np.float32))
    with pytest.raises(ValueError, match="sgemm: c must be a writeable row-contiguous view"):
        lib.sgemm(a, np.zeros((4, 2), np.float32), np.zeros((2, 3), np.float32).T)
    with pytest.raises(ValueError, match=r"a with strides \(64, 8\) is neither row- nor column-contiguous"):
        lib.sgemm(np.zeros((6, 8), np.float32)[::2, ::2], np.zeros((4, 4), np.float32), np.zeros((3, 4), np.float32))


def test_empty_reduction_scales_by_beta(lib):
    c = np.ones((3, 2), np.float32)
    lib.sgemm(np.empty((3, 0), np.float32), np.empty((0, 2), np.float32), c, 0.5)
    np.testing.assert_array_equal(c, 0.5)


def test_it_says_what_it_is(lib):
    assert lib.describe().startswith(f"oneDNN {lib.version} (")


# CPU time per thread (/proc/self/task), not wall time, so a busy machine cannot make these pass or fail
_TICKS = """
import os, threading, numba, numpy as np
from hetconv.devices import dnnl
lib = dnnl.load()
def ticks():
    out = {}
    for t in os.listdir("/proc/self/task"):
        try:
            out[int(t)] = sum(map(int, open(f"/proc/self/task/{t}/stat").read().rsplit(")", 1)[1].split()[11:13]))
        except OSError:
            pass
    return out
"""
needs_two_cores = pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2
                                     or not os.path.isdir("/proc/self/task"), reason="needs two cores and Linux's /proc")


def _probe(script):
    """stdout of `script` run after _TICKS in a fresh process (its OpenMP threads sleeping, as
    hetconv's do), where oneDNN is the OpenMP build whose thread counts these probes read."""
    if dnnl.load().runtime != "OpenMP":
        pytest.skip(f"a {dnnl.load().runtime} build follows the process's CPU affinity instead")
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONPATH=REPO)
    r = subprocess.run([sys.executable, "-c", _TICKS + script], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout


@needs_dnnl
@needs_two_cores
def test_a_gemm_runs_on_as_many_threads_as_the_caller_says():
    """One thread: the caller's thread does all the work; two: another thread shares it."""
    out = _probe("""
a = np.ones((768, 768), np.float32); c = np.empty_like(a)
for threads in (1, 2):
    lib.sgemm(a, a, c, threads=threads)
    before = ticks()
    for _ in range(25):
        lib.sgemm(a, a, c, threads=threads)
    spent = {t: v - before.get(t, 0) for t, v in ticks().items()}
    mine = spent.pop(threading.get_native_id())
    print(threads, mine, max(spent.values(), default=0))
""")
    (one, one_mine, one_other), (two, two_mine, two_other) = [map(int, line.split()) for line in out.split("\n")[:2]]
    assert one_other <= max(2, one_mine // 10), out
    assert two_other >= two_mine // 3, out


@needs_dnnl
@needs_two_cores
def test_sgemm_each_on_two_threads_runs_on_two_threads_not_a_team_inside_each():
    """Each GEMM inside sgemm_each's parallel region runs on its calling thread: two threads do
    the work, not two plus a team of oneDNN's own inside each."""
    out = _probe("""
numba.set_num_threads(2)
a = np.random.default_rng(0).standard_normal((36, 256, 256)).astype(np.float32); c = np.empty_like(a)
lib.sgemm_each(a, a, c, threads=2)
before = ticks()
for _ in range(30):
    lib.sgemm_each(a, a, c, threads=2)
print(*sorted((v - before.get(t, 0) for t, v in ticks().items()), reverse=True))
""")
    spent = [int(v) for v in out.split()]
    assert spent[1] >= spent[0] // 3, out                   # a second thread shares the work
    assert sum(spent[2:]) <= max(2, sum(spent) // 10), out   # and no third one does


# ---- a missing or broken library ------------------------------------------------------------------
def test_a_missing_library_is_one_line_saying_how_to_install_it(monkeypatch):
    monkeypatch.delenv(dnnl.LIBRARY_ENV, raising=False)
    monkeypatch.setattr(dnnl, "_candidates", lambda: [])
    monkeypatch.setattr(dnnl, "_loaded", {})
    with pytest.raises(DeviceError) as e:
        dnnl.load()
    assert str(e.value).startswith("oneDNN is not installed (no libdnnl.so.3 in ")
    assert str(e.value).endswith("pip install 'hetconv[onednn]' (in a checkout: pip install -e '.[onednn]')")
    assert "\n" not in str(e.value)
    assert not dnnl.available() and dnnl.unavailable_reason() == str(e.value)


def test_a_named_library_that_is_not_there_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv(dnnl.LIBRARY_ENV, str(tmp_path / "libdnnl.so.3"))
    monkeypatch.setattr(dnnl, "_loaded", {})
    with pytest.raises(DeviceError, match=f"^{dnnl.LIBRARY_ENV}={tmp_path}/libdnnl.so.3 cannot be used: "):
        dnnl.load()


def test_a_library_that_is_not_onednn_is_refused(monkeypatch):
    """A loadable library without the GEMM API (here: the C library) is named, not called."""
    monkeypatch.setenv(dnnl.LIBRARY_ENV, "libc.so.6")
    monkeypatch.setattr(dnnl, "_loaded", {})
    with pytest.raises(DeviceError, match="^HETCONV_DNNL_LIBRARY=libc.so.6 cannot be used: libc.so.6: not a oneDNN 3 "
                                          "library"):
        dnnl.load()
