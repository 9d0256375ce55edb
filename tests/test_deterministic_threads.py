"""--deterministic fixes every thread count that decides a reduction: the same command with 2
threads asked runs 2 threads and gives the same bits under an affinity mask of two cores and of
one (taskset -c 0,1 and -c 0), --local and with two spawned workers; the counts are recorded (the
plan record, the config's runtime) and a --plan FILE carries them; the runtimes that would split a
reduction otherwise (OMP_DYNAMIC, a TBB threading layer) are pinned before Numba loads, or refused.
Why the counts matter: oneDNN's sgemm splits K among 8 or more threads (a (12, 3200) @ (3200, 150)
product differs in ~1,600 of its 1,800 sums between 1 and 8 threads), so on a bigger host a count
taken from the mask changes the bits; on two cores 1 and 2 threads happen to sum alike, so these
tests hold the counts themselves as well as the bits."""
import dataclasses
import json
import os
import subprocess
import sys
import types

import pytest

from conftest import python_cmd
from hetconv import runtimes
from hetconv.cli.coordinator import _deterministic_threads
from hetconv.devices.cpu import CpuDevice
from hetconv.engine.policy import PlanSettings
from hetconv.training import checkpoint
from hetconv.training.config import Config
from hetconv.training.elastic import Elastic, Snapshot

needs_two_cores = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                     reason="needs two cores to set masks of one and of two")

FLAGS = ("--conv", "6,12", "--fc", "16", "--batch-size", "32", "--synthetic-train", "128", "--synthetic-test", "32",
         "--calibration-batch", "4", "--steps", "3", "--seed", "5", "--threads", "2", "--deterministic")


def _on_cores(cores):
    first = sorted(os.sched_getaffinity(0))[:cores]
    return lambda: os.sched_setaffinity(0, first)


def _run(procs, tmp_path, name, cores, *args):
    """One run on the first `cores` cores of this process: (records, losses, final state)."""
    out = tmp_path / name
    p = procs(python_cmd("hetconv.cli.coordinator", *FLAGS, *args, "--metrics", out / "m.jsonl",
                         "--checkpoint-dir", out / "ck"), preexec_fn=_on_cores(cores), env=_plain_env())
    text, _ = p.communicate(timeout=240)
    assert p.returncode == 0, text
    records = [json.loads(line) for line in open(out / "m.jsonl")]
    losses = [r["loss"] for r in records if r["event"] == "step"]
    _, conv, fc = checkpoint.load(str(out / "ck"))
    # each CPU device says its threads as it opens: 2 under either mask, not the mask's count
    assert text.count("cpu (2 threads,") == (1 if "--local" in args else 2), text
    return records, losses, {f"{i}.{k}": a for i, layer in enumerate(conv + fc) for k, a in layer.items()}


def _plain_env():
    """This environment without the settings runtimes.pin makes, so each process makes its own."""
    return {k: v for k, v in os.environ.items() if k not in ("OMP_DYNAMIC", "NUMBA_THREADING_LAYER", "NUMBA_NUM_THREADS")}


def _assert_same_bits(a, b):
    (_, losses_a, state_a), (_, losses_b, state_b) = a, b
    assert losses_a == losses_b and len(losses_a) == 3
    assert sorted(state_a) == sorted(state_b)
    for key in state_a:
        assert state_a[key].tobytes() == state_b[key].tobytes(), key


def _record(records, event):
    return next(r for r in records if r["event"] == event)


@needs_two_cores
def test_local_with_two_threads_gives_the_same_bits_on_one_core_as_on_two(procs, tmp_path):
    two = _run(procs, tmp_path, "two", 2, "--local")
    one = _run(procs, tmp_path, "one", 1, "--local")
    _assert_same_bits(two, one)
    for records, _, _ in (two, one):
        runtime = _record(records, "config")["runtime"]
        assert runtime["head_threads"] == 2 and runtime["omp_dynamic"] == "false"
        assert runtime["threading_layer"] in ("omp", "workqueue")
        assert _record(records, "plan")["threads"] == {"device": 2, "head": 2, "workers": {"local": 2}}


@needs_two_cores
def test_two_spawned_workers_with_two_threads_give_the_same_bits_on_one_core_as_on_two(procs, tmp_path):
    two = _run(procs, tmp_path, "two", 2, "--spawn", "cpu,cpu")
    one = _run(procs, tmp_path, "one", 1, "--spawn", "cpu,cpu")
    _assert_same_bits(two, one)
    for records, _, _ in (two, one):
        threads = _record(records, "plan")["threads"]
        assert threads["device"] == 2 and threads["head"] == 2 and sorted(threads["workers"].values()) == [2, 2]


def test_the_runtimes_are_pinned_before_numba_loads_whatever_the_affinity_mask():
    """A process on one core still has a pool for the count the machine's cores allow, runs
    Numba's loops on OpenMP (or workqueue, never TBB) and OpenMP with OMP_DYNAMIC false."""
    code = ("import os, hetconv, numba, numpy as np\n"
            "from numba import njit, prange\n"
            "f = njit(parallel=True)(lambda a: sum([a[i] for i in prange(a.size)]))\n"
            "f(np.ones(8))\n"
            "print(numba.threading_layer(), os.environ['OMP_DYNAMIC'], numba.config.NUMBA_NUM_THREADS)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_plain_env(),
                         preexec_fn=_on_cores(1) if hasattr(os, "sched_setaffinity") else None)
    assert out.returncode == 0, out.stderr
    layer, dynamic, pool = out.stdout.split()
    assert layer in ("omp", "workqueue") and dynamic == "false" and int(pool) >= (os.cpu_count() or 1)


