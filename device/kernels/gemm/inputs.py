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
from numba.core import cgutils
from numba.extending import intrinsic

from spyre_serve.device.abi import chunks_for, get_kernel_threads
from spyre_serve.device.kernels.formats import (
    FMT_BF16,
    FMT_DLF16,
    FMT_F16,
    bf16_narrow_ir,
    dlfloat16_round,
    has_integer_quants,
    padded_k,
)
from spyre_serve.device.kernels.simd import (
    F32,
    I16,
    I32,
    QB,
    array_ptr,
    const,
    has_bf16_dot,
    load_vec,
    splat,
)

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


def _block_of(context, builder, ty, arr, at):
    """The QB float32 values of `arr` from element `at`, as one vector."""
    return load_vec(builder, array_ptr(context, builder, ty, arr), at, ir.VectorType(F32, QB), 4)


def _llvm(builder, name, ret, *args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]),
                                        name)
    return builder.call(fn, args)


@intrinsic
def _block_amax(typingctx, af, at):
    """max |af[at + t]| over a block of QB values, in one vector: the largest of the magnitudes'
    bits as integers (their order is the floats' order; the float maximum's NaN-aware reduction
    is several times the work)."""
    if af.dtype != types.float32:
        return None

    def codegen(context, builder, signature, args):
        x = _block_of(context, builder, signature.args[0], args[0], args[1])
        it = ir.VectorType(I32, QB)
        mag = builder.and_(builder.bitcast(x, it), ir.Constant(it, [0x7FFFFFFF] * QB))
        top = _llvm(builder, f"llvm.vector.reduce.umax.v{QB}i32", I32, mag)
        return builder.bitcast(top, F32)

    return types.float32(af, types.int64), codegen


