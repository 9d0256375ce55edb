"""The optimizer updates of the CPU device (sgd_, adamw_, adam_, sum_of_squares, scale_).

Bit for bit against a numpy emulation that rounds every float32 operation apart (numpy's ufuncs
never fuse a multiply and an add), which is what the CUDA device's kernels do too
(tests/test_cuda_optim.py, tests/test_cuda_ptx.py); and against torch.optim over 20 steps.
"""
import math
import re

import numba
import numpy as np
import pytest
import torch

import hetconv.devices.base as base
import hetconv.devices.cpu_updates as cpu_updates
from hetconv.devices import open_device

f32 = np.float32


@pytest.fixture(scope="module")
def cpu():
    return open_device("cpu")


def _arrays(rng, shape, count):
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(count)]


# ---- the emulations: torch's operations, one float32 rounding each ----------------------------
def sgd_emulated(p, v, g, lr, momentum, weight_decay, nesterov):
    lr, momentum, weight_decay = f32(lr), f32(momentum), f32(weight_decay)
    decay = weight_decay * p
    v = (momentum * v + g) + decay
    step = ((g + decay) + momentum * v) if nesterov else v
    return p - lr * step, v


def adamw_emulated(p, m, v, g, lr, beta1, beta2, eps, weight_decay, step, coupled=False):
    """torch.optim.AdamW's single-tensor step, or with `coupled` torch.optim.Adam's (the decay
    added to the gradient); scalars in float64 as torch's Python computes them, rounded to
    float32 where its kernels take them."""
    if coupled:
        g = g + f32(weight_decay) * p
    else:
        p = p * f32(1 - lr * weight_decay)
    weight = 1 - beta1
    if abs(weight) < 0.5:                        # torch's lerp
        m = m + f32(weight) * (g - m)
    else:
        m = g - (g - m) * (f32(1) - f32(weight))
    v = v * f32(beta2) + (f32(1 - beta2) * g) * g
    denom = np.sqrt(v) / f32((1 - beta2 ** step) ** 0.5) + f32(eps)
    return p - (f32(lr / (1 - beta1 ** step)) * m) / denom, m, v


def square_sum_emulated(a, lanes):
    """Element i adds into lane i % lanes in float64, in order; the lanes' exactly rounded sum."""
    flat = a.reshape(-1).astype(np.float64)
    sums = np.zeros(min(lanes, flat.size))
    for row in range(0, flat.size, lanes):
        part = flat[row:row + lanes]
        sums[:part.size] += part * part
    return math.fsum(sums.tolist())


# ---- bit for bit against the emulation ---------------------------------------------------------
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 5e-4])
def test_sgd_rounds_every_operation_apart(cpu, nesterov, weight_decay):
    rng = np.random.default_rng(1)
    p, grads = _arrays(rng, (4, 3, 5, 5), 1)[0], _arrays(rng, (4, 3, 5, 5), 4)
    v = np.zeros_like(p)
    ep, ev = p.copy(), v.copy()
    for step, g in enumerate(grads):
        lr = 0.1 / (step + 1)
        cpu.sgd_(p, v, g, lr, 0.9, weight_decay, nesterov=nesterov)
        ep, ev = sgd_emulated(ep, ev, g, lr, 0.9, weight_decay, nesterov)
        np.testing.assert_array_equal(v, ev, err_msg=f"velocity after update {step + 1}")
        np.testing.assert_array_equal(p, ep, err_msg=f"param after update {step + 1}")


