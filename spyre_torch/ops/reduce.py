"""Reductions, scans and softmax: one launch of the row kernel along the reduced dim.

The reduced dims are moved last in the stride lists (no copy) and merged into one row when
their strides allow; otherwise the tensor is first copied row-major in that order. Full
reductions (argmax without a dim) read the tensor in row-major order, as torch's flat index
means.
"""

from __future__ import annotations

import torch

from spyre_torch import dtypes, memory
from spyre_torch.kernels import ROW_OPS
from spyre_torch.ops import aten
from spyre_torch.ops.copy import card_copy
from spyre_torch.ops.fallback import NoCardKernel
from spyre_torch.ops.launch import MAXD, launch, merge_dims, operand


def _dims(x: torch.Tensor, dim) -> list[int]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(x.dim()))
    dims = [dim] if isinstance(dim, int) else list(dim)
    n = max(x.dim(), 1)
    out = []
    for d in dims:
        if not -n <= d < n:
            raise IndexError(f"spyre: dimension out of range (expected to be in range of "
                             f"[{-n}, {n - 1}], but got {d})")
        out.append(d % n)
    return sorted(set(d for d in out if d < x.dim()))


def _row(sizes, strides) -> tuple[int, int] | None:
    """The reduced dims as one (length, stride), or None when they do not merge."""
    merged, st = merge_dims(sizes, [strides], MAXD)
    kept = [(s, t) for s, t in zip(merged, st[0], strict=True) if s != 1]
    if not kept:
        return 1, 0
    if len(kept) == 1:
        return kept[0]
    return None


def run_rows(name: str, op: str, x: torch.Tensor, dims: list[int], out: torch.Tensor,
             idx: torch.Tensor | None = None, flat: bool = False) -> None:
    """Launch op along `dims` of x. Reductions: out (and idx) have x's kept dims, row-major
    (keepdim or not); rows ops (softmax, cumsum): out has x's shape."""
    if dtypes.code(x.dtype) is None or dtypes.code(out.dtype) is None:
        raise NoCardKernel(f"dtype {x.dtype}")
    kept = [d for d in range(x.dim()) if d not in dims]
    same_shape = out.dim() == x.dim() and out.shape == x.shape and op in ("softmax", "log_softmax", "cumsum")
    row = None if flat and not _row_major(x) else _row([x.shape[d] for d in dims],
                                                        [x.stride(d) for d in dims])
    if row is None:  # copy row-major with the reduced dims last, then they merge
        perm = kept + dims
        xp = card_copy(memory.empty([x.shape[d] for d in perm], x.dtype), x.permute(perm))
        if same_shape:
            tmp = memory.empty(xp.shape, out.dtype)
            run_rows(name, op, xp, list(range(len(kept), x.dim())), tmp)
            card_copy(out, tmp.permute([perm.index(d) for d in range(x.dim())]))
            return
        run_rows(name, op, xp, list(range(len(kept), x.dim())), out, idx)
        return
    n, row_stride = row
    ksizes = [x.shape[d] for d in kept]
    xk = [x.stride(d) for d in kept]
    if same_shape:
        ok, o_row = [out.stride(d) for d in kept], out.stride(dims[0]) if dims else 0
    else:
        ok, o_row = list(memory.contiguous_strides(ksizes)), 0
    ik = list(memory.contiguous_strides(ksizes))
    sizes, (xs, os_, is_) = merge_dims(ksizes, [xk, ok, ik], MAXD - 1)
    b = {"op": ROW_OPS[op], "n": n}
    for i, s in enumerate(sizes):
        b[f"size{i}"] = s
    operand(b, "x", x, xs + [row_stride])
    operand(b, "out", out, os_ + [o_row])
    operand(b, "idx", idx, (is_ + [0]) if idx is not None else None)
    if x.numel() or out.numel():
        launch(name, "rows", b)


def _row_major(t: torch.Tensor) -> bool:
    from spyre_torch.ops.copy import row_major

    return row_major(t)


def _reduced_shape(x: torch.Tensor, dims: list[int], keepdim: bool) -> list[int]:
    if keepdim:
        return [1 if d in dims else s for d, s in enumerate(x.shape)]
    return [s for d, s in enumerate(x.shape) if d not in dims]


def reduce(name: str, op: str, x: torch.Tensor, dim, keepdim: bool, result: torch.dtype,
           with_indices: bool = False, flat: bool = False):
    dims = _dims(x, dim)
    if x.numel() == 0 and op in ("amax", "amin", "max", "min", "argmax", "argmin"):
        if any(x.shape[d] == 0 for d in dims) or x.dim() == 0:
            raise IndexError(f"spyre: {name}: cannot reduce an empty dimension without an identity")
    out = memory.empty(_reduced_shape(x, dims, keepdim), result)
    idx = memory.empty(out.shape, torch.int64) if with_indices else None
    if any(x.shape[d] == 0 for d in dims):  # an empty row: the op's identity
        identity = {"sum": 0, "mean": float("nan"), "prod": 1, "any": 0, "all": 1}[op]
        return out.fill_(identity)
    run_rows(name, op, x, dims, out, idx, flat=flat)
    return (out, idx) if with_indices else out


