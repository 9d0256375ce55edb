"""C += A @ B in one sgemm call (beta = 1), in the BLAS numpy itself was built against.

Why: numpy's matmul has no beta, so a sum of GEMMs (the shifted conv path's kernel rows) lands
each product in a temporary and adds it in: one more pass over the output per term. On the
paper's conv2 with a quarter of the kernels that pass over dX's (rows, C*kw) windows is ~5% of a
worker's step and does not shrink with its share. sgemm with beta = 1 adds while it stores.

How: threadpoolctl names the BLAS library numpy loaded; its cblas_sgemm is called through
ctypes (which releases the GIL, like numpy's own call, so a worker's heartbeat thread keeps
running). Only symbols whose integer width is certain are used: OpenBLAS's 64-bit-suffixed
names (numpy's wheels ship `scipy_cblas_sgemm64_`), or plain `cblas_sgemm` of an OpenBLAS whose
config says whether it uses 64-bit integers. The first call is checked against numpy on a small
product. Anything else (another BLAS, a failed check) gives None, and the caller falls back to
matmul into a temporary plus an add: the same result, one pass slower. `threads` limits set with
threadpoolctl apply here too: it is the same library.
"""
import ctypes
import os

import numpy as np
from threadpoolctl import threadpool_info

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112

# (symbol, integer type); tried in order on the library numpy uses
_SUFFIXED = [("scipy_cblas_sgemm64_", ctypes.c_int64), ("cblas_sgemm64_", ctypes.c_int64)]


def operand_layout(name, a):
    """(transposed, leading dimension) of a 2-D view that is row-major (transposed False) or a
    transposed view of a row-major block (True), as a row-major GEMM takes its operands."""
    item = a.itemsize
    if a.strides[1] == item and a.strides[0] >= max(1, a.shape[1]) * item:
        return False, a.strides[0] // item
    if a.strides[0] == item and a.strides[1] >= max(1, a.shape[0]) * item:
        return True, a.strides[1] // item
    raise ValueError(f"{name} with strides {a.strides!r} is neither row- nor column-contiguous")


def gemm_operands(name, a, b, c, beta, dtype=np.float32):
    """The checks of a GEMM c = a @ b + beta * c on 2-D views (a and b of `dtype`, c float32 and
    writeable row-contiguous) that a BLAS takes as they are. -> None where nothing is left to
    multiply (an empty product; c scaled by beta where k is 0), else (m, n, k, (a transposed, lda),
    (b transposed, ldb), ldc). Raises ValueError naming the operand and what was expected."""
    for label, v, want in (("a", a, dtype), ("b", b, dtype), ("c", c, np.float32)):
        if not isinstance(v, np.ndarray) or v.dtype != want or v.ndim != 2:
            raise ValueError(f"{name}: {label} must be a 2-D {np.dtype(want).name} view, got "
                             f"{getattr(v, 'dtype', type(v).__name__)} with shape {getattr(v, 'shape', None)!r}")
    m, k = a.shape
    k2, n = b.shape
    if k != k2 or c.shape != (m, n):
        raise ValueError(f"{name} shapes do not chain: a {a.shape!r} @ b {b.shape!r} into c {c.shape!r}")
    if c.strides[1] != c.itemsize or c.strides[0] < max(1, n) * c.itemsize or not c.flags.writeable:
        raise ValueError(f"{name}: c must be a writeable row-contiguous view, got strides {c.strides!r}")
    if m == 0 or n == 0:
        return None
    if k == 0:
        c *= np.float32(beta)
        return None
    return m, n, k, operand_layout("a", a), operand_layout("b", b), c.strides[0] // c.itemsize


class AccumulatingSgemm:
    """`sgemm(a, b, c, beta)`: c = a @ b + beta * c for float32 2-D views whose last or first
    stride is one element (any transposed view of a C-contiguous block qualifies); c must be
    row-contiguous. Shapes are checked; a view BLAS cannot take raises ValueError."""

    def __init__(self, function, int_type, library):
        self._function = function
        self._int = int_type
        self.library = library
        function.restype = None
        function.argtypes = ([ctypes.c_int] * 3 + [int_type] * 3 + [ctypes.c_float, ctypes.c_void_p, int_type,
                             ctypes.c_void_p, int_type, ctypes.c_float, ctypes.c_void_p, int_type])

    def __call__(self, a, b, c, beta=1.0):
        call = gemm_operands("sgemm", a, b, c, beta)
        if call is None:
            return c
        m, n, k, (a_t, lda), (b_t, ldb), ldc = call
        self._function(_ROW_MAJOR, _TRANS if a_t else _NO_TRANS, _TRANS if b_t else _NO_TRANS, m, n, k, 1.0,
                       a.ctypes.data, lda, b.ctypes.data, ldb, beta, c.ctypes.data, ldc)
        return c


def _numpy_blas_path():
    """The BLAS numpy's wheel bundles (numpy.libs/ beside numpy/), else the first one loaded: a
    process that also imported torch has torch's OpenBLAS loaded too."""
    numpy_root = os.path.dirname(os.path.dirname(os.path.abspath(np.__file__)))
    found = [(info["filepath"], info.get("internal_api")) for info in threadpool_info()
             if info.get("user_api") == "blas" and info.get("filepath")]
    numpy_own = [f for f in found if os.path.abspath(f[0]).startswith(os.path.join(numpy_root, "numpy"))]
    return (numpy_own or found or [(None, None)])[0]


def _find(library_path, internal_api):
    lib = ctypes.CDLL(library_path)
    for symbol, int_type in _SUFFIXED:
        if hasattr(lib, symbol):
            return getattr(lib, symbol), int_type
    if internal_api == "openblas" and hasattr(lib, "cblas_sgemm") and hasattr(lib, "openblas_get_config"):
        config = lib.openblas_get_config
        config.restype = ctypes.c_char_p
        wide = b"USE64BITINT" in (config() or b"")
        return lib.cblas_sgemm, ctypes.c_int64 if wide else ctypes.c_int32
    return None, None


def _self_check(sgemm):
    """A small product with every transpose combination and beta 0 and 1, against numpy."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((5, 7)).astype(np.float32)
    b = rng.standard_normal((7, 3)).astype(np.float32)
    c0 = rng.standard_normal((5, 3)).astype(np.float32)
    for a_view in (a, np.ascontiguousarray(a.T).T):
        for b_view in (b, np.ascontiguousarray(b.T).T):
            for beta in (0.0, 1.0):
                c = c0.copy()
                sgemm(a_view, b_view, c, beta)
                want = a.astype(np.float64) @ b + beta * c0
                if not np.allclose(c, want, rtol=1e-5, atol=1e-5):
                    return False
    return True


_cached = None


def accumulating_sgemm():
    """The BLAS's sgemm with beta, or None where it cannot be found or fails its check."""
    global _cached
    if _cached is None:
        _cached = False
        try:
            path, api = _numpy_blas_path()
            if path:
                function, int_type = _find(path, api)
                if function is not None:
                    sgemm = AccumulatingSgemm(function, int_type, path)
                    if _self_check(sgemm):
                        _cached = sgemm
        except (OSError, AttributeError, ValueError):
            _cached = False
    return _cached or None
