"""aten ops on "spyre" against the same torch op on the CPU, for each dtype the card computes
(float32, float64, int64, int32, bool), with the CPU fallback off (`on_card`): each runs on the
card. Integers and bools must match exactly; floats within a few float32 ulps (transcendental
functions are computed in float64 and rounded, torch's CPU uses its own vectorized ones)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._pytree import tree_map

FLOATS = [torch.float32, torch.float64]
INTS = [torch.int64, torch.int32]
ALL = FLOATS + INTS

pytestmark = pytest.mark.usefixtures("on_card")


def _spyre(x):
    return x.to("spyre") if isinstance(x, torch.Tensor) and x.dim() else x


def check(fn, *args, rtol=2e-6, atol=1e-6, **kwargs):
    """fn(*args) on the card equals fn(*args) on the CPU (0-dim tensors stay on the CPU:
    they are numbers to torch)."""
    expected = fn(*args, **kwargs)
    got = fn(*tree_map(_spyre, args), **tree_map(_spyre, kwargs))

    def cmp(e, g):
        if not isinstance(e, torch.Tensor):
            assert e == g
            return
        assert g.device.type == "spyre", "the result left the card"
        g = g.cpu()
        assert g.dtype == e.dtype and g.shape == e.shape, (g.dtype, e.dtype, g.shape, e.shape)
        if e.dtype.is_floating_point:
            torch.testing.assert_close(g, e, rtol=rtol, atol=atol, equal_nan=True)
        else:
            assert torch.equal(g, e), (g, e)
    if isinstance(expected, (tuple, list)):
        for e, g in zip(expected, got, strict=True):
            cmp(e, g)
    else:
        cmp(expected, got)


def values(shape, dtype, seed=0, low=-5, high=6):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.rand(shape, generator=g, dtype=torch.float64) * (high - low) + low).to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    return torch.randint(low, high, shape, generator=g, dtype=dtype)


# ---- elementwise -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ALL, ids=str)
@pytest.mark.parametrize("op", ["add", "sub", "mul", "maximum", "minimum"])
def test_binary_arithmetic_with_broadcast(op, dtype):
    fn = getattr(torch, op)
    check(fn, values((3, 4), dtype), values((4,), dtype, 1))
    check(fn, values((3, 1), dtype), values((1, 4), dtype, 2))


@pytest.mark.parametrize("dtype", ALL, ids=str)
def test_add_with_alpha_numbers_and_0_dim_tensors(dtype):
    a, b = values((2, 5), dtype), values((2, 5), dtype, 1)
    check(lambda x, y: torch.add(x, y, alpha=3), a, b)
    check(lambda x, y: x - 2 * y, a, b)
    check(lambda x: x * 0.22 + 1, a)                    # an int tensor times a float: float32
    check(lambda x, y: x + y, a, torch.tensor(7))        # a 0-dim CPU tensor is a number
    check(lambda x: 1 - x, a)                            # rsub


@pytest.mark.parametrize("dtype", ALL, ids=str)
def test_division_in_every_rounding_mode(dtype):
    a = values((4, 6), dtype)
    b = values((4, 6), dtype, 1, low=1, high=5) * (1 - 2 * (values((4, 6), torch.int64, 2, 0, 2)).to(dtype))
    check(torch.div, a, b)                               # true division: ints give float32
    check(lambda x, y: torch.div(x, y, rounding_mode="trunc"), a, b)
    check(lambda x, y: torch.div(x, y, rounding_mode="floor"), a, b)
    check(torch.remainder, a, b)
    check(torch.fmod, a, b)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_pow(dtype):
    a = values((3, 3), dtype, low=0, high=3)
    check(lambda x: x.pow(2), a)
    check(lambda x: x ** 0.5, a)
    check(torch.pow, a, values((3, 3), dtype, 1, low=-2, high=2))


@pytest.mark.parametrize("dtype", ALL + [torch.bool], ids=str)
@pytest.mark.parametrize("op", ["eq", "ne", "lt", "le", "gt", "ge"])
def test_comparisons_give_bools(op, dtype):
    a, b = values((5, 4), dtype, low=-2, high=2), values((4,), dtype, 1, low=-2, high=2)
    check(getattr(torch, op), a, b)
    if dtype != torch.bool:
        check(lambda x: getattr(torch, op)(x, 1), a)


@pytest.mark.parametrize("dtype", INTS + [torch.bool], ids=str)
@pytest.mark.parametrize("op", ["logical_and", "logical_or", "logical_xor", "bitwise_and",
                                "bitwise_or", "bitwise_xor"])
def test_logical_and_bitwise(op, dtype):
    check(getattr(torch, op), values((3, 4), dtype), values((3, 4), dtype, 1))


FLOAT_UNARY = ["neg", "exp", "sin", "cos", "tanh", "sigmoid", "abs", "reciprocal", "erf",
               "floor", "ceil", "trunc", "round", "sign", "expm1", "relu"]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("op", FLOAT_UNARY)
def test_unary_float(op, dtype):
    fn = getattr(torch, op)
    check(fn, values((4, 5), dtype))


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("op", ["log", "sqrt", "rsqrt", "log1p", "log2"])
def test_unary_float_on_positives(op, dtype):
    check(getattr(torch, op), values((4, 5), dtype, low=0.1, high=4))


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_activations(dtype):
    x = values((4, 7), dtype)
    check(torch.nn.functional.silu, x)
    check(torch.nn.functional.gelu, x)
    check(lambda t: torch.nn.functional.gelu(t, approximate="tanh"), x)


@pytest.mark.parametrize("dtype", INTS, ids=str)
def test_unary_integers(dtype):
    x = values((3, 4), dtype)
    for fn in (torch.neg, torch.abs, torch.sign, torch.bitwise_not):
        check(fn, x)
    check(torch.exp, x)                                  # ints to float32, as torch does


def test_unary_bools_and_nan_checks():
    check(torch.logical_not, values((7,), torch.bool))
    check(torch.bitwise_not, values((7,), torch.bool))
    x = torch.tensor([1.0, math.nan, -math.inf, 0.0])
    check(torch.isnan, x)
    check(torch.isfinite, x)
    check(torch.isinf, x)


@pytest.mark.parametrize("dtype", ALL, ids=str)
def test_where_masked_fill_and_clamp(dtype):
    cond = values((4, 5), torch.bool)
    a, b = values((4, 5), dtype), values((5,), dtype, 1)
    check(torch.where, cond, a, b)
    check(lambda m, x: x.masked_fill(m, 3), cond, a)
    check(lambda x: torch.clamp(x, -2, 3), a)
    check(lambda x: torch.clamp(x, min=0), a)


@pytest.mark.parametrize("dtype", ALL, ids=str)
def test_in_place_ops_through_views_write_the_base(dtype):
    def fn(x, y):
        x = x.clone()
        x[:, 1::2].add_(y[:, :2])
        x.t()[0].mul_(3)
        x.masked_fill_(x > 2, 0)
        return x
    check(fn, values((4, 4), dtype), values((4, 4), dtype, 1))


def test_in_place_with_an_overlapping_operand_reads_it_first():
    # the CPU refuses a partial overlap; the card copies the operand aside, as a clone would
    x = torch.arange(10.0).to("spyre")
    x[1:].add_(x[:-1])
    expected = torch.arange(10.0)
    expected[1:] += torch.arange(9.0)
    assert torch.equal(x.cpu(), expected)


def test_casts_between_dtypes():
    x = torch.tensor([-2.7, -0.5, 0.0, 0.4, 3.9, 1e10])
    for dtype in (torch.int64, torch.int32, torch.bool, torch.float64, torch.uint8):
        check(lambda t, d=dtype: t.to(d), x[:5] if dtype == torch.uint8 else x)
    check(lambda t: t.to(torch.float32), torch.tensor([1, -3, 2**40]))


# ---- factories and views ---------------------------------------------------------------------

def test_factories():
    on = torch.device("spyre")
    assert torch.equal(torch.arange(2, 20, 3, device=on).cpu(), torch.arange(2, 20, 3))
    assert torch.equal(torch.arange(0.5, 3.0, 0.25, device=on).cpu(), torch.arange(0.5, 3.0, 0.25))
    assert torch.equal(torch.full((2, 3), 7, device=on).cpu(), torch.full((2, 3), 7))
    assert torch.equal(torch.zeros(3, 2, dtype=torch.bool, device=on).cpu(), torch.zeros(3, 2, dtype=torch.bool))
    assert torch.equal(torch.ones_like(torch.empty(4, device=on)).cpu(), torch.ones(4))
    assert torch.equal(torch.tensor([[1, 2], [3, 4]], device=on).cpu(), torch.tensor([[1, 2], [3, 4]]))


def test_views_and_reshapes():
    x = values((2, 3, 4), torch.float32)
    check(lambda t: t.transpose(0, 2).contiguous(), x)
    check(lambda t: t.permute(1, 2, 0).reshape(12, 2), x)
    check(lambda t: t[:, None, 1:, ::2].expand(2, 3, 2, 2).contiguous(), x)
    check(lambda t: t.unsqueeze(1).squeeze(1).flatten(), x)
    check(lambda t: t.narrow(2, 1, 2).unfold(2, 1, 1).contiguous(), x)
    y = x.to("spyre")
    assert y.view(6, 4).untyped_storage().data_ptr() == y.untyped_storage().data_ptr()


# ---- reductions ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ALL + [torch.bool], ids=str)
def test_sum_prod_any_all(dtype):
    x = values((3, 4, 5), dtype, low=-2, high=3)
    check(lambda t: t.sum(), x)
    check(lambda t: t.sum(dim=(0, 2), keepdim=True), x)
    check(lambda t: t.sum(-1), x)
    check(lambda t: t.any(dim=1), x)
    check(lambda t: t.all(), x)
    if dtype != torch.bool:
        check(lambda t: t.prod(dim=1), values((3, 4), dtype, low=-2, high=3))


@pytest.mark.parametrize("dtype", ALL, ids=str)
def test_max_min_argmax_argmin(dtype):
    x = values((4, 6), dtype, low=-3, high=3)   # ties: the first index wins, as on the CPU
    check(lambda t: t.max(), x)
    check(lambda t: t.amin(dim=0), x)
    check(lambda t: t.max(dim=1), x)
    check(lambda t: t.min(dim=0, keepdim=True), x)
    check(lambda t: t.argmax(), x)
    check(lambda t: t.t().argmax(), x)               # flat index of a transposed view
    check(lambda t: t.argmin(dim=1, keepdim=True), x)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_mean_softmax_log_softmax(dtype):
    x = values((3, 5, 7), dtype)
    check(lambda t: t.mean(-1, keepdim=True), x, rtol=1e-5)
    check(lambda t: t.mean(dim=(0, 1)), x, rtol=1e-5)
    check(lambda t: t.pow(2).mean(), x, rtol=1e-5)
    for dim in (0, 1, -1):
        check(lambda t, d=dim: torch.softmax(t, d), x)
        check(lambda t, d=dim: torch.log_softmax(t, d), x)
    check(lambda t: torch.softmax(t.transpose(0, 2), -1), x)


@pytest.mark.parametrize("dtype", ALL + [torch.bool], ids=str)
def test_cumsum(dtype):
    x = values((3, 6), dtype, low=-3, high=4)
    check(lambda t: t.cumsum(-1), x)
    check(lambda t: t.cumsum(0), x)


# ---- matrix products -------------------------------------------------------------------------

def test_mm_bmm_addmm_with_transposed_operands():
    a, b = values((6, 5), torch.float32), values((5, 7), torch.float32, 1)
    check(torch.mm, a, b, rtol=1e-5)
    check(lambda x, y: x.t().t() @ y.t().contiguous().t(), a, b, rtol=1e-5)  # column-major b
    check(lambda x, y: torch.mm(y.t(), x.t()), a, b, rtol=1e-5)
    check(lambda x, y: x[:, 1:4] @ y[1:4, ::2], a, b, rtol=1e-5)            # copied first
    check(lambda c, x, y: torch.addmm(c, x, y, beta=0.5, alpha=2.0), values((7,), torch.float32, 2), a, b, rtol=1e-5)
    ba, bb = values((3, 4, 5), torch.float32), values((3, 5, 2), torch.float32, 1)
    check(torch.bmm, ba, bb, rtol=1e-5)
    check(lambda x, y: torch.baddbmm(torch.ones(3, 4, 2, device=x.device), x, y), ba, bb, rtol=1e-5)
    check(torch.mv, a, values((5,), torch.float32, 3), rtol=1e-5)


def test_linear_and_matmul_of_any_rank():
    x, w, bias = values((2, 3, 8), torch.float32), values((5, 8), torch.float32, 1), values((5,), torch.float32, 2)
    check(torch.nn.functional.linear, x, w, bias, rtol=1e-5)
    check(torch.nn.functional.linear, x.transpose(0, 1), w, rtol=1e-5)
    check(torch.matmul, values((2, 2, 3, 4), torch.float32), values((2, 2, 4, 6), torch.float32, 1), rtol=1e-5)
    check(torch.matmul, values((3, 4), torch.float32), values((2, 4, 5), torch.float32, 1), rtol=1e-5)


# ---- indexing and joining --------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ALL + [torch.bool], ids=str)
def test_embedding_index_select_and_integer_index(dtype):
    table = values((10, 4), dtype)
    ids = torch.tensor([[3, 0, 9], [1, 1, 2]])
    if dtype.is_floating_point:
        check(torch.nn.functional.embedding, ids, table)
    check(lambda t, i: t.index_select(0, i), table, ids[0])
    check(lambda t, i: t.index_select(1, i), table, torch.tensor([3, 0, 0]))
    check(lambda t, i: t[i], table, ids)
    check(lambda t, i: t[:, i], table, torch.tensor([-1, 0, 2]))       # negative: from the end


@pytest.mark.parametrize("dtype", ALL + [torch.bool], ids=str)
def test_cat(dtype):
    a, b = values((2, 3), dtype), values((2, 5), dtype, 1)
    check(lambda x, y: torch.cat([x, y], dim=1), a, b)
    check(lambda x, y: torch.cat([x.t(), y.t(), x.t()]), a, b)


def test_cat_promotes_and_isin():
    check(lambda x, y: torch.cat([x, y]), values((3,), torch.int64), values((2,), torch.float32))
    check(lambda x, y: torch.isin(x, y), values((4, 5), torch.int64), torch.tensor([0, 2, 4]))


# ---- attention -------------------------------------------------------------------------------

def _qkv(b, hq, hkv, seq_l, seq_s, d, seed=0):
    return (values((b, hq, seq_l, d), torch.float32, seed, -1, 1),
            values((b, hkv, seq_s, d), torch.float32, seed + 1, -1, 1),
            values((b, hkv, seq_s, d), torch.float32, seed + 2, -1, 1))


def test_sdpa_causal_plain_and_scaled():
    sdpa = torch.nn.functional.scaled_dot_product_attention
    q, k, v = _qkv(2, 3, 3, 7, 7, 16)
    check(lambda *t: sdpa(*t, is_causal=True), q, k, v, rtol=1e-5, atol=1e-6)
    check(lambda *t: sdpa(*t), q, k, v, rtol=1e-5, atol=1e-6)
    check(lambda *t: sdpa(*t, scale=0.3, is_causal=True), q, k, v, rtol=1e-5, atol=1e-6)


def test_sdpa_masks_gqa_and_strided_inputs():
    sdpa = torch.nn.functional.scaled_dot_product_attention
    q, k, v = _qkv(1, 4, 2, 5, 9, 8, seed=3)
    keep = torch.rand(1, 1, 5, 9, generator=torch.Generator().manual_seed(0)) > 0.3
    keep[..., 0] = True                                   # every query sees a key
    bias = values((5, 9), torch.float32, 5, -2, 2)
    check(lambda *t: sdpa(*t[:3], attn_mask=t[3], enable_gqa=True), q, k, v, keep, rtol=1e-5, atol=1e-6)
    check(lambda *t: sdpa(*t[:3], attn_mask=t[3], enable_gqa=True), q, k, v, bias, rtol=1e-5, atol=1e-6)
    # [B, L, H, D] storage read as [B, H, L, D] (how transformers hands it over)
    qt = values((1, 5, 4, 8), torch.float32, 7)
    check(lambda x, *t: sdpa(x.transpose(1, 2), *t, enable_gqa=True, is_causal=False), qt, k, v, rtol=1e-5, atol=1e-6)


# ---- what does not run on the card -----------------------------------------------------------

@pytest.fixture
def with_fallback(fallbacks):
    torch.spyre.set_cpu_fallback(True)
    return fallbacks


def test_an_op_without_a_card_kernel_runs_on_the_cpu_counted_and_warned_once(with_fallback):
    x = values((8,), torch.float32).to("spyre")
    with pytest.warns(UserWarning, match="aten::sort.*no card kernel"):
        values_, idx = torch.sort(x)
    torch.sort(x)
    assert list(with_fallback().values()) == [2]          # torch.sort is aten::sort.values_stable
    assert list(with_fallback())[0].startswith("aten::sort")
    assert values_.device.type == "spyre" and torch.equal(values_.cpu(), torch.sort(x.cpu())[0])


def test_a_dtype_the_kernel_does_not_cover_falls_back_under_the_ops_name(with_fallback):
    x = torch.ones(3, dtype=torch.float16).to("spyre")
    assert torch.equal((x + x).cpu(), torch.full((3,), 2.0, dtype=torch.float16))
    assert with_fallback() == {"aten::add.Tensor": 1}


def test_with_the_fallback_off_an_op_without_a_kernel_fails_naming_it():
    x = torch.ones(3).to("spyre")
    with pytest.raises(NotImplementedError, match="aten::sort.*CPU fallback is off"):
        torch.sort(x)


def test_a_view_without_a_card_kernel_cannot_fall_back_and_says_so(with_fallback):
    x = torch.zeros(2, dtype=torch.complex64).to("spyre")
    with pytest.raises(NotImplementedError, match="aten::view_as_real.*view"):
        torch.view_as_real(x)


def test_gradients_through_linear_and_silu_match_the_cpu():
    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(2, 4, 3, generator=g), torch.randn(5, 3, generator=g), torch.randn(5, generator=g)]
    grads = {}
    for device in ("cpu", "spyre"):
        x, w, b = (t.detach().to(device).requires_grad_() for t in leaves)
        torch.nn.functional.silu(torch.nn.functional.linear(x, w, b)).sum().backward()
        grads[device] = [t.grad.cpu() for t in (x, w, b)]
    for got, expected in zip(grads["spyre"], grads["cpu"], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
