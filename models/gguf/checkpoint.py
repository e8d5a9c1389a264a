"""GGUF files (llama.cpp's format) read as a Hugging Face checkpoint, without torch.

``load_gguf_checkpoint(path)`` gives the same ``Checkpoint`` as a safetensors directory:
a ``GraniteConfig`` built from the file's metadata and every tensor with its Hugging Face
name and shape. Four architectures are served, ``llama``, ``granite``, and ``granitehybrid``
and ``granitemoe`` (llama.cpp's names; those two by ``hybrid.py``); tensor types
F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K. Their matrices stay at their
width (the card's GEMM reads the quants as they are: models/gguf/file.py's QUANTIZED_TYPES);
the float types are read as float32.
Anything else is refused naming the tensor and its type, or the architecture, before any tensor
is read.

Three things differ from a Hugging Face checkpoint:

- Names: llama.cpp's ``token_embd``, ``blk.N.attn_q``, ..., ``output_norm``, ``output``.
  A file without ``output.weight`` ties the LM head to the embedding.
- Rotary layout: llama.cpp's converter permutes the rows of each head of ``q_proj`` and
  ``k_proj`` from Hugging Face's half-split rotary layout (rotate x[i] with x[i + D/2]) to
  GGML's interleaved one (x[2i] with x[2i + 1]). Our rope kernel is half-split, so those
  rows are put back (``unpermute_rope_rows``), as transformers' GGUF loader does.
- Metadata: the config is ``{arch}.*`` keys (llama.cpp's spellings, taken from the
  ``gguf`` package's ``Keys``); Granite's multipliers are ``granite.embedding_scale``,
  ``granite.residual_scale``, ``granite.attention.scale`` and ``granite.logit_scale``
  (logits are divided by it, as llama.cpp's Granite graph does). A multiplier the file
  does not give is neutral, as in llama.cpp (attention scale 1/sqrt(head_dim)).

The container itself (header, metadata, tensor bytes, dequantizing) is models/gguf/file.py.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, Keys

from spyre_serve.models.checkpoints.hf import Checkpoint, check_shapes, expected_shapes
from spyre_serve.models.config import ConfigError, GraniteConfig
from spyre_serve.models.gguf import hybrid
from spyre_serve.models.gguf.file import (  # noqa: F401  (GGUFError, is_gguf_file: this module's interface)
    QUANTIZED_TYPES,
    GGUFError,
    GGUFFile,
    dequantize_tensor,
    is_gguf_file,
    quantized_tensor,
    read_gguf,
    require,
)

log = logging.getLogger("spyre_serve.models")

# llama.cpp's architecture name -> ours (the Hugging Face class name)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "granite": "GraniteForCausalLM"}

Q = GGMLQuantizationType
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)
_FLOAT_DTYPES = {Q.F32: "float32", Q.F16: "float16", Q.BF16: "bfloat16"}

# Tensor names: llama.cpp's -> Hugging Face's, in block N for the per-layer ones.
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
_HF_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)\.weight")


# ---------------------------------------------------------------- names and the config


def hf_name(gguf_name: str) -> str | None:
    """llama.cpp's tensor name -> Hugging Face's, or None for a tensor we do not run."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    m = _LAYER_NAME.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.weight"
    return None


def gguf_name(name: str) -> str:
    """Hugging Face's tensor name -> llama.cpp's (the inverse of ``hf_name``)."""
    for g, h in _GLOBAL_TENSORS.items():
        if h == name:
            return g
    m = _HF_LAYER_NAME.fullmatch(name)
    if m:
        for g, h in _LAYER_TENSORS.items():
            if h == m.group(2):
                return f"blk.{m.group(1)}.{g}.weight"
    raise KeyError(name)


