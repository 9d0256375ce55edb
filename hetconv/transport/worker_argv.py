"""How a worker process is started: the argv a coordinator's --spawn or a launcher's actor runs, and
the environment variable that gives a worker its coordinator's address."""
import sys

COORDINATOR_ENV = "HETCONV_COORDINATOR"      # the coordinator's address when --connect is not given


def command(address, name, device, connect_timeout, parent_pid, threads=0, curve="", extra=()):
    """The argv that starts one worker the way a coordinator (--spawn) or a launcher's actor does:
    it ends itself when `parent_pid` is gone."""
    cmd = [sys.executable, "-m", "hetconv.cli.worker", "--device", device, "--connect", address, "--name", name,
           "--parent-pid", str(parent_pid), "--connect-timeout", str(connect_timeout), *extra]
    if threads:
        cmd += ["--threads", str(threads)]
    if curve:
        cmd += ["--curve", curve]
    return cmd
