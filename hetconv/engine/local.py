"""The engine of `--local` and of the tools that time one process: every conv layer whole, on one
device, in this process, behind the same contract as the remote engine."""
import time

from hetconv.engine.contract import ShardEngine
from hetconv.engine.shard import ShardServer
from hetconv.transport.wire import check_wire_dtype


class LocalEngine(ShardEngine):
    """The conv layers in this process, on in-process shards: `--local`, and tests. The shards
    are served by the same ShardServer a worker process runs; only the sockets are missing."""

    def __init__(self, shards, wire="float32"):
        self.servers = {name: ShardServer(shard) for name, shard in dict(shards).items()}
        super().__init__()
        self.wire = check_wire_dtype(wire)      # rounded as a distributed run's wire rounds: --local is its reference

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

    def propose_rebalance(self, specs, min_gain=0.05):
        """In-process shards share one device: nothing to rebalance."""
        return None
