"""The planner: measured device speeds in, a kernel split per conv layer out. Pure: no sockets,
no clocks, deterministic for the same input.

A plan is data: per layer, a mode and what each worker does in it.
- "model" (kernel-parallel): a contiguous kernel range [start, stop) per worker, in worker
  order. Shares are integers by largest remainder, so they sum exactly to the layer's kernel
  count, and every worker gets at least one kernel of every layer (a worker with no kernels
  would only add a round trip).
- "data" (image-parallel): every worker holds the whole layer (its range is (0, kernels)) and
  computes it on its share of a batch's images, `images` (integers by largest remainder of the
  same speeds, summing to the batch); image_ranges cuts any batch or micro-batch the same way.
  Consecutive data layers share one split (a worker keeps its images from one to the next, so
  nothing moves between them), made from their times together.
"""
from dataclasses import dataclass, field, fields, replace
import math

# PlanError and check_modes are the planner's words; the cost model, which checks modes too, holds them
from hetconv.engine.costmodel import (FLOAT_BYTES, MODES, PlanError, chain_shape, check_modes,  # noqa: F401  (MODES too)
                                     graph_mode_costs, largest_remainder, mode_costs, split_sizes)
from hetconv.engine.steptasks import predict_any, predict_peer_step

POLICIES = ("proportional", "equal")

@dataclass(frozen=True)
class LayerPlan:
    layer: int
    kernels: int
    ranges: dict                      # worker name -> (start, stop) of kernels; (0, kernels) in a data layer
    speeds: dict = field(default_factory=dict)   # worker name -> kernels/s of the device on this layer
    mode: str = "model"               # "model": kernels split; "data": images split, whole weights everywhere
    images: dict = field(default_factory=dict)   # data layer: worker name -> images of a whole batch

    def count(self, worker):
        """Kernels `worker` computes: its range (model), every kernel of the layer (data)."""
        start, stop = self.ranges[worker]
        return stop - start


def image_ranges(lp, n):
    """Rows [start, stop) of a batch (or micro-batch) of `n` images per worker of data layer `lp`:
    contiguous, in worker order, shares by largest remainder of the layer's image weights, so
    every n splits in the same proportion (n = the batch gives exactly `lp.images`). A worker may
    get 0 rows when n is smaller than the workers; it still takes part in the layer's dW
    all-gather, with zeros, so every worker applies the same update."""
    if lp.mode != "data":
        raise PlanError(f"layer {lp.layer} is a {lp.mode!r} layer: only a data layer splits images")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise PlanError(f"image_ranges: n must be a count of images (an int >= 0), got {n!r}")
    workers = list(lp.images)
    weights = [lp.images[w] for w in workers]
    total = sum(weights)
    if total <= 0:
        raise PlanError(f"layer {lp.layer}: data layer with no images to split by, got {lp.images!r}")
    shares = largest_remainder(n, weights, 0, "image")
    ranges, start = {}, 0
    for w, sh in zip(workers, shares):
        ranges[w] = (start, start + sh)
        start += sh
    return ranges


def layout_rows(layer_plans, sizes):
    """Per worker, its rows [r0, r1) of each micro-batch of `sizes` images: the data blocks'
    split where they all split each micro-batch alike, an even split where there is no data
    block; None where two data blocks split differently (a graph's step refuses that plan)."""
    data = [lp for lp in layer_plans if lp.mode == "data"]
    workers = list(layer_plans[0].ranges) if layer_plans else []
    rows = {w: [] for w in workers}
    for n in sizes:
        if data:
            first = image_ranges(data[0], n)
            if any(image_ranges(lp, n) != first for lp in data[1:]):
                return None
        else:                   # even, whole images by largest remainder (as the cost model cuts them)
            first, start = {}, 0
            for w, share in zip(workers, largest_remainder(n, [1] * len(workers), 0, "image")):
                first[w], start = (start, start + share), start + share
        for w in workers:
            rows[w].append(first[w])
    return rows


def step_calls(plan, specs, input_shapes, batch, micro_batches):
    """{worker: [(layer, spec, input shape, kernels)]}: the conv calls a training step of `plan`
    makes on each worker, each shape once: per micro-batch of `batch` images (cut as
    numpy.array_split cuts them), a model layer's every image on the worker's kernels, a data
    layer's rows of the worker (image_ranges) on every kernel. `input_shapes`: each layer's
    input (its batch dimension ignored)."""
    calls = {w: [] for w in plan.workers}
    sizes = split_sizes(int(batch), int(micro_batches))
    for lp, spec, shape in zip(plan.layers, specs, input_shapes):
        cuts = [image_ranges(lp, n) for n in sizes] if lp.mode == "data" else None
        for w, (start, stop) in lp.ranges.items():
            kernels = lp.kernels if cuts else stop - start
            rows = [cut[w][1] - cut[w][0] for cut in cuts] if cuts else sizes
            calls[w] += [(lp.layer, spec, (n,) + tuple(shape[1:]), kernels)
                         for n in sorted(set(rows), reverse=True) if n > 0 and kernels > 0]
    return calls


