"""A run you can read: evaluation during training (and redone when a worker is lost during it),
--augment, --steps beyond the epochs, what the coordinator prints, Ray's colour codes,
hetconv-plan's name and hetconv-report."""
import importlib.util
import io
import json
import os
import subprocess
import sys
import tomllib

import pytest

from conftest import REPO
from hetconv.training.config import Config
from hetconv.devices import open_device
from hetconv.engine.local import LocalEngine
from hetconv.engine.shard import ConvShard
from hetconv.training.loop import train

# 128 training images in batches of 32: 4 steps an epoch
TINY = dict(conv="6,12", fc="32", batch_size=32, synthetic_train=128, synthetic_test=64, lr=0.01, threads=1)
CLI_TINY = ["--conv", "4,8", "--fc", "8", "--batch-size", "16", "--synthetic-train", "64", "--synthetic-test", "32",
            "--threads", "1", "--calibration-batch", "4"]


def quiet(*_):
    pass


def local_engine():
    # paths by rule: runs compared for equal losses must not each time the conv paths afresh
    return LocalEngine({"local": ConvShard(open_device("cpu", threads=1, deterministic=True))})


def records(path, event=None):
    recs = [json.loads(line) for line in open(path)]
    return [r for r in recs if event is None or r["event"] == event]


