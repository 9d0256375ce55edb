"""Per conv layer, model- or data-parallel: the plan as data (modes, image shares), the cost of
each mode, the choice of the cheapest chain, and the --parallel flag. Pure: no processes."""
import dataclasses
import itertools
import json
import re

from hypothesis import assume, given, settings, strategies as st
import pytest

from hetconv.engine.planner import (Plan, PlanError, fixed_plan, image_ranges, make_plan, plan_from_lines, replan,
                                    step_calls)


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


def test_a_steps_call_shapes_are_each_workers_rows_and_kernels_per_micro_batch():
    """A data layer: the worker's rows of each micro-batch on every kernel; a model layer: every
    image of each micro-batch on the worker's kernels; each shape once, none with no rows."""
    from hetconv.geometry import ConvSpec
    specs = [ConvSpec(3, 8), ConvSpec(8, 6)]
    plan = fixed_plan([8, 6], {"a": [None, 4], "b": [None, 2]}, modes=["data", "model"], images={"a": 3, "b": 1})
    calls = step_calls(plan, specs, [(0, 3, 10, 10), (0, 8, 5, 5)], 10, 3)       # micro-batches of 4, 3, 3
    shapes = {w: [(layer, shape, k) for layer, _, shape, k in c] for w, c in calls.items()}
    assert shapes == {"a": [(0, (3, 3, 10, 10), 8), (0, (2, 3, 10, 10), 8), (1, (4, 8, 5, 5), 4), (1, (3, 8, 5, 5), 4)],
                      "b": [(0, (1, 3, 10, 10), 8), (1, (4, 8, 5, 5), 2), (1, (3, 8, 5, 5), 2)]}
    assert all(spec is specs[layer] for c in calls.values() for layer, spec, _, _ in c)


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


# ---- pricing each mode, and choosing the cheapest chain -------------------------------------

def _table(draw_costs, layers):
    node = [{"model": draw_costs[2 * li], "data": draw_costs[2 * li + 1]} for li in range(layers)]
    edge = [{}] + [{(a, b): draw_costs[2 * layers + 4 * (li - 1) + j]
                    for j, (a, b) in enumerate(itertools.product(("model", "data"), repeat=2))}
                   for li in range(1, layers)]
    return node, edge


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 7).flatmap(lambda n: st.tuples(st.just(n), st.lists(
    st.floats(0, 100, allow_nan=False), min_size=6 * n, max_size=6 * n))))
def test_the_dynamic_programme_finds_the_cheapest_of_all_assignments(case):
    from hetconv.engine.planner import cheapest_modes
    layers, values = case
    node, edge = _table(values, layers)

    def price(modes):
        return (sum(node[li][m] for li, m in enumerate(modes))
                + sum(edge[li][(modes[li - 1], modes[li])] for li in range(1, layers)))

    modes, seconds = cheapest_modes(node, edge)
    brute = min(price(list(m)) for m in itertools.product(("model", "data"), repeat=layers))
    assert seconds == pytest.approx(brute) and price(modes) == pytest.approx(seconds)


def test_on_a_tie_the_chain_with_fewer_data_layers_wins():
    from hetconv.engine.planner import cheapest_modes
    node = [{"model": 1.0, "data": 1.0}, {"model": 1.0, "data": 1.0}]
    edge = [{}, {(a, b): 0.0 for a in ("model", "data") for b in ("model", "data")}]
    assert cheapest_modes(node, edge) == (["model", "model"], 2.0)


def cpu_profile(name, specs, image, flops=50e9, bytes_per_s=10e9):
    """A CPU as calibration sees one, from each layer's shape: GEMMs at `flops`, expanding the
    input (fixed per image, whatever the kernels) and the update at `bytes_per_s`, 1-2 ms a call."""
    from hetconv.engine.costmodel import DeviceProfile, LayerCost, layer_geometry
    costs = []
    for spec, ((_, c, h, w), _) in zip(specs, layer_geometry(specs, image, 1)):
        ho, wo = spec.conv_hw(h, w)
        macs = c * spec.kh * spec.kw * ho * wo                # a kernel on an image
        expand = macs * 4 / bytes_per_s
        weights = c * spec.kh * spec.kw * 4 / bytes_per_s      # a kernel's weights, read once
        costs.append(LayerCost(expand, 2 * macs / flops, 2 * expand, 4 * macs / flops, 1e-3, 2e-3,
                               update_per_kernel_s=3 * weights, accumulate_per_kernel_s=weights))
    return DeviceProfile(name, "cpu", "", tuple(costs))


