"""Hostile data set files, each built small on disk, each loaded by `load_dataset` in a process of
its own: how long it ran, its peak resident memory, and what it said. The suite's
tests/test_hostile_data.py loads the same files and holds the loader to its bounds; this script
measures them for docs/reliability.md's "### Data sets" table.

    python bench/hostile_data.py --out docs                        # this checkout: docs/hostile-data.json
    python bench/hostile_data.py --out docs --before /path/to/old  # and the same files on another checkout
    python bench/hostile_data.py --render docs/hostile-data.json   # rewrite the table from the JSON only

A `--before` checkout runs each file under a 2 GB address-space limit and a 30 s deadline, so an
unbounded reader fails fast instead of taking the machine (its row says which limit it met).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import platform
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

_CHUNK = 1 << 20
MB = 1 << 20


# ---- compressed streams of mostly zeros, built without compressing them byte by byte ------------

def deflate_zeros(prefix: bytes, zeros: int, suffix: bytes = b"", unit: bytes = bytes(_CHUNK)) -> tuple[bytes, int]:
    """(raw deflate stream, CRC-32) of prefix + `zeros` bytes (repeats of `unit`) + suffix. After a
    full flush the compressor starts afresh, so one compressed unit repeated is the stream of the
    repeats: a gigabyte costs one unit's compression and a CRC pass."""
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    parts = [c.compress(prefix) + c.flush(zlib.Z_FULL_FLUSH)]
    block = c.compress(unit) + c.flush(zlib.Z_FULL_FLUSH)
    count, rest = divmod(zeros, len(unit))
    parts += [block] * count
    parts.append(c.compress(unit[:rest] + suffix) + c.flush())
    crc = zlib.crc32(prefix)
    for _ in range(count):
        crc = zlib.crc32(unit, crc)
    crc = zlib.crc32(suffix, zlib.crc32(unit[:rest], crc))
    return b"".join(parts), crc


def gzip_zeros(path: Path, prefix: bytes, zeros: int, suffix: bytes = b"", unit: bytes = bytes(_CHUNK)):
    body, crc = deflate_zeros(prefix, zeros, suffix, unit)
    size = len(prefix) + zeros + len(suffix)
    path.write_bytes(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff" + body + struct.pack("<II", crc, size & 0xFFFFFFFF))


def write_zip(path: Path, members: list[tuple[str, bytes, int, int]], directory_copies: int = 1):
    """A zip of deflated members (name, deflate stream, crc, uncompressed size), written by hand:
    its central directory lists them `directory_copies` times over."""
    out, central = bytearray(), bytearray()
    for name, body, crc, size in members:
        raw = name.encode()
        central += struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, 8, 0, 0x21, crc, len(body), size,
                               len(raw), 0, 0, 0, 0, 0, len(out)) + raw
        out += struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 8, 0, 0x21, crc, len(body), size, len(raw), 0) + raw
        out += body
    start, entries = len(out), len(members) * directory_copies
    out += bytes(central) * directory_copies
    out += struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, min(entries, 0xFFFF), min(entries, 0xFFFF),
                       len(central) * directory_copies, start, 0)
    path.write_bytes(bytes(out))


def npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, array)
    return buf.getvalue()


def npy_member(key: str, array: np.ndarray) -> tuple[str, bytes, int, int]:
    raw = npy_bytes(array)
    body, crc = deflate_zeros(raw, 0)
    return f"{key}.npy", body, crc, len(raw)


def npy_header(shape, dtype=np.uint8) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                               "fortran_order": False, "shape": tuple(shape)})
    return buf.getvalue()


def small_npz_members(n=12, size=8, labels=None):
    rng = np.random.default_rng(0)
    y = np.arange(n) % 4 if labels is None else np.asarray(labels)
    return [npy_member("x_train", rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8)),
            npy_member("y_train", y),
            npy_member("x_test", rng.integers(0, 256, (4, size, size, 3), dtype=np.uint8)),
            npy_member("y_test", np.arange(4))]


# ---- the hostile files ---------------------------------------------------------------------------

CIFAR10_BATCHES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


def cifar_nested_labels(root: Path) -> Path:
    import pickle
    labels = [0]
    for _ in range(30):
        labels = [labels, labels]                     # memoised once, referenced twice: 2**30 leaves
    batch = pickle.dumps({b"data": np.zeros((1, 3072), np.uint8), b"labels": labels}, protocol=2)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for name in CIFAR10_BATCHES:
        (folder / name).write_bytes(batch)
    return folder


