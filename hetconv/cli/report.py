"""`hetconv-report METRICS.jsonl [--out DIR]`: a run's metrics file as plots and a summary.

    hetconv-coordinator --spawn cpu,cpu --metrics run.jsonl
    hetconv-report run.jsonl                      # run-report/summary.md and its PNG plots

DIR/summary.md: steps, final training loss, best and final test accuracy, median step time,
images per second, the workers. With matplotlib (pip install 'hetconv[report]') also:
loss.png (training loss and test loss over steps), accuracy.png (test accuracy over steps),
images_per_s.png, workers.png (per worker and step: compute, wire and wait seconds), and
timeline.png where the run traced a step (hetconv-coordinator --trace-step): each worker's
blocks forward and backward, the waits inside them for what they read, and its updates, on one
time axis from the step's start.

Per worker and step, from the step records: compute is the time its device computed; wire is
the rest of its requests' round trips (messages, the peer exchange, queues); wait is the rest of
the step, when it had no request in flight (the coordinator's FC layers, data, the other workers).

A replayed step (after a lost worker) or a resumed run writes a step's record again; the last one
of each step is the run's. The file is read as JSON lines only: nothing in it is executed.
"""
import argparse
from dataclasses import dataclass, field
import json
import os
import statistics
import sys

from hetconv.flags import HelpFormatter, add_version

MATPLOTLIB_MISSING = "the plots need matplotlib, which is not installed: pip install 'hetconv[report]'"


@dataclass
class RunRecord:
    """What the report shows, taken from a metrics file's records."""
    steps: list = field(default_factory=list)            # step numbers, ascending
    loss: list = field(default_factory=list)             # training loss per step
    step_s: list = field(default_factory=list)
    images_per_s: list = field(default_factory=list)
    evals: list = field(default_factory=list)            # (step, test loss or None, test accuracy), ascending
    workers: dict = field(default_factory=dict)          # name -> {"steps", "compute_s", "wire_s", "wait_s"}
    config: dict = field(default_factory=dict)
    done: dict | None = None
    lost: list = field(default_factory=list)             # (step, worker)
    traces: dict = field(default_factory=dict)           # step -> {worker: [(what, layer, micro, start, end)]}