@pytest.mark.parametrize("optimizer", ["adamw", "adam"])
@pytest.mark.parametrize("beta1", [0.9, 0.3], ids=["lerp-from-exp_avg", "lerp-from-grad"])
def test_adamw_and_adam_round_every_operation_apart(cpu, beta1, optimizer):
    rng = np.random.default_rng(2)
    p, grads = _arrays(rng, (6, 7), 1)[0], _arrays(rng, (6, 7), 5)
    m, v = np.zeros_like(p), np.zeros_like(p)
    ep, em, ev = p.copy(), m.copy(), v.copy()
    update = getattr(cpu, optimizer + "_")
    for step, g in enumerate(grads, start=1):
        update(p, m, v, g, 1e-2, beta1, 0.999, 1e-8, 0.05, step)
        ep, em, ev = adamw_emulated(ep, em, ev, g, 1e-2, beta1, 0.999, 1e-8, 0.05, step, coupled=optimizer == "adam")
        for name, got, expected in (("exp_avg", m, em), ("exp_avg_sq", v, ev), ("param", p, ep)):
            np.testing.assert_array_equal(got, expected, err_msg=f"{name} after update {step}")


def test_the_cpu_update_kernels_hold_no_fused_multiply_add(cpu):
    """LLVM fuses nothing without a fast-math flag; an fma instruction in the machine code would
    round once where the emulation and the GPU round twice (the test above would see it only on
    a CPU with FMA)."""
    rng = np.random.default_rng(3)
    for size in (10, cpu_updates.SERIAL_UPDATE_SIZE):        # the serial kernels, then the parallel ones
        p, v, g = _arrays(rng, (size,), 3)
        cpu.sgd_(p, v, g, 0.1, 0.9, 1e-4, nesterov=True)
        cpu.adamw_(p, v.copy(), np.abs(v), g, 1e-3, 0.9, 0.999, 1e-8, 0.01, 1)
    cpu.scale_(g, 0.5)
    cpu.sum_of_squares(g)
    kernels = [cpu_updates._sgd_flat, cpu_updates._adamw_flat, cpu_updates._sgd_serial, cpu_updates._adamw_serial, cpu_updates._scale_flat,
               cpu_updates._square_sums_flat]
    fused = re.compile(r"\bv?f(?:n)?m(?:add|sub)\w*\b")
    for kernel in kernels:
        assert kernel.signatures, kernel
        # compiled afresh with the kernel's options: for code loaded from the on-disk cache Numba
        # lists no machine code (a warning and an empty listing, which would pass anything)
        fresh = numba.njit(**{k: v for k, v in kernel.targetoptions.items() if k != "nopython"})(kernel.py_func)
        for sig in kernel.signatures:
            fresh.compile(sig)
            asm = fresh.inspect_asm(sig)
            assert re.search(r"\bret[lq]?\b", asm), f"no machine code listed for {kernel.__name__}{sig}"
            assert not fused.search(asm), f"{kernel.__name__}{sig} holds {fused.search(asm).group(0)}"


@pytest.mark.parametrize("size", [1, 63, 64, 1000])
def test_sum_of_squares_is_float64_in_the_fixed_lane_order(cpu, monkeypatch, size):
    monkeypatch.setattr(base, "SQUARE_SUM_LANES", 64)    # many rows of lanes on a small array
    a = (np.random.default_rng(size).standard_normal(size) * 1e3).astype(np.float32)
    assert cpu.sum_of_squares(a) == square_sum_emulated(a, 64)
    assert cpu.sum_of_squares(a) == pytest.approx(float(np.sum(a.astype(np.float64) ** 2)), rel=1e-14)


def test_sum_of_squares_does_not_depend_on_the_thread_count(monkeypatch):
    monkeypatch.setattr(base, "SQUARE_SUM_LANES", 256)
    a = np.random.default_rng(4).standard_normal(100_003).astype(np.float32)
    one, two = open_device("cpu", threads=1).sum_of_squares(a), open_device("cpu", threads=2).sum_of_squares(a)
    assert one == two == square_sum_emulated(a, 256)


def test_sum_of_squares_of_nothing_is_zero(cpu):
    assert cpu.sum_of_squares(np.zeros((0, 3), np.float32)) == 0.0


def test_scale_multiplies_by_the_float32_factor(cpu):
    a = np.random.default_rng(5).standard_normal((3, 4)).astype(np.float32)
    expected = a * f32(1 / 3)
    cpu.scale_(a, 1 / 3)
    np.testing.assert_array_equal(a, expected)


