"""The native runtimes' settings that decide how a reduction is split, fixed before Numba or
oneDNN load (hetconv/__init__.py calls `pin` on the first import of any hetconv module).

- OMP_DYNAMIC=false: with it true, GNU OpenMP may run a parallel region (a Numba pass, a oneDNN
  GEMM) on fewer threads than asked, by the load it sees, and a reduction then splits otherwise.
- Numba's threading layer: omp where Numba's OpenMP pool loads, else workqueue, the same in the
  coordinator and every worker (they inherit the environment). Numba prefers TBB where it is
  installed, and Dnnl.sgemm_each expects its loop to run on OpenMP threads (a oneDNN GEMM called
  inside an OpenMP region runs on its calling thread alone).
- NUMBA_NUM_THREADS, the pool's size, which bounds every numba.set_num_threads: Numba sizes it by
  the process's affinity mask, so `--threads 2` under `taskset -c 0` would run one thread and sum
  otherwise. Here it is the machine's core count or the mask's, whichever is larger: a count the
  command asks for runs as asked. What it costs: threads that never set their count (numba's
  default is the pool's size) would run more threads than their cores, so every place that runs
  Numba kernels sets its count (CpuDevice, the coordinator's head: use_threads).
A user's own value of any of these is kept; `deterministic_problem` says which of them breaks
--deterministic.
"""
import ctypes
import ctypes.util
import importlib.util
import os

# The CPU thread count a --deterministic run takes where its command names none (--threads,
# cpu:N): fixed, because a count taken from the cores a process may use would change the sums
# with the host's affinity mask or cgroup.
DETERMINISTIC_THREADS = 1


def _numba_has_omp_pool():
    """Whether Numba's OpenMP pool is installed, found without importing Numba (which reads the
    environment on import)."""
    spec = importlib.util.find_spec("numba")
    if spec is None or not spec.submodule_search_locations:
        return False
    folder = os.path.join(spec.submodule_search_locations[0], "np", "ufunc")
    try:
        return any(name.startswith("omppool") for name in os.listdir(folder))
    except OSError:
        return False


def _usable_cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pin():
    """Set what is unset, before Numba is imported (afterwards it would not be read)."""
    os.environ.setdefault("OMP_DYNAMIC", "false")
    os.environ.setdefault("NUMBA_THREADING_LAYER", "omp" if _numba_has_omp_pool() else "workqueue")
    os.environ.setdefault("NUMBA_NUM_THREADS", str(max(_usable_cores(), os.cpu_count() or 1)))


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
# the most mallopt takes (an int): free memory at the heap's top beyond it goes back to the system
_TRIM_THRESHOLD_BYTES = 2 ** 31 - 1
KEEP_FREED_MEMORY_ENV = "HETCONV_KEEP_FREED_MEMORY"
# a user's own settings of what keep_freed_memory sets (glibc's checking allocator, MALLOC_CHECK_
# and MALLOC_PERTURB_, is not one: it runs with it)
_USER_MALLOC_TUNING = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
_allocator = None


