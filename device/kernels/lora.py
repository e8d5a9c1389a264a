"""Low-rank updates added to a projection's output, one adapter per row (punica's shrink/expand).

    lora_apply(y, x, a, b, scales, slots, col0)
        for every row t whose slot s = slots[t] >= 0 and scales[s] != 0:
            y[t, col0:col0 + N] += scales[s] * (x[t] @ a[s]) @ b[s]
    x float32[T, K]; a float32[NSLOT, K, R] (shrink), b float32[NSLOT, R, N] (expand);
    scales float32[NSLOT]; slots int32[T] (-1: no adapter); y float32[T, >= col0 + N]

    lora_at(y, x, f32, a_address, b_address, scales_address, slots, nslot, k, r, n, col0)
        the same with a, b and scales at byte addresses of the arena (f32: its float32 view)
    lora_modules_at(y, x, f32, modules, slots, nslot, r)
        several modules reading one x, side by side in y (the step's call: a fused QKV's q, k, v)

The rows of each slot are gathered (a decode's rows of one adapter are seldom adjacent), so each
adapter's a and b are read once a call: its shrink [rows, R] and its expand are two BLAS GEMMs
(OpenBLAS on one thread, as attention's tiles), the slots split across the cores, one parallel
region a projection (a region costs ~15 us: none when no row has an adapter). A decode's update
is small: the adapters' bytes bound it (4 adapters of rank 16 on SmolLM2's 7 projections: 78 MB
a step; a decode of 8 rows over 4 adapters, amx: 28.4 -> 32.8 ms a step, the first version,
a parallel region a module over runs of adjacent rows, 38.5). A rank below R is zero-padded, so
padding adds exact zeros. Sums are float32.
"""

import numpy as np
from numba import njit, prange

from spyre_serve.device.abi import f32_at


@njit(nogil=True, cache=True)
def _rows_by_slot(slots, scales, nslot):
    """(start int64[NSLOT + 1], rows int64[n]): the rows of slot s, in order, are
    rows[start[s]:start[s + 1]] (rows without an adapter, or of a zero scale, in none)."""
    start = np.zeros(nslot + 1, np.int64)
    for t in range(slots.shape[0]):
        s = slots[t]
        if s >= 0 and scales[s] != 0.0:
            start[s + 1] += 1
    for s in range(nslot):
        start[s + 1] += start[s]
    rows = np.empty(start[nslot], np.int64)
    fill = start[:nslot].copy()
    for t in range(slots.shape[0]):
        s = slots[t]
        if s >= 0 and scales[s] != 0.0:
            rows[fill[s]] = t
            fill[s] += 1
    return start, rows


@njit(nogil=True, cache=True)
def _gather(x, rows):
    """x's rows ``rows``, contiguous."""
    xs = np.empty((rows.shape[0], x.shape[1]), np.float32)
    for i in range(rows.shape[0]):
        xs[i] = x[rows[i]]
    return xs


@njit(nogil=True, cache=True)
def _add_scaled(y, rows, col0, out, scale):
    """y[rows[i], col0:col0+N] += scale * out[i]."""
    n = out.shape[1]
    for i in range(rows.shape[0]):
        yt = y[rows[i], col0:col0 + n]
        o = out[i]
        for c in range(n):
            yt[c] += scale * o[c]


@njit(nogil=True, cache=True)
def _slot(y, x, a, b, scale, s, rows, col0):
    """Every row of slot s: its rows of x gathered, shrunk by a[s] into [rows, R], expanded by
    b[s] (two BLAS GEMMs: the slot's a and b are read once, whatever its rows), scaled and added
    to y's columns."""
    _add_scaled(y, rows, col0, np.dot(np.dot(_gather(x, rows), a[s]), b[s]), scale)


@njit(nogil=True, cache=True, parallel=True)
def _slots_parallel(y, x, a, b, scales, start, rows, used, col0):
    """The slots in ``used`` across the cores (each its own rows: no two write one row of y)."""
    for i in prange(used.shape[0]):
        s = used[i]
        _slot(y, x, a, b, scales[s], s, rows[start[s]:start[s + 1]], col0)


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
    start, rows = _rows_by_slot(slots, scales, a.shape[0])
    used = np.flatnonzero(start[1:] > start[:-1])
    if used.shape[0] == 1:
        s = used[0]
        _slot(y, x, a, b, scales[s], s, rows[start[s]:start[s + 1]], col0)
    elif used.shape[0] > 1:
        _slots_parallel(y, x, a, b, scales, start, rows, used, col0)


@njit(nogil=True, cache=True)
def lora_at(y, x, f32, a_address, b_address, scales_address, slots, nslot, k, r, n, col0):
    """lora_apply with the adapters' a, b and scales at byte addresses of the arena."""
    a = f32_at(f32, a_address, nslot * k * r).reshape(nslot, k, r)
    b = f32_at(f32, b_address, nslot * r * n).reshape(nslot, r, n)
    scales = f32_at(f32, scales_address, nslot)
    lora_apply(y, x, a, b, scales, slots, col0)


@njit(nogil=True, cache=True)
def _any_rows(slots, nslot):
    """_rows_by_slot of every row with a slot (scales are per module: lora_modules_at checks them)."""
    return _rows_by_slot(slots, np.ones(nslot, np.float32), nslot)


@njit(nogil=True, cache=True)
def _slot_modules(y, x, f32, modules, s, mine, nslot, r):
    """Slot s's rows ``mine`` through every module of ``modules`` (lora_modules_at)."""
    xs = _gather(x, mine)
    for m in range(modules.shape[0]):
        k, n, col0 = modules[m, 3], modules[m, 4], modules[m, 5]
        scale = f32_at(f32, modules[m, 2], nslot)[s]
        if scale == 0.0:
            continue
        if k != x.shape[1]:
            raise ValueError("lora_modules_at: a module's K is not x's width (K, x columns)", k, x.shape[1])
        a = f32_at(f32, modules[m, 0], nslot * k * r).reshape(nslot, k, r)
        b = f32_at(f32, modules[m, 1], nslot * r * n).reshape(nslot, r, n)
        _add_scaled(y, mine, col0, np.dot(np.dot(xs, a[s]), b[s]), scale)


@njit(nogil=True, cache=True, parallel=True)
def _modules_parallel(y, x, f32, modules, start, rows, used, nslot, r):
    for i in prange(used.shape[0]):
        s = used[i]
        _slot_modules(y, x, f32, modules, s, rows[start[s]:start[s + 1]], nslot, r)


@njit(nogil=True, cache=True)
def lora_modules_at(y, x, f32, modules, slots, nslot, r):
    """lora_at for several modules that read the same x and write side by side in y (q, k, v of a
    fused QKV; gate, up): one pass over the slots (across the cores when several), each slot's
    rows of x gathered once. ``modules`` int64[M, 6]: a, b and scales addresses, K, N, first
    column of y."""
    for t in range(slots.shape[0]):
        if slots[t] >= nslot:
            raise IndexError("lora_modules_at: adapter slot past the arena (row, slot, slots)", t,
                             slots[t], nslot)
    start, rows = _any_rows(slots, nslot)
    used = np.flatnonzero(start[1:] > start[:-1])
    if used.shape[0] == 1:
        s = used[0]
        _slot_modules(y, x, f32, modules, s, rows[start[s]:start[s + 1]], nslot, r)
    elif used.shape[0] > 1:
        _modules_parallel(y, x, f32, modules, start, rows, used, nslot, r)
