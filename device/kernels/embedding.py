"""Embedding gather with Granite's embedding multiplier."""

import numpy as np
from numba import njit, prange


@njit(nogil=True, cache=True, parallel=True)
def embedding(out, table, ids, scale):
    """out[T, H] = table[V, H][ids int32[T]] * scale."""
    v, h = table.shape
    t_n = ids.shape[0]
    if out.shape[0] != t_n or out.shape[1] != h:
        raise ValueError("embedding: out must be [T, H]; T, H are", t_n, h)
    for t in range(t_n):
        if ids[t] < 0 or ids[t] >= v:
            raise IndexError("embedding: token id out of range (id, vocab)", ids[t], v)
    s = np.float32(scale)
    for t in prange(t_n):
        row = ids[t]
        for j in range(h):
            out[t, j] = table[row, j] * s
