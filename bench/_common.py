"""Helpers shared by the bench/ scripts: a clean BLAS environment, machine facts, timing, output.

Import this module before numpy, and call `reexec_without_blas_overrides()` first thing: it may
replace the process, which only works while nothing heavy has been loaded yet.
"""
import json
import os
import platform
import statistics
import sys
import time

# Some images set these for an older OpenBLAS; a current numpy's OpenBLAS then picks a slower
# kernel (or a wrong cache size). Only the benchmark process drops them; the product never does.
BLAS_OVERRIDES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
_DROPPED_MARK = "HETCONV_BENCH_DROPPED_BLAS_ENV"


def add_digits_run_flags(p, net, lr, spawn_help="the workers, as hetconv-coordinator --spawn"):
    """The flags of a benchmark that trains on the real digits over several seeds (accuracy.py,
    bf16_accuracy.py): the data, the network, the workers, the recipe's batch, epochs, lr and
    momentum, and the seeds."""
    p.add_argument("--data", default=os.path.join(REPO, "tests", "data", "digits"),
                   help="the data set (default: the digits in tests/data/digits, 1437 train / 360 test)")
    p.add_argument("--net", default=net)
    p.add_argument("--spawn", default="cpu:1,cpu:1", help=spawn_help)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1; the medians over them are compared")


def reexec_without_blas_overrides(keep=False):
    """Re-exec this script once with BLAS_OVERRIDES unset; returns a line saying what happened."""
    present = {k: os.environ[k] for k in BLAS_OVERRIDES if k in os.environ}
    if present and not keep:
        assert "numpy" not in sys.modules, "call reexec_without_blas_overrides() before importing numpy"
        env = {k: v for k, v in os.environ.items() if k not in BLAS_OVERRIDES}
        env[_DROPPED_MARK] = " ".join(f"{k}={v}" for k, v in present.items())
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, os.path.abspath(sys.argv[0]), *sys.argv[1:]], env)
    # hetconv's CPU device sets OMP_WAIT_POLICY=PASSIVE where it is unset (Numba's OpenMP threads
    # otherwise spin on the BLAS threads' cores); PyTorch in the same process reads it too
    omp = f"; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'PASSIVE (set by hetconv)')}"
    if os.environ.get(_DROPPED_MARK):
        return f"re-executed without {os.environ[_DROPPED_MARK]} (benchmark process only){omp}"
    if present:
        return f"kept {' '.join(f'{k}={v}' for k, v in present.items())} (--keep-blas-env){omp}"
    return f"{' and '.join(BLAS_OVERRIDES)} not set{omp}"


def cpu_model():
    """'AMD EPYC (family 25 model 17), 2 cores' from /proc/cpuinfo where there is one."""
    from hetconv.devices.wisdom import cpuinfo_fields    # here: this module loads before numpy
    fields = cpuinfo_fields()
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields:
        name += f" (family {fields['cpu family']} model {fields.get('model', '?')})"
    flags = fields.get("flags", "").split()
    simd = "avx512f" if "avx512f" in flags else "avx2" if "avx2" in flags else None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name}, {cores} cores" + (f", {simd}" if simd else "")


ISA_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile")


def cpu_isa_flags():
    """The SIMD flags of /proc/cpuinfo that decide which BLAS and oneDNN kernels run."""
    from hetconv.devices.wisdom import cpuinfo_fields
    present = set(cpuinfo_fields().get("flags", "").split())
    return [flag for flag in ISA_FLAGS if flag in present]


def relative_path(path):
    """`path` relative to the repository root (the parent of bench/), for results files."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.relpath(os.path.abspath(path), root)


def blas_info():
    """One line per BLAS library loaded, from threadpoolctl (the kernel OpenBLAS actually picked)."""
    from threadpoolctl import threadpool_info
    return [f"{i.get('internal_api')} {i.get('version')} architecture={i.get('architecture')} "
            f"num_threads={i.get('num_threads')} ({os.path.basename(i.get('filepath', ''))})"
            for i in threadpool_info() if i.get("user_api") == "blas"]


def torch_info(torch):
    """torch's version, the key lines of its parallel config and whether oneDNN (mkldnn) is on."""
    keys = ("get_num_threads", "OpenMP", "Math Kernel", "MKL-DNN", "parallel backend")
    parallel = [s.strip() for s in torch.__config__.parallel_info().splitlines() if any(k in s for k in keys)]
    return [f"torch {torch.__version__}, mkldnn available={torch.backends.mkldnn.is_available()} "
            f"enabled={torch.backends.mkldnn.enabled}", *parallel]


