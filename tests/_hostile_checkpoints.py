"""Hostile checkpoints, made on purpose, and a measurement of what each command does with them.

    python tests/_hostile_checkpoints.py DIR      # writes the files into DIR, then one JSON line
                                                  # per (file, command): exit status, seconds,
                                                  # peak RSS growth, the first line of stderr
    python tests/_hostile_checkpoints.py DIR --each   # the same, each (file, command) in its own process

The measurement runs each command's main() in this one process, one after another, after a
warm-up on a good checkpoint (so imports and caches are not counted): its RSS growth is how far
the process's peak (getrusage's ru_maxrss) rose during that command. Run with PYTHONPATH set to
the checkout to measure. tests/test_checkpoint_files.py runs it in a subprocess and checks the rows.
"""
import contextlib
import io
import json
import os
import resource
import struct
import sys
import time
import zipfile
import zlib

import numpy as np
from numpy.lib import format as npy

# a conv of 4 5x5 kernels on 3x32x32 images, pooled to 4x14x14, then a linear layer to 10 classes:
# the synthetic set's shape, so a good checkpoint evaluates and resumes on it
LAYERS = [{"type": "conv", "out_channels": 4, "kernel": 5}, {"type": "relu"}, {"type": "maxpool", "kernel": 2},
          {"type": "flatten"}, {"type": "linear", "out_features": 10}]
NETWORK = {"input_shape": [3, 32, 32], "classes": 10, "layers": LAYERS}
DATA = {"name": "synthetic", "classes": [str(i) for i in range(10)], "image_shape": [3, 32, 32],
        "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]}
MB = 1 << 20


def good_checkpoint(directory):
    """A valid checkpoint of NETWORK on a small synthetic set. Returns its path."""
    from hetconv.net import NetSpec
    from hetconv.training import checkpoint
    from hetconv.training.config import Config
    spec = NetSpec.from_json(NETWORK)
    conv, fc = spec.init_params(np.random.default_rng(0))
    with_momentum = [[{"w": w, "b": b, "w.momentum_buffer": np.zeros_like(w), "b.momentum_buffer": np.zeros_like(b)}
                      for w, b in part] for part in (conv, fc)]
    cfg = Config(conv="4", fc="", ksize=5, synthetic_train=64, synthetic_test=16, batch_size=16, steps=1)
    return checkpoint.save(str(directory), 1, 0, cfg, *with_momentum, network=spec.to_json(), data=DATA)


def _members(path):
    """{name: (bytes, compress type)} of a trusted zip (one this module wrote)."""
    with zipfile.ZipFile(path) as z:
        return {info.filename: z.read(info) for info in z.infolist()}


def write_zip(path, members):
    """A zip written as told: members are (name, data as stored, method, crc, declared size), so
    the directory may say what the data is not. No zip64: every size under 4 GB."""
    out, central = bytearray(), bytearray()
    for name, data, method, crc, size in members:
        n = name.encode()
        offset = len(out)
        out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, method, 0, 0x21, crc, len(data), size, len(n), 0)
        out += n + data
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, method, 0, 0x21, crc, len(data), size,
                               len(n), 0, 0, 0, 0, 0, offset) + n
    cd_offset = len(out)
    out += central + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(members), len(members), len(central),
                                 cd_offset, 0)
    with open(path, "wb") as f:
        f.write(out)


def npy_header(descr, shape):
    buf = io.BytesIO()
    npy.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False, "shape": shape})
    return buf.getvalue()


