"""The peer step as data (engine/steptasks.py): what its description holds for a plan, how a
description is priced, and the critical path that says what a priced step waits on."""
import dataclasses

import pytest

from hetconv.channelwise import BatchNorm
from hetconv.engine.costmodel import DeviceProfile, LayerCost, Link, chain_shape
from hetconv.engine.steptasks import StepTasks, Task, describe_peer_step, predict_peer_step, price
from hetconv.geometry import conv_specs

IMAGE = (3, 32, 32)
SPECS = [dataclasses.replace(s, tail=(BatchNorm(),)) for s in conv_specs([8, 16])]


def _profile(name):
    # dX comes at half of a backward call (a path that computes it before dW)
    cost = LayerCost(1e-4, 1e-5, 2e-4, 2e-5, forward_call_s=1e-3, backward_call_s=1e-3, update_per_kernel_s=1e-5,
                     backward_dx_share=0.5)
    return DeviceProfile(name, "cpu", "", (cost, cost))


def _describe(modes, micro_batches=2, batch=8):
    names = ["a", "b"]
    return describe_peer_step(SPECS, IMAGE, batch, {"a": [4, 8], "b": [4, 8]}, {w: 1 for w in names},
                              {w: _profile(w) for w in names}, 0.01, chain_shape(SPECS, IMAGE), modes, micro_batches)


def test_a_data_parallel_steps_description_holds_every_workers_tasks_and_messages():
    step = _describe(["data", "data"])
    by = {}
    for task in step.tasks:
        by.setdefault((task.what, task.worker), []).append(task)
    for w in ("a", "b"):
        # each block's forward and its backward's two parts, per micro-batch; an update per block
        assert len(by[("forward", w)]) == len(by[("backward dx", w)]) == len(by[("backward dw", w)]) == 2 * 2
        assert [t.layer for t in by[("update", w)]] == [0, 1]
        assert all(t.resources == (w,) for t in by[("forward", w)])
    assert len(by[("head", "coordinator")]) == 2
    kinds = {(t.kind, t.worker, t.to) for t in step.tasks if t.what in ("send", "bulk")}
    # every block's sums and weight gradients both ways; the images and features to and from the coordinator
    for src, dst in (("a", "b"), ("b", "a")):
        assert ("BatchNorm sums", src, dst) in kinds and ("weight gradients", src, dst) in kinds
    assert ("images", "coordinator", "a") in kinds and ("features", "b", "coordinator") in kinds
    # nothing waits for a task issued after it: the order a worker runs them
    assert all(j < i for i, t in enumerate(step.tasks) for j in t.after)


def test_a_model_parallel_step_sends_its_partial_input_gradients_as_dx_is_handed_over():
    step = _describe(["model", "model"])
    partial = [(i, t) for i, t in enumerate(step.tasks) if t.kind == "partial input gradients"]
    assert partial and not any(t.kind == "weight gradients" for t in step.tasks)
    for i, t in partial:
        (source,) = t.after                      # the dX part of the sender's backward, not its dW
        assert step.tasks[source].what == "backward dx" and step.tasks[source].worker == t.worker


def test_pricing_waits_for_inputs_and_for_resources_in_issue_order():
    step = StepTasks([], ["a", "b"], 1)
    first = step.add(Task("forward", ("a",), (), 1.0, worker="a", layer=0))
    other = step.add(Task("forward", ("b",), (), 0.5, worker="b", layer=0))
    message = step.add(Task("send", ("b out", "a in"), other, worker="b", to="a", nbytes=2000, kind="block outputs"))
    second = step.add(Task("forward", ("a",), message, 0.25, worker="a", layer=0))
    priced = price(step, Link(1000.0, 0.0))
    # the message leaves at 0.5 and takes 2 s; a's second task waits for it though a is free at 1
    assert [priced.end[i] for i in (*first, *other, *message, *second)] == pytest.approx([1.0, 0.5, 2.5, 2.75])
    assert priced.step_s == pytest.approx(2.75)
    assert priced.critical_path() == [other[0], message[0], second[0]]
    assert priced.critical_seconds() == pytest.approx({"forward": 0.75, "block outputs (message)": 2.0})
    assert priced.busy == pytest.approx({"a": 1.25, "b": 0.5, "b out": 2.0, "a in": 2.0})


def test_the_critical_path_names_the_link_where_the_link_sets_the_step():
    names = ["a", "b"]
    args = (SPECS, IMAGE, 8, {"a": [4, 8], "b": [4, 8]}, {w: 1 for w in names}, {w: _profile(w) for w in names})
    for link, waits_on_link in ((Link(1e4, 1e-4), True), (Link(1e12, 0.0), False)):
        pred = predict_peer_step(*args, link, 0.01, chain_shape(SPECS, IMAGE), ["model", "model"], 2)
        seconds = pred.priced.critical_seconds()
        assert sum(seconds.values()) == pytest.approx(pred.step_s)
        on_link = sum(s for what, s in seconds.items() if what.endswith("(message)"))
        assert (on_link > 0.5 * pred.step_s) == waits_on_link, seconds
        assert pred.to_json()["critical_path_s"] == seconds


def test_a_workers_trace_reaches_the_step_stats_only_as_a_bounded_list_of_spans():
    """STEP_DONE's `trace` comes from the network: the coordinator keeps its spans, at most
    MAX_TRACE_SPANS of them, and nothing else of it; a trace that is not a map of a list is
    dropped (hetconv-report checks every span it draws)."""
    from hetconv.devices import open_device
    from hetconv.engine.contract import MAX_TRACE_SPANS
    from hetconv.engine.local import LocalEngine
    from hetconv.engine.shard import ConvShard
    engine = LocalEngine({"w": ConvShard(open_device("cpu", threads=1))})
    span = ["forward", 0, -1, 0.0, 0.1]
    engine._record("w", None, {"compute_s": 0.1, "trace": {"spans": [span] * (MAX_TRACE_SPANS + 5), "extra": "x"}})
    assert engine.step_stats()["w"]["trace"] == {"spans": [span] * MAX_TRACE_SPANS}
    for bad in ("not a trace", {"spans": "nope"}, {"other": []}, None):
        engine._record("w", None, {"compute_s": 0.1, "trace": bad})
        assert "trace" not in engine.step_stats()["w"], bad
