"""The CPU device's choice of conv path, per call shape: forced (`conv_path`), by a rule
(`deterministic`, or a call too small to time), from a checkpoint's record, from the machine's
wisdom, or timed. ConvPathChoice is a part of CpuDevice (devices/cpu.py): it reads the paths the
device holds (`_path_gemms`, `_shifted_gemms`, `_direct`, `_depthwise`, `_fft`) and its options
(`conv_path`, `precision`, `threads`, `verbose`, `openmp_gemms_only`), and times the paths by
running the device's own conv calls with one path forced (`_trial_path`).

- "auto": on the first call with a shape big enough to matter (AUTO_TIMED_MIN_FLOPS) each path
  the layer can take is timed, forward and backward, and the fastest kept for that shape
  (`conv_paths()` says what each runs). Smaller calls keep a rule: where one GEMM's reduction
  C*kw is at least SHIFTED_MIN_REDUCTION (64) and the kernels held are fewer than 0.4 C*kw, the
  shifted-GEMM path, else im2col. A worker's share of the paper's conv2 (C*kw = 2500, up to 999
  kernels) is shifted by that rule, the whole 1500-kernel layer im2col; conv1 (C*kw = 15, where
  five 15-long reductions would run thin GEMMs and im2col is cheap) is im2col.
  `conv_path="im2col"`, `"shifted"` or `"fft"` forces one (tests run each everywhere).
- What the timing chose is data (devices/wisdom.py): kept per machine in a wisdom file, which
  later devices of that machine reuse instead of timing (`wisdom`, `retime`), recorded per run
  (`conv_path_record`) and run again on resume (`preload_conv_paths`); `deterministic` chooses by
  the rule above, never by a clock.
"""
import logging
import sys
import time

import numpy as np

from hetconv.devices import wisdom as wisdom_keys
from hetconv.devices.base import DeviceError
from hetconv.devices.cpu_gemm_paths import _conv_hw

