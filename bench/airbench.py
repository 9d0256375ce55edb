"""airbench94's training step: hetconv on one device, hetconv on two workers and PyTorch, in
alternating rounds on this host, and the BatchNorm sums the two workers exchange.

    python bench/airbench.py --out bench/results/bn                   # batch 256, until 3 quiet rounds
    python bench/airbench.py --batch-size 64 --width 0.5 --out DIR     # a smaller step
    python bench/airbench.py --render bench/results/bn/airbench.json   # rewrite airbench.md from the JSON only

The network is the `airbench94` preset (Keller Jordan's CIFAR-10 speed-record net: conv 2x2 24,
GELU, three blocks of conv, max-pool, BatchNorm, GELU, conv, BatchNorm, GELU at widths 64, 256,
256, max-pool 3, a bias-free linear, x/9; `--width` scales it) on the built-in synthetic
CIFAR-shaped set. Configurations, each in a fresh process per round:

  hetconv local    hetconv-coordinator --local --threads 2
  hetconv 2 workers  hetconv-coordinator --spawn cpu:1,cpu:1 (--parallel auto, auto micro-batches),
                   the workers pinned to one core each
  PyTorch (NCHW), PyTorch (channels_last)
                   the same nn.Sequential (hetconv.net.torch_import.to_torch) from hetconv's start,
                   torch.set_num_threads(2), forward + backward + SGD on the same batches, in both
                   memory layouts as PyTorch's CPU guidance tunes a conv network (channels_last: the
                   module's parameters and each batch in channels-last memory, the batch converted
                   inside the timed step); ratios to PyTorch take its faster layout (the least
                   median over the rounds a table covers), which the table names

The recipe is hetconv's default SGD (lr 0.01, momentum 0.9, weight decay 5e-4 except biases) on
both sides. hetconv's rebalancing is off (--rebalance-after 0): the split under test is the
calibrated one. A round runs every configuration once, its order rotated by one each round, so a
change in the host's load falls on all of them alike. Step time: the median of the timed steps
after the warm-up steps (a CPU device times its conv paths on the first call of each shape, in the
warm-up). Ratios are taken within a round, medians over rounds.

The host is shared: a round is quiet when, during each of its runs, other processes used at most
--max-foreign cores (CPU time from /proc/stat less this run's own). Rounds go on until
--quiet-rounds of them were quiet, or --rounds were run, or the next would end past --budget-min.
The first table is of the quiet rounds, the second of every round.

BatchNorm traffic: each two-worker run's metrics give every step's bytes each worker sent to its
peers (`peer_bytes_sent`, whole messages: header and arrays). From the run's plan, the script
computes what the data-parallel layers' sums must cost: per BatchNorm of a data-mode layer with C
channels, one message to each peer forward (sum, sum of squares) and one backward (sum dy, sum
dy*x_hat), each 2C + 1 float64 (the count last), packed with the worker's own header
(hetconv.transport.protocol.pack); and the same for the layer's weight-gradient sums (dW and db,
float32, one message to each peer). What is left is feature maps and their gradients.

Writes OUT/airbench.json (every run's steps, per-worker bytes, plan, machine, load) and
OUT/airbench.md, rendered from the JSON alone.
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402
import _speedup_common as C  # noqa: E402
import _torch_twin  # noqa: E402

TORCH = "PyTorch"
CONFIGS = ("hetconv local", "hetconv 2 workers",
           *(_torch_twin.layout_config(TORCH, layout) for layout in _torch_twin.LAYOUTS))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--width", type=float, default=1.0, help="airbench94@WIDTH (1: the published widths)")
    p.add_argument("--warmup", type=int, default=2, help="steps discarded before timing (>= 1)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per run")
    p.add_argument("--rounds", type=int, default=10, help="rounds at most (at least 2 are run)")
    p.add_argument("--quiet-rounds", type=int, default=3, help="stop once this many rounds were quiet")
    p.add_argument("--max-foreign", type=float, default=0.3,
                   help="a round is quiet when no run of it saw other processes use more cores than this")
    p.add_argument("--budget-min", type=float, default=25.0,
                   help="start no further round (after 2) that the mean round so far would take past this")
    p.add_argument("--threads", type=int, default=2, help="--local's threads and PyTorch's")
    p.add_argument("--spawn", default="cpu:1,cpu:1", help="the distributed row's workers")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take before it is ended")
    p.add_argument("--out", default="", help="folder for airbench.json and .md (default: print only)")
    p.add_argument("--render", default="", help="rewrite the .md beside a saved airbench.json")
    p.add_argument("--torch-run", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)   # the PyTorch child
    return p.parse_args(argv)


def net_name(args):
    return "airbench94" if args.width == 1 else f"airbench94@{args.width:g}"


def hetconv_argv(args, config, metrics):
    """hetconv-coordinator's arguments for one run."""
    steps = args.warmup + args.steps
    where = ["--local", "--threads", str(args.threads)] if config == "hetconv local" else ["--spawn", args.spawn]
    return [*where, "--net", net_name(args), "--batch-size", str(args.batch_size), "--steps", str(steps),
            "--synthetic-train", str(args.batch_size * steps), "--synthetic-test", str(args.batch_size),
            "--eval-batches", "1", "--rebalance-after", "0", "--metrics", metrics]


