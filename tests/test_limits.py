"""Every socket caps the size of one received frame near the largest array the run moves: a peer
cannot make a process allocate more, and a worker whose own cap is too low for the run says so."""
import subprocess
import time

import numpy as np
import pytest
import zmq

from conftest import python_cmd
from hetconv.transport import protocol as P
from hetconv.geometry import conv_specs, largest_array_bytes, message_limit_bytes
from hetconv.coordinator.remote import RemoteEngine
from hetconv.engine.policy import PlanSettings
from test_distributed import free_port, quiet


def test_the_largest_array_is_found_by_hand():
    # conv 6,12 (5x5, no padding) on 3x32x32 at batch 4: the images are the largest array,
    # 4*3*32*32 floats; conv2's input 4*6*14*14, its weights 12*6*5*5, the output 4*12*5*5
    assert largest_array_bytes(conv_specs([6, 12]), 4) == 4 * 3 * 32 * 32 * 4
    # wide kernels: conv2's weights (64*600*25) outgrow its input at batch 1 (600*14*14)
    assert largest_array_bytes(conv_specs([600, 64]), 1) == 64 * 600 * 5 * 5 * 4
    assert message_limit_bytes(conv_specs([6, 12]), 4) > largest_array_bytes(conv_specs([6, 12]), 4)