def whole_groups(plan, specs):
    """`plan` with each model layer's kernel ranges moved to whole groups where its conv is
    grouped (ConvSpec.kernel_group kernels each): every boundary between two workers goes to the
    nearest group boundary (a depthwise conv's groups are single kernels: nothing moves), each
    worker keeping at least one group, so a worker's kernels read only their groups' input
    channels. A grouped layer with fewer groups than the plan has workers cannot be split so: a
    PlanError naming it (the mode choice puts such a layer in data mode)."""
    layers = []
    for lp, spec in zip(plan.layers, specs):
        kg = spec.kernel_group if spec.groups > 1 else 1
        if lp.mode != "model" or kg == 1:
            layers.append(lp)
            continue
        workers = [w for w in plan.workers if w in lp.ranges]
        if spec.groups < len(workers):
            raise PlanError(f"conv layer {lp.layer + 1} ({spec.describe()}): its {spec.groups} groups cannot be split "
                            f"among {len(workers)} workers in model mode (a worker holds whole groups); give it data "
                            f"mode")
        ranges, start = {}, 0
        for i, w in enumerate(workers):
            stop = lp.ranges[w][1]
            groups_left = len(workers) - 1 - i
            # the nearest whole group, leaving each worker before and after at least one
            stop = min(max(round(stop / kg), start // kg + 1), spec.groups - groups_left) * kg
            ranges[w] = (start, stop)
            start = stop
        layers.append(replace(lp, ranges=ranges))
    return replace(plan, layers=tuple(layers))


def check_kernels_per_worker(layer_kernels, workers, modes=None):
    """PlanError where a model layer (`modes`, None: every layer) has fewer kernels than there
    are `workers`: each worker of a model layer holds at least one of its kernels."""
    too_few = [k for k, m in zip(layer_kernels, check_modes(modes, len(layer_kernels))) if k < workers and m == "model"]
    if too_few:
        raise PlanError(f"{workers} workers but a conv layer has only {min(too_few)} kernels: every worker needs at "
                        f"least one kernel of every model-parallel layer (use fewer workers, a wider layer, or "
                        f"--parallel data)")


def data_runs(modes):
    """Runs of consecutive data layers, as lists of layer indices: each run shares one split of
    the images."""
    runs, run = [], []
    for li, m in enumerate(modes + ["model"]):
        if m == "data":
            run.append(li)
        elif run:
            runs.append(run)
            run = []
    return runs


def _data_layer(li, total, workers, shares, speeds):
    return LayerPlan(li, int(total), {w: (0, int(total)) for w in workers}, speeds, "data",
                     {w: int(sh) for w, sh in zip(workers, shares)})


@dataclass(frozen=True)
class Plan:
    policy: str
    workers: tuple
    layers: tuple
    left_out: dict = field(default_factory=dict)     # worker -> why it takes no part
    # one device with the cores of several of its CPU workers of one host, priced against it
    # (policy.CoresTogether.to_json), or {} where none was
    cores_together: dict = field(default_factory=dict)

    def modes(self):
        return [lp.mode for lp in self.layers]

    def counts(self):
        """{worker: [kernels it holds per layer]}: the cost model's `counts`."""
        return {w: [lp.count(w) for lp in self.layers] for w in self.workers}

    def images(self):
        """{worker: [images of a batch it takes per layer, 0 in a model layer]}: the cost model's
        `images`."""
        return {w: [lp.images.get(w, 0) for lp in self.layers] for w in self.workers}

    def to_json(self):
        """Per layer: its mode, kernels, ranges and speeds per worker, and for a data layer the
        images of a batch per worker ("images")."""
        layers = []
        for lp in self.layers:
            d = {"layer": lp.layer, "mode": lp.mode, "kernels": {w: lp.count(w) for w in self.workers},
                 "ranges": {w: list(lp.ranges[w]) for w in self.workers},
                 "speeds": {w: lp.speeds.get(w) for w in self.workers}}
            if lp.mode == "data":
                d["images"] = {w: lp.images[w] for w in self.workers}
            layers.append(d)
        d = {"policy": self.policy, "workers": list(self.workers), "left_out": dict(self.left_out), "layers": layers}
        if self.cores_together:
            d["cores_together"] = dict(self.cores_together)
        return d

    @classmethod
    def from_json(cls, d):
        """The inverse of to_json (a plan without "mode" keys is all-model)."""
        try:
            workers = tuple(d["workers"])
            layers = []
            for ld in d["layers"]:
                ranges = {w: tuple(ld["ranges"][w]) for w in workers}
                mode = ld.get("mode", "model")
                check_modes([mode], 1)
                speeds = {w: s for w, s in ld.get("speeds", {}).items() if s is not None}
                images = {w: int(ld["images"][w]) for w in workers} if mode == "data" else {}
                layers.append(LayerPlan(int(ld["layer"]), max(stop for _, stop in ranges.values()), ranges, speeds,
                                        mode, images))
            return cls(d["policy"], workers, tuple(layers), dict(d.get("left_out", {})), dict(d.get("cores_together", {})))
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, PlanError):
                raise
            raise PlanError(f"not a stored plan: {type(e).__name__} {e}") from None

    def table(self):
        """A printable table: one row per worker; per layer its mode, and each worker's kernels
        (model, with the kernels/s the split used) or images of a batch (data)."""
        head = ["worker"] + [f"conv{lp.layer + 1} ({lp.kernels}) {lp.mode}" for lp in self.layers]
        rows = [head]
        for w in self.workers:
            row = [w]
            for lp in self.layers:
                s = lp.speeds.get(w)
                if lp.mode == "data":
                    row.append(f"{lp.images[w]} img")
                else:
                    row.append(f"{lp.count(w)}" + (f" @ {s:,.0f} kernels/s" if s else ""))
            rows.append(row)
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(r)) for r in rows]
        lines.insert(1, "  ".join("-" * wd for wd in widths))
        lines += [f"{w}: left out, {why}" for w, why in self.left_out.items()]
        title = (f"split: {self.policy}, per conv layer (its kernels in brackets, then its mode): kernels per worker "
                 f"(model), or images of a batch per worker, each holding every kernel (data)")
        return title + "\n" + "\n".join(lines)


