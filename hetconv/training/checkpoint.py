"""Checkpoints: one .npz per save (no pickle), checksummed, the last K kept.

A save writes a temporary file (`.ckpt-*.npz.tmp`), fsyncs it, renames it into place and fsyncs
the directory, so a kill at any point leaves either the old set of checkpoints or the old set plus
the new one, never a half file under a checkpoint's name. Older checkpoints are deleted only
after the new one is safely in place.

Each checkpoint's meta holds a sha256 over every array (name, dtype, shape, bytes, in sorted
name order) and over the rest of the meta, checked on every load: a flipped bit, a truncated
copy or a file spliced from two checkpoints is refused instead of resuming from wrong weights.
The sha256 detects accidents, not intent: whoever hands a user a file can write a matching one.
So every read is also bounded and checked against the network the file claims, before anything
is allocated: the zip directory's declared sizes against caps (the meta) and against the arrays
that network needs (`expected_arrays`, the one table of what a checkpoint holds); each member read
through zipfile's reader, which never inflates past the size declared; each .npy header's dtype
and shape checked before its data is read; then every value finite.

Order among checkpoints is the run's own: each save takes the next number of the directory's
counter (one more than the highest its checkpoints hold, kept in each meta and covered by the
checksum), so the newest is the one written last, whatever the wall clock says (an NTP correction or a VM restored from a snapshot can
step it back). A run resumed from an earlier checkpoint into the same directory thus starts a new
timeline whose checkpoints are the ones a later `--resume DIR` continues and retention keeps, even
where an abandoned timeline's files carry higher steps. Checkpoints written before the counter come
after every one with it, by step; files whose meta cannot be read come last. Sorting a directory
reads only metas, never arrays.
"""
import hashlib
import json
import os
import re
import tempfile
import time
import zipfile
from typing import NamedTuple

import numpy as np
from numpy.lib import format as npy

from hetconv.devices.wisdom import checked_records
from hetconv.update import SLOTS, slot_name
from hetconv.geometry import IMAGE_SHAPE, NUM_CLASSES, ConvSpec
from hetconv.net import NetSpec
from hetconv.training.config import Config

FORMAT = 3      # 3: each layer's state by name; 2: only (w, b, vw, vb), still read; 1: no checksum, refused
READABLE = (2, 3)
_NAME_RE = re.compile(r"^ckpt-step(\d+)\.npz$")
_TMP_RE = re.compile(r"^\.ckpt-.*\.npz\.tmp$")

# A real meta is a few KB, most of it the plan (about 300 bytes per worker and conv layer): 2 MB
# holds 64 workers on 100 layers. Parsing JSON costs up to ~22x its bytes (a list of empty
# lists), so this also bounds the meta's objects under 50 MB.
META_MAX_BYTES = 2 << 20
NPY_HEADER_MAX = 4096               # numpy writes ~128 bytes; its own reader allows 10000
DEFLATE_MAX_RATIO = 1032            # deflate cannot expand further: a member declaring more lies
_CHUNK = 1 << 20                    # bytes read per call: what a read holds beside its array


class CheckpointError(ValueError):
    pass


class Expected(NamedTuple):
    """One array a checkpoint of a network must hold."""
    dtype: np.dtype
    shape: tuple
    zero: bool = False              # all zeros: the bias (and its momentum) of a layer without one


class Loaded(NamedTuple):
    """What load_newest_valid returns: the meta (with "path", the file read), per conv and
    linear layer its state {name: array}, and the newer files passed over [(file name, reason)]."""
    meta: dict
    conv: list
    fc: list
    skipped: list


