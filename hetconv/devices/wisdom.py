"""Conv path "wisdom" (as FFTW's): the path a CPU device's timing chose for a call shape, kept per
machine so that later runs on that machine run the same paths without timing them again.

Why: the conv paths (im2col, shifted GEMMs, FFT, oneDNN's) round differently, and the fastest one
depends on the load of the moment, so two runs of one command that each timed their paths could
train to different bits. A path measured once and reused is the same path every time.

- Where: `$HETCONV_CACHE/conv-paths-3.json`; HETCONV_CACHE defaults to `$XDG_CACHE_HOME/hetconv`,
  else `~/.cache/hetconv` (`wisdom_path`). `machine_wisdom()` is that file, one Wisdom object per
  path and process.
- Key: the machine (`machine_key`: the CPU's model and the ISA flags that pick BLAS and oneDNN
  kernels, numpy's BLAS, oneDNN's version or none, Numba's version, and the device's threads,
  precision, `conv_path` option and the paths it has) and the call shape (`call_key`: x's and
  w's shapes, stride, padding, and the fused block or none). A device with other threads or
  another precision is another machine: its timing is its own.
- Written atomically (a temporary file in the same folder, then os.replace), merged under an
  advisory lock (fcntl.flock on `conv-paths-3.json.lock`) with what the file holds by then, so two
  processes storing at once lose nothing; the folder is synced after the rename, which a power
  cut would otherwise undo. A cache: a file that cannot be read is ignored with one line on
  stderr naming it, and a folder that cannot be written is said once; the run goes on either way,
  timing what it would have reused. A file that is not, as a whole, a wisdom file of this FORMAT
  (too big, not JSON, another format: another version's or not hetconv's) is also never written
  over: this run's choices are then kept in memory only. One of this format with some bad
  entries is written over, less those entries.
- Read once per Wisdom object, bounded before parsing (MAX_FILE_BYTES) and after it (MAX_ENTRIES,
  every field checked); a lookup is then one dict lookup.

The same keys name a run's choices in its metrics and checkpoints (`checked_records`: the bounded,
checked form they are read back in from a checkpoint or a worker's reply), which `--resume` hands
back to the devices (CpuDevice.preload_conv_paths).
"""
import functools
import json
import math
import os
import platform
import re
import sys
import tempfile
import threading

import numba
import numpy
from threadpoolctl import threadpool_info

try:
    import fcntl
except ImportError:                 # not POSIX: merged without the lock
    fcntl = None

from hetconv.geometry import ConvBlock

FORMAT = 1
# The file's name carries the timings' generation: a change that moves a path's speed enough that
# stored timings would keep a slower path names a new file, and every machine times its layers once
# more (the old file is left as it was, for a version that still reads it). 2: Winograd's GEMMs in
# one parallel region on two or more threads, which made it the fastest path on layers that
# conv-paths.json had timed it out of. 3: oneDNN's direct convolutions take and give channels-last
# (NHWC) maps with no reorder, and strided 1x1 convs run on the subsampled input.
FILE_NAME = "conv-paths-3.json"
CACHE_ENV = "HETCONV_CACHE"
# A real file holds a few hundred entries of ~400 bytes: 8 MB is far above any, and bounds what
# parsing it may cost (JSON: up to ~22x its bytes in objects).
MAX_FILE_BYTES = 8 << 20
MAX_ENTRIES = 16384                 # call shapes over every machine key of the file
MAX_MACHINES = 256
# What a run records of its choices (metrics, checkpoints, a worker's FETCH reply, WELCOME on
# resume): a header is at most 1 MiB (transport.protocol), which this keeps well under.
MAX_RECORDS = 64                    # devices
MAX_RECORD_CHOICES = 256            # per device: its latest
MAX_RECORDS_CHOICES = 1024          # over every device
MAX_RECORDS_BYTES = 512 << 10       # over every device, as JSON text (msgpack's is no longer)
MAX_WHY = 160
MAX_TEXT = 200
MAX_LIST = 16
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
_PATH_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")
_MAX_DIM = 1 << 31

# the fields of a machine key, and what each holds
MACHINE_FIELDS = {"cpu": str, "arch": str, "isa": list, "blas": list, "onednn": (str, type(None)), "numba": str,
                  "threads": int, "precision": str, "conv_path": str, "paths": list}