def check_lines(lines, unit="kernel", layers=None):
    """Cost lines {worker: [(fixed_s, per_unit_s) per layer]} as a plan reads them: a fixed part
    finite and >= 0, a per-unit part finite and > 0 (a device whose kernels cost nothing would
    take a layer's every kernel, and a share is sized by dividing by that cost). PlanError naming
    the worker, the layer and the value otherwise: a zero or non-finite calibration. `layers`:
    the indices read (None: every layer)."""
    for w, per_layer in lines.items():
        for li, line in enumerate(per_layer):
            if layers is not None and li not in layers:
                continue
            fixed, per_unit = line
            if not (math.isfinite(fixed) and fixed >= 0):
                raise PlanError(f"worker {w!r}: conv{li + 1}'s calibrated fixed seconds {fixed!r}, expected a finite "
                                f"number >= 0")
            if not (math.isfinite(per_unit) and per_unit > 0):
                raise PlanError(f"worker {w!r}: conv{li + 1}'s calibrated seconds per {unit} {per_unit!r}, expected a "
                                f"positive finite number (a zero or non-finite calibration)")


def check_profiles(profiles):
    """Calibrated profiles {worker: DeviceProfile} as the cost model reads them: every field of
    every layer's LayerCost finite and >= 0, and a kernel's image costing more than nothing
    (forward_per_kernel_s + backward_per_kernel_s > 0). A profile may come from a file or a
    worker: PlanError naming the worker, the layer and the field otherwise."""
    for w, profile in profiles.items():
        for li, cost in enumerate(profile.layers):
            for f in fields(cost):
                value = getattr(cost, f.name)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                        or value < 0:
                    raise PlanError(f"worker {w!r}: conv{li + 1}'s calibrated {f.name} {value!r}, expected finite "
                                    f"seconds >= 0")
            if not cost.forward_per_kernel_s + cost.backward_per_kernel_s > 0:
                raise PlanError(f"worker {w!r}: conv{li + 1}'s calibrated forward_per_kernel_s and "
                                f"backward_per_kernel_s are both 0, expected positive seconds (a zero calibration)")


def make_plan(layer_kernels, speeds, policy="proportional", modes=None, batch=None, one_split=False):
    """layer_kernels: kernels per conv layer, e.g. [500, 1500].
    speeds: {worker: [kernels/s for each layer]} in the order workers should hold the ranges
    (ignored by the `equal` policy except for its worker names).
    modes: "model" or "data" per layer (None: all "model"); a data layer splits the `batch`
    images in proportion to the same speeds, at least one image per worker, once per run of
    consecutive data layers (with `one_split`, once for all: plan_from_lines says why)."""
    if policy not in POLICIES:
        raise PlanError(f"unknown split policy {policy!r}: expected one of {', '.join(POLICIES)}")
    workers = tuple(speeds)
    modes = check_modes(modes, len(layer_kernels))
    _check_batch(modes, batch, len(workers))
    layers = []
    for li, total in enumerate(layer_kernels):
        if policy == "equal":
            weights = [1.0] * len(workers)
        else:
            weights = []
            for w in workers:
                per_layer = speeds[w]
                if len(per_layer) != len(layer_kernels):
                    raise PlanError(f"worker {w!r} reported {len(per_layer)} layer speeds, expected {len(layer_kernels)}")
                weights.append(float(per_layer[li]))
            if not all(math.isfinite(v) and v > 0 for v in weights):
                # a zero speed would get a share of nothing, an infinite one every kernel
                raise PlanError(f"conv{li + 1}: speeds must be positive and finite, got {weights!r}")
        layer_speeds = {w: float(speeds[w][li]) for w in workers if speeds[w] is not None and len(speeds[w]) > li}
        if modes[li] == "data":
            run = ([lj for lj, m in enumerate(modes) if m == "data"] if one_split
                   else next(r for r in data_runs(modes) if li in r))
            if policy != "equal":
                # a worker's images pass through the whole run: its time an image is the sum of
                # kernels / (kernels/s) over the run's layers
                weights = [1.0 / sum(layer_kernels[lj] / float(speeds[w][lj]) for lj in run) for w in workers]
            shares = largest_remainder(int(batch), weights, unit="image")
            layers.append(_data_layer(li, total, workers, shares, layer_speeds))
            continue
        shares = largest_remainder(int(total), weights)
        ranges, start = {}, 0
        for w, sh in zip(workers, shares):
            ranges[w] = (start, start + sh)
            start += sh
        layers.append(LayerPlan(li, int(total), ranges, layer_speeds))
    return Plan(policy, workers, tuple(layers))


def _check_batch(modes, batch, workers):
    if "data" not in modes:
        return
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise PlanError(f"a data layer splits a batch's images: batch must be a positive int, got {batch!r}")
    if batch < workers:
        raise PlanError(f"cannot give {workers} workers at least 1 image each of a batch of {batch}: "
                        f"use a batch of at least {workers} or model-parallel layers")