def deflated_zeros(header, n):
    """(raw deflate stream, crc) of `header` then n zero bytes, made in well under a second: after
    a full flush the compressor starts afresh, so every further MB of zeros deflates to the same
    bytes, computed once."""
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    parts = [c.compress(header) + c.flush(zlib.Z_FULL_FLUSH)]
    block = c.compress(bytes(MB)) + c.flush(zlib.Z_FULL_FLUSH)
    crc = zlib.crc32(header)
    zeros = bytes(MB)
    for _ in range(n // MB):
        parts.append(block)
        crc = zlib.crc32(zeros, crc)
    tail = bytes(n % MB)
    parts.append(c.compress(tail) + c.flush())
    return b"".join(parts), zlib.crc32(tail, crc)


def _stored(name, data):
    return (name, data, zipfile.ZIP_STORED, zlib.crc32(data), len(data))


def forge(path, out, change_arrays=None, change_meta=None):
    """A copy of checkpoint `path` with arrays or meta changed and its sha256 made to match."""
    from hetconv.training import checkpoint
    with np.load(path, allow_pickle=False) as z:
        arrays = {name: z[name].copy() for name in z.files}
    meta = json.loads(bytes(arrays.pop("meta")).decode())
    if change_arrays:
        change_arrays(arrays)
    if change_meta:
        change_meta(meta)
    meta.pop("sha256")
    meta["sha256"] = checkpoint._digest(arrays, meta)
    with open(out, "wb") as f:
        np.savez(f, **arrays, meta=np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8))
    return out


def make_hostile(directory):
    """{case: path} of every hostile file, written into `directory` (well under a second each),
    beside a good checkpoint in directory/good."""
    os.makedirs(directory, exist_ok=True)
    good = good_checkpoint(os.path.join(directory, "good"))
    members = _members(good)
    files = {}

    # a 300 KB file whose meta.npy is deflated: 300 MB of zeros, declared honestly
    path = files["meta deflated to 300 KB, 300 MB inflated"] = os.path.join(directory, "meta-300mb.npz")
    header = npy_header("|u1", (300 * MB,))
    data, crc = deflated_zeros(header, 300 * MB)
    write_zip(path, [_stored(n, d) for n, d in members.items() if n != "meta.npy"]
              + [("meta.npy", data, zipfile.ZIP_DEFLATED, crc, len(header) + 300 * MB)])

    # the same stream, its directory entry declaring a small meta: the declared size lies
    path = files["meta declaring 2 KB, inflating to 300 MB"] = os.path.join(directory, "meta-lies.npz")
    write_zip(path, [_stored(n, d) for n, d in members.items() if n != "meta.npy"]
              + [("meta.npy", data, zipfile.ZIP_DEFLATED, crc, 2048)])

    # an array 100 000 times what the network needs (1.25 GB of zeros in ~1.3 MB)
    path = files["fc0.w deflated, 1.25 GB inflated"] = os.path.join(directory, "array-big.npz")
    header = npy_header("<f4", (10, 784 * 40_000))
    size = 10 * 784 * 40_000 * 4
    big, big_crc = deflated_zeros(header, size)
    write_zip(path, [_stored(n, d) for n, d in members.items() if n != "fc0.w.npy"]
              + [("fc0.w.npy", big, zipfile.ZIP_DEFLATED, big_crc, len(header) + size)])

    # a meta claiming a network of 10^9 kernels: 300 GB of arrays
    files["network of 10^9 kernels in the meta"] = forge(
        good, os.path.join(directory, "network-huge.npz"),
        change_meta=lambda m: m["network"]["layers"][0].update(out_channels=10**9))
    files["conv0.b float64, checksum consistent"] = forge(
        good, os.path.join(directory, "bias-float64.npz"),
        change_arrays=lambda a: a.update({"conv0.b": a["conv0.b"].astype(np.float64)}))
    files["fc0.b and its momentum (1,) float64"] = forge(
        good, os.path.join(directory, "fc-shape-1.npz"),
        change_arrays=lambda a: a.update({"fc0.b": np.ones(1), "fc0.b.momentum_buffer": np.zeros(1)}))
    files["NaN in fc0.w"] = forge(good, os.path.join(directory, "nan.npz"),
                                  change_arrays=lambda a: a["fc0.w"].__setitem__((0, 0), np.nan))
    return files


def _peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024       # Linux: KB


