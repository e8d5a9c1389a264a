"""One batched model step as a single device program.

`step_entry(f32, i32, i64, u16, table)` has the device ABI: `table` holds the slots
listed in SLOTS (addresses and dimensions, patched at each launch), and the entry turns
addresses into typed views of the arena. Every dimension comes from the table, so one
compiled entry serves every bucket; a bucket is a Program with its own table region and
its own fixed (T, S, R) shapes.

A step (T token rows, S sequences, R logit rows, NS of them sampling):
    tokens  <- from-device rows replaced by the previous launch's sampled ids
    x[T, H] = embed[tokens] * embedding_multiplier
    per layer: rmsnorm, qkv = h @ Wqkv, split, rope(q, k), write_kv, paged attention,
               x += res * (attn @ Wo), rmsnorm, gu = h @ Wgu, swiglu, x += res * (act @ Wdown)
    (Granite 4.0's hybrid: a Mamba-2 layer's mixer instead of attention, zxbcdt = h @ Win,
     conv and scan from each sequence's states, gated norm, @ Wout; beside the dense MLP, a
     mixture of experts: route, group rows by expert, the experts' MLPs, combine)
    hsel[R, H] = rmsnorm(x[logit_rows]);   logits[R, V] = hsel @ lm_head / logits_scaling
    (a pooling runner, POOL > 0, instead: pooled[S, H] = each sequence's rows of rmsnorm(x) pooled)
One launch may run a part of this (the H0, H1 slots, in halves of layers): a card of several
runs the step as parts between which the cards sum their halves' outputs (tensor parallel);
a runner of one card runs it whole.
    count each penalized sequence's tokens into its slot of the penalty tables (on the card)
    sample rows 0..NS-1 (logit bias, penalties, bans, grammar mask, temperature, top-k/p,
    min-p, seeded draw) with the
    sampled id, its raw logprob and the top-K raw logprobs; rows SR.. only when asked
    (R > SR: every token row, for prompt logprobs) get a log-softmax. A sequence with proposed
    tokens (speculative decoding) has a sampling row for each of its last num_draft + 1 rows.

Its three buffers are declared once, below, as tables of fields (models/step/buffer_layout.py):
INPUTS (packed by the host at every launch), OUTPUTS (read back; two, alternating, so a
launch reads the previous one's samples) and WORKSPACE (activations, placed once for the
largest bucket). SLOTS gives every field two slots, its address and its length; the host
places the fields from the tables and binds their addresses at launch, and the entry views a
field through `_i32` / `_f32` / `_sample_rows`, which refuse a view longer than the field. So the
order of fields in a buffer is host-side data: reordering a table needs no recompile.

Numba freezes the module-level values the entry reads (Slot, KMAX, the layer-table columns,
the sample-row record) into its compiled code; the compile cache is keyed by the sources of
device/ and models/ (device/cache.py), so changing any of them compiles afresh.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
from numba import njit

from spyre_serve.device.abi import f32_at, i32_at, i64_at
from spyre_serve.device.kernels.activation import swiglu
from spyre_serve.device.kernels.attention.paged import attention_at
from spyre_serve.device.kernels.gather import gather_columns_at, gather_rows
from spyre_serve.device.kernels.gemm.packed import gemm_at
from spyre_serve.device.kernels.mamba import gated_rmsnorm, mamba_conv, ssm_scan
from spyre_serve.device.kernels.moe import moe_experts_at, moe_order, moe_route
from spyre_serve.device.kernels.norm import rmsnorm
from spyre_serve.device.kernels.pooling import pool_rows
from spyre_serve.device.kernels.residual import residual_add
from spyre_serve.device.kernels.rope import rope_tables, split_rope
from spyre_serve.device.kernels.sampling import count_tokens, sample_rows
from spyre_serve.device.kernels.softmax import log_softmax
from spyre_serve.device.profile import lap
from spyre_serve.models.lora.layout import ON_DOWN, ON_GATE_UP, ON_O, ON_QKV, lora_layer
from spyre_serve.models.step.buffer_layout import Field, Layout, Record, RowField, length_slot
from spyre_serve.models.step.inputs import greedy_or
from spyre_serve.models.step.interface import KMAX  # noqa: F401  (the top-logprobs width: this module's interface)

# Columns of the per-layer table int64[L, LAYER_FIELDS] (models/step/weights.py builds it): byte
# addresses, then each projection's number format (device.kernels.formats.FMT_*).
COL_IN_NORM, COL_QKV, COL_O, COL_POST_NORM, COL_GATE_UP, COL_DOWN, COL_K_CACHE, COL_V_CACHE = range(8)
COL_QKV_FMT, COL_O_FMT, COL_GATE_UP_FMT, COL_DOWN_FMT = range(8, 12)
# the layer's LoRA adapters (models/lora/layout.py): block address (0: none), rank, slots
COL_LORA, COL_LORA_RANK, COL_LORA_SLOTS = range(12, 15)
# the hybrid's: the layer's mixer (KIND_*); a Mamba-2 mixer's weights (in_proj and out_proj with
# their formats; the conv's weight [C, K] and bias [C]; dt_bias, A = -exp(A_log), D [NH]; the
# gated norm [DI]) and its states (conv [NSS, K - 1, C], SSM [NSS, NH, P, N]); the experts'
# router [H, E] and its format, their table int64[E, 2] (each expert's gate_up and down
# addresses), their two formats; whether the layer has the dense MLP
(COL_KIND, COL_M_IN, COL_M_IN_FMT, COL_M_CONV_W, COL_M_CONV_B, COL_M_DT_BIAS, COL_M_A, COL_M_D, COL_M_NORM,
 COL_M_OUT, COL_M_OUT_FMT, COL_M_CONV_STATE, COL_M_SSM_STATE, COL_MOE_ROUTER, COL_MOE_ROUTER_FMT,
 COL_MOE_EXPERTS, COL_MOE_GU_FMT, COL_MOE_DOWN_FMT, COL_DENSE) = range(15, 34)
LAYER_FIELDS = 34
KIND_ATTENTION, KIND_MAMBA = 0, 1
# Indexes into the model's float32 constants (models/step/weights.py places them).
CONST_EPS, CONST_EMB_MULT, CONST_ATTN_SCALE, CONST_RES_MULT, CONST_INV_LOGIT_SCALE = range(5)
CONST_DT_MIN, CONST_DT_MAX = 5, 6          # the Mamba-2 mixers' dt limits
N_CONSTS = 8
# Kernel timers (`timers` field; device/profile.py): where a step's device time goes.
TIMERS = ("embedding", "rmsnorm", "qkv", "rope", "write_kv", "attention", "o_proj", "residual",
          "gate_up", "swiglu", "down", "lm_head", "log_softmax", "sampling", "lora",
          "mamba_in", "mamba_conv", "ssm_scan", "mamba_out", "moe")
(K_EMBEDDING, K_RMSNORM, K_QKV, K_ROPE, K_WRITE_KV, K_ATTENTION, K_O_PROJ, K_RESIDUAL, K_GATE_UP,
 K_SWIGLU, K_DOWN, K_LM_HEAD, K_LOG_SOFTMAX, K_SAMPLING, K_LORA, K_MAMBA_IN, K_MAMBA_CONV, K_SSM_SCAN,
 K_MAMBA_OUT, K_MOE) = range(len(TIMERS))
I32, F32, I64 = np.int32, np.float32, np.int64

# One record per sampling row (the sampling sequences, in work order), read by the sampler as
# rows[s].<name> (device/kernels/sampling/rows.py). A per-row input is one line here and the
# kernel code that reads it: the buffer, its view on the card and the packing follow from it.
# value(w, ctx): w the row's SeqWork, ctx its models.step.inputs.RowContext.
SAMPLE_ROW = Record("sample_row", [
    #        name          dtype  padding  value
    RowField("temperature", F32, 0.0, lambda w, c: greedy_or(w.sampling.temperature)),
    RowField("top_p", F32, 1.0, lambda w, c: w.sampling.top_p),
    RowField("min_p", F32, 0.0, lambda w, c: w.sampling.min_p),
    RowField("top_n_sigma", F32, -1.0, lambda w, c: w.sampling.top_n_sigma),
    RowField("presence", F32, 0.0, lambda w, c: w.sampling.presence_penalty),
    RowField("frequency", F32, 0.0, lambda w, c: w.sampling.frequency_penalty),
    RowField("repetition", F32, 1.0, lambda w, c: w.sampling.repetition_penalty),
    RowField("top_k", I32, 0, lambda w, c: w.sampling.top_k),
    RowField("pen_slot", I32, -1, lambda w, c: c.pen_slot),     # penalty slot it reads, or -1
    RowField("mask_row", I32, -1, lambda w, c: c.mask_row),     # its mask's row, -1: no grammar
    RowField("seed", I64, 0, lambda w, c: c.seed),
    # RNG counter: the number of the output token the row samples (a proposal's j-th row: + j)
    RowField("counter", I64, 0, lambda w, c: w.num_generated + c.draft_row),
])

# Written by the host at each launch (one copy). Dims: T token rows, S sequences, SR sampling
# rows (S, plus one per proposed token: speculative decoding), R logit rows, MB block-table
# width, NBAN banned ids, NMW grammar-mask words (masked rows times ceil(V/32)), NBIAS
# logit-bias entries, all of this launch.
INPUTS = Layout("inputs", [
    Field("tokens", I32, ("T",)),               # (rows with src_rows >= 0: read on the card)
    Field("positions", I32, ("T",)),
    Field("slot_mapping", I32, ("T",)),         # KV slot of each row (padding: the trash block, if computed)
    Field("src_rows", I32, ("T",)),             # row of the previous launch's sample, or -1
    Field("query_start", I32, ("S+1",)),        # first token row of each sequence
    Field("context_lens", I32, ("S",)),
    Field("block_tables", I32, ("S", "MB")),
    Field("logit_rows", I32, ("R",)),           # sampling rows first, then (R > SR) every row
    Field("count_slot", I32, ("S",)),           # per sequence: penalty slot its tokens count in, or -1
    Field("prompt_lens", I32, ("S",)),          # per sequence: positions below are prompt tokens
    Field("ban_start", I32, ("SR+1",)),         # per sampling row: its bans, its mask, its biases
    Field("ban_ids", I32, ("NBAN",)),           # not to sample (min_tokens)
    Field("mask_words", I32, ("NMW",)),         # [masked rows, ceil(V/32)] bitmasks (llguidance's)
    Field("bias_start", I32, ("SR+1",)),        # per sampling row: its logit_bias entries
    Field("bias_ids", I32, ("NBIAS",)),
    Field("bias", F32, ("NBIAS",)),
    Field("sample_rows", SAMPLE_ROW, ("SR",)),  # per sampling row: its parameters (above)
    Field("lora_slot", I32, ("T",)),            # per token row: its LoRA adapter's slot, or -1
    # a hybrid model's: per sequence, its slot of the Mamba-2 states (-1: padding), and 1 where
    # it starts from position 0 (its states start from zeros)
    Field("state_slot", I32, ("SST",)),
    Field("state_reset", I32, ("SST",)),
])

# Read back after each launch; rows 0..NS-1 are written. Dims: SR sampling rows, K top
# logprobs, P pooled sequences, H.
OUTPUTS = Layout("outputs", [
    Field("sampled", I32, ("SR",)),
    Field("logprob", F32, ("SR",)),             # of the sampled id, raw distribution
    Field("top_ids", I32, ("SR", "K")),
    Field("top_logprobs", F32, ("SR", "K")),
    Field("pooled", F32, ("P", "H")),           # a pooling runner's (P = S; else 0) vectors
])

# The step's activations, placed once for the largest bucket and shared by every bucket
# (a bucket's views are prefixes; the penalty tables are state kept between launches).
# Dims: TMAX, RMAX, SMAX (the largest T, R, S), H, QD = Hq D, KD = Hkv D, I, V, HALF_D = D / 2.
WORKSPACE = Layout("workspace", [
    Field("x", F32, ("TMAX", "H")),             # residual stream
    Field("hbuf", F32, ("TMAX", "H")),          # normed input of a block
    Field("y", F32, ("TMAX", "H")),             # o / down projection out
    Field("qkv", F32, ("TMAX", "QD+2*KD")),
    Field("q", F32, ("TMAX", "QD")),
    Field("k", F32, ("TMAX", "KD")),
    Field("v", F32, ("TMAX", "KD")),
    Field("attn", F32, ("TMAX", "QD")),
    Field("gate_up", F32, ("TMAX", "2*I")),
    Field("act", F32, ("TMAX", "I")),
    Field("rope_cos", F32, ("TMAX", "HALF_D")),    # each row's rotary angles, once a step
    Field("rope_sin", F32, ("TMAX", "HALF_D")),
    Field("hsel", F32, ("RMAX", "H")),          # rows of x that need logits
    Field("hn", F32, ("RMAX", "H")),
    Field("logits", F32, ("RMAX", "V")),
    Field("lsm", F32, ("RMAX", "V")),           # log-softmax, only when R > SR
    # per penalty slot (a sequence with penalties, models/step/penalty_slots.py): times each token
    # was generated, and 1 where the prompt holds it; cleared by a chunk at position 0
    Field("pen_output_counts", I32, ("2*SMAX", "V")),
    Field("pen_prompt_mask", I32, ("2*SMAX", "V")),
    # a hybrid model's (the dims are 0 for the others): a Mamba-2 mixer's in_proj out [z | xBC |
    # dt], the conv's out [x | B | C], the scan's y and the gated norm's out; the experts' router
    # logits, each row's k experts and weights, the (row, choice) pairs by expert and where each
    # expert's start, the experts' rows in and out, and their sum
    Field("zxbcdt", F32, ("MTMAX", "MPROJ")),
    Field("xbc", F32, ("MTMAX", "MCONV")),
    Field("ssm_y", F32, ("MTMAX", "MDI")),
    Field("gnorm", F32, ("MTMAX", "MDI")),
    Field("router_logits", F32, ("ETMAX", "E")),
    Field("moe_ids", I32, ("ETMAX", "TOPK")),
    Field("moe_weights", F32, ("ETMAX", "TOPK")),
    Field("moe_order", I32, ("ETMAX*TOPK",)),
    Field("moe_starts", I32, ("E+1",)),
    Field("moe_rows", F32, ("ETMAX*TOPK", "H")),
    Field("moe_gate_up", F32, ("ETMAX*TOPK", "2*IE")),
    Field("moe_act", F32, ("ETMAX*TOPK", "IE")),
    Field("moe_down", F32, ("ETMAX*TOPK", "H")),
    Field("moe_out", F32, ("ETMAX", "H")),
])


def _field_slots(names) -> list[tuple[str, str]]:
    """Two adjacent slots per field: its address, then its length (read by `_bounded`)."""
    return [s for n in names for s in ((n, "address"), (length_slot(n), "dim"))]


# (name, kind); the index in this list is the slot's index in the table.
SLOTS = [
    # step shapes
    ("T", "dim"), ("S", "dim"), ("SR", "dim"), ("R", "dim"), ("NS", "dim"), ("MB", "dim"), ("K", "dim"),
    ("NBAN", "dim"), ("NMW", "dim"), ("NBIAS", "dim"),
    ("SST", "dim"),      # sequences with Mamba-2 state slots (a hybrid model's: S, else 0)
    # pooling (embedding models): 0 generates, else 1 + device.kernels.pooling.POOL_*; unit norm
    ("POOL", "dim"), ("POOL_NORM", "dim"),
    # the part of the step this launch runs, in halves of layers: [H0, H1) of 0..2L+1 (2l: layer
    # l's attention, 2l+1: its MLP, 2L: the head, 2L+1: sampling; one card runs 0..2L+2). VS:
    # the LM head's columns (V, or a card's vocabulary shard: written to `lsm` as [R, VS])
    ("H0", "dim"), ("H1", "dim"), ("VS", "dim"),
    # model shapes
    ("H", "dim"), ("HQ", "dim"), ("HKV", "dim"), ("D", "dim"), ("I", "dim"), ("V", "dim"),
    ("L", "dim"), ("NBT", "dim"), ("BS", "dim"),
    # a hybrid model's: the Mamba-2 mixers' inner width, heads, head dim, state size, groups,
    # conv width, state slots; the experts, k of them a token, their width (0: none)
    ("MDI", "dim"), ("MNH", "dim"), ("MP", "dim"), ("MN", "dim"), ("MG", "dim"), ("MK", "dim"), ("NSS", "dim"),
    ("E", "dim"), ("TOPK", "dim"), ("IE", "dim"),
    # number formats (device.kernels.formats.FMT_*): the embedding's and the LM head's (a layer's
    # projections: its table row), the GEMM inputs' (CFMT) and the KV cache's (KV_FMT)
    ("EMBED_FMT", "dim"), ("LM_HEAD_FMT", "dim"), ("CFMT", "dim"), ("KV_FMT", "dim"),
    # model
    ("embed", "address"), ("norm", "address"), ("lm_head", "address"), ("inv_freq", "address"),
    ("consts", "address"), ("layers", "address"),
    # the previous launch's `sampled` (from-device decode tokens are read from it), and the
    # kernel timers (int64[len(TIMERS)]; length 0: timing off)
    *_field_slots(["prev_sampled", "timers"]),
    # the fields of the three buffers
    *_field_slots(f.name for layout in (INPUTS, OUTPUTS, WORKSPACE) for f in layout.fields),
]
# Slot.<name> is a slot's index (a field's length: Slot.<name>_len, its address + 1); the entry
# reads the table through it, so every slot derives from the lists above.
Slot = IntEnum("Slot", {name.replace(".", "_"): i for i, (name, _) in enumerate(SLOTS)})
_ROW_DTYPE = SAMPLE_ROW.dtype
_ROW_WORDS = SAMPLE_ROW.words


@njit(nogil=True, cache=True)
def _bounded(table, slot, n):
    """The address of the field at `slot`, once n elements are known to fit in its length
    (slot + 1): a view ends at most at the end of its field.

    The exception is static (a constant message): a raise with runtime values compiled into two
    cached programs (this one and the encoder's both call it) crashed the process when the second
    program's launch raised it after the first had run from Numba's cache (a segmentation fault
    instead of the error). The host's tables place every field for the launch's dims, so this
    fires only on a layout the entry disagrees with: the test that makes one checks it."""
    if n < 0 or n > table[slot + 1]:
        raise IndexError("step_entry: view longer than its field")
    return table[slot]


@njit(nogil=True, cache=True)
def _f32(f32, table, slot, n):
    """float32[n] view of the field at `slot`."""
    return f32_at(f32, _bounded(table, slot, n), n)


@njit(nogil=True, cache=True)
def _i32(i32, table, slot, n):
    """int32[n] view of the field at `slot`."""
    return i32_at(i32, _bounded(table, slot, n), n)


@njit(nogil=True, cache=True)
def _sample_rows(i64, table, n):
    """SAMPLE_ROW[n] view of the sample_rows field."""
    return i64_at(i64, _bounded(table, Slot.sample_rows, n), n * _ROW_WORDS).view(_ROW_DTYPE)


@njit(nogil=True, cache=True, inline="always")
def _mamba_mixer(y, hbuf, f32, u16, row, cfmt, zxbcdt, xbc, ssm_y, gnorm, query_start, state_slot,
                 state_reset, H, MDI, MNH, MP, MN, MCONV, MK, NSS, dt_min, dt_max, eps, timers, t):
    """y = a Mamba-2 mixer of the normed rows hbuf (its weights and states: the layer's table
    `row`): in_proj to [z | xBC | dt], the conv and the scan from each sequence's states, the
    gated norm, out_proj. Returns the timer's last stamp."""
    gemm_at(zxbcdt, hbuf, f32, u16, row[COL_M_IN], H, MDI + MCONV + MNH, row[COL_M_IN_FMT], cfmt)
    t = lap(timers, K_MAMBA_IN, t)
    conv_states = f32_at(f32, row[COL_M_CONV_STATE], NSS * (MK - 1) * MCONV).reshape(NSS, MK - 1, MCONV)
    mamba_conv(xbc, zxbcdt[:, MDI:MDI + MCONV], f32_at(f32, row[COL_M_CONV_W], MCONV * MK).reshape(MCONV, MK),
               f32_at(f32, row[COL_M_CONV_B], MCONV), conv_states, query_start, state_slot, state_reset)
    t = lap(timers, K_MAMBA_CONV, t)
    gn = (MCONV - MDI) // 2
    ssm_states = f32_at(f32, row[COL_M_SSM_STATE], NSS * MNH * MP * MN).reshape(NSS, MNH, MP, MN)
    ssm_scan(ssm_y, xbc[:, :MDI], zxbcdt[:, MDI + MCONV:], xbc[:, MDI:MDI + gn], xbc[:, MDI + gn:],
             f32_at(f32, row[COL_M_A], MNH), f32_at(f32, row[COL_M_D], MNH), f32_at(f32, row[COL_M_DT_BIAS], MNH),
             dt_min, dt_max, ssm_states, query_start, state_slot, state_reset)
    t = lap(timers, K_SSM_SCAN, t)
    gated_rmsnorm(gnorm, ssm_y, zxbcdt[:, :MDI], f32_at(f32, row[COL_M_NORM], MDI), MDI // (gn // MN), eps)
    gemm_at(y, gnorm, f32, u16, row[COL_M_OUT], MDI, H, row[COL_M_OUT_FMT], cfmt)
    return lap(timers, K_MAMBA_OUT, t)


@njit(nogil=True, cache=True)
def step_entry(f32, i32, i64, u16, table):
    T = table[Slot.T]
    S = table[Slot.S]
    SR = table[Slot.SR]
    R = table[Slot.R]
    NS = table[Slot.NS]
    MB = table[Slot.MB]
    K = table[Slot.K]
    NBAN = table[Slot.NBAN]
    NMW = table[Slot.NMW]
    NBIAS = table[Slot.NBIAS]
    H = table[Slot.H]
    HQ = table[Slot.HQ]
    HKV = table[Slot.HKV]
    D = table[Slot.D]
    INTER = table[Slot.I]
    V = table[Slot.V]
    L = table[Slot.L]
    NBT = table[Slot.NBT]
    BS = table[Slot.BS]
    QD, KD = HQ * D, HKV * D
    QKV = QD + 2 * KD
    MDI, MNH, MP, MN, MG, MK, NSS = (table[Slot.MDI], table[Slot.MNH], table[Slot.MP], table[Slot.MN],
                                     table[Slot.MG], table[Slot.MK], table[Slot.NSS])
    MCONV = MDI + 2 * MG * MN
    E, TOPK, IE = table[Slot.E], table[Slot.TOPK], table[Slot.IE]

    consts = f32_at(f32, table[Slot.consts], N_CONSTS)
    eps, emb_mult = consts[CONST_EPS], consts[CONST_EMB_MULT]
    attn_scale = consts[CONST_ATTN_SCALE]
    res_mult = consts[CONST_RES_MULT]
    inv_logit_scale = consts[CONST_INV_LOGIT_SCALE]

    # ---- inputs (INPUTS)
    tokens = _i32(i32, table, Slot.tokens, T)
    positions = _i32(i32, table, Slot.positions, T)
    slot_mapping = _i32(i32, table, Slot.slot_mapping, T)
    src_rows = _i32(i32, table, Slot.src_rows, T)
    query_start = _i32(i32, table, Slot.query_start, S + 1)
    context_lens = _i32(i32, table, Slot.context_lens, S)
    block_tables = _i32(i32, table, Slot.block_tables, S * MB).reshape(S, MB)
    logit_rows = _i32(i32, table, Slot.logit_rows, R)
    count_slot = _i32(i32, table, Slot.count_slot, S)
    prompt_lens = _i32(i32, table, Slot.prompt_lens, S)
    ban_start = _i32(i32, table, Slot.ban_start, SR + 1)
    ban_ids = _i32(i32, table, Slot.ban_ids, NBAN)
    mw = (V + 31) // 32                      # words per grammar mask
    mask_words = _i32(i32, table, Slot.mask_words, NMW).reshape(NMW // mw, mw)
    bias_start = _i32(i32, table, Slot.bias_start, SR + 1)
    bias_ids = _i32(i32, table, Slot.bias_ids, NBIAS)
    bias = _f32(f32, table, Slot.bias, NBIAS)
    rows = _sample_rows(i64, table, SR)
    lora_slot = _i32(i32, table, Slot.lora_slot, T)
    SST = table[Slot.SST]
    state_slot = _i32(i32, table, Slot.state_slot, SST)
    state_reset = _i32(i32, table, Slot.state_reset, SST)

    # Decode tokens sampled by the previous launch, read here instead of on the host.
    prev_sampled = _i32(i32, table, Slot.prev_sampled, table[Slot.prev_sampled + 1])
    for t in range(T):
        if src_rows[t] >= prev_sampled.shape[0]:
            raise IndexError("step_entry: src_rows past the previous launch's samples",
                             src_rows[t], prev_sampled.shape[0])
        if src_rows[t] >= 0:
            tokens[t] = prev_sampled[src_rows[t]]
    # The bucket's padding rows (past query_start[S]) are not computed: every per-token kernel
    # below runs on the step's real rows only, so padding costs no arithmetic. A launch with no
    # rows at all (warmup's) computes the whole bucket: it pages in the workspace.
    if query_start[S] > T:
        raise ValueError("step_entry: more token rows than the bucket (rows, bucket)", query_start[S], T)
    if query_start[S] > 0:
        T = query_start[S]
        tokens, positions, slot_mapping, lora_slot = tokens[:T], positions[:T], slot_mapping[:T], lora_slot[:T]

    # ---- workspace (WORKSPACE, placed for the largest bucket: this bucket's views are prefixes)
    x = _f32(f32, table, Slot.x, T * H).reshape(T, H)
    hbuf = _f32(f32, table, Slot.hbuf, T * H).reshape(T, H)
    y = _f32(f32, table, Slot.y, T * H).reshape(T, H)
    qkv = _f32(f32, table, Slot.qkv, T * QKV).reshape(T, QKV)
    qf = _f32(f32, table, Slot.q, T * QD).reshape(T, QD)
    kf = _f32(f32, table, Slot.k, T * KD).reshape(T, KD)
    vf = _f32(f32, table, Slot.v, T * KD).reshape(T, KD)
    attn = _f32(f32, table, Slot.attn, T * QD).reshape(T, QD)
    gu = _f32(f32, table, Slot.gate_up, T * 2 * INTER).reshape(T, 2 * INTER)
    act = _f32(f32, table, Slot.act, T * INTER).reshape(T, INTER)
    rope_cos = _f32(f32, table, Slot.rope_cos, T * (D // 2)).reshape(T, D // 2)
    rope_sin = _f32(f32, table, Slot.rope_sin, T * (D // 2)).reshape(T, D // 2)
    hsel = _f32(f32, table, Slot.hsel, R * H).reshape(R, H)
    hn = _f32(f32, table, Slot.hn, R * H).reshape(R, H)
    logits = _f32(f32, table, Slot.logits, R * V).reshape(R, V)
    lsm = _f32(f32, table, Slot.lsm, R * V).reshape(R, V)
    npsl = table[Slot.pen_output_counts + 1] // V              # penalty slots
    pen_counts = _i32(i32, table, Slot.pen_output_counts, npsl * V).reshape(npsl, V)
    pen_prompt = _i32(i32, table, Slot.pen_prompt_mask, npsl * V).reshape(npsl, V)

    MT = T if MDI > 0 else 0
    zxbcdt = _f32(f32, table, Slot.zxbcdt, MT * (MDI + MCONV + MNH)).reshape(MT, MDI + MCONV + MNH)
    xbc = _f32(f32, table, Slot.xbc, MT * MCONV).reshape(MT, MCONV)
    ssm_y = _f32(f32, table, Slot.ssm_y, MT * MDI).reshape(MT, MDI)
    gnorm = _f32(f32, table, Slot.gnorm, MT * MDI).reshape(MT, MDI)
    ET = T if E > 0 else 0
    router_logits = _f32(f32, table, Slot.router_logits, ET * E).reshape(ET, E)
    moe_ids = _i32(i32, table, Slot.moe_ids, ET * TOPK).reshape(ET, TOPK)
    moe_weights = _f32(f32, table, Slot.moe_weights, ET * TOPK).reshape(ET, TOPK)
    moe_ord = _i32(i32, table, Slot.moe_order, ET * TOPK)
    moe_starts = _i32(i32, table, Slot.moe_starts, E + 1 if E > 0 else 0)
    moe_rows = _f32(f32, table, Slot.moe_rows, ET * TOPK * H).reshape(ET * TOPK, H)
    moe_gu = _f32(f32, table, Slot.moe_gate_up, ET * TOPK * 2 * IE).reshape(ET * TOPK, 2 * IE)
    moe_act = _f32(f32, table, Slot.moe_act, ET * TOPK * IE).reshape(ET * TOPK, IE)
    moe_down = _f32(f32, table, Slot.moe_down, ET * TOPK * H).reshape(ET * TOPK, H)
    moe_out = _f32(f32, table, Slot.moe_out, ET * H).reshape(ET, H)
    dt_min, dt_max = consts[CONST_DT_MIN], consts[CONST_DT_MAX]

    q3, a3 = qf.reshape(T, HQ, D), attn.reshape(T, HQ, D)
    k3, v3 = kf.reshape(T, HKV, D), vf.reshape(T, HKV, D)

    inv_freq = f32_at(f32, table[Slot.inv_freq], D // 2)
    layers = i64_at(i64, table[Slot.layers], L * LAYER_FIELDS).reshape(L, LAYER_FIELDS)
    cfmt = table[Slot.CFMT]      # GEMM inputs: rounded to 16 bits by the GEMM, or int8 (quantized weights)
    timers = i64_at(i64, table[Slot.timers], table[Slot.timers + 1])
    t = lap(timers, -1, 0)
    H0, H1 = table[Slot.H0], table[Slot.H1]
    if H0 == 0:
        rope_tables(rope_cos, rope_sin, positions, inv_freq)     # every layer rotates by them
        gather_columns_at(x, f32, u16, table[Slot.embed], tokens, emb_mult, H, V, table[Slot.EMBED_FMT])
        t = lap(timers, K_EMBEDDING, t)
    # ---- the model, half a layer at a time: a half's output y joins the residual stream at
    # the start of the next (several cards: once summed over the cards between the two)
    for half in range(H0, min(H1, 2 * L + 1)):
        if half > 0:
            residual_add(x, y, res_mult)
            t = lap(timers, K_RESIDUAL, t)
        if half == 2 * L:
            break
        layer = half // 2
        lora = layers[layer, COL_LORA:COL_LORA + 3]
        if half % 2 == 0 and layers[layer, COL_KIND] == KIND_MAMBA:
            rmsnorm(hbuf, x, f32_at(f32, layers[layer, COL_IN_NORM], H), eps)
            t = lap(timers, K_RMSNORM, t)
            t = _mamba_mixer(y, hbuf, f32, u16, layers[layer], cfmt, zxbcdt, xbc, ssm_y, gnorm, query_start,
                             state_slot, state_reset, H, MDI, MNH, MP, MN, MCONV, MK, NSS, dt_min, dt_max, eps,
                             timers, t)
        elif half % 2 == 0:
            rmsnorm(hbuf, x, f32_at(f32, layers[layer, COL_IN_NORM], H), eps)
            t = lap(timers, K_RMSNORM, t)
            gemm_at(qkv, hbuf, f32, u16, layers[layer, COL_QKV], H, QKV,
                    layers[layer, COL_QKV_FMT], cfmt)
            t = lap(timers, K_QKV, t)
            lora_layer(qkv, hbuf, f32, lora, lora_slot, ON_QKV[0], ON_QKV[1], H, QD, KD, INTER)
            t = lap(timers, K_LORA, t)
            split_rope(q3, k3, v3, qkv, rope_cos, rope_sin)
            t = lap(timers, K_ROPE, t)
            t = attention_at(f32, u16, layers[layer, COL_K_CACHE], layers[layer, COL_V_CACHE],
                             table[Slot.KV_FMT], NBT, BS, HKV, D, k3, v3, slot_mapping, a3, q3,
                             block_tables, query_start, context_lens, attn_scale, timers, t,
                             K_WRITE_KV, K_ATTENTION)
            gemm_at(y, attn, f32, u16, layers[layer, COL_O], QD, H, layers[layer, COL_O_FMT], cfmt)
            t = lap(timers, K_O_PROJ, t)
            lora_layer(y, attn, f32, lora, lora_slot, ON_O[0], ON_O[1], H, QD, KD, INTER)
            t = lap(timers, K_LORA, t)
        else:
            rmsnorm(hbuf, x, f32_at(f32, layers[layer, COL_POST_NORM], H), eps)
            t = lap(timers, K_RMSNORM, t)
            if E > 0:                 # the experts first: their sum, then the dense MLP's added
                row = layers[layer]
                gemm_at(router_logits, hbuf, f32, u16, row[COL_MOE_ROUTER], H, E, row[COL_MOE_ROUTER_FMT], cfmt)
                moe_route(moe_ids, moe_weights, router_logits)
                moe_order(moe_ord, moe_starts, moe_ids)
                moe_experts_at(moe_out, hbuf, moe_weights, moe_ord, moe_starts, moe_rows, moe_gu, moe_act, moe_down,
                               f32, u16, i64_at(i64, row[COL_MOE_EXPERTS], E * 2).reshape(E, 2),
                               row[COL_MOE_GU_FMT:COL_MOE_DOWN_FMT + 1], cfmt)
                t = lap(timers, K_MOE, t)
            if layers[layer, COL_DENSE] != 0:
                gemm_at(gu, hbuf, f32, u16, layers[layer, COL_GATE_UP], H, 2 * INTER,
                        layers[layer, COL_GATE_UP_FMT], cfmt)
                t = lap(timers, K_GATE_UP, t)
                lora_layer(gu, hbuf, f32, lora, lora_slot, ON_GATE_UP[0], ON_GATE_UP[1], H, QD, KD, INTER)
                t = lap(timers, K_LORA, t)
                swiglu(act, gu)
                t = lap(timers, K_SWIGLU, t)
                gemm_at(y, act, f32, u16, layers[layer, COL_DOWN], INTER, H, layers[layer, COL_DOWN_FMT], cfmt)
                t = lap(timers, K_DOWN, t)
                lora_layer(y, act, f32, lora, lora_slot, ON_DOWN[0], ON_DOWN[1], H, QD, KD, INTER)
                t = lap(timers, K_LORA, t)
                if E > 0:
                    for r in range(T):
                        for c in range(H):
                            y[r, c] = moe_out[r, c] + y[r, c]
            else:
                y[:, :] = moe_out

    norm = f32_at(f32, table[Slot.norm], H)
    if H0 <= 2 * L < H1 and table[Slot.POOL] > 0:   # an embedding model: each sequence's rows pooled
        rmsnorm(hbuf, x, norm, eps)
        pool_rows(_f32(f32, table, Slot.pooled, S * H).reshape(S, H), hbuf, query_start,
                  table[Slot.POOL] - 1, table[Slot.POOL_NORM])
        return
    if H0 <= 2 * L < H1:                 # ---- the head: logits only for the rows that need them
        VS = table[Slot.VS]
        gather_rows(hsel, x, logit_rows)
        rmsnorm(hn, hsel, norm, eps)
        head_out = logits if VS == V else lsm.reshape(R * V)[:R * VS].reshape(R, VS)
        gemm_at(head_out, hn, f32, u16, table[Slot.lm_head], H, VS, table[Slot.LM_HEAD_FMT], cfmt)
        t = lap(timers, K_LM_HEAD, t)
    if H1 <= 2 * L + 1:
        return
    lf = logits.reshape(R * V)           # ---- sampling (every card's logits whole by now)
    for i in range(R * V):
        lf[i] *= inv_logit_scale
    if R > SR:
        log_softmax(lsm, logits)          # every token row asked for (prompt logprobs, debug)
    t = lap(timers, K_LOG_SOFTMAX, t)

    # ---- penalty state: this step's tokens (from-device ones included) counted into the
    # slots, then sampling rows 0..NS-1: logit bias, penalties, bans, grammar masks,
    # temperature, filters, a draw; raw logprobs, top-K
    count_tokens(pen_counts, pen_prompt, count_slot, prompt_lens, query_start, positions, tokens)
    sampled = _i32(i32, table, Slot.sampled, NS)
    logprob = _f32(f32, table, Slot.logprob, NS)
    top_ids = _i32(i32, table, Slot.top_ids, NS * K).reshape(NS, K)
    top_lp = _f32(f32, table, Slot.top_logprobs, NS * K).reshape(NS, K)
    if NS > 0:
        sample_rows(sampled, logprob, top_ids, top_lp, logits[:NS], rows[:NS], pen_counts,
                    pen_prompt, ban_start[:NS + 1], ban_ids, mask_words, bias_start[:NS + 1],
                    bias_ids, bias)
    lap(timers, K_SAMPLING, t)
