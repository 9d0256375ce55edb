"""oneDNN's GEMMs for the CPU device: fp32 (dnnl_sgemm) and bf16 operands with fp32 accumulation
(dnnl_gemm_bf16bf16f32), through ctypes; and the fp32 -> bf16 rounding, in Numba.

Why: on an AMD EPYC Zen 5 core (AVX-512 with AVX512_BF16, no AMX), a conv2-shaped GEMM (M=1500,
K=12500, N=3200, one thread) ran ~250 GFLOP/s in OpenBLAS's AVX-512 kernel and in oneDNN's sgemm
alike, ~500 in oneDNN's bf16 GEMM; and ~125 in OpenBLAS where the environment forces its Haswell
kernel (OPENBLAS_CORETYPE, as on that host), which oneDNN's sgemm does not depend on
(bench/results/precision/, "The GEMM alone"). PyTorch's own oneDNN is linked in privately, so
the library comes from the `onednn` extra: the `onednn-cpu-gomp` wheel, 39 MB with no further
packages, whose libdnnl.so.3 lands in the environment's lib/ and uses the system's GNU OpenMP,
the very runtime Numba's threads run on (one pool of threads in the process, no second runtime
spinning on the same cores). The TBB-threaded `onednn` wheel works too where its libraries load
(it needs Intel's SYCL and compiler runtimes, ~2 GB): name it with HETCONV_DNNL_LIBRARY, its lib/
on LD_LIBRARY_PATH. Its convolutions (dnnl_conv) run on a SYCL CPU device: Intel's OpenCL CPU
runtime (OCL_ICD_FILENAMES=.../lib/libintelocl.so) and the Unified Runtime's OpenCL adapter, which
the 2026 runtime wheels leave out (2025.3's ship it); without them the direct paths decline and
its GEMMs still run (bench/results/onednn/).

Threads: the GNU OpenMP build runs a GEMM on omp_get_max_threads() threads, an OpenMP setting
of the calling thread (a worker computes on a thread of its own), so every call here sets it to
the caller's `threads` first (one ctypes call, ~1 us); tests/test_dnnl.py checks by the CPU time
of each thread that one thread means one. The `onednn` wheel (oneDNN 3.13, SYCL runtime over
TBB) follows the process's CPU affinity instead, and no C call caps it: measured the same way,
a process on 2 cores ran its GEMMs on 2 threads when asked for 1, and on 1 once pinned to one
core, which is what a pinned worker gives it; its convolutions likewise, on TBB's threads while
the calling thread waits.

bf16 travels as np.uint16 holding the upper half of a float32 (numpy has no bfloat16 dtype).
Rounding is to nearest, ties to even, as PyTorch's (NaN becomes 0x7FC0); widening is exact.
"""
import ctypes
import ctypes.util
import os
import site
import sys

import numpy as np
from numba import prange

from hetconv.devices.base import DeviceError
from hetconv.devices.blas import gemm_operands
from hetconv.jit import cached_njit

LIBRARY_ENV = "HETCONV_DNNL_LIBRARY"
INSTALL = "pip install 'hetconv[onednn]' (in a checkout: pip install -e '.[onednn]')"
_SONAME = "libdnnl.so.3"
_RUNTIMES = {1: "sequential", 2: "OpenMP", 4: "TBB", 8: "threadpool", 0x200: "SYCL"}
# dnnl_get_effective_cpu_isa's values that are the same in every oneDNN 3.x; others print in hex
_ISAS = {0x7: "avx2", 0x27: "avx512_core", 0x67: "avx512_core_vnni", 0xe7: "avx512_core_bf16"}
_SUCCESS = 0

_jit = cached_njit(parallel=True, nogil=True)
# sgemm_each's tasks per thread at least, where a batch has fewer matrices than that (each
# matrix's columns then cut into blocks): 36 Winograd GEMMs on 16 threads would leave 12 of 16
# threads idle for the third round of 3 against 2.25; with two column blocks, 72 tasks, 5 against 4.5
TASKS_PER_THREAD = 4


