"""What the cost model needs, measured on this host: a device's calibration in this process, the
loopback link's bandwidth, the coordinator's own share of a step (the FC layers and the loss), and
saved profiles of other hosts. Clocks and sockets live here; the model itself (engine.costmodel)
has neither."""
import contextlib
import json
import time

import numba
import numpy as np
from threadpoolctl import threadpool_limits
import zmq

from hetconv.devices.cpu import HostArrays
from hetconv.devices import open_device
from hetconv.devices.cpu_options import CpuOptions
from hetconv.engine.contract import ShardEngine
from hetconv.engine.conv_precision import computed_precision
from hetconv.engine.costmodel import DeviceProfile, LayerCost, layer_geometry
from hetconv.engine.planner import make_plan
from hetconv.engine.graph import graph_pass
from hetconv.engine.shard import ConvShard
from hetconv.geometry import NUM_CLASSES, layer_input_shapes
from hetconv.net.head import Network, paper_head
from hetconv.update import UpdateRule


def _timing_engine(specs, image_shape, batch, n, rng):
    """Stands in for `n` workers so the coordinator's own share of a step can be timed: the
    engine's real concatenation and dX sum around ready-made replies (no shard computes)."""

    geometry = layer_geometry(specs, image_shape, batch)
    names = [f"w{i}" for i in range(n)]

    class TimingEngine(ShardEngine):
        workers = names

        def __init__(self):
            super().__init__()
            self.plan = make_plan([s.kernels for s in specs], {w: None for w in names}, "equal")
            self.specs = list(specs)                 # what load() would have recorded
            self.outputs = [{w: rng.random((b, lp.count(w), hp, wp), dtype=np.float32) for w in names}
                            for lp, (_, (b, hp, wp)) in zip(self.plan.layers, geometry)]
            self.partials = [np.ones(shape, np.float32) for shape, _ in geometry]

        def _call(self, requests, doing, layer=None):
            replies = {}
            for name, (op, arrays, fields) in requests.items():
                if op == "FORWARD":
                    replies[name] = ([self.outputs[layer][name]] * len(arrays), {})
                elif op == "BACKWARD":
                    replies[name] = ([self.partials[layer]] * len(arrays) if fields["need_dx"] else [], {})
                else:                                # UPDATE, NORM: nothing of the coordinator's own
                    replies[name] = ([], {"sum_of_squares": 0.0})
            return replies

    return TimingEngine()


class HeadOnlyEngine:
    """Stands in for the peer step's workers: the features arrive ready-made, and the coordinator
    runs the head on them as that step does (the joins run on the workers). `weights_later`: the
    FC weights' gradients after the features' gradient has gone (head.settle), as the step runs
    them where no CPU worker shares the coordinator's host. Seconds booked over all steps: the
    head until its gradient (`head_s`) and the settle after it (`settle_s`)."""

    def __init__(self, feature_shape, weights_later=False):
        self.feature_shape, self.weights_later = tuple(feature_shape), weights_later
        self.head_s = self.settle_s = 0.0

    def conv_step(self, xs, head, update, step=(0, 0), head_sum_of_squares=None):
        for m, x in enumerate(xs):
            features = np.zeros((len(x),) + self.feature_shape, np.float32)
            t0 = time.perf_counter()
            if self.weights_later:
                head(m, features, weights_later=True)
            else:
                head(m, features)
            t1 = time.perf_counter()
            if self.weights_later:
                head.settle()
            self.head_s += t1 - t0
            self.settle_s += time.perf_counter() - t1
        return 1.0


def measure_coordinator_s(specs, head, image_shape, batch, n_workers, repeats=3, network=None, exchange="star",
                          workers_elsewhere=False):
    """Seconds of coordinator work per step on this host: the FC layers and the loss, and in the
    star exchange (and --local, n_workers 1) also the concatenation of the workers' blocks, the dX
    sums and a graph's joins between its blocks, which the peer exchange's workers do instead. In
    the peer exchange with `workers_elsewhere` (no CPU worker on the coordinator's host), less the
    FC weights' gradients, which the coordinator then computes while the workers' backward runs.
    `head`: the network's layers after flatten (JSON form), or the paper family's hidden FC
    widths; `network`: the NetSpec, where it may be a graph."""
    rng = np.random.default_rng(0)
    if all(isinstance(layer, int) for layer in head):
        head = paper_head(head, NUM_CLASSES)
    _, feature_shape = layer_input_shapes(specs, 1, image_shape)
    if network is not None:
        feature_shape = network.feature_shape()
    if exchange == "peer" and n_workers > 1:
        engine = HeadOnlyEngine(feature_shape, weights_later=workers_elsewhere)
    else:
        engine = _timing_engine(specs, image_shape, batch, n_workers, rng)
        if network is not None:
            engine.configure(graph_pass(network, HostArrays()))
    net = Network(specs, head, engine, rng, feature_shape, host=HostArrays())
    x = np.zeros((batch,) + tuple(image_shape), np.float32)
    labels = rng.integers(0, 10, batch)
    best = float("inf")
    for rep in range(repeats + 1):
        settled = getattr(engine, "settle_s", 0.0)
        t0 = time.perf_counter()
        net.train_step(x, labels, UpdateRule(lr=1e-6, momentum=0.0))
        if rep:
            best = min(best, time.perf_counter() - t0 - (getattr(engine, "settle_s", 0.0) - settled))
    return best


