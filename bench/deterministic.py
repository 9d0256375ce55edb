"""What --deterministic costs: a step of `hetconv-coordinator --local` with the conv paths timing (and
this machine's wisdom) chooses, against the same run with --deterministic (the untimed rule),
alternating rounds in one run. Writes OUT/deterministic.json and renders OUT/deterministic.md.

    python bench/deterministic.py --out bench/results/deterministic
    python bench/deterministic.py --render bench/results/deterministic/deterministic.json

Each row's step is the median of a run's steps after its first two (the first pays for timing the
paths and growing buffers); a fresh wisdom folder for the whole run, so the first default run
times the paths and the later ones reuse them, as a user's runs on one machine do.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NETS = {"paper": ["--conv", "500,1500", "--fc", "256"], "vgg-small": ["--net", "vgg-small"],
        "resnet18": ["--net", "resnet18"]}
MODES = {"timed (wisdom)": [], "--deterministic": ["--deterministic"]}


def one_run(net, mode, args, env, work):
    metrics = os.path.join(work, "m.jsonl")
    cmd = [sys.executable, "-m", "hetconv.cli.coordinator", "--local", "--threads", str(args.threads), *NETS[net],
           "--batch-size", str(args.batch), "--steps", str(args.steps), "--synthetic-train", str(args.batch * args.steps),
           "--synthetic-test", "16", "--eval-batches", "1", "--metrics", metrics, *MODES[mode]]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    steps = [json.loads(line) for line in open(metrics)]
    times = [r["step_s"] for r in steps if r["event"] == "step"][2:]
    paths = [c["path"] for r in steps if r["event"] == "conv_paths" for rec in r.get("devices", [])
             for c in rec.get("choices", [])]
    return statistics.median(times), sorted(set(paths))


def markdown(doc):
    lines = ["# What --deterministic costs", ""] + _common.run_header(doc)
    lines += [f"`--local --threads {doc['threads']}`, batch {doc['batch']}, {doc['steps']} steps a run "
              f"(median of steps 3 on), {doc['rounds']} alternating rounds; ratio = deterministic / timed, the "
              f"median of the rounds' ratios.", ""]
    rows = []
    for net, got in doc["rows"].items():
        timed, det = got["timed (wisdom)"], got["--deterministic"]
        ratios = [d / t for t, d in zip(timed, det)]
        rows.append([net, f"{statistics.median(timed) * 1e3:.1f}", f"{statistics.median(det) * 1e3:.1f}",
                     f"{statistics.median(ratios):.2f}x", f"{min(ratios):.2f}-{max(ratios):.2f}",
                     ", ".join(got.get("timed_paths", [])) or "(not recorded)"])
    lines.append(_common.markdown_table(["network", "timed step ms", "deterministic step ms", "cost", "range",
                                         "paths timing chose"], rows))
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[3:5]))
    p.add_argument("--nets", default="paper,vgg-small", help="comma list of: " + ", ".join(NETS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="", help="folder for deterministic.json and .md ('' prints only)")
    p.add_argument("--render", default="", metavar="JSON", help="run nothing: rewrite the .md beside a saved JSON")
    args = p.parse_args(argv)
    if args.render:
        print(f"wrote {_common.render_saved(args.render, 'deterministic', markdown)}")
        return 0
    started, load_start = time.time(), _common.load_average()
    nets = args.nets.split(",")
    doc = {**_common.run_facts("deterministic.py", sys.argv[1:] if argv is None else argv, started, load_start),
           "threads": args.threads, "batch": args.batch, "steps": args.steps, "rounds": args.rounds,
           "rows": {net: {mode: [] for mode in MODES} for net in nets}}
    with tempfile.TemporaryDirectory(prefix="hetconv-det-") as work:
        env = dict(os.environ, PYTHONPATH=REPO, HETCONV_CACHE=os.path.join(work, "wisdom"))
        for r in range(args.rounds):
            for net in nets:
                for mode in (list(MODES) if r % 2 == 0 else list(MODES)[::-1]):
                    step_s, paths = one_run(net, mode, args, env, work)
                    doc["rows"][net][mode].append(step_s)
                    if mode == "timed (wisdom)" and paths:
                        doc["rows"][net]["timed_paths"] = paths
                    print(f"round {r} {net} {mode}: {step_s * 1e3:.1f} ms", flush=True)
    doc["wall_s"], doc["load"]["end"] = time.time() - started, _common.load_average()
    _common.save_or_print(args.out, "deterministic", doc, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
