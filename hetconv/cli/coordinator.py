"""`hetconv-coordinator`: data, FC layers, loss, planner, checkpoints; conv kernels on workers.

    hetconv-coordinator --spawn cpu,cpu            # start two local CPU workers and train
    hetconv-coordinator --bind tcp://0.0.0.0:5555 --curve keys --workers 3   # three keyed external workers
    hetconv-coordinator --local                    # the single-device baseline, in one process

The engines live in hetconv.engine (the contract, and --local) and hetconv.remote (workers over
ZeroMQ); this module is the command line.
"""
import argparse
import dataclasses
import logging
import math
import os
import signal
import sys
import threading
import traceback

from hetconv import runtimes
from hetconv.coordinator.ray import RayLauncher, check_address, import_ray
from hetconv.coordinator.remote import RemoteEngine, WorkerError, WorkerLost, spawned_worker_names
from hetconv.data import DataError, load_dataset
from hetconv.devices import DeviceError, cuda_extra_missing, open_device, parse_device_list
from hetconv.devices.cpu_options import CpuOptions
from hetconv.engine.local import LocalEngine
from hetconv.engine.planner import PlanError, forced_modes, given_plan, recorded_worker_names
from hetconv.engine.shard import ConvShard
from hetconv.flags import (HelpFormatter, add_version, check_endpoint, check_output_dir, check_output_file,
                           check_range, say_in_handler, show_progress, threads_note, usable_cores)
from hetconv.geometry import ConvSpec, message_limit_bytes
from hetconv.net.presets import PRESETS
from hetconv.training.checkpoint import CheckpointError, load_newest_valid, recorded_conv_paths
from hetconv.training.config import Config, add_config_flags, config_from_args
from hetconv.training.loop import network_for, resume_lines, resumed_config, run_length, train
from hetconv.training.metrics import last_plan_record
from hetconv.training.recipe import Recipe
from hetconv.transport.keys import coordinator_keys, first_worker_dir, refuse_open_bind

# ---- command line --------------------------------------------------------------------------------

EXAMPLES = """examples:
  hetconv-coordinator --spawn cpu,cpu                       two local CPU workers (the default)
  hetconv-coordinator --spawn cpu:1,cpu:1,cuda:0            two 1-thread CPU workers and GPU 0
  hetconv-coordinator --local --conv 4,8 --fc 8 --steps 2   a tiny single-device run
  hetconv-keygen keys && hetconv-coordinator --bind tcp://0.0.0.0:5555 --curve keys --workers 3
                                                            wait for three keyed hetconv-worker processes
  hetconv-coordinator --spawn cpu,cpu --checkpoint-dir ckpt --metrics run.jsonl
  hetconv-coordinator --spawn cpu,cpu --resume ckpt --checkpoint-dir ckpt --metrics run.jsonl
  hetconv-coordinator --launcher ray --spawn cpu:8x4,cuda:0x2 --ray-address HEAD:6379
                                                            the same workers, placed by a Ray cluster"""


