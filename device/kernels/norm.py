"""RMSNorm over rows, as Granite/LLaMA compute it (float32 variance)."""

import numpy as np
from numba import njit, prange

from spyre_serve.device.abi import chunks_for

# Reassociated sums (vectorized), but infinities and NaN keep their meaning.
_REORDER = {"reassoc", "contract", "nsz", "arcp", "afn"}


@njit(nogil=True, cache=True, fastmath=_REORDER)
def _rows(out, x, w, eps, r0, r1):
    h = x.shape[1]
    for i in range(r0, r1):
        ss = np.float32(0.0)
        for j in range(h):
            ss += x[i, j] * x[i, j]
        r = np.float32(1.0) / np.sqrt(ss / np.float32(h) + np.float32(eps))
        for j in range(h):
            out[i, j] = w[j] * (x[i, j] * r)


@njit(nogil=True, cache=True, parallel=True)
def _parallel(out, x, w, eps, chunks):
    m = x.shape[0]
    for c in prange(chunks):
        _rows(out, x, w, eps, c * m // chunks, (c + 1) * m // chunks)


@njit(nogil=True, cache=True)
def rmsnorm(out, x, w, eps):
    """out[M, H] = x[M, H] / sqrt(mean(x**2, axis=1) + eps) * w[H] (few rows: on this thread)."""
    m, h = x.shape
    if out.shape[0] != m or out.shape[1] != h:
        raise ValueError("rmsnorm: out shape differs from x shape (rows, cols)", m, h)
    if w.shape[0] != h:
        raise ValueError("rmsnorm: weight length differs from hidden size", w.shape[0], h)
    chunks = chunks_for(m, m * h)
    if chunks == 1:
        _rows(out, x, w, eps, 0, m)
    else:
        _parallel(out, x, w, eps, chunks)
