"""`hetconv-coordinator`: data, FC layers, loss, planner, checkpoints; conv kernels on workers.

    hetconv-coordinator --spawn cpu,cpu            # start two local CPU workers and train
    hetconv-coordinator --bind tcp://0.0.0.0:5555 --workers 3   # wait for three external workers
    hetconv-coordinator --local                    # the single-device baseline, in one process

The engines live in hetconv.engine (the contract, and --local) and hetconv.remote (workers over
ZeroMQ); this module is the command line.
"""
import argparse
import signal
import sys

from hetconv.config import add_config_flags, config_from_args
from hetconv.planner import PlanError
from hetconv.remote import RemoteEngine, WorkerError, WorkerLost


# ---- command line --------------------------------------------------------------------------------

def build_parser():
    p = argparse.ArgumentParser(
        prog="hetconv-coordinator",
        description="Train a CNN with each conv layer's kernels split across CPU/GPU workers in proportion to "
                    "their measured speed; FC layers, loss and checkpoints stay here. With no mode flag it "
                    "spawns two local CPU workers (--spawn cpu,cpu) and trains the paper network on the "
                    "built-in synthetic data set.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    mode = p.add_argument_group("where the conv layers run (choose one)")
    mode.add_argument("--local", action="store_true", help="in this process on one CPU device: the single-device baseline")
    mode.add_argument("--spawn", default="", help="start these workers on this host, e.g. cpu,cpu or cpu,cuda:0")
    mode.add_argument("--workers", type=int, default=0, help="wait for this many external hetconv-worker processes")
    net = p.add_argument_group("network")
    net.add_argument("--bind", default="", help="address to listen on (default tcp://127.0.0.1:5555 with --workers, "
                                                "a free loopback port with --spawn)")
    net.add_argument("--worker-timeout", type=float, default=10.0, help="seconds without a heartbeat before a worker counts as lost")
    net.add_argument("--connect-timeout", type=float, default=60.0, help="seconds to wait for workers to connect")
    net.add_argument("--op-timeout", type=float, default=600.0, help="seconds any one request may take")
    net.add_argument("--no-pin", action="store_true", help="do not pin spawned CPU workers to disjoint cores")
    p.add_argument("--resume", default="", help="a checkpoint file, or a directory (its newest checkpoint)")
    add_config_flags(p)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"hetconv-coordinator: {e}", file=sys.stderr)
        return 2
    modes = [bool(args.local), bool(args.spawn), args.workers > 0]
    if sum(modes) > 1:
        print("hetconv-coordinator: choose one of --local, --spawn, --workers", file=sys.stderr)
        return 2
    if args.workers < 0:
        print(f"hetconv-coordinator: --workers must be >= 1, got {args.workers}", file=sys.stderr)
        return 2
    if sum(modes) == 0:
        args.spawn = "cpu,cpu"
    # SIGTERM ends the run like an exception, so the finally below still ends every worker.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(143)))
    engine = None
    from hetconv.checkpoint import CheckpointError
    from hetconv.data import DataError
    from hetconv.devices import DeviceError, parse_device
    try:
        if args.local:
            from hetconv.devices import open_device
            from hetconv.engine import LocalEngine
            from hetconv.shard import ConvShard
            device = open_device("cpu", threads=cfg.threads or None)
            print(f"local: {device.describe()}")
            engine = LocalEngine({"local": ConvShard(device)})
        else:
            spawn = [s.strip() for s in args.spawn.split(",") if s.strip()] if args.spawn else []
            for s in spawn:
                parse_device(s)
            bind = args.bind or ("tcp://127.0.0.1:0" if spawn else "tcp://127.0.0.1:5555")
            engine = RemoteEngine(bind, args.workers, spawn, threads=cfg.threads, worker_timeout=args.worker_timeout,
                                  connect_timeout=args.connect_timeout, op_timeout=args.op_timeout, pin=not args.no_pin,
                                  exchange=cfg.exchange, wire=cfg.wire_dtype)
        from hetconv.train import train
        summary = train(cfg, engine, resume=args.resume or None)
    except (WorkerError, WorkerLost, PlanError, DeviceError, DataError, CheckpointError, ValueError, FloatingPointError) as e:
        print(f"hetconv-coordinator: {e}", file=sys.stderr)
        if isinstance(e, WorkerError) and e.remote_traceback:
            print(f"--- worker traceback ---\n{e.remote_traceback}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("hetconv-coordinator: interrupted", file=sys.stderr)
        return 130
    finally:
        if engine is not None:
            engine.close()
    return 0 if not summary.get("interrupted") else 130


if __name__ == "__main__":
    sys.exit(main())
