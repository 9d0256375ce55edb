"""The training loop, the same for `--local` and for a distributed run: only the engine differs."""
import dataclasses
import math
import os
import signal
import threading
import time

import numpy as np
from tqdm.auto import tqdm

from hetconv import runtimes
from hetconv.data import load_dataset, test_batches
from hetconv.data.loader import open_loader
from hetconv.data.photos import bad_list
from hetconv.devices.cpu import HostArrays
from hetconv.engine.contract import WorkerLost, moved_bytes, plan_report, wire_record
from hetconv.engine.conv_precision import PrecisionReport, precision_line
from hetconv.engine.graph import graph_pass
from hetconv.engine.policy import DETERMINISTIC_FLAGS, MAX_REBALANCES, PlanSettings, rebalances, recorded_run_plan
from hetconv.flags import say_in_handler
from hetconv.geometry import ConvSpec
from hetconv.net import LoadedNet, NetSpec
from hetconv.net.head import Network, init_conv_params
from hetconv.training import checkpoint
from hetconv.training.config import NETWORK_FIELDS, Config
from hetconv.training.elastic import Elastic
from hetconv.training.membership import Finished, Stopped, WorkersJoined, WorkersLost
from hetconv.training.metrics import MetricsWriter, last_plan_record
from hetconv.training.recipe import Recipe
from hetconv.update import ADAM_FAMILY


class StopNow(BaseException):
    """A stop that cannot wait for the step: the grace period after SIGTERM ran out, or a second
    signal came, while workers were still busy. A BaseException, as KeyboardInterrupt is: it can
    arrive anywhere (a signal handler raises it), and no `except Exception` that guards a read or
    a save may take it for that operation's failure and carry on."""


