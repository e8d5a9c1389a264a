"""The GEMM block of bfloat16 weights on bfloat16 activations with AMX (Intel's Advanced Matrix
Extensions, Sapphire Rapids and later): tile registers of 16 rows x 64 bytes and a matrix
unit that multiplies them (tdpbf16ps), as oneDNN's avx512_core_amx kernels do.

    amx_rows(ab, a_off, lda, rows, w, w_off0, w_off1, pair_step, pairs, kp, c, c_off, ldc)
        c[rows, 32 j: 32 j + 32] = ab[rows, kp] @ [slab0 | slab1] of pair j < pairs
                                       (rows 1..32; byte offsets and strides)
    amx_strips(a, a_off, lda, row_tiles, b, b_off, ldb, kt, nt, c, c_off, ldc, accumulate)
        c (+)= a @ b over tiles of 16 rows and up to 4 tiles of 16 columns, B at any row
        stride: attention's blocks (device/kernels/attention/paged.py)
    interleave_rows(dst, dst_off, src, a_off, b_off, n)
        two rows of bfloat16 (or float32, rounded) into one row of AMX's B layout

ab holds the activations as bfloat16 bits, row-major, lda bytes a row (device/kernels/gemm/packed.py
rounds them once per GEMM; kp a multiple of 32, zero-padded); w a bfloat16 weight in pairs of
rows (device/kernels/gemm/microkernel.py), w_off0 and w_off1 the byte offsets of two panels' first
rows (a B tile is 16 pairs of rows of a panel: 1 KiB, contiguous, 64 bytes a row: AMX's own
layout for B); c float32 [32, 32] (128 bytes a row), written whole for the rows computed.

Eight tile registers: C00 C01 C10 C11 (rows 0-15 / 16-31, panel 0 / 1), A0 A1 (the two row
blocks' next 32 values of k), B0 B1 (the two panels' next 32 rows). Per 32 values of k: two
A loads, two B loads, four tdpbf16ps (16 x 16 x 32 products each). Up to 16 rows, only the
first row block's tiles are configured and used.

Numerics (Intel's definition): each product of two bfloat16 values is exact in float32; a
C element adds the pair's two products to itself one after the other, rounding to nearest
even, denormals flushed to zero; k is summed in order, 2 at a time.

The tile state is the thread's: each call loads its configuration (ldtilecfg, once for all its
pairs) and `amx_release` (tilerelease) returns the state once a thread is done. Linux hands the state
to the process only when asked (device/isa.py asks when it selects the amx level).
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from spyre_serve.device.kernels.formats import bf16_narrow_ir
from spyre_serve.device.kernels.simd import (
    I8,
    I16,
    I32,
    I64,
    PREFETCH_BYTES,
    array_ptr,
    byte_ptr,
    const,
    geometry,
    prefetch,
)

BLOCK_ROWS = 32      # rows of one block: two tiles of 16
BLOCK_COLS = 32      # columns: two panels of NR
TILE_K = 32          # bfloat16 values of k per tile (64 bytes a row)

_VOID = ir.VoidType()
_P8 = I8.as_pointer()
C00, C01, C10, C11, A0, A1, B0, B1 = range(8)


def _fns(module):
    fn = cgutils.get_or_insert_function
    return {
        "cfg": fn(module, ir.FunctionType(_VOID, [_P8]), "llvm.x86.ldtilecfg"),
        "load": fn(module, ir.FunctionType(_VOID, [I8, _P8, I64]), "llvm.x86.tileloadd64"),
        "zero": fn(module, ir.FunctionType(_VOID, [I8]), "llvm.x86.tilezero"),
        "dot": fn(module, ir.FunctionType(_VOID, [I8, I8, I8]), "llvm.x86.tdpbf16ps"),
        "store": fn(module, ir.FunctionType(_VOID, [I8, _P8, I64]), "llvm.x86.tilestored64"),
    }


def _t(n):
    return ir.Constant(I8, n)


def _config_block(builder):
    """A tile configuration on the stack, zeroed, palette 1: its first byte's address."""
    cfg = cgutils.alloca_once(builder, ir.ArrayType(I8, 64))
    base = builder.bitcast(cfg, _P8)
    words = builder.bitcast(cfg, I64.as_pointer())
    for i in range(8):
        builder.store(const(0), builder.gep(words, [const(i)]))
    builder.store(_t(1), base)                                          # palette 1
    return base


