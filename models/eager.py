"""The eager baseline: the same model run op by op, as the old stack did.

One stream command per kernel (each a Python call that Numba type-dispatches), every
intermediate allocated on the card for its op and freed at the end of the step, the host
looping over layers, and a synchronize after each step. Greedy only. It exists to be
measured against (benchmarks/model.py), not to serve: the program path (models.runner)
is what the server uses.
"""

from __future__ import annotations

import numpy as np

from device import Card, DeviceTensor
from device.kernels.activation import swiglu
from device.kernels.attention import paged_attention, write_kv
from device.kernels.embedding import embedding
from device.kernels.gemm import gemm, gemm_bt
from device.kernels.norm import rmsnorm
from device.kernels.residual import residual_add
from device.kernels.rope import rope_inplace
from device.kernels.sampling import sample
from models.kv_cache import KVCache
from models.runner import SeqWork, layer_weight_bytes, set_step_threads, step_threads
from models.step_program import _gather_rows, _split_qkv


def _scale(x, s):
    x *= np.float32(s)


class EagerModel:
    """Greedy steps of `model` on `card`, one launch per kernel, with its own KV cache."""

    def __init__(self, model, card: Card, block_size: int = 64, num_kv_blocks: int = 64):
        self.config = model.config
        self.weights = model.weights
        self.card = card
        self.block_size = block_size
        self.kv = KVCache(card, model.config, block_size, num_kv_blocks)
        self.stream = card.new_stream("eager")
        self._live: list[DeviceTensor] = []

    def _alloc(self, shape, dtype=np.float32) -> np.ndarray:
        t = self.card.empty(shape, dtype)
        self._live.append(t)
        return t.numpy()

    def _to_device(self, host: np.ndarray) -> np.ndarray:
        t = self.card.empty(host.shape, host.dtype)
        self._live.append(t)
        self.stream.copy_h2d(t, host)
        return t.numpy()

    def step(self, work: list[SeqWork]) -> np.ndarray:
        """One synchronous step; returns the greedy token of each sampling sequence."""
        c, w, bs, launch = self.config, self.weights, self.block_size, self.stream.enqueue
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
        T, R = len(tokens), len(rows)
        # the same core policy as the program path (models.runner.step_threads)
        launch(set_step_threads, *step_threads(T, layer_weight_bytes(w)), compute=False)
        tok = self._to_device(np.asarray(tokens, np.int32))
        pos = self._to_device(np.asarray(positions, np.int32))
        slot = self._to_device(np.asarray(slots, np.int32))
        qstart = self._to_device(np.asarray(qs, np.int32))
        ctxl = self._to_device(np.asarray(ctx, np.int32))
        btab = self._to_device(tables)
        rws = self._to_device(np.asarray(rows, np.int32))
        consts = w.consts.numpy()
        eps, emb_mult, attn_scale, res_mult, inv_ls = (float(v) for v in consts[:5])

        x = self._alloc((T, H))
        launch(embedding, x, w.embed.numpy(), tok, emb_mult)
        inv_freq = w.inv_freq.numpy()
        for li, lw in enumerate(w.layers):
            h = self._alloc((T, H))
            launch(rmsnorm, h, x, lw.in_norm.numpy(), eps)
            qkv = self._alloc((T, QD + 2 * KD))
            launch(gemm, qkv, h, lw.qkv.numpy())
            q, k, v = self._alloc((T, QD)), self._alloc((T, KD)), self._alloc((T, KD))
            launch(_split_qkv, q, k, v, qkv, QD, KD)
            q3, k3, v3 = q.reshape(T, HQ, D), k.reshape(T, HKV, D), v.reshape(T, HKV, D)
            launch(rope_inplace, q3, pos, inv_freq)
            launch(rope_inplace, k3, pos, inv_freq)
            kc = self.kv.k[li].numpy()
            vc = self.kv.v[li].numpy()
            launch(write_kv, kc, vc, k3, v3, slot)
            a = self._alloc((T, HQ, D))
            launch(paged_attention, a, q3, kc, vc, btab, qstart, ctxl, attn_scale)
            o = self._alloc((T, H))
            launch(gemm, o, a.reshape(T, QD), lw.o.numpy())
            launch(residual_add, x, o, res_mult)
            h2 = self._alloc((T, H))
            launch(rmsnorm, h2, x, lw.post_norm.numpy(), eps)
            gu = self._alloc((T, 2 * I))
            launch(gemm, gu, h2, lw.gate_up.numpy())
            act = self._alloc((T, I))
            launch(swiglu, act, gu)
            dn = self._alloc((T, H))
            launch(gemm, dn, act, lw.down.numpy())
            launch(residual_add, x, dn, res_mult)
        hs = self._alloc((R, H))
        launch(_gather_rows, hs, x, rws)
        hn = self._alloc((R, H))
        launch(rmsnorm, hn, hs, w.norm.numpy(), eps)
        logits = self._alloc((R, V))
        if w.tied:
            launch(gemm_bt, logits, hn, w.lm_head.numpy())
        else:
            launch(gemm, logits, hn, w.lm_head.numpy())
        launch(_scale, logits, inv_ls)
        out_t = self.card.empty((R,), np.int32)
        self._live.append(out_t)
        out = out_t.numpy()
        f0, i0 = np.zeros(R, np.float32), np.zeros(R, np.int32)
        launch(sample, out, self._alloc((R,)), self._alloc((R, 0), np.int32), self._alloc((R, 0)),
               logits, f0, i0, np.ones(R, np.float32), f0, np.zeros(R, np.uint64),
               np.zeros(R, np.int64), f0, f0, np.ones(R, np.float32), np.zeros(R + 1, np.int32),
               np.zeros(0, np.int32), np.zeros(0, np.int32))
        result = np.empty(R, np.int32)
        self.stream.copy_d2h(result, out_t)
        self.stream.synchronize()
        for t in self._live:
            self.card.free(t)
        self._live.clear()
        return result

    def close(self) -> None:
        self.stream.synchronize()
        self.kv.free()

