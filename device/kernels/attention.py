"""Paged KV cache: write this step's K/V, and attention over a ragged batch.

Cache layout: k_cache, v_cache [NB, BS, Hkv, D]; token slot = block*BS + offset.
A sequence's cache positions 0..L-1 live in blocks block_tables[s, p // BS]
at offset p % BS.
"""

import numpy as np
from numba import njit, prange

from spyre_serve.device.kernels.online_softmax import NEG_BIG, online_softmax_block

# Start value of running maxima. Finite, because fastmath assumes no infinities.
# Work items are (up to this many query vectors of one sequence, one KV head).
_QV_MAX = 128
# OpenBLAS multiplies an m x n x k GEMM with m*n*k <= 4 * 65536 on the calling thread
# (interface/gemm.c, GEMM_MULTITHREAD_THRESHOLD 4): the micro-GEMMs of a work item stay under
# it, so each worker of the parallel loop multiplies on its own core, never in BLAS's pool.
_BLAS_SERIAL_MNK = 262144
# Work items of fewer query vectors (decode rows) use the dot-product loops: a BLAS call's
# packing costs more than it saves on a few rows.
_BLAS_MIN_QV = 16


@njit(nogil=True, cache=True, parallel=True)
def write_kv(k_cache, v_cache, k, v, slot_mapping):
    """k_cache[slot] = k[t], v_cache[slot] = v[t] for slot = slot_mapping[t] (int32[T]).

    k_cache, v_cache: [NB, BS, Hkv, D]; k, v: [T, Hkv, D]. A negative slot
    skips the row (padding tokens of a bucket).
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
                k_cache[blk, off, h, i] = k[t, h, i]
                v_cache[blk, off, h, i] = v[t, h, i]


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


@njit(nogil=True, cache=True, parallel=True, fastmath=True)
def paged_attention(out, q, k_cache, v_cache, block_tables, query_start, context_lens, scale):
    """Causal attention of a ragged batch over a paged KV cache.

    out, q:        [T, Hq, D] float32 (rows of sequence s are query_start[s]:query_start[s+1])
    k_cache, v_cache: [NB, BS, Hkv, D] float32, this step's K/V already written
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
    its scores and its weighted sum of V as two single-threaded BLAS micro-GEMMs per block
    (the block's K and V rows copied contiguous first); a tile of a few decode rows uses
    dot-product loops.
    Rows past query_start[S] (bucket padding) are left untouched.
    """
    _check_attention(out, q, k_cache, v_cache, block_tables, query_start, context_lens)
    nb, bs, hkv, d = k_cache.shape
    hq = q.shape[1]
    group = hq // hkv
    s_n = context_lens.shape[0]
    qv_max = max(group, min(_QV_MAX, _BLAS_SERIAL_MNK // (bs * d)))
    row_tile = max(1, qv_max // group)
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
    for item in prange(n_tiles * hkv):
        tile = item // hkv
        kvh = item % hkv
        h0 = kvh * group
        s = tile_seq[tile]
        r0 = tile_row0[tile]
        nr = min(row_tile, query_start[s + 1] - r0)
        nqv = nr * group  # query vectors of the item: (row - r0) * group + g
        pos0 = context_lens[s] - (query_start[s + 1] - query_start[s]) + (r0 - query_start[s])
        n_keys = pos0 + nr  # keys the last row sees
        use_blas = nqv >= _BLAS_MIN_QV
        sbuf = np.empty(nqv * bs, np.float32)
        acc = np.zeros((nqv, d), np.float32)
        pv = np.empty((nqv, d), np.float32)
        kb = np.empty((bs, d), np.float32)
        vb = np.empty((bs, d), np.float32)
        m = np.full(nqv, NEG_BIG, np.float32)
        denom = np.zeros(nqv, np.float32)
        bits = np.empty(bs, np.int32)
        qt = np.empty((nqv, d), np.float32)  # the tile's query vectors, contiguous, scaled
        for j in range(nr):
            for g in range(group):
                for i in range(d):
                    qt[j * group + g, i] = q[r0 + j, h0 + g, i] * sc
        for b in range((n_keys + bs - 1) // bs):
            blk = block_tables[s, b]
            cnt = min(bs, n_keys - b * bs)
            scores = sbuf[:nqv * cnt].reshape(nqv, cnt)
            if use_blas:
                for o in range(cnt):
                    for i in range(d):
                        kb[o, i] = k_cache[blk, o, kvh, i]
                        vb[o, i] = v_cache[blk, o, kvh, i]
                np.dot(qt, kb[:cnt].T, scores)
            else:
                for o in range(cnt):
                    kv = k_cache[blk, o, kvh]
                    for qi in range(nqv):
                        dot = np.float32(0.0)
                        for i in range(d):
                            dot += qt[qi, i] * kv[i]
                        scores[qi, o] = dot
            # causal mask: key position b*bs+o is visible to row r iff <= pos0 + r
            last = b * bs + cnt - 1
            if last > pos0:
                for qi in range(nqv):
                    first_hidden = pos0 + qi // group + 1 - b * bs
                    for o in range(max(0, first_hidden), cnt):
                        scores[qi, o] = NEG_BIG
            online_softmax_block(scores, m, denom, acc, bits)
            if use_blas:
                np.dot(scores, vb[:cnt], pv)
                for qi in range(nqv):
                    for i in range(d):
                        acc[qi, i] += pv[qi, i]
            else:
                for o in range(cnt):
                    vv = v_cache[blk, o, kvh]
                    for qi in range(nqv):
                        w = scores[qi, o]
                        if w == 0.0:
                            continue
                        for i in range(d):
                            acc[qi, i] += w * vv[i]
        for j in range(nr):
            for g in range(group):
                inv = np.float32(1.0) / denom[j * group + g]
                for i in range(d):
                    out[r0 + j, h0 + g, i] = acc[j * group + g, i] * inv
