"""Checkpoints: the last K kept, checksummed, and resume takes the newest valid one."""
import json
import os
import re
import time

import numpy as np
import pytest

import _hostile_checkpoints as hostile
from hetconv.net import NetSpec
from hetconv.training import checkpoint
from hetconv.training.config import Config


# a conv of 4 3x3 kernels on 3x6x6 images, pooled to 4x2x2, then a linear layer to 10 classes
SPEC = NetSpec.from_json({"input_shape": [3, 6, 6], "classes": 10, "layers": [
    {"type": "conv", "out_channels": 4, "kernel": 3}, {"type": "relu"}, {"type": "maxpool", "kernel": 2},
    {"type": "flatten"}, {"type": "linear", "out_features": 10}]})


def params(step):
    """The network's conv and linear layers' states, their values saying which step they were saved at."""
    rng = np.random.default_rng(step)
    names = ("w", "b", "w.momentum_buffer", "b.momentum_buffer")
    conv = [{n: rng.standard_normal(s).astype(np.float32) + step for n, s in zip(names, ((4, 3, 3, 3), (4,), (4, 3, 3, 3),
                                                                                      (4,)))}]
    fc = [{n: rng.standard_normal(s).astype(np.float32) for n, s in zip(names, ((10, 16), (10,), (10, 16), (10,)))}]
    return conv, fc


def save(directory, step, keep=3):
    conv, fc = params(step)
    return checkpoint.save(str(directory), step, 0, Config(), conv, fc, keep=keep, network=SPEC.to_json())


def names(directory):
    return sorted(os.listdir(directory))


def rewrite(path, change_arrays=None, change_meta=None):
    """Write `path` again as a well-formed npz (so zip CRCs pass) with an array or the meta changed
    but the stored digest kept: what silent corruption or tampering looks like to the checksum."""
    with np.load(path, allow_pickle=False) as z:
        arrays = {name: z[name].copy() for name in z.files}
    meta = json.loads(bytes(arrays["meta"]).decode())
    if change_arrays:
        change_arrays(arrays)
    if change_meta:
        change_meta(meta)
    arrays["meta"] = np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def forge(path, change_arrays=None, change_meta=None):
    """Write `path` again with an array or the meta changed and the checksum made to match: a
    file someone made on purpose, which the checksum cannot tell from a real one."""
    return hostile.forge(path, path, change_arrays, change_meta)


def test_round_trip_returns_what_was_saved(tmp_path):
    path = save(tmp_path, 5)
    meta, conv, fc = checkpoint.load(path)
    assert meta["step"] == 5 and meta["format"] == checkpoint.FORMAT and meta["path"] == path
    for got, want in zip(conv + fc, sum(params(5), [])):
        assert sorted(got) == sorted(want)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])


def test_keep_k_deletes_the_oldest_after_saving(tmp_path):
    for step in (10, 20, 30):
        save(tmp_path, step, keep=3)
    assert names(tmp_path) == ["ckpt-step0000010.npz", "ckpt-step0000020.npz", "ckpt-step0000030.npz"]
    save(tmp_path, 40, keep=3)
    assert names(tmp_path) == ["ckpt-step0000020.npz", "ckpt-step0000030.npz", "ckpt-step0000040.npz"]
    save(tmp_path, 50, keep=1)
    assert names(tmp_path) == ["ckpt-step0000050.npz"]


def test_keep_k_never_deletes_the_checkpoint_just_written(tmp_path):
    for step in (40, 50):
        save(tmp_path, step, keep=2)
    save(tmp_path, 31, keep=2)              # a resume from an earlier file writes into the same dir
    assert names(tmp_path) == ["ckpt-step0000031.npz", "ckpt-step0000050.npz"]


def test_a_failed_save_deletes_nothing(tmp_path, monkeypatch):
    for step in (10, 20):
        save(tmp_path, step, keep=2)

    def disk_full(*_, **__):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(np, "savez", disk_full)
    with pytest.raises(OSError, match="No space"):
        save(tmp_path, 30, keep=2)
    assert names(tmp_path) == ["ckpt-step0000010.npz", "ckpt-step0000020.npz"]


