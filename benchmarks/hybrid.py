"""Granite 4.0's hybrid on the card against llama.cpp on the same GGUF file and transformers on
the same checkpoint, in one run.

    benchmarks/peers/llamacpp.sh && .venv/bin/python benchmarks/hybrid.py [--rounds 2] [--long 8192]

The checkpoint is written here by transformers (seeded random weights): a hybrid of our own
shape with Granite 4.0-H-Micro's kind of layers (Mamba-2 mixers, one attention layer in four
without position embedding, a dense shared MLP, no experts): hidden 1024, 8 layers, Mamba-2 32
heads of 64 with a state of 128, attention 16 heads of 64 (4 KV heads), MLP 2816, float32, and
SmolLM2's tokenizer (vocabulary 49152; one llama.cpp's converter knows). llama.cpp's own
converter (convert_hf_to_gguf.py, from the peer's checkout) makes it an F32 GGUF file, which
both we and llama.cpp serve; transformers runs the checkpoint directory. Figures, each the best
of --rounds:

  - prefill of a 512-token prompt (tokens/s);
  - batch-1 decode (ms a token) after a 1,024-token and after a --long-token context: the
    hybrid's point is that its Mamba layers' cost does not grow with the context, only its
    attention layers' do;
  - batch-8 and batch-32 decode (tokens/s) after 128-token prompts.

Ours runs the step program, timed as benchmarks/model.py times it (device-fed decode tokens,
step N+1 launched before step N is read); llama.cpp runs its own benchmarks on the file
(llama-bench: -p 512 for the prefill, -n with -d for batch-1 decode at a depth;
llama-batched-bench: -npp 128 -ntg N -npl 8,32 for the batches, its S_TG); transformers runs its
own model eagerly (its chunked SSD scan for prompts, its state update for decode tokens; greedy
`generate`, a decode step timed from one token's logits to the next's). Threads: 2 for each. Results:
benchmarks/results/hybrid.json, with the ISA level. Without the llama.cpp peer built
(benchmarks/peers/llamacpp.sh) its columns are left out and said so.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# the model benchmark's process set-up (threads, offline hub, configure()) and its program-path timers
import numpy as np  # noqa: E402

from benchmarks.limits import bandwidth  # noqa: E402
from benchmarks.model import BLOCK, THREADS, runtime_decode, runtime_prefill  # noqa: E402
from benchmarks.peers.smollm2 import paths as peer_paths  # noqa: E402
from spyre_serve.device import Card  # noqa: E402
from spyre_serve.device.isa import current  # noqa: E402
from spyre_serve.models import ModelRunner, load_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "hybrid.json"
CHECKPOINT = Path.home() / ".cache" / "spyre-serve" / "bench-hybrid-49k"
GGUF = CHECKPOINT.with_name(CHECKPOINT.name + ".f32.gguf")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
SHAPE = dict(vocab_size=49152, hidden_size=1024, intermediate_size=2816, shared_intermediate_size=2816,
             num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
             layer_types=["mamba", "mamba", "mamba", "attention"] * 2, mamba_n_heads=32, mamba_d_head=64,
             mamba_d_state=128, mamba_n_groups=1, mamba_expand=2, num_local_experts=0, num_experts_per_tok=0,
             position_embedding_type="nope", max_position_embeddings=16384, embedding_multiplier=12.0,
             residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=8.0)


def checkpoint():
    """The benchmark's checkpoint (written once, with SmolLM2's tokenizer files) and
    transformers' model of it."""
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    torch.manual_seed(0)
    if not (CHECKPOINT / "config.json").is_file():
        tokenizer = peer_paths()["hf_f32"]
        if not (tokenizer / "tokenizer.json").is_file():
            sys.exit(f"no SmolLM2 tokenizer at {tokenizer}: run benchmarks/peers/smollm2.py first")
        model = GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(**SHAPE, bos_token_id=1, eos_token_id=2,
                                                                   pad_token_id=2)).float().eval()
        model.save_pretrained(CHECKPOINT)
        # the published configs' spelling of the layer kinds (transformers 5 writes its own,
        # "linear_attention"/"full_attention", which llama.cpp's converter does not read)
        config = json.loads((CHECKPOINT / "config.json").read_text())
        config["layer_types"] = SHAPE["layer_types"]
        (CHECKPOINT / "config.json").write_text(json.dumps(config, indent=2))
        for f in TOKENIZER_FILES:
            shutil.copyfile(tokenizer / f, CHECKPOINT / f)
    return GraniteMoeHybridForCausalLM.from_pretrained(CHECKPOINT, dtype=torch.float32).eval()


def gguf() -> Path:
    """The checkpoint as an F32 GGUF file, by llama.cpp's own converter (once)."""
    peers = peer_paths()["cache"] / "llama.cpp"
    if not GGUF.is_file():
        tmp = GGUF.with_suffix(".tmp")
        subprocess.run([str(peers / "convert-venv" / "bin" / "python"), str(peers / "src" / "convert_hf_to_gguf.py"),
                        str(CHECKPOINT), "--outtype", "f32", "--outfile", str(tmp)], check=True)
        tmp.rename(GGUF)
    return GGUF


# ---- llama.cpp: its own benchmark tools on the same file --------------------------------

def llamacpp_bin(name: str) -> Path | None:
    path = peer_paths()["llama_server"].with_name(name)
    return path if path.is_file() else None