@_jit
def _sgemm_each(sgemm, transa, transb, m, n, k, a, a_step, lda, b, b_step, ldb, beta, c, c_step, ldc, count, blocks):
    """Dnnl.sgemm_each's loop: matrix i's GEMM (a, b, c: addresses of matrix 0; steps in floats
    between matrices), its columns in `blocks` blocks, one task each. -> a failing status or 0."""
    step = (n + blocks - 1) // blocks
    status = np.zeros(count * blocks, np.int32)
    for task in prange(count * blocks):
        i = task // blocks
        j0 = (task % blocks) * step
        j1 = min(n, j0 + step)
        if j1 > j0:
            b_at = i * b_step + (j0 * ldb if transb == 84 else j0)
            status[task] = sgemm(transa, transb, m, j1 - j0, k, np.float32(1.0), a + 4 * i * a_step, lda,
                                 b + 4 * b_at, ldb, beta, c + 4 * (i * c_step + j0), ldc)
    return status.max()


# ---- bf16 -----------------------------------------------------------------------------------------
@cached_njit(inline="always", nogil=True)
def _bf16_of_bits(u):
    """The bf16 nearest the float32 whose bits are u (a uint32), ties to even; NaN -> 0x7FC0."""
    v = np.int64(u)
    if (v & 0x7FFFFFFF) > 0x7F800000:
        return np.uint16(0x7FC0)
    return np.uint16((v + 0x7FFF + ((v >> 16) & 1)) >> 16)


@_jit
def _round_flat(bits, out):
    for i in prange(bits.shape[0]):
        out[i] = _bf16_of_bits(bits[i])


@_jit
def _round_rows(bits, out):
    """For 2-D views whose rows are contiguous (a window of a wider buffer)."""
    for r in prange(bits.shape[0]):
        for c in range(bits.shape[1]):
            out[r, c] = _bf16_of_bits(bits[r, c])


def to_bf16(a, out=None):
    """float32 array -> its bf16 bits (np.uint16, same shape), in `out` where given. A 2-D view
    whose rows are contiguous is taken as it is (no copy)."""
    if not isinstance(a, np.ndarray) or a.dtype != np.float32:
        raise TypeError(f"to_bf16 takes a float32 numpy array, got {getattr(a, 'dtype', type(a).__name__)}")
    if out is None:
        out = np.empty(a.shape, np.uint16)
    elif not (isinstance(out, np.ndarray) and out.dtype == np.uint16 and out.shape == a.shape):
        raise ValueError(f"out must be a uint16 array of shape {a.shape!r}, got "
                         f"{getattr(out, 'dtype', type(out).__name__)} {getattr(out, 'shape', None)!r}")
    if a.flags.c_contiguous and out.flags.c_contiguous:
        _round_flat(a.reshape(-1).view(np.uint32), out.reshape(-1))
    elif a.ndim == 2 and a.strides[1] == 4 and out.strides[1] == 2:
        _round_rows(a.view(np.uint32), out)
    else:
        out[...] = to_bf16(np.ascontiguousarray(a))
    return out


def from_bf16(bits):
    """bf16 bits (np.uint16) -> float32, exactly."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def _widened(bits):
    """A 2-D bf16 operand (row-major, or a transposed view of a row-major block) as a compact
    float32 array in the same orientation, which sgemm then reads the same way."""
    order = "F" if bits.strides[0] == bits.itemsize and bits.shape[0] > 1 else "C"
    wide = np.asarray(bits).astype(np.uint32, order=order)
    wide <<= 16
    return wide.view(np.float32)


def round_to_bf16(a):
    """float32 -> float32 holding the nearest bf16 (what a bf16 GEMM's operands are)."""
    return from_bf16(to_bf16(np.ascontiguousarray(a, np.float32)))


# ---- the library ----------------------------------------------------------------------------------
class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int),
                ("hash", ctypes.c_char_p), ("cpu_runtime", ctypes.c_uint), ("gpu_runtime", ctypes.c_uint)]


