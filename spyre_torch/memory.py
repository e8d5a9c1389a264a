"""Tensor storage in the card's arena, and torch.spyre's memory functions.

A spyre tensor is an ordinary torch tensor whose storage was made by
`torch._C._construct_storage_from_data_pointer` with a *device pointer*: `DEVICE_BASE` plus
the card's span (`CARD_SPAN` times its index) plus the block's address in that card's arena.
So torch's own view machinery (storage, offset, strides, `data_ptr()`) works unchanged,
`address(t)` is the card address a kernel is given, and no two cards' pointers are equal (torch
compares storages by pointer, e.g. torch.save). The base lies outside any host address space
(bit 60: non-canonical on x86-64), so host code holding a spyre pointer cannot read the card
behind it (OpenReg's guard): the bytes are reached only by the card's kernels and by copies on
its streams.

A storage's block goes back to the card when the storage dies (a `weakref.finalize` on the
storage object, which torch keeps alive as long as any tensor uses the storage).
"""

from __future__ import annotations

import weakref

import torch

from spyre_torch.runtime import index_of, initialized, made, runtime

DEVICE_BASE = 1 << 60
CARD_SPAN = 1 << 48  # card i's pointers: DEVICE_BASE + i * CARD_SPAN + its arena address
_IN_CARD = CARD_SPAN - 1
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_set_storage = torch.ops.aten.set_.source_Storage_storage_offset


def new_storage(nbytes: int, index: int | None = None) -> torch.UntypedStorage:
    """A storage of `nbytes` in card `index`'s arena (the current card's by default), freed when
    torch drops it."""
    rt = runtime(index)
    addr = rt.malloc(nbytes)
    storage = torch._C._construct_storage_from_data_pointer(
        DEVICE_BASE + rt.index * CARD_SPAN + addr, rt.device, nbytes)
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
    index = storage.device.index
    t = torch._C._acc.create_empty_tensor([0], dtype) if index == 0 else _blank(index, dtype)
    # the CPU kernel of set_ only writes metadata; it never reads the storage's bytes
    _set_storage.redispatch(_CPU_KEYS, t, storage, offset, list(shape), list(strides))
    return t


# ---- tensors of cards after the first ---------------------------------------------------------
# torch's Python-backend tensor constructor (`_acc.create_empty_tensor`) makes a tensor of spyre:0
# only, and `set_` refuses a storage of another device. A DLPack capsule of such a tensor, its
# device id rewritten, comes back from torch as a tensor of card i: one such seed per card and
# dtype, and each new tensor of that card a detach of its seed below autograd (its own
# TensorImpl and version counter, ~1 us), whose storage on_storage then sets.
_seeds: dict[tuple[int, torch.dtype], torch.Tensor] = {}
_CARD_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)
_detach = torch.ops.aten.detach.default
_DL_EXT_DEV = 12  # DLPack's kDLExtDev: torch's PrivateUse1


def _blank(index: int, dtype: torch.dtype) -> torch.Tensor:
    seed = _seeds.get((index, dtype))
    if seed is None:
        seed = _seeds.setdefault((index, dtype), _seed(index, dtype))
    return _detach.redispatch(_CARD_KEYS, seed)


def _seed(index: int, dtype: torch.dtype) -> torch.Tensor:
    import ctypes

    pointer = ctypes.pythonapi.PyCapsule_GetPointer
    pointer.restype, pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    capsule = torch.utils.dlpack.to_dlpack(torch._C._acc.create_empty_tensor([0], dtype))
    device = (ctypes.c_int32 * 2).from_address(pointer(capsule, b"dltensor") + 8)  # DLTensor.device
    if device[0] != _DL_EXT_DEV:
        raise RuntimeError(f"spyre: torch exported a spyre tensor as DLPack device type {device[0]}, "
                           f"not {_DL_EXT_DEV}: cannot make a tensor of spyre:{index}")
    device[1] = index
    seed = torch._C._from_dlpack(capsule)
    if seed.device != torch.device("spyre", index):
        raise RuntimeError(f"spyre: a tensor of spyre:{index} came back on {seed.device}")
    return seed


def empty(shape, dtype: torch.dtype, strides=None) -> torch.Tensor:
    """A new spyre tensor (contents unspecified), contiguous unless `strides` are given."""
    shape = tuple(int(d) for d in shape)
    strides = contiguous_strides(shape) if strides is None else tuple(int(s) for s in strides)
    return on_storage(new_storage(storage_bytes(shape, strides, dtype)), shape, strides, dtype)


def address(t: torch.Tensor) -> int:
    """The card address of `t`'s first element (in its own card's arena)."""
    return (t.data_ptr() - DEVICE_BASE) & _IN_CARD


def storage_address(t: torch.Tensor) -> int:
    return (t.untyped_storage().data_ptr() - DEVICE_BASE) & _IN_CARD


def is_spyre(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "spyre"


def record_stream(t: torch.Tensor, stream: torch.Stream) -> None:
    """`Tensor.record_stream(s)`: the tensor's block is not reused before `s` has passed the
    point where the tensor dies (s: a torch.spyre.Stream, or the torch.Stream torch made of it)."""
    rt = runtime(t.device.index)
    if stream.device_index != rt.index:
        raise RuntimeError(f"spyre: record_stream: the tensor is on {t.device}, the stream on "
                           f"spyre:{stream.device_index}")
    rt.record_stream(storage_address(t), rt.stream_of(stream.stream_id))


# ---- torch.spyre memory functions (mirroring torch.cuda's): `device` None is the current card --

def _made(device):
    """Card `device`'s runtime if it was made (asking makes no card), else None."""
    index = index_of(device)
    return runtime(index) if initialized(index) else None


def memory_allocated(device=None) -> int:
    """Bytes of the card held by live tensors (blocks rounded to the card's 128-byte sticks)."""
    rt = _made(device)
    return rt.allocated if rt else 0


def max_memory_allocated(device=None) -> int:
    rt = _made(device)
    return rt.peak if rt else 0


def memory_reserved(device=None) -> int:
    """Bytes of the arena the caching allocator has handed out and not got back: live tensors,
    blocks waiting for a stream to pass them, and the programs' operand tables."""
    rt = _made(device)
    return rt.card.allocator.stats().allocated if rt else 0


def max_memory_reserved(device=None) -> int:
    rt = _made(device)
    return rt.card.allocator.stats().peak if rt else 0


def reset_peak_memory_stats(device=None) -> None:
    rt = _made(device)
    if rt:
        rt.reset_peak()


def empty_cache() -> None:
    """Wait for every card's streams and free every block that was waiting for one. (The arena
    is the card's whole memory: freed blocks stay in the allocator's free list, there is no
    system allocator to give them back to.)"""
    for rt in made():
        rt.synchronize()


def mem_get_info(device=None) -> tuple[int, int]:
    """(free bytes, total bytes) of the card (made if need be)."""
    s = runtime(index_of(device)).card.allocator.stats()
    return s.capacity - s.allocated, s.capacity


def memory_stats(device=None) -> dict:
    """torch.cuda.memory_stats()'s main keys, from the card's caching allocator."""
    rt = _made(device)
    if rt is None:
        return {}
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
