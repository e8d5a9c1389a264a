"""Mixture of experts (Granite 4.0's and Granite 3.x MoE's feed-forward): route, group by expert, compute, combine.

transformers' GraniteMoeHybridMoE (and GraniteMoe's) for T token rows of hidden size H:

    logits[T, E] = x @ router^T;  each row's top k experts; their weights softmax(top-k logits)
    for each expert e, over the rows routed to it:  act = silu(x @ Wg_e^T) * (x @ Wu_e^T)
                                                    y   = act @ Wd_e^T
    out[t] = sum over t's experts, in expert order, of weight * y

Here the rows are grouped by expert once (``moe_order``: a counting sort of the T * k
(row, choice) pairs, stable), so each expert's GEMMs run on its rows together, gathered into a
contiguous block, through the card's packed GEMM on that expert's weights where they sit in the
arena (``moe_experts_at``: an [E, 2] table of byte addresses, gate_up [H, 2I] and down [I, H],
each placed once as every projection is). The combine adds each row's expert outputs in expert
order, from zeros, as transformers' index_add does. An expert no row chose costs nothing.

Checks raise static exceptions (models/step/program.py, ``_bounded``, says why).
"""

import numpy as np
from numba import njit, prange

from spyre_serve.device.kernels.activation import swiglu
from spyre_serve.device.kernels.gemm.packed import gemm_at


@njit(nogil=True, cache=True, parallel=True)
def moe_route(ids, weights, logits):
    """ids[T, k] <- each row's k largest logits[T, E] in descending order (ties: the lower expert
    first), weights[T, k] <- the softmax of those k logits."""
    t_n, e_n = logits.shape
    k_n = ids.shape[1]
    if ids.shape[0] != t_n or weights.shape[0] != t_n or weights.shape[1] != k_n or k_n > e_n or k_n < 1:
        raise ValueError("moe_route: ids and weights are not [T, k] with 1 <= k <= E")
    for t in prange(t_n):
        taken = np.zeros(e_n, np.bool_)
        for j in range(k_n):
            best = -1
            for e in range(e_n):
                if not taken[e] and (best < 0 or logits[t, e] > logits[t, best]):
                    best = e
            taken[best] = True
            ids[t, j] = best
        top = logits[t, ids[t, 0]]
        total = np.float32(0.0)
        for j in range(k_n):
            v = np.float32(np.exp(logits[t, ids[t, j]] - top))
            weights[t, j] = v
            total += v
        for j in range(k_n):
            weights[t, j] /= total


@njit(nogil=True, cache=True)
def moe_order(order, starts, ids):
    """order[T * k] <- the (row, choice) pairs ``row * k + choice`` grouped by expert, in row
    order within an expert; starts[E + 1] <- where each expert's pairs begin."""
    t_n, k_n = ids.shape
    e_n = starts.shape[0] - 1
    if order.shape[0] != t_n * k_n:
        raise ValueError("moe_order: order is not [T * k]")
    starts[:] = 0
    for t in range(t_n):
        for j in range(k_n):
            e = ids[t, j]
            if e < 0 or e >= e_n:
                raise ValueError("moe_order: an expert id out of range")
            starts[e + 1] += 1
    for e in range(e_n):
        starts[e + 1] += starts[e]
    fill = starts[:e_n].copy()
    for t in range(t_n):
        for j in range(k_n):
            e = ids[t, j]
            order[fill[e]] = t * k_n + j
            fill[e] += 1


@njit(nogil=True, cache=True, inline="always")
def moe_experts_at(out, x, weights, order, starts, rows, gate_up, act, down, f32, u16, experts, fmts, act_fmt):
    """out[T, H] = each row's experts' SwiGLU MLPs weighted by ``weights[T, k]`` (``moe_route``),
    over the pairs grouped by ``moe_order``. Workspace, [T * k, ...] each: rows [H], gate_up [2I],
    act [I], down [H]. experts: int64[E, 2] byte addresses of each expert's packed gate_up [H, 2I]
    and down [I, H]; fmts: int64[2] their number formats; act_fmt: the GEMM inputs' format."""
    t_n, h_n = x.shape
    k_n = weights.shape[1]
    i_n = act.shape[1]
    if rows.shape[0] < t_n * k_n or rows.shape[1] != h_n or gate_up.shape[1] != 2 * i_n or down.shape[1] != h_n:
        raise ValueError("moe_experts_at: the workspace is not [T * k, H | 2I | I | H]")
    for e in range(experts.shape[0]):
        s0, s1 = starts[e], starts[e + 1]
        if s1 == s0:
            continue
        for j in range(s0, s1):
            src = order[j] // k_n
            for c in range(h_n):
                rows[j, c] = x[src, c]
        gemm_at(gate_up[s0:s1], rows[s0:s1], f32, u16, experts[e, 0], h_n, 2 * i_n, fmts[0], act_fmt)
        swiglu(act[s0:s1], gate_up[s0:s1])
        gemm_at(down[s0:s1], act[s0:s1], f32, u16, experts[e, 1], i_n, h_n, fmts[1], act_fmt)
    out[:, :] = 0.0
    for j in range(t_n * k_n):          # expert by expert: each row's sum in expert order
        t, choice = order[j] // k_n, order[j] % k_n
        w = weights[t, choice]
        for c in range(h_n):
            out[t, c] += w * down[j, c]
