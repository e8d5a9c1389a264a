"""The packed GEMM on each weight format at a step's row counts: which format a batch favours.

    .venv/bin/python benchmarks/formats.py [--rows 1 32] [--formats bfloat16 Q8_0 Q5_K ...]
                                           [--shapes 576x3072 1536x576 ...] [--out F.json]

Each format's weight (K x N, as device/layout.py packs it: bfloat16 and float32 from a random
float matrix, the quantized ones from tests' random records) multiplies `rows` rows of float32
inputs through `gemm_packed`, with the inputs the server gives that format (a 16-bit weight
its own width, a quantized one int8 blocks). The weights are cold: enough copies of each, in
turn, to pass ~300 MB, as a model's layers pass, so a one-row figure is a read of memory and
a 32-row one the tiles' arithmetic on slabs from memory. Figures are GFLOP/s (2 M K N a call),
the median of --rounds rounds, the formats interleaved within a round; beside them the
machine's float32 FMA rate on data in L1 (limits.fma_peak, every core) and its read
bandwidth (limits.bandwidth). The default shapes are SmolLM2-135M's: gate/up fused
(576 x 3,072), down (1,536 x 576), QKV fused (576 x 960), O (576 x 576).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests' weight maker

from spyre_serve.device.process import configure  # noqa: E402

configure()

import numpy as np  # noqa: E402
from limits import bandwidth, fma_peak  # noqa: E402

from spyre_serve.device.isa import current  # noqa: E402
from spyre_serve.device.kernels.formats import FMT_DLF16, FORMATS, has_integer_quants, is_quantized  # noqa: E402
from spyre_serve.device.kernels.gemm.inputs import ACT_F32, ACT_INT8  # noqa: E402
from spyre_serve.device.kernels.gemm.packed import gemm_packed  # noqa: E402
from spyre_serve.device.layout import pack, pack_quantized  # noqa: E402
from tests.device.kernels.gemm.test_quantized import random_weight  # noqa: E402

PASS_BYTES = 300e6   # weight bytes a timed pass reads: copies of a weight, in turn
# every format a weight is packed in (DLFloat16 is a KV cache's rows, not a packed weight's)
CHOICES = [name for name, code in FORMATS.items() if code != FMT_DLF16]


def packed_weight(fmt: int, k: int, n: int) -> tuple[np.ndarray, int]:
    """(the packed weight, the inputs' format the server gives it)."""
    if is_quantized(fmt):
        return pack_quantized(random_weight(fmt, n, k)).reshape(-1), ACT_INT8 if has_integer_quants(fmt) else ACT_F32
    w = np.random.default_rng(k * n).standard_normal((k, n), dtype=np.float32) * np.float32(0.02)
    return pack(w, fmt).reshape(-1), fmt


def measure(fmts: list[str], rows: int, k: int, n: int, rounds: int) -> dict[str, float]:
    """GFLOP/s of each format at rows x k x n, median of ``rounds`` interleaved rounds."""
    a = np.random.default_rng(rows).standard_normal((rows, k), dtype=np.float32)
    out = np.empty((rows, n), np.float32)
    runs = {}
    for name in fmts:
        w, act = packed_weight(FORMATS[name], k, n)
        copies = max(2, min(64, int(PASS_BYTES / w.nbytes)))
        runs[name] = ([w.copy() for _ in range(copies)], act)
        gemm_packed(out, a, w, k, n, FORMATS[name], act)      # compiled before it is timed
    rates: dict[str, list[float]] = {name: [] for name in fmts}
    for r in range(rounds):
        for name in fmts if r % 2 == 0 else fmts[::-1]:
            ws, act = runs[name]
            t0 = time.perf_counter()
            for w in ws:
                gemm_packed(out, a, w, k, n, FORMATS[name], act)
            rates[name].append(2.0 * rows * k * n * len(ws) / (time.perf_counter() - t0) / 1e9)
    return {name: float(np.median(v)) for name, v in rates.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--formats", nargs="+", choices=CHOICES,
                    default=["float32", "bfloat16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"])
    ap.add_argument("--shapes", nargs="+", default=["576x3072", "1536x576", "576x960", "576x576"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    level = current().level
    peak, gbs = fma_peak(), bandwidth()["machine_gbs"]
    print(f"ISA {level}; float32 FMA on L1 data {peak:.0f} GFLOP/s, read {gbs:.1f} GB/s")
    print("| rows x K x N | " + " | ".join(args.formats) + " |")
    print("|---" * (len(args.formats) + 1) + "|")
    results = []
    for rows in args.rows:
        for shape in args.shapes:
            k, n = (int(x) for x in shape.split("x"))
            rates = measure(args.formats, rows, k, n, args.rounds)
            results.append({"rows": rows, "k": k, "n": n, "gflops": {f: round(v, 1) for f, v in rates.items()}})
            print(f"| {rows} x {k} x {n} | " + " | ".join(f"{rates[f]:.1f}" for f in args.formats) + " |",
                  flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"command": "python " + " ".join(sys.argv), "kernel_isa": level,
                                              "fma_peak_gflops": round(peak, 1), "bandwidth_gbs": round(gbs, 1),
                                              "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
