"""Server-Sent Events: the framing, and the streams the generating endpoints send.

``event_stream`` is what every stream does with a submission: its opening events, events
for each engine update, closing events, an error event that ends it early, and the abort of
what is left when it ends. Completions and chat (``sse_stream``) differ only in the chunks'
choices: each gives the opening choices (chat's role chunk) and how to turn one engine
update into a choice; the Responses API gives its own events (``responses_output``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterable

from spyre_serve.server.engine.core import SeqUpdate
from spyre_serve.server.openai.bridge import Submission
from spyre_serve.server.openai.errors import APIError, error_body, failure, internal_error

MEDIA_TYPE = "text/event-stream"
DONE = "[DONE]"  # OpenAI's last event of a completion's or a chat's stream


def sse(payload: dict | str, event: str | None = None) -> str:
    """One event: ``data: <JSON or the literal string>`` (after ``event: <name>`` when it has
    one, as the Responses API's events do) and a blank line."""
    data = f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"
    return data if event is None else f"event: {event}\n{data}"


async def event_stream(sub: Submission, opening: Iterable[str], events_of: Callable[[int, SeqUpdate], Iterable[str]],
                       closing: Callable[[], Iterable[str]], failed: Callable[[APIError], str],
                       last: str | None = None) -> AsyncIterator[str]:
    """A streaming response's events: ``opening``, then ``events_of(index, update)`` for each
    engine update, then ``closing()`` once every choice is done, then ``last`` if any. An
    update carrying an error, or an event that cannot be made, ends the stream with
    ``failed(error)`` (the error names the request id; what failed goes to the log), then
    ``last``: the response has started, so a status can no longer say it. Whatever ends the
    stream early (an error, the client going away) aborts what is left of the submission."""
    try:
        try:
            for event in opening:
                yield event
            while not sub.done:
                idx, u = await sub.next()
                if u.error:
                    yield failed(failure(u.error, sub.request_id))
                    break
                for event in events_of(idx, u):
                    yield event
            else:
                for event in closing():
                    yield event
        except Exception as exc:  # an event that cannot be made: the client still gets an end
            yield failed(internal_error("a stream chunk failed", sub.request_id, exc))
        if last is not None:
            yield last
    finally:
        if not sub.done:
            sub.abort()


def sse_stream(sub: Submission, head: dict, usage: str,
               choice_of: Callable[[int, SeqUpdate], dict], opening: Iterable[dict] = ()) -> AsyncIterator[str]:
    """A completion's or a chat's events (``event_stream``).

    One chunk ``{**head, "choices": [choice]}`` per choice of ``opening``, then one per
    engine update with the choice ``choice_of(index, update)`` makes (with ``usage``
    "continuous", each with its choice's ``usage`` so far, as vLLM's continuous_usage_stats);
    then, with any ``usage``, the usage chunk of the whole request, and ``[DONE]``. An error
    ends the stream with an error chunk (no usage) and ``[DONE]``."""
    continuous = usage == "continuous"

    def chunk(choice: dict, idx: int) -> str:
        return sse({**head, "choices": [choice], **({"usage": sub.usage(idx)} if continuous else {})})

    def closing() -> list[str]:
        return [sse({**head, "choices": [], "usage": sub.usage()})] if usage else []

    return event_stream(sub, (chunk(choice, choice["index"]) for choice in opening),
                        lambda idx, u: [chunk(choice_of(idx, u), idx)], closing, error_event, sse(DONE))


def error_event(err: APIError) -> str:
    return sse(error_body(err.status, err.message, err.param))
