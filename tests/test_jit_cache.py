"""hetconv.jit's on-disk kernel cache: processes compiling different signatures of one function at
once never leave an index entry that points at another signature's machine code (Numba's own
numbering does: the cause of the heap corruption that aborted the signal tests), and a loaded
entry of the wrong signature is never run."""
import os
import subprocess
import sys
import textwrap

import numba
import numpy as np
from numba.core import caching

from hetconv.jit import _KeyNamedIndex, _VerifiedCache, cached_njit

KERNEL = textwrap.dedent("""
    import numpy as np
    from hetconv.jit import cached_njit

    @cached_njit(nogil=True)
    def fill(a, v):
        for i in range(a.size):
            a[i] = v
        return a.size
""")

CALL = textwrap.dedent("""
    import sys
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    import kern
    for name in sys.argv[2].split(","):
        buf = np.zeros(64, name)
        view = buf[16:32]                   # guard bands on both sides: a wider type's code writes past
        kern.fill(view, 7)
        assert (view == 7).all() and not buf[:16].any() and not buf[32:].any(), name
    print("ok", flush=True)
""")

DTYPES = ("float64", "int64", "float32", "int16")


def _index(tmp_path, stamp="s"):
    return _KeyNamedIndex(str(tmp_path), "mod.f-1.py311", stamp)


def test_each_key_has_its_own_data_file_and_saves_in_any_order_load_their_own(tmp_path):
    a, b = _index(tmp_path), _index(tmp_path)       # two processes' views of one cache
    key_a, key_b = (("float32",), "magic", "h"), (("int32",), "magic", "h")
    assert a._name_of(key_a) != a._name_of(key_b)
    # b's whole save lands between a's data write and a's index update (what two compilers
    # finishing together may do): the index keeps both entries, each pointing at its own data
    write_data = a._save_data
    a._save_data = lambda name, data: (write_data(name, data), b.save(key_b, "code B"))
    a.save(key_a, "code A")
    fresh = _index(tmp_path)
    assert (fresh.load(key_a), fresh.load(key_b)) == ("code A", "code B")


def test_an_entry_numbered_by_numbas_own_index_is_not_loaded(tmp_path):
    ours = _index(tmp_path)
    numbered = caching.IndexDataCacheFile(str(tmp_path), "mod.f-1.py311", "s")
    numbered.save((("int16",), "magic", "h"), "code of another signature")   # 'mod.f-1.py311.1.nbc'
    assert ours.load((("int16",), "magic", "h")) is None


def test_a_loaded_overload_of_another_signature_is_compiled_again(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))

    def double(a):
        for i in range(a.size):
            a[i] = 2 * a[i]

    f64 = cached_njit(nogil=True)(double)
    f64(np.ones(4))                                   # compiled and saved for float64[::1]
    cache = f64._cache
    assert isinstance(cache, _VerifiedCache)
    [(key, name)] = cache._cache_file._load_index().items()
    # the int64 entry points at float64 code, as a crossed index would
    int64_sig = (numba.typeof(np.ones(4, np.int64)),)
    int64_key = cache._index_key(int64_sig, f64.targetctx.codegen())
    cache._cache_file.save(int64_key, cache._cache_file._load_data(name))
    fresh = cached_njit(nogil=True)(double)
    a = np.arange(4, dtype=np.int64)
    fresh(a)
    np.testing.assert_array_equal(a, [0, 2, 4, 6])
    assert fresh._cache_hits.get(int64_sig, 0) == 0


