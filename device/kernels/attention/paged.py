"""Paged KV cache: write this step's K/V, and attention over a ragged batch.

Cache layout, per block and KV head (token slot = block*BS + offset; a sequence's positions
0..L-1 live in blocks block_tables[s, p // BS] at offset p % BS):

    k_cache [NB, Hkv, D, BS]    K transposed: row i holds dim i of the block's BS keys
    v_cache [NB, Hkv, BS, D]    V as it is: row o holds key o's D values

so a block is, as it stands, the weight of a GEMM tile (device/kernels/gemm/microkernel.py, row
stride BS or D): scores = q @ K^T reads K^T's rows 16 keys at a time, and the weighted sum
p @ V reads V's rows 16 dims at a time, with nothing packed or transposed per step. BS and D
are multiples of 16. The cache is float32, or uint16 holding bfloat16 or float16 values
(`fmt`, FMT_BF16 / FMT_F16: `--kv-cache-dtype`): written rounded to nearest even, widened
exactly in the tiles; the attention computes in float32 (where the host multiplies bfloat16,
AMX or AVX512_BF16, a prompt's tile over a bfloat16 cache multiplies in bfloat16 and sums in
float32: paged_attention).
"""

import numpy as np
from numba import njit, prange

from spyre_serve.device.abi import chunks_for, f32_at, get_kernel_threads, u16_at
from spyre_serve.device.kernels.attention.online_softmax import NEG_BIG, online_softmax_block
from spyre_serve.device.kernels.formats import FMT_BF16, FMT_BF16R, FMT_F16, FMT_F32, narrow
from spyre_serve.device.kernels.gemm.amx import amx_release, amx_strips, interleave_rows
from spyre_serve.device.kernels.gemm.dot_tile import dtile
from spyre_serve.device.kernels.gemm.microkernel import tile, wide_tile
from spyre_serve.device.kernels.simd import (
    NR,
    has_amx,
    has_bf16_dot,
    prefetch_span,
    tile_height,
    wide_cols,
    wide_tile_height,
)
from spyre_serve.device.profile import lap

# Work items are (a tile of query rows of one sequence, one KV head): up to this many query
# vectors (rows x the query heads of the KV head), so that a tile's scores and running sum stay
# in L1/L2 while the sequence's blocks pass.
_QV_MAX = 96
_CHUNKS_PER_THREAD = 8     # items go to chunks round-robin; a chunk's scratch is allocated once
_WIDE_MAX_QV = 8           # items of at most this many query vectors take the wide tiles
_PAIRS_MIN_QV = 16         # a bfloat16 cache's items of at least this many (a prompt's tile)
                           # multiply in bfloat16 where the host can: _pair_path
_AMX_ROWS = 16             # an AMX tile's rows: the item's query vectors padded to them
_AMX_K = 32                # bfloat16 values of k in one AMX tile row
PAIRS_NONE, PAIRS_AMX, PAIRS_DOT = 0, 1, 2


@njit(nogil=True, cache=True)
def _pair_path(nqv, d, bs, fmt):
    """How an item of nqv query vectors multiplies: PAIRS_AMX (AMX's tiles) or PAIRS_DOT
    (AVX512_BF16's vdpbf16ps) for a bfloat16 cache's prompt tile, head dim and block size in
    whole AMX tile rows; else PAIRS_NONE (the float32 tiles, the cache widened)."""
    if fmt != FMT_BF16 or nqv < _PAIRS_MIN_QV or d % _AMX_K or bs % _AMX_K:
        return PAIRS_NONE
    if has_amx() != 0:
        return PAIRS_AMX
    if has_bf16_dot() != 0:
        return PAIRS_DOT
    return PAIRS_NONE


@njit(nogil=True, cache=True, inline="always")
def _write_row_as(k_cache, v_cache, kt, vt, blk, off, fmt):
    hkv, d = kt.shape
    for h in range(hkv):
        for i in range(d):
            k_cache[blk, h, i, off] = narrow(kt[h, i], k_cache, fmt)
            v_cache[blk, h, off, i] = narrow(vt[h, i], v_cache, fmt)


