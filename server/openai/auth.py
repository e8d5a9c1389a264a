"""The API key: with ``--api-key`` set, a guarded route wants ``Authorization: Bearer <key>``.

``app.py`` decides which routes are guarded (every /v1 route, /tokenize, /detokenize) by
including their routers with ``api_key_guard``; /health and /metrics stay open so that a
load balancer and Prometheus need no key. With ``--guard-metrics-and-docs`` the key guards
/metrics and the API's documents too (``GuardPaths``, a middleware: FastAPI serves the
documents outside any router).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

from fastapi import Request

from spyre_serve.server.openai.errors import APIError, error_response

# what --guard-metrics-and-docs puts behind the key besides the guarded routers
GUARDED_PATHS = frozenset({"/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})


def check_bearer(authorization: str, api_key: str | None) -> None:
    """Refuse (401) an ``Authorization`` header that is not ``Bearer <api_key>``; without a key
    every request passes. The comparison takes the same time whatever the token."""
    if api_key is None:
        return
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(401, "invalid API key: send 'Authorization: Bearer <key>' with the key the server was "
                            "started with")


def api_key_guard(api_key: str | None) -> Callable[[Request], None]:
    """A FastAPI dependency that checks each request's header against ``api_key``."""

    def guard(request: Request) -> None:
        check_bearer(request.headers.get("authorization", ""), api_key)

    return guard


class GuardPaths:
    """ASGI middleware: a request for one of ``paths`` needs ``Bearer <api_key>`` (401 in the
    OpenAI shape otherwise); any other request passes through untouched."""

    def __init__(self, app, api_key: str, paths: frozenset[str] = GUARDED_PATHS) -> None:
        self.app, self.api_key, self.paths = app, api_key, paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] in self.paths:
            header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), "")
            try:
                check_bearer(header, self.api_key)
            except APIError as err:
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)
