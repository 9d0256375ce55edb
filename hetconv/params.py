"""How parameters start and how they move, shared by the conv shards (on any device) and the FC
layers on the coordinator, so both train alike."""
import numpy as np


def numpy_gemm(a, b, out=None, accumulate=False):
    """a @ b into a new array, or added into `out` where `accumulate`, else written there: the FC
    layers' GEMM where no library GEMM serves (devices.cpu.head_gemm falls back to it)."""
    if out is None:
        return a @ b
    if accumulate:
        out += a @ b
    else:
        np.matmul(a, b, out=out)
    return out


def default_init(rng, shape, fan_in):
    """PyTorch's default for Linear and Conv2d: uniform in +-1/sqrt(fan_in) (std 1/sqrt(3 fan_in)).
    He's sqrt(2/fan_in) is 2.4x wider; with two max-pools (which keep the largest of four) in
    front of a 37500-wide FC layer it starts the paper network at a loss of 4.5 and makes the
    first SGD steps blow up."""
    bound = np.float32(1.0 / np.sqrt(fan_in))
    return rng.uniform(-bound, bound, size=shape).astype(np.float32)


def sgd_update(param, velocity, grad, lr, momentum, weight_decay):
    """In place, PyTorch's SGD: v = momentum*v + grad + weight_decay*param; param -= lr*v.

    Every device's `sgd_` follows this rule (the CPU device calls it)."""
    velocity *= momentum
    velocity += grad
    if weight_decay:
        velocity += weight_decay * param
    param -= lr * velocity

