"""Matrix products on the card's BLAS GEMM (float32): mm, bmm, addmm, baddbmm, mv, linear.

`linear` is taken whole (torch would decompose it into t + mm + view): the weight [N, K] is
read transposed in place, so `x @ w.T (+ b)` is one launch. Each matrix must be row-major or
column-major; any other layout (a slice with a wider row, an expanded batch of one...) is
copied row-major first.
"""

from __future__ import annotations

import torch

from spyre_torch import dtypes, memory
from spyre_torch.memory import address
from spyre_torch.ops import aten
from spyre_torch.ops.copy import card_copy, row_major
from spyre_torch.ops.fallback import NoCardKernel
from spyre_torch.ops.launch import broadcast_strides, launch


def _layout(rows: int, cols: int, rs: int, cs: int) -> tuple[int, int] | None:
    """(row stride, column stride) as the kernel wants them: (cols, 1) row-major,
    (1, rows) column-major; None for any other layout."""
    if (cols == 1 or cs == 1) and (rows == 1 or rs == cols):
        return cols, 1
    if (rows == 1 or rs == 1) and (cols == 1 or cs == rows):
        return 1, rows
    return None


def _matrix(t: torch.Tensor, rows: int, cols: int, rs: int, cs: int, bs: int = 0):
    """(tensor, batch stride, row stride, column stride), t copied row-major if need be."""
    layout = _layout(rows, cols, rs, cs)
    if layout is None:
        t = card_copy(memory.empty(t.shape, t.dtype), t)
        st = t.stride()
        return t, (st[0] if t.dim() == 3 else 0), cols, 1
    return t, bs, layout[0], layout[1]


def _check(name: str, *tensors) -> None:
    for t in tensors:
        if t is not None and t.dtype != torch.float32:
            raise NoCardKernel(f"dtype {t.dtype} (the card's GEMM is float32)")
        if t is not None and t.device.type != "spyre":
            raise RuntimeError(f"spyre: {name}: expected all tensors on the spyre device, "
                               f"got one on {t.device}")


def gemm(name: str, a, a_bs, a_rs, a_cs, b, b_bs, b_rs, b_cs, out, batch, m, n, k,
         bias=None, bias_strides=(0, 0, 0), alpha=1.0, beta=1.0) -> torch.Tensor:
    bindings = {
        "batch": batch, "m": m, "n": n, "k": k,
        "alpha": dtypes.float_bits(float(alpha)), "beta": dtypes.float_bits(float(beta)),
        "a": address(a), "b": address(b), "out": address(out),
        "a_bs": a_bs, "a_rs": a_rs, "a_cs": a_cs, "b_bs": b_bs, "b_rs": b_rs, "b_cs": b_cs,
        "bias_dt": dtypes.NONE,
    }
    if bias is not None and beta != 0:
        bindings.update(bias=address(bias), bias_dt=dtypes.F32, bias_bs=bias_strides[0],
                        bias_rs=bias_strides[1], bias_cs=bias_strides[2])
    if out.numel():
        launch(name, "matmul", bindings)
    return out


def mm2(name: str, a: torch.Tensor, b: torch.Tensor, bias=None, alpha=1.0, beta=1.0):
    """out[m, n] = alpha * a[m, k] @ b[k, n] + beta * bias (broadcast to [m, n])."""
    _check(name, a, b, bias)
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise RuntimeError(f"spyre: {name}: mat1 and mat2 shapes cannot be multiplied "
                           f"({a.shape[0]}x{a.shape[1]} and {b.shape[0]}x{b.shape[1]})")
    m, k = a.shape
    n = b.shape[1]
    a, _, a_rs, a_cs = _matrix(a, m, k, *a.stride())
    b, _, b_rs, b_cs = _matrix(b, k, n, *b.stride())
    out = memory.empty((m, n), torch.float32)
    bst = (0, *broadcast_strides(bias, (m, n))) if bias is not None else (0, 0, 0)
    return gemm(name, a, 0, a_rs, a_cs, b, 0, b_rs, b_cs, out, 1, m, n, k, bias, bst, alpha, beta)


def bmm3(name: str, a: torch.Tensor, b: torch.Tensor, bias=None, alpha=1.0, beta=1.0):
    _check(name, a, b, bias)
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise RuntimeError(f"spyre: {name}: batch1 and batch2 shapes cannot be multiplied "
                           f"({list(a.shape)} and {list(b.shape)})")
    batch, m, k = a.shape
    n = b.shape[2]
    a, a_bs, a_rs, a_cs = _matrix(a, m, k, a.stride(1), a.stride(2), a.stride(0))
    b, b_bs, b_rs, b_cs = _matrix(b, k, n, b.stride(1), b.stride(2), b.stride(0))
    out = memory.empty((batch, m, n), torch.float32)
    bst = tuple(broadcast_strides(bias, (batch, m, n))) if bias is not None else (0, 0, 0)
    return gemm(name, a, a_bs, a_rs, a_cs, b, b_bs, b_rs, b_cs, out, batch, m, n, k, bias, bst,
                alpha, beta)


@aten("mm")
def mm(self, mat2):
    return mm2("aten::mm", self, mat2)


@aten("bmm")
def bmm(self, mat2):
    return bmm3("aten::bmm", self, mat2)


@aten("addmm")
def addmm(self, mat1, mat2, beta=1, alpha=1):
    return mm2("aten::addmm", mat1, mat2, self, alpha, beta)


@aten("baddbmm")
def baddbmm(self, batch1, batch2, beta=1, alpha=1):
    return bmm3("aten::baddbmm", batch1, batch2, self, alpha, beta)


@aten("mv")
def mv(self, vec):
    return mm2("aten::mv", self, vec.view(-1, 1)).view(-1)


@aten("linear")
def linear(input, weight, bias=None):  # noqa: A002 - torch's argument name
    """input [..., K] @ weight[N, K].T + bias[N]: one launch."""
    _check("aten::linear", input, weight, bias)
    if input.dim() == 0 or weight.dim() != 2 or input.shape[-1] != weight.shape[1]:
        raise RuntimeError(f"spyre: linear: mat1 and mat2 shapes cannot be multiplied "
                           f"(input {list(input.shape)}, weight {list(weight.shape)})")
    k = input.shape[-1]
    n = weight.shape[0]
    lead = tuple(input.shape[:-1])
    if input.dim() == 2:
        x = input
    elif row_major(input):
        x = input.view(-1, k) if input.dim() != 1 else input.view(1, k)
    else:
        x = card_copy(memory.empty(input.shape, input.dtype), input).view(-1, k)
    out = mm2("aten::linear", x, weight.t(), bias)
    return out.view(*lead, n)


@aten("linear_backward")
def linear_backward(input, grad_output, weight, output_mask):  # noqa: A002
    """The gradients of `linear` (torch's autograd asks for them because linear is taken
    whole): grad_input = g @ w, grad_weight = g.T @ x, grad_bias = g summed over rows."""
    n, k = weight.shape
    g = grad_output.reshape(-1, n)
    x = input.reshape(-1, k)
    grad_input = (g @ weight).view(input.shape) if output_mask[0] else None
    grad_weight = g.t() @ x if output_mask[1] else None
    grad_bias = g.sum(0) if output_mask[2] else None
    return grad_input, grad_weight, grad_bias
