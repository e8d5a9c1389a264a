"""A GEMM's inputs as its tiles read them (device/kernels/gemm/packed.py), prepared once per GEMM:

    float32 as they are                             (ACT_F32)
    rounded to bfloat16 / float16 / DLFloat16,      (FMT_BF16 / FMT_F16 / FMT_DLF16 inputs,
      still float32                                   widening tiles)
    bfloat16 bits, K padded with zeros              (bf16 x bf16 on a level with vdpbf16ps/AMX:
                                                      micro-panels of PANEL_ROWS rows for the
                                                      dot tiles, rows for AMX's A tiles)
    int8 per row in blocks of QB, with scales       (ACT_INT8: a quantized weight's)

`gemm_inputs(a, m, k, fmt, act, row_major)` returns them as one tuple and the mode that says which the
tiles read; `round_to_format` rounds in place (tests and torch-spyre use it too).
"""

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from spyre_serve.device.abi import chunks_for, get_kernel_threads
from spyre_serve.device.kernels.formats import (
    FMT_BF16,
    FMT_DLF16,
    FMT_F16,
    dlfloat16_round,
    has_integer_quants,
    padded_k,
)
from spyre_serve.device.kernels.simd import F32, QB, has_bf16_dot

ACT_F32, ACT_INT8 = 0, 6   # GEMM inputs: float32, or int8 per block of QB (quantized weights);
# FMT_BF16 / FMT_F16 / FMT_DLF16 as an input format: rounded to that format once per GEMM
# which of the inputs the tiles read: bfloat16 pairs in micro-panels (MODE_DOT) or in rows
MODE_FLOAT, MODE_INT8, MODE_DOT, MODE_DOT_ROWS = 0, 1, 2, 3
# Rows of a micro-panel of bfloat16 inputs (the tallest AVX-512 tile): panel p's pair q (values
# 2q, 2q + 1) of its row i at uint16 element (p kp / 2 + q) 2 PANEL_ROWS + 2 i, so that a
# tile's broadcasts of one pair of all its rows read one 64-byte line, one stream in all (as
# BLIS packs A). Rows in plain order (a pair of each row in another line: one stream a row)
# held `vdpbf16ps` to 60-77% of its peak where A comes from L2 (Zen 4: 139-179 of 233
# GFLOP/s a core in C, the micro-panels 222). Fewer rows than a panel (a decode of a few
# sequences) stay in rows: a panel would pad them to PANEL_ROWS, and one row is one stream.
PANEL_ROWS = 16


@njit(nogil=True, cache=True)
def _quantize_span(af, k, aq, ad, asum, r0, r1):
    nb = k // QB
    for r in range(r0, r1):
        for b in range(nb):
            base = r * k + b * QB
            amax = np.float32(0.0)
            for t in range(QB):
                amax = max(amax, abs(af[base + t]))
            d = amax / np.float32(127.0)
            inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
            total = 0
            for t in range(QB):
                v = af[base + t] * inv
                q = np.int32(np.floor(abs(v) + np.float32(0.5)))
                q = -q if v < 0 else q
                aq[base + t] = q
                total += q
            ad[r * nb + b] = d
            asum[r * nb + b] = np.float32(total)


