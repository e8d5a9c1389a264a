"""The requests the engine's loop has taken and not answered in full, and how each is
answered: a sequence finishes here, its ``SeqUpdate``s go out through the request's
``on_update`` here, and the request closes (counted, timed) when all its sequences have;
an abort, an error, or every request at once when the engine stops."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from spyre_serve.server.engine.outputs import RequestFault, SeqUpdate, take_update
from spyre_serve.server.engine.stats import EngineObserver, EngineStats
from spyre_serve.server.sched.scheduler import Scheduler
from spyre_serve.server.sched.sequence import Sequence

log = logging.getLogger("spyre_serve.engine")


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    seqs: list[Sequence]
    on_update: Callable[[SeqUpdate], None]
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    num_finished: int = 0


class OpenRequests:
    """``observer()`` is the engine's metrics hooks (the metrics set them after the engine is
    made). ``silenced()`` is true when the calling thread must send nothing any more (the engine
    died meanwhile and every request was answered: only ``fail_all`` sends then)."""

    def __init__(self, scheduler: Scheduler, stats: EngineStats, observer: Callable[[], EngineObserver],
                 silenced: Callable[[], bool]) -> None:
        self.by_id: dict[str, EngineRequest] = {}
        self._scheduler = scheduler
        self._stats = stats
        self._observer = observer
        self._silenced = silenced
        self._fail_lock = threading.Lock()  # fail_all: the loop's thread or the watchdog's

    def __len__(self) -> int:
        return len(self.by_id)

    def get(self, request_id: str) -> EngineRequest | None:
        return self.by_id.get(request_id)

    def add(self, req: EngineRequest) -> None:
        self.by_id[req.request_id] = req

    def take(self, items: list, start: Callable[[Sequence], None]) -> None:
        """What the inbox held (``Inbox.take``): each request's sequences started (``start``: the
        output processor's) and scheduled; each abort finishes its request, telling no one."""
        for kind, item in items:
            if kind == "add":
                self.add(item)
                for seq in item.seqs:
                    start(seq)
                    self._scheduler.add(seq)
            else:
                req = self.by_id.get(item)
                if req is not None:
                    self.finish(req, "abort", notify=False)

    def finish_seq(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        if isinstance(stop_reason, RequestFault):      # an error the request caused: its message
            seq.error, stop_reason = stop_reason, None
        seq.stop_reason = stop_reason
        self._scheduler.finish(seq, reason)
        req = self.by_id.get(seq.request_id)
        if req is not None:
            req.num_finished += 1

    def emit(self, req: EngineRequest, seq: Sequence, force: bool = False) -> None:
        """Send what ``seq`` has that was not sent yet (nothing when there is nothing)."""
        update = take_update(seq)
        if update is None:
            return
        if not force and self._silenced():
            return  # the engine died meanwhile: every request was answered by fail_all
        try:
            req.on_update(update)
        except Exception:  # a closed event loop must not take the engine down
            log.exception("delivering an update for %s failed", req.request_id)

    def close(self, req: EngineRequest) -> None:
        self.by_id.pop(req.request_id, None)
        reason = req.seqs[0].finish_reason or "abort"
        self._stats.count_finished(reason)
        self._observer().on_finished(reason, time.monotonic() - req.arrival)
        self._observer().on_request_params(req.seqs[0].params.max_tokens)

    def finish(self, req: EngineRequest, reason: str, notify: bool, error: str | None = None) -> None:
        """End every sequence of ``req`` not finished yet with ``reason`` and close it, then
        (``notify``) answer them: closed first, so no count holds a request once answered."""
        ended = [seq for seq in req.seqs if not seq.is_finished]
        for seq in ended:
            seq.error = error
            self.finish_seq(seq, reason)
        self.close(req)
        for seq in ended if notify else ():
            self.emit(req, seq)

    def fail(self, request_id: str, message: str) -> None:
        req = self.by_id.get(request_id)
        if req is not None:
            self.finish(req, "error", notify=True, error=message)

    def fail_all(self, message: str, queued: list[EngineRequest]) -> None:
        """Answer every request (and ``queued``, taken from the inbox) with an error: from the
        loop's thread, or from whichever thread found the engine dead (it may be stuck)."""
        with self._fail_lock:
            for req in queued:
                self.by_id[req.request_id] = req
            for req in list(self.by_id.values()):
                for seq in req.seqs:
                    if not seq.is_finished:
                        self._scheduler.abandon(seq, "error")
                        seq.error = message
                        req.num_finished += 1
                        try:
                            self.emit(req, seq, force=True)
                        except Exception:
                            log.exception("failing %s", req.request_id)
                self.by_id.pop(req.request_id, None)
