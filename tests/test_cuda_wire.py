"""A CUDA worker in a bf16 plan: its kernels stay float32, and what it serves arrives and leaves
as the plan's bfloat16 wire, decoded to float32 before its kernels and encoded after (on Numba's
CUDA simulator where there is no GPU)."""
import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402

from _cuda_sim import dev, short_thread_switches  # noqa: E402,F401
from hetconv.devices import open_device  # noqa: E402
from hetconv.engine.shard import ConvShard, ShardServer  # noqa: E402
from hetconv.geometry import ConvSpec  # noqa: E402
from hetconv.transport.wire import decode, encode  # noqa: E402

SPEC = ConvSpec.paper(2, 3, 3, 0)           # 3x3 conv, ReLU, 2x2 max-pool: 6x6 -> 4x4 -> 2x2


def serve(device, wire, x, dy, w):
    """LOAD (the plan's `wire`), FORWARD x and BACKWARD dy on one shard of `device` -> the replies'
    arrays, as they would travel."""
    server = ShardServer(ConvShard(device))
    state = SPEC.initial_state(w)
    names = [a.name for a in SPEC.state_layout() if a.name in state]
    server.handle("LOAD", [state[n] for n in names], {"layer": 0, "spec": SPEC.to_json(), "start": 0, "stop": 3,
                                                      "wire": wire, "optimizer": "sgd", "names": names,
                                                      "bn_ghost_batch": 0})
    _, (y,), _ = server.handle("FORWARD", [encode(x, wire)], {"layer": 0, "micros": [0], "rows": [0], "batch": len(x),
                                                             "train": True, "train_step": 0, "seed": 0})
    _, (dx,), _ = server.handle("BACKWARD", [encode(dy, wire)], {"layer": 0, "micros": [0], "need_dx": True})
    return y, dx


def test_a_cuda_shard_takes_bf16_from_the_wire_and_computes_in_float32(dev):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 2, 6, 6)).astype(np.float32)
    w = rng.standard_normal((3, 2, 3, 3)).astype(np.float32)
    dy = rng.standard_normal((2, 3, 2, 2)).astype(np.float32)
    y, dx = serve(dev, "bfloat16", x, dy, w)
    assert y.dtype == dx.dtype == np.uint16                      # bfloat16 travels as its top 16 bits
    # what its float32 kernels make of the decoded arrays, on a float32 wire, rounded on the way out
    y32, dx32 = serve(dev, "float32", decode(encode(x, "bfloat16"), "bfloat16"),
                      decode(encode(dy, "bfloat16"), "bfloat16"), w)
    np.testing.assert_array_equal(y, encode(y32, "bfloat16"))
    np.testing.assert_array_equal(dx, encode(dx32, "bfloat16"))
    # and a float32 CPU shard on the same wire agrees with it, to the wire's rounding
    cpu_y, cpu_dx = serve(open_device("cpu", threads=1), "bfloat16", x, dy, w)
    np.testing.assert_allclose(decode(y, "bfloat16"), decode(cpu_y, "bfloat16"), rtol=2 ** -7, atol=1e-6)
    np.testing.assert_allclose(decode(dx, "bfloat16"), decode(cpu_dx, "bfloat16"), rtol=2 ** -7, atol=1e-6)