def _preset_specs(name):
    from hetconv.geometry import IMAGE_SHAPE, ConvSpec
    from hetconv.net.presets import preset
    return [ConvSpec.from_layer(layer) for layer in preset(name, IMAGE_SHAPE, 10).conv_layers()], IMAGE_SHAPE


def _step_s(specs, image, batch, profiles, link, modes, micro_batches=1):
    """What the one step of these modes costs (costmodel.predict_peer_step of the chain, its data
    layers splitting the images once): how a chain's plans are priced, as a graph's are."""
    from hetconv.engine.costmodel import chain_shape
    from hetconv.engine.steptasks import predict_peer_step
    from hetconv.engine.planner import mode_shares, one_image_split
    counts, _ = mode_shares(specs, batch, profiles, micro_batches)
    split = one_image_split(specs, batch, profiles, micro_batches)
    return predict_peer_step(specs, image, batch, counts, split, profiles, link, 0.0, chain_shape(specs, image),
                             list(modes), micro_batches).step_s


def test_vgg_small_on_1gbit_puts_its_early_layers_in_data_mode_and_the_paper_network_stays_model():
    from hetconv.engine.costmodel import parse_bandwidth
    from hetconv.engine.planner import choose_modes
    link = parse_bandwidth("1gbit")
    specs, image = _preset_specs("vgg-small")
    profiles = {w: cpu_profile(w, specs, image) for w in ("cpu0", "cpu1")}
    vgg = choose_modes(specs, image, 128, profiles, link, micro_batches=2)
    # 32 and 64 channels of 32x32 and 16x16 maps, a few thousand weights: moving the maps costs
    # far more than summing dW
    assert vgg.modes[:4] == ["data"] * 4
    assert vgg.chosen_s < 0.98 * vgg.model_s
    assert vgg.chosen_s == pytest.approx(_step_s(specs, image, 128, profiles, link, vgg.modes, 2))
    assert vgg.model_s == pytest.approx(_step_s(specs, image, 128, profiles, link, ["model"] * 8, 2))
    early = vgg.costs.detail[1]
    assert early["data"]["wire_s"] < 1e-3 < vgg.costs.edge[1][("model", "model")]
    specs, image = _preset_specs("paper")
    profiles = {w: cpu_profile(w, specs, image) for w in ("cpu0", "cpu1")}
    paper = choose_modes(specs, image, 128, profiles, link, micro_batches=2)
    # conv2's 18.75 M weights: a data conv2 would send 75 MB of dW each way every step
    assert paper.modes == ["model", "model"]
    assert paper.costs.node[1]["data"] > paper.costs.node[1]["model"] + 0.3
    json.dumps(paper.to_json())


def test_one_worker_is_all_model_and_parallel_forces_a_mode():
    from hetconv.engine.costmodel import parse_bandwidth
    from hetconv.engine.planner import check_parallel, choose_modes
    link = parse_bandwidth("1gbit")
    specs, image = _preset_specs("vgg-small")
    one = {"cpu0": cpu_profile("cpu0", specs, image)}
    assert choose_modes(specs, image, 32, one, link, parallel="data").modes == ["model"] * 8
    two = {w: cpu_profile(w, specs, image) for w in ("cpu0", "cpu1")}
    forced = choose_modes(specs, image, 32, two, link, parallel="model")
    assert forced.modes == ["model"] * 8 and forced.chosen_s == forced.model_s
    assert choose_modes(specs, image, 32, two, link, parallel="data").modes == ["data"] * 8
    with pytest.raises(PlanError, match="--parallel data: 2 workers cannot split a batch of 1 image\\(s\\)"):
        choose_modes(specs, image, 1, two, link, parallel="data")
    with pytest.raises(PlanError, match="--parallel must be one of auto, model, data, or a letter per conv layer "
                                        "\\(M model-parallel, D data-parallel\\) such as DDMM, got 'pipeline'"):
        check_parallel("pipeline")


