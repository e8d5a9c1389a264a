"""The weights' number formats on the card and the arithmetic of their packed layout: how many
rows a panel holds, where a panel's rows start, how many elements a packed weight takes.
device/kernels/gemm/packed.py describes the layouts; device/layout.py packs them.

    FMT_F32, FMT_BF16, FMT_F16        float32, bfloat16 (rows in pairs), float16
    FMT_Q8_0, FMT_Q4_0, FMT_Q4_1      GGML's block-quantized formats, in records of QB rows
    FMT_Q4_K, FMT_Q5_K, FMT_Q6_K      GGML's K-quants (and Q5_0 / Q5_1 as Q5_K) in records of
                                      QB rows: 4-bit quants (Q5: a plane of 5th bits, Q6: of
                                      5th and 6th), each block's scale (Q6: each half's) and
                                      minimum in float32, exactly as GGML's dequantizer
                                      multiplies them out of the super-block's
    FMT_Q6_K_MIN                      Q6_K's record with a minimum a half block: holds Q4_K,
                                      Q5_K and Q6_K exactly (a fused projection of them)
    FMT_FP8                           FP8 E4M3 (OCP's float8_e4m3fn) in Q8_0's records: a
                                      float16 scale a column, the bytes E4M3 values
    FMT_BF16R                         bfloat16 in plain rows: a KV cache block read by the tiles
    FMT_DLF16                         IBM's DLFloat16, the card's 16-bit format (1 sign, 6
                                      exponent, 9 fraction bits; device/numerics.py): plain
                                      rows, as float16

`widen` and `narrow` convert one value between float32 and a 16-bit format's storage (uint16
bits): a weight read outside the GEMM's tiles, the KV cache written and read; the DLFloat16
arithmetic is emitted by `dlf16_widen_ir` / `dlf16_narrow_ir` (the tiles widen with it too).
"""

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from spyre_serve.device.kernels.simd import F32, I32, NR, QB, const
from spyre_serve.device.numerics import DLF16_HALF_ULP, DLF16_NAN, DLF16_NMAX_BITS, DLF16_REBIAS

FMT_F32, FMT_BF16, FMT_F16, FMT_Q8_0, FMT_Q4_0, FMT_Q4_1 = range(6)
FMT_BF16R = 7    # bfloat16 in plain rows (a KV cache block), not a packed weight's pairs
FMT_FP8 = 8      # FP8 E4M3 bytes in Q8_0's records (device/layout.py: fp8_e4m3_encode)
FMT_DLF16 = 9    # DLFloat16 bits in plain rows (device/numerics.py: dlfloat16_encode)
FMT_Q4_K, FMT_Q5_K, FMT_Q6_K, FMT_Q6_K_MIN = 10, 11, 12, 13   # K-quants' records (device/layout.py)
# bytes of one record (QB rows of one panel) of each block-quantized format
SCALE_BYTES = 2 * NR                              # NR float16 values
WIDE_SCALE_BYTES = 4 * NR                         # NR float32 values (the K-quants' records)
GROUP_BYTES = 4 * NR                              # 4 rows of a panel, a column's 4 bytes together
NIBBLE_BYTES = QB * NR // 2                       # QB rows of 4-bit quants, two to a byte
RECORD_BYTES = {FMT_Q8_0: SCALE_BYTES + QB * NR, FMT_Q4_0: SCALE_BYTES + NIBBLE_BYTES,
                FMT_Q4_1: 2 * SCALE_BYTES + NIBBLE_BYTES, FMT_FP8: SCALE_BYTES + QB * NR,
                # scale and minimum, the nibbles, then (Q5) a 32-bit word of 5th bits a column
                FMT_Q4_K: 2 * WIDE_SCALE_BYTES + NIBBLE_BYTES,
                FMT_Q5_K: 2 * WIDE_SCALE_BYTES + NIBBLE_BYTES + GROUP_BYTES,
                # the two halves' scales, the nibbles, two words of 5th and 6th bits a column
                FMT_Q6_K: 2 * WIDE_SCALE_BYTES + NIBBLE_BYTES + 2 * GROUP_BYTES,
                # each half's scale and minimum, the nibbles, the two words
                FMT_Q6_K_MIN: 4 * WIDE_SCALE_BYTES + NIBBLE_BYTES + 2 * GROUP_BYTES}
REC_Q8_0, REC_Q4_0, REC_Q4_1 = (RECORD_BYTES[f] for f in (FMT_Q8_0, FMT_Q4_0, FMT_Q4_1))
REC_Q4_K, REC_Q5_K, REC_Q6_K, REC_Q6_K_MIN = (RECORD_BYTES[f] for f in (FMT_Q4_K, FMT_Q5_K, FMT_Q6_K, FMT_Q6_K_MIN))
# by format code (tuples, so that the kernels index them too): the byte of a record where its
# quants start, after its scales; the bits of a quant above its nibble, in planes after them
_CODES = range(FMT_Q6_K_MIN + 1)
QUANTS_AT = tuple({FMT_Q8_0: SCALE_BYTES, FMT_FP8: SCALE_BYTES, FMT_Q4_0: SCALE_BYTES, FMT_Q4_1: 2 * SCALE_BYTES,
                   FMT_Q4_K: 2 * WIDE_SCALE_BYTES, FMT_Q5_K: 2 * WIDE_SCALE_BYTES, FMT_Q6_K: 2 * WIDE_SCALE_BYTES,
                   FMT_Q6_K_MIN: 4 * WIDE_SCALE_BYTES}.get(c, 0) for c in _CODES)
