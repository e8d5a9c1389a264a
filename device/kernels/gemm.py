"""GEMM on weights placed once in panels (weight-stationary), fp32 or 16-bit.

A weight W[K, N] is stored as panels of NR columns, each panel K rows of NR contiguous
values (device/layout.py packs it; see device/README.md for a picture):

    packed[p, k, j] = W[k, p * NR + j]        p < ceil(N / NR), zero past column N

so the kernel streams every panel with unit stride and never repacks. Storage is float32,
or uint16 holding bfloat16 or float16 bits (`fmt`), widened to float32 right after the load
(bf16: a 16-bit shift; fp16: F16C's conversion): activations and accumulation stay fp32.

    out[M, N] = a[M, K] @ W                    gemm_packed(out, a, w, K, N, fmt)

The loops follow BLIS: the panels are split across the card's cores (`prange` over chunks
of panels); a panel's k-block of KC rows (16 KiB in fp32) stays in L1 while every row tile
of MR rows passes over it, so each weight byte comes from memory once per block of MC rows.
Up to MC rows (every decode) that is one pass and one parallel region; for more, the rows
come in blocks of MC and the k-blocks go outside the panels, so that an [MC, KC] block of
`a` stays in L2 while all the panels stream past it. The
innermost loop is a microkernel emitted as LLVM vector IR (`_microkernel`): it keeps an
MR x NR block of `out` in registers, and for each k loads the NR weights of that row,
broadcasts one value of `a` per row and does MR x NR fused multiply-adds. With NR = 16 and
8-wide vectors (AVX2: 16 registers) MR = 6 uses 12 accumulators, 2 weight vectors and a
broadcast. One row (a decode GEMV) unrolls k by 4 into independent accumulators so that
the FMA latency never limits the stream of weights.

Numerics: every product is a float32 FMA of exactly the stored weight. The order of the k
sum depends on K and on the height of a row's tile (one row sums k in four interleaved
partial sums), never on the thread count: a result is reproducible for a given batch shape.
"""

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from device.abi import f32_at, get_kernel_threads, u16_at

NR = 16          # columns per panel
VW = 8           # float32 lanes per LLVM vector (a ymm register on AVX2)
MR = 6           # rows per microkernel tile
KC = 256         # k rows per block: a [KC, NR] fp32 slab is 16 KiB, half of L1
MC = 192         # rows per block of a: [MC, KC] fp32 is 192 KiB, in L2
CHUNKS_PER_THREAD = 4   # panel chunks per core: balances the split, keeps each core's range contiguous

FMT_F32, FMT_BF16, FMT_F16 = 0, 1, 2
FORMATS = {"float32": FMT_F32, "bfloat16": FMT_BF16, "float16": FMT_F16}

_F32 = ir.FloatType()
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


def _load_weights(builder, w_ptr, index, kind):
    """<VW x float> of weights at element `index` of the packed array, widened if 16-bit."""
    p = builder.gep(w_ptr, [index])
    if kind == "f32":
        return builder.load(builder.bitcast(p, _VEC.as_pointer()), align=4)
    if kind == "f16":
        raw = builder.load(builder.bitcast(p, ir.VectorType(ir.HalfType(), VW).as_pointer()), align=2)
        return builder.fpext(raw, _VEC)
    raw = builder.load(builder.bitcast(p, ir.VectorType(_I16, VW).as_pointer()), align=2)  # bf16
    wide = builder.shl(builder.zext(raw, ir.VectorType(_I32, VW)),
                       ir.Constant(ir.VectorType(_I32, VW), [16] * VW))
    return builder.bitcast(wide, _VEC)


