"""Which precision each conv layer ran in under `--precision auto`, per layer, for the run's log
and its metrics (training.loop: after calibration, and after the first step of each plan, where
it changed).

A CPU device chooses a conv path per call shape (devices/cpu.py: its timing takes a bf16 path only
where it is faster), and reports its choices (`conv_path_choices`): the call's shapes (`key`, as
devices.wisdom.call_key writes it), the path, and how many calls have run it (`calls`). Here those
are mapped back to the network's conv layers and said in one line:

    precision auto: conv1 fp32 (im2col-dnnl), conv2 bf16 (direct-bf16), ...

where the devices differ, per device (`conv2 bf16 (direct-bf16) on w0-cpu, fp32 (im2col-dnnl) on
w1-cpu`); a device that ran a layer's call shapes on several paths lists them all (`conv2 mixed
(direct-bf16/im2col-dnnl)`); the line after calibration ends `(calibration's call shapes)`. The
metrics record: `{"event": "precision", "step", "calibration", "layers": [{"layer", "precision",
"paths"}], "bytes"}`, `precision` "bf16", "fp32" or "mixed", `paths` {device: [path, ...]}.

A call shape maps to a layer by the layer's input (C, H, W), kernel (kh, kw), stride and padding:
a worker's share of the kernels (K) and its images (N) are its own, the rest is the layer's. Two
layers of the same shapes run the same paths (a device chooses per call shape), so such a call is
counted for each. A report covers the call shapes whose `calls` grew since the counts before it
(`ran`), so the first step's report says what the step ran, not what calibration timed on its
other shapes (half the batch, half the kernels) nor an evaluation's short last batch. Only CPU
devices report choices: a GPU device runs fp32 and is not listed.
"""
from hetconv.devices.wisdom import canonical, check_call

PATH_LIMIT = 20


def checked_choices(value, limit=64):
    """A device's reported conv path choices, kept only as far as they are well-formed (they come
    from the network): at most `limit` (the latest) of {call, path, why: strings, seconds: {path:
    number}; where given, key: a call key devices.wisdom.check_call accepts, calls: a count; and
    on a direct path kernels: {direction: oneDNN's kernel name}}."""
    kept = []
    for c in value if isinstance(value, list) else []:
        if (isinstance(c, dict) and all(isinstance(c.get(k), str) for k in ("call", "path", "why"))
                and isinstance(c.get("seconds"), dict)):
            choice = {"call": c["call"][:300], "path": c["path"][:PATH_LIMIT], "why": c["why"][:300],
                      "seconds": {str(p)[:PATH_LIMIT]: float(t) for p, t in list(c["seconds"].items())[:16]
                                  if isinstance(t, (int, float)) and not isinstance(t, bool)}}
            if "key" in c and not check_call(c["key"]):
                choice["key"] = c["key"]
            calls = c.get("calls")
            if isinstance(calls, int) and not isinstance(calls, bool) and calls >= 0:
                choice["calls"] = calls
            if isinstance(c.get("kernels"), dict):
                choice["kernels"] = {str(d)[:20]: str(k)[:60] for d, k in list(c["kernels"].items())[:3]
                                     if isinstance(k, str)}
            kept.append(choice)
    return kept[-limit:] if limit else []


def _is_bf16(path):
    return path.endswith("-bf16")


def computed_precision(choices):
    """What a device's conv GEMMs run in, from its conv path choices ([{path, ...}], as a worker
    reports them at calibration): "fp32", "bf16", or "bf16 on N of M call shapes" (`--precision
    auto` where its timing took bf16 on some call shapes only). What the wire of a plan follows
    (engine.policy.wire_for)."""
    bf16 = sum(_is_bf16(c["path"]) for c in choices)
    if bf16 == 0 or bf16 == len(choices):
        return "bf16" if bf16 else "fp32"
    return f"bf16 on {bf16} of {len(choices)} call shapes"


def _precision(paths):
    bf16 = sum(_is_bf16(p) for p in paths)
    return "fp32" if bf16 == 0 else "bf16" if bf16 == len(paths) else "mixed"


class PrecisionReport:
    """What the devices' conv GEMMs ran in, per layer, since their calls were last counted (see the
    module's docstring). `specs`: the network's ConvSpecs; `input_shapes`: each layer's input
    (N, C, H, W)."""

    def __init__(self, specs, input_shapes):
        self.layers = [(f"conv{i + 1}", (tuple(shape[1:]), (spec.kh, spec.kw), tuple(spec.block.stride),
                                         tuple(spec.block.padding)))
                       for i, (spec, shape) in enumerate(zip(specs, input_shapes))]
        self._calls = {}                # device -> {call (canonical): its calls when last counted}
        self.reported = None            # the layers of the last report returned

    @property
    def devices(self):
        """The devices seen so far."""
        return set(self._calls)

    @staticmethod
    def _shape(key):
        """What a call key says of its layer: ((C, H, W), (kh, kw), stride, padding)."""
        x, w = key["x"], key["w"]
        return tuple(x[1:]), tuple(w[2:]), tuple(key["stride"]), tuple(key["padding"])

    def ran(self, devices):
        """{device: [(call's layer shape, path)]}: the choices of `devices` ({device: [choice]})
        whose calls grew since the last call of `ran` (every one that says no count)."""
        out = {}
        for device, choices in devices.items():
            before = self._calls.get(device, {})
            now = {}
            for c in choices:
                key = c.get("key")
                if key is None:
                    continue
                call = canonical(key)
                calls = c.get("calls")
                now[call] = calls
                if calls is None or calls != before.get(call, 0):    # fewer: a new device of that name
                    out.setdefault(device, []).append((self._shape(key), c["path"]))
            self._calls[device] = now
        return out

    def layer_records(self, ran):
        """[{layer, precision, paths: {device: [path, ...]}}] for every layer one of `ran`'s calls
        maps to, in layer order."""
        records = []
        for name, shape in self.layers:
            paths = {}
            for device, calls in ran.items():
                for call_shape, path in calls:
                    if call_shape == shape and path not in paths.setdefault(device, []):
                        paths[device].append(path)
            paths = {d: sorted(p) for d, p in paths.items() if p}
            if paths:
                records.append({"layer": name, "precision": _precision([p for ps in paths.values() for p in ps]),
                                "paths": paths})
        return records

    def update(self, devices):
        """The layer records of what ran since the last update, where any ran and they differ from
        the last ones returned; else None."""
        records = self.layer_records(self.ran(devices))
        if not records or records == self.reported:
            return None
        self.reported = records
        return records


def layer_text(record):
    """`conv2 bf16 (direct-bf16)`, or per device where they differ:
    `conv2 bf16 (direct-bf16) on w0-cpu, fp32 (im2col-dnnl) on w1-cpu`."""
    groups = {}
    for device, paths in record["paths"].items():
        groups.setdefault(tuple(paths), []).append(device)
    if len(groups) == 1:
        (paths,) = groups
        return f"{record['layer']} {_precision(paths)} ({'/'.join(paths)})"
    return f"{record['layer']} " + ", ".join(f"{_precision(paths)} ({'/'.join(paths)}) on {' and '.join(devices)}"
                                             for paths, devices in groups.items())


def precision_line(records, calibration=False):
    """The run's log line: `precision auto: conv1 fp32 (im2col-dnnl), conv2 bf16 (direct-bf16), ...`,
    ending `(calibration's call shapes)` where it says what calibration ran."""
    return ("precision auto: " + ", ".join(layer_text(r) for r in records)
            + (" (calibration's call shapes)" if calibration else ""))
