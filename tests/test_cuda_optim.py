"""The CUDA device's optimizer updates equal the CPU device's bit for bit (on Numba's CUDA simulator
when there is no GPU): data-parallel copies of a weight on a CPU and a GPU stay identical.

The simulator runs the same update rules (devices/base.py) with numpy's float32 operations; that
the compiled kernels round as those do is tests/test_cuda_ptx.py's part (no fma, no approximation).
"""
import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from _cuda_sim import dev, random_f32, short_thread_switches  # noqa: E402,F401
import hetconv.devices.base as base  # noqa: E402
from hetconv.devices import open_device  # noqa: E402


@pytest.fixture(scope="module")
def cpu():
    return open_device("cpu")


def _equal(dev, on_device, on_cpu, what):
    np.testing.assert_array_equal(dev.download(on_device), on_cpu, err_msg=what)


@pytest.mark.parametrize("nesterov, weight_decay", [(False, 0.0), (False, 5e-4), (True, 5e-4)])
def test_sgd_on_cuda_equals_the_cpu_bit_for_bit(dev, cpu, nesterov, weight_decay):
    rng = np.random.default_rng(1)
    p, v = random_f32(rng, 5, 3, 3, 3), np.zeros((5, 3, 3, 3), np.float32)
    p_dev, v_dev = dev.upload(p), dev.upload(v)
    for step in range(3):
        g = random_f32(rng, 5, 3, 3, 3)
        cpu.sgd_(p, v, g, 0.1 / (step + 1), 0.9, weight_decay, nesterov=nesterov)
        dev.sgd_(p_dev, v_dev, dev.upload(g), 0.1 / (step + 1), 0.9, weight_decay, nesterov=nesterov)
        _equal(dev, v_dev, v, f"velocity after update {step + 1}")
        _equal(dev, p_dev, p, f"param after update {step + 1}")


@pytest.mark.parametrize("optimizer", ["adamw", "adam"])
@pytest.mark.parametrize("beta1", [0.9, 0.3])
def test_adamw_and_adam_on_cuda_equal_the_cpu_bit_for_bit(dev, cpu, beta1, optimizer):
    rng = np.random.default_rng(2)
    p = random_f32(rng, 7, 11)
    m, v = np.zeros_like(p), np.zeros_like(p)
    p_dev, m_dev, v_dev = dev.upload(p), dev.upload(m), dev.upload(v)
    for step in range(1, 4):
        g = random_f32(rng, 7, 11)
        getattr(cpu, optimizer + "_")(p, m, v, g, 1e-2, beta1, 0.999, 1e-8, 0.05, step)
        getattr(dev, optimizer + "_")(p_dev, m_dev, v_dev, dev.upload(g), 1e-2, beta1, 0.999, 1e-8, 0.05, step)
        for what, on_device, on_cpu in (("exp_avg", m_dev, m), ("exp_avg_sq", v_dev, v), ("param", p_dev, p)):
            _equal(dev, on_device, on_cpu, f"{what} after update {step}")


@pytest.mark.parametrize("size", [1, 40, 203])
def test_sum_of_squares_and_scale_on_cuda_equal_the_cpu(dev, cpu, monkeypatch, size):
    monkeypatch.setattr(base, "SQUARE_SUM_LANES", 32)    # several rows of lanes on a simulated grid
    a = (random_f32(np.random.default_rng(size), size) * 100).astype(np.float32)
    a_dev = dev.upload(a)
    assert dev.sum_of_squares(a_dev) == cpu.sum_of_squares(a)
    dev.scale_(a_dev, 0.37)
    cpu.scale_(a, 0.37)
    _equal(dev, a_dev, a, "scaled")


def test_updates_refuse_host_arrays_naming_them(dev):
    a = np.zeros(4, np.float32)
    with pytest.raises(TypeError, match=r"^adamw_ updates arrays on cuda:0: exp_avg_sq is ndarray, upload it first$"):
        dev.adamw_(dev.upload(a), dev.upload(a), a, dev.upload(a), 1e-3, 0.9, 0.999, 1e-8, 0.0, 1)
    with pytest.raises(TypeError, match=r"^sum_of_squares reads arrays on cuda:0: a is ndarray, upload it first$"):
        dev.sum_of_squares(a)
    with pytest.raises(TypeError, match=r"^scale_ updates arrays on cuda:0: a is ndarray, upload it first$"):
        dev.scale_(a, 0.5)
