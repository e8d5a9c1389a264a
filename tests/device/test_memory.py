import random

import numpy as np
import pytest

from spyre_serve.device import STICK, Card, DeviceError, DeviceOutOfMemory, DeviceTensor
from spyre_serve.device.allocator import CachingAllocator
from spyre_serve.device.card import DEFAULT_MEMORY_BYTES
from spyre_serve.device.memory import parse_bytes


def test_arena_base_is_128_byte_aligned(card):
    assert card.memory.ctypes.data % STICK == 0
    assert card.memory.dtype == np.uint8 and card.memory.size == card.capacity


def test_typed_views_share_the_arena_bytes(card):
    card.f32[1] = 1.0  # bytes 4..8
    assert card.memory[4:8].view(np.float32)[0] == 1.0
    assert card.i32[1] == np.float32(1.0).view(np.int32)
    card.i64[2] = -5
    assert card.u16[8] == 0xFFFB  # low half of the int64 at bytes 16..24 (little-endian)


def test_capacity_is_rounded_up_to_whole_sticks():
    with Card(memory_bytes=1000) as c:
        assert c.capacity == 1024


def test_a_card_without_a_size_has_4_gib_whatever_the_environment_says(monkeypatch):
    monkeypatch.setenv("SPYRE_DEVICE_MEMORY", "64M")  # the variable cards read before
    monkeypatch.setenv("SPYRE_SERVE_DEVICE_MEMORY", "64M")  # the server's, read by its CLI only
    with Card() as c:
        assert c.capacity == DEFAULT_MEMORY_BYTES == 4 << 30


def test_parse_bytes_reads_binary_units_and_rejects_garbage():
    assert parse_bytes("2G") == 2 << 30 and parse_bytes("512MiB") == 512 << 20 and parse_bytes("4096") == 4096
    assert parse_bytes("1.5G") == 3 << 29 and parse_bytes("64kb") == 64 << 10
    with pytest.raises(DeviceError, match="cannot read a memory size"):
        parse_bytes("lots")


def test_allocations_are_stick_aligned_and_disjoint(card):
    ts = [card.empty((n,), np.float32) for n in (1, 31, 32, 33, 100, 7)]
    spans = sorted((t.address, t.address + t.nbytes) for t in ts)
    assert all(a % STICK == 0 for a, _ in spans)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False))


def test_zero_byte_allocation_takes_one_stick():
    a = CachingAllocator(1024)
    x, y = a.malloc(0), a.malloc(0)
    assert x != y and a.stats().allocated == 2 * STICK


def test_best_fit_takes_the_smallest_free_block_that_fits():
    a = CachingAllocator(8 * STICK)
    blocks = [a.malloc(s * STICK) for s in (3, 1, 1, 1, 2)]  # fills the arena
    a.free(blocks[0])  # 3-stick hole at 0
    a.free(blocks[2])  # 1-stick hole at 4 sticks
    assert a.malloc(STICK) == 4 * STICK  # the 1-stick hole, not the 3-stick one
    assert a.malloc(2 * STICK) == 0  # the 3-stick hole, split


def test_split_leaves_the_remainder_free():
    a = CachingAllocator(8 * STICK)
    x = a.malloc(3 * STICK)
    assert x == 0
    assert a.stats().largest_free == 5 * STICK
    assert a.malloc(5 * STICK) == 3 * STICK


def test_free_coalesces_with_both_neighbours():
    a = CachingAllocator(6 * STICK)
    x, y, z = (a.malloc(2 * STICK) for _ in range(3))
    a.free(x)
    a.free(z)
    assert a.stats().largest_free == 2 * STICK
    a.free(y)  # merges with x before and z after
    assert a.stats().largest_free == 6 * STICK
    assert a.malloc(6 * STICK) == 0


