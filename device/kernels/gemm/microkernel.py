"""The GEMM's innermost loop, emitted as LLVM vector IR: one mr x NR tile of `out` in registers,
float32 FMAs on float32 activations.

    tile(mr, a, a_off, lda, w, w_off, ldw, c, c_off, ldc, kc, accumulate, fmt)
        c[mr, NR] (+)= a[mr, kc] @ slab[kc, NR]

a and c are 1-D float32 arrays addressed by element offsets and row strides; w is a packed
weight (device/kernels/gemm/packed.py describes the layouts) and w_off the first element of the slab:

- float32 (FMT_F32), or uint16 holding float16 bits (FMT_F16), DLFloat16 bits (FMT_DLF16)
  or bfloat16 bits in plain rows (FMT_BF16R: a KV cache block): the slab is kc rows of NR
  values, ldw elements apart, widened to float32 right after the load;
- uint16 holding bfloat16 bits (FMT_BF16): the slab is kc / 2 pairs of rows, each pair NR
  columns of 2 values (column j's rows k and k + 1 together, the layout vdpbf16ps and AMX
  read; device/kernels/gemm/dot_tile.py); widened by a shift (row k) and a mask (row k + 1);
- uint8 block-quantized (FMT_Q8_0 / FMT_Q4_0 / FMT_Q4_1, GGML's formats in panels): the slab
  is kc / QB records of QB rows, each record the NR float16 scales `d` (Q4_1: then the NR
  float16 minimums `m`), then the quants in groups of 4 rows, each group NR columns of 4
  bytes (column j's rows 4g..4g+3, the layout integer dot products read, 4 products to a
  32-bit lane: device/kernels/gemm/int8_tile.py): Q8_0 QB/4 groups of int8; Q4_0/Q4_1 QB/8
  groups whose bytes hold row r in the low nibble and row r + QB/2 in the high one. kc is a
  multiple of QB.
- uint8 K-quants (FMT_Q4_K / FMT_Q5_K / FMT_Q6_K; GGML's Q5_0 and Q5_1 as Q5_K): a record
  is NR float32 scales d and NR float32 minimums m (Q6_K: the NR scales of rows 0..15, then
  of rows 16..31, m = -32 d), Q4's nibbles, then the quants' higher bits in planes of 32-bit
  words a column (Q5_K one word, Q6_K two; FMT_Q6_K_MIN: Q6_K's with each half's minimum
  after its scale): byte t of a column's word w holds the hb high
  bits of row 16 h + 4 g + t at bit (4 h + g) hb - 8 w, so that one shift and mask put them
  above the nibbles of a group's 4 rows, lane by lane (nibble_quants). value = fma(d, q, m).
  Each weight is widened in registers to exactly the value GGML's dequantizer gives
  (Q8_0 d*q; Q4_0 d*(q-8) = fma(d, q, -8d); Q4_1 fma(d, q, m): d*q is exact in float32, as
  it is for the K-quants' float32 d, a float16 times a 6- or 8-bit integer),
  so the products are those of the float32 GEMM on the dequantized weights. FMT_FP8 is
  Q8_0's record with E4M3 codes for bytes: a code widens as the float16 (sign << 15 |
  rest << 7), which is its value / 256, times 256 d (one rounding: d * value).

For each k the tile loads the NR weights of that row, broadcasts one value of `a` per row
and does mr x NR fused multiply-adds. The vector width and the heights are the ISA level's
(device/kernels/simd.py): AVX2 keeps 6 x 2 ymm accumulators, AVX-512 16 x 1 zmm. A short
tile sums k in several interleaved accumulator sets (row k in set k % sets, the rows after
the last whole round in set 0), so that the FMA latency never limits the stream of weights;
the sets depend on the height only, so every format of the same values sums alike.
"""

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from spyre_serve.device.kernels.formats import (
    FMT_BF16,
    FMT_BF16R,
    FMT_DLF16,
    FMT_F16,
    FMT_FP8,
    FMT_Q4_0,
    FMT_Q4_1,
    FMT_Q4_K,
    FMT_Q5_K,
    FMT_Q6_K,
    FMT_Q6_K_MIN,
    FMT_Q8_0,
    GROUP_BYTES,
    HIGH_BITS,
    NIBBLE_BYTES,
    QUANTS_AT,
    RECORD_BYTES,
    SCALE_BYTES,
    WIDE_SCALE_BYTES,
    dlf16_widen_ir,
)
from spyre_serve.device.kernels.simd import (
    I16,
    I32,
    NR,
    PREFETCH_BYTES,
    QB,
    accumulators,
    array_ptr,
    by_height,
    choose,
    const,
    counted,
    fma_fn,
    geometry,
    load_at_byte,
    load_vec,
    prefetch,
    reduce_sets,
    splat,
    store_tile,
    weight_locality,
)