HIGH_BITS = tuple({FMT_Q5_K: 1, FMT_Q6_K: 2, FMT_Q6_K_MIN: 2}.get(c, 0) for c in _CODES)
BF16_KB = 32     # a bfloat16 weight's K is padded with zero rows to a multiple of this (AMX's tile)

FORMATS = {"float32": FMT_F32, "bfloat16": FMT_BF16, "float16": FMT_F16,
           "Q8_0": FMT_Q8_0, "Q4_0": FMT_Q4_0, "Q4_1": FMT_Q4_1, "FP8_E4M3": FMT_FP8,
           "dlfloat16": FMT_DLF16, "Q4_K": FMT_Q4_K, "Q5_K": FMT_Q5_K, "Q6_K": FMT_Q6_K,
           "Q6_K_MIN": FMT_Q6_K_MIN}
FORMAT_NAMES = {code: name for name, code in FORMATS.items()}


@njit(nogil=True, cache=True, inline="always")
def is_quantized(fmt):
    """A block-quantized format (uint8 storage: records of QB rows per panel)."""
    return (fmt >= FMT_Q8_0 and fmt <= FMT_Q4_1) or fmt == FMT_FP8 or is_k_quant(fmt)


@njit(nogil=True, cache=True, inline="always")
def is_k_quant(fmt):
    """A K-quant's record: float32 scales, 4-bit quants and planes of higher bits."""
    return fmt >= FMT_Q4_K and fmt <= FMT_Q6_K_MIN


@njit(nogil=True, cache=True, inline="always")
def has_integer_quants(fmt):
    """A quantized format whose quants are integers (the int8 activations' dot products read
    them): GGML's Q8_0, Q4_0, Q4_1 and the K-quants, not FP8."""
    return fmt == FMT_Q8_0 or fmt == FMT_Q4_0 or fmt == FMT_Q4_1 or is_k_quant(fmt)


@njit(nogil=True, cache=True, inline="always")
def record_bytes(fmt):
    if fmt == FMT_Q8_0 or fmt == FMT_FP8:
        return REC_Q8_0
    if fmt == FMT_Q4_0:
        return REC_Q4_0
    if fmt == FMT_Q4_K:
        return REC_Q4_K
    if fmt == FMT_Q5_K:
        return REC_Q5_K
    if fmt == FMT_Q6_K:
        return REC_Q6_K
    if fmt == FMT_Q6_K_MIN:
        return REC_Q6_K_MIN
    return REC_Q4_1


@njit(nogil=True, cache=True, inline="always")
def padded_k(k, fmt):
    """Rows of each panel of a packed [K, N] weight: a bfloat16 weight's K padded with zero
    rows to a multiple of BF16_KB (its rows go in pairs, AMX's tiles in 32s); else K."""
    if fmt == FMT_BF16:
        return (k + BF16_KB - 1) // BF16_KB * BF16_KB
    return k


