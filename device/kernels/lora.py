"""Low-rank updates added to a projection's output, one adapter per row (punica's shrink/expand).

    lora_apply(y, x, a, b, scales, slots, col0)
        for every row t whose slot s = slots[t] >= 0 and scales[s] != 0:
            y[t, col0:col0 + N] += scales[s] * (x[t] @ a[s]) @ b[s]
    x float32[T, K]; a float32[NSLOT, K, R] (shrink), b float32[NSLOT, R, N] (expand);
    scales float32[NSLOT]; slots int32[T] (-1: no adapter); y float32[T, >= col0 + N]

    lora_at(y, x, f32, a_address, b_address, scales_address, slots, nslot, k, r, n, col0)
        the same with a, b and scales at byte addresses of the arena (f32: its float32 view)

Rows of one slot come in runs (a sequence's rows are contiguous): each run is a row group,
its shrink [rows, R] computed first, then its expand, the groups split across the cores.
A rank below R is zero-padded, so padding adds exact zeros. Sums are float32, in k order.
"""

import numpy as np
from numba import njit, prange

from spyre_serve.device.abi import f32_at


@njit(nogil=True, cache=True)
def _group(y, x, a, b, scale, s, r0, r1, col0):
    """Rows r0..r1-1, all of slot s: shrink into [rows, R], then expand into y's columns."""
    k, r = a.shape[1], a.shape[2]
    n = b.shape[2]
    mid = np.zeros((r1 - r0, r), np.float32)
    for t in range(r0, r1):
        m = mid[t - r0]
        for kk in range(k):
            xv = x[t, kk]
            ak = a[s, kk]
            for j in range(r):
                m[j] += xv * ak[j]
    out = np.empty(n, np.float32)
    for t in range(r0, r1):
        out[:] = 0.0
        m = mid[t - r0]
        for j in range(r):
            mj = m[j]
            bj = b[s, j]
            for c in range(n):
                out[c] += mj * bj[c]
        yt = y[t, col0:col0 + n]
        for c in range(n):
            yt[c] += scale * out[c]


@njit(nogil=True, cache=True)
def _groups(slots, scales):
    """[G, 3] (slot, first row, end row) of the runs of rows with an adapter to apply."""
    t_rows = slots.shape[0]
    out = np.empty((t_rows, 3), np.int64)
    g, t = 0, 0
    while t < t_rows:
        s = slots[t]
        e = t + 1
        while e < t_rows and slots[e] == s:
            e += 1
        if s >= 0 and scales[s] != 0.0:
            out[g, 0], out[g, 1], out[g, 2] = s, t, e
            g += 1
        t = e
    return out[:g]


@njit(nogil=True, cache=True, parallel=True)
def _apply_parallel(y, x, a, b, scales, groups, col0):
    for i in prange(groups.shape[0]):
        s = groups[i, 0]
        _group(y, x, a, b, scales[s], s, groups[i, 1], groups[i, 2], col0)


@njit(nogil=True, cache=True)
def lora_apply(y, x, a, b, scales, slots, col0):
    """y[t, col0:col0+N] += scales[s] * (x[t] @ a[s]) @ b[s] for each row t of slot s >= 0."""
    if x.shape[0] != slots.shape[0] or y.shape[0] != slots.shape[0]:
        raise ValueError("lora_apply: rows of x, y and slots differ", x.shape[0], y.shape[0],
                         slots.shape[0])
    if a.shape[1] != x.shape[1] or b.shape[1] != a.shape[2] or col0 + b.shape[2] > y.shape[1]:
        raise ValueError("lora_apply: shapes do not chain (K, R, N, y columns)", x.shape[1],
                         a.shape[2], b.shape[2], y.shape[1])
    for t in range(slots.shape[0]):
        if slots[t] >= a.shape[0]:
            raise IndexError("lora_apply: adapter slot past the arena (row, slot, slots)", t,
                             slots[t], a.shape[0])
    groups = _groups(slots, scales)
    if groups.shape[0] == 1:
        s = groups[0, 0]
        _group(y, x, a, b, scales[s], s, groups[0, 1], groups[0, 2], col0)
    elif groups.shape[0] > 1:
        _apply_parallel(y, x, a, b, scales, groups, col0)


@njit(nogil=True, cache=True)
def lora_at(y, x, f32, a_address, b_address, scales_address, slots, nslot, k, r, n, col0):
    """lora_apply with the adapters' a, b and scales at byte addresses of the arena."""
    a = f32_at(f32, a_address, nslot * k * r).reshape(nslot, k, r)
    b = f32_at(f32, b_address, nslot * r * n).reshape(nslot, r, n)
    scales = f32_at(f32, scales_address, nslot)
    lora_apply(y, x, a, b, scales, slots, col0)