class _StopRequests:
    """SIGINT (Ctrl-C) and SIGTERM (Slurm, Kubernetes, `kill`) both ask the run to stop: finish the
    running step, write a checkpoint, exit (130 or 143). Where workers do the steps (`bounded`), a
    step can hang on the network, so a stop that has not completed `grace` seconds after the first
    signal, or a second signal, raises StopNow: the loop then saves its newest in-memory snapshot
    instead, which needs no worker. In one process a second Ctrl-C stops at once.

    The handlers set what the loop reads and write their one line past Python's stderr buffer
    (flags.say_in_handler). SIGALRM and the real-time timer are the caller's until a stop arms the
    grace: only then is the handler replaced and the timer set, and both are given back after, the
    caller's own alarm (pytest-timeout's, a notebook's) with what was left of it."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, saving, grace, bounded):
        self.saving, self.grace, self.bounded = saving, grace, bounded
        self.signum = None
        self._previous = {}
        self._alarm = None              # (the caller's SIGALRM handler, its timer, when armed) while ours runs

    @property
    def requested(self):
        return self.signum is not None

    @property
    def exit_code(self):
        return 128 + self.signum if self.signum else 0

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():   # signals only work there
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame):
        if signum == signal.SIGALRM:
            raise StopNow(f"the stop did not complete within --stop-grace {self.grace:g}s")
        if self.requested:
            if self.bounded:
                raise StopNow(f"{signal.Signals(signum).name} again")
            raise KeyboardInterrupt
        self.signum = signum
        then = "saving a checkpoint and stopping" if self.saving else "stopping (no --checkpoint-dir: nothing is saved)"
        bound = (f"; if that takes over {self.grace:g}s, the last snapshot is saved instead" if self.bounded
                 and self.grace > 0 else "")
        say_in_handler(f"\n{signal.Signals(signum).name}: finishing this step, then {then}{bound} "
                       f"(the same signal again to stop now)\n")
        if self.bounded and self.grace > 0 and self._previous:
            self._arm_grace()

    def _arm_grace(self):
        handler = signal.signal(signal.SIGALRM, self._handle)
        self._alarm = (handler, signal.setitimer(signal.ITIMER_REAL, self.grace), time.monotonic())

    def disarm(self):
        """The stop completed: the grace timer must not fire into what follows. The caller's
        SIGALRM handler and timer (less the time since) are theirs again."""
        if self._alarm is None:
            return
        handler, (delay, interval), armed = self._alarm
        self._alarm = None
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, handler)
        if delay > 0:                   # 0: the caller had none running
            signal.setitimer(signal.ITIMER_REAL, max(delay - (time.monotonic() - armed), 1e-3), interval)

    def __exit__(self, *exc):
        self.disarm()
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


# What a resumed run takes from its checkpoint's config unless given again on the command line:
# the run itself (its data, network, recipe, step target, evaluation and checkpointing). The rest
# (devices, threads, the split, links, where metrics go) belongs to the machines of this start.
RESUMED_FIELDS = ("data", "synthetic_train", "synthetic_test", "val_split", "crop", "image_size", "bad_images", "net", "conv", "ksize", "padding", "fc",
                  "epochs", "steps", "batch_size", "lr", "optimizer", "momentum", "nesterov", "betas", "eps",
                  "weight_decay", "no_decay", "schedule", "warmup_steps", "milestones", "gamma", "min_lr",
                  "label_smoothing", "clip_grad_norm", "bn_ghost_batch", "seed", "augment",
                  "micro_batches", "wire_dtype", "eval_batches", "eval_every", "checkpoint_every",
                  "keep_checkpoints", "deterministic")
_SYNTHETIC_SIZES = ("synthetic_train", "synthetic_test")


def _flag(name):
    return "--" + name.replace("_", "-")


def resumed_config(meta, cfg, given):
    """The config a run resumed from the checkpoint `meta` goes on with: the checkpoint's own for
    every RESUMED_FIELDS field, except where its flag is in `given` (the Config fields the command
    line gave, whatever their values). Returns (config, one line per value changed). A change to
    the network (NETWORK_FIELDS: its layers, --crop) raises CheckpointError naming the flag; the
    data set may change where its images and classes stay those of the checkpoint's network
    (network_for checks that once it is loaded)."""
    try:
        saved = Config.from_json(meta["config"])
    except (KeyError, TypeError, ValueError) as e:
        raise checkpoint.CheckpointError(f"{meta.get('path')}: its config cannot be read: {e}") from None
    values, changes = {}, []
    for name in RESUMED_FIELDS:
        then, now = getattr(saved, name), getattr(cfg, name)
        if name not in given:
            values[name] = then
        elif now != then:
            if name in NETWORK_FIELDS:
                was = (f"{_flag(name)} {then!r}" if name != "net" or then else
                       f"the paper family (--conv {saved.conv} --fc {saved.fc}), not --net")
                raise checkpoint.CheckpointError(f"cannot resume: the checkpoint was trained with {was}, this run "
                                                 f"asks for {now!r} (the network cannot change; drop {_flag(name)})")
            changes.append(f"{_flag(name)} {then if then != '' else repr(then)} -> {now if now != '' else repr(now)} "
                           f"(given on the command line)")
    if values.get("data", cfg.data) != "synthetic":
        for name in _SYNTHETIC_SIZES:           # sizes of the built-in set mean nothing to files
            if name not in given:
                values[name] = getattr(Config, name)
    return dataclasses.replace(cfg, **values).validate(), changes


# the fields that set how many steps a run has (with its data set's size), and those that shape
# its learning rate over them
LENGTH_FIELDS = ("data", "synthetic_train", "epochs", "steps", "batch_size")
RATE_FIELDS = ("lr", "optimizer", "momentum", "betas", "schedule", "warmup_steps", "milestones", "gamma", "min_lr")


def run_length(cfg, ds):
    """(steps per epoch, steps in all) of a run of `cfg` on the data set `ds`, as train() counts
    them: --steps where given, else --epochs whole epochs."""
    per_epoch = len(ds.train_y) // cfg.batch_size
    if per_epoch < 1:
        raise ValueError(f"--batch-size {cfg.batch_size} is larger than the {len(ds.train_y)} training images of "
                         f"{ds.name}")
    return per_epoch, cfg.steps or cfg.epochs * per_epoch


def _two_numbers(a, b):
    """a and b as text, with the fewest significant digits (3 at least) that tell them apart."""
    for digits in (3, 6, 9):
        x, y = f"{a:.{digits}g}", f"{b:.{digits}g}"
        if x != y:
            break
    return x, y


def _resumed_rate_notes(meta, cfg, ds):
    """(what the run's length, what the learning rate) of a run resumed with `cfg` from the
    checkpoint `meta`, on data set `ds`, changes from the checkpoint's run, in words; '' for each
    that does not change. The schedule is a function of the run's steps, so it is laid over the
    resumed run's length: where it now ends, and the learning rate (and one-cycle's momentum) of
    the step the run resumes at, before and after."""
    step = int(meta["step"])
    try:
        saved = Config.from_json(meta["config"])
        then_total = run_length(saved, ds)[1]
        then = Recipe(saved, then_total).rule(min(step, then_total - 1))
    except (KeyError, TypeError, ValueError):           # the checkpoint's run cannot be laid over this data
        saved = then = None
    now_total = run_length(cfg, ds)[1]
    length = ""
    if then is not None and now_total != then_total:
        if cfg.schedule != "constant":
            length = (f"the {cfg.schedule} schedule, laid over the run's new length, now ends at step {now_total} "
                      f"(was {then_total})")
        elif not cfg.steps:                             # --steps says so itself
            length = f"the run now ends at step {now_total} (was {then_total})"
    if step >= now_total:
        return ((length + "; " if length else "") + f"the run's {now_total} steps end at or before step {step}, "
                f"where the checkpoint is: no step is trained, the checkpoint is only evaluated"), ""
    now = Recipe(cfg, now_total).rule(step)
    if then is None:
        return length, ""
    # each rate at its flag's value (constant, or past the warm-up) is said by that flag's line
    lr_moved = then.lr != now.lr and not (then.lr == saved.lr and now.lr == cfg.lr)
    momentum_moved = then.momentum != now.momentum and "onecycle" in (saved.schedule, cfg.schedule)
    if not (lr_moved or momentum_moved):
        return length, ""
    rate = []
    if then.lr != now.lr:
        a, b = _two_numbers(then.lr, now.lr)
        ended = " (its last step's, where the checkpoint's run ended)" if step >= then_total else ""
        rate.append(f"the learning rate goes from {a}{ended} to {b}")
    if momentum_moved:
        a, b = _two_numbers(then.momentum, now.momentum)
        rate.append(f"{'beta1' if cfg.optimizer in ADAM_FAMILY else 'the momentum'} from {a} to {b}")
    return length, f"where it resumes (step {step}), " + " and ".join(rate)


def resume_lines(meta, cfg, changes, ds):
    """resumed_config's `changes` lines with what they do to the learning rate (_resumed_rate_notes):
    after the first line of a flag that sets the run's length where that changed, else after the
    first of a flag that shapes the rate; a line of its own where no such line is there."""
    length, rate = _resumed_rate_notes(meta, cfg, ds)
    note = "; ".join(filter(None, (length, rate)))
    lines = list(changes)
    if not note:
        return lines
    for names in ((LENGTH_FIELDS,) if length else ()) + (RATE_FIELDS, LENGTH_FIELDS):
        for i, line in enumerate(lines):
            if any(line.startswith(_flag(name) + " ") for name in names):
                lines[i] = f"{line}: {note}"
                return lines
    return lines + [note]


def _compatible(meta, cfg, network):
    """Raise CheckpointError unless the checkpoint holds this run's network (`network`, a NetSpec)."""
    if "network" in meta:
        then = meta.get("config", {}).get("crop", 0)
        if then != cfg.crop:
            raise checkpoint.CheckpointError(f"cannot resume: the checkpoint was trained with --crop {then}, this run "
                                             f"asks for {cfg.crop}")
        saved = NetSpec.from_json(meta["network"])
        if saved != network:
            there = [layer.text() for layer in saved.layers] + ["(none)"]
            here = [layer.text() for layer in network.layers] + ["(none)"]
            i = next((i for i, (a, b) in enumerate(zip(there, here)) if a != b), min(len(there), len(here)) - 1)
            what = (f"layer {i} is {there[i]} there, {here[i]} here" if there[i] != here[i] else
                    f"its input is {saved.input_shape} with {saved.classes} classes, here {network.input_shape} "
                    f"with {network.classes}")
            raise checkpoint.CheckpointError(f"cannot resume: the checkpoint was trained with another network: {what} "
                                             f"(resume with no network flags to take the checkpoint's)")
        return
    try:
        cfg.check_same_network(Config.from_json(meta["config"]))
    except (TypeError, ValueError) as e:
        raise checkpoint.CheckpointError(f"cannot resume: {e}") from None


