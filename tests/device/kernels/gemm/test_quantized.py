"""The GEMM on block-quantized weights (Q8_0, Q4_0, Q4_1 in panels, the K-quants' records (Q4_K,
Q5_K, Q6_K: float32 scales, bit planes), and FP8 E4M3 with a scale a column in Q8_0's records)
against numpy: the values the formats define, bit for bit the float32
GEMM on the dequantized weights with float32 activations, and with int8 activations (integer
quants only) the product of both sides' quantized values."""

import numpy as np
import pytest

from spyre_serve.device import Card, DeviceError
from spyre_serve.device.kernels.formats import (
    FMT_BF16,
    FMT_F32,
    FMT_FP8,
    FMT_Q4_0,
    FMT_Q4_1,
    FMT_Q4_K,
    FMT_Q5_K,
    FMT_Q6_K,
    FMT_Q6_K_MIN,
    FMT_Q8_0,
    packed_len,
)
from spyre_serve.device.kernels.gather import gather_columns, gather_columns_at
from spyre_serve.device.kernels.gemm.inputs import ACT_F32, ACT_INT8, quantize_rows, round_to_format
from spyre_serve.device.kernels.gemm.packed import (
    AMX_QUANT_MIN_ROWS,
    DOT_QUANT_MIN_ROWS,
    WIDEN_NONE,
    gemm_at,
    gemm_packed,
    widened_path,
)
from spyre_serve.device.kernels.simd import QB
from spyre_serve.device.layout import (
    QuantizedWeight,
    pack,
    pack_quantized,
    place_quantized_weight,
    unpack_quantized,
)

K_QFMTS = [FMT_Q4_K, FMT_Q5_K, FMT_Q6_K, FMT_Q6_K_MIN]
INT_QFMTS = [FMT_Q8_0, FMT_Q4_0, FMT_Q4_1, *K_QFMTS]
QFMTS = [*INT_QFMTS, FMT_FP8]
# (M, K, N): a GEMV, two rows, a partial tile, past one block of rows (MC) of a decode, a
# prefill-sized block; K in whole blocks of 32 (an odd count of them), N odd
SHAPES = [(1, 64, 32), (2, 96, 33), (7, 288, 301), (33, 512, 17), (512, 96, 81)]


def random_weight(fmt, n, k, seed=0) -> QuantizedWeight:
    """Quants and float16 scales as a GGUF file holds them: Q8_0 q in [-127, 127], Q4 q in
    [0, 15]; scales of either sign (Q4_1's minimums too). K-quants: every quant of the width
    (Q6_K's 0..63), float32 scales of a float16 times an integer as GGML's super-blocks make
    them (Q6_K's int8 scales of either sign, a half block each; Q4_K's and Q5_K's 6-bit ones,
    minimums -dmin m)."""
    rng = np.random.default_rng(seed)
    nb = k // QB
    if fmt in K_QFMTS:
        bits = {FMT_Q4_K: 4, FMT_Q5_K: 5, FMT_Q6_K: 6, FMT_Q6_K_MIN: 6}[fmt]
        q = rng.integers(0, 1 << bits, (n, k)).astype(np.int8)
        d16 = (rng.standard_normal((n, 1)) * 0.001).astype(np.float16).astype(np.float32)
        if fmt == FMT_Q6_K:
            return QuantizedWeight(fmt, q, d16 * rng.integers(-128, 128, (n, 2 * nb)).astype(np.float32))
        if fmt == FMT_Q6_K_MIN:               # a Q4_K's, Q5_K's or Q6_K's scales, a half block each
            return QuantizedWeight(fmt, q, d16 * rng.integers(-128, 128, (n, 2 * nb)).astype(np.float32),
                                   d16 * rng.integers(-2048, 2048, (n, 2 * nb)).astype(np.float32))
        dmin = np.abs(rng.standard_normal((n, 1)) * 0.001).astype(np.float16).astype(np.float32)
        return QuantizedWeight(fmt, q, d16 * rng.integers(0, 64, (n, nb)).astype(np.float32),
                               -(dmin * rng.integers(0, 64, (n, nb)).astype(np.float32)))
    d = (rng.standard_normal((n, nb)) * 0.01).astype(np.float16)
    if fmt == FMT_Q8_0:
        return QuantizedWeight(fmt, rng.integers(-127, 128, (n, k)).astype(np.int8), d)
    if fmt == FMT_FP8:                        # every code but the two NaNs, subnormals too
        codes = rng.integers(0, 254, (n, k))
        codes = np.where(codes >= 0x7F, codes + 1, codes).astype(np.uint8)
        return QuantizedWeight(fmt, codes, d)
    q = rng.integers(0, 16, (n, k)).astype(np.int8)
    m = (rng.standard_normal((n, nb)) * 0.05).astype(np.float16) if fmt == FMT_Q4_1 else None
    return QuantizedWeight(fmt, q, d, m)


