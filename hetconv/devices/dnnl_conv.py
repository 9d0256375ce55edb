"""oneDNN's convolution primitives for the CPU device: a 2-D conv's forward, backward-data and
backward-weights on NCHW float32 arrays, in float32 or with bf16 operands (float32 sums and
float32 results), through oneDNN's C API over ctypes (the library devices/dnnl.py loads).

Why: on 3x3 layers with few channels (vgg-small, airbench94) the im2col and shifted paths spend
a third to half of a call expanding and folding the input around GEMMs too thin to reach their
peak; oneDNN's direct convolutions (its "brgconv" and "jit" kernels) read the input in place in a
channel-blocked layout. PyTorch's CPU convolutions, fp32 and bf16 autocast alike, are these very
primitives.

What a call costs beyond the primitive: the input, the weights and dY are reordered into the
primitive's blocked layout (bf16: rounded in the same pass, nearest-even as to_bf16), and Y, dX
and dW reordered back to NCHW/KCRS: one pass over each, as PyTorch's NCHW tensors pay. Primitives
are created once per call shape (oneDNN generates their code then: tens of milliseconds) and kept.

Threads: oneDNN's OpenMP build runs each primitive on omp_get_max_threads() of the calling thread
and fixes its blocking for that count when the primitive is created, so the count is set before
creating and before running (Dnnl.set_threads)."""
import atexit
import ctypes
from collections import OrderedDict

import numpy as np

from hetconv.devices.base import DeviceError, as_channels_last, empty_channels_last, is_channels_last, nhwc

# the C API's values (oneapi/dnnl/dnnl_types.h, dnnl_common_types.h: the same in every oneDNN 3.x)
_F32, _BF16 = 3, 2
_FORMAT_ANY = 1
_FORWARD_TRAINING = 64
_CONVOLUTION_DIRECT = 1
_CPU_ENGINE = 1
_STREAM_IN_ORDER = 1
_QUERY_IMPL_INFO_STR = 8
_QUERY_SRC_MD, _QUERY_DIFF_SRC_MD, _QUERY_WEIGHTS_MD, _QUERY_DIFF_WEIGHTS_MD = 129, 130, 131, 132
_QUERY_DST_MD, _QUERY_DIFF_DST_MD = 133, 134
ARG_SRC, ARG_DST, ARG_WEIGHTS, ARG_BIAS = 1, 17, 33, 41
ARG_DIFF_SRC, ARG_DIFF_DST, ARG_DIFF_WEIGHTS = 129, 145, 161
_SUCCESS, _UNIMPLEMENTED = 0, 3
_MAX_DIMS = 12
# Call shapes whose primitives and work buffers a device keeps (the least recently used go): a
# network has a few per layer (training, calibration's shares, evaluation's batches), each holding
# up to ~3 of the layer's feature maps in buffers (airbench94 at batch 256: ~40 MB for a 7x7 layer).
MAX_PLANS = 64

_Dims = ctypes.c_int64 * _MAX_DIMS


class _ExecArg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", ctypes.c_void_p)]


def _dims(values):
    return _Dims(*[int(v) for v in values])


class _Api:
    """The C functions this module calls, typed once per library."""

    def __init__(self, cdll):
        p, pp, i, dims = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, _Dims
        signatures = {
            "dnnl_engine_create": [pp, i, ctypes.c_size_t],
            "dnnl_stream_create": [pp, p, ctypes.c_uint],
            "dnnl_memory_desc_create_with_strides": [pp, i, dims, i, dims],
            "dnnl_memory_desc_create_with_tag": [pp, i, dims, i, i],
            "dnnl_memory_desc_destroy": [p],
            "dnnl_convolution_forward_primitive_desc_create": [pp, p, i, i, p, p, p, p, dims, dims, dims, dims, p],
            "dnnl_convolution_backward_data_primitive_desc_create": [pp, p, i, p, p, p, dims, dims, dims, dims, p, p],
            "dnnl_convolution_backward_weights_primitive_desc_create": [pp, p, i, p, p, p, p, dims, dims, dims, dims,
                                                                        p, p],
            "dnnl_reorder_primitive_desc_create": [pp, p, p, p, p, p],
            "dnnl_primitive_desc_query": [p, i, i, p],
            "dnnl_primitive_desc_destroy": [p],
            "dnnl_primitive_create": [pp, p],
            "dnnl_primitive_destroy": [p],
            "dnnl_primitive_execute": [p, p, i, ctypes.POINTER(_ExecArg)],
            "dnnl_memory_create": [pp, p, p, p],
            "dnnl_memory_set_data_handle": [p, p],
            "dnnl_memory_destroy": [p],
            "dnnl_engine_destroy": [p],
            "dnnl_stream_destroy": [p],
            "dnnl_stream_wait": [p],
        }
        for name, argtypes in signatures.items():
            f = getattr(cdll, name)
            f.argtypes, f.restype = argtypes, ctypes.c_int
            setattr(self, name[len("dnnl_"):], f)
        self.primitive_desc_query_md = cdll.dnnl_primitive_desc_query_md
        self.primitive_desc_query_md.argtypes, self.primitive_desc_query_md.restype = [p, i, i], p
        self.memory_desc_equal = cdll.dnnl_memory_desc_equal
        self.memory_desc_equal.argtypes, self.memory_desc_equal.restype = [p, p], ctypes.c_int
        self.memory_desc_get_size = cdll.dnnl_memory_desc_get_size
        self.memory_desc_get_size.argtypes, self.memory_desc_get_size.restype = [p], ctypes.c_size_t