def measure_join_s(network, batch, repeats=2):
    """{node: (forward s, backward s)} of each of a graph's steps between its blocks (a sum, a
    concatenation, an activation or pool outside a block, a BatchNorm node) on the whole batch, on
    this host's one thread: what the peer step's workers run themselves, each on its part of the
    tensor (the cost model charges a worker that fraction of it). {} for a chain."""
    if network is None or network.is_chain():
        return {}
    rng = np.random.default_rng(0)
    graph = graph_pass(network, HostArrays())
    shapes = {-1: tuple(network.input_shape)}
    shapes.update({node: tuple(shape) for node, shape in enumerate(network.output_shapes())})
    out = {}
    with _threads_kept(), threadpool_limits(limits=1, user_api="blas"):
        numba.set_num_threads(1)
        for st in graph.steps:
            if st.kind == "block":
                continue
            xs = [rng.standard_normal((batch,) + shapes[j], dtype=np.float32) for j in st.inputs]
            best = [float("inf"), float("inf")]
            for rep in range(repeats + 1):
                t0 = time.perf_counter()
                if st.output in graph.norms:
                    ys, saved = graph._norm_forward(st.output, xs[:1], True, None)
                    t1 = time.perf_counter()
                    graph._norm_backward(st.output, saved, [np.ones_like(ys[0])])
                else:
                    y, ctx = graph._node_forward(st.layer, xs)
                    t1 = time.perf_counter()
                    graph._node_backward(st.layer, ctx, np.ones_like(y))
                t2 = time.perf_counter()
                if rep:
                    best = [min(best[0], t1 - t0), min(best[1], t2 - t1)]
            out[st.output] = tuple(best)
    return out


def measure_loopback(megabytes=64, repeats=3):
    """Bytes/s of one large ZeroMQ message over TCP on 127.0.0.1, one way, as hetconv sends them."""

    ctx = zmq.Context()
    try:
        rx, tx = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        rx.linger = tx.linger = 0
        port = rx.bind_to_random_port("tcp://127.0.0.1")
        tx.connect(f"tcp://127.0.0.1:{port}")
        payload = np.ones(megabytes << 18, np.float32)            # megabytes MiB
        best = float("inf")
        # Sent and received on this thread (libzmq's own I/O threads move the bytes): a receive
        # on a thread of its own would still block in the socket when a lost message made this
        # one give up and destroy the context under it.
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            tx.send(payload, copy=False)
            if not rx.poll(30_000):
                raise RuntimeError("loopback measurement: no message arrived within 30s")
            rx.recv(copy=False)
            best = min(best, time.perf_counter() - t0)
        return payload.nbytes / best
    finally:
        ctx.destroy(linger=0)


def calibrate_local(device_spec, specs, input_shapes, kernels, threads=None, repeats=3, also=None, cpu=CpuOptions()):
    """A DeviceProfile for a device in this process (what a worker on it would report). With
    `also` (other kernel counts), two profiles from calibrations that alternate round by round,
    each value the median over rounds: a host whose speed drifts (other tenants) then skews both
    alike, and their ratio (a speedup) stays put. A CPU device's conv paths and precision (`cpu`,
    devices.cpu_options.CpuOptions, see calibrate_rounds) are named in the profile's
    description, since its times are theirs."""
    runs = [(device_spec, threads, kernels)] + ([] if also is None else [(device_spec, threads, also)])
    got = calibrate_rounds(runs, specs, input_shapes, repeats=repeats, cpu=cpu)
    return got[0] if also is None else tuple(got)


