"""Batch-1 GEMVs against a plain read of the same arrays: how near a decode step's matrices
stream to what the machine reads in that pattern.

    .venv/bin/python benchmarks/gemv.py [--layers 30] [--rounds 6]

The matrices of SmolLM2-135M's Q4_K_M file as the card holds them (per layer a fused QKV in
Q8_0 576 x 960, O in Q5_K 576 x 576, gate/up in Q5_K 576 x 3,072, down in Q4_K 1,536 x 576:
93 MB over 30 layers, more than the caches), one row of int8 inputs each, in a step's order.
Against them: the same arrays summed by limits._read_all (a vectorized read, 64 chunks over
the cores), and the machine's read of one 512 MB array (limits.bandwidth, what
benchmarks/model.py's batch-1 floor divides by). Each figure is the median of --rounds
rounds (each the best of 5 passes), the kinds interleaved within a round, at 1 and 2 threads.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests' weight maker

from spyre_serve.device.process import configure  # noqa: E402

configure()

import numba  # noqa: E402
import numpy as np  # noqa: E402
from limits import _read_all, bandwidth  # noqa: E402

from spyre_serve.device.isa import current  # noqa: E402
from spyre_serve.device.kernels.formats import FMT_Q4_K, FMT_Q5_K, FMT_Q8_0  # noqa: E402
from spyre_serve.device.kernels.gemm.inputs import ACT_INT8  # noqa: E402
from spyre_serve.device.kernels.gemm.packed import gemm_packed  # noqa: E402
from spyre_serve.device.layout import pack_quantized  # noqa: E402
from tests.device.kernels.gemm.test_quantized import random_weight  # noqa: E402

SHAPES = [(FMT_Q8_0, 576, 960), (FMT_Q5_K, 576, 576), (FMT_Q5_K, 576, 3072), (FMT_Q4_K, 1536, 576)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    layers = [[pack_quantized(random_weight(f, n, k, seed=4 * i + j)).reshape(-1)
               for j, (f, k, n) in enumerate(SHAPES)] for i in range(args.layers)]
    nbytes = sum(w.nbytes for layer in layers for w in layer)
    ins = {k: np.random.default_rng(k).standard_normal((1, k)).astype(np.float32) for _, k, _ in SHAPES}
    outs = {n: np.empty((1, n), np.float32) for _, _, n in SHAPES}
    as_f32 = [[w.view(np.float32) for w in layer] for layer in layers]

    def gemv():
        for layer in layers:
            for w, (f, k, n) in zip(layer, SHAPES, strict=True):
                gemm_packed(outs[n], ins[k], w, k, n, f, ACT_INT8)

    def read():
        for layer in as_f32:
            for w in layer:
                _read_all(w)

    print(f"ISA {current().level}, {args.layers} layers, {nbytes / 1e6:.1f} MB of matrices")
    for threads in (1, 2):
        numba.set_num_threads(threads)
        times: dict[str, list[float]] = {"gemv": [], "read of the same arrays": []}
        for _ in range(args.rounds):
            for name, fn in (("gemv", gemv), ("read of the same arrays", read)):
                fn()
                best = float("inf")
                for _ in range(5):
                    t0 = time.perf_counter()
                    fn()
                    best = min(best, time.perf_counter() - t0)
                times[name].append(best)
        for name, ts in times.items():
            med = sorted(ts)[len(ts) // 2]
            print(f"threads {threads}  {name:24s} {med * 1e3:6.2f} ms  {nbytes / med / 1e9:5.1f} GB/s")
        print(f"threads {threads}  read of one 512 MB array  {bandwidth()['machine_gbs']:5.1f} GB/s")


if __name__ == "__main__":
    main()