def _sum_dtype(x: torch.Tensor, dtype) -> torch.dtype:
    if dtype is not None:
        return dtype
    return x.dtype if x.dtype.is_floating_point or x.dtype.is_complex else torch.int64


def _cast(x: torch.Tensor, dtype) -> torch.Tensor:
    return x if dtype is None or x.dtype == dtype else x.to(dtype)


@aten("sum.dim_IntList")
def sum_dim(self, dim, keepdim=False, dtype=None):
    return reduce("aten::sum", "sum", _cast(self, dtype), dim, keepdim, _sum_dtype(self, dtype))


@aten("sum")
def sum_all(self, dtype=None):
    return reduce("aten::sum", "sum", _cast(self, dtype), None, False, _sum_dtype(self, dtype))


@aten("mean.dim")
def mean_dim(self, dim, keepdim=False, dtype=None):
    result = dtype or self.dtype
    if not result.is_floating_point:
        raise RuntimeError(f"spyre: mean(): could not infer output dtype. Input dtype must be "
                           f"either a floating point or complex dtype. Got: {result}")
    return reduce("aten::mean", "mean", _cast(self, dtype), dim, keepdim, result)


@aten("mean")
def mean_all(self, dtype=None):
    return mean_dim(self, None, False, dtype)


@aten("prod")
def prod_all(self, dtype=None):
    return reduce("aten::prod", "prod", _cast(self, dtype), None, False, _sum_dtype(self, dtype))


@aten("prod.dim_int")
def prod_dim(self, dim, keepdim=False, dtype=None):
    return reduce("aten::prod", "prod", _cast(self, dtype), dim, keepdim, _sum_dtype(self, dtype))


@aten("amax")
def amax(self, dim=(), keepdim=False):
    return reduce("aten::amax", "amax", self, dim, keepdim, self.dtype)


@aten("amin")
def amin(self, dim=(), keepdim=False):
    return reduce("aten::amin", "amin", self, dim, keepdim, self.dtype)


@aten("max")
def max_all(self):
    return reduce("aten::max", "amax", self, None, False, self.dtype)


@aten("min")
def min_all(self):
    return reduce("aten::min", "amin", self, None, False, self.dtype)


@aten("max.dim")
def max_dim(self, dim, keepdim=False):
    return reduce("aten::max.dim", "max", self, dim, keepdim, self.dtype, with_indices=True)


@aten("min.dim")
def min_dim(self, dim, keepdim=False):
    return reduce("aten::min.dim", "min", self, dim, keepdim, self.dtype, with_indices=True)


def _arg(name: str, op: str, x: torch.Tensor, dim, keepdim: bool) -> torch.Tensor:
    """argmax / argmin: without a dim, the index into x flattened row-major."""
    if dim is None:
        out = reduce(name, op, x, None, False, torch.int64, flat=True)
        return out.view([1] * x.dim()) if keepdim else out
    return reduce(name, op, x, dim, keepdim, torch.int64)


@aten("argmax")
def argmax(self, dim=None, keepdim=False):
    return _arg("aten::argmax", "argmax", self, dim, keepdim)


@aten("argmin")
def argmin(self, dim=None, keepdim=False):
    return _arg("aten::argmin", "argmin", self, dim, keepdim)


def _logic_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.uint8 if x.dtype == torch.uint8 else torch.bool


@aten("any")
def any_all(self):
    return reduce("aten::any", "any", self, None, False, _logic_dtype(self))


@aten("any.dim", "any.dims")
def any_dim(self, dim=None, keepdim=False):
    return reduce("aten::any", "any", self, dim, keepdim, _logic_dtype(self))


@aten("all")
def all_all(self):
    return reduce("aten::all", "all", self, None, False, _logic_dtype(self))


@aten("all.dim", "all.dims")
def all_dim(self, dim=None, keepdim=False):
    return reduce("aten::all", "all", self, dim, keepdim, _logic_dtype(self))


def along(name: str, op: str, x: torch.Tensor, dim: int, result: torch.dtype) -> torch.Tensor:
    dims = _dims(x, dim)
    out = memory.empty(x.shape, result)
    if x.dim() == 0:
        dims = []
    run_rows(name, op, x if x.dim() else x.view(1), dims or [0], out if x.dim() else out.view(1))
    return out


@aten("cumsum")
def cumsum(self, dim, dtype=None):
    return along("aten::cumsum", "cumsum", _cast(self, dtype), dim, _sum_dtype(self, dtype))


@aten("_softmax")
def softmax(self, dim, half_to_float=False):
    if not self.dtype.is_floating_point:
        raise RuntimeError(f"spyre: softmax needs a floating point tensor, got {self.dtype}")
    return along("aten::_softmax", "softmax", self, dim, self.dtype)


@aten("_log_softmax")
def log_softmax(self, dim, half_to_float=False):
    if not self.dtype.is_floating_point:
        raise RuntimeError(f"spyre: log_softmax needs a floating point tensor, got {self.dtype}")
    return along("aten::_log_softmax", "log_softmax", self, dim, self.dtype)
