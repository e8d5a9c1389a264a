"""GEMM on weights placed once in panels (weight-stationary): fp32, 16-bit, 8- and 4-bit.

A weight W[K, N] is stored as panels of NR columns, each panel K rows of NR contiguous
values (device/layout.py packs it; see device/README.md for a picture):

    packed[p, k, j] = W[k, p * NR + j]        p < ceil(N / NR), zero past column N

so the kernel streams every panel with unit stride and never repacks. Storage is float32,
or uint16 holding float16 bits, or bfloat16 bits in pairs of rows (packed[p, k // 2, j,
k % 2], K padded with zero rows to a multiple of BF16_KB: the layout of vdpbf16ps and of
AMX's B tiles), or uint8 in one of GGML's block-quantized formats (Q8_0, Q4_0, Q4_1: blocks
of QB = 32 rows with a float16 scale per column), each panel then K / QB records of QB rows
(device/kernels/microkernel.py has their bytes).

    out[M, N] = a[M, K] @ W                    gemm_packed(out, a, w, K, N, fmt, act)

The inputs' format `act` picks the tile family (device/kernels/):
    float32 (ACT_F32)         microkernel.py: weights widened in registers (16-bit by a shift
                              or F16C, quantized to exactly GGML's dequantized values), FMAs
    bfloat16 / float16        rounded to that format once per GEMM; on a bfloat16 weight where
                              the level has AVX512_BF16, multiplied in pairs (dot_tile.py,
                              vdpbf16ps), else the float32 tiles on the rounded values
    int8 (ACT_INT8)           a quantized weight's: quantized per row in blocks of QB
                              (quantize_rows), integer dot products (int8_tile.py)
The vector width and the tile heights are the ISA level's (device/kernels/simd.py).

The loops follow BLIS: the panels are split across the card's cores (`prange` over chunks
of panels); a panel's k-block of KC rows (16 KiB in fp32) stays in L1 while every row tile
passes over it, so each weight byte comes from memory once per block of MC rows.
Up to MC rows (every decode) that is one pass and one parallel region; for more, the rows
come in blocks of MC and the k-blocks go outside the panels, so that an [MC, KC] block of
`a` stays in L2 while all the panels stream past it.

Numerics of the float32 tiles: every product is a float32 FMA of exactly the stored
(dequantized) weight. The order of the k sum depends on K, on the level and on the height
of a row's tile (a short tile sums k in interleaved partial sums), never on the thread count
or the weight's format: a result is reproducible for a given batch shape and level, and a
quantized or 16-bit weight gives bit for bit what its float32 copy gives.
"""

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from spyre_serve.device.abi import f32_at, get_kernel_threads, u16_at
from spyre_serve.device.kernels.amx import BLOCK_COLS, BLOCK_ROWS, amx_block, amx_release
from spyre_serve.device.kernels.dot_tile import dtile
from spyre_serve.device.kernels.int8_tile import itile
from spyre_serve.device.kernels.microkernel import (  # noqa: F401  (NR, QB, RECORD_BYTES: this module's interface)
    BF16_KB,
    FMT_BF16,
    FMT_F16,
    FMT_F32,
    FMT_Q4_0,
    FMT_Q4_1,
    FMT_Q8_0,
    REC_Q4_0,
    REC_Q4_1,
    REC_Q8_0,
    RECORD_BYTES,
    tile,
)
from spyre_serve.device.kernels.simd import (
    NR,
    QB,
    has_amx,
    has_bf16_dot,
    max_tile_height,
    tile_height,
)

ACT_F32, ACT_INT8 = 0, 6   # GEMM inputs: float32, or int8 per block of QB (quantized weights);
# FMT_BF16 / FMT_F16 as an input format: rounded to that format once per GEMM (below)

