"""Speedup against link bandwidth on an emulated switched network, measured and predicted.

    sudo python bench/bandwidth.py --out bench/results       # 100mbit, 1gbit, 10gbit; every row kind
    sudo python bench/bandwidth.py --rates 1gbit --rows peer-auto,ddp
    sudo python bench/bandwidth.py --net vgg-small --rates 1gbit --rows model,data,auto,ddp --rounds 3 \
        --out bench/results/parallel      # per-layer modes: hetconv-coordinator --parallel, beside DDP
    sudo python bench/bandwidth.py --net resnet18 --rates 1gbit,10gbit --rows data,auto,ddp --rounds 2 \
        --out bench/results/graph --name resnet18_layouts      # a graph's rows and layouts beside DDP
    sudo python bench/bandwidth.py --net resnet18 --rates 10gbit --rows auto,ddp --busy-last-worker ...
        # a heterogeneous pair: a busy process shares the last worker's core in every networked row
    sudo python bench/bandwidth.py --net bench/imagenet_nets.py:resnet50 --data r50.npz --rates 1gbit,10gbit \
        --rows auto,ddp --precision auto --ddp-layout channels_last --warmup 2 --steps 4 --rounds 2 \
        --out bench/results/resnet50 --name resnet50_links    # a user's file on 160 px images (imagenet.make_data)
    python bench/bandwidth.py --render bench/results/bandwidth.json   # rewrite the .md (and .png) only

Set-up (made here, removed in a finally, on Ctrl-C and SIGTERM too): one network namespace per
host, the coordinator's and each worker's, each joined by its own veth pair to one bridge (the
switch) in the root namespace. Both ends of every veth carry a tbf qdisc at the rate under test,
so every host's own link is shaped in both directions: a switch, not a hub. Peers in different
namespaces talk tcp across the bridge (hetconv uses ipc only inside one namespace).

Rows per rate (--rows picks):
- star:       --exchange star, 1 micro-batch: the first design, everything through the coordinator
- peer:       --exchange peer, 1 micro-batch
- peer-auto:  --exchange peer, automatic micro-batches (overlap)
- peer-bf16:  peer-auto with --wire-dtype bfloat16
- model, data, auto: hetconv-coordinator itself (--exchange peer, automatic micro-batches,
              --rebalance-after 0) with --parallel model|data|auto and --link at the rate under test;
              the row keeps the modes its plan record says each conv layer ran in (and the images of a
              data layer per worker), auto's choice and priced seconds, and the cost model's step for
              that plan from the run's own calibration record (predict_any with the plan's modes)
- DDDDDDMM:   (any chain of M and D, one letter per conv layer) --parallel with each layer's mode
              forced: how a layer's mode is checked against the cost model's choice
- ddp:        PyTorch DistributedDataParallel (gloo), one rank per worker host, the same network and
              global batch, 1 thread each: what a user would otherwise pick
--net (a hetconv --net text: vgg-small, vgg-small@0.5, paper, a user's FILE.py:FUNCTION, ...) takes the
network from there instead of --conv/--fc; it runs the rows model, data, auto, chains and ddp (the others
build the paper family only). --data NPZ trains the hetconv rows on that file's images (no
augmentation) instead of synthetic CIFAR-sized ones, and DDP on random images of its size and class
count; a FILE.py:FUNCTION network is then the file's PyTorch module in the DDP row, as the user wrote
it. --precision is hetconv's (auto takes bf16 where calibration measures it faster); --ddp-layout the
DDP row's memory layout (NCHW, PyTorch's default, or channels_last).
--rounds N repeats every row N times, rows alternating within a round (the
order reversed every other round), the baseline in each round: a ratio is taken within a round.
The single-device baseline (hetconv --local, one pinned core) runs once a round, in this run. Every
star/peer row also carries the cost model's prediction from the run's own calibration, with links
that carry TCP payload at 1448/1514 of the tbf rate, and (unless --no-wire-cpu) what moving a byte
costs the workers' cores, measured once per run on the unshaped link by bench/_wire_cpu.py: the
emulated hosts share this machine's cores, so a transfer that overlaps compute slows it.
Needs root and iproute2 (ip, tc); without them it says so and exits 0.

Writes OUT/bandwidth.json (the command, machine, load and wall time with the rows), and the
bandwidth.md and bandwidth.png rendered from it.
"""
import argparse
import contextlib
import functools
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import _speedup_common as C  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROW_KINDS = {
    "star": {"exchange": "star", "micro_batches": 1, "wire": "float32"},
    "peer": {"exchange": "peer", "micro_batches": 1, "wire": "float32"},
    "peer-auto": {"exchange": "peer", "micro_batches": 0, "wire": "float32"},
    "peer-bf16": {"exchange": "peer", "micro_batches": 0, "wire": "bfloat16"},
    "model": {"parallel": "model"},
    "data": {"parallel": "data"},
    "auto": {"parallel": "auto"},
    "ddp": None,
}
PARALLEL_KINDS = ("model", "data", "auto")


def parallel_kind(kind):
    """A row of hetconv-coordinator --parallel KIND: model, data, auto, or a chain of one letter
    per conv layer (M model, D data, e.g. DDDDDDMM) that forces each layer's mode."""
    return kind in PARALLEL_KINDS or re.fullmatch(r"[MD]+", kind or "") is not None


def sh(*cmd, check=True):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip()}")
    return r


def missing_requirements():
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (network namespaces, veth links, a bridge and tc qdiscs)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs iproute2: `{tool}` is not on PATH"
    return None