class _Unsupported(Exception):
    """oneDNN has no implementation for this convolution here (status unimplemented)."""


def _check(status, what):
    if status == _UNIMPLEMENTED:
        raise _Unsupported(what)
    if status != _SUCCESS:
        raise DeviceError(f"oneDNN failed {what} (status {status})")


_exiting = []          # non-empty once the interpreter has begun to exit


@atexit.register
def _note_exit():
    _exiting.append(True)


class _Handle:
    """A C object destroyed with its owner, after what it was made on: `needs` (the engine's
    handle, for memories, primitives and the stream) stays alive until this one is destroyed, so
    however Python frees the owners, the engine goes last. Nothing is destroyed once the
    interpreter exits: module teardown frees objects in no dependency order, and a stream or
    memory destroyed after its engine reads freed memory; the process frees it all anyway."""

    def __init__(self, api, destroy, needs=None):
        self.value = ctypes.c_void_p()
        self._api, self._destroy, self._needs = api, destroy, needs

    def __del__(self):
        if self.value and not _exiting:
            try:
                getattr(self._api, self._destroy)(self.value)
            except Exception:
                pass
            self.value = ctypes.c_void_p()


class _Memory:
    """A memory descriptor (owned or borrowed from a primitive descriptor) with one memory object
    on it whose data pointer is set per call; `nbytes` is what a buffer in it holds."""

    def __init__(self, lib, md, owner=None):
        self._lib, self.md, self._owner = lib, md, owner      # owner: keeps a borrowed md alive
        self.nbytes = int(lib.api.memory_desc_get_size(md))
        self._memory = _Handle(lib.api, "memory_destroy", needs=lib.engine)
        _check(lib.api.memory_create(ctypes.byref(self._memory.value), md, lib.engine.value, None), "creating memory")
        self._same = {}                 # id of another memory -> whether its layout is this one's (fixed)

    def at(self, array):
        """The memory object, pointing at `array`: oneDNN reads or writes nbytes from its start, so
        anything but a C-contiguous array of at least that many bytes is refused here."""
        if not (isinstance(array, np.ndarray) and array.flags.c_contiguous and array.nbytes >= self.nbytes):
            raise ValueError(f"oneDNN's layout takes a C-contiguous array of {self.nbytes} bytes, got "
                             f"{getattr(array, 'nbytes', None)} bytes with shape {getattr(array, 'shape', None)}")
        _check(self._lib.api.memory_set_data_handle(self._memory.value, array.ctypes.data), "setting a data pointer")
        return self._memory.value

    def same_layout(self, other):
        same = self._same.get(id(other))
        if same is None:
            same = self._same[id(other)] = bool(self._lib.api.memory_desc_equal(self.md, other.md))
        return same


class _PlainDesc(_Handle):
    """An owned memory descriptor: a C-contiguous array of `shape` and `dtype` (with
    `channels_last`, an (N, C, H, W) one whose memory is NHWC), or the `any` layout of `dtype`
    the primitive chooses."""

    def __init__(self, api, shape, dtype, any_layout=False, channels_last=False):
        super().__init__(api, "memory_desc_destroy")
        if any_layout:
            _check(api.memory_desc_create_with_tag(ctypes.byref(self.value), len(shape), _dims(shape), dtype,
                                                   _FORMAT_ANY), "describing a tensor")
        else:
            strides = np.cumprod((1,) + tuple(shape[:0:-1]))[::-1]
            if channels_last:
                n, c, h, w = shape
                strides = (h * w * c, 1, w * c, c)
            _check(api.memory_desc_create_with_strides(ctypes.byref(self.value), len(shape), _dims(shape), dtype,
                                                       _dims(strides)), "describing a tensor")


