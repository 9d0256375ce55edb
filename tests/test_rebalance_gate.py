"""A re-split from measured steps only where it gains more than the steps' own noise, and a
re-split that would move a share back the way the last one moved it only for twice that: no
splits flip-flopping on a noisy host."""
import pytest

from hetconv.engine.contract import ShardEngine
from hetconv.engine.local import LocalEngine
from hetconv.engine.planner import fixed_plan

KERNELS = [8, 16]


def engine_measured(per_step):
    """An engine with a two-worker plan (even kernels) and each worker's compute per step as
    measured: {worker: [seconds of each step]}, each step's time split over the layers by kernels.
    (In-process shards share a device and never re-split: propose() calls the distributed engines'
    own rule, ShardEngine's.)"""
    engine = LocalEngine({})
    engine.plan = fixed_plan(KERNELS, {"a": [4, 8], "b": [4, 8]})
    engine.batch = 16
    engine.calibration = {}
    engine.reset_layer_timings()
    for step in range(len(per_step["a"])):
        for name, samples in per_step.items():
            layers = engine.layer_compute.setdefault(name, {0: 0.0, 1: 0.0})
            layers[0] += samples[step] / 3
            layers[1] += 2 * samples[step] / 3
        engine.close_measured_step()
    return engine


def propose(engine):
    return ShardEngine.propose_rebalance(engine, None)


def test_a_steady_gap_is_rebalanced_and_the_same_gap_inside_the_noise_is_not():
    steady = engine_measured({"a": [1.0, 1.0, 1.0, 1.0], "b": [1.2, 1.2, 1.2, 1.2]})
    assert steady.step_compute["b"] == pytest.approx([1.2, 1.2, 1.2, 1.2])
    assert steady.rebalance_gate(0.05) == 0.05
    plan = propose(steady)
    assert plan is not None and plan.layers[1].count("a") > 8

    # the same means, each step far from them: a 20% gain is inside twice the noise
    noisy = engine_measured({"a": [0.5, 1.5, 0.6, 1.4], "b": [0.7, 1.7, 0.8, 1.6]})
    assert noisy.rebalance_gate(0.05) > 0.2
    assert propose(noisy) is None


def test_a_share_moved_back_needs_twice_the_gain():
    engine = engine_measured({"a": [1.0] * 4, "b": [1.2] * 4})
    first = propose(engine)
    assert first is not None
    # as if under that plan, worker a's share now measured a little slow: a gain above the gate
    # (5%) but below twice it moves nothing back
    engine.plan = first
    a_share = {0: first.layers[0].count("a") / 8, 1: first.layers[1].count("a") / 16}
    engine.reset_layer_timings()
    for _ in range(4):
        for name, slower in (("a", 1.08), ("b", 1.0)):
            share = {li: a_share[li] if name == "a" else 1 - a_share[li] for li in (0, 1)}
            layers = engine.layer_compute.setdefault(name, {0: 0.0, 1: 0.0})
            layers[0] += slower * share[0] / 3
            layers[1] += slower * 2 * share[1] / 3
        engine.close_measured_step()
    assert propose(engine) is None
