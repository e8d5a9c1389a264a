"""``X-Request-Id``: a client's id for its request, as vLLM takes it.

A generation sent with the header answers with the id it names (``cmpl-<id>``,
``chatcmpl-<id>``), and every response carries the header back: the client's own value, or
the id the server made for a generation (``request_ids``), or a new one. The engine's id of
a request given one gets a short suffix of its own, so two requests sent with the same id
stay apart; the server's log names that id.

A response of the Responses API is kept under its id and found again by it (``GET``,
``previous_response_id``), so its id is the server's own, random (``server_made``): taken from
the header, a second request sent with it replaced the first's stored response, and anyone
who knew a client's header could read it back (issue 38). The header still names the request
and comes back on the answer.
"""

from __future__ import annotations

import secrets
import uuid

from fastapi import Request

from spyre_serve.server.openai.errors import APIError

HEADER = "X-Request-Id"
MAX_LENGTH = 256  # characters of a client's id: it goes into every log line of the request


def request_ids(request: Request, prefix: str, sep: str = "-", server_made: bool = False) -> tuple[str, str]:
    """(the response's id, the engine's id) of a generation: ``<prefix><sep><id>``, the id the
    header gives, else (or with ``server_made``, always) 48 random hex digits of the server's;
    400 for a header that is empty, over ``MAX_LENGTH`` or not printable."""
    given = request.headers.get(HEADER)
    if given is not None and not (0 < len(given) <= MAX_LENGTH and given.isprintable()):
        raise APIError(400, f"the {HEADER} header must be 1 to {MAX_LENGTH} printable characters", HEADER)
    if given is None or server_made:
        response_id = engine_id = f"{prefix}{sep}{secrets.token_hex(24)}"
    else:
        response_id = f"{prefix}{sep}{given}"
        engine_id = f"{response_id}-{uuid.uuid4().hex[:8]}"
    request.state.request_id = response_id
    return response_id, engine_id


class RequestIdMiddleware:
    """Puts ``X-Request-Id`` on every HTTP response (pure ASGI, so that streams and the
    disconnect polling are left as they are): the request's own, else the id the endpoint
    made (``request_ids``), else a new one."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        name = HEADER.lower().encode()
        given = next((v for k, v in scope.get("headers", ()) if k.lower() == name), None)

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                made = (scope.get("state") or {}).get("request_id")
                value = given or (made.encode("latin-1", "replace") if made else uuid.uuid4().hex.encode())
                message = {**message, "headers": [*message.get("headers", ()), (name, value)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
