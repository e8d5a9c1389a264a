"""Scaled dot-product attention, float32, as torch's `scaled_dot_product_attention` defines it:

    out[b, h] = softmax(q[b, h] @ k[b, g].T * scale + mask[b, h]) @ v[b, g]      g = h // (hq / hkv)

q [B, Hq, L, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv], each read through its batch, head and
row strides (the last dim contiguous); out [B, Hq, L, Dv] row-major. The mask is additive
(float32) or boolean (False: not attended), read through its strides (0 where broadcast);
`causal`: query i sees keys j <= i (torch's top-left alignment). A query row that sees no key
gives zeros (torch's math path does the same).

The loop is the card's paged attention (device/kernels/attention/paged.py) on dense K/V: work items,
in parallel, are (batch, KV head, a tile of query rows with every query head of that group);
keys come in blocks of KB, copied contiguous, with an online softmax (running max and sum,
exponentials by the card's vectorized `exp_nonpos`), and a causal tile stops at its last
row's key. Tiles of enough query vectors multiply through two single-threaded BLAS
micro-GEMMs per block (scores = q @ k.T, acc += p @ v); a few rows (decode) use dot loops.
`scratch` is unused (kept in the slot list: the host may give none).
"""

import numpy as np
from numba import njit, prange

from spyre_serve.device.abi import get_kernel_threads, set_kernel_threads
from spyre_serve.device.kernels.attention.online_softmax import NEG_BIG, online_softmax_block
from spyre_torch.kernels import ATTENTION, index
from spyre_torch.kernels.access import BOOL, F32, as_float

_I = index(ATTENTION)
BATCH, HQ, HKV, L, S, D, DV = _I["batch"], _I["hq"], _I["hkv"], _I["l"], _I["s"], _I["d"], _I["dv"]
CAUSAL, SCALE, MASK_DT = _I["causal"], _I["scale"], _I["mask_dt"]
Q, K, V, OUT, MASK = _I["q"], _I["k"], _I["v"], _I["out"], _I["mask"]
Q_BS, Q_HS, Q_LS = _I["q_bs"], _I["q_hs"], _I["q_ls"]
K_BS, K_HS, K_SS, V_BS, V_HS, V_SS = _I["k_bs"], _I["k_hs"], _I["k_ss"], _I["v_bs"], _I["v_hs"], _I["v_ss"]
M_BS, M_HS, M_LS, M_SS = _I["m_bs"], _I["m_hs"], _I["m_ls"], _I["m_ss"]

KB = 64                      # keys per block
QV_MAX = 128                 # query vectors per work item
BLAS_SERIAL_MNK = 262144     # OpenBLAS multiplies GEMMs up to this m*n*k on the calling thread
BLAS_MIN_QV = 16             # fewer query vectors: dot loops (a BLAS call costs more)
# less work than this runs on one core: ~10 ms on one; a decode row over 1024 keys (2 MFLOP)
# took 6 ms in parallel on the shared 2-core machine (each fork/join can wait a time slice for
# a descheduled worker, models/step/threads.py) against 0.2 ms on one core
PARALLEL_FLOPS = 50_000_000


@njit(nogil=True, cache=True)
def _mask_block(scores, u8, f32, mask_dt, mask, m_bs, m_hs, m_ls, m_ss, b, h0, group, r0,
                k0, cnt, causal):
    """Masked entries of the block's scores [nqv, cnt] (keys k0..) set to NEG_BIG, the float
    mask added; rows qi = (row - r0) * group + (head - h0)."""
    for qi in range(scores.shape[0]):
        i = r0 + qi // group
        h = h0 + qi % group
        row = mask + b * m_bs + h * m_hs + i * m_ls
        for o in range(cnt):
            x = scores[qi, o]
            if causal and k0 + o > i:
                x = NEG_BIG
            elif mask_dt == F32:
                x = x + f32[row + (k0 + o) * m_ss]
            elif mask_dt == BOOL and u8[row + (k0 + o) * m_ss] == 0:
                x = NEG_BIG
            scores[qi, o] = max(x, NEG_BIG)  # -inf in a float mask: masked too


@njit(nogil=True, cache=True)
def attention(f32, i32, i64, u16, table):
    """The entry: on one core when the work is small (a decode row: a parallel region's
    fork/join would cost more, and wait for a descheduled worker on a busy machine)."""
    flops = 2 * table[BATCH] * table[HQ] * table[L] * table[S] * (table[D] + table[DV])
    threads = get_kernel_threads()
    if flops < PARALLEL_FLOPS and threads > 1:
        set_kernel_threads(1)
        _attention(f32, u16, table)
        set_kernel_threads(threads)
    else:
        _attention(f32, u16, table)