def coordinator(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "hetconv.cli.coordinator", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


# ---- evaluation during training --------------------------------------------------------------------

@pytest.mark.parametrize("eval_every, steps_evaluated", [(1, [4, 8, 10]), (2, [8, 10]), (0, [10])])
def test_eval_records_every_n_epochs_and_at_the_end(tmp_path, eval_every, steps_evaluated):
    metrics = tmp_path / "m.jsonl"
    summary = train(Config(**TINY, steps=10, epochs=3, eval_every=eval_every, metrics=str(metrics)).validate(),
                    local_engine(), log=quiet)
    evals = records(metrics, "eval")
    assert [e["step"] for e in evals] == steps_evaluated
    assert {"step", "epoch", "test_loss", "test_accuracy", "test_images"} <= set(evals[0])
    assert evals[-1]["epoch"] == pytest.approx(10 / 4, abs=1e-3)
    done = records(metrics, "done")[-1]
    assert done["test_accuracy"] == evals[-1]["test_accuracy"] == summary["test_accuracy"]
    assert done["test_loss"] == evals[-1]["test_loss"] == summary["test_loss"]
    assert 0 < done["test_loss"] < 10


def test_the_evaluation_after_an_epoch_is_of_that_steps_weights(tmp_path):
    """The record at step 4 of a 10-step run equals the final evaluation of a 4-step run."""
    long, short = tmp_path / "long.jsonl", tmp_path / "short.jsonl"
    train(Config(**TINY, steps=10, epochs=3, metrics=str(long)).validate(), local_engine(), log=quiet)
    train(Config(**TINY, steps=4, metrics=str(short)).validate(), local_engine(), log=quiet)
    at4 = next(e for e in records(long, "eval") if e["step"] == 4)
    end = records(short, "done")[-1]
    assert at4["test_accuracy"] == end["test_accuracy"]
    assert at4["test_loss"] == pytest.approx(end["test_loss"], rel=1e-6)


def test_steps_beyond_the_epochs_run_the_epochs_they_need_and_say_so(tmp_path):
    lines, metrics = [], tmp_path / "m.jsonl"
    summary = train(Config(**TINY, steps=10, metrics=str(metrics)).validate(), local_engine(), log=lines.append)
    assert summary["step"] == 10 and len(summary["losses"]) == 10
    said = [line for line in lines if line.startswith("--steps 10")]
    assert said == ["--steps 10 needs 3 epochs of 4 steps (--epochs 1 covers 4): running 3 epochs"]
    assert records(metrics, "config")[0]["config"]["epochs"] == 3
    assert [r["epoch"] for r in records(metrics, "step")] == [0] * 4 + [1] * 4 + [2] * 2


@pytest.mark.parametrize("snapshot_every", [2, 3], ids=["snapshot-at-the-evaluated-step", "snapshot-before-it"])
def test_a_worker_lost_during_a_mid_run_evaluation_is_redone_once(tmp_path, snapshot_every):
    """3 workers, 6 steps (an epoch is 4): a worker killed in the evaluation after step 4. With a
    snapshot at step 4 nothing is replayed and the evaluation is redone at once; with one at step 3,
    step 4 is replayed first. Either way steps 4 and 6 are evaluated once each, as --local does."""
    from hetconv.coordinator.remote import RemoteEngine
    base = dict(TINY, calibration_batch=4, use_all=True, rebalance_after=0, steps=6, epochs=2)
    local = tmp_path / "local.jsonl"
    train(Config(**base, metrics=str(local)).validate(), local_engine(), log=quiet)
    engine = RemoteEngine("tcp://127.0.0.1:0", 0, ["cpu"] * 3, threads=1, connect_timeout=60, log=quiet)
    real_predict, killed = engine.predict, []

    def predict(x):
        if not killed:
            proc = engine.processes[1][1]
            proc.kill()
            proc.wait()
            killed.append(True)
        return real_predict(x)
    engine.predict = predict
    metrics = tmp_path / "m.jsonl"
    try:
        train(Config(**base, snapshot_every=snapshot_every, metrics=str(metrics)).validate(), engine, log=quiet)
    finally:
        engine.close()
    assert [r["worker"] for r in records(metrics, "worker_lost")] == ["w1-cpu"]
    got, want = records(metrics, "eval"), records(local, "eval")
    assert [e["step"] for e in got] == [e["step"] for e in want] == [4, 6]
    for g, w in zip(got, want):
        assert g["test_accuracy"] == w["test_accuracy"]
        assert g["test_loss"] == pytest.approx(w["test_loss"], rel=1e-4)
        assert g["test_images"] == w["test_images"] == 64


# ---- --augment -------------------------------------------------------------------------------------

def test_augment_is_checked_recorded_and_changes_the_batches_the_same_way_each_run(tmp_path):
    bad = coordinator("--local", *CLI_TINY, "--augment", "crop,blur", timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "--augment 'crop,blur'" in bad.stderr
    runs = []
    for name, augment in (("a", "crop,flip"), ("b", "crop,flip"), ("plain", "")):
        metrics = tmp_path / f"{name}.jsonl"
        summary = train(Config(**TINY, steps=3, augment=augment, metrics=str(metrics)).validate(), local_engine(),
                        log=quiet)
        assert records(metrics, "config")[0]["config"]["augment"] == augment
        runs.append(summary["losses"])
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


# ---- what the coordinator prints -------------------------------------------------------------------

def test_a_local_run_prints_evaluations_no_split_table_and_how_to_save():
    result = coordinator("--local", *CLI_TINY, "--steps", "6", "--eval-batches", "1")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "split:" not in out
    assert "step 4 (epoch 1): test loss " in out and "test accuracy" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("nothing was saved") and "--checkpoint-dir DIR" in last


def test_a_run_that_saves_does_not_say_nothing_was_saved(tmp_path):
    result = coordinator("--local", *CLI_TINY, "--steps", "2", "--checkpoint-dir", tmp_path / "ck")
    assert result.returncode == 0, result.stderr
    assert "nothing was saved" not in result.stdout


def test_spawned_workers_are_announced_once_calibration_says_it_starts_and_numbers_have_units():
    # --use-all: on a busy machine the planner may rightly leave a worker of so small a network out,
    # and then it has no row of its own in the plan's table
    result = coordinator("--spawn", "cpu:1,cpu:1", *CLI_TINY, "--steps", "4", "--eval-batches", "1", "--use-all")
    assert result.returncode == 0, result.stderr
    lines = (result.stdout + result.stderr).splitlines()
    for name in ("w0-cpu:1", "w1-cpu:1"):
        assert len([line for line in lines if f"worker {name}" in line or f"hetconv-worker {name}" in line]) == 1
    starts = [i for i, line in enumerate(lines) if line.startswith("calibrating 2 worker(s)")]
    done = [i for i, line in enumerate(lines) if line.startswith("calibrated 2 worker(s)")]
    assert len(starts) == 1 and len(done) == 1 and starts[0] < done[0]
    row = next(line for line in lines if line.startswith("w0-cpu:1 "))
    assert "kernels/s" in row or " img" in row          # a model layer's kernels and speed, a data layer's images
    assert not any(line.startswith("snapshots every") for line in lines)
    assert any(line.startswith("a lost worker costs at most") for line in lines)


def test_ray_is_told_to_print_no_colour_codes_where_output_is_not_a_terminal(monkeypatch):
    from hetconv.coordinator import ray as launch_ray

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    env = {}
    launch_ray.plain_worker_lines(env, (io.StringIO(), Terminal()))
    assert env == {"RAY_COLOR_PREFIX": "0"}
    env = {}
    launch_ray.plain_worker_lines(env, (Terminal(), Terminal()))
    assert env == {}
    env = {"RAY_COLOR_PREFIX": "1"}                  # the user's own choice stays
    launch_ray.plain_worker_lines(env, (io.StringIO(),))
    assert env == {"RAY_COLOR_PREFIX": "1"}
    # and the launcher does it before Ray starts printing (ray.init stubbed: no Ray is started)
    ray = pytest.importorskip("ray", reason="the Ray extra is not installed")
    monkeypatch.delenv("RAY_COLOR_PREFIX", raising=False)
    monkeypatch.setattr(ray, "init", lambda **kw: None)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    launch_ray.RayLauncher(None, num_cpus=1).close()
    assert os.environ.get("RAY_COLOR_PREFIX") == "0"


# ---- hetconv-plan ----------------------------------------------------------------------------------

def test_the_planning_command_is_hetconv_plan_everywhere():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert scripts["hetconv-plan"] == "hetconv.cli.plan:main"
    assert scripts["hetconv-report"] == "hetconv.cli.report:main"
    assert "hetconv-predict" not in scripts
    for folder in ("README.md", "docs", "bench", "examples", "hetconv"):
        path = os.path.join(REPO, folder)
        files = [path] if os.path.isfile(path) else [os.path.join(d, n) for d, _, names in os.walk(path)
                                                     for n in names if n.endswith((".md", ".py", ".sh"))]
        for name in files:
            with open(name) as f:
                assert "hetconv-predict" not in f.read(), name
    result = subprocess.run([sys.executable, "-m", "hetconv.cli.plan", "--help"], capture_output=True, text=True,
                            timeout=60, cwd=REPO)
    assert result.returncode == 0 and result.stdout.startswith("usage: hetconv-plan")


# ---- hetconv-report --------------------------------------------------------------------------------

def step_record(step, loss, step_s=2.0, compute=(1.0, 0.5), roundtrip=(1.5, 1.2)):
    return {"event": "step", "step": step, "epoch": 0, "loss": loss, "accuracy": 0.5, "step_s": step_s,
            "images_per_s": 64 / step_s,
            "workers": {f"w{i}-cpu": {"compute_s": c, "roundtrip_s": r, "bytes_sent": 1, "bytes_recv": 1}
                        for i, (c, r) in enumerate(zip(compute, roundtrip))}}


def write_metrics(path):
    recs = [{"event": "config", "config": dict(Config().to_json(), net="lenet5", augment="flip"), "data": "x"},
            step_record(1, 2.3, step_s=9.0), step_record(2, 2.2), step_record(3, 2.9),
            {"event": "worker_lost", "step": 4, "worker": "w2-cpu", "reason": "gone"},
            step_record(3, 2.1),                                  # step 3 replayed: this record is the run's
            step_record(4, 2.0, step_s=3.0),
            {"event": "eval", "step": 2, "epoch": 1.0, "test_loss": 2.25, "test_accuracy": 0.40, "test_images": 64},
            {"event": "eval", "step": 4, "epoch": 2.0, "test_loss": 2.05, "test_accuracy": 0.35, "test_images": 64},
            {"event": "done", "step": 4, "test_accuracy": 0.35, "test_loss": 2.05, "test_images": 64}]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"event": "st')     # a cut last line
    return path


def test_report_extracts_the_last_record_of_each_step_and_the_worker_times(tmp_path):
    from hetconv.cli.report import extract, read_records
    run = extract(read_records(write_metrics(tmp_path / "m.jsonl")))
    assert run.steps == [1, 2, 3, 4]
    assert run.loss == [2.3, 2.2, 2.1, 2.0]
    assert run.evals == [(2, 2.25, 0.40), (4, 2.05, 0.35)]
    w1 = run.workers["w1-cpu"]
    assert w1["compute_s"] == [0.5] * 4
    assert w1["wire_s"] == pytest.approx([0.7] * 4)                   # round trip minus compute
    assert w1["wait_s"] == pytest.approx([7.8, 0.8, 0.8, 1.8])         # step minus round trip
    assert run.lost == [(4, "w2-cpu")]


def test_report_summary_without_matplotlib_names_the_extra(tmp_path, monkeypatch, capsys):
    from hetconv.cli import report
    metrics = write_metrics(tmp_path / "m.jsonl")
    monkeypatch.setitem(sys.modules, "matplotlib", None)             # as if not installed
    assert report.main([str(metrics), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"hetconv-report: {report.MATPLOTLIB_MISSING}"
    summary = (tmp_path / "r" / "summary.md").read_text()
    for text in ("| steps | 4 (steps 1 to 4) |", "| final training loss | 2.0000 |",
                 "| best test accuracy | 0.4000 (step 2) |", "| final test accuracy | 0.3500 (step 4) |",
                 "| median step time | 2.000 s |", "| workers | w0-cpu, w1-cpu |", "| network | lenet5 |",
                 "augment flip", "| workers lost | w2-cpu (step 4) |", "| w1-cpu | 4 | 0.500 | 0.700 | 1.300 |"):
        assert text in summary, summary


@pytest.mark.parametrize("content, message", [
    (None, "no such metrics file"),
    ("not json\n{}\n", "line 1 is not JSON"),
    ('{"event": "config", "config": {}}\n', "has no step records"),
    ('[1, 2]\n{"event": "step"}\n', "line 1 has no event"),
])
def test_report_refuses_a_bad_file_in_one_line(tmp_path, capsys, content, message):
    from hetconv.cli import report
    path = tmp_path / "m.jsonl"
    if content is not None:
        path.write_text(content)
    assert report.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hetconv-report: ") and message in err, err
    assert not (tmp_path / "m-report").exists()


def test_report_plots_a_real_run(tmp_path):
    pytest.importorskip("matplotlib", reason="the plots need matplotlib (pip install 'hetconv[report]')")
    from hetconv.cli import report
    metrics = tmp_path / "run.jsonl"
    train(Config(**TINY, steps=6, epochs=2, metrics=str(metrics)).validate(), local_engine(), log=quiet)
    assert report.main([str(metrics)]) == 0
    out = tmp_path / "run-report"
    for name in ("summary.md", "loss.png", "accuracy.png", "images_per_s.png", "workers.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| best test accuracy |" in (out / "summary.md").read_text()


def test_report_summarises_a_real_run_without_plots(tmp_path):
    from hetconv.cli.report import extract, read_records, summary_markdown
    metrics = tmp_path / "run.jsonl"
    summary = train(Config(**TINY, steps=6, epochs=2, metrics=str(metrics)).validate(), local_engine(), log=quiet)
    run = extract(read_records(metrics))
    assert run.steps == list(range(1, 7)) and [s for s, _, _ in run.evals] == [4, 6]
    text = summary_markdown(run, str(metrics))
    assert f"| final training loss | {summary['final_loss']:.4f} |" in text
    assert "| workers | local |" in text


def test_report_shows_a_traced_step_per_worker_and_refuses_bad_spans(tmp_path):
    from hetconv.cli import report
    metrics = tmp_path / "m.jsonl"
    traced = step_record(5, 1.9)
    traced["workers"]["w0-cpu"]["trace"] = {"spans": [
        ["forward", 0, -1, 0.0, 0.4], ["wait gather", 3, 1, 0.1, 0.25], ["backward", 0, -1, 0.6, 1.2],
        ["wait GRAD", -1, 0, 0.4, 0.6], ["updates", -1, -1, 1.2, 1.3],
        ["forward", "x", 0, 0, 1], ["wait BN", 0, 0, 0.5, 0.1], "junk", [1, 2, 3, 4, 5]]}     # left out
    traced["workers"]["w1-cpu"]["trace"] = "not a trace"
    metrics.write_text(json.dumps(step_record(4, 2.0)) + "\n" + json.dumps(traced) + "\n")
    run = report.extract(report.read_records(metrics))
    assert list(run.traces) == [5] and list(run.traces[5]) == ["w0-cpu"]
    assert len(run.traces[5]["w0-cpu"]) == 5
    summary = report.summary_markdown(run, str(metrics))
    assert "| w0-cpu | 1.300 | 0.400 | 0.600 | 0.100 | GRAD 0.200, gather 0.150 |" in summary, summary
    if importlib.util.find_spec("matplotlib") is not None:
        assert report.main([str(metrics), "--out", str(tmp_path / "r")]) == 0
        assert (tmp_path / "r" / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