def read_records(path):
    """The metrics file's records. Raises ValueError naming the file and the first bad line."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"{path!r} cannot be read: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path!r} is not a metrics file (JSON lines): it is not text") from None
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if n == len(lines):               # a run killed while writing its last line
                break
            raise ValueError(f"{path!r} line {n} is not JSON ({e.msg}): expected a hetconv metrics file") from None
        if not isinstance(record, dict) or not isinstance(record.get("event"), str):
            raise ValueError(f"{path!r} line {n} has no event: expected a hetconv metrics file")
        records.append(record)
    return records


def _number(value):
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def extract(records):
    """RunRecord from the records (read_records), keeping the last record of each step."""
    run = RunRecord()
    steps, evals = {}, {}
    for r in records:
        event = r["event"]
        if event == "config" and isinstance(r.get("config"), dict):
            run.config = r["config"]
        elif event == "step" and isinstance(r.get("step"), int):
            steps[r["step"]] = r
        elif event == "eval" and isinstance(r.get("step"), int):
            evals[r["step"]] = (r["step"], _number(r.get("test_loss")), _number(r.get("test_accuracy")))
        elif event == "done":
            run.done = r
            if isinstance(r.get("step"), int) and r["step"] not in evals and _number(r.get("test_accuracy")) is not None:
                evals[r["step"]] = (r["step"], _number(r.get("test_loss")), _number(r.get("test_accuracy")))
        elif event == "worker_lost":
            run.lost.append((r.get("step"), str(r.get("worker"))))
    for step in sorted(steps):
        r = steps[step]
        loss, step_s = _number(r.get("loss")), _number(r.get("step_s"))
        if loss is None or step_s is None:
            continue
        run.steps.append(step)
        run.loss.append(loss)
        run.step_s.append(step_s)
        run.images_per_s.append(_number(r.get("images_per_s")))
        workers = r.get("workers") if isinstance(r.get("workers"), dict) else {}
        for name, stats in workers.items():
            if not isinstance(stats, dict):
                continue
            spans = trace_spans(stats.get("trace"))
            if spans:
                run.traces.setdefault(step, {})[str(name)] = spans
            compute, roundtrip = _number(stats.get("compute_s")), _number(stats.get("roundtrip_s"))
            if compute is None:
                continue
            w = run.workers.setdefault(name, {"steps": [], "compute_s": [], "wire_s": [], "wait_s": []})
            w["steps"].append(step)
            w["compute_s"].append(compute)
            # in-process shards have no round trip: all their time is compute
            w["wire_s"].append(max(0.0, roundtrip - compute) if roundtrip else 0.0)
            w["wait_s"].append(max(0.0, step_s - roundtrip) if roundtrip else max(0.0, step_s - compute))
    run.evals = [evals[s] for s in sorted(evals)]
    return run


def trace_spans(trace):
    """A worker's traced step (worker.graph_step.StepTrace.to_json) as [(what, layer, micro, start,
    end)], keeping only well-formed spans (the file is not trusted)."""
    spans = trace.get("spans") if isinstance(trace, dict) else None
    out = []
    for span in spans if isinstance(spans, list) else ():
        if not (isinstance(span, list) and len(span) == 5 and isinstance(span[0], str)):
            continue
        layer, micro, start, end = (_number(v) for v in span[1:])
        if None not in (layer, micro, start, end) and 0 <= start <= end:
            out.append((span[0][:40], int(layer), int(micro), start, end))
    return out


def trace_summary(spans):
    """A worker's traced step in seconds: when it ended, its blocks' forward and backward, its
    updates (after each backward and at the end), and its waits by what it waited for (inside
    the blocks' spans: a block waits for what it reads)."""
    total, waits = {}, {}
    for what, _, _, start, end in spans:
        if what.startswith("wait "):
            waits[what[5:]] = waits.get(what[5:], 0.0) + end - start
        else:
            total[what] = total.get(what, 0.0) + end - start
    return {"ends_s": max((end for *_, end in spans), default=0.0), "forward_s": total.get("forward", 0.0),
            "backward_s": total.get("backward", 0.0),
            "updates_s": total.get("updates", 0.0) + total.get("after backward", 0.0),
            "waits_s": dict(sorted(waits.items(), key=lambda kv: -kv[1]))}


def trace_table(step, spans_by_worker):
    """Markdown lines of a traced step: per worker, its seconds in blocks' forward and backward,
    updates, and waiting, by what it waited for."""
    lines = ["", f"Step {step}, traced (seconds from the step's start; waits fall inside the blocks that read "
                 f"what they wait for):", "", "| worker | ends at | forward | backward | updates | waiting, by what |",
             "|---|---|---|---|---|---|"]
    for name, spans in spans_by_worker.items():
        t = trace_summary(spans)
        waited = ", ".join(f"{k} {v:.3f}" for k, v in t["waits_s"].items()) or "none"
        lines.append(f"| {name} | {t['ends_s']:.3f} | {t['forward_s']:.3f} | {t['backward_s']:.3f} | "
                     f"{t['updates_s']:.3f} | {waited} |")
    return lines


def summary_markdown(run, source):
    """DIR/summary.md's text."""
    lines = [f"# Run report: `{os.path.basename(source)}`", ""]
    if not run.steps:
        return "\n".join(lines + ["No training steps were recorded.", ""])
    median = statistics.median(run.step_s[1:] or run.step_s)         # the first step pays for warm-up
    rates = [r for r in run.images_per_s[1:] or run.images_per_s if r is not None]
    cfg = run.config
    rows = [("steps", f"{len(run.steps)} (steps {run.steps[0]} to {run.steps[-1]})"),
            ("final training loss", f"{run.loss[-1]:.4f}")]
    if cfg:
        rows.insert(0, ("network", cfg.get("net") or f"--conv {cfg.get('conv')} --fc {cfg.get('fc')}"))
        rows.insert(1, ("data", f"{cfg.get('data')}, batch {cfg.get('batch_size')} images"
                                + (f", augment {cfg['augment']}" if cfg.get("augment") else "")))
    accuracies = [(step, acc) for step, _, acc in run.evals if acc is not None]
    if accuracies:
        best_step, best = max(accuracies, key=lambda e: e[1])
        rows.append(("best test accuracy", f"{best:.4f} (step {best_step})"))
        rows.append(("final test accuracy", f"{accuracies[-1][1]:.4f} (step {accuracies[-1][0]})"))
    losses = [(step, loss) for step, loss, _ in run.evals if loss is not None]
    if losses:
        rows.append(("final test loss", f"{losses[-1][1]:.4f} (step {losses[-1][0]})"))
    rows.append(("median step time", f"{median:.3f} s"))
    if rates:
        rows.append(("median images per second", f"{statistics.median(rates):.1f}"))
    rows.append(("workers", ", ".join(run.workers) or "none recorded"))
    if run.lost:
        rows.append(("workers lost", ", ".join(f"{w} (step {s})" for s, w in run.lost)))
    if run.done is None:
        rows.append(("ended", "without a `done` record (stopped, or still running)"))
    lines += ["| | |", "|---|---|"] + [f"| {name} | {value} |" for name, value in rows]
    if run.workers:
        lines += ["", "Per worker, median seconds per step (compute: its device; wire: the rest of its round "
                      "trips; wait: nothing in flight):", "",
                  "| worker | steps | compute s | wire s | wait s |", "|---|---|---|---|---|"]
        for name, w in run.workers.items():
            lines.append(f"| {name} | {len(w['steps'])} | {statistics.median(w['compute_s']):.3f} | "
                         f"{statistics.median(w['wire_s']):.3f} | {statistics.median(w['wait_s']):.3f} |")
    if run.traces:
        step = max(run.traces)
        lines += trace_table(step, run.traces[step])
    return "\n".join(lines + [""])


def import_pyplot():
    """matplotlib.pyplot on a backend that needs no display, or ValueError saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError(MATPLOTLIB_MISSING) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def write_plots(run, out):
    """The PNG plots into `out`. Returns their paths."""
    plt = import_pyplot()
    paths = []

    def save(fig, name):
        fig.tight_layout()
        path = os.path.join(out, name)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(run.steps, run.loss, lw=0.8, label="training loss (per step)")
    tested = [(s, loss) for s, loss, _ in run.evals if loss is not None]
    if tested:
        ax.plot(*zip(*tested), "o-", label="test loss")
    ax.set(xlabel="step", ylabel="softmax cross-entropy", title="loss")
    ax.legend()
    save(fig, "loss.png")

    accuracies = [(s, acc) for s, _, acc in run.evals if acc is not None]
    if accuracies:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(*zip(*accuracies), "o-")
        ax.set(xlabel="step", ylabel="test accuracy", title="test accuracy", ylim=(0, 1))
        save(fig, "accuracy.png")

    rates = [(s, r) for s, r in zip(run.steps, run.images_per_s) if r is not None]
    if rates:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(*zip(*rates), lw=0.8)
        ax.set(xlabel="step", ylabel="images per second", title="training throughput")
        save(fig, "images_per_s.png")

    if run.workers:
        names = list(run.workers)
        fig, axes = plt.subplots(len(names), 1, figsize=(7, 2.2 * len(names) + 0.6), sharex=True, squeeze=False)
        for ax, name in zip(axes[:, 0], names):
            w = run.workers[name]
            ax.stackplot(w["steps"], w["compute_s"], w["wire_s"], w["wait_s"], labels=("compute", "wire", "wait"))
            ax.set(ylabel="seconds", title=name)
        axes[0, 0].legend(loc="upper right", fontsize="small")
        axes[-1, 0].set_xlabel("step")
        save(fig, "workers.png")
    if run.traces:
        step = max(run.traces)
        save(timeline_figure(plt, step, run.traces[step]), "timeline.png")
    return paths


# a traced span's colour by what it is; every wait is grey, drawn in a lane of its own
TIMELINE_COLOURS = {"forward": "tab:blue", "backward": "tab:orange", "after backward": "tab:green",
                    "updates": "tab:purple"}


def timeline_figure(plt, step, spans_by_worker):
    """One traced step: per worker a lane of its blocks' forward and backward and its updates, and
    below it a lane of its waits."""
    names = list(spans_by_worker)
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.8 * len(names)))
    labelled = set()
    for row, name in enumerate(names):
        y = len(names) - 1 - row
        for what, layer, _, start, end in spans_by_worker[name]:
            waiting = what.startswith("wait ")
            colour = "0.6" if waiting else TIMELINE_COLOURS.get(what, "tab:red")
            kind = "wait" if waiting else what
            label = kind if kind not in labelled else None          # one legend entry a kind
            labelled.add(kind)
            ax.broken_barh([(start, max(end - start, 1e-5))], (y + (0.05 if waiting else 0.4), 0.3 if waiting else 0.5),
                           facecolors=colour, edgecolors="white", linewidth=0.3, label=label)
    ax.set_yticks([len(names) - 1 - i + 0.5 for i in range(len(names))], names)
    ax.set(xlabel="seconds from the step's start", title=f"step {step}: each worker's blocks (top) and waits (below)")
    ax.set_ylim(0, len(names) + 0.5)
    ax.legend(loc="upper right", fontsize="small", ncol=5, frameon=False)
    return fig


def build_parser():
    p = argparse.ArgumentParser(
        prog="hetconv-report",
        description="Plots and a markdown summary of a run, from the --metrics file hetconv-coordinator wrote.",
        epilog="examples:\n  hetconv-report run.jsonl\n  hetconv-report run.jsonl --out reports/run1",
        formatter_class=HelpFormatter)
    p.add_argument("metrics", metavar="METRICS.jsonl", help="the run's --metrics file")
    p.add_argument("--out", default="", metavar="DIR",
                   help="where summary.md and the plots go (default: beside METRICS, named after it with -report)")
    return add_version(p)


def default_out(metrics):
    root, _ = os.path.splitext(os.path.abspath(metrics))
    return root + "-report"


def main(argv=None):
    args = build_parser().parse_args(argv)
    out = args.out or default_out(args.metrics)
    try:
        if not os.path.isfile(args.metrics):
            raise ValueError(f"{args.metrics!r}: no such metrics file (write one with hetconv-coordinator "
                             f"--metrics FILE)")
        run = extract(read_records(args.metrics))
        if not run.steps:
            raise ValueError(f"{args.metrics!r} has no step records: nothing to report")
        try:
            os.makedirs(out, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--out {out!r} cannot be made: {e.strerror or e}") from None
        summary = os.path.join(out, "summary.md")
        with open(summary, "w") as f:
            f.write(summary_markdown(run, args.metrics))
        print(f"wrote {summary}")
        plots = write_plots(run, out)
    except ValueError as e:
        print(f"hetconv-report: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"hetconv-report: --out {out!r} cannot be written: {e.strerror or e}", file=sys.stderr)
        return 2
    for path in plots:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