def test_a_chain_of_letters_forces_each_layers_mode():
    """--parallel DDDDDDMM: each layer in the mode its letter says, priced as that chain; a
    chain of the wrong length, or a model layer with fewer kernels than workers, is named."""
    from hetconv.engine.costmodel import parse_bandwidth
    from hetconv.engine.planner import choose_modes, forced_modes
    link = parse_bandwidth("1gbit")
    specs, image = _preset_specs("vgg-small")
    two = {w: cpu_profile(w, specs, image) for w in ("cpu0", "cpu1")}
    for chain in ("DDDDDDMM", "MDMDMDMD", "MMMMMMMD"):
        modes = [{"M": "model", "D": "data"}[c] for c in chain]
        choice = choose_modes(specs, image, 32, two, link, parallel=chain)
        assert choice.modes == modes and choice.chosen_s == pytest.approx(_step_s(specs, image, 32, two, link, modes))
        assert f"--parallel {chain}" in choice.reason
    assert forced_modes("auto", 8) is None and forced_modes("data", 3) == ["data"] * 3
    with pytest.raises(PlanError, match="--parallel DDM: 3 letter\\(s\\) for a network of 8 conv layer\\(s\\)"):
        choose_modes(specs, image, 32, two, link, parallel="DDM")
    three = {w: cpu_profile(w, specs, image) for w in ("cpu0", "cpu1", "cpu2")}
    narrow = [dataclasses.replace(specs[0], kernels=2)] + specs[1:]
    with pytest.raises(PlanError, match="--parallel MDDDDDDD: 3 workers cannot split a conv layer of 2 kernel"):
        choose_modes(narrow, image, 32, three, link, parallel="MDDDDDDD")
    assert choose_modes(narrow, image, 32, three, link, parallel="DDDDDDDM").modes[0] == "data"


def test_a_data_layers_compute_and_wire():
    from hetconv.engine.costmodel import DeviceProfile, LayerCost, Link, mode_costs, transition_s, weight_floats
    from hetconv.geometry import conv_specs
    cost = LayerCost(1e-4, 1e-5, 2e-4, 2e-5, 0.01, 0.02, update_per_kernel_s=1e-6, accumulate_per_kernel_s=1e-7)
    # the image line of all kernels is the step's forward, backward, update and gradient sums
    fixed, per_image = cost.image_line(64, calls=2)
    step = sum(cost.forward_s(64, 8) + cost.backward_in_step_s(64, 8, m, 2) for m in range(2))
    assert fixed + 16 * per_image == pytest.approx(step)
    # two equal devices with no fixed nor call costs: the same compute in both modes
    specs = conv_specs([8, 16])
    flat = DeviceProfile("d", "cpu", "", (LayerCost(0.0, 1e-4, 0.0, 1e-4),) * 2)
    link = Link(1e6, 0.0)
    costs = mode_costs(specs, (3, 32, 32), 32, {"a": [4, 8], "b": [4, 8]}, {"a": [16, 16], "b": [16, 16]},
                       {"a": flat, "b": flat}, link)
    for li in range(2):
        assert costs.detail[li]["data"]["compute_s"] == pytest.approx(costs.detail[li]["model"]["compute_s"])
        # a data layer sends its dW (|W| + |b| floats) to its one peer, and receives the peer's
        assert costs.detail[li]["data"]["wire_s"] == pytest.approx(weight_floats(specs[li]) * 4 / 1e6)
        assert costs.detail[li]["model"]["wire_s"] == 0.0
    # the images all-gathered among the workers of a model first layer, not of a data one
    x = 32 * 3 * 32 * 32 * 4
    assert costs.detail[0]["model"]["coordinator_s"] == pytest.approx(x / 1e6 + x / 2 / 1e6)
    assert costs.detail[0]["data"]["coordinator_s"] == pytest.approx(x / 1e6)
    # transitions of a boundary of 1 MB between two workers holding half each
    half = [0.5, 0.5]
    assert transition_s(1e6, "data", "data", half, half, link) == 0.0
    assert transition_s(1e6, "model", "model", half, half, link) == pytest.approx(1.0)    # 0.5 MB each way, twice
    assert transition_s(1e6, "data", "model", half, half, link) == pytest.approx(1.0)
    assert transition_s(1e6, "model", "data", half, half, link) == pytest.approx(0.5)     # all-to-all: a quarter


