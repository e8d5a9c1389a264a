"""Speculative decoding's gain: SmolLM2-135M-Instruct served with and without ngram proposals.

Two spyre-serve servers on the same checkpoint (benchmarks/peers/smollm2.py's float32 one), one
with `--speculative-config` (ngram prompt lookup), each measured at every concurrency level in
turn (rounds interleaved, each keeping its best round: benchmarks/serving.py's method). The
prompts quote their context: a passage of the shipped prose corpus and an instruction to copy or
edit it (SmolLM2's chat template, sent to /v1/completions), a different passage for every
request of every level and round, so no prefix cache holds one. Greedy, EOS honoured: both
servers generate the same tokens (speculation changes no output), so their TPOTs compare the
same work; tokens are counted from the usage of each stream (a chunk may carry several).

    python benchmarks/speculative.py --concurrency 1 32 --rounds 2
    python benchmarks/speculative.py --spec '{"method": "ngram", "num_speculative_tokens": 5}'
    python benchmarks/speculative.py --prompts prose --concurrency 1    # text that quotes nothing

Prints the table and the ratios (TPOT at c=1, output tokens/s at every level), the
acceptance the server counted (vllm:spec_decode_* in /metrics) and the kernels' ISA; writes
JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import asdict
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))

from benchmarks.serving import PromptSets, bench_servers, publish, server_args, spyre_server  # noqa: E402

DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
# SmolLM2-Instruct's chat template (tokenizer_config.json), one user turn
TEMPLATE = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
INSTRUCTIONS = ["Copy the text below exactly, word for word.",
                "Rewrite the text below with every sentence on its own line.",
                "Repeat the text below, then give it a short title.",
                "Correct the grammar of the text below and write it out in full."]


def quoting_prompt_maker(words: int, quoting: bool = True):
    """make(n) -> n prompts, each an instruction and a passage of ``words`` words of the
    corpus (``quoting`` false: the passage alone, to go on with), none given twice."""
    text = (ROOT / "models" / "assets" / "corpus" / "prose.txt").read_text().split()
    given = iter(range(len(text) // words))

    def make(n: int) -> list[str]:
        out = []
        for _ in range(n):
            i = next(given)
            passage = " ".join(text[i * words:(i + 1) * words])
            out.append(TEMPLATE.format(f"{INSTRUCTIONS[i % len(INSTRUCTIONS)]}\n\n{passage}") if quoting else passage)
        return out
    return make


def spec_counters(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=30).text
    return {m[0]: float(m[1]) for m in re.findall(
        r"^vllm:spec_decode_num_(drafts|draft_tokens|accepted_tokens)_total\{[^}]*\} (\S+)$", text, re.M)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--words", type=int, default=120, help="words of each quoted passage")
    ap.add_argument("--prompts", choices=["quoting", "prose"], default="quoting",
                    help="quoting: copy or edit a passage; prose: a passage to go on with (no quoting asked)")
    ap.add_argument("--output-tokens", type=int, default=192, help="max_tokens (EOS honoured)")
    ap.add_argument("--min-requests", type=int, default=4)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--spec", default=DEFAULT_SPEC, help="the --speculative-config of the second server")
    server_args(ap, "speculative.json")
    args = ap.parse_args(argv)
    from smollm2 import paths

    from spyre_serve.device.isa import current as kernel_isa

    hf = paths(args.peers_cache)["hf_f32"]
    prompts = PromptSets(quoting_prompt_maker(args.words, args.prompts == "quoting"), args)
    servers = [spyre_server("spyre-fp32", str(hf), "smollm2", args, []),
               spyre_server("spyre-fp32-ngram", str(hf), "smollm2", args, ["--speculative-config", args.spec])]
    for srv in servers:
        srv.extra = {"stream_options": {"include_usage": True}}   # EOS honoured: no ignore_eos
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    counters = {}
    levels = bench_servers(servers, env, args, prompts,
                           before_stop=lambda srv: counters.__setitem__(srv.name, spec_counters(srv.base)))
    at = {(v.server, v.concurrency): v for v in levels if not v.failed}
    lines = []
    for c in args.concurrency:
        plain, spec = at.get(("spyre-fp32", c)), at.get(("spyre-fp32-ngram", c))
        if plain and spec:
            lines.append(f"- c={c}: TPOT p50 {plain.tpot_p50_ms} -> {spec.tpot_p50_ms} ms = "
                         f"{plain.tpot_p50_ms / spec.tpot_p50_ms:.2f}x faster; output {spec.output_tok_s} vs "
                         f"{plain.output_tok_s} tok/s = {spec.output_tok_s / plain.output_tok_s:.2f}x")
    got = counters.get("spyre-fp32-ngram", {})
    if got.get("draft_tokens"):
        lines.append(f"- proposals: {got['drafts']:.0f} drafts, {got['draft_tokens']:.0f} tokens proposed, "
                     f"{got['accepted_tokens']:.0f} kept ({got['accepted_tokens'] / got['draft_tokens']:.0%}); "
                     f"{got['accepted_tokens'] / got['drafts']:.2f} kept a draft")
    command = "python benchmarks/speculative.py " + " ".join(argv if argv is not None else sys.argv[1:])
    report = {"command": command.strip(), "checkpoint": str(hf), "kernel_isa": kernel_isa().describe(),
              "spec": json.loads(args.spec), "prompts": args.prompts, "words": args.words,
              "output_tokens": args.output_tokens,
              "cpu_count": os.cpu_count(), "rounds": args.rounds, "levels": [asdict(v) for v in levels],
              "spec_counters": got, "ratios": lines}
    return publish(args.out, report, f"SmolLM2-135M-Instruct float32, {args.prompts} prompts of {args.words}-word "
                   f"passages, max_tokens {args.output_tokens}, kernels {kernel_isa().describe()}", levels, lines)


if __name__ == "__main__":
    sys.exit(main())
