"""The GEMM's innermost loop, emitted as LLVM vector IR: one MR x NR tile of `out` in registers.

    tile(a, a_off, lda, w, w_off, c, c_off, ldc, kc, accumulate, fmt)
        c[mr, NR] (+)= a[mr, kc] @ slab[kc, NR]

a and c are 1-D float32 arrays addressed by element offsets and row strides; w is a packed
weight (device/kernels/gemm.py describes the layouts) and w_off the first element of the slab:

- float32 (FMT_F32) or uint16 holding bfloat16 / float16 bits (FMT_BF16 / FMT_F16): the slab
  is kc rows of NR values, widened to float32 right after the load;
- uint8 block-quantized (FMT_Q8_0 / FMT_Q4_0 / FMT_Q4_1, GGML's formats in panels): the slab
  is kc / QB records of QB rows, each record the NR float16 scales `d` (Q4_1: then the NR
  float16 minimums `m`), then the quants in groups of 4 rows, each group NR columns of 4
  bytes (column j's rows 4g..4g+3, the layout integer dot products read, 4 products to a
  32-bit lane: device/kernels/int8_tile.py): Q8_0 QB/4 groups of int8; Q4_0/Q4_1 QB/8
  groups whose bytes hold row r in the low nibble and row r + QB/2 in the high one. kc is a
  multiple of QB.
  Each weight is widened in registers to exactly the value GGML's dequantizer gives
  (Q8_0 d*q; Q4_0 d*(q-8) = fma(d, q, -8d); Q4_1 fma(d, q, m): d*q is exact in float32),
  so the products are those of the float32 GEMM on the dequantized weights.

For each k the tile loads the NR weights of that row, broadcasts one value of `a` per row
and does MR x NR fused multiply-adds. With NR = 16 and 8-wide vectors (AVX2: 16 registers)
MR = 6 uses 12 accumulators, 2 weight vectors and a broadcast. One row (a decode GEMV)
unrolls k by 4 into independent accumulators so that the FMA latency never limits the
stream of weights.
"""

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

NR = 16          # columns per panel
VW = 8           # float32 lanes per LLVM vector (a ymm register on AVX2)
MR = 6           # rows per microkernel tile
QB = 32          # rows per quantization block (GGML's QK8_0 / QK4_0 / QK4_1)

FMT_F32, FMT_BF16, FMT_F16, FMT_Q8_0, FMT_Q4_0, FMT_Q4_1 = range(6)
# bytes of one record (QB rows of one panel) of each block-quantized format
_SCALES = 2 * NR                                  # NR float16 values
GROUP_BYTES = 4 * NR                              # 4 rows of a panel, a column's 4 bytes together
RECORD_BYTES = {FMT_Q8_0: _SCALES + QB * NR, FMT_Q4_0: _SCALES + QB * NR // 2,
                FMT_Q4_1: 2 * _SCALES + QB * NR // 2}
REC_Q8_0, REC_Q4_0, REC_Q4_1 = (RECORD_BYTES[f] for f in (FMT_Q8_0, FMT_Q4_0, FMT_Q4_1))

_F32 = ir.FloatType()
_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_VEC = ir.VectorType(_F32, VW)


def _const(n: int) -> ir.Constant:
    return ir.Constant(_I64, n)


def _splat(builder, value):
    undef = ir.Constant(_VEC, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(_I32, VW), [0] * VW))


def _load_vec(builder, ptr, index, elem, align):
    """<VW x elem> at element `index` of ptr (an elem*-like pointer of any type)."""
    p = builder.gep(ptr, [index])
    return builder.load(builder.bitcast(p, ir.VectorType(elem, VW).as_pointer()), align=align)


def _load_weights(builder, w_ptr, index, kind):
    """<VW x float> of weights at element `index` of the packed array, widened if 16-bit."""
    if kind == "f32":
        return _load_vec(builder, w_ptr, index, _F32, 4)
    if kind == "f16":
        return builder.fpext(_load_vec(builder, w_ptr, index, ir.HalfType(), 2), _VEC)
    raw = _load_vec(builder, w_ptr, index, _I16, 2)                     # bf16
    wide = builder.shl(builder.zext(raw, ir.VectorType(_I32, VW)),
                       ir.Constant(ir.VectorType(_I32, VW), [16] * VW))
    return builder.bitcast(wide, _VEC)


def _accumulators(builder, mr, nv, sets):
    zero = ir.Constant(_VEC, [0.0] * VW)
    return [[[cgutils.alloca_once_value(builder, zero) for _ in range(nv)] for _ in range(mr)]
            for _ in range(sets)]


def _fma_row(builder, fma, a_ptr, a_off, lda, k, wv, accs):
    """accs[i][j] += a[i, k] * wv[j] for every row i of the tile."""
    for i, row in enumerate(accs):
        ai = builder.add(builder.add(a_off, builder.mul(_const(i), lda)), k)
        av = _splat(builder, builder.load(builder.gep(a_ptr, [ai])))
        for j, acc in enumerate(row):
            builder.store(builder.call(fma, [av, wv[j], builder.load(acc)]), acc)


