"""Elementwise kernels over strided operands: copies and casts, fill, arange, unary, binary
and where, in one program entry.

The host broadcasts every operand to the output's shape (stride 0 where broadcast), merges
dims that are contiguous in every operand and pads to MAXD = 6 dims at the front, so the
kernel walks one index space: the first five dims as a flat "outer" index, the last as the
inner loop. An operand is a tensor (address, dtype code, strides in elements) or a number
(SCALAR_F / SCALAR_I with its value in the operand's `val` slot).

Domains, as torch computes (`cdt`, the op's computation dtype):
- F32: every operand rounded to float32, the op computed in float64 and rounded to float32
  (exact for + - * / and sqrt, which float64 rounds correctly; within an ulp of torch's for
  the transcendental functions);
- F64: float64;
- I64 (and BOOL): integers, exactly.
All-float32 operands with an arithmetic op take a fast path computing in float32 directly.

    out[...] = op(a[...], b[...], c[...])      alpha, beta: add/sub's multiplier, fill's value,
                                              arange's start and step
"""

import math

import numpy as np
from numba import njit

from spyre_torch.kernels import ELEMENTWISE, EW_OPS, MAXD, index
from spyre_torch.kernels.access import (
    F32,
    F64,
    SCALAR_F,
    SCALAR_I,
    as_float,
    base,
    ldf,
    ldi,
    outer_offset,
    stf,
    sti,
    views,
)

_I = index(ELEMENTWISE)
OP, CDT, ALPHA, BETA, SIZE = _I["op"], _I["cdt"], _I["alpha"], _I["beta"], _I["size0"]
OUT, A, B, C = _I["out"], _I["a"], _I["b"], _I["c"]  # operand blocks: addr, dt, val, strides
OUTER = MAXD - 1

FILL, ARANGE, COPY = EW_OPS["fill"], EW_OPS["arange"], EW_OPS["copy"]
NEG, EXP, LOG, SQRT, RSQRT = EW_OPS["neg"], EW_OPS["exp"], EW_OPS["log"], EW_OPS["sqrt"], EW_OPS["rsqrt"]
SIN, COS, TAN, TANH, SIGMOID = EW_OPS["sin"], EW_OPS["cos"], EW_OPS["tan"], EW_OPS["tanh"], EW_OPS["sigmoid"]
SILU, RELU, ABS, RECIPROCAL = EW_OPS["silu"], EW_OPS["relu"], EW_OPS["abs"], EW_OPS["reciprocal"]
GELU, GELU_TANH, ERF = EW_OPS["gelu"], EW_OPS["gelu_tanh"], EW_OPS["erf"]
FLOOR, CEIL, TRUNC, ROUND, SIGN = EW_OPS["floor"], EW_OPS["ceil"], EW_OPS["trunc"], EW_OPS["round"], EW_OPS["sign"]
LOG1P, EXPM1, LOG2 = EW_OPS["log1p"], EW_OPS["expm1"], EW_OPS["log2"]
ISNAN, ISINF, ISFINITE = EW_OPS["isnan"], EW_OPS["isinf"], EW_OPS["isfinite"]
LOGICAL_NOT, BITWISE_NOT = EW_OPS["logical_not"], EW_OPS["bitwise_not"]
ADD, SUB, MUL, DIV = EW_OPS["add"], EW_OPS["sub"], EW_OPS["mul"], EW_OPS["div"]
DIV_TRUNC, DIV_FLOOR, REMAINDER, FMOD = EW_OPS["div_trunc"], EW_OPS["div_floor"], EW_OPS["remainder"], EW_OPS["fmod"]
POW, MAXIMUM, MINIMUM = EW_OPS["pow"], EW_OPS["maximum"], EW_OPS["minimum"]
EQ, NE, LT, LE, GT, GE = EW_OPS["eq"], EW_OPS["ne"], EW_OPS["lt"], EW_OPS["le"], EW_OPS["gt"], EW_OPS["ge"]
LOGICAL_AND, LOGICAL_OR, LOGICAL_XOR = EW_OPS["logical_and"], EW_OPS["logical_or"], EW_OPS["logical_xor"]
BITWISE_AND, BITWISE_OR, BITWISE_XOR = EW_OPS["bitwise_and"], EW_OPS["bitwise_or"], EW_OPS["bitwise_xor"]
ATAN2, WHERE = EW_OPS["atan2"], EW_OPS["where"]


