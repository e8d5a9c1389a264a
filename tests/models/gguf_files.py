"""Small GGUF files for tests, written as llama.cpp's converter writes them.

    tensors = dict(init_tensors(config, stds, seed))       # HF names, float32
    held = write_gguf(path, config, tensors, qtype=Q.Q8_0, tokenizer_dir=ASSETS, pre="gpt-2")
    write_numpy_checkpoint(ref_dir, config, held)          # the same weights as safetensors

``write_gguf`` writes llama.cpp's metadata keys and tensor names, permutes q_proj/k_proj rows
with llama.cpp's own formula (``llama_cpp_permute``, from convert_hf_to_gguf.py), keeps
norms in F32 and quantizes every matrix to ``qtype``; it returns what the file holds,
dequantized, in Hugging Face names and layout: the reference a loader must reproduce.

Types ``gguf.quants.quantize`` cannot produce (Q4_K, Q6_K) are packed by ``pack_q4_k`` and
``pack_q6_k``, written from GGML's block layouts (ggml-common.h ``block_q4_K``/``block_q6_K``)
and its scalar ``dequantize_row_q4_K``/``_q6_K`` (ggml-quants.c), not from gguf-py: each
returns the bytes and the values those bytes decode to by that C code, so a test compares
gguf's dequantizer with an independent reading of the format.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType
from gguf.quants import dequantize, quantize

from spyre_serve.models.checkpoints.hf import expected_shapes
from spyre_serve.models.config import GraniteConfig
from spyre_serve.models.gguf.checkpoint import gguf_name

Q = GGMLQuantizationType
QK_K = 256
_FILE_TYPES = {Q.F32: LlamaFileType.ALL_F32, Q.F16: LlamaFileType.MOSTLY_F16,
               Q.BF16: LlamaFileType.MOSTLY_BF16, Q.Q8_0: LlamaFileType.MOSTLY_Q8_0,
               Q.Q4_0: LlamaFileType.MOSTLY_Q4_0, Q.Q4_1: LlamaFileType.MOSTLY_Q4_1,
               Q.Q5_0: LlamaFileType.MOSTLY_Q5_0, Q.Q5_1: LlamaFileType.MOSTLY_Q5_1,
               Q.Q4_K: LlamaFileType.MOSTLY_Q4_K_M, Q.Q6_K: LlamaFileType.MOSTLY_Q6_K}


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF's half-split rotary rows of each head
    -> GGML's interleaved pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


# ------------------------------------------------------------------ quantization


def quantize_matrix(w: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray]:
    """(bytes or values to write, float32 values they decode to), row by row."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if qtype == Q.F32:
        return w, w
    if qtype == Q.Q4_K:
        return pack_q4_k(w)
    if qtype == Q.Q6_K:
        return pack_q6_k(w)
    raw = quantize(w, qtype)
    return raw, dequantize(raw, qtype).astype(np.float32)


def _f16(x: np.ndarray) -> np.ndarray:
    """float32 -> the float16 value, kept as float32 (what a block's ``ggml_half`` holds)."""
    return x.astype(np.float16).astype(np.float32)


def _round_div(x: np.ndarray, by: np.ndarray) -> np.ndarray:
    """round(x / by), 0 where by is 0."""
    safe = np.where(by == 0, 1, by)
    return np.where(by == 0, 0, np.rint(x / safe))


