"""The planner: measured device speeds in, a kernel split per conv layer out. Pure: no sockets,
no clocks, deterministic for the same input.

A plan is data: per layer, a contiguous kernel range [start, stop) per worker, in worker order.
Shares are integers by largest remainder, so they sum exactly to the layer's kernel count, and
every worker gets at least one kernel of every layer (a worker with no kernels would only add a
round trip).
"""
from dataclasses import dataclass, field

POLICIES = ("proportional", "equal")


class PlanError(ValueError):
    pass


@dataclass(frozen=True)
class LayerPlan:
    layer: int
    kernels: int
    ranges: dict                      # worker name -> (start, stop)
    speeds: dict = field(default_factory=dict)   # worker name -> kernels/s used for the split

    def count(self, worker):
        start, stop = self.ranges[worker]
        return stop - start


@dataclass(frozen=True)
class Plan:
    policy: str
    workers: tuple
    layers: tuple
    left_out: dict = field(default_factory=dict)     # worker -> why it takes no part

    def to_json(self):
        return {"policy": self.policy, "workers": list(self.workers), "left_out": dict(self.left_out), "layers": [
            {"layer": lp.layer, "kernels": {w: lp.count(w) for w in self.workers},
             "ranges": {w: list(lp.ranges[w]) for w in self.workers},
             "speeds": {w: lp.speeds.get(w) for w in self.workers}} for lp in self.layers]}

    def table(self):
        """A printable table: one row per worker, kernels (and measured kernels/s) per layer."""
        head = ["worker"] + [f"conv{lp.layer + 1} ({lp.kernels})" for lp in self.layers]
        rows = [head]
        for w in self.workers:
            row = [w]
            for lp in self.layers:
                s = lp.speeds.get(w)
                row.append(f"{lp.count(w)}" + (f" @ {s:,.0f} kernels/s" if s else ""))
            rows.append(row)
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(r)) for r in rows]
        lines.insert(1, "  ".join("-" * wd for wd in widths))
        lines += [f"{w}: left out, {why}" for w, why in self.left_out.items()]
        title = f"split: {self.policy}, kernels per worker and conv layer (the layer's total in brackets)"
        return title + "\n" + "\n".join(lines)


def largest_remainder(total, weights, minimum=1):
    """Integer shares of `total` proportional to `weights`, each >= minimum, summing to total."""
    n = len(weights)
    if n == 0:
        raise PlanError("no workers to split kernels across")
    if total < minimum * n:
        raise PlanError(f"cannot give {n} workers at least {minimum} kernel(s) each of a layer with {total} kernels: "
                        f"use at most {total // max(minimum, 1)} workers or a wider layer")
    bad = [w for w in weights if not (w > 0) or w != w or w == float("inf")]
    if bad:
        raise PlanError(f"speeds must be positive and finite, got {list(weights)!r}")
    s = float(sum(weights))
    exact = [total * w / s for w in weights]
    shares = [int(e) for e in exact]
    # Hand out what rounding down left, biggest remainder first; ties go to the earlier worker.
    order = sorted(range(n), key=lambda i: (-(exact[i] - shares[i]), i))
    for i in order[:total - sum(shares)]:
        shares[i] += 1
    # A very slow worker still gets `minimum`, taken from whoever holds the most.
    for i in range(n):
        while shares[i] < minimum:
            donor = max(range(n), key=lambda j: (shares[j], -j))
            shares[donor] -= 1
            shares[i] += 1
    return shares


def make_plan(layer_kernels, speeds, policy="proportional"):
    """layer_kernels: kernels per conv layer, e.g. [500, 1500].
    speeds: {worker: [kernels/s for each layer]} in the order workers should hold the ranges
    (ignored by the `equal` policy except for its worker names)."""
    if policy not in POLICIES:
        raise PlanError(f"unknown split policy {policy!r}: expected one of {', '.join(POLICIES)}")
    workers = tuple(speeds)
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
        shares = largest_remainder(int(total), weights)
        ranges, start = {}, 0
        for w, sh in zip(workers, shares):
            ranges[w] = (start, start + sh)
            start += sh
        layer_speeds = {w: float(speeds[w][li]) for w in workers if speeds[w] is not None and len(speeds[w]) > li}
        layers.append(LayerPlan(li, int(total), ranges, layer_speeds))
    return Plan(policy, workers, tuple(layers))


