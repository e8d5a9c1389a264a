"""``spyre_api_requests_total{endpoint, status}``: the HTTP requests each API endpoint answered,
by kind (completions, chats, responses, embeddings, scores, ...) and status, so that /metrics
shows what a server is asked for and what it refused. Counted by a pure ASGI middleware when
the response starts; a path that is not an endpoint counts as "other" (the labels stay few
whatever clients send)."""

from __future__ import annotations

import threading
from collections import Counter

from prometheus_client.core import CounterMetricFamily

ENDPOINTS = frozenset({
    "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/score", "/v1/score",
    "/tokenize", "/detokenize", "/v1/models",
})
DOC = "HTTP requests the API answered, by endpoint and status code."


class RequestCounts:
    """Counts by (endpoint, status); read by the /metrics collectors (``families``)."""

    def __init__(self) -> None:
        self._counts: Counter = Counter()
        self._lock = threading.Lock()

    def add(self, path: str, status: int) -> None:
        endpoint = path if path in ENDPOINTS else "/v1/responses" if path.startswith("/v1/responses/") else "other"
        with self._lock:
            self._counts[endpoint, str(status)] += 1

    def families(self, model_name: str):
        with self._lock:
            counts = dict(self._counts)
        family = CounterMetricFamily("spyre_api_requests", DOC, labels=["model_name", "endpoint", "status"])
        for (endpoint, status), n in sorted(counts.items()):
            family.add_metric([model_name, endpoint, status], n)
        yield family


class CountRequests:
    """ASGI middleware: each HTTP response's status counted under its request's path."""

    def __init__(self, app, counts: RequestCounts) -> None:
        self.app = app
        self.counts = counts

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                self.counts.add(scope.get("path", ""), message["status"])
            await send(message)

        await self.app(scope, receive, counted)
