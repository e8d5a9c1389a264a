"""sse.py: the event framing and the stream every generating endpoint sends."""

from __future__ import annotations

import asyncio
import json
import logging

from spyre_serve.server.openai.bridge import Submission
from spyre_serve.server.openai.generation.sse import sse, sse_stream
from tests.server.openai.fakes import RecordingEngine, update

HEAD = {"id": "x-1", "object": "chunk"}


def test_an_event_is_data_then_a_blank_line():
    assert sse({"a": [1, "é"]}) == 'data: {"a": [1, "\\u00e9"]}\n\n'
    assert sse("[DONE]") == "data: [DONE]\n\n"


def events(updates, include_usage=True, opening=(), take=None):
    """The stream's payloads for a one-prompt, two-choice submission fed ``updates``; with
    ``take``, the consumer stops after that many events. Also the aborted request ids."""

    async def main():
        engine = RecordingEngine()
        sub = Submission(engine, "x-1", [[5, 6]], ["a", "b"])
        for u in updates:
            engine.deliver["x-1-0"](u)
        out = []
        stream = sse_stream(sub, HEAD, include_usage, lambda idx, u: {"index": idx, "text": u.text}, opening)
        async for event in stream:
            assert event.startswith("data: ") and event.endswith("\n\n")
            data = event[len("data: "):-2]
            out.append(data if data == "[DONE]" else json.loads(data))
            if take is not None and len(out) == take:
                break
        await stream.aclose()
        return out, engine.aborted

    return asyncio.run(main())


FINISHED = [update(0, "a", [1]), update(1, "b", [2], finish="length"), update(0, "c", [3], finish="stop")]


def test_opening_chunks_then_a_chunk_per_update_then_usage_then_done():
    out, aborted = events(FINISHED, opening=[{"index": 0, "role": "assistant"}])
    assert out[0] == {**HEAD, "choices": [{"index": 0, "role": "assistant"}]}
    assert [c["choices"] for c in out[1:4]] == [[{"index": 0, "text": "a"}], [{"index": 1, "text": "b"}],
                                               [{"index": 0, "text": "c"}]]
    assert out[4] == {**HEAD, "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}
    assert out[5] == "[DONE]" and len(out) == 6 and aborted == []


def test_without_include_usage_the_last_chunk_is_followed_by_done():
    out, _ = events(FINISHED, include_usage=False)
    assert len(out) == 4 and out[-1] == "[DONE]" and "usage" not in out[-2]


def test_an_error_update_ends_the_stream_with_an_error_chunk_and_done_and_no_usage():
    out, aborted = events([update(0, "a", [1]), update(1, "", [], finish="error", error="KeyError: device fault")])
    assert out[1] == {"error": {"message": "internal error (request id x-1): the server's log says what failed",
                                "type": "InternalServerError", "param": None, "code": 500}}
    assert out[2:] == ["[DONE]"]
    assert set(aborted) == {"x-1-0"}  # choice 0 was still running


def test_a_chunk_that_cannot_be_made_ends_the_stream_with_an_error_chunk_and_done(caplog):
    def broken(idx, u):
        raise KeyError("secret")

    async def main():
        engine = RecordingEngine()
        sub = Submission(engine, "x-1", [[5]], ["a"])
        engine.deliver["x-1-0"](update(0, "a", [1]))
        return [e async for e in sse_stream(sub, HEAD, False, broken)], engine.aborted

    with caplog.at_level(logging.ERROR, logger="spyre_serve.api"):
        out, aborted = asyncio.run(main())
    assert json.loads(out[0][len("data: "):])["error"]["message"].startswith("internal error (request id x-1)")
    assert "secret" not in "".join(out) and out[-1] == "data: [DONE]\n\n"
    assert aborted == ["x-1-0"]
    assert any(rec.exc_info and rec.exc_info[0] is KeyError for rec in caplog.records)


def test_a_consumer_that_stops_early_aborts_the_submission():
    out, aborted = events([update(0, "a", [1])], take=1)
    assert len(out) == 1 and aborted == ["x-1-0"]
