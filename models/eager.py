"""The eager baseline: the same model run op by op, as the old stack did.

What one `EagerModel.step(work)` does, in order:
  - builds the step's host arrays (tokens, positions, slot mapping, query starts, context
    lengths, block tables, logit rows), allocates a device tensor for each and copies it in
    (one H2D command each);
  - for every op of the model (embedding; per layer rmsnorm, QKV GEMM, split, RoPE of q and
    of k, KV write, paged attention, O GEMM, residual add, rmsnorm, gate/up GEMM, SwiGLU,
    down GEMM, residual add; then row gather, final rmsnorm, LM head GEMM, logit scaling and
    greedy sampling): allocates the op's output on the card, builds a new `device.Program`
    for that one kernel and prepares it (a new operand table region on the card each time;
    there is no cache of prepared programs), and launches it (its own job plan: write the
    operand blob, copy it into the region, run the kernel) on the eager stream;
  - synchronizes the stream once at the end of the step, reads the sampled tokens back, and
    releases every program and intermediate it made.

The kernels are the ones the step program calls, with the same float32 constants (read on
the device from the model's constants), so the tokens equal the program path's. Each op's
entry is compiled by Numba once per process (in the constructor, from Numba's disk cache
when it has it): a real old stack would also recompile, which is not emulated here, so this
baseline is if anything faster than the stack it stands for. The host loops over layers and
ops in Python. Greedy only. It exists to be measured against (benchmarks/model.py), not to
serve: the program path (models.step.runner) is what the server uses.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from spyre_serve.device import Card, DeviceTensor, Program, Slot
from spyre_serve.device.abi import ENTRY_ARGS, f32_at, i32_at, i64_at
from spyre_serve.device.kernels.activation import swiglu
from spyre_serve.device.kernels.attention.paged import paged_attention, write_kv
from spyre_serve.device.kernels.gather import gather_columns_at, gather_rows
from spyre_serve.device.kernels.gemm.packed import gemm_at
from spyre_serve.device.kernels.norm import rmsnorm
from spyre_serve.device.kernels.residual import residual_add
from spyre_serve.device.kernels.rope import rope_inplace
from spyre_serve.device.kernels.sampling import sample_rows
from spyre_serve.models.step.interface import SeqWork
from spyre_serve.models.step.kv_cache import KVCache
from spyre_serve.models.step.program import (
    CONST_ATTN_SCALE,
    CONST_EMB_MULT,
    CONST_EPS,
    CONST_INV_LOGIT_SCALE,
    CONST_RES_MULT,
    N_CONSTS,
    SAMPLE_ROW,
)
from spyre_serve.models.step.threads import use_every_core
from spyre_serve.models.step.weights import compute_code, resolve_compute_dtype

# ---- one entry per op, with the device ABI: table slots in the order of the bindings ----


@njit(nogil=True, cache=True)
def op_embedding(f32, i32, i64, u16, t):
    # out, embed (E.T packed), ids, consts | T, H, V, WFMT
    n, h, v, wfmt = t[4], t[5], t[6], t[7]
    gather_columns_at(f32_at(f32, t[0], n * h).reshape(n, h), f32, u16, t[1],
                      i32_at(i32, t[2], n), f32_at(f32, t[3], N_CONSTS)[CONST_EMB_MULT], h, v, wfmt)


@njit(nogil=True, cache=True)
def op_rmsnorm(f32, i32, i64, u16, t):
    # out, x, w, consts | M, H
    m, h = t[4], t[5]
    rmsnorm(f32_at(f32, t[0], m * h).reshape(m, h), f32_at(f32, t[1], m * h).reshape(m, h),
            f32_at(f32, t[2], h), f32_at(f32, t[3], N_CONSTS)[CONST_EPS])


@njit(nogil=True, cache=True)
def op_gemm(f32, i32, i64, u16, t):
    # out, a, w (packed) | M, K, N, WFMT, CFMT   (the GEMM rounds a's values to CFMT)
    m, k, n, wfmt, cfmt = t[3], t[4], t[5], t[6], t[7]
    a = f32_at(f32, t[1], m * k).reshape(m, k)
    gemm_at(f32_at(f32, t[0], m * n).reshape(m, n), a, f32, u16, t[2], k, n, wfmt, cfmt)


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
def op_split_qkv(f32, i32, i64, u16, t):
    # q, k, v, qkv | T, QD, KD
    n, qd, kd = t[4], t[5], t[6]
    _split_qkv(f32_at(f32, t[0], n * qd).reshape(n, qd), f32_at(f32, t[1], n * kd).reshape(n, kd),
               f32_at(f32, t[2], n * kd).reshape(n, kd),
               f32_at(f32, t[3], n * (qd + 2 * kd)).reshape(n, qd + 2 * kd), qd, kd)


@njit(nogil=True, cache=True)
def op_rope(f32, i32, i64, u16, t):
    # x, positions, inv_freq | T, NH, D
    n, nh, d = t[3], t[4], t[5]
    rope_inplace(f32_at(f32, t[0], n * nh * d).reshape(n, nh, d), i32_at(i32, t[1], n),
                 f32_at(f32, t[2], d // 2))


@njit(nogil=True, cache=True)
def op_write_kv(f32, i32, i64, u16, t):
    # k_cache, v_cache, k, v, slots | NB, BS, HKV, D, T
    nb, bs, hkv, d, n = t[5], t[6], t[7], t[8], t[9]
    c = nb * bs * hkv * d
    write_kv(f32_at(f32, t[0], c).reshape(nb, hkv, d, bs), f32_at(f32, t[1], c).reshape(nb, hkv, bs, d),
             f32_at(f32, t[2], n * hkv * d).reshape(n, hkv, d),
             f32_at(f32, t[3], n * hkv * d).reshape(n, hkv, d), i32_at(i32, t[4], n))


@njit(nogil=True, cache=True)
def op_attention(f32, i32, i64, u16, t):
    # out, q, k_cache, v_cache, block_tables, query_start, context_lens, consts
    # | T, HQ, HKV, D, NB, BS, S, MB
    n, hq, hkv, d, nb, bs, s, mb = t[8], t[9], t[10], t[11], t[12], t[13], t[14], t[15]
    c = nb * bs * hkv * d
    paged_attention(f32_at(f32, t[0], n * hq * d).reshape(n, hq, d),
                    f32_at(f32, t[1], n * hq * d).reshape(n, hq, d),
                    f32_at(f32, t[2], c).reshape(nb, hkv, d, bs),
                    f32_at(f32, t[3], c).reshape(nb, hkv, bs, d),
                    i32_at(i32, t[4], s * mb).reshape(s, mb), i32_at(i32, t[5], s + 1),
                    i32_at(i32, t[6], s), f32_at(f32, t[7], N_CONSTS)[CONST_ATTN_SCALE])


@njit(nogil=True, cache=True)
def op_residual_add(f32, i32, i64, u16, t):
    # x, y, consts | N   (x += residual_multiplier * y)
    n = t[3]
    residual_add(f32_at(f32, t[0], n), f32_at(f32, t[1], n), f32_at(f32, t[2], N_CONSTS)[CONST_RES_MULT])


@njit(nogil=True, cache=True)
def op_swiglu(f32, i32, i64, u16, t):
    # out, gate_up | T, I
    n, i = t[2], t[3]
    swiglu(f32_at(f32, t[0], n * i).reshape(n, i), f32_at(f32, t[1], n * 2 * i).reshape(n, 2 * i))


@njit(nogil=True, cache=True)
def op_gather_rows(f32, i32, i64, u16, t):
    # out, x, rows | R, T, H
    r, n, h = t[3], t[4], t[5]
    gather_rows(f32_at(f32, t[0], r * h).reshape(r, h), f32_at(f32, t[1], n * h).reshape(n, h),
                 i32_at(i32, t[2], r))


@njit(nogil=True, cache=True)
def op_scale_logits(f32, i32, i64, u16, t):
    # logits, consts | N   (logits /= logits_scaling, as the step program does)
    n = t[2]
    x = f32_at(f32, t[0], n)
    s = f32_at(f32, t[1], N_CONSTS)[CONST_INV_LOGIT_SCALE]
    for i in range(n):
        x[i] *= s


_ROW_DTYPE, _ROW_WORDS = SAMPLE_ROW.dtype, SAMPLE_ROW.words


@njit(nogil=True, cache=True)
def op_sample_greedy(f32, i32, i64, u16, t):
    # out_ids, out_logprobs, logits, rows (SAMPLE_ROW[R] records), zeros (int32[R+1]) | R, V
    r, v = t[5], t[6]
    zeros = i32_at(i32, t[4], r + 1)
    none_i = zeros[:0]
    none_f = f32_at(f32, t[1], 0)
    sample_rows(i32_at(i32, t[0], r), f32_at(f32, t[1], r), none_i.reshape(r, 0),
                none_f.reshape(r, 0), f32_at(f32, t[2], r * v).reshape(r, v),
                i64_at(i64, t[3], r * _ROW_WORDS).view(_ROW_DTYPE), none_i.reshape(0, v),
                none_i.reshape(0, v), zeros, none_i, none_i.reshape(0, (v + 31) // 32), zeros,
                none_i, none_f)


OPS = (op_embedding, op_rmsnorm, op_gemm, op_split_qkv, op_rope, op_write_kv,
       op_attention, op_residual_add, op_swiglu, op_gather_rows, op_scale_logits, op_sample_greedy)


class EagerModel:
    """Greedy steps of `model` on `card`, one freshly prepared program per op, with its own KV cache."""

    def __init__(self, model, card: Card, block_size: int = 64, num_kv_blocks: int = 64,
                 compute_dtype: str = "auto"):
        self.config = model.config
        self.weights = model.weights
        self.cfmt = compute_code(resolve_compute_dtype(compute_dtype, model.weights))
        self.card = card
        self.block_size = block_size
        self.kv = KVCache(card, model.config, block_size, num_kv_blocks)
        self.stream = card.new_stream("eager")
        self.stream.enqueue(use_every_core, compute=False)   # the program path's core policy
        self._live: list[DeviceTensor] = []
        self._programs: list[Program] = []
        for op in OPS:          # Numba's in-process code is reused; see the module docstring
            op.compile(ENTRY_ARGS)

    def _alloc(self, shape, dtype=np.float32) -> DeviceTensor:
        t = self.card.empty(shape, dtype)
        self._live.append(t)
        return t

    def _to_device(self, host: np.ndarray) -> DeviceTensor:
        t = self._alloc(host.shape, host.dtype)
        self.stream.copy_h2d(t, host)
        return t

    def _op(self, entry, **bindings) -> None:
        """Build, prepare and launch a program for this one op (bindings in slot order)."""
        slots = [Slot(n, "address" if isinstance(v, DeviceTensor) else "dim")
                 for n, v in bindings.items()]
        prog = Program(self.card, entry.py_func.__name__, entry, slots)
        prog.prepare()
        self._programs.append(prog)
        prog.launch(self.stream, bindings)

    def step(self, work: list[SeqWork]) -> np.ndarray:
        """One synchronous step; returns the greedy token of each sampling sequence."""
        c, w, bs, op = self.config, self.weights, self.block_size, self._op
        H, HQ, HKV, D, I, V = (c.hidden_size, c.num_attention_heads, c.num_key_value_heads,  # noqa: E741
                               c.head_dim, c.intermediate_size, c.vocab_size)
        QD, KD = HQ * D, HKV * D
        tokens, positions, slots, qs, ctx, rows = [], [], [], [0], [], []
        mb = max(len(x.block_table) for x in work)
        tables = np.zeros((len(work), mb), np.int32)
        for i, x in enumerate(work):
            n = len(x.token_ids)
            pos = np.arange(x.start_pos, x.start_pos + n)
            bt = np.asarray(x.block_table, np.int32)
            tokens += x.token_ids
            positions += pos.tolist()
            slots += (bt[pos // bs] * bs + pos % bs).tolist()
            qs.append(qs[-1] + n)
            ctx.append(x.start_pos + n)
            tables[i, :len(bt)] = bt
            if x.sample:
                rows.append(qs[-1] - 1)
        T, S, R = len(tokens), len(work), len(rows)
        tok = self._to_device(np.asarray(tokens, np.int32))
        pos = self._to_device(np.asarray(positions, np.int32))
        slot = self._to_device(np.asarray(slots, np.int32))
        qstart = self._to_device(np.asarray(qs, np.int32))
        ctxl = self._to_device(np.asarray(ctx, np.int32))
        btab = self._to_device(tables)
        rws = self._to_device(np.asarray(rows, np.int32))
        k = w.consts
        nb = self.kv.k[0].shape[0]              # blocks in each cache tensor (padding block included)

        x = self._alloc((T, H))
        op(op_embedding, out=x, embed=w.embed.tensor, ids=tok, consts=k, T=T, H=H, V=V, WFMT=w.embed.fmt)
        for li, lw in enumerate(w.layers):
            kc, vc = self.kv.k[li], self.kv.v[li]
            h = self._alloc((T, H))
            op(op_rmsnorm, out=h, x=x, w=lw.in_norm, consts=k, M=T, H=H)
            qkv = self._alloc((T, QD + 2 * KD))
            op(op_gemm, out=qkv, a=h, w=lw.qkv.tensor, M=T, K=H, N=QD + 2 * KD, WFMT=lw.qkv.fmt, CFMT=self.cfmt)
            q, kk, v = self._alloc((T, QD)), self._alloc((T, KD)), self._alloc((T, KD))
            op(op_split_qkv, q=q, k=kk, v=v, qkv=qkv, T=T, QD=QD, KD=KD)
            op(op_rope, x=q, positions=pos, inv_freq=w.inv_freq, T=T, NH=HQ, D=D)
            op(op_rope, x=kk, positions=pos, inv_freq=w.inv_freq, T=T, NH=HKV, D=D)
            op(op_write_kv, k_cache=kc, v_cache=vc, k=kk, v=v, slots=slot, NB=nb, BS=bs, HKV=HKV,
               D=D, T=T)
            a = self._alloc((T, QD))
            op(op_attention, out=a, q=q, k_cache=kc, v_cache=vc, block_tables=btab,
               query_start=qstart, context_lens=ctxl, consts=k, T=T, HQ=HQ, HKV=HKV, D=D, NB=nb,
               BS=bs, S=S, MB=mb)
            o = self._alloc((T, H))
            op(op_gemm, out=o, a=a, w=lw.o.tensor, M=T, K=QD, N=H, WFMT=lw.o.fmt, CFMT=self.cfmt)
            op(op_residual_add, x=x, y=o, consts=k, N=T * H)
            h2 = self._alloc((T, H))
            op(op_rmsnorm, out=h2, x=x, w=lw.post_norm, consts=k, M=T, H=H)
            gu = self._alloc((T, 2 * I))
            op(op_gemm, out=gu, a=h2, w=lw.gate_up.tensor, M=T, K=H, N=2 * I, WFMT=lw.gate_up.fmt, CFMT=self.cfmt)
            act = self._alloc((T, I))
            op(op_swiglu, out=act, gate_up=gu, T=T, I=I)
            dn = self._alloc((T, H))
            op(op_gemm, out=dn, a=act, w=lw.down.tensor, M=T, K=I, N=H, WFMT=lw.down.fmt, CFMT=self.cfmt)
            op(op_residual_add, x=x, y=dn, consts=k, N=T * H)
        hs = self._alloc((R, H))
        op(op_gather_rows, out=hs, x=x, rows=rws, R=R, T=T, H=H)
        hn = self._alloc((R, H))
        op(op_rmsnorm, out=hn, x=hs, w=w.norm, consts=k, M=R, H=H)
        logits = self._alloc((R, V))
        op(op_gemm, out=logits, a=hn, w=w.lm_head.tensor, M=R, K=H, N=V, WFMT=w.lm_head.fmt, CFMT=self.cfmt)
        op(op_scale_logits, logits=logits, consts=k, N=R * V)
        # greedy: every row its record's defaults (temperature 0, no penalties, bans or masks)
        rows = np.full(R, SAMPLE_ROW.defaults, SAMPLE_ROW.dtype)
        out_ids, out_lp = self._alloc((R,), np.int32), self._alloc((R,))
        op(op_sample_greedy, out_ids=out_ids, out_logprobs=out_lp, logits=logits,
           rows=self._to_device(rows.view(np.int64)),
           zeros=self._to_device(np.zeros(R + 1, np.int32)), R=R, V=V)
        result = np.empty(R, np.int32)
        self.stream.copy_d2h(result, out_ids)
        self.stream.synchronize()
        for p in self._programs:
            p.release()
        self._programs.clear()
        for t in self._live:
            self.card.free(t)
        self._live.clear()
        return result

    def close(self) -> None:
        self.stream.synchronize()
        self.kv.free()