def e4m3_value(code: int) -> float:
    """An E4M3 code's value from the OCP 8-bit floating point spec: (-1)^s 2^(e - 7) (1 + m/8),
    subnormal (e = 0) 2^-6 (m/8); S.1111.111 is NaN; no infinities."""
    s, e, m = code >> 7, (code >> 3) & 15, code & 7
    if e == 15 and m == 7:
        return float("nan")
    mag = 2.0 ** -6 * (m / 8) if e == 0 else 2.0 ** (e - 7) * (1 + m / 8)
    return -mag if s else mag


E4M3 = np.array([e4m3_value(c) for c in range(256)], np.float32)


def reference_values(qw: QuantizedWeight) -> np.ndarray:
    """float32 [N, K] from the formats' definitions (ggml-quants.c dequantize_row_q8_0 /
    q4_0 / q4_1: x = d * q, d * (q - 8), d * q + m; FP8 d * e4m3(q)), written out here."""
    n, k = qw.shape
    out = np.empty((n, k), np.float32)
    for b in range(k // QB):
        cols = slice(b * QB, (b + 1) * QB)
        d = qw.d[:, b:b + 1].astype(np.float32)
        q = qw.q[:, cols].astype(np.float32)
        if qw.fmt == FMT_Q8_0:
            out[:, cols] = d * q
        elif qw.fmt == FMT_FP8:
            out[:, cols] = d * E4M3[qw.q[:, cols]]
        elif qw.fmt == FMT_Q4_0:
            out[:, cols] = d * (q - 8)
        elif qw.fmt == FMT_Q6_K:                 # a scale a half block
            halves = np.repeat(qw.d[:, 2 * b:2 * b + 2], QB // 2, axis=1)
            out[:, cols] = halves * (q - 32)
        elif qw.fmt == FMT_Q6_K_MIN:             # a scale and a minimum a half block
            halves, mins = (np.repeat(x[:, 2 * b:2 * b + 2], QB // 2, axis=1) for x in (qw.d, qw.m))
            out[:, cols] = halves * q + mins
        else:
            out[:, cols] = d * q + qw.m[:, b:b + 1].astype(np.float32)
    return out


@pytest.mark.parametrize("fmt", QFMTS)
def test_dequantize_and_unpack_give_the_formats_values(fmt):
    qw = random_weight(fmt, 37, 96)
    want = reference_values(qw)
    np.testing.assert_array_equal(qw.dequantize(), want)
    np.testing.assert_array_equal(unpack_quantized(pack_quantized(qw), 37, fmt), want.T)


@pytest.mark.parametrize("fmt", QFMTS)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_gemm_on_quantized_weights_is_the_float_gemm_on_their_values(m, k, n, fmt):
    qw = random_weight(fmt, n, k, seed=m)
    values = reference_values(qw)                                  # [N, K]
    a = np.random.default_rng(m + 1).standard_normal((m, k), dtype=np.float32)
    out = np.full((m, n), np.nan, np.float32)
    gemm_packed(out, a, pack_quantized(qw).reshape(-1), k, n, fmt, ACT_F32)
    want = a.astype(np.float64) @ values.T.astype(np.float64)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4 * np.sqrt(k) * np.abs(values).max())
    # the same sums in the same order as the float32 GEMM of the dequantized weights
    ref = np.full((m, n), np.nan, np.float32)
    gemm_packed(ref, a, pack(np.ascontiguousarray(values.T), FMT_F32).reshape(-1), k, n, FMT_F32, ACT_F32)
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("fmt", QFMTS)
def test_gather_columns_reads_quantized_columns(fmt):
    qw = random_weight(fmt, 50, 64)
    cols = np.array([0, 49, 16, 15, 33], np.int32)
    out = np.empty((5, 64), np.float32)
    gather_columns(out, pack_quantized(qw).reshape(-1), cols, 3.0, 64, 50, fmt)
    np.testing.assert_array_equal(out, reference_values(qw)[cols] * np.float32(3.0))


@pytest.mark.parametrize("fmt", QFMTS)
def test_a_placed_quantized_weight_is_read_at_its_address(fmt):
    qw = random_weight(fmt, 40, 128)
    with Card(8 << 20) as card:
        gw = place_quantized_weight(card, qw)
        assert (gw.k, gw.n, gw.fmt) == (128, 40, fmt)
        assert gw.nbytes == packed_len(128, 40, fmt)          # the width, not float32's
        np.testing.assert_array_equal(gw.numpy(), reference_values(qw).T)
        f32, u16 = card.f32, card.u16
        a = np.random.default_rng(3).standard_normal((3, 128), dtype=np.float32)
        out = np.empty((3, 40), np.float32)
        gemm_at(out, a, f32, u16, gw.address, 128, 40, fmt, ACT_F32)
        ref = np.empty((3, 40), np.float32)
        gemm_packed(ref, a, pack_quantized(qw).reshape(-1), 128, 40, fmt, ACT_F32)
        np.testing.assert_array_equal(out, ref)
        emb = np.empty((2, 128), np.float32)
        gather_columns_at(emb, f32, u16, gw.address, np.array([39, 1], np.int32), 1.0, 128, 40, fmt)
        np.testing.assert_array_equal(emb, reference_values(qw)[[39, 1]])


def test_bytes_per_weight_are_the_formats():
    k, n = 512, 64
    assert packed_len(k, n, FMT_Q8_0) == k * n * 34 // 32         # 8.5 bits, as GGML's
    assert packed_len(k, n, FMT_Q4_0) == k * n * 18 // 32         # 4.5 bits
    assert packed_len(k, n, FMT_Q4_1) == k * n * 20 // 32         # 5 bits
    assert packed_len(k, n, FMT_FP8) == k * n * 34 // 32          # 8 bits and a scale a block
    # K-quants: the quants at their width, a float32 scale and minimum a block (GGML's files
    # hold 4.5, 5.5 and 6.5625 bits: the scales as 6- or 8-bit integers of a super-block's)
    assert packed_len(k, n, FMT_Q4_K) == k * n * 6 // 8           # 4 + 2 bits
    assert packed_len(k, n, FMT_Q5_K) == k * n * 7 // 8           # 5 + 2 bits
    assert packed_len(k, n, FMT_Q6_K) == k * n * 8 // 8           # 6 + 2 bits (two scales)
    assert packed_len(k, n, FMT_Q6_K_MIN) == k * n * 10 // 8      # 6 + 4 bits (two of each)


def test_gemm_refuses_k_in_part_blocks_and_a_short_weight():
    qw = random_weight(FMT_Q8_0, 16, 64)
    w = pack_quantized(qw).reshape(-1)
    with pytest.raises(ValueError, match="whole blocks"):
        gemm_packed(np.empty((1, 16), np.float32), np.ones((1, 48), np.float32), w, 48, 16, FMT_Q8_0, ACT_F32)
    with pytest.raises(ValueError, match="too short"):
        gemm_packed(np.empty((1, 16), np.float32), np.ones((1, 64), np.float32), w[:-1], 64, 16,
                    FMT_Q8_0, ACT_F32)


def test_a_quantized_weight_checks_its_parts():
    q = np.zeros((4, 64), np.int8)
    with pytest.raises(DeviceError, match="blocks of 32"):
        QuantizedWeight(FMT_Q8_0, q, np.zeros((4, 3), np.float16))
    with pytest.raises(DeviceError, match="blocks of 32"):
        QuantizedWeight(FMT_Q4_1, q, np.zeros((4, 2), np.float16))       # Q4_1 needs m
    with pytest.raises(DeviceError, match=r"scales \[4, 4\]"):
        QuantizedWeight(FMT_Q6_K, q, np.zeros((4, 2), np.float32))      # a scale a half block
    with pytest.raises(DeviceError, match="scales are float32"):
        QuantizedWeight(FMT_Q4_K, q, np.zeros((4, 2), np.float16), np.zeros((4, 2), np.float16))
    with pytest.raises(DeviceError, match="cannot stack"):
        QuantizedWeight.stack([random_weight(FMT_Q8_0, 4, 64), random_weight(FMT_Q4_0, 4, 64)])


def test_a_weight_is_converted_only_to_a_format_that_holds_it_exactly():
    rng = np.random.default_rng(9)
    q4_0, q4_1, q4_k = (random_weight(f, 8, 64, seed=1) for f in (FMT_Q4_0, FMT_Q4_1, FMT_Q4_K))
    q8_0, q6_k = random_weight(FMT_Q8_0, 8, 64, seed=2), random_weight(FMT_Q6_K, 8, 64)
    d = (rng.standard_normal((8, 2)) * 0.01).astype(np.float16).astype(np.float32)
    q5_0 = QuantizedWeight(FMT_Q5_K, rng.integers(0, 32, (8, 64)).astype(np.int8), d, d * np.float32(-16))
    for qw, fmt in ((q4_0, FMT_Q8_0), (q5_0, FMT_Q8_0), (q4_0, FMT_Q5_K), (q4_1, FMT_Q5_K), (q4_k, FMT_Q5_K)):
        got = qw.exactly_as(fmt)
        assert got.fmt == fmt
        np.testing.assert_array_equal(got.dequantize(), reference_values(qw))
    for qw, fmt in ((q4_1, FMT_Q8_0), (q4_k, FMT_Q8_0), (q6_k, FMT_Q5_K), (q8_0, FMT_Q5_K), (q8_0, FMT_Q6_K)):
        assert qw.exactly_as(fmt) is None
    # a Q5_K whose minimum is not -16 d (a Q5_K file's own) is no Q8_0
    assert random_weight(FMT_Q5_K, 8, 64).exactly_as(FMT_Q8_0) is None
    # parts in the narrowest format that holds them all, or none
    assert [p.fmt for p in QuantizedWeight.in_one_format([q5_0, q5_0, q8_0])] == [FMT_Q8_0] * 3
    assert [p.fmt for p in QuantizedWeight.in_one_format([q4_k, q4_1, q4_0])] == [FMT_Q5_K] * 3
    assert [p.fmt for p in QuantizedWeight.in_one_format([q4_0, q4_0])] == [FMT_Q4_0] * 2
    # Q4_K q and k beside a Q6_K v (a larger model's Q4_K_M): Q6_K_MIN holds all three
    both = QuantizedWeight.in_one_format([q4_k, q4_k, q6_k])
    assert [p.fmt for p in both] == [FMT_Q6_K_MIN] * 3
    for part, qw in zip(both, (q4_k, q4_k, q6_k), strict=True):
        np.testing.assert_array_equal(part.dequantize(), reference_values(qw))
    assert QuantizedWeight.in_one_format([q8_0, q6_k]) is None


# ---- int8 activations: quantize_rows and the integer dot products --------------------------

def reference_quantize_rows(a: np.ndarray):
    """llama.cpp's quantize_row_q8_0, written out: per block of 32, d = max|x| / 127,
    q = round(x / d) half away from zero; and the block's sum of q."""
    m, k = a.shape
    blocks = a.reshape(m, k // QB, QB)
    d = np.abs(blocks).max(axis=-1) / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    v = blocks * inv[..., None]
    q = (np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))).astype(np.int8)
    return q.reshape(m, k), d.astype(np.float32), q.sum(axis=-1).astype(np.float32)


@pytest.mark.parametrize("m,k", [(5, 128), (96, 1536)])
def test_quantize_rows_is_llama_cpps_q8_0(m, k):
    """Every block in one vector (inputs._quantize_block), exactly the scalar reference, with
    the sums of each block and of its first half; the larger shape over both cores."""
    rng = np.random.default_rng(4)
    a = (rng.standard_normal((m, k)) * rng.uniform(0.01, 10, (m, 1))).astype(np.float32)
    a[2, 32:64] = 0.0                                   # a block of zeros: d = 0, q = 0
    a[3, 0:32] = np.linspace(-1, 1, 32)                 # values on the half steps
    a[4, 32:64] = -a[4, 32:64]                          # the other sign
    nb = m * k // QB
    aq, ad, asum = np.empty(m * k, np.int8), np.empty(nb, np.float32), np.empty(2 * nb, np.float32)
    quantize_rows(a.reshape(-1), m, k, aq, ad, asum)
    q, d, s = reference_quantize_rows(a)
    np.testing.assert_array_equal(aq.reshape(m, k), q)
    np.testing.assert_array_equal(ad.reshape(m, k // QB), d)
    sums = asum.reshape(m, k // QB, 2)                  # each block's sum, its first half's
    np.testing.assert_array_equal(sums[..., 0], s)
    low = q.reshape(m, k // QB, QB)[..., :QB // 2].sum(axis=-1, dtype=np.int64).astype(np.float32)
    np.testing.assert_array_equal(sums[..., 1], low)
    assert np.abs(q).max() == 127


@pytest.mark.parametrize("fmt", INT_QFMTS)
@pytest.mark.parametrize("m,k,n", [*SHAPES, (AMX_QUANT_MIN_ROWS, 1152, 17 * 32 + 5),
                                   (DOT_QUANT_MIN_ROWS, 1152, 17 * 32 + 5)])
def test_int8_activations_give_the_float_gemm_of_the_quantized_values(m, k, n, fmt):
    """Exact integer sums per block, scaled in float32: the float64 product of the int8
    activations' values and the weights' values, to float32 rounding. A prompt's rows on a
    level that multiplies bfloat16 (AMX_QUANT_MIN_ROWS and more on AMX, DOT_QUANT_MIN_ROWS on
    AVX512_BF16 for a Q6_K weight: widened_path) are bfloat16 inputs times the weights' values
    rounded to bfloat16 (AMX's tiles or vdpbf16ps; finer than int8 inputs): their float64
    product."""
    qw = random_weight(fmt, n, k, seed=m)
    a = np.random.default_rng(m + 1).standard_normal((m, k), dtype=np.float32)
    out = np.full((m, n), np.nan, np.float32)
    gemm_packed(out, a, pack_quantized(qw).reshape(-1), k, n, fmt, ACT_INT8)
    if widened_path(m, fmt, ACT_INT8) != WIDEN_NONE:
        a16, w16 = a.copy(), reference_values(qw).astype(np.float32)
        round_to_format(a16, FMT_BF16)
        round_to_format(w16, FMT_BF16)
        want = a16.astype(np.float64) @ w16.T.astype(np.float64)
    else:
        q, d, _ = reference_quantize_rows(a)
        a_values = (q.reshape(m, k // QB, QB) * d[..., None]).reshape(m, k).astype(np.float64)
        want = a_values @ reference_values(qw).T.astype(np.float64)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    # and within the activations' rounding of the float-activation GEMM
    exact = a.astype(np.float64) @ reference_values(qw).T.astype(np.float64)
    step = np.abs(reference_values(qw)).sum(axis=1).max() * np.abs(a).max() / 127
    assert np.abs(out - exact).max() <= step


@pytest.mark.parametrize("m", [1, 33])
def test_int8_activations_leave_fp8_weights_to_the_float_tiles(m):
    """FP8 quants are floats: with ACT_INT8 asked, its GEMM takes the float32 inputs."""
    qw = random_weight(FMT_FP8, 40, 96, seed=2)
    a = np.random.default_rng(7).standard_normal((m, 96), dtype=np.float32)
    out, ref = np.empty((m, 40), np.float32), np.empty((m, 40), np.float32)
    gemm_packed(out, a, pack_quantized(qw).reshape(-1), 96, 40, FMT_FP8, ACT_INT8)
    gemm_packed(ref, a, pack_quantized(qw).reshape(-1), 96, 40, FMT_FP8, ACT_F32)
    np.testing.assert_array_equal(out, ref)


def test_int8_activations_leave_float_weights_alone():
    rng = np.random.default_rng(6)
    w = rng.standard_normal((64, 24), dtype=np.float32)
    a = rng.standard_normal((3, 64), dtype=np.float32)
    out, ref = np.empty((3, 24), np.float32), np.empty((3, 24), np.float32)
    gemm_packed(out, a, pack(w, FMT_F32).reshape(-1), 64, 24, FMT_F32, ACT_INT8)
    gemm_packed(ref, a, pack(w, FMT_F32).reshape(-1), 64, 24, FMT_F32, ACT_F32)
    np.testing.assert_array_equal(out, ref)
