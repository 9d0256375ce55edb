"""Planning a run over workers measured apart, written once for every such engine: each worker
calibrated on the run's layer shapes (CALIBRATE, through the engine's `_call`), its reply checked,
then the policy's plan from those calibrations (policy.plan_workers), its wire decided, and its
CPU workers on this host priced with their cores together (policy.cores_together_record). A
transport (coordinator.remote.RemoteEngine) provides `_call`, `peers` ({name: what the worker said
of itself at HELLO: its label(), device, description, and the policy.Place fields}), `log` and
`cpu`; it decides nothing of the plan.
"""
import collections
import dataclasses
import math
import time

from hetconv.devices.cpu_options import CpuOptions
from hetconv.devices.wisdom import DETERMINISTIC
from hetconv.engine.contract import ShardEngine, WorkerError
from hetconv.engine.conv_precision import checked_choices, computed_precision
from hetconv.engine.costmodel import Link, parse_bandwidth, profiles_from_calibration
from hetconv.engine.measure import calibrate_local, measure_loopback
from hetconv.engine.microbatch import priced_text
from hetconv.engine.policy import (check_exchange, check_plannable, cores_together_record, plan_workers,
                                   step_bounds)
from hetconv.flags import usable_cores
from hetconv.transport.sockets import host_key

CALIBRATION_REPEATS = 3          # calls per timed block: each block also lasts at least 0.25 s (engine.shard)


