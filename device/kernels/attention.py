"""Paged KV cache: write this step's K/V, and attention over a ragged batch.

Cache layout: k_cache, v_cache [NB, BS, Hkv, D]; token slot = block*BS + offset.
A sequence's cache positions 0..L-1 live in blocks block_tables[s, p // BS]
at offset p % BS. The cache is float32, or uint16 holding bfloat16 or float16 values (`fmt`,
FMT_BF16 / FMT_F16: `--kv-cache-dtype`): written rounded to nearest even, read widened
exactly; the attention itself computes in float32.
"""

import numpy as np
from numba import njit, prange

from spyre_serve.device.abi import get_kernel_threads
from spyre_serve.device.kernels.formats import FMT_F32, narrow, widen
from spyre_serve.device.kernels.microkernel import tile
from spyre_serve.device.kernels.online_softmax import NEG_BIG, online_softmax_block
from spyre_serve.device.kernels.simd import NR, tile_height

# Work items are (a tile of query rows of one sequence, one KV head): up to this many query
# vectors (rows x the query heads of the KV head). Each item packs every K and V block it sees;
# taller tiles pack less per row but spill L2 and balance worse over the cores (SmolLM2's
# 512-token prefill, one layer: 96 -> 2.85 ms, 384 -> 3.34 ms).
_QV_MAX = 96
# Items of fewer query vectors (decode rows) use dot-product loops; more (prefill) multiply
# with the GEMM's register tiles, on K and V blocks packed into panels once per item.
_TILES_MIN_QV = 16
_CHUNKS_PER_THREAD = 8     # items go to chunks round-robin; a chunk's scratch is allocated once


@njit(nogil=True, cache=True, parallel=True)
def write_kv(k_cache, v_cache, k, v, slot_mapping, fmt=FMT_F32):
    """k_cache[slot] = k[t], v_cache[slot] = v[t] for slot = slot_mapping[t] (int32[T]).

    k_cache, v_cache: [NB, BS, Hkv, D] (float32, or uint16 of format fmt); k, v: [T, Hkv, D]
    float32. A negative slot skips the row (padding tokens of a bucket).
    """
    nb, bs, hkv, d = k_cache.shape
    t_n = k.shape[0]
    if k.shape[1] != hkv or k.shape[2] != d or v.shape[0] != t_n or v.shape[1] != hkv or v.shape[2] != d:
        raise ValueError("write_kv: k, v must be [T, Hkv, D] matching the cache (Hkv, D)", hkv, d)
    if v_cache.shape != k_cache.shape:
        raise ValueError("write_kv: k_cache and v_cache differ in shape (NB, BS)", nb, bs)
    if slot_mapping.shape[0] != t_n:
        raise ValueError("write_kv: slot_mapping length differs from tokens", slot_mapping.shape[0], t_n)
    for t in range(t_n):
        if slot_mapping[t] >= nb * bs:
            raise IndexError("write_kv: slot beyond the cache (slot, slots)", slot_mapping[t], nb * bs)
    for t in prange(t_n):
        slot = slot_mapping[t]
        if slot < 0:
            continue
        blk = slot // bs
        off = slot % bs
        for h in range(hkv):
            for i in range(d):
                k_cache[blk, off, h, i] = narrow(k[t, h, i], k_cache, fmt)
                v_cache[blk, off, h, i] = narrow(v[t, h, i], v_cache, fmt)


@njit(nogil=True, cache=True)
def _check_attention(out, q, k_cache, v_cache, block_tables, query_start, context_lens):
    nb, bs, hkv, d = k_cache.shape
    t_n, hq, dq = q.shape
    s_n = context_lens.shape[0]
    if dq != d or out.shape != q.shape:
        raise ValueError("paged_attention: q/out must be [T, Hq, D] with the cache's D", d)
    if v_cache.shape != k_cache.shape:
        raise ValueError("paged_attention: k_cache and v_cache differ in shape (NB, BS)", nb, bs)
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
def _pack_k(kp, k_cache, blk, kvh, cnt, d, fmt):
    """kp [ceil(bs/NR), d, NR]: the block's keys as the panels of K^T (key j of panel p at
    column j), keys past cnt zero: scores = q @ K^T with the GEMM's tiles."""
    kp[:] = 0.0
    for o in range(cnt):
        p, j = o // NR, o % NR
        for i in range(d):
            kp[p, i, j] = widen(k_cache[blk, o, kvh, i], fmt)


