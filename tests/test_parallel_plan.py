"""Per conv layer, model- or data-parallel: the plan as data (modes, image shares), the cost of
each mode, the choice of the cheapest chain, and the --parallel flag. Pure: no processes."""
import itertools
import json

from hypothesis import given, settings, strategies as st
import pytest

from hetconv.engine.planner import Plan, PlanError, fixed_plan, image_ranges, make_plan, plan_from_lines, replan


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 1000), min_size=1, max_size=6), st.integers(0, 600))
def test_image_ranges_are_contiguous_sum_to_n_and_proportional(weights, n):
    names = [f"w{i}" for i in range(len(weights))]
    plan = fixed_plan([8], {w: [None] for w in names}, modes=["data"], images=dict(zip(names, weights)))
    ranges = image_ranges(plan.layers[0], n)
    assert list(ranges) == names
    start = 0
    for w, weight in zip(names, weights):
        lo, hi = ranges[w]
        assert lo == start and hi >= lo
        assert abs((hi - lo) - n * weight / sum(weights)) < 1          # largest remainder: within one image
        start = hi
    assert start == n
    # the whole batch splits exactly as the plan's shares
    assert {w: hi - lo for w, (lo, hi) in image_ranges(plan.layers[0], sum(weights)).items()} == dict(zip(names, weights))


def test_a_micro_batch_smaller_than_the_workers_leaves_some_with_no_rows():
    plan = fixed_plan([8], {"a": [None], "b": [None], "c": [None]}, modes=["data"], images={"a": 2, "b": 1, "c": 1})
    assert image_ranges(plan.layers[0], 1) == {"a": (0, 1), "b": (1, 1), "c": (1, 1)}
    assert image_ranges(plan.layers[0], 0) == {"a": (0, 0), "b": (0, 0), "c": (0, 0)}
    with pytest.raises(PlanError, match="only a data layer splits images"):
        image_ranges(fixed_plan([4], {"a": [2], "b": [2]}).layers[0], 4)
    with pytest.raises(PlanError, match="n must be a count of images"):
        image_ranges(plan.layers[0], -1)


def test_make_plan_splits_data_layers_images_by_the_speeds_that_split_kernels():
    speeds = {"fast": [300.0, 30.0], "slow": [100.0, 10.0]}
    plan = make_plan([32, 64], speeds, modes=["data", "model"], batch=128)
    data, model = plan.layers
    assert data.mode == "data" and data.images == {"fast": 96, "slow": 32}
    assert data.ranges == {"fast": (0, 32), "slow": (0, 32)} and data.count("slow") == 32
    assert model.mode == "model" and model.images == {} and model.ranges == {"fast": (0, 48), "slow": (48, 64)}
    # without modes: exactly today's all-model plan
    assert make_plan([32, 64], speeds) == make_plan([32, 64], speeds, modes=["model", "model"])
    assert make_plan([32, 64], speeds, "equal", modes=["data", "data"], batch=5).layers[1].images == {"fast": 3, "slow": 2}


def test_consecutive_data_layers_share_one_split_from_their_times_together():
    # per image, fast takes 32/300 + 64/10 s, slow 32/100 + 64/30 s over the run: about 0.42 : 0.58...
    speeds = {"fast": [300.0, 10.0], "slow": [100.0, 30.0]}
    plan = make_plan([32, 64], speeds, modes=["data", "data"], batch=100)
    first, second = plan.layers
    assert first.images == second.images
    fast = 1 / (32 / 300 + 64 / 10)
    slow = 1 / (32 / 100 + 64 / 30)
    assert first.images["fast"] == round(100 * fast / (fast + slow))
    # by calibrated lines, the run's lines add up: each device's two layers take as long in total
    lines = {"a": [(0.0, 1.0), (0.0, 1.0)], "b": [(0.0, 1.0), (0.0, 1.0)]}
    image_lines = {"a": [(0.0, 0.001), (0.0, 0.003)], "b": [(0.0, 0.003), (0.0, 0.001)]}
    both = plan_from_lines([16, 16], lines, use_all=True, modes=["data", "data"], batch=64, image_lines=image_lines)
    assert both.layers[0].images == both.layers[1].images == {"a": 32, "b": 32}


