"""The GEMM tile on 8- and 4-bit weights with int8 activations: integer dot products, as
llama.cpp's q8 activations do on the CPU (AVX2 and AVX-512BW: vpmaddubsw + vpmaddwd;
AVX512_VNNI: vpdpbusd, one instruction for both).

    itile(mr, aq, a_off, lda, ad, asum, s_off, lds, w, w_off, c, c_off, ldc, kc, accumulate, fmt)
        c[mr, NR] (+)= dequant(aq)[mr, kc] @ slab[kc, NR]

The activations come quantized per row in blocks of QB (device/kernels/gemm/packed.py's
quantize_rows): aq int8 (row i's value k at a_off + i * lda + k), ad the float32 scale of
each row's block (row i's block b at s_off + i * lds + b) and asum the sums of its int8 values,
the block's and its first half's (at twice that index and the one after).
The weights are a quantized slab in the layout of device/kernels/gemm/microkernel.py: each group of
4 rows is NR columns of 4 bytes, so a 32-bit lane holds 4 consecutive rows of one column and
one dot product against 4 activations broadcast to every lane gives the columns' 4-row sums
in int32. Per block of QB rows, per row i and column j:

    Q8_0  isum = sum_k q[k] aq[k]              (|q| against aq with q's sign: the unsigned
                                                 side of the instruction is the weight's; with
                                                 VNNI, q + 128 against aq as it is, and 128 x
                                                 the block's sum of aq taken off)
    Q4_x  isum = sum_k q[k] aq[k], q in 0..15  (unsigned as it is; Q4_0's -8 and Q4_1's m by
                                                 the activation's block sum)
    K     the same on the nibbles with their high bits (q in 0..31, 0..63: microkernel.py's
          nibble_quants); Q6_K's halves in two sums, each with its own scale, its -32 by the
          half's activation sum (the low half's from asum, the high one's the rest)
    c    += d[j] ad[i] isum  (+ m[j] ad[i] asum[i]; Q4_0: m = -8 d)

Exact integer sums (|products| stay below vpmaddubsw's int16 saturation: 2 * 128 * 127 for
Q8_0, 2 * 15 * 127 for Q4, 2 * 2 * 31 * 127 for Q5_K, 2 * 63 * 127 for a Q6_K half; vpdpbusd
does not saturate), then float32 scaling: the error
against the float32 GEMM on the dequantized weights is the activations' int8 rounding (a
step of ad / 2 per value). Every level gives the same int32 sums, so the same results.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from spyre_serve.device.kernels.formats import GROUP_BYTES
from spyre_serve.device.kernels.gemm.microkernel import (
    HALVES,
    K_KINDS,
    QUANT_CASES,
    halves_scales,
    nibble_quants,
    quant_record,
    quant_scales,
)
from spyre_serve.device.kernels.simd import (
    F32,
    I8,
    I16,
    I32,
    PREFETCH_BYTES,
    QB,
    array_ptr,
    by_height,
    choose,
    const,
    counted,
    fma_fn,
    geometry,
    load_at_byte,
    prefetch,
    splat,
    store_tile,
    weight_locality,
)

ROWS_AT_ONCE = 8     # rows of one pass at AVX-512 (int32 and float32 accumulators: 2 x 8 + 4)


class _Dot:
    """acc (<VW x i32>) += the 4-byte dot products of unsigned bytes u and signed bytes s,
    lane by lane, with the level's instructions."""

    def __init__(self, builder, g):
        self.b, self.g = builder, g
        fn = cgutils.get_or_insert_function
        m = builder.module
        n = 4 * g.vw
        self.bytes = ir.VectorType(I8, n)
        self.words = ir.VectorType(I16, n // 2)
        self.ones = ir.Constant(self.words, [1] * (n // 2))
        if g.vnni:
            self.dpbusd = fn(m, ir.FunctionType(g.ivec, [g.ivec, g.ivec, g.ivec]),
                             "llvm.x86.avx512.vpdpbusd.512")
        else:
            suffix = "avx512.pmaddubs.w.512" if g.vw == 16 else "avx2.pmadd.ub.sw"
            self.maddubs = fn(m, ir.FunctionType(self.words, [self.bytes, self.bytes]),
                              f"llvm.x86.{suffix}")
            suffix = "avx512.pmaddw.d.512" if g.vw == 16 else "avx2.pmadd.wd"
            self.maddwd = fn(m, ir.FunctionType(g.ivec, [self.words, self.words]),
                             f"llvm.x86.{suffix}")

    def add(self, acc, pairs):
        """acc += pairs of (unsigned, signed) byte vectors, summed in one int32 lane per 4."""
        b = self.b
        if self.g.vnni:
            val = b.load(acc)
            for u, s in pairs:
                val = b.call(self.dpbusd, [val, b.bitcast(u, self.g.ivec), b.bitcast(s, self.g.ivec)])
            b.store(val, acc)
            return
        words = None
        for u, s in pairs:                 # at most 2 pairs: |sum| <= 2 * 2 * 15 * 127 for Q4
            w = b.call(self.maddubs, [u, s])
            words = w if words is None else b.add(words, w)
        b.store(b.add(b.load(acc), b.call(self.maddwd, [words, self.ones])), acc)

    def signed_by(self, a, w):
        """a with the sign of w applied (w < 0: -a), bytewise: |w| * that = w * a (AVX2's
        vpsignb also zeroes a where w is 0, where |w| is 0 anyway)."""
        b = self.b
        if self.g.vw == 8:
            psign = cgutils.get_or_insert_function(
                b.module, ir.FunctionType(self.bytes, [self.bytes, self.bytes]), "llvm.x86.avx2.psign.b")
            return b.call(psign, [a, w])
        zero = ir.Constant(self.bytes, [0] * self.bytes.count)
        return b.select(b.icmp_signed("<", w, zero), b.sub(zero, a), a)

    def magnitude(self, w):
        abs_fn = cgutils.get_or_insert_function(
            self.b.module, ir.FunctionType(self.bytes, [self.bytes, ir.IntType(1)]),
            f"llvm.abs.v{self.bytes.count}i8")
        return self.b.call(abs_fn, [w, ir.Constant(ir.IntType(1), 0)])


def _emit_int8_loop(builder, g, kind, rows, aq_ptr, a_off, lda, ad_ptr, as_ptr, s_off, lds,
                    w_ptr, w_off, c_acc, kc):
    """Adds every block's scaled integer dot products into the float accumulators c_acc of
    the tile's rows `rows` (a range)."""
    dot = _Dot(builder, g)
    fma = fma_fn(builder, g.vec)
    rec, q_start = quant_record(kind)
    low4 = ir.Constant(dot.bytes, [15] * dot.bytes.count)
    high_bit = ir.Constant(dot.bytes, [-128] * dot.bytes.count)
    zero = ir.Constant(g.ivec, [0] * g.vw)
    halves = kind in HALVES      # a scale a half block: the halves' sums apart
    offset = kind == "q8_0" and g.vnni    # Q8_0's q + 128 as vpdpbusd's unsigned side
    with counted(builder, const(0), builder.sdiv(kc, const(QB)), 1) as b:
        r0 = builder.add(w_off, builder.mul(b, const(rec)))
        q0 = builder.add(r0, const(q_start))
        kb = builder.mul(b, const(QB))
        iacc = {i: [cgutils.alloca_once_value(builder, zero) for _ in range(g.nv)] for i in rows}
        hacc = {i: [cgutils.alloca_once_value(builder, zero) for _ in range(g.nv)] for i in rows} \
            if halves else iacc

        def broadcast4(i, row):
            """aq[i, kb + row .. + 3] in every 32-bit lane, as bytes."""
            at = builder.add(builder.add(a_off, builder.mul(const(i), lda)), builder.add(kb, row))
            word = builder.load(builder.bitcast(builder.gep(aq_ptr, [at]), I32.as_pointer()), align=1)
            return builder.bitcast(splat(builder, word, g.ivec), dot.bytes)

        def group(gi):
            at = builder.add(builder.add(r0, const(q_start)), builder.mul(gi, const(GROUP_BYTES)))
            prefetch(builder, w_ptr, builder.add(at, const(PREFETCH_BYTES)), weight_locality(len(rows)))
            raw = [builder.bitcast(load_at_byte(builder, w_ptr, builder.add(at, const(4 * j * g.vw)),
                                                g.ivec), dot.bytes) for j in range(g.nv)]
            row = builder.mul(gi, const(4))
            if kind == "q8_0":
                if offset:                     # q + 128 unsigned against aq as it is
                    shifted = [builder.xor(x, high_bit) for x in raw]

                    def pair(j, av):
                        return shifted[j], av
                else:                          # |q| against aq with q's sign
                    mags = [dot.magnitude(x) for x in raw]

                    def pair(j, av):
                        return mags[j], dot.signed_by(av, raw[j])
                for i in rows:
                    av = broadcast4(i, row)
                    for j in range(g.nv):
                        dot.add(iacc[i][j], [pair(j, av)])
                return
            if kind in K_KINDS:     # the nibbles with their high bits, 4 quants a lane
                lo, hi = ([builder.bitcast(nibble_quants(builder, g, kind, w_ptr, q0, builder.bitcast(x, g.ivec),
                                                         j, high, gi), dot.bytes) for j, x in enumerate(raw)]
                          for high in (False, True))
            else:
                lo = [builder.and_(x, low4) for x in raw]
                hi = [builder.and_(builder.bitcast(builder.lshr(builder.bitcast(x, dot.words),
                                                                ir.Constant(dot.words, [4] * dot.words.count)),
                                                   dot.bytes), low4) for x in raw]
            for i in rows:
                a_lo = broadcast4(i, row)
                a_hi = broadcast4(i, builder.add(row, const(QB // 2)))
                for j in range(g.nv):
                    if halves:
                        dot.add(iacc[i][j], [(lo[j], a_lo)])
                        dot.add(hacc[i][j], [(hi[j], a_hi)])
                    else:
                        dot.add(iacc[i][j], [(lo[j], a_lo), (hi[j], a_hi)])

        with counted(builder, const(0), const(QB // 4 if kind == "q8_0" else QB // 8), 1) as gl:
            group(gl)

        if halves:
            (d, m), (d_hi, m_hi) = halves_scales(builder, g, w_ptr, r0, kind)
        else:
            d, m = quant_scales(builder, g, w_ptr, r0, kind)
        for i in rows:
            s_at = builder.add(builder.add(s_off, builder.mul(const(i), lds)), b)
            ad = builder.load(builder.gep(ad_ptr, [s_at]))
            scale = splat(builder, ad, g.vec)
            sums_at = builder.mul(s_at, const(2))     # asum: [block, its first half] a block
            if offset or kind != "q8_0":
                block_sum = builder.load(builder.gep(as_ptr, [sums_at]))
            offset_sum = None
            if offset:                        # the sums hold 128 x the block's sum too
                offset_sum = splat(builder, builder.fmul(block_sum, ir.Constant(F32, 128.0)), g.vec)
            if kind != "q8_0":
                if halves:          # the activations' sums of each half (the minimums' terms)
                    low_sum = builder.load(builder.gep(as_ptr, [builder.add(sums_at, const(1))]))
                    asum_hi = splat(builder, builder.fmul(ad, builder.fsub(block_sum, low_sum)), g.vec)
                    block_sum = low_sum
                asum = splat(builder, builder.fmul(ad, block_sum), g.vec)
            for j in range(g.nv):
                acc = c_acc[i][j]
                isum = builder.sitofp(builder.load(iacc[i][j]), g.vec)
                if offset_sum is not None:   # exact: both below 2^24 in magnitude
                    isum = builder.fsub(isum, offset_sum)
                val = builder.call(fma, [isum, builder.fmul(d[j], scale), builder.load(acc)])
                if kind != "q8_0":
                    val = builder.call(fma, [m[j], asum, val])
                if halves:
                    hsum = builder.sitofp(builder.load(hacc[i][j]), g.vec)
                    val = builder.call(fma, [hsum, builder.fmul(d_hi[j], scale), val])
                    val = builder.call(fma, [m_hi[j], asum_hi, val])
                builder.store(val, acc)


@intrinsic
def itile(typingctx, mr, aq, a_off, lda, ad, asum, s_off, lds, w, w_off, c, c_off, ldc, kc,
          accumulate, fmt):
    """The int8-activation tile of mr rows (a height of this level); see the module docstring."""
    if aq.dtype != types.int8:
        return None
    i64 = types.int64
    sig = types.void(i64, aq, i64, i64, ad, asum, i64, i64, w, i64, c, i64, i64, i64, i64, i64)

    def codegen(context, builder, signature, args):
        g = geometry()
        if signature.args[8].dtype != types.uint8:
            return context.get_dummy_value()    # a float weight: typed, never called
        (mr_v, aq_v, a_off, lda, ad_v, as_v, s_off, lds, w_v, w_off, c_v, c_off, ldc, kc, accf,
         fmt_v) = args
        aq_ptr, ad_ptr, as_ptr, w_ptr, c_ptr = (
            array_ptr(context, builder, signature.args[n], v)
            for n, v in ((1, aq_v), (4, ad_v), (5, as_v), (8, w_v), (10, c_v)))

        def height(mr):
            zero = ir.Constant(g.vec, [0.0] * g.vw)
            c_acc = [[cgutils.alloca_once_value(builder, zero) for _ in range(g.nv)]
                     for _ in range(mr)]
            # AVX-512: rows in passes of ROWS_AT_ONCE, each over the slab (in L1), so that the
            # int32 sums, the float sums and the weights stay in the 32 registers
            step = ROWS_AT_ONCE if g.vw == 16 else mr
            for r in range(0, mr, step):
                rows = range(r, min(mr, r + step))

                def emit(kind, rows=rows):
                    _emit_int8_loop(builder, g, kind, rows, aq_ptr, a_off, lda, ad_ptr, as_ptr,
                                    s_off, lds, w_ptr, w_off, c_acc, kc)
                choose(builder, fmt_v, [(code, kind) for code, kind in QUANT_CASES if kind != "fp8"], emit)
            store_tile(builder, g, c_acc, c_ptr, c_off, ldc, accf)

        by_height(builder, mr_v, g.heights, height)
        return context.get_dummy_value()

    return sig, codegen
