"""Matrix multiply kernels.

`gemm` calls BLAS through `np.dot` inside njit (Numba routes float32 2-D dot
products to SciPy's sgemm/sgemv). `gemm_tiled` is the hand-written
alternative it was measured against (see benchmarks/gemm_variants.py); it is
kept as the reference point for that benchmark, not used by the model.

All arrays are C-contiguous float32.
"""

import numpy as np
from numba import njit, prange

_TILE_N = 256  # columns of b per work item: 256 floats = 1 KiB of each b row
_TILE_M = 8  # rows of a per work item


@njit(nogil=True, cache=True)
def _check(out, a, b_rows, b_cols):
    # out: [M, N], a: [M, K]; b is [K, N] (b_rows=K, b_cols=N)
    m, k = a.shape
    if b_rows != k:
        raise ValueError("gemm: inner dimensions differ (a cols, b rows)", k, b_rows)
    if out.shape[0] != m or out.shape[1] != b_cols:
        raise ValueError("gemm: out shape does not match (rows, cols) wanted", m, b_cols)


@njit(nogil=True, cache=True)
def gemm(out, a, b):
    """out[M, N] = a[M, K] @ b[K, N] via BLAS (sgemm / sgemv)."""
    _check(out, a, b.shape[0], b.shape[1])
    np.dot(a, b, out)


@njit(nogil=True, cache=True)
def gemm_bt(out, a, bt):
    """out[M, N] = a[M, K] @ bt[N, K].T, b given transposed.

    For the LM head with tied embeddings: logits[T, V] = x[T, H] @ E[V, H].T.
    `bt.T` is an F-contiguous view, which Numba hands to BLAS with a
    transpose flag: no copy, no performance warning.
    """
    _check(out, a, bt.shape[1], bt.shape[0])
    np.dot(a, bt.T, out)


@njit(nogil=True, cache=True, parallel=True, fastmath=True)
def gemm_tiled(out, a, b):
    """out[M, N] = a[M, K] @ b[K, N], hand-written: tiles of rows x columns
    in parallel, each accumulating a row of b scaled by a[i, k] (the inner
    loop runs over contiguous columns and vectorizes)."""
    _check(out, a, b.shape[0], b.shape[1])
    m, k = a.shape
    n = b.shape[1]
    n_tiles_n = (n + _TILE_N - 1) // _TILE_N
    n_tiles_m = (m + _TILE_M - 1) // _TILE_M
    for tile in prange(n_tiles_m * n_tiles_n):
        i0 = (tile // n_tiles_n) * _TILE_M
        j0 = (tile % n_tiles_n) * _TILE_N
        i1 = min(i0 + _TILE_M, m)
        j1 = min(j0 + _TILE_N, n)
        acc = np.zeros((i1 - i0, j1 - j0), dtype=np.float32)
        for kk in range(k):
            brow = b[kk, j0:j1]
            for i in range(i1 - i0):
                aik = a[i0 + i, kk]
                for j in range(j1 - j0):
                    acc[i, j] += aik * brow[j]
        out[i0:i1, j0:j1] = acc