def _is_seconds(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def _check_timing_points(where, d):
    """`d`'s batch, kernels and per-kernel forward_s and backward_s (see _checked_calibration)."""
    if not isinstance(d, dict):
        raise ValueError(f"{where} is {type(d).__name__}, not a map")
    batch, ks = d.get("batch"), d.get("kernels")
    if not (isinstance(batch, int) and not isinstance(batch, bool) and batch > 0):
        raise ValueError(f"{where}: batch {batch!r}, expected a positive integer")
    if not (isinstance(ks, list) and 1 <= len(ks) <= 2
            and all(isinstance(k, int) and not isinstance(k, bool) and k > 0 for k in ks)):
        raise ValueError(f"{where}: kernels {ks!r}, expected one or two positive integers")
    for key in ("forward_s", "backward_s"):
        # a real run takes time: a zero would make a free device, whose share the planner
        # cannot size (it divides by the time a kernel takes)
        ts = d.get(key)
        if not (isinstance(ts, list) and len(ts) == len(ks) and all(_is_seconds(t) and t > 0 for t in ts)):
            raise ValueError(f"{where}: {key} {ts!r}, expected {len(ks)} positive finite seconds, one per "
                             f"kernel count")


def checked_calibration(label, fields, layers):
    """A worker's CALIBRATED fields, checked before the cost model fits them (they come from the
    network): `speeds`, a positive finite number per conv layer; `timings`, per layer a batch,
    one or two kernel counts and a positive forward and backward time for each, the same again on half
    the batch where there is one (`half_batch`), and finite update and gradient-sum times.
    -> (speeds, timings), or WorkerError naming the worker and the first thing wrong."""
    try:
        speeds, timings = fields.get("speeds"), fields.get("timings")
        if not (isinstance(speeds, list) and len(speeds) == layers
                and all(_is_seconds(v) and v > 0 for v in speeds)):
            raise ValueError(f"speeds {speeds!r:.200}, expected {layers} positive finite numbers")
        if not (isinstance(timings, list) and len(timings) == layers):
            raise ValueError(f"timings for {len(timings) if isinstance(timings, list) else 'no'} layers, "
                             f"expected {layers}")
        for li, timing in enumerate(timings):
            _check_timing_points(f"conv{li + 1}", timing)
            if "half_batch" in timing:
                _check_timing_points(f"conv{li + 1} half_batch", timing["half_batch"])
            for key in ("update_s", "accumulate_s"):
                if key in timing and not _is_seconds(timing[key]):
                    raise ValueError(f"conv{li + 1}: {key} {timing[key]!r}, expected finite non-negative seconds")
            if "update_kernels" in timing and not (isinstance(timing["update_kernels"], int)
                                                   and not isinstance(timing["update_kernels"], bool)):
                raise ValueError(f"conv{li + 1}: update_kernels {timing['update_kernels']!r}, expected an integer")
    except ValueError as e:
        raise WorkerError(label, "calibration", "CalibrationError", f"a malformed calibration: {e}") from None
    return list(speeds), list(timings)


def conv_path_lines(calibration, precision):
    """One line a calibrated worker (`calibration`: {name: its record}): which paths its device
    runs, by timing or as told (each call shape's choice, with every path's time, is in the
    metrics' calibration record). A worker whose device only took the rule's untimed choices
    on small layers, in a float32 run, gets none."""
    lines = []
    for name in sorted(calibration):
        chosen = calibration[name]["conv_paths"]
        # timed in this run, or earlier: this machine's wisdom, the checkpoint resumed from
        if (not any(c["why"] in ("timed", "forced", "wisdom", "checkpoint", DETERMINISTIC) or c["path"] == "fft"
                    for c in chosen) and precision == "fp32"):
            continue
        how = ("forced" if all(c["why"] == "forced" for c in chosen) else
               "by rule, --deterministic" if all(c["why"] == DETERMINISTIC for c in chosen) else
               "timed where a call is big enough")
        counts = collections.Counter(c["path"] for c in chosen)
        lines.append(f"  {name} conv paths ({how}): " + ", ".join(
            f"{path} for {n} call shape{'s' if n > 1 else ''}" for path, n in sorted(counts.items()))
            + f"; precision {calibration[name]['precision']}")
    return lines


class CalibratedEngine(ShardEngine):
    """An engine whose workers are measured apart and planned from what they measured."""

    def __init__(self, log=print, cpu=CpuOptions(use_wisdom=True)):
        """`log`: where planning's lines go; `cpu`: the options of the device this process
        calibrates a host's CPU workers' cores together with."""
        super().__init__()
        self.log, self.cpu = log, cpu
        self.peers = {}             # name -> what the worker said at HELLO (the transport fills it)
        self.plan_choice = None     # policy.PlanChoice of the last plan made from calibration
        self.workers_plan = None    # policy.WorkersPlan behind it: its wire and priced link too
        self.calibration_s = 0.0
        self.step_bounds = {}       # PEERS' micro_batches and early_bytes (_note_step_bounds)

    def replan(self, specs, input_shapes, settings):
        """A plan over the workers there are now, from their calibration; a worker without one
        (it joined while another was lost) is calibrated first, never planned blind."""
        self._note_step_bounds(specs, input_shapes, settings)
        missing = [name for name in self.peers if name not in self.calibration]
        if missing:
            self._calibrate_some(specs, input_shapes, settings, missing)
        return self._plan_from_calibration(specs, input_shapes,
                                           {name: self.calibration[name]["speeds"] for name in self.peers}, settings)

    def calibrate(self, specs, input_shapes, settings):
        """Each worker times its fused kernels on the real layer shapes, its equal share of kernels,
        after a JIT warm-up. Returns {worker: [kernels/s per layer]}."""
        return self._calibrate_some(specs, input_shapes, settings, list(self.peers))

    def _calibrate_some(self, specs, input_shapes, settings, names):
        batch = settings.calibration_batch
        n = len(self.peers)
        layers = [{"spec": s.to_json(), "input_shape": [batch] + list(shape[1:]), "kernels": -(-s.kernels // n)}
                  for s, shape in zip(specs, input_shapes)]
        t0 = time.perf_counter()
        request = ("CALIBRATE", [], {"layers": layers, "repeats": CALIBRATION_REPEATS})
        replies = self._call({name: request for name in names}, "calibration")
        self.calibration_s = time.perf_counter() - t0
        checked = {name: checked_calibration(self.peers[name].label(), fields, len(specs))
                   for name, (_, fields) in replies.items()}
        self.calibration.update({name: {"device": self.peers[name].device, "description": self.peers[name].description,
                                        "speeds": speeds, "layers": timings,
                                        "conv_paths": checked_choices(replies[name][1].get("conv_paths"))}
                                 for name, (speeds, timings) in checked.items()})
        for name in checked:
            self.calibration[name]["precision"] = computed_precision(self.calibration[name]["conv_paths"])
        return {name: list(checked[name][0]) for name in names}

    def _note_step_bounds(self, specs, input_shapes, settings):
        """What PEERS tells the workers a step of this run can need (policy.step_bounds)."""
        self.step_bounds = step_bounds(settings.flags.micro_batches, settings.batch_size, specs, input_shapes[0][1:])

    def plan_for(self, specs, input_shapes, settings):
        self._note_step_bounds(specs, input_shapes, settings)
        flags = settings.flags_for(self.exchange)
        check_exchange(flags, len(specs))
        if self.fixed_plan is not None:             # checked when it was made: its data layers need no kernel each
            self.decide_wire(settings)
            return self.fixed_plan
        check_plannable([s.kernels for s in specs], len(self.peers), flags)
        self.log(f"calibrating {len(self.peers)} worker(s): each times its share of every conv layer on the real "
                 f"shapes, after a warm-up (seconds to a minute) ...")
        speeds = self.calibrate(specs, input_shapes, settings)
        self.log(f"calibrated {len(self.peers)} worker(s) in {self.calibration_s:.1f}s")
        for line in conv_path_lines(self.calibration, settings.precision):
            self.log(line)
        plan = self._plan_from_calibration(specs, input_shapes, speeds, settings)
        return self._price_cores_together(plan, specs, input_shapes, settings)

    def _price_cores_together(self, plan, specs, input_shapes, settings):
        """`plan`, with its `cores_together` record (policy.cores_together_record, its line logged):
        where two or more of its CPU workers run on this host, one device with their cores
        together priced in their place. That device is calibrated here, in this process, while
        the workers wait: this process can open a device on those cores, a worker pinned to its
        own cannot. Workers together on another host are not priced so: their cores cannot be
        calibrated together from here."""
        if not all(w in self.calibration for w in plan.workers):
            return plan
        batch = settings.calibration_batch

        def calibrate_together(threads, workers):
            self.log(f"pricing one worker with the {threads} cores of {', '.join(workers)} together: calibrating "
                     f"cpu:{threads} in this process ...")
            return calibrate_local("cpu", specs, [(batch,) + tuple(s[1:]) for s in input_shapes],
                                   [s.kernels for s in specs], threads=threads, repeats=CALIBRATION_REPEATS,
                                   cpu=self.cpu)

        record = cores_together_record(
            specs, tuple(input_shapes[0][1:]), settings.batch_size, self.workers_plan,
            profiles_from_calibration({w: self.calibration[w] for w in plan.workers}), self.peers,
            settings.flags_for(self.exchange), calibrate_together, self.calibration_s,
            lambda: Link(measure_loopback(), name="loopback (measured)"), host_key(), usable_cores(),
            self._graph_shape(), self.log)
        return dataclasses.replace(plan, cores_together=record) if record else plan

    def _plan_from_calibration(self, specs, input_shapes, speeds, settings):
        """The plan policy.plan_workers makes from the workers' calibration (`speeds`: {worker:
        measured kernels/s per layer}, in worker order: what the split falls back to where the
        cost lines are too noisy), with its mode choice in `mode_choice`, its micro-batch choice
        in `micro_choice`, and its wire (`decide_wire`, from what the plan's workers computed in),
        said where it changed."""
        before = self.wire_choice["dtype"] if self.wire_choice else None
        profiles = profiles_from_calibration({name: self.calibration[name] for name in speeds})
        planned = plan_workers(specs, tuple(input_shapes[0][1:]), settings.batch_size, profiles,
                               parse_bandwidth(settings.link), self.peers, settings.flags_for(self.exchange),
                               self.asked_wire(settings), settings.precision,
                               self._graph_shape(), host_key(), usable_cores(), speeds)
        choice = planned.choice
        for note in choice.notes:
            self.log(note)
        self.decide_wire(settings, planned.computed, choice.plan.workers)
        if before is not None and before != self.wire:
            self.log(f"feature maps and gradients between layers: {self.wire} from this plan on, was {before} "
                     f"({self.wire_choice['reason']})")
        self.workers_plan = planned
        self.plan_choice, self.mode_choice, self.micro_choice = choice, choice.mode_choice, choice.micro_choice
        if self.micro_choice is not None and self.micro_choice["micro_batches"] < max(self.micro_choice["predicted_s"]):
            self.log(f"micro-batches: {self.micro_choice['micro_batches']}, the cheapest predicted step "
                     f"({priced_text(self.micro_choice['predicted_s'])})")
        return choice.plan

    def _graph_shape(self):
        """What the cost model prices this network's blocks with where it is a graph, else None."""
        return None if self.graph is None else self.graph.shape()