def test_out_of_memory_names_requested_free_and_largest_block():
    a = CachingAllocator(4 * STICK)
    blocks = [a.malloc(STICK) for _ in range(4)]
    a.free(blocks[0])
    a.free(blocks[2])  # 2 sticks free, but not together
    with pytest.raises(DeviceOutOfMemory) as info:
        a.malloc(2 * STICK)
    err = info.value
    assert (err.requested, err.free, err.largest_free) == (256, 256, 128)
    assert "requested 256 bytes" in str(err) and "256 bytes free" in str(err) and "largest free block 128" in str(err)


def test_card_out_of_memory_is_a_device_error(card):
    with pytest.raises(DeviceError, match="out of memory"):
        card.empty((card.capacity,), np.float32)


def test_double_free_raises(card):
    t = card.empty((16,))
    card.free(t)
    with pytest.raises(DeviceError, match="double free"):
        card.free(t)


def test_foreign_address_raises(card):
    t = card.empty((64,))
    with pytest.raises(DeviceError, match="foreign address"):
        card.free(t.address + STICK)
    with pytest.raises(DeviceError, match="foreign address"):
        card.free(12345678)


def test_tensor_of_another_card_is_refused_by_free(card):
    with Card(memory_bytes=1 << 16) as other:
        t = other.empty((4,))
        with pytest.raises(DeviceError, match="another card"):
            card.free(t)


def test_stats_track_allocated_reserved_peak_count(card):
    a = card.empty((32,))  # 128 bytes
    b = card.empty((64,))  # 256 bytes
    s = card.allocator.stats()
    assert (s.allocated, s.reserved, s.peak, s.count) == (384, 384, 384, 2)
    card.free(a)
    s = card.allocator.stats()
    assert (s.allocated, s.reserved, s.peak, s.count) == (256, 384, 384, 1)  # b still pins [128, 384)
    card.free(b)
    s = card.allocator.stats()
    assert (s.allocated, s.reserved, s.peak, s.count, s.largest_free) == (0, 0, 384, 0, card.capacity)


def test_random_alloc_free_keeps_blocks_disjoint_and_accounting_exact():
    rng = random.Random(0)
    a = CachingAllocator(256 * STICK)
    live = {}
    for _ in range(3000):
        if live and (rng.random() < 0.45 or len(live) > 60):
            addr = rng.choice(list(live))
            assert a.free(addr) == live.pop(addr)
        else:
            n = rng.randint(0, 9 * STICK)
            try:
                addr = a.malloc(n)
            except DeviceOutOfMemory as e:
                assert e.largest_free < n
                continue
            live[addr] = max(STICK, -(-n // STICK) * STICK)
        spans = sorted((x, x + s) for x, s in live.items())
        assert all(e <= nxt for (_, e), (nxt, _) in zip(spans, spans[1:], strict=False))
        assert a.stats().allocated == sum(live.values())
    for addr in list(live):
        a.free(addr)
    assert a.stats().largest_free == a.capacity  # everything merged back into one block


def test_tensor_numpy_is_a_view_without_copy(card):
    t = card.empty((3, 5), np.float32)
    v = t.numpy()
    v[:] = np.arange(15, dtype=np.float32).reshape(3, 5)
    assert np.shares_memory(v, card.memory)
    assert card.f32[t.address // 4 + 7] == 7.0
    assert t.numpy()[1, 2] == 7.0


def test_tensor_reports_shape_dtype_nbytes(card):
    t = card.empty((4, 6), np.uint16)
    assert (t.shape, t.dtype, t.size, t.nbytes) == ((4, 6), np.dtype(np.uint16), 24, 48)


def test_reshape_keeps_address_and_checks_size(card):
    t = card.empty((4, 6))
    r = t.reshape(-1, 3)
    assert (r.address, r.shape) == (t.address, (8, 3))
    with pytest.raises(DeviceError, match="cannot reshape"):
        t.reshape(5, 5)


def test_misaligned_tensor_address_is_refused():
    with pytest.raises(DeviceError, match="itemsize"):
        DeviceTensor(6, (2,), np.float32)
