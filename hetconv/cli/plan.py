"""`hetconv-plan`: calibrate the devices you have (or load saved profiles), measure the link,
and print the cost model's step time, speedup and wire bytes for one to all of them.

    hetconv-plan --devices cpu:1x4 --link 1gbit       # four 1-thread CPUs like this one, 1 GbE
    hetconv-plan --devices cpu:1,@gpu-host.json --link 10gbit

What it measures comes from engine.measure (calibration in this process, loopback bandwidth, the
coordinator's own share of a step); the model itself is engine.costmodel.
The plan of each set of devices is the one hetconv-coordinator would train with on workers of
those profiles, the same link and the same flags: both call hetconv.engine.policy.plan_workers
(devices that slow the step left out, each conv layer's mode, the shares, the micro-batches; the
link priced for the devices' hosts, the wire from what each device's conv GEMMs ran in at
calibration) and policy.cores_together_record. A device calibrated here runs on this host; a
saved profile on a host of its own that says nothing of its cores (one to spare for its network).
"""
import argparse
from dataclasses import asdict, replace
import json
import logging
import sys
import time

from hetconv.devices import DeviceError, open_device, parse_device_list
from hetconv.devices.cpu_options import CpuOptions
from hetconv.engine.costmodel import Link, dominant_term, parse_bandwidth, predict_local
from hetconv.engine.steptasks import predict_any
from hetconv.engine.graph import graph_pass
from hetconv.engine.measure import (calibrate_rounds, load_profiles, measure_coordinator_s, measure_join_s,
                                   measure_loopback)
from hetconv.engine.microbatch import micro_batch_count
from hetconv.engine.planner import Plan, PlanError, check_profiles, choose_modes
from hetconv.engine.policy import (SHARED_CORES_WIRE_CPU_S_PER_BYTE, PlanSettings, Place, check_exchange,
                                   cores_together_record, plan_workers)
from hetconv.flags import HelpFormatter, add_version, check_output_file, show_progress, still_working, usable_cores
from hetconv.geometry import IMAGE_SHAPE, NUM_CLASSES, ConvSpec, layer_input_shapes
from hetconv.training.config import Config, add_config_flags
from hetconv.transport.sockets import host_key
from hetconv.transport.wire import value_bytes

# the flags this command shares with the coordinator: their defaults and help come from Config
NETWORK_FLAGS = ("net", "conv", "fc", "ksize", "padding", "batch_size", "calibration_batch", "split", "use_all",
                 "exchange", "micro_batches", "wire_dtype", "parallel", "cpu_conv_path", "precision", "retime",
                 "deterministic")


def build_parser():
    p = argparse.ArgumentParser(
        prog="hetconv-plan",
        description="Plan a run: the kernel split, and the estimated step time, speedup over one device and wire "
                    "bytes for a set of devices, from calibrating the devices you have (or saved profiles) and the "
                    "link's bandwidth. It trains and classifies nothing.",
        epilog="examples:\n"
               "  hetconv-plan --devices cpu:1x4 --link 1gbit\n"
               "  hetconv-plan --devices cpu:2 --save-profiles host-a.json\n"
               "  hetconv-plan --devices cpu:4,@host-a.jsonx2 --link 10gbit --batch-size 32",
        formatter_class=HelpFormatter)
    p.add_argument("--devices", default="cpu:1x2",
                   help="comma list: cpu (all cores), cpu:THREADS, cuda:N, or @PROFILE.json (every profile saved "
                        "with --save-profiles, e.g. on another host); xCOUNT repeats an entry")
    # one name and one default with hetconv-coordinator, whose --parallel auto prices the modes on it
    p.add_argument("--link", "--bandwidth", dest="link", default=Config.link,
                   help="each host's link, as hetconv-coordinator --link: 100mbit, 1gbit, 10gbit, ... (Ethernet line "
                        "rate: TCP payload is 1448 of every 1538 bytes on it), 500MB (payload bytes/s), or 'loopback' "
                        "(measured here); --bandwidth is another name for it")
    p.add_argument("--wire-cpu-ns", type=float, default=None, metavar="NS",
                   help="nanoseconds of a host's compute cores that moving one byte costs (sender and receiver "
                        "together): 0 where hosts have a core to spare for their network; where they have none "
                        "(every core computes), bench/_wire_cpu.py measures it. Default: as hetconv-coordinator "
                        "prices it, for each set of devices 0 unless the CPU devices calibrated here among them use "
                        f"every core of this host, then {SHARED_CORES_WIRE_CPU_S_PER_BYTE * 1e9:g}")
    p.add_argument("--save-profiles", default="", help="write the calibrated device profiles to this JSON file")
    p.add_argument("--json", action="store_true", help="print the prediction as JSON")
    add_config_flags(p, NETWORK_FLAGS, title="network and batch (as hetconv-coordinator)")
    return add_version(p)


