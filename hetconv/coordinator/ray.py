"""`hetconv-coordinator --launcher ray`: the --spawn workers placed on a Ray cluster by their resources.

Each worker is a Ray actor holding `num_cpus` = its threads (and `num_gpus` = 1 for a CUDA
worker: Ray sets the visible GPU, so the worker opens cuda:0 of what it sees). The actor starts
the ordinary `python -m hetconv.cli.worker` as its child, so pinning and thread pools start fresh
and the worker loop is the one every other launcher runs; it connects back to the coordinator
over ZeroMQ like any worker. `RayProcess` gives the coordinator the same handle as a spawned
subprocess (`poll`, `pid`, `returncode`, `wait`, `terminate`, `kill`), so a dead actor is a lost
worker to hetconv.remote and the elastic path re-plans around it.

Ray is an optional extra (`pip install 'hetconv[ray]'`) and is imported only here, only when
asked for.
"""
import atexit
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading

from hetconv.engine.contract import WorkerLost
from hetconv.transport.keys import write_key_folder
from hetconv.transport.worker_argv import command

MISSING = "--launcher ray needs Ray, which is not installed: pip install 'hetconv[ray]'"


def import_ray():
    """The ray module, or ValueError with the one line that says how to install it."""
    try:
        import ray
    except ImportError:
        raise ValueError(MISSING) from None
    return ray


def check_address(address, timeout):
    """Raise ConnectionError, one line naming `address`, unless its host resolves and its port
    accepts a TCP connection within `timeout` seconds. ray.init on an address where no Ray head
    answers retries for minutes, printing Ray's GCS warnings; a head that is up accepts at once.
    'auto' (Ray finds the cluster itself) is left to Ray. A port that accepts but is not a Ray
    head still reaches ray.init."""
    if address == "auto":
        return
    scheme, _, text = address.rpartition("://")        # ray://HEAD:10001 is Ray Client: TCP too
    host, sep, port = text.rpartition(":")
    if not sep and scheme == "ray":
        host, port = text, "10001"                      # Ray Client's default port
    host = host.strip("[]")                             # [::1]:6379
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConnectionError(f"--ray-address {address!r}: expected HOST:PORT of the Ray head, e.g. HEAD:6379")
    outcome = []

    def connect():                  # in a thread: name resolution has no timeout of its own
        try:
            with socket.create_connection((host, int(port)), timeout=timeout):
                outcome.append(None)
        except socket.gaierror as e:
            outcome.append(f"cannot resolve host {host!r} ({e.strerror or e})")
        except ConnectionRefusedError:
            outcome.append(f"nothing accepts connections on port {port} of {host}")
        except OSError as e:
            outcome.append(f"cannot connect ({e.strerror or type(e).__name__})")

    thread = threading.Thread(target=connect, name="ray-address-check", daemon=True)
    thread.start()
    thread.join(timeout)
    reason = outcome[0] if outcome else f"no answer within {timeout:g}s (--connect-timeout)"
    if reason is not None:
        raise ConnectionError(f"--ray-address {address!r}: {reason}: is a Ray head running there "
                              f"(ray start --head)?")


class _WorkerActor:
    """Runs one hetconv-worker as a child process. Threaded (max_concurrency=2), so `signal` can
    reach the child while `wait` blocks on it."""

    def start(self, spec, key_files=None):
        """spec: hetconv.worker.command's arguments but the parent pid (this actor's) and keys."""

        self.keydir = None
        if key_files:
            # The run's worker keys, written where this node's worker reads them (a private temp
            # folder, removed when the worker ends). They travelled through Ray, which runs this
            # code: the cluster is trusted; the network beyond it is not.
            self.keydir = write_key_folder(key_files)
        # --parent-pid: the worker ends itself within one heartbeat when this actor dies (ray.kill,
        # a lost node), so a killed actor never leaves its worker behind.
        self.proc = subprocess.Popen(command(**spec, parent_pid=os.getpid(), curve=self.keydir or ""))
        return {"pid": self.proc.pid, "host": socket.gethostname()}

    def wait(self):
        try:
            return self.proc.wait()
        finally:
            if self.keydir:
                shutil.rmtree(self.keydir, ignore_errors=True)

    def signal(self, signum):
        if self.proc.poll() is None:
            self.proc.send_signal(signum)


