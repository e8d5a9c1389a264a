"""The online-softmax update of flash attention: one block of scores folded into a running
maximum, denominator and weighted sum, so attention never holds a row's whole score vector.

    online_softmax_block(scores, m, denom, acc, bits)
        scores float32[nq, cnt]  this block's scores (masked entries NEG_BIG); on return the
                                 block's weights exp(score - m_new), to multiply into V
        m, denom float32[nq]     the running maximum (NEG_BIG before any block) and denominator
        acc float32[nq, dv]      the running weighted sum of V rows, rescaled here to m_new
        bits int32[>= cnt]       scratch for exp_nonpos
A row that has seen only masked scores so far keeps m = NEG_BIG, gets all-zero weights and
adds nothing; the caller's final acc / denom must treat denom 0 as a row that saw nothing.
"""

import numpy as np
from numba import njit

from spyre_serve.device.kernels.fastexp import exp_nonpos

NEG_BIG = np.float32(-1.0e30)  # a masked score; finite: the loops assume no infinities


@njit(nogil=True, cache=True, inline="always")
def online_softmax_block(scores, m, denom, acc, bits):
    nq, cnt = scores.shape
    for qi in range(nq):
        sg = scores[qi]
        bmax = NEG_BIG
        for o in range(cnt):
            bmax = max(bmax, sg[o])
        m_new = max(m[qi], bmax)
        if m_new == NEG_BIG:  # nothing visible to this row yet: the block adds nothing
            sg[:] = 0.0
            continue
        corr = np.float32(np.exp(m[qi] - m_new))
        denom[qi] *= corr
        for i in range(acc.shape[1]):
            acc[qi, i] *= corr
        for o in range(cnt):
            sg[o] -= m_new
        exp_nonpos(sg, bits[:cnt])  # masked entries: -1e30 - m -> 0
        for o in range(cnt):
            denom[qi] += sg[o]
        m[qi] = m_new