def load_average():
    try:
        return "load average " + " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "load average unknown"


def time_interleaved(cases, min_reps, max_reps, budget_s, burn_in=1):
    """Time several cases round-robin, so a noisy neighbour hurts them alike.

    `cases` maps a name to a callable that runs one step and returns {phase: seconds}. Each case
    runs `burn_in` times untimed (JIT, caches, allocator), then rounds continue until every case
    has `min_reps` samples and `budget_s` has passed, or `max_reps` rounds. The order alternates
    each round. Returns {name: {phase: [seconds, ...]}}.
    """
    names = list(cases)
    for _ in range(burn_in):
        for name in names:
            cases[name]()
    samples = {name: {} for name in names}
    start = time.perf_counter()
    for rep in range(max_reps):
        if rep >= min_reps and time.perf_counter() - start > budget_s:
            break
        for name in (names if rep % 2 == 0 else names[::-1]):
            for phase, seconds in cases[name]().items():
                samples[name].setdefault(phase, []).append(seconds)
    return samples


def summarize(seconds):
    """median and min in ms, and the spread (max - min) / median of the samples."""
    med = statistics.median(seconds)
    return {"median_ms": med * 1e3, "min_ms": min(seconds) * 1e3,
            "spread": (max(seconds) - min(seconds)) / med if med > 0 else 0.0,
            "samples_ms": [round(s * 1e3, 3) for s in seconds]}


