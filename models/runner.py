"""ModelRunner: a list of SeqWork in, one program launch, a StepOutput back.

The runner owns the device memory a step needs, planned once: one workspace shared by
every bucket (sized for the largest), the input and output buffers, and the paged KV
cache (from what is left). `launch` turns the work into host arrays, copies them to the
card, and launches the program of the smallest (token, sequence) bucket that fits, all on
one compute stream; it returns a handle at once. `handle.result()` waits for the step's
readback. Launches are FIFO on the stream, so the host builds step N+1 while the card runs
step N; decode tokens marked `from_device` are read on the card from step N's samples.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass

import numba
import numpy as np

from device import Card, DeviceTensor, Program, Slot
from models.kv_cache import KVCache
from models.step_io import SeqWork, StepOutput
from models.step_program import (
    KMAX,
    SLOTS,
    in_i32_size,
    step_entry,
    workspace_floats,
    workspace_offsets,
)
from models.threads import attention_threads, layer_weight_bytes, set_step_threads, step_threads
from models.weights import build_layer_table


def _buckets(limit: int) -> list[int]:
    """Powers of two below `limit`, and `limit` itself."""
    out, b = [], 1
    while b < limit:
        out.append(b)
        b *= 2
    out.append(limit)
    return out


def _bucket(buckets: list[int], n: int) -> int:
    return buckets[bisect.bisect_left(buckets, n)]


class StepHandle:
    """A launched step. `result()` waits for its readback and returns the StepOutput."""

    __slots__ = ("_runner", "_launch", "_meta", "_out")

    def __init__(self, runner, launch, meta):
        self._runner = runner
        self._launch = launch
        self._meta = meta
        self._out: StepOutput | None = None

    def done(self) -> bool:
        return self._launch.done()

    @property
    def bucket(self) -> tuple[int, int]:
        """(tokens, sequences) of the program this step ran."""
        return self._meta.t_bucket, self._meta.s_bucket

    def result(self) -> StepOutput:
        if self._out is None:
            self._launch.wait()
            self._out = self._runner._finish(self._meta)
        return self._out


@dataclass(slots=True)
class _Meta:
    work: list
    s_bucket: int
    t_bucket: int
    row_start: list               # token row of each work item's first token
    sample_seq_ids: list
    k: int
    out_i32: np.ndarray
    out_f32: np.ndarray
    lsm: np.ndarray | None        # [R, V] log-softmax rows (prompt logprobs / debug)
    logits: np.ndarray | None     # [R, V] scaled logits (debug)


class ModelRunner:
    def __init__(self, model, card: Card, max_num_seqs: int = 32, max_num_batched_tokens: int = 512,
                 block_size: int = 64, num_kv_blocks: int | None = None,
                 kv_cache_fraction: float = 0.9, max_model_len: int | None = None,
                 seed: int | None = None):
        cfg = model.config
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs ({max_num_seqs}) and max_num_batched_tokens "
                             f"({max_num_batched_tokens}) must be positive")
        if max_num_seqs > max_num_batched_tokens:
            raise ValueError(f"max_num_seqs ({max_num_seqs}) exceeds max_num_batched_tokens "
                             f"({max_num_batched_tokens}): every sequence needs a token")
        self.model = model
        self.card = card
        self.config = cfg
        self.weights = model.weights
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        self.t_buckets = _buckets(max_num_batched_tokens)
        self.s_buckets = _buckets(max_num_seqs)
        self.tmax = self.t_buckets[-1]
        self.smax = self.s_buckets[-1]
        self.rmax = self.tmax + self.smax          # logit rows when every token row is asked for
        want_len = cfg.max_position_embeddings if max_model_len is None else max_model_len
        self.mbmax = -(-want_len // block_size)    # block-table width
        self.npen_max = self.smax * want_len
        self.nban_max = self.smax * cfg.vocab_size  # banned ids are unique per row
        self._seed = random.randrange(1 << 62) if seed is None else int(seed)

        H, V, I = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size  # noqa: E741
        dims = (self.tmax, self.rmax, self.smax, self.npen_max, H, cfg.q_size, cfg.kv_size, I, V)
        self._ws_offsets = workspace_offsets(*dims)
        allocated: list[DeviceTensor] = []

        def alloc(shape, dtype, zero=False):
            t = card.zeros(shape, dtype) if zero else card.empty(shape, dtype)
            allocated.append(t)
            return t

        try:
            # Planned memory: workspace and I/O first, then the KV cache from what is left.
            self.work = alloc((workspace_floats(*dims),), np.float32, zero=True)
            self.in_i32 = alloc((in_i32_size(self.tmax, self.smax, self.rmax, self.mbmax,
                                             self.npen_max, self.nban_max),), np.int32)
            self.in_f32 = alloc((6 * self.smax,), np.float32)
            self.in_i64 = alloc((2 * self.smax,), np.int64)
            self.out_i32 = [alloc((self.smax * (1 + KMAX),), np.int32, zero=True) for _ in range(2)]
            self.out_f32 = [alloc((self.smax * (1 + KMAX),), np.float32, zero=True) for _ in range(2)]
            self.kv = KVCache(card, cfg, block_size, num_kv_blocks, kv_cache_fraction)
            self.layer_table = build_layer_table(card, self.weights, self.kv.k, self.kv.v)
            allocated.append(self.layer_table)
        except BaseException:
            for t in allocated:
                card.free(t)
            if hasattr(self, "kv"):
                self.kv.free()
            raise
        self._allocated = allocated
        self.num_kv_blocks = self.kv.num_blocks
        self.max_model_len = min(want_len, self.kv.num_tokens)
        self.stream = card.new_stream("compute")
        self.programs: dict[tuple[int, int], Program] = {}
        self._launches = 0
        self._threads = (numba.get_num_threads(),) * 2   # (Numba, BLAS) of the compute stream
        self._layer_bytes = layer_weight_bytes(self.weights)
        self._last_rows: dict[int, int] = {}       # seq_id -> sample row in the previous launch
        self._pending_plp: dict[int, np.ndarray] = {}  # seq_id -> last prompt row's log-softmax
        self._static = {
            "TMAX": self.tmax, "RMAX": self.rmax, "H": H, "HQ": cfg.num_attention_heads,
            "HKV": cfg.num_key_value_heads, "D": cfg.head_dim, "I": I, "V": V,
            "L": cfg.num_hidden_layers, "NBT": self.kv.num_blocks + 1, "BS": block_size,
            "TIED": int(self.weights.tied),
            "embed": self.weights.embed, "norm": self.weights.norm,
            "lm_head": self.weights.lm_head, "inv_freq": self.weights.inv_freq,
            "consts": self.weights.consts, "layers": self.layer_table, "work": self.work,
            "in_i32": self.in_i32, "in_f32": self.in_f32, "in_i64": self.in_i64,
        }

    def step_threads(self, t: int) -> tuple[int, int]:
        """(Numba threads, BLAS threads) for a step of bucket size t."""
        return step_threads(t, self._layer_bytes)

    @property
    def scratch_bytes(self) -> int:
        """Device bytes of the step workspace, I/O buffers and layer table (KV cache not included)."""
        return sum(t.nbytes for t in self._allocated)

    @property
    def memory_plan(self) -> dict[str, int]:
        """Device bytes the runner planned, by use: 'workspace' (one step's activations, for
        the largest bucket), 'io' (input and output buffers), 'layer_table', 'kv_cache'.
        The first three add up to scratch_bytes; the weights belong to the model."""
        io = [self.in_i32, self.in_f32, self.in_i64, *self.out_i32, *self.out_f32]
        return {"workspace": self.work.nbytes, "io": sum(t.nbytes for t in io),
                "layer_table": self.layer_table.nbytes, "kv_cache": self.kv.nbytes}

    # ---- programs -------------------------------------------------------------------
    def bucket_shapes(self) -> list[tuple[int, int]]:
        """Every (tokens, sequences) bucket: sequences never exceed tokens."""
        return [(t, s) for t in self.t_buckets for s in self.s_buckets if s <= t]

    def _program(self, t: int, s: int) -> Program:
        prog = self.programs.get((t, s))
        if prog is None:
            prog = Program(self.card, name=f"step_t{t}_s{s}", entry=step_entry,
                           slots=[Slot(n, k) for n, k in SLOTS], scratch_bytes=0,
                           shapes={"T": t, "S": s, "H": self.config.hidden_size,
                                   "V": self.config.vocab_size})
            prog.prepare()
            prog.bind(self._static)
            self.programs[(t, s)] = prog
        return prog

    def warmup(self, progress: bool = True) -> None:
        """Compile (or load from Numba's disk cache) and prepare every bucket's program, and
        run each token bucket once on a batch of padding (pages in the workspace, starts the
        thread pools), so that serving never compiles. Every bucket shares one compiled entry."""
        import sys

        from tqdm import tqdm

        shapes = self.bucket_shapes()
        # A terminal gets a live bar; a log file (docker logs, CI) a line at the start and
        # one at the end instead of a redraw per program.
        bar = tqdm(shapes, desc="preparing step programs", unit="program", disable=not progress,
                   mininterval=0.1 if sys.stderr.isatty() else 3600.0)
        for t, s in bar:
            bar.set_postfix_str(f"tokens {t} seqs {s}", refresh=False)
            self._program(t, s)
            if s == max(x for x in self.s_buckets if x <= t):   # once per token bucket
                self._launch_padding(t, s).result()

    def _launch_padding(self, t: int, s: int) -> StepHandle:
        """A launch of bucket (t, s) with no real rows: exercises the program, touches no KV block."""
        return self._launch_arrays(t, s, [], return_rows=False, return_logits=False)

    # ---- a step ---------------------------------------------------------------------
    def launch(self, work: list[SeqWork], return_logits: bool = False) -> StepHandle:
        """Launch one step for `work`; returns at once. Results come from `handle.result()`."""
        if not work:
            raise ValueError("launch: empty work list")
        if len(work) > self.max_num_seqs:
            raise ValueError(f"launch: {len(work)} sequences exceed max_num_seqs {self.max_num_seqs}")
        n_tok = 0
        for w in work:
            n_tok += self._check(w)
        if n_tok > self.max_num_batched_tokens:
            raise ValueError(f"launch: {n_tok} tokens exceed max_num_batched_tokens "
                             f"{self.max_num_batched_tokens}")
        t = _bucket(self.t_buckets, n_tok)
        s = _bucket(self.s_buckets, len(work))
        extra = return_logits or any(w.prompt_logprobs for w in work)
        return self._launch_arrays(t, s, work, return_rows=extra, return_logits=return_logits)

    def _check(self, w: SeqWork) -> int:
        n = len(w.token_ids)
        if n < 1:
            raise ValueError(f"seq {w.seq_id}: no tokens to compute")
        end = w.start_pos + n
        if w.start_pos < 0 or end > self.max_model_len:
            raise ValueError(f"seq {w.seq_id}: positions {w.start_pos}..{end - 1} exceed "
                             f"max_model_len {self.max_model_len}")
        need = -(-end // self.block_size)
        if len(w.block_table) < need:
            raise ValueError(f"seq {w.seq_id}: block table has {len(w.block_table)} blocks, "
                             f"{end} tokens need {need} of {self.block_size}")
        used = w.block_table[:need]
        if min(used) < 0 or max(used) >= self.num_kv_blocks:
            raise ValueError(f"seq {w.seq_id}: block ids must be in 0..{self.num_kv_blocks - 1}, "
                             f"got {min(used)}..{max(used)}")
        if w.from_device:
            if n != 1 or w.token_ids[0] != -1:
                raise ValueError(f"seq {w.seq_id}: a from_device decode has token_ids [-1], "
                                 f"got {w.token_ids[:4]}")
            if w.seq_id not in self._last_rows:
                raise ValueError(f"seq {w.seq_id}: from_device, but it did not sample in the "
                                 f"previous launch")
        if w.sample:
            w.sampling.check()
            if w.banned_token_ids:
                lo, hi = min(w.banned_token_ids), max(w.banned_token_ids)
                if lo < 0 or hi >= self.config.vocab_size:
                    raise ValueError(f"seq {w.seq_id}: banned token id {lo if lo < 0 else hi} is "
                                     f"outside the vocabulary ({self.config.vocab_size})")
        return n

    def _seed_of(self, w: SeqWork) -> int:
        if w.sampling.seed is not None:
            return int(w.sampling.seed) & ((1 << 63) - 1)
        return (self._seed * 1_000_003 + w.seq_id * 7_919) & ((1 << 63) - 1)

    def _launch_arrays(self, t: int, s: int, work: list[SeqWork], return_rows: bool,
                       return_logits: bool) -> StepHandle:
        bs = self.block_size
        trash_slot = self.kv.trash_block * bs
        samplers = [w for w in work if w.sample]
        ns = len(samplers)
        r = s + t if return_rows else s
        mb = max([len(w.block_table) for w in work] + [1])
        mb = min(mb, self.mbmax) if work else 1
        pen_lists = []
        for w in samplers:
            sp = w.sampling
            active = (sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0
                      or sp.repetition_penalty != 1.0)
            if active and w.penalty_token_ids:
                ids, counts = np.unique(np.asarray(w.penalty_token_ids, np.int64), return_counts=True)
            else:
                ids = counts = np.zeros(0, np.int64)
            pen_lists.append((ids, counts, active))
        npen = sum(len(p[0]) for p in pen_lists)
        if npen > self.npen_max:
            raise ValueError(f"launch: {npen} penalty tokens exceed the buffer of {self.npen_max}")
        ban_lists = [np.unique(np.asarray(w.banned_token_ids, np.int32)) if w.banned_token_ids
                     else np.zeros(0, np.int32) for w in samplers]
        nban = sum(len(b) for b in ban_lists)           # <= nban_max: unique ids < V per row
        k = max([w.sampling.logprobs for w in work] + [0])

        # ---- int32 inputs, one host buffer in the device layout
        buf = np.zeros(in_i32_size(t, s, r, mb, npen, nban), np.int32)
        # views in the order the step program reads them (see in_i32_size)
        (tokens, positions, slots, src_rows, query_start, context_lens, block_tables, logit_rows,
         top_k, pen_start, pen_extra, pen_ids, pen_counts, ban_start, ban_ids) = np.split(
            buf, np.cumsum([t, t, t, t, s + 1, s, s * mb, r, s, s + 1, s, npen, npen, s + 1])
        )
        block_tables = block_tables.reshape(s, mb)

        slots[:] = trash_slot
        src_rows[:] = -1
        pen_extra[:] = -1
        fbuf = np.zeros(6 * s, np.float32)
        temperature, top_p, min_p = fbuf[0:s], fbuf[s:2 * s], fbuf[2 * s:3 * s]
        presence, frequency, repetition = fbuf[3 * s:4 * s], fbuf[4 * s:5 * s], fbuf[5 * s:6 * s]
        top_p[:] = 1.0
        repetition[:] = 1.0
        ibuf = np.zeros(2 * s, np.int64)
        seeds, counters = ibuf[0:s], ibuf[s:2 * s]

        row = 0
        row_start = []
        last_rows = self._last_rows
        new_rows: dict[int, int] = {}
        n_sample = 0
        pen_pos = 0
        ban_pos = 0
        for i, w in enumerate(work):
            n = len(w.token_ids)
            end = w.start_pos + n
            row_start.append(row)
            if w.from_device:
                src_rows[row] = last_rows[w.seq_id]
            else:
                tokens[row:row + n] = w.token_ids
            pos = np.arange(w.start_pos, end, dtype=np.int32)
            positions[row:row + n] = pos
            bt = np.asarray(w.block_table, dtype=np.int32)
            slots[row:row + n] = bt[pos // bs] * bs + pos % bs
            query_start[i] = row
            context_lens[i] = end
            block_tables[i, :len(bt)] = bt[:mb]
            row += n
            if w.sample:
                j = n_sample
                sp = w.sampling
                logit_rows[j] = row - 1
                top_k[j] = sp.top_k
                temperature[j] = sp.temperature
                top_p[j] = sp.top_p
                min_p[j] = sp.min_p
                presence[j] = sp.presence_penalty
                frequency[j] = sp.frequency_penalty
                repetition[j] = sp.repetition_penalty
                seeds[j] = self._seed_of(w)
                counters[j] = w.num_generated
                ids, cnts, active = pen_lists[j]
                pen_start[j] = pen_pos
                pen_ids[pen_pos:pen_pos + len(ids)] = ids
                pen_counts[pen_pos:pen_pos + len(ids)] = cnts
                pen_pos += len(ids)
                ban = ban_lists[j]
                ban_start[j] = ban_pos
                ban_ids[ban_pos:ban_pos + len(ban)] = ban
                ban_pos += len(ban)
                if w.from_device and active:
                    pen_extra[j] = row - 1        # the device counts the token it reads
                new_rows[w.seq_id] = j
                n_sample += 1
        query_start[len(work):] = row
        pen_start[n_sample:] = pen_pos
        ban_start[n_sample:] = ban_pos
        if return_rows:
            logit_rows[s:s + t] = np.arange(t, dtype=np.int32)
        if npen and (pen_ids.min() < 0 or pen_ids.max() >= self.config.vocab_size):
            raise ValueError(f"launch: a penalty token id is outside the vocabulary "
                             f"({self.config.vocab_size})")
        if work and (tokens.min() < 0 or tokens.max() >= self.config.vocab_size):
            bad = int(tokens.min()) if tokens.min() < 0 else int(tokens.max())
            raise ValueError(f"launch: token id {bad} is outside the vocabulary "
                             f"({self.config.vocab_size})")

        # ---- copy in, launch, read back (all FIFO on the compute stream)
        card, stream = self.card, self.stream
        stream.copy_h2d(DeviceTensor(self.in_i32.address, buf.shape, np.int32, card), buf)
        stream.copy_h2d(DeviceTensor(self.in_f32.address, fbuf.shape, np.float32, card), fbuf)
        stream.copy_h2d(DeviceTensor(self.in_i64.address, ibuf.shape, np.int64, card), ibuf)
        parity = self._launches & 1
        out_i32_dev, out_f32_dev = self.out_i32[parity], self.out_f32[parity]
        n_out = s * (1 + KMAX)
        out_i32 = np.empty(n_out, np.int32)
        out_f32 = np.empty(n_out, np.float32)
        readback = [(out_i32, DeviceTensor(out_i32_dev.address, (n_out,), np.int32, card)),
                    (out_f32, DeviceTensor(out_f32_dev.address, (n_out,), np.float32, card))]
        V = self.config.vocab_size
        lsm = logits = None
        if return_rows:
            lsm = np.empty((r, V), np.float32)
            readback.append((lsm, self._ws_view("lsm", r * V)))
            if return_logits:
                logits = np.empty((r, V), np.float32)
                readback.append((logits, self._ws_view("logits", r * V)))
        want = self.step_threads(t)
        attn_flops = 4 * self.config.num_attention_heads * self.config.head_dim * int(
            np.dot(context_lens.astype(np.int64), np.diff(query_start).astype(np.int64)))
        bindings = {"T": t, "S": s, "R": r, "NS": ns, "MB": mb, "K": k, "NPEN": npen,
                    "NBAN": nban, "ATHR": attention_threads(want[0], attn_flops),
                    "prev_out_i32": self.out_i32[parity ^ 1], "out_i32": out_i32_dev,
                    "out_f32": out_f32_dev}
        if want != self._threads:                # per-thread setting: set it on the stream's thread
            stream.enqueue(set_step_threads, *want, compute=False, label="set_step_threads")
            self._threads = want
        handle = self._program(t, s).launch(stream, bindings, readback=readback)
        self._launches += 1
        self._last_rows = new_rows
        meta = _Meta(work=work, s_bucket=s, t_bucket=t, row_start=row_start,
                     sample_seq_ids=[w.seq_id for w in samplers], k=k, out_i32=out_i32,
                     out_f32=out_f32, lsm=lsm, logits=logits)
        return StepHandle(self, handle, meta)

    def _ws_view(self, name: str, n: int) -> DeviceTensor:
        return DeviceTensor(self.work.address + 4 * self._ws_offsets[name], (n,), np.float32,
                            self.card)

    def _finish(self, m: _Meta) -> StepOutput:
        s, k = m.s_bucket, m.k
        ns = len(m.sample_seq_ids)
        top_ids = m.out_i32[s:s + ns * k].reshape(ns, k).copy()
        top_lp = m.out_f32[s:s + ns * k].reshape(ns, k).copy()
        out = StepOutput(seq_ids=m.sample_seq_ids, token_ids=m.out_i32[:ns].copy(),
                         logprobs=m.out_f32[:ns].copy(), top_ids=top_ids, top_logprobs=top_lp)
        if m.lsm is not None:
            for w, r0 in zip(m.work, m.row_start, strict=True):
                if w.prompt_logprobs:
                    out.prompt_logprobs[w.seq_id] = self._prompt_logprobs(w, m.lsm, s + r0)
            if m.logits is not None:
                out.logits = {w.seq_id: m.logits[s + r0:s + r0 + len(w.token_ids)].copy()
                              for w, r0 in zip(m.work, m.row_start, strict=True)}
        return out

    def _prompt_logprobs(self, w: SeqWork, lsm: np.ndarray, r0: int):
        n = len(w.token_ids)
        k = w.sampling.logprobs
        rows, targets = [], []
        prev = self._pending_plp.pop(w.seq_id, None)
        if prev is not None and w.start_pos > 0:
            rows.append(prev)
            targets.append(w.token_ids[0])
        for j in range(n - 1):
            rows.append(lsm[r0 + j])
            targets.append(w.token_ids[j + 1])
        if not w.sample:
            self._pending_plp[w.seq_id] = lsm[r0 + n - 1].copy()
        if not rows:
            return (np.zeros(0, np.float32), np.zeros((0, k), np.int32), np.zeros((0, k), np.float32))
        mat = np.stack(rows)                                       # [n', V]
        idx = np.asarray(targets, dtype=np.int64)
        lp = mat[np.arange(len(idx)), idx].astype(np.float32)
        if k:
            part = np.argpartition(-mat, k - 1, axis=1)[:, :k]
            order = np.argsort(-np.take_along_axis(mat, part, axis=1), axis=1, kind="stable")
            tid = np.take_along_axis(part, order, axis=1).astype(np.int32)
            tlp = np.take_along_axis(mat, tid, axis=1).astype(np.float32)
        else:
            tid, tlp = np.zeros((len(idx), 0), np.int32), np.zeros((len(idx), 0), np.float32)
        return lp, tid, tlp

    def forget(self, seq_id: int) -> None:
        """Drop what the runner keeps for a sequence between steps (a stashed prompt-logprob
        row of an unfinished prefill); call it when a sequence ends or is aborted."""
        self._pending_plp.pop(seq_id, None)

    # ---- lifetime -------------------------------------------------------------------
    def close(self) -> None:
        """Wait for the stream, then give the programs, buffers and KV cache back to the card."""
        self.stream.synchronize()
        for prog in self.programs.values():
            prog.release()
        self.programs.clear()
        for t in self._allocated:
            self.card.free(t)
        self._allocated = []
        self.kv.free()
