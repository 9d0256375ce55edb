"""The engine: the one contract between the training loop (and the network) and the conv shards.

`Engine` (below) is the contract as a Protocol: what the loop and the network may call, and
nothing else. `ElasticEngine` adds what an engine whose workers can come and go offers the
loop's membership handling (train.elastic). `ShardEngine` writes the contract once over one
abstract `_call` (a batch of requests to the shards): slicing by plan, concatenation of channel
slices, the sum of partial dX in plan order, gather, and the step through this process (every
network, a chain too, as its engine.graph.GraphPass: one walk of blocks and joins). A transport
implements only `_call`: in-process (engine.local.LocalEngine, an equal split of shards that
cannot be measured apart), over ZeroMQ (coordinator.remote.RemoteEngine, planned from its
workers' calibration by engine.calibrated.CalibratedEngine, and running the peer-exchange step
too), or not at all (the cost model's timing engine).
"""
from dataclasses import dataclass
import math
from typing import Protocol, runtime_checkable

import numpy as np

from hetconv.devices.wisdom import MAX_RECORD_CHOICES, checked_record
from hetconv.engine.conv_precision import checked_choices
from hetconv.engine.costmodel import profiles_from_calibration
from hetconv.engine.graph import GraphPass
from hetconv.engine.planner import PlanError, cost_lines, make_plan, replan, step_calls, whole_groups
from hetconv.engine.policy import run_micro_batches, wire_for
from hetconv.update import clip_factor
from hetconv.geometry import layer_state
from hetconv.transport.wire import decode, encode

# the most spans of a traced step a worker sends (worker.graph_step.StepTrace) and the metrics keep
MAX_TRACE_SPANS = 20000

def moved_bytes(stats):
    """Bytes both ways over every worker's link, from an Engine.step_stats()."""
    return sum(int(s.get("bytes_sent", 0)) + int(s.get("bytes_recv", 0)) for s in stats.values())


class WorkerError(RuntimeError):
    """A worker raised while serving a request; its message names the worker and what it was doing,
    and it carries the worker's traceback."""

    def __init__(self, worker, doing, name, message, remote_traceback="", workers=()):
        super().__init__(f"worker {worker} failed during {doing}: {name}: {message}")
        self.worker, self.remote_traceback = worker, remote_traceback
        self.workers = list(workers)        # the worker's name in plans, where known


class WorkerLost(RuntimeError):
    """A worker stopped answering (died, hung, disconnected, or its process exited). `workers`
    names the ones known lost (empty when it is not known which)."""

    def __init__(self, message, workers=()):
        super().__init__(message)
        self.workers = list(workers)


def concat_channels(parts):
    """Workers' channel slices (N, k_i, H, W) in plan order -> the layer's (N, K, H, W)."""
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)


def mode_choice_record(engine):
    """{"mode_choice": ...} for a "plan" metrics record: the modes an engine's plan_for chose, why,
    and the priced seconds of that chain and of all-model (None where a chain cannot run), or {}
    where no choice was made (one worker, --parallel model, a plan set by hand)."""
    choice = engine.mode_choice
    if choice is None:
        return {}
    finite = [s if math.isfinite(s) else None for s in (choice.chosen_s, choice.model_s)]
    return {"mode_choice": {"modes": list(choice.modes), "reason": choice.reason, "chosen_s": finite[0],
                            "model_s": finite[1]}}


def micro_choice_record(engine):
    """{"micro_choice": {micro_batches, predicted_s: {"count": seconds}}} for a "plan" metrics
    record where the cost model picked the plan's auto micro-batch count, else {}."""
    choice = getattr(engine, "micro_choice", None)
    if not choice:
        return {}
    return {"micro_choice": {"micro_batches": int(choice["micro_batches"]),
                             "predicted_s": {str(m): float(s) for m, s in sorted(choice["predicted_s"].items())}}}


def wire_record(engine):
    """{"wire": {dtype, reason, workers: {name: {computed, carried}}}} for a "plan" metrics record:
    what the plan's wire carries, why, and per worker what it computes in; {} where the engine
    made no choice (one built with a dtype and never planned)."""
    choice = getattr(engine, "wire_choice", None)
    return {"wire": choice} if choice else {}


