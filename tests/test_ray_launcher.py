"""Workers placed by Ray (`--launcher ray`) and found through HETCONV_COORDINATOR (Slurm).

The Ray tests start local Ray instances of 2 CPUs (a start takes 3-4 s here, a whole run about
20 s on 2 loaded cores). Every process a run starts carries a marker in its environment, so the
test can tell that none is left afterwards: Ray renames its worker processes (ray::IDLE), so
their command lines do not say whose they are.
"""
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from conftest import python_cmd

FLAGS = ["--data", "synthetic", "--conv", "6,10", "--fc", "16", "--steps", "8", "--batch-size", "16", "--seed", "3",
         "--lr", "0.01"]


def losses(path):
    return [json.loads(line)["loss"] for line in open(path) if '"event": "step"' in line]


def marked(marker):
    """pids of live (not zombie) processes whose environment holds `marker`."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() not in f.read():
                    continue
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[-1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        found.append(int(pid))
    return found


def leftovers(marker, seconds=15):
    deadline = time.monotonic() + seconds
    while marked(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [open(f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")[:120]
            for p in marked(marker)]


@pytest.fixture
def marker():
    """A marker for the environment of the processes a test starts; whatever still carries it
    when the test ends is killed, so a failing test leaves nothing behind either."""
    mark = f"HETCONV_TEST_RUN=ray-{uuid.uuid4().hex}"
    yield mark
    for pid in marked(mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_marked(marker, args, timeout):
    key, value = marker.split("=", 1)
    return subprocess.run(args, env={**os.environ, key: value}, capture_output=True, text=True, timeout=timeout,
                          start_new_session=True)


def test_ray_workers_train_like_local_and_leave_no_process(tmp_path, marker):
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'hetconv[ray]')")
    # the local reference run goes on while Ray starts (unmarked: it is not the Ray run's)
    local = subprocess.Popen(python_cmd("hetconv.cli.coordinator", "--local", "--metrics", tmp_path / "local.jsonl",
                                        *FLAGS), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        # --use-all: the planner may rightly leave a worker out on a busy machine
        ray_run = run_marked(marker, python_cmd("hetconv.cli.coordinator", "--launcher", "ray", "--spawn", "cpu,cpu",
                                                "--calibration-batch", "4", "--use-all",
                                                "--metrics", tmp_path / "ray.jsonl", *FLAGS), timeout=240)
        _, local_err = local.communicate(timeout=120)
    finally:
        if local.poll() is None:
            local.kill()
            local.wait()
    assert ray_run.returncode == 0, ray_run.stdout + ray_run.stderr
    assert "waiting for 2 worker(s) on tcp://127.0.0.1:" in ray_run.stdout     # a local Ray: loopback
    assert leftovers(marker) == []
    assert local.returncode == 0, local_err
    got, want = losses(tmp_path / "ray.jsonl"), losses(tmp_path / "local.jsonl")
    assert len(got) == 8
    np.testing.assert_allclose(got, want, rtol=1e-5)
    plan = next(json.loads(line) for line in open(tmp_path / "ray.jsonl") if '"event": "plan"' in line)
    assert set(plan["layers"][0]["kernels"]) == {"w0-cpu", "w1-cpu"}


def test_a_killed_ray_actor_is_a_lost_worker_and_the_run_recovers(tmp_path, marker):
    """In-process, so the test can reach the actor: ray.kill at step 4 (snapshots after steps 2
    and 4), the survivor goes on from the snapshot, and the run equals an uninterrupted one."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'hetconv[ray]')")
    from hetconv.training import checkpoint
    from hetconv.training.config import Config
    from hetconv.devices import open_device
    from hetconv.engine.local import LocalEngine
    from hetconv.coordinator.ray import RayLauncher
    from hetconv.coordinator.remote import RemoteEngine
    from hetconv.engine.shard import ConvShard
    from hetconv.training.loop import train

    cfg = dict(conv="6,12", fc="32", batch_size=32, synthetic_train=512, synthetic_test=64, lr=0.01, threads=1,
               calibration_batch=4, steps=6, snapshot_every=2, rebalance_after=0,
               use_all=True)              # the planner may rightly leave a worker out on a busy machine
    local = train(Config(**cfg, checkpoint_dir=str(tmp_path / "local")).validate(),
                  LocalEngine({"local": ConvShard(open_device("cpu", threads=1))}), log=lambda *a: None)
    key, value = marker.split("=", 1)
    os.environ[key] = value                   # Ray's processes, started from here, inherit it
    launcher = engine = None
    try:
        launcher = RayLauncher(None, num_cpus=2)
        engine = RemoteEngine(launcher.bind_address(), 0, ["cpu", "cpu"], threads=1, connect_timeout=60,
                              log=lambda *a: None, launcher=launcher)
        victim = engine.processes[1][1]
        worker_pid = victim.pid
        real, calls = engine.conv_step, {"n": 0}

        def conv_step(*args, **kw):
            calls["n"] += 1
            if calls["n"] == 4:
                launcher.ray.kill(victim.actor)              # as an operator or a lost node would
            return real(*args, **kw)
        engine.conv_step = conv_step
        metrics = tmp_path / "m.jsonl"
        summary = train(Config(**cfg, checkpoint_dir=str(tmp_path / "dist"), metrics=str(metrics)).validate(),
                        engine, log=lambda *a: None)
        survivors = list(engine.plan.workers)
        assert victim.poll() == victim.DEAD
    finally:
        if engine is not None:
            engine.close()
        if launcher is not None:
            launcher.close()
        del os.environ[key]
    assert survivors == ["w0-cpu"]
    records = [json.loads(line) for line in open(metrics)]
    lost = [r for r in records if r["event"] == "worker_lost"]
    # Ray ends an actor's child processes with it, so the worker's socket may close before Ray
    # reports the actor dead: either way it is named, as a lost worker
    assert len(lost) == 1 and lost[0]["worker"] == "w1-cpu", lost
    assert "exited with code -9" in lost[0]["reason"] or "disconnected" in lost[0]["reason"], lost
    assert records[-1]["event"] == "done"
    np.testing.assert_allclose(summary["losses"], local["losses"], rtol=1e-4)
    _, conv, fc = checkpoint.load(str(tmp_path / "dist"))
    _, local_conv, local_fc = checkpoint.load(str(tmp_path / "local"))
    for got, want in zip(conv + fc, local_conv + local_fc):
        assert sorted(got) == sorted(want)
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-6)
    assert leftovers(marker) == [], f"the killed actor's worker (pid {worker_pid}) or Ray outlived the run"


