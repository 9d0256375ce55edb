"""What the CUDA device needs from Numba's CUDA simulator (`NUMBA_ENABLE_CUDASIM=1`), where the
CUDA kernels run as Python threads on a machine without a GPU (the test suite, and workers it
starts). Nothing here runs on a GPU.

The simulator's `cuda.shared.array` finds a block's static array by looking its source line up in
a dict the block's threads share and inserting a new array when absent: a check, then a set. Two
simulated threads switched between the two each get an array of their own, and a reduction
through shared memory then adds half its values (one channel's BatchNorm sums wrong, on a host
busy enough to switch threads there). `dict.setdefault` is one step under the GIL, so every
thread of a block gets one array, as on a GPU. It also skips the simulator's
`traceback.extract_stack` per call.
"""
import sys

import numpy as np


def _shared_array_once_per_block(original):
    from numba.cuda import types as numba_types
    from numba.cuda.np import numpy_support

    def array(self, shape, dtype, alignment=None):
        if alignment is not None or shape == 0:     # refused, or the dynamic array: no lookup
            return original(self, shape, dtype, alignment)
        if isinstance(dtype, numba_types.Type):
            dtype = numpy_support.as_dtype(dtype)
        caller = sys._getframe(1)
        key = caller.f_code.co_filename, caller.f_lineno
        found = self._allocations.get(key)             # the block's array once one thread made it
        return found if found is not None else self._allocations.setdefault(key, np.empty(shape, dtype))

    array.unpatched = original
    return array


def share_static_arrays_per_block():
    """Installs the race-free lookup once per process; only call it under the simulator."""
    from numba.cuda.simulator import kernelapi

    if not hasattr(kernelapi.FakeCUDAShared.array, "unpatched"):
        kernelapi.FakeCUDAShared.array = _shared_array_once_per_block(kernelapi.FakeCUDAShared.array)
