"""Elastic training: in-memory snapshots, and what the loop does when a worker is lost or joins.

The shards hold the only copy of the conv weights during training, so the coordinator keeps a
snapshot: every layer's whole state (weights, BatchNorm statistics, optimizer slots) gathered
from the workers, the FC layers and theirs, and the step (the batch order depends only on the seed and the epoch, so the step is
the whole data position). Every gather the run makes anyway (a checkpoint's, a rebalance's, the
final one before evaluation) is kept as the snapshot too, so the snapshot is never older than a
checkpoint this run wrote. When a worker is lost, during a step or anything else that talks to
workers, the survivors are re-planned from their calibration, reloaded from the snapshot, and the
steps since it are replayed: the run ends with the weights an uninterrupted run would have, up to
float rounding (a different plan sums partial dX in another grouping; under --deterministic a line
says that the bits now differ from an uninterrupted run's). A worker that connects
mid-run is told how long until the next snapshot, then calibrated and admitted right after it.

What it costs: a snapshot gathers every conv weight and momentum over the workers' links (the
paper network: ~150 MB). N is chosen so snapshots take at most SNAPSHOT_BUDGET of the step
time, unless --snapshot-every sets it; a loss recomputes at most N steps.
"""
import math
import os
import time

from hetconv.engine.contract import ElasticEngine, WorkerLost, micro_choice_record, moved_bytes, wire_record
from hetconv.training import checkpoint
from hetconv.training.membership import WorkersJoined

SNAPSHOT_BUDGET = 0.02        # of step time
RESCUE_DIR = "hetconv-rescue"


class Snapshot:
    def __init__(self, step, conv, fc):
        self.step = step
        self.conv = conv                                    # per layer its whole state {name: array}, full size
        self.fc = fc                                        # per linear layer {name: array}, copies


