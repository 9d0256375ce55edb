"""Bad input on the command lines: refused up front with one line naming the value, before any
worker starts or any training runs; nothing hangs, nothing is lost."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from _in_process import run_main
from hetconv.cli import coordinator
from hetconv.training.config import Config
from hetconv.flags import check_endpoint, check_output_dir, check_output_file
from hetconv.devices import DeviceEntry, DeviceError, parse_device_list

TINY = ["--conv", "4,8", "--fc", "8", "--batch-size", "8", "--synthetic-train", "64", "--synthetic-test", "16"]


def run(module, *args, timeout=120):
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(result, message):
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize("args,message", [
    (["--connect", "tcp://bad"], "--connect 'tcp://bad' has no port"),
    (["--connect", "127.0.0.1:5555"], "--connect '127.0.0.1:5555': expected tcp://HOST:PORT or ipc://PATH"),
    (["--connect", "tcp://127.0.0.1:5555", "--heartbeat", "0"], "--heartbeat must be > 0, got 0.0"),
    (["--connect", "tcp://127.0.0.1:5555", "--idle-timeout", "0"], "--idle-timeout must be > 0, got 0.0"),
    (["--connect", "tcp://127.0.0.1:5555", "--connect-timeout", "-1"], "--connect-timeout must be > 0, got -1.0"),
    (["--connect", "tcp://127.0.0.1:5555", "--threads", "-1"], "--threads must be >= 0, got -1"),
    (["--connect", "tcp://127.0.0.1:5555", "--device", "cpu,cpu"], "one device per worker"),
    (["--connect", "tcp://127.0.0.1:5555", "--message-limit-mb", "0"], "--message-limit-mb must be > 0, got 0.0"),
])
def test_worker_flags_are_checked_before_it_connects(args, message):
    device = [] if "--device" in args else ["--device", "cpu"]
    assert_one_line_error(run("hetconv.cli.worker", *device, *args, timeout=30), message)


@pytest.mark.parametrize("args,message", [
    (["--spawn", "cpu,,cpu"], "--spawn 'cpu,,cpu' has an empty entry"),
    (["--spawn", ""], "--spawn needs at least one device"),
    (["--spawn", "cpu:0"], "--spawn entry 'cpu:0': a CPU device needs at least 1 thread"),
    (["--workers", "0"], "--workers must be >= 1, got 0"),
    (["--workers", "1", "--bind", "tcp://127.0.0.1"], "--bind 'tcp://127.0.0.1' has no port"),
    (["--local", "--worker-timeout", "0"], "--worker-timeout must be > 0, got 0.0"),
    (["--local", "--op-timeout", "0"], "--op-timeout must be > 0, got 0.0"),
    (["--local", "--connect-timeout", "-1"], "--connect-timeout must be > 0, got -1.0"),
    (["--local", "--checkpoint-dir", "/proc/x"], "--checkpoint-dir '/proc/x' cannot be created"),
    (["--local", "--metrics", "/proc/x/m.jsonl"], "--metrics '/proc/x/m.jsonl' cannot be written"),
    (["--local", "--resume", "/nonexistent/ckpt"], "--resume '/nonexistent/ckpt': no such checkpoint"),
    # the data is read before any worker is spawned: no worker line, no wait
    (["--spawn", "cpu,cpu", "--data", "/nonexistent/cifar"], "/nonexistent/cifar: does not exist"),
    # a chain of modes is checked against the network before any worker is spawned
    (["--spawn", "cpu,cpu", "--parallel", "DMD"], "--parallel DMD: 3 letter(s) for a network of 2 conv layer(s)"),
    (["--spawn", "cpu,cpu", "--parallel", "DX"], "--parallel must be one of auto, model, data, or a letter per conv"),
])
def test_coordinator_flags_are_checked_before_any_work(args, message, capsys):
    assert_one_line_error(run_main(coordinator.main, [*TINY, "--steps", "2", *args], capsys), message)


def test_the_coordinator_process_refuses_a_flag_in_one_line_with_status_2():
    """The matrix above runs main() in this process; the command's own process says the same."""
    assert_one_line_error(run("hetconv.cli.coordinator", *TINY, "--steps", "2", "--workers", "0", timeout=60),
                          "--workers must be >= 1, got 0")


def test_output_paths_that_are_a_file_or_a_directory_are_refused(tmp_path):
    somefile = tmp_path / "somefile"
    somefile.write_text("")
    assert_one_line_error(run("hetconv.cli.coordinator", *TINY, "--local", "--checkpoint-dir", str(somefile)),
                          "is a file, not a directory")
    assert_one_line_error(run("hetconv.cli.coordinator", *TINY, "--local", "--metrics", str(tmp_path)),
                          "it is a directory")
    with pytest.raises(ValueError, match="cannot be written"):
        check_output_file("--save-profiles", "/proc/x/p.json")
    check_output_dir("--checkpoint-dir", str(tmp_path / "new" / "dir"))
    assert (tmp_path / "new" / "dir").is_dir()


