"""Copies: host -> card and card -> host as commands on the current stream, card -> card as a
kernel. torch routes `copy_`, `.to()`, `.cpu()` and `.contiguous()` through `_copy_from`.

- host -> card: the host tensor, cast to the destination's dtype and broadcast, is snapshotted
  at enqueue (the host may reuse it at once) and copied into the card (`Stream.copy_h2d`);
  into a non-contiguous destination through a row-major staging tensor and a kernel;
- card -> host: a row-major source is copied out (`Stream.copy_d2h`) and the stream waited for;
  any other layout is made row-major on the card first;
- card -> card: the elementwise kernel's copy (any strides, broadcast, dtype casts); a source
  sharing the destination's storage is copied aside first;
- one card -> another: through the host (a copy out of the source's card, then into the
  destination's), each on its card's current stream.
"""

from __future__ import annotations

import numpy as np
import torch

from spyre_torch import dtypes, memory
from spyre_torch.kernels import EW_OPS
from spyre_torch.ops import aten
from spyre_torch.ops.launch import elementwise
from spyre_torch.runtime import on_card, runtime


def row_major(t: torch.Tensor) -> bool:
    """True when t's elements fill its memory in row-major order (size-1 dims aside)."""
    expected = 1
    for size, stride in zip(reversed(t.shape), reversed(t.stride()), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _device_tensor(t: torch.Tensor, np_dtype):
    from spyre_serve.device import DeviceTensor

    return DeviceTensor(memory.address(t), (t.numel(),), np_dtype, runtime().card)


def to_card(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst (spyre) <- src (host): broadcast and cast on the host, one copy command."""
    if not row_major(dst):
        staging = memory.empty(dst.shape, dst.dtype)
        to_card(staging, src)
        card_copy(dst, staging)
        return
    host = src.to(dst.dtype).expand(dst.shape).contiguous()
    if dst.numel():
        view = dtypes.host_view(host).reshape(-1)
        runtime().current_stream().copy_h2d(_device_tensor(dst, view.dtype), view)


def to_host(src: torch.Tensor) -> torch.Tensor:
    """A new CPU tensor with src's values (waits for the current stream)."""
    if not row_major(src):
        src = card_copy(memory.empty(src.shape, src.dtype), src)
    np_dtype = np.dtype(dtypes.NUMPY[src.dtype])
    host = np.empty(src.numel(), np_dtype)
    if src.numel():
        stream = runtime().current_stream()
        stream.copy_d2h(host, _device_tensor(src, np_dtype))
        stream.synchronize()
    out = torch.from_numpy(host)
    if src.dtype == torch.bfloat16:
        out = out.view(torch.bfloat16)
    return out.view(src.shape)


def card_copy(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst <- src, both on the card (src broadcast to dst's shape, cast to its dtype).
    Dtypes without a kernel code copy their bits when both sides agree, and go through the
    host otherwise."""
    dcode, scode = dtypes.code(dst.dtype), dtypes.code(src.dtype)
    if dcode is None or scode is None:
        if dst.dtype != src.dtype:
            to_card(dst, to_host(src))
            return dst
        raw, as_dtype = dtypes.RAW[dst.element_size()]
        elementwise("aten::_copy_from", EW_OPS["copy"], dst.view(as_dtype),
                    [_aside(dst, src).view(as_dtype)], dtypes.I64)
        return dst
    src = _aside(dst, src)
    cdt = dcode if dcode in dtypes.FLOATS or scode not in dtypes.FLOATS else scode
    if cdt not in dtypes.FLOATS:
        cdt = dtypes.I64  # integers, bools and raw bits copy exactly through int64
    return elementwise("aten::_copy_from", EW_OPS["copy"], dst, [src], cdt)


def _aside(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """src, copied first when it shares dst's storage (an overlapping copy would read
    elements it already wrote)."""
    if src.numel() and dst.untyped_storage().data_ptr() == src.untyped_storage().data_ptr():
        return card_copy(memory.empty(src.shape, src.dtype), src)
    return src


def copy_bytes(dst_storage, src_storage, nbytes: int, dst_offset: int = 0, src_offset: int = 0):
    """nbytes bytes from one card storage to another (as uint8 elements)."""
    if nbytes <= 0:
        return True
    dst = memory.on_storage(dst_storage, (nbytes,), (1,), torch.uint8, dst_offset)
    src = memory.on_storage(src_storage, (nbytes,), (1,), torch.uint8, src_offset)
    elementwise("aten::_copy_from", EW_OPS["copy"], dst, [src], dtypes.U8)
    return True


@aten("_copy_from")
def copy_from(self, dst, non_blocking=False):
    """Each side on its own card (the op is not given one: ops.CROSS_CARD)."""
    if self.device.type == "spyre" and dst.device.type == "spyre":
        if self.device == dst.device:
            with on_card(dst.device.index):
                card_copy(dst, self)
        else:  # card to card: through the host
            with on_card(self.device.index):
                host = to_host(self)
            with on_card(dst.device.index):
                to_card(dst, host)
    elif dst.device.type == "spyre":
        if self.device.type != "cpu":
            raise RuntimeError(f"spyre: cannot copy from {self.device} to the card")
        with on_card(dst.device.index):
            to_card(dst, self)
    else:
        if dst.device.type != "cpu":
            raise RuntimeError(f"spyre: cannot copy from the card to {dst.device}")
        with on_card(self.device.index):
            host = to_host(self)
        dst.copy_(host)
    return dst


@aten("_copy_from_and_resize")
def copy_from_and_resize(self, dst):
    if dst.shape != self.shape:
        dst.resize_(self.shape)
    return copy_from(self, dst)