CALL_FIELDS = ("x", "w", "stride", "padding", "block")
DETERMINISTIC = "rule (deterministic)"      # the `why` of a choice a device made by its fixed rule


def cache_dir():
    """$HETCONV_CACHE, else $XDG_CACHE_HOME/hetconv, else ~/.cache/hetconv."""
    given = os.environ.get(CACHE_ENV, "").strip()
    if given:
        return given
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return os.path.join(xdg or os.path.join(os.path.expanduser("~"), ".cache"), "hetconv")


def wisdom_path():
    return os.path.join(cache_dir(), FILE_NAME)


_opened = {}
_opened_lock = threading.Lock()


def machine_wisdom():
    """This machine's wisdom file (wisdom_path(), read when first looked in), one object per path
    per process: devices opened by the command lines share it."""
    path = os.path.abspath(wisdom_path())
    with _opened_lock:
        if path not in _opened:
            _opened[path] = Wisdom(path)
        return _opened[path]


def canonical(key):
    """A key dict as the one string that names it in lookups."""
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


# ---- keys --------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def cpuinfo_fields():
    """/proc/cpuinfo's fields of the first processor ({} where there is none), read once; what
    the machine key and the benchmarks' machine line are made of."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break                        # the first processor is enough
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


@functools.lru_cache(maxsize=1)
def _host():
    """(CPU model, architecture, ISA flags) of this host: /proc/cpuinfo's first processor where
    there is one, else what `platform` says (no flags)."""
    fields = cpuinfo_fields()
    name = fields.get("model name") or fields.get("Processor") or platform.processor() or platform.machine() or "?"
    if "cpu family" in fields:
        name += f" (family {fields['cpu family']} model {fields.get('model', '?')})"
    present = set(fields.get("flags", fields.get("Features", "")).split())
    return name[:MAX_TEXT], (platform.machine() or "?")[:MAX_TEXT], [f for f in ISA_FLAGS if f in present]


@functools.lru_cache(maxsize=1)
def _libraries():
    """(numpy's BLAS libraries as "internal_api version architecture", Numba's version), once.
    numpy's own: the BLAS its wheel bundles (in numpy.libs, numpy/.dylibs), not one a library
    loaded later brings (PyTorch's MKL, in a process that imported it for --net FILE.py); where
    numpy links a system BLAS, every BLAS loaded."""
    blas = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    home = os.path.dirname(os.path.abspath(numpy.__file__))
    bundled = [i for i in blas if str(i.get("filepath", "")).startswith((home + os.sep, home + ".libs" + os.sep))]
    names = sorted(f"{i.get('internal_api', '?')} {i.get('version', '?')} {i.get('architecture', '?')}"[:MAX_TEXT]
                   for i in bundled or blas)
    return names[:MAX_LIST], str(numba.__version__)[:MAX_TEXT]


def machine_key(threads, precision, conv_path, onednn_version, paths):
    """The machine part of a wisdom key for a CPU device: this host's CPU and libraries, and the
    device's `threads`, `precision`, `conv_path` option, oneDNN's version (None without it) and
    the `paths` it has. Timings made under any other of these are not this device's."""
    cpu, arch, isa = _host()
    blas, numba_version = _libraries()
    return {"cpu": cpu, "arch": arch, "isa": list(isa), "blas": list(blas),
            "onednn": None if onednn_version is None else str(onednn_version)[:MAX_TEXT], "numba": numba_version,
            "threads": int(threads), "precision": str(precision), "conv_path": str(conv_path),
            "paths": sorted(paths)[:MAX_LIST]}


def call_key(x_shape, w_shape, stride, padding, block):
    """The call part of a wisdom key: what a device's choice of path is per (the key of its
    `_choices`)."""
    return {"x": [int(d) for d in x_shape], "w": [int(d) for d in w_shape], "stride": [int(s) for s in stride],
            "padding": [int(p) for p in padding], "block": None if block is None else block.to_json()}


def _is_int(v, low=0, high=_MAX_DIM):
    return isinstance(v, int) and not isinstance(v, bool) and low <= v <= high


def _text_ok(v, limit=MAX_TEXT):
    return isinstance(v, str) and len(v) <= limit


def check_machine(d):
    """'' where `d` is a machine key as machine_key writes it, else what is wrong with it."""
    if not isinstance(d, dict):
        return f"a machine key is a map, got {type(d).__name__}"
    if set(d) != set(MACHINE_FIELDS):
        return f"a machine key has the fields {', '.join(sorted(MACHINE_FIELDS))}, got {sorted(map(str, d))[:12]}"
    for name, types in MACHINE_FIELDS.items():
        v = d[name]
        wanted = types if isinstance(types, tuple) else (types,)
        if isinstance(v, bool) or not isinstance(v, wanted):
            return f"machine field {name!r} is {type(v).__name__}, expected {' or '.join(t.__name__ for t in wanted)}"
        if isinstance(v, str) and len(v) > MAX_TEXT:
            return f"machine field {name!r} is longer than {MAX_TEXT} characters"
        if isinstance(v, list) and (len(v) > MAX_LIST or not all(_text_ok(s) for s in v)):
            return f"machine field {name!r} is not a list of at most {MAX_LIST} short strings"
    if not _is_int(d["threads"], 1, 1 << 16):
        return f"machine field 'threads' is {d['threads']!r}, expected 1 to 65536"
    return ""


def check_call(d):
    """'' where `d` is a call key as call_key writes it, else what is wrong with it."""
    if not isinstance(d, dict) or set(d) != set(CALL_FIELDS):
        return f"a call key is a map of {', '.join(CALL_FIELDS)}"
    for name, n in (("x", 4), ("w", 4), ("stride", 2), ("padding", 2)):
        v = d[name]
        if not (isinstance(v, list) and len(v) == n and all(_is_int(e) for e in v)):
            return f"call field {name!r} is {json.dumps(v)[:60]}, expected {n} integers >= 0"
    if d["block"] is not None:
        try:
            ConvBlock.from_json(d["block"])
        except (TypeError, ValueError) as e:
            return f"call field 'block': {str(e)[:120]}"
    return ""


def check_path(p):
    """'' where `p` is a conv path's name (im2col, shifted-dnnl, ...), else what is wrong."""
    if not (isinstance(p, str) and _PATH_RE.match(p)):
        return f"path {json.dumps(p)[:40]} is not a conv path's name"
    return ""


def _seconds(d):
    """{path: seconds} as stored, or None where `d` is not one."""
    if not (isinstance(d, dict) and len(d) <= MAX_LIST):
        return None
    out = {}
    for p, s in d.items():
        if check_path(p) or isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s < 0:
            return None
        out[p] = float(s)
    return out


# ---- the file -----------------------------------------------------------------------------------

class ForeignFile(Exception):
    """The wisdom file's path holds a file that is not, as a whole, a wisdom file of this FORMAT;
    the message says what it is instead."""


class Wisdom:
    """One wisdom file: `lookup` the entry of a (machine, call) key, `store` one. Both keys are
    canonical() strings of machine_key and call_key dicts. Never raises for what the file holds
    or for a folder it cannot write: says so once on stderr (`warn`) and goes on without it."""

    def __init__(self, path, warn=None):
        self.path = str(path)
        self._warn_to = warn
        self._entries = None            # {(machine, call): entry}: the file as last read or written
        self._said = set()              # the kinds of warning given already
        self._lock = threading.Lock()

    def _warn(self, kind, message):
        if kind in self._said:
            return
        self._said.add(kind)
        line = f"hetconv: conv path wisdom {self.path}: {message}"
        if self._warn_to is not None:
            self._warn_to(line)
        else:
            print(line, file=sys.stderr, flush=True)

    def lookup(self, machine, call):
        """The stored {path, seconds?} of this machine and call key, or None."""
        with self._lock:
            if self._entries is None:
                self._entries = self._read()
            return self._entries.get((machine, call))

    def store(self, machine, call, path, seconds=None):
        """Keep `path` (with the `seconds` each path took, where it was timed) for this key: in
        memory, and in the file, merged under its lock with whatever other processes wrote."""
        entry = {"path": path, **({"seconds": dict(seconds)} if seconds else {})}
        with self._lock:
            if self._entries is None:
                self._entries = self._read()
            self._entries.pop((machine, call), None)
            self._entries[(machine, call)] = entry
            if "unwritable" in self._said or "foreign" in self._said:
                return                  # said once: this run keeps its choices in memory
            try:
                self._entries = self._merge_and_write({(machine, call): entry})
            except ForeignFile as e:
                self._warn_foreign(str(e))
            except OSError as e:
                self._warn("unwritable", f"cannot be written ({e.strerror or e}); this run's conv path choices are "
                                         f"not kept for the next run")

    def _warn_foreign(self, problem):
        self._warn("foreign", f"ignored and left as it is: {problem}; this run's conv path choices are not kept "
                              f"for the next run (move the file away to let hetconv keep them)")

    # ---- reading: bounded, every field checked ----
    def _read(self):
        """{(machine, call): entry} of the file: empty where there is none, or it cannot be read
        (said once)."""
        try:
            entries, problem = self._read_entries()
        except ForeignFile as e:
            self._warn_foreign(str(e))
            return {}
        except OSError as e:
            self._warn("read", f"ignored: cannot be read ({e.strerror or e})")
            return {}
        if problem:
            self._warn("read", f"{'ignored' if not entries else 'some entries ignored'}: {problem}")
        return entries

    def _read_entries(self):
        """(entries, '' or the first bad entry's problem) of the file as it is now: ({}, '') where
        there is none yet (its folder may be what is missing). Raises ForeignFile for a file that is
        not a wisdom file of this format, OSError where it cannot be read."""
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > MAX_FILE_BYTES:       # a file of this format is never written this big
                    raise ForeignFile(f"{size} bytes, more than the {MAX_FILE_BYTES} a wisdom file may hold")
                raw = f.read(MAX_FILE_BYTES + 1)
        except (FileNotFoundError, NotADirectoryError):
            return {}, ""
        d, problem = _wisdom_map(raw)
        if problem:
            raise ForeignFile(problem)
        return _entries(d)

    # ---- writing: merged under the lock, replaced atomically ----
    def _merge_and_write(self, new):
        folder = os.path.dirname(self.path) or "."
        os.makedirs(folder, exist_ok=True)
        with open(self.path + ".lock", "a") as lock:
            if fcntl is not None:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                merged = self._read_for_merge()
                for key, entry in new.items():
                    merged.pop(key, None)
                    merged[key] = entry         # the newest last: the first to go over MAX_ENTRIES
                while len(merged) > MAX_ENTRIES:
                    merged.pop(next(iter(merged)))
                fd, tmp = tempfile.mkstemp(prefix=".conv-paths-", suffix=".tmp", dir=folder)
                try:
                    with os.fdopen(fd, "w") as f:
                        f.write(_file_text(merged))
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, self.path)
                except BaseException:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
                    raise
                _fsync_folder(folder)
            finally:
                if fcntl is not None:
                    fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
        return merged

    def _read_for_merge(self):
        """The file's entries now (another process may have written since it was first read);
        ForeignFile where it is no longer, or not yet, a wisdom file of this format."""
        return self._read_entries()[0]