def test_the_step_timeline_with_data_layers_agrees_with_the_choice():
    from hetconv.engine.costmodel import parse_bandwidth
    from hetconv.engine.steptasks import predict_any
    from hetconv.engine.planner import mode_shares
    link = parse_bandwidth("1gbit")
    specs, image = _preset_specs("vgg-small")
    profiles = {w: cpu_profile(w, specs, image) for w in ("cpu0", "cpu1")}
    counts, images = mode_shares(specs, 64, profiles, 2)
    model = predict_any("peer", specs, image, 64, counts, profiles, link, 0.01, 2)
    # all-model modes given explicitly: the very same prediction
    same = predict_any("peer", specs, image, 64, counts, profiles, link, 0.01, 2, modes=["model"] * 8, images=images)
    assert same.step_s == model.step_s and same.workers == model.workers
    data = predict_any("peer", specs, image, 64, counts, profiles, link, 0.01, 2, modes=["data"] * 8, images=images)
    mixed = predict_any("peer", specs, image, 64, counts, profiles, link, 0.01, 2, modes=["data"] * 4 + ["model"] * 4,
                      images=images)
    assert data.step_s < model.step_s and mixed.step_s < model.step_s
    # the coordinator's link carries the images once, the last layer's features and their gradient, in any mode
    assert data.coordinator_bytes == mixed.coordinator_bytes == model.coordinator_bytes
    # all-data moves no feature maps among the workers: each sends only its dW, once a step
    from hetconv.engine.costmodel import weight_floats
    sent = sum(weight_floats(s) * 4 for s in specs)
    assert data.workers["cpu0"]["recv"] == pytest.approx(sent)
    with pytest.raises(ValueError, match="--exchange star .* model-parallel only"):
        predict_any("star", specs, image, 64, counts, profiles, link, 0.01, modes=["data"] * 8, images=images)


@pytest.mark.parametrize("value", ["", "hybrid", "DXM", "ddx", None])
def test_the_parallel_flag_is_checked_with_the_config(value):
    from hetconv.training.config import Config
    assert Config().validate().parallel == "auto"
    for ok in ("auto", "model", "data", "DDMM", "M"):
        assert Config(parallel=ok).validate().parallel == ok
    with pytest.raises(ValueError, match=f"--parallel must be one of auto, model, data, or a letter per conv layer.* "
                                         f"got {re.escape(repr(value))}"):
        Config(parallel=value).validate()


# ---- hetconv-plan ----------------------------------------------------------------------------

def _plan_command(tmp_path, *args):
    import subprocess
    import sys
    from hetconv.engine.costmodel import DeviceProfile, LayerCost
    profile = tmp_path / "cpu.json"
    cost = LayerCost(1e-5, 1e-6, 2e-5, 2e-6)
    profile.write_text(json.dumps([DeviceProfile("cpu", "cpu", "a saved cpu", (cost,) * 2).to_json()]))
    return subprocess.run([sys.executable, "-m", "hetconv.cli.plan", "--devices", f"@{profile}x2", "--conv", "4,8",
                           "--fc", "8", "--batch-size", "8", "--bandwidth", "1gbit", *args],
                          capture_output=True, text=True, timeout=120)


