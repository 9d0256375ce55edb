import json

import pytest

from hetconv.engine.planner import PlanError, fixed_plan, largest_remainder, make_plan


@pytest.mark.parametrize("total,weights", [(500, [1, 1]), (1500, [3, 1, 1]), (7, [1, 2, 3]), (10, [0.001, 1000]),
                                           (4, [1, 1, 1, 1]), (1501, [2.5, 2.5])])
def test_shares_sum_exactly_and_each_worker_gets_one(total, weights):
    shares = largest_remainder(total, weights)
    assert sum(shares) == total and min(shares) >= 1 and len(shares) == len(weights)


def test_shares_are_proportional_within_one_kernel():
    shares = largest_remainder(1500, [300.0, 100.0, 100.0])
    assert shares == [900, 300, 300]
    assert largest_remainder(10, [1000.0, 1.0]) == [9, 1]      # the slow worker still gets one
    assert largest_remainder(10, [1, 1, 1]) == [4, 3, 3]        # ties go to the earlier worker


def test_plan_ranges_are_contiguous_and_per_layer():
    plan = make_plan([500, 1500], {"gpu": [1000.0, 5000.0], "cpu": [1000.0, 1000.0]})
    l0, l1 = plan.layers
    assert l0.ranges == {"gpu": (0, 250), "cpu": (250, 500)}
    assert l1.ranges == {"gpu": (0, 1250), "cpu": (1250, 1500)}     # the GPU's lead differs per layer


def test_equal_policy_ignores_speeds():
    plan = make_plan([10], {"a": [100.0], "b": [1.0]}, "equal")
    assert plan.layers[0].ranges == {"a": (0, 5), "b": (5, 10)}


def test_plan_is_deterministic_and_serialisable():
    speeds = {"w0": [3.0, 5.0], "w1": [7.0, 1.0]}
    a, b = make_plan([50, 60], speeds), make_plan([50, 60], speeds)
    assert a == b
    data = json.loads(json.dumps(a.to_json()))
    assert data["layers"][1]["kernels"] == {"w0": 50, "w1": 10}
    assert "w0" in a.table() and "conv2 (60)" in a.table()


def test_more_workers_than_kernels_is_refused():
    with pytest.raises(PlanError, match="cannot give 3 workers at least 1 kernel"):
        make_plan([2], {"a": [1.0], "b": [1.0], "c": [1.0]})


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_speeds_are_refused(bad):
    with pytest.raises(PlanError, match="speeds must be positive and finite"):
        make_plan([10], {"a": [1.0], "b": [bad]})


def test_unknown_policy_and_wrong_layer_count():
    with pytest.raises(PlanError, match="unknown split policy 'fastest'"):
        make_plan([10], {"a": [1.0]}, "fastest")
    with pytest.raises(PlanError, match="reported 1 layer speeds, expected 2"):
        make_plan([10, 10], {"a": [1.0]})


def test_fixed_plan_checks_counts():
    assert fixed_plan([5], {"a": [2], "b": [3]}).layers[0].ranges == {"a": (0, 2), "b": (2, 5)}
    with pytest.raises(PlanError, match="must be >= 1 and sum to 5"):
        fixed_plan([5], {"a": [1], "b": [1]})


def test_replan_moves_kernels_toward_the_worker_that_measured_faster():
    from hetconv.engine.planner import replan
    plan = fixed_plan([32, 256], {"a": [2, 8], "b": [30, 248]})
    # two equal devices, each 1 ms a kernel: a holding few kernels finished quickly, b slowly
    measured = {"a": [0.002, 0.008], "b": [0.030, 0.248]}
    lines = {"a": [(0.0, 0.001), (0.0, 0.001)], "b": [(0.0, 0.001), (0.0, 0.001)]}
    new = replan(plan, lines, measured)
    assert new is not None
    assert new.layers[1].count("a") == 128 and new.layers[0].count("a") == 16


def test_replan_keeps_a_balanced_plan():
    from hetconv.engine.planner import replan
    plan = fixed_plan([32, 256], {"a": [16, 128], "b": [16, 128]})
    measured = {"a": [0.016, 0.128], "b": [0.0165, 0.129]}
    assert replan(plan, {"a": None, "b": None}, measured) is None