def main(argv=None):

    args = build_parser().parse_args(argv)
    try:
        cfg = Config(**{name: getattr(args, name) for name in NETWORK_FLAGS}).validate()
        entries = parse_device_list("--devices", args.devices, allow_profiles=True)
        # CIFAR-shaped images: this command has no data set to take the shape from
        network = cfg.network(IMAGE_SHAPE, NUM_CLASSES).spec
        specs = [ConvSpec.from_layer(layer) for layer in network.conv_layers()]
        fc = [op.layer.to_json() for op in network.head() if op.type != "flatten"]
        image = network.input_shape
        input_shapes, _ = layer_input_shapes(specs, cfg.batch_size, image)
        graph = None if network is None or network.is_chain() else graph_pass(network, None).shape()
        if graph is not None:
            blocks = ", ".join(f"conv{n + 1} = {network.names[b.index]}" for n, b in enumerate(network.conv_layers()))
            how = ("its blocks' outputs meeting at the coordinator, which joins them (--exchange star)"
                   if cfg.exchange == "star" else
                   "each worker holding its rows of what data blocks read and write and the whole of what model "
                   "blocks read, gathered where rows meet a model block, and running the joins (--exchange peer)")
            print(f"the network is a graph: priced as it runs, {how}; its blocks: {blocks}", file=sys.stderr)
        check_output_file("--save-profiles", args.save_profiles)
        # saved profiles are read before anything is calibrated: a bad file costs nothing
        saved = {e.profile: load_profiles(e.profile, len(specs)) for e in entries if e.profile}
        for path, found in saved.items():
            try:
                check_profiles({p.name: p for p in found})
            except PlanError as e:
                raise ValueError(f"{path}: {e}") from None
        if args.wire_cpu_ns is not None and not 0 <= args.wire_cpu_ns < 1e6:
            raise ValueError(f"--wire-cpu-ns {args.wire_cpu_ns}: expected nanoseconds per byte, 0 or more "
                             f"(about 1 on a current x86 core over TCP)")
        check_exchange(PlanSettings.of(cfg).flags, len(specs))
        if args.link != "loopback":
            try:
                link = parse_bandwidth(args.link)
            except ValueError as e:
                raise ValueError(f"--link: {e}") from None
        # every device opens before any is calibrated: a missing GPU is said at once, not after
        # a minute of timing the CPU
        for device in sorted({e.device for e in entries if not e.profile and e.device != "cpu"}):
            open_device(device)
        if args.link == "loopback":
            link = Link(measure_loopback(), name="loopback (measured)")
        if args.wire_cpu_ns is not None:             # as given: not priced from the devices' cores
            link = replace(link, host_cpu_s_per_byte=args.wire_cpu_ns * 1e-9)
    except (ValueError, DeviceError) as e:
        print(f"hetconv-plan: {e}", file=sys.stderr)
        return 2
    progress = show_progress(to_stderr=True)   # a CPU device says when it times its conv paths
    try:
        return _calibrate_and_price(args, cfg, entries, saved, specs, fc, image, input_shapes, link, network)
    finally:                                   # main may be called again in this process
        logging.getLogger("hetconv.devices").removeHandler(progress)


def local_cpu_threads(entries):
    """Each CPU device of `entries` calibrated here (not a saved profile), once per count: its
    threads (None or 0: all this process's cores)."""
    return [e.threads for e in entries if not e.profile and e.device == "cpu" for _ in range(e.count)]


def cores_together(entries):
    """Threads of one CPU device with every core the CPU devices of `entries` (calibrated here, not
    saved profiles) would use together: their threads added up (cpu: all this process's cores),
    at most this process's cores. 0 where there is no such device."""
    cores = usable_cores()
    return min(cores, sum(t or cores for t in local_cpu_threads(entries)))


