"""`--resume DIR` continues the run its checkpoint holds: its data, recipe, step target and
evaluation settings come back from the saved config; a flag given again changes what may change
(said on stdout), and what cannot (the network, the data set's shape and classes) is refused
naming the flag. Runs in this process, on tiny networks: a few seconds each."""
import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from hetconv.cli import coordinator, report
from hetconv.training import checkpoint
from hetconv.training.loop import _Run

DIGITS = str(Path(__file__).parent / "data" / "digits")          # MNIST IDX, 1x28x28, 10 classes
TINY = ["--local", "--conv", "4,8", "--fc", "8", "--threads", "1"]


def records(path, event):
    return [r for r in map(json.loads, open(path)) if r["event"] == event]


def coordinator_run(capsys, *argv):
    code = coordinator.main(list(map(str, argv)))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def test_flags_given_are_told_apart_from_defaults_whatever_their_value():
    given = coordinator.given_config_fields(["--local", "--lr", "0.01", "--use-all", "--batch", "8", "--resume", "x"])
    assert given == {"lr", "use_all", "batch_size"}               # 0.01 is --lr's default, still given
    assert coordinator.given_config_fields([]) == set()


def test_a_resumed_run_keeps_its_data_recipe_and_step_target(tmp_path, capsys):
    ck, first_metrics, metrics = tmp_path / "ck", tmp_path / "first.jsonl", tmp_path / "m.jsonl"
    code, _, err = coordinator_run(capsys, *TINY, "--data", DIGITS, "--lr", "0.05", "--batch-size", "32",
                                   "--momentum", "0.8", "--eval-batches", "2", "--steps", "3",
                                   "--checkpoint-dir", ck, "--metrics", first_metrics)
    assert code == 0, err
    # as the README says: --resume DIR and a new step target; --lr given again changes it
    code, out, err = coordinator_run(capsys, *TINY, "--resume", ck, "--steps", "5", "--lr", "0.02",
                                     "--metrics", metrics)
    assert code == 0, err
    assert "--steps 3 -> 5 (given on the command line)" in out and "--lr 0.05 -> 0.02 (given on the command line)" in out
    assert "--momentum" not in out and "--data" not in out                # taken back, not changed
    config = records(metrics, "config")[0]["config"]
    assert (config["data"], config["batch_size"], config["momentum"], config["lr"], config["eval_batches"],
            config["steps"]) == (DIGITS, 32, 0.8, 0.02, 2, 5)
    assert [r["step"] for r in records(metrics, "step")] == [4, 5]
    assert records(metrics, "done")[0]["test_images"] == 64              # 2 batches of 32: --eval-batches kept
    meta = checkpoint.load(str(ck))[0]
    assert meta["step"] == 5 and meta["data"]["name"] == "mnist" and meta["config"]["data"] == DIGITS


def test_a_stopped_run_resumed_with_no_flags_stops_at_its_own_steps(tmp_path, capsys, monkeypatch):
    """SIGTERM at step 2 of --steps 6, then `--resume DIR` alone: the run goes on to step 6 (not
    to the end of an epoch at the default --epochs), with its --eval-batches."""
    ck = tmp_path / "ck"
    real = _Run.one_step

    def one_step(self, *args):
        joined = real(self, *args)
        if self.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)        # the handler finishes this step and checkpoints
        return joined
    monkeypatch.setattr(_Run, "one_step", one_step)
    code, _, err = coordinator_run(capsys, *TINY, "--batch-size", "8", "--synthetic-train", "200",
                                   "--synthetic-test", "16", "--eval-batches", "1", "--steps", "6",
                                   "--checkpoint-dir", ck)
    assert code == 143, err
    assert checkpoint.load(str(ck))[0]["step"] == 2
    monkeypatch.setattr(_Run, "one_step", real)
    code, out, err = coordinator_run(capsys, *TINY, "--resume", ck, "--metrics", tmp_path / "m.jsonl")
    assert code == 0, err
    assert "->" not in out                                                # nothing changed
    assert [r["step"] for r in records(tmp_path / "m.jsonl", "step")] == [3, 4, 5, 6]
    assert records(tmp_path / "m.jsonl", "done")[0]["test_images"] == 8
    assert checkpoint.load(str(ck))[0]["step"] == 6


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """A 2-step run on the digits (1x28x28): its checkpoint directory."""
    ck = tmp_path_factory.mktemp("digits") / "ck"
    assert coordinator.main([*TINY, "--data", DIGITS, "--batch-size", "16", "--steps", "2", "--eval-batches", "1",
                             "--checkpoint-dir", str(ck)]) == 0
    return ck


