"""The Mamba-2 mixer's kernels (Granite 4.0's hybrid layers), over a ragged batch with a state per sequence.

A Mamba-2 layer (transformers' GraniteMoeHybridMambaLayer) projects each token's hidden state to
[gate z | x B C | dt] (``in_proj``), then, per sequence and in token order:

    xBC    <- silu(causal depthwise conv1d(xBC) + bias)       ``mamba_conv``: a window of the
              last K - 1 inputs before the step is the sequence's conv state [K - 1, C]
    dt     <- clamp(softplus(dt + dt_bias), dt_min, dt_max)   (per head)
    state  <- state * exp(dt * A) + dt * x (outer) B          ``ssm_scan``: the SSM state
    y      <- state . C + D * x                                [H, P, N] per sequence
    out    <- w * rmsnorm_per_group(y * silu(z))               ``gated_rmsnorm``

and ``out_proj`` back to the hidden size (the GEMMs are the card's packed GEMM). The token's
heads share B and C by group (H / G heads a group).

Prefill and decode are one kernel each: a chunk of a sequence's prompt and a decode token both
advance the state token by token from where the sequence's last step left it (``reset``: a
sequence computed from position 0 starts from zeros; a chunked prefill's next chunk goes on
from the state its previous chunk left). transformers computes a prompt with the chunked SSD
form (the same recurrence, reassociated into GEMMs) and a decode token with this recurrence;
the tests hold both against these kernels.

The states live in device memory, one slot per running sequence (``seq_slot``): conv states
float32[slots, K - 1, C], SSM states float32[slots, H, P, N]. The checks raise static
exceptions (constant messages): a raise with runtime values compiled into two cached programs
crashed the process when it fired (models/step/program.py, ``_bounded``).
"""

import numpy as np
from numba import njit, prange

_REORDER = {"reassoc", "contract", "nsz", "arcp", "afn"}


@njit(nogil=True, cache=True, inline="always")
def _silu(v):
    # v * sigmoid(v) from e = exp(-|v|): never overflows
    e = np.exp(-abs(v))
    s = np.float32(1.0) / (np.float32(1.0) + e) if v >= 0 else e / (np.float32(1.0) + e)
    return v * s


@njit(nogil=True, cache=True, inline="always")
def _softplus(v):
    # torch's softplus (beta 1, threshold 20): v where v > 20, else log1p(exp(v))
    return v if v > np.float32(20.0) else np.float32(np.log1p(np.exp(v)))


@njit(nogil=True, cache=True, parallel=True, fastmath=_REORDER)
def mamba_conv(out, x, w, bias, states, seq_start, seq_slot, reset):
    """out[T, C] = silu(bias + sum_j w[:, j] * window[t + j]) for each sequence's rows, where the
    window is the sequence's conv state (its last K - 1 inputs; zeros where ``reset[s]``) followed
    by its rows of x[T, C]; then the state holds the window's last K - 1 rows. w: [C, K] (the
    conv's weight, transformers' [C, 1, K] squeezed), bias: [C], states: [slots, K - 1, C],
    seq_start: [S + 1] first row of each sequence, seq_slot: [S] its state slot (-1: none,
    a bucket's padding sequence: skipped)."""
    t_n, c_n = x.shape
    k_n = w.shape[1]
    if out.shape[0] != t_n or out.shape[1] != c_n or w.shape[0] != c_n or bias.shape[0] != c_n:
        raise ValueError("mamba_conv: out, x [T, C], w [C, K] and bias [C] disagree")
    if states.shape[1] != k_n - 1 or states.shape[2] != c_n:
        raise ValueError("mamba_conv: states are not [slots, K - 1, C]")
    s_n = seq_slot.shape[0]
    blocks = (c_n + 63) // 64
    for job in prange(s_n * blocks):
        s, b = job // blocks, job % blocks
        if seq_slot[s] < 0:               # a bucket's padding sequence
            continue
        c0, c1 = b * 64, min(c_n, (b + 1) * 64)
        r0, r1 = seq_start[s], seq_start[s + 1]
        st = states[seq_slot[s]]
        if reset[s]:
            st[:, c0:c1] = 0.0
        nc = c1 - c0
        win = np.empty((k_n - 1 + r1 - r0, nc), np.float32)
        win[:k_n - 1] = st[:, c0:c1]
        win[k_n - 1:] = x[r0:r1, c0:c1]
        wt = np.empty((k_n, nc), np.float32)      # the block's weights by tap: unit stride over channels
        for j in range(k_n):
            for c in range(nc):
                wt[j, c] = w[c0 + c, j]
        acc = np.empty(nc, np.float32)
        for t in range(r1 - r0):
            for c in range(nc):
                acc[c] = bias[c0 + c]
            for j in range(k_n):
                for c in range(nc):
                    acc[c] += wt[j, c] * win[t + j, c]
            for c in range(nc):
                out[r0 + t, c0 + c] = _silu(acc[c])
        st[:, c0:c1] = win[r1 - r0:]


