"""`cached_njit`: `numba.njit(cache=True)` with an on-disk cache that several processes can share.

Numba's own cache (numba.core.caching.IndexDataCacheFile) numbers a function's data files in the
order signatures arrive: a process reads the index, takes the first free number, writes the index,
then the data. Two processes that compile two signatures of one function at once both take number
1; the index then says "signature B -> data 1" while data 1 holds signature A's machine code, and
every later process that calls the function with B runs A's code (Numba does not check the
signature it loads against the one asked for). Seen here with four processes compiling four dtypes
of one cached function at once: 1 directory in 25 mapped int16 to float32 code. Where the item
sizes differ, Numba's unboxing refuses the call (a TypeError); where they agree, or the layouts or
dimension counts differ ('C' code reading a strided view, a 2-D wrapper unboxing a 4-D array into a
2-D struct), the wrong code reads and writes past its arrays: heap and stack corruption, found
later by glibc or LLVM, or wrong numbers. A test run starts dozens of processes (workers spawned
side by side, a coordinator beside the test's own process) on one cache.

Here each data file is named by a hash of its key and the source stamp (so two signatures, or one
signature compiled from two versions of the sources, never share a file, and a file is only ever
replaced by the same code), the data is written before the index entry that points at it, the
index's read-modify-write holds an exclusive lock (no lost entries), a loaded entry whose
signature is not the one asked for is dropped and compiled again, and the index's stamp covers
every kernel source file, not only the function's own (a cached kernel inlines helpers from other
files; Numba alone would keep a stale copy of them). NUMBA_BOUNDSCHECK is part of the key, so a
checking run on a warm cache compiles checked kernels beside the others.

A process started with HETCONV_NUMBA_CACHE_LAYER=DIR reads the shared cache but writes what it
compiles only under DIR (one folder per cache folder, each naming the folder it stands for);
`merge_cache_layer(DIR)` later copies those entries into the shared cache where they were compiled
from the kernel sources as they are now (a layer left from before a source edit is stale: merging
it would put its stamp over the shared index, which Numba then reads as empty). The test suite
gives every test such a folder of its own, inherited by the processes it starts: they cannot write
into one another's cache, and a kernel compiled once is still shared with the tests after it.
"""
import contextlib
import hashlib
import os
import pickle

import numba
from numba.core import caching, sigutils

try:
    import fcntl
except ImportError:         # no advisory locks: the key-named data files still never cross
    fcntl = None

# The files whose kernels the cached functions compile in (theirs and the helpers they inline).
_KERNEL_SOURCES = (("devices",), ("transport", "wire.py"), ("data", "resample.py"), ("jit.py",))


def _kernel_sources_stamp():
    """(mtime_ns, size) of every kernel source file, the stamp Numba keeps for one file only."""
    root = os.path.dirname(os.path.abspath(__file__))
    stamp = []
    for parts in _KERNEL_SOURCES:
        path = os.path.join(root, *parts)
        files = ([os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(".py")]
                 if os.path.isdir(path) else [path])
        for file in files:
            st = os.stat(file)
            stamp.append((os.path.relpath(file, root), st.st_mtime_ns, st.st_size))
    return tuple(stamp)


_SOURCES_STAMP = _kernel_sources_stamp()

# Read once, at import: a process's layer is fixed by the environment it was started with (a test
# that sets it for its children does not move the test process's own cache)
_CACHE_LAYER = os.environ.get("HETCONV_NUMBA_CACHE_LAYER") or None
_LAYER_TARGET_FILE = "shared-cache-folder"


class _KeyNamedIndex(caching.IndexDataCacheFile):
    """An index whose data files are named by their key and whose updates are locked."""

    def __init__(self, cache_path, filename_base, source_stamp):
        super().__init__(cache_path, filename_base, source_stamp)
        self._filename_base = filename_base
        self._lock_path = self._index_path + ".lock"

    def _name_of(self, key):
        # the stamp too: a process compiling from edited sources writes a file of its own, never
        # one an index of the old stamp points at
        digest = hashlib.sha256(repr((key, self._source_stamp)).encode()).hexdigest()[:24]
        return f"{self._filename_base}.{digest}.nbc"

    @contextlib.contextmanager
    def _locked(self):
        if fcntl is None:
            yield
            return
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)                # closing releases the lock

    def save(self, key, data):
        name = self._name_of(key)
        self._save_data(name, data)     # atomic (a temporary file renamed): never half a file
        with self._locked():
            overloads = self._load_index()
            if overloads.get(key) != name:
                overloads[key] = name
                self._save_index(overloads)

    def load(self, key):
        overloads = self._load_index()
        name = overloads.get(key)
        if name is None or name != self._name_of(key):    # an entry another numbering wrote
            return None
        try:
            return self._load_data(name)
        except OSError:
            return None


    def merge_from(self, other):
        """Copy `other`'s entries (an index of the same function in another folder) into this one:
        each data file first, under its key's name, then the index entries, under the lock."""
        found = other._load_index()
        if not found:
            return 0
        os.makedirs(self._cache_path, exist_ok=True)
        for key, name in found.items():
            if name == self._name_of(key) and not os.path.exists(self._data_path(name)):
                with open(other._data_path(name), "rb") as src, self._open_for_write(self._data_path(name)) as dst:
                    dst.write(src.read())
        with self._locked():
            overloads = self._load_index()
            added = {k: n for k, n in found.items() if n == self._name_of(k) and overloads.get(k) != n}
            if added:
                self._save_index({**overloads, **added})
        return len(added)


