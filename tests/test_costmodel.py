import json
import subprocess
import sys

import pytest

from _in_process import run_main
from hetconv.cli import plan as plan_cli
from hetconv.engine.costmodel import (
    DeviceProfile, LayerCost, Link, chain_shape, parse_bandwidth, predict_local, predict_step, profiles_from_calibration,
    wire_bytes)
from hetconv.geometry import conv_specs

PAPER = conv_specs([500, 1500])
IMAGE = (3, 32, 32)


def test_fit_separates_fixed_and_per_kernel_cost():
    # 8 images: 100 kernels take 1.2 s, 50 take 0.7 s -> 0.2 s fixed, 0.01 s per kernel
    cost = LayerCost.fit({"batch": 8, "kernels": [100, 50], "forward_s": [1.2, 0.7], "backward_s": [2.0, 1.0]})
    assert cost.forward_fixed_s == pytest.approx(0.2 / 8) and cost.forward_per_kernel_s == pytest.approx(0.01 / 8)
    assert cost.backward_fixed_s == pytest.approx(0.0) and cost.backward_s(100, 8) == pytest.approx(2.0)
    # noise that would make the fixed part negative falls back to purely per-kernel
    noisy = LayerCost.fit({"batch": 1, "kernels": [10, 5], "forward_s": [1.0, 0.6], "backward_s": [1.0, 0.4]})
    assert noisy.backward_fixed_s == 0.0 and noisy.backward_s(10, 1) == pytest.approx(1.0)


def test_fit_separates_the_cost_of_a_call_from_its_images():
    # each call 0.05 s; per image 0.01 s fixed + 0.001 s per kernel (forward), backward twice that
    def t(k, n, scale):
        return scale * (0.05 + n * (0.01 + 0.001 * k))
    timing = {"batch": 16, "kernels": [100, 50], "forward_s": [t(100, 16, 1), t(50, 16, 1)],
              "backward_s": [t(100, 16, 2), t(50, 16, 2)],
              "half_batch": {"batch": 8, "kernels": 50, "forward_s": t(50, 8, 1), "backward_s": t(50, 8, 2)}}
    cost = LayerCost.fit(timing)
    assert cost.forward_call_s == pytest.approx(0.05) and cost.backward_call_s == pytest.approx(0.1)
    assert cost.forward_fixed_s == pytest.approx(0.01) and cost.forward_per_kernel_s == pytest.approx(0.001)
    assert cost.backward_per_kernel_s == pytest.approx(0.002)
    # four micro-batches of 8 cost four calls; one batch of 32 one
    assert 4 * cost.forward_s(100, 8) == pytest.approx(cost.forward_s(100, 32) + 3 * 0.05)
    assert cost.step_line(32, calls=2) == pytest.approx((2 * 0.15 + 32 * 0.03, 32 * 0.003))
    # noise bounds it: at most half the half batch's time (half as many images taking as long)...
    timing["half_batch"]["forward_s"] = t(50, 16, 1)
    assert LayerCost.fit(timing).forward_call_s == pytest.approx(0.5 * t(50, 16, 1))
    # ... and never negative (half as many images taking a third of the time)
    timing["half_batch"]["forward_s"] = t(50, 16, 1) / 3
    assert LayerCost.fit(timing).forward_call_s == 0.0
    # a profile saved before calls were measured loads with none
    old = {"forward_fixed_s": 0.01, "forward_per_kernel_s": 0.001, "backward_fixed_s": 0.02, "backward_per_kernel_s": 0.002}
    assert DeviceProfile.from_json({"name": "a", "device": "cpu", "layers": [old]}).layers[0].forward_call_s == 0.0


