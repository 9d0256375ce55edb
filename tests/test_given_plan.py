"""--plan: an earlier run's plan record, read from its metrics file (bounded, the newest plan record,
a cut last line ignored) or a plan JSON, and checked against this run before it replaces
calibration: its workers, layers, kernels and data layers' batch."""
import json
from dataclasses import replace

import pytest

from hetconv.engine.planner import PlanError, fixed_plan, given_plan, make_plan, recorded_worker_names
from hetconv.training import metrics
from hetconv.training.metrics import last_plan_record


def _plan():
    return fixed_plan([6, 12], {"w0-cpu:1": [2, 5], "w1-cpu:1": [4, 7]}, modes=["data", "model"],
                      images={"w0-cpu:1": 10, "w1-cpu:1": 22})


def _metrics_file(tmp_path, *plans, tail=""):
    path = tmp_path / "run.jsonl"
    lines = [json.dumps({"event": "config", "config": {}})]
    lines += [json.dumps({"event": "plan", **p.to_json(), "micro_choice": {"micro_batches": 2, "predicted_s": {}}})
              for p in plans]
    path.write_text("\n".join(lines + [json.dumps({"event": "step", "step": 1})]) + "\n" + tail)
    return str(path)


def test_the_newest_plan_record_runs_with_its_micro_batches(tmp_path):
    first = make_plan([6, 12], {"w0-cpu:1": [1.0, 1.0], "w1-cpu:1": [1.0, 1.0]}, "equal")
    path = _metrics_file(tmp_path, first, _plan(), tail='{"event": "step", "st')    # a run killed mid-line
    record = last_plan_record(path)
    assert record["micro_batches"] == 2
    plan = given_plan(record, [6, 12], 32, ["w0-cpu:1", "w1-cpu:1"], path)
    assert plan.counts() == _plan().counts() and plan.modes() == ["data", "model"] and plan.images() == _plan().images()
    assert plan.layers[1].ranges == {"w0-cpu:1": (0, 5), "w1-cpu:1": (5, 12)}


def test_a_plan_json_is_taken_as_it_is(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_plan().to_json()))
    record = last_plan_record(str(path))
    assert "micro_batches" not in record
    assert given_plan(record, [6, 12], 32, ["w1-cpu:1", "w0-cpu:1"], str(path)).counts() == _plan().counts()


@pytest.mark.parametrize("layers,batch,workers,said", [
    ([6, 12, 24], 32, ["w0-cpu:1", "w1-cpu:1"], "a plan of 2 conv layers; this network has 3"),
    ([6, 16], 32, ["w0-cpu:1", "w1-cpu:1"], "conv layer 2 has 12 kernels in the plan, 16 here"),
    ([6, 12], 64, ["w0-cpu:1", "w1-cpu:1"], "split batches of [32] images; this run's --batch-size is 64"),
    ([6, 12], 32, ["w0-cpu:1", "w1-cpu:1", "w2-cpu:1"], "a plan for workers w0-cpu:1, w1-cpu:1; this run has "
                                                        "w0-cpu:1, w1-cpu:1, w2-cpu:1"),
], ids=["layers", "kernels", "batch", "workers"])
def test_a_plan_that_does_not_fit_the_run_is_refused_naming_what_differs(tmp_path, layers, batch, workers, said):
    path = _metrics_file(tmp_path, _plan())
    with pytest.raises(PlanError) as e:
        given_plan(last_plan_record(path), layers, batch, workers, path)
    assert said in str(e.value) and path in str(e.value)


def test_kernel_ranges_out_of_order_are_refused(tmp_path):
    record = _plan().to_json()
    record["layers"][1]["ranges"] = {"w0-cpu:1": [7, 12], "w1-cpu:1": [0, 7]}
    with pytest.raises(PlanError, match="not contiguous in the plan's worker order"):
        given_plan(record, [6, 12], 32, ["w0-cpu:1", "w1-cpu:1"], "plan.json")


def test_files_without_a_plan_are_refused_in_one_line(tmp_path, monkeypatch):
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"event": "config"}\n')
    with pytest.raises(ValueError, match="holds no plan record"):
        last_plan_record(str(empty))
    with pytest.raises(ValueError, match="cannot be read"):
        last_plan_record(str(tmp_path / "missing.jsonl"))
    monkeypatch.setattr(metrics, "MAX_RECORD_BYTES", 64)
    long = tmp_path / "long.jsonl"
    long.write_text("x" * 200 + "\n")
    with pytest.raises(ValueError, match="line 1 is over"):
        last_plan_record(str(long))
    with pytest.raises(PlanError, match="not a stored plan"):
        given_plan({"workers": ["a"], "layers": [{"ranges": {}}]}, [6], 8, ["a"], "bad.json")


class _Engine:
    """What the loop's plan choice reads of an engine: its workers and a plan set by hand."""

    def __init__(self, workers, fixed_plan=None):
        self.workers, self.fixed_plan = list(workers), fixed_plan


def _specs(*kernels):
    from hetconv.geometry import ConvSpec
    return [ConvSpec(3, k) for k in kernels]


def _resumed(plan, micro):
    return {"path": "ck/ckpt-step0000004.npz", "plan": plan.to_json(), "micro_batches": micro}


@pytest.mark.parametrize("micro,given,taken", [(2, 0, 2), (True, 0, 0), (-3, 0, 0), ("2", 0, 0), (2, 4, 4)],
                         ids=["recorded", "a bool", "negative", "a string", "--micro-batches given"])