def threads_record(engine, device_threads, head_threads):
    """The thread counts a run's sums split by, as its plan record keeps them (--plan FILE
    carries them, cli/coordinator takes "device"): "device", what a CPU device runs where the
    command names no count (`cpu` in --spawn, --local; `device_threads`, the command's --threads,
    where the engine fixed none); "head", the coordinator's (`head_threads`); "workers", each
    worker's as it said at HELLO (0: a GPU, or a CPU worker's every core, not fixed)."""
    device, workers = engine.thread_counts()
    return {"device": int(device or device_threads), "head": int(head_threads), "workers": workers}


@dataclass(frozen=True)
class PlanReport:
    """What a run says of the plan an engine made and loaded: its table and lines for the log,
    the fields of its "plan" metrics record, and the calibration behind it."""
    table: str                  # the plan's table (planner.Plan.table)
    lines: tuple                # its modes and its wire, where there is something to say
    record: dict                # the "plan" record: the plan, its mode and micro-batch choices, wire, threads
    calibration: dict           # {worker: its calibration record}, every worker measured ({}: none)
    micro_batches: int          # a step's micro-batch count under the plan (Engine.run_micro_batches)


def plan_report(engine, plan, precision, device_threads, head_threads, requested_micro, batch):
    """The PlanReport of `plan`, just made by `engine` (`precision`: --precision; `requested_micro`:
    --micro-batches, 0 for auto; `batch`: a step's images)."""
    choice, wire = mode_choice_record(engine), wire_record(engine)
    lines = []
    if choice:
        lines.append(f"modes: {', '.join(choice['mode_choice']['modes'])} ({choice['mode_choice']['reason']})")
    if wire and (wire["wire"]["dtype"] != "float32" or precision != "fp32"):
        lines.append(f"feature maps and gradients between layers: {wire['wire']['dtype']} ({wire['wire']['reason']})")
    record = {**plan.to_json(), **choice, **micro_choice_record(engine), **wire,
              "threads": threads_record(engine, device_threads, head_threads)}
    return PlanReport(plan.table(), tuple(lines), record, dict(engine.calibration or {}),
                      engine.run_micro_batches(requested_micro, batch))


def sum_in_order(parts):
    """Partial dX in plan order -> their sum, added left to right: the same float result whatever
    order the parts arrived in, and the same as every other engine's sum. One float32 part is
    its own sum, returned as it came (read-only where it came so)."""
    if len(parts) == 1 and isinstance(parts[0], np.ndarray) and parts[0].dtype == np.float32:
        return parts[0]
    total = np.array(parts[0], dtype=np.float32, copy=True)
    for part in parts[1:]:
        np.add(total, part, out=total)
    return total


