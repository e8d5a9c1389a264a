"""The accuracy report: what each number format we serve does to a model's answers, against
float32 on the same weights, measured on this machine's kernels (their ISA level is named).

    .venv/bin/python benchmarks/numerics.py [--peers-cache DIR] [--out JSON] [--quick]
        [--part all|smollm2|granite]

For every mode the server serves SmolLM2-135M-Instruct in (MODES: the float widths, DLFloat16
as --numerics spyre computes, FP8 and INT8 weights quantized at load, the GGUF Q8_0 and Q4_1
files at their width), over a fixed prompt set (chat prompts, teacher-forced on float32's own
greedy answer, and plain-text passages of prose, code and dialogue from models/assets/corpus):

  - per scored position, KL(P_fp32 || P_mode) of the next-token distributions (nats): the mean
    and the 99th percentile; top-1 agreement (the mode's most likely token is float32's);
  - greedy agreement over GREEDY_TOKENS generated tokens of each chat prompt: the share of
    positions whose token equals float32's, and the mean length of the identical prefix;
  - per layer (a logit lens: the model cut after its first l layers, the final norm and LM head
    reading layer l's output), the mean KL at a few depths, to show where the error grows.

The same per-layer figures on granite-8b-layers (Granite 3.3 8B's widths, 2 layers, random
weights: every depth, fewer positions) for the modes that apply to a float checkpoint.

The float32 reference of SmolLM2 is the Hugging Face checkpoint benchmarks/peers/smollm2.py
makes, which is the shipped Q4_1 file dequantized: the Q4_1 mode's error is therefore its
int8 activations alone, and Q8_0 is that checkpoint requantized (benchmarks/peers/llamacpp.sh).
Results go to benchmarks/results/numerics.json; docs/spyre-fidelity.md's table is printed last.
"""

from __future__ import annotations

import os

for var in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))

from spyre_serve.device.process import configure  # noqa: E402

configure()   # threads, ISA level, compile cache: before any kernel is imported

from spyre_serve.device import Card  # noqa: E402
from spyre_serve.device.isa import current  # noqa: E402
from spyre_serve.models import ModelRunner, SamplingParams, SeqWork, load_model, resolve_model  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)
GREEDY_TOKENS = 64
BLOCK = 64
CHUNK = 512          # the longest sequence scored in one launch
QUESTIONS = [
    "What is the capital of France?", "Name the three primary colors.",
    "Write one sentence about the sea.", "How many legs does a spider have?",
    "Explain what a prime number is.", "Give me a tip for sleeping better.",
    "What is photosynthesis?", "Write a haiku about autumn.",
    "Why is the sky blue?", "Translate 'good morning' into Spanish.",
    "List three uses of a paperclip.", "What does a compiler do?",
]
PASSAGES = [("prose.txt", 0), ("prose.txt", 40_000), ("prose.txt", 120_000), ("code.txt", 0),
            ("code.txt", 60_000), ("dialogue.txt", 0), ("dialogue.txt", 90_000), ("misc.txt", 0)]
PASSAGE_TOKENS = 200


@dataclass(frozen=True)
class Mode:
    source: str                     # a key of benchmarks/peers/smollm2.py's paths()
    dtype: str = "float32"
    quantization: str | None = None
    compute: str = "auto"
    kv: str = "auto"
    gguf: bool = False


MODES = {
    "fp32": Mode("hf_f32", compute="float32", kv="float32"),
    "bf16": Mode("hf_f32", "bfloat16"),
    "fp16": Mode("hf_f32", "float16"),
    "dlfloat16 (--numerics spyre)": Mode("hf_f32", "dlfloat16"),
    "fp8 e4m3 weights": Mode("hf_f32", quantization="fp8"),
    "fp8 e4m3 + dlfloat16 (spyre)": Mode("hf_f32", "dlfloat16", quantization="fp8"),
    "int8 weights, int8 inputs": Mode("hf_f32", quantization="int8"),
    "GGUF Q8_0 (int8 inputs)": Mode("gguf_q8_0", "auto", gguf=True),
    "GGUF Q4_1 (int8 inputs)": Mode("gguf_q4_1", "auto", gguf=True),
}
SMOLLM2_DEPTHS = (1, 5, 10, 15, 20, 25, 30)


def log(msg: str) -> None:
    print(f"[numerics] {msg}", file=sys.stderr, flush=True)