def _reduce_sets(builder, sets):
    """Sum every accumulator set into the first; returns it."""
    for other in sets[1:]:
        for row0, row in zip(sets[0], other, strict=True):
            for acc0, acc in zip(row0, row, strict=True):
                builder.store(builder.fadd(builder.load(acc0), builder.load(acc)), acc0)
    return sets[0]


def _emit_float_loop(builder, fma, kind, mr, unroll, a_ptr, a_off, lda, w_ptr, w_off, kc):
    """The tile over kc rows of a float / 16-bit slab; returns the accumulators."""
    nv = NR // VW
    sets = _accumulators(builder, mr, nv, unroll)

    def step(k, accs):
        base = builder.add(w_off, builder.mul(k, _const(NR)))
        wv = [_load_weights(builder, w_ptr, builder.add(base, _const(j * VW)), kind)
              for j in range(nv)]
        _fma_row(builder, fma, a_ptr, a_off, lda, k, wv, accs)

    kmain = builder.mul(builder.sdiv(kc, _const(unroll)), _const(unroll))
    with cgutils.for_range_slice(builder, _const(0), kmain, _const(unroll)) as (k0, _):
        for u in range(unroll):
            step(builder.add(k0, _const(u)), sets[u])
    with cgutils.for_range_slice(builder, kmain, kc, _const(1)) as (k1, _):
        step(k1, sets[0])
    return _reduce_sets(builder, sets)


