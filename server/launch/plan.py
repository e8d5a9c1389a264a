"""``spyre-serve plan``: will a model fit, card by card, before any weight is read.

    spyre-serve plan --model granite-3.3-8b --tensor-parallel-size 4 --max-model-len 32768 --max-num-seqs 32

From a config alone: ``granite-3.3-8b`` (its published config), a profile's name, a checkpoint
directory or a config.json, or a GGUF file (its header). For each of the ``--tensor-parallel-size``
cards it prints the weights, the KV cache of ``--max-num-seqs`` sequences of ``--max-model-len``
tokens, the step buffers, the LoRA slots (``--enable-lora``: ``--max-loras`` at
``--max-lora-rank``), and what is left of a real card (128 GB, 112 GB usable); the largest
context at that batch and the largest batch at that context; the projected TTFT and TPOT on a
real card (models/sizing/projection.py); and, for the emulator, whether the cards' arenas fit in this
machine's memory. The sizes are the runner's own (models/sizing/fit.py: the
server's memory plan allocates by the same functions). A plan that does not fit a real card
exits 1 with the numbers.
"""

from __future__ import annotations

import os
from pathlib import Path

from spyre_serve.models import (
    CARD_BYTES,
    CARD_USABLE_BYTES,
    GRANITE_33_8B,
    PLUGIN_GRANITE_33_8B,
    CardFit,
    GraniteConfig,
    largest_batch,
    largest_context,
    model_config,
    names_gguf,
    plan_fit,
    project_request,
    resolve_kv_dtype,
)
from spyre_serve.server.launch.settings import Settings


def host_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo, or None where there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def plan_text(name: str, cfg: GraniteConfig, s: Settings, fit: CardFit, host: int | None) -> list[str]:
    """The lines ``plan`` prints for one card's ``fit`` (every card holds the same)."""
    tp, bs = fit.tp, s.block_size
    max_len = s.max_model_len or cfg.max_position_embeddings
    sizes = dict(dtype=fit_dtype(s, cfg), kv_dtype=fit_kv_dtype(s, cfg), tp=tp,
                 max_num_batched_tokens=s.max_num_batched_tokens, block_size=bs, usable=fit.usable,
                 lora=lora_slots(s))
    context = largest_context(cfg, max_num_seqs=s.max_num_seqs, **sizes)
    sizes.pop("block_size")
    batch = largest_batch(cfg, max_model_len=max_len, block_size=bs, **sizes)
    lines = [
        f"plan for {name} ({cfg.architecture}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_attention_heads} heads ({cfg.num_key_value_heads} KV), vocab {cfg.vocab_size}), "
        f"weights {fit_dtype(s, cfg)}, KV cache {fit_kv_dtype(s, cfg)}, tensor parallel {tp}",
        f"each of the {tp} card(s) holds:",
        f"  weights                {_gb(fit.weights):>12}",
        f"  KV cache               {_gb(fit.kv_cache):>12}   {s.max_num_seqs} sequences x {max_len:,} tokens "
        f"({fit.kv_token_bytes / 1024:.1f} KiB a token, blocks of {bs})",
        f"  step buffers           {_gb(fit.scratch):>12}   workspace and I/O for {s.max_num_batched_tokens} tokens, "
        f"{s.max_num_seqs} sequences a step",
        *([f"  LoRA adapters          {_gb(fit.lora):>12}   {s.max_loras} slot(s) of rank {s.max_lora_rank} "
           f"for q, k, v, o, gate, up and down, float32"] if fit.lora else []),
        f"  total                  {_gb(fit.total):>12}   of {_gb(fit.usable)} usable on a {_gb(CARD_BYTES)} card: "
        + (f"{_gb(fit.left)} left" if fit.fits else f"{_gb(-fit.left)} too much"),
        f"  largest context at {s.max_num_seqs} sequences: {context:,} tokens (whole blocks, the model's positions "
        f"{cfg.max_position_embeddings:,} at most); largest batch at {max_len:,} tokens: {batch:,} sequences",
    ]
    ttft, tpot, chunk = projected(cfg, s, tp, max_len)
    adapters = min(s.max_loras, s.max_num_seqs)
    lines.append(f"projected on a real card (docs/projection.md): TTFT {ttft * 1e3:,.1f} ms for a prompt filling the "
                 f"context ({max_len - 1:,} tokens in chunks of {chunk}), TPOT {tpot * 1e3:,.2f} ms "
                 f"with {s.max_num_seqs} sequences decoding at {max_len:,} tokens"
                 + (f", spread over {adapters} LoRA adapter(s) of rank {s.max_lora_rank} on every module"
                    if s.enable_lora else ""))
    if host is not None:
        need = tp * fit.total
        lines.append(f"emulator on this machine: {tp} card arena(s) of {_gb(fit.total)} = {_gb(need)} of "
                     f"{_gb(host)} available: " + ("fits" if need <= host else "does not fit"))
    if name == GRANITE_33_8B and tp in PLUGIN_GRANITE_33_8B:
        length, seqs = PLUGIN_GRANITE_33_8B[tp]
        lines.append(f"the vLLM Spyre plugin serves Granite 3.3 8B at tensor parallel {tp} with {length:,} tokens x "
                     f"{seqs} sequences (its model_configs.yaml): memory is not what limits it there")
    return lines


