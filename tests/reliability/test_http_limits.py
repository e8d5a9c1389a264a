"""Limits per sequence and per request on a real server: a body under --max-body-bytes that
asks for too much is a 400 naming the limit, a long prompt is tokenized off the event loop,
and a normal request beside them gives its solo text."""

from __future__ import annotations

import asyncio
import gc
import json
import time

import httpx
import pytest

from spyre_serve.server.openai.body import MAX_CONTAINERS
from tests.reliability.servers import beside
from tests.server.servers import real_settings

LIMITS = real_settings()  # what the server runs with
# (what, body, param, words the message ends with)
OVER = [
    ("one one-token prompt over the cap", {"prompt": [[5]] * (LIMITS.max_prompts + 1), "max_tokens": 1}, "prompt",
     f"the limit is {LIMITS.max_prompts} (--max-prompts)"),
    ("260k one-token prompts", {"prompt": [[5]] * 260_000, "max_tokens": 1}, None,
     f"260002 arrays and objects, over the limit of {MAX_CONTAINERS}"),     # refused before parsing
    ("too many stop strings", {"prompt": "x", "stop": [f"s{i}" for i in range(LIMITS.max_stop_strings + 1)]},
     "stop", f"the limit is {LIMITS.max_stop_strings} (--max-stop-strings)"),
    ("a stop string too long", {"prompt": "x", "stop": ["y" * (LIMITS.max_stop_length + 1)]}, "stop",
     f"the limit is {LIMITS.max_stop_length} (--max-stop-length)"),
    ("too many stop token ids", {"prompt": "x", "stop_token_ids": list(range(LIMITS.max_stop_token_ids + 1))},
     "stop_token_ids", f"the limit is {LIMITS.max_stop_token_ids} (--max-stop-token-ids)"),
    ("more sequences than the queue holds", {"prompt": [[5]] * 200, "n": 4}, "n",
     f"more than the {LIMITS.max_waiting} the waiting queue holds (--max-waiting)"),
]


@pytest.mark.parametrize(("what", "body", "param", "words"), OVER, ids=[o[0] for o in OVER])
def test_a_request_over_a_limit_is_a_400_naming_it(http, what, body, param, words):
    t0 = time.monotonic()
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].endswith(words), err["message"]
    assert time.monotonic() - t0 < 5  # refused before any tokenizing


def test_the_limits_hold_for_chat_too(http):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                "stop": ["z" * 1000]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"


def test_a_normal_request_beside_the_refused_ones_gives_its_solo_text(server, http, solo):
    async def over(client):
        return await asyncio.gather(*(client.post("/v1/completions", json=body) for _, body, _, _ in OVER))

    text, responses = beside(server, over)
    assert text == solo and [r.status_code for r in responses] == [400] * len(OVER)


def test_a_long_prompt_is_tokenized_off_the_event_loop(server, http):
    """A prompt of most of the body limit takes a second or more to tokenize: /health answers
    meanwhile. (Without truncate_prompt_tokens it is refused at once, for the characters the
    context could never hold; with it, it is tokenized, cut, and served.) The server shares this
    process with the suite's heap: collected and frozen first, so that a full collection of what
    ~2,000 tests left behind does not hold the loop instead (seen once: the first /health 1.0 s,
    the fourteen after it 44 ms)."""
    prompt = ("The quick brown fox jumps over the lazy dog. " * 23_000)[:1_000_000]
    health_seconds: list[float] = []

    async def tokenize_while_polling_health():
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
            body = json.dumps({"prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": 8}).encode()
            long = asyncio.create_task(client.post("/v1/completions", content=body,
                                                   headers={"content-type": "application/json"}))
            while not long.done():
                start = time.monotonic()
                assert (await client.get("/health")).status_code == 200
                health_seconds.append(time.monotonic() - start)
                await asyncio.sleep(0.02)
            return await long

    gc.collect()
    gc.freeze()
    try:
        r = asyncio.run(tokenize_while_polling_health())
    finally:
        gc.unfreeze()
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 8, r.text
    assert len(health_seconds) >= 3 and max(health_seconds) < 0.5, health_seconds
