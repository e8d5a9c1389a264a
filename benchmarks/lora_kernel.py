"""LoRA kernel benchmark: what a decode step's adapter updates cost by the slots' rank.

A decode step of 8 rows over 4 adapters of rank 16 at SmolLM2-135M's widths (30 layers; per
layer the fused QKV's q, k, v, then o, gate/up, down: `lora_layer`'s four calls), in one run:

    tight   slots of rank 16 (--max-lora-rank 16), each adapter reads its 16 rows
    padded  slots of rank 64 (--max-lora-rank 64), each adapter reads its own 16 rows
    full    slots of rank 64 read whole (ranks marked 64: what the kernel did before it read
            a slot's own rank, every adapter zero-padded to the slots' rank)

Each is the median of --repeats runs of a whole step's updates, the three cases interleaved
round by round (a shared machine's noise falls on all three); the bytes each reads are printed
beside it with the machine's measured read bandwidth (benchmarks/limits.py).

    .venv/bin/python benchmarks/lora_kernel.py [--repeats 30]

Written to benchmarks/results/lora_kernel.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spyre_serve.device.process import configure  # noqa: E402

configure()   # threads, ISA level, compile cache: before any kernel is imported

import numpy as np  # noqa: E402

from spyre_serve.device import Card  # noqa: E402
from spyre_serve.device.isa import current as kernel_isa  # noqa: E402
from spyre_serve.models.lora.layout import (  # noqa: E402
    N_MODULES,
    ON_DOWN,
    ON_GATE_UP,
    ON_O,
    ON_QKV,
    block_offsets,
    lora_layer,
    module_dims,
)

H, QD, KD, INTER, LAYERS = 576, 576, 192, 1536, 30      # SmolLM2-135M
ROWS, ADAPTERS, RANK = 8, 4, 16
OUT = Path(__file__).resolve().parent / "results" / "lora_kernel.json"


def arena(card: Card, slot_rank: int, marked_rank: int):
    """Every layer's block of ADAPTERS slots of rank slot_rank, random adapters of rank RANK
    on all seven modules (the rows past RANK zero), ranks marked ``marked_rank``; the layer
    table's (address, R, slots) rows."""
    rng = np.random.default_rng(0)
    offs = block_offsets(H, QD, KD, INTER, slot_rank, ADAPTERS)
    block = int(offs[-1])
    t = card.zeros((LAYERS, block), np.float32)
    host = np.zeros((LAYERS, block), np.float32)
    for layer in range(LAYERS):
        row = host[layer]
        row[:N_MODULES * ADAPTERS] = 0.5
        row[N_MODULES * ADAPTERS:(N_MODULES + 1) * ADAPTERS] = marked_rank
        for m in range(N_MODULES):
            k, n = module_dims(m, H, QD, KD, INTER)
            a = row[offs[1 + 2 * m]:offs[1 + 2 * m] + ADAPTERS * slot_rank * k].reshape(ADAPTERS, slot_rank, k)
            b = row[offs[2 + 2 * m]:offs[2 + 2 * m] + ADAPTERS * slot_rank * n].reshape(ADAPTERS, slot_rank, n)
            a[:, :RANK] = rng.standard_normal((ADAPTERS, RANK, k), dtype=np.float32) * 0.01
            b[:, :RANK] = rng.standard_normal((ADAPTERS, RANK, n), dtype=np.float32) * 0.01
    t.numpy()[...] = host
    table = np.array([(t.address + i * block * 4, slot_rank, ADAPTERS) for i in range(LAYERS)], np.int64)
    return t, table


def step_runner(card: Card, table):
    """A function running one decode step's updates (per layer lora_layer's four calls) on the
    arena of ``table``, returning its seconds."""
    rng = np.random.default_rng(1)
    f32 = card.memory.view(np.float32)
    x_h = rng.standard_normal((ROWS, H), dtype=np.float32)
    x_i = rng.standard_normal((ROWS, INTER), dtype=np.float32)
    x_q = rng.standard_normal((ROWS, QD), dtype=np.float32)
    y_qkv = np.zeros((ROWS, QD + 2 * KD), np.float32)
    y_gu = np.zeros((ROWS, 2 * INTER), np.float32)
    y_h = np.zeros((ROWS, H), np.float32)
    slots = (np.arange(ROWS) % ADAPTERS).astype(np.int32)
    dims = (H, QD, KD, INTER)

    def step() -> float:
        t0 = time.perf_counter()
        for layer in range(LAYERS):
            lora = table[layer]
            lora_layer(y_qkv, x_h, f32, lora, slots, *ON_QKV, *dims)
            lora_layer(y_h, x_q, f32, lora, slots, *ON_O, *dims)
            lora_layer(y_gu, x_h, f32, lora, slots, *ON_GATE_UP, *dims)
            lora_layer(y_h, x_i, f32, lora, slots, *ON_DOWN, *dims)
        return time.perf_counter() - t0
    return step


def adapter_bytes(rank: int) -> int:
    """float32 bytes of A and B of ADAPTERS adapters read at ``rank`` over every layer."""
    per = sum(sum(module_dims(m, H, QD, KD, INTER)) for m in range(N_MODULES))
    return LAYERS * ADAPTERS * rank * per * 4


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    from benchmarks.limits import bandwidth

    card = Card(2 << 30)
    cases = {"tight": (RANK, RANK), "padded": (64, RANK), "full": (64, 64)}
    bw = bandwidth()["machine_gbs"] * 1e9
    arenas = {name: arena(card, slot_rank, marked) for name, (slot_rank, marked) in cases.items()}
    steps = {name: step_runner(card, table) for name, (_, table) in arenas.items()}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for rep in range(args.repeats + 2):       # the cases interleaved; the first two rounds warm up
        for name, step in steps.items():
            seconds = step()
            if rep >= 2:
                times[name].append(seconds)
    rows = []
    for name, (slot_rank, marked) in cases.items():
        nbytes = adapter_bytes(marked)
        rows.append({"case": name, "slot_rank": slot_rank, "rank_read": marked,
                     "ms_per_step": statistics.median(times[name]) * 1e3,
                     "adapter_mb_read": nbytes / 1e6, "floor_ms_at_read_bw": nbytes / bw * 1e3})
    isa = kernel_isa().describe()
    print(f"LoRA updates of a decode step: {ROWS} rows over {ADAPTERS} adapters of rank {RANK}, SmolLM2-135M "
          f"widths, {LAYERS} layers; {os.cpu_count()} cores, kernels {isa}; read bandwidth {bw / 1e9:.1f} GB/s\n")
    print("| case | slots' rank | rows read | ms a step | adapter MB read | floor at read bw, ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['slot_rank']} | {r['rank_read']} | {r['ms_per_step']:.2f} | "
              f"{r['adapter_mb_read']:.1f} | {r['floor_ms_at_read_bw']:.2f} |")
    tight, padded, full = (r["ms_per_step"] for r in rows)
    print(f"\npadded / tight {padded / tight:.2f}x; full (the zero-padded read) / padded {full / padded:.2f}x")
    command = "python benchmarks/lora_kernel.py " + " ".join(argv if argv is not None else sys.argv[1:])
    Path(args.out).write_text(json.dumps({"command": command.strip(), "kernel_isa": isa, "cpu_count": os.cpu_count(),
                                          "read_bandwidth_gb_s": bw / 1e9, "cases": rows}, indent=2) + "\n")
    for t, _ in arenas.values():
        card.free(t)
    card.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
