"""The card's number formats on the host: IBM's DLFloat16 and OCP's FP8 (E4M3, E5M2), each a
pair of conversions float32 -> codes -> float32, and FP8 with its scales. The kernels round
and widen with the same arithmetic (device/kernels/formats.py: `narrow`, `widen`, and
`dlfloat16_round` for a GEMM's inputs); tests/device/test_numerics.py holds a reference of
each format written from its specification and checks both against it, bit for bit.

DLFloat16 (IBM, "DLFloat: A 16-b Floating Point Format Designed for Deep Learning Training
and Inference", ARITH 2019), the format host fp16 becomes on the card:

    bit 15: sign | bits 14..9: exponent e, bias 31 | bits 8..0: fraction f
    value = (-1)^s 2^(e - 31) (1 + f / 512)     for every code but two pairs:
    0x0000 / 0x8000: +-0;  0x7FFF / 0xFFFF: the one NaN / infinity code
    no subnormals; the largest finite 2^32 (1 + 510/512) ~ 8.57e9, the smallest 2^-31 (1 + 1/512)

Rounding float32 -> DLFloat16 follows IBM's conversion (onnx-mlir's NNP1 `fp32_to_dlf16`):
the fraction rounds to nearest with ties away from zero (half an ulp added to the
magnitude), a value whose exponent is below the format's flushes to a signed zero (no
subnormals; a value that lands on exponent 0 with fraction 0 is the zero code too), and a
magnitude past the largest finite (after rounding), an infinity or a NaN becomes the NaN code.
"""

from __future__ import annotations

import numpy as np

DLF16_BIAS = 31
DLF16_NAN = 0x7FFF                          # exponent and fraction all ones: NaN and infinity
DLF16_MAX = 2.0 ** 32 * (1 + 510 / 512)     # exponent 63, fraction 510
DLF16_MIN = 2.0 ** -31 * (1 + 1 / 512)      # the smallest nonzero magnitude (code 0x0001)
DLF16_REBIAS = 127 - DLF16_BIAS                  # float32's exponent bias minus DLFloat16's: 96
DLF16_HALF_ULP = 1 << 13                         # half a DLFloat16 ulp in float32's fraction bits
# the largest float32 magnitude that rounds to DLF16_MAX (its bits): exponent 63, fraction 510,
# and every lower fraction bit set short of the rounding half
DLF16_NMAX_BITS = ((63 + DLF16_REBIAS) << 23) | (510 << 14) | (DLF16_HALF_ULP - 1)
CHUNK = 1 << 20                             # values converted at a time

FP8_E4M3_MAX = 448.0      # OCP 8-bit floats, E4M3 (torch's float8_e4m3fn): the largest finite
FP8_E5M2_MAX = 57344.0    # E5M2 (torch's float8_e5m2): the largest finite
FP8_MAX = {"e4m3": FP8_E4M3_MAX, "e5m2": FP8_E5M2_MAX}


def dlfloat16_encode(x: np.ndarray) -> np.ndarray:
    """float32 -> DLFloat16 codes (uint16), as the card's conversion rounds (module docstring).
    Works through the values in pieces of CHUNK, so a large weight needs little more memory
    than its codes."""
    flat = np.ascontiguousarray(x, np.float32).reshape(-1)
    out = np.empty(flat.shape, np.uint16)
    for lo in range(0, flat.size, CHUNK):
        out[lo:lo + CHUNK] = _encode_piece(flat[lo:lo + CHUNK].view(np.int32))
    return out.reshape(np.shape(x))


def _encode_piece(u: np.ndarray) -> np.ndarray:
    """float32 bits (int32) -> DLFloat16 codes (uint16)."""
    sign = (u >> 16) & 0x8000
    exp = ((u >> 23) & 0xFF) - DLF16_REBIAS
    frac = (u & 0x7FFFFF) + DLF16_HALF_ULP
    carry = frac > 0x7FFFFF
    frac[carry] = 0
    exp += carry
    code = sign | (exp << 9) | (frac >> 14)
    code = np.where((u & 0x7FFFFFFF) > DLF16_NMAX_BITS, sign | DLF16_NAN, code)
    return np.where(exp < 0, sign, code).astype(np.uint16)


def dlfloat16_decode(codes: np.ndarray) -> np.ndarray:
    """DLFloat16 codes (uint16) -> float32, exactly (0x7FFF / 0xFFFF: NaN)."""
    b = np.asarray(codes, np.uint16).astype(np.uint32)
    mag = b & 0x7FFF
    bits = ((b & 0x8000) << 16) | ((mag << 14) + (DLF16_REBIAS << 23))
    bits = np.where(mag == 0, (b & 0x8000) << 16, bits).astype(np.uint32)
    return np.where(mag == DLF16_NAN, np.float32(np.nan), bits.view(np.float32))