@njit(nogil=True, cache=True, inline="always")
def _write_row(k_cache, v_cache, kt, vt, slot, fmt):
    """One row's K^T and V (kt, vt [Hkv, D]) at slot; a negative slot writes nothing. The
    16-bit formats each in their own loop, fmt a constant there: `narrow` of a format known
    only at run time computes every format's rounding and selects (DLFloat16's the dearest;
    Zen 4, 512 rows of a bfloat16 cache: 1.78 ns a value, 0.25 in the bfloat16 loop)."""
    if slot < 0:
        return
    bs = k_cache.shape[3]
    blk = slot // bs
    off = slot % bs
    if fmt == FMT_BF16:
        _write_row_as(k_cache, v_cache, kt, vt, blk, off, FMT_BF16)
    elif fmt == FMT_F16:
        _write_row_as(k_cache, v_cache, kt, vt, blk, off, FMT_F16)
    else:
        _write_row_as(k_cache, v_cache, kt, vt, blk, off, fmt)


@njit(nogil=True, cache=True)
def _write_rows(k_cache, v_cache, k, v, slot_mapping, fmt, t0, t1):
    for t in range(t0, t1):
        _write_row(k_cache, v_cache, k[t], v[t], slot_mapping[t], fmt)


@njit(nogil=True, cache=True, parallel=True)
def _write_parallel(k_cache, v_cache, k, v, slot_mapping, fmt):
    for t in prange(k.shape[0]):
        _write_row(k_cache, v_cache, k[t], v[t], slot_mapping[t], fmt)


@njit(nogil=True, cache=True)
def write_kv(k_cache, v_cache, k, v, slot_mapping, fmt=FMT_F32):
    """K^T and V of each row t at slot = slot_mapping[t] (int32[T]): k_cache[blk, h, :, off]
    = k[t, h], v_cache[blk, h, off] = v[t, h] for blk, off = divmod(slot, BS).

    k_cache [NB, Hkv, D, BS], v_cache [NB, Hkv, BS, D] (float32, or uint16 of format fmt);
    k, v: [T, Hkv, D] float32. A negative slot skips the row (padding tokens of a bucket).
    """
    nb, hkv, d, bs = k_cache.shape
    t_n = k.shape[0]
    if k.shape[1] != hkv or k.shape[2] != d or v.shape[0] != t_n or v.shape[1] != hkv or v.shape[2] != d:
        raise ValueError("write_kv: k, v must be [T, Hkv, D] matching the cache (Hkv, D)", hkv, d)
    if v_cache.shape != (nb, hkv, bs, d):
        raise ValueError("write_kv: want k_cache [NB, Hkv, D, BS] and v_cache [NB, Hkv, BS, D] "
                         "(NB, Hkv, D, BS)", nb, hkv, d, bs)
    if slot_mapping.shape[0] != t_n:
        raise ValueError("write_kv: slot_mapping length differs from tokens", slot_mapping.shape[0], t_n)
    for t in range(t_n):
        if slot_mapping[t] >= nb * bs:
            raise IndexError("write_kv: slot beyond the cache (slot, slots)", slot_mapping[t], nb * bs)
    if chunks_for(t_n, 2 * t_n * hkv * d) == 1:    # a K and a V value a position
        _write_rows(k_cache, v_cache, k, v, slot_mapping, fmt, 0, t_n)
    else:
        _write_parallel(k_cache, v_cache, k, v, slot_mapping, fmt)