def pack_q4_k(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K: super-blocks of 256 = 8 sub-blocks of 32, value = d*sc[j]*q - dmin*m[j] with
    q 4-bit, sc/m 6-bit, d/dmin fp16. Bytes: d, dmin, scales[12], qs[128] (144)."""
    rows, cols = w.shape
    x = w.reshape(-1, 8, 32)                                   # [blocks, sub-block, value]
    lo = np.minimum(x.min(-1), 0.0)
    scale, mins = (x.max(-1) - lo) / 15, -lo                   # [blocks, 8]
    d, dmin = _f16(scale.max(-1) / 63), _f16(mins.max(-1) / 63)   # [blocks]
    sc = np.clip(_round_div(scale, d[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(_round_div(mins, dmin[:, None]), 0, 63).astype(np.uint8)
    d1 = (d[:, None] * sc.astype(np.float32))[..., None]      # as the C code: d * sc, then * q
    m1 = (dmin[:, None] * m.astype(np.float32))[..., None]
    q = np.clip(_round_div(x + m1, d1), 0, 15).astype(np.uint8)   # [blocks, 8, 32]
    values = (d1 * q.astype(np.float32) - m1).reshape(rows, cols)

    scales = np.zeros((x.shape[0], 12), np.uint8)
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)    # get_scale_min_k4, j < 4 / j >= 4
    scales[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    pairs = q.reshape(-1, 4, 2, 32)                            # 64 values: low nibbles, then high
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d.astype(np.float16).view(np.uint8).reshape(-1, 2),
                             dmin.astype(np.float16).view(np.uint8).reshape(-1, 2),
                             scales, qs], axis=1)              # [blocks, 144]
    return blocks.reshape(rows, -1), values.astype(np.float32)


def pack_q6_k(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K: super-blocks of 256 = 16 sub-blocks of 16, value = d*sc[s]*(q - 32) with q 6-bit,
    sc int8, d fp16. Bytes: ql[128] (low nibbles), qh[64] (high 2 bits), scales[16], d (210)."""
    rows, cols = w.shape
    x = w.reshape(-1, 16, 16)                                  # [blocks, sub-block, value]
    scale = np.abs(x).max(-1) / 31                             # [blocks, 16]
    d = _f16(scale.max(-1) / 127)                              # [blocks]
    sc = np.clip(_round_div(scale, d[:, None]), -128, 127).astype(np.int8)
    d1 = (d[:, None] * sc.astype(np.float32))[..., None]
    q = (np.clip(_round_div(x, d1), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    values = (d1 * (q.reshape(-1, 16, 16).astype(np.float32) - 32)).reshape(rows, cols)

    # half h of 128 values, quarter k of 32: value 128h + 32k + l
    ql = np.concatenate([q[:, :, 0] & 0xF | (q[:, :, 2] & 0xF) << 4,
                         q[:, :, 1] & 0xF | (q[:, :, 3] & 0xF) << 4], axis=2)   # [blocks, 2, 64]
    qh = (q[:, :, 0] >> 4) | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6
    blocks = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8),
                             d.astype(np.float16).view(np.uint8).reshape(-1, 2)], axis=1)
    return blocks.reshape(rows, -1), values.astype(np.float32)


# ------------------------------------------------------------------ files


def write_gguf(path, config: GraniteConfig, tensors: dict[str, np.ndarray], *, qtype: Q = Q.F32,
               tokenizer_dir: Path | None = None, pre: str = "gpt-2", permute: bool = True,
               types: dict[str, Q] | None = None, metadata: dict | None = None,
               drop: tuple[str, ...] = (), extra: dict | None = None,
               arch: str | None = None) -> dict[str, np.ndarray]:
    """Write ``tensors`` (HF names, float32) as llama.cpp would; return HF name -> the float32
    values the file holds (dequantized, HF row order).

    types: per-HF-name type overrides. metadata: extra or replaced keys (``{arch}`` in a key
    is formatted; a value None removes the key). drop: HF names left out. extra: more
    tensors by llama.cpp name, float values (written F32) or (bytes, type) pairs written as
    they are. arch: the architecture name to write."""
    arch = arch or ("granite" if config.architecture == "GraniteForCausalLM" else "llama")
    w = GGUFWriter(str(path), arch)
    kv = _model_metadata(config, arch, qtype)
    if tokenizer_dir is not None:
        kv.update(tokenizer_metadata(Path(tokenizer_dir), pre))
    for key, value in (metadata or {}).items():
        kv[key.format(arch=arch)] = value
    for key, value in kv.items():
        if value is not None:
            _add(w, key, value)
    held = {}
    for name in expected_shapes(config):
        if name in drop or name not in tensors:
            continue
        data = np.asarray(tensors[name], np.float32)
        t = (types or {}).get(name, Q.F32 if data.ndim == 1 else qtype)
        raw, values = quantize_matrix(data, t) if data.ndim == 2 else (data, data)
        held[name] = values
        if permute and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads
            kv_heads = heads if "q_proj" in name else config.num_key_value_heads
            raw, _ = quantize_matrix(llama_cpp_permute(data, heads, kv_heads), t)
        w.add_tensor(gguf_name(name), raw, raw_dtype=None if t == Q.F32 else t)
    for name, data in (extra or {}).items():
        if isinstance(data, tuple):
            w.add_tensor(name, data[0], raw_dtype=data[1])
        else:
            w.add_tensor(name, np.asarray(data, np.float32))
    _write_out(w)
    return held


