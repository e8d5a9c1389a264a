"""The embedding lookup of a table kept as the LM head's packed weight: a column of W[K, N]
in any format, widened to float32 exactly as the GEMM widens it, so a tied model keeps one
copy of its embedding, in the GEMM's layout and width.

    gather_columns(out, w, cols, scale, K, N, fmt)      out[T, K] = W[:, cols].T * scale
"""

import numpy as np
from numba import njit, prange

from spyre_serve.device.abi import chunks_for, f32_at, u16_at
from spyre_serve.device.kernels.formats import (
    FMT_BF16,
    FMT_F16,
    FMT_F32,
    FMT_FP8,
    FMT_Q4_0,
    FMT_Q6_K,
    FMT_Q6_K_MIN,
    FMT_Q8_0,
    GROUP_BYTES,
    HIGH_BITS,
    NIBBLE_BYTES,
    QUANTS_AT,
    WIDE_SCALE_BYTES,
    is_k_quant,
    is_quantized,
    packed_len,
    padded_k,
    record_bytes,
    widen,
)
from spyre_serve.device.kernels.simd import NR, QB


@njit(nogil=True, cache=True, inline="always")
def _half_at(w, i):
    """The float16 whose two little-endian bytes are w[i], w[i + 1], as float32."""
    lo, hi = np.uint16(np.uint8(w[i])), np.uint16(np.uint8(w[i + 1]))
    return widen(np.uint16(lo | (hi << np.uint16(8))), FMT_F16)