def _run_state(spec, state, optimizer, log):
    """A checkpoint's layer state for this run: another optimizer's slots are left behind (this
    run's start at zero), with a line saying so."""
    layout = {a.name for a in spec.state_layout(optimizer)}
    dropped = sorted(set(state) - layout)
    if dropped:
        log(f"the checkpoint's optimizer state {', '.join(dropped[:4])}{' ...' if len(dropped) > 4 else ''} is not "
            f"--optimizer {optimizer}'s: it starts afresh")
    return {name: a for name, a in state.items() if name in layout}


def data_meta(ds):
    """What a checkpoint keeps of its data set so the model can be used without it: the name, the
    class names, the image shape and the normalisation (per-channel mean and std of [0, 1] pixels)."""
    return ds.meta()


def load_resume(resume):
    """`resume` (a checkpoint file or directory, or what checkpoint.load_newest_valid returned for
    one) as checkpoint.Loaded; None stays None."""
    if resume is None or isinstance(resume, checkpoint.Loaded):
        return resume
    return checkpoint.load_newest_valid(resume)


def _shape_text(shape):
    return "x".join(map(str, shape))


def network_for(cfg, ds, resume=None):
    """The run's network (a hetconv.net LoadedNet) for data set `ds`: from the network flags, or,
    when resuming (`resume`: checkpoint.Loaded) with the checkpoint's own network flags, the
    network the checkpoint holds, which `ds` must fit (its images and classes): raises
    CheckpointError naming --data where it does not."""
    input_shape = cfg.input_shape(ds.image_shape)
    meta = resume.meta if resume is not None else None
    if meta is not None and "network" in meta:
        saved_cfg = Config.from_json(meta["config"])
        if all(getattr(saved_cfg, k) == getattr(cfg, k) for k in NETWORK_FIELDS):
            saved = checkpoint.network_of(meta)
            classes = (meta.get("data") or {}).get("classes")
            if tuple(saved.input_shape) != tuple(input_shape) or saved.classes != len(ds.classes):
                raise checkpoint.CheckpointError(
                    f"cannot resume on --data {cfg.data}: its images are {_shape_text(input_shape)} with "
                    f"{len(ds.classes)} classes, the checkpoint's network takes {_shape_text(saved.input_shape)} "
                    f"with {saved.classes} (the data set's shape and classes cannot change)")
            if isinstance(classes, list) and classes != list(ds.classes):
                raise checkpoint.CheckpointError(
                    f"cannot resume on --data {cfg.data}: its classes are {', '.join(map(str, ds.classes))[:200]}; "
                    f"the checkpoint's run had {', '.join(map(str, classes))[:200]} (the classes cannot change)")
            return LoadedNet(saved)
    return cfg.network(input_shape, len(ds.classes))


def prepared_record(replies):
    """{worker: {calls, ran, seconds}} of the workers' PREPARED fields, each a count or seconds
    where the worker sent a well-formed one, else 0: what the log and the metrics keep of them."""
    def number(v, kind):
        return v if isinstance(v, kind) and not isinstance(v, bool) and v >= 0 and math.isfinite(v) else kind(0)
    return {name: {"calls": number(f.get("calls"), int), "ran": number(f.get("ran"), int),
                   "seconds": number(f.get("seconds"), float)} for name, f in replies.items()}


def center_crop(x, size):
    """(N, C, H, W) -> (N, C, size, size), C-contiguous; size 0 keeps the image whole."""
    if not size or size == x.shape[2]:
        return x
    top, left = (x.shape[2] - size) // 2, (x.shape[3] - size) // 2
    return np.ascontiguousarray(x[:, :, top:top + size, left:left + size])


def cross_entropy_sum(logits, labels):
    """Sum over the rows of softmax cross-entropy, in float64 (a test set's sum of float32 terms
    would round differently with the batch size)."""
    z = logits.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    log_norm = np.log(np.exp(z).sum(axis=1))
    return float((log_norm - z[np.arange(len(labels)), labels]).sum())


@dataclasses.dataclass
class Evaluation:
    accuracy: float
    loss: float                 # mean softmax cross-entropy over the test images
    images: int


