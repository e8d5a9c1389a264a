"""Rotary position embedding, half-split form (HF LLaMA/Granite rotate_half).

For pair (x1 = x[:D/2], x2 = x[D/2:]) at angle a = position * inv_freq:
    x1' = x1 * cos(a) - x2 * sin(a)
    x2' = x2 * cos(a) + x1 * sin(a)
Angles are computed in float32 like transformers does (position as float32
times inv_freq), so large positions round the same way.
"""

import numpy as np
from numba import njit, prange


@njit(nogil=True, cache=True, parallel=True)
def rope_inplace(x, positions, inv_freq):
    """Rotate x[T, nh, D] in place; positions int32[T], inv_freq float32[D/2]."""
    t_n, nh, d = x.shape
    half = d // 2
    if d % 2 != 0:
        raise ValueError("rope_inplace: head dim must be even", d)
    if inv_freq.shape[0] != half:
        raise ValueError("rope_inplace: inv_freq length must be head_dim/2", inv_freq.shape[0], half)
    if positions.shape[0] != t_n:
        raise ValueError("rope_inplace: positions length differs from tokens", positions.shape[0], t_n)
    for t in prange(t_n):
        p = np.float32(positions[t])
        cos = np.empty(half, np.float32)
        sin = np.empty(half, np.float32)
        for i in range(half):
            ang = p * inv_freq[i]
            cos[i] = np.cos(ang)
            sin[i] = np.sin(ang)
        for h in range(nh):
            for i in range(half):
                x1 = x[t, h, i]
                x2 = x[t, h, half + i]
                x[t, h, i] = x1 * cos[i] - x2 * sin[i]
                x[t, h, half + i] = x2 * cos[i] + x1 * sin[i]
