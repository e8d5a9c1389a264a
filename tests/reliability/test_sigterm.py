"""SIGTERM under load, on a real server in its own process: every request accepted before the
signal completes in full, every request after it is a 503 (with Retry-After), and the process
exits 0 once the accepted ones are done."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx

from tests.reliability.servers import server_process

MAX_TOKENS = 48


async def stream(client: httpx.AsyncClient, i: int) -> tuple:
    body = {"prompt": f"Request number {i} tells the story of", "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    finish, usage = None, None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                usage = chunk.get("usage") or usage
                if chunk["choices"]:
                    finish = chunk["choices"][0]["finish_reason"] or finish
    return finish, usage


def test_sigterm_finishes_what_was_accepted_refuses_the_rest_and_exits_0():
    with server_process("--drain-timeout", "120") as srv:
        async def main():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
                streams = [asyncio.create_task(stream(client, i)) for i in range(12)]
                posts = [asyncio.create_task(client.post("/v1/completions", json={
                    "prompt": f"Plain request {i}", "max_tokens": MAX_TOKENS, "ignore_eos": True}))
                    for i in range(4)]
                deadline = time.monotonic() + 300
                while True:                              # all 16 in the engine, tokens flowing
                    m = (await client.get("/metrics")).text
                    queued = _sample(m, "vllm:num_requests_running") + _sample(m, "vllm:num_requests_waiting")
                    if queued >= 16 and _sample(m, "vllm:generation_tokens_total") > 0:
                        break
                    assert time.monotonic() < deadline, m
                    await asyncio.sleep(0.01)
                os.kill(srv.pid, signal.SIGTERM)
                t0 = time.monotonic()
                await asyncio.sleep(0.1)
                late = await asyncio.gather(*(client.post("/v1/completions", json={
                    "prompt": "too late", "max_tokens": 4}) for _ in range(4)))
                return await asyncio.gather(*streams), await asyncio.gather(*posts), late, t0

        streamed, posted, late, t0 = asyncio.run(main())
        code = srv.wait(120)
    assert all(f == "length" and u["completion_tokens"] == MAX_TOKENS for f, u in streamed), streamed
    for r in posted:
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS
    for r in late:
        assert r.status_code == 503 and "Retry-After" in r.headers, r.text
    assert code == 0
    assert time.monotonic() - t0 < 120


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rpartition(" ")[2])
    return 0.0
