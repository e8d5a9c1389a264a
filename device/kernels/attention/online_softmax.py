"""The online-softmax update of flash attention: one block of scores folded into a running
maximum, denominator and weighted sum, so attention never holds a row's whole score vector.

    online_softmax_block(scores, m, denom, acc, bits)
        scores float32[nq, cnt]  this block's scores (masked entries NEG_BIG); on return the
                                 block's weights exp(score - m_new), to multiply into V
        m, denom float32[nq]     the running maximum (NEG_BIG before any block) and denominator
        acc float32[nq, dv]      the running weighted sum of V rows, rescaled here to m_new
        bits int32[>= 2 nq]      scratch (unused by the vector path; kept for callers)
A row that has seen only masked scores so far keeps m = NEG_BIG, gets all-zero weights and
adds nothing; the caller's final acc / denom must treat denom 0 as a row that saw nothing.

Each row is one pass in registers, emitted as LLVM vector IR at the ISA level's width
(device/kernels/simd.py): its maximum, its correction exp(m_old - m_new) applied to denom and
acc, its weights (device/kernels/fastexp.py's polynomial) and their sum; a row's tail past
whole vectors goes one value at a time through the same code. scores and acc C-contiguous.
"""

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from spyre_serve.device.kernels.fastexp import emit_exp
from spyre_serve.device.kernels.simd import F32, I32, array_ptr, const, geometry, splat

NEG_BIG = np.float32(-1.0e30)  # a masked score; finite: the loops assume no infinities
_FAST = ("reassoc", "nnan", "ninf", "nsz")


def _vec_loop(builder, n, vw, body):
    """body(index, vector type) over [0, n): vectors of vw, then the tail in vectors of 1."""
    main = builder.mul(builder.sdiv(n, const(vw)), const(vw))
    with cgutils.for_range_slice(builder, const(0), main, const(vw)) as (i, _):
        body(i, ir.VectorType(F32, vw))
    with cgutils.for_range_slice(builder, main, n, const(1)) as (i, _):
        body(i, ir.VectorType(F32, 1))


def _load(builder, ptr, i, vt):
    return builder.load(builder.bitcast(builder.gep(ptr, [i]), vt.as_pointer()), align=4)


def _store(builder, ptr, i, v):
    builder.store(v, builder.bitcast(builder.gep(ptr, [i]), v.type.as_pointer()), align=4)


def _reduce(builder, kind, v, start):
    """max or sum of a vector's lanes and a scalar start."""
    n = v.type.count
    if kind == "max":
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(F32, [v.type]),
                                            f"llvm.vector.reduce.fmax.v{n}f32")
        r = builder.call(fn, [v])
        return builder.select(builder.fcmp_ordered(">", r, start), r, start)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(F32, [F32, v.type]),
                                        f"llvm.vector.reduce.fadd.v{n}f32")
    return builder.call(fn, [start, v], fastmath=_FAST)


@intrinsic
def _update_rows(typingctx, scores, m, denom, acc):
    for a, nd in ((scores, 2), (m, 1), (denom, 1), (acc, 2)):
        if not isinstance(a, types.Array) or a.dtype != types.float32 or a.ndim != nd:
            return None

    def codegen(context, builder, signature, args):
        g = geometry()
        arrs = [context.make_array(t)(context, builder, v) for t, v in zip(signature.args, args, strict=True)]
        s_p, m_p, d_p, a_p = (array_ptr(context, builder, t, v) for t, v in zip(signature.args, args, strict=True))
        nq = builder.extract_value(arrs[0].shape, 0)
        cnt = builder.extract_value(arrs[0].shape, 1)
        dv = builder.extract_value(arrs[3].shape, 1)
        neg_big = ir.Constant(F32, float(NEG_BIG))
        with cgutils.for_range(builder, nq) as row:
            q = row.index
            srow = builder.gep(s_p, [builder.mul(q, cnt)])
            arow = builder.gep(a_p, [builder.mul(q, dv)])
            bmax = cgutils.alloca_once_value(builder, neg_big)

            def find_max(i, vt):
                builder.store(_reduce(builder, "max", _load(builder, srow, i, vt),
                                      builder.load(bmax)), bmax)
            _vec_loop(builder, cnt, g.vw, find_max)
            m_old = builder.load(builder.gep(m_p, [q]))
            m_new = builder.select(builder.fcmp_ordered(">", builder.load(bmax), m_old),
                                   builder.load(bmax), m_old)
            with builder.if_else(builder.fcmp_ordered("==", m_new, neg_big)) as (blind, seen):
                with blind:                   # nothing visible yet: weights 0, state unchanged
                    def zero(i, vt):
                        _store(builder, srow, i, ir.Constant(vt, [0.0] * vt.count))
                    _vec_loop(builder, cnt, g.vw, zero)
                with seen:
                    one = ir.VectorType(F32, 1)
                    corr_v = emit_exp(builder, one, ir.VectorType(I32, 1),
                                      splat(builder, builder.fsub(m_old, m_new), one))
                    corr = builder.extract_element(corr_v, ir.Constant(I32, 0))

                    def rescale(i, vt):
                        _store(builder, arow, i, builder.fmul(_load(builder, arow, i, vt),
                                                              splat(builder, corr, vt)))
                    _vec_loop(builder, dv, g.vw, rescale)
                    total = cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0))

                    def weights(i, vt):
                        x = builder.fsub(_load(builder, srow, i, vt), splat(builder, m_new, vt))
                        w = emit_exp(builder, vt, ir.VectorType(I32, vt.count), x)
                        _store(builder, srow, i, w)
                        builder.store(_reduce(builder, "sum", w, builder.load(total)), total)
                    _vec_loop(builder, cnt, g.vw, weights)
                    d_at = builder.gep(d_p, [q])
                    builder.store(builder.fadd(builder.fmul(builder.load(d_at), corr),
                                               builder.load(total)), d_at)
                    builder.store(m_new, builder.gep(m_p, [q]))
        return context.get_dummy_value()

    return types.void(scores, m, denom, acc), codegen


@njit(nogil=True, cache=True, inline="always")
def online_softmax_block(scores, m, denom, acc, bits):
    nq, cnt = scores.shape
    if bits.shape[0] < 2 * nq:
        raise ValueError("online_softmax_block: bits needs 2 nq values (have, need)",
                         bits.shape[0], 2 * nq)
    if (scores.strides[1] != 4 or scores.strides[0] != 4 * cnt or acc.strides[1] != 4
            or acc.strides[0] != 4 * acc.shape[1] or m.strides[0] != 4 or denom.strides[0] != 4
            or m.shape[0] < nq or denom.shape[0] < nq or acc.shape[0] < nq):
        raise ValueError("online_softmax_block: scores [nq, cnt], acc [nq, dv], m, denom [nq] "
                         "contiguous (nq, cnt)", nq, cnt)
    _update_rows(scores, m, denom, acc)
