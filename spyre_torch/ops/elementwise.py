"""Elementwise ops: math, comparisons, logical and bitwise ops, where, masked_fill, clamp.

Result dtypes follow torch's type promotion (`torch.result_type` on the same arguments);
operands broadcast; a number or a 0-dim CPU tensor is an operand of its own (no copy to the
card). In-place forms write through the tensor's own strides; a second operand sharing its
storage with another layout is copied aside first, so no element is read after it is
written. One launch of the elementwise kernel each (clamp with both bounds: two).
"""

from __future__ import annotations

import torch

from spyre_torch import dtypes, memory
from spyre_torch.kernels import EW_OPS
from spyre_torch.ops import aten
from spyre_torch.ops.fallback import NoCardKernel
from spyre_torch.ops.launch import broadcast_shape, elementwise

COMPARE = ("eq", "ne", "lt", "le", "gt", "ge")
LOGICAL = ("logical_and", "logical_or", "logical_xor")
BITWISE = ("bitwise_and", "bitwise_or", "bitwise_xor")


def _operand(x, name: str):
    """A spyre tensor stays; a number or a 0-dim CPU tensor becomes a Python number."""
    if isinstance(x, torch.Tensor):
        if x.device.type == "spyre":
            if dtypes.code(x.dtype) is None:
                raise NoCardKernel(f"dtype {x.dtype}")
            return x
        if x.dim() == 0:
            return x.item()
        raise RuntimeError(f"spyre: {name} got a tensor on {x.device} of shape {tuple(x.shape)} "
                           f"beside a spyre tensor: expected all tensors on the same device")
    return x


def _number(x, cdt: int):
    if isinstance(x, torch.Tensor) or x is None:
        return x
    if cdt in dtypes.FLOATS:
        return float(x)
    return int(x)


def _out_shape(operands) -> tuple[int, ...]:
    return broadcast_shape(*[t.shape for t in operands if isinstance(t, torch.Tensor)])


def _aside(out: torch.Tensor, x):
    """x, copied when it shares out's storage in another layout (in-place ops)."""
    if not isinstance(x, torch.Tensor) or x is out:
        return x
    if x.untyped_storage().data_ptr() != out.untyped_storage().data_ptr():
        return x
    if (x.shape == out.shape and x.stride() == out.stride()
            and x.storage_offset() == out.storage_offset()):
        return x
    from spyre_torch.ops.copy import card_copy

    return card_copy(memory.empty(x.shape, x.dtype), x)


def _check_inplace(name: str, out: torch.Tensor, shape, result: torch.dtype) -> None:
    if tuple(out.shape) != tuple(shape):
        raise RuntimeError(f"spyre: {name}: output with shape {list(out.shape)} doesn't match "
                           f"the broadcast shape {list(shape)}")
    if not torch.can_cast(result, out.dtype):
        raise RuntimeError(f"spyre: {name}: result type {result} can't be cast to the desired "
                           f"output type {out.dtype}")


def binary(name: str, op: str, a, b, alpha=1, out: torch.Tensor | None = None,
           swap: bool = False) -> torch.Tensor:
    """out = op(a, b) (`swap`: op(b, a)) with torch's promotion; out=None: a new tensor."""
    common = torch.result_type(a, b)
    x, y = _operand(a, name), _operand(b, name)
    if swap:
        x, y = y, x
    if op in COMPARE or op in LOGICAL:
        result = torch.bool
    elif op == "div" and not common.is_floating_point:
        common = result = torch.get_default_dtype()
    else:
        result = common
    if op in BITWISE and common.is_floating_point:
        raise RuntimeError(f"spyre: {name}: bitwise ops need integer or bool tensors, got {common}")
    cdt = dtypes.code(common)
    if cdt is None or dtypes.code(result) is None:
        raise NoCardKernel(f"dtype {common}")
    if cdt == dtypes.BOOL or cdt == dtypes.U8 or cdt == dtypes.I32:
        cdt = dtypes.I64
    shape = _out_shape([x, y])
    if out is None:
        out = memory.empty(shape, result)
    else:
        _check_inplace(name, out, shape, result)
        x, y = _aside(out, x), _aside(out, y)
    alpha = _number(alpha, cdt) if op in ("add", "sub") else 1
    return elementwise(name, EW_OPS[op], out, [_number(x, cdt), _number(y, cdt)], cdt,
                       alpha=float(alpha))