# a uint8 weight's format code -> its kind, in the order the tiles test them
QUANT_CASES = [(FMT_Q8_0, "q8_0"), (FMT_Q4_0, "q4_0"), (FMT_Q4_1, "q4_1"), (FMT_Q4_K, "q4_k"),
               (FMT_Q5_K, "q5_k"), (FMT_Q6_K, "q6_k"), (FMT_Q6_K_MIN, "q6_kmin"), (FMT_FP8, "fp8")]


def _fma_row(builder, g, fma, a_ptr, a_off, lda, k, wv, accs):
    """accs[i][j] += a[i, k] * wv[j] for every row i of the tile."""
    for i, row in enumerate(accs):
        ai = builder.add(builder.add(a_off, builder.mul(const(i), lda)), k)
        av = splat(builder, builder.load(builder.gep(a_ptr, [ai])), g.vec)
        for j, acc in enumerate(row):
            builder.store(builder.call(fma, [av, wv[j], builder.load(acc)]), acc)


def _row_weights(builder, g, w_ptr, index, kind):
    """The NR weights of one row (f32, f16, dlf16 or bf16r storage) at element `index`, as
    float32 vectors."""
    out = []
    for j in range(g.nv):
        at = builder.add(index, const(j * g.vw))
        if kind == "f32":
            out.append(load_vec(builder, w_ptr, at, g.vec, 4))
        elif kind == "f16":
            half = load_vec(builder, w_ptr, at, ir.VectorType(ir.HalfType(), g.vw), 2)
            out.append(builder.fpext(half, g.vec))
        elif kind == "dlf16":
            raw = builder.zext(load_vec(builder, w_ptr, at, ir.VectorType(I16, g.vw), 2), g.ivec)
            out.append(dlf16_widen_ir(builder, raw, g.ivec, g.vec))
        else:                                      # bfloat16 in plain rows: a 16-bit shift
            raw = builder.zext(load_vec(builder, w_ptr, at, ir.VectorType(I16, g.vw), 2), g.ivec)
            out.append(builder.bitcast(builder.shl(raw, ir.Constant(g.ivec, [16] * g.vw)), g.vec))
    return out


def _pair_weights(builder, g, w_ptr, index):
    """Rows k and k + 1 of a bfloat16 slab, their pair row at uint16 element `index`:
    (row k's vectors, row k + 1's), widened exactly (a bfloat16 is a float32's top half)."""
    even, odd = [], []
    high = ir.Constant(g.ivec, [-65536] * g.vw)               # 0xFFFF0000
    for j in range(g.nv):
        raw = load_vec(builder, w_ptr, builder.add(index, const(2 * j * g.vw)), g.ivec, 2)
        even.append(builder.bitcast(builder.shl(raw, ir.Constant(g.ivec, [16] * g.vw)), g.vec))
        odd.append(builder.bitcast(builder.and_(raw, high), g.vec))
    return even, odd


