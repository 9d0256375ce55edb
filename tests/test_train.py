"""Single-process training: the baseline every distributed run must equal."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from _in_process import run_main
from hetconv.cli import coordinator as coordinator_cli
from hetconv.training import checkpoint
from hetconv.training.config import Config
from hetconv.devices import open_device
from hetconv.engine.local import LocalEngine
from hetconv.engine.shard import ConvShard
from hetconv.update import UpdateRule
from hetconv.training.loop import StopNow, _Run, train

TINY = dict(conv="6,12", fc="32", batch_size=32, synthetic_train=4000, synthetic_test=500, lr=0.01, threads=1)


def local_engine(n_shards=1):
    device = open_device("cpu", threads=1)
    return LocalEngine({f"s{i}": ConvShard(device) for i in range(n_shards)})


def quiet(*_):
    pass


def test_short_synthetic_run_learns(tmp_path):
    metrics = tmp_path / "m.jsonl"
    cfg = Config(**TINY, steps=120, metrics=str(metrics)).validate()
    summary = train(cfg, local_engine(), log=quiet)
    losses = summary["losses"]
    assert len(losses) == 120
    assert np.mean(losses[-20:]) < 0.75 * np.mean(losses[:10])
    assert summary["test_accuracy"] > 0.3                     # chance is 0.1
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    events = [r["event"] for r in records]
    assert events[0] == "config" and events[1] == "plan" and events[-1] == "done"
    assert records[0]["config"]["conv"] == "6,12"
    step = next(r for r in records if r["event"] == "step")
    assert {"step", "epoch", "loss", "images_per_s"} <= set(step)
    assert records[-1]["test_accuracy"] == summary["test_accuracy"]


def test_several_local_shards_equal_one(tmp_path):
    cfg = Config(**TINY, steps=4).validate()
    one = train(cfg, local_engine(1), log=quiet)["losses"]
    three = train(cfg, local_engine(3), log=quiet)["losses"]
    np.testing.assert_allclose(three, one, rtol=1e-5)


def test_checkpoint_and_resume_continue_exactly(tmp_path):
    full = Config(**TINY, steps=6, checkpoint_dir=str(tmp_path / "full")).validate()
    straight = train(full, local_engine(), log=quiet)

    first = Config(**TINY, steps=3, checkpoint_dir=str(tmp_path / "part")).validate()
    train(first, local_engine(), log=quiet)
    assert checkpoint.latest(str(tmp_path / "part")).endswith("ckpt-step0000003.npz")
    second = Config(**TINY, steps=6, checkpoint_dir=str(tmp_path / "part")).validate()
    resumed = train(second, local_engine(), log=quiet, resume=str(tmp_path / "part"))
    np.testing.assert_allclose(resumed["losses"], straight["losses"][3:], rtol=1e-6)
    _, conv_a, fc_a = checkpoint.load(str(tmp_path / "full"))
    _, conv_b, fc_b = checkpoint.load(str(tmp_path / "part"))
    for a, b in zip(conv_a + fc_a, conv_b + fc_b):
        assert sorted(a) == sorted(b)
        for name in a:
            np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-7)
    assert not [f for f in os.listdir(tmp_path / "part") if f.endswith(".tmp")]


def test_resume_skips_a_truncated_newest_checkpoint_and_says_so(tmp_path):
    ck = tmp_path / "ck"
    train(Config(**TINY, steps=3, checkpoint_every=1, keep_checkpoints=2, checkpoint_dir=str(ck)).validate(),
          local_engine(), log=quiet)
    assert sorted(os.listdir(ck)) == ["ckpt-step0000002.npz", "ckpt-step0000003.npz"]
    with open(ck / "ckpt-step0000003.npz", "r+b") as f:
        f.truncate(200)
    lines = []
    metrics = tmp_path / "m.jsonl"
    cfg = Config(**TINY, steps=4, checkpoint_dir=str(ck), metrics=str(metrics)).validate()
    result = train(cfg, local_engine(), log=lines.append, resume=str(ck))
    assert result["step"] == 4 and len(result["losses"]) == 2          # resumed at step 2
    assert any(line.startswith("skipped ckpt-step0000003.npz: truncated") for line in lines)
    resume = [r for r in map(json.loads, metrics.read_text().splitlines()) if r["event"] == "resume"]
    assert resume[0]["step"] == 2 and resume[0]["skipped"][0]["file"] == "ckpt-step0000003.npz"


def test_resume_refuses_a_different_network(tmp_path):
    train(Config(**TINY, steps=1, checkpoint_dir=str(tmp_path)).validate(), local_engine(), log=quiet)
    other = Config(**{**TINY, "conv": "6,10"}, steps=2).validate()
    with pytest.raises(checkpoint.CheckpointError, match="trained with another network: layer 3 is conv 12 5x5 .* there, conv 10 5x5 .* here"):
        train(other, local_engine(), log=quiet, resume=str(tmp_path))


def test_checkpoint_errors_name_the_file(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint"):
        checkpoint.load(str(tmp_path))
    bad = tmp_path / "ckpt-step0000001.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(checkpoint.CheckpointError, match="ckpt-step0000001.npz: not a readable hetconv checkpoint"):
        checkpoint.load(str(bad))


def run_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "hetconv.cli.coordinator", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("args,message", [
    (["--conv", "500,x"], "--conv must be comma-separated positive integers, got '500,x'"),
    (["--conv", "0"], "--conv must be comma-separated positive integers"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--lr", "-1"], "--lr must be > 0"),
    (["--split", "random"], "argument --split: invalid choice: 'random'"),
    (["--data", "/nonexistent/cifar"], "/nonexistent/cifar"),
    (["--conv", "4,4,4,4"], "layer 8 (maxpool): kernel 2x2 does not fit its 1x1 input"),
    (["--batch-size", "9999", "--synthetic-train", "100"], "larger than the 100 training images"),
])
def test_cli_bad_input_gets_a_clear_error(args, message):
    result = run_cli("--local", "--steps", "1", "--fc", "8", *(["--conv", "2,2"] if "--conv" not in args else []), *args)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args,message", [
    (["--local", "--spawn", "cpu"], "argument --spawn: not allowed with argument --local"),
    (["--workers", "0"], "--workers must be >= 1, got 0"),
    (["--workers", "-1"], "--workers must be >= 1, got -1"),
    (["--local", "--rebalance-after", "1"], "--rebalance-after must be 0 (never) or at least 2"),
    (["--local", "--crop", "40"], "--crop 40 is larger than the data set's 32x32 images"),
])
def test_cli_mode_flags_are_checked(args, message, capsys):
    result = run_main(coordinator_cli.main, ["--steps", "1", *args], capsys)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_cli_local_run_writes_metrics_and_checkpoint(tmp_path):
    result = run_cli("--local", "--conv", "4,8", "--fc", "16", "--steps", "3", "--batch-size", "16",
                     "--synthetic-train", "200", "--synthetic-test", "50", "--threads", "1",
                     "--metrics", str(tmp_path / "m.jsonl"), "--checkpoint-dir", str(tmp_path / "ck"))
    assert result.returncode == 0, result.stderr
    assert "test accuracy" in result.stdout
    assert checkpoint.latest(str(tmp_path / "ck")).endswith("ckpt-step0000003.npz")
    assert json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])["event"] == "done"


def test_help_explains_the_modes():
    result = run_cli("--help")
    assert result.returncode == 0
    for flag in ("--local", "--spawn", "--workers", "--split", "--resume", "--conv", "--checkpoint-dir"):
        assert flag in result.stdout


@pytest.mark.parametrize("path", ["im2col", "shifted", "fft", "winograd"])
def test_shard_steps_over_micro_batches_follow_the_reference_sgd(path):
    """Three steps of two micro-batches each on one shard: each step's dW is the micro-batches'
    sum, written into the buffer the last step's update used, and the one update per step is
    PyTorch's SGD rule; the weights after every step equal the numpy reference's."""
    from hetconv.geometry import ConvSpec
    from hetconv.net import reference as R
    rng = np.random.default_rng(5)
    spec = ConvSpec.paper(3, 6, ksize=3, padding=1)
    w = rng.standard_normal((6, 3, 3, 3)).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    shard = ConvShard(open_device("cpu", threads=1, conv_path=path))
    shard.load(0, spec, 0, 6, {"w": w, "b": b})
    lr, momentum, decay = 0.05, 0.9, 1e-3
    ref_w, ref_b = w.copy(), b.copy()
    vw, vb = np.zeros_like(w), np.zeros_like(b)
    buffers = set()
    for step in range(3):
        xs = [rng.standard_normal((3, 3, 8, 8)).astype(np.float32) for _ in range(2)]
        douts = [rng.standard_normal((3, 6, 4, 4)).astype(np.float32) for _ in range(2)]
        for m, x in enumerate(xs):
            shard.forward(0, x, micro=m)
        for m, dout in enumerate(douts):
            rule = UpdateRule(lr=lr, momentum=momentum, weight_decay=decay)
            assert shard.backward(0, dout, need_dx=False, micro=m, update=rule if m == 1 else None) is None
        buffers.add(id(shard.layers[0].dw_kept))
        grads = [R.conv_block_backward(x, ref_w, ref_b, spec.block, d, need_dx=False) for x, d in zip(xs, douts)]
        dw, db = grads[0][1] + grads[1][1], grads[0][2] + grads[1][2]
        vw = momentum * vw + dw + decay * ref_w
        vb = momentum * vb + db
        ref_w, ref_b = ref_w - lr * vw, ref_b - lr * vb
        got = shard.fetch(0)
        got_w, got_b = got["w"], got["b"]
        np.testing.assert_allclose(got_w, ref_w, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got_b, ref_b, rtol=1e-4, atol=1e-4)
    assert len(buffers) == 1, "every step writes its dW into the one kept buffer"


def test_a_stop_now_during_a_checkpoint_save_stops_the_run(tmp_path, monkeypatch):
    """StopNow (the --stop-grace alarm, a second signal) raised while a save reads the directory's
    metas must reach the loop, not pass for an unreadable file: the run stops at that step."""
    real = checkpoint._read_meta
    saves = {"n": 0}

    def read_meta(zf):
        if saves["n"] == 1:                    # the second save, as it sorts the directory
            raise StopNow("the stop did not complete within --stop-grace 1s")
        return real(zf)

    def save(*args, **kw):
        path = real_save(*args, **kw)
        saves["n"] += 1
        return path
    real_save = checkpoint.save
    monkeypatch.setattr(checkpoint, "_read_meta", read_meta)
    monkeypatch.setattr(checkpoint, "save", save)
    lines = []
    cfg = Config(**TINY, steps=6, checkpoint_every=1, checkpoint_dir=str(tmp_path)).validate()
    summary = train(cfg, local_engine(), log=lines.append)
    assert summary["interrupted"] and summary["step"] == 2 and summary["checkpoint"].endswith("ckpt-step0000001.npz")
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_a_stop_now_while_the_rescue_saves_the_snapshot_stops_at_once_and_says_so():
    """The rescue after a stop or an error saves the in-memory snapshot; a StopNow during that
    save ends it there, said in the log, and the last checkpoint written is what remains."""
    def save_snapshot():
        raise StopNow("SIGTERM again")
    elastic = SimpleNamespace(unsaved_snapshot=lambda: True, save_snapshot=save_snapshot,
                              snapshot=SimpleNamespace(step=4), saved={2: "ck/ckpt-step0000002.npz"})
    engine = SimpleNamespace(exchange="peer", workers=["a", "b"])
    lines = []
    run = _Run(Config(**TINY, checkpoint_dir="ck").validate(), engine, None, elastic, None, [], 0, 6, 10,
               lines.append, None, 2)
    run.last_ckpt = "ck/ckpt-step0000002.npz"
    assert run.rescue("the stop did not complete within --stop-grace 2s") == "ck/ckpt-step0000002.npz"
    assert lines == ["the stop did not complete within --stop-grace 2s; SIGTERM again while the snapshot of "
                     "step 4 was being saved: stopped without it"]
    assert issubclass(StopNow, BaseException) and not issubclass(StopNow, Exception)
