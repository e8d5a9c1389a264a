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
device.layout.QuantizedWeight: a GGUF file's quantized matrix) is placed at its own width;
a fused projection whose parts differ in format at a width that holds them all exactly
(QuantizedWeight.in_one_format: a Q4_K_M file's Q5_0 q and k beside a Q8_0 v as Q8_0, Q4_K
beside Q6_K as Q6_K_MIN), or, where none does (Q8_0 beside Q6_K), dequantized and placed in
`dtype`; a log line says which.
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
    COL_DENSE,
    COL_DOWN,
    COL_DOWN_FMT,
    COL_GATE_UP,
    COL_GATE_UP_FMT,
    COL_IN_NORM,
    COL_K_CACHE,
    COL_KIND,
    COL_LORA,
    COL_M_A,
    COL_M_CONV_B,
    COL_M_CONV_STATE,
    COL_M_CONV_W,
    COL_M_D,
    COL_M_DT_BIAS,
    COL_M_IN,
    COL_M_IN_FMT,
    COL_M_NORM,
    COL_M_OUT,
    COL_M_OUT_FMT,
    COL_M_SSM_STATE,
    COL_MOE_DOWN_FMT,
    COL_MOE_EXPERTS,
    COL_MOE_GU_FMT,
    COL_MOE_ROUTER,
    COL_MOE_ROUTER_FMT,
    COL_O,
    COL_O_FMT,
    COL_POST_NORM,
    COL_QKV,
    COL_QKV_FMT,
    COL_V_CACHE,
    CONST_ATTN_SCALE,
    CONST_DT_MAX,
    CONST_DT_MIN,
    CONST_EMB_MULT,
    CONST_EPS,
    CONST_INV_LOGIT_SCALE,
    CONST_RES_MULT,
    KIND_MAMBA,
    LAYER_FIELDS,
    N_CONSTS,
)

DTYPES = ("float32", "bfloat16", "float16", "dlfloat16")
log = logging.getLogger(__name__)


@dataclass(slots=True)
class MambaWeights:
    """A Mamba-2 mixer's (Granite 4.0's hybrid layers): see device/kernels/mamba.py."""

    in_proj: GemmWeight        # [H, DI + C + NH]  columns: gate z, x B C, dt
    conv_w: DeviceTensor       # float32 [C, K]
    conv_b: DeviceTensor       # float32 [C] (zeros without a conv bias)
    dt_bias: DeviceTensor      # float32 [NH]
    a: DeviceTensor            # float32 [NH]: -exp(A_log)
    d: DeviceTensor            # float32 [NH]
    norm: DeviceTensor         # float32 [DI]: the gated RMSNorm's weight
    out_proj: GemmWeight       # [DI, H]

    def gemms(self) -> list[GemmWeight]:
        return [self.in_proj, self.out_proj]

    def tensors(self) -> list[DeviceTensor]:
        return [self.in_proj.tensor, self.conv_w, self.conv_b, self.dt_bias, self.a, self.d, self.norm,
                self.out_proj.tensor]


@dataclass(slots=True)
class ExpertWeights:
    """A layer's mixture of experts: the router and each expert's SwiGLU MLP."""

    router: GemmWeight                 # [H, E]
    gate_up: list[GemmWeight]          # per expert [H, 2 IE]  columns: gate, up
    down: list[GemmWeight]             # per expert [IE, H]
    table: DeviceTensor                # int64[E, 2]: each expert's gate_up and down addresses

    def gemms(self) -> list[GemmWeight]:
        return [self.router, *self.gate_up, *self.down]


@dataclass(slots=True)
class LayerWeights:
    in_norm: DeviceTensor      # float32 [H]
    qkv: GemmWeight | None     # [H, (Hq + 2 Hkv) D]  columns: q heads, k heads, v heads (None: a Mamba layer)
    o: GemmWeight | None       # [Hq D, H]
    post_norm: DeviceTensor    # float32 [H]
    gate_up: GemmWeight | None  # [H, 2I]  columns: gate, up (None: experts only)
    down: GemmWeight | None     # [I, H]
    mamba: MambaWeights | None = None
    experts: ExpertWeights | None = None

    def gemms(self) -> list[GemmWeight]:
        out = [g for g in (self.qkv, self.o, self.gate_up, self.down) if g is not None]
        out += self.mamba.gemms() if self.mamba else []
        return out + (self.experts.gemms() if self.experts else [])

    def tensors(self) -> list[DeviceTensor]:
        out = [self.in_norm, self.post_norm, *(g.tensor for g in self.gemms())]
        out += [t for t in self.mamba.tensors() if t not in (self.mamba.in_proj.tensor, self.mamba.out_proj.tensor)
                ] if self.mamba else []
        return out + ([self.experts.table] if self.experts else [])


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
            out += lw.gemms()
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
            out += lw.tensors()
        return out

    def free(self, card: Card) -> None:
        for t in self.tensors():
            card.free(t)