def _fsync_folder(folder):
    """The rename into `folder` made durable. A folder that cannot be synced (some network file
    systems refuse) leaves it to the system's next sync: a cache loses at most this entry."""
    try:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


ABOUT = ("hetconv's conv path wisdom: the path each CPU device's timing chose per call shape, reused by later "
         "runs on this machine (hetconv-coordinator --retime times them again)")


def _file_text(entries):
    """{(machine, call): entry} -> the file's JSON text: entries grouped by machine key, one line
    per machine key and per call shape, so that a person can read it and a diff says what changed."""
    machines = {}
    for (machine, call), entry in entries.items():
        machines.setdefault(machine, []).append(json.dumps({"call": json.loads(call), **entry}))
    blocks = [f' {{"machine": {machine},\n  "calls": [\n   ' + ",\n   ".join(calls) + "]}"
              for machine, calls in machines.items()]
    return (f'{{"format": {FORMAT}, "about": {json.dumps(ABOUT)},\n "machines": [\n' + ",\n".join(blocks)
            + "]}\n")


def parse(raw):
    """A wisdom file's bytes -> ({(machine, call): {path, seconds?}}, '' or the first problem).
    Never raises: what cannot be read is left out, and said."""
    d, problem = _wisdom_map(raw)
    return ({}, problem) if problem else _entries(d)


