"""The planning policy, in one place: from the workers' calibrated profiles, the network, the
batch, the link and the run's flags, which workers take part (one that slows the step is left
out, with the reason), each conv layer's mode, the kernel and image shares, the micro-batch
count and the step the cost model predicts for it.

The coordinator calls choose_plan for its first plan and for every re-plan after a worker is
lost or joins; hetconv-plan calls it for each set of devices it prices. The same profiles, link
and flags give the same plan in both, so hetconv-plan prints the plan a run would train with.

Pure: no sockets, no clocks, no devices. What the caller should say about a plan (a fallback
taken) comes back in `notes`, for it to log.
"""
from dataclasses import dataclass, replace

from hetconv.engine.costmodel import FLOAT_BYTES
from hetconv.engine.microbatch import FEWER_MICRO_MARGIN, cheapest_micro_batches, micro_batch_count
from hetconv.engine.planner import (PlanError, check_profiles, choose_modes, cost_lines, forced_modes, make_plan,
                                    plan_from_lines, price_plan, whole_groups)

SPEED_FALLBACK = "splitting by measured speed, not by cost lines"


@dataclass(frozen=True)
class PlanFlags:
    """The run's flags that planning reads (hetconv-coordinator's and hetconv-plan's alike)."""
    split: str = "proportional"     # "proportional" (calibrated cost lines) or "equal" (the naive baseline)
    parallel: str = "auto"          # "auto", "model", "data", or a letter per conv layer (M/D)
    use_all: bool = False           # keep every worker, even one whose fixed work slows the step
    micro_batches: int = 0          # pieces a step is cut into as asked (0: auto, the rule's or fewer)
    exchange: str = "peer"          # "peer" (workers trade maps) or "star" (every layer through the coordinator)

    @classmethod
    def of(cls, cfg, exchange=None):
        """The flags of a training.config.Config (read by name: the engine does not import the
        training package); `exchange` where the engine's own differs from cfg's."""
        return cls(cfg.split, cfg.parallel, bool(getattr(cfg, "use_all", False)), cfg.micro_batches,
                   exchange if exchange is not None else cfg.exchange)


@dataclass(frozen=True)
class PlanChoice:
    plan: object                # planner.Plan, its left_out naming who takes no part and why
    mode_choice: object         # planner.ModeChoice behind its modes, or None where none was made
                                # (one worker, a forced all-model run, --exchange star, --split equal)
    micro_batches: int          # pieces a step of the plan is cut into
    micro_choice: object        # {micro_batches, predicted_s: {count: seconds}} where the cost model
                                # picked the count, else None (the rule's count stands)
    step_s: float               # the cost model's step at micro_batches, the coordinator's FC work left out
    notes: tuple = ()           # lines for the caller to log: a fallback taken


def check_exchange(flags, layers):
    """PlanError where flags.parallel forces data layers over --exchange star, which sends every
    layer through the coordinator and splits only kernels: said before anything is calibrated."""
    forced = forced_modes(flags.parallel, layers)
    if forced is not None and "data" in forced and flags.exchange == "star":
        raise PlanError(f"--parallel {flags.parallel} needs --exchange peer: --exchange star sends every layer through "
                        f"the coordinator and splits only kernels")


def profile_speeds(profiles):
    """{worker: [kernels/s per layer]} from calibrated profiles: one kernel on one image, forward
    and backward, its call costs included. What a worker without measured speeds splits by
    where its cost lines cannot be (see choose_plan's `speeds`)."""
    return {w: [1.0 / (c.forward_s(1, 1) + c.backward_s(1, 1)) for c in p.layers] for w, p in profiles.items()}


