"""The worker side: the serve loop (serve.py) and the peer step (peers.py; a graph's in graph_step.py,
both cutting tensors into workers' blocks as engine/layouts.py says). What the command line and the serve
loop share lives here: how a worker ends."""
import signal


class WorkerExit(Exception):
    """A reason to end the worker, printed as one line; exit status 2."""


class Terminated(Exception):
    """SIGTERM: raised in the main thread, so run's clean-up (ipc files, sockets) runs as on any
    other exit."""


def on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)    # a second one must not cut the clean-up short
    raise Terminated()