def _wisdom_map(raw):
    """(the parsed map, '') where `raw` is as a whole a wisdom file of this FORMAT, else (None,
    what it is instead)."""
    try:
        d = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        return None, f"not JSON ({type(e).__name__})"
    if not isinstance(d, dict) or d.get("format") != FORMAT or not isinstance(d.get("machines"), list):
        found = f"format {d['format']!r:.20}" if isinstance(d, dict) and "format" in d else "no format"
        return None, (f"not a wisdom file of format {FORMAT} (a map with its format and a list of machines; this "
                      f"one has {found})")
    return d, ""


def _entries(d):
    """A wisdom map's entries (as parse returns them): a bad entry left out, the first said."""
    if len(d["machines"]) > MAX_MACHINES:        # of this format still: written over like a bad entry
        return {}, f"{len(d['machines'])} machine keys, more than {MAX_MACHINES}"
    entries, problem = {}, ""
    for m in d["machines"]:
        if not isinstance(m, dict) or not isinstance(m.get("calls"), list):
            problem = problem or "a machine's entry is not a map with its list of calls"
            continue
        wrong = check_machine(m.get("machine"))
        if wrong:
            problem = problem or wrong
            continue
        machine = canonical(m["machine"])
        for c in m["calls"]:
            if len(entries) >= MAX_ENTRIES:
                return entries, f"more than {MAX_ENTRIES} entries: the rest ignored"
            if not isinstance(c, dict) or not set(c) <= {"call", "path", "seconds"}:
                problem = problem or "an entry is not a map of call, path and seconds"
                continue
            wrong = check_call(c.get("call")) or check_path(c.get("path"))
            seconds = _seconds(c["seconds"]) if "seconds" in c else {}
            if wrong or seconds is None:
                problem = problem or wrong or "an entry's seconds are not {path: seconds}"
                continue
            entries[(machine, canonical(c["call"]))] = {"path": c["path"], **({"seconds": seconds} if seconds else {})}
    return entries, problem


