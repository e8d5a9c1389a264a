"""Tensor parallelism: one model over ``tp`` emulated cards, as the vLLM Spyre plugin runs it.

Each card has its own arena, allocator and compute stream (a ``ModelRunner`` of its shard:
models/parallel/shards.py) and a share of the host's cores (its stream's Numba threads). A step is
packed once per card and launched on every card as the step program's parts (its H0/H1 slots):
half a layer at a time, each half's row-parallel output summed over the cards (an all-reduce)
before the next half adds it to the residual stream, then the head (each card its vocabulary
shard of the logits), an all-gather of the logits, and sampling (every card samples the same
rows with the same seeds, so each keeps the samples its next step reads for from-device
decodes). Each card's launch is one command on its stream (`Program.launch_parts`: the parts'
H0/H1 patched into its table in place); between parts the cards' streams meet at a barrier
whose last arrival runs the collective. Card 0's samples are read back; a failure on any card
fails the step's result (it breaks the barrier, so no card waits for it).
"""

from __future__ import annotations

import os
import threading

from spyre_serve.device import Card
from spyre_serve.device.card import share_cores
from spyre_serve.models.checkpoints.hf import load_checkpoint, stored_width
from spyre_serve.models.checkpoints.loader import LoadedModel, tokenizer_of
from spyre_serve.models.config import GraniteConfig
from spyre_serve.models.parallel.shards import shard_tensors, vocab_shard
from spyre_serve.models.sizing.projection import StepProjector, step_of_work
from spyre_serve.models.step.buckets import bucket
from spyre_serve.models.step.inputs import check_work
from spyre_serve.models.step.interface import SeqWork, SeqWorkError
from spyre_serve.models.step.runner import ModelRunner, StepHandle
from spyre_serve.models.step.weights import place_weights

BARRIER_SECONDS = 600.0   # a card that never reaches a collective fails the step after this


def load_sharded(path, cards: list[Card], dtype: str = "float32", name: str | None = None,
                 tokenizer: bool = True) -> tuple[GraniteConfig, list[LoadedModel]]:
    """The checkpoint at ``path`` read once: its whole config, and each card's shard placed on
    it (float widths); ``tokenizer=False`` skips the tokenizer (tests)."""
    ckpt = load_checkpoint(path)
    stored_dtype = stored_width(ckpt.stored_dtypes.values(), ckpt.config.torch_dtype)
    width = stored_dtype if dtype == "auto" else dtype
    tok = tokenizer_of(path) if tokenizer else None
    models = []
    for rank, card in enumerate(cards):
        cfg, tensors = shard_tensors(ckpt.config, ckpt.tensors, rank, len(cards))
        models.append(LoadedModel(name=name or os.path.basename(os.fspath(path)), path=path, config=cfg,
                                  tokenizer=tok, weights=place_weights(card, cfg, tensors, width),
                                  stored_dtype=stored_dtype))
    return ckpt.config, models


class _Exchange:
    """The cards' meeting points within one step: after part k (while k is below the number of
    collectives) every card's stream waits at a barrier whose last arrival runs collective k
    (an all-reduce, then the logits' all-gather). A card that fails breaks the barrier, so the
    others fail the step too instead of waiting for it."""

    def __init__(self, cards: int, collectives: list):
        self.collectives = collectives
        self.done = 0
        self.barrier = threading.Barrier(cards, action=self._run)

    def _run(self) -> None:
        self.collectives[self.done]()
        self.done += 1

    def between(self, k: int) -> None:
        if k < len(self.collectives):
            self.barrier.wait(timeout=BARRIER_SECONDS)

    def abort(self) -> None:
        self.barrier.abort()


class _AllCards:
    """The launch of a step over every card: card 0's, read back, and each other card's,
    whose failures fail the step."""

    __slots__ = ("first", "ends")

    def __init__(self, first, ends):
        self.first, self.ends = first, ends

    def wait(self) -> None:
        """Wait for every card; raise a card's own failure before the broken barrier it left
        the others with."""
        errors = []
        for wait in [self.first.wait, *(end.synchronize for end in self.ends)]:
            try:
                wait()
            except Exception as exc:         # noqa: BLE001  (each card's, compared below)
                errors.append(exc)
        if errors:
            raise next((e for e in errors if "BrokenBarrierError" not in repr(e)), errors[0])

    def done(self) -> bool:
        return self.first.done() and all(e.query() for e in self.ends)


