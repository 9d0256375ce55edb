"""The planning policy, in one place: from the workers' calibrated profiles, the network, the
batch, the link and the run's flags, which workers take part (one that slows the step is left
out, with the reason), each conv layer's mode, the kernel and image shares, the micro-batch
count and the step the cost model predicts for it.

The coordinator's engine (engine.calibrated.CalibratedEngine) calls plan_workers for its first
plan and for every re-plan after a worker is lost or joins; hetconv-plan calls it for each set of
devices it prices. From the same profiles
(their calibrated precision and speeds), link, places (which host, how many cores) and flags both
get the same plan, wire and priced link, so hetconv-plan prints the plan a run would train with.
The rules around a plan are here too: the cores-together price and when it is worth
calibrating, the head's weights-later choice, the wire a plan carries (wire_for), which recorded
plan a run fixes (recorded_run_plan) and what --deterministic runs, what a step can need
(step_bounds) and how many times a run re-splits from measured steps.

Pure: no sockets, no clocks, no devices (a caller hands in what measures: calibrate_together,
local_link). What the caller should say about a plan (a fallback taken) comes back in `notes`,
for it to log.
"""
from dataclasses import dataclass, replace

from hetconv.engine.costmodel import FLOAT_BYTES
from hetconv.engine.microbatch import (FEWER_MICRO_MARGIN, cheapest_micro_batches, micro_batch_count,
                                       recorded_micro_batches)
from hetconv.engine.planner import (PlanError, check_kernels_per_worker, check_profiles, choose_modes, cost_lines,
                                    forced_modes, given_plan, make_plan, plan_from_lines, price_plan,
                                    recorded_worker_names, whole_groups)
from hetconv.geometry import largest_array_bytes
from hetconv.transport.wire import check_wire_dtype, value_bytes as wire_value_bytes

SPEED_FALLBACK = "splitting by measured speed, not by cost lines"
# Re-splits from measured steps a run makes (training.loop schedules them, each after
# --rebalance-after steps): each round corrects the last; past three, the steps' noise is what moves.
MAX_REBALANCES = 3


def rebalances(split, rebalance_after, fixed_plan, workers):
    """Whether a run re-splits its plan from measured steps (up to MAX_REBALANCES times, the
    first after `rebalance_after` steps, which must be two or more: the first step pays for
    growing buffers): only a proportional split (`equal` is the baseline, kept as it is) of two
    or more workers that calibration planned (`fixed_plan` False: not one set by hand)."""
    return rebalance_after >= 2 and split == "proportional" and not fixed_plan and workers > 1


def run_micro_batches(requested, batch, exchange, workers, micro_choice=None):
    """A run's micro-batch count with `workers` workers: `requested` (--micro-batches) where set;
    else the rule's count (microbatch.micro_batch_count), or fewer where the plan's cost model
    priced fewer as faster (`micro_choice`, PlanChoice.micro_choice), never more than the rule
    gives for the workers there are now (a plan made for more workers may still stand)."""
    most = micro_batch_count(requested, batch, exchange, workers)
    if requested or not micro_choice:
        return most
    return max(1, min(most, int(micro_choice["micro_batches"])))


@dataclass(frozen=True)
class RecordedPlan:
    """A plan a run fixes on its engine instead of calibrating one (no calibrated split, no
    rebalancing): --plan's, or the checkpoint's it resumes from."""
    plan: object                # planner.Plan
    micro_batches: object       # the micro-batch count recorded with it (None: none recorded)
    source: str                 # where it came from, in words


def recorded_run_plan(layer_kernels, batch, workers, given=None, given_source="", resumed=None,
                      resumed_micro=None, resumed_source=""):
    """-> (RecordedPlan or None, a note for the log or ""): the plan a run fixes, where it has
    one. `given` (a "plan" metrics record of --plan FILE, `given_source` naming it) is run as
    it is, or refused (PlanError) where it does not fit the network, the batch or `workers`.
    Else the checkpoint's (`resumed`, its record; `resumed_micro` its micro-batch count) is run
    again where `workers` are the same ones (by name) and more than one: a plan the checkpoint
    cannot give again is said in the note, and one is calibrated. Else None: plan_for
    calibrates a plan."""
    if given is not None:
        return RecordedPlan(given_plan(given, layer_kernels, batch, workers, given_source),
                            given.get("micro_batches"), f"--plan {given_source}"), ""
    if not (isinstance(resumed, dict) and len(workers) > 1 and recorded_worker_names(resumed) == sorted(workers)):
        return None, ""
    try:
        plan = given_plan(resumed, layer_kernels, batch, workers, resumed_source)
    except PlanError as e:
        return None, f"the checkpoint's plan is not run again ({e}): calibrating a new one"
    return RecordedPlan(plan, recorded_micro_batches(resumed_micro), "the same workers as the checkpoint's"), ""


