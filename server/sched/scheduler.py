"""Which sequences compute which tokens in the next step.

Policy (the block manager does the accounting):

1. every running sequence that has one token to compute (a decode) gets it, oldest first;
2. running sequences still prefilling get the next chunk of their prompt;
3. waiting sequences are admitted in the queue's order (first come, first served, or by
   priority: ``server/sched/waiting.py``) while the token budget,
   ``max_num_seqs``, the free KV blocks and ``admits`` (a LoRA slot) allow; one from position 0 starts
   instead from the longest prefix of its tokens whose full KV blocks are cached
   (server/sched/block_manager.py), sharing them, unless it asks for prompt logprobs or
   penalties (``GenerationParams.reads_prefix_cache``).

Every launch registers the full blocks it fills in the prefix cache at once (``_take``):
steps run in order on one stream, and within a step every row's KV is written before
any row's attention, so a sequence admitted later in the same step (another choice of
the same request: ``n > 1`` prefills its prompt's full blocks once) or in a later step
reads them as written. When a step fails, what it registered leaves the cache and every
sequence that counted one of those blocks as computed is recomputed from position 0
(``_drop_cached``).

The prefill beside flowing decodes is capped (server/sched/prefill_budget.py).
A step scores at most ``max_scored_tokens_per_step`` prompt tokens (prompt logprobs: each a row
of the vocabulary read back), the chunks of those sequences cut to fit. Under ``--spyre-compat``
(``compat``: server/sched/spyre_compat.py) a step is decodes only or one whole prefill chunk (never cut),
one sequence prefills at a time, admission checks the volume, and prefix hits are whole chunks.

When a running sequence needs a KV block and none is free, the most recently admitted
running sequence not yet in this step is preempted (by priority: the lowest): its blocks are
freed and it goes back to the head of the waiting queue, to be recomputed from its known tokens. The oldest sequence
therefore always makes progress (no starvation), and a request was only admitted if it fits
the whole cache alone (the engine refuses the others up front), so preemption always ends.

The scheduler alone changes a sequence's counters and status: a launch counts its
tokens as computed, its sample as pending and the step as in flight (``_take``); when
the engine reads the step back, ``collected`` turns the pending token into a known one
(``step_failed`` drops it when the step raised, ``undo_launch`` takes back a launch that
never ran, ``rewind`` makes a sequence recompute from position 0); ``finish`` frees the
blocks, or defers that to the last step in flight.

A sequence that ends (finished, aborted, failed) or is preempted is *released* once no launched
step holds it: ``on_release(seq)`` lets the engine drop what the runner keeps for it
(``runner.forget``: a prompt-logprob row, a penalty slot).

A sequence whose last sampled token is still on the device decodes with ``from_device``: the
step reads the token the previous launch sampled. This holds for sequences with penalties
too: the card keeps their penalty state and counts the token it reads
(models/step/penalty_slots.py), so penalties see the true history without the host waiting.
"""

from __future__ import annotations

from collections.abc import Callable