def test_replan_does_not_take_fixed_cost_for_slowness():
    from hetconv.engine.planner import replan
    # a's time is mostly a fixed pass (0.05 s) that every share pays: per kernel, both are equal
    plan = fixed_plan([100], {"a": [10], "b": [90]})
    lines = {"a": [(0.05, 0.001)], "b": [(0.05, 0.001)]}
    measured = {"a": [0.06], "b": [0.14]}
    new = replan(plan, lines, measured)
    assert new.layers[0].count("a") == 50
    # without the calibrated line the same numbers read as a being 2.3x slower per kernel
    blind = replan(plan, {"a": None, "b": None}, measured)
    assert blind is None or blind.layers[0].count("a") < 50


def _lines(fixed, per_kernel, layers=2):
    return [(fixed, per_kernel)] * layers


def test_affine_shares_finish_together_and_drop_a_device_whose_fixed_part_is_too_long():
    from hetconv.engine.planner import affine_shares
    shares = affine_shares(100, [(0.0, 1.0), (10.0, 1.0)])      # the second pays 10 s before its first kernel
    assert shares == pytest.approx([55.0, 45.0])
    assert affine_shares(100, [(0.0, 0.01), (5.0, 1.0)]) == pytest.approx([100.0, 0.0])


def test_a_slow_cpu_beside_a_50x_gpu_is_left_out_when_its_fixed_work_slows_the_step():
    from hetconv.engine.planner import plan_from_lines, predicted_compute_s
    # per step at the batch: the GPU 50x faster per kernel and with little fixed work
    gpu, cpu = _lines(0.005, 0.0002), _lines(0.4, 0.01)
    plan = plan_from_lines([500, 1500], {"gpu": gpu, "cpu": cpu})
    assert plan.workers == ("gpu",) and "cpu" in plan.left_out
    assert "adds 0.8 s of fixed work a step" in plan.left_out["cpu"]
    assert "left out, adds" in plan.table()
    forced = plan_from_lines([500, 1500], {"gpu": gpu, "cpu": cpu}, use_all=True)
    assert forced.workers == ("gpu", "cpu") and not forced.left_out
    lines = {"gpu": gpu, "cpu": cpu}
    assert predicted_compute_s([500, 1500], lines, ["gpu"]) < predicted_compute_s([500, 1500], lines, ["gpu", "cpu"])


def test_a_cpu_that_helps_is_kept():
    from hetconv.engine.planner import plan_from_lines
    gpu, cpu = _lines(0.005, 0.0002), _lines(0.001, 0.004)      # little fixed work: its share pays
    plan = plan_from_lines([500, 1500], {"gpu": gpu, "cpu": cpu})
    assert plan.workers == ("gpu", "cpu") and not plan.left_out
    assert 0 < plan.layers[1].count("cpu") < plan.layers[1].count("gpu")


@pytest.mark.parametrize("bad", [0.0, float("nan"), float("inf")])
def test_a_zero_or_non_finite_calibrated_line_is_refused_naming_the_worker_and_the_layer(bad):
    """A device whose kernels cost nothing would have its share sized by dividing by that cost:
    the plan refuses it in one line instead of a ZeroDivisionError."""
    from hetconv.engine.planner import plan_from_lines
    lines = {"w0": [(0.01, 1e-3), (0.02, 2e-3)], "w1": [(0.01, 1e-3), (0.0, bad)]}
    with pytest.raises(PlanError, match=rf"worker 'w1': conv2's calibrated seconds per kernel {bad!r}, expected a "
                                        r"positive finite number \(a zero or non-finite calibration\)"):
        plan_from_lines([8, 8], lines)
    lines["w1"][1] = (float("nan"), 1e-3)
    with pytest.raises(PlanError, match=r"worker 'w1': conv2's calibrated fixed seconds nan, expected a finite"):
        plan_from_lines([8, 8], lines)


