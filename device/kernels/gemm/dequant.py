"""Two panels of a block-quantized weight widened to bfloat16, in a bfloat16 weight's layout, so
that AMX's bfloat16 tiles multiply them (device/kernels/gemm/packed.py: a prompt's rows on 8-
and 4-bit weights, where the level has AMX).

    dequantize_pair_bf16(w, k, fmt, p0, p1, out)
        out[:K NR] = panel p0, out[K NR:2 K NR] = panel p1 of the packed uint8 weight w, each
        in pairs of rows as a bfloat16 weight's panel is (K a multiple of QB, so no padding):
            out[(r // 2) 2 NR + 2 j + r % 2] = bfloat16(W[r, p NR + j])

Each value is GGML's dequantized one (d q for Q8_0, d (q - 8) for Q4_0, d q + m for Q4_1, Q4_K
and Q5_K, d (q - 32) for Q6_K: float32 arithmetic as device/layout.py's unpack_quantized),
rounded to the nearest bfloat16 (ties to even). A record is QB rows of one panel: its scales
(and minimums), then the quants in groups of 4 rows, a column's 4 bytes together (a 4-bit byte
holds row r in its low nibble and row r + QB/2 in its high one; the K-quants' higher bits in
planes after them: device/kernels/gemm/microkernel.py).
"""

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from spyre_serve.device.kernels.formats import (
    GROUP_BYTES,
    bf16_narrow_ir,
    has_integer_quants,
    record_bytes,
)
from spyre_serve.device.kernels.gemm.microkernel import QUANT_CASES, halves_scales, nibble_quants, quant_record
from spyre_serve.device.kernels.simd import (
    NR,
    QB,
    array_ptr,
    byte_ptr,
    choose,
    const,
    counted,
    fma_fn,
    load_at_byte,
)

_F16 = ir.VectorType(ir.HalfType(), NR)
_F32 = ir.VectorType(ir.FloatType(), NR)
_I32 = ir.VectorType(ir.IntType(32), NR)


def _v(n):
    return ir.Constant(_I32, [n] * NR)


def _bf16_pair(builder, lo, hi):
    """Two float32 vectors as bfloat16 pairs in 32-bit lanes (lo's in the low half), each
    rounded to nearest even (formats.bf16_narrow_ir)."""
    def rounded(v):
        return bf16_narrow_ir(builder, builder.bitcast(v, _I32), _I32)
    return builder.or_(rounded(lo), builder.shl(rounded(hi), _v(16)))


def _emit_record(builder, fma, kind, w_ptr, r0, o_ptr, o_at):
    """One record (QB rows of a panel) at byte r0 of w as QB / 2 pair rows of NR words at byte
    o_at of out: NR columns a vector."""
    rec, q_start = quant_record(kind)
    q0 = builder.add(r0, const(q_start))

    def store(pair_row, word):
        at = builder.add(o_at, const(pair_row * 4 * NR))
        builder.store(word, builder.bitcast(byte_ptr(builder, o_ptr, at), _I32.as_pointer()), align=4)

    if kind == "q8_0":
        d = builder.fpext(load_at_byte(builder, w_ptr, r0, _F16), _F32)
        for g in range(QB // 4):
            x = load_at_byte(builder, w_ptr, builder.add(q0, const(g * GROUP_BYTES)), _I32)
            # byte t of each lane, sign-extended: (x << 24 - 8 t) >> 24, arithmetic
            v = [builder.fmul(d, builder.sitofp(builder.ashr(builder.shl(x, _v(24 - 8 * t)), _v(24)), _F32))
                 for t in range(4)]
            store(2 * g, _bf16_pair(builder, v[0], v[1]))
            store(2 * g + 1, _bf16_pair(builder, v[2], v[3]))
        return
    geo = _NR_WIDE
    halves = halves_scales(builder, geo, w_ptr, r0, kind)
    for high in (False, True):
        (d,), (mn,) = halves[1 if high else 0]
        for g in range(QB // 8):
            x = load_at_byte(builder, w_ptr, builder.add(q0, const(g * GROUP_BYTES)), _I32)
            q = nibble_quants(builder, geo, kind, w_ptr, q0, x, 0, high, const(g))
            # GGML's dequantized value, one rounding (d q is exact)
            v = [builder.call(fma, [d, builder.uitofp(builder.and_(builder.lshr(q, _v(8 * t)), _v(255)), _F32), mn])
                 for t in range(4)]
            row = QB // 4 if high else 0
            store(row + 2 * g, _bf16_pair(builder, v[0], v[1]))
            store(row + 2 * g + 1, _bf16_pair(builder, v[2], v[3]))


class _NR_WIDE:
    """The geometry nibble_quants and halves_scales read: one vector of all NR columns."""
    vw, nv, vec, ivec = NR, 1, _F32, _I32


@intrinsic
def _records(typingctx, w, r0, nrec, fmt, out, o_at):
    """Records r0, r0 + rec, ... (nrec of them; byte offsets) of w to pair rows at byte o_at
    of out onwards (QB NR 2 bytes a record)."""
    if not isinstance(out, types.Array) or out.dtype != types.uint16:
        return None
    i64 = types.int64

    def codegen(context, builder, signature, args):
        w_v, r0_v, n_v, fmt_v, out_v, o_v = args
        if signature.args[0].dtype != types.uint8:
            return context.get_dummy_value()       # typed for every weight dtype: only uint8 runs
        w_ptr = array_ptr(context, builder, signature.args[0], w_v)
        o_ptr = array_ptr(context, builder, signature.args[4], out_v)
        fma = fma_fn(builder, _F32)

        def emit(kind):
            rec, _ = quant_record(kind)
            with counted(builder, const(0), n_v, 1) as i:
                _emit_record(builder, fma, kind, w_ptr, builder.add(r0_v, builder.mul(i, const(rec))), o_ptr,
                             builder.add(o_v, builder.mul(i, const(QB * NR * 2))))
        choose(builder, fmt_v, [(code, kind) for code, kind in QUANT_CASES if kind != "fp8"], emit)
        return context.get_dummy_value()

    return types.void(w, i64, i64, i64, out, i64), codegen


@njit(nogil=True, cache=True, inline="always")
def dequantize_panel_bf16(w, k, fmt, p, out, o_off):
    """Panel p of the packed weight w (an integer block-quantized format, K whole blocks: the
    caller's checks; its K / QB records, one after another) as bfloat16 bits in
    out[o_off:o_off + K NR], in a bfloat16 weight's layout."""
    nb = k // QB
    _records(w, p * nb * record_bytes(fmt), nb, fmt, out, 2 * o_off)


@njit(nogil=True, cache=True)
def dequantize_pair_bf16(w, k, fmt, p0, p1, out):
    """Panels p0 and p1 of the packed weight w (uint8; FMT_Q8_0, FMT_Q4_0 or FMT_Q4_1, K a
    multiple of QB) as bfloat16 bits in out[:2 K NR] (uint16), in a bfloat16 weight's layout."""
    if not has_integer_quants(fmt):
        raise ValueError("dequantize_pair_bf16: not an integer block-quantized format", fmt)
    if k % QB or out.shape[0] < 2 * k * NR:
        raise ValueError("dequantize_pair_bf16: K must be whole blocks and out 2 K NR long (K, len)",
                         k, out.shape[0])
    dequantize_panel_bf16(w, k, fmt, p0, out, 0)
    dequantize_panel_bf16(w, k, fmt, p1, out, k * NR)
