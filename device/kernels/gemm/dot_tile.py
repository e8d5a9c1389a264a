"""The GEMM tile of bfloat16 weights on bfloat16 activations with AVX512_BF16's dot product
(vdpbf16ps): two products of bfloat16 pairs added into each float32 lane, as oneDNN's
avx512_core_bf16 kernels and the card's 16-bit units compute.

    dtile(mr, ab, a_off, lda, ks, w, w_off, c, c_off, ldc, kc, accumulate, far)
        c[mr, NR] (+)= ab[mr, kc] @ slab[kc, NR]

ab holds the activations as bfloat16 bits (uint16; row i's value k, k even, at a_off + i *
lda + k * ks and value k + 1 after it), rounded once per GEMM by device/kernels/gemm/inputs.py
in micro-panels (lda 2, ks PANEL_ROWS: a pair of every row of the panel in one 64-byte line,
so the tile reads one stream, not one per row); w is a bfloat16 weight in pairs of rows
(device/kernels/gemm/microkernel.py: column j's rows k and k + 1 in one 32-bit lane) and w_off its
slab's first element; kc is even. For each pair of rows the tile loads the NR columns' pairs
(one zmm) and, per row of the tile, broadcasts that row's pair of activations to every lane:
one vdpbf16ps adds a[i, k] w[k, j] + a[i, k + 1] w[k + 1, j] to lane j.

The tile asks for its weight's lines PREFETCH_BYTES ahead; a tile of FAR_MIN_ROWS rows or more
given `far` != 0 also asks, into L2, for the line `far` elements past the one it reads: the
next panel's, when its rows read this slab again from the caches (gemm/packed.py's second row
tile), so that the next panel's first tile does not wait on memory alone. Zen 4, 2 cores,
cold weights (40 copies in turn), in-process A/B of four interleaved runs, 32 rows: K x N =
576 x 3,072 1.01-1.08x, 1,536 x 576 1.00-1.15x, 576 x 960 0.99-1.04x, 576 x 49,152
1.03-1.08x; 1, 8 and 16 rows and 512 unchanged (one tile a slab, or a slab in L2 already).

Numerics (Intel's definition of the instruction): each product of two bfloat16 values is
exact in float32; the two are added to the lane one after the other, rounding to nearest
even, with denormal inputs and results flushed to zero. Pairs go round-robin to several
accumulator sets (a short tile's latency), summed at the end: sums differ from the float32
path's order, within float32 rounding of the same exact products.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from spyre_serve.device.kernels.simd import (
    BF16,
    NR,
    PREFETCH_BYTES,
    accumulators,
    array_ptr,
    by_height,
    const,
    counted,
    geometry,
    load_vec,
    prefetch,
    reduce_sets,
    splat,
    store_tile,
    weight_locality,
)

FAR_MIN_ROWS = 8     # tiles this tall or taller may ask for the next panel (`far`)


def _emit_dot_loop(builder, g, mr, ab_ptr, a_off, lda, ks, w_ptr, w_off, kc, far):
    sets_n = max(1, 8 // mr)
    sets = accumulators(builder, g, mr, sets_n)
    pairs = ir.VectorType(BF16, 2 * g.vw)
    dp = cgutils.get_or_insert_function(builder.module, ir.FunctionType(g.vec, [g.vec, pairs, pairs]),
                                        "llvm.x86.avx512bf16.dpbf16ps.512")
    i32p = ir.IntType(32).as_pointer()

    def pair(k, accs):
        at = builder.add(w_off, builder.mul(k, const(NR)))
        prefetch(builder, w_ptr, builder.mul(builder.add(at, const(PREFETCH_BYTES // 2)), const(2)),
                 weight_locality(mr))
        if mr >= FAR_MIN_ROWS:
            with builder.if_then(builder.icmp_signed("!=", far, const(0)), likely=True):
                prefetch(builder, w_ptr, builder.mul(builder.add(at, far), const(2)), 2)
        wv = [builder.bitcast(load_vec(builder, w_ptr, builder.add(at, const(2 * j * g.vw)), g.ivec,
                                       2), pairs) for j in range(g.nv)]
        for i, row in enumerate(accs):
            at = builder.add(builder.add(a_off, builder.mul(const(i), lda)), builder.mul(k, ks))
            word = builder.load(builder.bitcast(builder.gep(ab_ptr, [at]), i32p), align=2)
            av = builder.bitcast(splat(builder, word, g.ivec), pairs)
            for j, acc in enumerate(row):
                builder.store(builder.call(dp, [builder.load(acc), wv[j], av]), acc)

    step = 2 * sets_n
    kmain = builder.mul(builder.sdiv(kc, const(step)), const(step))
    with counted(builder, const(0), kmain, step) as k0:
        for s in range(sets_n):
            pair(builder.add(k0, const(2 * s)), sets[s])
    with counted(builder, kmain, kc, 2) as k1:
        pair(k1, sets[0])
    return reduce_sets(builder, sets)


@intrinsic
def dtile(typingctx, mr, ab, a_off, lda, ks, w, w_off, c, c_off, ldc, kc, accumulate, far):
    """The bfloat16 dot tile of mr rows (a height of this level); see the module docstring."""
    if ab.dtype != types.uint16:
        return None
    i64 = types.int64
    sig = types.void(i64, ab, i64, i64, i64, w, i64, c, i64, i64, i64, i64, i64)

    def codegen(context, builder, signature, args):
        g = geometry()
        if not g.bf16_dot or signature.args[5].dtype != types.uint16:
            return context.get_dummy_value()   # not this level's, or a weight of another
                                               # format (typed, never called)
        mr_v, ab_v, a_off, lda, ks, w_v, w_off, c_v, c_off, ldc, kc, accf, far = args
        ab_ptr = array_ptr(context, builder, signature.args[1], ab_v)
        w_ptr = array_ptr(context, builder, signature.args[5], w_v)
        c_ptr = array_ptr(context, builder, signature.args[7], c_v)

        def height(mr):
            accs = _emit_dot_loop(builder, g, mr, ab_ptr, a_off, lda, ks, w_ptr, w_off, kc, far)
            store_tile(builder, g, accs, c_ptr, c_off, ldc, accf)

        by_height(builder, mr_v, g.heights, height)
        return context.get_dummy_value()

    return sig, codegen
