"""One module per `--device` kind, found by name: `cpu` is devices/cpu.py, `cuda:N` is devices/cuda.py.

Only the worker (and the local trainer) imports a device module, after parsing `--device`, so a
host that never runs a GPU worker never imports CUDA.
"""
import importlib
import importlib.util
import re
from dataclasses import dataclass

from hetconv.devices.base import Device, DeviceError

__all__ = ["Device", "DeviceError", "DeviceEntry", "cuda_extra_missing", "open_device", "parse_device",
           "parse_device_list"]

CUDA_PACKAGE = "numba_cuda"         # what the cuda extra installs (numba's own numba.cuda is not enough)
CUDA_INSTALL = "pip install 'hetconv[cuda]' (in a checkout: pip install -e '.[cuda]')"

_DEVICE_RE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")


def parse_device(spec):
    """'cpu' -> ('cpu', None); 'cuda:1' -> ('cuda', 1); anything else raises DeviceError."""
    m = _DEVICE_RE.match(str(spec).strip())
    if not m or (m.group(1) == "cpu" and m.group(2) is not None):
        raise DeviceError(f"unknown device {spec!r}: expected 'cpu' or 'cuda:N' (N a GPU index, e.g. cuda:0)")
    kind, index = m.group(1), m.group(2)
    return kind, (int(index) if index is not None else (0 if kind == "cuda" else None))


def cuda_extra_missing(requested):
    """The line that says how to install CUDA support when `requested` (e.g. 'cuda:0') cannot run
    for want of it, else ''. Finds the package without importing it: a coordinator needs no CUDA."""
    if importlib.util.find_spec(CUDA_PACKAGE) is None:
        return f"{requested} needs hetconv's CUDA extra, which is not installed: {CUDA_INSTALL}"
    return ""


def open_device(spec="cpu", **options):
    """Open a device by its string, e.g. open_device('cpu', threads=2) or open_device('cuda:0')."""
    kind, index = parse_device(spec)
    missing = cuda_extra_missing(spec) if kind == "cuda" else ""
    if missing:
        raise DeviceError(missing)
    try:
        module = importlib.import_module(f"hetconv.devices.{kind}")
    except ImportError as e:
        # numba's built-in numba.cuda imports without the extra, then a submodule is missing
        if kind != "cuda" or (e.name or "").split(".")[0] not in ("numba", "numba_cuda", "cuda"):
            raise
        raise DeviceError(f"{spec} needs hetconv's CUDA extra, which is missing or incomplete "
                          f"(no module {e.name}): {CUDA_INSTALL}") from None
    return module.open(index=index, **options)


@dataclass(frozen=True)
class DeviceEntry:
    """One entry of a device list: `device` is 'cpu' or 'cuda:N'; `threads` is set by cpu:THREADS;
    `profile` is the path of a saved profile (@FILE) instead of a device; `count` repeats it."""
    device: str
    threads: int | None = None
    count: int = 1
    profile: str = ""

    @property
    def label(self):
        if self.profile:
            return "@" + self.profile
        return f"{self.device}:{self.threads}" if self.threads else self.device


_COUNT_RE = re.compile(r"^(.*?)x(\d+)$")
_CPU_THREADS_RE = re.compile(r"^cpu:(\d+)$")


def parse_device_list(flag, text, allow_profiles=False):
    """The one device-list syntax of `--spawn` and `hetconv-plan --devices`: a comma list of
    cpu, cpu:THREADS, cuda:N (and @PROFILE.json where allowed), each optionally followed by xCOUNT.
    'cpu:1x4,cuda:0' -> [DeviceEntry('cpu', 1, 4), DeviceEntry('cuda:0')]. Raises DeviceError
    naming the entry. A path may contain 'x': only a trailing x<digits> is a count."""
    expected = "cpu, cpu:THREADS, cuda:N" + (" or @PROFILE.json" if allow_profiles else "")
    items = [t.strip() for t in str(text).split(",")]
    if not any(items):
        raise DeviceError(f"{flag} needs at least one device, e.g. {flag} cpu,cpu")
    entries = []
    for item in items:
        if not item:
            raise DeviceError(f"{flag} {text!r} has an empty entry: expected a comma list of {expected}")
        head, count = item, 1
        m = _COUNT_RE.match(item)
        if m and m.group(1):
            head, count = m.group(1), int(m.group(2))
            if count < 1:
                raise DeviceError(f"{flag} entry {item!r}: the count after x must be >= 1")
        if head.startswith("@"):
            if not allow_profiles or len(head) == 1:
                raise DeviceError(f"{flag} entry {item!r}: expected {expected}, optionally followed by xCOUNT")
            entries.append(DeviceEntry(device="", count=count, profile=head[1:]))
            continue
        cpu = _CPU_THREADS_RE.match(head)
        if cpu:
            threads = int(cpu.group(1))
            if threads < 1:
                raise DeviceError(f"{flag} entry {item!r}: a CPU device needs at least 1 thread")
            entries.append(DeviceEntry("cpu", threads, count))
            continue
        try:
            kind, index = parse_device(head)
        except DeviceError:
            raise DeviceError(f"{flag} entry {item!r}: expected {expected}, optionally followed by xCOUNT "
                              f"(e.g. cpu:1x4)") from None
        entries.append(DeviceEntry("cpu" if kind == "cpu" else f"cuda:{index}", None, count))
    return entries
