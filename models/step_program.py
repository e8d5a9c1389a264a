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
    hsel[R, H] = rmsnorm(x[logit_rows]);   logits[R, V] = hsel @ lm_head / logits_scaling
    count each penalized sequence's tokens into its slot of the penalty tables (on the card)
    sample rows 0..NS-1 (logit bias, penalties, bans, grammar mask, temperature, top-k/p,
    min-p, seeded draw) with the
    sampled id, its raw logprob and the top-K raw logprobs; rows NS.. only when asked
    (R > S: every token row, for prompt logprobs) get a log-softmax.

Its three buffers are declared once, below, as tables of fields (models/buffer_layout.py):
INPUTS (packed by the host at every launch), OUTPUTS (read back; two, alternating, so a
launch reads the previous one's samples) and WORKSPACE (activations, placed once for the
largest bucket). SLOTS gives every field two slots, its address and its length; the host
places the fields from the tables and binds their addresses at launch, and the entry views a
field through `_i32` / `_f32` / `_i64`, which refuse a view longer than the field. So the
order of fields in a buffer is host-side data: reordering a table needs no recompile.

Numba caches `step_entry` keyed on this file alone and freezes the module-level integers it
reads (slot indexes, KMAX, the layer-table columns) into the cached code: they are all
computed here, and the cache is keyed by the sources of device/ and models/ together
(device/cache.py), so changing any of them compiles afresh.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from device.abi import f32_at, i32_at, i64_at
from device.kernels.activation import swiglu
from device.kernels.attention import paged_attention, write_kv
from device.kernels.gemm import gather_columns_at, gemm_at, round_to_format
from device.kernels.norm import rmsnorm
from device.kernels.residual import residual_add
from device.kernels.rope import rope_inplace
from device.kernels.sampling import count_tokens, sample_with_state
from device.kernels.softmax import log_softmax
from device.profile import lap
from models.buffer_layout import Field, Layout, length_slot

KMAX = 5  # most top logprobs per sampled token (OpenAI's limit for completions)

# Columns of the per-layer table int64[L, LAYER_FIELDS] (models/weights.py builds it): byte
# addresses, then each projection's number format (device.kernels.gemm.FMT_*).
COL_IN_NORM, COL_QKV, COL_O, COL_POST_NORM, COL_GATE_UP, COL_DOWN, COL_K_CACHE, COL_V_CACHE = range(8)
COL_QKV_FMT, COL_O_FMT, COL_GATE_UP_FMT, COL_DOWN_FMT = range(8, 12)
LAYER_FIELDS = 12
# Indexes into the model's float32 constants (models/weights.py places them).
CONST_EPS, CONST_EMB_MULT, CONST_ATTN_SCALE, CONST_RES_MULT, CONST_INV_LOGIT_SCALE = range(5)
N_CONSTS = 8
# Kernel timers (`timers` field; device/profile.py): where a step's device time goes.
TIMERS = ("embedding", "rmsnorm", "qkv", "rope", "write_kv", "attention", "o_proj", "residual",
          "gate_up", "swiglu", "down", "lm_head", "log_softmax", "sampling")
(K_EMBEDDING, K_RMSNORM, K_QKV, K_ROPE, K_WRITE_KV, K_ATTENTION, K_O_PROJ, K_RESIDUAL, K_GATE_UP,
 K_SWIGLU, K_DOWN, K_LM_HEAD, K_LOG_SOFTMAX, K_SAMPLING) = range(len(TIMERS))
I32, F32, I64 = np.int32, np.float32, np.int64