def test_truncated_newest_falls_back_to_the_previous_and_says_so(tmp_path):
    save(tmp_path, 30)
    newest = save(tmp_path, 40)
    size = os.path.getsize(newest)
    with open(newest, "r+b") as f:
        f.truncate(size // 2)
    meta, conv, _, skipped = checkpoint.load_newest_valid(str(tmp_path))
    assert meta["step"] == 30
    np.testing.assert_array_equal(conv[0]["w"], params(30)[0][0]["w"])
    assert len(skipped) == 1 and skipped[0][0] == "ckpt-step0000040.npz"
    assert "truncated" in skipped[0][1] and "BadZipFile" in skipped[0][1]


def test_a_bad_file_given_directly_is_an_error_naming_it(tmp_path):
    save(tmp_path, 30)
    newest = save(tmp_path, 40)
    with open(newest, "r+b") as f:
        f.truncate(100)
    with pytest.raises(checkpoint.CheckpointError, match=r"ckpt-step0000040\.npz: truncated"):
        checkpoint.load_newest_valid(newest)


def test_a_flipped_byte_in_an_array_is_caught_by_the_checksum(tmp_path):
    save(tmp_path, 30)
    newest = save(tmp_path, 40)

    def flip(arrays):
        raw = arrays["conv0.w.momentum_buffer"].view(np.uint8).reshape(-1)
        raw[7] ^= 0x10
    rewrite(newest, change_arrays=flip)
    with pytest.raises(checkpoint.CheckpointError, match=r"ckpt-step0000040\.npz: checksum mismatch"):
        checkpoint.load(newest)
    meta, _, _, skipped = checkpoint.load_newest_valid(str(tmp_path))
    assert meta["step"] == 30 and skipped == [("ckpt-step0000040.npz", skipped[0][1])]
    assert "checksum mismatch" in skipped[0][1]


@pytest.mark.parametrize("change", [
    lambda meta: meta.update(step=41),                          # the metadata is covered too
    lambda meta: meta["config"].update(lr=0.5),
])
def test_changed_metadata_is_caught_by_the_checksum(tmp_path, change):
    path = save(tmp_path, 40)
    rewrite(path, change_meta=change)
    with pytest.raises(checkpoint.CheckpointError, match="checksum mismatch"):
        checkpoint.load(path)


def test_a_raw_flipped_byte_in_array_data_is_never_loaded(tmp_path):
    # in the file itself the zip's CRC or the sha256 catches it: either way it is refused
    path = save(tmp_path, 40)
    data = open(path, "rb").read()
    start = data.find(params(40)[0][0]["w"].tobytes())
    assert start > 0
    for offset in (start, start + 17, start + 4 * 4 * 27 - 1):
        flipped = bytearray(data)
        flipped[offset] ^= 0x01
        open(path, "wb").write(bytes(flipped))
        with pytest.raises(checkpoint.CheckpointError, match="ckpt-step0000040.npz"):
            checkpoint.load(path)


def test_an_all_bad_directory_is_a_clear_error_listing_each_file(tmp_path):
    for step in (10, 20):
        with open(save(tmp_path, step), "r+b") as f:
            f.truncate(50)
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"no valid checkpoint among 2: ckpt-step0000020\.npz: truncated.*; "
                             r"ckpt-step0000010\.npz: truncated"):
        checkpoint.load_newest_valid(str(tmp_path))


def test_an_old_format_file_without_a_checksum_is_refused(tmp_path):
    path = save(tmp_path, 40)

    def as_format_1(meta):
        meta["format"] = 1
        del meta["sha256"]
    rewrite(path, change_meta=as_format_1)
    with pytest.raises(checkpoint.CheckpointError, match="checkpoint format 1, expected 3 .*has no checksum"):
        checkpoint.load(path)