def test_a_resume_onto_the_same_workers_runs_the_checkpoints_plan_and_only_a_sound_count(micro, given, taken):
    from hetconv.training.config import Config
    from hetconv.training.loop import _reproducible
    said, engine = [], _Engine(["w0-cpu:1", "w1-cpu:1"])
    cfg = _reproducible(Config(conv="6,12", batch_size=32, micro_batches=given), engine, _specs(6, 12), said.append,
                        _resumed(_plan(), micro))
    assert engine.fixed_plan.counts() == _plan().counts() and cfg.micro_batches == taken
    assert ("micro-batches" in said[0]) == (given == 0 and taken > 0), said


def test_a_checkpoints_plan_that_does_not_fit_is_said_and_a_plan_set_by_hand_stands():
    from hetconv.training.config import Config
    from hetconv.training.loop import _reproducible
    said, engine = [], _Engine(["w0-cpu:1", "w1-cpu:1"])
    _reproducible(Config(conv="6,16", batch_size=32), engine, _specs(6, 16), said.append, _resumed(_plan(), 2))
    assert engine.fixed_plan is None and "not run again" in said[0] and "calibrating a new one" in said[0]
    mine = fixed_plan([6, 12], {"w0-cpu:1": [3, 6], "w1-cpu:1": [3, 6]})
    engine = _Engine(["w0-cpu:1", "w1-cpu:1"], fixed_plan=mine)
    _reproducible(Config(conv="6,12", batch_size=32), engine, _specs(6, 12), said.append, _resumed(_plan(), 2))
    assert engine.fixed_plan is mine


def test_a_plan_that_left_a_worker_out_runs_on_the_same_workers_given_or_resumed(tmp_path):
    """The planner may leave a slow worker out (its fixed cost outweighs its share): the plan is
    still this run's; that worker idles again. A worker neither in the plan nor left out is not."""
    from hetconv.training.config import Config
    from hetconv.training.loop import _reproducible
    alone = replace(fixed_plan([6, 12], {"w0-cpu:1": [6, 12]}), left_out={"w1-cpu:1": "adds 0.01 s of fixed work"})
    path = _metrics_file(tmp_path, alone)
    plan = given_plan(last_plan_record(path), [6, 12], 32, ["w1-cpu:1", "w0-cpu:1"], path)
    assert plan.workers == ("w0-cpu:1",) and plan.left_out == alone.left_out
    with pytest.raises(PlanError, match=r"a plan for workers w0-cpu:1 \(left out: w1-cpu:1\); this run has w0-cpu:1 \("):
        given_plan(last_plan_record(path), [6, 12], 32, ["w0-cpu:1"], path)
    bad = dict(alone.to_json(), left_out={"w1-cpu:1": 3})
    with pytest.raises(PlanError, match="left-out workers .* are not names with reasons"):
        given_plan(bad, [6, 12], 32, ["w0-cpu:1", "w1-cpu:1"], "bad.json")
    said, engine = [], _Engine(["w0-cpu:1", "w1-cpu:1"])
    _reproducible(Config(conv="6,12", batch_size=32), engine, _specs(6, 12), said.append, _resumed(alone, 0))
    assert engine.fixed_plan.workers == ("w0-cpu:1",) and "checkpoint's: running its plan" in said[0]


def test_a_recorded_plans_worker_names_are_read_only_from_what_names_them():
    assert recorded_worker_names({"workers": ["b", "a"], "left_out": {"c": "slow"}}) == ["a", "b", "c"]
    assert recorded_worker_names({"workers": ["a"], "left_out": ["b"]}) == ["a"]     # not a mapping: no names
    assert recorded_worker_names({"workers": "ab"}) == [] and recorded_worker_names(None) == []


# ---- refused before any worker starts ----------------------------------------------------------

@pytest.mark.parametrize("flags,said", [
    (["--spawn", "cpu:1,cpu:1", "--conv", "6,16"], "conv layer 2 has 12 kernels in the plan, 16 here"),
    (["--spawn", "cpu:1,cpu:1", "--batch-size", "64"], "split batches of [32] images; this run's --batch-size is 64"),
    (["--spawn", "cpu:1,cpu:1,cpu:1"], "a plan for workers w0-cpu:1, w1-cpu:1; this run has w0-cpu:1, w1-cpu:1, "
                                       "w2-cpu:1"),
    (["--workers", "3"], "a plan for 2 workers (w0-cpu:1, w1-cpu:1); this run waits for --workers 3"),
    (["--local"], "a plan for workers w0-cpu:1, w1-cpu:1; this run has local"),
], ids=["network", "batch", "spawned workers", "external workers", "local"])
def test_a_plan_of_another_run_is_refused_before_any_worker_starts(tmp_path, monkeypatch, capsys, flags, said):
    from hetconv.cli import coordinator

    def no_workers(*args, **kwargs):
        raise AssertionError("a worker or device was started before the plan was checked")
    monkeypatch.setattr(coordinator, "RemoteEngine", no_workers)
    monkeypatch.setattr(coordinator, "open_device", no_workers)
    path = _metrics_file(tmp_path, _plan())
    argv = ["--conv", "6,12", "--fc", "8", "--batch-size", "32", "--plan", path, *flags]
    assert coordinator.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"hetconv-coordinator: --plan {path}: " in err and said in err, err


def test_a_plan_of_this_run_passes_the_check_before_the_workers_start(tmp_path):
    from hetconv.cli import coordinator
    path = _metrics_file(tmp_path, _plan())
    argv = ["--conv", "6,12", "--fc", "8", "--batch-size", "32", "--plan", path, "--spawn", "cpu:1,cpu:1"]
    assert coordinator.prepare(coordinator.build_parser().parse_args(argv), argv).cfg.plan == path
