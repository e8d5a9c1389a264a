"""What the GEMM tiles are emitted with: the vector geometry of the kernels' ISA level, and the
LLVM IR helpers every tile family shares.

The geometry is read when a tile is compiled (at code generation, never at import), from
device/isa.py's level, and the compile cache is keyed by that level, so the code of one level
is never loaded at another:

    level          VW  registers  tile heights      16-bit dot   int8 dot       tiles
    avx2            8      16     1, 2, 3, 4, 5, 6   -            vpmaddubsw     -
    avx512         16      32     1, 2, 4, 8, 16     -            vpmaddubsw     -
    avx512_vnni    16      32     1, 2, 4, 8, 16     -            vpdpbusd       -
    avx512_bf16    16      32     1, 2, 4, 8, 16     vdpbf16ps    vpdpbusd       -
    amx            16      32     1, 2, 4, 8, 16     vdpbf16ps    vpdpbusd       AMX-BF16

VW float32 lanes make one LLVM vector (a ymm register on AVX2, a zmm on AVX-512); a panel's
NR = 16 columns are NR / VW vectors. A tile of mr rows keeps mr x NR / VW accumulators in
registers: AVX2's 16 registers hold 6 x 2 of them, AVX-512's 32 hold 16 x 1. A family's tile
is one intrinsic taking the height at run time (`by_height`: a switch over the level's
heights), so a level compiles only its own heights.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

NR = 16          # columns per panel (every level: the weights' layout does not depend on it)
WIDE_VECTORS = 4  # vectors a row of a wide tile (Geometry.wide)
# Every tile asks for the weights PREFETCH_BYTES ahead of each row it reads, before the
# hardware's prefetcher would (amx host, 2 cores: a 453 MB fp32 GEMV 27.2 -> 31.8 GB/s of the
# 34-36 a plain read gets, 512 B ahead 29.8; a 512-token fp32 prefill 640 -> 582 ms and a
# 32-row fp32 decode step 97 -> 86-92 ms, where 16 rows of FMAs per weight row cannot hide
# the memory alone).
PREFETCH_BYTES = 2048
QB = 32          # rows per quantization block (GGML's QK8_0 / QK4_0 / QK4_1)

F32 = ir.FloatType()
I8 = ir.IntType(8)
I16 = ir.IntType(16)
I32 = ir.IntType(32)
I64 = ir.IntType(64)


class BFloat16Type(ir.Type):
    """LLVM's `bfloat` (llvmlite has no class for it): the element type of vdpbf16ps's operands."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, BFloat16Type)

    def __hash__(self):
        return hash("bfloat")


BF16 = BFloat16Type()


