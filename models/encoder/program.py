"""One batched encoder step (RoBERTa / XLM-RoBERTa) as a single device program: every prompt of
the step embedded and pooled to one vector.

`encoder_entry(f32, i32, i64, u16, table)` has the device ABI, as models/step/program.py's
step_entry: `table` holds the slots listed in SLOTS (addresses and dimensions, patched at each
launch), every dimension comes from it, so one compiled entry serves every (tokens, sequences)
bucket, each a Program with its own table region.

A step (T token rows, S sequences; sequence s is rows query_start[s]..query_start[s+1]-1):
    x[T, H] = LayerNorm(word[tokens] + type[0] + pos[positions])
    per layer: qkv = x @ Wqkv + b, attention of each sequence's rows to all of its rows (no mask,
               scale 1/sqrt(D)), x = LayerNorm(x + attn @ Wo + b),
               x = LayerNorm(x + gelu(x @ Wup + b) @ Wdown + b)
    pooled[S, H] = each sequence's rows of x pooled (POOL: device.kernels.pooling.POOL_*),
                   unit length when POOL_NORM

Padding: a bucket's rows past the real tokens (query_start[S], as the host packs it) belong to
no sequence; the attention kernel excludes them (no sequence's row reads them) and sets their
output to zero, so they stay finite and never change a real row; a bucket's padding sequences
have no rows and pool to zeros.

Its buffers are declared once as tables of fields (models/step/buffer_layout.py): INPUTS (packed by
the host at each launch), OUTPUTS (read back) and WORKSPACE (activations, placed once for the
largest bucket). SLOTS gives every field an address slot and a length slot; the entry views a
field through step_program's `_i32` / `_f32`, which refuse a view longer than the field.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
from numba import njit

from spyre_serve.device.abi import f32_at, i64_at
from spyre_serve.device.kernels.encoder import (
    add_bias,
    bidirectional_attention,
    embed_rows,
    gelu,
    layernorm,
)
from spyre_serve.device.kernels.gemm.inputs import ACT_F32
from spyre_serve.device.kernels.gemm.packed import gemm_at
from spyre_serve.device.kernels.pooling import pool_rows
from spyre_serve.device.kernels.residual import residual_add
from spyre_serve.models.step.buffer_layout import Field, Layout, length_slot
from spyre_serve.models.step.program import _f32, _i32

# Columns of the per-layer table int64[L, LAYER_FIELDS] (models/encoder/weights.py builds it):
# byte addresses of each GEMM weight, its bias and the LayerNorms' weight and bias, then each
# GEMM weight's number format (device.kernels.formats.FMT_*).
(COL_QKV, COL_QKV_B, COL_O, COL_O_B, COL_LN1_W, COL_LN1_B, COL_UP, COL_UP_B, COL_DOWN, COL_DOWN_B,
 COL_LN2_W, COL_LN2_B) = range(12)
COL_QKV_FMT, COL_O_FMT, COL_UP_FMT, COL_DOWN_FMT = range(12, 16)
LAYER_FIELDS = 16
# Indexes into the model's float32 constants (models/encoder/weights.py places them).
CONST_EPS, CONST_ATTN_SCALE = range(2)
N_CONSTS = 2
F32, I32 = np.float32, np.int32

# Written by the host at each launch. Dims: T token rows, S sequences.
INPUTS = Layout("encoder_inputs", [
    Field("tokens", I32, ("T",)),               # padding rows: pad_token_id
    Field("positions", I32, ("T",)),            # pad_token_id + 1 + index in the sequence
    Field("query_start", I32, ("S+1",)),        # first token row of each sequence
])

# Read back after each launch.
OUTPUTS = Layout("encoder_outputs", [
    Field("pooled", F32, ("S", "H")),
])

# The step's activations, placed once for the largest token bucket (TMAX) and shared by every
# bucket: a bucket's views are prefixes.
WORKSPACE = Layout("encoder_workspace", [
    Field("x", F32, ("TMAX", "H")),             # hidden states (each block's LayerNorm in place)
    Field("y", F32, ("TMAX", "H")),             # o / down projection out
    Field("qkv", F32, ("TMAX", "3*H")),         # q heads, k heads, v heads
    Field("attn", F32, ("TMAX", "H")),
    Field("inter", F32, ("TMAX", "I")),         # the MLP's up projection, GELU in place
])

# (name, kind); the index in this list is the slot's index in the table.
SLOTS = [
    # step shapes, and the pooling: device.kernels.pooling.POOL_*, and 1 for unit length
    ("T", "dim"), ("S", "dim"), ("POOL", "dim"), ("POOL_NORM", "dim"),
    # model shapes: H, heads, head dim, MLP width, vocabulary, layers, position table rows
    ("H", "dim"), ("HQ", "dim"), ("D", "dim"), ("I", "dim"), ("V", "dim"), ("L", "dim"),
    ("NPOS", "dim"),
    # model: float32 tables word [V, H], position [NPOS, H], token type 0 [H], the embeddings'
    # LayerNorm weight and bias [H], constants [N_CONSTS], the layer table
    ("word_embed", "address"), ("pos_embed", "address"), ("type_embed", "address"),
    ("embed_norm_w", "address"), ("embed_norm_b", "address"), ("consts", "address"),
    ("layers", "address"),
    # the fields of the three buffers: address, then length (what `_bounded` reads)
    *[s for layout in (INPUTS, OUTPUTS, WORKSPACE) for f in layout.fields
      for s in ((f.name, "address"), (length_slot(f.name), "dim"))],
]
# Slot.<name> is a slot's index (a field's length: Slot.<name>_len, its address + 1).
Slot = IntEnum("Slot", {name.replace(".", "_"): i for i, (name, _) in enumerate(SLOTS)})


@njit(nogil=True, cache=True)
def _layer(f32, u16, lw, x, y, qkv, attn, inter, query_start, H, HQ, D, INTER, eps, scale):
    """One post-LayerNorm encoder block on x[T, H], in place; lw: its row of the layer table."""
    T = x.shape[0]
    gemm_at(qkv, x, f32, u16, lw[COL_QKV], H, 3 * H, lw[COL_QKV_FMT], ACT_F32)
    add_bias(qkv, f32_at(f32, lw[COL_QKV_B], 3 * H))
    q4 = qkv.reshape(T, 3, HQ, D)           # columns: q heads, k heads, v heads
    bidirectional_attention(attn.reshape(T, HQ, D), q4[:, 0], q4[:, 1], q4[:, 2], query_start,
                            scale)
    gemm_at(y, attn, f32, u16, lw[COL_O], H, H, lw[COL_O_FMT], ACT_F32)
    add_bias(y, f32_at(f32, lw[COL_O_B], H))
    residual_add(x, y, 1.0)
    layernorm(x, x, f32_at(f32, lw[COL_LN1_W], H), f32_at(f32, lw[COL_LN1_B], H), eps)
    gemm_at(inter, x, f32, u16, lw[COL_UP], H, INTER, lw[COL_UP_FMT], ACT_F32)
    add_bias(inter, f32_at(f32, lw[COL_UP_B], INTER))
    gelu(inter)
    gemm_at(y, inter, f32, u16, lw[COL_DOWN], INTER, H, lw[COL_DOWN_FMT], ACT_F32)
    add_bias(y, f32_at(f32, lw[COL_DOWN_B], H))
    residual_add(x, y, 1.0)
    layernorm(x, x, f32_at(f32, lw[COL_LN2_W], H), f32_at(f32, lw[COL_LN2_B], H), eps)


@njit(nogil=True, cache=True)
def encoder_entry(f32, i32, i64, u16, table):
    T, S, H, HQ, D = table[Slot.T], table[Slot.S], table[Slot.H], table[Slot.HQ], table[Slot.D]
    INTER, V, L, NPOS = table[Slot.I], table[Slot.V], table[Slot.L], table[Slot.NPOS]
    consts = f32_at(f32, table[Slot.consts], N_CONSTS)
    eps = consts[CONST_EPS]
    scale = consts[CONST_ATTN_SCALE]

    # ---- inputs (INPUTS)
    tokens = _i32(i32, table, Slot.tokens, T)
    positions = _i32(i32, table, Slot.positions, T)
    query_start = _i32(i32, table, Slot.query_start, S + 1)
    if query_start[S] > T:
        raise ValueError("encoder_entry: sequences end past the token rows (end, T)",
                         query_start[S], T)

    # ---- workspace (WORKSPACE, placed for the largest bucket: this bucket's views are prefixes)
    x = _f32(f32, table, Slot.x, T * H).reshape(T, H)
    y = _f32(f32, table, Slot.y, T * H).reshape(T, H)
    qkv = _f32(f32, table, Slot.qkv, T * 3 * H).reshape(T, 3 * H)
    attn = _f32(f32, table, Slot.attn, T * H).reshape(T, H)
    inter = _f32(f32, table, Slot.inter, T * INTER).reshape(T, INTER)

    # ---- the model
    word = f32_at(f32, table[Slot.word_embed], V * H).reshape(V, H)
    pos = f32_at(f32, table[Slot.pos_embed], NPOS * H).reshape(NPOS, H)
    embed_rows(x, word, pos, f32_at(f32, table[Slot.type_embed], H), tokens, positions)
    layernorm(x, x, f32_at(f32, table[Slot.embed_norm_w], H),
              f32_at(f32, table[Slot.embed_norm_b], H), eps)
    layers = i64_at(i64, table[Slot.layers], L * LAYER_FIELDS).reshape(L, LAYER_FIELDS)
    for layer in range(L):
        _layer(f32, u16, layers[layer], x, y, qkv, attn, inter, query_start, H, HQ, D, INTER,
               eps, scale)
    pool_rows(_f32(f32, table, Slot.pooled, S * H).reshape(S, H), x, query_start,
              table[Slot.POOL], table[Slot.POOL_NORM])
