"""Speculative decoding with a draft model (`--speculative-config '{"model": DIR, ...}'`).

A small model of the same tokenizer, placed on the same card with a runner of its own
(models/build.py loads it before the served model's KV cache takes the card), proposes k
tokens greedily for each sequence about to decode with proposals:

    round 1   every such sequence's tokens the draft has not computed yet (its catch-up, up
              to and including the last known token), one launch, sampled greedily
    round 2.. one token each, read on the card from the round before (from_device): the k
              launches are queued back to back and read back once, at the end

The draft keeps KV for the sequences it proposed for in a cache of its own, sized for
``disable_by_batch_size`` sequences of the longest context; when it is full, the state of the
sequence it proposed for least recently goes (that sequence catches up again next time). After
the served model kept n of a sequence's proposals, the draft's KV is right up to the sequence's
known tokens but the last (the proposals it computed and the server kept are those tokens), so
``computed`` only ever shrinks to ``len(known) - 1``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from spyre_serve.models import SamplingParams, SeqWork
from spyre_serve.server.sched.sequence import Sequence
from spyre_serve.server.spec_decode.proposals import SpeculativeConfig, Speculator

GREEDY = SamplingParams(temperature=0.0)
log = logging.getLogger("spyre_serve.speculative")


@dataclass(slots=True)
class _DraftSeq:
    blocks: list[int] = field(default_factory=list)   # its blocks of the draft's KV cache
    computed: int = 0                                  # tokens whose KV the draft holds


class DraftSpeculator(Speculator):
    """Proposals from a draft model's greedy continuation (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, runner) -> None:
        super().__init__(config, max_model_len)
        if runner is None:
            raise ValueError("--speculative-config: the draft model's runner is missing")
        self.runner = runner
        self.bs = runner.block_size
        self.free = list(range(runner.num_kv_blocks))
        self.states: OrderedDict[int, _DraftSeq] = OrderedDict()   # least recently proposed first
        self.proposals: dict[int, list[int]] = {}

    def prepare(self, seqs: list[Sequence]) -> None:
        """Propose for ``seqs`` (see the module docstring); a draft that fails proposes nothing and
        starts afresh (the served model's step is not the draft's to fail)."""
        self.proposals.clear()
        try:
            self._propose_all(seqs)
        except Exception as exc:  # noqa: BLE001 - logged; serving goes on without proposals
            log.warning("draft model failed (%s: %s): no proposals this step", type(exc).__name__, exc)
            self.proposals.clear()
            for sid in list(self.states):
                self.forget(sid)

    def _propose_all(self, seqs: list[Sequence]) -> None:
        room = self.runner.max_model_len
        batch = [(seq, k) for seq in seqs[:self.runner.max_num_seqs]
                 if (k := self.most(seq, self.config.num_speculative_tokens)) > 0
                 and len(seq.token_ids) + k - 1 <= room and self._room(seq, k, seqs)]
        if not batch:
            return
        states = [self.states[seq.seq_id] for seq, _ in batch]
        self._catch_up(batch, states)
        first = self.runner.launch([self._work(seq, st, len(seq.token_ids) - st.computed)
                                    for (seq, _), st in zip(batch, states, strict=True)])
        for st, (seq, _) in zip(states, batch, strict=True):
            st.computed = len(seq.token_ids)
        handles = [first]
        for r in range(1, max(k for _, k in batch)):     # one token more each, read on the card
            live = [(seq, st) for (seq, k), st in zip(batch, states, strict=True) if k > r]
            handles.append(self.runner.launch([SeqWork(seq.seq_id, [-1], st.computed + r - 1, list(st.blocks),
                                                        True, GREEDY, from_device=True) for seq, st in live]))
        outs = [h.result() for h in handles]
        for seq, k in batch:
            got = [int(out.token_ids[out.seq_ids.index(seq.seq_id)]) for out in outs[:k]]
            self.proposals[seq.seq_id] = got
        for (_, k), st in zip(batch, states, strict=True):
            st.computed += k - 1                         # the proposals fed back in: d1..d(k-1)

    def propose(self, seq: Sequence, most: int) -> list[int]:
        return self.proposals.pop(seq.seq_id, [])[:self.most(seq, most)]

    def forget(self, seq_id: int) -> None:
        super().forget(seq_id)
        st = self.states.pop(seq_id, None)
        if st is not None:
            self.free.extend(st.blocks)
        self.proposals.pop(seq_id, None)
        self.runner.forget(seq_id)

    # ---- the draft's KV ----------------------------------------------------------------------

    def _room(self, seq: Sequence, k: int, batch: list[Sequence]) -> bool:
        """Whether ``seq``'s draft state has blocks for its known tokens and k - 1 proposals,
        evicting sequences outside ``batch`` (least recently proposed first) to make them."""
        st = self.states.pop(seq.seq_id, None) or _DraftSeq()
        st.computed = min(st.computed, len(seq.token_ids) - 1)
        self.states[seq.seq_id] = st                     # most recent last
        need = -(-(len(seq.token_ids) + k - 1) // self.bs) - len(st.blocks)
        keep = {s.seq_id for s in batch}
        while need > len(self.free):
            victim = next((sid for sid in self.states if sid not in keep), None)
            if victim is None:
                return False
            self.forget(victim)
        for _ in range(max(0, need)):
            st.blocks.append(self.free.pop())
        return True

    def _work(self, seq: Sequence, st: _DraftSeq, n: int) -> SeqWork:
        return SeqWork(seq.seq_id, seq.token_ids[st.computed:st.computed + n], st.computed, list(st.blocks),
                       st.computed + n == len(seq.token_ids), GREEDY)

    def _catch_up(self, batch, states) -> None:
        """Compute every sequence's tokens but its last one's chunk ahead of round 1, in chunks of
        the draft runner's token budget (a long prompt the first time, a few tokens after)."""
        budget = self.runner.max_num_batched_tokens - len(batch)   # round 1 needs a token each
        while True:
            work, left = [], budget
            for (seq, _), st in zip(batch, states, strict=True):
                behind = len(seq.token_ids) - 1 - st.computed
                if behind > 0 and left > 0:
                    n = min(behind, left)
                    work.append(self._work(seq, st, n))
                    st.computed += n
                    left -= n
            if not work:
                return
            self.runner.launch(work).result()
