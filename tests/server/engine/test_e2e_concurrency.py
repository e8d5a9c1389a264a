"""64 concurrent streaming requests of mixed lengths, each with its greedy text when run alone."""

from __future__ import annotations

import asyncio
import json

import httpx

WORDS = ("the cat sat on a mat while seven birds sang about rivers and old stone bridges near "
         "the quiet harbour where boats rest until morning light returns again").split()

# eight (prompt, max_tokens) cases; the 64 requests cycle through them, so each is checked 8 times
CASES = [(" ".join(WORDS[: 2 + 3 * i]), 2 + (i * 3) % 5) for i in range(8)]


async def stream_text(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[str, str]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    text, finish = "", None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, (await r.aread()).decode()
        async for line in r.aiter_lines():
            if not line or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            text += chunk["choices"][0]["text"]
            finish = chunk["choices"][0]["finish_reason"] or finish
    return text, finish


def test_64_concurrent_streams_each_give_the_text_they_give_alone(client, real_server):
    alone = {}
    for prompt, max_tokens in CASES:
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                 "ignore_eos": True})
        alone[prompt] = r.json()["choices"][0]["text"]

    async def run_all():
        async with httpx.AsyncClient(base_url=real_server.url, timeout=900,
                                     limits=httpx.Limits(max_connections=100)) as c:
            jobs = [stream_text(c, *CASES[i % len(CASES)]) for i in range(64)]
            return await asyncio.gather(*jobs)

    results = asyncio.run(run_all())
    assert len(results) == 64
    for i, (text, finish) in enumerate(results):
        prompt, _ = CASES[i % len(CASES)]
        assert finish == "length"
        assert text == alone[prompt], f"request {i} ({prompt[:30]}...) differs from its run alone"
    engine = real_server.built.engine
    assert engine.blocks.num_free == engine.blocks.num_blocks
