"""AMX's strips (attention's blocks on AMX) against numpy: `interleave_rows` lays two rows as
one row of AMX's B layout (on any host: no AMX instruction), `amx_strips` multiplies 16-row
tiles of bfloat16 values exactly into float32 (only where the host's level is `amx`)."""

import numpy as np
import pytest
from numba import njit

from spyre_serve.device.isa import current
from spyre_serve.device.kernels.gemm.amx import amx_release, amx_strips, interleave_rows
from spyre_serve.device.layout import to_bf16_bits

needs_amx = pytest.mark.skipif(current().level != "amx", reason="the host's level has no AMX")


@njit(cache=True)
def _interleave(dst, src, a_off, b_off, n):
    interleave_rows(dst, 0, src, a_off, b_off, n)


@njit(cache=True)
def _strips(a, lda, row_tiles, b, ldb, kt, nt, c, ldc, accumulate):
    for n0 in range(0, nt, 4):
        amx_strips(a, 0, lda, row_tiles, b, 64 * n0, ldb, kt, min(4, nt - n0), c, 64 * n0, ldc,
                   accumulate)
    amx_release()


def pairs(b: np.ndarray) -> np.ndarray:
    """[K, N] -> AMX's B layout [K / 2, N, 2]: rows 2r and 2r + 1 interleaved."""
    k, n = b.shape
    return np.ascontiguousarray(b.reshape(k // 2, 2, n).transpose(0, 2, 1)).reshape(k // 2, 2 * n)


@pytest.mark.parametrize("n", [32, 64, 40, 7, 16, 53])
def test_interleave_rows_lays_two_rows_as_pairs(n):
    src = np.arange(3 * n, dtype=np.uint16) + 1
    dst = np.zeros(2 * n, np.uint16)
    _interleave(dst, src, n, 2 * n, n)
    np.testing.assert_array_equal(dst, pairs(src[n:].reshape(2, n)).ravel())


def test_interleave_rows_reads_zeros_for_a_negative_offset():
    src = np.arange(64, dtype=np.uint16) + 1
    dst = np.full(128, 9, np.uint16)
    _interleave(dst, src, 0, -1, 64)
    np.testing.assert_array_equal(dst[0::2], src)
    assert not dst[1::2].any()
    _interleave(dst, src, -1, -1, 64)
    assert not dst.any()


def _bf16(rng, shape):
    bits = to_bf16_bits(rng.standard_normal(shape).astype(np.float32))
    return bits, (bits.astype(np.uint32) << 16).view(np.float32)


@needs_amx
@pytest.mark.parametrize("rows,k,n", [(16, 32, 16), (48, 64, 64), (32, 128, 96)])
def test_amx_strips_is_the_float32_product_of_bfloat16_values(rows, k, n):
    rng = np.random.default_rng(rows + k + n)
    a_bits, a = _bf16(rng, (rows, k))
    b_bits, b = _bf16(rng, (k, n))
    c = np.full((rows, n), np.nan, np.float32)
    _strips(a_bits, 2 * k, rows // 16, pairs(b_bits), 4 * n, k // 32, n // 16, c, 4 * n, 0)
    np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)


@needs_amx
def test_amx_strips_adds_to_c_when_accumulating():
    rng = np.random.default_rng(3)
    a_bits, a = _bf16(rng, (32, 64))
    b_bits, b = _bf16(rng, (64, 32))
    c0 = rng.standard_normal((32, 32)).astype(np.float32)
    c = c0.copy()
    _strips(a_bits, 128, 2, pairs(b_bits), 128, 2, 2, c, 128, 1)
    np.testing.assert_allclose(c, c0 + a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)


def test_interleave_rows_rounds_float32_rows_to_bfloat16():
    src = np.random.default_rng(1).standard_normal(80).astype(np.float32)
    dst = np.zeros(80, np.uint16)
    _interleave(dst, src, 0, 40, 40)
    np.testing.assert_array_equal(dst, pairs(to_bf16_bits(src).reshape(2, 40)).ravel())