def runner_for(path, mode: Mode, card: Card, num_layers: int | None = None) -> ModelRunner:
    model = load_model(path, card, tokenizer=False, dtype=mode.dtype, quantization=mode.quantization,
                       num_layers=num_layers)
    return ModelRunner(model, card, max_num_seqs=16, max_num_batched_tokens=CHUNK, block_size=BLOCK,
                       num_kv_blocks=16 * (CHUNK // BLOCK) + 16, seed=0, compute_dtype=mode.compute,
                       kv_cache_dtype=mode.kv)


def score(runner: ModelRunner, sequences: list[list[int]]) -> list[np.ndarray]:
    """Each sequence's scaled logits at every position [len, V] (one prefill launch each)."""
    out = []
    for seq in sequences:
        table = list(range(-(-len(seq) // BLOCK)))
        step = runner.launch([SeqWork(0, list(seq), 0, table, True, GREEDY)], return_logits=True).result()
        out.append(step.logits[0])
        runner.forget(0)
    return out


def greedy(runner: ModelRunner, prompts: list[list[int]], n_new: int) -> list[list[int]]:
    """n_new greedy tokens of every prompt, all prompts in each step (no stop)."""
    per_seq = -(-(max(map(len, prompts)) + n_new) // BLOCK)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    out = runner.launch([SeqWork(i, list(p), 0, tables[i], True, GREEDY)
                         for i, p in enumerate(prompts)]).result()
    generated = [[int(t)] for t in out.token_ids]
    for step in range(1, n_new):
        work = [SeqWork(i, [g[-1]], len(prompts[i]) + step - 1, tables[i], True, GREEDY, num_generated=step)
                for i, g in enumerate(generated)]
        for g, t in zip(generated, runner.launch(work).result().token_ids, strict=True):
            g.append(int(t))
    for i in range(len(prompts)):
        runner.forget(i)
    return generated


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def divergence(ref: list[np.ndarray], got: list[np.ndarray]) -> dict:
    """Per-position KL(P_ref || P_got) (mean, p99) and top-1 agreement over every position."""
    kls, agree = [], []
    for r, g in zip(ref, got, strict=True):
        lr, lg = log_softmax(r), log_softmax(g)
        kls.append((np.exp(lr) * (lr - lg)).sum(axis=-1))
        agree.append(r.argmax(axis=-1) == g.argmax(axis=-1))
    kl, top1 = np.concatenate(kls), np.concatenate(agree)
    return {"positions": int(kl.size), "kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)),
            "top1_agreement": float(top1.mean())}


def greedy_agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    same = [np.mean([a == b for a, b in zip(r, g, strict=True)]) for r, g in zip(ref, got, strict=True)]
    prefix = [next((i for i, (a, b) in enumerate(zip(r, g, strict=True)) if a != b), len(r))
              for r, g in zip(ref, got, strict=True)]
    return {"greedy_tokens": len(ref[0]), "greedy_same": float(np.mean(same)),
            "greedy_prefix_mean": float(np.mean(prefix))}


def smollm2_prompts(hf_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    """(chat prompts rendered with the model's template, plain-text passages), as token ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    chats = [tok(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         tokenize=False), add_special_tokens=False)["input_ids"]
             for q in QUESTIONS]
    corpus = ROOT / "models" / "assets" / "corpus"
    passages = []
    for name, at in PASSAGES:
        text = (corpus / name).read_text()[at:at + 4 * PASSAGE_TOKENS * 2]
        passages.append(tok(text)["input_ids"][:PASSAGE_TOKENS])
    return [list(c) for c in chats], passages


def smollm2_report(paths: dict, modes: dict[str, Mode], depths: tuple[int, ...]) -> dict:
    chats, passages = smollm2_prompts(paths["hf_f32"])
    card_bytes = 3 << 30
    results: dict[str, dict] = {}
    ref_logits = ref_greedy = None
    ref_depth: dict[int, list[np.ndarray]] = {}
    for name, mode in modes.items():
        t0 = time.monotonic()
        with Card(card_bytes) as card:
            runner = runner_for(paths[mode.source], mode, card)
            answers = greedy(runner, chats, GREEDY_TOKENS)
            if ref_greedy is None:
                ref_greedy = answers            # float32's answers: what every mode is scored on
            sequences = [c + a for c, a in zip(chats, ref_greedy, strict=True)] + passages
            logits = score(runner, sequences)
            row = {"compute": runner.compute_dtype, "kv_cache": runner.kv_cache_dtype,
                   "weights": sorted(runner.weights.formats), "numerics": runner.numerics}
            runner.close()
        if ref_logits is None:
            ref_logits = logits
        row |= divergence(ref_logits, logits) | greedy_agreement(ref_greedy, answers)
        row["by_depth"] = {}
        for depth in depths:
            with Card(card_bytes) as card:
                runner = runner_for(paths[mode.source], mode, card, num_layers=depth)
                at_depth = score(runner, passages)
                runner.close()
            ref_depth.setdefault(depth, at_depth)
            row["by_depth"][depth] = divergence(ref_depth[depth], at_depth)["kl_mean"]
        results[name] = row
        log(f"smollm2 {name}: KL mean {row['kl_mean']:.2e} p99 {row['kl_p99']:.2e}, top-1 "
            f"{100 * row['top1_agreement']:.1f}%, greedy {100 * row['greedy_same']:.0f}% "
            f"({time.monotonic() - t0:.0f} s)")
    return {"model": "SmolLM2-135M-Instruct", "chat_prompts": len(chats), "passages": len(passages),
            "modes": results}


def granite_layers_report(modes: dict[str, Mode], positions: int) -> dict:
    """granite-8b-layers at each depth, modes of a float checkpoint, `positions` tokens."""
    from spyre_serve.models.checkpoints.tokenizer import load_tokenizer

    path = resolve_model("granite-8b-layers")
    tok = load_tokenizer(path)
    text = (ROOT / "models" / "assets" / "corpus" / "prose.txt").read_text()[:20_000]
    ids = tok(text)["input_ids"]
    sequences = [ids[i * 128:(i + 1) * 128] for i in range(positions // 128)]
    results, ref = {}, {}
    floats = {n: m for n, m in modes.items() if not m.gguf}
    for name, mode in floats.items():
        row = {}
        for depth in (1, 2):
            with Card(8 << 30) as card:
                runner = runner_for(path, mode, card, num_layers=depth)
                logits = score(runner, sequences)
                runner.close()
            ref.setdefault(depth, logits)
            row[depth] = divergence(ref[depth], logits)
        results[name] = row
        log(f"granite-8b-layers {name}: KL by layer " + ", ".join(
            f"{d}: {r['kl_mean']:.2e}" for d, r in row.items()))
    return {"model": "granite-8b-layers", "positions": len(sequences) * 128, "modes": results}


def table(report: dict) -> str:
    s = report.get("smollm2")
    if s is None:
        return ""
    depths = list(next(iter(s["modes"].values()))["by_depth"])
    head = ("| mode | GEMM inputs | KV cache | KL mean | KL p99 | top-1 | greedy same / prefix | "
            + " | ".join(f"KL @{d}" for d in depths) + " |")
    lines = [head, "|" + "---|" * (7 + len(depths))]
    for name, r in s["modes"].items():
        lines.append(f"| {name} | {r['compute']} | {r['kv_cache']} | {r['kl_mean']:.1e} | {r['kl_p99']:.1e} | "
                     f"{100 * r['top1_agreement']:.1f}% | {100 * r['greedy_same']:.0f}% / "
                     f"{r['greedy_prefix_mean']:.0f} | "
                     + " | ".join(f"{r['by_depth'][d]:.1e}" for d in depths) + " |")
    g = report.get("granite_8b_layers")
    if g:
        lines += ["", "| granite-8b-layers | KL after layer 1 | KL after layer 2 | top-1 after layer 2 |",
                  "|---|---|---|---|"]
        for name, r in g["modes"].items():
            lines.append(f"| {name} | {r[1]['kl_mean']:.1e} | {r[2]['kl_mean']:.1e} | "
                         f"{100 * r[2]['top1_agreement']:.1f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from smollm2 import paths as peer_paths

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers-cache", default=None, help="where benchmarks/peers/smollm2.py put SmolLM2")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "numerics.json"))
    ap.add_argument("--quick", action="store_true", help="three modes, two depths, no granite-8b-layers")
    ap.add_argument("--part", choices=["all", "smollm2", "granite"], default="all",
                    help="one part only, merged into the --out file's other part")
    args = ap.parse_args(argv)
    paths = peer_paths(args.peers_cache)
    missing = [str(paths[m.source]) for m in MODES.values() if not paths[m.source].exists()]
    if missing and args.part != "granite":
        log(f"missing {missing}: run benchmarks/peers/smollm2.py and benchmarks/peers/llamacpp.sh first")
        return 2
    modes = {n: MODES[n] for n in list(MODES)[:3]} if args.quick else MODES
    out = Path(args.out)
    report = json.loads(out.read_text()) if args.part != "all" and out.exists() else {}
    report |= {"isa": current().level, "date": time.strftime("%Y-%m-%d")}
    t0 = time.monotonic()
    if args.part in ("all", "smollm2"):
        report["smollm2"] = smollm2_report(paths, modes, (1, 30) if args.quick else SMOLLM2_DEPTHS)
        out.write_text(json.dumps(report, indent=1) + "\n")     # the larger part kept at once
    if args.part in ("all", "granite") and not args.quick:
        report["granite_8b_layers"] = granite_layers_report(modes, positions=256)
    report["seconds"] = round(time.monotonic() - t0)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"ISA level {report['isa']}; KL in nats against float32 on the same weights\n")
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
