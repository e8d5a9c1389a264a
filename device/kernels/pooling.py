"""Pooling: one vector per sequence from its rows of hidden states (embedding models).

A step's token rows are the sequences' rows back to back (`query_start`, as attention reads
them); pooling reduces each sequence's rows to one row of `out`, then optionally scales it to
unit length, as vLLM's poolers do:
    POOL_LAST  the sequence's last row (decoders: it has seen every token)
    POOL_MEAN  the mean of its rows
    POOL_CLS   its first row (BERT/RoBERTa's <s> / [CLS] token)
"""

import numpy as np
from numba import njit

POOL_LAST, POOL_MEAN, POOL_CLS = 0, 1, 2
POOLING_TYPES = {"LAST": POOL_LAST, "MEAN": POOL_MEAN, "CLS": POOL_CLS}


@njit(nogil=True, cache=True)
def pool_rows(out, hidden, query_start, mode, normalize):
    """out[S, H] <- the pooled rows of each sequence s (rows query_start[s]..query_start[s+1]-1
    of hidden[T, H]), in float64 sums; unit L2 norm when `normalize` (a zero vector stays 0).
    A sequence without rows (a bucket's padding) pools to zeros."""
    s_n, h = out.shape
    if query_start.shape[0] != s_n + 1 or hidden.shape[1] != h:
        raise ValueError("pool_rows: shapes differ (sequences, query_start, hidden columns)",
                         s_n, query_start.shape[0], hidden.shape[1])
    acc = np.empty(h, np.float64)
    for s in range(s_n):
        r0, r1 = query_start[s], query_start[s + 1]
        if r0 < 0 or r1 < r0 or r1 > hidden.shape[0]:
            raise ValueError("pool_rows: a sequence's rows out of range (seq, first, end)",
                             s, r0, r1)
        if r1 == r0:                       # a padding sequence of the bucket: no rows
            for j in range(h):
                out[s, j] = 0.0
            continue
        if mode == POOL_MEAN:
            for j in range(h):
                acc[j] = 0.0
            for r in range(r0, r1):
                for j in range(h):
                    acc[j] += hidden[r, j]
            for j in range(h):
                acc[j] /= r1 - r0
        else:
            src = r1 - 1 if mode == POOL_LAST else r0
            for j in range(h):
                acc[j] = hidden[src, j]
        scale = 1.0
        if normalize:
            ss = 0.0
            for j in range(h):
                ss += acc[j] * acc[j]
            if ss > 0.0:
                scale = 1.0 / np.sqrt(ss)
        for j in range(h):
            out[s, j] = np.float32(acc[j] * scale)
