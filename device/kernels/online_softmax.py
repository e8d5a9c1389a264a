"""The online-softmax update of flash attention: one block of scores folded into a running
maximum, denominator and weighted sum, so attention never holds a row's whole score vector.

    online_softmax_block(scores, m, denom, acc, bits)
        scores float32[nq, cnt]  this block's scores (masked entries NEG_BIG); on return the
                                 block's weights exp(score - m_new), to multiply into V
        m, denom float32[nq]     the running maximum (NEG_BIG before any block) and denominator
        acc float32[nq, dv]      the running weighted sum of V rows, rescaled here to m_new
        bits int32[>= nq * (cnt + 3)]  scratch (exp_nonpos's, and two values a row)
A row that has seen only masked scores so far keeps m = NEG_BIG, gets all-zero weights and
adds nothing; the caller's final acc / denom must treat denom 0 as a row that saw nothing.
The block's exponentials are one pass over all nq * cnt scores (scores C-contiguous), so the
polynomial runs in full vectors however short a row is.
"""

import numpy as np
from numba import njit

from spyre_serve.device.kernels.fastexp import exp_nonpos

NEG_BIG = np.float32(-1.0e30)  # a masked score; finite: the loops assume no infinities


@njit(nogil=True, cache=True, inline="always")
def online_softmax_block(scores, m, denom, acc, bits):
    nq, cnt = scores.shape
    n = nq * cnt
    if bits.shape[0] < n + 3 * nq:
        raise ValueError("online_softmax_block: bits needs nq * (cnt + 3) values (have, need)",
                         bits.shape[0], n + 3 * nq)
    corr = bits[n:n + nq].view(np.float32)       # exp(m_old - m_new) of each row
    m_new = bits[n + nq:n + 2 * nq].view(np.float32)
    for qi in range(nq):
        bmax = NEG_BIG
        for o in range(cnt):
            bmax = max(bmax, scores[qi, o])
        m_new[qi] = max(m[qi], bmax)
        corr[qi] = m[qi] - m_new[qi]
    exp_nonpos(corr, bits[n + 2 * nq:n + 3 * nq])
    for qi in range(nq):
        mn = m_new[qi]
        if mn == NEG_BIG:      # nothing visible to this row yet: weights 0 (exp of -1e30)
            for o in range(cnt):
                scores[qi, o] = NEG_BIG
            continue
        c = corr[qi]
        denom[qi] *= c
        for i in range(acc.shape[1]):
            acc[qi, i] *= c
        for o in range(cnt):
            scores[qi, o] -= mn  # masked entries: -1e30 - m, exp 0
        m[qi] = mn
    exp_nonpos(scores.reshape(n), bits[:n])
    for qi in range(nq):
        total = np.float32(0.0)
        for o in range(cnt):
            total += scores[qi, o]
        denom[qi] += total
