"""The engine of `--local` and of the tools that time one process: every conv layer whole, on one
device, in this process, behind the same contract as the remote engine."""
import time

import numpy as np

from hetconv.devices.base import as_layout_kept
from hetconv.engine.contract import ShardEngine
from hetconv.engine.shard import ShardServer
from hetconv.transport.wire import check_wire_dtype, rounded


def _whole_of(x, r):
    """Whether x is r or a view of all of it (a layer's whole channel range, as sent to a shard)."""
    return x is r or (x.base is r and x.shape == r.shape and x.strides == r.strides
                      and x.ctypes.data == r.ctypes.data)


class LocalEngine(ShardEngine):
    """The conv layers in this process, on in-process shards: `--local`, and tests. The shards
    are served by the same ShardServer a worker process runs; only the sockets are missing."""

    def __init__(self, shards, wire="float32"):
        self.servers = {name: ShardServer(shard) for name, shard in dict(shards).items()}
        super().__init__()
        self.wire = check_wire_dtype(wire)      # rounded as a distributed run's wire rounds: --local is its reference
        self._rounded = []                      # the last arrays this engine returned, already as the wire carries them

    # Nothing travels, so the shards take and give float32 and the engine rounds where a wire would:
    # one pass a map (encode then decode made two, and two new arrays), and none for a map that
    # is this engine's own rounded output going back in (a chain's next input, a next dX's dout).
    def _shard_wire(self):
        return "float32"

    def _wire_out(self, x):
        # a channels-last map stays so: the device it goes to reads it in place
        if self.wire == "float32" or any(_whole_of(x, r) for r in self._rounded):
            return as_layout_kept(x)
        return rounded(x, self.wire)

    def _wire_in(self, a):
        if self.wire == "float32":
            return a
        out = rounded(a, self.wire)              # a new array: the shard may keep `a` for its backward
        out.flags.writeable = False              # so it stays as the wire carries it, when it comes back
        self._rounded = [out] + self._rounded[:1]
        return out

    @property
    def workers(self):
        return list(self.servers)

    def _call(self, requests, doing, layer=None):
        replies = {}
        for name, (op, arrays, fields) in requests.items():
            t0 = time.perf_counter()
            _, out, reply = self.servers[name].handle(op, arrays, fields)
            replies[name] = (out, reply)
            self._record(name, layer, {"compute_s": time.perf_counter() - t0})
        return replies

    def thread_counts(self):
        """Each in-process device's threads; the first one's are the device's a plan record keeps."""
        workers = {name: getattr(server.shard.device, "threads", 0) for name, server in self.servers.items()}
        return next(iter(workers.values()), 0), workers

    def conv_path_records(self):
        """Each in-process device's conv path record, read from it now: no gather needed."""
        records = []
        for name, server in self.servers.items():
            record = server.shard.device.conv_path_record()
            if record is not None:
                records.append({"worker": name, **record})
        return records

    def propose_rebalance(self, specs, min_gain=0.05):
        """In-process shards share one device: nothing to rebalance."""
        return None
