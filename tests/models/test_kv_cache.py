"""The paged KV cache: sized from a budget or given, one trash block for padding."""

from __future__ import annotations

import pytest

from spyre_serve.device import Card, DeviceOutOfMemory
from spyre_serve.models.kv_cache import KVCache, block_bytes
from tests.models.checkpoints import granite_config

CFG = granite_config(hidden=128, layers=3, heads=4, kv_heads=2)   # D 32, Hkv 2


def test_given_block_count_gives_per_layer_k_and_v_with_a_trash_block():
    card = Card(32 << 20)
    kv = KVCache(card, CFG, block_size=16, num_blocks=10)
    assert len(kv.k) == len(kv.v) == 3
    assert kv.k[0].shape == (11, 16, 2, 32)                         # [NB + 1, BS, Hkv, D]
    assert kv.trash_block == 10 and kv.num_tokens == 160


def test_block_count_from_a_fraction_of_free_memory():
    card = Card(32 << 20)
    free = card.allocator.stats().largest_free
    kv = KVCache(card, CFG, block_size=64, fraction=0.5)
    per_block = block_bytes(CFG, 64)
    assert kv.nbytes <= 0.5 * free
    assert kv.nbytes + 2 * per_block > 0.5 * free - 2 * 3 * 128     # and not much less


def test_budget_without_room_for_a_block_is_refused():
    card = Card(1 << 20)
    with pytest.raises(DeviceOutOfMemory):
        KVCache(card, CFG, block_size=64, fraction=0.01)


def test_free_gives_the_memory_back():
    card = Card(32 << 20)
    kv = KVCache(card, CFG, block_size=16, num_blocks=50)
    assert card.allocator.stats().allocated >= kv.nbytes
    kv.free()
    assert card.allocator.stats().allocated == 0
