"""Weights placed once on the card, in the layout the GEMM kernels read (weight-stationary).

A caller hands over a weight as the K x N matrix of a GEMM (out[M, N] = a[M, K] @ W[K, N])
and a storage format; the card packs it once into panels of NR columns and keeps it:

    W [K, N]                     packed: panel p = columns p*NR .. p*NR+NR-1
    +----+----+----+--           +---------------+  k = 0     NR values, contiguous
    | p0 | p1 | p2 |             | panel 0       |  k = 1
    |    |    |    |    ---->    |  K x NR       |  ...
    |    |    |    |             +---------------+
    +----+----+----+--           | panel 1       |  (the last panel is zero past column N)

Formats: "float32", "bfloat16" or "float16" (16-bit values stored as uint16 bits; the
kernels widen them to float32 right after the load). Converting float32 to a 16-bit format
rounds to nearest even, as torch's `.to(torch.bfloat16 / torch.float16)` does, so a
checkpoint stored in that format is placed bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from device.card import Card
from device.kernels.gemm import FMT_BF16, FMT_F16, FMT_F32, FORMATS, NR
from device.memory import DeviceError, DeviceTensor

STORAGE = {FMT_F32: np.float32, FMT_BF16: np.uint16, FMT_F16: np.uint16}


def format_code(dtype: str) -> int:
    """FMT_* code of a storage format name; DeviceError naming the formats otherwise."""
    try:
        return FORMATS[dtype]
    except KeyError:
        raise DeviceError(f"weight format {dtype!r} is not one of {sorted(FORMATS)}") from None


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounded to nearest even."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32, exactly."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def encode(x: np.ndarray, fmt: int) -> np.ndarray:
    """float32 values -> storage values of format fmt (float32, or uint16 bits)."""
    x = np.asarray(x, np.float32)
    if fmt == FMT_F32:
        return x
    if fmt == FMT_BF16:
        return to_bf16_bits(x)
    return x.astype(np.float16).view(np.uint16)


def decode(stored: np.ndarray, fmt: int) -> np.ndarray:
    """Storage values of format fmt -> float32, exactly (what the kernels compute with)."""
    if fmt == FMT_F32:
        return np.asarray(stored, np.float32)
    if fmt == FMT_BF16:
        return from_bf16_bits(stored)
    return stored.view(np.float16).astype(np.float32)


def packed_shape(k: int, n: int) -> tuple[int, int, int]:
    """(panels, K, NR) of a packed K x N weight."""
    return (-(-n // NR), k, NR)


def pack(w: np.ndarray, fmt: int) -> np.ndarray:
    """W[K, N] (float32) -> its panels [ceil(N/NR), K, NR] in format fmt, zero past column N."""
    k, n = w.shape
    panels = np.zeros(packed_shape(k, n), STORAGE[fmt])
    full = n // NR
    stored = encode(w, fmt)                                             # [K, N]
    panels[:full] = stored[:, :full * NR].reshape(k, full, NR).transpose(1, 0, 2)
    if n % NR:
        panels[full, :, :n % NR] = stored[:, full * NR:]
    return panels


def unpack(panels: np.ndarray, n: int, fmt: int) -> np.ndarray:
    """The float32 K x N matrix the kernels compute with (inverse of pack, widened)."""
    p, k, nr = panels.shape
    return decode(panels, fmt).transpose(1, 0, 2).reshape(k, p * nr)[:, :n]


@dataclass(frozen=True, slots=True)
class GemmWeight:
    """A K x N GEMM weight on the card, in panels (see the module docstring)."""

    tensor: DeviceTensor     # [ceil(N/NR), K, NR] float32 or uint16
    k: int
    n: int
    fmt: int                 # FMT_F32, FMT_BF16 or FMT_F16

    @property
    def address(self) -> int:
        return self.tensor.address

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes

    def numpy(self) -> np.ndarray:
        """The float32 K x N matrix as the kernels see it (tests and debugging)."""
        return unpack(self.tensor.numpy(), self.n, self.fmt)


def place_gemm_weight(card: Card, w: np.ndarray, dtype: str) -> GemmWeight:
    """Pack W[K, N] into panels of format `dtype` and place it on `card`, once."""
    fmt = format_code(dtype)
    w = np.asarray(w)
    if w.ndim != 2:
        raise DeviceError(f"a GEMM weight is a K x N matrix, got shape {w.shape}")
    panels = pack(w, fmt)
    t = card.empty(panels.shape, panels.dtype)
    t.numpy()[...] = panels
    return GemmWeight(tensor=t, k=int(w.shape[0]), n=int(w.shape[1]), fmt=fmt)