# ---- against torch -----------------------------------------------------------------------------
SHAPES = [(8, 3, 3, 3), (8,)]


def _torch_run(make_optimizer, params, grads, lrs):
    tensors = [torch.tensor(p) for p in params]
    optimizer = make_optimizer(tensors)
    for step_grads, lr in zip(grads, lrs):
        optimizer.param_groups[0]["lr"] = lr
        for t, g in zip(tensors, step_grads):
            t.grad = torch.tensor(g)
        optimizer.step()
    return [t.numpy() for t in tensors]


def _grads(rng, steps):
    return [[rng.standard_normal(s).astype(np.float32) for s in SHAPES] for _ in range(steps)]


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_follows_torch_for_20_steps(cpu, nesterov):
    rng = np.random.default_rng(6)
    params = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    grads, lrs = _grads(rng, 20), [0.05 * (1 - s / 25) for s in range(20)]
    expected = _torch_run(lambda t: torch.optim.SGD(t, lr=lrs[0], momentum=0.9, weight_decay=5e-4,
                                                    nesterov=nesterov, foreach=False), params, grads, lrs)
    ours = [p.copy() for p in params]
    velocities = [np.zeros_like(p) for p in params]
    for step_grads, lr in zip(grads, lrs):
        for p, v, g in zip(ours, velocities, step_grads):
            cpu.sgd_(p, v, g, lr, 0.9, 5e-4, nesterov=nesterov)
    for got, want in zip(ours, expected):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


# Adam's weight decay is L2 in the gradient (coupled), unlike AdamW's: a large one, so a decoupled or
# missing decay shows
@pytest.mark.parametrize("name,torch_class,decay,seed", [("adamw", "AdamW", 0.05, 7), ("adam", "Adam", 0.5, 9)])
@pytest.mark.parametrize("beta1", [0.9, 0.3])
def test_adam_and_adamw_follow_torch_for_20_steps(cpu, beta1, name, torch_class, decay, seed):
    rng = np.random.default_rng(seed)
    params = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    grads, lrs = _grads(rng, 20), [1e-2 * (1 - s / 25) for s in range(20)]
    optimizer = getattr(torch.optim, torch_class)
    expected = _torch_run(lambda t: optimizer(t, lr=lrs[0], betas=(beta1, 0.999), eps=1e-8, weight_decay=decay,
                                              foreach=False), params, grads, lrs)
    update = getattr(cpu, f"{name}_")
    ours = [p.copy() for p in params]
    state = [(np.zeros_like(p), np.zeros_like(p)) for p in params]
    for step, (step_grads, lr) in enumerate(zip(grads, lrs), start=1):
        for p, (m, v), g in zip(ours, state, step_grads):
            update(p, m, v, g, lr, beta1, 0.999, 1e-8, decay, step)
    for got, want in zip(ours, expected):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_global_norm_clipping_from_per_worker_sums_follows_torch(cpu):
    """clip_grad_norm_ across workers: each sums the squares of its own gradients, the sums add
    up, and every worker scales by the one factor."""
    rng = np.random.default_rng(8)
    grads = [rng.standard_normal(s).astype(np.float32) for s in [(16, 3, 3, 3), (16,), (4, 16)]]
    tensors = [torch.zeros(g.shape, requires_grad=True) for g in grads]
    for t, g in zip(tensors, grads):
        t.grad = torch.tensor(g)
    torch_norm = float(torch.nn.utils.clip_grad_norm_(tensors, max_norm=1.0))
    worker_sums = [sum(cpu.sum_of_squares(g) for g in grads[:2]), cpu.sum_of_squares(grads[2])]
    norm = math.sqrt(sum(worker_sums))
    for g in grads:
        cpu.scale_(g, min(1.0, 1.0 / (norm + 1e-6)))
    assert norm == pytest.approx(torch_norm, rel=1e-6)
    for g, t in zip(grads, tensors):
        np.testing.assert_allclose(g, t.grad.numpy(), rtol=1e-6, atol=1e-7)