def _measure(tool, call):
    before, t0 = _peak_mb(), time.perf_counter()
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = call()
        except SystemExit as e:
            code = e.code
        except BaseException as e:                   # a traceback is a finding too
            code = f"raised {type(e).__name__}"
            print(f"{type(e).__name__}: {e}", file=sys.stderr)
    lines = err.getvalue().strip().splitlines()
    return {"tool": tool, "code": code, "seconds": round(time.perf_counter() - t0, 3),
            "rss_growth_mb": round(_peak_mb() - before, 1), "stderr_lines": len(lines),
            "said": lines[0][:300] if lines else ""}


def _tools(directory):
    from hetconv.cli import coordinator, evaluate, export
    out = os.path.join(directory, "model.npz")
    return {
        "hetconv-eval": lambda p: evaluate.main([p, "--threads", "1"]),
        "hetconv-export --format npz": lambda p: export.main([p, "--format", "npz", "--out", out]),
        "--resume": lambda p: coordinator.main(["--local", "--threads", "1", "--resume", p]),
    }


def measure(directory, only=None):
    """One dict per (hostile file, command), as the module's docstring says; `only`: (case,
    command) to measure that one alone (the files already made)."""
    from hetconv.training import checkpoint
    files = make_hostile(directory) if only is None else hostile_paths(directory)
    good = os.path.join(directory, "good")
    tools = _tools(directory)
    if only is not None:
        files, tools = {only[0]: files[only[0]]}, {only[1]: tools[only[1]]}
    for call in tools.values():                      # warm-up: imports, caches, a real run
        _measure("warm-up", lambda: call(good))
    rows = []
    for case, path in files.items():
        for tool, call in tools.items():
            rows.append({"case": case, "file": os.path.basename(path), **_measure(tool, lambda: call(path))})
    if only is not None:
        return rows
    sorting = os.path.join(directory, "sorting")          # a directory holding each hostile file and the good one
    os.makedirs(sorting)
    for i, path in enumerate([*files.values(), checkpoint.latest(good)]):
        os.link(path, os.path.join(sorting, f"ckpt-step{i + 1:07d}.npz"))
    rows.append({"case": "a directory of all of them and a good one", "file": "sorting/",
                 **_measure("sort the directory", lambda: len(checkpoint.checkpoints(sorting)) and 0)})
    rows.append({"case": "a directory of all of them and a good one", "file": "sorting/",
                 **_measure("hetconv-eval", lambda: evaluate_dir(sorting))})
    return rows


def evaluate_dir(path):
    from hetconv.cli import evaluate
    return evaluate.main([path, "--threads", "1", "--json"])


def hostile_paths(directory):
    names = {"meta deflated to 300 KB, 300 MB inflated": "meta-300mb.npz",
             "meta declaring 2 KB, inflating to 300 MB": "meta-lies.npz",
             "fc0.w deflated, 1.25 GB inflated": "array-big.npz",
             "network of 10^9 kernels in the meta": "network-huge.npz",
             "conv0.b float64, checksum consistent": "bias-float64.npz",
             "fc0.b and its momentum (1,) float64": "fc-shape-1.npz", "NaN in fc0.w": "nan.npz"}
    return {case: os.path.join(directory, name) for case, name in names.items()}


def measure_each(directory):
    """Each (file, command) in a fresh process, so no case's peak hides another's: for a code
    whose cases allocate (the ru_maxrss high-water mark only rises)."""
    import subprocess
    make_hostile(directory)
    for case in hostile_paths(directory):
        for tool in ("hetconv-eval", "hetconv-export --format npz", "--resume"):
            subprocess.run([sys.executable, __file__, directory, "--only", case, tool], check=False)


if __name__ == "__main__":
    if "--each" in sys.argv:
        measure_each(sys.argv[1])
    else:
        only = tuple(sys.argv[3:5]) if "--only" in sys.argv else None
        for row in measure(sys.argv[1], only):
            print(json.dumps(row), flush=True)
