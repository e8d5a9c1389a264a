"""Which requests a failed step fails: only those that caused it.

The runner names the work items it refuses (``SeqWorkError``): when it launched nothing,
only their requests fail and the others are planned again. A step that fails without naming
one fails its request if it holds only one; else each of its sequences becomes a suspect, to
be recomputed from position 0 in a step of its own once the pipeline is drained (the
engine's ``_probe``), so only a sequence that fails alone is failed.

A run of ``MAX_FAILED_STEPS_IN_A_ROW`` failed steps that no request explains is the card's
fault, not a client's: fatal. A refusal the runner names (``SeqWorkError``) is explained. A
failure put on a request by elimination (the step was its alone) is explained only once the
card is seen to work without it: on the next quiet pipeline the engine runs a canary, one
token of a sequence of the engine's own (``check_card``); if that fails too, the failure
counts. So a client who sends poison requests one after another fails only its own, and
never feeds the count, while a card that breaks still dies after the same run of failures.
"""

from __future__ import annotations

import logging
from collections import deque

from spyre_serve.models import SamplingParams, SeqWork, SeqWorkError
from spyre_serve.server.engine.step_work import ScheduledChunk
from spyre_serve.server.engine.watchdog import EngineFatal
from spyre_serve.server.sched.block_manager import BlockManager
from spyre_serve.server.sched.sequence import GenerationParams, Sequence

log = logging.getLogger("spyre_serve.engine")

MAX_FAILED_STEPS_IN_A_ROW = 8  # then the card, not a request, is at fault: the engine dies


class StepFailures:
    def __init__(self) -> None:
        self.suspects: deque[Sequence] = deque()  # of a failed step, each to run alone
        self.in_a_row = 0
        self.unverified: BaseException | None = None  # blamed by elimination: canary pending

    def succeeded(self) -> None:
        self.in_a_row = 0

    def count(self, exc: BaseException) -> None:
        """One more failed step; ``EngineFatal`` when that makes too many in a row."""
        self.in_a_row += 1
        if self.in_a_row >= MAX_FAILED_STEPS_IN_A_ROW:
            raise EngineFatal(f"{self.in_a_row} steps failed in a row, the last with "
                              f"{type(exc).__name__}: {exc}") from exc

    def blame(self, chunks: list[ScheduledChunk], exc: BaseException, ran: bool) -> dict[str, str]:
        """The requests to fail for a step that raised, at its launch (``ran`` false: nothing
        of it ran) or when read back, each with its error message, in the step's order. When
        no request can be blamed, the step's sequences become suspects instead."""
        in_step = {c.seq.seq_id for c in chunks}
        reasons = exc.reasons if isinstance(exc, SeqWorkError) else {}
        named = {i: r for i, r in reasons.items() if i in in_step}
        if named and not ran:
            # the runner refused these items and launched nothing: the others are planned
            # again from where they were
            failed: dict[str, str] = {}
            for c in chunks:
                if c.seq.seq_id in named:
                    failed.setdefault(c.seq.request_id, f"the step refused the request: {named[c.seq.seq_id]}")
            return failed
        message = f"the step failed: {type(exc).__name__}: {exc}"
        requests = {c.seq.request_id for c in chunks}
        if len(requests) == 1:
            self.unverified = exc      # the request's, unless the card fails without it too
            return {requests.pop(): message}
        log.warning("a step of %d requests failed (%s); each runs alone until the one at fault "
                    "fails alone", len(requests), message)
        queued = {s.seq_id for s in self.suspects}
        for c in chunks:
            if not c.seq.is_finished and c.seq.seq_id not in queued:
                self.suspects.append(c.seq)
                queued.add(c.seq.seq_id)
        return {}

    def check_card(self, runner, blocks: BlockManager, seq_id: int) -> None:
        """The canary after a failure put on a request by elimination (nothing in flight):
        one token of a sequence of the engine's own, in a free block. It passes: the card
        works, the request was at fault, and the run of failures is over. It fails: the
        failure was the card's and counts (``EngineFatal`` at the end of a run). With no free
        block there is nothing to run it in, and the failure stays the request's."""
        exc, self.unverified = self.unverified, None
        canary = Sequence(seq_id, "canary", 0, [0], GenerationParams(SamplingParams(temperature=0.0)), 0.0)
        if exc is None or not blocks.can_grow(canary, 1):
            return
        blocks.grow(canary, 1)
        try:
            runner.launch([SeqWork(seq_id, [0], 0, list(canary.block_table), True, canary.params.sampling)]).result()
        except Exception as canary_exc:  # noqa: BLE001 - a failed canary is the card's failure
            log.warning("the canary step failed too (%s: %s): the card, not the request, is at fault",
                        type(canary_exc).__name__, canary_exc)
            self.count(exc)
        else:
            self.succeeded()
        finally:
            blocks.free(canary)
            runner.forget(seq_id)
