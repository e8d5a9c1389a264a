"""The card's number formats (device/numerics.py, and the kernels' rounding in
device/kernels/formats.py) against references written here from each format's specification:
every code decoded by the formula, encodings found by searching the value grid (not by bit
tricks), on ties, the largest finite value and overflow, values below the smallest normal,
NaN and infinity, and large random sets; the kernels' DLFloat16 rounding equal to the
reference bit for bit."""

import numpy as np
import pytest

from spyre_serve.device.kernels.attention.paged import write_kv
from spyre_serve.device.kernels.formats import FMT_DLF16
from spyre_serve.device.kernels.gemm.inputs import round_to_format
from spyre_serve.device.numerics import (
    DLF16_MAX,
    DLF16_MIN,
    FP8_E5M2_MAX,
    dlfloat16_decode,
    dlfloat16_encode,
    dlfloat16_round,
    fp8_e4m3_decode,
    fp8_e4m3_encode,
    fp8_e5m2_decode,
    fp8_e5m2_encode,
    fp8_round,
    fp8_scales,
)
from tests.device.test_fp8 import nearest_code, nearest_even

# ---- DLFloat16 (IBM, ARITH 2019): s | e (6 bits, bias 31) | f (9 bits); no subnormals; code
# 0 is zero, 0x7FFF the one NaN/infinity; rounding as IBM's conversion: to nearest, ties away
# from zero; below 2^-31 zero; the normal grid's first point 2^-31 is code 0, so zero too.


def dlf16_spec(code: int) -> float:
    s, e, f = code >> 15, (code >> 9) & 63, code & 511
    if code & 0x7FFF == 0x7FFF:
        return float("nan")
    mag = 0.0 if code & 0x7FFF == 0 else 2.0 ** (e - 31) * (1 + f / 512)
    return -mag if s else mag


ALL16 = np.arange(1 << 16, dtype=np.uint16)
SPEC16 = np.array([dlf16_spec(int(c)) for c in ALL16])
GRID = np.array([2.0 ** (e - 31) * (1 + f / 512) for e in range(64) for f in range(512)])[:-1]
# GRID[c] is the magnitude of code c, c = 0 .. 0x7FFE, with code 0 standing at 2^-31


def dlf16_reference(x: float) -> int:
    """The code of x by search: nearest grid point, a tie to the larger magnitude; past the
    largest finite's rounding range NaN; below 2^-31 zero."""
    sign = 0x8000 if np.signbit(x) else 0
    a = abs(x)
    if np.isnan(a) or a >= DLF16_MAX + 2.0 ** 22:         # half an ulp past the largest: a tie up
        return sign | 0x7FFF
    if a < 2.0 ** -31:
        return sign
    i = int(np.searchsorted(GRID, a))                    # GRID[i - 1] < a <= GRID[i]
    if i < len(GRID) and GRID[i] == a:
        return sign | i
    lo, hi = GRID[i - 1], GRID[i] if i < len(GRID) else np.inf
    return sign | (i if a - lo >= hi - a else i - 1)


def test_dlfloat16_decode_is_the_spec_for_every_code():
    got = dlfloat16_decode(ALL16)
    nan = np.isnan(SPEC16)
    assert nan.sum() == 2 and np.array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan], SPEC16[~nan].astype(np.float32))
    assert got[0x7FFE] == DLF16_MAX and got[0x0001] == DLF16_MIN and np.signbit(got[0x8000])


def test_every_dlfloat16_code_round_trips():
    codes = ALL16[(ALL16 & 0x7FFF) != 0x7FFF]
    np.testing.assert_array_equal(dlfloat16_encode(dlfloat16_decode(codes)), codes)