def projected(cfg: GraniteConfig, s: Settings, tp: int, max_len: int) -> tuple[float, float, int]:
    """(TTFT, TPOT, chunk) on a real card (models/sizing/projection.py): a prompt of max_len - 1 tokens
    (at least one) prefilled in the card's chunks (--max-num-batched-tokens down to a multiple of
    the 64-token block, 64 at least: the plugin's rule), then its token at a full context beside
    --max-num-seqs - 1 others."""
    kv_bytes = 4 if fit_kv_dtype(s, cfg) == "float32" else 2
    chunk = max(64, s.max_num_batched_tokens // 64 * 64)
    ttft, tpot = project_request(cfg, max(1, max_len - 1), 2, s.max_num_seqs, tp=tp, chunk=chunk,
                                 formats=fit_dtype(s, cfg), kv_bytes=kv_bytes, lora=lora_slots(s))
    return ttft, tpot, chunk


def lora_slots(s: Settings) -> tuple[int, int] | None:
    """(--max-loras, --max-lora-rank) with --enable-lora, else None."""
    return (s.max_loras, s.max_lora_rank) if s.enable_lora else None


def check_sizes(s: Settings, cfg: GraniteConfig) -> int:
    """The context planned (--max-model-len, else the model's), once every size is one the
    plan can take: ValueError naming the flag otherwise. Quantized weights (a GGUF file's
    blocks, --quantization) are not sized: the plan counts float widths."""
    for flag, value in (("--max-num-seqs", s.max_num_seqs), ("--max-num-batched-tokens", s.max_num_batched_tokens),
                        ("--block-size", s.block_size), ("--tensor-parallel-size", s.tensor_parallel_size)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if s.max_model_len is not None and s.max_model_len < 1:
        raise ValueError(f"--max-model-len must be at least 1, got {s.max_model_len}")
    if s.quantization or names_gguf(s.model):
        raise ValueError("the plan sizes float weights (--dtype); a GGUF file's quantized blocks and --quantization "
                         "are not sized yet")
    max_len = s.max_model_len or cfg.max_position_embeddings
    if max_len > cfg.max_position_embeddings:
        raise ValueError(f"--max-model-len {max_len:,} is over the model's {cfg.max_position_embeddings:,} positions")
    return max_len


def fit_dtype(s: Settings, cfg: GraniteConfig) -> str:
    """The weights' width on the card: --dtype, or the checkpoint's (auto)."""
    return cfg.torch_dtype if s.dtype == "auto" else s.dtype


def fit_kv_dtype(s: Settings, cfg: GraniteConfig) -> str:
    """The KV cache's width as the runner resolves it (models/step/kv_cache.py)."""
    compute = fit_dtype(s, cfg) if s.compute_dtype == "auto" else s.compute_dtype
    return resolve_kv_dtype(s.kv_cache_dtype, compute)


def plan(s: Settings, out=None, usable: int = CARD_USABLE_BYTES) -> int:
    """`spyre-serve plan`: print the plan of ``s`` (its model, sizes and tensor-parallel degree);
    0 when it fits a real card, 1 (with the numbers) when not."""
    import sys

    out = out or sys.stdout
    try:
        cfg = model_config(s.model)
        max_len = check_sizes(s, cfg)
        fit = plan_fit(cfg, dtype=fit_dtype(s, cfg), kv_dtype=fit_kv_dtype(s, cfg), tp=s.tensor_parallel_size,
                       max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                       max_model_len=max_len, block_size=s.block_size, usable=usable, lora=lora_slots(s))
    except (ValueError, OSError) as exc:      # ConfigError, GGUFError, CheckpointError are ValueErrors
        print(f"cannot plan {s.model}: {exc}", file=out)
        return 1
    name = s.model if os.sep not in s.model else Path(s.model).name
    for line in plan_text(name, cfg, s, fit, host_available_bytes()):
        print(line, file=out)
    if not fit.fits:
        print(f"does not fit: each card needs {_gb(fit.total)} (weights {_gb(fit.weights)}, KV cache "
              f"{_gb(fit.kv_cache)}, buffers {_gb(fit.scratch)}"
              + (f", LoRA slots {_gb(fit.lora)}" if fit.lora else "")
              + f") and has {_gb(fit.usable)}; lower --max-model-len "
              f"or --max-num-seqs, or raise --tensor-parallel-size", file=out)
        return 1
    return 0