def keep_freed_memory():
    """Have glibc's malloc keep memory a process frees, for its next allocation, instead of giving
    it back to the system: -> a line saying what the allocator does (for a device's description).

    Why: a training step allocates and frees the same maps every step, tens of MB each at ImageNet
    sizes. glibc serves a block over its mmap threshold (at most 32 MB) with a fresh mmap and
    unmaps it on free, and trims the heap's free top, so every step the kernel faults in and zeroes
    those pages again, a cost on the order of a pass over every map (docs/bench-log.md has the
    figures). So: no mmap for blocks (M_MMAP_MAX 0: every block from the heap, where freed blocks
    are reused) and a trim threshold of 2 GB. What it costs: the process holds its peak heap until
    it exits, as a caching allocator does (the peak itself stays about glibc's default's).
    HETCONV_KEEP_FREED_MEMORY=0 leaves the allocator as it is; so do a user's own
    MALLOC_MMAP_*, MALLOC_TRIM_THRESHOLD_ or MALLOC_TOP_PAD_ (or the same in GLIBC_TUNABLES),
    another allocator (jemalloc, tcmalloc by LD_PRELOAD) and any C library other than glibc.
    Once per process; safe to call again."""
    global _allocator
    if _allocator is not None:
        return _allocator
    asked = os.environ.get(KEEP_FREED_MEMORY_ENV, "1").strip()
    if asked not in ("0", "1"):
        raise ValueError(f"{KEEP_FREED_MEMORY_ENV} must be 1 (keep freed memory for reuse, the default) or 0 "
                         f"(leave the C allocator as it is), got {os.environ[KEEP_FREED_MEMORY_ENV]!r}")
    if asked == "0":
        _allocator = f"malloc as the system's ({KEEP_FREED_MEMORY_ENV}=0)"
    elif any(name in os.environ for name in _USER_MALLOC_TUNING) or \
            any(knob in os.environ.get("GLIBC_TUNABLES", "") for knob in ("mmap_", "trim_", "top_pad")) or \
            any(lib in os.environ.get("LD_PRELOAD", "") for lib in ("jemalloc", "tcmalloc", "mimalloc")):
        _allocator = "malloc as the environment sets it"
    else:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            glibc = hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt")
        except OSError:
            glibc = False
        if not glibc:
            _allocator = "malloc as the system's (not glibc)"
        elif libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES) == 1:
            _allocator = "glibc malloc keeping freed memory"
        else:
            _allocator = "malloc as the system's (glibc refused mallopt)"
    return _allocator


def system_allocator(why):
    """The line a device without keep_freed_memory gives: malloc as the system's, and why."""
    return _allocator if _allocator is not None else f"malloc as the system's ({why})"


def deterministic_problem():
    """'' where the runtimes split reductions the same way every run, else the one line saying
    which setting does not (a user's own environment)."""
    dynamic = os.environ.get("OMP_DYNAMIC", "false").strip().lower()
    if dynamic not in ("false", "0", "no", "off", ""):
        return f"OMP_DYNAMIC={os.environ['OMP_DYNAMIC']} lets OpenMP run a region on fewer threads than asked: " \
               f"--deterministic needs it false (unset it)"
    layer = os.environ.get("NUMBA_THREADING_LAYER", "").strip().lower()
    if layer not in ("omp", "workqueue"):
        return f"NUMBA_THREADING_LAYER={os.environ.get('NUMBA_THREADING_LAYER', '')} may run Numba's loops on TBB: " \
               f"--deterministic needs omp or workqueue (unset it)"
    return ""


def threads_for(threads, deterministic):
    """A CPU device's thread count: `threads` where the command gives one (> 0), else
    DETERMINISTIC_THREADS under --deterministic, else every core this process may use."""
    if threads:
        return int(threads)
    return DETERMINISTIC_THREADS if deterministic else _usable_cores()


def use_threads(threads, deterministic):
    """Run this thread's Numba kernels, and the oneDNN GEMMs that follow Numba's count (the head's),
    on `threads` threads. -> the count set. Under `deterministic`, a count the pool cannot run is
    refused (ValueError) rather than capped, which would change the sums."""
    import numba
    most = numba.config.NUMBA_NUM_THREADS
    if threads > most and deterministic:
        raise ValueError(f"--threads {threads}: this process runs at most {most} Numba threads (NUMBA_NUM_THREADS); "
                         f"--deterministic cannot run fewer than asked without changing the sums")
    threads = max(1, min(int(threads), most))
    numba.set_num_threads(threads)
    return threads


def current_threads():
    """The thread count this thread's Numba kernels run on."""
    import numba
    return numba.get_num_threads()


def record(head_threads):
    """What the metrics and the plan keep of the runtimes: the head's threads, the threading
    layer and OMP_DYNAMIC as this process runs them."""
    import numba
    try:
        layer = numba.threading_layer()
    except ValueError:                  # no parallel region has run yet: the layer asked for
        layer = os.environ.get("NUMBA_THREADING_LAYER", "default")
    return {"head_threads": int(head_threads), "threading_layer": layer,
            "omp_dynamic": os.environ.get("OMP_DYNAMIC", ""), "numba_pool": int(numba.config.NUMBA_NUM_THREADS)}
