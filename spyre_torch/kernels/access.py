"""Typed element access to the arena for kernels whose operands may have any of the card's
dtypes. `views(f32, i64, u16)` gives the arena as every dtype a code names (spyre_torch/dtypes.py):

    V = (f32, f64, i64, i32, u8, u16)   # f64 and u8 are views of i64 / u16

An operand is (dtype code, element index); `base(dt, address)` is the index of its first
element in its dtype's view. Numbers in an operand table are int64; a float travels as its
bits (`as_float`). Loads widen to float64 (`ldf`) or int64 (`ldi`); stores narrow, as torch's
casts do (float -> int truncates, anything -> bool is `!= 0`).
"""

import numpy as np
from numba import njit

import spyre_torch.kernels._keyed  # noqa: F401  (before any decoration)

F32, F64, I64, I32, BOOL, U8, U16 = 0, 1, 2, 3, 4, 5, 6  # U16: bits of any 16-bit dtype (copies)
SCALAR_F, SCALAR_I = 14, 15
NONE = -1
ITEMSIZE = (4, 8, 8, 4, 1, 1, 2)


@njit(nogil=True, cache=True)
def views(f32, i32, i64, u16):
    return (f32, i64.view(np.float64), i64, i32, u16.view(np.uint8), u16)


@njit(nogil=True, cache=True)
def as_float(bits):
    """The float64 whose bits are the int64 `bits`."""
    return np.array([bits], np.int64).view(np.float64)[0]


@njit(nogil=True, cache=True)
def base(dt, addr):
    if dt < 0 or dt > U16:
        return 0
    size = ITEMSIZE[dt]
    if addr % size:
        raise ValueError("spyre kernel: operand address is not aligned to its dtype")
    return addr // size


@njit(nogil=True, cache=True, error_model="numpy")
def ldf(V, dt, i, val):
    """Element i of a dt operand as float64 (`val`: the operand's number, for SCALAR_*)."""
    if dt == F32:
        return np.float64(V[0][i])
    if dt == F64:
        return V[1][i]
    if dt == I64:
        return np.float64(V[2][i])
    if dt == I32:
        return np.float64(V[3][i])
    if dt == BOOL or dt == U8:
        return np.float64(V[4][i])
    if dt == U16:
        return np.float64(V[5][i])
    if dt == SCALAR_F:
        return as_float(val)
    if dt == SCALAR_I:
        return np.float64(val)
    return 0.0


@njit(nogil=True, cache=True, error_model="numpy")
def ldi(V, dt, i, val):
    """Element i of a dt operand as int64."""
    if dt == I64:
        return V[2][i]
    if dt == I32:
        return np.int64(V[3][i])
    if dt == BOOL or dt == U8:
        return np.int64(V[4][i])
    if dt == U16:
        return np.int64(V[5][i])
    if dt == F32:
        return np.int64(V[0][i])
    if dt == F64:
        return np.int64(V[1][i])
    if dt == SCALAR_I:
        return val
    if dt == SCALAR_F:
        return np.int64(as_float(val))
    return 0


@njit(nogil=True, cache=True, error_model="numpy")
def stf(V, dt, i, v):
    """Store float64 v as element i of a dt operand."""
    if dt == F32:
        V[0][i] = np.float32(v)
    elif dt == F64:
        V[1][i] = v
    elif dt == I64:
        V[2][i] = np.int64(v)
    elif dt == I32:
        V[3][i] = np.int32(v)
    elif dt == BOOL:
        V[4][i] = np.uint8(1 if v != 0.0 else 0)
    elif dt == U8:
        V[4][i] = np.uint8(np.int64(v) & 255)
    elif dt == U16:
        V[5][i] = np.uint16(np.int64(v) & 65535)


@njit(nogil=True, cache=True, error_model="numpy")
def sti(V, dt, i, v):
    """Store int64 v as element i of a dt operand."""
    if dt == I64:
        V[2][i] = v
    elif dt == I32:
        V[3][i] = np.int32(v)
    elif dt == BOOL:
        V[4][i] = np.uint8(1 if v != 0 else 0)
    elif dt == U8:
        V[4][i] = np.uint8(v & 255)
    elif dt == U16:
        V[5][i] = np.uint16(v & 65535)
    elif dt == F32:
        V[0][i] = np.float32(v)
    elif dt == F64:
        V[1][i] = np.float64(v)


@njit(nogil=True, cache=True)
def outer_offset(flat, sizes, strides, ndim):
    """Element offset of the flat index `flat` over dims 0..ndim-1 (row-major)."""
    off = 0
    for d in range(ndim - 1, -1, -1):
        s = sizes[d]
        q = flat // s
        off += (flat - q * s) * strides[d]
        flat = q
    return off
