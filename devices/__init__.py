"""One module per `--device` kind, found by name: `cpu` is devices/cpu.py, `cuda:N` is devices/cuda.py.

Only the worker (and the local trainer) imports a device module, after parsing `--device`, so a
host that never runs a GPU worker never imports CUDA.
"""
import importlib
import re

from hetconv.devices.base import Device, DeviceError

__all__ = ["Device", "DeviceError", "open_device", "parse_device", "KINDS"]

KINDS = ("cpu", "cuda")
_DEVICE_RE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")


def parse_device(spec):
    """'cpu' -> ('cpu', None); 'cuda:1' -> ('cuda', 1); anything else raises DeviceError."""
    m = _DEVICE_RE.match(str(spec).strip())
    if not m or (m.group(1) == "cpu" and m.group(2) is not None):
        raise DeviceError(f"unknown device {spec!r}: expected 'cpu' or 'cuda:N' (N a GPU index, e.g. cuda:0)")
    kind, index = m.group(1), m.group(2)
    return kind, (int(index) if index is not None else (0 if kind == "cuda" else None))


def open_device(spec="cpu", **options):
    """Open a device by its string, e.g. open_device('cpu', threads=2) or open_device('cuda:0')."""
    kind, index = parse_device(spec)
    module = importlib.import_module(f"hetconv.devices.{kind}")
    return module.open(index=index, **options)