class TensorParallelRunner:
    """What the engine reads of a runner (server/engine/seams.py), over ``len(models)`` cards."""

    def __init__(self, models: list[LoadedModel], cards: list[Card], full_config, **sizes):
        if len(models) != len(cards) or len(cards) < 2:
            raise ValueError(f"tensor parallelism takes 2 or more cards and a shard each, got {len(cards)} "
                             f"cards and {len(models)} shards")
        self.tp = len(cards)
        self.cards = cards
        self.full_config = full_config
        self.runners = [ModelRunner(m, c, **sizes) for m, c in zip(models, cards, strict=True)]
        r0 = self.runners[0]
        self.config, self.block_size, self.max_model_len = r0.config, r0.block_size, r0.max_model_len
        self.num_kv_blocks = min(r.num_kv_blocks for r in self.runners)
        self.t_buckets, self.s_buckets = r0.t_buckets, r0.s_buckets
        self.compute_dtype, self.kv_cache_dtype, self.pooling = r0.compute_dtype, r0.kv_cache_dtype, None
        self.numerics = f"{r0.numerics},tp={self.tp}"
        self.projector = StepProjector.of_weights(full_config, r0.weights, r0.kv_cache_dtype, tp=self.tp)
        for r in self.runners:
            share_cores(r.stream, self.tp)   # each card its share of the host's cores
        self._halves = 2 * full_config.num_hidden_layers

    # ---- what the engine and the CLI read ---------------------------------------------
    @property
    def memory_plan(self) -> dict[str, int]:
        return self.runners[0].memory_plan

    @property
    def programs(self) -> dict:
        return self.runners[0].programs

    def bucket_shapes(self) -> list[tuple[int, int]]:
        return self.runners[0].bucket_shapes()

    def warmup(self, progress: bool = True) -> None:
        for r in self.runners:
            r.warmup(progress)

    def forget(self, seq_id: int) -> None:
        for r in self.runners:
            r.forget(seq_id)

    def held(self) -> dict[str, int]:
        return self.runners[0].held()

    def close(self) -> None:
        for r in self.runners:
            r.close()

    # ---- a step ------------------------------------------------------------------------
    def launch(self, work: list[SeqWork], return_logits: bool = False) -> StepHandle:
        """Launch one step on every card; returns at once (see the module docstring)."""
        r0 = self.runners[0]
        n_tok = check_work(work, r0.limits, r0._last_rows)
        pooled = [w.seq_id for w in work if w.pool]
        if pooled:
            raise SeqWorkError({sid: f"seq {sid}: pooling runs on one card" for sid in pooled})
        pens = [r._pen_slots.assign(work) for r in self.runners]
        t, s = bucket(self.t_buckets, n_tok), bucket(self.s_buckets, len(work))
        preps = [r.prepare_launch(t, s, work, return_logits, return_logits, pen)
                 for r, pen in zip(self.runners, pens, strict=True)]
        rows = preps[0][0].packed.dims["R"]
        # the cards compute the step's own rows only (models/step/program.py): sum those
        ys = [r.memory.workspace_field("y", n_tok * self.config.hidden_size) for r in self.runners]
        logits = self._logit_views(rows)
        exchange = _Exchange(self.tp, [lambda: _sum_over_cards(ys)] * self._halves
                             + [lambda: _gather_logits(logits)])
        parts = [{"H0": h, "H1": h + 1} for h in range(self._halves + 2)]
        launched = [r._programs.get(t, s).launch_parts(r.stream, bindings, parts, exchange.between, exchange.abort,
                                                         readback=readback if rank == 0 else ())
                    for rank, (r, (_, bindings, readback)) in enumerate(zip(self.runners, preps, strict=True))]
        return StepHandle(_AllCards(launched[0], [h.event for h in launched[1:]]), preps[0][0],
                          r0._prompt_logprobs, self.projector.seconds(step_of_work(work)))

    def _logit_views(self, rows: int) -> list:
        """Per card: (its [rows, VS] head output in `lsm`, its whole [rows, V] logits, its
        vocabulary columns)."""
        v = self.config.vocab_size
        out = []
        for rank, r in enumerate(self.runners):
            v0, v1 = vocab_shard(v, rank, self.tp)
            out.append((r.memory.workspace_field("lsm", rows * (v1 - v0)), r.memory.workspace_field("logits", rows * v),
                        v0, v1, rows))
        return out


def _sum_over_cards(tensors) -> None:
    """All-reduce: every card's tensor becomes the sum over the cards (in card order)."""
    views = [t.numpy() for t in tensors]
    total = views[0].copy()
    for v in views[1:]:
        total += v
    for v in views:
        v[:] = total


def _gather_logits(cards) -> None:
    """All-gather: every card's whole logits from each card's vocabulary shard."""
    for shard, _, v0, v1, rows in cards:
        part = shard.numpy().reshape(rows, v1 - v0)
        for _, logits, _, _, _ in cards:
            logits.numpy().reshape(rows, -1)[:, v0:v1] = part