def choose_plan(specs, image_shape, batch, profiles, link, flags=PlanFlags(), value_bytes=FLOAT_BYTES, graph=None,
                speeds=None):
    """The plan of calibrated `profiles` {worker: DeviceProfile} (in worker order) for a step of
    `batch` images of `image_shape` over `link`, as `flags` ask. -> PlanChoice.

    proportional: the devices are chosen on the all-model plan, split by each worker's cost line
    (fixed + per kernel) at the step's batch, leaving out a worker that would slow the step
    (unless flags.use_all); then each layer's mode (flags.parallel: 'auto' asks the cost model,
    planner.choose_modes, over the kept workers) and, where a layer is data, the plan over those
    workers with its images split by their per-image lines. Cost lines too noisy to split by (a
    PlanError from plan_from_lines) do not end a run: the split falls back to `speeds` (the
    workers' measured kernels/s per layer; default profile_speeds) keeping every worker, and a
    note says so. equal: the naive baseline, every layer model unless flags.parallel forces
    data layers. A grouped conv's kernel shares are then moved to whole groups, as the workers
    load them. Last, auto micro-batches (flags.micro_batches 0) take the count whose step the
    cost model prices cheapest (engine.microbatch.cheapest_micro_batches); the modes are chosen
    for the rule's count and for each fewer, and the modes and count priced cheapest run.

    value_bytes: bytes of a feature-map value on the wire, or a function of the workers taking
    part -> that (--wire-dtype auto follows what they compute in: the modes are priced with every
    worker's wire, the micro-batches with the plan's). graph: a costmodel.GraphShape where the
    network is a graph. PlanError where no plan fits."""
    names = list(profiles)
    if not names:
        raise PlanError("no workers to plan for")
    bytes_of = value_bytes if callable(value_bytes) else (lambda workers: value_bytes)
    kernels = [s.kernels for s in specs]
    forced = forced_modes(flags.parallel, len(specs))
    speeds = profile_speeds(profiles) if speeds is None else {w: list(speeds[w]) for w in names}
    notes, mode_choice, modes_at = [], None, None
    if flags.split != "proportional":
        plan = make_plan(kernels, speeds, flags.split, batch=batch,
                         modes=forced if forced is not None and "data" in forced and len(names) > 1 else None,
                         one_split=True)
    else:
        lines, image_lines = cost_lines(profiles, kernels, batch)
        data_only = forced is not None and "model" not in forced and len(names) > 1
        if data_only and any(k < len(names) for k in kernels):
            model_plan = None                                # too few kernels to split: every worker takes part
            kept = names
        else:
            try:
                model_plan = plan_from_lines(kernels, lines, use_all=flags.use_all)
            except PlanError as e:
                notes.append(f"{SPEED_FALLBACK}: {e}")
                model_plan = make_plan(kernels, speeds, "proportional")
            kept = list(model_plan.workers)
        if model_plan is not None and (forced is not None and "data" not in forced or flags.exchange == "star"
                                       or len(kept) < 2):
            plan = model_plan
        else:
            def choose_at(micro):
                """The plan whose modes the cost model picks for a step of `micro` micro-batches
                -> (plan, ModeChoice, notes)."""
                said = []
                choice = choose_modes(specs, image_shape, batch, {w: profiles[w] for w in kept}, link, flags.parallel,
                                      micro_batches=micro, value_bytes=bytes_of(names), graph=graph)
                if "data" not in choice.modes:
                    return model_plan, choice, said
                try:
                    # the data layers split the images once: the step keeps each tensor in its layout between them
                    built = plan_from_lines(kernels, {w: lines[w] for w in kept}, use_all=True, modes=choice.modes,
                                            batch=batch, image_lines={w: image_lines[w] for w in kept},
                                            one_split=True)
                except PlanError as e:
                    said.append(f"{SPEED_FALLBACK}: {e}")
                    built = make_plan(kernels, {w: speeds[w] for w in kept}, "proportional", modes=choice.modes,
                                      batch=batch, one_split=True)
                return replace(built, left_out=dict(model_plan.left_out) if model_plan else {}), choice, said

            modes_at = choose_at
            plan, mode_choice, said = choose_at(micro_batch_count(flags.micro_batches, batch, flags.exchange,
                                                                  len(kept)))
            notes += said
    plan = whole_groups(plan, specs)

    def price(plan, m):
        return price_plan(specs, image_shape, batch, plan, profiles, link, flags.exchange, m, bytes_of(plan.workers),
                          graph)

    most = micro_batch_count(flags.micro_batches, batch, flags.exchange, len(plan.workers))
    picked = cheapest_micro_batches(flags.micro_batches, flags.split, most, lambda m: price(plan, m))
    if picked is None:
        return PlanChoice(plan, mode_choice, most, None, price(plan, most), tuple(notes))
    micro, predicted = picked
    if modes_at is not None and forced is None:
        # the modes were chosen for the rule's count of micro-batches; the modes chosen for fewer
        # (each plan at its own cheapest count) run where they are priced lower by more than the
        # noise: overlap favours model blocks, one call a layer favours data ones
        for fewer in range(1, most):
            other, other_choice, said = modes_at(fewer)
            other = whole_groups(other, specs)
            if other.modes() == plan.modes():
                continue
            got = cheapest_micro_batches(flags.micro_batches, flags.split, most, lambda m: price(other, m))
            if got is not None and got[1][got[0]] < (1.0 - FEWER_MICRO_MARGIN) * predicted[micro]:
                plan, mode_choice, (micro, predicted), notes = other, other_choice, got, notes + said
    return PlanChoice(plan, mode_choice, micro, {"micro_batches": micro, "predicted_s": predicted}, predicted[micro],
                      tuple(notes))


# ---- one device with the cores of several CPU workers of a host ----------------------------------
#
# On one host, two one-thread workers trade feature maps and partial dX over ipc and pay a call
# each per layer, where one device with both cores runs the same GEMMs on two threads and moves
# nothing, and can be the faster (docs/bench-log.md). Which is faster depends on the layers and the
# cores, so that device is priced as a plan like any other, from its own calibration: the device
# to beat is never one core.

CORES_TOGETHER_MIN_GAIN = 0.02      # the cost model's error is a few percent: a closer price is no news

# What moving a byte costs the compute cores of hosts with none to spare for their network (the
# kernel's TCP stack, ZeroMQ's I/O thread, the receive thread's copies; sender and receiver
# together), about what bench/_wire_cpu.py measures with two workers on two cores, shaped link or
# not (its runs: docs/bench-log.md). Where a host's CPU workers leave a core free the network runs
# there and costs the compute nothing.
SHARED_CORES_WIRE_CPU_S_PER_BYTE = 1.0e-9


