"""The run's metrics file: one JSON line per event (config, plan, step, snapshot, checkpoint, eval,
worker_lost, worker_joined, done), read back by hetconv-report."""
import json
import os


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
