"""Small Hugging Face checkpoints written by the tests, for model I/O and parity tests.

    from tests.models.hf_checkpoints import write_granite_checkpoint, load_reference_model

    path = write_granite_checkpoint(tmp_path, hidden=128, layers=2, tie=True, dtype="bfloat16")
    ref = load_reference_model(path)     # transformers' GraniteForCausalLM / LlamaForCausalLM, fp32

The weights are seeded numpy draws (models.checkpoints.profiles.init_tensors), loaded into
transformers' model class and written with ``save_pretrained``: a real HF checkpoint.
The default init is the granite-tiny recipe (small embedding std, large projection
std, jittered norms) so greedy output is varied; ``init_std`` gives every matrix the
same std instead (the usual 0.02 init is degenerate when tied, see docs/design.md).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from spyre_serve.models.checkpoints.profiles import (  # noqa: E402
    ASSETS,
    TINY,
    TOKENIZER_FILES,
    InitStds,
    init_tensors,
)
from spyre_serve.models.config import GraniteConfig  # noqa: E402


def granite_config(*, vocab: int = 256, hidden: int = 128, layers: int = 2, heads: int = 4,
                   kv_heads: int = 1, intermediate: int | None = None, tie: bool = True,
                   dtype: str = "float32", llama: bool = False, rope_theta: float = 1e7,
                   max_positions: int = 4096) -> GraniteConfig:
    """A GraniteConfig with Granite 3.3 8B's multipliers (or Llama's neutral ones)."""
    head_dim = hidden // heads
    if intermediate is None:
        intermediate = hidden * 12800 // 4096
    granite = not llama
    return GraniteConfig(
        architecture="LlamaForCausalLM" if llama else "GraniteForCausalLM",
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, max_position_embeddings=max_positions, rms_norm_eps=1e-5,
        rope_theta=rope_theta, tie_word_embeddings=tie,
        embedding_multiplier=12.0 if granite else 1.0,
        attention_multiplier=1.0 / head_dim if granite else 1.0 / np.sqrt(head_dim),
        residual_multiplier=0.22 if granite else 1.0,
        logits_scaling=16.0 if granite else 1.0,
        bos_token_id=0, eos_token_id=[0], pad_token_id=0, torch_dtype=dtype)


def write_granite_checkpoint(directory, *, vocab: int = 256, hidden: int = 128, layers: int = 2,
                             heads: int = 4, kv_heads: int = 1, intermediate: int | None = None,
                             tie: bool = True, dtype: str = "float32",
                             init_std: float | None = None, seed: int = 0, llama: bool = False,
                             sharded: bool = False, with_tokenizer: bool = False) -> Path:
    """Write a checkpoint into ``directory`` with transformers' ``save_pretrained``.

    dtype: "float32" | "bfloat16" | "float16" (stored dtype; the reference model reads
    it back in fp32). sharded: several model-*.safetensors with an index.
    with_tokenizer: copy the project's tokenizer files (needs vocab >= 8192).
    Returns the directory."""
    import torch
    from transformers import GraniteConfig as HFGraniteConfig
    from transformers import GraniteForCausalLM, LlamaConfig, LlamaForCausalLM

    directory = Path(directory)
    cfg = granite_config(vocab=vocab, hidden=hidden, layers=layers, heads=heads,
                         kv_heads=kv_heads, intermediate=intermediate, tie=tie, dtype=dtype,
                         llama=llama)
    hf = cfg.to_dict()
    for key in ("architectures", "model_type", "torch_dtype", "dtype", "rope_theta"):
        hf.pop(key)
    hf["eos_token_id"] = cfg.eos_token_id[0]
    hf_cfg = (LlamaConfig if llama else HFGraniteConfig)(**hf)
    model = (LlamaForCausalLM if llama else GraniteForCausalLM)(hf_cfg)

    if init_std is None:
        stds = TINY.stds
    else:
        stds = InitStds(init_std, init_std, init_std, init_std, init_std, norm_jitter=0.1)
    state = {name: torch.from_numpy(np.array(a)) for name, a in init_tensors(cfg, stds, seed)}
    if tie:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise AssertionError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                   "float16": torch.float16}[dtype]
    model = model.to(torch_dtype)
    kwargs = {"max_shard_size": max(1, _param_bytes(model) // 3)} if sharded else {}
    model.save_pretrained(directory, **kwargs)
    if with_tokenizer:
        if vocab < 8192:
            raise ValueError(f"with_tokenizer needs vocab >= 8192, got {vocab}")
        for f in TOKENIZER_FILES:
            shutil.copyfile(ASSETS / f, directory / f)
    return directory


def write_hybrid_checkpoint(directory, *, seed: int = 0, vocab: int = 256, with_tokenizer: bool = False, **kw):
    """A seeded random Granite 4.0 hybrid (GraniteMoeHybridForCausalLM) saved by transformers in
    ``directory``, 128 wide, its Mamba-2 mixers 8 heads of 32 (2 groups, state 16), SSD chunks of
    32 tokens, Granite's multipliers away from 1; ``kw``: its layer_types, experts and position
    embedding (transformers' field names). Returns (directory, the transformers model)."""
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    torch.manual_seed(seed)
    cfg = GraniteMoeHybridConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=64, shared_intermediate_size=96,
        num_hidden_layers=len(kw["layer_types"]), num_attention_heads=4, num_key_value_heads=2,
        mamba_n_heads=8, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=2, mamba_expand=2,
        mamba_chunk_size=32, max_position_embeddings=1024, embedding_multiplier=2.0, residual_multiplier=0.5,
        logits_scaling=2.0, attention_multiplier=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        **kw)
    model = GraniteMoeHybridForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", ".D", "dt_bias")):
                continue                          # transformers' own init: A 1..NH, D 1, dt_bias 1
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 0.2)
    directory = Path(directory)
    model.save_pretrained(directory)
    if with_tokenizer:
        for f in TOKENIZER_FILES:
            shutil.copyfile(ASSETS / f, directory / f)
    return directory, model


