"""SwiGLU: silu(gate) * up, gate and up fused in one [T, 2I] projection."""

import numpy as np
from numba import njit, prange


@njit(nogil=True, cache=True, parallel=True)
def swiglu(out, gate_up):
    """out[T, I] = silu(gate_up[:, :I]) * gate_up[:, I:]."""
    t_n, two_i = gate_up.shape
    n = two_i // 2
    if two_i % 2 != 0 or out.shape[0] != t_n or out.shape[1] != n:
        raise ValueError("swiglu: want out [T, I] and gate_up [T, 2I]; got out rows/cols, gate_up cols",
                         out.shape[0], out.shape[1], two_i)
    for t in prange(t_n):
        for i in range(n):
            g = gate_up[t, i]
            out[t, i] = g / (np.float32(1.0) + np.exp(-g)) * gate_up[t, n + i]
