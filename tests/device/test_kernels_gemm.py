import numpy as np
import pytest

from device.kernels.gemm import gemm, gemm_bt

SHAPES = [(1, 1, 1), (1, 37, 53), (7, 129, 300), (33, 64, 257)]


def _ab(m, k, n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_gemm_matches_numpy(m, k, n):
    a, b = _ab(m, k, n)
    out = np.full((m, n), np.nan, np.float32)
    gemm(out, a, b)
    np.testing.assert_allclose(out, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_gemm_bt_matches_numpy_with_transposed_b(m, k, n):
    a, b = _ab(m, k, n)
    bt = np.ascontiguousarray(b.T)
    out = np.full((m, n), np.nan, np.float32)
    gemm_bt(out, a, bt)
    np.testing.assert_allclose(out, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)


def test_gemm_rejects_mismatched_inner_dimension():
    a = np.zeros((2, 3), np.float32)
    b = np.zeros((4, 5), np.float32)
    with pytest.raises(ValueError, match="inner dimensions"):
        gemm(np.zeros((2, 5), np.float32), a, b)


def test_gemm_rejects_wrong_out_shape():
    a, b = _ab(2, 3, 5)
    with pytest.raises(ValueError, match="out shape"):
        gemm(np.zeros((2, 4), np.float32), a, b)


def test_gemm_and_gemm_bt_are_callable_from_njit_code():
    from numba import njit

    @njit
    def two_layers(out1, out2, x, w1, w2t):
        gemm(out1, x, w1)
        gemm_bt(out2, out1, w2t)

    x, w1 = _ab(3, 5, 7)
    w2t = np.random.default_rng(1).standard_normal((4, 7), dtype=np.float32)
    out1 = np.empty((3, 7), np.float32)
    out2 = np.empty((3, 4), np.float32)
    two_layers(out1, out2, x, w1, w2t)
    np.testing.assert_allclose(out2, (x.astype(np.float64) @ w1) @ w2t.T, rtol=1e-4, atol=1e-4)
