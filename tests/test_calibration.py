"""Calibration measures a device by the mean over a window of calls long enough to span many
scheduler slices, not by the median of a few short calls. A fake device advances a fake clock by a
known time per call, so the tests count calls and check the arithmetic, with no wall clock."""
import numpy as np
import pytest

from hetconv.engine.costmodel import LayerCost
from hetconv.geometry import conv_specs
from hetconv.engine.shard import CALIBRATION_FLOOR_S, CALIBRATION_MAX_CALLS, FLOOR_ENV, ConvShard, ShardError

# Times that are exact in binary floating point, so sums of them are exact too.
MS = 2.0 ** -10                    # about a millisecond


@pytest.fixture(autouse=True)
def product_floor(monkeypatch):
    """The floor a user's run takes (the suite's conftest shortens it for every other test)."""
    monkeypatch.delenv(FLOOR_ENV, raising=False)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class FakeDevice:
    """A device whose fused forward of k kernels takes `forward(k)` seconds of the fake clock and
    whose backward takes `backward(k)`; `stall(i)` adds seconds to its i-th call (forward and
    backward together count as one call), as a time slice lost to a neighbour would."""

    def __init__(self, clock, forward, backward, stall=lambda i: 0.0):
        self.clock, self.forward, self.backward, self.stall = clock, forward, backward, stall
        self.calls = []                # (kernels, batch) of every forward
        self.dw_given = []             # every backward's dw_out

    def declines_block(self, block):
        return ""                                   # runs every conv

    def upload(self, a):
        return np.array(a, np.float32)

    download = upload

    def zeros_like(self, a):
        return np.zeros_like(a)

    def synchronize(self):
        pass

    def sgd_(self, w, v, g, lr, momentum, weight_decay):
        self.clock.now += 2 * MS / 64

    def accumulate_(self, acc, g):
        self.clock.now += MS / 64

    def conv_block(self, x, w, b, block):
        k = w.shape[0]
        self.clock.now += self.forward(k) * len(x) + self.stall(len(self.calls))
        self.calls.append((k, len(x)))
        return np.zeros((len(x), k, 1, 1), np.float32), (k, len(x))

    def conv_block_backward(self, ctx, w, dy, need_dx, dw_out=None, accumulate=False, on_dx=None):
        k, n = ctx
        self.clock.now += self.backward(k) * n
        self.dw_given.append(dw_out)
        dx = np.zeros((n, 1, 1, 1), np.float32) if need_dx else None
        if on_dx is not None and need_dx:
            on_dx(dx)
        return dx, np.zeros_like(w) if dw_out is None else dw_out, np.zeros(k, np.float32)


def calibrate(device, clock, kernels=64, batch=16, repeats=3):
    spec = conv_specs([kernels], ksize=3)[0]
    return ConvShard(device, clock=clock).calibrate([spec], [(batch, 3, 8, 8)], [kernels], repeats=repeats)


