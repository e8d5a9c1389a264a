"""A float32 exp that vectorizes, for the exponentials of softmax-like sums.

np.exp inside njit compiles to a scalar libm call here (llvmlite has no SVML),
so a loop of them runs one element at a time. `exp_nonpos` evaluates Cephes'
expf polynomial and builds 2**k from its bit pattern; LLVM vectorizes both
loops. Arguments are <= 0 (x - max), as in every softmax.
"""

import numpy as np
from numba import njit

_LOG_UNDERFLOW = np.float32(-87.0)  # exp below this is 0 or denormal in float32
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)  # ln 2 in two parts (Cody-Waite), as Cephes expf
_LN2_LO = np.float32(-2.12194440e-4)


@njit(nogil=True, cache=True, fastmath=True)
def exp_nonpos(x, bits):
    """x[n] = exp(x[n]) in place for x <= 0, float32, within 3e-7 relative;
    x < -87 (and -inf) gives 0. bits int32[n] scratch. Cephes' expf polynomial, with 2**k built from
    its bits, so the loop vectorizes (np.exp does not here: no SVML)."""
    for i in range(x.shape[0]):
        xi = x[i]
        v = max(xi, _LOG_UNDERFLOW)
        k = np.floor(v * _LOG2E + np.float32(0.5))
        r = v - k * _LN2_HI - k * _LN2_LO
        p = np.float32(1.9875691500e-4)
        p = p * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        x[i] = p * r * r + r + np.float32(1.0)
        # 2**k as float32 bits; 0 (the float +0.0) flushes x < -87 to zero
        bits[i] = (np.int32(k) + np.int32(127)) << np.int32(23) if xi >= _LOG_UNDERFLOW else 0
    scale = bits.view(np.float32)
    for i in range(x.shape[0]):
        x[i] *= scale[i]