def _candidates():
    """Where libdnnl.so.3 may be: the user's choice, then where a wheel's data files land (this
    environment's lib/, the user site's), then the system's library path."""
    named = os.environ.get(LIBRARY_ENV)
    if named:
        return [named]
    roots = [sys.prefix, getattr(site, "USER_BASE", None) or ""]
    found = [os.path.join(root, "lib", _SONAME) for root in roots if root]
    system = ctypes.util.find_library("dnnl")
    return [p for p in found if os.path.exists(p)] + ([system] if system else [])


class Dnnl:
    """The loaded library: `sgemm` and `gemm_bf16` on numpy views, and what it is (`describe`)."""

    def __init__(self, path):
        self.path = path
        self.cdll = lib = ctypes.CDLL(path)
        dim, flt, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
        args = [ctypes.c_char, ctypes.c_char, dim, dim, dim, flt, ptr, dim, ptr, dim, flt, ptr, dim]
        self._sgemm, self._bf16 = lib.dnnl_sgemm, lib.dnnl_gemm_bf16bf16f32
        for f in (self._sgemm, self._bf16):
            f.argtypes, f.restype = args, ctypes.c_int
        # dnnl_sgemm again, as a pointer _sgemm_each calls from its Numba loop: chars as int8 and
        # pointers as int64 (the same registers on x86-64), since Numba passes neither as such
        i64 = ctypes.c_int64
        each = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int8, ctypes.c_int8, i64, i64, i64, flt, i64, i64, i64, i64,
                                flt, i64, i64)
        self._sgemm_pointer = each(ctypes.cast(lib.dnnl_sgemm, ctypes.c_void_p).value)
        lib.dnnl_version.restype = ctypes.POINTER(_Version)
        v = lib.dnnl_version().contents
        self.version = f"{v.major}.{v.minor}.{v.patch}"
        self.runtime = _RUNTIMES.get(v.cpu_runtime, f"runtime {v.cpu_runtime:#x}")
        lib.dnnl_get_effective_cpu_isa.restype = ctypes.c_uint
        isa = lib.dnnl_get_effective_cpu_isa()
        self.isa = _ISAS.get(isa, f"isa {isa:#x}")
        self._set_threads = None
        if self.runtime == "OpenMP":
            # looked up through libdnnl's handle: the OpenMP runtime it was linked against (GNU's
            # for the extra's wheel, Intel's for an iomp build), not whichever one the name finds
            self._set_threads = lib.omp_set_num_threads
            self._set_threads.argtypes, self._set_threads.restype = [ctypes.c_int], None
        self.bf16_error = ""            # why the bf16 GEMM cannot be used here, where it cannot
        # sgemm_each's one parallel region: only where a GEMM inside a region of Numba's OpenMP
        # threads runs on its calling thread (the OpenMP build); the TBB build's threads follow the
        # process's affinity wherever it is called from
        self.runs_each = self.runtime == "OpenMP"

    def describe(self):
        return f"oneDNN {self.version} ({self.runtime}, {self.isa})"

    def set_threads(self, threads):
        """The OpenMP build's thread count for what the calling thread runs next."""
        if self._set_threads is not None:
            self._set_threads(int(threads))

    def _call(self, name, function, a, b, c, beta, threads, dtype):
        call = gemm_operands(name, a, b, c, beta, dtype)
        if call is None:
            return c
        m, n, k, (a_t, lda), (b_t, ldb), ldc = call
        self.set_threads(threads)
        status = function(b"T" if a_t else b"N", b"T" if b_t else b"N", m, n, k, 1.0, a.ctypes.data, lda,
                          b.ctypes.data, ldb, float(beta), c.ctypes.data, ldc)
        if status != _SUCCESS:
            raise DeviceError(f"oneDNN's {name} failed (status {status}) on a {a.shape!r} @ b {b.shape!r}")
        return c

    def sgemm(self, a, b, c, beta=0.0, threads=1):
        """c = a @ b + beta * c in float32; a and b row-major or transposed views of row-major
        blocks, c row-contiguous. Releases the GIL (ctypes does) while it runs."""
        return self._call("sgemm", self._sgemm, a, b, c, beta, threads, np.float32)

    def sgemm_each(self, a, b, c, beta=0.0, threads=1):
        """c[i] = a[i] @ b[i] + beta * c[i] for every i of 3-D float32 views whose matrices each
        sgemm takes (a and b row-major or transposed, c row-contiguous), the matrices a fixed
        stride apart: the whole batch in ONE parallel region, each GEMM on one thread (oneDNN runs
        a GEMM called inside an OpenMP parallel region on the calling thread alone). Called one by
        one on `threads` threads, every GEMM is a region of its own that wakes the sleeping
        threads (OMP_WAIT_POLICY=PASSIVE, devices/cpu.py) and joins them again: on 2 Zen 3 cores,
        36 GEMMs of (64, 64) @ (64, 512) took 5.7-6.9 ms one by one against 1.2-1.6 ms here and
        2.4 ms on one thread. Needs the OpenMP build (`runs_each`); a batch of fewer matrices than
        threads has each matrix's columns cut into blocks as well."""
        if not (getattr(a, "ndim", 0) == getattr(b, "ndim", 0) == getattr(c, "ndim", 0) == 3
                and len(a) == len(b) == len(c)):
            raise ValueError(f"sgemm_each: a, b and c must be 3-D views of one count of matrices, got shapes "
                             f"{getattr(a, 'shape', None)!r}, {getattr(b, 'shape', None)!r}, {getattr(c, 'shape', None)!r}")
        count = len(c)
        if not self.runs_each:
            for i in range(count):
                self.sgemm(a[i], b[i], c[i], beta, threads)
            return c
        if count == 0:
            return c
        call = gemm_operands("sgemm_each", a[0], b[0], c[0], beta, np.float32)
        if call is None:            # nothing to multiply: with k = 0, each c[i] is scaled by beta
            for i in range(1, count):
                gemm_operands("sgemm_each", a[i], b[i], c[i], beta, np.float32)
            return c
        m, n, k, (a_t, lda), (b_t, ldb), ldc = call
        size = a.itemsize
        blocks = max(1, min(n, -(-TASKS_PER_THREAD * int(threads) // count)))
        status = _sgemm_each(self._sgemm_pointer, ord("T") if a_t else ord("N"), ord("T") if b_t else ord("N"),
                             m, n, k, a.ctypes.data, a.strides[0] // size, lda, b.ctypes.data, b.strides[0] // size,
                             ldb, np.float32(beta), c.ctypes.data, c.strides[0] // size, ldc, count, blocks)
        if status != _SUCCESS:
            raise DeviceError(f"oneDNN's sgemm failed (status {status}) in a batch of {count} a {a.shape[1:]!r} "
                              f"@ b {b.shape[1:]!r}")
        return c

    def gemm_bf16(self, a, b, c, beta=0.0, threads=1):
        """c = a @ b + beta * c, a and b bf16 bits (np.uint16) as sgemm takes them, products
        summed in float32 into c: the CPU's bf16 instructions (DeviceError where it has none,
        `bf16_error`; emulated_gemm_bf16 computes the same there)."""
        if self.bf16_error:
            gemm_operands("gemm_bf16", a, b, c, beta, np.uint16)   # a bad operand is named first
            raise DeviceError(self.bf16_error)
        return self._call("gemm_bf16", self._bf16, a, b, c, beta, threads, np.uint16)

    def emulated_gemm_bf16(self, a, b, c, beta=0.0, threads=1):
        """What gemm_bf16 computes, on any CPU: the bf16 operands widened to float32 (exactly: a
        bf16 is the upper half of a float32) and multiplied by sgemm. Every product of two bf16 is
        exact in float32 (8-bit significands), and the sums are float32 as the hardware path's
        are; only their order is sgemm's, not the bf16 kernel's, so the two agree to the float32
        rounding of the sums (tests/test_dnnl.py states the tolerance), not bit for bit. The
        same operands and threads give the same bits every run. For correctness where the CPU has
        no bf16 GEMM (the bf16 lines tested on every CPU), not speed: each operand is widened into
        a float32 copy first, and the product runs at sgemm's speed; `--precision auto` never
        times or takes it (CpuDevice)."""
        if gemm_operands("gemm_bf16", a, b, c, beta, np.uint16) is None:
            return c
        return self.sgemm(_widened(a), _widened(b), c, beta, threads)


def _self_check(lib):
    """A small product of every operand layout against numpy: '' if the fp32 GEMM is right, else
    what went wrong; sets lib.bf16_error where the bf16 GEMM is missing or wrong on this CPU."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((7, 9)).astype(np.float32)
    b = rng.standard_normal((9, 5)).astype(np.float32)
    c0 = rng.standard_normal((7, 5)).astype(np.float32)
    a16, b16 = round_to_bf16(a), round_to_bf16(b)
    for a_view, b_view, transposed in ((a, b, False), (np.ascontiguousarray(a.T).T, np.ascontiguousarray(b.T).T, True)):
        for beta in (0.0, 1.0):
            c = c0.copy()
            lib.sgemm(a_view, b_view, c, beta)
            if not np.allclose(c, a.astype(np.float64) @ b + beta * c0, rtol=1e-5, atol=1e-5):
                return f"its sgemm disagrees with numpy (transposed operands: {transposed}, beta {beta})"
            c = c0.copy()
            try:
                lib.gemm_bf16(to_bf16(a_view), to_bf16(b_view), c, beta)
            except DeviceError as e:
                lib.bf16_error = f"oneDNN {lib.version} at {lib.path} has no bf16 GEMM for this CPU ({e})"
                return ""
            if not np.allclose(c, a16.astype(np.float64) @ b16 + beta * c0, rtol=1e-5, atol=1e-5):
                lib.bf16_error = (f"oneDNN {lib.version} at {lib.path}: its bf16 GEMM disagrees with numpy on "
                                  f"bf16 operands (transposed: {transposed}, beta {beta})")
                return ""
    return ""


_loaded = {}       # HETCONV_DNNL_LIBRARY's value -> the library, or why it cannot be had


def load():
    """The oneDNN library (loaded and checked once per process), or DeviceError in one line
    saying what is missing and how to install it."""
    key = os.environ.get(LIBRARY_ENV, "")
    if key not in _loaded:
        _loaded[key] = _find()
    if isinstance(_loaded[key], str):
        raise DeviceError(_loaded[key])
    return _loaded[key]


def _find():
    problems = []
    for path in _candidates():
        try:
            lib = Dnnl(path)
        except OSError as e:
            problems.append(f"{path}: {e}")
            continue
        except AttributeError as e:           # a libdnnl without the GEMM API
            problems.append(f"{path}: not a oneDNN 3 library ({e})")
            continue
        wrong = _self_check(lib)
        if wrong:
            problems.append(f"{path}: {wrong}")
            continue
        return lib
    if os.environ.get(LIBRARY_ENV):
        return f"{LIBRARY_ENV}={os.environ[LIBRARY_ENV]} cannot be used: {'; '.join(problems)}"
    if problems:
        return f"oneDNN was found but cannot be used ({'; '.join(problems)}): {INSTALL}"
    return f"oneDNN is not installed (no {_SONAME} in {os.path.join(sys.prefix, 'lib')}): {INSTALL}"


def available():
    """Whether load() succeeds, without raising."""
    try:
        load()
        return True
    except DeviceError:
        return False


def unavailable_reason():
    """'' where oneDNN loads, else the one line load() raises."""
    try:
        load()
        return ""
    except DeviceError as e:
        return str(e)