def _write_out(w: GGUFWriter) -> None:
    """The header, the metadata and the tensors, in GGUF's order, then the file closed."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _model_metadata(c: GraniteConfig, arch: str, qtype: Q) -> dict:
    """The keys convert_hf_to_gguf.py writes for a Llama/Granite config."""
    kv = {
        "general.name": "test model",
        "general.file_type": int(_FILE_TYPES[qtype]),
        f"{arch}.context_length": c.max_position_embeddings,
        f"{arch}.embedding_length": c.hidden_size,
        f"{arch}.block_count": c.num_hidden_layers,
        f"{arch}.feed_forward_length": c.intermediate_size,
        f"{arch}.attention.head_count": c.num_attention_heads,
        f"{arch}.attention.head_count_kv": c.num_key_value_heads,
        f"{arch}.rope.freq_base": float(c.rope_theta),
        f"{arch}.attention.layer_norm_rms_epsilon": float(c.rms_norm_eps),
        f"{arch}.vocab_size": c.vocab_size,
        f"{arch}.rope.dimension_count": c.head_dim,
        "tokenizer.ggml.bos_token_id": c.bos_token_id,
        "tokenizer.ggml.eos_token_id": c.eos_token_id[0],
        "tokenizer.ggml.padding_token_id": c.pad_token_id,
    }
    if arch == "granite":
        kv.update({f"{arch}.attention.scale": float(c.attention_multiplier),
                   f"{arch}.embedding_scale": float(c.embedding_multiplier),
                   f"{arch}.residual_scale": float(c.residual_multiplier),
                   f"{arch}.logit_scale": float(c.logits_scaling)})
    return kv


def tokenizer_metadata(directory: Path, pre: str) -> dict:
    """tokenizer.ggml.* and the chat template from a byte-level BPE tokenizer.json, as
    llama.cpp's converter writes them (added special tokens CONTROL, others USER_DEFINED)."""
    tj = json.loads((directory / "tokenizer.json").read_text())
    cfg = json.loads((directory / "tokenizer_config.json").read_text())
    vocab = dict(tj["model"]["vocab"])
    kinds = {}
    for added in tj["added_tokens"]:
        vocab[added["content"]] = added["id"]
        kinds[added["id"]] = TokenType.CONTROL if added["special"] else TokenType.USER_DEFINED
    tokens = [None] * (max(vocab.values()) + 1)
    for token, i in vocab.items():
        tokens[i] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [int(kinds.get(i, TokenType.NORMAL)) for i in range(len(tokens))],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.add_bos_token": bool(cfg.get("add_bos_token", False)),
        "tokenizer.chat_template": cfg.get("chat_template"),
    }


def _add(w: GGUFWriter, key: str, value) -> None:
    """One metadata key with the type llama.cpp's writer gives such a value."""
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, list):
        w.add_array(key, value)
    else:
        raise TypeError(f"metadata {key!r}: {type(value).__name__}")


