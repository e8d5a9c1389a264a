"""A checkpoint's tensors placed on the card once, in the layout and width the kernels read.

Every projection is a GEMM weight W[K, N] (out = a @ W) handed to the card's layout
(device/layout.py: panels of 16 columns, float32 or 16-bit), which places it once; nothing
is repacked at run time. Hugging Face stores linears as [out, in], so each is transposed
here, and the projections that read the same input are fused: Q, K and V into one
W[H, (Hq + 2 Hkv) D], gate and up into one W[H, 2I].

The embedding is stored once, as the K x N weight of the LM head, E.T [H, V]: the step's
lookup gathers its columns, and a tied model's LM head is that same weight. An untied LM head
is its own [H, V] weight (lm_head.weight.T); the embedding then stays E.T for the lookup.

`dtype` is the width of every float weight on the card: "float32", "bfloat16", "float16" or
"dlfloat16" (the card's own 16-bit format: device/numerics.py). bfloat16 and float16 round
each value to nearest even (a checkpoint stored in that width is placed bit for bit),
dlfloat16 as IBM's conversion rounds; the norms and constants stay float32 arrays holding the rounded values, so the
model on the card is exactly the checkpoint rounded to `dtype`. A block-quantized matrix (a
device.layout.QuantizedWeight: a GGUF file's Q8_0, Q4_0 or Q4_1) is placed at its own width;
a fused projection whose parts differ in format is dequantized and placed in `dtype`, with a
log line saying so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from spyre_serve.device import Card, DeviceTensor
from spyre_serve.device.kernels.formats import has_integer_quants
from spyre_serve.device.kernels.gemm.inputs import ACT_INT8
from spyre_serve.device.layout import (
    GemmWeight,
    QuantizedWeight,
    decode,
    encode,
    format_code,
    place_gemm_weight,
    place_quantized_weight,
)
from spyre_serve.models.config import GraniteConfig
from spyre_serve.models.step.program import (
    COL_DOWN,
    COL_DOWN_FMT,
    COL_GATE_UP,
    COL_GATE_UP_FMT,
    COL_IN_NORM,
    COL_K_CACHE,
    COL_LORA,
    COL_O,
    COL_O_FMT,
    COL_POST_NORM,
    COL_QKV,
    COL_QKV_FMT,
    COL_V_CACHE,
    CONST_ATTN_SCALE,
    CONST_EMB_MULT,
    CONST_EPS,
    CONST_INV_LOGIT_SCALE,
    CONST_RES_MULT,
    LAYER_FIELDS,
    N_CONSTS,
)

DTYPES = ("float32", "bfloat16", "float16", "dlfloat16")
log = logging.getLogger(__name__)


@dataclass(slots=True)
class LayerWeights:
    in_norm: DeviceTensor      # float32 [H]
    qkv: GemmWeight            # [H, (Hq + 2 Hkv) D]  columns: q heads, k heads, v heads
    o: GemmWeight              # [Hq D, H]
    post_norm: DeviceTensor    # float32 [H]
    gate_up: GemmWeight        # [H, 2I]  columns: gate, up
    down: GemmWeight           # [I, H]


@dataclass(slots=True)
class ModelWeights:
    config: GraniteConfig
    dtype: str                 # width of the weights on the card: one of DTYPES
    embed: GemmWeight          # E.T [H, V]: the lookup reads its columns
    layers: list[LayerWeights]
    norm: DeviceTensor         # float32 [H]
    lm_head: GemmWeight        # [H, V]; tied: `embed` itself
    tied: bool
    inv_freq: DeviceTensor     # [D/2] RoPE inverse frequencies, float32 as transformers computes them
    consts: DeviceTensor       # float32[N_CONSTS]: eps, embedding x, attention scale, residual x, 1/logits_scaling
    nbytes: int                # bytes of parameters on the card (what one decode step reads, about)

    def gemm_weights(self) -> list[GemmWeight]:
        """Every GEMM weight, once (a tied LM head is the embedding)."""
        out = [self.embed] + ([] if self.tied else [self.lm_head])
        for lw in self.layers:
            out += [lw.qkv, lw.o, lw.gate_up, lw.down]
        return out

    @property
    def formats(self) -> dict[str, int]:
        """Bytes on the card of the GEMM weights, by format ("Q4_1", "float32", ...)."""
        out: dict[str, int] = {}
        for gw in self.gemm_weights():
            out[gw.format_name] = out.get(gw.format_name, 0) + gw.nbytes
        return out

    def tensors(self) -> list[DeviceTensor]:
        out = [self.embed.tensor, self.norm, self.inv_freq, self.consts]
        if not self.tied:
            out.append(self.lm_head.tensor)
        for lw in self.layers:
            out += [lw.in_norm, lw.qkv.tensor, lw.o.tensor, lw.post_norm, lw.gate_up.tensor,
                    lw.down.tensor]
        return out

    def free(self, card: Card) -> None:
        for t in self.tensors():
            card.free(t)


def rope_inv_freq(config: GraniteConfig) -> np.ndarray:
    """inv_freq[D/2] = 1 / theta^(2i/D), in float32 as transformers' default RoPE computes it."""
    d = config.head_dim
    exps = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)   # [D/2]
    return (1.0 / (np.float32(config.rope_theta) ** exps)).astype(np.float32)


