"""hetconv-plan prints the plan the coordinator trains with: for the same calibrated devices, link
and flags, the same workers (and the same left out, with the same reason), modes, kernel and
image shares, micro-batches and predicted step. Both sides from fake calibration records: no
processes, nothing timed."""
import dataclasses
import json

import pytest

from hetconv.cli import plan as plan_cli
from hetconv.coordinator.remote import RemoteEngine
from hetconv.devices.cpu_options import CpuOptions
from hetconv.engine.costmodel import LayerCost, profiles_from_calibration
from hetconv.engine.microbatch import micro_batch_count
from hetconv.engine.policy import SHARED_CORES_WIRE_CPU_S_PER_BYTE, PlanSettings
from hetconv.geometry import IMAGE_SHAPE, NUM_CLASSES, ConvSpec, layer_input_shapes
from hetconv.training.config import Config
from test_parallel_plan import cpu_profile


def calibration_record(device, costs, kernels, batch):
    """What a worker's CALIBRATED reply leaves in RemoteEngine.calibration for a device whose
    layers cost `costs` (LayerCost per layer): its times at two kernel counts on the batch and
    on half of it, and its update and gradient-sum times, as LayerCost.fit reads them."""
    layers, speeds = [], []
    for cost, k in zip(costs, kernels):
        ks = [max(2, k // 2), max(1, k // 4)]

        def point(n):
            return {"batch": n, "kernels": ks, "forward_s": [cost.forward_s(kk, n) for kk in ks],
                    "backward_s": [cost.backward_s(kk, n) for kk in ks]}
        layers.append({**point(batch), "half_batch": point(batch // 2), "update_kernels": ks[0],
                       "update_s": cost.update_s(ks[0]), "accumulate_s": cost.accumulate_s(ks[0])})
        speeds.append(ks[0] / (cost.forward_s(ks[0], batch) + cost.backward_s(ks[0], batch)))
    return {"device": device, "description": f"{device}, faked", "speeds": speeds, "layers": layers,
            "conv_paths": [], "precision": "fp32"}


def network(args):
    cfg = Config(**args).validate()
    spec = cfg.network(IMAGE_SHAPE, NUM_CLASSES).spec
    specs = [ConvSpec.from_layer(layer) for layer in spec.conv_layers()]
    return cfg, specs, layer_input_shapes(specs, cfg.batch_size, IMAGE_SHAPE)[0]


def coordinator_plan(cfg, specs, input_shapes, calibration):
    """The plan RemoteEngine makes from its workers' calibration when it re-plans (a worker lost
    or joined), with the log it wrote: a RemoteEngine with no sockets, holding `calibration`."""
    engine = RemoteEngine.__new__(RemoteEngine)
    engine.exchange, engine.wire, engine.mode_choice, engine.micro_choice = cfg.exchange, "float32", None, None
    engine.peers = dict.fromkeys(calibration)
    engine.calibration = dict(calibration)
    said = []
    engine.log = said.append
    return engine.replan(specs, input_shapes, PlanSettings.of(cfg)), engine, said


def hetconv_plan_row(monkeypatch, capsys, tmp_path, calibration, flags):
    """hetconv-plan's JSON row for every device, each a saved profile of what `calibration` fits
    to (the coordinator's own fit), the coordinator's part of a step priced at 0 so its step is
    the policy's. The devices' names in the row are the workers' names in `calibration`."""
    paths = []
    for name, profile in profiles_from_calibration(calibration).items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps([profile.to_json()]))
        paths.append(f"@{path}")
    monkeypatch.setattr(plan_cli, "measure_coordinator_s", lambda *a, **kw: 0.0)
    assert plan_cli.main(["--devices", ",".join(paths), *flags, "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["rows"][-1]
    # hetconv-plan names device i "d{i}-@PATH": back to the workers' names
    names = dict(zip([f"d{i}-{p}" for i, p in enumerate(paths)], calibration))
    return row, names


def renamed(value, names):
    """`value` (JSON data) with hetconv-plan's device names replaced by the workers'."""
    text = json.dumps(value)
    for device, worker in names.items():
        text = text.replace(json.dumps(device), json.dumps(worker))
    return json.loads(text)


def assert_same_plan(row, names, plan, engine, cfg):
    assert renamed(row["plan"], names) == plan.to_json()        # workers, left out, modes, ranges, images, speeds
    assert row["modes"] == plan.modes()
    micro = (engine.micro_choice["micro_batches"] if engine.micro_choice else
             micro_batch_count(cfg.micro_batches, cfg.batch_size, cfg.exchange, len(plan.workers)))
    assert row["micro_batches"] == micro
    if engine.micro_choice:
        assert row["step_s"] == pytest.approx(engine.micro_choice["predicted_s"][micro], rel=1e-12)
    if engine.mode_choice is not None:
        assert row["mode_costs"]["modes"] == engine.mode_choice.modes
        assert row["mode_costs"]["reason"] == engine.mode_choice.reason


def test_a_device_too_slow_for_its_share_is_left_out_by_both(monkeypatch, capsys, tmp_path):
    args = {"conv": "32,64", "fc": "16", "batch_size": 64, "link": "10gbit", "parallel": "model"}
    cfg, specs, input_shapes = network(args)
    fast = LayerCost(2e-6, 4e-7, 4e-6, 8e-7, 1e-3, 2e-3)
    slow = LayerCost(2e-5, 4e-6, 4e-5, 8e-6, 0.05, 0.1)         # ten times slower, and 0.15 s a call
    kernels = [s.kernels for s in specs]
    calibration = {name: calibration_record("cpu", [cost] * len(specs), kernels, cfg.batch_size)
                   for name, cost in (("fast0", fast), ("slow", slow), ("fast1", fast))}
    plan, engine, said = coordinator_plan(cfg, specs, input_shapes, calibration)
    assert plan.workers == ("fast0", "fast1") and list(plan.left_out) == ["slow"]
    assert not any("splitting by measured speed" in line for line in said)
    row, names = hetconv_plan_row(monkeypatch, capsys, tmp_path, calibration,
                                  ["--conv", "32,64", "--fc", "16", "--batch-size", "64", "--link", "10gbit",
                                   "--parallel", "model"])
    assert_same_plan(row, names, plan, engine, cfg)
    assert renamed(row["left_out"], names) == plan.left_out


def test_parallel_auto_puts_some_layers_in_data_mode_in_both(monkeypatch, capsys, tmp_path):
    flags = ["--conv", "16,64,2048", "--ksize", "3", "--padding", "1", "--fc", "16", "--batch-size", "128",
             "--link", "100mbit", "--parallel", "auto"]
    cfg, specs, input_shapes = network({"conv": "16,64,2048", "ksize": 3, "padding": 1, "fc": "16", "batch_size": 128,
                                        "link": "100mbit", "parallel": "auto"})
    kernels = [s.kernels for s in specs]
    calibration = {name: calibration_record("cpu", cpu_profile(name, specs, IMAGE_SHAPE, flops=flops).layers, kernels,
                                            cfg.batch_size)
                   for name, flops in (("big", 80e9), ("small", 40e9))}
    plan, engine, _ = coordinator_plan(cfg, specs, input_shapes, calibration)
    # the early layers (big maps, few weights) data, the wide last one model
    assert plan.modes() == ["data", "data", "model"] and engine.mode_choice.modes == plan.modes()
    assert plan.layers[0].images["big"] > plan.layers[0].images["small"]
    assert engine.micro_choice is not None
    row, names = hetconv_plan_row(monkeypatch, capsys, tmp_path, calibration, flags)
    assert_same_plan(row, names, plan, engine, cfg)


def test_moving_bytes_costs_compute_where_a_hosts_workers_use_every_core():
    """Workers that take every core of their host leave none for the network stack: the cost model
    then charges each byte moved to their compute; with a core free, or a cost given, the link is
    priced as it is."""
    from hetconv.engine.costmodel import parse_bandwidth
    from hetconv.engine.policy import SHARED_CORES_WIRE_CPU_S_PER_BYTE, PlanSettings, link_for_cores
    link = parse_bandwidth("1gbit")
    assert link_for_cores(link, [1, 1], 2).host_cpu_s_per_byte == SHARED_CORES_WIRE_CPU_S_PER_BYTE
    assert link_for_cores(link, [0], 8).host_cpu_s_per_byte == SHARED_CORES_WIRE_CPU_S_PER_BYTE   # 0: every core
    assert link_for_cores(link, [1, 1], 4) == link and link_for_cores(link, [], 2) == link
    given = dataclasses.replace(link, host_cpu_s_per_byte=3e-9)
    assert link_for_cores(given, [1, 1], 2) == given


def test_the_coordinator_charges_the_wire_cpu_for_its_own_hosts_cpu_workers_only():
    """priced_link counts the threads of the CPU workers on the coordinator's host: a GPU worker
    there, or CPU workers on another host, leave this host's cores to its network."""
    from hetconv.engine.costmodel import parse_bandwidth
    from hetconv.engine.policy import Place, priced_link
    cores = 4
    places = {"a": Place("here", "cpu", cores, cores), "b": Place("here", "cuda:0", 0, cores),
              "c": Place("elsewhere", "cpu", 0, 0)}
    link = parse_bandwidth("1gbit")
    assert priced_link(link, places, ["a"], "here", cores).host_cpu_s_per_byte > 0
    assert priced_link(link, places, ["b", "c"], "here", cores).host_cpu_s_per_byte == 0
    assert priced_link(link, places, ["missing"], "here", cores).host_cpu_s_per_byte == 0


def test_the_coordinator_charges_the_wire_cpu_where_another_hosts_cpu_workers_fill_its_cores():
    """A worker says how many cores it may run on (HELLO's `cores`): where the CPU workers of any
    one host fill them (a one-thread worker pinned to one core, as the bench's emulated hosts run
    them; two workers of one host each on its own core), moving a byte costs them compute; a host
    with a core to spare, or that says nothing of its cores, leaves the link as given. The
    coordinator's workers are read as places (HELLO's fields, by the same names)."""
    from hetconv.coordinator.remote import _Peer
    from hetconv.engine.costmodel import parse_bandwidth
    from hetconv.engine.policy import SHARED_CORES_WIRE_CPU_S_PER_BYTE, PlanSettings, Place, priced_link

    def peer(key, threads, cores, device="cpu"):
        return _Peer(b"w", {"host_key": key, "device": device, "threads": threads, "cores": cores})
    peers = {"pinned": peer("h1", 1, 1), "spare": peer("h2", 1, 4), "all": peer("h3", 0, 8),
             "x": peer("h4", 2, 4), "y": peer("h4", 2, 4), "gpu": peer("h5", 1, 1, "cuda:0"),
             "silent": peer("h6", 1, 0)}
    link = parse_bandwidth("1gbit")
    for names, charged in ((["pinned"], True), (["spare"], False), (["all"], True), (["x", "y"], True),
                           (["x"], False), (["gpu", "spare"], False), (["silent"], False), (["spare", "pinned"], True)):
        for places in (peers, {n: Place(p.host_key, p.device, p.threads, p.cores) for n, p in peers.items()}):
            got = priced_link(link, places, names, "here", 2).host_cpu_s_per_byte
            assert got == (SHARED_CORES_WIRE_CPU_S_PER_BYTE if charged else 0.0), names
    # HELLO's field, checked: what is not a positive count says nothing
    for said, kept in ((3, 3), (0, 0), (-2, 0), (True, 0), ("8", 0), (2.5, 0), (1 << 40, 0)):
        assert _Peer(b"w", {"cores": said}).cores == kept


def fake_here(monkeypatch, module, cores=2):
    """`module` (hetconv-plan's or the coordinator's) on a host named "here" of `cores` cores, its
    loopback measured at 20 GB/s."""
    monkeypatch.setattr(module, "host_key", lambda: "here")
    monkeypatch.setattr(module, "usable_cores", lambda: cores)
    monkeypatch.setattr(module, "measure_loopback", lambda: 20e9)


def hetconv_plan_here(monkeypatch, capsys, devices, profile_of, flags):
    """hetconv-plan's JSON for `devices` calibrated here (faked: `profile_of(threads, kernels)` is
    what a CPU device of `threads` threads calibrates to on `kernels` per layer), this host of two
    cores, the coordinator's part of a step priced at 0."""
    fake_here(monkeypatch, plan_cli)
    monkeypatch.setattr(plan_cli, "calibrate_rounds", lambda runs, specs, shapes, **options: [
        profile_of(threads, kernels) for _, threads, kernels in runs])
    monkeypatch.setattr(plan_cli, "measure_coordinator_s", lambda *a, **kw: 0.0)
    assert plan_cli.main(["--devices", devices, *flags, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_hetconv_plan_prices_the_wire_cpu_for_each_set_of_devices_it_calibrates_here(monkeypatch, capsys):
    """hetconv-plan applies the coordinator's rule to the CPU devices calibrated on this host
    that each row prices: one one-thread device of two cores leaves a core to its network, two
    fill them; a saved profile's host says nothing of its cores and takes none of these."""
    args = {"conv": "32,64", "fc": "16", "batch_size": 64, "link": "1gbit", "parallel": "model"}
    cfg, specs, _ = network(args)
    kernels = [s.kernels for s in specs]
    cost = LayerCost(2e-6, 4e-7, 4e-6, 8e-7, 1e-3, 2e-3)
    profile = profiles_from_calibration({"cpu": calibration_record("cpu", [cost] * len(specs), kernels,
                                                                   cfg.batch_size)})["cpu"]
    flags = ["--conv", "32,64", "--fc", "16", "--batch-size", "64", "--link", "1gbit", "--parallel", "model"]
    data = hetconv_plan_here(monkeypatch, capsys, "cpu:1x2", lambda threads, kernels: profile, flags)
    assert [r["link"]["host_cpu_s_per_byte"] for r in data["rows"]] == [0.0, SHARED_CORES_WIRE_CPU_S_PER_BYTE]
    assert data["link"] == data["rows"][-1]["link"]
    given = hetconv_plan_here(monkeypatch, capsys, "cpu:1x2", lambda threads, kernels: profile,
                              flags + ["--wire-cpu-ns", "0"])
    assert [r["link"]["host_cpu_s_per_byte"] for r in given["rows"]] == [0.0, 0.0]     # as given
    assert given["rows"][-1]["plan"]["cores_together"]["workers"] == ["d0-cpu:1", "d1-cpu:1"]     # priced still


@pytest.mark.parametrize("precision, wire", [("auto", "bfloat16"), ("fp32", "float32")])
def test_hetconv_plan_plans_as_the_coordinator_with_shared_cores_and_precision_auto(monkeypatch, capsys, precision,
                                                                                     wire):
    """Two one-thread CPU workers sharing this host's two cores, whose calibration took bf16 on
    every call shape under --precision auto: hetconv-plan --devices cpu:1x2 and the coordinator's
    plan_for (its calibration faked, its workers' HELLOs read) give the same plan, priced over the
    same link (each byte costing the shared cores compute) with the same wire (bfloat16, from what
    the devices computed in), the same fallback speeds, and the same price of one device with
    both cores in their place."""
    from hetconv.coordinator.remote import _Peer
    from hetconv.engine import calibrated
    flags = ["--conv", "16,64,512", "--ksize", "3", "--padding", "1", "--fc", "16", "--batch-size", "64",
             "--link", "1gbit", "--parallel", "auto", "--precision", precision]
    cfg, specs, input_shapes = network({"conv": "16,64,512", "ksize": 3, "padding": 1, "fc": "16", "batch_size": 64,
                                        "link": "1gbit", "parallel": "auto", "precision": precision})
    kernels = [s.kernels for s in specs]
    computed = "bf16" if precision == "auto" else "fp32"
    one = {**calibration_record("cpu", cpu_profile("one", specs, IMAGE_SHAPE, flops=40e9).layers, kernels,
                                cfg.batch_size), "precision": computed}
    two = calibration_record("cpu", cpu_profile("two", specs, IMAGE_SHAPE, flops=70e9).layers, kernels, cfg.batch_size)
    profile = {1: profiles_from_calibration({"cpu:1": one})["cpu:1"],
               2: profiles_from_calibration({"cpu:2": two})["cpu:2"]}
    data = hetconv_plan_here(monkeypatch, capsys, "cpu:1x2", lambda threads, kernels: profile[threads], flags)
    names = ["d0-cpu:1", "d1-cpu:1"]                  # the coordinator's workers named as hetconv-plan names them

    fake_here(monkeypatch, calibrated)
    monkeypatch.setattr(calibrated, "calibrate_local", lambda *a, threads=None, **kw: profile[threads])
    engine = RemoteEngine.__new__(RemoteEngine)
    engine.exchange, engine.wire, engine.fixed_plan = cfg.exchange, cfg.wire_dtype, None
    engine.mode_choice = engine.micro_choice = None
    engine.cpu = CpuOptions.of(cfg)
    engine.peers = {n: _Peer(n.encode(), {"name": n, "device": "cpu", "host": "box", "host_key": "here",
                                          "threads": 1, "cores": 2}) for n in names}
    engine.calibration, engine.calibration_s = {}, 0.0
    engine.log = lambda line: None

    def calibrate(specs, input_shapes, settings):
        engine.calibration.update({n: dict(one) for n in names})
        return {n: list(one["speeds"]) for n in names}
    engine.calibrate = calibrate
    plan = engine.plan_for(specs, input_shapes, PlanSettings.of(cfg))

    row = data["rows"][-1]
    assert engine.wire == wire and row["wire"] == wire and data["wire"] == wire
    assert row["link"] == dataclasses.asdict(engine.workers_plan.link)
    assert row["link"]["host_cpu_s_per_byte"] == SHARED_CORES_WIRE_CPU_S_PER_BYTE
    assert plan.cores_together["workers"] == names and "step_s" in plan.cores_together
    assert_same_plan(row, dict(zip(names, names)), plan, engine, cfg)     # cores_together in the plan too
    assert data["note"] == plan.cores_together.get("note", "")


def test_a_saved_profile_keeps_what_its_device_computed_in_and_the_speeds_it_measured(tmp_path):
    """--save-profiles writes the precision and speeds a calibration found, which the plan's wire
    and its fallback split read; a profile saved without them computes in fp32 and splits by its
    cost lines where it must."""
    from hetconv.engine.costmodel import DeviceProfile
    from hetconv.engine.measure import load_profiles
    from hetconv.engine.policy import profile_speeds
    cost = LayerCost(2e-6, 4e-7, 4e-6, 8e-7, 1e-3, 2e-3)
    kept = DeviceProfile("a", "cpu", "", (cost, cost), "bf16 on 1 of 2 call shapes", (300.0, 200.0))
    path = tmp_path / "a.json"
    path.write_text(json.dumps([kept.to_json()]))
    assert load_profiles(str(path), 2) == [kept]
    assert profile_speeds({"a": kept}) == {"a": [300.0, 200.0]}
    old = {k: v for k, v in kept.to_json().items() if k not in ("precision", "speeds")}
    read = DeviceProfile.from_json(old)
    assert read.precision == "fp32" and read.speeds == ()
    assert profile_speeds({"a": kept, "b": read})["a"] != [300.0, 200.0]       # never two scales in one split
    path.write_text(json.dumps([{**old, "speeds": [1.0, -2.0]}]))
    with pytest.raises(ValueError, match=r"speeds \[1.0, -2.0\], expected positive kernels/s per layer"):
        load_profiles(str(path), 2)


def test_the_modes_are_chosen_with_the_micro_batches_the_step_runs():
    """A heterogeneous pair on resnet18: at the rule's two micro-batches, overlap makes every
    block model-parallel look as cheap as anything, but the step runs one micro-batch, where data
    blocks price lower. The modes chosen for each count are priced at their own cheapest count,
    and the cheapest pair of modes and count is the plan."""
    from hetconv.engine.costmodel import parse_bandwidth
    from hetconv.engine.graph import GraphPass
    from hetconv.engine.planner import choose_modes
    from hetconv.engine.policy import PlanFlags, choose_plan
    from hetconv.net import preset
    spec = preset("resnet18", IMAGE_SHAPE, NUM_CLASSES)
    specs = [ConvSpec.from_layer(b) for b in spec.conv_layers()]
    graph = GraphPass(spec, None).shape()
    profiles = {"fast": cpu_profile("fast", specs, IMAGE_SHAPE),
                "slow": cpu_profile("slow", specs, IMAGE_SHAPE, flops=15e9, bytes_per_s=3e9)}
    link, batch = parse_bandwidth("10gbit"), 64
    assert micro_batch_count(0, batch, "peer", 2) == 4
    at_rule = choose_modes(specs, IMAGE_SHAPE, batch, profiles, link, "auto", micro_batches=4, graph=graph)
    assert "data" not in at_rule.modes
    chosen = choose_plan(specs, IMAGE_SHAPE, batch, profiles, link, PlanFlags(parallel="auto"), graph=graph)
    assert "data" in chosen.plan.modes() and chosen.micro_batches == 1
    all_model = choose_plan(specs, IMAGE_SHAPE, batch, profiles, link, PlanFlags(parallel="model"), graph=graph)
    assert "data" not in all_model.plan.modes()           # priced at its own cheapest count
    assert chosen.step_s < 0.98 * all_model.step_s


def test_the_rules_a_run_follows_between_plans_are_the_engines():
    """How many micro-batches a run cuts its steps into and whether it re-splits from measured
    steps are engine.policy's rules (the training loop only asks them)."""
    from hetconv.engine.policy import rebalances, run_micro_batches
    assert run_micro_batches(0, 64, "peer", 2) == micro_batch_count(0, 64, "peer", 2) == 4
    assert run_micro_batches(0, 64, "peer", 2, {"micro_batches": 2}) == 2          # priced fewer as faster
    assert run_micro_batches(0, 64, "peer", 1, {"micro_batches": 4}) == 1          # never above the rule now
    assert run_micro_batches(3, 64, "peer", 2, {"micro_batches": 2}) == 3          # asked: never second-guessed
    assert rebalances("proportional", 5, False, 2)
    assert not rebalances("equal", 5, False, 2) and not rebalances("proportional", 1, False, 2)
    assert not rebalances("proportional", 5, True, 2) and not rebalances("proportional", 5, False, 1)


def test_the_head_sends_its_gradient_first_only_where_no_cpu_worker_shares_the_coordinators_host():
    from hetconv.engine.policy import Place, head_weights_later
    places = {"cpu_here": Place("here", "cpu:1"), "gpu_here": Place("here", "cuda:0"),
              "cpu_there": Place("there", "cpu")}
    assert head_weights_later(places, ["gpu_here", "cpu_there"], "here")
    assert not head_weights_later(places, ["cpu_here", "cpu_there"], "here")


def test_what_fails_any_plan_is_said_before_calibration():
    """One rule for a layer too narrow for its workers, before calibration (the coordinator) and
    after the devices are chosen (plan_from_lines): --parallel data lets a narrow layer pass."""
    from hetconv.engine.planner import PlanError, plan_from_lines
    from hetconv.engine.policy import PlanFlags, check_plannable
    with pytest.raises(PlanError, match="3 workers but a conv layer has only 2 kernels"):
        check_plannable([2, 8], 3, PlanFlags(parallel="auto"))
    check_plannable([2, 8], 3, PlanFlags(parallel="DM"))
    with pytest.raises(PlanError, match="--parallel data needs --exchange peer"):
        check_plannable([8, 8], 2, PlanFlags(parallel="data", exchange="star"))
    with pytest.raises(PlanError, match="3 workers but a conv layer has only 2 kernels"):
        plan_from_lines([2, 8], {w: [(0.0, 1e-3)] * 2 for w in "abc"}, use_all=True)


def test_the_text_output_shows_the_split_table_the_json_holds(monkeypatch, capsys, tmp_path):
    from hetconv.engine.planner import Plan
    flags = ["--conv", "32,64", "--fc", "16", "--batch-size", "64", "--link", "10gbit", "--parallel", "model"]
    cfg, specs, _ = network({"conv": "32,64", "fc": "16", "batch_size": 64, "link": "10gbit", "parallel": "model"})
    fast = LayerCost(2e-6, 4e-7, 4e-6, 8e-7, 1e-3, 2e-3)
    slow = LayerCost(2e-5, 4e-6, 4e-5, 8e-6, 0.05, 0.1)
    calibration = {name: calibration_record("cpu", [cost] * len(specs), [s.kernels for s in specs], cfg.batch_size)
                   for name, cost in (("fast0", fast), ("slow", slow), ("fast1", fast))}
    row, names = hetconv_plan_row(monkeypatch, capsys, tmp_path, calibration, flags)
    assert plan_cli.main(["--devices", ",".join(d.split("-", 1)[1] for d in names), *flags]) == 0
    out = capsys.readouterr().out
    table = Plan.from_json(row["plan"]).table()
    assert table in out and "left out" in table