def build_parser():
    p = argparse.ArgumentParser(
        prog="hetconv-coordinator",
        description="Train a CNN with each conv layer's kernels split across CPU/GPU workers in proportion to "
                    "their measured speed; FC layers, loss and checkpoints stay here. With no mode flag it "
                    "spawns two local CPU workers (--spawn cpu,cpu) and trains the paper network on the "
                    "built-in synthetic data set.",
        epilog=EXAMPLES, formatter_class=HelpFormatter)
    group = p.add_argument_group("where the conv layers run (choose one)")
    mode = group.add_mutually_exclusive_group()
    mode.add_argument("--local", action="store_true", help="in this process on one CPU device: the single-device baseline")
    mode.add_argument("--spawn", default=None,
                      help="start these workers on this host: a comma list of cpu, cpu:THREADS, cuda:N, each "
                           "optionally xCOUNT, e.g. cpu,cpu or cpu:1x2,cuda:0 (default: cpu,cpu)")
    mode.add_argument("--workers", type=int, default=None, help="wait for this many external hetconv-worker processes")
    net = p.add_argument_group("connection (workers and the coordinator)")
    net.add_argument("--bind", default="", help="address to listen on (default: tcp://127.0.0.1:5555 with --workers, "
                                                "a free loopback port with --spawn)")
    net.add_argument("--curve", default="", metavar="DIR",
                     help="admit only workers whose public keys are in DIR/authorized (make DIR with hetconv-keygen); "
                          "all traffic encrypted. Needed to --bind an address other hosts can reach")
    net.add_argument("--insecure", action="store_true",
                     help="no keys: bind off loopback without --curve, and let --spawn run its workers without the "
                          "keys it otherwise makes for them (to measure what the encryption costs)")
    net.add_argument("--worker-timeout", type=float, default=10.0, help="seconds without a heartbeat before a worker counts as lost")
    net.add_argument("--connect-timeout", type=float, default=60.0, help="seconds to wait for workers to connect")
    net.add_argument("--op-timeout", type=float, default=600.0, help="seconds any one request may take")
    net.add_argument("--launcher", choices=("local", "ray"), default="local",
                     help="who starts the --spawn workers: 'local' (processes on this host) or 'ray' (Ray actors, "
                          "placed by their threads and GPUs; needs pip install 'hetconv[ray]')")
    net.add_argument("--ray-address", default="", help="with --launcher ray: the cluster to join, e.g. HEAD:6379 "
                                                       "(default: start a local Ray instance on this host's cores)")
    net.add_argument("--no-pin", action="store_true", help="do not pin spawned CPU workers to disjoint cores")
    p.add_argument("--resume", default="", help="a checkpoint file, or a directory (its newest checkpoint)")
    p.add_argument("--stop-grace", type=float, default=20.0,
                   help="on SIGTERM or Ctrl-C, seconds for the running step and its checkpoint; past that (or on a "
                        "second signal) the last in-memory snapshot is saved instead (Slurm and Kubernetes allow 30 s "
                        "before SIGKILL)")
    p.add_argument("--verbose", action="store_true",
                   help="print details too: a failing worker's own traceback, spawned workers' own start-up lines, "
                        "the conv path --local's device times and takes for each layer")
    add_config_flags(p)
    return add_version(p)


def _spawn_list(args):
    """--spawn's devices, one string per worker: 'cpu', 'cpu:THREADS' or 'cuda:N'."""
    entries = parse_device_list("--spawn", "cpu,cpu" if args.spawn is None else args.spawn)
    return [e.label for e in entries for _ in range(e.count)]