def fixed_plan(layer_kernels, counts, policy="fixed", modes=None, images=None):
    """A plan from explicit kernel counts {worker: [count per layer]}: for tests and experiments.
    modes: "model" or "data" per layer (None: all model); images: {worker: images of a batch},
    or {worker: [images per layer]}, for the data layers, >= 0 each, the same batch in every
    data layer. A data layer's entry in `counts` is not read (every worker holds every kernel)."""
    workers = tuple(counts)
    modes = check_modes(modes, len(layer_kernels))
    layers = []
    batches = set()
    for li, total in enumerate(layer_kernels):
        if modes[li] == "data":
            try:
                got = {w: images[w][li] if isinstance(images[w], (list, tuple)) else images[w] for w in workers}
            except (TypeError, KeyError, IndexError):
                raise PlanError(f"layer {li} is a data layer: images must give every worker of {list(workers)} "
                                f"its images of a batch, got {images!r}") from None
            if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in got.values()) or not sum(got.values()):
                raise PlanError(f"layer {li}: images {got!r} must be ints >= 0 with a positive sum")
            batches.add(sum(got.values()))
            if len(batches) > 1:
                raise PlanError(f"data layers split different batches {sorted(batches)}: images must sum to one batch")
            if li and modes[li - 1] == "data" and layers[-1].images != got:
                raise PlanError(f"layers {li - 1} and {li} are consecutive data layers with different images "
                                f"{layers[-1].images!r} and {got!r}: a worker keeps its images from one to the next")
            layers.append(_data_layer(li, total, workers, [got[w] for w in workers], {}))
            continue
        got = sum(counts[w][li] for w in workers)
        if got != total or any(counts[w][li] < 1 for w in workers):
            raise PlanError(f"layer {li}: counts {[counts[w][li] for w in workers]} must be >= 1 and sum to {total}")
        ranges, start = {}, 0
        for w in workers:
            ranges[w] = (start, start + counts[w][li])
            start += counts[w][li]
        layers.append(LayerPlan(li, total, ranges, {}))
    return Plan(policy, workers, tuple(layers))


def recorded_worker_names(record):
    """The names of the workers a recorded plan ran with, those it left out included, sorted;
    [] where the record holds none it can name (an untrusted file's record)."""
    if not isinstance(record, dict) or not isinstance(record.get("workers"), list):
        return []
    left_out = record.get("left_out") if isinstance(record.get("left_out"), dict) else {}
    return sorted({str(w) for w in record["workers"]} | {str(w) for w in left_out})


def given_plan(record, layer_kernels, batch, workers, source):
    """The plan an earlier run recorded (`record`: Plan.to_json()'s fields, as a "plan" metrics
    record holds them), checked against this run as fixed_plan checks a plan set by hand: its
    layers' kernels, its data layers' images summing to `batch`, and its workers exactly this
    run's `workers` (names). Raises PlanError naming `source` and what differs."""
    try:
        plan = Plan.from_json(record)
    except PlanError as e:
        raise PlanError(f"{source}: {e}") from None
    if len(plan.layers) != len(layer_kernels):
        raise PlanError(f"{source}: a plan of {len(plan.layers)} conv layers; this network has {len(layer_kernels)}")
    if not all(isinstance(w, str) and isinstance(why, str) for w, why in plan.left_out.items()):
        raise PlanError(f"{source}: its left-out workers {plan.left_out!r} are not names with reasons")
    # a worker the planner left out (too slow to pay for its share) was part of the run: it idles again
    if sorted([*plan.workers, *(w for w in plan.left_out if w not in plan.workers)]) != sorted(workers):
        left = f" (left out: {', '.join(plan.left_out)})" if plan.left_out else ""
        raise PlanError(f"{source}: a plan for workers {', '.join(plan.workers)}{left}; this run has "
                        f"{', '.join(workers)} (the same --spawn list, or external workers started with the same --name)")
    for lp, total in zip(plan.layers, layer_kernels):
        if lp.kernels != total:
            raise PlanError(f"{source}: conv layer {lp.layer + 1} has {lp.kernels} kernels in the plan, {total} here")
    images = plan.images()
    data_batches = {sum(images[w][li] for w in plan.workers) for li, m in enumerate(plan.modes()) if m == "data"}
    if data_batches and data_batches != {batch}:
        raise PlanError(f"{source}: its data layers split batches of {sorted(data_batches)} images; this run's "
                        f"--batch-size is {batch}")
    try:
        checked = fixed_plan(list(layer_kernels), plan.counts(), policy=f"given ({source})", modes=plan.modes(),
                             images=images)
    except PlanError as e:
        raise PlanError(f"{source}: {e}") from None
    for lp, mine in zip(plan.layers, checked.layers):
        if lp.mode == "model" and lp.ranges != mine.ranges:
            raise PlanError(f"{source}: conv layer {lp.layer + 1}'s kernel ranges {lp.ranges} are not contiguous in "
                            f"the plan's worker order")
    return replace(checked, layers=tuple(replace(mine, speeds=lp.speeds) for lp, mine in zip(plan.layers, checked.layers)),
                   left_out=dict(plan.left_out))