@njit(nogil=True, cache=True)
def _quantized_value(w, c, kk, k, fmt):
    """W[kk, c] of a block-quantized packed weight (uint8), as GGML's dequantizer gives it.
    (Typed for every weight dtype gather_columns takes; only uint8 ever reaches it.)"""
    j = c % NR
    r = kk % QB
    rec = record_bytes(fmt)
    r0 = (c // NR) * (k // QB) * rec + (kk // QB) * rec
    if is_k_quant(fmt):
        return _k_quant_value(w, r0, j, r, fmt)
    d = _half_at(w, r0 + 2 * j)
    q0 = r0 + QUANTS_AT[fmt]
    if fmt == FMT_Q8_0 or fmt == FMT_FP8:      # group r // 4, byte r % 4 of column j
        byte = np.uint8(w[q0 + (r // 4) * 4 * NR + 4 * j + r % 4])
        if fmt == FMT_FP8:       # E4M3 as the float16 (sign << 15 | rest << 7), times 256
            half = (np.uint16(byte & 0x80) << np.uint16(8)) | (np.uint16(byte & 0x7F) << np.uint16(7))
            return d * (widen(np.uint16(half), FMT_F16) * np.float32(256.0))
        return d * np.float32(np.int8(byte))
    rr = r % (QB // 2)
    byte = np.uint8(w[q0 + (rr // 4) * 4 * NR + 4 * j + rr % 4])
    q = np.float32((byte & 15) if r < QB // 2 else (byte >> 4))
    if fmt == FMT_Q4_0:
        return d * (q - np.float32(8.0))
    return d * q + _half_at(w, r0 + 2 * NR + 2 * j)


@njit(nogil=True, cache=True, inline="always")
def _f32_from(w, i):
    """The float32 whose four little-endian bytes are w[i..i+3]."""
    return w[i:i + 4].view(np.float32)[0]


@njit(nogil=True, cache=True)
def _k_quant_value(w, r0, j, r, fmt):
    """Row r of column j of the K-quant record at byte r0 (device/layout.py's planes)."""
    h, rr = r // (QB // 2), r % (QB // 2)
    mins = fmt == FMT_Q6_K_MIN                       # each half's scale and minimum
    q0 = r0 + QUANTS_AT[fmt]
    byte = np.uint8(w[q0 + (rr // 4) * GROUP_BYTES + 4 * j + rr % 4])
    q = np.int32((byte >> np.uint8(4 * h)) & np.uint8(15))
    hb = HIGH_BITS[fmt]
    if hb:
        at = (4 * h + rr // 4) * hb
        plane = np.uint8(w[q0 + NIBBLE_BYTES + (at // 8) * GROUP_BYTES + 4 * j + rr % 4])
        q |= np.int32((plane >> np.uint8(at % 8)) & np.uint8((1 << hb) - 1)) << 4
    if mins:
        at = r0 + 2 * h * WIDE_SCALE_BYTES + 4 * j
        return _f32_from(w, at) * np.float32(q) + _f32_from(w, at + WIDE_SCALE_BYTES)
    if fmt == FMT_Q6_K:
        d = _f32_from(w, r0 + h * WIDE_SCALE_BYTES + 4 * j)
        return d * (np.float32(q) - np.float32(32.0))
    # d q is exact in float32: one rounding, as the tiles' FMA
    return _f32_from(w, r0 + 4 * j) * np.float32(q) + _f32_from(w, r0 + WIDE_SCALE_BYTES + 4 * j)


@njit(nogil=True, cache=True)
def _columns(out, w, cols, s, k, n, fmt, t0, t1):
    for t in range(t0, t1):
        c = cols[t]
        if is_quantized(fmt):
            for kk in range(k):
                out[t, kk] = _quantized_value(w, c, kk, k, fmt) * s
        elif fmt == FMT_BF16:       # rows in pairs: row kk at (kk // 2) * 2 NR + 2 j + kk % 2
            base = (c // NR) * padded_k(k, fmt) * NR + 2 * (c % NR)
            for kk in range(k):
                out[t, kk] = widen(w[base + (kk >> 1) * 2 * NR + (kk & 1)], fmt) * s
        else:
            base = (c // NR) * k * NR + c % NR
            for kk in range(k):
                out[t, kk] = widen(w[base + kk * NR], fmt) * s


@njit(nogil=True, cache=True, parallel=True)
def _parallel(out, w, cols, s, k, n, fmt, chunks):
    m = cols.shape[0]
    for c in prange(chunks):
        _columns(out, w, cols, s, k, n, fmt, c * m // chunks, (c + 1) * m // chunks)


@njit(nogil=True, cache=True)
def gather_columns(out, w, cols, scale, k, n, fmt):
    """out[T, K] = W[:, cols].T * scale for W[K, N] packed in panels: the embedding lookup of
    a table stored as the K x N weight of the LM head (E.T, K = H, N = V), so a tied model
    keeps one copy of its embedding, in the GEMM's layout and width."""
    t_n = cols.shape[0]
    if out.shape[0] != t_n or out.shape[1] != k:
        raise ValueError("gather_columns: out must be [T, K]; T, K are", t_n, k)
    if w.shape[0] < packed_len(k, n, fmt):
        raise ValueError("gather_columns: packed weight too short (have, need)", w.shape[0],
                         packed_len(k, n, fmt))
    for t in range(t_n):
        if cols[t] < 0 or cols[t] >= n:
            raise IndexError("gather_columns: column out of range (column, N)", cols[t], n)
    s = np.float32(scale)
    chunks = chunks_for(t_n, 8 * t_n * k)          # strided reads: ~8 element-steps a value
    if chunks == 1:
        _columns(out, w, cols, s, k, n, fmt, 0, t_n)
    else:
        _parallel(out, w, cols, s, k, n, fmt, chunks)


@njit(nogil=True, cache=True)
def u8_at(u16, address, nbytes):
    """uint8[nbytes] at byte `address` (2-byte aligned, as every allocation is) of the arena."""
    return u16_at(u16, address, (nbytes + 1) // 2).view(np.uint8)[:nbytes]


@njit(nogil=True, cache=True, inline="always")
def gather_columns_at(out, f32, u16, address, cols, scale, k, n, fmt):
    """gather_columns with the weight at byte `address` of the arena."""
    size = packed_len(k, n, fmt)
    if fmt == FMT_F32:
        gather_columns(out, f32_at(f32, address, size), cols, scale, k, n, fmt)
    elif is_quantized(fmt):
        gather_columns(out, u8_at(u16, address, size), cols, scale, k, n, fmt)
    else:
        gather_columns(out, u16_at(u16, address, size), cols, scale, k, n, fmt)


@njit(nogil=True, cache=True)
def gather_rows(out, x, rows):
    """out[R, H] <- the rows `rows` of x[T, H]."""
    for r in range(rows.shape[0]):
        src = rows[r]
        for j in range(x.shape[1]):
            out[r, j] = x[src, j]
