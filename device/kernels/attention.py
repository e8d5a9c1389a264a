"""Paged KV cache: write this step's K/V, and attention over a ragged batch.

Cache layout: k_cache, v_cache [NB, BS, Hkv, D]; token slot = block*BS + offset.
A sequence's cache positions 0..L-1 live in blocks block_tables[s, p // BS]
at offset p % BS.
"""

import numpy as np
from numba import njit, prange

from device.kernels.fastexp import exp_nonpos

# Start value of running maxima. Finite, because fastmath assumes no infinities.
_NEG_BIG = np.float32(-1.0e30)
_ROW_TILE = 16  # query rows of one sequence per work item


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
    Online softmax over one cache block at a time, float32 accumulation,
    exponentials by `exp_nonpos` (vectorized, 3e-7 relative).
    Rows past query_start[S] (bucket padding) are left untouched.
    """
    _check_attention(out, q, k_cache, v_cache, block_tables, query_start, context_lens)
    nb, bs, hkv, d = k_cache.shape
    hq = q.shape[1]
    group = hq // hkv
    s_n = context_lens.shape[0]
    # Work items: (tile of up to _ROW_TILE query rows of one sequence, KV head).
    # The tile's rows and the `group` query heads sharing the KV head are
    # processed together, so each K/V row is read once per tile, not per row.
    n_tiles = 0
    for s in range(s_n):
        n_tiles += (query_start[s + 1] - query_start[s] + _ROW_TILE - 1) // _ROW_TILE
    tile_seq = np.empty(n_tiles, np.int32)
    tile_row0 = np.empty(n_tiles, np.int32)
    n_tiles = 0
    for s in range(s_n):
        for r0 in range(query_start[s], query_start[s + 1], _ROW_TILE):
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
        nr = min(_ROW_TILE, query_start[s + 1] - r0)
        nqv = nr * group  # query vectors of the item: (row - r0) * group + g
        pos0 = context_lens[s] - (query_start[s + 1] - query_start[s]) + (r0 - query_start[s])
        n_keys = pos0 + nr  # keys the last row sees
        scores = np.empty((nqv, bs), np.float32)
        acc = np.zeros((nqv, d), np.float32)
        m = np.full(nqv, _NEG_BIG, np.float32)
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
            for o in range(cnt):
                kv = k_cache[blk, o, kvh]
                # causal mask: query vectors before q0 belong to rows before this key
                q0 = max(0, b * bs + o - pos0) * group
                for qi in range(q0):
                    scores[qi, o] = _NEG_BIG
                for qi in range(q0, nqv):
                    dot = np.float32(0.0)
                    for i in range(d):
                        dot += qt[qi, i] * kv[i]
                    scores[qi, o] = dot
            for qi in range(nqv):
                sg = scores[qi, :cnt]
                bmax = _NEG_BIG
                for o in range(cnt):
                    bmax = max(bmax, sg[o])
                # row qi // group sees position 0 in block 0, so m is finite from then on
                m_new = max(m[qi], bmax)
                corr = np.float32(np.exp(m[qi] - m_new))
                denom[qi] *= corr
                for i in range(d):
                    acc[qi, i] *= corr
                for o in range(cnt):
                    sg[o] -= m_new
                exp_nonpos(sg, bits[:cnt])  # masked entries: -1e30 - m -> 0
                for o in range(cnt):
                    denom[qi] += sg[o]
                m[qi] = m_new
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