def run_hetconv(args, config, scratch, tag):
    """One hetconv-coordinator run in its own process group; -> a row from its metrics."""
    metrics = os.path.join(scratch, f"metrics-{tag}.jsonl")
    argv = hetconv_argv(args, config, metrics)
    log = os.path.join(scratch, f"log-{tag}.txt")
    row = {"command": "hetconv-coordinator " + " ".join(a if a != metrics else "RUN.jsonl" for a in argv)}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "hetconv.cli.coordinator", *argv], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if proc.poll() is None:
                C._kill_group(proc)
    if proc.returncode != 0:
        with open(log) as f:
            tail = f.read().strip().splitlines()[-3:]
        return {**row, "ok": False, "error": f"exit code {proc.returncode}: {' / '.join(tail)}"}
    with open(metrics) as f:
        records = [json.loads(line) for line in f]
    return {**row, **row_from_metrics(records, args.warmup)}


def row_from_metrics(records, warmup):
    """A run's row from its metrics records: the timed steps after `warmup`, and where workers ran,
    the plan, the network and every timed step's per-worker bytes and seconds."""
    steps = [r for r in records if r["event"] == "step"]
    timed = steps[warmup:]
    row = {"ok": True, "step_s_all": [r["step_s"] for r in timed],
           "warmup_step_s": [r["step_s"] for r in steps[:warmup]],
           "step_s": statistics.median(r["step_s"] for r in timed)}
    plan = next(r for r in records if r["event"] == "plan")
    if len(plan["workers"]) > 1:
        row["plan"] = {k: plan[k] for k in ("workers", "layers", "mode_choice", "micro_choice") if k in plan}
        row["network"] = next(r for r in records if r["event"] == "config")["network"]
        row["workers"] = {name: {key: [r["workers"][name].get(key, 0) for r in timed]
                                 for key in ("peer_bytes_sent", "bytes_sent", "bytes_recv", "compute_s", "roundtrip_s")}
                          for name in timed[0]["workers"]}
        row["steps"] = [r["step"] for r in timed]
    return row


