"""`--device cpu`: OpenBLAS sgemm on views of the input, with the data-movement kernels in Numba.

Design, and what it costs:
- Paths (CONV_PATHS; four need no oneDNN: im2col, shifted GEMMs, FFT in cpu_fft.py, Winograd F(4x4, 3x3) for dense
  3x3 stride-1 convs in devices/cpu_winograd.py), chosen per layer and share
  (`conv_path="auto"`) by devices/cpu_path_choice.py: timed on the first call with a shape big
  enough to matter, by a rule below that; the choice kept per machine and per run (the wisdom, a
  run's record). `conv_path` forces one.
- Where oneDNN is installed (the `onednn` extra, devices/dnnl.py), more paths run its GEMMs
  (devices/cpu_gemms.py, devices/cpu_shifted_gemms.py): "im2col-dnnl" and "shifted-dnnl",
  oneDNN's sgemm on either layout, more candidates the timing chooses among (OpenBLAS's speed
  where it runs its AVX-512 kernel, 2x where the environment holds it to its Haswell one); and
  "im2col-bf16" and "shifted-bf16", bf16 operands with float32 sums, which `precision="bf16"`
  times against each other (stride-1 calls big enough to time; im2col-bf16 elsewhere) and
  `precision="auto"` times as more candidates (see PRECISIONS). Untimed calls keep the rule's
  layout, on oneDNN's sgemm where it is installed (see cpu_path_choice.DNNL_PATHS). A device of
  two or more threads choosing its own paths with oneDNN installed times no OpenBLAS direct path
  at all (see cpu_path_choice.OPENBLAS_PATHS): their spinning threads slow the layers after them.
  "im2col-dnnl" can be forced (`conv_path`); the others are reached by timing only.
- A depthwise conv (groups == input channels, devices/cpu_depthwise.py) has its own paths,
  "depthwise" and under `precision="bf16"` "depthwise-bf16": Numba kernels over (image, channel)
  planes, no GEMM. The rule gives them such a conv; the timing takes them among the grouped
  conv's candidates. `conv_path="depthwise"` forces it (other convs then run im2col).
- im2col and shifted (devices/cpu_gemm_paths.py): the conv as GEMMs on an expansion of the input,
  kh*kw copies of it (im2col) or kw (shifted).
- The GEMMs are the whole arithmetic cost and run in BLAS; everything else is memory-bound and
  runs in Numba `parallel=True` kernels that also absorb the layout changes.
- The batch is cut into chunks so cols (or the expansion) stays under `im2col_budget_bytes`
  (default 64 MB): the paper's conv2 at batch 128 would otherwise need a 640 MB im2col.
- The fused forward (conv + bias + ReLU + 2x2 max-pool) keeps only the layer input and an int8
  argmax per pooled value for backward (-1 where the ReLU is off): 1 byte per pooled output
  instead of the 16 bytes of the pre-pool activation.
- Any other conv block (stride, activation, pool: devices/base.py's ConvBlock) runs the same conv
  paths (the shifted one at stride 1 only; im2col takes any stride), then one Numba pass per chunk
  applies bias, activation and pool on (image, kernel) planes viewed in place in the chunk's Y,
  keeping an int32 argmax per pooled value (max-pool) or a byte per conv output where ReLU passes
  (other pools). The paper's block keeps its own fused kernels above.
- What costs the same whatever K is keeps a worker holding a quarter of the kernels from taking
  a quarter of the time: im2col and col2im (~50 ms each on conv2 at N=32, one thread), or on the
  shifted path the expansion and the width fold (~10-12 ms each), plus BLAS packing the input
  side inside every GEMM on either path. The shifted path's sums of GEMMs accumulate inside sgemm
  (beta = 1, devices/blas.py) rather than through temporaries, which cost ~18 ms more at any K. So the fused forward keeps its
  im2col / expansion for backward when the whole batch's fits `saved_cols_budget_bytes`
  (default 256 MB; conv2 at batch 32: 160 MB of im2col, 45 MB of expansion) instead of
  recomputing it. The buffer comes back to a pool after backward, so steady state pays no
  allocation or page faults; a forward whose backward never runs leaves its buffer to the
  garbage collector. Over the budget, backward recomputes it per chunk.
- Work buffers (im2col, Y/dY, partial products) are kept between calls; what is returned is
  always freshly allocated, because a returned array may still be in flight on the wire.
- `threads` caps both Numba's and BLAS's threads (BLAS at one where oneDNN runs the direct
  GEMMs, see cpu_path_choice.OPENBLAS_PATHS), so that several workers on one host can be given
  disjoint cores.
- Kernels release the GIL (nogil) so a worker's heartbeat thread keeps running during compute.
"""
import os

import numba
import numpy as np
from numba import prange
from threadpoolctl import ThreadpoolController, threadpool_info, threadpool_limits

from hetconv import runtimes
from hetconv.devices import activation_math as am
from hetconv.devices import cpu_channels_last, cpu_channelwise, dnnl
from hetconv.channelwise import Activation, Pool
from hetconv.devices.base import Device, DeviceError, as_channels_last, empty_channels_last, in_layout_of, is_channels_last
from hetconv.devices.blas import accumulating_sgemm
from hetconv.devices.cpu_depthwise import DepthwiseConvs
from hetconv.devices.cpu_fft import FftConv, swap_leading
from hetconv.devices.cpu_gemm_paths import GemmPaths, _conv_hw, _nchw_to_rows, _rows_to_nchw
from hetconv.devices.cpu_gemms import BlasGemms, Bf16Gemms, DnnlGemms
from hetconv.devices.cpu_path_choice import AUTO_TIMED_MIN_FLOPS, ConvPathChoice, _time_one_run
from hetconv.devices.cpu_shifted_gemms import ShiftedBf16Gemms, ShiftedBlasGemms, ShiftedDnnlGemms
from hetconv.devices.cpu_tails import (
    _BlockContext, _PoolGeometry, _act_backward_planes, _act_pool, _act_pool_backward, _add_row_sums,
    _bias_act_max2_planes, _bias_act_planes, _bias_grad, _channel_totals, _flat_planes, _is_max2, _plane_totals,
    _unpool_planes)
