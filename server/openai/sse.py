"""Server-Sent Events: the framing, and the stream a completion or a chat sends.

Both endpoints stream the same way and differ only in the chunks' choices: each gives
``sse_stream`` the opening choices (chat's role chunk) and how to turn one engine update
into a choice.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterable

from spyre_serve.server.engine import SeqUpdate
from spyre_serve.server.openai.bridge import Submission
from spyre_serve.server.openai.errors import APIError, error_body, internal_error

MEDIA_TYPE = "text/event-stream"
DONE = "[DONE]"  # OpenAI's last event


def sse(payload: dict | str) -> str:
    """One event: ``data: <JSON or the literal string>`` and a blank line."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def sse_stream(sub: Submission, head: dict, usage: str,
                     choice_of: Callable[[int, SeqUpdate], dict], opening: Iterable[dict] = ()) -> AsyncIterator[str]:
    """A streaming response's events.

    One chunk ``{**head, "choices": [choice]}`` per choice of ``opening``, then one per
    engine update with the choice ``choice_of(index, update)`` makes (with ``usage``
    "continuous", each with its choice's ``usage`` so far, as vLLM's continuous_usage_stats);
    then, with any ``usage``, the usage chunk of the whole request, and ``[DONE]``. An update carrying an error, or a chunk
    that cannot be made, ends the stream with an error chunk naming the request id (no
    usage; what failed goes to the log) and ``[DONE]``: the response has started, so a
    status can no longer say it. Whatever ends the stream early (an error, the client
    going away) aborts what is left of the submission."""
    try:
        try:
            continuous = usage == "continuous"

            def chunk(choice: dict, idx: int) -> str:
                return sse({**head, "choices": [choice], **({"usage": sub.usage(idx)} if continuous else {})})

            for choice in opening:
                yield chunk(choice, choice["index"])
            while not sub.done:
                idx, u = await sub.next()
                if u.error:
                    yield error_event(internal_error(u.error, sub.request_id))
                    break
                yield chunk(choice_of(idx, u), idx)
            else:
                if usage:
                    yield sse({**head, "choices": [], "usage": sub.usage()})
        except Exception as exc:  # a chunk that cannot be made: the client still gets an end
            yield error_event(internal_error("a stream chunk failed", sub.request_id, exc))
        yield sse(DONE)
    finally:
        if not sub.done:
            sub.abort()


def error_event(err: APIError) -> str:
    return sse(error_body(err.status, err.message, err.param))
