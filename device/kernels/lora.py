"""Low-rank updates added to a projection's output, one adapter per row (punica's shrink/expand).

    lora_modules_at(y, x, f32, modules, ranks, slots, nslot, r)
        for each module m (int64[M, 6]: a, b and scales byte addresses in the arena, K, N,
        first column col0 of y), for every row t whose slot s = slots[t] >= 0 and
        scale = scales[s] != 0, with r_s = ranks[s] (the slots' ranks, shared by the modules):
            y[t, col0:col0 + N] += scale * (x[t] @ a[s, :r_s].T) @ b[s, :r_s]
    x float32[T, K]; a float32[NSLOT, R, K] (shrink: PEFT's lora_A.weight), b float32[NSLOT,
    R, N] (expand: lora_B.weight.T); scales float32[NSLOT]; ranks float32[NSLOT] (a slot's
    rank r_s <= R, a whole number; a view of the arena); slots int32[T] (-1: no adapter); y float32[T, >= col0 + N];
    f32 the arena's float32 view. Several modules read one x and write side by side in y
    (the step's call: a fused QKV's q, k, v; gate, up).

The rows of each slot are gathered (a decode's rows of one adapter are seldom adjacent), once a
call for all its modules, so each adapter's a and b are read once a call: its shrink [rows, R]
and its expand are two BLAS GEMMs (OpenBLAS on one thread, as attention's tiles), the slots
split across the cores, one parallel region a projection (a region costs ~15 us: none when no
row has an adapter). A decode's update is small: the adapters' bytes bound it (4 adapters of
rank 16 on SmolLM2's 7 projections: 78 MB a step; a decode of 8 rows over 4 adapters, amx:
28.4 -> 32.8 ms a step, the first version, a parallel region a module over runs of adjacent
rows, 38.5). A slot holds R rows of a and b and its adapter fills the first r_s: only those
are read, so an adapter of rank 8 in slots of rank 64 costs its own bytes. Sums are float32.
"""

import numpy as np
from numba import njit, prange

from spyre_serve.device.abi import f32_at


@njit(nogil=True, cache=True)
def _rows_by_slot(slots, nslot):
    """(start int64[NSLOT + 1], rows int64[n]): the rows of slot s, in order, are
    rows[start[s]:start[s + 1]] (rows without an adapter in none)."""
    start = np.zeros(nslot + 1, np.int64)
    for t in range(slots.shape[0]):
        if slots[t] >= 0:
            start[slots[t] + 1] += 1
    for s in range(nslot):
        start[s + 1] += start[s]
    rows = np.empty(start[nslot], np.int64)
    fill = start[:nslot].copy()
    for t in range(slots.shape[0]):
        s = slots[t]
        if s >= 0:
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
def _slot_modules(y, x, f32, modules, s, rs, mine, nslot, r):
    """Slot s's rows ``mine`` through every module of ``modules`` (lora_modules_at), at the
    slot's own rank ``rs``."""
    if rs == 0:
        return
    xs = _gather(x, mine)
    for m in range(modules.shape[0]):
        k, n, col0 = modules[m, 3], modules[m, 4], modules[m, 5]
        scale = f32_at(f32, modules[m, 2], nslot)[s]
        if scale == 0.0:
            continue
        a = f32_at(f32, modules[m, 0], nslot * r * k).reshape(nslot, r, k)[s, :rs]
        b = f32_at(f32, modules[m, 1], nslot * r * n).reshape(nslot, r, n)[s, :rs]
        _add_scaled(y, mine, col0, np.dot(np.dot(xs, a.T), b), scale)


@njit(nogil=True, cache=True, parallel=True)
def _modules_parallel(y, x, f32, modules, ranks, start, rows, used, nslot, r):
    for i in prange(used.shape[0]):
        s = used[i]
        _slot_modules(y, x, f32, modules, s, int(ranks[s]), rows[start[s]:start[s + 1]], nslot, r)


@njit(nogil=True, cache=True)
def lora_modules_at(y, x, f32, modules, ranks, slots, nslot, r):
    """Every module of ``modules`` applied to the rows of x with an adapter (the module's
    docstring): one pass over the slots (across the cores when several), each slot's rows of
    x gathered once."""
    if x.shape[0] != slots.shape[0] or y.shape[0] != slots.shape[0]:
        raise ValueError("lora_modules_at: rows of x, y and slots differ", x.shape[0], y.shape[0],
                         slots.shape[0])
    for m in range(modules.shape[0]):
        if modules[m, 3] != x.shape[1] or modules[m, 5] + modules[m, 4] > y.shape[1]:
            raise ValueError("lora_modules_at: shapes do not chain (module, K, x columns, col0 + N, "
                             "y columns)", m, modules[m, 3], x.shape[1], modules[m, 5] + modules[m, 4],
                             y.shape[1])
    for t in range(slots.shape[0]):
        if slots[t] >= nslot:
            raise IndexError("lora_modules_at: adapter slot past the arena (row, slot, slots)", t,
                             slots[t], nslot)
    for s in range(nslot):
        if not 0 <= ranks[s] <= r:
            raise ValueError("lora_modules_at: a slot's rank is past the arena's (slot, rank, R)", s,
                             int(ranks[s]), r)
    start, rows = _rows_by_slot(slots, nslot)
    used = np.flatnonzero(start[1:] > start[:-1])
    if used.shape[0] == 1:
        s = used[0]
        _slot_modules(y, x, f32, modules, s, int(ranks[s]), rows[start[s]:start[s + 1]], nslot, r)
    elif used.shape[0] > 1:
        _modules_parallel(y, x, f32, modules, ranks, start, rows, used, nslot, r)