class Switch:
    """A bridge and one namespace + veth pair per host, unique to this process. Host 0 is the
    coordinator's; `shape(rate)` puts tbf on both ends of every host's link."""

    def __init__(self, hosts):
        pid = os.getpid()
        self.bridge = f"hcbr{pid}"[:15]
        self.subnet = f"10.213.{pid % 250 + 1}"
        self.hosts = [{"ns": f"hetconv-bench-{pid}-{i}", "outer": f"hc{pid}h{i}a"[:15], "inner": f"hc{pid}h{i}b"[:15],
                       "ip": f"{self.subnet}.{i + 1}"} for i in range(hosts)]
        self.made = []

    def __enter__(self):
        try:
            sh("ip", "link", "add", self.bridge, "type", "bridge")
            self.made.append(("bridge", self.bridge))
            sh("ip", "link", "set", self.bridge, "up")
            for h in self.hosts:
                sh("ip", "netns", "add", h["ns"])
                self.made.append(("ns", h["ns"]))
                sh("ip", "link", "add", h["outer"], "type", "veth", "peer", "name", h["inner"])
                self.made.append(("link", h["outer"]))
                sh("ip", "link", "set", h["inner"], "netns", h["ns"])
                sh("ip", "link", "set", h["outer"], "master", self.bridge)
                sh("ip", "link", "set", h["outer"], "up")
                self.exec_in(h, "ip", "addr", "add", f"{h['ip']}/24", "dev", h["inner"])
                self.exec_in(h, "ip", "link", "set", h["inner"], "up")
                self.exec_in(h, "ip", "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def prefix(self, h):
        return ["ip", "netns", "exec", h["ns"]]

    def exec_in(self, h, *cmd):
        return sh(*self.prefix(h), *cmd)

    def shape(self, rate):
        """tbf at `rate` on both ends of every host's link (None: unshaped). burst >= rate/HZ for
        tbf to reach its rate and >= 64 KiB for one GSO segment; 100 ms of queue before drops."""
        for h in self.hosts:
            for prefix, dev in (([], h["outer"]), (self.prefix(h), h["inner"])):
                sh(*prefix, "tc", "qdisc", "del", "dev", dev, "root", check=False)
                if rate:
                    per_s = rate_bytes_per_s(rate)
                    burst = int(max(256 * 1024, per_s * 0.01))
                    sh(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                       "burst", str(burst), "latency", "100ms")

    def __exit__(self, *exc):
        for kind, name in reversed(self.made):
            if kind == "link":
                sh("ip", "link", "del", name, check=False)          # takes its peer with it
            elif kind == "ns":
                sh("ip", "netns", "del", name, check=False)
            elif kind == "bridge":
                sh("ip", "link", "del", name, check=False)
        self.made = []


def rate_bytes_per_s(rate):
    """The line rate tc shapes to, in bytes per second (the model's link carries less: framing)."""
    from hetconv.engine.costmodel import line_rate
    return line_rate(rate)[0]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_workers(switch, address, n):
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    cores = sorted(os.sched_getaffinity(0))
    procs = []
    for i in range(n):
        h = switch.hosts[i + 1]
        cmd = [*switch.prefix(h), sys.executable, "-m", "hetconv.cli.worker", "--device", "cpu", "--connect", address,
               "--threads", "1", "--cores", str(cores[i % len(cores)]), "--name", f"host{i + 1}",
               "--connect-timeout", "180", "--idle-timeout", "600"]
        procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
    return procs


def stop(procs):
    for p in procs:
        try:
            p.wait(timeout=5)                 # the coordinator's SHUTDOWN normally ends them
        except subprocess.TimeoutExpired:
            C._kill_group(p)


def measure_wire_cpu(switch, log=print):
    """CPU seconds per byte that moving data between two worker hosts costs their compute cores
    (bench/_wire_cpu.py): ends pinned as the workers are, receiver on host 1, sender on host 2."""
    import _wire_cpu
    receiver, sender = switch.hosts[1], switch.hosts[2 if len(switch.hosts) > 2 else 0]
    endpoint = f"tcp://{receiver['ip']}:{free_port()}"
    return _wire_cpu.measure(endpoint, switch.prefix(receiver), switch.prefix(sender), log=log)


def run_hetconv(switch, kind, rate, args, common):
    coordinator = switch.hosts[0]
    address = f"tcp://{coordinator['ip']}:{free_port()}"
    workers = start_workers(switch, address, args.workers)
    label = rate or "unshaped"
    spec = {**common, **ROW_KINDS[kind], "tag": f"{kind}-{label}-{common.get('round', 0)}", "set": f"{args.workers} workers, {kind}",
            "devices": ["cpu"] * args.workers, "bind": address, "external": args.workers,
            "link": rate or "10gbit", "link_framing": "tbf", "connect_timeout": 180.0}
    try:
        with C.ForeignLoad() as load:
            row = C.run_in_subprocess(spec, prefix=switch.prefix(coordinator))
            stop(workers)
            workers = []
    finally:
        for w in workers:
            C._kill_group(w)
    row.update(kind=kind, rate=label, foreign_load_cores=load.cores)
    return row


def run_ddp(switch, rate, args, common):
    master = switch.hosts[1]["ip"]
    port = free_port()
    out = os.path.join(common["out_dir"], f"ddp-{rate or 'unshaped'}-{common.get('round', 0)}.json")
    cores = sorted(os.sched_getaffinity(0))
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    procs = []
    with C.ForeignLoad() as load:
        for rank in range(args.workers):
            h = switch.hosts[rank + 1]
            spec = {"rank": rank, "world": args.workers, "master": master, "port": port, "threads": 1, "net": args.net,
                    "batch_size": args.batch_size, "conv": args.conv, "fc": args.fc, "warmup": args.warmup,
                    "steps": args.steps, "layout": args.ddp_layout, **ddp_data(args)}
            cmd = [*switch.prefix(h), "taskset", "-c", str(cores[rank % len(cores)]), sys.executable,
                   os.path.join(HERE, "_ddp_baseline.py"), json.dumps(spec), out]
            procs.append(subprocess.Popen(cmd, env={**env, "GLOO_SOCKET_IFNAME": h["inner"]}, start_new_session=True))
        row = C.ddp_row(procs, out)
    row.update(kind="ddp", rate=rate or "unshaped", batch_size=args.batch_size, devices=["cpu"] * args.workers,
               foreign_load_cores=load.cores)
    return row


def user_net(net):
    """Whether --net names a user's file (FILE.py:FUNCTION) rather than a preset or a .json."""
    return ".py:" in net


@functools.lru_cache(maxsize=None)
def data_shape(path):
    """(image size, classes) of an .npz of square images (x_train (N, 3, S, S), classes)."""
    import numpy as np
    with np.load(path) as f:
        x = f["x_train"]
        classes = len(f["classes"]) if "classes" in f.files else int(f["y_train"].max()) + 1
    if x.ndim != 4 or x.shape[2] != x.shape[3]:
        raise SystemExit(f"--data {path}: x_train of shape {x.shape}, expected (N, C, S, S) square images")
    return int(x.shape[2]), int(classes)


def ddp_data(args):
    """What the DDP row trains on beside --data: random images of its size and classes, and a
    user's file's own PyTorch module (nothing where the rows train synthetic CIFAR-sized data)."""
    if not args.data:
        return {}
    size, classes = data_shape(args.data)
    return {"image_size": size, "classes": classes, **({"module": args.net, "net": ""} if user_net(args.net) else {})}


# ---- rows of hetconv-coordinator itself: --parallel model | data | auto ---------------------------

def network_flags(args):
    return ["--net", args.net] if args.net else ["--conv", args.conv, "--fc", args.fc]


def coordinator_flags(args, metrics):
    """The flags every hetconv-coordinator row shares: the network, batch, steps of synthetic data
    (warm-up + timed), 1 thread, one test batch, the calibrated split kept (no rebalancing)."""
    steps = args.warmup + args.steps
    data = (["--data", args.data, "--augment", "none", "--eval-every", "0"] if args.data else
            ["--synthetic-train", str(args.batch_size * steps), "--synthetic-test", str(args.batch_size)])
    return [*network_flags(args), "--batch-size", str(args.batch_size), "--steps", str(steps), *data,
            "--eval-batches", "1", "--rebalance-after", "0", "--threads", "1",
            "--precision", args.precision, "--metrics", metrics]


def read_metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_cli(cmd, env, log_path, timeout=1800):
    """Run one hetconv-coordinator to its end (its process group ended on every exit path)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                C._kill_group(proc)
    return proc.returncode


def step_times(records, warmup):
    steps = [r["step_s"] for r in records if r["event"] == "step"]
    timed = steps[warmup:]
    if not timed:
        raise RuntimeError(f"{len(steps)} step records, none past the {warmup} warm-up step(s)")
    return float(statistics.median(timed)), timed, steps[:warmup]


def run_local_cli(args, common):
    """The single-device baseline as a user runs it: hetconv-coordinator --local, 1 thread, pinned
    to the first core."""
    tag = f"local-{common.get('round', 0)}"
    metrics = os.path.join(common["out_dir"], f"metrics-{tag}.jsonl")
    cores = sorted(os.sched_getaffinity(0))
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    flags = ["--local", *coordinator_flags(args, metrics)]
    cmd = ["taskset", "-c", str(cores[0]), sys.executable, "-m", "hetconv.cli.coordinator", *flags]
    row = {"kind": "local", "rate": "in-process", "round": common.get("round", 0), "batch_size": args.batch_size,
           "net": args.net or f"conv {args.conv}, fc {args.fc}", "command": "hetconv-coordinator " + " ".join(flags),
           "ok": False}
    with C.ForeignLoad() as load:
        code = run_cli(cmd, env, os.path.join(common["out_dir"], f"log-{tag}.txt"))
    row["foreign_load_cores"] = load.cores
    try:
        row["step_s"], row["step_s_all"], row["warmup_step_s"] = step_times(read_metrics(metrics), args.warmup)
        row["ok"] = True
    except (OSError, RuntimeError, ValueError, KeyError) as e:
        row["error"] = f"exit {code}: {type(e).__name__}: {e}"
    return row


def predict_parallel(args, batch, plan, calibration, rate, wire_cpu_s_per_byte, micro, coordinator_cache,
                     value_bytes=4):
    """The cost model's step for the plan a run trained with (its modes, kernels and images per
    worker), from the run's own calibration record: predict_any, as hetconv-plan does;
    `value_bytes`: a feature-map value's bytes on the run's wire."""
    from threadpoolctl import threadpool_limits

    from hetconv.engine import costmodel as cm, steptasks
    from hetconv.engine.graph import graph_pass
    from hetconv.engine.measure import measure_coordinator_s, measure_join_s
    from hetconv.geometry import IMAGE_SHAPE, NUM_CLASSES, ConvSpec
    from hetconv.training.config import Config
    image_shape, classes = IMAGE_SHAPE, NUM_CLASSES
    if getattr(args, "data", ""):
        size, classes = data_shape(args.data)
        image_shape = (3, size, size)
    net = Config(net=args.net, conv=args.conv if not args.net else Config.conv,
                 fc=args.fc if not args.net else Config.fc).network(image_shape, classes).spec
    specs = [ConvSpec.from_layer(layer) for layer in net.conv_layers()]
    workers = plan["workers"]
    key = (batch, len(workers))
    if key not in coordinator_cache:      # the coordinator's FC and loss (the peer step's), at its 1 thread
        fc = [op.layer.to_json() for op in net.head() if op.type != "flatten"]
        with threadpool_limits(1):
            coordinator_cache[key] = measure_coordinator_s(specs, fc, net.input_shape, batch, len(workers),
                                                           network=net, exchange="peer", workers_elsewhere=True)
    if ("joins", batch) not in coordinator_cache:     # the graph's joins, which each worker runs on its part
        coordinator_cache[("joins", batch)] = measure_join_s(net, batch)
    profiles = cm.profiles_from_calibration({w: calibration[w] for w in workers})
    counts = {w: [layer["kernels"][w] for layer in plan["layers"]] for w in workers}
    images = {w: [layer.get("images", {}).get(w, 0) for layer in plan["layers"]] for w in workers}
    modes = [layer.get("mode", "model") for layer in plan["layers"]]
    link = C.model_link(rate, "tbf", wire_cpu_s_per_byte)
    graph = None if net.is_chain() else graph_pass(net, None).shape()
    pred = steptasks.predict_any("peer", specs, net.input_shape, batch, counts, profiles, link, coordinator_cache[key],
                          micro, value_bytes, modes=modes, images=images, graph=graph,
                          join_s=coordinator_cache[("joins", batch)])
    out = pred.to_json()
    out["dominant"] = list(cm.dominant_term(pred))
    return out


def run_parallel(switch, kind, rate, args, common, coordinator_cache):
    """One hetconv-coordinator --parallel KIND row: workers on hosts 1..n, the coordinator on host 0."""
    from hetconv.engine.microbatch import micro_batch_count
    label = rate or "unshaped"
    tag = f"{kind}-{label}-{common.get('round', 0)}"
    metrics = os.path.join(common["out_dir"], f"metrics-{tag}.jsonl")
    coordinator = switch.hosts[0]
    address = f"tcp://{coordinator['ip']}:{free_port()}"
    flags = ["--workers", str(args.workers), "--bind", address, "--insecure", "--connect-timeout", "180",
             "--exchange", "peer", "--micro-batches", str(args.micro_batches), "--parallel", kind,
             "--link", rate or "10gbit", *coordinator_flags(args, metrics)]
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [*switch.prefix(coordinator), sys.executable, "-m", "hetconv.cli.coordinator", *flags]
    row = {"kind": kind, "rate": label, "round": common.get("round", 0), "batch_size": args.batch_size,
           "net": args.net or f"conv {args.conv}, fc {args.fc}", "exchange": "peer", "parallel": kind,
           "command": "hetconv-coordinator " + " ".join(flags), "devices": ["cpu"] * args.workers, "ok": False}
    workers = start_workers(switch, address, args.workers)
    try:
        with C.ForeignLoad() as load:
            code = run_cli(cmd, env, os.path.join(common["out_dir"], f"log-{tag}.txt"))
            stop(workers)
            workers = []
    finally:
        for w in workers:
            C._kill_group(w)
    row["foreign_load_cores"] = load.cores
    try:
        records = read_metrics(metrics)
        row["step_s"], row["step_s_all"], row["warmup_step_s"] = step_times(records, args.warmup)
        plan = next(r for r in records if r["event"] == "plan")
        calibration = next(r for r in records if r["event"] == "calibration")["workers"]
        row["plan"] = {k: plan[k] for k in ("workers", "left_out", "layers")}
        row["modes"] = [layer.get("mode", "model") for layer in plan["layers"]]
        row["images"] = [layer.get("images") for layer in plan["layers"]]
        row["mode_choice"] = plan.get("mode_choice")
        # the run's count: the cost model's pick where it made one (auto), else the rule
        row["micro_choice"] = plan.get("micro_choice")
        row["micro_batches"] = (int(plan["micro_choice"]["micro_batches"]) if plan.get("micro_choice") else
                                micro_batch_count(args.micro_batches, args.batch_size, "peer", len(plan["workers"])))
        row["calibration"] = calibration
        wire = (plan.get("wire") or {}).get("dtype", "float32")
        row["wire"] = wire
        pred = predict_parallel(args, args.batch_size, plan, calibration, rate or "10gbit",
                                common.get("wire_cpu_s_per_byte", 0.0), row["micro_batches"], coordinator_cache,
                                value_bytes=2 if wire == "bfloat16" else 4)
        row["prediction"] = pred
        row["predicted_step_s"] = pred["step_s"]
        row["model_error_pct"] = 100.0 * (pred["step_s"] - row["step_s"]) / row["step_s"]
        row["workers"] = {}
        steps = [r for r in records if r["event"] == "step"][args.warmup:]
        for name in (steps[0].get("workers") or {}) if steps else {}:
            med = lambda key: float(statistics.median([r["workers"][name].get(key, 0) for r in steps]))  # noqa: E731
            per_layer = [r["workers"][name].get("layer_compute_s") or [] for r in steps]
            row["workers"][name] = {"compute_s": med("compute_s"), "sent": int(med("bytes_sent")),
                                    "recv": int(med("bytes_recv")), "peer_sent": int(med("peer_bytes_sent")),
                                    "layer_compute_s": [float(statistics.median(col)) for col in zip(*per_layer)]}
        row["trace"] = traced_step(records)
        row["ok"] = True
    except (OSError, RuntimeError, ValueError, KeyError, StopIteration) as e:
        row["error"] = f"exit {code}: {type(e).__name__}: {e}"
    return row


def traced_step(records):
    """The run's traced step (--trace-step) per worker: when it ended, its forward, backward and
    update seconds and its waits by what it waited for (hetconv-report's table), or None."""
    from hetconv.cli.report import trace_spans, trace_summary
    for r in records:
        if r["event"] == "step" and any("trace" in w for w in (r.get("workers") or {}).values()):
            return {"step": r["step"], "step_s": r["step_s"],
                    "workers": {name: trace_summary(trace_spans(w.get("trace"))) for name, w in r["workers"].items()}}
    return None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--rates", default="100mbit,1gbit,10gbit",
                   help="tc rates, each host's own link; 'unshaped': the namespaces' veth links as they are")
    p.add_argument("--rows", default=",".join(ROW_KINDS), help=f"which rows per rate, of {', '.join(ROW_KINDS)}")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--conv", default="500,1500", help="kernels per conv layer (default: the paper network)")
    p.add_argument("--fc", default="256")
    p.add_argument("--net", default="", help="a hetconv --net text (vgg-small, vgg-small@0.5, paper, ...) instead of "
                                             "--conv/--fc; rows model, data, auto and ddp only")
    p.add_argument("--name", default="bandwidth", help="OUT/NAME.json and NAME.md")
    p.add_argument("--rounds", type=int, default=1, help="rows alternate within a round, the baseline in each")
    p.add_argument("--workers", type=int, default=2, help="1-thread CPU workers, each on a host of its own")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--micro-batches", type=int, default=0,
                   help="--micro-batches of the hetconv-coordinator rows (0: automatic, as training picks)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--data", default="", help="an .npz of images the hetconv rows train on (default: synthetic "
                                              "CIFAR-sized); DDP trains on random images of its size")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "auto"), help="hetconv's --precision")
    p.add_argument("--ddp-layout", default="NCHW", choices=("NCHW", "channels_last"), help="the DDP row's layout")
    p.add_argument("--busy-last-worker", action="store_true",
                   help="a heterogeneous pair: a busy process shares the last worker's core (its DDP rank's too) "
                        "during every networked row; the --local baseline runs without it")
    p.add_argument("--runs-dir", default="", help="keep each run's metrics JSON lines here (default: a temp dir)")
    p.add_argument("--no-wire-cpu", dest="wire_cpu", action="store_false",
                   help="do not measure the wire's CPU on the workers' cores (the model then charges none)")
    p.add_argument("--render", default="", help="only rewrite the .md and .png beside this saved bandwidth.json")
    p.add_argument("--repredict", default="", metavar="JSON",
                   help="run nothing: predict the rows of a saved bandwidth.json again with this version's cost "
                        "model, from each row's own saved calibration, plan and coordinator time; writes "
                        "bandwidth_repredicted.md beside it")
    p.add_argument("--wire-cpu-ns", type=float, default=None, metavar="NS",
                   help="with --repredict: the wire's CPU per byte to charge (default: what that run measured, else 0)")
    args = p.parse_args(argv)
    if args.repredict:
        return repredict(args.repredict, args.wire_cpu_ns)
    if args.render:
        with open(args.render) as f:
            saved = json.load(f)
        if not isinstance(saved, dict) or any("kind" not in r for r in saved.get("rows", [None])):
            p.error(f"--render {args.render}: not a bandwidth.json of this generator (rows without 'kind': "
                    f"written by the earlier one-shared-link version; re-run the benchmark)")
        write_outputs(os.path.dirname(os.path.abspath(args.render)), saved,
                      os.path.splitext(os.path.basename(args.render))[0])
        return 0
    kinds = [k.strip() for k in args.rows.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in ROW_KINDS and not parallel_kind(k)]
    if unknown:
        p.error(f"--rows: unknown {unknown}, expected some of {', '.join(ROW_KINDS)}, or a chain of M and D per conv "
                f"layer such as DDDDDDMM")
    if args.net and any(not parallel_kind(k) and k != "ddp" for k in kinds):
        p.error(f"--net {args.net}: rows {', '.join(k for k in kinds if not parallel_kind(k) and k != 'ddp')} build "
                f"the paper family only (--conv, --fc); with --net use {', '.join(PARALLEL_KINDS)} and ddp")
    if args.rounds < 1:
        p.error(f"--rounds must be 1 or more, got {args.rounds}")
    why = missing_requirements()
    if why:
        print(f"bench/bandwidth.py: skipped: {why}")
        return 0
    scratch = args.runs_dir or tempfile.mkdtemp(prefix="hetconv-bandwidth-")
    os.makedirs(scratch, exist_ok=True)
    print(f"per-run metrics and rows: {scratch}", flush=True)
    # SIGTERM ends the run like Ctrl-C, so the finally below still removes the namespaces
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(143)))
    command = "python bench/bandwidth.py " + " ".join(argv if argv is not None else sys.argv[1:])
    common = {"batch_size": args.batch_size, "warmup": args.warmup, "steps": args.steps, "out_dir": scratch,
              "split": "proportional", "conv": args.conv, "fc": args.fc}
    result = {"command": command, "machine": C.machine(), "load_before": _common.load_average(),
              "workers": args.workers, "conv": args.conv, "fc": args.fc, "net": args.net, "rounds": args.rounds,
              "micro_batches": args.micro_batches, "rows": [],
              "busy_core": (sorted(os.sched_getaffinity(0))[(args.workers - 1) % len(os.sched_getaffinity(0))]
                            if args.busy_last_worker else None)}
    rows = result["rows"]
    t_all = time.perf_counter()
    switch = Switch(1 + args.workers)
    try:
        switch.__enter__()
    except RuntimeError as e:               # root, but no CAP_NET_ADMIN (a container) or no netns support
        print(f"bench/bandwidth.py: skipped: cannot set up the network namespaces: {e}")
        return 0
    try:
        print(f"machine: {result['machine']}\nbridge {switch.bridge}, hosts "
              + ", ".join(f"{h['ns']} ({h['ip']})" for h in switch.hosts), flush=True)
        if args.wire_cpu and any(k != "ddp" for k in kinds):
            # once, unshaped: the most bytes in the probe's time, so the cost stands well above the
            # host's noise (at 100 Mbit/s it would be a few tenths of a second's difference)
            print("[unshaped] the wire's CPU on the workers' cores ...", flush=True)
            wire_cpu = measure_wire_cpu(switch, log=lambda msg: print(f"    | {msg}", flush=True))
            result["wire_cpu"] = wire_cpu
            common = {**common, "wire_cpu_s_per_byte": wire_cpu["host_cpu_s_per_byte"]}
            print(f"    -> {wire_cpu['host_cpu_s_per_byte'] * 1e9:.2f} ns a byte "
                  f"({wire_cpu['lost_s']:.3f} s of compute lost to {wire_cpu['bytes'] / 1e6:.0f} MB)", flush=True)
        coordinator_cache = {}
        for rnd in range(args.rounds):
            common = {**common, "round": rnd}
            # the baseline in every round; the rows' order reversed every other round, so a drift
            # of the host's speed during a round does not always favour the same row
            print(f"[round {rnd + 1}/{args.rounds}] [baseline] local, batch {args.batch_size} ...", flush=True)
            if args.net or any(parallel_kind(k) for k in kinds):
                base = run_local_cli(args, common)
            else:
                with C.ForeignLoad() as load:
                    base = C.run_in_subprocess({**common, "tag": f"local-{rnd}", "set": "local", "devices": ["cpu"],
                                                "local": True, "pin": [0], "split": "equal"})
                base.update(kind="local", rate="in-process", round=rnd, foreign_load_cores=load.cores)
            print(f"    -> {fmt(base)}", flush=True)
            rows.append(base)
            for rate in [r.strip() for r in args.rates.split(",") if r.strip()]:
                rate = None if rate == "unshaped" else rate          # the veth pair as it is
                switch.shape(rate)
                for kind in (kinds if rnd % 2 == 0 else kinds[::-1]):
                    print(f"[round {rnd + 1}/{args.rounds}] [{rate}] {kind}, {args.workers} workers ...", flush=True)
                    busy = (C.CoRunner(result["busy_core"]) if result["busy_core"] is not None
                            else contextlib.nullcontext())
                    with busy:
                        if kind == "ddp":
                            row = run_ddp(switch, rate, args, common)
                        elif parallel_kind(kind):
                            row = run_parallel(switch, kind, rate, args, common, coordinator_cache)
                        else:
                            row = run_hetconv(switch, kind, rate, args, common)
                    row["round"] = rnd
                    rows.append(row)
                    print(f"    -> {fmt(row)}", flush=True)
    except KeyboardInterrupt:
        print("interrupted: cleaning up, writing the rows measured so far", file=sys.stderr)
    finally:
        switch.__exit__()
        print(f"removed bridge {switch.bridge} and {len(switch.hosts)} namespaces", flush=True)
        result["wall_s"] = time.perf_counter() - t_all
        result["load_after"] = _common.load_average()
        for r in rows:                       # raw records, but no paths of this machine's scratch dir
            r.pop("log", None)
        write_outputs(args.out, result, args.name)
    return 0