def calibrate_rounds(runs, specs, input_shapes, repeats=3, cpu=CpuOptions()):
    """A DeviceProfile per run (device_spec, threads or None, kernels per layer), from
    calibrations in this process that alternate run by run, round by round, each value the
    median over `repeats` rounds (one round: a single calibration). Runs of the same device and
    threads share one opened device; a CPU device of other threads is a device of its own (one
    thread against all the cores, say), its Numba and BLAS thread counts set again before each of
    its calibrations, since both are the process's. The caller's thread counts are back as they
    were on return. A CPU device opens with `cpu` (devices.cpu_options.CpuOptions): the command
    lines give the run's, with the machine's wisdom, so calibration runs the paths a training run
    on this machine would."""
    devices, opened = [], {}
    with _threads_kept():
        for device_spec, threads, _ in runs:
            key = (device_spec, threads if device_spec == "cpu" else None)
            if key not in opened:
                device = open_device(device_spec, **(cpu.device_options(threads) if device_spec == "cpu" else {}))
                name = f"{device_spec}:{threads}" if device_spec == "cpu" and threads else device_spec
                opened[key] = (device, ConvShard(device), name, device_spec)
            devices.append(opened[key])
        if len(runs) == 1:
            shard = devices[0][1]
            speeds, timings = shard.calibrate(specs, input_shapes, runs[0][2], repeats=repeats)
            return [_profile(devices[0], timings, speeds)]
        rounds = [[] for _ in runs]
        for _ in range(repeats):
            for i, ((device, shard, _, _), (_, _, kernels)) in enumerate(zip(devices, runs)):
                with _threads_of(device):
                    rounds[i].append(shard.calibrate(specs, input_shapes, kernels, repeats=1))
        return [_profile(d, [_median_of(layer) for layer in zip(*(t for _, t in r))],
                         [float(np.median(layer)) for layer in zip(*(s for s, _ in r))])
                for d, r in zip(devices, rounds)]


def _profile(opened, timings, speeds):
    """The DeviceProfile of a calibration: its cost lines, what its conv GEMMs ran in and the
    kernels/s it measured, as a worker's calibration gives the coordinator (a device opened for
    several runs reports the paths of all of them)."""
    device, _, name, device_spec = opened
    paths = sorted(set(device.conv_paths().values()))
    description = device.describe() + (f"; conv paths {', '.join(paths)}" if paths else "")
    return DeviceProfile(name, device_spec, description, tuple(LayerCost.fit(t) for t in timings),
                         computed_precision(device.conv_path_choices()), tuple(speeds))


@contextlib.contextmanager
def _threads_of(device):
    """A CPU device's Numba and BLAS threads for what runs inside (another device opened since
    set them to its own); other devices keep theirs."""
    threads = getattr(device, "threads", None)
    if threads is None:
        yield
        return
    numba.set_num_threads(threads)
    with threadpool_limits(limits=threads, user_api="blas"):
        yield


@contextlib.contextmanager
def _threads_kept():
    """The caller's Numba and BLAS thread counts, as they were, after what runs inside (opening a
    CPU device sets both to its own for the process)."""
    numba_threads = numba.get_num_threads()
    try:
        with threadpool_limits(limits=None):
            yield
    finally:
        numba.set_num_threads(numba_threads)


def _median_of(values):
    """The element-wise median of equally shaped calibration timings (dicts, lists, numbers)."""
    first = values[0]
    if isinstance(first, dict):
        return {k: _median_of([v[k] for v in values]) for k in first}
    if isinstance(first, list):
        return [_median_of(list(col)) for col in zip(*values)]
    if isinstance(first, float):
        return float(np.median(values))
    return first                                    # batch, kernel counts: the same in every round


def load_profiles(path, n_layers):
    """Every DeviceProfile saved in `path` (a file written by --save-profiles: one profile or a
    list). Raises ValueError naming the file and what is wrong with it."""
    try:
        with open(path) as f:
            saved = json.load(f)
    except OSError as e:
        raise ValueError(f"{path}: cannot read a saved profile: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a saved profile (not JSON: {e})") from None
    saved = saved if isinstance(saved, list) else [saved]
    profiles = []
    for d in saved:
        try:
            profile = DeviceProfile.from_json(d)
        except KeyError as e:
            raise ValueError(f"{path}: not a saved profile: missing key {e}") from None
        except (TypeError, AttributeError) as e:
            raise ValueError(f"{path}: not a saved profile ({e})") from None
        if len(profile.layers) != n_layers:
            raise ValueError(f"{path}: profile {profile.name!r} has {len(profile.layers)} layers, --conv has {n_layers}")
        profiles.append(profile)
    if not profiles:
        raise ValueError(f"{path}: holds no profile")
    return profiles