@dataclass(frozen=True)
class Geometry:
    level: str
    vw: int                        # float32 lanes per vector
    heights: tuple[int, ...]       # tile heights, largest first
    bf16_dot: bool                 # vdpbf16ps
    vnni: bool                     # vpdpbusd
    amx: bool                      # AMX-BF16 tiles
    cols: int = NR                 # columns of a tile (NR; a wide tile's: WIDE_VECTORS vectors)

    @property
    def vec(self) -> ir.VectorType:
        return ir.VectorType(F32, self.vw)

    @property
    def ivec(self) -> ir.VectorType:
        return ir.VectorType(I32, self.vw)

    @property
    def nv(self) -> int:
        return self.cols // self.vw

    def wide(self) -> Geometry:
        """The wide tile's geometry: WIDE_VECTORS vectors a row (64 columns on AVX-512, 32 on
        AVX2), few rows (the accumulators and a row of weights in the registers): for a few
        rows over a long stream, e.g. a decode row's query heads over a KV block."""
        return replace(self, cols=WIDE_VECTORS * self.vw,
                       heights=(4, 3, 2, 1) if self.vw == 16 else (3, 2, 1))

    def unroll(self, mr: int) -> int:
        """Accumulator sets of a tile of mr rows: enough independent sums that the FMA latency
        never limits a short tile (AVX2 as it always was: 4, 2, 1)."""
        if self.cols != NR:
            return max(1, 8 // (mr * self.nv))
        if self.vw == 8:
            return 4 if mr == 1 else 2 if mr == 2 else 1
        return max(1, 8 // mr)


def geometry() -> Geometry:
    """The geometry of this process's ISA level (device/isa.py)."""
    from spyre_serve.device.isa import current

    isa = current()
    wide = isa.at_least("avx512")
    return Geometry(level=isa.level, vw=16 if wide else 8,
                    heights=(16, 8, 4, 2, 1) if wide else (6, 5, 4, 3, 2, 1),
                    bf16_dot=isa.at_least("avx512_bf16"), vnni=isa.at_least("avx512_vnni"),
                    amx=isa.at_least("amx"))


@intrinsic
def tile_height(typingctx, rows):
    """The largest tile height of this level at most `rows` (rows >= 1): a constant chain."""
    if not isinstance(rows, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        r = context.cast(builder, args[0], signature.args[0], types.int64)
        return _largest_height(builder, r, geometry().heights)
    return types.int64(rows), codegen


def _largest_height(builder, r, heights):
    """The largest of heights at most r (r >= 1; 1 is always one): a chain of selects."""
    out = const(1)
    for h in sorted(heights):
        if h > 1:
            out = builder.select(builder.icmp_signed(">=", r, const(h)), const(h), out)
    return out


@intrinsic
def wide_tile_height(typingctx, rows):
    """The largest wide-tile height of this level at most `rows` (rows >= 1)."""
    if not isinstance(rows, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        r = context.cast(builder, args[0], signature.args[0], types.int64)
        return _largest_height(builder, r, geometry().wide().heights)
    return types.int64(rows), codegen


@intrinsic
def wide_cols(typingctx):
    """Columns of this level's wide tile (64 on AVX-512, 32 on AVX2)."""
    def codegen(context, builder, signature, args):
        return const(geometry().wide().cols)
    return types.int64(), codegen


@intrinsic
def max_tile_height(typingctx):
    """This level's largest tile height."""
    def codegen(context, builder, signature, args):
        return const(geometry().heights[0])
    return types.int64(), codegen


@intrinsic
def has_bf16_dot(typingctx):
    """1 when this level multiplies bfloat16 pairs natively (vdpbf16ps), else 0."""
    def codegen(context, builder, signature, args):
        return const(int(geometry().bf16_dot))
    return types.int64(), codegen


@intrinsic
def has_amx(typingctx):
    """1 when this level has AMX-BF16 tiles, else 0."""
    def codegen(context, builder, signature, args):
        return const(int(geometry().amx))
    return types.int64(), codegen


# ---- IR helpers ---------------------------------------------------------------------------

def const(n: int) -> ir.Constant:
    return ir.Constant(I64, n)


def splat(builder, value, vtype: ir.VectorType):
    """<n x T> with every lane `value`."""
    undef = ir.Constant(vtype, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(I32, 0))
    return builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(I32, vtype.count),
                                                          [0] * vtype.count))


def load_vec(builder, ptr, index, vtype: ir.VectorType, align: int):
    """A vtype at element `index` of ptr (elements of ptr's own type)."""
    p = builder.gep(ptr, [index])
    return builder.load(builder.bitcast(p, vtype.as_pointer()), align=align)


def byte_ptr(builder, ptr, byte_offset):
    """An i8* `byte_offset` bytes past ptr."""
    return builder.gep(builder.bitcast(ptr, I8.as_pointer()), [byte_offset])


def load_at_byte(builder, ptr, byte_offset, vtype: ir.VectorType, align: int = 1):
    return builder.load(builder.bitcast(byte_ptr(builder, ptr, byte_offset), vtype.as_pointer()),
                        align=align)


L2_PREFETCH_BELOW_ROWS = 2   # a tile of fewer rows prefetches its weight into L2, not L1


def weight_locality(mr: int) -> int:
    """The prefetch locality of a GEMM tile of mr rows on its weight's stream. A one-row tile
    (a batch-1 decode's GEMV) reads each weight line once, at the memory's rate, and asks for
    it into L2 (prefetcht1). Zen 4, 2 cores, SmolLM2's four matrices over 30 layers at one row,
    best of 3 interleaved runs, into L1 -> into L2: Q8_0 5.06 -> 3.88 ms, bfloat16 9.08 -> 6.97,
    float32 14.98 -> 10.77, Q4_K 3.18 -> 2.97. Taller tiles read the line again for their other
    rows and ask for it into L1: into L2 was within the noise at 2 to 8 rows and 3-7% slower at
    32 rows on the int8 tiles."""
    return 2 if mr < L2_PREFETCH_BELOW_ROWS else 3


def prefetch(builder, ptr, byte_offset, locality=3):
    """A hint to bring the cache line at byte_offset of ptr into the caches early (locality 3:
    into L1, prefetcht0; 2: into L2, prefetcht1)."""
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [I8.as_pointer(), I32, I32, I32]),
        "llvm.prefetch.p0")
    builder.call(fn, [byte_ptr(builder, ptr, byte_offset), ir.Constant(I32, 0),
                      ir.Constant(I32, locality), ir.Constant(I32, 1)])