@runtime_checkable
class Engine(Protocol):
    """What the training loop and the network call on an engine, and nothing else."""

    workers: list               # names of the shards, in plan order
    plan: object                # the loaded Plan (None before load)
    fixed_plan: object          # a plan the loop (--plan, a resume) or a test sets: plan_for returns it, never re-split
    graph: object               # engine.graph.GraphPass joining a non-chain network's blocks, else None (configure)
    optimizer: str              # whose slots every layer's state holds: "sgd", "adamw" or "adam" (configure)
    bn_ghost_batch: int         # images per BatchNorm statistics group, 0: the whole batch (configure)
    trace_step: int             # the training step whose timeline the workers record, 0: none (configure)
    in_process: bool            # every shard runs in this process (--local), on the threads the head runs on
    exchange: str               # "star" (every layer through this process) or "peer" (workers trade slices)
    wire: str                   # dtype of feature maps and gradients between devices, fixed per plan
    wire_choice: object         # {dtype, reason, workers: {name: {computed, carried}}} of the plan, or None
    calibration: dict           # worker -> {device, description, speeds, layers: timings, conv_paths}
    mode_choice: object         # planner.ModeChoice behind the plan's modes, or None where none was made
    micro_choice: object        # {micro_batches, predicted_s} the cost model picked for the plan, or None

    def configure(self, graph=None, optimizer="sgd", bn_ghost_batch=0, trace_step=0):
        """The network's joins between blocks (`graph`), the optimizer and the BatchNorm groups the
        shards' states and steps follow, and the training step (numbered as the metrics number
        it) whose spans each worker records, where its step can (the peer exchange): set once,
        before plan_for and load."""

    def plan_for(self, specs, input_shapes, settings):
        """-> Plan; calibrates where there is something to measure. `settings`: what planning
        reads of the run's configuration (engine.policy.PlanSettings)."""

    def load(self, plan, specs, params):
        """Slices every layer's whole state ({name: array}) onto the shards."""

    def run_micro_batches(self, requested, batch):
        """-> the micro-batches a step of `batch` images is cut into under the loaded plan:
        `requested` (--micro-batches) where set, else the rule's count or the plan's cheaper one
        (policy.run_micro_batches)."""

    def prepare_calls(self, input_shapes, batch, micro_batches):
        """Each worker runs the conv call shapes of the loaded plan's training step (`batch`
        images in `micro_batches`) whose first call would time its device's paths, before the
        step would meet them -> {worker: {calls, ran, seconds}}."""

    def conv_step(self, xs, head, update, step=(0, 0), head_sum_of_squares=None):
        """One training step's conv work over micro-batches xs: forward, head(m, features) ->
        dfeatures, backward, gradients summed over micro-batches, one update (an UpdateRule,
        scaled by global-norm clipping where it has a max_norm). Returns the clipping factor. A
        head with a `settle` (net.head.Network's) also takes head(m, features, weights_later=True):
        its FC weights' gradients then wait for head.settle(), which an engine calls once
        dfeatures is on its way (`features` left as they are until then)."""

    def predict(self, x):
        """-> features of the last conv layer; no state kept."""

    def gather(self):
        """-> every layer's whole state {name: array} (snapshots, checkpoints, rebalancing)."""

    def conv_path_records(self):
        """-> [{worker, machine, choices}]: each device's measured conv path choices (checkpoints,
        metrics; `--resume` hands them back)."""

    def conv_path_choices(self):
        """-> {worker: [{call, key, path, why, seconds, calls}]}: each device's conv path choices
        per call shape, asked now (--precision auto's per-layer report)."""

    def step_stats(self):
        """Per worker, since the last call: compute, wire, bytes."""

    def thread_counts(self):
        """-> (device, {worker: threads}): the threads of a CPU device where the command names no
        count (a spawned `cpu` worker's, --local's; 0 where none is fixed here), and each worker's
        (0: a GPU, or a CPU worker on every core it may use). A plan record keeps them."""

    def reset_layer_timings(self):
        """Start measuring per-layer compute afresh (rebalancing skips the warm-up steps)."""

    def propose_rebalance(self, specs):
        """-> a better Plan from measured step times, or None (the loop moves the kernels:
        gather, then load)."""

    def close(self):
        """Release workers and sockets."""


@runtime_checkable
class ElasticEngine(Engine, Protocol):
    """An engine whose workers can be lost or join during a run."""

    def drop(self, names):
        """Forget workers that were lost."""

    def replan(self, specs, input_shapes, settings):
        """-> a Plan over the workers left (calibrating any that were never measured)."""

    def admit(self, specs, input_shapes, settings):
        """-> a Plan that includes the workers waiting to join, or None when none waits."""

    def keep_joiners_waiting(self, seconds):
        """Tell waiting workers how long until the run can admit them."""


