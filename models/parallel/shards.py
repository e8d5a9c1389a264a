"""One card's share of a checkpoint under tensor parallelism, as vLLM's linear layers split it.

Card ``rank`` of ``tp`` holds query heads [rank * Hq/tp, (rank + 1) * Hq/tp) of q_proj's rows
and o_proj's columns (column- and row-parallel), their KV heads of k_proj and v_proj (split
when there are at least tp of them; else the one their queries read, replicated), its share
of gate_proj's and up_proj's rows and of down_proj's columns, and the LM head's rows of its
vocabulary shard [rank * ceil(V/tp), ...) (a tied head is cut from the embedding). The
embedding itself and the norms are whole on every card: each card embeds every token, and the
sums of the row-parallel halves (o_proj, down_proj) happen between the step's parts
(models/parallel/runner.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from spyre_serve.models.config import GraniteConfig
from spyre_serve.models.sizing.fit import card_config


def vocab_shard(vocab: int, rank: int, tp: int) -> tuple[int, int]:
    """[first, end) of card ``rank``'s vocabulary rows (the last may be shorter)."""
    size = -(-vocab // tp)
    return rank * size, min(vocab, (rank + 1) * size)


def shard_tensors(config: GraniteConfig, tensors: dict, rank: int, tp: int) -> tuple[GraniteConfig, dict]:
    """Card ``rank``'s config (its heads and MLP width: ``models.sizing.fit.card_config``, an untied LM
    head of its vocabulary shard) and HF-named float tensors; ValueError for block-quantized
    matrices (their blocks run along the dimension row-parallel layers cut)."""
    if any(not isinstance(t, np.ndarray) for t in tensors.values()):
        raise ValueError("tensor parallelism takes float checkpoints: quantized matrices (GGUF's, "
                         "--quantization) are kept in blocks a shard would cut")
    c = config
    cc = card_config(c, tp)
    d = c.head_dim
    hq, hkv, inter = cc.num_attention_heads, cc.num_key_value_heads, cc.intermediate_size
    q0 = rank * hq
    kv0 = rank * hkv if c.num_key_value_heads >= tp else q0 // (c.num_attention_heads // c.num_key_value_heads)
    i0 = rank * inter
    v0, v1 = vocab_shard(c.vocab_size, rank, tp)
    out = {"model.embed_tokens.weight": tensors["model.embed_tokens.weight"],
           "model.norm.weight": tensors["model.norm.weight"]}
    head = tensors["model.embed_tokens.weight"] if c.tie_word_embeddings else tensors["lm_head.weight"]
    out["lm_head.weight"] = np.ascontiguousarray(head[v0:v1])
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        out[p + "input_layernorm.weight"] = tensors[p + "input_layernorm.weight"]
        out[p + "post_attention_layernorm.weight"] = tensors[p + "post_attention_layernorm.weight"]
        out[a + "q_proj.weight"] = tensors[a + "q_proj.weight"][q0 * d:(q0 + hq) * d]
        out[a + "k_proj.weight"] = tensors[a + "k_proj.weight"][kv0 * d:(kv0 + hkv) * d]
        out[a + "v_proj.weight"] = tensors[a + "v_proj.weight"][kv0 * d:(kv0 + hkv) * d]
        out[a + "o_proj.weight"] = np.ascontiguousarray(tensors[a + "o_proj.weight"][:, q0 * d:(q0 + hq) * d])
        out[m + "gate_proj.weight"] = tensors[m + "gate_proj.weight"][i0:i0 + inter]
        out[m + "up_proj.weight"] = tensors[m + "up_proj.weight"][i0:i0 + inter]
        out[m + "down_proj.weight"] = np.ascontiguousarray(tensors[m + "down_proj.weight"][:, i0:i0 + inter])
    return dataclasses.replace(cc, tie_word_embeddings=False), out
