"""Test-suite set-up that must happen before anything imports numba.

CUDA kernels run under Numba's CUDA simulator unless HETCONV_TEST_REAL_GPU=1 is set (on a GPU
machine), so the one test command works on a machine without a GPU. Worker processes that the
tests start inherit this environment.
"""
import os
import signal
import subprocess
import sys

if os.environ.get("HETCONV_TEST_REAL_GPU") != "1":
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
# Calibration points timed over 20 ms windows, not 250 (engine/shard.py): the suite's runs check
# what a plan computes, not how fast; tests/test_calibration.py checks the windows at the default.
os.environ.setdefault("HETCONV_CALIBRATION_FLOOR_S", "0.02")

import pytest  # noqa: E402

# Imported before any test sets HETCONV_NUMBA_CACHE_LAYER: this process keeps the shared cache
from hetconv.jit import merge_cache_layer  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session", autouse=True)
def _conv_path_wisdom_outside_tests(tmp_path_factory):
    """What module- and session-scoped fixtures (set up before a test's own folder below) time
    goes to a folder of the session's, never to the user's ~/.cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HETCONV_CACHE", str(tmp_path_factory.mktemp("hetconv-cache-shared")))
        yield


@pytest.fixture(autouse=True)
def conv_path_wisdom(tmp_path_factory, monkeypatch):
    """Every test its own, empty conv path wisdom folder (hetconv.devices.wisdom; HETCONV_CACHE,
    inherited by the workers it starts): the suite never reads or writes the user's ~/.cache, and
    a path one test timed is not reused by the next, which times afresh. A folder of its own
    beside tmp_path, so a test that lists tmp_path finds only its own files there."""
    folder = tmp_path_factory.mktemp("hetconv-cache")
    monkeypatch.setenv("HETCONV_CACHE", str(folder))
    return folder


@pytest.fixture(scope="session", autouse=True)
def _numba_cache_layer_outside_tests(tmp_path_factory):
    """The processes module- and session-scoped fixtures start write their kernels to a folder of
    the session's; each test's teardown merges it into the shared cache."""
    layer = tmp_path_factory.mktemp("numba-layer-shared")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HETCONV_NUMBA_CACHE_LAYER", str(layer))
        yield layer
    merge_cache_layer(str(layer))


@pytest.fixture(autouse=True)
def numba_cache_layer(tmp_path_factory, monkeypatch, _numba_cache_layer_outside_tests):
    """Every test its own Numba cache folder for the processes it starts (hetconv.jit's cache layer,
    HETCONV_NUMBA_CACHE_LAYER, inherited): they read the shared cache and write only there, so no two
    tests' processes write one cache. What they compiled goes into the shared cache when the test
    ends, so the next test loads it instead of compiling again."""
    layer = tmp_path_factory.mktemp("numba-layer")
    monkeypatch.setenv("HETCONV_NUMBA_CACHE_LAYER", str(layer))
    yield layer
    merge_cache_layer(str(layer))
    merge_cache_layer(str(_numba_cache_layer_outside_tests))


@pytest.fixture
def procs():
    """Start processes through this fixture: every one is ended when the test ends, pass or fail."""
    started = []

    def start(args, **kwargs):
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.STDOUT)
        kwargs.setdefault("text", True)
        p = subprocess.Popen(args, start_new_session=True, **kwargs)
        started.append(p)
        return p

    yield start
    for p in started:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for stream in (p.stdout, p.stderr):
            if stream:
                stream.close()


def python_cmd(module, *args):
    return [sys.executable, "-m", module, *map(str, args)]


def external_worker(procs, address, name, keys="", *extra):
    """A one-thread CPU hetconv-worker started apart from the engine (as a user would on another
    host), connecting to `address`: a worker that joins a run, or one a test kills by hand."""
    return procs(python_cmd("hetconv.cli.worker", "--device", "cpu", "--connect", address, "--threads", "1",
                            "--name", name, "--connect-timeout", "60", "--idle-timeout", "120",
                            *(["--curve", keys] if keys else []), *extra),
                 stdout=subprocess.DEVNULL)