# What --deterministic runs without a recorded plan: the equal split over every worker, never
# re-split from step times (a split from timing would change the sums' order from run to run).
DETERMINISTIC_FLAGS = {"split": "equal", "use_all": True, "rebalance_after": 0}


@dataclass(frozen=True)
class PlanFlags:
    """The run's flags that planning reads (hetconv-coordinator's and hetconv-plan's alike)."""
    split: str = "proportional"     # "proportional" (calibrated cost lines) or "equal" (the naive baseline)
    parallel: str = "auto"          # "auto", "model", "data", or a letter per conv layer (M/D)
    use_all: bool = False           # keep every worker, even one whose fixed work slows the step
    micro_batches: int = 0          # pieces a step is cut into as asked (0: auto, the rule's or fewer)
    exchange: str = "peer"          # "peer" (workers trade maps) or "star" (every layer through the coordinator)


@dataclass(frozen=True)
class PlanSettings:
    """What an engine's planning and calibration read of a run's configuration, and nothing else:
    built once from it (PlanSettings.of) and handed to Engine.plan_for, replan and admit, so no
    engine reads the configuration itself."""
    batch_size: int                 # images a training step
    calibration_batch: int          # images each layer is timed on at calibration (at most a step's)
    link: str                       # the link between hosts as --link gives it (costmodel.parse_bandwidth)
    precision: str                  # what the workers' conv GEMMs compute in (--precision): fp32, bf16 or auto
    wire_dtype: str                 # the wire asked for (--wire-dtype): a dtype, or auto
    flags: PlanFlags = PlanFlags()  # split, modes, workers kept, micro-batches, exchange

    @classmethod
    def of(cls, cfg):
        """The settings of a training.config.Config (read by name: the engine does not import the
        training package)."""
        flags = PlanFlags(cfg.split, cfg.parallel, bool(getattr(cfg, "use_all", False)), cfg.micro_batches,
                          cfg.exchange)
        return cls(cfg.batch_size, min(cfg.calibration_batch, cfg.batch_size), cfg.link, cfg.precision,
                   cfg.wire_dtype, flags)

    def flags_for(self, exchange):
        """The flags, with the exchange of an engine made with its own."""
        return replace(self.flags, exchange=exchange)


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


def check_plannable(layer_kernels, workers, flags):
    """What fails any plan of `workers` workers, said before anything is calibrated: data layers
    forced over --exchange star (check_exchange), and a layer that --parallel does not make
    data-parallel with fewer kernels than there are workers (only the cost model could give it
    data mode, and it chooses after calibration)."""
    check_exchange(flags, len(layer_kernels))
    forced = forced_modes(flags.parallel, len(layer_kernels))
    check_kernels_per_worker(layer_kernels, workers, forced)


def step_bounds(micro_batches, batch, specs, image_shape):
    """What the workers are told a step of this run can need, so each bounds what it holds of a
    peer's next step before that step starts there: the most micro-batches a step has (the
    rule's count for the peer exchange over two workers: more workers never give more pieces,
    and a re-plan to any count of workers stays under it), and twice the run's largest array (a
    peer's rows of the images, and where the first layer is data-parallel its rows of one
    layer's output)."""
    return {"micro_batches": micro_batch_count(micro_batches, batch, "peer", 2),
            "early_bytes": 2 * largest_array_bytes(specs, batch, tuple(image_shape))}


def profile_speeds(profiles):
    """{worker: [kernels/s per layer]} a split falls back to where the cost lines cannot split:
    the speeds each worker measured at calibration (DeviceProfile.speeds) where every profile
    kept them; else from the cost lines, one kernel on one image forward and backward, its call
    costs included (profiles saved without speeds: the two are not on one scale, so never
    mixed)."""
    if all(len(p.speeds) == len(p.layers) for p in profiles.values()):
        return {w: list(p.speeds) for w, p in profiles.items()}
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
    forced = forced_modes(flags.parallel, len(specs))
    speeds = profile_speeds(profiles) if speeds is None else {w: list(speeds[w]) for w in names}
    if flags.split != "proportional":
        plan = make_plan([s.kernels for s in specs], speeds, flags.split, batch=batch,
                         modes=forced if forced is not None and "data" in forced and len(names) > 1 else None,
                         one_split=True)
        mode_choice, modes_at, notes = None, None, []
    else:
        plan, mode_choice, modes_at, notes = _proportional_plan(specs, image_shape, batch, profiles, link, flags,
                                                                bytes_of, graph, speeds, forced)
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


