"""A float32 exp that runs in full vectors, for the exponentials of softmax-like sums.

np.exp inside njit compiles to a scalar libm call here (llvmlite has no SVML), so a loop of
them runs one element at a time; and a loop Numba vectorizes itself gets one vector of the
polynomial at a time, its 8-deep chain of dependent multiply-adds the limit. `exp_nonpos`
emits the loop as LLVM vector IR (device/kernels/simd.py's width) with four independent
vectors in flight: Cephes' expf polynomial, 2**k built from its bits. Arguments are <= 0
(x - max), as in every softmax.
"""

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from spyre_serve.device.kernels.simd import F32, I32, array_ptr, const, geometry, load_vec, splat

_LOG_UNDERFLOW = np.float32(-87.0)  # exp below this is 0 or denormal in float32
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)  # ln 2 in two parts (Cody-Waite), as Cephes expf
_LN2_LO = np.float32(-2.12194440e-4)
_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
         5.0000001201e-1)
_IN_FLIGHT = 4     # independent vectors an iteration


def emit_exp(builder, vec, ivec, x):
    """exp(x) of a <n x float> x <= 0 (x < -87: 0)."""
    n = vec.count

    def c(v):
        return ir.Constant(vec, [float(np.float32(v))] * n)

    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec] * 3),
                                         f"llvm.fma.v{n}f32")
    floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec]),
                                           f"llvm.floor.v{n}f32")
    maxf = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec, vec]),
                                          f"llvm.maxnum.v{n}f32")
    v = builder.call(maxf, [x, c(_LOG_UNDERFLOW)])
    k = builder.call(floor, [builder.call(fma, [v, c(_LOG2E), c(0.5)])])
    r = builder.call(fma, [k, c(-_LN2_HI), v])
    r = builder.call(fma, [k, c(-_LN2_LO), r])
    p = c(_POLY[0])
    for coef in _POLY[1:]:
        p = builder.call(fma, [p, r, c(coef)])
    rr = builder.fmul(r, r)
    e = builder.call(fma, [p, rr, builder.fadd(r, c(1.0))])
    bits = builder.shl(builder.add(builder.fptosi(k, ivec), ir.Constant(ivec, [127] * n)),
                       ir.Constant(ivec, [23] * n))
    keep = builder.fcmp_ordered(">=", x, c(_LOG_UNDERFLOW))
    scale = builder.select(keep, builder.bitcast(bits, vec), c(0.0))
    return builder.fmul(e, scale)


@intrinsic
def _exp_inplace(typingctx, x):
    """x[i] = exp(x[i]) for a contiguous float32 array, in vectors; the tail one element at
    a time through the same polynomial."""
    if not isinstance(x, types.Array) or x.dtype != types.float32 or x.ndim != 1 or x.layout != "C":
        return None

    def codegen(context, builder, signature, args):
        g = geometry()
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = array_ptr(context, builder, signature.args[0], args[0])
        n = builder.extract_value(arr.shape, 0)
        step = _IN_FLIGHT * g.vw
        main = builder.mul(builder.sdiv(n, const(step)), const(step))
        with cgutils.for_range_slice(builder, const(0), main, const(step)) as (i, _):
            vals = [load_vec(builder, ptr, builder.add(i, const(j * g.vw)), g.vec, 4)
                    for j in range(_IN_FLIGHT)]
            outs = [emit_exp(builder, g.vec, g.ivec, v) for v in vals]
            for j, o in enumerate(outs):
                at = builder.gep(ptr, [builder.add(i, const(j * g.vw))])
                builder.store(o, builder.bitcast(at, g.vec.as_pointer()), align=4)
        one = ir.VectorType(F32, 1)
        one_i = ir.VectorType(I32, 1)
        with cgutils.for_range_slice(builder, main, n, const(1)) as (i, _):
            at = builder.gep(ptr, [i])
            o = emit_exp(builder, one, one_i, splat(builder, builder.load(at), one))
            builder.store(builder.extract_element(o, ir.Constant(I32, 0)), at)
        return context.get_dummy_value()

    return types.void(x), codegen


@njit(nogil=True, cache=True)
def exp_nonpos(x):
    """x[n] = exp(x[n]) in place for x <= 0 (float32, 1-D, contiguous), within 3e-7 relative;
    x < -87 (and -inf) gives 0."""
    _exp_inplace(x)