@pytest.mark.parametrize("kwargs,message", [
    ({"modes": ["data"], "batch": 8}, "expected one of model, data for each of the 2 conv layers"),
    ({"modes": ["data", "pipeline"], "batch": 8}, "expected one of model, data for each of the 2 conv layers"),
    ({"modes": ["data", "model"]}, "batch must be a positive int, got None"),
    ({"modes": ["data", "model"], "batch": 1}, "cannot give 2 workers at least 1 image each of a batch of 1"),
])
def test_bad_modes_or_batch_are_named(kwargs, message):
    with pytest.raises(PlanError, match=message):
        make_plan([8, 8], {"a": [1.0, 1.0], "b": [1.0, 1.0]}, **kwargs)


def test_fixed_plan_forces_modes_and_checks_images():
    plan = fixed_plan([4, 8], {"a": [None, 3], "b": [None, 5]}, modes=["data", "model"], images={"a": 5, "b": 3})
    assert plan.modes() == ["data", "model"] and plan.layers[0].images == {"a": 5, "b": 3}
    per_layer = fixed_plan([4, 8, 8], {"a": [0, 4, 0], "b": [0, 4, 0]}, modes=["data", "model", "data"],
                           images={"a": [1, 0, 2], "b": [3, 0, 2]})
    assert [lp.images for lp in per_layer.layers] == [{"a": 1, "b": 3}, {}, {"a": 2, "b": 2}]
    # a worker keeps its images from one data layer to the next: nothing moves between them
    with pytest.raises(PlanError, match="consecutive data layers with different images"):
        fixed_plan([4, 8], {"a": [0, 0], "b": [0, 0]}, modes=["data", "data"], images={"a": [1, 2], "b": [3, 2]})
    with pytest.raises(PlanError, match="images must give every worker"):
        fixed_plan([4], {"a": [0], "b": [0]}, modes=["data"], images={"a": 3})
    with pytest.raises(PlanError, match="must be ints >= 0 with a positive sum"):
        fixed_plan([4], {"a": [0], "b": [0]}, modes=["data"], images={"a": -1, "b": 3})
    with pytest.raises(PlanError, match="images must sum to one batch"):
        fixed_plan([4, 4, 4], {"a": [0, 2, 0], "b": [0, 2, 0]}, modes=["data", "model", "data"],
                   images={"a": [1, 0, 2], "b": [3, 0, 3]})


def test_plan_json_and_table_round_trip_with_modes():
    plan = make_plan([32, 64], {"a": [3.0, 1.0], "b": [1.0, 1.0]}, modes=["data", "model"], batch=128)
    data = json.loads(json.dumps(plan.to_json()))
    assert [lp["mode"] for lp in data["layers"]] == ["data", "model"]
    assert data["layers"][0]["images"] == {"a": 96, "b": 32} and "images" not in data["layers"][1]
    assert Plan.from_json(data) == plan
    everything_model = make_plan([32, 64], {"a": [3.0, 1.0], "b": [1.0, 1.0]})
    stored = everything_model.to_json()
    for lp in stored["layers"]:
        del lp["mode"]                                  # a plan stored without modes is all-model
    assert Plan.from_json(stored) == everything_model
    table = plan.table()
    assert "conv1 (32) data" in table and "conv2 (64) model" in table
    assert "96 img" in table and "32 @ 1 kernels/s" in table
    with pytest.raises(PlanError, match="not a stored plan"):
        Plan.from_json({"workers": ["a"]})


def test_plan_from_lines_finishes_data_layers_together_and_replan_moves_images():
    # per image: a 1 ms, b 3 ms (and no fixed part): a takes 3/4 of the images
    lines = {"a": [(0.0, 1.0), (0.0, 1.0)], "b": [(0.0, 1.0), (0.0, 1.0)]}
    image_lines = {"a": [(0.0, 0.001), None], "b": [(0.0, 0.003), None]}
    plan = plan_from_lines([16, 16], lines, use_all=True, modes=["data", "model"], batch=64, image_lines=image_lines)
    assert plan.layers[0].images == {"a": 48, "b": 16} and plan.layers[1].ranges == {"a": (0, 8), "b": (8, 16)}
    # an even split of equal devices where b measured twice as slow: b's images move to a
    even = fixed_plan([16, 16], {"a": [0, 8], "b": [0, 8]}, modes=["data", "model"], images={"a": 32, "b": 32})
    moved = replan(even, {"a": None, "b": None}, {"a": [0.032, 0.008], "b": [0.064, 0.008]})
    assert moved.modes() == ["data", "model"] and moved.layers[0].images == {"a": 43, "b": 21}
    assert moved.layers[1].ranges == {"a": (0, 8), "b": (8, 16)}