def _proportional_plan(specs, image_shape, batch, profiles, link, flags, bytes_of, graph, speeds, forced):
    """choose_plan's --split proportional: the devices kept on the all-model plan of their cost
    lines, then the modes over them. -> (plan, ModeChoice or None, the modes' plan at a count of
    micro-batches (a function of it -> (plan, ModeChoice, notes)) or None where the modes are not
    chosen, notes)."""
    names, kernels, notes = list(profiles), [s.kernels for s in specs], []
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
        return model_plan, None, None, notes

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
                                    batch=batch, image_lines={w: image_lines[w] for w in kept}, one_split=True)
        except PlanError as e:
            said.append(f"{SPEED_FALLBACK}: {e}")
            built = make_plan(kernels, {w: speeds[w] for w in kept}, "proportional", modes=choice.modes,
                              batch=batch, one_split=True)
        return replace(built, left_out=dict(model_plan.left_out) if model_plan else {}), choice, said

    plan, mode_choice, said = choose_at(micro_batch_count(flags.micro_batches, batch, flags.exchange, len(kept)))
    return plan, mode_choice, choose_at, notes + said


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


def wire_for(asked, precision, computed=None):
    """The wire dtype of a plan, and why: -> (dtype, reason).

    `asked`: --wire-dtype (a dtype is taken as it is); `precision`: --precision; `computed`:
    {worker: (device, what its conv GEMMs ran in at calibration: "fp32", "bf16" or "bf16 on N
    of M call shapes")}, or None where nothing was calibrated (--local, a plan set by hand).
    auto gives bfloat16 where every CPU worker computes in bf16 (a GPU worker's kernels are
    float32: it decodes the bf16 it gets), and without a calibration where --precision bf16 is
    asked for; float32 otherwise. A worker that took bf16 on only some calls keeps float32: its
    other calls would see maps rounded that its float32 GEMMs would have used whole."""
    if check_wire_dtype(asked) != "auto":
        return asked, f"--wire-dtype {asked}"
    if computed is None:
        if precision == "bf16":
            return "bfloat16", "--precision bf16: the conv GEMMs take bf16 operands"
        if precision == "auto":
            return "float32", ("--precision auto decides per layer as the device runs, after the wire is fixed: "
                               "float32")
        return "float32", f"--precision {precision}"
    cpus = {name: what for name, (device, what) in computed.items() if is_cpu_device(device)}
    if not cpus:
        return "float32", "no CPU worker: GPU kernels compute in float32"
    fp32 = [f"{name} computes in {what}" for name, what in cpus.items() if what != "bf16"]
    if fp32:
        return "float32", "not every CPU worker computes in bf16: " + ", ".join(fp32[:3]) + (
            f" and {len(fp32) - 3} more" if len(fp32) > 3 else "")
    others = [name for name in computed if name not in cpus]
    return "bfloat16", (f"every CPU worker's conv GEMMs run bf16 ({', '.join(list(cpus)[:4])}"
                        f"{' ...' if len(cpus) > 4 else ''})"
                        + (f"; {', '.join(others[:4])} computes in float32 from what the wire carries" if others else ""))


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


# ---- where the workers run: the link as priced, the head's order, the plan of a run ----------------

@dataclass(frozen=True)
class Place:
    """Where a worker runs, as planning reads it (the coordinator's workers say it in HELLO and
    are read by these attribute names; hetconv-plan says it of the devices it prices)."""
    host_key: str = ""          # its host, as transport.sockets.host_key gives it ("" not said)
    device: str = "?"           # its device text: "cpu", "cpu:THREADS", "cuda:N"
    threads: int = 0            # its threads (0: every core it may run on)
    cores: int = 0              # the cores it may run on (0: not said)
    host: str = ""              # its host, in words


def priced_link(link, places, names, here="", here_cores=0):
    """`link` as the cost model prices it for workers `names` (of `places`, {name: Place}): where
    the CPU workers among them on any one host use every core they may run on (on host `here`,
    its `here_cores`; on another host, the most any of them says it may run on), moving a byte
    costs them compute (link_for_cores); a host that says nothing of its cores is taken to have
    one to spare."""
    hosts = {}
    for p in (places.get(n) for n in names):
        if p is not None and is_cpu_device(p.device):
            hosts.setdefault(p.host_key, []).append(p)
    for key, group in hosts.items():
        cores = here_cores if key == here else max(p.cores for p in group)
        if key and cores:
            priced = link_for_cores(link, [p.threads for p in group], cores)
            if priced is not link:
                return priced
    return link


def head_weights_later(places, workers, here):
    """Whether the coordinator's head sends the features' gradient before its FC weight GEMMs
    (head.settle after the sends), so the workers' backward starts sooner (the paper network's
    head: 11 ms to its gradient instead of 22, bench/head.py): only where no CPU worker of the
    plan shares host `here`, whose cores those GEMMs would take while it computes."""
    return not any(places[n].host_key == here and is_cpu_device(places[n].device) for n in workers)