class RayProcess:
    """A worker on Ray, behind the subset of subprocess.Popen that RemoteEngine uses. `pid` is the
    worker's own pid (the one its HELLO carries), on whichever node Ray placed it. Nothing here
    blocks longer than its timeout: poll() is a ray.wait with timeout 0 (a few microseconds)."""

    DEAD = -signal.SIGKILL          # the returncode of a worker whose actor died (ray.kill, node lost)

    def __init__(self, ray, actor, label, pid, host):
        self.ray, self.actor, self.label = ray, actor, label
        self.pid, self.host = pid, host
        self.args = f"Ray actor for worker {label} (pid {pid} on {host})"
        self.returncode = None
        self._ref = actor.wait.remote()

    def poll(self):
        if self.returncode is None:
            try:
                ready, _ = self.ray.wait([self._ref], timeout=0)
            except Exception:                  # Ray itself is gone (shut down, raylet killed)
                ready = [self._ref]
            if ready:
                self.returncode = self._result()
        return self.returncode

    def _result(self):
        try:
            return int(self.ray.get(self._ref, timeout=5))
        except Exception:                      # RayActorError: the actor died, so did its worker
            return self.DEAD

    def wait(self, timeout=None):
        timeout = 30.0 if timeout is None else timeout      # every wait has a deadline
        if self.returncode is None:
            try:
                ready, _ = self.ray.wait([self._ref], timeout=timeout)
            except Exception:
                ready = [self._ref]
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = self._result()
        return self.returncode

    def terminate(self):
        try:
            self.actor.signal.remote(signal.SIGTERM)
        except Exception:
            pass

    def kill(self):
        """SIGKILL to the worker, then the actor itself: both end even if one is hung."""
        try:
            self.ray.get(self.actor.signal.remote(signal.SIGKILL), timeout=2)
        except Exception:
            pass
        self.end_actor()

    def end_actor(self):
        try:
            self.ray.kill(self.actor, no_restart=True)
        except Exception:
            pass


def plain_worker_lines(environ=os.environ, streams=None):
    """Ray prints its actors' output prefixed with terminal colour codes; where this process's
    output is not a terminal (a log file, a pipe, Slurm's output) they are noise, so Ray is told
    to leave them out (RAY_COLOR_PREFIX=0, read as each line is printed). One the user set stays.
    The streams are this process's stdout and stderr as they are at the call (a caller may have
    replaced them); a closed one is not a terminal."""
    if not all(_is_terminal(s) for s in (streams if streams is not None else (sys.stdout, sys.stderr))):
        environ.setdefault("RAY_COLOR_PREFIX", "0")


def _is_terminal(stream):
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):      # no isatty, or closed
        return False