def expected_arrays(spec, optimizer="sgd", form=FORMAT):
    """{name: Expected} every checkpoint of the network `spec` (a NetSpec) trained with
    `optimizer` holds: per conv layer i, `convI.` and each name of its ConvSpec.state_layout (the
    conv's w and b, its tail's BatchNorm weights, biases and running statistics, and the
    optimizer's slots of every parameter that trains), then per BatchNorm between blocks (a graph's
    NetSpec.norm_nodes, numbered on after the conv layers) its NormSpec.state_layout's names; per
    linear layer i, `fcI.` w, b and the
    slots of w (and of b where the layer has one). A bias a layer does not have is zero. Format 2
    held only w, b and SGD's momentum vw, vb. The one place this set is written down: every reader
    (resume, eval, classify, export) checks against it."""
    f32 = np.dtype(np.float32)
    table = {}
    conv_shapes, fc_shapes = spec.parameter_shapes()
    if form == 2:
        for kind, shapes in (("conv", conv_shapes), ("fc", fc_shapes)):
            for i, (w_shape, b_shape) in enumerate(shapes):
                bias = b_shape or (w_shape[0],)
                table[f"{kind}{i}.w"] = table[f"{kind}{i}.vw"] = Expected(f32, tuple(w_shape))
                table[f"{kind}{i}.b"] = table[f"{kind}{i}.vb"] = Expected(f32, tuple(bias), zero=b_shape is None)
        return table
    for i, layer in enumerate(spec.conv_layers()):
        conv = ConvSpec.from_layer(layer)
        for a in conv.state_layout(optimizer):
            table[f"conv{i}.{a.name}"] = Expected(np.dtype(a.dtype), tuple(a.shape), zero=a.name == "b" and not conv.bias)
    for i, norm in enumerate(spec.norm_specs(), start=len(conv_shapes)):
        for a in norm.state_layout(optimizer):
            table[f"conv{i}.{a.name}"] = Expected(np.dtype(a.dtype), tuple(a.shape))
    for i, (w_shape, b_shape) in enumerate(fc_shapes):
        table[f"fc{i}.w"] = Expected(f32, tuple(w_shape))
        table[f"fc{i}.b"] = Expected(f32, (w_shape[0],), zero=b_shape is None)
        for param, shape in (("w", w_shape), ("b", b_shape)):
            for slot in SLOTS[optimizer] if shape else ():
                table[f"fc{i}.{slot_name(param, slot)}"] = Expected(f32, tuple(shape))
    return table


def network_of(meta):
    """The NetSpec a checkpoint's meta claims: the stored one, or for a checkpoint written before
    checkpoints kept it, the run's paper-family flags on CIFAR-shaped images (every run of that
    time). Raises CheckpointError when there is none to be had."""
    if "network" in meta:
        try:
            return NetSpec.from_json(meta["network"])
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"its stored network cannot be read: {e}") from None
    config = meta.get("config")
    if not isinstance(config, dict):
        raise CheckpointError("it has neither the network nor the run's config")
    try:
        cfg = Config.from_json(config)
        if cfg.net:
            raise CheckpointError(f"it has no stored network, and its config names --net {cfg.net}, which is "
                                  f"not read back from a checkpoint")
        return cfg.network(cfg.input_shape(IMAGE_SHAPE), NUM_CLASSES).spec
    except CheckpointError:
        raise
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"it has no stored network, and its config does not describe one: {e}") from None