def evaluate(net, ds, batch_size, max_batches=0, crop=0, stop=None, progress=None, loader=None):
    """-> an Evaluation on the test set (its first `max_batches` batches, 0: all of it), or None
    when `stop` (a _StopRequests) asks to stop first. `progress(images)` is called after each batch.
    `loader`: the run's (data.loader), whose processes decode a photo folder's test batches."""
    correct = seen = 0
    loss = 0.0
    for i, (x, y) in enumerate(test_batches(ds, batch_size) if loader is None else loader.test_batches(batch_size)):
        if max_batches and i >= max_batches:
            break
        if stop is not None and stop.requested:
            return None
        logits = net.predict(center_crop(x, crop))
        correct += int((logits.argmax(axis=1) == y).sum())
        loss += cross_entropy_sum(logits, y)
        seen += len(y)
        if progress is not None:
            progress(len(y))
    return Evaluation(correct / max(seen, 1), loss / max(seen, 1), seen)


def test_images(ds, batch_size, max_batches=0):
    """How many test images an evaluation reads."""
    n = len(ds.test_y)
    return min(n, max_batches * batch_size) if max_batches else n


def checkpoint_dir_for(cfg, resume):
    """Where this run's checkpoints go: --checkpoint-dir, else the directory of the checkpoint it
    resumed from (`resume`: checkpoint.Loaded; a resumed run that wrote nothing would lose every
    step it trained)."""
    if cfg.checkpoint_dir or resume is None:
        return cfg.checkpoint_dir
    return os.path.dirname(resume.meta["path"]) or "."


def train(cfg, engine, log=print, resume=None, metrics_extra=None, dataset=None, stop_grace=20.0, network=None):
    """Train per `cfg` with conv layers on `engine`. `engine.plan_for(specs, input_shapes, settings)`
    (`settings`: what planning reads of `cfg`, engine.policy.PlanSettings) returns the kernel
    split; the loop is otherwise transport-agnostic. `dataset`, when given, is cfg.data already
    loaded (the command line loads it before starting workers). `resume`: a
    checkpoint file or directory (the checkpoints it skips are logged), or what
    checkpoint.load_newest_valid returned for one (the caller says what it skipped); `cfg` is
    the whole config (hetconv.cli.coordinator takes the checkpoint's with resumed_config). `stop_grace`:
    seconds a SIGTERM or Ctrl-C gives the running step and checkpoint before the last snapshot is
    saved instead. `network`: a hetconv.net LoadedNet, when the caller made it already (else
    network_for). Returns a summary dict."""
    metrics = MetricsWriter(cfg.metrics, append=bool(resume))
    opened = []                                  # the data loader, once _train opens it
    try:
        return _train(cfg, engine, log, resume, metrics, metrics_extra or {}, dataset, stop_grace, network, opened)
    finally:
        for loader in opened:
            loader.close()
            if getattr(loader, "skipped", None):
                log(f"--bad-images skip: {len(loader.skipped)} photos failed to decode during the run and were "
                    f"replaced in their batches by others of the batch: {bad_list(loader.skipped)}")
        metrics.close()