def model_constants(config: GraniteConfig) -> np.ndarray:
    """float32[N_CONSTS] the step reads: eps and Granite's four multipliers."""
    consts = np.zeros(N_CONSTS, np.float32)
    consts[CONST_EPS] = config.rms_norm_eps
    consts[CONST_EMB_MULT] = config.embedding_multiplier
    consts[CONST_ATTN_SCALE] = config.attention_multiplier
    consts[CONST_RES_MULT] = config.residual_multiplier
    consts[CONST_INV_LOGIT_SCALE] = 1.0 / config.logits_scaling
    return consts


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ValueError(f"weight dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return dtype


COMPUTE_DTYPES = ("float32", "bfloat16", "float16", "dlfloat16", "int8")
SIXTEEN_BIT = ("bfloat16", "float16", "dlfloat16")


def resolve_compute_dtype(compute_dtype: str, weights: ModelWeights) -> str:
    """The format of GEMM inputs. "auto": int8 when the model has integer-quantized weights
    (their GEMMs then take activations quantized per block of 32, as llama.cpp does), else the
    float weights' width (16-bit weights compute in 16 bits, as vLLM's --dtype does).
    "float32" keeps activations exact (16-bit weights only widened, quantized ones computed
    on their dequantized values); a 16-bit format needs float weights of that width; "int8"
    needs quantized weights (the float GEMMs beside them keep float32 inputs)."""
    quantized = any(has_integer_quants(gw.fmt) for gw in weights.gemm_weights())
    if compute_dtype == "auto":
        return "int8" if quantized else weights.dtype
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute dtype must be one of auto, {', '.join(COMPUTE_DTYPES)}, "
                         f"got {compute_dtype!r}")
    if compute_dtype == "int8" and not quantized:
        raise ValueError("compute dtype int8 quantizes the inputs of integer 8- and 4-bit "
                         "weights; this model has none (a GGUF file's Q8_0/Q4_0/Q4_1, or "
                         "--quantization int8; fp8 weights take float inputs)")
    if compute_dtype in SIXTEEN_BIT and compute_dtype != weights.dtype:
        raise ValueError(f"compute dtype {compute_dtype} needs weights in {compute_dtype}; "
                         f"the weights are {weights.dtype}")
    return compute_dtype


def compute_code(compute_dtype: str) -> int:
    """The step's CFMT code of a resolved compute dtype (device.kernels.gemm.packed)."""
    return ACT_INT8 if compute_dtype == "int8" else format_code(compute_dtype)


class _Placer:
    """Places tensors on the card, remembering them so a failure frees every one."""

    def __init__(self, card: Card, dtype: str):
        self.card, self.dtype, self.fmt = card, dtype, format_code(dtype)
        self.placed: list[DeviceTensor] = []

    def vector(self, host: np.ndarray, rounded: bool = True) -> DeviceTensor:
        """A float32 array; `rounded`: its values rounded to the weights' width first."""
        host = np.asarray(host, np.float32)
        if rounded:
            host = decode(encode(host, self.fmt), self.fmt)
        t = self.card.empty(host.shape, np.float32)
        t.numpy()[...] = host
        self.placed.append(t)
        return t

    def gemm(self, name: str, *rows: np.ndarray | QuantizedWeight) -> GemmWeight:
        """The GEMM weight W[K, N] of Hugging Face linears [n_i, K] (out, in), their outputs
        side by side (a fused projection): at the parts' block-quantized width if they share
        one, else in the float width."""
        fmts = {r.fmt for r in rows if isinstance(r, QuantizedWeight)}
        if len(fmts) == 1 and all(isinstance(r, QuantizedWeight) for r in rows):
            gw = place_quantized_weight(self.card, QuantizedWeight.stack(list(rows)))
        else:
            if fmts:
                log.info("%s: parts of formats %s are dequantized and placed in %s", name,
                         ", ".join(sorted({_format_of(r) for r in rows})), self.dtype)
            rows = [r.dequantize() if isinstance(r, QuantizedWeight) else r for r in rows]
            w = rows[0].T if len(rows) == 1 else np.concatenate([r.T for r in rows], axis=1)
            gw = place_gemm_weight(self.card, w, self.dtype)
        self.placed.append(gw.tensor)
        return gw

    def free(self) -> None:
        for t in self.placed:
            self.card.free(t)