def test_a_runtime_that_would_split_the_sums_otherwise_is_refused(monkeypatch):
    monkeypatch.setenv("OMP_DYNAMIC", "true")
    monkeypatch.setenv("NUMBA_THREADING_LAYER", "omp")
    assert "OMP_DYNAMIC=true" in runtimes.deterministic_problem()
    with pytest.raises(ValueError, match="OMP_DYNAMIC=true"):
        _deterministic_threads(Config(deterministic=True))
    monkeypatch.setenv("OMP_DYNAMIC", "false")
    assert runtimes.deterministic_problem() == ""
    monkeypatch.setenv("NUMBA_THREADING_LAYER", "tbb")
    assert "NUMBA_THREADING_LAYER=tbb" in runtimes.deterministic_problem()
    assert _deterministic_threads(Config())[0] == Config()          # without --deterministic: untouched


def test_the_deterministic_thread_count_comes_from_the_command_a_plan_or_a_fixed_default(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_DYNAMIC", "false")
    monkeypatch.setenv("NUMBA_THREADING_LAYER", "omp")
    cfg, note = _deterministic_threads(Config(deterministic=True))
    assert cfg.threads == runtimes.DETERMINISTIC_THREADS and "--threads N" in note
    assert _deterministic_threads(Config(deterministic=True, threads=3)) == (Config(deterministic=True, threads=3), "")
    plan = tmp_path / "m.jsonl"
    plan.write_text(json.dumps({"event": "plan", "workers": ["a"], "layers": [], "threads": {"device": 4, "head": 4}})
                    + "\n")
    cfg, note = _deterministic_threads(Config(deterministic=True, plan=str(plan)))
    assert cfg.threads == 4 and note == ""
    with pytest.raises(ValueError, match=r"--threads 2: --plan .* ran its CPU devices on 4 thread"):
        _deterministic_threads(Config(deterministic=True, plan=str(plan), threads=2))


def test_a_cpu_device_of_no_thread_count_takes_a_fixed_one_under_deterministic():
    assert CpuDevice(threads=None, deterministic=True).threads == runtimes.DETERMINISTIC_THREADS
    assert CpuDevice(threads=None).threads == len(os.sched_getaffinity(0))
    assert runtimes.threads_for(0, True) == runtimes.DETERMINISTIC_THREADS and runtimes.threads_for(3, True) == 3


class _Survivors:
    """The engine side of a loss: what Elastic.recover calls."""

    def __init__(self):
        self.workers = ["a", "b"]

    def drop(self, names):
        self.workers = [w for w in self.workers if w not in names]

    def replan(self, specs, input_shapes, settings):
        return types.SimpleNamespace(to_json=lambda: {"workers": self.workers}, table=lambda: "(plan)")

    def load(self, plan, specs, conv):
        pass


@pytest.mark.parametrize("deterministic", [True, False])
def test_a_lost_worker_under_deterministic_says_the_bits_now_differ(deterministic):
    from hetconv.engine.contract import WorkerLost
    lines = []
    cfg = dataclasses.replace(Config(), deterministic=deterministic, min_workers=1)
    net = types.SimpleNamespace(fc_state=lambda: [], load_fc_state=lambda state: None)
    metrics = types.SimpleNamespace(write=lambda *a, **k: None)
    elastic = Elastic(cfg, _Survivors(), net, [], [], PlanSettings.of(cfg), 10, lines.append, metrics)
    elastic.enabled, elastic.snapshot = True, Snapshot(2, [], [])
    assert elastic.recover(WorkerLost("gone", ["b"]), 4)[0] == 2
    said = [line for line in lines if "bits now differ" in line]
    assert len(said) == (1 if deterministic else 0)
    if deterministic:
        assert said[0].startswith("--deterministic: lost b, so the run's bits now differ from an uninterrupted run's")


def test_a_deterministic_cpu_worker_takes_a_fixed_thread_count_and_refuses_a_dynamic_openmp(monkeypatch):
    """What it says at HELLO (the plan's record) is the count it runs, never its cores; and an
    environment that would split its sums otherwise ends it with one line."""
    from hetconv.cli import worker as worker_cli
    from hetconv.worker import WorkerExit
    from hetconv.worker.serve import _check_args
    monkeypatch.setenv("OMP_DYNAMIC", "false")
    monkeypatch.setenv("NUMBA_THREADING_LAYER", "omp")

    def checked(*argv):
        args = worker_cli.build_parser().parse_args(["--connect", "tcp://127.0.0.1:5555", *argv])
        _check_args(args)
        return args.threads

    assert checked("--device", "cpu", "--deterministic") == runtimes.DETERMINISTIC_THREADS
    assert checked("--device", "cpu:2", "--deterministic") == 2
    assert checked("--device", "cpu") == 0                   # without --deterministic: every core, as before
    monkeypatch.setenv("OMP_DYNAMIC", "TRUE")
    with pytest.raises(WorkerExit, match="^OMP_DYNAMIC=TRUE lets OpenMP run a region on fewer threads than asked"):
        checked("--device", "cpu", "--deterministic")
