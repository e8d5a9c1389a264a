"""The format each GEMM weight of a GGUF file takes on the card, from the file's header alone
(``spyre-serve plan`` sizes a file before reading its blocks).

The loader keeps a matrix of a quantized type at its width (``QUANTIZED_TYPES``: Q5_0 and
Q5_1 in Q5_K's records) and reads a float type as float32; the weights' placer
(models/step/weights.py) fuses q, k, v and gate, up in the narrowest format that holds every
part exactly (``QuantizedWeight.in_one_format``), else in the float width (``--dtype``). The
same function decides here, on one block of each part's type whose scales have that type's
form: a Q5_0's minimum is -16 d with d a float16 (Q8_0 holds it), a Q5_1's minimum is free
(Q8_0 does not, unless a file's every block happened to have that form).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from spyre_serve.device.kernels.formats import FORMAT_NAMES
from spyre_serve.device.kernels.simd import QB
from spyre_serve.device.layout import K_QUANTS, QUANTIZED, QuantizedWeight, format_code, sub_block
from spyre_serve.models.config import GraniteConfig
from spyre_serve.models.gguf.checkpoint import gguf_name
from spyre_serve.models.gguf.file import QUANTIZED_TYPES, GGUFFile

_Q = GGMLQuantizationType


def block_of(ggml_type) -> QuantizedWeight:
    """One block of 32 values of a quantized type in the card's format the loader gives it,
    its scales of the type's form: d 1 (a float16 value); a minimum where the type has one,
    -16 d for Q5_0 (as the loader writes it), 0.5 for the others."""
    fmt = QUANTIZED_TYPES[ggml_type]
    n = QB // sub_block(fmt)
    scale = np.float32 if fmt in K_QUANTS else np.float16
    d = np.ones((1, n), scale)
    q = np.zeros((1, QB), np.int8)
    if ggml_type in (_Q.Q8_0, _Q.Q4_0, _Q.Q6_K):
        return QuantizedWeight(fmt, q, d)
    m = d * scale(-16) if ggml_type == _Q.Q5_0 else np.full((1, n), 0.5, scale)
    return QuantizedWeight(fmt, q, d, m)


def placed_format(ggml_types: list, dtype: str) -> str:
    """The card's format name of a GEMM weight fused from parts of these GGML types: their
    common quantized format where one holds them all exactly, else ``dtype`` (a float type
    among them, or quantized ones no format holds together, as Q8_0 beside Q6_K)."""
    if not all(t in QUANTIZED_TYPES for t in ggml_types):
        return dtype
    common = QuantizedWeight.in_one_format([block_of(t) for t in ggml_types])
    return dtype if common is None else FORMAT_NAMES[common[0].fmt]


# the step's GEMM weights of a dense layer (models/step/weights.py's place_weights): parts in order
LAYER_GEMMS = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",),
               "gate_up": ("ffn_gate", "ffn_up"), "down": ("ffn_down",)}


def gemm_formats(f: GGUFFile, config: GraniteConfig, dtype: str) -> dict[str, str | list[str]] | None:
    """Each GEMM weight's format on the card: "embed" and "lm_head" (the embedding's when
    tied) a name each, "qkv", "o", "gate_up", "down" a name per layer; None when the file
    holds no quantized matrix (all of them in ``dtype``, the float width: ``--dtype``, or the
    file's own)."""
    if not any(t.ggml_type in QUANTIZED_TYPES for t in f.tensors.values()):
        return None
    if config.mamba_layers or config.num_experts or not config.dense_mlp:
        raise ValueError(f"a quantized {f.architecture} file (Mamba-2 layers or experts): its matrices' formats "
                         "on the card are not sized yet")

    def fmt(*names: str) -> str:
        return placed_format([f.tensors[n].ggml_type for n in names], dtype)

    out: dict[str, str | list[str]] = {"embed": fmt(gguf_name("model.embed_tokens.weight"))}
    out["lm_head"] = out["embed"] if config.tie_word_embeddings else fmt(gguf_name("lm_head.weight"))
    for matrix, parts in LAYER_GEMMS.items():
        out[matrix] = [fmt(*(f"blk.{i}.{p}.weight" for p in parts)) for i in range(config.num_hidden_layers)]
    return out


def any_quantized(formats: dict[str, str | list[str]]) -> bool:
    """Whether any of a file's GEMM weights (gemm_formats) stays quantized on the card: GGUF's
    types are all integer quants, so the server's GEMM inputs are then int8 ("auto")."""
    names = (n for f in formats.values() for n in ([f] if isinstance(f, str) else f))
    return any(format_code(n) in QUANTIZED for n in names)
