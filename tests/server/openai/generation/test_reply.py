"""response.py: the envelope, the collected JSON body (499 and 500 included), the stream."""

from __future__ import annotations

import asyncio
import logging
import re

import pytest
from fastapi.responses import Response

from spyre_serve.server.openai.bridge import Submission
from spyre_serve.server.openai.errors import APIError
from spyre_serve.server.openai.generation.reply import full_response, new_head, stream_response
from tests.server.openai.fakes import RecordingEngine, update


def test_a_head_has_a_fresh_prefixed_id_the_object_the_time_the_model_and_the_fingerprint():
    a, b = (new_head("cmpl", "text_completion", "tiny", "fp") for _ in range(2))
    assert list(a) == ["id", "object", "created", "model", "system_fingerprint"]
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", a["id"]) and a["id"] != b["id"]
    assert (a["object"], a["model"], a["system_fingerprint"]) == ("text_completion", "tiny", "fp")
    assert isinstance(a["created"], int)


async def still_here() -> bool:
    return False


async def gone() -> bool:
    return True


def respond(updates, is_disconnected=still_here):
    async def main():
        engine = RecordingEngine()
        sub = Submission(engine, "r", [[1, 2]], ["a", "b"])
        for u in updates:
            engine.deliver["r-0"](u)
        return await full_response(sub, is_disconnected, {"id": "r"},
                                   lambda idx, c: {"index": idx, "text": c.text, "finish_reason": c.finish_reason})

    return asyncio.run(main())


def test_the_body_is_the_head_a_choice_per_choice_and_the_usage():
    body = respond([update(1, "b", [3], finish="length"), update(0, "a", [4, 5], finish="stop")])
    assert body == {
        "id": "r",
        "choices": [{"index": 0, "text": "a", "finish_reason": "stop"},
                    {"index": 1, "text": "b", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5},
    }


def test_a_client_gone_before_the_end_gets_499():
    r = respond([update(0, "a", [4])], is_disconnected=gone)
    assert isinstance(r, Response) and r.status_code == 499


def test_a_failed_choice_makes_the_response_a_500_naming_the_request_not_the_engines_message(caplog):
    with pytest.raises(APIError) as info, caplog.at_level(logging.ERROR, logger="spyre_serve.api"):
        respond([update(0, "", [], finish="error", error="OverflowError: device fault"),
                 update(1, "b", [3], finish="length")])
    assert info.value.status == 500
    assert info.value.message == "internal error (request id r): the server's log says what failed"
    assert any("OverflowError: device fault" in rec.getMessage() and "request id r" in rec.getMessage()
               for rec in caplog.records)


def test_a_stream_response_is_server_sent_events():
    async def main():
        sub = Submission(RecordingEngine(), "r", [[1]], ["a"])
        return stream_response(sub, {"id": "r"}, False, lambda idx, u: {})

    assert asyncio.run(main()).media_type == "text/event-stream"