from hetconv.devices.cpu_winograd import WinogradConvs
from hetconv.devices.cpu_updates import _adamw_update, _scale_flat, _sgd_update, _square_sums_flat
from hetconv.devices.dnnl_conv import DirectConvs
from hetconv.jit import cached_njit
from hetconv.params import numpy_gemm

# Numba's OpenMP threads spin-wait after each parallel region (GNU libgomp's default), on the very
# cores the BLAS threads need next. On 2 cores a 2-thread device ran vgg-small's last layer 3.4x
# slower for it (shifted path 39.9 ms against 11.6 ms with the threads put to sleep at once) and
# the paper's conv1 1.5x slower (im2col 102 ms against 68); conv2's big GEMMs are unchanged (they
# wait for no one). Read once, when Numba first starts its threads, so it is set here, at import;
# a user's own OMP_WAIT_POLICY is left alone. PyTorch imported later in the same process reads it
# too (the benchmarks say so in their headers). What sleeping costs: every parallel region (a Numba
# pass, a oneDNN GEMM) wakes the other threads, 10-45 us a region on this project's 2-core VM
# against ~1.4 us with them spinning, and a vgg-small step at batch 32 runs ~130 regions. Spinning
# threads (GOMP_SPINCOUNT, which overrides PASSIVE's zero) took that step from 0.042 s to 0.036 s
# on a quiet host (bench/results/precision/targets/vgg_small.md), and made it 1.5-2x slower in
# three rounds beside 1-1.5 cores of other tenants' work (targets/vgg_small_loaded.md): a spinning
# thread holds a core its peer or a neighbour needs. So sleeping stays the default, and a user
# with cores of their own may set GOMP_SPINCOUNT.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

DEFAULT_IM2COL_BUDGET_BYTES = 64 << 20
DEFAULT_SAVED_COLS_BUDGET_BYTES = 256 << 20
# The FFT path (devices/cpu_fft.py) caches each weight array's kernel spectra, 12x the weights'
# bytes for 5x5 kernels on 14x14 inputs (the whole conv2: 900 MB + a 75 MB copy of the weights);
# a layer whose spectra would not fit this budget runs the direct path instead.
DEFAULT_FFT_BUDGET_BYTES = 1 << 30
CONV_PATHS = ("auto", "im2col", "shifted", "fft", "im2col-dnnl", "direct-dnnl", "depthwise", "winograd")
# A CPU device's GEMM precision (`--precision`): "fp32"; "bf16", every conv on a bf16 path
# (bf16 operands, float32 sums, everything else float32): im2col-bf16 (devices/cpu_gemms.py), or
# at stride 1 shifted-bf16 (devices/cpu_shifted_gemms.py) where the timing finds it faster;
# "auto", the bf16 paths as more candidates of the timed choice (devices/cpu_path_choice.py),
# taken where one runs faster than the fastest float32 path by AUTO_BF16_MARGIN (the accuracy it
# gives up buys a real gain, not a timing's noise), and float32 wherever a call is too small to
# be timed.
PRECISIONS = ("fp32", "bf16", "auto")

_jit = cached_njit(parallel=True, nogil=True)


@_jit
def _add_into(dst, src):
    """dst += src for 2-D arrays, parallel over rows (numpy's add runs on one thread)."""
    for r in prange(dst.shape[0]):
        for c in range(dst.shape[1]):
            dst[r, c] += src[r, c]


class _FftBlockContext(_BlockContext):
    """What a block's backward needs on the FFT path: as _BlockContext, with the forward's kernel
    spectra (a view of the cache's buffer: reused by backward when given the same weights) and,
    when they fit the saved-cols budget, the input's spectra (flat; None otherwise)."""

    def __init__(self, x, w, block, conv_hw, pool, argmax, mask, pooled_shape, spectra, x_spectra=None):
        super().__init__(x, w, block, conv_hw, pool, argmax, mask, pooled_shape)
        self.spectra = spectra
        self.x_spectra = x_spectra


class _DirectBlockContext(_BlockContext):
    """What a block's backward needs on a direct (oneDNN convolution) path: as _BlockContext, with
    the input in the forward primitive's layout where it fit the saved-cols budget (`saved`, a
    flat float32 buffer of that pool; `saved_src`, its bytes oneDNN's layout takes; both None
    otherwise)."""

    def __init__(self, x, w, block, conv_hw, pool, argmax, mask, pooled_shape, convs, saved, saved_src):
        super().__init__(x, w, block, conv_hw, pool, argmax, mask, pooled_shape)
        self.convs, self.saved, self.saved_src = convs, saved, saved_src


_F0 = np.float32(0)


class _ChannelKernels:
    """The activation, pool and BatchNorm kernels of the CPU device, which the coordinator's host
    arrays use too (a graph's nodes between blocks): on NCHW maps (cpu_channelwise.py) or on
    channels-last ones (cpu_channels_last.py), in the layout the map is in; a second operand is
    read in the first one's layout. BatchNorm with the activation after it runs fused."""

    channels_last = True

    def _activation(self, x, act):
        return cpu_channelwise.activation(x, act)

    def _activation_backward(self, act, saved, dy):
        return cpu_channelwise.activation_backward(act, saved, dy)

    def _pool(self, x, pool, out_shape):
        """(y, (argmax, whether the maps are channels-last)): an average pool keeps no argmax, so
        the layout its backward writes in is kept apart."""
        if is_channels_last(x):
            y, argmax = cpu_channels_last.pool(x, pool, out_shape)
            return y, (argmax, True)
        y, argmax = cpu_channelwise.pool(x, pool, out_shape)
        return y, (argmax, False)

    def _pool_backward(self, pool, saved, in_shape, dy):
        argmax, channels_last = saved
        if channels_last:
            return cpu_channels_last.pool_backward(pool, argmax, in_shape, as_channels_last(dy))
        return cpu_channelwise.pool_backward(pool, argmax, in_shape, np.ascontiguousarray(dy))

    def _plane_sums(self, a, b, shift):
        if is_channels_last(a):
            return cpu_channels_last.rows_sums(a, in_layout_of(b, a), shift)
        return cpu_channelwise.plane_sums(a, np.ascontiguousarray(b), shift)

    def _normalize(self, x, mean, scale, shift):
        if is_channels_last(x):
            return cpu_channels_last.norm_act(x, mean, scale, shift, am.IDENTITY, _F0, _F0), x
        return cpu_channelwise.normalize(x, mean, scale, shift), x

    def _normalize_act(self, x, mean, scale, shift, act):
        return cpu_channels_last.norm_act(x, mean, scale, shift, *am.code_and_params(act)), x

    def _batchnorm_grad_sums(self, saved, dy, mean):
        return self._plane_sums(in_layout_of(dy, saved), saved, mean)

    def _batchnorm_act_grad_sums(self, saved, dy, mean, scale, shift, act):
        return cpu_channels_last.grad_sums(saved, in_layout_of(dy, saved), mean, scale, shift,
                                           *am.code_and_params(act))

    def _batchnorm_backward(self, saved, dy, mean, mean_dy, k, a):
        if is_channels_last(saved):
            # the identity's gradient reads no BatchNorm output: mean stands in for scale and shift
            return cpu_channels_last.backward(saved, in_layout_of(dy, saved), mean, mean, mean, am.IDENTITY, _F0,
                                              _F0, mean_dy, k, a)
        return cpu_channelwise.batchnorm_backward(saved, np.ascontiguousarray(dy), mean, mean_dy, k, a)

    def _batchnorm_act_backward(self, saved, dy, mean, scale, shift, act, mean_dy, k, a):
        return cpu_channels_last.backward(saved, in_layout_of(dy, saved), mean, scale, shift,
                                          *am.code_and_params(act), mean_dy, k, a)