def run_torch(args, scratch, tag, layout):
    """The PyTorch run in a fresh process (this script's --torch-run), in memory `layout`; -> its row."""
    out = os.path.join(scratch, f"torch-{tag}.json")
    spec = {"net": net_name(args), "batch_size": args.batch_size, "warmup": args.warmup, "steps": args.steps,
            "threads": args.threads, "layout": layout}
    n = str(args.threads)
    env = dict(os.environ, OMP_NUM_THREADS=n, MKL_NUM_THREADS=n, OPENBLAS_NUM_THREADS=n)
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--torch-run", json.dumps(spec), out],
                            env=env, start_new_session=True)
    try:
        proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if proc.poll() is None:
            C._kill_group(proc)
    if not os.path.exists(out):
        return {"ok": False, "error": f"the PyTorch run exited with code {proc.returncode} and wrote no row"}
    with open(out) as f:
        return json.load(f)


def torch_child(spec_text, out):
    """PyTorch's steps: the network hetconv builds, from hetconv's start, on hetconv's batches."""
    omp_wait_policy = os.environ.get("OMP_WAIT_POLICY", "unset")     # as torch's OpenMP runtime starts with it
    import numpy as np
    import torch
    from hetconv.data import batches, load_dataset
    from hetconv.net.torch_import import to_torch
    from hetconv.training.config import Config
    from hetconv.training.loop import network_for
    spec = json.loads(spec_text)
    torch.set_num_threads(spec["threads"])
    total = spec["warmup"] + spec["steps"]
    cfg = Config(net=spec["net"], batch_size=spec["batch_size"], steps=total,
                 synthetic_train=spec["batch_size"] * total, synthetic_test=spec["batch_size"]).validate()
    ds = load_dataset("synthetic", seed=cfg.seed, n_train=cfg.synthetic_train, n_test=cfg.synthetic_test)
    net = network_for(cfg, ds).spec
    layout = spec.get("layout", "NCHW")
    module, _ = _torch_twin.in_layout(torch, layout, to_torch(net, *_torch_twin.initial_weights(cfg, net)))
    module.train()
    opt = _torch_twin.sgd(torch, module, cfg)
    step_s = []
    for x, y in batches(ds, cfg.batch_size, np.random.default_rng([cfg.seed, 0])):
        t0 = time.perf_counter()
        (x,) = _torch_twin.in_layout(torch, layout, None, [torch.from_numpy(x)])[1]
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(module(x), torch.from_numpy(y))
        loss.backward()
        opt.step()
        step_s.append(time.perf_counter() - t0)
    timed = step_s[spec["warmup"]:]
    row = {"ok": True, "step_s": statistics.median(timed), "step_s_all": timed,
           "warmup_step_s": step_s[:spec["warmup"]], "final_loss": float(loss.item()),
           "torch": "; ".join(_common.torch_info(torch)), "omp_wait_policy": omp_wait_policy, "layout": layout}
    _common.write_text(out, json.dumps(row))


# ---- what the plan says the BatchNorm and weight-gradient sums cost ------------------------------

def message_bytes(array, step, phase, layer, index, sender):
    """Bytes of one peer SLICE carrying `array`, header included, as a worker packs it."""
    from hetconv.transport import protocol
    frames = protocol.pack("SLICE", 0, [array], step=step, phase=phase, layer=layer, micro=index, sender=sender)
    return sum(len(f) for f in frames)


def sums_bytes(network, plan, worker, step):
    """Per step, what `worker` sends its peers for the data-mode layers of `plan`: {"batchnorm":
    bytes, "batchnorm_arrays": those bytes less the headers, "weights": bytes, "batchnorms": how
    many}. Per BatchNorm, a forward and a backward message to each peer; per layer, one message of
    its dW and db."""
    import numpy as np
    from hetconv.geometry import ConvSpec
    from hetconv.net import NetSpec
    net = NetSpec.from_json(network)
    specs = [ConvSpec.from_layer(layer) for layer in net.conv_layers()]
    peers = len(plan["workers"]) - 1
    out = {"batchnorm": 0, "batchnorm_arrays": 0, "weights": 0, "batchnorms": 0, "channels": []}
    for li, (spec, lp) in enumerate(zip(specs, plan["layers"])):
        if lp["mode"] != "data" or not peers:
            continue
        for index, op in enumerate(spec.tail):
            if op.type == "batchnorm":
                sums = np.zeros(2 * spec.kernels + 1, np.float64)
                out["batchnorm"] += peers * sum(message_bytes(sums, step, phase, li, index, worker)
                                                for phase in ("bn_forward", "bn_backward"))
                out["batchnorm_arrays"] += peers * 2 * sums.nbytes
                out["batchnorms"] += 1
                out["channels"].append(spec.kernels)
        flat = np.zeros(spec.kernels * spec.in_channels * spec.kh * spec.kw + spec.kernels, np.float32)
        out["weights"] += peers * message_bytes(flat, step, "dweights", li, 0, worker)
    return out


