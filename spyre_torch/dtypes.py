"""Dtypes: torch's, numpy's (how bytes cross between host and card), and the kernels' codes.

A tensor of any dtype can live on the card and be copied in and out (its bytes travel as the
numpy dtype below; bfloat16 as raw uint16 bits). The card's kernels compute on the dtypes that
have a code (`CODES`); an op on any other dtype runs on the CPU (counted, see ops/fallback.py).
"""

from __future__ import annotations

import numpy as np
import torch

# kernel dtype codes (spyre_torch/kernels/abi.py reads the arena through one view per code)
F32, F64, I64, I32, BOOL, U8, U16 = 0, 1, 2, 3, 4, 5, 6  # U16: 16-bit bits, for copies only
SCALAR_F, SCALAR_I = 14, 15  # an operand that is a number (its value in the operand's value slot)
NONE = -1                    # no operand

CODES = {torch.float32: F32, torch.float64: F64, torch.int64: I64, torch.int32: I32,
         torch.bool: BOOL, torch.uint8: U8}
FLOATS = (F32, F64)
OPERANDS = {**CODES, torch.int16: U16}  # what a kernel operand may be (int16: as bits, copies)

# how each torch dtype's bytes are seen on the host (bfloat16 has no numpy dtype: its bits)
NUMPY = {
    torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
    torch.bfloat16: np.uint16, torch.int64: np.int64, torch.int32: np.int32,
    torch.int16: np.int16, torch.int8: np.int8, torch.uint8: np.uint8, torch.bool: np.bool_,
    torch.complex64: np.complex64, torch.complex128: np.complex128,
}


# the code that copies a dtype's bits unchanged, by itemsize (any dtype, same dtype both sides)
RAW = {1: (U8, torch.uint8), 2: (U16, torch.int16), 4: (I32, torch.int32), 8: (I64, torch.int64)}


def code(dtype: torch.dtype) -> int | None:
    """The kernels' code of `dtype`, or None when no card kernel computes on it."""
    return CODES.get(dtype)


def host_view(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor's bytes in the dtype they cross as."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype not in NUMPY:
        raise TypeError(f"spyre: tensors of dtype {t.dtype} cannot be copied to or from the card")
    return t.numpy()


def float_bits(x: float) -> int:
    """A float64 as the int64 with its bits (how a number travels in an operand table)."""
    return int(np.array(x, np.float64).view(np.int64))
