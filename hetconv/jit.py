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

Here each data file is named by a hash of its key (so two signatures never share a file, and a
file is only ever replaced by the same key's code), the data is written before the index entry
that points at it, the index's read-modify-write holds an exclusive lock (no lost entries), a
loaded entry whose signature is not the one asked for is dropped and compiled again, and the
index's stamp covers every kernel source file, not only the function's own (a cached kernel
inlines helpers from other files; Numba alone would keep a stale copy of them). NUMBA_BOUNDSCHECK
is part of the key, so a checking run on a warm cache compiles checked kernels beside the others.
"""
import contextlib
import hashlib
import os

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


class _KeyNamedIndex(caching.IndexDataCacheFile):
    """An index whose data files are named by their key and whose updates are locked."""

    def __init__(self, cache_path, filename_base, source_stamp):
        super().__init__(cache_path, filename_base, source_stamp)
        self._filename_base = filename_base
        self._lock_path = self._index_path + ".lock"

    def _name_of(self, key):
        return f"{self._filename_base}.{hashlib.sha256(repr(key).encode()).hexdigest()[:24]}.nbc"

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


class _VerifiedCache(caching.FunctionCache):
    """numba's FunctionCache over a _KeyNamedIndex; a loaded overload must be the signature asked
    for, else it is compiled again."""

    def __init__(self, py_func):
        super().__init__(py_func)
        stamp = (self._impl.locator.get_source_stamp(), _SOURCES_STAMP)
        self._cache_file = _KeyNamedIndex(self._cache_path, self._impl.filename_base, stamp)

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