def _check_args(args, cfg):
    """Every value that can be checked before any work starts (workers, calibration, training)."""
    for flag, value in (("--worker-timeout", args.worker_timeout), ("--connect-timeout", args.connect_timeout),
                        ("--op-timeout", args.op_timeout)):
        check_range(flag, value, 0, inclusive=False)
    check_range("--stop-grace", args.stop_grace, 0)
    if args.workers is not None:
        check_range("--workers", args.workers, 1)
    if args.launcher == "ray":
        if args.local or args.workers:
            raise ValueError(f"--launcher ray places --spawn workers: it cannot go with "
                             f"{'--local' if args.local else '--workers'}")
        import_ray()                                   # a missing extra is named before any work starts
        if args.ray_address:
            check_address(args.ray_address, args.connect_timeout)
    elif args.ray_address:
        raise ValueError(f"--ray-address {args.ray_address!r} is for --launcher ray (add --launcher ray)")
    if args.bind:
        check_endpoint("--bind", args.bind, bind=True)
    if args.local and (args.curve or args.insecure):
        raise ValueError("--curve and --insecure are for workers over the network; --local has none")
    if args.curve and args.insecure:
        raise ValueError("--curve and --insecure contradict each other: give one")
    if args.curve:
        coordinator_keys(args.curve)                 # every key file read and checked before any work
        if args.workers is None and not args.local:
            first_worker_dir(args.curve)             # --spawn's workers need a keypair from DIR
    if not args.local:
        # spawned workers (here or by Ray) get this run's own keys unless --insecure
        keyed = args.curve or (args.workers is None and not args.insecure)
        refuse_open_bind(args.bind or "tcp://127.0.0.1:5555", keyed, args.insecure)
    check_output_dir("--checkpoint-dir", cfg.checkpoint_dir)
    check_output_file("--metrics", cfg.metrics)
    if args.resume and not os.path.exists(args.resume):
        raise ValueError(f"--resume {args.resume!r}: no such checkpoint file or directory")
    # combinations that would otherwise be ignored without a word
    if args.local and args.bind:
        raise ValueError(f"--bind {args.bind!r} is where workers connect; --local has none")
    if args.no_pin and (args.local or args.workers or args.launcher == "ray"):
        raise ValueError(f"--no-pin is for the CPU workers --spawn starts on this host; "
                         f"{'--local' if args.local else '--workers' if args.workers else '--launcher ray'} "
                         f"pins nothing")
    if cfg.checkpoint_every and not cfg.checkpoint_dir and not args.resume:
        raise ValueError(f"--checkpoint-every {cfg.checkpoint_every} needs --checkpoint-dir DIR: where the "
                         f"checkpoints go")
    spawn = [] if args.local or args.workers else _spawn_list(args)
    if cfg.min_workers > 1:
        if args.local:
            raise ValueError(f"--min-workers {cfg.min_workers} is for runs with workers; --local runs on one device")
        have, given = (args.workers, f"--workers {args.workers}") if args.workers else \
            (len(spawn), f"--spawn {args.spawn or 'cpu,cpu'}")
        if cfg.min_workers > have:
            raise ValueError(f"--min-workers {cfg.min_workers} is more than the {have} worker(s) this run starts "
                             f"with ({given}): it would stop at the first lost worker")
    if args.launcher == "local" and any(d.startswith("cuda") for d in spawn):
        missing = cuda_extra_missing("--spawn " + ",".join(d for d in spawn if d.startswith("cuda")))
        if missing:                                  # spawned workers run this host's Python
            raise ValueError(missing)


def _check_data_flags(cfg):
    """The built-in set's sizes mean nothing to a data set read from files: refused, not ignored."""
    if cfg.data == "synthetic":
        return
    for flag, name in (("--synthetic-train", "synthetic_train"), ("--synthetic-test", "synthetic_test")):
        if getattr(cfg, name) != getattr(Config, name):
            raise ValueError(f"{flag} {getattr(cfg, name)} sizes the built-in data set; --data {cfg.data!r} "
                             f"is read whole (drop {flag}, or use --data synthetic)")


def _spawn_threads_note(spawn):
    """A line when a local cpu:THREADS worker asks for more threads than this host's usable cores:
    the CPU device runs that many at most. A note, as for --threads: the run is the same."""
    cores = usable_cores()
    over = sorted({d for d in spawn if d.startswith("cpu:") and int(d.split(":")[1]) > cores})
    if over:
        return (f"note: --spawn {','.join(over)} asks for more threads than the {cores} core(s) this process may "
                f"use: each such worker runs {cores} thread(s)")
    return ""


