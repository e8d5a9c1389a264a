"""How requests reach the engine's loop: the ``Inbox``, a locked list any thread adds
requests (``EngineRequest``) and aborts to and the loop drains each iteration. Once closed (the engine died or was shut
down) it takes no more requests, so none is queued where nobody will answer it."""

from __future__ import annotations

import threading

from spyre_serve.server.engine.open_requests import EngineRequest


class Inbox:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[tuple[str, object]] = []  # ("add", EngineRequest) | ("abort", request id)
        self.closed = False  # no request is taken any more (set under the lock)

    def add(self, req: EngineRequest) -> bool:
        """Queue ``req``; False (and nothing queued) once the inbox is closed."""
        with self._lock:
            if self.closed:
                return False
            self._items.append(("add", req))
        return True

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._items.append(("abort", request_id))

    def take(self) -> list[tuple[str, object]]:
        """Everything queued since the last take, in order."""
        with self._lock:
            items, self._items = self._items, []
        return items

    def close(self) -> list[tuple[str, object]]:
        """Take no more requests; returns what was still queued."""
        with self._lock:
            self.closed = True
            items, self._items = self._items, []
        return items

    def num_requests(self) -> int:
        with self._lock:
            return sum(1 for kind, _ in self._items if kind == "add")

    def num_sequences(self) -> int:
        """Every choice of every queued request (a request with n choices counts n)."""
        with self._lock:
            return sum(len(item.seqs) for kind, item in self._items if kind == "add")