@njit(nogil=True, cache=True)
def _check_attention(out, q, k_cache, v_cache, block_tables, query_start, context_lens):
    nb, hkv, d, bs = k_cache.shape
    t_n, hq, dq = q.shape
    s_n = context_lens.shape[0]
    if dq != d or out.shape != q.shape:
        raise ValueError("paged_attention: q/out must be [T, Hq, D] with the cache's D", d)
    if v_cache.shape != (nb, hkv, bs, d):
        raise ValueError("paged_attention: want k_cache [NB, Hkv, D, BS] and v_cache [NB, Hkv, BS, D]"
                         " (NB, Hkv, D, BS)", nb, hkv, d, bs)
    if bs % NR or d % NR:
        raise ValueError("paged_attention: the block size and head dim must be multiples of 16 "
                         "(BS, D)", bs, d)
    if hq % hkv != 0:
        raise ValueError("paged_attention: query heads not a multiple of KV heads", hq, hkv)
    if query_start.shape[0] != s_n + 1 or block_tables.shape[0] != s_n:
        raise ValueError("paged_attention: want query_start [S+1] and block_tables [S, max_blocks]; S is", s_n)
    if query_start[0] != 0 or query_start[s_n] > t_n:
        raise ValueError("paged_attention: query_start must start at 0 and end within T (end, T)",
                         query_start[s_n], t_n)
    max_blocks = block_tables.shape[1]
    for s in range(s_n):
        q_len = query_start[s + 1] - query_start[s]
        if q_len < 0 or q_len > context_lens[s]:
            raise ValueError("paged_attention: sequence has more query rows than context (seq, rows, context)",
                             s, q_len, context_lens[s])
        n_blk = (context_lens[s] + bs - 1) // bs
        if n_blk > max_blocks:
            raise ValueError("paged_attention: context needs more blocks than the table holds (seq, blocks, width)",
                             s, n_blk, max_blocks)
        for b in range(n_blk):
            if block_tables[s, b] < 0 or block_tables[s, b] >= nb:
                raise IndexError("paged_attention: block id out of range (seq, index, block, NB)",
                                 s, b, block_tables[s, b], nb)