@njit(nogil=True, cache=True, error_model="numpy")
def _f32(x):
    return np.float64(np.float32(x))


@njit(nogil=True, cache=True, error_model="numpy")
def _predicate(op, x, y):
    """The comparisons and logical ops (EQ..LOGICAL_XOR, consecutive codes), any number type."""
    if op == EQ:
        return x == y
    if op == NE:
        return x != y
    if op == LT:
        return x < y
    if op == LE:
        return x <= y
    if op == GT:
        return x > y
    if op == GE:
        return x >= y
    if op == LOGICAL_AND:
        return x != 0 and y != 0
    if op == LOGICAL_OR:
        return x != 0 or y != 0
    return (x != 0) != (y != 0)  # LOGICAL_XOR


@njit(nogil=True, cache=True, error_model="numpy")
def opf(op, x, y, z, alpha, rnd):
    """op on float64 operands; `rnd`: round products to float32 as a float32 op would."""
    if op == ADD:
        return x + (y if alpha == 1.0 else (_f32(alpha * y) if rnd else alpha * y))
    if op == SUB:
        return x - (y if alpha == 1.0 else (_f32(alpha * y) if rnd else alpha * y))
    if op == MUL:
        return x * y
    if op == DIV:
        return x / y
    if op == DIV_TRUNC:
        return math.trunc(x / y) if y != 0.0 else x / y
    if op == DIV_FLOOR:
        return math.floor(x / y) if y != 0.0 else x / y
    if op == REMAINDER:
        if y == 0.0:
            return math.nan
        r = np.fmod(x, y)
        return r + y if r != 0.0 and (r < 0.0) != (y < 0.0) else r
    if op == FMOD:
        return np.fmod(x, y) if y != 0.0 else math.nan
    if op == POW:
        return x * x if y == 2.0 else x ** y
    if op == MAXIMUM or op == MINIMUM:  # NaN wins, as in torch
        if x != x:
            return x
        if y != y:
            return y
        return max(x, y) if op == MAXIMUM else min(x, y)
    if EQ <= op <= LOGICAL_XOR:
        return 1.0 if _predicate(op, x, y) else 0.0
    if op == ATAN2:
        return math.atan2(x, y)
    if op == WHERE:
        return y if x != 0.0 else z
    return _unary_f(op, x)


@njit(nogil=True, cache=True, error_model="numpy")
def _unary_f(op, x):
    if op == COPY:
        return x
    if op == NEG:
        return -x
    if op == EXP:
        return math.exp(x)
    if op == LOG:
        return math.log(x) if x > 0.0 else (-math.inf if x == 0.0 else math.nan)
    if op == SQRT:
        return math.sqrt(x) if x >= 0.0 else math.nan
    if op == RSQRT:
        return 1.0 / math.sqrt(x) if x >= 0.0 else math.nan
    if op == SIN:
        return math.sin(x)
    if op == COS:
        return math.cos(x)
    if op == TAN:
        return math.tan(x)
    if op == TANH:
        return math.tanh(x)
    if op == SIGMOID:
        return 1.0 / (1.0 + math.exp(-x))
    if op == SILU:
        return x / (1.0 + math.exp(-x))
    if op == RELU:
        return 0.0 if x <= 0.0 else x
    if op == ABS:
        return abs(x)
    if op == RECIPROCAL:
        return 1.0 / x
    if op == GELU:
        return 0.5 * x * (1.0 + math.erf(x / math.sqrt(2.0)))
    if op == GELU_TANH:
        return 0.5 * x * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))
    if op == ERF:
        return math.erf(x)
    if op == FLOOR:
        return math.floor(x) if math.isfinite(x) else x
    if op == CEIL:
        return math.ceil(x) if math.isfinite(x) else x
    if op == TRUNC:
        return math.trunc(x) if math.isfinite(x) else x
    if op == ROUND:
        return np.rint(x)
    if op == SIGN:
        return 1.0 if x > 0.0 else (-1.0 if x < 0.0 else x)
    if op == LOG1P:
        return math.log1p(x) if x > -1.0 else (-math.inf if x == -1.0 else math.nan)
    if op == EXPM1:
        return math.expm1(x)
    if op == LOG2:
        return math.log2(x) if x > 0.0 else (-math.inf if x == 0.0 else math.nan)
    if op == ISNAN:
        return 1.0 if x != x else 0.0
    if op == ISINF:
        return 1.0 if math.isinf(x) else 0.0
    if op == ISFINITE:
        return 1.0 if math.isfinite(x) else 0.0
    if op == LOGICAL_NOT:
        return 1.0 if x == 0.0 else 0.0
    raise ValueError("spyre elementwise: op not defined on floats", op)


