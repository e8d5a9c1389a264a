"""RMSNorm over rows, as Granite/LLaMA compute it (float32 variance)."""

import numpy as np
from numba import njit, prange

# Reassociated sums (vectorized), but infinities and NaN keep their meaning.
_REORDER = {"reassoc", "contract", "nsz", "arcp", "afn"}


@njit(nogil=True, cache=True, parallel=True, fastmath=_REORDER)
def rmsnorm(out, x, w, eps):
    """out[M, H] = x[M, H] / sqrt(mean(x**2, axis=1) + eps) * w[H]."""
    m, h = x.shape
    if out.shape[0] != m or out.shape[1] != h:
        raise ValueError("rmsnorm: out shape differs from x shape (rows, cols)", m, h)
    if w.shape[0] != h:
        raise ValueError("rmsnorm: weight length differs from hidden size", w.shape[0], h)
    for i in prange(m):
        ss = np.float32(0.0)
        for j in range(h):
            ss += x[i, j] * x[i, j]
        r = np.float32(1.0) / np.sqrt(ss / np.float32(h) + np.float32(eps))
        for j in range(h):
            out[i, j] = w[j] * (x[i, j] * r)