def test_resuming_an_mnist_run_without_data_takes_its_data(digits_run, tmp_path, capsys):
    code, out, err = coordinator_run(capsys, *TINY, "--resume", digits_run, "--steps", "3",
                                     "--checkpoint-dir", tmp_path / "ck2")
    assert code == 0, err
    assert "another network" not in out + err
    assert checkpoint.load(str(tmp_path / "ck2"))[0]["data"]["name"] == "mnist"


@pytest.mark.parametrize("argv,message", [
    (["--data", "synthetic"], "cannot resume on --data synthetic: its images are 3x32x32 with 10 classes, the "
                              "checkpoint's network takes 1x28x28 with 10"),
    (["--conv", "4,6"], "the checkpoint was trained with --conv '4,8', this run asks for '4,6' (the network cannot "
                        "change; drop --conv)"),
    (["--net", "lenet5"], "the checkpoint was trained with the paper family (--conv 4,8 --fc 8), not --net, this "
                          "run asks for 'lenet5'"),
])
def test_what_cannot_change_is_refused_naming_the_flag(digits_run, capsys, argv, message):
    code, _, err = coordinator_run(capsys, *TINY, "--resume", digits_run, *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_resumed_run_names_the_network_it_trains(tmp_path, capsys):
    ck = tmp_path / "ck"
    common = ["--local", "--threads", "1", "--batch-size", "8", "--synthetic-train", "32", "--synthetic-test", "8"]
    assert coordinator.main([*common, "--net", "lenet5@0.5", "--steps", "1", "--checkpoint-dir", str(ck)]) == 0
    metrics = tmp_path / "m.jsonl"
    code, _, err = coordinator_run(capsys, *common, "--resume", ck, "--steps", "2", "--metrics", metrics)
    assert code == 0, err
    assert checkpoint.load(str(ck))[0]["config"]["net"] == "lenet5@0.5"
    assert records(metrics, "config")[0]["config"]["net"] == "lenet5@0.5"
    assert report.main([str(metrics), "--out", str(tmp_path / "r")]) in (0, 2)        # plots need matplotlib
    assert "| network | lenet5@0.5 |" in (tmp_path / "r" / "summary.md").read_text()


def test_a_checkpoints_data_set_that_is_gone_is_named_as_the_checkpoints(tmp_path, capsys):
    data = tmp_path / "digits"
    shutil.copytree(DIGITS, data)
    ck = tmp_path / "ck"
    assert coordinator.main([*TINY, "--data", str(data), "--batch-size", "16", "--steps", "1", "--eval-batches", "1",
                             "--checkpoint-dir", str(ck)]) == 0
    shutil.rmtree(data)
    code, _, err = coordinator_run(capsys, *TINY, "--resume", ck)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"the data set {checkpoint.latest(str(ck))} was trained on: " in err and str(data) in err
    assert err.strip().endswith("(give --data to resume on another copy of it)")


def test_a_truncated_newest_checkpoint_is_named_with_why_before_any_worker_starts(tmp_path, capsys):
    ck = tmp_path / "ck"
    code, _, err = coordinator_run(capsys, *TINY, "--data", DIGITS, "--batch-size", "16", "--steps", "2",
                                   "--checkpoint-every", "1", "--checkpoint-dir", ck)
    assert code == 0, err
    newest = ck / "ckpt-step0000002.npz"
    with open(newest, "r+b") as f:
        f.truncate(1000)
    argv = [*TINY, "--resume", str(ck), "--steps", "3"]
    # prepare reads and checks everything a run needs and starts no worker or device
    prepared = coordinator.prepare(coordinator.build_parser().parse_args(argv), argv)
    assert prepared.resumed.meta["step"] == 1
    out = capsys.readouterr().out
    assert (f"resuming {ck / 'ckpt-step0000001.npz'}: skipped the newer ckpt-step0000002.npz: truncated or not "
            f"a zip (BadZipFile") in out
    code, out, err = coordinator_run(capsys, *argv)
    assert code == 0, err
    assert out.count("ckpt-step0000002.npz") == 1            # said once, before the device's line
    assert out.index("skipped the newer") < out.index("local: cpu")
