"""The program ABI: what a compiled entry receives, and how it finds its tensors.

    entry(f32, i32, i64, u16, table)

The first four are the card's arena seen as float32, int32, int64 and uint16
(1-D, C-contiguous, same bytes). `table` is int64[n_slots], a view of the
program's operand region: slot i holds a byte address or a dimension, written
at launch. A kernel turns an address into a typed view with `view_at`, named
below for each view (`f32_at(f32, addr, n)` is `f32[addr >> 2 : (addr >> 2) + n]`), then
`.reshape(...)`. They raise on a misaligned address or a view past the arena.
"""

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.ufunc.parallel import _launch_threads

# the exact signature every entry is compiled for: arrays 1-D, C-contiguous, writable
ENTRY_ARGS = (
    types.float32[::1],
    types.int32[::1],
    types.int64[::1],
    types.uint16[::1],
    types.int64[::1],
)


@njit(nogil=True, cache=True)
def view_at(arena, addr, n):
    """`n` elements of `arena` (any of the four views) from byte address `addr`: it must be a
    multiple of the element size, and the view must lie inside the arena."""
    size = arena.itemsize
    if addr % size:
        if size == 8:
            raise ValueError("address is not 8-byte aligned (an int64 view)")
        if size == 4:
            raise ValueError("address is not 4-byte aligned (a float32 or int32 view)")
        raise ValueError("address is not 2-byte aligned (a uint16 view)")
    start = addr // size
    if addr < 0 or n < 0 or start + n > arena.shape[0]:
        raise IndexError("view lies outside the arena")
    return arena[start:start + n]


# the names the kernels use, one per arena view: f32_at(f32, addr, n) is float32[n] at byte
# address addr, i32_at(i32, ...) int32[n], i64_at(i64, ...) int64[n], u16_at(u16, ...) uint16[n]
f32_at = i32_at = i64_at = u16_at = view_at


# Work below this many elements runs on the calling thread: a parallel region costs ~5-10 us
# to open and join (TBB), more than a decode row's rmsnorm or residual takes alone. Kernels
# split into a serial worker over a range of rows and a driver that either calls it once or
# spreads chunks of rows over the cores.
SERIAL_BELOW = 1 << 15


@njit(nogil=True, cache=True, inline="always")
def chunks_for(rows, work):
    """How many chunks `rows` rows of `work` elements in all go in: 1 (this thread) below
    SERIAL_BELOW, else up to 4 a kernel thread."""
    if work < SERIAL_BELOW or rows < 2:
        return 1
    return min(rows, 4 * get_kernel_threads())


# ---- the calling thread's kernel thread count, from inside an entry -------------------------
# numba.set_num_threads / get_num_threads work in njit code too, but through ctypes pointers,
# which make the caller uncachable; these call the threading layer's symbols by name, as
# Numba's own parallel loops do, so an entry using them is still cached on disk.

@intrinsic
def get_kernel_threads(typingctx):
    """Threads the calling thread's parallel kernels use (numba.get_num_threads)."""
    _launch_threads()

    def codegen(context, builder, signature, args):
        # declared as Numba's parallel loops declare it (intp), so both can share a module
        fnty = ir.FunctionType(ir.IntType(64), [])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "get_num_threads")
        return builder.call(fn, [])
    return types.int64(), codegen


@intrinsic
def set_kernel_threads(typingctx, n):
    """Set the calling thread's parallel kernel threads (numba.set_num_threads, unchecked:
    n must be 1..NUMBA_NUM_THREADS)."""
    if not isinstance(n, types.Integer):
        return None
    _launch_threads()

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(32)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "set_num_threads")
        arg = context.cast(builder, args[0], signature.args[0], types.int64)
        builder.call(fn, [builder.trunc(arg, ir.IntType(32))])
        return context.get_dummy_value()
    return types.void(n), codegen


@intrinsic
def cycle_counter(typingctx):
    """The CPU's time-stamp counter (llvm.readcyclecounter): a cheap clock for timing the
    kernels inside an entry; ticks, converted to seconds on the host (device.profile)."""
    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                            "llvm.readcyclecounter")
        return builder.call(fn, [])
    return types.int64(), codegen
