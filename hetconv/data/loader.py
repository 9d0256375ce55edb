"""The streaming loader: a photo folder's batches decoded in loader processes, a bounded number of
batches ahead of the step, passed back as uint8 through one shared-memory block; and the same
interface over the in-memory sets (batches.py), so the training loop has one way to ask.

    loader = open_loader(ds, batch_size, augment, seed, workers)   # InMemory or Photo
    for x, y in loader.epoch(epoch, start=step_in_epoch): ...     # float32 (B, C, H, W), int64 (B,)
    for x, y in loader.test_batches(): ...
    loader.close()                                                  # every process ended, the block freed

An epoch's order is a full permutation of the training files from np.random.default_rng([seed,
epoch]) (what batches.py draws for an in-memory set), and each photo's random choices come from
(seed, epoch, its position), so a resumed or replaying run sees the same images at the same steps,
whichever process decoded them.

Nothing waits without a deadline: a loader process that dies, or one that fails to decode a
photo with --bad-images fail, ends the epoch with a DataError naming it; with skip, a photo that
fails mid-run is replaced in its batch by the batch's next good photo (label and all), and named.
A photo still decoding after PHOTO_DEADLINE_S (a file swapped for a fifo after the listing, a hung
network file system) ends the run with a DataError naming it, as does a loader process that takes
no work for that long or does not start within START_DEADLINE_S. A loader process exits on a
None task, and on its own when the parent process is gone.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import signal
import time
from multiprocessing import shared_memory

import numpy as np

from hetconv.data.base import DataError
from hetconv.data.batches import _check_augment, batches, test_batches
from hetconv.data.photos import (BadImage, FileImages, auto_workers, eval_image, image_rng,  # noqa: F401
                                 loader_processes, pixel_limit, train_image, usable_cores)

POLL_S = 0.2                  # how often a wait checks that the loader processes are alive and moving
# One photo's decode: its file is at most 64 MB and its pixels within the decode budget
# (photos.pixel_limit), a second or two on a slow core; past this the file does not end or its
# file system hangs, and no retry would help.
PHOTO_DEADLINE_S = 60.0
START_DEADLINE_S = 120.0      # a loader process's start (a spawn and its imports) on a loaded machine


def open_loader(ds, batch_size: int, augment=(), seed: int = 0, workers: int = 0, log=None, prefetch: int = 0):
    """The loader of data set `ds`: PhotoLoader for a photo folder (its processes started now, as
    photos.loader_processes makes of --loader-workers `workers`; `log` told how many, and why when
    that is fewer than asked), else InMemoryLoader."""
    if isinstance(ds.train_x, FileImages):
        chosen, capped = loader_processes(workers)
        loader = PhotoLoader(ds, batch_size, augment, seed, chosen, prefetch=prefetch)
        if log is not None:
            if capped:
                log(capped)
            why = ("--loader-workers, capped" if capped else "--loader-workers") if workers else (
                f"auto: a quarter of the {usable_cores()} usable cores, the rest left to the compute; "
                f"--loader-workers sets it")
            log(f"photo loader: {chosen} process{'es' if chosen > 1 else ''} ({why}), {loader.slots} batches of "
                f"{batch_size} ahead in shared memory ({loader.shm.size / 2 ** 20:.1f} MB)")
        return loader
    return InMemoryLoader(ds, batch_size, augment, seed)


class InMemoryLoader:
    """batches.py's epochs over a set held in memory, behind the loader's interface."""

    def __init__(self, ds, batch_size, augment=(), seed=0):
        self.ds, self.batch_size, self.augment, self.seed = ds, batch_size, tuple(augment), seed

    def epoch(self, epoch, start=0):
        return batches(self.ds, self.batch_size, np.random.default_rng([self.seed, epoch]), augment=self.augment,
                       seed=self.seed, epoch=epoch, start=start, prefetch=True)

    def test_batches(self, batch_size=None):
        return test_batches(self.ds, batch_size or self.batch_size)

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _serve(shm_name, slots_shape, size, augment, seed, skip, tasks, results, progress, limit):
    """A loader process: decode each task's photos into its slot of the shared block, then say so.
    `progress` (shared with the parent) is (task tag, position in it, since when): the photo being
    decoded, or tag 0 and the time it went idle, so the parent can name a photo that never ends."""
    # Ctrl-C and a SIGTERM to the process group are the parent's to handle: it checkpoints, then
    # ends us (close(): a None task, then kill); a parent gone without that is noticed below
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    block = shared_memory.SharedMemory(name=shm_name)
    slots = None
    try:
        slots = np.ndarray(slots_shape, np.uint8, block.buf)
        parent = mp.parent_process()
        progress[2] = time.monotonic()                    # started, idle
        while True:
            try:
                task = tasks.get(timeout=1.0)
            except queue.Empty:
                if parent is not None and not parent.is_alive():
                    return                                 # the parent died without telling us
                continue
            if task is None:
                return
            tag, slot, paths, epoch, first = task
            out = slots[slot]
            failed = []
            for k, path in enumerate(paths):
                progress[2], progress[1], progress[0] = time.monotonic(), k, tag
                try:
                    if epoch is None:
                        out[k] = eval_image(path, size, limit)
                    else:
                        out[k] = train_image(path, size, augment, image_rng(seed, epoch, first + k), limit)
                except BadImage as e:
                    failed.append((k, path, str(e)))
                except Exception as e:                     # anything else names the photo too
                    failed.append((k, path, f"{type(e).__name__}: {e}"))
            progress[2], progress[0] = time.monotonic(), 0
            if failed and (not skip or len(failed) == len(paths)):
                results.put((tag, "error", failed))
                continue
            taken = {}                                     # position -> the good position it copies
            bad = {k for k, _, _ in failed}
            for k, _, _ in failed:
                src = next(j % len(paths) for j in range(k + 1, k + len(paths)) if j % len(paths) not in bad)
                out[k] = out[src]
                taken[k] = src
            results.put((tag, "ok", (taken, failed)))
    finally:
        del slots
        block.close()


class PhotoLoader:
    """`workers` loader processes decoding a photo folder's batches into `slots` shared-memory
    batch buffers; at most `slots` batches are decoded ahead of the one the step takes. Memory is
    slots x batch x 3 x S x S bytes and the paths, whatever the number of photos; what the
    processes decode at once is bounded by photos.DECODE_BUDGET_BYTES (pixel_limit(workers), checked
    from each photo's header before it is decoded)."""

    def __init__(self, ds, batch_size, augment=(), seed=0, workers=1, prefetch=0, skip=None,
                 deadline_s=PHOTO_DEADLINE_S):
        self.ds, self.batch_size, self.seed = ds, batch_size, seed
        self.augment = _check_augment(augment, photos=True)
        self.files = ds.train_x.files
        self.size = ds.train_x.size
        self.skip = ds.bad_images == "skip" if skip is None else skip
        self.slots = prefetch or max(2, 2 * workers)
        self.workers = []
        self.shm = None
        self._tag = 0
        self._busy = {}                     # slot -> tag of the task decoding into it
        self._done = {}                     # tag -> (status, payload) arrived before it was waited for
        self.skipped = []                   # (path, why) of photos replaced mid-run
        self.deadline_s = deadline_s
        self.pixel_limit = pixel_limit(workers)
        self._paths = {}                    # tag -> the photos of that task, to name one that stalls
        self._progress = []                 # per process: (tag, position, since), see _serve
        self._moved = time.monotonic()      # when a task was last submitted or a result arrived
        shape = (self.slots, batch_size, 3, self.size, self.size)
        self.shm = shared_memory.SharedMemory(create=True, size=max(1, int(np.prod(shape))))
        self.buffers = np.ndarray(shape, np.uint8, self.shm.buf)
        ctx = mp.get_context("spawn")       # no fork of a process that holds sockets and BLAS threads
        self.tasks, self.results = ctx.Queue(), ctx.Queue()
        try:
            for i in range(workers):
                progress = ctx.Array("d", 3, lock=False)
                p = ctx.Process(target=_serve, name=f"hetconv-loader-{i}", daemon=True,
                                args=(self.shm.name, shape, self.size, self.augment, seed, self.skip,
                                      self.tasks, self.results, progress, self.pixel_limit))
                p.start()
                self.workers.append(p)
                self._progress.append(progress)
            self._started = time.monotonic()
        except BaseException:
            self.close()
            raise

    # ---- tasks and results -------------------------------------------------------------------
    def _submit(self, slot, paths, epoch, first):
        self._tag += 1
        self._busy[slot] = self._tag
        self._paths[self._tag] = paths
        self._moved = time.monotonic()      # idle processes have had no work until now
        self.tasks.put((self._tag, slot, paths, epoch, first))
        return self._tag

    def _check_alive(self):
        for p in self.workers:
            if not p.is_alive():
                raise DataError(f"photo loader process {p.name} (pid {p.pid}) exited with code {p.exitcode} "
                                f"while decoding batches; the run cannot go on without it")

    def _check_moving(self):
        """DataError when a process has decoded one photo for longer than the deadline (naming it),
        when every process has been idle that long with work waiting, or when one has not started."""
        now = time.monotonic()
        for p, (tag, k, since) in zip(self.workers, [tuple(r) for r in self._progress]):
            if tag and now - since > self.deadline_s:
                paths = self._paths.get(int(tag), ())
                path = paths[int(k)] if int(k) < len(paths) else f"a photo of batch task {int(tag)}"
                raise DataError(f"{path}: loader process {p.name} has been decoding it for more than "
                                f"{self.deadline_s:g} s (hetconv.data.loader.PHOTO_DEADLINE_S): a file that never "
                                f"ends (a fifo, a device) or a file system that hangs; the run cannot go on")
            if not since and now - self._started > START_DEADLINE_S:
                raise DataError(f"photo loader process {p.name} (pid {p.pid}) did not start within "
                                f"{START_DEADLINE_S:g} s (hetconv.data.loader.START_DEADLINE_S)")
        records = [tuple(r) for r in self._progress]
        if records and all(since and not tag for tag, _, since in records):
            idle = now - max([self._moved] + [since for _, _, since in records])
            if idle > self.deadline_s:
                raise DataError(f"photo loader: no loader process took a batch or returned one for {idle:.0f} s "
                                f"while one was waited for (deadline {self.deadline_s:g} s, "
                                f"hetconv.data.loader.PHOTO_DEADLINE_S)")

    def _wait(self, tag):
        """The result of task `tag` (others that arrive first are kept for their own wait); every
        poll checks the processes are alive and moving (_check_moving), so no wait is unbounded."""
        done = self._done
        while tag not in done:
            try:
                got, status, payload = self.results.get(timeout=POLL_S)
            except queue.Empty:
                self._check_alive()
                self._check_moving()
                continue
            done[got] = (status, payload)
            self._moved = time.monotonic()
        self._paths.pop(tag, None)
        return done.pop(tag)

    def _drain(self):
        """Wait for every task still decoding (a generator left early), dropping its result."""
        for slot, tag in list(self._busy.items()):
            self._wait(tag)
            del self._busy[slot]

    def _batches(self, jobs, epoch, labels_of, raw=False):
        """Yield (x float32, y int64) of each job (paths, first position, labels), in order, with
        up to `slots` jobs decoding ahead; `raw`: x as uint8, not normalised."""
        self._drain()
        free = list(range(self.slots))
        pending = []                                    # (tag, slot, labels) in job order
        jobs = iter(jobs)

        def fill():
            while free:
                job = next(jobs, None)
                if job is None:
                    return
                paths, first, labels = job
                slot = free.pop(0)
                pending.append((self._submit(slot, paths, epoch, first), slot, labels))

        fill()
        while pending:
            tag, slot, labels = pending.pop(0)
            status, payload = self._wait(tag)
            del self._busy[slot]
            if status == "error":
                free.append(slot)
                k, path, why = payload[0]
                more = f" (and {len(payload) - 1} more in its batch)" if len(payload) > 1 else ""
                hint = "" if self.skip else "; --bad-images skip replaces such a photo in its batch and goes on"
                raise DataError(f"{path}: {why}{more}: a loader could not decode it{hint}")
            taken, failed = payload
            y = labels.copy()
            for k, src in taken.items():
                y[k] = labels[src]
            self.skipped += [(path, why) for _, path, why in failed]
            x = self.buffers[slot, :len(labels)]
            x = x.copy() if raw else self.ds.normalize(x)              # a copy: the slot is free again
            free.append(slot)
            fill()
            yield x, y

    # ---- the interface -------------------------------------------------------------------------
    def epoch(self, epoch, start=0):
        """Epoch `epoch` from its batch `start`: full batches only (drop_last), as batches.py."""
        n, b = len(self.files), self.batch_size
        if b > n:
            raise ValueError(f"batch_size {b} is larger than the {n} training photos of {self.ds.name!r}")
        order = np.random.default_rng([self.seed, epoch]).permutation(n)
        train_y = self.ds.train_y

        def jobs():
            for i in range(start, n // b):
                idx = order[i * b:(i + 1) * b]
                yield [self.files[j] for j in idx], i * b, train_y[idx]
        return self._batches(jobs(), epoch, train_y)

    def test_batches(self, batch_size=None, raw=False):
        """Every evaluation photo once, in order, with evaluation's transform; the last batch may
        be smaller. `raw`: uint8 images, for a caller that normalises with a model's statistics."""
        b = min(batch_size or self.batch_size, self.batch_size)
        files, labels = self.ds.test_x.files, self.ds.test_y

        def jobs():
            for s in range(0, len(files), b):
                yield files[s:s + b], s, labels[s:s + b]
        return self._batches(jobs(), None, labels, raw)

    def close(self, timeout=5.0):
        """Every loader process told to stop and joined (killed past `timeout`),
        the queues closed and the shared block freed. Safe to call twice."""
        for _ in self.workers:
            try:
                self.tasks.put(None)
            except (ValueError, OSError):
                break
        deadline = time.monotonic() + timeout
        for p in self.workers:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()                     # SIGTERM is ignored there (see _serve)
                p.join(1.0)
        self.workers = []
        for q in (getattr(self, "tasks", None), getattr(self, "results", None)):
            if q is not None:
                q.close()
                q.cancel_join_thread()
        if self.shm is not None:
            self.buffers = None
            self.shm.close()
            self.shm.unlink()
            self.shm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if getattr(self, "shm", None) is not None:
            self.close(timeout=1.0)
