"""Speedup against link bandwidth on an emulated switched network, measured and predicted.

    sudo python bench/bandwidth.py --out bench/results       # 100mbit, 1gbit, 10gbit; every row kind
    sudo python bench/bandwidth.py --rates 1gbit --rows peer-auto,ddp
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
- ddp:        PyTorch DistributedDataParallel (gloo), one rank per worker host, the same network and
              global batch, 1 thread each: what a user would otherwise pick
The single-device baseline (hetconv --local, one pinned core) runs once, in this run. Every
hetconv row also carries the cost model's prediction from the run's own calibration, with links
that carry TCP payload at 1448/1514 of the tbf rate, and (unless --no-wire-cpu) what moving a byte
costs the workers' cores, measured once per run on the unshaped link by bench/_wire_cpu.py: the
emulated hosts share this machine's cores, so a transfer that overlaps compute slows it.
Needs root and iproute2 (ip, tc); without them it says so and exits 0.

Writes OUT/bandwidth.json (the command, machine, load and wall time with the rows), and the
bandwidth.md and bandwidth.png rendered from it.
"""
import argparse
import json
import os
import shutil
import signal
import socket
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
    "ddp": None,
}


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
    spec = {**common, **ROW_KINDS[kind], "tag": f"{kind}-{label}", "set": f"{args.workers} workers, {kind}",
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
    out = os.path.join(common["out_dir"], f"ddp-{rate or 'unshaped'}.json")
    cores = sorted(os.sched_getaffinity(0))
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    procs = []
    with C.ForeignLoad() as load:
        for rank in range(args.workers):
            h = switch.hosts[rank + 1]
            spec = {"rank": rank, "world": args.workers, "master": master, "port": port, "threads": 1,
                    "batch_size": args.batch_size, "conv": args.conv, "fc": args.fc, "warmup": args.warmup,
                    "steps": args.steps}
            cmd = [*switch.prefix(h), "taskset", "-c", str(cores[rank % len(cores)]), sys.executable,
                   os.path.join(HERE, "_ddp_baseline.py"), json.dumps(spec), out]
            procs.append(subprocess.Popen(cmd, env={**env, "GLOO_SOCKET_IFNAME": h["inner"]}, start_new_session=True))
        try:
            for p in procs:
                p.wait(timeout=1800)
        finally:
            for p in procs:
                if p.poll() is None:
                    C._kill_group(p)
    row = {"ok": False, "error": f"ranks exited with {[p.returncode for p in procs]} and wrote no row"}
    if os.path.exists(out):
        with open(out) as f:
            row = json.load(f)
    row.update(kind="ddp", rate=rate or "unshaped", batch_size=args.batch_size, devices=["cpu"] * args.workers,
               foreign_load_cores=load.cores)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--rates", default="100mbit,1gbit,10gbit", help="tc rates, each host's own link")
    p.add_argument("--rows", default=",".join(ROW_KINDS), help=f"which rows per rate, of {', '.join(ROW_KINDS)}")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--conv", default="500,1500", help="kernels per conv layer (default: the paper network)")
    p.add_argument("--fc", default="256")
    p.add_argument("--workers", type=int, default=2, help="1-thread CPU workers, each on a host of its own")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
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
        write_outputs(os.path.dirname(os.path.abspath(args.render)), saved)
        return 0
    kinds = [k.strip() for k in args.rows.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in ROW_KINDS]
    if unknown:
        p.error(f"--rows: unknown {unknown}, expected some of {', '.join(ROW_KINDS)}")
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
              "workers": args.workers, "conv": args.conv, "fc": args.fc, "rows": []}
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
        print(f"[baseline] local, batch {args.batch_size} ...", flush=True)
        with C.ForeignLoad() as load:
            base = C.run_in_subprocess({**common, "tag": "local", "set": "local", "devices": ["cpu"],
                                        "local": True, "pin": [0], "split": "equal"})
        base.update(kind="local", rate="in-process", foreign_load_cores=load.cores)
        print(f"    -> {C.fmt_row(base)}", flush=True)
        rows.append(base)
        if args.wire_cpu and any(k != "ddp" for k in kinds):
            # once, unshaped: the most bytes in the probe's time, so the cost stands well above the
            # host's noise (at 100 Mbit/s it would be a few tenths of a second's difference)
            print("[unshaped] the wire's CPU on the workers' cores ...", flush=True)
            wire_cpu = measure_wire_cpu(switch, log=lambda msg: print(f"    | {msg}", flush=True))
            result["wire_cpu"] = wire_cpu
            common = {**common, "wire_cpu_s_per_byte": wire_cpu["host_cpu_s_per_byte"]}
            print(f"    -> {wire_cpu['host_cpu_s_per_byte'] * 1e9:.2f} ns a byte "
                  f"({wire_cpu['lost_s']:.3f} s of compute lost to {wire_cpu['bytes'] / 1e6:.0f} MB)", flush=True)
        for rate in [r.strip() for r in args.rates.split(",") if r.strip()]:
            switch.shape(rate)
            for kind in kinds:
                print(f"[{rate}] {kind}, {args.workers} workers ...", flush=True)
                row = run_ddp(switch, rate, args, common) if kind == "ddp" else run_hetconv(switch, kind, rate, args, common)
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
        write_outputs(args.out, result)
    return 0


def repredict(path, wire_cpu_ns=None):
    """The saved rows against this version's model: what a model change does to a measured run,
    without measuring again (the host's speed that day stays in both the steps and the profiles)."""
    from hetconv.engine import costmodel as cm
    from hetconv.geometry import IMAGE_SHAPE, conv_specs
    from hetconv.transport.wire import value_bytes
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        print(f"--repredict {path}: cannot read it as JSON: {e}", file=sys.stderr)
        return 2
    rows = [r for r in saved.get("rows", []) if r.get("ok") and r.get("profiles") and "prediction" in r] \
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
        if r.get("kind") == "local":
            profile = cm.DeviceProfile.from_json(r["profiles"]["local"])
            new = cm.predict_local(specs, r["batch_size"], profile, coordinator_s)
        else:
            profiles = {w: cm.DeviceProfile.from_json(p) for w, p in r["profiles"].items()}
            link = C.model_link(r["rate"], "tbf", wire_cpu_ns * 1e-9)
            new = cm.predict_any(r["exchange"], specs, IMAGE_SHAPE, r["batch_size"], r["counts"], profiles, link,
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
    return C.fmt_row(row)


def write_outputs(out_dir, result):
    rows = result["rows"]
    base = next((r for r in rows if r.get("kind") == "local"), None)
    for r in rows:
        if r.get("ok") and base and base.get("ok"):
            r["speedup"] = base["step_s"] / r["step_s"]
            if "predicted_step_s" in r:
                r["predicted_speedup"] = base["predicted_step_s"] / r["predicted_step_s"]
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bandwidth.json"), "w") as f:
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
    with open(os.path.join(out_dir, "bandwidth.md"), "w") as f:
        f.write(text)
    print("\n" + text)
    try:
        plot(out_dir, result)
    except ImportError as e:
        print(f"no plot: {e}")


def plot(out_dir, result):
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
    fig.savefig(os.path.join(out_dir, "bandwidth.png"), dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
