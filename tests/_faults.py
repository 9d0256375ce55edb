"""Faults and membership events the multi-process tests inject into a run."""
import time

from conftest import external_worker


def kill_worker_on_step(engine, victim_index, at_step):
    """Make the engine's conv_step kill one spawned worker (SIGKILL) when step `at_step` starts."""
    real, calls = engine.conv_step, {"n": 0}

    def conv_step(*args, **kw):
        calls["n"] += 1
        if calls["n"] == at_step:
            proc = engine.processes[victim_index][1]
            proc.kill()
            proc.wait()
        return real(*args, **kw)
    engine.conv_step = conv_step


def join_during_step(engine, procs, at_step, *extra):
    """Make the engine's conv_step start an external worker named "late" (the run's own keys,
    hetconv-worker flags `extra`) when step `at_step` starts; its HELLO arrives during that step."""
    real, calls = engine.conv_step, {"n": 0}

    def conv_step(*args, **kw):
        calls["n"] += 1
        if calls["n"] == at_step:
            external_worker(procs, engine.address, "late", engine.worker_keydir, *extra)
            wait_for_hello(engine)
        return real(*args, **kw)
    engine.conv_step = conv_step


def wait_for_hello(engine, limit_s=90.0):
    """Until the engine has heard a joiner's HELLO (its receive absorbs one from a stranger and
    keeps it for the next snapshot), however long a loaded host takes to start the process: a
    fixed sleep let the HELLO arrive after the step, or after the run, on a busy machine."""
    deadline = time.monotonic() + limit_s
    while not engine.joining:
        assert time.monotonic() < deadline, f"no HELLO from the joiner within {limit_s:.0f} s"
        got = engine._receive({}, deadline + 1.0, "waiting for a joiner's HELLO")
        assert got is None, f"a message from a worker of the run between steps: {got}"