def _pinning_note(spawn, threads, pin):
    """A line when spawned CPU workers cannot each have their own cores (so they are not pinned):
    their threads, counted as RemoteEngine._spawn gives them (`cpu`: --threads, or an equal part
    of the cores; `cpu:N`: N), are more than the cores."""
    cores = usable_cores()
    plain = spawn.count("cpu")
    per_plain = threads or max(1, cores // max(1, plain))
    wanted = plain * per_plain + sum(int(d.split(":")[1]) for d in spawn if d.startswith("cpu:"))
    if not pin or wanted <= cores:
        return ""
    if plain and threads and plain == len(spawn):
        asked = f"{plain} CPU worker(s) x --threads {threads}"
    else:
        asked = f"--spawn {','.join(spawn)} asks for {wanted} CPU threads in all, which"
    return (f"note: {asked} is more than the {cores} core(s) this process may use: the workers are not pinned "
            f"to cores and will share them (a step is then slower than with fewer threads)")


# flags that split work among workers: with --local (one device) they change nothing
WORKER_ONLY_FIELDS = ("parallel", "split", "exchange", "link", "use_all", "rebalance_after")


def _local_notes(cfg):
    """Lines for flags that --local reads otherwise than a run with workers: the wire dtype
    (no wire, yet maps and gradients are rounded to it, as the distributed run it is the reference
    of), and flags that split work among workers (nothing to split on one device)."""
    notes = []
    if cfg.wire_dtype not in ("float32", "auto"):         # auto's choice is said with the plan
        notes.append(f"note: --local has no wire; --wire-dtype {cfg.wire_dtype} rounds its feature maps and gradients "
                     f"between layers to {cfg.wire_dtype} as a distributed run's wire would (this run is that run's "
                     f"reference); leave it out for full float32")
    ignored = [f"--{name.replace('_', '-')}" + ("" if value is True else f" {value}")
               for name in WORKER_ONLY_FIELDS
               for value in [getattr(cfg, name)] if value != getattr(Config, name)]
    if ignored:
        notes.append(f"note: {', '.join(ignored)} split the work among workers; --local runs every layer whole on one "
                     f"device, so {'it changes' if len(ignored) == 1 else 'they change'} nothing here")
    return notes


# A run whose training loss stays within this fraction of log(classes), the loss of a uniform
# guess, for a whole epoch of at least CHANCE_MIN_STEPS steps has not started learning: vgg-small
# (no normalisation) at the default --lr stays at 2.3026 for 10 classes, as PyTorch's same
# network and recipe does, while a network that learns slowly is off by more within an epoch
# (the paper family on 64 images: 2.2975 after 4 steps, which is too few to tell).
CHANCE_LOSS_TOLERANCE = 0.001
CHANCE_MIN_STEPS = 8


def _chance_hint(losses, steps_per_epoch, classes, lr):
    """One line when the last epoch's mean training loss is log(classes) within
    CHANCE_LOSS_TOLERANCE (the network guesses uniformly), saying what usually moves it; else ''.
    Cheap: the run's losses are kept anyway."""
    if classes < 2 or steps_per_epoch < CHANCE_MIN_STEPS or len(losses) < steps_per_epoch:
        return ""
    chance = math.log(classes)
    mean = sum(losses[-steps_per_epoch:]) / steps_per_epoch
    if abs(mean - chance) > CHANCE_LOSS_TOLERANCE * chance:
        return ""
    normalised = [name for name in PRESETS if name.endswith("-bn")]
    return (f"hint: the training loss stayed at {mean:.4f} for the last epoch, log({classes}) = {chance:.4f}: the "
            f"network still guesses uniformly among its {classes} classes, as a deep one without normalisation "
            f"often starts. Try another --lr (this run's: {lr:g}) or more epochs"
            + (f", or a network with normalisation (--net {', '.join(normalised)})" if normalised else ""))


def _on_sigterm(signum, frame):
    # Outside the training loop (starting workers, calibrating, after the last checkpoint) nothing
    # trained is unsaved: SIGTERM ends the run like an exception, so the finally in main still ends
    # every worker. Inside the loop, train() handles it like Ctrl-C: finish the step, checkpoint.
    say_in_handler("hetconv-coordinator: terminated (SIGTERM) outside the training steps: stopping the workers\n")
    raise SystemExit(143)


def given_config_fields(argv):
    """The Config fields whose flags `argv` gives, whatever their values (a flag given with its
    default value is given): argparse sets a default only on an attribute the namespace lacks,
    so one parsed into a namespace holding a marker for each field keeps the marker where the
    flag was not given."""
    unset = object()
    names = [f.name for f in dataclasses.fields(Config)]
    args = build_parser().parse_args(argv, namespace=argparse.Namespace(**{name: unset for name in names}))
    return {name for name in names if getattr(args, name) is not unset}


def _resume(path, given, cfg):
    """The checkpoint --resume names, read and checked, the config the run goes on with: its own,
    with each flag in `given` taken from the command line where it may change, and a line per
    change (printed by prepare once the data set says what they do to the schedule)."""
    resumed = load_newest_valid(path)
    cfg, changes = resumed_config(resumed.meta, cfg, given)
    return resumed, cfg, changes


def _check_given(args, cfg, given):
    """Flags given (`given`, as given_config_fields) that this run would ignore, each refused in
    one line naming it: the recipe's (Config.check_given), and those of the devices and outputs.
    Returns notes for flags that count only in part, or that scripts give to every kind of run."""
    notes = cfg.check_given(given)
    if "keep_checkpoints" in given and not cfg.checkpoint_dir and not args.resume:
        raise ValueError(f"--keep-checkpoints {cfg.keep_checkpoints} needs --checkpoint-dir DIR: without it no "
                         f"checkpoint is written")
    if "rebalance_after" in given and cfg.rebalance_after and cfg.split == "equal" and not args.local:
        raise ValueError(f"--rebalance-after {cfg.rebalance_after} re-splits the work by measured speed; --split "
                         f"equal keeps it equal (drop one of them, or give --rebalance-after 0)")
    if args.workers and "threads" in given:        # a note: benches give --threads 1 to every row
        notes.append(f"note: --threads {cfg.threads} is for the devices this run starts (--local, --spawn); the "
                     f"--workers {args.workers} external ones take their own (hetconv-worker --threads), so it "
                     f"changes nothing here")
    return notes


def _deterministic_threads(cfg):
    """Under --deterministic, the CPU threads the run's sums split by, in its config (saved with
    it): --threads; else the count a --plan FILE's run gave its CPU devices (its plan record's
    threads.device); else runtimes.DETERMINISTIC_THREADS, said in a note. Never a share of the
    cores this process may use, which the host's affinity mask or cgroup decides. An environment
    that would split the sums otherwise (runtimes.deterministic_problem) is refused. -> (cfg, a
    note or '')."""
    if not cfg.deterministic:
        return cfg, ""
    problem = runtimes.deterministic_problem()
    if problem:
        raise ValueError(problem)
    recorded = 0
    if cfg.plan:
        threads = last_plan_record(cfg.plan).get("threads")
        device = threads.get("device") if isinstance(threads, dict) else None
        recorded = device if isinstance(device, int) and not isinstance(device, bool) and device > 0 else 0
    if cfg.threads:
        if recorded and recorded != cfg.threads:
            raise ValueError(f"--threads {cfg.threads}: --plan {cfg.plan} ran its CPU devices on {recorded} thread(s), "
                             f"and another count changes the sums under --deterministic (give --threads {recorded}, "
                             f"or leave it out)")
        return cfg, ""
    if recorded:
        return dataclasses.replace(cfg, threads=recorded), ""
    fixed = runtimes.DETERMINISTIC_THREADS
    return dataclasses.replace(cfg, threads=fixed), (
        f"note: --deterministic runs {fixed} thread(s) per CPU device and for the head where --threads is not given "
        f"(a count from the cores this process may use would change the sums with the host); --threads N for more")


def _check_network_flags(cfg, network, given):
    """Flags given that the run's network (a LoadedNet) would ignore, refused naming the flag."""
    if "bn_ghost_batch" in given and not any(layer.type == "batchnorm" for layer in network.spec.layers):
        which = f"--net {cfg.net}" if cfg.net else f"the paper family (--conv {cfg.conv} --fc {cfg.fc})"
        raise ValueError(f"--bn-ghost-batch {cfg.bn_ghost_batch} groups the images of BatchNorm's statistics; "
                         f"{which} has no BatchNorm layer (drop it, or use a network with one, such as "
                         f"--net vgg-small-bn)")


def _load_data(cfg, resumed, given):
    """The run's data set; where it is the checkpoint's (no --data given), a failure says so."""
    try:
        return load_dataset(cfg.data, **cfg.dataset_options())
    except DataError as e:
        if resumed is None or "data" in given:
            raise
        raise DataError(f"the data set {resumed.meta['path']} was trained on: {e} (give --data to resume on "
                        f"another copy of it)") from None


@dataclasses.dataclass
class Prepared:
    """What a run needs before its first worker starts, every value checked: the config, the
    checkpoint it resumes (or None), the workers to spawn, the data set and the network."""
    cfg: Config
    resumed: object
    spawn: list
    dataset: object
    network: object


# a bad flag value, found before any work starts (exit 2)
CHECK_ERRORS = (ValueError, DeviceError, DataError, ConnectionError, CheckpointError, PlanError)
# a run that started and failed (exit 1)
RUN_ERRORS = (WorkerError, WorkerLost, PlanError, DeviceError, DataError, CheckpointError, ValueError,
              FloatingPointError, ConnectionError)


def prepare(args, argv):
    """Every check that can be made before any work starts (workers, calibration, training), on the
    flags `args` parsed from `argv`; the data set and the network are read here too, so a wrong
    --data or --net costs nothing. Raises one of CHECK_ERRORS naming the flag."""
    cfg = config_from_args(args)
    _check_args(args, cfg)
    given = given_config_fields(argv)
    resumed, changes = None, []
    if args.resume:              # the run the checkpoint holds goes on: its data, recipe and step target
        resumed, cfg, changes = _resume(args.resume, given, cfg)
        for name, reason in resumed.skipped:        # said before any worker starts: the run is not the newest
            print(f"resuming {resumed.meta['path']}: skipped the newer {name}: {reason}")
    notes = _check_given(args, cfg, given)
    cfg, note = _deterministic_threads(cfg)
    notes += [note] if note else []
    spawn = [] if args.local or args.workers else _spawn_list(args)
    ds = _load_data(cfg, resumed, given)
    _check_data_flags(cfg)
    Recipe(cfg, run_length(cfg, ds)[1])        # the schedule over the run's steps: --warmup-steps, --milestones
    if resumed is not None:      # each change, with what it does to the learning rate
        for line in resume_lines(resumed.meta, cfg, changes, ds):
            print(f"resuming {resumed.meta['path']}: {line}")
    network = network_for(cfg, ds, resumed)
    _check_network_flags(cfg, network, given)
    forced_modes(cfg.parallel, len(network.spec.conv_layers()))     # a chain of M/D letters fits the network
    if cfg.plan:
        _check_plan_file(cfg, args, network, spawn)
    for note in notes:
        print(note, file=sys.stderr)
    return Prepared(cfg, resumed, spawn, ds, network)


def _check_plan_file(cfg, args, network, spawn):
    """--plan FILE against this run before any worker starts or is calibrated: the network's conv
    layers and kernels, the batch its data layers split, and the workers, by name where this run
    knows them before they start (--local, --spawn), else by count (--workers N; their names are
    checked when they have connected). PlanError naming the file and what differs."""
    record = last_plan_record(cfg.plan)
    source = f"--plan {cfg.plan}"
    names = ["local"] if args.local else spawned_worker_names(spawn) if spawn else None
    if names is None:
        names = recorded_worker_names(record)
        if len(names) != args.workers:
            raise PlanError(f"{source}: a plan for {len(names)} workers ({', '.join(names)}); this run waits for "
                            f"--workers {args.workers}")
    kernels = [ConvSpec.from_layer(layer).kernels for layer in network.spec.conv_layers()]
    given_plan(record, kernels, cfg.batch_size, names, source)


def _resumed_conv_paths(resumed):
    """The conv path records of the checkpoint a run resumes from (`resumed`: checkpoint.Loaded,
    or None for a new run: none), which its devices run again where their machine key is the
    record's. What is malformed there is left out, said in one line: those call shapes are taken
    from the wisdom or timed, as in a new run."""
    if resumed is None:
        return []
    records, problem = recorded_conv_paths(resumed.meta)
    if problem:
        print(f"resuming {resumed.meta['path']}: its conv path records: {problem} (left out: those call shapes "
              f"take the wisdom's path or are timed)", file=sys.stderr)
    return records


def run(args, prepared):
    """Start the engine (and its workers), train, and return train()'s summary. Whatever way it
    ends (done, a stop, an exception, KeyboardInterrupt), every worker it started has ended and
    the SIGTERM handler it set is taken back. Raises one of RUN_ERRORS when the run fails."""
    cfg, spawn, ds, network = prepared.cfg, prepared.spawn, prepared.dataset, prepared.network
    notes = ([threads_note(cfg.threads), *_local_notes(cfg)] if args.local else
             [_pinning_note(spawn, cfg.threads, not args.no_pin), _spawn_threads_note(spawn)]
             if args.launcher == "local" else [])
    for note in filter(None, notes):
        print(note, file=sys.stderr)
    # signals reach only the main thread; a run started from another (a caller's own) has none
    handles_signals = threading.current_thread() is threading.main_thread()
    previous_sigterm = signal.signal(signal.SIGTERM, _on_sigterm) if handles_signals else None
    engine = launcher = progress = None
    try:
        if args.local:
            progress = show_progress()                 # the device's conv path timing, on the first steps
            device = open_device("cpu", verbose=args.verbose, **CpuOptions.of(cfg).device_options(cfg.threads))
            device.preload_conv_paths(_resumed_conv_paths(prepared.resumed))
            print(f"local: {device.describe()}")
            engine = LocalEngine({"local": ConvShard(device)}, wire=cfg.wire_dtype)
        else:
            if args.launcher == "ray":
                launcher = RayLauncher(args.ray_address or None, num_cpus=usable_cores(),
                                       start_timeout=args.connect_timeout)
                if handles_signals:
                    signal.signal(signal.SIGTERM, _on_sigterm)    # ray.init put its own in place
            bind = args.bind or (launcher.bind_address() if launcher else
                                 "tcp://127.0.0.1:0" if spawn else "tcp://127.0.0.1:5555")
            limit = message_limit_bytes([ConvSpec.from_layer(layer) for layer in network.spec.conv_layers()],
                                        cfg.batch_size, network.spec.input_shape)
            try:
                engine = RemoteEngine(bind, args.workers or 0, spawn, threads=cfg.threads,
                                      worker_timeout=args.worker_timeout, connect_timeout=args.connect_timeout,
                                      op_timeout=args.op_timeout, pin=not args.no_pin,
                                      exchange=cfg.exchange, wire=cfg.wire_dtype, curve=args.curve,
                                      insecure=args.insecure, message_limit=limit, launcher=launcher,
                                      verbose=args.verbose, cpu=CpuOptions.of(cfg),
                                      conv_paths=_resumed_conv_paths(prepared.resumed))
            except SystemExit as e:
                # RemoteEngine ends the command on an address it cannot bind; from Python that is
                # the ConnectionError it is (the command prints the same line)
                if not isinstance(e.code, str):
                    raise
                raise ConnectionError(e.code.removeprefix("hetconv-coordinator: ")) from None
        summary = train(cfg, engine, resume=prepared.resumed, dataset=ds, stop_grace=args.stop_grace,
                        network=network)
        hint = _chance_hint(summary.get("losses", []), len(ds.train_y) // cfg.batch_size, len(ds.classes),
                            cfg.lr)
        if hint:
            print(hint)
        return summary
    finally:
        if progress is not None:                       # run may be called again in this process
            logging.getLogger("hetconv.devices").removeHandler(progress)
        if engine is not None:
            engine.close()
        if launcher is not None:
            launcher.close()                           # every actor ends, and Ray if it was started here
        if handles_signals and previous_sigterm is not None:      # None: a handler not set from Python
            signal.signal(signal.SIGTERM, previous_sigterm)


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        prepared = prepare(args, argv)
    except CHECK_ERRORS as e:
        print(f"hetconv-coordinator: {e}", file=sys.stderr)
        if args.verbose and e.__cause__ is not None:       # the user's own code failed: --net FILE.py's traceback
            print("--- traceback ---\n" + "".join(traceback.format_exception(e.__cause__)).rstrip(), file=sys.stderr)
        return 2
    try:
        summary = run(args, prepared)
    except RUN_ERRORS as e:
        print(f"hetconv-coordinator: {e}", file=sys.stderr)
        if args.verbose and isinstance(e, WorkerError) and e.remote_traceback:
            print(f"--- worker traceback ---\n{e.remote_traceback}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("hetconv-coordinator: interrupted", file=sys.stderr)
        return 130
    return summary.get("exit_code", 130) if summary.get("interrupted") else 0


if __name__ == "__main__":
    sys.exit(main())