def test_endpoints():
    assert check_endpoint("--connect", "tcp://10.0.0.5:5555") == "tcp://10.0.0.5:5555"
    assert check_endpoint("--bind", "tcp://0.0.0.0:*", bind=True)
    assert check_endpoint("--connect", "ipc:///tmp/hetconv.sock")
    for bad in ("tcp://127.0.0.1:0", "tcp://h:99999", "udp://h:1", "tcp://:5555"):
        with pytest.raises(ValueError, match="--connect"):
            check_endpoint("--connect", bad)


def test_one_device_list_syntax():
    assert parse_device_list("--spawn", "cpu, cpu:2x2 ,cuda:1") == [
        DeviceEntry("cpu"), DeviceEntry("cpu", 2, 2), DeviceEntry("cuda:1")]
    entries = parse_device_list("--devices", "@/home/alex/gpu.json,@/home/alex/gpu.jsonx3", allow_profiles=True)
    assert entries == [DeviceEntry("", None, 1, "/home/alex/gpu.json"), DeviceEntry("", None, 3, "/home/alex/gpu.json")]
    with pytest.raises(DeviceError, match="'@gpu.json'"):
        parse_device_list("--spawn", "@gpu.json")
    for bad in ("cpu,gpu", "cuda:x", "cpux0", "cpu:1x"):
        with pytest.raises(DeviceError, match="--spawn"):
            parse_device_list("--spawn", bad)


def test_spawned_cpu_threads_worker():
    result = run("hetconv.cli.coordinator", *TINY, "--steps", "2", "--spawn", "cpu:1,cpu:1", "--split", "equal")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("cpu (1 thread,") >= 2


def test_short_runs_and_too_many_threads_say_what_they_leave_out(tmp_path):
    # 16 images are 2 steps of 8 an epoch: 3 steps need a second epoch (each epoch ends with an evaluation)
    result = run("hetconv.cli.coordinator", *TINY, "--synthetic-train", "16", "--local", "--steps", "3",
                 "--threads", "999")
    assert result.returncode == 0, result.stderr
    assert "--steps 3 needs 2 epochs of 2 steps (--epochs 1 covers 2): running 2 epochs" in result.stdout
    assert "--threads 999 is more than the" in result.stderr and "a CPU device runs" in result.stderr
    result = run("hetconv.cli.coordinator", *TINY, "--spawn", "cpu,cpu", "--steps", "3", "--threads", "999")
    assert result.returncode == 0, result.stderr
    assert "no rebalancing: 3 steps are too few" in result.stdout
    assert "the workers are not pinned to cores" in result.stderr


def test_resume_appends_to_the_metrics_file(tmp_path):
    metrics, ckpt = str(tmp_path / "m.jsonl"), str(tmp_path / "ck")
    first = run("hetconv.cli.coordinator", *TINY, "--local", "--steps", "2", "--metrics", metrics, "--checkpoint-dir", ckpt)
    assert first.returncode == 0, first.stderr
    second = run("hetconv.cli.coordinator", *TINY, "--local", "--steps", "4", "--metrics", metrics,
                 "--checkpoint-dir", ckpt, "--resume", ckpt)
    assert second.returncode == 0, second.stderr
    steps = [r["step"] for r in map(json.loads, open(metrics)) if r["event"] == "step"]
    assert steps == [1, 2, 3, 4]


def test_resume_names_both_values_of_a_changed_network(tmp_path):
    ckpt = str(tmp_path / "ck")
    assert run("hetconv.cli.coordinator", *TINY, "--local", "--steps", "1", "--checkpoint-dir", ckpt).returncode == 0
    result = run("hetconv.cli.coordinator", *TINY, "--local", "--steps", "2", "--crop", "28", "--resume", ckpt)
    assert result.returncode == 2                  # refused before any work, as other bad input
    assert "the checkpoint was trained with --crop 0, this run asks for 28" in result.stderr
    with pytest.raises(ValueError, match="unknown config keys"):
        Config.from_json({**Config().to_json(), "colour": "blue"})


def interrupt_after_first_step(extra, sig):
    """Start a local run, send `sig` once its first step is done; return (returncode, stderr)."""
    cmd = [sys.executable, "-m", "hetconv.cli.coordinator", *TINY, "--local", "--steps", "0", "--epochs", "200",
           "--conv", "8,16", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"})
    try:
        for line in proc.stdout:                  # the set-up line comes just before the first step
            if "steps of 8 images" in line:
                break
        time.sleep(0.5)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)     # a hang guard only
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