# ---- checks --------------------------------------------------------------------------------------
def _sgd(cpu, **changes):
    args = dict(param=np.zeros(4, np.float32), velocity=np.zeros(4, np.float32), grad=np.ones(4, np.float32),
                lr=0.1, momentum=0.9, weight_decay=0.0)
    args.update(changes)
    cpu.sgd_(**args)


def _adamw(cpu, **changes):
    args = dict(param=np.zeros(4, np.float32), exp_avg=np.zeros(4, np.float32), exp_avg_sq=np.zeros(4, np.float32),
                grad=np.ones(4, np.float32), lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=1)
    args.update(changes)
    cpu.adamw_(**args)


def _read_only(a):
    a.flags.writeable = False
    return a


@pytest.mark.parametrize("call, changes, error, message", [
    (_sgd, dict(lr=-0.1), ValueError, r"^lr must be >= 0.0, got -0.1$"),
    (_sgd, dict(momentum=float("nan")), ValueError, r"^momentum must be a finite number, got nan$"),
    (_sgd, dict(weight_decay="0.1"), ValueError, r"^weight_decay must be a finite number, got '0.1'$"),
    (_sgd, dict(momentum=0.0, nesterov=True), ValueError, r"^nesterov momentum needs a momentum > 0, got 0.0$"),
    (_sgd, dict(grad=np.ones(5, np.float32)), ValueError, r"^grad shape must match param, \(5,\) != \(4,\)$"),
    (_sgd, dict(velocity=np.zeros(4)), TypeError, r"^sgd_: velocity must be float32, got float64$"),
    (_sgd, dict(param=_read_only(np.zeros(4, np.float32))), ValueError,
     r"^sgd_: param is read-only, but it is updated in place$"),
    (_sgd, dict(velocity=np.zeros(8, np.float32)[::2]), ValueError,
     r"^sgd_: velocity must be C-contiguous \(it is read as one flat run\), got strides \(8,\)$"),
    (_adamw, dict(beta1=1.0), ValueError, r"^beta1 must be < 1.0, got 1.0$"),
    (_adamw, dict(beta2=-0.5), ValueError, r"^beta2 must be >= 0.0, got -0.5$"),
    (_adamw, dict(eps=float("inf")), ValueError, r"^eps must be a finite number, got inf$"),
    (_adamw, dict(step=0), ValueError, r"^step must be an integer >= 1 \(the first update is 1\), got 0$"),
    (_adamw, dict(step=2.0), ValueError, r"^step must be an integer >= 1 \(the first update is 1\), got 2.0$"),
    (_adamw, dict(exp_avg_sq=np.zeros((2, 2), np.float32)), ValueError,
     r"^exp_avg_sq shape must match param, \(2, 2\) != \(4,\)$"),
], ids=lambda v: v if isinstance(v, str) and not v.startswith("^") else None)
def test_bad_update_arguments_are_refused_in_one_line(cpu, call, changes, error, message):
    with pytest.raises(error, match=message):
        call(cpu, **changes)


def test_a_read_only_gradient_is_accepted(cpu):
    """Gradients received from the network are read-only views of their frames: only read."""
    grad = _read_only(np.ones(4, np.float32))
    _sgd(cpu, grad=grad)
    _adamw(cpu, grad=grad)
    assert cpu.sum_of_squares(grad) == 4.0


def test_scale_and_sum_of_squares_check_their_array(cpu):
    with pytest.raises(TypeError, match=r"^sum_of_squares: a must be float32, got int64$"):
        cpu.sum_of_squares(np.ones(3, np.int64))
    with pytest.raises(ValueError, match=r"^factor must be a finite number, got nan$"):
        cpu.scale_(np.ones(3, np.float32), float("nan"))
    with pytest.raises(ValueError, match=r"^scale_: a is read-only, but it is updated in place$"):
        cpu.scale_(_read_only(np.ones(3, np.float32)), 0.5)