def repredict(path, wire_cpu_ns=None):
    """The saved rows against this version's model: what a model change does to a measured run,
    without measuring again (the host's speed that day stays in both the steps and the profiles)."""
    from hetconv.engine import costmodel as cm, steptasks
    from hetconv.geometry import IMAGE_SHAPE, conv_specs
    from hetconv.transport.wire import value_bytes
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        print(f"--repredict {path}: cannot read it as JSON: {e}", file=sys.stderr)
        return 2
    rows = [r for r in saved.get("rows", []) if r.get("ok") and (r.get("profiles") or r.get("calibration"))
            and "prediction" in r] \
        if isinstance(saved, dict) else []
    if not rows:
        print(f"--repredict {path}: no rows with saved profiles and predictions (not a bandwidth.json of this "
              f"generator?)", file=sys.stderr)
        return 2
    if wire_cpu_ns is None:
        wire_cpu_ns = 1e9 * (saved.get("wire_cpu") or {}).get("host_cpu_s_per_byte", 0.0)
    lines = [f"Rows of `{os.path.basename(path)}` ({saved.get('command', '?')}; {saved.get('machine', '?')}) predicted "
             f"again by this version's cost model from their own saved calibration; links carry TCP payload at "
             f"1448/1514 of the tbf rate; wire CPU {wire_cpu_ns:.2f} ns a byte.", "",
             "| link | row | micro-batches | wire | step s | saved prediction | error | new prediction | error |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    specs = conv_specs([int(k) for k in saved.get("conv", "500,1500").split(",")])   # recorded since it was a flag
    for r in rows:
        coordinator_s = r["prediction"]["coordinator_s"]
        if "plan" in r and "calibration" in r:       # a hetconv-coordinator --parallel row (any --net)
            args = argparse.Namespace(net=saved.get("net"), conv=saved.get("conv"), fc=saved.get("fc"))
            new = predict_parallel(args, r["batch_size"], r["plan"], r["calibration"],
                                   r["rate"] if r["rate"] != "unshaped" else "10gbit", wire_cpu_ns * 1e-9,
                                   r["micro_batches"], {(r["batch_size"], len(r["plan"]["workers"])): coordinator_s},
                                   value_bytes(r.get("wire") or "float32"))["step_s"]
        elif r.get("kind") == "local":
            profile = cm.DeviceProfile.from_json(r["profiles"]["local"])
            new = cm.predict_local(specs, r["batch_size"], profile, coordinator_s)
        else:
            profiles = {w: cm.DeviceProfile.from_json(p) for w, p in r["profiles"].items()}
            link = C.model_link(r["rate"], "tbf", wire_cpu_ns * 1e-9)
            new = steptasks.predict_any(r["exchange"], specs, IMAGE_SHAPE, r["batch_size"], r["counts"], profiles, link,
                                 coordinator_s, r["micro_batches"], value_bytes(r["wire"])).step_s
        err = lambda pred: 100.0 * (pred - r["step_s"]) / r["step_s"]   # noqa: E731
        lines.append(f"| {r['rate']} | {r['kind']} | {r.get('micro_batches', '')} | {r.get('wire', '')} | "
                     f"{r['step_s']:.3f} | {r['predicted_step_s']:.3f} | {err(r['predicted_step_s']):+.1f}% | "
                     f"{new:.3f} | {err(new):+.1f}% |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(os.path.dirname(os.path.abspath(path)), "bandwidth_repredicted.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


def fmt(row):
    if not row.get("ok"):
        return f"FAILED: {row.get('error')}"
    if row["kind"] == "ddp":
        return f"step {row['step_s']:.3f}s (all-reduce of {row['allreduce_mb']:.0f} MB)"
    if parallel_kind(row["kind"]) or "command" in row:      # a hetconv-coordinator row
        steps = ", ".join(f"{t:.3f}" for t in row["step_s_all"])
        predicted = (f", predicted {row['predicted_step_s']:.3f}s ({row['model_error_pct']:+.1f}%)"
                     if "predicted_step_s" in row else "")
        modes = f", modes {modes_text(row['modes'])}" if row.get("modes") else ""
        return f"step {row['step_s']:.3f}s (steps {steps}){predicted}{modes}"
    return C.fmt_row(row)


def modes_text(modes):
    """Per conv layer, M (model) or D (data), in layer order."""
    return "".join("D" if m == "data" else "M" for m in modes)


def round_ratios(rows):
    """Per row, within its own round: the model row's step over its step at the same rate
    (vs_model) and the --local baseline's over its step (vs_local): > 1 is faster."""
    by = {(r.get("round", 0), r.get("rate"), r["kind"]): r for r in rows if r.get("ok")}
    for r in rows:
        if not r.get("ok"):
            continue
        model = by.get((r.get("round", 0), r.get("rate"), "model"))
        local = by.get((r.get("round", 0), "in-process", "local"))
        r["vs_model"] = model["step_s"] / r["step_s"] if model else None
        r["vs_local"] = local["step_s"] / r["step_s"] if local else None


def write_parallel(out_dir, result, stem):
    """The --parallel rows: a summary per link and row (medians over the rounds, ratios taken
    within each round) and every row as measured."""
    from hetconv.engine.microbatch import priced_text
    rows = result["rows"]
    round_ratios(rows)
    med = lambda xs: statistics.median(xs) if xs else None          # noqa: E731
    num = lambda x, f="{:.3f}": f.format(x) if x is not None else ""  # noqa: E731
    wire = result.get("wire_cpu")
    micro = result.get("micro_batches")
    micro_text = f"{micro} micro-batch(es)" if micro else "automatic micro-batches (the cost model's pick)"
    lines = [f"Machine: {result['machine']}. Command: `{result['command']}` ({result.get('wall_s', 0) / 60:.1f} min; "
             f"{result.get('load_before', '')} before, {result.get('load_after', '')} after).",
             f"Network: {result.get('net') or 'conv ' + result['conv'] + ', fc ' + result['fc']}; batch "
             f"{next((r['batch_size'] for r in rows if r.get('batch_size')), '?')}; {result.get('workers', 2)} one-thread "
             f"CPU workers and the coordinator, each in a network namespace of its own with its own tbf-shaped link "
             f"(both directions) to one bridge. Rows: hetconv-coordinator --parallel model|data|auto|a chain (--exchange "
             f"peer, {micro_text}, --link at the rate, --rebalance-after 0: the calibrated plan); PyTorch DDP "
             f"(gloo, one 1-thread rank per worker host); baseline hetconv-coordinator --local, 1 thread, one pinned "
             f"core. {result.get('rounds', 1)} round(s), rows alternating within a round (order reversed every other "
             f"round); a ratio is taken within a round, then the median over rounds. Modes: per conv layer, M model, "
             f"D data. Predicted: the cost model (predict_any with the run's own plan and calibration record; links "
             f"carry TCP payload at 1448/1514 of the tbf rate"
             + (f"; moving a byte costs the workers' cores {wire['host_cpu_s_per_byte'] * 1e9:.2f} ns, measured "
                f"unshaped in this run)." if wire else "; no wire CPU charged).")
             + (f" A heterogeneous pair: during every networked row a busy process (a pure-Python loop) shares core "
                f"{result['busy_core']} with the last worker (its PyTorch DDP rank too), so that worker computes at "
                f"about half speed; the --local baseline runs without it." if result.get("busy_core") is not None
                else "")
             + " Foreign load: cores' worth of CPU other processes used during the row (the machine is shared).", "",
             "| link (each host) | row | modes | s/step (median of rounds) | predicted s | model error | x faster than "
             "model (same round) | x faster than --local (same round) | foreign load |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    keys = []
    for r in rows:
        key = (r.get("rate"), r["kind"])
        if key not in keys:
            keys.append(key)
    for rate, kind in keys:
        mine = [r for r in rows if (r.get("rate"), r["kind"]) == (rate, kind) and r.get("ok")]
        failed = [r for r in rows if (r.get("rate"), r["kind"]) == (rate, kind) and not r.get("ok")]
        if not mine:
            lines.append(f"| {rate} | {kind} | failed: {failed[0].get('error', '?') if failed else '?'} |")
            continue
        modes = sorted({modes_text(r["modes"]) for r in mine if r.get("modes")})
        step = med([r["step_s"] for r in mine])
        pred = med([r["predicted_step_s"] for r in mine if "predicted_step_s" in r])
        err = med([r["model_error_pct"] for r in mine if "model_error_pct" in r])
        name = {"local": "hetconv --local (baseline)", "ddp": "PyTorch DDP (gloo)"}.get(kind, f"--parallel {kind}")
        name += f" ({len(mine)} of {len(mine) + len(failed)} runs)" if failed else ""
        lines.append(f"| {rate} | {name} | {' / '.join(modes)} | {step:.3f} | {num(pred)} | "
                     f"{num(err, '{:+.1f}%')} | {num(med([r['vs_model'] for r in mine if r.get('vs_model')]), '{:.2f}x')} | "
                     f"{num(med([r['vs_local'] for r in mine if r.get('vs_local')]), '{:.2f}x')} | "
                     f"{med([r.get('foreign_load_cores', 0) for r in mine]):.2f} |")
    lines += ["", "Every row:", "",
              "| round | link | row | step s (median) | timed steps s | predicted s | error | modes | micro-batches | "
              "images per worker (data layers) | auto's choice | foreign load |",
              "|---:|---|---|---:|---|---:|---:|---|---|---|---|---:|"]
    for r in rows:
        if not r.get("ok"):
            lines.append(f"| {r.get('round', 0) + 1} | {r.get('rate')} | {r['kind']} | failed: {r.get('error', '?')} |")
            continue
        images = sorted({"/".join(str(v) for v in im.values()) for im in (r.get("images") or []) if im})
        choice = r.get("mode_choice") or {}
        choice_text = (f"{choice.get('reason', '')}; priced {num(choice.get('chosen_s'))} s, all-model "
                       f"{num(choice.get('model_s'))} s" if choice else "")
        micro_choice = r.get("micro_choice")
        micro_text = str(r.get("micro_batches", "")) + (f" (priced {priced_text(micro_choice['predicted_s'])})"
                                                         if micro_choice else "")
        lines.append(f"| {r.get('round', 0) + 1} | {r.get('rate')} | {r['kind']} | {r['step_s']:.3f} | "
                     f"{', '.join(f'{t:.3f}' for t in r.get('step_s_all', []))} | {num(r.get('predicted_step_s'))} | "
                     f"{num(r.get('model_error_pct'), '{:+.1f}%')} | {modes_text(r.get('modes') or [])} | "
                     f"{micro_text} | {', '.join(images)} | {choice_text} | {r.get('foreign_load_cores', 0):.2f} |")
    lines += layer_compute_table(rows)
    lines += bytes_table(rows)
    lines += trace_table(rows)
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(text)
    print("\n" + text)


def trace_table(rows):
    """Each run's traced step beside its priced one: per worker when it ended, its forward,
    backward and updates and what it waited for (the trace), and what the cost model's critical
    path for the run's plan waits on."""
    mine = [r for r in rows if r.get("ok") and r.get("trace")]
    if not mine:
        return []
    lines = ["", "The traced step of each run (hetconv-coordinator --trace-step; seconds; waits fall inside the "
                 "blocks that read what they wait for) beside the priced step's critical path:", "",
             "| round | link | row | step | step s | worker | ends | forward | backward | updates | waited for | "
             "priced critical path |", "|---:|---|---|---:|---:|---|---:|---:|---:|---:|---|---|"]
    for r in mine:
        path = (r.get("prediction") or {}).get("critical_path_s") or {}
        path_text = ", ".join(f"{k} {v:.3f}" for k, v in sorted(path.items(), key=lambda kv: -kv[1])[:4])
        for i, (name, t) in enumerate(r["trace"]["workers"].items()):
            waited = ", ".join(f"{k} {v:.3f}" for k, v in list(t["waits_s"].items())[:4]) or "none"
            lines.append(f"| {r.get('round', 0) + 1} | {r.get('rate')} | {r['kind']} | {r['trace']['step']} | "
                         f"{r['trace']['step_s']:.3f} | {name} | {t['ends_s']:.3f} | {t['forward_s']:.3f} | "
                         f"{t['backward_s']:.3f} | {t['updates_s']:.3f} | {waited} | {path_text if i == 0 else ''} |")
    return lines


def bytes_table(rows):
    """A graph's rows: megabytes a step by what they carry, as the cost model counts them for the
    run's plan, beside what the workers measured sending to each other (STEP_DONE's peer bytes,
    headers included) and what crossed the coordinator's link."""
    mine = [r for r in rows if r.get("ok") and (r.get("prediction") or {}).get("bytes_by_kind")]
    if not mine:
        return []
    kinds = list(dict.fromkeys(k for r in mine for k in r["prediction"]["bytes_by_kind"]))
    lines = ["", "Megabytes a step by what they carry (a graph: every block's output all-gathered among the workers, "
                 "a model block's partial input gradient to every other worker, a data block's input gradient by "
                 "images and its weight gradients), priced for the run's plan; measured: sent among the workers and "
                 "through the coordinator's link (median step):", "",
             "| link | row | " + " | ".join(kinds) + " | priced among the workers | measured among the workers | "
             "measured through the coordinator |",
             "|---|---|" + "---:|" * (len(kinds) + 3)]
    for r in mine:
        by_kind = r["prediction"]["bytes_by_kind"]
        among = sum(v for k, v in by_kind.items() if "coordinator" not in k)
        peer = sum(w.get("peer_sent", 0) for w in r["workers"].values())
        coordinator = sum(w.get("sent", 0) + w.get("recv", 0) for w in r["workers"].values())
        lines.append(f"| {r.get('rate')} | {r['kind']} | " + " | ".join(f"{by_kind.get(k, 0) / 1e6:.1f}" for k in kinds)
                     + f" | {among / 1e6:.1f} | {peer / 1e6:.1f} | {coordinator / 1e6:.1f} |")
    return lines


def layer_compute_table(rows):
    """Per row kind, each worker's compute per conv layer: measured in the run (median of the timed
    steps, then of the rounds) against the cost model's price from the run's calibration. Where a
    row's prediction departs from its step, this says which layer's compute is mispriced (or that
    none is, and the time went to the wire or to waiting)."""
    lines = []
    for kind in dict.fromkeys(r["kind"] for r in rows if r.get("ok") and r.get("workers")):
        mine = [r for r in rows if r.get("ok") and r["kind"] == kind and r.get("prediction")]
        names = sorted({w for r in mine for w in r["workers"]})
        if not mine or not names:
            continue
        if not lines:
            lines += ["", "Compute per conv layer, each worker: measured s a step (median) / priced from calibration, "
                          "and their ratio:", ""]
        layers = len(mine[0]["modes"] or [])
        lines += [f"| {kind} ({modes_text(mine[0].get('modes') or [])}) | " + " | ".join(f"conv{i + 1}" for i in range(layers)) + " |",
                  "|---|" + "---:|" * layers]
        for w in names:
            cells = []
            for li in range(layers):
                measured = [r["workers"][w]["layer_compute_s"][li] for r in mine
                            if len(r["workers"].get(w, {}).get("layer_compute_s") or []) > li]
                priced = [r["prediction"]["workers"][w]["layer_compute_s"][li] for r in mine
                          if len(r["prediction"]["workers"].get(w, {}).get("layer_compute_s") or []) > li]
                if measured and priced:
                    m, p = statistics.median(measured), statistics.median(priced)
                    cells.append(f"{m:.3f} / {p:.3f} ({m / p:.2f}x)" if p > 0 else f"{m:.3f} / 0")
                else:
                    cells.append("")
            lines.append(f"| {w} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def write_outputs(out_dir, result, stem="bandwidth"):
    rows = result["rows"]
    if result.get("net") or any(parallel_kind(r.get("kind")) for r in rows):
        os.makedirs(out_dir, exist_ok=True)
        round_ratios(rows)
        with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
            json.dump(result, f, indent=1)
        write_parallel(out_dir, result, stem)
        return
    base = next((r for r in rows if r.get("kind") == "local"), None)
    for r in rows:
        if r.get("ok") and base and base.get("ok"):
            r["speedup"] = base["step_s"] / r["step_s"]
            if "predicted_step_s" in r:
                r["predicted_speedup"] = base["predicted_step_s"] / r["predicted_step_s"]
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(result, f, indent=1)
    framed = any("host_cpu_s_per_byte" in (r.get("link") or {}) for r in rows)    # saved by this version's model
    lines = [f"Machine: {result['machine']}. Command: `{result['command']}` "
             f"({result.get('wall_s', 0) / 60:.1f} min; {result.get('load_before', '')} before, "
             f"{result.get('load_after', '')} after).",
             f"{result.get('workers', 2)} one-thread CPU workers and the coordinator, each in a network namespace of "
             f"its own with its own shaped link to one bridge; baseline: hetconv --local on one core, same run. "
             + ("Each row's devices are calibrated before its steps (the plan) and after them; the model gets the "
                "average, and `calibration drift` is after/before per device (1.00: the host held its speed). "
                if any(r.get("calibration_drift") for r in rows) else "")
             + ("The model's links carry TCP payload at 1448/1514 of the tbf rate (headers and framing tbf counts)"
                if framed else "The predictions are that version's model: the line rate as payload, no wire CPU.")
             + (f"; moving a byte costs the workers' cores {result['wire_cpu']['host_cpu_s_per_byte'] * 1e9:.2f} ns, "
                f"measured unshaped in this run ({result['wire_cpu']['lost_s']:.2f} s of sgemm lost to "
                f"{result['wire_cpu']['bytes'] / 1e6:.0f} MB, bench/_wire_cpu.py)." if result.get("wire_cpu")
                else "; no wire CPU measured (the model charges none)." if framed else ""), "",
             "| link (each host) | row | exchange | micro-batches | wire | step s | speedup | predicted s | model error "
             "| calibration drift | coordinator MB/step | peer MB/step | dominant term (model) | foreign load |",
             "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        if not r.get("ok"):
            lines.append(f"| {r.get('rate')} | {r.get('kind')} | failed: {r.get('error', '?')} |")
            continue
        ws = r.get("workers") or {}
        coord_mb = sum(m["sent"] + m["recv"] for m in ws.values()) / 1e6 if ws else 0.0
        peer_mb = sum(m.get("peer_sent", 0) for m in ws.values()) / 1e6 if ws else 0.0
        if r["kind"] == "ddp":
            lines.append(f"| {r['rate']} | PyTorch DDP (gloo) | all-reduce | 1 | float32 | {r['step_s']:.3f} | "
                         f"{r.get('speedup', float('nan')):.2f}x | | | | | {r['allreduce_mb']:.0f} per rank | | "
                         f"{r.get('foreign_load_cores', 0):.2f} |")
            continue
        if r["kind"] == "local":
            lines.append(f"| in-process | hetconv --local (baseline) | | | | {r['step_s']:.3f} | 1.00x | "
                         f"{r['predicted_step_s']:.3f} | {r['model_error_pct']:+.1f}% | {C.drift_text(r)} | | | | "
                         f"{r.get('foreign_load_cores', 0):.2f} |")
            continue
        dominant = (r.get("prediction") or {}).get("dominant")
        lines.append(f"| {r['rate']} | {r['kind']} | {r.get('exchange', '')} | {r.get('micro_batches', '')} | "
                     f"{r.get('wire', '')} | {r['step_s']:.3f} | {r.get('speedup', float('nan')):.2f}x | "
                     f"{r['predicted_step_s']:.3f} | {r['model_error_pct']:+.1f}% | {C.drift_text(r)} | {coord_mb:.1f} | "
                     f"{peer_mb:.1f} | "
                     f"{dominant[0] if dominant else ''} | {r.get('foreign_load_cores', 0):.2f} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(text)
    print("\n" + text)
    try:
        plot(out_dir, result, stem)
    except ImportError as e:
        print(f"no plot: {e}")


def plot(out_dir, result, stem="bandwidth"):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in result["rows"] if r.get("ok") and "speedup" in r and r.get("kind") != "local"]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind in ROW_KINDS:
        mine = sorted((r for r in rows if r["kind"] == kind), key=lambda r: rate_bytes_per_s(r["rate"]))
        if not mine:
            continue
        bits = [rate_bytes_per_s(r["rate"]) * 8 for r in mine]
        line, = ax.plot(bits, [r["speedup"] for r in mine], "o-", label=kind if kind != "ddp" else "PyTorch DDP")
        if kind != "ddp":
            ax.plot(bits, [r["predicted_speedup"] for r in mine], "s--", mfc="none", color=line.get_color(), lw=0.8)
    n = result.get("workers", 2)
    ax.axhline(n, color="k", lw=1, ls=":", label=f"ideal ({n} devices)")
    ax.set_xscale("log")
    ax.set_xlabel("each host's link (bit/s, tbf both directions); dashed: cost model")
    ax.set_ylabel("speedup over hetconv --local (1 thread)")
    ax.set_title(f"speedup vs bandwidth, batch {rows[0].get('batch_size')}\n{result['machine']}", fontsize=9)
    ax.grid(alpha=.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"{stem}.png"), dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