def test_a_zero_calibrated_profile_is_refused_before_the_cost_model_prices_it():
    """A profile (from a file or a worker) whose every time is 0, or with one field non-finite,
    is named with its worker, layer and field by cost_lines and choose_modes."""
    from hetconv.engine.costmodel import DeviceProfile, LayerCost
    from hetconv.engine.planner import choose_modes, cost_lines
    from hetconv.geometry import conv_specs
    good = LayerCost(1e-4, 1e-5, 2e-4, 2e-5)
    zero = LayerCost(0.0, 0.0, 0.0, 0.0)
    profiles = {"a": DeviceProfile("a", "cpu", "", (good, good)), "b": DeviceProfile("b", "cpu", "", (good, zero))}
    with pytest.raises(PlanError, match=r"worker 'b': conv2's calibrated forward_per_kernel_s and "
                                        r"backward_per_kernel_s are both 0"):
        cost_lines(profiles, [8, 8], 16)
    profiles["b"] = DeviceProfile("b", "cpu", "", (LayerCost(1e-4, 1e-5, 2e-4, float("inf")), good))
    with pytest.raises(PlanError, match=r"worker 'b': conv1's calibrated backward_per_kernel_s inf, expected finite"):
        choose_modes(conv_specs([8, 8], 3), (3, 16, 16), 16, profiles, None)


def test_a_grouped_convs_ranges_move_to_whole_groups_and_a_depthwise_one_splits_anywhere():
    from hetconv.engine.planner import whole_groups
    from hetconv.geometry import ConvBlock, ConvSpec
    grouped = ConvSpec(16, 32, 3, 3, ConvBlock(groups=4))          # 8 kernels a group
    depthwise = ConvSpec(16, 16, 3, 3, ConvBlock(groups=16))
    dense = ConvSpec(16, 32, 3, 3, ConvBlock())
    plan = make_plan([32, 16, 32], {"a": [1.0] * 3, "b": [2.0] * 3, "c": [3.0] * 3})
    aligned = whole_groups(plan, [grouped, depthwise, dense])
    assert aligned.layers[1:] == plan.layers[1:]                    # depthwise and dense: as they were
    ranges = [aligned.layers[0].ranges[w] for w in ("a", "b", "c")]
    assert ranges == [(0, 8), (8, 16), (16, 32)], ranges            # shares 5.3, 10.7, 16: to whole groups
    for w in "abc":
        grouped.kernel_slice(*aligned.layers[0].ranges[w])          # each a slice a shard can hold
    few = ConvSpec(4, 4, 3, 3, ConvBlock(groups=2))
    with pytest.raises(PlanError, match=r"conv layer 1 \(conv 4 3x3/1 pad 0 groups 2, .*\): its 2 groups cannot be "
                                        r"split among 3 workers in model mode"):
        whole_groups(make_plan([4], {"a": None, "b": None, "c": None}, "equal"), [few])


def test_of_plans_priced_alike_auto_takes_the_one_moving_fewest_bytes_but_never_loses_to_all_model():
    from hetconv.engine.planner import TRAFFIC_TIE, fewest_bytes_of_alike
    all_data, late_model, mixed = ("data",) * 3, ("data", "data", "model"), ("data", "model", "data")
    priced = {all_data: 1.00, late_model: 1.00 + TRAFFIC_TIE / 2, mixed: 1.00 + 2 * TRAFFIC_TIE}
    moved = {all_data: 90e6, late_model: 40e6, mixed: 10e6}
    assert fewest_bytes_of_alike(priced, moved, beat=2.0) == late_model     # mixed is not priced alike
    assert fewest_bytes_of_alike(priced, moved, beat=1.01) == all_data      # late_model would not beat all-model
    assert fewest_bytes_of_alike(priced, moved, beat=0.5) == all_data       # none beats it: the cheapest


def test_one_largest_remainder_split_for_kernels_images_and_affine_shares():
    """Kernels (at least one each), images (none is fine) and the cost lines' float shares are
    cut by the one function: the cost model's rows and the planner's ranges cannot part."""
    from hetconv.engine import costmodel, planner
    assert planner.largest_remainder is costmodel.largest_remainder and planner.check_modes is costmodel.check_modes
    assert not hasattr(planner, "_integer_shares") and not hasattr(costmodel, "largest_remainder_shares")
    assert largest_remainder(3, [0, 1, 1], minimum=0) == [0, 2, 1]
    assert largest_remainder(3, [0, 1, 1]) == [1, 1, 1]                  # a kernel each: taken from the most
    assert largest_remainder(10, [2.5, 7.5]) == [3, 7]                   # exact shares, rounded (ties earlier)
    with pytest.raises(PlanError, match=r"finite weights >= 0 with a positive sum, got \[0, 0\]"):
        largest_remainder(4, [0, 0], minimum=0)
    assert costmodel.check_modes(None, 2) == ["model", "model"]
    with pytest.raises(PlanError, match="expected one of model, data for each of the 2 conv layers"):
        costmodel.check_modes(["data"], 2)
