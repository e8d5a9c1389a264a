"""How the scheduler takes back a step that failed (server/sched/scheduler.py's part for failures).

A launched step that raised sampled nothing and wrote unknown KV (``step_failed``); a launch
that raised before it ran is undone (``undo_launch``); a sequence whose KV is suspect is
recomputed from position 0 (``rewind``); the blocks a failed step registered in the prefix
cache leave it, and every sequence that counted one as computed is recomputed (``_drop_cached``).
"""

from __future__ import annotations

from spyre_serve.server.engine.step_work import ScheduledChunk
from spyre_serve.server.sched.sequence import SeqStatus, Sequence


class StepRecovery:
    """The Scheduler's methods for failed steps (it provides blocks, running, waiting, _leave_step)."""

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