@njit(nogil=True, cache=True, inline="always")
def _tiles(c, c_off, ldc, a, lda, nrows, w, w_off, ldw, cols, kc, accumulate, fmt, wide):
    """c[:nrows, :cols] (+)= a[:nrows, :kc] @ W for W's rows ldw elements apart from w_off
    (all flat; row strides ldc, lda): the GEMM's tiles on a KV cache block, NR columns at a
    time, or (wide) wide_cols() at a time; cols a multiple of that width."""
    width = wide_cols() if wide else NR
    for p in range(cols // width):
        r0 = 0
        while r0 < nrows:
            if wide:
                mr = wide_tile_height(nrows - r0)
                wide_tile(mr, a, r0 * lda, lda, w, w_off + p * width, ldw, c,
                          c_off + r0 * ldc + p * width, ldc, kc, accumulate, fmt)
            else:
                mr = tile_height(nrows - r0)
                tile(mr, a, r0 * lda, lda, w, w_off + p * width, ldw, c,
                     c_off + r0 * ldc + p * width, ldc, kc, accumulate, fmt)
            r0 += mr


@njit(nogil=True, cache=True, fastmath=True)
def _attend_item(out, q, kf, vf, shape, block_tables, s, r0, nr, pos0, kvh, group, sc,
                 qt, sbuf, acc, m, denom, bits, fmt):
    """One work item: rows r0..r0+nr-1 of sequence s (the first at position pos0), the query
    heads of KV head kvh; kf, vf the flat caches of `shape` (NB, Hkv, D, BS). Scratch: qt
    [QV, D], sbuf [QV * BS], acc [QV, D], m, denom [QV], bits [2 QV]."""
    nb, hkv, d, bs = shape
    nqv = nr * group          # query vectors: (row - r0) * group + g
    h0 = kvh * group
    n_keys = pos0 + nr        # keys the last row sees
    tfmt = FMT_BF16R if fmt == FMT_BF16 else fmt     # the tiles' name for bfloat16 rows
    wc = wide_cols()
    # a few query vectors (a decode row's heads): wide tiles, a block's row in one pass
    wide = nqv <= _WIDE_MAX_QV and bs % wc == 0 and d % wc == 0
    width = wc if wide else NR                        # the tiles' columns at a time
    for j in range(nr):
        for g in range(group):
            for i in range(d):
                qt[j * group + g, i] = q[r0 + j, h0 + g, i] * sc
    af = qt.reshape(qt.size)
    accf = acc.reshape(acc.size)
    accv = acc[:nqv]
    accv[:] = 0.0
    m[:nqv] = NEG_BIG
    denom[:nqv] = 0.0
    n_blocks = (n_keys + bs - 1) // bs
    for b in range(n_blocks):
        base = (block_tables[s, b] * hkv + kvh) * d * bs       # this block's K^T, and its V
        cnt = min(bs, n_keys - b * bs)
        nxt = -1
        if b + 1 < n_blocks:                 # the next block lies elsewhere: ask for it now
            nxt = (block_tables[s, b + 1] * hkv + kvh) * d * bs
            prefetch_span(kf, nxt, d * bs)
        scores = sbuf[:nqv * bs].reshape(nqv, bs)
        _tiles(sbuf, 0, bs, af, d, nqv, kf, base, bs, (cnt + width - 1) // width * width, d, 0,
               tfmt, wide)
        if nxt >= 0:
            prefetch_span(vf, nxt, d * bs)
        # masked: keys past cnt (stale), and key b*bs+o for row r unless <= pos0 + r (causal)
        for qi in range(nqv):
            first_hidden = min(cnt, max(0, pos0 + qi // group + 1 - b * bs))
            for o in range(first_hidden, bs):
                scores[qi, o] = NEG_BIG
        online_softmax_block(scores, m[:nqv], denom[:nqv], accv, bits)
        _tiles(accf, 0, d, sbuf, bs, nqv, vf, base, d, d, cnt, 1, tfmt, wide)
    for j in range(nr):
        for g in range(group):
            inv = np.float32(1.0) / denom[j * group + g]
            for i in range(d):
                out[r0 + j, h0 + g, i] = acc[j * group + g, i] * inv


@njit(nogil=True, cache=True)
def _pairs(dst, src, base, rows, cols, live, panel):
    """A block's rows (value (r, c) at src[base + r cols + c]) interleaved in pairs, in panels
    of `panel` columns: (r, c) at dst[(c // panel) rows panel + (r // 2) 2 panel + 2 (c %
    panel) + r % 2]. panel = cols is AMX's B layout of the whole block (rows 2 cols values
    apart), panel = NR the dot tiles' slabs (device/kernels/gemm/dot_tile.py). Rows from
    `live` on are zeros (a block's stale slots, which may hold any bits)."""
    for p in range(cols // panel):
        for r in range(rows // 2):
            a = base + 2 * r * cols + p * panel
            interleave_rows(dst, p * rows * panel + 2 * r * panel, src,
                            a if 2 * r < live else -1, a + cols if 2 * r + 1 < live else -1, panel)


@njit(nogil=True, cache=True, inline="always")
def _pair_gemm(c, ldc, a, lda, nrows, tiles, w, cols, k, k_live, cols_live, accumulate, amx):
    """c[:nrows, :cols] (+)= a[:nrows, :k] @ W (a bfloat16 bits, rows lda apart; c float32,
    rows ldc apart), W [k, cols] a block interleaved by `_pairs`. amx: by amx_strips over
    `tiles` tiles of 16 rows, W in AMX's layout (panel = cols). Else by the dot tiles, W in
    panels of NR, only the panels of the first cols_live columns and the first k_live values
    of k (rounded up to a pair): past them W is zeros or c is masked."""
    if amx:
        for n0 in range(0, cols // NR, 4):
            amx_strips(a, 0, 2 * lda, tiles, w, 4 * NR * n0, 4 * cols, k // _AMX_K,
                       min(4, cols // NR - n0), c, 4 * NR * n0, 4 * ldc, accumulate)
        return
    kc = (k_live + 1) // 2 * 2
    for p in range((cols_live + NR - 1) // NR):
        r = 0
        while r < nrows:
            mr = tile_height(nrows - r)
            dtile(mr, a, r * lda, lda, 1, w, p * k * NR, c, r * ldc + p * NR, ldc, kc, accumulate, 0)
            r += mr


@njit(nogil=True, cache=True)
def _round_rows(dst, src, n):
    """dst[:n] = src[:n] (float32) rounded to bfloat16 bits."""
    for i in range(n):
        dst[i] = narrow(src[i], dst, FMT_BF16)


@njit(nogil=True, cache=True, fastmath=True)
def _attend_item_pairs(out, q, kf, vf, shape, block_tables, s, r0, nr, pos0, kvh, group, sc,
                       qb, sbuf, pb, acc, kb, vb, m, denom, bits, path):
    """_attend_item's work in bfloat16 products, for a bfloat16 cache (path PAIRS_AMX or
    PAIRS_DOT): q rounded to bfloat16 (the cache's format); per block, K^T's dim rows and V's
    key rows interleaved in pairs (kb, vb [D * BS]: `_pairs`), the scores q @ K^T in float32,
    scaled and masked, the online softmax in float32, the weights rounded to bfloat16 (as a
    bfloat16 model's attention rounds them: transformers' eager attention casts the float32
    softmax to the query's dtype) and p @ V into acc. On AMX by amx_strips, the query vectors
    padded with zeros to whole tiles of _AMX_ROWS; else by the dot tiles, NR columns a panel.
    Scratch: qb [QV * D], pb [QV * BS] uint16; sbuf [QV * BS], acc [QV, D] float32; QV a
    multiple of _AMX_ROWS."""
    nb, hkv, d, bs = shape
    nqv = nr * group
    amx = path == PAIRS_AMX
    tiles = (nqv + _AMX_ROWS - 1) // _AMX_ROWS
    rows = tiles * _AMX_ROWS if amx else nqv
    panel_k = bs if amx else NR           # _pairs' panel: AMX reads a whole row of pairs
    panel_v = d if amx else NR
    h0 = kvh * group
    n_keys = pos0 + nr
    for j in range(nr):
        for g in range(group):
            for i in range(d):
                qb[(j * group + g) * d + i] = narrow(q[r0 + j, h0 + g, i], qb, FMT_BF16)
    qb[nqv * d:rows * d] = 0
    pb[nqv * bs:rows * bs] = 0
    accf = acc.reshape(acc.size)
    acc[:rows] = 0.0
    accv = acc[:nqv]
    m[:nqv] = NEG_BIG
    denom[:nqv] = 0.0
    n_blocks = (n_keys + bs - 1) // bs
    for b in range(n_blocks):
        base = (block_tables[s, b] * hkv + kvh) * d * bs
        cnt = min(bs, n_keys - b * bs)
        if b + 1 < n_blocks:
            nxt = (block_tables[s, b + 1] * hkv + kvh) * d * bs
            prefetch_span(kf, nxt, d * bs)
            prefetch_span(vf, nxt, d * bs)
        _pairs(kb, kf, base, d, bs, d, panel_k)
        _pair_gemm(sbuf, bs, qb, d, nqv, tiles, kb, bs, d, d, cnt, 0, amx)
        scores = sbuf[:nqv * bs].reshape(nqv, bs)
        for qi in range(nqv):
            first_hidden = min(cnt, max(0, pos0 + qi // group + 1 - b * bs))
            for o in range(first_hidden):
                scores[qi, o] *= sc
            for o in range(first_hidden, bs):
                scores[qi, o] = NEG_BIG
        online_softmax_block(scores, m[:nqv], denom[:nqv], accv, bits)
        _round_rows(pb, sbuf, nqv * bs)
        _pairs(vb, vf, base, bs, d, cnt, panel_v)
        _pair_gemm(accf, d, pb, bs, nqv, tiles, vb, d, bs, cnt, d, 1, amx)
    for j in range(nr):
        for g in range(group):
            inv = np.float32(1.0) / denom[j * group + g]
            for i in range(d):
                out[r0 + j, h0 + g, i] = acc[j * group + g, i] * inv


@njit(nogil=True, cache=True, parallel=True, fastmath=True)
def paged_attention(out, q, k_cache, v_cache, block_tables, query_start, context_lens, scale,
                    fmt=FMT_F32):
    """Causal attention of a ragged batch over a paged KV cache.

    out, q:        [T, Hq, D] float32 (rows of sequence s are query_start[s]:query_start[s+1])
    k_cache, v_cache: [NB, Hkv, D, BS] and [NB, Hkv, BS, D], float32 (or uint16 of format
                   fmt), this step's K/V already written
    block_tables:  int32[S, max_blocks]
    query_start:   int32[S+1]
    context_lens:  int32[S], tokens in cache for s including this step's
    scale:         softmax scale (Granite: attention_multiplier)
    Row j of s sits at position context_lens[s] - q_len + j and attends to
    positions <= its own. Query head h reads KV head h // (Hq // Hkv).
    Work items, in parallel: (a tile of query rows of one sequence, a KV head); the tile's rows
    and the query heads sharing that KV head are processed together, so each K/V row is read
    once per tile. Per cache block: the scores by the GEMM's tiles on the block's K^T, an
    online-softmax update (float32, exponentials by `exp_nonpos`, 3e-7 relative), the
    weighted sum by the tiles on its V: a decode row as a prefill tile, in full vectors. An
    item of at most _WIDE_MAX_QV query vectors (a decode row's heads) takes the wide tiles
    (microkernel.wide_tile: 64 columns on AVX-512), so each row of K^T or V is read once a
    few heights rather than once a 16-column panel and a height.
    With a bfloat16 cache, an item of at least _PAIRS_MIN_QV query vectors (a prompt's tile)
    takes `_attend_item_pairs` where the host multiplies bfloat16 (AMX, else AVX512_BF16): q
    and the softmax weights rounded to bfloat16, each block's K^T and V interleaved in pairs
    and multiplied by AMX's tiles or vdpbf16ps, the softmax in float32 as above.
    Items are dealt round-robin to chunks (a causal prefill's late tiles cost more than its
    early ones), each chunk's scratch allocated once.
    Rows past query_start[S] (bucket padding) are left untouched.
    """
    _check_attention(out, q, k_cache, v_cache, block_tables, query_start, context_lens)
    nb, hkv, d, bs = k_cache.shape
    hq = q.shape[1]
    group = hq // hkv
    s_n = context_lens.shape[0]
    row_tile = max(1, _QV_MAX // group)
    n_tiles = 0
    for s in range(s_n):
        n_tiles += (query_start[s + 1] - query_start[s] + row_tile - 1) // row_tile
    tile_seq = np.empty(n_tiles, np.int32)
    tile_row0 = np.empty(n_tiles, np.int32)
    n_tiles = 0
    for s in range(s_n):
        for r0 in range(query_start[s], query_start[s + 1], row_tile):
            tile_seq[n_tiles] = s
            tile_row0[n_tiles] = r0
            n_tiles += 1
    sc = np.float32(scale)
    items = n_tiles * hkv
    chunks = min(items, _CHUNKS_PER_THREAD * get_kernel_threads())
    kf = k_cache.reshape(k_cache.size)
    vf = v_cache.reshape(v_cache.size)
    for c in prange(chunks):
        qv = group               # the chunk's tallest item: its scratch's height
        for item in range(c, items, chunks):
            s = tile_seq[item // hkv]
            qv = max(qv, min(row_tile, query_start[s + 1] - tile_row0[item // hkv]) * group)
        pairs = _pair_path(qv, d, bs, fmt)             # may any of the chunk's items take it
        if pairs == PAIRS_AMX:
            qv = (qv + _AMX_ROWS - 1) // _AMX_ROWS * _AMX_ROWS    # whole AMX tiles
        qt = np.empty((qv, d), np.float32)
        sbuf = np.empty(qv * bs, np.float32)
        acc = np.empty((qv, d), np.float32)
        m = np.empty(qv, np.float32)
        denom = np.empty(qv, np.float32)
        bits = np.empty(2 * qv, np.int32)
        n16 = qv * max(d, bs) if pairs else 0           # the bfloat16 scratch, if it may run
        qb = np.empty(n16, np.uint16)
        pb = np.empty(n16, np.uint16)
        kb = np.empty(d * bs if pairs else 0, np.uint16)
        vb = np.empty(d * bs if pairs else 0, np.uint16)
        for item in range(c, items, chunks):
            tile_i = item // hkv
            kvh = item % hkv
            s = tile_seq[tile_i]
            r0 = tile_row0[tile_i]
            if item + chunks < items:        # the chunk's next item: its first block, now
                nxt = item + chunks
                first = (block_tables[tile_seq[nxt // hkv], 0] * hkv + nxt % hkv) * d * bs
                prefetch_span(kf, first, d * bs)
                prefetch_span(vf, first, d * bs)
            nr = min(row_tile, query_start[s + 1] - r0)
            pos0 = context_lens[s] - (query_start[s + 1] - query_start[s]) + (r0 - query_start[s])
            path = _pair_path(nr * group, d, bs, fmt)
            if path != PAIRS_NONE:
                _attend_item_pairs(out, q, kf, vf, (nb, hkv, d, bs), block_tables, s, r0, nr,
                                   pos0, kvh, group, sc, qb, sbuf, pb, acc, kb, vb, m, denom,
                                   bits, path)
            else:
                _attend_item(out, q, kf, vf, (nb, hkv, d, bs), block_tables, s, r0, nr, pos0,
                             kvh, group, sc, qt, sbuf, acc, m, denom, bits, fmt)
        if pairs == PAIRS_AMX:
            amx_release()


@njit(nogil=True, cache=True, inline="always")
def attention_at(f32, u16, k_addr, v_addr, kv_fmt, nbt, bs, hkv, d, k3, v3, slot_mapping, a3, q3,
                 block_tables, query_start, context_lens, attn_scale, timers, t, k_write, k_attention):
    """write_kv, then paged attention, over the layer's cache (K^T [NBT, Hkv, D, BS] and V
    [NBT, Hkv, BS, D]; float32, or 16-bit: kv_fmt); returns the kernel timers' running tick,
    as `lap` does (`k_write`, `k_attention`: the timers of the two)."""
    n = nbt * hkv * d * bs
    if kv_fmt == FMT_F32:
        kc = f32_at(f32, k_addr, n).reshape(nbt, hkv, d, bs)
        vc = f32_at(f32, v_addr, n).reshape(nbt, hkv, bs, d)
        write_kv(kc, vc, k3, v3, slot_mapping, kv_fmt)
        t = lap(timers, k_write, t)
        paged_attention(a3, q3, kc, vc, block_tables, query_start, context_lens, attn_scale,
                        kv_fmt)
    else:
        kc16 = u16_at(u16, k_addr, n).reshape(nbt, hkv, d, bs)
        vc16 = u16_at(u16, v_addr, n).reshape(nbt, hkv, bs, d)
        write_kv(kc16, vc16, k3, v3, slot_mapping, kv_fmt)
        t = lap(timers, k_write, t)
        paged_attention(a3, q3, kc16, vc16, block_tables, query_start, context_lens,
                        attn_scale, kv_fmt)
    return lap(timers, k_attention, t)