KC = 256         # k rows per block: a [KC, NR] fp32 slab is 16 KiB, in L1 (a multiple of QB)
MC = 192         # rows per block of a: [MC, KC] fp32 is 192 KiB, in L2
CHUNKS_PER_THREAD = 4   # panel chunks per core: balances the split, keeps each core's range contiguous
AMX_MIN_ROWS = 3        # bfloat16 GEMMs of at least this many rows go to AMX where the level has it

FORMATS = {"float32": FMT_F32, "bfloat16": FMT_BF16, "float16": FMT_F16,
           "Q8_0": FMT_Q8_0, "Q4_0": FMT_Q4_0, "Q4_1": FMT_Q4_1}
FORMAT_NAMES = {code: name for name, code in FORMATS.items()}

# how a GEMM's tiles read their inputs (_Inputs.mode)
MODE_FLOAT, MODE_INT8, MODE_DOT = 0, 1, 2

_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)


def _const(n: int) -> ir.Constant:
    return ir.Constant(_I64, n)


@njit(nogil=True, cache=True, inline="always")
def is_quantized(fmt):
    """A block-quantized format (uint8 storage: records of QB rows per panel)."""
    return fmt >= FMT_Q8_0


@njit(nogil=True, cache=True, inline="always")
def _record_bytes(fmt):
    if fmt == FMT_Q8_0:
        return REC_Q8_0
    if fmt == FMT_Q4_0:
        return REC_Q4_0
    return REC_Q4_1


@njit(nogil=True, cache=True, inline="always")
def padded_k(k, fmt):
    """Rows of each panel of a packed [K, N] weight: a bfloat16 weight's K padded with zero
    rows to a multiple of BF16_KB (its rows go in pairs, AMX's tiles in 32s); else K."""
    if fmt == FMT_BF16:
        return (k + BF16_KB - 1) // BF16_KB * BF16_KB
    return k