# "auto" takes the shifted-GEMM path where one GEMM's reduction, C*kw, is at least this long, and
# im2col below it: conv1's C*kw = 3*5 = 15 would run five thin GEMMs where im2col runs one of 75.
SHIFTED_MIN_REDUCTION = 64
# ... and where the layer's kernels K stay below this fraction of C*kw: the shifted path's cost
# grows with K (each kernel row's GEMM lands in a temporary that is added in), im2col's fixed
# part does not. Measured on the paper's conv2 (C*kw = 2500), N=32, one thread, quiet machine:
# shifted/im2col = 0.94 at 375 kernels, 0.94 at 750, 1.08 at 1500; so a worker holding a share
# takes the shifted path, the whole layer on one device im2col.
SHIFTED_MAX_KERNELS_PER_REDUCTION = 0.4
# A bf16 path is taken where it runs faster than the fastest float32 path by this margin
# (`precision="auto"`, see cpu.py's PRECISIONS): the accuracy it gives up buys a real gain, not a
# timing's noise.
AUTO_BF16_MARGIN = 0.04
# the oneDNN paths (devices/cpu_gemms.py, cpu_shifted_gemms.py): where oneDNN is installed,
# "auto" times im2col-dnnl and shifted-dnnl among the float32 paths. On vgg-small's 32x32 and
# 16x16 layers the shifted layout's kw-fold expansion costs a third of im2col's kh*kw one, which
# the im2col paths' GEMMs do not win back. An untimed call takes the rule's layout on oneDNN's
# sgemm: OpenBLAS's two threads, which spin between calls, waited ~30 ms a call for a core beside
# other tenants' work (airbench94's 2x2 first layer at batch 32: 36 ms forward and backward
# against 2-4 on oneDNN, under either OpenBLAS kernel), where oneDNN's OpenMP threads sleep.
DNNL_PATHS = ("im2col-dnnl", "im2col-bf16", "shifted-dnnl", "shifted-bf16", "direct-dnnl", "direct-bf16")
BF16_PATHS = ("im2col-bf16", "shifted-bf16", "direct-bf16", "depthwise-bf16")
# ... and oneDNN's own convolutions (devices/dnnl_conv.py), float32 and bf16, at any stride: no
# expansion of the input at all, for a reorder into a channel-blocked layout and back (one pass
# over x, dY, Y and dX each). Timed among the others where oneDNN is installed.
DIRECT_PATHS = ("direct-dnnl", "direct-bf16")
# ... and where oneDNN is installed, a device of two or more threads choosing its own paths runs no
# direct path on OpenBLAS at all: OpenBLAS's pthreads keep spinning after each call on the very
# cores the next Numba pass and oneDNN GEMM (one OpenMP pool) need, a cost that falls on the layers
# after the call, so a layer timed alone cannot see it. vgg-small at batch 32, 2 threads, single
# runs on a nearly quiet host: the OpenBLAS layers' neighbours ran 1.3-1.8x slower than alone (its
# 32x32 layer's forward 5.9 ms in the step against 3.3 ms alone), and the step took 52 ms with
# OpenBLAS's shifted path on five layers against 43 ms with every GEMM on oneDNN; three quiet
# rounds since: 0.042 s a step (bench/results/precision/targets/vgg_small.md; 0.055 s before).
# OpenBLAS is held to one thread there: the FFT path (one BLAS thread per call, split over its own
# threads) still runs on it.
OPENBLAS_PATHS = ("im2col", "shifted")
# "auto" times the paths a layer can take (im2col; shifted and FFT at stride 1, FFT within its
# budget) on the first call with each shape: forward and backward with dX on the call's own input
# and weights, one warm-up run per path, then AUTO_TIMED_ROUNDS rounds (or more, below) in
# alternating order, the fastest median kept for that shape from then on. That costs up to ~3
# steps of the layer per path, once per shape (calibration's warm-up call absorbs it), so below
# AUTO_TIMED_MIN_FLOPS forward FLOPs per call the rule above stays, untimed: there a call takes under a millisecond, the paths
# differ by less than that, and the first use of a path (Numba loading its kernels, the work
# buffers' first touch) costs tens of milliseconds. The test suite's small layers stay there.
AUTO_TIMED_MIN_FLOPS = 20e6
AUTO_TIMED_ROUNDS = 2
# ... and more rounds, up to AUTO_TIMED_MAX_ROUNDS, until the timed runs add up to this many
# seconds: a layer of ~50 ms per step is decided on a time slice or two of a shared core otherwise
# (on a loaded 2-core machine two rounds picked a path 1.1-2x slower on 5 of 15 preset layers).
AUTO_TIMED_MIN_SECONDS = 1.0
AUTO_TIMED_MAX_ROUNDS = 9
# After the first timed round a path over this multiple of the fastest is not timed again (the
# rounds' noise is a few percent): conv1 on the FFT path (~8x im2col) or conv2's direct paths
# (~2.5x its FFT path) run once less.
AUTO_DROP_FACTOR = 1.5
# The median of a path's rounds, not its minimum: the FFT path's runs spread more than the direct
# paths' (a pool of threads, many small GEMMs), and its luckiest run chose it for a vgg-small layer
# (5.5 ms against shifted 5.7) that another worker timed at 14.4 ms. And the FFT path is taken
# only where it is faster than the best direct path by AUTO_FFT_MARGIN: it also holds its kernel
# spectra (12x the weights) for as long as the layer runs.
AUTO_FFT_MARGIN = 0.04
# ... and Winograd F(4x4, 3x3) (devices/cpu_winograd.py) by the same margin: its sums carry about
# 10x a direct sum's float32 rounding (relative error ~1e-5 where a direct conv's is ~1e-6), which
# is taken only for a real gain. Timed on 3x3 stride-1 dense calls, float32 only.
AUTO_WINOGRAD_MARGIN = 0.04
# ... and where one of oneDNN's own convolutions runs the call on channels-last maps (DIRECT_PATHS),
# a path that runs on NCHW is taken only where it beats the fastest of those by this margin: its
# timing counts the reorder of its input into NCHW, not what its NCHW output costs the work around
# it (the block's tail runs on NCHW, the next conv reorders it back, and so do dY and dX in the
# backward). ResNet-50's layer2.0.conv1 on a one-thread worker (16 images, 1x1, 256 -> 128 at
# 40x40): the shifted path timed 0.089 s against direct-dnnl's 0.096 s, and ran 0.130 s in the
# step, where calibration priced direct-dnnl at 0.059 s.
AUTO_LAYOUT_MARGIN = 0.15
# ... and only where the layer has at least this many input channels and kernels (its share of
# them on a worker): its GEMMs are (K, C) @ (C, tiles), and with fewer the memory-bound transforms
# outweigh what they save (resnet18's 64-channel 32x32 layer at batch 16 on one Zen 4 core: 1.05x
# oneDNN's direct convolution; its 128- and 256-channel layers 1.35x and 1.22x).
WINOGRAD_MIN_CHANNELS = 32
# A layer timed once keeps its choice for calls of the same layer with the same images and
# kernels within this factor of the timed call's: calibration's two kernel counts (the share and
# half of it) and a training call on that batch then cost one timing instead of three (~24 s each
# for the paper's conv2 at N=32 on one thread), and the cost line fitted to them measures one
# path. Across batch sizes only where FFT was chosen and the call has more images (evaluation's
# batches, say): the FFT path pays its kernel spectra once a call whatever the images, so more
# images only widen its lead, and fewer images with more kernels narrow it (vgg-small's last
# layer: even with the shifted path at 16 images x 128 kernels, 1.5x slower at 8 x 256).
AUTO_REUSE_FACTOR = 2.0
# ... but not across kernel counts where Winograd is a candidate: its input transform is a cost per
# call that the kernels do not share out, so its rank flips with them. resnet18's 64-channel 32x32
# layer at 16 images on one Zen 4 core: 22.1 ms against the direct path's 20.1 with a worker's 32
# kernels (calibration's share), 31 against 37 with all 64 (the data-parallel block's call).