def cifar_shared_bytes(root: Path) -> Path:
    import pickle
    batch = pickle.dumps({b"data": np.zeros((1, 3072), np.uint8), b"labels": [bytes(MB)] * 10000}, protocol=2)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for name in CIFAR10_BATCHES:
        (folder / name).write_bytes(batch)
    return folder


def cifar_pax_header(root: Path) -> Path:
    info = tarfile.TarInfo("cifar-10-batches-py/data_batch_1")
    info.type, info.size = tarfile.XHDTYPE, 256 * MB
    root.mkdir(parents=True)
    gzip_zeros(root / "cifar-10-python.tar.gz", info.tobuf(tarfile.USTAR_FORMAT), info.size + 1024)
    return root / "cifar-10-python.tar.gz"


def cifar_many_members(root: Path) -> Path:
    header = tarfile.TarInfo("cifar-10-batches-py/readme.html").tobuf(tarfile.USTAR_FORMAT)   # empty files
    root.mkdir(parents=True)
    gzip_zeros(root / "cifar-10-python.tar.gz", b"", 1_000_000 * 512, bytes(1024), unit=header * 2000)
    return root / "cifar-10-python.tar.gz"


def idx_gzip_bomb(root: Path) -> Path:
    root.mkdir(parents=True)
    images = 640_000                                  # 640000 28x28 images: 502 MB of zeros
    gzip_zeros(root / "train-images-idx3-ubyte.gz", struct.pack(">IIII", 0x803, images, 28, 28), images * 784)
    for name, header, n in (("train-labels-idx1-ubyte.gz", struct.pack(">II", 0x801, images), images),
                            ("t10k-images-idx3-ubyte.gz", struct.pack(">IIII", 0x803, 10, 28, 28), 7840),
                            ("t10k-labels-idx1-ubyte.gz", struct.pack(">II", 0x801, 10), 10)):
        gzip_zeros(root / name, header, n)
    return root


def npz_zip_bomb(root: Path) -> Path:
    root.mkdir(parents=True)
    n = 1 << 20                                       # 1M 32x32 grey images: 1 GB of zeros in 1 MB
    header = npy_header((n, 32, 32))
    body, crc = deflate_zeros(header, n * 1024)
    write_zip(root / "bomb.npz", [("x_train.npy", body, crc, len(header) + n * 1024),
                                  npy_member("y_train", np.zeros(n, np.int64)),
                                  npy_member("x_test", np.zeros((4, 32, 32), np.uint8)),
                                  npy_member("y_test", np.zeros(4, np.int64))])
    return root / "bomb.npz"


def npz_directory(root: Path) -> Path:
    root.mkdir(parents=True)
    write_zip(root / "entries.npz", small_npz_members(), directory_copies=125_000)   # 500,000 entries
    return root / "entries.npz"


def npz_label(label: int):
    def write(root: Path) -> Path:
        root.mkdir(parents=True)
        write_zip(root / f"label{label}.npz", small_npz_members(2001, labels=[i % 10 for i in range(2000)] + [label]))
        return root / f"label{label}.npz"
    return write


def png_bomb(root: Path) -> Path:
    width, height = 10_000, 9_000                     # 90M pixels: past Pillow's limit, short of twice it

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    rows = height * (1 + 3 * width)                   # a filter byte and RGB zeros per row
    body, _ = deflate_zeros(b"", rows)
    stream = b"\x78\xda" + body + struct.pack(">I", ((rows % 65521) << 16) | 1)      # zlib: header, adler32
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) \
        + chunk(b"IDAT", stream) + chunk(b"IEND", b"")
    for split in ("train", "test"):
        (root / split / "cat").mkdir(parents=True)
        (root / split / "cat" / "0.png").write_bytes(png)
    return root


def folder_fifo(root: Path) -> Path:
    for split in ("train", "test"):
        (root / split / "cat").mkdir(parents=True)
        os.mkfifo(root / split / "cat" / "0.png")
    return root


def data_fifo(root: Path) -> Path:
    root.mkdir(parents=True)
    os.mkfifo(root / "data.npz")
    return root / "data.npz"


