"""Gather along one dim: out[o, j, i] = x[o, idx[j], i] (embedding, index_select, index).

x is seen as [outer, dim_size, inner] through three strides (the host merges the dims before
and after the gathered one, copying x first when they do not merge); idx is int64 or int32
with a stride; out is row-major [outer, J, inner] of x's dtype. `wrap`: negative indices
count from the end (indexing); otherwise they are out of range (index_select, embedding).
An index out of range stops the kernel with the index and the size.
"""

import numpy as np
from numba import njit

from spyre_torch.kernels import GATHER, index
from spyre_torch.kernels.access import F32, base, ldi, views

_I = index(GATHER)
OUTER, J, INNER, DIM_SIZE, WRAP = _I["outer"], _I["j"], _I["inner"], _I["dim_size"], _I["wrap"]
X_DT, X_OS, X_DS, X_IS, IDX_DT, IDX_ST = (_I["x_dt"], _I["x_os"], _I["x_ds"], _I["x_is"],
                                          _I["idx_dt"], _I["idx_st"])
X, IDX, OUT = _I["x"], _I["idx"], _I["out"]


@njit(nogil=True, cache=True)
def _copy(a, dst, src, stride, n):
    """a[dst : dst + n] = a[src :: stride][:n], one typed view of the arena."""
    for i in range(n):
        a[dst + i] = a[src + i * stride]


@njit(nogil=True, cache=True)
def _copy_elements(V, dt, dst, src, stride, n):
    """n elements of dtype code dt (its view of the arena, V[dt]; bools and bytes: V[4])."""
    if dt == 0:
        _copy(V[0], dst, src, stride, n)
    elif dt == 1:
        _copy(V[1], dst, src, stride, n)
    elif dt == 2:
        _copy(V[2], dst, src, stride, n)
    elif dt == 3:
        _copy(V[3], dst, src, stride, n)
    else:
        _copy(V[4], dst, src, stride, n)


@njit(nogil=True, cache=True)
def gather(f32, i32, i64, u16, table):
    V = views(f32, i32, i64, u16)
    outer, j_n, inner, size = table[OUTER], table[J], table[INNER], table[DIM_SIZE]
    wrap = table[WRAP] != 0
    dt, os_, ds, is_ = table[X_DT], table[X_OS], table[X_DS], table[X_IS]
    idt, ist = table[IDX_DT], table[IDX_ST]
    xb, ib, ob = base(dt, table[X]), base(idt, table[IDX]), base(dt, table[OUT])
    rows = np.empty(j_n, np.int64)
    for j in range(j_n):
        r = ldi(V, idt, ib + j * ist, 0)
        if wrap and r < 0:
            r += size
        if r < 0 or r >= size:
            raise IndexError("spyre gather: index out of range (index, size of the dim)",
                             ldi(V, idt, ib + j * ist, 0), size)
        rows[j] = r
    for o in range(outer):
        for j in range(j_n):
            src = xb + o * os_ + rows[j] * ds
            dst = ob + (o * j_n + j) * inner
            if dt == F32 and is_ == 1:
                f32[dst:dst + inner] = f32[src:src + inner]
            else:
                _copy_elements(V, dt, dst, src, is_, inner)