def _configure(builder, fns, top_rows, bottom_rows):
    """ldtilecfg: palette 1; every tile 64 bytes a row; C and A tiles of each row block as many
    rows as it has (bottom_rows 0: its tiles unconfigured), B tiles 16 (i8 values)."""
    base = _config_block(builder)
    rows = {C00: top_rows, C01: top_rows, A0: top_rows, C10: bottom_rows, C11: bottom_rows,
            A1: bottom_rows, B0: _t(16), B1: _t(16)}
    for tile, r in rows.items():
        colsb = builder.select(builder.icmp_unsigned("!=", r, _t(0)), ir.Constant(I16, 64),
                               ir.Constant(I16, 0))
        builder.store(colsb, builder.bitcast(builder.gep(base, [const(16 + 2 * tile)]),
                                             I16.as_pointer()))
        builder.store(r, builder.gep(base, [const(48 + tile)]))
    builder.call(fns["cfg"], [base])


def _emit_pair(builder, fns, two_blocks, ab, a_off, lda, w, w_off0, w_off1, kp, c, c_off, ldc,
               accumulate):
    """C (rows x 2 panels) (+)= A (rows x kp) @ the two panels' slabs, C at byte c_off of c
    with row stride ldc bytes (accumulate != 0: C loaded from there first)."""
    cs = (C00, C01, C10, C11) if two_blocks else (C00, C01)
    corner = {C00: (0, 0), C01: (0, 16), C10: (16, 0), C11: (16, 16)}

    def c_at(t):
        r0, col = corner[t]
        return byte_ptr(builder, c, builder.add(c_off, builder.add(builder.mul(const(r0), ldc),
                                                                  const(4 * col))))
    with builder.if_else(builder.icmp_signed("!=", accumulate, const(0))) as (load, zero):
        with load:
            for t in cs:
                builder.call(fns["load"], [_t(t), c_at(t), ldc])
        with zero:
            for t in cs:
                builder.call(fns["zero"], [_t(t)])
    b_stride = const(64)
    with cgutils.for_range_slice(builder, const(0), kp, const(TILE_K)) as (k, _):
        # each load just before the first product that reads it: a tile register is not
        # renamed, so a load waits for the products still reading it and they for the load;
        # interleaved, a step of 4 products takes 166 cycles here against 195 loaded up front
        # (a C loop on this VM: 4 products alone 56 cycles)
        a_at = builder.add(a_off, builder.mul(k, const(2)))            # k bfloat16 values in
        b_at = builder.mul(k, const(2 * 16))                           # k / 2 pair rows of 64 B
        builder.call(fns["load"], [_t(A0), byte_ptr(builder, ab, a_at), lda])
        for w_off in (w_off0, w_off1):    # the weights PREFETCH_BYTES ahead: a tile is 16 lines
            ahead = builder.add(builder.add(w_off, b_at), const(PREFETCH_BYTES))
            for line in range(16):
                prefetch(builder, w, builder.add(ahead, const(64 * line)))
        builder.call(fns["load"], [_t(B0), byte_ptr(builder, w, builder.add(w_off0, b_at)), b_stride])
        builder.call(fns["dot"], [_t(C00), _t(A0), _t(B0)])
        builder.call(fns["load"], [_t(B1), byte_ptr(builder, w, builder.add(w_off1, b_at)), b_stride])
        builder.call(fns["dot"], [_t(C01), _t(A0), _t(B1)])
        if two_blocks:
            a1 = builder.add(a_at, builder.mul(lda, const(16)))
            builder.call(fns["load"], [_t(A1), byte_ptr(builder, ab, a1), lda])
            builder.call(fns["dot"], [_t(C10), _t(A1), _t(B0)])
            builder.call(fns["dot"], [_t(C11), _t(A1), _t(B1)])
    for t in cs:
        builder.call(fns["store"], [_t(t), c_at(t), ldc])


