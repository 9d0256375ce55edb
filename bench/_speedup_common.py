"""Shared by bench/speedup.py and bench/bandwidth.py: run ONE training configuration in a fresh
process, time it, and predict it with the cost model.

    python bench/_speedup_common.py '{"devices": ["local"], "batch_size": 32, "local": true, ...}' OUT.json

Why a process per configuration: numba and BLAS thread counts are process-global and read at
import, so the single-device baseline must start in a process pinned to one core before numpy is
imported; a fresh process also keeps one configuration's JIT caches and heap out of the next.

Definitions (per worker, per step, medians over the timed steps):
- compute_s: the seconds the worker itself reported computing (sum over the step's requests).
- wire_s:    roundtrip_s - compute_s: the time its requests and replies spent outside its compute
             (serialization, the transfer itself, socket queues, the coordinator picking the reply up).
- wait_s:    step_s - roundtrip_s: the time the worker had nothing in flight: the coordinator's
             own work (FC layers, loss, concat, dX sum) and waiting for the slower workers.
- sent/recv: bytes coordinator -> worker and worker -> coordinator.
"""
import json
import os
import sys
import time
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))


def _cost_prediction(specs, fc, image, batch, counts, profiles, link, n_workers, local_profile=None,
                     exchange="peer", micro_batches=1, wire="float32", coordinator_s=None):
    from hetconv.engine import costmodel as cm, steptasks
    from hetconv.engine.measure import measure_coordinator_s
    from hetconv.transport.wire import value_bytes
    if coordinator_s is None:
        coordinator_s = measure_coordinator_s(specs, fc, image, batch, n_workers,
                                              exchange=exchange if local_profile is None else "star")
    if local_profile is not None:
        return {"step_s": cm.predict_local(specs, batch, local_profile, coordinator_s),
                "coordinator_s": coordinator_s, "workers": {}}
    pred = steptasks.predict_any(exchange, specs, image, batch, counts, profiles, link, coordinator_s, micro_batches,
                          value_bytes(wire))
    out = pred.to_json()
    out["dominant"] = list(cm.dominant_term(pred))
    return out


def model_link(name, framing="ethernet", wire_cpu_s_per_byte=0.0):
    """The cost model's link for a row: 'loopback' (measured here) or a tc rate ('tbf' framing:
    the rate is what tc shapes to, else an Ethernet line rate), with what moving a byte costs the
    hosts' compute cores where they share them (bench/_wire_cpu.py)."""
    from hetconv.engine import costmodel as cm
    if name == "loopback":
        from hetconv.engine.measure import measure_loopback
        link = cm.Link(measure_loopback(), name="loopback (measured)")
    else:
        link = cm.parse_bandwidth(name, framing=cm.TBF_FRAMING if framing == "tbf" else cm.ETHERNET_FRAMING)
    return replace(link, host_cpu_s_per_byte=float(wire_cpu_s_per_byte))


def bracket(before, after, kernels, batch):
    """One device's profiles from calibrations before a row's steps and after them -> (what the
    model gets: their element-wise mean; the drift: after/before of its forward + backward at
    `kernels` per layer on `batch` images, > 1 where the host slowed down meanwhile)."""
    from dataclasses import astuple

    from hetconv.engine.costmodel import LayerCost
    seconds = lambda profile: sum(c.forward_s(k, batch) + c.backward_s(k, batch)   # noqa: E731
                                  for c, k in zip(profile.layers, kernels))
    mean = replace(before, layers=tuple(LayerCost(*[(x + y) / 2 for x, y in zip(astuple(a), astuple(b))])
                                        for a, b in zip(before.layers, after.layers)))
    return mean, seconds(after) / seconds(before)


