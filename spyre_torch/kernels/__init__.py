"""The card kernels behind torch's "spyre" ops: one program entry per kernel family.

Every entry has the card's program ABI, `entry(f32, i32, i64, u16, table)` (device/abi.py):
the arena seen as four dtypes, and the int64 operand table the launch patches. The slots of
each entry are declared here (`SPECS`: name -> slot list); the host side
(spyre_torch/ops/) binds them by name, so this package is imported only when the first
program is prepared (they import Numba and `device`; `import torch` never does). This file
imports neither: the host side reads its slot lists and op codes.

| entry | module | ops |
| --- | --- | --- |
| `elementwise` | elementwise.py | copies and casts, fill, arange, unary, binary, where, over strided operands |
| `rows` | rows.py | reductions along one dim (sum, mean, amax, argmax, any, ...), cumsum, softmax |
| `matmul` | matmul.py | batched strided GEMM through BLAS (mm, bmm, addmm, linear, matmul) |
| `attention` | attention.py | scaled dot-product attention (masks, causal, GQA) |
| `gather` | gather.py | rows gathered by index (embedding, index_select, index) |

Numba's on-disk cache for these lives under a key of the sources of `device/` and of this
folder (device/cache.py, set by `_keyed.py`, which every kernel module imports first): a
change to either compiles afresh.
"""

import importlib

MAXD = 6  # dims of a strided operand after coalescing (elementwise); rows: 5 outer + the row


# op codes (the host passes them in the "op" slot; the kernels branch on them)
NULLARY = ("fill", "arange")
UNARY = ("copy", "neg", "exp", "log", "sqrt", "rsqrt", "sin", "cos", "tan", "tanh", "sigmoid",
         "silu", "relu", "abs", "reciprocal", "gelu", "gelu_tanh", "erf", "floor", "ceil",
         "trunc", "round", "sign", "log1p", "expm1", "log2", "isnan", "isinf", "isfinite",
         "logical_not", "bitwise_not")
# (eq .. logical_xor are consecutive: the kernel tests them as a range)
BINARY = ("add", "sub", "mul", "div", "div_trunc", "div_floor", "remainder", "fmod", "pow",
          "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or",
          "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor", "atan2")
TERNARY = ("where",)
EW_OPS = {name: i for i, name in enumerate(NULLARY + UNARY + BINARY + TERNARY)}
ROW_OPS = {name: i for i, name in enumerate(
    ("sum", "mean", "prod", "amax", "amin", "argmax", "argmin", "max", "min", "any", "all",
     "cumsum", "softmax", "log_softmax"))}


def _operand(name: str, ndim: int = MAXD) -> list[tuple[str, str]]:
    """An operand's slots: its address, dtype code, value (a number operand), strides."""
    return ([(name, "address"), (f"{name}_dt", "dim"), (f"{name}_val", "dim")]
            + [(f"{name}_st{i}", "dim") for i in range(ndim)])


def _dims(*names: str) -> list[tuple[str, str]]:
    return [(n, "dim") for n in names]


ELEMENTWISE = (_dims("op", "cdt", "alpha", "beta") + _dims(*(f"size{i}" for i in range(MAXD)))
               + _operand("out") + _operand("a") + _operand("b") + _operand("c"))
ROWS = (_dims("op", "n") + _dims(*(f"size{i}" for i in range(MAXD - 1)))
        + _operand("x") + _operand("out") + _operand("idx"))
MATMUL = (_dims("batch", "m", "n", "k", "alpha", "beta")
          + [("a", "address"), ("b", "address"), ("out", "address"), ("bias", "address")]
          + _dims("a_bs", "a_rs", "a_cs", "b_bs", "b_rs", "b_cs", "bias_dt", "bias_bs",
                  "bias_rs", "bias_cs"))
ATTENTION = (_dims("batch", "hq", "hkv", "l", "s", "d", "dv", "causal", "scale", "mask_dt")
             + [("q", "address"), ("k", "address"), ("v", "address"), ("out", "address"),
                ("mask", "address")]
             + _dims("q_bs", "q_hs", "q_ls", "k_bs", "k_hs", "k_ss", "v_bs", "v_hs", "v_ss",
                     "m_bs", "m_hs", "m_ls", "m_ss"))
GATHER = (_dims("outer", "j", "inner", "dim_size", "wrap", "x_dt", "x_os", "x_ds", "x_is",
                "idx_dt", "idx_st")
          + [("x", "address"), ("idx", "address"), ("out", "address")])

SPECS = {
    "elementwise": ("spyre_torch.kernels.elementwise", ELEMENTWISE),
    "rows": ("spyre_torch.kernels.rows", ROWS),
    "matmul": ("spyre_torch.kernels.matmul", MATMUL),
    "attention": ("spyre_torch.kernels.attention", ATTENTION),
    "gather": ("spyre_torch.kernels.gather", GATHER),
}


def index(slots) -> dict[str, int]:
    """slot name -> table index (the kernels read their operands at these)."""
    return {name: i for i, (name, _) in enumerate(slots)}


ENTRIES = {"elementwise": "elementwise", "rows": "rows", "matmul": "matmul",
           "attention": "attention", "gather": "gather"}  # name -> module (and its entry)


def program(card, op: str, name: str, stream):
    """A prepared program of torch op `op` on entry `name`, for `stream`, every slot bound to 0
    (a launch binds only the slots it uses). The entry compiles once (the first op using it);
    every later op's program only places its operand table."""
    from spyre_serve.device import Program, Slot

    _, slots = SPECS[name]
    entry = getattr(importlib.import_module(f"spyre_torch.kernels.{ENTRIES[name]}"), name)
    prog = Program(card, f"{op} [{name}]", entry, [Slot(n, k) for n, k in slots],
                   shapes={"entry": name, "stream": stream.name})
    prog.prepare()
    prog.bind({n: 0 for n, _ in slots})
    return prog
