"""What the CUDA device's test modules share: skipped without numba-cuda, or where numba.cuda
was loaded without the simulator and there is no GPU (tests/conftest.py turns the simulator on
before anything imports numba); short thread switches for the simulator; one device; random
float32 arrays and the tolerance every kernel is held to."""
import sys

import numpy as np
import pytest

pytest.importorskip("numba_cuda", reason="numba-cuda is not installed (pip install 'hetconv[cuda]')")

from numba import cuda  # noqa: E402

from hetconv.devices import open_device  # noqa: E402

if not cuda.is_available():
    pytest.skip("numba.cuda was imported without the simulator before this module and there is no GPU: "
                "run with NUMBA_ENABLE_CUDASIM=1", allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def short_thread_switches():
    # The simulator's block manager busy-waits on its threads; with Python's default 5 ms
    # switch interval a block at a syncthreads barrier idles most of the time (3x slower).
    previous = sys.getswitchinterval()
    sys.setswitchinterval(5e-4)
    yield
    sys.setswitchinterval(previous)


@pytest.fixture(scope="module")
def dev():
    return open_device("cuda:0")


def random_f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def assert_close(got, expected, what):
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4, err_msg=what)
