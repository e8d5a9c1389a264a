"""How many cores a step uses: its Numba kernels, its BLAS calls, and its attention.

`step_threads` decides per bucket (the constants below say why, with the measurements),
`set_step_threads` applies it on the thread that runs the kernels (the runner's compute
stream), and `attention_threads` lets the attention of an otherwise serial step use every core
when it is worth it (the step entry switches around that one kernel: slot `ATHR`).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os

import numba

# Buckets of fewer token rows than this run the whole step on one core (Numba kernels and
# BLAS): on a few rows a parallel region or a BLAS fork/join costs more than it saves, and on
# a busy machine each one can wait a whole time slice for a descheduled worker thread.
SERIAL_BELOW = 64
# ... except BLAS when a step's GEMMs are big enough to amortise a fork/join: rows x one
# layer's weight bytes at least this (granite-tiny: from 2 rows; Granite 8B widths: always).
# A single row is a GEMV, bandwidth-bound, as fast on one thread (granite-tiny: 2.36 vs 2.30
# ms for a step's weights); from 2 rows OpenBLAS packs the weights for its GEMM kernel and
# one thread is 1.4-1.8x slower than two (2, 8, 32 rows: 10.3 / 11.0 / 23.2 ms vs 6.9 / 6.4 /
# 14.2 ms). Whole decode steps, same process A/B: batch 8 15.8 -> 9.6 ms, 16: 20.2 -> 12.9.
BLAS_PARALLEL_WORK_BYTES = 16 << 20
# ... and attention, the one Numba kernel of a decode step with real work of its own: it runs
# on every core when its FLOPs reach this (~0.1 ms on one core). granite-tiny, 32 sequences
# of 192 tokens, one layer's attention: 0.59 ms on one thread, 0.32 ms on two.
ATTN_PARALLEL_FLOPS = 2_000_000


def _numba_blas_threads_setter():
    """The thread-count setter of the OpenBLAS that Numba's np.dot calls (scipy's bundled
    one, through scipy.linalg.cython_blas), or None when scipy brings no OpenBLAS of its own.

    threadpoolctl finds the OpenBLAS libraries loaded in the process; numpy's wheel loads a
    second one (ILP64, not what Numba calls), which is left alone: the one taken is the file
    that belongs to scipy's distribution. The setter is called through threadpoolctl's ctypes
    handle of that library, not through `lib.set_num_threads`, because threadpoolctl >= 3.8
    lets only the first thread that sets a pthreads OpenBLAS change it while that thread lives
    (a second runner's or the eager model's stream would be ignored silently). Cost per call,
    measured here: 1.05 us through the handle, 1.96 us through `lib.set_num_threads`; the
    runner calls it only when a step's thread counts differ from the previous step's.
    `openblas_set_num_threads_local` is named "_local", but in this build it changes the count
    for every calling thread (measured): OpenBLAS's setting is in effect process-wide."""
    import scipy.linalg.cython_blas  # noqa: F401  (loads the library Numba binds to)
    from threadpoolctl import ThreadpoolController

    scipy_dist = importlib.metadata.distribution("scipy")
    root = os.path.realpath(scipy_dist.locate_file(""))
    scipy_files = {str(f) for f in scipy_dist.files or ()}
    for lib in ThreadpoolController().select(internal_api="openblas").lib_controllers:
        if os.path.relpath(os.path.realpath(lib.filepath), root) not in scipy_files:
            continue
        fn = getattr(lib.dynlib, "openblas_set_num_threads_local", None)
        if fn is not None:
            fn.argtypes = [ctypes.c_int]
            fn.restype = ctypes.c_int
            return fn
    return None


_blas_threads = _numba_blas_threads_setter()


def attention_threads(step_threads: int, flops: int) -> int:
    """Threads for the attention kernel of a step whose other kernels use step_threads:
    0 (the same) unless the step is serial and the attention is big enough to share."""
    full = numba.config.NUMBA_NUM_THREADS
    return full if step_threads < full and flops >= ATTN_PARALLEL_FLOPS else 0


def layer_weight_bytes(weights) -> int:
    """Bytes of one layer's projection weights."""
    lw = weights.layers[0]
    return sum(x.nbytes for x in (lw.qkv, lw.o, lw.gate_up, lw.down))


def step_threads(t: int, layer_bytes: int) -> tuple[int, int]:
    """(Numba threads, BLAS threads) for a step of t token rows (see SERIAL_BELOW)."""
    full = numba.config.NUMBA_NUM_THREADS
    if t >= SERIAL_BELOW:
        return full, full
    return 1, (full if t * layer_bytes >= BLAS_PARALLEL_WORK_BYTES else 1)


def set_step_threads(n: int, blas: int | None = None) -> None:
    """Threads the calling thread's Numba kernels (n) and BLAS calls (blas, default n) use;
    Numba's setting is per calling thread, OpenBLAS's in effect process-wide."""
    numba.set_num_threads(n)
    if _blas_threads is not None:
        _blas_threads(n if blas is None else blas)
