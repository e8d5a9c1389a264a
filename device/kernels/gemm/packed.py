"""GEMM on weights placed once in panels (weight-stationary): fp32, 16-bit, 8- and 4-bit.

A weight W[K, N] is stored as panels of NR columns, each panel K rows of NR contiguous
values (device/layout.py packs it; see device/README.md for a picture):

    packed[p, k, j] = W[k, p * NR + j]        p < ceil(N / NR), zero past column N

so the kernel streams every panel with unit stride and never repacks. Storage is float32,
or uint16 holding float16 bits, or bfloat16 bits in pairs of rows (packed[p, k // 2, j,
k % 2], K padded with zero rows to a multiple of BF16_KB: the layout of vdpbf16ps and of
AMX's B tiles), or uint8 in one of GGML's block-quantized formats (Q8_0, Q4_0, Q4_1: blocks
of QB = 32 rows with a float16 scale per column; the K-quants Q4_K, Q5_K, Q6_K with float32
scales and planes of higher bits), each panel then K / QB records of QB rows
(device/kernels/gemm/microkernel.py has their bytes).

    out[M, N] = a[M, K] @ W                    gemm_packed(out, a, w, K, N, fmt, act)

The inputs' format `act` picks the tile family (device/kernels/):
    float32 (ACT_F32)         microkernel.py: weights widened in registers (16-bit by a shift
                              or F16C, quantized to exactly GGML's dequantized values), FMAs
    bfloat16 / float16        rounded to that format once per GEMM; on a bfloat16 weight where
                              the level has AVX512_BF16, multiplied in pairs (dot_tile.py,
                              vdpbf16ps), else the float32 tiles on the rounded values
    int8 (ACT_INT8)           a quantized weight's: quantized per row in blocks of QB
                              (quantize_rows), integer dot products (int8_tile.py); on a
                              level with AMX, from AMX_QUANT_MIN_ROWS rows on (a prompt's
                              chunk, a batch of 32), the weight widened to bfloat16 a group
                              of panel pairs at a time (dequant.py) and multiplied by AMX's
                              tiles with bfloat16 inputs instead: 1.5-2.5x the int8 tiles'
                              speed there, and finer inputs than int8's; on AVX512_BF16
                              without AMX the same for a Q6_K weight (`dot_widens`) from
                              DOT_QUANT_MIN_ROWS rows on, a group of panels widened at a time
                              for the dot tiles (Zen 4: 1.1-1.5x its int8 tiles at 64-2,048
                              rows; every other format's int8 tiles are as fast or faster
                              there, Q8_0's 1.1-1.5x, with VNNI's vpdpbusd)
The vector width and the tile heights are the ISA level's (device/kernels/simd.py).

The loops follow BLIS: the panels are split across the card's cores (`prange` over chunks
of panels); a panel's k-block of KC rows (16 KiB in fp32; for the bfloat16 dot tiles up to
KC_DOT, K in equal blocks) stays in L1 while every row tile passes over it, so each weight
byte comes from memory once per block of MC rows.
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
from numba import njit, prange, types
from numba.extending import overload

from spyre_serve.device.abi import f32_at, get_kernel_threads, u16_at
from spyre_serve.device.kernels.formats import (
    FMT_BF16,
    FMT_F32,
    FMT_Q6_K,
    FMT_Q6_K_MIN,
    has_integer_quants,
    is_quantized,
    packed_len,
    slab_offset,
)
from spyre_serve.device.kernels.gather import u8_at
from spyre_serve.device.kernels.gemm.amx import BLOCK_COLS, BLOCK_ROWS, amx_release, amx_rows
from spyre_serve.device.kernels.gemm.dequant import dequantize_pair_bf16, dequantize_panel_bf16
from spyre_serve.device.kernels.gemm.dot_tile import dtile
from spyre_serve.device.kernels.gemm.inputs import (
    ACT_INT8,
    MODE_DOT,
    MODE_DOT_ROWS,
    MODE_INT8,
    PANEL_ROWS,
    gemm_inputs,
)
from spyre_serve.device.kernels.gemm.int8_tile import itile
from spyre_serve.device.kernels.gemm.microkernel import tile
from spyre_serve.device.kernels.simd import NR, QB, geometry, has_amx, has_bf16_dot, max_tile_height, tile_height

KC = 256         # k rows per block: a [KC, NR] fp32 slab is 16 KiB, in L1 (a multiple of QB)
KC_DOT = 576     # the bfloat16 dot tiles' most: a [KC_DOT, NR] slab is 18 KiB (_k_block)
MC = 192         # rows per block of a: [MC, KC] fp32 is 192 KiB, in L2
CHUNKS_PER_THREAD = 4   # panel chunks per core: balances the split, keeps each core's range contiguous
AMX_MIN_ROWS = 3        # bfloat16 GEMMs of at least this many rows go to AMX where the level has it
AMX_PAIRS = 16          # panel pairs an AMX row block passes before the next row block
AMX_A_BYTES = 256 << 10  # rows of A an AMX pass takes (their bfloat16 bytes): they stay in L2
AMX_B_BYTES = 1 << 20    # a core's share of B up to this stays in L2 for all the rows
AMX_KC = 512             # k values of A an AMX block row takes at a time: 32 rows x 1 KiB in L1
AMX_QUANT_MIN_ROWS = 32  # 8-/4-bit GEMMs on int8 inputs of at least this many rows: bfloat16 on AMX
AMX_QUANT_PAIRS = 8      # quantized panel pairs widened at a time (8 x 2 K x 16 bfloat16: 576 KiB at K 1152)
DOT_QUANT_MIN_ROWS = 64  # the same on vdpbf16ps without AMX (dot_widens): widened panels, the dot tiles
DOT_QUANT_PANELS = 16    # quantized panels widened at a time there (16 x K x 16 bfloat16: 288 KiB at K 576)


@njit(nogil=True, cache=True, inline="always")
def dot_widens(fmt):
    """Whether a prompt's rows on this quantized format go widened to bfloat16 on the dot
    tiles where the level has vdpbf16ps but no AMX: Q6_K's records only. Zen 4, 2 cores, cold
    weights, in-process A/B of the int8 tiles against the widened path at 64-2,048 rows of
    K x N = 576 x 3,072 (576 x 960 for the fused record): Q6_K 0.66-0.91x, Q6_K_MIN 0.67-0.94x;
    Q8_0 1.10-1.49x (vpdpbusd on q + 128), Q4_0 1.05-1.22x, Q4_1 1.36x, Q4_K 1.02-1.37x, Q5_K
    0.98-1.24x."""
    return fmt == FMT_Q6_K or fmt == FMT_Q6_K_MIN


WIDEN_NONE, WIDEN_AMX, WIDEN_DOT = 0, 1, 2     # widened_path's answers


@njit(nogil=True, cache=True, inline="always")
def widened_path(m, fmt, act):
    """Which path a GEMM of m rows on a weight of `fmt` with inputs `act` takes on this level
    before the tiles: WIDEN_AMX (an 8- or 4-bit weight widened to bfloat16 for AMX, from
    AMX_QUANT_MIN_ROWS rows), WIDEN_DOT (the same for the dot tiles where there is vdpbf16ps
    but no AMX, `dot_widens` formats from DOT_QUANT_MIN_ROWS rows) or WIDEN_NONE (the tiles of
    the inputs' family). gemm_packed takes its decision here, and the tests their expectation."""
    if act != ACT_INT8:
        return WIDEN_NONE
    if has_integer_quants(fmt) and m >= AMX_QUANT_MIN_ROWS and has_amx():
        return WIDEN_AMX
    if dot_widens(fmt) and m >= DOT_QUANT_MIN_ROWS and has_bf16_dot():
        return WIDEN_DOT
    return WIDEN_NONE


@njit(nogil=True, cache=True, inline="always")
def _k_block(kk, dot):
    """Rows of k a block: KC; for the bfloat16 dot tiles, K in as few equal blocks of at most
    KC_DOT as it takes (each a multiple of QB), so that no short last block costs a pass over
    c (Zen 4, one thread: K = 576 in one block instead of 256 + 256 + 64, 1.04-1.19x)."""
    if not dot:
        return KC
    blocks = (kk + KC_DOT - 1) // KC_DOT
    per = (kk + blocks - 1) // blocks
    return (per + QB - 1) // QB * QB


@njit(nogil=True, cache=True, inline="always")
def _tile_at(mr, ins, r0, kb, k, w, w_off, c, c_off, ldc, kc, acc, fmt, far):
    """One tile of rows r0.., k rows kb..kb+kc of the inputs `ins` (gemm_inputs)."""
    af, aq, ad, asum, ab, kab, mode = ins
    if mode == MODE_INT8:
        nb = k // QB
        itile(mr, aq, r0 * k + kb, k, ad, asum, r0 * nb + kb // QB, nb, w, w_off, c, c_off, ldc,
              kc, acc, fmt)
    elif mode == MODE_DOT_ROWS:     # fewer rows than a micro-panel, in rows
        dtile(mr, ab, r0 * kab + kb, kab, 1, w, w_off, c, c_off, ldc, kc, acc, far)
    elif mode == MODE_DOT:          # micro-panels (inputs.py): r0 never starts a tile across one
        a_off = (r0 // PANEL_ROWS) * kab * PANEL_ROWS + 2 * (r0 % PANEL_ROWS) + kb * PANEL_ROWS
        if mr == PANEL_ROWS:       # the tallest tile by its constant height, not through the
            dtile(PANEL_ROWS, ab, a_off, 2, PANEL_ROWS, w, w_off, c, c_off, ldc, kc, acc, far)
        else:                      # switch over every height: 1.25-1.4x (Zen 4, 2 cores)
            dtile(mr, ab, a_off, 2, PANEL_ROWS, w, w_off, c, c_off, ldc, kc, acc, far)
    else:
        tile(mr, af, r0 * k + kb, k, w, w_off, NR, c, c_off, ldc, kc, acc, fmt)


@njit(nogil=True, cache=True)
def _panels(of, w, k, n, m0, mc, k0, kc_all, kcb, p0, p1, fmt, tmp, ins, w_p0):
    """Rows m0..m0+mc of out, panels p0..p1-1, k rows k0..k0+kc_all (one core's share of one
    block): per panel, per k-block of kcb (_k_block), every row tile (the level's heights).
    Panel p of out is panel p - w_p0 of w (0: the weight itself; else a group widened)."""
    for p in range(p0, p1):
        n0 = p * NR
        cols = min(NR, n - n0)
        for kb in range(k0, k0 + kc_all, kcb):
            kc = min(kcb, k0 + kc_all - kb)
            acc = 1 if kb > 0 else 0
            w_off = slab_offset(p - w_p0, kb, k, fmt)
            # the row tiles after the first read the slab from the caches: they ask for the
            # next panel's into L2 meanwhile (its first tile's stream then comes from L2)
            nxt = slab_offset(p + 1 - w_p0, kb, k, fmt) - w_off if p + 1 < p1 else 0
            r0, first = m0, tile_height(mc)
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
                _tile_at(mr, ins, r0, kb, k, w, w_off, dst, d_off, ldd, kc, acc, fmt,
                         nxt if r0 == m0 + first else 0)
                if cols < NR:
                    for i in range(mr):
                        for j in range(cols):
                            of[(r0 + i) * n + n0 + j] = tmp[i * NR + j]
                r0 += mr


@njit(nogil=True, cache=True, parallel=True)
def gemm_packed(out, a, w, k, n, fmt, act):
    """out[M, N] = a[M, K] @ W[K, N], W packed in panels.

    out, a: C-contiguous float32 2-D; w: the packed 1-D array of packed_len(K, N, fmt)
    elements; fmt: FMT_F32 for float32 w, FMT_BF16 or FMT_F16 for uint16 w, FMT_Q8_0,
    FMT_Q4_0, FMT_Q4_1, FMT_FP8 or a K-quant's for uint8 w (K a multiple of QB); act, the inputs' format: ACT_F32,
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
    n_panels = (n + NR - 1) // NR
    widen = widened_path(m, fmt, act)
    if widen == WIDEN_AMX:
        # a prompt's rows on an 8- or 4-bit weight: the weight widened to bfloat16 a panel pair
        # at a time and multiplied by AMX, for bfloat16 inputs (finer than the int8 ones)
        bf = gemm_inputs(af, m, k, FMT_BF16, FMT_BF16, True)
        _amx_quantized_path(of, bf[4], m, bf[5], w, k, n, n_panels, fmt)
        return
    if widen == WIDEN_DOT:
        # the same without AMX, for Q6_K: the widened panels on the dot tiles (vdpbf16ps)
        _dot_quantized_path(of, w, k, n, m, n_panels, fmt,
                            gemm_inputs(af, m, k, FMT_BF16, FMT_BF16, False))
        return
    on_amx = m >= AMX_MIN_ROWS and has_amx()        # a bfloat16 dot GEMM's rows go to AMX
    ins = gemm_inputs(af, m, k, fmt, act, on_amx)
    dot = ins[6] == MODE_DOT or ins[6] == MODE_DOT_ROWS
    kk = ins[5] if dot else k                       # rows the tiles run over (the dot's padded)
    if ins[6] == MODE_DOT_ROWS and on_amx:
        _amx_path(of, ins[4], m, ins[5], w, k, n, n_panels)
        return
    chunks = min(n_panels, CHUNKS_PER_THREAD * get_kernel_threads())
    kcb = _k_block(kk, dot)
    th = max_tile_height()
    # Up to MC rows (decode-sized: all of a fits in L2) one block of every row and every k, and
    # one parallel region over the panels. More rows (prefill-sized) go in blocks of MC rows x
    # kcb k-rows: each stays in L2 while every panel's [kcb, NR] slab passes (BLIS's order:
    # k-blocks outside the panels). One prange loop serves both: Numba compiles every prange
    # loop as a function with its own copy of the tiles, so a second loop would double them.
    mb, kb_outer = (m, kk) if m <= MC else (MC, kcb)
    for m0 in range(0, m, mb):
        mc = min(mb, m - m0)
        for k0 in range(0, kk, kb_outer):
            kc = min(kb_outer, kk - k0)
            for c in prange(chunks):
                tmp = np.empty(th * NR, np.float32)
                _panels(of, w, k, n, m0, mc, k0, kc, kcb, c * n_panels // chunks,
                        (c + 1) * n_panels // chunks, fmt, tmp, ins, 0)


# ---- the paths a weight's dtype and the level may take, compiled only where they can -------
# gemm_packed is compiled for float32, uint16 and uint8 weights; the AMX paths serve only
# bfloat16 (uint16) or quantized (uint8) weights on a level with AMX, the widened dot path
# only quantized weights on a level with vdpbf16ps. Each path is reached through one of these
# names, whose overload compiles the real call where it applies and a raise elsewhere (the
# callers' runtime tests keep it unreached): the parallel kernels of the paths a compile cannot
# take are not compiled, nor linked into every program above them.

def _amx_quantized_path(of, ab, m, kp, w, k, n, n_panels, fmt):
    """_gemm_amx_quantized, compiled for a uint8 weight on a level with AMX."""
    raise NotImplementedError("called from compiled code only")


def _dot_quantized_path(of, w, k, n, m, n_panels, fmt, ins):
    """_gemm_dot_quantized, compiled for a uint8 weight on a level with vdpbf16ps."""
    raise NotImplementedError("called from compiled code only")


def _amx_path(of, ab, m, kp, w, k, n, n_panels):
    """_gemm_amx, compiled for a uint16 (bfloat16) weight on a level with AMX."""
    raise NotImplementedError("called from compiled code only")


@njit(nogil=True, cache=True)
def _unreachable():
    raise RuntimeError("gemm_packed: a path this weight's format or the level cannot take")


@overload(_amx_quantized_path, inline="always")
def _amx_quantized_path_typed(of, ab, m, kp, w, k, n, n_panels, fmt):
    if w.dtype == types.uint8 and geometry().amx:
        def impl(of, ab, m, kp, w, k, n, n_panels, fmt):
            _gemm_amx_quantized(of, ab, m, kp, w, k, n, n_panels, fmt)
        return impl
    return lambda of, ab, m, kp, w, k, n, n_panels, fmt: _unreachable()


@overload(_dot_quantized_path, inline="always")
def _dot_quantized_path_typed(of, w, k, n, m, n_panels, fmt, ins):
    if w.dtype == types.uint8 and geometry().bf16_dot:
        def impl(of, w, k, n, m, n_panels, fmt, ins):
            _gemm_dot_quantized(of, w, k, n, m, n_panels, fmt, ins)
        return impl
    return lambda of, w, k, n, m, n_panels, fmt, ins: _unreachable()


@overload(_amx_path, inline="always")
def _amx_path_typed(of, ab, m, kp, w, k, n, n_panels):
    if w.dtype == types.uint16 and geometry().amx:
        def impl(of, ab, m, kp, w, k, n, n_panels):
            _gemm_amx(of, ab, m, kp, w, k, n, n_panels, AMX_A_BYTES, AMX_B_BYTES, AMX_PAIRS)
        return impl
    return lambda of, ab, m, kp, w, k, n, n_panels: _unreachable()


@njit(nogil=True, cache=True)
def _dot_quantized_panels(of, w, k, n, m, p0, p1, fmt, scratch, tmp, ins):
    """Panels p0..p1-1 of out = a @ W for a block-quantized W on the bfloat16 dot tiles:
    DOT_QUANT_PANELS panels at a time widened to bfloat16 in `scratch` (dequant.py, a bfloat16
    weight's layout), then every block of MC rows over the group (_panels), while the group
    stays in L2."""
    kk = ins[5]
    kcb = _k_block(kk, True)
    for g0 in range(p0, p1, DOT_QUANT_PANELS):
        g1 = min(p1, g0 + DOT_QUANT_PANELS)
        for p in range(g0, g1):
            dequantize_panel_bf16(w, k, fmt, p, scratch, (p - g0) * k * NR)
        for m0 in range(0, m, MC):
            _panels(of, scratch, k, n, m0, min(MC, m - m0), 0, kk, kcb, g0, g1, FMT_BF16, tmp,
                    ins, g0)


@njit(nogil=True, cache=True, parallel=True)
def _gemm_dot_quantized(of, w, k, n, m, n_panels, fmt, ins):
    """out = a @ W, W block-quantized (integer quants), on a level with vdpbf16ps and no AMX:
    panels split across the cores, each widened to bfloat16 once for all the rows."""
    chunks = min(n_panels, CHUNKS_PER_THREAD * get_kernel_threads())
    th = max_tile_height()
    for c in prange(chunks):
        scratch = np.empty(DOT_QUANT_PANELS * k * NR, np.uint16)
        tmp = np.empty(th * NR, np.float32)
        _dot_quantized_panels(of, w, k, n, m, c * n_panels // chunks, (c + 1) * n_panels // chunks,
                              fmt, scratch, tmp, ins)


@njit(nogil=True, cache=True)
def _amx_group(of, ab, r_lo, r_hi, kp, w, w_base, slab, g0, g1, n, n_panels, tmp):
    """Rows r_lo..r_hi-1 of out against panel pairs g0..g1-1 of a bfloat16 weight whose panel
    p lies at byte w_base + (p - 2 g0) slab of w, a block of BLOCK_ROWS rows at a time (r_hi
    - r_lo a multiple of it, or r_hi = M). The pairs whose columns are all in N in one AMX call
    a k chunk; a pair past N's last whole pair (an odd last panel: its only panel twice)
    through tmp, copied into out."""
    direct = max(0, min(g1, n // BLOCK_COLS) - g0)
    for r0 in range(r_lo, r_hi, BLOCK_ROWS):
        rows = min(BLOCK_ROWS, r_hi - r0)
        for k0 in range(0, kp, AMX_KC):               # A's chunk stays in L1 for the group
            kc = min(AMX_KC, kp - k0)
            acc = 1 if k0 > 0 else 0
            a_at, b_at = 2 * (r0 * kp + k0), 32 * k0       # k0 / 2 pair rows of 64 bytes
            if direct > 0:
                amx_rows(ab, a_at, 2 * kp, rows, w, w_base + b_at, w_base + slab + b_at, 2 * slab, direct, kc,
                         of, 4 * (r0 * n + g0 * BLOCK_COLS), 4 * n, acc)
            for q in range(g0 + direct, g1):
                p1 = 2 * q + 1 if 2 * q + 1 < n_panels else 2 * q
                amx_rows(ab, a_at, 2 * kp, rows, w, w_base + (2 * q - 2 * g0) * slab + b_at,
                         w_base + (p1 - 2 * g0) * slab + b_at, 0, 1, kc,
                         tmp[(q - g0 - direct) * BLOCK_ROWS * BLOCK_COLS:], 0, 4 * BLOCK_COLS, acc)
        for q in range(g0 + direct, g1):
            cols = min(BLOCK_COLS, n - q * BLOCK_COLS)
            at = (q - g0 - direct) * BLOCK_ROWS * BLOCK_COLS
            for i in range(rows):
                for j in range(cols):
                    of[(r0 + i) * n + q * BLOCK_COLS + j] = tmp[at + i * BLOCK_COLS + j]


@njit(nogil=True, cache=True)
def _amx_panels(of, ab, m, kp, w, k, n, n_panels, q0, q1, tmp, a_bytes, b_bytes, pairs):
    """Panel pairs q0..q1-1 of out, every block of BLOCK_ROWS rows, by AMX. When these pairs'
    B slabs fit in AMX_B_BYTES they stay in L2 and every row block passes all of them; else
    rows go in passes of AMX_A_BYTES of A and pairs in groups of AMX_PAIRS (36 KiB a pair at
    K 576), both in L2 while each row block of the pass meets every pair of the group."""
    slab = 2 * slab_offset(1, 0, k, FMT_BF16)          # bytes of one panel
    mb = max(BLOCK_ROWS, a_bytes // (2 * kp) // BLOCK_ROWS * BLOCK_ROWS)
    group = pairs
    if (q1 - q0) * 2 * slab <= b_bytes:             # this core's B fits in L2: keep it
        mb, group = m, max(1, q1 - q0)                  # there, and stream A past it once
    for m0 in range(0, m, mb):                          # rows whose A stays in L2
        for g0 in range(q0, q1, group):
            _amx_group(of, ab, m0, min(m, m0 + mb), kp, w, 2 * g0 * slab, slab, g0, min(q1, g0 + group), n,
                       n_panels, tmp)
    amx_release()


@njit(nogil=True, cache=True, parallel=True)
def _gemm_amx(of, ab, m, kp, w, k, n, n_panels, a_bytes, b_bytes, group):
    """out = ab @ W with AMX blocks of BLOCK_ROWS x 2 panels, panel pairs split across the
    cores."""
    pairs = (n_panels + 1) // 2
    chunks = min(pairs, CHUNKS_PER_THREAD * get_kernel_threads())
    for c in prange(chunks):
        tmp = np.empty(2 * BLOCK_ROWS * BLOCK_COLS, np.float32)    # the partial pairs' C
        _amx_panels(of, ab, m, kp, w, k, n, n_panels, c * pairs // chunks,
                    (c + 1) * pairs // chunks, tmp, a_bytes, b_bytes, group)


@njit(nogil=True, cache=True)
def _amx_quantized_pairs(of, ab, m, kp, w, k, n, n_panels, q0, q1, fmt, scratch, tmp):
    """Panel pairs q0..q1-1 of out = ab @ W for a block-quantized W, AMX_QUANT_PAIRS at a time:
    the group widened to bfloat16 in `scratch` (dequant.py; a pair after another, as a
    bfloat16 weight's pairs lie), then every block of BLOCK_ROWS rows by AMX over the whole
    group (_amx_group), while the group stays in L2 and the rows of ab stream past it."""
    for g0 in range(q0, q1, AMX_QUANT_PAIRS):
        g1 = min(q1, g0 + AMX_QUANT_PAIRS)
        for q in range(g0, g1):
            p1 = 2 * q + 1 if 2 * q + 1 < n_panels else 2 * q      # an odd last panel: twice
            dequantize_pair_bf16(w, k, fmt, 2 * q, p1, scratch[(q - g0) * 2 * k * NR:])
        _amx_group(of, ab, 0, m, kp, scratch, 0, 2 * k * NR, g0, g1, n, n_panels, tmp)
    amx_release()


@njit(nogil=True, cache=True, parallel=True)
def _gemm_amx_quantized(of, ab, m, kp, w, k, n, n_panels, fmt):
    """out = ab @ W, W block-quantized (integer quants: Q8_0, Q4_0, Q4_1, the K-quants): panel
    pairs split across the cores, each widened to bfloat16 once and multiplied by AMX for all the rows."""
    pairs = (n_panels + 1) // 2
    chunks = min(pairs, CHUNKS_PER_THREAD * get_kernel_threads())
    for c in prange(chunks):
        scratch = np.empty(AMX_QUANT_PAIRS * 2 * k * NR, np.uint16)
        tmp = np.empty(2 * BLOCK_ROWS * BLOCK_COLS, np.float32)    # the partial pairs' C
        _amx_quantized_pairs(of, ab, m, kp, w, k, n, n_panels, c * pairs // chunks, (c + 1) * pairs // chunks,
                             fmt, scratch, tmp)


# ---- on the arena: a weight by its address, as the card's programs reach it ----------------

@njit(nogil=True, cache=True, inline="always")
def gemm_at(out, a, f32, u16, address, k, n, fmt, act):
    """gemm_packed with the weight at byte `address` of the arena (f32 / u16: its views)."""
    size = packed_len(k, n, fmt)
    if fmt == FMT_F32:
        gemm_packed(out, a, f32_at(f32, address, size), k, n, fmt, act)
    elif is_quantized(fmt):
        gemm_packed(out, a, u8_at(u16, address, size), k, n, fmt, act)
    else:
        gemm_packed(out, a, u16_at(u16, address, size), k, n, fmt, act)