# Written by the host at each launch (one copy). Dims: T token rows, S sequences, R logit
# rows, MB block-table width, NBAN banned ids, NMW grammar-mask words (masked rows times
# ceil(V/32)), NBIAS logit-bias entries, all of this launch.
INPUTS = Layout("inputs", [
    Field("tokens", I32, ("T",)),               # (rows with src_rows >= 0: read on the card)
    Field("positions", I32, ("T",)),
    Field("slot_mapping", I32, ("T",)),         # KV slot of each row (padding: the trash block)
    Field("src_rows", I32, ("T",)),             # row of the previous launch's sample, or -1
    Field("query_start", I32, ("S+1",)),        # first token row of each sequence
    Field("context_lens", I32, ("S",)),
    Field("block_tables", I32, ("S", "MB")),
    Field("logit_rows", I32, ("R",)),           # sampling rows first, then (R > S) every row
    Field("count_slot", I32, ("S",)),           # per sequence: penalty slot its tokens count in, or -1
    Field("prompt_lens", I32, ("S",)),          # per sequence: positions below are prompt tokens
    Field("top_k", I32, ("S",)),                # per sampling row, like the fields below
    Field("pen_slot", I32, ("S",)),             # penalty slot the row's penalties read, or -1
    Field("ban_start", I32, ("S+1",)),
    Field("ban_ids", I32, ("NBAN",)),           # not to sample (min_tokens)
    Field("mask_row", I32, ("S",)),             # per sampling row: its mask's row, -1: no grammar
    Field("mask_words", I32, ("NMW",)),         # [masked rows, ceil(V/32)] bitmasks (llguidance's)
    Field("bias_start", I32, ("S+1",)),         # per sampling row: its logit_bias entries
    Field("bias_ids", I32, ("NBIAS",)),
    Field("bias", F32, ("NBIAS",)),
    Field("temperature", F32, ("S",)),
    Field("top_p", F32, ("S",)),
    Field("min_p", F32, ("S",)),
    Field("presence", F32, ("S",)),
    Field("frequency", F32, ("S",)),
    Field("repetition", F32, ("S",)),
    Field("seeds", I64, ("S",)),
    Field("counters", I64, ("S",)),             # RNG counter: tokens generated so far
])

# Read back after each launch; rows 0..NS-1 are written. Dims: S sequences, K top logprobs.
OUTPUTS = Layout("outputs", [
    Field("sampled", I32, ("S",)),
    Field("logprob", F32, ("S",)),              # of the sampled id, raw distribution
    Field("top_ids", I32, ("S", "K")),
    Field("top_logprobs", F32, ("S", "K")),
])

# The step's activations, placed once for the largest bucket and shared by every bucket
# (a bucket's views are prefixes; the penalty tables are state kept between launches).
# Dims: TMAX, RMAX, SMAX (the largest T, R, S), H, QD = Hq D, KD = Hkv D, I, V.
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
    Field("hsel", F32, ("RMAX", "H")),          # rows of x that need logits
    Field("hn", F32, ("RMAX", "H")),
    Field("logits", F32, ("RMAX", "V")),
    Field("lsm", F32, ("RMAX", "V")),           # log-softmax, only when R > S
    # per penalty slot (a sequence with penalties, models/penalty_slots.py): times each token
    # was generated, and 1 where the prompt holds it; cleared by a chunk at position 0
    Field("pen_output_counts", I32, ("2*SMAX", "V")),
    Field("pen_prompt_mask", I32, ("2*SMAX", "V")),
])


def _field_slots(names) -> list[tuple[str, str]]:
    """Two adjacent slots per field: its address, then its length (read by `_bounded`)."""
    return [s for n in names for s in ((n, "address"), (length_slot(n), "dim"))]


