"""Row kernels: an op along one dim of a strided tensor, for every index of the other dims.

The host moves the reduced dim last (merging several reduced dims into one when they are
contiguous, or copying first), merges the outer dims and pads them to five; slot `n` is the
row's length and each operand's `st5` its stride along the row.

    reductions  out[o] = op(x[o, 0..n))           sum, mean, prod, amax, amin, argmax, argmin,
                                                  any, all; max/min also write idx[o]
    scans       out[o, j] = op(x[o, 0..j])        cumsum
    rows        out[o, :] = op(x[o, :])           softmax, log_softmax

Floats accumulate in float64 (torch's CPU accumulates float sums and scans in double too),
integers and bools in int64; NaN wins max/min/argmax/argmin as in torch. A row of softmax
whose entries are all -inf gives NaN, as torch's does.
"""

import math

import numpy as np
from numba import njit

from spyre_torch.kernels import MAXD, ROW_OPS, ROWS, index
from spyre_torch.kernels.access import F32, F64, base, ldf, ldi, outer_offset, stf, sti, views

_I = index(ROWS)
OP, N, SIZE, X, OUT, IDX = _I["op"], _I["n"], _I["size0"], _I["x"], _I["out"], _I["idx"]
OUTER = MAXD - 1
SUM, MEAN, PROD, AMAX, AMIN = ROW_OPS["sum"], ROW_OPS["mean"], ROW_OPS["prod"], ROW_OPS["amax"], ROW_OPS["amin"]
ARGMAX, ARGMIN, MAX, MIN = ROW_OPS["argmax"], ROW_OPS["argmin"], ROW_OPS["max"], ROW_OPS["min"]
ANY, ALL, CUMSUM = ROW_OPS["any"], ROW_OPS["all"], ROW_OPS["cumsum"]
SOFTMAX, LOG_SOFTMAX = ROW_OPS["softmax"], ROW_OPS["log_softmax"]


@njit(nogil=True, cache=True, error_model="numpy")
def _extreme(V, dt, p, s, n, val, larger, floats):
    """(value, index) of the first largest (or smallest) entry; NaN counts as the extreme."""
    best_i = 0
    if floats:
        best = ldf(V, dt, p, val)
        if best != best:
            return best, 0
        for j in range(1, n):
            x = ldf(V, dt, p + j * s, val)
            if x != x:
                return x, j
            if (x > best) if larger else (x < best):
                best, best_i = x, j
        return best, best_i
    ibest = ldi(V, dt, p, val)
    for j in range(1, n):
        x = ldi(V, dt, p + j * s, val)
        if (x > ibest) if larger else (x < ibest):
            ibest, best_i = x, j
    return np.float64(ibest), best_i


@njit(nogil=True, cache=True, error_model="numpy")
def _row(V, op, xdt, px, sx, odt, po, so, idt, pi, n, floats):
    if op == SOFTMAX or op == LOG_SOFTMAX:
        mx = -math.inf
        for j in range(n):
            x = ldf(V, xdt, px + j * sx, 0)
            if x > mx or x != x:
                mx = x
        total = 0.0
        for j in range(n):
            total += math.exp(ldf(V, xdt, px + j * sx, 0) - mx)
        if op == SOFTMAX:
            for j in range(n):
                stf(V, odt, po + j * so, math.exp(ldf(V, xdt, px + j * sx, 0) - mx) / total)
        else:
            lse = mx + math.log(total)
            for j in range(n):
                stf(V, odt, po + j * so, ldf(V, xdt, px + j * sx, 0) - lse)
    elif op == CUMSUM:
        if floats:
            acc = 0.0
            for j in range(n):
                acc += ldf(V, xdt, px + j * sx, 0)
                stf(V, odt, po + j * so, acc)
        else:
            iacc = 0
            for j in range(n):
                iacc += ldi(V, xdt, px + j * sx, 0)
                sti(V, odt, po + j * so, iacc)
    elif op == SUM or op == MEAN or op == PROD:
        if floats:
            acc = 1.0 if op == PROD else 0.0
            for j in range(n):
                x = ldf(V, xdt, px + j * sx, 0)
                acc = acc * x if op == PROD else acc + x
            stf(V, odt, po, acc / n if op == MEAN else acc)
        else:
            iacc = 1 if op == PROD else 0
            for j in range(n):
                x = ldi(V, xdt, px + j * sx, 0)
                iacc = iacc * x if op == PROD else iacc + x
            sti(V, odt, po, iacc)
    elif op == ANY or op == ALL:
        hit = op == ALL
        for j in range(n):
            nz = ldf(V, xdt, px + j * sx, 0) != 0.0
            if op == ANY and nz:
                hit = True
                break
            if op == ALL and not nz:
                hit = False
                break
        sti(V, odt, po, 1 if hit else 0)
    else:
        larger = op == AMAX or op == ARGMAX or op == MAX
        value, at = _extreme(V, xdt, px, sx, n, 0, larger, floats)
        if op == ARGMAX or op == ARGMIN:
            sti(V, odt, po, at)
        else:
            if floats:
                stf(V, odt, po, value)
            else:
                sti(V, odt, po, np.int64(value))
            if op == MAX or op == MIN:
                sti(V, idt, pi, at)


@njit(nogil=True, cache=True, error_model="numpy")
def rows(f32, i32, i64, u16, table):
    V = views(f32, i32, i64, u16)
    op, n = table[OP], table[N]
    sizes = table[SIZE:SIZE + OUTER]
    xdt, odt, idt = table[X + 1], table[OUT + 1], table[IDX + 1]
    xst, ost, ist = table[X + 3:X + 3 + MAXD], table[OUT + 3:OUT + 3 + MAXD], table[IDX + 3:IDX + 3 + MAXD]
    xb, ob, ib = base(xdt, table[X]), base(odt, table[OUT]), base(idt, table[IDX])
    floats = xdt == F32 or xdt == F64 or op == MEAN or op == SOFTMAX or op == LOG_SOFTMAX
    outer = 1
    for d in range(OUTER):
        outer *= sizes[d]
    for o in range(outer):
        px = xb + outer_offset(o, sizes, xst, OUTER)
        po = ob + outer_offset(o, sizes, ost, OUTER)
        pi = ib + outer_offset(o, sizes, ist, OUTER)
        _row(V, op, xdt, px, xst[MAXD - 1], odt, po, ost[MAXD - 1], idt, pi, n, floats)