def replan(plan, lines, measured, min_gain=0.05, image_lines=None):
    """Re-split a proportional plan from what real steps took under it: kernels of its model
    layers, images of its data layers (each layer keeps its mode).

    lines: {worker: [(fixed_s, per_kernel_s) per layer]}, the calibrated seconds per step at
        the step's batch, or None for a worker without calibration (then all of its time counts
        as per-kernel, or per-image in a data layer).
    measured: {worker: [compute seconds per step, per layer]} under `plan`.
    image_lines: {worker: [(fixed_s, per_image_s) per layer]} for the data layers (see
        LayerCost.image_line); where absent, a data layer's line is its kernel line's whole-layer
        time spread over the batch's images (no fixed part).

    Calibration can be fooled (a burst of outside load, a cache that behaves differently at the
    calibration batch); real steps cannot. Each worker's calibrated line is scaled by how far the
    real steps were from it, so a worker holding few kernels, whose time is mostly the fixed
    part, is not mistaken for a slow one. Returns the proportional plan of the scaled lines if
    it cuts the slowest worker's predicted compute by more than `min_gain`, else None."""
    modes = plan.modes()
    batch = next((sum(lp.images.values()) for lp in plan.layers if lp.mode == "data"), None)
    fixed, per_unit, now = {}, {}, {}
    for name in plan.workers:
        fixed[name], per_unit[name] = [], []
        for lp in plan.layers:
            seconds = float(measured[name][lp.layer])
            units = _units(lp, name)               # kernels (model) or images of the batch (data)
            line = _unit_line(lp, lines.get(name), (image_lines or {}).get(name), batch)
            if line is not None and line[0] + line[1] * units > 0:
                f, p = line
                scale = seconds / (f + p * units)
                f, p = f * scale, p * scale
            else:
                f, p = 0.0, seconds / max(units, 1)
            fixed[name].append(f)
            per_unit[name].append(p)
        now[name] = sum(float(measured[name][lp.layer]) for lp in plan.layers)
    scaled = {name: list(zip(fixed[name], per_unit[name])) for name in plan.workers}
    # a data layer's kernel line (read only for its kernels/s): the whole layer at the batch
    kernel_lines = {name: [(0.0, (f + p * batch) / lp.kernels) if lp.mode == "data" else (f, p)
                           for lp, (f, p) in zip(plan.layers, scaled[name])] for name in plan.workers}
    data = [lp for lp in plan.layers if lp.mode == "data"]
    one_split = len(data) > 1 and all(lp.images == data[0].images for lp in data)   # a graph's layouts keep it
    proposal = plan_from_lines([lp.kernels for lp in plan.layers], kernel_lines, use_all=True, modes=modes,
                               batch=batch, image_lines=scaled, one_split=one_split)
    then = {name: sum(fixed[name][lp.layer] + _units(lp, name) * per_unit[name][lp.layer] for lp in proposal.layers)
            for name in proposal.workers}
    if max(then.values()) > (1 - min_gain) * max(now.values()):
        return None
    return proposal


def _units(lp, worker):
    return lp.images[worker] if lp.mode == "data" else lp.count(worker)


def _unit_line(lp, kernel_lines, image_lines, batch):
    """The (fixed, per unit) line a layer splits by: per kernel (model) or per image (data)."""
    if lp.mode != "data":
        return None if kernel_lines is None else kernel_lines[lp.layer]
    if image_lines is not None:
        return image_lines[lp.layer]
    if kernel_lines is None:
        return None
    return image_line_from_kernel_line(kernel_lines[lp.layer], lp.kernels, batch)


def image_line_from_kernel_line(line, kernels, batch):
    """A device's (fixed, per image) seconds on a data layer, from its (fixed, per kernel) line
    at `batch` images: the whole layer's time spread over the batch. It puts the per-call part
    (small at a step's batch) into every image: LayerCost.image_line keeps it apart."""
    f, p = line
    return 0.0, (f + p * kernels) / batch


# ---- splitting by calibrated cost lines, and choosing the devices ------------------------------

def affine_shares(total, lines):
    """Kernel counts (floats) that finish together: each device's seconds are fixed + per_kernel * k,
    and the split makes them equal where it can (T = F_i + p_i k_i for every device that gets
    kernels). A device whose fixed part alone exceeds T gets none. lines: [(fixed_s, per_kernel_s)]."""
    active = [i for i, (_, p) in enumerate(lines) if p > 0]
    while active:
        inv = sum(1.0 / lines[i][1] for i in active)
        finish = (total + sum(lines[i][0] / lines[i][1] for i in active)) / inv
        shares = {i: (finish - lines[i][0]) / lines[i][1] for i in active}
        negative = [i for i, k in shares.items() if k < 0]
        if not negative:
            return [shares.get(i, 0.0) for i in range(len(lines))]
        active = [i for i in active if i not in negative]
    raise PlanError("no device has a usable cost line (per-kernel cost must be > 0)")


def predicted_compute_s(layer_kernels, lines, workers):
    """Seconds of conv compute a step takes with `workers` sharing every layer by affine_shares:
    layers run one after another (each needs the whole previous layer), the slowest device
    sets each layer's time."""
    total = 0.0
    for li, kernels in enumerate(layer_kernels):
        layer_lines = [lines[w][li] for w in workers]
        shares = largest_remainder(kernels, affine_shares(kernels, layer_lines))
        total += max(f + p * k for (f, p), k in zip(layer_lines, shares))
    return total


