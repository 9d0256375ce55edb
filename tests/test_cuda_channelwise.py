"""The CUDA device's per-channel layers against the float64 reference, on Numba's CUDA simulator
when there is no GPU (tests/conftest.py switches it on before numba is imported; so does this
module when run alone). Every simulated GPU thread is a Python thread: shapes are tiny, and the
simulated blocks small (8 threads per channel sum), so the shapes still span several blocks."""
import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from _cuda_sim import dev, short_thread_switches  # noqa: E402,F401
from numba.cuda.core import config as cuda_config  # noqa: E402

from hetconv import channelwise as cw  # noqa: E402
from hetconv.devices import open_device  # noqa: E402

import _channelwise_cases as cases  # noqa: E402

SHAPE = (2, 3, 5, 4)


@pytest.mark.parametrize("act", cases.ACTIVATIONS, ids=lambda a: str(a.to_json()))
def test_activation_matches_reference(dev, act):
    cases.check_activation(dev, act, SHAPE)


@pytest.mark.parametrize("pool", cases.POOLS, ids=lambda p: str(p.to_json()))
def test_pool_matches_reference(dev, pool):
    cases.check_pool(dev, pool, (2, 2, 7, 6), ties=pool.mode == "max")


@pytest.mark.parametrize("bn", [cw.BatchNorm(), cw.BatchNorm(momentum=None, affine=False)],
                         ids=lambda b: str(b.to_json()))
def test_batchnorm_whole_batch_matches_reference(dev, bn):
    x, dy, weight, bias = cases.batchnorm_inputs((3, 3, 4, 5))
    cases.check_batchnorm_against_reference([(dev, slice(None))], bn, x, dy, weight, bias)


def test_batchnorm_in_pieces_on_a_gpu_and_a_cpu():
    """Three pieces of one batch: two on the GPU (micro-batches), one on a CPU worker; the sums
    added on the host give the whole batch's statistics and gradients."""
    x, dy, weight, bias = cases.batchnorm_inputs((5, 3, 3, 4), seed=1)
    gpu, cpu = open_device("cuda:0"), open_device("cpu", threads=1)
    pieces = [(gpu, slice(0, 1)), (gpu, slice(1, 3)), (cpu, slice(3, 5))]
    stats, sums = cases.check_batchnorm_against_reference(pieces, cw.BatchNorm(), x, dy, weight, bias)
    whole_stats, whole_sums = cases.check_batchnorm_against_reference([(cpu, slice(None))], cw.BatchNorm(), x, dy,
                                                                       weight, bias)
    np.testing.assert_allclose(stats.var, whole_stats.var, rtol=1e-12)
    for a, b in zip(sums, whole_sums):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12 * np.abs(b).max())


def test_batchnorm_evaluation_matches_reference(dev):
    cases.check_batchnorm_eval(dev, cw.BatchNorm(), (2, 3, 3, 4))


def test_channel_scale_matches_reference(dev):
    cases.check_channel_scale(dev, (2, 3, 4, 5))


def test_a_piece_with_no_images(dev):
    cases.check_a_piece_with_no_images(dev)


@pytest.mark.skipif(not cuda_config.ENABLE_CUDASIM, reason="the simulator's shared memory only")
def test_the_simulated_threads_of_a_block_share_one_static_array():
    """Two threads of one simulated block switched between the lookup and the insert (forced here
    by a lookup that sleeps) get one array, as the block's threads on a GPU do."""
    import threading
    import time

    from numba.cuda.simulator import kernelapi

    import hetconv.devices.cuda_channelwise  # noqa: F401  (installs the lookup under the simulator)

    class SlowLookup(dict):
        def get(self, *args):
            found = super().get(*args)
            time.sleep(0.02)
            return found

    shared = kernelapi.FakeCUDAShared(0)
    shared._allocations = SlowLookup()
    got = []

    def take():
        got.append(shared.array(8, np.float64))

    threads = [threading.Thread(target=take) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(got) == 2 and got[0] is got[1]