def write_moe_checkpoint(directory, *, shared: bool, seed: int = 0):
    """A seeded random Granite 3.x mixture of experts saved by transformers: GraniteMoeShared
    (4 experts of 64 beside a shared MLP of 96) or GraniteMoe (experts only); 128 wide, 2 layers,
    Granite's multipliers away from 1. Returns (directory, the transformers model)."""
    import torch
    from transformers import (
        GraniteMoeConfig,
        GraniteMoeForCausalLM,
        GraniteMoeSharedConfig,
        GraniteMoeSharedForCausalLM,
    )

    torch.manual_seed(seed)
    kw = dict(vocab_size=256, hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=1024,
              embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0, attention_multiplier=0.1,
              tie_word_embeddings=False)
    if shared:
        model = GraniteMoeSharedForCausalLM(GraniteMoeSharedConfig(shared_intermediate_size=96, **kw))
    else:
        model = GraniteMoeForCausalLM(GraniteMoeConfig(**kw))
    model = model.float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 0.2)
    directory = Path(directory)
    model.save_pretrained(directory)
    return directory, model


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def load_reference_model(path):
    """transformers' model for the checkpoint at ``path``, in fp32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def runner_greedy(runner, prompts: list[list[int]], n_new: int, stop_ids=(),
                  block_size: int = 16) -> tuple[dict[int, np.ndarray], list[list[int]]]:
    """Greedy continuation of every prompt on the project's ModelRunner: all prompts
    prefilled in one launch, then one decode step for all of them at a time. Returns the
    prefill logits (seq index -> float32[len(prompt), V]) and the generated ids of each,
    cut after the first of ``stop_ids``."""
    from spyre_serve.models import SamplingParams, SeqWork

    greedy = SamplingParams(temperature=0.0)
    longest = max(len(p) for p in prompts) + n_new
    per_seq = -(-longest // block_size)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    work = [SeqWork(i, list(p), 0, tables[i], True, greedy) for i, p in enumerate(prompts)]
    out = runner.launch(work, return_logits=True).result()
    logits = dict(out.logits)
    generated = [[int(t)] for t in out.token_ids]
    for step in range(1, n_new):
        live = [i for i, g in enumerate(generated) if g[-1] not in stop_ids]
        if not live:
            break
        work = [SeqWork(i, [generated[i][-1]], len(prompts[i]) + step - 1, tables[i], True,
                        greedy, num_generated=step) for i in live]
        for i, t in zip(live, runner.launch(work).result().token_ids, strict=True):
            generated[i].append(int(t))
    return logits, generated