def write_numpy_checkpoint(directory, config: GraniteConfig, tensors: dict[str, np.ndarray],
                           dtype: str = "float32") -> Path:
    """config.json + model.safetensors holding ``tensors`` stored as ``dtype`` (values
    already representable in it): the safetensors twin of a GGUF file, for parity. A twin
    of a 16-bit file is 16-bit too, so both are placed on the card in the same width."""
    from safetensors.numpy import save_file

    from spyre_serve.models.checkpoints.profiles import write_bf16_safetensors

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = dataclasses.replace(config, torch_dtype=dtype)
    (directory / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    if dtype == "bfloat16":
        write_bf16_safetensors(directory / "model.safetensors", config, tensors)
    else:
        save_file({n: np.ascontiguousarray(a, dtype=dtype) for n, a in tensors.items()},
                  str(directory / "model.safetensors"))
    return directory


# ------------------------------------------------------------------ Granite 4.0 hybrids, Granite 3.x MoE


def write_hybrid_gguf(path, model, checkpoint_dir, tokenizer_dir: Path | None = None, qtype: Q = Q.F32) -> str:
    """A transformers GraniteMoeHybrid / GraniteMoe(Shared) model written as llama.cpp's converter
    writes it (convert_hf_to_gguf.py's GraniteHybridModel, GraniteMoeModel, Mamba2Model), all
    tensors F32: the fused gate/up halves split, A as -exp(A_log), D and A as [NH, 1], the conv
    squeezed, the gated norm as [G, DI / G], q/k rows permuted, KV heads per layer (0: Mamba),
    RoPE off for a hybrid. The tensors are read from the safetensors ``checkpoint_dir`` holds (the
    names a checkpoint has on disk, as the converter reads them); ``tokenizer_dir``: a tokenizer.json
    (and tokenizer_config.json) written into the file too; ``qtype``: the matrices (projections,
    router, experts, embedding and LM head) quantized to it, as ``--outtype q8_0`` does, the rest
    F32. Returns the architecture written."""
    from safetensors.numpy import load_file

    c = model.config
    sd = {}
    for f in sorted(Path(checkpoint_dir).glob("*.safetensors")):
        sd.update({k: v.astype(np.float32) for k, v in load_file(f).items()})
    kinds = list(getattr(c, "layer_types", None) or ["attention"] * c.num_hidden_layers)
    mamba = [i for i, k in enumerate(kinds) if k in ("mamba", "linear_attention")]
    arch = "granitehybrid" if mamba else "granitemoe"
    experts = bool(getattr(c, "num_local_experts", 0))
    w = GGUFWriter(str(path), arch)
    kv = {
        "general.name": "test model", "general.file_type": int(_FILE_TYPES[qtype]),
        f"{arch}.context_length": 2 ** 20 if mamba else c.max_position_embeddings,
        f"{arch}.embedding_length": c.hidden_size, f"{arch}.block_count": c.num_hidden_layers,
        f"{arch}.feed_forward_length": c.intermediate_size, f"{arch}.attention.head_count": c.num_attention_heads,
        f"{arch}.attention.head_count_kv": ([0 if i in mamba else c.num_key_value_heads
                                             for i in range(c.num_hidden_layers)] if arch == "granitehybrid"
                                            else c.num_key_value_heads),
        f"{arch}.rope.freq_base": float(_rope_theta(c)),
        f"{arch}.attention.layer_norm_rms_epsilon": float(c.rms_norm_eps),
        f"{arch}.attention.scale": float(c.attention_multiplier),
        f"{arch}.embedding_scale": float(c.embedding_multiplier),
        f"{arch}.residual_scale": float(c.residual_multiplier), f"{arch}.logit_scale": float(c.logits_scaling),
        "tokenizer.ggml.bos_token_id": c.bos_token_id, "tokenizer.ggml.eos_token_id": c.eos_token_id,
    }
    if experts:
        kv[f"{arch}.expert_count"] = c.num_local_experts
        kv[f"{arch}.expert_used_count"] = c.num_experts_per_tok
    if getattr(c, "shared_intermediate_size", None):
        kv[f"{arch}.expert_shared_feed_forward_length"] = c.shared_intermediate_size
    if tokenizer_dir is not None:
        kv.update(tokenizer_metadata(Path(tokenizer_dir), "gpt-2"))
    if arch == "granitehybrid":
        heads = c.mamba_n_heads
        kv.update({f"{arch}.ssm.conv_kernel": c.mamba_d_conv, f"{arch}.ssm.state_size": c.mamba_d_state,
                   f"{arch}.ssm.group_count": c.mamba_n_groups, f"{arch}.ssm.inner_size": heads * c.mamba_d_head,
                   f"{arch}.ssm.time_step_rank": heads, f"{arch}.rope.scaling.finetuned": False})
    for key, value in kv.items():
        if value is not None:
            _add(w, key, value)
    matrices = re.compile(r"(token_embd|output|blk\.\d+\.(attn_(q|k|v|output)|ssm_(in|out)|ffn_\w+))\.weight")
    for name, t in _hybrid_tensors(sd, c, mamba, experts).items():
        t = np.ascontiguousarray(t, np.float32)
        if qtype != Q.F32 and matrices.fullmatch(name) and t.ndim >= 2 and "norm" not in name:
            w.add_tensor(name, quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, t)
    _write_out(w)
    return arch


def _rope_theta(c) -> float:
    """A transformers config's rope_theta: 4's attribute, or 5's rope_parameters["rope_theta"]."""
    try:
        return c.rope_theta
    except AttributeError:
        return (getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0)


def _hybrid_tensors(sd: dict, c, mamba: list[int], experts: bool) -> dict[str, np.ndarray]:
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if "lm_head.weight" in sd and not c.tie_word_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out[b + "attn_norm.weight"] = sd[p + "input_layernorm.weight"]
        out[b + "ffn_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
        if i in mamba:
            m = p + "mamba."
            out[b + "ssm_in.weight"] = sd[m + "in_proj.weight"]
            out[b + "ssm_conv1d.weight"] = sd[m + "conv1d.weight"].squeeze()
            if m + "conv1d.bias" in sd:
                out[b + "ssm_conv1d.bias"] = sd[m + "conv1d.bias"]
            out[b + "ssm_dt.bias"] = sd[m + "dt_bias"]
            out[b + "ssm_a"] = -np.exp(sd[m + "A_log"]).reshape(-1, 1)
            out[b + "ssm_d"] = sd[m + "D"].reshape(-1, 1)
            out[b + "ssm_norm.weight"] = sd[m + "norm.weight"].reshape(c.mamba_n_groups, -1)
            out[b + "ssm_out.weight"] = sd[m + "out_proj.weight"]
        else:
            a = p + "self_attn."
            out[b + "attn_q.weight"] = llama_cpp_permute(sd[a + "q_proj.weight"], c.num_attention_heads)
            out[b + "attn_k.weight"] = llama_cpp_permute(sd[a + "k_proj.weight"], c.num_attention_heads,
                                                         c.num_key_value_heads)
            out[b + "attn_v.weight"] = sd[a + "v_proj.weight"]
            out[b + "attn_output.weight"] = sd[a + "o_proj.weight"]
        if experts:
            e = p + "block_sparse_moe."
            out[b + "ffn_gate_inp.weight"] = sd[e + "router.layer.weight"]
            gate, up = np.split(sd[e + "input_linear.weight"], 2, axis=1)
            out[b + "ffn_gate_exps.weight"], out[b + "ffn_up_exps.weight"] = gate, up
            out[b + "ffn_down_exps.weight"] = sd[e + "output_linear.weight"]
        if p + "shared_mlp.input_linear.weight" in sd:
            gate, up = np.split(sd[p + "shared_mlp.input_linear.weight"], 2, axis=0)
            tail = "_shexp" if experts else ""
            out[b + f"ffn_gate{tail}.weight"], out[b + f"ffn_up{tail}.weight"] = gate, up
            out[b + f"ffn_down{tail}.weight"] = sd[p + "shared_mlp.output_linear.weight"]
    return out