def test_ctrl_c_without_a_checkpoint_dir_says_nothing_is_saved():
    code, err = interrupt_after_first_step([], signal.SIGINT)
    assert code == 130, err                       # a crash's stacks: PYTHONFAULTHANDLER
    assert "no --checkpoint-dir: nothing is saved" in err


def test_sigterm_finishes_the_step_like_ctrl_c():
    code, err = interrupt_after_first_step([], signal.SIGTERM)
    assert code == 143, err
    assert "SIGTERM: finishing this step, then stopping (no --checkpoint-dir: nothing is saved)" in err


def test_a_workers_traceback_only_with_verbose():
    # cuda:7 fails to open (no such GPU, or no GPU at all): the worker reports it as an ERROR
    quiet = run("hetconv.cli.coordinator", *TINY, "--steps", "1", "--spawn", "cuda:7", "--connect-timeout", "30")
    assert quiet.returncode == 1 and "failed during opening device cuda:7" in quiet.stderr, quiet.stderr
    assert "Traceback" not in quiet.stderr
    loud = run("hetconv.cli.coordinator", *TINY, "--steps", "1", "--spawn", "cuda:7", "--connect-timeout", "30", "--verbose")
    assert loud.returncode == 1 and "--- worker traceback ---" in loud.stderr


def test_help_prints_each_default_once_and_examples():
    text = run("hetconv.cli.coordinator", "--help").stdout
    assert text.count("(default: 500,1500)") == 1 and "(default: '500,1500')" not in text
    assert "examples:\n  hetconv-coordinator --spawn cpu,cpu" in text
    assert "default: 1.0" in run("hetconv.cli.worker", "--help").stdout


# ---- papercuts: --version, help groups, notes, names shared with hetconv-plan ------------------------

COMMANDS = ("coordinator", "worker", "plan", "keygen", "report", "evaluate", "classify", "export")


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_says_its_version(command, capsys):
    import importlib
    import tomllib

    from conftest import REPO
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        version = tomllib.load(f)["project"]["version"]
    module = importlib.import_module(f"hetconv.cli.{command}")
    with pytest.raises(SystemExit) as done:
        module.main(["--version"])
    assert done.value.code == 0
    name = {"evaluate": "eval"}.get(command, command)
    assert capsys.readouterr().out == f"hetconv-{name} {version}\n"


def test_help_groups_and_texts_fit_any_data_set():
    """--bind and --curve sit under "connection", apart from --net (the network trained); --crop and
    --fc speak of the data set's images and classes, not CIFAR-10's."""
    from hetconv.cli import coordinator
    text = coordinator.build_parser().format_help()
    connection = text[text.index("connection"):text.index("\ntraining:")]
    assert "--bind" in connection and "--curve" in connection and "--net" not in connection
    assert "\nnetwork:" not in text
    assert "32x32" not in text and "10-way" not in text


@pytest.mark.parametrize("given,modes", [("mmdd", ["model", "model", "data", "data"]), ("MmDd", None),
                                         ("Data", ["data"] * 4), ("AUTO", None)])
def test_parallel_is_read_in_either_case(given, modes):
    from hetconv.engine.planner import forced_modes
    Config(parallel=given).validate()
    assert forced_modes(given, 4) == (modes if given != "MmDd" else ["model", "model", "data", "data"])


def test_local_says_what_flags_for_workers_and_the_wire_do_there():
    from hetconv.cli.coordinator import _local_notes
    assert _local_notes(Config()) == []
    (wire,) = _local_notes(Config(wire_dtype="bfloat16"))
    assert wire.startswith("note: --local has no wire; --wire-dtype bfloat16 rounds its feature maps")
    (ignored,) = _local_notes(Config(parallel="data", link="10gbit", use_all=True))
    assert ignored.startswith("note: --parallel data, --link 10gbit, --use-all split the work among workers; "
                              "--local runs every layer whole on one device, so they change nothing here")


def test_more_spawned_cpu_threads_than_cores_is_a_note(monkeypatch):
    """--spawn cpu:1x3 on 2 cores (and cpu,cpu with --threads 2) cannot pin each worker to cores of
    its own: said in a note; cpu,cpu shares the cores and needs none."""
    from hetconv.cli import coordinator
    monkeypatch.setattr(coordinator, "usable_cores", lambda: 2)
    note = coordinator._pinning_note(["cpu:1"] * 3, 0, True)
    assert "--spawn cpu:1,cpu:1,cpu:1 asks for 3 CPU threads in all, which is more than the 2 core(s)" in note
    assert "not pinned" in note
    assert "2 CPU worker(s) x --threads 2 is more than the 2 core(s)" in coordinator._pinning_note(["cpu", "cpu"], 2, True)
    assert coordinator._pinning_note(["cpu", "cpu"], 0, True) == ""
    assert coordinator._pinning_note(["cpu:1", "cpu:1", "cuda:0"], 0, True) == ""
    assert coordinator._pinning_note(["cpu:1"] * 3, 0, False) == ""          # --no-pin: nothing to say


