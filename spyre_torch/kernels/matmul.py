"""Batched GEMM through BLAS (the card's `gemm`, Numba's np.dot), float32:

    out[i] = alpha * (a[i] @ b[i]) + beta * bias[i]       i < batch; a [m, k], b [k, n]

Each matrix is row-major ("C": row stride = columns, column stride 1) or column-major ("F":
the transpose of a row-major one, e.g. a weight [n, k] read as w.T): BLAS takes either with
a transpose flag, so `x @ w.T` (linear) copies nothing. The host copies any other layout
first. `out` is row-major, batch stride m * n. `bias` (dtype code, or -1 for none) is read
through its strides (0 where broadcast).

One row (a decode step's GEMV) is a loop instead of BLAS: it is bandwidth-bound, as fast on
one core for small matrices (models/step/threads.py measured it; OpenBLAS's thread pool on a
shared 2-core machine can wait a whole time slice for a descheduled worker), and split over
the cores by output columns from GEMV_PARALLEL_BYTES of matrix.
"""

import numpy as np
from numba import njit, prange

from spyre_serve.device.abi import f32_at, get_kernel_threads
from spyre_torch.kernels import MATMUL, index
from spyre_torch.kernels.access import as_float

# a one-row product reads its whole matrix once: from this size (models/step/threads.py's
# BLAS_PARALLEL_WORK_BYTES) the read is split across the cores, below it one core is as fast
GEMV_PARALLEL_BYTES = 16 << 20

_I = index(MATMUL)
BATCH, M, N, K, ALPHA, BETA = _I["batch"], _I["m"], _I["n"], _I["k"], _I["alpha"], _I["beta"]
A, B, OUT, BIAS = _I["a"], _I["b"], _I["out"], _I["bias"]
A_BS, A_RS, A_CS, B_BS, B_RS, B_CS = _I["a_bs"], _I["a_rs"], _I["a_cs"], _I["b_bs"], _I["b_rs"], _I["b_cs"]
BIAS_DT, BIAS_BS, BIAS_RS, BIAS_CS = _I["bias_dt"], _I["bias_bs"], _I["bias_rs"], _I["bias_cs"]


@njit(nogil=True, cache=True)
def _gemm(f32, a, a_rowmajor, b, b_rowmajor, out, m, n, k):
    """out[m, n] = a @ b, each given by its first element and layout."""
    o = f32_at(f32, out, m * n).reshape(m, n)
    if a_rowmajor:
        am = f32_at(f32, a, m * k).reshape(m, k)
        if b_rowmajor:
            np.dot(am, f32_at(f32, b, k * n).reshape(k, n), o)
        else:
            np.dot(am, f32_at(f32, b, k * n).reshape(n, k).T, o)
    else:
        at = f32_at(f32, a, m * k).reshape(k, m).T
        if b_rowmajor:
            np.dot(at, f32_at(f32, b, k * n).reshape(k, n), o)
        else:
            np.dot(at, f32_at(f32, b, k * n).reshape(n, k).T, o)


@njit(nogil=True, cache=True, fastmath={"reassoc", "contract", "nsz", "arcp"})
def _gemv_cols(x, b, b_rowmajor, o, i0, i1):
    """o[i0:i1] = x @ b[:, i0:i1] (b row-major [k, n]) or x @ w[i0:i1, :].T (w = b [n, k])."""
    k = x.shape[0]
    if b_rowmajor:
        o[i0:i1] = 0.0
        for j in range(k):
            xj = x[j]
            for i in range(i0, i1):
                o[i] += xj * b[j, i]
    else:
        for i in range(i0, i1):
            acc = np.float32(0.0)
            for j in range(k):
                acc += x[j] * b[i, j]
            o[i] = acc


@njit(nogil=True, cache=True, parallel=True)
def _gemv_parallel(x, b, b_rowmajor, o, chunks):
    n = o.shape[0]
    step = (n + chunks - 1) // chunks
    for c in prange(chunks):
        _gemv_cols(x, b, b_rowmajor, o, c * step, min(n, (c + 1) * step))


@njit(nogil=True, cache=True)
def _gemv(f32, a, b, b_rowmajor, out, n, k):
    """out[n] = a[k] @ b: on the calling thread, or split over the cores when the matrix is
    big enough (GEMV_PARALLEL_BYTES) to amortise the fork/join."""
    x = f32_at(f32, a, k)
    o = f32_at(f32, out, n)
    bm = f32_at(f32, b, k * n)
    mat = bm.reshape(k, n) if b_rowmajor else bm.reshape(n, k)
    threads = get_kernel_threads()
    if 4 * n * k >= GEMV_PARALLEL_BYTES and threads > 1:
        _gemv_parallel(x, mat, b_rowmajor, o, 4 * threads)
    else:
        _gemv_cols(x, mat, b_rowmajor, o, 0, n)


@njit(nogil=True, cache=True)
def matmul(f32, i32, i64, u16, table):
    batch, m, n, k = table[BATCH], table[M], table[N], table[K]
    alpha, beta = as_float(table[ALPHA]), as_float(table[BETA])
    a_rowmajor = table[A_CS] == 1  # the host passes (k, 1) for row-major, (1, m) otherwise
    b_rowmajor = table[B_CS] == 1
    has_bias = table[BIAS_DT] >= 0
    for i in range(batch):
        a = table[A] + 4 * i * table[A_BS]
        b = table[B] + 4 * i * table[B_BS]
        out = table[OUT] + 4 * i * m * n
        o = f32_at(f32, out, m * n).reshape(m, n)
        if k == 0:
            o[:] = 0.0
        elif m == 1:
            _gemv(f32, a, b, b_rowmajor, out, n, k)
        else:
            _gemm(f32, a, a_rowmajor, b, b_rowmajor, out, m, n, k)
        if alpha != 1.0:
            o *= np.float32(alpha)
        if has_bias:
            pb = (table[BIAS] >> 2) + i * table[BIAS_BS]
            rs, cs = table[BIAS_RS], table[BIAS_CS]
            bt = np.float32(beta)
            for r in range(m):
                for c in range(n):
                    o[r, c] += bt * f32[pb + r * rs + c * cs]
