"""hetconv-plan prints the plan the coordinator trains with: for the same calibrated devices, link
and flags, the same workers (and the same left out, with the same reason), modes, kernel and
image shares, micro-batches and predicted step. Both sides from fake calibration records: no
processes, nothing timed."""
import dataclasses
import json

import pytest

from hetconv.cli import plan as plan_cli
from hetconv.coordinator.remote import RemoteEngine
from hetconv.engine.costmodel import LayerCost, profiles_from_calibration
from hetconv.engine.microbatch import micro_batch_count
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
    return engine.replan(specs, input_shapes, cfg), engine, said


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
    from hetconv.engine.policy import SHARED_CORES_WIRE_CPU_S_PER_BYTE, link_for_cores
    link = parse_bandwidth("1gbit")
    assert link_for_cores(link, [1, 1], 2).host_cpu_s_per_byte == SHARED_CORES_WIRE_CPU_S_PER_BYTE
    assert link_for_cores(link, [0], 8).host_cpu_s_per_byte == SHARED_CORES_WIRE_CPU_S_PER_BYTE   # 0: every core
    assert link_for_cores(link, [1, 1], 4) == link and link_for_cores(link, [], 2) == link
    given = dataclasses.replace(link, host_cpu_s_per_byte=3e-9)
    assert link_for_cores(given, [1, 1], 2) == given


def test_the_coordinator_charges_the_wire_cpu_for_its_own_hosts_cpu_workers_only():
    """priced_link counts the threads of the CPU workers on the coordinator's host: a GPU worker
    there, or CPU workers on another host, leave this host's cores to its network."""
    from types import SimpleNamespace

    from hetconv.coordinator.remote import priced_link
    from hetconv.flags import usable_cores
    from hetconv.transport.sockets import host_key
    here, cores = host_key(), usable_cores()
    peers = {"a": SimpleNamespace(host_key=here, device="cpu", threads=cores, cores=cores),
             "b": SimpleNamespace(host_key=here, device="cuda:0", threads=0, cores=cores),
             "c": SimpleNamespace(host_key="elsewhere", device="cpu", threads=0, cores=0)}
    cfg = Config(link="1gbit")
    assert priced_link(cfg, peers, ["a"]).host_cpu_s_per_byte > 0
    assert priced_link(cfg, peers, ["b", "c"]).host_cpu_s_per_byte == 0
    assert priced_link(cfg, peers, ["missing"]).host_cpu_s_per_byte == 0


def test_the_coordinator_charges_the_wire_cpu_where_another_hosts_cpu_workers_fill_its_cores():
    """A worker says how many cores it may run on (HELLO's `cores`): where the CPU workers of any
    one host fill them (a one-thread worker pinned to one core, as the bench's emulated hosts run
    them; two workers of one host each on its own core), moving a byte costs them compute; a host
    with a core to spare, or that says nothing of its cores, leaves the link as given."""
    from types import SimpleNamespace

    from hetconv.coordinator.remote import _Peer, priced_link
    from hetconv.engine.policy import SHARED_CORES_WIRE_CPU_S_PER_BYTE

    def peer(key, threads, cores, device="cpu"):
        return SimpleNamespace(host_key=key, device=device, threads=threads, cores=cores)
    peers = {"pinned": peer("h1", 1, 1), "spare": peer("h2", 1, 4), "all": peer("h3", 0, 8),
             "x": peer("h4", 2, 4), "y": peer("h4", 2, 4), "gpu": peer("h5", 1, 1, "cuda:0"),
             "silent": peer("h6", 1, 0)}
    cfg = Config(link="1gbit")
    for names, charged in ((["pinned"], True), (["spare"], False), (["all"], True), (["x", "y"], True),
                           (["x"], False), (["gpu", "spare"], False), (["silent"], False), (["spare", "pinned"], True)):
        got = priced_link(cfg, peers, names).host_cpu_s_per_byte
        assert got == (SHARED_CORES_WIRE_CPU_S_PER_BYTE if charged else 0.0), names
    # HELLO's field, checked: what is not a positive count says nothing
    for said, kept in ((3, 3), (0, 0), (-2, 0), (True, 0), ("8", 0), (2.5, 0), (1 << 40, 0)):
        assert _Peer(b"w", {"cores": said}).cores == kept


def test_hetconv_plan_prices_the_wire_cpu_from_the_cpu_devices_it_calibrates_here():
    """hetconv-plan applies the coordinator's rule to the CPU devices it calibrates on this host
    (each once per count); a GPU and a saved profile take none of this host's cores."""
    from hetconv.cli.plan import local_cpu_threads
    from hetconv.engine.costmodel import parse_bandwidth
    from hetconv.engine.policy import link_for_cores
    from hetconv.devices import parse_device_list
    entries = parse_device_list("--devices", "cpu:1x2,cpu,cuda:0", allow_profiles=True)
    assert local_cpu_threads(entries) == [1, 1, None]                   # None: every core
    assert link_for_cores(parse_bandwidth("1gbit"), local_cpu_threads(entries), 2).host_cpu_s_per_byte > 0
    assert local_cpu_threads(parse_device_list("--devices", "cuda:0x2", allow_profiles=True)) == []


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
