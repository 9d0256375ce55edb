"""Faults the multi-process tests inject into a run."""


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