def test_fit_separates_a_calls_per_kernel_cost_from_its_images():
    # the FFT path's shape: each call streams its kernels' spectra whatever its images
    # (0.4 ms a kernel), on top of 0.03 ms per image and kernel, 5 ms a call and 1 ms an image
    def t(k, n, scale):
        return scale * (0.005 + 4e-4 * k + n * (0.001 + 3e-5 * k))
    timing = {"batch": 32, "kernels": [750, 375], "forward_s": [t(750, 32, 1), t(375, 32, 1)],
              "backward_s": [t(750, 32, 2), t(375, 32, 2)],
              "half_batch": {"batch": 16, "kernels": [750, 375], "forward_s": [t(750, 16, 1), t(375, 16, 1)],
                             "backward_s": [t(750, 16, 2), t(375, 16, 2)]}}
    cost = LayerCost.fit(timing)
    assert cost.forward_call_s == pytest.approx(0.005) and cost.forward_call_per_kernel_s == pytest.approx(4e-4)
    assert cost.forward_fixed_s == pytest.approx(0.001) and cost.forward_per_kernel_s == pytest.approx(3e-5)
    assert cost.backward_call_per_kernel_s == pytest.approx(8e-4)
    # a data-parallel layer's point, all 1500 kernels on 16 images, and four micro-batches of it
    assert cost.forward_s(1500, 16) == pytest.approx(t(1500, 16, 1))
    assert cost.forward_s(1500, 16) > 1.25 * cost.forward_s(750, 32)
    fixed, per_image = cost.image_line(1500, calls=4)
    assert fixed + 16 * per_image == pytest.approx(sum(t(1500, 4, s) for s in (1, 2)) * 4)
    fixed, per_kernel = cost.step_line(32, calls=2)
    assert fixed + 750 * per_kernel == pytest.approx(2 * sum(t(750, 16, s) for s in (1, 2)))
    # the old half point (the smaller count alone) still fits, with no per-kernel call cost
    timing["half_batch"] = {"batch": 16, "kernels": 375, "forward_s": t(375, 16, 1), "backward_s": t(375, 16, 2)}
    assert LayerCost.fit(timing).forward_call_per_kernel_s == 0.0
    # noise: half the images as slow as all of them (forward), or faster than half (backward). The
    # full batch's line is kept, and the cost still grows with the images: a data layer's images
    # are split by that growth, and a zero slope there leaves no usable line to split by
    timing["half_batch"] = {"batch": 16, "kernels": [750, 375], "forward_s": [t(750, 32, 1) * 1.1, t(375, 32, 1)],
                            "backward_s": [t(750, 8, 2), t(375, 8, 2)]}
    noisy = LayerCost.fit(timing)
    assert noisy.forward_per_kernel_s > 0 and noisy.forward_s(750, 32) == pytest.approx(t(750, 32, 1))
    assert noisy.image_line(750)[1] > 0
    assert noisy.backward_call_s == 0.0 and noisy.backward_call_per_kernel_s == 0.0
    assert noisy.backward_s(750, 32) == pytest.approx(t(750, 32, 2)) and noisy.backward_s(375, 32) == pytest.approx(
        t(375, 32, 2))


def test_updates_once_per_step_and_gradient_sums_per_extra_micro_batch():
    from hetconv.engine.steptasks import predict_any
    cost = LayerCost.fit({"batch": 4, "kernels": [10, 5], "forward_s": [1.0, 0.5], "backward_s": [2.0, 1.0],
                          "update_kernels": 10, "update_s": 0.3, "accumulate_s": 0.1})
    assert cost.update_s(20) == pytest.approx(0.6) and cost.accumulate_s(20) == pytest.approx(0.2)
    plain = LayerCost(0.0, 1e-4, 0.0, 1e-4)
    stepped = LayerCost(0.0, 1e-4, 0.0, 1e-4, update_per_kernel_s=1e-5, accumulate_per_kernel_s=2e-6)
    fast, counts = Link(1e15, 0.0), {"w0": [500, 1500]}
    for m in (1, 4):
        a, b = (predict_any("peer", PAPER, IMAGE, 32, counts, {"w0": DeviceProfile("a", "cpu", "", (c,) * 2)}, fast,
                            0.0, micro_batches=m) for c in (stepped, plain))
        assert a.step_s - b.step_s == pytest.approx(2000 * (1e-5 + (m - 1) * 2e-6), rel=1e-6)
    assert predict_local(PAPER, 32, DeviceProfile("a", "cpu", "", (stepped,) * 2), 0.0) == pytest.approx(
        predict_local(PAPER, 32, DeviceProfile("a", "cpu", "", (plain,) * 2), 0.0) + 2000 * 1e-5)