def plan_from_lines(layer_kernels, lines, use_all=False, modes=None, batch=None, image_lines=None, one_split=False):
    """The proportional plan from calibrated cost lines {worker: [(fixed_s, per_kernel_s) per
    layer]} (seconds a step at the step's batch), choosing the devices: a device whose part in
    the plan makes the predicted step slower (its fixed work outweighs its share, or its share
    would round to nothing) is left out, greedily, most harmful first, and the plan says why.
    `use_all` keeps every device. Pure: the same input gives the same plan.
    modes: "model" or "data" per layer (None: all model). A data layer splits the `batch`
    images so the devices finish together, by image_lines {worker: [(fixed_s, per_image_s) per
    layer]} (LayerCost.image_line) or, without them, by image_line_from_kernel_line. Choosing
    the devices reads the kernel lines of every layer, whatever its mode. A run of consecutive
    data layers splits the images once; with `one_split` (a graph, whose tensors keep a layout
    only where every data block splits the images alike: engine/layouts.py) all of them do."""
    modes = check_modes(modes, len(layer_kernels))
    _check_batch(modes, batch, 1)
    check_lines(lines)
    if image_lines is not None:
        check_lines(image_lines, "image", [li for li, m in enumerate(modes) if m == "data"])
    workers = list(lines)
    left_out = {}
    if not use_all:
        while len(workers) > 1:
            now = predicted_compute_s(layer_kernels, lines, workers)
            best = min(workers, key=lambda w: predicted_compute_s(layer_kernels, lines, [v for v in workers if v != w]))
            without = predicted_compute_s(layer_kernels, lines, [v for v in workers if v != best])
            if without >= now:
                break
            fixed = sum(lines[best][li][0] for li in range(len(layer_kernels)))
            exact = [affine_shares(k, [lines[w][li] for w in workers])[workers.index(best)]
                     for li, k in enumerate(layer_kernels)]
            share = sum(exact) / sum(layer_kernels)
            left_out[best] = (f"adds {fixed:.3g} s of fixed work a step for {100 * share:.1f}% of the kernels "
                              f"(step {now:.3g} s with it, {without:.3g} s without)")
            workers.remove(best)
    check_kernels_per_worker(layer_kernels, len(workers), modes)
    _check_batch(modes, batch, len(workers))
    layers = []
    for li, total in enumerate(layer_kernels):
        if modes[li] == "data":
            run = ([lj for lj, m in enumerate(modes) if m == "data"] if one_split
                   else next(r for r in data_runs(modes) if li in r))
            per_image = [[image_lines[w][lj] if image_lines is not None
                          else image_line_from_kernel_line(lines[w][lj], int(layer_kernels[lj]), batch) for lj in run]
                         for w in workers]
            # the run's layers one after another on each worker's images: their lines add up
            run_lines = [(sum(f for f, _ in wl), sum(p for _, p in wl)) for wl in per_image]
            shares = largest_remainder(int(batch), affine_shares(int(batch), run_lines))
            layers.append(_data_layer(li, total, workers, shares,
                                      {w: 1.0 / lines[w][li][1] for w in workers if lines[w][li][1] > 0}))
            continue
        layer_lines = [lines[w][li] for w in workers]
        shares = largest_remainder(int(total), affine_shares(int(total), layer_lines))
        ranges, start = {}, 0
        for w, sh in zip(workers, shares):
            ranges[w] = (start, start + sh)
            start += sh
        speeds = {w: 1.0 / p for w, (f, p) in zip(workers, layer_lines)}    # kernels/s, past the fixed part
        layers.append(LayerPlan(li, int(total), ranges, speeds))
    return Plan("proportional", tuple(workers), tuple(layers), left_out)


# ---- per layer: model- or data-parallel --------------------------------------------------------

PARALLEL = ("auto", "model", "data")


MODE_LETTERS = {"M": "model", "D": "data"}
# A graph's plans priced within this fraction of the cheapest count as alike, and of those the
# one moving the fewest bytes is taken. The cost model is within a few percent on compute but
# under-prices traffic where hosts have no core to spare for their network (resnet18, two
# one-thread workers on two cores at 1 Gbit/s: all-data priced 3% under a plan with model-parallel
# layer4 that moves half the bytes, measured 38% slower).
TRAFFIC_TIE = 0.05


def check_parallel(value):
    """--parallel: 'auto' (the cost model picks per layer), 'model' or 'data' (every layer), or
    a chain of one letter per conv layer, M model or D data (e.g. DDDDDDMM), which forces each
    layer's mode: how a benchmark checks the cost model's choice layer by layer. Either case is
    read; returns the value as it is used (a word in lower case, a chain in upper case)."""
    if isinstance(value, str) and value.lower() in PARALLEL:
        return value.lower()
    if isinstance(value, str) and value and set(value.upper()) <= set(MODE_LETTERS):
        return value.upper()
    raise PlanError(f"--parallel must be one of {', '.join(PARALLEL)}, or a letter per conv layer (M model-parallel, "
                    f"D data-parallel) such as DDMM, got {value!r}")


def forced_modes(parallel, layers):
    """The mode of each of `layers` conv layers that --parallel forces ('model', 'data', or a
    chain of M and D), or None where the cost model chooses ('auto'). A chain of the wrong
    length is a PlanError that says how many layers the network has."""
    parallel = check_parallel(parallel)
    if parallel == "auto":
        return None
    if parallel in PARALLEL:
        return [parallel] * layers
    if len(parallel) != layers:
        raise PlanError(f"--parallel {parallel}: {len(parallel)} letter(s) for a network of {layers} conv layer(s) "
                        f"(one M or D per layer)")
    return [MODE_LETTERS[letter] for letter in parallel]


def cheapest_modes(node, edge):
    """The cheapest assignment of modes to a chain of layers, by dynamic programme over the
    layers with the state the layer's mode: node[l][mode] is layer l's price in a mode,
    edge[l][(previous mode, mode)] the price of the boundary between layers l-1 and l (edge[0]
    is not read). Returns (modes, seconds). On a tie, fewer data layers win (whole weights on
    every worker cost memory)."""
    best = {m: (s, [m]) for m, s in node[0].items()}
    for li in range(1, len(node)):
        best = {m: min(((s + edge[li][(a, m)] + here, path + [m]) for a, (s, path) in best.items()),
                       key=lambda t: (t[0], t[1].count("data")))
                for m, here in node[li].items()}
    seconds, modes = min(best.values(), key=lambda t: (t[0], t[1].count("data")))
    return modes, seconds


@dataclass
class ModeChoice:
    modes: list                 # "model" or "data" per conv layer
    costs: object               # costmodel.ModeCosts: every layer's price in each mode
    chosen_s: float             # the priced seconds of `modes`
    model_s: float              # ... and of every layer in model mode
    reason: str                 # why these modes, in words

    def to_json(self):
        return {"modes": list(self.modes), "chosen_s": self.chosen_s, "model_s": self.model_s, "reason": self.reason,
                "layers": self.costs.to_json()}


def cost_lines(profiles, layer_kernels, batch, calls=1):
    """Calibrated profiles {worker: DeviceProfile} -> (lines, image_lines) for plan_from_lines:
    per worker and layer, (fixed, per kernel) seconds of a step of `batch` images in `calls`
    calls (model), and (fixed, per image) seconds of all the layer's kernels (data)."""
    check_profiles(profiles)
    lines = {w: [c.step_line(batch, calls) for c in p.layers] for w, p in profiles.items()}
    image_lines = {w: [c.image_line(k, calls) for c, k in zip(p.layers, layer_kernels)] for w, p in profiles.items()}
    return lines, image_lines


