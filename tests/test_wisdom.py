"""Conv path wisdom (as FFTW's): a path a CPU device timed is kept per machine and reused by the
next device of that machine; `retime` times it again; `deterministic` chooses by rule with no
clock; a run's choices go into its checkpoints and `--resume` runs them again. In this process,
with fake timers on small layers: a few seconds in all."""
import json
import os
import re
import threading
from dataclasses import replace

import numpy as np
import pytest

import _hostile_checkpoints as hostile
from _bf16 import DNNL_MISSING
from hetconv.cli import coordinator
from hetconv.devices import wisdom as W
from hetconv.devices.cpu_options import CpuOptions
from hetconv.devices.cpu import CpuDevice
from hetconv.engine.local import LocalEngine
from hetconv.engine.planner import fixed_plan
from hetconv.engine.shard import ConvShard, ShardServer
from hetconv.geometry import ConvBlock, ConvSpec
from hetconv.transport import protocol as P
from hetconv.training import checkpoint
from hetconv.training.config import Config

RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, 3, 10, 10)).astype(np.float32)
WEIGHTS = RNG.standard_normal((4, 3, 3, 3)).astype(np.float32)


class Timer:
    """A fake auto_timer: `best` takes 1 s, every other path 2 s; counts its calls."""

    def __init__(self, best):
        self.best, self.calls = best, 0

    def __call__(self, path, run):
        self.calls += 1
        return 1.0 if path == self.best else 2.0


def never(path, run):
    raise AssertionError(f"timed {path}, where nothing may be timed")


def device(timer, wisdom=None, **options):
    """A one-thread CPU device that times every call (no size floor) with `timer`."""
    return CpuDevice(threads=options.pop("threads", 1), auto_timed_min_flops=0, auto_timer=timer, wisdom=wisdom,
                     **options)


def choice(dev):
    """(path, why) of the device's one call shape."""
    (c,) = dev.conv_path_choices()
    return c["path"], c["why"]


def stored(path):
    """{call key: path} of every entry a wisdom file holds."""
    with open(path, "rb") as f:
        entries, problem = W.parse(f.read())
    assert problem == ""
    return {call: e["path"] for (_, call), e in entries.items()}


# ---- reuse ------------------------------------------------------------------------------------------

def test_a_second_device_runs_the_path_the_first_one_timed_and_retime_times_it_again(tmp_path):
    path = tmp_path / "conv-paths.json"
    first = device(Timer("im2col"), W.Wisdom(path))
    first.conv2d(X, WEIGHTS, None)
    assert choice(first) == ("im2col", "timed")
    # another process's device: a timer that would choose shifted, never asked
    timer = Timer("shifted")
    second = device(timer, W.Wisdom(path))
    y = second.conv2d(X, WEIGHTS, None)
    assert choice(second) == ("im2col", "wisdom") and timer.calls == 0
    np.testing.assert_array_equal(y, first.conv2d(X, WEIGHTS, None))       # the same path, the same bits
    # --retime: timed again, and the file then says what this timing chose
    timer = Timer("shifted")
    third = device(timer, W.Wisdom(path), retime=True)
    third.conv2d(X, WEIGHTS, None)
    assert choice(third) == ("shifted", "timed") and timer.calls > 0
    assert list(stored(path).values()) == ["shifted"]
    fourth = device(Timer("im2col"), W.Wisdom(path))
    fourth.conv2d(X, WEIGHTS, None)
    assert choice(fourth) == ("shifted", "wisdom")


@pytest.mark.parametrize("other", [{"threads": 2}, {"precision": "auto"}])
def test_a_device_of_other_threads_or_precision_is_another_machine(tmp_path, other):
    path = tmp_path / "conv-paths.json"
    device(Timer("im2col"), W.Wisdom(path)).conv2d(X, WEIGHTS, None)
    timer = Timer("shifted")
    dev = device(timer, W.Wisdom(path), **other)
    dev.conv2d(X, WEIGHTS, None)
    assert choice(dev)[1] == "timed" and timer.calls > 0
    machines = {m for m, _ in W.parse(open(path, "rb").read())[0]}
    assert len(machines) == 2                  # both kept, each under its own machine key


def test_a_stored_path_this_call_cannot_take_is_passed_over(tmp_path):
    path = tmp_path / "conv-paths.json"
    first = device(Timer("im2col"), W.Wisdom(path))
    key = first._machine_key()[1]
    call = W.canonical(W.call_key(X.shape, WEIGHTS.shape, (1, 1), (0, 0), None))
    W.Wisdom(path).store(key, call, "no-such-path")
    timer = Timer("shifted")
    dev = device(timer, W.Wisdom(path))
    dev.conv2d(X, WEIGHTS, None)
    assert choice(dev) == ("shifted", "timed") and timer.calls > 0


