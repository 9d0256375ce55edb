"""What moving data costs the compute cores of the hosts at both ends of a link: CPU seconds per
byte, for the cost model's `Link.host_cpu_s_per_byte`.

Where every emulated host shares one machine's cores (bench/bandwidth.py: the coordinator and
two 1-thread workers on 2 cores), a worker's kernel network stack, ZeroMQ I/O thread and receive
thread run on the core its device computes on. With micro-batches the wire overlaps compute, so
that work is paid as slower compute. This measures it the way a worker would feel it: two
processes pinned like two workers (cores 0 and 1), each timing a fixed amount of single-thread
sgemm work, once with the link idle and once while one streams 4 MB ZeroMQ messages to the other
as fast as the link takes them. The compute time both lose, over the bytes that arrived while the
receiver computed, is the cost per byte. Rounds alternate idle and streaming; each keeps its
median, so a burst of outside load skews neither for long.

    python bench/_wire_cpu.py measure ipc:///tmp/probe.ipc        # two processes on this host
    python bench/_wire_cpu.py measure ipc:///tmp/probe.ipc conv   # the CPU device's conv2 as the workload
    python bench/_wire_cpu.py receive|send ENDPOINT CORE MODE ITERATIONS WORKLOAD   # one end (run by measure)
"""
import json
import os
import subprocess
import sys
import threading
import time

MESSAGE_BYTES = 4 << 20
WORK_ITERATIONS = 600            # ~1.5 s of 512^3 sgemm on one core of a recent x86


def _conv_probe(iterations):
    """The device's own work instead of sgemm: the CPU device's fused forward and backward (with dX)
    of a worker's half of the paper's conv2, 16 images; one pass counts as ~300 of `iterations`
    (about as long as 300 of the 512^3 sgemm). Memory-bound parts (the expansion, the fold) feel
    a neighbour's copies more than sgemm does, if anything does."""
    import numpy as np
    from hetconv.devices import open_device
    from hetconv.geometry import conv_specs
    from hetconv.engine.shard import ConvShard
    spec = conv_specs([500, 1500])[1]
    shard = ConvShard(open_device("cpu", threads=1))
    rng = np.random.default_rng(0)
    w = (0.01 * rng.standard_normal((750, 500, 5, 5))).astype(np.float32)
    shard.load(0, spec, 0, 750, w, np.zeros(750, np.float32))
    x = rng.standard_normal((16, 500, 14, 14), dtype=np.float32)

    def one():
        y = shard.forward(0, x)
        shard.backward(0, np.ones_like(y), True)
    one()
    t0 = time.perf_counter()
    for _ in range(max(1, round(iterations / 300))):
        one()
    return time.perf_counter() - t0


def _probe(iterations=WORK_ITERATIONS, workload="sgemm"):
    if workload == "conv":
        return _conv_probe(iterations)
    """Seconds for a fixed amount of single-thread sgemm (numpy releases the GIL inside it, as the
    device kernels do, so the process's other threads run beside it as they would in a worker)."""
    import numpy as np
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((512, 512), dtype=np.float32) for _ in range(2))
    c = np.empty_like(a)
    for _ in range(20):
        np.matmul(a, b, out=c)                # warm: pages, BLAS buffers, frequency
    t0 = time.perf_counter()
    for _ in range(iterations):
        np.matmul(a, b, out=c)
    return time.perf_counter() - t0