def test_short_calls_repeat_until_the_floor_and_give_total_over_count():
    clock = FakeClock()
    # per image: forward MS/16 + k MS/256, backward twice that; batch 16, 64 kernels and 32
    device = FakeDevice(clock, lambda k: MS / 16 + k * MS / 256, lambda k: 2 * (MS / 16 + k * MS / 256))
    speeds, (timing,) = calibrate(device, clock)
    per_call = {(64, 16): 5 * 3 * MS, (32, 16): 3 * 3 * MS, (32, 8): 3 * 1.5 * MS,     # forward + backward
                (64, 8): 5 * 1.5 * MS}
    for point, seconds in per_call.items():
        timed = device.calls.count(point) - 1                      # the first is the warm-up
        # the fewest calls whose measured time reaches the floor: many more than `repeats`
        assert timed == int(np.ceil(CALIBRATION_FLOOR_S / seconds)) > 3, point
    # each point is the window's total over its count: here exactly the per-call time
    assert timing["kernels"] == [64, 32]
    assert timing["forward_s"] == [5 * MS, 3 * MS] and timing["backward_s"] == [10 * MS, 6 * MS]
    assert timing["half_batch"] == {"batch": 8, "kernels": [64, 32], "forward_s": [2.5 * MS, 1.5 * MS],
                                    "backward_s": [5 * MS, 3 * MS]}
    assert speeds == [64 / (15 * MS)]
    assert timing["update_s"] == 2 * MS / 64 and timing["accumulate_s"] == MS / 64
    # and the cost model reads back the device's own line
    cost = LayerCost.fit(timing)
    assert cost.forward_per_kernel_s == pytest.approx(MS / 256) and cost.forward_fixed_s == pytest.approx(MS / 16)
    assert cost.forward_call_s == pytest.approx(0.0, abs=1e-12)
    assert cost.forward_call_per_kernel_s == pytest.approx(0.0, abs=1e-12)
    # each kernel count's backwards, on the whole batch and on half of it, write dW into the one
    # buffer its first warm-up made, as a step's do
    fresh = [d for d in device.dw_given if d is None]
    buffers = {id(d) for d in device.dw_given if d is not None}
    assert len(fresh) == 2 and len(buffers) == 2 and len(device.dw_given) > 4 * 6


def test_a_device_stalled_in_one_short_call_of_several_is_measured_at_its_mean():
    clock = FakeClock()
    # 1 ms a call, and every fifth call loses 8 ms to a neighbour: a median of a few calls sees
    # 1 ms, while the device delivers 1 + 8/5 ms a call on average
    device = FakeDevice(clock, lambda k: MS / 16, lambda k: 0.0, stall=lambda i: 8 * MS if i % 5 == 4 else 0.0)
    _, (timing,) = calibrate(device, clock, kernels=1)
    assert timing["kernels"] == [1]
    # the window spans about 100 calls: its edges move the mean by at most one stall in 100
    assert timing["forward_s"][0] == pytest.approx(2.6 * MS, rel=0.04)
    assert timing["half_batch"]["forward_s"][0] == pytest.approx(2.1 * MS, rel=0.04)   # 0.5 ms + the same stalls


def test_tiny_calls_stop_at_the_cap_and_long_calls_are_not_repeated_beyond_repeats():
    clock = FakeClock()
    tiny = FakeDevice(clock, lambda k: MS / 2 ** 20, lambda k: MS / 2 ** 20)
    calibrate(tiny, clock, kernels=2)
    assert tiny.calls.count((2, 16)) == 1 + CALIBRATION_MAX_CALLS
    long = FakeDevice(clock, lambda k: 0.125, lambda k: 0.125)         # 4 s a call at batch 16
    _, (timing,) = calibrate(long, clock, kernels=2, repeats=3)
    assert long.calls.count((2, 16)) == 1 + 3 and timing["forward_s"] == [2.0, 2.0]


def test_the_floor_from_the_environment_sets_each_window_and_a_bad_one_is_named(monkeypatch):
    clock = FakeClock()
    device = FakeDevice(clock, lambda k: MS / 16 + k * MS / 256, lambda k: 2 * (MS / 16 + k * MS / 256))
    monkeypatch.setenv(FLOOR_ENV, "0.0625")
    calibrate(device, clock)
    timed = device.calls.count((64, 16)) - 1             # the first is the warm-up
    assert timed == int(np.ceil(0.0625 / (15 * MS))) < int(np.ceil(CALIBRATION_FLOOR_S / (15 * MS)))
    for bad in ("fast", "0", "-1", "nan", "100"):
        monkeypatch.setenv(FLOOR_ENV, bad)
        with pytest.raises(ShardError, match=rf"{FLOOR_ENV}={bad!r}: expected the seconds"):
            calibrate(FakeDevice(clock, lambda k: MS, lambda k: MS), clock)
