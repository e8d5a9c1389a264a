"""Which requests a failed step fails: only those that caused it.

The runner names the work items it refuses (``SeqWorkError``): when it launched nothing,
only their requests fail and the others are planned again. A step that fails without naming
one fails its request if it holds only one; else each of its sequences becomes a suspect, to
be recomputed from position 0 in a step of its own once the pipeline is drained (the
engine's ``_probe``), so only a sequence that fails alone is failed. A run of
``MAX_FAILED_STEPS_IN_A_ROW`` failed steps is the card's fault, not a client's: fatal.
"""

from __future__ import annotations

import logging
from collections import deque

from spyre_serve.models.step_io import SeqWorkError
from spyre_serve.server.sequence import Sequence
from spyre_serve.server.step_work import ScheduledChunk
from spyre_serve.server.watchdog import EngineFatal

log = logging.getLogger("spyre_serve.engine")

MAX_FAILED_STEPS_IN_A_ROW = 8  # then the card, not a request, is at fault: the engine dies


class StepFailures:
    def __init__(self) -> None:
        self.suspects: deque[Sequence] = deque()  # of a failed step, each to run alone
        self.in_a_row = 0

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
            return {requests.pop(): message}
        log.warning("a step of %d requests failed (%s); each runs alone until the one at fault "
                    "fails alone", len(requests), message)
        queued = {s.seq_id for s in self.suspects}
        for c in chunks:
            if not c.seq.is_finished and c.seq.seq_id not in queued:
                self.suspects.append(c.seq)
                queued.add(c.seq.seq_id)
        return {}
