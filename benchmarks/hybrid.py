"""Granite 4.0's hybrid on the card against transformers on the same checkpoint, in one run.

    .venv/bin/python benchmarks/hybrid.py [--rounds 2] [--long 8192]

The checkpoint is written here by transformers (seeded random weights): a hybrid of our own
shape with Granite 4.0-H-Micro's kind of layers (Mamba-2 mixers, one attention layer in four
without position embedding, a dense shared MLP, no experts): hidden 1024, 8 layers, Mamba-2 32
heads of 64 with a state of 128, attention 16 heads of 64 (4 KV heads), MLP 2816, vocabulary
8192, float32. Figures, each the best of --rounds:

  - prefill of a 512-token prompt (tokens/s);
  - batch-1 decode (ms a token) after a 1,024-token and after a --long-token context: the
    hybrid's point is that its Mamba layers' cost does not grow with the context, only its
    attention layers' do;
  - batch-8 and batch-32 decode (tokens/s) after 128-token prompts.

Ours runs the step program, timed as benchmarks/model.py times it (device-fed decode tokens,
step N+1 launched before step N is read);
transformers runs its own model eagerly (its chunked SSD scan for prompts, its state update
for decode tokens; greedy `generate`, decode time = (N tokens - 1 token) / (N - 1)). Threads: 2
for Numba, BLAS and torch alike. Results: benchmarks/results/hybrid.json, with the ISA level.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# the model benchmark's process set-up (threads, offline hub, configure()) and its program-path timers
import numpy as np  # noqa: E402

from benchmarks.model import BLOCK, THREADS, runtime_decode, runtime_prefill  # noqa: E402
from spyre_serve.device import Card  # noqa: E402
from spyre_serve.device.isa import current  # noqa: E402
from spyre_serve.models import ModelRunner, load_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "hybrid.json"
CHECKPOINT = Path.home() / ".cache" / "spyre-serve" / "bench-hybrid"
SHAPE = dict(vocab_size=8192, hidden_size=1024, intermediate_size=2816, shared_intermediate_size=2816,
             num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
             layer_types=["mamba", "mamba", "mamba", "attention"] * 2, mamba_n_heads=32, mamba_d_head=64,
             mamba_d_state=128, mamba_n_groups=1, mamba_expand=2, num_local_experts=0,
             position_embedding_type="nope", max_position_embeddings=16384, embedding_multiplier=12.0,
             residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=8.0)


def checkpoint():
    """The benchmark's checkpoint (written once) and transformers' model of it."""
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    torch.manual_seed(0)
    if not (CHECKPOINT / "config.json").is_file():
        model = GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(**SHAPE)).float().eval()
        model.save_pretrained(CHECKPOINT)
    return GraniteMoeHybridForCausalLM.from_pretrained(CHECKPOINT, dtype=torch.float32).eval()


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, SHAPE["vocab_size"], length).tolist() for _ in range(n)]


# ---- ours: benchmarks/model.py's timers ---------------------------------------------------

def ours_prefill(runner, prompt) -> float:
    run = runtime_prefill(runner, prompt)
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


# ---- transformers -------------------------------------------------------------------------

def hf_generate(model, batch: list[list[int]], new: int) -> float:
    import torch

    ids = torch.tensor(batch)
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0


def hf_decode(model, batch, steps: int) -> float:
    """Seconds of `steps` decode tokens: generating steps + 1 tokens less generating one."""
    return hf_generate(model, batch, steps + 1) - hf_generate(model, batch, 1)


def hf_prefill(model, prompt) -> float:
    import torch

    t0 = time.perf_counter()
    with torch.no_grad():
        model(torch.tensor([prompt]))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--long", type=int, default=8192, help="the long context of the batch-1 decode")
    ap.add_argument("--steps", type=int, default=32, help="decode steps measured")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(int(THREADS))
    ref = checkpoint()
    card = Card(4 << 30)
    model = load_model(CHECKPOINT, card, tokenizer=False)
    runner = ModelRunner(model, card, max_num_seqs=32, max_num_batched_tokens=512, block_size=BLOCK,
                         num_kv_blocks=32 * 4 + (args.long + 2 * args.steps) // BLOCK + 8,
                         max_model_len=args.long + 2 * args.steps + BLOCK, seed=0)
    t0 = time.perf_counter()
    runner.warmup(progress=False)
    print(f"ours: {len(runner.programs)} step programs ready in {time.perf_counter() - t0:.0f} s "
          f"(kernels {current().level})", flush=True)
    cases = {
        "prefill_512": (prompts(1, 512, 1)[0], None),
        "decode_b1_ctx1024": (prompts(1, 1024, 2), args.steps),
        f"decode_b1_ctx{args.long}": (prompts(1, args.long, 3), args.steps),
        "decode_b8_ctx128": (prompts(8, 128, 4), args.steps),
        "decode_b32_ctx128": (prompts(32, 128, 5), args.steps),
    }
    best: dict[str, dict[str, float]] = {}
    for r in range(args.rounds):
        for name, (work, steps) in cases.items():
            if steps is None:
                ours, theirs = ours_prefill(runner, work), hf_prefill(ref, work)
                figures = {"ours_tok_s": len(work) / ours, "transformers_tok_s": len(work) / theirs}
            else:
                ours, theirs = runtime_decode(runner, work, steps), hf_decode(ref, work, steps)
                n = len(work) * steps
                figures = {"ours_ms_per_step": 1e3 * ours / steps, "transformers_ms_per_step": 1e3 * theirs / steps,
                           "ours_tok_s": n / ours, "transformers_tok_s": n / theirs}
            keep = best.setdefault(name, figures)
            for k, v in figures.items():
                keep[k] = min(keep[k], v) if k.endswith("ms_per_step") else max(keep[k], v)
            print(f"  round {r + 1}: {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()), flush=True)
    runner.close()
    card.close()
    print(f"\nhybrid (hidden 1024, 8 layers, 6 Mamba-2 + 2 attention; kernels {current().level}, threads {THREADS})")
    for name, f in best.items():
        ratio = f["ours_tok_s"] / f["transformers_tok_s"]
        step = f"   (ours {f['ours_ms_per_step']:.2f} ms a step)" if "ours_ms_per_step" in f else ""
        print(f"  {name:22s} ours {f['ours_tok_s']:9.1f} tok/s   transformers {f['transformers_tok_s']:9.1f} tok/s"
              f"   {ratio:5.2f}x{step}")
    short, long = best["decode_b1_ctx1024"], best[f"decode_b1_ctx{args.long}"]
    growth = long["ours_ms_per_step"] / short["ours_ms_per_step"]
    theirs = long["transformers_ms_per_step"] / short["transformers_ms_per_step"]
    print(f"  batch-1 TPOT at {args.long} vs 1024 tokens of context: ours x{growth:.2f}, transformers x{theirs:.2f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"isa": current().level, "threads": int(THREADS), "shape": SHAPE,
                                   "figures": best, "tpot_growth": {"ours": growth, "transformers": theirs}},
                                  indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
