"""Scaled residual add in place (Granite scales each branch by 0.22)."""

import numpy as np
from numba import njit, prange


@njit(nogil=True, cache=True, parallel=True)
def residual_add(x, y, scale):
    """x += scale * y, in place; x and y C-contiguous of the same shape (any rank)."""
    if x.shape != y.shape:
        raise ValueError("residual_add: x and y differ in size", x.size, y.size)
    xf = x.reshape(x.size)
    yf = y.reshape(y.size)
    s = np.float32(scale)
    for i in prange(xf.shape[0]):
        xf[i] += s * yf[i]