# ---- a run's records ------------------------------------------------------------------------------

def checked_choice(c):
    """(the checked {call, path, why} of a recorded choice, '') or (None, what is wrong)."""
    if not isinstance(c, dict):
        return None, "a choice is not a map"
    wrong = check_call(c.get("call")) or check_path(c.get("path"))
    if wrong:
        return None, wrong
    why = c.get("why", "")
    if not isinstance(why, str):
        return None, f"a choice's why is {type(why).__name__}, not text"
    return {"call": c["call"], "path": c["path"], "why": why[:MAX_WHY]}, ""


def checked_record(r):
    """(the checked {machine, choices} of one device's record (with its `worker` where it names
    one), '') or (None, what is wrong); bad choices are left out (and said), at most
    MAX_RECORD_CHOICES kept."""
    if not isinstance(r, dict) or not isinstance(r.get("choices"), list):
        return None, "a device's record is not a map with its list of choices"
    wrong = check_machine(r.get("machine"))
    if wrong:
        return None, wrong
    if len(r["choices"]) > MAX_RECORD_CHOICES:
        return None, f"a device's record holds {len(r['choices'])} choices, more than {MAX_RECORD_CHOICES}"
    out, problem = {"machine": r["machine"], "choices": []}, ""
    worker = r.get("worker")
    if worker is not None:
        if not _text_ok(worker):
            return None, "a record's worker is not a short text"
        out = {"worker": worker, **out}
    for c in r["choices"]:
        choice, wrong = checked_choice(c)
        if choice is None:
            problem = problem or wrong
        else:
            out["choices"].append(choice)
    return out, problem


def checked_records(value):
    """A run's recorded choices as they come back (a checkpoint's meta, a WELCOME): a list of
    {worker?, machine, choices: [{call, path, why}]}, bounded (MAX_RECORDS devices,
    MAX_RECORDS_CHOICES choices in all) and every field checked. Returns (records, '' or the
    first problem); what is wrong is left out, never raised."""
    if value is None:
        return [], ""
    if not isinstance(value, list):
        return [], f"the conv path records are {type(value).__name__}, not a list"
    if len(value) > MAX_RECORDS:
        return [], f"{len(value)} devices' conv path records, more than {MAX_RECORDS}"
    records, problem, total, size = [], "", 0, 0
    for r in value:
        record, wrong = checked_record(r)
        problem = problem or wrong
        if record is None:
            continue
        total += len(record["choices"])
        size += len(json.dumps(record))
        if total > MAX_RECORDS_CHOICES or size > MAX_RECORDS_BYTES:
            return records, problem or (f"more than {MAX_RECORDS_CHOICES} conv path choices or {MAX_RECORDS_BYTES} "
                                        f"bytes of them: the rest left out")
        records.append(record)
    return records, problem
