"""Softmax and log-softmax over the rows of a [M, N] matrix, float32."""

import numpy as np
from numba import njit, prange

# Reassociated sums (vectorized), but infinities and NaN keep their meaning.
_REORDER = {"reassoc", "contract", "nsz", "arcp", "afn"}


@njit(nogil=True, cache=True)
def _check(out, x):
    if out.shape[0] != x.shape[0] or out.shape[1] != x.shape[1]:
        raise ValueError("softmax: out shape differs from x shape (rows, cols)", x.shape[0], x.shape[1])


@njit(nogil=True, cache=True, parallel=True, fastmath=_REORDER)
def softmax(out, x):
    """out[M, N] = exp(x - max) / sum(exp(x - max)), per row."""
    _check(out, x)
    m, n = x.shape
    for i in prange(m):
        mx = x[i, 0]
        for j in range(1, n):
            if x[i, j] > mx:
                mx = x[i, j]
        s = np.float32(0.0)
        for j in range(n):
            e = np.exp(x[i, j] - mx)
            out[i, j] = e
            s += e
        r = np.float32(1.0) / s
        for j in range(n):
            out[i, j] *= r


@njit(nogil=True, cache=True, parallel=True, fastmath=_REORDER)
def log_softmax(out, x):
    """out[M, N] = x - max - log(sum(exp(x - max))), per row."""
    _check(out, x)
    m, n = x.shape
    for i in prange(m):
        mx = x[i, 0]
        for j in range(1, n):
            if x[i, j] > mx:
                mx = x[i, j]
        s = np.float32(0.0)
        for j in range(n):
            s += np.exp(x[i, j] - mx)
        lse = mx + np.log(s)
        for j in range(n):
            out[i, j] = x[i, j] - lse
