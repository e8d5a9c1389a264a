"""Scaled dot-product attention, float32, as torch's `scaled_dot_product_attention` defines it:

    out[b, h] = softmax(q[b, h] @ k[b, g].T * scale + mask[b, h]) @ v[b, g]      g = h // (hq / hkv)

q [B, Hq, L, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv], each read through its batch, head and
row strides (the last dim contiguous); out [B, Hq, L, Dv] row-major. The mask is additive
(float32) or boolean (False: not attended), read through its strides (0 where broadcast);
`causal`: query i sees keys j <= i (torch's top-left alignment). A query row that sees no key
gives zeros (torch's math path does the same).

Per (b, kv head) the kernel copies k and v into row-major scratch once, and per query head
its q rows; the two products go to BLAS: scores [L, S] = q @ k.T, out = p @ v.
scratch: float32 [L*D + S*D + S*Dv + L*S].
"""

import math

import numpy as np
from numba import njit

from device.abi import f32_at
from spyre_torch.kernels import ATTENTION, index
from spyre_torch.kernels.access import BOOL, F32, as_float, views

_I = index(ATTENTION)
BATCH, HQ, HKV, L, S, D, DV = _I["batch"], _I["hq"], _I["hkv"], _I["l"], _I["s"], _I["d"], _I["dv"]
CAUSAL, SCALE, MASK_DT = _I["causal"], _I["scale"], _I["mask_dt"]
Q, K, V, OUT, MASK, SCRATCH = _I["q"], _I["k"], _I["v"], _I["out"], _I["mask"], _I["scratch"]
Q_BS, Q_HS, Q_LS = _I["q_bs"], _I["q_hs"], _I["q_ls"]
K_BS, K_HS, K_SS, V_BS, V_HS, V_SS = _I["k_bs"], _I["k_hs"], _I["k_ss"], _I["v_bs"], _I["v_hs"], _I["v_ss"]
M_BS, M_HS, M_LS, M_SS = _I["m_bs"], _I["m_hs"], _I["m_ls"], _I["m_ss"]


@njit(nogil=True, cache=True)
def _rows(dst, f32, start, row_stride, rows, cols):
    """dst[rows, cols] = the rows at f32[start + r * row_stride : + cols]."""
    for r in range(rows):
        p = start + r * row_stride
        dst[r, :] = f32[p:p + cols]


@njit(nogil=True, cache=True, error_model="numpy")
def _softmax_rows(p, f32, u8, b, h, l_n, s_n, scale, mask_dt, mask, m_bs, m_hs, m_ls, m_ss, causal):
    """p[L, S] = softmax(p * scale + mask) per row, in place; rows that see nothing -> 0."""
    for i in range(l_n):
        mx = -math.inf
        mrow = mask + b * m_bs + h * m_hs + i * m_ls
        for j in range(s_n):
            x = np.float64(p[i, j]) * scale
            if causal and j > i:
                x = -math.inf
            elif mask_dt == F32:
                x += f32[mrow + j * m_ss]
            elif mask_dt == BOOL and u8[mrow + j * m_ss] == 0:
                x = -math.inf
            p[i, j] = x
            if x > mx:
                mx = x
        if mx == -math.inf:
            p[i, :] = 0.0
            continue
        total = 0.0
        for j in range(s_n):
            e = math.exp(np.float64(p[i, j]) - mx)
            p[i, j] = e
            total += e
        r = 1.0 / total
        for j in range(s_n):
            p[i, j] = np.float32(np.float64(p[i, j]) * r)


@njit(nogil=True, cache=True, error_model="numpy")
def attention(f32, i32, i64, u16, table):
    V_ = views(f32, i32, i64, u16)
    u8 = V_[4]
    batch, hq, hkv = table[BATCH], table[HQ], table[HKV]
    l_n, s_n, d, dv = table[L], table[S], table[D], table[DV]
    causal, scale, mask_dt = table[CAUSAL] != 0, as_float(table[SCALE]), table[MASK_DT]
    group = hq // hkv
    q0, k0, v0 = table[Q] >> 2, table[K] >> 2, table[V] >> 2
    mask = table[MASK] >> 2 if mask_dt == F32 else table[MASK]
    sc = f32_at(f32, table[SCRATCH], l_n * d + s_n * d + s_n * dv + l_n * s_n)
    qs = sc[:l_n * d].reshape(l_n, d)
    ks = sc[l_n * d:l_n * d + s_n * d].reshape(s_n, d)
    vs = sc[l_n * d + s_n * d:l_n * d + s_n * d + s_n * dv].reshape(s_n, dv)
    p = sc[l_n * d + s_n * d + s_n * dv:].reshape(l_n, s_n)
    for b in range(batch):
        for g in range(hkv):
            _rows(ks, f32, k0 + b * table[K_BS] + g * table[K_HS], table[K_SS], s_n, d)
            _rows(vs, f32, v0 + b * table[V_BS] + g * table[V_HS], table[V_SS], s_n, dv)
            for h in range(g * group, (g + 1) * group):
                _rows(qs, f32, q0 + b * table[Q_BS] + h * table[Q_HS], table[Q_LS], l_n, d)
                np.dot(qs, ks.T, p)
                _softmax_rows(p, f32, u8, b, h, l_n, s_n, scale, mask_dt, mask, table[M_BS],
                              table[M_HS], table[M_LS], table[M_SS], causal)
                out = f32_at(f32, table[OUT] + 4 * ((b * hq + h) * l_n * dv), l_n * dv)
                np.dot(p, vs, out.reshape(l_n, dv))
