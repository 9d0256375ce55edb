"""Is this checkout's training step slower than an earlier revision's? The paper network's step,
`--local`, the two checkouts run one after the other in alternating rounds, in one run
(`--net`: another network, as hetconv-coordinator's --net takes it).

    python bench/versus.py --base b780387 --out bench/results
    python bench/versus.py --base HEAD~1 --net vgg-small --batch-size 32 --steps 8 --out DIR --name vgg_small
    python bench/versus.py --render bench/results/versus.json

Each side is `hetconv-coordinator --local --threads T --batch-size N --steps S` from its own
exported tree (`git archive REV`, run with only that tree importable: the editable install of
this checkout is kept out), on the built-in synthetic set. A round's number for a side is the
median of its steps after the first (which pays for buffers), and the process's wall time. The
row's ratio is this checkout over the base, per round and as the median of the rounds.
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
import numpy  # noqa: E402,F401  (loads the BLAS the results name)

STEM = "versus"
# Runs a module with only PYTHONPATH's tree importable: the editable install's finder would
# otherwise map hetconv.devices to this checkout whatever PYTHONPATH says.
RUNNER = ("import runpy, sys\n"
          "sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in (getattr(f, '__module__', '') or '')]\n"
          "module = sys.argv[1]\nsys.argv = [module] + sys.argv[2:]\nrunpy.run_module(module, run_name='__main__')\n")


def export(rev, into):
    """`git archive REV` unpacked into `into`, with devices/ reachable as hetconv.devices."""
    os.makedirs(into)
    archive = subprocess.run(["git", "-C", _common.REPO, "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    if not os.path.exists(os.path.join(into, "hetconv", "devices")):
        os.symlink(os.path.join("..", "devices"), os.path.join(into, "hetconv", "devices"))
    return subprocess.run(["git", "-C", _common.REPO, "rev-parse", "--short", rev], capture_output=True, text=True,
                          check=True).stdout.strip()


def one_run(tree, work, args, tag):
    metrics = os.path.join(work, f"{tag}.jsonl")
    env = dict(os.environ, PYTHONPATH=tree, NUMBA_CACHE_DIR=os.path.join(work, f"numba-{os.path.basename(tree)}"))
    # the command's module where that tree keeps it (hetconv/cli/ in this layout, hetconv/ before)
    module = ("hetconv.cli.coordinator" if os.path.exists(os.path.join(tree, "hetconv", "cli", "coordinator.py"))
              else "hetconv.coordinator")
    cmd = [sys.executable, os.path.join(work, "runner.py"), module, "--local", "--threads",
           str(args.threads), "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--synthetic-train",
           str(args.batch_size * (args.steps + 1)), "--synthetic-test", str(args.batch_size), "--eval-batches", "1",
           "--metrics", metrics] + (["--net", args.net] if args.net else [])
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=work)
    wall = time.perf_counter() - t0
    if done.returncode:
        raise SystemExit(f"{tag}: exit {done.returncode}\n{done.stderr[-2000:]}")
    steps = [json.loads(line)["step_s"] for line in open(metrics) if '"event": "step"' in line]
    return {"step_s": statistics.median(steps[1:] or steps), "steps_s": steps, "wall_s": wall}


def run(args):
    with tempfile.TemporaryDirectory(prefix="hetconv-versus-") as work:
        with open(os.path.join(work, "runner.py"), "w") as f:
            f.write(RUNNER)
        trees = {}
        for side, rev in (("base", args.base), ("this", "HEAD")):
            tree = os.path.join(work, side)
            trees[side] = (tree, export(rev, tree))
        rounds = {side: [] for side in trees}
        for r in range(args.rounds):
            for side in (("base", "this") if r % 2 == 0 else ("this", "base")):
                rounds[side].append(one_run(trees[side][0], work, args, f"{side}-{r}"))
                print(f"round {r} {side}: {rounds[side][-1]['step_s']:.3f} s/step, wall {rounds[side][-1]['wall_s']:.1f} s",
                      flush=True)
    step_ratios = [t["step_s"] / b["step_s"] for t, b in zip(rounds["this"], rounds["base"])]
    wall_ratios = [t["wall_s"] / b["wall_s"] for t, b in zip(rounds["this"], rounds["base"])]
    return {"base": trees["base"][1], "this": trees["this"][1], "rounds": rounds, "step_ratios": step_ratios,
            "wall_ratios": wall_ratios, "median_step_ratio": statistics.median(step_ratios),
            "median_wall_ratio": statistics.median(wall_ratios)}


def markdown(doc):
    r = doc["result"]
    lines = ["# This checkout's step against an earlier revision's", ""] + _common.run_header(doc)
    lines += [f"ISA: {doc['isa']}. BLAS: {doc['blas']}.", "",
              f"{doc.get('net') or 'The paper network'}, `--local --threads {doc['threads']} "
              f"--batch-size {doc['batch_size']} --steps "
              f"{doc['steps']}`, from exported trees of {r['this']} (this) and {r['base']} (base), in alternating "
              f"rounds. Per round: the median step after the first, and the process's wall time. Ratios are this "
              f"over base (above 1: slower).", ""]
    table = [[i, f"{b['step_s']:.3f}", f"{t['step_s']:.3f}", f"{s:.3f}", f"{b['wall_s']:.1f}", f"{t['wall_s']:.1f}",
              f"{w:.3f}"] for i, (b, t, s, w) in enumerate(zip(r["rounds"]["base"], r["rounds"]["this"],
                                                             r["step_ratios"], r["wall_ratios"]))]
    lines.append(_common.markdown_table(["round", "base s/step", "this s/step", "step ratio", "base wall s",
                                         "this wall s", "wall ratio"], table))
    lines += ["", f"Median step ratio {r['median_step_ratio']:.3f}; median wall ratio {r['median_wall_ratio']:.3f}."]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="HEAD~1", help="the earlier revision (anything git rev-parse takes)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--net", default="", help="a hetconv --net text (default: the paper network)")
    p.add_argument("--name", default=STEM, help="OUT/NAME.json and NAME.md")
    p.add_argument("--out", default="")
    p.add_argument("--render", default="", help="rewrite the .md beside a saved JSON, running nothing")
    args = p.parse_args(argv)
    if args.render:
        stem = os.path.splitext(os.path.basename(args.render))[0]
        print(f"wrote {_common.render_saved(args.render, stem, markdown)}")
        return 0
    t0, load_start = time.time(), _common.load_average()
    result = run(args)
    doc = {**_common.run_facts("versus.py", sys.argv[1:] if argv is None else argv, t0, load_start),
           "threads": args.threads, "batch_size": args.batch_size, "steps": args.steps, "net": args.net,
           "result": result}
    _common.save_or_print(args.out, args.name, doc, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
