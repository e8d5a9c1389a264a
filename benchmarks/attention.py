"""Decode attention over a paged KV cache against a plain read of the same cache: how near a
batch's attention streams to what the machine reads; or (--prompt T) a prompt's attention, by
the rate of its causal products.

    .venv/bin/python benchmarks/attention.py [--rows 32] [--keys 192] [--layers 30] [--rounds 6]
    .venv/bin/python benchmarks/attention.py --prompt 512 [--layers 30] [--rounds 6]

SmolLM2-135M's attention (9 query heads, 3 KV heads of 64, blocks of 64 keys): --rows decode
rows, each with --keys keys in the cache, in blocks dealt at random over the cache (a running
server's tables are not in order), one cache per layer, every block a row reads and no other:
at the defaults 30 layers of 4.7 MB in bfloat16 (142 MB), more than the caches. Against it: the same
caches read whole by limits._read_all (in order, 64 chunks over the cores) and the machine's
read of one 512 MB array. For each KV format (bfloat16, float32) the median of --rounds rounds,
each the best of 5 passes over the layers, attention and read interleaved within a round.
--prompt T: one sequence of T tokens prefilled (T query rows over its own T keys, causal), its
blocks dealt at random; per format the median of --rounds rounds of the best of 5 passes, and
the causal products' rate (2 HQ T (T + 1) D multiply-adds a layer: q @ K^T and p @ V).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spyre_serve.device.process import configure  # noqa: E402

configure()

import numpy as np  # noqa: E402
from limits import _read_all, bandwidth, best_of  # noqa: E402

from spyre_serve.device.isa import current  # noqa: E402
from spyre_serve.device.kernels.attention.paged import paged_attention  # noqa: E402
from spyre_serve.device.kernels.formats import FMT_BF16, FMT_F32  # noqa: E402
from spyre_serve.device.layout import to_bf16_bits  # noqa: E402

HQ, HKV, D, BS = 9, 3, 64, 64


def caches(fmt: int, blocks: int, layers: int, rng) -> list[tuple[np.ndarray, np.ndarray]]:
    def one(shape):
        x = rng.standard_normal(shape).astype(np.float32)
        return to_bf16_bits(x) if fmt == FMT_BF16 else x
    return [(one((blocks, HKV, D, BS)), one((blocks, HKV, BS, D))) for _ in range(layers)]


def prompt(args) -> None:
    """A prompt of args.prompt tokens over each KV format: ms a pass and GFLOP/s."""
    rng = np.random.default_rng(0)
    t = args.prompt
    blocks = -(-t // BS)
    tables = rng.permutation(blocks).astype(np.int32).reshape(1, blocks)
    query_start = np.array([0, t], np.int32)
    context = np.array([t], np.int32)
    q = rng.standard_normal((t, HQ, D)).astype(np.float32)
    out = np.empty_like(q)
    flop = 2.0 * 2 * HQ * t * (t + 1) / 2 * D * args.layers
    print(f"ISA {current().level}, a prompt of {t} tokens, {args.layers} layers")
    for name, fmt in (("bfloat16", FMT_BF16), ("float32", FMT_F32)):
        kv = caches(fmt, blocks, args.layers, rng)

        def attend(kv=kv, fmt=fmt):
            for k, v in kv:
                paged_attention(out, q, k, v, tables, query_start, context, 0.125, fmt)

        ts = sorted(best_of(attend, min_reps=5, max_reps=5) for _ in range(args.rounds))
        med = ts[len(ts) // 2]
        print(f"{name:9s} prompt attention {med * 1e3:8.2f} ms  {flop / med / 1e9:6.1f} GFLOP/s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--keys", type=int, default=192)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--prompt", type=int, default=0, help="a prompt of this many tokens instead")
    args = ap.parse_args()
    if args.prompt:
        prompt(args)
        return
    rng = np.random.default_rng(0)
    per_row = -(-args.keys // BS)
    blocks = args.rows * per_row
    tables = rng.permutation(blocks).astype(np.int32).reshape(args.rows, per_row)
    query_start = np.arange(args.rows + 1, dtype=np.int32)
    context = np.full(args.rows, args.keys, np.int32)
    q = rng.standard_normal((args.rows, HQ, D)).astype(np.float32)
    out = np.empty_like(q)
    print(f"ISA {current().level}, {args.rows} rows of {args.keys} keys, {args.layers} layers")
    for name, fmt in (("bfloat16", FMT_BF16), ("float32", FMT_F32)):
        kv = caches(fmt, blocks, args.layers, rng)
        nbytes = sum(k.nbytes + v.nbytes for k, v in kv)
        flat = [(k.reshape(-1).view(np.float32), v.reshape(-1).view(np.float32)) for k, v in kv]

        def attend(kv=kv, fmt=fmt):
            for k, v in kv:
                paged_attention(out, q, k, v, tables, query_start, context, 0.125, fmt)

        def read(flat=flat):
            for k, v in flat:
                _read_all(k)
                _read_all(v)

        times: dict[str, list[float]] = {"attention": [], "read of the same caches": []}
        for _ in range(args.rounds):
            times["attention"].append(best_of(attend, min_reps=5, max_reps=5))
            times["read of the same caches"].append(best_of(read, min_reps=5, max_reps=5))
        for what, ts in times.items():
            med = sorted(ts)[len(ts) // 2]
            print(f"{name:9s} {what:24s} {med * 1e3:6.2f} ms  {nbytes / med / 1e9:5.1f} GB/s "
                  f"({nbytes / 1e6:.0f} MB)")
    print(f"read of one 512 MB array  {bandwidth()['machine_gbs']:5.1f} GB/s")


if __name__ == "__main__":
    main()
