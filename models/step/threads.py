"""How many cores a step uses: every one, for every kernel; BLAS on one.

Each kernel of a step, decode or prefill, runs on every Numba thread. The packed GEMM
(device/kernels/gemm/packed.py) splits its weight panels across the cores, and a decode needs that:
a batch-1 step is a stream of every weight once, bounded by the memory bandwidth that two
cores draw, not one. OpenBLAS is called only inside attention's per-tile micro-GEMMs, each
already on one worker of a parallel loop, so the compute stream keeps BLAS at one thread and
OpenBLAS's own pool never runs beside Numba's.

This replaces a policy from the BLAS era (steps under 64 rows on one core, BLAS threads by
work size, attention switching its thread count), which made sense when every parallel region
cost a sleeping OpenMP thread's wake-up (OMP_WAIT_POLICY=PASSIVE, ~90 us here) and OpenBLAS's
pool spun beside OpenMP's. Numba now runs on TBB (device/process.py says why): a region costs a
few microseconds, and a busy neighbour process does not stall a region the way OpenMP's static
split does. Measured on a SmolLM2-135M-shaped model (fp32, 538 MB of weights), one process per
setting (ms):

    policy                                    prefill 512   decode b1   decode b8   decode b32
    serial < 64 rows, OpenMP PASSIVE (before)     1770         31.9        66.2        189
    every core, OpenMP PASSIVE                    1882         36.0        72.3        196
    every core, OpenMP spinning 1e5               1056         23.1        35.1        113
    every core, TBB (now)                                      22-26                   111-120
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os

import numba


def _numba_blas_threads_setter():
    """The thread-count setter of the OpenBLAS that Numba's np.dot calls (scipy's bundled
    one, through scipy.linalg.cython_blas), or None when scipy brings no OpenBLAS of its own.

    threadpoolctl finds the OpenBLAS libraries loaded in the process; numpy's wheel loads a
    second one (ILP64, not what Numba calls), which is left alone: the one taken is the file
    that belongs to scipy's distribution. The setter is called through threadpoolctl's ctypes
    handle of that library, not through `lib.set_num_threads`, because threadpoolctl >= 3.8
    lets only the first thread that sets a pthreads OpenBLAS change it while that thread lives
    (a second runner's or the eager model's stream would be ignored silently). Cost per call,
    measured here: 1.05 us through the handle, 1.96 us through `lib.set_num_threads`.
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


def use_every_core() -> None:
    """On the thread that runs a step's kernels (a compute stream's): Numba kernels on every
    thread, BLAS (attention's micro-GEMMs, already one per worker) on one."""
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    if _blas_threads is not None:
        _blas_threads(1)