def _digest(arrays, meta_body):
    """sha256 over every array in sorted name order, then the meta without its digest. Costs one
    pass over the bytes (about 1 GB/s on one core): a fraction of a second for the paper network."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.asarray(arrays[name], order="C")     # ascontiguousarray would make a count 1-d
        # length-prefixed fields, so no two different checkpoints hash the same byte stream
        for part in (name.encode(), a.dtype.str.encode(), repr(tuple(a.shape)).encode()):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
        h.update(a.nbytes.to_bytes(8, "little"))
        h.update(memoryview(a.reshape(-1)).cast("B") if a.size else b"")
    h.update(json.dumps(meta_body, sort_keys=True).encode())
    return h.hexdigest()


def save(directory, step, epoch, config, conv_params, fc_params, plan=None, keep=3, network=None, data=None,
         conv_paths=None, micro_batches=None):
    """conv_params / fc_params: per layer its state {name: array} (weights, BatchNorm statistics,
    the optimizer's slots), stored as "conv0.w", "conv0.bn1.running_mean", "fc1.w.exp_avg"... (the
    names expected_arrays lists). `conv_paths`: each device's conv path record (the engine's
    conv_path_records), kept in the meta as far as devices.wisdom.checked_records keeps it, so
    `--resume` runs the same paths (recorded_conv_paths). `micro_batches`: the count the cost
    model chose for `plan` (auto), which a resume onto the same workers runs again. Keeps the
    `keep` newest checkpoints (this one always among them). Returns the path written."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1 checkpoint, got {keep}")
    os.makedirs(directory, exist_ok=True)
    arrays = {}
    for kind, params in (("conv", conv_params), ("fc", fc_params)):
        for i, state in enumerate(params):
            for name, a in state.items():
                arrays[f"{kind}{i}.{name}"] = a
    arrays = {name: np.asarray(a, order="C") for name, a in arrays.items()}
    order = _next_order(_listing(directory))
    meta = {"format": FORMAT, "step": int(step), "epoch": int(epoch), "config": config.to_json(),
            "conv_layers": len(conv_params), "fc_layers": len(fc_params), "order": order,
            "plan": plan.to_json() if plan is not None else None,
            "micro_batches": int(micro_batches) if micro_batches else None,
            "written_ns": time.time_ns()}          # information only: the clock can step back
    if network is not None:
        meta["network"] = network                      # the NetSpec's JSON: resume needs no network flags
    if data is not None:
        meta["data"] = data                            # the data set's classes and normalisation: the model leaves
    if conv_paths:
        meta["conv_paths"] = checked_records(conv_paths)[0]    # the paths each device ran: --resume runs them again
    # round-trip through JSON first so the digest is over exactly what load() will parse back
    meta = json.loads(json.dumps(meta))
    meta["sha256"] = _digest(arrays, meta)
    arrays["meta"] = np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8)
    path = os.path.join(directory, f"ckpt-step{int(step):07d}.npz")
    fd, tmp = tempfile.mkstemp(prefix=".ckpt-", suffix=".npz.tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_directory(directory)           # the rename itself survives a power cut only after this
    _remove_old(directory, keep, path)
    return path


def _fsync_directory(directory):
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- order: the directory's counter ---------------------------------------------------------------

def _next_order(listing):
    """The directory's counter, one on: one more than the highest order among its checkpoints'
    metas. The newest checkpoint holds the highest, so each save is numbered after every one
    before it; a damaged file whose number is reused sorts after the readable ones anyway."""
    return max([entry.order for entry in listing if entry.order is not None], default=0) + 1


class _Entry(NamedTuple):
    path: str
    step: int                       # from the file name
    order: int | None               # the meta's counter; None: written before it, or unreadable
    problem: str | None             # why its meta cannot be read, else None

    def key(self):
        rank = 0 if self.problem else 1 if self.order is None else 2
        return rank, self.order or 0, self.step


def _listing(directory):
    """Every checkpoint file in `directory` as an _Entry, newest first: by the directory's
    counter, those without it after, by step, and those whose meta cannot be read last. Reads
    each file's zip directory and meta only (bounded), never an array."""
    if not os.path.isdir(directory):
        return []
    entries = []
    for name in os.listdir(directory):
        m = _NAME_RE.match(name)
        if not m:
            continue
        path = os.path.join(directory, name)
        try:
            with _open_zip(path) as zf:
                meta = _read_meta(zf)
            order = meta.get("order")
            if order is not None and (isinstance(order, bool) or not isinstance(order, int) or order < 0):
                raise CheckpointError(f"its order {json.dumps(order)[:40]} is not a counter (an integer >= 0)")
            entries.append(_Entry(path, int(m.group(1)), order, None))
        except CheckpointError as e:
            entries.append(_Entry(path, int(m.group(1)), None, str(e)))
    return sorted(entries, key=_Entry.key, reverse=True)


def checkpoints(directory):
    """Checkpoint paths in a directory, newest first (see _listing); temporary files are never
    listed."""
    return [entry.path for entry in _listing(directory)]


def latest(directory):
    """The newest checkpoint in a directory (not checked), or None."""
    found = checkpoints(directory)
    return found[0] if found else None


def _remove_old(directory, keep, just_written):
    """Delete all but the `keep` newest checkpoints, and temporary files left by a killed save.
    The one just written is never deleted; an abandoned timeline's checkpoints (higher steps,
    written before a resume from an earlier one) go before any of the new timeline's."""
    others = [p for p in checkpoints(directory) if os.path.abspath(p) != os.path.abspath(just_written)]
    for path in others[keep - 1:]:
        os.unlink(path)
    for name in os.listdir(directory):
        if _TMP_RE.match(name):
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:     # another cleaner got there first
                pass


# ---- reading: bounded before anything is allocated ------------------------------------------------

_NOT_OURS = "not a readable hetconv checkpoint: "


def _size_text(n):
    for unit, scale in (("TB", 1 << 40), ("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} bytes"


def _open_zip(path):
    """The file as a ZipFile (its central directory read, nothing inflated), or CheckpointError.
    A file that is not a .npz of plain arrays is named as such: numpy's advice to load pickled
    data unsafely is never passed on."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        if not magic.startswith(b"PK"):         # np.load would take it for a .npy or a pickle
            raise CheckpointError(_NOT_OURS + ("the file is empty" if not magic else
                                               "a checkpoint is a .npz (zip) file, this one is not"))
        return zipfile.ZipFile(path)
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, EOFError) as e:
        raise CheckpointError(f"truncated or not a zip ({type(e).__name__}: {e})") from None
    except (OSError, ValueError, NotImplementedError, OverflowError) as e:
        raise CheckpointError(f"not a readable hetconv checkpoint ({type(e).__name__}: {e})") from None


def _member(zf, name):
    """The zip directory's entry for array `name` (stored as name.npy), checked as an entry
    before any of it is read."""
    try:
        info = zf.getinfo(name + ".npy")
    except KeyError:
        raise CheckpointError(f"not a readable hetconv checkpoint (missing {name!r})") from None
    if info.flag_bits & 0x1:
        raise CheckpointError(f"entry {name!r} is encrypted")
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise CheckpointError(f"entry {name!r} is compressed with zip method {info.compress_type}; "
                              f"expected stored or deflated")
    ratio = 1 if info.compress_type == zipfile.ZIP_STORED else DEFLATE_MAX_RATIO
    if info.file_size > info.compress_size * ratio:
        raise CheckpointError(f"entry {name!r} declares {info.file_size} bytes from {info.compress_size} "
                              f"stored, more than {'storing' if ratio == 1 else 'deflate'} can give")
    return info


def _header(f, name):
    """The .npy header of the member open as `f`: (dtype, shape, fortran order, header bytes).
    Reads at most NPY_HEADER_MAX bytes."""
    try:
        version = npy.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = npy.read_array_header_1_0(f, max_header_size=NPY_HEADER_MAX)
        elif version == (2, 0):
            shape, fortran, dtype = npy.read_array_header_2_0(f, max_header_size=NPY_HEADER_MAX)
        else:
            raise ValueError(f".npy version {version[0]}.{version[1]}, expected 1.0 or 2.0")
    except (ValueError, TypeError, SyntaxError, EOFError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"entry {name!r} has no readable .npy header ({type(e).__name__}: {e})") from None
    return dtype, shape, fortran, f.tell()


def _read_into(f, out, name):
    """Fill the array `out` from `f` in _CHUNK reads: nothing but `out` and one chunk is held."""
    view = memoryview(out.reshape(-1)).cast("B") if out.size else memoryview(b"")
    done = 0
    while done < len(view):
        chunk = f.read(min(_CHUNK, len(view) - done))
        if not chunk:
            raise CheckpointError(f"entry {name!r} ends after {done} of its {len(view)} bytes (truncated)")
        view[done:done + len(chunk)] = chunk
        done += len(chunk)


def _read_meta(zf):
    """The meta dict of an open checkpoint, read within META_MAX_BYTES; format and the fields
    every reader uses checked."""
    names = [info.filename for info in zf.infolist()]
    if "meta.npy" not in names:
        entries = sorted(n[:-4] if n.endswith(".npy") else n for n in names)
        raise CheckpointError(_NOT_OURS + f"a .npz without the 'meta' entry every checkpoint has "
                                          f"(its entries: {', '.join(entries[:8]) or 'none'})")
    info = _member(zf, "meta")
    if info.file_size > META_MAX_BYTES + NPY_HEADER_MAX:
        raise CheckpointError(f"its meta declares {_size_text(info.file_size)}, more than the "
                              f"{_size_text(META_MAX_BYTES)} a checkpoint's meta may hold")
    try:
        with zf.open(info) as f:
            dtype, shape, _, header = _header(f, "meta")
            if dtype.hasobject:
                raise CheckpointError(_NOT_OURS + "entry 'meta' is not a plain numeric array")
            if dtype != np.uint8 or len(shape) != 1:
                raise CheckpointError(f"its meta is {dtype} {shape}, expected uint8 text")
            if header + shape[0] != info.file_size:
                raise CheckpointError(f"its meta's header says {shape[0]} bytes, its zip entry {info.file_size - header}")
            raw = f.read(shape[0])
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, NotImplementedError) as e:
        raise CheckpointError(f"its meta cannot be read ({type(e).__name__}: {e})") from None
    if len(raw) != shape[0]:
        raise CheckpointError(f"its meta ends after {len(raw)} of its {shape[0]} bytes (truncated)")
    try:
        meta = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"its meta is not JSON text ({type(e).__name__})") from None
    if not isinstance(meta, dict):
        raise CheckpointError("meta is not a JSON object")
    if meta.get("format") not in READABLE:
        raise CheckpointError(f"checkpoint format {json.dumps(meta.get('format'))[:40]}, expected {FORMAT}"
                              + (" (format 1 has no checksum; resume it with the version that wrote it)"
                                 if meta.get("format") == 1 else ""))
    for key in ("step", "epoch", "conv_layers", "fc_layers"):
        value = meta.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointError(f"its meta's {key} is {json.dumps(value)[:40]}, expected an integer >= 0")
    return meta


def _memory_bytes():
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):   # not known here: no cap beyond the file's own
        return None


def _read_arrays(zf, table):
    """{name: array} for every name in `table`, each checked against its Expected: the zip
    directory first (names, declared sizes: nothing read), then per member its .npy header
    (dtype, shape) before its data, then its values (finite; zero where the table says)."""
    present = {info.filename[:-4] if info.filename.endswith(".npy") else info.filename for info in zf.infolist()}
    present.discard("meta")
    if len(zf.infolist()) != len(present) + 1:
        raise CheckpointError("its zip directory lists an entry twice")
    extra = sorted(present - set(table))
    if extra:
        raise CheckpointError(f"entry {extra[0]!r} is not an array of its network (expected "
                              f"{', '.join(list(table)[:4])}, ...)")
    total = sum(int(np.prod(e.shape)) * e.dtype.itemsize for e in table.values())
    memory = _memory_bytes()
    if memory and total > memory:
        raise CheckpointError(f"its network needs {_size_text(total)} of arrays, more than this machine's "
                              f"{_size_text(memory)} of memory")
    infos = {}
    for name, want in table.items():                         # the whole directory before any data
        info = infos[name] = _member(zf, name)
        nbytes = int(np.prod(want.shape)) * want.dtype.itemsize
        if not nbytes + 10 <= info.file_size <= nbytes + NPY_HEADER_MAX:
            raise CheckpointError(f"entry {name!r} declares {info.file_size} bytes; its network's "
                                  f"{want.dtype} {want.shape} takes {nbytes} and a header")
    arrays = {}
    for name, want in table.items():
        info = infos[name]
        try:
            with zf.open(info) as f:
                dtype, shape, fortran, header = _header(f, name)
                if dtype.hasobject:
                    raise CheckpointError(_NOT_OURS + f"entry {name!r} is not a plain numeric array")
                if dtype != want.dtype or tuple(shape) != want.shape or fortran:
                    raise CheckpointError(f"array {name} is {dtype} {tuple(shape)}"
                                          f"{' (Fortran order)' if fortran else ''}; its network needs "
                                          f"{want.dtype} {want.shape}")
                if header + int(np.prod(shape)) * dtype.itemsize != info.file_size:
                    raise CheckpointError(f"entry {name!r}: its header and its zip entry disagree on its size")
                a = np.empty(want.shape, want.dtype)       # untouched pages cost nothing until read into
                _read_into(f, a, name)
        except CheckpointError:
            raise
        except (zipfile.BadZipFile, EOFError) as e:
            raise CheckpointError(f"truncated or not a zip ({type(e).__name__}: {e})") from None
        except (OSError, ValueError, NotImplementedError) as e:
            raise CheckpointError(f"entry {name!r} cannot be read ({type(e).__name__}: {e})") from None
        arrays[name] = a
    return arrays


def _check_values(arrays, table):
    """Every value finite; zero where the table says (a bias the layer does not have)."""
    for name, want in table.items():
        a = arrays[name]
        if not np.isfinite(a).all():
            raise CheckpointError(f"array {name} holds NaN or inf")
        if want.zero and a.any():
            raise CheckpointError(f"array {name} is not zero, but its layer has no bias")


def _read(path):
    """Returns (meta, conv_params, fc_params) of one file, or raises CheckpointError with a short
    reason (no path: the callers add it)."""
    with _open_zip(path) as zf:
        meta = _read_meta(zf)
        spec = network_of(meta)
        conv_shapes, fc_shapes = spec.parameter_shapes()
        conv_states = len(conv_shapes) + len(spec.norm_nodes())     # BatchNorms between blocks after the convs
        if (meta["conv_layers"], meta["fc_layers"]) != (conv_states, len(fc_shapes)):
            raise CheckpointError(f"its meta says {meta['conv_layers']} conv and {meta['fc_layers']} linear "
                                  f"layers, its network has {conv_states} and {len(fc_shapes)}")
        try:
            config = Config.from_json(meta["config"]).validate()
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(f"its config is not a run's config: {type(e).__name__}: {e}") from None
        table = expected_arrays(spec, config.optimizer, meta["format"])
        arrays = _read_arrays(zf, table)
    body = {k: v for k, v in meta.items() if k != "sha256"}
    if meta.get("sha256") != _digest(arrays, body):
        raise CheckpointError("checksum mismatch: the file changed after it was written")
    _check_values(arrays, table)
    params = {kind: [_layer_arrays(arrays, f"{kind}{i}.", meta["format"]) for i in range(meta[f"{kind}_layers"])]
              for kind in ("conv", "fc")}
    meta["path"] = path
    return meta, params["conv"], params["fc"]


# format 2 named SGD's momentum vw and vb
_FORMAT2_NAMES = {"vw": "w.momentum_buffer", "vb": "b.momentum_buffer"}


def _layer_arrays(arrays, prefix, form):
    """{name: array} of one layer, its prefix ("conv0.") taken off, in today's names."""
    state = {name[len(prefix):]: a for name, a in arrays.items() if name.startswith(prefix)}
    if form == 2:
        state = {_FORMAT2_NAMES.get(name, name): a for name, a in state.items()}
    return state


def load_newest_valid(path):
    """`path` is a checkpoint file or a directory. A file must be valid. For a directory, the
    newest checkpoint that reads, passes its checksum and fits its network. Returns Loaded
    (meta, conv_params, fc_params, skipped); skipped lists (file name, reason) for each newer
    checkpoint passed over, newest first, then each unreadable one of a higher step (it may hold
    later training). Raises CheckpointError naming the file (or every file tried) when there is
    none."""
    if not os.path.isdir(path):
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: no such checkpoint file")
        try:
            return Loaded(*_read(path), [])
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None
    listing = _listing(path)
    if not listing:
        raise CheckpointError(f"{path}: no checkpoint (ckpt-stepNNNNNNN.npz) in this directory")
    skipped = []
    for entry in listing:
        if entry.problem:
            continue
        try:
            meta, conv, fc = _read(entry.path)
        except CheckpointError as e:
            skipped.append((os.path.basename(entry.path), str(e)))
            continue
        unreadable = [(os.path.basename(e.path), e.problem) for e in listing if e.problem and e.step > meta["step"]]
        return Loaded(meta, conv, fc, skipped + unreadable)
    skipped += [(os.path.basename(e.path), e.problem) for e in listing if e.problem]
    raise CheckpointError(f"{path}: no valid checkpoint among {len(skipped)}: "
                          + "; ".join(f"{name}: {reason}" for name, reason in skipped))


def recorded_conv_paths(meta):
    """The conv path records a checkpoint's meta holds (what each device chose by measuring, see
    save), checked and bounded (devices.wisdom.checked_records): (records, '' or why some or all
    were left out). A checkpoint without them (written before they were kept) has none; a
    malformed one never stops a resume: its records are left out, and said."""
    return checked_records(meta.get("conv_paths") if isinstance(meta, dict) else None)


def load(path):
    """Returns (meta dict, conv_params, fc_params). `path` may be a checkpoint or a directory
    (its newest valid checkpoint)."""
    meta, conv_params, fc_params, _ = load_newest_valid(path)
    return meta, conv_params, fc_params