class RayLauncher:
    """Connects to Ray (`address`), or starts a local instance with `num_cpus` (address None),
    and places workers on it. close() ends every actor and, if this launcher started Ray, Ray."""

    def __init__(self, address=None, num_cpus=None, start_timeout=60.0):
        ray = import_ray()
        if address is not None:
            check_address(address, start_timeout)
        self.ray, self.local, self.start_timeout = ray, address is None, start_timeout
        self.started = []                                   # RayProcess, in order
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")   # no usage report leaves this host
        plain_worker_lines()
        try:
            # address="local" starts a new instance even when RAY_ADDRESS names another cluster:
            # the coordinator then listens on loopback, which only this host reaches.
            # The dashboard is not started: it costs seconds and processes, and nothing reads it.
            ray.init(address=address or "local", num_cpus=num_cpus if self.local else None,
                     include_dashboard=False, logging_level=logging.ERROR, log_to_driver=True)
        except Exception as e:
            where = f"the Ray cluster at {address}" if address else "a local Ray instance"
            raise ConnectionError(f"--launcher ray: cannot start or reach {where}: "
                                  f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
        self._actor_class = ray.remote(max_concurrency=2)(_WorkerActor)
        atexit.register(self.close)

    def bind_address(self):
        """Where the coordinator listens: loopback for a local Ray, else the address the other
        nodes of the cluster reach this host on (any free port)."""
        if self.local:
            return "tcp://127.0.0.1:0"
        return f"tcp://{self.ray.util.get_node_ip_address()}:0"

    def cpu_threads(self, cpu_workers):
        """Threads of a plain `cpu` worker when neither --threads nor cpu:THREADS says: the cluster's
        CPUs shared among the plain CPU workers, at most the largest node's (or it could never be
        placed)."""
        nodes = [n.get("Resources", {}).get("CPU", 0) for n in self.ray.nodes() if n.get("Alive")]
        if not nodes or not cpu_workers:
            return 1
        return max(1, int(min(max(nodes), sum(nodes) // cpu_workers)))

    def start(self, workers, address, threads, connect_timeout, extra_args=(), key_files=None):
        """workers: [(label, device)] with device cpu, cpu:THREADS or cuda:N. Returns
        [(label, RayProcess)]. A worker Ray cannot place (too few CPUs or GPUs) stays pending, and
        the coordinator's --connect-timeout names it."""
        host, port = address.rsplit(":", 1)
        if host in ("tcp://0.0.0.0", "tcp://*"):             # listening everywhere: tell them a reachable one
            address = f"tcp://{self.ray.util.get_node_ip_address()}:{port}"
        plain = sum(1 for _, d in workers if d == "cpu")
        default_threads = threads or self.cpu_threads(plain)
        procs = []
        for label, device in workers:
            spec = {"address": address, "name": label, "connect_timeout": connect_timeout, "extra": list(extra_args)}
            if device.startswith("cuda"):
                # Ray picks the GPU and makes it the only one visible: it is cuda:0 in the worker.
                resources = {"num_cpus": 1, "num_gpus": 1}
                spec.update(device="cuda:0")
            else:
                n = int(device.split(":")[1]) if ":" in device else default_threads
                resources = {"num_cpus": n, "num_gpus": 0}
                spec.update(device="cpu", threads=n)
            actor = self._actor_class.options(**resources).remote()
            procs.append((label, actor, actor.start.remote(spec, key_files)))
        out = []
        for label, actor, ref in procs:
            info = self._started(label, ref)
            proc = RayProcess(self.ray, actor, label, info["pid"], info["host"])
            self.started.append(proc)
            out.append((label, proc))
        return out

    def _started(self, label, ref):
        ready, _ = self.ray.wait([ref], timeout=self.start_timeout)
        if not ready:
            raise WorkerLost(f"Ray did not place worker {label} within {self.start_timeout:.0f}s: "
                             f"{self.resources_note()}")
        try:
            return self.ray.get(ref, timeout=5)
        except Exception as e:                 # the actor died, or could not start python there
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise WorkerLost(f"Ray could not start worker {label}: {type(e).__name__}: {first}") from None

    def resources_note(self):
        try:
            free, total = self.ray.available_resources(), self.ray.cluster_resources()
        except Exception:
            return "Ray did not say what it has"
        return (f"the cluster has {free.get('CPU', 0):g} of {total.get('CPU', 0):g} CPUs and "
                f"{free.get('GPU', 0):g} of {total.get('GPU', 0):g} GPUs free (ask for fewer threads or workers)")

    def close(self):
        """Ends every actor (their workers follow within a heartbeat, if still running) and Ray,
        if this launcher started it; a driver of a cluster only disconnects."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        for proc in self.started:
            if proc.poll() is None:
                proc.kill()
            proc.end_actor()
        try:
            self.ray.shutdown()
        except Exception:
            pass
