"""Caching allocator over one fixed arena: best-fit free list, splitting, coalescing.

The arena is the whole of device memory, so there is no system allocator to
return memory to: freed blocks are kept ("cached") in the free list, merged
with free neighbours, and handed out again. Every block starts and ends on a
128-byte stick boundary.

Stats, in bytes:
- allocated: sum of live blocks (requests rounded up to 128)
- reserved: arena from address 0 to the end of the highest live block, the
  footprint the live blocks pin down (reserved - allocated is fragmentation)
- peak: highest `allocated` seen
- count: live blocks
- largest_free: largest block an allocation could get right now
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

from spyre_serve.device.memory import STICK, DeviceError, DeviceOutOfMemory


@dataclass(frozen=True, slots=True)
class AllocatorStats:
    allocated: int
    reserved: int
    peak: int
    count: int
    largest_free: int
    capacity: int

    @property
    def free(self) -> int:
        return self.capacity - self.allocated


def round_up(nbytes: int) -> int:
    """Bytes actually taken by a request: at least one stick, a whole number of sticks."""
    return max(STICK, -(-nbytes // STICK) * STICK)


class CachingAllocator:
    """Hands out 128-aligned byte ranges of [0, capacity). Thread-safe."""

    def __init__(self, capacity: int):
        if capacity <= 0 or capacity % STICK:
            raise DeviceError(f"allocator capacity {capacity} must be a positive multiple of {STICK}")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._by_size: list[tuple[int, int]] = [(capacity, 0)]  # free blocks (size, address), sorted
        self._free_at: dict[int, int] = {0: capacity}  # free block address -> size
        self._free_end: dict[int, int] = {capacity: 0}  # free block end -> address
        self._live: dict[int, int] = {}  # live block address -> size
        self._freed: set[int] = set()  # addresses freed and not handed out since: double-free detection
        self._allocated = 0
        self._peak = 0

    def malloc(self, nbytes: int) -> int:
        """Address of a new block of at least `nbytes`, best fit; raises DeviceOutOfMemory."""
        if nbytes < 0:
            raise DeviceError(f"cannot allocate a negative size ({nbytes} bytes)")
        size = round_up(int(nbytes))
        with self._lock:
            i = bisect.bisect_left(self._by_size, (size, -1))
            if i == len(self._by_size):
                largest = self._by_size[-1][0] if self._by_size else 0
                raise DeviceOutOfMemory(int(nbytes), self.capacity - self._allocated, largest, self.capacity)
            block_size, addr = self._by_size.pop(i)
            self._forget_free(addr, block_size)
            if block_size > size:  # split: the tail stays free
                self._add_free(addr + size, block_size - size)
            self._live[addr] = size
            self._freed.discard(addr)
            self._allocated += size
            self._peak = max(self._peak, self._allocated)
            return addr

    def free(self, addr: int) -> int:
        """Return a block to the free list, merged with free neighbours; returns its size."""
        with self._lock:
            size = self._live.pop(addr, None)
            if size is None:
                if addr in self._freed:
                    raise DeviceError(f"double free: address {addr} is not allocated (already freed)")
                raise DeviceError(
                    f"free of foreign address {addr}: not the start of any block this allocator "
                    f"handed out (arena is {self.capacity} bytes)"
                )
            self._freed.add(addr)
            self._allocated -= size
            start, end = addr, addr + size
            prev = self._free_end.get(start)
            if prev is not None:  # merge with the free block just before
                self._remove_free(prev, start - prev)
                start = prev
            nxt = self._free_at.get(end)
            if nxt is not None:  # merge with the free block just after
                self._remove_free(end, nxt)
                end += nxt
            self._add_free(start, end - start)
            return size

    def size_of(self, addr: int) -> int | None:
        """Size of the live block at `addr`, or None."""
        return self._live.get(addr)

    def stats(self) -> AllocatorStats:
        with self._lock:
            reserved = max((a + s for a, s in self._live.items()), default=0)
            largest = self._by_size[-1][0] if self._by_size else 0
            return AllocatorStats(self._allocated, reserved, self._peak, len(self._live), largest, self.capacity)

    def reset_peak(self) -> None:
        with self._lock:
            self._peak = self._allocated

    # free-list bookkeeping (caller holds the lock)
    def _add_free(self, addr: int, size: int) -> None:
        bisect.insort(self._by_size, (size, addr))
        self._free_at[addr] = size
        self._free_end[addr + size] = addr

    def _forget_free(self, addr: int, size: int) -> None:
        del self._free_at[addr]
        del self._free_end[addr + size]

    def _remove_free(self, addr: int, size: int) -> None:
        i = bisect.bisect_left(self._by_size, (size, addr))
        del self._by_size[i]
        self._forget_free(addr, size)
