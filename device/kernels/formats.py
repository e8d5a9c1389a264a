"""The weights' number formats on the card and the arithmetic of their packed layout: how many
rows a panel holds, where a panel's rows start, how many elements a packed weight takes.
device/kernels/gemm.py describes the layouts; device/layout.py packs them.

    FMT_F32, FMT_BF16, FMT_F16        float32, bfloat16 (rows in pairs), float16
    FMT_Q8_0, FMT_Q4_0, FMT_Q4_1      GGML's block-quantized formats, in records of QB rows
    FMT_FP8                           FP8 E4M3 (OCP's float8_e4m3fn) in Q8_0's records: a
                                      float16 scale a column, the bytes E4M3 values
    FMT_BF16R                         bfloat16 in plain rows: a KV cache block read by the tiles

`widen` and `narrow` convert one value between float32 and a 16-bit format's storage (uint16
bits): a weight read outside the GEMM's tiles, the KV cache written and read.
"""

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from spyre_serve.device.kernels.simd import F32, I32, NR, QB, const

FMT_F32, FMT_BF16, FMT_F16, FMT_Q8_0, FMT_Q4_0, FMT_Q4_1 = range(6)
FMT_BF16R = 7    # bfloat16 in plain rows (a KV cache block), not a packed weight's pairs
FMT_FP8 = 8      # FP8 E4M3 bytes in Q8_0's records (device/layout.py: fp8_e4m3_encode)
# bytes of one record (QB rows of one panel) of each block-quantized format
SCALE_BYTES = 2 * NR                              # NR float16 values
GROUP_BYTES = 4 * NR                              # 4 rows of a panel, a column's 4 bytes together
RECORD_BYTES = {FMT_Q8_0: SCALE_BYTES + QB * NR, FMT_Q4_0: SCALE_BYTES + QB * NR // 2,
                FMT_Q4_1: 2 * SCALE_BYTES + QB * NR // 2, FMT_FP8: SCALE_BYTES + QB * NR}
REC_Q8_0, REC_Q4_0, REC_Q4_1 = (RECORD_BYTES[f] for f in (FMT_Q8_0, FMT_Q4_0, FMT_Q4_1))
BF16_KB = 32     # a bfloat16 weight's K is padded with zero rows to a multiple of this (AMX's tile)

FORMATS = {"float32": FMT_F32, "bfloat16": FMT_BF16, "float16": FMT_F16,
           "Q8_0": FMT_Q8_0, "Q4_0": FMT_Q4_0, "Q4_1": FMT_Q4_1, "FP8_E4M3": FMT_FP8}
FORMAT_NAMES = {code: name for name, code in FORMATS.items()}


@njit(nogil=True, cache=True, inline="always")
def is_quantized(fmt):
    """A block-quantized format (uint8 storage: records of QB rows per panel)."""
    return fmt >= FMT_Q8_0


@njit(nogil=True, cache=True, inline="always")
def has_integer_quants(fmt):
    """A quantized format whose quants are integers (the int8 activations' dot products read
    them): GGML's Q8_0, Q4_0, Q4_1, not FP8."""
    return fmt == FMT_Q8_0 or fmt == FMT_Q4_0 or fmt == FMT_Q4_1


@njit(nogil=True, cache=True, inline="always")
def record_bytes(fmt):
    if fmt == FMT_Q8_0 or fmt == FMT_FP8:
        return REC_Q8_0
    if fmt == FMT_Q4_0:
        return REC_Q4_0
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
        return builder.select(builder.icmp_signed("==", fmt_v, const(FMT_F16)), half, brain)
    return types.float32(bits, types.int64), codegen   # (any other 16-bit code: bfloat16)


@intrinsic
def narrow(typingctx, x, store, fmt):
    """float32 x as a value of the array `store`'s type: itself for a float32 array, the bits
    of the nearest bfloat16 or float16 (fmt; round to nearest even) for a uint16 one."""
    if x != types.float32 or store.dtype not in (types.float32, types.uint16):
        return None

    def codegen(context, builder, signature, args):
        v, _, fmt_v = args
        if signature.args[1].dtype == types.float32:
            return v
        i16 = ir.IntType(16)
        half = builder.bitcast(builder.fptrunc(v, ir.HalfType()), i16)
        u = builder.bitcast(v, I32)
        rounded = builder.add(builder.add(u, ir.Constant(I32, 0x7FFF)),
                              builder.and_(builder.lshr(u, ir.Constant(I32, 16)), ir.Constant(I32, 1)))
        brain = builder.trunc(builder.lshr(rounded, ir.Constant(I32, 16)), i16)
        return builder.select(builder.icmp_signed("==", fmt_v, const(FMT_F16)), half, brain)
    return store.dtype(x, store, types.int64), codegen
