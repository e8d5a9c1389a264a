"""A storm on a real server in its own process: 200 requests at concurrency 64, of mixed
lengths, many of them dropped by their client mid-stream or mid-wait. Afterwards nothing
runs or waits, the KV cache and the runner hold nothing, no response was a 5xx, and the
server's RSS is within 5% of what it was after a warm-up storm."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter

import httpx

from tests.reliability.servers import server_process, wait_idle

WORDS = ("the river runs past the old mill where seven birds sang about stone bridges near the "
         "quiet harbour and boats rest until morning light returns to the hills").split()


def random_body(rng: random.Random) -> dict:
    """A random prompt and length."""
    return {"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 60))),
            "max_tokens": rng.randint(4, 96), "temperature": rng.choice([0, 0.8]), "ignore_eos": True}


async def one(client: httpx.AsyncClient, rng: random.Random, make_body=random_body) -> str:
    """One client: a request of ``make_body(rng)``; it streams to the end, streams and hangs up
    after a few chunks, waits for the whole body, or gives up waiting. Returns its outcome:
    the status, or 'left' when it hung up first."""
    body = make_body(rng)
    kind = rng.random()
    if kind < 0.6:                                      # stream; most hang up part way
        leave_after = rng.randint(1, 6) if kind < 0.45 else None
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            if r.status_code != 200:
                await r.aread()
                return str(r.status_code)
            chunks = 0
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    assert "error" not in json.loads(line[6:]), line
                    chunks += 1
                    if leave_after is not None and chunks >= leave_after:
                        return "left"                   # closing the response drops the connection
        return "200"
    try:
        timeout = httpx.Timeout(120, read=rng.uniform(0.05, 0.5)) if kind < 0.8 else httpx.Timeout(120)
        r = await client.post("/v1/completions", json=body, timeout=timeout)
        return str(r.status_code)
    except httpx.ReadTimeout:
        return "left"


async def storm(url: str, n: int, concurrency: int, seed: int, make_body=random_body) -> Counter:
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        async def guarded(i: int) -> str:
            async with gate:
                return await one(client, random.Random(rng.random() + i), make_body)

        return Counter(await asyncio.gather(*(guarded(i) for i in range(n))))


def test_a_storm_of_hang_ups_leaves_the_server_idle_and_its_memory_where_it_was():
    with server_process() as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        warm = asyncio.run(storm(srv.url, 128, 64, seed=1))   # every path once: pools, buffers
        wait_idle(http)
        rss_before = srv.rss_bytes()
        outcomes = asyncio.run(storm(srv.url, 200, 64, seed=2))
        idle = wait_idle(http)
        rss_after = srv.rss_bytes()
    assert not [k for k in (*warm, *outcomes) if k[0] == "5"], (warm, outcomes)
    assert outcomes["left"] >= 60 and outcomes["200"] >= 60, outcomes
    assert sum(outcomes.values()) == 200
    assert idle == {"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0,
                    "vllm:kv_cache_usage_perc": 0, "spyre_runner_held_sequences": 0}
    growth = rss_after / rss_before - 1
    assert growth <= 0.05, f"RSS {rss_before >> 20} -> {rss_after >> 20} MiB ({growth:+.1%})"