def test_calibration_times_calls_updates_and_sums():
    from hetconv.devices import open_device
    from hetconv.engine.shard import ConvShard
    specs = conv_specs([4, 6], 3)
    shapes = [(4, 3, 12, 12), (4, 4, 5, 5)]
    _, timings = ConvShard(open_device("cpu", threads=1)).calibrate(specs, shapes, [4, 6], repeats=1)
    for t, k in zip(timings, (4, 6)):
        assert t["half_batch"]["batch"] == 2 and t["half_batch"]["kernels"] == [k, k // 2]
        assert len(t["half_batch"]["forward_s"]) == len(t["half_batch"]["backward_s"]) == 2
        assert t["update_kernels"] == k and t["update_s"] > 0 and t["accumulate_s"] > 0
        LayerCost.fit(t)


def test_micro_batches_pay_one_call_each_in_the_peer_model():
    from hetconv.engine.steptasks import predict_any
    with_calls = DeviceProfile("a", "cpu", "", (LayerCost(0.0, 1e-4, 0.0, 1e-4, 0.02, 0.03),) * 2)
    without = DeviceProfile("a", "cpu", "", (LayerCost(0.0, 1e-4, 0.0, 1e-4),) * 2)
    fast = Link(1e15, 0.0)
    counts = {"w0": [500, 1500]}
    for m in (1, 4):
        a = predict_any("peer", PAPER, IMAGE, 32, counts, {"w0": with_calls}, fast, 0.0, micro_batches=m)
        b = predict_any("peer", PAPER, IMAGE, 32, counts, {"w0": without}, fast, 0.0, micro_batches=m)
        assert a.step_s - b.step_s == pytest.approx(m * 2 * (0.02 + 0.03), rel=1e-6)


def test_wire_bytes_of_the_paper_network():
    per_worker, phases = wire_bytes(PAPER, IMAGE, 128, {"a": [250, 750], "b": [250, 750]})
    x1, y1 = 128 * 3 * 32 * 32 * 4, 128 * 250 * 14 * 14 * 4
    x2, y2 = 128 * 500 * 14 * 14 * 4, 128 * 750 * 5 * 5 * 4
    assert per_worker["a"] == {"sent": x1 + x2 + y2 + y1, "recv": y1 + y2 + x2}     # no dX for conv1
    assert [p[:2] for p in phases] == [("forward", 0), ("forward", 1), ("backward", 1), ("backward", 0)]


def flat_profile(name, per_kernel, layers=2):
    return DeviceProfile(name, "cpu", "", (LayerCost(0.0, per_kernel, 0.0, per_kernel),) * layers)


def test_prediction_scales_with_devices_and_bandwidth():
    profiles = {"a": flat_profile("a", 1e-4), "b": flat_profile("b", 1e-4)}
    fast, slow = Link(1e12, 0.0), parse_bandwidth("100mbit")
    one = predict_step(PAPER, IMAGE, 32, {"a": [500, 1500]}, profiles, fast, 0.0)
    two = predict_step(PAPER, IMAGE, 32, {"a": [250, 750], "b": [250, 750]}, profiles, fast, 0.0)
    assert one.step_s == pytest.approx(2 * 32 * 2000 * 1e-4, rel=1e-4)
    assert two.step_s == pytest.approx(one.step_s / 2, rel=1e-3)
    assert predict_step(PAPER, IMAGE, 32, {"a": [250, 750], "b": [250, 750]}, profiles, slow, 0.0).step_s > two.step_s + 1
    assert predict_local(PAPER, 32, profiles["a"], 0.5) == pytest.approx(one.step_s + 0.5, rel=1e-4)


def test_an_uneven_split_of_equal_devices_waits_for_the_slowest():
    profiles = {"a": flat_profile("a", 1e-4), "b": flat_profile("b", 1e-4)}
    link = Link(1e12, 0.0)
    even = predict_step(PAPER, IMAGE, 8, {"a": [250, 750], "b": [250, 750]}, profiles, link, 0.0)
    uneven = predict_step(PAPER, IMAGE, 8, {"a": [400, 1200], "b": [100, 300]}, profiles, link, 0.0)
    assert uneven.step_s == pytest.approx(even.step_s * 1.6, rel=1e-3)
    assert uneven.workers["b"]["wait_s"] > uneven.workers["a"]["wait_s"]


def test_profiles_from_calibration_round_trip():
    cal = {"w0": {"device": "cpu", "description": "cpu (1 thread)",
                  "layers": [{"batch": 4, "kernels": [4, 2], "forward_s": [0.4, 0.2], "backward_s": [0.8, 0.4]}]}}
    prof = profiles_from_calibration(cal)["w0"]
    assert DeviceProfile.from_json(json.loads(json.dumps(prof.to_json()))) == prof
    assert prof.layers[0].forward_s(4, 4) == pytest.approx(0.4)


@pytest.mark.parametrize("text,bytes_per_s", [("100mbit", 12.5e6), ("1gbit", 125e6), ("10gbit", 1.25e9),
                                               ("2.5gbit", 312.5e6), ("500MB", 500e6)])
def test_parse_bandwidth(text, bytes_per_s):
    from hetconv.engine.costmodel import TBF_FRAMING, line_rate
    bits = text.endswith("bit")
    assert line_rate(text) == (pytest.approx(bytes_per_s), bits)
    # a line rate carries TCP payload in 1448 of every 1538 bytes of Ethernet (1514 that tbf counts)
    assert parse_bandwidth(text).bytes_per_s == pytest.approx(bytes_per_s * (1448 / 1538 if bits else 1))
    assert parse_bandwidth(text, framing=TBF_FRAMING).bytes_per_s == pytest.approx(bytes_per_s * (1448 / 1514 if bits else 1))


@pytest.mark.parametrize("text,same_as", [("1gbps", "1gbit"), ("1Gbps", "1gbit"), ("1Gb/s", "1gbit"),
                                           ("100mbit/s", "100mbit"), ("500MB/s", "500MB"), ("500MBps", "500MB")])
def test_bandwidth_is_read_as_vendors_write_it(text, same_as):
    """A lower-case b is bits, an upper-case B bytes, with or without 'ps' or '/s'."""
    from hetconv.engine.costmodel import line_rate
    assert line_rate(text) == line_rate(same_as)


@pytest.mark.parametrize("text", ["fast", "1gigabit", "-1gbit", "0mbit", "1gb", "1g"])
def test_bad_bandwidth_is_named(text):
    with pytest.raises(ValueError, match=f"bandwidth '{text}': expected a rate"):
        parse_bandwidth(text)


def test_plan_command_end_to_end(tmp_path):
    profile = tmp_path / "cpu.json"
    result = subprocess.run([sys.executable, "-m", "hetconv.cli.plan", "--devices", "cpu:1x2", "--conv", "4,8",
                             "--fc", "8", "--batch-size", "8", "--calibration-batch", "4", "--bandwidth", "1gbit",
                             "--save-profiles", str(profile), "--json"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert [r["devices"] for r in out["rows"]] == [["cpu:1"], ["cpu:1", "cpu:1"]]
    assert all(r["step_s"] > 0 and r["wire_mb"] > 0 for r in out["rows"])
    # the single device is calibrated on the whole layers, not extrapolated from the share
    assert out["baseline"].startswith("calibrated on the whole layers") and "on the whole layers" in result.stderr
    again = subprocess.run([sys.executable, "-m", "hetconv.cli.plan", "--devices", f"@{profile}x3", "--conv", "4,8",
                            "--fc", "8", "--batch-size", "8", "--bandwidth", "100mbit"], capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0, again.stderr
    assert "100mbit = 12 MB/s" in again.stdout and again.stdout.count(f"@{profile}") >= 3
    assert "its share's cost line, extrapolated" in again.stdout         # saved profiles cannot be re-timed


def _even_counts(n):
    from hetconv.engine.planner import make_plan
    names = [f"w{i}" for i in range(n)]
    plan = make_plan([500, 1500], {w: [1.0, 1.0] for w in names}, "proportional")
    return {w: [lp.count(w) for lp in plan.layers] for w in names}


def test_peer_model_keeps_the_coordinators_bytes_flat_and_beats_the_star_on_a_shared_link():
    from hetconv.engine.steptasks import predict_any
    link = parse_bandwidth("1gbit")
    bytes_by_n, speedups = {}, {}
    for n in (2, 4, 8):
        counts = _even_counts(n)
        profiles = {w: flat_profile(w, 1e-4) for w in counts}
        local = predict_local(PAPER, 32, profiles["w0"], 0.05)
        peer = predict_any("peer", PAPER, IMAGE, 32, counts, profiles, link, 0.05, micro_batches=2)
        star = predict_any("star", PAPER, IMAGE, 32, counts, profiles, link, 0.05)
        bytes_by_n[n] = peer.coordinator_bytes
        speedups[n] = (local / peer.step_s, local / star.step_s)
        assert peer.step_s < star.step_s, n
    # images once, the last layer's features and their gradient: whatever the number of workers
    assert bytes_by_n[2] == bytes_by_n[4] == bytes_by_n[8] == 32 * 4 * (3 * 32 * 32 + 2 * 1500 * 5 * 5)
    assert speedups[8][0] > speedups[4][0] > speedups[2][0]


def test_peer_model_with_a_free_link_is_the_compute_and_micro_batches_hide_the_coordinator():
    from hetconv.engine.steptasks import predict_any
    counts = _even_counts(2)
    profiles = {w: flat_profile(w, 1e-4) for w in counts}
    free = Link(1e15, 0.0)
    compute = sum(profiles["w0"].layers[i].forward_s(counts["w0"][i], 32)
                  + profiles["w0"].layers[i].backward_s(counts["w0"][i], 32) for i in range(2))
    one = predict_any("peer", PAPER, IMAGE, 32, counts, profiles, free, 0.5, micro_batches=1)
    assert one.step_s == pytest.approx(compute + 0.5)              # nothing to overlap the FC work with
    four = predict_any("peer", PAPER, IMAGE, 32, counts, profiles, free, 0.5, micro_batches=4)
    assert four.step_s < one.step_s - 0.2                           # FC on piece m while conv runs m+1


def test_dominant_term_names_the_bottleneck():
    from hetconv.engine.costmodel import dominant_term
    from hetconv.engine.steptasks import predict_any
    counts = _even_counts(4)
    profiles = {w: flat_profile(w, 1e-4) for w in counts}
    star = predict_any("star", PAPER, IMAGE, 32, counts, profiles, parse_bandwidth("100mbit"), 0.05)
    assert dominant_term(star)[0] == "the coordinator's link"
    peer = predict_any("peer", PAPER, IMAGE, 32, counts, profiles, Link(1e15, 0.0), 0.05)
    what, seconds, share = dominant_term(peer)
    assert what.endswith("'s compute") and 0 < share <= 1


def test_the_cost_model_agrees_with_the_device_set_the_planner_picks():
    from hetconv.engine.steptasks import predict_any
    from hetconv.engine.planner import plan_from_lines
    batch = 32
    gpu = DeviceProfile("gpu", "cuda:0", "", (LayerCost(0.0002, 0.000006, 0.0002, 0.000006),) * 2)
    cpu = DeviceProfile("cpu", "cpu", "", (LayerCost(0.006, 0.0003, 0.006, 0.0003),) * 2)
    profiles = {"gpu": gpu, "cpu": cpu}
    lines = {n: [(batch * (c.forward_fixed_s + c.backward_fixed_s), batch * (c.forward_per_kernel_s + c.backward_per_kernel_s))
                 for c in p.layers] for n, p in profiles.items()}
    plan = plan_from_lines([500, 1500], lines)
    assert plan.workers == ("gpu",)
    fast = Link(1e15, 0.0)
    alone = predict_any("peer", PAPER, IMAGE, batch, {"gpu": [500, 1500]}, profiles, fast, 0.0)
    forced = plan_from_lines([500, 1500], lines, use_all=True)
    both = predict_any("peer", PAPER, IMAGE, batch, {w: [lp.count(w) for lp in forced.layers] for w in forced.workers},
                       profiles, fast, 0.0)
    assert alone.step_s < both.step_s


PLAN_FLAGS = ["--conv", "4,8", "--fc", "8", "--batch-size", "8", "--bandwidth", "1gbit"]


def plan_command(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "hetconv.cli.plan", *PLAN_FLAGS, *args], capture_output=True,
                          text=True, timeout=timeout)


def saved_profile(name, layers=2):
    cost = LayerCost(1e-5, 1e-6, 2e-5, 2e-6)
    return DeviceProfile(name, "cpu", f"{name} described", (cost,) * layers).to_json()


def test_every_profile_in_a_file_loads_and_a_path_may_contain_x(tmp_path):
    folder = tmp_path / "alex"
    folder.mkdir()
    path = folder / "gpux.json"
    path.write_text(json.dumps([saved_profile("a"), saved_profile("b")]))
    result = plan_command("--devices", f"@{path}x2", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)["rows"]
    assert rows[-1]["devices"] == [f"@{path}:a", f"@{path}:b"] * 2


@pytest.mark.parametrize("content,message", [
    ({"layers": []}, "not a saved profile: missing key 'name'"),
    ("[1, 2]", "not a saved profile"),
    ("{", "not a saved profile (not JSON"),
])
def test_a_bad_profile_file_is_named_in_one_line(tmp_path, content, message, capsys):
    path = tmp_path / "bad.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    result = run_main(plan_cli.main, [*PLAN_FLAGS, "--devices", f"@{path}"], capsys)
    assert result.returncode == 2 and f"hetconv-plan: {path}: {message}" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args,message", [
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--calibration-batch", "0"], "--calibration-batch must be >= 1, got 0"),
    (["--ksize", "0"], "--ksize must be >= 1, got 0"),
    (["--split", "fair"], "argument --split: invalid choice: 'fair'"),
    (["--devices", "cpu,,cpu"], "--devices 'cpu,,cpu' has an empty entry"),
    # refused before calibrating (no 'calibrating' line)
    (["--save-profiles", "/proc/x/p.json"], "--save-profiles '/proc/x/p.json' cannot be written"),
])
def test_plan_ranges_are_checked_up_front(args, message, capsys):
    result = run_main(plan_cli.main, [*PLAN_FLAGS, *args], capsys)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "calibrating" not in result.stderr and "Traceback" not in result.stderr


def test_plan_shares_the_coordinators_flags():
    text = subprocess.run([sys.executable, "-m", "hetconv.cli.plan", "--help"], capture_output=True, text=True).stdout
    assert "images per step (default: 128)" in " ".join(text.split())
    assert "{proportional,equal}" in text and "examples:" in text


def test_wire_cpu_hides_in_the_wait_without_overlap_and_slows_compute_with_it():
    """Link.host_cpu_s_per_byte: the CPU work of moving data on the hosts' compute cores. With one
    micro-batch and a wire slower than that work, it falls in time the devices wait anyway; with
    micro-batches the wire overlaps compute and the same work makes the step slower, by at most
    what the busiest host was charged."""
    from dataclasses import replace

    from hetconv.engine.steptasks import predict_any
    counts = _even_counts(2)
    profiles = {w: flat_profile(w, 1e-4) for w in counts}
    slow = Link(12.5e6, 0.0)                          # 100 Mbit/s: 80 ns a byte on the wire
    for m in (1, 2):
        free = predict_any("peer", PAPER, IMAGE, 32, counts, profiles, slow, 0.05, micro_batches=m)
        cheap = predict_any("peer", PAPER, IMAGE, 32, counts, profiles, replace(slow, host_cpu_s_per_byte=1e-9), 0.05,
                            micro_batches=m)
        assert cheap.step_s >= free.step_s
        if m == 1:
            # every transfer's 0.5 ns a byte at each end ends long before its 80 ns a byte on the wire
            assert cheap.step_s == pytest.approx(free.step_s, rel=1e-3)
    fast = Link(1e15, 0.0)
    cpu = 6e-9
    for m in (2, 4):
        free = predict_any("peer", PAPER, IMAGE, 32, counts, profiles, fast, 0.05, micro_batches=m)
        paid = predict_any("peer", PAPER, IMAGE, 32, counts, profiles, replace(fast, host_cpu_s_per_byte=cpu), 0.05,
                           micro_batches=m)
        # each host pays half the CPU of every byte it sends or receives; the step grows by more
        # than half a worker's share (it overlapped compute) and by no more than all of it together
        charged = {w: 0.5 * cpu * (v["sent"] + v["recv"]) for w, v in paid.workers.items()}
        everything = sum(charged.values()) + 0.5 * cpu * paid.coordinator_bytes
        assert 0.5 * max(charged.values()) < paid.step_s - free.step_s <= everything + 1e-9, m
    # the star is not charged: it overlaps nothing
    from hetconv.engine.steptasks import predict_any
    star = [predict_any("star", PAPER, IMAGE, 32, counts, profiles, replace(fast, host_cpu_s_per_byte=c), 0.05).step_s
            for c in (0.0, cpu)]
    assert star[0] == star[1]


def test_the_wire_cpu_probe_measures_a_cost_per_byte(tmp_path):
    """bench/_wire_cpu.py end to end over ipc, shortened: both ends start, bytes arrive while the
    receiver computes, and the result is a finite cost per byte (its size is the benchmark's)."""
    import math
    import os
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    try:
        import _wire_cpu
    finally:
        sys.path.pop(0)
    out = _wire_cpu.measure(f"ipc://{tmp_path}/probe.ipc", rounds=1, log=lambda msg: None, iterations=40)
    assert out["bytes"] > 0 and math.isfinite(out["host_cpu_s_per_byte"]) and out["host_cpu_s_per_byte"] >= 0
    assert len(out["idle_probe_s"]) == len(out["streaming_probe_s"]) == 2


def test_plan_names_a_bad_wire_cpu():
    bad = plan_command("--wire-cpu-ns", "-1", timeout=60)
    assert bad.returncode == 2 and "--wire-cpu-ns -1.0: expected nanoseconds per byte" in bad.stderr


def test_bandwidth_repredict_uses_the_saved_calibrations_and_names_a_bad_file(tmp_path):
    """bench/bandwidth.py --repredict: each saved row predicted again by this model from its own
    saved profiles (tbf framing, the wire CPU asked for); a file that is not one says so."""
    import os
    from dataclasses import replace

    from hetconv.engine.costmodel import TBF_FRAMING
    from hetconv.engine.steptasks import predict_any
    bench = os.path.join(os.path.dirname(__file__), "..", "bench", "bandwidth.py")
    counts = _even_counts(2)
    profiles = {w: flat_profile(w, 1e-4) for w in counts}
    peer = {"ok": True, "kind": "peer-auto", "rate": "1gbit", "exchange": "peer", "batch_size": 32, "micro_batches": 2,
            "wire": "bfloat16", "counts": counts, "profiles": {w: p.to_json() for w, p in profiles.items()},
            "prediction": {"coordinator_s": 0.05}, "step_s": 2.0, "predicted_step_s": 1.5}
    local = {"ok": True, "kind": "local", "rate": "in-process", "batch_size": 32, "step_s": 4.0, "predicted_step_s": 3.0,
             "profiles": {"local": flat_profile("local", 1e-4).to_json()}, "prediction": {"coordinator_s": 0.05}}
    saved = tmp_path / "bandwidth.json"
    saved.write_text(json.dumps({"command": "test", "machine": "test", "rows": [local, peer]}))
    run = subprocess.run([sys.executable, bench, "--repredict", str(saved), "--wire-cpu-ns", "0.5"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    link = replace(parse_bandwidth("1gbit", framing=TBF_FRAMING), host_cpu_s_per_byte=0.5e-9)
    want = predict_any("peer", PAPER, IMAGE, 32, counts, profiles, link, 0.05, 2, 2).step_s
    table = (tmp_path / "bandwidth_repredicted.md").read_text()
    assert f"| 1gbit | peer-auto | 2 | bfloat16 | 2.000 | 1.500 | -25.0% | {want:.3f} |" in table
    assert f"| {predict_local(PAPER, 32, flat_profile('local', 1e-4), 0.05):.3f} |" in table
    saved.write_text("{not json")
    bad = subprocess.run([sys.executable, bench, "--repredict", str(saved)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "cannot read it as JSON" in bad.stderr
    saved.write_text(json.dumps([1, 2]))
    bad = subprocess.run([sys.executable, bench, "--repredict", str(saved)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no rows with saved profiles" in bad.stderr


def test_bandwidth_tables_each_layers_measured_compute_against_its_price():
    """bench/bandwidth.py's per-layer table: a row's workers' measured compute per conv layer
    (median over the rows of a kind) beside the peer prediction's price for that layer."""
    import os
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    try:
        import bandwidth
    finally:
        sys.path.pop(0)
    from hetconv.engine.steptasks import predict_any
    from hetconv.geometry import ConvSpec
    specs = [ConvSpec(3, 4, 3, 3), ConvSpec(4, 6, 3, 3)]
    cost = LayerCost.fit({"batch": 8, "kernels": [2, 1], "forward_s": [0.02, 0.012], "backward_s": [0.04, 0.024]})
    profiles = {w: DeviceProfile(w, "cpu", "", (cost, cost)) for w in ("a", "b")}
    pred = predict_any("peer", specs, (3, 12, 12), 8, {"a": [2, 3], "b": [2, 3]}, profiles, Link(1e9), 0.001).to_json()
    priced = pred["workers"]["a"]["layer_compute_s"]
    assert len(priced) == 2 and all(p > 0 for p in priced)
    assert sum(priced) == pytest.approx(pred["workers"]["a"]["compute_s"])
    rows = [{"ok": True, "kind": "model", "modes": ["model", "model"], "prediction": pred,
             "workers": {w: {"layer_compute_s": [2 * priced[0], priced[1]]} for w in ("a", "b")}}] * 2
    lines = bandwidth.layer_compute_table(rows)
    row_a = next(line for line in lines if line.startswith("| a |"))
    assert "(2.00x)" in row_a and "(1.00x)" in row_a
    assert bandwidth.layer_compute_table([{"ok": False, "kind": "model"}]) == []


def test_a_calibration_whose_half_batch_is_no_faster_still_splits_a_data_layer():
    """Noise on a small layer: half the images timed as slow as all of them, both phases. The fit
    keeps a cost that grows with images, so a data layer's images can still be split by it (a
    zero per-image cost left no usable line, and a lost worker's re-plan failed on it)."""
    from hetconv.engine.planner import mode_shares
    flat = {"batch": 4, "kernels": [4, 2], "forward_s": [0.002, 0.001], "backward_s": [0.004, 0.002],
            "half_batch": {"batch": 2, "kernels": [4, 2], "forward_s": [0.002, 0.001], "backward_s": [0.004, 0.002]}}
    cost = LayerCost.fit(flat)
    assert cost.image_line(4)[1] > 0
    assert cost.forward_s(4, 4) == pytest.approx(0.002) and cost.backward_s(2, 4) == pytest.approx(0.002)
    profiles = {w: DeviceProfile(w, "cpu", "", (cost, cost)) for w in ("a", "b")}
    _, images = mode_shares(conv_specs([4, 4]), 10, profiles)
    assert all(sum(images[w][li] for w in images) == 10 for li in range(2))


def test_a_batchnorm_layer_is_priced_as_a_barrier_and_a_data_layers_sums_as_bytes():
    """With micro-batches a layer whose tail has a BatchNorm sends nothing before its last
    micro-batch is done (whole-batch statistics), which costs the overlap; in a data layer every
    worker also sends its per-channel sums to every peer, forward and backward."""
    import dataclasses
    from hetconv.channelwise import BatchNorm
    from hetconv.engine.costmodel import batchnorm_sum_bytes
    from hetconv.engine.steptasks import predict_any
    with_bn = [dataclasses.replace(s, tail=(BatchNorm(),)) for s in PAPER]
    profiles = {"a": flat_profile("a", 1e-4), "b": flat_profile("b", 1e-4)}
    link = parse_bandwidth("1gbit")
    counts = {"a": [250, 750], "b": [250, 750]}
    for modes, images in ((["model", "model"], None), (["data", "model"], {"a": [16, 16], "b": [16, 16]})):
        plain = predict_any("peer", PAPER, IMAGE, 32, counts, profiles, link, 0.0, 4, modes=modes, images=images)
        barrier = predict_any("peer", with_bn, IMAGE, 32, counts, profiles, link, 0.0, 4, modes=modes, images=images)
        assert barrier.step_s > plain.step_s
        extra = barrier.workers["a"]["recv"] - plain.workers["a"]["recv"]      # what a's link carried besides
        assert extra == (2 * batchnorm_sum_bytes(with_bn[0]) if modes[0] == "data" else 0)
    assert batchnorm_sum_bytes(with_bn[0]) == (2 * 500 + 1) * 8


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_a_network_is_priced_the_same_however_it_was_written(micro_batches):
    """One cost model: the paper network given as a chain of conv specs (graph None) and as the
    graph of its NetSpec (whose nodes are numbered otherwise) are the same step, seconds and
    bytes, all-model and with a data first layer."""
    from hetconv.engine.steptasks import predict_any
    from hetconv.engine.graph import GraphPass
    from hetconv.geometry import ConvSpec
    from hetconv.net import preset
    spec = preset("paper", IMAGE, 10)
    specs = [ConvSpec.from_layer(b) for b in spec.conv_layers()]
    graph = GraphPass(spec, None).shape()
    assert graph.steps != chain_shape(specs, IMAGE).steps
    profiles = {"a": flat_profile("a", 1e-4), "b": flat_profile("b", 2e-4)}
    counts = {"a": [300, 900], "b": [200, 600]}
    link = parse_bandwidth("1gbit")
    for modes in (["model", "model"], ["data", "model"]):
        images = {"a": [20, 20], "b": [12, 12]}
        chain, net = (predict_any("peer", specs, IMAGE, 32, counts, profiles, link, 0.05, micro_batches,
                                  modes=modes, images=images, graph=g) for g in (None, graph))
        assert chain.step_s == pytest.approx(net.step_s, rel=1e-12)
        assert chain.bytes_by_kind == net.bytes_by_kind and chain.workers == net.workers


def test_the_peer_model_overlaps_a_micro_batchs_wire_with_the_next_ones_compute():
    """Micro-batch by micro-batch: on a link whose every transfer is shorter than a micro-batch's
    compute, two micro-batches hide the gathers and the head's round trip that one pays in full."""
    from hetconv.engine.steptasks import predict_any
    counts = _even_counts(2)
    profiles = {w: flat_profile(w, 1e-4) for w in counts}
    link = parse_bandwidth("1gbit")
    one, two = (predict_any("peer", PAPER, IMAGE, 32, counts, profiles, link, 0.02, m) for m in (1, 2))
    assert one.bytes_by_kind == two.bytes_by_kind
    compute = max(v["compute_s"] for v in one.workers.values())
    assert two.workers["w0"]["compute_s"] == pytest.approx(compute)       # no call terms here
    assert one.step_s - compute > 2 * (two.step_s - compute) > 0


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_each_worker_pays_for_the_joins_on_its_part_of_the_tensor(micro_batches):
    """A graph's joins run on the workers (the peer step's coordinator runs the head alone): each
    pays a join's whole-batch seconds times the fraction of the tensor it holds, forward and
    backward: all-data, its rows (20 and 12 of 32 images); all-model, the whole tensor on every
    worker, except where a join keeps a model block's channels (its kernels' fraction)."""
    from hetconv.engine.steptasks import predict_any
    from hetconv.engine.graph import GraphPass
    from hetconv.engine.layouts import WHOLE, is_channels, tensor_layouts
    from hetconv.geometry import ConvSpec
    from hetconv.net import preset
    spec = preset("resnet9", IMAGE, 10, 0.25)
    specs = [ConvSpec.from_layer(b) for b in spec.conv_layers()]
    graph_pass = GraphPass(spec, None)
    graph = graph_pass.shape()
    joins = {st.output: (0.003 + st.output * 1e-4, 0.005) for st in graph_pass.steps if st.kind != "block"}
    assert len(joins) >= 3
    profiles = {"a": flat_profile("a", 1e-4, len(specs)), "b": flat_profile("b", 2e-4, len(specs))}
    counts = {"a": [s.kernels // 4 for s in specs], "b": [s.kernels - s.kernels // 4 for s in specs]}
    images = {"a": [20] * len(specs), "b": [12] * len(specs)}
    link = parse_bandwidth("1gbit")
    for modes in (["data"] * len(specs), ["model"] * len(specs)):
        without, priced = (predict_any("peer", specs, IMAGE, 32, counts, profiles, link, 0.01, micro_batches,
                                       modes=modes, images=images, graph=graph, join_s=j) for j in (None, joins))
        layouts = tensor_layouts(graph_pass.steps, modes, graph_pass.norms)
        for w, rows in (("a", 20), ("b", 12)):
            def held(node):
                if layouts[node] == WHOLE:
                    return 1.0
                if is_channels(layouts[node]):
                    return counts[w][layouts[node][1]] / specs[layouts[node][1]].kernels
                return rows / 32
            extra = sum(sum(seconds) * held(node) for node, seconds in joins.items())
            assert priced.workers[w]["compute_s"] - without.workers[w]["compute_s"] == pytest.approx(extra)
        assert priced.step_s > without.step_s
        assert priced.bytes_by_kind == without.bytes_by_kind


def test_the_weight_gradients_take_the_link_time_the_other_messages_leave():
    """On their own connection the weight gradients never hold up the step's other messages, and
    they move only in the time those leave on both hosts' directions: the link carries one
    thing at a time whichever connection it is on."""
    from hetconv.engine.steptasks import StepTasks, Task, price
    step = StepTasks([], ["a", "b", "c", "d"], 0)

    def send(what, src, dst, nbytes, after=()):
        lanes = ("out", "in") if what == "send" else ("bulk out", "bulk in")
        return step.add(Task(what, (f"{src} {lanes[0]}", f"{dst} {lanes[1]}"), after, worker=src, to=dst,
                             nbytes=nbytes))[0]

    at_2, at_3 = step.add(Task("forward", ("x",), (), 2.0)), step.add(Task("forward", ("y",), (), 3.0))
    first = send("send", "a", "b", 1000)                  # a out, b in: [0, 1]
    second = send("send", "c", "b", 1000, at_2)           # b in: [2, 3]
    # 2 s of gradients from a to b, issued at 0: in [1, 2] and [3, 4]; the next on that connection
    # queues behind it; one between other hosts moves at once
    gradients = [send("bulk", "a", "b", 2000), send("bulk", "a", "b", 500), send("bulk", "c", "d", 500)]
    # and a later message of the step's own is not held up by them
    later = send("send", "a", "b", 1000, at_3)
    end = price(step, Link(1000.0, 0.0)).end
    assert [end[first], end[second], end[later]] == pytest.approx([1.0, 3.0, 4.0])
    assert [end[g] for g in gradients] == pytest.approx([4.0, 4.5, 0.5])
