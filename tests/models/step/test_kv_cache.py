"""The paged KV cache: sized from a budget or given, one trash block for padding."""

from __future__ import annotations

import numpy as np
import pytest

from spyre_serve.device import Card, DeviceOutOfMemory
from spyre_serve.device.kernels.formats import FMT_BF16
from spyre_serve.models.step.kv_cache import KVCache, block_bytes, resolve_dtype
from tests.models.hf_checkpoints import granite_config

CFG = granite_config(hidden=128, layers=3, heads=4, kv_heads=2)   # D 32, Hkv 2


def test_given_block_count_gives_per_layer_k_and_v_with_a_trash_block():
    card = Card(32 << 20)
    kv = KVCache(card, CFG, block_size=16, num_blocks=10)
    assert len(kv.k) == len(kv.v) == 3
    assert kv.k[0].shape == (11, 2, 32, 16)                         # K^T [NB + 1, Hkv, D, BS]
    assert kv.v[0].shape == (11, 2, 16, 32)                         # V [NB + 1, Hkv, BS, D]
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


def test_a_16_bit_cache_stores_uint16_and_fits_twice_the_blocks():
    card = Card(32 << 20)
    kv32 = KVCache(card, CFG, block_size=64, fraction=0.4)
    n32 = kv32.num_blocks
    kv32.free()
    kv = KVCache(card, CFG, block_size=64, fraction=0.4, dtype="bfloat16")
    assert kv.k[0].dtype == np.uint16 and kv.fmt == FMT_BF16
    assert block_bytes(CFG, 64, "bfloat16") * 2 == block_bytes(CFG, 64)
    assert 2 * n32 <= kv.num_blocks + 2


def test_auto_keeps_float32_with_float32_compute_and_16_bits_otherwise():
    assert resolve_dtype("auto", "float32") == "float32"
    assert resolve_dtype("auto", "bfloat16") == "bfloat16"
    assert resolve_dtype("auto", "float16") == "float16"
    assert resolve_dtype("auto", "int8") == "bfloat16"
    assert resolve_dtype("float16", "float32") == "float16"
    with pytest.raises(ValueError, match="one of auto, float32"):
        resolve_dtype("fp8", "float32")


def test_blocks_and_heads_must_come_in_16s():
    with pytest.raises(ValueError, match="multiples of 16"):
        KVCache(Card(32 << 20), CFG, block_size=8, num_blocks=4)
