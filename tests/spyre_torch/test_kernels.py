"""The card kernels of spyre_torch/kernels/ called directly through their program ABI, on a
numpy arena, against numpy references (no torch in the computation)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from spyre_torch import dtypes
from spyre_torch.kernels import ATTENTION, ELEMENTWISE, EW_OPS, GATHER, MATMUL, ROW_OPS, ROWS


class Arena:
    """A little card: arrays placed at 128-byte aligned addresses; `call` runs an entry."""

    def __init__(self, nbytes: int = 1 << 20):
        raw = np.zeros(nbytes + 128, np.uint8)
        skip = (-raw.ctypes.data) % 128
        self.mem = raw[skip:skip + nbytes]
        self.top = 128  # address 0 stays unused

    def put(self, a: np.ndarray) -> int:
        a = np.ascontiguousarray(a)
        addr = self.top
        self.mem[addr:addr + a.nbytes] = a.view(np.uint8).reshape(-1)
        self.top += -(-max(a.nbytes, 1) // 128) * 128
        return addr

    def get(self, addr: int, shape, dtype) -> np.ndarray:
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return self.mem[addr:addr + n].view(dtype).reshape(shape).copy()

    def call(self, entry, slots, **values):
        index = {name: i for i, (name, _) in enumerate(slots)}
        table = np.zeros(len(slots), np.int64)
        for name, v in values.items():
            table[index[name]] = v
        m = self.mem
        entry(m.view(np.float32), m.view(np.int32), m.view(np.int64), m.view(np.uint16), table)


def _operand(name, addr, dt, strides, val=0):
    d = {name: addr, f"{name}_dt": dt, f"{name}_val": val}
    d.update({f"{name}_st{i}": s for i, s in enumerate(strides)})
    return d


def _elementwise(arena, op, out, operands, cdt, sizes, alpha=1.0, beta=0.0):
    from spyre_torch.kernels.elementwise import elementwise

    values = {"op": EW_OPS[op], "cdt": cdt, "alpha": dtypes.float_bits(alpha),
              "beta": dtypes.float_bits(beta)}
    values.update({f"size{i}": s for i, s in enumerate(sizes)})
    values.update(_operand("out", *out))
    for name, spec in zip("abc", operands, strict=False):
        values.update(_operand(name, *spec))
    for name in "abc"[len(operands):]:
        values[f"{name}_dt"] = dtypes.NONE
    arena.call(elementwise, ELEMENTWISE, **values)


def test_elementwise_binary_broadcast_and_a_number_match_numpy():
    ar = Arena()
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.array([1.5, -2.0, 0.25, 3.0], np.float32)
    pa, pb, po = ar.put(a), ar.put(b), ar.put(np.zeros((3, 4), np.float32))
    sizes = [1, 1, 1, 1, 3, 4]
    _elementwise(ar, "mul", (po, dtypes.F32, [0] * 4 + [4, 1]),
                 [(pa, dtypes.F32, [0] * 4 + [4, 1]), (pb, dtypes.F32, [0] * 5 + [1])], dtypes.F32, sizes)
    np.testing.assert_array_equal(ar.get(po, (3, 4), np.float32), a * b)
    # a float number, a transposed read, an int64 output through the generic path
    pi = ar.put(np.zeros((4, 3), np.int64))
    _elementwise(ar, "sub", (pi, dtypes.I64, [0] * 4 + [3, 1]),
                 [(pa, dtypes.F32, [0] * 4 + [1, 4]), (0, dtypes.SCALAR_F, [0] * 6, dtypes.float_bits(0.5))],
                 dtypes.F32, [1, 1, 1, 1, 4, 3])
    np.testing.assert_array_equal(ar.get(pi, (4, 3), np.int64), (a.T - 0.5).astype(np.int64))


@pytest.mark.parametrize("op,ref", [("exp", np.exp), ("silu", lambda x: x / (1 + np.exp(-x))),
                                    ("rsqrt", lambda x: 1 / np.sqrt(x)), ("neg", np.negative),
                                    ("floor", np.floor), ("erf", np.vectorize(math.erf))])
def test_elementwise_unary_float32_within_an_ulp_of_numpy(op, ref):
    ar = Arena()
    x = np.linspace(0.1, 4.0, 37, dtype=np.float32)
    px, po = ar.put(x), ar.put(np.zeros(37, np.float32))
    _elementwise(ar, op, (po, dtypes.F32, [0] * 5 + [1]), [(px, dtypes.F32, [0] * 5 + [1])],
                 dtypes.F32, [1] * 5 + [37])
    np.testing.assert_allclose(ar.get(po, 37, np.float32), ref(x.astype(np.float64)).astype(np.float32), rtol=2e-7)


def test_elementwise_where_integers_fill_and_arange():
    ar = Arena()
    cond = np.array([1, 0, 1, 0], np.uint8)
    a, b = np.array([1, 2, 3, 4], np.int64), np.array([-1, -2, -3, -4], np.int64)
    pc, pa, pb, po = ar.put(cond), ar.put(a), ar.put(b), ar.put(np.zeros(4, np.int64))
    one = [0] * 5 + [1]
    _elementwise(ar, "where", (po, dtypes.I64, one),
                 [(pc, dtypes.BOOL, one), (pa, dtypes.I64, one), (pb, dtypes.I64, one)], dtypes.I64, [1] * 5 + [4])
    np.testing.assert_array_equal(ar.get(po, 4, np.int64), np.where(cond, a, b))
    _elementwise(ar, "arange", (po, dtypes.I64, one), [], dtypes.I64, [1] * 5 + [4], alpha=3, beta=-2)
    np.testing.assert_array_equal(ar.get(po, 4, np.int64), np.arange(3, -5, -2))
    _elementwise(ar, "fill", (po, dtypes.I64, one), [], dtypes.I64, [1] * 5 + [4], alpha=7)
    np.testing.assert_array_equal(ar.get(po, 4, np.int64), [7] * 4)


def _rows(ar, op, x, out, n, outer_sizes, idx=(0, dtypes.NONE, [0] * 6)):
    from spyre_torch.kernels.rows import rows

    values = {"op": ROW_OPS[op], "n": n}
    values.update({f"size{i}": s for i, s in enumerate(outer_sizes)})
    values.update(_operand("x", *x))
    values.update(_operand("out", *out))
    values.update(_operand("idx", *idx))
    ar.call(rows, ROWS, **values)


def test_rows_reductions_along_a_strided_dim_match_numpy():
    ar = Arena()
    x = np.random.default_rng(0).standard_normal((5, 6)).astype(np.float32)
    px = ar.put(x)
    out = ar.put(np.zeros(6, np.float32))
    idx = ar.put(np.zeros(6, np.int64))
    # reduce dim 0 (stride 6) for each of the 6 columns (outer stride 1)
    _rows(ar, "max", (px, dtypes.F32, [0] * 4 + [1, 6]), (out, dtypes.F32, [0] * 4 + [1, 0]), 5,
          [1, 1, 1, 1, 6], (idx, dtypes.I64, [0] * 4 + [1, 0]))
    np.testing.assert_array_equal(ar.get(out, 6, np.float32), x.max(0))
    np.testing.assert_array_equal(ar.get(idx, 6, np.int64), x.argmax(0))
    _rows(ar, "sum", (px, dtypes.F32, [0] * 4 + [1, 6]), (out, dtypes.F32, [0] * 4 + [1, 0]), 5, [1, 1, 1, 1, 6])
    np.testing.assert_allclose(ar.get(out, 6, np.float32), x.astype(np.float64).sum(0), rtol=1e-6)


def test_rows_softmax_and_cumsum_match_numpy():
    ar = Arena()
    x = np.random.default_rng(1).standard_normal((3, 7)).astype(np.float32)
    px, po = ar.put(x), ar.put(np.zeros((3, 7), np.float32))
    rows3 = [0] * 4 + [7, 1]
    _rows(ar, "softmax", (px, dtypes.F32, rows3), (po, dtypes.F32, rows3), 7, [1, 1, 1, 1, 3])
    e = np.exp(x - x.max(1, keepdims=True))
    np.testing.assert_allclose(ar.get(po, (3, 7), np.float32), e / e.sum(1, keepdims=True), rtol=1e-6)
    ints = np.array([[1, -2, 3], [4, 5, -6]], np.int64)
    pi, pc = ar.put(ints), ar.put(np.zeros((2, 3), np.int64))
    rows2 = [0] * 4 + [3, 1]
    _rows(ar, "cumsum", (pi, dtypes.I64, rows2), (pc, dtypes.I64, rows2), 3, [1, 1, 1, 1, 2])
    np.testing.assert_array_equal(ar.get(pc, (2, 3), np.int64), ints.cumsum(1))


def test_matmul_row_and_column_major_with_bias_match_numpy():
    from spyre_torch.kernels.matmul import matmul

    ar = Arena()
    rng = np.random.default_rng(2)
    a = rng.standard_normal((2, 4, 5)).astype(np.float32)
    w = rng.standard_normal((6, 5)).astype(np.float32)   # read as w.T: column-major [5, 6]
    bias = rng.standard_normal(6).astype(np.float32)
    pa, pw, pb, po = ar.put(a), ar.put(w), ar.put(bias), ar.put(np.zeros((2, 4, 6), np.float32))
    ar.call(matmul, MATMUL, batch=2, m=4, n=6, k=5, alpha=dtypes.float_bits(2.0),
            beta=dtypes.float_bits(1.0), a=pa, b=pw, out=po, bias=pb, a_bs=20, a_rs=5, a_cs=1,
            b_bs=0, b_rs=1, b_cs=5, bias_dt=dtypes.F32, bias_bs=0, bias_rs=0, bias_cs=1)
    np.testing.assert_allclose(ar.get(po, (2, 4, 6), np.float32), 2.0 * (a @ w.T) + bias, rtol=1e-5, atol=1e-6)


def _attention_ref(q, k, v, causal, mask=None, scale=None):
    b, hq, seq_l, d = q.shape
    group = hq // k.shape[1]
    out = np.zeros((b, hq, seq_l, v.shape[-1]))
    for i in range(b):
        for h in range(hq):
            s = q[i, h].astype(np.float64) @ k[i, h // group].T * (scale or 1 / math.sqrt(d))
            if causal:
                s = np.where(np.tril(np.ones(s.shape, bool)), s, -np.inf)
            if mask is not None:
                s = s + mask
            p = np.exp(s - s.max(1, keepdims=True))
            out[i, h] = (p / p.sum(1, keepdims=True)) @ v[i, h // group]
    return out


@pytest.mark.parametrize("causal", [True, False])
def test_attention_grouped_heads_match_numpy(causal):
    from spyre_torch.kernels.attention import attention

    ar = Arena(4 << 20)
    rng = np.random.default_rng(3)
    b, hq, hkv, seq_l, seq_s, d = 2, 4, 2, 6, 6, 8
    q = rng.standard_normal((b, hq, seq_l, d)).astype(np.float32)
    k = rng.standard_normal((b, hkv, seq_s, d)).astype(np.float32)
    v = rng.standard_normal((b, hkv, seq_s, d)).astype(np.float32)
    mask = rng.standard_normal((seq_l, seq_s)).astype(np.float32)
    pq, pk, pv, pm = ar.put(q), ar.put(k), ar.put(v), ar.put(mask)
    po = ar.put(np.zeros((b, hq, seq_l, d), np.float32))
    ar.call(attention, ATTENTION, batch=b, hq=hq, hkv=hkv, l=seq_l, s=seq_s, d=d, dv=d,
            causal=int(causal), scale=dtypes.float_bits(1 / math.sqrt(d)),
            mask_dt=dtypes.NONE if causal else dtypes.F32, q=pq, k=pk, v=pv, out=po, mask=pm,
            q_bs=hq * seq_l * d, q_hs=seq_l * d, q_ls=d,
            k_bs=hkv * seq_s * d, k_hs=seq_s * d, k_ss=d, v_bs=hkv * seq_s * d, v_hs=seq_s * d,
            v_ss=d, m_ls=seq_s, m_ss=1)
    ref = _attention_ref(q, k, v, causal, None if causal else mask)
    np.testing.assert_allclose(ar.get(po, q.shape, np.float32), ref, rtol=1e-5, atol=1e-6)


def test_gather_rows_with_negative_indices_and_out_of_range():
    from spyre_torch.kernels.gather import gather

    ar = Arena()
    x = np.arange(20, dtype=np.float32).reshape(5, 4)
    idx = np.array([4, -1, 0], np.int64)
    px, pi, po = ar.put(x), ar.put(idx), ar.put(np.zeros((3, 4), np.float32))
    common = dict(outer=1, j=3, inner=4, dim_size=5, x_dt=dtypes.F32, x_os=0, x_ds=4, x_is=1,
                  idx_dt=dtypes.I64, idx_st=1, x=px, idx=pi, out=po)
    ar.call(gather, GATHER, wrap=1, **common)
    np.testing.assert_array_equal(ar.get(po, (3, 4), np.float32), x[idx])
    with pytest.raises(IndexError, match="out of range"):
        ar.call(gather, GATHER, wrap=0, **common)


def test_matmul_one_row_large_enough_to_split_across_cores_matches_numpy():
    from spyre_torch.kernels.matmul import GEMV_PARALLEL_BYTES, matmul

    n, k = 1024, GEMV_PARALLEL_BYTES // (4 * 1024)  # the GEMV split by output columns
    ar = Arena(4 * (n * k + n + k) + (1 << 12))
    rng = np.random.default_rng(4)
    x, w = rng.standard_normal(k).astype(np.float32), rng.standard_normal((n, k)).astype(np.float32)
    px, pw, po = ar.put(x), ar.put(w), ar.put(np.zeros(n, np.float32))
    ar.call(matmul, MATMUL, batch=1, m=1, n=n, k=k, alpha=dtypes.float_bits(1.0), a=px, b=pw,
            out=po, a_rs=k, a_cs=1, b_rs=1, b_cs=k, bias_dt=dtypes.NONE)
    np.testing.assert_allclose(ar.get(po, n, np.float32), w.astype(np.float64) @ x, rtol=1e-4, atol=1e-3)