@njit(nogil=True, cache=True, inline="always")
def _pack_v(vp, v_cache, blk, kvh, cnt, d, fmt):
    """vp [ceil(d/NR), bsp, NR]: the block's values as the panels of V (dims 16p.. of key o at
    row o), keys past cnt and dims past d zero."""
    vp[:] = 0.0
    for o in range(cnt):
        for i in range(d):
            vp[i // NR, o, i % NR] = widen(v_cache[blk, o, kvh, i], fmt)


@njit(nogil=True, cache=True, inline="always")
def _tiled_gemm(c, ldc, a, lda, nrows, w, panels, kc, accumulate):
    """c[:nrows, :panels * NR] (+)= a[:nrows, :kc] @ W, W packed as panels of kc x NR rows
    (all flat float32; row strides ldc, lda)."""
    for p in range(panels):
        r0 = 0
        while r0 < nrows:
            mr = tile_height(nrows - r0)
            tile(mr, a, r0 * lda, lda, w, p * kc * NR, c, r0 * ldc + p * NR, ldc, kc,
                 accumulate, FMT_F32)
            r0 += mr


@njit(nogil=True, cache=True, fastmath=True)
def _attend_item(out, q, k_cache, v_cache, block_tables, s, r0, nr, pos0, kvh, group, sc,
                 qt, sbuf, acc, m, denom, bits, kp, vp, fmt):
    """One work item: rows r0..r0+nr-1 of sequence s (the first at position pos0), the query
    heads of KV head kvh. Scratch: qt [QV, d], sbuf [QV * bsp], acc [QV, dp] (dp, bsp: d and
    bs rounded up to NR), m, denom [QV], bits [QV * (bsp + 3)], kp, vp (the panels)."""
    nb, bs, hkv, d = k_cache.shape
    bsp = kp.shape[0] * NR
    dp = vp.shape[0] * NR
    nqv = nr * group          # query vectors: (row - r0) * group + g
    h0 = kvh * group
    n_keys = pos0 + nr        # keys the last row sees
    tiled = nqv >= _TILES_MIN_QV
    for j in range(nr):
        for g in range(group):
            for i in range(d):
                qt[j * group + g, i] = q[r0 + j, h0 + g, i] * sc
    af = qt.reshape(qt.size)
    accv = acc[:nqv]
    accv[:] = 0.0
    m[:nqv] = NEG_BIG
    denom[:nqv] = 0.0
    for b in range((n_keys + bs - 1) // bs):
        blk = block_tables[s, b]
        cnt = min(bs, n_keys - b * bs)
        width = bsp if tiled else cnt
        scores = sbuf[:nqv * width].reshape(nqv, width)
        if tiled:
            _pack_k(kp, k_cache, blk, kvh, cnt, d, fmt)
            _tiled_gemm(sbuf, bsp, af, d, nqv, kp.reshape(kp.size), kp.shape[0], d, 0)
        else:
            for o in range(cnt):
                kv = k_cache[blk, o, kvh]
                for qi in range(nqv):
                    dot = np.float32(0.0)
                    for i in range(d):
                        dot += qt[qi, i] * widen(kv[i], fmt)
                    scores[qi, o] = dot
        # masked: keys past cnt, and key b*bs+o for row r unless <= pos0 + r (causal)
        for qi in range(nqv):
            first_hidden = min(cnt, max(0, pos0 + qi // group + 1 - b * bs))
            for o in range(first_hidden, width):
                scores[qi, o] = NEG_BIG
        online_softmax_block(scores, m[:nqv], denom[:nqv], accv, bits)
        if tiled:
            _pack_v(vp, v_cache, blk, kvh, cnt, d, fmt)
            _tiled_gemm(acc.reshape(acc.size), dp, sbuf, bsp, nqv, vp.reshape(vp.size),
                        vp.shape[0], bsp, 1)
        else:
            for o in range(cnt):
                vv = v_cache[blk, o, kvh]
                for qi in range(nqv):
                    w = scores[qi, o]
                    if w == 0.0:
                        continue
                    for i in range(d):
                        acc[qi, i] += w * widen(vv[i], fmt)
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
    k_cache, v_cache: [NB, BS, Hkv, D] float32 (or uint16 of format fmt), this step's K/V
                   already written
    block_tables:  int32[S, max_blocks]
    query_start:   int32[S+1]
    context_lens:  int32[S], tokens in cache for s including this step's
    scale:         softmax scale (Granite: attention_multiplier)
    Row j of s sits at position context_lens[s] - q_len + j and attends to
    positions <= its own. Query head h reads KV head h // (Hq // Hkv).
    Work items, in parallel: (a tile of query rows of one sequence, a KV head); the tile's rows
    and the query heads sharing that KV head are processed together, so each K/V row is read
    once per tile. Online softmax over one cache block at a time, float32 accumulation,
    exponentials by `exp_nonpos` (vectorized, 3e-7 relative). A tile of prefill rows computes
    its scores and its weighted sum of V with the GEMM's register tiles (the block's K and V
    packed into panels first); a tile of a few decode rows uses dot-product loops. Items are
    dealt round-robin to chunks (a causal prefill's late tiles cost more than its early ones),
    each chunk's scratch allocated once.
    Rows past query_start[S] (bucket padding) are left untouched.
    """
    _check_attention(out, q, k_cache, v_cache, block_tables, query_start, context_lens)
    nb, bs, hkv, d = k_cache.shape
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
    bsp = (bs + NR - 1) // NR * NR
    dp = (d + NR - 1) // NR * NR
    for c in prange(chunks):
        qv = group               # the chunk's tallest item: its scratch's height
        for item in range(c, items, chunks):
            s = tile_seq[item // hkv]
            qv = max(qv, min(row_tile, query_start[s + 1] - tile_row0[item // hkv]) * group)
        qt = np.empty((qv, d), np.float32)
        sbuf = np.empty(qv * bsp, np.float32)
        acc = np.empty((qv, dp), np.float32)
        m = np.empty(qv, np.float32)
        denom = np.empty(qv, np.float32)
        bits = np.empty(qv * (bsp + 3), np.int32)
        kp = np.empty((bsp // NR, d, NR), np.float32)
        vp = np.empty((dp // NR, bsp, NR), np.float32)
        for item in range(c, items, chunks):
            tile_i = item // hkv
            kvh = item % hkv
            s = tile_seq[tile_i]
            r0 = tile_row0[tile_i]
            nr = min(row_tile, query_start[s + 1] - r0)
            pos0 = context_lens[s] - (query_start[s + 1] - query_start[s]) + (r0 - query_start[s])
            _attend_item(out, q, k_cache, v_cache, block_tables, s, r0, nr, pos0, kvh, group,
                         sc, qt, sbuf, acc, m, denom, bits, kp, vp, fmt)
