"""The two ways a generation answers: one JSON body when every choice is done, or a stream.

Completions and chat share the envelope (``id``, ``object``, ``created``, ``model``, then
``choices`` and ``usage``) and differ only in how a choice reads: each endpoint passes a
function that makes one choice, from a finished ``Choice`` (``full_response``) or from one
engine update (``stream_response``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable, Iterable

from fastapi.responses import JSONResponse, Response, StreamingResponse

from spyre_serve.server.engine.core import SeqUpdate
from spyre_serve.server.openai.bridge import Choice, Submission, collect
from spyre_serve.server.openai.errors import failure
from spyre_serve.server.openai.generation.sse import MEDIA_TYPE, sse_stream

CLIENT_CLOSED = 499  # nginx's status for a client that went away before the answer


def new_head(id_prefix: str, object_name: str, model: str, fingerprint: str,
             response_id: str | None = None) -> dict:
    """The fields a response or each of its chunks starts with: ``response_id``
    (``request_id.request_ids``) or a new id, made now; ``fingerprint``, the numbers the
    server computes with (``Serving.fingerprint``), as OpenAI's ``system_fingerprint``."""
    return {"id": response_id or f"{id_prefix}-{uuid.uuid4().hex}", "object": object_name,
            "created": int(time.time()), "model": model, "system_fingerprint": fingerprint}


async def full_response(sub: Submission, is_disconnected: Callable[[], Awaitable[bool]], head: dict,
                        choice_of: Callable[[int, Choice], dict]) -> dict | Response:
    """Wait for every choice (499 if the client left first, 500 naming the request id if a
    step failed: the engine's message goes to the log), then the body: ``head``, one choice
    per ``Choice``, the token usage."""
    await collect(sub, is_disconnected)
    if not sub.done:
        return Response(status_code=CLIENT_CLOSED)
    if sub.error:
        raise failure(sub.error, sub.request_id)
    choices = [choice_of(idx, c) for idx, c in enumerate(sub.choices)]
    return {**head, "choices": choices, "usage": sub.usage()}


def encoded(body: dict | Response) -> Response:
    """A finished body as the response, encoded with ``json.dumps`` at once: FastAPI would
    first walk it with ``jsonable_encoder``, in Python, on the event loop (seconds for a body
    of thousands of prompt logprobs, while every stream waits)."""
    return body if isinstance(body, Response) else JSONResponse(body)


def stream_response(sub: Submission, head: dict, usage: str,
                    choice_of: Callable[[int, SeqUpdate], dict], opening: Iterable[dict] = ()) -> StreamingResponse:
    """The events of ``sse.sse_stream`` as the response."""
    return StreamingResponse(sse_stream(sub, head, usage, choice_of, opening), media_type=MEDIA_TYPE)