@njit(nogil=True, cache=True, inline="always")
def _slab_offset(p, kb, k, fmt):
    """First element of panel p's rows kb.. (kb a multiple of QB for a quantized format, even
    for bfloat16)."""
    if is_quantized(fmt):
        rec = _record_bytes(fmt)
        return p * (k // QB) * rec + (kb // QB) * rec
    return p * padded_k(k, fmt) * NR + kb * NR


@njit(nogil=True, cache=True)
def packed_len(k, n, fmt):
    """Elements (bytes for a quantized format) of a packed [K, N] weight in format fmt."""
    panels = (n + NR - 1) // NR
    if is_quantized(fmt):
        return panels * (k // QB) * _record_bytes(fmt)
    return panels * padded_k(k, fmt) * NR


@njit(nogil=True, cache=True)
def packed_size(k, n):
    """Elements of a packed [K, N] float32 or float16 weight: ceil(N / NR) panels of K x NR."""
    return ((n + NR - 1) // NR) * k * NR


@njit(nogil=True, cache=True, inline="always")
def _tile_at(mr, ins, r0, kb, k, w, w_off, c, c_off, ldc, kc, acc, fmt):
    """One tile of rows r0.., k rows kb..kb+kc of the inputs `ins` (_inputs)."""
    af, aq, ad, asum, ab, kab, mode = ins
    if mode == MODE_INT8:
        nb = k // QB
        itile(mr, aq, r0 * k + kb, k, ad, asum, r0 * nb + kb // QB, nb, w, w_off, c, c_off, ldc,
              kc, acc, fmt)
    elif mode == MODE_DOT:
        dtile(mr, ab, r0 * kab + kb, kab, w, w_off, c, c_off, ldc, kc, acc)
    else:
        tile(mr, af, r0 * k + kb, k, w, w_off, c, c_off, ldc, kc, acc, fmt)


@njit(nogil=True, cache=True)
def _panels(of, w, k, n, m0, mc, k0, kc_all, p0, p1, fmt, tmp, ins):
    """Rows m0..m0+mc of out, panels p0..p1-1, k rows k0..k0+kc_all (one core's share of one
    block): per panel, per k-block of KC, every row tile (the level's heights)."""
    for p in range(p0, p1):
        n0 = p * NR
        cols = min(NR, n - n0)
        for kb in range(k0, k0 + kc_all, KC):
            kc = min(KC, k0 + kc_all - kb)
            acc = 1 if kb > 0 else 0
            w_off = _slab_offset(p, kb, k, fmt)
            r0 = m0
            while r0 < m0 + mc:
                mr = tile_height(m0 + mc - r0)
                # the last panel may be partial: then the whole tile goes to tmp, and its
                # columns are copied in and out (one call site: the tiles are emitted once)
                dst, d_off, ldd = of, r0 * n + n0, n
                if cols < NR:
                    for i in range(mr):
                        for j in range(cols):
                            tmp[i * NR + j] = of[(r0 + i) * n + n0 + j]
                    dst, d_off, ldd = tmp, 0, NR
                _tile_at(mr, ins, r0, kb, k, w, w_off, dst, d_off, ldd, kc, acc, fmt)
                if cols < NR:
                    for i in range(mr):
                        for j in range(cols):
                            of[(r0 + i) * n + n0 + j] = tmp[i * NR + j]
                r0 += mr


@njit(nogil=True, cache=True, parallel=True)
def quantize_rows(af, m, k, aq, ad, asum):
    """Each row of a[M, K] (flat) in blocks of QB, as llama.cpp's q8_0 activations: d = max|x| /
    127, q = round(x / d) half away from zero, in aq (int8 [M K]); d and the sum of the block's
    q in ad, asum (float32 [M, K / QB])."""
    nb = k // QB
    for r in prange(m):
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


@njit(nogil=True, cache=True, inline="always")
def _bf16_bits(u):
    """float32 bits -> the nearest bfloat16's bits (round to nearest even), as uint32."""
    return (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)


@njit(nogil=True, cache=True)
def _to_bf16_rows(af, m, k, kp, ab, r0, r1):
    """Rows r0..r1-1 of a[M, K] (flat float32) as bfloat16 bits into ab [M, kp], zero past K."""
    bits = af.view(np.uint32)
    for r in range(r0, r1):
        for t in range(k):
            ab[r * kp + t] = np.uint16(_bf16_bits(bits[r * k + t]))
        for t in range(k, kp):
            ab[r * kp + t] = 0


@njit(nogil=True, cache=True, parallel=True)
def _to_bf16_parallel(af, m, k, kp, ab):
    chunks = min(m, 4 * get_kernel_threads())
    for c in prange(chunks):
        _to_bf16_rows(af, m, k, kp, ab, c * m // chunks, (c + 1) * m // chunks)


@njit(nogil=True, cache=True)
def _inputs(af, m, k, fmt, act):
    """The tiles' inputs: (float32 a, int8 a with its scales and sums, bfloat16 a, its row
    stride, mode). int8 for a quantized weight with int8 inputs; bfloat16 pairs for a
    bfloat16 weight with bfloat16 inputs on a level with the dot product (each value rounded
    to nearest even once); else float32, rounded first to a 16-bit input format (act) so that
    the widening tiles multiply 16-bit values exactly."""
    use_int = act == ACT_INT8 and is_quantized(fmt)
    nq = m * k if use_int else 0
    aq, ad, asum = np.empty(nq, np.int8), np.empty(nq // QB, np.float32), np.empty(nq // QB, np.float32)
    if use_int:
        quantize_rows(af, m, k, aq, ad, asum)
        return af, aq, ad, asum, np.empty(0, np.uint16), 0, MODE_INT8
    if fmt == FMT_BF16 and act == FMT_BF16 and has_bf16_dot():
        kp = padded_k(k, fmt)
        ab = np.empty(m * kp, np.uint16)
        if m * k >= 65536:
            _to_bf16_parallel(af, m, k, kp, ab)
        else:
            _to_bf16_rows(af, m, k, kp, ab, 0, m)
        return af, aq, ad, asum, ab, kp, MODE_DOT
    if act == FMT_BF16 or act == FMT_F16:
        rounded = af.copy()
        round_to_format(rounded, act)
        return rounded, aq, ad, asum, np.empty(0, np.uint16), 0, MODE_FLOAT
    return af, aq, ad, asum, np.empty(0, np.uint16), 0, MODE_FLOAT


@njit(nogil=True, cache=True, parallel=True)
def gemm_packed(out, a, w, k, n, fmt, act):
    """out[M, N] = a[M, K] @ W[K, N], W packed in panels.

    out, a: C-contiguous float32 2-D; w: the packed 1-D array of packed_len(K, N, fmt)
    elements; fmt: FMT_F32 for float32 w, FMT_BF16 or FMT_F16 for uint16 w, FMT_Q8_0,
    FMT_Q4_0 or FMT_Q4_1 for uint8 w (K a multiple of QB); act, the inputs' format: ACT_F32,
    FMT_BF16 / FMT_F16 (rounded to it), or ACT_INT8 (a quantized weight's: int8 per block)."""
    m = a.shape[0]
    if a.shape[1] != k or out.shape[0] != m or out.shape[1] != n:
        raise ValueError("gemm_packed: want a [M, K] and out [M, N]; (M, K, N) are", m, k, n)
    if is_quantized(fmt) and k % QB:
        raise ValueError("gemm_packed: a block-quantized weight needs K in whole blocks (K, QB)",
                         k, QB)
    if w.shape[0] < packed_len(k, n, fmt):
        raise ValueError("gemm_packed: packed weight too short (have, need)", w.shape[0],
                         packed_len(k, n, fmt))
    if m == 0 or n == 0:
        return
    if k == 0:
        out[:] = 0.0
        return
    af = a.reshape(m * k)
    of = out.reshape(m * n)
    ins = _inputs(af, m, k, fmt, act)
    kk = ins[5] if ins[6] == MODE_DOT else k        # rows the tiles run over (the dot's padded)
    n_panels = (n + NR - 1) // NR
    if ins[6] == MODE_DOT and m >= AMX_MIN_ROWS and has_amx():
        _gemm_amx(of, ins[4], m, ins[5], w, k, n, n_panels)
        return
    chunks = min(n_panels, CHUNKS_PER_THREAD * get_kernel_threads())
    th = max_tile_height()
    if m <= MC:
        # decode-sized: all of a fits in L2; one parallel region over the panels
        for c in prange(chunks):
            tmp = np.empty(th * NR, np.float32)
            _panels(of, w, k, n, 0, m, 0, kk, c * n_panels // chunks,
                    (c + 1) * n_panels // chunks, fmt, tmp, ins)
        return
    # prefill-sized: a block of MC rows x KC columns of a stays in L2 while every panel's
    # [KC, NR] slab passes (BLIS's order: k-blocks outside the panels)
    for m0 in range(0, m, MC):
        mc = min(MC, m - m0)
        for k0 in range(0, kk, KC):
            kc = min(KC, kk - k0)
            for c in prange(chunks):
                tmp = np.empty(th * NR, np.float32)
                _panels(of, w, k, n, m0, mc, k0, kc, c * n_panels // chunks,
                        (c + 1) * n_panels // chunks, fmt, tmp, ins)


@njit(nogil=True, cache=True)
def _amx_panels(of, ab, m, kp, w, k, n, n_panels, q0, q1, tmp):
    """Panel pairs q0..q1-1 of out, every block of BLOCK_ROWS rows: AMX blocks, copied out."""
    for q in range(q0, q1):
        p0 = 2 * q
        p1 = p0 + 1 if p0 + 1 < n_panels else p0          # an odd last panel: computed twice
        off0 = 2 * _slab_offset(p0, 0, k, FMT_BF16)         # bytes
        off1 = 2 * _slab_offset(p1, 0, k, FMT_BF16)
        cols = min(BLOCK_COLS, n - p0 * NR)
        for r0 in range(0, m, BLOCK_ROWS):
            rows = min(BLOCK_ROWS, m - r0)
            amx_block(ab, 2 * r0 * kp, 2 * kp, rows, w, off0, off1, kp, tmp)
            for i in range(rows):
                for j in range(cols):
                    of[(r0 + i) * n + p0 * NR + j] = tmp[i * BLOCK_COLS + j]
    amx_release()


@njit(nogil=True, cache=True, parallel=True)
def _gemm_amx(of, ab, m, kp, w, k, n, n_panels):
    """out = ab @ W with AMX blocks of BLOCK_ROWS x 2 panels, panel pairs split across the
    cores (each block's whole k at once: its B slabs stay in L2 while the row blocks pass)."""
    pairs = (n_panels + 1) // 2
    chunks = min(pairs, CHUNKS_PER_THREAD * get_kernel_threads())
    for c in prange(chunks):
        tmp = np.empty(BLOCK_ROWS * BLOCK_COLS, np.float32)
        _amx_panels(of, ab, m, kp, w, k, n, n_panels, c * pairs // chunks,
                    (c + 1) * pairs // chunks, tmp)


@intrinsic
def _widen(typingctx, bits, fmt):
    """One stored value -> float32, exactly: a float32 as it is, a uint16 of bf16 or fp16
    bits (fmt) widened (a uint8, a quantized weight's byte, as its integer value: gather_columns
    types that branch for uint8 weights too, and never takes it)."""
    if bits not in (types.uint16, types.float32, types.uint8):
        return None

    def codegen(context, builder, signature, args):
        raw, fmt_v = args
        if signature.args[0] == types.float32:
            return raw
        if signature.args[0] == types.uint8:
            return builder.uitofp(raw, _F32)
        half = builder.fpext(builder.bitcast(raw, ir.HalfType()), _F32)
        brain = builder.bitcast(builder.shl(builder.zext(raw, _I32), ir.Constant(_I32, 16)), _F32)
        return builder.select(builder.icmp_signed("==", fmt_v, _const(FMT_F16)), half, brain)
    return types.float32(bits, types.int64), codegen


@njit(nogil=True, cache=True, inline="always")
def _half_at(w, i):
    """The float16 whose two little-endian bytes are w[i], w[i + 1], as float32."""
    lo, hi = np.uint16(np.uint8(w[i])), np.uint16(np.uint8(w[i + 1]))
    return _widen(np.uint16(lo | (hi << np.uint16(8))), FMT_F16)


@njit(nogil=True, cache=True)
def _quantized_value(w, c, kk, k, fmt):
    """W[kk, c] of a block-quantized packed weight (uint8), as GGML's dequantizer gives it.
    (Typed for every weight dtype gather_columns takes; only uint8 ever reaches it.)"""
    j = c % NR
    r = kk % QB
    rec = _record_bytes(fmt)
    r0 = (c // NR) * (k // QB) * rec + (kk // QB) * rec
    d = _half_at(w, r0 + 2 * j)
    q0 = r0 + (4 * NR if fmt == FMT_Q4_1 else 2 * NR)
    if fmt == FMT_Q8_0:            # group r // 4, byte r % 4 of column j
        return d * np.float32(np.int8(np.uint8(w[q0 + (r // 4) * 4 * NR + 4 * j + r % 4])))
    rr = r % (QB // 2)
    byte = np.uint8(w[q0 + (rr // 4) * 4 * NR + 4 * j + rr % 4])
    q = np.float32((byte & 15) if r < QB // 2 else (byte >> 4))
    if fmt == FMT_Q4_0:
        return d * (q - np.float32(8.0))
    return d * q + _half_at(w, r0 + 2 * NR + 2 * j)


@njit(nogil=True, cache=True, parallel=True)
def gather_columns(out, w, cols, scale, k, n, fmt):
    """out[T, K] = W[:, cols].T * scale for W[K, N] packed in panels: the embedding lookup of
    a table stored as the K x N weight of the LM head (E.T, K = H, N = V), so a tied model
    keeps one copy of its embedding, in the GEMM's layout and width."""
    t_n = cols.shape[0]
    if out.shape[0] != t_n or out.shape[1] != k:
        raise ValueError("gather_columns: out must be [T, K]; T, K are", t_n, k)
    if w.shape[0] < packed_len(k, n, fmt):
        raise ValueError("gather_columns: packed weight too short (have, need)", w.shape[0],
                         packed_len(k, n, fmt))
    for t in range(t_n):
        if cols[t] < 0 or cols[t] >= n:
            raise IndexError("gather_columns: column out of range (column, N)", cols[t], n)
    s = np.float32(scale)
    for t in prange(t_n):
        c = cols[t]
        if is_quantized(fmt):
            for kk in range(k):
                out[t, kk] = _quantized_value(w, c, kk, k, fmt) * s
        elif fmt == FMT_BF16:       # rows in pairs: row kk at (kk // 2) * 2 NR + 2 j + kk % 2
            base = (c // NR) * padded_k(k, fmt) * NR + 2 * (c % NR)
            for kk in range(k):
                out[t, kk] = _widen(w[base + (kk >> 1) * 2 * NR + (kk & 1)], fmt) * s
        else:
            base = (c // NR) * k * NR + c % NR
            for kk in range(k):
                out[t, kk] = _widen(w[base + kk * NR], fmt) * s


# ---- on the arena: a weight by its address, as the card's programs reach it ----------------

@njit(nogil=True, cache=True)
def _u8_at(u16, address, nbytes):
    """uint8[nbytes] at byte `address` (2-byte aligned, as every allocation is) of the arena."""
    return u16_at(u16, address, (nbytes + 1) // 2).view(np.uint8)[:nbytes]


@njit(nogil=True, cache=True)
def gemm_at(out, a, f32, u16, address, k, n, fmt, act):
    """gemm_packed with the weight at byte `address` of the arena (f32 / u16: its views)."""
    size = packed_len(k, n, fmt)
    if fmt == FMT_F32:
        gemm_packed(out, a, f32_at(f32, address, size), k, n, fmt, act)
    elif is_quantized(fmt):
        gemm_packed(out, a, _u8_at(u16, address, size), k, n, fmt, act)
    else:
        gemm_packed(out, a, u16_at(u16, address, size), k, n, fmt, act)


@njit(nogil=True, cache=True)
def gather_columns_at(out, f32, u16, address, cols, scale, k, n, fmt):
    """gather_columns with the weight at byte `address` of the arena."""
    size = packed_len(k, n, fmt)
    if fmt == FMT_F32:
        gather_columns(out, f32_at(f32, address, size), cols, scale, k, n, fmt)
    elif is_quantized(fmt):
        gather_columns(out, _u8_at(u16, address, size), cols, scale, k, n, fmt)
    else:
        gather_columns(out, u16_at(u16, address, size), cols, scale, k, n, fmt)

# ---- 16-bit compute: GEMM inputs rounded to the weights' format -----------------------------

@intrinsic
def _round_f16(typingctx, x):
    """float32 -> nearest float16 (round to nearest even; F16C's conversion) -> float32."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), _F32)
    return types.float32(x), codegen


@njit(nogil=True, cache=True, parallel=True)
def round_to_format(x, fmt):
    """Round every value of the C-contiguous float32 array x, in place, to the nearest value
    of the 16-bit format fmt (round to nearest even), so that the products of a 16-bit GEMM
    are exact products of 16-bit numbers, as in a bf16/fp16 multiplier; any other format
    (FMT_F32; ACT_INT8, which the GEMM of a quantized weight applies itself) does nothing."""
    if fmt != FMT_BF16 and fmt != FMT_F16:
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
        else:
            for i in range(lo, hi):
                u = bits[i]
                bits[i] = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