# name -> (builder, what the file is, what happened before as users reported it, or None: measured)
CASES = {
    "cifar-nested-labels": (cifar_nested_labels, "CIFAR-10 directory of 3.5 KB batches whose labels are [a, a] "
                            "nested 30 deep (shared references)",
                            "as reported: 26 deep took 28 s and 4.2 GB before an error; 30 deep grew to 23.5 GB and "
                            "was killed by the kernel"),
    "cifar-shared-bytes": (cifar_shared_bytes, "CIFAR-10 directory of 1 MB batches whose labels are 10000 references "
                           "to one 1 MB bytes object", None),
    "cifar-pax-header": (cifar_pax_header, "cifar-10-python.tar.gz (0.3 MB) whose first member's pax header declares "
                         "256 MB", None),
    "cifar-many-members": (cifar_many_members, "cifar-10-python.tar.gz (0.6 MB) of 1,000,000 empty members", None),
    "idx-gzip-bomb": (idx_gzip_bomb, "MNIST directory whose train-images-idx3-ubyte.gz (0.5 MB) holds 640000 "
                      "images, 502 MB of zeros", None),
    "npz-zip-bomb": (npz_zip_bomb, ".npz (1 MB) whose x_train.npy deflates to 1 GB of zeros", None),
    "npz-directory": (npz_directory, ".npz (29 MB) whose zip directory lists 500,000 entries", None),
    "npz-label-250": (npz_label(250), ".npz of labels 0..9 and one 250, no classes array",
                      "as reported: trained 251 classes to 0.000 accuracy, exit 0, no word"),
    "npz-label-10": (npz_label(10), ".npz of labels 0..9 and one 10, no classes array",
                     "as reported: trained 11 classes, exit 0, no word"),
    "png-bomb": (png_bomb, "image folder of one 10000x9000 RGB PNG of zeros (0.3 MB): past Pillow's pixel limit, "
                 "short of twice it", None),
    "folder-fifo": (folder_fifo, "image folder whose train/cat/0.png is a fifo", None),
    "data-fifo": (data_fifo, "--data naming a fifo", None),
}

# Run in the child: load every spec given, one after another, a JSON line each.
CHILD = r"""
import json, resource, sys, time
limit = int(sys.argv[2])
if limit:                                         # set here, not in a preexec_fn: that forces a fork
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
sys.path.insert(0, sys.argv[1])


def peak_mb():
    # this process's own high-water mark: /proc's VmHWM starts afresh at exec, where getrusage's
    # maxrss keeps what the forked parent held (800 MB from a pytest that has loaded torch)
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


from hetconv.data import load_dataset
for spec in sys.argv[3:]:
    start = time.perf_counter()
    try:
        ds = load_dataset(spec)
        outcome, said = "loaded", "; ".join(getattr(ds, "notes", ())) or repr(ds)
    except Exception as e:
        outcome, said = type(e).__name__, str(e)
    print(json.dumps({"spec": spec, "outcome": outcome, "said": said[:400], "lines": len(said.splitlines()),
                      "seconds": round(time.perf_counter() - start, 3), "peak_rss_mb": round(peak_mb(), 1)}),
          flush=True)
"""


def run_child(code: str, specs: list[str], timeout: float, address_space: int | None = None) -> tuple[list, dict]:
    """Load `specs` with the checkout at `code` in one child: (its records, how it ended: exit code,
    seconds, its peak RSS (its own, as it last reported it; where it was killed first, wait4's,
    which also counts what it held as a fork of this process), whether the deadline killed it, its
    last line of stderr)."""
    env = {**os.environ, "PYTHONPATH": code}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-c", CHILD, code, str(address_space or 0), *specs], stdout=out,
                                stderr=err, text=True, env=env, start_new_session=True)
        killed = False
        while True:                                   # reaped here, not by Popen: wait4 gives its own rusage
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - start > timeout:
                os.killpg(proc.pid, signal.SIGKILL)
                killed = True
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.02)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        records = [json.loads(line) for line in out.read().splitlines() if line.startswith("{")]
        tail = err.read().strip().splitlines()
    peak = records[-1]["peak_rss_mb"] if records and not killed else round(usage.ru_maxrss / 1024, 1)
    end = {"exit_code": proc.returncode, "seconds": round(time.perf_counter() - start, 2), "killed": killed,
           "peak_rss_mb": peak, "stderr_tail": tail[-1][:300] if tail else ""}
    return records, end