def _emit_float_loop(builder, g, fma, kind, mr, a_ptr, a_off, lda, w_ptr, w_off, ldw, kc):
    """The tile over kc rows of a float / 16-bit slab (rows ldw elements apart: NR in a
    packed weight; pairs of rows always 2 NR); returns the accumulators."""
    unroll = g.unroll(mr)
    sets = accumulators(builder, g, mr, unroll)
    args = (a_ptr, a_off, lda)
    if kind != "bf16":
        size = 4 if kind == "f32" else 2

        def step(k, accs):
            at = builder.add(w_off, builder.mul(k, ldw))
            prefetch(builder, w_ptr, builder.mul(builder.add(at, const(PREFETCH_BYTES // size)),
                                                 const(size)), weight_locality(mr))
            wv = _row_weights(builder, g, w_ptr, at, kind)
            _fma_row(builder, g, fma, *args, k, wv, accs)

        kmain = builder.mul(builder.sdiv(kc, const(unroll)), const(unroll))
        with counted(builder, const(0), kmain, unroll) as k0:
            for u in range(unroll):
                step(builder.add(k0, const(u)), sets[u])
        with counted(builder, kmain, kc, 1) as k1:
            step(k1, sets[0])
        return reduce_sets(builder, sets)

    # bfloat16 pairs: rows k, k + 1 go to the sets the row-by-row loop above gives them
    def pair(k, s0, s1):
        at = builder.add(w_off, builder.mul(k, const(NR)))
        prefetch(builder, w_ptr, builder.mul(builder.add(at, const(PREFETCH_BYTES // 2)), const(2)),
                 weight_locality(mr))
        even, odd = _pair_weights(builder, g, w_ptr, at)
        _fma_row(builder, g, fma, *args, k, even, s0)
        _fma_row(builder, g, fma, *args, builder.add(k, const(1)), odd, s1)

    step = max(unroll, 2)
    kmain = builder.mul(builder.sdiv(kc, const(step)), const(step))
    with counted(builder, const(0), kmain, step) as k0:
        for u in range(0, step, 2):
            pair(builder.add(k0, const(u)), sets[u % unroll], sets[(u + 1) % unroll])
    last = builder.sub(kc, const(1))
    with counted(builder, kmain, last, 2) as k1:             # the rest in set 0, in order
        pair(k1, sets[0], sets[0])
    with builder.if_then(builder.icmp_signed("!=", builder.and_(kc, const(1)), const(0))):
        even, _ = _pair_weights(builder, g, w_ptr, builder.add(w_off, builder.mul(last, const(NR))))
        _fma_row(builder, g, fma, *args, last, even, sets[0])
    return reduce_sets(builder, sets)


K_KINDS = ("q4_k", "q5_k", "q6_k", "q6_kmin")   # the K-quants' records: float32 scales, bit planes
NIBBLE_KINDS = ("q4_0", "q4_1", *K_KINDS)  # a byte holds row r and row r + QB/2, a nibble each
KIND_CODES = {kind: code for code, kind in QUANT_CASES}
HALVES = ("q6_k", "q6_kmin")               # a scale a half block


def quant_record(kind):
    """(record bytes, offset of the quants in a record) of a quantized kind."""
    code = KIND_CODES[kind]
    return RECORD_BYTES[code], QUANTS_AT[code]


def quant_scales(builder, g, w_ptr, r0, kind):
    """(d, m) of a record at byte r0 as float32 vectors (Q4_0's m = -8 d; Q8_0: m None).
    Q6_K: the low half's (halves_scales has both)."""
    if kind in K_KINDS:
        return halves_scales(builder, g, w_ptr, r0, kind)[0]
    half = ir.VectorType(ir.HalfType(), g.vw)
    d = [builder.fpext(load_at_byte(builder, w_ptr, builder.add(r0, const(2 * j * g.vw)), half),
                       g.vec) for j in range(g.nv)]
    m = None
    if kind == "q4_1":
        m = [builder.fpext(load_at_byte(builder, w_ptr, builder.add(
            r0, const(SCALE_BYTES + 2 * j * g.vw)), half), g.vec) for j in range(g.nv)]
    elif kind == "q4_0":
        m = [builder.fmul(dj, ir.Constant(g.vec, [-8.0] * g.vw)) for dj in d]
    elif kind == "fp8":          # a code widens to its value / 256 (device/layout.py)
        d = [builder.fmul(dj, ir.Constant(g.vec, [256.0] * g.vw)) for dj in d]
    return d, m


def halves_scales(builder, g, w_ptr, r0, kind):
    """[(d, m) of rows 0..QB/2-1, (d, m) of rows QB/2..] of a nibble kind's record at byte r0,
    float32 vectors: value = fma(d, q, m). The same pair twice but for Q6_K, whose record
    holds a scale a half (m = -32 d), and Q6_K_MIN, a scale and a minimum a half."""
    if kind not in K_KINDS:
        return [quant_scales(builder, g, w_ptr, r0, kind)] * 2

    def wide(at):
        return [load_at_byte(builder, w_ptr, builder.add(r0, const(at + 4 * j * g.vw)), g.vec)
                for j in range(g.nv)]
    if kind == "q6_kmin":
        return [(wide(0), wide(WIDE_SCALE_BYTES)), (wide(2 * WIDE_SCALE_BYTES), wide(3 * WIDE_SCALE_BYTES))]
    if kind != "q6_k":
        return [(wide(0), wide(WIDE_SCALE_BYTES))] * 2
    minus32 = ir.Constant(g.vec, [-32.0] * g.vw)
    return [(d, [builder.fmul(dj, minus32) for dj in d]) for d in (wide(0), wide(WIDE_SCALE_BYTES))]


def nibble_quants(builder, g, kind, w_ptr, q0, x, j, high, gi):
    """The quants of 4 rows of a nibble kind's group (rows 4 gi.. of the record's low half, or
    of its high half), a byte each in 32-bit lanes, from the group's bytes x (vector j of the
    NR columns): Q4 the nibbles; Q5_K / Q6_K with their high bits from the planes after the
    nibbles (device/layout.py: a column's word w, byte t holds the hb bits of row 16 h + 4 g + t
    at bit (4 h + g) hb - 8 w)."""
    ivec = g.ivec

    def lanes(n):
        return ir.Constant(ivec, [n] * g.vw)
    nib = builder.and_(builder.lshr(x, lanes(4)) if high else x, lanes(0x0F0F0F0F))
    hb = HIGH_BITS[KIND_CODES[kind]]
    if not hb:
        return nib
    word = 1 if hb == 2 and high else 0
    at = builder.add(q0, const(NIBBLE_BYTES + word * GROUP_BYTES + 4 * j * g.vw))
    plane = load_at_byte(builder, w_ptr, at, ivec)
    shift = builder.mul(builder.add(gi, const(4 if high and hb == 1 else 0)), const(hb))
    bits = builder.and_(builder.lshr(plane, splat(builder, builder.trunc(shift, I32), ivec)),
                        lanes((1 << hb) - 1 | ((1 << hb) - 1) << 8 | ((1 << hb) - 1) << 16 | ((1 << hb) - 1) << 24))
    return builder.or_(nib, builder.shl(bits, lanes(4)))


def _emit_quant_loop(builder, g, fma, kind, mr, a_ptr, a_off, lda, w_ptr, w_off, ldw, kc):
    """The tile over kc rows (kc / QB records) of a block-quantized slab (w_ptr: i8*, w_off in
    bytes); returns the accumulators. Rows are taken in order and row k goes to accumulator
    set k % sets, as in the float loop, so the sums round alike."""
    unroll = g.unroll(mr)
    sets = accumulators(builder, g, mr, unroll)
    rec, q_start = quant_record(kind)

    def splat32(n):
        return ir.Constant(g.ivec, [n] * g.vw)

    with counted(builder, const(0), builder.sdiv(kc, const(QB)), 1) as b:
        r0 = builder.add(w_off, builder.mul(b, const(rec)))            # the record's first byte
        kb = builder.mul(b, const(QB))                                 # its first row of a
        d, m = quant_scales(builder, g, w_ptr, r0, kind)
        halves = halves_scales(builder, g, w_ptr, r0, kind) if kind in NIBBLE_KINDS else None
        q0 = builder.add(r0, const(q_start))

        def group(gi, high, u):
            """Rows 4g..4g+3 of the block (Q4: of its low or high nibbles), g = gi + u: each
            32-bit lane holds a column's 4 rows, one a byte."""
            gi = builder.add(gi, const(u))
            at = builder.add(q0, builder.mul(gi, const(GROUP_BYTES)))
            prefetch(builder, w_ptr, builder.add(at, const(PREFETCH_BYTES)), weight_locality(mr))
            raw = [load_at_byte(builder, w_ptr, builder.add(at, const(4 * j * g.vw)), g.ivec)
                   for j in range(g.nv)]
            if kind in NIBBLE_KINDS:              # 4 quants a lane, a byte each
                raw = [nibble_quants(builder, g, kind, w_ptr, q0, x, j, high, gi) for j, x in enumerate(raw)]
                dh, mh = halves[1 if high else 0]
            for t in range(4):
                if kind == "fp8":        # byte t as the float16 (sign << 15 | rest << 7)
                    b = [builder.lshr(x, splat32(8 * t)) for x in raw]
                    h = [builder.or_(builder.shl(builder.and_(v, splat32(0x80)), splat32(8)),
                                     builder.shl(builder.and_(v, splat32(0x7F)), splat32(7)))
                         for v in b]
                    wv = [builder.fmul(d[j], builder.fpext(builder.bitcast(builder.trunc(
                        v, ir.VectorType(I16, g.vw)), ir.VectorType(ir.HalfType(), g.vw)), g.vec))
                        for j, v in enumerate(h)]
                elif kind == "q8_0":
                    wv = [builder.fmul(d[j], builder.sitofp(builder.ashr(
                        builder.shl(x, splat32(24 - 8 * t)), splat32(24)), g.vec))
                        for j, x in enumerate(raw)]
                else:
                    wv = [builder.call(fma, [dh[j], builder.uitofp(builder.and_(
                        builder.lshr(x, splat32(8 * t)), splat32(255)), g.vec), mh[j]])
                        for j, x in enumerate(raw)]
                r = builder.add(builder.mul(gi, const(4)), const(t + (QB // 2 if high else 0)))
                _fma_row(builder, g, fma, a_ptr, a_off, lda, builder.add(kb, r), wv,
                         sets[(4 * u + t) % unroll])

        per = max(1, unroll // 4)                  # groups an iteration: row r in set r % unroll
        whole = kind in ("q8_0", "fp8")            # a byte a row (Q4: rows 0..15, then 16..31)
        for high in ((False,) if whole else (False, True)):
            with counted(builder, const(0), const(QB // 4 if whole else QB // 8), per) as gl:
                for u in range(per):
                    group(gl, high, u)
    return reduce_sets(builder, sets)


@intrinsic
def tile(typingctx, mr, a, a_off, lda, w, w_off, ldw, c, c_off, ldc, kc, accumulate, fmt):
    """The tile of mr rows (a height of this level: simd.tile_height); see the module
    docstring. ldw: elements between rows of a float32, float16 or bfloat16-rows weight (NR
    in a packed GEMM weight; a KV cache block's own stride in attention)."""
    if w.dtype not in (types.float32, types.uint16, types.uint8):
        return None
    i64 = types.int64
    sig = types.void(i64, a, i64, i64, w, i64, i64, c, i64, i64, i64, i64, i64)
    return sig, _tile_codegen(wide=False)


@intrinsic
def wide_tile(typingctx, mr, a, a_off, lda, w, w_off, ldw, c, c_off, ldc, kc, accumulate, fmt):
    """`tile` over simd.wide_cols() columns of rows ldw apart (mr a wide height:
    simd.wide_tile_height), float32, float16 or bfloat16 in plain rows (FMT_BF16R): a few
    rows (a decode row's query heads) over a KV cache block in one pass, a row of the block
    WIDE_VECTORS vectors, where NR-column tiles would pass it once a panel and a height."""
    if w.dtype not in (types.float32, types.uint16):
        return None
    i64 = types.int64
    sig = types.void(i64, a, i64, i64, w, i64, i64, c, i64, i64, i64, i64, i64)
    return sig, _tile_codegen(wide=True)


def _tile_codegen(wide):
    def codegen(context, builder, signature, args):
        g = geometry().wide() if wide else geometry()
        mr_v, a_v, a_off, lda, w_v, w_off, ldw, c_v, c_off, ldc, kc, accf, fmt_v = args
        a_ptr = array_ptr(context, builder, signature.args[1], a_v)
        w_ptr = array_ptr(context, builder, signature.args[4], w_v)
        c_ptr = array_ptr(context, builder, signature.args[7], c_v)
        fma = fma_fn(builder, g.vec)
        wdt = signature.args[4].dtype

        def height(mr):
            result = [[builder.alloca(g.vec) for _ in range(g.nv)] for _ in range(mr)]

            def emit(kind):
                loop = _emit_quant_loop if wdt == types.uint8 else _emit_float_loop
                got = loop(builder, g, fma, kind, mr, a_ptr, a_off, lda, w_ptr, w_off, ldw, kc)
                for i in range(mr):
                    for j in range(g.nv):
                        builder.store(builder.load(got[i][j]), result[i][j])

            if wdt == types.float32:
                emit("f32")
            elif wdt == types.uint16 and wide:
                choose(builder, fmt_v, [(FMT_F16, "f16"), (FMT_DLF16, "dlf16"),
                                        (FMT_BF16R, "bf16r")], emit)
            elif wdt == types.uint16:
                choose(builder, fmt_v, [(FMT_F16, "f16"), (FMT_DLF16, "dlf16"),
                                        (FMT_BF16R, "bf16r"), (FMT_BF16, "bf16")], emit)
            else:
                choose(builder, fmt_v, QUANT_CASES, emit)
            store_tile(builder, g, result, c_ptr, c_off, ldc, accf)

        by_height(builder, mr_v, g.heights, height)
        return context.get_dummy_value()

    return codegen
