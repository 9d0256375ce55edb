"""hetconv: train CNNs across mixed CPUs and GPUs by splitting each conv layer's kernels in
proportion to measured device speed; the fully connected layers stay on the coordinator.

From Python (hetconv.api): train, load, load_dataset, and the Run and Model they return.
"""
from hetconv import runtimes as _runtimes

__version__ = "0.1.0"
# before any module here imports Numba or loads oneDNN: the settings that decide how reductions split
_runtimes.pin()

# The API is loaded on first use: it imports the commands, the coordinator and Numba, which a
# process importing any other hetconv module (a worker, a data reader) must not pay for.
API = ("train", "load", "load_dataset", "Model", "Run", "Interrupted", "FlagError")
__all__ = ["__version__", *API]


def __getattr__(name):
    if name in API:
        from hetconv import api
        return getattr(api, name)
    raise AttributeError(f"module 'hetconv' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(API))
