"""FP8 E4M3 (OCP 8-bit floating point, torch's float8_e4m3fn) as the card stores weights:
`fp8_e4m3_encode` / `fp8_e4m3_decode` against the spec written out here, brute-force nearest
rounding, and torch's cast."""

import numpy as np
import pytest
import torch

from spyre_serve.device.numerics import FP8_E4M3_MAX, fp8_e4m3_decode, fp8_e4m3_encode


def spec_value(code: int) -> float:
    """(-1)^s 2^(e - 7) (1 + m/8); e = 0: 2^-6 m/8 (subnormal); S.1111.111: NaN."""
    s, e, m = code >> 7, (code >> 3) & 15, code & 7
    if e == 15 and m == 7:
        return float("nan")
    mag = 2.0 ** -6 * (m / 8) if e == 0 else 2.0 ** (e - 7) * (1 + m / 8)
    return -mag if s else mag


CODES = np.arange(256, dtype=np.uint8)
SPEC = np.array([spec_value(int(c)) for c in CODES])
FINITE = ~np.isnan(SPEC)


def nearest_code(x: float, spec: np.ndarray, largest: float, nan_code: int) -> int:
    """The 8-bit code nearest x among the finite ones of `spec` (every code's value; a tie:
    the even code, mantissa bit 0 clear), saturating at +-largest; by search, not by bits."""
    if np.isnan(x):
        return nan_code
    x = float(np.clip(x, -largest, largest))
    codes = CODES[np.isfinite(spec) & ((CODES >> 7) == (1 if np.signbit(x) else 0))]
    dist = np.abs(spec[codes] - x)
    best = codes[dist == dist.min()]
    return int(best[best % 2 == 0][0] if len(best) > 1 else best[0])


def nearest_even(x: float) -> int:
    """E4M3's code of x by search (NaN -> 0x7F)."""
    return nearest_code(x, SPEC, FP8_E4M3_MAX, 0x7F)


def test_decode_is_the_spec_for_every_code():
    got = fp8_e4m3_decode(CODES)
    np.testing.assert_array_equal(np.isnan(got), ~FINITE)       # 0x7F and 0xFF only
    np.testing.assert_array_equal(got[FINITE], SPEC[FINITE].astype(np.float32))
    assert got[0x7E] == FP8_E4M3_MAX and got[0x01] == 2.0 ** -9 and got[0x08] == 2.0 ** -6


def test_every_finite_code_round_trips():
    np.testing.assert_array_equal(fp8_e4m3_encode(fp8_e4m3_decode(CODES[FINITE])), CODES[FINITE])


@pytest.mark.parametrize("x,code", [
    (448.0, 0x7E), (464.0, 0x7E), (1e30, 0x7E), (-1e30, 0xFE),       # the largest; saturation
    (2.0 ** -10, 0x00), (3 * 2.0 ** -10, 0x02), (5 * 2.0 ** -10, 0x02),  # subnormal ties: even
    (2.0 ** -11, 0x00), (-0.0, 0x80), (1.0 + 1 / 16, 0x38), (1.0 + 3 / 16, 0x3A),  # ties
    (7 * 2.0 ** -9 + 2.0 ** -10, 0x08),          # the largest subnormal's tie rounds up to 2^-6
    (float("nan"), 0x7F),
])
def test_encode_rounds_ties_to_even_and_saturates(x, code):
    assert fp8_e4m3_encode(np.array([x], np.float32))[0] == code
    assert nearest_even(x) == code


def test_encode_is_the_nearest_code_on_a_large_random_set():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(4000) * 10.0 ** rng.uniform(-4, 2.8, 4000),
                        rng.uniform(-2.0 ** -6, 2.0 ** -6, 1000)]).astype(np.float32)
    got = fp8_e4m3_encode(x)
    np.testing.assert_array_equal(got, [nearest_even(float(v)) for v in x])


def test_encode_is_torchs_cast_within_range():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(20000) * 10.0 ** rng.uniform(-5, 2.5, 20000)).astype(np.float32)
    x = np.clip(x, -FP8_E4M3_MAX, FP8_E4M3_MAX)
    want = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(fp8_e4m3_encode(x), want)