def dlfloat16_round(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to DLFloat16's, as float32."""
    return dlfloat16_decode(dlfloat16_encode(x))


def _fp8_round(x: np.ndarray, mant: int, min_exp: int, max_exp: int, largest: float):
    """|x| to the nearest (ties to even) value of an 8-bit float with `mant` fraction bits,
    normal exponents min_exp..max_exp (subnormals below), saturating at `largest`."""
    a = np.abs(np.asarray(x, np.float32)).astype(np.float64)
    _, ex = np.frexp(a)                                     # a = f 2^ex, f in [0.5, 1)
    quantum = np.exp2(np.clip(ex - 1, min_exp, max_exp) - mant)
    return np.minimum(np.rint(a / quantum) * quantum, largest)


def fp8_e4m3_encode(x: np.ndarray) -> np.ndarray:
    """float32 -> E4M3 codes (uint8), from the OCP spec: sign, 4 exponent bits (bias 7), 3
    mantissa bits, subnormals below 2^-6 (steps of 2^-9), no infinities; rounded to nearest
    even, saturating at +-448 (a value past it becomes +-448, as quantizers clamp before the
    cast); NaN -> 0x7F."""
    x = np.asarray(x, np.float32)
    q = _fp8_round(x, 3, -6, 8, FP8_E4M3_MAX)
    half = (q / 256).astype(np.float16).view(np.uint16)   # exact: E4M3 / 256 is a float16
    codes = ((half >> 7) & 0x7F).astype(np.uint8) | np.where(np.signbit(x), 0x80, 0).astype(np.uint8)
    return np.where(np.isnan(x), np.uint8(0x7F), codes).astype(np.uint8)


def fp8_e4m3_decode(codes: np.ndarray) -> np.ndarray:
    """E4M3 codes (uint8) -> float32, exactly; 0x7F / 0xFF are NaN. The kernels widen a code
    as the float16 whose bits are (sign << 15) | (rest << 7), times 256 (the same value for
    every finite code: E4M3 is float16's top bits at an exponent 8 lower)."""
    b = np.asarray(codes, np.uint8).astype(np.uint16)
    half = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    value = half.view(np.float16).astype(np.float32) * np.float32(256)
    return np.where((b & 0x7F) == 0x7F, np.float32(np.nan), value)


def fp8_e5m2_encode(x: np.ndarray) -> np.ndarray:
    """float32 -> E5M2 codes (uint8), from the OCP spec: sign, 5 exponent bits (bias 15), 2
    mantissa bits, subnormals below 2^-14 (steps of 2^-16), IEEE's infinities and NaNs; rounded
    to nearest even, saturating at +-57344 as E4M3 does here (an infinity too); NaN -> 0x7E."""
    x = np.asarray(x, np.float32)
    q = _fp8_round(x, 2, -14, 15, FP8_E5M2_MAX)
    half = q.astype(np.float16).view(np.uint16)            # exact: E5M2 is float16's top byte
    codes = ((half >> 8) & 0x7F).astype(np.uint8) | np.where(np.signbit(x), 0x80, 0).astype(np.uint8)
    return np.where(np.isnan(x), np.uint8(0x7E), codes).astype(np.uint8)


def fp8_e5m2_decode(codes: np.ndarray) -> np.ndarray:
    """E5M2 codes (uint8) -> float32, exactly: the float16 whose top byte the code is
    (0x7C / 0xFC: +-infinity; 0x7D..0x7F, 0xFD..0xFF: NaN)."""
    b = np.asarray(codes, np.uint8).astype(np.uint16)
    return (b << 8).view(np.float16).astype(np.float32)


FP8_CODECS = {"e4m3": (fp8_e4m3_encode, fp8_e4m3_decode), "e5m2": (fp8_e5m2_encode, fp8_e5m2_decode)}


def fp8_scales(w: np.ndarray, kind: str, per_channel: bool = True) -> np.ndarray:
    """The float32 scales that put W[N, K]'s largest magnitude (of each row, or of the whole
    tensor) on the format's largest finite value, as compressed-tensors' FP8 schemes do;
    1 for an all-zero row. Shape [N, 1] (per channel) or [1, 1]."""
    a = np.abs(np.asarray(w, np.float32))
    amax = a.max(axis=1, keepdims=True) if per_channel else a.max(keepdims=True).reshape(1, 1)
    return np.where(amax > 0, amax / np.float32(FP8_MAX[kind]), 1).astype(np.float32)


def fp8_round(w: np.ndarray, kind: str, per_channel: bool = True) -> np.ndarray:
    """W[N, K] through FP8 `kind` ("e4m3" or "e5m2") with its scales: decode(encode(W / s)) s,
    in float32 (what a GEMM on those codes computes with)."""
    encode, decode = FP8_CODECS[kind]
    s = fp8_scales(w, kind, per_channel)
    return decode(encode(np.asarray(w, np.float32) / s)) * s