def link_for_cores(link, threads, cores):
    """`link` as the cost model should price it where CPU workers of `threads` (their threads, 0:
    every core) share a host of `cores` cores: with SHARED_CORES_WIRE_CPU_S_PER_BYTE of compute a
    byte where they use every core, and the link as given where one is free or it already says."""
    if link.host_cpu_s_per_byte or not threads or sum(t or cores for t in threads) < cores:
        return link
    return replace(link, host_cpu_s_per_byte=SHARED_CORES_WIRE_CPU_S_PER_BYTE)


def is_cpu_device(device):
    """A CPU worker's device text: "cpu" or "cpu:THREADS"."""
    return device == "cpu" or str(device).startswith("cpu:")


def cpu_groups(workers):
    """The CPU workers that share a host: {host_key: [names in plan order]} for each host with two
    or more of them. workers: {name: (host_key, device)}; a device is a CPU one where it is "cpu"
    or "cpu:THREADS"; an empty host key (not reported) groups nothing."""
    groups = {}
    for name, (host, device) in workers.items():
        if host and is_cpu_device(device):
            groups.setdefault(host, []).append(name)
    return {host: names for host, names in groups.items() if len(names) > 1}


@dataclass(frozen=True)
class CoresTogether:
    """One CPU device with the cores of several CPU workers of one host, in their place, priced
    against the plan that has them apart (both by the cost model, the coordinator's FC work left
    out of both)."""
    device: str                 # the one device, e.g. "cpu:2"
    threads: int                # its threads: the cores of `workers` together
    workers: tuple              # the plan's workers whose cores it has
    step_s: float               # the priced step with it in their place
    plan_step_s: float          # ... and of the plan
    alone: bool                 # whether it is the whole plan (no other worker stays)
    host: str = ""              # where they run, in words

    @property
    def ratio(self):
        return self.step_s / self.plan_step_s

    def faster(self, min_gain=CORES_TOGETHER_MIN_GAIN):
        return self.step_s < (1.0 - min_gain) * self.plan_step_s

    def note(self):
        """One line where the device is priced faster than the plan, else ''."""
        if not self.faster():
            return ""
        priced = (f"is priced {self.ratio:.2f}x this plan's step ({self.step_s:.3g} s against "
                  f"{self.plan_step_s:.3g} s)")
        if self.alone:
            return (f"note: one worker with the {self.threads} cores of {', '.join(self.workers)} together "
                    f"({self.device}) {priced}: --spawn {self.device} or --local --threads {self.threads}")
        return (f"note: one worker with the {self.threads} cores of {', '.join(self.workers)} together "
                f"({self.device}{' on ' + self.host if self.host else ''}) in their place {priced}: run one "
                f"hetconv-worker --device {self.device} there instead")

    def line(self):
        """The note where the device is priced faster, else one line saying the plan stands."""
        return self.note() or (f"one worker with the {self.threads} cores of {', '.join(self.workers)} together "
                               f"({self.device}) is priced {self.ratio:.2f}x this plan's step ({self.step_s:.3g} s "
                               f"against {self.plan_step_s:.3g} s): the plan stands")

    def to_json(self):
        d = {"device": self.device, "threads": self.threads, "workers": list(self.workers), "step_s": self.step_s,
             "plan_step_s": self.plan_step_s, "ratio": self.ratio}
        note = self.note()
        if note:
            d["note"] = note
        return d


def price_cores_together(specs, image_shape, batch, plan, profiles, together, threads, workers, link,
                         flags=PlanFlags(), value_bytes=FLOAT_BYTES, plan_micro_batches=1, host="", graph=None):
    """`plan` ({worker: DeviceProfile} for its workers, priced at `plan_micro_batches`) against the
    plan with one CPU device of `threads` threads, `together` (its DeviceProfile, from its own
    calibration), in the place of `workers` (CPU workers of one host in the plan), made by
    choose_plan with the same flags like any other plan. `value_bytes`: bytes of a feature-map
    value on the plan's wire, both plans priced with it. -> CoresTogether."""
    workers = [w for w in plan.workers if w in set(workers)]
    if len(workers) < 2:
        raise PlanError(f"one device with the cores of several workers needs two or more of the plan's, got {workers!r}")
    check_profiles({together.name: together})
    plan_step_s = price_plan(specs, image_shape, batch, plan, profiles, link, flags.exchange, plan_micro_batches,
                             value_bytes, graph)
    device = f"cpu:{int(threads)}"
    name = f"{device} (together)"
    others = [w for w in plan.workers if w not in workers]
    order = [name if w == workers[0] else w for w in plan.workers if w not in workers[1:]]
    alternative = {w: together if w == name else profiles[w] for w in order}
    step_s = choose_plan(specs, image_shape, batch, alternative, link, flags, value_bytes, graph).step_s
    return CoresTogether(device, int(threads), tuple(workers), step_s, plan_step_s, not others, host)