@njit(nogil=True, cache=True, parallel=True, fastmath=_REORDER)
def ssm_scan(y, x, dt, b, c, a, d, dt_bias, dt_min, dt_max, states, seq_start, seq_slot, reset):
    """The SSM over each sequence's rows, token by token from its state (zeros where ``reset[s]``):
    y[T, H * P] and x[T, H * P] (head h's P values at h * P), dt[T, H] (before dt_bias and
    softplus), b and c [T, G * N] (group g's N values at g * N; head h reads group h // (H / G)),
    a[H] (negative: -exp(A_log)), d[H], dt_bias[H]; states [slots, H, P, N] left at the state
    after each sequence's last row."""
    t_n = x.shape[0]
    h_n, p_n, n_n = states.shape[1], states.shape[2], states.shape[3]
    g_n = b.shape[1] // n_n
    if x.shape[1] != h_n * p_n or y.shape[0] != t_n or y.shape[1] != h_n * p_n:
        raise ValueError("ssm_scan: x and y are not [T, H * P] for the states' [H, P, N]")
    if dt.shape[0] != t_n or dt.shape[1] != h_n or c.shape[1] != b.shape[1] or g_n * n_n != b.shape[1]:
        raise ValueError("ssm_scan: dt is not [T, H], or b and c are not [T, G * N]")
    if g_n == 0 or h_n % g_n != 0:
        raise ValueError("ssm_scan: the heads do not split into the groups of b and c")
    per_group = h_n // g_n
    s_n = seq_slot.shape[0]
    for job in prange(s_n * h_n):
        s, h = job // h_n, job % h_n
        if seq_slot[s] < 0:
            continue
        st = states[seq_slot[s], h]
        if reset[s]:
            st[:, :] = 0.0
        g0 = (h // per_group) * n_n
        # the row's B and C copied to unit-stride vectors: b and c are column slices of the conv's
        # output, whose stride the compiler cannot assume, so the state loop would not vectorize
        bt = np.empty(n_n, np.float32)
        ct = np.empty(n_n, np.float32)
        for t in range(seq_start[s], seq_start[s + 1]):
            delta = min(max(_softplus(dt[t, h] + dt_bias[h]), dt_min), dt_max)
            decay = np.float32(np.exp(delta * a[h]))
            for n in range(n_n):
                bt[n] = b[t, g0 + n]
                ct[n] = c[t, g0 + n]
            for p in range(p_n):
                xv = x[t, h * p_n + p]
                dx = delta * xv
                row = st[p]
                acc = np.float32(0.0)
                for n in range(n_n):
                    v = row[n] * decay + dx * bt[n]
                    row[n] = v
                    acc += v * ct[n]
                y[t, h * p_n + p] = acc + d[h] * xv


@njit(nogil=True, cache=True, parallel=True, fastmath=_REORDER)
def gated_rmsnorm(out, y, z, w, group, eps):
    """out[T, I] = w * rmsnorm(y * silu(z)) with the mean of squares taken over each ``group``
    consecutive values (transformers' GraniteMoeHybridRMSNormGated: I / G groups)."""
    t_n, i_n = y.shape
    if z.shape[0] != t_n or z.shape[1] != i_n or out.shape[0] != t_n or out.shape[1] != i_n or w.shape[0] != i_n:
        raise ValueError("gated_rmsnorm: out, y, z [T, I] and w [I] disagree")
    if group <= 0 or i_n % group != 0:
        raise ValueError("gated_rmsnorm: the group does not divide the width")
    groups = i_n // group
    for job in prange(t_n * groups):
        t, g0 = job // groups, (job % groups) * group
        ss = np.float32(0.0)
        for i in range(g0, g0 + group):
            v = y[t, i] * _silu(z[t, i])
            out[t, i] = v
            ss += v * v
        r = np.float32(1.0) / np.sqrt(ss / np.float32(group) + np.float32(eps))
        for i in range(g0, g0 + group):
            out[t, i] = w[i] * (out[t, i] * r)