def _end(role, endpoint, core, mode, iterations=WORK_ITERATIONS, workload="sgemm"):
    """One end: pinned to `core`; the receiver binds, counts the bytes that arrive while it
    computes; the sender streams while it computes (mode 'stream') or only says go ('idle')."""
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[int(core) % len(cores)]})       # the workers' cores: 0 and 1, as they are
    import zmq
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL if role == "receive" else zmq.PUSH)
    sock.linger = 0
    sock.sndhwm = sock.rcvhwm = 4
    result = {"role": role}
    if role == "receive":
        sock.bind(endpoint)
        print("ready", flush=True)
        if not sock.poll(30000):
            raise SystemExit("receive: no sender within 30 s")
        sock.recv()                                   # go
        counting, received = [True], [0]

        def drain():
            while counting[0]:
                if sock.poll(50):
                    frame = sock.recv(copy=False)
                    if counting[0]:
                        received[0] += len(frame.buffer)
        t = threading.Thread(target=drain, daemon=True)
        t.start()
        result["probe_s"] = _probe(int(iterations), workload)
        counting[0] = False
        t.join()
        result["bytes"] = received[0]
    else:
        import numpy as np
        sock.connect(endpoint)
        sock.send(b"go")
        sending = [mode == "stream"]
        payload = np.ones(MESSAGE_BYTES // 4, np.float32)

        sock.sndtimeo = 100                         # blocking sends (no polling of our own to pay for),

        def stream():                               # ... woken every 100 ms to see whether to stop
            while sending[0]:
                try:
                    sock.send(payload, copy=False)
                except zmq.Again:
                    pass
        t = threading.Thread(target=stream, daemon=True)
        t.start()
        result["probe_s"] = _probe(int(iterations), workload)
        sending[0] = False
        t.join()
    ctx.destroy(linger=0)
    print(json.dumps(result), flush=True)


def _pair(endpoint, mode, prefix_receiver, prefix_sender, iterations, workload, timeout=120):
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    me = os.path.abspath(__file__)
    end = lambda role, core: [sys.executable, me, role, endpoint, core, mode, str(iterations), workload]   # noqa: E731
    rx = subprocess.Popen([*prefix_receiver, *end("receive", "0")], env=env, stdout=subprocess.PIPE, text=True)
    tx = None
    try:
        if rx.stdout.readline().strip() != "ready":
            raise RuntimeError("wire CPU probe: the receiver did not start")
        tx = subprocess.Popen([*prefix_sender, *end("send", "1")], env=env, stdout=subprocess.PIPE, text=True)
        out_tx, _ = tx.communicate(timeout=timeout)
        out_rx, _ = rx.communicate(timeout=timeout)
        return json.loads(out_rx.strip().splitlines()[-1]), json.loads(out_tx.strip().splitlines()[-1])
    finally:
        for p in (rx, tx):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def measure(endpoint, prefix_receiver=(), prefix_sender=(), rounds=3, log=print, iterations=WORK_ITERATIONS,
            workload="sgemm"):
    """{"host_cpu_s_per_byte", the rounds' medians and bytes}: see the module's docstring."""
    import numpy as np
    idle, streamed = [], []
    for r in range(rounds):
        idle.append(_pair(endpoint, "idle", prefix_receiver, prefix_sender, iterations, workload))
        streamed.append(_pair(endpoint, "stream", prefix_receiver, prefix_sender, iterations, workload))
        log(f"wire CPU round {r + 1}: idle {idle[-1][0]['probe_s']:.3f}/{idle[-1][1]['probe_s']:.3f} s, streaming "
            f"{streamed[-1][0]['probe_s']:.3f}/{streamed[-1][1]['probe_s']:.3f} s with "
            f"{streamed[-1][0]['bytes'] / 1e6:.0f} MB")
    med = lambda rows, i, key: float(np.median([row[i][key] for row in rows]))   # noqa: E731
    lost = sum(med(streamed, end, "probe_s") - med(idle, end, "probe_s") for end in (0, 1))   # receiver + sender
    moved = med(streamed, 0, "bytes")
    return {"host_cpu_s_per_byte": max(0.0, lost) / moved if moved else 0.0,
            "lost_s": lost, "bytes": moved, "endpoint": endpoint, "rounds": rounds, "workload": workload,
            "idle_probe_s": [med(idle, 0, "probe_s"), med(idle, 1, "probe_s")],
            "streaming_probe_s": [med(streamed, 0, "probe_s"), med(streamed, 1, "probe_s")]}


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] in ("receive", "send"):
        _end(*sys.argv[1:])
    elif len(sys.argv) in (3, 4) and sys.argv[1] == "measure" and sys.argv[3:] in ([], ["sgemm"], ["conv"]):
        out = measure(sys.argv[2], workload=(sys.argv[3:] or ["sgemm"])[0])
        print(json.dumps(out))
        print(f"{out['host_cpu_s_per_byte'] * 1e9:.2f} ns of compute-core CPU per byte moved")
    else:
        sys.exit(__doc__)
