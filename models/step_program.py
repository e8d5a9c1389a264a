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
    sample rows 0..NS-1 (penalties, bans, temperature, top-k/p, min-p, seeded draw) with the
    sampled id, its raw logprob and the top-K raw logprobs; rows NS.. only when asked
    (R > S: every token row, for prompt logprobs) get a log-softmax.

Host-side layouts (all offsets in elements, computed identically by `InputLayout`):
    in_i32: tokens[T] positions[T] slots[T] src_rows[T] query_start[S+1] context_lens[S]
            block_tables[S, MB] logit_rows[R] top_k[S] pen_start[S+1] pen_extra[S]
            pen_ids[NPEN] pen_counts[NPEN] ban_start[S+1] ban_ids[NBAN]
    in_f32: temperature[S] top_p[S] min_p[S] presence[S] frequency[S] repetition[S]
    in_i64: seeds[S] counters[S]
    out_i32: sampled[NS] at 0, top_ids[NS, K] at S;  out_f32: logprob[NS] at 0, top_lp[NS, K] at S
"""

from __future__ import annotations

from numba import njit

from device.abi import f32_at, get_kernel_threads, i32_at, i64_at, set_kernel_threads
from device.kernels.activation import swiglu
from device.kernels.attention import paged_attention, write_kv
from device.kernels.embedding import embedding
from device.kernels.gemm import gemm, gemm_bt
from device.kernels.norm import rmsnorm
from device.kernels.residual import residual_add
from device.kernels.rope import rope_inplace
from device.kernels.sampling import sample
from device.kernels.softmax import log_softmax
from models.weights import (
    COL_DOWN,
    COL_GATE_UP,
    COL_IN_NORM,
    COL_K_CACHE,
    COL_O,
    COL_POST_NORM,
    COL_QKV,
    COL_V_CACHE,
    CONST_ATTN_SCALE,
    CONST_EMB_MULT,
    CONST_EPS,
    CONST_INV_LOGIT_SCALE,
    CONST_RES_MULT,
    LAYER_FIELDS,
)

KMAX = 5  # most top logprobs per sampled token (OpenAI's limit for completions)

# (name, kind); the index in this list is the slot's index in the table.
SLOTS = [
    # step shapes
    ("T", "dim"), ("S", "dim"), ("R", "dim"), ("NS", "dim"), ("MB", "dim"), ("K", "dim"),
    ("NPEN", "dim"), ("NBAN", "dim"), ("ATHR", "dim"),
    # workspace capacity and model shapes
    ("TMAX", "dim"), ("RMAX", "dim"), ("H", "dim"), ("HQ", "dim"), ("HKV", "dim"), ("D", "dim"),
    ("I", "dim"), ("V", "dim"), ("L", "dim"), ("NBT", "dim"), ("BS", "dim"), ("TIED", "dim"),
    # model
    ("embed", "address"), ("norm", "address"), ("lm_head", "address"), ("inv_freq", "address"),
    ("consts", "address"), ("layers", "address"),
    # buffers
    ("work", "address"), ("in_i32", "address"), ("in_f32", "address"), ("in_i64", "address"),
    ("prev_out_i32", "address"), ("out_i32", "address"), ("out_f32", "address"),
]
_IX = {name: i for i, (name, _) in enumerate(SLOTS)}
(S_T, S_S, S_R, S_NS, S_MB, S_K, S_NPEN, S_NBAN, S_ATHR, S_TMAX, S_RMAX, S_H, S_HQ, S_HKV, S_D, S_I, S_V, S_L,
 S_NBT, S_BS, S_TIED, A_EMBED, A_NORM, A_LM_HEAD, A_INV_FREQ, A_CONSTS, A_LAYERS, A_WORK,
 A_IN_I32, A_IN_F32, A_IN_I64, A_PREV_OUT, A_OUT_I32, A_OUT_F32) = range(len(SLOTS))


def workspace_offsets(tmax: int, rmax: int, smax: int, npen_max: int, h: int, qd: int, kd: int,
                      inter: int, v: int) -> dict[str, int]:
    """float32 element offsets of the step workspace, in the order `step_entry` lays it out."""
    sizes = [("x", tmax * h), ("hbuf", tmax * h), ("y", tmax * h), ("qkv", tmax * (qd + 2 * kd)),
             ("q", tmax * qd), ("k", tmax * kd), ("v", tmax * kd), ("attn", tmax * qd),
             ("gate_up", tmax * 2 * inter), ("act", tmax * inter), ("hsel", rmax * h),
             ("hn", rmax * h), ("logits", rmax * v), ("lsm", rmax * v),
             ("pen", (smax + 1) + 2 * (npen_max + smax)), ("end", 0)]
    out, o = {}, 0
    for name, n in sizes:
        out[name] = o
        o += n
    return out


def workspace_floats(*dims) -> int:
    """float32 elements of the step workspace (arguments as `workspace_offsets`)."""
    return workspace_offsets(*dims)["end"]


def in_i32_size(t: int, s: int, r: int, mb: int, npen: int, nban: int) -> int:
    return 4 * t + (s + 1) + s + s * mb + r + s + (s + 1) + s + 2 * npen + (s + 1) + nban


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
def _merge_penalties(off_out, ids_out, cnt_out, off_in, ids_in, cnt_in, extra, tokens):
    """Per sampling row n: the host's unique (id, count) list, plus one occurrence of the
    token at row extra[n] (a from-device decode token the host has not seen) if >= 0."""
    o = 0
    for n in range(off_in.shape[0] - 1):
        off_out[n] = o
        a = off_in[n]
        b = off_in[n + 1]
        for i in range(a, b):
            ids_out[o] = ids_in[i]
            cnt_out[o] = cnt_in[i]
            o += 1
        if extra[n] >= 0:
            tok = tokens[extra[n]]
            found = False
            for i in range(off_out[n], o):
                if ids_out[i] == tok:
                    cnt_out[i] += 1
                    found = True
                    break
            if not found:
                ids_out[o] = tok
                cnt_out[o] = 1
                o += 1
    off_out[off_in.shape[0] - 1] = o


@njit(nogil=True, cache=True)
def step_entry(f32, i32, i64, u16, table):
    T = table[S_T]
    S = table[S_S]
    R = table[S_R]
    NS = table[S_NS]
    MB = table[S_MB]
    K = table[S_K]
    NPEN = table[S_NPEN]
    NBAN = table[S_NBAN]
    ATHR = table[S_ATHR]        # > 0: threads for attention only (a step otherwise serial)
    step_thr = get_kernel_threads()
    TMAX = table[S_TMAX]
    RMAX = table[S_RMAX]
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

    consts = f32_at(f32, table[A_CONSTS], 8)
    eps = consts[CONST_EPS]
    emb_mult = consts[CONST_EMB_MULT]
    attn_scale = consts[CONST_ATTN_SCALE]
    res_mult = consts[CONST_RES_MULT]
    inv_logit_scale = consts[CONST_INV_LOGIT_SCALE]

    # ---- inputs
    p = table[A_IN_I32]
    tokens = i32_at(i32, p, T)                                    # [T]
    p += 4 * T
    positions = i32_at(i32, p, T)                                 # [T]
    p += 4 * T
    slot_mapping = i32_at(i32, p, T)                              # [T]
    p += 4 * T
    src_rows = i32_at(i32, p, T)                                  # [T] prev sample row or -1
    p += 4 * T
    query_start = i32_at(i32, p, S + 1)                           # [S+1]
    p += 4 * (S + 1)
    context_lens = i32_at(i32, p, S)                              # [S]
    p += 4 * S
    block_tables = i32_at(i32, p, S * MB).reshape(S, MB)          # [S, MB]
    p += 4 * S * MB
    logit_rows = i32_at(i32, p, R)                                # [R]
    p += 4 * R
    top_k = i32_at(i32, p, S)                                     # [S] per sampling row
    p += 4 * S
    pen_start = i32_at(i32, p, S + 1)                             # [S+1]
    p += 4 * (S + 1)
    pen_extra = i32_at(i32, p, S)                                 # [S] token row also counted, or -1
    p += 4 * S
    pen_ids = i32_at(i32, p, NPEN)                                # [NPEN] unique per row
    p += 4 * NPEN
    pen_counts = i32_at(i32, p, NPEN)                             # [NPEN]
    p += 4 * NPEN
    ban_start = i32_at(i32, p, S + 1)                             # [S+1]
    p += 4 * (S + 1)
    ban_ids = i32_at(i32, p, NBAN)                                # [NBAN] not to sample (min_tokens)

    q = table[A_IN_F32]
    temperature = f32_at(f32, q, S)
    top_p = f32_at(f32, q + 4 * S, S)
    min_p = f32_at(f32, q + 8 * S, S)
    presence = f32_at(f32, q + 12 * S, S)
    frequency = f32_at(f32, q + 16 * S, S)
    repetition = f32_at(f32, q + 20 * S, S)
    seeds = i64_at(i64, table[A_IN_I64], S)
    counters = i64_at(i64, table[A_IN_I64] + 8 * S, S)

    # Decode tokens sampled by the previous launch, read here instead of on the host.
    prev = table[A_PREV_OUT]
    for t in range(T):
        if src_rows[t] >= 0:
            tokens[t] = i32[(prev >> 2) + src_rows[t]]

    # ---- workspace (offsets from the largest bucket, so every bucket shares it)
    w = table[A_WORK]
    x = f32_at(f32, w, T * H).reshape(T, H)                       # residual stream
    w += 4 * TMAX * H
    hbuf = f32_at(f32, w, T * H).reshape(T, H)                    # normed input of a block
    w += 4 * TMAX * H
    y = f32_at(f32, w, T * H).reshape(T, H)                       # o / down projection out
    w += 4 * TMAX * H
    qkv = f32_at(f32, w, T * QKV).reshape(T, QKV)
    w += 4 * TMAX * QKV
    qf = f32_at(f32, w, T * QD).reshape(T, QD)
    w += 4 * TMAX * QD
    kf = f32_at(f32, w, T * KD).reshape(T, KD)
    w += 4 * TMAX * KD
    vf = f32_at(f32, w, T * KD).reshape(T, KD)
    w += 4 * TMAX * KD
    attn = f32_at(f32, w, T * QD).reshape(T, QD)
    w += 4 * TMAX * QD
    gu = f32_at(f32, w, T * 2 * INTER).reshape(T, 2 * INTER)
    w += 4 * TMAX * 2 * INTER
    act = f32_at(f32, w, T * INTER).reshape(T, INTER)
    w += 4 * TMAX * INTER
    hsel = f32_at(f32, w, R * H).reshape(R, H)
    w += 4 * RMAX * H
    hn = f32_at(f32, w, R * H).reshape(R, H)
    w += 4 * RMAX * H
    logits = f32_at(f32, w, R * V).reshape(R, V)
    w += 4 * RMAX * V
    lsm = f32_at(f32, w, R * V).reshape(R, V)                     # only when R > S
    w += 4 * RMAX * V
    pen_off = i32_at(i32, w, NS + 1)                              # penalties incl. device tokens
    w += 4 * (NS + 1)
    pen_ids2 = i32_at(i32, w, NPEN + NS)
    w += 4 * (NPEN + NS)
    pen_cnt2 = i32_at(i32, w, NPEN + NS)

    q3 = qf.reshape(T, HQ, D)
    k3 = kf.reshape(T, HKV, D)
    v3 = vf.reshape(T, HKV, D)
    a3 = attn.reshape(T, HQ, D)

    embed = f32_at(f32, table[A_EMBED], V * H).reshape(V, H)
    inv_freq = f32_at(f32, table[A_INV_FREQ], D // 2)
    layers = i64_at(i64, table[A_LAYERS], L * LAYER_FIELDS).reshape(L, LAYER_FIELDS)

    # ---- the model
    embedding(x, embed, tokens, emb_mult)
    for layer in range(L):
        in_norm = f32_at(f32, layers[layer, COL_IN_NORM], H)
        w_qkv = f32_at(f32, layers[layer, COL_QKV], H * QKV).reshape(H, QKV)
        w_o = f32_at(f32, layers[layer, COL_O], QD * H).reshape(QD, H)
        post_norm = f32_at(f32, layers[layer, COL_POST_NORM], H)
        w_gu = f32_at(f32, layers[layer, COL_GATE_UP], H * 2 * INTER).reshape(H, 2 * INTER)
        w_down = f32_at(f32, layers[layer, COL_DOWN], INTER * H).reshape(INTER, H)
        k_cache = f32_at(f32, layers[layer, COL_K_CACHE], NBT * BS * KD).reshape(NBT, BS, HKV, D)
        v_cache = f32_at(f32, layers[layer, COL_V_CACHE], NBT * BS * KD).reshape(NBT, BS, HKV, D)

        rmsnorm(hbuf, x, in_norm, eps)
        gemm(qkv, hbuf, w_qkv)
        _split_qkv(qf, kf, vf, qkv, QD, KD)
        rope_inplace(q3, positions, inv_freq)
        rope_inplace(k3, positions, inv_freq)
        write_kv(k_cache, v_cache, k3, v3, slot_mapping)
        if ATHR > 0:
            set_kernel_threads(ATHR)
        paged_attention(a3, q3, k_cache, v_cache, block_tables, query_start, context_lens,
                        attn_scale)
        if ATHR > 0:
            set_kernel_threads(step_thr)
        gemm(y, attn, w_o)
        residual_add(x, y, res_mult)
        rmsnorm(hbuf, x, post_norm, eps)
        gemm(gu, hbuf, w_gu)
        swiglu(act, gu)
        gemm(y, act, w_down)
        residual_add(x, y, res_mult)

    # ---- logits only for the rows that need them
    norm = f32_at(f32, table[A_NORM], H)
    _gather_rows(hsel, x, logit_rows)
    rmsnorm(hn, hsel, norm, eps)
    if table[S_TIED] != 0:
        gemm_bt(logits, hn, f32_at(f32, table[A_LM_HEAD], V * H).reshape(V, H))
    else:
        gemm(logits, hn, f32_at(f32, table[A_LM_HEAD], H * V).reshape(H, V))
    lf = logits.reshape(R * V)
    for i in range(R * V):
        lf[i] *= inv_logit_scale
    if R > S:
        log_softmax(lsm, logits)          # every token row asked for (prompt logprobs, debug)

    # ---- sampling rows 0..NS-1: penalties, bans, temperature, filters, a draw; raw logprobs, top-K
    o32 = table[A_OUT_I32]
    of32 = table[A_OUT_F32]
    sampled = i32_at(i32, o32, NS)
    top_ids = i32_at(i32, o32 + 4 * S, NS * K).reshape(NS, K)
    logprob = f32_at(f32, of32, NS)
    top_lp = f32_at(f32, of32 + 4 * S, NS * K).reshape(NS, K)
    if NS > 0:
        _merge_penalties(pen_off, pen_ids2, pen_cnt2, pen_start[:NS + 1], pen_ids, pen_counts,
                         pen_extra[:NS], tokens)
        sample(sampled, logprob, top_ids, top_lp, logits[:NS], temperature[:NS], top_k[:NS],
               top_p[:NS], min_p[:NS], seeds[:NS], counters[:NS], presence[:NS],
               frequency[:NS], repetition[:NS], pen_off, pen_ids2, pen_cnt2, ban_start[:NS + 1],
               ban_ids)