def test_sigterm_mid_run_ends_every_actor_and_ray(tmp_path, marker):
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'hetconv[ray]')")
    from test_distributed import wait_for_step
    key, value = marker.split("=", 1)
    metrics = tmp_path / "m.jsonl"
    with open(tmp_path / "out.txt", "w") as out:
        coord = subprocess.Popen(python_cmd("hetconv.cli.coordinator", "--launcher", "ray", "--spawn", "cpu,cpu",
                                            "--conv", "6,12", "--fc", "16", "--batch-size", "32",
                                            "--synthetic-train", "20000", "--synthetic-test", "64",
                                            "--calibration-batch", "4", "--metrics", metrics),
                                 env={**os.environ, key: value}, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    try:
        wait_for_step(metrics)
        coord.send_signal(signal.SIGTERM)
        assert coord.wait(timeout=60) == 143, (tmp_path / "out.txt").read_text()
    finally:
        if coord.poll() is None:
            coord.kill()
            coord.wait(timeout=10)
    assert leftovers(marker) == []


def test_a_worker_ray_cannot_place_is_named_and_nothing_is_left(marker):
    """No node has 4096 CPUs: that worker's actor stays pending until --connect-timeout."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'hetconv[ray]')")
    r = run_marked(marker, python_cmd("hetconv.cli.coordinator", "--launcher", "ray", "--spawn", "cpu,cpu:4096",
                                      "--connect-timeout", "5", *FLAGS), timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Ray did not place worker w1-cpu:4096 within 5s: the cluster has" in r.stderr
    assert leftovers(marker) == []


def test_launcher_flags_are_checked_before_any_work(tmp_path):
    bad = [(["--launcher", "ray", "--local"], "--launcher ray places --spawn workers: it cannot go with --local"),
           (["--launcher", "ray", "--workers", "2"], "cannot go with --workers"),
           (["--ray-address", "10.0.0.1:6379"], "--ray-address '10.0.0.1:6379' is for --launcher ray")]
    for args, message in bad:
        r = subprocess.run(python_cmd("hetconv.cli.coordinator", *args, *FLAGS), capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and message in r.stderr, (args, r.stderr)


def test_a_missing_ray_is_named_with_its_extra(tmp_path):
    # a module named ray that fails to import stands in for an environment without the extra
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text("raise ImportError('no ray here')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run(python_cmd("hetconv.cli.coordinator", "--launcher", "ray", *FLAGS), capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 2
    assert r.stderr.strip() == "hetconv-coordinator: --launcher ray needs Ray, which is not installed: " \
                               "pip install 'hetconv[ray]'"


def test_ray_stays_out_of_the_paths_that_do_not_use_it():
    code = ("import sys, hetconv.cli.coordinator, hetconv.coordinator.remote, hetconv.worker.serve, hetconv.coordinator.ray; "
            "print('ray' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "False", r.stderr


# ---- HETCONV_COORDINATOR: how a worker started by srun finds the coordinator -------------------------------

def test_a_worker_finds_the_coordinator_through_the_environment(procs, tmp_path):
    from test_distributed import free_port
    address = f"tcp://127.0.0.1:{free_port()}"
    common = ["--conv", "6,12", "--fc", "16", "--batch-size", "32", "--synthetic-train", "256", "--synthetic-test",
              "64", "--steps", "2", "--threads", "1", "--calibration-batch", "4"]
    coord = procs(python_cmd("hetconv.cli.coordinator", "--workers", "1", "--bind", address, *common))
    worker = procs(python_cmd("hetconv.cli.worker", "--device", "cpu", "--threads", "1", "--name", "from-env"),
                   env={**os.environ, "HETCONV_COORDINATOR": address})
    out, _ = coord.communicate(timeout=120)
    assert coord.returncode == 0, out
    assert "worker from-env (cpu" in out
    assert worker.wait(timeout=15) == 0


def test_a_worker_with_no_coordinator_address_says_to_give_one():
    env = {k: v for k, v in os.environ.items() if k != "HETCONV_COORDINATOR"}
    r = subprocess.run(python_cmd("hetconv.cli.worker", "--device", "cpu"), capture_output=True, text=True, timeout=60,
                       env=env)
    assert r.returncode == 2
    assert r.stderr.strip() == ("hetconv-worker: no coordinator address: give --connect tcp://HOST:PORT "
                                "or set HETCONV_COORDINATOR")
    r = subprocess.run(python_cmd("hetconv.cli.worker", "--device", "cpu"), capture_output=True, text=True, timeout=60,
                       env={**env, "HETCONV_COORDINATOR": "10.0.0.5"})
    assert r.returncode == 2 and "HETCONV_COORDINATOR '10.0.0.5': expected tcp://HOST:PORT" in r.stderr


def test_the_slurm_recipe_is_valid_bash_and_sets_the_coordinator_address():
    from conftest import REPO
    script = os.path.join(REPO, "examples", "slurm", "train.sbatch")
    r = subprocess.run(["bash", "-n", script], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    text = open(script).read()
    assert 'export HETCONV_COORDINATOR="tcp://$COORDINATOR_HOST:$PORT"' in text
    assert "scontrol show hostnames" in text
