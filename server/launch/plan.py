"""``spyre-serve plan``: will a model fit, card by card, before any weight is read.

    spyre-serve plan --model granite-3.3-8b --tensor-parallel-size 4 --max-model-len 32768 --max-num-seqs 32

From a config alone: ``granite-3.3-8b`` (its published config), a profile's name, a checkpoint
directory or a config.json, or a GGUF file (its header: each matrix sized in the format the
card holds it in, models/gguf/placement.py). For each of the ``--tensor-parallel-size``
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
    any_quantized,
    file_gemm_formats,
    largest_batch,
    largest_context,
    model_config,
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


def plan_text(name: str, cfg: GraniteConfig, s: Settings, fit: CardFit, host: int | None,
              formats: dict | None = None) -> list[str]:
    """The lines ``plan`` prints for one card's ``fit`` (every card holds the same); ``formats``:
    a GGUF file's GEMM weights' (file_gemm_formats)."""
    tp, bs = fit.tp, s.block_size
    max_len = s.max_model_len or cfg.max_position_embeddings
    sizes = dict(dtype=fit_dtype(s, cfg), kv_dtype=fit_kv_dtype(s, cfg, formats), tp=tp,
                 max_num_batched_tokens=s.max_num_batched_tokens, block_size=bs, usable=fit.usable,
                 lora=lora_slots(s), formats=formats)
    context = largest_context(cfg, max_num_seqs=s.max_num_seqs, **sizes)
    sizes.pop("block_size")
    batch = largest_batch(cfg, max_model_len=max_len, block_size=bs, **sizes)
    lines = [
        f"plan for {name} ({cfg.architecture}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_attention_heads} heads ({cfg.num_key_value_heads} KV), vocab {cfg.vocab_size}), "
        f"weights {weights_text(fit_dtype(s, cfg), formats, cfg.tie_word_embeddings)}, "
        f"KV cache {fit_kv_dtype(s, cfg, formats)}, tensor parallel {tp}",
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
    ttft, tpot, chunk = projected(cfg, s, tp, max_len, formats)
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


def projected(cfg: GraniteConfig, s: Settings, tp: int, max_len: int,
              formats: dict | None = None) -> tuple[float, float, int]:
    """(TTFT, TPOT, chunk) on a real card (models/sizing/projection.py): a prompt of max_len - 1 tokens
    (at least one) prefilled in the card's chunks (--max-num-batched-tokens down to a multiple of
    the 64-token block, 64 at least: the plugin's rule), then its token at a full context beside
    --max-num-seqs - 1 others. A file's matrices in their formats, the first layer's standing for
    every layer (as the server's own projection takes them: StepProjector.of_weights)."""
    kv_bytes = 4 if fit_kv_dtype(s, cfg, formats) == "float32" else 2
    chunk = max(64, s.max_num_batched_tokens // 64 * 64)
    by_matrix = fit_dtype(s, cfg) if formats is None else \
        {m: f if isinstance(f, str) else f[0] for m, f in formats.items()}
    ttft, tpot = project_request(cfg, max(1, max_len - 1), 2, s.max_num_seqs, tp=tp, chunk=chunk,
                                 formats=by_matrix, kv_bytes=kv_bytes, lora=lora_slots(s))
    return ttft, tpot, chunk


def weights_text(dtype: str, formats: dict | None, tied: bool) -> str:
    """The weights' width: ``dtype``, or a file's formats with how many GEMM weights each holds
    ("Q5_K x 61, Q8_0 x 31, float32 x 1"; a tied LM head is the embedding, counted once)."""
    if formats is None:
        return dtype
    count: dict[str, int] = {}
    for m, f in formats.items():
        if m == "lm_head" and tied:
            continue
        for name in [f] if isinstance(f, str) else f:
            count[name] = count.get(name, 0) + 1
    return ", ".join(f"{n} x {c}" for n, c in sorted(count.items(), key=lambda nc: (-nc[1], nc[0])))


def lora_slots(s: Settings) -> tuple[int, int] | None:
    """(--max-loras, --max-lora-rank) with --enable-lora, else None."""
    return (s.max_loras, s.max_lora_rank) if s.enable_lora else None


def check_sizes(s: Settings, cfg: GraniteConfig) -> int:
    """The context planned (--max-model-len, else the model's), once every size is one the
    plan can take: ValueError naming the flag otherwise. --quantization (int8 at load) is not
    sized: the plan counts a float checkpoint at its width."""
    for flag, value in (("--max-num-seqs", s.max_num_seqs), ("--max-num-batched-tokens", s.max_num_batched_tokens),
                        ("--block-size", s.block_size), ("--tensor-parallel-size", s.tensor_parallel_size)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if s.max_model_len is not None and s.max_model_len < 1:
        raise ValueError(f"--max-model-len must be at least 1, got {s.max_model_len}")
    if s.quantization:
        raise ValueError("the plan sizes a float checkpoint at --dtype and a GGUF file's blocks at their width; "
                         "--quantization is not sized yet")
    max_len = s.max_model_len or cfg.max_position_embeddings
    if max_len > cfg.max_position_embeddings:
        raise ValueError(f"--max-model-len {max_len:,} is over the model's {cfg.max_position_embeddings:,} positions")
    return max_len


def fit_dtype(s: Settings, cfg: GraniteConfig) -> str:
    """The weights' width on the card: --dtype, or the checkpoint's (auto)."""
    return cfg.torch_dtype if s.dtype == "auto" else s.dtype


def fit_kv_dtype(s: Settings, cfg: GraniteConfig, formats: dict | None = None) -> str:
    """The KV cache's width as the runner resolves it (models/step/kv_cache.py), beside GEMM
    inputs as it resolves them (models/step/weights.py: int8 beside a file's quantized matrices)."""
    compute = s.compute_dtype
    if compute == "auto":
        compute = "int8" if formats is not None and any_quantized(formats) else fit_dtype(s, cfg)
    return resolve_kv_dtype(s.kv_cache_dtype, compute)


def plan(s: Settings, out=None, usable: int = CARD_USABLE_BYTES) -> int:
    """`spyre-serve plan`: print the plan of ``s`` (its model, sizes and tensor-parallel degree);
    0 when it fits a real card, 1 (with the numbers) when not."""
    import sys

    out = out or sys.stdout
    try:
        cfg = model_config(s.model)
        max_len = check_sizes(s, cfg)
        formats = file_gemm_formats(s.model, fit_dtype(s, cfg))
        fit = plan_fit(cfg, dtype=fit_dtype(s, cfg), kv_dtype=fit_kv_dtype(s, cfg, formats), tp=s.tensor_parallel_size,
                       max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                       max_model_len=max_len, block_size=s.block_size, usable=usable, lora=lora_slots(s),
                       formats=formats)
    except (ValueError, OSError) as exc:      # ConfigError, GGUFError, CheckpointError are ValueErrors
        print(f"cannot plan {s.model}: {exc}", file=out)
        return 1
    name = s.model if os.sep not in s.model else Path(s.model).name
    for line in plan_text(name, cfg, s, fit, host_available_bytes(), formats):
        print(line, file=out)
    if not fit.fits:
        print(f"does not fit: each card needs {_gb(fit.total)} (weights {_gb(fit.weights)}, KV cache "
              f"{_gb(fit.kv_cache)}, buffers {_gb(fit.scratch)}"
              + (f", LoRA slots {_gb(fit.lora)}" if fit.lora else "")
              + f") and has {_gb(fit.usable)}; lower --max-model-len "
              f"or --max-num-seqs, or raise --tensor-parallel-size", file=out)
        return 1
    return 0
