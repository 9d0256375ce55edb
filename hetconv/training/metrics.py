"""The run's metrics file: one JSON line per event (config, plan, step, snapshot, checkpoint, eval,
worker_lost, worker_joined, done), read back by hetconv-report."""
import json
import os

from hetconv.engine.microbatch import recorded_micro_batches


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


# A metrics file is read line by line for --plan; no line of one is near this (a plan record of a
# network of hundreds of layers is tens of KB).
MAX_RECORD_BYTES = 16 << 20


def last_plan_record(path):
    """The newest "plan" record of the metrics file `path` (or the plan JSON `path` holds), for
    --plan: the plan's fields, and "micro_batches" where the run's plan had a micro-batch count
    chosen for it. Raises ValueError naming --plan and the file where it holds none or is no
    such file; a line over MAX_RECORD_BYTES is refused, never read whole."""
    def bad(why):
        return ValueError(f"--plan {path!r}: {why}")

    try:
        f = open(path, "rb")
    except OSError as e:
        raise bad(f"cannot be read ({e.strerror or e})") from None
    found = None
    with f:
        for n, line in enumerate(iter(lambda: f.readline(MAX_RECORD_BYTES + 1), b""), 1):
            if len(line) > MAX_RECORD_BYTES:
                raise bad(f"line {n} is over {MAX_RECORD_BYTES:,} bytes: not a metrics file")
            try:
                record = json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError):
                continue                    # a last line cut short by a killed run
            if isinstance(record, dict) and (record.get("event") == "plan" or
                                             "event" not in record and "layers" in record and "workers" in record):
                found = record
    if found is None:
        raise bad("holds no plan record (give the --metrics file of a run with workers, or a plan's JSON)")
    plan = {k: v for k, v in found.items() if k != "event"}
    choice = found.get("micro_choice")
    micro = recorded_micro_batches(choice.get("micro_batches")) if isinstance(choice, dict) else None
    if micro:
        plan["micro_batches"] = micro
    return plan
