"""The online-softmax update of flash attention: one block of scores folded into a running
maximum, denominator and weighted sum, so attention never holds a row's whole score vector.

    online_softmax_block(scores, m, denom, acc, bits)
        scores float32[nq, cnt]  this block's scores (masked entries NEG_BIG); on return the
                                 block's weights exp(score - m_new), to multiply into V
        m, denom float32[nq]     the running maximum (NEG_BIG before any block) and denominator
        acc float32[nq, dv]      the running weighted sum of V rows, rescaled here to m_new
        bits int32[>= 2 nq]      scratch: each row's new maximum and its correction (as float32)
A row that has seen only masked scores so far keeps m = NEG_BIG, gets all-zero weights and
adds nothing; the caller's final acc / denom must treat denom 0 as a row that saw nothing.

Three passes, emitted as LLVM vector IR at the ISA level's width (device/kernels/simd.py), so
no row waits on a chain of its own: every row's new maximum (whole vectors folded lane-wise,
one horizontal step a row); every row's correction exp(m_old - m_new), in vectors across rows;
per row, its weights (device/kernels/fastexp.py's polynomial), their sum (folded the same way)
and the correction applied to denom and acc (acc only where the maximum moved: a correction
of exactly 1 changes nothing). A row's tail past whole vectors goes one value
at a time through the same code. scores and acc C-contiguous.
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


def _fold(builder, n, vw, kind, value):
    """max or sum over i < n of value(i, vector type): whole vectors of vw folded lane-wise
    into one vector (no horizontal step per vector: a row's chain is one fold deep), the tail
    one value at a time; one horizontal reduction at the end."""
    start = float(NEG_BIG) if kind == "max" else 0.0
    lanes = {w: cgutils.alloca_once_value(builder, ir.Constant(ir.VectorType(F32, w), [start] * w))
             for w in {vw, 1}}

    def combine(a, b):
        if kind == "max":
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(a.type, [a.type, a.type]),
                                                f"llvm.maxnum.v{a.type.count}f32")
            return builder.call(fn, [a, b])
        return builder.fadd(a, b, flags=_FAST)

    def body(i, vt):
        acc = lanes[vt.count]
        builder.store(combine(builder.load(acc), value(i, vt)), acc)
    _vec_loop(builder, n, vw, body)
    tail = builder.extract_element(builder.load(lanes[1]), ir.Constant(I32, 0))
    return _reduce(builder, kind, builder.load(lanes[vw]), tail)


@intrinsic
def _update_rows(typingctx, scores, m, denom, acc, bits):
    for a, nd in ((scores, 2), (m, 1), (denom, 1), (acc, 2)):
        if not isinstance(a, types.Array) or a.dtype != types.float32 or a.ndim != nd:
            return None
    if not isinstance(bits, types.Array) or bits.dtype != types.int32:
        return None

    def codegen(context, builder, signature, args):
        g = geometry()
        arrs = [context.make_array(t)(context, builder, v) for t, v in zip(signature.args, args, strict=True)]
        s_p, m_p, d_p, a_p, b_p = (array_ptr(context, builder, t, v)
                                   for t, v in zip(signature.args, args, strict=True))
        nq = builder.extract_value(arrs[0].shape, 0)
        cnt = builder.extract_value(arrs[0].shape, 1)
        dv = builder.extract_value(arrs[3].shape, 1)
        neg_big = ir.Constant(F32, float(NEG_BIG))
        m_new_p = builder.bitcast(b_p, F32.as_pointer())             # bits[:nq]: each row's new max
        corr_p = builder.gep(m_new_p, [nq])                           # bits[nq:2nq]: its correction
        # three passes, so no row waits on a chain of its own: its new maximum; every row's
        # correction exp(m_old - m_new) in vectors across rows; its weights, sum and rescale
        with cgutils.for_range(builder, nq) as row:
            q = row.index
            srow = builder.gep(s_p, [builder.mul(q, cnt)])
            bmax = _fold(builder, cnt, g.vw, "max", lambda i, vt: _load(builder, srow, i, vt))
            m_old = builder.load(builder.gep(m_p, [q]))
            builder.store(builder.select(builder.fcmp_ordered(">", bmax, m_old), bmax, m_old),
                          builder.gep(m_new_p, [q]))

        def correction(i, vt):
            x = builder.fsub(_load(builder, m_p, i, vt), _load(builder, m_new_p, i, vt))
            _store(builder, corr_p, i, emit_exp(builder, vt, ir.VectorType(I32, vt.count), x))
        _vec_loop(builder, nq, g.vw, correction)
        with cgutils.for_range(builder, nq) as row:
            q = row.index
            srow = builder.gep(s_p, [builder.mul(q, cnt)])
            arow = builder.gep(a_p, [builder.mul(q, dv)])
            m_new = builder.load(builder.gep(m_new_p, [q]))
            with builder.if_else(builder.fcmp_ordered("==", m_new, neg_big)) as (blind, seen):
                with blind:                   # nothing visible yet: weights 0, state unchanged
                    def zero(i, vt):
                        _store(builder, srow, i, ir.Constant(vt, [0.0] * vt.count))
                    _vec_loop(builder, cnt, g.vw, zero)
                with seen:
                    corr = builder.load(builder.gep(corr_p, [q]))

                    def rescale(i, vt):
                        _store(builder, arow, i, builder.fmul(_load(builder, arow, i, vt),
                                                              splat(builder, corr, vt)))
                    m_old = builder.load(builder.gep(m_p, [q]))
                    with builder.if_then(builder.fcmp_unordered("!=", m_new, m_old)):
                        _vec_loop(builder, dv, g.vw, rescale)     # else corr is exactly 1

                    def weights(i, vt):
                        x = builder.fsub(_load(builder, srow, i, vt), splat(builder, m_new, vt))
                        w = emit_exp(builder, vt, ir.VectorType(I32, vt.count), x)
                        _store(builder, srow, i, w)
                        return w
                    total = _fold(builder, cnt, g.vw, "sum", weights)
                    d_at = builder.gep(d_p, [q])
                    builder.store(builder.fadd(builder.fmul(builder.load(d_at), corr), total), d_at)
                    builder.store(m_new, builder.gep(m_p, [q]))
        return context.get_dummy_value()

    return types.void(scores, m, denom, acc, bits), codegen


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
    _update_rows(scores, m, denom, acc, bits)