def _format_of(t: np.ndarray | QuantizedWeight) -> str:
    return t.name if isinstance(t, QuantizedWeight) else "float"


def place_weights(card: Card, config: GraniteConfig,
                  tensors: dict[str, np.ndarray | QuantizedWeight],
                  dtype: str = "float32") -> ModelWeights:
    """Place HF-named tensors (shapes checked by models.checkpoints.hf; float32 arrays, or
    block-quantized matrices) on `card`, the float ones in width `dtype`."""
    c = config
    put = _Placer(card, check_dtype(dtype))

    def gemm(*names: str) -> GemmWeight:
        return put.gemm(names[0], *(tensors[n] for n in names))

    try:
        embed = gemm("model.embed_tokens.weight")                                 # [H, V]
        layers = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            layers.append(LayerWeights(
                in_norm=put.vector(tensors[p + "input_layernorm.weight"]),
                qkv=gemm(p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                         p + "self_attn.v_proj.weight"),                          # [H, QD+2KD]
                o=gemm(p + "self_attn.o_proj.weight"),                            # [QD, H]
                post_norm=put.vector(tensors[p + "post_attention_layernorm.weight"]),
                gate_up=gemm(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),  # [H, 2I]
                down=gemm(p + "mlp.down_proj.weight"),                            # [I, H]
            ))
        norm = put.vector(tensors["model.norm.weight"])
        tied = c.tie_word_embeddings
        lm_head = embed if tied else gemm("lm_head.weight")                      # [H, V]
        inv_freq = put.vector(rope_inv_freq(c), rounded=False)
        consts = put.vector(model_constants(c), rounded=False)
    except BaseException:
        put.free()
        raise
    nbytes = sum(t.nbytes for t in put.placed) - inv_freq.nbytes - consts.nbytes
    return ModelWeights(config=c, dtype=dtype, embed=embed, layers=layers, norm=norm,
                        lm_head=lm_head, tied=tied, inv_freq=inv_freq, consts=consts, nbytes=nbytes)


def build_layer_table(card: Card, weights: ModelWeights, k_caches: list[DeviceTensor],
                      v_caches: list[DeviceTensor],
                      lora: list[tuple[int, int, int]] | None = None) -> DeviceTensor:
    """int64[L, LAYER_FIELDS]: each layer's weights and KV cache by byte address, and each
    projection's format (columns COL_* of models/step/program.py, which reads it); `lora`:
    each layer's adapter block (address, rank, slots: models/lora/arena.py), else zeros."""
    L = len(weights.layers)
    if len(k_caches) != L or len(v_caches) != L:
        raise ValueError(f"KV cache has {len(k_caches)}/{len(v_caches)} layers, model has {L}")
    host = np.zeros((L, LAYER_FIELDS), np.int64)
    for i, lw in enumerate(weights.layers):
        host[i, COL_IN_NORM] = lw.in_norm.address
        host[i, COL_QKV] = lw.qkv.address
        host[i, COL_O] = lw.o.address
        host[i, COL_POST_NORM] = lw.post_norm.address
        host[i, COL_GATE_UP] = lw.gate_up.address
        host[i, COL_DOWN] = lw.down.address
        host[i, COL_K_CACHE] = k_caches[i].address
        host[i, COL_V_CACHE] = v_caches[i].address
        host[i, COL_QKV_FMT] = lw.qkv.fmt
        host[i, COL_O_FMT] = lw.o.fmt
        host[i, COL_GATE_UP_FMT] = lw.gate_up.fmt
        host[i, COL_DOWN_FMT] = lw.down.fmt
        if lora is not None:
            host[i, COL_LORA:COL_LORA + 3] = lora[i]
    t = card.empty(host.shape, np.int64)
    t.numpy()[...] = host
    return t