@njit(nogil=True, cache=True, error_model="numpy")
def opi(op, x, y, z, alpha):
    """op on int64 operands (bools are 0/1)."""
    if op == ADD:
        return x + alpha * y
    if op == SUB:
        return x - alpha * y
    if op == MUL:
        return x * y
    if op == DIV_TRUNC or op == DIV_FLOOR or op == REMAINDER or op == FMOD:
        if y == 0:
            raise ZeroDivisionError("spyre elementwise: integer division by zero")
        q = abs(x) // abs(y)
        if (x < 0) != (y < 0):
            q = -q
        if op == DIV_TRUNC:
            return q
        if op == FMOD:
            return x - q * y
        if op == DIV_FLOOR:
            return x // y
        return x % y  # Python's remainder takes the divisor's sign, as torch.remainder
    if op == POW:
        if y < 0:
            raise ValueError("spyre elementwise: integers to negative powers are not allowed")
        r = 1
        for _ in range(y):
            r *= x
        return r
    if op == MAXIMUM:
        return max(x, y)
    if op == MINIMUM:
        return min(x, y)
    if EQ <= op <= LOGICAL_XOR:
        return 1 if _predicate(op, x, y) else 0
    if op == BITWISE_AND:
        return x & y
    if op == BITWISE_OR:
        return x | y
    if op == BITWISE_XOR:
        return x ^ y
    if op == WHERE:
        return y if x != 0 else z
    if op == COPY:
        return x
    if op == NEG:
        return -x
    if op == ABS:
        return abs(x)
    if op == SIGN:
        return 1 if x > 0 else (-1 if x < 0 else 0)
    if op == LOGICAL_NOT:
        return 1 if x == 0 else 0
    if op == BITWISE_NOT:
        return ~x
    if op == FLOOR or op == CEIL or op == TRUNC or op == ROUND:
        return x
    raise ValueError("spyre elementwise: op not defined on integers", op)


@njit(nogil=True, cache=True, error_model="numpy")
def _fast(op, f32, out, so, a, pa, sa, b, pb, sb, n, alpha):
    """float32 operands, float32 arithmetic: f32[out + so*i] = op(a[pa + sa*i], b[pb + sb*i])."""
    if op == ADD and alpha == np.float32(1.0):
        for i in range(n):
            f32[out + i * so] = a[pa + i * sa] + b[pb + i * sb]
    elif op == ADD:
        for i in range(n):
            f32[out + i * so] = a[pa + i * sa] + alpha * b[pb + i * sb]
    elif op == SUB and alpha == np.float32(1.0):
        for i in range(n):
            f32[out + i * so] = a[pa + i * sa] - b[pb + i * sb]
    elif op == SUB:
        for i in range(n):
            f32[out + i * so] = a[pa + i * sa] - alpha * b[pb + i * sb]
    elif op == MUL:
        for i in range(n):
            f32[out + i * so] = a[pa + i * sa] * b[pb + i * sb]
    elif op == DIV:
        for i in range(n):
            f32[out + i * so] = a[pa + i * sa] / b[pb + i * sb]
    elif op == COPY:
        for i in range(n):
            f32[out + i * so] = a[pa + i * sa]
    elif op == NEG:
        for i in range(n):
            f32[out + i * so] = -a[pa + i * sa]
    elif op == SILU:
        one = np.float32(1.0)
        for i in range(n):
            x = a[pa + i * sa]
            f32[out + i * so] = x / (one + np.exp(-x))
    elif op == EXP:
        for i in range(n):
            f32[out + i * so] = np.exp(a[pa + i * sa])
    elif op == RSQRT:
        one = np.float32(1.0)
        for i in range(n):
            f32[out + i * so] = one / np.sqrt(a[pa + i * sa])
    elif op == POW:  # the host takes this path for a square only
        for i in range(n):
            x = a[pa + i * sa]
            f32[out + i * so] = x * x


FAST = (ADD, SUB, MUL, DIV, COPY, NEG, SILU, EXP, RSQRT)


