"""Will it fit: a model's device memory from its config alone, by the sizes the server places.

The runner's memory plan (models/step/memory_plan.py) and ``spyre-serve plan`` size everything with
these functions, so what the command says a card holds is what the server allocates:

    weight_bytes(config, dtype, tp)   the weights one card holds (ModelWeights.nbytes at tp 1):
                                      packed GEMM panels (device.layout.packed_shape) + float32 norms;
                                      a GGUF file's matrices each in its own format (``formats``:
                                      models/gguf/placement.py's gemm_formats)
    capacity(config, ...)             the largest step the buffers hold (a Capacity)
    buffer_bytes(config, cap)         workspace, inputs, the two outputs, the layer table
    kv_cache.block_bytes(...)         one KV block over every layer (K and V)
    lora_arena_bytes(config, K, R)    the LoRA arena of K adapter slots at rank R (LoraArena.nbytes)

Tensor parallelism (``tp`` cards) shards as the vLLM Spyre plugin does (vLLM's linear layers):
QKV, gate and up by columns (heads), O and down by rows, the embedding and the LM head by
vocabulary; norms are replicated; KV heads are split when there are at least ``tp`` of them,
else each card keeps one (replicated, as vLLM does when tp > num_key_value_heads).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from spyre_serve.device.kernels.formats import RECORD_BYTES
from spyre_serve.device.kernels.simd import NR, QB
from spyre_serve.device.layout import QUANTIZED, STORAGE, format_code, packed_shape
from spyre_serve.models.config import GraniteConfig
from spyre_serve.models.lora.layout import block_offsets
from spyre_serve.models.step.buckets import buckets
from spyre_serve.models.step.inputs import mask_words
from spyre_serve.models.step.kv_cache import block_bytes
from spyre_serve.models.step.program import INPUTS, KMAX, LAYER_FIELDS, OUTPUTS, WORKSPACE

GB = 10**9
# The real card (docs/spyre-fidelity.md, from torch-spyre's spyre_accelerator.md): up to 128 GB of
# LPDDR5, about 112 GB of it usable.
CARD_BYTES = 128 * GB
CARD_USABLE_BYTES = 112 * GB
# vLLM Spyre plugin (sendnn_inference/config/model_configs.yaml; docs/spyre-fidelity.md): the
# context and batch it serves Granite 3.3 8B with, by tensor-parallel degree.
PLUGIN_GRANITE_33_8B = {1: (3072, 16), 4: (32768, 32)}


@dataclass(frozen=True, slots=True)
class Capacity:
    """The largest step the buffers hold, in each dim they are sized by."""

    tmax: int        # token rows (the largest token bucket)
    smax: int        # sequences (the largest sequence bucket)
    rmax: int        # logit rows: every token row asked for, plus the sampling rows
    srmax: int       # sampling rows: one per sequence, and one per proposed token (each a token row)
    mbmax: int       # block-table width (max_model_len in blocks)
    nban_max: int    # banned ids: unique per sampling row, each < V
    nmw_max: int = 0     # grammar-mask words: a mask of ceil(V/32) words per sampling row
    nbias_max: int = 0   # logit-bias entries: unique per sampling row, each < V

    def input_dims(self) -> dict[str, int]:
        return {"T": self.tmax, "S": self.smax, "SR": self.srmax, "R": self.rmax, "MB": self.mbmax,
                "NBAN": self.nban_max, "NMW": self.nmw_max, "NBIAS": self.nbias_max, "SST": self.smax}


def workspace_dims(cap: Capacity, cfg: GraniteConfig) -> dict[str, int]:
    """The dims WORKSPACE is declared in, for this capacity and model."""
    m = cfg.mamba if cfg.mamba_layers else None
    return {"TMAX": cap.tmax, "RMAX": cap.rmax, "SMAX": cap.smax,
            "H": cfg.hidden_size, "QD": cfg.q_size, "KD": cfg.kv_size,
            "I": cfg.intermediate_size, "V": cfg.vocab_size, "HALF_D": cfg.head_dim // 2,
            # a hybrid's Mamba-2 mixers and experts (0: the fields take no room)
            "MTMAX": cap.tmax if m else 0, "MPROJ": m.proj if m else 0, "MCONV": m.conv_dim if m else 0,
            "MDI": m.d_inner if m else 0, "ETMAX": cap.tmax if cfg.num_experts else 0, "E": cfg.num_experts,
            "TOPK": cfg.num_experts_per_tok, "IE": cfg.expert_intermediate_size}


def granite_33_8b() -> GraniteConfig:
    """Granite 3.3 8B's config (docs/spyre-fidelity.md): granite-8b-layers' widths with its 40 layers
    and 128K positions, bfloat16 as published."""
    from spyre_serve.models.checkpoints.profiles import EIGHT_B_LAYERS

    return dataclasses.replace(EIGHT_B_LAYERS.config, num_hidden_layers=40, max_position_embeddings=131072)


def gemm_bytes(k: int, n: int, dtype: str) -> int:
    """Bytes of a K x N GEMM weight packed in panels of format ``dtype`` (place_gemm_weight;
    a block-quantized format's records of QB rows: place_quantized_weight)."""
    code = format_code(dtype)
    if code in QUANTIZED:
        if k % QB:
            raise ValueError(f"a {dtype} weight needs K in blocks of {QB}, got K {k}")
        return -(-n // NR) * (k // QB) * RECORD_BYTES[code]
    p, kp, nr = packed_shape(k, n, code)
    return p * kp * nr * np.dtype(STORAGE[code]).itemsize


def shard(n: int, tp: int, what: str) -> int:
    """n split over tp cards; ValueError unless tp divides it."""
    if n % tp:
        raise ValueError(f"{what} ({n}) is not divisible by --tensor-parallel-size {tp}")
    return n // tp


def kv_heads_per_card(config: GraniteConfig, tp: int) -> int:
    """KV heads one card holds: split when there are at least tp of them, else one (replicated)."""
    hkv = config.num_key_value_heads
    if hkv >= tp:
        return shard(hkv, tp, "num_key_value_heads")
    if tp % hkv:
        raise ValueError(f"--tensor-parallel-size {tp} is not a multiple of num_key_value_heads {hkv}")
    return 1


def card_config(config: GraniteConfig, tp: int) -> GraniteConfig:
    """The config of the shard one of ``tp`` cards computes: its attention heads, its KV heads
    and its share of the MLP (the vocabulary stays whole: every card gathers the logits)."""
    if tp < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {tp}")
    return dataclasses.replace(
        config, num_attention_heads=shard(config.num_attention_heads, tp, "num_attention_heads"),
        num_key_value_heads=kv_heads_per_card(config, tp),
        intermediate_size=shard(config.intermediate_size, tp, "intermediate_size"))


def weight_bytes(config: GraniteConfig, dtype: str, tp: int = 1, formats: dict | None = None) -> int:
    """Bytes of the weights one of ``tp`` cards holds, placed in width ``dtype`` (float32,
    bfloat16, float16, dlfloat16); at tp 1 this is ``ModelWeights.nbytes``. ``formats``: each
    GEMM weight's own format instead (a GGUF file's: "embed", "lm_head" a name each, "qkv",
    "o", "gate_up", "down" a name per layer; a dense model at tp 1)."""
    if tp > 1 and (config.mamba_layers or config.num_experts):
        raise ValueError(f"--tensor-parallel-size {tp}: a model's Mamba-2 layers and experts are not sharded yet")
    if formats is not None and tp != 1:
        raise ValueError(f"--tensor-parallel-size {tp}: tensor parallelism takes float checkpoints, "
                         "not a quantized file's matrices")
    if formats is not None and (config.mamba_layers or config.num_experts or not config.dense_mlp):
        raise ValueError("a hybrid or mixture-of-experts file's quantized matrices are not sized yet")

    def fmt(matrix: str, layer: int = 0) -> str:
        if formats is None:
            return dtype
        f = formats[matrix]
        return f if isinstance(f, str) else f[layer]

    c = card_config(config, tp)
    h, q, kv, inter = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size
    vocab = -(-c.vocab_size // tp)                   # vocabulary-parallel: the last shard padded
    layers = c.num_hidden_layers * 2 * 4 * h         # two norms a layer
    layers += sum(gemm_bytes(h, q + 2 * kv, fmt("qkv", i)) + gemm_bytes(q, h, fmt("o", i))    # QKV, O
                  for i in c.attention_layers)
    if c.dense_mlp:
        layers += sum(gemm_bytes(h, 2 * inter, fmt("gate_up", i)) + gemm_bytes(inter, h, fmt("down", i))
                      for i in range(c.num_hidden_layers))
    m = c.mamba
    if m and c.mamba_layers:    # in_proj, out_proj; the conv's weight and bias, dt_bias, A, D, the gated norm
        mixer = (gemm_bytes(h, m.proj, dtype) + gemm_bytes(m.d_inner, h, dtype)
                 + 4 * (m.conv_dim * (m.d_conv + 1) + 3 * m.n_heads + m.d_inner))
        layers += len(c.mamba_layers) * mixer
    if c.num_experts:           # the router, each expert's gate/up and down, the experts' address table
        e, ie = c.num_experts, c.expert_intermediate_size
        layers += c.num_hidden_layers * (gemm_bytes(h, e, dtype) + 16 * e
                                         + e * (gemm_bytes(h, 2 * ie, dtype) + gemm_bytes(ie, h, dtype)))
    embed = gemm_bytes(h, vocab, fmt("embed"))
    lm_head = 0 if c.tie_word_embeddings else gemm_bytes(h, vocab, fmt("lm_head"))
    return embed + lm_head + layers + 4 * h


def capacity(config: GraniteConfig, max_num_seqs: int, max_num_batched_tokens: int,
             max_model_len: int, block_size: int) -> Capacity:
    """The largest step a runner of these sizes plans its buffers for (its largest token and
    sequence buckets, every row's logits, block tables of max_model_len)."""
    tmax, smax = buckets(max_num_batched_tokens)[-1], buckets(max_num_seqs)[-1]
    v = config.vocab_size
    return Capacity(tmax=tmax, smax=smax, rmax=tmax + smax, srmax=tmax + smax,
                    mbmax=-(-max_model_len // block_size),
                    nban_max=smax * v, nmw_max=smax * mask_words(v), nbias_max=smax * v)


def buffer_bytes(config: GraniteConfig, cap: Capacity) -> dict[str, int]:
    """Bytes of the step's buffers: 'workspace', 'inputs', 'output' (one of the two), 'layer_table'."""
    return {"workspace": WORKSPACE.place(workspace_dims(cap, config)).nbytes,
            "inputs": INPUTS.place(cap.input_dims()).nbytes,
            "output": OUTPUTS.place({"SR": cap.srmax, "K": KMAX, "P": cap.smax,
                                     "H": config.hidden_size}).nbytes,
            "layer_table": config.num_hidden_layers * LAYER_FIELDS * 8}


def scratch_bytes(config: GraniteConfig, cap: Capacity) -> int:
    """Workspace, inputs, both outputs and the layer table: what the runner places beside the
    weights and the KV cache (``ModelRunner.scratch_bytes``)."""
    b = buffer_bytes(config, cap)
    return b["workspace"] + b["inputs"] + 2 * b["output"] + b["layer_table"] + state_bytes(config, cap)


def state_bytes(config: GraniteConfig, cap: Capacity) -> int:
    """A hybrid model's Mamba-2 states: per Mamba layer, each of the 2 SMAX state slots' conv
    state [K - 1, C] and SSM state [NH, P, N] in float32 (models/step/memory_plan.py)."""
    m = config.mamba
    if not m or not config.mamba_layers:
        return 0
    return 2 * cap.smax * len(config.mamba_layers) * 4 * m.state_values


@dataclass(frozen=True, slots=True)
class CardFit:
    """One of ``tp`` cards serving a model at these sizes, in bytes (see ``plan_fit``)."""

    tp: int
    weights: int
    kv_cache: int            # max_num_seqs contexts of max_model_len, in whole blocks (+ the trash block)
    scratch: int             # workspace, inputs, outputs, layer table
    kv_token_bytes: int      # one token's K and V over every layer, on this card
    usable: int              # what the card can hand out (CARD_USABLE_BYTES, or the emulator's card)
    lora: int = 0            # the LoRA adapters' slots (--enable-lora: --max-loras at --max-lora-rank)

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.scratch + self.lora

    @property
    def left(self) -> int:
        return self.usable - self.total

    @property
    def fits(self) -> bool:
        return self.left >= 0



def kv_token_bytes(config: GraniteConfig, kv_dtype: str, tp: int = 1) -> int:
    """Bytes of one token's K and V over every layer on one of ``tp`` cards (kv_cache.block_bytes
    of one token)."""
    return block_bytes(card_config(config, tp), 1, kv_dtype)


def lora_arena_bytes(config: GraniteConfig, max_loras: int, max_rank: int, tp: int = 1) -> int:
    """Bytes of the LoRA arena one of ``tp`` cards holds: per layer a block of ``max_loras``
    slots at rank ``max_rank`` over the seven modules, in float32 (models/lora/layout.py, as
    LoraArena places it; the modules sharded with their projections)."""
    c = card_config(config, tp)
    floats = block_offsets(c.hidden_size, c.q_size, c.kv_size, c.intermediate_size, max_rank, max_loras)[-1]
    return c.num_hidden_layers * int(floats) * 4


def plan_fit(config: GraniteConfig, *, dtype: str, kv_dtype: str, tp: int, max_num_seqs: int,
             max_num_batched_tokens: int, max_model_len: int, block_size: int,
             usable: int = CARD_USABLE_BYTES, lora: tuple[int, int] | None = None,
             formats: dict | None = None) -> CardFit:
    """What one of ``tp`` cards holds to serve ``max_num_seqs`` sequences of ``max_model_len``
    tokens with these step sizes, and with ``lora`` (max_loras, max_rank) LoRA slots (every
    card holds the same: the shards are even); ``formats``: a file's GEMM weights' own
    (weight_bytes)."""
    per_token = kv_token_bytes(config, kv_dtype, tp)
    blocks = max_num_seqs * -(-max_model_len // block_size) + 1
    shard_cfg = card_config(config, tp)
    cap = capacity(shard_cfg, max_num_seqs, max_num_batched_tokens, max_model_len, block_size)
    return CardFit(tp=tp, weights=weight_bytes(config, dtype, tp, formats), kv_cache=blocks * block_size * per_token,
                   scratch=scratch_bytes(shard_cfg, cap), kv_token_bytes=per_token, usable=usable,
                   lora=lora_arena_bytes(config, *lora, tp) if lora else 0)


def _largest(fits, low: int, high: int) -> int:
    """The largest n in [low, high] with fits(n) (fits is monotone), or low - 1 when none."""
    if not fits(low):
        return low - 1
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def largest_context(config: GraniteConfig, *, max_num_seqs: int, block_size: int, **sizes) -> int:
    """The longest --max-model-len (whole blocks, at most the model's positions) with which
    ``max_num_seqs`` sequences fit (``plan_fit``'s other arguments in ``sizes``); 0 when none."""
    limit = config.max_position_embeddings // block_size
    blocks = _largest(lambda n: plan_fit(config, max_num_seqs=max_num_seqs, max_model_len=n * block_size,
                                         block_size=block_size, **sizes).fits, 1, limit)
    return blocks * block_size


def largest_batch(config: GraniteConfig, *, max_model_len: int, **sizes) -> int:
    """The most sequences of ``max_model_len`` tokens that fit (the step buffers grow with them
    too); 0 when not one does."""
    fits = lambda n: plan_fit(config, max_num_seqs=n, max_model_len=max_model_len, **sizes).fits  # noqa: E731
    high = 1
    while fits(high) and high < 1 << 20:
        high *= 2
    return _largest(fits, 1, high)
