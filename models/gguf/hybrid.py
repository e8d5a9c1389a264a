"""llama.cpp's Granite 4.0 hybrid (``granitehybrid``) and Granite 3.x mixture-of-experts
(``granitemoe``) GGUF files, read back into the Hugging Face checkpoint they were converted from.

llama.cpp's converter (convert_hf_to_gguf.py: ``GraniteHybridModel``, ``GraniteMoeModel``,
``Mamba2Model``) changes a GraniteMoeHybrid / GraniteMoe(Shared) checkpoint in these ways, and
``hf_tensors`` undoes each:

- The experts' fused ``input_linear`` [E, 2I, H] is split into ``ffn_gate_exps`` and
  ``ffn_up_exps`` (gate first); the shared MLP's fused ``input_linear`` into ``ffn_gate_shexp`` /
  ``ffn_up_shexp`` beside experts, or ``ffn_gate`` / ``ffn_up`` without them (its
  ``output_linear`` is ``ffn_down_shexp`` or ``ffn_down``). The router is ``ffn_gate_inp``.
- A Mamba-2 mixer: ``A_log`` is stored as A = -exp(A_log) (``ssm_a``, [NH, 1]); ``D`` as [NH, 1];
  the depthwise conv's [C, 1, K] squeezed to [C, K]; the gated norm's [DI] as [G, DI / G];
  ``dt_bias`` is ``ssm_dt.bias``.
- q/k rows are permuted to GGML's rotary layout, as for Llama (``checkpoint.unpermute_rope_rows``).
- Metadata: which layers are attention is the per-layer ``attention.head_count_kv`` array (0 for
  a Mamba layer); the mixer's shape is ``ssm.{conv_kernel, state_size, group_count, inner_size,
  time_step_rank}`` (the rank is the head count); ``rope.scaling.finetuned`` says whether
  attention uses RoPE (false for a hybrid: Granite 4.0's attention has no positions); experts
  are ``expert_count`` / ``expert_used_count``, the shared MLP's width
  ``expert_shared_feed_forward_length``. A GraniteMoe file with ``*_shexp`` tensors is
  GraniteMoeShared.

A matrix stored quantized (any of models/gguf/file.py's QUANTIZED_TYPES: the attention and
Mamba projections, the router, the experts' and the shared MLP's, the embedding and LM head) is kept at its width with
``quantized`` (a ``device.layout.QuantizedWeight``, an experts' stack a list of them, one an
expert), as the dense architectures' are; every other tensor is dequantized to float32.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
from gguf import Keys

from spyre_serve.device.layout import QuantizedWeight
from spyre_serve.models.gguf.file import QUANTIZED_TYPES, GGUFError, GGUFFile, dequantize_tensor, quantized_tensor

ARCHITECTURES = {"granitehybrid": "GraniteMoeHybridForCausalLM", "granitemoe": "GraniteMoeForCausalLM"}

# llama.cpp's per-layer tensor (name, suffix) -> the Hugging Face name after "model.layers.N."
_DIRECT = {
    ("attn_norm", "weight"): "input_layernorm.weight",
    ("ffn_norm", "weight"): "post_attention_layernorm.weight",
    ("attn_q", "weight"): "self_attn.q_proj.weight",
    ("attn_k", "weight"): "self_attn.k_proj.weight",
    ("attn_v", "weight"): "self_attn.v_proj.weight",
    ("attn_output", "weight"): "self_attn.o_proj.weight",
    ("ssm_in", "weight"): "mamba.in_proj.weight",
    ("ssm_conv1d", "weight"): "mamba.conv1d.weight",
    ("ssm_conv1d", "bias"): "mamba.conv1d.bias",
    ("ssm_dt", "bias"): "mamba.dt_bias",
    ("ssm_a", ""): "mamba.A_log",
    ("ssm_d", ""): "mamba.D",
    ("ssm_norm", "weight"): "mamba.norm.weight",
    ("ssm_out", "weight"): "mamba.out_proj.weight",
    ("ffn_gate_inp", "weight"): "block_sparse_moe.router.layer.weight",
    ("ffn_down_exps", "weight"): "block_sparse_moe.output_linear.weight",
    ("ffn_down_shexp", "weight"): "shared_mlp.output_linear.weight",
    ("ffn_down", "weight"): "shared_mlp.output_linear.weight",
}
# pairs fused back into one Hugging Face tensor: (gate, up) -> the fused name and its axis
_FUSED = {
    ("ffn_gate_exps", "ffn_up_exps"): ("block_sparse_moe.input_linear.weight", 1),
    ("ffn_gate_shexp", "ffn_up_shexp"): ("shared_mlp.input_linear.weight", 0),
    ("ffn_gate", "ffn_up"): ("shared_mlp.input_linear.weight", 0),
}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_NAME = re.compile(r"blk\.(\d+)\.(\w+?)(?:\.(weight|bias))?")
# the matrices a GEMM multiplies by (kept at their width when quantized)
_MATRICES = {"attn_q", "attn_k", "attn_v", "attn_output", "ssm_in", "ssm_out", "ffn_gate_inp", "ffn_gate_exps",
             "ffn_up_exps", "ffn_down_exps", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "ffn_gate",
             "ffn_up", "ffn_down"}


def architecture(f: GGUFFile) -> str:
    """The Hugging Face class: a granitemoe file with shared-expert tensors is GraniteMoeShared."""
    arch = ARCHITECTURES[f.architecture]
    if f.architecture == "granitemoe" and any(n.endswith("_shexp.weight") for n in f.tensors):
        return "GraniteMoeSharedForCausalLM"
    return arch


def _int(f: GGUFFile, key: str, default: int | None = None) -> int:
    value = f.metadata.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise GGUFError(f"{f.path}: metadata {key!r} is {value!r:.40}, not a non-negative integer")
    return value


def config_fields(f: GGUFFile, hidden: int, blocks: int) -> dict:
    """The Hugging Face config fields of a granitehybrid or granitemoe file beyond Llama's:
    KV heads, layer kinds, RoPE or none, experts, the shared MLP and the Mamba-2 mixer."""
    key = f.arch_key
    out: dict = {"num_local_experts": _int(f, key(Keys.LLM.EXPERT_COUNT), 0),
                 "num_experts_per_tok": _int(f, key(Keys.LLM.EXPERT_USED_COUNT), 0)}
    shared = f.metadata.get(key(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH))
    if shared is not None:
        out["shared_intermediate_size"] = _int(f, key(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH))
    kv = f.metadata.get(key(Keys.Attention.HEAD_COUNT_KV))
    if f.architecture == "granitemoe":
        out["num_key_value_heads"] = _int(f, key(Keys.Attention.HEAD_COUNT_KV), _int(f, key(Keys.Attention.HEAD_COUNT)))
        return out
    per_layer = kv if isinstance(kv, list) else [kv] * blocks
    if len(per_layer) != blocks or not all(isinstance(n, int) and n >= 0 for n in per_layer):
        raise GGUFError(f"{f.path}: metadata {key(Keys.Attention.HEAD_COUNT_KV)!r} must give one KV head count "
                        f"per layer ({blocks}), got {kv!r:.80}")
    attention = sorted({n for n in per_layer if n})
    if len(attention) > 1:
        raise GGUFError(f"{f.path}: attention layers with different KV head counts {attention}; one is supported")
    out["num_key_value_heads"] = attention[0] if attention else _int(f, key(Keys.Attention.HEAD_COUNT))
    out["layer_types"] = ["attention" if n else "mamba" for n in per_layer]
    out["position_embedding_type"] = "rope" if f.metadata.get(key(Keys.Rope.SCALING_FINETUNED)) else "nope"
    if "shared_intermediate_size" not in out:      # a dense hybrid: its MLP is ffn_gate's width
        gate = next((t for n, t in f.tensors.items() if n.endswith(".ffn_gate.weight")), None)
        if gate is None:
            raise GGUFError(f"{f.path}: no {key(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH)!r} and no ffn_gate "
                            "tensor to size the shared MLP")
        out["shared_intermediate_size"] = gate.shape[0]
    if "mamba" in out["layer_types"]:
        heads, inner = _int(f, key(Keys.SSM.TIME_STEP_RANK)), _int(f, key(Keys.SSM.INNER_SIZE))
        if not heads or inner % heads:
            raise GGUFError(f"{f.path}: {key(Keys.SSM.INNER_SIZE)!r} {inner} does not split into "
                            f"{key(Keys.SSM.TIME_STEP_RANK)!r} {heads} heads")
        first = out["layer_types"].index("mamba")
        out.update({"mamba_n_heads": heads, "mamba_d_head": inner // heads, "mamba_expand": inner / hidden,
                    "mamba_n_groups": _int(f, key(Keys.SSM.GROUP_COUNT)),
                    "mamba_d_state": _int(f, key(Keys.SSM.STATE_SIZE)),
                    "mamba_d_conv": _int(f, key(Keys.SSM.CONV_KERNEL)),
                    "mamba_conv_bias": f"blk.{first}.ssm_conv1d.bias" in f.tensors})
    return out


def unknown_tensors(f: GGUFFile) -> list[str]:
    """The tensors ``hf_tensors`` would not place."""
    fused = {name for pair in _FUSED for name in pair}
    out = []
    for name in f.tensors:
        m = _NAME.fullmatch(name)
        if name in _GLOBAL or (m and ((m.group(2), m.group(3) or "") in _DIRECT
                                      or (m.group(2) in fused and m.group(3) == "weight"))):
            continue
        out.append(name)
    return out


def _at_width(f: GGUFFile, t):
    """A quantized matrix as its quants and scales; an experts' stack [E, N, K] as a
    list of E of them."""
    if len(t.shape) == 2:
        return quantized_tensor(f, t)
    experts, rows, cols = t.shape
    whole = quantized_tensor(f, dataclasses.replace(t, shape=(experts * rows, cols)))   # the same bytes
    return [whole.take_rows(np.arange(e * rows, (e + 1) * rows)) for e in range(experts)]


def shape_of(w) -> tuple[int, ...]:
    """The shape of a tensor ``hf_tensors`` gives: an array's, a quantized matrix's, or an
    experts' list's (experts first)."""
    if isinstance(w, list):
        return (len(w), *w[0].shape)
    return tuple(w.shape)


def _stack(gate, up, axis: int):
    """A fused gate/up tensor from its halves: quantized rows stacked when both are kept at
    their width in a format that holds both exactly (QuantizedWeight.in_one_format; an
    experts' stack: expert by expert), else float32 concatenated."""
    if isinstance(gate, list) and isinstance(up, list):
        pairs = [QuantizedWeight.in_one_format([g, u]) for g, u in zip(gate, up, strict=True)]
        if all(p is not None for p in pairs):
            return [QuantizedWeight.stack(p) for p in pairs]
    elif isinstance(gate, QuantizedWeight) and isinstance(up, QuantizedWeight):
        both = QuantizedWeight.in_one_format([gate, up])
        if both is not None:
            return QuantizedWeight.stack(both)
    return np.concatenate([_float(gate), _float(up)], axis=axis)


def _float(w) -> np.ndarray:
    if isinstance(w, list):
        return np.stack([q.dequantize() for q in w])
    return w.dequantize() if isinstance(w, QuantizedWeight) else w


def hf_tensors(f: GGUFFile, n_heads: int, n_kv_heads: int, unpermute,
               quantized: bool = True) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Every tensor under its Hugging Face name and in its layout: float32, or a quantized
    matrix at its width (``quantized``: see the module docstring); and each one's GGML type
    name (a fused one's gate's)."""
    tensors, stored, halves = {}, {}, {}

    def read(t, kind: str):
        keep = quantized and t.ggml_type in QUANTIZED_TYPES and kind in _MATRICES | {"token_embd", "output"}
        return _at_width(f, t) if keep else dequantize_tensor(f, t)

    for t in f.tensors.values():
        if t.name in _GLOBAL:
            name = _GLOBAL[t.name]
            tensors[name], stored[name] = read(t, t.name.split(".")[0]), t.type_name
            continue
        m = _NAME.fullmatch(t.name)
        layer, kind, suffix = int(m.group(1)), m.group(2), m.group(3) or ""
        prefix = f"model.layers.{layer}."
        w = read(t, kind if suffix == "weight" else "")
        if kind == "ssm_a" and not (w < 0).all():
            raise GGUFError(f"{f.path}: {t.name} holds A = -exp(A_log), negative, but has values >= 0")
        if (kind, suffix) in _DIRECT:
            name = prefix + _DIRECT[(kind, suffix)]
            tensors[name], stored[name] = _to_hf(kind, w, n_heads, n_kv_heads, unpermute), t.type_name
        else:
            halves[(layer, kind)] = (w, t.type_name)
    for (gate, up), (fused, axis) in _FUSED.items():
        for layer in sorted({layer for layer, kind in halves if kind in (gate, up)}):
            if (layer, gate) not in halves or (layer, up) not in halves:
                raise GGUFError(f"{f.path}: block {layer} has one of {gate}/{up} without the other")
            name = f"model.layers.{layer}.{fused}"
            tensors[name] = _stack(halves[(layer, gate)][0], halves[(layer, up)][0], axis)
            stored[name] = halves[(layer, gate)][1]
    return tensors, stored


def _to_hf(kind: str, w: np.ndarray, n_heads: int, n_kv_heads: int, unpermute) -> np.ndarray:
    """One tensor from llama.cpp's layout back to Hugging Face's."""
    if kind in ("attn_q", "attn_k"):
        heads = n_heads if kind == "attn_q" else n_kv_heads
        if isinstance(w, QuantizedWeight):      # its rows (output channels) put back in order
            return w.take_rows(unpermute(np.arange(w.shape[0]), heads))
        return unpermute(w, heads)
    if kind == "ssm_a":          # A = -exp(A_log), [NH, 1]
        return np.log(-w.reshape(-1).astype(np.float64)).astype(np.float32)
    if kind == "ssm_d":
        return w.reshape(-1)
    if kind == "ssm_conv1d" and w.ndim == 2:      # the weight: [C, K] -> [C, 1, K]
        return w[:, None, :]
    if kind == "ssm_norm":       # [G, DI / G] -> [DI]
        return w.reshape(-1)
    return w