# (name, kind); the index in this list is the slot's index in the table.
SLOTS = [
    # step shapes
    ("T", "dim"), ("S", "dim"), ("R", "dim"), ("NS", "dim"), ("MB", "dim"), ("K", "dim"),
    ("NBAN", "dim"), ("NMW", "dim"), ("NBIAS", "dim"),
    # model shapes
    ("H", "dim"), ("HQ", "dim"), ("HKV", "dim"), ("D", "dim"), ("I", "dim"), ("V", "dim"),
    ("L", "dim"), ("NBT", "dim"), ("BS", "dim"),
    # number formats (device.kernels.gemm.FMT_*): the embedding's and the LM head's (a layer's
    # projections: its table row), and the GEMM inputs' (CFMT)
    ("EMBED_FMT", "dim"), ("LM_HEAD_FMT", "dim"), ("CFMT", "dim"),
    # model
    ("embed", "address"), ("norm", "address"), ("lm_head", "address"), ("inv_freq", "address"),
    ("consts", "address"), ("layers", "address"),
    # the previous launch's `sampled` (from-device decode tokens are read from it), and the
    # kernel timers (int64[len(TIMERS)]; length 0: timing off)
    *_field_slots(["prev_sampled", "timers"]),
    # the fields of the three buffers
    *_field_slots(f.name for layout in (INPUTS, OUTPUTS, WORKSPACE) for f in layout.fields),
]
_INDEX = {name: i for i, (name, _) in enumerate(SLOTS)}


def _slots(names: str) -> tuple[int, ...]:
    """Indexes of the named slots. Constants below: S_<dim> for a dim slot, A_<NAME> for the
    address slot of `name` (tests/models/test_step_layout.py checks the naming)."""
    return tuple(_INDEX[n] for n in names.split())


S_T, S_S, S_R, S_NS, S_MB, S_K, S_NBAN, S_NMW, S_NBIAS = _slots("T S R NS MB K NBAN NMW NBIAS")
S_H, S_HQ, S_HKV, S_D, S_I, S_V, S_L, S_NBT, S_BS = _slots("H HQ HKV D I V L NBT BS")
S_EMBED_FMT, S_LM_HEAD_FMT, S_CFMT = _slots("EMBED_FMT LM_HEAD_FMT CFMT")
A_EMBED, A_NORM, A_LM_HEAD, A_INV_FREQ, A_CONSTS, A_LAYERS = _slots(
    "embed norm lm_head inv_freq consts layers")
A_PREV_SAMPLED, A_TIMERS, A_SAMPLED, A_LOGPROB, A_TOP_IDS, A_TOP_LOGPROBS = _slots(
    "prev_sampled timers sampled logprob top_ids top_logprobs")
A_TOKENS, A_POSITIONS, A_SLOT_MAPPING, A_SRC_ROWS, A_QUERY_START, A_CONTEXT_LENS = _slots(
    "tokens positions slot_mapping src_rows query_start context_lens")
A_BLOCK_TABLES, A_LOGIT_ROWS, A_TOP_K, A_COUNT_SLOT, A_PROMPT_LENS, A_PEN_SLOT = _slots(
    "block_tables logit_rows top_k count_slot prompt_lens pen_slot")
A_BAN_START, A_BAN_IDS, A_SEEDS, A_COUNTERS = _slots("ban_start ban_ids seeds counters")
A_MASK_ROW, A_MASK_WORDS, A_BIAS_START, A_BIAS_IDS, A_BIAS = _slots(
    "mask_row mask_words bias_start bias_ids bias")
A_TEMPERATURE, A_TOP_P, A_MIN_P, A_PRESENCE, A_FREQUENCY, A_REPETITION = _slots(
    "temperature top_p min_p presence frequency repetition")
A_X, A_HBUF, A_Y, A_QKV, A_Q, A_K, A_V, A_ATTN, A_GATE_UP, A_ACT = _slots(
    "x hbuf y qkv q k v attn gate_up act")
A_HSEL, A_HN, A_LOGITS, A_LSM = _slots("hsel hn logits lsm")
A_PEN_OUTPUT_COUNTS, A_PEN_PROMPT_MASK = _slots("pen_output_counts pen_prompt_mask")


