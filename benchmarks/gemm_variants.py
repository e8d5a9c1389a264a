"""GEMM inside njit: BLAS (np.dot) against the hand-written tiled kernel.

Prints GFLOP/s for each shape and variant, all measured in this run, plus
torch's CPU matmul as the peer. Short on purpose (shared machine):

    .venv/bin/python benchmarks/gemm_variants.py [--quick]
"""

import sys
import time

import numpy as np

from device.kernels.gemm import gemm, gemm_bt, gemm_tiled


def best_seconds(reps, fn, *args):
    fn(*args)  # warm-up (compile, caches)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    quick = "--quick" in sys.argv
    try:
        import torch
    except ImportError:
        torch = None
    shapes = [(1, 4096, 4096), (32, 4096, 4096), (512, 4096, 4096),
              (1, 1024, 1024), (32, 1024, 1024), (512, 1024, 1024)]
    if quick:
        shapes = [s for s in shapes if s[1] == 1024]
    rng = np.random.default_rng(0)
    print(f"{'M':>5} {'K':>5} {'N':>5} {'blas':>9} {'blas_bt':>9} {'tiled':>9} {'torch':>9}  GFLOP/s")
    for m, k, n in shapes:
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        bt = np.ascontiguousarray(b.T)
        out = np.empty((m, n), np.float32)
        flops = 2.0 * m * k * n
        reps = 3 if m == 512 and k == 4096 else 10
        res = {
            "blas": best_seconds(reps, gemm, out, a, b),
            "blas_bt": best_seconds(reps, gemm_bt, out, a, bt),
            "tiled": best_seconds(reps, gemm_tiled, out, a, b),
        }
        if torch is not None:
            res["torch"] = best_seconds(reps, torch.matmul, torch.from_numpy(a), torch.from_numpy(b))
        cells = " ".join(f"{flops / res[v] / 1e9:9.1f}" if v in res else f"{'-':>9}"
                         for v in ("blas", "blas_bt", "tiled", "torch"))
        print(f"{m:5d} {k:5d} {n:5d} {cells}")


if __name__ == "__main__":
    main()