def test_a_partial_temp_file_from_a_killed_save_is_ignored_and_cleaned_up(tmp_path):
    save(tmp_path, 30)
    good = open(save(tmp_path, 40), "rb").read()
    # a kill mid-write leaves the temporary file, half written, and never renames it
    partial = tmp_path / ".ckpt-abc123.npz.tmp"
    partial.write_bytes(good[:len(good) // 2])
    assert checkpoint.latest(str(tmp_path)).endswith("ckpt-step0000040.npz")
    meta, _, _, skipped = checkpoint.load_newest_valid(str(tmp_path))
    assert meta["step"] == 40 and skipped == []
    save(tmp_path, 50)
    assert not partial.exists()
    assert not [n for n in names(tmp_path) if n.endswith(".tmp")]


def test_keep_checkpoints_is_range_checked():
    with pytest.raises(ValueError, match="--keep-checkpoints must be >= 1, got 0"):
        Config(keep_checkpoints=0).validate()


def test_order_is_the_runs_own_not_the_wall_clock(tmp_path, monkeypatch):
    """A run checkpoints steps 2..6 while the clock is an hour ahead (then corrected: NTP, a VM
    restored from a snapshot), resumes from the newest and checkpoints 8..12. The newest three
    are kept, and the directory's newest is 12, where a later --resume DIR continues."""
    now = time.time_ns()
    monkeypatch.setattr(time, "time_ns", lambda: now + 3600 * 10**9)
    for step in (2, 4, 6):
        save(tmp_path, step)
    monkeypatch.setattr(time, "time_ns", lambda: now)
    assert checkpoint.load(str(tmp_path))[0]["step"] == 6          # the resume
    for step in (8, 10, 12):
        save(tmp_path, step)
    assert names(tmp_path) == ["ckpt-step0000008.npz", "ckpt-step0000010.npz", "ckpt-step0000012.npz"]
    meta, conv, _ = checkpoint.load(str(tmp_path))
    assert meta["step"] == 12 and meta["order"] == 6
    np.testing.assert_array_equal(conv[0]["w"], params(12)[0][0]["w"])


def test_checkpoints_without_the_counter_come_after_those_with_it_by_step(tmp_path):
    for step in (30, 40, 20):
        save(tmp_path, step, keep=5)
    for step in (30, 40):                  # written before checkpoints numbered themselves
        forge(tmp_path / f"ckpt-step{step:07d}.npz", change_meta=lambda meta: meta.pop("order"))
    assert [os.path.basename(p) for p in checkpoint.checkpoints(str(tmp_path))] == [
        "ckpt-step0000020.npz", "ckpt-step0000040.npz", "ckpt-step0000030.npz"]
    assert checkpoint.load(str(tmp_path))[0]["step"] == 20
    save(tmp_path, 50, keep=2)             # retention drops the old ones first, the lowest step first
    assert names(tmp_path) == ["ckpt-step0000020.npz", "ckpt-step0000050.npz"]
    assert checkpoint.load(str(tmp_path))[0]["order"] == 4


def test_the_expected_arrays_come_from_the_network():
    table = checkpoint.expected_arrays(SPEC)
    assert table == {f"{kind}0.{n}": (np.dtype(np.float32), shape, False)
                     for kind, w, b in (("conv", (4, 3, 3, 3), (4,)), ("fc", (10, 16), (10,)))
                     for n, shape in (("w", w), ("b", b), ("w.momentum_buffer", w), ("b.momentum_buffer", b))}
    no_bias = NetSpec.from_json({**SPEC.to_json(), "layers": [*SPEC.to_json()["layers"][:-1],
                                                             {"type": "linear", "out_features": 10, "bias": False}]})
    assert checkpoint.expected_arrays(no_bias)["fc0.b"] == (np.dtype(np.float32), (10,), True)


def _set(name, value):
    return lambda arrays: arrays.__setitem__(name, value)


@pytest.mark.parametrize("change,message", [
    (lambda a: a.__setitem__("conv0.b", a["conv0.b"].astype(np.float64)),
     r"array conv0\.b is float64 \(4,\); its network needs float32 \(4,\)"),
    (_set("fc0.b", np.ones(1, np.float64)), r"array fc0\.b is float64 \(1,\); its network needs float32 \(10,\)"),
    (_set("fc0.b.momentum_buffer", np.ones(1, np.float32)), r"array fc0\.b\.momentum_buffer is float32 \(1,\); its network needs float32 \(10,\)"),
    (lambda a: a["fc0.w"].__setitem__((3, 4), np.nan), r"array fc0\.w holds NaN or inf"),
    (lambda a: a["conv0.b.momentum_buffer"].__setitem__(0, -np.inf), r"array conv0\.b\.momentum_buffer holds NaN or inf"),
    (_set("extra", np.zeros(3, np.float32)), r"entry 'extra' is not an array of its network"),
    (lambda a: a.pop("conv0.w.momentum_buffer"), r"not a readable hetconv checkpoint \(missing 'conv0\.w\.momentum_buffer'\)"),
    (_set("conv0.w", np.zeros((4, 3, 3, 3), np.float32, order="F").T.copy().T),
     r"array conv0\.w is float32 \(4, 3, 3, 3\) \(Fortran order\)"),
], ids=["conv bias float64", "fc bias (1,) float64", "fc momentum (1,)", "nan", "inf", "extra", "missing",
        "fortran"])
def test_arrays_that_do_not_fit_the_network_are_refused_naming_them(tmp_path, change, message):
    path = save(tmp_path, 7)
    forge(path, change_arrays=change)                  # the checksum matches: only the network can tell
    with pytest.raises(checkpoint.CheckpointError, match=r"ckpt-step0000007\.npz: " + message):
        checkpoint.load(path)


def test_a_bias_the_layer_does_not_have_must_be_zero(tmp_path):
    spec = NetSpec.from_json({**SPEC.to_json(), "layers": [*SPEC.to_json()["layers"][:-1],
                                                          {"type": "linear", "out_features": 10, "bias": False}]})
    conv, fc = params(3)
    fc = [{"w": fc[0]["w"], "b": np.zeros(10, np.float32), "w.momentum_buffer": fc[0]["w.momentum_buffer"]}]
    path = checkpoint.save(str(tmp_path), 3, 0, Config(), conv, fc, network=spec.to_json())
    checkpoint.load(path)
    forge(path, change_arrays=lambda a: a["fc0.b"].__setitem__(2, 0.5))
    with pytest.raises(checkpoint.CheckpointError, match=r"array fc0\.b is not zero, but its layer has no bias"):
        checkpoint.load(path)


@pytest.mark.parametrize("change,message", [
    (lambda m: m.update(network={"layers": []}), "its stored network cannot be read: the network has no"),
    (lambda m: m.update(conv_layers=2), "its meta says 2 conv and 1 linear layers, its network has 1 and 1"),
    (lambda m: m.update(step="7"), "its meta's step is \"7\", expected an integer >= 0"),
    (lambda m: m.update(config=[1]), "its config is not a run's config"),
    (lambda m: m["config"].update(lr=-1.0), "its config is not a run's config: ValueError: --lr must be > 0"),
])
def test_a_meta_that_does_not_hold_together_is_refused(tmp_path, change, message):
    path = save(tmp_path, 7)
    forge(path, change_meta=change)
    with pytest.raises(checkpoint.CheckpointError, match=re.escape(message)):
        checkpoint.load(path)
