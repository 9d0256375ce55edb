"""The training loop, the same for `--local` and for a distributed run: only the engine differs."""
import json
import math
import os
import signal
import sys
import threading
import time

import numpy as np
from tqdm import tqdm

from hetconv import checkpoint
from hetconv.config import Config
from hetconv.data import batches, load_dataset, test_batches
from hetconv.elastic import Elastic
from hetconv.engine import WorkerLost, moved_bytes
from hetconv.geometry import conv_specs, layer_input_shapes
from hetconv.model import Network, init_conv_params


MAX_REBALANCES = 3


class MetricsWriter:
    """JSON lines, flushed per record so a crash loses at most the line being written. A resumed
    run appends, so the records of the steps before the checkpoint stay. A file that cannot be
    written (a full disk, /dev/full) raises one ValueError naming --metrics and the OS error; the
    unwritten record is dropped, so close() does not raise it a second time."""

    def __init__(self, path, append=False):
        self.file, self.path = None, path
        if path:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                self.file = open(path, "a" if append else "w")
            except OSError as e:
                raise self._error(e) from None

    def _error(self, e):
        return ValueError(f"--metrics {self.path!r} cannot be written: {e.strerror or e}")

    def write(self, event, **fields):
        if self.file:
            try:
                self.file.write(json.dumps({"event": event, **fields}) + "\n")
                self.file.flush()
            except OSError as e:
                self._drop()
                raise self._error(e) from None

    def _drop(self):
        file, self.file = self.file, None
        try:
            file.close()                # flushes what is buffered again: it fails the same way
        except OSError:
            pass

    def close(self):
        if self.file:
            file, self.file = self.file, None
            try:
                file.close()
            except OSError as e:
                raise self._error(e) from None