@intrinsic
def _quantize_block(typingctx, af, at, inv, aq):
    """aq[at + t] = round(af[at + t] inv) half away from zero (floor(|v| + 0.5) with v's sign,
    as the scalar reference), a block of QB values in one vector; returns the sum of the q and
    the sum of its first QB / 2."""
    if af.dtype != types.float32 or aq.dtype != types.int8:
        return None

    def codegen(context, builder, signature, args):
        a_v, at, scale, q_v = args
        x = _block_of(context, builder, signature.args[0], a_v, at)
        vt = x.type
        v = builder.fmul(x, splat(builder, scale, vt))
        half = ir.Constant(vt, [0.5] * QB)
        mag = _llvm(builder, f"llvm.floor.v{QB}f32", vt,
                    builder.fadd(_llvm(builder, f"llvm.fabs.v{QB}f32", vt, v), half))
        q = builder.fptosi(_llvm(builder, f"llvm.copysign.v{QB}f32", vt, mag, v),
                           ir.VectorType(I32, QB))
        qt = ir.VectorType(ir.IntType(8), QB)
        out = builder.gep(array_ptr(context, builder, signature.args[3], q_v), [at])
        builder.store(builder.trunc(q, qt), builder.bitcast(out, qt.as_pointer()), align=1)
        total = _llvm(builder, f"llvm.vector.reduce.add.v{QB}i32", I32, q)
        low = builder.shuffle_vector(q, q, ir.Constant(ir.VectorType(I32, QB // 2), list(range(QB // 2))))
        low = _llvm(builder, f"llvm.vector.reduce.add.v{QB // 2}i32", I32, low)
        sums = types.UniTuple(types.int64, 2)
        return context.make_tuple(builder, sums, [builder.sext(total, ir.IntType(64)),
                                                  builder.sext(low, ir.IntType(64))])

    return types.UniTuple(types.int64, 2)(af, types.int64, types.float32, aq), codegen


@njit(nogil=True, cache=True)
def _quantize_span(af, k, aq, ad, asum, r0, r1):
    """Rows r0..r1-1 of quantize_rows, a block of QB values at a time in vectors (Zen 4, 32 to
    512 rows of 576 or 1,536: 0.19-0.36 ns a value; a value at a time, 0.74-1.45)."""
    nb = k // QB
    for r in range(r0, r1):
        for b in range(nb):
            base = r * k + b * QB
            d = _block_amax(af, base) / np.float32(127.0)
            inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
            ad[r * nb + b] = d
            total, low = _quantize_block(af, base, inv, aq)
            asum[2 * (r * nb + b)] = np.float32(total)
            asum[2 * (r * nb + b) + 1] = np.float32(low)


@njit(nogil=True, cache=True, parallel=True)
def _quantize_parallel(af, m, k, aq, ad, asum, chunks):
    for c in prange(chunks):
        _quantize_span(af, k, aq, ad, asum, c * m // chunks, (c + 1) * m // chunks)


@njit(nogil=True, cache=True)
def quantize_rows(af, m, k, aq, ad, asum):
    """Each row of a[M, K] (flat) in blocks of QB, as llama.cpp's q8_0 activations: d = max|x| /
    127, q = round(x / d) half away from zero, in aq (int8 [M K]); d in ad (float32 [M, K / QB]);
    the sum of the block's q and of its first QB / 2 in asum (float32 [M, K / QB, 2]: Q6_K's
    tiles take a half block's minimum term from the second, once per GEMM instead of once a
    panel)."""
    chunks = chunks_for(m, m * k)
    if chunks == 1:
        _quantize_span(af, k, aq, ad, asum, 0, m)
    else:
        _quantize_parallel(af, m, k, aq, ad, asum, chunks)


@njit(nogil=True, cache=True, inline="always")
def _bf16_bits(u):
    """float32 bits -> the nearest bfloat16's bits (round to nearest even), as uint32."""
    return (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)


BLOCK_PAIRS = 16   # pairs of a row the vector code rounds at a time (32 values: two vectors)


def _words_of(builder, s_p, at):
    """BLOCK_PAIRS words from the 32 float32 bits at s_p[at..]: each value rounded to the
    nearest bfloat16 (ties to even), value 2q in word q's low half and 2q + 1 in its high half."""
    v32 = ir.VectorType(I32, 2 * BLOCK_PAIRS)
    u = load_vec(builder, s_p, at, v32, 4)
    halves = builder.trunc(bf16_narrow_ir(builder, u, v32), ir.VectorType(I16, 2 * BLOCK_PAIRS))
    return builder.bitcast(halves, ir.VectorType(I32, BLOCK_PAIRS))


def _transpose(builder, rows):
    """The 16 x 16 words of `rows` (16 vectors) transposed: four rounds of swapping a block's
    off-diagonal halves (8, 4, 2, 1 wide), each vector a shuffle of two (vpermt2d)."""
    n = len(rows)
    mask_ty = ir.VectorType(I32, n)
    b = n // 2
    while b:
        out = list(rows)
        for i in range(n):
            if i & b:
                continue
            j = i | b
            keep = [q if not q & b else n + q - b for q in range(n)]
            swap = [q + b if not q & b else n + q for q in range(n)]
            out[i] = builder.shuffle_vector(rows[i], rows[j], ir.Constant(mask_ty, keep))
            out[j] = builder.shuffle_vector(rows[i], rows[j], ir.Constant(mask_ty, swap))
        rows = out
        b //= 2
    return rows


@intrinsic
def _panel_block(typingctx, words, w_off, bits, src, k):
    """A micro-panel's BLOCK_PAIRS pairs of its PANEL_ROWS rows in one pass: the rows' values
    at bits[src + i k ..] (float32 bits, 32 a row) rounded to bfloat16 (`_words_of`), the 16 x
    16 words transposed in registers, and pair q's 16 words (one a row: one line) stored at
    words[w_off + 16 q ..]. Zen 4, 32 to 512 rows of 576 or 1,536: 0.10-0.12 ns a value; a
    value at a time, 1.0-1.1 ns (0.73-0.80 with a 4-byte store a pair: the stores to 16 lines
    a row are the cost, not the rounding)."""
    if words.dtype != types.uint32 or bits.dtype != types.uint32 or PANEL_ROWS != BLOCK_PAIRS:
        return None

    def codegen(context, builder, signature, args):
        d_v, d_off, s_v, s_off, kk = args
        d_p = array_ptr(context, builder, signature.args[0], d_v)
        s_p = array_ptr(context, builder, signature.args[2], s_v)
        rows = [_words_of(builder, s_p, builder.add(s_off, builder.mul(const(i), kk)))
                for i in range(PANEL_ROWS)]
        w16 = ir.VectorType(I32, BLOCK_PAIRS)
        for q, vec in enumerate(_transpose(builder, rows)):
            at = builder.gep(d_p, [builder.add(d_off, const(PANEL_ROWS * q))])
            builder.store(vec, builder.bitcast(at, w16.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(words, types.int64, bits, types.int64, types.int64), codegen


@intrinsic
def _row_block(typingctx, words, w_off, bits, src):
    """BLOCK_PAIRS pairs of one row in order: bits[src ..] (32 float32 bits) rounded to
    bfloat16 into words[w_off ..] (`_words_of`)."""
    if words.dtype != types.uint32 or bits.dtype != types.uint32:
        return None

    def codegen(context, builder, signature, args):
        d_v, d_off, s_v, s_off = args
        d_p = array_ptr(context, builder, signature.args[0], d_v)
        s_p = array_ptr(context, builder, signature.args[2], s_v)
        w16 = ir.VectorType(I32, BLOCK_PAIRS)
        builder.store(_words_of(builder, s_p, s_off),
                      builder.bitcast(builder.gep(d_p, [d_off]), w16.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(words, types.int64, bits, types.int64), codegen


@njit(nogil=True, cache=True)
def _to_bf16(af, m, k, kp, ab, pr, p0, p1):
    """Panels p0..p1-1 of pr rows of a[M, K] (flat float32) as bfloat16 bits into ab: row r's
    values t, t + 1 (t even) together at (r // pr) kp pr + t pr + 2 (r % pr). pr = 1: rows in
    order ([M, kp]); pr = PANEL_ROWS: the micro-panels. Zero past K, and in the rows past M
    of the last panel. Whole blocks of BLOCK_PAIRS pairs go through the vector code
    (`_panel_block` for a full micro-panel, `_row_block` for a row), the rest a value at a time."""
    bits = af.view(np.uint32)
    words = ab.view(np.uint32)
    vector = k // (2 * BLOCK_PAIRS) * (2 * BLOCK_PAIRS)      # values the vector code takes
    pairs = k // 2
    for p in range(p0, p1):
        base = p * kp * pr
        whole = vector if pr == 1 or (p + 1) * pr <= m else 0     # a full panel, or a row
        if pr == PANEL_ROWS:
            for t in range(0, whole, 2 * BLOCK_PAIRS):
                _panel_block(words, (base + t * pr) // 2, bits, p * pr * k + t, k)
        for i in range(pr):
            r = p * pr + i
            at = base + 2 * i
            t0 = 0
            if r < m:
                src = r * k
                if pr == 1:
                    for t in range(0, whole, 2 * BLOCK_PAIRS):
                        _row_block(words, (base + t) // 2, bits, src + t)
                for q in range(whole // 2, pairs):
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
    aq, ad, asum = np.empty(nq, np.int8), np.empty(nq // QB, np.float32), np.empty(2 * nq // QB, np.float32)
    if use_int:
        quantize_rows(af, m, k, aq, ad, asum)
        return af, aq, ad, asum, np.empty(0, np.uint16), 0, MODE_INT8
    if fmt == FMT_BF16 and act == FMT_BF16 and has_bf16_dot():
        kp = padded_k(k, fmt)
        rows = row_major or m < PANEL_ROWS
        pr = 1 if rows else PANEL_ROWS
        panels = (m + pr - 1) // pr
        ab = np.empty(panels * pr * kp, np.uint16)
        if m * k >= 1 << 17:     # 128 x 576 values: 9 us on one core (Zen 4), 11 over two
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