def fma_fn(builder, vtype: ir.VectorType):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(vtype, [vtype] * 3),
                                          f"llvm.fma.v{vtype.count}f32")


def accumulators(builder, g: Geometry, mr: int, sets: int):
    """sets x mr x nv zeroed accumulators (allocas: LLVM keeps them in registers)."""
    zero = ir.Constant(g.vec, [0.0] * g.vw)
    return [[[cgutils.alloca_once_value(builder, zero) for _ in range(g.nv)] for _ in range(mr)]
            for _ in range(sets)]


def reduce_sets(builder, sets):
    """Sum every accumulator set into the first; returns it."""
    for other in sets[1:]:
        for row0, row in zip(sets[0], other, strict=True):
            for acc0, acc in zip(row0, row, strict=True):
                builder.store(builder.fadd(builder.load(acc0), builder.load(acc)), acc0)
    return sets[0]


def store_tile(builder, g: Geometry, accs, c_ptr, c_off, ldc, accumulate):
    """c[i, :NR] = accs[i] (accumulate != 0: += ) for every row i of the tile."""
    add = builder.icmp_signed("!=", accumulate, const(0))
    for i, row_accs in enumerate(accs):
        row = builder.add(c_off, builder.mul(const(i), ldc))
        for j, acc in enumerate(row_accs):
            p = builder.bitcast(builder.gep(c_ptr, [builder.add(row, const(j * g.vw))]),
                                g.vec.as_pointer())
            val = builder.load(acc)
            val = builder.select(add, builder.fadd(val, builder.load(p, align=4)), val)
            builder.store(val, p, align=4)


def array_ptr(context, builder, ty, value):
    """The data pointer of a Numba array argument."""
    return context.make_array(ty)(context, builder, value).data


def choose(builder, value, cases, emit):
    """if value == code_0: emit(kind_0) elif ... else emit(kind_last), for cases
    [(code, kind), ...]: one branch per case, chosen at run time."""
    code, kind = cases[0]
    if len(cases) == 1:
        emit(kind)
        return
    with builder.if_else(builder.icmp_signed("==", value, const(code))) as (then, other):
        with then:
            emit(kind)
        with other:
            choose(builder, value, cases[1:], emit)


@contextmanager
def counted(builder, start, stop, step: int):
    """`with counted(builder, start, stop, step) as k:` a loop over k = start, start + step, ...
    below stop (i64 values)."""
    with cgutils.for_range_slice(builder, start, stop, const(step)) as (index, _):
        yield index


def by_height(builder, mr, heights, emit):
    """switch (mr) { case h: emit(h) } for every h of heights (i64 mr; any other value: no
    code runs): one intrinsic holds every tile height of the level."""
    done = builder.append_basic_block("height.done")
    switch = builder.switch(mr, done)
    for h in heights:
        block = builder.append_basic_block(f"height.{h}")
        switch.add_case(const(h), block)
        builder.position_at_end(block)
        emit(h)
        builder.branch(done)
    builder.position_at_end(done)


# prefetch_span asks into L2: decode attention (device/kernels/attention/paged.py) prefetches
# the next 16 KB KV block while it computes on this one (a 32 KB L1 holds this block's 16 KB
# beside it at best): 32 rows of 192 keys each, 30 layers, Zen 4: 9.9-10.9 ms into L1, 7.4-8.6
# into L2, three interleaved pairs
PREFETCH_SPAN_LOCALITY = 2


@intrinsic
def prefetch_span(typingctx, arr, start, count):
    """Ask for elements start .. start + count of the 1-D array arr (one prefetch a 64-byte
    line): data the next loop iteration reads from elsewhere in memory."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, signature, args):
        arr_v, start_v, count_v = args
        ptr = array_ptr(context, builder, signature.args[0], arr_v)
        size = context.get_abi_sizeof(context.get_data_type(signature.args[0].dtype))
        first = builder.mul(start_v, const(size))
        nbytes = builder.mul(count_v, const(size))
        with cgutils.for_range_slice(builder, const(0), nbytes, const(64)) as (off, _):
            prefetch(builder, ptr, builder.add(first, off), PREFETCH_SPAN_LOCALITY)
        return context.get_dummy_value()
    return types.void(arr, types.int64, types.int64), codegen
