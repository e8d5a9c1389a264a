"""Log-softmax over the rows of a [M, N] matrix, float32.

Exponentials by `exp_nonpos` (vectorized, 3e-7 relative); -inf entries give 0.
"""

import numpy as np
from numba import njit, prange

from spyre_serve.device.kernels.fastexp import exp_nonpos

# Reassociated sums (vectorized), but infinities and NaN keep their meaning.
_REORDER = {"reassoc", "contract", "nsz", "arcp", "afn"}


@njit(nogil=True, cache=True)
def _check(out, x):
    if out.shape[0] != x.shape[0] or out.shape[1] != x.shape[1]:
        raise ValueError("softmax: out shape differs from x shape (rows, cols)", x.shape[0], x.shape[1])


@njit(nogil=True, cache=True, fastmath=_REORDER)
def _exp_shifted(e, x):
    """e[N] = exp(x[N] - max(x)); returns max(x)."""
    mx = x[0]
    for j in range(1, x.shape[0]):
        mx = max(mx, x[j])
    for j in range(x.shape[0]):
        e[j] = x[j] - mx
    exp_nonpos(e)
    return mx


@njit(nogil=True, cache=True, parallel=True, fastmath=_REORDER)
def log_softmax(out, x):
    """out[M, N] = x - max - log(sum(exp(x - max))), per row (out may be x)."""
    _check(out, x)
    m, n = x.shape
    for i in prange(m):
        e = np.empty(n, np.float32)
        mx = _exp_shifted(e, x[i])
        s = np.float32(0.0)
        for j in range(n):
            s += e[j]
        lse = mx + np.log(s)
        for j in range(n):
            out[i, j] = x[i, j] - lse
