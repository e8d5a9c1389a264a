"""Rotary position embedding, half-split form (HF LLaMA/Granite rotate_half).

For pair (x1 = x[:D/2], x2 = x[D/2:]) at angle a = position * inv_freq:
    x1' = x1 * cos(a) - x2 * sin(a)
    x2' = x2 * cos(a) + x1 * sin(a)
Angles are computed in float32 like transformers does (position as float32
times inv_freq), so large positions round the same way.

A step computes each row's cos and sin once (`rope_tables`: libm calls, one pair an angle)
and every layer rotates q and k with them while splitting the fused QKV rows (`split_rope`:
multiply-adds only); `rope_inplace` (tables, then `rope_apply`) rotates one tensor alone.
"""

import numpy as np
from numba import njit, prange

from spyre_serve.device.abi import chunks_for


@njit(nogil=True, cache=True)
def _tables_rows(cos, sin, positions, inv_freq, r0, r1):
    for t in range(r0, r1):
        p = np.float32(positions[t])
        for i in range(cos.shape[1]):
            ang = p * inv_freq[i]
            cos[t, i] = np.cos(ang)
            sin[t, i] = np.sin(ang)


@njit(nogil=True, cache=True, parallel=True)
def _tables_parallel(cos, sin, positions, inv_freq, chunks):
    m = cos.shape[0]
    for c in prange(chunks):
        _tables_rows(cos, sin, positions, inv_freq, c * m // chunks, (c + 1) * m // chunks)


@njit(nogil=True, cache=True)
def rope_tables(cos, sin, positions, inv_freq):
    """cos, sin [T, D/2] of the angles positions[t] * inv_freq[i] (float32)."""
    t_n, half = cos.shape
    if sin.shape != cos.shape or inv_freq.shape[0] != half or positions.shape[0] != t_n:
        raise ValueError("rope_tables: want cos, sin [T, D/2], positions [T], inv_freq [D/2] "
                         "(T, D/2)", t_n, half)
    chunks = chunks_for(t_n, 16 * t_n * half)      # a sine and a cosine: ~16 element-steps
    if chunks == 1:
        _tables_rows(cos, sin, positions, inv_freq, 0, t_n)
    else:
        _tables_parallel(cos, sin, positions, inv_freq, chunks)


@njit(nogil=True, cache=True, parallel=True)
def rope_apply(x, cos, sin):
    """Rotate x[T, nh, D] in place by the rows' tables cos, sin [T, D/2]."""
    t_n, nh, d = x.shape
    half = d // 2
    if d % 2 != 0:
        raise ValueError("rope_apply: head dim must be even", d)
    if cos.shape[0] < t_n or cos.shape[1] != half or sin.shape != cos.shape:
        raise ValueError("rope_apply: want cos, sin [>= T, D/2] (T, D/2)", t_n, half)
    for t in prange(t_n):
        for h in range(nh):
            for i in range(half):
                x1 = x[t, h, i]
                x2 = x[t, h, half + i]
                x[t, h, i] = x1 * cos[t, i] - x2 * sin[t, i]
                x[t, h, half + i] = x2 * cos[t, i] + x1 * sin[t, i]


@njit(nogil=True, cache=True)
def rope_inplace(x, positions, inv_freq):
    """Rotate x[T, nh, D] in place; positions int32[T], inv_freq float32[D/2] (the tables and
    the rotation in one call: for a single use of the angles)."""
    t_n, nh, d = x.shape
    half = d // 2
    if d % 2 != 0:
        raise ValueError("rope_inplace: head dim must be even", d)
    if inv_freq.shape[0] != half:
        raise ValueError("rope_inplace: inv_freq length must be head_dim/2", inv_freq.shape[0], half)
    if positions.shape[0] != t_n:
        raise ValueError("rope_inplace: positions length differs from tokens", positions.shape[0], t_n)
    cos = np.empty((t_n, half), np.float32)
    sin = np.empty((t_n, half), np.float32)
    rope_tables(cos, sin, positions, inv_freq)
    rope_apply(x, cos, sin)


@njit(nogil=True, cache=True, inline="always")
def _split_row(qt, kt, vt, row, cos_t, sin_t):
    """One row: qkv's row split into qt [Hq, D], kt, vt [Hkv, D], qt and kt rotated. The
    row arrays come sliced, so the loops run from 0 (Numba vectorizes those, inlined into a
    parallel body or not)."""
    hq, d = qt.shape
    hkv = kt.shape[0]
    half = d // 2
    for h in range(hq + hkv):
        base = h * d
        out = qt[h] if h < hq else kt[h - hq]
        for i in range(half):
            x1 = row[base + i]
            x2 = row[base + half + i]
            out[i] = x1 * cos_t[i] - x2 * sin_t[i]
            out[half + i] = x2 * cos_t[i] + x1 * sin_t[i]
    vbase = (hq + hkv) * d
    for h in range(hkv):
        for i in range(d):
            vt[h, i] = row[vbase + h * d + i]


@njit(nogil=True, cache=True)
def _split_rows(q, k, v, qkv, cos, sin, r0, r1):
    for t in range(r0, r1):
        _split_row(q[t], k[t], v[t], qkv[t], cos[t], sin[t])


@njit(nogil=True, cache=True, parallel=True)
def _split_parallel(q, k, v, qkv, cos, sin):
    for t in prange(q.shape[0]):
        _split_row(q[t], k[t], v[t], qkv[t], cos[t], sin[t])


@njit(nogil=True, cache=True)
def split_rope(q, k, v, qkv, cos, sin):
    """The fused QKV projection's rows split into q [T, Hq, D], k, v [T, Hkv, D], q and k
    rotated by the rows' tables cos, sin [>= T, D/2] on the way: one pass over qkv
    [T, Hq D + 2 Hkv D]."""
    t_n, hq, d = q.shape
    hkv = k.shape[1]
    half = d // 2
    if (qkv.shape[0] != t_n or qkv.shape[1] != (hq + 2 * hkv) * d or k.shape != v.shape
            or k.shape[0] != t_n or k.shape[2] != d or d % 2 != 0):
        raise ValueError("split_rope: want q [T, Hq, D], k, v [T, Hkv, D] and qkv "
                         "[T, (Hq + 2 Hkv) D] (T, Hq, Hkv, D)", t_n, hq, hkv, d)
    if cos.shape[0] < t_n or cos.shape[1] != half or sin.shape != cos.shape:
        raise ValueError("split_rope: want cos, sin [>= T, D/2] (T, D/2)", t_n, half)
    if chunks_for(t_n, qkv.shape[0] * qkv.shape[1]) == 1:
        _split_rows(q, k, v, qkv, cos, sin, 0, t_n)
    else:
        _split_parallel(q, k, v, qkv, cos, sin)