class CpuDevice(ConvPathChoice, GemmPaths, Device):
    """The device contract (devices/base.py) on the CPU's paths: each conv call goes to the path
    ConvPathChoice (cpu_path_choice.py) chose for its shape, run by GemmPaths (cpu_gemm_paths.py:
    im2col, shifted), FftConv (cpu_fft.py), oneDNN's DirectConvs (dnnl_conv.py) or DepthwiseConvs
    (cpu_depthwise.py); a block's tail on its output (cpu_tails.py); the work buffers they share.
    Channels-last maps pass through (`channels_last`): oneDNN's convolutions make them and every
    per-channel kernel runs on them, so a map stays NHWC from conv to conv where the direct path
    runs; the other paths read NCHW."""

    channels_last = _ChannelKernels.channels_last


    def __init__(self, threads=None, im2col_budget_bytes=DEFAULT_IM2COL_BUDGET_BYTES,
                 saved_cols_budget_bytes=DEFAULT_SAVED_COLS_BUDGET_BYTES, conv_path="auto",
                 fft_budget_bytes=DEFAULT_FFT_BUDGET_BYTES, verbose=False,
                 auto_timed_min_flops=AUTO_TIMED_MIN_FLOPS, auto_timer=_time_one_run, precision="fp32",
                 onednn=None, wisdom=None, retime=False, deterministic=False):
        """`wisdom`: a devices.wisdom.Wisdom whose stored choices this device reuses and where
        it keeps what it times (None: none; the command lines give the machine's file,
        wisdom.machine_wisdom(), so a device made here touches no file unless told). `retime`:
        time every call shape again and store the result over the wisdom's. `threads`: None, every
        core this process may use, or under `deterministic` runtimes.DETERMINISTIC_THREADS (the
        sums split by the count). `deterministic`: choose by a fixed rule, never timing and never reading or writing the wisdom: a depthwise
        conv its depthwise path (depthwise-bf16 under precision bf16); else the untimed rule
        (shifted where C*kw is long enough and the kernels few enough, see
        cpu_path_choice.SHIFTED_MIN_REDUCTION, else im2col): under precision bf16 on bf16
        operands (shifted-bf16, im2col-bf16), else on oneDNN's sgemm (shifted-dnnl, im2col-dnnl)
        where oneDNN is loaded; a forced `conv_path` still rules.
        Slower than the timed choice where another path is faster, and the same bits every
        run. Choices a checkpoint recorded (preload_conv_paths) come before the wisdom and
        timing, after the forced path and `deterministic`."""
        if threads is None:         # under `deterministic` a fixed count, never the affinity mask's
            threads = runtimes.threads_for(0, deterministic)
        if not isinstance(threads, (int, np.integer)) or threads < 1:
            raise DeviceError(f"threads must be a positive integer, got {threads!r}")
        if deterministic and threads > numba.config.NUMBA_NUM_THREADS:
            raise DeviceError(f"threads {threads}: this process runs at most {numba.config.NUMBA_NUM_THREADS} Numba "
                              f"threads (NUMBA_NUM_THREADS), and deterministic cannot run fewer without changing "
                              f"the sums")
        if conv_path not in CONV_PATHS:
            raise DeviceError(f"conv_path must be one of {CONV_PATHS!r}, got {conv_path!r}")
        if precision not in PRECISIONS:
            raise DeviceError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        if precision == "bf16" and conv_path not in ("auto", "direct-dnnl"):
            raise DeviceError(f"precision bf16 runs every conv on a bf16 path: conv path {conv_path!r} "
                              f"cannot be forced with it (direct-dnnl can: oneDNN's convolutions in bf16)")
        try:
            # a step frees and allocates the same large maps: keep their pages rather than fault
            # them in again every step (runtimes.keep_freed_memory says what it costs). Not under
            # `deterministic`: a block from the kept heap sits wherever the run's history of
            # allocations left room, so its alignment varies from run to run, and a GEMM's kernel
            # may follow the alignment; glibc's own mmap'd blocks are all page-aligned.
            self.allocator = (runtimes.system_allocator("--deterministic") if deterministic
                              else runtimes.keep_freed_memory())
        except ValueError as e:
            raise DeviceError(str(e)) from None
        self.conv_path = conv_path
        self.precision = precision
        self.threads = int(min(threads, numba.config.NUMBA_NUM_THREADS))
        numba.set_num_threads(self.threads)
        self.im2col_budget_bytes = int(im2col_budget_bytes)
        self.saved_cols_budget_bytes = int(saved_cols_budget_bytes)
        self.name = "cpu"
        self._scratch_buffers = {}
        self._saved_cols_pool = []      # flat float32 buffers handed back by backward
        # sgemm with beta = 1 for sums of GEMMs; None: numpy's matmul into a temporary plus an add
        self._sgemm = accumulating_sgemm()
        # conv_path="fft": stride-1 layers whose kernel spectra fit fft_budget_bytes; work buffers
        # per block of frequencies under im2col_budget_bytes, as the direct paths' chunks. Its
        # GEMMs run one BLAS thread each, split among our threads by the FFT path itself.
        blas = ThreadpoolController().select(user_api="blas")
        self._fft = FftConv(self._fft_gemm, self._scratch, fft_budget_bytes, self.im2col_budget_bytes,
                            threads=self.threads, one_blas_thread=lambda: blas.limit(limits=1))
        self.verbose = bool(verbose)
        self._start_path_choice(auto_timed_min_flops, auto_timer, wisdom, retime, deterministic)
        self._path_gemms = {"im2col": BlasGemms(self)}     # im2col path -> its GEMMs (cpu_gemms)
        self._shifted_gemms = {"shifted": ShiftedBlasGemms(self)}    # shifted path -> its GEMMs
        self._direct = {}               # direct path -> its oneDNN convolutions (dnnl_conv)
        # depthwise path -> its Numba convolutions (cpu_depthwise), called as the direct ones are
        self._depthwise = {"depthwise": DepthwiseConvs(bf16=False), "depthwise-bf16": DepthwiseConvs(bf16=True)}
        # onednn: None, its paths where it is installed; False, OpenBLAS's only (as without it)
        self._dnnl, self.bf16_missing = self._open_dnnl(conv_path, precision, onednn)
        # precision bf16 where the CPU has no bf16 GEMM: the GEMM paths on its emulation (the same
        # products, float32 sums; dnnl.Dnnl.emulated_gemm_bf16), for correctness, not speed.
        # Never under precision auto, which takes exactly the float32 choice there.
        self.bf16_emulated = bool(self.bf16_missing) and precision == "bf16"
        # the direct paths' GEMMs all on oneDNN's OpenMP threads, OpenBLAS on one (see
        # cpu_path_choice.OPENBLAS_PATHS)
        self.openmp_gemms_only = self._dnnl is not None and self.threads > 1 and conv_path == "auto"
        # Held for the device's lifetime: BLAS threads beyond our share only oversubscribe cores
        # that another worker on this host was given.
        self._blas_limit = threadpool_limits(limits=1 if self.openmp_gemms_only else self.threads, user_api="blas")
        # Winograd F(4x4, 3x3) (cpu_winograd.py): float32 3x3 stride-1 convs as 36 GEMMs on the
        # transformed tiles, called as the direct paths are; its GEMMs on oneDNN's sgemm where
        # installed, on two or more threads the 36 of a pass in one parallel region
        # (_winograd_gemm_each), else OpenBLAS's.
        self._direct["winograd"] = WinogradConvs(self._winograd_gemm_each, self._scratch, self.im2col_budget_bytes)
        if self._dnnl is not None:
            self._path_gemms["im2col-dnnl"] = DnnlGemms(self, self._dnnl)
            self._shifted_gemms["shifted-dnnl"] = ShiftedDnnlGemms(self, self._dnnl)
            self._direct["direct-dnnl"] = DirectConvs(self._dnnl, self.threads, bf16=False)
            if not self.bf16_missing or self.bf16_emulated:
                self._path_gemms["im2col-bf16"] = Bf16Gemms(self, self._dnnl, self.bf16_emulated)
                self._shifted_gemms["shifted-bf16"] = ShiftedBf16Gemms(self, self._dnnl, self.bf16_emulated)
            if not self.bf16_missing:
                self._direct["direct-bf16"] = DirectConvs(self._dnnl, self.threads, bf16=True)

    @staticmethod
    def _open_dnnl(conv_path, precision, onednn):
        """(oneDNN or None, why bf16 cannot run here or ''). Where a path or precision asks for
        it, its absence is the one-line DeviceError; elsewhere the device runs without it."""
        needed = {"im2col-dnnl": f"conv path {conv_path}", "direct-dnnl": f"conv path {conv_path}",
                  "bf16": f"precision {precision}"}
        asked = needed.get(conv_path) or needed.get(precision)
        if onednn is False:
            if asked:
                raise DeviceError(f"{asked} needs oneDNN, which this device was opened without")
            return None, "opened without oneDNN"
        if asked is None and not dnnl.available():
            return None, dnnl.unavailable_reason()
        try:
            lib = dnnl.load()
        except DeviceError as e:
            raise DeviceError(f"{asked} needs oneDNN: {e}") from None
        if lib.bf16_error and precision == "bf16" and conv_path == "direct-dnnl":
            raise DeviceError(f"precision bf16 with conv path direct-dnnl runs oneDNN's bf16 convolutions, which "
                              f"this CPU lacks ({lib.bf16_error}); conv path auto runs bf16 on emulated GEMMs here")
        return lib, lib.bf16_error

    def _take_saved_cols(self, size):
        """A flat float32 buffer of at least `size` for a forward's im2col: the smallest pooled
        one that fits, else a new one."""
        fits = [b for b in self._saved_cols_pool if b.size >= size]
        if not fits:
            return np.empty(size, np.float32)
        best = min(fits, key=lambda b: b.size)
        self._saved_cols_pool = [b for b in self._saved_cols_pool if b is not best]
        return best

    def _give_back_saved_cols(self, buf):
        """Pool a buffer, keeping at most the budget's worth (the largest ones) in the pool."""
        pool = sorted(self._saved_cols_pool + [buf], key=lambda b: b.size, reverse=True)
        kept, total = [], 0
        for b in pool:
            if total + b.nbytes <= self.saved_cols_budget_bytes:
                kept.append(b)
                total += b.nbytes
        self._saved_cols_pool = kept

    def _scratch(self, name, shape):
        """A float32 work buffer kept between calls and grown when needed: allocating and first-
        touching ~100 MB per call cost about 5% of conv2's step. Never returned to a caller."""
        size = int(np.prod(shape))
        flat = self._scratch_buffers.get(name)
        if flat is None or flat.size < size:
            flat = self._scratch_buffers[name] = np.empty(size, np.float32)
        return flat[:size].reshape(shape)

    def describe(self):
        blas = [f"{i['internal_api']} {i.get('version', '?')} ({i.get('architecture', '?')})"
                for i in threadpool_info() if i.get("user_api") == "blas"]
        gemm = f", {self._dnnl.describe()}" if self._dnnl is not None else ""
        precision = self.precision
        if self.precision == "auto" and self.bf16_missing:
            precision += f" (float32 only: {'no oneDNN' if self._dnnl is None else 'no bf16 GEMM on this CPU'})"
        if self.bf16_emulated:
            precision += " (emulated: no bf16 GEMM on this CPU; the same sums, slower than float32)"
        return (f"cpu ({self.threads} thread{'s' if self.threads > 1 else ''}, BLAS {', '.join(blas) or 'unknown'}"
                f"{gemm}, {self.allocator}, precision {precision})")

    def _matmul_add(self, a, b, out, work):
        """out += a @ b: in one sgemm with beta = 1 where the BLAS can be called so, else through
        the work buffer named `work` and an add (one more pass over `out`)."""
        if self._sgemm is not None:
            self._sgemm(a, b, out, 1.0)
        else:
            part = self._scratch(work, out.shape)
            np.matmul(a, b, out=part)
            _add_into(out, part)

    def _fft_gemm(self, a, b, out, beta):
        """out = a @ b + beta * out, beta 0 or 1, on any row- or column-major views; safe to call
        from several threads at once (no shared work buffer)."""
        if self._sgemm is not None:
            self._sgemm(a, b, out, beta)
        elif beta == 0.0:
            np.matmul(a, b, out=out)
        else:
            out += a @ b


    def _winograd_gemm(self, a, b, out, beta):
        """out = a @ b + beta * out on the device's threads: oneDNN's sgemm where installed, but
        OpenBLAS's on one thread where b is a transposed view (dW's Z @ V^T, both summed along
        their rows): oneDNN's took 8.6 ms for resnet18's 64-channel layer at batch 16 (36 GEMMs
        of (64, 1024) @ (1024, 64)) where OpenBLAS's took 5.1, and either ~3.6 on its other
        layers. On more threads OpenBLAS stays held to one (cpu_path_choice.OPENBLAS_PATHS)."""
        if self._dnnl is not None and (self.threads > 1 or b.strides[0] != b.itemsize):
            self._dnnl.sgemm(a, b, out, beta, self.threads)
        else:
            self._fft_gemm(a, b, out, beta)

    def _winograd_gemm_each(self, a, b, out, beta):
        """out[f] = a[f] @ b[f] + beta * out[f] for the 36 frequencies: on two or more threads by
        dnnl.Dnnl.sgemm_each, in one parallel region of one-thread GEMMs where oneDNN's build can
        (36 regions a pass, 108 a layer's step, each waking the sleeping threads, took resnet18's
        and vgg-small's 3x3 layers on 2 threads to more than their time on one), else one by one
        as _winograd_gemm would; on one thread one by one (_winograd_gemm: OpenBLAS for dW)."""
        if self._dnnl is not None and self.threads > 1:
            self._dnnl.sgemm_each(a, b, out, beta, self.threads)
            return
        for f in range(len(out)):
            self._winograd_gemm(a[f], b[f], out[f], beta)

    # ---- the conv contract: each call on its path ------------------------------------------------
    def _conv2d(self, x, w, b, stride, padding):
        n, k = x.shape[0], w.shape[0]
        path = self._path(x, w, stride, padding)
        if path == "fft":
            y_kn, _ = self._fft_forward(x, w, padding)
            y = np.empty((n, k) + _conv_hw(x.shape, w.shape, stride, padding), np.float32)
            swap_leading(y_kn.reshape(k, n, -1), y.reshape(n, k, -1))
            y += b[None, :, None, None]
            return y
        if path in self._direct:
            convs = self._direct[path]
            if getattr(convs, "channels_last", False):    # the plain contract's y is C-contiguous NCHW
                y = empty_channels_last((n, k) + _conv_hw(x.shape, w.shape, stride, padding))
                convs.forward(x, w, stride, padding, y, b=b)
                return np.ascontiguousarray(y)
            y = np.empty((n, k) + _conv_hw(x.shape, w.shape, stride, padding), np.float32)
            convs.forward(np.ascontiguousarray(x, np.float32), w, stride, padding, y)
            y += b[None, :, None, None]
            return y
        if path in self._shifted_gemms:
            ho, wo = _conv_hw(x.shape, w.shape, stride, padding)
            y = np.empty((n, k, ho, wo), np.float32)
            self._shifted_forward(x, w, padding, lambda n0, n1, yt: _rows_to_nchw(yt, b, n0, n1, ho, wo, y),
                                  gemms=self._shifted_gemms[path])
            return y
        out = {}

        def to_nchw(n0, n1, y):
            out[n0] = y.reshape(k, n1 - n0, -1).transpose(1, 0, 2).copy()

        ho, wo = self._forward_chunks(x, w, stride, padding, to_nchw, gemms=self._path_gemms[path])
        y = np.concatenate([out[n0] for n0 in sorted(out)], axis=0).reshape(n, k, ho, wo)
        y += b[None, :, None, None]
        return y

    def _conv_block(self, x, w, b, block):
        """The block on its path: oneDNN's convolutions take x in either layout and give a
        channels-last output; every other path runs on NCHW (a channels-last x reordered first)."""
        w = np.ascontiguousarray(w, np.float32)
        has_bias = b is not None
        b = self._check_bias(b, w.shape[0])
        path = self._path(x, w, block.stride, block.padding, block)
        if path in self._direct and getattr(self._direct[path], "channels_last", False):
            return self._channels_last_block(x, w, b, block, self._direct[path], has_bias)
        x = np.ascontiguousarray(x)
        if path == "fft":
            return self._fft_block(x, w, b, block)
        if path in self._direct:
            return self._direct_block(x, w, b, block, self._direct[path])
        if path in self._depthwise:
            return self._direct_block(x, w, b, block, self._depthwise[path])
        return self._gemm_block(x, w, b, block, path)


    def _conv2d_backward(self, x, w, dy, stride, padding, need_dx):
        k = w.shape[0]
        path = self._path(x, w, stride, padding)
        if path == "fft":
            n = x.shape[0]
            dy_kn = self._scratch("fft_dy_kn", (k, n, dy.shape[2] * dy.shape[3]))
            swap_leading(dy.reshape(n, k, -1), dy_kn)
            return self._fft_backward(x, w, dy_kn, padding, need_dx)
        if path in self._direct:
            dw = np.empty(w.shape, np.float32)
            dy = np.ascontiguousarray(dy, np.float32)
            dx = self._direct[path].backward(np.ascontiguousarray(x, np.float32), w, dy, stride, padding, need_dx, dw)
            return dx, dw, _channel_totals(dy)
        if path in self._shifted_gemms:
            ho, wo = dy.shape[2], dy.shape[3]
            return self._shifted_backward(x, w, padding, need_dx,
                                          lambda n0, n1, dyt: _nchw_to_rows(dy, n0, n1, ho, wo, dyt),
                                          gemms=self._shifted_gemms[path])

        def from_nchw(n0, n1, out):
            out[:] = dy[n0:n1].reshape(n1 - n0, k, -1).transpose(1, 0, 2).reshape(k, -1)

        return self._backward_chunks(x, w, stride, padding, need_dx, from_nchw, gemms=self._path_gemms[path])

    @staticmethod
    def _backward_weights(ctx, w, dw_out):
        """w as backward reads it, after checking it and dw_out against the forward's context."""
        w = np.ascontiguousarray(w, np.float32)
        if tuple(w.shape) != tuple(ctx.w_shape):
            raise ValueError(f"weights changed shape since forward, {w.shape!r} != {ctx.w_shape!r}")
        if dw_out is not None and not (isinstance(dw_out, np.ndarray) and dw_out.dtype == np.float32
                                       and dw_out.flags.c_contiguous):
            raise TypeError(f"dw_out must be a C-contiguous float32 numpy array, got {type(dw_out).__name__}")
        return w

    def _channels_last_block(self, x, w, b, block, convs, has_bias=True):
        """The block on channels-last maps: the conv (bias added by the primitive) straight into
        the output where the block has no activation and no pool, else into a map the activation
        (kept for backward, as its own kernel keeps it) and the pool read; the input in the
        primitive's layout kept for backward within the saved-cols budget where it is not x's.
        Without a bias (`has_bias` False: the caller gave none) backward's db is zeros, not the
        sums of dY, a pass over the conv's whole output that a conv followed by BatchNorm (every
        conv of ResNet-50 and MobileNetV2) would pay for nothing."""
        stride, padding, shape = block.stride, block.padding, dict(dilation=block.dilation, groups=block.groups)
        ho, wo = _conv_hw(x.shape, w.shape, stride, padding, block.dilation)
        nbytes = convs.src_nbytes(x.shape, w.shape, stride, padding, **shape, x_channels_last=is_channels_last(x))
        saved = self._take_saved_cols(-(-nbytes // 4)) if 0 < nbytes <= self.saved_cols_budget_bytes else None
        saved_src = None if saved is None else saved.view(np.uint8)[:nbytes]
        y = empty_channels_last((x.shape[0], w.shape[0], ho, wo))
        convs.forward(x, w, stride, padding, y, saved_src, **shape, b=b)
        act = pool = None
        out = y
        if block.activation != "none":
            act = Activation(block.activation)
            out, act_saved = cpu_channelwise.activation(out, act)
        if block.pool != "none":
            pool = Pool(block.pool, block.pool_kernel, block.pool_stride, block.pool_padding)
            out, argmax = cpu_channels_last.pool(out, pool, (out.shape[:2]) + pool.output_hw(ho, wo))
        ctx = _DirectBlockContext(x, w, block, (ho, wo), pool, argmax if pool else None,
                                  act_saved if act else None, out.shape, convs, saved, saved_src)
        ctx.activation = act
        ctx.has_bias = has_bias
        return out, ctx

    def _channels_last_block_backward(self, ctx, w, dout, need_dx, dw_out, accumulate, on_dx=None):
        (ho, wo), x = ctx.conv_hw, ctx.x
        dy = as_channels_last(dout)
        if ctx.pool is not None:
            dy = cpu_channels_last.pool_backward(ctx.pool, ctx.argmax, (x.shape[0], w.shape[0], ho, wo), dy)
        if ctx.activation is not None:
            dy = cpu_channelwise.activation_backward(ctx.activation, ctx.mask, dy)
        db = (cpu_channels_last.rows_sums(dy, dy, np.zeros(dy.shape[1], np.float32))[0].astype(np.float32)
              if ctx.has_bias else np.zeros(dy.shape[1], np.float32))
        saved, saved_src = ctx.saved, ctx.saved_src
        ctx.saved = ctx.saved_src = None        # the buffer goes back to the pool: a second backward reorders x
        into = dw_out if dw_out is not None and not accumulate else np.empty(w.shape, np.float32)
        dx = ctx.convs.backward(x, w, dy, ctx.block.stride, ctx.block.padding, need_dx, into, saved_src,
                                dilation=ctx.block.dilation, groups=ctx.block.groups, on_dx=on_dx)
        if saved is not None:
            self._give_back_saved_cols(saved)
        return dx, (into if into is dw_out else self._dw_into(dw_out, accumulate, into)), db

    def _conv_block_backward_dx_first(self, ctx, w, dout, dw_out, accumulate, on_dx):
        """The FFT and direct paths compute dX apart from dW: dX first, handed to on_dx, then dW
        (the GEMM paths interleave both per chunk of images: on_dx at the end, as the base does)."""
        if isinstance(ctx, _FftBlockContext):
            return self._fft_block_backward(ctx, self._backward_weights(ctx, w, dw_out), dout, True, dw_out,
                                            accumulate, on_dx)
        if isinstance(ctx, _DirectBlockContext):
            return self._direct_block_backward(ctx, self._backward_weights(ctx, w, dw_out), dout, True, dw_out,
                                               accumulate, on_dx)
        return super()._conv_block_backward_dx_first(ctx, w, dout, dw_out, accumulate, on_dx)

    def _conv_block_backward(self, ctx, w, dout, need_dx, dw_out=None, accumulate=False):
        w = self._backward_weights(ctx, w, dw_out)
        if isinstance(ctx, _FftBlockContext):
            return self._fft_block_backward(ctx, w, dout, need_dx, dw_out, accumulate)
        if isinstance(ctx, _DirectBlockContext):
            return self._direct_block_backward(ctx, w, dout, need_dx, dw_out, accumulate)
        return self._gemm_block_backward(ctx, w, dout, need_dx, dw_out, accumulate)


    # ---- the FFT path (devices/cpu_fft.py) -----------------------------------------------------
    # Its spatial Y and dY are kernel-major, (K, N, Ho, Wo): each frequency's product runs as
    # W (K, C) @ X^T, the weights' spectra the GEMM's left operand. The block's activation and pool
    # read Y as (N, K, Ho, Wo) planes of that buffer, so nothing is reordered for a fused block.
    def _fft_forward(self, x, w, padding, x_spectra=None):
        """(Y (K*N, Ho*Wo) in a work buffer, without bias; the kernel spectra of w)."""
        ho, wo = _conv_hw(x.shape, w.shape, (1, 1), padding)
        y = self._scratch("fft_y_kn", (w.shape[0] * x.shape[0], ho * wo))
        return y, self._fft.forward(x, w, padding, y, x_spectra)

    def _fft_backward(self, x, w, dy_kn, padding, need_dx, spectra=None, x_spectra=None, dw_out=None,
                      accumulate=False, on_dx=None):
        """(dx, dw, db) from dY (K, N, Ho, Wo), C-contiguous; dW into dw_out where given; dx to
        on_dx, where given, before dW's work."""
        k, n = dy_kn.shape[0], dy_kn.shape[1]
        db = np.zeros(k, np.float64)
        _add_row_sums(dy_kn.reshape(k, -1), db)
        dx, dw = self._fft.backward(x, w, dy_kn.reshape(k * n, -1), padding, need_dx, spectra, x_spectra,
                                    dw_out, accumulate, on_dx)
        return dx, dw, db.astype(np.float32)

    def _fft_block(self, x, w, b, block):
        """The block's conv in the frequency domain, then bias, activation and pool in one pass
        over the (N, K, Ho, Wo) planes of the kernel-major Y, as _generic_block."""
        n, k = x.shape[0], w.shape[0]
        ho, wo = _conv_hw(x.shape, w.shape, (1, 1), block.padding)
        pool = _PoolGeometry.of(block)
        relu = block.activation == "relu"
        out = np.empty((n, k) + pool.output_hw(ho, wo), np.float32)
        argmax = np.empty(out.shape if pool.is_max else (0, 0, 0, 0), np.int32)
        mask = np.empty((n, k, ho, wo) if relu and not pool.is_max else (0, 0, 0, 0), np.uint8)
        # the input's spectra kept for backward, as the direct paths keep their im2col, within
        # the same budget and from the same pool
        size = self._fft.x_spectra_size(x.shape, w.shape, block.padding)
        x_spectra = self._take_saved_cols(size)[:size] if size * 4 <= self.saved_cols_budget_bytes else None
        y, spectra = self._fft_forward(x, w, block.padding, x_spectra)
        planes = y.reshape(k, n, ho, wo).transpose(1, 0, 2, 3)
        _act_pool(planes, b, 0, relu, pool.is_max, *pool.args, out, argmax, mask)
        return out, _FftBlockContext(x, w, block, (ho, wo), pool, argmax, mask, out.shape, spectra, x_spectra)

    def _fft_block_backward(self, ctx, w, dout, need_dx, dw_out, accumulate, on_dx=None):
        (ho, wo), pool = ctx.conv_hw, ctx.pool
        n, k = ctx.x.shape[0], w.shape[0]
        dy = self._scratch("fft_dy_kn", (k, n, ho * wo))
        planes = dy.reshape(k, n, ho, wo).transpose(1, 0, 2, 3)
        _act_pool_backward(dout, 0, ctx.block.activation == "relu", pool.is_max, *pool.args, ctx.argmax, ctx.mask,
                           planes)
        # the forward's spectra where these are its very weights (defined for them only: the
        # argmax came from them), else the cache's, checked against w
        spectra = ctx.spectra if w is ctx.forward_weights else None
        x_spectra, ctx.spectra, ctx.x_spectra = ctx.x_spectra, None, None     # a second backward recomputes
        grads = self._fft_backward(ctx.x, w, dy, ctx.block.padding, need_dx, spectra, x_spectra, dw_out, accumulate,
                                   on_dx)
        if x_spectra is not None:
            self._give_back_saved_cols(x_spectra.base if x_spectra.base is not None else x_spectra)
        return grads

    # ---- the direct paths: oneDNN's convolutions ------------------------------------------------
    def _direct_block(self, x, w, b, block, convs):
        """The block's conv by oneDNN into a work buffer (N, K, Ho, Wo), then bias, activation and
        pool in one pass, as _generic_block; the input in the primitive's layout kept for backward
        within the saved-cols budget."""
        x = np.ascontiguousarray(x, np.float32)
        n, k = x.shape[0], w.shape[0]
        stride, padding, shape = block.stride, block.padding, dict(dilation=block.dilation, groups=block.groups)
        ho, wo = _conv_hw(x.shape, w.shape, stride, padding, block.dilation)
        pool = _PoolGeometry.of(block)
        relu = block.activation == "relu"
        out = np.empty((n, k) + pool.output_hw(ho, wo), np.float32)
        max2 = _is_max2(block)
        argmax = np.empty(out.shape if pool.is_max else (0, 0, 0, 0), np.int8 if max2 else np.int32)
        mask = np.empty((n, k, ho, wo) if relu and not pool.is_max else (0, 0, 0, 0), np.uint8)
        nbytes = convs.src_nbytes(x.shape, w.shape, stride, padding, **shape)
        saved = self._take_saved_cols(-(-nbytes // 4)) if 0 < nbytes <= self.saved_cols_budget_bytes else None
        saved_src = None if saved is None else saved.view(np.uint8)[:nbytes]
        y = self._scratch("direct_y", (n, k, ho, wo))
        convs.forward(x, w, stride, padding, y, saved_src, **shape)
        if max2:
            _bias_act_max2_planes(y, b, relu, out, argmax)
        elif block.pool == "none":
            _bias_act_planes(_flat_planes(y), b, relu, _flat_planes(out), _flat_planes(mask))
        else:
            _act_pool(y, b, 0, relu, pool.is_max, *pool.args, out, argmax, mask)
        return out, _DirectBlockContext(x, w, block, (ho, wo), pool, argmax, mask, out.shape, convs, saved, saved_src)

    def _direct_block_backward(self, ctx, w, dout, need_dx, dw_out, accumulate, on_dx=None):
        if getattr(ctx.convs, "channels_last", False):
            return self._channels_last_block_backward(ctx, w, dout, need_dx, dw_out, accumulate, on_dx)
        (ho, wo), pool, x, block = ctx.conv_hw, ctx.pool, ctx.x, ctx.block
        relu = block.activation == "relu"
        dy = self._scratch("direct_dy", (x.shape[0], w.shape[0], ho, wo))
        sums = np.empty(dy.shape[:2])
        if _is_max2(block):
            _unpool_planes(dout, ctx.argmax, dy, sums)
        elif block.pool == "none":
            _act_backward_planes(_flat_planes(dout), _flat_planes(ctx.mask), relu, _flat_planes(dy), sums)
        else:
            _act_pool_backward(dout, 0, relu, pool.is_max, *pool.args, ctx.argmax, ctx.mask, dy)
            _plane_totals(dy.reshape(dy.shape[0], dy.shape[1], -1), sums)
        saved, saved_src = ctx.saved, ctx.saved_src
        ctx.saved = ctx.saved_src = None        # the buffer goes back to the pool: a second backward reorders x
        into = dw_out if dw_out is not None and not accumulate else np.empty(w.shape, np.float32)
        dx = ctx.convs.backward(x, w, dy, block.stride, block.padding, need_dx, into, saved_src,
                                dilation=block.dilation, groups=block.groups, on_dx=on_dx)
        if saved is not None:
            self._give_back_saved_cols(saved)
        return dx, (into if into is dw_out else self._dw_into(dw_out, accumulate, into)), _bias_grad(sums)

    # ---- optimizer ---------------------------------------------------------------------------
    def _sgd_(self, param, velocity, grad, lr, momentum, weight_decay, nesterov):
        _sgd_update(param, velocity, grad, lr, momentum, weight_decay, nesterov)
        self._fft.refresh(param)       # the FFT path's kernel spectra of these weights, if cached

    def _adamw_(self, param, exp_avg, exp_avg_sq, grad, *scalars):
        _adamw_update(param, exp_avg, exp_avg_sq, grad, *scalars)
        self._fft.refresh(param)

    def _square_sums(self, a, lanes):
        sums = np.empty(lanes, np.float64)
        _square_sums_flat(a.reshape(-1), sums)
        return sums

    def _scale_(self, a, factor):
        _scale_flat(a.reshape(-1), factor)
        self._fft.refresh(a)

    # ---- per-channel layers (devices/cpu_channelwise.py) ---------------------------------------------
    _activation = _ChannelKernels._activation
    _activation_backward = _ChannelKernels._activation_backward
    _pool = _ChannelKernels._pool
    _pool_backward = _ChannelKernels._pool_backward
    _plane_sums = _ChannelKernels._plane_sums
    _normalize = _ChannelKernels._normalize
    _normalize_act = _ChannelKernels._normalize_act
    _batchnorm_grad_sums = _ChannelKernels._batchnorm_grad_sums
    _batchnorm_act_grad_sums = _ChannelKernels._batchnorm_act_grad_sums
    _batchnorm_backward = _ChannelKernels._batchnorm_backward
    _batchnorm_act_backward = _ChannelKernels._batchnorm_act_backward

    def _channel_scale(self, x, mask):
        if is_channels_last(x):
            return cpu_channels_last.channel_scale(x, mask)
        return cpu_channelwise.channel_scale(x, mask)


def open(index=None, threads=None, **options):
    if index is not None:
        raise DeviceError(f"the cpu device takes no index, got cpu:{index}")
    return CpuDevice(threads=threads, **options)


_head_sgemm = None       # oneDNN where installed, False where not: looked up on the first head GEMM


def head_gemm(a, b, out=None, accumulate=False):
    """a @ b for the head's 2-D float32 operands (row-major, or transposed views of row-major
    blocks), into a new array, or added into `out` (float32, row-contiguous) where `accumulate`,
    else written there: oneDNN's sgemm where installed, on as many threads as Numba runs here;
    numpy's matmul otherwise, and for any other dtype or layout. Why not numpy's OpenBLAS: its
    pthreads keep spinning after each call on the cores the conv layers compute on next; at
    vgg-small's size (batch 32, 1024 -> 256 -> 10) the head's GEMMs take ~0.1 ms, and an OpenBLAS
    thread left spinning beside a two-thread conv slowed the layers after it by more than that,
    and under other tenants' load OpenBLAS's two threads took 10-30 ms a call."""
    global _head_sgemm
    if _head_sgemm is None:
        _head_sgemm = dnnl.load() if dnnl.available() else False
    if _head_sgemm and a.dtype == np.float32 and b.dtype == np.float32 and a.ndim == b.ndim == 2:
        c = np.empty((a.shape[0], b.shape[1]), np.float32) if out is None else out
        try:
            return _head_sgemm.sgemm(a, b, c, 1.0 if accumulate else 0.0, numba.get_num_threads())
        except ValueError:          # a layout a GEMM cannot take as it is (a broadcast view, say)
            pass
    return numpy_gemm(a, b, out, accumulate)


class HostArrays(_ChannelKernels, Device):
    """Updates of numpy arrays that live on no device (a conv layer's per-channel BatchNorm
    vectors, the head on the coordinator): the CPU device's update kernels, with nothing to open.
    Every copy of such a vector, on any worker, moves by this same arithmetic. The activations and
    pools a graph runs between its blocks use the CPU device's kernels, the head's GEMMs
    `head_gemm`."""

    name = "host"
    gemm = staticmethod(head_gemm)

    def _sgd_(self, param, velocity, grad, lr, momentum, weight_decay, nesterov):
        _sgd_update(param, velocity, grad, lr, momentum, weight_decay, nesterov)

    def _adamw_(self, param, exp_avg, exp_avg_sq, grad, *scalars):
        _adamw_update(param, exp_avg, exp_avg_sq, grad, *scalars)

    def _square_sums(self, a, lanes):
        sums = np.empty(lanes, np.float64)
        _square_sums_flat(np.ascontiguousarray(a, np.float32).reshape(-1), sums)
        return sums

    def _scale_(self, a, factor):
        _scale_flat(a.reshape(-1), factor)
