"""Restricted unpickling for data files that are pickles (CIFAR-10 and CIFAR-100).

Unpickling runs whatever callable the file names, so these files are read with an unpickler that
admits only what plain containers and numpy arrays need and refuses everything else before it is
called.
"""

from __future__ import annotations

import pickle
import struct

import numpy as np

from hetconv.data.base import DataError

# The numpy callables an array pickle names, resolved from numpy itself rather than by import:
# numpy 1.x files say numpy.core.multiarray, numpy 2.x files say numpy._core.multiarray, and
# importing numpy.core on numpy 2 only to find the same function warns.
_reconstruct = np.ndarray.__reduce__(np.zeros(1, np.uint8))[0]
_scalar = np.uint8(0).__reduce__()[0]
_frombuffer = np.zeros(1, np.uint8).__reduce_ex__(5)[0]    # what protocol 5 pickles name


def _latin1_encode(text, encoding="latin1"):
    # Python 3 pickles bytes at protocol <= 2 as _codecs.encode(str, "latin1"). codecs.encode
    # with another codec name is not needed by any array file, so only latin-1 is let through.
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise pickle.UnpicklingError(f"_codecs.encode is only allowed for latin1 text, "
                                     f"got encoding {encoding!r}")
    return text.encode("latin1")


_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy.core.multiarray", "scalar"): _scalar,
    ("numpy._core.multiarray", "scalar"): _scalar,
    ("numpy.core.numeric", "_frombuffer"): _frombuffer,
    ("numpy._core.numeric", "_frombuffer"): _frombuffer,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): _latin1_encode,
}


class _DataUnpickler(pickle.Unpickler):
    """Unpickler for data files: plain containers and numpy arrays, nothing that runs code."""

    def __init__(self, file, source: str):
        # encoding="bytes": the official files were pickled by Python 2, whose str is bytes.
        super().__init__(file, encoding="bytes")
        self.source = source

    def find_class(self, module, name):
        allowed = _ALLOWED_GLOBALS.get((module, name))
        if allowed is None:
            raise DataError(f"{self.source}: refusing to unpickle {module}.{name}: only plain "
                            f"containers and numpy arrays are allowed")
        return allowed

    def persistent_load(self, pid):
        raise DataError(f"{self.source}: refusing a persistent id in the pickle: only plain "
                        f"containers and numpy arrays are allowed")


def restricted_load(stream, source: str, what: str = "CIFAR-10"):
    """The object pickled in `stream` (a file named `source`), or DataError naming it."""
    try:
        return _DataUnpickler(stream, source).load()
    except DataError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError,
            AttributeError, struct.error, UnicodeDecodeError, OverflowError, MemoryError) as e:
        raise DataError(f"{source}: not a readable {what} pickle (truncated or a different "
                        f"file?): {type(e).__name__}: {e}") from None