from spyre_serve.server.engine.step_work import ScheduledChunk
from spyre_serve.server.sched.block_manager import BlockManager
from spyre_serve.server.sched.prefill_budget import prefill_budget
from spyre_serve.server.sched.sequence import SeqStatus, Sequence
from spyre_serve.server.sched.spyre_compat import SpyreCompat
from spyre_serve.server.sched.waiting import WaitingQueue
from spyre_serve.server.spec_decode.proposals import Speculator


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 on_release: Callable[[Sequence], None] | None = None,
                 max_prefill_with_decodes: int | None = None, max_scored_tokens_per_step: int | None = None,
                 policy: str = "fcfs", compat: SpyreCompat | None = None,
                 speculator: Speculator | None = None, admits=lambda seq: True) -> None:
        if max_num_seqs <= 0 or max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_seqs ({max_num_seqs}) and max_num_batched_tokens "
                             f"({max_num_batched_tokens}) must be positive")
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # prefill tokens a step that carries decodes may take (None: the whole budget): a
        # prefill chunk makes every decode in its step wait for it (see _prefill_budget)
        self.max_prefill_with_decodes = max_prefill_with_decodes
        # prompt tokens one step scores (prompt logprobs: a [rows, vocab] readback each)
        self.max_scored = max_scored_tokens_per_step
        self.on_release = on_release
        self.compat = compat  # the plugin's rules (--spyre-compat), or None: the freer default
        self.speculator = speculator  # proposes tokens to a decode (--speculative-config), or None
        self.admits = admits  # a gate a waiting sequence passes last (its LoRA slot: server/lora/adapters.py)
        self.waiting = WaitingQueue(policy)
        self.running: list[Sequence] = []  # in admission order
        self.deferred_free: list[Sequence] = []  # finished while a launched step still uses them
        self.num_preemptions = 0
        self._preempted_now: set[int] = set()  # preempted in this schedule(): not readmitted in it

    # ---- queues -------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.push(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take ``seq`` out of the queues; free its blocks now, or when the last launched
        step that writes into them is collected (a block freed earlier could be handed to
        another sequence while the device still writes the old one's KV into it). A
        sequence preempted while in flight has no blocks left and defers nothing."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if seq.num_inflight and seq.block_table:
            self.deferred_free.append(seq)
        else:
            self.blocks.free(seq)
        self._release_when_idle(seq)

    def _release_when_idle(self, seq: Sequence) -> None:
        """Release ``seq`` (``on_release``) now if no launched step holds it, else when the
        last one is collected; a sequence running again by then is not released."""
        seq.release_pending = True
        self._release_if_idle(seq)

    def _release_if_idle(self, seq: Sequence) -> None:
        if not seq.release_pending or seq.num_inflight:
            return
        seq.release_pending = False
        if seq.status is not SeqStatus.RUNNING and self.on_release is not None:
            self.on_release(seq)

    def abandon(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished and leave the queues and the blocks as they are: the engine
        loop has ended (perhaps on an exception raised in here), nothing runs again, and a
        scheduler in an unknown state must not keep the request from being told."""
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def collected(self, chunk: ScheduledChunk, token: int | None) -> bool:
        """``chunk``'s step has been read back; ``token`` is what it sampled (None when the
        chunk did not sample). The token joins the sequence's known tokens unless the
        sequence finished meanwhile; returns whether it joined."""
        if chunk.sample != (token is not None):
            raise ValueError(f"seq {chunk.seq.seq_id}: a chunk with sample={chunk.sample} "
                             f"was collected with token {token}")
        seq = chunk.seq
        if seq.kv_suspect:  # it read a cached block a failed step wrote: recomputed from 0
            token = None
        self._leave_step(chunk)
        if chunk.draft and seq.status is SeqStatus.RUNNING and seq.num_computed == chunk.start + chunk.num_new:
            seq.num_computed = chunk.start + 1  # the proposals' KV counts once each is kept
        if token is None or seq.status is SeqStatus.FINISHED:
            return False
        return self._known(seq, token)

    def kept_proposal(self, seq: Sequence, token: int) -> bool:
        """The next sample of a collected chunk with proposals, kept (models.step.runner's
        accepted_counts): it joins the known tokens, and the KV of the proposal before it (which
        it equals) counts as computed; False when the sequence finished meanwhile."""
        if seq.status is SeqStatus.FINISHED:
            return False
        if seq.status is SeqStatus.RUNNING and seq.num_computed == len(seq.token_ids) - 1:
            seq.num_computed += 1
        return self._known(seq, token)

    def _known(self, seq: Sequence, token: int) -> bool:
        seq.token_ids.append(token)
        if seq.num_inflight == 0 and seq.block_table:
            # every step of it is read back: full blocks whose last token only this read-back
            # made known go in the cache too (a finished sequence's output, for a chat's next turn)
            self.blocks.cache_full_blocks(seq, seq.num_computed)
        return True

    def _leave_step(self, chunk: ScheduledChunk) -> None:
        """Undo what ``_take`` counted for ``chunk``'s launch; free the blocks of a finished
        sequence that no launched step uses any more."""
        seq = chunk.seq
        seq.num_inflight -= 1
        if chunk.sample:
            seq.num_pending -= 1
        if seq.num_inflight == 0 and seq.status is SeqStatus.FINISHED and seq.block_table:
            self.blocks.free(seq)
            self.deferred_free.remove(seq)
        if seq.num_inflight == 0 and seq.kv_suspect and seq.status is not SeqStatus.FINISHED:
            self.rewind(seq)
        self._release_if_idle(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.num_preemptions += 1
        self._preempted_now.add(seq.seq_id)
        self.waiting.push_preempted(seq)
        self._release_when_idle(seq)  # recomputed from 0: the runner's state goes too

    # ---- a step that failed ------------------------------------------------

    def step_failed(self, chunks: list[ScheduledChunk]) -> None:
        """A launched step raised (or its results are not to be trusted): its chunks sampled
        nothing, and what they wrote is unknown: a sequence that goes on must ``rewind``."""
        for chunk in chunks:
            self._leave_step(chunk)
        self._drop_cached(chunks)

    def undo_launch(self, chunks: list[ScheduledChunk]) -> None:
        """The launch of the newest step raised before it ran: its chunks are taken back, as
        if never scheduled (the steps before it are untouched)."""
        for chunk in chunks:
            self._leave_step(chunk)
            if chunk.seq.status is not SeqStatus.FINISHED:
                chunk.seq.num_computed = chunk.start
        self._drop_cached(chunks)

    def rewind(self, seq: Sequence) -> None:
        """Recompute ``seq`` from position 0 (its KV cache and runner state are suspect after
        a failed step); no launched step may hold it. Its known tokens stay; its blocks are
        let go (some may be shared: it recomputes into blocks of its own)."""
        if seq.num_inflight or seq.num_pending:
            raise RuntimeError(f"seq {seq.seq_id}: rewind with {seq.num_inflight} steps in flight "
                               f"and {seq.num_pending} samples pending")
        self.blocks.free(seq)
        seq.num_computed = 0
        seq.kv_suspect = False

    def _drop_cached(self, chunks: list[ScheduledChunk]) -> None:
        """The blocks the failed ``chunks`` registered in the prefix cache hold what the
        step wrote, which is unknown: they leave the cache, and every sequence that counts
        one of them as computed (one that found it in the cache, the writer itself) is
        recomputed from position 0 in blocks of its own once no launched step holds it; the
        tokens its steps in flight sample are dropped."""
        bad = {block: h for c in chunks for block, h in c.cached}
        if not bad:
            return
        bs = self.blocks.block_size
        for seq in [*self.running, *self.waiting]:
            if any(bad.get(block) == self.blocks.hash_of(block) and (i + 1) * bs <= seq.num_computed
                   for i, block in enumerate(seq.block_table) if block in bad):
                seq.kv_suspect = True
                if not seq.num_inflight:
                    self.rewind(seq)
        for block, h in bad.items():
            self.blocks.uncache(block, h)

    # ---- what a sequence needs ----------------------------------------------

    @staticmethod
    def target(seq: Sequence) -> tuple[int, bool]:
        """(tokens the KV cache must reach, sample after reaching them)."""
        if seq.params.max_tokens == 0:  # scoring only: compute the prompt, sample nothing
            return seq.num_prompt, False
        if not seq.wants_more:
            return seq.num_computed, False  # the last token is sampled; nothing to compute
        return seq.num_tokens, True

    def ready(self, seq: Sequence) -> bool:
        """Whether ``seq`` can be in the next step (its token on the device is one it may read)."""
        if seq.num_pending > 1:
            return False
        if seq.num_pending == 1 and seq.num_computed != seq.num_tokens - 1:
            return False
        if seq.num_pending and seq.params.grammar is not None:
            return False  # its grammar's mask is built from its last token: known on the host only
        if seq.num_pending and self.speculator and self.speculator.proposes_for(seq, len(self.running)):
            return False  # proposals are looked up after its last token: known on the host only
        return True

    # ---- the step -------------------------------------------------------------

    @staticmethod
    def _scores(seq: Sequence) -> bool:
        """Whether ``seq``'s next chunk scores its tokens (prompt logprobs, still in the prompt)."""
        return seq.params.prompt_logprobs and seq.num_computed < seq.num_prompt

    def _kind(self, seq: Sequence, remaining: int) -> str:
        """"decode" (one token; under compat not a prompt's) or "prefill": ``remaining`` of ``seq``."""
        if self.compat is not None:
            return "prefill" if self.compat.prefill_kind(seq, remaining) else "decode"
        return "decode" if remaining == 1 else "prefill"

    def _has(self, kind: str) -> bool:
        """Whether a running sequence has a ``kind`` of chunk to compute now (ready or not)."""
        return any(0 < (r := self.target(s)[0] - s.num_computed) and self._kind(s, r) == kind
                   for s in self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget, compat = self.max_num_batched_tokens, self.compat
        scored = budget if self.max_scored is None or compat else self.max_scored   # scored tokens left
        chunks: list[ScheduledChunk] = []
        done: set[int] = set()
        self._preempted_now.clear()
        bs = self.blocks.block_size

        def victim_for(seq: Sequence) -> Sequence | None:
            return self.waiting.victim(self.running, seq, lambda c: c.seq_id in done)

        if len(self.running) >= self.max_num_seqs and (last := self.waiting.outranked(self.running)):
            self._preempt(last)             # priority: the waiting head takes its slot

        def run_pass(kind: str) -> None:
            nonlocal budget, scored
            for seq in list(self.running):
                if budget == 0 or (compat and kind == "prefill" and chunks):
                    return                  # compat: one prefill chunk a step
                if seq.status is not SeqStatus.RUNNING or seq.seq_id in done:
                    continue
                target, sample = self.target(seq)
                remaining = target - seq.num_computed
                if remaining <= 0 or self._kind(seq, remaining) != kind or not self.ready(seq):
                    continue
                scores = self._scores(seq)
                want = min(remaining, budget, scored if scores else budget)
                if want == 0:
                    continue
                need = want if compat else 1  # find blocks: shrink a chunk to fit (compat: never)
                while True:
                    room = (len(seq.block_table) + self.blocks.num_free) * bs - seq.num_computed
                    if room >= need:
                        break
                    victim = victim_for(seq)
                    if victim is None or victim is seq:
                        break
                    self._preempt(victim)
                if room < need:
                    if self.deferred_free:
                        continue  # blocks come back when the step in flight is collected
                    self._preempt(seq)
                    continue
                num_new = min(want, room)
                if seq.params.pooling and num_new < remaining:
                    continue  # an embedding is pooled from one step: its whole prompt or nothing
                scored -= num_new if scores else 0
                draft = self._draft(seq, min(budget, room) - num_new) if kind == "decode" and sample else []
                chunks.append(self._take(seq, num_new, sample and num_new == remaining, draft))
                done.add(seq.seq_id)
                budget -= num_new + len(draft)

        def admit(most: int) -> None:
            """Admit waiting sequences in the queue's order, at most ``most``."""
            nonlocal budget, scored
            passed: set[int] = set()      # waiting for their LoRA adapter's slot: others may pass them
            while budget > 0 and len(self.running) < self.max_num_seqs and most:
                seq = next((s for s in self.waiting if s.seq_id not in passed), None)
                if seq is None or seq.seq_id in self._preempted_now or not self.ready(seq) or seq.num_pending:
                    break  # the head waits, nobody overtakes it
                if compat and not compat.fits_volume(seq, self.running):
                    break  # batch x max context would go over the plugin's limit
                target, sample = self.target(seq)
                hit = self._cached_prefix(seq, target)
                start = len(hit) * bs if hit else seq.num_computed
                remaining = target - start
                if remaining <= 0:
                    break
                scores = self._scores(seq)
                num_new = min(remaining, budget, scored if scores else budget)
                if num_new == 0 or (seq.params.pooling and num_new < remaining) or \
                        not self.blocks.can_share(seq, hit, start + num_new):
                    break
                if not self.admits(seq):  # no slot for its adapter yet: those behind it go on (vLLM)
                    passed.add(seq.seq_id)
                    continue
                self.waiting.remove(seq)
                if hit:
                    self.blocks.share(seq, hit, seq.num_tokens)
                    seq.num_computed = start
                elif seq.num_computed == 0 and seq.params.reads_prefix_cache and self.blocks.enable_caching:
                    self.blocks.stats.queries += seq.num_tokens  # looked up, nothing found
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
                scored -= num_new if scores else 0
                chunks.append(self._take(seq, num_new, sample and num_new == remaining))
                done.add(seq.seq_id)
                budget -= num_new
                most -= 1

        if compat is None:
            self._prepare_proposals()
            run_pass("decode")
            budget = prefill_budget(self, self.max_num_batched_tokens - budget, budget)
            run_pass("prefill")
            admit(self.max_num_seqs)
            return chunks
        for kind in compat.order(self._has("decode")):   # a prefill step or a decode step
            run_pass(kind)
            if kind == "prefill" and not chunks and not self._has("prefill"):
                admit(1)                                  # one prefill at a time
            if chunks:
                compat.last_prefill = kind == "prefill"
                break
        return chunks

    def schedule_solo(self, seq: Sequence) -> list[ScheduledChunk]:
        """A step of ``seq`` alone (a suspect of a failed step, run to see whether it fails on
        its own): its next chunk within the budget and the blocks it has or that are free;
        empty when it has nothing to compute or no room (normal scheduling takes it then)."""
        if seq.status is not SeqStatus.RUNNING or not self.ready(seq):
            return []
        target, sample = self.target(seq)
        remaining = target - seq.num_computed
        room = (len(seq.block_table) + self.blocks.num_free) * self.blocks.block_size - seq.num_computed
        num_new = min(remaining, self.max_num_batched_tokens, room)
        if num_new <= 0 or (seq.params.pooling and num_new < remaining):
            return []
        return [self._take(seq, num_new, sample and num_new == remaining)]

    def _cached_prefix(self, seq: Sequence, target: int) -> list[int]:
        """The cached blocks a sequence about to start from position 0 starts from: the longest
        cached prefix of its tokens, leaving one of ``target`` to compute (vLLM's cap)."""
        if seq.num_computed or seq.block_table or not seq.params.reads_prefix_cache:
            return []
        hit = self.blocks.lookup(seq, min(target, seq.num_tokens) - 1)
        return self.compat.whole_chunks(hit) if self.compat else hit

    def _prepare_proposals(self) -> None:
        """Tell the speculator which sequences decode with proposals next (a draft model batches them)."""
        if self.speculator is not None:
            n = len(self.running)
            self.speculator.prepare([s for s in self.running if s.status is SeqStatus.RUNNING and not s.num_pending
                                     and self.target(s)[0] - s.num_computed == 1 and self.target(s)[1]
                                     and self.speculator.proposes_for(s, n)])

    def _draft(self, seq: Sequence, most: int) -> list[int]:
        """Tokens proposed to ``seq``'s decode (its last token known on the host), at most ``most``."""
        spec = self.speculator
        if spec is None or seq.num_pending or self.compat or not spec.proposes_for(seq, len(self.running)):
            return []
        return spec.propose(seq, most)

    def _take(self, seq: Sequence, num_new: int, sample: bool, draft: list[int] | None = None) -> ScheduledChunk:
        start = seq.num_computed
        draft = draft or []
        num_new += len(draft)
        self.blocks.grow(seq, start + num_new)
        from_device = seq.num_pending == 1
        prompt_lp = (seq.params.prompt_logprobs and start < seq.num_prompt
                     and any(lp is None for lp in seq.prompt_logprobs[1:]))
        num_generated = seq.num_generated_total
        seq.num_computed = start + num_new
        seq.num_inflight += 1
        if sample:
            seq.num_pending += 1
        # the full blocks this launch writes (and any whose last token became known since) are
        # cached at once: later steps, and sequences later in this one, read them once written
        cached = self.blocks.cache_full_blocks(seq, seq.num_computed)
        return ScheduledChunk(seq, start, num_new, sample, from_device, prompt_lp, num_generated, cached, draft)