def llamacpp(args, rounds: int, steps: int) -> dict[str, dict[str, float]]:
    """llama.cpp's figures on GGUF, keyed as ours: llama-bench (prefill; batch-1 decode at the
    two depths) and llama-bench-batched (batch 8 and 32 after 128-token prompts)."""
    bench, batched = llamacpp_bin("llama-bench"), llamacpp_bin("llama-batched-bench")
    common = ["-m", str(GGUF), "-t", THREADS]
    out: dict[str, dict[str, float]] = {}
    run = subprocess.run([str(bench), *common, "-r", str(rounds), "-o", "json", "-p", "512", "-n", "0"],
                         check=True, capture_output=True, text=True)
    out["prefill_512"] = {"llamacpp_tok_s": json.loads(run.stdout)[0]["avg_ts"]}
    run = subprocess.run([str(bench), *common, "-r", str(rounds), "-o", "json", "-p", "0", "-n", str(steps),
                          "-d", f"1024,{args.long}"], check=True, capture_output=True, text=True)
    for row in json.loads(run.stdout):
        tok_s = max(row["samples_ts"])
        out[f"decode_b1_ctx{row['n_depth']}"] = {"llamacpp_tok_s": tok_s, "llamacpp_ms_per_step": 1e3 / tok_s}
    for _ in range(rounds):
        run = subprocess.run([str(batched), *common, "-c", str(32 * (128 + steps) + 64), "-b", "2048",
                              "-npp", "128", "-ntg", str(steps), "-npl", "8,32", "--output-format", "jsonl"],
                             check=True, capture_output=True, text=True)
        for line in run.stdout.splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                key = f"decode_b{row['pl']}_ctx128"
                tok_s = row["speed_tg"]
                keep = out.setdefault(key, {"llamacpp_tok_s": 0.0})
                if tok_s > keep["llamacpp_tok_s"]:
                    keep.update(llamacpp_tok_s=tok_s, llamacpp_ms_per_step=1e3 * row["pl"] / tok_s)
    return out


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

def hf_decode(model, batch, steps: int) -> float:
    """Seconds of `steps` decode tokens: from the first token's logits (the prompt's forward
    done) to the last one's, stamped by a logits processor as `generate` calls it (a difference
    of two whole `generate` runs carries two prefills' noise, which at 8k tokens swamps the
    decode steps)."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    ids = torch.tensor(batch)
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps + 1, min_new_tokens=steps + 1,
                       do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([Stamp()]))
    assert len(stamps) == steps + 1, len(stamps)
    return stamps[-1] - stamps[0]


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
    peer = llamacpp_bin("llama-bench") and llamacpp_bin("llama-batched-bench")
    if not peer:
        print("llama.cpp's llama-bench and llama-batched-bench are not built (benchmarks/peers/llamacpp.sh): "
              "its columns are left out", flush=True)
    source = gguf() if peer else CHECKPOINT          # ours serves the file llama.cpp serves
    card = Card(4 << 30)
    model = load_model(source, card, tokenizer=False)
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
    bandwidth_gbs = 0.0
    for r in range(args.rounds):
        bandwidth_gbs = max(bandwidth_gbs, bandwidth(512 << 20)["machine_gbs"])
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
    weight_bytes = model.weights.nbytes           # what a batch-1 step reads (the KV and states: little)
    runner.close()
    card.close()
    if peer:
        for name, figures in llamacpp(args, args.rounds, args.steps).items():
            best[name].update(figures)
    peers = ["transformers", *(["llamacpp"] if peer else [])]
    print(f"\nhybrid (hidden 1024, 8 layers, 6 Mamba-2 + 2 attention; kernels {current().level}, threads {THREADS})")
    for name, f in best.items():
        cols = "".join(f"   {p} {f[p + '_tok_s']:9.1f} tok/s ({f['ours_tok_s'] / f[p + '_tok_s']:5.2f}x)"
                       for p in peers)
        step = f"   (ours {f['ours_ms_per_step']:.2f} ms a step)" if "ours_ms_per_step" in f else ""
        print(f"  {name:22s} ours {f['ours_tok_s']:9.1f} tok/s{cols}{step}")
    short, long = best["decode_b1_ctx1024"], best[f"decode_b1_ctx{args.long}"]
    growth = {p: long[p + "_ms_per_step"] / short[p + "_ms_per_step"] for p in ["ours", *peers]}
    print(f"  batch-1 TPOT at {args.long} vs 1024 tokens of context: "
          + ", ".join(f"{p} x{g:.2f}" for p, g in growth.items()))
    floor_ms = 1e3 * weight_bytes / (bandwidth_gbs * 1e9)
    print(f"  batch-1 floor: {weight_bytes / 1e6:.0f} MB of weights at {bandwidth_gbs:.1f} GB/s = {floor_ms:.1f} ms; "
          f"ours at 1,024 tokens of context {short['ours_ms_per_step'] / floor_ms:.2f}x it")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"isa": current().level, "threads": int(THREADS), "shape": SHAPE,
                                   "ours_from": source.name, "figures": best, "tpot_growth": growth,
                                   "limits": {"bandwidth_gbs": bandwidth_gbs, "weight_bytes": weight_bytes,
                                              "batch1_floor_ms": floor_ms}},
                                  indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