@njit(nogil=True, cache=True, parallel=True, fastmath={"reassoc", "contract", "arcp", "afn", "nsz"})
def _attention(f32, u16, table):
    u8 = u16.view(np.uint8)
    batch, hq, hkv = table[BATCH], table[HQ], table[HKV]
    l_n, s_n, d, dv = table[L], table[S], table[D], table[DV]
    causal, mask_dt = table[CAUSAL] != 0, table[MASK_DT]
    sc = np.float32(as_float(table[SCALE]))
    group = hq // hkv
    q0, k0_, v0, out0 = table[Q] >> 2, table[K] >> 2, table[V] >> 2, table[OUT] >> 2
    mask = table[MASK] >> 2 if mask_dt == F32 else table[MASK]
    q_bs, q_hs, q_ls = table[Q_BS], table[Q_HS], table[Q_LS]
    k_bs, k_hs, k_ss = table[K_BS], table[K_HS], table[K_SS]
    v_bs, v_hs, v_ss = table[V_BS], table[V_HS], table[V_SS]
    m_bs, m_hs, m_ls, m_ss = table[M_BS], table[M_HS], table[M_LS], table[M_SS]
    qv_max = max(group, min(QV_MAX, BLAS_SERIAL_MNK // (KB * max(d, dv))))
    row_tile = max(1, qv_max // group)
    tiles = (l_n + row_tile - 1) // row_tile
    for item in prange(batch * hkv * tiles):
        b = item // (hkv * tiles)
        g = (item // tiles) % hkv
        r0 = (item % tiles) * row_tile
        nr = min(row_tile, l_n - r0)
        nqv = nr * group
        h0 = g * group
        n_keys = min(s_n, r0 + nr) if causal else s_n  # keys the tile's last row can see
        use_blas = nqv >= BLAS_MIN_QV
        qt = np.empty((nqv, d), np.float32)  # the tile's query vectors, scaled
        for j in range(nr):
            for gg in range(group):
                p = q0 + b * q_bs + (h0 + gg) * q_hs + (r0 + j) * q_ls
                for i in range(d):
                    qt[j * group + gg, i] = f32[p + i] * sc
        acc = np.zeros((nqv, dv), np.float32)
        pv = np.empty((nqv, dv), np.float32)
        kb = np.empty((KB, d), np.float32)
        vb = np.empty((KB, dv), np.float32)
        sbuf = np.empty(nqv * KB, np.float32)
        m = np.full(nqv, NEG_BIG, np.float32)
        denom = np.zeros(nqv, np.float32)
        bits = np.empty(2 * nqv, np.int32)
        kbase = k0_ + b * k_bs + g * k_hs
        vbase = v0 + b * v_bs + g * v_hs
        for k0 in range(0, n_keys, KB):
            cnt = min(KB, n_keys - k0)
            for o in range(cnt):
                pk = kbase + (k0 + o) * k_ss
                pvv = vbase + (k0 + o) * v_ss
                kb[o, :] = f32[pk:pk + d]
                vb[o, :] = f32[pvv:pvv + dv]
            scores = sbuf[:nqv * cnt].reshape(nqv, cnt)
            if use_blas:
                np.dot(qt, kb[:cnt].T, scores)
            else:
                for qi in range(nqv):
                    for o in range(cnt):
                        dot = np.float32(0.0)
                        for i in range(d):
                            dot += qt[qi, i] * kb[o, i]
                        scores[qi, o] = dot
            if causal or mask_dt >= 0:
                _mask_block(scores, u8, f32, mask_dt, mask, m_bs, m_hs, m_ls, m_ss, b, h0,
                            group, r0, k0, cnt, causal)
            online_softmax_block(scores, m, denom, acc, bits)
            if use_blas:
                np.dot(scores, vb[:cnt], pv)
                for qi in range(nqv):
                    for i in range(dv):
                        acc[qi, i] += pv[qi, i]
            else:
                for o in range(cnt):
                    for qi in range(nqv):
                        w = scores[qi, o]
                        if w != 0.0:
                            for i in range(dv):
                                acc[qi, i] += w * vb[o, i]
        for j in range(nr):
            for gg in range(group):
                qi = j * group + gg
                inv = np.float32(1.0) / denom[qi] if denom[qi] > 0.0 else np.float32(0.0)
                p = out0 + ((b * hq + h0 + gg) * l_n + r0 + j) * dv
                for i in range(dv):
                    f32[p + i] = acc[qi, i] * inv