# Timing the paths of a big layer takes seconds to tens of seconds (the paper's conv2 on one
# thread: ~24 s): said here at INFO before it starts, for a command line that shows progress
# (hetconv-plan, --local) to print; a worker leaves it unshown.
progress = logging.getLogger(__name__)


DETERMINISTIC = wisdom_keys.DETERMINISTIC      # the `why` of a choice made by `deterministic`'s rule
_NOT_DEPTHWISE = "forced path depthwise runs depthwise convs only (groups equal to the input channels)"


def _time_one_run(path, run):
    """Seconds of one run() (the default timer of the automatic path choice)."""
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


class _PathChoice:
    """The path a layer call runs, why ("timed", "as timed for ...", "wisdom", "checkpoint",
    "rule: ...", "rule (deterministic)", "forced", "fft declined: ..."), the seconds each path
    took where they were timed (in this run, or where the wisdom kept them), and whether it came
    from a measurement (`measured`: a run's record and the wisdom keep only those; the others a
    device makes the same again by itself); `calls`: how many calls of its shape have run it
    (what ran since a report: --precision auto's per-layer line, training.loop)."""

    def __init__(self, path, why, seconds=None, measured=False):
        self.path, self.why, self.seconds, self.measured = path, why, seconds or {}, measured
        self.calls = 0

    def describe(self):
        if not self.seconds:
            return f"{self.path} ({self.why})"
        times = ", ".join(f"{p} {s * 1e3:.1f} ms" for p, s in sorted(self.seconds.items(), key=lambda kv: kv[1]))
        return f"{self.path} ({'' if self.why == 'timed' else self.why + ': '}timed forward+backward: {times})"


def _fastest(seconds):
    """The path to run from {path: seconds}: the fastest direct float32 path, or FFT or a bf16
    path where it beats that by its margin (the fastest of those that do); where every path is
    bf16 (precision bf16), the fastest. Where one of oneDNN's channels-last convolutions is among
    them, every path on NCHW maps is compared at its seconds over 1 - AUTO_LAYOUT_MARGIN: the
    share of a call its layout is taken to cost the work around it."""
    if any(p in DIRECT_PATHS for p in seconds):
        seconds = {p: s if p in DIRECT_PATHS else s / (1.0 - AUTO_LAYOUT_MARGIN) for p, s in seconds.items()}
    direct = [p for p in seconds if p not in ("fft", "winograd") and p not in BF16_PATHS]
    if not direct:
        return min(seconds, key=seconds.get)
    direct = min(direct, key=seconds.get)
    margins = {"fft": AUTO_FFT_MARGIN, "winograd": AUTO_WINOGRAD_MARGIN, **dict.fromkeys(BF16_PATHS, AUTO_BF16_MARGIN)}
    better = [p for p, m in margins.items() if p in seconds and seconds[p] < (1.0 - m) * seconds[direct]]
    return min(better, key=seconds.get) if better else direct


def _conv_shape(block):
    """The dilation and groups of a call's block as keyword arguments (none for a plain call)."""
    return {} if block is None else dict(dilation=block.dilation, groups=block.groups)


def _describe_call(key):
    x_shape, w_shape, stride, padding, block = key
    form = "plain conv" if block is None else f"block {block}"
    return f"x {x_shape} w {w_shape} stride {stride} padding {padding}, {form}"


class _WouldTime(Exception):
    """A path choice that would time the paths, raised where conv_block_needs_timing asks."""