def test_a_training_loss_stuck_at_chance_for_an_epoch_gets_one_hint():
    import math

    from hetconv.cli.coordinator import _chance_hint
    chance = math.log(10)
    assert _chance_hint([2.5, 2.4] + [chance + 0.001] * 8, 8, 10, 0.01).startswith(
        "hint: the training loss stayed at 2.3036 for the last epoch, log(10) = 2.3026")
    assert "--lr (this run's: 0.01)" in _chance_hint([chance] * 8, 8, 10, 0.01)
    assert _chance_hint([chance] * 8 + [2.0] * 8, 8, 10, 0.01) == ""         # it moved in the last epoch
    assert _chance_hint([chance] * 8 + [2.2975] * 8, 8, 10, 0.01) == ""      # learning slowly is moving
    assert _chance_hint([chance] * 7, 8, 10, 0.01) == ""                     # less than an epoch
    assert _chance_hint([chance] * 4, 4, 10, 0.01) == ""                     # an epoch too short to tell
    assert _chance_hint([math.log(100)] * 8, 8, 100, 0.01) != ""             # log(classes) of the data


def test_plan_names_the_link_as_the_coordinator_does_and_keeps_bandwidth(capsys):
    from hetconv.cli import plan
    assert plan.build_parser().parse_args([]).link == Config.link == "1gbit"
    assert plan.build_parser().parse_args(["--bandwidth", "10gbit"]).link == "10gbit"
    assert plan.main(["--link", "fast"]) == 2
    assert capsys.readouterr().err.strip() == ("hetconv-plan: --link: bandwidth 'fast': expected a rate such as "
                                               "100mbit, 1gbit (or 1gbps), 10gbit or 500MB")


def test_plan_opens_every_device_before_it_calibrates_any(capsys):
    """A GPU that is not there is named at once, not after the CPU before it has been timed."""
    from hetconv.cli import plan
    assert plan.main(["--devices", "cpu,cuda:7", "--conv", "4,8", "--fc", "8", "--batch-size", "8"]) == 2
    err = capsys.readouterr().err
    assert "calibrating" not in err and err.startswith("hetconv-plan: cuda:7") and len(err.splitlines()) == 1


def test_plan_refuses_a_saved_profile_with_a_zero_calibration(tmp_path, capsys):
    from hetconv.cli import plan
    layer = {"forward_fixed_s": 0.0, "forward_per_kernel_s": 0.0, "backward_fixed_s": 0.0, "backward_per_kernel_s": 0.0}
    path = tmp_path / "zero.json"
    path.write_text(json.dumps({"name": "gpu", "device": "cuda:0", "layers": [layer, layer]}))
    assert plan.main(["--devices", f"cpu,@{path}", "--conv", "4,8", "--fc", "8", "--batch-size", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"hetconv-plan: {path}: worker 'gpu': conv1's calibrated forward_per_kernel_s and "
                   f"backward_per_kernel_s are both 0, expected positive seconds (a zero calibration)")


def test_long_work_says_what_it_is_doing(capsys):
    """A CPU device says when it starts timing its conv paths (where a command shows progress),
    and a long wait prints a line every few seconds."""
    import numpy as np

    from hetconv.devices import open_device
    from hetconv.flags import show_progress, still_working
    import logging
    handler = show_progress()
    dev = open_device("cpu", conv_path="auto", threads=1, auto_timed_min_flops=0, onednn=False,
                      auto_timer=lambda path, run: run() or {"im2col": 1.0, "shifted": 2.0, "fft": 3.0}[path])
    x, w = np.zeros((2, 3, 9, 8), np.float32), np.zeros((4, 3, 3, 3), np.float32)
    try:
        dev.conv2d(x, w, np.zeros(4, np.float32), padding=1)
    finally:
        logging.getLogger("hetconv.devices").removeHandler(handler)
    assert capsys.readouterr().out == ("cpu device: timing conv paths im2col, shifted, fft on x (2, 3, 9, 8) "
                                       "w (4, 3, 3, 3) padding (1, 1) (once per call shape) ...\n")
    with still_working("counting sheep", every_s=0.05):
        time.sleep(0.3)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) >= 2 and lines[0].startswith("  ... still counting sheep (")
