"""write_kv and paged_attention against numpy: the cache written in its layout (K^T
[NB, Hkv, D, BS], V [NB, Hkv, BS, D]), attention against a float64 softmax over each sequence's
gathered K/V. Caches are built logically ([NB, BS, Hkv, D], as a reader thinks of them) and
laid out by `to_layout`."""

import numpy as np
import pytest

from spyre_serve.device.isa import current
from spyre_serve.device.kernels.attention.paged import paged_attention, write_kv
from spyre_serve.device.kernels.formats import FMT_BF16, FMT_DLF16, FMT_F16
from spyre_serve.device.layout import decode, encode
from tests.device.kernels.gemm.test_packed import rounded

D = 16


def to_layout(k_logical, v_logical):
    """Logical caches [NB, BS, Hkv, D] -> the kernels' K^T [NB, Hkv, D, BS], V [NB, Hkv, BS, D]."""
    return (np.ascontiguousarray(k_logical.transpose(0, 2, 3, 1)),
            np.ascontiguousarray(v_logical.transpose(0, 2, 1, 3)))


def from_layout(k_cache, v_cache):
    """The kernels' caches -> logical [NB, BS, Hkv, D]."""
    return k_cache.transpose(0, 3, 1, 2), v_cache.transpose(0, 2, 1, 3)