class _Primitive:
    """A primitive descriptor and its primitive."""

    def __init__(self, lib, create_desc, what):
        api = lib.api
        self._lib = lib
        self.desc = _Handle(api, "primitive_desc_destroy", needs=lib.engine)
        create_desc(ctypes.byref(self.desc.value))
        self._primitive = _Handle(api, "primitive_destroy", needs=(lib.engine, self.desc))
        _check(api.primitive_create(ctypes.byref(self._primitive.value), self.desc.value), f"creating {what}")
        self.what = what

    def memory(self, query):
        return _Memory(self._lib, self._lib.api.primitive_desc_query_md(self.desc.value, query, 0), owner=self)

    def implementation(self):
        name = ctypes.c_char_p()
        _check(self._lib.api.primitive_desc_query(self.desc.value, _QUERY_IMPL_INFO_STR, 0, ctypes.byref(name)),
               "naming an implementation")
        return name.value.decode()

    def run(self, args):
        pairs = (_ExecArg * len(args))(*[_ExecArg(arg, memory) for arg, memory in args])
        _check(self._lib.api.primitive_execute(self._primitive.value, self._lib.stream.value, len(args), pairs),
               f"running {self.what}")
        # a SYCL build's stream runs the primitive asynchronously: its output (and the memory
        # objects' data pointers, reset for the next call) are ours again only once it is done
        _check(self._lib.api.stream_wait(self._lib.stream.value), f"waiting for {self.what}")


class _Reorder(_Primitive):
    def __init__(self, lib, src, dst):
        api = lib.api
        super().__init__(lib, lambda out: _check(api.reorder_primitive_desc_create(
            out, src.md, lib.engine.value, dst.md, lib.engine.value, None), "creating a reorder"), "a reorder")
        self.src, self.dst = src, dst

    def __call__(self, src_array, dst_array):
        self.run([(ARG_SRC, self.src.at(src_array)), (ARG_DST, self.dst.at(dst_array))])


class _Library:
    """One engine and stream on the loaded libdnnl."""

    def __init__(self, dnnl):
        self.dnnl = dnnl
        self.api = _Api(dnnl.cdll)
        self.engine = _Handle(self.api, "engine_destroy")
        _check(self.api.engine_create(ctypes.byref(self.engine.value), _CPU_ENGINE, 0), "creating a CPU engine")
        self.stream = _Handle(self.api, "stream_destroy", needs=self.engine)
        _check(self.api.stream_create(ctypes.byref(self.stream.value), self.engine.value, _STREAM_IN_ORDER),
               "creating a stream")