class _Run:
    """The state of one training run that changes as it goes: the step reached, the plan's
    schedule of rebalances, the per-step records, and the progress bar. Membership changes
    (a worker lost, a worker joined) arrive here through `recover` and `replanned`."""

    def __init__(self, cfg, engine, net, elastic, ds, specs, start_step, total_steps, steps_per_epoch, log, metrics,
                 micro_batches):
        self.cfg, self.engine, self.net, self.elastic, self.ds, self.specs = cfg, engine, net, elastic, ds, specs
        self.log, self.metrics = log, metrics
        self.start_step, self.step, self.total_steps = start_step, start_step, total_steps
        self.steps_per_epoch = steps_per_epoch
        self.losses, self.step_times = [], []
        self.last_ckpt = None
        self.conv_paths_written = None          # the conv path records last written to the metrics
        # --precision auto: what each conv layer ran in, said after calibration and after the first
        # step of each plan, where it changed (conv_precision.PrecisionReport); None for fp32 and bf16
        self.precision, self.precision_due = None, True
        self.precision_counted = True           # the report's call counts are the devices' (nothing ran since)
        self.precision_bytes = 0                # what asking the counts before a step moved
        self.micro_batches = micro_batches      # a step's pieces under the plan (Engine.run_micro_batches)
        self.calls_due = True                   # the plan's call shapes, run before its first step (prepare_calls)
        self.rebalance_at, self.rebalances = 0, 0
        self.bar = None
        self._last_line = time.monotonic()
        self.evaluated = {}                     # step -> Evaluation recorded at that step
        self.augment = cfg.augment_kinds()
        self.recipe = Recipe(cfg, total_steps)  # each step's update: optimizer, schedule, clipping
        self.loader = None                      # the data's (data.loader): set by _train, which closes it

    # ---- the steps ---------------------------------------------------------------------------------
    def advance(self, stop):
        """Train, save and evaluate until the run ends or its workers change; what happened comes
        back as a membership event (train.membership)."""
        try:
            joined = self.train_steps(stop)
            if joined is not None:
                return joined
            self.final_state()
            evaluation = None if stop.requested else (self.evaluated.get(self.step)
                                                      or self.evaluate_now(stop, final=True))
            return Stopped() if evaluation is None else Finished(evaluation)
        except WorkerLost as lost:
            return WorkersLost(lost)

    def train_steps(self, stop):
        """Steps until the last one, or until a stop is asked for, evaluating every --eval-every
        epochs on the way. Returns WorkersJoined when workers were admitted after a step (the
        loop re-plans and calls again), else None."""
        cfg = self.cfg
        while self.step < self.total_steps and not stop.requested:
            # an evaluation a lost worker interrupted, where the snapshot was of its own step:
            # nothing is replayed before it, so it is redone here
            self.evaluate_if_due(stop)
            if stop.requested:
                break
            epoch = self.step // self.steps_per_epoch
            # the epoch's order and augmentation depend only on (seed, epoch, batch), so a resumed or
            # replaying run sees the same batches; the next batch is made while this step runs
            # (a photo folder's loader processes decode ahead the same way)
            batches = self.loader.epoch(epoch, start=self.step % self.steps_per_epoch)
            while True:
                waited = time.perf_counter()
                x, y = next(batches, (None, None))
                waited = time.perf_counter() - waited            # the seconds this step waited for its data
                if x is None:
                    break
                joined = self.one_step(epoch, x, y, waited)
                if joined is not None:
                    return joined
                self.evaluate_if_due(stop)
                if self.step >= self.total_steps or stop.requested:
                    break

    def one_step(self, epoch, x, y, data_wait_s=0.0):
        cfg = self.cfg
        if self.calls_due:
            self.prepare_calls(len(x))
        if self.precision_due:
            self.count_precision()
        t0 = time.perf_counter()
        rule = self.recipe.rule(self.step)
        result = self.net.train_step(center_crop(x, cfg.crop), y, rule, self.micro_batches, step=self.step,
                                     label_smoothing=cfg.label_smoothing)
        dt = time.perf_counter() - t0
        if not math.isfinite(result.loss):
            raise FloatingPointError(f"loss became {result.loss} at step {self.step + 1}: lower --lr (now {cfg.lr})")
        self.step += 1
        step = self.step
        self.losses.append(result.loss)
        self.step_times.append(dt)
        clipped = {"grad_scale": result.grad_scale} if rule.max_norm else {}
        self.metrics.write("step", step=step, epoch=epoch, loss=result.loss, accuracy=result.correct / len(y),
                           lr=rule.lr, **clipped, step_s=dt, data_wait_s=round(data_wait_s, 6), images_per_s=len(y) / dt,
                           workers=self.engine.step_stats())
        self.precision_counted = False
        if self.precision_due:          # the paths this plan's shapes run are chosen by now
            self.report_precision()
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{result.loss:.3f}", img_s=f"{len(y) / dt:.0f}")
        if self.bar.disable and time.monotonic() - self._last_line >= 30:
            # no terminal (a log file, CI): a plain line every 30 s instead of the bar
            self._last_line = time.monotonic()
            self.log(f"step {step}/{self.total_steps}  loss {result.loss:.4f}  {len(y) / dt:.1f} img/s")
        self.maybe_rebalance()
        joined = self.elastic.after_step(step, dt)
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            self.save_checkpoint()
        return joined

    # ---- evaluation: on the test set every --eval-every epochs and at the end. A worker lost
    # during one raises WorkerLost out of it before anything is recorded: after the recovery the
    # run comes back to the same step (by replaying or at once) and evaluates again. A step
    # evaluated once is not evaluated again when a later loss replays through it. ---------------
    def evaluate_if_due(self, stop):
        every = self.cfg.eval_every * self.steps_per_epoch
        step = self.step
        if (not every or step % every or step == self.start_step or step >= self.total_steps
                or step in self.evaluated):
            return
        self.evaluate_now(stop)

    def evaluate_now(self, stop, final=False):
        """Evaluate at this step and record it (the last one is announced by the run's last line).
        Returns the Evaluation, or None when a stop came first."""
        cfg, step = self.cfg, self.step
        total = test_images(self.ds, cfg.batch_size, cfg.eval_batches)
        bar = tqdm(total=total, unit="img", desc=f"test set at step {step}", leave=False, dynamic_ncols=True,
                   disable=None)
        try:
            result = evaluate(self.net, self.ds, cfg.batch_size, cfg.eval_batches, cfg.crop, stop, bar.update,
                              loader=self.loader)
        finally:
            bar.close()
        if result is None:
            return None
        self.evaluated[step] = result
        epochs = step / self.steps_per_epoch
        self.metrics.write("eval", step=step, epoch=round(epochs, 4), test_loss=result.loss,
                           test_accuracy=result.accuracy, test_images=result.images)
        if not final:
            self.log(f"step {step} (epoch {epochs:.4g}): test loss {result.loss:.4f}, "
                     f"test accuracy {result.accuracy:.3f} on {result.images} images")
        return result

    # ---- rebalancing: early on, the split from calibration is checked against real steps and
    # corrected, up to MAX_REBALANCES times while it still gains (never for `equal`, the baseline,
    # nor for a plan set by hand); armed again after every re-plan -------------------------------
    def arm_rebalance(self, first=False):
        cfg = self.cfg
        self.rebalances, self.rebalance_at = 0, 0
        if not rebalances(cfg.split, cfg.rebalance_after, self.engine.fixed_plan is not None, len(self.engine.workers)):
            return
        at = self.step + cfg.rebalance_after
        if at < self.total_steps:
            self.rebalance_at = at
        elif first:
            self.log(f"no rebalancing: {self.total_steps} steps are too few (the first re-split comes after step "
                     f"{at}, see --rebalance-after)")

    def maybe_rebalance(self):
        after = self.cfg.rebalance_after
        if not self.rebalance_at:
            return
        if self.step == self.rebalance_at - (after - 1):
            self.engine.reset_layer_timings()                    # the first step pays for growing buffers
        if self.step != self.rebalance_at:
            return
        self.rebalance_at = 0
        plan = self.engine.propose_rebalance(self.specs)
        if plan is None:
            return
        conv = self.engine.gather()
        self.elastic.keep(self.step, conv)                       # a loss while the kernels move replays nothing
        self.engine.load(plan, self.specs, conv)
        self.rebalances += 1
        self.precision_due = self.calls_due = True               # new shares: new call shapes
        self.log("rebalanced from measured step times:\n" + plan.table())
        self.metrics.write("plan", reason="rebalance", step=self.step, bytes=moved_bytes(self.engine.step_stats()),
                           **plan.to_json(), **wire_record(self.engine))
        if self.rebalances < MAX_REBALANCES:                     # check again: each round corrects the last
            self.rebalance_at = self.step + after

    # ---- membership ------------------------------------------------------------------------------
    def recover(self, lost):
        """WorkersLost: the survivors are re-planned and reloaded from the last snapshot, and the
        steps since it are replayed (their records dropped). Raises WorkerLost below
        --min-workers, after a rescue checkpoint."""
        self.step, _ = self.elastic.recover(lost.error, self.step)
        del self.losses[max(0, self.step - self.start_step):], self.step_times[max(0, self.step - self.start_step):]
        self.bar.n = self.step
        self.bar.refresh()
        self.replanned()

    def replanned(self):
        """Another set of workers (lost or joined): the micro-batch count follows it, and
        rebalancing starts over."""
        self.micro_batches = self.engine.run_micro_batches(self.cfg.micro_batches, self.cfg.batch_size)
        self.precision_due, self.precision_counted = True, False     # a step cut short ran some calls
        self.calls_due = True
        self.arm_rebalance()

    # ---- saving ---------------------------------------------------------------------------------
    def save_checkpoint(self):
        path = self.elastic.checkpoint(self.step)
        # the gather's traffic is the checkpoint's, not the next step's
        self.metrics.write("checkpoint", step=self.step, path=path, bytes=moved_bytes(self.engine.step_stats()))
        self.last_ckpt = path
        self.record_conv_paths()
        return path

    def record_conv_paths(self):
        """A "conv_paths" metrics record: each device's conv path choices made by a measurement
        (engine.conv_path_records: machine key, call, path, why), as the checkpoints keep them;
        written at each checkpoint and at the end, where there are any and they changed since the
        last one."""
        records = self.engine.conv_path_records()
        if any(r["choices"] for r in records) and records != self.conv_paths_written:
            self.metrics.write("conv_paths", step=self.step, devices=records)
            self.conv_paths_written = records

    def prepare_calls(self, batch):
        """Before a plan's first step: each worker runs the step's conv call shapes whose first
        call would time its device's paths (engine.prepare_calls), so no training step pays for
        timing them unannounced. Said in the log where it took a second or more, kept as a
        "prepare" metrics record where anything ran."""
        self.calls_due = False
        t0 = time.perf_counter()
        prepared = prepared_record(self.engine.prepare_calls(self.elastic.input_shapes, batch, self.micro_batches))
        seconds = time.perf_counter() - t0
        ran = sum(p["ran"] for p in prepared.values())
        moved = moved_bytes(self.engine.step_stats())                   # no step's
        self.precision_counted = False                                  # calls ran since the counts
        if ran:
            self.metrics.write("prepare", step=self.step, seconds=seconds, bytes=moved, workers=prepared)
        if seconds >= 1.0:
            self.log(f"ran the plan's {ran} new conv call shape(s) before step {self.step + 1}, {seconds:.1f}s: each "
                     f"device timed its conv paths for them (once per shape; this machine's wisdom keeps the choice)")

    def count_precision(self):
        """Before the step a report follows: each device's calls so far, so that the report says
        what that step ran, not an evaluation's batches or a joiner's calibration (one small FETCH
        a worker, unless nothing ran since the counts were taken)."""
        if self.precision is None or self.precision_counted:
            return
        self.precision.ran(self.engine.conv_path_choices())
        self.precision_bytes += moved_bytes(self.engine.step_stats())    # no step's
        self.precision_counted = True

    def report_precision(self, calibration=None):
        """--precision auto: the conv layers' precision and paths since the calls were counted
        (engine.conv_precision), logged in one line and kept as a "precision" metrics record where
        it changed; from `calibration` ({worker: its calibration record}) where given, else asked
        of the engine now (one small FETCH a worker, whose bytes the record keeps, no step)."""
        self.precision_due = False
        if self.precision is None:
            return
        if calibration is not None:
            devices = {name: c.get("conv_paths", []) for name, c in calibration.items()}
        else:
            devices = self.engine.conv_path_choices()
            self.precision_bytes += moved_bytes(self.engine.step_stats())
        records = self.precision.update(devices)
        if records:
            self.log(precision_line(records, calibration is not None))
            self.metrics.write("precision", step=self.step, calibration=calibration is not None, layers=records,
                               **({} if calibration is not None else {"bytes": self.precision_bytes}))
        self.precision_bytes = 0

    def final_state(self):
        """The checkpoint of the step reached (where --checkpoint-dir is set), and with workers a
        snapshot of it, so a loss during evaluation replays nothing."""
        if self.cfg.checkpoint_dir and self.step not in self.elastic.saved:
            self.save_checkpoint()
        elif self.elastic.enabled:
            self.elastic.gather(self.step)

    def rescue(self, why):
        """Save the newest state that exists without asking a worker (the snapshot), where it is
        newer than every checkpoint this run wrote. Returns the newest checkpoint's path or None."""
        if self.cfg.checkpoint_dir and self.elastic.unsaved_snapshot():
            try:
                self.last_ckpt = self.elastic.save_snapshot()
            except StopNow as e:               # a further signal: stop at once (a save leaves no half file)
                self.log(f"{why}; {e} while the snapshot of step {self.elastic.snapshot.step} was being saved: "
                         f"stopped without it")
                return self.last_ckpt
            except Exception as e:             # a full disk must not hide why the run ended
                self.log(f"{why}; saving the snapshot of step {self.elastic.snapshot.step} failed too: {e}")
                return self.last_ckpt
            self.log(f"{why}: saved the snapshot of step {self.elastic.snapshot.step} to {self.last_ckpt}")
        elif self.elastic.saved:
            self.last_ckpt = self.elastic.saved[max(self.elastic.saved)]
        return self.last_ckpt