def test_a_stored_timing_serves_the_layers_other_shares_as_a_timing_made_here_would(tmp_path):
    """Calibration's two kernel counts: the second is 'as timed for' the first, from the wisdom too."""
    path = tmp_path / "conv-paths.json"
    w8 = RNG.standard_normal((8, 3, 3, 3)).astype(np.float32)
    device(Timer("im2col"), W.Wisdom(path)).conv2d(X, w8, None)
    dev = device(never, W.Wisdom(path))
    dev.conv2d(X, w8, None)
    dev.conv2d(X, WEIGHTS, None)                # half the kernels: never timed
    whys = [c["why"] for c in dev.conv_path_choices()]
    assert whys[0] == "wisdom" and whys[1].startswith("as timed for x (2, 3, 10, 10) w (8, 3, 3, 3)")


BLOCK = ConvBlock(padding=(1, 1))


def test_whether_a_call_would_be_timed_is_answered_without_timing_and_a_choice_made_so_is_kept(tmp_path):
    """conv_block_needs_timing: True for a shape the device would time (the timer never asked),
    False once it ran; a shape the wisdom or the rule chooses is chosen by the question itself."""
    path = tmp_path / "conv-paths.json"
    timer = Timer("im2col")
    dev = device(timer, W.Wisdom(path))
    assert dev.conv_block_needs_timing(X.shape, WEIGHTS.shape, BLOCK) and timer.calls == 0
    assert dev.conv_path_choices() == []
    dev.conv_block(X, WEIGHTS, None, BLOCK)
    assert timer.calls > 0 and not dev.conv_block_needs_timing(X.shape, WEIGHTS.shape, BLOCK)
    second = device(never, W.Wisdom(path))          # this machine's wisdom has the shape
    assert not second.conv_block_needs_timing(X.shape, WEIGHTS.shape, BLOCK)
    assert choice(second) == ("im2col", "wisdom")
    ruled = device(never, deterministic=True)
    assert not ruled.conv_block_needs_timing(X.shape, WEIGHTS.shape, BLOCK) and choice(ruled)[1] == "rule (deterministic)"
    small = CpuDevice(threads=1, auto_timer=never, wisdom=None)   # under the timed size: the rule's
    assert not small.conv_block_needs_timing(X.shape, WEIGHTS.shape, BLOCK)
    assert choice(small)[1].startswith("rule: ")


def test_a_plans_call_shapes_are_timed_before_its_first_step_and_no_step_times_one(tmp_path, monkeypatch):
    """A --local run times its step's call shapes before the step (a "prepare" record, step 0),
    and no training step times any: a timing inside the step would raise."""
    in_step = [False]

    def timer(path, run):
        assert not in_step[0], f"timed {path} inside a training step"
        return 1.0 if path == "im2col" else 2.0

    real_open, real_step = coordinator.open_device, LocalEngine.conv_step

    def step(self, *args, **kwargs):
        in_step[0] = True
        try:
            return real_step(self, *args, **kwargs)
        finally:
            in_step[0] = False
    monkeypatch.setattr(coordinator, "open_device",
                        lambda spec, **o: real_open(spec, auto_timed_min_flops=0, auto_timer=timer, **o))
    monkeypatch.setattr(LocalEngine, "conv_step", step)
    metrics = tmp_path / "m.jsonl"
    assert coordinator.main([*TINY, "--steps", "2", "--eval-every", "0", "--metrics", str(metrics)]) == 0
    (prepared,) = events(metrics, "prepare")
    assert prepared["step"] == 0 and prepared["workers"]["local"]["ran"] == 2 == prepared["workers"]["local"]["calls"]
    assert [r["event"] for r in map(json.loads, open(metrics))].index("prepare") < \
        [r["event"] for r in map(json.loads, open(metrics))].index("step")


@pytest.mark.parametrize("call,expected", [
    ({"layer": 0, "input_shape": [2, 3, 10, 10], "kernels": 4}, "expected layer, spec, input_shape and kernels"),
    ({"layer": 0, "spec": ConvSpec(3, 4).to_json(), "input_shape": [2, 5, 10, 10], "kernels": 4},
     "do not fit conv layer 1 \\(3 input channels, 4 kernels\\)"),
    ({"layer": 0, "spec": ConvSpec(3, 4).to_json(), "input_shape": [2, 3, 10, 10], "kernels": 9}, "9 kernels do not fit"),
    ({"layer": 0, "spec": ConvSpec(3, 4).to_json(), "input_shape": [0, 3, 10, 10], "kernels": 4}, "do not fit"),
], ids=["no spec", "other channels", "too many kernels", "no images"])
def test_a_prepare_call_that_does_not_fit_its_layer_is_refused_by_name(call, expected):
    server = ShardServer(ConvShard(device(never)))
    with pytest.raises(Exception, match=f"PREPARE call 0: .*{expected}"):
        server.handle("PREPARE", [], {"calls": [call]})