def _microkernel(mr: int):
    """An intrinsic computing one tile: c[mr, NR] (+)= a[mr, kc] @ panel[kc, NR].

    tile(a, a_off, lda, w, w_off, c, c_off, ldc, kc, accumulate, fmt): a and c are 1-D
    float32 arrays addressed by element offsets and row strides; w is the packed weight
    (1-D float32, or uint16 with fmt FMT_BF16 / FMT_F16), w_off the first element of the
    slab [kc, NR]. accumulate != 0 adds to c instead of overwriting it."""
    nv = NR // VW
    unroll = 4 if mr == 1 else 2 if mr == 2 else 1

    def emit_loop(builder, fma, kind, a_ptr, a_off, lda, w_ptr, w_off, kc):
        zero = ir.Constant(_VEC, [0.0] * VW)
        sets = [[[cgutils.alloca_once_value(builder, zero) for _ in range(nv)] for _ in range(mr)]
                for _ in range(unroll)]

        def step(k, accs):
            base = builder.add(w_off, builder.mul(k, _const(NR)))
            wv = [_load_weights(builder, w_ptr, builder.add(base, _const(j * VW)), kind)
                  for j in range(nv)]
            for i in range(mr):
                ai = builder.add(builder.add(a_off, builder.mul(_const(i), lda)), k)
                av = _splat(builder, builder.load(builder.gep(a_ptr, [ai])))
                for j in range(nv):
                    acc = accs[i][j]
                    builder.store(builder.call(fma, [av, wv[j], builder.load(acc)]), acc)

        kmain = builder.mul(builder.sdiv(kc, _const(unroll)), _const(unroll))
        with cgutils.for_range_slice(builder, _const(0), kmain, _const(unroll)) as (k0, _):
            for u in range(unroll):
                step(builder.add(k0, _const(u)), sets[u])
        with cgutils.for_range_slice(builder, kmain, kc, _const(1)) as (k1, _):
            step(k1, sets[0])
        for u in range(1, unroll):
            for i in range(mr):
                for j in range(nv):
                    acc = sets[0][i][j]
                    builder.store(builder.fadd(builder.load(acc), builder.load(sets[u][i][j])), acc)
        return sets[0]

    @intrinsic
    def tile(typingctx, a, a_off, lda, w, w_off, c, c_off, ldc, kc, accumulate, fmt):
        if w.dtype not in (types.float32, types.uint16):
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
            loop = (a_ptr, a_off, lda, w_ptr, w_off, kc)
            if signature.args[3].dtype == types.float32:
                accs = emit_loop(builder, fma, "f32", *loop)
            else:
                result = [[cgutils.alloca_once(builder, _VEC) for _ in range(nv)] for _ in range(mr)]
                is_f16 = builder.icmp_signed("==", fmt_v, _const(FMT_F16))
                with builder.if_else(is_f16) as (then, otherwise):
                    for kind, branch in (("f16", then), ("bf16", otherwise)):
                        with branch:
                            got = emit_loop(builder, fma, kind, *loop)
                            for i in range(mr):
                                for j in range(nv):
                                    builder.store(builder.load(got[i][j]), result[i][j])
                accs = result
            add = builder.icmp_signed("!=", accf, _const(0))
            for i in range(mr):
                row = builder.add(c_off, builder.mul(_const(i), ldc))
                for j in range(nv):
                    p = builder.bitcast(builder.gep(c_ptr, [builder.add(row, _const(j * VW))]),
                                        _VEC.as_pointer())
                    val = builder.load(accs[i][j])
                    val = builder.select(add, builder.fadd(val, builder.load(p, align=4)), val)
                    builder.store(val, p, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return tile


_tile1, _tile2, _tile3, _tile4, _tile5, _tile6 = (_microkernel(m) for m in range(1, MR + 1))


@njit(nogil=True, cache=True, inline="always")
def _tile(mr, a, a_off, lda, w, w_off, c, c_off, ldc, kc, acc, fmt):
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


@njit(nogil=True, cache=True)
def packed_size(k, n):
    """Elements of a packed [K, N] weight: ceil(N / NR) panels of K x NR."""
    return ((n + NR - 1) // NR) * k * NR


@njit(nogil=True, cache=True)
def _panels(af, of, w, k, n, m0, mc, k0, kc_all, p0, p1, fmt, tmp):
    """Rows m0..m0+mc of out, panels p0..p1-1, k rows k0..k0+kc_all (one core's share of one
    block): per panel, per k-block of KC, every row tile of MR rows."""
    for p in range(p0, p1):
        n0 = p * NR
        cols = min(NR, n - n0)
        for kb in range(k0, k0 + kc_all, KC):
            kc = min(KC, k0 + kc_all - kb)
            acc = 1 if kb > 0 else 0
            w_off = p * k * NR + kb * NR
            for r0 in range(m0, m0 + mc, MR):
                mr = min(MR, m0 + mc - r0)
                if cols == NR:
                    _tile(mr, af, r0 * k + kb, k, w, w_off, of, r0 * n + n0, n, kc, acc, fmt)
                    continue
                # the last panel is partial: compute the whole tile into tmp, copy its columns
                for i in range(mr):
                    for j in range(cols):
                        tmp[i * NR + j] = of[(r0 + i) * n + n0 + j]
                _tile(mr, af, r0 * k + kb, k, w, w_off, tmp, 0, NR, kc, acc, fmt)
                for i in range(mr):
                    for j in range(cols):
                        of[(r0 + i) * n + n0 + j] = tmp[i * NR + j]


@njit(nogil=True, cache=True, parallel=True)
def gemm_packed(out, a, w, k, n, fmt):
    """out[M, N] = a[M, K] @ W[K, N], W packed in panels (float32, or uint16 bf16/fp16 bits).

    out, a: C-contiguous float32 2-D; w: the packed 1-D array of packed_size(K, N) elements;
    fmt: FMT_F32 for float32 w, FMT_BF16 or FMT_F16 for uint16 w."""
    m = a.shape[0]
    if a.shape[1] != k or out.shape[0] != m or out.shape[1] != n:
        raise ValueError("gemm_packed: want a [M, K] and out [M, N]; (M, K, N) are", m, k, n)
    if w.shape[0] < packed_size(k, n):
        raise ValueError("gemm_packed: packed weight too short (have, need)", w.shape[0],
                         packed_size(k, n))
    if m == 0 or n == 0:
        return
    if k == 0:
        out[:] = 0.0
        return
    af = a.reshape(m * k)
    of = out.reshape(m * n)
    n_panels = (n + NR - 1) // NR
    chunks = min(n_panels, CHUNKS_PER_THREAD * get_kernel_threads())
    if m <= MC:
        # decode-sized: all of a fits in L2; one parallel region over the panels
        for c in prange(chunks):
            tmp = np.empty(MR * NR, np.float32)
            _panels(af, of, w, k, n, 0, m, 0, k, c * n_panels // chunks,
                    (c + 1) * n_panels // chunks, fmt, tmp)
        return
    # prefill-sized: a block of MC rows x KC columns of a stays in L2 while every panel's
    # [KC, NR] slab passes (BLIS's order: k-blocks outside the panels)
    for m0 in range(0, m, MC):
        mc = min(MC, m - m0)
        for k0 in range(0, k, KC):
            kc = min(KC, k - k0)
            for c in prange(chunks):
                tmp = np.empty(MR * NR, np.float32)
                _panels(af, of, w, k, n, m0, mc, k0, kc, c * n_panels // chunks,
                        (c + 1) * n_panels // chunks, fmt, tmp)




@intrinsic
def _widen(typingctx, bits, fmt):
    """One stored value -> float32, exactly: a float32 as it is, a uint16 of bf16 or fp16
    bits (fmt) widened."""
    if bits not in (types.uint16, types.float32):
        return None

    def codegen(context, builder, signature, args):
        raw, fmt_v = args
        if signature.args[0] == types.float32:
            return raw
        half = builder.fpext(builder.bitcast(raw, ir.HalfType()), _F32)
        brain = builder.bitcast(builder.shl(builder.zext(raw, _I32), ir.Constant(_I32, 16)), _F32)
        return builder.select(builder.icmp_signed("==", fmt_v, _const(FMT_F16)), half, brain)
    return types.float32(bits, types.int64), codegen


@njit(nogil=True, cache=True, parallel=True)
def gather_columns(out, w, cols, scale, k, n, fmt):
    """out[T, K] = W[:, cols].T * scale for W[K, N] packed in panels: the embedding lookup of
    a table stored as the K x N weight of the LM head (E.T, K = H, N = V), so a tied model
    keeps one copy of its embedding, in the GEMM's layout and width."""
    t_n = cols.shape[0]
    if out.shape[0] != t_n or out.shape[1] != k:
        raise ValueError("gather_columns: out must be [T, K]; T, K are", t_n, k)
    for t in range(t_n):
        if cols[t] < 0 or cols[t] >= n:
            raise IndexError("gather_columns: column out of range (column, N)", cols[t], n)
    s = np.float32(scale)
    for t in prange(t_n):
        c = cols[t]
        base = (c // NR) * k * NR + c % NR
        for kk in range(k):
            out[t, kk] = _widen(w[base + kk * NR], fmt) * s


# ---- on the arena: a weight by its address, as the card's programs reach it ----------------

@njit(nogil=True, cache=True)
def gemm_at(out, a, f32, u16, address, k, n, fmt):
    """gemm_packed with the weight at byte `address` of the arena (f32 / u16: its views)."""
    if fmt == FMT_F32:
        gemm_packed(out, a, f32_at(f32, address, packed_size(k, n)), k, n, fmt)
    else:
        gemm_packed(out, a, u16_at(u16, address, packed_size(k, n)), k, n, fmt)


@njit(nogil=True, cache=True)
def gather_columns_at(out, f32, u16, address, cols, scale, k, n, fmt):
    """gather_columns with the weight at byte `address` of the arena."""
    if fmt == FMT_F32:
        gather_columns(out, f32_at(f32, address, packed_size(k, n)), cols, scale, k, n, fmt)
    else:
        gather_columns(out, u16_at(u16, address, packed_size(k, n)), cols, scale, k, n, fmt)

# ---- 16-bit compute: GEMM inputs rounded to the weights' format -----------------------------

@intrinsic
def _round_f16(typingctx, x):
    """float32 -> nearest float16 (round to nearest even; F16C's conversion) -> float32."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), _F32)
    return types.float32(x), codegen


@njit(nogil=True, cache=True, parallel=True)
def round_to_format(x, fmt):
    """Round every value of the C-contiguous float32 array x, in place, to the nearest value
    of the 16-bit format fmt (round to nearest even), so that the products of a 16-bit GEMM
    are exact products of 16-bit numbers, as in a bf16/fp16 multiplier; FMT_F32 does nothing."""
    if fmt == FMT_F32:
        return
    flat = x.reshape(x.size)
    bits = flat.view(np.uint32)
    n = flat.shape[0]
    rows = (n + 4095) // 4096
    for r in prange(rows):
        lo = r * 4096
        hi = min(n, lo + 4096)
        if fmt == FMT_F16:
            for i in range(lo, hi):
                flat[i] = _round_f16(flat[i])
        else:
            for i in range(lo, hi):
                u = bits[i]
                bits[i] = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)

# ---- activations times activations: BLAS (np.dot), which packs its operands per call --------


@njit(nogil=True, cache=True)
def _check(out, a, b_rows, b_cols):
    # out: [M, N], a: [M, K]; b is [K, N] (b_rows=K, b_cols=N)
    m, k = a.shape
    if b_rows != k:
        raise ValueError("gemm: inner dimensions differ (a cols, b rows)", k, b_rows)
    if out.shape[0] != m or out.shape[1] != b_cols:
        raise ValueError("gemm: out shape does not match (rows, cols) wanted", m, b_cols)


@njit(nogil=True, cache=True)
def gemm(out, a, b):
    """out[M, N] = a[M, K] @ b[K, N] via BLAS (sgemm / sgemv)."""
    _check(out, a, b.shape[0], b.shape[1])
    np.dot(a, b, out)


@njit(nogil=True, cache=True)
def gemm_bt(out, a, bt):
    """out[M, N] = a[M, K] @ bt[N, K].T, b given transposed.

    For the LM head with tied embeddings: logits[T, V] = x[T, H] @ E[V, H].T.
    `bt.T` is an F-contiguous view, which Numba hands to BLAS with a
    transpose flag: no copy, no performance warning.
    """
    _check(out, a, bt.shape[1], bt.shape[0])
    np.dot(a, bt.T, out)