class _StopAfterStep:
    """First Ctrl-C: finish the running step, checkpoint, stop. Second Ctrl-C: stop at once."""

    def __init__(self, saving):
        self.saving = saving
        self.requested = False
        self._previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():   # signals only work there
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        then = "saving a checkpoint and stopping" if self.saving else "stopping (no --checkpoint-dir: nothing is saved)"
        print(f"\ninterrupt: finishing this step, then {then} (Ctrl-C again to stop now)", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def _compatible(saved, cfg):
    """Raise CheckpointError unless the checkpoint's saved config has this run's network."""
    try:
        cfg.check_same_network(Config.from_json(saved))
    except (TypeError, ValueError) as e:
        raise checkpoint.CheckpointError(f"cannot resume: {e}") from None


def resolve_micro_batches(cfg, engine):
    """--micro-batches 0 (auto): pieces only where something overlaps, the peer exchange over
    two or more workers; at least 16 images a piece, since smaller GEMMs lose efficiency, and at
    most 4, since each adds a round of messages."""
    if cfg.micro_batches:
        return cfg.micro_batches
    if getattr(engine, "exchange", None) != "peer" or len(engine.workers) < 2:
        return 1
    return max(1, min(4, cfg.batch_size // 16))


def center_crop(x, size):
    """(N, C, H, W) -> (N, C, size, size), C-contiguous; size 0 keeps the image whole."""
    if not size or size == x.shape[2]:
        return x
    top, left = (x.shape[2] - size) // 2, (x.shape[3] - size) // 2
    return np.ascontiguousarray(x[:, :, top:top + size, left:left + size])


def evaluate(net, ds, batch_size, max_batches=0, crop=0):
    correct = seen = 0
    for i, (x, y) in enumerate(test_batches(ds, batch_size)):
        if max_batches and i >= max_batches:
            break
        correct += int((net.predict(center_crop(x, crop)).argmax(axis=1) == y).sum())
        seen += len(y)
    return correct / max(seen, 1), seen


def train(cfg, engine, log=print, resume=None, metrics_extra=None, dataset=None):
    """Train per `cfg` with conv layers on `engine`. `engine.plan_for(specs, input_shapes, cfg)`
    returns the kernel split; the loop is otherwise transport-agnostic. `dataset`, when given, is
    cfg.data already loaded (the command line loads it before starting workers). Returns a
    summary dict."""
    metrics = MetricsWriter(cfg.metrics, append=bool(resume))
    try:
        return _train(cfg, engine, log, resume, metrics, metrics_extra or {}, dataset)
    finally:
        metrics.close()


def _train(cfg, engine, log, resume, metrics, metrics_extra, ds):
    t_setup = time.perf_counter()
    if ds is None:
        ds = load_dataset(cfg.data, seed=cfg.seed,
                          n_train=cfg.synthetic_train if cfg.data == "synthetic" else None,
                          n_test=cfg.synthetic_test if cfg.data == "synthetic" else None)
    specs = conv_specs(cfg.conv_kernels(), cfg.ksize, cfg.padding)
    input_shapes, _ = layer_input_shapes(specs, cfg.batch_size, cfg.image_shape())
    steps_per_epoch = len(ds.train_y) // cfg.batch_size
    if steps_per_epoch < 1:
        raise ValueError(f"--batch-size {cfg.batch_size} is larger than the {len(ds.train_y)} training images of {ds.name}")
    total_steps = cfg.epochs * steps_per_epoch
    if cfg.steps > total_steps:
        log(f"--steps {cfg.steps} is more than {cfg.epochs} epoch(s) of {steps_per_epoch} steps: "
            f"stopping after {total_steps} (raise --epochs for more)")
    elif cfg.steps:
        total_steps = cfg.steps
    metrics.write("config", config=cfg.to_json(), data=repr(ds), **metrics_extra)

    rng = np.random.default_rng(cfg.seed)
    conv_params = init_conv_params(specs, rng)
    net = Network(specs, cfg.fc_sizes(), engine, rng, cfg.image_shape())
    start_step = 0
    if resume:
        meta, conv_params, fc_state, skipped = checkpoint.load_newest_valid(resume)
        for name, reason in skipped:
            log(f"skipped {name}: {reason}")
        _compatible(meta["config"], cfg)
        net.load_fc_state(fc_state)
        start_step = meta["step"]
        log(f"resumed from {meta['path']} at step {start_step}")
        metrics.write("resume", path=meta["path"], step=start_step,
                      skipped=[{"file": name, "reason": reason} for name, reason in skipped])

    plan = engine.plan_for(specs, input_shapes, cfg)
    engine.load(plan, specs, conv_params)
    elastic = Elastic(cfg, engine, net, specs, input_shapes, steps_per_epoch, log, metrics)
    elastic.start(start_step, conv_params)      # the first snapshot (kept only where a worker can be lost)
    del conv_params                             # the shards own the conv weights from here on
    log(plan.table())
    metrics.write("plan", **plan.to_json())
    micro_batches = resolve_micro_batches(cfg, engine)
    setup_s = time.perf_counter() - t_setup
    log(f"{ds!r}; {total_steps - start_step} steps of {cfg.batch_size} images "
        f"({steps_per_epoch} per epoch" + (f", {micro_batches} micro-batches each" if micro_batches > 1 else "")
        + f"); setup {setup_s:.1f}s")

    def save(step, epoch):
        if not cfg.checkpoint_dir:
            return None
        path = checkpoint.save(cfg.checkpoint_dir, step, epoch, cfg, engine.gather(), net.fc_state(), engine.plan,
                               keep=cfg.keep_checkpoints)
        # the gather's traffic is the checkpoint's, not the next step's
        metrics.write("checkpoint", step=step, path=path, bytes=moved_bytes(engine.step_stats()))
        return path

    step = start_step
    # early on, the split from calibration is checked against real steps and corrected, up to
    # MAX_REBALANCES times while it still gains (never for `equal`, the baseline, nor for a
    # plan set by hand)
    rebalances = 0
    rebalance_at = (start_step + cfg.rebalance_after
                    if cfg.rebalance_after >= 2 and cfg.split == "proportional"
                    and engine.fixed_plan is None else 0)
    if rebalance_at >= total_steps:
        if rebalance_at and len(getattr(engine, "workers", ())) > 1:
            log(f"no rebalancing: {total_steps} steps are too few (the first re-split comes after step {rebalance_at}, "
                f"see --rebalance-after)")
        rebalance_at = 0
    losses, step_times = [], []
    last_ckpt = None

    def go_on_without(lost, step):
        """After WorkerLost in step `step` + 1: survivors re-planned and reloaded from the last
        snapshot; the records of the steps to replay are dropped. -> (step, plan, micro-batches)."""
        step, plan = elastic.recover(lost, step)
        del losses[step - start_step:], step_times[step - start_step:]
        bar.n = step
        bar.refresh()
        return step, plan, resolve_micro_batches(cfg, engine)

    interrupted = False
    last_line = time.monotonic()
    bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, disable=None)
    with _StopAfterStep(saving=bool(cfg.checkpoint_dir)) as stop:
        while step < total_steps and not stop.requested:
            epoch = step // steps_per_epoch
            skip = step % steps_per_epoch
            # the epoch's order depends only on (seed, epoch), so a resumed run sees the same batches
            order_rng = np.random.default_rng([cfg.seed, epoch])
            for i, (x, y) in enumerate(batches(ds, cfg.batch_size, order_rng)):
                if i < skip:
                    continue
                t0 = time.perf_counter()
                try:
                    result = net.train_step(center_crop(x, cfg.crop), y, cfg.lr, cfg.momentum, cfg.weight_decay,
                                            micro_batches)
                except WorkerLost as lost:
                    # go on without it: survivors reloaded from the last snapshot, the steps since replayed
                    step, plan, micro_batches = go_on_without(lost, step)
                    rebalance_at = 0                   # the survivors' split comes from their calibration
                    break                              # the epoch loop starts again at `step`
                dt = time.perf_counter() - t0
                if not math.isfinite(result.loss):
                    raise FloatingPointError(f"loss became {result.loss} at step {step + 1}: lower --lr (now {cfg.lr})")
                step += 1
                losses.append(result.loss)
                step_times.append(dt)
                metrics.write("step", step=step, epoch=epoch, loss=result.loss, accuracy=result.correct / len(y),
                              step_s=dt, images_per_s=len(y) / dt, workers=engine.step_stats())
                bar.update(1)
                bar.set_postfix(loss=f"{result.loss:.3f}", img_s=f"{len(y) / dt:.0f}")
                if bar.disable and time.monotonic() - last_line >= 30:
                    # no terminal (a log file, CI): a plain line every 30 s instead of the bar
                    last_line = time.monotonic()
                    log(f"step {step}/{total_steps}  loss {result.loss:.4f}  {len(y) / dt:.1f} img/s")
                if rebalance_at and step == rebalance_at - (cfg.rebalance_after - 1):
                    engine.reset_layer_timings()       # the first step pays for growing buffers
                if rebalance_at and step == rebalance_at:
                    new_plan = engine.rebalance(specs)
                    rebalance_at = 0
                    if new_plan is not None:
                        plan = new_plan
                        rebalances += 1
                        log("rebalanced from measured step times:\n" + plan.table())
                        metrics.write("plan", reason="rebalance", step=step, bytes=moved_bytes(engine.step_stats()),
                                      **plan.to_json())
                        if rebalances < MAX_REBALANCES:   # check again: each round corrects the last
                            rebalance_at = step + cfg.rebalance_after
                try:
                    if elastic.after_step(step, dt) is not None:
                        plan = engine.plan
                        micro_batches = resolve_micro_batches(cfg, engine)
                except WorkerLost as lost:             # lost while a snapshot was gathered: the last one stands
                    step, plan, micro_batches = go_on_without(lost, step - 1)
                    rebalance_at = 0
                    break
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                    last_ckpt = save(step, epoch)
                if step >= total_steps or stop.requested:
                    break
        interrupted = stop.requested
    bar.close()
    if step > start_step or not last_ckpt:
        last_ckpt = save(step, step // steps_per_epoch) or last_ckpt
    if interrupted:
        log(f"stopped at step {step}" + (f"; checkpoint {last_ckpt}" if last_ckpt else ""))
        metrics.write("interrupted", step=step, checkpoint=last_ckpt)
        return {"step": step, "interrupted": True, "checkpoint": last_ckpt, "losses": losses}

    accuracy, seen = evaluate(net, ds, cfg.batch_size, cfg.eval_batches, cfg.crop)
    summary = {"step": step, "test_accuracy": accuracy, "test_images": seen,
               "final_loss": losses[-1] if losses else None,
               "median_step_s": float(np.median(step_times[1:] or step_times)) if step_times else None,
               "checkpoint": last_ckpt, "setup_s": setup_s}
    metrics.write("done", **summary)
    log(f"done: {step} steps, test accuracy {accuracy:.3f} on {seen} images"
        + (f", final loss {losses[-1]:.4f}" if losses else ""))
    summary["losses"] = losses
    return summary