@njit(nogil=True, cache=True, inline="always")
def slab_offset(p, kb, k, fmt):
    """First element of panel p's rows kb.. (kb a multiple of QB for a quantized format, even
    for bfloat16)."""
    if is_quantized(fmt):
        rec = record_bytes(fmt)
        return p * (k // QB) * rec + (kb // QB) * rec
    return p * padded_k(k, fmt) * NR + kb * NR


@njit(nogil=True, cache=True)
def packed_len(k, n, fmt):
    """Elements (bytes for a quantized format) of a packed [K, N] weight in format fmt."""
    panels = (n + NR - 1) // NR
    if is_quantized(fmt):
        return panels * (k // QB) * record_bytes(fmt)
    return panels * padded_k(k, fmt) * NR


@njit(nogil=True, cache=True)
def packed_size(k, n):
    """Elements of a packed [K, N] float32 or float16 weight: ceil(N / NR) panels of K x NR."""
    return ((n + NR - 1) // NR) * k * NR


@intrinsic
def widen(typingctx, bits, fmt):
    """One stored value -> float32, exactly: a float32 as it is, a uint16 of bf16 or fp16
    bits (fmt) widened (a uint8, a quantized weight's byte, as its integer value: gather_columns
    types that branch for uint8 weights too, and never takes it)."""
    if bits not in (types.uint16, types.float32, types.uint8):
        return None

    def codegen(context, builder, signature, args):
        raw, fmt_v = args
        if signature.args[0] == types.float32:
            return raw
        if signature.args[0] == types.uint8:
            return builder.uitofp(raw, F32)
        half = builder.fpext(builder.bitcast(raw, ir.HalfType()), F32)
        brain = builder.bitcast(builder.shl(builder.zext(raw, I32), ir.Constant(I32, 16)), F32)
        dl = dlf16_widen_ir(builder, builder.zext(raw, I32), I32, F32)
        out = builder.select(builder.icmp_signed("==", fmt_v, const(FMT_F16)), half, brain)
        return builder.select(builder.icmp_signed("==", fmt_v, const(FMT_DLF16)), dl, out)
    return types.float32(bits, types.int64), codegen   # (any other 16-bit code: bfloat16)


@intrinsic
def narrow(typingctx, x, store, fmt):
    """float32 x as a value of the array `store`'s type: itself for a float32 array, the bits
    of the nearest bfloat16 or float16 (fmt; round to nearest even) or DLFloat16 (IBM's
    rounding: device/numerics.py) for a uint16 one."""
    if x != types.float32 or store.dtype not in (types.float32, types.uint16):
        return None

    def codegen(context, builder, signature, args):
        v, _, fmt_v = args
        if signature.args[1].dtype == types.float32:
            return v
        i16 = ir.IntType(16)
        half = builder.bitcast(builder.fptrunc(v, ir.HalfType()), i16)
        u = builder.bitcast(v, I32)
        brain = builder.trunc(bf16_narrow_ir(builder, u, I32), i16)
        dl = builder.trunc(dlf16_narrow_ir(builder, u), i16)
        out = builder.select(builder.icmp_signed("==", fmt_v, const(FMT_F16)), half, brain)
        return builder.select(builder.icmp_signed("==", fmt_v, const(FMT_DLF16)), dl, out)
    return store.dtype(x, store, types.int64), codegen


def bf16_narrow_ir(builder, u, ity):
    """float32 bits `u` (int32 `ity`, a scalar or vector type) -> the nearest bfloat16's bits,
    ties to even, in the low 16 bits: (u + 0x7FFF + (u >> 16 & 1)) >> 16."""
    odd = builder.and_(builder.lshr(u, _k(ity, 16)), _k(ity, 1))
    return builder.lshr(builder.add(builder.add(u, _k(ity, 0x7FFF)), odd), _k(ity, 16))


def _k(ty, value):
    """The constant `value` of an integer or float type, or of each lane of a vector type."""
    if isinstance(ty, ir.VectorType):
        return ir.Constant(ty, [value] * ty.count)
    return ir.Constant(ty, value)


def dlf16_widen_ir(builder, raw, ity, fty):
    """DLFloat16 codes (zero-extended into int32 `ity`, a scalar or vector type) -> float32
    (`fty`), exactly: the exponent rebiased by DLF16_REBIAS (96) under the fraction, 0x0000/0x8000 a signed
    zero, 0x7FFF/0xFFFF NaN (device/numerics.py: dlfloat16_decode)."""
    mag = builder.and_(raw, _k(ity, 0x7FFF))
    sign = builder.shl(builder.and_(raw, _k(ity, 0x8000)), _k(ity, 16))
    normal = builder.or_(sign, builder.add(builder.shl(mag, _k(ity, 14)), _k(ity, DLF16_REBIAS << 23)))
    bits = builder.select(builder.icmp_unsigned("==", mag, _k(ity, 0)), sign, normal)
    nan = builder.icmp_unsigned("==", mag, _k(ity, DLF16_NAN))
    return builder.select(nan, _k(fty, float("nan")), builder.bitcast(bits, fty))


def dlf16_narrow_ir(builder, u):
    """float32 bits u (int32) -> the DLFloat16 code (in int32), as IBM's conversion rounds:
    half an ulp added to the fraction (ties away from zero), a carry into the exponent, below
    exponent 0 a signed zero, past the largest finite the NaN code (device/numerics.py)."""
    sign = builder.and_(builder.lshr(u, _k(I32, 16)), _k(I32, 0x8000))
    exp = builder.sub(builder.and_(builder.lshr(u, _k(I32, 23)), _k(I32, 0xFF)), _k(I32, DLF16_REBIAS))
    frac = builder.add(builder.and_(u, _k(I32, 0x7FFFFF)), _k(I32, DLF16_HALF_ULP))
    carry = builder.icmp_unsigned(">", frac, _k(I32, 0x7FFFFF))
    frac = builder.select(carry, _k(I32, 0), frac)
    exp = builder.add(exp, builder.zext(carry, I32))
    normal = builder.or_(builder.or_(sign, builder.shl(exp, _k(I32, 9))),
                         builder.lshr(frac, _k(I32, 14)))
    big = builder.icmp_unsigned(">", builder.and_(u, _k(I32, 0x7FFFFFFF)), _k(I32, DLF16_NMAX_BITS))
    out = builder.select(big, builder.or_(sign, _k(I32, DLF16_NAN)), normal)
    return builder.select(builder.icmp_signed("<", exp, _k(I32, 0)), sign, out)


@intrinsic
def dlfloat16_round(typingctx, x):
    """float32 x -> the nearest DLFloat16 value (IBM's rounding), as float32."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        code = dlf16_narrow_ir(builder, builder.bitcast(args[0], I32))
        return dlf16_widen_ir(builder, code, I32, F32)
    return types.float32(x), codegen