def _reproducible(cfg, engine, specs, log, resumed_meta=None):
    """--plan and --deterministic on this run: a recorded plan (--plan's, or the checkpoint's
    where the same workers came back and the caller fixed none: policy.recorded_run_plan) is
    fixed on the engine, with its micro-batch count where --micro-batches is auto;
    --deterministic without one takes policy.DETERMINISTIC_FLAGS (the returned config, saved
    with the run, says so)."""
    resumed = resumed_meta or {}
    recorded, note = recorded_run_plan(
        [s.kernels for s in specs], cfg.batch_size, engine.workers,
        given=last_plan_record(cfg.plan) if cfg.plan else None, given_source=cfg.plan,
        resumed=resumed.get("plan") if engine.fixed_plan is None else None,
        resumed_micro=resumed.get("micro_batches"), resumed_source=resumed.get("path", ""))
    if note:
        log(note)
    if recorded is not None:            # its micro-batch count too, where --micro-batches is auto
        engine.fixed_plan = recorded.plan
        taken = recorded.micro_batches if recorded.micro_batches and not cfg.micro_batches else None
        log(f"{recorded.source}: running its plan" + (f" and its {taken} micro-batches" if taken else "")
            + " (no calibrated split, no rebalancing)")
        return dataclasses.replace(cfg, micro_batches=taken) if taken else cfg
    if cfg.deterministic and any(getattr(cfg, name) != value for name, value in DETERMINISTIC_FLAGS.items()):
        cfg = dataclasses.replace(cfg, **DETERMINISTIC_FLAGS)
        if len(engine.workers) > 1:
            log("--deterministic: the equal split over every worker, never re-split (a split from timing would change "
                "the sums' order from run to run); --plan METRICS repeats an earlier run's calibrated plan")
    return cfg