class ConvPathChoice:
    """The path of each conv call of a CpuDevice, and what the device reports of its choices."""

    def _start_path_choice(self, auto_timed_min_flops, auto_timer, wisdom, retime, deterministic):
        """The choice's state, empty: called once by CpuDevice.__init__ (its arguments are the
        device's own, described there)."""
        self._fft_declined = set()      # layer shapes already reported as declined
        self.auto_timed_min_flops = float(auto_timed_min_flops)
        self._auto_timer = auto_timer   # (path, run) -> seconds of one run; tests give a fake one
        if wisdom is not None and not (callable(getattr(wisdom, "lookup", None))
                                        and callable(getattr(wisdom, "store", None))):
            raise DeviceError(f"wisdom must be a devices.wisdom.Wisdom or None, got {type(wisdom).__name__}")
        self.wisdom, self.retime, self.deterministic = wisdom, bool(retime), bool(deterministic)
        self._machine = None            # this device's wisdom machine key, (dict, canonical string), when first needed
        self._preloaded = {}            # canonical call key -> path, from a checkpoint's record (preload_conv_paths)
        # the path of each call shape (x, w, stride, padding, block or None): see _path
        self._choices = {}
        self._timed = []                # (layer less its batch, images, kernels, call, choice) per timing
        self._warm_flops = {}           # path -> the largest call (forward FLOPs) it has run while timed
        self._trial_path = None         # the path forced while "auto" times the candidates
        self._choosing_untimed = False  # conv_block_needs_timing: a choice that would time raises _WouldTime

    def conv_paths(self):
        """{call shape: the path it runs}, one entry per (input shape, weights shape, stride,
        padding, plain conv or block) this device has run: "fft", "shifted" or "im2col"."""
        return {_describe_call(key): choice.path for key, choice in self._choices.items()}

    def conv_path_choices(self):
        """[{call, key, path, why, seconds, calls}] per call shape run so far (see
        Device.conv_path_choices); `key`: the call as devices.wisdom.call_key writes it."""
        return [{"call": _describe_call(key), "key": wisdom_keys.call_key(*key), "path": choice.path, "why": choice.why,
                 "seconds": {p: float(s) for p, s in choice.seconds.items()}, "calls": choice.calls,
                 **({"kernels": self._direct_kernels(key, choice)} if choice.path in DIRECT_PATHS else {})}
                for key, choice in self._choices.items()]

    def machine_key(self):
        """This device's machine key in the wisdom and in a run's records (devices.wisdom
        machine_key): the host's CPU and libraries, and this device's threads, precision,
        conv_path option and paths."""
        return self._machine_key()[0]

    def _machine_key(self):
        if self._machine is None:
            paths = {*self._path_gemms, *self._shifted_gemms, *self._direct, *self._depthwise, "fft"}
            # --precision auto where bf16 cannot run has fp32's candidates: it is fp32's machine,
            # so it runs the paths fp32 timed (its own timing, at another moment, could pick others)
            precision = "fp32" if self.precision == "auto" and self.bf16_missing else self.precision
            key = wisdom_keys.machine_key(self.threads, precision, self.conv_path,
                                          None if self._dnnl is None else self._dnnl.version, paths)
            self._machine = (key, wisdom_keys.canonical(key))
        return self._machine

    def conv_path_record(self):
        """{machine, choices: [{call, path, why}]}: the choices this device made from a measurement
        (timed, as timed, the wisdom's, a checkpoint's; the latest MAX_RECORD_CHOICES), which a
        run keeps in its metrics and checkpoints and `--resume` hands back (preload_conv_paths).
        The rule's and forced choices are left out: a device makes them the same again."""
        choices = [{"call": wisdom_keys.call_key(*key), "path": c.path, "why": c.why[:wisdom_keys.MAX_WHY]}
                   for key, c in self._choices.items() if c.measured]
        return {"machine": self.machine_key(), "choices": choices[-wisdom_keys.MAX_RECORD_CHOICES:]}

    def preload_conv_paths(self, records):
        """Take the choices of `records` (a run's, as conv_path_record gives them per device:
        from a checkpoint, checked here again) whose machine key is this device's: those call
        shapes run that path from now on (why "checkpoint"), before the wisdom and timing, where
        the path is among the call's candidates. Where two records of this machine disagree, the
        first one's stands. Returns how many call shapes were taken."""
        checked, _ = wisdom_keys.checked_records(records)
        machine = self._machine_key()[1]
        taken = 0
        for record in checked:
            if wisdom_keys.canonical(record["machine"]) != machine:
                continue
            for c in record["choices"]:
                call = wisdom_keys.canonical(c["call"])
                if call not in self._preloaded:
                    self._preloaded[call] = c["path"]
                    taken += 1
        # a call shape chosen already (calibration before a resume's record came) is chosen again
        self._choices = {key: choice for key, choice in self._choices.items()
                         if self._preloaded.get(wisdom_keys.canonical(wisdom_keys.call_key(*key)), choice.path)
                         == choice.path}
        return taken

    def _direct_kernels(self, key, choice):
        """oneDNN's implementations of a call on a direct path: {direction: name}."""
        return self._direct[choice.path].implementations(*key[:4], **_conv_shape(key[4]))

    def describe_conv_paths(self):
        """One line per call shape run so far: the path and why (timed, with each path's time; the
        rule; forced; or why the FFT path declined); on a direct path, oneDNN's kernels."""
        return [f"{_describe_call(key)}: {self._describe_choice(key, choice)}" for key, choice in self._choices.items()]

    def _describe_choice(self, key, choice):
        if choice.path not in DIRECT_PATHS:
            return choice.describe()
        kernels = ", ".join(f"{d} {name}" for d, name in self._direct_kernels(key, choice).items())
        return f"{choice.describe()}; oneDNN {kernels}"

    def conv_block_needs_timing(self, x_shape, w_shape, block):
        """Whether the first call of this shape would time the paths (see Device): not where the
        shape is chosen already, nor where the rule, a forced path, a checkpoint's record or the
        wisdom chooses it; those choices are made here and kept, as the call would make them."""
        key = (tuple(x_shape), tuple(w_shape), block.stride, block.padding, block)
        if key in self._choices:
            return False
        # shapes only: the choice reads no values
        x, w = np.broadcast_to(np.float32(0), key[0]), np.broadcast_to(np.float32(0), key[1])
        self._choosing_untimed = True
        try:
            self._choices[key] = self._choose_path(x, w, block.stride, block.padding, block)
        except _WouldTime:
            return True
        finally:
            self._choosing_untimed = False
        return False

    def choose_conv_path(self, x, w, block):
        self._path(x, np.ascontiguousarray(w, np.float32), block.stride, block.padding, block)

    def _path(self, x, w, stride, padding, block=None):
        """The conv path of this call, "fft", "shifted" or "im2col": chosen on the first call with
        its shapes (see AUTO_TIMED_MIN_FLOPS), the same from then on."""
        if self._trial_path is not None:
            return self._trial_path
        key = (tuple(x.shape), tuple(w.shape), stride, padding, block)
        choice = self._choices.get(key)
        if choice is None:
            choice = self._choices[key] = self._choose_path(x, w, stride, padding, block)
        choice.calls += 1
        return choice.path

    def _choose_path(self, x, w, stride, padding, block):
        n, k, ho, wo = x.shape[0], w.shape[0], *_conv_hw(x.shape, w.shape, stride, padding,
                                                         (1, 1) if block is None else block.dilation)
        flops = 2.0 * n * k * w.shape[1] * w.shape[2] * w.shape[3] * ho * wo
        untimed = f"rule: {flops / 1e6:.3g} MFLOP per call, under the {self.auto_timed_min_flops / 1e6:.3g} timed"
        if block is not None and not block.dense:
            return self._choose_dilated_or_grouped(x, w, stride, padding, block, flops, untimed)
        if self.precision == "bf16":
            if self.conv_path == "direct-dnnl":
                return self._forced_direct("direct-bf16", x, w, stride, padding, block)
            if self.deterministic:
                # the float32 rule's layout, on bf16 operands: im2col's col2im is the dearer
                # backward where shifted takes the layer (resnet18's 3x3 stride-1 layers)
                return _PathChoice("shifted-bf16" if self._shifted(w.shape, stride) else "im2col-bf16",
                                   DETERMINISTIC)
            if flops < self.auto_timed_min_flops and not self._preloaded:
                return _PathChoice("im2col-bf16", untimed)
            candidates = (["im2col-bf16"] + (["shifted-bf16"] if stride == (1, 1) else [])
                          + (["direct-bf16"] if self._direct_runs("direct-bf16", x, w, stride, padding, block) else []))
            if flops < self.auto_timed_min_flops:       # untimed, unless a checkpoint's record says otherwise
                found = self._preloaded_choice(candidates, x, w, stride, padding, block)
                return found or _PathChoice("im2col-bf16", untimed)
            if len(candidates) == 1:
                return _PathChoice("im2col-bf16", "the only bf16 path here")
            return self._measured_choice(candidates, x, w, stride, padding, block, flops, "")
        if self.conv_path == "im2col-dnnl":
            return _PathChoice("im2col-dnnl", "forced")
        if self.conv_path == "direct-dnnl":
            return self._forced_direct("direct-dnnl", x, w, stride, padding, block)
        rule = "shifted" if self._shifted(w.shape, stride) else "im2col"
        have = {**self._path_gemms, **self._shifted_gemms, **self._direct}
        by_rule = f"{rule}-dnnl" if f"{rule}-dnnl" in have else rule
        if self.conv_path == "depthwise":
            return _PathChoice(rule, _NOT_DEPTHWISE)
        if self.conv_path in ("im2col", "shifted"):
            return _PathChoice(rule, "forced" if rule == self.conv_path else "forced path takes stride 1 only")
        if self.conv_path == "winograd":
            declined = self._direct["winograd"].declines(x.shape, w.shape, stride, padding)
            return _PathChoice(by_rule if declined else "winograd", f"winograd declined: {declined}" if declined
                               else "forced")
        declined = self._fft_declines(x.shape, w.shape, stride, padding)
        if self.conv_path == "fft":
            if not declined:
                return _PathChoice("fft", "forced")
            layer = (tuple(x.shape[1:]), tuple(w.shape), stride, padding)
            if self.verbose and layer not in self._fft_declined:
                print(f"cpu device: conv of x {tuple(x.shape)} with w {tuple(w.shape)} takes the direct path, "
                      f"not FFT: {declined}", file=sys.stderr, flush=True)
            self._fft_declined.add(layer)
            return _PathChoice(rule, f"fft declined: {declined}")
        if self.deterministic:
            return _PathChoice(by_rule, DETERMINISTIC)
        if flops < self.auto_timed_min_flops and not self._preloaded:
            return _PathChoice(by_rule, untimed)
        candidates = (["im2col"] + (["shifted"] if stride == (1, 1) else []) + ([] if declined else ["fft"])
                      + (["winograd"] if min(w.shape[:2]) >= WINOGRAD_MIN_CHANNELS
                         and self._direct_runs("winograd", x, w, stride, padding, block) else [])
                      + [p for p in DNNL_PATHS if p in have and (stride == (1, 1) or p not in self._shifted_gemms)
                         and (p not in BF16_PATHS or self.precision == "auto")
                         and (p not in self._direct or self._direct_runs(p, x, w, stride, padding, block))])
        if self.openmp_gemms_only:
            candidates = [p for p in candidates if p not in OPENBLAS_PATHS]
        if flops < self.auto_timed_min_flops:           # untimed, unless a checkpoint's record says otherwise
            return self._preloaded_choice(candidates, x, w, stride, padding, block) or _PathChoice(by_rule, untimed)
        if len(candidates) == 1:
            return _PathChoice(candidates[0], f"the only path here: {declined}")
        return self._measured_choice(candidates, x, w, stride, padding, block, flops, declined)

    def _choose_dilated_or_grouped(self, x, w, stride, padding, block, flops, untimed):
        """The path of a dilated or grouped conv: an im2col path (its GEMMs one per group, its
        im2col taps dilation apart), oneDNN's direct one (which takes both) or, for a depthwise
        conv, the depthwise path (the rule's there); never the shifted path (its GEMMs read each
        kernel row's dense taps as one block of rows) nor FFT (dense kernel spectra): a forced one
        of those runs im2col, and says why."""
        bf16 = self.precision == "bf16"
        depthwise = not self._depthwise["depthwise"].declines(x.shape, w.shape, stride, padding, **_conv_shape(block))
        if self.conv_path == "direct-dnnl":
            return self._forced_direct("direct-bf16" if bf16 else "direct-dnnl", x, w, stride, padding, block)
        if self.conv_path == "im2col-dnnl":
            return _PathChoice("im2col-dnnl", "forced")
        if self.conv_path == "depthwise":
            return _PathChoice("depthwise", "forced") if depthwise else _PathChoice("im2col", _NOT_DEPTHWISE)
        if self.conv_path in ("im2col", "shifted", "fft"):
            return _PathChoice("im2col", "forced" if self.conv_path == "im2col"
                               else f"forced path {self.conv_path} runs dense convs only (no dilation, one group)")
        if depthwise:
            by_rule = "depthwise-bf16" if bf16 else "depthwise"
        else:
            by_rule = ("im2col-bf16" if bf16 else "im2col-dnnl" if "im2col-dnnl" in self._path_gemms else "im2col")
        if self.deterministic:
            return _PathChoice(by_rule, DETERMINISTIC)
        if bf16:
            candidates = ["im2col-bf16", "direct-bf16"] + (["depthwise-bf16"] if depthwise else [])
        else:
            # not depthwise-bf16 under precision auto: the float32 kernel and a rounding pass, it
            # cannot beat the float32 path by AUTO_BF16_MARGIN
            candidates = (["im2col", "im2col-dnnl", "direct-dnnl"] + (["depthwise"] if depthwise else [])
                          + (["im2col-bf16", "direct-bf16"] if self.precision == "auto" else []))
        if self.openmp_gemms_only:
            candidates = [p for p in candidates if p not in OPENBLAS_PATHS]
        candidates = [p for p in candidates if p in self._path_gemms or p in self._depthwise
                      or self._direct_runs(p, x, w, stride, padding, block)]
        if flops < self.auto_timed_min_flops:
            # untimed, a depthwise conv takes oneDNN's own depthwise kernels where they run it: 1.6x
            # to 3.6x the depthwise path's speed on mobilenet_v2's layers (one Zen 4 core);
            # --deterministic keeps the depthwise path, whose sums do not depend on the threads
            direct = "direct-bf16" if bf16 else "direct-dnnl"
            untimed_rule = direct if depthwise and direct in candidates else by_rule
            return (self._preloaded_choice(candidates, x, w, stride, padding, block)
                    or _PathChoice(untimed_rule, untimed))
        if len(candidates) == 1:
            return _PathChoice(candidates[0], "the only path here for a dilated or grouped conv")
        return self._measured_choice(candidates, x, w, stride, padding, block, flops, "")

    def _preloaded_choice(self, candidates, x, w, stride, padding, block):
        """The checkpoint's choice for this call (preload_conv_paths), where it gave one among
        `candidates`, else None. Said with --verbose, as a timed choice is."""
        if not self._preloaded:
            return None
        key = (tuple(x.shape), tuple(w.shape), stride, padding, block)
        path = self._preloaded.get(wisdom_keys.canonical(wisdom_keys.call_key(*key)))
        if path not in candidates:
            return None
        found = _PathChoice(path, "checkpoint", measured=True)
        if self.verbose:
            print(f"cpu device: {_describe_call(key)} runs {self._describe_choice(key, found)}", file=sys.stderr,
                  flush=True)
        return found

    def _measured_choice(self, candidates, x, w, stride, padding, block, flops, declined):
        """The choice among `candidates` (two or more) of a call big enough to be timed: the
        checkpoint's where preload_conv_paths gave one for this call; else the wisdom's (unless
        `retime`); else timed (_timed_choice), and kept in the wisdom. A stored path that is not
        among this call's candidates (a budget or a library changed) is passed over."""
        found = self._preloaded_choice(candidates, x, w, stride, padding, block)
        if found is not None:
            return found
        if self.wisdom is None:
            return self._timed_choice(candidates, x, w, stride, padding, block, flops, declined)
        key = (tuple(x.shape), tuple(w.shape), stride, padding, block)
        machine, call = self._machine_key()[1], wisdom_keys.canonical(wisdom_keys.call_key(*key))
        entry = None if self.retime else self.wisdom.lookup(machine, call)
        if entry is not None and entry["path"] in candidates:
            stored = entry.get("seconds") or {}
            timed_alike = bool(stored) and set(stored) <= set(candidates)
            # a stored timing of these very paths is read by today's margins (_fastest), as a
            # timing made here would be
            found = _PathChoice(_fastest(stored) if timed_alike else entry["path"], "wisdom", entry.get("seconds"),
                                measured=True)
            if timed_alike:
                # as if timed here: calls of the same layer within AUTO_REUSE_FACTOR take it too
                layer = (tuple(x.shape[1:]), tuple(w.shape[1:]), stride, padding, block)
                self._timed.append((layer, x.shape[0], w.shape[0], key, found))
            if self.verbose:
                print(f"cpu device: {_describe_call(key)} runs {self._describe_choice(key, found)}", file=sys.stderr,
                      flush=True)
            return found
        choice = self._timed_choice(candidates, x, w, stride, padding, block, flops, declined)
        self.wisdom.store(machine, call, choice.path, choice.seconds)
        return choice

    def _forced_direct(self, path, x, w, stride, padding, block):
        declined = self._direct[path].declines(x.shape, w.shape, stride, padding, **_conv_shape(block))
        if declined:
            call = _describe_call((tuple(x.shape), tuple(w.shape), stride, padding, block))
            raise DeviceError(f"conv path direct-dnnl cannot run {call}: {declined}")
        return _PathChoice(path, "forced")

    def _direct_runs(self, path, x, w, stride, padding, block=None):
        """Whether this device has the direct `path` and oneDNN can run this call on it."""
        return path in self._direct and not self._direct[path].declines(x.shape, w.shape, stride, padding,
                                                                        **_conv_shape(block))

    def _timed_choice(self, candidates, x, w, stride, padding, block, flops, declined):
        """The fastest of `candidates` on this call, timed (or as timed for a call of the same
        layer, see AUTO_REUSE_FACTOR); `declined`: why FFT is not among them ('' where it is or
        was never asked)."""
        n, k = x.shape[0], w.shape[0]
        layer = (tuple(x.shape[1:]), tuple(w.shape[1:]), stride, padding, block)
        for timed_layer, timed_n, timed_k, timed_key, timed in self._timed:
            if (timed_layer == layer and max(k / timed_k, timed_k / k) <= AUTO_REUSE_FACTOR
                    and (k == timed_k or "winograd" not in candidates)
                    and (n == timed_n or n > timed_n and timed.path == "fft")):
                if timed.path in candidates:
                    return _PathChoice(timed.path, f"as timed for {_describe_call(timed_key)}", measured=True)
                # FFT won there but declines here (more kernels: spectra over the budget): the
                # fastest of the paths this call can take, by the same timing
                return _PathChoice(_fastest({p: s for p, s in timed.seconds.items() if p in candidates}),
                                   f"as timed for {_describe_call(timed_key)}, but fft declined: {declined}",
                                   measured=True)
        if self._choosing_untimed:
            raise _WouldTime()
        progress.info(f"cpu device: timing conv paths {', '.join(candidates)} on x {tuple(x.shape)} w {tuple(w.shape)}"
                      f"{f' stride {stride}' if stride != (1, 1) else ''}{f' padding {padding}' if any(padding) else ''}"
                      f" (once per call shape) ...")
        seconds = self._time_paths(candidates, x, w, stride, padding, block, flops)
        choice = _PathChoice(_fastest(seconds), "timed", seconds, measured=True)
        if choice.path != "fft":
            self._fft.drop(w)      # the FFT trial's spectra: never read again, yet refreshed at each update
        self._timed.append((layer, n, k, (tuple(x.shape), tuple(w.shape), stride, padding, block), choice))
        if self.verbose:
            key = (tuple(x.shape), tuple(w.shape), stride, padding, block)
            print(f"cpu device: {_describe_call(key)} runs {self._describe_choice(key, choice)}", file=sys.stderr,
                  flush=True)
        return choice

    def _time_paths(self, candidates, x, w, stride, padding, block, flops):
        """{path: seconds}: each path's median forward+backward run (with dX) on this call's x and
        w, over AUTO_TIMED_ROUNDS rounds or more (see AUTO_TIMED_MIN_SECONDS), the order
        alternating between rounds, after one warm-up run of each path that has not yet been
        timed on a call at least this big (its first use: Numba loading its kernels, its work
        buffers growing, which the drop after the first round must not mistake for its speed)."""
        b = np.zeros(w.shape[0], np.float32)

        dw_kept = np.empty(w.shape, np.float32)     # as a step's backward, into a kept dW

        def run(path):
            self._trial_path = path
            try:
                if path == "fft":
                    self._fft.forget(w)     # each run pays for the kernel spectra, as each step does
                if block is None:
                    y = self._conv2d(x, w, b, stride, padding)
                    self._conv2d_backward(x, w, np.zeros_like(y), stride, padding, True)
                else:
                    out, ctx = self._conv_block(x, w, b, block)
                    self._conv_block_backward(ctx, w, np.zeros_like(out), True, dw_kept, False)
            finally:
                self._trial_path = None

        for path in candidates:
            if self._warm_flops.get(path, 0.0) < flops:
                run(path)
                self._warm_flops[path] = flops
        runs, spent, r = {}, 0.0, 0
        while r < AUTO_TIMED_ROUNDS or (spent < AUTO_TIMED_MIN_SECONDS and r < AUTO_TIMED_MAX_ROUNDS):
            if r > 0:       # a path far behind after a round is not run again: it cannot win
                best = min(min(ts) for ts in runs.values())
                candidates = [p for p in candidates if min(runs[p]) <= AUTO_DROP_FACTOR * best]
            for path in candidates if r % 2 == 0 else candidates[::-1]:
                t = self._auto_timer(path, lambda: run(path))
                runs.setdefault(path, []).append(t)
                spent += t
            r += 1
        return {path: float(np.median(ts)) for path, ts in runs.items()}

    def _shifted(self, w_shape, stride=(1, 1)):
        """Whether the rule (or a forced path) puts a layer with weights w_shape (K, C, kh, kw) on
        the shifted-GEMM path, untimed: only at stride 1 (a row stride would break the contiguous
        blocks of rows its GEMMs read)."""
        if stride != (1, 1):
            return False
        if self.conv_path in ("auto", "fft", "winograd"):     # fft, winograd: where the path declines
            reduction = w_shape[1] * w_shape[3]
            return reduction >= SHIFTED_MIN_REDUCTION and w_shape[0] < SHIFTED_MAX_KERNELS_PER_REDUCTION * reduction
        return self.conv_path == "shifted"

    def _fft_declines(self, x_shape, w_shape, stride, padding):
        """'' where the FFT path takes this layer (stride 1, kernel spectra within
        fft_budget_bytes), else why not."""
        if stride != (1, 1):
            return f"stride {stride!r} (the FFT path is for stride 1)"
        return self._fft.declines(x_shape, w_shape, padding)
