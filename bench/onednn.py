"""Two oneDNN libraries on this machine, in alternating rounds: the `onednn` extra's (3.2, GNU
OpenMP) and another libdnnl.so.3 (e.g. the `onednn` wheel's), each in processes of its own.

    python bench/onednn.py --lib /ENV/lib/libdnnl.so.3 --lib-env OCL_ICD_FILENAMES=/ENV/lib/libintelocl.so \\
        --out bench/results/onednn

Each round runs every row once per library, the libraries' order alternating (A B, B A, ...):
- convs: forward + backward (dX and dW) of single conv layers on the CPU device's oneDNN direct
  paths (open_device("cpu", conv_path="direct-dnnl", precision=fp32|bf16, threads=T),
  conv_block + conv_block_backward, no activation, no pool), median of --conv-reps calls after
  one untimed; 1 thread in a process pinned to one core (a SYCL/TBB build runs on as many
  threads as the process's affinity allows, whatever it is asked), 2 threads unpinned;
- steps: hetconv-coordinator --local --threads 2 --retime (each run times its conv paths anew),
  median step_s of the metrics' step events after the first --warmup.
--lib's directory is put on LD_LIBRARY_PATH for its processes (a wheel's runtime libraries lie
beside its libdnnl.so.3); --lib-env adds variables to them.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402

STEM = "onednn"
# name: (x shape, w shape, padding)
LAYERS = {"paper conv2": ((32, 500, 14, 14), (1500, 500, 5, 5), 0),
          "resnet18 64x32x32": ((32, 64, 32, 32), (64, 64, 3, 3), 1),
          "resnet18 256x8x8": ((32, 256, 8, 8), (256, 256, 3, 3), 1)}
STEPS = ["vgg-small bf16", "vgg-small fp32", "resnet18 bf16", "resnet18 auto", "resnet18 fp32"]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lib", help="the other libdnnl.so.3 (B); A is the default lookup's")
    p.add_argument("--lib-env", action="append", default=[], metavar="NAME=VALUE", help="more environment for B")
    p.add_argument("--out", default="", help="write onednn.json and onednn.md here")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", default=",".join(LAYERS))
    p.add_argument("--threads", default="1,2")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--conv-reps", type=int, default=3)
    p.add_argument("--steps", default=",".join(STEPS), help="'NET PRECISION' rows, comma-separated ('' for none)")
    p.add_argument("--step-count", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--render", default="", metavar="JSON", help="rewrite the .md beside a saved JSON, run nothing")
    p.add_argument("--conv-child", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def lib_env(which, args):
    env = {k: v for k, v in os.environ.items() if k not in ("HETCONV_DNNL_LIBRARY",)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_common.REPO, env.get("PYTHONPATH", "")]))
    if which == "B":
        env["HETCONV_DNNL_LIBRARY"] = args.lib
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [os.path.dirname(args.lib), env.get("LD_LIBRARY_PATH")]))
        for item in args.lib_env:
            name, _, value = item.partition("=")
            env[name] = value
    return env


def conv_child(spec, out):
    """In a process of its own: every layer and precision of `spec` on `threads` threads."""
    spec = json.loads(spec)
    if spec["pin"]:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})     # before any thread pool starts
    import numpy as np
    from hetconv.devices import dnnl, open_device
    from hetconv.geometry import ConvBlock
    result = {"library": dnnl.load().describe(), "affinity": sorted(os.sched_getaffinity(0)), "rows": {}}
    for layer in spec["layers"]:
        x_shape, w_shape, pad = LAYERS[layer]
        rng = np.random.default_rng(0)
        x = rng.standard_normal(x_shape, dtype=np.float32)
        w = (rng.standard_normal(w_shape, dtype=np.float32) / np.sqrt(np.prod(w_shape[1:]))).astype(np.float32)
        b = np.zeros(w_shape[0], np.float32)
        block = ConvBlock(padding=pad, activation="none", pool="none")
        for precision in spec["precisions"]:
            dev = open_device("cpu", conv_path="direct-dnnl", precision=precision, threads=spec["threads"])
            dw = np.zeros(w_shape, np.float32)
            seconds = []
            for rep in range(spec["reps"] + 1):
                t0 = time.perf_counter()
                y, ctx = dev.conv_block(x, w, b, block)
                dev.conv_block_backward(ctx, w, y, need_dx=True, dw_out=dw)
                if rep:
                    seconds.append(time.perf_counter() - t0)
            result["rows"][f"{layer} {precision}"] = {"s": statistics.median(seconds), "samples": seconds}
            del dev
    with open(out, "w") as f:
        json.dump(result, f)


def run_convs(which, threads, args, work, tag):
    spec = {"layers": args.layers.split(","), "precisions": args.precisions.split(","), "threads": threads,
            "pin": threads == 1, "reps": args.conv_reps}
    out = os.path.join(work, f"{tag}.json")
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--conv-child", json.dumps(spec), out],
                          env=lib_env(which, args), capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"bench/onednn.py: the conv child ({which}, {threads} threads) failed:\n{done.stderr[-2000:]}")
    with open(out) as f:
        return json.load(f)


def run_step(which, row, args, work, tag):
    net, precision = row.split()
    metrics = os.path.join(work, f"{tag}.jsonl")
    batch = 32
    cmd = [sys.executable, "-m", "hetconv.cli.coordinator", "--local", "--threads", "2", "--net", net,
           "--batch-size", str(batch), "--steps", str(args.step_count), "--precision", precision,
           "--synthetic-train", "512", "--synthetic-test", str(batch), "--eval-batches", "1", "--retime",
           "--metrics", metrics, "--verbose"]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=lib_env(which, args), capture_output=True, text=True, cwd=work, timeout=1800)
    wall = time.perf_counter() - t0
    if done.returncode:
        raise SystemExit(f"bench/onednn.py: {row} on {which} failed:\n{done.stderr[-2000:]}")
    with open(metrics) as f:
        steps = [r for r in map(json.loads, f) if r["event"] == "step"]
    times = [r["step_s"] for r in steps]
    paths = sorted({line.split(" runs ", 1)[1].split(" (")[0] for line in done.stderr.splitlines()
                    if line.startswith("cpu device: x (") and " runs " in line})
    return {"step_s": statistics.median(times[args.warmup:]), "samples": times[args.warmup:], "wall_s": wall,
            "loss_first": steps[0]["loss"], "loss_last": steps[-1]["loss"], "paths": paths}


def run(args, argv):
    started, load_start = time.time(), _common.load_average()
    doc = {**_common.run_facts("onednn.py", argv, started, load_start), "libraries": {}, "rounds": []}
    steps = [s for s in args.steps.split(",") if s.strip()]
    with tempfile.TemporaryDirectory(prefix="hetconv-onednn-") as work:
        for rnd in range(args.rounds):
            order = ("A", "B") if rnd % 2 == 0 else ("B", "A")
            record = {"order": "".join(order), "load": _common.load_average(), "convs": {}, "steps": {}}
            for threads in map(int, args.threads.split(",")):
                for which in order:
                    got = run_convs(which, threads, args, work, f"r{rnd}-{which}-t{threads}")
                    doc["libraries"][which] = got["library"]
                    for name, r in got["rows"].items():
                        record["convs"].setdefault(f"{name}, {threads} thread{'s' * (threads > 1)}", {})[which] = r
            for row in steps:
                for which in order:
                    record["steps"].setdefault(row, {})[which] = run_step(which, row, args, work, f"r{rnd}-{which}")
            doc["rounds"].append(record)
            print(f"round {rnd + 1}/{args.rounds} done ({record['order']}, {record['load']})", flush=True)
            if args.out:
                _common.save_run(args.out, STEM, doc, started, markdown)
    if not args.out:
        print(markdown(doc))


def _table(doc, kind, unit, scale):
    rounds = doc["rounds"]
    names = list(rounds[0][kind]) if rounds else []
    key = "s" if kind == "convs" else "step_s"
    rows = []
    for name in names:
        a = [r[kind][name]["A"][key] for r in rounds if name in r[kind]]
        b = [r[kind][name]["B"][key] for r in rounds if name in r[kind]]
        ratios = [y / x for x, y in zip(a, b)]
        rows.append([name, f"{statistics.median(a) * scale:.1f}", f"{statistics.median(b) * scale:.1f}",
                     f"**{statistics.median(ratios):.3f}**", " ".join(f"{q:.3f}" for q in ratios),
                     " / ".join(f"{x * scale:.1f}, {y * scale:.1f}" for x, y in zip(a, b))])
    return _common.markdown_table(["", f"A median ({unit})", f"B median ({unit})", "B / A (median of rounds)",
                                   "B / A per round", "A, B per round"], rows)


def markdown(doc):
    lines = ["# Two oneDNN libraries, alternating rounds", ""] + _common.run_header(doc)
    lines += [f"- A: {doc['libraries'].get('A', '?')}", f"- B: {doc['libraries'].get('B', '?')}", "",
              "Rounds: " + ", ".join(f"{r['order']} ({r['load']})" for r in doc["rounds"]), "",
              "B / A below 1: B is faster.", "", "## Conv layers, forward + backward (direct paths)", "",
              _table(doc, "convs", "ms", 1e3), "", "## Training steps (--local --threads 2, batch 32)", "",
              _table(doc, "steps", "ms", 1e3), ""]
    if doc["rounds"] and doc["rounds"][0]["steps"]:
        lines += ["Conv paths each library's runs took (round 1):", ""]
        for row, by in doc["rounds"][0]["steps"].items():
            lines += [f"- {row}: A {', '.join(by['A']['paths'])}; B {', '.join(by['B']['paths'])}"]
        lines += [""]
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.conv_child:
        return conv_child(*args.conv_child)
    if args.render:
        return print(f"wrote {_common.render_saved(args.render, STEM, markdown)}")
    if not args.lib:
        raise SystemExit("bench/onednn.py: --lib PATH (the libdnnl.so.3 to compare with) is needed")
    run(args, argv)


if __name__ == "__main__":
    main()