class ConvPlan:
    """The primitives of one call shape: x (N, C, H, W), w (K, C/groups, kh, kw), stride, padding,
    dilation, groups, in float32 or bf16 (for the thread count set when it is made); the reorders
    between the arrays' plain layouts and the primitives' own, and the buffers of the latter.
    oneDNN takes both natively: a grouped conv's weights as (groups, K/groups, C/groups, kh, kw),
    the same bytes as ours; its dilation counts the taps skipped (ours - 1).

    Layouts: by default the arrays are NCHW and each primitive chooses its own (a channel-blocked
    one), reordered to and from. With `channels_last`, the primitives run on NHWC maps (x, y and
    their gradients; the weights still in the layout each chooses) and y and dy are channels-last
    arrays: no reorder at all where x is one too (`x_channels_last`), else x and dx are NCHW and
    reordered. The forward adds the bias itself there (ARG_BIAS)."""

    def __init__(self, lib, x_shape, w_shape, stride, padding, bf16, dilation=(1, 1), groups=1,
                 channels_last=False, x_channels_last=False):
        api = lib.api
        self._lib = lib
        self.channels_last = bool(channels_last)
        n, c, h, wd = x_shape
        k, _, kh, kw = w_shape
        spans = ((kh - 1) * dilation[0] + 1, (kw - 1) * dilation[1] + 1)
        y_shape = (n, k, (h + 2 * padding[0] - spans[0]) // stride[0] + 1,
                   (wd + 2 * padding[1] - spans[1]) // stride[1] + 1)
        if groups > 1:
            w_shape = (groups, k // groups) + tuple(w_shape[1:])
        operand = _BF16 if bf16 else _F32
        plain = {"x": _PlainDesc(api, x_shape, _F32, channels_last=x_channels_last and channels_last),
                 "w": _PlainDesc(api, w_shape, _F32), "y": _PlainDesc(api, y_shape, _F32, channels_last=channels_last)}
        fixed = not channels_last           # NHWC maps where channels-last, else the primitive's choice
        chosen = {name: _PlainDesc(api, shape, dtype, any_layout=name in ("w", "dw") or fixed,
                                   channels_last=channels_last) for name, shape, dtype in
                  (("x", x_shape, operand), ("w", w_shape, operand), ("y", y_shape, _F32),
                   ("dx", x_shape, _F32), ("dw", w_shape, _F32), ("dy", y_shape, operand))}
        if channels_last:
            chosen["b"] = _PlainDesc(api, (k,), _F32)
        bias = chosen["b"].value if channels_last else None
        geometry = (_dims(stride), _dims((dilation[0] - 1, dilation[1] - 1)), _dims(padding), _dims(padding))
        self.forward = _Primitive(lib, lambda out: _check(api.convolution_forward_primitive_desc_create(
            out, lib.engine.value, _FORWARD_TRAINING, _CONVOLUTION_DIRECT, chosen["x"].value, chosen["w"].value,
            bias, chosen["y"].value, *geometry, None), "describing the forward convolution"), "the forward conv")
        self.backward_data = _Primitive(lib, lambda out: _check(api.convolution_backward_data_primitive_desc_create(
            out, lib.engine.value, _CONVOLUTION_DIRECT, chosen["dx"].value, chosen["w"].value, chosen["dy"].value,
            *geometry, self.forward.desc.value, None), "describing the backward-data convolution"),
            "the backward-data conv")
        self.backward_weights = _Primitive(
            lib, lambda out: _check(api.convolution_backward_weights_primitive_desc_create(
                out, lib.engine.value, _CONVOLUTION_DIRECT, chosen["x"].value, chosen["dw"].value, None,
                chosen["dy"].value, *geometry, self.forward.desc.value, None),
                "describing the backward-weights convolution"), "the backward-weights conv")
        self._descs = (plain, chosen)          # alive as long as the memory objects made on them
        self.plain = {name: _Memory(lib, d.value) for name, d in plain.items()}
        self.bias = _Memory(lib, chosen["b"].value) if channels_last else None
        f, bd, bw = self.forward, self.backward_data, self.backward_weights
        self.src = f.memory(_QUERY_SRC_MD)
        self.weights = f.memory(_QUERY_WEIGHTS_MD)
        self.dst = f.memory(_QUERY_DST_MD)
        self.bd_weights = bd.memory(_QUERY_WEIGHTS_MD)
        self.bd_diff_dst = bd.memory(_QUERY_DIFF_DST_MD)
        self.bd_diff_src = bd.memory(_QUERY_DIFF_SRC_MD)
        self.bw_src = bw.memory(_QUERY_SRC_MD)
        self.bw_diff_dst = bw.memory(_QUERY_DIFF_DST_MD)
        self.bw_diff_weights = bw.memory(_QUERY_DIFF_WEIGHTS_MD)
        self._reorders = {}
        self._buffers = {}
        # every reorder a call may run, created now: creating one generates its code (~1 ms),
        # which would otherwise land in the first call, the one the device's path choice times
        x, w, y = self.plain["x"], self.plain["w"], self.plain["y"]
        for src, dst in ((x, self.src), (w, self.weights), (self.dst, y), (y, self.bw_diff_dst), (x, self.bw_src),
                         (self.bw_diff_weights, w), (y, self.bd_diff_dst), (w, self.bd_weights),
                         (self.bd_diff_src, x)):
            if not src.same_layout(dst):
                self._reorder(src, dst)

    def implementations(self):
        return {"forward": self.forward.implementation(), "backward-data": self.backward_data.implementation(),
                "backward-weights": self.backward_weights.implementation()}

    def _reorder(self, src, dst):
        key = (id(src), id(dst))
        if key not in self._reorders:
            self._reorders[key] = _Reorder(self._lib, src, dst)
        return self._reorders[key]

    def reorder(self, src, dst, src_array, dst_array):
        """dst_array (in dst's layout) = src_array (in src's)."""
        self._reorder(src, dst)(src_array, dst_array)

    def operand(self, name, plain, memory, array, into=None):
        """`array` (in the plain layout `plain`, a key of self.plain) as the primitive's `memory`
        takes it: the array itself where the layouts agree and no `into` is given, else reordered
        into `into` or the plan's buffer `name`."""
        if into is None and memory.same_layout(self.plain[plain]):
            return array
        buf = self.buffer(name, memory) if into is None else into
        self.reorder(self.plain[plain], memory, array, buf)
        return buf

    def result(self, name, memory, plain, array):
        """Where a primitive writes its `memory` for `array` (plain layout `plain`): the array
        itself where the layouts agree, else the plan's buffer `name` (then see deliver)."""
        return array if memory.same_layout(self.plain[plain]) else self.buffer(name, memory)

    def deliver(self, memory, plain, written, array):
        """`array` = what the primitive wrote into `written` (a no-op where that was `array`)."""
        if written is not array:
            self.reorder(memory, self.plain[plain], written, array)

    def buffer(self, name, memory):
        """A work buffer for a tensor in `memory`'s layout, kept with the plan (never returned)."""
        buf = self._buffers.get(name)
        if buf is None:
            buf = self._buffers[name] = np.empty(memory.nbytes, np.uint8)
        return buf


class DirectConvs:
    """The oneDNN convolutions of one device: `forward` and `backward` on numpy arrays, float32 or
    bf16 operands (`bf16`), on `threads` threads. The maps they give are channels-last (the
    primitives run on NHWC, ConvPlan's `channels_last`), and they take x in either layout: a
    channels-last x is read in place, an NCHW one reordered; dx comes back in x's layout."""

    channels_last = True

    def __init__(self, dnnl, threads, bf16):
        self._dnnl = dnnl
        self._lib = None                # the engine and stream, made on first use (_engine)
        self.threads, self.bf16 = int(threads), bool(bf16)
        self._plans = OrderedDict()
        self._unsupported = {}

    @staticmethod
    def _key(x_shape, w_shape, stride, padding, dilation=(1, 1), groups=1, x_channels_last=False):
        return (tuple(x_shape), tuple(w_shape), tuple(stride), tuple(padding), tuple(dilation), int(groups),
                bool(x_channels_last))

    def _plan(self, x_shape, w_shape, stride, padding, dilation=(1, 1), groups=1, x_channels_last=False):
        key = self._key(x_shape, w_shape, stride, padding, dilation, groups, x_channels_last)
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
            return plan
        if key[:-1] in self._unsupported:
            raise DeviceError(self._unsupported[key[:-1]])
        self._engine()
        self._lib.dnnl.set_threads(self.threads)
        try:
            plan = ConvPlan(self._lib, x_shape, w_shape, stride, padding, self.bf16, tuple(dilation), int(groups),
                            channels_last=True, x_channels_last=x_channels_last)
        except _Unsupported as e:
            self._unsupported[key[:-1]] = f"oneDNN {self._lib.dnnl.version} has no " \
                                          f"{'bf16 ' if self.bf16 else ''}implementation of {e} here"
            raise DeviceError(self._unsupported[key[:-1]]) from None
        self._plans[key] = plan
        if len(self._plans) > MAX_PLANS:
            self._plans.popitem(last=False)
        return plan

    def _engine(self):
        """The library's engine and stream, or DeviceError saying why there is none."""
        if self._lib is None:
            lib = _library(self._dnnl)
            if isinstance(lib, str):
                raise DeviceError(lib)
            self._lib = lib
        return self._lib

    def declines(self, x_shape, w_shape, stride, padding, dilation=(1, 1), groups=1):
        """'' where oneDNN has this convolution (its primitives created, kept), else why not."""
        key = self._key(x_shape, w_shape, stride, padding, dilation, groups)
        if key[:-1] in self._unsupported:
            return self._unsupported[key[:-1]]
        try:
            self._plan_of_call(x_shape, w_shape, stride, padding, dilation, groups)
        except DeviceError as e:
            return str(e)
        return ""

    def implementations(self, x_shape, w_shape, stride, padding, dilation=(1, 1), groups=1):
        """{direction: oneDNN's implementation name} for this call shape."""
        return self._plan_of_call(x_shape, w_shape, stride, padding, dilation, groups).implementations()

    def forward(self, x, w, stride, padding, y, saved_src=None, dilation=(1, 1), groups=1, b=None):
        """y (N, K, Ho, Wo) float32, channels-last (see empty_channels_last) = conv(x, w) + b (no
        bias where b is None). With `saved_src` (a uint8 buffer of src_nbytes()) the input in the
        primitive's layout is left there for backward."""
        if _subsampled(w.shape, stride, padding, dilation):
            return self.forward(_subsample(x, stride), w, (1, 1), (0, 0), y, None, dilation, groups, b)
        x_cl = is_channels_last(x)
        plan = self._plan(x.shape, w.shape, stride, padding, dilation, groups, x_cl)
        self._lib.dnnl.set_threads(self.threads)
        src = plan.operand("src", "x", plan.src, _memory_of(x), into=saved_src)
        weights = plan.operand("weights", "w", plan.weights, w)
        bias = np.zeros(w.shape[0], np.float32) if b is None else np.ascontiguousarray(b, np.float32)
        plan.forward.run([(ARG_SRC, plan.src.at(src)), (ARG_WEIGHTS, plan.weights.at(weights)),
                          (ARG_BIAS, plan.bias.at(bias)), (ARG_DST, plan.dst.at(_nhwc_memory(y)))])
        return y

    def src_nbytes(self, x_shape, w_shape, stride, padding, dilation=(1, 1), groups=1, x_channels_last=False):
        """The bytes of the input in the forward primitive's layout (what forward can save); 0
        where that layout is x's own (backward reads x itself)."""
        if _subsampled(w_shape, stride, padding, dilation):
            return 0                        # backward subsamples x again
        plan = self._plan(x_shape, w_shape, stride, padding, dilation, groups, x_channels_last)
        return 0 if plan.src.same_layout(plan.plain["x"]) else plan.src.nbytes

    def backward(self, x, w, dy, stride, padding, need_dx, dw, saved_src=None, dilation=(1, 1), groups=1,
                 on_dx=None):
        """dx (N, C, H, W) in x's layout, or None where not asked; dW of this call into dw
        (K, C, kh, kw) float32 C-contiguous. dy is read channels-last (one copy where it is not).
        `saved_src`: forward's, for these x. The bias's gradient is the caller's (from the float32
        dY, as the other paths: a bf16 primitive would sum the rounded one). dX's primitive runs
        first, and dx goes to on_dx (where given) before dW's runs: the two are independent, so a
        worker's dX can travel while its dW computes."""
        if _subsampled(w.shape, stride, padding, dilation):
            return self._subsampled_backward(x, w, dy, stride, need_dx, dw, dilation, groups, on_dx)
        x_cl = is_channels_last(x)
        plan = self._plan(x.shape, w.shape, stride, padding, dilation, groups, x_cl)
        self._lib.dnnl.set_threads(self.threads)
        dy = _nhwc_memory(as_channels_last(dy))
        diff_dst = plan.operand("diff_dst", "y", plan.bw_diff_dst, dy)
        dx = None
        if need_dx:
            if plan.bd_diff_dst.same_layout(plan.bw_diff_dst):
                bd_dy = diff_dst
            else:
                bd_dy = plan.operand("bd_diff_dst", "y", plan.bd_diff_dst, dy)
            weights = plan.operand("bd_weights", "w", plan.bd_weights, w)
            dx = empty_channels_last(x.shape) if x_cl else np.empty(x.shape, np.float32)
            # one view of dx for both: deliver copies wherever `written` is another object, and a
            # second view of the same memory would be copied onto itself, a whole pass over dx
            dx_memory = _memory_of(dx)
            diff_src = plan.result("diff_src", plan.bd_diff_src, "x", dx_memory)
            plan.backward_data.run([(ARG_DIFF_DST, plan.bd_diff_dst.at(bd_dy)),
                                    (ARG_WEIGHTS, plan.bd_weights.at(weights)),
                                    (ARG_DIFF_SRC, plan.bd_diff_src.at(diff_src))])
            plan.deliver(plan.bd_diff_src, "x", diff_src, dx_memory)
            if on_dx is not None:
                on_dx(dx)
        if saved_src is not None and plan.bw_src.same_layout(plan.src):
            src = saved_src
        else:
            src = plan.operand("bw_src", "x", plan.bw_src, _memory_of(x))
        diff_weights = plan.result("diff_weights", plan.bw_diff_weights, "w", dw)
        plan.backward_weights.run([(ARG_SRC, plan.bw_src.at(src)), (ARG_DIFF_DST, plan.bw_diff_dst.at(diff_dst)),
                                   (ARG_DIFF_WEIGHTS, plan.bw_diff_weights.at(diff_weights))])
        plan.deliver(plan.bw_diff_weights, "w", diff_weights, dw)
        return dx


    def _subsampled_backward(self, x, w, dy, stride, need_dx, dw, dilation, groups, on_dx):
        """backward of a strided 1x1 conv as the unit-stride conv of the subsampled input: its dX
        is zero but at the pixels the stride reads (see _subsampled)."""
        whole = {}

        def scatter(dx_read):
            dx = empty_channels_last(x.shape) if is_channels_last(x) else np.empty(x.shape, np.float32)
            dx[...] = 0
            dx[:, :, ::stride[0], ::stride[1]] = dx_read
            whole["dx"] = dx
            if on_dx is not None:
                on_dx(dx)
        dx_read = self.backward(_subsample(x, stride), w, dy, (1, 1), (0, 0), need_dx, dw, None, dilation, groups,
                                scatter if need_dx else None)
        return whole.get("dx") if dx_read is not None else None

    def _plan_of_call(self, x_shape, w_shape, stride, padding, dilation, groups):
        """The plan a call of this shape runs (a strided 1x1 conv's is its unit-stride one's)."""
        if _subsampled(w_shape, stride, padding, dilation):
            n, c, h, w = x_shape
            x_shape, stride, padding = (n, c, -(-h // stride[0]), -(-w // stride[1])), (1, 1), (0, 0)
        return self._plan(x_shape, w_shape, stride, padding, dilation, groups)


def _subsampled(w_shape, stride, padding, dilation):
    """Whether a conv is 1x1, strided, unpadded: it reads every stride-th pixel and nothing else,
    so it runs as the unit-stride conv of those pixels. oneDNN 3.2's own strided 1x1 convolutions
    on NHWC (jit_avx2_1x1's backward-weights among them, on AVX2) overrun their scratchpad, a
    heap corruption glibc finds later or at exit (tests/test_channels_last.py runs every conv
    form under glibc's checking allocator); this takes them off that path for one strided copy
    of the input, the conv's output size."""
    return (tuple(w_shape[-2:]) == (1, 1) and tuple(stride) != (1, 1) and tuple(padding) == (0, 0)
            and tuple(dilation) == (1, 1))


def _subsample(x, stride):
    """The pixels a strided 1x1 conv reads, as a map of their own in x's layout."""
    picked = x[:, :, ::stride[0], ::stride[1]]
    return as_channels_last(picked) if is_channels_last(x) else np.ascontiguousarray(picked)


def _memory_of(a):
    """The C-contiguous array whose memory oneDNN reads for `a`: its NHWC view where it is
    channels-last, else `a` (which _Memory.at checks)."""
    return nhwc(a) if is_channels_last(a) else a


def _nhwc_memory(a):
    """The NHWC memory under a map the primitives read or write as NHWC (y, dy), or ValueError:
    a C-contiguous NCHW map of more than one channel and pixel lies otherwise."""
    m = nhwc(a)
    if not m.flags.c_contiguous:
        raise ValueError(f"a channels-last map was expected (see empty_channels_last), got strides {a.strides!r} "
                         f"for shape {a.shape!r}")
    return m


_libraries = {}


def _library(dnnl):
    """The library's engine and stream, or why it has none: a SYCL build's CPU engine is a SYCL
    CPU device, which only Intel's OpenCL CPU runtime and the Unified Runtime's OpenCL adapter
    provide (its GEMMs need neither)."""
    if dnnl.path not in _libraries:
        try:
            _libraries[dnnl.path] = _Library(dnnl)
        except DeviceError as e:
            why = f"oneDNN {dnnl.version} at {dnnl.path}: {e}"
            if dnnl.runtime == "SYCL":
                why += (" (a SYCL build's convolutions run on a SYCL CPU device: Intel's OpenCL CPU runtime, "
                        "named by OCL_ICD_FILENAMES, with the Unified Runtime's OpenCL adapter)")
            _libraries[dnnl.path] = why
    return _libraries[dnnl.path]
