"""The GEMM tile on 8- and 4-bit weights with int8 activations: integer dot products (AVX2's
vpmaddubsw / vpmaddwd), as llama.cpp's q8 activations do on the CPU.

    itile(aq, a_off, lda, ad, asum, s_off, lds, w, w_off, c, c_off, ldc, kc, accumulate, fmt)
        c[mr, NR] (+)= dequant(aq)[mr, kc] @ slab[kc, NR]

The activations come quantized per row in blocks of QB (device/kernels/gemm.py's
quantize_rows): aq int8 (row i's value k at a_off + i * lda + k), ad the float32 scale of
each row's block and asum the sum of its int8 values (row i's block b at s_off + i * lds + b).
The weights are a quantized slab in the layout of device/kernels/microkernel.py: each group of
4 rows is NR columns of 4 bytes, so a 32-bit lane holds 4 consecutive rows of one column and
one vpmaddubsw + vpmaddwd against 4 activations broadcast to every lane gives 8 columns'
4-row dot products in int32. Per block of QB rows, per row i and column j:

    Q8_0  isum = sum_k q[k] aq[k]              (|q| by vpsignb's sign on aq: vpmaddubsw needs
                                                 one unsigned side)
    Q4_x  isum = sum_k q[k] aq[k], q in 0..15  (unsigned as it is; Q4_0's -8 and Q4_1's m by
                                                 the activation's block sum)
    c    += d[j] ad[i] isum  (+ m[j] ad[i] asum[i]; Q4_0: m = -8 d)

Exact integer sums (|products| stay below vpmaddubsw's int16 saturation: 2 * 128 * 127 for
Q8_0, 2 * 15 * 127 for Q4), then float32 scaling: the error against the float32 GEMM on the
dequantized weights is the activations' int8 rounding (a step of ad / 2 per value).
"""

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from spyre_serve.device.kernels.microkernel import (
    _I8,
    _I32,
    _SCALES,
    _VEC,
    FMT_Q4_1,
    FMT_Q8_0,
    GROUP_BYTES,
    MR,
    NR,
    QB,
    REC_Q4_0,
    REC_Q4_1,
    REC_Q8_0,
    VW,
    _const,
    _load_vec,
    _splat,
    store_tile,
)

_I16 = ir.IntType(16)
_V32I8 = ir.VectorType(_I8, 32)
_V16I16 = ir.VectorType(_I16, 16)
_V8I32 = ir.VectorType(_I32, 8)


def _intrinsics(module):
    fn = cgutils.get_or_insert_function
    return {
        "maddubs": fn(module, ir.FunctionType(_V16I16, [_V32I8, _V32I8]), "llvm.x86.avx2.pmadd.ub.sw"),
        "maddwd": fn(module, ir.FunctionType(_V8I32, [_V16I16, _V16I16]), "llvm.x86.avx2.pmadd.wd"),
        "sign": fn(module, ir.FunctionType(_V32I8, [_V32I8, _V32I8]), "llvm.x86.avx2.psign.b"),
        "abs": fn(module, ir.FunctionType(_V32I8, [_V32I8, ir.IntType(1)]), "llvm.abs.v32i8"),
        "fma": fn(module, ir.FunctionType(_VEC, [_VEC, _VEC, _VEC]), f"llvm.fma.v{VW}f32"),
    }