def test_the_workers_prepared_fields_are_kept_only_where_well_formed():
    from hetconv.training.loop import prepared_record
    got = prepared_record({"a": {"calls": 3, "ran": 2, "seconds": 1.5, "extra": "x" * 10},
                           "b": {"calls": "3", "ran": True, "seconds": float("nan")}, "c": {}})
    assert got == {"a": {"calls": 3, "ran": 2, "seconds": 1.5}, "b": {"calls": 0, "ran": 0, "seconds": 0.0},
                   "c": {"calls": 0, "ran": 0, "seconds": 0.0}}


# ---- the file ----------------------------------------------------------------------------------------

def test_a_store_replaces_the_file_whole_or_not_at_all(tmp_path, monkeypatch, capsys):
    path = tmp_path / "conv-paths.json"
    wisdom = W.Wisdom(path)
    wisdom.store(_machine(1), W.canonical(W.call_key((1, 1, 4, 4), (1, 1, 3, 3), (1, 1), (0, 0), None)), "im2col")
    before = path.read_bytes()

    def fail(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(W.os, "replace", fail)
    wisdom.store(_machine(1), W.canonical(W.call_key((2, 1, 4, 4), (1, 1, 3, 3), (1, 1), (0, 0), None)), "shifted")
    assert path.read_bytes() == before                      # the old file, whole
    assert sorted(os.listdir(tmp_path)) == ["conv-paths.json", "conv-paths.json.lock"]     # no temporary left
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and "No space left on device" in err


def _machine(threads):
    return W.canonical({**W.machine_key(threads, "fp32", "auto", None, ["im2col"])})


def test_two_writers_at_once_lose_nothing(tmp_path):
    """Two processes' objects on one file, storing at the same time: the lock and the merge keep
    every entry of both (each had read the file before the other wrote)."""
    path = tmp_path / "conv-paths.json"
    writers = [W.Wisdom(path), W.Wisdom(path)]
    for w in writers:
        assert w.lookup(_machine(1), "nothing") is None      # both read the (missing) file first

    def store(i):
        for n in range(1, 21):
            writers[i].store(_machine(i + 1), W.canonical(W.call_key((n, 3, 8, 8), (4, 3, 3, 3), (1, 1), (0, 0),
                                                                      None)), "im2col" if i else "shifted")
    threads = [threading.Thread(target=store, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    entries, problem = W.parse(path.read_bytes())
    assert problem == "" and len(entries) == 40
    assert {e["path"] for (m, _), e in entries.items() if m == _machine(1)} == {"shifted"}


@pytest.mark.parametrize("content, message, kept", [
    (b"{not json", "not JSON", True),
    (b"[1, 2]", "not a wisdom file of format 1", True),
    (b'{"format": 2, "machines": []}', "not a wisdom file of format 1 (a map with its format and a list of machines; "
                                       "this one has format 2)", True),
    (b'{"format": 1, "machines": [{"machine": {"cpu": 3}, "calls": []}]}', "a machine key has the fields", False),
    (None, "more than the 200 a wisdom file may hold", True),
    (b'{"format": 1, "machines": [{"machine": {}, "calls": []}, {"machine": {}, "calls": []}]}',
     "2 machine keys, more than 1", False),
], ids=["not JSON", "not a map", "another format", "a bad entry", "too big", "too many machines"])
def test_a_file_that_cannot_be_read_is_ignored_in_one_line_and_the_device_times(tmp_path, monkeypatch, capsys,
                                                                                 content, message, kept):
    """A file of this format with bad entries is written over, less them; one that is not a
    wisdom file of this format (another version's, not hetconv's) is left as it is."""
    path = tmp_path / "conv-paths.json"
    if content is None:                         # oversized: a real entry, over a cap made small here
        device(Timer("im2col"), W.Wisdom(path)).conv2d(X, WEIGHTS, None)
        monkeypatch.setattr(W, "MAX_FILE_BYTES", 200)
    else:
        path.write_bytes(content)
    monkeypatch.setattr(W, "MAX_MACHINES", 1)
    before = path.read_bytes()
    timer = Timer("shifted")
    dev = device(timer, W.Wisdom(path))
    dev.conv2d(X, WEIGHTS, None)
    dev.conv2d(X[:1], WEIGHTS, None)            # a second store: not said again
    assert [c["path"] for c in dev.conv_path_choices()] == ["shifted", "shifted"] and timer.calls > 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and message in err and "Traceback" not in err
    if kept:
        assert path.read_bytes() == before
        assert "left as it is" in err and "not kept for the next run (move the file away" in err
        assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    else:
        monkeypatch.setattr(W, "MAX_FILE_BYTES", 8 << 20)
        assert list(stored(path).values()) == ["shifted", "shifted"]     # written over with what this run knows


def test_a_file_of_another_format_written_after_the_first_read_is_not_written_over(tmp_path, capsys):
    """Another process (a newer version) puts its file in place while this one runs: the store,
    which reads the file again under the lock, leaves it as it is and says so once."""
    path = tmp_path / "conv-paths.json"
    wisdom = W.Wisdom(path)
    wisdom.store(_machine(1), W.canonical(W.call_key((1, 1, 4, 4), (1, 1, 3, 3), (1, 1), (0, 0), None)), "im2col")
    path.write_bytes(b'{"format": 2, "machines": [], "more": "of a newer version"}')
    for n in (2, 3):
        wisdom.store(_machine(1), W.canonical(W.call_key((n, 1, 4, 4), (1, 1, 3, 3), (1, 1), (0, 0), None)), "shifted")
    assert path.read_bytes() == b'{"format": 2, "machines": [], "more": "of a newer version"}'
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "this one has format 2" in err and "left as it is" in err
    assert wisdom.lookup(_machine(1), W.canonical(W.call_key((3, 1, 4, 4), (1, 1, 3, 3), (1, 1), (0, 0), None))) == \
        {"path": "shifted"}                                 # kept in memory for this run


def test_a_store_syncs_the_folder_after_the_rename(tmp_path, monkeypatch):
    path = tmp_path / "cache" / "conv-paths.json"
    done = []
    replace_file, fsync = os.replace, os.fsync
    monkeypatch.setattr(W.os, "replace", lambda src, dst: (replace_file(src, dst), done.append("rename")))
    monkeypatch.setattr(W.os, "fsync", lambda fd: (fsync(fd), done.append(
        "folder" if os.path.samestat(os.fstat(fd), os.stat(path.parent)) else "file")))
    W.Wisdom(path).store(_machine(1), W.canonical(W.call_key((1, 1, 4, 4), (1, 1, 3, 3), (1, 1), (0, 0), None)), "im2col")
    assert done == ["file", "rename", "folder"]


def test_wrong_typed_entries_are_left_out_and_the_rest_kept(tmp_path, capsys):
    path = tmp_path / "conv-paths.json"
    device(Timer("im2col"), W.Wisdom(path)).conv2d(X, WEIGHTS, None)
    d = json.loads(path.read_text())
    good = d["machines"][0]["calls"][0]
    d["machines"][0]["calls"] = [{**good, "path": 3}, {**good, "call": {**good["call"], "x": [2, 3, "10", 10]}},
                                 {**good, "seconds": {"im2col": "fast"}}, {**good, "extra": 1}, good]
    d["machines"].append({"machine": {**d["machines"][0]["machine"], "threads": True}, "calls": [good]})
    path.write_text(json.dumps(d))
    dev = device(never, W.Wisdom(path))
    dev.conv2d(X, WEIGHTS, None)
    assert choice(dev) == ("im2col", "wisdom")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "some entries ignored" in err and "path 3 is not a conv path's name" in err


def test_a_folder_that_cannot_be_written_is_said_once_and_the_run_goes_on(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    path = tmp_path / "file" / "cache" / "conv-paths.json"      # a folder under a file: never creatable
    wisdom = W.Wisdom(path)
    dev = device(Timer("shifted"), wisdom)
    dev.conv2d(X, WEIGHTS, None)
    dev.conv2d(X[:1], WEIGHTS, None)            # a second shape, stored again: not said again
    assert [c["path"] for c in dev.conv_path_choices()] == ["shifted", "shifted"]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot be written" in err and str(path) in err


def test_the_previous_generations_timings_are_not_read_and_are_left_as_they_were(monkeypatch, tmp_path):
    """conv-paths.json holds timings made before Winograd's GEMMs ran in one parallel region, which
    would keep layers off the path that is now the fastest: a device of a cache folder holding it
    times its calls again, into the new file, and leaves the old one as it was."""
    old = tmp_path / "conv-paths.json"
    device(Timer("im2col"), W.Wisdom(old)).conv2d(X, WEIGHTS, None)
    before = old.read_bytes()
    monkeypatch.setenv("HETCONV_CACHE", str(tmp_path))
    timer = Timer("shifted")
    dev = device(timer, W.machine_wisdom())
    dev.conv2d(X, WEIGHTS, None)
    assert choice(dev) == ("shifted", "timed") and timer.calls > 0
    assert old.read_bytes() == before
    assert list(stored(tmp_path / W.FILE_NAME).values()) == ["shifted"]


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("HETCONV_CACHE", str(tmp_path / "a"))
    assert W.wisdom_path() == str(tmp_path / "a" / W.FILE_NAME)
    assert W.machine_wisdom() is W.machine_wisdom()
    monkeypatch.delenv("HETCONV_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert W.wisdom_path() == str(tmp_path / "xdg" / "hetconv" / W.FILE_NAME)
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert W.wisdom_path() == str(tmp_path / "home" / ".cache" / "hetconv" / W.FILE_NAME)


def test_the_readme_and_the_help_name_the_file_the_wisdom_is_in(monkeypatch):
    """Where the README and `--retime`'s help say the wisdom is, it is: a new generation's file
    name (wisdom.FILE_NAME) leaves no page naming the old one."""
    from hetconv.cli import worker
    monkeypatch.setenv("COLUMNS", "1000")          # argparse would break the name at its hyphens
    texts = {"README.md": open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                            "README.md")).read(),
             "hetconv-worker --help": worker.build_parser().format_help(),
             "hetconv-coordinator --help": coordinator.build_parser().format_help()}
    for where, text in texts.items():
        named = set(re.findall(r"conv-paths[\w-]*\.json", text))
        assert named == {W.FILE_NAME}, where


def test_the_suite_never_touches_the_users_cache(conv_path_wisdom):
    assert W.wisdom_path() == os.path.join(str(conv_path_wisdom), W.FILE_NAME)


# ---- deterministic ----------------------------------------------------------------------------------

@pytest.mark.parametrize("w_shape, rule", [((4, 3, 3, 3), "im2col"), ((8, 32, 3, 3), "shifted")])
def test_deterministic_takes_the_rule_and_no_clock_nor_wisdom(tmp_path, w_shape, rule):
    path = tmp_path / "conv-paths.json"
    w = RNG.standard_normal(w_shape).astype(np.float32)
    x = RNG.standard_normal((2, w_shape[1], 10, 10)).astype(np.float32)
    device(Timer("fft"), W.Wisdom(path)).conv2d(x, w, None)          # the wisdom says fft
    before = path.read_bytes()
    dev = device(never, W.Wisdom(path), deterministic=True)
    dev.conv2d(x, w, None)
    dev.conv_block(x, w, None, ConvBlock())
    expected = f"{rule}-dnnl" if f"{rule}-dnnl" in {**dev._path_gemms, **dev._shifted_gemms} else rule
    assert [(c["path"], c["why"]) for c in dev.conv_path_choices()] == [(expected, "rule (deterministic)")] * 2
    assert path.read_bytes() == before and dev.conv_path_record()["choices"] == []


@pytest.mark.parametrize("w_shape, rule", [((4, 3, 3, 3), "im2col-bf16"), ((8, 32, 3, 3), "shifted-bf16")])
def test_deterministic_bf16_takes_the_float32_rules_layout_on_bf16_operands(w_shape, rule):
    """im2col-bf16, or shifted-bf16 where the float32 rule takes shifted: im2col's col2im made
    resnet18's deterministic bf16 step 1.5x slower (0.845 s against 0.557, 2 threads)."""
    if DNNL_MISSING:         # on a CPU without bf16 instructions, the emulated GEMMs: the same rule
        pytest.skip(f"precision bf16 needs oneDNN: {DNNL_MISSING}")
    w = RNG.standard_normal(w_shape).astype(np.float32)
    x = RNG.standard_normal((2, w_shape[1], 10, 10)).astype(np.float32)
    dev = device(never, precision="bf16", deterministic=True)
    dev.conv2d(x, w, None)
    assert choice(dev) == (rule, "rule (deterministic)")


class Seconds:
    """A fake auto_timer from {path: seconds}; records which paths it was asked to time."""

    def __init__(self, seconds):
        self.seconds, self.timed = seconds, set()

    def __call__(self, path, run):
        self.timed.add(path)
        return self.seconds.get(path, 2.0)


DEPTHWISE_X = RNG.standard_normal((2, 4, 8, 8)).astype(np.float32)
DEPTHWISE_W = RNG.standard_normal((8, 1, 3, 3)).astype(np.float32)          # two kernels a channel
DEPTHWISE = ConvBlock(padding=1, groups=4, activation="none", pool="none")


@pytest.mark.parametrize("precision, rule, direct", [("fp32", "depthwise", "direct-dnnl"),
                                                     ("bf16", "depthwise-bf16", "direct-bf16")])
def test_a_depthwise_conv_takes_onednns_direct_path_untimed_and_the_depthwise_path_deterministic(precision, rule,
                                                                                                 direct):
    if precision == "bf16" and DNNL_MISSING:
        pytest.skip(f"precision bf16 needs oneDNN: {DNNL_MISSING}")
    untimed = CpuDevice(threads=1, precision=precision)                  # under the timed size
    untimed.conv_block(DEPTHWISE_X, DEPTHWISE_W, None, DEPTHWISE)
    # oneDNN's depthwise kernels where oneDNN is installed and runs the call; the depthwise path else
    want = direct if untimed._direct_runs(direct, DEPTHWISE_X, DEPTHWISE_W, (1, 1), (1, 1), DEPTHWISE) else rule
    assert choice(untimed)[0] == want and choice(untimed)[1].startswith("rule: ")
    dev = device(never, precision=precision, deterministic=True)
    dev.conv_block(DEPTHWISE_X, DEPTHWISE_W, None, DEPTHWISE)
    assert choice(dev) == (rule, "rule (deterministic)")
    grouped = device(never, precision=precision, deterministic=True)   # two channels a group: not depthwise
    grouped.conv_block(DEPTHWISE_X, DEPTHWISE_W[:, :1].repeat(2, axis=1), None, replace(DEPTHWISE, groups=2))
    assert choice(grouped)[0].startswith("im2col")


def test_a_depthwise_conv_times_the_depthwise_path_among_the_grouped_paths():
    timer = Seconds({"depthwise": 1.0})
    dev = device(timer)
    dev.conv_block(DEPTHWISE_X, DEPTHWISE_W, None, DEPTHWISE)
    assert choice(dev) == ("depthwise", "timed")
    assert "depthwise" in timer.timed and "im2col" in timer.timed and "depthwise-bf16" not in timer.timed
    slower = device(Seconds({"depthwise": 3.0, "im2col": 1.0}))        # the timing rules, not the rule
    slower.conv_block(DEPTHWISE_X, DEPTHWISE_W, None, DEPTHWISE)
    assert choice(slower) == ("im2col", "timed")


# ---- a run's record, and --resume ---------------------------------------------------------------------

def test_a_checkpoints_record_is_run_before_the_wisdom_and_the_timer(tmp_path):
    path = tmp_path / "conv-paths.json"
    first = device(Timer("im2col"))
    first.conv2d(X, WEIGHTS, None)
    record = first.conv_path_record()
    assert record["choices"] == [{"call": W.call_key(X.shape, WEIGHTS.shape, (1, 1), (0, 0), None),
                                  "path": "im2col", "why": "timed"}]
    device(Timer("shifted"), W.Wisdom(path)).conv2d(X, WEIGHTS, None)        # the wisdom says shifted
    dev = device(never, W.Wisdom(path))
    assert dev.preload_conv_paths([{"worker": "local", **record}]) == 1
    dev.conv2d(X, WEIGHTS, None)
    assert choice(dev) == ("im2col", "checkpoint")
    # another machine's record (two threads) is not this device's: it takes the wisdom's
    other = device(never, W.Wisdom(path))
    assert other.preload_conv_paths([{**record, "machine": {**record["machine"], "threads": 2}}]) == 0
    other.conv2d(X, WEIGHTS, None)
    assert choice(other) == ("shifted", "wisdom")


def test_a_record_that_comes_after_a_calibration_call_replaces_its_choice():
    """A worker calibrates before LOAD: a record arriving later (it never does, WELCOME comes
    first, but a device must not keep a stale choice) makes that shape choose again."""
    first = device(Timer("im2col"))
    first.conv2d(X, WEIGHTS, None)
    dev = device(Timer("shifted"))
    dev.conv2d(X, WEIGHTS, None)
    assert choice(dev)[0] == "shifted"
    dev.preload_conv_paths([first.conv_path_record()])
    dev.conv2d(X, WEIGHTS, None)
    assert choice(dev) == ("im2col", "checkpoint")


def test_records_are_bounded_and_checked_never_raised():
    dev = device(Timer("im2col"))
    dev.conv2d(X, WEIGHTS, None)
    good = dev.conv_path_record()
    assert W.checked_records([good]) == ([good], "")
    hostile_values = [
        "everything", 7, {"machine": 1}, [None], [{"machine": good["machine"], "choices": "all"}],
        [{**good, "machine": {**good["machine"], "threads": -1}}],
        [{**good, "choices": [{"call": {"x": [1] * 9}, "path": "im2col", "why": ""}]}],
        [{**good, "choices": [{**good["choices"][0], "path": "../../etc"}]}],
        [{**good, "choices": [{**good["choices"][0], "call": {**good["choices"][0]["call"], "block": {"pool": 3}}}]}],
        [good] * (W.MAX_RECORDS + 1),
        [{**good, "choices": good["choices"] * (W.MAX_RECORD_CHOICES + 1)}],
    ]
    for value in hostile_values:
        records, problem = W.checked_records(value)
        assert problem and all(r["choices"] == good["choices"] or not r["choices"] for r in records)
        assert dev.preload_conv_paths(value) == 0                # and a device takes none of it
    many = [{**good, "choices": good["choices"] * W.MAX_RECORD_CHOICES}] * 5
    records, problem = W.checked_records(many)
    assert sum(len(r["choices"]) for r in records) <= W.MAX_RECORDS_CHOICES and "left out" in problem
    why = W.checked_records([{**good, "choices": [{**good["choices"][0], "why": "x" * 999}]}])[0]
    assert len(why[0]["choices"][0]["why"]) == W.MAX_WHY


def test_a_checkpoint_keeps_the_record_and_a_forged_one_never_stops_a_resume(tmp_path):
    dev = device(Timer("im2col"))
    dev.conv2d(X, WEIGHTS, None)
    record = {"worker": "w0-cpu", **dev.conv_path_record()}
    good = hostile.good_checkpoint(tmp_path / "good")
    path = hostile.forge(good, str(tmp_path / "ckpt-step0000001.npz"),
                         change_meta=lambda m: m.update(conv_paths=[record]))
    meta = checkpoint.load(path)[0]
    assert checkpoint.recorded_conv_paths(meta) == ([record], "")
    for bad in ("all", [{"machine": "x", "choices": []}], [{**record, "choices": [{"call": 1}] * 5}], {"a": [1]}):
        forged = hostile.forge(good, str(tmp_path / "ckpt-step0000002.npz"),
                               change_meta=lambda m: m.update(conv_paths=bad))
        meta = checkpoint.load(forged)[0]                  # it loads: the record is not the weights
        records, problem = checkpoint.recorded_conv_paths(meta)
        assert problem and all(not r["choices"] for r in records)
    assert checkpoint.recorded_conv_paths(checkpoint.load(good)[0]) == ([], "")    # written before records


def test_save_keeps_only_what_reads_back(tmp_path):
    dev = device(Timer("im2col"))
    dev.conv2d(X, WEIGHTS, None)
    record = {"worker": "local", **dev.conv_path_record()}
    meta, conv, fc = checkpoint.load(hostile.good_checkpoint(tmp_path / "a"))
    path = checkpoint.save(str(tmp_path / "b"), 1, 0, Config.from_json(meta["config"]), conv, fc,
                           network=meta["network"], conv_paths=[record, {"machine": "hostile"}])
    assert checkpoint.recorded_conv_paths(checkpoint.load(path)[0]) == ([record], "")


# ---- on the wire ----------------------------------------------------------------------------------------

def test_fetch_carries_the_record_where_asked_and_a_gather_asks_each_worker_once(tmp_path):
    spec = ConvSpec.paper(3, 4, 3, 0)
    dev = device(Timer("im2col"))
    server = ShardServer(ConvShard(dev))
    state = spec.initial_state(WEIGHTS, np.zeros(4, np.float32))
    server.shard.load(0, spec, 0, 4, state)
    dev.conv_block(X, WEIGHTS, None, spec.block)
    op, arrays, fields = server.handle("FETCH", [], {"layer": 0})
    assert op == "SHARD" and "conv_paths" not in fields and arrays
    op, arrays, fields = server.handle("FETCH", [], {"layer": 0, "conv_paths": True})
    assert fields["conv_paths"] == dev.conv_path_record() and fields["conv_paths"]["choices"]
    assert P.unpack(P.pack(op, 1, arrays, **fields)).fields["conv_paths"] == fields["conv_paths"]   # it travels
    op, arrays, fields = server.handle("FETCH", [], {"layer": -1, "conv_paths": True})
    assert (op, arrays, fields["names"], fields["conv_paths"]) == ("SHARD", [], [], dev.conv_path_record())
    with pytest.raises(P.ProtocolError, match="FETCH field 'conv_paths' must be boolean"):
        server.handle("FETCH", [], {"layer": 0, "conv_paths": 1})
    # two in-process shards on a plan of data layers only: the second gives its record by layer -1
    devices = [device(Timer("im2col")), device(Timer("shifted"))]
    engine = LocalEngine({"a": ConvShard(devices[0]), "b": ConvShard(devices[1])})
    engine.exchange = "peer"                    # what a distributed run's data layers take; gather is the same
    calls = []
    real = engine._call
    engine._call = lambda requests, doing, layer=None: (calls.append(requests), real(requests, doing, layer))[1]
    engine.load(fixed_plan([4], {"a": [4], "b": [4]}, modes=["data"], images={"a": 1, "b": 1}), [spec], [state])
    for d in devices:
        d.conv_block(X, WEIGHTS, None, spec.block)
    calls.clear()
    engine.gather()
    assert [{n: f for n, (_, _, f) in r.items()} for r in calls] == [{"a": {"layer": 0, "conv_paths": True}},
                                                                     {"b": {"layer": -1, "conv_paths": True}}]
    assert [r["worker"] for r in engine.conv_path_records()] == ["a", "b"]
    assert [r["choices"][0]["path"] for r in engine.conv_path_records()] == ["im2col", "shifted"]


def test_a_workers_malformed_record_leaves_its_last_one_standing():
    from hetconv.engine.contract import ShardEngine
    engine = ShardEngine()
    dev = device(Timer("im2col"))
    dev.conv2d(X, WEIGHTS, None)
    engine._keep_conv_path_record("w0", {"conv_paths": dev.conv_path_record()})
    for bad in ("x", {"machine": {}, "choices": []}, {"choices": [None] * 10**4, "machine": dev.machine_key()}):
        engine._keep_conv_path_record("w0", {"conv_paths": bad})
    engine._keep_conv_path_record("w0", {})
    assert engine._conv_path_records["w0"] == dev.conv_path_record()


# ---- a --local run and its --resume ----------------------------------------------------------------------

TINY = ["--local", "--conv", "4,8", "--fc", "8", "--threads", "1", "--batch-size", "8", "--synthetic-train", "32",
        "--synthetic-test", "16", "--eval-batches", "1", "--seed", "1"]


def events(path, event):
    return [r for r in map(json.loads, open(path)) if r["event"] == event]


def test_a_resumed_local_run_runs_the_paths_its_checkpoint_ran(tmp_path, monkeypatch, capsys):
    """The first run times (a fake clock choosing im2col) and checkpoints; the resumed one, on an
    empty wisdom and a clock that would choose shifted, runs im2col from the checkpoint and times
    nothing."""
    timer = Timer("im2col")
    real_open = coordinator.open_device
    monkeypatch.setattr(coordinator, "open_device",
                        lambda spec, **o: real_open(spec, auto_timed_min_flops=0, auto_timer=timer, **o))
    ck, first, second = tmp_path / "ck", tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    code = coordinator.main([*TINY, "--steps", "2", "--checkpoint-dir", str(ck), "--metrics", str(first)])
    assert code == 0, capsys.readouterr().err
    assert timer.calls > 0
    (recorded,) = events(first, "conv_paths")[-1]["devices"]
    assert recorded["worker"] == "local" and recorded["machine"]["threads"] == 1
    assert {(c["path"], c["why"]) for c in recorded["choices"]} == {("im2col", "timed")}
    assert checkpoint.recorded_conv_paths(checkpoint.load(str(ck))[0]) == ([recorded], "")

    monkeypatch.setenv("HETCONV_CACHE", str(tmp_path / "another-cache"))      # nothing in the wisdom
    timer.best, timer.calls = "shifted", 0
    code = coordinator.main([*TINY, "--resume", str(ck), "--steps", "4", "--metrics", str(second)])
    assert code == 0, capsys.readouterr().err
    assert timer.calls == 0
    (resumed,) = events(second, "conv_paths")[-1]["devices"]
    assert [c["call"] for c in resumed["choices"]] == [c["call"] for c in recorded["choices"]]
    assert {(c["path"], c["why"]) for c in resumed["choices"]} == {("im2col", "checkpoint")}


# ---- a spawned worker -----------------------------------------------------------------------------------

def test_a_worker_runs_the_records_its_welcome_carries_and_gives_its_own_back_at_a_gather():
    """WELCOME carries a resumed run's records to a spawned worker, whose device runs them (here a
    call too small to be timed, which only a record moves off the rule); the gather's FETCH brings
    its record back. One worker process: a few seconds."""
    from hetconv.coordinator.remote import RemoteEngine
    spec = ConvSpec.paper(3, 4, 3, 0)
    x = RNG.standard_normal((2, 3, 8, 8)).astype(np.float32)
    call = W.call_key(x.shape, WEIGHTS.shape, (1, 1), (0, 0), spec.block)
    mine = CpuDevice(threads=1).machine_key()            # this host's, as the worker's device computes it
    records = [{"worker": "elsewhere", "machine": {**mine, "threads": 7},
                "choices": [{"call": call, "path": "fft", "why": "timed"}]},
               {"worker": "w0-cpu", "machine": mine, "choices": [{"call": call, "path": "shifted", "why": "timed"}]}]
    engine = RemoteEngine("tcp://127.0.0.1:0", 0, ["cpu"], threads=1, connect_timeout=60, log=lambda *_: None,
                          conv_paths=records)
    try:
        engine.load(fixed_plan([4], {"w0-cpu": [4]}), [spec], [spec.initial_state(WEIGHTS)])
        engine.forward(0, x)
        engine.gather()
        (got,) = engine.conv_path_records()
        assert got == {"worker": "w0-cpu", "machine": mine, "choices": [{"call": call, "path": "shifted",
                                                                         "why": "checkpoint"}]}
    finally:
        engine.close()


def test_the_flags_reach_spawned_workers_and_the_worker_takes_them():
    from hetconv.cli import worker as worker_cli
    assert CpuOptions.of(Config(retime=True, deterministic=True)).worker_flags() == [
        "--cpu-conv-path", "auto", "--precision", "fp32", "--retime", "--deterministic"]
    assert CpuOptions.of(Config()).worker_flags() == ["--cpu-conv-path", "auto", "--precision", "fp32"]
    args = worker_cli.build_parser().parse_args(["--device", "cpu", "--retime", "--deterministic"])
    assert args.retime and args.deterministic
    args = coordinator.build_parser().parse_args(["--local", "--retime", "--deterministic"])
    assert args.retime and args.deterministic


def test_a_resume_says_in_one_line_what_of_its_records_it_left_out(capsys):
    resumed = checkpoint.Loaded({"path": "runs/a/ckpt-step0000003.npz", "conv_paths": "junk"}, [], [], [])
    assert coordinator._resumed_conv_paths(resumed) == []
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("resuming runs/a/ckpt-step0000003.npz: its conv path records: ")
    assert coordinator._resumed_conv_paths(None) == [] and capsys.readouterr().err == ""