def test_processes_compiling_four_signatures_at_once_each_run_their_own_code(tmp_path):
    (tmp_path / "kern.py").write_text(KERNEL)
    (tmp_path / "call.py").write_text(CALL)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=os.getcwd())
    env.pop("HETCONV_NUMBA_CACHE_LAYER", None)          # the processes share one cache folder here
    run = [sys.executable, str(tmp_path / "call.py"), str(tmp_path)]
    at_once = [subprocess.Popen(run + [dtype], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for dtype in DTYPES]
    for p in at_once:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out
    # a later process loads every signature from the shared cache: each must be its own code
    done = subprocess.run(run + [",".join(DTYPES)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


def test_boundscheck_is_part_of_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))

    def poke(a, i):
        a[i] = 1.0

    unchecked = cached_njit(nogil=True)(poke)
    unchecked(np.zeros(4), 1)                          # compiled and cached without bounds checks
    monkeypatch.setattr(numba.config, "BOUNDSCHECK", 1)
    checked = cached_njit(nogil=True)(poke)
    with __import__("pytest").raises(IndexError):      # not the unchecked code from the warm cache
        checked(np.zeros(4), 9)


HITS = textwrap.dedent("""
    import sys
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    import kern
    kern.fill(np.zeros(8), 7)
    print(sum(kern.fill.stats.cache_hits.values()), flush=True)
""")


def _nbc_files(folder):
    return sorted(p.name for p in folder.rglob("*.nbc")) if folder.exists() else []


def test_a_process_with_a_layer_reads_the_shared_cache_writes_only_its_layer_and_the_layer_merges(tmp_path):
    from hetconv.jit import merge_cache_layer
    (tmp_path / "kern.py").write_text(KERNEL)
    (tmp_path / "hits.py").write_text(HITS)
    shared = tmp_path / "shared"

    def run(layer):
        env = dict(os.environ, NUMBA_CACHE_DIR=str(shared), HETCONV_NUMBA_CACHE_LAYER=str(layer),
                   PYTHONPATH=os.getcwd())
        done = subprocess.run([sys.executable, str(tmp_path / "hits.py"), str(tmp_path)], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        return int(done.stdout.split()[-1])

    first = tmp_path / "layer-1"
    assert run(first) == 0                                  # compiled: the shared cache is empty
    assert _nbc_files(shared) == [] and len(_nbc_files(first)) == 1
    assert merge_cache_layer(str(first)) == 1
    assert _nbc_files(shared) == _nbc_files(first)
    assert merge_cache_layer(str(first)) == 0               # merging again adds nothing
    second = tmp_path / "layer-2"
    assert run(second) == 1                                 # loaded from the shared cache
    assert _nbc_files(second) == []
    assert merge_cache_layer(str(tmp_path / "no-such-layer")) == 0


def test_a_layer_folder_naming_no_shared_folder_or_holding_a_foreign_index_is_left_where_it_is(tmp_path):
    from hetconv.jit import _LAYER_TARGET_FILE, merge_cache_layer
    unnamed = tmp_path / "layer" / "unnamed"                # no file naming its shared folder
    unnamed.mkdir(parents=True)
    (unnamed / "mod.f-1.py311.nbi").write_bytes(b"anything")
    foreign = tmp_path / "layer" / "foreign"                 # names one, but its index is not this numba's
    foreign.mkdir()
    (foreign / _LAYER_TARGET_FILE).write_text(str(tmp_path / "shared"))
    (foreign / "mod.f-1.py311.nbi").write_bytes(b"half an index")
    assert merge_cache_layer(str(tmp_path / "layer")) == 0
    assert not (tmp_path / "shared").exists()


def test_a_data_files_name_holds_the_source_stamp(tmp_path):
    """A process compiling from edited sources (another stamp) never writes over a data file an
    index of the old stamp points at, nor the reverse."""
    key = (("float32",), "magic", "h")
    old, new = _index(tmp_path, "stamp 1"), _index(tmp_path, "stamp 2")
    assert old._name_of(key) != new._name_of(key)
    old.save(key, "old code")
    new.save(key, "new code")
    assert {p.name for p in tmp_path.glob("*.nbc")} == {old._name_of(key), new._name_of(key)}
    assert _index(tmp_path, "stamp 2").load(key) == "new code"


def _layer(tmp_path, shared, stamp, key, code):
    """A layer folder holding one entry of `stamp`, naming `shared` as its shared folder."""
    from hetconv.jit import _LAYER_TARGET_FILE
    folder = tmp_path / "layer" / "sub"
    folder.mkdir(parents=True)
    (folder / _LAYER_TARGET_FILE).write_text(str(shared))
    _KeyNamedIndex(str(folder), "mod.f-1.py311", stamp).save(key, code)
    return str(tmp_path / "layer")


KEY_A, KEY_B = (("float32",), "magic", "h"), (("int32",), "magic", "h")


def test_a_layer_compiled_before_a_source_edit_is_not_merged_over_the_shared_index(tmp_path):
    from hetconv.jit import _kernel_sources_stamp, merge_cache_layer
    today, before_the_edit = ("f.py", _kernel_sources_stamp()), ("f.py", (("devices/cpu.py", 1, 2),))
    shared = tmp_path / "shared"
    shared.mkdir()
    _KeyNamedIndex(str(shared), "mod.f-1.py311", today).save(KEY_A, "code A")
    assert merge_cache_layer(_layer(tmp_path, shared, before_the_edit, KEY_B, "stale code B")) == 0
    fresh = _KeyNamedIndex(str(shared), "mod.f-1.py311", today)
    assert fresh.load(KEY_A) == "code A" and fresh.load(KEY_B) is None


def test_a_layer_of_todays_sources_replaces_a_stale_shared_index_but_not_one_of_another_stamp(tmp_path):
    """A shared index from before an edit is stale (Numba reads it as empty): today's layer takes
    its place. One of today's sources with another stamp of the function's own file: which is
    stale is not known, so it stays."""
    from hetconv.jit import _kernel_sources_stamp, merge_cache_layer
    today = ("f.py", _kernel_sources_stamp())
    shared = tmp_path / "shared"
    shared.mkdir()
    _KeyNamedIndex(str(shared), "mod.f-1.py311", ("f.py", (("devices/cpu.py", 1, 2),))).save(KEY_A, "stale A")
    assert merge_cache_layer(_layer(tmp_path / "1", shared, today, KEY_B, "code B")) == 1
    assert _KeyNamedIndex(str(shared), "mod.f-1.py311", today).load(KEY_B) == "code B"
    assert merge_cache_layer(_layer(tmp_path / "2", shared, ("g.py", today[1]), KEY_A, "code A")) == 0
    assert _KeyNamedIndex(str(shared), "mod.f-1.py311", today).load(KEY_B) == "code B"


FUSED_KERNELS = textwrap.dedent("""
    import gc
    import numpy as np
    from numba.core.dispatcher import Dispatcher
    from hetconv import channelwise as cw
    from hetconv.devices import open_device
    from hetconv.devices.base import as_channels_last
    from hetconv.jit import _VerifiedCache
    dev = open_device("cpu", threads=1)
    rng = np.random.default_rng(0)
    ones, zeros = np.ones(3, np.float32), np.zeros(3, np.float32)
    # silu's backward reads its output: the kernels recompute it, the widest of the fused kernels
    x, dy = (as_channels_last(a) for a in rng.standard_normal((2, 2, 3, 4, 4)).astype(np.float32))
    y, ctx = dev.batchnorm_apply(x, zeros, ones, ones, zeros, activation=cw.Activation("silu"))
    dev.batchnorm_backward(ctx, dy, *dev.batchnorm_grad_sums(ctx, dy), 32)
    ours = [d for d in gc.get_objects() if isinstance(d, Dispatcher) and isinstance(d._cache, _VerifiedCache)]
    compiled = {d.py_func.__qualname__ for d in ours if sum(d.stats.cache_misses.values())}
    print("compiled:", *sorted(compiled), flush=True)
""")


def test_a_second_process_compiles_none_of_the_kernels_the_first_cached(tmp_path):
    """Numba keys a cached closure by its cells' pickled contents: a kernel closing over a jitted
    function (which pickles differently in every process) was compiled again by every process,
    every worker's start paying for BatchNorm fused with each activation of its network."""
    from hetconv.jit import merge_cache_layer
    layer = tmp_path / "layer"
    env = dict(os.environ, HETCONV_NUMBA_CACHE_LAYER=str(layer))

    def compiled():
        done = subprocess.run([sys.executable, "-c", FUSED_KERNELS], env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout.split("compiled:")[-1].split()

    compiled()                                  # whatever the suite's cache lacked, compiled into the layer
    merge_cache_layer(str(layer))
    assert compiled() == []
