"""Checkpoints: one .npz per save (no pickle), checksummed, the last K kept.

A save writes a temporary file (`.ckpt-*.npz.tmp`), fsyncs it, renames it into place and fsyncs
the directory, so a kill at any point leaves either the old set of checkpoints or the old set plus
the new one, never a half file under a checkpoint's name. Older checkpoints are deleted only
after the new one is safely in place.

Each checkpoint's meta holds a sha256 over every array (name, dtype, shape, bytes, in sorted
name order) and over the rest of the meta, checked on every load: a flipped bit, a truncated
copy or a file spliced from two checkpoints is refused instead of resuming from wrong weights.
Resuming from a directory takes the newest checkpoint that passes and reports those it skipped.

"Newest" is the most recently written, not the highest step: a run resumed from an earlier
checkpoint into the same directory starts a new timeline, and its checkpoints are the ones a
later `--resume DIR` must continue, and the ones retention keeps, even where an abandoned
timeline's files carry higher steps. Each save records its wall-clock time in the meta (covered
by the checksum); a file whose meta cannot be read is ordered by its modification time.
"""
import hashlib
import json
import os
import re
import tempfile
import time
import zipfile

import numpy as np

FORMAT = 3      # 3: each layer's state by name; 2: only (w, b, vw, vb), read too; 1: no checksum, refused
READABLE = (2, 3)
_NAME_RE = re.compile(r"^ckpt-step(\d+)\.npz$")
_TMP_RE = re.compile(r"^\.ckpt-.*\.npz\.tmp$")


class CheckpointError(ValueError):
    pass


def _digest(arrays, meta_body):
    """sha256 over every array in sorted name order, then the meta without its digest. Costs one
    pass over the bytes (about 1 GB/s on one core): a fraction of a second for the paper network."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        # length-prefixed fields, so no two different checkpoints hash the same byte stream
        for part in (name.encode(), a.dtype.str.encode(), repr(tuple(a.shape)).encode()):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
        h.update(a.nbytes.to_bytes(8, "little"))
        h.update(memoryview(a.reshape(-1)).cast("B") if a.size else b"")
    h.update(json.dumps(meta_body, sort_keys=True).encode())
    return h.hexdigest()


def save(directory, step, epoch, config, conv_params, fc_params, plan=None, keep=3, network=None, data=None):
    """conv_params / fc_params: per layer its state {name: array} (weights, BatchNorm statistics,
    the optimizer's slots), stored as "conv0.w", "conv0.bn1.running_mean", "fc1.w.exp_avg"... Keeps the `keep` newest checkpoints
    (this one always among them). Returns the path written."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1 checkpoint, got {keep}")
    os.makedirs(directory, exist_ok=True)
    arrays = {}
    for kind, params in (("conv", conv_params), ("fc", fc_params)):
        for i, state in enumerate(params):
            for name, a in state.items():
                arrays[f"{kind}{i}.{name}"] = a
    arrays = {name: np.ascontiguousarray(a) for name, a in arrays.items()}
    meta = {"format": FORMAT, "step": int(step), "epoch": int(epoch), "config": config.to_json(),
            "conv_layers": len(conv_params), "fc_layers": len(fc_params),
            "plan": plan.to_json() if plan is not None else None, "written_ns": time.time_ns()}
    if network is not None:
        meta["network"] = network                      # the NetSpec's JSON: resume needs no network flags
    if data is not None:
        meta["data"] = data                            # the data set's classes and normalisation: the model leaves
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


def _remove_old(directory, keep, just_written):
    """Delete all but the `keep` most recently written checkpoints, and temporary files left by a
    killed save. The one just written is never deleted; an abandoned timeline's checkpoints (higher
    steps, written before a resume from an earlier one) go before any of the new timeline's."""
    others = [p for p in checkpoints(directory) if os.path.abspath(p) != os.path.abspath(just_written)]
    for path in others[keep - 1:]:
        os.unlink(path)
    for name in os.listdir(directory):
        if _TMP_RE.match(name):
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:     # another cleaner got there first
                pass


def _peek_meta(path):
    """A checkpoint's meta dict, unchecked, or None where it cannot be read. Reads only the zip
    directory and the small meta member, not the arrays; the checksum is checked on load."""
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
    except Exception:                         # unreadable or truncated: load_newest_valid names it
        return None
    return meta if isinstance(meta, dict) else None


def _written_ns(path):
    """When a checkpoint was written: its meta's `written_ns`, else the file's modification time."""
    meta = _peek_meta(path)
    try:
        return int(meta["written_ns"])
    except (TypeError, KeyError, ValueError):  # unreadable, or written before `written_ns`
        try:
            return os.stat(path).st_mtime_ns
        except OSError:
            return 0


def saved_network(path):
    """The network (NetSpec JSON) stored in the checkpoint `path` (a file, or a directory's most
    recently written one whose meta reads), or None (none there, or written without one). Reads
    only metas; the checksum is checked when the checkpoint itself is loaded."""
    for candidate in (checkpoints(path) if os.path.isdir(path) else [path]):
        meta = _peek_meta(candidate)
        if meta is not None:
            return meta.get("network")
    return None


