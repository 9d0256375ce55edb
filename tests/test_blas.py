"""sgemm with beta through the BLAS numpy uses: every operand layout against numpy, bad views named."""
import numpy as np
import pytest
from threadpoolctl import threadpool_info

from hetconv.devices.blas import AccumulatingSgemm, accumulating_sgemm

OPENBLAS = any(i.get("user_api") == "blas" and i.get("internal_api") == "openblas" for i in threadpool_info())


@pytest.fixture(scope="module")
def sgemm():
    found = accumulating_sgemm()
    if found is None:
        assert not OPENBLAS, "numpy's BLAS is OpenBLAS, whose cblas_sgemm must be found"
        pytest.skip("numpy's BLAS is not OpenBLAS: the device adds products from a temporary (tested in test_cpu_device)")
    return found


def test_numpy_wheels_openblas_is_found():
    """The wheels' OpenBLAS (the CI's) is what the fast path exists for: it must not fall back silently."""
    if OPENBLAS:
        assert isinstance(accumulating_sgemm(), AccumulatingSgemm)


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
def test_every_layout_matches_numpy(sgemm, trans_a, trans_b, beta):
    rng = np.random.default_rng(3)
    m, k, n = 37, 53, 29
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    a_view = np.ascontiguousarray(a.T).T if trans_a else a
    b_view = np.ascontiguousarray(b.T).T if trans_b else b
    c = rng.standard_normal((m, n)).astype(np.float32)
    want = a.astype(np.float64) @ b + beta * c
    sgemm(a_view, b_view, c, beta)
    np.testing.assert_allclose(c, want, rtol=1e-4, atol=1e-4)


def test_row_windows_of_a_larger_block(sgemm):
    """The shifted conv path's use: overlapping row windows of one buffer as operand and output."""
    rng = np.random.default_rng(4)
    big = rng.standard_normal((20, 16)).astype(np.float32)
    out = np.zeros((24, 16), np.float32)
    want = np.zeros((24, 16))
    w = rng.standard_normal((5, 16, 16)).astype(np.float32)
    for u in range(5):
        sgemm(big[u:u + 16], w[u], out[u:u + 16], 1.0)
        want[u:u + 16] += big[u:u + 16].astype(np.float64) @ w[u]
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


def test_empty_reduction_scales_by_beta(sgemm):
    c = np.ones((3, 2), np.float32)
    sgemm(np.empty((3, 0), np.float32), np.empty((0, 2), np.float32), c, 0.5)
    np.testing.assert_array_equal(c, 0.5)


@pytest.mark.parametrize("a,b,c,message", [
    (np.ones((3, 4), np.float32), np.ones((5, 2), np.float32), np.ones((3, 2), np.float32), "do not chain"),
    (np.ones((3, 4), np.float32), np.ones((4, 2), np.float32), np.ones((3, 3), np.float32), "do not chain"),
    (np.ones((3, 4)), np.ones((4, 2), np.float32), np.ones((3, 2), np.float32), "a must be a 2-D float32 view"),
    (np.ones((3, 8), np.float32)[:, ::2], np.ones((4, 2), np.float32), np.ones((3, 2), np.float32), "neither row- nor column-contiguous"),
    (np.ones((3, 4), np.float32), np.ones((4, 2), np.float32), np.ones((2, 3), np.float32).T, "c must be a writeable row-contiguous view"),
])
def test_views_blas_cannot_take_are_named(sgemm, a, b, c, message):
    with pytest.raises(ValueError, match=message):
        sgemm(a, b, c)