def mode_shares(specs, batch, profiles, micro_batches=1):
    """Each layer's split in each mode from calibrated profiles {worker: DeviceProfile}:
    ({worker: [kernels per layer]} finishing together in model mode, {worker: [images per
    layer]} finishing together in data mode, each layer on its own)."""
    names = list(profiles)
    calls = micro_batches
    counts, images = {w: [] for w in names}, {w: [] for w in names}
    for li, spec in enumerate(specs):
        if spec.kernels >= len(names):
            lines = [profiles[w].layers[li].step_line(batch, calls) for w in names]
            for w, k in zip(names, largest_remainder(spec.kernels, affine_shares(spec.kernels, lines))):
                counts[w].append(k)
        else:
            for w in names:
                counts[w].append(0)
        per_image = [profiles[w].layers[li].image_line(spec.kernels, calls) for w in names]
        if batch >= len(names):
            shares = largest_remainder(batch, affine_shares(batch, per_image))
        else:
            shares = [1 if i < batch else 0 for i in range(len(names))]
        for w, n in zip(names, shares):
            images[w].append(n)
    return counts, images


def one_image_split(specs, batch, profiles, micro_batches=1):
    """{worker: images of the batch}: one split for every block of an all-data graph, the
    workers' per-image lines over the whole network (each block's image_line added up) finishing
    together, as data parallelism splits a batch."""
    names = list(profiles)
    lines = []
    for w in names:
        parts = [profiles[w].layers[li].image_line(spec.kernels, micro_batches) for li, spec in enumerate(specs)]
        lines.append((sum(f for f, _ in parts), sum(p for _, p in parts)))
    if batch < len(names):
        return {w: int(i < batch) for i, w in enumerate(names)}
    return dict(zip(names, largest_remainder(batch, affine_shares(batch, lines))))


def fewest_bytes_of_alike(priced, moved, beat):
    """Of plans `priced` ({modes: seconds}) within TRAFFIC_TIE of the cheapest, the one that moves
    the fewest bytes (`moved`, {modes: bytes}): what the cost model knows least is traffic (the
    link's queue, the CPU moving it takes from compute). Only plans priced under `beat` (what
    all-model costs less the gain a plan with data blocks must show) count, so the tie never
    loses that test; where none is, the cheapest."""
    cheapest = min(priced, key=lambda c: (priced[c], c.count("model")))
    bound = min((1 + TRAFFIC_TIE) * priced[cheapest], beat)
    near = [c for c in priced if priced[c] <= bound] or [cheapest]
    return min(near, key=lambda c: (moved[c], priced[c], c.count("model")))


def _layer_mode_costs(specs, image_shape, batch, profiles, link, micro_batches, value_bytes, graph):
    """choose_modes' prices of every layer in each mode at the shares its workers would get
    (mode_shares): -> (costmodel.ModeCosts, {worker: [kernels per layer]} in model mode, the
    GraphShape its plans are priced on: `graph`, or a chain's). A mode a layer cannot take costs
    infinity: model where it has fewer kernels (or groups) than workers, data where the batch has
    fewer images."""
    names = list(profiles)
    counts, images = mode_shares(specs, batch, profiles, micro_batches)
    if graph is None:
        costs = mode_costs(specs, image_shape, batch, counts, images, profiles, link, micro_batches, value_bytes)
        # its candidate plans priced as the one step runs a chain: the graph whose blocks each
        # read the one before
        graph = chain_shape(specs, image_shape)
    else:
        costs = graph_mode_costs(specs, image_shape, batch, counts, images, profiles, link, graph.needs_dx,
                                 micro_batches, value_bytes, graph.feature_floats * batch)
    for li, spec in enumerate(specs):
        if spec.kernels < len(names) or spec.groups > 1 and spec.groups < len(names):
            # a worker of a model layer holds a kernel, of a grouped one a group
            costs.node[li]["model"] = float("inf")
        if batch < len(names):
            costs.node[li]["data"] = float("inf")
    return costs, counts, graph


def _best_layout_plan(priced, moved, costs, model_s, min_gain, layers):
    """choose_modes' pick of the plans with data blocks priced as the layout step runs them
    (`priced`: {modes: seconds}; `moved`: {modes: bytes among the workers}): the cheapest, or of
    those within TRAFFIC_TIE the one moving the fewest bytes, where it gains `min_gain` over
    every layer in model mode (`model_s`); else all-model. -> ModeChoice."""
    cheapest = min(priced, key=lambda c: (priced[c], c.count("model"))) if priced else None
    best = (fewest_bytes_of_alike(priced, moved, (1 - min_gain) * model_s)
            if cheapest is not None and priced[cheapest] < float("inf") else cheapest)
    if best is not None and priced[best] < (1 - min_gain) * model_s:
        how = ("every block data-parallel" if "model" not in best else
               f"{best.count('data')} blocks data-parallel, {best.count('model')} model-parallel")
        fewer = ("" if best == cheapest else
                 f"; it moves {moved[best] / 1e6:.3g} MB a step among the workers where the cheapest-priced plan "
                 f"({priced[cheapest]:.3g} s, within {100 * TRAFFIC_TIE:g}%) moves {moved[cheapest] / 1e6:.3g}")
        return ModeChoice(list(best), costs, priced[best], model_s,
                          f"{how}, the tensors in each worker's rows or whole between them: {priced[best]:.3g} s "
                          f"against {model_s:.3g} s with every layer in model mode{fewer}")
    return ModeChoice(["model"] * layers, costs, model_s, model_s,
                      f"no plan with data blocks gains {100 * min_gain:g}% over all-model ({model_s:.3g} s)")


