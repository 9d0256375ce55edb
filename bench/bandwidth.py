"""The paper's bandwidth study: speedup against the coordinator's link bandwidth, measured over a
shaped virtual link and predicted by the cost model.

    sudo python bench/bandwidth.py --out bench/results                 # 100mbit, 1gbit, 10gbit, unshaped
    sudo python bench/bandwidth.py --rates 100mbit,1gbit --batch-size 32 --steps 2

Set-up (made here, removed in a finally, on Ctrl-C and SIGTERM too): a network namespace
`hetconv-bench-<pid>` holding the workers, joined to the root namespace by a veth pair
`hcb<pid>a` (root side, 10.213.N.1) / `hcb<pid>b` (in the namespace, 10.213.N.2). The coordinator
binds 10.213.N.1, so every byte between it and the workers crosses the veth pair; both ends carry a
tbf qdisc at the rate under test, so both directions are shaped, and all workers share the one
link as the cost model assumes. The single-device baseline runs once, in-process on one pinned
core, as in bench/speedup.py. Needs root and iproute2 (ip, tc); without them it says so and exits 0.

Writes OUT/bandwidth.json, OUT/bandwidth.md and OUT/bandwidth.png.
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


def sh(*cmd, check=True):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip()}")
    return r


def missing_requirements():
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (network namespaces, veth links and tc qdiscs)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs iproute2: `{tool}` is not on PATH"
    return None


class Testbed:
    """One namespace + one veth pair, unique to this process; `shape(rate)` puts tbf on both ends."""

    def __init__(self):
        pid = os.getpid()
        self.ns = f"hetconv-bench-{pid}"
        self.veth, self.peer = f"hcb{pid}a", f"hcb{pid}b"          # interface names: at most 15 chars
        self.subnet = f"10.213.{pid % 250 + 1}"
        self.host, self.remote = f"{self.subnet}.1", f"{self.subnet}.2"
        self.made = []

    def __enter__(self):
        try:
            sh("ip", "netns", "add", self.ns)
            self.made.append("ns")
            sh("ip", "link", "add", self.veth, "type", "veth", "peer", "name", self.peer)
            self.made.append("veth")
            sh("ip", "link", "set", self.peer, "netns", self.ns)
            sh("ip", "addr", "add", f"{self.host}/24", "dev", self.veth)
            sh("ip", "link", "set", self.veth, "up")
            self.exec_ns("ip", "addr", "add", f"{self.remote}/24", "dev", self.peer)
            self.exec_ns("ip", "link", "set", self.peer, "up")
            self.exec_ns("ip", "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def exec_ns(self, *cmd):
        return sh("ip", "netns", "exec", self.ns, *cmd)

    def shape(self, rate):
        """tbf at `rate` on both ends (None: remove shaping). burst >= rate/HZ for tbf to reach
        its rate, and >= 64 KiB for one GSO segment; 100 ms of queue before it drops."""
        for prefix in ([], ["ip", "netns", "exec", self.ns]):
            dev = self.peer if prefix else self.veth
            sh(*prefix, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            if rate:
                per_s = rate_bytes_per_s(rate)
                burst = int(max(256 * 1024, per_s * 0.01))
                sh(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                   "burst", str(burst), "latency", "100ms")

    def __exit__(self, *exc):
        if "veth" in self.made:
            sh("ip", "link", "del", self.veth, check=False)        # takes its peer with it
        if "ns" in self.made:
            sh("ip", "netns", "del", self.ns, check=False)
        self.made = []


def rate_bytes_per_s(rate):
    from hetconv.costmodel import parse_bandwidth
    return parse_bandwidth(rate).bytes_per_s


def free_port(host):
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_workers(bed, address, n):
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    procs = []
    for i in range(n):
        cmd = ["ip", "netns", "exec", bed.ns, sys.executable, "-m", "hetconv.worker", "--device", "cpu",
               "--connect", address, "--threads", "1", "--cores", str(i % len(os.sched_getaffinity(0))),
               "--name", f"ns-w{i}", "--connect-timeout", "180", "--idle-timeout", "600"]
        procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
    return procs


def stop_workers(procs):
    for p in procs:
        try:
            p.wait(timeout=5)                 # the coordinator's SHUTDOWN normally ends them
        except subprocess.TimeoutExpired:
            C._kill_group(p)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--rates", default="10gbit,1gbit,100mbit", help="tc rates to test (an unshaped row is added)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2, help="1-thread CPU workers in the namespace")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--runs-dir", default="", help="keep each run's metrics JSON lines here (default: a temp dir)")
    p.add_argument("--render", default="", metavar="JSON",
                   help="run nothing: rewrite bandwidth.md (and the plot) beside a saved bandwidth.json")
    args = p.parse_args(argv)
    if args.render:
        _common.rerender(args.render, "bandwidth", markdown, plot)
        return 0
    why = missing_requirements()
    if why:
        print(f"bench/bandwidth.py: skipped: {why}")
        return 0
    os.makedirs(args.out, exist_ok=True)
    scratch = args.runs_dir or tempfile.mkdtemp(prefix="hetconv-bandwidth-")
    os.makedirs(scratch, exist_ok=True)
    print(f"per-run metrics and rows: {scratch}", flush=True)
    # SIGTERM ends the run like Ctrl-C, so the finally below still removes the namespace
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(143)))
    machine = C.machine()
    command = _common.recorded_command("bandwidth.py", argv if argv is not None else sys.argv[1:])
    load_start = _common.load_average()
    common = {"batch_size": args.batch_size, "warmup": args.warmup, "steps": args.steps, "out_dir": scratch,
              "split": "proportional"}
    rows, workers = [], []
    t_all = time.perf_counter()
    bed = Testbed()
    try:
        bed.__enter__()
    except RuntimeError as e:               # root, but no CAP_NET_ADMIN (a container) or no netns support
        print(f"bench/bandwidth.py: skipped: cannot set up a network namespace: {e}")
        return 0
    try:
        print(f"machine: {machine}\nnamespace {bed.ns}, veth {bed.veth} ({bed.host}) <-> {bed.peer} ({bed.remote})",
              flush=True)
        print(f"[baseline] local, batch {args.batch_size} ...", flush=True)
        with C.ForeignLoad() as load:
            base = C.run_in_subprocess({**common, "tag": "local", "set": "local", "devices": ["cpu"],
                                        "local": True, "pin": [0], "split": "equal"})
        base.update(rate="in-process", foreign_load_cores=load.cores)
        print(f"    -> {C.fmt_row(base)}", flush=True)
        rows.append(base)
        for rate in [None] + [r.strip() for r in args.rates.split(",") if r.strip()]:
            bed.shape(rate)
            label = rate or "unshaped veth"
            port = free_port(bed.host)
            address = f"tcp://{bed.host}:{port}"
            print(f"[{label}] {args.workers} workers in {bed.ns} -> coordinator {address} ...", flush=True)
            workers = start_workers(bed, address, args.workers)
            spec = {**common, "tag": f"bw-{label.split()[0]}", "set": f"{args.workers} workers over {label}",
                    "devices": ["cpu"] * args.workers, "bind": address, "external": args.workers,
                    "link": rate or "loopback", "connect_timeout": 180.0}
            with C.ForeignLoad() as load:         # workers reaped inside: their CPU time is ours
                row = C.run_in_subprocess(spec)
                stop_workers(workers)
                workers = []
            row.update(rate=label, foreign_load_cores=load.cores)
            rows.append(row)
            print(f"    -> {C.fmt_row(row)}", flush=True)
    except KeyboardInterrupt:
        print("interrupted: cleaning up, writing the rows measured so far", file=sys.stderr)
    finally:
        for w in workers:
            C._kill_group(w)
        bed.__exit__()
        print(f"removed namespace {bed.ns} and link {bed.veth}", flush=True)
        add_speedups(rows)
        doc = {"machine": machine, "command": command, "wall_s": time.perf_counter() - t_all,
               "load": {"start": load_start, "end": _common.load_average()}, "rows": rows}
        _common.save_outputs(args.out, "bandwidth", doc, markdown, plot)
    return 0


def add_speedups(rows):
    base = next((r for r in rows if r.get("local") or r.get("rate") == "in-process"), None)
    for r in rows:
        if r.get("ok") and base and base.get("ok"):
            r["speedup"] = base["step_s"] / r["step_s"]
            r["predicted_speedup"] = base["predicted_step_s"] / r["predicted_step_s"]


def markdown(doc):
    """bandwidth.md, from bandwidth.json's contents alone."""
    lines = _common.run_header(doc) + [
        "| link | batch | step s | predicted s | model error | speedup | predicted speedup | "
        "MB per step (all workers, both ways) | wire s (max worker) | foreign load |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in doc["rows"]:
        if not r.get("ok"):
            lines.append(f"| {r.get('rate')} | {r.get('batch_size')} | failed: {r.get('error', '?')} |")
            continue
        ws = r.get("workers") or {}
        mb = sum(m["sent"] + m["recv"] for m in ws.values()) / 1e6
        wire = max((m["wire_s"] for m in ws.values()), default=0.0)
        lines.append(f"| {r['rate']} | {r['batch_size']} | {r['step_s']:.3f} | {r['predicted_step_s']:.3f} | "
                     f"{r['model_error_pct']:+.1f}% | {r.get('speedup', float('nan')):.2f}x | "
                     f"{r.get('predicted_speedup', float('nan')):.2f}x | {mb:.1f} | {wire:.3f} | "
                     f"{r.get('foreign_load_cores', 0):.2f} |")
    return "\n".join(lines) + "\n"


def plot(out_dir, rows, machine):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from hetconv.costmodel import parse_bandwidth
    shaped = [r for r in rows if r.get("ok") and "speedup" in r and r["rate"] not in ("in-process", "unshaped veth")]
    if not shaped:
        return
    bits = [parse_bandwidth(r["rate"]).bytes_per_s * 8 for r in shaped]
    order = sorted(range(len(shaped)), key=lambda i: bits[i])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([bits[i] for i in order], [shaped[i]["speedup"] for i in order], "o-", label="measured")
    ax.plot([bits[i] for i in order], [shaped[i]["predicted_speedup"] for i in order], "s--", mfc="none",
            label="cost model")
    n = len(shaped[0]["devices"])
    ax.axhline(n, color="k", lw=1, ls=":", label=f"ideal ({n} devices)")
    ax.set_xscale("log")
    ax.set_xlabel("link bandwidth (bit/s, tbf both directions)")
    ax.set_ylabel("speedup over local (1 thread)")
    ax.set_title(f"speedup vs bandwidth, batch {shaped[0]['batch_size']}\n{machine}", fontsize=9)
    ax.grid(alpha=.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "bandwidth.png"), dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