def run_one(spec):
    """spec keys: tag, devices (device strings), local (in-process baseline), batch_size, warmup, steps, split,
    pin (cores for the local baseline), bind / external (namespace runs), link (cost-model link:
    'loopback' or a tc rate), link_framing ('tbf': the rate is tc's), wire_cpu_s_per_byte
    (Link.host_cpu_s_per_byte), calibration_batch, out_dir; for the local engine also threads (its CPU
    device's threads, default 1), conv_path (its cpu_conv_path, default "auto") and predict (False: no
    cost-model prediction, so no calibration before and after the steps; default True)."""
    if spec.get("pin") is not None:
        os.sched_setaffinity(0, set(spec["pin"]))        # before numpy/numba start any thread pool
    import numpy as np
    from threadpoolctl import threadpool_limits

    from hetconv.engine import costmodel as cm
    from hetconv.engine import measure as planning
    from hetconv.engine.policy import PlanSettings
    from hetconv.training.config import Config
    from hetconv.geometry import conv_specs, layer_input_shapes
    from hetconv.training.loop import train

    threads, conv_path = int(spec.get("threads", 1)), spec.get("conv_path", "auto")
    predict = spec.get("predict", True)
    threadpool_limits(threads)   # the coordinator's own BLAS (FC layers) runs on the device's threads, as --local's
    devices, batch = spec["devices"], spec["batch_size"]
    warmup, timed = spec["warmup"], spec["steps"]
    metrics = os.path.join(spec["out_dir"], f"metrics-{spec['tag']}.jsonl")
    cfg = Config(conv=spec.get("conv", "500,1500"), fc=spec.get("fc", "256"), batch_size=batch,
                 steps=warmup + timed, threads=threads, split=spec["split"], synthetic_train=batch * (warmup + timed),
                 synthetic_test=batch, eval_batches=1, calibration_batch=spec.get("calibration_batch", 16),
                 metrics=metrics, exchange=spec.get("exchange", "peer"), micro_batches=spec.get("micro_batches", 0),
                 wire_dtype=spec.get("wire", "float32"), cpu_conv_path=conv_path,
                 # the split under test is the calibrated one (the model predicts from the same
                 # calibration); training's own correction after a few steps is measured apart
                 rebalance_after=spec.get("rebalance_after", 0)).validate()
    specs = conv_specs(cfg.conv_kernels(), cfg.ksize, cfg.padding)
    image = cfg.image_shape()
    cal_shapes = [(min(cfg.calibration_batch, batch),) + s[1:] for s in layer_input_shapes(specs, batch, image)[0]]
    logs = []
    log = lambda msg: (logs.append(str(msg)), print(f"    | {msg}", flush=True))   # noqa: E731
    engine = None
    row = {"tag": spec["tag"], "set": spec.get("set", ""), "devices": devices, "batch_size": batch, "split": spec["split"],
           "warmup_steps": warmup, "timed_steps": timed, "threads": threads, "conv_path": conv_path}
    t_start = time.perf_counter()
    try:
        if spec.get("local"):
            from hetconv.devices import open_device
            from hetconv.devices.cpu_options import CpuOptions
            from hetconv.engine.local import LocalEngine
            from hetconv.engine.shard import ConvShard
            # with this machine's wisdom, as `hetconv-coordinator --local` opens it: without it the
            # baseline timed its conv paths again in every run (the paper network: 50 s a run)
            device = open_device("cpu", **CpuOptions(conv_path=conv_path, use_wisdom=True).device_options(threads))
            engine = LocalEngine({"local": ConvShard(device)})
        else:
            from hetconv.coordinator.remote import RemoteEngine
            engine = RemoteEngine(spec.get("bind", "tcp://127.0.0.1:0"), spec.get("external", 0),
                                  [] if spec.get("external") else devices, threads=1, pin=True,
                                  connect_timeout=spec.get("connect_timeout", 120.0), log=log,
                                  exchange=cfg.exchange, wire=cfg.wire_dtype)
        if spec.get("local") and predict:   # the baseline's first calibration, before its steps
            t0 = time.perf_counter()
            local_before = planning.calibrate_local("cpu", specs, cal_shapes, [s.kernels for s in specs], threads=threads)
            local_calibration_s = time.perf_counter() - t0
        summary = train(cfg, engine, log=log)
        micro = engine.run_micro_batches(cfg.micro_batches, cfg.batch_size)
        row.update(exchange=cfg.exchange, micro_batches=micro, wire=cfg.wire_dtype)
        # ---- measured ---------------------------------------------------------------------
        with open(metrics) as f:
            steps = [r for r in map(json.loads, f) if r["event"] == "step"][warmup:]
        step_s = [r["step_s"] for r in steps]
        row["step_s"] = float(np.median(step_s))
        row["step_s_all"] = step_s
        with open(metrics) as f:            # the warm-up steps (an auto device times its paths in the first)
            row["warmup_step_s"] = [r["step_s"] for r in map(json.loads, f) if r["event"] == "step"][:warmup]
        if spec.get("local"):
            row["conv_paths"] = device.describe_conv_paths()
        row["setup_s"] = summary["setup_s"]
        row["calibration_s"] = getattr(engine, "calibration_s", 0.0)
        row["workers"] = {}
        for name in (steps[0]["workers"] if steps else {}):
            med = lambda key: float(np.median([r["workers"][name][key] for r in steps]))   # noqa: E731
            compute, roundtrip = med("compute_s"), med("roundtrip_s")
            row["workers"][name] = {"compute_s": compute, "wire_s": max(0.0, roundtrip - compute),
                                    "wait_s": max(0.0, row["step_s"] - roundtrip), "roundtrip_s": roundtrip,
                                    "sent": int(med("bytes_sent")), "recv": int(med("bytes_recv")),
                                    "peer_sent": int(np.median([r["workers"][name].get("peer_bytes_sent", 0)
                                                                for r in steps]))}
        # ---- predicted (cost model) ---------------------------------------------------------
        # Calibrated before the steps (for the remote rows that made the plan under test) and
        # again after them: the model gets the average, so the host's drift while the row ran
        # moves the prediction as it moved the steps, and the row records how far it drifted.
        if not predict:
            pred = None
        elif spec.get("local"):
            t0 = time.perf_counter()
            after = planning.calibrate_local("cpu", specs, cal_shapes, [s.kernels for s in specs], threads=threads)
            row["calibration_s"] = time.perf_counter() - t0 + local_calibration_s
            profile, drift = bracket(local_before, after, [s.kernels for s in specs], batch)
            row["calibration_drift"] = {"local": drift}
            pred = _cost_prediction(specs, cfg.fc_sizes(), image, batch, None, None, None, 1, local_profile=profile)
            row["profile_source"] = (f"calibrate_local in the baseline's process ({threads} thread(s), all kernels "
                                     f"and half), before and after the timed steps, averaged")
            row["profiles"] = {"local": profile.to_json()}
            row["plan"] = None
        else:
            row["calibration_before"] = engine.calibration
            before = cm.profiles_from_calibration(engine.calibration)
            engine.calibrate(specs, layer_input_shapes(specs, batch, image)[0], PlanSettings.of(cfg))
            after = cm.profiles_from_calibration(engine.calibration)
            counts = engine.plan.counts()
            bracketed = {w: bracket(before[w], after[w], counts[w], batch) for w in counts}
            profiles = {w: profile for w, (profile, _) in bracketed.items()}
            row["calibration_drift"] = {w: drift for w, (_, drift) in bracketed.items()}
            link = model_link(spec.get("link", "loopback"), spec.get("link_framing", "ethernet"),
                              spec.get("wire_cpu_s_per_byte", 0.0))
            predict_with = lambda profiles, coordinator_s=None: _cost_prediction(   # noqa: E731
                specs, cfg.fc_sizes(), image, batch, counts, profiles, link, len(counts), exchange=cfg.exchange,
                micro_batches=micro, wire=cfg.wire_dtype, coordinator_s=coordinator_s)
            pred = predict_with(profiles)
            row["predicted_step_s_first_calibration"] = predict_with(before, pred["coordinator_s"])["step_s"]
            row["profile_source"] = ("the workers' own calibration in this run (RemoteEngine.calibration), before "
                                     "and after the timed steps, averaged")
            row["profiles"] = {w: p.to_json() for w, p in profiles.items()}
            row["plan"] = engine.plan.to_json()
            row["counts"] = counts
            row["link"] = {"name": link.name, "bytes_per_s": link.bytes_per_s, "latency_s": link.latency_s,
                           "host_cpu_s_per_byte": link.host_cpu_s_per_byte}
            row["calibration"] = engine.calibration          # the one after the steps
        if pred is not None:
            row["predicted_step_s"] = pred["step_s"]
            row["prediction"] = pred
            row["model_error_pct"] = 100.0 * (pred["step_s"] - row["step_s"]) / row["step_s"]
        row["ok"] = True
    except Exception as e:          # the row records the failure; the benchmark goes on
        import traceback
        row["ok"] = False
        row["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    finally:
        if engine is not None:
            engine.close()
    row["wall_s"] = time.perf_counter() - t_start
    row["log"] = logs[-20:]
    return row


def drift_text(row):
    """A row's calibration drift for the tables: after/before per device, '' where not measured."""
    drift = row.get("calibration_drift") or {}
    return ", ".join(f"{v:.2f}" for v in drift.values())


# ---- the parent side -------------------------------------------------------------------------

def run_in_subprocess(spec, prefix=(), timeout=1800):
    """Run one configuration in a fresh Python (optionally under `prefix`, e.g. ip netns exec);
    returns its row. The child's process group is ended on every exit path."""
    import subprocess
    out = os.path.join(spec["out_dir"], f"row-{spec['tag']}.json")
    n = str(spec.get("threads", 1))        # BLAS pools sized at import: the row's own thread count
    env = dict(os.environ, OPENBLAS_NUM_THREADS=n, OMP_NUM_THREADS=n, MKL_NUM_THREADS=n)
    cmd = [*prefix, sys.executable, os.path.abspath(__file__), json.dumps(spec), out]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            _kill_group(proc)
    if not os.path.exists(out):
        return {**{k: spec.get(k) for k in ("tag", "set", "devices", "batch_size", "split")}, "ok": False,
                "error": f"runner exited with code {proc.returncode} and wrote no row"}
    with open(out) as f:
        return json.load(f)


def ddp_row(procs, out):
    """Wait for DDP ranks (killing what is left if the wait fails) and return the row rank 0
    wrote to `out`, or a failed row naming the ranks' exit codes."""
    try:
        for p in procs:
            p.wait(timeout=1800)
    finally:
        for p in procs:
            if p.poll() is None:
                _kill_group(p)
    if not os.path.exists(out):
        return {"ok": False, "error": f"ranks exited with {[p.returncode for p in procs]} and wrote no row"}
    with open(out) as f:
        return json.load(f)


def _kill_group(proc):
    import signal
    import subprocess
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


class CoRunner:
    """A CPU-bound process pinned to `core` (pure-Python busy loop), to make that core slower for
    whoever shares it. Use as a context manager: it is killed on every exit path."""

    def __init__(self, core):
        self.core, self.proc = core, None

    def __enter__(self):
        import subprocess
        code = f"import os\nos.sched_setaffinity(0, {{{self.core}}})\nx = 0\nwhile True:\n    x += 1\n"
        self.proc = subprocess.Popen([sys.executable, "-c", code])
        return self

    def __exit__(self, *exc):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class ForeignLoad:
    """How many cores' worth of CPU time processes other than ours used during a block: busy time
    from /proc/stat (steal included) minus the CPU time of our reaped children. The machine is
    shared; a row measured while something else ran says so."""

    def __enter__(self):
        self.t0, self.busy0, self.ours0 = time.perf_counter(), _busy_s(), _ours_s()
        return self

    def __exit__(self, *exc):
        wall = max(1e-9, time.perf_counter() - self.t0)
        self.cores = max(0.0, (_busy_s() - self.busy0) - (_ours_s() - self.ours0)) / wall


def _busy_s():
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return (sum(v[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _ours_s():
    import resource
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def machine():
    sys.path.insert(0, HERE)
    from _common import cpu_model
    return cpu_model()


def fmt_row(r):
    if not r.get("ok"):
        return f"FAILED: {r.get('error')}"
    predicted = (f", predicted {r['predicted_step_s']:.3f}s ({r['model_error_pct']:+.1f}%)"
                 if "predicted_step_s" in r else "")
    return (f"step {r['step_s']:.3f}s (steps {', '.join(f'{s:.2f}' for s in r['step_s_all'])}){predicted}, "
            f"calibration {r['calibration_s']:.1f}s, setup {r['setup_s']:.1f}s")


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    row = run_one(spec)
    tmp = sys.argv[2] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(row, f)
    os.replace(tmp, sys.argv[2])
    sys.exit(0 if row["ok"] else 1)
