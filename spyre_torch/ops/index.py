"""Indexing and joining: index_select, index (one integer index tensor), cat, isin.

`index` with one integer index tensor (the rest full slices: `x[:, ids]`, `x[ids]`) is one
gather; boolean masks and several index tensors (shapes depend on the data, or broadcast
together) fall back to the CPU.
"""

from __future__ import annotations

import torch

from spyre_torch import dtypes, memory
from spyre_torch.ops import aten
from spyre_torch.ops.copy import card_copy
from spyre_torch.ops.elementwise import binary, unary
from spyre_torch.ops.fallback import NoCardKernel
from spyre_torch.ops.launch import merge_dims
from spyre_torch.ops.nn import gather
from spyre_torch.ops.reduce import reduce


def _around(x: torch.Tensor, dim: int) -> tuple[int, int, int, int, int] | None:
    """x as [outer, x.shape[dim], inner]: (outer, inner, outer stride, dim stride, inner
    stride), or None when the dims before or after `dim` do not merge."""
    def one(shape, strides):
        sizes, (st,) = merge_dims(shape, [list(strides)], 6)
        kept = [(s, t) for s, t in zip(sizes, st, strict=True) if s != 1]
        if not kept:
            return 1, 0
        return kept[0] if len(kept) == 1 else None
    before = one(x.shape[:dim], x.stride()[:dim])
    after = one(x.shape[dim + 1:], x.stride()[dim + 1:])
    if before is None or after is None:
        return None
    return before[0], after[0], before[1], x.stride(dim), after[1]


def select_rows(name: str, x: torch.Tensor, dim: int, idx: torch.Tensor, wrap: bool) -> torch.Tensor:
    """x gathered along `dim` at idx: shape x.shape[:dim] + idx.shape + x.shape[dim+1:]."""
    if dtypes.code(x.dtype) is None:
        raise NoCardKernel(f"dtype {x.dtype}")
    parts = _around(x, dim)
    if parts is None:
        x = card_copy(memory.empty(x.shape, x.dtype), x)
        parts = _around(x, dim)
    outer, inner, os_, ds, is_ = parts
    out = memory.empty((*x.shape[:dim], *idx.shape, *x.shape[dim + 1:]), x.dtype)
    return gather(name, x, idx, outer, x.shape[dim], inner, (os_, ds, is_), out, wrap)


@aten("index_select")
def index_select(self, dim, index):
    if index.dim() > 1:
        raise RuntimeError("spyre: index_select(): Index is supposed to be a vector")
    x = self if self.dim() else self.view(1)
    return select_rows("aten::index_select", x, dim % x.dim(), index.view(-1), wrap=False)


@aten("index.Tensor")
def index(self, indices):
    given = [(i, t) for i, t in enumerate(indices) if t is not None]
    if len(given) != 1:
        raise NoCardKernel("several index tensors")
    dim, idx = given[0]
    if idx.dtype not in (torch.int64, torch.int32):
        raise NoCardKernel(f"an index of dtype {idx.dtype}")
    return select_rows("aten::index", self, dim, idx, wrap=True)


@aten("cat")
def cat(tensors, dim=0):
    # torch skips 1-D empty tensors of size (0,) (legacy behaviour)
    parts = [t for t in tensors if not (t.dim() == 1 and t.shape[0] == 0)]
    if not parts:
        return memory.empty((0,), torch.result_type(*tensors) if len(tensors) > 1 else tensors[0].dtype)
    ref = parts[0]
    d = dim % ref.dim()
    result = ref.dtype
    for t in parts[1:]:
        result = torch.promote_types(result, t.dtype)
        if t.dim() != ref.dim() or any(t.shape[i] != ref.shape[i] for i in range(ref.dim()) if i != d):
            raise RuntimeError(f"spyre: cat: sizes of tensors must match except in dimension {d}; "
                               f"got {list(ref.shape)} and {list(t.shape)}")
    shape = list(ref.shape)
    shape[d] = sum(t.shape[d] for t in parts)
    out = memory.empty(shape, result)
    offset = 0
    for t in parts:
        if t.device.type != "spyre":
            raise RuntimeError(f"spyre: cat: expected all tensors on the spyre device, got {t.device}")
        n = t.shape[d]
        if n:
            card_copy(out.narrow(d, offset, n), t)
        offset += n
    return out


@aten("isin.Tensor_Tensor")
def isin(elements, test_elements, *, assume_unique=False, invert=False):
    """any(elements[..., None] == test_elements.flatten(), -1): two launches."""
    test = test_elements.reshape(-1)
    if test.device.type != "spyre":
        test = test.to("spyre")
    hit = reduce("aten::isin", "any", binary("aten::isin", "eq", elements.unsqueeze(-1), test),
                 -1, False, torch.bool)
    return unary("aten::isin", "logical_not", hit) if invert else hit
