"""The real card's clock for Granite 3.3 8B: its projected TTFT and TPOT on IBM Spyre cards
(models/sizing/projection.py over device/cost_model.py's figures), with where each step's time goes.

    .venv/bin/python benchmarks/projection.py [--tp 1 2 4] [--batch 1 32] [--context 1024]
        [--chunk 512] [--format fp16] [--kv-bytes 2] [--json OUT]

Granite 3.3 8B's real config (hidden 4096, 40 layers, 32 heads, 8 KV heads, head dim 128, MLP
12800, vocab 49159: models/checkpoints/profiles.py's granite-8b-layers with 40 layers), weights in
`--format`, at each tensor-parallel degree and batch: TTFT is a prompt of `--context` tokens
prefilled alone in chunks of `--chunk` (the plugin's way), TPOT one decode step of `--batch`
sequences each holding `--context` tokens. Nothing runs on this host: it is arithmetic, and
takes well under a second. Prints docs/spyre-fidelity.md's tables (markdown); `--json` writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spyre_serve.models.checkpoints.profiles import PROFILES  # noqa: E402
from spyre_serve.models.sizing.projection import (  # noqa: E402
    KERNELS,
    StepProjector,
    decode_step,
    prefill_steps,
)

GRANITE_8B = replace(PROFILES["granite-8b-layers"].config, num_hidden_layers=40)


def project(tp: int, batch: int, context: int, chunk: int, fmt: str, kv_bytes: float) -> dict:
    """TTFT and TPOT (seconds) and each one's kernels, at degree `tp` and `batch`."""
    projector = StepProjector(GRANITE_8B, tp, formats=fmt, kv_bytes=kv_bytes)
    prefill = [projector.project(step) for step in prefill_steps(context, chunk)]
    decode = projector.project(decode_step(batch, context))
    return {"tp": tp, "batch": batch, "ttft": sum(c.seconds for c in prefill), "tpot": decode.seconds,
            "prefill_kernels": {k: sum(c.by_kernel[k] for c in prefill) for k in KERNELS},
            "decode_kernels": decode.by_kernel}


def tables(rows: list[dict], context: int, chunk: int) -> str:
    """The summary (TTFT, TPOT, tokens/s per card set) and the kernel breakdown, in markdown."""
    out = [f"| TP | batch | TTFT, prompt {context:,} (ms) | TPOT at {context:,} (ms) | decode tokens/s |",
           "| ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        out.append(f"| {r['tp']} | {r['batch']} | {r['ttft'] * 1e3:.1f} | {r['tpot'] * 1e3:.2f} | "
                   f"{r['batch'] / r['tpot']:,.0f} |")
    prefills = {r["tp"]: r for r in rows}          # the prefill does not depend on the batch
    columns = [(f"prefill TP{tp}", r["prefill_kernels"]) for tp, r in prefills.items()]
    columns += [(f"decode TP{r['tp']} b{r['batch']}", r["decode_kernels"]) for r in rows]
    out += ["", f"Where the time goes (ms; prefill: the {-(-context // chunk)} chunks of {chunk} summed; "
            "decode: one step)", "",
            "| kernel | " + " | ".join(name for name, _ in columns) + " |",
            "| --- |" + " ---: |" * len(columns)]
    for k in KERNELS:
        out.append(f"| {k} | " + " | ".join(f"{kernels[k] * 1e3:.2f}" for _, kernels in columns) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--format", default="fp16", help="the weights' format (device/cost_model.py)")
    ap.add_argument("--kv-bytes", type=float, default=2, help="bytes of a KV cache value")
    ap.add_argument("--json", type=Path, help="write the numbers here too")
    args = ap.parse_args(argv)
    rows = [project(tp, b, args.context, args.chunk, args.format, args.kv_bytes)
            for tp in args.tp for b in args.batch]
    print(f"Granite 3.3 8B ({args.format} weights, KV cache {args.kv_bytes:g} bytes a value) "
          "on IBM Spyre cards, projected\n")
    print(tables(rows, args.context, args.chunk))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