FLOAT_RESULT = ("exp", "log", "sqrt", "rsqrt", "sin", "cos", "tan", "tanh", "sigmoid", "silu",
                "reciprocal", "gelu", "gelu_tanh", "erf", "log1p", "expm1", "log2")
BOOL_RESULT = ("isnan", "isinf", "isfinite", "logical_not")


def unary(name: str, op: str, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    x = _operand(x, name)
    if op in FLOAT_RESULT and not x.dtype.is_floating_point:
        result = torch.get_default_dtype()
    elif op in BOOL_RESULT:
        result = torch.bool
    else:
        result = x.dtype
    if op == "bitwise_not" and x.dtype == torch.bool:
        op = "logical_not"
    if op == "bitwise_not" and x.dtype.is_floating_point:
        raise RuntimeError(f"spyre: {name}: bitwise_not needs an integer or bool tensor")
    compute = result if op not in BOOL_RESULT else x.dtype
    cdt = dtypes.code(compute)
    if cdt is None or dtypes.code(result) is None:
        raise NoCardKernel(f"dtype {compute}")
    if cdt in (dtypes.BOOL, dtypes.U8, dtypes.I32):
        cdt = dtypes.I64
    if out is None:
        out = memory.empty(x.shape, result)
    else:
        _check_inplace(name, out, x.shape, result)
    return elementwise(name, EW_OPS[op], out, [x], cdt)


def where(name: str, cond: torch.Tensor, a, b, out: torch.Tensor | None = None,
          result: torch.dtype | None = None) -> torch.Tensor:
    result = result or torch.result_type(a, b)
    c, x, y = _operand(cond, name), _operand(a, name), _operand(b, name)
    cdt = dtypes.code(result)
    if cdt is None:
        raise NoCardKernel(f"dtype {result}")
    if cdt in (dtypes.BOOL, dtypes.U8, dtypes.I32):
        cdt = dtypes.I64
    shape = _out_shape([c, x, y])
    if out is None:
        out = memory.empty(shape, result)
    else:
        _check_inplace(name, out, shape, result)
        c, x, y = _aside(out, c), _aside(out, x), _aside(out, y)
    if not isinstance(c, torch.Tensor):
        raise NoCardKernel("a number as the condition")
    return elementwise(name, EW_OPS["where"], out, [c, _number(x, cdt), _number(y, cdt)], cdt)


# ---- registrations ---------------------------------------------------------------------------

def _binary_ops(op: str, base: str, inplace: bool = True, scalar: bool = True):
    names = [f"{base}.Tensor"] + ([f"{base}.Scalar"] if scalar else [])

    @aten(*names)
    def functional(self, other, alpha=1):
        return binary(f"aten::{base}", op, self, other, alpha)

    if inplace:
        @aten(*[f"{base}_.{n.split('.')[1]}" for n in names])
        def in_place(self, other, alpha=1):
            return binary(f"aten::{base}_", op, self, other, alpha, out=self)


for _op in ("add", "sub", "mul", "div", "remainder", "fmod") + COMPARE:
    _binary_ops(_op, _op)
for _op in LOGICAL:
    aten(_op)(lambda self, other, _op=_op: binary(f"aten::{_op}", _op, self, other))
    aten(f"{_op}_")(lambda self, other, _op=_op: binary(f"aten::{_op}_", _op, self, other, out=self))
for _op in BITWISE:
    _binary_ops(_op, _op)


@aten("rsub.Tensor", "rsub.Scalar")
def rsub(self, other, alpha=1):
    """other - alpha * self."""
    if alpha != 1:
        self = binary("aten::rsub", "mul", self, alpha)
    return binary("aten::rsub", "sub", self, other, swap=True)


@aten("div.Tensor_mode", "div.Scalar_mode")
def div_mode(self, other, *, rounding_mode=None):
    op = {None: "div", "trunc": "div_trunc", "floor": "div_floor"}[rounding_mode]
    return binary("aten::div", op, self, other)


@aten("div_.Tensor_mode", "div_.Scalar_mode")
def div_mode_(self, other, *, rounding_mode=None):
    op = {None: "div", "trunc": "div_trunc", "floor": "div_floor"}[rounding_mode]
    return binary("aten::div_", op, self, other, out=self)


@aten("floor_divide", "floor_divide.Scalar")
def floor_divide(self, other):
    return binary("aten::floor_divide", "div_floor", self, other)


@aten("pow.Tensor_Scalar", "pow.Tensor_Tensor")
def pow_(self, exponent):
    return binary("aten::pow", "pow", self, exponent)


@aten("pow.Scalar")
def pow_scalar(self, exponent):
    return binary("aten::pow", "pow", self, exponent)


@aten("pow_.Scalar", "pow_.Tensor")
def pow_inplace(self, exponent):
    return binary("aten::pow_", "pow", self, exponent, out=self)


@aten("maximum")
def maximum(self, other):
    return binary("aten::maximum", "maximum", self, other)


@aten("minimum")
def minimum(self, other):
    return binary("aten::minimum", "minimum", self, other)


@aten("atan2")
def atan2(self, other):
    return binary("aten::atan2", "atan2", self, other)


def _unary_ops(op: str, base: str, inplace: bool = True):
    aten(base)(lambda self, _op=op, _b=base: unary(f"aten::{_b}", _op, self))
    if inplace:
        aten(f"{base}_")(lambda self, _op=op, _b=base: unary(f"aten::{_b}_", _op, self, out=self))


for _op in ("neg", "exp", "log", "sqrt", "rsqrt", "sin", "cos", "tan", "tanh", "sigmoid", "silu",
            "relu", "abs", "reciprocal", "erf", "floor", "ceil", "trunc", "round", "sign", "log1p",
            "expm1", "log2", "logical_not", "bitwise_not"):
    _unary_ops(_op, _op)
_unary_ops("isnan", "isnan", inplace=False)


@aten("gelu")
def gelu(self, approximate="none"):
    return unary("aten::gelu", "gelu_tanh" if approximate == "tanh" else "gelu", self)


@aten("gelu_")
def gelu_(self, approximate="none"):
    return unary("aten::gelu_", "gelu_tanh" if approximate == "tanh" else "gelu", self, out=self)


@aten("where.self")
def where_self(condition, self, other):
    return where("aten::where", condition, self, other)


@aten("masked_fill.Scalar", "masked_fill.Tensor")
def masked_fill(self, mask, value):
    if mask.dtype != torch.bool:
        raise RuntimeError(f"spyre: masked_fill only supports boolean masks, got {mask.dtype}")
    out = memory.empty(broadcast_shape(self.shape, mask.shape), self.dtype)
    return where("aten::masked_fill", mask, _fill_value(value, self), self, out=out,
                 result=self.dtype)


@aten("masked_fill_.Scalar", "masked_fill_.Tensor")
def masked_fill_(self, mask, value):
    if mask.dtype != torch.bool:
        raise RuntimeError(f"spyre: masked_fill_ only supports boolean masks, got {mask.dtype}")
    return where("aten::masked_fill_", mask, _fill_value(value, self), self, out=self,
                 result=self.dtype)


def _fill_value(value, like: torch.Tensor):
    """masked_fill's value takes the tensor's dtype (not a promotion)."""
    if isinstance(value, torch.Tensor):
        value = value.item()
    if like.dtype == torch.bool:
        return bool(value)
    return float(value) if like.dtype.is_floating_point else int(value)


def clamp(name: str, x, lo, hi, out=None):
    if lo is not None and hi is not None:
        y = binary(name, "maximum", x, lo)
        return binary(name, "minimum", y, hi, out=out) if out is not None else binary(name, "minimum", y, hi)
    if lo is not None:
        return binary(name, "maximum", x, lo, out=out)
    if hi is not None:
        return binary(name, "minimum", x, hi, out=out)
    raise RuntimeError("spyre: clamp: at least one of 'min' or 'max' must not be None")


@aten("clamp", "clamp.Tensor")
def clamp_(self, min=None, max=None):  # noqa: A002 - torch's argument names
    return clamp("aten::clamp", self, min, max)


@aten("clamp_", "clamp_.Tensor")
def clamp_inplace(self, min=None, max=None):  # noqa: A002
    return clamp("aten::clamp_", self, min, max, out=self)


@aten("clamp_min", "clamp_min.Tensor")
def clamp_min(self, min):  # noqa: A002
    return binary("aten::clamp_min", "maximum", self, min)


@aten("clamp_max", "clamp_max.Tensor")
def clamp_max(self, max):  # noqa: A002
    return binary("aten::clamp_max", "minimum", self, max)