def measure(code: str, specs: dict[str, str], timeout: float, address_space: int | None) -> dict:
    """Each case in a child of its own: its record, or how the child ended; the child's peak RSS."""
    rows = {}
    for name, spec in specs.items():
        records, end = run_child(code, [spec], timeout, address_space)
        rows[name] = records[0] if records else {
            "outcome": "killed at the deadline" if end["killed"] else f"exit {end['exit_code']}",
            "said": end["stderr_tail"], "seconds": end["seconds"]}
        rows[name]["peak_rss_mb"] = end["peak_rss_mb"]
    return rows


def build_all(root: Path, names=None) -> dict[str, str]:
    return {name: str(CASES[name][0](root / name)) for name in (names or CASES)}


# ---- the table ------------------------------------------------------------------------------------

BEGIN, END = "<!-- hostile-data: begin (bench/hostile_data.py writes this part) -->", "<!-- hostile-data: end -->"


def _cell(row: dict | None, work: str) -> str:
    if row is None:
        return ""
    said = " ".join(row["said"].replace(work + "/", "").split()).replace("|", "\\|")     # one line, paths short
    said = said[:220] + ("..." if len(said) > 220 else "")
    rss = f", peak RSS {row['peak_rss_mb']:.0f} MB" if row.get("peak_rss_mb") else ""
    return f"{row['outcome']} after {row['seconds']:.2f} s{rss}: {said}" if said else \
        f"{row['outcome']} after {row['seconds']:.2f} s{rss}"


def render(results: dict) -> str:
    lines = [BEGIN, "### Data sets", "",
             f"Machine: {results['machine']}. Command: `{results['command']}`. Each file is built small on disk by "
             f"`bench/hostile_data.py` and loaded by `load_dataset` in a process of its own; peak RSS is that "
             f"process's whole (Python and numpy: {results['baseline_rss_mb']:.0f} MB loading nothing)."
             + (f" Before: the same files on {results['before_code']}, under a 2 GB address-space limit and a "
                f"{results['timeout_s']:.0f} s deadline; or as users reported it." if results.get("before_code") else ""),
             "", "| file | before | now |", "|---|---|---|"]
    for name, (_, what, reported) in CASES.items():
        if name in results["now"]:
            before = reported or _cell(results.get("before", {}).get(name), results["work"])
            lines.append(f"| {what} | {before} | {_cell(results['now'][name], results['work'])} |")
    lines += ["", "`tests/test_hostile_data.py` loads the same files in one child process and holds each to a "
              "one-line refusal (or note), 20 s, and the child to 600 MB.", END]
    return "\n".join(lines)


def write_doc(doc: Path, table: str):
    """Put `table` in place of the last one written, else at the head of "## Hostile files"."""
    text = doc.read_text() if doc.exists() else ""
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + table + text[text.index(END) + len(END):]
    else:
        if "## Hostile files" not in text:
            text = text.rstrip("\n") + "\n\n## Hostile files\n"
        head, tail = text.split("## Hostile files", 1)
        text = head + "## Hostile files\n\n" + table + "\n\n" + tail.lstrip("\n")
    doc.write_text(text.rstrip("\n") + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="docs", help="where hostile-data.json goes and whose reliability.md is updated")
    p.add_argument("--before", default="", help="another checkout to load the same files with")
    p.add_argument("--render", default="", help="only rewrite the table from this JSON")
    p.add_argument("--timeout", type=float, default=30.0)
    args = p.parse_args()
    if args.render:
        write_doc(Path(args.render).parent / "reliability.md", render(json.loads(Path(args.render).read_text())))
        return
    repo = str(Path(__file__).resolve().parent.parent)
    work = Path(tempfile.mkdtemp(prefix="hetconv-hostile-data-"))
    try:
        specs = build_all(work)
        _, baseline = run_child(repo, [], 60)
        results = {"command": "python bench/hostile_data.py --out docs" + (" --before CHECKOUT" if args.before else ""),
                   "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                              f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') >> 30} GiB",
                   "work": str(work), "timeout_s": args.timeout, "baseline_rss_mb": baseline["peak_rss_mb"],
                   "now": measure(repo, specs, args.timeout, None)}
        if args.before:
            results["before_code"] = "the checkout before these bounds"
            results["before"] = measure(args.before, specs, args.timeout, 2 << 30)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = Path(args.out)
    (out / "hostile-data.json").write_text(json.dumps(results, indent=1) + "\n")
    write_doc(out / "reliability.md", render(results))


if __name__ == "__main__":
    main()
