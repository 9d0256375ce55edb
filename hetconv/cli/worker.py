"""`hetconv-worker`: serve a slice of every conv layer's kernels on one device to a coordinator."""
import argparse
import os
import signal
import sys
import threading

from hetconv.flags import HelpFormatter, add_version
# the names only: hetconv.devices.cpu itself would start numba before --cores pins this process
CPU_CONV_PATHS = ("auto", "im2col", "shifted", "fft", "im2col-dnnl", "direct-dnnl", "depthwise", "winograd")
PRECISIONS = ("fp32", "bf16", "auto")
from hetconv.transport.worker_argv import COORDINATOR_ENV
from hetconv.worker import Terminated, WorkerExit, on_sigterm


# Pinning and thread caps must happen before numpy/numba load their thread pools.
def _early_pin(argv):
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--cores", default="")
    known, _ = parser.parse_known_args(argv)
    if not known.cores or not hasattr(os, "sched_setaffinity"):
        return
    allowed = sorted(os.sched_getaffinity(0))
    try:
        cores = {int(c) for c in known.cores.split(",") if c.strip()}
        if not cores or not cores <= set(allowed):      # Linux silently drops unknown cores
            raise ValueError(known.cores)
        os.sched_setaffinity(0, cores)
    except (ValueError, OSError):
        raise WorkerExit(f"--cores {known.cores!r}: expected a comma list of CPU cores this process may use, "
                         f"some of {','.join(map(str, allowed))}") from None


def build_parser():
    p = argparse.ArgumentParser(
        prog="hetconv-worker",
        description="Serve a slice of every conv layer's kernels on one device to a hetconv coordinator. "
                    "Start one per device; the coordinator calibrates them and splits kernels by speed.",
        epilog="examples:\n"
               "  hetconv-worker --device cpu --connect tcp://10.0.0.5:5555 --threads 4\n"
               "  hetconv-worker --device cuda:0 --connect tcp://10.0.0.5:5555 --name gpu0",
        formatter_class=HelpFormatter)
    p.add_argument("--device", required=True, help="'cpu', 'cpu:THREADS' or 'cuda:N' (GPU N of this host)")
    p.add_argument("--connect", default="", help="the coordinator's address, tcp://HOST:PORT, e.g. tcp://127.0.0.1:5555 "
                                                 f"(default: ${COORDINATOR_ENV}, as a Slurm job script sets it)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for a cpu device (0: every core this process may use)")
    p.add_argument("--cpu-conv-path", default="auto", choices=CPU_CONV_PATHS,
                   help="a cpu device's conv path: auto (per layer and share, the fastest by timing on first use), "
                        "or forced: im2col, shifted, fft (stride-1 layers), im2col-dnnl (oneDNN's sgemm), "
                        "direct-dnnl (oneDNN's convolutions), depthwise (depthwise convs; others im2col), winograd "
                        "(F(4x4,3x3) on 3x3 stride-1 convs; others by the rule)")
    p.add_argument("--precision", default="fp32", choices=PRECISIONS,
                   help="a cpu device's conv GEMMs: fp32; bf16 (bf16 operands, fp32 sums; needs oneDNN); auto (bf16 "
                        "where its timing finds it faster, per layer and share). A GPU runs fp32")
    p.add_argument("--retime", action="store_true",
                   help="time a cpu device's conv paths again and store them over this machine's wisdom "
                        "($HETCONV_CACHE/conv-paths-3.json, default ~/.cache/hetconv), which otherwise gives a call "
                        "shape timed before on this machine its path")
    p.add_argument("--deterministic", action="store_true",
                   help="a cpu device's conv paths by a fixed rule, no timing and no wisdom: the same bits every run "
                        "(slower where another path is faster)")
    p.add_argument("--name", default="", help="a label for tables and logs (default: DEVICE@HOST)")
    p.add_argument("--cores", default="", help="pin this worker to these CPU cores, e.g. 0,1 (before any thread pool starts)")
    p.add_argument("--connect-timeout", type=float, default=60.0, help="seconds to wait for the coordinator to answer HELLO")
    p.add_argument("--idle-timeout", type=float, default=900.0, help="exit after this many seconds with no request")
    p.add_argument("--heartbeat", type=float, default=1.0, help="seconds between heartbeats")
    p.add_argument("--peer-address", default="", help="address other workers reach this one on (default: the "
                                                      "interface this host uses to reach the coordinator)")
    p.add_argument("--curve", default="", metavar="DIR",
                   help="this worker's key folder from hetconv-keygen (DIR/workers/NAME, or a DIR holding one worker): "
                        "talk only to the coordinator and peers holding the matching keys, encrypted")
    p.add_argument("--message-limit-mb", type=float, default=1024.0,
                   help="the largest frame accepted from the coordinator or a peer, in MB (ZMQ_MAXMSGSIZE): a bigger "
                        "one drops that connection. The coordinator says at WELCOME what its run needs; a worker "
                        "below it exits saying so")
    p.add_argument("--verbose", action="store_true", help="print the traceback of a failure while serving")
    p.add_argument("--parent-pid", type=int, default=0, help=argparse.SUPPRESS)
    return add_version(p)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    # Signals are handled on the main thread only. A SIGTERM that the caller set to be ignored stays
    # ignored (`trap '' TERM` in a Slurm recipe: the coordinator gets the job's SIGTERM too, and its
    # workers must serve the step and checkpoint it finishes before ending them).
    on_main_thread = (threading.current_thread() is threading.main_thread()
                      and signal.getsignal(signal.SIGTERM) != signal.SIG_IGN)
    previous = signal.signal(signal.SIGTERM, on_sigterm) if on_main_thread else None
    try:
        _early_pin(argv)
        # Imported only now: numpy and numba start their thread pools on import, after the pinning above.
        from hetconv.worker.serve import run
        run(build_parser().parse_args(argv))
    except WorkerExit as e:
        print(f"hetconv-worker: {e}", file=sys.stderr, flush=True)
        return 2
    except Terminated:
        print("hetconv-worker: terminated (SIGTERM); exiting", file=sys.stderr, flush=True)
        return 128 + signal.SIGTERM            # 143, as a shell reports a process the signal ended
    except KeyboardInterrupt:
        return 130
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous)    # a caller in-process gets its own handler back
    return 0


def entry():
    """The hetconv-worker command: main(), then the process ends as serve.exit_process says."""
    code = main()
    serve = sys.modules.get("hetconv.worker.serve")     # not imported: nothing ever ran
    if serve is None:
        sys.exit(code)
    serve.exit_process(code)


if __name__ == "__main__":
    entry()