def _head_threads(cfg, engine):
    """The threads of the head's GEMMs and of this thread's Numba kernels (head_gemm follows
    Numba's count), set here: under --deterministic the command's count (runtimes.threads_for);
    beside workers every core this process may use, as Numba's default gave before its pool was
    sized past the affinity mask (runtimes.pin); --local keeps its device's, which opening it set
    on this thread."""
    if cfg.deterministic:
        return runtimes.use_threads(runtimes.threads_for(cfg.threads, True), True)
    if not engine.in_process:
        return runtimes.use_threads(runtimes.threads_for(0, False), False)
    return runtimes.current_threads()


def _train(cfg, engine, log, resume, metrics, metrics_extra, ds, stop_grace, loaded, opened):
    t_setup = time.perf_counter()
    if ds is None:
        ds = load_dataset(cfg.data, **cfg.dataset_options())
    for note in ds.notes:                     # what the loader inferred (classes) or did (a held-out test split)
        log(note)
    said_skipped = isinstance(resume, checkpoint.Loaded)    # read by the caller, who said what it skipped
    resume = load_resume(resume)
    if resume is not None and not cfg.checkpoint_dir:
        cfg = dataclasses.replace(cfg, checkpoint_dir=checkpoint_dir_for(cfg, resume))
        log(f"checkpoints go to {cfg.checkpoint_dir}, where the run resumed from (--checkpoint-dir sets another)")
    loaded = loaded or network_for(cfg, ds, resume)
    network = loaded.spec
    specs = [ConvSpec.from_layer(layer) for layer in network.conv_layers()]
    input_shapes = [(cfg.batch_size,) + layer.input_shape for layer in network.conv_layers()]
    feature_shape = network.feature_shape()
    # the graph before planning (its joins are priced) and loading (its BatchNorm nodes' states)
    engine.configure(graph_pass(network, HostArrays()), cfg.optimizer, cfg.bn_ghost_batch, cfg.trace_step)
    if engine.graph is not None:
        log("the network is a graph; its conv blocks, as the plan names them: " + ", ".join(
            f"conv{n + 1} = {network.names[b.index]}" for n, b in enumerate(network.conv_layers())))
    steps_per_epoch = len(ds.train_y) // cfg.batch_size
    if steps_per_epoch < 1:
        raise ValueError(f"--batch-size {cfg.batch_size} is larger than the {len(ds.train_y)} training images of {ds.name}")
    total_steps = cfg.epochs * steps_per_epoch
    if cfg.steps > total_steps:
        epochs = math.ceil(cfg.steps / steps_per_epoch)
        log(f"--steps {cfg.steps} needs {epochs} epochs of {steps_per_epoch} steps (--epochs {cfg.epochs} covers "
            f"{total_steps}): running {epochs} epochs")
        cfg = dataclasses.replace(cfg, epochs=epochs)
    if cfg.steps:
        total_steps = cfg.steps
    head_threads = _head_threads(cfg, engine)         # --deterministic and --threads: no recorded plan changes them
    cfg = _reproducible(cfg, engine, specs, log, None if resume is None else resume[0])
    metrics.write("config", config=cfg.to_json(), data=repr(ds), network=network.to_json(),
                  runtime=runtimes.record(head_threads), **metrics_extra)

    rng = np.random.default_rng(cfg.seed)
    head = [op.layer.to_json() for op in network.head() if op.type != "flatten"]
    norms = network.norm_specs()                  # BatchNorms between blocks: their states follow the blocks'
    if loaded.params is not None:                 # a PyTorch module's own weights are the starting weights
        conv_given, fc_given = loaded.params
        conv_params = [given if isinstance(given, dict) else spec.initial_state(*given)
                       for spec, given in zip(specs, conv_given)] + list(conv_given[len(specs):])
        net = Network(specs, head, engine, rng, feature_shape, fc_params=fc_given, seed=cfg.seed,
                      optimizer=cfg.optimizer, host=HostArrays())
    else:
        conv_params = init_conv_params(specs, rng) + [norm.initial_state() for norm in norms]
        net = Network(specs, head, engine, rng, feature_shape, seed=cfg.seed, optimizer=cfg.optimizer,
                      host=HostArrays())
    start_step = 0
    if resume is not None:
        meta, conv_params, fc_state, skipped = resume
        for name, reason in [] if said_skipped else skipped:
            log(f"skipped {name}: {reason}")
        _compatible(meta, cfg, network)
        conv_params = [_run_state(spec, state, cfg.optimizer, log) for spec, state in zip(specs + norms, conv_params)]
        net.load_fc_state(fc_state)
        start_step = meta["step"]
        log(f"resumed from {meta['path']} at step {start_step}")
        metrics.write("resume", path=meta["path"], step=start_step,
                      skipped=[{"file": name, "reason": reason} for name, reason in skipped])

    settings = PlanSettings.of(cfg)             # what the engine plans by, now and at every re-plan
    plan = engine.plan_for(specs, input_shapes, settings)
    report = plan_report(engine, plan, cfg.precision, cfg.threads, head_threads, cfg.micro_batches, cfg.batch_size)
    engine.load(plan, specs, conv_params)
    if report.calibration:              # each worker's speeds and timings, and the conv paths its device chose
        metrics.write("calibration", workers=report.calibration)
    elastic = Elastic(cfg, engine, net, specs, input_shapes, settings, steps_per_epoch, log, metrics,
                      network.to_json(), data_meta(ds))
    elastic.start(start_step, conv_params)      # the first snapshot (kept only where a worker can be lost)
    del conv_params                             # the shards own the conv weights from here on
    if len(plan.workers) > 1 or elastic.enabled:      # one device in-process: nothing is split
        log(report.table)
    for line in report.lines:
        log(line)
    metrics.write("plan", **report.record)
    run = _Run(cfg, engine, net, elastic, ds, specs, start_step, total_steps, steps_per_epoch, log, metrics,
               report.micro_batches)
    # the photo loader's processes end with the run, however it ends (train's finally closes it)
    run.loader = open_loader(ds, cfg.batch_size, run.augment, cfg.seed, cfg.loader_workers, log)
    opened.append(run.loader)
    if cfg.precision == "auto":
        run.precision = PrecisionReport(specs, input_shapes)
        if report.calibration:          # the workers' choices at calibration; the first step's follow
            run.report_precision({name: report.calibration[name] for name in plan.workers
                                  if name in report.calibration})
            run.precision_due = True    # its counts stand as the first step's start (nothing runs between)
    setup_s = time.perf_counter() - t_setup
    log(f"{ds!r}; {max(0, total_steps - start_step)} steps of {cfg.batch_size} images "
        f"({steps_per_epoch} per epoch" + (f", {run.micro_batches} micro-batches each" if run.micro_batches > 1 else "")
        + f"); setup {setup_s:.1f}s")
    run.arm_rebalance(first=True)

    # Every operation that talks to workers (steps, snapshots, checkpoints, rebalancing, joins,
    # evaluation) runs inside run.advance: a lost or joining worker, wherever it is noticed, comes
    # back here as an event, and the run goes on. Only --min-workers ends a run for a loss.
    evaluation = None
    run.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, disable=None)
    with _StopRequests(saving=bool(cfg.checkpoint_dir), grace=stop_grace, bounded=elastic.enabled) as stop:
        try:
            while True:
                event = run.advance(stop)
                if isinstance(event, WorkersLost):
                    run.recover(event)
                elif isinstance(event, WorkersJoined):
                    run.replanned()
                elif isinstance(event, Stopped):
                    stop.disarm()
                    break
                else:
                    evaluation = event.evaluation
                    break
        except StopNow as e:
            run.rescue(str(e))
        except BaseException as e:
            run.rescue(f"run ended by {type(e).__name__}")
            raise
        finally:
            run.bar.close()
    step, last_ckpt, losses = run.step, run.last_ckpt, run.losses
    run.record_conv_paths()
    if evaluation is None:
        log(f"stopped at step {step}" + (f"; checkpoint {last_ckpt}" if last_ckpt else "; nothing saved"))
        metrics.write("interrupted", step=step, checkpoint=last_ckpt)
        return {"step": step, "interrupted": True, "exit_code": stop.exit_code or 130, "checkpoint": last_ckpt,
                "losses": losses}

    accuracy, seen = evaluation.accuracy, evaluation.images
    step_times = run.step_times
    summary = {"step": step, "test_accuracy": accuracy, "test_loss": evaluation.loss, "test_images": seen,
               "final_loss": losses[-1] if losses else None,
               "median_step_s": float(np.median(step_times[1:] or step_times)) if step_times else None,
               "checkpoint": last_ckpt, "setup_s": setup_s}
    metrics.write("done", **summary)
    log(f"done: {step} steps; test accuracy {accuracy:.3f} and test loss {evaluation.loss:.4f} on {seen} images"
        + (f"; final training loss {losses[-1]:.4f}" if losses else ""))
    if not last_ckpt:
        log("nothing was saved: add --checkpoint-dir DIR to keep the trained model (and --checkpoint-every N "
            "to save during the run too)")
    summary["losses"] = losses
    return summary
