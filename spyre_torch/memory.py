"""Tensor storage in the card's arena, and torch.spyre's memory functions.

A spyre tensor is an ordinary torch tensor whose storage was made by
`torch._C._construct_storage_from_data_pointer` with a *device pointer*: `DEVICE_BASE` plus
the block's address in the card's arena. So torch's own view machinery (storage, offset,
strides, `data_ptr()`) works unchanged, and `t.data_ptr() - DEVICE_BASE` is the card address
a kernel is given. The base lies outside any host address space (bit 60: non-canonical on
x86-64), so host code holding a spyre pointer cannot read the card behind it (OpenReg's
guard): the bytes are reached only by the card's kernels and by copies on its streams.

A storage's block goes back to the card when the storage dies (a `weakref.finalize` on the
storage object, which torch keeps alive as long as any tensor uses the storage).
"""

from __future__ import annotations

import weakref

import torch

from spyre_torch.runtime import initialized, runtime

DEVICE_BASE = 1 << 60
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_set_storage = torch.ops.aten.set_.source_Storage_storage_offset


def _device(cache=[]) -> torch.device:  # noqa: B006 - made once, after the rename to "spyre"
    if not cache:
        cache.append(torch.device("spyre", 0))
    return cache[0]


def new_storage(nbytes: int) -> torch.UntypedStorage:
    """A storage of `nbytes` in the card's arena, freed when torch drops it."""
    rt = runtime()
    addr = rt.malloc(nbytes)
    storage = torch._C._construct_storage_from_data_pointer(DEVICE_BASE + addr, _device(), nbytes)
    weakref.finalize(storage, rt.release, addr)
    return storage


def contiguous_strides(shape) -> tuple[int, ...]:
    strides, n = [], 1
    for d in reversed(tuple(shape)):
        strides.append(n)
        n *= max(int(d), 1)
    return tuple(reversed(strides))


def storage_bytes(shape, strides, dtype: torch.dtype, offset: int = 0) -> int:
    """Bytes a tensor of this layout reaches (0 if it has no elements)."""
    if any(int(d) == 0 for d in shape):
        return 0
    last = offset + sum((int(d) - 1) * int(s) for d, s in zip(shape, strides, strict=True))
    return (last + 1) * dtype.itemsize


def on_storage(storage: torch.UntypedStorage, shape, strides, dtype: torch.dtype,
               offset: int = 0) -> torch.Tensor:
    """A spyre tensor viewing `storage` with this layout (metadata only)."""
    t = torch._C._acc.create_empty_tensor([0], dtype)
    # the CPU kernel of set_ only writes metadata; it never reads the storage's bytes
    _set_storage.redispatch(_CPU_KEYS, t, storage, offset, list(shape), list(strides))
    return t


def empty(shape, dtype: torch.dtype, strides=None) -> torch.Tensor:
    """A new spyre tensor (contents unspecified), contiguous unless `strides` are given."""
    shape = tuple(int(d) for d in shape)
    strides = contiguous_strides(shape) if strides is None else tuple(int(s) for s in strides)
    return on_storage(new_storage(storage_bytes(shape, strides, dtype)), shape, strides, dtype)


def address(t: torch.Tensor) -> int:
    """The card address of `t`'s first element."""
    return t.data_ptr() - DEVICE_BASE


def storage_address(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() - DEVICE_BASE


def is_spyre(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "spyre"


def record_stream(t: torch.Tensor, stream: torch.Stream) -> None:
    """`Tensor.record_stream(s)`: the tensor's block is not reused before `s` has passed the
    point where the tensor dies (s: a torch.spyre.Stream, or the torch.Stream torch made of it)."""
    rt = runtime()
    rt.record_stream(storage_address(t), rt.stream_of(stream.stream_id))


# ---- torch.spyre memory functions (mirroring torch.cuda's) ------------------------------------

def memory_allocated(device=None) -> int:
    """Bytes of the card held by live tensors (blocks rounded to the card's 128-byte sticks)."""
    return runtime().allocated if initialized() else 0


def max_memory_allocated(device=None) -> int:
    return runtime().peak if initialized() else 0


def memory_reserved(device=None) -> int:
    """Bytes of the arena the caching allocator has handed out and not got back: live tensors,
    blocks waiting for a stream to pass them, and the programs' operand tables."""
    return runtime().card.allocator.stats().allocated if initialized() else 0


def max_memory_reserved(device=None) -> int:
    return runtime().card.allocator.stats().peak if initialized() else 0


def reset_peak_memory_stats(device=None) -> None:
    if initialized():
        runtime().reset_peak()


def empty_cache() -> None:
    """Wait for the streams and free every block that was waiting for one. (The arena is the
    card's whole memory: freed blocks stay in the allocator's free list, there is no system
    allocator to give them back to.)"""
    if initialized():
        runtime().synchronize()


def mem_get_info(device=None) -> tuple[int, int]:
    """(free bytes, total bytes) of the card."""
    s = runtime().card.allocator.stats()
    return s.capacity - s.allocated, s.capacity


def memory_stats(device=None) -> dict:
    """torch.cuda.memory_stats()'s main keys, from the card's caching allocator."""
    if not initialized():
        return {}
    rt = runtime()
    s = rt.card.allocator.stats()
    return {
        "allocated_bytes.all.current": rt.allocated,
        "allocated_bytes.all.peak": rt.peak,
        "allocation.all.current": rt.count,
        "allocation.all.allocated": rt.num_allocs,
        "allocation.all.freed": rt.num_frees,
        "reserved_bytes.all.current": s.allocated,
        "reserved_bytes.all.peak": s.peak,
        "num_ooms": rt.num_ooms,
        "num_deferred_frees": rt.num_deferred,
        "pending_frees": rt.pending_frees,
        "arena_bytes": s.capacity,
        "arena_footprint_bytes": s.reserved,
        "largest_free_block_bytes": s.largest_free,
    }