def rope_inv_freq(config: GraniteConfig) -> np.ndarray:
    """inv_freq[D/2] = 1 / theta^(2i/D), in float32 as transformers' default RoPE computes it;
    zeros for attention without position embedding (a hybrid's "nope": every angle 0, so the
    step's rotation is the identity)."""
    d = config.head_dim
    if not config.rope:
        return np.zeros(d // 2, np.float32)
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
    if config.mamba is not None:
        consts[CONST_DT_MIN], consts[CONST_DT_MAX] = config.mamba.dt_min, config.mamba.dt_max
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
                         "weights; this model has none (a GGUF file's quantized matrices, or "
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
            host = self.round(host)
        t = self.card.empty(host.shape, np.float32)
        t.numpy()[...] = host
        self.placed.append(t)
        return t

    def round(self, host: np.ndarray) -> np.ndarray:
        """float32 values rounded to the weights' width (as the card holds them)."""
        return decode(encode(np.asarray(host, np.float32), self.fmt), self.fmt)

    def gemm(self, name: str, *rows: np.ndarray | QuantizedWeight) -> GemmWeight:
        """The GEMM weight W[K, N] of Hugging Face linears [n_i, K] (out, in), their outputs
        side by side (a fused projection): at the parts' block-quantized width if they share
        one, else in the float width."""
        fmts = {r.fmt for r in rows if isinstance(r, QuantizedWeight)}
        common = QuantizedWeight.in_one_format(list(rows)) \
            if all(isinstance(r, QuantizedWeight) for r in rows) else None
        if common is not None:
            if len(fmts) > 1:
                log.info("%s: parts of formats %s are placed as %s (it holds their values exactly)", name,
                         ", ".join(sorted({_format_of(r) for r in rows})), common[0].name)
            gw = place_quantized_weight(self.card, QuantizedWeight.stack(common))
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
            attention = c.kind_of(i) == "attention"
            if c.mlp_names == "shared_mlp":
                gate_up, down = gemm(p + "shared_mlp.input_linear.weight"), gemm(p + "shared_mlp.output_linear.weight")
            elif not c.mlp_names:
                gate_up = down = None                                                 # experts only
            else:
                gate_up = gemm(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")   # [H, 2I]
                down = gemm(p + "mlp.down_proj.weight")                                # [I, H]
            layers.append(LayerWeights(
                in_norm=put.vector(tensors[p + "input_layernorm.weight"]),
                qkv=gemm(p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                         p + "self_attn.v_proj.weight") if attention else None,       # [H, QD+2KD]
                o=gemm(p + "self_attn.o_proj.weight") if attention else None,          # [QD, H]
                post_norm=put.vector(tensors[p + "post_attention_layernorm.weight"]),
                gate_up=gate_up, down=down,
                mamba=None if attention else _place_mamba(put, c, tensors, p + "mamba."),
                experts=_place_experts(put, c, tensors, p + "block_sparse_moe.") if c.num_experts else None,
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


def _place_mamba(put: _Placer, c: GraniteConfig, tensors, p: str) -> MambaWeights:
    """A Mamba-2 mixer's tensors (HF names under `p`) on the card; A as the scan reads it."""
    m = c.mamba
    conv_b = tensors[p + "conv1d.bias"] if m.conv_bias else np.zeros(m.conv_dim, np.float32)
    return MambaWeights(
        in_proj=put.gemm(p + "in_proj.weight", tensors[p + "in_proj.weight"]),
        conv_w=put.vector(np.asarray(tensors[p + "conv1d.weight"], np.float32).reshape(m.conv_dim, m.d_conv)),
        conv_b=put.vector(conv_b), dt_bias=put.vector(tensors[p + "dt_bias"]),
        # transformers: A = -exp(A_log.float()), from the stored (rounded) A_log
        a=put.vector(-np.exp(put.round(tensors[p + "A_log"])), rounded=False),
        d=put.vector(tensors[p + "D"]), norm=put.vector(tensors[p + "norm.weight"]),
        out_proj=put.gemm(p + "out_proj.weight", tensors[p + "out_proj.weight"]))


def _place_experts(put: _Placer, c: GraniteConfig, tensors, p: str) -> ExpertWeights:
    """A layer's router and experts (HF names under `p`: input_linear [E, 2 IE, H], gate rows
    first, output_linear [E, H, IE]), each expert a GEMM weight of its own."""
    gu, dn = tensors[p + "input_linear.weight"], tensors[p + "output_linear.weight"]
    def expert(stack, e: int):           # a float stack's slice, or an expert quantized at load
        return stack[e] if isinstance(stack, list) else np.asarray(stack[e])

    gate_up = [put.gemm(f"{p}input_linear.weight[{e}]", expert(gu, e)) for e in range(c.num_experts)]
    down = [put.gemm(f"{p}output_linear.weight[{e}]", expert(dn, e)) for e in range(c.num_experts)]
    host = np.array([[g.address, d.address] for g, d in zip(gate_up, down, strict=True)], np.int64)
    table = put.card.empty(host.shape, np.int64)
    table.numpy()[...] = host
    put.placed.append(table)
    return ExpertWeights(router=put.gemm(p + "router.layer.weight", tensors[p + "router.layer.weight"]),
                         gate_up=gate_up, down=down, table=table)


def build_layer_table(card: Card, weights: ModelWeights, k_caches: list[DeviceTensor],
                      v_caches: list[DeviceTensor],
                      lora: list[tuple[int, int, int]] | None = None,
                      states: list[tuple[DeviceTensor, DeviceTensor]] | None = None) -> DeviceTensor:
    """int64[L, LAYER_FIELDS]: each layer's weights and KV cache by byte address, and each
    projection's format (columns COL_* of models/step/program.py, which reads it); `lora`:
    each layer's adapter block (address, rank, slots: models/lora/arena.py), else zeros. A hybrid
    model's KV caches are its attention layers', in order, and `states` its Mamba layers' (conv,
    SSM) state arrays."""
    L = len(weights.layers)
    attention = weights.config.attention_layers
    mamba = weights.config.mamba_layers
    if len(k_caches) != len(attention) or len(v_caches) != len(attention):
        raise ValueError(f"KV cache has {len(k_caches)}/{len(v_caches)} layers, model has {len(attention)} "
                         f"attention layers of {L}")
    if mamba and (states is None or len(states) != len(mamba)):
        raise ValueError(f"the model has {len(mamba)} Mamba layers, the states {0 if states is None else len(states)}")
    kv_of = {layer: j for j, layer in enumerate(attention)}
    states_of = {layer: j for j, layer in enumerate(mamba)}
    host = np.zeros((L, LAYER_FIELDS), np.int64)
    for i, lw in enumerate(weights.layers):
        host[i, COL_IN_NORM] = lw.in_norm.address
        host[i, COL_POST_NORM] = lw.post_norm.address
        if lw.gate_up is not None:
            host[i, COL_GATE_UP] = lw.gate_up.address
            host[i, COL_DOWN] = lw.down.address
            host[i, COL_GATE_UP_FMT] = lw.gate_up.fmt
            host[i, COL_DOWN_FMT] = lw.down.fmt
            host[i, COL_DENSE] = 1
        if i in kv_of:
            host[i, COL_QKV] = lw.qkv.address
            host[i, COL_O] = lw.o.address
            host[i, COL_QKV_FMT] = lw.qkv.fmt
            host[i, COL_O_FMT] = lw.o.fmt
            host[i, COL_K_CACHE] = k_caches[kv_of[i]].address
            host[i, COL_V_CACHE] = v_caches[kv_of[i]].address
        else:
            m, (conv, ssm) = lw.mamba, states[states_of[i]]
            host[i, COL_KIND] = KIND_MAMBA
            host[i, [COL_M_IN, COL_M_IN_FMT, COL_M_OUT, COL_M_OUT_FMT]] = (m.in_proj.address, m.in_proj.fmt,
                                                                           m.out_proj.address, m.out_proj.fmt)
            host[i, [COL_M_CONV_W, COL_M_CONV_B, COL_M_DT_BIAS, COL_M_A, COL_M_D, COL_M_NORM]] = [
                v.address for v in (m.conv_w, m.conv_b, m.dt_bias, m.a, m.d, m.norm)]
            host[i, COL_M_CONV_STATE], host[i, COL_M_SSM_STATE] = conv.address, ssm.address
        if lw.experts is not None:
            ex = lw.experts
            host[i, [COL_MOE_ROUTER, COL_MOE_ROUTER_FMT, COL_MOE_EXPERTS]] = (ex.router.address, ex.router.fmt,
                                                                             ex.table.address)
            fmts = {g.fmt for g in ex.gate_up}, {d.fmt for d in ex.down}
            if len(fmts[0]) != 1 or len(fmts[1]) != 1:
                raise ValueError(f"layer {i}: the experts' weights are of several formats {fmts}")
            host[i, COL_MOE_GU_FMT], host[i, COL_MOE_DOWN_FMT] = fmts[0].pop(), fmts[1].pop()
        if lora is not None:
            host[i, COL_LORA:COL_LORA + 3] = lora[i]
    t = card.empty(host.shape, np.int64)
    t.numpy()[...] = host
    return t