def markdown_table(headers, rows):
    """rows: lists of already formatted cells."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(out_dir, stem, rows, markdown):
    """OUT/<stem>.json (the rows: a list, or an object holding them with the run's facts) and
    OUT/<stem>.md; returns both paths."""
    os.makedirs(out_dir, exist_ok=True)
    json_path, md_path = os.path.join(out_dir, f"{stem}.json"), os.path.join(out_dir, f"{stem}.md")
    for path, text in ((json_path, json.dumps(rows, indent=1) + "\n"), (md_path, markdown + "\n")):
        write_text(path, text)
    return json_path, md_path


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def recorded_command(script, argv):
    """The command as typed, with paths inside the repository made relative to it, so a results
    file names a command that works from any checkout."""
    def relative(arg):
        path = os.path.abspath(arg) if os.path.exists(arg) or os.sep in arg else ""
        if path and (path == REPO or path.startswith(REPO + os.sep)):
            return os.path.relpath(path, REPO)
        return arg
    return " ".join(["python", f"bench/{script}", *map(relative, argv)])


def write_text(path, text):
    """Write `text` to `path` through a temporary file, so a reader never sees half a file."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def render_saved(json_path, stem, render):
    """`--render OUT/<stem>.json`: rewrite OUT/<stem>.md from the saved JSON alone, without running
    anything, so a results table is always exactly its JSON's rendering. Returns the .md path."""
    with open(json_path) as f:
        doc = json.load(f)
    md_path = os.path.join(os.path.dirname(os.path.abspath(json_path)), f"{stem}.md")
    write_text(md_path, render(doc).rstrip("\n") + "\n")
    return md_path


def plot_saved(json_path, plot):
    """plot(out_dir, rows, machine) from a saved results JSON, into the folder beside it; says so
    and goes on where matplotlib is missing (the .md does not need it)."""
    with open(json_path) as f:
        doc = json.load(f)
    try:
        plot(os.path.dirname(os.path.abspath(json_path)), doc["rows"], doc["machine"])
    except ImportError as e:
        print(f"no plots: {e} (pip install matplotlib)")


def run_facts(script, argv, started, load_start):
    """What every results file records of its run: the command, the machine (CPU, ISA, BLAS kernel),
    the wall time since `started` (time.time()) and the load at start and end."""
    return {"command": recorded_command(script, argv), "machine": cpu_model(), "isa": " ".join(cpu_isa_flags()),
            "blas": "; ".join(blas_info()), "wall_s": time.time() - started,
            "load": {"start": load_start, "end": load_average()}}


def save_outputs(out_dir, stem, doc, markdown, plot=None):
    """OUT/<stem>.json holds `doc`, as the run recorded it; the .md and the plots are rendered from
    that file, never from anything else."""
    json_path = os.path.join(out_dir, f"{stem}.json")
    write_text(json_path, json.dumps(doc, indent=1))
    print("\n" + markdown(doc))
    if plot is None:
        print(f"wrote {render_saved(json_path, stem, markdown)}")
    else:
        rerender(json_path, stem, markdown, plot)


def save_run(out_dir, stem, doc, started, markdown):
    """A run's outputs so far (after every round, and at its end): its wall time since `started`
    and the load at the end into `doc`, then save_outputs."""
    os.makedirs(out_dir, exist_ok=True)
    doc["wall_s"] = time.time() - started
    doc["load"]["end"] = load_average()
    save_outputs(out_dir, stem, doc, markdown)


def save_or_print(out_dir, stem, doc, markdown):
    """save_outputs into `out_dir` (made if missing), or, without one, only print the markdown."""
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        save_outputs(out_dir, stem, doc, markdown)
    else:
        print(markdown(doc))


def rerender(json_path, stem, markdown, plot):
    """--render: the .md (and the plots, where matplotlib is installed) beside a saved JSON."""
    print(f"wrote {render_saved(json_path, stem, markdown)}")
    plot_saved(json_path, plot)


def run_header(doc):
    """The lines above a results table: machine, command, wall time and, where recorded, the load."""
    lines = [f"Machine: {doc['machine']}. Command: `{doc['command']}` ({doc['wall_s'] / 60:.1f} min).", ""]
    load = doc.get("load")
    if load:
        lines += [f"Whole run: {load['start']} at start, {load['end']} at end; foreign load below is per row.", ""]
    return lines


def train_on_spawned_workers(cfg, spawn, precision="fp32", **train_kwargs):
    """`cfg` trained on the workers `spawn` names (a --spawn text, started as the CLI starts them,
    their conv GEMMs in `precision`), its metrics at cfg.metrics -> (train()'s summary, wall
    seconds, the run's eval records, its first plan record, its step records)."""
    from hetconv.coordinator.remote import RemoteEngine
    from hetconv.devices import parse_device_list
    from hetconv.devices.cpu_options import CpuOptions
    from hetconv.training.loop import train
    labels = [e.label for e in parse_device_list("--spawn", spawn) for _ in range(e.count)]
    lines = []
    engine = RemoteEngine("tcp://127.0.0.1:0", 0, labels, threads=cfg.threads, log=lines.append,
                          exchange=cfg.exchange, wire=cfg.wire_dtype,
                          cpu=CpuOptions(conv_path=cfg.cpu_conv_path, precision=precision, use_wisdom=True))
    t0 = time.perf_counter()
    try:
        summary = train(cfg, engine, log=lines.append, **train_kwargs)
    finally:
        engine.close()
    wall = time.perf_counter() - t0
    with open(cfg.metrics) as f:
        records = [json.loads(line) for line in f]
    return (summary, wall, [r for r in records if r["event"] == "eval"],
            next(r for r in records if r["event"] == "plan"), [r for r in records if r["event"] == "step"])


class PhotoFiles:
    """Files and labels as a map-style data set, each opened as torchvision's ImageFolder does."""

    def __init__(self, files, labels, transform):
        self.files, self.labels, self.transform = files, labels, transform

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        from PIL import Image
        with open(self.files[i], "rb") as f:
            image = Image.open(f).convert("RGB")
        return self.transform(image), int(self.labels[i])