@pytest.mark.parametrize("x,code", [
    (0.0123456789, 12585),                                # IBM's example in onnx-mlir's conversion
    (1.0, 31 << 9), (-2.0, 0x8000 | 32 << 9),
    (1 + 1 / 1024, (31 << 9) | 1), (1 + 3 / 1024, (31 << 9) | 2),    # ties: away from zero
    (-(1 + 1 / 1024), 0x8000 | (31 << 9) | 1),
    (1 + 1 / 1024 - 2.0 ** -23, 31 << 9),                 # just under the tie: down
    (2 - 2.0 ** -11, 32 << 9),                            # a tie into the next binade
    (DLF16_MAX, 0x7FFE), (DLF16_MAX + 2.0 ** 22 - 2.0 ** 9, 0x7FFE),  # the largest finite
    (DLF16_MAX + 2.0 ** 22, 0x7FFF), (1e30, 0x7FFF), (-1e30, 0xFFFF),  # overflow: NaN code
    (float("inf"), 0x7FFF), (float("-inf"), 0xFFFF), (float("nan"), 0x7FFF),
    (2.0 ** -32, 0x0000), (-(2.0 ** -40), 0x8000), (1e-45, 0),       # below the smallest normal
    (2.0 ** -31, 0x0000), (DLF16_MIN, 0x0001),            # 2^-31 is code 0: zero
    (2.0 ** -31 * (1 + 1 / 1024), 0x0001),                # a tie up to the smallest nonzero
    (0.0, 0x0000), (-0.0, 0x8000),
])
def test_dlfloat16_encode_on_the_edges(x, code):
    assert dlfloat16_encode(np.array([x], np.float32))[0] == code
    assert dlf16_reference(float(np.float32(x))) == code


def test_dlfloat16_encode_is_the_reference_on_a_large_random_set():
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 1 << 32, 20_000, dtype=np.uint64).astype(np.uint32)   # every exponent
    x = np.concatenate([bits.view(np.float32), rng.standard_normal(20_000).astype(np.float32)])
    want = np.array([dlf16_reference(float(v)) for v in x], np.uint16)
    np.testing.assert_array_equal(dlfloat16_encode(x), want)


def _same_bits(a: np.ndarray, b: np.ndarray) -> None:
    """Equal bit for bit, every NaN counted equal (the format has one NaN)."""
    nan = np.isnan(a)
    np.testing.assert_array_equal(nan, np.isnan(b))
    np.testing.assert_array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32))


def test_the_kernels_round_to_dlfloat16_as_the_reference():
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)
    edges = np.array([DLF16_MAX, DLF16_MAX + 2.0 ** 22, 2.0 ** -31, DLF16_MIN, 1 + 1 / 1024,
                      0.0, -0.0, np.inf, -np.inf, np.nan], np.float32)
    x = np.concatenate([bits.view(np.float32), edges, rng.standard_normal(100_000).astype(np.float32)])
    got = x.copy()
    round_to_format(got, FMT_DLF16)                       # a GEMM's inputs
    _same_bits(got, dlfloat16_round(x))