def _emit_int8_loop(builder, fn, kind, mr, aq_ptr, a_off, lda, ad_ptr, as_ptr, s_off, lds,
                    w_ptr, w_off, c_acc, kc):
    """Adds every block's scaled integer dot products into the float accumulators c_acc."""
    nv = NR // VW
    assert VW == 8, "one vpmaddwd result is 8 int32 lanes"
    half = ir.HalfType()
    rec = {"q8_0": REC_Q8_0, "q4_0": REC_Q4_0, "q4_1": REC_Q4_1}[kind]
    q_start = 2 * _SCALES if kind == "q4_1" else _SCALES
    ones = ir.Constant(_V16I16, [1] * 16)
    low4 = ir.Constant(_V32I8, [15] * 32)
    zero = ir.Constant(_V8I32, [0] * 8)
    with cgutils.for_range(builder, builder.sdiv(kc, _const(QB))) as loop:
        b = loop.index
        r0 = builder.add(w_off, builder.mul(b, _const(rec)))
        kb = builder.mul(b, _const(QB))
        iacc = [[cgutils.alloca_once_value(builder, zero) for _ in range(nv)] for _ in range(mr)]

        def broadcast4(i, row):
            """aq[i, kb + row .. + 3] in every 32-bit lane, as bytes."""
            at = builder.add(builder.add(a_off, builder.mul(_const(i), lda)), builder.add(kb, row))
            word = builder.load(builder.bitcast(builder.gep(aq_ptr, [at]), _I32.as_pointer()), align=1)
            lanes = builder.insert_element(ir.Constant(_V8I32, ir.Undefined), word, ir.Constant(_I32, 0))
            lanes = builder.shuffle_vector(lanes, ir.Constant(_V8I32, ir.Undefined),
                                           ir.Constant(_V8I32, [0] * 8))
            return builder.bitcast(lanes, _V32I8)

        def add_dot(acc, pairs):
            builder.store(builder.add(builder.load(acc), builder.call(fn["maddwd"], [pairs, ones])), acc)

        def group(g):
            at = builder.add(builder.add(r0, _const(q_start)), builder.mul(g, _const(GROUP_BYTES)))
            raw = [_load_vec(builder, w_ptr, builder.add(at, _const(32 * j)), _I32, 1)
                   for j in range(nv)]
            raw = [builder.bitcast(x, _V32I8) for x in raw]
            row = builder.mul(g, _const(4))
            if kind == "q8_0":
                mags = [builder.call(fn["abs"], [x, ir.Constant(ir.IntType(1), 0)]) for x in raw]
                for i in range(mr):
                    av = broadcast4(i, row)
                    for j in range(nv):
                        signed = builder.call(fn["sign"], [av, raw[j]])
                        add_dot(iacc[i][j], builder.call(fn["maddubs"], [mags[j], signed]))
                return
            lo = [builder.and_(x, low4) for x in raw]
            hi = [builder.and_(builder.bitcast(builder.lshr(builder.bitcast(x, _V16I16),
                                                            ir.Constant(_V16I16, [4] * 16)), _V32I8), low4)
                  for x in raw]
            for i in range(mr):
                a_lo = broadcast4(i, row)
                a_hi = broadcast4(i, builder.add(row, _const(QB // 2)))
                for j in range(nv):
                    pairs = builder.add(builder.call(fn["maddubs"], [lo[j], a_lo]),
                                        builder.call(fn["maddubs"], [hi[j], a_hi]))
                    add_dot(iacc[i][j], pairs)

        with cgutils.for_range(builder, _const(QB // 4 if kind == "q8_0" else QB // 8)) as gl:
            group(gl.index)

        d = [builder.fpext(_load_vec(builder, w_ptr, builder.add(r0, _const(2 * j * VW)), half, 1),
                           _VEC) for j in range(nv)]
        if kind == "q4_1":
            m = [builder.fpext(_load_vec(builder, w_ptr, builder.add(r0, _const(_SCALES + 2 * j * VW)),
                                         half, 1), _VEC) for j in range(nv)]
        elif kind == "q4_0":
            m = [builder.fmul(dj, ir.Constant(_VEC, [-8.0] * VW)) for dj in d]
        for i in range(mr):
            s_at = builder.add(builder.add(s_off, builder.mul(_const(i), lds)), b)
            ad = builder.load(builder.gep(ad_ptr, [s_at]))
            scale = _splat(builder, ad)
            if kind != "q8_0":
                asum = _splat(builder, builder.fmul(ad, builder.load(builder.gep(as_ptr, [s_at]))))
            for j in range(nv):
                acc = c_acc[i][j]
                dot = builder.sitofp(builder.load(iacc[i][j]), _VEC)
                val = builder.call(fn["fma"], [dot, builder.fmul(d[j], scale), builder.load(acc)])
                if kind != "q8_0":
                    val = builder.call(fn["fma"], [m[j], asum, val])
                builder.store(val, acc)


def _int8_tile(mr: int):
    nv = NR // VW

    @intrinsic
    def itile(typingctx, aq, a_off, lda, ad, asum, s_off, lds, w, w_off, c, c_off, ldc, kc,
              accumulate, fmt):
        if aq.dtype != types.int8:
            return None
        i64 = types.int64
        sig = types.void(aq, i64, i64, ad, asum, i64, i64, w, i64, c, i64, i64, i64, i64, i64)

        def codegen(context, builder, signature, args):
            if signature.args[7].dtype != types.uint8:
                return context.get_dummy_value()    # a float weight: never called (typed only)
            (aq_v, a_off, lda, ad_v, as_v, s_off, lds, w_v, w_off, c_v, c_off, ldc, kc, accf,
             fmt_v) = args
            ptr = [context.make_array(signature.args[n])(context, builder, v).data
                   for n, v in ((0, aq_v), (3, ad_v), (4, as_v), (7, w_v), (9, c_v))]
            aq_ptr, ad_ptr, as_ptr, w_ptr, c_ptr = ptr
            fn = _intrinsics(builder.module)
            zero = ir.Constant(_VEC, [0.0] * VW)
            c_acc = [[cgutils.alloca_once_value(builder, zero) for _ in range(nv)] for _ in range(mr)]
            loop = (mr, aq_ptr, a_off, lda, ad_ptr, as_ptr, s_off, lds, w_ptr, w_off, c_acc, kc)
            with builder.if_else(builder.icmp_signed("==", fmt_v, _const(FMT_Q8_0))) as (q8, q4):
                with q8:
                    _emit_int8_loop(builder, fn, "q8_0", *loop)
                with q4:
                    with builder.if_else(builder.icmp_signed("==", fmt_v, _const(FMT_Q4_1))) as (a, b):
                        with a:
                            _emit_int8_loop(builder, fn, "q4_1", *loop)
                        with b:
                            _emit_int8_loop(builder, fn, "q4_0", *loop)
            store_tile(builder, c_acc, c_ptr, c_off, ldc, accf)
            return context.get_dummy_value()

        return sig, codegen

    return itile


_itile1, _itile2, _itile3, _itile4, _itile5, _itile6 = (_int8_tile(m) for m in range(1, MR + 1))


@njit(nogil=True, cache=True, inline="always")
def itile(mr, aq, a_off, lda, ad, asum, s_off, lds, w, w_off, c, c_off, ldc, kc, acc, fmt):
    """The int8-activation tile of mr (1..MR) rows: the intrinsic of that height."""
    if mr == 6:
        _itile6(aq, a_off, lda, ad, asum, s_off, lds, w, w_off, c, c_off, ldc, kc, acc, fmt)
    elif mr == 5:
        _itile5(aq, a_off, lda, ad, asum, s_off, lds, w, w_off, c, c_off, ldc, kc, acc, fmt)
    elif mr == 4:
        _itile4(aq, a_off, lda, ad, asum, s_off, lds, w, w_off, c, c_off, ldc, kc, acc, fmt)
    elif mr == 3:
        _itile3(aq, a_off, lda, ad, asum, s_off, lds, w, w_off, c, c_off, ldc, kc, acc, fmt)
    elif mr == 2:
        _itile2(aq, a_off, lda, ad, asum, s_off, lds, w, w_off, c, c_off, ldc, kc, acc, fmt)
    else:
        _itile1(aq, a_off, lda, ad, asum, s_off, lds, w, w_off, c, c_off, ldc, kc, acc, fmt)