def traffic(row):
    """Per worker: measured peer bytes per step (median over the timed steps) beside the computed
    BatchNorm and weight-gradient sums of the same step."""
    out = {}
    for name, m in row["workers"].items():
        computed = [sums_bytes(row["network"], row["plan"], name, step) for step in row["steps"]]
        peer = m["peer_bytes_sent"]
        bn = [c["batchnorm"] for c in computed]
        weights = [c["weights"] for c in computed]
        out[name] = {"peer_bytes": statistics.median(peer), "batchnorm_bytes": statistics.median(bn),
                     "batchnorm_array_bytes": computed[0]["batchnorm_arrays"], "channels": computed[0]["channels"],
                     "weight_bytes": statistics.median(weights), "batchnorms": computed[0]["batchnorms"],
                     "rest_bytes": statistics.median(p - b - w for p, b, w in zip(peer, bn, weights)),
                     "to_worker_bytes": statistics.median(m["bytes_sent"]),
                     "from_worker_bytes": statistics.median(m["bytes_recv"])}
    return out


# ---- rounds ---------------------------------------------------------------------------------------

def main(argv):
    args = parse_args(argv)
    if args.torch_run:
        torch_child(*args.torch_run)
        return 0
    if args.render:
        print(f"wrote {_common.render_saved(args.render, 'airbench', markdown)}")
        return 0
    if args.warmup < 1:
        raise SystemExit("--warmup must be >= 1: the first step times the conv paths")
    started, load_start = time.time(), _common.load_average()
    import numpy  # noqa: F401  (loaded so that run_facts names the BLAS the hetconv rows load)
    scratch = tempfile.mkdtemp(prefix="hetconv-airbench-")
    doc = {**_common.run_facts("airbench.py", argv, started, load_start), "net": net_name(args),
           "batch_size": args.batch_size, "warmup": args.warmup, "steps": args.steps, "threads": args.threads,
           "spawn": args.spawn, "configs": list(CONFIGS), "max_foreign": args.max_foreign, "rows": [], "round_s": []}
    print(f"machine: {doc['machine']}; {load_start}; per-run files: {scratch}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(143)))
    try:
        for rnd in range(max(2, args.rounds)):
            elapsed = time.time() - started
            if rnd >= 2 and elapsed + statistics.mean(doc["round_s"]) > args.budget_min * 60:
                print(f"round {rnd}: would end past --budget-min {args.budget_min:g}: stopping", flush=True)
                break
            if rnd >= 2 and len(quiet_rounds(doc)) >= args.quiet_rounds:
                break
            t_round = time.time()
            order = CONFIGS[rnd % len(CONFIGS):] + CONFIGS[:rnd % len(CONFIGS)]
            for config in order:
                tag = f"r{rnd}-{config.replace(' ', '_')}"
                print(f"[round {rnd}] {config} ... ({_common.load_average()})", flush=True)
                with C.ForeignLoad() as load:
                    mode, layout = _torch_twin.layout_of(config)
                    row = (run_torch(args, scratch, tag, layout) if mode == TORCH
                           else run_hetconv(args, config, scratch, tag))
                row.update(config=config, round=rnd, foreign_load_cores=load.cores, load_after=_common.load_average())
                if row.get("ok") and "workers" in row:
                    row["traffic"] = traffic(row)
                doc["rows"].append(row)
                print(f"    -> {row_text(row)}; foreign load {load.cores:.2f} cores", flush=True)
            doc["round_s"].append(time.time() - t_round)
            save(args, doc, started)             # after every round: a stopped run keeps its rounds
    except KeyboardInterrupt:
        print("interrupted: writing the rows measured so far", file=sys.stderr)
    finally:
        save(args, doc, started, final=True)
    return 0 if doc["rows"] and all(r.get("ok") for r in doc["rows"]) else 1


def save(args, doc, started, final=False):
    doc.update(wall_s=time.time() - started)
    doc["load"]["end"] = _common.load_average()
    torch_row = next((r for r in doc["rows"] if r.get("torch")), None)
    if torch_row:
        doc["torch"], doc["omp_wait_policy"] = torch_row["torch"], torch_row["omp_wait_policy"]
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        _common.write_text(os.path.join(args.out, "airbench.json"), json.dumps(doc, indent=1))
        if final:
            print("\n" + markdown(doc))
            print(f"wrote {_common.render_saved(os.path.join(args.out, 'airbench.json'), 'airbench', markdown)}")
    elif final:
        print(markdown(doc))


def row_text(r):
    if not r.get("ok"):
        return f"FAILED: {r.get('error')}"
    text = (f"step {r['step_s']:.3f}s (timed {', '.join(f'{s:.2f}' for s in r['step_s_all'])}; warm-up "
            f"{', '.join(f'{s:.2f}' for s in r['warmup_step_s'])})")
    for name, t in (r.get("traffic") or {}).items():
        text += (f"; {name} sent peers {t['peer_bytes'] / 1e6:.3f} MB a step, BatchNorm sums "
                 f"{t['batchnorm_bytes']:.0f} B, weight sums {t['weight_bytes'] / 1e6:.3f} MB, "
                 f"rest {t['rest_bytes']:.0f} B")
    return text


# ---- the tables -----------------------------------------------------------------------------------

def torch_peer(rows):
    """The PyTorch row ratios take over `rows`: its faster layout, by the median over them (the
    one "PyTorch" row of results saved before both layouts ran); None without one."""
    configs = {r["config"] for r in rows if r.get("ok") and _torch_twin.layout_of(r["config"])[0] == TORCH}
    return _torch_twin.faster_layout({c: statistics.median(r["step_s"] for r in rows
                                                           if r["config"] == c and r.get("ok"))
                                      for c in configs}, TORCH)


def ratios(rows):
    """Per round, each configuration's step over PyTorch's (its faster layout over `rows`,
    torch_peer) and over hetconv local's (> 1: slower)."""
    out = {}
    peer = torch_peer(rows)
    for rnd in sorted({r["round"] for r in rows}):
        here = {r["config"]: r["step_s"] for r in rows if r["round"] == rnd and r.get("ok")}
        for config, s in here.items():
            out.setdefault(config, {"vs_torch": [], "vs_local": []})
            if peer in here:
                out[config]["vs_torch"].append(s / here[peer])
            if "hetconv local" in here:
                out[config]["vs_local"].append(s / here["hetconv local"])
    return out


def quiet_rounds(doc):
    """The rounds every run of which went well and saw at most doc["max_foreign"] foreign cores."""
    rounds = {}
    for r in doc["rows"]:
        rounds.setdefault(r["round"], []).append(r)
    return [rnd for rnd, rs in sorted(rounds.items())
            if len(rs) == len(doc["configs"]) and all(r.get("ok") and r["foreign_load_cores"] <= doc["max_foreign"]
                                                      for r in rs)]


def summary_table(doc, ok):
    """Per configuration over the rounds of `ok`: median step, each round's, and the ratios; and
    which PyTorch layout was the faster."""
    rat, peer = ratios(ok), torch_peer(ok)
    med = lambda values: (f"{statistics.median(values):.2f} (" + ", ".join(f"{v:.2f}" for v in values)  # noqa: E731
                          + ")") if values else "-"
    table = []
    for config in doc["configs"]:
        mine = [r for r in ok if r["config"] == config]
        if not mine:
            continue
        table.append([config, f"{statistics.median(r['step_s'] for r in mine):.3f}",
                      ", ".join(f"{r['step_s']:.3f}" for r in mine),
                      f"{doc['batch_size'] / statistics.median(r['step_s'] for r in mine):.0f}",
                      med(rat[config]["vs_torch"]), med(rat[config]["vs_local"])])
    medians = {c: statistics.median(r["step_s"] for r in ok if r["config"] == c)
               for c in {r["config"] for r in ok}}
    note = _torch_twin.layout_note(medians, TORCH)
    return _common.markdown_table(["configuration", "median step s", "rounds' step s", "images/s",
                                   f"step / {peer or TORCH}'s (per round)", "step / hetconv local's (per round)"],
                                  table) + (f"\n\nPyTorch's faster layout, which the ratios take: {note}."
                                            if note else "")


def markdown(doc):
    rows = doc["rows"]
    lines = _common.run_header(doc) + [
        f"ISA: {doc['isa']}. BLAS: {doc['blas']}. PyTorch: {doc.get('torch', '?')}.", "",
        f"`{doc['net']}` on the synthetic set (3x32x32, 10 classes), batch {doc['batch_size']}, hetconv's default "
        f"SGD on both sides; {doc['warmup']} warm-up step(s), then {doc['steps']} timed; step s = the median of the "
        f"timed steps. hetconv local: `--local --threads {doc['threads']}`; hetconv 2 workers: `--spawn "
        f"{doc['spawn']}`, `--parallel auto` and auto micro-batches (the plan below), workers pinned to a core "
        f"each; PyTorch: the same nn.Sequential from the same start, torch.set_num_threads({doc['threads']}) "
        f"(OMP_WAIT_POLICY {doc.get('omp_wait_policy', '?')} as it started)"
        + (", in each memory layout (NCHW; channels_last: the module and each batch in channels-last memory), "
           "ratios taking the faster" if any(_torch_twin.layout_of(c)[1] for c in doc["configs"]) else "")
        + ". Rebalancing off in every hetconv run. Ratios are taken within a round (> 1: slower than the row named), "
          "then the median over rounds.", ""]
    quiet = quiet_rounds(doc)
    ok = [r for r in rows if r.get("ok")]
    if quiet:
        lines += [f"Quiet rounds ({', '.join(map(str, quiet))}: other processes used at most {doc['max_foreign']:g} "
                  f"cores during each run of them):", ""]
        lines += [summary_table(doc, [r for r in ok if r["round"] in quiet]), ""]
    else:
        lines += [f"No round was quiet (other processes used more than {doc['max_foreign']:g} cores during some run "
                  f"of every round): every number below was measured with less than the cores it asked for.", ""]
    lines += [f"Every round ({len({r['round'] for r in rows})}):", "", summary_table(doc, ok)]
    lines += ["", "Every run, in the order they ran:", ""]
    lines.append(_common.markdown_table(
        ["round", "configuration", "step s", "timed steps s", "warm-up steps s", "foreign load (cores)", "load after"],
        [[r["round"], r["config"], f"{r['step_s']:.3f}" if r.get("ok") else f"failed: {r.get('error')}",
          ", ".join(f"{s:.3f}" for s in r.get("step_s_all", [])),
          ", ".join(f"{s:.2f}" for s in r.get("warmup_step_s", [])),
          f"{r['foreign_load_cores']:.2f}", r.get("load_after", "")] for r in rows]))
    dist = [r for r in ok if r.get("traffic")]
    if dist:
        plan = dist[0]["plan"]
        modes = "".join(layer["mode"][0].upper() for layer in plan["layers"])
        lines += ["", "### Two workers: the plan and the bytes to peers", "",
                  f"Plan of the first round: modes {modes} (M model, D data) for the {len(plan['layers'])} conv layers"
                  + (f" ({plan['mode_choice']['reason']})" if plan.get("mode_choice") else "") + "; "
                  + ", ".join(f"{w}: {lp_images(plan, w)}" for w in plan["workers"])
                  + (f"; micro-batches {plan['micro_choice']['micro_batches']}" if plan.get("micro_choice") else "")
                  + ".", ""]
        first = next(iter(dist[0]["traffic"].values()))           # the first round's plan
        peers = len(plan["workers"]) - 1
        if first["channels"]:
            lines += [f"The data-mode layers hold {first['batchnorms']} BatchNorms of "
                      f"{', '.join(map(str, first['channels']))} channels: per worker and step, 2 directions x "
                      f"{peers} peer(s) x 8 bytes x (2C + 1), summed over them: "
                      f"{first['batchnorm_array_bytes']:,} bytes of sums (a count once per message), "
                      f"{first['batchnorms'] * 2 * peers} messages.", ""]
        lines += [
                  "Per worker and step (median over the timed steps): the bytes it sent its peers, measured "
                  "(`peer_bytes_sent`), and, computed from the plan (each message packed as the worker packs it), "
                  "its BatchNorm sums (one message forward, one backward, per BatchNorm of a data-mode layer and "
                  "peer, 2C + 1 float64 each) and its data-mode layers' weight-gradient sums (dW and db, float32); "
                  "rest = measured - the two (feature maps and their gradients between layers of different modes; "
                  "each round's plan is its own calibration's). "
                  "1 MB = 1e6 bytes.", ""]
        table = []
        for r in dist:
            for name, t in r["traffic"].items():
                share = 100.0 * t["batchnorm_bytes"] / t["peer_bytes"] if t["peer_bytes"] else 0.0
                modes = "".join(layer["mode"][0].upper() for layer in r["plan"]["layers"])
                table.append([r["round"], name, modes, f"{t['peer_bytes']:,.0f}",
                              f"{t['batchnorm_bytes']:,.0f} ({t['batchnorm_array_bytes']:,.0f})",
                              t["batchnorms"], f"{share:.2f}%", f"{t['weight_bytes']:,.0f}", f"{t['rest_bytes']:,.0f}",
                              f"{t['to_worker_bytes'] / 1e6:.2f}", f"{t['from_worker_bytes'] / 1e6:.2f}"])
        lines.append(_common.markdown_table(
            ["round", "worker", "modes", "to peers, measured (bytes)", "BatchNorm sums, computed (bytes; arrays alone)",
             "BatchNorms",
             "BatchNorm share", "weight-gradient sums, computed (bytes)", "rest (bytes)",
             "coordinator to worker MB", "worker to coordinator MB"], table))
    if doc.get("round_s"):
        lines += ["", f"Rounds took {', '.join(f'{s / 60:.1f}' for s in doc['round_s'])} min."]
    return "\n".join(lines)


def lp_images(plan, worker):
    """A worker's share in words: images of a data layer, kernels of a model layer (first of each)."""
    data = [lp for lp in plan["layers"] if lp["mode"] == "data"]
    model = [lp for lp in plan["layers"] if lp["mode"] != "data"]
    parts = []
    if data:
        parts.append(f"{data[0]['images'][worker]} images of each data layer")
    if model:
        parts.append("kernels " + "+".join(str(lp["kernels"][worker]) for lp in model) + " of the model layers")
    return " and ".join(parts)


if __name__ == "__main__":
    if "--torch-run" not in sys.argv:
        print(_common.reexec_without_blas_overrides())
    sys.exit(main(sys.argv[1:]))