@njit(nogil=True, cache=True, parallel=True)
def _quantize_parallel(af, m, k, aq, ad, asum, chunks):
    for c in prange(chunks):
        _quantize_span(af, k, aq, ad, asum, c * m // chunks, (c + 1) * m // chunks)


@njit(nogil=True, cache=True)
def quantize_rows(af, m, k, aq, ad, asum):
    """Each row of a[M, K] (flat) in blocks of QB, as llama.cpp's q8_0 activations: d = max|x| /
    127, q = round(x / d) half away from zero, in aq (int8 [M K]); d and the sum of the block's
    q in ad, asum (float32 [M, K / QB])."""
    chunks = chunks_for(m, m * k)
    if chunks == 1:
        _quantize_span(af, k, aq, ad, asum, 0, m)
    else:
        _quantize_parallel(af, m, k, aq, ad, asum, chunks)


@njit(nogil=True, cache=True, inline="always")
def _bf16_bits(u):
    """float32 bits -> the nearest bfloat16's bits (round to nearest even), as uint32."""
    return (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)


@njit(nogil=True, cache=True)
def _to_bf16(af, m, k, kp, ab, pr, p0, p1):
    """Panels p0..p1-1 of pr rows of a[M, K] (flat float32) as bfloat16 bits into ab: row r's
    values t, t + 1 (t even) together at (r // pr) kp pr + t pr + 2 (r % pr). pr = 1: rows in
    order ([M, kp]); pr = PANEL_ROWS: the micro-panels. Zero past K, and in the rows past M
    of the last panel."""
    bits = af.view(np.uint32)
    pairs = k // 2
    for p in range(p0, p1):
        base = p * kp * pr
        for i in range(pr):
            r = p * pr + i
            at = base + 2 * i
            t0 = 0
            if r < m:
                src = r * k
                for q in range(pairs):
                    ab[at + 2 * q * pr] = np.uint16(_bf16_bits(bits[src + 2 * q]))
                    ab[at + 2 * q * pr + 1] = np.uint16(_bf16_bits(bits[src + 2 * q + 1]))
                t0 = 2 * pairs
                if k % 2:                     # the last value, its pair's other half zero
                    ab[at + t0 * pr] = np.uint16(_bf16_bits(bits[src + k - 1]))
                    ab[at + t0 * pr + 1] = 0
                    t0 += 2
            for t in range(t0, kp, 2):
                ab[at + t * pr] = 0
                ab[at + t * pr + 1] = 0


@njit(nogil=True, cache=True, parallel=True)
def _to_bf16_parallel(af, m, k, kp, ab, pr, panels):
    chunks = min(panels, 4 * get_kernel_threads())
    for c in prange(chunks):
        _to_bf16(af, m, k, kp, ab, pr, c * panels // chunks, (c + 1) * panels // chunks)


@njit(nogil=True, cache=True)
def gemm_inputs(af, m, k, fmt, act, row_major):
    """The tiles' inputs: (float32 a, int8 a with its scales and sums, bfloat16 a, its padded
    K, mode). int8 for a quantized weight with int8 inputs; bfloat16 pairs for a bfloat16
    weight with bfloat16 inputs on a level with the dot product (each value rounded to nearest
    even once; in micro-panels, or in rows, K padded, if row_major (AMX's A tiles) or M is
    under PANEL_ROWS); else
    float32, rounded first to a 16-bit input format (act) so that the widening tiles multiply
    16-bit values exactly."""
    use_int = act == ACT_INT8 and has_integer_quants(fmt)     # FP8: float inputs
    nq = m * k if use_int else 0
    aq, ad, asum = np.empty(nq, np.int8), np.empty(nq // QB, np.float32), np.empty(nq // QB, np.float32)
    if use_int:
        quantize_rows(af, m, k, aq, ad, asum)
        return af, aq, ad, asum, np.empty(0, np.uint16), 0, MODE_INT8
    if fmt == FMT_BF16 and act == FMT_BF16 and has_bf16_dot():
        kp = padded_k(k, fmt)
        rows = row_major or m < PANEL_ROWS
        pr = 1 if rows else PANEL_ROWS
        panels = (m + pr - 1) // pr
        ab = np.empty(panels * pr * kp, np.uint16)
        if m * k >= 65536:
            _to_bf16_parallel(af, m, k, kp, ab, pr, panels)
        else:
            _to_bf16(af, m, k, kp, ab, pr, 0, panels)
        return af, aq, ad, asum, ab, kp, MODE_DOT_ROWS if rows else MODE_DOT
    if act == FMT_BF16 or act == FMT_F16 or act == FMT_DLF16:
        rounded = af.copy()
        round_to_format(rounded, act)
        return rounded, aq, ad, asum, np.empty(0, np.uint16), 0, MODE_FLOAT
    return af, aq, ad, asum, np.empty(0, np.uint16), 0, MODE_FLOAT


@intrinsic
def _round_f16(typingctx, x):
    """float32 -> nearest float16 (round to nearest even; F16C's conversion) -> float32."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), F32)
    return types.float32(x), codegen


@njit(nogil=True, cache=True, parallel=True)
def round_to_format(x, fmt):
    """Round every value of the C-contiguous float32 array x, in place, to the nearest value
    of the 16-bit format fmt (bfloat16, float16: round to nearest even; DLFloat16: IBM's
    rounding, device/numerics.py), so that the products of a 16-bit GEMM are exact products
    of 16-bit numbers, as in a 16-bit multiplier; any other format (FMT_F32; ACT_INT8, which
    the GEMM of a quantized weight applies itself) does nothing."""
    if fmt != FMT_BF16 and fmt != FMT_F16 and fmt != FMT_DLF16:
        return
    flat = x.reshape(x.size)
    bits = flat.view(np.uint32)
    n = flat.shape[0]
    rows = (n + 4095) // 4096
    for r in prange(rows):
        lo = r * 4096
        hi = min(n, lo + 4096)
        if fmt == FMT_F16:
            for i in range(lo, hi):
                flat[i] = _round_f16(flat[i])
        elif fmt == FMT_DLF16:
            for i in range(lo, hi):
                flat[i] = dlfloat16_round(flat[i])
        else:
            for i in range(lo, hi):
                u = bits[i]
                bits[i] = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
