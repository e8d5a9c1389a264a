"""LoRA's cost: SmolLM2-135M-Instruct with 4 adapters mixed in one batch against the base alone.

Two spyre-serve servers on the same float32 checkpoint (benchmarks/peers/smollm2.py's): `plain`
without LoRA, and `lora` with `--enable-lora --max-loras 4` and four random PEFT adapters of
rank 16 on all seven projections (written once into --adapters-dir by peft, as the tests write
theirs). At each concurrency level, in turn for --rounds rounds (each keeping its best round,
benchmarks/serving.py's method): `plain` serving the base, `lora` serving the base, and `lora`
with its requests spread over the four adapters (request i asks for adapter i % 4), every
level and round with prompts of its own (random token ids, none sent twice), 128 tokens out.

    python benchmarks/lora.py --concurrency 8 --rounds 2

Prints the table and the ratios (mixed adapters / the base on the plain server: the issue's
target is >= 0.8 at c=8) with the kernels' ISA; writes JSON to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))

from benchmarks.serving import (  # noqa: E402
    PromptSets,
    id_prompt_maker,
    one,
    publish,
    server_args,
    spyre_server,
    start_server,
    stop_server,
    summarize,
)

ADAPTERS = [f"ad{i}" for i in range(4)]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapters(base: Path, out: Path) -> dict[str, Path]:
    """Four random rank-16 PEFT adapters of ``base`` under ``out`` (kept between runs)."""
    from tests.models.lora_adapters import write_lora_adapter

    paths = {}
    for i, name in enumerate(ADAPTERS):
        path = out / name
        if not (path / "adapter_model.safetensors").exists():
            write_lora_adapter(base, path, r=16, alpha=32, targets=TARGETS, seed=i, std=0.02)
        paths[name] = path
    return paths


async def level(base_url: str, models: list[str], prompts: list, c: int, output_tokens: int, timeout: float):
    """``prompts`` sent ``c`` at a time, request i to ``models[i % len(models)]``."""
    sem = asyncio.Semaphore(c)
    host, port = base_url.removeprefix("http://").rsplit(":", 1)

    async def limited(i, p):
        async with sem:
            body = {"model": models[i % len(models)], "prompt": p, "max_tokens": output_tokens,
                    "temperature": 0.0, "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}
            return await one(host, int(port), "/v1/completions", body, timeout)

    t0 = time.perf_counter()
    results = await asyncio.gather(*[limited(i, p) for i, p in enumerate(prompts)])
    return list(results), time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--adapters-dir", default=str(Path.home() / ".cache" / "spyre-serve" / "lora-bench"))
    server_args(ap, "lora.json")
    args = ap.parse_args(argv)
    from smollm2 import paths

    from spyre_serve.device.isa import current as kernel_isa

    hf = paths(args.peers_cache)["hf_f32"]
    adapters = write_adapters(hf, Path(args.adapters_dir))
    vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
    modes = [("plain", ["smollm2"]), ("lora-base", ["smollm2"]), ("lora-mixed", ADAPTERS)]
    make = id_prompt_maker(vocab, args.prompt_tokens)
    prompt_sets = {mode: PromptSets(make, args) for mode, _ in modes}     # each mode its own prompts
    plain = spyre_server("plain", str(hf), "smollm2", args, [])
    lora = spyre_server("lora", str(hf), "smollm2", args,
                        ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "16", "--lora-modules",
                         *[f"{n}={p}" for n, p in adapters.items()]])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    best = {}
    try:
        for srv in (plain, lora):
            start_server(srv, env, args, prompt_sets["plain"].warmup)
        for c in args.concurrency:
            for rnd in range(args.rounds):
                for mode, models in modes:
                    srv = plain if mode == "plain" else lora
                    results, duration = asyncio.run(level(srv.base, models, prompt_sets[mode].level(c, rnd), c,
                                                          args.output_tokens, args.request_timeout))
                    got = summarize(mode, c, results, duration, None)
                    print(f"  {mode} c={c} round {rnd + 1}: {got.output_tok_s} tok/s, failed {got.failed}",
                          file=sys.stderr, flush=True)
                    if (mode, c) not in best or (got.failed, -got.output_tok_s) < (best[(mode, c)].failed,
                                                                                   -best[(mode, c)].output_tok_s):
                        best[(mode, c)] = got
    finally:
        for srv in (plain, lora):
            stop_server(srv)
    levels = [best[(m, c)] for m, _ in modes for c in args.concurrency if (m, c) in best]
    lines = []
    for c in args.concurrency:
        p, b, m = (best.get((mode, c)) for mode, _ in modes)
        if p and b and m and not (p.failed or b.failed or m.failed):
            lines.append(f"- c={c}: 4 adapters mixed {m.output_tok_s} tok/s = {m.output_tok_s / p.output_tok_s:.2f}x "
                         f"the base on the plain server ({p.output_tok_s}; target >= 0.8x at c=8); the base on the "
                         f"LoRA server {b.output_tok_s} = {b.output_tok_s / p.output_tok_s:.2f}x")
    command = "python benchmarks/lora.py " + " ".join(argv if argv is not None else sys.argv[1:])
    report = {"command": command.strip(), "checkpoint": str(hf), "kernel_isa": kernel_isa().describe(),
              "adapters": {"rank": 16, "targets": TARGETS, "count": len(ADAPTERS)},
              "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens, "cpu_count": os.cpu_count(),
              "rounds": args.rounds, "levels": [asdict(v) for v in levels], "ratios": lines}
    return publish(args.out, report, "SmolLM2-135M-Instruct float32, 4 adapters of rank 16 on all projections, "
                   f"kernels {kernel_isa().describe()}", levels, lines)


if __name__ == "__main__":
    sys.exit(main())