class ShardEngine:
    """The contract, written once over an abstract `_call`."""

    wire = "float32"            # dtype of feature maps and gradients between coordinator and shards
    wire_asked = None           # the wire the engine was made with (a dtype, or auto), once a plan decided it
    wire_choice = None          # {dtype, reason, workers: {name: {computed, carried}}}: what decide_wire chose
    exchange = "star"           # every layer's slices meet here; RemoteEngine may run the peer step
    optimizer = "sgd"           # whose slots every layer's state holds (configure sets the run's)
    bn_ghost_batch = 0          # images per BatchNorm statistics group (0: the whole batch; configure sets the run's)
    graph = None                # engine.graph.GraphPass where the network is not a chain: what joins its blocks
    trace_step = 0              # the training step whose timeline the workers record (configure sets the run's)
    in_process = True           # every shard in this process; RemoteEngine's are in worker processes

    def __init__(self):
        self.plan = None
        self.specs = []             # the loaded network's ConvSpecs, set by load()
        self._input_hw = {}         # layer -> (H, W) of its last forward input: what its dX must have
        self.fixed_plan = None      # a plan set by hand (tests, experiments): no calibration, no rebalancing
        self.calibration = {}       # worker -> {device, description, speeds, layers: timings}
        self.mode_choice = None     # planner.ModeChoice behind the plan's modes, where one was made
        self.micro_choice = None    # {micro_batches, predicted_s}: auto micro-batches as the cost model picked them
        self._conv_path_records = {}    # worker -> its device's conv path record, as of the last gather
        self._chain_pass = (None, None)     # (its key, the GraphPass a chain's step runs: step_graph)
        self.batch = 0
        self.reset_layer_timings()
        self._stats = {}

    # ---- what a transport provides -------------------------------------------------------------
    @property
    def workers(self):
        raise NotImplementedError

    def _call(self, requests, doing, layer=None):
        """requests: {worker: (op, arrays, fields)} -> {worker: (arrays, fields)}, every reply in."""
        raise NotImplementedError

    def configure(self, graph=None, optimizer="sgd", bn_ghost_batch=0, trace_step=0):
        self.graph, self.optimizer, self.bn_ghost_batch = graph, optimizer, bn_ghost_batch
        self.trace_step = trace_step

    def plan_for(self, specs, input_shapes, settings):
        """Shards that cannot be measured apart (one process): an equal split, unless set by hand."""
        self.decide_wire(settings)
        if self.fixed_plan is not None:
            return self.fixed_plan
        return make_plan([s.kernels for s in specs], {name: None for name in self.workers}, "equal")

    def decide_wire(self, settings, computed=None, names=None):
        """The wire of the plan being made (policy.wire_for), before anything prices or
        loads it: the engine's own where it was made with a dtype; for auto, --wire-dtype and
        --precision with what each worker computes in (`computed`: {name: (device, precision)}
        from calibration, or None). Kept in `wire_choice` for the log and the plan record, with
        each worker's side of it (`names`: the workers, default every one): what it computes in
        (without a calibration, the --precision asked) and what the wire carries to it."""
        self.wire, reason = wire_for(self.asked_wire(settings), settings.precision, computed)
        names = list(self.workers if names is None else names)
        self.wire_choice = {"dtype": self.wire, "reason": reason, "workers": {
            name: {"computed": computed[name][1] if computed else settings.precision, "carried": self.wire}
            for name in names}}
        return self.wire

    def asked_wire(self, settings):
        """The wire asked for: the engine's own where it was made with a dtype, else --wire-dtype
        (a dtype, or auto: wire_for decides it from what the workers compute in)."""
        if self.wire_asked is None:
            self.wire_asked = self.wire
        return self.wire_asked if self.wire_asked != "auto" else settings.wire_dtype

    def close(self):
        pass

    # ---- written once ------------------------------------------------------------------------------
    def load(self, plan, specs, params):
        """params: per layer its whole state, {name: full array} as ConvSpec.state_layout names it
        (optimizer slots may be missing: they start at zero), or the old (w, b, vw, vb); each
        worker gets its kernels' rows of every per-kernel array (a data layer's range is every
        kernel, so each of its workers gets the whole layer) and every scalar whole. A graph's
        BatchNorm nodes between blocks (NetSpec.norm_nodes) have their states after the blocks', in
        order: the graph keeps them."""
        if self.exchange != "peer" and len(plan.workers) > 1 and "data" in plan.modes():
            raise PlanError(f"--exchange {self.exchange} sends every layer through the coordinator and splits only "
                            f"kernels: data-parallel layers ({plan.modes()}) need --exchange peer")
        plan = whole_groups(plan, specs)       # a grouped conv's shards hold whole groups
        self.plan, self.specs = plan, list(specs)
        if self.graph is not None:             # the BatchNorm nodes' states follow the blocks'
            self.graph.load_norms(params[len(specs):], self.optimizer)
        for lp, spec, state in zip(plan.layers, specs, params):
            state = layer_state(spec, state)
            layout = [a for a in spec.state_layout(self.optimizer) if a.name in state]
            requests = {}
            for name, (s, e) in lp.ranges.items():
                arrays = [state[a.name][s:e] if a.per_kernel else state[a.name] for a in layout]
                requests[name] = ("LOAD", arrays, {"layer": lp.layer, "spec": spec.to_json(), "start": s, "stop": e,
                                                    "wire": self._shard_wire(), "optimizer": self.optimizer,
                                                    "names": [a.name for a in layout],
                                                    "bn_ghost_batch": self.bn_ghost_batch})
            self._call(requests, f"loading conv{lp.layer + 1}")
        self.step_stats()

    def run_micro_batches(self, requested, batch):
        return run_micro_batches(requested, batch, self.exchange, len(self.workers), self.micro_choice)

    def prepare_calls(self, input_shapes, batch, micro_batches):
        calls = step_calls(self.plan, self.specs, input_shapes, batch, micro_batches)
        requests = {name: ("PREPARE", [], {"calls": [{"layer": layer, "spec": spec.to_json(), "input_shape": list(shape),
                                                      "kernels": kernels} for layer, spec, shape, kernels in mine]})
                    for name, mine in calls.items() if mine}
        replies = self._call(requests, "running the plan's new conv call shapes")
        return {name: fields for name, (_, fields) in replies.items()}

    def _shard_wire(self):
        """The wire dtype the shards' LOADs name: what their requests and replies carry."""
        return self.wire

    def _wire_out(self, x):
        """A feature map or gradient -> what a request carries for it (the wire's encoding)."""
        return encode(np.ascontiguousarray(x), self.wire)

    def _wire_in(self, a):
        """What a reply carried -> float32."""
        return decode(a, self.wire)

    def forward_layer(self, layer, xs, train, step=None):
        """A layer's input per micro-batch (N, C, H, W) to every shard -> the layer's output per
        micro-batch (N, K, H', W'). All micro-batches in one request: a shard's BatchNorms
        normalise with the whole batch's statistics. `step`: (training step, seed), what channel
        dropout draws its masks from."""
        sent = [self._wire_out(x) for x in xs]   # one buffer for every shard, never written
        rows = [int(r) for r in np.cumsum([0] + [len(x) for x in xs])[:-1]]
        train_step, seed = step if step is not None else (0, 0)
        fields = {"layer": layer, "micros": list(range(len(xs))), "rows": rows, "batch": int(sum(len(x) for x in xs)),
                  "train": bool(train), "train_step": int(train_step), "seed": int(seed)}
        doing = f"forward conv{layer + 1}"
        replies = self._call({name: ("FORWARD", sent, fields) for name in self.plan.workers}, doing, layer)
        lp = self.plan.layers[layer]
        self._input_hw[layer] = tuple(xs[0].shape[2:])
        out_hw = self.pooled_output_hw(layer, xs[0].shape[2:])
        return [concat_channels([self._wire_in(self._reply_array(replies, name, m, (len(x), lp.count(name)) + out_hw,
                                                                  doing)) for name in self.plan.workers])
                for m, x in enumerate(xs)]

    def forward(self, layer, x, micro=0, keep=True):
        """One layer's input, a whole batch, to every shard -> the layer's output."""
        return self.forward_layer(layer, [x], keep)[0]

    def pooled_output_hw(self, layer, input_hw):
        """(H', W') of conv layer `layer`'s output for an input of `input_hw`, from its spec."""
        spec = self.specs[layer]
        return spec.output_hw(*input_hw)

    def _reply_array(self, replies, name, index, shape, doing):
        """Array `index` of worker `name`'s reply, checked against the shape the plan expects: a
        worker that sends something else fails the request, named, instead of corrupting a
        concatenation, a sum or a snapshot."""
        arrays = replies[name][0]
        got = tuple(arrays[index].shape) if index < len(arrays) else None
        if got != tuple(shape):
            raise WorkerError(name, doing, "ShapeError", f"reply array {index} has shape {got}, the plan expects "
                                                          f"{tuple(shape)}")
        return arrays[index]

    def backward_layer(self, layer, grads, need_dx):
        """Each shard gets its slice of dL/d(output) of every micro-batch; returns dL/d(layer input)
        per micro-batch, the sum of the shards' partial dX in plan order (None when not needed)."""
        lp = self.plan.layers[layer]
        fields = {"layer": layer, "micros": list(range(len(grads))), "need_dx": need_dx}
        requests = {name: ("BACKWARD", [self._wire_out(g[:, s:e]) for g in grads], fields)
                    for name, (s, e) in lp.ranges.items()}
        doing = f"backward conv{layer + 1}"
        replies = self._call(requests, doing, layer)
        if not need_dx:
            return [None] * len(grads)
        return [sum_in_order([self._wire_in(self._reply_array(replies, name, m, (len(g), self.specs[layer].in_channels)
                                                               + self._input_hw[layer], doing))
                              for name in self.plan.workers])
                for m, g in enumerate(grads)]

    def backward(self, layer, dout, need_dx, micro=0):
        """One layer's gradient, a whole batch -> dL/d(layer input) (None when not needed)."""
        return self.backward_layer(layer, [dout], need_dx)[0]

    def update_layers(self, rule):
        """The step's one update of every layer, where its kernels are."""
        for lp in self.plan.layers:
            self._call({name: ("UPDATE", [], {"layer": lp.layer, "update": rule.to_json()}) for name in lp.ranges},
                       f"updating conv{lp.layer + 1}", lp.layer)

    def sum_of_squares(self):
        """The squared norm of every conv gradient of the step, over every shard (float64)."""
        replies = self._call({name: ("NORM", [], {}) for name in self.plan.workers}, "summing gradient norms")
        return sum(float(replies[name][1]["sum_of_squares"]) for name in self.plan.workers)

    def conv_step(self, xs, head, update, step=(0, 0), head_sum_of_squares=None):
        """One step's conv work through this process, layer by layer over every micro-batch:
        forward, `head(m, features) -> dfeatures` (the FC layers and the loss) per micro-batch,
        backward; then the one update of the step (`update`, an UpdateRule). Where it clips
        (max_norm), `head_sum_of_squares()` is the head's part of the global norm. Returns the
        factor every gradient was scaled by (1.0 without clipping)."""
        self.batch = sum(len(x) for x in xs)
        graph = self.step_graph(tuple(xs[0].shape[2:]))
        graph.train(self, xs, head, step)
        factor = 1.0
        if update is not None and update.max_norm > 0:
            factor = clip_factor(self.sum_of_squares() + graph.norm_sum_of_squares() + head_sum_of_squares(),
                                 update.max_norm)
            update = update.scaled(factor)
        if update is not None:
            self.update_layers(update)
            graph.update_norms(update)
        self.close_measured_step()
        return factor

    def predict(self, x):
        return self.step_graph(tuple(x.shape[2:])).predict(self, x)

    def step_graph(self, image_hw):
        """The GraphPass a step runs, whatever the exchange: the network's graph, or a chain's
        (GraphPass.chain: each block reads the one before; its features the last layer's pooled
        output for images of `image_hw`), made once per shape."""
        if self.graph is not None:
            return self.graph
        hw = image_hw
        for layer in range(len(self.specs)):
            hw = self.pooled_output_hw(layer, hw)
        key = (len(self.specs), self.specs[-1].kernels) + tuple(hw)
        if self._chain_pass[0] != key:
            self._chain_pass = (key, GraphPass.chain(len(self.specs), (self.specs[-1].kernels,) + tuple(hw)))
        return self._chain_pass[1]

    def gather(self):
        """Per layer its whole state {name: array}: a model layer's slices concatenated in plan
        order (scalars from the plan's first worker); a data layer's one copy (every worker holds
        the same state), from the plan's first worker. Then a graph's BatchNorm nodes' states."""
        out, asked = [], set()
        for lp in self.plan.layers:
            holders = self.plan.workers[:1] if lp.mode == "data" else self.plan.workers
            # each worker's first FETCH of the gather also asks for its conv path record
            replies = self._call({name: ("FETCH", [], {"layer": lp.layer, **({} if name in asked else
                                                                            {"conv_paths": True})})
                                  for name in holders}, f"gathering conv{lp.layer + 1}'s weights")
            for name in holders:
                if name not in asked:
                    asked.add(name)
                    self._keep_conv_path_record(name, replies[name][1])
            spec, doing = self.specs[lp.layer], f"fetching conv{lp.layer + 1}"
            layout = {a.name: a for a in spec.state_layout(self.optimizer)}
            parts = []
            for name in holders:
                arrays, fields = replies[name]
                names = fields.get("names")
                if not isinstance(names, list) or sorted(names) != sorted(layout):
                    raise WorkerError(name, doing, "ShapeError", f"its state names {str(names)[:200]}, the plan "
                                                                  f"expects {sorted(layout)}")
                k = lp.count(name) if lp.mode == "model" else lp.kernels
                part = {}
                for i, n in enumerate(names):
                    a = layout[n]
                    shape = ((k,) + a.shape[1:]) if a.per_kernel else ()
                    part[n] = self._reply_array(replies, name, i, shape, doing)
                parts.append(part)
            out.append({n: (np.concatenate([p[n] for p in parts], axis=0) if layout[n].per_kernel else
                            np.array(parts[0][n], copy=True)) for n in layout})
        rest = [name for name in self.plan.workers if name not in asked]     # every layer data-parallel
        if rest:
            replies = self._call({name: ("FETCH", [], {"layer": -1, "conv_paths": True}) for name in rest},
                                 "gathering the conv path records")
            for name in rest:
                self._keep_conv_path_record(name, replies[name][1])
        if self.graph is not None:             # the BatchNorm nodes' states after the blocks', as load takes them
            out += self.graph.norm_states()
        return out

    def _keep_conv_path_record(self, name, fields):
        """A SHARD reply's conv path record (devices.wisdom.checked_record: checked, bounded), kept
        as the worker's newest; a malformed one is dropped, and the one before stands."""
        record = fields.get("conv_paths")
        if record is None:
            return
        record, _ = checked_record(record)
        if record is not None:
            record.pop("worker", None)                  # the plan's name for it, not its own
            self._conv_path_records[name] = record

    def conv_path_records(self):
        """[{worker, machine, choices: [{call, path, why}]}] per worker of the plan, in plan order:
        the conv path choices each device made from a measurement, as of the last gather. What a
        checkpoint and the metrics keep, and `--resume` hands back to the devices."""
        workers = self.plan.workers if self.plan is not None else self.workers
        return [{"worker": name, **self._conv_path_records[name]} for name in workers
                if name in self._conv_path_records]

    def conv_path_choices(self):
        """{worker: [{call, key, path, why, seconds, calls}]} per worker of the plan: each device's
        conv path choices per call shape, the rule's too, with how many calls ran each
        (conv_precision.checked_choices: checked, bounded), asked now: one small FETCH a worker,
        which also refreshes its conv path record. A device with one path per call shape (GPU)
        has none. A worker that answers without them (an older one) gives none."""
        workers = self.plan.workers if self.plan is not None else self.workers
        replies = self._call({name: ("FETCH", [], {"layer": -1, "conv_paths": True, "conv_path_choices": True})
                              for name in workers}, "asking the conv paths run")
        out = {}
        for name in workers:
            fields = replies[name][1]
            self._keep_conv_path_record(name, fields)
            out[name] = checked_choices(fields.get("conv_path_choices"), MAX_RECORD_CHOICES)
        return out

    # ---- measurements ------------------------------------------------------------------------------
    def _record(self, name, layer, fields, roundtrip_s=0.0, sent=0, received=0):
        """Book one reply: per-step stats, and per-layer compute for rebalancing."""
        stats = self._stats.setdefault(name, {"compute_s": 0.0, "roundtrip_s": 0.0, "bytes_sent": 0, "bytes_recv": 0})
        compute = float(fields.get("compute_s", 0.0))
        stats["compute_s"] += compute
        stats["roundtrip_s"] += roundtrip_s
        stats["bytes_sent"] += sent
        stats["bytes_recv"] += received
        for key in ("peer_bytes_sent", "peer_bytes_recv", "peer_wait_s"):
            if key in fields:
                stats[key] = stats.get(key, 0) + fields[key]
        spans = fields["trace"].get("spans") if isinstance(fields.get("trace"), dict) else None
        if isinstance(spans, list):         # a traced step's spans, for the metrics: hetconv-report checks each
            stats["trace"] = {"spans": spans[:MAX_TRACE_SPANS]}
        per_layer = self.layer_compute.setdefault(name, {})
        if "layer_compute_s" in fields:                  # a whole step's worth, from the peer step
            booked = [(li, float(seconds)) for li, seconds in enumerate(fields["layer_compute_s"])]
        elif layer is not None:
            booked = [(layer, compute)]
        else:
            booked = []
        # per layer in the step's stats too: the metrics show which layer's compute departs from
        # its calibrated price, not just the step's sum
        step_layers = stats.setdefault("layer_compute_s", [])
        for li, seconds in booked:
            per_layer[li] = per_layer.get(li, 0.0) + seconds
            step_layers.extend([0.0] * (li + 1 - len(step_layers)))
            step_layers[li] += seconds

    def thread_counts(self):
        """Shards reached through `_call` alone: no thread count known here."""
        return 0, {}

    def step_stats(self):
        """Per worker, since the last call: compute seconds, round-trip seconds, bytes each way."""
        stats = {name: dict(self._stats.get(name, {"compute_s": 0.0, "roundtrip_s": 0.0, "bytes_sent": 0,
                                                   "bytes_recv": 0})) for name in self.workers}
        self._stats = {}
        return stats

    def reset_layer_timings(self):
        self.layer_compute = {}          # worker -> {layer: compute seconds since the reset}
        self.measured_steps = 0          # training steps since the reset
        self.step_compute = {}           # worker -> [its compute seconds in each of those steps]
        self._booked_before = {}

    def close_measured_step(self):
        """One training step more since the reset: each worker's compute in it, from what its
        replies booked, kept as a sample of how much a step's time varies (propose_rebalance)."""
        self.measured_steps += 1
        booked = getattr(self, "_booked_before", {})
        for name, per_layer in self.layer_compute.items():
            total = sum(per_layer.values())
            self.step_compute.setdefault(name, []).append(total - booked.get(name, 0.0))
            booked[name] = total
        self._booked_before = booked

    def rebalance_gate(self, min_gain):
        """The gain a re-split must promise: `min_gain`, or twice the relative standard error of the
        noisiest worker's mean step compute where there are 3 or more steps to see it by (a gain
        inside the noise moves kernels for nothing, and the next re-split moves them back); twice
        that again for a re-split that would move some worker's share back the way the last one
        came."""
        noise = 0.0
        for samples in getattr(self, "step_compute", {}).values():
            if len(samples) >= 3 and sum(samples) > 0:
                mean = sum(samples) / len(samples)
                var = sum((x - mean) ** 2 for x in samples) / (len(samples) - 1)
                noise = max(noise, math.sqrt(var / len(samples)) / mean)
        return max(min_gain, 2.0 * noise)

    def propose_rebalance(self, specs, min_gain=0.05):
        """A re-split of the kernels from what training measured since reset_layer_timings() (see
        planner.replan), when it gains; else None. Nothing moves: the caller gathers and loads."""
        if self.plan is None or len(self.plan.workers) < 2:
            return None
        profiles = profiles_from_calibration(self.calibration) if self.calibration else {}
        kernels = [lp.kernels for lp in self.plan.layers]
        known = {name: profiles[name] for name in self.plan.workers if name in profiles}
        # a data layer splits images: its workers' per-image lines (the kernel lines elsewhere)
        lines, image_lines = cost_lines(known, kernels, self.batch)
        measured = {}
        steps = self.measured_steps
        for name in self.plan.workers:
            compute = self.layer_compute.get(name, {})
            if steps == 0 or any(compute.get(lp.layer, 0.0) <= 0 for lp in self.plan.layers):
                return None
            measured[name] = [compute[lp.layer] / steps for lp in self.plan.layers]
            lines.setdefault(name, None)
        gate = self.rebalance_gate(min_gain)
        image_lines = image_lines if "data" in self.plan.modes() else None
        proposal = replan(self.plan, lines, measured, gate, image_lines=image_lines)
        last = getattr(self, "_last_moves", {})
        if proposal is not None and _reverses(share_moves(self.plan, proposal), last):
            proposal = replan(self.plan, lines, measured, 2.0 * gate, image_lines=image_lines)
        if proposal is not None:
            self._last_moves = share_moves(self.plan, proposal)
        return proposal


def share_moves(plan, proposal):
    """{(worker, layer): +1 or -1}: which way each worker's share (kernels, or images of a data
    layer) of each layer moves from `plan` to `proposal`."""
    moves = {}
    for old, new in zip(plan.layers, proposal.layers):
        for name in proposal.workers:
            before = old.images.get(name, 0) if old.mode == "data" else old.count(name) if name in old.ranges else 0
            after = new.images.get(name, 0) if new.mode == "data" else new.count(name)
            if after != before:
                moves[(name, new.layer)] = 1 if after > before else -1
    return moves


def _reverses(moves, last):
    """Whether some share would move back the way the last re-split moved it."""
    return any(last.get(key) == -sign for key, sign in moves.items())
