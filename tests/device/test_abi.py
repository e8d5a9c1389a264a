import numpy as np
import pytest

from spyre_serve.device.abi import f32_at, i32_at, i64_at, u16_at


def test_typed_views_start_at_the_byte_address(card):
    t = card.empty((4,), np.int64)
    t.numpy()[:] = [1, 2, 3, -4]
    assert i64_at(card.i64, t.address, 4).tolist() == [1, 2, 3, -4]
    assert i32_at(card.i32, t.address + 8, 2).tolist() == [2, 0]
    assert u16_at(card.u16, t.address + 24, 4).tolist() == [0xFFFC, 0xFFFF, 0xFFFF, 0xFFFF]
    f = card.empty((3,), np.float32)
    f.numpy()[:] = [0.5, 1.5, 2.5]
    assert f32_at(card.f32, f.address + 4, 2).tolist() == [1.5, 2.5]


def test_views_write_through_to_the_arena(card):
    f = card.zeros((2,), np.float32)
    f32_at(card.f32, f.address, 2)[1] = 7.0
    assert f.numpy()[1] == 7.0


def test_misaligned_address_raises(card):
    with pytest.raises(ValueError, match="not 4-byte aligned"):
        f32_at(card.f32, 130, 1)
    with pytest.raises(ValueError, match="not 8-byte aligned"):
        i64_at(card.i64, 132, 1)


def test_view_past_the_arena_raises(card):
    with pytest.raises(IndexError, match="outside the arena"):
        i32_at(card.i32, card.capacity - 4, 2)


def test_kernel_threads_are_read_and_set_from_njit_code_per_calling_thread():
    import numba
    from numba import njit

    from spyre_serve.device.abi import get_kernel_threads, set_kernel_threads

    @njit(cache=False)
    def swap(n):
        before = get_kernel_threads()
        set_kernel_threads(n)
        during = get_kernel_threads()
        set_kernel_threads(before)
        return before, during

    full = numba.config.NUMBA_NUM_THREADS
    numba.set_num_threads(full)
    assert swap(1) == (full, 1)
    assert numba.get_num_threads() == full