@pytest.mark.timeout(60)
def test_a_frame_over_the_limit_is_never_delivered_and_the_coordinator_keeps_serving():
    limit = 200_000
    engine = RemoteEngine("tcp://127.0.0.1:0", 0, ["cpu"], threads=1, log=quiet, message_limit=limit, insecure=True)
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.linger = 0
    try:
        assert engine.sock.getsockopt(zmq.MAXMSGSIZE) == limit
        rogue.connect(engine.address)
        big = np.zeros(limit // 4 + 1000, np.float32)                  # one frame just over the limit
        rogue.send_multipart(P.pack("HELLO", 0, [big], name="rogue"))
        # libzmq drops the connection that carried it before the frame is read whole
        name = engine.workers[0]
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:                              # the engine goes on serving meanwhile
            replies = engine._call({name: ("CALIBRATE", [], {"layers": [], "repeats": 1})}, "a request after the big frame")
            assert replies[name][1]["speeds"] == []
        names = [hello.get("name") for hello, _ in engine.joining.values()]
        assert "rogue" not in names, "a frame over the limit got through"   # (without the limit, it does)
    finally:
        rogue.close(0)
        ctx.term()
        engine.close()


@pytest.mark.timeout(120)
def test_a_worker_whose_limit_is_below_the_runs_says_how_to_raise_it(procs):
    address = f"tcp://127.0.0.1:{free_port()}"
    coord = procs(python_cmd("hetconv.cli.coordinator", "--workers", "1", "--bind", address, "--connect-timeout", "15",
                             "--conv", "6,12", "--fc", "8", "--batch-size", "8", "--steps", "1",
                             "--synthetic-train", "64", "--synthetic-test", "16"))
    worker = subprocess.run(python_cmd("hetconv.cli.worker", "--device", "cpu", "--connect", address, "--threads", "1",
                                       "--message-limit-mb", "0.01"), capture_output=True, text=True, timeout=60)
    assert worker.returncode == 2, worker.stderr
    assert "start the worker with --message-limit-mb 2" in worker.stderr, worker.stderr
    out, _ = coord.communicate(timeout=60)
    assert coord.returncode == 1 and "start the worker with --message-limit-mb 2" in out, out   # says why too


def test_replies_of_the_wrong_shape_are_named_not_concatenated():
    """A shard whose forward output, partial dX or fetched weights have another shape than the
    plan and the layer geometry say fails the request naming it (the star path's checks)."""
    from hetconv.devices import open_device
    from hetconv.engine.local import LocalEngine
    from hetconv.engine.contract import WorkerError
    from hetconv.geometry import ConvSpec
    from hetconv.engine.planner import fixed_plan
    from hetconv.engine.shard import ConvShard

    spec = ConvSpec.paper(3, 4, 3, 0)
    rng = np.random.default_rng(0)
    w, b = rng.standard_normal((4, 3, 3, 3)).astype(np.float32), np.zeros(4, np.float32)
    shards = {"a": ConvShard(open_device("cpu", threads=1)), "b": ConvShard(open_device("cpu", threads=1))}
    engine = LocalEngine(shards)
    engine.load(fixed_plan([4], {"a": [1], "b": [3]}), [spec], [(w, b, None, None)])
    x = rng.standard_normal((2, 3, 10, 10)).astype(np.float32)
    y = engine.forward(0, x)
    assert y.shape == (2, 4, 4, 4)
    engine.backward(0, np.ones_like(y), need_dx=True)

    # the first worker lies: the expected shape comes from the layer's geometry, not from a reply
    honest_forward, honest_backward = shards["a"].forward_layer, shards["a"].backward_layer
    shards["a"].forward_layer = lambda *a, **k: {m: y[:, :, :3] for m, y in honest_forward(*a, **k).items()}
    with pytest.raises(WorkerError, match=r"worker a failed during forward conv1: ShapeError: reply array 0 has "
                                          r"shape \(2, 1, 3, 4\), the plan expects \(2, 1, 4, 4\)"):
        engine.forward(0, x)                                                           # one row short
    shards["a"].forward_layer = honest_forward
    engine.forward(0, x)
    shards["a"].backward_layer = lambda *a, **k: {m: dx[:, :, 1:] for m, dx in honest_backward(*a, **k).items()}
    with pytest.raises(WorkerError, match=r"worker a failed during backward conv1: .*shape \(2, 3, 9, 10\), "
                                          r"the plan expects \(2, 3, 10, 10\)"):
        engine.backward(0, np.ones_like(y), need_dx=True)                              # dX cropped
    honest_fetch = shards["a"].fetch
    shards["a"].fetch = lambda layer: {**honest_fetch(layer), "w": honest_fetch(layer)["w"][:, :2]}
    with pytest.raises(WorkerError, match=r"worker a failed during fetching conv1: .*shape \(1, 2, 3, 3\), the plan "
                                          r"expects \(1, 3, 3, 3\)"):
        engine.gather()


# A worker whose conv output is one row short: it sends FEATURES of the wrong height.
_LYING_WORKER = ("import sys\nfrom hetconv.engine import shard\nhonest = shard.ConvShard.forward_layer\n"
                 "def lying(self, layer, inputs, train, reduce=None, emit=None, dropout=None, batch=None):\n"
                 "    return honest(self, layer, inputs, train, reduce, lambda m, y: emit(m, y[:, :, :-1]), dropout,\n"
                 "                  batch)\n"
                 "shard.ConvShard.forward_layer = lying\n"
                 "from hetconv.cli.worker import main\nsys.exit(main())\n")


def test_peer_features_of_the_wrong_shape_are_named(procs):
    """The peer exchange's check on the last layer's slices (FEATURES) takes H and W from the
    layer's geometry: a worker that sends a short map fails the step, named, with both shapes."""
    import sys

    from hetconv.engine.contract import WorkerError
    from hetconv.geometry import ConvSpec
    from hetconv.engine.planner import fixed_plan

    address = f"tcp://127.0.0.1:{free_port()}"
    procs([sys.executable, "-c", _LYING_WORKER, "--device", "cpu", "--connect", address, "--threads", "1",
           "--name", "liar"])
    engine = RemoteEngine(address, 1, threads=1, connect_timeout=60, worker_timeout=10.0, log=quiet, exchange="peer")
    try:
        rng = np.random.default_rng(0)
        spec = ConvSpec.paper(3, 4, 3, 0)
        w, b = rng.standard_normal((4, 3, 3, 3)).astype(np.float32), np.zeros(4, np.float32)
        engine.load(fixed_plan([4], {"liar": [4]}), [spec], [(w, b, None, None)])
        x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
        with pytest.raises(WorkerError, match=r"liar.*ShapeError: FEATURES for micro-batch 0: float32 \(2, 4, 2, 3\); "
                                              r"the plan expects float32 \(2, 4, 3, 3\)"):
            engine.predict(x)
    finally:
        engine.close()


def test_a_graphs_features_of_the_wrong_shape_are_named(procs):
    """A graph's step: the plan's first worker sends the whole feature map, which the coordinator
    checks against the graph's feature shape and float32 before the head reads it. Every block of
    the liar comes out one row short, so its two branches still concatenate (each lost two rows)
    and only the features show it."""
    import sys

    from hetconv.devices.cpu import HostArrays
    from hetconv.engine.contract import WorkerError
    from hetconv.engine.graph import graph_pass
    from hetconv.engine.planner import fixed_plan
    from hetconv.geometry import ConvSpec
    from hetconv.net import NetSpec

    spec = NetSpec.from_json({"input_shape": [3, 8, 8], "classes": 2, "nodes": [
        {"name": "stem", "inputs": ["input"], "type": "conv", "out_channels": 4, "kernel": 3, "padding": 1},
        {"name": "a", "inputs": ["stem"], "type": "conv", "out_channels": 2, "kernel": 1},
        {"name": "b", "inputs": ["stem"], "type": "conv", "out_channels": 3, "kernel": 1},
        {"name": "cat", "inputs": ["a", "b"], "type": "concat"},
        {"name": "flatten", "inputs": ["cat"], "type": "flatten"},
        {"name": "fc", "inputs": ["flatten"], "type": "linear", "out_features": 2}]})
    specs = [ConvSpec.from_layer(b) for b in spec.conv_layers()]
    address = f"tcp://127.0.0.1:{free_port()}"
    procs([sys.executable, "-c", _LYING_WORKER, "--device", "cpu", "--connect", address, "--threads", "1",
           "--name", "liar"])
    engine = RemoteEngine(address, 1, threads=1, connect_timeout=60, worker_timeout=10.0, log=quiet, exchange="peer")
    engine.configure(graph_pass(spec, HostArrays()))
    try:
        rng = np.random.default_rng(0)
        params = [(rng.standard_normal((s.kernels, s.in_channels, s.kh, s.kw)).astype(np.float32),
                   np.zeros(s.kernels, np.float32), None, None) for s in specs]
        engine.load(fixed_plan([s.kernels for s in specs], {"liar": [s.kernels for s in specs]}), specs, params)
        with pytest.raises(WorkerError, match=r"liar.*ShapeError: FEATURES for micro-batch 0: float32 \(2, 5, 6, 8\); "
                                              r"the plan expects float32 \(2, 5, 8, 8\) for micro-batch 0, from liar"):
            engine.predict(rng.standard_normal((2, 3, 8, 8)).astype(np.float32))
    finally:
        engine.close()


def test_a_malformed_calibration_is_named_before_the_cost_model_reads_it():
    """CALIBRATED comes from the network: the coordinator checks its shape, names the worker and
    what is wrong, instead of failing deep inside the cost model's fit."""
    import copy

    from hetconv.engine.calibrated import checked_calibration as _checked_calibration
    from hetconv.devices import open_device
    from hetconv.engine.contract import WorkerError
    from hetconv.engine.shard import ConvShard

    specs = conv_specs([4, 6], 3)
    speeds, timings = ConvShard(open_device("cpu", threads=1)).calibrate(specs, [(4, 3, 12, 12), (4, 4, 5, 5)],
                                                                         [4, 6], repeats=1)
    good = {"speeds": speeds, "timings": timings}
    assert _checked_calibration("w0", good, 2) == (speeds, timings)

    def broken(change):
        fields = copy.deepcopy(good)
        change(fields)
        return fields
    cases = [
        (lambda f: f.update(speeds=[1.0]), r"speeds \[1\.0\], expected 2 positive finite numbers"),
        (lambda f: f["speeds"].__setitem__(0, float("nan")), "expected 2 positive finite numbers"),
        (lambda f: f.update(timings=f["timings"][:1]), "timings for 1 layers, expected 2"),
        (lambda f: f["timings"].__setitem__(1, "fast"), "conv2 is str, not a map"),
        (lambda f: f["timings"][0].update(batch=0), "conv1: batch 0, expected a positive integer"),
        (lambda f: f["timings"][0].update(kernels=[4, 2, 1]), "conv1: kernels .*expected one or two positive"),
        (lambda f: f["timings"][1].update(forward_s=[0.1]), r"conv2: forward_s \[0\.1\], expected 2 positive finite"),
        # a zero time would make a free device: the planner sizes a share by dividing by it
        (lambda f: f["timings"][0].update(forward_s=[0.0, 0.0]), r"conv1: forward_s \[0\.0, 0\.0\], expected 2 positive"),
        (lambda f: f["timings"][1]["half_batch"].update(backward_s=[0.1, 0.0]), "conv2 half_batch: backward_s"),
        (lambda f: f["timings"][1]["half_batch"].update(backward_s=[0.1, -1.0]), "conv2 half_batch: backward_s"),
        (lambda f: f["timings"][0].update(half_batch=[]), "conv1 half_batch is list, not a map"),
        (lambda f: f["timings"][0].update(update_s=True), "conv1: update_s True, expected finite"),
        (lambda f: f["timings"][0].update(update_kernels="4"), "conv1: update_kernels '4', expected an integer"),
    ]
    for change, message in cases:
        with pytest.raises(WorkerError, match=r"worker w0 failed during calibration: CalibrationError: a malformed "
                                              r"calibration: .*" + message):
            _checked_calibration("w0", broken(change), 2)


def test_workers_waiting_to_join_are_bounded_and_one_more_is_refused_in_words():
    """Without keys (--insecure) anyone can say HELLO, each time from a new routing id: the run
    keeps at most MAX_JOINING of them until its next snapshot, refuses the rest with an ERROR the
    worker prints, and logs the first refusal only."""
    from types import SimpleNamespace

    from hetconv.coordinator.remote import MAX_JOINING

    sent, told, log = [], [], []
    stub = SimpleNamespace(joining={}, joiners_refused=0, log=log.append, zmq=zmq, _tell_to_wait=told.append,
                           sock=SimpleNamespace(send_multipart=lambda frames, flags=0: sent.append(frames)))

    def hello(i):
        return [zmq.Frame(f"stranger-{i}".encode())] + [zmq.Frame(f) for f in P.pack("HELLO", 0, name=f"s{i}")]
    for i in range(MAX_JOINING + 50):
        RemoteEngine._note_stranger(stub, hello(i))
    assert len(stub.joining) == MAX_JOINING and len(told) == MAX_JOINING
    RemoteEngine._note_stranger(stub, hello(0))                    # one already waiting says HELLO again: kept
    assert len(stub.joining) == MAX_JOINING and stub.joiners_refused == 50
    assert len(sent) == 50
    refusal = P.unpack(sent[0][1:])
    assert refusal.op == "ERROR" and f"at most {MAX_JOINING} at a time" in refusal.fields["message"]
    assert sum("refused worker" in line for line in log) == 1


def test_peers_tells_the_workers_the_most_a_step_of_the_run_needs():
    """The bounds a worker holds a peer's next step to: the rule's micro-batch count (or the one
    set by hand), and twice the run's largest array."""
    from types import SimpleNamespace

    from hetconv.training.config import Config
    specs, shapes = conv_specs([6, 12]), [(8, 3, 32, 32), (8, 6, 14, 14)]
    for micro, batch, expected in ((0, 128, 4), (0, 32, 2), (0, 8, 1), (16, 32, 16)):
        stub = SimpleNamespace()
        RemoteEngine._note_step_bounds(stub, specs, shapes, PlanSettings.of(Config(micro_batches=micro,
                                                                                  batch_size=batch)))
        assert stub.step_bounds == {"micro_batches": expected, "early_bytes": 2 * largest_array_bytes(specs, batch)}