def _emit_quant_loop(builder, fma, kind, mr, unroll, a_ptr, a_off, lda, w_ptr, w_off, kc):
    """The tile over kc rows (kc / QB records) of a block-quantized slab (w_ptr: i8*, w_off in
    bytes); returns the accumulators. Rows are taken in order and row k goes to accumulator
    set k % unroll, as in the float loop, so the sums round alike."""
    nv = NR // VW
    half = ir.HalfType()
    vi32 = ir.VectorType(_I32, VW)
    sets = _accumulators(builder, mr, nv, unroll)
    rec = {"q8_0": REC_Q8_0, "q4_0": REC_Q4_0, "q4_1": REC_Q4_1}[kind]
    q_start = 2 * _SCALES if kind == "q4_1" else _SCALES
    nblocks = builder.sdiv(kc, _const(QB))

    def splat32(n):
        return ir.Constant(vi32, [n] * VW)

    with cgutils.for_range(builder, nblocks) as loop:
        b = loop.index
        r0 = builder.add(w_off, builder.mul(b, _const(rec)))            # the record's first byte
        kb = builder.mul(b, _const(QB))                                 # its first row of a
        d = [builder.fpext(_load_vec(builder, w_ptr, builder.add(r0, _const(2 * j * VW)), half, 1),
                           _VEC) for j in range(nv)]
        if kind == "q4_1":
            m = [builder.fpext(_load_vec(builder, w_ptr, builder.add(r0, _const(_SCALES + 2 * j * VW)),
                                         half, 1), _VEC) for j in range(nv)]
        elif kind == "q4_0":
            m = [builder.fmul(dj, ir.Constant(_VEC, [-8.0] * VW)) for dj in d]
        q0 = builder.add(r0, _const(q_start))

        def group(g, high):
            """Rows 4g..4g+3 of the block (Q4: of its low or high nibbles): each <VW x i32>
            lane holds a column's 4 rows, one a byte."""
            at = builder.add(q0, builder.mul(g, _const(GROUP_BYTES)))
            raw = [_load_vec(builder, w_ptr, builder.add(at, _const(4 * j * VW)), _I32, 1)
                   for j in range(nv)]
            for t in range(4):
                if kind == "q8_0":
                    wv = [builder.fmul(d[j], builder.sitofp(builder.ashr(
                        builder.shl(x, splat32(24 - 8 * t)), splat32(24)), _VEC))
                        for j, x in enumerate(raw)]
                else:
                    shift = 8 * t + (4 if high else 0)
                    wv = [builder.call(fma, [d[j], builder.uitofp(builder.and_(
                        builder.lshr(x, splat32(shift)), splat32(15)), _VEC), m[j]])
                        for j, x in enumerate(raw)]
                r = builder.add(builder.mul(g, _const(4)), _const(t + (QB // 2 if high else 0)))
                _fma_row(builder, fma, a_ptr, a_off, lda, builder.add(kb, r), wv, sets[t % unroll])

        if kind == "q8_0":
            with cgutils.for_range(builder, _const(QB // 4)) as gl:
                group(gl.index, False)
        else:
            for high in (False, True):             # rows 0..15 (low nibbles), then 16..31
                with cgutils.for_range(builder, _const(QB // 8)) as gl:
                    group(gl.index, high)
    return _reduce_sets(builder, sets)


def store_tile(builder, accs, c_ptr, c_off, ldc, accumulate):
    """c[i, :NR] = accs[i] (accumulate != 0: += ) for every row i of the tile."""
    add = builder.icmp_signed("!=", accumulate, _const(0))
    for i, row_accs in enumerate(accs):
        row = builder.add(c_off, builder.mul(_const(i), ldc))
        for j, acc in enumerate(row_accs):
            p = builder.bitcast(builder.gep(c_ptr, [builder.add(row, _const(j * VW))]),
                                _VEC.as_pointer())
            val = builder.load(acc)
            val = builder.select(add, builder.fadd(val, builder.load(p, align=4)), val)
            builder.store(val, p, align=4)


def _microkernel(mr: int):
    """The tile intrinsic for tiles of mr rows (see the module docstring)."""
    nv = NR // VW
    unroll = 4 if mr == 1 else 2 if mr == 2 else 1

    def branches(builder, fmt_v, kinds, emit):
        """Emit one loop per (fmt code, kind), chosen at run time by fmt; the accumulators."""
        result = [[cgutils.alloca_once(builder, _VEC) for _ in range(nv)] for _ in range(mr)]

        def emit_into(kind):
            got = emit(kind)
            for i in range(mr):
                for j in range(nv):
                    builder.store(builder.load(got[i][j]), result[i][j])

        def choose(rest):
            code, kind = rest[0]
            if len(rest) == 1:
                emit_into(kind)
                return
            with builder.if_else(builder.icmp_signed("==", fmt_v, _const(code))) as (then, other):
                with then:
                    emit_into(kind)
                with other:
                    choose(rest[1:])

        choose(kinds)
        return result

    @intrinsic
    def tile(typingctx, a, a_off, lda, w, w_off, c, c_off, ldc, kc, accumulate, fmt):
        if w.dtype not in (types.float32, types.uint16, types.uint8):
            return None
        i64 = types.int64
        sig = types.void(a, i64, i64, w, i64, c, i64, i64, i64, i64, i64)

        def codegen(context, builder, signature, args):
            a_v, a_off, lda, w_v, w_off, c_v, c_off, ldc, kc, accf, fmt_v = args
            a_ptr = context.make_array(signature.args[0])(context, builder, a_v).data
            w_ptr = context.make_array(signature.args[3])(context, builder, w_v).data
            c_ptr = context.make_array(signature.args[5])(context, builder, c_v).data
            fma = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(_VEC, [_VEC, _VEC, _VEC]), f"llvm.fma.v{VW}f32")
            wdt = signature.args[3].dtype
            if wdt == types.float32:
                accs = _emit_float_loop(builder, fma, "f32", mr, unroll, a_ptr, a_off, lda,
                                        w_ptr, w_off, kc)
            elif wdt == types.uint16:
                accs = branches(builder, fmt_v, [(FMT_F16, "f16"), (FMT_BF16, "bf16")],
                                lambda kind: _emit_float_loop(builder, fma, kind, mr, unroll, a_ptr,
                                                              a_off, lda, w_ptr, w_off, kc))
            else:
                accs = branches(builder, fmt_v,
                                [(FMT_Q8_0, "q8_0"), (FMT_Q4_0, "q4_0"), (FMT_Q4_1, "q4_1")],
                                lambda kind: _emit_quant_loop(builder, fma, kind, mr, unroll, a_ptr,
                                                              a_off, lda, w_ptr, w_off, kc))
            store_tile(builder, accs, c_ptr, c_off, ldc, accf)
            return context.get_dummy_value()

        return sig, codegen

    return tile


_tile1, _tile2, _tile3, _tile4, _tile5, _tile6 = (_microkernel(m) for m in range(1, MR + 1))


@njit(nogil=True, cache=True, inline="always")
def tile(mr, a, a_off, lda, w, w_off, c, c_off, ldc, kc, acc, fmt):
    """The tile of mr (1..MR) rows: the intrinsic of that height."""
    if mr == 6:
        _tile6(a, a_off, lda, w, w_off, c, c_off, ldc, kc, acc, fmt)
    elif mr == 5:
        _tile5(a, a_off, lda, w, w_off, c, c_off, ldc, kc, acc, fmt)
    elif mr == 4:
        _tile4(a, a_off, lda, w, w_off, c, c_off, ldc, kc, acc, fmt)
    elif mr == 3:
        _tile3(a, a_off, lda, w, w_off, c, c_off, ldc, kc, acc, fmt)
    elif mr == 2:
        _tile2(a, a_off, lda, w, w_off, c, c_off, ldc, kc, acc, fmt)
    else:
        _tile1(a, a_off, lda, w, w_off, c, c_off, ldc, kc, acc, fmt)