def fixed_plan(layer_kernels, counts, policy="fixed"):
    """A plan from explicit kernel counts {worker: [count per layer]}: for tests and experiments."""
    workers = tuple(counts)
    layers = []
    for li, total in enumerate(layer_kernels):
        got = sum(counts[w][li] for w in workers)
        if got != total or any(counts[w][li] < 1 for w in workers):
            raise PlanError(f"layer {li}: counts {[counts[w][li] for w in workers]} must be >= 1 and sum to {total}")
        ranges, start = {}, 0
        for w in workers:
            ranges[w] = (start, start + counts[w][li])
            start += counts[w][li]
        layers.append(LayerPlan(li, total, ranges, {}))
    return Plan(policy, workers, tuple(layers))


def replan(plan, lines, measured, min_gain=0.05):
    """Re-split a proportional plan from what real steps took under it.

    lines: {worker: [(fixed_s, per_kernel_s) per layer]}, the calibrated seconds per step at
        the step's batch, or None for a worker without calibration (then all of its time counts
        as per-kernel).
    measured: {worker: [compute seconds per step, per layer]} under `plan`.

    Calibration can be fooled (a burst of outside load, a cache that behaves differently at the
    calibration batch); real steps cannot. Each worker's calibrated line is scaled by how far the
    real steps were from it, so a worker holding few kernels, whose time is mostly the fixed
    part, is not mistaken for a slow one. Returns the proportional plan of the scaled lines if
    it cuts the slowest worker's predicted compute by more than `min_gain`, else None."""
    fixed, per_kernel, now = {}, {}, {}
    for name in plan.workers:
        fixed[name], per_kernel[name] = [], []
        for lp in plan.layers:
            seconds = float(measured[name][lp.layer])
            k = lp.count(name)
            line = lines.get(name)
            if line is not None:
                f, p = line[lp.layer]
                scale = seconds / (f + p * k)
                f, p = f * scale, p * scale
            else:
                f, p = 0.0, seconds / k
            fixed[name].append(f)
            per_kernel[name].append(p)
        now[name] = sum(float(measured[name][lp.layer]) for lp in plan.layers)
    scaled = {name: list(zip(fixed[name], per_kernel[name])) for name in plan.workers}
    proposal = plan_from_lines([lp.kernels for lp in plan.layers], scaled, use_all=True)
    then = {name: sum(fixed[name][lp.layer] + lp.count(name) * per_kernel[name][lp.layer] for lp in proposal.layers)
            for name in proposal.workers}
    if max(then.values()) > (1 - min_gain) * max(now.values()):
        return None
    return proposal


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


def _integer_shares(total, exact):
    """Floats summing to total -> integers summing to total, each >= 1 (largest remainder)."""
    shares = [int(e) for e in exact]
    order = sorted(range(len(exact)), key=lambda i: (-(exact[i] - shares[i]), i))
    for i in order[:total - sum(shares)]:
        shares[i] += 1
    for i in range(len(shares)):
        while shares[i] < 1:
            donor = max(range(len(shares)), key=lambda j: (shares[j], -j))
            shares[donor] -= 1
            shares[i] += 1
    return shares


def predicted_compute_s(layer_kernels, lines, workers):
    """Seconds of conv compute a step takes with `workers` sharing every layer by affine_shares:
    layers run one after another (each needs the whole previous layer), the slowest device
    sets each layer's time."""
    total = 0.0
    for li, kernels in enumerate(layer_kernels):
        layer_lines = [lines[w][li] for w in workers]
        shares = _integer_shares(kernels, affine_shares(kernels, layer_lines))
        total += max(f + p * k for (f, p), k in zip(layer_lines, shares))
    return total


def plan_from_lines(layer_kernels, lines, use_all=False):
    """The proportional plan from calibrated cost lines {worker: [(fixed_s, per_kernel_s) per
    layer]} (seconds a step at the step's batch), choosing the devices: a device whose part in
    the plan makes the predicted step slower (its fixed work outweighs its share, or its share
    would round to nothing) is left out, greedily, most harmful first, and the plan says why.
    `use_all` keeps every device. Pure: the same input gives the same plan."""
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
    too_few = [k for k in layer_kernels if k < len(workers)]
    if too_few:
        raise PlanError(f"{len(workers)} workers but a conv layer has only {min(too_few)} kernels: "
                        f"every worker needs at least one kernel of every layer")
    layers = []
    for li, total in enumerate(layer_kernels):
        layer_lines = [lines[w][li] for w in workers]
        shares = _integer_shares(int(total), affine_shares(int(total), layer_lines))
        ranges, start = {}, 0
        for w, sh in zip(workers, shares):
            ranges[w] = (start, start + sh)
            start += sh
        speeds = {w: 1.0 / p for w, (f, p) in zip(workers, layer_lines)}    # kernels/s, past the fixed part
        layers.append(LayerPlan(li, int(total), ranges, speeds))
    return Plan("proportional", tuple(workers), tuple(layers), left_out)