@njit(nogil=True, cache=True)
def _bounded(table, slot, n):
    """The address of the field at `slot`, once n elements are known to fit in its length
    (slot + 1): a view ends at most at the end of its field."""
    if n < 0 or n > table[slot + 1]:
        raise IndexError("step_entry: view longer than its field (slot, elements, field length)",
                         slot, n, table[slot + 1])
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
def _i64(i64, table, slot, n):
    """int64[n] view of the field at `slot`."""
    return i64_at(i64, _bounded(table, slot, n), n)


@njit(nogil=True, cache=True)
def _split_qkv(q, k, v, qkv, qd, kd):
    # q [T, QD], k/v [T, KD] <- qkv [T, QD + 2 KD]
    for t in range(qkv.shape[0]):
        for j in range(qd):
            q[t, j] = qkv[t, j]
        for j in range(kd):
            k[t, j] = qkv[t, qd + j]
            v[t, j] = qkv[t, qd + kd + j]


@njit(nogil=True, cache=True)
def _gather_rows(out, x, rows):
    # out [R, H] <- x [T, H] rows
    for r in range(rows.shape[0]):
        src = rows[r]
        for j in range(x.shape[1]):
            out[r, j] = x[src, j]


@njit(nogil=True, cache=True)
def step_entry(f32, i32, i64, u16, table):
    T = table[S_T]
    S = table[S_S]
    R = table[S_R]
    NS = table[S_NS]
    MB = table[S_MB]
    K = table[S_K]
    NBAN = table[S_NBAN]
    NMW = table[S_NMW]
    NBIAS = table[S_NBIAS]
    H = table[S_H]
    HQ = table[S_HQ]
    HKV = table[S_HKV]
    D = table[S_D]
    INTER = table[S_I]
    V = table[S_V]
    L = table[S_L]
    NBT = table[S_NBT]
    BS = table[S_BS]
    QD = HQ * D
    KD = HKV * D
    QKV = QD + 2 * KD

    consts = f32_at(f32, table[A_CONSTS], N_CONSTS)
    eps = consts[CONST_EPS]
    emb_mult = consts[CONST_EMB_MULT]
    attn_scale = consts[CONST_ATTN_SCALE]
    res_mult = consts[CONST_RES_MULT]
    inv_logit_scale = consts[CONST_INV_LOGIT_SCALE]

    # ---- inputs (INPUTS)
    tokens = _i32(i32, table, A_TOKENS, T)
    positions = _i32(i32, table, A_POSITIONS, T)
    slot_mapping = _i32(i32, table, A_SLOT_MAPPING, T)
    src_rows = _i32(i32, table, A_SRC_ROWS, T)
    query_start = _i32(i32, table, A_QUERY_START, S + 1)
    context_lens = _i32(i32, table, A_CONTEXT_LENS, S)
    block_tables = _i32(i32, table, A_BLOCK_TABLES, S * MB).reshape(S, MB)
    logit_rows = _i32(i32, table, A_LOGIT_ROWS, R)
    count_slot = _i32(i32, table, A_COUNT_SLOT, S)
    prompt_lens = _i32(i32, table, A_PROMPT_LENS, S)
    top_k = _i32(i32, table, A_TOP_K, S)
    pen_slot = _i32(i32, table, A_PEN_SLOT, S)
    ban_start = _i32(i32, table, A_BAN_START, S + 1)
    ban_ids = _i32(i32, table, A_BAN_IDS, NBAN)
    mask_row = _i32(i32, table, A_MASK_ROW, S)
    mw = (V + 31) // 32                      # words per grammar mask
    mask_words = _i32(i32, table, A_MASK_WORDS, NMW).reshape(NMW // mw, mw)
    bias_start = _i32(i32, table, A_BIAS_START, S + 1)
    bias_ids = _i32(i32, table, A_BIAS_IDS, NBIAS)
    bias = _f32(f32, table, A_BIAS, NBIAS)
    temperature = _f32(f32, table, A_TEMPERATURE, S)
    top_p = _f32(f32, table, A_TOP_P, S)
    min_p = _f32(f32, table, A_MIN_P, S)
    presence = _f32(f32, table, A_PRESENCE, S)
    frequency = _f32(f32, table, A_FREQUENCY, S)
    repetition = _f32(f32, table, A_REPETITION, S)
    seeds = _i64(i64, table, A_SEEDS, S)
    counters = _i64(i64, table, A_COUNTERS, S)

    # Decode tokens sampled by the previous launch, read here instead of on the host.
    prev_sampled = _i32(i32, table, A_PREV_SAMPLED, table[A_PREV_SAMPLED + 1])
    for t in range(T):
        if src_rows[t] >= prev_sampled.shape[0]:
            raise IndexError("step_entry: src_rows past the previous launch's samples",
                             src_rows[t], prev_sampled.shape[0])
        if src_rows[t] >= 0:
            tokens[t] = prev_sampled[src_rows[t]]

    # ---- workspace (WORKSPACE, placed for the largest bucket: this bucket's views are prefixes)
    x = _f32(f32, table, A_X, T * H).reshape(T, H)
    hbuf = _f32(f32, table, A_HBUF, T * H).reshape(T, H)
    y = _f32(f32, table, A_Y, T * H).reshape(T, H)
    qkv = _f32(f32, table, A_QKV, T * QKV).reshape(T, QKV)
    qf = _f32(f32, table, A_Q, T * QD).reshape(T, QD)
    kf = _f32(f32, table, A_K, T * KD).reshape(T, KD)
    vf = _f32(f32, table, A_V, T * KD).reshape(T, KD)
    attn = _f32(f32, table, A_ATTN, T * QD).reshape(T, QD)
    gu = _f32(f32, table, A_GATE_UP, T * 2 * INTER).reshape(T, 2 * INTER)
    act = _f32(f32, table, A_ACT, T * INTER).reshape(T, INTER)
    hsel = _f32(f32, table, A_HSEL, R * H).reshape(R, H)
    hn = _f32(f32, table, A_HN, R * H).reshape(R, H)
    logits = _f32(f32, table, A_LOGITS, R * V).reshape(R, V)
    lsm = _f32(f32, table, A_LSM, R * V).reshape(R, V)
    npsl = table[A_PEN_OUTPUT_COUNTS + 1] // V              # penalty slots
    pen_counts = _i32(i32, table, A_PEN_OUTPUT_COUNTS, npsl * V).reshape(npsl, V)
    pen_prompt = _i32(i32, table, A_PEN_PROMPT_MASK, npsl * V).reshape(npsl, V)

    q3 = qf.reshape(T, HQ, D)
    k3 = kf.reshape(T, HKV, D)
    v3 = vf.reshape(T, HKV, D)
    a3 = attn.reshape(T, HQ, D)

    inv_freq = f32_at(f32, table[A_INV_FREQ], D // 2)
    layers = i64_at(i64, table[A_LAYERS], L * LAYER_FIELDS).reshape(L, LAYER_FIELDS)
    cfmt = table[S_CFMT]                     # GEMM inputs: rounded to 16 bits, or int8 (quantized weights)
    timers = i64_at(i64, table[A_TIMERS], table[A_TIMERS + 1])
    t = lap(timers, -1, 0)

    # ---- the model
    gather_columns_at(x, f32, u16, table[A_EMBED], tokens, emb_mult, H, V, table[S_EMBED_FMT])
    t = lap(timers, K_EMBEDDING, t)
    for layer in range(L):
        in_norm = f32_at(f32, layers[layer, COL_IN_NORM], H)
        post_norm = f32_at(f32, layers[layer, COL_POST_NORM], H)
        k_cache = f32_at(f32, layers[layer, COL_K_CACHE], NBT * BS * KD).reshape(NBT, BS, HKV, D)
        v_cache = f32_at(f32, layers[layer, COL_V_CACHE], NBT * BS * KD).reshape(NBT, BS, HKV, D)

        rmsnorm(hbuf, x, in_norm, eps)
        round_to_format(hbuf, cfmt)
        t = lap(timers, K_RMSNORM, t)
        gemm_at(qkv, hbuf, f32, u16, layers[layer, COL_QKV], H, QKV,
                layers[layer, COL_QKV_FMT], cfmt)
        t = lap(timers, K_QKV, t)
        _split_qkv(qf, kf, vf, qkv, QD, KD)
        rope_inplace(q3, positions, inv_freq)
        rope_inplace(k3, positions, inv_freq)
        t = lap(timers, K_ROPE, t)
        write_kv(k_cache, v_cache, k3, v3, slot_mapping)
        t = lap(timers, K_WRITE_KV, t)
        paged_attention(a3, q3, k_cache, v_cache, block_tables, query_start, context_lens,
                        attn_scale)
        round_to_format(attn, cfmt)
        t = lap(timers, K_ATTENTION, t)
        gemm_at(y, attn, f32, u16, layers[layer, COL_O], QD, H,
                layers[layer, COL_O_FMT], cfmt)
        t = lap(timers, K_O_PROJ, t)
        residual_add(x, y, res_mult)
        t = lap(timers, K_RESIDUAL, t)
        rmsnorm(hbuf, x, post_norm, eps)
        round_to_format(hbuf, cfmt)
        t = lap(timers, K_RMSNORM, t)
        gemm_at(gu, hbuf, f32, u16, layers[layer, COL_GATE_UP], H, 2 * INTER,
                layers[layer, COL_GATE_UP_FMT], cfmt)
        t = lap(timers, K_GATE_UP, t)
        swiglu(act, gu)
        round_to_format(act, cfmt)
        t = lap(timers, K_SWIGLU, t)
        gemm_at(y, act, f32, u16, layers[layer, COL_DOWN], INTER, H,
                layers[layer, COL_DOWN_FMT], cfmt)
        t = lap(timers, K_DOWN, t)
        residual_add(x, y, res_mult)
        t = lap(timers, K_RESIDUAL, t)

    # ---- logits only for the rows that need them
    norm = f32_at(f32, table[A_NORM], H)
    _gather_rows(hsel, x, logit_rows)
    rmsnorm(hn, hsel, norm, eps)
    round_to_format(hn, cfmt)
    gemm_at(logits, hn, f32, u16, table[A_LM_HEAD], H, V, table[S_LM_HEAD_FMT], cfmt)
    lf = logits.reshape(R * V)
    for i in range(R * V):
        lf[i] *= inv_logit_scale
    t = lap(timers, K_LM_HEAD, t)
    if R > S:
        log_softmax(lsm, logits)          # every token row asked for (prompt logprobs, debug)
    t = lap(timers, K_LOG_SOFTMAX, t)

    # ---- penalty state: this step's tokens (from-device ones included) counted into the
    # slots, then sampling rows 0..NS-1: logit bias, penalties, bans, grammar masks,
    # temperature, filters, a draw; raw logprobs, top-K
    count_tokens(pen_counts, pen_prompt, count_slot, prompt_lens, query_start, positions, tokens)
    sampled = _i32(i32, table, A_SAMPLED, NS)
    logprob = _f32(f32, table, A_LOGPROB, NS)
    top_ids = _i32(i32, table, A_TOP_IDS, NS * K).reshape(NS, K)
    top_lp = _f32(f32, table, A_TOP_LOGPROBS, NS * K).reshape(NS, K)
    if NS > 0:
        sample_with_state(sampled, logprob, top_ids, top_lp, logits[:NS], temperature[:NS],
                          top_k[:NS], top_p[:NS], min_p[:NS], seeds[:NS], counters[:NS],
                          presence[:NS], frequency[:NS], repetition[:NS], pen_slot[:NS],
                          pen_counts, pen_prompt, ban_start[:NS + 1], ban_ids, mask_row[:NS],
                          mask_words, bias_start[:NS + 1], bias_ids, bias)
    lap(timers, K_SAMPLING, t)