class Elastic:
    """Owned by the training loop; a no-op for engines that cannot lose workers (--local)."""

    def __init__(self, cfg, engine, net, specs, input_shapes, settings, steps_per_epoch, log, metrics, network=None,
                 data=None):
        self.cfg, self.engine, self.net = cfg, engine, net
        self.steps_per_epoch = steps_per_epoch
        self.specs, self.input_shapes = specs, input_shapes
        self.settings = settings                            # engine.policy.PlanSettings every re-plan reads
        self.log, self.metrics = log, metrics
        self.network = network                              # the NetSpec's JSON, stored in every checkpoint
        self.data = data                                    # the data set's meta (classes, normalisation), too
        self.enabled = isinstance(engine, ElasticEngine)
        self.every = cfg.snapshot_every or None             # None: decided after the first timed snapshot
        self.snapshot = None
        self.snapshot_s = 0.0
        self.saved = {}                                     # step -> checkpoint path this run wrote
        self.first_step = 0

    def start(self, step, conv_params):
        """The weights the shards were just loaded with are the first snapshot: no gather needed."""
        self.first_step = step
        if self.enabled:
            self.snapshot = Snapshot(step, conv_params, self.net.fc_state())

    def keep(self, step, conv):
        """A gather made for another reason (checkpoint, rebalance, the end) is the newest snapshot."""
        if self.enabled:
            self.snapshot = Snapshot(step, conv, self.net.fc_state())

    def gather(self, step):
        """The conv weights at `step`: from the snapshot when it is of this step, else gathered
        (and kept as the snapshot)."""
        if self.enabled and self.snapshot.step == step:
            return self.snapshot.conv
        conv = self.engine.gather()
        self.keep(step, conv)
        return conv

    def after_step(self, step, step_s):
        """Take a snapshot when one is due; admit waiting workers right after it. Returns
        WorkersJoined with the new plan when workers joined, else None."""
        if not self.enabled:
            return None
        since = step - self.snapshot.step
        due = since >= self.every if self.every else since >= 2    # the 1st step pays for warm-up
        if not due:
            self._tell_joiners(step, step_s)
            return None
        t0 = time.perf_counter()
        self.snapshot = Snapshot(step, self.engine.gather(), self.net.fc_state())
        self.snapshot_s = time.perf_counter() - t0
        # recorded as the snapshot's own traffic, so that the next step's stats stay the step's
        self.metrics.write("snapshot", step=step, seconds=self.snapshot_s, bytes=moved_bytes(self.engine.step_stats()))
        if self.every is None:
            self.every = max(1, math.ceil(self.snapshot_s / (SNAPSHOT_BUDGET * max(step_s, 1e-9))))
            self.log(f"a lost worker costs at most {self.every} step(s) of work: the weights are copied here every "
                     f"{self.every} step(s), {self.snapshot_s:.2f} s a copy against {step_s:.2f} s a step")
        plan = self.engine.admit(self.specs, self.input_shapes, self.settings)
        if plan is not None:
            self.engine.load(plan, self.specs, self.snapshot.conv)
            self.metrics.write("worker_joined", step=step, workers=list(plan.workers))
            self.metrics.write("plan", reason="worker joined", step=step, **plan.to_json(),
                               **micro_choice_record(self.engine), **wire_record(self.engine))
            self.log("a worker joined:\n" + plan.table())
            self._say_bits_differ("a worker joined")
            return WorkersJoined(plan)
        return None

    def _tell_joiners(self, step, step_s):
        """Workers waiting to join hear how long until the next snapshot admits them, so they wait
        as long as the run needs rather than their own --connect-timeout."""
        every = self.every or 2
        steps_left = max(1, self.snapshot.step + every - step)
        self.engine.keep_joiners_waiting(steps_left * step_s + self.snapshot_s)

    def recover(self, error, step):
        """After `error` (WorkerLost) while the run was at step `step`: drop the lost workers,
        re-plan the survivors, reload them from the snapshot. Returns (the step to go on from,
        the new plan). Below --min-workers, saves the snapshot as a checkpoint and raises
        WorkerLost saying so."""
        if not self.enabled or not error.workers:
            raise error
        while True:
            self.engine.drop(error.workers)
            for name in error.workers:
                self.metrics.write("worker_lost", step=step + 1, worker=name, reason=str(error))
            self.log(f"lost {', '.join(error.workers)} at step {step + 1}: {error}")
            left = len(self.engine.workers)
            if left < self.cfg.min_workers:
                path = self.save_snapshot()
                raise WorkerLost(f"{error}; {left} worker(s) left, below --min-workers {self.cfg.min_workers}: "
                                 f"saved step {self.snapshot.step} to {path}; resume with --resume {path}",
                                 error.workers) from None
            try:
                plan = self.engine.replan(self.specs, self.input_shapes, self.settings)
                self.engine.load(plan, self.specs, self.snapshot.conv)
                break
            except WorkerLost as again:          # another one went while the survivors were reloaded
                if not again.workers:
                    raise
                error = again
        self.net.load_fc_state(self.snapshot.fc)
        self.metrics.write("plan", reason=f"lost {', '.join(error.workers)}", step=self.snapshot.step, **plan.to_json(),
                           **micro_choice_record(self.engine), **wire_record(self.engine))
        self.log(f"going on with {left} worker(s) from the snapshot at step {self.snapshot.step} "
                 f"(replaying {step - self.snapshot.step} step(s)):\n" + plan.table())
        self._say_bits_differ(f"lost {', '.join(error.workers)}")
        return self.snapshot.step, plan

    def _say_bits_differ(self, what):
        """Under --deterministic, the line saying that a new plan's sums group otherwise: the same
        command without the loss or join gives other bits from here on (a replay on the old plan's
        split would need the lost worker's share recomputed as it was, which no survivor holds)."""
        if self.cfg.deterministic:
            self.log(f"--deterministic: {what}, so the run's bits now differ from an uninterrupted run's (the new "
                     f"plan sums partial results in another grouping)")

    def checkpoint(self, step):
        """A checkpoint of the run at `step` in --checkpoint-dir (the conv weights gathered, or
        the snapshot's where it is of this step). Returns its path."""
        return self._write(self.cfg.checkpoint_dir, step, self.gather(step), self.net.fc_state())

    def save_snapshot(self):
        """The snapshot as a checkpoint (in --checkpoint-dir, else RESCUE_DIR), honouring
        --keep-checkpoints; where this run already wrote that step, that file. Returns its path."""
        if self.snapshot.step in self.saved and os.path.exists(self.saved[self.snapshot.step]):
            return self.saved[self.snapshot.step]
        return self._write(self.cfg.checkpoint_dir or os.path.abspath(RESCUE_DIR), self.snapshot.step,
                           self.snapshot.conv, self.snapshot.fc)

    def unsaved_snapshot(self):
        """Whether the snapshot holds steps that no checkpoint of this run has."""
        return (self.enabled and self.snapshot is not None
                and self.snapshot.step > max(self.saved, default=self.first_step))

    def _write(self, directory, step, conv, fc):
        path = checkpoint.save(directory, step, step // self.steps_per_epoch, self.cfg, conv, fc, self.engine.plan,
                               keep=self.cfg.keep_checkpoints, network=self.network,
                               data=self.data, conv_paths=self.engine.conv_path_records(),
                               micro_batches=(getattr(self.engine, "micro_choice", None) or {}).get("micro_batches"))
        self.saved[step] = path
        return path
