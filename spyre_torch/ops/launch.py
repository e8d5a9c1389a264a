"""Launching a card kernel for a torch op: operand descriptors, broadcast, merged dims.

`launch(op, kernel, bindings)` launches the op's prepared program (runtime.program: one per
op and stream, compiled once per kernel family) on the current stream with its operands
patched in, and returns at once. The helpers build the bindings of the elementwise and row
kernels from torch tensors (spyre_torch/kernels/__init__.py lists their slots).
"""

from __future__ import annotations

import torch

from spyre_torch import dtypes
from spyre_torch.memory import address
from spyre_torch.ops.fallback import NoCardKernel
from spyre_torch.runtime import runtime

MAXD = 6  # spyre_torch.kernels.MAXD (not imported: that package imports Numba)


def launch(op: str, kernel: str, bindings: dict) -> None:
    rt = runtime()
    stream = rt.current_stream()
    rt.program(op, kernel, stream).launch(stream, bindings)


def broadcast_shape(*shapes) -> tuple[int, ...]:
    """torch's broadcasting of shapes (torch.broadcast_shapes takes ~100 us: this ~1 us)."""
    if len(shapes) == 1:
        return tuple(shapes[0])
    n = max(len(s) for s in shapes)
    out = [1] * n
    for s in shapes:
        off = n - len(s)
        for i, d in enumerate(s):
            o = out[off + i]
            if d != o:
                if o == 1:
                    out[off + i] = d
                elif d != 1:
                    raise RuntimeError(f"spyre: shapes {[list(x) for x in shapes]} cannot be "
                                       f"broadcast together (dim {off + i - n}: {o} and {d})")
    return tuple(out)


def broadcast_strides(t: torch.Tensor, shape) -> list[int]:
    """t's strides seen at `shape` (torch's broadcasting: 0 where t has size 1 or no dim)."""
    out = [0] * len(shape)
    offset = len(shape) - t.dim()
    for i, (size, stride) in enumerate(zip(t.shape, t.stride(), strict=True)):
        if size != 1:
            out[offset + i] = stride
    return out


def merge_dims(shape, strides: list[list[int]], limit: int) -> tuple[list[int], list[list[int]]]:
    """Drop size-1 dims and merge neighbours contiguous in every operand; pad to `limit` dims
    at the front. Raises NoCardKernel when more than `limit` dims remain."""
    sizes: list[int] = []
    merged: list[list[int]] = [[] for _ in strides]
    for d, size in enumerate(shape):
        if size == 1:
            continue
        if sizes and all(st[-1] == s[d] * size for st, s in zip(merged, strides, strict=True)):
            sizes[-1] *= size
            for st, s in zip(merged, strides, strict=True):
                st[-1] = s[d]
            continue
        sizes.append(size)
        for st, s in zip(merged, strides, strict=True):
            st.append(s[d])
    if len(sizes) > limit:
        raise NoCardKernel(f"{len(sizes)} dims that do not merge (the kernel walks {limit})")
    pad = limit - len(sizes)
    return [1] * pad + sizes, [[0] * pad + st for st in merged]


def operand(bindings: dict, name: str, x, strides=None) -> None:
    """Bind operand `name`: a spyre tensor (with `strides`), a number, or None."""
    if x is None:
        bindings[f"{name}_dt"] = dtypes.NONE
        return
    if isinstance(x, torch.Tensor):
        bindings[name] = address(x)
        bindings[f"{name}_dt"] = dtypes.OPERANDS[x.dtype]
        for key, s in zip(_STRIDE_KEYS[name], strides, strict=False):
            if s:  # the program binds every slot to 0 once: only the others are patched
                bindings[key] = s
        return
    if isinstance(x, float):
        bindings[f"{name}_dt"] = dtypes.SCALAR_F
        bindings[f"{name}_val"] = dtypes.float_bits(x)
    else:
        bindings[f"{name}_dt"] = dtypes.SCALAR_I
        bindings[f"{name}_val"] = int(x)


NAMES = ("a", "b", "c")
_STRIDE_KEYS = {n: [f"{n}_st{i}" for i in range(MAXD)] for n in ("out", "a", "b", "c", "x", "idx")}
_SIZE_KEYS = [f"size{i}" for i in range(MAXD)]
_ONE = dtypes.float_bits(1.0)


def elementwise(op_name: str, code: int, out: torch.Tensor, inputs, cdt: int,
                alpha: float = 1.0, beta: float = 0.0) -> torch.Tensor:
    """out = op(inputs...) over out's shape; inputs are spyre tensors broadcastable to it,
    numbers, or None. `cdt`: the computation dtype's code."""
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    strides = [list(out.stride())] + [broadcast_strides(t, out.shape) for t in tensors]
    sizes, merged = merge_dims(out.shape, strides, MAXD)
    b = {"op": code, "cdt": cdt, "alpha": _ONE if alpha == 1.0 else dtypes.float_bits(alpha)}
    if beta:
        b["beta"] = dtypes.float_bits(beta)
    for key, s in zip(_SIZE_KEYS, sizes, strict=True):
        b[key] = s
    operand(b, "out", out, merged[0])
    k = 1
    for name, x in zip(NAMES, inputs, strict=False):
        if isinstance(x, torch.Tensor):
            operand(b, name, x, merged[k])
            k += 1
        else:
            operand(b, name, x)
    for name in NAMES[len(inputs):]:
        b[f"{name}_dt"] = dtypes.NONE
    if out.numel():
        launch(op_name, "elementwise", b)
    return out