def test_plan_command_shows_both_modes_per_layer_and_records_the_chosen_ones(tmp_path):
    forced = _plan_command(tmp_path, "--parallel", "data", "--json")
    assert forced.returncode == 0, forced.stderr
    one, two = json.loads(forced.stdout)["rows"]
    assert one["modes"] == ["model", "model"]                     # one device: the modes are the same
    assert two["modes"] == ["data", "data"]
    plan = Plan.from_json(two["plan"])
    assert plan.modes() == ["data", "data"] and sum(plan.layers[0].images.values()) == 8
    assert two["plan"]["layers"][1]["images"] == plan.layers[1].images
    assert [set(layer["mode_s"]) for layer in two["mode_costs"]["layers"]] == [{"model", "data"}] * 2
    text = _plan_command(tmp_path, "--parallel", "model")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert any(line.split()[-1] == "model" and line.startswith("conv2") for line in lines)
    assert "--parallel model" in text.stdout and "per conv layer with 2 device(s)" in text.stdout
    chain = _plan_command(tmp_path, "--parallel", "DM", "--json")
    assert chain.returncode == 0, chain.stderr
    assert [row["modes"] for row in json.loads(chain.stdout)["rows"]] == [["model", "model"], ["data", "model"]]


@pytest.mark.parametrize("args,message", [
    (["--parallel", "hybrid"], "hetconv-plan: --parallel must be one of auto, model, data, or a letter per conv "
                               "layer (M model-parallel, D data-parallel) such as DDMM, got 'hybrid'"),
    (["--parallel", "data", "--exchange", "star"], "hetconv-plan: --parallel data needs --exchange peer"),
    (["--parallel", "MD", "--exchange", "star"], "hetconv-plan: --parallel MD needs --exchange peer"),
    (["--parallel", "DMD"], "hetconv-plan: --parallel DMD: 3 letter(s) for a network of 2 conv layer(s)"),
])
def test_plan_command_names_a_bad_parallel_in_one_line(tmp_path, args, message):
    bad = _plan_command(tmp_path, *args)
    assert bad.returncode == 2 and message in bad.stderr, bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0.1, 1000), min_size=2, max_size=5), st.integers(5, 300))
def test_a_data_layer_between_model_layers_splits_the_batch_in_proportion_to_its_speeds(speeds, batch):
    names = [f"w{i}" for i in range(len(speeds))]
    plan = make_plan([8, 16, 8], {w: [1.0, s, 1.0] for w, s in zip(names, speeds)}, modes=["model", "data", "model"],
                     batch=batch)
    images = plan.layers[1].images
    assert sum(images.values()) == batch and min(images.values()) >= 1
    exact = [batch * s / sum(speeds) for s in speeds]
    assume(min(exact) >= 1)                 # else the at-least-one-image rule moves shares
    assert all(abs(images[w] - e) < 1 for w, e in zip(names, exact))


def test_cost_lines_give_plan_from_lines_what_a_data_layer_splits_by():
    from hetconv.engine.planner import cost_lines
    specs, image = _preset_specs("vgg-small")
    fast = cpu_profile("fast", specs, image, flops=150e9, bytes_per_s=30e9)
    slow = cpu_profile("slow", specs, image)
    kernels = [s.kernels for s in specs]
    lines, image_lines = cost_lines({"fast": fast, "slow": slow}, kernels, 64, calls=2)
    assert image_lines["slow"][0] == slow.layers[0].image_line(kernels[0], 2)
    plan = plan_from_lines(kernels, lines, use_all=True, modes=["data"] * 2 + ["model"] * 6, batch=64,
                           image_lines=image_lines)
    first = plan.layers[0].images
    assert first == plan.layers[1].images and 64 * 0.6 < first["fast"] < 64 * 0.8


def test_the_step_timeline_names_missing_images_or_bad_modes():
    from hetconv.engine.costmodel import DeviceProfile, LayerCost, Link
    from hetconv.engine.steptasks import predict_any
    from hetconv.geometry import conv_specs
    flat = DeviceProfile("d", "cpu", "", (LayerCost(0.0, 1e-4, 0.0, 1e-4),) * 2)
    args = (conv_specs([4, 8]), (3, 32, 32), 8, {"a": [2, 4], "b": [2, 4]}, {"a": flat, "b": flat}, Link(1e9), 0.0)
    with pytest.raises(ValueError, match="data layers need images"):
        predict_any("peer", *args, modes=["data", "model"])
    with pytest.raises(ValueError, match="expected one of model, data for each of the 2 conv layers"):
        predict_any("peer", *args, modes=["data"], images={"a": [4], "b": [4]})