def checkpoints(directory):
    """Checkpoint paths in a directory, most recently written first, ties by step (temporary files
    are never listed)."""
    if not os.path.isdir(directory):
        return []
    found = [(int(m.group(1)), os.path.join(directory, name)) for name in os.listdir(directory)
             if (m := _NAME_RE.match(name))]
    return [path for _, _, path in sorted(((_written_ns(path), step, path) for step, path in found), reverse=True)]


def latest(directory):
    """The most recently written checkpoint in a directory (not checked), or None."""
    found = checkpoints(directory)
    return found[0] if found else None


def _read(path):
    """Returns (meta, conv_params, fc_params) of one file, or raises CheckpointError with a short
    reason (no path: the callers add it). A file that is not a .npz of plain arrays is named as
    such: numpy's advice to load pickled data unsafely is never passed on."""
    not_ours = "not a readable hetconv checkpoint: "
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        if not magic.startswith(b"PK"):         # np.load would take it for a .npy or a pickle
            raise CheckpointError(not_ours + ("the file is empty" if not magic else
                                              "a checkpoint is a .npz (zip) file, this one is not"))
        with np.load(path, allow_pickle=False) as z:
            if "meta" not in z.files:
                raise CheckpointError(not_ours + f"a .npz without the 'meta' entry every checkpoint has "
                                                 f"(its entries: {', '.join(sorted(z.files)[:8]) or 'none'})")

            def entry(name):
                try:
                    return z[name]
                except ValueError:              # an object (pickled) entry, refused by allow_pickle=False
                    raise CheckpointError(not_ours + f"entry {name!r} is not a plain numeric array") from None

            meta = json.loads(bytes(entry("meta")).decode())
            if not isinstance(meta, dict):
                raise CheckpointError("meta is not a JSON object")
            if meta.get("format") not in READABLE:
                raise CheckpointError(f"checkpoint format {meta.get('format')!r}, expected {FORMAT}"
                                      + (" (format 1 has no checksum; resume it with the version that wrote it)"
                                         if meta.get("format") == 1 else ""))
            arrays = {name: entry(name) for name in z.files if name != "meta"}
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, EOFError) as e:
        raise CheckpointError(f"truncated or not a zip ({type(e).__name__}: {e})") from None
    except Exception as e:
        raise CheckpointError(f"not a readable hetconv checkpoint ({type(e).__name__}: {e})") from None
    body = {k: v for k, v in meta.items() if k != "sha256"}
    if meta.get("sha256") != _digest(arrays, body):
        raise CheckpointError("checksum mismatch: the file changed after it was written")
    try:
        params = {kind: [_layer_arrays(arrays, f"{kind}{i}.", meta["format"]) for i in range(meta[f"{kind}_layers"])]
                  for kind in ("conv", "fc")}
    except KeyError as e:
        raise CheckpointError(f"not a readable hetconv checkpoint (missing {e})") from None
    meta["path"] = path
    return meta, params["conv"], params["fc"]


# format 2 named SGD's momentum vw and vb
_FORMAT2_NAMES = {"vw": "w.momentum_buffer", "vb": "b.momentum_buffer"}


def _layer_arrays(arrays, prefix, form):
    """{name: array} of one layer, its prefix ("conv0.") taken off; KeyError where it has no weights."""
    state = {name[len(prefix):]: a for name, a in arrays.items() if name.startswith(prefix)}
    if form == 2:
        state = {_FORMAT2_NAMES.get(name, name): a for name, a in state.items()}
    for name in ("w", "b"):
        if name not in state:
            raise KeyError(prefix + name)
    return state


def load_newest_valid(path):
    """`path` is a checkpoint file or a directory. A file must be valid. For a directory, the most
    recently written checkpoint that reads and passes its checksum. Returns (meta, conv_params, fc_params,
    skipped); skipped lists (file name, reason) for each newer checkpoint passed over, newest
    first. Raises CheckpointError naming the file (or every file tried) when there is none."""
    if not os.path.isdir(path):
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: no such checkpoint file")
        try:
            return (*_read(path), [])
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None
    candidates = checkpoints(path)
    if not candidates:
        raise CheckpointError(f"{path}: no checkpoint (ckpt-stepNNNNNNN.npz) in this directory")
    skipped = []
    for candidate in candidates:
        try:
            return (*_read(candidate), skipped)
        except CheckpointError as e:
            skipped.append((os.path.basename(candidate), str(e)))
    raise CheckpointError(f"{path}: no valid checkpoint among {len(skipped)}: "
                          + "; ".join(f"{name}: {reason}" for name, reason in skipped))


def load(path):
    """Returns (meta dict, conv_params, fc_params). `path` may be a checkpoint or a directory
    (its newest valid checkpoint)."""
    meta, conv_params, fc_params, _ = load_newest_valid(path)
    return meta, conv_params, fc_params