def check_architecture(f: GGUFFile) -> str:
    """Our architecture class for the file's, or the refusal naming it."""
    arch = f.architecture
    if isinstance(arch, str) and arch in hybrid.ARCHITECTURES:
        return hybrid.architecture(f)
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise GGUFError(f"{f.path}: GGUF architecture {arch!r} is not supported; supported: "
                        f"{', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[arch]


def check_tensors(f: GGUFFile) -> None:
    """Every tensor is one we run, in a type we dequantize: else refuse naming the first."""
    if f.architecture in hybrid.ARCHITECTURES:
        unknown = [f.tensors[n] for n in hybrid.unknown_tensors(f)]
    else:
        unknown = [t for t in f.tensors.values() if hf_name(t.name) is None]
    if unknown:
        t = unknown[0]
        raise GGUFError(f"{f.path}: tensor {t.name!r} ({t.type_name}{list(t.shape)}) is not part of "
                        f"a {f.architecture} model this server runs (no biases, experts or rope "
                        f"frequency factors); {len(unknown)} such tensors in all")
    bad = [t for t in f.tensors.values() if t.ggml_type not in SUPPORTED_TYPES]
    if bad:
        t = bad[0]
        raise GGUFError(f"{f.path}: tensor {t.name!r} has type {t.type_name}, which this server "
                        f"does not dequantize; supported: {', '.join(q.name for q in SUPPORTED_TYPES)}"
                        f" ({len(bad)} tensors of unsupported types in all)")


def _one_value(f: GGUFFile, key: str):
    """A per-model value; llama.cpp allows a per-layer array, which we take if all equal."""
    v = f.metadata[key]
    if isinstance(v, list):
        if not v or any(x != v[0] for x in v):
            raise GGUFError(f"{f.path}: metadata {key!r} varies across layers ({v[:8]}...); "
                            "only uniform layers are supported")
        return v[0]
    return v


def _count(f: GGUFFile, key: str) -> int:
    """A size or count of the metadata (one value, or a uniform per-layer array): a positive int."""
    v = _one_value(f, key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise GGUFError(f"{f.path}: metadata {key!r} is {v!r:.40}, not a positive integer")
    return v


def _number(f: GGUFFile, key: str, default: float) -> float:
    """A float of the metadata (an int or a float, finite), ``default`` when absent."""
    v = f.metadata.get(key, default)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise GGUFError(f"{f.path}: metadata {key!r} is {v!r:.40}, not a number")
    return float(v)


def gguf_config(f: GGUFFile) -> GraniteConfig:
    """The GraniteConfig the metadata and tensors describe (llama.cpp's defaults where a key
    is optional), checked by the same parser as a config.json. Each count is checked first, a
    GGUFError naming the key (a head count of 0 divided by zero), and the block count against
    the tensors the file holds (10^12 blocks in an 8 KB file made their expected tensors until
    memory ran out: issue 38)."""
    arch = check_architecture(f)
    key = f.arch_key
    for k in (Keys.LLM.EMBEDDING_LENGTH, Keys.LLM.BLOCK_COUNT, Keys.LLM.FEED_FORWARD_LENGTH,
              Keys.Attention.HEAD_COUNT, Keys.LLM.CONTEXT_LENGTH):
        require(f, key(k))
    hidden = _count(f, key(Keys.LLM.EMBEDDING_LENGTH))
    heads = _count(f, key(Keys.Attention.HEAD_COUNT))
    blocks = _count(f, key(Keys.LLM.BLOCK_COUNT))
    extra = hybrid.config_fields(f, hidden, blocks) if f.architecture in hybrid.ARCHITECTURES else {}
    kv_heads = extra.pop("num_key_value_heads", None) or (
        _count(f, key(Keys.Attention.HEAD_COUNT_KV)) if key(Keys.Attention.HEAD_COUNT_KV) in f.metadata else heads)
    if blocks * len(_LAYER_TENSORS) > len(f.tensors):
        raise GGUFError(f"{f.path}: metadata {key(Keys.LLM.BLOCK_COUNT)!r} is {blocks}: the file holds "
                        f"{len(f.tensors)} tensors, and each block has {len(_LAYER_TENSORS)}")
    head_dim = _head_dim(f, hidden, heads)
    _refuse_rope_scaling(f)
    embed = f.tensors.get("token_embd.weight")
    if embed is None:
        raise GGUFError(f"{f.path}: no tensor 'token_embd.weight'")
    vocab = embed.shape[0]
    declared = f.metadata.get(key(Keys.LLM.VOCAB_SIZE))
    if declared is not None and declared != vocab:
        raise GGUFError(f"{f.path}: metadata {key(Keys.LLM.VOCAB_SIZE)!r} is {declared}, but "
                        f"'token_embd.weight' has {vocab} rows")
    d = {
        "architectures": [arch],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": _count(f, key(Keys.LLM.FEED_FORWARD_LENGTH)),
        "num_hidden_layers": blocks,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": _count(f, key(Keys.LLM.CONTEXT_LENGTH)),
        "rms_norm_eps": _number(f, key(Keys.Attention.LAYERNORM_RMS_EPS), 1e-5),
        "rope_theta": _number(f, key(Keys.Rope.FREQ_BASE), 10000.0),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "torch_dtype": _dominant_dtype(f),
        **_special_ids(f, vocab),
    }
    if arch == "LlamaForCausalLM":
        d["head_dim"] = head_dim
    else:
        d.update(_granite_multipliers(f, head_dim))
    d.update(extra)
    try:
        return GraniteConfig.from_dict(d)
    except ConfigError as e:
        raise GGUFError(f"{f.path}: the metadata gives a config this server cannot run: {e}") from e


def _head_dim(f: GGUFFile, hidden: int, heads: int) -> int:
    """``attention.key_length`` or hidden / heads (llama.cpp's rule); values and rotary
    dims must be the same size: partial rotary is not implemented."""
    key = f.arch_key
    head_dim = _count(f, key(Keys.Attention.KEY_LENGTH)) if key(Keys.Attention.KEY_LENGTH) in f.metadata else None
    if head_dim is None:
        if hidden % heads:
            raise GGUFError(f"{f.path}: embedding_length {hidden} is not divisible by "
                            f"head_count {heads} and there is no {key(Keys.Attention.KEY_LENGTH)!r}")
        head_dim = hidden // heads
    for k in (Keys.Attention.VALUE_LENGTH, Keys.Rope.DIMENSION_COUNT):
        v = f.metadata.get(key(k))
        if v is not None and v != head_dim:
            raise GGUFError(f"{f.path}: metadata {key(k)!r} is {v}, the head dim is {head_dim}; "
                            "only full rotary heads with equal key and value sizes are supported")
    return head_dim


def _refuse_rope_scaling(f: GGUFFile) -> None:
    scaling = f.metadata.get(f.arch_key(Keys.Rope.SCALING_TYPE))
    if scaling not in (None, "none"):
        raise GGUFError(f"{f.path}: metadata {f.arch_key(Keys.Rope.SCALING_TYPE)!r} is "
                        f"{scaling!r}; only no rope scaling is supported")


def _granite_multipliers(f: GGUFFile, head_dim: int) -> dict[str, float]:
    """Granite's four multipliers from llama.cpp's keys; absent ones neutral, as llama.cpp
    computes them (its attention scale defaults to 1/sqrt(head_dim), not HF's 1.0)."""
    key = f.arch_key
    return {
        "embedding_multiplier": _number(f, key(Keys.LLM.EMBEDDING_SCALE), 1.0),
        "residual_multiplier": _number(f, key(Keys.LLM.RESIDUAL_SCALE), 1.0),
        "attention_multiplier": _number(f, key(Keys.Attention.SCALE), 1.0 / math.sqrt(head_dim)),
        "logits_scaling": _number(f, key(Keys.LLM.LOGIT_SCALE), 1.0),
    }


def _special_ids(f: GGUFFile, vocab: int) -> dict:
    """bos/pad ids, and as eos ids every id generation ends on in llama.cpp: eos, end of
    turn, end of message. An id outside the vocabulary is left out, as transformers does."""
    t = Keys.Tokenizer
    ids = {k: f.metadata.get(k) for k in (t.BOS_ID, t.EOS_ID, t.EOT_ID, t.EOM_ID, t.PAD_ID)}
    ids = {k: v if isinstance(v, int) and 0 <= v < vocab else None for k, v in ids.items()}
    eos = list(dict.fromkeys(v for k in (t.EOS_ID, t.EOT_ID, t.EOM_ID)
                             if (v := ids[k]) is not None))
    return {"bos_token_id": ids[t.BOS_ID], "eos_token_id": eos, "pad_token_id": ids[t.PAD_ID]}


def _dominant_dtype(f: GGUFFile) -> str:
    """The float type most of the weights are stored in; quantized weights are float32
    once dequantized."""
    by_type: dict = {}
    for t in f.tensors.values():
        by_type[t.ggml_type] = by_type.get(t.ggml_type, 0) + math.prod(t.shape)
    main = max(by_type, key=by_type.get)
    return _FLOAT_DTYPES.get(main, "float32")


# ---------------------------------------------------------------- tensors


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's converter permutation of q_proj/k_proj rows (``n_heads`` of them:
    query heads for q, KV heads for k). Within each head of D rows the converter writes
    row 2i + j (j in 0, 1) from HF row j * D/2 + i; this puts every row back."""
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise GGUFError(f"{rows} rows do not split into {n_heads} heads of an even size")
    half = rows // n_heads // 2
    return np.ascontiguousarray(
        w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def load_gguf_checkpoint(path: str | Path, quantized: bool = True) -> Checkpoint:
    """Read a GGUF file into a Checkpoint: config from the metadata, every tensor refused,
    or under its Hugging Face name (q/k rows back in HF's rotary layout) either kept at its
    width (a quantized type with ``quantized``: a device.layout.QuantizedWeight, which the
    card serves as it is) or read as float32 (the float types; every type without
    ``quantized``). ``stored_dtypes`` holds each tensor's GGML type name ("Q4_1", ...)."""
    f = read_gguf(path)
    config = gguf_config(f)
    check_tensors(f)
    if f.architecture in hybrid.ARCHITECTURES:
        return _load_hybrid(f, config, quantized)
    expected = {gguf_name(n): s for n, s in expected_shapes(config).items()}
    check_shapes(f.path, expected, {n: t.shape for n, t in f.tensors.items()})
    rope_heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    tensors, stored = {}, {}
    for t in f.tensors.values():
        keep = quantized and t.ggml_type in QUANTIZED_TYPES
        w = quantized_tensor(f, t) if keep else dequantize_tensor(f, t)
        m = _LAYER_NAME.fullmatch(t.name)
        if m and m.group(2) in rope_heads:
            if keep:
                w = w.take_rows(unpermute_rope_rows(np.arange(t.shape[0]), rope_heads[m.group(2)]))
            else:
                w = unpermute_rope_rows(w, rope_heads[m.group(2)])
        tensors[hf_name(t.name)] = w
        stored[hf_name(t.name)] = t.type_name
    return Checkpoint(config=config, tensors=tensors, path=f.path, stored_dtypes=stored)


def _load_hybrid(f: GGUFFile, config: GraniteConfig, quantized: bool) -> Checkpoint:
    """A granitehybrid or granitemoe file (``hybrid``): every tensor under its Hugging Face name
    and layout, its matrices at their width where the card serves it (``quantized``), checked
    against the config's shapes."""
    tensors, stored = hybrid.hf_tensors(f, config.num_attention_heads, config.num_key_value_heads,
                                        unpermute_rope_rows, quantized)
    check_shapes(f.path, expected_shapes(config), {n: hybrid.shape_of(w) for n, w in tensors.items()})
    widened = sorted({t.type_name for t in f.tensors.values()
                      if (t.ggml_type not in QUANTIZED_TYPES or not quantized) and t.ggml_type not in _FLOAT_DTYPES})
    if widened:
        log.info("%s: its %s tensors are dequantized to float32 (the card keeps a quantized matrix at its "
                 "width)", f.path.name, ", ".join(widened))
    return Checkpoint(config=config, tensors=tensors, path=f.path, stored_dtypes=stored)