@intrinsic
def amx_rows(typingctx, ab, a_off, lda, rows, w, w_off0, w_off1, pair_step, pairs, kp, c, c_off,
             ldc, accumulate):
    """c[rows, 32 pairs] (+)= ab[rows, kp] @ `pairs` panel pairs (rows 1..32), the tiles
    configured once: pair j's panels at bytes w_off0 + j pair_step and w_off1 + j pair_step
    of w, its 32 columns at byte c_off + 128 j of c (rows ldc bytes apart); accumulate != 0
    adds to what c holds. Offsets and strides in bytes, kp (a multiple of 32) in bfloat16
    values; see the module docstring."""
    if ab.dtype != types.uint16 or c.dtype != types.float32:
        return None
    i64 = types.int64
    sig = types.void(ab, i64, i64, i64, w, i64, i64, i64, i64, i64, c, i64, i64, i64)

    def codegen(context, builder, signature, args):
        if not geometry().amx or signature.args[4].dtype != types.uint16:
            return context.get_dummy_value()    # not this level's, or not a bfloat16 weight
        ab_v, a_off, lda, rows, w_v, w_off0, w_off1, pair_step, pairs, kp, c_v, c_off, ldc, acc = args
        ab_p, w_p, c_p = (array_ptr(context, builder, signature.args[n], v)
                          for n, v in ((0, ab_v), (4, w_v), (10, c_v)))
        fns = _fns(builder.module)
        top = builder.trunc(builder.select(builder.icmp_signed(">", rows, const(16)), const(16),
                                           rows), I8)
        bottom = builder.trunc(builder.select(builder.icmp_signed(">", rows, const(16)),
                                              builder.sub(rows, const(16)), const(0)), I8)
        _configure(builder, fns, top, bottom)

        def run(two):
            with cgutils.for_range(builder, pairs) as loop:
                step = builder.mul(loop.index, pair_step)
                _emit_pair(builder, fns, two, ab_p, a_off, lda, w_p, builder.add(w_off0, step),
                           builder.add(w_off1, step), kp, c_p,
                           builder.add(c_off, builder.mul(loop.index, const(4 * BLOCK_COLS))), ldc,
                           acc)

        with builder.if_else(builder.icmp_signed(">", rows, const(16))) as (two, one):
            with two:
                run(True)
            with one:
                run(False)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def amx_release(typingctx):
    """tilerelease: this thread's tile state back to its initial (unused) state."""
    def codegen(context, builder, signature, args):
        if geometry().amx:
            builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VOID, []),
                                                        "llvm.x86.tilerelease"), [])
        return context.get_dummy_value()
    return types.void(), codegen


# ---- strips of 16-row tiles, B at any row stride: attention's blocks ----------------------

_STRIP_C = 4                       # C tiles 0..3: up to four 16-column tiles of one strip
_STRIP_A, _STRIP_B = 4, (5, 6)     # one A tile; two B tiles, alternating


