"""SwiGLU: silu(gate) * up, gate and up fused in one [T, 2I] projection.

silu(g) = g * sigmoid(g), with sigmoid from e = exp(-|g|) (never overflows):
sigmoid(g) = 1 / (1 + e) for g >= 0, e / (1 + e) for g < 0. The exponentials
go through `exp_nonpos`, which vectorizes.
"""

import numpy as np
from numba import njit, prange

from spyre_serve.device.kernels.fastexp import exp_nonpos


@njit(nogil=True, cache=True, parallel=True)
def swiglu(out, gate_up):
    """out[T, I] = silu(gate_up[:, :I]) * gate_up[:, I:]."""
    t_n, two_i = gate_up.shape
    n = two_i // 2
    if two_i % 2 != 0 or out.shape[0] != t_n or out.shape[1] != n:
        raise ValueError("swiglu: want out [T, I] and gate_up [T, 2I]; got out rows/cols, gate_up cols",
                         out.shape[0], out.shape[1], two_i)
    for t in prange(t_n):
        e = np.empty(n, np.float32)
        for i in range(n):
            e[i] = min(gate_up[t, i], -gate_up[t, i])  # -|g|
        exp_nonpos(e)
        one = np.float32(1.0)
        zero = np.float32(0.0)
        for i in range(n):
            g = gate_up[t, i]
            num = max(e[i], one) if g >= zero else e[i]  # branch-free select
            out[t, i] = g * (num / (one + e[i])) * gate_up[t, n + i]