@njit(nogil=True, cache=True, error_model="numpy")
def elementwise(f32, i32, i64, u16, table):
    V = views(f32, i32, i64, u16)
    op, cdt = table[OP], table[CDT]
    alpha, beta = as_float(table[ALPHA]), as_float(table[BETA])
    sizes = table[SIZE:SIZE + MAXD]
    odt, adt, bdt, cdt_c = table[OUT + 1], table[A + 1], table[B + 1], table[C + 1]
    aval, bval, cval = table[A + 2], table[B + 2], table[C + 2]
    ost, ast = table[OUT + 3:OUT + 3 + MAXD], table[A + 3:A + 3 + MAXD]
    bst, cst = table[B + 3:B + 3 + MAXD], table[C + 3:C + 3 + MAXD]
    obase, abase = base(odt, table[OUT]), base(adt, table[A])
    bbase, cbase = base(bdt, table[B]), base(cdt_c, table[C])
    n = sizes[MAXD - 1]
    outer = 1
    for d in range(OUTER):
        outer *= sizes[d]
    if n == 0 or outer == 0:
        return
    so, sa, sb, sc = ost[MAXD - 1], ast[MAXD - 1], bst[MAXD - 1], cst[MAXD - 1]

    if op == FILL or op == ARANGE:
        for o in range(outer):
            po = obase + outer_offset(o, sizes, ost, OUTER)
            for i in range(n):
                if op == ARANGE:
                    k = o * n + i
                    if cdt == F32 or cdt == F64:
                        stf(V, odt, po + i * so, alpha + beta * k)
                    else:
                        sti(V, odt, po + i * so, np.int64(alpha) + np.int64(beta) * k)
                elif cdt == F32 or cdt == F64:
                    stf(V, odt, po + i * so, alpha)
                else:
                    sti(V, odt, po + i * so, np.int64(alpha))
        return

    fast = (cdt == F32 and odt == F32 and (adt == F32 or adt == SCALAR_F or adt == SCALAR_I)
            and (bdt == F32 or bdt == SCALAR_F or bdt == SCALAR_I or bdt < 0))
    if fast:
        fast = False
        for f in FAST:
            if op == f:
                fast = True
        if op == POW and bdt != F32 and ldf(V, bdt, 0, bval) == 2.0:
            fast = True
    if fast:
        one_a = np.empty(1, np.float32)  # a number operand: read at index 0, stride 0
        one_b = np.empty(1, np.float32)
        av = f32
        bv = f32
        if adt != F32:
            one_a[0] = np.float32(ldf(V, adt, 0, aval))
            av = one_a
        if bdt != F32:
            one_b[0] = np.float32(ldf(V, bdt, 0, bval))
            bv = one_b
        for o in range(outer):
            po = obase + outer_offset(o, sizes, ost, OUTER)
            pa = abase + outer_offset(o, sizes, ast, OUTER) if adt == F32 else 0
            pb = bbase + outer_offset(o, sizes, bst, OUTER) if bdt == F32 else 0
            _fast(op, f32, po, so, av, pa, sa if adt == F32 else 0, bv, pb,
                  sb if bdt == F32 else 0, n, np.float32(alpha))
        return

    floats = cdt == F32 or cdt == F64
    rnd = cdt == F32
    ialpha = np.int64(alpha)
    for o in range(outer):
        po = obase + outer_offset(o, sizes, ost, OUTER)
        pa = abase + outer_offset(o, sizes, ast, OUTER)
        pb = bbase + outer_offset(o, sizes, bst, OUTER)
        pc = cbase + outer_offset(o, sizes, cst, OUTER)
        for i in range(n):
            if floats:
                if op == WHERE:  # a is the condition: never rounded
                    x = ldf(V, adt, pa + i * sa, aval)
                    y = ldf(V, bdt, pb + i * sb, bval)
                    z = ldf(V, cdt_c, pc + i * sc, cval)
                    if rnd:
                        y, z = _f32(y), _f32(z)
                else:
                    x = ldf(V, adt, pa + i * sa, aval)
                    y = ldf(V, bdt, pb + i * sb, bval)
                    z = 0.0
                    if rnd:
                        x, y = _f32(x), _f32(y)
                stf(V, odt, po + i * so, opf(op, x, y, z, alpha, rnd))
            else:
                x = ldi(V, adt, pa + i * sa, aval)
                y = ldi(V, bdt, pb + i * sb, bval)
                z = ldi(V, cdt_c, pc + i * sc, cval)
                sti(V, odt, po + i * so, opi(op, x, y, z, ialpha))