def test_the_kernels_write_a_dlfloat16_cache_as_the_reference_encodes():
    d, bs = 64, 16
    rng = np.random.default_rng(2)
    k = (rng.standard_normal((3, 1, d)) * 1e3).astype(np.float32)
    k[0, 0, :4] = [np.inf, np.nan, 1e-12, DLF16_MAX * 2]
    v = rng.standard_normal((3, 1, d)).astype(np.float32)
    kc = np.zeros((2, 1, d, bs), np.uint16)
    vc = np.zeros((2, 1, bs, d), np.uint16)
    slots = np.array([0, 3, 17], np.int32)
    write_kv(kc, vc, k, v, slots, FMT_DLF16)
    for t, s in enumerate(slots):
        np.testing.assert_array_equal(kc[s // bs, 0, :, s % bs], dlfloat16_encode(k[t, 0]))
        np.testing.assert_array_equal(vc[s // bs, 0, s % bs], dlfloat16_encode(v[t, 0]))


# ---- FP8 E5M2 (OCP 8-bit floating point): s | e (5 bits, bias 15) | m (2 bits); subnormals
# below 2^-14; e = 31: m = 0 infinity, else NaN. E4M3's own reference is tests/device/test_fp8.py.


def e5m2_spec(code: int) -> float:
    s, e, m = code >> 7, (code >> 2) & 31, code & 3
    if e == 31:
        mag = float("inf") if m == 0 else float("nan")
    else:
        mag = 2.0 ** -14 * (m / 4) if e == 0 else 2.0 ** (e - 15) * (1 + m / 4)
    return -mag if s else mag


CODES8 = np.arange(256, dtype=np.uint8)
SPEC8 = np.array([e5m2_spec(int(c)) for c in CODES8])


def e5m2_reference(x: float) -> int:
    """E5M2's code of x by search: nearest finite, a tie to the even code, saturating; NaN
    -> 0x7E."""
    return nearest_code(x, SPEC8, FP8_E5M2_MAX, 0x7E)


def test_e5m2_decode_is_the_spec_for_every_code():
    got = fp8_e5m2_decode(CODES8)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(SPEC8))
    ok = ~np.isnan(SPEC8)
    np.testing.assert_array_equal(got[ok], SPEC8[ok].astype(np.float32))
    assert got[0x7B] == FP8_E5M2_MAX and got[0x01] == 2.0 ** -16 and got[0x7C] == np.inf


@pytest.mark.parametrize("x,code", [
    (57344.0, 0x7B), (61440.0, 0x7B), (1e30, 0x7B), (-1e30, 0xFB), (float("inf"), 0x7B),
    (2.0 ** -17, 0x00), (3 * 2.0 ** -17, 0x02), (2.0 ** -18, 0x00),   # subnormal ties: even
    (1.0 + 1 / 8, 0x3C), (1.0 + 3 / 8, 0x3E), (-0.0, 0x80), (float("nan"), 0x7E),
    (3 * 2.0 ** -16 + 2.0 ** -17, 0x04),       # the largest subnormal's tie: up to 2^-14
])
def test_e5m2_encode_on_the_edges(x, code):
    assert fp8_e5m2_encode(np.array([x], np.float32))[0] == code
    assert e5m2_reference(x) == code


@pytest.mark.parametrize("encode,decode,reference_of", [
    (fp8_e5m2_encode, fp8_e5m2_decode, "e5m2"), (fp8_e4m3_encode, fp8_e4m3_decode, "e4m3")])
def test_fp8_encoders_are_their_references_on_a_large_random_set(encode, decode, reference_of):
    reference = e5m2_reference if reference_of == "e5m2" else nearest_even
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.standard_normal(5000) * 10.0 ** rng.uniform(-6, 5, 5000),
                        rng.standard_normal(2000)]).astype(np.float32)
    want = np.array([reference(float(v)) for v in x], np.uint8)
    np.testing.assert_array_equal(encode(x), want)


@pytest.mark.parametrize("kind", ["e4m3", "e5m2"])
@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_with_scales_puts_each_largest_value_on_the_formats_largest(kind, per_channel):
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((6, 64)) * np.array([[1e-3], [1], [50], [0], [7], [1e4]])).astype(np.float32)
    s = fp8_scales(w, kind, per_channel)
    assert s.shape == ((6, 1) if per_channel else (1, 1))
    out = fp8_round(w, kind, per_channel)
    amax = np.abs(w).max(axis=1)
    if per_channel:
        np.testing.assert_allclose(np.abs(out).max(axis=1), amax, rtol=1e-6)   # largest: exact
        assert not out[3].any()                                # a zero row stays zero
    rel = 2.0 ** -4 if kind == "e4m3" else 2.0 ** -3             # half an ulp of the mantissa
    normal = np.abs(w) >= s * (2.0 ** -6 if kind == "e4m3" else 2.0 ** -14)
    assert np.all(np.abs(out - w)[normal] <= rel * np.abs(w)[normal] * (1 + 1e-6))