def choose_modes(specs, image_shape, batch, profiles, link, parallel="auto", micro_batches=1, value_bytes=FLOAT_BYTES,
                 min_gain=0.02, graph=None):
    """Model or data per conv layer, from the cost model: every layer priced in both modes at
    the shares its workers would get (mode_shares), then the cheapest chain (cheapest_modes).
    profiles: {worker: DeviceProfile} of the workers of the plan, in plan order.
    `parallel`: 'model' or 'data' forces every layer, a chain of M and D each layer; 'auto' takes the cheapest chain where it
    beats every layer in model mode by more than `min_gain` of its price (a plan with data
    layers holds whole weights on every worker, and the model's error is a few percent). With
    one worker the two modes are the same: every layer is "model". A layer with fewer kernels
    than workers can only be data; a batch with fewer images than workers only model.
    `graph`: a costmodel.GraphShape where the network is a graph, whose blocks are priced as its
    step runs them (graph_mode_costs). A chain's layers are priced by mode_costs, and its plans,
    as a graph's, by the one step's timeline (predict_peer_step of chain_shape): of the plans
    priced within TRAFFIC_TIE of the cheapest the one that moves the fewest bytes is taken.
    Returns a ModeChoice."""
    check_parallel(parallel)
    check_profiles(profiles)
    names = list(profiles)
    layers = len(specs)
    if not names:
        raise PlanError("no workers to choose modes for")
    chain = graph is None
    costs, counts, graph = _layer_mode_costs(specs, image_shape, batch, profiles, link, micro_batches, value_bytes,
                                             graph)
    inf = float("inf")
    model_s = costs.chain_s(["model"] * layers)
    if graph.steps and len(names) > 1 and model_s < inf:
        model_s = predict_peer_step(specs, image_shape, batch, counts, {w: 1 for w in names}, profiles, link, 0.0,
                                    graph, ["model"] * layers, micro_batches, value_bytes).step_s
    if len(names) == 1:
        return ModeChoice(["model"] * layers, costs, model_s, model_s, "one worker: the two modes are the same")
    # a graph's plan with data blocks splits the images once and holds its tensors in layouts
    # (engine/layouts.py): such plans are priced as that step runs them
    moved = {}                                  # modes -> bytes a layout step of them sends among the workers

    def layout_s(modes):
        if graph.steps and "data" not in modes:
            return model_s
        if not graph.steps or batch < len(names):
            return None
        if any(m == "model" and costs.node[li]["model"] == inf for li, m in enumerate(modes)):
            return inf
        pred = predict_peer_step(specs, image_shape, batch, counts, split, profiles, link, 0.0, graph, list(modes),
                                 micro_batches, value_bytes)
        moved[tuple(modes)] = sum(v["sent"] for v in pred.workers.values())
        return pred.step_s

    split = one_image_split(specs, batch, profiles, micro_batches) if graph.steps and batch >= len(names) else None
    forced = forced_modes(parallel, layers)
    if forced is not None:
        priced = layout_s(forced)
        seconds = costs.chain_s(forced) if priced is None else priced
        if seconds == inf:
            what = (f"a batch of {batch} image(s)" if "data" in forced and batch < len(names)
                    else f"a conv layer of {min(s.kernels for s, m in zip(specs, forced) if m == 'model')} kernel(s)")
            raise PlanError(f"--parallel {parallel}: {len(names)} workers cannot split {what}")
        return ModeChoice(forced, costs, seconds, model_s, f"--parallel {parallel}")
    modes, seconds = cheapest_modes(costs.node, costs.edge)
    if split is not None:
        # every run of data blocks before model ones (all data too) and, for a chain, its layers'
        # cheapest modes however they interleave: a chain's per-layer prices see its transitions
        # (mode_costs' edges), a graph's see every tensor whole between blocks, and each change of
        # layout is a wait on every worker for the slowest that the timeline leaves out (resnet18
        # at 10 Gbit/s: an interleaved plan priced as D11M9 ran 9% slower)
        candidates = {("data",) * k + ("model",) * (layers - k) for k in range(1, layers + 1)}
        if chain:
            candidates.add(tuple(modes))
        priced = {c: layout_s(c) for c in candidates if "data" in c}
        return _best_layout_plan(priced, moved, costs, model_s, min_gain, layers)
    if "data" in modes and model_s < inf and seconds > (1 - min_gain) * model_s:
        return ModeChoice(["model"] * layers, costs, model_s, model_s,
                          f"the cheapest chain ({seconds:.3g} s) gains less than {100 * min_gain:g}% over "
                          f"all-model ({model_s:.3g} s)")
    why = ("every layer is cheapest in model mode" if "data" not in modes
           else f"{seconds:.3g} s against {model_s:.3g} s with every layer in model mode")
    return ModeChoice(modes, costs, seconds, model_s, why)


def price_plan(specs, image_shape, batch, plan, profiles, link, exchange="peer", micro_batches=1,
               value_bytes=FLOAT_BYTES, graph=None):
    """The cost model's seconds of one step of `plan` ({worker: DeviceProfile} for its workers;
    its modes and images), the coordinator's own FC work left out: it is the same whatever the
    plan. `graph`: a costmodel.GraphShape where the network is a graph."""
    return predict_any(exchange, specs, image_shape, batch, plan.counts(), {w: profiles[w] for w in plan.workers},
                       link, 0.0, micro_batches, value_bytes, modes=plan.modes(), images=plan.images(),
                       graph=graph).step_s
