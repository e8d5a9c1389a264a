"""Tensors made on the card: empty, fill, arange; storage-level ops (resize_, set_); item()."""

from __future__ import annotations

import numpy as np
import torch

from spyre_torch import dtypes, memory
from spyre_torch.kernels import EW_OPS
from spyre_torch.ops import aten
from spyre_torch.ops.fallback import NoCardKernel
from spyre_torch.ops.launch import elementwise
from spyre_torch.runtime import index_of, runtime

_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def check_device(device) -> None:
    """A spyre device argument names a card there is (the op runs on it: ops/devices.py)."""
    if device is not None and torch.device(device).type == "spyre":
        index_of(device)


def _strides_for(shape, memory_format) -> tuple[int, ...] | None:
    if memory_format in (None, torch.contiguous_format, torch.preserve_format):
        return None
    return torch.empty(shape, memory_format=memory_format, device="meta").stride()


@aten("empty.memory_format")
def empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    check_device(device)
    dtype = dtype or torch.get_default_dtype()
    return memory.empty(size, dtype, _strides_for(tuple(size), memory_format))


@aten("empty_strided")
def empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    check_device(device)
    return memory.empty(size, dtype or torch.get_default_dtype(), stride)


def _number(value, dtype: torch.dtype):
    """A Python number (or a 0-dim CPU tensor) as the int or float that dtype holds."""
    if isinstance(value, torch.Tensor):
        value = value.item()
    if dtype.is_floating_point:
        return float(value)
    if dtype == torch.bool:
        return int(bool(value))
    return int(value)


def fill(t: torch.Tensor, value, op: str) -> torch.Tensor:
    code = dtypes.code(t.dtype)
    if code is None:
        raise NoCardKernel(f"dtype {t.dtype}")
    v = _number(value, t.dtype)
    return elementwise(op, EW_OPS["fill"], t, [], code, alpha=float(v))


@aten("fill_.Scalar")
def fill_scalar(self, value):
    return fill(self, value, "aten::fill_.Scalar")


@aten("fill_.Tensor")
def fill_tensor(self, value):
    if value.device.type == "spyre":
        value = value.cpu()
    return fill(self, value, "aten::fill_.Tensor")


@aten("zero_")
def zero_(self):
    return fill(self, 0, "aten::zero_")


@aten("arange.start_out")
def arange_out(start, end, step=1, *, out):
    code = dtypes.code(out.dtype)
    if code is None:
        raise NoCardKernel(f"dtype {out.dtype}")
    # the length as torch computes it (the meta kernel checks the arguments the same way)
    n = torch.arange(start, end, step, dtype=out.dtype, device="meta").numel()
    if out.numel() != n:
        out.resize_((n,))
    f = out.dtype.is_floating_point
    conv = float if f else int
    return elementwise("aten::arange.start_out", EW_OPS["arange"], out, [], code,
                       alpha=float(conv(start)), beta=float(conv(step)))


@aten("_local_scalar_dense")
def local_scalar_dense(self):
    """`t.item()`: one element copied to the host (the stream is waited for)."""
    from spyre_serve.device import DeviceTensor

    rt = runtime()
    np_dtype = np.dtype(dtypes.NUMPY[self.dtype])
    host = np.empty(1, np_dtype)
    stream = rt.current_stream()
    stream.copy_d2h(host, DeviceTensor(memory.address(self), (1,), np_dtype, rt.card))
    stream.synchronize()
    value = torch.from_numpy(host)
    if self.dtype == torch.bfloat16:
        value = value.view(torch.bfloat16)
    return value.item()


_SET = torch.ops.aten.set_


@aten("set_.source_Storage_storage_offset")
def set_storage_offset(self, source, storage_offset, size, stride=()):
    return _SET.source_Storage_storage_offset.redispatch(_CPU_KEYS, self, source, storage_offset,
                                                         size, stride)


@aten("set_.source_Storage")
def set_storage(self, source):
    n = source.nbytes() // self.element_size()
    return _SET.source_Storage_storage_offset.redispatch(_CPU_KEYS, self, source, 0, [n], [1])


@aten("set_.source_Tensor")
def set_tensor(self, source):
    return _SET.source_Storage_storage_offset.redispatch(
        _CPU_KEYS, self, source.untyped_storage(), source.storage_offset(), source.shape,
        source.stride())


@aten("set_")
def set_empty(self):
    return _SET.source_Storage_storage_offset.redispatch(
        _CPU_KEYS, self, memory.new_storage(0, self.device.index), 0, [0], [1])


@aten("resize_")
def resize_(self, size, memory_format=None):
    """Resize in place; a larger size moves the tensor to a new block, its bytes copied."""
    size = tuple(int(d) for d in size)
    strides = _strides_for(size, memory_format) or memory.contiguous_strides(size)
    offset = self.storage_offset()
    need = memory.storage_bytes(size, strides, self.dtype, offset)
    storage = self.untyped_storage()
    if need > storage.nbytes():
        old, storage = storage, memory.new_storage(need, self.device.index)
        if old.nbytes():
            from spyre_torch.ops.copy import copy_bytes

            copy_bytes(storage, old, old.nbytes())
    return _SET.source_Storage_storage_offset.redispatch(_CPU_KEYS, self, storage, offset, size,
                                                         strides)


@aten("record_stream")
def record_stream(self, s):
    memory.record_stream(self, s)
