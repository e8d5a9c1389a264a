"""The machine's own limits, measured in the run that compares against them.

    bandwidth(nbytes)        memory read GB/s: a numpy sum and an njit parallel read; the best
    gemm_peak(shapes)        GFLOP/s: the best of BLAS's sgemm (np.dot in njit, OpenBLAS) and the
                             card's packed GEMM at each shape, the best shape the machine figure
    fma_peak()               GFLOP/s of the card's microkernel on data that sits in L1, on every
                             core at once: what the floating-point units give, the ceiling above

Every figure is the best of a few repetitions (`best_of`): on a shared machine the best run is
the one least disturbed, which is what a limit means.
"""

from __future__ import annotations

import time

import numba
import numpy as np
from numba import njit, prange

from spyre_serve.device.kernels.formats import FMT_F32
from spyre_serve.device.kernels.gemm.inputs import ACT_F32
from spyre_serve.device.kernels.gemm.microkernel import tile
from spyre_serve.device.kernels.gemm.packed import gemm_packed
from spyre_serve.device.kernels.simd import NR, geometry
from spyre_serve.device.layout import pack


@njit(nogil=True, cache=True)
def blas_gemm(out, a, b):
    """out[M, N] = a[M, K] @ b[K, N] by BLAS (np.dot in njit: scipy's OpenBLAS), the reference
    the packed GEMM is measured against."""
    np.dot(a, b, out)


def best_of(fn, *, min_reps=2, max_reps=20, budget=0.4):
    """Best wall time of fn() after one warm-up; repeats until `budget` seconds or max_reps."""
    fn()
    best, spent, reps = float("inf"), 0.0, 0
    while reps < min_reps or (spent < budget and reps < max_reps):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent, reps = min(best, dt), spent + dt, reps + 1
    return best


# ---- memory bandwidth -------------------------------------------------------------------

@njit(nogil=True, cache=True, fastmath=True)
def _read_span(x):
    # reassociated (fastmath): the sum vectorizes into several independent accumulators, so
    # the loads, not the adds, set the pace
    s = np.float32(0.0)
    for i in range(x.shape[0]):
        s += x[i]
    return s


@njit(nogil=True, parallel=True, cache=True)
def _read_all(x):
    # x: f32[n], read once in one contiguous span a chunk
    chunks = 64
    n = x.shape[0]
    acc = 0.0
    for c in prange(chunks):
        acc += _read_span(x[c * n // chunks:(c + 1) * n // chunks])
    return acc


def bandwidth(nbytes: int = 512 << 20) -> dict:
    """Read bandwidth (GB/s) of a numpy sum and an njit parallel read of nbytes; the better is
    the machine figure."""
    x = np.ones(nbytes // 4, np.float32)
    res = {
        "numpy_sum_gbs": nbytes / best_of(lambda: x.sum(), min_reps=3) / 1e9,
        "njit_read_gbs": nbytes / best_of(lambda: _read_all(x), min_reps=3) / 1e9,
        "bytes": nbytes,
    }
    res["machine_gbs"] = max(res["numpy_sum_gbs"], res["njit_read_gbs"])
    return res


# ---- GEMM --------------------------------------------------------------------------------

def gemm_peak(shapes, budget: float = 1.0) -> tuple[float, dict]:
    """(best GFLOP/s, {"MxKxN": {"blas": ..., "packed": ...}}) over (M, K, N) shapes, each
    measured with BLAS's sgemm (on every core: a runner keeps OpenBLAS at one thread, a
    process-wide setting) and with the card's packed GEMM on the same numbers."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=numba.get_num_threads(), user_api="blas"):
        return _gemm_peak(shapes, budget)


def _gemm_peak(shapes, budget):
    rng = np.random.default_rng(0)
    table = {}
    for m, k, n in shapes:
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32) * 0.02
        wp = pack(b, FMT_F32).reshape(-1)
        out = np.empty((m, n), np.float32)
        flop = 2.0 * m * k * n
        table[f"{m}x{k}x{n}"] = {
            "blas": flop / best_of(lambda a=a, b=b, o=out: blas_gemm(o, a, b), min_reps=3,
                                   budget=budget) / 1e9,
            "packed": flop / best_of(lambda a=a, w=wp, o=out, k=k, n=n: gemm_packed(
                o, a, w, k, n, FMT_F32, ACT_F32), min_reps=3, budget=budget) / 1e9,
        }
    return max(max(v.values()) for v in table.values()), table


@njit(nogil=True, parallel=True, cache=True)
def _fma_loop(out, a, w, reps, mr):
    # each core: the gemm's microkernel (its tallest tile, mr x NR, over a [256, NR] slab),
    # again and again, on data that stays in L1
    for c in prange(out.shape[0]):
        for _ in range(reps):
            tile(mr, a[c], 0, 256, w, 0, NR, out[c], 0, NR, 256, 1, FMT_F32)


def fma_peak(seconds: float = 0.3) -> float:
    """GFLOP/s of the microkernel on L1-resident data, one tile per core, every core."""
    cores = numba.get_num_threads()
    MR = geometry().heights[0]   # noqa: N806  (the level's tile height)
    a = np.ones((cores, MR * 256), np.float32)
    w = np.ones(256 * NR, np.float32)
    out = np.zeros((cores, MR * NR), np.float32)
    reps = 2000
    t = best_of(lambda: _fma_loop(out, a, w, reps, MR), min_reps=3, budget=seconds)
    return cores * reps * 2.0 * MR * NR * 256 / t / 1e9
