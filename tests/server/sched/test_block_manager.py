"""The block manager alone: content hashes of full blocks, reference counts, which free block
is handed out (LIFO for plain ones, least recently used cached ones, never-used ones last)."""

from __future__ import annotations

import pytest

from spyre_serve.models import SamplingParams
from spyre_serve.server.sched.block_manager import BlockManager, hash_block
from spyre_serve.server.sched.sequence import GenerationParams, Sequence


def seq(seq_id: int, tokens: list[int]) -> Sequence:
    params = GenerationParams(sampling=SamplingParams(temperature=0.0), max_tokens=4)
    return Sequence(seq_id, f"r{seq_id}", 0, list(tokens), params, 0.0)


def filled(blocks: BlockManager, s: Sequence) -> Sequence:
    """``s`` holding blocks for all its tokens, its full ones registered."""
    blocks.grow(s, len(s.token_ids))
    blocks.cache_full_blocks(s, len(s.token_ids))
    return s


def test_a_block_hash_names_its_tokens_and_everything_before_them():
    a, b = hash_block(None, [1, 2, 3, 4]), hash_block(None, [1, 2, 3, 5])
    assert a != b and a == hash_block(None, [1, 2, 3, 4])
    assert hash_block(a, [9, 9, 9, 9]) != hash_block(b, [9, 9, 9, 9])   # same tokens, other prefix
    assert len(a) == 32                                                  # SHA-256


def test_only_full_blocks_of_known_tokens_are_hashed_and_looked_up():
    blocks = BlockManager(8, 4)
    s = filled(blocks, seq(0, list(range(10))))              # 2 full blocks + 2 tokens
    assert len(s.block_hashes) == 2 and blocks.num_cached == 2
    assert blocks.hash_of(s.block_table[2]) is None            # the partial last block: never
    t = seq(1, list(range(10)) + [77])
    assert blocks.lookup(t, 10) == s.block_table[:2]
    assert blocks.lookup(t, 7) == s.block_table[:1]            # capped, whole blocks only
    assert blocks.lookup(seq(2, [0, 1, 2, 9, 4, 5, 6, 7]), 8) == []   # differs in block 0
    assert blocks.lookup(seq(3, [0, 1, 2, 3, 4, 5, 6, 0]), 8) == s.block_table[:1]


def test_shared_blocks_are_counted_and_freed_by_the_last_holder():
    blocks = BlockManager(8, 4)
    a = filled(blocks, seq(0, list(range(9))))
    b = seq(1, list(range(9)))
    hit = blocks.lookup(b, 8)
    assert blocks.can_share(b, hit, 9)
    blocks.share(b, hit, 9)
    blocks.grow(b, 9)
    assert [blocks.ref_count(x) for x in a.block_table] == [2, 2, 1]
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert blocks.num_used == 4 and (blocks.stats.queries, blocks.stats.hits) == (9, 8)
    blocks.free(a)
    assert blocks.num_used == 3 and [blocks.ref_count(x) for x in b.block_table] == [1, 1, 1]
    blocks.free(b)
    assert blocks.num_free == 8 and blocks.usage == 0                 # cached blocks count as free
    assert blocks.num_cached == 2                                      # and stay cached
    blocks.free(b)                                                     # idempotent: holds nothing
    stale = seq(9, [1])
    stale.block_table = [3]                                            # a block nobody holds
    with pytest.raises(RuntimeError, match="held by no sequence"):
        blocks.free(stale)


def test_a_freed_cached_block_is_found_again_until_evicted():
    blocks = BlockManager(4, 4)
    a = filled(blocks, seq(0, [5] * 4 + [6] * 4))
    cached = list(a.block_table)
    blocks.free(a)
    b = seq(1, [5] * 4 + [6] * 4 + [7])
    hit = blocks.lookup(b, 8)
    assert hit == cached
    blocks.share(b, hit, 9)
    assert blocks.num_free == 2                                        # revived from the free ones


def test_plain_freed_blocks_are_reused_first_then_the_least_recently_used_cached_then_new():
    blocks = BlockManager(6, 2)
    a = filled(blocks, seq(0, [1, 1, 2, 2]))       # blocks 0, 1: cached
    b = filled(blocks, seq(1, [3, 3, 4]))          # blocks 2 (cached), 3 (partial, plain)
    blocks.free(a)                                 # evictable, LRU order: 1, 0 (tail first)
    blocks.free(b)                                 # 3 plain; evictable: 1, 0, 2
    assert blocks.num_free == 6 and blocks.num_cached == 3
    c = seq(2, [9] * 12)
    blocks.grow(c, 2)
    assert c.block_table == [3]                    # the plain freed block: LIFO
    blocks.grow(c, 8)
    assert c.block_table == [3, 1, 0, 2]           # then cached ones, least recently used first
    assert blocks.num_cached == 0                  # each evicted block's hash is forgotten
    assert blocks.lookup(seq(3, [1, 1, 2, 2, 0]), 4) == []
    blocks.grow(c, 12)
    assert c.block_table == [3, 1, 0, 2, 4, 5]     # never-used blocks last, in order


def test_a_hit_refreshes_a_block_so_it_is_evicted_last():
    blocks = BlockManager(3, 2)
    a = filled(blocks, seq(0, [1, 1]))
    b = filled(blocks, seq(1, [2, 2]))
    blocks.free(a)
    blocks.free(b)                                  # LRU: a's block, then b's
    c = seq(2, [1, 1, 5])
    blocks.share(c, blocks.lookup(c, 2), 3)         # a's block used again...
    blocks.free(c)                                  # ...and freed: now the most recent
    d = seq(3, [8] * 2)
    blocks.grow(d, 2)
    assert d.block_table == [1]                     # b's block: least recently used
    assert blocks.lookup(seq(4, [1, 1, 0]), 2) == [0]


def test_a_hash_already_held_by_another_block_stays_with_it():
    blocks = BlockManager(4, 2)
    a = filled(blocks, seq(0, [1, 1]))
    b = filled(blocks, seq(1, [1, 1]))              # computed beside a, not from it
    assert blocks.hash_of(a.block_table[0]) is not None and blocks.hash_of(b.block_table[0]) is None
    blocks.free(b)
    assert blocks.num_cached == 1


def test_uncache_forgets_a_block_and_frees_it_as_a_plain_one():
    blocks = BlockManager(4, 2)
    a = filled(blocks, seq(0, [1, 1, 2, 2]))
    h0 = blocks.hash_of(a.block_table[0])
    blocks.free(a)
    assert not blocks.uncache(0, b"other")
    assert blocks.uncache(0, h0)
    assert blocks.lookup(seq(1, [1, 1, 2, 2, 3]), 4) == []
    c = seq(2, [7, 7])
    blocks.grow(c, 2)
    assert c.block_table == [0]                     # plain again: reused first


def test_without_caching_nothing_is_hashed_or_found():
    blocks = BlockManager(4, 2, enable_caching=False)
    a = filled(blocks, seq(0, [1, 1, 2, 2]))
    assert blocks.num_cached == 0 and blocks.lookup(seq(1, [1, 1, 2, 2, 3]), 4) == []
    blocks.free(a)
    b = seq(2, [3, 3])
    blocks.grow(b, 2)
    assert b.block_table == [1]                     # LIFO as before: the last freed first