def _reference(q, k_cache, v_cache, block_tables, query_start, context_lens, scale):
    """Gather each sequence's K/V (logical caches [NB, BS, Hkv, D]) through its block table,
    masked softmax in float64."""
    bs = k_cache.shape[1]
    hkv = k_cache.shape[2]
    group = q.shape[1] // hkv
    out = np.zeros(q.shape, np.float64)
    for s in range(len(context_lens)):
        L = context_lens[s]
        pos = np.arange(L)
        blocks = block_tables[s, pos // bs]
        k = k_cache[blocks, pos % bs].astype(np.float64)  # [L, Hkv, D]
        v = v_cache[blocks, pos % bs].astype(np.float64)
        rows = range(query_start[s], query_start[s + 1])
        q_len = len(rows)
        for j, r in enumerate(rows):
            p = L - q_len + j
            for h in range(q.shape[1]):
                sc = k[: p + 1, h // group] @ q[r, h].astype(np.float64) * scale
                w = np.exp(sc - sc.max())
                out[r, h] = (w / w.sum()) @ v[: p + 1, h // group]
    return out


def _case(q_lens, ctx_lens, hq, hkv, bs, seed=0, shuffle_blocks=True, d=D):
    """Random cache with each sequence's blocks scattered (out of order) over the pool."""
    rng = np.random.default_rng(seed)
    need = [(c + bs - 1) // bs for c in ctx_lens]
    nb = sum(need) + 3
    perm = rng.permutation(nb) if shuffle_blocks else np.arange(nb)
    max_blocks = max(need) + 1
    tables = np.full((len(ctx_lens), max_blocks), -1, np.int32)
    i = 0
    for s, n in enumerate(need):
        tables[s, :n] = perm[i:i + n]
        i += n
    k_cache = rng.standard_normal((nb, bs, hkv, d), dtype=np.float32)
    v_cache = rng.standard_normal((nb, bs, hkv, d), dtype=np.float32)
    query_start = np.zeros(len(q_lens) + 1, np.int32)
    query_start[1:] = np.cumsum(q_lens)
    q = rng.standard_normal((int(query_start[-1]), hq, d), dtype=np.float32)
    return q, k_cache, v_cache, tables, query_start, np.array(ctx_lens, np.int32)


def _run_and_compare(q_lens, ctx_lens, hq, hkv, bs, seed=0, d=D):
    q, kc, vc, bt, qs, cl = _case(q_lens, ctx_lens, hq, hkv, bs, seed, d=d)
    out = np.full_like(q, np.nan)
    scale = 1.0 / 128 * 8  # not 1/sqrt(D), like Granite's multiplier
    paged_attention(out, q, *to_layout(kc, vc), bt, qs, cl, scale)
    np.testing.assert_allclose(out, _reference(q, kc, vc, bt, qs, cl, scale), rtol=1e-4, atol=1e-5)


def test_single_decode_row_single_token_context():
    _run_and_compare([1], [1], hq=1, hkv=1, bs=16)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_with_gqa_ratio(group):
    _run_and_compare([13], [13], hq=2 * group, hkv=2, bs=16)
    _run_and_compare([45], [45], hq=2 * group, hkv=2, bs=16, seed=2)    # past one block


def test_prefill_length_not_multiple_of_block_size():
    _run_and_compare([67], [67], hq=4, hkv=1, bs=16)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_batched_decode_with_gqa_ratio(group):
    _run_and_compare([1, 1, 1], [5, 64, 129], hq=group, hkv=1, bs=16, seed=group)


@pytest.mark.parametrize("group", [1, 2, 3, 5, 8])
def test_decode_rows_on_the_wide_tiles(group):
    # blocks of 64 and D 64: a decode item's query heads go through the wide tiles (every
    # height, and two tiles for 5 and 8), a block's cut at 5, 64 and 129 keys
    _run_and_compare([1, 1, 1], [5, 64, 129], hq=2 * group, hkv=2, bs=64, seed=group, d=64)


def test_mixed_batch_decode_and_chunked_prefill():
    # decode of a long sequence, a chunk with a prefix already cached, a fresh prefill
    _run_and_compare([1, 7, 10, 1], [40, 30, 10, 3], hq=8, hkv=2, bs=16, seed=3)


def test_chunk_spanning_several_row_tiles_after_unaligned_prefix():
    # 37 rows x 4 heads = 148 query vectors (items of 96 and 52) from position 63, blocks of 32
    _run_and_compare([37, 20], [100, 20], hq=4, hkv=1, bs=32, seed=4)


@pytest.mark.parametrize("d", [64, 128])
def test_granite_shapes_mix_prefill_tiles_and_decode_rows(d):
    # Granite's GQA 4:1 and blocks of 64: prefill tiles of many query vectors beside decode
    # rows of 4; the chunk starts at an unaligned position 70 of a 3-block context, so the
    # causal mask cuts a block
    _run_and_compare([1, 130, 1, 20], [200, 200, 65, 20], hq=16, hkv=4, bs=64, seed=5, d=d)


def test_padding_rows_past_query_start_are_untouched():
    q, kc, vc, bt, qs, cl = _case([3], [5], 2, 1, 16)
    kc, vc = to_layout(kc, vc)
    q = np.concatenate([q, np.ones((2, 2, D), np.float32)])
    out = np.full_like(q, 7.0)
    paged_attention(out, q, kc, vc, bt, qs, cl, 0.1)
    assert np.all(out[3:] == 7.0)


def test_rejects_more_query_rows_than_context():
    q, kc, vc, bt, qs, cl = _case([3], [5], 2, 1, 16)
    kc, vc = to_layout(kc, vc)
    cl[0] = 2
    with pytest.raises(ValueError, match="more query rows than context"):
        paged_attention(np.empty_like(q), q, kc, vc, bt, qs, cl, 0.1)


def test_rejects_block_id_beyond_pool():
    q, kc, vc, bt, qs, cl = _case([3], [5], 2, 1, 16)
    kc, vc = to_layout(kc, vc)
    bt[0, 0] = kc.shape[0]
    with pytest.raises(IndexError, match="block id out of range"):
        paged_attention(np.empty_like(q), q, kc, vc, bt, qs, cl, 0.1)


def test_rejects_query_heads_not_multiple_of_kv_heads():
    q, kc, vc, bt, qs, cl = _case([1], [1], 3, 2, 16)
    kc, vc = to_layout(kc, vc)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_attention(np.empty_like(q), q, kc, vc, bt, qs, cl, 0.1)


def empty_caches(nb, bs, hkv, d=D, dtype=np.float32):
    """Zeroed caches in the kernels' layout."""
    return np.zeros((nb, hkv, d, bs), dtype), np.zeros((nb, hkv, bs, d), dtype)


def test_write_kv_places_rows_at_block_and_offset():
    nb, bs, hkv = 5, 16, 3
    kc, vc = empty_caches(nb, bs, hkv)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((4, hkv, D), dtype=np.float32)
    v = rng.standard_normal((4, hkv, D), dtype=np.float32)
    slots = np.array([2 * bs + 3, 0, 4 * bs + 1, 1 * bs + 2], np.int32)
    write_kv(kc, vc, k, v, slots)
    ref_k = np.zeros((nb, bs, hkv, D), np.float32)
    ref_v = np.zeros_like(ref_k)
    for t, sl in enumerate(slots):
        ref_k[sl // bs, sl % bs] = k[t]
        ref_v[sl // bs, sl % bs] = v[t]
    got_k, got_v = from_layout(kc, vc)
    np.testing.assert_array_equal(got_k, ref_k)
    np.testing.assert_array_equal(got_v, ref_v)
    assert kc[2, 1, 5, 3] == k[0, 1, 5] and vc[2, 1, 3, 5] == v[0, 1, 5]   # K^T, V rows


def test_write_kv_skips_negative_slots():
    kc, vc = empty_caches(2, 16, 1)
    k = np.ones((2, 1, D), np.float32)
    write_kv(kc, vc, k, k, np.array([-1, 17], np.int32))
    assert kc.sum() == D and kc[1, 0, :, 1].sum() == D and vc[1, 0, 1].sum() == D


def test_write_kv_rejects_slot_beyond_cache():
    kc, vc = empty_caches(2, 16, 1)
    k = np.ones((1, 1, D), np.float32)
    with pytest.raises(IndexError, match="slot beyond the cache"):
        write_kv(kc, vc, k, k, np.array([32], np.int32))


def test_attention_refuses_blocks_or_heads_not_in_16s():
    q = np.zeros((1, 1, 8), np.float32)
    kc, vc = np.zeros((2, 1, 8, 16), np.float32), np.zeros((2, 1, 16, 8), np.float32)
    with pytest.raises(ValueError, match="multiples of 16"):
        paged_attention(np.empty_like(q), q, kc, vc, np.array([[0]], np.int32),
                        np.array([0, 1], np.int32), np.array([1], np.int32), 0.1)


def test_write_then_attend_equals_reference_on_contiguous_kv():
    # end to end: prefill writes K/V through write_kv, attention reads it back
    hkv, hq, bs, n = 2, 8, 16, 40
    rng = np.random.default_rng(5)
    k = rng.standard_normal((n, hkv, D), dtype=np.float32)
    v = rng.standard_normal((n, hkv, D), dtype=np.float32)
    q = rng.standard_normal((n, hq, D), dtype=np.float32)
    table = np.array([[6, 2, 4]], np.int32)
    slots = (table[0, np.arange(n) // bs] * bs + np.arange(n) % bs).astype(np.int32)
    kc, vc = empty_caches(8, bs, hkv)
    write_kv(kc, vc, k, v, slots)
    out = np.empty_like(q)
    paged_attention(out, q, kc, vc, table, np.array([0, n], np.int32), np.array([n], np.int32), 0.25)
    # dense causal reference with torch-free numpy
    kk = np.repeat(k, hq // hkv, axis=1).astype(np.float64)
    vv = np.repeat(v, hq // hkv, axis=1).astype(np.float64)
    sc = np.einsum("thd,shd->hts", q.astype(np.float64), kk) * 0.25
    sc[:, np.triu(np.ones((n, n), bool), 1)] = -np.inf
    w = np.exp(sc - sc.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    ref = np.einsum("hts,shd->thd", w, vv)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


def test_write_kv_and_attention_are_callable_from_njit_code():
    from numba import njit

    @njit
    def layer(out, q, k, v, kc, vc, slots, bt, qs, cl):
        write_kv(kc, vc, k, v, slots)
        paged_attention(out, q, kc, vc, bt, qs, cl, 0.5)

    rng = np.random.default_rng(0)
    q = rng.standard_normal((3, 4, D), dtype=np.float32)
    k = rng.standard_normal((3, 2, D), dtype=np.float32)
    kc, vc = empty_caches(2, 16, 2)
    bt = np.array([[1]], np.int32)
    qs = np.array([0, 3], np.int32)
    cl = np.array([3], np.int32)
    out = np.empty_like(q)
    layer(out, q, k, k, kc, vc, np.array([16, 17, 18], np.int32), bt, qs, cl)
    np.testing.assert_allclose(out, _reference(q, *from_layout(kc, vc), bt, qs, cl, 0.5),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fmt", [FMT_BF16, FMT_F16, FMT_DLF16])
def test_a_16_bit_cache_is_written_rounded_as_the_reference_rounds(fmt):
    rng = np.random.default_rng(8)
    k = (rng.standard_normal((5, 2, D)) * 30).astype(np.float32)
    v = (rng.standard_normal((5, 2, D)) * 30).astype(np.float32)
    kc, vc = empty_caches(3, 16, 2, dtype=np.uint16)
    slots = np.array([0, 5, 41, 2, 17], np.int32)
    write_kv(kc, vc, k, v, slots, fmt)
    for cache, x in zip(from_layout(kc, vc), (k, v), strict=True):
        got = decode(np.ascontiguousarray(cache).reshape(-1, 2, D)[slots], fmt)
        np.testing.assert_array_equal(got, rounded(x, fmt))


@pytest.mark.parametrize("fmt", [FMT_BF16, FMT_F16, FMT_DLF16])
@pytest.mark.parametrize("q_lens,ctx", [([1, 1, 1], [5, 64, 129]), ([37, 1], [100, 20]),
                                        ([130, 1], [200, 65])])
def test_attention_over_a_16_bit_cache_is_the_reference_on_its_values(fmt, q_lens, ctx):
    """Prefill tiles and decode rows read the 16-bit cache widened exactly: the float64
    reference on the cache's values, within float32 summation. Where the host multiplies
    bfloat16 (AVX512_BF16, AMX), a bfloat16 cache's prefill tiles round q and the weights to
    bfloat16 (test_prompt_tiles_of_a_bfloat16_cache_in_bfloat16); those rows are checked
    there, the rest here."""
    q, kc, vc, bt, qs, cl = _case(q_lens, ctx, 6, 2, 64, seed=9, d=64)
    k16, v16 = encode(kc, fmt), encode(vc, fmt)
    out = np.full_like(q, np.nan)
    paged_attention(out, q, *to_layout(k16, v16), bt, qs, cl, 0.125, fmt)
    want = _reference(q, decode(k16, fmt), decode(v16, fmt), bt, qs, cl, 0.125)
    exact = np.ones(len(q), bool)
    if fmt == FMT_BF16 and current().at_least("avx512_bf16"):
        exact = np.repeat(np.diff(qs) * 3 < 16, np.diff(qs))      # items of < 16 query vectors
    np.testing.assert_allclose(out[exact], want[exact], rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not current().at_least("avx512_bf16"),
                    reason="the host's level multiplies no bfloat16 (AVX512_BF16 or AMX)")
@pytest.mark.parametrize("q_lens,ctx,hq,hkv,d", [([37, 1], [100, 20], 6, 2, 64),
                                                 ([130, 6], [200, 65], 9, 3, 64),
                                                 ([70], [133], 16, 4, 128)])
def test_prompt_tiles_of_a_bfloat16_cache_in_bfloat16(q_lens, ctx, hq, hkv, d):
    """A prompt's tiles over a bfloat16 cache on AMX's tiles or AVX512_BF16's vdpbf16ps (the
    host's best): q rounded to bfloat16, q @ K^T exact in float32, the softmax in float32,
    its weights rounded to bfloat16 before p @ V. Against
    the float64 reference on rounded q: within the weights' rounding, 2^-9 relative each, so
    |error| <= 2^-9 max |V|. The blocks' stale slots hold NaN bits, which must not leak."""
    q, kc, vc, bt, qs, cl = _case(q_lens, ctx, hq, hkv, 64, seed=11, d=d)
    live = np.zeros(kc.shape[:2], bool)
    for s, n in enumerate(cl):
        pos = np.arange(n)
        live[bt[s, pos // 64], pos % 64] = True
    kc[~live] = np.nan
    vc[~live] = np.nan
    k16, v16 = encode(kc, FMT_BF16), encode(vc, FMT_BF16)
    out = np.full_like(q, np.nan)
    paged_attention(out, q, *to_layout(k16, v16), bt, qs, cl, 0.125, FMT_BF16)
    want = _reference(decode(encode(q, FMT_BF16), FMT_BF16), decode(k16, FMT_BF16),
                      decode(v16, FMT_BF16), bt, qs, cl, 0.125)
    bound = 2.0 ** -9 * np.nanmax(np.abs(vc)) + 1e-5
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out, want, rtol=0, atol=bound)