@dataclass(frozen=True)
class WorkersPlan:
    """What plan_workers decides for a run: the policy's plan and the wire and link it was priced
    with."""
    choice: PlanChoice          # the plan, its modes and micro-batches, and their price
    link: object                # costmodel.Link as priced for the workers (priced_link)
    asked_link: object          # ... and as asked (--link)
    wire: str                   # the plan's wire dtype (wire_for)
    wire_reason: str            # ... and why, in words
    computed: dict              # {worker of the plan: (device, what its conv GEMMs ran in)}

    @property
    def plan(self):
        return self.choice.plan


def plan_workers(specs, image_shape, batch, profiles, link, places, flags=PlanFlags(), wire="auto",
                 precision="fp32", graph=None, here="", here_cores=0, speeds=None):
    """The plan of workers with calibrated `profiles` ({worker: DeviceProfile}, in worker order,
    each with the precision its conv GEMMs ran in and the speeds it measured) at `places`
    ({worker: Place}; a worker without one is taken to be on a host with a core to spare) for a
    step of `batch` images of `image_shape` over `link` (--link as asked), as `flags` ask, with
    --wire-dtype `wire` and --precision `precision`: what hetconv-coordinator trains with and
    hetconv-plan prints. The link is priced for the places (priced_link; `here`, `here_cores`:
    the caller's host key and cores, 0 where they are not to be counted: the link as given for
    the workers there); the modes with every worker's wire, the micro-batches and the run with
    the plan's (wire_for of what its workers computed in: --wire-dtype auto follows them).
    `speeds`: what a split falls back to (None: profile_speeds). -> WorkersPlan."""
    priced = priced_link(link, places, list(profiles), here, here_cores)
    computed = {w: (p.device, p.precision) for w, p in profiles.items()}

    def wire_bytes(names):
        return wire_value_bytes(wire_for(wire, precision, {n: computed[n] for n in names})[0])

    choice = choose_plan(specs, image_shape, batch, profiles, priced, flags, wire_bytes, graph, speeds)
    kept = {n: computed[n] for n in choice.plan.workers}
    dtype, reason = wire_for(wire, precision, kept)
    return WorkersPlan(choice, priced, link, dtype, reason, kept)


# One device with the cores of this host's CPU workers is calibrated by the coordinator, about as
# long as the workers' own calibration took: only where that is at most this many of the plan's
# priced steps. On tiny layers calibration's fixed costs (warm-up, 0.25 s blocks) are hundreds of
# steps.
CORES_TOGETHER_MAX_STEPS = 50


def cores_together_record(specs, image_shape, batch, planned, profiles, places, flags, calibrate_together,
                          calibration_s, local_link, here="", here_cores=0, graph=None, log=print):
    """The `cores_together` record of `planned` (a WorkersPlan of `profiles` at `places`): where
    two or more of its CPU workers run on host `here`, one CPU device with their cores together
    priced in their place as a plan like any
    other (price_cores_together), with its note where it is faster; {} where no such group is.
    `calibrate_together(threads, workers)` -> that device's DeviceProfile.
    Not priced (and not calibrated) where that calibration, about the workers' own
    (`calibration_s`), would cost more than CORES_TOGETHER_MAX_STEPS of the plan's steps, nor
    where it fails (a price the run does not need: the record says why). Where every worker is
    on `here` what moves goes over loopback and ipc: priced over `local_link()`, else over the
    link as priced for the plan's workers. `log`: its one line (the note, or that the plan
    stands)."""
    plan = planned.plan
    group = cpu_groups({w: (places[w].host_key, places[w].device) for w in plan.workers if w in places}).get(here)
    if not group:
        return {}
    threads = min(here_cores, sum(places[w].threads or here_cores for w in group))
    record = {"device": f"cpu:{threads}", "threads": threads, "workers": list(group)}
    step_s = planned.choice.step_s
    if calibration_s > CORES_TOGETHER_MAX_STEPS * step_s:
        return {**record, "not_priced": f"its calibration, about the workers' {calibration_s:.1f} s, would cost "
                                        f"more than {CORES_TOGETHER_MAX_STEPS} of this plan's steps ({step_s:.3g} s "
                                        f"each)"}
    if all(places[w].host_key == here for w in plan.workers):
        link = local_link()
    else:
        link = priced_link(planned.asked_link, places, plan.workers, here, here_cores)
    try:
        together = calibrate_together(threads, group)
        priced = price_cores_together(specs, image_shape, batch, plan, profiles, together, threads, group, link,
                                      flags, wire_value_bytes(planned.wire), planned.choice.micro_batches,
                                      places[group[0]].host, graph)
    except Exception as e:          # a price the run does not need: whatever fails, the run goes on
        why = f"{type(e).__name__}: {e}"
        log(f"one worker with the cores of {', '.join(group)} together not priced: {why}")
        return {**record, "not_priced": why}
    log(priced.line())
    return {**priced.to_json(), "link": link.name, "description": together.description}