class _LayeredIndex:
    """Loads from the process's own layer, then the shared folder; saves to its own layer only."""

    def __init__(self, own, shared):
        self._own, self._shared = own, shared

    def save(self, key, data):
        os.makedirs(self._own._cache_path, exist_ok=True)
        target = os.path.join(self._own._cache_path, _LAYER_TARGET_FILE)
        if not os.path.exists(target):
            with self._own._open_for_write(target) as f:
                f.write(self._shared._cache_path.encode())
        self._own.save(key, data)

    def load(self, key):
        found = self._own.load(key)
        return found if found is not None else self._shared.load(key)

    def flush(self):
        self._own.flush()


def merge_cache_layer(layer):
    """Copy every entry compiled under the layer folder `layer` into the shared folders its
    subfolders name. Returns how many index entries were added. A subfolder that names no folder,
    an index from another numba, or one compiled from kernel sources edited since (stale) is left
    where it is; so is one whose shared index is of today's sources but another stamp of its own
    file (which of the two is stale cannot be told here)."""
    added = 0
    if not os.path.isdir(layer):
        return 0
    sources_now = _kernel_sources_stamp()       # not _SOURCES_STAMP: the sources may have changed since import
    for sub in sorted(os.listdir(layer)):
        folder = os.path.join(layer, sub)
        try:
            with open(os.path.join(folder, _LAYER_TARGET_FILE), "rb") as f:
                shared_folder = f.read().decode()
        except (OSError, UnicodeDecodeError):
            continue
        for index_name in sorted(os.listdir(folder)):
            if not index_name.endswith(".nbi"):
                continue
            base = index_name[:-len(".nbi")]
            stamp = _stamp_of(os.path.join(folder, index_name))
            if stamp is None or stamp[1] != sources_now:
                continue
            shared_stamp = _stamp_of(os.path.join(shared_folder, index_name))
            if shared_stamp is not None and shared_stamp != stamp and shared_stamp[1] == sources_now:
                continue
            added += _KeyNamedIndex(shared_folder, base, stamp).merge_from(_KeyNamedIndex(folder, base, stamp))
    return added


def _stamp_of(index_path):
    """The source stamp an index file was written with, or None where it is not this numba's."""
    try:
        with open(index_path, "rb") as f:
            if pickle.load(f) != numba.__version__:
                return None
            stamp, _ = pickle.loads(f.read())
    except Exception:       # a half-written or foreign file: not merged
        return None
    return stamp


class _VerifiedCache(caching.FunctionCache):
    """numba's FunctionCache over a _KeyNamedIndex; a loaded overload must be the signature asked
    for, else it is compiled again."""

    def __init__(self, py_func):
        super().__init__(py_func)
        stamp = (self._impl.locator.get_source_stamp(), _SOURCES_STAMP)
        shared = _KeyNamedIndex(self._cache_path, self._impl.filename_base, stamp)
        if _CACHE_LAYER:
            own_folder = os.path.join(_CACHE_LAYER, hashlib.sha1(self._cache_path.encode()).hexdigest()[:20])
            self._cache_file = _LayeredIndex(_KeyNamedIndex(own_folder, self._impl.filename_base, stamp), shared)
        else:
            self._cache_file = shared

    def _index_key(self, sig, codegen):
        # NUMBA_BOUNDSCHECK changes the machine code but not Numba's key: a warm cache would hand
        # a checking run the unchecked kernels
        return (*super()._index_key(sig, codegen), ("boundscheck", bool(numba.config.BOUNDSCHECK)))

    def _load_overload(self, sig, target_context):
        cres = super()._load_overload(sig, target_context)
        if cres is None:
            return None
        args, _ = sigutils.normalize_signature(sig)
        if tuple(cres.signature.args) != tuple(args):
            return None
        return cres


def cached_njit(**options):
    """numba.njit(**options) compiled once per signature and kept on disk (as cache=True), in a
    cache that processes compiling at the same time cannot cross (see the module docstring)."""
    if "cache" in options:
        raise TypeError("cached_njit always caches: drop cache=")

    def wrap(py_func):
        dispatcher = numba.njit(**options)(py_func)
        dispatcher._cache = _VerifiedCache(dispatcher.py_func)
        return dispatcher

    return wrap