def entry_place(entry, profile=None):
    """Where a device of `entries` runs, as the coordinator reads a worker's HELLO: one
    calibrated here on this host (a CPU device its threads, 0: every core, of this process's
    cores); a saved profile (`profile`) on a host of its own that says nothing of its cores."""
    if entry.profile:
        return Place("", profile.device if profile is not None else "?", 0, 0)
    return Place(host_key(), entry.device, (entry.threads or 0) if entry.device == "cpu" else 0, usable_cores(),
                 "this host")


def _calibrate_devices(cfg, entries, saved, specs, cal_shapes, together):
    """Each device of `entries` calibrated here, once per label (or its saved profiles), the first
    also on the whole layers where its share is not them and, with `together` threads, one CPU
    device of that many on the whole layers, in the same rounds. -> (profiles {key: DeviceProfile},
    order (a key per device), places {key: Place}, whole_profile, together_profile, calibration_s:
    the longest one device's own calibration took, what the coordinator's workers, calibrating at
    once, would take), or an exit status."""
    n_total = sum(e.count * (len(saved[e.profile]) if e.profile else 1) for e in entries)
    share = [-(-s.kernels // n_total) for s in specs]
    whole_kernels = [s.kernels for s in specs]
    first, cpu = entries[0], CpuOptions.of(cfg)
    profiles, order, places, whole_profile, together_profile, calibration_s = {}, [], {}, None, None, 0.0
    for entry in entries:
        if entry.profile:
            found = saved[entry.profile]
            keys = [entry.label if len(found) == 1 else f"{entry.label}:{p.name}" for p in found]
            profiles.update(zip(keys, found))
            places.update({key: entry_place(entry, p) for key, p in zip(keys, found)})
        else:
            keys = [entry.label]
            places[entry.label] = entry_place(entry)
            if entry.label not in profiles:
                # the first device also gives the single-device baseline: every kernel, which its
                # share's line only extrapolates to (a CPU takes another conv path for the whole
                # layer), timed in rounds alternating with its share's, and with one device of the
                # CPU devices' cores together on every kernel
                runs, what = [(entry.device, entry.threads, share)], ""
                if entry is first and share != whole_kernels:
                    runs.append((entry.device, entry.threads, whole_kernels))
                    what = " at its share and on the whole layers"
                if entry is first and together:
                    runs.append(("cpu", together, whole_kernels))
                    what += (f"{',' if what else ''} and cpu:{together} (the {together} cores of the CPU devices "
                             f"together) on the whole layers")
                print(f"calibrating {entry.label}{what} ...", file=sys.stderr, flush=True)
                t0 = time.perf_counter()
                try:
                    with still_working(f"calibrating {entry.label}: {len(specs)} conv layers{what}, in rounds"):
                        got = calibrate_rounds(runs, specs, cal_shapes, cpu=cpu)
                except Exception as e:
                    print(f"hetconv-plan: {entry.label}: {e}", file=sys.stderr)
                    return 2
                calibration_s = max(calibration_s, (time.perf_counter() - t0) / len(runs))
                profiles[entry.label] = got[0]
                if entry is first and share != whole_kernels:
                    whole_profile = got[1]
                if entry is first and together:
                    together_profile = got[-1]
        order += keys * entry.count
    return profiles, order, places, whole_profile, together_profile, calibration_s


def _calibrate_together(cfg, specs, cal_shapes, threads):
    """One CPU device of `threads` threads calibrated here on the whole layers: its DeviceProfile."""
    label = f"cpu:{threads}"
    print(f"calibrating {label} (the {threads} cores of the CPU devices together) on the whole layers ...",
          file=sys.stderr, flush=True)
    with still_working(f"calibrating {label}: {len(specs)} conv layers, whole"):
        return calibrate_rounds([("cpu", threads, [s.kernels for s in specs])], specs, cal_shapes,
                                cpu=CpuOptions.of(cfg))[0]


def _calibrate_and_price(args, cfg, entries, saved, specs, fc, image, input_shapes, link, network=None):
    """The devices calibrated (or their saved profiles), then each count of them priced and
    printed; the exit status."""
    graph = None if network is None or network.is_chain() else graph_pass(network, None).shape()
    cal_batch = min(cfg.calibration_batch, cfg.batch_size)
    cal_shapes = [(cal_batch,) + s[1:] for s in input_shapes]
    # the second baseline: one device with the cores the list's CPU devices would use together,
    # where that is more than the first device has
    first = entries[0]
    first_threads = (first.threads or usable_cores()) if first.device == "cpu" and not first.profile else 0
    together = cores_together(entries)
    together = together if together > first_threads else 0
    together_label = f"cpu:{together}"
    got = _calibrate_devices(cfg, entries, saved, specs, cal_shapes, together)
    if isinstance(got, int):
        return got
    profiles, order, places, whole_profile, together_profile, calibration_s = got
    if together and together_profile is None:         # the first device is a saved profile
        try:
            together_profile = _calibrate_together(cfg, specs, cal_shapes, together)
        except Exception as e:
            print(f"hetconv-plan: {together_label}: {e}", file=sys.stderr)
            return 2
    if args.save_profiles:
        with open(args.save_profiles, "w") as f:
            json.dump([p.to_json() for p in profiles.values()], f, indent=1)
    names = [f"d{i}-{key}" for i, key in enumerate(order)]
    by_name = {n: profiles[k] for n, k in zip(names, order)}
    place_of = {n: places[k] for n, k in zip(names, order)}
    # --wire-cpu-ns given: the link as it says, whatever the devices' cores (priced_link leaves a
    # host that says nothing of its cores as it is)
    link_cores = 0 if args.wire_cpu_ns is not None else usable_cores()
    baseline, baseline_note = by_name[names[0]], "its share's cost line, extrapolated"
    if whole_profile is not None:
        baseline, baseline_note = whole_profile, "calibrated on the whole layers, alternating with the share"
    print(f"timing this host's part of a step (FC layers, loss{', joining the workers blocks' if cfg.exchange == 'star' else ''}) "
          f"for 1 to {len(names)} device(s) ...", file=sys.stderr, flush=True)
    coordinator_s = {n: measure_coordinator_s(specs, fc, image, cfg.batch_size, n, network=network,
                                              exchange=cfg.exchange)
                     for n in range(1, len(names) + 1)}
    # a graph's joins, which the peer step's workers run each on its part of the tensor
    join_s = measure_join_s(network, cfg.batch_size) if cfg.exchange == "peer" else None
    local_s = predict_local(specs, cfg.batch_size, baseline, coordinator_s[1])
    baselines = [{"device": order[0], "step_s": local_s, "how": baseline_note}]
    if together_profile is not None:
        baselines.append({"device": together_label, "step_s": predict_local(specs, cfg.batch_size, together_profile,
                                                                            coordinator_s[1]),
                          "how": f"one device with the {together} cores the CPU devices use together, calibrated on "
                                 f"the whole layers" + ("" if first.profile else f" in the same rounds as {first.label}"),
                          "description": together_profile.description})
    stronger = min(baselines, key=lambda b: b["step_s"])
    flags = PlanSettings.of(cfg).flags
    rows, planned = [], None
    for n in range(1, len(names) + 1):
        # one device alone is the baseline's profile: calibrated on the whole layers where it could be
        subset_profiles = {w: baseline if n == 1 else by_name[w] for w in names[:n]}
        # the plan a run with these devices, this link and these flags trains with (the
        # coordinator calls the same policy on its workers' calibration)
        try:
            planned = plan_workers(specs, image, cfg.batch_size, subset_profiles, link, place_of, flags,
                                   cfg.wire_dtype, cfg.precision, graph, host_key(), link_cores)
            modes_priced = _modes_priced(planned, cfg, specs, image, subset_profiles, graph)
        except PlanError as e:
            print(f"hetconv-plan: {n} device(s): {e}", file=sys.stderr)
            return 2
        for note in planned.choice.notes:
            print(f"hetconv-plan: {n} device(s): {note}", file=sys.stderr)
        rows.append(_row(cfg, specs, image, planned, subset_profiles, coordinator_s, join_s, graph, network,
                         order[:n], modes_priced, stronger["step_s"]))
    # the CPU devices calibrated here that the last plan keeps: one device with their cores is
    # priced in their place as the coordinator prices it (and logs the same line)

    def calibrate_together(threads, workers):
        return together_profile if threads == together else _calibrate_together(cfg, specs, cal_shapes, threads)

    record = cores_together_record(specs, image, cfg.batch_size, planned, by_name, place_of, flags, calibrate_together,
                                   calibration_s, lambda: Link(measure_loopback(), name="loopback (measured)"),
                                   host_key(), usable_cores(), graph, log=lambda line: None)
    if record:
        rows[-1]["plan"] = replace(planned.plan, cores_together=record).to_json()
    if record.get("not_priced"):
        print(f"hetconv-plan: {record['device']} in the place of {', '.join(record['workers'])} not priced: "
              f"{record['not_priced']}", file=sys.stderr)
    note, last = record.get("note", ""), rows[-1]
    if args.json:
        print(json.dumps({"link": last["link"], "wire": last["wire"], "local_step_s": local_s,
                          "baseline": baseline_note, "baselines": baselines, "speedup_against": stronger["device"],
                          "note": note, "rows": rows}, indent=1))
        return 0
    priced = Link(**last["link"])
    cpu = f", {priced.host_cpu_s_per_byte * 1e9:g} ns of CPU a byte" if priced.host_cpu_s_per_byte else ""
    print(f"link: {priced.name} = {priced.bytes_per_s / 1e6:,.0f} MB/s of payload{cpu}; "
          f"batch {cfg.batch_size}; {('network ' + cfg.net) if cfg.net else 'conv ' + cfg.conv}; "
          f"split {cfg.split}; --exchange {cfg.exchange}, wire {last['wire']} ({last['wire_reason']}); "
          f"--parallel {cfg.parallel}")
    for b in baselines:
        print(f"single-device baseline {b['device']}: {b['step_s']:.3f} s/step ({b['how']})"
              + (" <- speedup and efficiency (speedup / devices) against this one" if len(baselines) > 1 and
                 b is stronger else ""))
    for key, prof in profiles.items():
        print(f"  {key}: {prof.description}")
    if together_profile is not None:
        print(f"  {together_label}: {together_profile.description}")
    _print_rows(rows, specs, note)
    return 0


def _row(cfg, specs, image, planned, profiles, coordinator_s, join_s, graph, network, devices, modes_priced,
         baseline_s):
    """The JSON row of one set of devices: its plan (`planned`, a policy.WorkersPlan), the step
    the cost model prices for it with the coordinator's own part (FC layers, loss; in the star
    exchange joining the blocks too), its speedup over `baseline_s`, its wire and link."""
    plan, n = planned.plan, len(devices)
    counts, images = plan.counts(), plan.images()
    pred = predict_any(cfg.exchange, specs, image, cfg.batch_size, counts, {w: profiles[w] for w in plan.workers},
                       planned.link, coordinator_s[len(plan.workers)], planned.choice.micro_batches,
                       value_bytes(planned.wire), modes=plan.modes(), images=images, graph=graph, join_s=join_s)
    what, seconds, share = dominant_term(pred)
    return {"devices": devices, "step_s": pred.step_s, "micro_batches": planned.choice.micro_batches,
            "dominant": {"term": what, "seconds": seconds, "share": share},
            "speedup": baseline_s / pred.step_s, "efficiency": baseline_s / pred.step_s / n,
            # a graph's step says what crosses the links, each byte once; else workers' in and out
            "wire_mb": (sum(pred.bytes_by_kind.values()) if getattr(pred, "bytes_by_kind", None) else
                        sum(v["sent"] + v["recv"] for v in pred.workers.values())) / 1e6,
            "counts": counts, "modes": plan.modes(), "plan": plan.to_json(),
            "mode_costs": modes_priced.to_json(), "left_out": dict(plan.left_out),
            "wire": planned.wire, "wire_reason": planned.wire_reason, "link": asdict(planned.link),
            "blocks": [network.names[b.index] for b in network.conv_layers()] if graph else None,
            "prediction": pred.to_json()}


def _print_rows(rows, specs, note):
    """The table of `rows`, the cores-together note, who was left out, and the last row's modes."""
    width = max(5, len(specs))
    print(f"{'devices':<34} {'step s':>8} {'speedup':>8} {'effic.':>7} {'wire MB/step':>13}  {'modes':<{width}}  "
          f"dominant term")
    for r in rows:
        d = r["dominant"]
        print(f"{','.join(r['devices']):<34} {r['step_s']:8.3f} {r['speedup']:8.2f} {r['efficiency']:7.2f} "
              f"{r['wire_mb']:13.1f}  {''.join(m[0].upper() for m in r['modes']):<{width}}  "
              f"{d['term']} ({100 * d['share']:.0f}% of the step)")
    print("modes: a letter per conv layer, M model-parallel (kernels split), D data-parallel (images split)")
    if note:
        print(note)
    for r in rows:
        for w, why in r["left_out"].items():
            print(f"{len(r['devices'])} device(s): {w} left out, {why}")
    print(f"with {len(rows[-1]['devices'])} device(s), the {Plan.from_json(rows[-1]['plan']).table()}")       # what the coordinator logs
    print(mode_table(rows[-1]))
    by_kind = rows[-1]["prediction"].get("bytes_by_kind")
    if by_kind:
        print(f"a step's bytes with {len(rows[-1]['plan']['workers'])} device(s), by what they carry: "
              + ", ".join(f"{kind} {moved / 1e6:.1f} MB" for kind, moved in by_kind.items()))
    waits = rows[-1]["prediction"].get("critical_path_s")
    if waits:
        # the chain of tasks that sets the step's length (engine/steptasks.py): what to make faster
        print(f"what a step with {len(rows[-1]['plan']['workers'])} device(s) waits on (its critical path, "
              f"{sum(waits.values()):.3f} s): " + ", ".join(
                  f"{what} {seconds:.3f} s" for what, seconds in sorted(waits.items(), key=lambda kv: -kv[1])))


def _modes_priced(planned, cfg, specs, image, profiles, graph):
    """The mode choice of `planned` (a policy.WorkersPlan) for the table, and where the policy made
    none (one device, the modes forced or fixed by --exchange star or --split equal) the plan's
    modes priced the same way, over its link and wire, with why they were not chosen."""
    chosen, link, wire = planned.choice, planned.link, planned.wire
    if chosen.mode_choice is not None:
        return chosen.mode_choice
    plan = chosen.plan
    letters = "".join(m[0].upper() for m in plan.modes())
    micro = micro_batch_count(cfg.micro_batches, cfg.batch_size, cfg.exchange, len(plan.workers))
    priced = choose_modes(specs, image, cfg.batch_size, {w: profiles[w] for w in plan.workers}, link, letters, micro,
                          value_bytes(wire), graph=graph)
    if len(plan.workers) == 1:
        return priced                  # its reason: one worker, the two modes are the same
    if cfg.exchange == "star":
        why = "--exchange star: every layer model-parallel"
    elif cfg.split != "proportional":
        why = f"--split {cfg.split}: the modes --parallel {cfg.parallel} forces, else model"
    else:
        why = f"--parallel {cfg.parallel}"
    return replace(priced, reason=why)


def mode_table(row):
    """Per conv layer, the price of each mode with the devices `row`'s plan keeps (seconds a step:
    compute, the layer's own wire, the coordinator's at the ends), the transition into it from
    the layer before in the chosen chain, and the chosen mode."""
    costs = row["mode_costs"]
    modes = costs["modes"]
    lines = [f"per conv layer with {len(row['plan']['workers'])} device(s), seconds a step in each mode (* chosen): "
             f"{costs['reason']}",
             f"{'layer':<8} {'model s':>10} {'data s':>10} {'into it s':>10}  chosen"]
    for li, layer in enumerate(costs["layers"]):
        into = layer["transition_s"].get(f"{modes[li - 1]}->{modes[li]}", 0.0) if li else 0.0
        mark = {m: "*" if modes[li] == m else " " for m in ("model", "data")}
        block = f" ({row['blocks'][li]})" if row.get("blocks") else ""
        lines.append(f"{'conv' + str(li + 1):<8} {layer['mode_s']['model']:9.4f}{mark['model']} "
                     f"{layer['mode_s']['data']:9.4f}{mark['data']} {into:10.4f}  {modes[li]}{block}")
    if row.get("blocks") and "data" in modes:
        lines.append(f"chosen plan {costs['chosen_s']:.4f} s, every layer in model mode {costs['model_s']:.4f} s "
                     f"(the columns price each block with every tensor whole; the chosen plan holds rows where its "
                     f"blocks are data, and is priced as it runs)")
    else:
        lines.append(f"chosen chain {costs['chosen_s']:.4f} s, every layer in model mode {costs['model_s']:.4f} s "
                     f"(compute and wire added up; the step time above overlaps them)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
