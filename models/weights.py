"""A checkpoint's tensors placed on the card once, in the layout the kernels want.

Hugging Face stores linears as [out, in]; `gemm(out, a, b)` wants b as [K, N] = [in, out],
so every projection is transposed once here, and the projections that read the same input
are fused: Q, K and V into one [H, (Hq + 2 Hkv) D] matrix, gate and up into one [H, 2I].
The tied LM head is the embedding itself ([V, H], read through `gemm_bt`); an untied one is
stored transposed, [H, V], like the other projections.

`layer_table` is an int64 device array [L, LAYER_FIELDS] of byte addresses, one row per
layer (see the column constants below): the step program reads a layer's weights and
KV cache through it, so a whole model is one address slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from device import Card, DeviceTensor
from models.config import GraniteConfig

# Columns of the per-layer address table.
COL_IN_NORM, COL_QKV, COL_O, COL_POST_NORM, COL_GATE_UP, COL_DOWN, COL_K_CACHE, COL_V_CACHE = range(8)
LAYER_FIELDS = 8


@dataclass(slots=True)
class LayerWeights:
    in_norm: DeviceTensor      # [H]
    qkv: DeviceTensor          # [H, (Hq + 2 Hkv) D]  columns: q heads, k heads, v heads
    o: DeviceTensor            # [Hq D, H]
    post_norm: DeviceTensor    # [H]
    gate_up: DeviceTensor      # [H, 2I]  columns: gate, up
    down: DeviceTensor         # [I, H]


@dataclass(slots=True)
class ModelWeights:
    config: GraniteConfig
    embed: DeviceTensor        # [V, H]
    layers: list[LayerWeights]
    norm: DeviceTensor         # [H]
    lm_head: DeviceTensor      # tied: the embedding [V, H]; untied: [H, V]
    tied: bool
    inv_freq: DeviceTensor     # [D/2] RoPE inverse frequencies, float32 as transformers computes them
    consts: DeviceTensor       # float32[8]: eps, embedding x, attention scale, residual x, 1/logits_scaling
    nbytes: int                # bytes of parameters on the card (what one decode step reads, about)

    def tensors(self) -> list[DeviceTensor]:
        out = [self.embed, self.norm, self.inv_freq, self.consts]
        if not self.tied:
            out.append(self.lm_head)
        for lw in self.layers:
            out += [lw.in_norm, lw.qkv, lw.o, lw.post_norm, lw.gate_up, lw.down]
        return out

    def free(self, card: Card) -> None:
        for t in self.tensors():
            card.free(t)


# Indexes into ModelWeights.consts.
CONST_EPS, CONST_EMB_MULT, CONST_ATTN_SCALE, CONST_RES_MULT, CONST_INV_LOGIT_SCALE = range(5)


def rope_inv_freq(config: GraniteConfig) -> np.ndarray:
    """inv_freq[D/2] = 1 / theta^(2i/D), in float32 as transformers' default RoPE computes it."""
    d = config.head_dim
    exps = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)   # [D/2]
    return (1.0 / (np.float32(config.rope_theta) ** exps)).astype(np.float32)


def _put(card: Card, host: np.ndarray) -> DeviceTensor:
    t = card.empty(host.shape, np.float32)
    t.numpy()[...] = host
    return t


def place_weights(card: Card, config: GraniteConfig, tensors: dict[str, np.ndarray]) -> ModelWeights:
    """Copy HF-named float32 tensors (shapes checked by models.checkpoint) onto `card`."""
    c = config
    H, I, QD, KD = c.hidden_size, c.intermediate_size, c.q_size, c.kv_size  # noqa: E741
    placed: list[DeviceTensor] = []

    def put(host):
        t = _put(card, np.asarray(host, dtype=np.float32))
        placed.append(t)
        return t

    try:
        embed = put(tensors["model.embed_tokens.weight"])                         # [V, H]
        layers = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            qkv = card.empty((H, QD + 2 * KD), np.float32)                         # [H, QD+2KD]
            placed.append(qkv)
            q = qkv.numpy()
            q[:, :QD] = tensors[p + "self_attn.q_proj.weight"].T
            q[:, QD:QD + KD] = tensors[p + "self_attn.k_proj.weight"].T
            q[:, QD + KD:] = tensors[p + "self_attn.v_proj.weight"].T
            gate_up = card.empty((H, 2 * I), np.float32)                          # [H, 2I]
            placed.append(gate_up)
            g = gate_up.numpy()
            g[:, :I] = tensors[p + "mlp.gate_proj.weight"].T
            g[:, I:] = tensors[p + "mlp.up_proj.weight"].T
            layers.append(LayerWeights(
                in_norm=put(tensors[p + "input_layernorm.weight"]),
                qkv=qkv,
                o=put(tensors[p + "self_attn.o_proj.weight"].T),                   # [QD, H]
                post_norm=put(tensors[p + "post_attention_layernorm.weight"]),
                gate_up=gate_up,
                down=put(tensors[p + "mlp.down_proj.weight"].T),                   # [I, H]
            ))
        norm = put(tensors["model.norm.weight"])
        tied = c.tie_word_embeddings
        lm_head = embed if tied else put(tensors["lm_head.weight"].T)             # [H, V]
        inv_freq = put(rope_inv_freq(c))
        consts = np.zeros(8, np.float32)
        consts[CONST_EPS] = c.rms_norm_eps
        consts[CONST_EMB_MULT] = c.embedding_multiplier
        consts[CONST_ATTN_SCALE] = c.attention_multiplier
        consts[CONST_RES_MULT] = c.residual_multiplier
        consts[CONST_INV_LOGIT_SCALE] = 1.0 / c.logits_scaling
        consts_t = put(consts)
    except BaseException:
        for t in placed:
            card.free(t)
        raise
    nbytes = sum(t.nbytes for t in placed) - inv_freq.nbytes - consts_t.nbytes
    return ModelWeights(config=c, embed=embed, layers=layers, norm=norm, lm_head=lm_head,
                        tied=tied, inv_freq=inv_freq, consts=consts_t, nbytes=nbytes)


def build_layer_table(card: Card, weights: ModelWeights, k_caches: list[DeviceTensor],
                      v_caches: list[DeviceTensor]) -> DeviceTensor:
    """int64[L, LAYER_FIELDS] of byte addresses: each layer's weights and its KV cache."""
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
    t = card.empty(host.shape, np.int64)
    t.numpy()[...] = host
    return t