@intrinsic
def amx_strips(typingctx, a, a_off, lda, row_tiles, b, b_off, ldb, kt, nt, c, c_off, ldc,
               accumulate):
    """C (+)= A @ B over `row_tiles` tiles of 16 rows and `nt` (1..4) tiles of 16 columns,
    k in `kt` steps of 32 bfloat16 values, all tiles 16 rows x 64 bytes:
        A tile (r, j) at byte a_off + 16 r lda + 64 j of a   (bfloat16 bits, rows lda bytes apart)
        B tile (j, n) at byte b_off + 16 j ldb + 64 n of b   (pairs of k rows interleaved,
                                                              AMX's layout; rows ldb bytes apart)
        C tile (r, n) at byte c_off + 16 r ldc + 64 n of c   (float32; accumulate != 0: added to)
    so a B of 16 pair rows need not be contiguous: a KV cache block interleaved in place
    (device/kernels/attention/paged.py) is read as it lies. Numerics as amx_rows'."""
    if a.dtype != types.uint16 or b.dtype != types.uint16 or c.dtype != types.float32:
        return None
    i64 = types.int64
    sig = types.void(a, i64, i64, i64, b, i64, i64, i64, i64, c, i64, i64, i64)

    def codegen(context, builder, signature, args):
        if not geometry().amx:
            return context.get_dummy_value()
        a_v, a_off, lda, row_tiles, b_v, b_off, ldb, kt, nt, c_v, c_off, ldc, acc = args
        a_p, b_p, c_p = (array_ptr(context, builder, signature.args[n], v)
                         for n, v in ((0, a_v), (4, b_v), (9, c_v)))
        fns = _fns(builder.module)
        base = _config_block(builder)
        for tile in range(7):                                           # 16 rows x 64 bytes
            builder.store(ir.Constant(I16, 64), builder.bitcast(
                builder.gep(base, [const(16 + 2 * tile)]), I16.as_pointer()))
            builder.store(_t(16), builder.gep(base, [const(48 + tile)]))
        builder.call(fns["cfg"], [base])

        def guarded(n, emit):
            with builder.if_then(builder.icmp_signed(">", nt, const(n))):
                emit()

        with cgutils.for_range(builder, row_tiles) as rloop:
            r = rloop.index
            c_row = builder.add(c_off, builder.mul(r, builder.mul(ldc, const(16))))
            a_row = builder.add(a_off, builder.mul(r, builder.mul(lda, const(16))))

            def c_at(n):
                return byte_ptr(builder, c_p, builder.add(c_row, const(64 * n)))
            for n in range(_STRIP_C):
                def start(n=n):
                    with builder.if_else(builder.icmp_signed("!=", acc, const(0))) as (load, zero):
                        with load:
                            builder.call(fns["load"], [_t(n), c_at(n), ldc])
                        with zero:
                            builder.call(fns["zero"], [_t(n)])
                guarded(n, start)
            with cgutils.for_range(builder, kt) as kloop:
                j = kloop.index
                builder.call(fns["load"], [_t(_STRIP_A), byte_ptr(
                    builder, a_p, builder.add(a_row, builder.mul(j, const(64)))), lda])
                b_row = builder.add(b_off, builder.mul(j, builder.mul(ldb, const(16))))
                for n in range(_STRIP_C):
                    def dot(n=n):
                        bt = _STRIP_B[n % 2]
                        builder.call(fns["load"], [_t(bt), byte_ptr(
                            builder, b_p, builder.add(b_row, const(64 * n))), ldb])
                        builder.call(fns["dot"], [_t(n), _t(_STRIP_A), _t(bt)])
                    guarded(n, dot)
            for n in range(_STRIP_C):
                guarded(n, lambda n=n: builder.call(fns["store"], [_t(n), c_at(n), ldc]))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def interleave_rows(typingctx, dst, dst_off, src, a_off, b_off, n):
    """dst[dst_off + 2 c] = src[a_off + c], dst[dst_off + 2 c + 1] = src[b_off + c] for
    c < n (a negative a_off or b_off reads zeros): two rows of a block as one row of AMX's B
    layout, in vectors of 32 values, then of 16, the tail one value at a time. dst holds bfloat16 bits;
    src bfloat16 bits too (uint16), or float32 values, rounded to nearest even."""
    if dst.dtype != types.uint16 or src.dtype not in (types.uint16, types.float32):
        return None
    wide = src.dtype == types.float32
    i64 = types.int64
    sig = types.void(dst, i64, src, i64, i64, i64)

    def codegen(context, builder, signature, args):
        dst_v, dst_off, src_v, a_off, b_off, n = args
        d_p = array_ptr(context, builder, signature.args[0], dst_v)
        s_p = array_ptr(context, builder, signature.args[2], src_v)

        def row(off, i, vt):
            live = builder.icmp_signed(">=", off, const(0))
            at = builder.gep(s_p, [builder.select(live, builder.add(off, i), const(0))])
            if wide:
                it = ir.VectorType(I32, vt.count)
                u = builder.load(builder.bitcast(at, it.as_pointer()), align=4)
                v = builder.trunc(bf16_narrow_ir(builder, u, it), vt)
            else:
                v = builder.load(builder.bitcast(at, vt.as_pointer()), align=2)
            return builder.select(live, v, ir.Constant(vt, None))

        def body(i, w):
            vt = ir.VectorType(I16, w)
            lo, hi = row(a_off, i, vt), row(b_off, i, vt)
            mask = ir.Constant(ir.VectorType(ir.IntType(32), 2 * w),
                               [x for c in range(w) for x in (c, w + c)])
            out = builder.shuffle_vector(lo, hi, mask)
            at = builder.add(dst_off, builder.mul(i, const(2)))
            builder.store(out, builder.bitcast(builder.gep(d_p, [at]),
                                               ir.VectorType(I16, 2 * w).as_pointer()), align=2)
        main = builder.mul(builder.sdiv(n, const(32)), const(32))
        half = builder.add(main, builder.mul(builder.sdiv(builder.sub(n, main), const(16)),
                                             const(16)))
        with cgutils.for_range_slice(builder, const(0), main, const(32)) as (i, _):
            body(i, 32)
        with cgutils.for_range_slice(builder, main, half, const(16)) as (i, _):
            body(i, 16)
        with cgutils.for_range_slice(builder, half, n, const(1)) as (i, _):
            body(i, 1)
        return context.get_dummy_value()

    return sig, codegen
