"""SwiGLU: silu(gate) * up, gate and up fused in one [T, 2I] projection.

silu(g) = g * sigmoid(g), with sigmoid from e = exp(-|g|) (never overflows):
sigmoid(g) = 1 / (1 + e) for g >= 0, e / (1 + e) for g < 0. The exponentials
go through `exp_nonpos`, in full vectors.
"""

import numpy as np
from numba import njit, prange

from spyre_serve.device.abi import chunks_for
from spyre_serve.device.kernels.fastexp import exp_nonpos


@njit(nogil=True, cache=True)
def _rows(out, gate_up, r0, r1):
    n = out.shape[1]
    e = np.empty(n, np.float32)
    one = np.float32(1.0)
    zero = np.float32(0.0)
    for t in range(r0, r1):
        gate, up, o = gate_up[t, :n], gate_up[t, n:], out[t]     # row views: loops from 0
        for i in range(n):
            e[i] = min(gate[i], -gate[i])  # -|g|
        exp_nonpos(e)
        for i in range(n):
            g = gate[i]
            num = max(e[i], one) if g >= zero else e[i]  # branch-free select
            o[i] = g * (num / (one + e[i])) * up[i]


@njit(nogil=True, cache=True, parallel=True)
def _parallel(out, gate_up):
    # the rows' loops written out in the parallel loop's body: Numba's parallel lowering
    # vectorizes them (the same loops in a called function took 2x as long here)
    t_n = out.shape[0]
    n = out.shape[1]
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


@njit(nogil=True, cache=True)
def swiglu(out, gate_up):
    """out[T, I] = silu(gate_up[:, :I]) * gate_up[:, I:]."""
    t_n, two_i = gate_up.shape
    n = two_i // 2
    if two_i % 2 != 0 or out.shape[0] != t_n or out.shape[1] != n:
        raise ValueError("swiglu: want out [T, I] and gate_up [T, 2I]; got out rows/cols, gate_up cols",
                         out.shape[0], out.shape[1], two_i)
    if chunks_for(t_n, t_n * n) == 1:
        _rows(out, gate_up, 0, t_n)
    else:
        _parallel(out, gate_up)
